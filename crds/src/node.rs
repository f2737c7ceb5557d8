//! `GpuNode`: one per GPU node, named after the node. Its status has two writers with
//! disjoint fields: the node agent (`driver`, `gpus`, `bindings`, `privilegedPods`, `runtime`,
//! `vfio`) and the operator (`conditions`, `summary`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::bounds::{
    self, DNS_LABEL_LEN, DNS_SUBDOMAIN_LEN, MAX_BINDING_DEVICES, MAX_BINDINGS, MAX_GPUS,
    MAX_HEALTH_REASONS, MAX_MIG_DEVICES, MAX_PRIVILEGED_PODS, MESSAGE_LEN, NVML_STRING_LEN,
    PATH_LEN, PCI_BUS_ID_LEN, QUALIFIED_NAME_LEN, REASON_LEN, UUID_LEN, keep, truncate_chars,
};

/// A node's GPUs: what they are, whether they are healthy, and which pod holds which.
// kube-derive takes one `printcolumn(...)` per column, which clippy reads as a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "gpuwarden.io",
    version = "v1alpha1",
    kind = "GpuNode",
    shortname = "gpun",
    category = "gpuwarden",
    status = "GpuNodeStatus",
    printcolumn(name = "Node", type_ = "string", json_path = ".spec.nodeName"),
    printcolumn(name = "GPUs", type_ = "integer", json_path = ".status.summary.gpus"),
    printcolumn(
        name = "Source",
        type_ = "string",
        json_path = ".status.summary.gpusFrom"
    ),
    printcolumn(
        name = "Healthy",
        type_ = "integer",
        json_path = ".status.summary.healthy"
    ),
    printcolumn(
        name = "Allocated",
        type_ = "integer",
        json_path = ".status.summary.allocated"
    ),
    printcolumn(name = "Model", type_ = "string", json_path = ".status.gpus[0].model"),
    printcolumn(
        name = "Driver",
        type_ = "string",
        json_path = ".status.driver.driverVersion"
    ),
    printcolumn(
        name = "Toolkit",
        type_ = "string",
        json_path = ".status.summary.toolkit"
    ),
    printcolumn(
        name = "Patched",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"RuntimePatched\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(
        name = "Agent",
        type_ = "string",
        priority = 1,
        json_path = ".status.conditions[?(@.type==\"AgentReady\")].status"
    ),
    printcolumn(
        name = "Isolated",
        type_ = "string",
        priority = 1,
        json_path = ".status.conditions[?(@.type==\"Isolated\")].status"
    ),
    printcolumn(
        name = "Privileged",
        type_ = "integer",
        priority = 1,
        json_path = ".status.summary.privilegedPods"
    ),
    printcolumn(
        name = "CUDA",
        type_ = "string",
        priority = 1,
        json_path = ".status.driver.cudaDriverVersion"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = bounds::kubernetes_integers)]
pub struct GpuNodeSpec {
    /// Name of the Node this object describes (equal to `metadata.name`).
    #[schemars(length(max = DNS_SUBDOMAIN_LEN))]
    pub node_name: String,
}

/// Observed state of a GPU node. Small and slow-changing: no utilisation, temperatures or
/// per-poll timestamps (those are metrics). Every list is bounded; the node agent keeps the
/// most important entries when a list would be longer and counts the rest in `truncated`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = bounds::kubernetes_integers)]
pub struct GpuNodeStatus {
    /// Driver, CUDA and NVML versions (node agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<DriverInfo>,

    /// The node's GPUs, keyed by UUID (node agent). At most 32; beyond that unhealthy GPUs
    /// are kept first and the rest counted in `truncated.gpus`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_GPUS))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["uuid"]))]
    pub gpus: Option<Vec<GpuStatus>>,

    /// Which pod container holds which GPUs, keyed by pod UID and container (node agent).
    /// At most 512; beyond that out-of-band bindings are kept first and the rest counted in
    /// `truncated.bindings`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_BINDINGS))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["podUid", "container"]))]
    pub bindings: Option<Vec<Binding>>,

    /// Pods on this node with a privileged GPU container (node agent), exempt ones included
    /// and marked. At most 256; beyond that pods no exemption covers are kept first and the
    /// rest counted in `truncated.privilegedPods`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_PRIVILEGED_PODS))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["uid"]))]
    pub privileged_pods: Option<Vec<PodRef>>,

    /// What the node's NVIDIA container runtime does (node agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<RuntimeStatus>,

    /// The extended resources whose devices the kubelet hands out as VFIO devices, and the
    /// IOMMU groups that back more than one of them (node agent); absent where there are none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vfio: Option<VfioStatus>,

    /// Entries the node agent left out of its lists to stay within their bounds, per list;
    /// absent when nothing was left out (node agent). The `StatusComplete` condition says the
    /// same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncated: Option<Truncated>,

    /// `AgentReady`, `Healthy`, `Isolated`, `RuntimeIsolation`, `StatusComplete` (operator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = bounds::conditions)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Option<Vec<Condition>>,

