//! Scenario tests: the reconcilers against a mock API server (tower-test), with caches filled
//! by hand and an injected clock. Each test asserts the exact requests the operator sends.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuwarden_crds::condition_types::{
    AGENT_READY, HEALTHY, ISOLATED, READY, RUNTIME_ISOLATION, RUNTIME_PATCHED,
};
use gpuwarden_crds::{
    GpuHealth, GpuNode, GpuNodeSpec, GpuNodeStatus, GpuPolicy, GpuStatus, HealthState,
    RuntimeStatus,
};
use gpuwarden_operator::certs::{self, CertParams};
use gpuwarden_operator::metrics::Metrics;
use gpuwarden_operator::node_controller::{NodeContext, desired_gpunode, reconcile_node};
use gpuwarden_operator::policy_controller::{PolicyContext, reconcile_policy};
use gpuwarden_operator::webhook_certs::{CertContext, reconcile_certificates};
use gpuwarden_operator::{Clock, Leadership};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, NodeStatus};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, MicroTime};
use kube::runtime::controller::Action;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, Store, store::Writer};
use kube::runtime::watcher;
use kube::{Client, Resource};
use serde_json::{Value, json};

/// One request the operator sent.
#[derive(Clone, Debug)]
struct Seen {
    method: String,
    path: String,
    query: String,
    content_type: String,
    body: Value,
}

impl Seen {
    fn is_write(&self) -> bool {
        self.method != "GET"
    }
}

type Responder = Arc<dyn Fn(&Seen) -> (StatusCode, Value) + Send + Sync>;

/// A mock API server: records every request and answers with `respond`.
struct FakeApi {
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl FakeApi {
    fn start(respond: Responder) -> (Client, Self) {
        let (svc, mut handle) =
            tower_test::mock::pair::<Request<kube::client::Body>, Response<kube::client::Body>>();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            while let Some((req, send)) = handle.next_request().await {
                let (parts, body) = req.into_parts();
                let bytes = body.collect().await.unwrap().to_bytes();
                let seen = Seen {
                    method: parts.method.to_string(),
                    path: parts.uri.path().to_owned(),
                    query: parts.uri.query().unwrap_or_default().to_owned(),
                    content_type: parts
                        .headers
                        .get(http::header::CONTENT_TYPE)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned(),
                    body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
                };
                let (code, answer) = respond(&seen);
                log.lock().unwrap().push(seen);
                send.send_response(
                    Response::builder()
                        .status(code)
                        .header("content-type", "application/json")
                        .body(kube::client::Body::from(
                            serde_json::to_vec(&answer).unwrap(),
                        ))
                        .unwrap(),
                );
            }
        });
        (Client::new(svc, "default"), Self { seen })
    }

    fn requests(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn writes(&self) -> Vec<Seen> {
        self.requests().into_iter().filter(Seen::is_write).collect()
    }
}

fn not_found() -> (StatusCode, Value) {
    (
        StatusCode::NOT_FOUND,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"}),
    )
}

/// Answers writes with the object written (plus a uid), reads with 404.
fn echo() -> Responder {
    Arc::new(|s: &Seen| match s.method.as_str() {
        "GET" => not_found(),
        "DELETE" => (
            StatusCode::OK,
            json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200}),
        ),
        _ if s.body.is_array() => {
            // A JSON patch: answer with the patched object's name, enough for any kind.
            let name = s.path.rsplit('/').next().unwrap_or_default();
            (StatusCode::OK, json!({"metadata": {"name": name}}))
        }
        _ => {
            let mut obj = s.body.clone();
            if obj.get("metadata").is_some() {
                obj["metadata"]["uid"] = json!("gpunode-uid");
                obj["metadata"]["resourceVersion"] = json!("2");
            }
            if obj.get("spec").is_none() && s.path.contains("gpunodes") {
                obj["spec"] = json!({"nodeName": obj["metadata"]["name"]});
            }
            if obj.get("spec").is_none() && s.path.contains("gpupolicies") {
                obj["spec"] = json!({});
            }
            (StatusCode::OK, obj)
        }
    })
}

fn ts(secs: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + secs).unwrap()
}

/// A clock tests move by hand.
fn clock_at(secs: i64) -> (Clock, Arc<AtomicI64>) {
    let now = Arc::new(AtomicI64::new(secs));
    let n = now.clone();
    (Arc::new(move || ts(n.load(Ordering::SeqCst))), now)
}

fn gpu_node(name: &str, gpus: &str) -> Node {
    let mut n = Node::default();
    n.metadata.name = Some(name.into());
    n.metadata.uid = Some(format!("{name}-uid"));
    n.status = Some(NodeStatus {
        allocatable: Some(BTreeMap::from([
            ("cpu".to_owned(), Quantity("64".into())),
            ("nvidia.com/gpu".to_owned(), Quantity(gpus.into())),
        ])),
        ..Default::default()
    });
    n
}

fn agent_lease(node: &str, renewed: i64, secs: i32) -> Lease {
    let mut l = Lease {
        spec: Some(LeaseSpec {
            holder_identity: Some(format!("agent-{node}")),
            renew_time: Some(MicroTime(ts(renewed))),
            lease_duration_seconds: Some(secs),
            ..Default::default()
        }),
        ..Default::default()
    };
    l.metadata.name = Some(gpuwarden_crds::agent_lease_name(node));
    l.metadata.namespace = Some(gpuwarden_crds::AGENT_LEASE_NAMESPACE.into());
    l
}

