//! gpuwarden installed in the cluster, as the README installs it, on a real node.
//!
//! The image is built from this workspace's binaries without a registry: an OCI image
//! layout (`gpuwarden_e2e::image`) imported into the node's containerd as
//! `localhost/gpuwarden:e2e`. A test overlay sets that image, and where the node lacks the
//! NVIDIA container runtime (`GPUWARDEN_E2E_DRIVER_ROOT` names the driver root holding
//! NVML, as NVIDIA's mock NVML is laid out) gives the node agent the library through a
//! read-only hostPath and `LD_LIBRARY_PATH`, as the runtime would have injected it. Then,
//! with `kubectl`:
//!
//! - the README's Install block runs as written, with `-k deploy/` replaced by the overlay
//!   as the README tells overlay users, and its rollout loop ends within its timeouts;
//! - a privileged busybox pod naming GPUs `0,1` is stored rewritten, runs, and prints
//!   exactly two GPU UUIDs, which the in-cluster agent lists in the node's GpuNode binding;
//! - with the webhook at 0 replicas, an exempt NVIDIA component in `gpu-operator` is
//!   admitted (the operator's `gpuwarden-not-exempt` matchCondition lets it through without
//!   a call), while a privileged GPU pod elsewhere is refused (fail closed);
//! - the restore of "When the webhook is down" (docs/operations.md: delete, then re-apply
//!   the overlay) admits a privileged GPU pod rewritten within 15 seconds of the re-apply;
//! - the README's Uninstall block runs twice with exit 0, nothing of the install is left,
//!   and no host path the manifests or the NVIDIA runtime name exists that did not before.
//!
//! It needs root on the node (to import images with `ctr`), a one-node cluster whose node
//! is this machine (the image exists only in its containerd) with NVIDIA's device plugin and
//! at least two allocatable `nvidia.com/gpu`, and `kubectl`, `ctr`, `tar`, `sha256sum` and
//! `ldd` on `PATH`. It labels the node `nvidia.com/gpu.present=true` where GPU feature
//! discovery has not (and removes the label after). Everything it creates is deleted, also
//! when it fails. Where it cannot run (no such node, a node that is not this machine, not
//! root, no `ctr` reaching containerd, a tool missing) it prints `SKIPPED` and why; it waits
//! (up to 120 s) for a `gpuwarden-system` that a test before it is deleting, and refuses to
//! run where gpuwarden is installed (an object of the install other than the namespace).
//!
//! ```sh
//! GPUWARDEN_E2E_DRIVER_ROOT=<driver root> KUBECONFIG=... \
//!   cargo test -p gpuwarden-e2e --test in_cluster -- --ignored --nocapture --test-threads=1
//! ```
//!
//! The binaries are built with `cargo build --release` into the same `CARGO_TARGET_DIR`;
//! `GPUWARDEN_E2E_BINARIES=<dir>` uses prebuilt ones instead.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use gpuwarden_crds::admission::match_conditions::NOT_EXEMPT_CONDITION;
use gpuwarden_crds::install::MUTATING_WEBHOOK_CONFIGURATION;
use gpuwarden_crds::{LABEL_GPU_PRESENT, RESOURCE_GPU, SYSTEM_NAMESPACE};
use gpuwarden_e2e::cluster::{skip, visible_in_log};
use gpuwarden_e2e::image::{IMAGE_USER, write_oci_layout};
use gpuwarden_e2e::install::refuse_where_installed;
use gpuwarden_e2e::kubectl::{self, get_json, must, poll};
use gpuwarden_e2e::manifests::{parse_documents, repo_root};
use gpuwarden_e2e::node::{
    COMPONENT_BINARIES, NEEDS_GPU_NODE, Out, busybox, ctr, exec, gpu_node_in, image_refs,
    local_node_problem,
};
use gpuwarden_e2e::readme::{OPERATIONS, doc_block, doc_section, readme_block_in, statements};
use serde_json::{Value, json};

/// The image the overlay gives all three components.
const IMAGE_NAME: &str = "localhost/gpuwarden";
const IMAGE_TAG: &str = "e2e";
/// An NVIDIA component the default policy exempts in `gpu-operator` (busybox, tagged so).
const EXEMPT_IMAGE: &str = "nvcr.io/nvidia/k8s/dcgm-exporter:4.5.3-4.8.2-distroless";
const EXEMPT_NAMESPACE: &str = "gpu-operator";
/// Where the NVIDIA runtime and CDI keep their files: the node agent reads them, and must
/// create none.
const NVIDIA_HOST_PATHS: [&str; 5] = [
    "/etc/nvidia-container-runtime",
    "/usr/local/nvidia/toolkit/.config/nvidia-container-runtime",
    "/etc/cdi",
    "/run/cdi",
    "/var/run/cdi",
];
fn image() -> String {
    format!("{IMAGE_NAME}:{IMAGE_TAG}")
}

