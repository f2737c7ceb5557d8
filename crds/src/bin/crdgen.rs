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
//!
//! The Helm chart (`deploy/helm/gpuwarden`) is fed from the same files: its `crds/` are the
//! generated CRDs, and `files/base/` and `files/components/` hold every other file of the
//! base and the components' plain objects, as install.yaml has them. The chart's templates
//! only read and patch those, so a change to `deploy/` reaches the chart here, and `--check`
//! also names a file under those directories that nothing generates any more.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;

use serde::Deserialize;

/// Path of the rendered install manifest, relative to the repository root.
const INSTALL_YAML: &str = "deploy/install.yaml";
/// Path of the kustomize base it is rendered from.
const KUSTOMIZATION: &str = "deploy/kustomization.yaml";
/// The Helm chart, relative to the repository root.
const CHART: &str = "deploy/helm/gpuwarden";
/// The chart's directories crdgen owns: every file in them is generated.
const CHART_GENERATED_DIRS: [&str; 3] = ["crds", "files/base", "files/components"];
/// Plain objects of the kustomize components the chart switches on by value (the
/// components' patches are the chart's templates).
const CHART_COMPONENT_FILES: [&str; 3] = [
    "components/taint-unhealthy-nodes/rbac.yaml",
    "components/monitoring/podmonitor.yaml",
    "components/monitoring/dashboard.yaml",
];

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
    let chart = match render_chart(root, &files) {
        Ok(chart) => chart,
        Err(e) => {
            eprintln!("failed to render the chart's files under {CHART}: {e}");
            return ExitCode::FAILURE;
        }
    };
    match render_install(root, &files) {
        Ok(install) => files.push((INSTALL_YAML.to_string(), install)),
        Err(e) => {
            eprintln!("failed to render {INSTALL_YAML}: {e}");
            return ExitCode::FAILURE;
        }
    }
    files.extend(chart);

    let mut stale = false;
    for rel in orphans(root, &files) {
        if check {
            eprintln!(
                "{rel} is generated from nothing any more; run `cargo run -p gpuwarden-crds --bin crdgen`"
            );
            stale = true;
        } else if let Err(e) = std::fs::remove_file(root.join(&rel)) {
            eprintln!("failed to remove {rel}: {e}");
            return ExitCode::FAILURE;
        } else {
            println!("removed {rel}");
        }
    }
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

/// Reads the kustomization under `root`.
fn read_kustomization(root: &Path) -> Result<Kustomization, String> {
    let text = std::fs::read_to_string(root.join(KUSTOMIZATION))
        .map_err(|e| format!("failed to read {KUSTOMIZATION}: {e}"))?;
    serde_saphyr::from_str(&text)
        .map_err(|e| format!("{KUSTOMIZATION} is not a plain list of resources and images: {e}"))
}

/// The content of `deploy/<resource>`: from `generated` where crdgen makes it, else read.
fn resource_content(
    root: &Path,
    resource: &str,
    generated: &BTreeMap<&str, &str>,
) -> Result<String, String> {
    if resource.contains("://") || resource.starts_with('/') || resource.contains("..") {
        return Err(format!(
            "{KUSTOMIZATION}: resource {resource} is not a file inside deploy/"
        ));
    }
    let rel = format!("deploy/{resource}");
    if let Some(content) = generated.get(rel.as_str()) {
        return Ok((*content).to_string());
    }
    let path = root.join(&rel);
    if path.is_dir() {
        return Err(format!(
            "{KUSTOMIZATION}: resource {resource} is a directory; list its files"
        ));
    }
    std::fs::read_to_string(&path).map_err(|e| format!("failed to read {rel}: {e}"))
}

/// `content` with the kustomization's image overrides applied to its `image:` lines.
fn with_images(content: &str, images: &[ImageOverride]) -> String {
    let mut out = String::new();
    for line in content.lines() {
        out.push_str(&override_image_line(line, images));
        out.push('\n');
    }
    out
}

/// The chart's generated files (path, content): the CRDs under `crds/`, every other resource
/// of the base under `files/base/` and the components' objects under `files/components/`,
/// each with the base's image overrides applied and a header naming its source.
fn render_chart(
    root: &Path,
    generated: &[(String, String)],
) -> Result<Vec<(String, String)>, String> {
    let kustomization = read_kustomization(root)?;
    let generated: BTreeMap<&str, &str> = generated
        .iter()
        .map(|(p, c)| (p.as_str(), c.as_str()))
        .collect();
    let mut out = Vec::new();
    for resource in &kustomization.resources {
        let content = resource_content(root, resource, &generated)?;
        let target = match resource.strip_prefix("crds/") {
            Some(crd) => format!("{CHART}/crds/{crd}"),
            None => format!("{CHART}/files/base/{resource}"),
        };
        out.push((
            target,
            chart_file(resource, &content, &kustomization.images),
        ));
    }
    for component in CHART_COMPONENT_FILES {
        let content = resource_content(root, component, &generated)?;
        out.push((
            format!("{CHART}/files/{component}"),
            chart_file(component, &content, &kustomization.images),
        ));
    }
    Ok(out)
}

/// A chart file copied from `deploy/<resource>`.
fn chart_file(resource: &str, content: &str, images: &[ImageOverride]) -> String {
    format!(
        "# Copied from deploy/{resource} by `cargo run -p gpuwarden-crds --bin crdgen`; do not edit.\n{}",
        with_images(content, images)
    )
}

/// Files in the chart's generated directories that crdgen no longer writes.
fn orphans(root: &Path, files: &[(String, String)]) -> Vec<String> {
    let mut found = Vec::new();
    for dir in CHART_GENERATED_DIRS {
        collect_files(root, &format!("{CHART}/{dir}"), &mut found);
    }
    found
        .into_iter()
        .filter(|rel| !files.iter().any(|(p, _)| p == rel))
        .collect()
}

/// Every file under `rel` (relative to `root`), recursively; nothing where it is absent.
fn collect_files(root: &Path, rel: &str, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(root.join(rel)) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let child = format!("{rel}/{name}");
        if entry.path().is_dir() {
            collect_files(root, &child, out);
        } else {
            out.push(child);
        }
    }
}

/// Renders install.yaml from the kustomization under `root`. Files in `generated` (path,
/// content) are taken from memory, so `--check` compares against freshly generated CRDs.
fn render_install(root: &Path, generated: &[(String, String)]) -> Result<String, String> {
    let kustomization = read_kustomization(root)?;
    let generated: BTreeMap<&str, &str> = generated
        .iter()
        .map(|(p, c)| (p.as_str(), c.as_str()))
        .collect();

    let mut out = String::from(INSTALL_HEADER);
    for resource in &kustomization.resources {
        let content = resource_content(root, resource, &generated)?;
        out.push_str("---\n# Source: deploy/");
        out.push_str(resource);
        out.push('\n');
        out.push_str(&with_images(
            &strip_leading_separator(&content),
            &kustomization.images,
        ));
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
