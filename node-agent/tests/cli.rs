//! The binary as a new user runs it, and the size of an 8-GPU status.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use gpuwarden_node_agent::agent::{AllocationSource, Sweeper};
use gpuwarden_node_agent::fake::{FakeBackend, FakeNode};
use gpuwarden_node_agent::health::HealthRules;
use gpuwarden_node_agent::metrics::Metrics;
use gpuwarden_node_agent::writer::apply_body;
use gpuwarden_node_agent::{InspectConfig, inspect};

fn sample() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/examples/node-agent/h100-8gpu.fake.yaml")
}

fn agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gpuwarden-node-agent"))
}

#[test]
fn inspect_the_sample_node_prints_a_complete_status() {
    let out = agent()
        .args(["inspect", "--fake"])
        .arg(sample())
        .env_remove("NODE_NAME")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_saphyr::from_str(&stdout).unwrap();
    assert_eq!(doc["kind"], "GpuNode");
    let status = &doc["status"];
    assert_eq!(status["driver"]["driverVersion"], "550.90.07");
    let gpus = status["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 8);
    assert!(gpus.iter().all(|g| g["model"] == "NVIDIA H100 80GB HBM3"));
    assert_eq!(gpus[7]["health"]["state"], "Unhealthy");
    // XID 13 is an application error: GPU 0 stays healthy.
    assert_eq!(gpus[0]["health"]["state"], "Healthy");
    assert_eq!(gpus[6]["migDevices"].as_array().unwrap().len(), 2);
    let bindings = status["bindings"].as_array().unwrap();
    let sources: Vec<&str> = bindings
        .iter()
        .map(|b| b["source"].as_str().unwrap())
        .collect();
    assert_eq!(bindings.len(), 4, "{sources:?}");
    assert_eq!(sources.iter().filter(|s| **s == "Observed").count(), 1);
    let privileged: Vec<(&str, Option<&str>)> = status["privilegedPods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["name"].as_str().unwrap(), p["exempt"].as_str()))
        .collect();
    assert_eq!(
        privileged,
        [
            (
                "nvidia-dcgm-exporter-x7k2p",
                Some(
                    "GpuPolicy default: image nvcr.io/nvidia/k8s/dcgm-exporter:3.3.5-3.4.0-ubuntu22.04 is exempt in namespace gpu-operator"
                )
            ),
            ("legacy-render", None)
        ],
        "privileged GPU pods, the GPU Operator's exporter marked exempt by the default policy"
    );
    assert!(status["runtime"].is_object());
}

#[test]
fn nvml_missing_is_one_clear_line() {
    let out = agent()
        .args(["inspect"])
        .env_remove("GPUWARDEN_FAKE")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        eprintln!("NVML is present on this machine; nothing to check");
        return;
    }
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    // Where the tests themselves run in a pod, the token says so.
    let advice = if std::path::Path::new(gpuwarden_node_agent::nvml::SERVICE_ACCOUNT_TOKEN).exists()
    {
        gpuwarden_node_agent::nvml::ADVICE_POD_RUNTIME
    } else {
        "run on a GPU node with the NVIDIA driver, or pass --fake FILE"
    };
    assert!(
        stderr.starts_with("NVML is not available: ")
            && stderr.contains("libnvidia-ml.so.1")
            && stderr.trim_end().ends_with(advice),
        "{stderr}"
    );
}

/// In a pod (the kubelet sets KUBERNETES_SERVICE_HOST) the agent that cannot load NVML
/// names what the NVIDIA runtime failed to do and where to fix it, and exits non-zero so the
/// pod restarts and `rollout status` does not report it ready.
#[test]
fn nvml_missing_in_a_pod_names_the_runtime_causes() {
    let out = agent()
        .args(["inspect"])
        .env_remove("GPUWARDEN_FAKE")
        .env("KUBERNETES_SERVICE_HOST", "10.96.0.1")
        .output()
        .unwrap();
    if out.status.success() {
        eprintln!("NVML is present on this machine; nothing to check");
        return;
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("NVML is not available: libnvidia-ml.so.1 could not be loaded")
            && stderr
                .trim_end()
                .ends_with(gpuwarden_node_agent::nvml::ADVICE_POD_RUNTIME),
        "{stderr}"
    );
    assert!(stderr.contains("runtimeClassName") && stderr.contains("node-agent-privileged"));
}

#[test]
fn kubelet_missing_is_one_clear_line() {
    let out = agent()
        .args([
            "inspect",
            "--pod-resources-socket",
            "/nonexistent/kubelet.sock",
            "--fake",
        ])
        .arg(sample())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.trim_end(),
        "kubelet pod-resources socket /nonexistent/kubelet.sock does not exist: is the kubelet running, and is its pod-resources directory mounted into the agent? (--pod-resources-socket)"
    );
}

#[tokio::test]
async fn the_sample_status_is_under_8_kib() {
    let status = inspect(&InspectConfig {
        node_name: "gpu-node-1".into(),
        fake: Some(sample()),
        pod_resources_socket: None,
        host_root: PathBuf::from("/nonexistent-host-root"),
        posture_paths: Default::default(),
    })
    .await
    .unwrap();
    let bytes = serde_json::to_vec(&apply_body("gpu-node-1", &status)).unwrap();
    assert!(bytes.len() < 8 * 1024, "{} bytes", bytes.len());
}

