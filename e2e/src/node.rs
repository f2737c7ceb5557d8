//! The node side of the end-to-end suites: the GPU node a test runs pods on, whether this
//! machine is that node (for the tests that import images into its containerd and read its
//! kubelet), the commands they run there, and what a container saw of its GPUs.

use std::collections::BTreeSet;
use std::io::Write;
use std::process::{Command, Stdio};

use http::Method;
use serde_json::Value;

use crate::cluster::{Cluster, ClusterError};
use crate::image::derive_with_env;

/// What the node tests need, for their `SKIPPED` line where a cluster has none.
pub const NEEDS_GPU_NODE: &str = "no Ready node with 2 allocatable nvidia.com/gpu (a kubelet with NVIDIA's device plugin, on GPUs or NVIDIA's mock NVML; GPUWARDEN_E2E_NODE names the node)";

/// The busybox image the node tests run: `$GPUWARDEN_E2E_BUSYBOX`, default
/// docker.io/library/busybox:latest. It is never pulled: import it where the node has no
/// registry.
pub fn busybox() -> String {
    std::env::var("GPUWARDEN_E2E_BUSYBOX")
        .unwrap_or_else(|_| "docker.io/library/busybox:latest".into())
}

/// Of a `NodeList` (JSON), the Ready node with at least two allocatable GPUs
/// (`$GPUWARDEN_E2E_NODE` picks one by name).
pub fn gpu_node_in(list: &Value) -> Option<&Value> {
    let wanted = std::env::var("GPUWARDEN_E2E_NODE").ok();
    list["items"].as_array()?.iter().find(|node| {
        let name = node["metadata"]["name"].as_str().unwrap_or_default();
        let ready = is_ready(node);
        let gpus: u32 = node["status"]["allocatable"][gpuwarden_crds::RESOURCE_GPU]
            .as_str()
            .and_then(|g| g.parse().ok())
            .unwrap_or(0);
        wanted.as_deref().is_none_or(|w| w == name) && ready && gpus >= 2
    })
}

/// Whether a Node (JSON) is `Ready`.
pub fn is_ready(node: &Value) -> bool {
    (node["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten())
    .any(|c| c["type"] == "Ready" && c["status"] == "True")
}

/// The GPU node of the cluster ([`gpu_node_in`]), `None` where it has none.
pub async fn gpu_node(cluster: &Cluster) -> Result<Option<Value>, ClusterError> {
    let list = cluster
        .raw(Method::GET, "/api/v1/nodes", "application/json", None)
        .await?;
    if !list.status.is_success() {
        return Err(ClusterError::Body {
            what: "list nodes".into(),
            message: list.message().to_owned(),
        });
    }
    Ok(gpu_node_in(&list.body).cloned())
}

/// The binaries of gpuwarden's image: one each for its three components.
pub const COMPONENT_BINARIES: [&str; 3] = [
    "gpuwarden-webhook",
    "gpuwarden-operator",
    "gpuwarden-node-agent",
];

/// Why a test that works on `node` from this machine (importing images into its
/// containerd with `ctr`, reading its kubelet's sockets) cannot run here, or `None` where it
/// can: the node must be this machine, the test must run as root, and `tools` (with `ctr`
/// first, answering) must be on `PATH`.
pub fn local_node_problem(node: &Value, tools: &[&str]) -> Option<String> {
    let name = node["metadata"]["name"].as_str().unwrap_or_default();
    if !is_this_machine(node) {
        return Some(format!(
            "node {name} is not this machine (none of its addresses is local): the test imports images into the node's containerd"
        ));
    }
    if !is_root() {
        return Some("not running as root: `ctr` and the kubelet's sockets need it".into());
    }
    // `ctr` always: the check below asks containerd through it.
    for tool in std::iter::once(&"ctr").chain(tools) {
        if Command::new(tool)
            .arg("--help")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_err()
        {
            return Some(format!("no {tool} on PATH"));
        }
    }
    let images = ctr(&["images", "ls", "-q"]);
    if !images.ok {
        return Some(format!(
            "ctr cannot reach containerd's k8s.io namespace: {}",
            images.stderr.trim()
        ));
    }
    None
}

/// Whether the node is this machine: its name or `Hostname` address is this host's name, or
/// one of its IP addresses can be bound here.
fn is_this_machine(node: &Value) -> bool {
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let hostname = hostname.trim();
    if node["metadata"]["name"] == hostname {
        return true;
    }
    (node["status"]["addresses"].as_array().into_iter().flatten()).any(|a| {
        let address = a["address"].as_str().unwrap_or_default();
        match a["type"].as_str() {
            Some("Hostname") => address == hostname,
            _ => address
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| std::net::TcpListener::bind((ip, 0)).is_ok()),
        }
    })
}

/// Whether this process's effective user is root.
fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        == Some("0")
}

