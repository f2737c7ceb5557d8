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
//! the webhook is at 0 replicas, `helm upgrade` with changed values, and the README's Helm
//! uninstall, twice, leaving nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use gpuwarden_e2e::helm::{CHART, HELM_ONLY, helm, helm_required, kubectl};
use gpuwarden_e2e::manifests::{Document, load_file, parse_documents, repo_root};
use gpuwarden_e2e::node::{Out, exec};
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

/// `helm template` of the chart with `set` values, CRDs included, as documents.
fn template(helm: &Path, set: &[&str]) -> Vec<Document> {
    let mut args = vec![
        "template",
        "gpuwarden",
        CHART,
        "--namespace",
        "kube-system",
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
        Value::Object(map) => Value::Object(map.into_iter().map(|(k, v)| (k, normalized(v))).collect()),
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
            hook.value["metadata"]["annotations"]["helm.sh/hook"], "pre-delete",
            "{}",
            hook.id()
        );
    }
    rest
}

/// What kustomize renders from `dir` (relative to the repository root), or None without
/// kubectl.
fn kustomize(dir: &Path) -> Option<Vec<Document>> {
    let kubectl = kubectl()?;
    let out = exec(Command::new(kubectl).arg("kustomize").arg(dir), None);
    assert!(out.ok, "kubectl kustomize {} failed: {}", dir.display(), out.stderr);
    Some(parse_documents("kubectl kustomize", &out.stdout).unwrap_or_else(|e| panic!("{e}")))
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
    let (base, from) = match kustomize(&repo_root().join("deploy")) {
        Some(docs) => (docs, "kubectl kustomize deploy/"),
        None => (
            load_file("deploy/install.yaml").unwrap_or_else(|e| panic!("{e}")),
            "deploy/install.yaml (no kubectl)",
        ),
    };
    let base = keyed(base);
    let chart = keyed(without_hook(template(&helm, &[])));
    let diff = differences(&base, &chart);
    assert!(diff.is_empty(), "helm template vs {from}:\n{}", diff.join("\n"));
    eprintln!("helm template == {from}: {} objects", base.len());
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
        assert!(!helm_required(), "{test}: kubectl is required with helm (kubectl kustomize)");
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
    let diff = differences(&keyed(base), &keyed(without_hook(chart)));
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
        assert_eq!(spec["imagePullSecrets"][0]["name"], "regcred", "{kind}/{name}");
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
    assert!(
        env.as_array().expect("env").iter().any(|e| e["name"]
            == "GPUWARDEN_ADMISSION_POLICIES"
            && e["value"] == "false"),
        "{env}"
    );
    let agent = &get("DaemonSet", "gpuwarden-node-agent")["spec"]["template"]["spec"];
    assert_eq!(agent["nodeSelector"], serde_json::json!({"pool": "gpu"}));
    assert_eq!(agent["tolerations"], serde_json::json!([{"operator": "Exists"}]));
    assert_eq!(agent["priorityClassName"], "system-node-critical");
    let policy = &get("GpuPolicy", "default")["spec"];
    assert_eq!(policy["mode"], "Audit");
    let namespaces = policy["exemptions"]["namespaces"].as_array().expect("namespaces");
    assert_eq!(namespaces.last().and_then(Value::as_str), Some("ml-infra"));
    assert!(namespaces.iter().any(|n| n == "kube-system"), "{namespaces:?}");
    assert_eq!(
        policy["gpu"]["sharing"]["kai"],
        serde_json::json!({"binder": "kai/binder"})
    );
    // Off: no PodDisruptionBudget for the webhook.
    let off = keyed(template(&helm, &["webhook.podDisruptionBudget.enabled=false"]));
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
        let out = run_helm(&helm, &["template", "gpuwarden", CHART, "-n", "kube-system", "--set", set]);
        assert!(!out.ok, "--set {set} was accepted");
        assert!(
            out.stderr.contains("additional properties") && out.stderr.contains(key),
            "--set {set}: {}",
            out.stderr
        );
        let lint = run_helm(&helm, &["lint", "--strict", CHART, "--set", set]);
        assert!(!lint.ok, "helm lint --set {set} passed");
    }
    let bad = run_helm(&helm, &["template", "gpuwarden", CHART, "-n", "kube-system", "--set", "defaultPolicy.mode=enforce"]);
    assert!(!bad.ok, "mode enforce (lower case) was accepted");
    // The release may not live in the namespace it creates and deletes.
    let same = run_helm(&helm, &["template", "gpuwarden", CHART, "-n", "gpuwarden-system"]);
    assert!(!same.ok && same.stderr.contains("namespace.create"), "{}", same.stderr);
    let own = run_helm(
        &helm,
        &["template", "gpuwarden", CHART, "-n", "gpuwarden-system", "--set", "namespace.create=false"],
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
    assert!(out.ok, "helm lint --strict {CHART}: {}{}", out.stdout, out.stderr);
}
