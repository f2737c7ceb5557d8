//! The shell blocks of the README and of the pages under `docs/`, read by the tests that run
//! them as written.
//!
//! A section is found by its heading's text at any level (`# On DRA clusters` heads a page,
//! `## Upgrade` a section of one) and runs to the next heading of the same or a higher level;
//! lines inside code fences are never headings (`# kind` in an sh block is a comment).

use crate::manifests::repo_root;

/// The page of operating tasks: Upgrade, "When the webhook is down", Metrics.
pub const OPERATIONS: &str = "docs/operations.md";
/// The page of the pre-flight, "Before you install: what would change".
pub const PREFLIGHT: &str = "docs/preflight.md";
/// The Troubleshooting page.
pub const TROUBLESHOOTING: &str = "docs/troubleshooting.md";

/// The text of `page`, a path relative to the repository root.
fn read(page: &str) -> String {
    std::fs::read_to_string(repo_root().join(page)).unwrap_or_else(|e| panic!("{page}: {e}"))
}

/// The level of a Markdown heading line (`## X` is 2) and its text, or `None`.
fn heading(line: &str) -> Option<(usize, &str)> {
    let level = line.bytes().take_while(|&b| b == b'#').count();
    let text = line.get(level..)?.strip_prefix(' ')?;
    (1..=6).contains(&level).then_some((level, text.trim_end()))
}

/// Whether `line` opens or closes a code fence (also one indented in a list item).
fn is_fence(line: &str) -> bool {
    line.trim_start().starts_with("```")
}

/// The lines of `text` under the heading whose text is `heading_text` (any level), to the
/// next heading of the same or a higher level, without the heading line itself.
fn section_of<'a>(text: &'a str, heading_text: &str) -> Option<Vec<&'a str>> {
    let mut in_fence = false;
    let mut found: Option<(usize, Vec<&str>)> = None;
    for line in text.lines() {
        let this = if in_fence { None } else { heading(line) };
        if is_fence(line) {
            in_fence = !in_fence;
        }
        match (&mut found, this) {
            (Some((level, _)), Some((l, _))) if l <= *level => break,
            (Some((_, lines)), _) => lines.push(line),
            (None, Some((l, t))) if t == heading_text => found = Some((l, Vec::new())),
            (None, _) => {}
        }
    }
    found.map(|(_, lines)| lines)
}

