//! The README's shell blocks, read by the tests that run them as written.

use crate::manifests::repo_root;

/// The README from the line after its heading `## {heading}` on.
fn from_section(heading: &str) -> String {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    readme
        .split_once(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("README has no section {heading}"))
        .1
        .to_owned()
}

/// The lines of the first `sh` block in `text`; `what` names it in the panic.
fn first_sh_block(text: &str, what: &str) -> Vec<String> {
    let block = text
        .split_once("```sh\n")
        .and_then(|(_, rest)| rest.split_once("\n```"))
        .unwrap_or_else(|| panic!("README {what} has no sh block"))
        .0;
    block.lines().map(str::to_owned).collect()
}

/// The lines of the first `sh` block under the heading `## {heading}` of the README.
pub fn readme_block(heading: &str) -> Vec<String> {
    first_sh_block(&from_section(heading), &format!("section {heading}"))
}

/// The lines of the first `sh` block under `### {subheading}` within the section
/// `## {heading}` of the README.
pub fn readme_block_in(heading: &str, subheading: &str) -> Vec<String> {
    let rest = from_section(heading);
    let section = rest.split("\n## ").next().unwrap_or_default();
    let sub = section
        .split_once(&format!("\n### {subheading}\n"))
        .unwrap_or_else(|| panic!("README section {heading} has no subsection {subheading}"))
        .1;
    first_sh_block(sub, &format!("{heading} / {subheading}"))
}

/// The statements of a README block: each line, and a `for` loop with its body as one.
pub fn statements(lines: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut in_loop = false;
    for line in lines {
        if in_loop {
            let last = out.last_mut().expect("the loop's first line");
            last.push('\n');
            last.push_str(line);
            in_loop = line.trim() != "done";
        } else if !line.trim().is_empty() {
            in_loop = line.trim_start().starts_with("for ");
            out.push(line.clone());
        }
    }
    out
}
