//! The agent: one sweep reads the GPUs, the kubelet's allocations and the GPU processes'
//! cgroups, computes the status and the metrics; `run` repeats it and writes the status,
//! `inspect` does it once and prints it.

use gpuwarden_crds::error_chain;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use gpuwarden_crds::{GpuNodeStatus, GpuPolicy, RuntimeStatus};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::DynamicObject;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource};
use tracing::{Instrument, info, info_span, warn};

use crate::backend::{BackendError, GpuBackend};
use crate::cdi::CdiDevices;
use crate::cgroup::{self, ContainerRef};
use crate::fake::{FakeBackend, FakeNode};
use crate::health::{HealthRules, HealthTracker};
use crate::kai::KaiBinds;
use crate::lease::{LeaseKeeper, RENEW_INTERVAL};
use crate::metrics::{CallLabels, ErrorSource, Metrics};
use crate::nvml::NvmlBackend;
use crate::podresources::{
    ClaimUse, ContainerDevices, DeviceMap, PodResources, PodResourcesClient, PodResourcesError,
    Timeouts, claim_uses, gpu_allocations,
};
use crate::pods::{PodIndex, PodInfo};
use crate::status::{Computed, ObservedProcess, StatusInput};
use crate::vfio::VfioInventory;
use crate::writer::{
    Clock, KubeSink, MIN_WRITE_INTERVAL, Outcome, StatusSink, StatusWriter, SystemClock,
};

