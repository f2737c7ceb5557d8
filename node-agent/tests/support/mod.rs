//! Shared test fixtures: a small fake node, a mock API server for GpuNode status, and helpers.

#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use gpuwarden_node_agent::fake::FakeNode;
use gpuwarden_node_agent::podresources::{ContainerDevices, ContainerResources, PodResources};
use gpuwarden_node_agent::pods::{ContainerInfo, PodInfo};
use http::{Method, Request, Response};
use jiff::Timestamp;
use kube::client::Body;

pub const NODE: &str = "gpu-node-1";
pub const POD_UID: &str = "8e81973e-0bec-47b0-b898-d190f9ebdacc";
pub const ROGUE_UID: &str = "6b4cb242-4a23-4596-a217-beaddbc496cb";
pub const TRAINER_ID: &str = "ae97ba94d0eda82f8f6d05584ef8aa38922766581e27a1c08a6a63ec24ede6a4";
pub const ROGUE_ID: &str = "18f135d25f557203301850c5a38fd547923a736994e3bf911a61dbe22e44158b";

/// Two GPUs; the trainer runs on GPU 0 (read from the host root's /proc), a privileged pod
/// runs on GPU 1 with no allocation.
pub const FAKE: &str = r#"
driver: {driverVersion: "550.90.07", cudaDriverVersion: "12.4", nvmlVersion: "12.550.90.07"}
gpus:
  - {index: 0, uuid: GPU-aaaa, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559, pciBusId: "00000000:18:00.0", utilizationPercent: 90}
  - {index: 1, uuid: GPU-bbbb, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559, pciBusId: "00000000:2A:00.0", utilizationPercent: 40}
processes:
  - {pid: 4242, gpu: "0"}
  - {pid: 5353, gpu: "1"}
events:
  - {after: 5m, gpu: "1", xid: 79}
"#;

pub fn fake_node() -> FakeNode {
    FakeNode::parse(FAKE, "test").unwrap()
}

pub fn t0() -> Timestamp {
    Timestamp::from_second(1_800_000_000).unwrap()
}

pub fn at(seconds: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + seconds).unwrap()
}

/// A host root whose /proc holds the two processes' cgroup files.
pub fn host_root() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let uid_ = POD_UID.replace('-', "_");
    write_cgroup(
        dir.path(),
        4242,
        &format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/cri-containerd-{TRAINER_ID}.scope\n"
        ),
    );
    write_cgroup(
        dir.path(),
        5353,
        &format!("12:devices:/kubepods/besteffort/pod{ROGUE_UID}/{ROGUE_ID}\n"),
    );
    dir
}

pub fn write_cgroup(root: &std::path::Path, pid: u32, text: &str) {
    let p = root.join("proc").join(pid.to_string());
    std::fs::create_dir_all(&p).unwrap();
    std::fs::write(p.join("cgroup"), text).unwrap();
}

pub fn pods() -> Vec<PodInfo> {
    vec![
        PodInfo {
            uid: POD_UID.into(),
            namespace: "ml".into(),
            name: "trainer-0".into(),
            mirror_uid: None,
            service_account: String::new(),
            labels: Default::default(),
            exempt: None,
            claims_exempt: None,
            kai: None,
            injected: Vec::new(),
            containers: vec![ContainerInfo {
                name: "trainer".into(),
                image: String::new(),
                container_id: Some(format!("containerd://{TRAINER_ID}")),
                privileged: false,
                gpu: true,
            }],
        },
        PodInfo {
            uid: ROGUE_UID.into(),
            namespace: "research".into(),
            name: "legacy".into(),
            mirror_uid: None,
            service_account: String::new(),
            labels: Default::default(),
            exempt: None,
            claims_exempt: None,
            kai: None,
            injected: Vec::new(),
            containers: vec![ContainerInfo {
                name: "render".into(),
                image: String::new(),
                container_id: Some(format!("containerd://{ROGUE_ID}")),
                privileged: true,
                gpu: true,
            }],
        },
    ]
}

/// What the kubelet says: the trainer got GPU 0.
pub fn allocations() -> Vec<PodResources> {
    vec![PodResources {
        name: "trainer-0".into(),
        namespace: "ml".into(),
        containers: vec![ContainerResources {
            name: "trainer".into(),
            devices: vec![ContainerDevices {
                resource_name: "nvidia.com/gpu".into(),
                device_ids: vec!["GPU-aaaa".into()],
            }],
            dynamic_resources: vec![],
        }],
    }]
}

/// A request the mock API server saw.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: Method,
    pub path_and_query: String,
    pub content_type: String,
    pub body: serde_json::Value,
}

/// A mock API server holding one GpuNode; it records every request.
pub struct MockApi {
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub exists: Arc<Mutex<bool>>,
}

impl MockApi {
    pub fn start() -> (kube::Client, MockApi) {
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let exists = Arc::new(Mutex::new(true));
        let (seen2, exists2) = (seen.clone(), exists.clone());
        tokio::spawn(async move {
            let mut status = serde_json::json!({});
            while let Some((req, send)) = handle.next_request().await {
                let (parts, body) = req.into_parts();
                let bytes = body.collect_bytes().await.unwrap_or_default();
                let body: serde_json::Value =
                    serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
                seen2.lock().unwrap().push(Seen {
                    method: parts.method.clone(),
                    path_and_query: parts
                        .uri
                        .path_and_query()
                        .map(|p| p.to_string())
                        .unwrap_or_default(),
                    content_type: parts
                        .headers
                        .get(http::header::CONTENT_TYPE)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned(),
                    body: body.clone(),
                });
                if !*exists2.lock().unwrap() {
                    let not_found = serde_json::json!({
                        "kind": "Status", "apiVersion": "v1", "metadata": {},
                        "status": "Failure", "reason": "NotFound", "code": 404,
                        "message": format!("gpunodes.gpuwarden.io \"{NODE}\" not found"),
                    });
                    send.send_response(
                        Response::builder()
                            .status(404)
                            .body(Body::from(serde_json::to_vec(&not_found).unwrap()))
                            .unwrap(),
                    );
                    continue;
                }
                if parts.method == Method::PATCH {
                    // Server-side apply of the agent's fields; the operator's stay.
                    if let Some(s) = body.get("status").and_then(|s| s.as_object()) {
                        for (k, v) in s {
                            status[k] = v.clone();
                        }
                    }
                }
                let object = serde_json::json!({
                    "apiVersion": "gpuwarden.io/v1alpha1",
                    "kind": "GpuNode",
                    "metadata": {"name": NODE, "resourceVersion": "1"},
                    "spec": {"nodeName": NODE},
                    "status": status,
                });
                send.send_response(
                    Response::builder()
                        .status(200)
                        .body(Body::from(serde_json::to_vec(&object).unwrap()))
                        .unwrap(),
                );
            }
        });
        (
            kube::Client::new(service, "default"),
            MockApi { seen, exists },
        )
    }

    pub fn patches(&self) -> Vec<Seen> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.method == Method::PATCH)
            .cloned()
            .collect()
    }
}