/// What a command printed.
pub struct Out {
    /// It exited 0.
    pub ok: bool,
    /// Its standard output.
    pub stdout: String,
    /// Its standard error.
    pub stderr: String,
}

/// Runs `command`, feeding it `stdin`; panics only where it cannot start.
pub fn exec(command: &mut Command, stdin: Option<&str>) -> Out {
    command
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command
        .spawn()
        .unwrap_or_else(|e| panic!("failed to start {command:?}: {e}"));
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        let _ = pipe.write_all(input.as_bytes());
    }
    let output = child.wait_with_output().expect("wait for a command");
    Out {
        ok: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// `ctr -n k8s.io ARGS`: containerd's namespace of the kubelet's images.
pub fn ctr(args: &[&str]) -> Out {
    exec(Command::new("ctr").args(["-n", "k8s.io"]).args(args), None)
}

/// The image references in containerd's `k8s.io` namespace.
pub fn image_refs() -> BTreeSet<String> {
    ctr(&["images", "ls", "-q"])
        .stdout
        .lines()
        .map(str::to_owned)
        .collect()
}

/// What a container printed of itself: the environment (`env`), then its `/dev/nvidia*`
/// entries, between the marks [`SEEN_COMMAND`] prints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Seen {
    /// `NVIDIA_VISIBLE_DEVICES`, where set.
    pub visible: Option<String>,
    /// The MIG access variables that are set, `NAME=value`.
    pub mig: Vec<String>,
    /// `/dev/nvidia<N>`: the GPU device nodes, sorted.
    pub gpu_devices: Vec<String>,
    /// The other device variables of the NVIDIA runtime that are set, `NAME=value`: IMEX
    /// channels, NVSwitch, and the features MOFED, GDS and gdrcopy.
    pub device_variables: Vec<String>,
}

/// The shell script a container runs to print what it sees, then stay (`sleep 3600`).
pub const SEEN_COMMAND: &str =
    "env; echo ==devices==; ls -d /dev/nvidia* 2>/dev/null; echo ==end==; sleep 3600";

/// The same, ending instead of staying (for init containers and jobs).
pub const SEEN_ONCE_COMMAND: &str =
    "env; echo ==devices==; ls -d /dev/nvidia* 2>/dev/null; echo ==end==";

impl Seen {
    /// Reads a container's log; `None` until it printed the end mark.
    pub fn parse(log: &str) -> Option<Seen> {
        let (env, rest) = log.split_once("==devices==\n")?;
        let (devices, _) = rest.split_once("==end==")?;
        let mut seen = Seen::default();
        for line in env.lines() {
            if let Some(v) = line.strip_prefix("NVIDIA_VISIBLE_DEVICES=") {
                seen.visible = Some(v.to_owned());
            } else if line.starts_with("NVIDIA_MIG_CONFIG_DEVICES=")
                || line.starts_with("NVIDIA_MIG_MONITOR_DEVICES=")
            {
                seen.mig.push(line.to_owned());
            } else if (gpuwarden_crds::gpu::RUNTIME_VARIABLES.iter()).any(|v| {
                line.strip_prefix(v)
                    .is_some_and(|rest| rest.starts_with('='))
            }) {
                seen.device_variables.push(line.to_owned());
            }
        }
        seen.gpu_devices = (devices.lines())
            .map(str::trim)
            .filter(|d| {
                d.strip_prefix("/dev/nvidia")
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            })
            .map(str::to_owned)
            .collect();
        seen.gpu_devices.sort();
        Some(seen)
    }

    /// The GPUs `NVIDIA_VISIBLE_DEVICES` names, sorted: none for absent, empty, `void` or
    /// `none`.
    pub fn visible_ids(&self) -> Vec<String> {
        let value = self.visible.as_deref().unwrap_or("").trim();
        if value.is_empty() || value == "void" || value == "none" {
            return Vec::new();
        }
        let mut ids: Vec<String> = value.split(',').map(|s| s.trim().to_owned()).collect();
        ids.sort();
        ids
    }

