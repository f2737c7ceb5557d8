//! The agent's part of `GpuNode.status`, computed from one sweep's readings. Pure: the same
//! inputs give the same value, sorted, so "did it change" is a plain comparison.

use std::collections::{BTreeMap, BTreeSet};

use gpuwarden_crds::bounds;
use gpuwarden_crds::node::{IommuGroupHold, VfioDevice, fit_vfio};
use gpuwarden_crds::{
    Binding, BindingSource, GpuNodeStatus, GpuStatus, HealthState, PodRef, RuntimeStatus,
};

use gpuwarden_crds::injection::GpuName;

use crate::backend::Reading;
use crate::cdi::{CdiDevices, NvidiaNode};
use crate::cgroup::ContainerRef;
use crate::health::HealthTracker;
use crate::kai::KaiBinds;
use crate::podresources::{Allocation, ClaimUse, DeviceMap};
use crate::pods::PodIndex;
use crate::vfio::{VfioHold, VfioInventory};
use gpuwarden_crds::sharing::{KAI_GPU_GROUP_LABEL, KAI_RESERVATION_APP};

/// A compute process NVML reported, with the pod container it belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObservedProcess {
    /// GPU or MIG device UUID.
    pub device_uuid: String,
    /// Process id.
    pub pid: u32,
    /// Its pod and container; `None` for a process outside any pod (a host service).
    pub container: Option<ContainerRef>,
    /// GPU memory it holds, bytes, when NVML says.
    pub used_memory_bytes: Option<u64>,
    /// Its share of the GPU's SM time, percent, when NVML samples it.
    pub sm_util_percent: Option<u32>,
}

/// Who holds a GPU, for metric labels.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Holder {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Container name.
    pub container: String,
}

/// How a holder came to hold a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HolderSource {
    /// The kubelet allocated it; no process of the container was seen on it.
    Allocated,
    /// A process of the container runs on it, but the kubelet allocated it nothing there.
    Observed,
    /// Allocated and seen in use.
    Both,
    /// A process of the container runs on it, which a GPU-sharing scheduler granted it
    /// ([`BindingSource::Shared`]).
    Shared,
}

impl HolderSource {
    /// The metric label value: `allocated`, `observed`, `both` or `shared`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Allocated => "allocated",
            Self::Observed => "observed",
            Self::Both => "both",
            Self::Shared => "shared",
        }
    }
}

/// What one container's processes use of one GPU, summed over the processes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// GPU memory, bytes; `None` when no process of it reported its memory.
    pub memory_bytes: Option<u64>,
    /// Share of the GPU's SM time, percent; `None` unless NVML sampled every process of it.
    pub sm_util_percent: Option<u32>,
}

/// One holder of a GPU: who, how, and what it uses there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldBy {
    /// The pod container.
    pub holder: Holder,
    /// Allocated, observed or both, on this GPU.
    pub source: HolderSource,
    /// What its processes use of this GPU; both `None` when none was seen.
    pub usage: Usage,
}

/// Everything one sweep produces besides the raw readings.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Computed {
    /// The agent's status fields.
    pub status: GpuNodeStatus,
    /// Holders per physical GPU UUID (allocated or observed), sorted.
    pub holders: BTreeMap<String, Vec<HeldBy>>,
    /// Processes outside any pod, per physical GPU UUID.
    pub host_processes: BTreeMap<String, u32>,
}

/// The inputs of [`compute`].
pub struct StatusInput<'a> {
    /// This sweep's GPU reading.
    pub reading: &'a Reading,
    /// Health so far.
    pub health: &'a HealthTracker,
    /// GPU allocations from the kubelet.
    pub allocations: &'a [Allocation],
    /// Compute processes with their pods.
    pub observed: &'a [ObservedProcess],
    /// The pods on the node.
    pub pods: &'a PodIndex<'a>,
    /// Device IDs to UUIDs.
    pub devices: &'a DeviceMap,
    /// Runtime diagnostics.
    pub runtime: &'a RuntimeStatus,
    /// KAI-Scheduler's binds of fraction pods on this node.
    pub kai: &'a KaiBinds,
    /// The claims each container uses, from the kubelet.
    pub claims: &'a [ClaimUse],
    /// The CDI devices defined on the node.
    pub cdi: &'a CdiDevices,
    /// The VFIO devices the kubelet advertises, with their IOMMU groups.
    pub vfio: &'a VfioInventory,
    /// Which of them the kubelet allocated to which container.
    pub vfio_holds: &'a [VfioHold],
}

#[derive(Default)]
struct Entry {
    namespace: String,
    pod: String,
    resource_name: Option<String>,
    /// ResourceClaims the allocation came through.
    claims: BTreeSet<String>,
    allocated: BTreeSet<String>,
    observed: BTreeSet<String>,
    /// Per physical GPU: memory and SM share of the processes seen, and whether every one
    /// had a utilisation sample.
    usage: BTreeMap<String, (Option<u64>, u32, bool)>,
}

/// The entries of the containers, by pod UID and container name.
type Entries = BTreeMap<(String, String), Entry>;

impl Entry {
    /// Adds what process `p` uses of the physical GPU `gpu`.
    fn add_usage(&mut self, gpu: String, p: &ObservedProcess) {
        let usage = self.usage.entry(gpu).or_insert((None, 0, true));
        if let Some(bytes) = p.used_memory_bytes {
            usage.0 = Some(usage.0.unwrap_or(0).saturating_add(bytes));
        }
        match p.sm_util_percent {
            Some(util) => usage.1 = usage.1.saturating_add(util),
            None => usage.2 = false,
        }
    }
}

/// The reservation pods (`namespace/name`) whose GPUs KAI-Scheduler granted the container
/// `container` of the pod with `pod_uid`, which holds no GPU of its own (`entry`), when it
/// uses no other: it is the pod's KAI fraction container under a policy that names KAI, and
/// each GPU its processes run on is one the kubelet allocated to a reservation pod, in the
/// policy's reservation namespace, of a GPU group the pod's BindRequest names. `None`
/// otherwise, which leaves the use out of band ([`crate::kai`]).
fn kai_grant(
    input: &StatusInput<'_>,
    pod_uid: &str,
    container: &str,
    entry: &Entry,
) -> Option<Vec<String>> {
    let pod = input.pods.by_uid(pod_uid)?;
    let kai = pod.kai.as_ref().filter(|k| k.container == container)?;
    let groups = input.kai.groups(pod_uid, &pod.namespace);
    let (app, app_value) = KAI_RESERVATION_APP;
    let reservations: Vec<&crate::pods::PodInfo> = (input.pods.all().iter())
        .filter(|r| {
            r.namespace == kai.reservation_namespace
                && r.labels.get(app).map(String::as_str) == Some(app_value)
                && (r.labels.get(KAI_GPU_GROUP_LABEL)).is_some_and(|g| groups.contains(g))
        })
        .collect();
    let mut from = BTreeSet::new();
    for used in &entry.observed {
        let gpu = parent(input.devices, used);
        let holder = reservations.iter().find(|r| {
            (input.allocations.iter()).any(|a| {
                a.namespace == r.namespace
                    && a.pod == r.name
                    && (a.device_uuids.iter()).any(|u| parent(input.devices, u) == gpu)
            })
        })?;
        from.insert(format!("{}/{}", holder.namespace, holder.name));
    }
    Some(from.into_iter().collect())
}

