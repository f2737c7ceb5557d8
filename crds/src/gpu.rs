//! The one definition of a GPU container (docs/design.md, "The GPU predicate"): which
//! containers of a pod hold GPUs, and by which signals. The webhook, the node agent and the
//! operator read pods through [`signals`], so they agree; the backstop
//! ValidatingAdmissionPolicy is checked against it by a differential test.
//!
//! A container is a GPU container when any of these holds:
//! - a limit or request on a GPU resource (`nvidia.com/gpu`, `nvidia.com/gpu.shared`,
//!   `nvidia.com/mig-*`, or the governing policy's `gpu.resourceName`);
//! - its last `NVIDIA_VISIBLE_DEVICES` entry names devices or `all`, or comes from
//!   `valueFrom` (unknown here, so assumed to);
//! - it mounts a pod volume whose hostPath is a GPU device path;
//! - the pod carries a `cdi.k8s.io/*` annotation naming an NVIDIA device;
//! - it uses a DRA ResourceClaim of a GPU DeviceClass ([`crate::claims`]);
//! - the governing policy says `match.privilegedContainers: All`, and its last
//!   `NVIDIA_VISIBLE_DEVICES` entry does not say `none`, `void` or empty.
//!
//! [`signal_count`] and [`annotation_count`] say how many GPUs a rewritten GPU container
//! is given.

use std::collections::BTreeSet;

use crate::{
    ANNOTATION_GPU_COUNT, GpuPolicy, PrivilegedMatch, RESOURCE_GPU, RESOURCE_GPU_SHARED,
    RESOURCE_MIG_PREFIX, RuntimeFeature, VisibleDevicesAll,
};

/// The environment variable the NVIDIA container runtime hands GPUs out by.
pub const ENV_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// Environment variable naming the driver capabilities (libraries) the runtime mounts.
pub const ENV_DRIVER_CAPABILITIES: &str = "NVIDIA_DRIVER_CAPABILITIES";
/// MIG configuration access (`/proc/driver/nvidia/capabilities/mig/config`).
pub const ENV_MIG_CONFIG_DEVICES: &str = "NVIDIA_MIG_CONFIG_DEVICES";
/// MIG monitoring access (`/proc/driver/nvidia/capabilities/mig/monitor`).
pub const ENV_MIG_MONITOR_DEVICES: &str = "NVIDIA_MIG_MONITOR_DEVICES";
/// IMEX channels (`/dev/nvidia-caps-imex-channels/channel<N>`): what keeps one multi-node
/// NVLink workload's memory apart from another's. NVIDIA's DRA driver (ComputeDomains) or a
/// device plugin the administrator configured hands them out.
pub const ENV_IMEX_CHANNELS: &str = "NVIDIA_IMEX_CHANNELS";
/// NVSwitch devices (`/dev/nvidia-nvswitchctl`, `/dev/nvidia-nvswitch<N>`): the fabric of the
/// whole node. No device plugin hands them to a workload.
pub const ENV_NVSWITCH: &str = "NVIDIA_NVSWITCH";
/// Every `/dev/infiniband` verbs device and `rdma_cm` of the host ([`crate::RuntimeFeature`]).
pub const ENV_MOFED: &str = "NVIDIA_MOFED";
/// GPUDirect Storage (`/dev/nvidia-fs*`) ([`crate::RuntimeFeature`]).
pub const ENV_GDS: &str = "NVIDIA_GDS";
/// gdrcopy (`/dev/gdrdrv`) ([`crate::RuntimeFeature`]).
pub const ENV_GDRCOPY: &str = "NVIDIA_GDRCOPY";

// The feature is the policy's word; the variable is the runtime's, so it is named here, with
// the runtime's other variables.
impl RuntimeFeature {
    /// The variable that turns it on.
    pub fn variable(self) -> &'static str {
        match self {
            Self::Gdrcopy => ENV_GDRCOPY,
            Self::Gds => ENV_GDS,
            Self::Mofed => ENV_MOFED,
        }
    }
}

/// The NVIDIA runtime's variables, besides `NVIDIA_VISIBLE_DEVICES`, that hand a container
/// host devices and that no container's own value may set, whatever the policy
/// (docs/design.md, "Runtime variables"): the MIG capabilities, IMEX channels, NVSwitch.
pub const DEVICE_VARIABLES: [&str; 4] = [
    ENV_MIG_CONFIG_DEVICES,
    ENV_MIG_MONITOR_DEVICES,
    ENV_IMEX_CHANNELS,
    ENV_NVSWITCH,
];

/// Every variable through which the NVIDIA runtime hands a container devices: what a
/// ConfigMap or Secret key read through `envFrom`, or an `envFrom` prefix with such a key,
/// must not spell.
pub const RUNTIME_VARIABLES: [&str; 8] = [
    ENV_VISIBLE_DEVICES,
    ENV_MIG_CONFIG_DEVICES,
    ENV_MIG_MONITOR_DEVICES,
    ENV_IMEX_CHANNELS,
    ENV_NVSWITCH,
    ENV_MOFED,
    ENV_GDS,
    ENV_GDRCOPY,
];

/// The runtime variable an `envFrom` prefix could spell together with a key of the
/// ConfigMap or Secret it reads: one it is a proper start of (a key is never empty). An
/// empty prefix spells nothing by itself: the key alone is the name, which the ConfigMap
/// guard judges (`deploy/admission/runtime-variables.yaml`).
pub fn spelled_by_prefix(prefix: &str) -> Option<&'static str> {
    (!prefix.is_empty())
        .then(|| {
            (RUNTIME_VARIABLES.iter())
                .find(|v| v.len() > prefix.len() && v.starts_with(prefix))
                .copied()
        })
        .flatten()
}

/// Where the NVIDIA container toolkit reads a device list from mounts
/// (`accept-nvidia-visible-devices-as-volume-mounts`): a mount at
/// `<root>/<device>` hands `<device>` (an index, a UUID or `all`) to the container.
pub const DEVICE_LIST_ROOT: &str = "/var/run/nvidia-container-devices";

/// Part of every device-list path: a mount path that contains it is never voided, by the
/// engine or the API server (CEL cannot clean a path, so both test the raw text).
pub const DEVICE_LIST_MARK: &str = "nvidia-container-devices";

/// The kind of workload that runs a pod on every node: a GPU count it did not write would
/// take a GPU on each node, so neither path adds one.
pub const KIND_DAEMON_SET: &str = "DaemonSet";

/// The `NVIDIA_VISIBLE_DEVICES` value the void rule sets: the runtime hands out no GPU.
pub const VOID: &str = "void";

/// Whether a mount path (cleaned lexically) is at or under [`DEVICE_LIST_ROOT`], and the
/// device it names: `Some(None)` for the root itself, `Some(Some(device))` below it.
pub fn device_list_entry(path: &str) -> Option<Option<String>> {
    let path = cleaned(path);
    let rest = path.strip_prefix(DEVICE_LIST_ROOT)?;
    if rest.is_empty() {
        return Some(None);
    }
    let device = rest.strip_prefix('/')?;
    Some(Some(device.split('/').next().unwrap_or(device).to_owned()))
}