    /// Whether the container sees exactly the GPUs `allocated` (the kubelet's device IDs for
    /// it): its `NVIDIA_VISIBLE_DEVICES` names them (none, where it got none), no MIG access
    /// variable is set, no other device variable the runtime would act on (IMEX channels,
    /// NVSwitch, MOFED, GDS; gdrcopy without a GPU), and it has one GPU device node per
    /// allocated GPU. Under NVIDIA's runtime the process's own variable reads `void` (every
    /// CDI spec the toolkit generates sets it): there its device nodes are what it got, and
    /// `void` with one node per allocated GPU holds. `Err` says what it sees beyond that.
    pub fn holds_exactly(&self, allocated: &[String]) -> Result<(), String> {
        let mut allocated = allocated.to_vec();
        allocated.sort();
        let mut wrong = Vec::new();
        let toolkit_void = self.visible.as_deref().map(str::trim) == Some("void")
            && self.gpu_devices.len() == allocated.len();
        if self.visible_ids() != allocated && !toolkit_void {
            wrong.push(format!(
                "NVIDIA_VISIBLE_DEVICES={} where the kubelet allocated {allocated:?}",
                self.visible.as_deref().unwrap_or("(unset)")
            ));
        }
        if !self.mig.is_empty() {
            wrong.push(format!("MIG access variables {:?}", self.mig));
        }
        // The runtime acts on these wherever NVIDIA_VISIBLE_DEVICES is set and not void
        // (`none` too); gdrcopy is the policy's default feature for a container with GPUs.
        let visible = self.visible.as_deref().map(str::trim);
        if visible.is_some_and(|v| !v.is_empty() && v != "void") {
            let handed: Vec<&String> = (self.device_variables.iter())
                .filter(|v| {
                    let (name, value) = v.split_once('=').unwrap_or((v, ""));
                    match name {
                        "NVIDIA_IMEX_CHANNELS" | "NVIDIA_NVSWITCH" => true,
                        "NVIDIA_GDRCOPY" => value == "enabled" && allocated.is_empty(),
                        _ => value == "enabled",
                    }
                })
                .collect();
            if !handed.is_empty() {
                wrong.push(format!("device variables {handed:?}"));
            }
        }
        if self.gpu_devices.len() != allocated.len() {
            wrong.push(format!(
                "device nodes {:?} for {} allocated GPU(s)",
                self.gpu_devices,
                allocated.len()
            ));
        }
        if wrong.is_empty() {
            Ok(())
        } else {
            Err(wrong.join("; "))
        }
    }

    /// `NVIDIA_VISIBLE_DEVICES=..., devices=[...]`, for a table.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "NVIDIA_VISIBLE_DEVICES={}, devices={:?}",
            self.visible.as_deref().unwrap_or("(unset)"),
            self.gpu_devices
        );
        if !self.mig.is_empty() {
            s.push_str(&format!(", {}", self.mig.join(", ")));
        }
        if !self.device_variables.is_empty() {
            s.push_str(&format!(", {}", self.device_variables.join(", ")));
        }
        s
    }
}

/// containerd image references this test added, removed when it ends (also on failure).
#[derive(Default)]
pub struct Images {
    before: Option<BTreeSet<String>>,
}

impl Images {
    /// Imports the OCI image layout tar `layout` into the node's containerd; the images it
    /// adds are removed at the end.
    pub fn import(&mut self, layout: &std::path::Path) -> Result<(), String> {
        if self.before.is_none() {
            self.before = Some(image_refs());
        }
        let import = ctr(&[
            "images",
            "import",
            "--platform",
            "linux/amd64",
            &layout.to_string_lossy(),
        ]);
        if import.ok {
            Ok(())
        } else {
            Err(format!("ctr images import: {}", import.stderr))
        }
    }
}

impl Drop for Images {
    fn drop(&mut self) {
        if let Some(before) = self.before.take() {
            for image in image_refs().difference(&before) {
                let _ = ctr(&["images", "rm", image]);
            }
        }
    }
}