fn agent_status() -> GpuNodeStatus {
    GpuNodeStatus {
        gpus: Some(
            (0..8)
                .map(|i| GpuStatus {
                    index: i,
                    uuid: format!("GPU-{i}"),
                    model: "NVIDIA H100 80GB HBM3".into(),
                    memory_mi_b: 81559,
                    pci_bus_id: format!("00000000:{i:02}:00.0"),
                    health: GpuHealth {
                        state: HealthState::Healthy,
                        ..Default::default()
                    },
                    ..Default::default()
                })
                .collect(),
        ),
        bindings: Some(vec![]),
        runtime: Some(RuntimeStatus {
            accept_env_var_when_unprivileged: Some(false),
            toolkit: Some(gpuwarden_crds::ToolkitStatus {
                version: "1.18.2".into(),
                source: "package nvidia-container-toolkit in /var/lib/dpkg/status".into(),
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn gpunode_for(node: &Node, status: Option<GpuNodeStatus>) -> GpuNode {
    let mut gn = desired_gpunode(node);
    gn.metadata.uid = Some("gpunode-uid".into());
    gn.status = status;
    gn
}

/// A cache filled with `objects`; `synced: false` leaves it before its first full list.
fn cache<K>(objects: Vec<K>, synced: bool) -> (Store<K>, Writer<K>)
where
    K: kube::runtime::reflector::Lookup + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Default,
{
    let (store, mut writer) = reflector::store::<K>();
    writer.apply_watcher_event(&watcher::Event::Init);
    for o in objects {
        writer.apply_watcher_event(&watcher::Event::InitApply(o));
    }
    if synced {
        writer.apply_watcher_event(&watcher::Event::InitDone);
    }
    (store, writer)
}

struct World {
    ctx: NodeContext,
    api: FakeApi,
    now: Arc<AtomicI64>,
    gpunode_writer: Writer<GpuNode>,
    _writers: (Writer<Node>, Writer<Lease>),
}

fn world(
    nodes: Vec<Node>,
    gpunodes: Vec<GpuNode>,
    leases: Vec<Lease>,
    synced: bool,
    leader: Leadership,
    respond: Responder,
    events: bool,
) -> World {
    let (client, api) = FakeApi::start(respond);
    let (clock, now) = clock_at(0);
    let (nodes, nw) = cache(nodes, synced);
    let (gpunodes, gw) = cache(gpunodes, true);
    let (leases, lw) = cache(leases, true);
    let recorder = events.then(|| {
        Recorder::new(
            client.clone(),
            Reporter {
                controller: "gpuwarden-operator".into(),
                instance: Some("test".into()),
            },
        )
    });
    World {
        ctx: NodeContext {
            client,
            nodes,
            gpunodes,
            leases,
            lease_namespace: gpuwarden_crds::AGENT_LEASE_NAMESPACE.into(),
            clock,
            leader,
            metrics: Arc::new(Metrics::new()),
            recorder,
            taint_unhealthy_nodes: false,
        },
        api,
        now,
        gpunode_writer: gw,
        _writers: (nw, lw),
    }
}

fn condition<'a>(conditions: &'a [Value], type_: &str) -> &'a Value {
    conditions
        .iter()
        .find(|c| c["type"] == type_)
        .unwrap_or_else(|| panic!("no {type_} condition in {conditions:?}"))
}

#[tokio::test]
async fn gpu_node_gets_a_gpunode_owned_by_its_node() {
    let node = gpu_node("gpu-1", "8");
    let w = world(
        vec![node],
        vec![],
        vec![],
        true,
        Leadership::always(),
        echo(),
        false,
    );

    let action = reconcile_node("gpu-1", &w.ctx).await.unwrap();
    assert_eq!(action, Action::await_change(), "no Lease, nothing to time");

    let writes = w.api.writes();
    assert_eq!(writes.len(), 2, "{writes:#?}");
    let create = &writes[0];
    assert_eq!(create.method, "PATCH");
    assert_eq!(create.path, "/apis/gpuwarden.io/v1alpha1/gpunodes/gpu-1");
    assert!(
        create.query.contains("fieldManager=gpuwarden-operator"),
        "{}",
        create.query
    );
    assert!(create.query.contains("force=true"));
    assert_eq!(create.content_type, "application/apply-patch+yaml");
    assert_eq!(create.body["spec"]["nodeName"], "gpu-1");
    let owner = &create.body["metadata"]["ownerReferences"][0];
    assert_eq!(owner["kind"], "Node");
    assert_eq!(owner["apiVersion"], "v1");
    assert_eq!(owner["name"], "gpu-1");
    assert_eq!(owner["uid"], "gpu-1-uid");
    assert_eq!(owner["controller"], true);
    assert!(
        create.body.get("status").is_none(),
        "spec apply must not touch status"
    );

    let status = &writes[1];
    assert_eq!(
        status.path,
        "/apis/gpuwarden.io/v1alpha1/gpunodes/gpu-1/status"
    );
    assert!(status.query.contains("fieldManager=gpuwarden-operator"));
    // Only the operator's fields: conditions and the summary, whose GPU count comes from
    // the Node until the agent reports.
    let fields: Vec<&String> = status.body["status"].as_object().unwrap().keys().collect();
    assert_eq!(fields, ["conditions", "summary"]);
    assert_eq!(
        status.body["status"]["summary"],
        json!({"gpus": 8, "gpusFrom": "Node"})
    );
    let conditions = status.body["status"]["conditions"].as_array().unwrap();
    for t in [AGENT_READY, HEALTHY, ISOLATED, RUNTIME_ISOLATION] {
        assert_eq!(condition(conditions, t)["status"], "Unknown", "{t}");
    }
    assert_eq!(condition(conditions, AGENT_READY)["reason"], "NoLease");
}

#[tokio::test]
async fn node_without_gpus_gets_no_gpunode() {
    let mut cpu = gpu_node("cpu-1", "0");
    cpu.status
        .as_mut()
        .unwrap()
        .allocatable
        .as_mut()
        .unwrap()
        .remove("nvidia.com/gpu");
    let w = world(
        vec![cpu],
        vec![],
        vec![],
        true,
        Leadership::always(),
        echo(),
        false,
    );
    reconcile_node("cpu-1", &w.ctx).await.unwrap();
    assert!(w.api.requests().is_empty(), "{:#?}", w.api.requests());
}

#[tokio::test]
async fn nothing_is_deleted_while_the_node_cache_is_unsynced() {
    let node = gpu_node("gpu-1", "8");
    let gn = gpunode_for(&node, Some(agent_status()));
    // The Node cache has not finished its first list: it is empty, but that means nothing.
    let w = world(
        vec![],
        vec![gn],
        vec![],
        false,
        Leadership::always(),
        echo(),
        false,
    );
    let action = reconcile_node("gpu-1", &w.ctx).await.unwrap();
    assert!(w.api.requests().is_empty(), "{:#?}", w.api.requests());
    assert_eq!(action, Action::requeue(Duration::from_secs(2)));
}

#[tokio::test]
async fn gpunode_is_deleted_once_the_synced_cache_says_the_node_is_gone() {
    let node = gpu_node("gpu-1", "8");
    let gn = gpunode_for(&node, Some(agent_status()));
    let w = world(
        vec![],
        vec![gn],
        vec![],
        true,
        Leadership::always(),
        echo(),
        false,
    );
    reconcile_node("gpu-1", &w.ctx).await.unwrap();
    let writes = w.api.writes();
    assert_eq!(writes.len(), 1, "{writes:#?}");
    assert_eq!(writes[0].method, "DELETE");
    assert_eq!(writes[0].path, "/apis/gpuwarden.io/v1alpha1/gpunodes/gpu-1");
    // Guarded by the uid, so a GpuNode recreated meanwhile survives.
    assert_eq!(writes[0].body["preconditions"]["uid"], "gpunode-uid");
}

#[tokio::test]
async fn gpunode_of_a_node_that_lost_its_gpus_but_has_a_live_agent_stays() {
    let mut node = gpu_node("gpu-1", "0");
    node.metadata.labels = None;
    let gn = gpunode_for(&node, None);
    let w = world(
        vec![node],
        vec![gn],
        vec![agent_lease("gpu-1", -5, 40)],
        true,
        Leadership::always(),
        echo(),
        false,
    );
    reconcile_node("gpu-1", &w.ctx).await.unwrap();
    assert!(w.api.writes().iter().all(|s| s.method != "DELETE"));
}

#[tokio::test]
async fn agent_ready_flips_to_false_when_the_lease_expires_with_an_event() {
    let node = gpu_node("gpu-1", "8");
    let gn = gpunode_for(&node, Some(agent_status()));
    let mut w = world(
        vec![node],
        vec![gn],
        vec![agent_lease("gpu-1", 0, 40)],
        true,
        Leadership::always(),
        echo(),
        true,
    );

    // t=10: the Lease is fresh. First reconcile writes the conditions, all True.
    w.now.store(10, Ordering::SeqCst);
    let action = reconcile_node("gpu-1", &w.ctx).await.unwrap();
    // Timed requeue at the moment the Lease would lapse (40 s after renewal, +1 s slack).
    assert_eq!(action, Action::requeue(Duration::from_secs(31)));
    let writes = w.api.writes();
    assert_eq!(
        writes.len(),
        1,
        "new True conditions publish no events: {writes:#?}"
    );
    let first = writes[0].body["status"]["conditions"]
        .as_array()
        .unwrap()
        .clone();
    for t in [
        AGENT_READY,
        HEALTHY,
        ISOLATED,
        RUNTIME_ISOLATION,
        RUNTIME_PATCHED,
    ] {
        assert_eq!(condition(&first, t)["status"], "True", "{t}");
    }
    assert_eq!(
        writes[0].body["status"]["summary"],
        json!({"gpus": 8, "gpusFrom": "Agent", "healthy": 8, "allocated": 0, "privilegedPods": 0,
            "toolkit": "1.18.2"})
    );
    apply_status(&mut w, &writes[0].body);

    // t=41: nobody renewed the Lease. AgentReady goes False; the GPU data stays as reported.
    w.now.store(41, Ordering::SeqCst);
    let action = reconcile_node("gpu-1", &w.ctx).await.unwrap();
    assert_eq!(action, Action::await_change());
    let writes = w.api.writes();
    assert_eq!(writes.len(), 3, "{writes:#?}");
    let after = writes[1].body["status"]["conditions"].as_array().unwrap();
    let agent = condition(after, AGENT_READY);
    assert_eq!(agent["status"], "False");
    assert_eq!(agent["reason"], "LeaseExpired");
    assert_ne!(
        agent["lastTransitionTime"],
        condition(&first, AGENT_READY)["lastTransitionTime"]
    );
    // Conditions that did not change keep their transition time.
    assert_eq!(
        condition(after, HEALTHY)["lastTransitionTime"],
        condition(&first, HEALTHY)["lastTransitionTime"]
    );
    assert_eq!(
        writes[1].body["status"]["summary"]["gpus"], 8,
        "never zero GPUs"
    );
    let event = &writes[2];
    assert_eq!(event.method, "POST");
    assert!(event.path.ends_with("/events"), "{}", event.path);
    assert_eq!(event.body["reason"], "LeaseExpired");
    assert_eq!(event.body["type"], "Warning");
    assert_eq!(event.body["regarding"]["kind"], "GpuNode");
    assert_eq!(event.body["regarding"]["name"], "gpu-1");
}

/// Puts what the operator wrote into the GpuNode cache, as the watch would.
fn apply_status(w: &mut World, body: &Value) {
    let mut gn = (*w
        .ctx
        .gpunodes
        .get(&kube::runtime::reflector::ObjectRef::new("gpu-1"))
        .unwrap())
    .clone();
    let status = gn.status.get_or_insert_with(Default::default);
    status.conditions =
        serde_json::from_value::<Option<Vec<Condition>>>(body["status"]["conditions"].clone())
            .unwrap();
    status.summary = serde_json::from_value(body["status"]["summary"].clone()).unwrap();
    w.gpunode_writer
        .apply_watcher_event(&watcher::Event::Apply(gn));
}

#[tokio::test]
async fn nothing_is_written_when_nothing_changed() {
    let node = gpu_node("gpu-1", "8");
    let gn = gpunode_for(&node, Some(agent_status()));
    let mut w = world(
        vec![node],
        vec![gn],
        vec![agent_lease("gpu-1", 0, 40)],
        true,
        Leadership::always(),
        echo(),
        true,
    );
    w.now.store(5, Ordering::SeqCst);
    reconcile_node("gpu-1", &w.ctx).await.unwrap();
    assert_eq!(w.api.writes().len(), 1);
    let body = w.api.writes()[0].body.clone();
    apply_status(&mut w, &body);

    // The Lease is renewed (still live), time passes, the operator's own write came back
    // through the watch: ten more reconciles, zero writes.
    for i in 0..10 {
        w.now.store(6 + i, Ordering::SeqCst);
        reconcile_node("gpu-1", &w.ctx).await.unwrap();
    }
    assert_eq!(w.api.requests().len(), 1, "{:#?}", w.api.requests());
    assert_eq!(w.ctx.metrics.writes("gpunode", "status"), 1);
    assert_eq!(w.ctx.metrics.writes("gpunode", "apply"), 0);
}

#[tokio::test]
async fn only_the_leader_writes() {
    let node = gpu_node("gpu-1", "8");
    let (tx, leadership) = Leadership::channel(false);
    let w = world(
        vec![node],
        vec![],
        vec![],
        true,
        leadership.clone(),
        echo(),
        false,
    );
    for _ in 0..3 {
        reconcile_node("gpu-1", &w.ctx).await.unwrap();
    }
    assert!(
        w.api.requests().is_empty(),
        "a standby wrote: {:#?}",
        w.api.requests()
    );

    // Policies and certificates hold back too.
    let (pctx, papi) = policy_world(vec![bad_policy()], leadership.clone());
    reconcile_policy("bad", &pctx).await.unwrap();
    assert!(papi.requests().is_empty());
    let (client, capi) = FakeApi::start(echo());
    let (clock, _) = clock_at(0);
    let cctx = CertContext {
        client,
        namespace: "gpuwarden-system".into(),
        params: cert_params(),
        clock,
        leader: leadership.clone(),
        metrics: Arc::new(Metrics::new()),
    };
    reconcile_certificates(&cctx).await.unwrap();
    assert!(capi.writes().is_empty(), "{:#?}", capi.writes());

    // Leadership arrives: the same reconcile now writes.
    tx.send(true).unwrap();
    reconcile_node("gpu-1", &w.ctx).await.unwrap();
    assert_eq!(w.api.writes().len(), 2);
    reconcile_policy("bad", &pctx).await.unwrap();
    assert_eq!(papi.writes().len(), 1);
}

fn bad_policy() -> GpuPolicy {
    let mut p = GpuPolicy::default_policy();
    p.metadata.name = Some("bad".into());
    p.metadata.generation = Some(3);
    p.spec.capabilities.allowed.push("NET_PWN".into());
    p
}

fn policy_world(policies: Vec<GpuPolicy>, leader: Leadership) -> (PolicyContext, FakeApi) {
    let (client, api) = FakeApi::start(echo());
    let (clock, _) = clock_at(0);
    let (store, writer) = cache(policies, true);
    // The writer must outlive the test; a dropped writer leaves the store as it is.
    std::mem::forget(writer);
    (
        PolicyContext {
            client,
            policies: store,
            clock,
            leader,
            metrics: Arc::new(Metrics::new()),
            admission_policies: None,
        },
        api,
    )
}

#[tokio::test]
async fn invalid_gpupolicy_is_reported_with_a_reason_and_then_left_alone() {
    let (ctx, api) = policy_world(vec![bad_policy()], Leadership::always());
    let action = reconcile_policy("bad", &ctx).await.unwrap();
    assert_eq!(
        action,
        Action::await_change(),
        "invalid policies wait for an edit"
    );
    let writes = api.writes();
    assert_eq!(writes.len(), 1);
    assert_eq!(
        writes[0].path,
        "/apis/gpuwarden.io/v1alpha1/gpupolicies/bad/status"
    );
    assert!(writes[0].query.contains("fieldManager=gpuwarden-operator"));
    let status = &writes[0].body["status"];
    assert_eq!(status["observedGeneration"], 3);
    let ready = condition(status["conditions"].as_array().unwrap(), READY);
    assert_eq!(ready["status"], "False");
    assert_eq!(ready["reason"], "UnknownCapability");
    assert!(ready["message"].as_str().unwrap().contains("NET_PWN"));
    assert_eq!(ready["observedGeneration"], 3);

    // With that status in the cache, the next reconcile writes nothing.
    let mut p = bad_policy();
    p.status = Some(serde_json::from_value(status.clone()).unwrap());
    let (ctx, api) = policy_world(vec![p], Leadership::always());
    reconcile_policy("bad", &ctx).await.unwrap();
    assert!(api.requests().is_empty());
}

#[tokio::test]
async fn equal_priority_overlap_is_reported() {
    let mut a = GpuPolicy::default_policy();
    a.metadata.name = Some("a".into());
    a.metadata.generation = Some(1);
    let mut b = a.clone();
    b.metadata.name = Some("b".into());
    let (ctx, api) = policy_world(vec![a, b], Leadership::always());
    reconcile_policy("a", &ctx).await.unwrap();
    let ready = condition(
        api.writes()[0].body["status"]["conditions"]
            .as_array()
            .unwrap(),
        READY,
    )
    .clone();
    assert_eq!(ready["reason"], "OverlappingPriority");
    assert!(ready["message"].as_str().unwrap().contains("shared with b"));
}

fn cert_params() -> CertParams {
    CertParams {
        namespace: "gpuwarden-system".into(),
        service: "gpuwarden-webhook".into(),
        validity: Duration::from_secs(90 * 86400),
    }
}

fn secret_json(data: &BTreeMap<String, Vec<u8>>) -> Value {
    let data: BTreeMap<&str, k8s_openapi::ByteString> = data
        .iter()
        .map(|(k, v)| (k.as_str(), k8s_openapi::ByteString(v.clone())))
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "gpuwarden-webhook-tls", "namespace": "gpuwarden-system"},
        "type": "kubernetes.io/tls",
        "data": data,
    })
}

fn mwc_json(bundle: &[u8]) -> Value {
    json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "gpuwarden"},
        "webhooks": [{
            "name": "pods.gpuwarden.io",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "clientConfig": {
                "service": {"name": "gpuwarden-webhook", "namespace": "gpuwarden-system"},
                "caBundle": k8s_openapi::ByteString(bundle.to_vec()),
            },
        }],
    })
}

