//! The pure core of the GpuNode controller: which nodes get a GpuNode, and what the
//! operator's part of its status (`conditions`, `summary`) should be.
//!
//! Every function here is a function of the objects read from the caches and of `now`;
//! the reconciler in [`crate::node_controller`] does the reading and writing.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use gpuwarden_crds::condition_types::{
    AGENT_READY, HEALTHY, ISOLATED, RUNTIME_ISOLATION, RUNTIME_PATCHED, STATUS_COMPLETE,
};
use gpuwarden_crds::conditions::{DesiredCondition, merge_conditions};
use gpuwarden_crds::{
    Binding, BindingSource, GpuNodeStatus, GpuNodeSummary, GpuStatus, GpusFrom, HealthState,
    LABEL_GPU_PRESENT, RESOURCE_GPU, RuntimeStatus, Truncated, gpu,
};
use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// Why a node counts as a GPU node; `None` when it does not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuSignal {
    /// Allocatable GPU resource (`nvidia.com/gpu`, `nvidia.com/gpu.shared`, `nvidia.com/mig-*`) > 0.
    Allocatable(String),
    /// Label `nvidia.com/gpu.present=true`.
    Label,
    /// A node agent holds a live Lease for the node.
    Agent,
}

/// Parses a resource quantity as a whole count; extended resources are integers, so anything
/// else (`500m`, garbage) counts as zero rather than as a GPU.
fn quantity_count(q: &Quantity) -> u64 {
    q.0.trim().parse::<u64>().unwrap_or(0)
}

/// Why `node` is a GPU node, from its own fields only (allocatable resources, then label).
pub fn node_gpu_signal(node: &Node) -> Option<GpuSignal> {
    let allocatable = node
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .into_iter()
        .flatten()
        .find(|(name, q)| gpu::is_gpu_resource(name) && quantity_count(q) > 0);
    if let Some((name, _)) = allocatable {
        return Some(GpuSignal::Allocatable(name.clone()));
    }
    let labelled = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_GPU_PRESENT))
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    labelled.then_some(GpuSignal::Label)
}

/// What the agent's Lease says about the agent at `now`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentLiveness {
    /// No Lease: the agent never ran on this node (or its Lease was deleted).
    NoLease,
    /// The Lease exists but has no renew time or duration.
    Incomplete,
    /// Renewed recently; stays live until `expires`.
    Live {
        /// When the Lease lapses unless renewed again.
        expires: Timestamp,
    },
    /// Not renewed in time.
    Expired {
        /// When it lapsed.
        expired: Timestamp,
    },
}

impl AgentLiveness {
    /// Whether the agent is live.
    pub fn is_live(&self) -> bool {
        matches!(self, Self::Live { .. })
    }
}

/// Reads the agent Lease's liveness at `now`: live while `renewTime + leaseDurationSeconds`
/// is in the future.
pub fn agent_liveness(lease: Option<&Lease>, now: Timestamp) -> AgentLiveness {
    let Some(lease) = lease else {
        return AgentLiveness::NoLease;
    };
    let spec = lease.spec.as_ref();
    let renew = spec.and_then(|s| s.renew_time.as_ref().or(s.acquire_time.as_ref()));
    let duration = spec.and_then(|s| s.lease_duration_seconds);
    match (renew, duration) {
        (Some(renew), Some(secs)) if secs > 0 => {
            let end = renew
                .0
                .checked_add(jiff::SignedDuration::from_secs(i64::from(secs)))
                .unwrap_or(renew.0);
            if end > now {
                AgentLiveness::Live { expires: end }
            } else {
                AgentLiveness::Expired { expired: end }
            }
        }
        _ => AgentLiveness::Incomplete,
    }
}

/// What should happen to a node's GpuNode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lifecycle {
    /// The node has GPUs or an agent: its GpuNode should exist.
    Keep(GpuSignal),
    /// The node exists but has neither GPUs nor a live agent.
    RemoveNoGpus,
    /// The Node object is gone.
    RemoveNodeGone,
}

/// Decides the fate of the GpuNode for a node. Only call this once every cache it reads from
/// has synced: an empty cache would otherwise look like "node gone".
pub fn lifecycle(node: Option<&Node>, liveness: &AgentLiveness) -> Lifecycle {
    let Some(node) = node else {
        return Lifecycle::RemoveNodeGone;
    };
    if let Some(signal) = node_gpu_signal(node) {
        return Lifecycle::Keep(signal);
    }
    if liveness.is_live() {
        return Lifecycle::Keep(GpuSignal::Agent);
    }
    Lifecycle::RemoveNoGpus
}

/// Most per-GPU problems named in one condition message; keeps status small.
const MAX_LISTED: usize = 8;

fn list_limited(items: &[String]) -> String {
    let mut out = items
        .iter()
        .take(MAX_LISTED)
        .cloned()
        .collect::<Vec<_>>()
        .join("; ");
    if items.len() > MAX_LISTED {
        out.push_str(&format!("; and {} more", items.len() - MAX_LISTED));
    }
    out
}

/// How a `BeyondClaim` binding came to be, for the Isolated message: which claims' CDI specs
/// hand the container which device nodes beyond its allocation.
fn beyond_claim(b: &Binding) -> String {
    const NODES_LISTED: usize = 4;
    let mut nodes = (b.device_nodes.iter().take(NODES_LISTED))
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if b.device_nodes.len() > NODES_LISTED {
        nodes.push_str(&format!(
            " and {} more",
            b.device_nodes.len() - NODES_LISTED
        ));
    }
    format!(
        " (the CDI spec of claim {} hands it {nodes}, beyond what was allocated to it)",
        b.claims.join(", ")
    )
}

fn format_ts(ts: Timestamp) -> String {
    ts.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// The GPUs a device plugin allocated to one container and a DRA driver to another
/// (docs/design.md, "One allocator per GPU"), each as `GPU-x: ns/pod container c
/// (nvidia.com/gpu) and ns/pod container d (claim ns/claim)`. The two never learn of each
/// other's allocations, so where both serve a node they hand out the same GPU. A GPU and
/// one of its MIG devices are the same GPU here; a container that holds GPUs both ways is
/// left out, as its binding does not say which came from where.
fn allocated_twice(status: &GpuNodeStatus) -> Vec<String> {
    let gpus = status.gpus.as_deref().unwrap_or_default();
    let physical = |uuid: &str| -> String {
        (gpus.iter())
            .find(|g| g.mig_devices.iter().any(|m| m.uuid == uuid))
            .map_or_else(|| uuid.to_owned(), |g| g.uuid.clone())
    };
    // Per physical GPU: who holds it through a device plugin, and who through a claim.
    let mut held: BTreeMap<String, (Vec<String>, Vec<String>)> = BTreeMap::new();
    for b in status.bindings.iter().flatten() {
        // Out-of-band use is its own condition, as is what a claim's CDI spec hands out
        // beyond its allocation; a shared GPU is its reservation's.
        if matches!(
            b.source,
            BindingSource::Observed | BindingSource::Shared | BindingSource::BeyondClaim
        ) {
            continue;
        }
        let from_claim = !b.claims.is_empty();
        if from_claim && b.resource_name.as_deref().is_some_and(gpu::is_gpu_resource) {
            continue;
        }
        let holder = if from_claim {
            format!(
                "{}/{} container {} (claim {})",
                b.namespace,
                b.pod,
                b.container,
                b.claims.join(", ")
            )
        } else {
            format!(
                "{}/{} container {} ({})",
                b.namespace,
                b.pod,
                b.container,
                b.resource_name.as_deref().unwrap_or("a device plugin")
            )
        };
        for uuid in &b.gpu_uuids {
            let entry = held.entry(physical(uuid)).or_default();
            let list = if from_claim {
                &mut entry.1
            } else {
                &mut entry.0
            };
            if !list.contains(&holder) {
                list.push(holder.clone());
            }
        }
    }
    held.into_iter()
        .filter(|(_, (plugin, claim))| !plugin.is_empty() && !claim.is_empty())
        .map(|(gpu, (plugin, claim))| {
            format!("{gpu}: {} and {}", plugin.join(", "), claim.join(", "))
        })
        .collect()
}

/// The IOMMU groups that containers of more than one pod hold (docs/design.md, "Whole IOMMU
/// groups"), each as `group 13: vms/vm-a container compute (nvidia.com/X 0000:81:00.0) and
/// vms/vm-b container compute (nvidia.com/Y 0000:81:00.1)`. A VFIO device plugin hands each
/// of them the group's device node, which opens every device of the group: each pod can
/// reach what was allocated to the other. Containers of one pod are one holder.
fn shared_iommu_groups(status: &GpuNodeStatus) -> Vec<String> {
    // Per group, per pod (namespace, name, UID): its containers and what each was allocated.
    type PodKey<'k> = (&'k str, &'k str, &'k str);
    let mut held: BTreeMap<u32, BTreeMap<PodKey<'_>, Vec<String>>> = BTreeMap::new();
    for b in status.bindings.iter().flatten() {
        for hold in &b.iommu_groups {
            let devices = (hold.allocated.iter())
                .map(|d| format!("{} {}", d.resource_name, d.device_id))
                .collect::<Vec<_>>()
                .join(", ");
            (held.entry(hold.group).or_default())
                .entry((&b.namespace, &b.pod, &b.pod_uid))
                .or_default()
                .push(format!("container {} ({devices})", b.container));
        }
    }
    held.into_iter()
        .filter(|(_, pods)| pods.len() > 1)
        .map(|(group, pods)| {
            let holders = (pods.into_iter())
                .map(|((namespace, pod, _), containers)| {
                    format!("{namespace}/{pod} {}", containers.join(", "))
                })
                .collect::<Vec<_>>()
                .join(" and ");
            format!("group {group}: {holders}")
        })
        .collect()
}

