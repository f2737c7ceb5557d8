//! Writes the generated files under `deploy/`: the CRDs and the default policy (from the
//! types), then `deploy/install.yaml` (the kustomize base rendered into one file).
//!
//! `cargo run -p gpuwarden-crds --bin crdgen` from anywhere in the repository; `--check`
//! exits non-zero when a file is out of date instead of writing it.
//!
//! install.yaml is rendered without kustomize: the base's `resources` (plain files) are
//! concatenated in order, verbatim with their comments, and the `images` overrides are
//! applied to `image:` lines. Anything else in the kustomization is refused, so the file
//! can never silently differ from what `kubectl apply -k deploy/` installs.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;

use serde::Deserialize;

/// Path of the rendered install manifest, relative to the repository root.
const INSTALL_YAML: &str = "deploy/install.yaml";
/// Path of the kustomize base it is rendered from.
const KUSTOMIZATION: &str = "deploy/kustomization.yaml";

const INSTALL_HEADER: &str = "# gpuwarden: every object of the kustomize base deploy/kustomization.yaml, in one file.\n# Rendered by `cargo run -p gpuwarden-crds --bin crdgen`; do not edit by hand.\n# Install: kubectl apply -f deploy/install.yaml (or kubectl apply -k deploy/).\n";

fn main() -> ExitCode {
    let check = std::env::args().any(|a| a == "--check");
    let Some(root) = Path::new(env!("CARGO_MANIFEST_DIR")).parent() else {
        eprintln!("the crds crate must live inside the workspace");
        return ExitCode::FAILURE;
    };
    let mut files: Vec<(String, String)> = gpuwarden_crds::manifests::generated_files()
        .into_iter()
        .map(|f| (f.path.to_string(), f.content))
        .collect();
    match render_install(root, &files) {
        Ok(install) => files.push((INSTALL_YAML.to_string(), install)),
        Err(e) => {
            eprintln!("failed to render {INSTALL_YAML}: {e}");
            return ExitCode::FAILURE;
        }
    }

    let mut stale = false;
    for (rel, content) in &files {
        let path = root.join(rel);
        let current = std::fs::read_to_string(&path).ok();
        if current.as_deref() == Some(content.as_str()) {
            continue;
        }
        if check {
            eprintln!("{rel} is out of date; run `cargo run -p gpuwarden-crds --bin crdgen`");
            stale = true;
            continue;
        }
        if let Some(dir) = path.parent()
            && let Err(e) = std::fs::create_dir_all(dir)
        {
            eprintln!("failed to create {}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
        if let Err(e) = std::fs::write(&path, content) {
            eprintln!("failed to write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("wrote {rel}");
    }
    if stale {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// The part of a kustomization this renderer understands.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Kustomization {
    #[serde(rename = "apiVersion")]
    _api_version: String,
    #[serde(rename = "kind")]
    _kind: String,
    resources: Vec<String>,
    #[serde(default)]
    images: Vec<ImageOverride>,
}

/// One entry of `images:`: which image to replace and with what.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ImageOverride {
    name: String,
    new_name: Option<String>,
    new_tag: Option<String>,
    digest: Option<String>,
}

impl ImageOverride {
    /// The reference `image` becomes, or `None` when the override does not apply to it.
    fn apply(&self, image: &str) -> Option<String> {
        let (name, tag, digest) = split_image(image);
        if name != self.name {
            return None;
        }
        let mut out = self.new_name.clone().unwrap_or_else(|| name.to_string());
        if let Some(digest) = &self.digest {
            out.push('@');
            out.push_str(digest);
        } else if let Some(tag) = self.new_tag.as_deref().or(tag) {
            out.push(':');
            out.push_str(tag);
            if let Some(d) = digest {
                out.push('@');
                out.push_str(d);
            }
        } else if let Some(d) = digest {
            out.push('@');
            out.push_str(d);
        }
        Some(out)
    }
}

/// Splits an image reference into name, tag and digest (`registry:5000/a/b:tag@sha256:..`).
fn split_image(image: &str) -> (&str, Option<&str>, Option<&str>) {
    let (rest, digest) = match image.split_once('@') {
        Some((rest, digest)) => (rest, Some(digest)),
        None => (image, None),
    };
    // A colon after the last slash separates the tag; one before it is a registry port.
    let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
    match rest[last_slash..].rfind(':') {
        Some(i) => (
            &rest[..last_slash + i],
            Some(&rest[last_slash + i + 1..]),
            digest,
        ),
        None => (rest, None, digest),
    }
}

/// Renders install.yaml from the kustomization under `root`. Files in `generated` (path,
/// content) are taken from memory, so `--check` compares against freshly generated CRDs.
fn render_install(root: &Path, generated: &[(String, String)]) -> Result<String, String> {
    let text = std::fs::read_to_string(root.join(KUSTOMIZATION))
        .map_err(|e| format!("failed to read {KUSTOMIZATION}: {e}"))?;
    let kustomization: Kustomization = serde_saphyr::from_str(&text)
        .map_err(|e| format!("{KUSTOMIZATION} is not a plain list of resources and images: {e}"))?;
    let generated: BTreeMap<&str, &str> = generated
        .iter()
        .map(|(p, c)| (p.as_str(), c.as_str()))
        .collect();

    let mut out = String::from(INSTALL_HEADER);
    for resource in &kustomization.resources {
        if resource.contains("://") || resource.starts_with('/') || resource.contains("..") {
            return Err(format!(
                "{KUSTOMIZATION}: resource {resource} is not a file inside deploy/"
            ));
        }
        let rel = format!("deploy/{resource}");
        let content = match generated.get(rel.as_str()) {
            Some(content) => (*content).to_string(),
            None => {
                let path = root.join(&rel);
                if path.is_dir() {
                    return Err(format!(
                        "{KUSTOMIZATION}: resource {resource} is a directory; list its files"
                    ));
                }
                std::fs::read_to_string(&path).map_err(|e| format!("failed to read {rel}: {e}"))?
            }
        };
        out.push_str("---\n# Source: ");
        out.push_str(&rel);
        out.push('\n');
        for line in strip_leading_separator(&content).lines() {
            out.push_str(&override_image_line(line, &kustomization.images));
            out.push('\n');
        }
    }
    Ok(out)
}

/// Drops the first `---` of a file when only comments precede it, so the rendered file has
/// no empty documents.
fn strip_leading_separator(content: &str) -> String {
    let mut lines: Vec<&str> = content.lines().collect();
    if let Some(i) = lines
        .iter()
        .position(|l| !(l.trim().is_empty() || l.trim_start().starts_with('#')))
        && lines[i].trim_end() == "---"
    {
        lines.remove(i);
    }
    lines.join("\n")
}

/// Applies the `images:` overrides to a line `image: NAME` or `- image: NAME`.
fn override_image_line(line: &str, images: &[ImageOverride]) -> String {
    let trimmed = line.trim_start();
    let key_start = line.len() - trimmed.len();
    let after_dash = trimmed.strip_prefix("- ").unwrap_or(trimmed);
    let Some(value) = after_dash.strip_prefix("image:") else {
        return line.to_string();
    };
    let prefix_len = key_start + (trimmed.len() - after_dash.len()) + "image:".len();
    let image = value.trim().trim_matches(|c| c == '"' || c == '\'');
    for o in images {
        if let Some(new) = o.apply(image) {
            return format!("{} {new}", &line[..prefix_len]);
        }
    }
    line.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn over(name: &str, new_name: Option<&str>, tag: Option<&str>) -> ImageOverride {
        ImageOverride {
            name: name.into(),
            new_name: new_name.map(Into::into),
            new_tag: tag.map(Into::into),
            digest: None,
        }
    }

    #[test]
    fn image_references_split_at_tag_not_registry_port() {
        assert_eq!(split_image("a/b:1"), ("a/b", Some("1"), None));
        assert_eq!(split_image("reg:5000/a/b"), ("reg:5000/a/b", None, None));
        assert_eq!(
            split_image("reg:5000/a@sha256:ab"),
            ("reg:5000/a", None, Some("sha256:ab"))
        );
    }

    #[test]
    fn image_lines_are_rewritten_keeping_indentation() {
        let o = [over("ghcr.io/x/y", Some("reg.example/y"), Some("2"))];
        assert_eq!(
            override_image_line("          image: ghcr.io/x/y:1", &o),
            "          image: reg.example/y:2"
        );
        assert_eq!(
            override_image_line("  - image: \"ghcr.io/x/y\"", &o),
            "  - image: reg.example/y:2"
        );
        assert_eq!(
            override_image_line("  image: ghcr.io/x/other:1", &o),
            "  image: ghcr.io/x/other:1"
        );
        assert_eq!(
            override_image_line("  imagePullPolicy: x", &o),
            "  imagePullPolicy: x"
        );
    }

    #[test]
    fn leading_separator_after_comments_is_dropped() {
        assert_eq!(strip_leading_separator("# a\n---\nkind: X"), "# a\nkind: X");
        assert_eq!(
            strip_leading_separator("kind: X\n---\nkind: Y"),
            "kind: X\n---\nkind: Y"
        );
    }
}
