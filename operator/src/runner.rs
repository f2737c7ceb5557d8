//! Wiring: one watch (and cache) per kind, routes that pass on only objects whose inputs
//! changed (so the operator's own writes and Lease renewals do not wake it), three
//! kube-runtime `Controller`s with bounded concurrency and per-object backoff, the
//! certificate keeper (woken by a watch on the webhook configuration), the
//! ResourceClaimTemplate keeper (where the cluster serves DRA), leader election and the
//! health server.

use gpuwarden_crds::error_chain;
use std::collections::HashMap;
use std::future::Future;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt, stream};
use gpuwarden_crds::{
    AGENT_LEASE_NAMESPACE, AGENT_LEASE_PREFIX, GpuNode, GpuPolicy, TAINT_GPU_UNHEALTHY,
};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, NodeSpec, NodeStatus, Pod};
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use kube::api::PartialObjectMeta;
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, store::Writer};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use std::fmt::Debug;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use crate::admission_policies::{self, AdmissionContext, Keeping};
use crate::certs::CertParams;
use crate::claim_templates::{self, TemplateContext};
use crate::gpunode::{agent_liveness, node_gpu_signal};
use crate::health::{self, HealthState};
use crate::leader::{self, LeaderError, Leadership};
use crate::metrics::Metrics;
use crate::node_controller::{self, NodeContext, NodeError};
use crate::policy_controller::{self, PolicyContext, PolicyError};
use crate::reports::{self, ReportContext, ReportError};
use crate::webhook_certs::{self, CertContext};
use crate::webhook_conditions::{self, ConditionContext};
use crate::{Clock, Config, system_clock};
use gpuwarden_webhook::report::ReportKind;

/// The operator failed to start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The health listener could not be bound.
    #[error("failed to listen on {addr} for /healthz, /readyz and /metrics")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Leader election could not start.
    #[error(transparent)]
    Leader(#[from] LeaderError),
}

/// Resolves once `rx` says shutdown (or its sender is gone).
async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Drops what the operator never reads from a Node (images, conditions, annotations, managed
/// fields): at 5,000 nodes that is most of the cache's memory.
pub fn trim_node(node: &mut Node) {
    node.metadata.managed_fields = None;
    node.metadata.annotations = None;
    node.spec = node.spec.take().map(|s| NodeSpec {
        taints: s.taints,
        ..Default::default()
    });
    node.status = node.status.take().map(|s| NodeStatus {
        allocatable: s.allocatable,
        ..Default::default()
    });
}

fn trim_gpunode(gn: &mut GpuNode) {
    gn.metadata.managed_fields = None;
    gn.metadata.annotations = None;
}

fn hash_of(value: &impl Hash) -> u64 {
    let mut h = DefaultHasher::new();
    value.hash(&mut h);
    h.finish()
}

/// What the GpuNode reconciler reads from a Node; heartbeats and image lists do not count.
fn node_inputs(node: &Node) -> u64 {
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == TAINT_GPU_UNHEALTHY));
    hash_of(&(
        node.metadata.uid.as_deref(),
        format!("{:?}", node_gpu_signal(node)),
        tainted,
        node.metadata.deletion_timestamp.is_some(),
    ))
}

/// What the GpuNode reconciler reads from a GpuNode: everything but the operator's own
/// `conditions` and `summary`, so its own status writes do not wake it.
fn gpunode_inputs(gn: &GpuNode) -> u64 {
    let agent_part = gn.status.as_ref().map(|s| {
        serde_json::to_string(&(
            &s.driver,
            &s.gpus,
            &s.bindings,
            &s.privileged_pods,
            &s.runtime,
        ))
        .unwrap_or_default()
    });
    let owners = serde_json::to_string(&gn.metadata.owner_references).unwrap_or_default();
    hash_of(&(
        &gn.spec.node_name,
        owners,
        agent_part,
        gn.metadata.deletion_timestamp.is_some(),
        gn.metadata.uid.as_deref(),
    ))
}

/// What the reconciler reads from an agent Lease: holder, duration and whether it is live
/// now. A renewal of a live Lease changes none of these; expiry is caught by a timed requeue.
fn lease_inputs(lease: &Lease, clock: &Clock) -> u64 {
    let spec = lease.spec.as_ref();
    hash_of(&(
        spec.and_then(|s| s.holder_identity.as_deref()),
        spec.and_then(|s| s.lease_duration_seconds),
        agent_liveness(Some(lease), clock()).is_live(),
    ))
}

/// What the certificate and condition keepers read of the webhook configuration: which
/// object it is, each webhook's `caBundle` and its `matchConditions`. A configuration
/// re-created from the manifests, or one whose bundle or conditions someone changed, wakes
/// them; a label edit does not.
fn webhook_configuration_inputs(mwc: &MutatingWebhookConfiguration) -> u64 {
    let mut hasher = DefaultHasher::new();
    mwc.metadata.uid.hash(&mut hasher);
    for w in mwc.webhooks.iter().flatten() {
        w.name.hash(&mut hasher);
        (w.client_config.ca_bundle.as_ref())
            .map(|b| b.0.as_slice())
            .hash(&mut hasher);
        for c in w.match_conditions.iter().flatten() {
            (c.name.as_str(), c.expression.as_str()).hash(&mut hasher);
        }
    }
    hasher.finish()
}

/// Remembers the last input hash per object and says whether a new one differs.
#[derive(Default)]
struct ChangeFilter(HashMap<String, u64>);

impl ChangeFilter {
    fn changed(&mut self, key: &str, hash: u64) -> bool {
        self.0.insert(key.to_owned(), hash) != Some(hash)
    }
    fn forget(&mut self, key: &str) {
        self.0.remove(key);
    }
}

