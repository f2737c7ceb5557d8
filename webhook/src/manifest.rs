//! Reading Kubernetes manifests for the offline engine: files, directories or stdin holding
//! multi-document YAML or JSON (an object or a `List`), and finding the pod template inside
//! each workload.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// A manifest that could not be read, naming the file, the document and the reason.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The file or directory could not be read.
    #[error("{path}: failed to read: {source}")]
    Read {
        /// The path as given.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not UTF-8 text.
    #[error("{path}: not UTF-8 text")]
    NotText {
        /// The path as given.
        path: String,
    },
    /// A YAML document does not parse.
    #[error("{path}: document {index} (line {line}): invalid YAML: {message}")]
    Yaml {
        /// The path as given.
        path: String,
        /// 1-based index among the file's non-empty documents.
        index: usize,
        /// 1-based line the document starts on.
        line: usize,
        /// The parser's message.
        message: String,
    },
    /// The JSON does not parse.
    #[error("{path}: invalid JSON: {message}")]
    Json {
        /// The path as given.
        path: String,
        /// The parser's message.
        message: String,
    },
    /// A document parses but is not a Kubernetes object.
    #[error("{path}: document {index} (line {line}): {problem}")]
    NotAnObject {
        /// The path as given.
        path: String,
        /// 1-based document index.
        index: usize,
        /// 1-based line the document starts on (1 for JSON).
        line: usize,
        /// What is wrong.
        problem: String,
    },
}

/// One Kubernetes object read from a manifest.
#[derive(Clone, Debug, PartialEq)]
pub struct Document {
    /// Where it came from (`-` for stdin).
    pub source: String,
    /// 1-based index among the source's documents (items of a `List` are numbered in order).
    pub index: usize,
    /// 1-based line the document starts on.
    pub line: usize,
    /// The object.
    pub object: Value,
}

impl Document {
    /// `kind`, or `""`.
    pub fn kind(&self) -> &str {
        self.object
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or("")
    }

    /// `metadata.name` (or `generateName` followed by `*`), or `<unnamed>`.
    pub fn name(&self) -> String {
        let meta = self.object.get("metadata");
        if let Some(name) = meta.and_then(|m| m.get("name")).and_then(Value::as_str) {
            return name.to_owned();
        }
        if let Some(g) = meta
            .and_then(|m| m.get("generateName"))
            .and_then(Value::as_str)
        {
            return format!("{g}*");
        }
        "<unnamed>".to_owned()
    }

    /// `metadata.namespace`, if set.
    pub fn namespace(&self) -> Option<&str> {
        self.object
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
    }
}

/// One file to read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputFile {
    /// The path (`-` for stdin).
    pub path: String,
    /// Found by listing a directory (rather than named on the command line).
    pub from_directory: bool,
}

/// Expands the `-f` arguments: `-` is stdin, a directory is its `*.yaml`, `*.yml` and
/// `*.json` files in name order (not recursive), anything else is a file.
pub fn expand_inputs(inputs: &[String]) -> Result<Vec<InputFile>, ManifestError> {
    let mut out = Vec::new();
    for input in inputs {
        let path = Path::new(input);
        if input != "-" && path.is_dir() {
            let entries = std::fs::read_dir(path).map_err(|source| ManifestError::Read {
                path: input.clone(),
                source,
            })?;
            let mut files: Vec<PathBuf> = Vec::new();
            for entry in entries {
                let entry = entry.map_err(|source| ManifestError::Read {
                    path: input.clone(),
                    source,
                })?;
                let p = entry.path();
                let manifest = p
                    .extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"));
                if manifest && p.is_file() {
                    files.push(p);
                }
            }
            files.sort();
            out.extend(files.into_iter().map(|p| InputFile {
                path: p.display().to_string(),
                from_directory: true,
            }));
        } else {
            out.push(InputFile {
                path: input.clone(),
                from_directory: false,
            });
        }
    }
    Ok(out)
}

/// Whether `text` looks like Kubernetes manifests at all: some document has a top-level
/// `kind`. A directory may hold other YAML (such as a node agent's fake GPU inventory); those
/// files are skipped rather than reported as broken manifests.
pub fn looks_like_kubernetes(text: &str) -> bool {
    text.lines()
        .any(|l| l.starts_with("kind:") || l.starts_with("\"kind\":") || l.contains("\"kind\""))
}