/// The types of the conditions [`desired_conditions`] sets, in its order.
pub const CONDITION_TYPES: [&str; 6] = [
    AGENT_READY,
    HEALTHY,
    ISOLATED,
    RUNTIME_ISOLATION,
    RUNTIME_PATCHED,
    STATUS_COMPLETE,
];

/// The six GpuNode conditions, computed from the agent's status and Lease.
pub fn desired_conditions(
    status: Option<&GpuNodeStatus>,
    liveness: &AgentLiveness,
) -> Vec<DesiredCondition> {
    let runtime = status.and_then(|s| s.runtime.as_ref());
    vec![
        agent_ready(liveness),
        healthy(status.and_then(|s| s.gpus.as_deref())),
        isolated(status),
        runtime_isolation(runtime),
        runtime_patched(runtime),
        status_complete(status),
    ]
}

/// `AgentReady`: whether the node agent renews its Lease.
fn agent_ready(liveness: &AgentLiveness) -> DesiredCondition {
    match liveness {
        AgentLiveness::Live { .. } => DesiredCondition::new(
            AGENT_READY,
            true,
            "LeaseRenewed",
            "the node agent renews its Lease",
        ),
        AgentLiveness::Expired { expired } => DesiredCondition::new(
            AGENT_READY,
            false,
            "LeaseExpired",
            format!(
                "the node agent's Lease expired at {}; GPU data below is the last it reported",
                format_ts(*expired)
            ),
        ),
        AgentLiveness::NoLease => DesiredCondition::unknown(
            AGENT_READY,
            "NoLease",
            "no node agent Lease for this node; is the node agent running here?",
        ),
        AgentLiveness::Incomplete => DesiredCondition::unknown(
            AGENT_READY,
            "LeaseIncomplete",
            "the node agent's Lease has no renew time or duration",
        ),
    }
}

/// `Healthy`: whether every GPU the agent reported is healthy, naming those that are not.
fn healthy(gpus: Option<&[GpuStatus]>) -> DesiredCondition {
    let gpus = match gpus {
        None => {
            return DesiredCondition::unknown(
                HEALTHY,
                "NotReported",
                "the node agent has not reported any GPUs yet",
            );
        }
        Some([]) => {
            return DesiredCondition::new(
                HEALTHY,
                false,
                "NoGpusFound",
                "the node agent found no GPUs through NVML",
            );
        }
        Some(gpus) => gpus,
    };
    let sick = unhealthy_gpus(gpus);
    if sick.is_empty() {
        DesiredCondition::new(
            HEALTHY,
            true,
            "AllGpusHealthy",
            format!("{} of {} GPUs healthy", gpus.len(), gpus.len()),
        )
    } else {
        DesiredCondition::new(
            HEALTHY,
            false,
            "GpuUnhealthy",
            format!(
                "{} of {} GPUs unhealthy: {}",
                sick.len(),
                gpus.len(),
                list_limited(&sick)
            ),
        )
    }
}

/// The unhealthy GPUs, each as `GPU 3 (GPU-x): why`.
fn unhealthy_gpus(gpus: &[GpuStatus]) -> Vec<String> {
    gpus.iter()
        .filter(|g| g.health.state == HealthState::Unhealthy)
        .map(|g| {
            let why = if g.health.reasons.is_empty() {
                "unhealthy".to_owned()
            } else {
                g.health.reasons.join(", ")
            };
            format!("GPU {} ({}): {why}", g.index, g.uuid)
        })
        .collect()
}

/// `Isolated`: whether every GPU user was allocated its GPUs by the kubelet, or else the
/// first way around that the agent found ([`isolation_breach`]).
fn isolated(status: Option<&GpuNodeStatus>) -> DesiredCondition {
    let reported =
        status.filter(|s| s.gpus.is_some() || s.bindings.is_some() || s.privileged_pods.is_some());
    let Some(s) = reported else {
        return DesiredCondition::unknown(
            ISOLATED,
            "NotReported",
            "the node agent has not reported GPU users yet",
        );
    };
    if let Some(breached) = isolation_breach(s) {
        return breached;
    }
    let message = if (s.bindings.iter().flatten()).any(|b| b.source == BindingSource::Shared) {
        "every GPU user was allocated its GPUs by the kubelet, or shares the GPU KAI-Scheduler's reservation pod was allocated for it"
    } else {
        "every GPU user was allocated its GPUs by the kubelet"
    };
    DesiredCondition::new(ISOLATED, true, "NoOutOfBandUse", message)
}

/// The `Isolated=False` condition for the gravest breach of isolation in the agent's status:
/// out-of-band use, then GPUs allocated twice, then shared IOMMU groups, then privileged
/// pods. `None` when there is none.
fn isolation_breach(s: &GpuNodeStatus) -> Option<DesiredCondition> {
    let beyond = (s.bindings.iter().flatten())
        .any(|b| b.is_out_of_band() && b.source == BindingSource::BeyondClaim);
    let out_of_band = if beyond {
        "DevicesBeyondClaim"
    } else {
        "OutOfBandGpuUse"
    };
    breach(
        out_of_band,
        "containers use GPUs the kubelet never allocated to them",
        out_of_band_uses(s),
    )
    .or_else(|| {
        breach(
            "GpuAllocatedTwice",
            "GPUs handed out both by a device plugin and by a DRA driver, which do not know of each other's allocations (run one of them per node, or give each its own GPUs)",
            allocated_twice(s),
        )
    })
    .or_else(|| {
        breach(
            "SharedIommuGroup",
            "pods were allocated devices of one IOMMU group, and their VFIO device plugin hands each the whole group, so each can open the devices allocated to the other (allocate a group's devices to one pod, e.g. a GPU with its audio function)",
            shared_iommu_groups(s),
        )
    })
    .or_else(|| {
        breach(
            "PrivilegedGpuPods",
            "privileged GPU pods see every GPU on the node",
            unexempt_privileged_pods(s),
        )
    })
}

/// `Isolated=False` for `reason`, its message `what` followed by what was `found`; `None`
/// when nothing was.
fn breach(reason: &str, what: &str, found: Vec<String>) -> Option<DesiredCondition> {
    (!found.is_empty()).then(|| {
        DesiredCondition::new(
            ISOLATED,
            false,
            reason,
            format!("{what}: {}", list_limited(&found)),
        )
    })
}

