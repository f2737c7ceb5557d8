//! `GpuNode`: one per GPU node, named after the node. Its status has two writers with
//! disjoint fields: the node agent (`driver`, `gpus`, `bindings`, `privilegedPods`, `runtime`)
//! and the operator (`conditions`, `summary`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

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
pub struct GpuNodeSpec {
    /// Name of the Node this object describes (equal to `metadata.name`).
    pub node_name: String,
}

/// Observed state of a GPU node. Small and slow-changing: no utilisation, temperatures or
/// per-poll timestamps (those are metrics).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuNodeStatus {
    /// Driver, CUDA and NVML versions (node agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<DriverInfo>,

    /// The node's GPUs, keyed by UUID (node agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["uuid"]))]
    pub gpus: Option<Vec<GpuStatus>>,

    /// Which pod container holds which GPUs, keyed by pod UID and container (node agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["podUid", "container"]))]
    pub bindings: Option<Vec<Binding>>,

    /// Pods on this node with a privileged GPU container (node agent), exempt ones included
    /// and marked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["uid"]))]
    pub privileged_pods: Option<Vec<PodRef>>,

    /// What the node's NVIDIA container runtime does (node agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<RuntimeStatus>,

    /// `AgentReady`, `Healthy`, `Isolated`, `RuntimeIsolation` (operator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
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
    pub driver_version: String,
    /// Highest CUDA version the driver supports, e.g. `12.4`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_driver_version: Option<String>,
    /// NVML library version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvml_version: Option<String>,
}

/// One physical GPU.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuStatus {
    /// NVML index on this node.
    pub index: u32,
    /// GPU UUID, e.g. `GPU-5e4f...`.
    pub uuid: String,
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub model: String,
    /// Total framebuffer memory in MiB.
    pub memory_mi_b: u64,
    /// PCI bus id, e.g. `00000000:18:00.0`.
    pub pci_bus_id: String,
    /// Minor number of `/dev/nvidia<N>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor_number: Option<u32>,
    /// MIG mode: `Enabled`, `Disabled` or `Unsupported`; `pending` differs while a change
    /// waits for a GPU reset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_mode: Option<MigMode>,
    /// MIG devices, when MIG is enabled.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_devices: Vec<MigDevice>,
    /// Health as the agent judges it.
    pub health: GpuHealth,
}

/// MIG mode of a GPU.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigMode {
    /// Mode in force.
    pub current: String,
    /// Mode after the next GPU reset.
    pub pending: String,
}

/// A MIG device (GPU instance + compute instance).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigDevice {
    /// MIG device UUID, e.g. `MIG-1a2b...`.
    pub uuid: String,
    /// Profile name, e.g. `1g.10gb`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
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
    /// Why it is unhealthy, e.g. `Xid79: GPU has fallen off the bus`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<String>,
    /// When the state last changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
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
}

/// GPUs held by one container of one pod.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Binding {
    /// Pod UID.
    pub pod_uid: String,
    /// Container name.
    pub container: String,
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Resource name the GPUs were allocated under (e.g. `nvidia.com/gpu`); absent when only
    /// observed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_name: Option<String>,
    /// GPU (or MIG device) UUIDs.
    pub gpu_uuids: Vec<String>,
    /// `Allocated`, `Observed` (out of band) or `AllocatedAndObserved`.
    pub source: BindingSource,
}

impl Binding {
    /// A binding nobody allocated: the container uses GPUs it never requested.
    pub fn is_out_of_band(&self) -> bool {
        self.source == BindingSource::Observed
    }
}

/// A pod by namespace, name and UID.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema, Hash)]
#[serde(rename_all = "camelCase")]
pub struct PodRef {
    /// Pod UID.
    pub uid: String,
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// The GpuPolicy exemption that lets this pod keep its privilege (GPU Operator
    /// components and the like), as `<policy>: <reason>`; absent when none does. Exempt
    /// pods are listed but leave the node `Isolated` and are not counted in the summary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exempt: Option<String>,
}

/// What the node's NVIDIA container runtime does with unprivileged containers.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeStatus {
    /// Path of the NVIDIA container runtime `config.toml` read, when one was found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_path: Option<String>,
    /// `accept-nvidia-visible-devices-envvar-when-unprivileged`: when true (NVIDIA's default)
    /// an unprivileged container gets GPUs by setting `NVIDIA_VISIBLE_DEVICES`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accept_env_var_when_unprivileged: Option<bool>,
    /// Runtime mode: `auto`, `legacy`, `cdi` or `csv`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Device list strategy of the device plugin / runtime (`envvar`, `volume-mounts`, `cdi-annotations`, `cdi-cri`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_list_strategy: Option<String>,
    /// Whether NVIDIA CDI specs exist under `/etc/cdi` or `/var/run/cdi`.
    pub cdi_enabled: bool,
    /// What could not be read, if anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl RuntimeStatus {
    /// True when the runtime hands GPUs to unprivileged containers on request of an
    /// environment variable (the NVIDIA default when unset).
    pub fn env_var_leak(&self) -> bool {
        self.accept_env_var_when_unprivileged.unwrap_or(true)
    }
}

/// Counts shown by `kubectl get gpunodes`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuNodeSummary {
    /// GPUs the agent reports.
    pub gpus: u32,
    /// Healthy GPUs.
    pub healthy: u32,
    /// GPUs allocated to or used by a pod.
    pub allocated: u32,
    /// Pods on the node with a privileged GPU container that no exemption covers.
    pub privileged_pods: u32,
}
