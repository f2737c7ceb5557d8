//! The kubelet pod-resources API (`v1.PodResourcesLister`) over its unix socket: which
//! devices the kubelet allocated to which container.
//!
//! The messages are written out here (no maintained crate carries them); only the fields the
//! agent reads are declared, and protobuf skips the rest. Field numbers follow the public
//! `k8s.io/kubelet/pkg/apis/podresources/v1` API.

use std::path::{Path, PathBuf};
use std::time::Duration;

use http::uri::PathAndQuery;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};
use tonic_prost::ProstCodec;

use crate::backoff::Backoff;

/// Default path of the kubelet's pod-resources socket.
pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
/// Largest response the agent accepts: tonic's 4 MiB default is too small for big nodes.
pub const MAX_DECODE_BYTES: usize = 16 * 1024 * 1024;
/// gRPC service name.
pub const SERVICE: &str = "v1.PodResourcesLister";
/// Path of `List`.
pub const LIST_PATH: &str = "/v1.PodResourcesLister/List";
/// Path of `GetAllocatableResources`.
pub const ALLOCATABLE_PATH: &str = "/v1.PodResourcesLister/GetAllocatableResources";

/// `ListPodResourcesRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListPodResourcesRequest {}

/// `ListPodResourcesResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListPodResourcesResponse {
    /// One entry per pod.
    #[prost(message, repeated, tag = "1")]
    pub pod_resources: Vec<PodResources>,
}

/// `PodResources`: what one pod holds.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PodResources {
    /// Pod name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Pod namespace.
    #[prost(string, tag = "2")]
    pub namespace: String,
    /// Per container.
    #[prost(message, repeated, tag = "3")]
    pub containers: Vec<ContainerResources>,
}

/// `ContainerResources`: what one container holds.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerResources {
    /// Container name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Devices, per resource name.
    #[prost(message, repeated, tag = "2")]
    pub devices: Vec<ContainerDevices>,
}

/// `ContainerDevices`: devices of one resource.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerDevices {
    /// Resource name, e.g. `nvidia.com/gpu`.
    #[prost(string, tag = "1")]
    pub resource_name: String,
    /// Device IDs as the device plugin named them.
    #[prost(string, repeated, tag = "2")]
    pub device_ids: Vec<String>,
}

/// `AllocatableResourcesRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AllocatableResourcesRequest {}

/// `AllocatableResourcesResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AllocatableResourcesResponse {
    /// Devices the kubelet can allocate.
    #[prost(message, repeated, tag = "1")]
    pub devices: Vec<ContainerDevices>,
}

/// Errors talking to the kubelet.
#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    /// The socket does not exist.
    #[error(
        "kubelet pod-resources socket {path} does not exist: is the kubelet running, and is its pod-resources directory mounted into the agent? (--pod-resources-socket)"
    )]
    SocketMissing {
        /// The socket path.
        path: String,
    },
    /// The socket exists but nothing answers.
    #[error("failed to connect to the kubelet pod-resources socket {path}")]
    Connect {
        /// The socket path.
        path: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// The kubelet refused the call for its rate limit; the agent waits before asking again.
    #[error("kubelet pod-resources rate limit hit; next call in {retry_in:?}")]
    RateLimited {
        /// Time until the next call.
        retry_in: Duration,
    },
    /// The call failed.
    #[error("kubelet pod-resources call {call} failed: {status}")]
    Call {
        /// `List` or `GetAllocatableResources`.
        call: &'static str,
        /// The gRPC status.
        status: Box<tonic::Status>,
    },
}

/// Timeouts of the pod-resources client.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// Connecting to the socket.
    pub connect: Duration,
    /// One call.
    pub request: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(5),
            request: Duration::from_secs(10),
        }
    }
}

/// A client of the kubelet's pod-resources API that respects its rate limit.
pub struct PodResourcesClient {
    grpc: tonic::client::Grpc<Channel>,
    path: PathBuf,
    backoff: Backoff,
    blocked_until: Option<Instant>,
}