/// Per-object retry delays: doubling from 1 s to 5 min on transient errors, reset on success.
#[derive(Default)]
struct Backoffs(Mutex<HashMap<String, u32>>);

impl Backoffs {
    fn next(&self, key: &str) -> Duration {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(key.to_owned()).or_insert(0);
        *n = n.saturating_add(1);
        Duration::from_secs(1u64 << (*n - 1).min(9)).min(Duration::from_secs(300))
    }
    fn reset(&self, key: &str) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(key);
    }
}

/// One watch per kind: each event goes into the kind's cache, then to `route`, which
/// passes the objects whose inputs changed to the controllers that listen. Runs until
/// shutdown; the watcher retries with backoff and the cache keeps serving what it has.
fn watch_kind<K>(
    api: Api<K>,
    config: watcher::Config,
    trim: fn(&mut K),
    writer: Writer<K>,
    shutdown: watch::Receiver<bool>,
    mut route: impl FnMut(&watcher::Event<K>) + Send + 'static,
) -> tokio::task::JoinHandle<()>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let events = watcher(api, config)
        .default_backoff()
        .modify(trim)
        .reflect(writer)
        .take_until(stopped(shutdown));
    tokio::spawn(async move {
        futures::pin_mut!(events);
        while let Some(event) = events.next().await {
            match event {
                Ok(event) => route(&event),
                Err(e) => warn!(error = %e, "watch failed; retrying"),
            }
        }
    })
}

/// What a kind's watch passes on: `changed` gets an object whose inputs (`inputs`, a hash
/// of what the reconciler reads) differ from the last seen, `deleted` a deleted one.
fn route<K: Resource<DynamicType = ()>>(
    inputs: impl Fn(&K) -> u64 + Send + 'static,
    mut changed: impl FnMut(&K) + Send + 'static,
    mut deleted: impl FnMut(&K) + Send + 'static,
) -> impl FnMut(&watcher::Event<K>) + Send + 'static {
    let mut filter = ChangeFilter::default();
    // Namespaced objects are known by namespace and name.
    let key = |o: &K| match o.namespace() {
        Some(namespace) => format!("{namespace}/{}", o.name_any()),
        None => o.name_any(),
    };
    move |event| match event {
        watcher::Event::Apply(o) | watcher::Event::InitApply(o) => {
            if filter.changed(&key(o), inputs(o)) {
                changed(o);
            }
        }
        watcher::Event::Delete(o) => {
            filter.forget(&key(o));
            deleted(o);
        }
        watcher::Event::Init | watcher::Event::InitDone => {}
    }
}

/// A route's two callbacks that only wake `tx`, for a keeper that reconciles everything.
fn wake_on<K>(
    tx: &mpsc::UnboundedSender<()>,
) -> (
    impl FnMut(&K) + Send + 'static,
    impl FnMut(&K) + Send + 'static,
) {
    let (a, b) = (tx.clone(), tx.clone());
    (
        move |_: &K| {
            let _ = a.send(());
        },
        move |_: &K| {
            let _ = b.send(());
        },
    )
}

/// A channel of objects for a controller's trigger: the sending half for a route, the
/// receiving half as the stream `Controller` reads.
fn trigger<K: Send + 'static>() -> (
    mpsc::UnboundedSender<K>,
    impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    let stream = stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|o| (Ok(o), rx)) },
    );
    (tx, stream)
}

/// Fires each time this replica becomes the leader: a new leader reconciles everything, as
/// the old one may have died mid-way.
fn leader_gained(leadership: Leadership) -> impl Stream<Item = ()> + Send {
    stream::unfold(leadership, |mut leadership| async move {
        loop {
            if leadership.changed().await? {
                return Some(((), leadership));
            }
        }
    })
}

/// Follows leadership for the metric and the log, until shutdown.
fn report_leadership(
    mut leadership: Leadership,
    metrics: Arc<Metrics>,
    shutdown: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let changes = async {
            while let Some(leader) = leadership.changed().await {
                metrics.set_leader(leader);
                if leader {
                    info!("became leader; reconciling everything");
                } else {
                    info!("not the leader; standing by");
                }
            }
        };
        tokio::select! {
            () = changes => {}
            () = stopped(shutdown) => {}
        }
    })
}

/// Drains a controller's results: reconcile errors are logged where they happen, objects
/// gone from the cache before their turn are not errors.
async fn drain<K: Resource, E: std::error::Error + 'static, Q: std::error::Error + 'static>(
    results: impl Stream<Item = Result<(ObjectRef<K>, Action), controller::Error<E, Q>>>,
) {
    results
        .for_each(|result| async move {
            if let Err(e) = result {
                debug!(error = %error_chain(&e), "controller");
            }
        })
        .await;
}

/// Runs the operator until `shutdown` resolves, then finishes in-flight reconciles, releases
/// the leader Lease and stops the health server.
pub async fn run<F>(config: Config, client: Client, shutdown: F) -> Result<(), RunError>
where
    F: Future<Output = ()> + Send + 'static,
{
    run_with(config, client, shutdown, system_clock(), None).await
}