/// A busy 8-GPU node: every GPU unhealthy with the most reasons kept, one long-named pod per
/// GPU using it, all allocated and observed.
#[tokio::test]
async fn a_busy_8_gpu_status_is_under_8_kib() {
    let mut yaml = String::from(
        "driver: {driverVersion: \"550.90.07\", cudaDriverVersion: \"12.4\", nvmlVersion: \"12.550.90.07\"}\ngpus:\n",
    );
    for i in 0..8 {
        yaml += &format!(
            "  - {{index: {i}, uuid: GPU-{i:08x}-1111-2222-3333-444455556666, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559, pciBusId: \"00000000:{i:02X}:00.0\", minorNumber: {i}, migMode: Disabled}}\n"
        );
    }
    yaml += "processes:\n";
    for i in 0..8 {
        yaml += &format!(
            "  - {{pid: {}, gpu: \"{i}\", cgroup: \"0::/kubepods.slice/kubepods-pod{i:08x}_aaaa_bbbb_cccc_dddddddddddd.slice/cri-containerd-{:064x}.scope\"}}\n",
            1000 + i,
            i
        );
    }
    yaml += "events:\n";
    for i in 0..8 {
        for xid in [48, 63, 74, 79, 94] {
            yaml += &format!("  - {{after: 0s, gpu: \"{i}\", xid: {xid}}}\n");
        }
    }
    yaml += "pods:\n";
    let long = "a-rather-long-workload-name-for-a-distributed-training-job";
    for i in 0..8 {
        yaml += &format!(
            "  - {{namespace: ml-research-team, name: {long}-{i}, uid: {i:08x}-aaaa-bbbb-cccc-dddddddddddd, containers: [{{name: pytorch-worker, gpu: true, containerId: \"containerd://{i:064x}\"}}]}}\n"
        );
    }
    yaml += "podResources:\n";
    for i in 0..8 {
        yaml += &format!(
            "  - {{namespace: ml-research-team, pod: {long}-{i}, containers: [{{name: pytorch-worker, resourceName: nvidia.com/gpu, deviceIds: [GPU-{i:08x}-1111-2222-3333-444455556666]}}]}}\n"
        );
    }
    let node = FakeNode::parse(&yaml, "busy").unwrap();
    let pods = node.pod_infos();
    let allocations = AllocationSource::Static(node.pod_resources_list());
    let now = jiff::Timestamp::now();
    let mut sweeper = Sweeper::new(
        Arc::new(FakeBackend::new(node, now)),
        allocations,
        std::path::Path::new("/nonexistent-host-root"),
        Duration::from_secs(600),
        Arc::new(Metrics::new()),
    );
    let c = sweeper
        .sweep(now, &pods, true, &HealthRules::default())
        .await
        .unwrap();
    let bindings = c.status.bindings.as_ref().unwrap();
    assert_eq!(bindings.len(), 8);
    assert!(
        c.status
            .gpus
            .as_ref()
            .unwrap()
            .iter()
            .all(|g| g.health.reasons.len() == 4)
    );
    let bytes = serde_json::to_vec(&apply_body("gpu-node-1", &c.status)).unwrap();
    assert!(bytes.len() < 8 * 1024, "{} bytes", bytes.len());
    eprintln!("busy 8-GPU status: {} bytes", bytes.len());
}

/// A kubeconfig in `dir` naming an API server that is not there: the agent still logs its
/// first lines, then retries.
fn unreachable_kubeconfig(dir: &std::path::Path) -> PathBuf {
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: x\n  cluster: {server: \"http://127.0.0.1:1\"}\n\
         users:\n- name: x\n  user: {}\ncontexts:\n- name: x\n  context: {cluster: x, user: x}\n\
         current-context: x\n",
    )
    .unwrap();
    kubeconfig
}

/// `--log-format text` into a pipe (a file, a log collector) is plain text: colour codes only
/// go to a terminal.
#[test]
fn text_logs_into_a_pipe_have_no_colour_codes() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = unreachable_kubeconfig(dir.path());
    let mut child = agent()
        .args(["run", "--node-name", "n1", "--log-format", "text"])
        .args([
            "--listen",
            "127.0.0.1:0",
            "--pod-resources-socket",
            "/nonexistent",
        ])
        .arg("--fake")
        .arg(sample())
        .env("KUBECONFIG", &kubeconfig)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    let _ = child.kill();
    let _ = child.wait();
    assert!(first.contains("GPU backend ready"), "{first:?}");
    assert!(!first.contains('\x1b'), "{first:?}");
}

/// On a terminal (a pseudo-terminal from util-linux `script`), text logs keep their colours.
/// Skipped, saying so, where `script` is not installed.
#[test]
fn text_logs_on_a_terminal_keep_their_colours() {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = unreachable_kubeconfig(dir.path());
    let agent = format!(
        "timeout 3 {} run --node-name n1 --log-format text --listen 127.0.0.1:0 \
         --pod-resources-socket /nonexistent --fake {}",
        env!("CARGO_BIN_EXE_gpuwarden-node-agent"),
        sample().display()
    );
    let out = match Command::new("script")
        .args(["-qec", &agent, "/dev/null"])
        .env("KUBECONFIG", &kubeconfig)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            eprintln!("util-linux script is not available ({e}); nothing to check");
            return;
        }
    };
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("GPU backend ready"), "{text}");
    assert!(text.contains('\x1b'), "no colour on a terminal: {text:?}");
}
