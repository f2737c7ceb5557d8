//! `GpuPolicy`: which namespaces gpuwarden governs, and how privileged GPU pods are treated.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::bounds::{
    self, DNS_LABEL_LEN, DNS_SUBDOMAIN_LEN, IMAGE_LEN, QUALIFIED_NAME_LEN,
    RESOURCE_PATTERN_MESSAGE, RESOURCE_PATTERN_RULE,
};
use crate::claims::{DEVICE_CLASS_LEN, DriverClaims};
use crate::duration::DURATION_PATTERN;

/// How privileged GPU pods are treated. The highest-priority `GpuPolicy` whose selectors match
/// a pod governs it; equal priorities are broken by name order.
// kube-derive takes one `printcolumn(...)` per column, which clippy reads as a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "gpuwarden.io",
    version = "v1alpha1",
    kind = "GpuPolicy",
    shortname = "gpup",
    category = "gpuwarden",
    status = "GpuPolicyStatus",
    printcolumn(name = "Priority", type_ = "integer", json_path = ".spec.priority"),
    printcolumn(name = "Mode", type_ = "string", json_path = ".spec.mode"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        priority = 1,
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = bounds::kubernetes_integers)]
pub struct GpuPolicySpec {
    /// Priority among policies that select the same pod: the highest wins, ties go to the
    /// policy whose name sorts first.
    #[serde(default)]
    pub priority: i32,

    /// Namespaces this policy governs, by label. `{}` selects every namespace. At most 64
    /// `matchLabels` and 32 `matchExpressions` of 64 values each.
    #[serde(default)]
    #[schemars(transform = bounds::label_selector)]
    pub namespace_selector: LabelSelector,

    /// Optional narrowing to pods with these labels. It can only narrow what the namespace
    /// selector chose; it is never a way for a pod to opt out of a stricter policy, because
    /// the next policy in priority order still applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = bounds::label_selector)]
    pub pod_selector: Option<LabelSelector>,

    /// What happens to a governed pod with a privileged GPU container: `Enforce` rewrites it,
    /// `Audit` admits it unchanged with warnings and an annotation, `Deny` rejects it.
    #[serde(default)]
    pub mode: PolicyMode,

    /// Which privileged containers count as GPU containers.
    #[serde(default, rename = "match")]
    pub match_: MatchSpec,

    /// How GPUs are requested after the rewrite.
    #[serde(default)]
    pub gpu: GpuSpec,

    /// Which Linux capabilities a rewritten container keeps.
    #[serde(default)]
    pub capabilities: CapabilitiesSpec,

    /// `NVIDIA_DRIVER_CAPABILITIES` set on rewritten containers.
    #[serde(default = "default_driver_capabilities")]
    #[x_kube(validation = Rule::new("self.all(c, c in ['compute', 'utility', 'video', 'graphics', 'display', 'compat32'])").message("driver capabilities are compute, utility, video, graphics, display or compat32"))]
    #[schemars(length(max = 6), inner(length(max = 16)))]
    pub driver_capabilities: Vec<String>,

    /// NVIDIA runtime features a container that holds GPUs may turn on with its own
    /// variable: `GDRCOPY` (`NVIDIA_GDRCOPY=enabled`, `/dev/gdrdrv`), `GDS`
    /// (`NVIDIA_GDS=enabled`, `/dev/nvidia-fs*`) and `MOFED` (`NVIDIA_MOFED=enabled`, every
    /// `/dev/infiniband` verbs device of the host, outside any RDMA device plugin's
    /// allocation). A feature not listed is the runtime's only where a device plugin or the
    /// administrator sets it: a container's own entry is removed, and a ConfigMap or Secret
    /// key of that name is refused in governed namespaces (docs/design.md, "Runtime
    /// variables"). IMEX channels and NVSwitch devices are never a container's to ask for.
    #[serde(default = "default_runtime_features")]
    #[schemars(length(max = 3))]
    #[x_kube(validation = Rule::new("self.all(f, self.exists_one(g, g == f))").message("runtimeFeatures lists each feature once"))]
    pub runtime_features: Vec<RuntimeFeature>,

    /// Remove hostPath volumes of `/dev`, `/dev/nvidia*` and `/dev/dri` (and their mounts)
    /// from rewritten pods. A volume an exempt container still mounts stays.
    #[serde(default = "default_true")]
    pub strip_device_host_paths: bool,

