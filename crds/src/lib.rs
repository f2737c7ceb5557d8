//! The gpuwarden API: `GpuPolicy` and `GpuNode` in `gpuwarden.io/v1alpha1`, the label,
//! annotation and field-manager names every component shares, and pure helpers on them.
//!
//! This crate does no I/O. The CRD YAML under `deploy/crds/` is generated from these
//! types (`cargo run -p gpuwarden-crds --bin crdgen`) and a test fails when they drift.

pub mod admission;
pub mod bounds;
pub mod claims;
pub mod conditions;
pub mod duration;
mod error;
pub mod exemptions;
pub mod glob;
pub mod gpu;
pub mod injection;
pub mod kata;
pub mod manifests;
pub mod node;
pub mod pod_security;
pub mod policy;
pub mod rdma;
pub mod reports;
pub mod selection;
pub mod selector;
pub mod sharing;
pub mod start_up;
pub mod toolkit;
pub mod validation;
pub mod vm;

pub use claims::DriverClaims;
pub use error::error_chain;
pub use node::{
    Binding, BindingSource, CdiKindStatus, ContainerRuntimeStatus, DriverInfo, GpuHealth, GpuNode,
    GpuNodeSpec, GpuNodeStatus, GpuNodeSummary, GpuStatus, GpusFrom, HealthState, MigDevice,
    PodRef, RuntimeStatus, ToolkitStatus, Truncated, UnknownField,
};
pub use policy::{
    CapabilitiesSpec, ContainerExemption, EnvFromGpu, Exemptions, GpuPolicy, GpuPolicySpec,
    GpuSpec, HealthSpec, KaiSharing, MatchSpec, PolicyMode, PrivilegedMatch, RequestAs,
    RuntimeFeature, SharingSpec, VisibleDevicesAll,
};

/// API group of every gpuwarden kind.
pub const GROUP: &str = "gpuwarden.io";
/// API version of every gpuwarden kind.
pub const VERSION: &str = "v1alpha1";

/// Field manager of the node agent's server-side apply on `gpunodes/<node>/status`.
pub const FIELD_MANAGER_NODE_AGENT: &str = "gpuwarden-node-agent";
/// Field manager of the operator's server-side apply (GpuNode objects, conditions, summary).
pub const FIELD_MANAGER_OPERATOR: &str = "gpuwarden-operator";

/// Namespace gpuwarden's own components run in.
pub const SYSTEM_NAMESPACE: &str = "gpuwarden-system";
/// Name of the built-in default `GpuPolicy`.
pub const DEFAULT_POLICY_NAME: &str = "default";

/// Where the GPU Operator runs by default.
pub const GPU_OPERATOR_NAMESPACE: &str = "gpu-operator";

/// The namespaces NVIDIA's official installs put their node components in: the GPU Operator
/// (`gpu-operator`; `nvidia-gpu-operator` through OLM on OpenShift), the standalone device
/// plugin and GPU feature discovery charts, the DRA driver (before and after its rename) and
/// the Network Operator. `kube-system`, where static manifests and GKE put theirs, is exempt
/// as a whole.
pub const NVIDIA_COMPONENT_NAMESPACES: [&str; 7] = [
    GPU_OPERATOR_NAMESPACE,
    "nvidia-gpu-operator",
    "nvidia-device-plugin",
    "gpu-feature-discovery",
    "nvidia-dra-driver-gpu",
    "dra-driver-nvidia-gpu",
    "nvidia-network-operator",
];

/// GPU resource names the webhook treats as a GPU request.
pub const RESOURCE_GPU: &str = "nvidia.com/gpu";
/// Time-sliced / shared GPU resource name.
pub const RESOURCE_GPU_SHARED: &str = "nvidia.com/gpu.shared";
/// Prefix of MIG resource names (`nvidia.com/mig-1g.10gb`, ...).
pub const RESOURCE_MIG_PREFIX: &str = "nvidia.com/mig-";

/// Annotation/label prefix of everything gpuwarden writes on other objects.
pub const ANNOTATION_PREFIX: &str = "gpuwarden.io/";
/// Pod annotation: JSON, per container, what the webhook changed.
pub const ANNOTATION_REWRITTEN: &str = "gpuwarden.io/rewritten";
/// Pod annotation: `name@generation` of the policy that rewrote the pod.
pub const ANNOTATION_POLICY: &str = "gpuwarden.io/policy";
/// Pod annotation (Audit mode): JSON, per container, what Enforce would change.
pub const ANNOTATION_AUDIT: &str = "gpuwarden.io/audit";
/// Pod annotation: GPU count for every rewritten container without a GPU limit.
/// `gpuwarden.io/gpu-count.<container>` sets it for one container.
pub const ANNOTATION_GPU_COUNT: &str = "gpuwarden.io/gpu-count";
/// Pod annotation prefixes through which a container runtime injects CDI devices: Kubernetes'
/// `cdi.k8s.io/`, and `nvidia.cdi.k8s.io/`, which the NVIDIA runtime reads where the GPU
/// Operator enables CDI (its toolkit's `annotation-prefixes`).
pub const CDI_ANNOTATION_PREFIXES: [&str; 2] = ["cdi.k8s.io/", "nvidia.cdi.k8s.io/"];

