//! gpuwarden's operator and node agent run inside the test process, against the cluster the
//! tests drive: the operator without leader election or certificate management, the agent
//! for one node.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use gpuwarden_crds::{Binding, GpuNode};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::Api;

use crate::cluster::{skip, wait_for};
use crate::env::Env;
use crate::node::{NEEDS_GPU_NODE, gpu_node};

/// A sender, and the shutdown future it resolves.
pub fn stoppable() -> (
    oneshot::Sender<()>,
    impl Future<Output = ()> + Send + 'static,
) {
    let (tx, rx) = oneshot::channel::<()>();
    (tx, async move {
        let _ = rx.await;
    })
}

/// Runs the operator in-process (no leader election, certificates left alone) until the
/// returned sender fires.
pub fn start_operator(env: &Env) -> (oneshot::Sender<()>, JoinHandle<()>) {
    start_operator_with(env, |_| {})
}

/// [`start_operator`], with its configuration as `edit` leaves it.
pub fn start_operator_with(
    env: &Env,
    edit: impl FnOnce(&mut gpuwarden_operator::Config),
) -> (oneshot::Sender<()>, JoinHandle<()>) {
    let mut config = gpuwarden_operator::Config::new(gpuwarden_crds::SYSTEM_NAMESPACE);
    config.leader_election = false;
    config.manage_webhook_certificates = false;
    config.health_listen = SocketAddr::from(([127, 0, 0, 1], 0));
    edit(&mut config);
    let (tx, shutdown) = stoppable();
    let client = env.client();
    let task = tokio::spawn(async move {
        if let Err(e) = gpuwarden_operator::run(config, client, shutdown).await {
            eprintln!("operator stopped: {e}");
        }
    });
    (tx, task)
}

/// Runs the node agent in-process for the real `node`: real NVML, the kubelet's own
/// pod-resources socket, the host's /proc. Returns its metrics address.
pub fn start_real_agent(
    env: &Env,
    node: &str,
) -> (oneshot::Sender<()>, JoinHandle<()>, SocketAddr) {
    // A free port for the metrics, known before the agent binds it.
    let listen = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let mut config = gpuwarden_node_agent::Config::new(node);
    config.listen = listen;
    // A test node may keep its containerd and toolkit configs elsewhere (the rig's do).
    let list = |var: &str| -> Vec<String> {
        (std::env::var(var).unwrap_or_default().split(','))
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    };
    config.posture_paths = gpuwarden_node_agent::posture::Paths::with_first(
        &list("GPUWARDEN_E2E_TOOLKIT_CONFIG"),
        &list("GPUWARDEN_E2E_CONTAINERD_CONFIG"),
    );
    // A VFIO plugin on a faked host reads its own sysfs (the rig's /tmp/vfio/fakesys).
    if let Some(root) = std::env::var_os("GPUWARDEN_SYSFS_ROOT").filter(|r| !r.is_empty()) {
        config.posture_paths.sysfs_root = root.into();
    }
    let (stop, task) = spawn_agent(env, config);
    (stop, task, listen)
}

/// Runs the node agent in-process with `config` (polling every 2 seconds) until the
/// returned sender fires.
pub fn spawn_agent(
    env: &Env,
    mut config: gpuwarden_node_agent::Config,
) -> (oneshot::Sender<()>, JoinHandle<()>) {
    config.poll_interval = Duration::from_secs(2);
    let (stop, shutdown) = stoppable();
    let client = env.client();
    let task = tokio::spawn(async move {
        if let Err(e) = gpuwarden_node_agent::run(config, client, shutdown).await {
            eprintln!("node agent stopped: {e}");
        }
    });
    (stop, task)
}

/// The operator and the node agent, in-process, for a real GPU node.
pub struct RealNode {
    /// The node's name.
    pub name: String,
    /// The agent's metrics address.
    metrics: SocketAddr,
    stop_operator: oneshot::Sender<()>,
    operator: JoinHandle<()>,
    stop_agent: oneshot::Sender<()>,
    agent: JoinHandle<()>,
}

impl RealNode {
    /// Picks the node with two allocatable GPUs ([`gpu_node`]) and starts the operator and
    /// its agent; `None`, with a `SKIPPED` line for `test`, where the cluster has no such
    /// node.
    pub async fn start(env: &Env, test: &str) -> Option<Self> {
        let node = gpu_node(&env.cluster)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let Some(name) = node.and_then(|n| n["metadata"]["name"].as_str().map(str::to_owned))
        else {
            skip(test, NEEDS_GPU_NODE);
            return None;
        };
        Some(Self::start_on(env, name).await)
    }

    /// Starts the operator and the agent of node `name`; its GpuNode is deleted with the
    /// test's other objects.
    pub async fn start_on(env: &Env, name: String) -> Self {
        env.system_namespace().await;
        env.cleanup
            .own_typed::<gpuwarden_crds::GpuNode>(None, &name);
        let (stop_operator, operator) = start_operator(env);
        let (stop_agent, agent, metrics) = start_real_agent(env, &name);
        Self {
            name,
            metrics,
            stop_operator,
            operator,
            stop_agent,
            agent,
        }
    }