    /// Remove `cdi.k8s.io/*` pod annotations, which would otherwise inject devices through CDI.
    /// An annotation naming only passthrough GPUs (`nvidia.com/pgpu=...`) in a pod that holds
    /// one through the sandbox device plugin, under a VM runtime class
    /// (`virtualMachines.runtimeClasses`), stays: the Kata runtime hands that GPU to the pod's
    /// VM.
    #[serde(default = "default_true")]
    pub strip_cdi_annotations: bool,

    /// Extended resources of RDMA device plugins (globs, `domain/name`): a container that
    /// requests one is handed its `/dev/infiniband` devices by that plugin, so a
    /// `/dev/infiniband` hostPath it mounts does not stop the rewrite. Without one, a
    /// privileged container mounting `/dev/infiniband`, or showing RDMA use in its own spec
    /// (NCCL's InfiniBand settings, an RDMA NCCL plugin), is denied rather than
    /// de-privileged into one that cannot open the HCA. The default names NVIDIA's RDMA
    /// shared device plugin (`rdma/*`), the Network Operator's SR-IOV and host-device pools
    /// and AWS's EFA.
    #[serde(default = "default_rdma_resources")]
    #[x_kube(validation = Rule::new(RESOURCE_PATTERN_RULE).message(RESOURCE_PATTERN_MESSAGE))]
    #[schemars(length(max = 16), inner(length(max = QUALIFIED_NAME_LEN)))]
    pub rdma_resources: Vec<String>,

    /// Set `NVIDIA_VISIBLE_DEVICES=void` on every init and regular container that holds no
    /// GPU (no GPU resource, no resource claim, no `NVIDIA_VISIBLE_DEVICES` of its own) and is
    /// neither privileged nor exempt, in Enforce mode; Audit mode warns instead. The entry
    /// overrides the image's own `ENV NVIDIA_VISIBLE_DEVICES=all` (every CUDA base image sets
    /// it), through which the NVIDIA runtime would hand the container every GPU of the node.
    /// Pods of a DaemonSet and pods holding a passthrough GPU under a VM runtime class are left
    /// as they are. The
    /// operator has the API server do it (a MutatingAdmissionPolicy), so it needs no webhook
    /// call; where MutatingAdmissionPolicy is not served, the policy's `AdmissionPolicies`
    /// condition says so.
    #[serde(default = "default_true")]
    pub void_non_gpu_containers: bool,

    /// DRA claims that only a driver's own pods may hold: a ResourceClaim or
    /// ResourceClaimTemplate naming one of these DeviceClasses, or carrying an opaque config
    /// of one of these kinds, is refused in a governed namespace outside `namespaces`, and so
    /// is a pod using one (docs/design.md, "Claims only a driver's own pods may hold").
    #[serde(default)]
    pub driver_claims: DriverClaims,

    /// GPUs handed whole to virtual machines through VFIO (docs/design.md, "GPUs handed to
    /// VMs"): which resources only a VM's pod may hold, and who makes such pods.
    #[serde(default)]
    pub virtual_machines: crate::vm::VirtualMachines,

    /// What this policy never touches. Pods cannot exempt themselves.
    #[serde(default)]
    pub exemptions: Exemptions,

    /// Health rules for node agents. A node takes them from the highest-priority policy whose
    /// `health.nodeSelector` matches it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthSpec>,
}

/// What the webhook does with a governed privileged GPU pod.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema, Hash)]
pub enum PolicyMode {
    /// Rewrite the pod into an unprivileged one that requests its GPUs.
    #[default]
    Enforce,
    /// Admit unchanged; warn and annotate what Enforce would do.
    Audit,
    /// Reject, naming each change that would make the pod acceptable.
    Deny,
}

impl std::fmt::Display for PolicyMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Enforce => "Enforce",
            Self::Audit => "Audit",
            Self::Deny => "Deny",
        })
    }
}

