//! The reflector caches against an in-process mock API server: the sync flag rises only
//! after the GpuPolicy, Namespace and (where DRA is served) ResourceClaim and
//! ResourceClaimTemplate lists arrived, and then reviews read policies, namespace labels and
//! claims from memory.

use std::sync::Arc;
use std::time::Duration;

use gpuwarden_crds::claims::ClaimDevices;
use gpuwarden_webhook::admission::PolicySource;
use gpuwarden_webhook::cache::{ReflectorCache, SyncFlag};
use gpuwarden_webhook::engine::{ClaimLookup, ClaimSource};
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

/// A failure `Status` answer.
fn failure(code: u16, reason: &str) -> Response<Body> {
    let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code});
    let mut response = json_response(status);
    *response.status_mut() = http::StatusCode::from_u16(code).unwrap();
    response
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

/// What the mock says of `resource.k8s.io/v1`.
#[derive(Clone, Copy, PartialEq)]
enum Dra {
    /// Served, with the lists of [`dra_list`].
    Served,
    /// Served, but the webhook may not list it (RBAC not updated).
    Forbidden,
    /// Not served.
    NotServed,
}

/// The DRA lists: a GPU claim and a template of `gpu.nvidia.com`, a NIC claim.
fn dra_list(kind: &str) -> serde_json::Value {
    let request = |class: &str| json!({"name": "r", "exactly": {"deviceClassName": class}});
    let items = if kind == "ResourceClaimList" {
        json!([
            {"metadata": {"name": "gpu", "namespace": "ml", "resourceVersion": "30"},
             "spec": {"devices": {"requests": [request("gpu.nvidia.com")]}},
             "status": {"allocation": {"devices": {"results": []}}}},
            {"metadata": {"name": "nic", "namespace": "ml", "resourceVersion": "31"},
             "spec": {"devices": {"requests": [request("nic.example.com")]}}}
        ])
    } else {
        json!([
            {"metadata": {"name": "gpuwarden-gpu.nvidia.com-1", "namespace": "ml", "resourceVersion": "32"},
             "spec": {"spec": {"devices": {"requests": [request("gpu.nvidia.com")]}}}}
        ])
    };
    json!({"apiVersion": "resource.k8s.io/v1", "kind": kind, "metadata": {"resourceVersion": "33"}, "items": items})
}

