//! Which pod and container a process belongs to, from the text of `/proc/<pid>/cgroup`.
//!
//! The kubelet names pod cgroups after the pod UID and the runtime names container cgroups
//! after the container id, in two drivers' styles:
//! - cgroupfs: `/kubepods/burstable/pod<uid>/<container-id>`
//! - systemd: `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with
//!   underscores>.slice/cri-containerd-<id>.scope` (`crio-<id>.scope`, `docker-<id>.scope`)
//!
//! cgroup v2 has one line `0::<path>`; v1 has one line per hierarchy (`12:devices:<path>`).

use std::path::Path;

/// A process's pod and container.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContainerRef {
    /// Pod UID, with dashes.
    pub pod_uid: String,
    /// Container id (hex, without runtime prefix); `None` when the process sits in the pod's
    /// cgroup itself.
    pub container_id: Option<String>,
}

/// Errors reading a process's cgroup.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// The file could not be read for a reason other than the process being gone.
    #[error("failed to read {path}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Reads `/proc/<pid>/cgroup` under `proc_root` (`/proc`, or `/host/proc` with the host's PID
/// namespace). `Ok(None)` when the process is gone.
pub fn read_process_cgroup(proc_root: &Path, pid: u32) -> Result<Option<String>, CgroupError> {
    let path = proc_root.join(pid.to_string()).join("cgroup");
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        // ESRCH: the process exited between NVML's answer and our read.
        Err(e) if e.raw_os_error() == Some(3) => Ok(None),
        Err(source) => Err(CgroupError::Read {
            path: path.display().to_string(),
            source,
        }),
    }
}

/// The pod and container a process belongs to, or `None` for a process outside any pod.
pub fn parse(cgroup_file: &str) -> Option<ContainerRef> {
    // The unified (v2) line wins; otherwise the first v1 line that names a pod.
    let mut best: Option<ContainerRef> = None;
    for line in cgroup_file.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(hierarchy), Some(_controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let Some(found) = parse_path(path) else {
            continue;
        };
        if hierarchy == "0" {
            return Some(found);
        }
        if best.is_none() {
            best = Some(found);
        }
    }
    best
}

/// The pod and container named by one cgroup path.
pub fn parse_path(path: &str) -> Option<ContainerRef> {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    // Search from the end: a kind or nested node puts a `kubepods` tree inside another one.
    let pod_pos = segments.iter().rposition(|s| pod_uid(s).is_some())?;
    let pod_uid = pod_uid(segments[pod_pos])?;
    let container_id = segments.get(pod_pos + 1).and_then(|s| container_id(s));
    Some(ContainerRef {
        pod_uid,
        container_id,
    })
}

/// `pod<uid>` (cgroupfs) or `...-pod<uid_with_underscores>.slice` (systemd).
fn pod_uid(segment: &str) -> Option<String> {
    let name = segment.strip_suffix(".slice").unwrap_or(segment);
    let at = name.rfind("pod")?;
    // cgroupfs: the segment starts with `pod`; systemd: `-pod` follows the QoS slice name.
    if at != 0 && !name[..at].ends_with('-') {
        return None;
    }
    if at != 0 && !name.starts_with("kubepods") && !name.contains("-kubepods") {
        return None;
    }
    let uid = name[at + 3..].replace('_', "-");
    is_uid(&uid).then_some(uid)
}

fn is_uid(s: &str) -> bool {
    // 8-4-4-4-12 hex digits; static pods use a 32-hex config hash instead.
    let parts: Vec<&str> = s.split('-').collect();
    let hex = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_hexdigit());
    (parts.len() == 5
        && [8, 4, 4, 4, 12]
            .iter()
            .zip(&parts)
            .all(|(n, p)| p.len() == *n && hex(p)))
        || (parts.len() == 1 && s.len() == 32 && hex(s))
}

/// `<id>`, `cri-containerd-<id>.scope`, `crio-<id>.scope`, `docker-<id>.scope`.
fn container_id(segment: &str) -> Option<String> {
    let name = segment.strip_suffix(".scope").unwrap_or(segment);
    if name.starts_with("crio-conmon-") {
        // CRI-O's monitor process, not the container.
        return None;
    }
    let id = ["cri-containerd-", "crio-", "docker-", "containerd-"]
        .iter()
        .find_map(|p| name.strip_prefix(p))
        .unwrap_or(name);
    (id.len() >= 12 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| id.to_owned())
}