/// Computes the agent's status fields and the metric holders: the kubelet's allocations
/// and NVML's processes give one binding per container, each other source adds to them or
/// adds its own, and the status is cut to the CRD's bounds at the end.
pub fn compute(input: &StatusInput<'_>) -> Computed {
    let mut entries = Entries::new();
    allocated_entries(input, &mut entries);
    let processes = observed_entries(input, &mut entries);
    let (mut bindings, holders) = entry_bindings(input, entries);
    injected_bindings(input, &mut bindings);
    beyond_claim_bindings(input, &mut bindings);
    iommu_group_bindings(input, &mut bindings);
    let privileged = privileged_pods(input, processes.privileged_pods, &bindings);
    let mut status = GpuNodeStatus {
        driver: Some(input.reading.driver.clone()),
        gpus: Some(gpu_statuses(input)),
        bindings: Some(bindings),
        privileged_pods: Some(privileged),
        runtime: Some(input.runtime.clone()),
        vfio: input.vfio.status(),
        truncated: None,
        conditions: None,
        summary: None,
    };
    // The metrics keep every holder; only the status is cut to the CRD's bounds.
    bounds::fit_status(&mut status);
    fit_vfio(&mut status);
    Computed {
        status,
        holders,
        host_processes: processes.host_processes,
    }
}

/// Each GPU NVML reports, with its health so far.
fn gpu_statuses(input: &StatusInput<'_>) -> Vec<GpuStatus> {
    input
        .reading
        .gpus
        .iter()
        .map(|g| GpuStatus {
            index: g.info.index,
            uuid: g.info.uuid.clone(),
            model: g.info.model.clone(),
            memory_mi_b: g.info.memory_mib,
            pci_bus_id: g.info.pci_bus_id.clone(),
            minor_number: g.info.minor_number,
            mig_mode: g.info.mig_mode.clone(),
            mig_devices: g.info.mig_devices.clone(),
            health: input.health.health(&g.info.uuid),
        })
        .collect()
}

/// Records what the kubelet allocated each container: a device plugin's devices and a DRA
/// driver's, with the claims they came through.
fn allocated_entries(input: &StatusInput<'_>, entries: &mut Entries) {
    for a in input.allocations {
        let uid = match input.pods.by_name(&a.namespace, &a.pod) {
            Some(p) => p.uid.clone(),
            // The pod is gone from the API but the kubelet still lists it: skip until it
            // settles. Without an API (inspect) there is no UID to give.
            None if input.pods.authoritative() => continue,
            None => String::new(),
        };
        let e = entries.entry((uid, a.container.clone())).or_default();
        e.namespace.clone_from(&a.namespace);
        e.pod.clone_from(&a.pod);
        if e.resource_name.is_none() {
            e.resource_name = Some(a.resource_name.clone());
        }
        e.claims.extend(a.claim.iter().cloned());
        e.allocated.extend(a.device_uuids.iter().cloned());
    }
}

/// What NVML's processes say besides the devices each container uses.
struct ProcessesSeen {
    /// Processes outside any pod, per physical GPU UUID.
    host_processes: BTreeMap<String, u32>,
    /// UIDs of the pods a process of a privileged container runs in.
    privileged_pods: BTreeSet<String>,
}

/// Records the devices each container's processes run on, and what they use there.
fn observed_entries(input: &StatusInput<'_>, entries: &mut Entries) -> ProcessesSeen {
    let mut seen = ProcessesSeen {
        host_processes: BTreeMap::new(),
        privileged_pods: BTreeSet::new(),
    };
    for p in input.observed {
        let Some(cref) = &p.container else {
            let gpu = parent(input.devices, &p.device_uuid);
            *seen.host_processes.entry(gpu).or_default() += 1;
            continue;
        };
        let pod = input.pods.by_uid(&cref.pod_uid);
        let container = container_name(input, cref, pod);
        let (uid, namespace, name) = match pod {
            Some(pod) => (pod.uid.clone(), pod.namespace.clone(), pod.name.clone()),
            None => (cref.pod_uid.clone(), String::new(), String::new()),
        };
        if let Some(pod) = pod
            && pod
                .containers
                .iter()
                .any(|c| c.name == container && c.privileged)
        {
            seen.privileged_pods.insert(pod.uid.clone());
        }
        let e = entries.entry((uid, container)).or_default();
        if e.pod.is_empty() {
            e.namespace = namespace;
            e.pod = name;
        }
        e.observed.insert(p.device_uuid.clone());
        e.add_usage(parent(input.devices, &p.device_uuid), p);
    }
    seen
}

/// The name of the container a process's cgroup names in `pod`: the one with its ID, else
/// the pod's only one, else its short ID.
fn container_name(
    input: &StatusInput<'_>,
    cref: &ContainerRef,
    pod: Option<&crate::pods::PodInfo>,
) -> String {
    let by_id = cref
        .container_id
        .as_deref()
        .and_then(|id| input.pods.by_container_id(id));
    let only_container = pod.and_then(|p| match p.containers.as_slice() {
        [single] => Some(single.name.clone()),
        _ => None,
    });
    match (by_id, only_container, &cref.container_id) {
        (Some((_, name)), _, _) => name.to_owned(),
        // A restarted container whose new id the pod status does not show yet.
        (None, Some(name), _) => name,
        // Otherwise name it by its short id.
        (None, None, Some(id)) => id.chars().take(12).collect(),
        (None, None, None) => String::new(),
    }
}

/// One binding per container the kubelet allocated devices to or NVML saw using one, and
/// the holders of each physical GPU, sorted.
fn entry_bindings(
    input: &StatusInput<'_>,
    entries: Entries,
) -> (Vec<Binding>, BTreeMap<String, Vec<HeldBy>>) {
    let mut bindings = Vec::with_capacity(entries.len());
    let mut holders: BTreeMap<String, Vec<HeldBy>> = BTreeMap::new();
    for ((pod_uid, container), e) in entries {
        let shared_from = match e.allocated.is_empty() {
            true => kai_grant(input, &pod_uid, &container, &e),
            false => None,
        };
        let holder = Holder {
            namespace: e.namespace.clone(),
            pod: e.pod.clone(),
            container: container.clone(),
        };
        add_holders(input, &mut holders, holder, &e, shared_from.is_some());
        bindings.push(entry_binding(input, pod_uid, container, e, shared_from));
    }
    for list in holders.values_mut() {
        list.sort_by(|a, b| a.holder.cmp(&b.holder));
    }
    (bindings, holders)
}

/// The binding of one container's entry; `shared_from` is the KAI grant of its GPUs.
fn entry_binding(
    input: &StatusInput<'_>,
    pod_uid: String,
    container: String,
    e: Entry,
    shared_from: Option<Vec<String>>,
) -> Binding {
    let explained = e.observed.iter().all(|o| {
        e.allocated.iter().any(|a| {
            a == o
                || input.devices.parent(o) == Some(a.as_str())
                || input.devices.parent(a) == Some(o.as_str())
        })
    });
    let source = match (e.allocated.is_empty(), e.observed.is_empty()) {
        (false, true) => BindingSource::Allocated,
        (false, false) if explained => BindingSource::AllocatedAndObserved,
        (true, false) if shared_from.is_some() => BindingSource::Shared,
        // Observed only, or on GPUs beyond the allocation: out of band.
        _ => BindingSource::Observed,
    };
    let gpu_uuids: Vec<String> = e.allocated.union(&e.observed).cloned().collect();
    Binding {
        pod_uid,
        container,
        namespace: e.namespace,
        pod: e.pod,
        resource_name: e.resource_name,
        claims: e.claims.into_iter().collect(),
        gpu_uuids,
        source,
        shared_from: shared_from.unwrap_or_default(),
        device_nodes: Vec::new(),
        iommu_groups: Vec::new(),
        exempt: None,
    }
}