/// Whether `name` is an NVIDIA GPU resource: `nvidia.com/gpu`, `nvidia.com/gpu.shared` or
/// `nvidia.com/mig-*`.
pub fn is_gpu_resource(name: &str) -> bool {
    name == RESOURCE_GPU || name == RESOURCE_GPU_SHARED || name.starts_with(RESOURCE_MIG_PREFIX)
}

/// The resource NVIDIA's sandbox (KubeVirt) device plugin advertises passthrough GPUs as when
/// it is given the alias `pgpu`.
pub const RESOURCE_PASSTHROUGH_ALIAS: &str = "nvidia.com/pgpu";

/// Whether `name` is a GPU that NVIDIA's sandbox device plugin hands out whole to a VM
/// (KubeVirt, Kata, confidential containers): `nvidia.com/pgpu`, or `nvidia.com/` followed
/// by the upper-case device name it reads from the PCI database (`nvidia.com/GH100_H100_PCIE`)
/// or a vGPU type (`nvidia.com/NVIDIA_A10-12Q`). NVIDIA's other resources under
/// `nvidia.com/` (the GPU, MIG and network operators' names) are lower case.
pub fn is_passthrough_resource(name: &str) -> bool {
    name == RESOURCE_PASSTHROUGH_ALIAS
        || name
            .strip_prefix("nvidia.com/")
            .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_uppercase()))
}

/// The CDI device kind of a passthrough GPU (`nvidia.com/pgpu=0`): the Kata runtime hands it
/// to the pod's VM. The NVIDIA container toolkit on the host names its devices
/// `nvidia.com/gpu=...` and never reads this kind.
pub const CDI_PASSTHROUGH_PREFIX: &str = "nvidia.com/pgpu=";

/// Whether a `cdi.k8s.io/*` annotation value names passthrough GPUs only: every
/// comma-separated device is of the [`CDI_PASSTHROUGH_PREFIX`] kind.
pub fn is_passthrough_cdi(value: &str) -> bool {
    value
        .split(',')
        .all(|d| d.starts_with(CDI_PASSTHROUGH_PREFIX))
}

/// A host device an unprivileged container cannot open, whatever it mounts: the device
/// cgroup lets through only the devices the kubelet allocated (and a few terminals).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostDevice {
    /// The device, or the directory of devices, as the host names it.
    pub path: &'static str,
    /// What it is, for messages.
    pub what: &'static str,
    /// The extended resources of device plugins that hand a container this device (globs).
    pub resources: &'static [&'static str],
}

/// The host devices a de-privileged container cannot open (docs/design.md, "Do no harm").
/// `/dev/infiniband` takes its resources from the policy's `rdmaResources` too; `/dev/vfio`
/// from the passthrough GPU resources ([`is_passthrough_resource`]).
pub const HOST_DEVICES: &[HostDevice] = &[
    HostDevice {
        path: "/dev/infiniband",
        what: "RDMA devices",
        resources: &[],
    },
    HostDevice {
        path: "/dev/vfio",
        what: "VFIO passthrough devices",
        resources: &[],
    },
    HostDevice {
        path: "/dev/kvm",
        what: "KVM",
        resources: &["devices.kubevirt.io/kvm"],
    },
    HostDevice {
        path: "/dev/net/tun",
        what: "TUN/TAP",
        resources: &["devices.kubevirt.io/tun"],
    },
    HostDevice {
        path: "/dev/vhost-net",
        what: "vhost-net",
        resources: &["devices.kubevirt.io/vhost-net"],
    },
    HostDevice {
        path: "/dev/fuse",
        what: "FUSE",
        resources: &[],
    },
];

/// What the whole host `/dev` (or a directory above one of [`HOST_DEVICES`]) is to messages:
/// no device plugin hands it out.
pub const HOST_DEV_TREE: HostDevice = HostDevice {
    path: "/dev",
    what: "every host device",
    resources: &[],
};

/// The host device an unprivileged container cannot open that a hostPath (cleaned
/// lexically) reaches: one of [`HOST_DEVICES`] or a path under it, or [`HOST_DEV_TREE`] for
/// a directory that holds one of them (`/dev`, `/dev/net`).
pub fn host_device(path: &str) -> Option<HostDevice> {
    let path = cleaned(path);
    let path = path.as_ref();
    let under = |parent: &str, child: &str| {
        child
            .strip_prefix(parent)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    };
    if let Some(device) = HOST_DEVICES.iter().find(|d| under(d.path, path)) {
        return Some(*device);
    }
    (path != "/" && HOST_DEVICES.iter().any(|d| under(path, d.path))).then_some(HOST_DEV_TREE)
}

/// How a container's `NVIDIA_VISIBLE_DEVICES` reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VisibleDevices {
    /// Not set in the pod spec.
    Unset,
    /// `none`, `void` or empty: no GPU.
    NoGpu,
    /// `all`.
    All,
    /// A list of indices, GPU UUIDs or MIG identifiers; the number of distinct entries.
    Devices(u32),
    /// Set from a ConfigMap, Secret or field reference: the value is unknown here.
    Indirect,
}

impl VisibleDevices {
    /// Parses an `NVIDIA_VISIBLE_DEVICES` value. Blanks around it and around each entry are
    /// ASCII whitespace, as a CEL `\\s` reads them.
    pub fn parse(value: &str) -> Self {
        let value = value.trim_ascii();
        if value.is_empty()
            || value.eq_ignore_ascii_case("none")
            || value.eq_ignore_ascii_case("void")
        {
            return Self::NoGpu;
        }
        if value.eq_ignore_ascii_case("all") {
            return Self::All;
        }
        let ids: BTreeSet<&str> = value
            .split(',')
            .map(str::trim_ascii)
            .filter(|s| !s.is_empty())
            .collect();
        if ids.iter().any(|id| id.eq_ignore_ascii_case("all")) {
            return Self::All;
        }
        if ids.is_empty() {
            return Self::NoGpu;
        }
        Self::Devices(u32::try_from(ids.len()).unwrap_or(u32::MAX))
    }

    /// Whether this value hands GPUs to the container.
    pub fn is_gpu_signal(&self) -> bool {
        matches!(self, Self::All | Self::Devices(_) | Self::Indirect)
    }
}

/// Whether a hostPath is a device path: `/dev`, `/dev/nvidia*`, `/dev/dri`, `/dev/dri/...`.
pub fn is_device_host_path(path: &str) -> bool {
    let is_device = |clean: &str| {
        clean == "/dev"
            || clean.starts_with("/dev/nvidia")
            || clean == "/dev/dri"
            || clean.starts_with("/dev/dri/")
    };
    is_device(&cleaned(path))
}

