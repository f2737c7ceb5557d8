//! Scale benchmark: the whole operator (`gpuwarden_operator::run`: watches, caches, change
//! filters, appliers, reconcilers) against an in-process fake API server that serves list and
//! watch for 5,000 Nodes, 5,000 GpuNodes and 5,000 agent Leases, applies the operator's
//! writes and sends them back through the watches as a real API server would.
//!
//! Reports the cold-start time until every GpuNode has its conditions, the process RSS, and
//! the number of writes during a steady-state window in which every Lease is renewed and every
//! Node sends a heartbeat.
//!
//! `cargo bench -p gpuwarden-operator --bench scale` (release). `GPUWARDEN_BENCH_NODES` changes
//! the node count.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody, combinators::UnsyncBoxBody};
use hyper::body::Frame;
use serde_json::{Value, json};
use tokio::sync::mpsc;

type Body = UnsyncBoxBody<Bytes, Infallible>;

/// Objects of one resource, with the watchers to tell about changes.
#[derive(Default)]
struct Collection {
    /// Serialised objects, as an API server keeps them (and to keep the fake's memory small
    /// next to the operator's).
    objects: BTreeMap<String, Bytes>,
    watchers: Vec<mpsc::UnboundedSender<Bytes>>,
}

/// An in-memory API server for the resources the operator reads and writes.
#[derive(Default)]
struct FakeApi {
    collections: Mutex<HashMap<&'static str, Collection>>,
    resource_version: AtomicU64,
    writes: AtomicU64,
    status_writes: AtomicU64,
    lists: AtomicU64,
}

fn full(bytes: Vec<u8>) -> Body {
    http_body_util::Full::new(Bytes::from(bytes))
        .map_err(|never| match never {})
        .boxed_unsync()
}

fn json_response(code: StatusCode, value: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(full(serde_json::to_vec(value).unwrap_or_default()))
        .unwrap_or_default()
}

fn not_found() -> Response<Body> {
    json_response(
        StatusCode::NOT_FOUND,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}),
    )
}

/// (collection, list kind, apiVersion) for a path, and the object name and subresource.
fn route(
    path: &str,
) -> Option<(
    &'static str,
    &'static str,
    &'static str,
    Option<String>,
    bool,
)> {
    let routes: [(&str, &str, &str, &str); 6] = [
        ("/api/v1/nodes", "nodes", "NodeList", "v1"),
        (
            "/apis/gpuwarden.io/v1alpha1/gpunodes",
            "gpunodes",
            "GpuNodeList",
            "gpuwarden.io/v1alpha1",
        ),
        (
            "/apis/gpuwarden.io/v1alpha1/gpupolicies",
            "gpupolicies",
            "GpuPolicyList",
            "gpuwarden.io/v1alpha1",
        ),
        (
            "/apis/coordination.k8s.io/v1/namespaces/gpuwarden-system/leases",
            "leases",
            "LeaseList",
            "coordination.k8s.io/v1",
        ),
        (
            "/api/v1/namespaces/gpuwarden-system/secrets",
            "secrets",
            "SecretList",
            "v1",
        ),
        (
            "/apis/events.k8s.io/v1/namespaces/default/events",
            "events",
            "EventList",
            "events.k8s.io/v1",
        ),
    ];
    for (prefix, coll, kind, version) in routes {
        if let Some(rest) = path.strip_prefix(prefix) {
            let mut parts = rest.trim_start_matches('/').split('/');
            let name = parts.next().filter(|s| !s.is_empty()).map(str::to_owned);
            let status = parts.next() == Some("status");
            return Some((coll, kind, version, name, status));
        }
    }
    None
}

impl FakeApi {
    fn next_rv(&self) -> String {
        (self.resource_version.fetch_add(1, Ordering::SeqCst) + 1).to_string()
    }

    fn insert(&self, coll: &'static str, name: &str, mut obj: Value) {
        obj["metadata"]["resourceVersion"] = json!(self.next_rv());
        let bytes = Bytes::from(serde_json::to_vec(&obj).unwrap_or_default());
        let mut c = self.collections.lock().unwrap_or_else(|p| p.into_inner());
        c.entry(coll)
            .or_default()
            .objects
            .insert(name.to_owned(), bytes);
    }