/// Decodes the base64 `value` of the `add caBundle` op.
fn bundle_in_patch(patch: &Value) -> Vec<u8> {
    let op = patch
        .as_array()
        .unwrap()
        .iter()
        .find(|op| op["path"] == "/webhooks/0/clientConfig/caBundle")
        .expect("caBundle op");
    serde_json::from_value::<k8s_openapi::ByteString>(op["value"].clone())
        .unwrap()
        .0
}

#[tokio::test]
async fn certificate_renewed_before_expiry_with_both_cas_in_the_bundle_during_rollover() {
    let params = cert_params();
    let day = 86400;
    // A Secret the operator wrote 241 days ago: the 360-day CA has under a third left.
    let old = certs::plan(&BTreeMap::new(), ts(-241 * day), &params).unwrap();
    let old_ca = old.ca_bundle.clone();
    let secret = secret_json(&old.data);
    let mwc = mwc_json(&old_ca);
    let respond: Responder = Arc::new(move |s: &Seen| match (s.method.as_str(), s.path.as_str()) {
        ("GET", p) if p.ends_with("/secrets/gpuwarden-webhook-tls") => {
            (StatusCode::OK, secret.clone())
        }
        ("GET", p) if p.ends_with("/mutatingwebhookconfigurations/gpuwarden") => {
            (StatusCode::OK, mwc.clone())
        }
        ("PATCH", p) if p.ends_with("/mutatingwebhookconfigurations/gpuwarden") => {
            (StatusCode::OK, mwc.clone())
        }
        ("PATCH", _) => (StatusCode::OK, s.body.clone()),
        _ => not_found(),
    });
    let (client, api) = FakeApi::start(respond);
    let (clock, _) = clock_at(0);
    let ctx = CertContext {
        client,
        namespace: "gpuwarden-system".into(),
        params: params.clone(),
        clock,
        leader: Leadership::always(),
        metrics: Arc::new(Metrics::new()),
    };
    let next = reconcile_certificates(&ctx).await.unwrap();
    assert!(next > ts(0));

    let writes = api.writes();
    assert_eq!(writes.len(), 2, "{writes:#?}");
    // The caBundle is patched first, so the API server trusts the new CA before the webhook
    // can serve a certificate from it.
    let patch = &writes[0];
    assert_eq!(
        patch.path,
        "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/gpuwarden"
    );
    assert_eq!(patch.content_type, "application/json-patch+json");
    assert!(
        patch.query.contains("fieldManager=gpuwarden-operator"),
        "the caBundle is written under the operator's name: {}",
        patch.query
    );
    assert_eq!(patch.body[0]["op"], "test");
    assert_eq!(patch.body[0]["value"], "pods.gpuwarden.io");
    let bundle = bundle_in_patch(&patch.body);
    assert_eq!(certs::bundle_len(&bundle), 2, "old and new CA together");
    let bundle_text = String::from_utf8(bundle.clone()).unwrap();
    assert!(bundle_text.contains(std::str::from_utf8(&old_ca).unwrap().trim()));

    let secret = &writes[1];
    assert_eq!(
        secret.path,
        "/api/v1/namespaces/gpuwarden-system/secrets/gpuwarden-webhook-tls"
    );
    assert_eq!(secret.content_type, "application/apply-patch+yaml");
    assert_eq!(secret.body["type"], "kubernetes.io/tls");
    let data: BTreeMap<String, k8s_openapi::ByteString> =
        serde_json::from_value(secret.body["data"].clone()).unwrap();
    for key in ["tls.crt", "tls.key", "ca.crt"] {
        assert!(data.contains_key(key), "{key}");
    }
    assert_eq!(data["ca.crt"].0, bundle);
    assert_ne!(
        data["tls.crt"].0, old.data["tls.crt"],
        "serving certificate renewed"
    );

    // The next pass, with the new Secret and bundle in place, writes nothing.
    let new_data: BTreeMap<String, Vec<u8>> = data.into_iter().map(|(k, v)| (k, v.0)).collect();
    let secret = secret_json(&new_data);
    let mwc = mwc_json(&bundle);
    let respond: Responder = Arc::new(move |s: &Seen| match (s.method.as_str(), s.path.as_str()) {
        ("GET", p) if p.ends_with("/secrets/gpuwarden-webhook-tls") => {
            (StatusCode::OK, secret.clone())
        }
        ("GET", p) if p.ends_with("/mutatingwebhookconfigurations/gpuwarden") => {
            (StatusCode::OK, mwc.clone())
        }
        _ => not_found(),
    });
    let (client, api) = FakeApi::start(respond);
    let ctx = CertContext { client, ..ctx };
    reconcile_certificates(&ctx).await.unwrap();
    assert!(api.writes().is_empty(), "{:#?}", api.writes());
}