/// `path` cleaned lexically ([`clean_path`]), borrowed when it is clean already.
pub(crate) fn cleaned(path: &str) -> std::borrow::Cow<'_, str> {
    if is_clean(path) {
        std::borrow::Cow::Borrowed(path)
    } else {
        std::borrow::Cow::Owned(clean_path(path))
    }
}

/// Whether [`clean_path`] would leave `path` as it is: `/`, or absolute with no empty, `.`
/// or `..` part and no trailing `/`.
fn is_clean(path: &str) -> bool {
    path == "/"
        || path
            .strip_prefix('/')
            .is_some_and(|rest| rest.split('/').all(|p| !matches!(p, "" | "." | "..")))
}

/// Lexically cleans an absolute path (`//`, `.`, `..`, trailing `/`), as the kubelet would
/// resolve it, so `/dev/./nvidia0/` and `/dev//dri` are recognised.
fn clean_path(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    let mut out = String::with_capacity(path.len() + 1);
    for p in parts {
        out.push('/');
        out.push_str(p);
    }
    if out.is_empty() {
        out.push('/');
    }
    out
}

/// Where a container sits in the pod spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum ContainerKind {
    /// `spec.initContainers`.
    Init,
    /// `spec.containers`.
    Regular,
    /// `spec.ephemeralContainers`.
    Ephemeral,
}

impl ContainerKind {
    /// The pod spec field holding containers of this kind.
    pub fn field(self) -> &'static str {
        match self {
            Self::Init => "initContainers",
            Self::Regular => "containers",
            Self::Ephemeral => "ephemeralContainers",
        }
    }

    /// How a message names a container of this kind.
    pub fn noun(self) -> &'static str {
        match self {
            Self::Init => "init container",
            Self::Regular => "container",
            Self::Ephemeral => "ephemeral container",
        }
    }
}

/// One `env` entry, as the predicate reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EnvEntry<'a> {
    /// `name`.
    pub name: &'a str,
    /// `value`, when set.
    pub value: Option<&'a str>,
    /// Whether `valueFrom` is set.
    pub value_from: bool,
}

/// A container as the predicate reads it: implemented for the webhook's borrowed view and
/// for the API types.
pub trait ContainerSpec {
    /// `name`.
    fn name(&self) -> &str;
    /// `image`.
    fn image(&self) -> &str;
    /// `securityContext.privileged == true`.
    fn privileged(&self) -> bool;
    /// The resource names in `resources.limits`.
    fn limit_names(&self) -> impl Iterator<Item = &str>;
    /// The resource names in `resources.requests`.
    fn request_names(&self) -> impl Iterator<Item = &str>;
    /// `env`, in order.
    fn env_entries(&self) -> impl Iterator<Item = EnvEntry<'_>>;
    /// `volumeMounts` as (name, mountPath), in order.
    fn mounts(&self) -> impl Iterator<Item = (&str, &str)>;
    /// Whether `envFrom` lists anything: variables admission cannot see.
    fn env_from(&self) -> bool;
    /// The `prefix` of each `envFrom` entry, in order (`""` where it has none).
    fn env_from_prefixes(&self) -> impl Iterator<Item = &str>;
    /// The pod `resourceClaims` entries it uses (`resources.claims[].name`), in order.
    fn claim_names(&self) -> impl Iterator<Item = &str>;
}

/// What the governing policy adds to the predicate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rules<'p> {
    /// `gpu.resourceName`: one more GPU resource name.
    pub resource: &'p str,
    /// `match.privilegedContainers: All`: every container counts.
    pub every_container: bool,
    /// `stripCdiAnnotations`: an NVIDIA CDI annotation is a leak the rewrite removes.
    pub strip_cdi: bool,
    /// `match.runtimeClassNames`.
    pub runtime_classes: &'p [String],
    /// `match.gpuNodeLabels`: prefixes.
    pub node_labels: &'p [String],
    /// `match.gpuTaints`.
    pub taints: &'p [String],
    /// `match.gpuImages`: globs.
    pub images: &'p [String],
    /// `match.gpuResources`: more GPU resources (globs).
    pub resources: &'p [String],
    /// `gpu.deviceClassName`: one more GPU DeviceClass.
    pub device_class: &'p str,
    /// `runtimeFeatures`: the feature variables a container may set.
    pub features: &'p [RuntimeFeature],
    /// `virtualMachines.runtimeClasses`: globs of the runtime classes that run a pod in its
    /// own VM, where a passthrough GPU's variables are read inside it.
    pub vm_runtime_classes: &'p [String],
}

impl Default for Rules<'_> {
    /// No policy: the NVIDIA resource names only, no hints, no VM runtime class; CDI
    /// annotations are leaks.
    fn default() -> Self {
        Self {
            resource: RESOURCE_GPU,
            every_container: false,
            strip_cdi: true,
            runtime_classes: &[],
            node_labels: &[],
            taints: &[],
            images: &[],
            resources: &[],
            device_class: crate::claims::DEVICE_CLASS_GPU,
            features: &[],
            vm_runtime_classes: &[],
        }
    }
}

impl<'p> Rules<'p> {
    /// The rules of `policy`.
    pub fn of(policy: &'p GpuPolicy) -> Self {
        Self {
            resource: &policy.spec.gpu.resource_name,
            every_container: policy.spec.match_.privileged_containers == PrivilegedMatch::All,
            strip_cdi: policy.spec.strip_cdi_annotations,
            runtime_classes: &policy.spec.match_.runtime_class_names,
            node_labels: &policy.spec.match_.gpu_node_labels,
            taints: &policy.spec.match_.gpu_taints,
            images: &policy.spec.match_.gpu_images,
            resources: &policy.spec.match_.gpu_resources,
            device_class: &policy.spec.gpu.device_class_name,
            features: &policy.spec.runtime_features,
            vm_runtime_classes: &policy.spec.virtual_machines.runtime_classes,
        }
    }

    /// Whether a container's own entry of variable `name` would hand it devices these rules
    /// do not let it ask for: one of [`DEVICE_VARIABLES`], or a feature variable the policy
    /// does not list in `runtimeFeatures`.
    pub fn is_device_variable(&self, name: &str) -> bool {
        DEVICE_VARIABLES.contains(&name)
            || (RuntimeFeature::ALL.iter())
                .any(|f| f.variable() == name && !self.features.contains(f))
    }

