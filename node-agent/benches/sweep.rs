//! Cost of the agent's steady state on a fake 8-GPU node with 100 pods.
//!
//! `cargo bench -p gpuwarden-node-agent --bench sweep`
//!
//! - CPU per full sweep: GPU read (fake backend), kubelet `List` over a unix socket (the
//!   fake kubelet runs in this process, so its CPU is counted too), `/proc/<pid>/cgroup`
//!   reads from a temporary host root, status computation and metrics update. Measured as
//!   process CPU time (utime + stime from /proc/self/stat) over many sweeps.
//! - RSS of the process after the sweeps (VmRSS, and the peak VmHWM).
//! - Status writes over 10 simulated minutes with nothing changing, through the real
//!   `StatusWriter` driven by a simulated clock (one sweep every 10 s).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use gpuwarden_crds::{DriverInfo, GpuNodeStatus};
use gpuwarden_node_agent::agent::{AllocationSource, Sweeper};
use gpuwarden_node_agent::fake::{FakeBackend, FakeGpu, FakeNode, FakeProcess};
use gpuwarden_node_agent::health::HealthRules;
use gpuwarden_node_agent::metrics::Metrics;
use gpuwarden_node_agent::podresources::{
    ContainerDevices, ContainerResources, PodResources, Timeouts,
};
use gpuwarden_node_agent::pods::{ContainerInfo, PodInfo};
use gpuwarden_node_agent::testing::{FakeKubelet, FakeKubeletServer};
use gpuwarden_node_agent::writer::{StatusSink, StatusWriter, WriteError, apply_body};
use jiff::{SignedDuration, Timestamp};

const GPUS: u32 = 8;
const PODS: u32 = 100;
const SWEEPS: u32 = 3000;

fn uuid(i: u32) -> String {
    format!("GPU-{i:08x}-5e4f-4a1b-9c2d-0123456789ab")
}
fn pod_uid(i: u32) -> String {
    format!("{i:08x}-1111-4222-8333-444455556666")
}
fn container_id(i: u32) -> String {
    format!("{:064x}", u64::from(i) + 0xabcdef)
}

fn fake_node() -> FakeNode {
    FakeNode {
        driver: DriverInfo {
            driver_version: "550.90.07".into(),
            cuda_driver_version: Some("12.4".into()),
            nvml_version: Some("12.550.90.07".into()),
        },
        gpus: (0..GPUS)
            .map(|i| FakeGpu {
                index: i,
                uuid: uuid(i),
                model: "NVIDIA H100 80GB HBM3".into(),
                memory_mi_b: 81559,
                pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + i * 0x10),
                minor_number: Some(i),
                mig_mode: Some("Disabled".into()),
                utilization_percent: Some(50),
                memory_used_mi_b: Some(40_000),
                temperature_celsius: Some(55),
                power_watts: Some(400.0),
                ecc_uncorrected: Some(0),
                pages_pending_retirement: Some(false),
                row_remapping_pending: Some(false),
                row_remapping_failed: Some(false),
                ..Default::default()
            })
            .collect(),
        // One process per pod, time-sliced over the GPUs; cgroups come from the host root.
        processes: (0..PODS)
            .map(|i| FakeProcess {
                pid: 10_000 + i,
                gpu: uuid(i % GPUS),
                used_memory_mi_b: Some(400),
                sm_util_percent: Some(7),
                cgroup: None,
            })
            .collect(),
        ..Default::default()
    }
}

fn pods() -> Vec<PodInfo> {
    (0..PODS)
        .map(|i| PodInfo {
            uid: pod_uid(i),
            namespace: format!("team-{}", i % 10),
            name: format!("inference-{i}"),
            mirror_uid: None,
            service_account: String::new(),
            labels: Default::default(),
            exempt: None,
            claims_exempt: None,
            kai: None,
            injected: Vec::new(),
            containers: vec![ContainerInfo {
                name: "server".into(),
                image: String::new(),
                container_id: Some(format!("containerd://{}", container_id(i))),
                privileged: false,
                gpu: true,
            }],
        })
        .collect()
}