/// Which privileged containers are GPU containers.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MatchSpec {
    /// `GpuSignals`: a privileged container counts when it shows a GPU signal (GPU limit,
    /// `NVIDIA_VISIBLE_DEVICES`, device hostPath, CDI annotation, or one of the hints
    /// below). `All`: every privileged container counts, for nodes whose default runtime is
    /// nvidia.
    #[serde(default)]
    pub privileged_containers: PrivilegedMatch,

    /// Runtime classes that run the NVIDIA runtime: a privileged container of a pod with
    /// one of these `runtimeClassName`s counts. `[]` turns the hint off.
    #[serde(default = "default_runtime_classes")]
    #[schemars(length(max = 16), inner(length(max = DNS_SUBDOMAIN_LEN)))]
    pub runtime_class_names: Vec<String>,

    /// Node label prefixes of GPU nodes: a privileged container of a pod whose
    /// `nodeSelector` or required node affinity names a label starting with one of these
    /// (other than with the value `false`, or `NotIn`/`DoesNotExist`) counts. `[]` turns
    /// the hint off.
    #[serde(default = "default_gpu_node_labels")]
    #[schemars(length(max = 16), inner(length(max = QUALIFIED_NAME_LEN)))]
    pub gpu_node_labels: Vec<String>,

    /// Taints of GPU nodes: a privileged container of a pod that tolerates one of these
    /// keys counts. A toleration without a key (tolerate everything) is no hint. `[]` turns
    /// the hint off.
    #[serde(default = "default_gpu_taints")]
    #[schemars(length(max = 16), inner(length(max = QUALIFIED_NAME_LEN)))]
    pub gpu_taints: Vec<String>,

    /// Image globs (`*`, `?`) of GPU software whose image sets `NVIDIA_VISIBLE_DEVICES`
    /// itself (CUDA bases, frameworks): a privileged container running one counts.
    /// `[]` turns the hint off.
    #[serde(default = "default_gpu_images")]
    #[schemars(length(max = 64), inner(length(max = IMAGE_LEN)))]
    pub gpu_images: Vec<String>,

    /// Extended resources (globs, `domain/name`) that hand a container GPUs besides
    /// `nvidia.com/gpu`, `nvidia.com/gpu.shared`, `nvidia.com/mig-*`, `gpu.resourceName` and
    /// the passthrough GPUs of NVIDIA's sandbox device plugin (`nvidia.com/pgpu`,
    /// `nvidia.com/<GPU model>`), e.g. a renamed time-slicing resource: a container holding
    /// one is a GPU container and is given no `gpu.resourceName` on top.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = Rule::new(RESOURCE_PATTERN_RULE).message(RESOURCE_PATTERN_MESSAGE))]
    #[schemars(length(max = 16), inner(length(max = QUALIFIED_NAME_LEN)))]
    pub gpu_resources: Vec<String>,
}

impl Default for MatchSpec {
    fn default() -> Self {
        Self {
            privileged_containers: PrivilegedMatch::default(),
            runtime_class_names: default_runtime_classes(),
            gpu_node_labels: default_gpu_node_labels(),
            gpu_taints: default_gpu_taints(),
            gpu_images: default_gpu_images(),
            gpu_resources: Vec::new(),
        }
    }
}

/// See [`GpuPolicySpec::runtime_features`].
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, JsonSchema,
)]
pub enum RuntimeFeature {
    /// `NVIDIA_GDRCOPY=enabled`: `/dev/gdrdrv`, GPU memory mapped by the CPU (gdrcopy).
    #[serde(rename = "GDRCOPY")]
    Gdrcopy,
    /// `NVIDIA_GDS=enabled`: `/dev/nvidia-fs*`, GPUDirect Storage.
    #[serde(rename = "GDS")]
    Gds,
    /// `NVIDIA_MOFED=enabled`: every `/dev/infiniband` verbs device and `rdma_cm` of the host.
    #[serde(rename = "MOFED")]
    Mofed,
}

impl RuntimeFeature {
    /// Every feature, in the order the docs list them.
    pub const ALL: [Self; 3] = [Self::Gdrcopy, Self::Gds, Self::Mofed];

    /// Its name in a policy.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gdrcopy => "GDRCOPY",
            Self::Gds => "GDS",
            Self::Mofed => "MOFED",
        }
    }
}

/// See [`MatchSpec::privileged_containers`].
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum PrivilegedMatch {
    /// Only privileged containers with a GPU signal.
    #[default]
    GpuSignals,
    /// Every privileged container.
    All,
}

/// How GPUs are requested after the rewrite.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.defaultCount <= self.maxPerContainer").message("defaultCount must not exceed maxPerContainer"))]
pub struct GpuSpec {
    /// Extended resource name a rewritten container requests.
    #[serde(default = "default_resource_name")]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9.-]+/[a-zA-Z0-9._-]+$')").message("resourceName must be a domain-prefixed extended resource name such as nvidia.com/gpu"))]
    #[schemars(length(max = QUALIFIED_NAME_LEN))]
    pub resource_name: String,

