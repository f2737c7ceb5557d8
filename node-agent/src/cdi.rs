//! The CDI specs on the node, read for the device nodes each CDI device gives a container
//! (docs/design.md, "What a claim's CDI spec hands out").
//!
//! The kubelet's pod-resources API names, for every device a DRA driver prepared for a
//! claim, the fully qualified CDI devices the runtime will inject (`vendor/class=name`). The
//! runtime applies each device's `containerEdits` and its spec's own, so the device nodes a
//! CDI device gives are the union of both. The drivers write those specs into their CDI
//! root, `/var/run/cdi` by default ([`CLAIM_SPEC_DIR`]), as root with mode 0600: the agent
//! reads them where it runs as UID 0, from a read-only mount of that directory and nothing
//! beside it.

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

use crate::host::under;

/// Where CDI specs live.
pub const CDI_DIRS: &[&str] = &["/etc/cdi", "/var/run/cdi"];

/// Where DRA drivers write the CDI specs of the claims they prepare (NVIDIA's GPU and
/// compute-domain kubelet plugins' default `--cdi-root`).
pub const CLAIM_SPEC_DIR: &str = "/var/run/cdi";

/// CDI spec files larger than this are not read (they are a few hundred KiB at most).
pub const MAX_SPEC_FILE: u64 = 4 * 1024 * 1024;

/// The Linux major number of NVIDIA's GPU device nodes (`/dev/nvidia<minor>`, and
/// `nvidiactl` at minor 255).
const NVIDIA_MAJOR: i64 = 195;
/// Minor numbers from here on are NVIDIA's control nodes, not GPUs.
const NVIDIA_CONTROL_MINORS: i64 = 254;
/// The directory of IMEX channel nodes (`channel<N>`).
const IMEX_CHANNELS_DIR: &str = "nvidia-caps-imex-channels";

/// A CDI spec, as far as device nodes go. Fields the agent does not need are ignored.
#[derive(Deserialize)]
struct Spec {
    kind: String,
    #[serde(default)]
    devices: Vec<SpecDevice>,
    #[serde(default, rename = "containerEdits")]
    container_edits: Edits,
}

impl Spec {
    /// A spec's text (`json`: JSON, else YAML), with a `vendor/class` kind.
    fn parse(text: &str, json: bool) -> Result<Self, SpecError> {
        let spec: Spec = if json {
            serde_json::from_str(text).map_err(|e| SpecError::Invalid(e.to_string()))?
        } else {
            serde_saphyr::from_str(text).map_err(|e| SpecError::Invalid(e.to_string()))?
        };
        if !spec.kind.contains('/') {
            return Err(SpecError::Invalid(format!(
                "kind {:?} is not vendor/class",
                spec.kind
            )));
        }
        Ok(spec)
    }
}

/// What one CDI spec directory holds, for the node's posture: each kind with its devices and
/// files, and the files that could not be read or parsed.
#[derive(Debug, Default)]
pub struct Census {
    /// Per kind: (devices, files).
    pub kinds: std::collections::BTreeMap<String, (u32, u32)>,
    /// Files that could not be read (the drivers write theirs mode 0600), by name, with why.
    pub unreadable: Vec<(String, String)>,
    /// Files that are not CDI specs, by name, with why.
    pub invalid: Vec<(String, String)>,
}

/// One spec file of a directory: its name, its text (or why it could not be read; `None`
/// for one too large), and whether it is JSON.
struct SpecFile {
    name: String,
    text: std::io::Result<Option<String>>,
    json: bool,
}

/// The spec files (`.json`, `.yaml`, `.yml`) in `dir`, in the order the runtime reads them,
/// so that a duplicate is the later one.
fn spec_files(dir: &Path) -> std::io::Result<Vec<SpecFile>> {
    let mut paths: Vec<_> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .collect();
    paths.sort();
    Ok((paths.into_iter())
        .filter_map(|path| {
            let json = match path.extension().and_then(|e| e.to_str()) {
                Some("json") => true,
                Some("yaml" | "yml") => false,
                _ => return None,
            };
            let name = path.file_name()?.to_string_lossy().into_owned();
            Some(SpecFile {
                name,
                text: read_bounded(&path),
                json,
            })
        })
        .collect())
}