    /// Changes an object and tells its watchers, as an API server would.
    fn modify(
        &self,
        coll: &'static str,
        name: &str,
        change: impl FnOnce(&mut Value),
    ) -> Option<Value> {
        let rv = self.next_rv();
        let mut c = self.collections.lock().unwrap_or_else(|p| p.into_inner());
        let entry = c.entry(coll).or_default();
        let stored = entry.objects.get_mut(name)?;
        let mut obj: Value = serde_json::from_slice(stored).ok()?;
        change(&mut obj);
        obj["metadata"]["resourceVersion"] = json!(rv);
        *stored = Bytes::from(serde_json::to_vec(&obj).unwrap_or_default());
        let mut line =
            serde_json::to_vec(&json!({"type": "MODIFIED", "object": obj})).unwrap_or_default();
        line.push(b'\n');
        let line = Bytes::from(line);
        entry.watchers.retain(|w| w.send(line.clone()).is_ok());
        Some(obj)
    }

    /// A list page: honours `limit` and `continue` like the API server (continue is an offset).
    fn list(&self, coll: &'static str, kind: &str, version: &str, query: &str) -> Vec<u8> {
        self.lists.fetch_add(1, Ordering::Relaxed);
        let param = |key: &str| {
            query
                .split('&')
                .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
                .and_then(|v| v.parse::<usize>().ok())
        };
        let limit = param("limit").unwrap_or(usize::MAX);
        let offset = param("continue").unwrap_or(0);
        let c = self.collections.lock().unwrap_or_else(|p| p.into_inner());
        let objects = c.get(coll).map(|c| &c.objects);
        let total = objects.map_or(0, BTreeMap::len);
        let mut out = Vec::new();
        let next = offset.saturating_add(limit);
        let meta = if next < total {
            json!({"resourceVersion": self.resource_version.load(Ordering::SeqCst).to_string(), "continue": next.to_string()})
        } else {
            json!({"resourceVersion": self.resource_version.load(Ordering::SeqCst).to_string()})
        };
        out.extend_from_slice(
            format!(r#"{{"apiVersion":"{version}","kind":"{kind}","metadata":{meta},"items":["#)
                .as_bytes(),
        );
        for (i, obj) in objects
            .into_iter()
            .flat_map(|o| o.values())
            .skip(offset)
            .take(limit)
            .enumerate()
        {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(obj);
        }
        out.extend_from_slice(b"]}");
        out
    }

    fn watch(&self, coll: &'static str) -> Response<Body> {
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        self.collections
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(coll)
            .or_default()
            .watchers
            .push(tx);
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
        });
        Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/json")
            .body(StreamBody::new(stream).boxed_unsync())
            .unwrap_or_default()
    }

    async fn handle(self: Arc<Self>, req: Request<kube::client::Body>) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let path = parts.uri.path().to_owned();
        let query = parts.uri.query().unwrap_or_default().to_owned();
        let Some((coll, kind, version, name, status)) = route(&path) else {
            return not_found();
        };
        match (parts.method.as_str(), name) {
            ("GET", None) if query.contains("watch=true") => self.watch(coll),
            ("GET", None) => Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "application/json")
                .body(full(self.list(coll, kind, version, &query)))
                .unwrap_or_default(),
            ("GET", Some(_)) => not_found(),
            ("PATCH", Some(name)) | ("POST", Some(name)) => {
                self.writes.fetch_add(1, Ordering::Relaxed);
                let patch: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                if status {
                    self.status_writes.fetch_add(1, Ordering::Relaxed);
                }
                let updated = self.modify(coll, &name, |obj| {
                    if status {
                        for (k, v) in patch["status"].as_object().into_iter().flatten() {
                            obj["status"][k] = v.clone();
                        }
                    } else if let Some(spec) = patch.get("spec") {
                        obj["spec"] = spec.clone();
                    }
                });
                match updated {
                    Some(obj) => json_response(StatusCode::OK, &obj),
                    None => {
                        let mut obj = patch;
                        obj["metadata"]["uid"] = json!(format!("{coll}-{name}"));
                        self.insert(coll, &name, obj.clone());
                        json_response(StatusCode::CREATED, &obj)
                    }
                }
            }
            ("POST", None) => {
                self.writes.fetch_add(1, Ordering::Relaxed);
                json_response(
                    StatusCode::CREATED,
                    &serde_json::from_slice(&body).unwrap_or(Value::Null),
                )
            }
            _ => not_found(),
        }
    }
}

