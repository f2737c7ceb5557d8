//! The kinds several controllers read, one [`Feed`] each, with what their readers read of an
//! object (so that the operator's own writes, heartbeats and Lease renewals wake nobody) and
//! what the cache keeps of it.

use gpuwarden_crds::{GpuNode, GpuPolicy, TAINT_GPU_UNHEALTHY};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Namespace, Node, NodeSpec, NodeStatus};
use kube::api::PartialObjectMeta;
use kube::runtime::watcher;
use kube::{Api, Client};

use crate::gpunode::node_gpu_signal;
use crate::wiring::{Feed, Shutdown, hash_of};

/// The shared kinds. Controllers add their listeners while the operator is wired; then
/// [`Feeds::start`] watches them all.
pub struct Feeds {
    /// Nodes, trimmed to what the operator reads ([`trim_node`]).
    pub nodes: Feed<Node>,
    /// GpuNodes.
    pub gpunodes: Feed<GpuNode>,
    /// GpuPolicies.
    pub policies: Feed<GpuPolicy>,
    /// Namespaces' metadata: their labels choose the policy.
    pub namespaces: Feed<PartialObjectMeta<Namespace>>,
    /// gpuwarden's one MutatingWebhookConfiguration; its store only feeds the listeners.
    pub webhook_configuration: Feed<MutatingWebhookConfiguration>,
}

impl Default for Feeds {
    fn default() -> Self {
        Self {
            nodes: Feed::new(node_inputs),
            gpunodes: Feed::new(gpunode_inputs),
            policies: Feed::new(policy_inputs),
            namespaces: Feed::new(namespace_inputs),
            webhook_configuration: Feed::new(webhook_configuration_inputs),
        }
    }
}

impl Feeds {
    /// Watches every shared kind until shutdown.
    pub fn start(self, client: &Client, shutdown: &Shutdown) -> Vec<tokio::task::JoinHandle<()>> {
        let all = watcher::Config::default;
        vec![
            (self.nodes).start(Api::<Node>::all(client.clone()), all(), trim_node, shutdown),
            (self.gpunodes).start(
                Api::<GpuNode>::all(client.clone()),
                all(),
                trim_gpunode,
                shutdown,
            ),
            (self.policies).start(
                Api::<GpuPolicy>::all(client.clone()),
                all(),
                |p| p.metadata.managed_fields = None,
                shutdown,
            ),
            (self.namespaces).start(
                Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
                all(),
                |ns| {
                    ns.metadata.managed_fields = None;
                    ns.metadata.annotations = None;
                },
                shutdown,
            ),
            // The watch is on that one object: a field selector, which is also what lets
            // RBAC pin list and watch to its name.
            (self.webhook_configuration).start(
                Api::<MutatingWebhookConfiguration>::all(client.clone()),
                all().fields(&format!(
                    "metadata.name={}",
                    gpuwarden_crds::install::MUTATING_WEBHOOK_CONFIGURATION
                )),
                |mwc| mwc.metadata.managed_fields = None,
                shutdown,
            ),
        ]
    }
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

/// A policy's readers read its spec: its generation stands for it.
fn policy_inputs(p: &GpuPolicy) -> u64 {
    hash_of(&(
        p.metadata.generation,
        p.metadata.uid.as_deref(),
        p.metadata.deletion_timestamp.is_some(),
    ))
}

/// A namespace's labels choose its policy.
fn namespace_inputs(ns: &PartialObjectMeta<Namespace>) -> u64 {
    hash_of(&(
        &ns.metadata.labels,
        ns.metadata.deletion_timestamp.is_some(),
    ))
}

/// What the certificate and condition keepers read of the webhook configuration: which
/// object it is, each webhook's `caBundle` and its `matchConditions`. A configuration
/// re-created from the manifests, or one whose bundle or conditions someone changed, wakes
/// them; a label edit does not.
fn webhook_configuration_inputs(mwc: &MutatingWebhookConfiguration) -> u64 {
    let webhooks: Vec<_> = (mwc.webhooks.iter().flatten())
        .map(|w| {
            let bundle = (w.client_config.ca_bundle.as_ref()).map(|b| b.0.as_slice());
            let conditions: Vec<_> = (w.match_conditions.iter().flatten())
                .map(|c| (c.name.as_str(), c.expression.as_str()))
                .collect();
            (w.name.as_str(), bundle, conditions)
        })
        .collect();
    hash_of(&(&mwc.metadata.uid, webhooks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_status_writes_and_heartbeats_do_not_change_the_inputs() {
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

        let mut node = Node {
            status: Some(NodeStatus::default()),
            ..Default::default()
        };
        let before = node_inputs(&node);
        node.metadata.resource_version = Some("99".into());
        node.metadata.annotations = Some([("heartbeat".to_owned(), "x".to_owned())].into());
        assert_eq!(node_inputs(&node), before, "heartbeats are not inputs");
    }

    #[test]
    fn a_webhook_configuration_wakes_its_keepers_on_bundles_and_conditions_only() {
        let mwc = |bundle: &[u8], label: &str| -> MutatingWebhookConfiguration {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "gpuwarden", "uid": "u", "labels": {"l": label}},
                "webhooks": [{"name": "pods.gpuwarden.io", "admissionReviewVersions": ["v1"],
                    "sideEffects": "None",
                    "clientConfig": {"caBundle": k8s_openapi::ByteString(bundle.to_vec())},
                    "matchConditions": [{"name": "c", "expression": "true"}]}]
            }))
            .expect("a configuration")
        };
        let before = webhook_configuration_inputs(&mwc(b"a", "x"));
        assert_eq!(webhook_configuration_inputs(&mwc(b"a", "y")), before);
        assert_ne!(webhook_configuration_inputs(&mwc(b"b", "x")), before);
    }
}
