//! The GpuNode reconciler: reads a node's Node, GpuNode and agent Lease from the caches,
//! computes (with [`crate::gpunode`]) what should exist, and writes only the difference.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, Stream};
use gpuwarden_crds::{
    AGENT_LEASE_PREFIX, FIELD_MANAGER_OPERATOR, GpuNode, GpuNodeSpec, TAINT_GPU_UNHEALTHY,
    agent_lease_name,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use std::future::Future;
use tracing::{debug, info, warn};

use crate::feeds::Feeds;
use crate::gpunode::{self, Lifecycle, Transition};
use crate::metrics::Metrics;
use crate::wiring::{Feed, Part, Reconciles, Shared, drain, hash_of, leader_gained};
use crate::{Clock, Leadership};

/// Controller name in metrics and logs.
pub const CONTROLLER: &str = "gpunode";

/// A GpuNode reconcile that failed.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// An API call failed.
    #[error("failed to {action} for node {node}")]
    Api {
        /// What was being done.
        action: &'static str,
        /// The node.
        node: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// A value could not be serialised for the API.
    #[error("failed to encode {what} for node {node}")]
    Encode {
        /// What was being encoded.
        what: &'static str,
        /// The node.
        node: String,
        /// The serde error.
        #[source]
        source: serde_json::Error,
    },
}

impl NodeError {
    /// A bounded label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Api { source, .. } => crate::api_error_kind(source),
            Self::Encode { .. } => "encode",
        }
    }

    /// Whether retrying without a change to the object cannot help. Forbidden is not
    /// permanent: fixing RBAC changes no watched object, so it is retried with backoff.
    pub fn is_permanent(&self) -> bool {
        matches!(self.kind(), "invalid" | "encode")
    }
}

/// What the GpuNode reconciler needs: caches, a client, the clock and leadership.
pub struct NodeContext {
    /// API client.
    pub client: Client,
    /// Node cache (trimmed to the fields the operator reads).
    pub nodes: Store<Node>,
    /// GpuNode cache.
    pub gpunodes: Store<GpuNode>,
    /// Agent Lease cache.
    pub leases: Store<Lease>,
    /// The agents' Lease namespace: gpuwarden's own.
    pub lease_namespace: String,
    /// Current time; tests inject their own.
    pub clock: Clock,
    /// Whether this replica may write.
    pub leader: Leadership,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Event recorder; `None` disables Events.
    pub recorder: Option<Recorder>,
    /// Put [`TAINT_GPU_UNHEALTHY`] on nodes while `Healthy=False`.
    pub taint_unhealthy_nodes: bool,
}

/// Whether a cache has finished its first list. Reads that decide deletions must never run
/// against a cache that is still empty because it has not synced.
pub fn synced<K: kube::runtime::reflector::Lookup + Clone + 'static>(store: &Store<K>) -> bool
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    matches!(store.wait_until_ready().now_or_never(), Some(Ok(())))
}

fn api_err(action: &'static str, node: &str) -> impl FnOnce(kube::Error) -> NodeError {
    let node = node.to_owned();
    move |source| NodeError::Api {
        action,
        node,
        source,
    }
}

/// Reconciles the GpuNode of node `name`: create, update status, or delete.
#[tracing::instrument(skip(ctx), fields(node = %name))]
pub async fn reconcile_node(name: &str, ctx: &NodeContext) -> Result<Action, NodeError> {
    if !ctx.leader.is_leader() {
        // A standby keeps its caches warm; it reconciles everything when it becomes leader.
        return Ok(Action::await_change());
    }
    if !(synced(&ctx.nodes) && synced(&ctx.gpunodes) && synced(&ctx.leases)) {
        debug!("caches not synced yet; not deciding anything");
        return Ok(Action::requeue(Duration::from_secs(2)));
    }
    let now = (ctx.clock)();
    let node = ctx.nodes.get(&ObjectRef::new(name));
    let current = ctx.gpunodes.get(&ObjectRef::new(name));
    let lease = ctx
        .leases
        .get(&ObjectRef::new(&agent_lease_name(name)).within(&ctx.lease_namespace));
    let liveness = gpunode::agent_liveness(lease.as_deref(), now);
    match gpunode::lifecycle(node.as_deref(), &liveness) {
        lifecycle @ (Lifecycle::RemoveNodeGone | Lifecycle::RemoveNoGpus) => {
            if let Some(gn) = current.filter(|g| g.metadata.deletion_timestamp.is_none()) {
                info!(reason = ?lifecycle, "deleting GpuNode");
                delete_gpunode(ctx, name, &gn).await?;
            }
            if let Some(node) = node.as_deref()
                && ctx.taint_unhealthy_nodes
            {
                sync_taint(ctx, node, false).await?;
            }
            Ok(Action::await_change())
        }
        Lifecycle::Keep(signal) => {
            let Some(node) = node else {
                return Ok(Action::await_change());
            };
            let gn = match current {
                Some(gn) if gpunode_matches(&gn, &node) => gn,
                _ => {
                    debug!(?signal, "applying GpuNode");
                    apply_gpunode(ctx, &node).await?
                }
            };
            let conditions = keep_status(ctx, &gn, &node, &liveness, now).await?;
            (ctx.metrics).set_node_conditions(
                name,
                (conditions.iter()).map(|c| (c.type_.as_str(), c.status.as_str())),
            );
            if ctx.taint_unhealthy_nodes {
                sync_taint(ctx, &node, gpunode::wants_unhealthy_taint(&conditions)).await?;
            }
            Ok(gpunode::requeue_after(&liveness, now)
                .map_or_else(Action::await_change, Action::requeue))
        }
    }
}