/// Errors that stop the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The GPU backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The kubelet could not be asked (fatal only in `inspect`).
    #[error(transparent)]
    PodResources(#[from] PodResourcesError),
    /// A setting is out of range.
    #[error("invalid configuration: {0}")]
    Config(&'static str),
    /// The metrics listener could not bind.
    #[error("failed to listen on {addr}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Where allocations come from.
pub enum AllocationSource {
    /// Nowhere: no bindings from the kubelet.
    None,
    /// A fixed list (the fake file's `podResources`, for `inspect`).
    Static(Vec<PodResources>),
    /// The kubelet's pod-resources socket.
    Kubelet {
        /// Socket path.
        socket: PathBuf,
        /// Timeouts.
        timeouts: Timeouts,
        /// Whether a failure fails the sweep (`inspect`) or is logged and retried (`run`).
        strict: bool,
    },
}

/// Runs sweeps and keeps what must survive between them (health, kubelet connection).
pub struct Sweeper {
    backend: Arc<dyn GpuBackend>,
    health: HealthTracker,
    allocations: AllocationSource,
    kubelet: Option<PodResourcesClient>,
    last_list: Vec<PodResources>,
    /// `GetAllocatableResources`, and when it was last asked.
    allocatable: Option<(Timestamp, Vec<ContainerDevices>)>,
    last_kubelet_error: Option<String>,
    proc_root: PathBuf,
    host_root: PathBuf,
    /// The report of the runtime-report container, read instead of `host_root`'s files.
    runtime_report: Option<PathBuf>,
    /// Where the toolkit's and the CRI's configs are, when read under `host_root`, and
    /// where sysfs is.
    posture_paths: crate::posture::Paths,
    runtime: Option<(Timestamp, RuntimeStatus)>,
    runtime_refresh: Duration,
    cgroups: HashMap<u32, Option<ContainerRef>>,
    metrics: Arc<Metrics>,
    /// KAI-Scheduler's binds of fraction pods on this node, as last read.
    kai: KaiBinds,
    /// What was wrong with the CDI specs at the last sweep that read them.
    cdi_problems: Vec<String>,
    /// The VFIO devices among the kubelet's allocatable ones, read with them.
    vfio: VfioInventory,
}

impl Sweeper {
    /// A sweeper over `backend`; `host_root` is where the host's `/` (or at least its `/proc`
    /// and `/etc`) is visible.
    pub fn new(
        backend: Arc<dyn GpuBackend>,
        allocations: AllocationSource,
        host_root: &Path,
        runtime_refresh: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            backend,
            health: HealthTracker::new(),
            allocations,
            kubelet: None,
            last_list: Vec::new(),
            allocatable: None,
            last_kubelet_error: None,
            proc_root: host_root.join("proc"),
            host_root: host_root.to_path_buf(),
            runtime_report: None,
            posture_paths: crate::posture::Paths::default(),
            runtime: None,
            runtime_refresh,
            cgroups: HashMap::new(),
            metrics,
            kai: KaiBinds::default(),
            cdi_problems: Vec::new(),
            vfio: VfioInventory::default(),
        }
    }

    /// Reads the NVIDIA runtime's configuration from `report` (written by
    /// [`crate::runtime::report_loop`] in another container) instead of under the host root.
    pub fn with_runtime_report(mut self, report: Option<PathBuf>) -> Self {
        self.runtime_report = report;
        self
    }

    /// Where the toolkit's and the CRI's configs are, when they are read under the host root
    /// (no runtime report), and where sysfs is.
    pub fn with_posture_paths(mut self, paths: crate::posture::Paths) -> Self {
        self.posture_paths = paths;
        self
    }

    /// KAI-Scheduler's binds of fraction pods on this node, for the sweeps to come
    /// ([`crate::kai`]).
    pub fn set_kai_binds(&mut self, binds: KaiBinds) {
        self.kai = binds;
    }

    /// Health so far.
    pub fn health(&self) -> &HealthTracker {
        &self.health
    }

    /// Carries health over from a status written before a restart.
    pub fn restore_health(&mut self, gpus: &[gpuwarden_crds::GpuStatus], now: Timestamp) {
        self.health.restore(gpus, now);
    }

    /// One full sweep at `now`. `pods` are the pods on the node; `authoritative` when they
    /// come from the API.
    pub async fn sweep(
        &mut self,
        now: Timestamp,
        pods: &[PodInfo],
        authoritative: bool,
        rules: &HealthRules,
    ) -> Result<Computed, AgentError> {
        for event in self.backend.take_events(now) {
            self.health.observe_event(&event, rules);
        }
        let started = Instant::now();
        let read = self.backend.read(now).await;
        self.metrics
            .nvml_call_seconds
            .get_or_create(&CallLabels {
                call: "read".into(),
            })
            .observe(started.elapsed().as_secs_f64());
        let reading = read.inspect_err(|_| self.metrics.error(ErrorSource::nvml))?;
        for gpu in &reading.gpus {
            self.health.observe_reading(gpu, now, rules);
        }

        let devices = DeviceMap::new(&reading.gpus);
        let list = self.list_allocations().await?;
        let allocations = gpu_allocations(list, &devices);
        let claims = claim_uses(list);
        self.check_allocatable(now, &devices).await;
        let vfio_holds = crate::vfio::holds(self.last_allocations(), &self.vfio);
        let cdi = self.read_cdi(&claims);

        let mut observed = Vec::new();
        let mut live = HashMap::with_capacity(self.cgroups.len());
        for gpu in &reading.gpus {
            for p in &gpu.processes {
                let container = match &p.cgroup {
                    Some(text) => cgroup::parse(text),
                    None => match self.cgroups.get(&p.pid) {
                        Some(cached) => cached.clone(),
                        None => match cgroup::read_process_cgroup(&self.proc_root, p.pid) {
                            Ok(Some(text)) => cgroup::parse(&text),
                            Ok(None) => continue, // exited since NVML listed it
                            Err(e) => {
                                self.metrics.error(ErrorSource::proc);
                                tracing::debug!(pid = p.pid, error = %e, "cannot attribute GPU process");
                                continue;
                            }
                        },
                    },
                };
                live.insert(p.pid, container.clone());
                observed.push(ObservedProcess {
                    device_uuid: p.device_uuid.clone(),
                    pid: p.pid,
                    container,
                    used_memory_bytes: p.used_memory_bytes,
                    sm_util_percent: p.sm_util_percent,
                });
            }
        }
        // Only PIDs still on a GPU stay cached, so a reused PID is read afresh.
        self.cgroups = live;

        let mut runtime = self.runtime_status(now);
        crate::posture::from_pods(&mut runtime, pods);
        let index = PodIndex::new(pods, authoritative);
        let computed = crate::status::compute(&StatusInput {
            reading: &reading,
            health: &self.health,
            allocations: &allocations,
            observed: &observed,
            pods: &index,
            devices: &devices,
            runtime: &runtime,
            kai: &self.kai,
            claims: &claims,
            cdi: &cdi,
            vfio: &self.vfio,
            vfio_holds: &vfio_holds,
        });
        self.metrics.update(&reading, &self.health, &computed);
        Ok(computed)
    }

    /// The runtime's configuration and the node's posture: read under the host root, or
    /// from the runtime-report container's report, at most every `runtime_refresh`.
    fn runtime_status(&mut self, now: Timestamp) -> RuntimeStatus {
        match &self.runtime {
            Some((at, r)) if elapsed(*at, now) < self.runtime_refresh => r.clone(),
            _ => match &self.runtime_report {
                None => {
                    let r = crate::runtime::read_runtime(&self.host_root, &self.posture_paths);
                    self.runtime = Some((now, r.clone()));
                    r
                }
                Some(report) => match crate::runtime::status_from_report(report) {
                    Ok(r) => {
                        self.runtime = Some((now, r.clone()));
                        r
                    }
                    // Both containers start together: a report not written yet is read
                    // again at the next sweep, not after the whole refresh interval.
                    Err(r) => {
                        self.runtime = None;
                        *r
                    }
                },
            },
        }
    }

    /// The CDI specs on the node, read when a container uses a claim (docs/design.md, "What
    /// a claim's CDI spec hands out"). Specs that cannot be read, and CDI devices the kubelet
    /// names that no spec defines, are logged when they change and counted as errors.
    fn read_cdi(&mut self, claims: &[ClaimUse]) -> CdiDevices {
        if claims.iter().all(|c| c.cdi_devices.is_empty()) {
            self.cdi_problems.clear();
            return CdiDevices::default();
        }
        let cdi = CdiDevices::read(&self.host_root);
        let mut problems = cdi.problems.clone();
        for claim in claims {
            let undefined: Vec<&str> = (claim.cdi_devices.iter())
                .filter(|name| cdi.nodes(name).is_none())
                .map(String::as_str)
                .collect();
            if !undefined.is_empty() {
                problems.push(format!(
                    "claim {} of {}/{} names CDI devices no spec in {} defines, so what \
                     they hand out is not judged: {}",
                    claim.claim,
                    claim.namespace,
                    claim.pod,
                    crate::cdi::CLAIM_SPEC_DIR,
                    undefined.join(", ")
                ));
            }
        }
        if !problems.is_empty() {
            self.metrics.error(ErrorSource::cdi);
        }
        if problems != self.cdi_problems {
            for problem in &problems {
                warn!(%problem, "CDI specs");
            }
            self.cdi_problems = problems;
        }
        cdi
    }

    async fn list_allocations(&mut self) -> Result<&[PodResources], AgentError> {
        let (socket, timeouts, strict) = match &self.allocations {
            AllocationSource::None => return Ok(&[]),
            AllocationSource::Static(list) => return Ok(list),
            AllocationSource::Kubelet {
                socket,
                timeouts,
                strict,
            } => (socket.clone(), *timeouts, *strict),
        };
        let result = match self.kubelet.as_mut() {
            Some(client) => client.list().await,
            None => match PodResourcesClient::connect(&socket, timeouts).await {
                Ok(client) => client_list(self.kubelet.insert(client)).await,
                Err(e) => Err(e),
            },
        };
        match result {
            Ok(list) => {
                if self.last_kubelet_error.take().is_some() {
                    info!("kubelet pod-resources answers again");
                }
                self.last_list = list;
            }
            Err(e) if strict => return Err(e.into()),
            Err(e) => {
                self.metrics.error(ErrorSource::pod_resources);
                if !matches!(e, PodResourcesError::RateLimited { .. }) {
                    self.kubelet = None;
                }
                let msg = e.to_string();
                if self.last_kubelet_error.as_deref() != Some(msg.as_str()) {
                    warn!(error = %msg, "keeping the last known allocations");
                    self.last_kubelet_error = Some(msg);
                }
            }
        }
        Ok(&self.last_list)
    }

    /// The allocations [`Self::list_allocations`] last gave, without asking again.
    fn last_allocations(&self) -> &[PodResources] {
        match &self.allocations {
            AllocationSource::None => &[],
            AllocationSource::Static(list) => list,
            AllocationSource::Kubelet { .. } => &self.last_list,
        }
    }

    /// Reads the IOMMU groups of the VFIO devices among `allocatable` under the sysfs root
    /// ([`crate::vfio`]). What could not be read is logged when it changes and counted as
    /// an error; the status says it per device (`vfio.unknown`).
    fn read_vfio(&mut self, allocatable: &[ContainerDevices]) {
        let inventory = VfioInventory::read(&self.posture_paths.sysfs_root, allocatable);
        if !inventory.unknown.is_empty() {
            self.metrics.error(ErrorSource::sysfs);
        }
        if inventory.unknown != self.vfio.unknown {
            for u in &inventory.unknown {
                warn!(resource = %u.resource_name, device = %u.device_id, problem = %u.reason,
                    "IOMMU group of an advertised device not known");
            }
        }
        if inventory.devices != self.vfio.devices {
            let shared = inventory.shared_groups();
            info!(
                devices = inventory.devices.len(),
                shared_groups = ?shared.keys().collect::<Vec<_>>(),
                sysfs = %self.posture_paths.sysfs_root.display(),
                "VFIO devices advertised by the kubelet"
            );
        }
        self.vfio = inventory;
    }
}

impl Sweeper {
    /// Asks the kubelet, now and then, which GPU devices it can allocate, and exports how
    /// many of them name a GPU on this node and how many name none (a device plugin that
    /// disagrees with NVML). The VFIO devices among them are read with each answer.
    async fn check_allocatable(&mut self, now: Timestamp, devices: &DeviceMap) {
        let due = self
            .allocatable
            .as_ref()
            .is_none_or(|(at, _)| elapsed(*at, now) >= self.runtime_refresh);
        if due && let Some(client) = self.kubelet.as_mut() {
            match client.allocatable().await {
                Ok(list) => {
                    self.read_vfio(&list);
                    self.allocatable = Some((now, list));
                }
                Err(e) => {
                    self.metrics.error(ErrorSource::pod_resources);
                    tracing::debug!(error = %e, "GetAllocatableResources failed");
                    // Asked again at the next refresh, not every sweep.
                    let old = self.allocatable.take().map(|(_, l)| l).unwrap_or_default();
                    self.allocatable = Some((now, old));
                }
            }
        }
        if let Some((_, list)) = &self.allocatable {
            let (known, unknown) = crate::podresources::allocatable_gpu_devices(list, devices);
            self.metrics.set_allocatable(known, unknown);
        }
    }
}

async fn client_list(
    client: &mut PodResourcesClient,
) -> Result<Vec<PodResources>, PodResourcesError> {
    client.list().await
}

fn elapsed(from: Timestamp, to: Timestamp) -> Duration {
    Duration::try_from(to.duration_since(from)).unwrap_or(Duration::ZERO)
}

/// The GPU backend a configuration asks for: the fake file, or NVML.
pub async fn backend(
    fake: Option<&Path>,
    start: Timestamp,
) -> Result<Arc<dyn GpuBackend>, BackendError> {
    Ok(match fake {
        Some(path) => Arc::new(FakeBackend::new(FakeNode::load(path)?, start)),
        None => Arc::new(NvmlBackend::start().await?),
    })
}

/// Settings of `run`.
#[derive(Clone, Debug)]
pub struct Config {
    /// This node's name.
    pub node_name: String,
    /// gpuwarden's namespace, where the agent's Lease lives (the pod's own, from the downward
    /// API).
    pub namespace: String,
    /// Fake GPU file instead of NVML.
    pub fake: Option<PathBuf>,
    /// Kubelet pod-resources socket.
    pub pod_resources_socket: PathBuf,
    /// Where the host's filesystem is visible (`/` or `/host`).
    pub host_root: PathBuf,
    /// Read the NVIDIA runtime's configuration from this report instead of under `host_root`.
    pub runtime_report: Option<PathBuf>,
    /// Where the toolkit's and the CRI's configs are, when read under `host_root`, and
    /// where sysfs is (`--sysfs-root`).
    pub posture_paths: crate::posture::Paths,
    /// Metrics and probes listener.
    pub listen: SocketAddr,
    /// Time between sweeps.
    pub poll_interval: Duration,
    /// Time between checks of the server's copy of the status (and of the runtime config).
    pub resync_interval: Duration,
    /// Kubelet timeouts.
    pub pod_resources_timeouts: Timeouts,
}

impl Config {
    /// Defaults for `node_name`.
    pub fn new(node_name: &str) -> Self {
        Self {
            node_name: node_name.to_owned(),
            namespace: gpuwarden_crds::SYSTEM_NAMESPACE.to_owned(),
            fake: None,
            pod_resources_socket: PathBuf::from(crate::podresources::DEFAULT_SOCKET),
            host_root: PathBuf::from("/"),
            runtime_report: None,
            posture_paths: crate::posture::Paths::default(),
            listen: SocketAddr::from(([0, 0, 0, 0], gpuwarden_crds::install::NODE_AGENT_PORT)),
            poll_interval: Duration::from_secs(10),
            resync_interval: Duration::from_secs(600),
            pod_resources_timeouts: Timeouts::default(),
        }
    }
}

/// Runs the agent until `shutdown` completes.
pub async fn run(
    config: Config,
    client: kube::Client,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), AgentError> {
    let node = config.node_name.clone();
    run_inner(config, client, shutdown)
        .instrument(info_span!("node_agent", node = %node))
        .await
}

async fn run_inner(
    config: Config,
    client: kube::Client,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), AgentError> {
    check_config(&config)?;
    let mut agent = Agent::start(&config, client).await?;
    let mut tick = tokio::time::interval(config.poll_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tick.tick() => {}
        }
        agent.step().await;
    }
    info!("shutting down");
    agent.stop().await;
    Ok(())
}