/// Adds `holder` to each physical GPU its entry `e` was allocated or seen on, with what it
/// uses there; `shared` when KAI granted it the GPUs it was seen on.
fn add_holders(
    input: &StatusInput<'_>,
    holders: &mut BTreeMap<String, Vec<HeldBy>>,
    holder: Holder,
    e: &Entry,
    shared: bool,
) {
    // Per physical GPU: allocated there, seen there, or both.
    let mut per_gpu: BTreeMap<String, (bool, bool)> = BTreeMap::new();
    for u in &e.allocated {
        per_gpu.entry(parent(input.devices, u)).or_default().0 = true;
    }
    for u in &e.observed {
        per_gpu.entry(parent(input.devices, u)).or_default().1 = true;
    }
    for (gpu, (allocated, observed)) in per_gpu {
        let source = match (allocated, observed) {
            (true, true) => HolderSource::Both,
            (true, false) => HolderSource::Allocated,
            _ if shared => HolderSource::Shared,
            _ => HolderSource::Observed,
        };
        let usage = e
            .usage
            .get(&gpu)
            .map_or(Usage::default(), |&(memory, sm, sampled)| Usage {
                memory_bytes: memory,
                sm_util_percent: sampled.then_some(sm.min(100)),
            });
        let list = holders.entry(gpu).or_default();
        match list.iter_mut().find(|h| h.holder == holder) {
            // The same name under two pod UIDs (a pod replaced in between): one holder.
            Some(held) if held.source != source => held.source = HolderSource::Both,
            Some(_) => {}
            None => list.push(HeldBy {
                holder: holder.clone(),
                source,
                usage,
            }),
        }
    }
}

/// The privileged GPU pods: those a process of a privileged container was seen in
/// (`observed`), those whose spec shows a privileged GPU container, and those with a
/// privileged container the kubelet allocated GPUs to.
fn privileged_pods(
    input: &StatusInput<'_>,
    observed: BTreeSet<String>,
    bindings: &[Binding],
) -> Vec<PodRef> {
    let mut privileged: BTreeMap<String, PodRef> = BTreeMap::new();
    for uid in observed {
        if let Some(p) = input.pods.by_uid(&uid) {
            privileged.insert(uid.clone(), pod_ref(p));
        }
    }
    for p in input.pods.all() {
        if p.has_privileged_gpu_container() {
            privileged.insert(p.uid.clone(), pod_ref(p));
        }
    }
    // A privileged container the kubelet allocated GPUs to holds GPUs whatever its spec
    // shows: a DRA claim says nothing of its device class in the pod alone.
    for b in bindings
        .iter()
        .filter(|b| b.source != BindingSource::Observed)
    {
        if let Some(p) = input.pods.by_uid(&b.pod_uid)
            && (p.containers.iter()).any(|c| c.privileged && c.name == b.container)
        {
            privileged.insert(p.uid.clone(), pod_ref(p));
        }
    }
    privileged.into_values().collect()
}

/// Adds what the pods' device-injection annotations name beyond what the kubelet allocated
/// to the pod (docs/design.md, "Device-injection annotations"): admission let the annotation
/// through because it names no more GPUs than the pod holds, and here the node says whether
/// they are the pod's. Each GPU named and allocated to no container of the pod makes the
/// container the annotation reaches an `Injected` holder of it; a container that holds an
/// allocation already has it marked so, with the GPUs added. A name no GPU of this node
/// answers to (the plugin then injects nothing) is left out.
fn injected_bindings(input: &StatusInput<'_>, bindings: &mut Vec<Binding>) {
    for pod in (input.pods.all().iter()).filter(|p| !p.injected.is_empty()) {
        let allocated: BTreeSet<String> = (bindings.iter())
            .filter(|b| b.pod_uid == pod.uid && !b.is_out_of_band())
            .flat_map(|b| b.gpu_uuids.iter().map(|u| parent(input.devices, u)))
            .collect();
        for (target, names) in &pod.injected {
            let beyond: BTreeSet<String> = (names.iter())
                .filter_map(|n| named_gpu(input, n))
                .filter(|uuid| !allocated.contains(uuid))
                .collect();
            if beyond.is_empty() {
                continue;
            }
            let reached: Vec<&str> = match target {
                Some(c) => vec![c.as_str()],
                None => pod.containers.iter().map(|c| c.name.as_str()).collect(),
            };
            for container in reached {
                match (bindings.iter_mut())
                    .find(|b| b.pod_uid == pod.uid && b.container == container)
                {
                    Some(b) => {
                        b.source = BindingSource::Injected;
                        for uuid in &beyond {
                            if !b.gpu_uuids.contains(uuid) {
                                b.gpu_uuids.push(uuid.clone());
                            }
                        }
                    }
                    None => bindings.push(Binding {
                        pod_uid: pod.uid.clone(),
                        container: container.to_owned(),
                        namespace: pod.namespace.clone(),
                        pod: pod.name.clone(),
                        gpu_uuids: beyond.iter().cloned().collect(),
                        source: BindingSource::Injected,
                        ..Binding::default()
                    }),
                }
            }
        }
    }
}

/// Adds what the containers' claims' CDI specs give them beyond what the kubelet allocated
/// to them (docs/design.md, "What a claim's CDI spec hands out"). For each claim, the
/// device nodes of its CDI devices (each device's edits and its spec's) are judged by the
/// host node the runtime opens: a GPU no resource or claim of the container was allocated,
/// or an IMEX channel where none of its claims was allocated a channel, is beyond the
/// allocation. The compute-domain driver hands a channel claim in `AllocationMode: All`
/// every channel of the node, all of them the one domain's: a container allocated a
/// channel holds them. The container becomes a `BeyondClaim` holder naming the claims, the
/// GPUs among its `gpuUuids` and every node beyond in `deviceNodes`, exempt where its pod
/// runs in a driver's own namespace. A CDI device no spec
/// defines gives nothing here (the agent says which in its log).
fn beyond_claim_bindings(input: &StatusInput<'_>, bindings: &mut Vec<Binding>) {
    type Key<'k> = (&'k str, &'k str, &'k str);
    let mut per_container: BTreeMap<Key<'_>, Vec<&ClaimUse>> = BTreeMap::new();
    for c in input.claims {
        (per_container
            .entry((&c.namespace, &c.pod, &c.container))
            .or_default())
        .push(c);
    }
    for ((namespace, pod_name, container), claims) in per_container {
        let pod = input.pods.by_name(namespace, pod_name);
        if pod.is_none() && input.pods.authoritative() {
            continue;
        }
        let allocated: BTreeSet<String> = (input.allocations.iter())
            .filter(|a| a.namespace == namespace && a.pod == pod_name && a.container == container)
            .flat_map(|a| a.device_uuids.iter().map(|u| parent(input.devices, u)))
            .collect();
        let holds_channel = claims.iter().any(|c| c.imex_channel);
        let mut gpus = BTreeSet::new();
        let mut nodes = BTreeSet::new();
        let mut by = BTreeSet::new();
        let mut drivers = BTreeSet::new();
        for claim in &claims {
            let mut beyond = false;
            for node in (claim.cdi_devices.iter())
                .filter_map(|name| input.cdi.nodes(name))
                .flatten()
            {
                match node.nvidia() {
                    Some(NvidiaNode::Gpu(minor)) => {
                        if let Some(uuid) = input.devices.by_minor(minor)
                            && !allocated.contains(&uuid)
                        {
                            beyond = true;
                            gpus.insert(uuid);
                            nodes.insert(node.host().to_owned());
                        }
                    }
                    Some(NvidiaNode::ImexChannel(_)) if !holds_channel => {
                        beyond = true;
                        nodes.insert(node.host().to_owned());
                    }
                    _ => {}
                }
            }
            if beyond {
                by.insert(claim.claim.clone());
                drivers.extend(claim.drivers.iter().cloned());
            }
        }
        if by.is_empty() {
            continue;
        }
        let exempt = pod.and_then(|p| p.claims_exempt.clone());
        let binding = binding_of(
            bindings,
            Binding {
                pod_uid: pod.map(|p| p.uid.clone()).unwrap_or_default(),
                container: container.to_owned(),
                namespace: namespace.to_owned(),
                pod: pod_name.to_owned(),
                resource_name: drivers.into_iter().next(),
                ..Binding::default()
            },
        );
        binding.source = BindingSource::BeyondClaim;
        binding.exempt = exempt;
        for claim in by {
            if !binding.claims.contains(&claim) {
                binding.claims.push(claim);
            }
        }
        for uuid in gpus {
            if !binding.gpu_uuids.contains(&uuid) {
                binding.gpu_uuids.push(uuid);
            }
        }
        binding.device_nodes.extend(nodes);
    }
}