/// One command line (or `for ... done` loop) of the README or docs/, run through bash in the
/// repository root as a reader would; its exit status, output and duration.
fn run_readme(statement: &str) -> (Out, Duration) {
    eprintln!("$ {statement}");
    let start = Instant::now();
    let out = exec(
        Command::new("bash")
            .arg("-c")
            .arg(statement)
            .current_dir(repo_root()),
        None,
    );
    let took = start.elapsed();
    eprint!("{}{}", out.stdout, out.stderr);
    eprintln!(
        "  (exit {}, {:.1} s)",
        if out.ok { 0 } else { 1 },
        took.as_secs_f64()
    );
    (out, took)
}

/// What the test made, deleted on drop (also when the test fails).
#[derive(Default)]
struct Cleanup {
    /// The README install ran (or began): run the README uninstall.
    installed: bool,
    /// Namespaces this test created.
    namespaces: Vec<String>,
    /// Pods this test created in namespaces it did not create.
    pods: Vec<(String, String)>,
    /// containerd's image references before the test: every other one is this test's (its
    /// tags, and the references by ID the CRI plugin adds for images it runs).
    images_before: Option<BTreeSet<String>>,
    /// The node this test labelled `nvidia.com/gpu.present=true`.
    labelled_node: Option<String>,
}

impl Cleanup {
    fn uninstall(&mut self) {
        if std::mem::take(&mut self.installed) {
            for statement in statements(&readme_block_in("Uninstall", "With the manifests")) {
                let _ = run_readme(&statement);
            }
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        self.uninstall();
        for (ns, pod) in std::mem::take(&mut self.pods) {
            let _ = kubectl::run(&["delete", "pod", "-n", &ns, &pod, "--ignore-not-found"]);
        }
        let namespaces = std::mem::take(&mut self.namespaces);
        for ns in &namespaces {
            let _ = kubectl::run(&[
                "delete",
                "namespace",
                ns,
                "--ignore-not-found",
                "--wait=false",
            ]);
        }
        for ns in &namespaces {
            let _ = kubectl::run(&[
                "wait",
                "--for=delete",
                &format!("namespace/{ns}"),
                "--timeout=90s",
            ]);
        }
        if let Some(before) = self.images_before.take() {
            for image in image_refs().difference(&before) {
                let _ = ctr(&["images", "rm", image]);
            }
        }
        if let Some(node) = self.labelled_node.take() {
            let _ = kubectl::run(&["label", "node", &node, &format!("{LABEL_GPU_PRESENT}-")]);
        }
    }
}

/// The three binaries: prebuilt in `GPUWARDEN_E2E_BINARIES`, or built here (release) into
/// the `CARGO_TARGET_DIR` this test runs under.
fn binaries(summary: &mut Vec<String>) -> Vec<PathBuf> {
    let dir = if let Some(dir) = std::env::var_os("GPUWARDEN_E2E_BINARIES") {
        summary.push(format!("binaries: prebuilt in {}", dir.to_string_lossy()));
        PathBuf::from(dir)
    } else {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut command = Command::new(cargo);
        command
            .args(["build", "--release", "--locked"])
            .current_dir(repo_root());
        // What cargo sets for this test (CARGO_MANIFEST_DIR, CARGO_PKG_NAME, ...) is no part
        // of the build: build scripts that watch those names (ring's) would run again, and
        // the release build would start over on every switch between here and a shell.
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            let set_for_tests = [
                "CARGO_MANIFEST_DIR",
                "CARGO_MANIFEST_PATH",
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "CARGO_RUSTC_CURRENT_DIR",
            ];
            if name.starts_with("CARGO_PKG_") || set_for_tests.contains(&&*name) {
                command.env_remove(&*name);
            }
        }
        for binary in COMPONENT_BINARIES {
            command.args(["-p", binary]);
        }
        let start = Instant::now();
        let status = command.status().expect("run cargo build");
        assert!(status.success(), "cargo build --release failed");
        summary.push(format!(
            "binaries: cargo build --release, {:.0} s",
            start.elapsed().as_secs_f64()
        ));
        std::env::var_os("CARGO_TARGET_DIR")
            .map_or_else(|| repo_root().join("target"), PathBuf::from)
            .join("release")
    };
    COMPONENT_BINARIES
        .iter()
        .map(|b| {
            let path = dir.join(b);
            assert!(path.is_file(), "{} is missing", path.display());
            path
        })
        .collect()
}

/// The directory under `root` that holds `libnvidia-ml.so.1`.
fn nvml_dir(root: &Path) -> PathBuf {
    ["usr/lib64", "usr/lib/x86_64-linux-gnu", "lib64", "usr/lib"]
        .iter()
        .map(|d| root.join(d))
        .find(|d| d.join("libnvidia-ml.so.1").exists())
        .unwrap_or_else(|| panic!("no libnvidia-ml.so.1 under {}", root.display()))
}