/// The bare annotation key NVIDIA's NRI plugin (container toolkit 1.19 and later) reads CDI
/// devices from for every container of the pod, besides `nvidia.cdi.k8s.io/pod` and
/// `nvidia.cdi.k8s.io/container.<name>`.
pub const CDI_ANNOTATION_BARE_KEY: &str = "nvidia.cdi.k8s.io";

/// Whether a pod annotation key injects CDI devices ([`CDI_ANNOTATION_PREFIXES`],
/// [`CDI_ANNOTATION_BARE_KEY`]).
pub fn is_cdi_annotation(key: &str) -> bool {
    key == CDI_ANNOTATION_BARE_KEY || CDI_ANNOTATION_PREFIXES.iter().any(|p| key.starts_with(p))
}

/// Label the API server sets on every namespace.
pub const LABEL_NAMESPACE_NAME: &str = "kubernetes.io/metadata.name";
/// Node label set by NVIDIA GPU feature discovery on nodes with GPUs.
pub const LABEL_GPU_PRESENT: &str = "nvidia.com/gpu.present";
/// Taint the operator may put on nodes whose GPUs are unhealthy.
pub const TAINT_GPU_UNHEALTHY: &str = "gpuwarden.io/gpu-unhealthy";

/// Namespace of the node agents' liveness Leases (one per node, named `gpuwarden-agent-<node>`).
pub const AGENT_LEASE_NAMESPACE: &str = SYSTEM_NAMESPACE;
/// Prefix of an agent's Lease name; the node name follows.
pub const AGENT_LEASE_PREFIX: &str = "gpuwarden-agent-";

/// Name of the agent Lease for `node`.
pub fn agent_lease_name(node: &str) -> String {
    format!("{AGENT_LEASE_PREFIX}{node}")
}

/// Condition types on `GpuNode.status.conditions`.
pub mod condition_types {
    /// The node agent's Lease is fresh.
    pub const AGENT_READY: &str = "AgentReady";
    /// Every GPU the agent reports is healthy.
    pub const HEALTHY: &str = "Healthy";
    /// No out-of-band GPU users and no privileged GPU pods on the node.
    pub const ISOLATED: &str = "Isolated";
    /// The NVIDIA runtime does not hand GPUs to unprivileged containers by environment variable.
    pub const RUNTIME_ISOLATION: &str = "RuntimeIsolation";
    /// The node's NVIDIA Container Toolkit is affected by no advisory gpuwarden knows of
    /// (`gpuwarden_crds::toolkit::ADVISORIES`).
    pub const RUNTIME_PATCHED: &str = "RuntimePatched";
    /// The node agent listed everything it found: no list was cut to its bound.
    pub const STATUS_COMPLETE: &str = "StatusComplete";
    /// `GpuPolicy`: the spec is valid and in force.
    pub const READY: &str = "Ready";
}

/// Names of the installed objects that components refer to each other by.
pub mod install {
    /// ServiceAccount, Deployment and Service of the webhook.
    pub const WEBHOOK_NAME: &str = "gpuwarden-webhook";
    /// ServiceAccount and Deployment of the operator.
    pub const OPERATOR_NAME: &str = "gpuwarden-operator";
    /// ServiceAccount and DaemonSet of the node agent.
    pub const NODE_AGENT_NAME: &str = "gpuwarden-node-agent";
    /// Secret holding the webhook's serving certificate (`tls.crt`, `tls.key`, `ca.crt`).
    pub const WEBHOOK_TLS_SECRET: &str = "gpuwarden-webhook-tls";
    /// The MutatingWebhookConfiguration.
    pub const MUTATING_WEBHOOK_CONFIGURATION: &str = "gpuwarden";
    /// The webhook entry inside it.
    pub const MUTATING_WEBHOOK: &str = "pods.gpuwarden.io";
    /// HTTPS path the webhook answers on.
    pub const MUTATE_PATH: &str = "/mutate";
    /// HTTPS path on which the webhook answers requests to exec, attach or port-forward into
    /// a pod: only those pay for parsing them as such.
    pub const ENTRY_PATH: &str = "/enter";
    /// Container port of the webhook's HTTPS listener (Service port 443 targets it).
    pub const WEBHOOK_HTTPS_PORT: u16 = 8443;
    /// Plain-HTTP port of `/healthz`, `/readyz` and `/metrics` (webhook and operator).
    pub const HEALTH_PORT: u16 = 8080;
    /// Plain-HTTP port of the node agent's `/metrics`, `/healthz` and `/readyz`.
    pub const NODE_AGENT_PORT: u16 = 9400;
    /// Lease the operator replicas elect their leader with (in the system namespace).
    pub const OPERATOR_LEADER_LEASE: &str = "gpuwarden-operator-leader";
    /// Container image all three binaries ship in.
    pub const IMAGE: &str = "ghcr.io/gpuwarden/gpuwarden";
}