/// Adds the IOMMU groups the containers hold whole (docs/design.md, "Whole IOMMU
/// groups"): a VFIO device plugin hands a container the device node of each allocated
/// device's group, and with it every device of the group. Of the groups that back more than
/// one advertised device, each one a container was allocated a device of is named in its
/// binding's `iommuGroups`, with the devices it was allocated and the others it gets with
/// them. A container holding nothing else is an `IommuGroup` holder; an `Allocated` one
/// becomes one; any other source is kept, as it says more. A group backing one device
/// gives nothing beyond the allocation and is left out.
fn iommu_group_bindings(input: &StatusInput<'_>, bindings: &mut Vec<Binding>) {
    let shared = input.vfio.shared_groups();
    if shared.is_empty() {
        return;
    }
    type Key<'k> = (&'k str, &'k str, &'k str);
    let mut per_container: BTreeMap<Key<'_>, BTreeMap<u32, BTreeSet<VfioDevice>>> = BTreeMap::new();
    for hold in input.vfio_holds {
        let Some(device) = input.vfio.get(&hold.resource, &hold.id) else {
            continue;
        };
        if !shared.contains_key(&device.sysfs.group) {
            continue;
        }
        (per_container
            .entry((&hold.namespace, &hold.pod, &hold.container))
            .or_default()
            .entry(device.sysfs.group)
            .or_default())
        .insert(device.named(false));
    }
    for ((namespace, pod_name, container), groups) in per_container {
        let pod = input.pods.by_name(namespace, pod_name);
        if pod.is_none() && input.pods.authoritative() {
            continue;
        }
        let held: Vec<IommuGroupHold> = (groups.into_iter())
            .map(|(group, allocated)| IommuGroupHold {
                group,
                others: (shared.get(&group).into_iter().flatten())
                    .map(|d| d.named(false))
                    .filter(|d| !allocated.contains(d))
                    .collect(),
                allocated: allocated.into_iter().collect(),
            })
            .collect();
        let binding = binding_of(
            bindings,
            Binding {
                pod_uid: pod.map(|p| p.uid.clone()).unwrap_or_default(),
                container: container.to_owned(),
                namespace: namespace.to_owned(),
                pod: pod_name.to_owned(),
                resource_name: (held.iter())
                    .flat_map(|h| h.allocated.first())
                    .map(|d| d.resource_name.clone())
                    .next(),
                source: BindingSource::IommuGroup,
                ..Binding::default()
            },
        );
        if binding.source == BindingSource::Allocated {
            binding.source = BindingSource::IommuGroup;
        }
        binding.iommu_groups = held;
    }
}

/// The binding of the container `new` names (pod UID, namespace, pod and container), or
/// `new` itself, added, where there is none yet. By name too: without an API (inspect)
/// every pod's UID is empty.
fn binding_of(bindings: &mut Vec<Binding>, new: Binding) -> &mut Binding {
    let same = |b: &Binding| {
        b.pod_uid == new.pod_uid
            && b.container == new.container
            && b.namespace == new.namespace
            && b.pod == new.pod
    };
    match bindings.iter().position(same) {
        Some(i) => &mut bindings[i],
        None => {
            bindings.push(new);
            bindings.last_mut().expect("pushed")
        }
    }
}

/// The UUID of the GPU of this node an injection names: by minor number (`/dev/nvidia<N>`,
/// `195:<N>`), or by what follows `=` in a CDI name: an index, a GPU UUID, a MIG device
/// (its GPU), or NVIDIA's DRA driver's `gpu-<minor>`.
fn named_gpu(input: &StatusInput<'_>, name: &GpuName) -> Option<String> {
    let gpus = &input.reading.gpus;
    match name {
        GpuName::Minor(n) => input.devices.by_minor(*n),
        // The plugin resolves no such path to a GPU of this node.
        GpuName::Text(_) => None,
        GpuName::Cdi(id) => {
            if let Ok(index) = id.parse::<u32>() {
                return (gpus.iter())
                    .find(|g| g.info.index == index)
                    .map(|g| g.info.uuid.clone());
            }
            if let Some(minor) = id.strip_prefix("gpu-").and_then(|m| m.parse().ok()) {
                return input.devices.by_minor(minor);
            }
            let uuid = parent(input.devices, id);
            (gpus.iter()).find(|g| g.info.uuid == uuid).map(|_| uuid)
        }
    }
}

fn pod_ref(p: &crate::pods::PodInfo) -> PodRef {
    PodRef {
        uid: p.uid.clone(),
        namespace: p.namespace.clone(),
        name: p.name.clone(),
        exempt: p.exempt.clone(),
    }
}

fn parent(devices: &DeviceMap, uuid: &str) -> String {
    devices.parent(uuid).unwrap_or(uuid).to_owned()
}

/// Only the agent's fields of a status, with empty lists and absent lists made equal, so a
/// status read back from the API compares equal to the one that was applied.
pub fn agent_fields(status: &GpuNodeStatus) -> GpuNodeStatus {
    fn non_empty<T: Clone>(v: &Option<Vec<T>>) -> Option<Vec<T>> {
        v.as_ref().filter(|v| !v.is_empty()).cloned()
    }
    GpuNodeStatus {
        driver: status.driver.clone(),
        gpus: non_empty(&status.gpus),
        bindings: non_empty(&status.bindings),
        privileged_pods: non_empty(&status.privileged_pods),
        runtime: status.runtime.clone(),
        vfio: status.vfio.clone(),
        truncated: status.truncated.clone(),
        conditions: None,
        summary: None,
    }
}