/// [`run`] with an injected clock and, optionally, leadership decided by the caller instead
/// of the Lease election (`config.leader_election` is then ignored).
pub async fn run_with<F>(
    config: Config,
    client: Client,
    shutdown: F,
    clock: Clock,
    leadership: Option<Leadership>,
) -> Result<(), RunError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let (sd_tx, sd_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        info!("shutting down");
        let _ = sd_tx.send(true);
        // Keep the sender so receivers see `true`, not a closed channel, until they exit.
        sd_tx.closed().await;
    });

    let metrics = Arc::new(Metrics::new());
    let ready = Arc::new(AtomicBool::new(false));
    let listener = tokio::net::TcpListener::bind(config.health_listen)
        .await
        .map_err(|source| RunError::Bind {
            addr: config.health_listen,
            source,
        })?;
    info!(addr = %config.health_listen, "serving /healthz, /readyz and /metrics");
    let health_task = tokio::spawn(
        axum::serve(
            listener,
            health::router(HealthState {
                metrics: metrics.clone(),
                ready: ready.clone(),
            }),
        )
        .with_graceful_shutdown(stopped(sd_rx.clone()))
        .into_future(),
    );

    let (leadership, leader_task) = if let Some(given) = leadership {
        (given, None)
    } else if config.leader_election {
        let (l, t) = leader::elect(
            client.clone(),
            &config.namespace,
            &config.identity,
            sd_rx.clone(),
        )
        .await?;
        (l, Some(t))
    } else {
        (Leadership::always(), None)
    };
    metrics.set_leader(leadership.is_leader());

    let (nodes, node_w) = reflector::store::<Node>();
    let (gpunodes, gpunode_w) = reflector::store::<GpuNode>();
    let (leases, lease_w) = reflector::store::<Lease>();
    let (policies, policy_w) = reflector::store::<GpuPolicy>();
    // The GpuNode controller runs on Nodes, and wakes for their GpuNodes and agent Leases;
    // the orphan controller runs on GpuNodes, and wakes when their Node goes; the policy
    // controller re-validates every policy when any changes.
    let (node_tx, node_changes) = trigger::<Node>();
    let (gpunode_tx, gpunode_changes) = trigger::<GpuNode>();
    let (lease_tx, lease_changes) = trigger::<Lease>();
    let (orphan_tx, orphan_changes) = trigger::<GpuNode>();
    let (gone_tx, nodes_gone) = trigger::<Node>();
    let (policy_tx, policy_changes) = trigger::<GpuPolicy>();
    let (policies_tx, policies_changed) = mpsc::unbounded_channel::<()>();
    // The template keeper reconciles everything when a policy, a namespace's labels or one of
    // its templates change.
    let (templates_tx, templates_changed) = mpsc::unbounded_channel::<()>();
    // The condition keeper, when a policy or the webhook configuration changes.
    let (conditions_tx, conditions_changed) = mpsc::unbounded_channel::<()>();
    // The admission policies' keeper, when a policy changes.
    let (admission_tx, admission_changed) = mpsc::unbounded_channel::<()>();
    // The report controller runs on Namespaces (their labels choose the policy), wakes for
    // the Pods in them, and reports on every namespace when a policy changes, a report kind
    // appears or this replica becomes the leader.
    let (report_ns_tx, report_ns_changes) = trigger::<PartialObjectMeta<Namespace>>();
    let (report_pod_tx, report_pod_changes) = trigger::<Pod>();
    let (reports_tx, reports_all) = mpsc::unbounded_channel::<()>();

    let tasks = vec![
        report_leadership(leadership.clone(), metrics.clone(), sd_rx.clone()),
        watch_kind(
            Api::<Node>::all(client.clone()),
            watcher::Config::default(),
            trim_node,
            node_w,
            sd_rx.clone(),
            route(
                node_inputs,
                move |n| {
                    let _ = node_tx.send(n.clone());
                },
                move |n| {
                    let _ = gone_tx.send(n.clone());
                },
            ),
        ),
        watch_kind(
            Api::<GpuNode>::all(client.clone()),
            watcher::Config::default(),
            trim_gpunode,
            gpunode_w,
            sd_rx.clone(),
            route(
                gpunode_inputs,
                {
                    let gpunode_tx = gpunode_tx.clone();
                    move |g| {
                        let _ = gpunode_tx.send(g.clone());
                        let _ = orphan_tx.send(g.clone());
                    }
                },
                move |g| {
                    let _ = gpunode_tx.send(g.clone());
                },
            ),
        ),
        watch_kind(
            Api::<Lease>::namespaced(client.clone(), AGENT_LEASE_NAMESPACE),
            watcher::Config::default(),
            |l| l.metadata.managed_fields = None,
            lease_w,
            sd_rx.clone(),
            route(
                {
                    let clock = clock.clone();
                    move |l| lease_inputs(l, &clock)
                },
                {
                    let lease_tx = lease_tx.clone();
                    move |l| {
                        let _ = lease_tx.send(l.clone());
                    }
                },
                move |l| {
                    let _ = lease_tx.send(l.clone());
                },
            ),
        ),
        // Overlaps are between policies, so any change re-validates all of them.
        watch_kind(
            Api::<GpuPolicy>::all(client.clone()),
            watcher::Config::default(),
            |p| p.metadata.managed_fields = None,
            policy_w,
            sd_rx.clone(),
            route(
                |p: &GpuPolicy| {
                    hash_of(&(
                        p.metadata.generation,
                        p.metadata.uid.as_deref(),
                        p.metadata.deletion_timestamp.is_some(),
                    ))
                },
                {
                    let (policies_tx, templates_tx, conditions_tx, admission_tx, reports_tx) = (
                        policies_tx.clone(),
                        templates_tx.clone(),
                        conditions_tx.clone(),
                        admission_tx.clone(),
                        reports_tx.clone(),
                    );
                    move |p: &GpuPolicy| {
                        let _ = policy_tx.send(p.clone());
                        let _ = policies_tx.send(());
                        let _ = templates_tx.send(());
                        let _ = conditions_tx.send(());
                        let _ = admission_tx.send(());
                        let _ = reports_tx.send(());
                    }
                },
                {
                    let (policies_tx, templates_tx, conditions_tx, reports_tx) = (
                        policies_tx.clone(),
                        templates_tx.clone(),
                        conditions_tx.clone(),
                        reports_tx.clone(),
                    );
                    move |_| {
                        let _ = policies_tx.send(());
                        let _ = templates_tx.send(());
                        let _ = conditions_tx.send(());
                        let _ = admission_tx.send(());
                        let _ = reports_tx.send(());
                    }
                },
            ),
        ),
    ];
    let mut tasks = tasks;
    // The certificate and condition keepers are woken when the webhook configuration appears
    // or its bundles or conditions change. The watch is on that one object (a field selector,
    // which is also what lets RBAC pin list and watch to its name); the store only feeds the
    // route.
    let (certs_tx, certs_changed) = mpsc::unbounded_channel::<()>();
    let manage_certificates = config.manage_webhook_certificates;
    let (_, webhook_configuration_w) = reflector::store::<MutatingWebhookConfiguration>();
    tasks.push(watch_kind(
        Api::<MutatingWebhookConfiguration>::all(client.clone()),
        watcher::Config::default().fields(&format!(
            "metadata.name={}",
            gpuwarden_crds::install::MUTATING_WEBHOOK_CONFIGURATION
        )),
        |mwc| mwc.metadata.managed_fields = None,
        webhook_configuration_w,
        sd_rx.clone(),
        route(
            webhook_configuration_inputs,
            move |_: &MutatingWebhookConfiguration| {
                if manage_certificates {
                    let _ = certs_tx.send(());
                }
                let _ = conditions_tx.send(());
            },
            // Nothing to restore on a configuration that is gone; its return wakes us.
            |_: &MutatingWebhookConfiguration| {},
        ),
    ));
    let (namespaces, namespace_w) = reflector::store::<PartialObjectMeta<Namespace>>();
    let (templates, template_w) = reflector::store::<ResourceClaimTemplate>();
    let dra = dra_served(&client).await;
    // Namespace labels choose the policy: the templates and the reports read them.
    {
        let (mut templates_changed, mut templates_deleted) = wake_on(&templates_tx);
        tasks.push(watch_kind(
            Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
            watcher::Config::default(),
            |ns| {
                ns.metadata.managed_fields = None;
                ns.metadata.annotations = None;
            },
            namespace_w,
            sd_rx.clone(),
            route(
                |ns: &PartialObjectMeta<Namespace>| {
                    hash_of(&(
                        &ns.metadata.labels,
                        ns.metadata.deletion_timestamp.is_some(),
                    ))
                },
                move |ns: &PartialObjectMeta<Namespace>| {
                    if dra {
                        templates_changed(ns);
                    }
                    let _ = report_ns_tx.send(ns.clone());
                },
                move |ns: &PartialObjectMeta<Namespace>| {
                    if dra {
                        templates_deleted(ns);
                    }
                },
            ),
        ));
    }
    if dra {
        let (changed, deleted) = wake_on(&templates_tx);
        tasks.push(watch_kind(
            Api::<ResourceClaimTemplate>::all(client.clone()),
            watcher::Config::default().labels(gpuwarden_crds::claims::LABEL_CLAIM_TEMPLATE),
            |t| t.metadata.managed_fields = None,
            template_w,
            sd_rx.clone(),
            route(
                |t: &ResourceClaimTemplate| {
                    hash_of(&(
                        t.metadata.namespace.as_deref(),
                        t.metadata.uid.as_deref(),
                        serde_json::to_string(&t.metadata.owner_references).unwrap_or_default(),
                    ))
                },
                changed,
                deleted,
            ),
        ));
    } else {
        info!("the cluster does not serve resource.k8s.io/v1: no ResourceClaimTemplates are kept");
    }

    // Nothing is decided before every cache has its first full list; what changed meanwhile
    // waits in the triggers.
    let caches = {
        let (nodes, gpunodes, leases, policies, namespaces) = (
            nodes.clone(),
            gpunodes.clone(),
            leases.clone(),
            policies.clone(),
            namespaces.clone(),
        );
        async move {
            let _ = namespaces.wait_until_ready().await;
            let _ = nodes.wait_until_ready().await;
            let _ = gpunodes.wait_until_ready().await;
            let _ = leases.wait_until_ready().await;
            let _ = policies.wait_until_ready().await;
        }
    };
    tokio::select! {
        () = caches => {}
        () = stopped(sd_rx.clone()) => {
            return finish(tasks, leader_task, health_task).await;
        }
    }
    ready.store(true, Ordering::Release);
    metrics.set_caches_synced(true);
    info!(
        nodes = nodes.len(),
        gpunodes = gpunodes.len(),
        leases = leases.len(),
        policies = policies.len(),
        "caches synced"
    );

    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: gpuwarden_crds::install::OPERATOR_NAME.to_owned(),
            instance: Some(config.identity.clone()),
        },
    );
    let node_ctx = Arc::new(NodeContext {
        client: client.clone(),
        nodes: nodes.clone(),
        gpunodes: gpunodes.clone(),
        leases,
        clock: clock.clone(),
        leader: leadership.clone(),
        metrics: metrics.clone(),
        recorder: Some(recorder),
        taint_unhealthy_nodes: config.taint_unhealthy_nodes,
    });
    let controller_config = kube::runtime::Config::default().concurrency(config.concurrency.max(1));
    let node_backoff = Arc::new(Backoffs::default());
    let reconcile_by_name = {
        let backoffs = node_backoff.clone();
        move |name: String, ctx: Arc<NodeContext>| {
            let backoffs = backoffs.clone();
            async move {
                timed(
                    &ctx.metrics,
                    node_controller::CONTROLLER,
                    node_controller::reconcile_node(&name, &ctx),
                    NodeError::kind,
                    &backoffs,
                    &name,
                )
                .await
            }
        }
    };
    let node_controller = {
        let (reconcile, backoffs) = (reconcile_by_name.clone(), node_backoff.clone());
        Controller::for_stream(node_changes, nodes)
            .watches_stream(gpunode_changes, |g: GpuNode| {
                Some(ObjectRef::<Node>::new(&g.name_any()))
            })
            .watches_stream(lease_changes, |l: Lease| {
                let name = l.name_any();
                (name.strip_prefix(AGENT_LEASE_PREFIX)).map(ObjectRef::<Node>::new)
            })
            .reconcile_all_on(leader_gained(leadership.clone()))
            .with_config(controller_config.clone())
            .graceful_shutdown_on(stopped(sd_rx.clone()))
            .run(
                move |node: Arc<Node>, ctx| reconcile(node.name_any(), ctx),
                move |node: Arc<Node>, err: &NodeError, _| {
                    error_action(&backoffs, &node.name_any(), err.is_permanent(), err)
                },
                node_ctx.clone(),
            )
    };
    let gpunodes_for_reports = gpunodes.clone();
    let orphan_controller = {
        let (reconcile, backoffs) = (reconcile_by_name, node_backoff);
        Controller::for_stream(orphan_changes, gpunodes)
            .watches_stream(nodes_gone, |n: Node| {
                Some(ObjectRef::<GpuNode>::new(&n.name_any()))
            })
            .reconcile_all_on(leader_gained(leadership.clone()))
            .with_config(controller_config.clone())
            .graceful_shutdown_on(stopped(sd_rx.clone()))
            .run(
                move |gn: Arc<GpuNode>, ctx: Arc<NodeContext>| {
                    let reconcile = reconcile.clone();
                    async move {
                        let name = gn.name_any();
                        if ctx.nodes.get(&ObjectRef::new(&name)).is_some() {
                            // The node controller owns GpuNodes whose Node exists.
                            return Ok(Action::await_change());
                        }
                        reconcile(name, ctx).await
                    }
                },
                move |gn: Arc<GpuNode>, err: &NodeError, _| {
                    error_action(&backoffs, &gn.name_any(), err.is_permanent(), err)
                },
                node_ctx,
            )
    };
    let report_controller = {
        let (pods, pod_w) = reflector::store::<Pod>();
        let ctx = Arc::new(ReportContext::new(
            client.clone(),
            pods,
            namespaces.clone(),
            policies.clone(),
            leadership.clone(),
            metrics.clone(),
        ));
        let pod_watch = PodWatch {
            api: Api::<Pod>::all(client.clone()),
            writer: pod_w,
            index: ctx.index.clone(),
            changes: report_pod_tx,
        };
        let keeper = report_kinds_loop(
            ctx.clone(),
            config.policy_reports.then_some(pod_watch),
            reports_tx,
            sd_rx.clone(),
        );
        // The GPU nodes' posture, in one cluster-scoped report.
        let nodes_report = (config.policy_reports)
            .then(|| crate::node_reports::run(ctx.clone(), gpunodes_for_reports, sd_rx.clone()));
        let all = stream::unfold(reports_all, |mut rx| async move {
            rx.recv().await.map(|()| ((), rx))
        });
        let backoffs = Arc::new(Backoffs::default());
        let (b1, b2) = (backoffs.clone(), backoffs);
        let controller = Controller::for_stream(report_ns_changes, namespaces.clone())
            .watches_stream(report_pod_changes, |pod: Pod| {
                pod.metadata
                    .namespace
                    .as_deref()
                    .map(ObjectRef::<PartialObjectMeta<Namespace>>::new)
            })
            .reconcile_all_on(all)
            .with_config(controller_config.clone().debounce(reports::DEBOUNCE))
            .graceful_shutdown_on(stopped(sd_rx.clone()))
            .run(
                move |ns: Arc<PartialObjectMeta<Namespace>>, ctx: Arc<ReportContext>| {
                    let backoffs = b1.clone();
                    async move {
                        let name = ns.name_any();
                        timed(
                            &ctx.metrics,
                            reports::CONTROLLER,
                            reports::reconcile_namespace(&name, &ctx),
                            ReportError::kind,
                            &backoffs,
                            &name,
                        )
                        .await
                    }
                },
                move |ns: Arc<PartialObjectMeta<Namespace>>, err: &ReportError, _| {
                    error_action(&b2, &ns.name_any(), err.is_permanent(), err)
                },
                ctx,
            );
        async move {
            let nodes_report = async {
                if let Some(run) = nodes_report {
                    run.await;
                }
            };
            tokio::join!(drain(controller), keeper, nodes_report);
        }
    };
    let policies_for_templates = policies.clone();
    let policies_for_conditions = policies.clone();
    let policies_for_admission = policies.clone();
    let keeping = if config.admission_policies {
        let api = admission_policies::discover(&client).await;
        match api {
            Some(api) => info!(version = api.version(), "keeping MutatingAdmissionPolicies"),
            None => warn!(
                "the API server does not serve MutatingAdmissionPolicy: containers that hold no GPU keep their image's NVIDIA_VISIBLE_DEVICES"
            ),
        }
        Some(Arc::new(Keeping::new(api)))
    } else {
        None
    };
    let policy_ctx = Arc::new(PolicyContext {
        client: client.clone(),
        policies: policies.clone(),
        clock: clock.clone(),
        leader: leadership.clone(),
        metrics: metrics.clone(),
        admission_policies: keeping.clone(),
    });
    let policy_backoff = Arc::new(Backoffs::default());
    let policy_controller = {
        let (b1, b2) = (policy_backoff.clone(), policy_backoff);
        let all = stream::unfold(policies_changed, |mut rx| async move {
            rx.recv().await.map(|()| ((), rx))
        });
        Controller::for_stream(policy_changes, policies)
            .reconcile_all_on(stream::select(all, leader_gained(leadership.clone())))
            .with_config(controller_config.clone())
            .graceful_shutdown_on(stopped(sd_rx.clone()))
            .run(
                move |p: Arc<GpuPolicy>, ctx: Arc<PolicyContext>| {
                    let backoffs = b1.clone();
                    async move {
                        let name = p.name_any();
                        timed(
                            &ctx.metrics,
                            policy_controller::CONTROLLER,
                            policy_controller::reconcile_policy(&name, &ctx),
                            PolicyError::kind,
                            &backoffs,
                            &name,
                        )
                        .await
                    }
                },
                move |p: Arc<GpuPolicy>, err: &PolicyError, _| {
                    error_action(&b2, &p.name_any(), err.kind() == "invalid", err)
                },
                policy_ctx,
            )
    };
    let certs = async {
        if !config.manage_webhook_certificates {
            info!("webhook certificates are managed elsewhere (e.g. cert-manager)");
            return;
        }
        let ctx = CertContext {
            client: client.clone(),
            namespace: config.namespace.clone(),
            params: CertParams {
                namespace: config.namespace.clone(),
                service: gpuwarden_crds::install::WEBHOOK_NAME.to_owned(),
                validity: config.cert_validity,
            },
            clock: clock.clone(),
            leader: leadership.clone(),
            metrics: metrics.clone(),
        };
        cert_loop(ctx, certs_changed, sd_rx.clone()).await;
    };
    let templates = async {
        if !dra {
            return;
        }
        let ctx = TemplateContext {
            client: client.clone(),
            policies: policies_for_templates,
            namespaces,
            templates,
            leader: leadership.clone(),
            metrics: metrics.clone(),
        };
        template_loop(ctx, templates_changed, sd_rx.clone()).await;
    };
    let conditions = async {
        let ctx = ConditionContext {
            client: client.clone(),
            policies: policies_for_conditions,
            leader: leadership.clone(),
            metrics: metrics.clone(),
        };
        keep(
            webhook_conditions::CONTROLLER,
            &ctx.leader,
            &ctx.metrics,
            async {},
            || async {
                webhook_conditions::reconcile_conditions(&ctx)
                    .await
                    .map(|_| ())
            },
            webhook_conditions::ConditionSyncError::kind,
            conditions_changed,
            sd_rx.clone(),
        )
        .await;
    };
    let admission = async {
        let Some(keeping) = keeping else {
            return;
        };
        let ctx = AdmissionContext {
            client: client.clone(),
            policies: policies_for_admission,
            keeping,
            policies_changed: policies_tx,
            leader: leadership.clone(),
            metrics: metrics.clone(),
        };
        // An empty cache would delete every policy kept.
        let ready = async {
            let _ = ctx.policies.wait_until_ready().await;
        };
        keep(
            admission_policies::CONTROLLER,
            &ctx.leader,
            &ctx.metrics,
            ready,
            || admission_policies::reconcile_admission_policies(&ctx),
            admission_policies::AdmissionPolicyError::kind,
            admission_changed,
            sd_rx.clone(),
        )
        .await;
    };
    tokio::join!(
        drain(node_controller),
        drain(orphan_controller),
        drain(policy_controller),
        report_controller,
        certs,
        templates,
        conditions,
        admission
    );
    finish(tasks, leader_task, health_task).await
}