/// Builds an image like every CUDA base image (busybox with `ENV NVIDIA_VISIBLE_DEVICES=all`)
/// named `name`, and imports it into the node's containerd; `images` removes it again.
pub fn import_image(name: &str, images: &mut Images) {
    let work = tempfile::tempdir().expect("a temporary directory");
    let base = work.path().join("busybox.tar");
    let export = ctr(&[
        "images",
        "export",
        "--platform",
        "linux/amd64",
        &base.to_string_lossy(),
        &busybox(),
    ]);
    assert!(
        export.ok,
        "ctr images export {}: {}",
        busybox(),
        export.stderr
    );
    let out = work.path().join("env-all.tar");
    let digest = derive_with_env(
        work.path(),
        &base,
        &out,
        name,
        &[
            "NVIDIA_VISIBLE_DEVICES=all",
            "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    images.import(&out).unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "image {name} ({digest}): {} with NVIDIA_VISIBLE_DEVICES=all in its config",
        busybox()
    );
}

/// The value of a container's last `NVIDIA_VISIBLE_DEVICES` entry (`valueFrom` for one set
/// from elsewhere), if any.
pub fn last_visible(c: &Value) -> Option<String> {
    let entry = (c["env"].as_array().into_iter().flatten())
        .rfind(|e| e["name"] == "NVIDIA_VISIBLE_DEVICES")?;
    Some(match entry["value"].as_str() {
        Some(v) => v.to_owned(),
        None if entry.get("valueFrom").is_some() => "(valueFrom)".to_owned(),
        None => String::new(),
    })
}

/// The kubelet's pod-resources socket: `$GPUWARDEN_E2E_POD_RESOURCES`, default
/// /var/lib/kubelet/pod-resources/kubelet.sock.
pub fn pod_resources_socket() -> std::path::PathBuf {
    std::env::var_os("GPUWARDEN_E2E_POD_RESOURCES").map_or_else(
        || std::path::PathBuf::from(gpuwarden_node_agent::podresources::DEFAULT_SOCKET),
        std::path::PathBuf::from,
    )
}

/// The GPUs (device IDs, as the device plugin names them and writes them into
/// `NVIDIA_VISIBLE_DEVICES`) the kubelet allocated each container of pod `ns/pod`, asked
/// at `socket`.
pub async fn kubelet_gpus(
    socket: &std::path::Path,
    ns: &str,
    pod: &str,
) -> Vec<(String, Vec<String>)> {
    use gpuwarden_node_agent::podresources::{PodResourcesClient, Timeouts};
    let mut client = PodResourcesClient::connect(socket, Timeouts::default())
        .await
        .unwrap_or_else(|e| panic!("the kubelet's pod-resources socket: {e}"));
    let list = client
        .list()
        .await
        .unwrap_or_else(|e| panic!("pod-resources List: {e}"));
    (list.into_iter())
        .filter(|p| p.namespace == ns && p.name == pod)
        .flat_map(|p| p.containers)
        .map(|c| {
            let mut ids: Vec<String> = (c.devices.into_iter())
                .filter(|d| d.resource_name == gpuwarden_crds::RESOURCE_GPU)
                .flat_map(|d| d.device_ids)
                .collect();
            ids.sort();
            (c.name, ids)
        })
        .collect()
}

/// The host PIDs of a running container, by its cgroup: the processes whose
/// `/proc/<pid>/cgroup` names `container_id` (a pod status's `containerID`, with or without
/// its `containerd://` prefix). Needs this machine to be the node.
pub fn container_host_pids(container_id: &str) -> Vec<u32> {
    let id = container_id
        .split_once("://")
        .map_or(container_id, |(_, id)| id);
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
                .is_ok_and(|cgroup| !id.is_empty() && cgroup.contains(id))
        })
        .collect();
    pids.sort_unstable();
    pids
}

/// Compute processes that NVIDIA's mock NVML reports, for as long as this lives: its
/// runtime overrides file (`$MOCK_NVML_OVERRIDES`, or `overrides.yaml` beside
/// `$MOCK_NVML_CONFIG`), which every NVML user of the node rereads within a second. Where
/// the file existed it is put back when this is dropped, else removed.
pub struct MockProcesses {
    path: std::path::PathBuf,
    before: Option<Vec<u8>>,
}

