//! An in-process fake kubelet pod-resources server on a unix socket, for this crate's tests
//! and benchmarks and for other crates' end-to-end tests, and the sysfs of a node with VFIO
//! devices ([`sandbox`]).
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use gpuwarden_node_agent::testing::{FakeKubelet, FakeKubeletServer};
//! let dir = tempfile::tempdir()?;
//! let server = FakeKubeletServer::start(&dir.path().join("kubelet.sock"), FakeKubelet::default()).await?;
//! // point the agent's --pod-resources-socket at server.socket()
//! server.stop().await;
//! # Ok(()) }
//! ```

use std::convert::Infallible;
use std::future::{Future, Ready, ready};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::body::Body;
use tonic::server::{NamedService, UnaryService};
use tonic_prost::ProstCodec;

use crate::podresources::{
    ALLOCATABLE_PATH, AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    LIST_PATH, ListPodResourcesRequest, ListPodResourcesResponse, PodResources, SERVICE,
};

/// What the fake kubelet answers.
#[derive(Clone, Debug, Default)]
pub struct FakeKubelet {
    /// `List` answer.
    pub pods: Vec<PodResources>,
    /// `GetAllocatableResources` answer.
    pub allocatable: Vec<ContainerDevices>,
    /// How many of the next calls to refuse with `ResourceExhausted`, as the kubelet's rate
    /// limiter does.
    pub reject_next: u32,
}

#[derive(Clone, Default)]
struct Shared {
    state: Arc<Mutex<FakeKubelet>>,
    calls: Arc<AtomicU64>,
}

impl Shared {
    fn answer<T>(&self, f: impl FnOnce(&FakeKubelet) -> T) -> Result<T, tonic::Status> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.reject_next > 0 {
            state.reject_next -= 1;
            return Err(tonic::Status::resource_exhausted(
                "rejected pod resources List request due to rate limiting",
            ));
        }
        Ok(f(&state))
    }
}

/// A running fake kubelet; stops when [`FakeKubeletServer::stop`] is called or it is dropped.
pub struct FakeKubeletServer {
    socket: PathBuf,
    shared: Shared,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl FakeKubeletServer {
    /// Listens on `socket` (which must not exist yet) and serves `state`.
    pub async fn start(socket: &Path, state: FakeKubelet) -> std::io::Result<Self> {
        let listener = tokio::net::UnixListener::bind(socket)?;
        let shared = Shared {
            state: Arc::new(Mutex::new(state)),
            calls: Arc::new(AtomicU64::new(0)),
        };
        let (tx, rx) = oneshot::channel::<()>();
        let service = Lister(shared.clone());
        let task = tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                    let _ = rx.await;
                })
                .await;
            if let Err(e) = served {
                tracing::warn!(error = %e, "fake kubelet stopped");
            }
        });
        Ok(Self {
            socket: socket.to_path_buf(),
            shared,
            shutdown: Some(tx),
            task: Some(task),
        })
    }

    /// The socket path to give the agent.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Replaces what `List` answers.
    pub fn set_pods(&self, pods: Vec<PodResources>) {
        self.with_state(|s| s.pods = pods);
    }

    /// Refuses the next `n` calls with `ResourceExhausted`.
    pub fn reject_next(&self, n: u32) {
        self.with_state(|s| s.reject_next = n);
    }

    /// Calls served (or refused) so far.
    pub fn calls(&self) -> u64 {
        self.shared.calls.load(Ordering::Relaxed)
    }

    fn with_state(&self, f: impl FnOnce(&mut FakeKubelet)) {
        f(&mut self
            .shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner));
    }

    /// Stops serving and waits for the server to finish.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

impl Drop for FakeKubeletServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

#[derive(Clone)]
struct Lister(Shared);

impl NamedService for Lister {
    const NAME: &'static str = SERVICE;
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl tower::Service<http::Request<Body>> for Lister {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let shared = self.0.clone();
        match req.uri().path() {
            LIST_PATH => Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(ProstCodec::<
                    ListPodResourcesResponse,
                    ListPodResourcesRequest,
                >::default());
                Ok(grpc.unary(List(shared), req).await)
            }),
            ALLOCATABLE_PATH => Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(ProstCodec::<
                    AllocatableResourcesResponse,
                    AllocatableResourcesRequest,
                >::default());
                Ok(grpc.unary(Allocatable(shared), req).await)
            }),
            _ => Box::pin(async { Ok(tonic::Status::unimplemented("unknown method").into_http()) }),
        }
    }
}

struct List(Shared);

impl UnaryService<ListPodResourcesRequest> for List {
    type Response = ListPodResourcesResponse;
    type Future = Ready<Result<tonic::Response<Self::Response>, tonic::Status>>;

    fn call(&mut self, _req: tonic::Request<ListPodResourcesRequest>) -> Self::Future {
        ready(
            self.0
                .answer(|s| ListPodResourcesResponse {
                    pod_resources: s.pods.clone(),
                })
                .map(tonic::Response::new),
        )
    }
}

struct Allocatable(Shared);

impl UnaryService<AllocatableResourcesRequest> for Allocatable {
    type Response = AllocatableResourcesResponse;
    type Future = Ready<Result<tonic::Response<Self::Response>, tonic::Status>>;