fn node(i: usize) -> Value {
    let name = format!("gpu-node-{i:05}");
    let images: Vec<Value> = (0..30)
        .map(|j| json!({"names": [format!("registry.example.com/team-{j}/training-image@sha256:{:064x}", i * 31 + j)], "sizeBytes": 5_000_000_000u64 + j as u64}))
        .collect();
    let conditions: Vec<Value> = ["MemoryPressure", "DiskPressure", "PIDPressure", "Ready"]
        .iter()
        .map(|t| {
            json!({
                "type": t, "status": if *t == "Ready" { "True" } else { "False" }, "reason": "KubeletReady",
                "message": "kubelet is posting ready status", "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            })
        })
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name, "uid": format!("uid-{name}"),
            "labels": {
                "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": "p5.48xlarge", "topology.kubernetes.io/zone": format!("zone-{}", i % 3),
                "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8",
            },
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", "volumes.kubernetes.io/controller-managed-attach-detach": "true"},
        },
        "spec": {"podCIDR": format!("10.{}.{}.0/24", i / 256, i % 256), "providerID": format!("aws:///zone/i-{i:017x}")},
        "status": {
            "capacity": {"cpu": "192", "memory": "2097152Mi", "nvidia.com/gpu": "8", "pods": "110"},
            "allocatable": {"cpu": "191", "memory": "2000000Mi", "nvidia.com/gpu": "8", "pods": "110"},
            "conditions": conditions,
            "nodeInfo": {"kubeletVersion": "v1.33.1", "containerRuntimeVersion": "containerd://1.7.27", "kernelVersion": "6.8.0", "osImage": "Ubuntu 24.04", "architecture": "amd64", "operatingSystem": "linux", "machineID": format!("{i:032x}"), "systemUUID": format!("{i:032x}"), "bootID": format!("{i:032x}"), "kubeProxyVersion": "", "containerRuntimeVersion2": ""},
            "images": images,
        },
    })
}

fn gpunode(i: usize) -> Value {
    let name = format!("gpu-node-{i:05}");
    let gpus: Vec<Value> = (0..8)
        .map(|g| json!({
            "index": g, "uuid": format!("GPU-{i:08x}-{g:04x}-4000-8000-000000000000"), "model": "NVIDIA H100 80GB HBM3",
            "memoryMiB": 81559, "pciBusId": format!("00000000:{:02X}:00.0", 0x18 + g), "minorNumber": g,
            "health": {"state": "Healthy"},
        }))
        .collect();
    let bindings: Vec<Value> = (0..4)
        .map(|b| json!({
            "podUid": format!("pod-{i}-{b}"), "container": "trainer", "namespace": "ml", "pod": format!("train-{i}-{b}"),
            "resourceName": "nvidia.com/gpu", "gpuUuids": [format!("GPU-{i:08x}-{:04x}-4000-8000-000000000000", b * 2), format!("GPU-{i:08x}-{:04x}-4000-8000-000000000000", b * 2 + 1)],
            "source": "Allocated",
        }))
        .collect();
    json!({
        "apiVersion": "gpuwarden.io/v1alpha1", "kind": "GpuNode",
        "metadata": {
            "name": name, "uid": format!("gpunode-uid-{name}"),
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": format!("uid-{name}"), "controller": true, "blockOwnerDeletion": false}],
        },
        "spec": {"nodeName": name},
        "status": {
            "driver": {"driverVersion": "550.54.15", "cudaDriverVersion": "12.4", "nvmlVersion": "12.550.54.15"},
            "gpus": gpus, "bindings": bindings,
            "runtime": {"acceptEnvVarWhenUnprivileged": false, "mode": "cdi", "cdiEnabled": true},
        },
    })
}

fn lease(i: usize, renewed: &str) -> Value {
    let node = format!("gpu-node-{i:05}");
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": format!("gpuwarden-agent-{node}"), "namespace": "gpuwarden-system", "uid": format!("lease-{node}")},
        "spec": {"holderIdentity": format!("gpuwarden-node-agent-{node}"), "leaseDurationSeconds": 3600, "renewTime": renewed},
    })
}

fn vm(field: &str) -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .map(|l| l.trim_start_matches(field).trim().to_owned())
        })
        .unwrap_or_else(|| "n/a".to_owned())
}

fn mib(kb: &str) -> String {
    kb.trim_end_matches("kB")
        .trim()
        .parse::<f64>()
        .map(|k| format!("{:.1} MiB", k / 1024.0))
        .unwrap_or_else(|_| kb.to_owned())
}

fn micro_time(ts: jiff::Timestamp) -> String {
    ts.strftime("%Y-%m-%dT%H:%M:%S.%6fZ").to_string()
}