impl MockProcesses {
    /// The overrides file of the mock NVML this process loads, `None` where
    /// `$MOCK_NVML_CONFIG` is unset (real NVML).
    pub fn open() -> Option<Self> {
        let path = match std::env::var_os("MOCK_NVML_OVERRIDES") {
            Some(p) => std::path::PathBuf::from(p),
            None => std::path::Path::new(&std::env::var_os("MOCK_NVML_CONFIG")?)
                .parent()?
                .join("overrides.yaml"),
        };
        let before = std::fs::read(&path).ok();
        Some(Self { path, before })
    }

    /// Reports `(GPU index, host PID)` as compute processes (1 GiB each), and nothing else.
    pub fn set(&self, processes: &[(u32, u32)]) {
        let mut devices = serde_json::Map::new();
        for (index, pid) in processes {
            let entry = devices
                .entry(index.to_string())
                .or_insert_with(|| serde_json::json!({"processes": []}));
            if let Some(list) = entry["processes"].as_array_mut() {
                list.push(serde_json::json!({"pid": pid, "type": "C", "used_memory_mib": 1024}));
            }
        }
        let doc = serde_json::json!({"devices": devices});
        std::fs::write(&self.path, doc.to_string())
            .unwrap_or_else(|e| panic!("failed to write {}: {e}", self.path.display()));
    }
}

impl Drop for MockProcesses {
    fn drop(&mut self) {
        let _ = match &self.before {
            Some(bytes) => std::fs::write(&self.path, bytes),
            None => std::fs::remove_file(&self.path),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_container_log_reads_as_what_it_sees() {
        let log = "PATH=/bin\nNVIDIA_VISIBLE_DEVICES=GPU-b,GPU-a\nNVIDIA_MIG_CONFIG_DEVICES=all\n==devices==\n/dev/nvidia-caps\n/dev/nvidia1\n/dev/nvidiactl\n/dev/nvidia0\n==end==\n";
        let seen = Seen::parse(log).expect("complete");
        assert_eq!(seen.visible_ids(), ["GPU-a", "GPU-b"]);
        assert_eq!(seen.gpu_devices, ["/dev/nvidia0", "/dev/nvidia1"]);
        assert_eq!(seen.mig, ["NVIDIA_MIG_CONFIG_DEVICES=all"]);
        let allocated = ["GPU-b".to_owned(), "GPU-a".to_owned()];
        let err = seen
            .holds_exactly(&allocated)
            .expect_err("the MIG variable");
        assert!(err.contains("MIG"), "{err}");
        assert!(Seen::parse("PATH=/bin\n==devices==\n").is_none());

        let void = Seen::parse("NVIDIA_VISIBLE_DEVICES=void\n==devices==\n==end==").expect("seen");
        assert_eq!(void.holds_exactly(&[]), Ok(()));
        let all = Seen::parse("NVIDIA_VISIBLE_DEVICES=all\n==devices==\n==end==").expect("seen");
        assert!(all.holds_exactly(&[]).is_err());
        let unset = Seen::parse("PATH=/bin\n==devices==\n/dev/nvidia3\n==end==").expect("seen");
        assert!(unset.holds_exactly(&[]).is_err(), "a GPU device node");

        // Under NVIDIA's runtime: void in the process, the allocated GPUs as device nodes.
        let toolkit = Seen::parse(
            "NVIDIA_VISIBLE_DEVICES=void\n==devices==\n/dev/nvidia4\n/dev/nvidia5\n==end==",
        )
        .expect("seen");
        assert_eq!(toolkit.holds_exactly(&allocated), Ok(()));
        assert!(
            toolkit.holds_exactly(&allocated[..1]).is_err(),
            "one node too many"
        );
        assert!(
            toolkit.holds_exactly(&[]).is_err(),
            "nodes with nothing allocated"
        );
    }

    #[test]
    fn the_gpu_node_is_ready_with_two_gpus() {
        let node = |name: &str, ready: &str, gpus: &str| {
            json!({"metadata": {"name": name}, "status": {
                "conditions": [{"type": "Ready", "status": ready}],
                "allocatable": {"nvidia.com/gpu": gpus}}})
        };
        let list = json!({"items": [node("a", "True", "1"), node("b", "False", "8"),
            node("c", "True", "2")]});
        if std::env::var_os("GPUWARDEN_E2E_NODE").is_none() {
            assert_eq!(
                gpu_node_in(&list).map(|n| &n["metadata"]["name"]),
                Some(&json!("c"))
            );
        }
        assert!(gpu_node_in(&json!({"items": [node("a", "True", "0")]})).is_none());
    }
}