/// The section `heading` of `page` (a path relative to the repository root), to the next
/// heading of the same or a higher level, without its heading line.
pub fn doc_section(page: &str, heading: &str) -> String {
    let text = read(page);
    let lines =
        section_of(&text, heading).unwrap_or_else(|| panic!("{page} has no section {heading}"));
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

/// The lines of the first `sh` block in `lines`, its fence's indentation taken off each;
/// `what` names it in the panic.
fn first_sh_block(lines: &[&str], what: &str) -> Vec<String> {
    let start = lines
        .iter()
        .position(|l| l.trim() == "```sh")
        .unwrap_or_else(|| panic!("{what} has no sh block"));
    let indent = lines[start].len() - lines[start].trim_start().len();
    let body = &lines[start + 1..];
    let end = body
        .iter()
        .position(|l| l.trim() == "```")
        .unwrap_or_else(|| panic!("{what}: its sh block is not closed"));
    body[..end]
        .iter()
        .map(|l| {
            let spaces = l.len() - l.trim_start_matches(' ').len();
            l[spaces.min(indent)..].to_owned()
        })
        .collect()
}

/// The lines of the first `sh` block in the section `heading` of `page`.
pub fn doc_block(page: &str, heading: &str) -> Vec<String> {
    let text = read(page);
    let section =
        section_of(&text, heading).unwrap_or_else(|| panic!("{page} has no section {heading}"));
    first_sh_block(&section, &format!("{page}, section {heading},"))
}

/// The lines of the first `sh` block in the subsection `subheading` of the section
/// `heading` of `page`.
pub fn doc_block_in(page: &str, heading: &str, subheading: &str) -> Vec<String> {
    let text = read(page);
    let section =
        section_of(&text, heading).unwrap_or_else(|| panic!("{page} has no section {heading}"));
    let section = section.join("\n");
    let sub = section_of(&section, subheading)
        .unwrap_or_else(|| panic!("{page}, section {heading}, has no subsection {subheading}"));
    first_sh_block(&sub, &format!("{page}, {heading} / {subheading},"))
}

/// The lines of the first `sh` block in the section `## {heading}` of the README.
pub fn readme_block(heading: &str) -> Vec<String> {
    doc_block("README.md", heading)
}

/// The lines of the first `sh` block under `### {subheading}` within the section
/// `## {heading}` of the README.
pub fn readme_block_in(heading: &str, subheading: &str) -> Vec<String> {
    doc_block_in("README.md", heading, subheading)
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

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "# Page\n\nintro\n\n## One\n\n```sh\n# not a heading\necho one\n```\n\n### Sub\n\ntext\n\n   ```sh\n   echo sub\n     indented\n   ```\n\n## Two\n\n```sh\necho two\n```\n";

    #[test]
    fn sections_end_at_a_heading_of_their_level_and_skip_code() {
        let one = section_of(PAGE, "One").unwrap().join("\n");
        assert!(
            one.contains("# not a heading") && one.contains("### Sub"),
            "{one}"
        );
        assert!(!one.contains("echo two"), "{one}");
        let page = section_of(PAGE, "Page").unwrap().join("\n");
        assert!(page.contains("echo two"), "{page}");
        assert_eq!(section_of(PAGE, "not a heading"), None);
        let sub = section_of(&one, "Sub").unwrap();
        assert_eq!(first_sh_block(&sub, "sub"), ["echo sub", "  indented"]);
        let two = section_of(PAGE, "Two").unwrap();
        assert_eq!(first_sh_block(&two, "two"), ["echo two"]);
    }

    /// The blocks the cluster tests (ignored without one) read, found where those tests
    /// look for them, so a heading renamed or a block moved fails here and not only on a
    /// cluster. `install.rs` and `in_cluster.rs` check the README's manifests blocks
    /// without a cluster already.
    #[test]
    fn every_block_the_cluster_tests_read_is_found() {
        // helm.rs: install, upgrade and uninstall with Helm, and the upgrade of a release
        // installed the old way, each block holding its command.
        for (block, command) in [
            (readme_block_in("Install", "With Helm"), "helm install "),
            (
                doc_block_in(OPERATIONS, "Upgrade", "With Helm"),
                "helm upgrade ",
            ),
            (readme_block_in("Uninstall", "With Helm"), "helm uninstall "),
            (
                doc_block_in(
                    OPERATIONS,
                    "Upgrade",
                    "A release installed into kube-system",
                ),
                "helm upgrade gpuwarden deploy/helm/gpuwarden --namespace kube-system ",
            ),
        ] {
            let found = statements(&block);
            assert!(
                found.iter().any(|s| s.starts_with(command)),
                "no `{command}` in {found:?}"
            );
        }
        // in_cluster.rs: the restore of "When the webhook is down".
        let down = doc_section(OPERATIONS, "When the webhook is down");
        assert!(
            down.contains("`kubectl apply --server-side -k <your-overlay>`"),
            "{down}"
        );
        assert_eq!(
            statements(&doc_block(OPERATIONS, "When the webhook is down")),
            [format!(
                "kubectl delete mutatingwebhookconfiguration {}",
                gpuwarden_crds::install::MUTATING_WEBHOOK_CONFIGURATION
            )]
        );
        // preflight.rs: the pre-flight, which writes cluster.yaml and runs mutate on it.
        let preflight = doc_block(PREFLIGHT, "Before you install: what would change");
        assert!(
            (preflight.iter()).any(|l| l.contains("mutate -f cluster.yaml -o diff")),
            "{preflight:?}"
        );
    }
}