    /// The variables [`Self::is_device_variable`] holds for, in [`RUNTIME_VARIABLES`] order.
    pub fn device_variables(&self) -> Vec<&'static str> {
        (RUNTIME_VARIABLES.iter().copied())
            .filter(|v| self.is_device_variable(v))
            .collect()
    }

    /// Whether a container's own entry of `name` is a door these rules judge:
    /// `NVIDIA_VISIBLE_DEVICES`, or a device variable ([`Self::is_device_variable`]).
    pub fn is_judged_variable(&self, name: &str) -> bool {
        name == ENV_VISIBLE_DEVICES || self.is_device_variable(name)
    }

    /// The variables [`Self::is_judged_variable`] holds for, `NVIDIA_VISIBLE_DEVICES` first.
    pub fn judged_variables(&self) -> Vec<&'static str> {
        (RUNTIME_VARIABLES.iter().copied())
            .filter(|v| self.is_judged_variable(v))
            .collect()
    }

    /// The first hint the pod's placement gives that it runs on GPU nodes.
    fn placement_hint<'a>(&self, pod: &PodSignals<'a>) -> Option<Hint<'a>> {
        if let Some(class) = pod
            .runtime_class
            .filter(|c| self.runtime_classes.iter().any(|r| r == c))
        {
            return Some(Hint::RuntimeClass(class));
        }
        let gpu_label = |key: &str| self.node_labels.iter().any(|p| key.starts_with(p.as_str()));
        if let Some(key) = pod.node_keys.iter().copied().find(|k| gpu_label(k)) {
            return Some(Hint::NodeLabel(key));
        }
        let key = pod
            .toleration_keys
            .iter()
            .copied()
            .find(|k| self.taints.iter().any(|t| t == k))?;
        Some(Hint::Toleration(key))
    }

    /// Whether `name` is a GPU resource under these rules: NVIDIA's GPU and passthrough
    /// resources, `gpu.resourceName` and `match.gpuResources`.
    pub fn is_gpu_resource(&self, name: &str) -> bool {
        is_gpu_resource(name)
            || name == self.resource
            || is_passthrough_resource(name)
            || (self.resources.iter()).any(|p| crate::exemptions::glob_match(p, name))
    }
}

/// What says, short of a GPU signal, that a privileged container sees GPUs: the pod runs
/// on GPU nodes with the NVIDIA runtime, or the container runs GPU software whose image
/// sets `NVIDIA_VISIBLE_DEVICES` itself (docs/design.md, "The GPU predicate").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hint<'a> {
    /// `runtimeClassName` in `match.runtimeClassNames`.
    RuntimeClass(&'a str),
    /// A `nodeSelector` or required node affinity key with a `match.gpuNodeLabels` prefix.
    NodeLabel(&'a str),
    /// A toleration of a `match.gpuTaints` key.
    Toleration(&'a str),
    /// The image matches this `match.gpuImages` pattern.
    Image(&'a str),
}

impl std::fmt::Display for Hint<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::RuntimeClass(class) => write!(f, "runtimeClassName {class}"),
            Self::NodeLabel(key) => write!(f, "node label {key}"),
            Self::Toleration(key) => write!(f, "toleration of {key}"),
            Self::Image(pattern) => write!(f, "image pattern {pattern}"),
        }
    }
}

/// What the predicate reads of the pod as a whole: its device hostPath volumes and whether
/// an NVIDIA CDI annotation hands devices to every container.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodSignals<'a> {
    /// Device volumes, (name, path) sorted by name, each name once: the last of a repeated
    /// name wins, as in the kubelet's map of volumes.
    device_volumes: Vec<(&'a str, &'a str)>,
    /// The `cdi.k8s.io/*` annotation keys the rewrite removes, in order: all but those that
    /// name the passthrough GPUs the pod holds.
    cdi_keys: Vec<&'a str>,
    /// Whether one of them names an NVIDIA device.
    cdi_nvidia: bool,
    /// `runtimeClassName`.
    runtime_class: Option<&'a str>,
    /// Node label keys the pod's placement requires: `nodeSelector` keys (not set to
    /// `false`) and required node affinity keys (not `NotIn` or `DoesNotExist`).
    node_keys: Vec<&'a str>,
    /// Toleration keys.
    toleration_keys: Vec<&'a str>,
    /// The pod's `resourceClaims` entries whose claim asks for GPUs, sorted.
    gpu_claims: Vec<&'a str>,
    /// A container of the pod holds a passthrough GPU and a VM runtime class runs it: the pod
    /// runs in a VM sandbox on a node whose GPUs are bound to VFIO, where the host's NVIDIA
    /// runtime hands out nothing. A KubeVirt launcher pod runs on the host: not so.
    passthrough: bool,
}

impl<'a> PodSignals<'a> {
    /// Reads `spec.volumes` as (name, hostPath path) and `metadata.annotations` as
    /// (key, string value). `passthrough` says whether a container of the pod holds a
    /// passthrough GPU resource ([`is_passthrough_resource`]) and a VM runtime class runs the
    /// pod: then a CDI annotation that
    /// names only passthrough GPUs ([`is_passthrough_cdi`]) names the GPU the pod holds,
    /// which the Kata runtime hands its VM; it is no signal, and it stays.
    pub fn read(
        volumes: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
        annotations: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
        passthrough: bool,
    ) -> Self {
        let mut signals = Self {
            passthrough,
            ..Self::default()
        };
        for (name, path) in volumes {
            let Some(path) = path.filter(|p| is_device_host_path(p)) else {
                continue;
            };
            let volumes = &mut signals.device_volumes;
            match volumes.binary_search_by(|(n, _)| (*n).cmp(name)) {
                Ok(i) => volumes[i] = (name, path),
                Err(i) => volumes.insert(i, (name, path)),
            }
        }
        for (key, value) in annotations {
            if crate::is_cdi_annotation(key) {
                if passthrough && value.is_some_and(is_passthrough_cdi) {
                    continue;
                }
                signals.cdi_keys.push(key);
                signals.cdi_nvidia |= value.is_some_and(|v| v.contains("nvidia.com/"));
            }
        }
        signals
    }

    /// Adds where the pod asks to run: `runtimeClassName`, `nodeSelector` as (key, string
    /// value), required node affinity as (key, operator), toleration keys.
    pub fn placed(
        mut self,
        runtime_class: Option<&'a str>,
        node_selector: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
        required: impl IntoIterator<Item = (&'a str, &'a str)>,
        tolerations: impl IntoIterator<Item = &'a str>,
    ) -> Self {
        self.runtime_class = runtime_class;
        self.node_keys = (node_selector.into_iter())
            .filter(|(_, value)| *value != Some("false"))
            .map(|(key, _)| key)
            .chain(
                (required.into_iter())
                    .filter(|(_, op)| !matches!(*op, "NotIn" | "DoesNotExist"))
                    .map(|(key, _)| key),
            )
            .collect();
        self.toleration_keys = tolerations.into_iter().filter(|k| !k.is_empty()).collect();
        self
    }

    /// Adds the names of the pod's `resourceClaims` entries whose ResourceClaim (or
    /// template) requests devices of a GPU DeviceClass ([`crate::claims`]): reading them
    /// needs the API, which the caller has.
    pub fn claimed(mut self, gpu_claims: impl IntoIterator<Item = &'a str>) -> Self {
        self.gpu_claims = gpu_claims.into_iter().collect();
        self.gpu_claims.sort_unstable();
        self.gpu_claims.dedup();
        self
    }

