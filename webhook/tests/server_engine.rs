//! The real engine behind the HTTPS server: a privileged GPU pod comes back rewritten, an
//! exempt one unchanged, and malformed reviews sent over TLS get clear denials (never a
//! panic, a hang or a non-200 answer). Metrics record the outcomes.

mod server_support;

use std::sync::Arc;
use std::time::Duration;

use gpuwarden_crds::GpuPolicy;
use gpuwarden_webhook::cache::{StaticPolicySource, SyncFlag};
use gpuwarden_webhook::server::{EngineReviewer, Limits};
use serde_json::{Value, json};
use server_support::*;

const JSON: Option<&str> = Some("application/json");

async fn engine_server(dir: &std::path::Path) -> (TestServer, Conn) {
    let ca = TestCa::new("test CA");
    let paths = plain_pair(dir, &ca.leaf(1));
    let source = StaticPolicySource::new(vec![GpuPolicy::default_policy()]);
    let server = TestServer::start(
        Arc::new(EngineReviewer::new(Arc::new(source))),
        paths,
        Duration::from_secs(5),
        SyncFlag::raised(),
        Limits::default(),
    )
    .await;
    let conn = connect(server.https, client_config(&[ca.pem()]))
        .await
        .unwrap();
    (server, conn)
}

/// A CUDA pod: privileged with `NVIDIA_VISIBLE_DEVICES=all`, or as it should be, unprivileged
/// with a GPU limit.
fn pod_review(uid: &str, namespace: &str, privileged: bool) -> Value {
    let container = if privileged {
        json!({"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]})
    } else {
        json!({"resources": {"limits": {"nvidia.com/gpu": "1"}}})
    };
    let mut review = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "object": {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "train", "namespace": namespace},
                "spec": {"containers": [{
                    "name": "cuda",
                    "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                    "securityContext": {"privileged": privileged},
                }]},
            },
        },
    });
    let c = &mut review["request"]["object"]["spec"]["containers"][0];
    for (k, v) in container.as_object().into_iter().flatten() {
        c[k] = v.clone();
    }
    review
}

async fn ask(conn: &mut Conn, body: impl Into<bytes::Bytes>) -> Value {
    let (status, body) =
        tokio::time::timeout(Duration::from_secs(10), post(conn, "/mutate", JSON, body))
            .await
            .expect("no answer within 10 s")
            .unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).unwrap_or_else(|e| {
        panic!(
            "answer is not JSON ({e}): {}",
            String::from_utf8_lossy(&body)
        )
    })
}

/// Standard base64 (the encoding of `response.patch`).
fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let digits: Vec<u8> = text.bytes().filter(|&c| c != b'=').map(value).collect();
    let mut out = Vec::new();
    for chunk in digits.chunks(4) {
        let mut n = 0u32;
        for (i, d) in chunk.iter().enumerate() {
            n |= u32::from(*d) << (18 - 6 * i);
        }
        for i in 0..chunk.len().saturating_sub(1) {
            out.push((n >> (16 - 8 * i)) as u8);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_privileged_gpu_pod_comes_back_rewritten() {
    let dir = tempfile::tempdir().unwrap();
    let (server, mut conn) = engine_server(dir.path()).await;

    let answer = ask(&mut conn, pod_review("rw-1", "ml", true).to_string()).await;
    let response = &answer["response"];
    assert_eq!(answer["kind"], "AdmissionReview");
    assert_eq!(response["uid"], "rw-1");
    assert_eq!(response["allowed"], true, "{answer}");
    assert_eq!(response["patchType"], "JSONPatch");
    let patch: json_patch::Patch =
        serde_json::from_slice(&base64_decode(response["patch"].as_str().unwrap())).unwrap();
    let mut pod = pod_review("rw-1", "ml", true)["request"]["object"].take();
    json_patch::patch(&mut pod, &patch).expect("the patch applies to the pod");
    let container = &pod["spec"]["containers"][0];
    assert_eq!(container["securityContext"]["privileged"], false, "{pod}");
    assert_eq!(
        container["resources"]["limits"]["nvidia.com/gpu"], "1",
        "{pod}"
    );
    let env = container["env"].as_array().cloned().unwrap_or_default();
    assert!(
        !env.iter().any(|e| e["name"] == "NVIDIA_VISIBLE_DEVICES"),
        "NVIDIA_VISIBLE_DEVICES left in {pod}"
    );
    assert!(
        pod["metadata"]["annotations"]["gpuwarden.io/policy"].is_string(),
        "{pod}"
    );

    let (_, metrics) = http_get(server.health, "/metrics").await;
    assert!(
        metrics
            .contains(r#"gpuwarden_webhook_reviews_total{outcome="rewritten",policy="default"} 1"#),
        "{metrics}"
    );
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exempt_namespace_and_an_unprivileged_pod_pass_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let (server, mut conn) = engine_server(dir.path()).await;
    for (uid, namespace, privileged) in [("ex-1", "kube-system", true), ("ok-1", "ml", false)] {
        let answer = ask(
            &mut conn,
            pod_review(uid, namespace, privileged).to_string(),
        )
        .await;
        assert_eq!(answer["response"]["uid"], uid);
        assert_eq!(answer["response"]["allowed"], true, "{answer}");
        assert!(answer["response"]["patch"].is_null(), "{answer}");
    }
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_reviews_get_clear_denials_over_https() {
    let dir = tempfile::tempdir().unwrap();
    let (server, mut conn) = engine_server(dir.path()).await;

    let mut no_object = pod_review("no-object", "ml", true);
    no_object["request"]
        .as_object_mut()
        .unwrap()
        .remove("object");
    let mut no_uid = pod_review("", "ml", true);
    no_uid["request"].as_object_mut().unwrap().remove("uid");
    let mut not_a_pod = pod_review("deploy-1", "ml", true);
    not_a_pod["request"]["kind"] = json!({"group": "apps", "version": "v1", "kind": "Deployment"});
    not_a_pod["request"]["resource"] =
        json!({"group": "apps", "version": "v1", "resource": "deployments"});
    not_a_pod["request"]["object"] = json!({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"}, "spec": {}
    });

    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("not JSON", b"this is not json {".to_vec(), ""),
        ("empty body", Vec::new(), ""),
        ("JSON array", b"[1, 2, 3]".to_vec(), ""),
        (
            "JSON that is not a review",
            br#"{"hello": "world"}"#.to_vec(),
            "",
        ),
        (
            "review without request",
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#.to_vec(),
            "",
        ),
        ("review without uid", no_uid.to_string().into_bytes(), ""),
        (
            "review without object",
            no_object.to_string().into_bytes(),
            "no-object",
        ),
        (
            "review of a Deployment",
            not_a_pod.to_string().into_bytes(),
            "deploy-1",
        ),
    ];
    for (what, body, uid) in cases {
        let answer = ask(&mut conn, body).await;
        let response = &answer["response"];
        assert_eq!(answer["kind"], "AdmissionReview", "{what}: {answer}");
        assert_eq!(response["uid"], uid, "{what}: {answer}");
        assert_eq!(response["allowed"], false, "{what}: {answer}");
        let message = response["status"]["message"].as_str().unwrap_or("");
        assert!(!message.is_empty(), "{what}: no reason given: {answer}");
    }

    let (_, metrics) = http_get(server.health, "/metrics").await;
    assert!(
        !metrics.contains(r#"reason="internal""#),
        "the engine panicked on some input: {metrics}"
    );
    assert!(
        metrics.contains(r#"gpuwarden_webhook_reviews_total{outcome="invalid",policy="none"} 8"#),
        "{metrics}"
    );
    server.shutdown();
}