/// Reads a file (or stdin for `-`) as text.
pub fn read_source(path: &str, stdin: &mut dyn std::io::Read) -> Result<String, ManifestError> {
    let bytes = if path == "-" {
        let mut buf = Vec::new();
        stdin
            .read_to_end(&mut buf)
            .map_err(|source| ManifestError::Read {
                path: path.to_owned(),
                source,
            })?;
        buf
    } else {
        std::fs::read(path).map_err(|source| ManifestError::Read {
            path: path.to_owned(),
            source,
        })?
    };
    String::from_utf8(bytes).map_err(|_| ManifestError::NotText {
        path: path.to_owned(),
    })
}

/// Parses `text` (from `source`) into objects: JSON when it starts with `{` or `[`,
/// otherwise multi-document YAML. `List` objects are flattened into their items.
pub fn parse_documents(source: &str, text: &str) -> Result<Vec<Document>, ManifestError> {
    documents(source, text).collect()
}

/// The objects of `text` (from `source`), one at a time: a YAML document is parsed when it
/// is reached, so only one is held at once (JSON is parsed whole, as it is one value). After
/// an error the iterator ends.
pub fn documents<'t>(source: &'t str, text: &'t str) -> Documents<'t> {
    let trimmed = text.trim_start_matches('\u{feff}').trim_start();
    let input = if trimmed.starts_with('{') || trimmed.starts_with('[') {
        Input::Json(Some(trimmed))
    } else {
        Input::Yaml(split_yaml(text).into_iter().enumerate())
    };
    Documents {
        source,
        input,
        pending: VecDeque::new(),
        failed: false,
    }
}

/// The iterator [`documents`] returns.
pub struct Documents<'t> {
    source: &'t str,
    input: Input<'t>,
    /// Objects read but not yet returned: the items of a `List`.
    pending: VecDeque<Document>,
    failed: bool,
}

enum Input<'t> {
    /// The JSON text, until it is parsed.
    Json(Option<&'t str>),
    /// The YAML documents not yet parsed: (start line, text), numbered from 0.
    Yaml(std::iter::Enumerate<std::vec::IntoIter<(usize, &'t str)>>),
}

impl<'t> Iterator for Documents<'t> {
    type Item = Result<Document, ManifestError>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.failed {
            if let Some(doc) = self.pending.pop_front() {
                return Some(Ok(doc));
            }
            let read = match &mut self.input {
                Input::Json(text) => {
                    let text = text.take()?;
                    self.read_json(text)
                }
                Input::Yaml(chunks) => {
                    let (index, (line, chunk)) = chunks.next()?;
                    self.read_yaml(index + 1, line, chunk)
                }
            };
            if let Err(e) = read {
                self.failed = true;
                return Some(Err(e));
            }
        }
        None
    }
}

impl Documents<'_> {
    fn read_json(&mut self, text: &str) -> Result<(), ManifestError> {
        let value: Value = serde_json::from_str(text).map_err(|e| ManifestError::Json {
            path: self.source.to_owned(),
            message: e.to_string(),
        })?;
        match value {
            Value::Array(items) => {
                (items.into_iter().enumerate()).try_for_each(|(i, item)| self.push(i + 1, 1, item))
            }
            value => self.push(1, 1, value),
        }
    }

    fn read_yaml(&mut self, index: usize, line: usize, chunk: &str) -> Result<(), ManifestError> {
        let value: Value = yaml_value(chunk).map_err(|e| ManifestError::Yaml {
            path: self.source.to_owned(),
            index,
            line,
            message: first_line(&e.to_string()),
        })?;
        if value.is_null() {
            return Ok(());
        }
        self.push(index, line, value)
    }

    /// Queues an object, or the items of a `List`.
    fn push(&mut self, index: usize, line: usize, value: Value) -> Result<(), ManifestError> {
        let not_object = |problem: String| ManifestError::NotAnObject {
            path: self.source.to_owned(),
            index,
            line,
            problem,
        };
        let Value::Object(map) = &value else {
            return Err(not_object(
                "not a Kubernetes object (expected a mapping with apiVersion and kind)".into(),
            ));
        };
        let kind = map.get("kind").and_then(Value::as_str).unwrap_or("");
        if kind.is_empty() {
            return Err(not_object("has no kind".into()));
        }
        let document = |object| Document {
            source: self.source.to_owned(),
            index,
            line,
            object,
        };
        if kind == "List" || (kind.ends_with("List") && map.get("items").is_some()) {
            let Some(Value::Array(items)) = value.get("items") else {
                return Err(not_object(format!("{kind} has no items list")));
            };
            for (i, item) in items.iter().enumerate() {
                if item
                    .get("kind")
                    .and_then(Value::as_str)
                    .is_none_or(str::is_empty)
                {
                    return Err(not_object(format!("{kind} item {} has no kind", i + 1)));
                }
            }
            let Value::Object(mut map) = value else {
                return Ok(());
            };
            if let Some(Value::Array(items)) = map.remove("items") {
                let documents: Vec<Document> = items.into_iter().map(document).collect();
                self.pending.extend(documents);
            }
            return Ok(());
        }
        let document = document(value);
        self.pending.push_back(document);
        Ok(())
    }
}