fn allocations() -> Vec<PodResources> {
    (0..PODS)
        .map(|i| PodResources {
            name: format!("inference-{i}"),
            namespace: format!("team-{}", i % 10),
            containers: vec![ContainerResources {
                name: "server".into(),
                devices: vec![ContainerDevices {
                    resource_name: "nvidia.com/gpu".into(),
                    // Time-slicing replica IDs.
                    device_ids: vec![format!("{}::{}", uuid(i % GPUS), i / GPUS)],
                }],
                dynamic_resources: vec![],
            }],
        })
        .collect()
}

fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    (ticks(11) + ticks(12)) / 100.0
}

fn status_kib(key: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// Counts writes instead of calling an API server; the "server" keeps what was applied.
#[derive(Default)]
struct CountingSink {
    applies: AtomicU64,
    reads: AtomicU64,
    server: std::sync::Mutex<GpuNodeStatus>,
}

#[async_trait]
impl StatusSink for &CountingSink {
    async fn apply(&self, status: &GpuNodeStatus) -> Result<(), WriteError> {
        self.applies.fetch_add(1, Ordering::Relaxed);
        *self.server.lock().unwrap_or_else(|e| e.into_inner()) = status.clone();
        Ok(())
    }
    async fn current(&self) -> Result<GpuNodeStatus, WriteError> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        Ok(self
            .server
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone())
    }
}

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("tokio runtime: {e}"));
    runtime.block_on(bench());
}

