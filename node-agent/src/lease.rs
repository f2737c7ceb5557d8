//! The agent's liveness Lease, renewed like the kubelet's node lease: the operator reads
//! `renewTime` to tell a silent agent from a node with no GPUs.

use std::time::Duration;

use gpuwarden_crds::{FIELD_MANAGER_NODE_AGENT, agent_lease_name};
use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::Api;
use kube::api::{Patch, PatchParams};

/// How long a Lease stays valid without renewal (the kubelet's node lease uses 40 s).
pub const LEASE_DURATION_SECONDS: i32 = 40;
/// How often the agent renews it (a quarter of the duration, like the kubelet).
pub const RENEW_INTERVAL: Duration = Duration::from_secs(10);

/// Errors renewing the Lease.
#[derive(Debug, thiserror::Error)]
#[error("failed to renew Lease {namespace}/{name}")]
pub struct LeaseError {
    namespace: String,
    name: String,
    #[source]
    source: Box<kube::Error>,
}

/// The apply body of the Lease for `node` in `namespace` (the agent's own).
pub fn lease_body(
    namespace: &str,
    node: &str,
    acquired: Timestamp,
    now: Timestamp,
) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": agent_lease_name(node),
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/name": gpuwarden_crds::install::NODE_AGENT_NAME,
                "app.kubernetes.io/part-of": "gpuwarden",
            },
        },
        "spec": {
            "holderIdentity": node,
            "leaseDurationSeconds": LEASE_DURATION_SECONDS,
            "acquireTime": MicroTime(acquired),
            "renewTime": MicroTime(now),
        },
    })
}

/// Renews one node's Lease.
pub struct LeaseKeeper {
    api: Api<Lease>,
    namespace: String,
    node: String,
    acquired: Timestamp,
}

impl LeaseKeeper {
    /// A keeper for `node`'s Lease in `namespace`; `acquired` is when this agent started
    /// holding it.
    pub fn new(client: kube::Client, namespace: &str, node: &str, acquired: Timestamp) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_owned(),
            node: node.to_owned(),
            acquired,
        }
    }

    /// Creates or renews the Lease at `now`.
    pub async fn renew(&self, now: Timestamp) -> Result<(), LeaseError> {
        let name = agent_lease_name(&self.node);
        self.api
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER_NODE_AGENT).force(),
                &Patch::Apply(lease_body(&self.namespace, &self.node, self.acquired, now)),
            )
            .await
            .map(|_| ())
            .map_err(|e| LeaseError {
                namespace: self.namespace.clone(),
                name,
                source: Box::new(e),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_body_is_a_valid_lease() {
        let t0 = Timestamp::from_second(1_700_000_000).unwrap();
        let now = Timestamp::from_microsecond(1_700_000_010_123_456).unwrap();
        let body = lease_body("gpu-guard", "gpu-node-1", t0, now);
        assert_eq!(body["spec"]["renewTime"], "2023-11-14T22:13:30.123456Z");
        let lease: Lease = serde_json::from_value(body).unwrap();
        let spec = lease.spec.unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some("gpu-node-1"));
        assert_eq!(spec.lease_duration_seconds, Some(40));
        assert_eq!(spec.renew_time.unwrap().0, now);
        assert_eq!(spec.acquire_time.unwrap().0, t0);
        assert_eq!(
            lease.metadata.name.as_deref(),
            Some("gpuwarden-agent-gpu-node-1")
        );
        assert_eq!(lease.metadata.namespace.as_deref(), Some("gpu-guard"));
    }
}
