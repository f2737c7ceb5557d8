//! The Helm chart (`deploy/helm/gpuwarden`).
//!
//! Without a cluster: `helm template` with the default values is the kustomize base, object
//! for object (keyed by apiVersion, kind, namespace and name; parsed, not text), less the
//! chart's pre-delete hook ([`HELM_ONLY`]); with the values that switch on the kustomize
//! components it is the base with those components; a misspelt value fails; `helm lint
//! --strict` passes. The base is `kubectl kustomize deploy/` where `kubectl` is found, else
//! `deploy/install.yaml` (which `crdgen --check` keeps equal to it).
//!
//! On a cluster (ignored): the README's Helm install with the image this workspace builds,
//! a privileged GPU pod rewritten to exactly its GPUs, an exempt NVIDIA pod admitted while
//! the webhook is at 0 replicas, `helm upgrade` with changed values (docs/operations.md,
//! Upgrade), and the README's Helm uninstall, twice, leaving nothing; all of it in a
//! namespace of the test's, not the README's. And a release installed the old way (the chart
//! before it installed into any namespace: stored in kube-system, creating gpuwarden-system)
//! upgraded where it is by docs/operations.md's block, and uninstalled.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use gpuwarden_crds::LABEL_GPU_PRESENT;
use gpuwarden_e2e::cluster::{skip, visible_in_log};
use gpuwarden_e2e::helm::{CHART, HELM_ONLY, helm, helm_required, kubectl as kubectl_binary};
use gpuwarden_e2e::image::write_oci_layout;
use gpuwarden_e2e::install::refuse_where_installed;
use gpuwarden_e2e::kubectl;
use gpuwarden_e2e::manifests::{Document, load_file, parse_documents, repo_root};
use gpuwarden_e2e::node::{
    COMPONENT_BINARIES, NEEDS_GPU_NODE, Out, busybox, ctr, exec, gpu_node_in, image_refs,
    local_node_problem,
};
use gpuwarden_e2e::readme::{OPERATIONS, doc_block_in, readme_block_in, statements};
use serde_json::Value;

/// `helm`, or `None` after printing why the test is skipped (a panic where helm is required).
fn helm_or_skip(test: &str) -> Option<PathBuf> {
    let found = helm();
    if found.is_none() {
        assert!(
            !helm_required(),
            "{test}: helm is required (GPUWARDEN_REQUIRE_HELM=1) but not found: set GPUWARDEN_HELM, or run .ci/run, which installs it into target/tools/"
        );
        eprintln!(
            "SKIPPED {test}: no helm (GPUWARDEN_HELM, target/tools/helm or PATH); .ci/run installs the pinned one"
        );
    }
    found
}

/// `helm ARGS` in the repository root.
fn run_helm(helm: &Path, args: &[&str]) -> Out {
    exec(Command::new(helm).args(args).current_dir(repo_root()), None)
}

/// `helm template` of the chart released in gpuwarden-system with `set` values, CRDs
/// included, as documents.
fn template(helm: &Path, set: &[&str]) -> Vec<Document> {
    template_in(helm, "gpuwarden-system", set)
}

/// `helm template` of the chart released in `namespace` with `set` values, CRDs included.
fn template_in(helm: &Path, namespace: &str, set: &[&str]) -> Vec<Document> {
    let mut args = vec![
        "template",
        "gpuwarden",
        CHART,
        "--namespace",
        namespace,
        "--include-crds",
    ];
    for s in set {
        args.extend_from_slice(&["--set", s]);
    }
    let out = run_helm(helm, &args);
    assert!(out.ok, "helm {} failed: {}", args.join(" "), out.stderr);
    parse_documents("helm template", &out.stdout).unwrap_or_else(|e| panic!("{e}"))
}

/// Documents keyed by apiVersion, kind, namespace and name; a key twice is an error.
fn keyed(docs: Vec<Document>) -> BTreeMap<(String, String, String, String), Value> {
    let mut out = BTreeMap::new();
    for doc in docs {
        let key = (
            doc.api_version().to_owned(),
            doc.kind().to_owned(),
            doc.namespace().unwrap_or_default().to_owned(),
            doc.name().to_owned(),
        );
        assert!(
            out.insert(key.clone(), normalized(doc.value)).is_none(),
            "{key:?} twice in {}",
            doc.source
        );
    }
    out
}

/// `value` with every integral number as an integer: YAML writers differ on `0` and `0.0`
/// (the CRDs' `minimum`), which mean the same to the API server.
fn normalized(value: Value) -> Value {
    match value {
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 9.0e15 => {
                #[allow(clippy::cast_possible_truncation)]
                let i = f as i64;
                Value::from(i)
            }
            _ => Value::Number(n),
        },
        Value::Array(items) => Value::Array(items.into_iter().map(normalized).collect()),
        Value::Object(map) => {
            Value::Object(map.into_iter().map(|(k, v)| (k, normalized(v))).collect())
        }
        other => other,
    }
}

/// Where `a` and `b` first differ, as a JSON path with both values.
fn first_difference(a: &Value, b: &Value, path: &str) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => x
            .keys()
            .chain(y.keys().filter(|k| !x.contains_key(*k)))
            .find_map(|k| {
                first_difference(
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    &format!("{path}.{k}"),
                )
            }),
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (a, b))| first_difference(a, b, &format!("{path}[{i}]"))),
        _ if a == b => None,
        _ => Some(format!("{path}: base {a} / chart {b}")),
    }
}

/// The chart's objects less its pre-delete hook, which must be exactly [`HELM_ONLY`], each
/// annotated as a pre-delete hook.
fn without_hook(docs: Vec<Document>) -> Vec<Document> {
    let (hooks, rest): (Vec<Document>, Vec<Document>) = docs
        .into_iter()
        .partition(|d| !d.value["metadata"]["annotations"]["helm.sh/hook"].is_null());
    let mut names: Vec<String> = hooks
        .iter()
        .map(|d| format!("{}/{}", d.kind(), d.name()))
        .collect();
    names.sort();
    let mut expected: Vec<String> = HELM_ONLY.iter().map(|s| (*s).to_owned()).collect();
    expected.sort();
    assert_eq!(names, expected, "the chart's Helm-only objects");
    for hook in &hooks {
        assert_eq!(
            hook.value["metadata"]["annotations"]["helm.sh/hook"],
            "pre-delete",
            "{}",
            hook.id()
        );
    }
    rest
}