async fn finish(
    tasks: Vec<tokio::task::JoinHandle<()>>,
    leader_task: Option<tokio::task::JoinHandle<()>>,
    health_task: tokio::task::JoinHandle<std::io::Result<()>>,
) -> Result<(), RunError> {
    for t in tasks {
        let _ = t.await;
    }
    if let Some(t) = leader_task {
        let _ = t.await;
    }
    match health_task.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => warn!(error = %e, "health server failed"),
        Err(e) => warn!(error = %e, "health server task failed"),
    }
    info!("stopped");
    Ok(())
}

/// Runs one reconcile, records its duration and outcome, and resets the object's backoff on
/// success.
async fn timed<E>(
    metrics: &Metrics,
    controller: &'static str,
    fut: impl Future<Output = Result<Action, E>>,
    kind: fn(&E) -> &'static str,
    backoffs: &Backoffs,
    key: &str,
) -> Result<Action, E> {
    let start = Instant::now();
    let result = fut.await;
    metrics.reconciled(controller, start.elapsed(), result.as_ref().err().map(kind));
    if result.is_ok() {
        backoffs.reset(key);
    }
    result
}

fn error_action(
    backoffs: &Backoffs,
    key: &str,
    permanent: bool,
    err: &dyn std::error::Error,
) -> Action {
    let chain = error_chain(err);
    if permanent {
        // Retrying cannot help; the next change to the object (or its inputs) will.
        warn!(object = key, error = %chain, "reconcile failed; waiting for a change");
        return Action::await_change();
    }
    let delay = backoffs.next(key);
    warn!(object = key, error = %chain, retry_in = ?delay, "reconcile failed; retrying");
    Action::requeue(delay)
}

