//! PolicyReports on a real API server: with a PolicyReport CRD installed (a minimal one
//! written here), one namespace under an Audit policy and one under Enforce whose pods were
//! created before its policy existed (no webhook is registered: they bypassed it), the
//! operator's reports list exactly what `gpuwarden-webhook mutate -o policyreport` says of
//! the same pods read back from the cluster, `kubectl get polr -A` shows them, and the
//! reports go when the pods do.
//!
//! ```sh
//! KUBECONFIG=... flock /scratch/rig.lock cargo test -p gpuwarden-e2e --test reports -- --ignored --nocapture
//! ```
//!
//! The pods stay Pending (a nodeSelector no node has). The operator runs in this process as
//! the only writer, without webhook certificates or admission policies; it also keeps the
//! GpuNode of each GPU node, which is deleted again where it did not exist before.

use std::process::Command;
use std::time::Duration;

use gpuwarden_crds::{GpuNode, GpuPolicy, PolicyMode};
use gpuwarden_e2e::cluster::{settled, wait_for};
use gpuwarden_e2e::env::{Env, SHORT};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, PostParams};
use kube::{ResourceExt, api::ListParams};
use serde_json::{Value, json};

const CRD_NAME: &str = "policyreports.wgpolicyk8s.io";

/// The least of the Policy WG's PolicyReport CRD that serves the kind: namespaced,
/// `wgpolicyk8s.io/v1alpha2`, short name `polr`, any content.
fn policy_report_crd() -> CustomResourceDefinition {
    serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": "wgpolicyk8s.io",
            "scope": "Namespaced",
            "names": {"plural": "policyreports", "singular": "policyreport",
                "kind": "PolicyReport", "listKind": "PolicyReportList", "shortNames": ["polr"]},
            "versions": [{"name": "v1alpha2", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object",
                    "x-kubernetes-preserve-unknown-fields": true}}}],
        },
    }))
    .expect("CRD")
}

const CLUSTER_CRD_NAME: &str = "clusterpolicyreports.wgpolicyk8s.io";

/// The same of the ClusterPolicyReport CRD: cluster-scoped, short name `cpolr`.
fn cluster_policy_report_crd() -> CustomResourceDefinition {
    let mut crd = serde_json::to_value(policy_report_crd()).expect("json");
    crd["metadata"]["name"] = json!(CLUSTER_CRD_NAME);
    crd["spec"]["scope"] = json!("Cluster");
    crd["spec"]["names"] = json!({"plural": "clusterpolicyreports",
        "singular": "clusterpolicyreport", "kind": "ClusterPolicyReport",
        "listKind": "ClusterPolicyReportList", "shortNames": ["cpolr"]});
    serde_json::from_value(crd).expect("CRD")
}

fn reports_api(env: &Env, namespace: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("wgpolicyk8s.io", "v1alpha2", "PolicyReport");
    let resource = ApiResource::from_gvk_with_plural(&gvk, "policyreports");
    Api::namespaced_with(env.client(), namespace, &resource)
}

/// A pod that stays Pending: `privileged` with `env` in container `trainer`, and an
/// ordinary `sidecar`.
fn pod(name: &str, gpu_limit: bool) -> Value {
    let mut trainer = json!({"name": "trainer", "image": "docker.io/library/busybox:latest",
        "command": ["sleep", "3600"], "securityContext": {"privileged": true}});
    if gpu_limit {
        trainer["resources"] = json!({"limits": {"nvidia.com/gpu": "1"}});
    } else {
        trainer["env"] = json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]);
    }
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"nodeSelector": {"gpuwarden.io/e2e-nowhere": "true"},
            "containers": [trainer, {"name": "sidecar", "image": "docker.io/library/busybox:latest",
                "command": ["sleep", "3600"]}]}})
}

