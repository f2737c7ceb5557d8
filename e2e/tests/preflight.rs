//! The pre-flight of docs/preflight.md ("Before you install: what would change") run as
//! written against a real API server, and the offline reading of manifests held to
//! kubectl's: an object gpuwarden leaves unchanged comes out as
//! `kubectl create --dry-run=client` reads its input, and passes a server-side dry run
//! where its input does.
//!
//! ```sh
//! KUBECONFIG=... cargo test -p gpuwarden-e2e --test preflight -- --ignored --test-threads=1
//! ```
//!
//! Both drive `kubectl` on `PATH` and create only what they delete again: namespaces named
//! `gpuwarden-preflight-*` and, where missing, a CRD for each custom resource kind they
//! use (removed again only if they made it).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use gpuwarden_e2e::manifests::repo_root;
use gpuwarden_e2e::readme::{PREFLIGHT, doc_block};
use gpuwarden_webhook::manifest::parse_documents;
use serde_json::{Value, json};

fn kubectl(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new("kubectl")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl on PATH");
    {
        use std::io::Write;
        let mut input = child.stdin.take().expect("stdin");
        input
            .write_all(stdin.unwrap_or("").as_bytes())
            .expect("kubectl stdin");
    }
    child.wait_with_output().expect("kubectl runs")
}

fn apply(object: &Value) {
    let out = kubectl(&["apply", "-f", "-"], Some(&object.to_string()));
    assert!(
        out.status.success(),
        "kubectl apply {}: {}",
        object["metadata"]["name"],
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CRD that accepts any object of `kind` in `group`/`version` (plural: `plural`), for
/// custom resources whose operator is not installed. Returns whether it was made here.
fn permissive_crd(group: &str, version: &str, kind: &str, plural: &str) -> Option<String> {
    let name = format!("{plural}.{group}");
    if kubectl(&["get", "crd", &name], None).status.success() {
        return None;
    }
    apply(&json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "gpuwarden-e2e"}},
        "spec": {
            "group": group,
            "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase()},
            "scope": "Namespaced",
            "versions": [{"name": version, "served": true, "storage": true, "schema": {
                "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}
            }}]
        }
    }));
    let out = kubectl(
        &[
            "wait",
            "--for=condition=Established",
            "--timeout=30s",
            &format!("crd/{name}"),
        ],
        None,
    );
    assert!(out.status.success(), "CRD {name} not established");
    Some(name)
}

/// Deletes what a test made, also when it fails.
struct Made {
    namespaces: Vec<String>,
    crds: Vec<String>,
}

impl Drop for Made {
    fn drop(&mut self) {
        for ns in &self.namespaces {
            kubectl(
                &[
                    "delete",
                    "namespace",
                    ns,
                    "--ignore-not-found",
                    "--wait=false",
                ],
                None,
            );
        }
        for crd in &self.crds {
            kubectl(&["delete", "crd", crd, "--ignore-not-found"], None);
        }
    }
}

fn suffix() -> String {
    format!("{:x}", rand::random::<u32>())
}

fn namespace(made: &mut Made, name: &str) {
    apply(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}));
    made.namespaces.push(name.to_owned());
}

/// A node selector no node has: the workloads are stored, never scheduled.
fn nowhere() -> Value {
    json!({"gpuwarden.io/e2e-nowhere": "true"})
}

