//! PolicyReports from the whole operator against the in-process fake API server: a report
//! appears for a governed namespace's finding, follows its pods and goes when they do; both
//! report kinds are written where both are served; where neither is, nothing is written, no
//! Pod is watched, and the operator keeps running; a standby writes nothing until it leads; a
//! crowded namespace's report is cut to its bound and says so.

#[path = "support/fake_api.rs"]
mod fake_api;
#[path = "support/running.rs"]
mod running;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use fake_api::FakeApi;
use running::{Running, free_port, wait_for};
use serde_json::{Value, json};

/// The operator with the reports on and nothing else it would write to the fake: no Lease
/// election, no webhook certificates, no admission policies; `leadership`, when given,
/// decided by the test.
fn start(fake: &Arc<FakeApi>, leadership: Option<gpuwarden_operator::Leadership>) -> Running {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut config = gpuwarden_operator::Config::new("gpuwarden-system");
    config.health_listen = free_port();
    config.leader_election = false;
    config.manage_webhook_certificates = false;
    config.admission_policies = false;
    Running::start(fake, config, leadership)
}

/// An Audit-mode policy over namespaces labelled `team=ml`.
fn audit_policy() -> Value {
    let mut policy = serde_json::to_value(gpuwarden_crds::GpuPolicy::default_policy()).unwrap();
    policy["metadata"] = json!({"name": "ml-audit", "uid": "policy-uid", "generation": 3});
    policy["spec"]["mode"] = json!("Audit");
    policy["spec"]["namespaceSelector"] = json!({"matchLabels": {"team": "ml"}});
    policy
}

fn namespace(name: &str, labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name, "uid": format!("ns-{name}"), "labels": labels}})
}

/// A pod whose trainer runs privileged with every GPU of the node.
fn privileged_pod(namespace: &str, name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{name}"),
            "creationTimestamp": "2026-01-02T03:04:05Z"},
        "spec": {"containers": [{"name": "trainer", "image": "nvcr.io/nvidia/pytorch:24.05-py3",
            "securityContext": {"privileged": true},
            "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]},
        "status": {"phase": "Running"}})
}

fn plain_pod(namespace: &str, name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{name}")},
        "spec": {"containers": [{"name": "web", "image": "nginx:1.27"}]},
        "status": {"phase": "Running"}})
}

/// A cluster with the policy, namespace `ml` (governed) and `web` (not), a privileged GPU pod
/// in each and an ordinary one in `ml`.
fn cluster() -> Arc<FakeApi> {
    let fake = Arc::new(FakeApi::default());
    fake.insert("gpupolicies", "ml-audit", audit_policy());
    fake.insert("namespaces", "ml", namespace("ml", json!({"team": "ml"})));
    fake.insert("namespaces", "web", namespace("web", json!({})));
    fake.insert("pods", "ml/train", privileged_pod("ml", "train"));
    fake.insert("pods", "ml/frontend", plain_pod("ml", "frontend"));
    fake.insert("pods", "web/train", privileged_pod("web", "train"));
    fake
}