/// Deletes the GpuNode `gn` of node `name`, if it is still the object read.
async fn delete_gpunode(ctx: &NodeContext, name: &str, gn: &GpuNode) -> Result<(), NodeError> {
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            uid: gn.metadata.uid.clone(),
            resource_version: None,
        }),
        ..Default::default()
    };
    ctx.metrics.forget_node(name, &gpunode::CONDITION_TYPES);
    match Api::<GpuNode>::all(ctx.client.clone())
        .delete(name, &dp)
        .await
    {
        Ok(_) => ctx.metrics.write(CONTROLLER, "delete"),
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
        Err(e) => return Err(api_err("delete GpuNode", name)(e)),
    }
    Ok(())
}

/// Applies the GpuNode of `node` (its spec and the operator's metadata).
async fn apply_gpunode(ctx: &NodeContext, node: &Node) -> Result<Arc<GpuNode>, NodeError> {
    let name = node.name_any();
    let applied = Api::<GpuNode>::all(ctx.client.clone())
        .patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER_OPERATOR).force(),
            &Patch::Apply(desired_gpunode(node)),
        )
        .await
        .map_err(api_err("apply GpuNode", &name))?;
    ctx.metrics.write(CONTROLLER, "apply");
    Ok(Arc::new(applied))
}

/// Writes `gn`'s conditions and summary where they differ from what they should be, with
/// an Event per transition; returns the conditions it now has.
async fn keep_status(
    ctx: &NodeContext,
    gn: &GpuNode,
    node: &Node,
    liveness: &gpunode::AgentLiveness,
    now: jiff::Timestamp,
) -> Result<Vec<Condition>, NodeError> {
    let desired = gpunode::desired_conditions(gn.status.as_ref(), liveness);
    let summary = gpunode::summary(gn.status.as_ref(), Some(node));
    let plan = gpunode::plan_status(gn.status.as_ref(), &desired, summary, now);
    let Some(status) = plan.apply else {
        return Ok((gn.status.as_ref())
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default());
    };
    let name = gn.name_any();
    // No summary when neither the agent nor the Node says how many GPUs: leaving it out of
    // the apply removes it, so a silent agent never reads as "0 GPUs".
    let mut fields = serde_json::Map::new();
    fields.insert("conditions".into(), json!(status.conditions));
    if let Some(summary) = &status.summary {
        fields.insert("summary".into(), json!(summary));
    }
    let body = json!({
        "apiVersion": GpuNode::api_version(&()),
        "kind": GpuNode::kind(&()),
        "metadata": { "name": name },
        "status": fields,
    });
    Api::<GpuNode>::all(ctx.client.clone())
        .patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER_OPERATOR).force(),
            &Patch::Apply(body),
        )
        .await
        .map_err(api_err("apply GpuNode status", &name))?;
    ctx.metrics.write(CONTROLLER, "status");
    publish_transitions(ctx, gn, &plan.transitions).await;
    Ok(status.conditions)
}

/// The GpuNode the operator owns the spec and metadata of.
pub fn desired_gpunode(node: &Node) -> GpuNode {
    let name = node.name_any();
    let mut gn = GpuNode::new(
        &name,
        GpuNodeSpec {
            node_name: name.clone(),
        },
    );
    gn.metadata.labels = Some(BTreeMap::from([(
        "app.kubernetes.io/managed-by".to_owned(),
        FIELD_MANAGER_OPERATOR.to_owned(),
    )]));
    // Owned by the Node, so deleting the node deletes its GpuNode even when the operator is down.
    gn.metadata.owner_references = node.controller_owner_ref(&()).map(|mut o| {
        o.block_owner_deletion = Some(false);
        vec![o]
    });
    gn
}

/// Whether an existing GpuNode already has the spec and owner reference it should have.
fn gpunode_matches(gn: &GpuNode, node: &Node) -> bool {
    let uid = node.metadata.uid.as_deref();
    gn.spec.node_name == node.name_any()
        && gn
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.kind == "Node" && Some(o.uid.as_str()) == uid)
}