/// What kustomize renders from `dir` (relative to the repository root), or None without
/// kubectl.
fn kustomize(dir: &Path) -> Option<Vec<Document>> {
    let kubectl = kubectl_binary()?;
    let out = exec(Command::new(kubectl).arg("kustomize").arg(dir), None);
    assert!(
        out.ok,
        "kubectl kustomize {} failed: {}",
        dir.display(),
        out.stderr
    );
    Some(parse_documents("kubectl kustomize", &out.stdout).unwrap_or_else(|e| panic!("{e}")))
}

/// `docs` less the Namespace object: a release made with `helm install -n NS
/// --create-namespace` finds its namespace made by Helm, not by the chart.
fn without_namespace(docs: Vec<Document>) -> Vec<Document> {
    docs.into_iter()
        .filter(|d| d.kind() != "Namespace")
        .collect()
}

/// `value` with gpuwarden-system renamed `to` in every string: the base as it would read
/// installed elsewhere.
fn renamed(value: Value, to: &str) -> Value {
    match value {
        Value::String(s) => Value::String(s.replace("gpuwarden-system", to)),
        Value::Array(items) => Value::Array(items.into_iter().map(|v| renamed(v, to)).collect()),
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (k.replace("gpuwarden-system", to), renamed(v, to)))
                .collect(),
        ),
        other => other,
    }
}

/// The kustomize base, or deploy/install.yaml where there is no kubectl, and which it is.
fn base() -> (Vec<Document>, &'static str) {
    match kustomize(&repo_root().join("deploy")) {
        Some(docs) => (docs, "kubectl kustomize deploy/"),
        None => (
            load_file("deploy/install.yaml").unwrap_or_else(|e| panic!("{e}")),
            "deploy/install.yaml (no kubectl)",
        ),
    }
}

/// Every difference between two keyed sets, for the assertion message.
fn differences(
    base: &BTreeMap<(String, String, String, String), Value>,
    chart: &BTreeMap<(String, String, String, String), Value>,
) -> Vec<String> {
    let mut out = Vec::new();
    for (key, value) in base {
        match chart.get(key) {
            None => out.push(format!("only in the base: {key:?}")),
            Some(v) if v != value => out.push(format!(
                "differs: {key:?} at {}",
                first_difference(value, v, "").unwrap_or_default()
            )),
            Some(_) => {}
        }
    }
    for key in chart.keys().filter(|k| !base.contains_key(*k)) {
        out.push(format!("only in the chart: {key:?}"));
    }
    out
}

#[test]
fn default_values_render_the_kustomize_base_object_for_object() {
    let Some(helm) = helm_or_skip("default_values_render_the_kustomize_base_object_for_object")
    else {
        return;
    };
    let (docs, from) = base();
    let base = keyed(without_namespace(docs.clone()));
    let chart = keyed(without_hook(template(&helm, &[])));
    let diff = differences(&base, &chart);
    assert!(
        diff.is_empty(),
        "helm template -n gpuwarden-system vs {from}:\n{}",
        diff.join("\n")
    );
    eprintln!(
        "helm template == {from} less its Namespace: {} objects",
        base.len()
    );

    // The release installed the old way (stored in kube-system, creating gpuwarden-system)
    // renders the whole base, the Namespace with its Pod Security label included.
    let old_way = ["namespace.create=true", "namespace.name=gpuwarden-system"];
    let chart = keyed(without_hook(template_in(&helm, "kube-system", &old_way)));
    let diff = differences(&keyed(docs), &chart);
    assert!(
        diff.is_empty(),
        "the old way vs {from}:\n{}",
        diff.join("\n")
    );
}

#[test]
fn a_release_in_any_namespace_renders_the_base_moved_there() {
    let Some(helm) = helm_or_skip("a_release_in_any_namespace_renders_the_base_moved_there") else {
        return;
    };
    let (docs, from) = base();
    let moved: Vec<Document> = without_namespace(docs)
        .into_iter()
        .map(|d| Document {
            value: renamed(d.value, "gpu-guard"),
            ..d
        })
        .collect();
    let chart = template_in(&helm, "gpu-guard", &[]);
    let named = (chart.iter()).find(|d| d.value.to_string().contains("gpuwarden-system"));
    assert!(
        named.is_none(),
        "still names gpuwarden-system: {:?}",
        named.map(Document::id)
    );
    let diff = differences(&keyed(moved), &keyed(without_hook(chart)));
    assert!(
        diff.is_empty(),
        "helm template -n gpu-guard vs {from} moved to gpu-guard:\n{}",
        diff.join("\n")
    );
}

#[test]
fn the_kustomize_example_moves_the_base_to_its_namespace() {
    let test = "the_kustomize_example_moves_the_base_to_its_namespace";
    let Some(overlay) = kustomize(&repo_root().join("docs/examples/any-namespace")) else {
        assert!(
            !helm_required(),
            "{test}: kubectl is required (kubectl kustomize)"
        );
        eprintln!("SKIPPED {test}: no kubectl for `kubectl kustomize`");
        return;
    };
    let (docs, _) = base();
    let moved = keyed(
        (docs.into_iter())
            .map(|d| Document {
                value: renamed(d.value, "gpuwarden"),
                ..d
            })
            .collect(),
    );
    // kustomize puts its namespace on the cluster-scoped kinds it does not know
    // (ValidatingAdmissionPolicies, GpuPolicy); the API server drops it from such objects.
    let cluster_scoped: Vec<(String, String, String)> = (moved.keys())
        .filter(|k| k.2.is_empty())
        .map(|k| (k.0.clone(), k.1.clone(), k.3.clone()))
        .collect();
    let overlay: Vec<Document> = (overlay.into_iter())
        .map(|mut d| {
            let key = (
                d.api_version().to_owned(),
                d.kind().to_owned(),
                d.name().to_owned(),
            );
            if cluster_scoped.contains(&key)
                && let Some(meta) = d.value["metadata"].as_object_mut()
            {
                meta.remove("namespace");
            }
            d
        })
        .collect();
    let diff = differences(&moved, &keyed(overlay));
    assert!(
        diff.is_empty(),
        "docs/examples/any-namespace:\n{}",
        diff.join("\n")
    );
}

