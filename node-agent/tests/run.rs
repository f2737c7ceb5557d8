//! `run` end to end in-process: fake GPUs, a fake kubelet on a unix socket, and a mock API
//! server that answers the agent's lists, holds its watches open and records its writes.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuwarden_crds::GpuPolicy;
use gpuwarden_node_agent::Config;
use gpuwarden_node_agent::testing::{FakeKubelet, FakeKubeletServer};
use http::{Method, Request, Response};
use kube::client::Body;
use support::*;

#[derive(Clone, Debug)]
struct Call {
    method: Method,
    path: String,
    query: String,
    body: serde_json::Value,
}

fn json_response(status: u16, value: &serde_json::Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::to_vec(value).unwrap_or_default()))
        .unwrap()
}

fn list(kind: &str, api_version: &str, items: Vec<serde_json::Value>) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": api_version, "kind": kind,
        "metadata": {"resourceVersion": "1"}, "items": items,
    })
}

/// A policy for pool=h100 nodes that ignores no XID. It governs the pods of namespaces
/// labelled team=ops and exempts none of them.
fn strict_policy() -> serde_json::Value {
    let mut p = GpuPolicy::default_policy();
    p.metadata.name = Some("strict-health".into());
    p.metadata.resource_version = Some("1".into());
    p.spec.priority = 50;
    p.spec.namespace_selector.match_labels = Some([("team".to_string(), "ops".to_string())].into());
    p.spec.exemptions = Default::default();
    if let Some(h) = p.spec.health.as_mut() {
        h.ignored_xids.clear();
        h.node_selector.match_labels = Some([("pool".to_string(), "h100".to_string())].into());
    }
    serde_json::to_value(p).unwrap()
}

fn default_policy() -> serde_json::Value {
    let mut p = GpuPolicy::default_policy();
    p.metadata.resource_version = Some("1".into());
    serde_json::to_value(p).unwrap()
}