    /// GPUs requested when neither an annotation nor `NVIDIA_VISIBLE_DEVICES` says how many.
    #[serde(default = "default_count")]
    #[schemars(range(min = 1, max = 64))]
    pub default_count: u32,

    /// Most GPUs one container may end up requesting; more is a denial.
    #[serde(default = "default_max")]
    #[schemars(range(min = 1, max = 64))]
    pub max_per_container: u32,

    /// Most GPUs a rewritten pod may hold at once (its containers together, or its largest
    /// init container): more than one node holds is a denial rather than a pod that never
    /// schedules.
    #[serde(default = "default_max")]
    #[schemars(range(min = 1, max = 256))]
    pub max_per_pod: u32,

    /// What `NVIDIA_VISIBLE_DEVICES=all` turns into: `DefaultCount` GPUs, or a denial.
    #[serde(default)]
    pub visible_devices_all: VisibleDevicesAll,

    /// What happens to a rewritten GPU container with `envFrom`, which may set
    /// `NVIDIA_VISIBLE_DEVICES` where admission cannot see it and so override the GPUs the
    /// kubelet allocates: `Deny` it, or `Warn` and rewrite it (for nodes whose runtime
    /// ignores the variable in unprivileged containers).
    #[serde(default)]
    pub env_from: EnvFromGpu,

    /// How a rewritten container is given the GPUs it had: `ExtendedResource` adds a
    /// `resourceName` limit; `ResourceClaim` adds a DRA claim from a ResourceClaimTemplate
    /// the operator keeps in each governed namespace, which containers that named the same
    /// GPUs share (docs/design.md, "ResourceClaims").
    #[serde(default)]
    pub request_as: RequestAs,

    /// The DRA DeviceClass the `ResourceClaim` mode requests GPUs from. Claims of this class
    /// are GPU claims, like those of the NVIDIA DRA driver's own classes.
    #[serde(default = "default_device_class")]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')").message("deviceClassName must be a DNS subdomain such as gpu.nvidia.com"))]
    #[schemars(length(min = 1, max = DEVICE_CLASS_LEN))]
    pub device_class_name: String,

    /// GPU-sharing schedulers whose own grant of part of a GPU the policy recognises
    /// (docs/design.md, "GPU-sharing schedulers"). HAMi needs nothing here: its pods request
    /// `nvidia.com/gpu` like any other.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<SharingSpec>,
}

/// See [`GpuSpec::sharing`].
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SharingSpec {
    /// KAI-Scheduler's GPU fractions: the container KAI's admission gives a GPU from the
    /// ConfigMap its binder writes keeps that GPU. Only KAI's binder may then write such
    /// ConfigMaps (`deploy/admission/kai-sharing.yaml`), and the node agent checks each
    /// fraction process against the GPU KAI's reservation pod holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kai: Option<KaiSharing>,
}

/// Where KAI-Scheduler runs: the names of its Helm chart by default.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KaiSharing {
    /// KAI's binder, as `<namespace>/<service account>`: where KAI-Scheduler is installed,
    /// and `binder`. Only it writes the ConfigMaps a fraction container reads its GPU from.
    #[serde(default = "default_kai_binder")]
    #[schemars(length(min = 3, max = SERVICE_ACCOUNT_LEN), regex(pattern = SERVICE_ACCOUNT_PATTERN))]
    pub binder: String,

    /// The `schedulerName` KAI-Scheduler serves.
    #[serde(default = "default_kai_scheduler_name")]
    #[schemars(length(min = 1, max = DNS_SUBDOMAIN_LEN))]
    pub scheduler_name: String,

    /// The namespace KAI's binder puts its GPU reservation pods in.
    #[serde(default = "default_kai_reservation_namespace")]
    #[schemars(length(min = 1, max = DNS_LABEL_LEN), regex(pattern = DNS_LABEL_PATTERN))]
    pub reservation_namespace: String,
}

impl Default for KaiSharing {
    fn default() -> Self {
        Self {
            binder: default_kai_binder(),
            scheduler_name: default_kai_scheduler_name(),
            reservation_namespace: default_kai_reservation_namespace(),
        }
    }
}

/// A DNS label (a namespace name).
const DNS_LABEL_PATTERN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
/// `<namespace>/<service account>`.
const SERVICE_ACCOUNT_PATTERN: &str =
    "^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-a-z0-9.]*[a-z0-9])?$";

fn default_kai_binder() -> String {
    "kai-scheduler/binder".into()
}
fn default_kai_scheduler_name() -> String {
    "kai-scheduler".into()
}
fn default_kai_reservation_namespace() -> String {
    "kai-resource-reservation".into()
}