#[test]
fn component_values_render_the_base_with_those_components() {
    let test = "component_values_render_the_base_with_those_components";
    let Some(helm) = helm_or_skip(test) else {
        return;
    };
    let work = tempfile::tempdir().expect("a temporary directory");
    let deploy = repo_root().join("deploy");
    let overlay = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - {d}
components:
  - {d}/components/host-pid
  - {d}/components/node-agent-privileged
  - {d}/components/taint-unhealthy-nodes
  - {d}/components/monitoring
",
        d = pathdiff(work.path(), &deploy)
    );
    std::fs::write(work.path().join("kustomization.yaml"), overlay).expect("write the overlay");
    let Some(base) = kustomize(work.path()) else {
        assert!(
            !helm_required(),
            "{test}: kubectl is required with helm (kubectl kustomize)"
        );
        eprintln!("SKIPPED {test}: no kubectl for `kubectl kustomize`");
        return;
    };
    let chart = template(
        &helm,
        &[
            "nodeAgent.hostPID=true",
            "nodeAgent.privileged=true",
            "operator.taintUnhealthyNodes=true",
            "monitoring.podMonitor.enabled=true",
            "monitoring.dashboard.enabled=true",
        ],
    );
    let diff = differences(&keyed(without_namespace(base)), &keyed(without_hook(chart)));
    assert!(diff.is_empty(), "{}", diff.join("\n"));
}

/// `to` relative to `from` (kustomize takes no absolute path for a base).
fn pathdiff(from: &Path, to: &Path) -> String {
    let from = from.canonicalize().expect("the overlay directory");
    let to = to.canonicalize().expect("deploy/");
    let ups = from.components().count() - 1;
    let mut out = PathBuf::new();
    for _ in 0..ups {
        out.push("..");
    }
    out.join(to.strip_prefix("/").unwrap_or(&to))
        .display()
        .to_string()
}

#[test]
fn values_reach_the_objects_they_name() {
    let Some(helm) = helm_or_skip("values_reach_the_objects_they_name") else {
        return;
    };
    let digest = format!("sha256:{}", "ab".repeat(32));
    let chart = keyed(template(
        &helm,
        &[
            "image.repository=registry.example/gw",
            "image.tag=9.9.9",
            &format!("image.digest={digest}"),
            "imagePullSecrets[0].name=regcred",
            "webhook.replicas=3",
            "webhook.podDisruptionBudget.minAvailable=2",
            "webhook.resources.limits.memory=1Gi",
            "operator.replicas=1",
            "operator.admissionPolicies=false",
            "operator.policyReports=false",
            "nodeAgent.nodeSelector.pool=gpu",
            "nodeAgent.tolerations[0].operator=Exists",
            "nodeAgent.priorityClassName=system-node-critical",
            "defaultPolicy.mode=Audit",
            "defaultPolicy.exemptions.namespaces[0]=ml-infra",
            "defaultPolicy.kaiSharing.enabled=true",
            "defaultPolicy.kaiSharing.binder=kai/binder",
        ],
    ));
    let get = |kind: &str, name: &str| -> &Value {
        chart
            .iter()
            .find(|((_, k, _, n), _)| k == kind && n == name)
            .map(|(_, v)| v)
            .unwrap_or_else(|| panic!("no {kind}/{name}"))
    };
    let image = format!("registry.example/gw:9.9.9@{digest}");
    for (kind, name) in [
        ("Deployment", "gpuwarden-webhook"),
        ("Deployment", "gpuwarden-operator"),
        ("DaemonSet", "gpuwarden-node-agent"),
        ("Job", "gpuwarden-uninstall"),
    ] {
        let spec = &get(kind, name)["spec"]["template"]["spec"];
        for c in spec["containers"].as_array().expect("containers") {
            assert_eq!(c["image"], image.as_str(), "{kind}/{name}");
        }
        assert_eq!(
            spec["imagePullSecrets"][0]["name"], "regcred",
            "{kind}/{name}"
        );
    }
    let webhook = get("Deployment", "gpuwarden-webhook");
    assert_eq!(webhook["spec"]["replicas"], 3);
    assert_eq!(
        webhook["spec"]["template"]["spec"]["containers"][0]["resources"],
        serde_json::json!({"limits": {"memory": "1Gi"}})
    );
    assert_eq!(
        get("PodDisruptionBudget", "gpuwarden-webhook")["spec"]["minAvailable"],
        2
    );
    let operator = get("Deployment", "gpuwarden-operator");
    assert_eq!(operator["spec"]["replicas"], 1);
    let env = &operator["spec"]["template"]["spec"]["containers"][0]["env"];
    for variable in ["GPUWARDEN_ADMISSION_POLICIES", "GPUWARDEN_POLICY_REPORTS"] {
        assert!(
            env.as_array()
                .expect("env")
                .iter()
                .any(|e| e["name"] == variable && e["value"] == "false"),
            "{variable}: {env}"
        );
    }
    let agent = &get("DaemonSet", "gpuwarden-node-agent")["spec"]["template"]["spec"];
    assert_eq!(agent["nodeSelector"], serde_json::json!({"pool": "gpu"}));
    assert_eq!(
        agent["tolerations"],
        serde_json::json!([{"operator": "Exists"}])
    );
    assert_eq!(agent["priorityClassName"], "system-node-critical");
    let policy = &get("GpuPolicy", "default")["spec"];
    assert_eq!(policy["mode"], "Audit");
    let namespaces = policy["exemptions"]["namespaces"]
        .as_array()
        .expect("namespaces");
    assert_eq!(namespaces.last().and_then(Value::as_str), Some("ml-infra"));
    assert!(
        namespaces.iter().any(|n| n == "kube-system"),
        "{namespaces:?}"
    );
    assert_eq!(
        policy["gpu"]["sharing"]["kai"],
        serde_json::json!({"binder": "kai/binder"})
    );
    // Off: no PodDisruptionBudget for the webhook.
    let off = keyed(template(
        &helm,
        &["webhook.podDisruptionBudget.enabled=false"],
    ));
    assert!(
        !off.keys()
            .any(|(_, k, _, n)| k == "PodDisruptionBudget" && n == "gpuwarden-webhook")
    );
}

