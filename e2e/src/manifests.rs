//! The manifests under `deploy/` as documents: which file each came from, and its JSON.
//!
//! The kustomize base (`deploy/kustomization.yaml`) is read the way `crdgen` renders
//! `deploy/install.yaml`: its `resources` are plain files, and its `images` overrides apply
//! to every container image of the same name.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

/// Errors loading manifests.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// A file could not be read.
    #[error("failed to read {path}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file is not YAML, or not the shape expected of it.
    #[error("failed to parse {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What the parser said.
        message: String,
    },
    /// A document has no `apiVersion` or `kind`.
    #[error("{source_name}: document has no apiVersion or kind")]
    NotAnObject {
        /// File and document index.
        source_name: String,
    },
}

/// One YAML document of a manifest file.
#[derive(Clone, Debug)]
pub struct Document {
    /// `path#index`, the file relative to the repository root and the document's position.
    pub source: String,
    /// The document as JSON.
    pub value: Value,
}

impl Document {
    /// `apiVersion` of the object.
    pub fn api_version(&self) -> &str {
        self.value["apiVersion"].as_str().unwrap_or_default()
    }

    /// `kind` of the object.
    pub fn kind(&self) -> &str {
        self.value["kind"].as_str().unwrap_or_default()
    }

    /// `metadata.name` of the object.
    pub fn name(&self) -> &str {
        self.value["metadata"]["name"].as_str().unwrap_or_default()
    }

    /// `metadata.namespace` of the object, if namespaced.
    pub fn namespace(&self) -> Option<&str> {
        self.value["metadata"]["namespace"].as_str()
    }

    /// `kind/name` (with `namespace/` in front when namespaced), for messages.
    pub fn id(&self) -> String {
        match self.namespace() {
            Some(ns) => format!("{}/{ns}/{}", self.kind(), self.name()),
            None => format!("{}/{}", self.kind(), self.name()),
        }
    }
}

/// An `images:` override of a kustomization.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ImageOverride {
    /// Image name to replace (no tag).
    pub name: String,
    /// New image name.
    pub new_name: Option<String>,
    /// New tag.
    pub new_tag: Option<String>,
    /// New digest (wins over the tag).
    pub digest: Option<String>,
}

/// The plain kustomization this project's base is: resources and image overrides.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Kustomization {
    /// `kustomize.config.k8s.io/v1beta1` or `v1alpha1` (components).
    pub api_version: String,
    /// `Kustomization` or `Component`.
    pub kind: String,
    /// Files, in order.
    #[serde(default)]
    pub resources: Vec<String>,
    /// Image overrides.
    #[serde(default)]
    pub images: Vec<ImageOverride>,
    /// JSON 6902 / strategic-merge patches (components only).
    #[serde(default)]
    pub patches: Vec<Value>,
}

/// The repository root (the parent of this crate).
pub fn repo_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map_or_else(|| manifest_dir.to_path_buf(), Path::to_path_buf)
}

/// Reads `rel` (relative to the repository root) into its documents. Empty documents are
/// skipped, as kubectl skips them.
pub fn load_file(rel: &str) -> Result<Vec<Document>, ManifestError> {
    let path = repo_root().join(rel);
    let text = std::fs::read_to_string(&path).map_err(|source| ManifestError::Read {
        path: rel.to_string(),
        source,
    })?;
    parse_documents(rel, &text)
}

/// Parses YAML text with one or more documents.
pub fn parse_documents(source: &str, text: &str) -> Result<Vec<Document>, ManifestError> {
    let values: Vec<Value> =
        serde_saphyr::from_multiple(text).map_err(|e| ManifestError::Parse {
            path: source.to_string(),
            message: e.to_string(),
        })?;
    let mut docs = Vec::new();
    for (i, value) in values.into_iter().enumerate() {
        if value.is_null() {
            continue;
        }
        let doc = Document {
            source: format!("{source}#{i}"),
            value,
        };
        if doc.api_version().is_empty() || doc.kind().is_empty() {
            return Err(ManifestError::NotAnObject {
                source_name: doc.source,
            });
        }
        docs.push(doc);
    }
    Ok(docs)
}

