//! The install manifests under `deploy/`, checked without a cluster: every object is a
//! valid object of its kind with no unknown field, install.yaml is the kustomize base, RBAC
//! grants exactly what the binaries call, and names, ports and paths agree with the
//! constants the binaries use.

use std::collections::{BTreeMap, BTreeSet};

use gpuwarden_crds::install;
use gpuwarden_e2e::manifests::{self, Document, load_base, load_file, repo_root};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// Every YAML file under `deploy/` that holds Kubernetes objects (not kustomization files).
fn manifest_files() -> Vec<String> {
    fn walk(dir: &std::path::Path, out: &mut Vec<String>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("failed to read {}: {e}", dir.display()))
            .map(|e| e.expect("directory entry").path())
            .collect();
        entries.sort();
        for path in entries {
            if path.is_dir() {
                // Example workloads and fake GPU files, not install manifests; the Helm
                // chart's templates and its copies of the base (e2e/tests/helm.rs).
                if path
                    .file_name()
                    .is_some_and(|n| n != "examples" && n != "helm")
                {
                    walk(&path, out);
                }
            } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml")
                && path.file_name().is_some_and(|n| n != "kustomization.yaml")
            {
                let rel = path
                    .strip_prefix(repo_root())
                    .expect("under the repository")
                    .to_string_lossy()
                    .into_owned();
                out.push(rel);
            }
        }
    }
    let mut out = Vec::new();
    walk(&repo_root().join("deploy"), &mut out);
    assert!(!out.is_empty(), "no manifests found under deploy/");
    out
}

/// Where `input` and `output` differ, as JSON paths. A path in `input` missing from
/// `output` is a field the type does not know.
fn differences(input: &Value, output: &Value, path: &str, out: &mut Vec<String>) {
    match (input, output) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                let p = format!("{path}.{k}");
                match b.get(k) {
                    Some(w) => differences(v, w, &p, out),
                    None => out.push(format!("unknown field {p}")),
                }
            }
            for k in b.keys().filter(|k| !a.contains_key(*k)) {
                out.push(format!("field {path}.{k} added by the type"));
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (v, w)) in a.iter().zip(b).enumerate() {
                differences(v, w, &format!("{path}[{i}]"), out);
            }
        }
        _ if input == output => {}
        // A quantity written as a YAML number (`nvidia.com/gpu: 1`): the API reads it the
        // same way.
        (Value::Number(n), Value::String(s)) if n.to_string() == *s => {}
        _ => out.push(format!("{path}: {input} became {output}")),
    }
}

/// Deserialises a document into `T`, serialises it back, and fails naming every field the
/// round trip lost or changed (k8s-openapi ignores unknown fields; this makes them errors).
fn round_trip<T: DeserializeOwned + Serialize>(doc: &Document) -> Result<(), String> {
    let typed: T = serde_json::from_value(doc.value.clone())
        .map_err(|e| format!("{} ({}): {e}", doc.source, doc.id()))?;
    let back = serde_json::to_value(&typed).map_err(|e| format!("{}: {e}", doc.source))?;
    let mut diffs = Vec::new();
    differences(&doc.value, &back, "", &mut diffs);
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} ({}): {}",
            doc.source,
            doc.id(),
            diffs.join("; ")
        ))
    }
}

/// The Prometheus Operator's PodMonitor, as far as the monitoring component uses it. There
/// is no Rust type for it in k8s-openapi; unknown fields are refused all the same.
mod pod_monitor {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
    use serde::{Deserialize, Serialize};

    #[derive(Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct PodMonitor {
        pub api_version: String,
        pub kind: String,
        pub metadata: ObjectMeta,
        pub spec: Spec,
    }

    #[derive(Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct Spec {
        pub selector: LabelSelector,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub namespace_selector: Option<NamespaceSelector>,
        pub pod_metrics_endpoints: Vec<Endpoint>,
    }

    #[derive(Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct NamespaceSelector {
        pub match_names: Vec<String>,
    }

    #[derive(Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct Endpoint {
        pub port: String,
        pub path: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub interval: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub scrape_timeout: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub honor_labels: Option<bool>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub relabelings: Vec<Relabeling>,
    }

    #[derive(Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    pub struct Relabeling {
        pub source_labels: Vec<String>,
        pub target_label: String,
    }
}

/// Round-trips a document through the type its apiVersion and kind name.
fn check_typed(doc: &Document) -> Result<(), String> {
    match (doc.api_version(), doc.kind()) {
        ("v1", "Namespace") => round_trip::<Namespace>(doc),
        ("v1", "ServiceAccount") => round_trip::<ServiceAccount>(doc),
        ("v1", "Service") => round_trip::<Service>(doc),
        ("v1", "ConfigMap") => round_trip::<ConfigMap>(doc),
        ("v1", "Pod") => round_trip::<k8s_openapi::api::core::v1::Pod>(doc),
        ("resource.k8s.io/v1", "ResourceClaimTemplate") => {
            round_trip::<k8s_openapi::api::resource::v1::ResourceClaimTemplate>(doc)
        }
        ("apps/v1", "Deployment") => round_trip::<Deployment>(doc),
        ("apps/v1", "StatefulSet") => round_trip::<k8s_openapi::api::apps::v1::StatefulSet>(doc),
        ("apps/v1", "ReplicaSet") => round_trip::<k8s_openapi::api::apps::v1::ReplicaSet>(doc),
        ("batch/v1", "Job") => round_trip::<k8s_openapi::api::batch::v1::Job>(doc),
        ("batch/v1", "CronJob") => round_trip::<k8s_openapi::api::batch::v1::CronJob>(doc),
        ("apps/v1", "DaemonSet") => round_trip::<DaemonSet>(doc),
        ("policy/v1", "PodDisruptionBudget") => round_trip::<PodDisruptionBudget>(doc),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => round_trip::<ClusterRole>(doc),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            round_trip::<ClusterRoleBinding>(doc)
        }
        ("rbac.authorization.k8s.io/v1", "Role") => round_trip::<Role>(doc),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => round_trip::<RoleBinding>(doc),
        ("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration") => {
            round_trip::<MutatingWebhookConfiguration>(doc)
        }
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy") => {
            round_trip::<ValidatingAdmissionPolicy>(doc)
        }
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding") => {
            round_trip::<ValidatingAdmissionPolicyBinding>(doc)
        }
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => {
            round_trip::<CustomResourceDefinition>(doc)
        }
        ("gpuwarden.io/v1alpha1", "GpuPolicy") => round_trip::<gpuwarden_crds::GpuPolicy>(doc),
        ("gpuwarden.io/v1alpha1", "GpuNode") => round_trip::<gpuwarden_crds::GpuNode>(doc),
        ("monitoring.coreos.com/v1", "PodMonitor") => round_trip::<pod_monitor::PodMonitor>(doc),
        (api_version, kind) => Err(format!(
            "{}: no type known for {api_version} {kind}; add it to check_typed",
            doc.source
        )),
    }
}

fn base() -> Vec<Document> {
    load_base().expect("the kustomize base loads").1
}

fn find<'a>(docs: &'a [Document], kind: &str, name: &str) -> &'a Document {
    docs.iter()
        .find(|d| d.kind() == kind && d.name() == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in deploy/"))
}

fn typed<T: DeserializeOwned>(doc: &Document) -> T {
    serde_json::from_value(doc.value.clone())
        .unwrap_or_else(|e| panic!("{} ({}): {e}", doc.source, doc.id()))
}

