//! An in-process fake kubelet pod-resources server on a unix socket, for this crate's tests
//! and benchmarks and for other crates' end-to-end tests.
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