/// Whether the API server serves ResourceClaimTemplates in `resource.k8s.io/v1`. Asked once
/// at start; an error counts as no (and is logged), since templates are only needed where a
/// webhook could point pods at them, and the webhook asks for itself.
async fn dra_served(client: &Client) -> bool {
    match client.list_api_group_resources("resource.k8s.io/v1").await {
        Ok(list) => list
            .resources
            .iter()
            .any(|r| r.name == "resourceclaimtemplates"),
        Err(kube::Error::Api(status)) if status.code == 404 => false,
        Err(e) => {
            warn!(error = %error_chain(&e), "discovery of resource.k8s.io/v1 failed; no ResourceClaimTemplates are kept until restart");
            false
        }
    }
}

/// The Pod watch the report keeper starts once a report kind is served: the API, the cache it
/// fills and where it sends the Pods whose inputs changed.
struct PodWatch {
    api: Api<Pod>,
    writer: Writer<Pod>,
    index: Arc<reports::PodIndex>,
    changes: mpsc::UnboundedSender<Pod>,
}

impl PodWatch {
    /// Starts the watch; it runs until shutdown.
    fn start(self, shutdown: watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
        // Only the name travels to the controller, which names it as the reconcile's reason.
        let namespace_of = |pod: &Pod| Pod {
            metadata: kube::api::ObjectMeta {
                name: pod.metadata.name.clone(),
                namespace: pod.metadata.namespace.clone(),
                ..Default::default()
            },
            ..Default::default()
        };
        let (changed, deleted) = (self.changes.clone(), self.changes);
        let (seen, gone) = (self.index.clone(), self.index);
        watch_kind(
            self.api,
            watcher::Config::default(),
            reports::trim_pod,
            self.writer,
            shutdown,
            route(
                reports::pod_inputs,
                move |p| {
                    seen.insert(p);
                    let _ = changed.send(namespace_of(p));
                },
                move |p| {
                    gone.remove(p);
                    let _ = deleted.send(namespace_of(p));
                },
            ),
        )
    }
}

