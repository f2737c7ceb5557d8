//! The kubelet pod-resources API (`v1.PodResourcesLister`) over its unix socket: which
//! devices the kubelet allocated to which container, through device plugins and through
//! Dynamic Resource Allocation (ResourceClaims).
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
    /// Devices allocated through ResourceClaims (DRA).
    #[prost(message, repeated, tag = "5")]
    pub dynamic_resources: Vec<DynamicResource>,
}

/// `DynamicResource`: one ResourceClaim a container uses. (Tag 1, the claim's class, was
/// removed from the API in Kubernetes 1.31.)
#[derive(Clone, PartialEq, prost::Message)]
pub struct DynamicResource {
    /// The claim's name.
    #[prost(string, tag = "2")]
    pub claim_name: String,
    /// The claim's namespace.
    #[prost(string, tag = "3")]
    pub claim_namespace: String,
    /// The devices allocated for it.
    #[prost(message, repeated, tag = "4")]
    pub claim_resources: Vec<ClaimResource>,
}

/// `ClaimResource`: one device a DRA driver allocated for a claim.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ClaimResource {
    /// The CDI devices the driver injects for it.
    #[prost(message, repeated, tag = "1")]
    pub cdi_devices: Vec<CdiDevice>,
    /// The driver, e.g. `gpu.nvidia.com`.
    #[prost(string, tag = "2")]
    pub driver_name: String,
    /// The pool it came from (for the NVIDIA driver, the node).
    #[prost(string, tag = "3")]
    pub pool_name: String,
    /// The device's name in its ResourceSlice, e.g. `gpu-0`.
    #[prost(string, tag = "4")]
    pub device_name: String,
}

/// `CDIDevice`: a fully qualified CDI device name.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CdiDevice {
    /// e.g. `k8s.gpu.nvidia.com/device=gpu-0`.
    #[prost(string, tag = "1")]
    pub name: String,
}

/// The DRA drivers whose devices are GPUs: NVIDIA's `gpu.nvidia.com` (full GPUs and MIG
/// devices). Its `compute-domain.nvidia.com` hands out IMEX channels, not GPUs.
pub const GPU_DRA_DRIVERS: &[&str] = &["gpu.nvidia.com"];

/// NVIDIA's compute-domain DRA driver, and the prefix of the devices it publishes for IMEX
/// channels (`channel-0`); its other device is the IMEX daemon's (`daemon-0`).
pub const IMEX_CHANNEL_DEVICES: (&str, &str) = ("compute-domain.nvidia.com", "channel-");

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
    /// Resource name, or for a ResourceClaim the DRA driver's name.
    pub resource_name: String,
    /// GPU or MIG device UUIDs.
    pub device_uuids: Vec<String>,
    /// The ResourceClaim (`namespace/name`) the devices were allocated for, when DRA
    /// allocated them.
    pub claim: Option<String>,
}

/// One ResourceClaim one container uses, as the kubelet lists it: what was allocated for it
/// and the CDI devices the runtime injects for it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimUse {
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Container name.
    pub container: String,
    /// The claim, `namespace/name`.
    pub claim: String,
    /// The DRA drivers of its devices, sorted.
    pub drivers: Vec<String>,
    /// Whether an IMEX channel was allocated for it.
    pub imex_channel: bool,
    /// The fully qualified CDI devices of its devices.
    pub cdi_devices: Vec<String>,
}

/// The claims each container uses, with their CDI devices (docs/design.md, "What a claim's
/// CDI spec hands out"). The GPUs allocated for them are in [`gpu_allocations`].
pub fn claim_uses(list: &[PodResources]) -> Vec<ClaimUse> {
    let mut out = Vec::new();
    for pod in list {
        for container in &pod.containers {
            for claim in &container.dynamic_resources {
                let mut drivers: Vec<String> = (claim.claim_resources.iter())
                    .map(|r| r.driver_name.clone())
                    .collect();
                drivers.sort();
                drivers.dedup();
                let (cd_driver, channel) = IMEX_CHANNEL_DEVICES;
                out.push(ClaimUse {
                    namespace: pod.namespace.clone(),
                    pod: pod.name.clone(),
                    container: container.name.clone(),
                    claim: format!("{}/{}", claim.claim_namespace, claim.claim_name),
                    drivers,
                    imex_channel: (claim.claim_resources.iter())
                        .any(|r| r.driver_name == cd_driver && r.device_name.starts_with(channel)),
                    cdi_devices: (claim.claim_resources.iter())
                        .flat_map(|r| r.cdi_devices.iter().map(|d| d.name.clone()))
                        .collect(),
                });
            }
        }
    }
    out
}