#[tokio::main]
async fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let n: usize = std::env::var("GPUWARDEN_BENCH_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000);
    let rss_start = vm("VmRSS:");

    let fake = Arc::new(FakeApi::default());
    let renewed = micro_time(jiff::Timestamp::now());
    for i in 0..n {
        let name = format!("gpu-node-{i:05}");
        fake.insert("nodes", &name, node(i));
        fake.insert("gpunodes", &name, gpunode(i));
        fake.insert(
            "leases",
            &format!("gpuwarden-agent-{name}"),
            lease(i, &renewed),
        );
    }
    let rss_fake = vm("VmRSS:");

    let svc_fake = fake.clone();
    let service = tower::service_fn(move |req: Request<kube::client::Body>| {
        let fake = svc_fake.clone();
        async move { Ok::<_, Infallible>(fake.handle(req).await) }
    });
    let client = kube::Client::new(service, "default");
    let mut config = gpuwarden_operator::Config::new("gpuwarden-system");
    config.health_listen = ([127, 0, 0, 1], 0).into();
    config.leader_election = false;
    config.concurrency = 16;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let started = Instant::now();
    let operator = tokio::spawn(gpuwarden_operator::run(config, client, async move {
        let _ = stop_rx.await;
    }));

    // Cold start: until every GpuNode carries the operator's conditions.
    let deadline = started + Duration::from_secs(600);
    while fake.status_writes.load(Ordering::Relaxed) < n as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cold = started.elapsed();
    let cold_writes = fake.writes.load(Ordering::Relaxed);
    let cold_status = fake.status_writes.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let settled_writes = fake.writes.load(Ordering::Relaxed);
    let rss_cold = vm("VmRSS:");

    // Steady state: every agent renews its Lease and every kubelet posts a heartbeat; the
    // operator's own status writes have already come back through the watch.
    let before = fake.writes.load(Ordering::Relaxed);
    let renewed = micro_time(jiff::Timestamp::now());
    let steady_start = Instant::now();
    for i in 0..n {
        let name = format!("gpu-node-{i:05}");
        fake.modify("leases", &format!("gpuwarden-agent-{name}"), |l| {
            l["spec"]["renewTime"] = json!(renewed);
        });
        fake.modify("nodes", &name, |node| {
            if let Some(conds) = node["status"]["conditions"].as_array_mut() {
                for c in conds {
                    c["lastHeartbeatTime"] = json!(renewed);
                }
            }
        });
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let steady_writes = fake.writes.load(Ordering::Relaxed) - before;
    let rss_steady = vm("VmRSS:");
    let hwm = vm("VmHWM:");

    let _ = stop_tx.send(());
    let stopped = tokio::time::timeout(Duration::from_secs(30), operator).await;

    let status_sample = fake
        .collections
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get("gpunodes")
        .and_then(|c| c.objects.values().next().cloned())
        .and_then(|o| serde_json::from_slice::<Value>(&o).ok())
        .map(|o| o["status"]["summary"].clone())
        .unwrap_or(Value::Null);

    println!();
    println!(
        "gpuwarden-operator scale benchmark: full operator against an in-process fake API server"
    );
    println!("(list + watch, writes applied and echoed back through the watches)");
    println!();
    println!("| measurement                                   | value            | target   |");
    println!("|-----------------------------------------------|------------------|----------|");
    println!("| Nodes / GpuNodes / agent Leases               | {n} / {n} / {n}  |          |");
    println!(
        "| cold start: all GpuNodes have conditions      | {:>13.2} s  | <= 60 s  |",
        cold.as_secs_f64()
    );
    println!(
        "| writes during cold start (status / all)       | {cold_status} / {cold_writes}      |          |"
    );
    println!(
        "| writes in the 2 s after cold start            | {:>16} |          |",
        settled_writes - cold_writes
    );
    println!(
        "| steady state: writes after {n} Lease renewals + {n} Node heartbeats, 10 s | {steady_writes} | 0 |"
    );
    println!(
        "| VmRSS before objects were generated           | {:>16} |          |",
        mib(&rss_start)
    );
    println!(
        "| VmRSS with the fake API server's objects      | {:>16} |          |",
        mib(&rss_fake)
    );
    println!(
        "| VmRSS after cold start (operator + fake)      | {:>16} |          |",
        mib(&rss_cold)
    );
    println!(
        "| VmRSS in steady state (operator + fake)       | {:>16} |          |",
        mib(&rss_steady)
    );
    println!(
        "| VmHWM (peak RSS, operator + fake)             | {:>16} |          |",
        mib(&hwm)
    );
    println!(
        "| list requests served                          | {:>16} |          |",
        fake.lists.load(Ordering::Relaxed)
    );
    println!(
        "| steady-state window                           | {:>13.2} s  |          |",
        steady_start.elapsed().as_secs_f64()
    );
    println!(
        "| operator stopped cleanly                      | {:>16} |          |",
        matches!(stopped, Ok(Ok(Ok(()))))
    );
    println!();
    println!("sample summary written: {status_sample}");
    println!(
        "note: RSS is the whole process; the fake API server's own copy of the objects is the"
    );
    println!("difference between the first two RSS rows, so the operator's share is roughly");
    println!("'steady state' minus 'with the fake API server's objects'.");
}