/// Every object in every file under deploy/ (components and install.yaml included) parses
/// into its Kubernetes type, and serialising it back gives the same JSON: a field the type
/// drops is an unknown field (a typo, or a field the API does not have) and is named.
#[test]
fn every_object_is_its_kind_with_no_unknown_field() {
    let mut failures = Vec::new();
    let mut count = 0;
    for file in manifest_files() {
        let docs = load_file(&file).unwrap_or_else(|e| panic!("{e}"));
        assert!(!docs.is_empty(), "{file} holds no object");
        for doc in docs {
            count += 1;
            if let Err(e) = check_typed(&doc) {
                failures.push(e);
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {count} objects are not valid:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The checker above notices a misspelt or misplaced field: a test of the test.
#[test]
fn an_unknown_field_is_named() {
    let docs = manifests::parse_documents(
        "inline.yaml",
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: x\nspec:\n  ports:\n    - port: 443\n      targetPrt: 8443\n",
    )
    .unwrap();
    let err = check_typed(&docs[0]).unwrap_err();
    assert!(
        err.contains("unknown field .spec.ports[0].targetPrt"),
        "{err}"
    );
}

/// The kustomization lists every manifest file of the base (nothing under deploy/ is
/// forgotten by `kubectl apply -k`), each once, and only files that exist.
#[test]
fn kustomization_lists_every_base_file() {
    let (kustomization, _) = load_base().unwrap_or_else(|e| panic!("{e}"));
    let listed: Vec<String> = kustomization
        .resources
        .iter()
        .map(|r| format!("deploy/{r}"))
        .collect();
    let unique: BTreeSet<&String> = listed.iter().collect();
    assert_eq!(unique.len(), listed.len(), "a resource is listed twice");
    let on_disk: BTreeSet<String> = manifest_files()
        .into_iter()
        .filter(|f| f != "deploy/install.yaml" && !f.starts_with("deploy/components/"))
        .collect();
    let listed: BTreeSet<String> = listed.into_iter().collect();
    let missing: Vec<_> = on_disk.difference(&listed).collect();
    let extra: Vec<_> = listed.difference(&on_disk).collect();
    assert!(
        missing.is_empty(),
        "not in deploy/kustomization.yaml: {missing:?}"
    );
    assert!(extra.is_empty(), "listed but not a file: {extra:?}");
}

/// install.yaml holds exactly the objects of the kustomize base, in the base's order, with
/// the image override applied: the one-file install and `kubectl apply -k` install the same
/// thing. (`cargo run -p gpuwarden-crds --bin crdgen` regenerates it.)
#[test]
fn install_yaml_is_the_rendered_base() {
    let base = base();
    let install = load_file("deploy/install.yaml")
        .unwrap_or_else(|e| panic!("{e}; run `cargo run -p gpuwarden-crds --bin crdgen`"));
    let base_ids: Vec<String> = base.iter().map(Document::id).collect();
    let install_ids: Vec<String> = install.iter().map(Document::id).collect();
    assert_eq!(
        install_ids, base_ids,
        "deploy/install.yaml is out of date; run `cargo run -p gpuwarden-crds --bin crdgen`"
    );
    for (b, i) in base.iter().zip(&install) {
        let mut diffs = Vec::new();
        differences(&b.value, &i.value, "", &mut diffs);
        assert!(
            diffs.is_empty(),
            "deploy/install.yaml differs from {} ({}): {}; run `cargo run -p gpuwarden-crds --bin crdgen`",
            b.source,
            b.id(),
            diffs.join("; ")
        );
    }
}

/// The base creates what must exist before the rest: the namespace first, the CRDs
/// before the default policy and the policies that take it as a parameter.
#[test]
fn objects_come_in_creatable_order() {
    let base = base();
    let pos = |kind: &str| {
        base.iter()
            .position(|d| d.kind() == kind)
            .unwrap_or_else(|| panic!("no {kind} in the base"))
    };
    assert_eq!(base[0].kind(), "Namespace");
    assert_eq!(base[0].name(), gpuwarden_crds::SYSTEM_NAMESPACE);
    assert!(pos("CustomResourceDefinition") < pos("GpuPolicy"));
    assert!(pos("CustomResourceDefinition") < pos("ValidatingAdmissionPolicy"));
    assert!(pos("ServiceAccount") < pos("Deployment"));
    for doc in &base {
        if let Some(ns) = doc.namespace() {
            assert_eq!(ns, gpuwarden_crds::SYSTEM_NAMESPACE, "{}", doc.id());
        }
    }
}

/// One grant: which API group, resource and verb, optionally pinned to one object name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Grant {
    /// `None`: cluster-wide (ClusterRoleBinding); `Some(ns)`: a RoleBinding's namespace.
    scope: Option<String>,
    group: String,
    resource: String,
    verb: String,
    /// `None`: any object.
    name: Option<String>,
}

/// What each component's code calls, kept in step with the code by reading it: every
/// `Api::` call, watcher/reflector, `patch_status`, event recorder and lease manager.
/// (component service account, namespace or cluster-wide, group, resource, verbs, names)
type Row = (
    &'static str,
    Option<&'static str>,
    &'static str,
    &'static str,
    &'static [&'static str],
    &'static [&'static str],
);

const NS: Option<&str> = Some(gpuwarden_crds::SYSTEM_NAMESPACE);

const EXPECTED_GRANTS: &[Row] = &[
    // webhook (src/server.rs): reads the pod a request to exec, attach or port-forward
    // enters, to tell a VM's pod.
    (install::WEBHOOK_NAME, None, "", "pods", &["get"], &[]),
    // webhook (src/cache.rs): reflectors over GpuPolicy and Namespace metadata.
    (
        install::WEBHOOK_NAME,
        None,
        "gpuwarden.io",
        "gpupolicies",
        &["list", "watch"],
        &[],
    ),
    (
        install::WEBHOOK_NAME,
        None,
        "",
        "namespaces",
        &["list", "watch"],
        &[],
    ),
    // ... and, where DRA is served, over ResourceClaims and ResourceClaimTemplates.
    (
        install::WEBHOOK_NAME,
        None,
        "resource.k8s.io",
        "resourceclaims",
        &["list", "watch"],
        &[],
    ),
    (
        install::WEBHOOK_NAME,
        None,
        "resource.k8s.io",
        "resourceclaimtemplates",
        &["list", "watch"],
        &[],
    ),
    // operator (src/runner.rs): reflectors over Node, GpuNode, GpuPolicy, agent Leases and
    // Namespace metadata.
    (
        install::OPERATOR_NAME,
        None,
        "",
        "nodes",
        &["list", "watch"],
        &[],
    ),
    (
        install::OPERATOR_NAME,
        None,
        "",
        "namespaces",
        &["list", "watch"],
        &[],
    ),
    // src/claim_templates.rs: gpuwarden's ResourceClaimTemplates, applied and deleted.
    (
        install::OPERATOR_NAME,
        None,
        "resource.k8s.io",
        "resourceclaimtemplates",
        &["list", "watch", "create", "patch", "delete"],
        &[],
    ),
    // src/admission_policies.rs: the admission policies rendered from the GpuPolicies,
    // applied, listed by label and deleted.
    (
        install::OPERATOR_NAME,
        None,
        "admissionregistration.k8s.io",
        "mutatingadmissionpolicies",
        &["list", "create", "patch", "delete"],
        &[],
    ),
    (
        install::OPERATOR_NAME,
        None,
        "admissionregistration.k8s.io",
        "mutatingadmissionpolicybindings",
        &["list", "create", "patch", "delete"],
        &[],
    ),
    (
        install::OPERATOR_NAME,
        None,
        "admissionregistration.k8s.io",
        "validatingadmissionpolicies",
        &["list", "create", "patch", "delete"],
        &[],
    ),
    (
        install::OPERATOR_NAME,
        None,
        "admissionregistration.k8s.io",
        "validatingadmissionpolicybindings",
        &["list", "create", "patch", "delete"],
        &[],
    ),
    // src/node_controller.rs: server-side apply of GpuNode (create + patch), delete, status.
    (
        install::OPERATOR_NAME,
        None,
        "gpuwarden.io",
        "gpunodes",
        &["list", "watch", "create", "patch", "delete"],
        &[],
    ),
    (
        install::OPERATOR_NAME,
        None,
        "gpuwarden.io",
        "gpunodes/status",
        &["patch"],
        &[],
    ),
    // src/policy_controller.rs: GpuPolicy status.
    (
        install::OPERATOR_NAME,
        None,
        "gpuwarden.io",
        "gpupolicies",
        &["list", "watch"],
        &[],
    ),
    (
        install::OPERATOR_NAME,
        None,
        "gpuwarden.io",
        "gpupolicies/status",
        &["patch"],
        &[],
    ),
    // src/webhook_certs.rs: get_opt + JSON patch of caBundle; src/runner.rs: a watch on
    // that one object (field selector metadata.name), which wakes the certificate keeper.
    (
        install::OPERATOR_NAME,
        None,
        "admissionregistration.k8s.io",
        "mutatingwebhookconfigurations",
        &["get", "list", "watch", "patch"],
        &[install::MUTATING_WEBHOOK_CONFIGURATION],
    ),
    // src/policy_controller.rs: a GpuPolicy that names KAI-Scheduler reads, by name, KAI's
    // webhook configuration and its BindRequest CRD.
    (
        install::OPERATOR_NAME,
        None,
        "admissionregistration.k8s.io",
        "mutatingwebhookconfigurations",
        &["get"],
        &[gpuwarden_operator::policy_controller::KAI_ADMISSION],
    ),
    (
        install::OPERATOR_NAME,
        None,
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        &["get"],
        &[gpuwarden_operator::policy_controller::KAI_BIND_REQUESTS_CRD],
    ),
    // src/reports.rs: a reflector over every Pod; one report per governed namespace in
    // wgpolicyk8s.io and openreports.io, applied, listed by label and deleted.
    (
        install::OPERATOR_NAME,
        None,
        "",
        "pods",
        &["list", "watch"],
        &[],
    ),
    (
        install::OPERATOR_NAME,
        None,
        "wgpolicyk8s.io",
        "policyreports",
        &["list", "create", "patch", "delete"],
        &[],
    ),
    (
        install::OPERATOR_NAME,
        None,
        "openreports.io",
        "reports",
        &["list", "create", "patch", "delete"],
        &[],
    ),
    // The GPU nodes' posture report (operator::node_reports): applied and deleted by name.
    (
        install::OPERATOR_NAME,
        None,
        "wgpolicyk8s.io",
        "clusterpolicyreports",
        &["patch", "delete"],
        &[gpuwarden_crds::reports::NODES_REPORT_NAME],
    ),
    (
        install::OPERATOR_NAME,
        None,
        "openreports.io",
        "clusterreports",
        &["patch", "delete"],
        &[gpuwarden_crds::reports::NODES_REPORT_NAME],
    ),
    // kube::runtime::events::Recorder (events.k8s.io/v1: create, then patch for a series).
    (
        install::OPERATOR_NAME,
        None,
        "events.k8s.io",
        "events",
        &["create", "patch"],
        &[],
    ),
    // Agent Lease reflector; kube-lease-manager: create, get, patch of the leader Lease.
    (
        install::OPERATOR_NAME,
        NS,
        "coordination.k8s.io",
        "leases",
        &["list", "watch", "create"],
        &[],
    ),
    (
        install::OPERATOR_NAME,
        NS,
        "coordination.k8s.io",
        "leases",
        &["get", "patch"],
        &[install::OPERATOR_LEADER_LEASE],
    ),
    // src/webhook_certs.rs: get_opt + server-side apply of the TLS Secret.
    (
        install::OPERATOR_NAME,
        NS,
        "",
        "secrets",
        &["get", "create", "patch"],
        &[install::WEBHOOK_TLS_SECRET],
    ),
    // node agent (src/agent.rs): reflectors over its node's Pods, its Node, GpuPolicy and
    // Namespace metadata (namespace labels choose the policy that governs a pod).
    (
        install::NODE_AGENT_NAME,
        None,
        "",
        "pods",
        &["list", "watch"],
        &[],
    ),
    (
        install::NODE_AGENT_NAME,
        None,
        "",
        "namespaces",
        &["list", "watch"],
        &[],
    ),
    (
        install::NODE_AGENT_NAME,
        None,
        "",
        "nodes",
        &["list", "watch"],
        &[],
    ),
    (
        install::NODE_AGENT_NAME,
        None,
        "gpuwarden.io",
        "gpupolicies",
        &["list", "watch"],
        &[],
    ),
    // src/agent.rs: where a GpuPolicy names KAI-Scheduler, its node's BindRequests.
    (
        install::NODE_AGENT_NAME,
        None,
        gpuwarden_crds::sharing::bind_request::GROUP,
        gpuwarden_crds::sharing::bind_request::PLURAL,
        &["list", "watch"],
        &[],
    ),
    // src/writer.rs: get_status + server-side apply of its GpuNode's status (pinned to its
    // own node by a ValidatingAdmissionPolicy).
    (
        install::NODE_AGENT_NAME,
        None,
        "gpuwarden.io",
        "gpunodes/status",
        &["get", "patch"],
        &[],
    ),
    // src/lease.rs: server-side apply of gpuwarden-agent-<node> (create + patch).
    (
        install::NODE_AGENT_NAME,
        NS,
        "coordination.k8s.io",
        "leases",
        &["create", "patch"],
        &[],
    ),
];

fn expand(rows: &[Row], component: &str) -> BTreeSet<Grant> {
    let mut out = BTreeSet::new();
    for (c, scope, group, resource, verbs, names) in rows {
        if *c != component {
            continue;
        }
        for verb in *verbs {
            let names: Vec<Option<String>> = if names.is_empty() {
                vec![None]
            } else {
                names.iter().map(|n| Some(n.to_string())).collect()
            };
            for name in names {
                out.insert(Grant {
                    scope: scope.map(str::to_string),
                    group: group.to_string(),
                    resource: resource.to_string(),
                    verb: verb.to_string(),
                    name,
                });
            }
        }
    }
    out
}

/// Everything the manifests grant to `component`'s service account.
fn granted(docs: &[Document], component: &str) -> BTreeSet<Grant> {
    let mut out = BTreeSet::new();
    for binding in docs
        .iter()
        .filter(|d| d.kind() == "RoleBinding" || d.kind() == "ClusterRoleBinding")
    {
        let subjects = binding.value["subjects"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let bound = subjects.iter().any(|s| {
            s["kind"] == "ServiceAccount"
                && s["name"] == component
                && s["namespace"] == gpuwarden_crds::SYSTEM_NAMESPACE
        });
        if !bound {
            continue;
        }
        let role_kind = binding.value["roleRef"]["kind"]
            .as_str()
            .unwrap_or_default();
        let role_name = binding.value["roleRef"]["name"]
            .as_str()
            .unwrap_or_default();
        let role = find(docs, role_kind, role_name);
        let scope = if binding.kind() == "RoleBinding" {
            assert_eq!(
                role_kind,
                "Role",
                "{}: bind Roles, not ClusterRoles",
                binding.id()
            );
            binding.namespace().map(str::to_string)
        } else {
            None
        };
        for rule in role.value["rules"].as_array().into_iter().flatten() {
            let strings = |key: &str| -> Vec<String> {
                rule[key]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            };
            assert!(
                rule.get("nonResourceURLs").is_none(),
                "{}: no component needs non-resource URLs",
                role.id()
            );
            let names = strings("resourceNames");
            for group in strings("apiGroups") {
                for resource in strings("resources") {
                    for verb in strings("verbs") {
                        assert!(
                            group != "*" && resource != "*" && verb != "*",
                            "{}: wildcard in a rule",
                            role.id()
                        );
                        let names: Vec<Option<String>> = if names.is_empty() {
                            vec![None]
                        } else {
                            names.iter().cloned().map(Some).collect()
                        };
                        for name in names {
                            out.insert(Grant {
                                scope: scope.clone(),
                                group: group.clone(),
                                resource: resource.clone(),
                                verb: verb.clone(),
                                name,
                            });
                        }
                    }
                }
            }
        }
    }
    out
}

/// Each component's service account is granted exactly the API calls its code makes (the
/// table above), no more and no less; nothing else in the base is bound to them.
#[test]
fn rbac_grants_exactly_what_each_component_calls() {
    let docs = base();
    for component in [
        install::WEBHOOK_NAME,
        install::OPERATOR_NAME,
        install::NODE_AGENT_NAME,
    ] {
        find(&docs, "ServiceAccount", component);
        let expected = expand(EXPECTED_GRANTS, component);
        let actual = granted(&docs, component);
        let extra: Vec<_> = actual.difference(&expected).collect();
        let missing: Vec<_> = expected.difference(&actual).collect();
        assert!(
            extra.is_empty() && missing.is_empty(),
            "{component}: granted but not called: {extra:#?}\ncalled but not granted: {missing:#?}"
        );
    }
    // No binding to anything but gpuwarden's own service accounts.
    for binding in docs.iter().filter(|d| d.kind().ends_with("RoleBinding")) {
        for s in binding.value["subjects"].as_array().into_iter().flatten() {
            assert_eq!(s["kind"], "ServiceAccount", "{}", binding.id());
        }
    }
}

/// `rbac_grants_exactly_what_each_component_calls` notices an extra verb.
#[test]
fn an_extra_grant_is_noticed() {
    let mut docs = base();
    let role = docs
        .iter_mut()
        .find(|d| d.kind() == "ClusterRole" && d.name() == install::WEBHOOK_NAME)
        .expect("webhook ClusterRole");
    role.value["rules"][0]["verbs"]
        .as_array_mut()
        .expect("verbs")
        .push(json!("delete"));
    assert_ne!(
        granted(&docs, install::WEBHOOK_NAME),
        expand(EXPECTED_GRANTS, install::WEBHOOK_NAME)
    );
}

fn workloads(docs: &[Document]) -> Vec<&Document> {
    docs.iter()
        .filter(|d| manifests::pod_spec(&d.value).is_some())
        .collect()
}

/// Every container runs with the restricted security context: no privilege, no privilege
/// escalation, every capability dropped and none added, a read-only root filesystem,
/// seccomp RuntimeDefault, and a non-root user. The one exception is pinned: the node
/// agent's own container runs as UID 0 (the kubelet's pod-resources socket is root's) with
/// no capability; the other container of its pod does not.
#[test]
fn every_container_is_restricted() {
    let docs = base();
    let workloads = workloads(&docs);
    assert_eq!(workloads.len(), 3, "webhook, operator and node agent");
    for w in workloads {
        let spec = manifests::pod_spec(&w.value).expect("pod spec");
        let pod_sc = &spec["securityContext"];
        let containers = spec["containers"].as_array().expect("containers");
        let init = spec["initContainers"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert!(spec.get("hostNetwork").is_none(), "{}: hostNetwork", w.id());
        assert!(spec.get("hostIPC").is_none(), "{}: hostIPC", w.id());
        assert!(
            spec.get("hostPID").is_none(),
            "{}: hostPID is the host-pid component's switch, off in the base",
            w.id()
        );
        for c in containers.iter().chain(&init) {
            let name = format!("{} container {}", w.id(), c["name"]);
            let sc = &c["securityContext"];
            assert_eq!(sc["privileged"], json!(false), "{name}: privileged");
            assert_eq!(
                sc["allowPrivilegeEscalation"],
                json!(false),
                "{name}: allowPrivilegeEscalation"
            );
            assert_eq!(
                sc["readOnlyRootFilesystem"],
                json!(true),
                "{name}: readOnlyRootFilesystem"
            );
            assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{name}: drop");
            assert!(
                sc["capabilities"].get("add").is_none(),
                "{name}: adds capabilities"
            );
            let seccomp = sc["seccompProfile"]["type"]
                .as_str()
                .or(pod_sc["seccompProfile"]["type"].as_str());
            assert_eq!(seccomp, Some("RuntimeDefault"), "{name}: seccomp");
            let non_root = sc["runAsNonRoot"]
                .as_bool()
                .or(pod_sc["runAsNonRoot"].as_bool());
            if w.name() == install::NODE_AGENT_NAME && c["name"] == "node-agent" {
                assert_eq!(
                    non_root,
                    Some(false),
                    "{name}: the agent's exception is explicit"
                );
                assert_eq!(pod_sc["runAsUser"], json!(0), "{name}");
            } else {
                assert_eq!(non_root, Some(true), "{name}: runAsNonRoot");
                let uid = sc["runAsUser"].as_i64().or(pod_sc["runAsUser"].as_i64());
                assert!(
                    uid.is_some_and(|u| u > 0),
                    "{name}: a numeric non-root user"
                );
            }
            assert!(
                c["resources"]["requests"]["memory"].is_string()
                    && c["resources"]["limits"]["memory"].is_string(),
                "{name}: memory request and limit"
            );
            assert!(c.get("livenessProbe").is_some(), "{name}: liveness probe");
            assert!(c.get("readinessProbe").is_some(), "{name}: readiness probe");
        }
        for v in spec["volumes"].as_array().into_iter().flatten() {
            if v.get("hostPath").is_some() {
                assert_eq!(
                    w.name(),
                    install::NODE_AGENT_NAME,
                    "{}: only the node agent mounts host paths",
                    w.id()
                );
                let mounts: Vec<&Value> = containers
                    .iter()
                    .flat_map(|c| c["volumeMounts"].as_array().into_iter().flatten())
                    .filter(|m| m["name"] == v["name"])
                    .collect();
                for m in mounts {
                    assert_eq!(m["readOnly"], json!(true), "{}: {m} is writable", w.id());
                }
            }
        }
    }
}

/// Each workload runs its binary from the one image, named once in the kustomization with
/// the workspace version as tag, and serves probes on the ports the binaries listen on.
#[test]
fn workloads_run_their_binary_from_the_one_image() {
    let (kustomization, docs) = load_base().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(kustomization.images.len(), 1);
    assert_eq!(kustomization.images[0].name, install::IMAGE);
    assert_eq!(
        kustomization.images[0].new_tag.as_deref(),
        Some(env!("CARGO_PKG_VERSION")),
        "the image tag follows the workspace version"
    );
    let expected_image = format!("{}:{}", install::IMAGE, env!("CARGO_PKG_VERSION"));
    for (kind, name, binary, port) in [
        (
            "Deployment",
            install::WEBHOOK_NAME,
            "gpuwarden-webhook",
            install::HEALTH_PORT,
        ),
        (
            "Deployment",
            install::OPERATOR_NAME,
            "gpuwarden-operator",
            install::HEALTH_PORT,
        ),
        (
            "DaemonSet",
            install::NODE_AGENT_NAME,
            "gpuwarden-node-agent",
            install::NODE_AGENT_PORT,
        ),
    ] {
        let w = find(&docs, kind, name);
        let spec = manifests::pod_spec(&w.value).expect("pod spec");
        assert_eq!(spec["serviceAccountName"], json!(name), "{}", w.id());
        let c = &spec["containers"][0];
        assert_eq!(c["image"], json!(expected_image), "{}", w.id());
        assert_eq!(
            c["command"],
            json!([format!("/usr/local/bin/{binary}")]),
            "{}",
            w.id()
        );
        let ports = c["ports"].as_array().expect("ports");
        let metrics = ports
            .iter()
            .find(|p| p["name"] == "http-metrics")
            .unwrap_or_else(|| panic!("{}: no http-metrics port", w.id()));
        assert_eq!(metrics["containerPort"], json!(port), "{}", w.id());
        assert_eq!(
            c["livenessProbe"]["httpGet"]["path"],
            "/healthz",
            "{}",
            w.id()
        );
        assert_eq!(
            c["readinessProbe"]["httpGet"]["path"],
            "/readyz",
            "{}",
            w.id()
        );
        assert_eq!(c["livenessProbe"]["httpGet"]["port"], "http-metrics");
        assert_eq!(c["readinessProbe"]["httpGet"]["port"], "http-metrics");
    }
    let webhook = find(&docs, "Deployment", install::WEBHOOK_NAME);
    let operator = find(&docs, "Deployment", install::OPERATOR_NAME);
    assert_eq!(webhook.value["spec"]["replicas"], 2);
    assert_eq!(operator.value["spec"]["replicas"], 2);
    let pdb = find(&docs, "PodDisruptionBudget", install::WEBHOOK_NAME);
    assert_eq!(pdb.value["spec"]["minAvailable"], 1);
    let spread = &webhook.value["spec"]["template"]["spec"]["topologySpreadConstraints"];
    assert!(
        spread.as_array().is_some_and(|s| !s.is_empty()),
        "webhook spread"
    );
}

/// The MutatingWebhookConfiguration is the one docs/design.md describes, and it reaches the
/// webhook: Service port 443 to the container's HTTPS port, on the path the server
/// answers, with the TLS Secret the operator writes mounted where the server reads it.
#[test]
fn webhook_configuration_reaches_the_server() {
    let docs = base();
    let mwc: MutatingWebhookConfiguration = typed(find(
        &docs,
        "MutatingWebhookConfiguration",
        install::MUTATING_WEBHOOK_CONFIGURATION,
    ));
    let webhooks = mwc.webhooks.expect("webhooks");
    let names: Vec<&str> = webhooks.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(
        names,
        [
            install::MUTATING_WEBHOOK,
            "vms.gpuwarden.io",
            "pod-entry.gpuwarden.io"
        ]
    );
    // The VM and pod-entry webhooks reach the same server, never patch, and say how an
    // outage goes: a VM's launcher pod is judged again when created (Ignore); a pod that
    // cannot be judged is not entered (Fail).
    let others = ["Ignore", "Fail"]
        .into_iter()
        .zip([install::MUTATE_PATH, install::ENTRY_PATH]);
    for (w, (failure, path)) in webhooks[1..].iter().zip(others) {
        let service = w.client_config.service.as_ref().expect("service reference");
        assert_eq!(
            (service.name.as_str(), service.path.as_deref(), service.port),
            (install::WEBHOOK_NAME, Some(path), Some(443)),
            "{}",
            w.name
        );
        assert_eq!(w.failure_policy.as_deref(), Some(failure), "{}", w.name);
        assert_eq!(
            w.reinvocation_policy.as_deref(),
            Some("Never"),
            "{}",
            w.name
        );
    }
    let entry = &webhooks[2].rules.as_ref().expect("rules")[0];
    assert_eq!(
        entry.operations.as_deref(),
        Some(&["CONNECT".to_string()][..])
    );
    let w = &webhooks[0];
    assert_eq!(w.name, install::MUTATING_WEBHOOK);
    assert_eq!(w.admission_review_versions, ["v1"]);
    assert_eq!(w.failure_policy.as_deref(), Some("Fail"));
    assert_eq!(w.side_effects, "None");
    assert_eq!(w.timeout_seconds, Some(5));
    assert_eq!(w.reinvocation_policy.as_deref(), Some("IfNeeded"));
    assert!(
        w.client_config.ca_bundle.is_none(),
        "the operator owns caBundle"
    );
    let service = w.client_config.service.as_ref().expect("service reference");
    assert_eq!(service.name, install::WEBHOOK_NAME);
    assert_eq!(service.namespace, gpuwarden_crds::SYSTEM_NAMESPACE);
    assert_eq!(service.path.as_deref(), Some(install::MUTATE_PATH));
    assert_eq!(service.port, Some(443));

    let rules: Vec<(Vec<String>, Vec<String>)> = w
        .rules
        .iter()
        .flatten()
        .map(|r| {
            assert_eq!(r.api_groups.as_deref(), Some(&[String::new()][..]));
            (
                r.operations.clone().unwrap_or_default(),
                r.resources.clone().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        rules,
        [
            (vec!["CREATE".to_string()], vec!["pods".to_string()]),
            (
                vec!["UPDATE".to_string()],
                vec!["pods/ephemeralcontainers".to_string()]
            ),
        ]
    );
    let conditions = w.match_conditions.as_ref().expect("matchConditions");
    assert_eq!(conditions.len(), 1);
    for field in ["containers", "initContainers", "ephemeralContainers"] {
        assert!(
            conditions[0]
                .expression
                .contains(&format!("object.spec.{field}")),
            "matchConditions must look at {field}"
        );
    }
    let selector = w.namespace_selector.as_ref().expect("namespaceSelector");
    let expr = &selector
        .match_expressions
        .as_ref()
        .expect("matchExpressions")[0];
    assert_eq!(expr.key, "kubernetes.io/metadata.name");
    assert_eq!(expr.operator, "NotIn");
    let excluded: BTreeSet<&str> = expr.values.iter().flatten().map(String::as_str).collect();
    assert_eq!(
        excluded,
        BTreeSet::from(["kube-system", gpuwarden_crds::SYSTEM_NAMESPACE])
    );
    // The default policy exempts at least what the webhook never sees.
    let default = gpuwarden_crds::GpuPolicy::default_policy();
    for ns in &excluded {
        assert!(
            default.spec.exemptions.namespaces.iter().any(|n| n == ns),
            "the default policy should exempt {ns}"
        );
    }

    let svc: Service = typed(find(&docs, "Service", install::WEBHOOK_NAME));
    let svc_spec = svc.spec.expect("service spec");
    let https = svc_spec
        .ports
        .iter()
        .flatten()
        .find(|p| p.port == 443)
        .expect("Service port 443");
    let target = serde_json::to_value(&https.target_port).expect("targetPort");
    let deployment = find(&docs, "Deployment", install::WEBHOOK_NAME);
    let spec = manifests::pod_spec(&deployment.value).expect("pod spec");
    assert_eq!(
        svc_spec.selector.as_ref().map(|s| json!(s)),
        Some(deployment.value["spec"]["selector"]["matchLabels"].clone()),
        "the Service selects the webhook pods"
    );
    let container = &spec["containers"][0];
    let port = container["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == target || p["containerPort"] == target)
        .unwrap_or_else(|| panic!("Service targetPort {target} names no container port"));
    assert_eq!(port["containerPort"], json!(install::WEBHOOK_HTTPS_PORT));

    let volume = spec["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["secret"]["secretName"] == install::WEBHOOK_TLS_SECRET)
        .expect("the TLS Secret is mounted");
    let mount = container["volumeMounts"]
        .as_array()
        .expect("volumeMounts")
        .iter()
        .find(|m| m["name"] == volume["name"])
        .expect("the TLS volume is mounted");
    assert_eq!(mount["mountPath"], "/etc/gpuwarden/tls");
    assert_eq!(mount["readOnly"], true);
    // The operator keeps the CA's private key in the same Secret; only the serving pair
    // reaches the webhook's file system.
    let projected: Vec<(&str, &str)> = volume["secret"]["items"]
        .as_array()
        .expect("the TLS volume projects chosen keys, not the whole Secret")
        .iter()
        .map(|item| {
            (
                item["key"].as_str().unwrap_or_default(),
                item["path"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        projected,
        [("tls.crt", "tls.crt"), ("tls.key", "tls.key")],
        "the webhook mounts exactly the serving certificate and key"
    );
    // Where the server reads them by default (webhook/src/main.rs).
    let main = std::fs::read_to_string(repo_root().join("webhook/src/main.rs")).expect("main.rs");
    for file in ["tls.crt", "tls.key"] {
        assert!(
            main.contains(&format!("\"/etc/gpuwarden/tls/{file}\"")),
            "the webhook no longer reads /etc/gpuwarden/tls/{file} by default"
        );
    }
}

/// The node agent runs on GPU nodes only, knows its node, reaches NVML through the NVIDIA
/// runtime with the `utility` capability, and reads the kubelet's pod-resources socket
/// read-only; the runtime's configuration comes from the pod's unprivileged runtime-report
/// container, which reads it from host directories every node has.
#[test]
fn node_agent_reaches_nvml_and_the_kubelet() {
    let docs = base();
    let ds: DaemonSet = typed(find(&docs, "DaemonSet", install::NODE_AGENT_NAME));
    let pod = ds.spec.expect("spec").template.spec.expect("pod spec");
    assert_eq!(
        pod.node_selector
            .as_ref()
            .and_then(|s| s.get(gpuwarden_crds::LABEL_GPU_PRESENT))
            .map(String::as_str),
        Some("true")
    );
    let c = &pod.containers[0];
    let env: BTreeMap<&str, &k8s_openapi::api::core::v1::EnvVar> = c
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.as_str(), e))
        .collect();
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"].value.as_deref(), Some("all"));
    assert_eq!(
        env["NVIDIA_DRIVER_CAPABILITIES"].value.as_deref(),
        Some("utility")
    );
    let node_name = env["NODE_NAME"]
        .value_from
        .as_ref()
        .and_then(|v| v.field_ref.as_ref())
        .map(|f| f.field_path.as_str());
    assert_eq!(node_name, Some("spec.nodeName"));
    let mounts: BTreeMap<&str, &str> = c
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| (m.mount_path.as_str(), m.name.as_str()))
        .collect();
    let host_path = |mount: &str| -> String {
        let name = mounts
            .get(mount)
            .unwrap_or_else(|| panic!("nothing mounted at {mount}"));
        pod.volumes
            .iter()
            .flatten()
            .find(|v| v.name == *name)
            .and_then(|v| v.host_path.as_ref())
            .map(|h| h.path.clone())
            .unwrap_or_else(|| panic!("{mount} is not a hostPath"))
    };
    // The agent's default socket path, its directory mounted from the same host path.
    let socket_dir = std::path::Path::new(gpuwarden_node_agent::podresources::DEFAULT_SOCKET)
        .parent()
        .expect("socket directory")
        .to_string_lossy()
        .into_owned();
    assert_eq!(host_path(&socket_dir), socket_dir);
    // The agent reads the runtime's config and CDI specs from the report of the pod's
    // runtime-report container, through an emptyDir both mount.
    let reader = pod
        .containers
        .iter()
        .find(|c| {
            c.args
                .as_deref()
                .and_then(<[String]>::first)
                .map(String::as_str)
                == Some("runtime-report")
        })
        .expect("a runtime-report container");
    let env_of = |c: &k8s_openapi::api::core::v1::Container, name: &str| -> Option<String> {
        c.env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .and_then(|e| e.value.clone())
    };
    let report = env_of(c, "GPUWARDEN_RUNTIME_REPORT").expect("the agent reads a runtime report");
    assert_eq!(
        env_of(reader, "GPUWARDEN_RUNTIME_REPORT"),
        Some(report.clone())
    );
    let dir_of = |c: &k8s_openapi::api::core::v1::Container, path: &str| {
        c.volume_mounts
            .iter()
            .flatten()
            .filter(|m| path.starts_with(&format!("{}/", m.mount_path)))
            .max_by_key(|m| m.mount_path.len())
            .cloned()
            .unwrap_or_else(|| panic!("{}: nothing mounted above {path}", c.name))
    };
    let (agent_side, reader_side) = (dir_of(c, &report), dir_of(reader, &report));
    assert_eq!(agent_side.name, reader_side.name, "one volume for both");
    assert_eq!(
        agent_side.read_only,
        Some(true),
        "the agent only reads the report"
    );
    let shared = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == agent_side.name)
        .expect("report volume");
    assert!(
        shared.empty_dir.is_some(),
        "the report lives in an emptyDir"
    );

    // Every place gpuwarden_node_agent::runtime looks is under a read-only hostPath of the
    // reader, at the same path under GPUWARDEN_HOST_ROOT=/host, whether or not the node has
    // it: the reader mounts a parent every node has.
    assert_eq!(
        env_of(reader, "GPUWARDEN_HOST_ROOT").as_deref(),
        Some("/host")
    );
    let mut paths: Vec<String> = gpuwarden_node_agent::runtime::CONFIG_PATHS
        .iter()
        .map(|p| p.to_string())
        .collect();
    paths.extend(
        gpuwarden_node_agent::runtime::CDI_DIRS
            .iter()
            .map(|d| format!("{d}/nvidia.yaml")),
    );
    // The node's posture: the CRI's configs, the toolkit's binaries, the package database.
    let posture = gpuwarden_node_agent::posture::Paths::default();
    paths.extend(posture.containerd_configs.iter().cloned());
    paths.extend(posture.crio_configs.iter().cloned());
    paths.extend(posture.toolkit_binaries.iter().cloned());
    paths.push(gpuwarden_node_agent::posture::DPKG_STATUS.to_owned());
    for host in paths {
        let mount = dir_of(reader, &format!("/host{host}"));
        assert_eq!(mount.read_only, Some(true), "{host}");
        let volume = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == mount.name)
            .and_then(|v| v.host_path.as_ref())
            .unwrap_or_else(|| panic!("{host}: {} is not a hostPath", mount.name));
        assert_eq!(
            format!("/host{}", volume.path),
            mount.mount_path,
            "{host}: the host path and where it is mounted differ"
        );
        assert!(
            ["/etc", "/usr", "/var/run", "/var/lib"].contains(&volume.path.as_str()),
            "{host}: {} is not a directory every node has",
            volume.path
        );
    }
    // The reader is not the agent: not root, and no GPU.
    let sc = reader
        .security_context
        .as_ref()
        .expect("reader security context");
    assert_eq!(sc.run_as_non_root, Some(true));
    assert!(sc.run_as_user.is_some_and(|u| u > 0));
    assert_eq!(
        env_of(reader, "NVIDIA_VISIBLE_DEVICES").as_deref(),
        Some("void")
    );
    let host_root = env["GPUWARDEN_HOST_ROOT"].value.as_deref();
    assert_eq!(host_root, Some("/host"));
    // The agent itself, root, sees no host directory but the kubelet's pod-resources and
    // the directory DRA drivers write their claims' CDI specs into (root's, mode 0600),
    // both read-only, neither holding the container runtime's socket.
    let agent_host_paths: Vec<(&str, &str, Option<bool>)> = c
        .volume_mounts
        .iter()
        .flatten()
        .filter_map(|m| {
            let volume = (pod.volumes.iter().flatten()).find(|v| v.name == m.name)?;
            let host = volume.host_path.as_ref()?;
            Some((host.path.as_str(), m.mount_path.as_str(), m.read_only))
        })
        .collect();
    let claim_specs = format!("/host{}", gpuwarden_node_agent::cdi::CLAIM_SPEC_DIR);
    assert_eq!(
        agent_host_paths,
        [
            (socket_dir.as_str(), socket_dir.as_str(), Some(true)),
            (
                gpuwarden_node_agent::cdi::CLAIM_SPEC_DIR,
                claim_specs.as_str(),
                Some(true)
            )
        ]
    );
}

/// A hostPath whose type is unset, DirectoryOrCreate or FileOrCreate makes a missing path
/// on the node (the kubelet creates it, or the container runtime does for an unset type).
/// No manifest of the base or of a component may change the host that way: every hostPath
/// names what it expects to find. The one exception is the CDI spec directory DRA drivers
/// write their claims into, which only the root agent may read and whose parent holds the
/// runtime's socket: an empty `/var/run/cdi` (on tmpfs, root's) is what every CDI runtime
/// already reads specs from, and NVIDIA's DRA driver mounts it the same way.
#[test]
fn no_host_path_is_created_on_the_node() {
    let mut docs = base();
    let components = std::fs::read_dir(repo_root().join("deploy/components"))
        .expect("components")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect::<Vec<_>>();
    assert!(components.len() >= 4, "{components:?}");
    for component in &components {
        docs.extend(
            with_component(component)
                .into_iter()
                .filter(|d| manifests::pod_spec(&d.value).is_some()),
        );
    }
    let mut seen = 0;
    for w in workloads(&docs) {
        let spec = manifests::pod_spec(&w.value).expect("pod spec");
        for v in spec["volumes"].as_array().into_iter().flatten() {
            let Some(host_path) = v.get("hostPath") else {
                continue;
            };
            seen += 1;
            let kind = host_path["type"].as_str().unwrap_or_default();
            if host_path["path"] == gpuwarden_node_agent::cdi::CLAIM_SPEC_DIR
                && kind == "DirectoryOrCreate"
            {
                continue;
            }
            assert!(
                ["Directory", "File", "Socket", "CharDevice", "BlockDevice"].contains(&kind),
                "{}: hostPath {} has type {kind:?}, which creates it where it is missing",
                w.source,
                host_path["path"]
            );
        }
    }
    assert!(seen >= 4, "only {seen} hostPath volumes found");
}

/// The base with a component applied: its resources added, its JSON 6902 patches applied
/// to their targets.
fn with_component(dir: &str) -> Vec<Document> {
    let rel = format!("deploy/components/{dir}/kustomization.yaml");
    let component = manifests::load_kustomization(&rel).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(component.kind, "Component", "{rel}");
    assert!(
        component.images.is_empty(),
        "{rel}: images belong to the base"
    );
    let mut docs = base();
    for resource in &component.resources {
        docs.extend(
            load_file(&format!("deploy/components/{dir}/{resource}"))
                .unwrap_or_else(|e| panic!("{e}")),
        );
    }
    for patch in &component.patches {
        let kind = patch["target"]["kind"].as_str().expect("target kind");
        let name = patch["target"]["name"].as_str().expect("target name");
        let ops: json_patch::Patch =
            serde_saphyr::from_str(patch["patch"].as_str().expect("an inline JSON 6902 patch"))
                .unwrap_or_else(|e| panic!("{rel}: the patch is not JSON 6902: {e}"));
        let target = docs
            .iter_mut()
            .find(|d| d.kind() == kind && d.name() == name)
            .unwrap_or_else(|| panic!("{rel}: no {kind} {name} to patch"));
        json_patch::patch(&mut target.value, &ops)
            .unwrap_or_else(|e| panic!("{rel}: the patch does not apply to {kind} {name}: {e}"));
        target.source = format!("{} patched by {rel}", target.source);
        check_typed(target).unwrap_or_else(|e| panic!("{e}"));
    }
    docs
}

/// The host-pid component switches on the host PID namespace and mounts the host's /proc
/// read-only at /host/proc, where the agent (GPUWARDEN_HOST_ROOT=/host) reads
/// /proc/<pid>/cgroup; the patched DaemonSet is still a valid DaemonSet.
#[test]
fn host_pid_component_patches_the_agent() {
    let docs = with_component("host-pid");
    let ds = find(&docs, "DaemonSet", install::NODE_AGENT_NAME);
    let spec = manifests::pod_spec(&ds.value).expect("pod spec");
    assert_eq!(spec["hostPID"], true);
    let container = &spec["containers"][0];
    let mount = container["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .find(|m| m["mountPath"] == "/host/proc")
        .expect("/host/proc mounted");
    assert_eq!(mount["readOnly"], true);
    let host_root = container["env"]
        .as_array()
        .expect("env")
        .iter()
        .find(|e| e["name"] == "GPUWARDEN_HOST_ROOT")
        .expect("GPUWARDEN_HOST_ROOT");
    assert_eq!(host_root["value"], "/host");
}

/// The node-agent-privileged component makes the agent privileged (so the NVIDIA runtime
/// gives it NVML even with `accept-nvidia-visible-devices-envvar-when-unprivileged =
/// false`), with privilege escalation allowed as Kubernetes requires of a privileged
/// container, the NVML variables kept, and nothing else changed; its namespace is one the
/// default policy exempts, so gpuwarden's own webhook and backstop leave it alone.
#[test]
fn node_agent_privileged_component_gives_the_agent_nvml_without_the_leak() {
    let base_docs = base();
    let docs = with_component("node-agent-privileged");
    let ds = find(&docs, "DaemonSet", install::NODE_AGENT_NAME);
    let container = &manifests::pod_spec(&ds.value).expect("pod spec")["containers"][0];
    let security = &container["securityContext"];
    assert_eq!(security["privileged"], true);
    assert_eq!(security["allowPrivilegeEscalation"], true);
    let env = container["env"].as_array().expect("env");
    for (name, value) in [
        ("NVIDIA_VISIBLE_DEVICES", "all"),
        ("NVIDIA_DRIVER_CAPABILITIES", "utility"),
    ] {
        assert!(
            env.iter().any(|e| e["name"] == name && e["value"] == value),
            "{name}={value} is gone: {env:?}"
        );
    }
    let mut unpatched = find(&base_docs, "DaemonSet", install::NODE_AGENT_NAME)
        .value
        .clone();
    unpatched["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privileged"] =
        serde_json::json!(true);
    unpatched["spec"]["template"]["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] =
        serde_json::json!(true);
    assert_eq!(
        ds.value, unpatched,
        "the component changes only the two fields"
    );
    let namespace = ds.value["metadata"]["namespace"]
        .as_str()
        .expect("namespace");
    let policy = gpuwarden_crds::GpuPolicy::default_policy();
    assert!(
        policy
            .spec
            .exemptions
            .namespaces
            .iter()
            .any(|n| n == namespace),
        "{namespace} is not exempt by default"
    );
}

/// The taint-unhealthy-nodes component turns the operator's flag on and grants exactly the
/// one extra call it makes: a patch of Node taints.
#[test]
fn taint_component_grants_node_patch_and_sets_the_flag() {
    let docs = with_component("taint-unhealthy-nodes");
    let operator = find(&docs, "Deployment", install::OPERATOR_NAME);
    let env =
        manifests::pod_spec(&operator.value).expect("pod spec")["containers"][0]["env"].clone();
    assert!(
        env.as_array()
            .expect("env")
            .iter()
            .any(|e| e["name"] == "GPUWARDEN_TAINT_UNHEALTHY_NODES" && e["value"] == "true")
    );
    let mut expected = expand(EXPECTED_GRANTS, install::OPERATOR_NAME);
    expected.insert(Grant {
        scope: None,
        group: String::new(),
        resource: "nodes".into(),
        verb: "patch".into(),
        name: None,
    });
    assert_eq!(granted(&docs, install::OPERATOR_NAME), expected);
}

/// The kind of the metric `expr` (the third argument of `register`) in `source`: the type
/// written where its variable or field is declared.
fn metric_kind(source: &str, expr: &str) -> &'static str {
    let var = expr
        .trim()
        .trim_end_matches(".clone()")
        .rsplit('.')
        .next()
        .unwrap_or_default()
        .trim();
    for line in source.lines() {
        let line = line.trim();
        let decl = line
            .strip_prefix("pub ")
            .unwrap_or(line)
            .strip_prefix("let ")
            .unwrap_or(line.strip_prefix("pub ").unwrap_or(line));
        let Some(rest) = decl.strip_prefix(var) else {
            continue;
        };
        let rest = rest.trim_start();
        if !(rest.starts_with(':') || rest.starts_with('=')) {
            continue;
        }
        if rest.contains("Histogram") {
            return "histogram";
        }
        if rest.contains("Counter") {
            return "counter";
        }
        if rest.contains("Gauge") {
            return "gauge";
        }
    }
    "unknown"
}

/// Metric names each binary registers (read from its `metrics.rs`, where every metric is
/// registered under the component's prefix), with the sample suffixes Prometheus sees:
/// `_total` for counters; `_bucket`, `_sum`, `_count` for histograms.
fn exported_metric_names() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for file in [
        "webhook/src/metrics.rs",
        "node-agent/src/metrics.rs",
        "operator/src/metrics.rs",
    ] {
        let source = std::fs::read_to_string(repo_root().join(file))
            .unwrap_or_else(|e| panic!("failed to read {file}: {e}"));
        let prefix = source
            .split("with_prefix(\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
            .unwrap_or_else(|| panic!("{file}: no registry with a prefix"));
        for call in source.split(".register(").skip(1) {
            // register("name", "help", metric)
            let mut parts = call.splitn(5, '"');
            let (Some(_), Some(name), Some(_), Some(_), Some(rest)) = (
                parts.next(),
                parts.next(),
                parts.next(),
                parts.next(),
                parts.next(),
            ) else {
                panic!("{file}: unexpected register call {call:.80}");
            };
            let expr = rest
                .trim_start_matches(|c: char| c == ',' || c.is_whitespace())
                .split(')')
                .next()
                .unwrap_or_default();
            // A name registered at the root already carries its whole name.
            let full = if name.starts_with("gpuwarden_") {
                name.to_owned()
            } else {
                format!("{prefix}_{name}")
            };
            match metric_kind(&source, &format!("{expr})")) {
                "counter" => {
                    names.insert(format!("{full}_total"));
                }
                "histogram" => {
                    for suffix in ["_bucket", "_sum", "_count"] {
                        names.insert(format!("{full}{suffix}"));
                    }
                }
                "gauge" => {
                    names.insert(full);
                }
                _ => panic!("{file}: cannot tell the kind of {full} ({expr})"),
            }
        }
    }
    // Cross-check with what the registries really encode (families appear once they have
    // a sample, plain metrics always).
    let encoded = [
        gpuwarden_webhook::metrics::Metrics::new()
            .encode()
            .expect("webhook metrics encode"),
        gpuwarden_node_agent::metrics::Metrics::new().encode(),
        gpuwarden_operator::metrics::Metrics::new().encode(),
    ];
    for text in &encoded {
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            assert!(
                names.contains(name),
                "{name} is exported but not found in the sources ({names:?})"
            );
        }
    }
    names
}

/// The monitoring component scrapes the components' metrics ports, and its Grafana
/// dashboard (valid JSON) queries only metrics the webhook, node agent and operator really
/// export: a renamed metric fails here, not on a blank panel.
#[test]
fn monitoring_component_matches_the_exported_metrics() {
    let docs = with_component("monitoring");
    let monitor = find(&docs, "PodMonitor", "gpuwarden");
    let port = monitor.value["spec"]["podMetricsEndpoints"][0]["port"]
        .as_str()
        .expect("port name");
    for w in workloads(&docs) {
        let c = &manifests::pod_spec(&w.value).expect("pod spec")["containers"][0];
        assert!(
            c["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|p| p["name"] == port),
            "{} has no port named {port}",
            w.id()
        );
        assert_eq!(
            w.value["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"],
            "gpuwarden",
            "{}: not selected by the PodMonitor",
            w.id()
        );
    }
    let dashboard = find(&docs, "ConfigMap", "gpuwarden-dashboard");
    let text = dashboard.value["data"]["gpuwarden.json"]
        .as_str()
        .expect("dashboard JSON");
    let json: Value = serde_json::from_str(text).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    fn collect(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr" | "definition", Value::String(s)) => out.push(s.clone()),
                        _ => collect(v, out),
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|v| collect(v, out)),
            _ => {}
        }
    }
    collect(&json, &mut exprs);
    assert!(exprs.len() > 10, "the dashboard has queries");
    let exported = exported_metric_names();
    assert!(
        exported.contains("gpuwarden_webhook_reviews_total"),
        "{exported:?}"
    );
    let mut used = BTreeSet::new();
    for expr in &exprs {
        let mut rest = expr.as_str();
        while let Some(i) = rest.find("gpuwarden_") {
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            used.insert(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    let unknown: Vec<_> = used.difference(&exported).collect();
    assert!(
        unknown.is_empty(),
        "the dashboard queries metrics nobody exports: {unknown:?}"
    );
    for prefix in ["gpuwarden_webhook_", "gpuwarden_node_agent_"] {
        assert!(
            used.iter().any(|m| m.starts_with(prefix)),
            "the dashboard shows no {prefix} metric"
        );
    }
}

/// Every component lists only files that exist and applies to the base.
#[test]
fn every_component_applies_to_the_base() {
    let dir = repo_root().join("deploy/components");
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).expect("deploy/components") {
        let name = entry
            .expect("entry")
            .file_name()
            .to_string_lossy()
            .into_owned();
        with_component(&name);
        count += 1;
    }
    assert!(count >= 3, "host-pid, monitoring and taint-unhealthy-nodes");
}

/// The admission policies are bound, take the default GpuPolicy as their parameter where
/// they need one, exempt what the webhook exempts, and pin the node agent by the exact
/// service-account user name.
#[test]
fn admission_policies_are_bound_and_consistent() {
    let docs = base();
    let policies: Vec<&Document> = docs
        .iter()
        .filter(|d| d.kind() == "ValidatingAdmissionPolicy")
        .collect();
    assert_eq!(policies.len(), 6);
    let names: BTreeSet<&str> = docs
        .iter()
        .filter(|d| d.kind() == "ValidatingAdmissionPolicyBinding")
        .map(Document::name)
        .collect();
    assert_eq!(names.len(), 6, "one binding per policy");
    for policy in policies {
        let binding: ValidatingAdmissionPolicyBinding = typed(find(
            &docs,
            "ValidatingAdmissionPolicyBinding",
            policy.name(),
        ));
        let spec = binding.spec.expect("binding spec");
        assert_eq!(spec.policy_name.as_deref(), Some(policy.name()));
        // The start-up warning only tells; the others refuse.
        let warns = policy.name() == gpuwarden_crds::admission::start_up::NAME;
        let action = if warns { "Warn" } else { "Deny" };
        assert_eq!(spec.validation_actions, Some(vec![action.to_string()]));
        let typed_policy: ValidatingAdmissionPolicy = typed(policy);
        let pspec = typed_policy.spec.expect("policy spec");
        // The ConfigMap guards meet every ConfigMap (and Secret) write, and the claim guard
        // every claim write: they fail open.
        let guards = [
            "gpuwarden-kai-sharing-configmaps",
            "gpuwarden-runtime-variables",
            gpuwarden_crds::admission::driver_claims::NAME,
        ];
        let failure = if guards.contains(&policy.name()) || warns {
            "Ignore"
        } else {
            "Fail"
        };
        assert_eq!(pspec.failure_policy.as_deref(), Some(failure));
        if warns {
            // Cluster-wide, for the pods gpuwarden rewrote only.
            assert!(spec.match_resources.is_none() && pspec.param_kind.is_none());
            let conditions = serde_json::to_string(&pspec.match_conditions).expect("json");
            assert!(
                conditions.contains(gpuwarden_crds::ANNOTATION_REWRITTEN),
                "{conditions}"
            );
            continue;
        }
        if let Some(param_kind) = &pspec.param_kind {
            assert_eq!(
                param_kind.api_version.as_deref(),
                Some(format!("{}/{}", gpuwarden_crds::GROUP, gpuwarden_crds::VERSION).as_str())
            );
            assert_eq!(param_kind.kind.as_deref(), Some("GpuPolicy"));
            let param = spec.param_ref.as_ref().expect("paramRef");
            if policy.name() == "gpuwarden-kai-sharing-configmaps" {
                // Every GpuPolicy is a parameter; one that does not name KAI is skipped.
                assert!(param.name.is_none(), "{param:?}");
                assert_eq!(param.selector, Some(Default::default()));
                assert_eq!(param.parameter_not_found_action.as_deref(), Some("Allow"));
                let conditions = serde_json::to_string(&pspec.match_conditions).expect("json");
                assert!(
                    conditions.contains("params.spec.gpu.sharing.kai"),
                    "{conditions}"
                );
                continue;
            }
            assert_eq!(
                param.name.as_deref(),
                Some(gpuwarden_crds::DEFAULT_POLICY_NAME)
            );
            assert!(param.namespace.is_none(), "GpuPolicy is cluster-scoped");
            let selector = spec
                .match_resources
                .as_ref()
                .and_then(|m| m.namespace_selector.as_ref())
                .and_then(|s| s.match_expressions.as_ref())
                .expect("namespaceSelector");
            let values: BTreeSet<&str> = selector[0]
                .values
                .iter()
                .flatten()
                .map(String::as_str)
                .collect();
            assert!(values.contains("kube-system"));
            assert!(values.contains(gpuwarden_crds::SYSTEM_NAMESPACE));
        } else {
            let user = format!(
                "system:serviceaccount:{}:{}",
                gpuwarden_crds::SYSTEM_NAMESPACE,
                install::NODE_AGENT_NAME
            );
            let conditions = pspec.match_conditions.expect("matchConditions");
            assert!(
                conditions.iter().any(|c| c.expression.contains(&user)),
                "the agent policy matches {user}"
            );
            let variables = serde_json::to_string(&pspec.variables).expect("variables");
            assert!(variables.contains("authentication.kubernetes.io/node-name"));
            assert!(variables.contains(&format!("'{}'", gpuwarden_crds::AGENT_LEASE_PREFIX)));
            assert!(pspec.validations.is_some_and(|v| !v.is_empty()));
        }
    }
}

/// The environment variables each binary reads: every clap `env = "..."` in its main.rs,
/// plus `RUST_LOG` (the log filter).
fn binary_env(binary_dir: &str) -> BTreeSet<String> {
    let main = std::fs::read_to_string(repo_root().join(binary_dir).join("src/main.rs"))
        .unwrap_or_else(|e| panic!("failed to read {binary_dir}/src/main.rs: {e}"));
    let mut names: BTreeSet<String> = main
        .split("env = \"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .map(str::to_string)
        .collect();
    names.insert("RUST_LOG".to_string());
    names
}

/// Every environment variable the manifests set on a gpuwarden container is one its binary
/// reads (NVIDIA_* are for the NVIDIA runtime, not the binary), and each runs a subcommand
/// its binary has: a renamed flag fails here, not in a crash-looping pod.
#[test]
fn manifests_only_set_what_the_binaries_read() {
    let mut docs = base();
    for component in ["host-pid", "taint-unhealthy-nodes", "node-agent-privileged"] {
        docs.extend(
            with_component(component)
                .into_iter()
                .filter(|d| manifests::pod_spec(&d.value).is_some()),
        );
    }
    for (name, dir, subcommand) in [
        (install::WEBHOOK_NAME, "webhook", "Serve("),
        (install::OPERATOR_NAME, "operator", "Run("),
        (install::NODE_AGENT_NAME, "node-agent", "Run("),
    ] {
        let known = binary_env(dir);
        let main =
            std::fs::read_to_string(repo_root().join(dir).join("src/main.rs")).expect("main.rs");
        for w in docs
            .iter()
            .filter(|d| d.name() == name && manifests::pod_spec(&d.value).is_some())
        {
            let containers = manifests::pod_spec(&w.value).expect("pod spec")["containers"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            for c in &containers {
                for e in c["env"].as_array().into_iter().flatten() {
                    let var = e["name"].as_str().expect("env name");
                    if var.starts_with("NVIDIA_") {
                        continue;
                    }
                    assert!(
                        known.contains(var),
                        "{}: {var} is not read by {dir}/src/main.rs (it reads {known:?})",
                        w.source
                    );
                }
                let args: Vec<&str> = c["args"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect();
                // The first container runs the component's subcommand; any other runs one its
                // binary has too (`runtime-report` is `RuntimeReport(`).
                let expected = subcommand.trim_end_matches('(').to_lowercase();
                let first = args.first().copied().unwrap_or_default();
                if c["name"] == containers[0]["name"] {
                    assert_eq!(first, expected, "{}", w.source);
                }
                let variant: String = first
                    .split('-')
                    .map(|part| {
                        let mut chars = part.chars();
                        chars.next().map_or_else(String::new, |f| {
                            f.to_uppercase().chain(chars).collect::<String>()
                        })
                    })
                    .collect();
                assert!(
                    main.contains(&format!("{variant}(")),
                    "{dir} has no {first} subcommand"
                );
                for probe in ["livenessProbe", "readinessProbe"] {
                    if let Some(command) = c[probe]["exec"]["command"].as_array() {
                        assert_eq!(
                            command.first(),
                            c["command"].get(0),
                            "{}: {probe}",
                            w.source
                        );
                        assert_eq!(command.get(1), c["args"].get(0), "{}: {probe}", w.source);
                    }
                }
            }
        }
    }
}

/// The image the manifests run is what the Dockerfile builds: every binary a workload's
/// `command` names is built (release, `--locked`) and copied to /usr/local/bin, and the
/// image's numeric non-root user is the one the webhook and operator run as.
#[test]
fn dockerfile_builds_what_the_manifests_run() {
    let dockerfile = std::fs::read_to_string(repo_root().join("Dockerfile")).expect("Dockerfile");
    let ignore = std::fs::read_to_string(repo_root().join(".dockerignore")).expect(".dockerignore");
    assert!(
        ignore.lines().any(|l| l.trim() == "target/"),
        ".dockerignore keeps target/ out"
    );
    assert!(dockerfile.contains("cargo build --release --locked"));
    assert!(dockerfile.contains("COPY --from=build /out/ /usr/local/bin/"));
    let user = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER line");
    let (uid, gid) = user.trim().split_once(':').expect("USER uid:gid");
    let uid: i64 = uid.parse().expect("numeric uid");
    let _: i64 = gid.parse().expect("numeric gid");
    assert!(uid > 0, "the image runs as non-root");
    let docs = base();
    for w in workloads(&docs) {
        let spec = manifests::pod_spec(&w.value).expect("pod spec");
        let command = spec["containers"][0]["command"][0]
            .as_str()
            .expect("command");
        let binary = command
            .strip_prefix("/usr/local/bin/")
            .expect("in /usr/local/bin");
        assert!(
            dockerfile.contains(&format!("-p {binary}"))
                && dockerfile.contains(&format!("target/release/{binary}")),
            "the Dockerfile does not build and copy {binary}"
        );
        if w.name() != install::NODE_AGENT_NAME {
            assert_eq!(
                spec["securityContext"]["runAsUser"],
                json!(uid),
                "{}",
                w.id()
            );
        }
    }
}

/// The resources a component's code touches, read from its sources: every `Api<Kind>`,
/// an event `Recorder` (events) and a `LeaseManagerBuilder` (leases).
fn resources_in_code(dir: &str) -> BTreeSet<String> {
    let kinds = [
        ("GpuPolicy", "gpupolicies"),
        ("GpuNode", "gpunodes"),
        ("Namespace", "namespaces"),
        ("Node", "nodes"),
        ("Pod", "pods"),
        ("Lease", "leases"),
        ("Secret", "secrets"),
        ("ResourceClaim", "resourceclaims"),
        ("ResourceClaimTemplate", "resourceclaimtemplates"),
        (
            "MutatingWebhookConfiguration",
            "mutatingwebhookconfigurations",
        ),
        ("CustomResourceDefinition", "customresourcedefinitions"),
    ];
    let mut out = BTreeSet::new();
    let src = repo_root().join(dir).join("src");
    // The crate's sources, its modules' directories included.
    let mut files = Vec::new();
    let mut dirs = vec![src];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    for path in files {
        let text = std::fs::read_to_string(&path).expect("source");
        for marker in ["Api::<", "Api<"] {
            for rest in text.split(marker).skip(1) {
                // `Api<PartialObjectMeta<Namespace>>` names Namespace.
                let inner = rest.split('>').next().unwrap_or_default();
                let kind = inner.rsplit('<').next().unwrap_or_default().trim();
                if let Some((_, resource)) = kinds.iter().find(|(k, _)| *k == kind) {
                    out.insert(resource.to_string());
                }
            }
        }
        if text.contains("Recorder::new") {
            out.insert("events".into());
        }
        // KAI-Scheduler's BindRequests, through `Api<DynamicObject>`.
        if text.contains("Api::<DynamicObject>") && text.contains("bind_request_resource") {
            out.insert(gpuwarden_crds::sharing::bind_request::PLURAL.into());
        }
        // PolicyReports and openreports.io Reports, through `Api<DynamicObject>`.
        if text.contains("Api::<DynamicObject>") && text.contains("ReportKind::") {
            out.insert(gpuwarden_crds::reports::POLICY_REPORT_PLURAL.into());
            out.insert(gpuwarden_crds::reports::OPEN_REPORT_PLURAL.into());
        }
        // Their cluster-scoped kinds, for the nodes' posture report.
        if text.contains("cluster_plural()") {
            out.insert(gpuwarden_crds::reports::CLUSTER_POLICY_REPORT_PLURAL.into());
            out.insert(gpuwarden_crds::reports::CLUSTER_OPEN_REPORT_PLURAL.into());
        }
        if text.contains("LeaseManagerBuilder") {
            out.insert("leases".into());
        }
        // The rendered admission policies, by their kinds through `Api<DynamicObject>`.
        if text.contains("Api<DynamicObject>") && text.contains("KIND_MUTATING_BINDING") {
            for resource in [
                "mutatingadmissionpolicies",
                "mutatingadmissionpolicybindings",
                "validatingadmissionpolicies",
                "validatingadmissionpolicybindings",
            ] {
                out.insert(resource.into());
            }
        }
    }
    out
}

/// The RBAC table above stays in step with the code: every resource a component's code
/// calls the API for has a grant in the table, and every resource in the table is one its
/// code touches. A new `Api<Kind>` without RBAC fails here.
#[test]
fn rbac_table_follows_the_code() {
    for (component, dir) in [
        (install::WEBHOOK_NAME, "webhook"),
        (install::OPERATOR_NAME, "operator"),
        (install::NODE_AGENT_NAME, "node-agent"),
    ] {
        let in_code = resources_in_code(dir);
        let in_table: BTreeSet<String> = EXPECTED_GRANTS
            .iter()
            .filter(|row| row.0 == component)
            .map(|row| row.3.split('/').next().unwrap_or_default().to_string())
            .collect();
        assert_eq!(
            in_code, in_table,
            "{component}: resources its code touches (left) and the RBAC table grants (right) differ"
        );
    }
}

/// The example workloads under deploy/examples (what `gpuwarden-webhook mutate` is shown
/// on) are valid objects of their kinds too; the fake GPU files beside them are not
/// Kubernetes objects and are left out.
#[test]
fn examples_are_valid_objects() {
    let dir = repo_root().join("deploy/examples");
    let entries =
        std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()));
    let mut failures = Vec::new();
    let mut count = 0;
    for entry in entries {
        let path = entry.expect("entry").path();
        let name = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        if !(name.ends_with(".yaml") || name.ends_with(".yml")) || name.contains(".fake.") {
            continue;
        }
        let rel = format!("deploy/examples/{name}");
        for doc in load_file(&rel).unwrap_or_else(|e| panic!("{e}")) {
            count += 1;
            if let Err(e) = check_typed(&doc) {
                failures.push(e);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        count >= 6,
        "only {count} example objects found in deploy/examples"
    );
    eprintln!("{count} example objects checked");
}