/// The containers that use GPUs the kubelet never allocated to them, each as `ns/pod
/// container c` and how they came by them.
fn out_of_band_uses(s: &GpuNodeStatus) -> Vec<String> {
    (s.bindings.iter().flatten())
        .filter(|b| b.is_out_of_band())
        .map(|b| {
            let how = match b.source {
                BindingSource::Injected => " (by a device-injection annotation)".into(),
                BindingSource::BeyondClaim => beyond_claim(b),
                _ => String::new(),
            };
            format!("{}/{} container {}{how}", b.namespace, b.pod, b.container)
        })
        .collect()
}

/// The privileged GPU pods no policy exempts, each as `ns/pod`.
fn unexempt_privileged_pods(s: &GpuNodeStatus) -> Vec<String> {
    (s.privileged_pods.iter().flatten())
        .filter(|p| p.exempt.is_none())
        .map(|p| format!("{}/{}", p.namespace, p.name))
        .collect()
}

/// `StatusComplete`: whether the agent's lists hold everything it found, or what it cut.
fn status_complete(status: Option<&GpuNodeStatus>) -> DesiredCondition {
    match status {
        Some(s) if s.gpus.is_some() => match &s.truncated {
            Some(cut) => DesiredCondition::new(
                STATUS_COMPLETE,
                false,
                "ListsTruncated",
                format!(
                    "the node agent found more than a GpuNode holds and left out {}; the lists keep \
                     unhealthy GPUs, out-of-band bindings and unexempt privileged pods first",
                    describe_truncated(cut)
                ),
            ),
            None => DesiredCondition::new(
                STATUS_COMPLETE,
                true,
                "AllListed",
                "the node agent's lists hold everything it found",
            ),
        },
        _ => DesiredCondition::unknown(
            STATUS_COMPLETE,
            "NotReported",
            "the node agent has not reported yet",
        ),
    }
}

/// `RuntimeIsolation`: whether the NVIDIA runtime hands GPUs to unprivileged containers on
/// request of an environment variable, and, channel by channel, which doors the node closes
/// itself and which only admission closes ([`doors`]).
fn runtime_isolation(runtime: Option<&RuntimeStatus>) -> DesiredCondition {
    let r = match runtime {
        None => {
            return DesiredCondition::unknown(
                RUNTIME_ISOLATION,
                "NotReported",
                "the node agent has not reported the NVIDIA runtime configuration yet",
            );
        }
        Some(r) if r.error.is_some() && r.accept_env_var_when_unprivileged.is_none() => {
            return DesiredCondition::unknown(
                RUNTIME_ISOLATION,
                "RuntimeConfigUnreadable",
                format!(
                    "the node agent could not read the NVIDIA runtime configuration: {}",
                    r.error.as_deref().unwrap_or_default()
                ),
            );
        }
        Some(r) => r,
    };
    let cdi = if r.cdi_enabled {
        "NVIDIA CDI specs are present, so cdi.k8s.io annotations can inject GPUs"
    } else {
        "no NVIDIA CDI specs found"
    };
    // What the agent could not read beside the config (a CDI directory the node does not
    // have, a spec it may not open) qualifies the CDI part.
    let cdi = match &r.error {
        Some(e) => format!("{cdi} ({e})"),
        None => cdi.to_owned(),
    };
    let doors = doors(r);
    // A node where no CRI handler runs NVIDIA's runtime hands out nothing by variable,
    // whatever the toolkit's config says.
    let runs_nvidia = !(r.container_runtime.as_ref()).is_some_and(|c| c.nvidia_handlers.is_empty());
    if r.env_var_leak() && runs_nvidia {
        DesiredCondition::new(
            RUNTIME_ISOLATION,
            false,
            "EnvVarAcceptedWhenUnprivileged",
            format!(
                "the NVIDIA runtime honours NVIDIA_VISIBLE_DEVICES in unprivileged containers \
                 (accept-nvidia-visible-devices-envvar-when-unprivileged is true or unset); {cdi}; \
                 before setting it to false, give the node agent NVML another way \
                 (the node-agent-privileged component). {doors}"
            ),
        )
    } else {
        DesiredCondition::new(
            RUNTIME_ISOLATION,
            true,
            "EnvVarIgnoredWhenUnprivileged",
            format!(
                "unprivileged containers get GPUs only through the device plugin; {cdi}. {doors}"
            ),
        )
    }
}

/// Each way around the kubelet to a device, and whether the node's own settings close it
/// or only admission does: "Closed by the node: ...; closed only by admission: ...; not
/// known: ...".
fn doors(r: &RuntimeStatus) -> String {
    let (mut node, mut admission, mut unknown) = (Vec::new(), Vec::new(), Vec::new());
    let cri = r.container_runtime.as_ref();
    // Where no CRI handler runs NVIDIA's runtime, nothing acts on its variables and mounts.
    let no_nvidia_runtime = cri.is_some_and(|c| c.nvidia_handlers.is_empty());
    let mut door = |known: Option<bool>, what: &str| match known {
        Some(true) => node.push(what.to_owned()),
        Some(false) => admission.push(what.to_owned()),
        None => unknown.push(what.to_owned()),
    };
    let runtime_door = |setting: Option<bool>| match no_nvidia_runtime {
        true => Some(true),
        false => setting,
    };
    door(
        runtime_door(r.accept_env_var_when_unprivileged.map(|a| !a)),
        "NVIDIA_VISIBLE_DEVICES in unprivileged containers",
    );
    door(
        runtime_door(r.accept_volume_mounts.map(|a| !a)),
        "device-list volume mounts (/var/run/nvidia-container-devices)",
    );
    door(
        runtime_door(r.ignore_imex_channel_requests),
        "NVIDIA_IMEX_CHANNELS requests",
    );
    door(
        cri.and_then(|c| c.cdi_enabled)
            .map(|on| !(on && r.cdi_enabled)),
        "cdi.k8s.io annotations naming NVIDIA CDI devices",
    );
    let injectors = !r.device_injectors.is_empty();
    door(
        cri.and_then(|c| c.nri_enabled).map(|on| !(on && injectors)),
        &if injectors {
            format!(
                "device-injection annotations ({})",
                r.device_injectors.join(", ")
            )
        } else {
            "device-injection annotations (NRI)".to_owned()
        },
    );
    let mut parts = Vec::new();
    if !node.is_empty() {
        parts.push(format!("Closed by the node: {}", node.join(", ")));
    }
    if !admission.is_empty() {
        parts.push(format!(
            "closed only by admission: {}",
            admission.join(", ")
        ));
    }
    if !unknown.is_empty() {
        parts.push(format!("not known: {}", unknown.join(", ")));
    }
    let mut out = parts.join("; ");
    if let Some(first) = out.get(..1) {
        out = first.to_uppercase() + &out[1..];
    }
    if cri.and_then(|c| c.nvidia_default) == Some(true) {
        out.push_str(". Every container runs through NVIDIA's runtime (it is the CRI's default)");
    } else if let Some(c) = cri.filter(|c| !c.nvidia_handlers.is_empty()) {
        out.push_str(&format!(
            ". Pods reach NVIDIA's runtime through the RuntimeClass handlers {}",
            c.nvidia_handlers.join(", ")
        ));
    } else if no_nvidia_runtime {
        out.push_str(". No CRI handler runs NVIDIA's runtime");
    }
    out
}