fn mock_api() -> (kube::Client, Arc<Mutex<Vec<Call>>>) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let seen = calls.clone();
    tokio::spawn(async move {
        let mut held_watches = Vec::new();
        let mut stored_status = serde_json::Value::Null;
        while let Some((req, send)) = handle.next_request().await {
            let (parts, body) = req.into_parts();
            let bytes = body.collect_bytes().await.unwrap_or_default();
            let body: serde_json::Value =
                serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
            let path = parts.uri.path().to_owned();
            let query = parts.uri.query().unwrap_or_default().to_owned();
            seen.lock().unwrap().push(Call {
                method: parts.method.clone(),
                path: path.clone(),
                query: query.clone(),
                body: body.clone(),
            });
            if query.contains("watch=true") {
                // Nothing changes: keep the watch open.
                held_watches.push(send);
                continue;
            }
            let response = match (parts.method.clone(), path.as_str()) {
                // A privileged GPU pod in gpu-operator, which the default policy exempts;
                // its namespace's labels put it under strict-health, which does not.
                (Method::GET, "/api/v1/pods") => list(
                    "PodList",
                    "v1",
                    vec![serde_json::json!({
                        "apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": "exporter", "namespace": "gpu-operator",
                            "uid": "exporter-uid", "resourceVersion": "1"},
                        "spec": {"nodeName": NODE, "containers": [{
                            "name": "dcgm", "image": "nvcr.io/nvidia/k8s/dcgm-exporter:3",
                            "securityContext": {"privileged": true},
                            "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]},
                        "status": {"phase": "Running"},
                    })],
                ),
                (Method::GET, "/api/v1/namespaces") => list(
                    "NamespaceList",
                    "v1",
                    vec![serde_json::json!({
                        "apiVersion": "v1", "kind": "Namespace",
                        "metadata": {"name": "gpu-operator", "resourceVersion": "1",
                            "labels": {"team": "ops"}},
                    })],
                ),
                (Method::GET, "/api/v1/nodes") => list(
                    "NodeList",
                    "v1",
                    vec![serde_json::json!({
                        "apiVersion": "v1", "kind": "Node",
                        "metadata": {"name": NODE, "resourceVersion": "1", "labels": {"pool": "h100"}},
                    })],
                ),
                (Method::GET, "/apis/gpuwarden.io/v1alpha1/gpupolicies") => list(
                    "GpuPolicyList",
                    "gpuwarden.io/v1alpha1",
                    vec![strict_policy(), default_policy()],
                ),
                (Method::PATCH, _) | (Method::GET, _) if path.contains("/gpunodes/") => {
                    if parts.method == Method::PATCH {
                        stored_status = body.get("status").cloned().unwrap_or_default();
                    }
                    serde_json::json!({
                        "apiVersion": "gpuwarden.io/v1alpha1", "kind": "GpuNode",
                        "metadata": {"name": NODE, "resourceVersion": "2"},
                        "spec": {"nodeName": NODE},
                        "status": stored_status,
                    })
                }
                (Method::PATCH, _) if path.contains("/leases/") => {
                    let mut lease = body.clone();
                    lease["metadata"]["resourceVersion"] = "3".into();
                    lease
                }
                _ => {
                    send.send_response(json_response(
                        404,
                        &serde_json::json!({"kind": "Status", "apiVersion": "v1", "code": 404,
                            "status": "Failure", "reason": "NotFound", "metadata": {}}),
                    ));
                    continue;
                }
            };
            send.send_response(json_response(200, &response));
        }
    });
    (kube::Client::new(service, "default"), calls)
}

fn calls_of(calls: &Arc<Mutex<Vec<Call>>>) -> Vec<Call> {
    calls.lock().unwrap().clone()
}

#[tokio::test]
async fn run_writes_status_once_renews_its_lease_and_watches_only_its_pods() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("node.fake.yaml");
    // XID 13 at start: ignored by default, critical under the strict policy.
    std::fs::write(
        &fake,
        format!("{FAKE}  - {{after: 0s, gpu: \"0\", xid: 13}}\n"),
    )
    .unwrap();
    let kubelet = FakeKubeletServer::start(
        &dir.path().join("kubelet.sock"),
        FakeKubelet {
            pods: allocations(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let host = host_root();
    let (client, all_calls) = mock_api();
    let config = Config {
        fake: Some(fake),
        pod_resources_socket: kubelet.socket().to_path_buf(),
        host_root: host.path().to_path_buf(),
        listen: "127.0.0.1:0".parse().unwrap(),
        poll_interval: Duration::from_millis(100),
        ..Config::new(NODE)
    };
    gpuwarden_node_agent::run(
        config.clone(),
        client.clone(),
        tokio::time::sleep(Duration::from_secs(2)),
    )
    .await
    .unwrap();

    let status_writes = |calls: &[Call]| {
        calls
            .iter()
            .filter(|c| {
                c.method == Method::PATCH && c.path.ends_with("/gpunodes/gpu-node-1/status")
            })
            .count()
    };
    let calls = calls_of(&all_calls);
    // Pods: only this node's, by field selector.
    let pod_calls: Vec<&Call> = calls.iter().filter(|c| c.path == "/api/v1/pods").collect();
    assert!(!pod_calls.is_empty());
    assert!(
        pod_calls
            .iter()
            .all(|c| c.query.contains("fieldSelector=spec.nodeName%3Dgpu-node-1")),
        "{pod_calls:#?}"
    );
    assert!(
        !calls
            .iter()
            .any(|c| c.path.starts_with("/api/v1/namespaces/") && c.path.ends_with("/pods"))
    );

    // Liveness Lease.
    let lease = calls
        .iter()
        .find(|c| {
            c.method == Method::PATCH
                && c.path
                    == "/apis/coordination.k8s.io/v1/namespaces/gpuwarden-system/leases/gpuwarden-agent-gpu-node-1"
        })
        .expect("a Lease apply");
    assert_eq!(lease.body["spec"]["holderIdentity"], NODE);
    assert_eq!(lease.body["spec"]["leaseDurationSeconds"], 40);

    // Status: written once in 2 s of sweeps every 100 ms (nothing changed after the first).
    let writes: Vec<&Call> = calls
        .iter()
        .filter(|c| c.method == Method::PATCH && c.path.ends_with("/gpunodes/gpu-node-1/status"))
        .collect();
    assert_eq!(writes.len(), 1, "{writes:#?}");
    let status = &writes[0].body["status"];
    assert_eq!(status["gpus"].as_array().unwrap().len(), 2);
    // The governing policy ignores no XID: GPU 0 is unhealthy after XID 13.
    assert_eq!(status["gpus"][0]["health"]["state"], "Unhealthy");
    assert_eq!(status["gpus"][0]["health"]["reasons"][0], "Xid13");
    assert!(status.get("conditions").is_none() && status.get("summary").is_none());
    // The exporter is judged by the policy its namespace's labels choose, which exempts
    // nothing; the default policy's exemption of gpu-operator does not count.
    let privileged = status["privilegedPods"].as_array().expect("privilegedPods");
    assert_eq!(privileged.len(), 1, "{privileged:#?}");
    assert_eq!(privileged[0]["name"], "exporter");
    assert!(privileged[0].get("exempt").is_none(), "{privileged:#?}");

    // A restart with nothing changed: health and `since` carry over, no status write.
    let before = status_writes(&calls);
    gpuwarden_node_agent::run(
        config,
        client,
        tokio::time::sleep(Duration::from_millis(1500)),
    )
    .await
    .unwrap();
    let all = calls_of(&all_calls);
    assert_eq!(
        status_writes(&all),
        before,
        "a restart rewrote an unchanged status"
    );
    kubelet.stop().await;
}