/// See [`GpuSpec::request_as`].
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum RequestAs {
    /// A limit on `gpu.resourceName`, served by the device plugin (or by a DeviceClass with
    /// that `extendedResourceName`, KEP-5004).
    #[default]
    ExtendedResource,
    /// A pod `resourceClaims` entry from the ResourceClaimTemplate
    /// `gpuwarden-<deviceClassName>-<count>`, referenced by the container.
    ResourceClaim,
}

impl std::fmt::Display for RequestAs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::ExtendedResource => "ExtendedResource",
            Self::ResourceClaim => "ResourceClaim",
        })
    }
}

/// See [`GpuSpec::env_from`].
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum EnvFromGpu {
    /// Reject the pod, naming the container.
    #[default]
    Deny,
    /// Rewrite it, with a warning that `envFrom` may still hand GPUs over.
    Warn,
}

impl Default for GpuSpec {
    fn default() -> Self {
        Self {
            resource_name: default_resource_name(),
            default_count: default_count(),
            max_per_container: default_max(),
            max_per_pod: default_max(),
            visible_devices_all: VisibleDevicesAll::default(),
            env_from: EnvFromGpu::default(),
            request_as: RequestAs::default(),
            device_class_name: default_device_class(),
            sharing: None,
        }
    }
}

/// See [`GpuSpec::visible_devices_all`].
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum VisibleDevicesAll {
    /// Request `defaultCount` GPUs.
    #[default]
    DefaultCount,
    /// Reject the pod: it must say how many GPUs it needs.
    Deny,
}

/// Which Linux capabilities a rewritten container keeps.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CapabilitiesSpec {
    /// Stricter than an ordinary container: drop every capability (`drop: [ALL]`) before
    /// adding the kept ones back, and set `allowPrivilegeEscalation: false`. By default
    /// (`false`) a rewritten container keeps what an ordinary container of its namespace has:
    /// the runtime's default capabilities, and setuid programs, within the namespace's Pod
    /// Security level (`restricted` always drops every capability). With `true`, chown,
    /// setuid programs (`su`, `sudo`), user switches (`gosu`, supervisord) and sshd's
    /// privilege separation fail in the container, and the admission warning says so.
    #[serde(default)]
    pub drop_all: bool,

    /// Capabilities always added to a rewritten container.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self.all(c, c in ['AUDIT_CONTROL', 'AUDIT_READ', 'AUDIT_WRITE', 'BLOCK_SUSPEND', 'BPF', 'CHECKPOINT_RESTORE', 'CHOWN', 'DAC_OVERRIDE', 'DAC_READ_SEARCH', 'FOWNER', 'FSETID', 'IPC_LOCK', 'IPC_OWNER', 'KILL', 'LEASE', 'LINUX_IMMUTABLE', 'MAC_ADMIN', 'MAC_OVERRIDE', 'MKNOD', 'NET_ADMIN', 'NET_BIND_SERVICE', 'NET_BROADCAST', 'NET_RAW', 'PERFMON', 'SETFCAP', 'SETGID', 'SETPCAP', 'SETUID', 'SYS_ADMIN', 'SYS_BOOT', 'SYS_CHROOT', 'SYS_MODULE', 'SYS_NICE', 'SYS_PACCT', 'SYS_PTRACE', 'SYS_RAWIO', 'SYS_RESOURCE', 'SYS_TIME', 'SYS_TTY_CONFIG', 'SYSLOG', 'WAKE_ALARM'])").message("unknown Linux capability: names are upper case without the CAP_ prefix, e.g. IPC_LOCK (capabilities(7))"))]
    #[schemars(length(max = 64), inner(length(max = CAPABILITY_LEN)))]
    pub default: Vec<String>,

    /// Capabilities a rewritten container keeps when it asked for them (`capabilities.add`),
    /// beside the runtime's defaults, which it keeps asking for unless `dropAll`. Anything
    /// else it asked for is dropped and named in a warning.
    #[serde(default = "default_allowed_caps")]
    #[x_kube(validation = Rule::new("self.all(c, c in ['AUDIT_CONTROL', 'AUDIT_READ', 'AUDIT_WRITE', 'BLOCK_SUSPEND', 'BPF', 'CHECKPOINT_RESTORE', 'CHOWN', 'DAC_OVERRIDE', 'DAC_READ_SEARCH', 'FOWNER', 'FSETID', 'IPC_LOCK', 'IPC_OWNER', 'KILL', 'LEASE', 'LINUX_IMMUTABLE', 'MAC_ADMIN', 'MAC_OVERRIDE', 'MKNOD', 'NET_ADMIN', 'NET_BIND_SERVICE', 'NET_BROADCAST', 'NET_RAW', 'PERFMON', 'SETFCAP', 'SETGID', 'SETPCAP', 'SETUID', 'SYS_ADMIN', 'SYS_BOOT', 'SYS_CHROOT', 'SYS_MODULE', 'SYS_NICE', 'SYS_PACCT', 'SYS_PTRACE', 'SYS_RAWIO', 'SYS_RESOURCE', 'SYS_TIME', 'SYS_TTY_CONFIG', 'SYSLOG', 'WAKE_ALARM'])").message("unknown Linux capability: names are upper case without the CAP_ prefix, e.g. IPC_LOCK (capabilities(7))"))]
    #[schemars(length(max = 64), inner(length(max = CAPABILITY_LEN)))]
    pub allowed: Vec<String>,
}