/// `to` as a path relative to the directory `from`, through the root.
fn relative_to(from: &Path, to: &Path) -> PathBuf {
    let from = from.canonicalize().expect("the overlay directory");
    let to = to.canonicalize().expect("deploy/");
    let mut out = PathBuf::new();
    for _ in from.components().skip(1) {
        out.push("..");
    }
    out.join(to.strip_prefix("/").unwrap_or(&to))
}

/// Whether the host mount holding `path` propagates mounts to slaves (shared or slave):
/// what `mountPropagation: HostToContainer` needs.
fn propagates(path: &str) -> bool {
    let path = Path::new(path)
        .canonicalize()
        .unwrap_or_else(|_| PathBuf::from(path));
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    // ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE ...
    mountinfo
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let mount_point = Path::new(*fields.get(4)?);
            let optional = fields.iter().skip(6).take_while(|f| **f != "-");
            let propagates = optional
                .clone()
                .any(|f| f.starts_with("shared:") || f.starts_with("master:"));
            path.starts_with(mount_point)
                .then_some((mount_point.components().count(), propagates))
        })
        .max_by_key(|(depth, _)| *depth)
        .is_some_and(|(_, propagates)| propagates)
}

/// The test overlay: the repository's `deploy/`, the local image, and what this node
/// needs that a usual GPU node would not: where it lacks the NVIDIA runtime, NVML for the
/// node agent (and the mock's configuration beside it); where its `/run` mount is private,
/// no `HostToContainer` propagation, which the container runtime refuses there. Returns
/// the overlay's path and what it changed, for the summary.
fn write_overlay(dir: &Path) -> (String, Vec<String>) {
    // kustomize takes no absolute path for a base: reach it from the overlay.
    let deploy = relative_to(dir, &repo_root().join("deploy"));
    let mut kustomization = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - {deploy}
images:
  - name: ghcr.io/gpuwarden/gpuwarden
    newName: {IMAGE_NAME}
    newTag: {IMAGE_TAG}
",
        deploy = deploy.display()
    );
    let mut notes = Vec::new();
    let mut containers = Vec::new();
    let mut volumes = Vec::new();
    if let Some(root) = std::env::var_os("GPUWARDEN_E2E_DRIVER_ROOT") {
        let root = PathBuf::from(root);
        let lib = nvml_dir(&root);
        let mut dirs = vec![("nvml", lib.clone())];
        // NVIDIA's mock NVML reads <driver root>/config/config.yaml, found from where the
        // library was loaded.
        if root.join("config").is_dir() {
            dirs.push(("nvml-config", root.join("config")));
        }
        let mounts: Vec<Value> = (dirs.iter())
            .map(|(name, path)| json!({"name": name, "mountPath": path, "readOnly": true}))
            .collect();
        volumes.extend(dirs.iter().map(
            |(name, path)| json!({"name": name, "hostPath": {"path": path, "type": "Directory"}}),
        ));
        containers.push(json!({
            "name": "node-agent",
            "env": [{"name": "LD_LIBRARY_PATH", "value": lib}],
            "volumeMounts": mounts,
        }));
        notes.push(format!(
            "node agent given NVML from {} (hostPath, read-only) and LD_LIBRARY_PATH: no NVIDIA runtime on the node",
            lib.display()
        ));
    }
    if !propagates("/var/run") {
        containers.push(json!({
            "name": "runtime-report",
            "volumeMounts": [{"mountPath": "/host/var/run", "mountPropagation": "None"}],
        }));
        notes.push(
            "runtime-report's /host/var/run mount without HostToContainer: the node's /run mount is private, and containerd refuses the container (`path \"/run\" is mounted on \"/\" but it is not a shared or slave mount`)".to_owned(),
        );
    }
    if !containers.is_empty() {
        let mut spec = json!({"containers": containers});
        if !volumes.is_empty() {
            spec["volumes"] = json!(volumes);
        }
        let patch = json!({
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "gpuwarden-node-agent", "namespace": SYSTEM_NAMESPACE},
            "spec": {"template": {"spec": spec}},
        });
        kustomization.push_str(&format!("patches:\n  - patch: |-\n      {patch}\n"));
    }
    std::fs::write(dir.join("kustomization.yaml"), &kustomization).expect("write the overlay");
    eprintln!("overlay {}:\n{kustomization}", dir.display());
    (dir.display().to_string(), notes)
}

/// Every hostPath of the rendered overlay.
fn host_paths(overlay: &str) -> Vec<String> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(map) => {
                if let Some(path) = map.get("hostPath").and_then(|h| h["path"].as_str()) {
                    out.push(path.to_owned());
                }
                map.values().for_each(|v| walk(v, out));
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let rendered = must(&["kustomize", overlay]);
    let docs = parse_documents("kubectl kustomize", &rendered).expect("the rendered overlay");
    let mut out = Vec::new();
    for doc in &docs {
        walk(&doc.value, &mut out);
    }
    out
}