/// Counts the kinds and devices of the spec files in `dir`.
pub fn census(dir: &Path) -> std::io::Result<Census> {
    let mut out = Census::default();
    for file in spec_files(dir)? {
        match file.text {
            Ok(Some(text)) => match Spec::parse(&text, file.json) {
                Ok(spec) => {
                    let entry = out.kinds.entry(spec.kind).or_default();
                    let devices = u32::try_from(spec.devices.len()).unwrap_or(u32::MAX);
                    entry.0 = entry.0.saturating_add(devices);
                    entry.1 = entry.1.saturating_add(1);
                }
                Err(e) => out.invalid.push((file.name, e.to_string())),
            },
            Ok(None) => {}
            Err(e) => out.unreadable.push((file.name, e.to_string())),
        }
    }
    Ok(out)
}

#[derive(Deserialize)]
struct SpecDevice {
    name: String,
    #[serde(default, rename = "containerEdits")]
    container_edits: Edits,
}

#[derive(Deserialize, Default)]
struct Edits {
    #[serde(default, rename = "deviceNodes")]
    device_nodes: Vec<DeviceNode>,
}

/// One device node a CDI edit creates in a container.
#[derive(Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct DeviceNode {
    /// Its path in the container.
    pub path: String,
    /// Its path on the host, when it differs.
    #[serde(default, rename = "hostPath")]
    pub host_path: Option<String>,
    /// Major number, when the spec gives it (the runtime reads the host node otherwise).
    #[serde(default)]
    pub major: Option<i64>,
    /// Minor number, when the spec gives it.
    #[serde(default)]
    pub minor: Option<i64>,
}

/// What an NVIDIA device node is, as far as allocation goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum NvidiaNode {
    /// A GPU, by minor number: `/dev/nvidia<minor>`.
    Gpu(u32),
    /// An IMEX channel: `/dev/nvidia-caps-imex-channels/channel<N>`.
    ImexChannel(u32),
}

impl DeviceNode {
    /// The node on the host: its `hostPath`, else its `path`.
    pub fn host(&self) -> &str {
        self.host_path.as_deref().unwrap_or(&self.path)
    }

    /// Which GPU or IMEX channel this node is, judged by the host node the runtime opens
    /// (its major and minor numbers where the spec gives them, else its host path), not by
    /// the name it has in the container. `None` for NVIDIA's control and capability nodes
    /// (`nvidiactl`, `nvidia-uvm`, `nvidia-caps/...`), which every GPU container gets, and
    /// for anything else.
    pub fn nvidia(&self) -> Option<NvidiaNode> {
        let host = Path::new(self.host());
        let file = host.file_name()?.to_str()?;
        let dir = host.parent().and_then(Path::file_name);
        if dir.is_some_and(|d| d == IMEX_CHANNELS_DIR) {
            return file
                .strip_prefix("channel")?
                .parse()
                .ok()
                .map(NvidiaNode::ImexChannel);
        }
        if let (Some(NVIDIA_MAJOR), Some(minor)) = (self.major, self.minor) {
            return (minor < NVIDIA_CONTROL_MINORS)
                .then(|| u32::try_from(minor).ok().map(NvidiaNode::Gpu))
                .flatten();
        }
        if self.major.is_some_and(|major| major != NVIDIA_MAJOR) {
            return None;
        }
        let minor: u32 = file.strip_prefix("nvidia")?.parse().ok()?;
        (i64::from(minor) < NVIDIA_CONTROL_MINORS).then_some(NvidiaNode::Gpu(minor))
    }
}

/// Errors reading one spec.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// Not a CDI spec the agent can read.
    #[error("not a CDI spec: {0}")]
    Invalid(String),
    /// Two specs define the same device (the runtime refuses to inject it).
    #[error("device {0} is defined again")]
    Duplicate(String),
}