    /// Counts for `kubectl get gpunodes` (operator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<GpuNodeSummary>,
}

/// Versions of the NVIDIA driver stack.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DriverInfo {
    /// Kernel driver version, e.g. `550.54.15`.
    #[schemars(length(max = NVML_STRING_LEN))]
    pub driver_version: String,
    /// Highest CUDA version the driver supports, e.g. `12.4`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = NVML_STRING_LEN))]
    pub cuda_driver_version: Option<String>,
    /// NVML library version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = NVML_STRING_LEN))]
    pub nvml_version: Option<String>,
}

/// One physical GPU.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuStatus {
    /// NVML index on this node.
    pub index: u32,
    /// GPU UUID, e.g. `GPU-5e4f...`.
    #[schemars(length(max = UUID_LEN))]
    pub uuid: String,
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    #[schemars(length(max = NVML_STRING_LEN))]
    pub model: String,
    /// Total framebuffer memory in MiB.
    pub memory_mi_b: u64,
    /// PCI bus id, e.g. `00000000:18:00.0`.
    #[schemars(length(max = PCI_BUS_ID_LEN))]
    pub pci_bus_id: String,
    /// Minor number of `/dev/nvidia<N>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor_number: Option<u32>,
    /// MIG mode: `Enabled`, `Disabled` or `Unsupported`; `pending` differs while a change
    /// waits for a GPU reset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_mode: Option<MigMode>,
    /// MIG devices, when MIG is enabled. At most 16 (a GPU has at most 7 today); the rest
    /// are counted in `truncated.migDevices`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_MIG_DEVICES))]
    pub mig_devices: Vec<MigDevice>,
    /// Health as the agent judges it.
    pub health: GpuHealth,
}

/// MIG mode of a GPU.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigMode {
    /// Mode in force.
    #[schemars(length(max = 32))]
    pub current: String,
    /// Mode after the next GPU reset.
    #[schemars(length(max = 32))]
    pub pending: String,
}

/// A MIG device (GPU instance + compute instance).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigDevice {
    /// MIG device UUID, e.g. `MIG-1a2b...`.
    #[schemars(length(max = UUID_LEN))]
    pub uuid: String,
    /// Profile name, e.g. `1g.10gb`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub profile: Option<String>,
    /// GPU instance id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_instance_id: Option<u32>,
    /// Compute instance id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_instance_id: Option<u32>,
    /// Memory in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mi_b: Option<u64>,
}

/// Whether a GPU is fit to run work.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema, Hash)]
pub enum HealthState {
    /// No critical event within `recoverAfter`.
    #[default]
    Healthy,
    /// A critical XID, uncorrectable ECC error, pending page retirement, or lost GPU.
    Unhealthy,
}

/// Health of one GPU, with the reasons and since when.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuHealth {
    /// `Healthy` or `Unhealthy`.
    pub state: HealthState,
    /// Why it is unhealthy, e.g. `Xid79: GPU has fallen off the bus`. At most 16 reasons
    /// of 512 characters; the rest are counted in `truncated.healthReasons`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_HEALTH_REASONS), inner(length(max = REASON_LEN)))]
    pub reasons: Vec<String>,
    /// When the state last changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = bounds::timestamp)]
    pub since: Option<Time>,
}

/// How a binding was learned.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema, Hash)]
pub enum BindingSource {
    /// The kubelet allocated these GPUs (pod-resources API); no process seen on them.
    #[default]
    Allocated,
    /// A process of this container runs on these GPUs, but the kubelet allocated nothing:
    /// an out-of-band user (privileged, `NVIDIA_VISIBLE_DEVICES` leak, or no request).
    Observed,
    /// Allocated by the kubelet and seen in use.
    AllocatedAndObserved,
    /// A process of this container runs on GPUs a GPU-sharing scheduler granted it, which
    /// the kubelet allocated to that scheduler's reservation pod (`sharedFrom`): KAI's
    /// fractions, under a GpuPolicy that names KAI.
    Shared,
    /// A device-injection annotation on the pod (containerd's NRI device injector, GKE's)
    /// names these GPUs for this container, and the kubelet allocated none of them to the
    /// pod: a node plugin hands them over around the kubelet (docs/design.md,
    /// "Device-injection annotations").
    Injected,
    /// The CDI spec a DRA driver wrote for one of the container's ResourceClaims gives it
    /// these GPUs (or `deviceNodes`), which the kubelet allocated to none of the
    /// container's claims or resources: the driver hands out more than the claim was
    /// allocated (docs/design.md, "What a claim's CDI spec hands out").
    BeyondClaim,
    /// The kubelet allocated this container a VFIO device whose IOMMU group backs other
    /// devices the node advertises, and the device plugin hands it the whole group
    /// (`iommuGroups`): with the device it was allocated come the others. Not out of band
    /// by itself; containers of two pods holding one group are (`SharedIommuGroup`).
    IommuGroup,
}