    /// `GET /metrics` of the agent, as text (empty while it does not answer).
    pub async fn scrape(&self) -> String {
        scrape(self.metrics).await
    }

    /// The agent's `gpuwarden_gpu_holder_info` series of pod `ns/pod`, once there is one per
    /// UUID of `uuids` and each names its UUID (joinable on it); panics with the metrics
    /// after 30 seconds.
    pub async fn holder_series(&self, ns: &str, pod: &str, uuids: &[String]) -> Vec<String> {
        let wanted = |text: &str| -> Option<Vec<String>> {
            let lines: Vec<String> = (text.lines())
                .filter(|l| {
                    l.starts_with("gpuwarden_gpu_holder_info{")
                        && l.contains(&format!("pod=\"{pod}\""))
                        && l.contains(&format!("namespace=\"{ns}\""))
                })
                .map(str::to_owned)
                .collect();
            let each =
                (uuids.iter()).all(|u| lines.iter().any(|l| l.contains(&format!("UUID=\"{u}\""))));
            (lines.len() == uuids.len() && each).then_some(lines)
        };
        let series = crate::cluster::wait_for(Duration::from_secs(30), || async {
            wanted(&self.scrape().await)
        })
        .await;
        match series {
            Some(series) => series,
            None => panic!(
                "not one holder series per GPU {uuids:?} for {ns}/{pod}:\n{}",
                self.scrape().await
            ),
        }
    }

    /// Stops the agent, then the operator.
    pub async fn stop(self) {
        let _ = self.stop_agent.send(());
        let _ = self.agent.await;
        let _ = self.stop_operator.send(());
        let _ = self.operator.await;
    }
}

/// `GET /metrics` of an agent at `addr`, as text (empty while it does not answer).
async fn scrape(addr: SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return String::new();
    };
    let request = format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut body = String::new();
    let _ = stream.read_to_string(&mut body).await;
    body
}

/// The agent's GpuNode once it lists the node's GPUs.
pub async fn inventory(env: &Env, node: &str) -> GpuNode {
    let api: Api<GpuNode> = Api::all(env.client());
    wait_for(Duration::from_secs(90), || {
        let api = api.clone();
        async move {
            let gn = api.get_opt(node).await.ok().flatten()?;
            let listed = gn
                .status
                .as_ref()?
                .gpus
                .as_ref()
                .is_some_and(|g| !g.is_empty());
            listed.then_some(gn)
        }
    })
    .await
    .unwrap_or_else(|| panic!("the agent never listed the GPUs of {node}"))
}

/// The agent's binding of a pod's container, once `ready` holds for it.
pub async fn binding(
    env: &Env,
    node: &str,
    pod_uid: &str,
    container: &str,
    ready: impl Fn(&Binding) -> bool,
) -> Binding {
    let api: Api<GpuNode> = Api::all(env.client());
    let found = wait_for(Duration::from_secs(90), || {
        let api = api.clone();
        let ready = &ready;
        async move {
            let gn = api.get_opt(node).await.ok().flatten()?;
            (gn.status?.bindings?.into_iter())
                .find(|b| b.pod_uid == pod_uid && b.container == container && ready(b))
        }
    })
    .await;
    found.unwrap_or_else(|| {
        panic!("the GpuNode never listed the expected binding of {pod_uid} container {container}")
    })
}

/// The `Isolated` condition of GpuNode `node`, once its status is `status` (`"True"` or
/// `"False"`); `None` after 60 seconds.
pub async fn isolated(env: &Env, node: &str, status: &str) -> Option<Condition> {
    let api: Api<GpuNode> = Api::all(env.client());
    wait_for(Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let gn = api.get_opt(node).await.ok().flatten()?;
            let c = (gn.status?.conditions?.into_iter())
                .find(|c| c.type_ == gpuwarden_crds::condition_types::ISOLATED)?;
            (c.status == status).then_some(c)
        }
    })
    .await
}

/// The GPUs a container's device nodes are, by the minor numbers NVML reports, sorted.
pub fn device_uuids(gn: &GpuNode, seen: &crate::node::Seen) -> Vec<String> {
    let gpus = gn.status.as_ref().and_then(|s| s.gpus.as_ref());
    let by_path: std::collections::BTreeMap<String, &str> = (gpus.into_iter().flatten())
        .filter_map(|g| Some((format!("/dev/nvidia{}", g.minor_number?), g.uuid.as_str())))
        .collect();
    let mut uuids: Vec<String> = (seen.gpu_devices.iter())
        .map(|path| {
            by_path
                .get(path)
                .unwrap_or_else(|| panic!("{path} is no GPU NVML reports: {by_path:?}"))
                .to_string()
        })
        .collect();
    uuids.sort();
    uuids
}
