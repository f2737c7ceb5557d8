//! The README's shell blocks, read by the tests that run them as written.

use crate::manifests::repo_root;

/// The lines of the first `sh` block under the heading `## {heading}` of the README.
pub fn readme_block(heading: &str) -> Vec<String> {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let section = readme
        .split_once(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("README has no section {heading}"))
        .1;
    let block = section
        .split_once("```sh\n")
        .and_then(|(_, rest)| rest.split_once("\n```"))
        .unwrap_or_else(|| panic!("README section {heading} has no sh block"))
        .0;
    block.lines().map(str::to_owned).collect()
}

/// The lines of the first `sh` block under `### {subheading}` within the section
/// `## {heading}` of the README.
pub fn readme_block_in(heading: &str, subheading: &str) -> Vec<String> {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let section = readme
        .split_once(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("README has no section {heading}"))
        .1;
    let section = section.split("\n## ").next().unwrap_or_default();
    let sub = section
        .split_once(&format!("\n### {subheading}\n"))
        .unwrap_or_else(|| panic!("README section {heading} has no subsection {subheading}"))
        .1;
    let block = sub
        .split_once("```sh\n")
        .and_then(|(_, rest)| rest.split_once("\n```"))
        .unwrap_or_else(|| panic!("README {heading} / {subheading} has no sh block"))
        .0;
    block.lines().map(str::to_owned).collect()
}