/// Refuses intervals of zero and an empty node name.
fn check_config(config: &Config) -> Result<(), AgentError> {
    if config.poll_interval.is_zero() || config.resync_interval.is_zero() {
        return Err(AgentError::Config(
            "poll and resync intervals must be longer than zero",
        ));
    }
    if config.node_name.is_empty() {
        return Err(AgentError::Config("the node name is empty"));
    }
    Ok(())
}

/// The running agent: its servers and background tasks, the caches it reads the cluster
/// from, and the sweeper and writer each step drives.
struct Agent {
    node: String,
    clock: SystemClock,
    metrics: Arc<Metrics>,
    /// What the readiness probe answers.
    ready: Arc<AtomicBool>,
    caches: Caches,
    client: kube::Client,
    /// KAI-Scheduler's BindRequests for this node, once a policy names KAI.
    bind_requests: Option<Store<DynamicObject>>,
    /// The health rules of the last step, to log when they change.
    last_rules: Option<HealthRules>,
    sweeper: Sweeper,
    writer: StatusWriter<KubeSink>,
    stop: tokio::sync::watch::Sender<bool>,
    lease: tokio::task::JoinHandle<()>,
    http: tokio::task::JoinHandle<()>,
}

impl Agent {
    /// Starts the GPU backend, the metrics server, the watches and the Lease, and carries
    /// health over from the status written before a restart.
    async fn start(config: &Config, client: kube::Client) -> Result<Self, AgentError> {
        let clock = SystemClock;
        let node = config.node_name.clone();
        let metrics = Arc::new(Metrics::for_node(&node));
        let ready = Arc::new(AtomicBool::new(false));
        let backend = backend(config.fake.as_deref(), clock.now()).await?;
        info!(backend = backend.name(), "GPU backend ready");
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let http = serve(
            config.listen,
            metrics.clone(),
            ready.clone(),
            stop_rx.clone(),
        )
        .await?;
        let caches = Caches::watch(&client, &node);
        let lease = keep_lease(client.clone(), config, metrics.clone(), stop_rx);
        let mut sweeper = sweeper(config, backend, metrics.clone());
        let mut writer = StatusWriter::new(
            KubeSink::new(client.clone(), &node),
            MIN_WRITE_INTERVAL,
            config.resync_interval,
        );
        restore_previous(&mut sweeper, &mut writer, &clock).await;
        Ok(Self {
            node,
            clock,
            metrics,
            ready,
            caches,
            client,
            bind_requests: None,
            last_rules: None,
            sweeper,
            writer,
            stop,
            lease,
            http,
        })
    }