/// Asks which report kinds the API server serves, at start and every few minutes, and says so
/// once per change: where none is, the operator writes no reports and keeps running. Once one
/// is, it starts the Pod watch (`pods`; `None` when reports are switched off) and, when its
/// cache is complete and on every check and leadership gain, lists the reports left behind
/// ([`reports::sweep`]) and wakes the report controller for every namespace (`all`).
async fn report_kinds_loop(
    ctx: Arc<ReportContext>,
    mut pods: Option<PodWatch>,
    all: mpsc::UnboundedSender<()>,
    shutdown: watch::Receiver<bool>,
) {
    if pods.is_none() {
        info!("PolicyReports are switched off (--policy-reports=false)");
        return;
    }
    let mut leadership = ctx.leader.clone();
    let mut known: Option<Vec<ReportKind>> = None;
    loop {
        let kinds = reports::discover_kinds(&ctx.client).await;
        if known.as_ref() != Some(&kinds) {
            if kinds.is_empty() {
                warn!(
                    "neither wgpolicyk8s.io/v1alpha2 PolicyReport nor openreports.io/v1alpha1 Report is served: no policy reports are written (checked again every {} s)",
                    reports::RECHECK.as_secs()
                );
            } else {
                let names: Vec<String> = kinds
                    .iter()
                    .map(|k| format!("{}/{}", k.api_version(), k.kind()))
                    .collect();
                info!(kinds = %names.join(", "), "writing one policy report per governed namespace");
            }
            if let Ok(mut k) = ctx.kinds.write() {
                k.clone_from(&kinds);
            }
            // A kind that appeared holds none of what was written in the others.
            ctx.forget_contents();
            known = Some(kinds.clone());
        }
        if !kinds.is_empty() {
            if let Some(watch) = pods.take() {
                watch.start(shutdown.clone());
                info!("watching Pods for policy reports");
                tokio::select! {
                    _ = ctx.pods.wait_until_ready() => {}
                    () = stopped(shutdown.clone()) => return,
                }
                ctx.pods_ready.store(true, Ordering::Release);
                info!(pods = ctx.pods.len(), "Pod cache synced");
            }
            if ctx.leader.is_leader() {
                if let Err(e) = reports::sweep(&ctx).await {
                    warn!(error = %error_chain(&e), "listing gpuwarden's reports failed; retrying at the next check");
                }
                let _ = all.send(());
            }
        }
        tokio::select! {
            () = tokio::time::sleep(reports::RECHECK) => {}
            changed = leadership.changed() => {
                match changed {
                    None => return,
                    // Another leader may have written since: every report is written again.
                    Some(true) => ctx.forget_contents(),
                    Some(false) => {}
                }
            }
            () = stopped(shutdown.clone()) => return,
        }
    }
}