#[tokio::test]
async fn serving_certificate_alone_is_renewed_when_a_third_of_its_life_is_left() {
    let params = cert_params();
    let old = certs::plan(&BTreeMap::new(), ts(-61 * 86400), &params).unwrap();
    let secret = secret_json(&old.data);
    let mwc = mwc_json(&old.ca_bundle);
    let respond: Responder = Arc::new(move |s: &Seen| match (s.method.as_str(), s.path.as_str()) {
        ("GET", p) if p.ends_with("/secrets/gpuwarden-webhook-tls") => {
            (StatusCode::OK, secret.clone())
        }
        ("GET", p) if p.ends_with("/mutatingwebhookconfigurations/gpuwarden") => {
            (StatusCode::OK, mwc.clone())
        }
        ("PATCH", _) => (StatusCode::OK, s.body.clone()),
        _ => not_found(),
    });
    let (client, api) = FakeApi::start(respond);
    let (clock, _) = clock_at(0);
    let ctx = CertContext {
        client,
        namespace: "gpuwarden-system".into(),
        params,
        clock,
        leader: Leadership::always(),
        metrics: Arc::new(Metrics::new()),
    };
    reconcile_certificates(&ctx).await.unwrap();
    let writes = api.writes();
    // Same CA, so the caBundle is already right: only the Secret is written.
    assert_eq!(writes.len(), 1, "{writes:#?}");
    assert!(writes[0].path.ends_with("/secrets/gpuwarden-webhook-tls"));
}

