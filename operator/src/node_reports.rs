//! The GPU nodes' posture as one cluster-scoped report (docs/design.md, "Node posture"):
//! for every GpuNode, one result for `RuntimePatched` and one for `RuntimeIsolation`, and
//! one for [`VM_DEVICE_RESOURCES`] where its VFIO plugin advertises resources, in
//! whichever of `ClusterPolicyReport` and openreports.io's `ClusterReport` the API server
//! serves. The leader keeps it, from the GpuNode and GpuPolicy caches, and rewrites it only
//! when it changes.

use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use gpuwarden_crds::condition_types::{RUNTIME_ISOLATION, RUNTIME_PATCHED};
use gpuwarden_crds::reports::{
    FIELD_MANAGER_REPORTS, NODE_POSTURE_POLICY, NODES_REPORT_NAME, SOURCE,
};
use gpuwarden_crds::{GpuNode, GpuPolicy, error_chain};
use gpuwarden_webhook::report::{
    self, CATEGORY, Outcome, ReportKind, ReportResult, Severity, Subject, Timestamp,
};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::runtime::reflector::Store;
use kube::{Api, Client, ResourceExt};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::reports::ReportContext;

/// Controller name in metrics and logs.
pub const CONTROLLER: &str = "node-reports";
/// How often the report is checked against the GpuNodes.
pub const INTERVAL: Duration = Duration::from_secs(30);

/// The conditions reported, with how much a False one matters.
const REPORTED: [(&str, Severity); 2] = [
    (RUNTIME_PATCHED, Severity::High),
    (RUNTIME_ISOLATION, Severity::Medium),
];

/// The rule that says whether every GpuPolicy lists a node's VFIO resources among its VM
/// devices (docs/design.md, "GPUs handed to VMs").
pub const VM_DEVICE_RESOURCES: &str = "VmDeviceResources";

/// One result per GpuNode and reported condition, sorted by node: pass for True, fail for
/// False, warn (not scored) for Unknown. A GpuNode without the condition yet has no result.
/// Then, for a node whose VFIO plugin advertises resources, whether every one of
/// `policies` lists them as VM devices: one a policy misses, a plain pod it governs could
/// take whole.
pub fn results(gpunodes: &[Arc<GpuNode>], policies: &[Arc<GpuPolicy>]) -> Vec<ReportResult> {
    let mut out = Vec::new();
    let mut sorted: Vec<&Arc<GpuNode>> = gpunodes.iter().collect();
    sorted.sort_by_key(|g| g.name_any());
    for gn in sorted {
        let conditions = gn.status.as_ref().and_then(|s| s.conditions.as_ref());
        let toolkit = (gn.status.as_ref())
            .and_then(|s| s.runtime.as_ref())
            .and_then(|r| r.toolkit.as_ref());
        for (type_, severity) in REPORTED {
            let Some(c) = conditions.into_iter().flatten().find(|c| c.type_ == type_) else {
                continue;
            };
            let result = match c.status.as_str() {
                "True" => Outcome::Pass,
                "False" => Outcome::Fail,
                _ => Outcome::Warn,
            };
            let mut properties = BTreeMap::from([("reason".to_owned(), c.reason.clone())]);
            if let (RUNTIME_PATCHED, Some(t)) = (type_, toolkit) {
                properties.insert("toolkitVersion".into(), t.version.clone());
            }
            out.push(ReportResult {
                source: SOURCE.into(),
                policy: NODE_POSTURE_POLICY.into(),
                rule: type_.into(),
                category: CATEGORY.into(),
                severity,
                timestamp: Timestamp::of(c.last_transition_time.0),
                result,
                scored: result != Outcome::Warn,
                resources: vec![node_subject(gn)],
                message: report::clip(c.message.clone()),
                properties,
            });
        }
        out.extend(vm_devices(gn, policies));
    }
    out
}