impl PodResourcesClient {
    /// Connects to the socket at `path`.
    pub async fn connect(path: &Path, timeouts: Timeouts) -> Result<Self, PodResourcesError> {
        if !path.exists() {
            return Err(PodResourcesError::SocketMissing {
                path: path.display().to_string(),
            });
        }
        let socket = path.to_path_buf();
        // The URI is a placeholder: the connector ignores it and dials the socket.
        let channel = Endpoint::from_static("http://kubelet.sock")
            .connect_timeout(timeouts.connect)
            .timeout(timeouts.request)
            .connect_with_connector(tower::service_fn(move |_: http::Uri| {
                let socket = socket.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(socket).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(stream))
                }
            }))
            .await
            .map_err(|source| PodResourcesError::Connect {
                path: path.display().to_string(),
                source,
            })?;
        Ok(Self {
            grpc: tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_DECODE_BYTES),
            path: path.to_path_buf(),
            backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(60)),
            blocked_until: None,
        })
    }

    /// The socket this client talks to.
    pub fn socket(&self) -> &Path {
        &self.path
    }

    /// `List`: every pod's allocated devices.
    pub async fn list(&mut self) -> Result<Vec<PodResources>, PodResourcesError> {
        let resp: ListPodResourcesResponse = self
            .call("List", LIST_PATH, ListPodResourcesRequest {})
            .await?;
        Ok(resp.pod_resources)
    }

    /// `GetAllocatableResources`: the devices the kubelet can hand out.
    pub async fn allocatable(&mut self) -> Result<Vec<ContainerDevices>, PodResourcesError> {
        let resp: AllocatableResourcesResponse = self
            .call(
                "GetAllocatableResources",
                ALLOCATABLE_PATH,
                AllocatableResourcesRequest {},
            )
            .await?;
        Ok(resp.devices)
    }

    async fn call<Req, Resp>(
        &mut self,
        name: &'static str,
        path: &'static str,
        req: Req,
    ) -> Result<Resp, PodResourcesError>
    where
        Req: prost::Message + Send + Sync + 'static,
        Resp: prost::Message + Default + Send + Sync + 'static,
    {
        let now = Instant::now();
        if let Some(until) = self.blocked_until
            && until > now
        {
            return Err(PodResourcesError::RateLimited {
                retry_in: until - now,
            });
        }
        let call_err = |status: tonic::Status| PodResourcesError::Call {
            call: name,
            status: Box::new(status),
        };
        self.grpc
            .ready()
            .await
            .map_err(|e| call_err(tonic::Status::unavailable(e.to_string())))?;
        let result = self
            .grpc
            .unary(
                tonic::Request::new(req),
                PathAndQuery::from_static(path),
                ProstCodec::<Req, Resp>::default(),
            )
            .await;
        match result {
            Ok(resp) => {
                self.backoff.reset();
                self.blocked_until = None;
                Ok(resp.into_inner())
            }
            Err(status) if status.code() == tonic::Code::ResourceExhausted => {
                let wait = self.backoff.next_delay();
                self.blocked_until = Some(now + wait);
                Err(PodResourcesError::RateLimited { retry_in: wait })
            }
            Err(status) => Err(call_err(status)),
        }
    }
}

/// A kubelet allocation of GPUs to one container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Container name.
    pub container: String,
    /// Resource name.
    pub resource_name: String,
    /// GPU or MIG device UUIDs.
    pub device_uuids: Vec<String>,
}

/// Maps device plugin IDs to GPU and MIG device UUIDs.
#[derive(Clone, Debug, Default)]
pub struct DeviceMap {
    /// (GPU index, GPU UUID, MIG UUIDs in MIG index order).
    gpus: Vec<(u32, String, Vec<String>)>,
}

impl DeviceMap {
    /// A map over the GPUs of one reading.
    pub fn new(gpus: &[crate::backend::GpuReading]) -> Self {
        Self {
            gpus: gpus
                .iter()
                .map(|g| {
                    (
                        g.info.index,
                        g.info.uuid.clone(),
                        g.info.mig_devices.iter().map(|m| m.uuid.clone()).collect(),
                    )
                })
                .collect(),
        }
    }

    /// The GPU or MIG UUID a device ID names: a UUID (`GPU-…`, `MIG-…`), an index (`3`),
    /// a MIG index (`3:1`), each possibly with a time-slicing replica suffix (`::2`).
    pub fn resolve(&self, device_id: &str) -> Option<String> {
        let id = device_id
            .split_once("::")
            .map_or(device_id, |(base, _)| base);
        for (index, uuid, migs) in &self.gpus {
            if uuid == id {
                return Some(uuid.clone());
            }
            if let Some(m) = migs.iter().find(|m| *m == id) {
                return Some(m.clone());
            }
            if index.to_string() == id {
                return Some(uuid.clone());
            }
            if let Some((gpu, mig)) = id.split_once(':')
                && gpu == index.to_string()
                && let Ok(mig) = mig.parse::<usize>()
            {
                return migs.get(mig).cloned();
            }
        }
        None
    }

    /// The physical GPU a GPU or MIG UUID belongs to.
    pub fn parent(&self, uuid: &str) -> Option<&str> {
        self.gpus
            .iter()
            .find(|(_, gpu, migs)| gpu == uuid || migs.iter().any(|m| m == uuid))
            .map(|(_, gpu, _)| gpu.as_str())
    }
}