/// The device nodes of every CDI device in the claim spec directory, by fully qualified
/// name, with what could not be read.
#[derive(Debug, Default)]
pub struct CdiDevices {
    nodes: HashMap<String, Vec<DeviceNode>>,
    /// Spec files that could not be read or parsed, each with its path and why.
    pub problems: Vec<String>,
}

impl CdiDevices {
    /// Reads the specs in [`CLAIM_SPEC_DIR`] under `host_root`. A missing directory holds
    /// no spec; a file that cannot be read or parsed is named in `problems`.
    pub fn read(host_root: &Path) -> Self {
        let mut out = Self::default();
        let dir = CLAIM_SPEC_DIR;
        let files = match spec_files(&under(host_root, dir)) {
            Ok(files) => files,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return out,
            Err(e) => {
                out.problems.push(format!("{dir}: {e}"));
                return out;
            }
        };
        for file in files {
            let shown = format!("{dir}/{}", file.name);
            match file.text {
                Ok(Some(text)) => {
                    if let Err(e) = out.add(&text, file.json) {
                        out.problems.push(format!("{shown}: {e}"));
                    }
                }
                Ok(None) => {}
                Err(e) => out.problems.push(format!("{shown}: {e}")),
            }
        }
        out
    }

    /// Adds the devices of one spec (`json`: JSON, else YAML).
    pub fn add(&mut self, text: &str, json: bool) -> Result<(), SpecError> {
        let spec = Spec::parse(text, json)?;
        let mut duplicate = None;
        for device in spec.devices {
            let name = format!("{}={}", spec.kind, device.name);
            if self.nodes.contains_key(&name) {
                duplicate.get_or_insert(name);
                continue;
            }
            let mut nodes = device.container_edits.device_nodes;
            nodes.extend(spec.container_edits.device_nodes.iter().cloned());
            self.nodes.insert(name, nodes);
        }
        duplicate.map_or(Ok(()), |name| Err(SpecError::Duplicate(name)))
    }

    /// The device nodes the CDI device `qualified` (`vendor/class=name`) gives a container;
    /// `None` when no spec read defines it.
    pub fn nodes(&self, qualified: &str) -> Option<&[DeviceNode]> {
        self.nodes.get(qualified).map(Vec::as_slice)
    }
}

/// The file's text, or `None` when it is not a regular file within [`MAX_SPEC_FILE`].
fn read_bounded(path: &Path) -> std::io::Result<Option<String>> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() || meta.len() > MAX_SPEC_FILE {
        return Ok(None);
    }
    std::fs::read_to_string(path).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The compute-domain driver's two specs for a daemon claim, as v25.12.0 writes them on
    /// a node whose driver root is not `/`.
    const CLAIM_SPEC: &str = r#"---
cdiVersion: 0.5.0
kind: k8s.compute-domain.nvidia.com/claim
devices:
    - name: 440b48f2-daemon-0
      containerEdits:
        env:
            - COMPUTE_DOMAIN_NAME=cd1
        deviceNodes:
            - path: /dev/nvidia-caps/nvidia-cap3
              type: c
              major: 235
              minor: 3
              fileMode: 256
"#;
    const BASE_SPEC: &str = r#"---
cdiVersion: 0.5.0
kind: k8s.compute-domain.nvidia.com/device
devices:
    - name: all
      containerEdits:
        deviceNodes:
            - path: /dev/nvidia-uvm
              hostPath: /driver/dev/nvidia-uvm
            - path: /dev/nvidia0
              hostPath: /driver/dev/nvidia0
            - path: /dev/nvidia1
              hostPath: /driver/dev/nvidia1
            - path: /dev/nvidiactl
              hostPath: /driver/dev/nvidiactl
            - path: /dev/nvidia-caps-imex-channels/channel7
containerEdits:
    env:
        - NVIDIA_VISIBLE_DEVICES=void
    deviceNodes:
        - path: /dev/nvidia-modeset