/// The Node a GpuNode reports on, as a result names it.
fn node_subject(gn: &GpuNode) -> Subject {
    Subject {
        api_version: "v1".into(),
        kind: "Node".into(),
        namespace: String::new(),
        name: gn.spec.node_name.clone(),
        uid: None,
    }
}

/// The [`VM_DEVICE_RESOURCES`] result of `gn`: `None` where it advertises no VFIO resource or
/// no policy governs anything.
fn vm_devices(gn: &GpuNode, policies: &[Arc<GpuPolicy>]) -> Option<ReportResult> {
    let vfio = gn.status.as_ref()?.vfio.as_ref()?;
    if vfio.resources.is_empty() || policies.is_empty() {
        return None;
    }
    let names: Vec<&str> = vfio.resources.iter().map(|r| r.name.as_str()).collect();
    let mut missed = Vec::new();
    for policy in policies {
        let vms = &policy.spec.virtual_machines;
        let unlisted: Vec<&str> = names
            .iter()
            .copied()
            .filter(|r| !vms.is_device(r))
            .collect();
        if !unlisted.is_empty() {
            missed.push(format!(
                "GpuPolicy {}: {}",
                policy.name_any(),
                unlisted.join(", ")
            ));
        }
    }
    let (result, message) = if missed.is_empty() {
        (
            Outcome::Pass,
            format!(
                "every GpuPolicy lists the node's VFIO resources under virtualMachines.deviceResources: {}",
                names.join(", ")
            ),
        )
    } else {
        (
            Outcome::Fail,
            format!(
                "VFIO resources of this node that a GpuPolicy does not list under virtualMachines.deviceResources, so a plain pod it governs could take the device whole: {}",
                missed.join("; ")
            ),
        )
    };
    let since = gn.metadata.creation_timestamp.as_ref().map(|t| t.0);
    Some(ReportResult {
        source: SOURCE.into(),
        policy: NODE_POSTURE_POLICY.into(),
        rule: VM_DEVICE_RESOURCES.into(),
        category: CATEGORY.into(),
        severity: Severity::High,
        timestamp: Timestamp::of(since.unwrap_or(jiff::Timestamp::UNIX_EPOCH)),
        result,
        scored: true,
        resources: vec![node_subject(gn)],
        message: report::clip(message),
        properties: BTreeMap::from([("resources".to_owned(), names.join(","))]),
    })
}