/// GPUs held by one container of one pod.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Binding {
    /// Pod UID.
    #[schemars(length(max = 64))]
    pub pod_uid: String,
    /// Container name.
    #[schemars(length(max = DNS_LABEL_LEN))]
    pub container: String,
    /// Pod namespace.
    #[schemars(length(max = DNS_LABEL_LEN))]
    pub namespace: String,
    /// Pod name.
    #[schemars(length(max = DNS_SUBDOMAIN_LEN))]
    pub pod: String,
    /// Resource name the GPUs were allocated under (e.g. `nvidia.com/gpu`); absent when only
    /// observed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = QUALIFIED_NAME_LEN))]
    pub resource_name: Option<String>,
    /// The ResourceClaims (`namespace/name`) the GPUs were allocated through, when Dynamic
    /// Resource Allocation allocated them; `resourceName` is then the DRA driver.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), inner(length(max = CLAIM_REF_LEN)))]
    pub claims: Vec<String>,
    /// GPU (or MIG device) UUIDs. At most 64; the rest are counted in
    /// `truncated.bindingDevices`.
    #[schemars(length(max = MAX_BINDING_DEVICES), inner(length(max = UUID_LEN)))]
    pub gpu_uuids: Vec<String>,
    /// `Allocated`, `Observed` (out of band), `AllocatedAndObserved`, `Shared`, `Injected`
    /// (named by a device-injection annotation, not allocated), `BeyondClaim` (given by
    /// a claim's CDI spec, not allocated) or `IommuGroup` (allocated a VFIO device that
    /// comes with the rest of its IOMMU group).
    pub source: BindingSource,
    /// For a `Shared` binding: the reservation pods (`namespace/name`) the kubelet allocated
    /// these GPUs to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), inner(length(max = CLAIM_REF_LEN)))]
    pub shared_from: Vec<String>,
    /// For a `BeyondClaim` binding: the device nodes (GPUs, IMEX channels) its claims' CDI
    /// specs give it beyond what was allocated to it, as the host paths the runtime opens.
    /// At most 64; the rest are counted in `truncated.bindingDevices`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_BINDING_DEVICES), inner(length(max = PATH_LEN)))]
    pub device_nodes: Vec<String>,
    /// The IOMMU groups the container holds whole, of those that back more than one
    /// advertised device: each with the devices of it the kubelet allocated to the
    /// container and the others, which it gets with them. Set whatever `source` says (an
    /// allocation alone reads `IommuGroup`). At most 16; the rest are counted in
    /// `truncated.iommuGroups`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_BINDING_IOMMU_GROUPS))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["group"]))]
    pub iommu_groups: Vec<IommuGroupHold>,
    /// Why this binding does not count against the node's isolation: the GpuPolicy that
    /// lets the pod's namespace hold a driver's own claims, or exempts the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = REASON_LEN))]
    pub exempt: Option<String>,
}

/// Longest `namespace/name` of a ResourceClaim or a pod.
const CLAIM_REF_LEN: usize = DNS_LABEL_LEN + 1 + DNS_SUBDOMAIN_LEN;

impl Binding {
    /// A binding nobody allocated and no policy allows: the container uses GPUs it never
    /// requested, an annotation has a node plugin hand them to it, or a claim's CDI spec
    /// gives it more than the claim was allocated.
    pub fn is_out_of_band(&self) -> bool {
        self.exempt.is_none()
            && matches!(
                self.source,
                BindingSource::Observed | BindingSource::Injected | BindingSource::BeyondClaim
            )
    }
}

/// A pod by namespace, name and UID.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema, Hash)]
#[serde(rename_all = "camelCase")]
pub struct PodRef {
    /// Pod UID.
    #[schemars(length(max = 64))]
    pub uid: String,
    /// Pod namespace.
    #[schemars(length(max = DNS_LABEL_LEN))]
    pub namespace: String,
    /// Pod name.
    #[schemars(length(max = DNS_SUBDOMAIN_LEN))]
    pub name: String,
    /// The GpuPolicy exemption that lets this pod keep its privilege (GPU Operator
    /// components and the like), as `<policy>: <reason>`; absent when none does. Exempt
    /// pods are listed but leave the node `Isolated` and are not counted in the summary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = REASON_LEN))]
    pub exempt: Option<String>,
}