impl Default for CapabilitiesSpec {
    fn default() -> Self {
        Self {
            drop_all: false,
            default: Vec::new(),
            allowed: default_allowed_caps(),
        }
    }
}

/// What a policy never touches.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Exemptions {
    /// Namespaces whose pods are never changed (at most 256).
    #[serde(default)]
    #[schemars(length(max = 256), inner(length(max = DNS_LABEL_LEN)))]
    pub namespaces: Vec<String>,

    /// Service accounts, as `namespace/name`, whose pods are never changed (at most 256).
    #[serde(default)]
    #[x_kube(validation = Rule::new("self.all(s, s.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-.a-z0-9]*[a-z0-9])?$'))").message("service accounts are written namespace/name"))]
    #[schemars(length(max = 256), inner(length(max = SERVICE_ACCOUNT_LEN)))]
    pub service_accounts: Vec<String>,

    /// Removed: an image pattern on its own exempted a container in every namespace, so any
    /// tenant could run an exempt image privileged with its own command. Kept in the schema
    /// only so that policies written before still read; one that sets it is invalid
    /// (`RemovedField`) and fails closed. Move each pattern to `containers`, with the
    /// namespaces or service accounts where it applies.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = Rule::new("size(self) == 0").message("exemptions.images was removed: an image pattern alone no longer exempts anything; list it under exemptions.containers with the namespaces or serviceAccounts where it applies"))]
    #[schemars(length(max = 64), inner(length(max = IMAGE_LEN)))]
    pub images: Vec<String>,

    /// Containers exempt by their image, each entry only in the namespaces and for the
    /// service accounts it names (at most 64 entries).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub containers: Vec<ContainerExemption>,
}

/// A scoped image exemption: a container keeps what it has when its image matches one of
/// `images` **and** the pod is in one of `namespaces` (when listed) **and** runs as one of
/// `serviceAccounts` (when listed) **and** the image is pinned to one of `digests` (when
/// listed). At least one of `namespaces` and `serviceAccounts` must be listed.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(has(self.namespaces) && size(self.namespaces) > 0) || (has(self.serviceAccounts) && size(self.serviceAccounts) > 0)").message("a container exemption names the namespaces or serviceAccounts where it applies"))]
pub struct ContainerExemption {
    /// Image glob patterns (`*` and `?`), e.g. `nvcr.io/nvidia/k8s/dcgm-exporter:*`.
    #[schemars(length(min = 1, max = 64), inner(length(max = IMAGE_LEN)))]
    pub images: Vec<String>,

    /// Namespaces where the images are exempt.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(max = DNS_LABEL_LEN)))]
    pub namespaces: Vec<String>,

    /// Service accounts, as `namespace/name`, whose pods may run the images exempt.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = Rule::new("self.all(s, s.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-.a-z0-9]*[a-z0-9])?$'))").message("service accounts are written namespace/name"))]
    #[schemars(length(max = 64), inner(length(max = SERVICE_ACCOUNT_LEN)))]
    pub service_accounts: Vec<String>,

    /// Image digests (`sha256:<64 hex>`): when listed, the image must be pinned to one of
    /// them (`<image>@sha256:...`), so a retagged image is not exempt.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(validation = Rule::new("self.all(d, d.matches('^sha256:[0-9a-f]{64}$'))").message("digests are written sha256:<64 lower-case hex digits>"))]
    #[schemars(length(max = 64), inner(length(max = 71)))]
    pub digests: Vec<String>,
}