/// The paths to watch, with each one's ancestors: none may appear.
fn watched_paths(overlay: &str) -> BTreeSet<PathBuf> {
    let mut paths = BTreeSet::new();
    for path in NVIDIA_HOST_PATHS
        .iter()
        .map(|p| (*p).to_owned())
        .chain(host_paths(overlay))
    {
        for ancestor in Path::new(&path).ancestors() {
            paths.insert(ancestor.to_path_buf());
        }
    }
    paths
}

/// A privileged busybox pod naming GPUs 0 and 1, as users write them.
fn privileged_gpu_pod(ns: &str, name: &str) -> String {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "train",
                "image": busybox(),
                "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", "env; sleep 3600"],
                "securityContext": {"privileged": true},
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,1"}],
            }],
        },
    })
    .to_string()
}

/// Whether a stored (or dry-run) pod is the rewrite of [`privileged_gpu_pod`].
fn assert_rewritten(pod: &Value) {
    let c = &pod["spec"]["containers"][0];
    assert_eq!(c["securityContext"]["privileged"], false, "{c:#}");
    assert_eq!(c["resources"]["limits"][RESOURCE_GPU], "2", "{c:#}");
    assert!(
        !(c["env"].as_array().into_iter().flatten()).any(|e| e["name"] == "NVIDIA_VISIBLE_DEVICES"),
        "{c:#}"
    );
}

fn is_rewritten(pod: &Value) -> bool {
    let c = &pod["spec"]["containers"][0];
    c["securityContext"]["privileged"] == false && c["resources"]["limits"][RESOURCE_GPU] == "2"
}

/// The webhook's endpoints, ready or not, and its pods.
fn webhook_backends() -> usize {
    let selector = "kubernetes.io/service-name=gpuwarden-webhook";
    let slices = get_json(&["endpointslices", "-n", SYSTEM_NAMESPACE, "-l", selector]);
    let endpoints = slices
        .iter()
        .flat_map(|s| s["items"].as_array().cloned().unwrap_or_default())
        .map(|s| s["endpoints"].as_array().map_or(0, Vec::len))
        .sum::<usize>();
    let pods = get_json(&[
        "pods",
        "-n",
        SYSTEM_NAMESPACE,
        "-l",
        "app.kubernetes.io/name=gpuwarden-webhook",
    ])
    .map_or(0, |p| p["items"].as_array().map_or(0, Vec::len));
    endpoints + pods
}

fn match_condition_names() -> String {
    kubectl::run(&[
        "get",
        "mutatingwebhookconfiguration",
        MUTATING_WEBHOOK_CONFIGURATION,
        "-o",
        "jsonpath={.webhooks[0].matchConditions[*].name}",
    ])
    .stdout
}

/// Whether `kubectl get KIND NAME` finds nothing (its type may be gone with its CRD).
fn gone(kind: &str, name: &str, namespace: Option<&str>) -> bool {
    let mut args = vec!["get", kind, name, "--ignore-not-found", "-o", "name"];
    if let Some(ns) = namespace {
        args.extend_from_slice(&["-n", ns]);
    }
    let out = kubectl::run(&args);
    if out.ok {
        out.stdout.trim().is_empty()
    } else {
        out.stderr
            .contains("the server doesn't have a resource type")
            || out.stderr.contains("NotFound")
    }
}