/// What the node's NVIDIA container runtime does with unprivileged containers.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeStatus {
    /// Path of the NVIDIA container runtime `config.toml` read, when one was found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = PATH_LEN))]
    pub config_path: Option<String>,
    /// `accept-nvidia-visible-devices-envvar-when-unprivileged`: when true (NVIDIA's default)
    /// an unprivileged container gets GPUs by setting `NVIDIA_VISIBLE_DEVICES`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accept_env_var_when_unprivileged: Option<bool>,
    /// Runtime mode: `auto`, `legacy`, `cdi` or `csv`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub mode: Option<String>,
    /// Device list strategy of the device plugin / runtime (`envvar`, `volume-mounts`, `cdi-annotations`, `cdi-cri`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub device_list_strategy: Option<String>,
    /// Whether NVIDIA CDI specs exist under `/etc/cdi` or `/var/run/cdi`.
    pub cdi_enabled: bool,
    /// What could not be read, if anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MESSAGE_LEN))]
    pub error: Option<String>,
    /// The NVIDIA Container Toolkit's version and where it was read; absent when unknown
    /// (`unknown` says why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toolkit: Option<ToolkitStatus>,
    /// The mode the runtime runs in: `mode`, with `auto` resolved by the toolkit's version
    /// (`jit-cdi` from 1.18, `legacy` before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub resolved_mode: Option<String>,
    /// `accept-nvidia-visible-devices-as-volume-mounts` (NVIDIA's default: false): whether
    /// the runtime takes a container's devices from mounts under
    /// `/var/run/nvidia-container-devices`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accept_volume_mounts: Option<bool>,
    /// `features.ignore-imex-channel-requests`: whether the runtime ignores
    /// `NVIDIA_IMEX_CHANNELS` (and its volume mounts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_imex_channel_requests: Option<bool>,
    /// `features.disable-imex-channel-creation`: whether the runtime creates no IMEX channel
    /// nodes in containers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disable_imex_channel_creation: Option<bool>,
    /// The CRI runtime (containerd or CRI-O) and how it runs NVIDIA's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_runtime: Option<ContainerRuntimeStatus>,
    /// The CDI kinds (`vendor/class`) defined in the spec directories, with their device
    /// counts. At most 32.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub cdi_kinds: Vec<CdiKindStatus>,
    /// NRI plugins known to inject devices named by pod annotations, found running on the
    /// node. At most 16.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), inner(length(max = REASON_LEN)))]
    pub device_injectors: Vec<String>,
    /// Why a field above is absent or partial. At most 16.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub unknown: Vec<UnknownField>,
}

/// The NVIDIA Container Toolkit's version on a node.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ToolkitStatus {
    /// The version as its source gives it (`1.17.8-1`, `v1.17.8-ubuntu20.04`, `1.18.2`).
    #[schemars(length(max = 64))]
    pub version: String,
    /// Where it was read: the package database, a binary's build flags, or the GPU
    /// Operator's toolkit pod on the node.
    #[schemars(length(max = REASON_LEN))]
    pub source: String,
}

/// The CRI runtime of a node, as its configuration reads.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContainerRuntimeStatus {
    /// `containerd` or `cri-o`.
    #[schemars(length(max = 32))]
    pub name: String,
    /// The configuration file read.
    #[schemars(length(max = PATH_LEN))]
    pub config_path: String,
    /// The CRI's default runtime handler.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = DNS_LABEL_LEN))]
    pub default_runtime: Option<String>,
    /// Whether the default handler runs NVIDIA's runtime: every container then goes through
    /// it, with no RuntimeClass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvidia_default: Option<bool>,
    /// The handlers that run NVIDIA's runtime (a pod reaches one by its RuntimeClass), the
    /// default first. None: no container goes through NVIDIA's runtime. At most 8.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8), inner(length(max = DNS_LABEL_LEN)))]
    pub nvidia_handlers: Vec<String>,
    /// Whether the CRI injects CDI devices (`cdi.k8s.io/` annotations, DRA claims).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cdi_enabled: Option<bool>,
    /// Whether NRI plugins may change containers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nri_enabled: Option<bool>,
}

/// One CDI kind in a node's spec directories.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CdiKindStatus {
    /// `vendor/class`, e.g. `nvidia.com/gpu`.
    #[schemars(length(max = QUALIFIED_NAME_LEN))]
    pub kind: String,
    /// Devices it defines, over all its spec files.
    pub devices: u32,
    /// Spec files that define it.
    pub files: u32,
}

/// A posture field the agent could not fill in, and why.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UnknownField {
    /// The field (`toolkit`, `containerRuntime`, `cdiKinds`, `deviceInjectors`).
    #[schemars(length(max = 64))]
    pub field: String,
    /// Why.
    #[schemars(length(max = REASON_LEN))]
    pub reason: String,
}

impl RuntimeStatus {
    /// True when the runtime hands GPUs to unprivileged containers on request of an
    /// environment variable (the NVIDIA default when unset).
    pub fn env_var_leak(&self) -> bool {
        self.accept_env_var_when_unprivileged.unwrap_or(true)
    }
}