#[test]
fn a_misspelt_value_fails_template_and_lint() {
    let Some(helm) = helm_or_skip("a_misspelt_value_fails_template_and_lint") else {
        return;
    };
    for (set, key) in [
        ("webhok.replicas=1", "webhok"),
        ("webhook.replica=1", "replica"),
        ("nodeAgent.tolerations[0].efect=NoSchedule", "efect"),
        ("defaultPolicy.exemptions.namespace[0]=x", "namespace"),
    ] {
        let out = run_helm(
            &helm,
            &[
                "template",
                "gpuwarden",
                CHART,
                "-n",
                "kube-system",
                "--set",
                set,
            ],
        );
        assert!(!out.ok, "--set {set} was accepted");
        assert!(
            out.stderr.contains("additional properties") && out.stderr.contains(key),
            "--set {set}: {}",
            out.stderr
        );
        let lint = run_helm(&helm, &["lint", "--strict", CHART, "--set", set]);
        assert!(!lint.ok, "helm lint --set {set} passed");
    }
    let bad = run_helm(
        &helm,
        &[
            "template",
            "gpuwarden",
            CHART,
            "-n",
            "kube-system",
            "--set",
            "defaultPolicy.mode=enforce",
        ],
    );
    assert!(!bad.ok, "mode enforce (lower case) was accepted");
    // The release may not live in the namespace it creates and deletes.
    let same = run_helm(
        &helm,
        &[
            "template",
            "gpuwarden",
            CHART,
            "-n",
            "gpuwarden-system",
            "--set",
            "namespace.create=true",
        ],
    );
    assert!(
        !same.ok
            && same.stderr.contains("namespace.create")
            && same.stderr.contains("--create-namespace"),
        "{}",
        same.stderr
    );
    let bad_name = run_helm(
        &helm,
        &[
            "template",
            "gpuwarden",
            CHART,
            "--set",
            "namespace.name=Not_A_Name",
        ],
    );
    assert!(!bad_name.ok, "namespace.name Not_A_Name was accepted");
    let own = run_helm(
        &helm,
        &["template", "gpuwarden", CHART, "-n", "gpuwarden-system"],
    );
    assert!(own.ok, "{}", own.stderr);
    assert!(!own.stdout.contains("kind: Namespace"));
}

#[test]
fn the_chart_passes_strict_lint() {
    let Some(helm) = helm_or_skip("the_chart_passes_strict_lint") else {
        return;
    };
    let out = run_helm(&helm, &["lint", "--strict", CHART]);
    assert!(
        out.ok,
        "helm lint --strict {CHART}: {}{}",
        out.stdout, out.stderr
    );
}

// ---------------------------------------------------------------------------------------
// On a cluster.

/// The image the test builds and imports, and the release's values that point at it.
const IMAGE_REPOSITORY: &str = "localhost/gpuwarden";
const IMAGE_TAG: &str = "helm-e2e";
/// An NVIDIA component the default policy exempts in `gpu-operator` (busybox, tagged so).
const EXEMPT_IMAGE: &str = "nvcr.io/nvidia/k8s/dcgm-exporter:4.5.3-4.8.2-distroless";
const EXEMPT_NAMESPACE: &str = "gpu-operator";
/// A namespace the upgrade adds to the default policy's exemptions.
const UPGRADE_EXEMPT: &str = "gpuwarden-helm-e2e-upgraded";
/// Where the test installs gpuwarden: not the README's namespace, to show any works.
const HELM_NAMESPACE: &str = "gpuwarden-helm";

/// A statement of the docs with gpuwarden's namespace the test's.
fn moved(statement: &str) -> String {
    statement.replace("gpuwarden-system", HELM_NAMESPACE)
}
/// One README statement through bash in the repository root, `helm` from [`helm`] first
/// on `PATH`; its output and duration.
fn run_statement(helm: &Path, statement: &str) -> (Out, Duration) {
    eprintln!("$ {statement}");
    let dir = helm.parent().map(Path::to_path_buf).unwrap_or_default();
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let start = Instant::now();
    let out = exec(
        Command::new("bash")
            .arg("-c")
            .arg(statement)
            .env("PATH", path)
            .current_dir(repo_root()),
        None,
    );
    eprint!("{}{}", out.stdout, out.stderr);
    (out, start.elapsed())
}

/// What the test adds to each `helm upgrade`: where it patched the node agent for this node
/// ([`node_patch`]), Helm's server-side apply would refuse to set those fields back, so it
/// takes them back (and the test patches them again).
fn upgrade_flags() -> &'static str {
    if node_patch().is_some() {
        " --force-conflicts"
    } else {
        ""
    }
}

/// The image values the test adds to each `helm install` and `helm upgrade`.
fn image_values() -> String {
    format!(
        " --set image.repository={IMAGE_REPOSITORY} --set image.tag={IMAGE_TAG} --set image.pullPolicy=Never"
    )
}

/// What the test made, removed on drop (also when it fails).
struct Cleanup {
    helm: PathBuf,
    installed: bool,
    namespaces: Vec<String>,
    images_before: Option<std::collections::BTreeSet<String>>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if std::mem::take(&mut self.installed) {
            for block in [
                readme_block_in("Uninstall", "With Helm"),
                readme_block_in("Uninstall", "With the manifests"),
            ] {
                for statement in statements(&block) {
                    let _ = run_statement(&self.helm, &moved(&statement));
                }
            }
        }
        for ns in std::mem::take(&mut self.namespaces) {
            let _ = kubectl::run(&[
                "delete",
                "namespace",
                &ns,
                "--ignore-not-found",
                "--wait=false",
            ]);
        }
        if let Some(before) = self.images_before.take() {
            for image in image_refs().difference(&before) {
                let _ = ctr(&["images", "rm", image]);
            }
        }
    }
}

/// The node adaptations the in-cluster test's overlay makes, as a strategic merge patch of
/// the node agent: NVML from `GPUWARDEN_E2E_DRIVER_ROOT` where the node has no NVIDIA
/// runtime, and no `HostToContainer` where the node's `/run` mount is private. None where
/// the node needs neither.
fn node_patch() -> Option<String> {
    let mut containers = Vec::new();
    let mut volumes = Vec::new();
    if let Some(root) = std::env::var_os("GPUWARDEN_E2E_DRIVER_ROOT") {
        let root = PathBuf::from(root);
        let lib = ["usr/lib64", "usr/lib/x86_64-linux-gnu", "lib64", "usr/lib"]
            .iter()
            .map(|d| root.join(d))
            .find(|d| d.join("libnvidia-ml.so.1").exists())
            .unwrap_or_else(|| panic!("no libnvidia-ml.so.1 under {}", root.display()));
        let mut dirs = vec![("nvml", lib.clone())];
        if root.join("config").is_dir() {
            dirs.push(("nvml-config", root.join("config")));
        }
        volumes.extend(dirs.iter().map(|(name, path)| {
            serde_json::json!({"name": name, "hostPath": {"path": path, "type": "Directory"}})
        }));
        containers.push(serde_json::json!({
            "name": "node-agent",
            "env": [{"name": "LD_LIBRARY_PATH", "value": lib}],
            "volumeMounts": dirs.iter().map(|(name, path)| serde_json::json!({"name": name, "mountPath": path, "readOnly": true})).collect::<Vec<_>>(),
        }));
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let run_propagates = mountinfo.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        matches!(f.get(4), Some(&"/run") | Some(&"/var/run") | Some(&"/"))
            && f.iter()
                .skip(6)
                .take_while(|x| **x != "-")
                .any(|x| x.starts_with("shared:") || x.starts_with("master:"))
    });
    if !run_propagates {
        containers.push(serde_json::json!({
            "name": "runtime-report",
            "volumeMounts": [{"name": "host-var-run", "mountPath": "/host/var/run", "mountPropagation": "None"}],
        }));
    }
    if containers.is_empty() {
        return None;
    }
    Some(serde_json::json!({"spec": {"template": {"spec": {"containers": containers, "volumes": volumes}}}}).to_string())
}