#[test]
#[ignore = "needs a node: root on a one-node cluster's node with NVIDIA's device plugin, ctr, GPUWARDEN_E2E_DRIVER_ROOT where the node lacks the NVIDIA runtime, KUBECONFIG=... cargo test -p gpuwarden-e2e --test in_cluster -- --ignored --nocapture --test-threads=1"]
fn readme_install_in_cluster_on_a_real_node() {
    assert!(
        std::env::var_os("KUBECONFIG").is_some(),
        "KUBECONFIG is not set: this test installs and uninstalls gpuwarden, so point it at a disposable cluster"
    );
    let test = "readme_install_in_cluster_on_a_real_node";
    let Some(gpu_node) = gpu_node_in(&get_json(&["nodes"]).expect("list nodes")).cloned() else {
        skip(test, NEEDS_GPU_NODE);
        return;
    };
    if let Some(why) = local_node_problem(&gpu_node, &["kubectl", "tar", "sha256sum", "ldd"]) {
        skip(test, &why);
        return;
    }
    // A test before this one may have left gpuwarden-system Terminating: it is waited for.
    refuse_where_installed();
    let mut summary = Vec::new();
    let mut cleanup = Cleanup::default();
    let run_id = format!("{:08x}", rand::random::<u32>());
    let work = tempfile::tempdir().expect("a temporary directory");

    // 1. The image, from this workspace's binaries, imported into the node's containerd.
    let images_before = image_refs();
    assert!(
        !images_before.is_empty(),
        "ctr lists no image in containerd's k8s.io namespace (run as root, on the node)"
    );
    let exempt_image_present = images_before.contains(EXEMPT_IMAGE);
    cleanup.images_before = Some(images_before);
    let binaries = binaries(&mut summary);
    let start = Instant::now();
    let tar = work.path().join("gpuwarden.oci.tar");
    let image_dir = work.path().join("image");
    std::fs::create_dir_all(&image_dir).expect("image directory");
    let digest =
        write_oci_layout(&image_dir, &tar, &image(), &binaries).unwrap_or_else(|e| panic!("{e}"));
    let size = std::fs::metadata(&tar).map_or(0, |m| m.len());
    let import = ctr(&[
        "images",
        "import",
        "--platform",
        "linux/amd64",
        &tar.to_string_lossy(),
    ]);
    assert!(import.ok, "ctr images import failed: {}", import.stderr);
    summary.push(format!(
        "image {} ({digest}, user {IMAGE_USER}): {:.1} MB OCI layout written and imported in {:.1} s",
        image(),
        size as f64 / 1e6,
        start.elapsed().as_secs_f64()
    ));
    // An exempt NVIDIA image: busybox under dcgm-exporter's name.
    if !exempt_image_present {
        let tag = ctr(&["images", "tag", &busybox(), EXEMPT_IMAGE]);
        assert!(tag.ok, "ctr images tag failed: {}", tag.stderr);
    }

    // 2. The overlay, the node, and the host paths before.
    let overlay_dir = work.path().join("overlay");
    std::fs::create_dir_all(&overlay_dir).expect("overlay directory");
    let (overlay, notes) = write_overlay(&overlay_dir);
    summary.extend(notes.into_iter().map(|n| format!("test overlay: {n}")));
    let node = gpu_node["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let labelled = gpu_node["metadata"]["labels"][LABEL_GPU_PRESENT] == "true";
    if !labelled {
        must(&["label", "node", &node, &format!("{LABEL_GPU_PRESENT}=true")]);
        cleanup.labelled_node = Some(node.clone());
    }
    let watched = watched_paths(&overlay);
    let existed: BTreeSet<PathBuf> = watched.iter().filter(|p| p.exists()).cloned().collect();

    // 3. The README's install, with the overlay where it says `-k deploy/`.
    let install = statements(&readme_block_in("Install", "With the manifests"));
    assert_eq!(
        install.iter().filter(|s| s.contains("-k deploy/")).count(),
        1,
        "{install:#?}"
    );
    cleanup.installed = true;
    let mut install_times = Vec::new();
    for statement in &install {
        let statement = statement.replace("-k deploy/", &format!("-k {overlay}"));
        let (out, took) = run_readme(&statement);
        let first = statement.lines().next().unwrap_or_default().to_owned();
        if !out.ok {
            let pods = kubectl::run(&["-n", SYSTEM_NAMESPACE, "get", "pods", "-o", "wide"]).stdout;
            panic!("`{first}` failed after {took:?}: {}\n{pods}", out.stderr);
        }
        if first.starts_with("for ") {
            // Three rollouts of at most five minutes each.
            assert!(took < Duration::from_secs(3 * 300 + 30), "{took:?}");
        }
        install_times.push(format!("`{first}` {:.1} s", took.as_secs_f64()));
    }
    summary.push(format!(
        "install (exit 0 each): {}",
        install_times.join("; ")
    ));
    let images: BTreeSet<String> = must(&[
        "-n",
        SYSTEM_NAMESPACE,
        "get",
        "pods",
        "-o",
        "jsonpath={.items[*].spec.containers[*].image}",
    ])
    .split_whitespace()
    .map(str::to_owned)
    .collect();
    assert_eq!(images, BTreeSet::from([image()]), "the pods run {images:?}");

    // 4. A privileged GPU pod: stored rewritten, running with exactly its two GPUs, and the
    // in-cluster agent lists the same GPUs in the node's GpuNode.
    let ns = format!("gpuwarden-e2e-{run_id}");
    must(&["create", "namespace", &ns]);
    cleanup.namespaces.push(ns.clone());
    let start = Instant::now();
    let created = kubectl::run_stdin(
        &["create", "-f", "-", "-o", "json"],
        &privileged_gpu_pod(&ns, "train"),
    );
    assert!(created.ok, "the GPU pod was refused: {}", created.stderr);
    eprint!("{}", created.stderr);
    let stored: Value = serde_json::from_str(&created.stdout).expect("the stored pod");
    assert_rewritten(&stored);
    let pod_uid = stored["metadata"]["uid"].as_str().expect("uid").to_owned();
    let ready = kubectl::run(&[
        "-n",
        &ns,
        "wait",
        "--for=condition=Ready",
        "pod/train",
        "--timeout=180s",
    ]);
    assert!(
        ready.ok,
        "the rewritten pod never ran: {}\n{}",
        ready.stderr,
        kubectl::run(&["-n", &ns, "describe", "pod", "train"]).stdout
    );
    let running = start.elapsed();
    let log = poll(Duration::from_secs(30), Duration::from_secs(1), || {
        let out = kubectl::run(&["-n", &ns, "logs", "train"]);
        out.stdout
            .contains("NVIDIA_VISIBLE_DEVICES=")
            .then_some(out.stdout)
    })
    .expect("the container printed its environment");
    let seen = visible_in_log(&log);
    assert_eq!(seen.len(), 2, "the process sees {seen:?}");
    assert!(seen.iter().all(|id| id.starts_with("GPU-")), "{seen:?}");
    assert_ne!(seen[0], seen[1]);
    let start = Instant::now();
    let binding = poll(Duration::from_secs(120), Duration::from_secs(2), || {
        let gpunode = get_json(&["gpunode", &node])?;
        (gpunode["status"]["bindings"].as_array()?.iter())
            .find(|b| b["podUid"] == pod_uid.as_str())
            .cloned()
    });
    let Some(binding) = binding else {
        panic!(
            "the GpuNode never listed the pod's binding: {}\nagent log:\n{}",
            kubectl::run(&["get", "gpunode", &node, "-o", "yaml"]).stdout,
            kubectl::run(&[
                "-n",
                SYSTEM_NAMESPACE,
                "logs",
                "ds/gpuwarden-node-agent",
                "-c",
                "node-agent"
            ])
            .stdout
        );
    };
    let mut bound: Vec<String> = (binding["gpuUuids"].as_array().into_iter().flatten())
        .filter_map(|u| u.as_str().map(str::to_owned))
        .collect();
    bound.sort();
    assert_eq!(bound, seen, "{binding:#}");
    assert_eq!(binding["resourceName"], RESOURCE_GPU, "{binding:#}");
    assert_eq!(binding["source"], "Allocated", "{binding:#}");
    summary.push(format!(
        "privileged pod {ns}/train: stored rewritten (unprivileged, {RESOURCE_GPU}: 2, no NVIDIA_VISIBLE_DEVICES), Running after {:.1} s, sees {seen:?}; GpuNode {node} binding {bound:?} after {:.1} s more",
        running.as_secs_f64(),
        start.elapsed().as_secs_f64()
    ));

    // 5. The webhook at 0 replicas: an exempt NVIDIA component is admitted without a call,
    // a privileged GPU pod elsewhere is refused.
    let names = poll(Duration::from_secs(60), Duration::from_secs(1), || {
        let names = match_condition_names();
        names
            .split_whitespace()
            .any(|n| n == NOT_EXEMPT_CONDITION)
            .then_some(names)
    });
    assert!(
        names.is_some(),
        "the operator never wrote the matchCondition {NOT_EXEMPT_CONDITION}: {}",
        match_condition_names()
    );
    must(&[
        "-n",
        SYSTEM_NAMESPACE,
        "scale",
        "deploy/gpuwarden-webhook",
        "--replicas=0",
    ]);
    let start = Instant::now();
    let down = poll(Duration::from_secs(120), Duration::from_secs(1), || {
        (webhook_backends() == 0).then_some(())
    });
    assert!(
        down.is_some(),
        "webhook pods or endpoints remain at 0 replicas"
    );
    let down_after = start.elapsed();
    if gone("namespace", EXEMPT_NAMESPACE, None) {
        let namespace = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": EXEMPT_NAMESPACE,
            "labels": {"pod-security.kubernetes.io/enforce": "privileged"},
        }});
        let out = kubectl::run_stdin(&["create", "-f", "-"], &namespace.to_string());
        assert!(out.ok, "{}", out.stderr);
        cleanup.namespaces.push(EXEMPT_NAMESPACE.to_owned());
    }
    let exporter_name = format!("gpuwarden-e2e-dcgm-exporter-{run_id}");
    cleanup
        .pods
        .push((EXEMPT_NAMESPACE.to_owned(), exporter_name.clone()));
    let exporter = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": exporter_name, "namespace": EXEMPT_NAMESPACE},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "nvidia-dcgm-exporter",
                "image": EXEMPT_IMAGE,
                "imagePullPolicy": "IfNotPresent",
                "command": ["sleep", "3600"],
                "securityContext": {"privileged": true},
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
            }],
        },
    });
    let admitted = kubectl::run_stdin(&["create", "-f", "-", "-o", "json"], &exporter.to_string());
    assert!(
        admitted.ok,
        "the exempt NVIDIA component was refused while the webhook was down: {}",
        admitted.stderr
    );
    let stored: Value = serde_json::from_str(&admitted.stdout).expect("the stored pod");
    let c = &stored["spec"]["containers"][0];
    assert_eq!(c["securityContext"]["privileged"], true, "{c:#}");
    assert!(
        stored["metadata"]["annotations"]
            .get("gpuwarden.io/rewritten")
            .is_none(),
        "{stored:#}"
    );
    // Where the operator keeps the default policy's MutatingAdmissionPolicy, the API server
    // rewrites a plain privileged GPU pod itself, webhook or not; one it leaves to the
    // webhook (a device hostPath) waits for the webhook.
    let in_api_server = !gone("mutatingadmissionpolicy", "gpuwarden-default", None);
    let waits = if in_api_server {
        let rewritten = kubectl::run_stdin(
            &["create", "--dry-run=server", "-f", "-", "-o", "json"],
            &privileged_gpu_pod(&ns, "outage"),
        );
        assert!(
            rewritten.ok,
            "the API server did not admit the pod it rewrites itself while the webhook was down: {}",
            rewritten.stderr
        );
        assert_rewritten(&serde_json::from_str(&rewritten.stdout).expect("the stored pod"));
        let mut pod: Value =
            serde_json::from_str(&privileged_gpu_pod(&ns, "outage")).expect("the pod");
        pod["spec"]["volumes"] = json!([{"name": "gpu0", "hostPath": {"path": "/dev/nvidia0"}}]);
        pod["spec"]["containers"][0]["volumeMounts"] =
            json!([{"name": "gpu0", "mountPath": "/dev/nvidia0"}]);
        pod.to_string()
    } else {
        privileged_gpu_pod(&ns, "outage")
    };
    let refused = kubectl::run_stdin(
        &["create", "--dry-run=server", "-f", "-", "-o", "json"],
        &waits,
    );
    assert!(
        !refused.ok,
        "a privileged GPU pod the webhook judges was admitted with no webhook replica: {}",
        refused.stdout
    );
    assert!(
        refused.stderr.contains("failed calling webhook"),
        "{}",
        refused.stderr
    );
    let _ = kubectl::run(&[
        "delete",
        "pod",
        "-n",
        EXEMPT_NAMESPACE,
        &exporter_name,
        "--wait=false",
    ]);
    must(&[
        "-n",
        SYSTEM_NAMESPACE,
        "scale",
        "deploy/gpuwarden-webhook",
        "--replicas=2",
    ]);
    let start = Instant::now();
    must(&[
        "-n",
        SYSTEM_NAMESPACE,
        "rollout",
        "status",
        "deploy/gpuwarden-webhook",
        "--timeout=5m",
    ]);
    let outage = if in_api_server {
        "plain privileged GPU pod admitted rewritten by the API server; one with a device hostPath, left to the webhook,"
    } else {
        "privileged GPU pod"
    };
    summary.push(format!(
        "webhook at 0 replicas (no endpoint or pod after {:.1} s; matchConditions {}): {EXEMPT_NAMESPACE}/{exporter_name} ({EXEMPT_IMAGE}, privileged) admitted unchanged; {outage} in {ns} refused: {}; back at 2 replicas in {:.1} s",
        down_after.as_secs_f64(),
        names.unwrap_or_default().trim(),
        refused.stderr.lines().next().unwrap_or_default().trim(),
        start.elapsed().as_secs_f64()
    ));

    // 6. The restore of docs/operations.md, "When the webhook is down": delete the
    // configuration, apply the overlay again; a privileged GPU pod is admitted rewritten
    // within 15 seconds of the re-apply.
    let restore_apply = "kubectl apply --server-side -k <your-overlay>";
    let down_section = doc_section(OPERATIONS, "When the webhook is down");
    assert!(
        down_section.contains(&format!("`{restore_apply}`")),
        "{down_section}"
    );
    // The block sits in a list item: `doc_block` takes its fence's indentation off.
    let take_out: Vec<String> = doc_block(OPERATIONS, "When the webhook is down");
    assert_eq!(
        statements(&take_out),
        [format!(
            "kubectl delete mutatingwebhookconfiguration {MUTATING_WEBHOOK_CONFIGURATION}"
        )]
    );
    for statement in statements(&take_out) {
        let (out, _) = run_readme(&statement);
        assert!(out.ok, "`{statement}` failed: {}", out.stderr);
    }
    let start = Instant::now();
    let (out, apply_took) = run_readme(&restore_apply.replace("<your-overlay>", &overlay));
    assert!(out.ok, "the re-apply failed: {}", out.stderr);
    let mut refusals: Vec<String> = Vec::new();
    let probe = privileged_gpu_pod(&ns, "restore-probe");
    let admitted = poll(Duration::from_secs(60), Duration::from_millis(500), || {
        let out = kubectl::run_stdin(
            &["create", "--dry-run=server", "-f", "-", "-o", "json"],
            &probe,
        );
        if out.ok {
            let pod: Value = serde_json::from_str(&out.stdout).ok()?;
            if is_rewritten(&pod) {
                return Some((start.elapsed(), pod));
            }
            refusals.push("admitted unrewritten".into());
        } else {
            // Before the configuration: the backstop; before the caBundle: x509; before
            // kube-proxy has the webhook's endpoints again: connection refused.
            let reason = if out.stderr.contains("x509") {
                "x509"
            } else if out.stderr.contains("ValidatingAdmissionPolicy") {
                "backstop"
            } else if out.stderr.contains("connection refused") {
                "connection refused"
            } else {
                out.stderr.trim()
            };
            refusals.push(reason.to_owned());
        }
        None
    });
    let Some((restored, pod)) = admitted else {
        panic!(
            "no privileged GPU pod admitted rewritten within 60 s of the re-apply: {refusals:?}"
        );
    };
    assert_rewritten(&pod);
    refusals.dedup();
    eprintln!(
        "restore: admitted rewritten {restored:?} after the re-apply began; refused before: {refusals:?}"
    );
    assert!(
        restored <= Duration::from_secs(15),
        "a privileged GPU pod was admitted rewritten {restored:?} after the re-apply, more than 15 s"
    );
    let condition_back = poll(Duration::from_secs(30), Duration::from_secs(1), || {
        match_condition_names()
            .split_whitespace()
            .any(|n| n == NOT_EXEMPT_CONDITION)
            .then_some(())
    });
    assert!(
        condition_back.is_some(),
        "{NOT_EXEMPT_CONDITION} was not written back after the restore"
    );
    summary.push(format!(
        "restore: re-apply took {:.1} s; privileged GPU pod admitted rewritten {:.1} s after the re-apply began (refused before: {refusals:?}); {NOT_EXEMPT_CONDITION} back",
        apply_took.as_secs_f64(),
        restored.as_secs_f64()
    ));

    // 7. The README's uninstall, twice; nothing of the install and no new host path left.
    let rendered = parse_documents("kubectl kustomize", &must(&["kustomize", &overlay]))
        .expect("the rendered overlay");
    let _ = kubectl::run(&["delete", "namespace", &ns, "--wait=false"]);
    let uninstall = statements(&readme_block_in("Uninstall", "With the manifests"));
    let mut uninstall_times = Vec::new();
    for round in 1..=2 {
        let start = Instant::now();
        for statement in &uninstall {
            let (out, _) = run_readme(statement);
            assert!(
                out.ok,
                "uninstall {round}: `{statement}` failed: {}",
                out.stderr
            );
        }
        uninstall_times.push(format!("{:.1} s", start.elapsed().as_secs_f64()));
    }
    cleanup.installed = false;
    let start = Instant::now();
    let ns_gone = poll(Duration::from_secs(180), Duration::from_secs(2), || {
        gone("namespace", SYSTEM_NAMESPACE, None).then_some(())
    });
    let ns_state = if ns_gone.is_some() {
        format!("gone after {:.1} s", start.elapsed().as_secs_f64())
    } else {
        let phase = kubectl::run(&[
            "get",
            "namespace",
            SYSTEM_NAMESPACE,
            "-o",
            "jsonpath={.status.phase}",
        ])
        .stdout;
        assert_eq!(phase, "Terminating", "{SYSTEM_NAMESPACE} is {phase}");
        "still Terminating after 180 s".to_owned()
    };
    let mut left = Vec::new();
    for doc in &rendered {
        if doc.namespace().is_some() || doc.kind() == "Namespace" {
            continue;
        }
        let group = doc.api_version().split_once('/').map_or("", |(g, _)| g);
        let kind = if group.is_empty() {
            doc.kind().to_owned()
        } else {
            format!("{}.{group}", doc.kind())
        };
        if !gone(&kind, doc.name(), None) {
            left.push(doc.id());
        }
    }
    let labelled = must(&[
        "get",
        "validatingadmissionpolicies,validatingadmissionpolicybindings,mutatingwebhookconfigurations,clusterroles,clusterrolebindings,crds",
        "-l",
        "app.kubernetes.io/part-of=gpuwarden",
        "-o",
        "name",
    ]);
    left.extend(labelled.lines().map(str::to_owned));
    assert!(left.is_empty(), "left behind after the uninstall: {left:?}");
    let new_paths: Vec<&PathBuf> = watched
        .iter()
        .filter(|p| !existed.contains(*p) && p.exists())
        .collect();
    assert!(
        new_paths.is_empty(),
        "new on the node after the uninstall: {new_paths:?}"
    );
    summary.push(format!(
        "uninstall twice (exit 0 each): {}; {SYSTEM_NAMESPACE} {ns_state}; no CRD, webhook configuration, admission policy, binding or cluster role left; {} host paths watched ({} absent before, still absent)",
        uninstall_times.join(", "),
        watched.len(),
        watched.len() - existed.len()
    ));

    drop(cleanup);
    eprintln!("\nSUMMARY (in-cluster install on node {node}):");
    for line in &summary {
        eprintln!("- {line}");
    }
}

#[test]
fn the_install_statements_keep_the_rollout_loop_whole() {
    let install = statements(&readme_block_in("Install", "With the manifests"));
    assert_eq!(install.len(), 4, "{install:#?}");
    assert!(install[2].contains("-k deploy/"), "{}", install[2]);
    assert!(
        install[3].starts_with("for ") && install[3].ends_with("done"),
        "{}",
        install[3]
    );
    assert!(install[3].contains("rollout status"), "{}", install[3]);
}