/// Most VFIO-backed resources one `GpuNode` lists: a node advertises a passthrough resource
/// per PCI device name and function, and a vGPU resource per type.
pub const MAX_VFIO_RESOURCES: usize = 32;
/// Most IOMMU groups listed in `vfio.sharedGroups`: one per GPU behind its own root port,
/// 16 GPUs in the largest chassis, with room to spare.
pub const MAX_IOMMU_GROUPS: usize = 32;
/// Most devices listed for one IOMMU group: every function of 8 GPUs behind one switch
/// that does not isolate them (no ACS).
pub const MAX_IOMMU_GROUP_DEVICES: usize = 32;
/// Most IOMMU groups listed in one binding: a VM holding every GPU of a 16-GPU node.
pub const MAX_BINDING_IOMMU_GROUPS: usize = 16;
/// Most devices `vfio.unknown` lists.
pub const MAX_VFIO_UNKNOWN: usize = 16;
/// Longest kernel driver or mdev type name the agent reports.
pub const SYSFS_NAME_LEN: usize = 128;

/// The node's VFIO devices as the kubelet advertises them: which extended resources hand
/// out VFIO devices, and which IOMMU groups back more than one advertised device. A device
/// plugin that hands a container one device of such a group hands it the group's device
/// node, `/dev/vfio/<group>`, and with it every device of the group.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VfioStatus {
    /// The VFIO-backed resources: those with a device that sysfs puts in an IOMMU group.
    /// At most 32; the rest are counted in `truncated.vfioResources`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_VFIO_RESOURCES))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub resources: Vec<VfioResource>,
    /// The IOMMU groups that back more than one advertised device, with those devices. At
    /// most 32; the rest are counted in `truncated.iommuGroups`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_IOMMU_GROUPS))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["group"]))]
    pub shared_groups: Vec<IommuGroupStatus>,
    /// Advertised devices whose sysfs entries could not be read or made no sense, and why;
    /// their groups are not known. At most 16; the rest are counted in
    /// `truncated.vfioUnknown`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_VFIO_UNKNOWN))]
    pub unknown: Vec<VfioUnknown>,
}

/// How a VFIO-backed resource's devices reach a VM.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema, Hash)]
pub enum VfioKind {
    /// Whole PCI functions bound to a VFIO driver, named by their PCI address.
    #[default]
    Passthrough,
    /// Mediated devices (vGPUs) carved out of a GPU, named by their UUID.
    Vgpu,
}

/// One extended resource whose devices are VFIO devices.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VfioResource {
    /// The resource name, e.g. `nvidia.com/GA102GL_RTX_A6000` or `nvidia.com/GRID_T4-1Q`.
    #[schemars(length(max = QUALIFIED_NAME_LEN))]
    pub name: String,
    /// `Passthrough` (PCI functions) or `Vgpu` (mediated devices).
    pub kind: VfioKind,
    /// Its advertised devices that are in an IOMMU group.
    pub devices: u32,
    /// For `Passthrough`: how many of them are bound to `vfio-pci`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vfio_pci: Option<u32>,
    /// For `Vgpu`: the mediated device type's name (`mdev_type/name`, e.g. `GRID T4-1Q`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = SYSFS_NAME_LEN))]
    pub mdev_type: Option<String>,
}

/// An IOMMU group and the advertised devices in it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IommuGroupStatus {
    /// The group's number (`/dev/vfio/<group>`).
    pub group: u32,
    /// Its advertised devices. At most 32; the rest are counted in
    /// `truncated.iommuGroupDevices`.
    #[schemars(length(max = MAX_IOMMU_GROUP_DEVICES))]
    pub devices: Vec<VfioDevice>,
}

/// A device the kubelet advertises under an extended resource.
#[derive(
    Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Default, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct VfioDevice {
    /// The resource it is advertised under.
    #[schemars(length(max = QUALIFIED_NAME_LEN))]
    pub resource_name: String,
    /// Its kubelet device ID: a PCI address (`0000:81:00.0`) or a mediated device's UUID.
    #[schemars(length(max = UUID_LEN))]
    pub device_id: String,
    /// The kernel driver a PCI function is bound to (`vfio-pci`); absent when unbound, for a
    /// mediated device, and in bindings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = SYSFS_NAME_LEN))]
    pub driver: Option<String>,
}

/// An IOMMU group one container holds whole.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IommuGroupHold {
    /// The group's number (`/dev/vfio/<group>`).
    pub group: u32,
    /// The devices of the group the kubelet allocated to the container. At most 32; the
    /// rest are counted in `truncated.iommuGroupDevices`.
    #[schemars(length(max = MAX_IOMMU_GROUP_DEVICES))]
    pub allocated: Vec<VfioDevice>,
    /// The group's other advertised devices, which the container gets with them. At most
    /// 32; the rest are counted in `truncated.iommuGroupDevices`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_IOMMU_GROUP_DEVICES))]
    pub others: Vec<VfioDevice>,
}

/// An advertised device whose IOMMU group the agent could not read, and why.
#[derive(
    Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Default, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct VfioUnknown {
    /// The resource it is advertised under.
    #[schemars(length(max = QUALIFIED_NAME_LEN))]
    pub resource_name: String,
    /// Its kubelet device ID.
    #[schemars(length(max = UUID_LEN))]
    pub device_id: String,
    /// What could not be read, or what made no sense.
    #[schemars(length(max = REASON_LEN))]
    pub reason: String,
}