/// The image of this workspace's binaries, imported into the node's containerd, and the
/// exempt NVIDIA image tagged from busybox where the node lacks it; returns the images
/// there were before.
fn import_image() -> std::collections::BTreeSet<String> {
    let before = image_refs();
    assert!(
        !before.is_empty(),
        "ctr lists no image (run as root, on the node)"
    );
    let exempt_present = before.contains(EXEMPT_IMAGE);
    let dir = std::env::var_os("GPUWARDEN_E2E_BINARIES").map_or_else(
        || {
            std::env::var_os("CARGO_TARGET_DIR")
                .map_or_else(|| repo_root().join("target"), PathBuf::from)
                .join("release")
        },
        PathBuf::from,
    );
    let binaries: Vec<PathBuf> = COMPONENT_BINARIES.iter().map(|b| dir.join(b)).collect();
    for b in &binaries {
        assert!(
            b.is_file(),
            "{} is missing: cargo build --release -p gpuwarden-webhook -p gpuwarden-operator -p gpuwarden-node-agent, or set GPUWARDEN_E2E_BINARIES",
            b.display()
        );
    }
    let work = tempfile::tempdir().expect("a temporary directory");
    let tar = work.path().join("gpuwarden.oci.tar");
    let image_dir = work.path().join("image");
    std::fs::create_dir_all(&image_dir).expect("image directory");
    let image = format!("{IMAGE_REPOSITORY}:{IMAGE_TAG}");
    write_oci_layout(&image_dir, &tar, &image, &binaries).unwrap_or_else(|e| panic!("{e}"));
    let import = ctr(&[
        "images",
        "import",
        "--platform",
        "linux/amd64",
        &tar.to_string_lossy(),
    ]);
    assert!(import.ok, "ctr images import failed: {}", import.stderr);
    if !exempt_present {
        let tag = ctr(&["images", "tag", &busybox(), EXEMPT_IMAGE]);
        assert!(tag.ok, "ctr images tag failed: {}", tag.stderr);
    }
    before
}

fn patch_node_agent() {
    patch_node_agent_in(HELM_NAMESPACE);
}

fn patch_node_agent_in(namespace: &str) {
    if let Some(patch) = node_patch() {
        kubectl::must(&[
            "-n",
            namespace,
            "patch",
            "ds/gpuwarden-node-agent",
            "--type=strategic",
            "-p",
            &patch,
        ]);
    }
}

/// The cluster's gpuwarden objects: by the label every one carries, by name, the
/// operator's kept admission policies and claim templates, and the webhook's `caBundle`.
fn leftovers() -> Vec<String> {
    let mut out = Vec::new();
    let by_label = [
        (
            "app.kubernetes.io/part-of=gpuwarden",
            "clusterroles,clusterrolebindings,validatingadmissionpolicies,validatingadmissionpolicybindings,mutatingwebhookconfigurations,customresourcedefinitions,namespaces",
        ),
        (
            "app.kubernetes.io/part-of=gpuwarden",
            "serviceaccounts,jobs,pods,secrets,configmaps,roles,rolebindings,deployments,daemonsets,services",
        ),
        (
            "app.kubernetes.io/managed-by=gpuwarden-operator",
            "validatingadmissionpolicies,validatingadmissionpolicybindings",
        ),
    ];
    for (selector, kinds) in by_label {
        let o = kubectl::run(&["get", kinds, "-A", "-l", selector, "-o", "name"]);
        out.extend(o.stdout.lines().map(str::to_owned));
    }
    for kind in [
        "mutatingadmissionpolicies",
        "mutatingadmissionpolicybindings",
    ] {
        let o = kubectl::run(&[
            "get",
            kind,
            "-l",
            "app.kubernetes.io/part-of=gpuwarden",
            "-o",
            "name",
        ]);
        out.extend(o.stdout.lines().map(str::to_owned));
    }
    let o = kubectl::run(&[
        "get",
        "resourceclaimtemplates",
        "-A",
        "-l",
        "gpuwarden.io/claim-template",
        "-o",
        "name",
    ]);
    out.extend(o.stdout.lines().map(str::to_owned));
    for (kind, name) in [
        ("namespace", HELM_NAMESPACE),
        ("crd", "gpupolicies.gpuwarden.io"),
        ("crd", "gpunodes.gpuwarden.io"),
        ("mutatingwebhookconfiguration", "gpuwarden"),
        ("clusterrole", "gpuwarden-operator"),
        ("clusterrole", "gpuwarden-uninstall"),
        ("validatingadmissionpolicy", "gpuwarden-privileged-gpu-pods"),
    ] {
        let o = kubectl::run(&["get", kind, name, "--ignore-not-found", "-o", "name"]);
        out.extend(o.stdout.lines().map(str::to_owned));
    }
    out.sort();
    out.dedup();
    out
}

/// What a test that installs gpuwarden on this machine's GPU node needs: KUBECONFIG, helm
/// (returned), a GPU node that is this machine, with `tools` besides kubectl, tar, sha256sum
/// and ldd, and no gpuwarden installed. None, after saying why, where the test is skipped.
fn on_a_gpu_node(test: &str, tools: &[&str]) -> Option<PathBuf> {
    assert!(
        std::env::var_os("KUBECONFIG").is_some(),
        "KUBECONFIG is not set: this test installs and uninstalls gpuwarden, so point it at a disposable cluster"
    );
    let helm = helm_or_skip(test)?;
    let helm = helm.canonicalize().unwrap_or(helm);
    let Some(gpu_node) = gpu_node_in(&kubectl::get_json(&["nodes"]).expect("list nodes")).cloned()
    else {
        skip(test, NEEDS_GPU_NODE);
        return None;
    };
    let mut needed = vec!["kubectl", "tar", "sha256sum", "ldd"];
    needed.extend_from_slice(tools);
    if let Some(why) = local_node_problem(&gpu_node, &needed) {
        skip(test, &why);
        return None;
    }
    refuse_where_installed();
    Some(helm)
}