    fn call(&mut self, _req: tonic::Request<AllocatableResourcesRequest>) -> Self::Future {
        ready(
            self.0
                .answer(|s| AllocatableResourcesResponse {
                    devices: s.allocatable.clone(),
                })
                .map(tonic::Response::new),
        )
    }
}

/// The node of NVIDIA's sandbox device plugin (kubevirt-gpu-device-plugin) on the test rig,
/// as sysfs and the kubelet show it: an RTX A6000 and its audio function on `vfio-pci` in
/// IOMMU group 13, and a T4 on `nvidia` (group 5) carved into three `GRID T4-1Q` vGPUs in
/// groups 10 to 12. As on the rig, the `iommu_group` links dangle: there is no
/// `kernel/iommu_groups` tree, and only a link's name counts.
pub mod sandbox {
    use std::io;
    use std::os::unix::fs::symlink;
    use std::path::Path;

    use crate::podresources::ContainerDevices;

    /// The A6000's passthrough resource.
    pub const A6000: &str = "nvidia.com/GA102GL_RTX_A6000";
    /// Its audio function's passthrough resource.
    pub const AUDIO: &str = "nvidia.com/GA102_HIGH_DEFINITION_AUDIO_CONTROLLER";
    /// The T4's vGPU resource.
    pub const T4_1Q: &str = "nvidia.com/GRID_T4-1Q";
    /// The A6000's PCI address.
    pub const GPU: &str = "0000:81:00.0";
    /// Its audio function's PCI address.
    pub const AUDIO_FN: &str = "0000:81:00.1";
    /// The T4's PCI address.
    pub const T4: &str = "0000:41:00.0";
    /// The vGPUs' UUIDs, in groups 10, 11 and 12.
    pub const MDEVS: [&str; 3] = [
        "3f1a6a0e-0000-4a00-8000-00000000a010",
        "3f1a6a0e-0000-4a00-8000-00000000a011",
        "3f1a6a0e-0000-4a00-8000-00000000a012",
    ];
    /// A GPU UUID NVIDIA's GPU device plugin advertises as `nvidia.com/gpu`.
    pub const GPU_UUID: &str = "GPU-5e4f0000-0000-0000-0000-000000000000";

    /// Writes the node's sysfs under `root` (what the plugin sees as `/sys`).
    pub fn write_sysfs(root: &Path) -> io::Result<()> {
        let link = |target: &str, at: &Path| -> io::Result<()> {
            if let Some(parent) = at.parent() {
                std::fs::create_dir_all(parent)?;
            }
            symlink(target, at)
        };
        for (addr, group, driver, port) in [
            (GPU, 13, "vfio-pci", "pci0000:80/0000:80:01.1"),
            (AUDIO_FN, 13, "vfio-pci", "pci0000:80/0000:80:01.1"),
            (T4, 5, "nvidia", "pci0000:40/0000:40:01.1"),
        ] {
            let dir = root.join("devices").join(port).join(addr);
            std::fs::create_dir_all(&dir)?;
            std::fs::write(dir.join("vendor"), "0x10de\n")?;
            symlink(
                format!("../../../../kernel/iommu_groups/{group}"),
                dir.join("iommu_group"),
            )?;
            symlink(
                format!("../../../../bus/pci/drivers/{driver}"),
                dir.join("driver"),
            )?;
            link(
                &format!("../../../devices/{port}/{addr}"),
                &root.join("bus/pci/devices").join(addr),
            )?;
        }
        let t4 = root.join("devices/pci0000:40/0000:40:01.1").join(T4);
        let types = t4.join("mdev_supported_types/nvidia-222");
        std::fs::create_dir_all(&types)?;
        std::fs::write(types.join("name"), "GRID T4-1Q\n")?;
        for (group, uuid) in (10..).zip(MDEVS) {
            let dir = t4.join(uuid);
            std::fs::create_dir_all(&dir)?;
            symlink(
                format!("../../../../../kernel/iommu_groups/{group}"),
                dir.join("iommu_group"),
            )?;
            symlink("../mdev_supported_types/nvidia-222", dir.join("mdev_type"))?;
            symlink(
                "../../../../../bus/mdev/drivers/vfio_mdev",
                dir.join("driver"),
            )?;
            link(
                &format!("../../../devices/pci0000:40/0000:40:01.1/{T4}/{uuid}"),
                &root.join("bus/mdev/devices").join(uuid),
            )?;
        }
        Ok(())
    }

    /// What the kubelet lists as allocatable there: the sandbox plugin's three resources
    /// and one GPU of NVIDIA's GPU device plugin.
    pub fn allocatable() -> Vec<ContainerDevices> {
        let devices = |resource: &str, ids: &[&str]| ContainerDevices {
            resource_name: resource.into(),
            device_ids: ids.iter().map(|s| s.to_string()).collect(),
        };
        vec![
            devices(T4_1Q, &MDEVS),
            devices(A6000, &[GPU]),
            devices(AUDIO, &[AUDIO_FN]),
            devices(gpuwarden_crds::RESOURCE_GPU, &[GPU_UUID]),
        ]
    }
}