#[tokio::test]
async fn first_run_creates_the_secret_and_fills_an_empty_ca_bundle() {
    let mwc = mwc_json(b"");
    let respond: Responder = Arc::new(move |s: &Seen| match (s.method.as_str(), s.path.as_str()) {
        (_, p) if p.ends_with("/mutatingwebhookconfigurations/gpuwarden") => {
            (StatusCode::OK, mwc.clone())
        }
        ("PATCH", _) => (StatusCode::OK, s.body.clone()),
        _ => not_found(),
    });
    let (client, api) = FakeApi::start(respond);
    let (clock, _) = clock_at(0);
    let ctx = CertContext {
        client,
        namespace: "gpuwarden-system".into(),
        params: cert_params(),
        clock,
        leader: Leadership::always(),
        metrics: Arc::new(Metrics::new()),
    };
    reconcile_certificates(&ctx).await.unwrap();
    let writes = api.writes();
    assert_eq!(writes.len(), 2);
    assert_eq!(certs::bundle_len(&bundle_in_patch(&writes[0].body)), 1);
    assert_eq!(writes[1].body["metadata"]["namespace"], "gpuwarden-system");
}

#[tokio::test]
async fn a_standby_reads_but_writes_no_certificate_and_no_ca_bundle() {
    let mwc = mwc_json(b"");
    let respond: Responder = Arc::new(move |s: &Seen| match (s.method.as_str(), s.path.as_str()) {
        (_, p) if p.ends_with("/mutatingwebhookconfigurations/gpuwarden") => {
            (StatusCode::OK, mwc.clone())
        }
        ("PATCH", _) => (StatusCode::OK, s.body.clone()),
        _ => not_found(),
    });
    let (client, api) = FakeApi::start(respond);
    let (clock, _) = clock_at(0);
    let (_leader_tx, leader) = Leadership::channel(false);
    let ctx = CertContext {
        client,
        namespace: "gpuwarden-system".into(),
        params: cert_params(),
        clock,
        leader,
        metrics: Arc::new(Metrics::new()),
    };
    let next = reconcile_certificates(&ctx).await.unwrap();
    assert!(api.writes().is_empty(), "{:#?}", api.writes());
    assert_eq!(
        next,
        ts(300),
        "a standby checks again at the longest interval"
    );
}