/// Keeps gpuwarden's ResourceClaimTemplates: once its caches are complete, reconciles all of
/// them whenever something they depend on changes, on becoming the leader, after a failure
/// (with backoff), and every ten minutes.
async fn template_loop(
    ctx: TemplateContext,
    wake: mpsc::UnboundedReceiver<()>,
    shutdown: watch::Receiver<bool>,
) {
    let ready = async {
        let _ = ctx.policies.wait_until_ready().await;
        let _ = ctx.namespaces.wait_until_ready().await;
        let _ = ctx.templates.wait_until_ready().await;
    };
    keep(
        claim_templates::CONTROLLER,
        &ctx.leader,
        &ctx.metrics,
        ready,
        || async { claim_templates::reconcile_templates(&ctx).await.map(|_| ()) },
        claim_templates::TemplateError::kind,
        wake,
        shutdown,
    )
    .await;
}

/// Keeps one whole set of objects (`pass` reconciles it): once `ready` resolves, then
/// whenever `wake` fires (a burst of changes is one pass), on becoming the leader, after a
/// failure (with backoff), and every ten minutes.
#[allow(clippy::too_many_arguments, reason = "one loop serves every keeper")]
async fn keep<E, F, Fut>(
    controller: &'static str,
    leader: &Leadership,
    metrics: &Metrics,
    ready: impl Future<Output = ()>,
    mut pass: F,
    kind: fn(&E) -> &'static str,
    mut wake: mpsc::UnboundedReceiver<()>,
    shutdown: watch::Receiver<bool>,
) where
    E: std::error::Error + 'static,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), E>>,
{
    tokio::select! {
        () = ready => {}
        () = stopped(shutdown.clone()) => return,
    }
    let mut leadership = leader.clone();
    let backoffs = Backoffs::default();
    loop {
        let start = Instant::now();
        let wait = match pass().await {
            Ok(()) => {
                metrics.reconciled(controller, start.elapsed(), None);
                backoffs.reset(controller);
                Duration::from_secs(600)
            }
            Err(e) => {
                metrics.reconciled(controller, start.elapsed(), Some(kind(&e)));
                let delay = backoffs.next(controller);
                warn!(controller, error = %error_chain(&e), retry_in = ?delay, "sync failed");
                delay
            }
        };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            woken = wake.recv() => {
                if woken.is_none() {
                    return;
                }
                // A burst of changes is one reconcile.
                tokio::time::sleep(Duration::from_millis(200)).await;
                while wake.try_recv().is_ok() {}
            }
            changed = leadership.changed() => {
                if changed.is_none() {
                    return;
                }
            }
            () = stopped(shutdown.clone()) => return,
        }
    }
}