/// Health rules node agents apply.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HealthSpec {
    /// Nodes these rules apply to, by label. `{}` selects every node.
    #[serde(default)]
    #[schemars(transform = bounds::label_selector)]
    pub node_selector: LabelSelector,

    /// XID error codes that do not make a GPU unhealthy (application errors such as 13, 31,
    /// 43, 45, 68, 109).
    #[serde(default = "default_ignored_xids")]
    #[schemars(length(max = 256))]
    pub ignored_xids: Vec<u64>,

    /// How long a GPU must go without a new critical event, while it still answers, before
    /// it is healthy again (Go duration, e.g. `10m`).
    #[serde(default = "default_recover_after")]
    #[schemars(regex(pattern = DURATION_PATTERN), length(max = 32))]
    pub recover_after: String,
}

impl Default for HealthSpec {
    fn default() -> Self {
        Self {
            node_selector: LabelSelector::default(),
            ignored_xids: default_ignored_xids(),
            recover_after: default_recover_after(),
        }
    }
}

/// Observed state of a `GpuPolicy`, written by the operator.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(transform = bounds::kubernetes_integers)]
pub struct GpuPolicyStatus {
    /// The `metadata.generation` the operator last validated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// `Ready`: the spec is valid; when it is not, the reason and message say why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(transform = bounds::conditions)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// The image repositories of NVIDIA's node components (the GPU Operator's operands and
/// validator, the device plugin and GPU feature discovery, the sandbox and Kata device
/// plugins, DCGM, the DRA driver, the Network Operator), each by tag and by digest (OLM pins
/// digests without a tag). `nvcr.io/nvidia/cloud-native/*` holds the driver, MIG, vGPU,
/// Kata and confidential-computing managers, DCGM, GDS and gdrcopy.
fn nvidia_component_images() -> Vec<String> {
    const REPOSITORIES: [&str; 11] = [
        "nvcr.io/nvidia/gpu-operator",
        "nvcr.io/nvidia/driver",
        "nvcr.io/nvidia/k8s-device-plugin",
        "nvcr.io/nvidia/gpu-feature-discovery",
        "nvcr.io/nvidia/k8s/dcgm-exporter",
        "nvcr.io/nvidia/k8s/container-toolkit",
        "nvcr.io/nvidia/kubevirt-gpu-device-plugin",
        "nvcr.io/nvidia/k8s-dra-driver-gpu",
        "nvcr.io/nvidia/dra-driver-nvidia-gpu",
        // Older GPU Operators ran the VFIO manager and operand init containers on it.
        "nvcr.io/nvidia/cuda",
        "registry.k8s.io/nv-dra-driver-gpu/nvidia-dra-driver-gpu",
    ];
    const TREES: [&str; 5] = [
        "nvcr.io/nvidia/cloud-native/*",
        "nvcr.io/nvidia/mellanox/*",
        "registry.k8s.io/dra-driver-nvidia/*",
        // NVIDIA does not publish the vGPU manager: each site builds it into its own registry.
        "*/vgpu-manager:*",
        "*/vgpu-manager@*",
    ];
    (REPOSITORIES.iter())
        .flat_map(|r| [format!("{r}:*"), format!("{r}@*")])
        .chain(TREES.map(String::from))
        .collect()
}

/// Longest Linux capability name without `CAP_` (the longest today, `CHECKPOINT_RESTORE`,
/// has 18).
const CAPABILITY_LEN: usize = 32;
/// Longest `namespace/name` of a service account.
const SERVICE_ACCOUNT_LEN: usize = DNS_LABEL_LEN + 1 + DNS_SUBDOMAIN_LEN;

fn default_true() -> bool {
    true
}
fn default_count() -> u32 {
    1
}
fn default_max() -> u32 {
    8
}
fn default_resource_name() -> String {
    crate::RESOURCE_GPU.to_owned()
}
fn default_device_class() -> String {
    crate::claims::DEVICE_CLASS_GPU.to_owned()
}
fn default_runtime_classes() -> Vec<String> {
    vec!["nvidia".into()]
}
fn default_gpu_node_labels() -> Vec<String> {
    vec![crate::RESOURCE_GPU.to_owned()]
}
fn default_gpu_taints() -> Vec<String> {
    vec![crate::RESOURCE_GPU.to_owned()]
}
fn default_gpu_images() -> Vec<String> {
    [
        "nvcr.io/nvidia/*",
        "*/cuda:*",
        "*pytorch/pytorch:*",
        "*vllm/vllm-openai:*",
        "*tensorflow/tensorflow:*-gpu*",
    ]
    .map(String::from)
    .to_vec()
}
fn default_rdma_resources() -> Vec<String> {
    crate::rdma::DEFAULT_RESOURCES.map(String::from).to_vec()
}

fn default_runtime_features() -> Vec<RuntimeFeature> {
    // DeepEP and NVSHMEM recipes set NVIDIA_GDRCOPY=enabled in the GPU container itself.
    vec![RuntimeFeature::Gdrcopy]
}

fn default_driver_capabilities() -> Vec<String> {
    vec!["compute".into(), "utility".into()]
}
fn default_allowed_caps() -> Vec<String> {
    ["IPC_LOCK", "SYS_PTRACE", "SYS_NICE", "SYS_RESOURCE"]
        .map(String::from)
        .to_vec()
}
/// XIDs that are application errors, not hardware faults.
pub fn default_ignored_xids() -> Vec<u64> {
    vec![13, 31, 43, 45, 68, 109]
}
fn default_recover_after() -> String {
    "10m".into()
}

impl GpuPolicy {
    /// The order in which policies are tried: highest `priority` first, ties to the name that
    /// sorts first. Use with `sort_by`.
    pub fn precedence(a: &GpuPolicy, b: &GpuPolicy) -> std::cmp::Ordering {
        b.spec
            .priority
            .cmp(&a.spec.priority)
            .then_with(|| a.metadata.name.cmp(&b.metadata.name))
    }