#[test]
fn gpunode_owner_reference_points_at_the_node() {
    let gn = desired_gpunode(&gpu_node("n", "1"));
    assert_eq!(
        gn.spec,
        GpuNodeSpec {
            node_name: "n".into()
        }
    );
    let o = &gn.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!((o.kind.as_str(), o.uid.as_str()), ("Node", "n-uid"));
    assert_eq!(o.block_owner_deletion, Some(false));
    assert_eq!(GpuNode::kind(&()), "GpuNode");
}

#[tokio::test]
async fn unhealthy_nodes_are_tainted_and_untainted_when_the_flag_is_on() {
    let mut node = gpu_node("gpu-1", "8");
    node.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
        taints: Some(vec![k8s_openapi::api::core::v1::Taint {
            key: "dedicated".into(),
            value: Some("ml".into()),
            effect: "NoSchedule".into(),
            time_added: None,
        }]),
        ..Default::default()
    });
    let mut status = agent_status();
    status.gpus.as_mut().unwrap()[3].health = GpuHealth {
        state: HealthState::Unhealthy,
        reasons: vec!["Xid79: GPU has fallen off the bus".into()],
        since: None,
    };
    let gn = gpunode_for(&node, Some(status));
    let mut w = world(
        vec![node.clone()],
        vec![gn],
        vec![agent_lease("gpu-1", 0, 40)],
        true,
        Leadership::always(),
        echo(),
        false,
    );
    w.ctx.taint_unhealthy_nodes = true;
    w.now.store(1, Ordering::SeqCst);
    reconcile_node("gpu-1", &w.ctx).await.unwrap();
    let writes = w.api.writes();
    assert_eq!(writes.len(), 2, "{writes:#?}");
    let taint = &writes[1];
    assert_eq!(taint.method, "PATCH");
    assert_eq!(taint.path, "/api/v1/nodes/gpu-1");
    assert_eq!(taint.content_type, "application/json-patch+json");
    // Guarded by the taints it read, so a concurrent edit fails instead of being lost.
    assert_eq!(taint.body[0]["op"], "test");
    assert_eq!(taint.body[0]["value"][0]["key"], "dedicated");
    assert_eq!(taint.body[1]["op"], "replace");
    let after = taint.body[1]["value"].as_array().unwrap();
    assert_eq!(after.len(), 2, "the existing taint stays");
    assert_eq!(after[1]["key"], "gpuwarden.io/gpu-unhealthy");
    assert_eq!(after[1]["effect"], "NoSchedule");

    // Healthy again, with the taint on the node: it is removed, the other taint kept.
    let mut tainted = node;
    tainted
        .spec
        .as_mut()
        .unwrap()
        .taints
        .as_mut()
        .unwrap()
        .push(k8s_openapi::api::core::v1::Taint {
            key: "gpuwarden.io/gpu-unhealthy".into(),
            effect: "NoSchedule".into(),
            value: None,
            time_added: None,
        });
    let gn = gpunode_for(&tainted, Some(agent_status()));
    let mut w = world(
        vec![tainted],
        vec![gn],
        vec![agent_lease("gpu-1", 0, 40)],
        true,
        Leadership::always(),
        echo(),
        false,
    );
    w.ctx.taint_unhealthy_nodes = true;
    reconcile_node("gpu-1", &w.ctx).await.unwrap();
    let writes = w.api.writes();
    let taint = writes
        .iter()
        .find(|s| s.path == "/api/v1/nodes/gpu-1")
        .expect("untaint");
    let after = taint.body[1]["value"].as_array().unwrap();
    assert_eq!(after.len(), 1);
    assert_eq!(after[0]["key"], "dedicated");
}