/// The bare id of `status.containerStatuses[].containerID` (`containerd://<id>`).
pub fn strip_runtime_scheme(container_id: &str) -> &str {
    container_id
        .split_once("://")
        .map_or(container_id, |(_, id)| id)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "5f8a7c1e-3b2d-4e6f-9a0b-1c2d3e4f5a6b";
    const ID: &str = "4c0a3d5e7f9b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d";

    #[test]
    fn table_of_real_cgroup_paths() {
        let uid_ = UID.replace('-', "_");
        let cases: Vec<(&str, String, Option<&str>)> = vec![
            // cgroup v2, systemd driver, containerd (most current distributions).
            (
                "v2 systemd containerd burstable",
                format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/cri-containerd-{ID}.scope\n"
                ),
                Some(ID),
            ),
            (
                "v2 systemd containerd guaranteed",
                format!("0::/kubepods.slice/kubepods-pod{uid_}.slice/cri-containerd-{ID}.scope\n"),
                Some(ID),
            ),
            (
                "v2 systemd cri-o besteffort",
                format!(
                    "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/crio-{ID}.scope\n"
                ),
                Some(ID),
            ),
            (
                "v2 systemd cri-o, nested cgroup inside the container",
                format!(
                    "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/crio-{ID}.scope/container\n"
                ),
                Some(ID),
            ),
            (
                "v2 systemd docker (cri-dockerd)",
                format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/docker-{ID}.scope\n"
                ),
                Some(ID),
            ),
            (
                "v2 cgroupfs containerd",
                format!("0::/kubepods/besteffort/pod{UID}/{ID}\n"),
                Some(ID),
            ),
            (
                "v2 kind node (kubelet.slice inside a container)",
                format!(
                    "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{uid_}.slice/cri-containerd-{ID}.scope\n"
                ),
                Some(ID),
            ),
            (
                "v1 cgroupfs docker, many hierarchies",
                format!(
                    "12:devices:/kubepods/burstable/pod{UID}/{ID}\n11:memory:/kubepods/burstable/pod{UID}/{ID}\n1:name=systemd:/kubepods/burstable/pod{UID}/{ID}\n"
                ),
                Some(ID),
            ),
            (
                "v1 cgroupfs guaranteed (no QoS level)",
                format!("4:cpu,cpuacct:/kubepods/pod{UID}/{ID}\n"),
                Some(ID),
            ),
            (
                "v1 systemd containerd",
                format!(
                    "11:devices:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/cri-containerd-{ID}.scope\n0::/\n"
                ),
                Some(ID),
            ),
            (
                "hybrid: v2 line names the pod, v1 lines do not",
                format!(
                    "1:name=systemd:/user.slice\n0::/kubepods.slice/kubepods-pod{uid_}.slice/cri-containerd-{ID}.scope\n"
                ),
                Some(ID),
            ),
            (
                "process in the pod cgroup itself",
                format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice\n"
                ),
                None,
            ),
            (
                "cri-o conmon is not the container",
                format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/crio-conmon-{ID}.scope\n"
                ),
                None,
            ),
        ];
        for (name, text, id) in cases {
            let got = parse(&text).unwrap_or_else(|| panic!("{name}: no pod found"));
            assert_eq!(got.pod_uid, UID, "{name}");
            assert_eq!(got.container_id.as_deref(), id, "{name}");
        }
    }

    #[test]
    fn static_pod_config_hash() {
        let hash = "0123456789abcdef0123456789abcdef";
        let got = parse(&format!("0::/kubepods/burstable/pod{hash}/{ID}")).unwrap();
        assert_eq!(got.pod_uid, hash);
    }

    #[test]
    fn host_processes_are_not_pods() {
        for text in [
            "0::/system.slice/nvidia-persistenced.service\n",
            "0::/user.slice/user-1000.slice/session-3.scope\n",
            "12:devices:/\n0::/init.scope\n",
            "0::/system.slice/docker-0123456789abcdef0123.scope\n",
            "0::/podman.slice/pod-deadbeef.slice\n",
            "",
            "garbage without colons",
        ] {
            assert_eq!(parse(text), None, "{text:?}");
        }
    }

    #[test]
    fn container_id_schemes() {
        assert_eq!(strip_runtime_scheme("containerd://abc"), "abc");
        assert_eq!(strip_runtime_scheme("cri-o://abc"), "abc");
        assert_eq!(strip_runtime_scheme("abc"), "abc");
    }

    #[test]
    fn missing_process_is_none() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read_process_cgroup(dir.path(), 424242).unwrap().is_none());
    }
}