/// The GPU allocations in a `List` response: devices whose IDs name a GPU or MIG device on
/// this node (other resources, such as RDMA or CPUs, are left out).
pub fn gpu_allocations(list: &[PodResources], devices: &DeviceMap) -> Vec<Allocation> {
    let mut out = Vec::new();
    for pod in list {
        for container in &pod.containers {
            for dev in &container.devices {
                let mut uuids: Vec<String> = dev
                    .device_ids
                    .iter()
                    .filter_map(|id| devices.resolve(id))
                    .collect();
                if uuids.is_empty() {
                    continue;
                }
                uuids.sort();
                uuids.dedup();
                out.push(Allocation {
                    namespace: pod.namespace.clone(),
                    pod: pod.name.clone(),
                    container: container.name.clone(),
                    resource_name: dev.resource_name.clone(),
                    device_uuids: uuids,
                });
            }
        }
    }
    out
}

/// Of the kubelet's allocatable devices under GPU resource names: how many name a GPU or
/// MIG device on this node, and how many name nothing NVML knows.
pub fn allocatable_gpu_devices(list: &[ContainerDevices], devices: &DeviceMap) -> (usize, usize) {
    let mut known = 0;
    let mut unknown = 0;
    for dev in list {
        for id in &dev.device_ids {
            if devices.resolve(id).is_some() {
                known += 1;
            } else if gpuwarden_crds::gpu::is_gpu_resource(&dev.resource_name) {
                unknown += 1;
            }
        }
    }
    (known, unknown)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{GpuInfo, GpuReading, Telemetry};
    use gpuwarden_crds::node::MigDevice;

    fn gpu(index: u32, uuid: &str, migs: &[&str]) -> GpuReading {
        GpuReading {
            info: GpuInfo {
                index,
                uuid: uuid.into(),
                mig_devices: migs
                    .iter()
                    .map(|m| MigDevice {
                        uuid: m.to_string(),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            },
            answering: true,
            never_answered: false,
            telemetry: Telemetry::default(),
            ecc_uncorrected: None,
            pages_pending_retirement: None,
            row_remapping_pending: None,
            row_remapping_failed: None,
            processes: vec![],
        }
    }

    #[test]
    fn device_ids_map_by_uuid_index_mig_and_replica() {
        let map = DeviceMap::new(&[gpu(0, "GPU-a", &[]), gpu(1, "GPU-b", &["MIG-x", "MIG-y"])]);
        assert_eq!(map.resolve("GPU-a").as_deref(), Some("GPU-a"));
        assert_eq!(map.resolve("GPU-a::3").as_deref(), Some("GPU-a"));
        assert_eq!(map.resolve("0").as_deref(), Some("GPU-a"));
        assert_eq!(map.resolve("MIG-y").as_deref(), Some("MIG-y"));
        assert_eq!(map.resolve("1:0").as_deref(), Some("MIG-x"));
        assert_eq!(map.resolve("1:7"), None);
        assert_eq!(map.resolve("mlx5_0"), None);
        assert_eq!(map.parent("MIG-y"), Some("GPU-b"));
    }

    #[test]
    fn non_gpu_devices_are_left_out() {
        let map = DeviceMap::new(&[gpu(0, "GPU-a", &[])]);
        let list = vec![PodResources {
            name: "p".into(),
            namespace: "ns".into(),
            containers: vec![ContainerResources {
                name: "c".into(),
                devices: vec![
                    ContainerDevices {
                        resource_name: "rdma/hca".into(),
                        device_ids: vec!["mlx5_0".into()],
                    },
                    ContainerDevices {
                        resource_name: "nvidia.com/gpu".into(),
                        device_ids: vec!["GPU-a".into()],
                    },
                ],
            }],
        }];
        let allocs = gpu_allocations(&list, &map);
        assert_eq!(allocs.len(), 1);
        assert_eq!(allocs[0].resource_name, "nvidia.com/gpu");
        assert_eq!(allocs[0].device_uuids, vec!["GPU-a"]);
    }

    #[tokio::test]
    async fn missing_socket_error_is_clear() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubelet.sock");
        let err = PodResourcesClient::connect(&path, Timeouts::default())
            .await
            .err()
            .expect("connect must fail")
            .to_string();
        assert!(
            err.starts_with("kubelet pod-resources socket ")
                && err.contains(&path.display().to_string())
                && err.contains("does not exist")
                && err.contains("--pod-resources-socket"),
            "{err}"
        );
    }
}