/// Keeps the webhook's certificates: a pass when they are due, when the webhook
/// configuration changes (`wake`), on becoming the leader, and after a failure (with backoff).
async fn cert_loop(
    ctx: CertContext,
    mut wake: mpsc::UnboundedReceiver<()>,
    shutdown: watch::Receiver<bool>,
) {
    let mut leadership = ctx.leader.clone();
    let backoffs = Backoffs::default();
    loop {
        let wait = if ctx.leader.is_leader() {
            let start = Instant::now();
            match webhook_certs::reconcile_certificates(&ctx).await {
                Ok(next) => {
                    ctx.metrics
                        .reconciled(webhook_certs::CONTROLLER, start.elapsed(), None);
                    backoffs.reset("certs");
                    let left = next.duration_since((ctx.clock)());
                    Duration::try_from(left)
                        .unwrap_or_default()
                        .max(Duration::from_secs(1))
                }
                Err(e) => {
                    ctx.metrics.reconciled(
                        webhook_certs::CONTROLLER,
                        start.elapsed(),
                        Some(e.kind()),
                    );
                    let delay = backoffs.next("certs");
                    warn!(error = %error_chain(&e), retry_in = ?delay, "webhook certificate sync failed");
                    delay
                }
            }
        } else {
            webhook_certs::MAX_RECHECK
        };
        debug!(?wait, "next webhook certificate check");
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            woken = wake.recv() => {
                if woken.is_none() {
                    return;
                }
                // A re-applied configuration may come as a create and a few updates.
                tokio::time::sleep(Duration::from_millis(200)).await;
                while wake.try_recv().is_ok() {}
            }
            changed = leadership.changed() => {
                if changed.is_none() {
                    return;
                }
            }
            () = stopped(shutdown.clone()) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("boom")]
    struct Boom;

    #[test]
    fn backoff_doubles_per_object_caps_and_resets_on_success() {
        let b = Backoffs::default();
        let delays: Vec<u64> = (0..11).map(|_| b.next("a").as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        // Another object has its own backoff.
        assert_eq!(b.next("b"), Duration::from_secs(1));
        b.reset("a");
        assert_eq!(b.next("a"), Duration::from_secs(1));
    }

    #[test]
    fn invalid_objects_wait_for_a_change_transient_errors_requeue() {
        let b = Backoffs::default();
        assert_eq!(error_action(&b, "x", true, &Boom), Action::await_change());
        assert_eq!(
            error_action(&b, "x", false, &Boom),
            Action::requeue(Duration::from_secs(1))
        );
        assert_eq!(
            error_action(&b, "x", false, &Boom),
            Action::requeue(Duration::from_secs(2))
        );
    }

    #[test]
    fn own_status_writes_and_renewals_do_not_change_the_inputs() {
        let mut gn = GpuNode::new(
            "n",
            gpuwarden_crds::GpuNodeSpec {
                node_name: "n".into(),
            },
        );
        gn.status = Some(gpuwarden_crds::GpuNodeStatus::default());
        let before = gpunode_inputs(&gn);
        if let Some(s) = gn.status.as_mut() {
            s.summary = Some(gpuwarden_crds::GpuNodeSummary::default());
            s.conditions = Some(vec![]);
        }
        assert_eq!(
            gpunode_inputs(&gn),
            before,
            "operator fields are not inputs"
        );
        if let Some(s) = gn.status.as_mut() {
            s.gpus = Some(vec![]);
        }
        assert_ne!(gpunode_inputs(&gn), before, "agent fields are");

        let clock: Clock = Arc::new(|| jiff::Timestamp::from_second(1000).unwrap_or_default());
        let mut lease = Lease::default();
        let spec = |renew: i64| k8s_openapi::api::coordination::v1::LeaseSpec {
            holder_identity: Some("agent".into()),
            lease_duration_seconds: Some(40),
            renew_time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
                jiff::Timestamp::from_second(renew).unwrap_or_default(),
            )),
            ..Default::default()
        };
        lease.spec = Some(spec(990));
        let live = lease_inputs(&lease, &clock);
        lease.spec = Some(spec(995));
        assert_eq!(
            lease_inputs(&lease, &clock),
            live,
            "renewal of a live Lease"
        );
        lease.spec = Some(spec(900));
        assert_ne!(lease_inputs(&lease, &clock), live, "expired");

        let mut node = Node {
            status: Some(NodeStatus::default()),
            ..Default::default()
        };
        let before = node_inputs(&node);
        node.metadata.resource_version = Some("99".into());
        node.metadata.annotations = Some([("heartbeat".to_owned(), "x".to_owned())].into());
        assert_eq!(node_inputs(&node), before, "heartbeats are not inputs");
    }
}