/// Reads a kustomization file (relative to the repository root).
pub fn load_kustomization(rel: &str) -> Result<Kustomization, ManifestError> {
    let path = repo_root().join(rel);
    let text = std::fs::read_to_string(&path).map_err(|source| ManifestError::Read {
        path: rel.to_string(),
        source,
    })?;
    serde_saphyr::from_str(&text).map_err(|e| ManifestError::Parse {
        path: rel.to_string(),
        message: e.to_string(),
    })
}

/// Every object `kubectl apply -k deploy/` creates, in order, with image overrides applied.
pub fn load_base() -> Result<(Kustomization, Vec<Document>), ManifestError> {
    let kustomization = load_kustomization("deploy/kustomization.yaml")?;
    let mut docs = Vec::new();
    for resource in &kustomization.resources {
        for mut doc in load_file(&format!("deploy/{resource}"))? {
            for container in containers_mut(&mut doc.value) {
                if let Some(image) = container.get("image").and_then(Value::as_str) {
                    let new = apply_images(image, &kustomization.images);
                    container["image"] = Value::String(new);
                }
            }
            docs.push(doc);
        }
    }
    Ok((kustomization, docs))
}

/// The reference `image` becomes under `overrides` (unchanged when none names it).
pub fn apply_images(image: &str, overrides: &[ImageOverride]) -> String {
    let (name, tag, digest) = split_image(image);
    let Some(o) = overrides.iter().find(|o| o.name == name) else {
        return image.to_string();
    };
    let mut out = o.new_name.clone().unwrap_or_else(|| name.to_string());
    if let Some(d) = &o.digest {
        out = format!("{out}@{d}");
    } else {
        if let Some(t) = o.new_tag.as_deref().or(tag) {
            out = format!("{out}:{t}");
        }
        if let Some(d) = digest {
            out = format!("{out}@{d}");
        }
    }
    out
}

/// Splits an image reference into name, tag and digest.
pub fn split_image(image: &str) -> (&str, Option<&str>, Option<&str>) {
    let (rest, digest) = match image.split_once('@') {
        Some((rest, digest)) => (rest, Some(digest)),
        None => (image, None),
    };
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

/// The pod spec of a workload document (Deployment, DaemonSet, ... or Pod), if it has one.
pub fn pod_spec(value: &Value) -> Option<&Value> {
    match value["kind"].as_str()? {
        "Pod" => value.get("spec"),
        "CronJob" => value.pointer("/spec/jobTemplate/spec/template/spec"),
        "Deployment" | "DaemonSet" | "StatefulSet" | "ReplicaSet" | "Job" => {
            value.pointer("/spec/template/spec")
        }
        _ => None,
    }
}

/// Every container (init and regular) of a workload document, mutably.
pub fn containers_mut(value: &mut Value) -> Vec<&mut Value> {
    let pointer = match value["kind"].as_str() {
        Some("Pod") => "/spec",
        Some("CronJob") => "/spec/jobTemplate/spec/template/spec",
        Some("Deployment" | "DaemonSet" | "StatefulSet" | "ReplicaSet" | "Job") => {
            "/spec/template/spec"
        }
        _ => return Vec::new(),
    };
    let Some(spec) = value.pointer_mut(pointer).and_then(Value::as_object_mut) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (key, list) in spec.iter_mut() {
        if (key == "containers" || key == "initContainers")
            && let Some(list) = list.as_array_mut()
        {
            out.extend(list.iter_mut());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_replace_name_and_tag() {
        let o = [ImageOverride {
            name: "ghcr.io/a/b".into(),
            new_name: Some("reg:5000/b".into()),
            new_tag: Some("2".into()),
            digest: None,
        }];
        assert_eq!(apply_images("ghcr.io/a/b:1", &o), "reg:5000/b:2");
        assert_eq!(apply_images("ghcr.io/a/c:1", &o), "ghcr.io/a/c:1");
        assert_eq!(split_image("reg:5000/b"), ("reg:5000/b", None, None));
    }

    #[test]
    fn documents_without_kind_are_refused() {
        assert!(parse_documents("x", "apiVersion: v1\nkind: A\n---\nfoo: 1\n").is_err());
        let docs = parse_documents("x", "# c\n---\napiVersion: v1\nkind: A\n---\n").unwrap();
        assert_eq!(docs.len(), 1);
        assert_eq!(docs[0].source, "x#0");
    }
}