    /// Whether the pod's `resourceClaims` entry `name` holds GPUs.
    pub fn is_gpu_claim(&self, name: &str) -> bool {
        self.gpu_claims.binary_search(&name).is_ok()
    }

    /// The path of device volume `name`.
    pub fn device_volume(&self, name: &str) -> Option<&'a str> {
        let volumes = &self.device_volumes;
        (volumes.binary_search_by(|(n, _)| (*n).cmp(name)).ok()).map(|i| volumes[i].1)
    }

    /// The device volumes' names, sorted.
    pub fn device_volume_names(&self) -> impl Iterator<Item = &'a str> + '_ {
        self.device_volumes.iter().map(|(name, _)| *name)
    }

    /// Whether an init or regular container holds a passthrough GPU.
    pub fn holds_passthrough(&self) -> bool {
        self.passthrough
    }

    /// The `cdi.k8s.io/*` annotation keys the rewrite removes (`stripCdiAnnotations`).
    pub fn cdi_keys(&self) -> &[&'a str] {
        &self.cdi_keys
    }

    /// Whether an NVIDIA CDI annotation hands devices to the pod's containers.
    pub fn cdi_nvidia(&self) -> bool {
        self.cdi_nvidia
    }
}

/// Why a container is (or is not) a GPU container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Signals<'c> {
    /// A limit on a GPU resource.
    pub limit: bool,
    /// A GPU resource requested but not limited: its name.
    pub request: Option<&'c str>,
    /// Its last `NVIDIA_VISIBLE_DEVICES` entry.
    pub visible: VisibleDevices,
    /// That entry's value as written, when it has one.
    pub visible_raw: Option<&'c str>,
    /// It mounts a device hostPath volume.
    pub device_mount: bool,
    /// The pod's NVIDIA CDI annotation.
    pub cdi: bool,
    /// The policy counts every container that does not set `NVIDIA_VISIBLE_DEVICES` to
    /// `none`, `void` or empty.
    pub every_container: bool,
    /// Mounts under [`DEVICE_LIST_ROOT`]: the device list the toolkit would read from them
    /// (`All` for `all` or a mount of the root itself).
    pub device_list: VisibleDevices,
    /// The first variable it sets that hands it devices it may not ask for
    /// ([`Rules::is_device_variable`]: a MIG capability, IMEX channels, NVSwitch, or a
    /// runtime feature the policy does not allow), set at all, by value or `valueFrom`.
    pub device_variable: Option<&'c str>,
    /// The policy removes NVIDIA CDI annotations (`stripCdiAnnotations`).
    pub strip_cdi: bool,
    /// `envFrom` lists something: it may set `NVIDIA_VISIBLE_DEVICES` where admission
    /// cannot see it (an `env` entry of the same name overrides it).
    pub env_from: bool,
    /// An `envFrom` prefix that could spell a runtime variable with a key of what it reads
    /// ([`spelled_by_prefix`]): the prefix, and the variable.
    pub env_from_spells: Option<(&'c str, &'static str)>,
    /// For a privileged container: the first hint that it sees GPUs.
    pub hint: Option<Hint<'c>>,
    /// The first pod `resourceClaims` entry it uses whose claim holds GPUs: the GPUs it gets
    /// through DRA, which the rewrite keeps rather than adding a limit on top.
    pub claim: Option<&'c str>,
    /// The pod holds a passthrough GPU ([`is_passthrough_resource`]) in a VM runtime class: its
    /// `NVIDIA_VISIBLE_DEVICES` and MIG variables are read inside its VM, among the GPUs
    /// passed through to it, never by the host's runtime, so they neither name GPUs here nor
    /// leak.
    pub passthrough: bool,
}

impl Signals<'_> {
    /// Whether these make a GPU container.
    pub fn is_gpu(&self) -> bool {
        let env = match self.host_visible() {
            // `privilegedContainers: All` counts a container that says nothing about GPUs,
            // never one that says `none`, `void` or empty.
            VisibleDevices::Unset => self.every_container || self.hint.is_some(),
            visible => visible.is_gpu_signal(),
        };
        self.limit
            || self.request.is_some()
            || env
            || self.device_mount
            || self.cdi
            || self.device_list.is_gpu_signal()
            || self.claim.is_some()
    }

    /// Its `NVIDIA_VISIBLE_DEVICES` as the host's runtime reads it: unset in a pod that holds
    /// a passthrough GPU.
    fn host_visible(&self) -> &VisibleDevices {
        if self.passthrough {
            &VisibleDevices::Unset
        } else {
            &self.visible
        }
    }

    /// Whether a privileged container may hold GPUs: a GPU container, or one whose
    /// `envFrom` may set `NVIDIA_VISIBLE_DEVICES` with no `env` entry to override it. Such a
    /// container never passes as "no GPU" unseen.
    pub fn maybe_gpu(&self) -> bool {
        self.is_gpu() || (self.env_from && self.visible == VisibleDevices::Unset)
    }

    /// Whether the container reaches GPUs around the kubelet even when unprivileged
    /// (docs/design.md, "Leaks"): `NVIDIA_VISIBLE_DEVICES` naming devices, `all` or set
    /// through `valueFrom`; a device variable it may not set (a MIG capability, IMEX
    /// channels, NVSwitch, a feature the policy does not allow); an `envFrom` prefix that
    /// could spell a runtime variable, unless its own last `NVIDIA_VISIBLE_DEVICES` is
    /// `void` (the runtime then acts on none of them); a device-list mount; or an NVIDIA CDI annotation the
    /// policy removes. The container's own `NVIDIA_VISIBLE_DEVICES` comes after the device
    /// plugin's in the kubelet's list, so the runtime reads the container's: even beside a
    /// GPU limit it is a leak.
    pub fn leaks(&self) -> bool {
        (!self.passthrough
            && (self.visible.is_gpu_signal()
                || self.device_variable.is_some()
                || (self.env_from_spells.is_some() && self.visible_raw != Some(VOID))))
            || self.device_list != VisibleDevices::Unset
            || (self.cdi && self.strip_cdi)
    }
}