    /// The built-in default policy: what `deploy/policies/default.yaml` installs, and what the
    /// offline engine uses when no policy file is given.
    pub fn default_policy() -> Self {
        let mut policy = GpuPolicy::new(
            crate::DEFAULT_POLICY_NAME,
            GpuPolicySpec {
                priority: 0,
                namespace_selector: LabelSelector::default(),
                pod_selector: None,
                mode: PolicyMode::Enforce,
                match_: MatchSpec::default(),
                gpu: GpuSpec::default(),
                capabilities: CapabilitiesSpec::default(),
                driver_capabilities: default_driver_capabilities(),
                runtime_features: default_runtime_features(),
                strip_device_host_paths: true,
                strip_cdi_annotations: true,
                void_non_gpu_containers: true,
                rdma_resources: default_rdma_resources(),
                driver_claims: DriverClaims::default(),
                virtual_machines: crate::vm::VirtualMachines::default(),
                exemptions: Exemptions {
                    namespaces: ["kube-system", crate::SYSTEM_NAMESPACE]
                        .map(String::from)
                        .to_vec(),
                    service_accounts: Vec::new(),
                    images: Vec::new(),
                    // NVIDIA's node components need privilege and every GPU of their node,
                    // in the namespaces their official installs use only.
                    containers: vec![ContainerExemption {
                        images: nvidia_component_images(),
                        namespaces: crate::NVIDIA_COMPONENT_NAMESPACES
                            .map(String::from)
                            .to_vec(),
                        service_accounts: Vec::new(),
                        digests: Vec::new(),
                    }],
                },
                health: Some(HealthSpec::default()),
            },
        );
        policy.metadata.labels = Some(BTreeMap::from([(
            "app.kubernetes.io/part-of".to_owned(),
            "gpuwarden".to_owned(),
        )]));
        policy
    }

    /// `name@generation`, as written in the `gpuwarden.io/policy` annotation.
    pub fn reference(&self) -> String {
        // Built in place: this runs on every admission review, where `format!` over the
        // whole string costs several times more.
        let name = self.metadata.name.as_deref().unwrap_or("");
        let mut out = String::with_capacity(name.len() + 21);
        out.push_str(name);
        out.push('@');
        // Writing into a String cannot fail.
        let _ = write!(out, "{}", self.metadata.generation.unwrap_or(0));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_name_the_policy_and_its_generation() {
        let mut policy = GpuPolicy::default_policy();
        policy.metadata.name = Some("team-a".to_owned());
        assert_eq!(policy.reference(), "team-a@0", "no generation yet");
        for generation in [0, 7, 10, 1_234_567, -1, i64::MAX, i64::MIN] {
            policy.metadata.generation = Some(generation);
            assert_eq!(policy.reference(), format!("team-a@{generation}"));
        }
        policy.metadata.name = None;
        assert_eq!(policy.reference(), "@-9223372036854775808");
    }
}