#[test]
#[ignore = "needs a cluster: KUBECONFIG and kubectl on PATH"]
fn the_readme_preflight_judges_what_is_running() {
    let mut made = Made {
        namespaces: Vec::new(),
        crds: Vec::new(),
    };
    let tenant = format!("gpuwarden-preflight-{}", suffix());
    namespace(&mut made, &tenant);
    // A privileged training Deployment, stored with no replicas.
    apply(&json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "train", "namespace": tenant},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "train"}}, "template": {
            "metadata": {"labels": {"app": "train"}},
            "spec": {"nodeSelector": nowhere(), "containers": [{"name": "trainer",
                "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,1"}],
                "securityContext": {"privileged": true}}]}}}
    }));
    // A privileged exporter DaemonSet mounting /dev/nvidia0: it would take a GPU per node.
    apply(&json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "gpu-exporter", "namespace": tenant},
        "spec": {"selector": {"matchLabels": {"app": "x"}}, "template": {
            "metadata": {"labels": {"app": "x"}},
            "spec": {"nodeSelector": nowhere(), "containers": [{"name": "exporter",
                "image": "utkuozdemir/nvidia_gpu_exporter:1.2.0",
                "securityContext": {"privileged": true},
                "volumeMounts": [{"name": "nvidia0", "mountPath": "/dev/nvidia0"}]}],
                "volumes": [{"name": "nvidia0", "hostPath": {"path": "/dev/nvidia0"}}]}}}
    }));
    // An MPIJob whose privileged workers mount the host's HCAs.
    made.crds.extend(permissive_crd(
        "kubeflow.org",
        "v2beta1",
        "MPIJob",
        "mpijobs",
    ));
    apply(&json!({
        "apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob",
        "metadata": {"name": "nccl", "namespace": tenant},
        "spec": {"mpiReplicaSpecs": {"Worker": {"replicas": 2, "template": {"spec": {
            "containers": [{"name": "worker", "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                "resources": {"limits": {"nvidia.com/gpu": 8}},
                "securityContext": {"privileged": true},
                "volumeMounts": [{"name": "ib", "mountPath": "/dev/infiniband"}]}],
            "volumes": [{"name": "ib", "hostPath": {"path": "/dev/infiniband"}}]}}}}}
    }));

    // docs/preflight.md's block, as written, in a scratch directory; `cargo run` finds the
    // workspace through --manifest-path.
    let dir = tempfile::tempdir().expect("a scratch directory");
    let manifest = repo_root().join("Cargo.toml");
    let script = doc_block(PREFLIGHT, "Before you install: what would change")
        .join("\n")
        .replace(
            "cargo run -q -p gpuwarden-webhook",
            &format!(
                "cargo run -q --manifest-path {} -p gpuwarden-webhook",
                manifest.display()
            ),
        );
    let out = Command::new("bash")
        .args(["-c", &script])
        .current_dir(dir.path())
        .output()
        .expect("bash");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let diff = std::fs::read_to_string(dir.path().join("preflight.diff")).unwrap_or_default();
    assert_eq!(
        out.status.code(),
        Some(1),
        "something would be denied:\n{stderr}"
    );
    let line = |prefix: &str| {
        (stderr.lines())
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no line {prefix:?} in\n{stderr}"))
            .to_owned()
    };
    assert!(line(&format!("  Deployment {tenant}/train: ")).contains("REWRITTEN"));
    assert!(line(&format!("  DaemonSet {tenant}/gpu-exporter: ")).contains("DENIED"));
    assert!(
        stderr.contains("DaemonSet gpu-exporter runs it on every node"),
        "{stderr}"
    );
    assert!(
        line(&format!(
            "  MPIJob {tenant}/nccl spec.mpiReplicaSpecs.Worker.template: "
        ))
        .contains("DENIED"),
        "{stderr}"
    );
    assert!(stderr.contains("cannot open RDMA devices (/dev/infiniband, volume ib)"));
    // What is running in kube-system is exempt, never rewritten.
    assert!(
        !(stderr.lines())
            .any(|l| l.starts_with("  ") && l.contains(" kube-system/") && l.contains("REWRITTEN")),
        "{stderr}"
    );
    // The diff shows the Deployment's rewrite.
    assert!(
        diff.contains(&format!("Deployment/{tenant}/train (rewritten)"))
            && diff.contains("+          privileged: false"),
        "{diff}"
    );
    eprintln!(
        "{}",
        stderr
            .lines()
            .filter(|l| l.contains(&tenant))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The manifests the offline tests read: the examples and the real-manifest corpus.
fn manifest_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in ["deploy/examples", "webhook/tests/real"] {
        let Ok(entries) = std::fs::read_dir(repo_root().join(dir)) else {
            continue;
        };
        let mut found: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
            .collect();
        found.sort();
        files.extend(found);
    }
    files
}

/// `mutate -o json` of one file, as a list of objects, and its stderr.
fn mutate_json(path: &Path) -> (Vec<Value>, String) {
    use clap::Parser as _;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: gpuwarden_webhook::mutate::MutateArgs,
    }
    let path = path.display().to_string();
    let cli = Cli::try_parse_from(["mutate", "-f", &path, "-o", "json"]).expect("flags");
    let (mut out, mut err) = (Vec::new(), Vec::new());
    gpuwarden_webhook::mutate::run(&cli.args, &mut std::io::empty(), &mut out, &mut err);
    let value: Value = serde_json::from_slice(&out).unwrap_or(Value::Null);
    let objects = match value {
        Value::Object(ref m) if m.get("kind") == Some(&json!("List")) => {
            m["items"].as_array().cloned().unwrap_or_default()
        }
        Value::Null => Vec::new(),
        one => vec![one],
    };
    (objects, String::from_utf8_lossy(&err).into_owned())
}

