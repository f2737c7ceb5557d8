//! The reflector caches against an in-process mock API server: the sync flag rises only
//! after both the GpuPolicy and the Namespace lists arrived, and then reviews read policies
//! and namespace labels from memory.

use std::sync::Arc;
use std::time::Duration;

use gpuwarden_webhook::admission::PolicySource;
use gpuwarden_webhook::cache::{ReflectorCache, SyncFlag};
use gpuwarden_webhook::metrics::Metrics;
use gpuwarden_webhook::server::shutdown_channel;
use http::{Request, Response};
use kube::client::Body;
use serde_json::json;
use tower_test::mock::{Handle, SendResponse};

type ApiHandle = Handle<Request<Body>, Response<Body>>;

fn json_response(value: serde_json::Value) -> Response<Body> {
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(&value).unwrap()))
        .unwrap()
}

fn policy_list() -> serde_json::Value {
    let mut policy = serde_json::to_value(gpuwarden_crds::GpuPolicy::default_policy()).unwrap();
    policy["metadata"]["resourceVersion"] = json!("11");
    policy["metadata"]["generation"] = json!(3);
    json!({
        "apiVersion": "gpuwarden.io/v1alpha1",
        "kind": "GpuPolicyList",
        "metadata": {"resourceVersion": "11"},
        "items": [policy],
    })
}

fn namespace_list() -> serde_json::Value {
    json!({
        "apiVersion": "meta.k8s.io/v1",
        "kind": "PartialObjectMetadataList",
        "metadata": {"resourceVersion": "21"},
        "items": [{
            "apiVersion": "meta.k8s.io/v1",
            "kind": "PartialObjectMetadata",
            "metadata": {
                "name": "ml",
                "resourceVersion": "20",
                "labels": {"kubernetes.io/metadata.name": "ml", "team": "research"},
            },
        }],
    })
}

/// Answers list requests for `kind` ("gpupolicies" or "namespaces") when `answer` says so;
/// holds watch requests open (an API server with nothing new to say).
async fn serve_api(
    mut handle: ApiHandle,
    answer_policies: tokio::sync::watch::Receiver<bool>,
    seen: Arc<std::sync::Mutex<Vec<String>>>,
) {
    let mut held: Vec<SendResponse<Response<Body>>> = Vec::new();
    let mut pending_policy_list: Option<SendResponse<Response<Body>>> = None;
    let mut answer_policies = answer_policies;
    loop {
        tokio::select! {
            request = handle.next_request() => {
                let Some((request, send)) = request else { return };
                let uri = request.uri().to_string();
                seen.lock().unwrap().push(uri.clone());
                let watch = uri.contains("watch=true");
                if watch {
                    held.push(send);
                } else if uri.starts_with("/apis/gpuwarden.io/v1alpha1/gpupolicies") {
                    if *answer_policies.borrow() {
                        send.send_response(json_response(policy_list()));
                    } else {
                        pending_policy_list = Some(send);
                    }
                } else if uri.starts_with("/api/v1/namespaces") {
                    let accept = request
                        .headers()
                        .get("accept")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_owned();
                    assert!(accept.contains("as=PartialObjectMetadataList"), "namespaces must be watched as metadata only: {accept}");
                    send.send_response(json_response(namespace_list()));
                } else {
                    panic!("unexpected request {uri}");
                }
            }
            changed = answer_policies.changed(), if pending_policy_list.is_some() => {
                if changed.is_ok()
                    && *answer_policies.borrow()
                    && let Some(send) = pending_policy_list.take()
                {
                    send.send_response(json_response(policy_list()));
                }
            }
        }
    }
}

#[tokio::test]
async fn caches_sync_from_lists_and_answer_from_memory() {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let (release_policies, answer_policies) = tokio::sync::watch::channel(false);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    tokio::spawn(serve_api(handle, answer_policies, seen.clone()));

    let metrics = Arc::new(Metrics::new());
    let synced = SyncFlag::new();
    let (trigger, shutdown) = shutdown_channel();
    let cache = ReflectorCache::start(client, metrics.clone(), synced.clone(), shutdown);

    // Namespaces are listed, policies are not yet: not synced.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!synced.get(), "synced before the GpuPolicy list arrived");
    assert!(cache.policies().is_empty());
    let text = metrics.encode().unwrap();
    assert!(
        text.contains(r#"gpuwarden_webhook_cache_synced{cache="namespaces"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"gpuwarden_webhook_cache_synced{cache="gpupolicies"} 0"#),
        "{text}"
    );

    release_policies.send_replace(true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !synced.get() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(synced.get(), "not synced after both lists arrived");

    let policies = cache.policies();
    assert_eq!(policies.len(), 1);
    assert_eq!(policies[0].reference(), "default@3");
    assert_eq!(
        policies[0].spec,
        gpuwarden_crds::GpuPolicy::default_policy().spec
    );
    let labels = cache.namespace_labels("ml").unwrap();
    assert_eq!(labels["team"], "research");
    assert_eq!(cache.namespace_labels("unknown"), None);
    // What a review reads: the same policies and labels, lent.
    for (namespace, expected) in [("ml", Some(labels)), ("unknown", None)] {
        let mut lent = None;
        cache.lend(namespace, &mut |policies, labels| {
            lent = Some((policies.to_vec(), labels.cloned()));
        });
        let (lent_policies, lent_labels) = lent.expect("lend calls back");
        assert_eq!(lent_policies.len(), 1);
        assert_eq!(lent_policies[0].reference(), "default@3");
        assert_eq!(lent_labels, expected, "{namespace}");
    }

    // Reading the caches made no request: only lists and watches were ever sent.
    let requests = seen.lock().unwrap().clone();
    assert!(
        requests.iter().all(
            |uri| uri.starts_with("/apis/gpuwarden.io/v1alpha1/gpupolicies?")
                || uri.starts_with("/api/v1/namespaces?")
        ),
        "{requests:?}"
    );
    trigger.trigger();
}