    /// One sweep over what the caches hold now, written when the caches have synced.
    async fn step(&mut self) {
        let started = Instant::now();
        let now = self.clock.now();
        let synced = self.caches.synced();
        let policy_list = self.caches.policies.state();
        let pods = self.caches.pod_infos(&policy_list);
        let labels = self.caches.node_labels();
        let policies: Vec<&GpuPolicy> = policy_list.iter().map(|p| p.as_ref()).collect();
        self.follow_kai(&policies);
        let rules = self.health_rules(&policies, &labels);
        let computed = match self.sweeper.sweep(now, &pods, synced, &rules).await {
            Ok(c) => c,
            Err(e) => {
                self.ready.store(false, Ordering::Relaxed);
                warn!(error = %error_chain(&e), "sweep failed");
                return;
            }
        };
        self.ready.store(synced, Ordering::Relaxed);
        if synced {
            self.write(now, &computed.status).await;
        }
        (self.metrics.sweep_seconds).observe(started.elapsed().as_secs_f64());
    }

    /// Watches KAI's BindRequests once a policy names KAI (other clusters have no such kind
    /// to watch), and gives the sweeper the binds they hold.
    fn follow_kai(&mut self, policies: &[&GpuPolicy]) {
        if self.bind_requests.is_none()
            && (policies.iter())
                .any(|p| p.spec.gpu.sharing.as_ref().is_some_and(|s| s.kai.is_some()))
        {
            info!("a GpuPolicy names KAI-Scheduler: watching its BindRequests for this node");
            self.bind_requests = Some(reflect_bind_requests(self.client.clone(), &self.node));
        }
        if let Some(store) = &self.bind_requests {
            let requests = store.state();
            self.sweeper.set_kai_binds(KaiBinds::from_requests(
                requests.iter().map(|r| r.as_ref()),
                &self.node,
            ));
        }
    }