#[test]
#[ignore = "needs a cluster: KUBECONFIG and kubectl on PATH"]
fn objects_left_alone_read_as_kubectl_reads_them() {
    let mut made = Made {
        namespaces: Vec::new(),
        crds: Vec::new(),
    };
    let mut namespaces = BTreeSet::new();
    let (mut compared, mut dry_runs) = (0, 0);
    for path in manifest_files() {
        let text = std::fs::read_to_string(&path).expect("readable");
        let inputs = parse_documents(&path.display().to_string(), &text).expect("parses");
        let (outputs, _) = mutate_json(&path);
        assert_eq!(inputs.len(), outputs.len(), "{}", path.display());
        for (input, output) in inputs.iter().zip(&outputs) {
            if input.object != *output {
                continue;
            }
            let what = format!(
                "{} document {} ({} {})",
                path.display(),
                input.index,
                input.kind(),
                input.name()
            );
            // kubectl's own reading of the same document.
            let yaml_doc = serde_saphyr::to_string(&input.object).expect("YAML");
            let original = nth_yaml_document(&text, input.index);
            let client = read_by_kubectl(&original);
            if !client.status.success() {
                // A kind this server does not know: made known for the server dry run below.
                let api_version = input.object["apiVersion"].as_str().unwrap_or("");
                let unknown =
                    String::from_utf8_lossy(&client.stderr).contains("no matches for kind");
                if let Some((group, version)) = api_version.split_once('/')
                    && unknown
                {
                    let kind = input.kind();
                    made.crds.extend(permissive_crd(
                        group,
                        version,
                        kind,
                        &format!("{}s", kind.to_lowercase()),
                    ));
                }
            }
            let client = read_by_kubectl(&original);
            if !client.status.success() && input.object.get("apiVersion").is_none() {
                // A fragment (a kustomize patch): kubectl reads no object there either.
                eprintln!("{what}: no apiVersion, not an object kubectl creates: skipped");
                continue;
            }
            assert!(
                client.status.success(),
                "{what}: kubectl cannot read it: {}",
                String::from_utf8_lossy(&client.stderr)
            );
            let mut kubectl_json: Value = serde_json::from_slice(&client.stdout).expect("JSON");
            if input.object.pointer("/metadata/namespace").is_none() {
                // kubectl fills in its context's namespace.
                if let Some(meta) = kubectl_json["metadata"].as_object_mut() {
                    meta.remove("namespace");
                }
            }
            assert_eq!(
                kubectl_json, *output,
                "{what}: gpuwarden's output differs from kubectl's reading of the input\n{yaml_doc}"
            );
            compared += 1;
            // A server-side dry run of gpuwarden's output passes where the input's does.
            if let Some(ns) = input.namespace()
                && namespaces.insert(ns.to_owned())
                && !kubectl(&["get", "namespace", ns], None).status.success()
            {
                namespace(&mut made, ns);
            }
            let server = |doc: &str| {
                kubectl(
                    &["create", "--dry-run=server", "-o", "name", "-f", "-"],
                    Some(doc),
                )
            };
            let from_input = server(&original);
            let from_output = server(&output.to_string());
            assert_eq!(
                from_input.status.success(),
                from_output.status.success(),
                "{what}: server dry run of the input {}, of gpuwarden's output {}",
                String::from_utf8_lossy(&from_input.stderr),
                String::from_utf8_lossy(&from_output.stderr)
            );
            dry_runs += usize::from(from_output.status.success());
        }
    }
    eprintln!(
        "{compared} objects left unchanged read as kubectl reads them; {dry_runs} passed a server dry run"
    );
    assert!(compared >= 20, "{compared}");
}

/// `kubectl create --dry-run=client -o json` of one document: how kubectl reads it.
fn read_by_kubectl(document: &str) -> Output {
    kubectl(
        &[
            "create",
            "--dry-run=client",
            "-o",
            "json",
            "--validate=false",
            "-f",
            "-",
        ],
        Some(document),
    )
}

/// The `index`th (1-based) non-empty YAML document of `text`, as written.
fn nth_yaml_document(text: &str, index: usize) -> String {
    let mut docs = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        if line == "---" || line.starts_with("--- ") {
            docs.push(std::mem::take(&mut current));
            continue;
        }
        current.push_str(line);
        current.push('\n');
    }
    docs.push(current);
    docs.into_iter()
        .filter(|d| {
            d.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        })
        .nth(index - 1)
        .unwrap_or_default()
}