/// `RuntimePatched`: whether the node's NVIDIA Container Toolkit is one NVIDIA's advisories
/// ([`gpuwarden_crds::toolkit::ADVISORIES`]) name as affected. Never True without a known
/// version.
fn runtime_patched(runtime: Option<&RuntimeStatus>) -> DesiredCondition {
    use gpuwarden_crds::toolkit::{ADVISORIES, Version, describe};
    let Some(r) = runtime else {
        return DesiredCondition::unknown(
            RUNTIME_PATCHED,
            "NotReported",
            "the node agent has not reported the NVIDIA Container Toolkit yet",
        );
    };
    let Some(toolkit) = &r.toolkit else {
        let why = (r.unknown.iter())
            .find(|u| u.field == "toolkit")
            .map_or("the node agent found none", |u| u.reason.as_str());
        return DesiredCondition::unknown(
            RUNTIME_PATCHED,
            "VersionUnknown",
            format!("the NVIDIA Container Toolkit's version is not known: {why}"),
        );
    };
    let Some(version) = Version::parse(&toolkit.version) else {
        return DesiredCondition::unknown(
            RUNTIME_PATCHED,
            "VersionUnreadable",
            format!(
                "the NVIDIA Container Toolkit's version {:?} ({}) is not one the agent can compare",
                toolkit.version, toolkit.source
            ),
        );
    };
    let affected = version.advisories();
    if affected.is_empty() {
        DesiredCondition::new(
            RUNTIME_PATCHED,
            true,
            "NoKnownVulnerabilities",
            format!(
                "NVIDIA Container Toolkit {} ({}) has the fixes of all {} advisories known to gpuwarden",
                toolkit.version,
                toolkit.source,
                ADVISORIES.len()
            ),
        )
    } else {
        let newest = affected
            .iter()
            .map(|a| a.fixed_in)
            .max()
            .expect("not empty");
        DesiredCondition::new(
            RUNTIME_PATCHED,
            false,
            "KnownVulnerabilities",
            format!(
                "NVIDIA Container Toolkit {} ({}) is affected by {}; upgrade to {newest} or later",
                toolkit.version,
                toolkit.source,
                describe(&affected).join("; ")
            ),
        )
    }
}

/// "3 bindings, 2 privileged pods" for the counts that are not zero.
fn describe_truncated(cut: &Truncated) -> String {
    [
        (cut.gpus, "GPUs"),
        (cut.mig_devices, "MIG devices"),
        (cut.health_reasons, "health reasons"),
        (cut.bindings, "bindings"),
        (cut.binding_devices, "device UUIDs of bindings"),
        (cut.privileged_pods, "privileged pods"),
        (cut.vfio_resources, "VFIO resources"),
        (cut.iommu_groups, "IOMMU groups"),
        (cut.iommu_group_devices, "devices of IOMMU groups"),
        (cut.vfio_unknown, "unread VFIO devices"),
    ]
    .iter()
    .filter(|(n, _)| *n > 0)
    .map(|(n, what)| format!("{n} {what}"))
    .collect::<Vec<_>>()
    .join(", ")
}

/// Label NVIDIA GPU feature discovery sets to the number of time-slicing or MPS replicas the
/// device plugin advertises per GPU.
const LABEL_GPU_REPLICAS: &str = "nvidia.com/gpu.replicas";

/// Summary counts. Until the agent has reported GPUs, the GPU count is the Node's
/// allocatable `nvidia.com/gpu` (divided by its time-slicing replicas) and the other counts
/// are absent; with neither, `None`, so a silent agent never reads as "zero GPUs".
pub fn summary(status: Option<&GpuNodeStatus>, node: Option<&Node>) -> Option<GpuNodeSummary> {
    let Some(gpus) = status.and_then(|s| s.gpus.as_ref()) else {
        return node.and_then(node_summary);
    };
    let status = status?;
    let healthy = gpus
        .iter()
        .filter(|g| g.health.state == HealthState::Healthy)
        .count();
    // A driver's own pod handed every GPU by its claim's CDI spec (the IMEX daemon) holds
    // none of them for the summary.
    let held: BTreeSet<&str> = (status.bindings.iter().flatten())
        .filter(|b| !(b.source == BindingSource::BeyondClaim && b.exempt.is_some()))
        .flat_map(|b| b.gpu_uuids.iter().map(String::as_str))
        .collect();
    // A GPU counts as allocated when it, or one of its MIG devices, is bound to a container.
    let allocated = gpus
        .iter()
        .filter(|g| {
            held.contains(g.uuid.as_str())
                || g.mig_devices.iter().any(|m| held.contains(m.uuid.as_str()))
        })
        .count();
    let privileged_pods = status
        .privileged_pods
        .iter()
        .flatten()
        .filter(|p| p.exempt.is_none())
        .count();
    let clamp = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    Some(GpuNodeSummary {
        gpus: clamp(gpus.len()),
        gpus_from: GpusFrom::Agent,
        healthy: Some(clamp(healthy)),
        allocated: Some(clamp(allocated)),
        privileged_pods: Some(clamp(privileged_pods)),
        toolkit: (status.runtime.as_ref())
            .and_then(|r| r.toolkit.as_ref())
            .map(|t| t.version.clone()),
    })
}

/// What the Node itself says about its GPUs, before an agent reports.
fn node_summary(node: &Node) -> Option<GpuNodeSummary> {
    let allocatable = node
        .status
        .as_ref()?
        .allocatable
        .as_ref()?
        .get(RESOURCE_GPU)
        .map(quantity_count)?;
    let replicas = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_GPU_REPLICAS))
        .and_then(|r| r.parse::<u64>().ok())
        .filter(|r| *r > 0)
        .unwrap_or(1);
    Some(GpuNodeSummary {
        gpus: u32::try_from(allocatable / replicas).unwrap_or(u32::MAX),
        gpus_from: GpusFrom::Node,
        healthy: None,
        allocated: None,
        privileged_pods: None,
        toolkit: None,
    })
}

/// The operator's part of a GpuNode's status, ready to apply.
#[derive(Clone, Debug, PartialEq)]
pub struct OperatorStatus {
    /// Conditions, merged with the existing ones (transition times kept where status held).
    pub conditions: Vec<Condition>,
    /// Summary counts.
    pub summary: Option<GpuNodeSummary>,
}

/// A condition whose status changed (or that appeared), for Events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition {
    /// Condition type.
    pub type_: String,
    /// Previous status, `None` when the condition is new.
    pub from: Option<String>,
    /// New status.
    pub to: String,
    /// New reason.
    pub reason: String,
    /// New message.
    pub message: String,
}

/// The result of comparing computed status against what the object holds.
#[derive(Clone, Debug, PartialEq)]
pub struct StatusPlan {
    /// What to apply, or `None` when the object already says exactly this.
    pub apply: Option<OperatorStatus>,
    /// Conditions whose status changes with this apply.
    pub transitions: Vec<Transition>,
}

fn same_condition(a: &Condition, b: &Condition) -> bool {
    a.type_ == b.type_
        && a.status == b.status
        && a.reason == b.reason
        && a.message == b.message
        && a.observed_generation == b.observed_generation
}

/// Compares computed conditions and summary with the current status. Nothing is applied when
/// they match (transition times aside, which only move with a status change anyway).
pub fn plan_status(
    current: Option<&GpuNodeStatus>,
    desired: &[DesiredCondition],
    desired_summary: Option<GpuNodeSummary>,
    now: Timestamp,
) -> StatusPlan {
    let existing: &[Condition] = current
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    let merged = merge_conditions(existing, desired, None, Time(now));
    let conditions_same = merged.len() == existing.len()
        && merged.iter().all(|m| {
            existing
                .iter()
                .any(|e| e.type_ == m.type_ && same_condition(e, m))
        });
    let summary_same = current.and_then(|s| s.summary.as_ref()) == desired_summary.as_ref();
    let transitions = merged
        .iter()
        .filter_map(|m| {
            let prev = existing.iter().find(|e| e.type_ == m.type_);
            match prev {
                Some(p) if p.status == m.status => None,
                _ => Some(Transition {
                    type_: m.type_.clone(),
                    from: prev.map(|p| p.status.clone()),
                    to: m.status.clone(),
                    reason: m.reason.clone(),
                    message: m.message.clone(),
                }),
            }
        })
        .collect();
    if conditions_same && summary_same {
        return StatusPlan {
            apply: None,
            transitions: Vec::new(),
        };
    }
    StatusPlan {
        apply: Some(OperatorStatus {
            conditions: merged,
            summary: desired_summary,
        }),
        transitions,
    }
}