fn results_of(report: &Value) -> Vec<Value> {
    report["results"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_governed_namespace_gets_a_report_that_follows_its_pods() {
    let fake = cluster();
    fake.serve_reports("wgpolicyk8s.io/v1alpha2");
    let operator = start(&fake, None);
    let t = Duration::from_secs(30);

    wait_for("the report of ml", t, || {
        fake.get("policyreports", "ml/gpuwarden").is_some()
    })
    .await;
    let report = fake.get("policyreports", "ml/gpuwarden").unwrap();
    assert_eq!(report["apiVersion"], "wgpolicyk8s.io/v1alpha2");
    assert_eq!(report["kind"], "PolicyReport");
    assert_eq!(
        report["metadata"]["labels"]["app.kubernetes.io/managed-by"],
        "gpuwarden-operator"
    );
    let results = results_of(&report);
    assert!(!results.is_empty());
    for r in &results {
        assert_eq!(r["source"], "gpuwarden");
        assert_eq!(r["policy"], "ml-audit");
        assert_eq!(r["resources"][0]["kind"], "Pod");
        // The ordinary pod only gets the void rule's warning.
        if r["resources"][0]["name"] == "frontend" {
            assert_eq!(
                (&r["rule"], &r["result"]),
                (&json!("void"), &json!("warn")),
                "{r:#}"
            );
            assert_eq!(r["properties"]["verdict"], "unchanged");
            continue;
        }
        assert_eq!(r["resources"][0]["name"], "train", "{r:#}");
        assert_eq!(r["resources"][0]["uid"], "uid-train");
        assert_eq!(r["properties"]["mode"], "Audit");
        assert_eq!(r["properties"]["verdict"], "audited");
        assert_eq!(r["properties"]["policyReference"], "ml-audit@3");
        assert_eq!(
            r["timestamp"]["seconds"], 1_767_323_045,
            "found when the pod was created"
        );
    }
    assert!(
        results
            .iter()
            .any(|r| r["resources"][0]["name"] == "frontend")
    );
    let privileged = results
        .iter()
        .find(|r| r["rule"] == "privileged-gpu")
        .expect("a privileged-gpu result");
    assert_eq!(privileged["properties"]["container"], "trainer");
    assert_eq!(privileged["result"], "fail");
    assert_eq!(privileged["severity"], "high");
    let message = privileged["message"].as_str().unwrap();
    assert!(
        message.starts_with("container trainer: privileged removed"),
        "{message}"
    );
    assert!(message.contains("NVIDIA_VISIBLE_DEVICES"), "{message}");
    assert_eq!(
        report["summary"]["fail"],
        json!(results.iter().filter(|r| r["result"] == "fail").count())
    );
    // Not governed: no report.
    assert!(fake.get("policyreports", "web/gpuwarden").is_none());

    // Status updates change nothing the report reads: no write.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let writes = fake.writes.load(Ordering::Relaxed);
    fake.modify("pods", "ml/train", |p| {
        p["status"]["conditions"] = json!([{"type": "Ready", "status": "True"}]);
    });
    fake.modify("pods", "ml/frontend", |p| {
        p["status"]["podIP"] = json!("10.0.0.7");
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        fake.writes.load(Ordering::Relaxed),
        writes,
        "a status update wrote"
    );

    // A second privileged pod: one more apply, naming both.
    fake.create("pods", "ml/train-2", privileged_pod("ml", "train-2"));
    wait_for("the second pod in the report", t, || {
        fake.get("policyreports", "ml/gpuwarden").is_some_and(|r| {
            results_of(&r)
                .iter()
                .any(|r| r["resources"][0]["name"] == "train-2")
        })
    })
    .await;

    // The pods go: the report goes.
    fake.remove("pods", "ml/train");
    fake.remove("pods", "ml/train-2");
    fake.remove("pods", "ml/frontend");
    wait_for("the report deleted", t, || {
        fake.get("policyreports", "ml/gpuwarden").is_none()
    })
    .await;
    operator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_kinds_are_written_where_both_are_served_and_a_namespace_that_leaves_its_policy_loses_its_report()
 {
    let fake = cluster();
    fake.serve_reports("wgpolicyk8s.io/v1alpha2");
    fake.serve_reports("openreports.io/v1alpha1");
    // A report left behind by an earlier run in a namespace with nothing to report.
    fake.insert("namespaces", "old", namespace("old", json!({})));
    fake.insert(
        "policyreports",
        "old/gpuwarden",
        json!({
            "apiVersion": "wgpolicyk8s.io/v1alpha2", "kind": "PolicyReport",
            "metadata": {"name": "gpuwarden", "namespace": "old",
                "labels": {"app.kubernetes.io/managed-by": "gpuwarden-operator"}},
            "results": [],
        }),
    );
    let operator = start(&fake, None);
    let t = Duration::from_secs(30);
    wait_for("both reports", t, || {
        fake.get("policyreports", "ml/gpuwarden").is_some()
            && fake.get("reports", "ml/gpuwarden").is_some()
    })
    .await;
    let open = fake.get("reports", "ml/gpuwarden").unwrap();
    assert_eq!(open["apiVersion"], "openreports.io/v1alpha1");
    assert_eq!(open["kind"], "Report");
    assert_eq!(open["source"], "gpuwarden");
    assert_eq!(
        results_of(&open),
        results_of(&fake.get("policyreports", "ml/gpuwarden").unwrap()),
        "the same results in both kinds"
    );
    wait_for("the leftover report deleted", t, || {
        fake.get("policyreports", "old/gpuwarden").is_none()
    })
    .await;

    // The namespace loses the label the policy selects: no longer governed, no report.
    fake.modify("namespaces", "ml", |ns| {
        ns["metadata"]["labels"] = json!({});
    });
    wait_for("reports deleted", t, || {
        fake.get("policyreports", "ml/gpuwarden").is_none()
            && fake.get("reports", "ml/gpuwarden").is_none()
    })
    .await;
    operator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_report_kind_nothing_is_written_no_pod_is_watched_and_the_operator_runs_on() {
    let fake = cluster();
    let operator = start(&fake, None);
    // The operator comes up (it reports on its policies) and stays up.
    wait_for("policy status", Duration::from_secs(30), || {
        fake.get("gpupolicies", "ml-audit")
            .is_some_and(|p| p["status"]["observedGeneration"] == 3)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(!operator.is_finished(), "the operator stopped");
    assert_eq!(fake.count("policyreports"), 0);
    assert_eq!(fake.count("reports"), 0);
    let requests = fake.requests.lock().unwrap().clone();
    assert!(
        !requests
            .iter()
            .any(|r| r.contains("/pods") || r.contains("reports")),
        "{requests:#?}"
    );
    operator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_writes_no_report_until_it_leads() {
    let fake = cluster();
    fake.serve_reports("wgpolicyk8s.io/v1alpha2");
    let (leader_tx, leadership) = gpuwarden_operator::Leadership::channel(false);
    let operator = start(&fake, Some(leadership));
    // It watches its Pods (the report kind is served) and still writes nothing. The fake
    // replays no event to a watch that starts later, so the pod is created once the watch
    // is open, not merely after the listing.
    wait_for("the Pod watch", Duration::from_secs(30), || {
        (fake.collections.lock().unwrap())
            .get("pods")
            .is_some_and(|pods| !pods.watchers.is_empty())
    })
    .await;
    fake.create("pods", "ml/train-2", privileged_pod("ml", "train-2"));
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(fake.count("policyreports"), 0, "a standby wrote a report");

    leader_tx.send(true).unwrap();
    wait_for("the report once leading", Duration::from_secs(30), || {
        fake.get("policyreports", "ml/gpuwarden").is_some_and(|r| {
            let names: Vec<Value> = results_of(&r)
                .iter()
                .map(|r| r["resources"][0]["name"].clone())
                .collect();
            names.contains(&json!("train")) && names.contains(&json!("train-2"))
        })
    })
    .await;
    operator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowded_namespace_gets_a_report_cut_to_its_bound() {
    let fake = cluster();
    fake.serve_reports("openreports.io/v1alpha1");
    for i in 0..510 {
        let name = format!("train-{i:03}");
        fake.insert("pods", &format!("ml/{name}"), privileged_pod("ml", &name));
    }
    let operator = start(&fake, None);
    wait_for("the report of ml", Duration::from_secs(30), || {
        fake.get("reports", "ml/gpuwarden").is_some()
    })
    .await;
    let report = fake.get("reports", "ml/gpuwarden").unwrap();
    let bytes = serde_json::to_vec(&report).unwrap().len();
    assert!(bytes < 1_500_000, "{bytes} bytes");
    assert_eq!(results_of(&report).len(), 500);
    // 511 privileged pods and the ordinary one's void warning: 512 results in all.
    assert_eq!(report["summary"]["fail"], 511);
    assert_eq!(report["summary"]["warn"], 1);
    let note = report["metadata"]["annotations"]["gpuwarden.io/results-omitted"]
        .as_str()
        .unwrap();
    assert!(note.starts_with("12 of 512 results are left out"), "{note}");
    operator.stop().await;
}