    /// The health rules of the policy that governs this node, logged when they change.
    fn health_rules(
        &mut self,
        policies: &[&GpuPolicy],
        labels: &BTreeMap<String, String>,
    ) -> HealthRules {
        let rules = crate::policy::health_rules(policies, labels);
        if self.last_rules.as_ref() != Some(&rules) {
            info!(policy = %rules.policy, ignored_xids = ?rules.ignored_xids,
                recover_after = ?rules.recover_after, "health rules");
            self.last_rules = Some(rules.clone());
        }
        rules
    }

    /// Writes the status when the writer says it is due; counts and logs what happened.
    async fn write(&mut self, now: Timestamp, status: &GpuNodeStatus) {
        match self.writer.tick(now, status).await {
            Ok(Outcome::Written) => {
                self.metrics.status_writes.inc();
                let (gpus, healthy, oob) = crate::status::counts(status);
                info!(gpus, healthy, out_of_band = oob, "GpuNode status written");
            }
            Ok(_) => {}
            Err(e) => {
                self.metrics.error(ErrorSource::status);
                warn!(error = %error_chain(&e), "status write failed");
            }
        }
    }

    /// Stops the Lease and the metrics server, and waits for them.
    async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.lease.await;
        let _ = self.http.await;
    }
}

/// Serves metrics and probes on `listen` until `stop`.
async fn serve(
    listen: SocketAddr,
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>, AgentError> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| AgentError::Listen {
            addr: listen,
            source,
        })?;
    let app = crate::http::router(metrics, ready);
    Ok(tokio::spawn(
        async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await;
            if let Err(e) = served {
                warn!(error = %e, "metrics server stopped");
            }
        }
        .in_current_span(),
    ))
}