/// The GPU signals of one container of a pod, under the governing policy's rules.
pub fn signals<'c, C: ContainerSpec>(
    container: &'c C,
    pod: &PodSignals<'c>,
    rules: Rules<'c>,
) -> Signals<'c> {
    let limit = container
        .limit_names()
        .any(|name| rules.is_gpu_resource(name));
    let request = if limit {
        None
    } else {
        container
            .request_names()
            .find(|name| rules.is_gpu_resource(name))
    };
    // The last entry wins, as in the kubelet.
    let last = (container.env_entries()).fold(None, |last, entry| {
        (entry.name == ENV_VISIBLE_DEVICES)
            .then_some(entry)
            .or(last)
    });
    let (visible, visible_raw) = match last {
        None => (VisibleDevices::Unset, None),
        Some(EnvEntry {
            value: Some(value), ..
        }) => (VisibleDevices::parse(value), Some(value)),
        Some(EnvEntry {
            value_from: true, ..
        }) => (VisibleDevices::Indirect, None),
        Some(_) => (VisibleDevices::NoGpu, Some("")),
    };
    let mut devices = BTreeSet::new();
    let mut device_list = VisibleDevices::Unset;
    let mut device_mount = false;
    for (name, path) in container.mounts() {
        device_mount |= pod.device_volume(name).is_some();
        match device_list_entry(path) {
            None => {}
            Some(Some(device)) if !device.eq_ignore_ascii_case("all") => {
                devices.insert(device);
            }
            Some(_) => device_list = VisibleDevices::All,
        }
    }
    if device_list == VisibleDevices::Unset && !devices.is_empty() {
        device_list = VisibleDevices::Devices(u32::try_from(devices.len()).unwrap_or(u32::MAX));
    }
    let device_variable = (container.env_entries())
        .find(|e| rules.is_device_variable(e.name))
        .map(|e| e.name);
    let env_from_spells =
        (container.env_from_prefixes()).find_map(|p| spelled_by_prefix(p).map(|v| (p, v)));
    Signals {
        limit,
        request,
        visible,
        visible_raw,
        device_mount,
        cdi: pod.cdi_nvidia,
        every_container: rules.every_container,
        device_list,
        device_variable,
        strip_cdi: rules.strip_cdi,
        env_from: container.env_from(),
        env_from_spells,
        claim: container.claim_names().find(|name| pod.is_gpu_claim(name)),
        passthrough: pod.passthrough,
        hint: if container.privileged() {
            let image = container.image();
            (rules.images.iter())
                .find(|p| crate::exemptions::image_exempt(image, std::slice::from_ref(p)))
                .map(|p| Hint::Image(p))
                .or_else(|| rules.placement_hint(pod))
        } else {
            None
        },
    }
}

/// Whether a container has a limit or request on a passthrough GPU resource.
pub fn holds_passthrough<C: ContainerSpec>(container: &C) -> bool {
    (container.limit_names().chain(container.request_names())).any(is_passthrough_resource)
}

/// Where a rewritten container's GPU count came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CountFrom<'a> {
    /// Its GPU request, copied into the limit.
    Request,
    /// The pod annotation `gpuwarden.io/gpu-count.<name>`.
    ContainerAnnotation(&'a str),
    /// The pod annotation `gpuwarden.io/gpu-count`: the pod's total, split over `ways`
    /// containers (1: all of it).
    PodAnnotation {
        /// The annotation's number.
        total: u32,
        /// How many containers share it.
        ways: u32,
    },
    /// `NVIDIA_VISIBLE_DEVICES=all`, counted as the policy's default.
    VisibleAll,
    /// The IDs in `NVIDIA_VISIBLE_DEVICES`, as written.
    Visible(&'a str),
    /// The devices named by mounts under [`DEVICE_LIST_ROOT`].
    DeviceList,
    /// A mount of [`DEVICE_LIST_ROOT`] itself or of its `all`, counted as the policy's
    /// default.
    DeviceListAll,
    /// Nothing said how many: the policy's default, and the signal that made it a GPU
    /// container.
    PolicyDefault(Because<'a>),
}

impl CountFrom<'_> {
    /// Whether the pod asked for this many GPUs itself (a request, an annotation, the IDs
    /// or devices it named), rather than being given the policy's default because of what
    /// it mounts, runs or where it runs.
    pub fn asked_by_pod(&self) -> bool {
        !matches!(
            self,
            Self::VisibleAll | Self::DeviceListAll | Self::PolicyDefault(_)
        )
    }
}

/// Why a container counted with the policy's default is a GPU container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Because<'a> {
    /// A device hostPath mount.
    DeviceMount,
    /// The pod's NVIDIA CDI annotation.
    Cdi,
    /// `match.privilegedContainers: All`.
    EveryContainer,
    /// A hint.
    Hint(Hint<'a>),
    /// Anything else (a count was asked for).
    Other,
}

impl std::fmt::Display for CountFrom<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Self::Request => f.write_str("request"),
            Self::ContainerAnnotation(name) => {
                write!(f, "annotation {ANNOTATION_GPU_COUNT}.{name}")
            }
            Self::PodAnnotation { total, ways: 1 } => {
                write!(f, "annotation {ANNOTATION_GPU_COUNT}={total}")
            }
            Self::PodAnnotation { total, ways } => write!(
                f,
                "annotation {ANNOTATION_GPU_COUNT}={total}, the pod's total split over {ways} containers"
            ),
            Self::VisibleAll => write!(f, "{ENV_VISIBLE_DEVICES}=all, policy default"),
            Self::Visible(raw) => write!(f, "{ENV_VISIBLE_DEVICES}={raw}"),
            Self::DeviceList => write!(f, "device-list mounts under {DEVICE_LIST_ROOT}"),
            Self::DeviceListAll => write!(
                f,
                "device-list mount of all GPUs under {DEVICE_LIST_ROOT}, policy default"
            ),
            Self::PolicyDefault(because) => {
                f.write_str("policy default")?;
                match because {
                    Because::DeviceMount => f.write_str(", GPU by a device mount"),
                    Because::Cdi => f.write_str(", GPU by an NVIDIA CDI annotation"),
                    Because::EveryContainer => {
                        f.write_str(", GPU by match.privilegedContainers: All")
                    }
                    Because::Hint(hint) => write!(f, ", GPU by {hint}"),
                    Because::Other => Ok(()),
                }
            }
        }
    }
}

/// Why a regular container gets no GPU when an earlier one names the same GPUs in
/// `NVIDIA_VISIBLE_DEVICES` (`raw`, its own value): `first` holds them (docs/design.md, "GPU
/// counts"). The engine's report and the API server's rewrite both write this text.
pub fn shared_gpus_text(first: &str, raw: &str) -> String {
    format!(
        "names the same GPUs as container {first} ({ENV_VISIBLE_DEVICES}={raw}); an extended resource cannot be shared, so container {first} holds them and this one gets none (a DRA ResourceClaim that both containers reference would give both the same GPUs)"
    )
}

/// The number a count annotation gives (`key` names it in the error): a whole number,
/// at least `min`.
pub fn annotation_count(
    key: &str,
    text: Option<&str>,
    shown: &str,
    min: u32,
) -> Result<u32, String> {
    match text.map(str::trim).unwrap_or("").parse::<u32>() {
        Ok(n) if n >= min => Ok(n),
        _ => Err(format!(
            "annotation {key}={shown} is not a whole number of GPUs of at least {min}"
        )),
    }
}