async fn bench() {
    let host = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    for i in 0..PODS {
        let dir = host.path().join("proc").join((10_000 + i).to_string());
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let uid = pod_uid(i).replace('-', "_");
        std::fs::write(
            dir.join("cgroup"),
            format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/cri-containerd-{}.scope\n",
                container_id(i)
            ),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
    let sock = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let kubelet = FakeKubeletServer::start(
        &sock.path().join("kubelet.sock"),
        FakeKubelet {
            pods: allocations(),
            ..Default::default()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("fake kubelet: {e}"));

    let start = Timestamp::from_second(1_800_000_000).unwrap_or(Timestamp::UNIX_EPOCH);
    let at = |s: i64| start + SignedDuration::from_secs(s);
    let mut sweeper = Sweeper::new(
        Arc::new(FakeBackend::new(fake_node(), start)),
        AllocationSource::Kubelet {
            socket: kubelet.socket().to_path_buf(),
            timeouts: Timeouts::default(),
            strict: true,
        },
        host.path(),
        Duration::from_secs(600),
        Arc::new(Metrics::new()),
    );
    let pods = pods();
    let rules = HealthRules::default();

    // Warm up: connections, caches, allocations.
    let first = sweeper
        .sweep(start, &pods, true, &rules)
        .await
        .unwrap_or_else(|e| panic!("sweep: {e}"));
    let bindings = first.status.bindings.as_ref().map_or(0, Vec::len);
    let status_bytes =
        serde_json::to_vec(&apply_body("gpu-node-1", &first.status)).map_or(0, |b| b.len());
    for i in 1..50 {
        let _ = sweeper
            .sweep(at(i64::from(i) * 10), &pods, true, &rules)
            .await;
    }

    let cpu0 = cpu_seconds();
    let wall0 = Instant::now();
    for i in 0..SWEEPS {
        sweeper
            .sweep(at(500 + i64::from(i) * 10), &pods, true, &rules)
            .await
            .unwrap_or_else(|e| panic!("sweep: {e}"));
    }
    let cpu = cpu_seconds() - cpu0;
    let wall = wall0.elapsed().as_secs_f64();
    let rss = status_kib("VmRSS:");
    let hwm = status_kib("VmHWM:");

    // Ten simulated minutes of nothing changing, one sweep every 10 s.
    let sink = CountingSink::default();
    let mut writer = StatusWriter::new(&sink, Duration::from_secs(10), Duration::from_secs(600));
    let base = 500 + i64::from(SWEEPS) * 10;
    let c = sweeper
        .sweep(at(base), &pods, true, &rules)
        .await
        .unwrap_or_else(|e| panic!("sweep: {e}"));
    writer
        .tick(at(base), &c.status)
        .await
        .unwrap_or_else(|e| panic!("write: {e}"));
    let initial = sink.applies.load(Ordering::Relaxed);
    for s in (10..=600).step_by(10) {
        let c = sweeper
            .sweep(at(base + s), &pods, true, &rules)
            .await
            .unwrap_or_else(|e| panic!("sweep: {e}"));
        writer
            .tick(at(base + s), &c.status)
            .await
            .unwrap_or_else(|e| panic!("write: {e}"));
    }
    let quiet_writes = sink.applies.load(Ordering::Relaxed) - initial;
    let reads = sink.reads.load(Ordering::Relaxed);

    // The whole agent in this process for a few seconds: kube client, pod/policy/node
    // reflectors holding the 100 pods, Lease, metrics server, sweeps every 100 ms.
    let fake_file = host.path().join("node.fake.yaml");
    std::fs::write(&fake_file, fake_yaml()).unwrap_or_else(|e| panic!("{e}"));
    let (client, api_calls) = mock_api();
    let config = gpuwarden_node_agent::Config {
        fake: Some(fake_file),
        pod_resources_socket: kubelet.socket().to_path_buf(),
        host_root: host.path().to_path_buf(),
        listen: "127.0.0.1:0".parse().unwrap_or_else(|e| panic!("{e}")),
        poll_interval: Duration::from_millis(100),
        ..gpuwarden_node_agent::Config::new("gpu-node-1")
    };
    gpuwarden_node_agent::run(config, client, tokio::time::sleep(Duration::from_secs(5)))
        .await
        .unwrap_or_else(|e| panic!("run: {e}"));
    let agent_rss = status_kib("VmRSS:");
    let agent_hwm = status_kib("VmHWM:");
    let agent_writes = api_calls.load(Ordering::Relaxed);
    kubelet.stop().await;

    let per_sweep_ms = cpu * 1000.0 / f64::from(SWEEPS);
    println!(
        "gpuwarden-node-agent sweep benchmark: fake backend, {GPUS} GPUs, {PODS} pods ({bindings} bindings)"
    );
    println!("{:<52} {:>12} {:>10}", "measure", "value", "target");
    println!("{:-<76}", "");
    println!(
        "{:<52} {:>9.3} ms {:>10}",
        format!("CPU per full sweep ({SWEEPS} sweeps)"),
        per_sweep_ms,
        "<= 5 ms"
    );
    println!(
        "{:<52} {:>9.3} ms {:>10}",
        "wall time per full sweep",
        wall * 1000.0 / f64::from(SWEEPS),
        ""
    );
    println!(
        "{:<52} {:>9.1} MiB {:>9}",
        "RSS (VmRSS) after the sweeps",
        rss / 1024.0,
        "<= 32 MiB"
    );
    println!(
        "{:<52} {:>9.1} MiB {:>9}",
        "peak RSS (VmHWM)",
        hwm / 1024.0,
        ""
    );
    println!(
        "{:<52} {:>12} {:>10}",
        "status writes, 10 simulated minutes, nothing changing", quiet_writes, "0"
    );
    println!(
        "{:<52} {:>12} {:>10}",
        "  (initial write before them)", initial, ""
    );
    println!(
        "{:<52} {:>12} {:>10}",
        "  (resync reads of the server copy)", reads, ""
    );
    println!(
        "{:<52} {:>8} B {:>12}",
        "status size with these bindings (JSON)", status_bytes, ""
    );
    println!(
        "{:<52} {:>9.1} MiB {:>9}",
        "RSS after 5 s of the full agent (run) in-process",
        agent_rss / 1024.0,
        "<= 32 MiB"
    );
    println!(
        "{:<52} {:>9.1} MiB {:>9}",
        "peak RSS (VmHWM), whole benchmark",
        agent_hwm / 1024.0,
        ""
    );
    println!(
        "{:<52} {:>12} {:>10}",
        "  status writes by run in those 5 s (50 sweeps)", agent_writes, "1"
    );
}

/// The fake node as YAML, for `run --fake`.
fn fake_yaml() -> String {
    let mut y = String::from(
        "driver: {driverVersion: \"550.90.07\", cudaDriverVersion: \"12.4\", nvmlVersion: \"12.550.90.07\"}\ngpus:\n",
    );
    for i in 0..GPUS {
        y += &format!(
            "  - {{index: {i}, uuid: {}, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559, pciBusId: \"00000000:{:02X}:00.0\", utilizationPercent: 50, memoryUsedMiB: 40000, temperatureCelsius: 55, powerWatts: 400}}\n",
            uuid(i),
            0x18 + i * 0x10
        );
    }
    y += "processes:\n";
    for i in 0..PODS {
        y += &format!("  - {{pid: {}, gpu: {}}}\n", 10_000 + i, uuid(i % GPUS));
    }
    y
}

fn pod_json(i: u32) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": format!("inference-{i}"), "namespace": format!("team-{}", i % 10),
            "uid": pod_uid(i), "resourceVersion": "1",
            "labels": {"app": "inference", "pod-template-hash": "7d9f8c6b5"},
            "annotations": {"kubectl.kubernetes.io/default-container": "server"},
        },
        "spec": {
            "nodeName": "gpu-node-1",
            "containers": [{
                "name": "server", "image": "nvcr.io/nvidia/tritonserver:24.05-py3",
                "args": ["tritonserver", "--model-repository=/models"],
                "resources": {"limits": {"nvidia.com/gpu": "1", "memory": "16Gi"},
                              "requests": {"cpu": "2", "memory": "16Gi"}},
                "env": [{"name": "MODEL", "value": "llama"}],
                "volumeMounts": [{"name": "models", "mountPath": "/models"}],
            }],
            "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
        },
        "status": {
            "phase": "Running", "podIP": "10.0.0.1",
            "containerStatuses": [{
                "name": "server", "ready": true, "restartCount": 0,
                "image": "nvcr.io/nvidia/tritonserver:24.05-py3", "imageID": "sha256:abc",
                "containerID": format!("containerd://{}", container_id(i)),
            }],
        },
    })
}