/// Errors keeping the report.
#[derive(Debug, thiserror::Error)]
pub enum NodeReportError {
    /// Applying it failed.
    #[error("failed to apply {kind} {}", NODES_REPORT_NAME)]
    Apply {
        /// The report kind.
        kind: &'static str,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Deleting it failed.
    #[error("failed to delete {kind} {}", NODES_REPORT_NAME)]
    Delete {
        /// The report kind.
        kind: &'static str,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

fn cluster_api(client: &Client, kind: ReportKind) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(kind.group(), kind.version(), kind.cluster_kind());
    let resource = ApiResource::from_gvk_with_plural(&gvk, kind.cluster_plural());
    Api::all_with(client.clone(), &resource)
}

/// Writes the report of `gpunodes` in each of `kinds` where it differs from `last` (the hash
/// of what was last written), or deletes it where there is no GpuNode. Returns the new hash.
pub async fn reconcile(
    client: &Client,
    kinds: &[ReportKind],
    gpunodes: &[Arc<GpuNode>],
    policies: &[Arc<GpuPolicy>],
    last: Option<u64>,
    metrics: &crate::metrics::Metrics,
) -> Result<Option<u64>, NodeReportError> {
    let results = results(gpunodes, policies);
    let mut h = DefaultHasher::new();
    results.hash(&mut h);
    kinds.hash(&mut h);
    let hash = h.finish();
    if last == Some(hash) {
        return Ok(last);
    }
    for kind in kinds {
        let api = cluster_api(client, *kind);
        if results.is_empty() {
            match api.delete(NODES_REPORT_NAME, &Default::default()).await {
                Ok(_) => metrics.write(CONTROLLER, "delete"),
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(source) => {
                    return Err(NodeReportError::Delete {
                        kind: kind.cluster_kind(),
                        source,
                    });
                }
            }
            continue;
        }
        let object = report::nodes_report_object(*kind, &results);
        let params = PatchParams::apply(FIELD_MANAGER_REPORTS).force();
        match api
            .patch(NODES_REPORT_NAME, &params, &Patch::Apply(object))
            .await
        {
            Ok(_) => metrics.write(CONTROLLER, "apply"),
            // The namespaced kind is served and the cluster kind is not (a cluster that
            // installed only one CRD): nothing to keep there.
            Err(kube::Error::Api(s)) if s.code == 404 => {
                debug!(
                    kind = kind.cluster_kind(),
                    "not served; no nodes' report there"
                );
            }
            Err(source) => {
                return Err(NodeReportError::Apply {
                    kind: kind.cluster_kind(),
                    source,
                });
            }
        }
    }
    Ok(Some(hash))
}

/// Keeps the report every [`INTERVAL`] while this replica leads and a report kind is served,
/// until `shutdown`. What fails is logged and tried again at the next tick.
pub async fn run(
    ctx: Arc<ReportContext>,
    gpunodes: Store<GpuNode>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut last: Option<u64> = None;
    let mut tick = tokio::time::interval(INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = tick.tick() => {}
        }
        if *shutdown.borrow() {
            return;
        }
        if !ctx.leader.is_leader() {
            // Another leader's writes: write again on gaining leadership.
            last = None;
            continue;
        }
        let kinds = ctx.kinds();
        if kinds.is_empty() || gpunodes.wait_until_ready().await.is_err() {
            continue;
        }
        let started = std::time::Instant::now();
        let policies = ctx.policies.state();
        let result = reconcile(
            &ctx.client,
            &kinds,
            &gpunodes.state(),
            &policies,
            last,
            &ctx.metrics,
        )
        .await;
        let error = result.as_ref().err().map(|_| "api");
        ctx.metrics.reconciled(CONTROLLER, started.elapsed(), error);
        match result {
            Ok(hash) => {
                if hash != last && hash.is_some() {
                    info!(
                        nodes = gpunodes.state().len(),
                        "GPU nodes' posture report written"
                    );
                }
                last = hash;
            }
            Err(e) => warn!(error = %error_chain(&e), "GPU nodes' posture report not written"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuwarden_crds::{GpuNodeSpec, GpuNodeStatus, RuntimeStatus, ToolkitStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

    fn gpunode(name: &str, patched: &str, isolation: Option<&str>) -> Arc<GpuNode> {
        let condition = |type_: &str, status: &str| Condition {
            type_: type_.into(),
            status: status.into(),
            reason: format!("{type_}{status}"),
            message: format!("{type_} is {status}"),
            last_transition_time: Time(jiff::Timestamp::from_second(1_800_000_000).unwrap()),
            observed_generation: None,
        };
        let mut conditions = vec![condition(RUNTIME_PATCHED, patched)];
        conditions.extend(isolation.map(|s| condition(RUNTIME_ISOLATION, s)));
        let mut gn = GpuNode::new(
            name,
            GpuNodeSpec {
                node_name: name.into(),
            },
        );
        gn.status = Some(GpuNodeStatus {
            conditions: Some(conditions),
            runtime: Some(RuntimeStatus {
                toolkit: Some(ToolkitStatus {
                    version: "1.17.3-1".into(),
                    source: "dpkg".into(),
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
        Arc::new(gn)
    }

    #[test]
    fn one_result_per_node_and_condition() {
        let nodes = [
            gpunode("gpu-b", "True", Some("True")),
            gpunode("gpu-a", "False", Some("Unknown")),
            gpunode("gpu-c", "Unknown", None),
        ];
        let results = results(&nodes, &[]);
        let lines: Vec<(String, String, Outcome, bool)> = (results.iter())
            .map(|r| {
                (
                    r.resources[0].name.clone(),
                    r.rule.clone(),
                    r.result,
                    r.scored,
                )
            })
            .collect();
        assert_eq!(
            lines,
            [
                ("gpu-a".into(), RUNTIME_PATCHED.into(), Outcome::Fail, true),
                (
                    "gpu-a".into(),
                    RUNTIME_ISOLATION.into(),
                    Outcome::Warn,
                    false
                ),
                ("gpu-b".into(), RUNTIME_PATCHED.into(), Outcome::Pass, true),
                (
                    "gpu-b".into(),
                    RUNTIME_ISOLATION.into(),
                    Outcome::Pass,
                    true
                ),
                ("gpu-c".into(), RUNTIME_PATCHED.into(), Outcome::Warn, false),
            ]
        );
        let patched = &results[0];
        assert_eq!(patched.severity, Severity::High);
        assert_eq!(patched.properties["toolkitVersion"], "1.17.3-1");
        assert_eq!(patched.properties["reason"], "RuntimePatchedFalse");
        assert_eq!(patched.resources[0].kind, "Node");
        let object = report::nodes_report_object(ReportKind::PolicyReport, &results);
        assert_eq!(object["kind"], "ClusterPolicyReport");
        assert_eq!(object["metadata"]["name"], NODES_REPORT_NAME);
        assert_eq!(object["summary"]["pass"], 2);
        assert_eq!(object["summary"]["fail"], 1);
        assert_eq!(object["summary"]["warn"], 2);
        let open = report::nodes_report_object(ReportKind::OpenReport, &results);
        assert_eq!(open["kind"], "ClusterReport");
        assert_eq!(open["source"], SOURCE);
    }

    #[test]
    fn a_vfio_resource_a_policy_does_not_list_fails_naming_it() {
        use gpuwarden_crds::node::{VfioKind, VfioResource, VfioStatus};
        let node = |names: &[&str]| {
            let mut gn = (*gpunode("vm-node", "True", None)).clone();
            let status = gn.status.as_mut().unwrap();
            status.vfio = Some(VfioStatus {
                resources: (names.iter())
                    .map(|n| VfioResource {
                        name: (*n).into(),
                        kind: VfioKind::Passthrough,
                        devices: 1,
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            });
            Arc::new(gn)
        };
        let default = Arc::new(GpuPolicy::default_policy());
        let mut narrow = GpuPolicy::default_policy();
        narrow.metadata.name = Some("narrow".into());
        narrow.spec.virtual_machines.device_resources = vec!["nvidia.com/GRID_*".into()];
        let narrow = Arc::new(narrow);
        let listed = node(&["nvidia.com/GA102GL_A10", "nvidia.com/GRID_T4-1Q"]);
        let vm = |r: &[ReportResult]| {
            r.iter()
                .find(|r| r.rule == VM_DEVICE_RESOURCES)
                .cloned()
                .expect("a VM device result")
        };
        assert_eq!(
            vm(&results(
                std::slice::from_ref(&listed),
                std::slice::from_ref(&default)
            ))
            .result,
            Outcome::Pass
        );
        let failed = vm(&results(std::slice::from_ref(&listed), &[default, narrow]));
        assert_eq!(failed.result, Outcome::Fail);
        assert!(
            failed
                .message
                .contains("GpuPolicy narrow: nvidia.com/GA102GL_A10"),
            "{}",
            failed.message
        );
        // No VFIO resources, or no policy: no result.
        assert!(
            results(&[gpunode("plain", "True", None)], &[])
                .iter()
                .all(|r| r.rule != VM_DEVICE_RESOURCES)
        );
        assert!(
            results(&[listed], &[])
                .iter()
                .all(|r| r.rule != VM_DEVICE_RESOURCES)
        );
    }
}