/// How many GPUs a GPU container's own signals ask for, and where the number came from
/// (docs/design.md, "Rewrite rules", rule 3), when no annotation says: the distinct devices
/// its device-list mounts name, else the distinct IDs in `NVIDIA_VISIBLE_DEVICES`, else the
/// policy's default (also for `all`, unless the policy denies it). The error says why the
/// container cannot be given GPUs as it is.
pub fn signal_count<'a>(
    signals: &Signals<'a>,
    policy: &GpuPolicy,
) -> Result<(u32, CountFrom<'a>), String> {
    let default = policy.spec.gpu.default_count;
    // The toolkit reads a device list from mounts before the environment.
    let (visible, all_from) = match signals.device_list {
        VisibleDevices::Devices(n) => return Ok((n, CountFrom::DeviceList)),
        VisibleDevices::All => (&VisibleDevices::All, CountFrom::DeviceListAll),
        _ => (&signals.visible, CountFrom::VisibleAll),
    };
    match visible {
        VisibleDevices::All => match policy.spec.gpu.visible_devices_all {
            VisibleDevicesAll::DefaultCount => Ok((default, all_from)),
            VisibleDevicesAll::Deny => Err(format!(
                "{ENV_VISIBLE_DEVICES}=all is not allowed: request GPUs with limits {} or annotation {ANNOTATION_GPU_COUNT}",
                policy.spec.gpu.resource_name
            )),
        },
        VisibleDevices::Devices(n) => {
            Ok((*n, CountFrom::Visible(signals.visible_raw.unwrap_or(""))))
        }
        _ => Ok((default, CountFrom::PolicyDefault(signals.because()))),
    }
}

impl<'c> Signals<'c> {
    /// Why a container with no count of its own is a GPU container, for messages.
    pub fn because(&self) -> Because<'c> {
        if self.device_mount {
            Because::DeviceMount
        } else if self.cdi {
            Because::Cdi
        } else if let Some(hint) = self.hint.filter(|_| self.visible == VisibleDevices::Unset) {
            Because::Hint(hint)
        } else if self.every_container {
            Because::EveryContainer
        } else {
            Because::Other
        }
    }

    /// The GPUs its `NVIDIA_VISIBLE_DEVICES` names, as a key two containers naming the same
    /// GPUs share: the distinct IDs sorted, or `all`. `None` when it names none or is not
    /// known.
    pub fn visible_key(&self) -> Option<String> {
        match self.visible {
            VisibleDevices::All => Some("all".to_owned()),
            VisibleDevices::Devices(_) => {
                let ids: BTreeSet<&str> = (self.visible_raw?.split(','))
                    .map(str::trim_ascii)
                    .filter(|s| !s.is_empty())
                    .collect();
                Some(ids.into_iter().collect::<Vec<_>>().join(","))
            }
            _ => None,
        }
    }
}

/// The predicate over the API's own types, for the node agent, the operator and tests.
macro_rules! api_container_spec {
    ($($ty:ty),*) => {$(
        impl ContainerSpec for $ty {
            fn name(&self) -> &str {
                &self.name
            }
            fn image(&self) -> &str {
                self.image.as_deref().unwrap_or("")
            }
            fn privileged(&self) -> bool {
                self.security_context.as_ref().and_then(|s| s.privileged) == Some(true)
            }
            fn limit_names(&self) -> impl Iterator<Item = &str> {
                let limits = self.resources.as_ref().and_then(|r| r.limits.as_ref());
                limits.into_iter().flatten().map(|(k, _)| k.as_str())
            }
            fn request_names(&self) -> impl Iterator<Item = &str> {
                let requests = self.resources.as_ref().and_then(|r| r.requests.as_ref());
                requests.into_iter().flatten().map(|(k, _)| k.as_str())
            }
            fn env_entries(&self) -> impl Iterator<Item = EnvEntry<'_>> {
                self.env.iter().flatten().map(|e| EnvEntry {
                    name: &e.name,
                    value: e.value.as_deref(),
                    value_from: e.value_from.is_some(),
                })
            }
            fn mounts(&self) -> impl Iterator<Item = (&str, &str)> {
                (self.volume_mounts.iter().flatten())
                    .map(|m| (m.name.as_str(), m.mount_path.as_str()))
            }
            fn env_from(&self) -> bool {
                self.env_from.as_ref().is_some_and(|e| !e.is_empty())
            }
            fn env_from_prefixes(&self) -> impl Iterator<Item = &str> {
                (self.env_from.iter().flatten()).map(|e| e.prefix.as_deref().unwrap_or(""))
            }
            fn claim_names(&self) -> impl Iterator<Item = &str> {
                let claims = self.resources.as_ref().and_then(|r| r.claims.as_ref());
                claims.into_iter().flatten().map(|c| c.name.as_str())
            }
        }
    )*};
}

api_container_spec!(
    k8s_openapi::api::core::v1::Container,
    k8s_openapi::api::core::v1::EphemeralContainer
);

impl<'a> PodSignals<'a> {
    /// The pod-level signals of an API `Pod`; `vm_runtime_classes` are the globs of the
    /// runtime classes that run a pod in its own VM ([`Rules::vm_runtime_classes`]).
    pub fn of_pod(pod: &'a k8s_openapi::api::core::v1::Pod, vm_runtime_classes: &[String]) -> Self {
        let volumes = pod.spec.as_ref().and_then(|s| s.volumes.as_ref());
        let in_vm = (pod.spec.as_ref())
            .and_then(|s| s.runtime_class_name.as_deref())
            .is_some_and(|class| crate::vm::matches_runtime_class(vm_runtime_classes, class));
        let passthrough = in_vm
            && (pod.spec.iter())
                .flat_map(|s| s.init_containers.iter().flatten().chain(&s.containers))
                .any(holds_passthrough);
        Self::read(
            volumes.into_iter().flatten().map(|v| {
                let path = v.host_path.as_ref().map(|h| h.path.as_str());
                (v.name.as_str(), path)
            }),
            (pod.metadata.annotations.iter().flatten())
                .map(|(k, v)| (k.as_str(), Some(v.as_str()))),
            passthrough,
        )
        .placed(
            pod.spec
                .as_ref()
                .and_then(|s| s.runtime_class_name.as_deref()),
            (pod.spec.iter())
                .flat_map(|s| s.node_selector.iter().flatten())
                .map(|(k, v)| (k.as_str(), Some(v.as_str()))),
            (pod.spec.iter())
                .filter_map(|s| s.affinity.as_ref()?.node_affinity.as_ref())
                .filter_map(|a| {
                    a.required_during_scheduling_ignored_during_execution
                        .as_ref()
                })
                .flat_map(|r| r.node_selector_terms.iter())
                .flat_map(|t| t.match_expressions.iter().flatten())
                .map(|e| (e.key.as_str(), e.operator.as_str())),
            (pod.spec.iter())
                .flat_map(|s| s.tolerations.iter().flatten())
                .filter_map(|t| t.key.as_deref()),
        )
    }
}