/// What [`bounds::fit_status`] does to the agent's lists: out-of-band bindings and those
/// holding a whole IOMMU group are kept before allocated ones, privileged pods no exemption
/// covers before exempt ones, unhealthy GPUs before healthy ones, so the conditions the
/// operator derives (`Isolated`, `Healthy`) stay true; free-text fields are cut to their
/// length; `truncated` is set afresh.
impl bounds::FitToBounds for GpuNodeStatus {
    fn fit_to_bounds(&mut self) {
        let mut cut = Truncated::default();
        if let Some(gpus) = self.gpus.as_mut() {
            cut.gpus = keep(gpus, MAX_GPUS, |g| g.health.state == HealthState::Unhealthy);
            for gpu in gpus.iter_mut() {
                cut.mig_devices += keep(&mut gpu.mig_devices, MAX_MIG_DEVICES, |_| false);
                cut.health_reasons += keep(&mut gpu.health.reasons, MAX_HEALTH_REASONS, |_| false);
                for reason in &mut gpu.health.reasons {
                    truncate_chars(reason, REASON_LEN);
                }
            }
        }
        if let Some(bindings) = self.bindings.as_mut() {
            // A binding holding a whole IOMMU group says what `Isolated` reads too.
            cut.bindings = keep(bindings, MAX_BINDINGS, |b| {
                b.is_out_of_band() || !b.iommu_groups.is_empty()
            });
            for binding in bindings.iter_mut() {
                cut.binding_devices += keep(&mut binding.gpu_uuids, MAX_BINDING_DEVICES, |_| false);
                cut.binding_devices +=
                    keep(&mut binding.device_nodes, MAX_BINDING_DEVICES, |_| false);
                if let Some(exempt) = binding.exempt.as_mut() {
                    truncate_chars(exempt, REASON_LEN);
                }
            }
        }
        if let Some(pods) = self.privileged_pods.as_mut() {
            cut.privileged_pods = keep(pods, MAX_PRIVILEGED_PODS, |p| p.exempt.is_none());
            for exempt in pods.iter_mut().filter_map(|p| p.exempt.as_mut()) {
                truncate_chars(exempt, REASON_LEN);
            }
        }
        if let Some(error) = self.runtime.as_mut().and_then(|r| r.error.as_mut()) {
            truncate_chars(error, MESSAGE_LEN);
        }
        self.truncated = (cut != Truncated::default()).then_some(cut);
    }
}

/// Cuts `status.vfio` and the bindings' `iommuGroups` to their bounds, keeping each list's
/// order, and adds what it left out to `status.truncated`. The counterpart of
/// [`bounds::fit_status`] for these fields; call it after that, which sets `truncated`
/// afresh.
pub fn fit_vfio(status: &mut GpuNodeStatus) {
    fn cut<T>(list: &mut Vec<T>, max: usize) -> u32 {
        let dropped = list.len().saturating_sub(max);
        list.truncate(max);
        u32::try_from(dropped).unwrap_or(u32::MAX)
    }
    let mut more = Truncated::default();
    if let Some(vfio) = status.vfio.as_mut() {
        more.vfio_resources = cut(&mut vfio.resources, MAX_VFIO_RESOURCES);
        more.iommu_groups = cut(&mut vfio.shared_groups, MAX_IOMMU_GROUPS);
        for group in &mut vfio.shared_groups {
            more.iommu_group_devices += cut(&mut group.devices, MAX_IOMMU_GROUP_DEVICES);
        }
        more.vfio_unknown = cut(&mut vfio.unknown, MAX_VFIO_UNKNOWN);
        for unknown in &mut vfio.unknown {
            if let Some((i, _)) = unknown.reason.char_indices().nth(REASON_LEN) {
                unknown.reason.truncate(i);
            }
        }
    }
    for binding in status.bindings.iter_mut().flatten() {
        more.iommu_groups += cut(&mut binding.iommu_groups, MAX_BINDING_IOMMU_GROUPS);
        for hold in &mut binding.iommu_groups {
            more.iommu_group_devices += cut(&mut hold.allocated, MAX_IOMMU_GROUP_DEVICES);
            more.iommu_group_devices += cut(&mut hold.others, MAX_IOMMU_GROUP_DEVICES);
        }
    }
    if more == Truncated::default() {
        return;
    }
    let truncated = status.truncated.get_or_insert_with(Truncated::default);
    truncated.vfio_resources += more.vfio_resources;
    truncated.iommu_groups += more.iommu_groups;
    truncated.iommu_group_devices += more.iommu_group_devices;
    truncated.vfio_unknown += more.vfio_unknown;
}