/// Renews this node's Lease every [`RENEW_INTERVAL`] until `stop`.
fn keep_lease(
    client: kube::Client,
    config: &Config,
    metrics: Arc<Metrics>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let lease = LeaseKeeper::new(
        client,
        &config.namespace,
        &config.node_name,
        SystemClock.now(),
    );
    tokio::spawn(
        async move {
            let mut tick = tokio::time::interval(RENEW_INTERVAL);
            loop {
                tokio::select! {
                    _ = stop.wait_for(|s| *s) => break,
                    _ = tick.tick() => {}
                }
                if let Err(e) = lease.renew(SystemClock.now()).await {
                    metrics.error(ErrorSource::lease);
                    warn!(error = %error_chain(&e), "lease renewal failed");
                }
            }
        }
        .in_current_span(),
    )
}

/// The sweeper `run` drives: allocations from the kubelet, retried when it fails.
fn sweeper(config: &Config, backend: Arc<dyn GpuBackend>, metrics: Arc<Metrics>) -> Sweeper {
    Sweeper::new(
        backend,
        AllocationSource::Kubelet {
            socket: config.pod_resources_socket.clone(),
            timeouts: config.pod_resources_timeouts,
            strict: false,
        },
        &config.host_root,
        config.resync_interval,
        metrics,
    )
    .with_runtime_report(config.runtime_report.clone())
    .with_posture_paths(config.posture_paths.clone())
}

/// Carries over what this agent wrote before a restart: health that events no longer show.
async fn restore_previous(
    sweeper: &mut Sweeper,
    writer: &mut StatusWriter<KubeSink>,
    clock: &impl Clock,
) {
    match tokio::time::timeout(Duration::from_secs(10), writer.sink().current()).await {
        Ok(Ok(previous)) => {
            let now = clock.now();
            if let Some(gpus) = &previous.gpus {
                sweeper.restore_health(gpus, now);
                writer.assume_applied(&previous, now);
            }
        }
        Ok(Err(e)) => {
            info!(error = %error_chain(&e), "no previous status to carry health over from")
        }
        Err(_) => info!("reading the previous status timed out; health starts fresh"),
    }
}

/// The caches of this node's pods, the policies, this node and the namespaces' labels,
/// fed by watches in the background.
struct Caches {
    pods: Store<Pod>,
    policies: Store<GpuPolicy>,
    nodes: Store<Node>,
    namespaces: Store<PartialObjectMeta<Namespace>>,
    /// Set once every cache has synced.
    synced: Arc<AtomicBool>,
}

impl Caches {
    /// Starts the watches, and a task that sets `synced` once all four caches are ready.
    fn watch(client: &kube::Client, node: &str) -> Self {
        // Only this node's pods: never a cluster-wide pod watch.
        let pods = reflect(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default().fields(&format!("spec.nodeName={node}")),
        );
        let policies = reflect(
            Api::<GpuPolicy>::all(client.clone()),
            watcher::Config::default(),
        );
        let nodes = reflect(
            Api::<Node>::all(client.clone()),
            watcher::Config::default().fields(&format!("metadata.name={node}")),
        );
        // Namespace labels choose the policy that governs a pod, as in the webhook; only the
        // metadata is watched.
        let namespaces = reflect(
            Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
            watcher::Config::default(),
        );
        let caches = Self {
            pods,
            policies,
            nodes,
            namespaces,
            synced: Arc::new(AtomicBool::new(false)),
        };
        caches.flag_when_synced();
        caches
    }