/// When to look at the node again without a watch event: the moment the agent's Lease would
/// lapse (plus a second of slack), so expiry is noticed even though nothing changes.
pub fn requeue_after(liveness: &AgentLiveness, now: Timestamp) -> Option<Duration> {
    match liveness {
        AgentLiveness::Live { expires } => {
            let left = expires.duration_since(now);
            let left = Duration::try_from(left).unwrap_or_default();
            Some(left + Duration::from_secs(1))
        }
        _ => None,
    }
}

/// Whether the unhealthy taint should be on the node: only while `Healthy` is `False`.
pub fn wants_unhealthy_taint(conditions: &[Condition]) -> bool {
    conditions
        .iter()
        .any(|c| c.type_ == HEALTHY && c.status == "False")
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuwarden_crds::{
        Binding, BindingSource, GpuHealth, GpuStatus, MigDevice, PodRef, RuntimeStatus,
    };
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::api::core::v1::NodeStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
    use std::collections::BTreeMap;

    fn ts(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).unwrap()
    }

    fn node(allocatable: &[(&str, &str)], labels: &[(&str, &str)]) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some("n1".into());
        n.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        n.status = Some(NodeStatus {
            allocatable: Some(
                allocatable
                    .iter()
                    .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..Default::default()
        });
        n
    }

    fn lease(renew: i64, secs: i32) -> Lease {
        Lease {
            spec: Some(LeaseSpec {
                holder_identity: Some("agent".into()),
                renew_time: Some(MicroTime(ts(renew))),
                lease_duration_seconds: Some(secs),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn gpu(index: u32, healthy: bool) -> GpuStatus {
        GpuStatus {
            index,
            uuid: format!("GPU-{index}"),
            model: "NVIDIA H100 80GB HBM3".into(),
            memory_mi_b: 81559,
            pci_bus_id: format!("00000000:{index:02}:00.0"),
            health: GpuHealth {
                state: if healthy {
                    HealthState::Healthy
                } else {
                    HealthState::Unhealthy
                },
                reasons: if healthy {
                    vec![]
                } else {
                    vec!["Xid79: GPU has fallen off the bus".into()]
                },
                since: None,
            },
            ..Default::default()
        }
    }

    fn find<'a>(c: &'a [DesiredCondition], t: &str) -> &'a DesiredCondition {
        c.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn gpu_nodes_are_detected_by_resource_label_or_agent() {
        assert_eq!(
            node_gpu_signal(&node(&[("nvidia.com/gpu", "8")], &[])),
            Some(GpuSignal::Allocatable("nvidia.com/gpu".into()))
        );
        assert_eq!(
            node_gpu_signal(&node(&[("nvidia.com/mig-1g.10gb", "7")], &[])),
            Some(GpuSignal::Allocatable("nvidia.com/mig-1g.10gb".into()))
        );
        assert_eq!(
            node_gpu_signal(&node(&[("nvidia.com/gpu.shared", "4")], &[])),
            Some(GpuSignal::Allocatable("nvidia.com/gpu.shared".into()))
        );
        assert_eq!(
            node_gpu_signal(&node(&[], &[(LABEL_GPU_PRESENT, "true")])),
            Some(GpuSignal::Label)
        );
        // Zero GPUs, a CPU-only node, a non-integer quantity and a false label are not GPU nodes.
        assert_eq!(
            node_gpu_signal(&node(&[("nvidia.com/gpu", "0")], &[])),
            None
        );
        assert_eq!(
            node_gpu_signal(&node(&[("cpu", "64"), ("memory", "512Gi")], &[])),
            None
        );
        assert_eq!(
            node_gpu_signal(&node(&[("nvidia.com/gpu", "x")], &[])),
            None
        );
        assert_eq!(
            node_gpu_signal(&node(&[], &[(LABEL_GPU_PRESENT, "false")])),
            None
        );

        let cpu = node(&[("cpu", "64")], &[]);
        let live = agent_liveness(Some(&lease(100, 40)), ts(120));
        assert_eq!(
            lifecycle(Some(&cpu), &live),
            Lifecycle::Keep(GpuSignal::Agent)
        );
        let dead = agent_liveness(Some(&lease(100, 40)), ts(141));
        assert_eq!(lifecycle(Some(&cpu), &dead), Lifecycle::RemoveNoGpus);
        assert_eq!(lifecycle(None, &live), Lifecycle::RemoveNodeGone);
    }

    #[test]
    fn lease_liveness_and_requeue() {
        assert_eq!(agent_liveness(None, ts(0)), AgentLiveness::NoLease);
        assert_eq!(
            agent_liveness(Some(&Lease::default()), ts(0)),
            AgentLiveness::Incomplete
        );
        let l = lease(100, 40);
        assert_eq!(
            agent_liveness(Some(&l), ts(139)),
            AgentLiveness::Live { expires: ts(140) }
        );
        assert_eq!(
            agent_liveness(Some(&l), ts(140)),
            AgentLiveness::Expired { expired: ts(140) }
        );
        assert_eq!(
            requeue_after(&agent_liveness(Some(&l), ts(110)), ts(110)),
            Some(Duration::from_secs(31))
        );
        assert_eq!(requeue_after(&AgentLiveness::NoLease, ts(110)), None);
    }

    #[test]
    fn silent_agent_is_not_zero_gpus() {
        let c = desired_conditions(None, &AgentLiveness::NoLease);
        assert_eq!(find(&c, AGENT_READY).status, "Unknown");
        assert_eq!(find(&c, HEALTHY).status, "Unknown");
        assert_eq!(find(&c, ISOLATED).status, "Unknown");
        assert_eq!(find(&c, RUNTIME_ISOLATION).status, "Unknown");
        assert_eq!(summary(None, None), None);
        assert_eq!(summary(Some(&GpuNodeStatus::default()), None), None);
        assert_eq!(find(&c, STATUS_COMPLETE).status, "Unknown");

        let expired = AgentLiveness::Expired { expired: ts(5) };
        let c = desired_conditions(None, &expired);
        assert_eq!(find(&c, AGENT_READY).status, "False");
        assert_eq!(find(&c, AGENT_READY).reason, "LeaseExpired");
    }

    #[test]
    fn health_isolation_runtime_and_summary() {
        let live = AgentLiveness::Live { expires: ts(100) };
        let mut status = GpuNodeStatus {
            gpus: Some(vec![gpu(0, true), gpu(1, true)]),
            bindings: Some(vec![Binding {
                pod_uid: "u1".into(),
                container: "main".into(),
                namespace: "ml".into(),
                pod: "train-0".into(),
                resource_name: Some("nvidia.com/gpu".into()),
                claims: vec![],
                gpu_uuids: vec!["GPU-1".into()],
                source: BindingSource::Allocated,
                ..Binding::default()
            }]),
            runtime: Some(RuntimeStatus {
                accept_env_var_when_unprivileged: Some(false),
                cdi_enabled: true,
                ..Default::default()
            }),
            ..Default::default()
        };
        let c = desired_conditions(Some(&status), &live);
        assert_eq!(find(&c, AGENT_READY).status, "True");
        assert_eq!(find(&c, HEALTHY).status, "True");
        assert_eq!(find(&c, HEALTHY).message, "2 of 2 GPUs healthy");
        assert_eq!(find(&c, ISOLATED).status, "True");
        assert_eq!(find(&c, RUNTIME_ISOLATION).status, "True");
        assert_eq!(
            summary(Some(&status), None),
            Some(GpuNodeSummary {
                gpus: 2,
                gpus_from: GpusFrom::Agent,
                healthy: Some(2),
                allocated: Some(1),
                privileged_pods: Some(0),
                toolkit: None,
            })
        );

        status.gpus = Some(vec![gpu(0, false), gpu(1, true)]);
        status.bindings.as_mut().unwrap().push(Binding {
            pod_uid: "u2".into(),
            container: "sneaky".into(),
            namespace: "ml".into(),
            pod: "priv-0".into(),
            resource_name: None,
            claims: vec![],
            gpu_uuids: vec!["GPU-0".into()],
            source: BindingSource::Observed,
            ..Binding::default()
        });
        status.privileged_pods = Some(vec![
            PodRef {
                uid: "u2".into(),
                namespace: "ml".into(),
                name: "priv-0".into(),
                exempt: None,
            },
            PodRef {
                uid: "u3".into(),
                namespace: "gpu-operator".into(),
                name: "nvidia-dcgm-exporter-x7k2p".into(),
                exempt: Some("GpuPolicy default: namespace gpu-operator is exempt".into()),
            },
        ]);
        status
            .runtime
            .as_mut()
            .unwrap()
            .accept_env_var_when_unprivileged = None;
        let c = desired_conditions(Some(&status), &live);
        let h = find(&c, HEALTHY);
        assert_eq!((h.status, h.reason.as_str()), ("False", "GpuUnhealthy"));
        assert!(h.message.contains("GPU 0 (GPU-0): Xid79"), "{}", h.message);
        let i = find(&c, ISOLATED);
        assert_eq!((i.status, i.reason.as_str()), ("False", "OutOfBandGpuUse"));
        assert!(i.message.contains("ml/priv-0 container sneaky"));
        assert_eq!(find(&c, RUNTIME_ISOLATION).status, "False");
        assert_eq!(
            summary(Some(&status), None),
            Some(GpuNodeSummary {
                gpus: 2,
                gpus_from: GpusFrom::Agent,
                healthy: Some(1),
                allocated: Some(2),
                privileged_pods: Some(1),
                toolkit: None,
            })
        );

        // The device plugin and a DRA driver handing out the same GPU: both holders named.
        status.bindings = Some(vec![
            Binding {
                pod_uid: "u4".into(),
                container: "main".into(),
                namespace: "ml".into(),
                pod: "plugin-0".into(),
                resource_name: Some("nvidia.com/gpu".into()),
                claims: vec![],
                gpu_uuids: vec!["GPU-0".into()],
                source: BindingSource::Allocated,
                ..Binding::default()
            },
            Binding {
                pod_uid: "u5".into(),
                container: "main".into(),
                namespace: "ml".into(),
                pod: "claim-0".into(),
                resource_name: Some("gpu.nvidia.com".into()),
                claims: vec!["ml/claim-0-gpu-x7k2p".into()],
                gpu_uuids: vec!["GPU-0".into()],
                source: BindingSource::AllocatedAndObserved,
                ..Binding::default()
            },
        ]);
        let i = desired_conditions(Some(&status), &live);
        let i = find(&i, ISOLATED);
        assert_eq!(
            (i.status, i.reason.as_str()),
            ("False", "GpuAllocatedTwice")
        );
        assert!(
            i.message.contains(
                "GPU-0: ml/plugin-0 container main (nvidia.com/gpu) and ml/claim-0 container main (claim ml/claim-0-gpu-x7k2p)"
            ),
            "{}",
            i.message
        );
        assert_eq!(summary(Some(&status), None).unwrap().allocated, Some(1));
        // On different GPUs they are fine.
        status.bindings.as_mut().unwrap()[1].gpu_uuids = vec!["GPU-1".into()];
        let i = desired_conditions(Some(&status), &live);
        assert_ne!(find(&i, ISOLATED).reason, "GpuAllocatedTwice");

        // A KAI fraction sharing its reservation's GPU is neither out of band nor a second
        // allocation, and the condition says it is there.
        let saved = status.privileged_pods.take();
        status.bindings = Some(vec![
            Binding {
                namespace: "kai-resource-reservation".into(),
                pod: "gpu-reservation-1".into(),
                container: "resource-reservation".into(),
                ..status.bindings.as_ref().unwrap()[0].clone()
            },
            Binding {
                pod_uid: "u6".into(),
                container: "main".into(),
                namespace: "ml".into(),
                pod: "fraction".into(),
                resource_name: None,
                claims: vec![],
                gpu_uuids: vec!["GPU-0".into()],
                source: BindingSource::Shared,
                shared_from: vec!["kai-resource-reservation/gpu-reservation-1".into()],
                ..Binding::default()
            },
        ]);
        let i = desired_conditions(Some(&status), &live);
        let i = find(&i, ISOLATED);
        assert_eq!((i.status, i.reason.as_str()), ("True", "NoOutOfBandUse"));
        assert!(
            i.message.contains("KAI-Scheduler's reservation"),
            "{}",
            i.message
        );
        assert_eq!(summary(Some(&status), None).unwrap().allocated, Some(1));
        status.privileged_pods = saved;

        // A claim whose CDI spec hands a tenant's container every GPU: named with its
        // devices, under its own reason; the IMEX daemon in the driver's namespace is not.
        let daemon = |namespace: &str, exempt: Option<&str>| Binding {
            pod_uid: "u7".into(),
            container: "main".into(),
            namespace: namespace.into(),
            pod: "thief".into(),
            resource_name: Some("compute-domain.nvidia.com".into()),
            claims: vec![format!("{namespace}/steal")],
            gpu_uuids: vec!["GPU-0".into(), "GPU-1".into()],
            source: BindingSource::BeyondClaim,
            device_nodes: (0..6).map(|i| format!("/dev/nvidia{i}")).collect(),
            exempt: exempt.map(Into::into),
            ..Binding::default()
        };
        status.bindings = Some(vec![daemon("ml", None)]);
        let i = desired_conditions(Some(&status), &live);
        let i = find(&i, ISOLATED);
        assert_eq!(
            (i.status, i.reason.as_str()),
            ("False", "DevicesBeyondClaim")
        );
        assert!(
            i.message.contains(
                "ml/thief container main (the CDI spec of claim ml/steal hands it /dev/nvidia0, /dev/nvidia1, /dev/nvidia2, /dev/nvidia3 and 2 more, beyond what was allocated to it)"
            ),
            "{}",
            i.message
        );
        assert_eq!(summary(Some(&status), None).unwrap().allocated, Some(2));
        let own = daemon(
            "nvidia-dra-driver-gpu",
            Some("GpuPolicy default: namespace nvidia-dra-driver-gpu runs DRA drivers' own pods"),
        );
        let plugin = Binding {
            pod_uid: "u8".into(),
            container: "main".into(),
            namespace: "ml".into(),
            pod: "plugin-0".into(),
            resource_name: Some("nvidia.com/gpu".into()),
            gpu_uuids: vec!["GPU-0".into()],
            source: BindingSource::Allocated,
            ..Binding::default()
        };
        status.bindings = Some(vec![own, plugin]);
        let saved = status.privileged_pods.take();
        let i = desired_conditions(Some(&status), &live);
        assert_eq!(
            find(&i, ISOLATED).status,
            "True",
            "{:?}",
            find(&i, ISOLATED)
        );
        assert_eq!(summary(Some(&status), None).unwrap().allocated, Some(1));
        status.privileged_pods = saved;

        // Privileged pods alone break isolation too.
        status.bindings = Some(vec![]);
        let i = desired_conditions(Some(&status), &live);
        assert_eq!(find(&i, ISOLATED).reason, "PrivilegedGpuPods");
        assert!(
            !find(&i, ISOLATED).message.contains("dcgm-exporter"),
            "exempt pods are not named"
        );

        // Exempt privileged pods (GPU Operator components) leave the node isolated.
        status.privileged_pods.as_mut().unwrap().remove(0);
        let i = desired_conditions(Some(&status), &live);
        assert_eq!(find(&i, ISOLATED).status, "True");
        assert_eq!(
            summary(Some(&status), None).unwrap().privileged_pods,
            Some(0)
        );

        // An agent that found no GPUs at all is unhealthy, not healthy-with-zero.
        status.gpus = Some(vec![]);
        let c = desired_conditions(Some(&status), &live);
        assert_eq!(find(&c, HEALTHY).status, "False");
    }

    /// The agent creates nothing on the host, so any of the paths it reads may be missing:
    /// the condition says which, and a node without any runtime config is Unknown, not True.
    #[test]
    fn runtime_isolation_names_what_the_agent_found_missing() {
        let live = AgentLiveness::Live { expires: ts(100) };
        let with = |runtime: RuntimeStatus| GpuNodeStatus {
            runtime: Some(runtime),
            ..Default::default()
        };
        let none = with(RuntimeStatus {
            error: Some(
                "no NVIDIA container runtime config found on the node (... do not exist); \
                 /etc/cdi and /var/run/cdi do not exist"
                    .into(),
            ),
            ..Default::default()
        });
        let c = desired_conditions(Some(&none), &live);
        let r = find(&c, RUNTIME_ISOLATION);
        assert_eq!(
            (r.status, r.reason.as_str()),
            ("Unknown", "RuntimeConfigUnreadable")
        );
        assert!(
            r.message
                .contains("no NVIDIA container runtime config found on the node")
                && r.message.contains("/var/run/cdi do not exist"),
            "{}",
            r.message
        );

        let no_cdi = with(RuntimeStatus {
            accept_env_var_when_unprivileged: Some(false),
            error: Some("/etc/cdi and /var/run/cdi do not exist".into()),
            ..Default::default()
        });
        let c = desired_conditions(Some(&no_cdi), &live);
        let r = find(&c, RUNTIME_ISOLATION);
        assert_eq!(r.status, "True");
        assert_eq!(
            r.message,
            "unprivileged containers get GPUs only through the device plugin; no NVIDIA CDI \
             specs found (/etc/cdi and /var/run/cdi do not exist). Closed by the node: \
             NVIDIA_VISIBLE_DEVICES in unprivileged containers; not known: device-list volume \
             mounts (/var/run/nvidia-container-devices), NVIDIA_IMEX_CHANNELS requests, \
             cdi.k8s.io annotations naming NVIDIA CDI devices, device-injection annotations (NRI)"
        );
    }

    /// Each door is said to be closed by the node or only by admission, from what the agent
    /// read of the toolkit and the CRI.
    #[test]
    fn runtime_isolation_names_each_door() {
        let live = AgentLiveness::Live { expires: ts(100) };
        let status = |runtime: RuntimeStatus| GpuNodeStatus {
            gpus: Some(vec![gpu(0, true)]),
            runtime: Some(runtime),
            ..Default::default()
        };
        let gpu_operator = RuntimeStatus {
            accept_env_var_when_unprivileged: Some(false),
            accept_volume_mounts: Some(true),
            ignore_imex_channel_requests: Some(false),
            cdi_enabled: true,
            container_runtime: Some(gpuwarden_crds::ContainerRuntimeStatus {
                name: "containerd".into(),
                config_path: "/etc/containerd/config.toml".into(),
                default_runtime: Some("nvidia".into()),
                nvidia_default: Some(true),
                nvidia_handlers: vec!["nvidia".into()],
                cdi_enabled: Some(true),
                nri_enabled: Some(true),
            }),
            device_injectors: vec!["pod kube-system/nri-device-injector-x".into()],
            ..Default::default()
        };
        let c = desired_conditions(Some(&status(gpu_operator)), &live);
        let r = find(&c, RUNTIME_ISOLATION);
        assert_eq!(r.status, "True");
        assert!(
            r.message.ends_with(
                "Closed by the node: NVIDIA_VISIBLE_DEVICES in unprivileged containers; closed only \
                 by admission: device-list volume mounts (/var/run/nvidia-container-devices), \
                 NVIDIA_IMEX_CHANNELS requests, cdi.k8s.io annotations naming NVIDIA CDI devices, \
                 device-injection annotations (pod kube-system/nri-device-injector-x). Every \
                 container runs through NVIDIA's runtime (it is the CRI's default)"
            ),
            "{}",
            r.message
        );
        // No handler runs NVIDIA's runtime: nothing acts on its variables or mounts.
        let runc = RuntimeStatus {
            accept_env_var_when_unprivileged: Some(true),
            container_runtime: Some(gpuwarden_crds::ContainerRuntimeStatus {
                name: "containerd".into(),
                default_runtime: Some("runc".into()),
                nvidia_default: Some(false),
                cdi_enabled: Some(false),
                nri_enabled: Some(false),
                ..Default::default()
            }),
            ..Default::default()
        };
        let c = desired_conditions(Some(&status(runc)), &live);
        let r = find(&c, RUNTIME_ISOLATION);
        assert_eq!(r.status, "True", "{}", r.message);
        assert!(
            r.message.contains(
                "Closed by the node: NVIDIA_VISIBLE_DEVICES in unprivileged containers, device-list volume mounts"
            ) && r.message.ends_with("No CRI handler runs NVIDIA's runtime"),
            "{}",
            r.message
        );
    }

    /// RuntimePatched: False naming each advisory and the version to upgrade to, True only
    /// for a known version past every fix, Unknown with why otherwise.
    #[test]
    fn runtime_patched_follows_the_advisories() {
        use gpuwarden_crds::{ToolkitStatus, UnknownField};
        let live = AgentLiveness::Live { expires: ts(100) };
        let patched = |toolkit: Option<&str>, unknown: &[(&str, &str)]| {
            let status = GpuNodeStatus {
                gpus: Some(vec![gpu(0, true)]),
                runtime: Some(RuntimeStatus {
                    toolkit: toolkit.map(|v| ToolkitStatus {
                        version: v.into(),
                        source: "package nvidia-container-toolkit in /var/lib/dpkg/status".into(),
                    }),
                    unknown: (unknown.iter())
                        .map(|(f, r)| UnknownField {
                            field: (*f).into(),
                            reason: (*r).into(),
                        })
                        .collect(),
                    ..Default::default()
                }),
                ..Default::default()
            };
            find(&desired_conditions(Some(&status), &live), RUNTIME_PATCHED).clone()
        };
        let old = patched(Some("1.17.3-1"), &[]);
        assert_eq!(
            (old.status, old.reason.as_str()),
            ("False", "KnownVulnerabilities")
        );
        assert!(
            old.message.starts_with(
                "NVIDIA Container Toolkit 1.17.3-1 (package nvidia-container-toolkit in /var/lib/dpkg/status) is affected by CVE-2025-23359 (fixed in 1.17.4): "
            ) && old.message.contains("CVE-2025-23267 (fixed in 1.17.8)")
                && old.message.ends_with("upgrade to 1.17.8 or later"),
            "{}",
            old.message
        );
        let new = patched(Some("1.18.2"), &[]);
        assert_eq!(
            (new.status, new.reason.as_str()),
            ("True", "NoKnownVulnerabilities")
        );
        let rc = patched(Some("1.17.8~rc.1-1"), &[]);
        assert_eq!(rc.status, "False");
        let unknown = patched(
            None,
            &[("toolkit", "the RPM database in /var/lib/rpm is not read")],
        );
        assert_eq!(
            (unknown.status, unknown.reason.as_str()),
            ("Unknown", "VersionUnknown")
        );
        assert!(
            unknown
                .message
                .ends_with("the RPM database in /var/lib/rpm is not read")
        );
        let odd = patched(Some("latest"), &[]);
        assert_eq!(
            (odd.status, odd.reason.as_str()),
            ("Unknown", "VersionUnreadable")
        );
    }

    #[test]
    fn condition_types_are_those_desired_conditions_sets() {
        let desired = desired_conditions(None, &AgentLiveness::NoLease);
        let types: Vec<&str> = desired.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, CONDITION_TYPES);
    }

    #[test]
    fn mig_devices_count_their_parent_as_allocated() {
        let mut g = gpu(0, true);
        g.mig_devices = vec![MigDevice {
            uuid: "MIG-a".into(),
            ..Default::default()
        }];
        let status = GpuNodeStatus {
            gpus: Some(vec![g, gpu(1, true)]),
            bindings: Some(vec![Binding {
                gpu_uuids: vec!["MIG-a".into()],
                ..Default::default()
            }]),
            ..Default::default()
        };
        assert_eq!(summary(Some(&status), None).unwrap().allocated, Some(1));
    }

    #[test]
    fn unchanged_status_plans_no_write_and_transition_time_moves_only_on_change() {
        let live = AgentLiveness::Live { expires: ts(100) };
        let status = GpuNodeStatus {
            gpus: Some(vec![gpu(0, true)]),
            ..Default::default()
        };
        let desired = desired_conditions(Some(&status), &live);
        let first = plan_status(
            Some(&status),
            &desired,
            summary(Some(&status), None),
            ts(10),
        );
        let applied = first.apply.clone().unwrap();
        assert_eq!(first.transitions.len(), 6);
        assert!(
            applied
                .conditions
                .iter()
                .all(|c| c.last_transition_time == Time(ts(10)))
        );

        let mut current = status.clone();
        current.conditions = Some(applied.conditions.clone());
        current.summary = applied.summary.clone();
        let again = plan_status(
            Some(&current),
            &desired,
            summary(Some(&current), None),
            ts(50),
        );
        assert_eq!(again.apply, None);
        assert!(again.transitions.is_empty());

        // The agent goes silent: only AgentReady (and nothing else) transitions.
        let expired = AgentLiveness::Expired { expired: ts(100) };
        let desired = desired_conditions(Some(&current), &expired);
        let plan = plan_status(
            Some(&current),
            &desired,
            summary(Some(&current), None),
            ts(101),
        );
        let merged = plan.apply.unwrap().conditions;
        assert_eq!(plan.transitions.len(), 1);
        assert_eq!(plan.transitions[0].type_, AGENT_READY);
        assert_eq!(plan.transitions[0].to, "False");
        for c in &merged {
            let expect = if c.type_ == AGENT_READY {
                ts(101)
            } else {
                ts(10)
            };
            assert_eq!(c.last_transition_time, Time(expect), "{}", c.type_);
        }
        assert!(!wants_unhealthy_taint(&merged));
    }

    #[test]
    fn before_the_agent_reports_the_node_says_how_many_gpus() {
        let n = node(&[("nvidia.com/gpu", "8")], &[]);
        let from_node = Some(GpuNodeSummary {
            gpus: 8,
            gpus_from: GpusFrom::Node,
            healthy: None,
            allocated: None,
            privileged_pods: None,
            toolkit: None,
        });
        assert_eq!(summary(None, Some(&n)), from_node);
        assert_eq!(
            summary(Some(&GpuNodeStatus::default()), Some(&n)),
            from_node
        );

        // Time-slicing advertises replicas per GPU; feature discovery labels how many.
        let shared = node(
            &[("nvidia.com/gpu", "32")],
            &[("nvidia.com/gpu.replicas", "4")],
        );
        assert_eq!(summary(None, Some(&shared)).unwrap().gpus, 8);

        // MIG-only or label-only nodes do not say how many GPUs: no summary.
        let mig = node(&[("nvidia.com/mig-1g.10gb", "7")], &[]);
        assert_eq!(summary(None, Some(&mig)), None);
        let labelled = node(&[], &[(LABEL_GPU_PRESENT, "true")]);
        assert_eq!(summary(None, Some(&labelled)), None);

        // Once the agent reports, its inventory wins.
        let status = GpuNodeStatus {
            gpus: Some(vec![gpu(0, true)]),
            ..Default::default()
        };
        let s = summary(Some(&status), Some(&n)).unwrap();
        assert_eq!(
            (s.gpus, s.gpus_from, s.healthy),
            (1, GpusFrom::Agent, Some(1))
        );
    }

    #[test]
    fn truncated_lists_make_the_status_incomplete() {
        let live = AgentLiveness::Live { expires: ts(100) };
        let mut status = GpuNodeStatus {
            gpus: Some(vec![gpu(0, true)]),
            ..Default::default()
        };
        let c = desired_conditions(Some(&status), &live);
        assert_eq!(find(&c, STATUS_COMPLETE).status, "True");

        status.truncated = Some(Truncated {
            bindings: 37,
            privileged_pods: 2,
            ..Default::default()
        });
        let c = desired_conditions(Some(&status), &live);
        let complete = find(&c, STATUS_COMPLETE);
        assert_eq!(
            (complete.status, complete.reason.as_str()),
            ("False", "ListsTruncated")
        );
        assert!(
            complete
                .message
                .contains("left out 37 bindings, 2 privileged pods;"),
            "{}",
            complete.message
        );
    }

    /// Two VMs given the two functions of one GPU share its IOMMU group, and each can open
    /// the other's device: named, with the group and the devices. One VM holding the group,
    /// or two containers of one pod, leave the node isolated.
    #[test]
    fn pods_sharing_an_iommu_group_are_not_isolated() {
        use gpuwarden_crds::node::{IommuGroupHold, VfioDevice};
        let live = AgentLiveness::Live {
            expires: ts(2_000_000_000),
        };
        let device = |resource: &str, id: &str| VfioDevice {
            resource_name: resource.into(),
            device_id: id.into(),
            driver: None,
        };
        let a6000 = device("nvidia.com/GA102GL_RTX_A6000", "0000:81:00.0");
        let audio = device(
            "nvidia.com/GA102_HIGH_DEFINITION_AUDIO_CONTROLLER",
            "0000:81:00.1",
        );
        let vm = |pod: &str, container: &str, allocated: &VfioDevice, other: &VfioDevice| Binding {
            pod_uid: format!("u-{pod}"),
            container: container.into(),
            namespace: "vms".into(),
            pod: pod.into(),
            resource_name: Some(allocated.resource_name.clone()),
            source: BindingSource::IommuGroup,
            iommu_groups: vec![IommuGroupHold {
                group: 13,
                allocated: vec![allocated.clone()],
                others: vec![other.clone()],
            }],
            ..Binding::default()
        };
        let mut status = GpuNodeStatus {
            gpus: Some(vec![]),
            bindings: Some(vec![
                vm("vm-a", "compute", &a6000, &audio),
                vm("vm-b", "compute", &audio, &a6000),
            ]),
            ..Default::default()
        };
        let c = desired_conditions(Some(&status), &live);
        let i = find(&c, ISOLATED);
        assert_eq!((i.status, i.reason.as_str()), ("False", "SharedIommuGroup"));
        assert!(
            i.message.ends_with(
                "group 13: vms/vm-a container compute (nvidia.com/GA102GL_RTX_A6000 0000:81:00.0) and vms/vm-b container compute (nvidia.com/GA102_HIGH_DEFINITION_AUDIO_CONTROLLER 0000:81:00.1)"
            ),
            "{}",
            i.message
        );
        assert_eq!(summary(Some(&status), None).unwrap().allocated, Some(0));

        // Out-of-band use is named first.
        let mut rogue = vm("rogue", "main", &a6000, &audio);
        (rogue.source, rogue.iommu_groups) = (BindingSource::Observed, vec![]);
        status.bindings.as_mut().unwrap().push(rogue);
        let c = desired_conditions(Some(&status), &live);
        assert_eq!(find(&c, ISOLATED).reason, "OutOfBandGpuUse");

        let isolated = |bindings: Vec<Binding>| {
            let status = GpuNodeStatus {
                gpus: Some(vec![]),
                bindings: Some(bindings),
                ..Default::default()
            };
            let c = desired_conditions(Some(&status), &live);
            let i = find(&c, ISOLATED);
            (i.status, i.reason.clone())
        };
        let yes = ("True", "NoOutOfBandUse".to_owned());
        assert_eq!(isolated(vec![vm("vm-a", "compute", &a6000, &audio)]), yes);
        assert_eq!(
            isolated(vec![
                vm("vm-a", "compute", &a6000, &audio),
                vm("vm-a", "sidecar", &audio, &a6000),
            ]),
            yes,
            "one pod"
        );
    }

    #[test]
    fn truncated_vfio_lists_are_named() {
        let cut = Truncated {
            iommu_groups: 2,
            iommu_group_devices: 5,
            ..Default::default()
        };
        assert_eq!(
            describe_truncated(&cut),
            "2 IOMMU groups, 5 devices of IOMMU groups"
        );
    }
}
