//! An in-process fake API server for the operator's resources: paginated list, watch
//! (events streamed as JSON lines), server-side apply and status apply, delete. Writes are
//! counted and sent back through the watches, as a real API server would.
//!
//! Shared by the end-to-end test and the scale benchmark (`#[path]`-included); each uses a
//! different part of it.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody, combinators::UnsyncBoxBody};
use hyper::body::Frame;
use serde_json::{Value, json};
use std::sync::Arc;
use tokio::sync::mpsc;

/// Response body of the fake.
pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// Objects of one resource, with the watchers to tell about changes.
#[derive(Default)]
pub struct Collection {
    /// Serialised objects, as an API server keeps them (and to keep the fake's memory small
    /// next to the operator's).
    pub objects: BTreeMap<String, Bytes>,
    pub watchers: Vec<mpsc::UnboundedSender<Bytes>>,
}

/// An in-memory API server for the resources the operator reads and writes.
#[derive(Default)]
pub struct FakeApi {
    pub collections: Mutex<HashMap<&'static str, Collection>>,
    pub resource_version: AtomicU64,
    pub writes: AtomicU64,
    pub status_writes: AtomicU64,
    pub lists: AtomicU64,
    /// Deletes served.
    pub deletes: AtomicU64,
    /// Every request but to events, as `METHOD path?query`, in order.
    pub requests: Mutex<Vec<String>>,
    /// The report kinds discovery says are served, by `group/version`
    /// (`wgpolicyk8s.io/v1alpha2`, `openreports.io/v1alpha1`).
    pub served_reports: Mutex<Vec<&'static str>>,
}

/// The report kinds the fake can serve: `group/version`, resource, kind.
const REPORT_KINDS: [(&str, &str, &str); 2] = [
    ("wgpolicyk8s.io/v1alpha2", "policyreports", "PolicyReport"),
    ("openreports.io/v1alpha1", "reports", "Report"),
];

/// JSON merge patch (RFC 7386): objects merge, null removes, anything else replaces.
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