async fn publish_transitions(ctx: &NodeContext, gn: &GpuNode, transitions: &[Transition]) {
    let Some(recorder) = &ctx.recorder else {
        return;
    };
    let reference = gn.object_ref(&());
    for t in transitions {
        // A condition appearing as True on a new GpuNode is not news.
        if t.from.is_none() && t.to == "True" {
            continue;
        }
        let ev = Event {
            type_: if t.to == "True" {
                EventType::Normal
            } else {
                EventType::Warning
            },
            reason: t.reason.clone(),
            note: Some(
                format!(
                    "{} {} -> {}: {}",
                    t.type_,
                    t.from.as_deref().unwrap_or("(none)"),
                    t.to,
                    t.message
                )
                .chars()
                .take(1000)
                .collect(),
            ),
            action: format!("{}Changed", t.type_),
            secondary: None,
        };
        // Events are best effort: a failure to publish must not fail the status update.
        match recorder.publish(&ev, &reference).await {
            Ok(()) => ctx.metrics.write(CONTROLLER, "event"),
            Err(e) => warn!(error = %e, "failed to publish event"),
        }
    }
}

/// Adds or removes [`TAINT_GPU_UNHEALTHY`] with a JSON patch guarded by a `test` of the
/// current taints, so a concurrent change by someone else makes it fail instead of losing it.
async fn sync_taint(ctx: &NodeContext, node: &Node, want: bool) -> Result<(), NodeError> {
    let name = node.name_any();
    let taints: Vec<Taint> = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    let has = taints.iter().any(|t| t.key == TAINT_GPU_UNHEALTHY);
    if has == want {
        return Ok(());
    }
    let mut next: Vec<Taint> = taints
        .iter()
        .filter(|t| t.key != TAINT_GPU_UNHEALTHY)
        .cloned()
        .collect();
    if want {
        next.push(Taint {
            key: TAINT_GPU_UNHEALTHY.to_owned(),
            effect: "NoSchedule".to_owned(),
            value: None,
            time_added: None,
        });
    }
    let encode = |source| NodeError::Encode {
        what: "taint patch",
        node: name.clone(),
        source,
    };
    let ops = if node.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some() {
        json!([
            { "op": "test", "path": "/spec/taints", "value": serde_json::to_value(&taints).map_err(encode)? },
            { "op": "replace", "path": "/spec/taints", "value": serde_json::to_value(&next).map_err(encode)? },
        ])
    } else {
        json!([{ "op": "add", "path": "/spec/taints", "value": serde_json::to_value(&next).map_err(encode)? }])
    };
    let patch: json_patch_ops::Ops = serde_json::from_value(ops).map_err(encode)?;
    let api: Api<Node> = Api::all(ctx.client.clone());
    api.patch(&name, &PatchParams::default(), &Patch::Json::<()>(patch.0))
        .await
        .map_err(api_err("patch node taints", &name))?;
    ctx.metrics.write(CONTROLLER, "taint");
    info!(
        taint = want,
        "node taint {}",
        if want { "added" } else { "removed" }
    );
    Ok(())
}

/// What the reconciler reads from an agent Lease: holder, duration and whether it is live
/// now. A renewal of a live Lease changes none of these; expiry is caught by a timed requeue.
fn lease_inputs(lease: &Lease, clock: &Clock) -> u64 {
    let spec = lease.spec.as_ref();
    hash_of(&(
        spec.and_then(|s| s.holder_identity.as_deref()),
        spec.and_then(|s| s.lease_duration_seconds),
        gpunode::agent_liveness(Some(lease), clock()).is_live(),
    ))
}

/// The GpuNode controllers: one runs on Nodes, and wakes for their GpuNodes and agent Leases
/// (watched here, in `namespace`); the orphan controller runs on GpuNodes, and wakes when
/// their Node goes. Both reconcile everything on becoming the leader.
pub fn wire(
    shared: &Shared,
    feeds: &mut Feeds,
    namespace: &str,
    identity: &str,
    taint_unhealthy_nodes: bool,
) -> Part {
    let mut leases = Feed::<Lease>::new({
        let clock = shared.clock.clone();
        move |l| lease_inputs(l, &clock)
    });
    let lease_changes = leases.trigger(true);
    let recorder = Recorder::new(
        shared.client.clone(),
        Reporter {
            controller: gpuwarden_crds::install::OPERATOR_NAME.to_owned(),
            instance: Some(identity.to_owned()),
        },
    );
    let ctx = Arc::new(NodeContext {
        client: shared.client.clone(),
        nodes: feeds.nodes.store(),
        gpunodes: feeds.gpunodes.store(),
        leases: leases.store(),
        lease_namespace: namespace.to_owned(),
        clock: shared.clock.clone(),
        leader: shared.leadership.clone(),
        metrics: shared.metrics.clone(),
        recorder: Some(recorder),
        taint_unhealthy_nodes,
    });
    let reconciles = Reconciles::new(CONTROLLER, NodeError::kind, NodeError::is_permanent);
    let nodes = nodes_controller(shared, feeds, &ctx, lease_changes, reconciles.clone());
    let orphans = orphans_controller(shared, feeds, &ctx, reconciles);
    let lease_store = ctx.leases.clone();
    Part {
        name: CONTROLLER,
        watches: vec![leases.start(
            Api::<Lease>::namespaced(shared.client.clone(), namespace),
            watcher::Config::default(),
            |l| l.metadata.managed_fields = None,
            &shared.shutdown,
        )],
        synced: async move {
            let _ = lease_store.wait_until_ready().await;
        }
        .boxed(),
        run: async move {
            tokio::join!(nodes, orphans);
        }
        .boxed(),
    }
}

