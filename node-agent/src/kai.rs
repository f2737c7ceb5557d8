//! KAI-Scheduler's GPU fractions on this node (docs/design.md, "GPU-sharing schedulers").
//!
//! A fraction container holds no GPU of the kubelet's: KAI's reservation pod, in KAI's own
//! namespace, holds the whole GPU, and the container reads its UUID from a ConfigMap. Its
//! processes on that GPU are sanctioned only where the policy that governs the pod names KAI,
//! and only on a GPU that the kubelet allocated to a reservation pod of a GPU group that
//! the pod's BindRequest names. The pod's own labels and annotations, which its author
//! writes, decide nothing; BindRequests are written by KAI's scheduler and binder alone
//! (tenants need no write on them), reservation pods live in KAI's namespace, and
//! pod-resources is the kubelet's word.

use std::collections::BTreeMap;

use gpuwarden_crds::sharing::bind_request;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::Value;

/// KAI's BindRequest, for a dynamic API.
pub fn bind_request_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(
            bind_request::GROUP,
            bind_request::VERSION,
            bind_request::KIND,
        ),
        bind_request::PLURAL,
    )
}

/// The GPU groups KAI bound each fraction pod on this node to, by pod UID, from the
/// BindRequests that say so.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KaiBinds(BTreeMap<String, Bound>);

/// One pod's bind: where its BindRequest is, and the groups it names.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Bound {
    namespace: String,
    groups: Vec<String>,
}

impl KaiBinds {
    /// The binds that `requests` record for `node`: a BindRequest that succeeded, for a
    /// fraction, on this node, owned by its pod (by UID). Anything else (another node, a
    /// whole-GPU bind, one still pending or failed, one without its pod as owner) binds
    /// nothing.
    pub fn from_requests<'a>(
        requests: impl IntoIterator<Item = &'a DynamicObject>,
        node: &str,
    ) -> Self {
        let mut binds = BTreeMap::new();
        for request in requests {
            let text = |v: &Value, key: &str| v.get(key).and_then(Value::as_str).map(str::to_owned);
            let spec = request.data.get("spec").unwrap_or(&Value::Null);
            let status = request.data.get("status").unwrap_or(&Value::Null);
            if text(spec, "selectedNode").as_deref() != Some(node)
                || text(spec, "receivedResourceType").as_deref() != Some("Fraction")
                || text(status, "phase").as_deref() != Some("Succeeded")
            {
                continue;
            }
            let groups: Vec<String> = (spec.get("selectedGPUGroups").and_then(Value::as_array))
                .into_iter()
                .flatten()
                .filter_map(|g| g.as_str().map(str::to_owned))
                .collect();
            let namespace = request.metadata.namespace.clone().unwrap_or_default();
            for owner in request.metadata.owner_references.iter().flatten() {
                if owner.kind == "Pod" && owner.api_version == "v1" && !groups.is_empty() {
                    binds.insert(
                        owner.uid.clone(),
                        Bound {
                            namespace: namespace.clone(),
                            groups: groups.clone(),
                        },
                    );
                }
            }
        }
        Self(binds)
    }

    /// The GPU groups KAI bound the pod with `uid` in `namespace` to.
    pub fn groups(&self, uid: &str, namespace: &str) -> &[String] {
        (self.0.get(uid))
            .filter(|b| b.namespace == namespace)
            .map_or(&[], |b| b.groups.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn request(value: Value) -> DynamicObject {
        serde_json::from_value(value).expect("a BindRequest")
    }

    fn bound(node: &str, kind: &str, phase: &str) -> DynamicObject {
        request(json!({
            "apiVersion": "scheduling.run.ai/v1alpha2", "kind": "BindRequest",
            "metadata": {"name": "train", "namespace": "team-a",
                "labels": {"selected-node": node},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "train", "uid": "uid-1"}]},
            "spec": {"podName": "train", "selectedNode": node, "selectedGPUGroups": ["g-1"],
                "receivedResourceType": kind, "receivedGPU": {"count": 1, "portion": "0.50"}},
            "status": {"phase": phase}
        }))
    }

    #[test]
    fn only_a_succeeded_fraction_bind_on_this_node_counts() {
        let good = bound("node-1", "Fraction", "Succeeded");
        let binds = KaiBinds::from_requests([&good], "node-1");
        assert_eq!(binds.groups("uid-1", "team-a"), ["g-1"]);
        // Its pod by UID and namespace, nothing else.
        assert!(binds.groups("uid-2", "team-a").is_empty());
        assert!(binds.groups("uid-1", "team-b").is_empty());
        for other in [
            bound("node-2", "Fraction", "Succeeded"),
            bound("node-1", "Regular", "Succeeded"),
            bound("node-1", "Fraction", "Pending"),
            bound("node-1", "Fraction", "Failed"),
        ] {
            assert!(
                KaiBinds::from_requests([&other], "node-1")
                    .groups("uid-1", "team-a")
                    .is_empty()
            );
        }
        // No owner, or a malformed spec: nothing.
        let mut orphan = good.clone();
        orphan.metadata.owner_references = None;
        let mut malformed = good;
        malformed.data["spec"]["selectedGPUGroups"] = json!("g-1");
        for r in [orphan, malformed] {
            assert!(
                KaiBinds::from_requests([&r], "node-1")
                    .groups("uid-1", "team-a")
                    .is_empty()
            );
        }
    }
}