/// Answers list requests for `kind` ("gpupolicies" or "namespaces") when `answer` says so,
/// discovery of `resource.k8s.io/v1` as `dra` says, and its lists; holds watch requests open
/// (an API server with nothing new to say).
async fn serve_api(
    mut handle: ApiHandle,
    answer_policies: tokio::sync::watch::Receiver<bool>,
    seen: Arc<std::sync::Mutex<Vec<String>>>,
    dra: Dra,
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
                } else if uri == "/apis/resource.k8s.io/v1" {
                    send.send_response(if dra != Dra::NotServed {
                        let resources = ["resourceclaims", "resourceclaimtemplates", "deviceclasses"].map(|name| json!({
                            "name": name, "singularName": "", "namespaced": name != "deviceclasses",
                            "kind": "x", "verbs": ["list", "watch"]
                        }));
                        json_response(json!({
                            "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "resource.k8s.io/v1",
                            "resources": resources.to_vec()
                        }))
                    } else {
                        failure(404, "NotFound")
                    });
                } else if dra == Dra::Forbidden && uri.starts_with("/apis/resource.k8s.io/v1/") {
                    send.send_response(failure(403, "Forbidden"));
                } else if dra == Dra::Served && uri.starts_with("/apis/resource.k8s.io/v1/resourceclaims?") {
                    send.send_response(json_response(dra_list("ResourceClaimList")));
                } else if dra == Dra::Served && uri.starts_with("/apis/resource.k8s.io/v1/resourceclaimtemplates?") {
                    send.send_response(json_response(dra_list("ResourceClaimTemplateList")));
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

/// A cache started against the mock: what it serves of DRA as `dra` says; the GpuPolicy list
/// held back until `release_policies` says true, unless `policies_at_once`.
struct Started {
    cache: ReflectorCache,
    synced: SyncFlag,
    metrics: Arc<Metrics>,
    seen: Arc<std::sync::Mutex<Vec<String>>>,
    release_policies: tokio::sync::watch::Sender<bool>,
    trigger: gpuwarden_webhook::shutdown::ShutdownTrigger,
}

fn start(policies_at_once: bool, dra: Dra) -> Started {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let (release_policies, answer_policies) = tokio::sync::watch::channel(policies_at_once);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    tokio::spawn(serve_api(handle, answer_policies, seen.clone(), dra));
    let metrics = Arc::new(Metrics::new());
    let synced = SyncFlag::new();
    let (trigger, shutdown) = shutdown_channel();
    let cache = ReflectorCache::start(client, metrics.clone(), synced.clone(), shutdown);
    Started {
        cache,
        synced,
        metrics,
        seen,
        release_policies,
        trigger,
    }
}

#[tokio::test]
async fn caches_sync_from_lists_and_answer_from_memory() {
    let Started {
        cache,
        synced,
        metrics,
        seen,
        release_policies,
        trigger,
    } = start(false, Dra::Served);

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

    // Claims, by namespace and name: a GPU claim, a NIC claim, gpuwarden's template.
    let claims = cache.claims();
    let gpu = ClaimLookup::Found(ClaimDevices {
        classes: vec!["gpu.nvidia.com".to_owned()],
        config_kinds: Vec::new(),
    });
    assert_eq!(claims.lookup(ClaimSource::Claim, "ml", "gpu"), gpu);
    assert_eq!(
        claims.lookup(ClaimSource::Claim, "ml", "nic"),
        ClaimLookup::Found(ClaimDevices {
            classes: vec!["nic.example.com".to_owned()],
            config_kinds: Vec::new()
        })
    );
    let template = "gpuwarden-gpu.nvidia.com-1";
    assert_eq!(claims.lookup(ClaimSource::Template, "ml", template), gpu);
    assert_eq!(
        claims.lookup(ClaimSource::Template, "ml", "gpu"),
        ClaimLookup::Missing
    );
    assert_eq!(
        claims.lookup(ClaimSource::Claim, "other", "gpu"),
        ClaimLookup::Missing
    );
    assert!(
        metrics
            .encode()
            .unwrap()
            .contains(r#"gpuwarden_webhook_cache_synced{cache="resourceclaims"} 1"#)
    );

    // Reading the caches made no request: only discovery, lists and watches were ever sent.
    let requests = seen.lock().unwrap().clone();
    assert!(
        requests.iter().all(
            |uri| uri.starts_with("/apis/gpuwarden.io/v1alpha1/gpupolicies?")
                || uri.starts_with("/api/v1/namespaces?")
                || uri == "/apis/resource.k8s.io/v1"
                || uri.starts_with("/apis/resource.k8s.io/v1/resourceclaims?")
                || uri.starts_with("/apis/resource.k8s.io/v1/resourceclaimtemplates?")
        ),
        "{requests:?}"
    );
    trigger.trigger();
}

#[tokio::test]
async fn without_dra_the_caches_sync_and_claims_are_unknown() {
    let Started {
        cache,
        synced,
        seen,
        release_policies: _release,
        trigger,
        ..
    } = start(true, Dra::NotServed);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !synced.get() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(synced.get(), "a cluster without DRA still syncs");
    let lookup = cache
        .claims()
        .lookup(ClaimSource::Template, "ml", "gpuwarden-gpu.nvidia.com-1");
    assert!(
        matches!(&lookup, ClaimLookup::Unknown(why) if why.contains("does not serve resource.k8s.io/v1")),
        "{lookup:?}"
    );
    let requests = seen.lock().unwrap().clone();
    assert!(
        !requests.iter().any(|uri| uri.contains("resourceclaims")),
        "{requests:?}"
    );
    trigger.trigger();
}

#[tokio::test(start_paused = true)]
async fn dra_caches_that_never_sync_hold_readiness_only_for_a_while() {
    let Started {
        cache,
        synced,
        metrics,
        release_policies: _release,
        trigger,
        ..
    } = start(true, Dra::Forbidden);
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert!(!synced.get(), "ready before the grace ran out");
    tokio::time::sleep(Duration::from_secs(15)).await;
    assert!(
        synced.get(),
        "the forbidden DRA caches held readiness past the grace"
    );
    let lookup = cache.claims().lookup(ClaimSource::Claim, "ml", "gpu");
    assert!(
        matches!(&lookup, ClaimLookup::Unknown(why) if why.contains("not synced")),
        "{lookup:?}"
    );
    assert!(
        metrics
            .encode()
            .unwrap()
            .contains(r#"gpuwarden_webhook_cache_synced{cache="resourceclaims"} 0"#)
    );
    trigger.trigger();
}
