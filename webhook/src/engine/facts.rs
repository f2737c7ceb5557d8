//! Reading the pod: what each container is (privileged, GPU, exempt by image) and which pod
//! volumes and annotations hand out devices. Everything here borrows from the pod's view
//! and the policy.

use gpuwarden_crds::{CDI_ANNOTATION_PREFIX, GpuPolicy, PrivilegedMatch, gpu};

use super::{ContainerKind, ContainerRef, ENV_VISIBLE_DEVICES, VisibleDevices, image_exempt};
use crate::pod::{Container, Map, PodView, Scalar};

/// One container, as the engine sees it.
#[derive(Debug)]
pub(super) struct ContainerFacts<'a> {
    pub(super) at: ContainerRef,
    /// `name` (may be empty in a malformed pod).
    pub(super) name: &'a str,
    pub(super) value: &'a Container<'a>,
    pub(super) privileged: bool,
    pub(super) image_exempt: bool,
    pub(super) gpu_limit: bool,
    /// A GPU resource requested but not limited: its name and quantity.
    pub(super) gpu_request: Option<(&'a str, &'a Scalar<'a>)>,
    pub(super) visible: VisibleDevices,
    /// The `NVIDIA_VISIBLE_DEVICES` value as written, when it has one.
    pub(super) visible_raw: Option<&'a str>,
    /// Whether it mounts one of the pod's device hostPath volumes.
    pub(super) device_mount: bool,
    pub(super) gpu: bool,
}

impl<'a> ContainerFacts<'a> {
    /// The names of its volume mounts, in order ("" for a mount without one).
    pub(super) fn mount_names(&self) -> impl Iterator<Item = &'a str> + use<'a> {
        let value: &'a Container<'a> = self.value;
        value
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| m.name.as_deref().unwrap_or(""))
    }
}

/// Pod-level facts.
#[derive(Debug)]
pub(super) struct PodFacts<'a> {
    /// Init, regular, then ephemeral containers, each list in its order.
    pub(super) containers: Vec<ContainerFacts<'a>>,
    pub(super) device_volumes: DeviceVolumes<'a>,
    /// `cdi.k8s.io/*` annotation keys, sorted.
    pub(super) cdi_keys: Vec<&'a str>,
    pub(super) annotations: Option<&'a Map<'a>>,
}

/// The pod's device hostPath volumes: name and path, sorted by name, each name once (the
/// last of a repeated name wins, as it does in the kubelet's map of volumes).
#[derive(Debug, Default)]
pub(super) struct DeviceVolumes<'a>(Vec<(&'a str, &'a str)>);

impl<'a> DeviceVolumes<'a> {
    fn insert(&mut self, name: &'a str, path: &'a str) {
        match self.0.binary_search_by(|(n, _)| (*n).cmp(name)) {
            Ok(i) => self.0[i] = (name, path),
            Err(i) => self.0.insert(i, (name, path)),
        }
    }

    /// The path of device volume `name`.
    pub(super) fn path(&self, name: &str) -> Option<&'a str> {
        self.0
            .binary_search_by(|(n, _)| (*n).cmp(name))
            .ok()
            .map(|i| self.0[i].1)
    }

    pub(super) fn contains(&self, name: &str) -> bool {
        self.path(name).is_some()
    }

    /// The names, sorted.
    pub(super) fn names(&self) -> impl Iterator<Item = &'a str> + '_ {
        self.0.iter().map(|(name, _)| *name)
    }
}

/// Reads every container of the pod (init, regular, ephemeral) under `policy`.
pub(super) fn read_pod<'a>(pod: &'a PodView<'a>, policy: &GpuPolicy) -> PodFacts<'a> {
    let annotations = pod.annotations();
    let mut cdi_keys = Vec::new();
    let mut cdi_nvidia = false;
    for (key, value) in annotations.into_iter().flatten() {
        if key.starts_with(CDI_ANNOTATION_PREFIX) {
            cdi_keys.push(key.as_ref());
            if value.as_str().is_some_and(|v| v.contains("nvidia.com/")) {
                cdi_nvidia = true;
            }
        }
    }
    let mut device_volumes = DeviceVolumes::default();
    for volume in pod.volumes() {
        let (Some(name), Some(path)) = (
            volume.name.as_deref(),
            volume.host_path.as_ref().and_then(|h| h.path.as_deref()),
        ) else {
            continue;
        };
        if super::is_device_host_path(path) {
            device_volumes.insert(name, path);
        }
    }
    let all = policy.spec.match_.privileged_containers == PrivilegedMatch::All;
    let resource = policy.spec.gpu.resource_name.as_str();
    let images = &policy.spec.exemptions.images;
    let kinds = [
        ContainerKind::Init,
        ContainerKind::Regular,
        ContainerKind::Ephemeral,
    ];
    let count = kinds.iter().map(|&k| pod.containers(k).len()).sum();
    let mut containers = Vec::with_capacity(count);
    for kind in kinds {
        for (index, value) in pod.containers(kind).iter().enumerate() {
            let name = value.name.as_deref().unwrap_or("");
            let privileged = value.is_privileged();
            let image = value.image.as_deref().unwrap_or("");
            let resources = value.resources.as_ref();
            let gpu_limit = resources
                .and_then(|r| r.limits.as_ref())
                .is_some_and(|l| l.keys().any(|k| is_gpu_resource(k, resource)));
            let gpu_request = if gpu_limit {
                None
            } else {
                resources
                    .and_then(|r| r.requests.as_ref())
                    .and_then(|r| r.iter().find(|(k, _)| is_gpu_resource(k, resource)))
                    .map(|(k, v)| (k.as_ref(), v))
            };
            let (visible, visible_raw) = visible_devices(value);
            let mut facts = ContainerFacts {
                at: ContainerRef { kind, index },
                name,
                value,
                privileged,
                image_exempt: image_exempt(image, images),
                gpu_limit,
                gpu_request,
                visible,
                visible_raw,
                device_mount: false,
                gpu: false,
            };
            facts.device_mount = facts.mount_names().any(|m| device_volumes.contains(m));
            facts.gpu = all
                || gpu_limit
                || gpu_request.is_some()
                || facts.visible.is_gpu_signal()
                || facts.device_mount
                || cdi_nvidia;
            containers.push(facts);
        }
    }
    PodFacts {
        containers,
        device_volumes,
        cdi_keys,
        annotations,
    }
}

/// Whether `name` is a GPU resource under a policy whose resource is `policy_resource`.
fn is_gpu_resource(name: &str, policy_resource: &str) -> bool {
    gpu::is_gpu_resource(name) || name == policy_resource
}

/// Reads `NVIDIA_VISIBLE_DEVICES` from a container's `env` (the last entry wins, as in the
/// kubelet), with the value as written.
fn visible_devices<'a>(container: &'a Container<'a>) -> (VisibleDevices, Option<&'a str>) {
    let mut found = (VisibleDevices::Unset, None);
    for entry in container.env.iter().flatten() {
        if entry.name.as_deref() != Some(ENV_VISIBLE_DEVICES) {
            continue;
        }
        found = match entry.value.as_deref() {
            Some(v) => (VisibleDevices::parse(v), Some(v)),
            None if entry.value_from => (VisibleDevices::Indirect, None),
            None => (VisibleDevices::NoGpu, Some("")),
        };
    }
    found
}