    fn flag_when_synced(&self) {
        let (pods, policies, nodes, namespaces, flag) = (
            self.pods.clone(),
            self.policies.clone(),
            self.nodes.clone(),
            self.namespaces.clone(),
            self.synced.clone(),
        );
        tokio::spawn(
            async move {
                let ok = pods.wait_until_ready().await.is_ok()
                    && policies.wait_until_ready().await.is_ok()
                    && nodes.wait_until_ready().await.is_ok()
                    && namespaces.wait_until_ready().await.is_ok();
                flag.store(ok, Ordering::Relaxed);
                if ok {
                    info!("pod, policy, node and namespace caches synced");
                }
            }
            .in_current_span(),
        );
    }

    fn synced(&self) -> bool {
        self.synced.load(Ordering::Relaxed)
    }

    /// The pods on this node, each with the policy that governs it under its namespace's
    /// labels.
    fn pod_infos(&self, policies: &[Arc<GpuPolicy>]) -> Vec<PodInfo> {
        (self.pods.state().iter())
            .filter_map(|p| {
                let namespace = p.metadata.namespace.as_deref().unwrap_or_default();
                let labels = (self.namespaces)
                    .get(&reflector::ObjectRef::new(namespace))
                    .map(|ns| ns.metadata.labels.clone().unwrap_or_default());
                PodInfo::from_pod(p, policies, labels)
            })
            .collect()
    }

    /// This node's labels.
    fn node_labels(&self) -> BTreeMap<String, String> {
        (self.nodes.state().first())
            .and_then(|n| n.meta().labels.clone())
            .unwrap_or_default()
    }
}

/// A reflector store fed by a watch with `config`, in the background.
fn reflect<K>(api: Api<K>, config: watcher::Config) -> Store<K>
where
    K: kube::Resource
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
{
    reflect_with(api, config, K::DynamicType::default())
}

/// A reflector store of KAI-Scheduler's BindRequests for `node` (its scheduler labels them
/// with the node). Where KAI's kind is not installed the watch keeps failing with a
/// backoff, and no pod is bound.
fn reflect_bind_requests(client: kube::Client, node: &str) -> Store<DynamicObject> {
    let resource = crate::kai::bind_request_resource();
    let config = watcher::Config::default().labels(&format!(
        "{}={node}",
        gpuwarden_crds::sharing::bind_request::NODE_LABEL
    ));
    reflect_with(
        Api::<DynamicObject>::all_with(client, &resource),
        config,
        resource,
    )
}

/// [`reflect`], for a kind known at run time (`dyntype`).
fn reflect_with<K>(api: Api<K>, config: watcher::Config, dyntype: K::DynamicType) -> Store<K>
where
    K: kube::Resource
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
{
    let kind = K::kind(&dyntype).into_owned();
    let writer = reflector::store::Writer::new(dyntype);
    let store = writer.as_reader();
    let stream = watcher(api, config)
        .default_backoff()
        .modify(|obj: &mut K| {
            // Managed fields are the bulk of a Pod and of no use here.
            obj.meta_mut().managed_fields = None;
        })
        .reflect(writer)
        .touched_objects();
    tokio::spawn(
        async move {
            futures::pin_mut!(stream);
            while let Some(item) = stream.next().await {
                if let Err(e) = item {
                    warn!(%kind, error = %e, "watch error");
                }
            }
        }
        .in_current_span(),
    );
    store
}

/// Settings of `inspect`.
#[derive(Clone, Debug, Default)]
pub struct InspectConfig {
    /// Node name written in the output.
    pub node_name: String,
    /// Fake GPU file instead of NVML.
    pub fake: Option<PathBuf>,
    /// Kubelet socket to read bindings from.
    pub pod_resources_socket: Option<PathBuf>,
    /// Host root for `/proc` and the runtime config.
    pub host_root: PathBuf,
    /// Where the toolkit's and the CRI's configs are under `host_root`, and where sysfs is.
    pub posture_paths: crate::posture::Paths,
}