/// The controller on Nodes, woken by their GpuNodes and agent Leases (`lease_changes`).
fn nodes_controller(
    shared: &Shared,
    feeds: &mut Feeds,
    ctx: &Arc<NodeContext>,
    lease_changes: impl Stream<Item = Result<Lease, watcher::Error>> + Send + 'static,
    reconciles: Reconciles<NodeError>,
) -> impl Future<Output = ()> + Send + 'static {
    let controller = Controller::for_stream(feeds.nodes.trigger(false), ctx.nodes.clone())
        .watches_stream(feeds.gpunodes.trigger(true), |g: GpuNode| {
            Some(ObjectRef::<Node>::new(&g.name_any()))
        })
        .watches_stream(lease_changes, |l: Lease| {
            let name = l.name_any();
            (name.strip_prefix(AGENT_LEASE_PREFIX)).map(ObjectRef::<Node>::new)
        })
        .reconcile_all_on(leader_gained(shared.leadership.clone()))
        .with_config(shared.controller_config.clone())
        .graceful_shutdown_on(shared.shutdown.stopped())
        .run(
            {
                let reconciles = reconciles.clone();
                move |node: Arc<Node>, ctx: Arc<NodeContext>| {
                    let reconciles = reconciles.clone();
                    async move { reconcile_timed(&reconciles, node.name_any(), &ctx).await }
                }
            },
            {
                let reconciles = reconciles.clone();
                move |node: Arc<Node>, err: &NodeError, _| {
                    reconciles.error_action(&node.name_any(), err)
                }
            },
            ctx.clone(),
        );
    drain(controller)
}

/// The controller on GpuNodes whose Node is gone, woken when a Node is deleted.
fn orphans_controller(
    shared: &Shared,
    feeds: &mut Feeds,
    ctx: &Arc<NodeContext>,
    reconciles: Reconciles<NodeError>,
) -> impl Future<Output = ()> + Send + 'static {
    let controller = Controller::for_stream(feeds.gpunodes.trigger(false), ctx.gpunodes.clone())
        .watches_stream(feeds.nodes.deletions(), |n: Node| {
            Some(ObjectRef::<GpuNode>::new(&n.name_any()))
        })
        .reconcile_all_on(leader_gained(shared.leadership.clone()))
        .with_config(shared.controller_config.clone())
        .graceful_shutdown_on(shared.shutdown.stopped())
        .run(
            {
                let reconciles = reconciles.clone();
                move |gn: Arc<GpuNode>, ctx: Arc<NodeContext>| {
                    let reconciles = reconciles.clone();
                    async move {
                        let name = gn.name_any();
                        if ctx.nodes.get(&ObjectRef::new(&name)).is_some() {
                            // The node controller owns GpuNodes whose Node exists.
                            return Ok(Action::await_change());
                        }
                        reconcile_timed(&reconciles, name, &ctx).await
                    }
                }
            },
            move |gn: Arc<GpuNode>, err: &NodeError, _| {
                reconciles.error_action(&gn.name_any(), err)
            },
            ctx.clone(),
        );
    drain(controller)
}

/// [`reconcile_node`] of `name`, timed and counted.
async fn reconcile_timed(
    reconciles: &Reconciles<NodeError>,
    name: String,
    ctx: &NodeContext,
) -> Result<Action, NodeError> {
    (reconciles.timed(&ctx.metrics, &name, reconcile_node(&name, ctx))).await
}

mod json_patch_ops {
    //! kube's `Patch::Json` takes a `json_patch::Patch`; it deserialises from the RFC 6902
    //! operation list.
    #[derive(serde::Deserialize)]
    #[serde(transparent)]
    pub struct Ops(pub json_patch::Patch);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_renewal_of_a_live_lease_is_not_an_input_its_expiry_is() {
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
    }
}