fn broadcast(entry: &mut Collection, kind: &str, obj: &Value) {
    let mut line = serde_json::to_vec(&json!({"type": kind, "object": obj})).unwrap_or_default();
    line.push(b'\n');
    let line = Bytes::from(line);
    entry.watchers.retain(|w| w.send(line.clone()).is_ok());
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

fn invalid(message: &str) -> Response<Body> {
    json_response(
        StatusCode::UNPROCESSABLE_ENTITY,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Invalid", "code": 422, "message": message}),
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
    // Reports: namespaced objects, kept as `namespace/name`; listed across namespaces.
    for (version, plural, kind) in REPORT_KINDS {
        let Some(rest) = path.strip_prefix(&format!("/apis/{version}/")) else {
            continue;
        };
        let list_kind = match kind {
            "PolicyReport" => "PolicyReportList",
            _ => "ReportList",
        };
        if rest == plural {
            return Some((plural, list_kind, version, None, false));
        }
        let parts: Vec<&str> = rest.split('/').collect();
        if let ["namespaces", namespace, p, name] = parts[..]
            && p == plural
        {
            return Some((
                plural,
                list_kind,
                version,
                Some(format!("{namespace}/{name}")),
                false,
            ));
        }
        return None;
    }
    let routes: [(&str, &str, &str, &str); 9] = [
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
            "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
            "mutatingwebhookconfigurations",
            "MutatingWebhookConfigurationList",
            "admissionregistration.k8s.io/v1",
        ),
        (
            "/apis/events.k8s.io/v1/namespaces/default/events",
            "events",
            "EventList",
            "events.k8s.io/v1",
        ),
        // After the namespaced routes above, which it is a prefix of.
        ("/api/v1/namespaces", "namespaces", "NamespaceList", "v1"),
        ("/api/v1/pods", "pods", "PodList", "v1"),
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
    /// A `kube::Client` whose requests this fake answers.
    pub fn client(self: &Arc<Self>) -> kube::Client {
        let fake = self.clone();
        let service = tower::service_fn(move |req: Request<kube::client::Body>| {
            let fake = fake.clone();
            async move { Ok::<_, Infallible>(fake.handle(req).await) }
        });
        kube::Client::new(service, "default")
    }

    fn next_rv(&self) -> String {
        (self.resource_version.fetch_add(1, Ordering::SeqCst) + 1).to_string()
    }

    /// Stores an object without telling watchers: for what exists before the operator starts.
    pub fn insert(&self, coll: &'static str, name: &str, mut obj: Value) {
        obj["metadata"]["resourceVersion"] = json!(self.next_rv());
        let bytes = Bytes::from(serde_json::to_vec(&obj).unwrap_or_default());
        let mut c = self.collections.lock().unwrap_or_else(|p| p.into_inner());
        c.entry(coll)
            .or_default()
            .objects
            .insert(name.to_owned(), bytes);
    }

    /// Creates an object and tells watchers it was added, as an API server would.
    pub fn create(&self, coll: &'static str, name: &str, obj: Value) {
        self.insert(coll, name, obj);
        let mut c = self.collections.lock().unwrap_or_else(|p| p.into_inner());
        let entry = c.entry(coll).or_default();
        if let Some(obj) = entry
            .objects
            .get(name)
            .and_then(|b| serde_json::from_slice::<Value>(b).ok())
        {
            broadcast(entry, "ADDED", &obj);
        }
    }

    /// Changes an object and tells its watchers, as an API server would.
    pub fn modify(
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
    /// Removes an object and tells watchers.
    pub fn remove(&self, coll: &'static str, name: &str) -> bool {
        let mut c = self.collections.lock().unwrap_or_else(|p| p.into_inner());
        let entry = c.entry(coll).or_default();
        let Some(stored) = entry.objects.remove(name) else {
            return false;
        };
        if let Ok(mut obj) = serde_json::from_slice::<Value>(&stored) {
            obj["metadata"]["resourceVersion"] = json!(self.next_rv());
            broadcast(entry, "DELETED", &obj);
        }
        true
    }

    /// Number of objects in a collection.
    pub fn count(&self, coll: &'static str) -> usize {
        let c = self.collections.lock().unwrap_or_else(|p| p.into_inner());
        c.get(coll).map_or(0, |c| c.objects.len())
    }

    /// One object, parsed.
    pub fn get(&self, coll: &'static str, name: &str) -> Option<Value> {
        let c = self.collections.lock().unwrap_or_else(|p| p.into_inner());
        serde_json::from_slice(c.get(coll)?.objects.get(name)?).ok()
    }

    fn list(&self, coll: &'static str, kind: &str, version: &str, query: &str) -> Vec<u8> {
        self.list_within(coll, kind, version, query, "")
    }

    /// A page of the objects of `coll` whose keys start with `within`.
    fn list_within(
        &self,
        coll: &'static str,
        kind: &str,
        version: &str,
        query: &str,
        within: &str,
    ) -> Vec<u8> {
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
        let objects = c.get(coll).map(|c| {
            (c.objects.iter())
                .filter(|(key, _)| key.starts_with(within))
                .collect::<BTreeMap<_, _>>()
        });
        let total = objects.as_ref().map_or(0, BTreeMap::len);
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
            .flat_map(|o| o.into_values())
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

    /// Serves a report kind's API group, as `served_reports` says.
    pub fn serve_reports(&self, group_version: &'static str) {
        self.served_reports
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(group_version);
    }

    /// The discovery document of a served report group, `None` for any other path.
    fn discovery(&self, path: &str) -> Option<Value> {
        let group_version = path.strip_prefix("/apis/")?;
        let served = self
            .served_reports
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (version, plural, kind) = REPORT_KINDS
            .into_iter()
            .find(|(v, _, _)| *v == group_version && served.contains(v))?;
        Some(json!({
            "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": version,
            "resources": [{"name": plural, "singularName": "", "namespaced": true, "kind": kind,
                "verbs": ["delete", "get", "list", "patch", "create", "watch"]}],
        }))
    }

    /// Answers one request.
    pub async fn handle(self: Arc<Self>, req: Request<kube::client::Body>) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let path = parts.uri.path().to_owned();
        let query = parts.uri.query().unwrap_or_default().to_owned();
        self.handle_parts(parts.method.as_str(), &path, &query, body)
    }

    /// Answers one request given as method, path, query and body.
    pub fn handle_parts(
        &self,
        method: &str,
        path: &str,
        query: &str,
        body: Bytes,
    ) -> Response<Body> {
        if method == "GET"
            && let Some(list) = self.discovery(path)
        {
            return json_response(StatusCode::OK, &list);
        }
        // The pods of one namespace (kept as `namespace/name`), listed.
        if method == "GET"
            && !query.contains("watch=true")
            && let Some(namespace) = (path.strip_prefix("/api/v1/namespaces/"))
                .and_then(|rest| rest.strip_suffix("/pods"))
        {
            self.requests
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(format!("{method} {path}?{query}"));
            let within = format!("{namespace}/");
            let list = self.list_within("pods", "PodList", "v1", query, &within);
            return Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "application/json")
                .body(full(list))
                .unwrap_or_default();
        }
        let Some((coll, kind, version, name, status)) = route(path) else {
            return not_found();
        };
        if coll != "events" {
            self.requests
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(format!("{method} {path}?{query}"));
        }
        match (method, name) {
            ("GET", None) if query.contains("watch=true") => self.watch(coll),
            ("GET", None) => Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "application/json")
                .body(full(self.list(coll, kind, version, query)))
                .unwrap_or_default(),
            ("GET", Some(name)) => match self.get(coll, &name) {
                Some(obj) => json_response(StatusCode::OK, &obj),
                None => not_found(),
            },
            ("PATCH", Some(name)) | ("POST", Some(name)) => {
                self.writes.fetch_add(1, Ordering::Relaxed);
                let patch: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                if status {
                    self.status_writes.fetch_add(1, Ordering::Relaxed);
                }
                if patch.is_array() {
                    // A JSON patch (RFC 6902): applied as the API server does, refused whole
                    // when a `test` fails or the object is missing.
                    let Ok(ops) = serde_json::from_value::<json_patch::Patch>(patch) else {
                        return invalid("not a JSON patch");
                    };
                    let Some(mut patched) = self.get(coll, &name) else {
                        return not_found();
                    };
                    if json_patch::patch(&mut patched, &ops).is_err() {
                        return invalid("the patch does not apply");
                    }
                    return match self.modify(coll, &name, |obj| *obj = patched) {
                        Some(obj) => json_response(StatusCode::OK, &obj),
                        None => not_found(),
                    };
                }
                let updated = self.modify(coll, &name, |obj| {
                    if status {
                        for (k, v) in patch["status"].as_object().into_iter().flatten() {
                            obj["status"][k] = v.clone();
                        }
                    } else {
                        merge(obj, &patch);
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
            ("DELETE", Some(name)) => {
                self.writes.fetch_add(1, Ordering::Relaxed);
                self.deletes.fetch_add(1, Ordering::Relaxed);
                if self.remove(coll, &name) {
                    json_response(
                        StatusCode::OK,
                        &json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200}),
                    )
                } else {
                    not_found()
                }
            }
            ("POST", None) => {
                self.writes.fetch_add(1, Ordering::Relaxed);
                let mut obj: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                // Events are only counted; other creates are stored.
                if let (false, Some(name)) = (coll == "events", obj["metadata"]["name"].as_str()) {
                    let name = name.to_owned();
                    if self.get(coll, &name).is_some() {
                        return json_response(
                            StatusCode::CONFLICT,
                            &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "AlreadyExists", "code": 409}),
                        );
                    }
                    obj["metadata"]["uid"] = json!(format!("{coll}-{name}"));
                    self.insert(coll, &name, obj);
                    obj = self.get(coll, &name).unwrap_or_default();
                }
                json_response(StatusCode::CREATED, &obj)
            }
            _ => not_found(),
        }
    }
}

/// A realistic GPU Node (labels, allocatable, conditions, 30 images).
pub fn node(i: usize) -> Value {
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

/// A GpuNode as the agent reports it: 8 healthy GPUs, 4 bindings, runtime.
pub fn gpunode(i: usize) -> Value {
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

/// A live agent Lease for node `i`.
pub fn lease(i: usize, renewed: &str) -> Value {
    let node = format!("gpu-node-{i:05}");
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": format!("gpuwarden-agent-{node}"), "namespace": "gpuwarden-system", "uid": format!("lease-{node}")},
        "spec": {"holderIdentity": format!("gpuwarden-node-agent-{node}"), "leaseDurationSeconds": 3600, "renewTime": renewed},
    })
}

/// An HTTP router serving `fake` (every path not routed otherwise).
pub fn router(fake: Arc<FakeApi>) -> axum::Router {
    axum::Router::new().fallback(move |req: axum::extract::Request| {
        let fake = fake.clone();
        async move {
            let (parts, body) = req.into_parts();
            let body = axum::body::to_bytes(body, 64 << 20)
                .await
                .unwrap_or_default();
            fake.handle_parts(
                parts.method.as_str(),
                parts.uri.path(),
                parts.uri.query().unwrap_or_default(),
                body,
            )
            .map(axum::body::Body::new)
        }
    })
}