/// What `mutate -o policyreport` says of the pods of `namespaces` as the cluster holds them,
/// under every GpuPolicy of the cluster: its reports by namespace.
async fn mutate_reports(env: &Env, namespaces: &[&str]) -> Vec<Value> {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut docs = Vec::new();
    for ns in namespaces {
        let namespace = Api::<Namespace>::all(env.client())
            .get(ns)
            .await
            .expect("namespace");
        docs.push(serde_json::to_value(namespace).expect("json"));
        for p in Api::<Pod>::namespaced(env.client(), ns)
            .list(&ListParams::default())
            .await
            .expect("pods")
        {
            let mut v = serde_json::to_value(p).expect("json");
            v["apiVersion"] = json!("v1");
            v["kind"] = json!("Pod");
            docs.push(v);
        }
    }
    let policies: Vec<Value> = Api::<GpuPolicy>::all(env.client())
        .list(&ListParams::default())
        .await
        .expect("policies")
        .into_iter()
        .map(|p| {
            let mut v = serde_json::to_value(p).expect("json");
            v["apiVersion"] = json!("gpuwarden.io/v1alpha1");
            v["kind"] = json!("GpuPolicy");
            v
        })
        .collect();
    let write = |name: &str, docs: &[Value]| {
        let path = dir.path().join(name);
        let text: Vec<String> = (docs.iter())
            .map(|d| serde_saphyr::to_string(d).expect("YAML"))
            .collect();
        std::fs::write(&path, text.join("\n---\n")).expect("write");
        path
    };
    let manifests = write("pods.yaml", &docs);
    let policy_file = write("policies.yaml", &policies);
    let args = gpuwarden_webhook::mutate::MutateArgs {
        filenames: vec![manifests.display().to_string()],
        policies: vec![policy_file],
        output: gpuwarden_webhook::mutate::OutputFormat::PolicyReport,
        namespace: None,
        namespace_labels: None,
    };
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = gpuwarden_webhook::mutate::run(&args, &mut std::io::empty(), &mut out, &mut err);
    let err = String::from_utf8_lossy(&err);
    assert!(code != 2, "mutate failed: {err}");
    eprintln!("mutate:\n{err}");
    serde_saphyr::from_multiple(&String::from_utf8_lossy(&out)).expect("mutate's reports")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG, and rights to install a CRD"]
async fn reports_list_what_mutate_would_change_and_empty_when_the_pods_go() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let env = Env::new().await;
    let crds: Api<CustomResourceDefinition> = Api::all(env.client());
    for (name, crd, plural) in [
        (CRD_NAME, policy_report_crd(), "policyreports"),
        (
            CLUSTER_CRD_NAME,
            cluster_policy_report_crd(),
            "clusterpolicyreports",
        ),
    ] {
        let existing = settled(&crds, name, Duration::from_secs(90))
            .await
            .unwrap_or_else(|| panic!("the CRD {name} is stuck terminating"));
        if existing.is_some() {
            continue;
        }
        crds.create(&PostParams::default(), &crd)
            .await
            .unwrap_or_else(|e| panic!("create the CRD {name}: {e}"));
        env.cleanup
            .own_typed::<CustomResourceDefinition>(None, name);
        let served = wait_for(SHORT, || async {
            env.cluster
                .serves("wgpolicyk8s.io/v1alpha2", plural)
                .await
                .then_some(())
        })
        .await;
        assert!(served.is_some(), "the CRD {name} is not served");
    }
    let gpunodes: Vec<String> = Api::<GpuNode>::all(env.client())
        .list(&ListParams::default())
        .await
        .expect("GpuNodes")
        .iter()
        .map(ResourceExt::name_any)
        .collect();

    let audit = env.namespace("reports-audit").await;
    let enforce = env.namespace("reports-enforce").await;
    env.policy_for(&audit, PolicyMode::Audit, false).await;
    for (ns, name, gpu) in [(&audit, "audited", false), (&enforce, "bypassed", true)] {
        let pod: Pod = serde_json::from_value(pod(name, gpu)).expect("pod");
        Api::<Pod>::namespaced(env.client(), ns)
            .create(&PostParams::default(), &pod)
            .await
            .unwrap_or_else(|e| panic!("create pod {ns}/{name}: {e}"));
    }
    // The Enforce policy comes after the pod: the webhook never saw it under this policy.
    env.policy_for(&enforce, PolicyMode::Enforce, false).await;

    let mut config = gpuwarden_operator::Config::new(gpuwarden_crds::SYSTEM_NAMESPACE);
    config.health_listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    config.leader_election = false;
    config.manage_webhook_certificates = false;
    config.admission_policies = false;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let client = env.client();
    let operator = tokio::spawn(async move {
        gpuwarden_operator::run_with(
            config,
            client,
            async move {
                let _ = stopped.await;
            },
            gpuwarden_operator::system_clock(),
            Some(gpuwarden_operator::Leadership::always()),
        )
        .await
    });
    for name in Api::<GpuNode>::all(env.client())
        .list(&ListParams::default())
        .await
        .expect("GpuNodes")
        .iter()
        .map(ResourceExt::name_any)
        .filter(|n| !gpunodes.contains(n))
    {
        env.cleanup.own_typed::<GpuNode>(None, &name);
    }

    let expected = mutate_reports(&env, &[&audit, &enforce]).await;
    assert_eq!(
        expected.len(),
        2,
        "mutate reports both namespaces: {expected:#?}"
    );
    for want in &expected {
        let ns = want["metadata"]["namespace"]
            .as_str()
            .expect("namespace")
            .to_owned();
        let api = reports_api(&env, &ns);
        let got = wait_for(Duration::from_secs(60), || {
            let api = api.clone();
            let want = want["results"].clone();
            async move {
                let report = api.get_opt("gpuwarden").await.ok()??;
                (report.data["results"] == want).then_some(report)
            }
        })
        .await;
        let got = match got {
            Some(got) => got,
            None => panic!(
                "the report in {ns} never matched mutate's:\nmutate: {:#}\ncluster: {:#?}",
                want["results"],
                api.get_opt("gpuwarden").await
            ),
        };
        assert_eq!(got.data["summary"], want["summary"], "{ns}");
        let results = want["results"].as_array().expect("results");
        assert!(!results.is_empty());
        // The sidecar holds no GPU: the void rule is all it gets.
        for r in results {
            assert!(
                r["properties"]["container"] == "trainer" || r["rule"] == "void",
                "{r:#}"
            );
        }
        let verdict = if ns == audit { "audited" } else { "rewritten" };
        assert!(
            results
                .iter()
                .all(|r| r["properties"]["verdict"] == verdict),
            "{results:#?}"
        );
        assert!(
            results.iter().any(|r| r["rule"] == "privileged-gpu"),
            "{results:#?}"
        );
        eprintln!("{ns}: {} results, as mutate says", results.len());
    }

    // `kubectl get polr -A` lists both.
    let out = Command::new("kubectl")
        .args(["get", "polr", "-A"])
        .output()
        .expect("kubectl on PATH");
    let listing = String::from_utf8_lossy(&out.stdout);
    eprintln!("kubectl get polr -A:\n{listing}");
    for ns in [&audit, &enforce] {
        assert!(
            listing
                .lines()
                .any(|l| l.starts_with(ns.as_str()) && l.contains("gpuwarden")),
            "{ns} missing from:\n{listing}"
        );
    }

    // The pods go: so do the reports.
    for (ns, name) in [(&audit, "audited"), (&enforce, "bypassed")] {
        Api::<Pod>::namespaced(env.client(), ns)
            .delete(name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap_or_else(|e| panic!("delete pod {ns}/{name}: {e}"));
    }
    for ns in [&audit, &enforce] {
        let api = reports_api(&env, ns);
        let gone = wait_for(Duration::from_secs(60), || {
            let api = api.clone();
            async move { api.get_opt("gpuwarden").await.ok()?.is_none().then_some(()) }
        })
        .await;
        assert!(
            gone.is_some(),
            "the report in {ns} stayed after its pods went"
        );
    }

    // The GPU nodes' posture: one cluster-scoped report, a RuntimePatched and a
    // RuntimeIsolation result per GpuNode (Unknown until an agent reports: warn).
    let nodes: Vec<String> = Api::<GpuNode>::all(env.client())
        .list(&ListParams::default())
        .await
        .expect("GpuNodes")
        .iter()
        .map(|g| g.spec.node_name.clone())
        .collect();
    let gvk = GroupVersionKind::gvk("wgpolicyk8s.io", "v1alpha2", "ClusterPolicyReport");
    let cluster: Api<DynamicObject> = Api::all_with(
        env.client(),
        &ApiResource::from_gvk_with_plural(&gvk, "clusterpolicyreports"),
    );
    let report = wait_for(Duration::from_secs(90), || {
        let (cluster, nodes) = (cluster.clone(), nodes.clone());
        async move {
            let report = cluster.get_opt("gpuwarden-nodes").await.ok()??;
            let results = report.data["results"].as_array()?.clone();
            let lines: Vec<(String, String)> = (results.iter())
                .map(|r| {
                    let rule = r["rule"].as_str().unwrap_or_default().to_owned();
                    (
                        r["resources"][0]["name"]
                            .as_str()
                            .unwrap_or_default()
                            .to_owned(),
                        rule,
                    )
                })
                .collect();
            let every = nodes.iter().all(|n| {
                ["RuntimePatched", "RuntimeIsolation"]
                    .iter()
                    .all(|rule| lines.contains(&(n.clone(), (*rule).to_owned())))
            });
            (every && lines.len() == 2 * nodes.len()).then_some(report)
        }
    })
    .await;
    if nodes.is_empty() {
        eprintln!("no GpuNode: no nodes' report to check");
    } else {
        let report = report.unwrap_or_else(|| {
            panic!("the ClusterPolicyReport gpuwarden-nodes never listed the GpuNodes {nodes:?}")
        });
        eprintln!(
            "ClusterPolicyReport gpuwarden-nodes: summary {}, {} results for {nodes:?}",
            report.data["summary"],
            report.data["results"].as_array().map_or(0, Vec::len)
        );
        env.cleanup.own(
            ApiResource::from_gvk_with_plural(&gvk, "clusterpolicyreports"),
            None,
            "gpuwarden-nodes",
        );
    }

    let _ = stop.send(());
    let stopped = tokio::time::timeout(Duration::from_secs(30), operator)
        .await
        .expect("the operator stops");
    assert!(matches!(stopped, Ok(Ok(()))), "{stopped:?}");
    env.cleanup.run().await;
}