/// Counts for logs: (GPUs, healthy, out-of-band bindings).
pub fn counts(status: &GpuNodeStatus) -> (usize, usize, usize) {
    let gpus = status.gpus.as_deref().unwrap_or_default();
    let healthy = gpus
        .iter()
        .filter(|g| g.health.state == HealthState::Healthy)
        .count();
    let oob = status
        .bindings
        .iter()
        .flatten()
        .filter(|b| b.is_out_of_band())
        .count();
    (gpus.len(), healthy, oob)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{GpuInfo, GpuReading, Telemetry};
    use crate::pods::{ContainerInfo, PodInfo};

    fn reading() -> Reading {
        Reading {
            driver: Default::default(),
            gpus: vec![GpuReading {
                info: GpuInfo {
                    uuid: "GPU-a".into(),
                    ..Default::default()
                },
                answering: true,
                never_answered: false,
                telemetry: Telemetry::default(),
                ecc_uncorrected: None,
                pages_pending_retirement: None,
                row_remapping_pending: None,
                row_remapping_failed: None,
                processes: vec![],
            }],
        }
    }

    /// GPU-a and GPU-b, minor numbers 0 and 1.
    fn two_gpus() -> Reading {
        let mut r = reading();
        r.gpus[0].info.minor_number = Some(0);
        let mut other = r.gpus[0].clone();
        other.info.uuid = "GPU-b".into();
        other.info.index = 1;
        other.info.minor_number = Some(1);
        r.gpus.push(other);
        r
    }

    fn observed(uid: &str, id: &str) -> ObservedProcess {
        ObservedProcess {
            device_uuid: "GPU-a".into(),
            pid: 1,
            container: Some(ContainerRef {
                pod_uid: uid.into(),
                container_id: Some(id.into()),
            }),
            used_memory_bytes: None,
            sm_util_percent: None,
        }
    }

    /// A pod `namespace/name` (UID `u1`) with one unprivileged container `main`.
    fn one_pod(namespace: &str, name: &str, container_id: &str) -> Vec<PodInfo> {
        vec![PodInfo {
            uid: "u1".into(),
            namespace: namespace.into(),
            name: name.into(),
            mirror_uid: None,
            service_account: String::new(),
            labels: Default::default(),
            exempt: None,
            claims_exempt: None,
            kai: None,
            injected: Vec::new(),
            containers: vec![ContainerInfo {
                name: "main".into(),
                image: String::new(),
                container_id: Some(container_id.into()),
                privileged: false,
                gpu: false,
            }],
        }]
    }

    fn run(pods: &[PodInfo], observed: &[ObservedProcess]) -> Computed {
        run_allocated(pods, &[], observed)
    }

    fn run_allocated(
        pods: &[PodInfo],
        allocations: &[Allocation],
        observed: &[ObservedProcess],
    ) -> Computed {
        compute_on(
            &reading(),
            pods,
            allocations,
            observed,
            &[],
            &CdiDevices::default(),
        )
    }

    /// [`compute`] on `r` and `pods`, with no health history, runtime or KAI binds.
    fn compute_on(
        r: &Reading,
        pods: &[PodInfo],
        allocations: &[Allocation],
        observed: &[ObservedProcess],
        claims: &[ClaimUse],
        cdi: &CdiDevices,
    ) -> Computed {
        let index = PodIndex::new(pods, true);
        let vfio = (&VfioInventory::default(), &[][..]);
        compute_from(r, &index, allocations, observed, claims, cdi, vfio)
    }

    /// [`compute`] on `r` and the pods of `index`, with these sources of bindings and the
    /// node's VFIO devices with what the kubelet allocated of them.
    fn compute_from(
        r: &Reading,
        index: &PodIndex,
        allocations: &[Allocation],
        observed: &[ObservedProcess],
        claims: &[ClaimUse],
        cdi: &CdiDevices,
        (vfio, vfio_holds): (&VfioInventory, &[VfioHold]),
    ) -> Computed {
        compute(&StatusInput {
            reading: r,
            health: &HealthTracker::new(),
            allocations,
            observed,
            pods: index,
            devices: &DeviceMap::new(&r.gpus),
            runtime: &RuntimeStatus::default(),
            kai: &KaiBinds::default(),
            claims,
            cdi,
            vfio,
            vfio_holds,
        })
    }

    #[test]
    fn gpus_allocated_through_a_resource_claim_are_not_out_of_band() {
        let pods = one_pod("ml", "train", "containerd://abc");
        let allocations = [Allocation {
            namespace: "ml".into(),
            pod: "train".into(),
            container: "main".into(),
            resource_name: "gpu.nvidia.com".into(),
            device_uuids: vec!["GPU-a".into()],
            claim: Some("ml/train-gpus".into()),
        }];
        let c = run_allocated(&pods, &allocations, &[observed("u1", "containerd://abc")]);
        let bindings = c.status.bindings.unwrap_or_default();
        assert_eq!(bindings.len(), 1, "{bindings:?}");
        let b = &bindings[0];
        assert_eq!(b.source, BindingSource::AllocatedAndObserved);
        assert!(!b.is_out_of_band());
        assert_eq!(b.claims, ["ml/train-gpus"]);
        assert_eq!(b.resource_name.as_deref(), Some("gpu.nvidia.com"));
        assert_eq!(c.status.privileged_pods.unwrap_or_default(), []);

        // Privileged, the container holds its claim's GPUs and the pod is a privileged GPU
        // pod, though nothing in its spec but the claim says GPU.
        let mut pods = pods;
        pods[0].containers[0].privileged = true;
        let c = run_allocated(&pods, &allocations, &[]);
        let privileged = c.status.privileged_pods.unwrap_or_default();
        assert_eq!(privileged.len(), 1, "{privileged:?}");
        assert_eq!(privileged[0].name, "train");
    }

    /// The compute-domain driver's daemon claim, as v25.12.0 prepares it: its own CDI
    /// device gives a capability node, and the driver's `device=all` every GPU and channel.
    const DAEMON_SPECS: [&str; 2] = [
        r#"
kind: k8s.compute-domain.nvidia.com/claim
devices:
  - name: c1-daemon-0
    containerEdits:
      deviceNodes: [{path: /dev/nvidia-caps/nvidia-cap3, major: 235, minor: 3}]
"#,
        r#"
kind: k8s.compute-domain.nvidia.com/device
devices:
  - name: all
    containerEdits:
      deviceNodes:
        - {path: /dev/nvidia0, hostPath: /run/nvidia/driver/dev/nvidia0}
        - {path: /dev/nvidia1, hostPath: /run/nvidia/driver/dev/nvidia1}
        - {path: /dev/nvidiactl}
        - {path: /dev/nvidia-caps-imex-channels/channel0}
        - {path: /dev/nvidia-caps-imex-channels/channel1}
  - name: channel-0
    containerEdits:
      deviceNodes: [{path: /dev/nvidia-caps-imex-channels/channel0}]
"#,
    ];

    #[test]
    fn a_claim_whose_cdi_spec_hands_out_more_than_its_allocation_is_beyond_claim() {
        let r = two_gpus();
        let mut cdi = CdiDevices::default();
        for spec in DAEMON_SPECS {
            cdi.add(spec, false).unwrap();
        }
        let claim = |name: &str, device: &str, cdi: &[&str]| ClaimUse {
            namespace: "ml".into(),
            pod: "train".into(),
            container: "main".into(),
            claim: format!("ml/{name}"),
            drivers: vec!["compute-domain.nvidia.com".into()],
            imex_channel: device.starts_with("channel-"),
            cdi_devices: cdi.iter().map(|s| s.to_string()).collect(),
        };
        let daemon = claim(
            "steal",
            "daemon-0",
            &[
                "k8s.compute-domain.nvidia.com/device=all",
                "k8s.compute-domain.nvidia.com/claim=c1-daemon-0",
            ],
        );
        let channel = claim(
            "channel",
            "channel-0",
            &["k8s.compute-domain.nvidia.com/device=channel-0"],
        );
        let gpu_a = Allocation {
            namespace: "ml".into(),
            pod: "train".into(),
            container: "main".into(),
            resource_name: "nvidia.com/gpu".into(),
            device_uuids: vec!["GPU-a".into()],
            claim: None,
        };
        let run = |pods: &[PodInfo], claims: &[ClaimUse], allocations: &[Allocation]| {
            compute_on(&r, pods, allocations, &[], claims, &cdi)
                .status
                .bindings
                .unwrap_or_default()
        };
        let pods = one_pod("ml", "train", "containerd://abc");

        // A tenant's daemon claim: every GPU and channel of the node, allocated nothing.
        let bindings = run(&pods, std::slice::from_ref(&daemon), &[]);
        assert_eq!(bindings.len(), 1, "{bindings:?}");
        let b = &bindings[0];
        assert_eq!(b.source, BindingSource::BeyondClaim);
        assert!(b.is_out_of_band());
        assert_eq!((b.pod_uid.as_str(), b.container.as_str()), ("u1", "main"));
        assert_eq!(b.claims, ["ml/steal"]);
        assert_eq!(
            b.resource_name.as_deref(),
            Some("compute-domain.nvidia.com")
        );
        assert_eq!(b.gpu_uuids, ["GPU-a", "GPU-b"]);
        assert_eq!(
            b.device_nodes,
            [
                "/dev/nvidia-caps-imex-channels/channel0",
                "/dev/nvidia-caps-imex-channels/channel1",
                "/run/nvidia/driver/dev/nvidia0",
                "/run/nvidia/driver/dev/nvidia1",
            ]
        );

        // Beside a GPU the device plugin allocated it, the rest is beyond; the binding keeps
        // both GPUs and names only the other's node.
        let bindings = run(
            &pods,
            std::slice::from_ref(&daemon),
            std::slice::from_ref(&gpu_a),
        );
        assert_eq!(bindings.len(), 1, "{bindings:?}");
        assert_eq!(bindings[0].source, BindingSource::BeyondClaim);
        assert_eq!(bindings[0].gpu_uuids, ["GPU-a", "GPU-b"]);
        assert_eq!(bindings[0].resource_name.as_deref(), Some("nvidia.com/gpu"));
        assert!(
            (bindings[0].device_nodes.iter()).all(|n| !n.ends_with("/nvidia0")),
            "{bindings:?}"
        );

        // A channel claim gets its channel; with it, the other channels of the domain
        // (AllocationMode: All) are its too, and only the GPUs are beyond.
        let bindings = run(&pods, std::slice::from_ref(&channel), &[]);
        assert!(bindings.is_empty(), "{bindings:?}");
        let bindings = run(
            &pods,
            &[channel.clone(), daemon.clone()],
            std::slice::from_ref(&gpu_a),
        );
        assert_eq!(bindings[0].device_nodes, ["/run/nvidia/driver/dev/nvidia1"]);
        assert_eq!(bindings[0].claims, ["ml/steal"]);

        // The driver's own namespace: reported, and exempt.
        let mut own = one_pod("nvidia-dra-driver-gpu", "imex-daemon", "containerd://abc");
        own[0].claims_exempt = Some("built-in driverClaims".into());
        let mut mine = daemon.clone();
        mine.namespace = "nvidia-dra-driver-gpu".into();
        mine.pod = "imex-daemon".into();
        let bindings = run(&own, &[mine], &[]);
        assert_eq!(bindings.len(), 1, "{bindings:?}");
        assert_eq!(bindings[0].source, BindingSource::BeyondClaim);
        assert!(!bindings[0].is_out_of_band());

        // A CDI device no spec defines gives nothing to judge; a pod gone from the API is
        // skipped.
        let unknown = claim("x", "daemon-0", &["vendor.example.com/x=y"]);
        assert!(run(&pods, &[unknown], &[]).is_empty());
        assert!(run(&[], std::slice::from_ref(&daemon), &[]).is_empty());
    }

    #[test]
    fn an_annotation_naming_a_gpu_the_pod_was_not_allocated_is_injected_use() {
        use gpuwarden_crds::injection::GpuName;
        let r = two_gpus();
        let allocated = |uuid: &str| Allocation {
            namespace: "ml".into(),
            pod: "train".into(),
            container: "main".into(),
            resource_name: "nvidia.com/gpu".into(),
            device_uuids: vec![uuid.into()],
            claim: None,
        };
        let run = |named: GpuName, target: Option<&str>, allocations: &[Allocation]| {
            let mut pods = one_pod("ml", "train", "containerd://abc");
            let daemon = ContainerInfo {
                name: "daemon".into(),
                ..pods[0].containers[0].clone()
            };
            pods[0].containers.push(daemon);
            pods[0].injected = vec![(target.map(str::to_owned), vec![named])];
            compute_on(&r, &pods, allocations, &[], &[], &CdiDevices::default())
                .status
                .bindings
                .unwrap_or_default()
        };
        // The daemon sidecar is handed /dev/nvidia0, which the kubelet allocated to its pod.
        let held = run(GpuName::Minor(0), Some("daemon"), &[allocated("GPU-a")]);
        assert!(held.iter().all(|b| !b.is_out_of_band()), "{held:?}");
        // Named by minor number, by CDI index, by the DRA driver's name: GPU-b is not the pod's.
        for named in [
            GpuName::Minor(1),
            GpuName::Cdi("1".into()),
            GpuName::Cdi("gpu-1".into()),
            GpuName::Cdi("GPU-b".into()),
        ] {
            let bindings = run(named.clone(), Some("daemon"), &[allocated("GPU-a")]);
            let injected: Vec<&Binding> = (bindings.iter())
                .filter(|b| b.source == BindingSource::Injected)
                .collect();
            assert_eq!(injected.len(), 1, "{named:?}: {bindings:?}");
            assert_eq!(injected[0].container, "daemon");
            assert_eq!(injected[0].gpu_uuids, ["GPU-b"]);
            assert!(injected[0].is_out_of_band());
        }
        // Pod-wide: every container; the one that holds GPU-a keeps it, marked injected.
        let bindings = run(GpuName::Minor(1), None, &[allocated("GPU-a")]);
        assert_eq!(bindings.len(), 2, "{bindings:?}");
        let main = bindings.iter().find(|b| b.container == "main").unwrap();
        assert_eq!(main.source, BindingSource::Injected);
        assert_eq!(main.gpu_uuids, ["GPU-a", "GPU-b"]);
        // A GPU this node does not have is nothing the plugin can inject.
        assert!(run(GpuName::Minor(7), Some("daemon"), &[]).is_empty());
    }

    /// A KAI fraction pod `team-a/train` (UID `u1`) whose process runs on GPU-a, and KAI's
    /// reservation pod of group `g-1` that the kubelet allocated GPU-a to.
    fn kai_node() -> (Vec<PodInfo>, Vec<Allocation>, KaiBinds) {
        let mut pods = one_pod("team-a", "train", "containerd://abc");
        pods[0].kai = Some(crate::pods::KaiFraction {
            container: "main".into(),
            reservation_namespace: "kai-resource-reservation".into(),
        });
        let mut reservation = one_pod(
            "kai-resource-reservation",
            "gpu-reservation-1",
            "containerd://r",
        );
        reservation[0].uid = "r1".into();
        reservation[0].containers[0].name = "resource-reservation".into();
        reservation[0].labels = [
            ("app", "kai-resource-reservation"),
            ("runai-gpu-group", "g-1"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .into();
        pods.extend(reservation);
        let allocations = vec![Allocation {
            namespace: "kai-resource-reservation".into(),
            pod: "gpu-reservation-1".into(),
            container: "resource-reservation".into(),
            resource_name: "nvidia.com/gpu".into(),
            device_uuids: vec!["GPU-a".into()],
            claim: None,
        }];
        let request: kube::api::DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "scheduling.run.ai/v1alpha2", "kind": "BindRequest",
            "metadata": {"name": "train", "namespace": "team-a",
                "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "train", "uid": "u1"}]},
            "spec": {"selectedNode": "node-1", "selectedGPUGroups": ["g-1"],
                "receivedResourceType": "Fraction"},
            "status": {"phase": "Succeeded"}
        }))
        .expect("a BindRequest");
        (
            pods,
            allocations,
            KaiBinds::from_requests([&request], "node-1"),
        )
    }

    fn run_kai(pods: &[PodInfo], allocations: &[Allocation], kai: &KaiBinds) -> Binding {
        let r = reading();
        let index = PodIndex::new(pods, true);
        let c = compute(&StatusInput {
            reading: &r,
            health: &HealthTracker::new(),
            allocations,
            observed: &[observed("u1", "containerd://abc")],
            pods: &index,
            devices: &DeviceMap::new(&r.gpus),
            runtime: &RuntimeStatus::default(),
            kai,
            claims: &[],
            cdi: &CdiDevices::default(),
            vfio: &VfioInventory::default(),
            vfio_holds: &[],
        });
        let bindings = c.status.bindings.unwrap_or_default();
        let b = bindings
            .iter()
            .find(|b| b.pod_uid == "u1")
            .expect("the fraction pod's binding");
        let holder = &c.holders["GPU-a"]
            .iter()
            .find(|h| h.holder.pod == "train")
            .expect("holder");
        assert_eq!(
            holder.source == HolderSource::Shared,
            b.source == BindingSource::Shared
        );
        b.clone()
    }

    #[test]
    fn a_kai_fraction_on_its_reservations_gpu_is_shared_and_nothing_else_is() {
        let (pods, allocations, binds) = kai_node();
        let b = run_kai(&pods, &allocations, &binds);
        assert_eq!(b.source, BindingSource::Shared);
        assert!(!b.is_out_of_band());
        assert_eq!(
            b.shared_from,
            ["kai-resource-reservation/gpu-reservation-1"]
        );
        assert_eq!(b.gpu_uuids, ["GPU-a"]);

        // Each link missing makes it out of band.
        let out_of_band = |pods: &[PodInfo], allocations: &[Allocation], binds: &KaiBinds| {
            let b = run_kai(pods, allocations, binds);
            b.source == BindingSource::Observed && b.shared_from.is_empty()
        };
        assert!(
            out_of_band(&pods, &allocations, &KaiBinds::default()),
            "no BindRequest"
        );
        let mut unnamed = pods.clone();
        unnamed[0].kai = None;
        assert!(
            out_of_band(&unnamed, &allocations, &binds),
            "a policy that does not name KAI"
        );
        let mut other_container = pods.clone();
        other_container[0].kai.as_mut().unwrap().container = "sidecar".into();
        assert!(
            out_of_band(&other_container, &allocations, &binds),
            "another container"
        );
        let mut tenant_reservation = pods.clone();
        tenant_reservation[1].namespace = "team-a".into();
        let mut moved = allocations.clone();
        moved[0].namespace = "team-a".into();
        assert!(
            out_of_band(&tenant_reservation, &moved, &binds),
            "a reservation outside KAI's namespace"
        );
        let mut other_group = pods.clone();
        other_group[1]
            .labels
            .insert("runai-gpu-group".into(), "g-2".into());
        assert!(
            out_of_band(&other_group, &allocations, &binds),
            "another group"
        );
        let mut other_gpu = allocations.clone();
        other_gpu[0].device_uuids = vec!["GPU-b".into()];
        assert!(
            out_of_band(&pods, &other_gpu, &binds),
            "a GPU the reservation does not hold"
        );
        assert!(out_of_band(&pods, &[], &binds), "no reservation allocated");
    }

    /// HAMi's device plugin offers each GPU as slices `<UUID>-<k>`, and sets the process's
    /// GPU from annotations its pod could have written. Pods sharing the slices of one GPU
    /// are each an allocation of it; a process on another GPU than its slice's is out of band.
    #[test]
    fn hami_slices_of_a_gpu_are_allocations_and_one_used_elsewhere_is_named() {
        use crate::podresources::{
            ContainerDevices, ContainerResources, PodResources, gpu_allocations,
        };
        let mut r = reading();
        let mut b = r.gpus[0].clone();
        b.info.uuid = "GPU-b".into();
        b.info.index = 1;
        r.gpus.push(b);
        let devices = DeviceMap::new(&r.gpus);
        let listed: Vec<PodResources> = (0..3)
            .map(|i| PodResources {
                name: format!("vgpu-{i}"),
                namespace: "ml".into(),
                containers: vec![ContainerResources {
                    name: "main".into(),
                    devices: vec![ContainerDevices {
                        resource_name: "nvidia.com/gpu".into(),
                        device_ids: vec![format!("GPU-a-{i}")],
                    }],
                    dynamic_resources: vec![],
                }],
            })
            .collect();
        let allocations = gpu_allocations(&listed, &devices);
        let pods: Vec<PodInfo> = (0..3)
            .flat_map(|i| {
                let mut p = one_pod("ml", &format!("vgpu-{i}"), &format!("containerd://c{i}"));
                p[0].uid = format!("u{i}");
                p
            })
            .collect();
        let mut observed: Vec<ObservedProcess> = (0..3)
            .map(|i| observed(&format!("u{i}"), &format!("containerd://c{i}")))
            .collect();
        // The third runs on GPU-b, which its slice is not.
        observed[2].device_uuid = "GPU-b".into();
        let index = PodIndex::new(&pods, true);
        let c = compute(&StatusInput {
            reading: &r,
            health: &HealthTracker::new(),
            allocations: &allocations,
            observed: &observed,
            pods: &index,
            devices: &devices,
            runtime: &RuntimeStatus::default(),
            kai: &KaiBinds::default(),
            claims: &[],
            cdi: &CdiDevices::default(),
            vfio: &VfioInventory::default(),
            vfio_holds: &[],
        });
        let bindings = c.status.bindings.unwrap_or_default();
        let source = |pod: &str| {
            (bindings.iter().find(|b| b.pod == pod))
                .map(|b| (b.source, b.gpu_uuids.clone()))
                .expect("a binding")
        };
        assert_eq!(
            source("vgpu-0"),
            (BindingSource::AllocatedAndObserved, vec!["GPU-a".into()])
        );
        assert_eq!(
            source("vgpu-1"),
            (BindingSource::AllocatedAndObserved, vec!["GPU-a".into()])
        );
        assert_eq!(
            source("vgpu-2"),
            (
                BindingSource::Observed,
                vec!["GPU-a".into(), "GPU-b".into()]
            )
        );
        assert_eq!(c.holders["GPU-a"].len(), 3);
    }

    #[test]
    fn unknown_container_ids_are_named_sensibly() {
        let pods = one_pod("ns", "p", "containerd://old");
        // A restarted single container: its pod's only container.
        let c = run(&pods, &[observed("u1", "0123456789abcdef0123")]);
        let b = &c.status.bindings.unwrap()[0];
        assert_eq!((b.pod.as_str(), b.container.as_str()), ("p", "main"));
        assert!(b.is_out_of_band());

        // A pod the API does not know: reported by UID and short container id.
        let c = run(&pods, &[observed("u9", "0123456789abcdef0123")]);
        let b = &c.status.bindings.unwrap()[0];
        assert_eq!(b.pod_uid, "u9");
        assert_eq!(b.pod, "");
        assert_eq!(b.container, "0123456789ab");
    }

    #[test]
    fn a_busy_node_lists_what_the_crd_holds_and_counts_the_rest() {
        // 600 time-sliced containers on one GPU: more than a GpuNode lists.
        let allocations: Vec<Allocation> = (0..600)
            .map(|i| Allocation {
                namespace: "ns".into(),
                pod: format!("p{i:03}"),
                container: "main".into(),
                resource_name: "nvidia.com/gpu".into(),
                device_uuids: vec!["GPU-a".into()],
                claim: None,
            })
            .collect();
        let pods: Vec<PodInfo> = (0..600)
            .map(|i| PodInfo {
                uid: format!("u{i:03}"),
                namespace: "ns".into(),
                name: format!("p{i:03}"),
                mirror_uid: None,
                service_account: String::new(),
                labels: Default::default(),
                exempt: None,
                claims_exempt: None,
                kai: None,
                injected: Vec::new(),
                containers: vec![],
            })
            .collect();
        let c = run_allocated(&pods, &allocations, &[]);
        let bindings = c.status.bindings.as_ref().unwrap();
        assert_eq!(bindings.len(), gpuwarden_crds::bounds::MAX_BINDINGS);
        assert_eq!(c.status.truncated.as_ref().unwrap().bindings, 88);
        // The metrics are not bounded by the CRD: every holder is there.
        assert_eq!(c.holders["GPU-a"].len(), 600);
        // What the writer applies keeps the count.
        assert_eq!(agent_fields(&c.status).truncated, c.status.truncated);
    }

    #[test]
    fn host_processes_are_counted_not_bound() {
        let mut p = observed("u1", "x");
        p.container = None;
        let c = run(&[], &[p]);
        assert!(c.status.bindings.unwrap().is_empty());
        assert_eq!(c.host_processes["GPU-a"], 1);
    }

    const A6000: &str = "nvidia.com/GA102GL_RTX_A6000";
    const AUDIO: &str = "nvidia.com/GA102_HIGH_DEFINITION_AUDIO_CONTROLLER";
    const T4_1Q: &str = "nvidia.com/GRID_T4-1Q";
    const MDEV: &str = "3f1a6a0e-0000-4a00-8000-00000000a010";

    /// The test rig's sandbox devices: an RTX A6000 (`0000:81:00.0`) and its audio
    /// function (`0000:81:00.1`) in IOMMU group 13, a T4 vGPU alone in group 10.
    fn vfio_node() -> VfioInventory {
        use crate::vfio::{GroupedDevice, SysfsDevice};
        use gpuwarden_crds::node::VfioKind;
        let grouped = |resource: &str, id: &str, kind: VfioKind, group: u32| GroupedDevice {
            resource: resource.into(),
            id: id.into(),
            sysfs: SysfsDevice {
                kind,
                group,
                driver: (kind == VfioKind::Passthrough).then(|| "vfio-pci".into()),
                ..SysfsDevice::default()
            },
        };
        VfioInventory {
            devices: vec![
                grouped(A6000, "0000:81:00.0", VfioKind::Passthrough, 13),
                grouped(AUDIO, "0000:81:00.1", VfioKind::Passthrough, 13),
                grouped(T4_1Q, MDEV, VfioKind::Vgpu, 10),
            ],
            unknown: vec![],
        }
    }

    /// The kubelet allocated `resource`'s device `id` to container `compute` of `vms/<pod>`.
    fn vfio_hold(pod: &str, resource: &str, id: &str) -> VfioHold {
        VfioHold {
            namespace: "vms".into(),
            pod: pod.into(),
            container: "compute".into(),
            resource: resource.into(),
            id: id.into(),
        }
    }

    /// KubeVirt launcher pods `vms/<name>` (UIDs `u-<name>`), each with a `compute` container.
    fn launchers(names: &[&str]) -> Vec<PodInfo> {
        (names.iter())
            .flat_map(|name| {
                let mut pod = one_pod("vms", name, &format!("containerd://{name}"));
                pod[0].uid = format!("u-{name}");
                pod[0].containers[0].name = "compute".into();
                pod
            })
            .collect()
    }

    fn compute_vfio(
        pods: &[PodInfo],
        allocations: &[Allocation],
        holds: &[VfioHold],
    ) -> GpuNodeStatus {
        let index = PodIndex::new(pods, true);
        let vfio = (&vfio_node(), holds);
        let cdi = CdiDevices::default();
        compute_from(&reading(), &index, allocations, &[], &[], &cdi, vfio).status
    }

    fn device(resource: &str, id: &str) -> VfioDevice {
        VfioDevice {
            resource_name: resource.into(),
            device_id: id.into(),
            driver: None,
        }
    }

    /// Two VMs given the two functions of one GPU each hold the whole group: each binding
    /// names the group, what was allocated to it and what it gets with it.
    #[test]
    fn two_pods_each_allocated_a_function_of_one_group_each_hold_the_group() {
        let pods = launchers(&["vm-a", "vm-b"]);
        let status = compute_vfio(
            &pods,
            &[],
            &[
                vfio_hold("vm-a", A6000, "0000:81:00.0"),
                vfio_hold("vm-b", AUDIO, "0000:81:00.1"),
            ],
        );
        let bindings = status.bindings.clone().unwrap_or_default();
        assert_eq!(bindings.len(), 2, "{bindings:#?}");
        let (a, b) = (&bindings[0], &bindings[1]);
        assert_eq!(
            (a.pod_uid.as_str(), a.pod.as_str(), a.container.as_str()),
            ("u-vm-a", "vm-a", "compute")
        );
        assert_eq!(a.source, BindingSource::IommuGroup);
        assert_eq!(a.resource_name.as_deref(), Some(A6000));
        assert!(a.gpu_uuids.is_empty());
        assert!(!a.is_out_of_band(), "the kubelet allocated it");
        assert_eq!(
            a.iommu_groups,
            [IommuGroupHold {
                group: 13,
                allocated: vec![device(A6000, "0000:81:00.0")],
                others: vec![device(AUDIO, "0000:81:00.1")],
            }]
        );
        assert_eq!(
            (b.pod.as_str(), b.source),
            ("vm-b", BindingSource::IommuGroup)
        );
        assert_eq!(b.resource_name.as_deref(), Some(AUDIO));
        assert_eq!(
            b.iommu_groups,
            [IommuGroupHold {
                group: 13,
                allocated: vec![device(AUDIO, "0000:81:00.1")],
                others: vec![device(A6000, "0000:81:00.0")],
            }]
        );
        // The node's VFIO status lists the group with both devices.
        let vfio = status.vfio.expect("VFIO-backed resources");
        assert_eq!(vfio.resources.len(), 3);
        assert_eq!(vfio.shared_groups.len(), 1);
        assert_eq!(vfio.shared_groups[0].group, 13);
        assert_eq!(vfio.shared_groups[0].devices.len(), 2);
        assert_eq!(status.truncated, None);
        // What the writer applies keeps them.
        let applied = agent_fields(&compute_vfio(
            &pods,
            &[],
            &[vfio_hold("vm-a", A6000, "0000:81:00.0")],
        ));
        assert!(applied.vfio.is_some());
        assert_eq!(applied.bindings.unwrap()[0].iommu_groups.len(), 1);
    }

    /// One VM holding a group alone: named with what it gets beyond its allocation, or
    /// with nothing more when it was allocated the whole group. A vGPU alone in its group
    /// gives nothing beyond the allocation and is not reported.
    #[test]
    fn one_pod_holding_a_group_is_named_and_a_single_device_group_is_not() {
        let pods = launchers(&["vm-a", "vm-b"]);
        let bindings =
            |holds: &[VfioHold]| (compute_vfio(&pods, &[], holds).bindings).unwrap_or_default();
        let audio_only = bindings(&[vfio_hold("vm-b", AUDIO, "0000:81:00.1")]);
        assert_eq!(audio_only.len(), 1, "{audio_only:#?}");
        assert_eq!(
            audio_only[0].iommu_groups[0].others,
            [device(A6000, "0000:81:00.0")]
        );

        let whole = bindings(&[
            vfio_hold("vm-a", A6000, "0000:81:00.0"),
            vfio_hold("vm-a", AUDIO, "0000:81:00.1"),
        ]);
        assert_eq!(whole.len(), 1, "{whole:#?}");
        assert_eq!(
            whole[0].iommu_groups,
            [IommuGroupHold {
                group: 13,
                allocated: vec![device(A6000, "0000:81:00.0"), device(AUDIO, "0000:81:00.1")],
                others: vec![],
            }]
        );

        assert!(bindings(&[vfio_hold("vm-a", T4_1Q, MDEV)]).is_empty());
        // A device of no group the agent knows, and a pod gone from the API: nothing.
        assert!(bindings(&[vfio_hold("vm-a", A6000, "0000:82:00.0")]).is_empty());
        assert!(bindings(&[vfio_hold("vm-gone", A6000, "0000:81:00.0")]).is_empty());
    }

    /// Without an API (`inspect`) pods have no UID: two holders of one group stay apart by
    /// name.
    #[test]
    fn without_an_api_two_holders_of_a_group_stay_apart() {
        let index = PodIndex::new(&[], false);
        let holds = [
            vfio_hold("vm-a", A6000, "0000:81:00.0"),
            vfio_hold("vm-b", AUDIO, "0000:81:00.1"),
        ];
        let cdi = CdiDevices::default();
        let vfio = (&vfio_node(), &holds[..]);
        let unknown = compute_from(&reading(), &index, &[], &[], &[], &cdi, vfio);
        let apart: Vec<(String, String)> = (unknown.status.bindings.unwrap_or_default())
            .into_iter()
            .map(|b| (b.pod_uid, b.pod))
            .collect();
        assert_eq!(
            apart,
            [("".into(), "vm-a".into()), ("".into(), "vm-b".into())]
        );
    }

    /// A container allocated GPUs through NVIDIA's device plugin and a VFIO function keeps
    /// one binding: an allocation turns `IommuGroup`, an out-of-band source stays.
    #[test]
    fn a_container_with_other_gpus_keeps_one_binding_with_its_groups() {
        let pods = launchers(&["vm-a"]);
        let gpu = Allocation {
            namespace: "vms".into(),
            pod: "vm-a".into(),
            container: "compute".into(),
            resource_name: "nvidia.com/gpu".into(),
            device_uuids: vec!["GPU-a".into()],
            claim: None,
        };
        let holds = [vfio_hold("vm-a", AUDIO, "0000:81:00.1")];
        let status = compute_vfio(&pods, std::slice::from_ref(&gpu), &holds);
        let bindings = status.bindings.unwrap_or_default();
        assert_eq!(bindings.len(), 1, "{bindings:#?}");
        assert_eq!(bindings[0].source, BindingSource::IommuGroup);
        assert_eq!(bindings[0].gpu_uuids, ["GPU-a"]);
        assert_eq!(bindings[0].resource_name.as_deref(), Some("nvidia.com/gpu"));
        assert_eq!(bindings[0].iommu_groups[0].group, 13);
    }
}