#[test]
#[ignore = "needs a cluster: root on a one-node cluster's node with NVIDIA's device plugin, ctr, helm; KUBECONFIG=... cargo test -p gpuwarden-e2e --test helm -- --ignored --nocapture --test-threads=1"]
fn helm_install_upgrade_and_uninstall_on_a_real_node() {
    let test = "helm_install_upgrade_and_uninstall_on_a_real_node";
    let Some(helm) = on_a_gpu_node(test, &[]) else {
        return;
    };
    let mut summary = Vec::new();
    let mut cleanup = Cleanup {
        helm: helm.clone(),
        installed: false,
        namespaces: Vec::new(),
        images_before: None,
    };

    // 1. The image from this workspace's binaries, imported into the node's containerd.
    let before = import_image();
    cleanup.images_before = Some(before);

    // 2. The README's Helm install, with the image values; the node's adaptations patched
    // onto the node agent before the rollout loop.
    let install = statements(&readme_block_in("Install", "With Helm"));
    assert!(
        install.iter().any(|s| s.starts_with("helm install ")),
        "{install:#?}"
    );
    cleanup.installed = true;
    for statement in &install {
        let statement = if statement.starts_with("helm install ") {
            format!("{}{}", moved(statement), image_values())
        } else {
            moved(statement)
        };
        if statement.starts_with("for ") {
            patch_node_agent();
        }
        let (out, took) = run_statement(&helm, &statement);
        assert!(
            out.ok,
            "`{statement}` failed after {took:?}: {}\n{}",
            out.stderr,
            kubectl::run(&["-n", HELM_NAMESPACE, "get", "pods", "-o", "wide"]).stdout
        );
        summary.push(format!(
            "`{}` {:.1} s",
            statement.lines().next().unwrap_or_default(),
            took.as_secs_f64()
        ));
    }
    let ready = default_policy_ready();
    assert!(
        ready,
        "the default GpuPolicy never became Ready: {}",
        kubectl::run(&["get", "gpupolicy", "default", "-o", "yaml"]).stdout
    );
    summary.push("GpuPolicy default Ready".into());

    // 3. A privileged GPU pod naming GPUs 0,1: stored rewritten, runs with exactly two.
    let ns = format!("gpuwarden-helm-e2e-{:08x}", rand::random::<u32>());
    kubectl::must(&["create", "namespace", &ns]);
    cleanup.namespaces.push(ns.clone());
    let pod = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "train", "namespace": ns},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": [{
            "name": "train", "image": busybox(), "imagePullPolicy": "IfNotPresent",
            "command": ["sh", "-c", "env; sleep 3600"],
            "securityContext": {"privileged": true},
            "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,1"}],
        }]},
    });
    let created = kubectl::run_stdin(&["create", "-f", "-", "-o", "json"], &pod.to_string());
    assert!(created.ok, "the GPU pod was refused: {}", created.stderr);
    let stored: Value = serde_json::from_str(&created.stdout).expect("the stored pod");
    let c = &stored["spec"]["containers"][0];
    assert_eq!(c["securityContext"]["privileged"], false, "{c:#}");
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "2", "{c:#}");
    let running = kubectl::run(&[
        "-n",
        &ns,
        "wait",
        "--for=condition=Ready",
        "pod/train",
        "--timeout=180s",
    ]);
    assert!(
        running.ok,
        "the rewritten pod never ran: {}",
        kubectl::run(&["-n", &ns, "describe", "pod", "train"]).stdout
    );
    let log = kubectl::poll(Duration::from_secs(30), Duration::from_secs(1), || {
        let o = kubectl::run(&["-n", &ns, "logs", "train"]);
        o.stdout
            .contains("NVIDIA_VISIBLE_DEVICES=")
            .then_some(o.stdout)
    })
    .expect("the container printed its environment");
    let seen = visible_in_log(&log);
    assert_eq!(seen.len(), 2, "the process sees {seen:?}");
    assert!(
        seen.iter().all(|id| id.starts_with("GPU-")) && seen[0] != seen[1],
        "{seen:?}"
    );
    summary.push(format!(
        "privileged pod rewritten (nvidia.com/gpu: 2), sees {seen:?}"
    ));

    // 4. The webhook at 0 replicas: an exempt NVIDIA component is admitted.
    let condition = kubectl::poll(Duration::from_secs(60), Duration::from_secs(1), || {
        let names = kubectl::run(&[
            "get",
            "mutatingwebhookconfiguration",
            "gpuwarden",
            "-o",
            "jsonpath={.webhooks[0].matchConditions[*].name}",
        ])
        .stdout;
        names.contains("gpuwarden-not-exempt").then_some(names)
    });
    assert!(
        condition.is_some(),
        "the operator never wrote gpuwarden-not-exempt"
    );
    // Through the release's values: a `kubectl scale` would own the field, and the
    // upgrade below would then conflict with it.
    let (out, _) = run_statement(
        &helm,
        &format!(
            "helm upgrade gpuwarden {CHART} --namespace {HELM_NAMESPACE} --reuse-values --set webhook.replicas=0{}",
            upgrade_flags()
        ),
    );
    assert!(out.ok, "scaling the webhook to 0 failed: {}", out.stderr);
    patch_node_agent();
    let down = kubectl::poll(Duration::from_secs(120), Duration::from_secs(1), || {
        let pods = kubectl::get_json(&[
            "pods",
            "-n",
            HELM_NAMESPACE,
            "-l",
            "app.kubernetes.io/name=gpuwarden-webhook",
        ])?;
        pods["items"].as_array()?.is_empty().then_some(())
    });
    assert!(down.is_some(), "webhook pods remain at 0 replicas");
    if kubectl::run(&["get", "namespace", EXEMPT_NAMESPACE]).ok {
        // Someone else's: only the test's pod is removed.
    } else {
        kubectl::must(&["create", "namespace", EXEMPT_NAMESPACE]);
        cleanup.namespaces.push(EXEMPT_NAMESPACE.into());
    }
    let exporter = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("helm-e2e-exporter-{}", &ns[ns.len() - 8..]), "namespace": EXEMPT_NAMESPACE},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": [{
            "name": "nvidia-dcgm-exporter", "image": EXEMPT_IMAGE, "imagePullPolicy": "IfNotPresent",
            "command": ["sleep", "3600"], "securityContext": {"privileged": true},
            "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
        }]},
    });
    let admitted = kubectl::run_stdin(
        &["create", "--dry-run=server", "-f", "-", "-o", "json"],
        &exporter.to_string(),
    );
    assert!(
        admitted.ok,
        "the exempt NVIDIA component was refused with the webhook down: {}",
        admitted.stderr
    );
    let stored: Value = serde_json::from_str(&admitted.stdout).expect("the admitted pod");
    assert_eq!(
        stored["spec"]["containers"][0]["securityContext"]["privileged"],
        true
    );
    summary.push("webhook at 0: exempt NVIDIA component admitted unchanged".into());

    // 5. docs/operations.md's helm upgrade with changed values: the webhook's replicas and
    // the policy's mode.
    let upgrade = statements(&doc_block_in(OPERATIONS, "Upgrade", "With Helm"));
    assert!(
        upgrade.iter().any(|s| s.starts_with("helm upgrade ")),
        "{upgrade:#?}"
    );
    for statement in &upgrade {
        let statement = if statement.starts_with("helm upgrade ") {
            format!(
                "{}{} --set webhook.replicas=1 --set defaultPolicy.exemptions.namespaces[0]={UPGRADE_EXEMPT}{}",
                moved(statement),
                image_values(),
                upgrade_flags()
            )
        } else {
            moved(statement)
        };
        if statement.starts_with("for ") {
            patch_node_agent();
        }
        let (out, took) = run_statement(&helm, &statement);
        assert!(
            out.ok,
            "`{statement}` failed after {took:?}: {}",
            out.stderr
        );
    }
    let replicas = kubectl::must(&[
        "-n",
        HELM_NAMESPACE,
        "get",
        "deploy/gpuwarden-webhook",
        "-o",
        "jsonpath={.spec.replicas}/{.status.readyReplicas}",
    ]);
    assert_eq!(replicas, "1/1", "webhook replicas/ready after the upgrade");
    let exempt = kubectl::must(&[
        "get",
        "gpupolicy",
        "default",
        "-o",
        "jsonpath={.spec.exemptions.namespaces}",
    ]);
    assert!(
        exempt.contains(UPGRADE_EXEMPT),
        "exemptions after the upgrade: {exempt}"
    );
    summary.push(format!(
        "helm upgrade: webhook 1/1 replicas, {UPGRADE_EXEMPT} exempt by the default policy"
    ));

    // 6. The README's Helm uninstall, twice: nothing is left.
    let mut rendered_maps = kubectl::run(&[
        "get",
        "mutatingadmissionpolicies",
        "-l",
        "app.kubernetes.io/managed-by=gpuwarden-operator",
        "-o",
        "name",
    ])
    .stdout;
    rendered_maps = rendered_maps.trim().replace('\n', ", ");
    // Where the API server serves MutatingAdmissionPolicy the operator keeps one for the
    // default policy (Enforce): the uninstall must remove what it rendered.
    if kubectl::run(&["api-resources", "-o", "name"])
        .stdout
        .lines()
        .any(|r| r.starts_with("mutatingadmissionpolicies."))
    {
        assert!(
            !rendered_maps.is_empty(),
            "the operator rendered no MutatingAdmissionPolicy for the default policy"
        );
    }
    let uninstall = statements(&readme_block_in("Uninstall", "With Helm"));
    for round in 1..=2 {
        for statement in &uninstall {
            let statement = &moved(statement);
            let (out, took) = run_statement(&helm, statement);
            assert!(
                out.ok,
                "round {round}: `{statement}` failed after {took:?}: {}",
                out.stderr
            );
            summary.push(format!(
                "uninstall round {round}: `{statement}` {:.1} s",
                took.as_secs_f64()
            ));
        }
    }
    cleanup.installed = false;
    let left = kubectl::poll(Duration::from_secs(120), Duration::from_secs(1), || {
        let left = leftovers();
        left.is_empty().then_some(())
    });
    assert!(
        left.is_some(),
        "left after helm uninstall: {:?}",
        leftovers()
    );
    summary.push(format!(
        "nothing left (operator MAPs before: {rendered_maps})"
    ));
    eprintln!("{test}:\n  {}", summary.join("\n  "));
}