/// A mock API server: lists (100 pods, no policies, the node), open watches, and status
/// applies counted.
fn mock_api() -> (kube::Client, Arc<AtomicU64>) {
    use http::{Method, Request, Response};
    use kube::client::Body;
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let writes = Arc::new(AtomicU64::new(0));
    let counted = writes.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        let mut stored = serde_json::Value::Null;
        while let Some((req, send)) = handle.next_request().await {
            let (parts, body) = req.into_parts();
            let bytes = body.collect_bytes().await.unwrap_or_default();
            let body: serde_json::Value =
                serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
            let path = parts.uri.path().to_owned();
            if parts.uri.query().unwrap_or_default().contains("watch=true") {
                held.push(send);
                continue;
            }
            let list = |kind: &str, items: Vec<serde_json::Value>| {
                serde_json::json!({"apiVersion": "v1", "kind": kind,
                    "metadata": {"resourceVersion": "1"}, "items": items})
            };
            let value = match (&parts.method, path.as_str()) {
                (&Method::GET, "/api/v1/pods") => {
                    list("PodList", (0..PODS).map(pod_json).collect())
                }
                (&Method::GET, "/api/v1/nodes") => list(
                    "NodeList",
                    vec![serde_json::json!({"apiVersion": "v1", "kind": "Node",
                        "metadata": {"name": "gpu-node-1", "resourceVersion": "1"}})],
                ),
                (&Method::GET, "/apis/gpuwarden.io/v1alpha1/gpupolicies") => {
                    list("GpuPolicyList", vec![])
                }
                (&Method::GET, "/api/v1/namespaces") => list("NamespaceList", vec![]),
                (m, p) if p.contains("/gpunodes/") => {
                    if m == Method::PATCH {
                        counted.fetch_add(1, Ordering::Relaxed);
                        stored = body.get("status").cloned().unwrap_or_default();
                    }
                    serde_json::json!({"apiVersion": "gpuwarden.io/v1alpha1", "kind": "GpuNode",
                        "metadata": {"name": "gpu-node-1", "resourceVersion": "2"},
                        "spec": {"nodeName": "gpu-node-1"}, "status": stored})
                }
                _ => body,
            };
            let response = Response::builder()
                .status(200)
                .body(Body::from(serde_json::to_vec(&value).unwrap_or_default()));
            if let Ok(r) = response {
                send.send_response(r);
            }
        }
    });
    (kube::Client::new(service, "default"), writes)
}