#[tokio::test]
async fn nodes_are_never_tainted_with_the_flag_off() {
    let node = gpu_node("gpu-1", "8");
    let mut status = agent_status();
    status.gpus.as_mut().unwrap()[0].health.state = HealthState::Unhealthy;
    let gn = gpunode_for(&node, Some(status));
    let w = world(
        vec![node],
        vec![gn],
        vec![],
        true,
        Leadership::always(),
        echo(),
        false,
    );
    reconcile_node("gpu-1", &w.ctx).await.unwrap();
    assert!(
        w.api
            .writes()
            .iter()
            .all(|s| !s.path.starts_with("/api/v1/nodes"))
    );
}

fn claim_policy() -> GpuPolicy {
    let mut p = GpuPolicy::default_policy();
    p.metadata.name = Some("dra".into());
    p.metadata.uid = Some("u-dra".into());
    p.spec.gpu.request_as = gpuwarden_crds::RequestAs::ResourceClaim;
    p.spec.gpu.max_per_container = 2;
    p
}

fn namespace_meta(
    name: &str,
) -> kube::api::PartialObjectMeta<k8s_openapi::api::core::v1::Namespace> {
    let mut ns = kube::api::PartialObjectMeta::<k8s_openapi::api::core::v1::Namespace>::default();
    ns.metadata.name = Some(name.to_owned());
    ns
}

#[tokio::test]
async fn claim_templates_are_applied_where_missing_and_deleted_where_unwanted() {
    use gpuwarden_operator::claim_templates::{
        TemplateContext, Written, desired_templates, reconcile_templates, template_object,
    };
    use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
    let policies = vec![claim_policy()];
    let all: Vec<Arc<GpuPolicy>> = policies.iter().cloned().map(Arc::new).collect();
    let desired = desired_templates(&all, [("ml", None)]);
    // ml/…-1 is current; ml/…-9 is no longer wanted (the policy's maxPerContainer went down).
    let key = ("ml".to_owned(), "gpuwarden-gpu.nvidia.com-1".to_owned());
    let mut current = template_object(&key, &desired[&key]);
    current.metadata.uid = Some("t-1".into());
    let mut stale = current.clone();
    stale.metadata.name = Some("gpuwarden-gpu.nvidia.com-9".into());
    stale.metadata.uid = Some("t-9".into());
    let world = |templates: Vec<ResourceClaimTemplate>, leader| {
        let (client, api) = FakeApi::start(echo());
        let (policies, pw) = cache(policies.clone(), true);
        let (namespaces, nw) = cache(
            vec![namespace_meta("ml"), namespace_meta("kube-system")],
            true,
        );
        let (templates, tw) = cache(templates, true);
        std::mem::forget((pw, nw, tw));
        let ctx = TemplateContext {
            client,
            policies,
            namespaces,
            templates,
            leader,
            metrics: Arc::new(Metrics::new()),
        };
        (ctx, api)
    };

    let (ctx, api) = world(vec![current.clone(), stale], Leadership::always());
    let written = reconcile_templates(&ctx).await.unwrap();
    assert_eq!(
        written,
        Written {
            applied: 1,
            deleted: 1
        }
    );
    let writes = api.writes();
    assert_eq!(writes.len(), 2, "{writes:?}");
    let apply = &writes[0];
    assert_eq!(apply.method, "PATCH");
    assert_eq!(
        apply.path,
        "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaimtemplates/gpuwarden-gpu.nvidia.com-2"
    );
    assert!(
        apply.query.contains("fieldManager=gpuwarden-operator")
            && apply.query.contains("force=true")
    );
    assert_eq!(apply.content_type, "application/apply-patch+yaml");
    assert_eq!(
        apply.body["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"],
        2
    );
    assert_eq!(apply.body["metadata"]["ownerReferences"][0]["uid"], "u-dra");
    let delete = &writes[1];
    assert_eq!(delete.method, "DELETE");
    assert_eq!(
        delete.path,
        "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaimtemplates/gpuwarden-gpu.nvidia.com-9"
    );
    assert_eq!(
        delete.body["preconditions"]["uid"], "t-9",
        "only the template it saw"
    );

    // Once they are what the policy wants, nothing is written; and a replica that is not
    // the leader never writes.
    let mut second = template_object(
        &("ml".into(), "gpuwarden-gpu.nvidia.com-2".into()),
        &desired[&("ml".to_owned(), "gpuwarden-gpu.nvidia.com-2".to_owned())],
    );
    second.metadata.uid = Some("t-2".into());
    let (ctx, api) = world(vec![current.clone(), second], Leadership::always());
    assert_eq!(reconcile_templates(&ctx).await.unwrap(), Written::default());
    assert!(api.requests().is_empty());
    let (_tx, standby) = Leadership::channel(false);
    let (ctx, api) = world(vec![], standby);
    assert_eq!(reconcile_templates(&ctx).await.unwrap(), Written::default());
    assert!(api.requests().is_empty());
}