/// One YAML document read as kubectl reads it: sigs.k8s.io/yaml resolves plain scalars by
/// YAML 1.1 (`0755` is the octal 493, `yes`/`no`/`on`/`off`/`y`/`n` are booleans), which
/// serde-saphyr does with `legacy_octal_numbers` (its booleans are YAML 1.1 already); then the
/// JSON is what Go's encoder writes of the numbers it read, where a float without a fraction
/// is written as an integer (`1e3` and `1.0` become `1000` and `1`), so a quantity or a mode
/// reads back as the integer the API server sees.
pub fn yaml_value(text: &str) -> Result<Value, serde_saphyr::Error> {
    let options = serde_saphyr::options! { legacy_octal_numbers: true };
    let mut value: Value = serde_saphyr::from_str_with_options(text, options)?;
    integral_floats_as_integers(&mut value);
    Ok(value)
}

/// Writes each float that holds a whole number in the `i64` or `u64` range as an integer, as
/// Go's `encoding/json` prints a `float64` without a fraction (below 1e21).
fn integral_floats_as_integers(value: &mut Value) {
    match value {
        Value::Number(n) if n.is_f64() => {
            let Some(f) = n.as_f64().filter(|f| f.fract() == 0.0) else {
                return;
            };
            // `as` saturates; the round trip says whether the value fits exactly.
            if f >= -(2f64.powi(63)) && f < 2f64.powi(63) && (f as i64) as f64 == f {
                *value = Value::from(f as i64);
            } else if f >= 0.0 && f < 2f64.powi(64) && (f as u64) as f64 == f {
                *value = Value::from(f as u64);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(integral_floats_as_integers),
        Value::Object(map) => map.values_mut().for_each(integral_floats_as_integers),
        _ => {}
    }
}

/// Splits YAML text at `---` document markers into (1-based start line, text) chunks,
/// leaving out chunks with nothing but blank lines and comments.
fn split_yaml(text: &str) -> Vec<(usize, &str)> {
    let mut chunks = Vec::new();
    let mut start = 0usize;
    let mut start_line = 1usize;
    let mut offset = 0usize;
    for (i, line) in text.split_inclusive('\n').enumerate() {
        let bare = line.trim_end_matches(['\n', '\r']);
        let marker = bare == "---" || bare.starts_with("--- ") || bare.starts_with("---\t");
        let end_marker = bare == "...";
        if marker || end_marker {
            chunks.push((start_line, &text[start..offset]));
            // Content after `--- ` on the same line belongs to the next document.
            start = if marker {
                offset + 3
            } else {
                offset + line.len()
            };
            start_line = i + 1 + usize::from(end_marker);
        }
        offset += line.len();
    }
    chunks.push((start_line, &text[start..]));
    chunks
        .into_iter()
        .filter(|(_, chunk)| {
            chunk.lines().any(|l| {
                let l = l.trim();
                !l.is_empty() && !l.starts_with('#')
            })
        })
        .collect()
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or(s).to_owned()
}

/// A pod found inside an object that is not a workload of a known kind (a custom resource:
/// MPIJob, RayCluster, JobSet, Volcano Job, ...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundPod {
    /// JSON pointer of the template (or of the bare pod spec).
    pub pointer: String,
    /// The same place as users write it: `spec.mpiReplicaSpecs.Worker.template`,
    /// `spec.tasks[0].template`.
    pub path: String,
    /// A pod spec on its own (`containers` right at the pointer, as in a KServe predictor or
    /// an Argo `containerSet`) rather than a template with `metadata` and `spec`.
    pub bare: bool,
}

/// Every pod inside `object`, in key order: each subtree shaped like a pod template
/// (an object whose `spec` holds a `containers` list of named objects) or, failing that,
/// like a pod spec (an object holding such a `containers` list itself). Nothing inside a pod
/// found is searched again. A list of containers is only a pod when every entry is an object
/// with a string `name`, so schemas (`containers` as an object) and lists of names do not
/// count.
pub fn find_pods(object: &Value) -> Vec<FoundPod> {
    fn is_pod_spec(value: &Value) -> bool {
        value
            .get("containers")
            .and_then(Value::as_array)
            .is_some_and(|list| {
                !list.is_empty()
                    && list
                        .iter()
                        .all(|c| c.get("name").is_some_and(Value::is_string))
            })
    }
    fn walk(value: &Value, pointer: &mut String, path: &mut String, out: &mut Vec<FoundPod>) {
        match value {
            Value::Object(map) => {
                let found = if map.get("spec").is_some_and(is_pod_spec) {
                    Some(false)
                } else {
                    is_pod_spec(value).then_some(true)
                };
                if let Some(bare) = found {
                    out.push(FoundPod {
                        pointer: pointer.clone(),
                        path: path.clone(),
                        bare,
                    });
                    return;
                }
                for (key, child) in map {
                    let (p, q) = (pointer.len(), path.len());
                    pointer.push('/');
                    pointer.push_str(&key.replace('~', "~0").replace('/', "~1"));
                    if !path.is_empty() {
                        path.push('.');
                    }
                    path.push_str(key);
                    walk(child, pointer, path, out);
                    pointer.truncate(p);
                    path.truncate(q);
                }
            }
            Value::Array(items) => {
                for (i, child) in items.iter().enumerate() {
                    let (p, q) = (pointer.len(), path.len());
                    let _ = write!(pointer, "/{i}");
                    let _ = write!(path, "[{i}]");
                    walk(child, pointer, path, out);
                    pointer.truncate(p);
                    path.truncate(q);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(object, &mut String::new(), &mut String::new(), &mut out);
    out
}

/// JSON pointer of the pod template in a workload of `kind`: `Some("")` for a Pod,
/// `None` for kinds that hold no pod.
pub fn pod_template_pointer(api_version: &str, kind: &str) -> Option<&'static str> {
    let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
    match (group, kind) {
        ("", "Pod") => Some(""),
        ("", "ReplicationController") => Some("/spec/template"),
        ("apps", "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet") => {
            Some("/spec/template")
        }
        ("batch", "Job") => Some("/spec/template"),
        ("batch", "CronJob") => Some("/spec/jobTemplate/spec/template"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_documents_are_split_and_numbered() {
        let text = "# header\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: a}\n---\n# only a comment\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: b}\n...\n";
        let docs = parse_documents("x.yaml", text).unwrap();
        assert_eq!(docs.len(), 2);
        assert_eq!((docs[0].index, docs[0].line), (1, 2));
        assert_eq!(docs[1].kind(), "ConfigMap");
        assert_eq!(docs[1].index, 2);
    }

    #[test]
    fn bad_yaml_names_file_document_and_line() {
        let text = "apiVersion: v1\nkind: Pod\n---\napiVersion: v1\nkind: [unclosed\n";
        let err = parse_documents("bad.yaml", text).unwrap_err().to_string();
        assert!(
            err.starts_with("bad.yaml: document 2 (line 3): invalid YAML"),
            "{err}"
        );
        let err = parse_documents("s.yaml", "just a string\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("document 1") && err.contains("not a Kubernetes object"),
            "{err}"
        );
    }

    #[test]
    fn json_objects_and_lists() {
        let docs = parse_documents("l.json", r#"{"apiVersion":"v1","kind":"List","items":[{"apiVersion":"v1","kind":"Pod"},{"apiVersion":"v1","kind":"Service"}]}"#).unwrap();
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[1].kind(), "Service");
        assert!(
            parse_documents("bad.json", "{\"kind\":")
                .unwrap_err()
                .to_string()
                .starts_with("bad.json: invalid JSON")
        );
    }

    #[test]
    fn non_kubernetes_yaml_is_recognised() {
        assert!(looks_like_kubernetes("apiVersion: v1\nkind: Pod\n"));
        assert!(looks_like_kubernetes(
            "{\"apiVersion\":\"v1\",\"kind\":\"Pod\"}"
        ));
        assert!(!looks_like_kubernetes(
            "driver:\n  driverVersion: \"550\"\ngpus: []\n"
        ));
    }

    #[test]
    fn yaml_scalars_read_as_kubectl_reads_them() {
        let doc = "mode: 0755\nzero: 0\nyes_: yes\nOn_: On\nn_: n\nquoted: \"0755\"\nexp: 1e3\nwhole: 1.0\nhalf: 0.5\ntime: 1:20\nunderscored: 1_000\nhex: 0x1F\nbinary: 0b101\nbad_octal: 08\nbig: 1e30\nneg: -012\n";
        let v = yaml_value(doc).unwrap();
        let expect = serde_json::json!({
            "mode": 493, "zero": 0, "yes_": true, "On_": true, "n_": false, "quoted": "0755",
            "exp": 1000, "whole": 1, "half": 0.5, "time": "1:20", "underscored": 1000,
            "hex": 31, "binary": 5, "bad_octal": 8, "big": 1e30, "neg": -10,
        });
        assert_eq!(v, expect);
        // Integers stay integers in the JSON, as kubectl writes them.
        assert_eq!(v["exp"].to_string(), "1000");
        assert_eq!(v["mode"].to_string(), "493");
    }

    #[test]
    fn pods_are_found_inside_any_object() {
        let job: Value = yaml_value(
            "apiVersion: kubeflow.org/v2beta1\nkind: MPIJob\nmetadata: {name: nccl}\nspec:\n  mpiReplicaSpecs:\n    Launcher:\n      replicas: 1\n      template:\n        spec:\n          containers: [{name: launcher, image: mpi}]\n    Worker:\n      replicas: 2\n      template:\n        metadata: {annotations: {a: b}}\n        spec:\n          containers: [{name: worker, image: nccl}]\n          volumes: [{name: ib, hostPath: {path: /dev/infiniband}}]\n",
        )
        .unwrap();
        let found = find_pods(&job);
        let paths: Vec<(&str, &str, bool)> = (found.iter())
            .map(|f| (f.path.as_str(), f.pointer.as_str(), f.bare))
            .collect();
        assert_eq!(
            paths,
            [
                (
                    "spec.mpiReplicaSpecs.Launcher.template",
                    "/spec/mpiReplicaSpecs/Launcher/template",
                    false
                ),
                (
                    "spec.mpiReplicaSpecs.Worker.template",
                    "/spec/mpiReplicaSpecs/Worker/template",
                    false
                ),
            ]
        );
        // Lists, escaped keys, and a pod spec on its own (a KServe predictor).
        let other = serde_json::json!({
            "kind": "Thing",
            "spec": {
                "tasks": [{"name": "t", "template": {"spec": {"containers": [{"name": "c"}]}}}],
                "a/b": {"containers": [{"name": "p", "image": "x"}]},
            }
        });
        let found = find_pods(&other);
        assert_eq!(found.len(), 2);
        assert_eq!(found[0].pointer, "/spec/a~1b");
        assert!(found[0].bare);
        assert_eq!(found[1].path, "spec.tasks[0].template");
        assert_eq!(
            other.pointer(&found[1].pointer).unwrap()["spec"]["containers"][0]["name"],
            "c"
        );
        // Not pods: a schema whose `containers` is an object, a list of names, an empty
        // list, containers without names.
        for not_a_pod in [
            serde_json::json!({"spec": {"containers": {"type": "array"}}}),
            serde_json::json!({"spec": {"containers": ["a", "b"]}}),
            serde_json::json!({"spec": {"containers": []}}),
            serde_json::json!({"containers": [{"image": "x"}]}),
            serde_json::json!({"data": {"pod.yaml": "spec:\n  containers: [{name: a}]"}}),
        ] {
            assert!(find_pods(&not_a_pod).is_empty(), "{not_a_pod}");
        }
    }

    #[test]
    fn templates() {
        assert_eq!(pod_template_pointer("v1", "Pod"), Some(""));
        assert_eq!(
            pod_template_pointer("apps/v1", "Deployment"),
            Some("/spec/template")
        );
        assert_eq!(
            pod_template_pointer("batch/v1", "CronJob"),
            Some("/spec/jobTemplate/spec/template")
        );
        assert_eq!(pod_template_pointer("v1", "ConfigMap"), None);
        assert_eq!(pod_template_pointer("example.com/v1", "Deployment"), None);
    }
}