/// Maps device plugin IDs to GPU and MIG device UUIDs.
#[derive(Clone, Debug, Default)]
pub struct DeviceMap {
    /// (GPU index, GPU UUID, MIG UUIDs in MIG index order).
    gpus: Vec<(u32, String, Vec<String>)>,
    /// (minor number of `/dev/nvidia<N>`, GPU UUID), where NVML told it.
    minors: Vec<(u32, String)>,
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
            minors: gpus
                .iter()
                .filter_map(|g| Some((g.info.minor_number?, g.info.uuid.clone())))
                .collect(),
        }
    }

    /// The GPU or MIG UUID a device ID names: a UUID (`GPU-…`, `MIG-…`), an index (`3`),
    /// a MIG index (`3:1`), each possibly with a time-slicing replica suffix (`::2`), or a
    /// UUID with HAMi's split suffix (`GPU-…-3`: HAMi's device plugin offers each GPU as
    /// several devices named so).
    pub fn resolve(&self, device_id: &str) -> Option<String> {
        let id = device_id
            .split_once("::")
            .map_or(device_id, |(base, _)| base);
        self.resolve_base(id).or_else(|| {
            let (uuid, split) = id.rsplit_once('-')?;
            let known = self
                .gpus
                .iter()
                .any(|(_, gpu, migs)| gpu == uuid || migs.iter().any(|m| m == uuid));
            (known && !split.is_empty() && split.bytes().all(|b| b.is_ascii_digit()))
                .then(|| uuid.to_owned())
        })
    }

    /// [`DeviceMap::resolve`] of an ID without a replica or split suffix.
    fn resolve_base(&self, id: &str) -> Option<String> {
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

    /// The UUID of the GPU whose device node is `/dev/nvidia<minor>`. Where NVML gave no
    /// minor numbers, `minor` is read as the GPU's index, which it is on most machines.
    pub fn by_minor(&self, minor: u32) -> Option<String> {
        if self.minors.is_empty() {
            return (self.gpus.iter())
                .find(|(index, _, _)| *index == minor)
                .map(|(_, uuid, _)| uuid.clone());
        }
        (self.minors.iter())
            .find(|(m, _)| *m == minor)
            .map(|(_, uuid)| uuid.clone())
    }

    /// The GPU or MIG UUID a DRA device names: its device name (`gpu-3`, a UUID) or one of
    /// its CDI device names (`k8s.gpu.nvidia.com/device=gpu-3`). NVIDIA's driver names a
    /// full GPU `gpu-<minor>`, after its `/dev/nvidia<minor>`, and a MIG device
    /// `gpu-<parent minor>-mig-...`; as that name does not say which MIG UUID it is, a MIG
    /// device resolves to its GPU. Where NVML gave no minor numbers, `<minor>` is read as
    /// the GPU's index, which it is on most machines.
    pub fn resolve_dra(&self, device_name: &str, cdi_names: &[&str]) -> Option<String> {
        let named = |name: &str| {
            self.resolve(name).or_else(|| {
                let minor = name.strip_prefix("gpu-")?;
                let minor = minor.split_once("-mig-").map_or(minor, |(gpu, _)| gpu);
                self.by_minor(minor.parse().ok()?)
            })
        };
        named(device_name).or_else(|| {
            (cdi_names.iter())
                .filter_map(|cdi| cdi.rsplit_once('=').map(|(_, name)| name))
                .find_map(named)
        })
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
            // GPUs found under one resource name or claim: one allocation.
            let mut push = |resource_name: &str, uuids: Vec<String>, claim: Option<String>| {
                let mut uuids = uuids;
                if uuids.is_empty() {
                    return;
                }
                uuids.sort();
                uuids.dedup();
                out.push(Allocation {
                    namespace: pod.namespace.clone(),
                    pod: pod.name.clone(),
                    container: container.name.clone(),
                    resource_name: resource_name.to_owned(),
                    device_uuids: uuids,
                    claim,
                });
            };
            for dev in &container.devices {
                let uuids = (dev.device_ids.iter()).filter_map(|id| devices.resolve(id));
                push(&dev.resource_name, uuids.collect(), None);
            }
            for claim in &container.dynamic_resources {
                for driver in GPU_DRA_DRIVERS {
                    let uuids = (claim.claim_resources.iter())
                        .filter(|r| r.driver_name == *driver)
                        .filter_map(|r| {
                            let cdi: Vec<&str> =
                                r.cdi_devices.iter().map(|d| d.name.as_str()).collect();
                            devices.resolve_dra(&r.device_name, &cdi)
                        });
                    let name = format!("{}/{}", claim.claim_namespace, claim.claim_name);
                    push(driver, uuids.collect(), Some(name));
                }
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
                ..ContainerResources::default()
            }],
        }];
        let allocs = gpu_allocations(&list, &map);
        assert_eq!(allocs.len(), 1);
        assert_eq!(allocs[0].resource_name, "nvidia.com/gpu");
        assert_eq!(allocs[0].device_uuids, vec!["GPU-a"]);
    }

    fn claim_device(driver: &str, device: &str, cdi: &str) -> ClaimResource {
        ClaimResource {
            cdi_devices: vec![CdiDevice { name: cdi.into() }],
            driver_name: driver.into(),
            pool_name: "node-1".into(),
            device_name: device.into(),
        }
    }

    #[test]
    fn claims_of_the_nvidia_dra_driver_are_gpu_allocations() {
        let map = DeviceMap::new(&[gpu(0, "GPU-a", &[]), gpu(1, "GPU-b", &["MIG-x"])]);
        let list = vec![PodResources {
            name: "train".into(),
            namespace: "ml".into(),
            containers: vec![ContainerResources {
                name: "main".into(),
                dynamic_resources: vec![
                    DynamicResource {
                        claim_name: "train-gpus-x7k2p".into(),
                        claim_namespace: "ml".into(),
                        claim_resources: vec![
                            claim_device(
                                "gpu.nvidia.com",
                                "gpu-1",
                                "k8s.gpu.nvidia.com/device=gpu-1",
                            ),
                            // A MIG device: its GPU, as the name does not say which MIG.
                            claim_device("gpu.nvidia.com", "gpu-0-mig-1g.10gb-0", ""),
                            // Named only by its CDI device.
                            claim_device(
                                "gpu.nvidia.com",
                                "odd",
                                "k8s.gpu.nvidia.com/device=gpu-1",
                            ),
                            // Not a GPU: an IMEX channel, another vendor, an unknown device.
                            claim_device("compute-domain.nvidia.com", "channel-0", ""),
                            claim_device("fpga.example.com", "gpu-0", ""),
                            claim_device("gpu.nvidia.com", "gpu-9", ""),
                        ],
                    },
                    DynamicResource {
                        claim_name: "nics".into(),
                        claim_namespace: "ml".into(),
                        claim_resources: vec![claim_device("rdma.example.com", "mlx5_0", "")],
                    },
                ],
                ..ContainerResources::default()
            }],
        }];
        let allocs = gpu_allocations(&list, &map);
        assert_eq!(allocs.len(), 1, "{allocs:?}");
        let a = &allocs[0];
        assert_eq!(a.resource_name, "gpu.nvidia.com");
        assert_eq!(a.claim.as_deref(), Some("ml/train-gpus-x7k2p"));
        assert_eq!(a.device_uuids, ["GPU-a", "GPU-b"]);
        assert_eq!(map.resolve_dra("MIG-x", &[]).as_deref(), Some("MIG-x"));
        assert_eq!(map.resolve_dra("gpu-x", &[]), None);
    }

    #[test]
    fn hamis_split_devices_name_their_gpu() {
        let map = DeviceMap::new(&[
            gpu(0, "GPU-01000100-0000-0000-0000-000000000000", &[]),
            gpu(1, "GPU-b", &["MIG-x"]),
        ]);
        // A UUID whose last group is all digits is itself, not a split of something.
        assert_eq!(
            map.resolve("GPU-01000100-0000-0000-0000-000000000000")
                .as_deref(),
            Some("GPU-01000100-0000-0000-0000-000000000000")
        );
        assert_eq!(
            map.resolve("GPU-01000100-0000-0000-0000-000000000000-7")
                .as_deref(),
            Some("GPU-01000100-0000-0000-0000-000000000000")
        );
        assert_eq!(map.resolve("GPU-b-0").as_deref(), Some("GPU-b"));
        assert_eq!(map.resolve("MIG-x-2").as_deref(), Some("MIG-x"));
        assert_eq!(map.resolve("GPU-c-1"), None, "no such GPU");
        assert_eq!(map.resolve("GPU-b-x"), None, "not a split number");
        assert_eq!(map.resolve("GPU-b-"), None);
    }

    #[test]
    fn a_dra_device_name_is_the_minor_number_of_its_gpu() {
        // GPU index 0 is /dev/nvidia2 and index 1 is /dev/nvidia0: NVML's order (PCI bus)
        // need not be the driver's minor numbers.
        let mut a = gpu(0, "GPU-a", &[]);
        a.info.minor_number = Some(2);
        let mut b = gpu(1, "GPU-b", &["MIG-x"]);
        b.info.minor_number = Some(0);
        let map = DeviceMap::new(&[a, b]);
        assert_eq!(map.resolve_dra("gpu-0", &[]).as_deref(), Some("GPU-b"));
        assert_eq!(map.resolve_dra("gpu-2", &[]).as_deref(), Some("GPU-a"));
        assert_eq!(map.resolve_dra("gpu-1", &[]), None, "no GPU has minor 1");
        assert_eq!(
            map.resolve_dra("gpu-0-mig-1g.10gb-0-1", &[]).as_deref(),
            Some("GPU-b")
        );
        assert_eq!(
            map.resolve_dra("x", &["k8s.gpu.nvidia.com/device=gpu-2"])
                .as_deref(),
            Some("GPU-a")
        );
        // A device plugin ID is still its index.
        assert_eq!(map.resolve("0").as_deref(), Some("GPU-a"));
    }

    /// The DRA messages carry the field numbers of the kubelet's `api.proto`
    /// (`ContainerResources.dynamic_resources = 5`, `DynamicResource` 2 to 4 with 1
    /// reserved, `ClaimResource` 1 to 4, `CDIDevice.name = 1`): the bytes prost writes are
    /// the bytes a Go kubelet writes.
    #[test]
    fn dra_field_numbers_follow_the_kubelet_api() {
        use prost::Message;
        let container = ContainerResources {
            name: "c".into(),
            devices: vec![],
            dynamic_resources: vec![DynamicResource {
                claim_name: "n".into(),
                claim_namespace: "s".into(),
                claim_resources: vec![claim_device("d", "v", "x")],
            }],
        };
        let bytes = container.encode_to_vec();
        // name (1, length-delimited) "c", then dynamic_resources (5, length-delimited).
        assert_eq!(&bytes[..3], &[0x0a, 1, b'c']);
        assert_eq!(bytes[3], (5 << 3) | 2);
        let resource = &bytes[5..];
        // claim_name (2) "n", claim_namespace (3) "s", claim_resources (4).
        assert_eq!(&resource[..6], &[0x12, 1, b'n', 0x1a, 1, b's']);
        assert_eq!(resource[6], (4 << 3) | 2);
        let claim = &resource[8..];
        // cdi_devices (1) {name (1) "x"}, driver_name (2) "d", pool_name (3) "node-1",
        // device_name (4) "v".
        assert_eq!(&claim[..5], &[0x0a, 3, 0x0a, 1, b'x']);
        assert_eq!(&claim[5..8], &[0x12, 1, b'd']);
        assert_eq!(&claim[8..10], &[0x1a, 6]);
        assert_eq!(&claim[16..], &[0x22, 1, b'v']);
        assert_eq!(
            ContainerResources::decode(bytes.as_slice()).unwrap(),
            container
        );
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