/// Every container of an API `Pod` (init, regular, ephemeral) with its kind, index, whether
/// it is privileged, its image and its GPU signals under `rules`.
pub fn pod_containers<'p>(
    pod: &'p k8s_openapi::api::core::v1::Pod,
    rules: Rules<'p>,
) -> Vec<PodContainer<'p>> {
    let Some(spec) = &pod.spec else {
        return Vec::new();
    };
    let pod = PodSignals::of_pod(pod, rules.vm_runtime_classes);
    let mut out = Vec::new();
    for (i, c) in spec.init_containers.iter().flatten().enumerate() {
        out.push(describe(c, (ContainerKind::Init, i), &pod, rules));
    }
    for (i, c) in spec.containers.iter().enumerate() {
        out.push(describe(c, (ContainerKind::Regular, i), &pod, rules));
    }
    for (i, c) in spec.ephemeral_containers.iter().flatten().enumerate() {
        out.push(describe(c, (ContainerKind::Ephemeral, i), &pod, rules));
    }
    out
}

/// One container of an API `Pod`, as [`pod_containers`] describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodContainer<'p> {
    /// Which list it is in.
    pub kind: ContainerKind,
    /// Its index there.
    pub index: usize,
    /// `name`.
    pub name: &'p str,
    /// `image`.
    pub image: &'p str,
    /// `securityContext.privileged == true`.
    pub privileged: bool,
    /// Its GPU signals.
    pub signals: Signals<'p>,
}

/// One container as [`pod_containers`] describes it.
fn describe<'p, C: ContainerSpec>(
    container: &'p C,
    (kind, index): (ContainerKind, usize),
    pod: &PodSignals<'p>,
    rules: Rules<'p>,
) -> PodContainer<'p> {
    PodContainer {
        kind,
        index,
        name: container.name(),
        image: container.image(),
        privileged: container.privileged(),
        signals: signals(container, pod, rules),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_device_list_path_holds_the_mark() {
        assert!(DEVICE_LIST_ROOT.contains(DEVICE_LIST_MARK));
    }

    #[test]
    fn visible_devices_parsing() {
        assert_eq!(VisibleDevices::parse("all"), VisibleDevices::All);
        assert_eq!(VisibleDevices::parse(" ALL "), VisibleDevices::All);
        assert_eq!(VisibleDevices::parse("none"), VisibleDevices::NoGpu);
        assert_eq!(VisibleDevices::parse("void"), VisibleDevices::NoGpu);
        assert_eq!(VisibleDevices::parse(""), VisibleDevices::NoGpu);
        assert_eq!(VisibleDevices::parse(" , "), VisibleDevices::NoGpu);
        assert_eq!(VisibleDevices::parse("0,1"), VisibleDevices::Devices(2));
        assert_eq!(VisibleDevices::parse("0, 1,1"), VisibleDevices::Devices(2));
        assert_eq!(
            VisibleDevices::parse("GPU-8f2c3b1a-1111-2222-3333-444455556666"),
            VisibleDevices::Devices(1)
        );
        assert_eq!(
            VisibleDevices::parse(
                "MIG-2a3b4c5d-aaaa-bbbb-cccc-ddddeeeeffff,MIG-GPU-8f2c3b1a-1111-2222-3333-444455556666/1/0,0:1"
            ),
            VisibleDevices::Devices(3)
        );
        assert!(!VisibleDevices::parse("void").is_gpu_signal());
        assert!(VisibleDevices::parse("3").is_gpu_signal());
    }

    #[test]
    fn device_paths() {
        for p in [
            "/dev",
            "/dev/",
            "/dev/nvidia0",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/dri",
            "/dev/dri/card0",
            "//dev/./nvidia1",
            "/host/../dev",
            "dev/nvidia0",
            "/dev/dri/../nvidia0",
            "/dev/dri/..",
        ] {
            assert!(is_device_host_path(p), "{p}");
        }
        for p in [
            "/dev/shm",
            "/devices",
            "/var/lib/nvidia",
            "/dev/fuse",
            "/",
            "",
            "/driver",
            "/dev/nvidia0/../../shm",
            "/dev/dri/../shm",
        ] {
            assert!(!is_device_host_path(p), "{p}");
        }
    }

    #[test]
    fn a_path_is_clean_exactly_when_cleaning_leaves_it_as_it_is() {
        let parts = ["", ".", "..", "dev", "dri", "nvidia0", "x"];
        // Every path of up to four parts from the list, with and without the leading slash.
        let mut paths = vec![String::new()];
        for _ in 0..4 {
            let longer: Vec<String> = paths
                .iter()
                .flat_map(|p| parts.iter().map(move |part| format!("{p}/{part}")))
                .collect();
            paths.extend(longer);
        }
        for path in paths
            .iter()
            .flat_map(|p| [p.clone(), p.trim_start_matches('/').to_owned()])
        {
            assert_eq!(is_clean(&path), clean_path(&path) == path, "{path:?}");
        }
    }

    #[test]
    fn the_predicate_reads_every_signal_once() {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "annotations": {"cdi.k8s.io/x": "vendor.com/dev=1"}},
            "spec": {
                "volumes": [
                    {"name": "fuse", "hostPath": {"path": "/dev/fuse"}},
                    {"name": "dotted", "hostPath": {"path": "/dev/./nvidia0"}}
                ],
                "initContainers": [{"name": "requested",
                    "resources": {"requests": {"nvidia.com/mig-1g.10gb": "1"}}}],
                "containers": [
                    {"name": "fuse", "securityContext": {"privileged": true},
                     "volumeMounts": [{"name": "fuse", "mountPath": "/dev/fuse"}]},
                    {"name": "dotted", "volumeMounts": [{"name": "dotted", "mountPath": "/d"}]},
                    {"name": "none", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"},
                        {"name": "NVIDIA_VISIBLE_DEVICES", "value": " NONE "}]},
                    {"name": "indirect", "env": [{"name": "NVIDIA_VISIBLE_DEVICES",
                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]},
                    {"name": "limited", "resources": {"limits": {"nvidia.com/gpu.shared": "1"}}}
                ],
                "ephemeralContainers": [{"name": "debug"}]
            }
        }))
        .unwrap();
        let read: Vec<(ContainerKind, &str, bool)> = pod_containers(&pod, Rules::default())
            .iter()
            .map(|c| (c.kind, c.name, c.signals.is_gpu()))
            .collect();
        assert_eq!(
            read,
            [
                (ContainerKind::Init, "requested", true),
                (ContainerKind::Regular, "fuse", false),
                (ContainerKind::Regular, "dotted", true),
                (ContainerKind::Regular, "none", false),
                (ContainerKind::Regular, "indirect", true),
                (ContainerKind::Regular, "limited", true),
                (ContainerKind::Ephemeral, "debug", false),
            ]
        );
        let all = Rules {
            every_container: true,
            ..Rules::default()
        };
        // `All` counts every container but the one that says NONE.
        let read: Vec<(&str, bool)> = pod_containers(&pod, all)
            .iter()
            .map(|c| (c.name, c.signals.is_gpu()))
            .collect();
        assert!(
            read.iter().all(|&(name, gpu)| gpu == (name != "none")),
            "{read:?}"
        );
    }
}
