//! What makes a container a GPU container, at the level of single values: GPU resource
//! names, `NVIDIA_VISIBLE_DEVICES` values and device paths. The webhook, the node agent and
//! the operator all read GPU signals through these functions, so they agree.

use std::collections::BTreeSet;

use crate::{RESOURCE_GPU, RESOURCE_GPU_SHARED, RESOURCE_MIG_PREFIX};

/// The environment variable the NVIDIA container runtime hands GPUs out by.
pub const ENV_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";

/// Whether `name` is an NVIDIA GPU resource: `nvidia.com/gpu`, `nvidia.com/gpu.shared` or
/// `nvidia.com/mig-*`.
pub fn is_gpu_resource(name: &str) -> bool {
    name == RESOURCE_GPU || name == RESOURCE_GPU_SHARED || name.starts_with(RESOURCE_MIG_PREFIX)
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
    /// Parses an `NVIDIA_VISIBLE_DEVICES` value.
    pub fn parse(value: &str) -> Self {
        let value = value.trim();
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
            .map(str::trim)
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
    if is_clean(path) {
        is_device(path)
    } else {
        is_device(&clean_path(path))
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