/// Counts shown by `kubectl get gpunodes`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuNodeSummary {
    /// GPUs on the node: what the agent reports, or, before it has, the Node's allocatable
    /// `nvidia.com/gpu` (see `gpusFrom`).
    pub gpus: u32,
    /// Where `gpus` comes from: `Agent` (NVML) or `Node` (allocatable, until an agent
    /// reports).
    #[serde(default)]
    pub gpus_from: GpusFrom,
    /// Healthy GPUs; absent until the agent reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub healthy: Option<u32>,
    /// GPUs allocated to or used by a pod; absent until the agent reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated: Option<u32>,
    /// Pods on the node with a privileged GPU container that no exemption covers; absent
    /// until the agent reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub privileged_pods: Option<u32>,
    /// The NVIDIA Container Toolkit's version, as the agent read it; absent when unknown
    /// (`RuntimePatched` says why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub toolkit: Option<String>,
}

/// See [`GpuNodeSummary::gpus_from`].
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum GpusFrom {
    /// The node agent's NVML inventory.
    #[default]
    Agent,
    /// The Node's allocatable `nvidia.com/gpu`: no agent has reported yet.
    Node,
}

/// How many entries the node agent left out of each list of its status. Zero fields are
/// omitted.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Truncated {
    /// GPUs left out of `gpus`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub gpus: u32,
    /// MIG devices left out, over all GPUs.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mig_devices: u32,
    /// Health reasons left out, over all GPUs.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub health_reasons: u32,
    /// Bindings left out of `bindings`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bindings: u32,
    /// Device UUIDs left out, over all bindings.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub binding_devices: u32,
    /// Pods left out of `privilegedPods`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub privileged_pods: u32,
    /// Resources left out of `vfio.resources`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub vfio_resources: u32,
    /// IOMMU groups left out of `vfio.sharedGroups` and of the bindings' `iommuGroups`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iommu_groups: u32,
    /// Devices left out of those IOMMU groups' lists.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iommu_group_devices: u32,
    /// Entries left out of `vfio.unknown`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub vfio_unknown: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bounds::fit_status;

    fn device(i: usize) -> VfioDevice {
        VfioDevice {
            resource_name: "nvidia.com/GA102GL_RTX_A6000".into(),
            device_id: format!("0000:{i:02x}:00.0"),
            driver: Some("vfio-pci".into()),
        }
    }

    fn group(group: u32, devices: usize) -> IommuGroupStatus {
        IommuGroupStatus {
            group,
            devices: (0..devices).map(device).collect(),
        }
    }

    #[test]
    fn vfio_lists_within_bounds_are_left_as_they_are() {
        let mut status = GpuNodeStatus {
            vfio: Some(VfioStatus {
                resources: vec![VfioResource::default(); 3],
                shared_groups: vec![group(13, 2)],
                unknown: vec![],
            }),
            bindings: Some(vec![Binding {
                iommu_groups: vec![IommuGroupHold {
                    group: 13,
                    allocated: vec![device(0)],
                    others: vec![device(1)],
                }],
                ..Binding::default()
            }]),
            ..Default::default()
        };
        let before = status.clone();
        fit_vfio(&mut status);
        assert_eq!(status, before);
        assert_eq!(status.truncated, None);
    }

    #[test]
    fn long_vfio_lists_are_cut_and_counted_beside_the_other_cuts() {
        let mut status = GpuNodeStatus {
            vfio: Some(VfioStatus {
                resources: vec![VfioResource::default(); MAX_VFIO_RESOURCES + 8],
                shared_groups: (0..40)
                    .map(|g| group(g, MAX_IOMMU_GROUP_DEVICES + 1))
                    .collect(),
                unknown: vec![
                    VfioUnknown {
                        reason: "x".repeat(REASON_LEN + 10),
                        ..VfioUnknown::default()
                    };
                    MAX_VFIO_UNKNOWN + 4
                ],
            }),
            bindings: Some(vec![Binding {
                iommu_groups: (0..20)
                    .map(|g| IommuGroupHold {
                        group: g,
                        allocated: vec![device(0)],
                        others: (1..=MAX_IOMMU_GROUP_DEVICES + 2).map(device).collect(),
                    })
                    .collect(),
                ..Binding::default()
            }]),
            // What bounds::fit_status counted before.
            truncated: Some(Truncated {
                bindings: 3,
                ..Truncated::default()
            }),
            ..Default::default()
        };
        fit_vfio(&mut status);
        let vfio = status.vfio.as_ref().unwrap();
        assert_eq!(vfio.resources.len(), MAX_VFIO_RESOURCES);
        assert_eq!(vfio.shared_groups.len(), MAX_IOMMU_GROUPS);
        assert_eq!(vfio.shared_groups[0].group, 0, "in their order");
        assert!((vfio.shared_groups.iter()).all(|g| g.devices.len() == MAX_IOMMU_GROUP_DEVICES));
        assert_eq!(vfio.unknown.len(), MAX_VFIO_UNKNOWN);
        assert!(vfio.unknown.iter().all(|u| u.reason.len() == REASON_LEN));
        let holds = &status.bindings.as_ref().unwrap()[0].iommu_groups;
        assert_eq!(holds.len(), MAX_BINDING_IOMMU_GROUPS);
        assert!(
            holds
                .iter()
                .all(|h| h.others.len() == MAX_IOMMU_GROUP_DEVICES)
        );
        assert_eq!(
            status.truncated,
            Some(Truncated {
                bindings: 3,
                vfio_resources: 8,
                iommu_groups: 8 + 4,
                iommu_group_devices: 32 + 16 * 2,
                vfio_unknown: 4,
                ..Truncated::default()
            })
        );
    }

    fn binding(i: usize, source: BindingSource) -> Binding {
        Binding {
            pod_uid: format!("uid-{i:04}"),
            container: "main".into(),
            namespace: "ns".into(),
            pod: format!("pod-{i}"),
            resource_name: None,
            claims: vec![],
            gpu_uuids: vec![format!("GPU-{}", i % 8)],
            source,
            ..Binding::default()
        }
    }

    #[test]
    fn a_status_within_bounds_is_left_as_it_is() {
        let mut status = GpuNodeStatus {
            gpus: Some(vec![GpuStatus::default(); 8]),
            bindings: Some(
                (0..100)
                    .map(|i| binding(i, BindingSource::Allocated))
                    .collect(),
            ),
            ..Default::default()
        };
        let before = status.clone();
        fit_status(&mut status);
        assert_eq!(status, before);
        assert_eq!(status.truncated, None);
    }

    #[test]
    fn long_lists_keep_what_the_conditions_need_and_count_the_rest() {
        // 600 allocated bindings and 20 out-of-band ones, spread through the list.
        let bindings: Vec<Binding> = (0..620)
            .map(|i| {
                let source = if i % 31 == 0 {
                    BindingSource::Observed
                } else {
                    BindingSource::Allocated
                };
                let mut b = binding(i, source);
                if i == 1 {
                    b.gpu_uuids = (0..100).map(|d| format!("MIG-{d}")).collect();
                }
                b
            })
            .collect();
        let out_of_band = bindings.iter().filter(|b| b.is_out_of_band()).count();
        let mut gpus: Vec<GpuStatus> = (0..40)
            .map(|i| GpuStatus {
                index: i,
                uuid: format!("GPU-{i}"),
                mig_devices: vec![MigDevice::default(); 20],
                ..Default::default()
            })
            .collect();
        gpus[39].health = GpuHealth {
            state: HealthState::Unhealthy,
            reasons: vec!["x".repeat(2000); 20],
            since: None,
        };
        let pods: Vec<PodRef> = (0..300)
            .map(|i| PodRef {
                uid: format!("p{i:03}"),
                exempt: (i >= 10).then(|| format!("image {} is exempt", "x".repeat(i * 2))),
                ..Default::default()
            })
            .collect();
        let mut status = GpuNodeStatus {
            gpus: Some(gpus),
            bindings: Some(bindings),
            privileged_pods: Some(pods),
            ..Default::default()
        };
        fit_status(&mut status);

        let cut = status.truncated.clone().expect("lists were cut");
        let gpus = status.gpus.as_ref().unwrap();
        assert_eq!(gpus.len(), MAX_GPUS);
        assert_eq!(cut.gpus, 8);
        assert!(
            gpus.iter().any(|g| g.index == 39),
            "the unhealthy GPU is kept"
        );
        assert!(
            gpus.windows(2).all(|w| w[0].index < w[1].index),
            "in index order"
        );
        assert_eq!(cut.mig_devices, 32 * 4);
        let sick = gpus.iter().find(|g| g.index == 39).unwrap();
        assert_eq!(sick.health.reasons.len(), MAX_HEALTH_REASONS);
        assert!(sick.health.reasons.iter().all(|r| r.len() == REASON_LEN));
        assert_eq!(cut.health_reasons, 4);

        let bindings = status.bindings.as_ref().unwrap();
        assert_eq!(bindings.len(), MAX_BINDINGS);
        assert_eq!(cut.bindings, 620 - 512);
        assert_eq!(
            bindings.iter().filter(|b| b.is_out_of_band()).count(),
            out_of_band,
            "every out-of-band binding is kept"
        );
        assert!(
            bindings.windows(2).all(|w| w[0].pod_uid < w[1].pod_uid),
            "in key order"
        );
        assert_eq!(cut.binding_devices, 100 - MAX_BINDING_DEVICES as u32);

        let pods = status.privileged_pods.as_ref().unwrap();
        assert_eq!(pods.len(), MAX_PRIVILEGED_PODS);
        assert_eq!(cut.privileged_pods, 300 - 256);
        assert_eq!(pods.iter().filter(|p| p.exempt.is_none()).count(), 10);
        assert!(
            pods.iter()
                .filter_map(|p| p.exempt.as_ref())
                .all(|e| e.chars().count() <= REASON_LEN)
        );

        // What was cut fits the schema the API server checks.
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(json["truncated"]["bindings"], 108);
        let only_bindings = Truncated {
            bindings: 3,
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(only_bindings).unwrap(),
            serde_json::json!({"bindings": 3}),
            "zero counts are left out"
        );
    }
}