"#;

    #[test]
    fn a_device_gives_its_own_and_its_specs_nodes() {
        let mut cdi = CdiDevices::default();
        cdi.add(CLAIM_SPEC, false).unwrap();
        cdi.add(BASE_SPEC, false).unwrap();
        let all = cdi
            .nodes("k8s.compute-domain.nvidia.com/device=all")
            .unwrap();
        let judged: Vec<_> = all.iter().filter_map(DeviceNode::nvidia).collect();
        assert_eq!(
            judged,
            [
                NvidiaNode::Gpu(0),
                NvidiaNode::Gpu(1),
                NvidiaNode::ImexChannel(7)
            ]
        );
        assert!(all.iter().any(|n| n.path == "/dev/nvidia-modeset"));
        let claim = cdi
            .nodes("k8s.compute-domain.nvidia.com/claim=440b48f2-daemon-0")
            .unwrap();
        assert_eq!(claim.len(), 1);
        assert_eq!(claim[0].nvidia(), None);
        assert!(
            cdi.nodes("k8s.compute-domain.nvidia.com/device=gpu-0")
                .is_none()
        );
    }

    #[test]
    fn a_node_is_judged_by_what_the_runtime_opens() {
        let node = |path: &str, host: Option<&str>, major, minor| DeviceNode {
            path: path.into(),
            host_path: host.map(Into::into),
            major,
            minor,
        };
        // Named nvidia0 in the container, GPU 5 on the host.
        assert_eq!(
            node("/dev/nvidia0", Some("/dev/nvidia5"), None, None).nvidia(),
            Some(NvidiaNode::Gpu(5))
        );
        // The numbers win over any name.
        assert_eq!(
            node("/dev/whatever", None, Some(195), Some(3)).nvidia(),
            Some(NvidiaNode::Gpu(3))
        );
        assert_eq!(node("/dev/nvidia3", None, Some(10), Some(3)).nvidia(), None);
        // Control nodes are not GPUs.
        assert_eq!(
            node("/dev/nvidiactl", None, Some(195), Some(255)).nvidia(),
            None
        );
        assert_eq!(node("/dev/nvidia255", None, None, None).nvidia(), None);
        assert_eq!(node("/dev/nvidia-uvm", None, None, None).nvidia(), None);
        assert_eq!(
            node("/dev/nvidia-caps/nvidia-cap1", None, None, None).nvidia(),
            None
        );
        assert_eq!(
            node(
                "/dev/x",
                Some("/dev/nvidia-caps-imex-channels/channel2047"),
                None,
                None
            )
            .nvidia(),
            Some(NvidiaNode::ImexChannel(2047))
        );
    }

    #[test]
    fn bad_specs_are_named_and_the_rest_read() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("var/run/cdi");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a-claim.yaml"), CLAIM_SPEC).unwrap();
        std::fs::write(dir.join("b-broken.yaml"), "kind: [").unwrap();
        std::fs::write(
            dir.join("c-nokind.json"),
            r#"{"kind":"nvidia","devices":[]}"#,
        )
        .unwrap();
        std::fs::write(dir.join("d-again.yaml"), CLAIM_SPEC).unwrap();
        std::fs::write(dir.join("notes.txt"), "not a spec").unwrap();
        let json = r#"{"cdiVersion":"0.6.0","kind":"nvidia.com/gpu","devices":[
            {"name":"0","containerEdits":{"deviceNodes":[{"path":"/dev/nvidia0"}]}}]}"#;
        std::fs::write(dir.join("nvidia.json"), json).unwrap();

        let cdi = CdiDevices::read(root.path());
        assert!(cdi.nodes("nvidia.com/gpu=0").is_some());
        assert!(
            cdi.nodes("k8s.compute-domain.nvidia.com/claim=440b48f2-daemon-0")
                .is_some()
        );
        let problems = cdi.problems.join("\n");
        assert_eq!(cdi.problems.len(), 3, "{problems}");
        assert!(problems.contains("/var/run/cdi/b-broken.yaml: not a CDI spec"));
        assert!(problems.contains("/var/run/cdi/c-nokind.json: not a CDI spec: kind \"nvidia\""));
        assert!(problems.contains(
            "/var/run/cdi/d-again.yaml: device k8s.compute-domain.nvidia.com/claim=440b48f2-daemon-0 is defined again"
        ));
    }
}