/// The admission policies' keeper applies what the GpuPolicies render under the operator's
/// field manager, policies before bindings, and deletes by label what no policy renders any
/// more; a failed pass is recorded, wakes the GpuPolicy reconciler, and turns the policy's
/// `AdmissionPolicies` condition to KeepFailed.
#[tokio::test]
async fn admission_policies_are_applied_stale_ones_deleted_and_a_failure_reported() {
    use gpuwarden_crds::admission::policies::{CONDITION_ADMISSION_POLICIES, MutatingApi};
    use gpuwarden_operator::admission_policies::{
        AdmissionContext, Keeping, reconcile_admission_policies,
    };

    const MAPS: &str = "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicies";
    let forbid = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let respond: Responder = {
        let forbid = forbid.clone();
        Arc::new(move |s: &Seen| match s.method.as_str() {
            "PATCH" if forbid.load(Ordering::SeqCst) => (
                StatusCode::FORBIDDEN,
                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403, "message": "forbidden"}),
            ),
            // A policy left from a GpuPolicy that is gone.
            "GET" if s.path == MAPS => (
                StatusCode::OK,
                json!({"apiVersion": "v1", "kind": "PartialObjectMetadataList", "metadata": {},
                    "items": [{"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                        "metadata": {"name": "gpuwarden-gone"}},
                        {"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                        "metadata": {"name": "gpuwarden-default"}}]}),
            ),
            "GET" => (
                StatusCode::OK,
                json!({"apiVersion": "v1", "kind": "PartialObjectMetadataList", "metadata": {}, "items": []}),
            ),
            _ => echo()(s),
        })
    };
    let (client, api) = FakeApi::start(respond);
    let (store, writer) = cache(vec![GpuPolicy::default_policy()], true);
    std::mem::forget(writer);
    let keeping = Arc::new(Keeping::new(Some(MutatingApi::V1)));
    let (policies_tx, mut policies_changed) = tokio::sync::mpsc::unbounded_channel();
    let ctx = AdmissionContext {
        client: client.clone(),
        policies: store.clone(),
        keeping: keeping.clone(),
        policies_changed: policies_tx,
        leader: Leadership::always(),
        metrics: Arc::new(Metrics::new()),
    };
    reconcile_admission_policies(&ctx).await.unwrap();
    let writes: Vec<String> = (api.writes().iter())
        .map(|s| format!("{} {}", s.method, s.path))
        .collect();
    assert_eq!(
        writes,
        [
            format!("PATCH {MAPS}/gpuwarden-default"),
            "PATCH /apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicybindings/gpuwarden-default".to_owned(),
            format!("DELETE {MAPS}/gpuwarden-gone"),
        ]
    );
    for write in api.writes().iter().filter(|s| s.method == "PATCH") {
        assert!(
            write.query.contains("fieldManager=gpuwarden-operator")
                && write.query.contains("force=true"),
            "{write:?}"
        );
    }
    let lists: Vec<Seen> = api
        .requests()
        .into_iter()
        .filter(|s| s.method == "GET")
        .collect();
    assert_eq!(lists.len(), 4);
    assert!(
        lists.iter().all(|s| s
            .query
            .contains("labelSelector=app.kubernetes.io%2Fmanaged-by%3Dgpuwarden-operator")),
        "{lists:?}"
    );
    assert_eq!(keeping.failure(), None);
    assert!(
        policies_changed.try_recv().is_err(),
        "nothing changed for the conditions"
    );

    // Refused: the pass fails, says so once, and the condition says it too.
    forbid.store(true, Ordering::SeqCst);
    assert!(reconcile_admission_policies(&ctx).await.is_err());
    let failure = keeping.failure().expect("recorded");
    assert!(
        failure.contains("failed to apply MutatingAdmissionPolicy gpuwarden-default"),
        "{failure}"
    );
    assert!(policies_changed.try_recv().is_ok());
    let (clock, _) = clock_at(0);
    let pctx = PolicyContext {
        client,
        policies: store,
        clock,
        leader: Leadership::always(),
        metrics: Arc::new(Metrics::new()),
        admission_policies: Some(keeping),
    };
    forbid.store(false, Ordering::SeqCst);
    reconcile_policy("default", &pctx).await.unwrap();
    let status = api.writes().last().expect("status written").body["status"].clone();
    let admission = condition(
        status["conditions"].as_array().unwrap(),
        CONDITION_ADMISSION_POLICIES,
    );
    assert_eq!(admission["status"], "False");
    assert_eq!(admission["reason"], "KeepFailed");
}