/// The last commit whose chart stored the release in kube-system and created
/// gpuwarden-system itself (namespace.create on by default).
const OLD_WAY_CHART_COMMIT: &str = "4433f82";

#[test]
#[ignore = "needs a cluster: root on a one-node cluster's node with NVIDIA's device plugin, ctr, helm, git history; KUBECONFIG=... cargo test -p gpuwarden-e2e --test helm -- --ignored --nocapture --test-threads=1"]
fn a_release_installed_into_kube_system_upgrades_where_it_is() {
    let test = "a_release_installed_into_kube_system_upgrades_where_it_is";
    let Some(helm) = on_a_gpu_node(test, &["git"]) else {
        return;
    };
    // The old chart creates gpuwarden-system as part of its release; Helm refuses one that
    // exists already.
    assert!(
        !kubectl::run(&["get", "namespace", "gpuwarden-system"]).ok,
        "namespace gpuwarden-system exists: the old chart this test installs creates it; delete it first (`kubectl delete namespace gpuwarden-system`)"
    );
    let work = tempfile::tempdir().expect("a temporary directory");
    let archive = exec(
        Command::new("bash")
            .arg("-c")
            .arg(format!(
                "git archive {OLD_WAY_CHART_COMMIT} deploy/helm/gpuwarden | tar -x -C {}",
                work.path().display()
            ))
            .current_dir(repo_root()),
        None,
    );
    assert!(
        archive.ok,
        "the chart at {OLD_WAY_CHART_COMMIT}: {}",
        archive.stderr
    );
    let old_chart = work.path().join("deploy/helm/gpuwarden");
    let before = import_image();
    let mut cleanup = OldWayCleanup {
        helm: helm.clone(),
        images_before: Some(before),
        labelled_node: None,
    };
    // The node agent runs where GPU feature discovery labels a node; label this one (as the
    // in-cluster test does) where nothing did, so that its Lease shows where it lives.
    let nodes = kubectl::get_json(&["nodes"]).expect("list nodes");
    let node = gpu_node_in(&nodes).expect("the GPU node");
    if node["metadata"]["labels"][LABEL_GPU_PRESENT] != "true" {
        let name = node["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        kubectl::must(&["label", "node", &name, &format!("{LABEL_GPU_PRESENT}=true")]);
        cleanup.labelled_node = Some(name);
    }

    // 1. The release as it used to be installed: stored in kube-system, creating
    //    gpuwarden-system.
    let (out, took) = run_statement(
        &helm,
        &format!(
            "helm install gpuwarden {} --namespace kube-system{}",
            old_chart.display(),
            image_values()
        ),
    );
    assert!(
        out.ok,
        "the old install failed after {took:?}: {}",
        out.stderr
    );
    patch_node_agent_in("gpuwarden-system");
    rollout("gpuwarden-system");
    let uid = || {
        kubectl::must(&[
            "get",
            "namespace",
            "gpuwarden-system",
            "-o",
            "jsonpath={.metadata.uid}",
        ])
    };
    let namespace_uid = uid();

    // 2. docs/operations.md's upgrade of such a release, with this workspace's chart.
    let upgrade = statements(&doc_block_in(
        OPERATIONS,
        "Upgrade",
        "A release installed into kube-system",
    ));
    let mut notes = String::new();
    for statement in &upgrade {
        let statement = if statement.starts_with("helm upgrade ") {
            format!("{statement}{}{}", image_values(), upgrade_flags())
        } else {
            statement.clone()
        };
        if statement.starts_with("for ") {
            patch_node_agent_in("gpuwarden-system");
        }
        let (out, took) = run_statement(&helm, &statement);
        assert!(
            out.ok,
            "`{statement}` failed after {took:?}: {}",
            out.stderr
        );
        notes.push_str(&out.stdout);
    }
    // `--reuse-values` carries the values the release was made with (Helm reuses the old
    // chart's defaults too): gpuwarden-system, created by the release.
    assert!(
        notes.contains("installed in gpuwarden-system") && notes.contains("and the namespace"),
        "the upgrade's notes: {notes}"
    );
    assert_eq!(uid(), namespace_uid, "gpuwarden-system was re-created");
    // Without them, the chart finds gpuwarden-system made by this release and keeps it.
    let (out, took) = run_statement(
        &helm,
        &format!(
            "helm upgrade gpuwarden deploy/helm/gpuwarden --namespace kube-system{}{}",
            image_values(),
            upgrade_flags()
        ),
    );
    assert!(
        out.ok,
        "the upgrade without --reuse-values failed after {took:?}: {}",
        out.stderr
    );
    assert!(
        out.stdout.contains("installed the old way")
            && out.stdout.contains("installed in gpuwarden-system"),
        "the notes of the upgrade without --reuse-values: {}",
        out.stdout
    );
    patch_node_agent_in("gpuwarden-system");
    rollout("gpuwarden-system");
    assert_eq!(uid(), namespace_uid, "gpuwarden-system was re-created");
    let manifest = run_helm(
        &helm,
        &["get", "manifest", "gpuwarden", "-n", "kube-system"],
    );
    assert!(
        manifest.stdout.contains("kind: Namespace")
            && !manifest.stdout.contains("namespace: kube-system"),
        "the upgraded release's objects: {}",
        manifest.stdout
    );
    let ready = default_policy_ready();
    assert!(
        ready,
        "the default GpuPolicy is not Ready after the upgrade"
    );
    let lease = kubectl::poll(Duration::from_secs(60), Duration::from_secs(2), || {
        kubectl::run(&["-n", "gpuwarden-system", "get", "leases", "-o", "name"])
            .stdout
            .contains("gpuwarden-agent-")
            .then_some(())
    });
    assert!(
        lease.is_some(),
        "no node agent Lease in gpuwarden-system after the upgrade: {}",
        kubectl::run(&["-n", "gpuwarden-system", "get", "pods,leases", "-o", "wide"]).stdout
    );

    // 3. Its uninstall, where it is, deletes the namespace it created.
    let (out, _) = run_statement(
        &helm,
        "helm uninstall gpuwarden --namespace kube-system --ignore-not-found --wait --timeout 5m",
    );
    assert!(out.ok, "helm uninstall -n kube-system: {}", out.stderr);
    let gone = kubectl::poll(Duration::from_secs(180), Duration::from_secs(2), || {
        leftovers().is_empty().then_some(())
    });
    assert!(
        gone.is_some(),
        "left after the uninstall: {:?}",
        leftovers()
    );
    drop(cleanup);
    eprintln!(
        "{test}: installed the old way, upgraded in place (namespace kept, policy Ready, agent Leases), uninstalled"
    );
}

/// Whether the default GpuPolicy says `Ready=True` within two minutes.
fn default_policy_ready() -> bool {
    kubectl::poll(Duration::from_secs(120), Duration::from_secs(1), || {
        let p = kubectl::get_json(&["gpupolicy", "default"])?;
        (p["status"]["conditions"].as_array()?.iter())
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
            .then_some(())
    })
    .is_some()
}

/// Each `rollout status` of the install, in `namespace`.
fn rollout(namespace: &str) {
    for w in [
        "deploy/gpuwarden-operator",
        "deploy/gpuwarden-webhook",
        "ds/gpuwarden-node-agent",
    ] {
        let out = kubectl::run(&["-n", namespace, "rollout", "status", w, "--timeout=5m"]);
        assert!(
            out.ok,
            "{w} in {namespace}: {}\n{}",
            out.stderr,
            kubectl::run(&["-n", namespace, "get", "pods", "-o", "wide"]).stdout
        );
    }
}

/// What the old-way test made, removed on drop: the release, the images it imported and
/// the node's label.
struct OldWayCleanup {
    helm: PathBuf,
    images_before: Option<std::collections::BTreeSet<String>>,
    labelled_node: Option<String>,
}

impl Drop for OldWayCleanup {
    fn drop(&mut self) {
        let _ = run_statement(
            &self.helm,
            "helm uninstall gpuwarden --namespace kube-system --ignore-not-found --wait --timeout 5m",
        );
        if let Some(node) = self.labelled_node.take() {
            let _ = kubectl::run(&["label", "node", &node, &format!("{LABEL_GPU_PRESENT}-")]);
        }
        if let Some(before) = self.images_before.take() {
            for image in image_refs().difference(&before) {
                let _ = ctr(&["images", "rm", image]);
            }
        }
    }
}