/// One sweep without a cluster: the status the agent would apply, with its pods taken from
/// the fake file when there is one.
pub async fn inspect(config: &InspectConfig) -> Result<GpuNodeStatus, AgentError> {
    let now = Timestamp::now();
    let fake = config.fake.as_deref().map(FakeNode::load).transpose()?;
    let backend: Arc<dyn GpuBackend> = match &fake {
        Some(node) => Arc::new(FakeBackend::new(node.clone(), now)),
        None => Arc::new(NvmlBackend::start().await?),
    };
    let allocations = match (&config.pod_resources_socket, &fake) {
        (Some(socket), _) => AllocationSource::Kubelet {
            socket: socket.clone(),
            timeouts: Timeouts::default(),
            strict: true,
        },
        (None, Some(node)) => AllocationSource::Static(node.pod_resources_list()),
        (None, None) => AllocationSource::None,
    };
    // No cluster, so no GpuPolicies or Namespaces: the built-in default policy governs
    // every pod.
    let default_policy = [Arc::new(GpuPolicy::default_policy())];
    let pods: Vec<PodInfo> = fake
        .as_ref()
        .map(FakeNode::pod_infos)
        .unwrap_or_default()
        .into_iter()
        .map(|p| p.exempt_by(&default_policy, None))
        .collect();
    let mut sweeper = Sweeper::new(
        backend,
        allocations,
        &config.host_root,
        Duration::from_secs(600),
        Arc::new(Metrics::new()),
    )
    .with_posture_paths(config.posture_paths.clone());
    let computed = sweeper
        .sweep(now, &pods, false, &HealthRules::default())
        .await?;
    Ok(computed.status)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::podresources::{ContainerResources, PodResources};
    use crate::pods::ContainerInfo;
    use crate::testing::sandbox::{self, A6000, AUDIO, AUDIO_FN, GPU};
    use crate::testing::{FakeKubelet, FakeKubeletServer};
    use gpuwarden_crds::BindingSource;

    /// KubeVirt's launcher pod `vms/<name>` and what the kubelet allocated it: vm-a the
    /// A6000, any other the A6000's audio function.
    fn launcher(name: &str) -> (PodInfo, PodResources) {
        let (resource, id) = match name {
            "vm-a" => (A6000, GPU),
            _ => (AUDIO, AUDIO_FN),
        };
        let info = PodInfo {
            uid: format!("u-{name}"),
            namespace: "vms".into(),
            name: name.into(),
            mirror_uid: None,
            service_account: String::new(),
            labels: Default::default(),
            exempt: None,
            claims_exempt: None,
            kai: None,
            injected: Vec::new(),
            containers: vec![ContainerInfo {
                name: "compute".into(),
                image: String::new(),
                container_id: None,
                privileged: false,
                gpu: false,
            }],
        };
        let listed = PodResources {
            name: name.into(),
            namespace: "vms".into(),
            containers: vec![ContainerResources {
                name: "compute".into(),
                devices: vec![ContainerDevices {
                    resource_name: resource.into(),
                    device_ids: vec![id.into()],
                }],
                ..ContainerResources::default()
            }],
        };
        (info, listed)
    }

    /// The agent asks the kubelet what it can allocate, reads those devices' groups under
    /// `--sysfs-root`, and names the group each VM was allocated a function of.
    #[tokio::test]
    async fn a_sweep_reads_the_advertised_vfio_devices_under_the_sysfs_root() {
        let sysfs = tempfile::tempdir().unwrap();
        sandbox::write_sysfs(sysfs.path()).unwrap();
        let (a, a_listed) = launcher("vm-a");
        let (b, b_listed) = launcher("vm-b");
        let sock = tempfile::tempdir().unwrap();
        let server = FakeKubeletServer::start(
            &sock.path().join("kubelet.sock"),
            FakeKubelet {
                pods: vec![a_listed, b_listed],
                allocatable: sandbox::allocatable(),
                ..FakeKubelet::default()
            },
        )
        .await
        .unwrap();
        let now = Timestamp::from_second(1_800_000_000).unwrap();
        let node = FakeNode::parse("driver: {driverVersion: x}", "test").unwrap();
        let paths = crate::posture::Paths {
            sysfs_root: sysfs.path().to_path_buf(),
            ..crate::posture::Paths::default()
        };
        let host = tempfile::tempdir().unwrap();
        let mut sweeper = Sweeper::new(
            Arc::new(FakeBackend::new(node, now)),
            AllocationSource::Kubelet {
                socket: server.socket().to_path_buf(),
                timeouts: Timeouts::default(),
                strict: true,
            },
            host.path(),
            Duration::from_secs(600),
            Arc::new(Metrics::new()),
        )
        .with_posture_paths(paths);
        let status = sweeper
            .sweep(now, &[a, b], true, &HealthRules::default())
            .await
            .unwrap()
            .status;
        server.stop().await;

        let vfio = status.vfio.expect("VFIO-backed resources");
        assert_eq!(vfio.resources.len(), 3, "{vfio:#?}");
        assert_eq!(vfio.shared_groups.len(), 1);
        assert_eq!(vfio.unknown, []);
        let bindings = status.bindings.unwrap_or_default();
        let held: Vec<(&str, BindingSource, u32, usize)> = (bindings.iter())
            .map(|b| {
                let group = &b.iommu_groups[0];
                (b.pod.as_str(), b.source, group.group, group.others.len())
            })
            .collect();
        assert_eq!(
            held,
            [
                ("vm-a", BindingSource::IommuGroup, 13, 1),
                ("vm-b", BindingSource::IommuGroup, 13, 1),
            ]
        );
    }
}
