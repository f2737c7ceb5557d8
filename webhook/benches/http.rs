//! HTTPS benchmark of `POST /mutate` on loopback (`cargo bench -p gpuwarden-webhook --bench http`).
//!
//! Measures, over real TLS with keep-alive connections and a ~3 KB Pod CREATE review that
//! the default policy rewrites:
//! 1. the in-process server with the engine, and the same server stack with a constant
//!    allow (the floor): throughput and p50/p99 at a fixed concurrency, and p50/p99 at a
//!    fixed rate; the same two over one HTTP/2 connection with as many concurrent streams,
//!    the way the API server calls webhooks.
//! 2. the release binary `gpuwarden-webhook serve --policy-file deploy/policies/default.yaml`
//!    as a separate process: the same figures plus its resident memory (VmRSS) idle and
//!    under load.
//!
//! The client runs on the same machine and shares its cores with the server: on a 2-core
//! machine the figures are a lower bound on what the server alone can do. Because the
//! machine's speed drifts between runs, the engine and the floor are measured in alternating
//! rounds, over HTTP/1.1 and then over HTTP/2 in each round, and compared round by round
//! (a round with failed requests is left out, and the summary says so); each round also
//! reports the CPU time the whole process (client and server) spent per request.
//!
//! Environment: `BENCH_SECONDS` (default 5) per measurement, `BENCH_ROUNDS` (3) alternating
//! engine/floor rounds, `BENCH_CONCURRENCY` (32), `BENCH_RATE` (500 req/s),
//! `BENCH_BREAKDOWN=1` adds reviewers that split the engine's cost: the floor answering
//! with the engine's (larger) response, the engine answering with the floor's, and the floor
//! plus plain arithmetic that takes as long as the engine in a tight loop (an engine as slow
//! as ours with no cache footprint), each against a fresh floor run; and it times `review`
//! itself inside the loaded server, beside its time in a tight loop.
//!
//! `BENCH_REQUESTS=N` with `BENCH_REVIEWER=engine|floor` instead sends N requests (rounded
//! up to a whole number per connection) to that one reviewer over `BENCH_CONCURRENCY`
//! connections and exits, without timing loops: a fixed amount of work for a cache
//! simulator. Run it at two values of N and subtract, so that start-up (key generation,
//! handshakes) cancels out, e.g.
//! `valgrind --tool=callgrind --cache-sim=yes --I1=32768,8,64 --D1=32768,8,64
//! --LL=524288,8,64` (this machine's L1 and per-core L2) on the bench executable.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use gpuwarden_webhook::admission::{PolicySource, ReviewSummary};
use gpuwarden_webhook::cache::{StaticPolicySource, SyncFlag};
use gpuwarden_webhook::metrics::Metrics;
use gpuwarden_webhook::server::{EngineReviewer, Limits, Reviewer, Webhook, shutdown_channel};
use gpuwarden_webhook::tls::{CertReloader, CertStore, TlsPaths};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use rustls_pki_types::pem::PemObject;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tokio_rustls::TlsConnector;

/// The binary's allocator, so that the bench measures what runs in production.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

type Sender = SendRequest<Full<Bytes>>;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A privileged training pod that asks for all GPUs through the environment and mounts two
/// GPUs' device nodes: the default policy rewrites it (privilege, capabilities, GPU limit,
/// env, device hostPaths). The whole host `/dev` would be denied instead (an unprivileged
/// container cannot open it), which measures another path.
fn review_body() -> Bytes {
    let env: Vec<serde_json::Value> = [
        ("NVIDIA_VISIBLE_DEVICES", "all"),
        ("NVIDIA_DRIVER_CAPABILITIES", "all"),
        ("NCCL_DEBUG", "INFO"),
        ("NCCL_SOCKET_IFNAME", "eth0"),
        ("OMP_NUM_THREADS", "8"),
        (
            "MASTER_ADDR",
            "llama-finetune-0.llama-finetune.ml-research.svc",
        ),
        ("MASTER_PORT", "29500"),
        ("WANDB_PROJECT", "llama-finetune"),
        ("HF_HOME", "/cache/huggingface"),
    ]
    .iter()
    .map(|(k, v)| serde_json::json!({"name": k, "value": v}))
    .collect();
    let review = serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "llama-finetune-0",
            "namespace": "ml-research",
            "operation": "CREATE",
            "userInfo": {
                "username": "system:serviceaccount:kube-system:statefulset-controller",
                "uid": "8f3b2a51-0b7a-4c55-9d8e-3f2d7f0b8a11",
                "groups": ["system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"]
            },
            "object": {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": "llama-finetune-0",
                    "namespace": "ml-research",
                    "labels": {
                        "app.kubernetes.io/name": "llama-finetune",
                        "app.kubernetes.io/component": "trainer",
                        "statefulset.kubernetes.io/pod-name": "llama-finetune-0",
                        "controller-revision-hash": "llama-finetune-6d9f8c7b5"
                    },
                    "annotations": {
                        "kubectl.kubernetes.io/default-container": "trainer",
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": "9090"
                    },
                    "ownerReferences": [{
                        "apiVersion": "apps/v1", "kind": "StatefulSet", "name": "llama-finetune",
                        "uid": "0d1c2b3a-4f5e-6d7c-8b9a-0f1e2d3c4b5a", "controller": true, "blockOwnerDeletion": true
                    }]
                },
                "spec": {
                    "serviceAccountName": "trainer",
                    "restartPolicy": "Always",
                    "terminationGracePeriodSeconds": 60,
                    "nodeSelector": {"nvidia.com/gpu.present": "true"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [{
                        "name": "trainer",
                        "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                        "command": ["torchrun", "--nproc_per_node=8", "train.py", "--config", "/config/llama-7b.yaml"],
                        "env": env,
                        "ports": [{"containerPort": 29500, "name": "rendezvous"}, {"containerPort": 9090, "name": "metrics"}],
                        "resources": {"requests": {"cpu": "16", "memory": "128Gi"}, "limits": {"memory": "128Gi"}},
                        "securityContext": {"privileged": true},
                        "volumeMounts": [
                            {"name": "nvidia0", "mountPath": "/dev/nvidia0"},
                            {"name": "nvidia1", "mountPath": "/dev/nvidia1"},
                            {"name": "dshm", "mountPath": "/dev/shm"},
                            {"name": "cache", "mountPath": "/cache"},
                            {"name": "config", "mountPath": "/config", "readOnly": true}
                        ]
                    }],
                    "volumes": [
                        {"name": "nvidia0", "hostPath": {"path": "/dev/nvidia0", "type": "CharDevice"}},
                        {"name": "nvidia1", "hostPath": {"path": "/dev/nvidia1", "type": "CharDevice"}},
                        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}},
                        {"name": "cache", "persistentVolumeClaim": {"claimName": "hf-cache"}},
                        {"name": "config", "configMap": {"name": "llama-finetune-config"}}
                    ]
                }
            },
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        }
    });
    Bytes::from(serde_json::to_vec(&review).unwrap_or_default())
}

struct Pki {
    ca_pem: String,
    paths: TlsPaths,
    _dir: tempfile::TempDir,
}

fn pki() -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let params = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let paths = TlsPaths {
        cert: dir.path().join("tls.crt"),
        key: dir.path().join("tls.key"),
    };
    std::fs::write(&paths.cert, cert.pem()).unwrap();
    std::fs::write(&paths.key, key.serialize_pem()).unwrap();
    Pki {
        ca_pem: ca.pem(),
        paths,
        _dir: dir,
    }
}

fn client_config(ca_pem: &str) -> Arc<ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut config =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}

/// A TLS connection to the server, with the ALPN protocols of `config`.
async fn tls_connect(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
) -> hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let tls = TlsConnector::from(config)
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    hyper_util::rt::TokioIo::new(tls)
}

async fn connect(addr: SocketAddr, config: Arc<ClientConfig>) -> Sender {
    let (sender, conn) = hyper::client::conn::http1::handshake(tls_connect(addr, config).await)
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

/// `POST /mutate` with `body`; HTTP/1.1 also needs a Host header (HTTP/2 sends the
/// authority as a pseudo-header instead).
fn mutate_request(body: &Bytes, host: bool) -> Option<http::Request<Full<Bytes>>> {
    let mut request = http::Request::post("/mutate").header("content-type", "application/json");
    if host {
        request = request.header("host", "localhost");
    }
    request.body(Full::new(body.clone())).ok()
}

/// The body of a 200 answer, or None on any failure.
async fn answer_body(
    response: Result<http::Response<hyper::body::Incoming>, hyper::Error>,
) -> Option<Bytes> {
    let response = response.ok()?;
    if response.status() != 200 {
        return None;
    }
    Some(response.into_body().collect().await.ok()?.to_bytes())
}

/// One request; returns the response body, or None on any failure.
async fn send(sender: &mut Sender, body: &Bytes) -> Option<Bytes> {
    sender.ready().await.ok()?;
    answer_body(sender.send_request(mutate_request(body, true)?).await).await
}

#[derive(Default)]
struct Run {
    latencies_us: Vec<u64>,
    errors: usize,
    elapsed: Duration,
    /// CPU time of the whole process (client and server) during the run, if readable.
    cpu: Option<Duration>,
}

impl Run {
    fn percentile(&self, p: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return f64::NAN;
        }
        let index = ((self.latencies_us.len() as f64 - 1.0) * p).round() as usize;
        self.latencies_us[index] as f64 / 1000.0
    }

    fn throughput(&self) -> f64 {
        self.latencies_us.len() as f64 / self.elapsed.as_secs_f64()
    }

    /// Microseconds of CPU (client and server together) per answered request.
    fn cpu_per_request_us(&self) -> f64 {
        match self.cpu {
            Some(cpu) if !self.latencies_us.is_empty() => {
                cpu.as_secs_f64() * 1e6 / self.latencies_us.len() as f64
            }
            _ => f64::NAN,
        }
    }
}

/// User plus system CPU time of this process so far, from `/proc/self/stat`.
fn process_cpu(ticks_per_second: f64) -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the name.
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(Duration::from_secs_f64(ticks / ticks_per_second))
}

/// Clock ticks per second of `/proc` CPU times (`getconf CLK_TCK`; 100 on Linux when unknown).
fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// The median (the mean of the two middle values of an even count); sorts `values`.
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    match values.len() {
        0 => f64::NAN,
        n if n % 2 == 0 => (values[mid - 1] + values[mid]) / 2.0,
        _ => values[mid],
    }
}

/// One round's engine and floor throughput, measured back to back.
struct Ratio {
    engine: f64,
    floor: f64,
}

impl Ratio {
    /// A run with failed requests has no throughput (NaN): [`Ratio::print`] leaves that
    /// round out and says so.
    fn of(engine: &Run, floor: &Run) -> Self {
        let throughput = |run: &Run| {
            if run.errors == 0 {
                run.throughput()
            } else {
                f64::NAN
            }
        };
        Self {
            engine: throughput(engine),
            floor: throughput(floor),
        }
    }

    fn percent(&self) -> f64 {
        100.0 * self.engine / self.floor
    }

    /// `<what>: median R % (low to high %) ...` over the rounds without failed requests.
    fn print(what: &str, rounds: &[Ratio]) {
        let clean: Vec<&Ratio> = rounds.iter().filter(|r| r.percent().is_finite()).collect();
        let failed = rounds.len() - clean.len();
        let failed = if failed == 0 {
            String::new()
        } else {
            format!(
                "; {failed} of {} rounds left out: requests failed",
                rounds.len()
            )
        };
        let mut percents: Vec<f64> = clean.iter().map(|r| r.percent()).collect();
        let ratio = median(&mut percents);
        // `median` sorted them: the range is the ends.
        let (lowest, highest) = match (percents.first(), percents.last()) {
            (Some(low), Some(high)) => (*low, *high),
            _ => (f64::NAN, f64::NAN),
        };
        let mut engine: Vec<f64> = clean.iter().map(|r| r.engine).collect();
        let mut floor: Vec<f64> = clean.iter().map(|r| r.floor).collect();
        println!(
            "{what}: median {ratio:.1} % ({lowest:.1} to {highest:.1} %); engine {:.0} req/s, floor {:.0} req/s (medians){failed}",
            median(&mut engine),
            median(&mut floor),
        );
    }
}

/// Allows every request, echoing only its uid: the cheapest answer an API server accepts.
/// The floor, measuring the server stack around the engine.
#[derive(Debug, Clone, Copy)]
struct ConstantAllow;

impl Reviewer for ConstantAllow {
    fn review(&self, body: &[u8]) -> (Vec<u8>, ReviewSummary) {
        // The least a valid answer does: the API server rejects a response whose uid
        // does not echo the request's, so even the floor reads the review once.
        let uid = gpuwarden_webhook::admission::request_uid(body);
        let response = serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {"uid": uid, "allowed": true},
        });
        let summary = ReviewSummary {
            uid,
            outcome: gpuwarden_webhook::admission::Outcome::Allowed,
            policy: None,
            pod: None,
        };
        (response.to_string().into_bytes(), summary)
    }
}

/// The floor's answer pattern with the engine's response bytes: what a bigger answer alone
/// costs the stack.
struct FloorWithEngineAnswer {
    answer: Vec<u8>,
    summary: ReviewSummary,
}

impl Reviewer for FloorWithEngineAnswer {
    fn review(&self, body: &[u8]) -> (Vec<u8>, ReviewSummary) {
        let _ = ConstantAllow.review(body);
        (self.answer.clone(), self.summary.clone())
    }
}

/// A reviewer that adds up the time spent in `review`, to compare the reviewer's cost inside
/// the loaded server with its cost in a tight loop (where caches stay warm).
struct Timed<R> {
    reviewer: R,
    nanos: AtomicU64,
    calls: AtomicU64,
}

impl<R> Timed<R> {
    fn new(reviewer: R) -> Self {
        Self {
            reviewer,
            nanos: AtomicU64::new(0),
            calls: AtomicU64::new(0),
        }
    }
}

impl<R: Reviewer> Reviewer for Timed<R> {
    fn review(&self, body: &[u8]) -> (Vec<u8>, ReviewSummary) {
        let start = Instant::now();
        let answer = self.reviewer.review(body);
        let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_add(nanos, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
        answer
    }
}

/// What a [`Timed`] reviewer measured, whatever it wraps.
trait TakeTime {
    /// Mean microseconds per `review` call since the last call to `take`.
    fn take(&self) -> f64;
}

impl<R> TakeTime for Timed<R> {
    fn take(&self) -> f64 {
        let nanos = self.nanos.swap(0, Ordering::Relaxed) as f64;
        let calls = self.calls.swap(0, Ordering::Relaxed) as f64;
        nanos / calls / 1000.0
    }
}

/// The engine's work with the floor's small answer: what the engine's computing alone costs.
struct EngineWithFloorAnswer(Arc<EngineReviewer>);

impl Reviewer for EngineWithFloorAnswer {
    fn review(&self, body: &[u8]) -> (Vec<u8>, ReviewSummary) {
        let (_, summary) = self.0.review(body);
        (ConstantAllow.review(body).0, summary)
    }
}

/// The floor plus `rounds` steps of arithmetic that touch no memory: as much CPU as the
/// engine's extra work in a tight loop, without its allocations and data. Compared with the
/// engine under load, it shows how much of the engine's cost comes from its memory use.
struct FloorPlusCompute {
    rounds: u64,
}

impl FloorPlusCompute {
    fn compute(rounds: u64) -> u64 {
        let mut x = 0u64;
        for i in 0..rounds {
            x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(i));
        }
        x
    }

    /// A reviewer that takes `target` µs per review in a tight loop, given that the floor
    /// alone takes `floor`; the machine's speed drifts, so it measures itself and scales once.
    fn calibrated(target: f64, floor: f64, body: &[u8]) -> Self {
        let extra = (target - floor).max(0.0);
        let probe = Self { rounds: 100_000 };
        let per_round = (time_reviewer(&probe, body) - floor).max(1e-3) / probe.rounds as f64;
        let first = Self {
            rounds: (extra / per_round) as u64,
        };
        let measured = (time_reviewer(&first, body) - floor).max(1e-3);
        Self {
            rounds: (first.rounds as f64 * extra / measured) as u64,
        }
    }
}

impl Reviewer for FloorPlusCompute {
    fn review(&self, body: &[u8]) -> (Vec<u8>, ReviewSummary) {
        std::hint::black_box(Self::compute(self.rounds));
        ConstantAllow.review(body)
    }
}

/// One HTTP/2 connection, as the API server holds to a webhook (Go's client negotiates h2).
async fn connect_h2(addr: SocketAddr, config: Arc<ClientConfig>) -> Http2Sender {
    let mut config = (*config).clone();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let (sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        tls_connect(addr, Arc::new(config)).await,
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    sender
}

type Http2Sender = hyper::client::conn::http2::SendRequest<Full<Bytes>>;

/// One request over HTTP/2; returns the response body, or None on any failure.
async fn send_h2(sender: &mut Http2Sender, body: &Bytes) -> Option<Bytes> {
    sender.ready().await.ok()?;
    answer_body(sender.send_request(mutate_request(body, false)?).await).await
}

/// What one closed-loop sender sends on: its own HTTP/1.1 connection, or a stream of a
/// shared HTTP/2 connection.
enum Client {
    Http1(Sender),
    Http2(Http2Sender),
}

impl Client {
    async fn send(&mut self, body: &Bytes) -> Option<Bytes> {
        match self {
            Self::Http1(sender) => send(sender, body).await,
            Self::Http2(sender) => send_h2(sender, body).await,
        }
    }
}

/// `n` senders: keep-alive HTTP/1.1 connections, or streams of one HTTP/2 connection.
async fn clients(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
    n: usize,
    http2: bool,
) -> Vec<Client> {
    if http2 {
        let sender = connect_h2(addr, config).await;
        return (0..n).map(|_| Client::Http2(sender.clone())).collect();
    }
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        clients.push(Client::Http1(connect(addr, config.clone()).await));
    }
    clients
}

/// Each client sends back to back for `duration`; the run carries this process's CPU time.
async fn closed_loop(clients: Vec<Client>, body: Bytes, duration: Duration, ticks: f64) -> Run {
    let before = process_cpu(ticks);
    let start = Instant::now();
    let deadline = start + duration;
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|mut client| {
            let body = body.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(65536);
                let mut errors = 0;
                while Instant::now() < deadline {
                    let sent = Instant::now();
                    match client.send(&body).await {
                        Some(_) => latencies.push(sent.elapsed().as_micros() as u64),
                        None => errors += 1,
                    }
                }
                (latencies, errors)
            })
        })
        .collect();
    let mut run = Run::default();
    for task in tasks {
        let (latencies, errors) = task.await.unwrap();
        run.latencies_us.extend(latencies);
        run.errors += errors;
    }
    run.elapsed = start.elapsed();
    run.cpu = before
        .zip(process_cpu(ticks))
        .map(|(b, a)| a.saturating_sub(b));
    run.latencies_us.sort_unstable();
    run
}

/// Each client sends `per_client` requests back to back; returns how many failed.
async fn fixed_count(clients: Vec<Client>, body: Bytes, per_client: usize) -> usize {
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|mut client| {
            let body = body.clone();
            tokio::spawn(async move {
                let mut errors = 0;
                for _ in 0..per_client {
                    if client.send(&body).await.is_none() {
                        errors += 1;
                    }
                }
                errors
            })
        })
        .collect();
    let mut errors = 0;
    for task in tasks {
        errors += task.await.unwrap_or(per_client);
    }
    errors
}

/// Requests at a fixed `rate` for `duration` over a pool of 32 keep-alive connections; each
/// request is dispatched on schedule whether or not earlier ones have finished.
async fn fixed_rate(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
    body: Bytes,
    rate: u32,
    duration: Duration,
) -> Run {
    let (idle_tx, idle_rx) = async_channel();
    for _ in 0..32 {
        idle_tx.send(connect(addr, config.clone()).await).await.ok();
    }
    let idle_rx = Arc::new(tokio::sync::Mutex::new(idle_rx));
    let interval = Duration::from_secs_f64(1.0 / f64::from(rate));
    let total = (duration.as_secs_f64() * f64::from(rate)) as usize;
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(total);
    for i in 0..total {
        tokio::time::sleep_until(start + interval * i as u32).await;
        // Timed from dispatch: the timer wakes up to a millisecond late, which is the
        // client's artefact, not the server's. Waiting for a free connection is counted.
        let dispatched = Instant::now();
        let (idle_tx, idle_rx, body) = (idle_tx.clone(), idle_rx.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let mut sender = idle_rx.lock().await.recv().await?;
            let result = send(&mut sender, &body).await;
            let latency = dispatched.elapsed().as_micros() as u64;
            idle_tx.send(sender).await.ok();
            result.map(|_| latency)
        }));
    }
    let mut run = Run::default();
    for task in tasks {
        match task.await.ok().flatten() {
            Some(latency) => run.latencies_us.push(latency),
            None => run.errors += 1,
        }
    }
    run.elapsed = start.elapsed();
    run.latencies_us.sort_unstable();
    run
}

fn async_channel() -> (
    tokio::sync::mpsc::Sender<Sender>,
    tokio::sync::mpsc::Receiver<Sender>,
) {
    tokio::sync::mpsc::channel(64)
}

/// Starts the library server on its own runtime (2 worker threads, like the binary on this
/// machine) and returns its address.
fn start_in_process(
    server_rt: &Runtime,
    reviewer: Arc<dyn Reviewer>,
    paths: &TlsPaths,
) -> SocketAddr {
    let paths = paths.clone();
    server_rt.block_on(async move {
        let metrics = Arc::new(Metrics::new());
        let certs = Arc::new(CertStore::new());
        let mut reloader = CertReloader::new(paths, certs.clone(), metrics.clone());
        reloader.poll_once().await;
        let (trigger, shutdown) = shutdown_channel();
        // The server lives until the process ends.
        std::mem::forget(trigger);
        tokio::spawn(reloader.run(Duration::from_secs(5), shutdown.clone()));
        let https = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let health = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = https.local_addr().unwrap();
        let webhook = Webhook::new(
            reviewer,
            certs,
            SyncFlag::raised(),
            metrics,
            Limits::default(),
        );
        tokio::spawn(webhook.serve(https, health, shutdown));
        addr
    })
}

/// Mean time of one `review` call, after a warm-up, in microseconds.
fn time_reviewer(reviewer: &dyn Reviewer, body: &[u8]) -> f64 {
    for _ in 0..500 {
        std::hint::black_box(reviewer.review(body));
    }
    let rounds = 5000;
    let start = Instant::now();
    for _ in 0..rounds {
        std::hint::black_box(reviewer.review(std::hint::black_box(body)));
    }
    start.elapsed().as_secs_f64() * 1e6 / f64::from(rounds)
}

/// Reviews per second of `threads` threads calling `review` back to back, no network.
fn reviews_per_second(reviewer: Arc<dyn Reviewer>, body: &Bytes, threads: usize) -> f64 {
    let rounds = 3000;
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (reviewer, body) = (reviewer.clone(), body.clone());
            std::thread::spawn(move || {
                for _ in 0..rounds {
                    std::hint::black_box(reviewer.review(std::hint::black_box(&body)));
                }
            })
        })
        .collect();
    for handle in handles {
        let _ = handle.join();
    }
    (rounds * threads) as f64 / start.elapsed().as_secs_f64()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(18443)
}

fn vm_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

struct Binary(Child);

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn row(name: &str, run: &Run) {
    let cpu = run.cpu_per_request_us();
    println!(
        "{name:<44} {:>10.0} {:>9.2} {:>9.2} {:>9.2} {:>7} {:>12}",
        run.throughput(),
        run.percentile(0.50),
        run.percentile(0.99),
        run.percentile(0.999),
        run.errors,
        if cpu.is_nan() {
            "-".to_owned()
        } else {
            format!("{cpu:.1}")
        }
    );
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let seconds: u64 = env_or("BENCH_SECONDS", 5);
    let concurrency: usize = env_or::<usize>("BENCH_CONCURRENCY", 32).max(1);
    let rate: u32 = env_or("BENCH_RATE", 500);
    let rounds: usize = env_or::<usize>("BENCH_ROUNDS", 3).max(1);
    let breakdown = std::env::var_os("BENCH_BREAKDOWN").is_some_and(|v| v == "1");
    let ticks = clock_ticks();
    let duration = Duration::from_secs(seconds);
    let body = review_body();
    let pki = pki();
    let config = client_config(&pki.ca_pem);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());

    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();

    let policy_file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/policies/default.yaml");
    let source: Arc<dyn PolicySource> =
        Arc::new(StaticPolicySource::from_file(&policy_file).unwrap());
    let engine_reviewer = Arc::new(EngineReviewer::new(source.clone()));
    if let Ok(requests) = std::env::var("BENCH_REQUESTS") {
        let requests: usize = requests.parse().expect("BENCH_REQUESTS is a whole number");
        let reviewer: Arc<dyn Reviewer> = match std::env::var("BENCH_REVIEWER").as_deref() {
            Ok("engine") => engine_reviewer,
            Ok("floor") => Arc::new(ConstantAllow),
            _ => panic!("BENCH_REQUESTS needs BENCH_REVIEWER=engine or floor"),
        };
        let addr = start_in_process(&server_rt, reviewer, &pki.paths);
        let per_client = requests.div_ceil(concurrency);
        let errors = client_rt.block_on(async {
            let clients = clients(addr, config.clone(), concurrency, false).await;
            fixed_count(clients, body.clone(), per_client).await
        });
        println!(
            "{} requests over {concurrency} connections, {errors} failed",
            per_client * concurrency
        );
        return;
    }
    let engine_alone = time_reviewer(engine_reviewer.as_ref(), &body);
    let floor_alone = time_reviewer(&ConstantAllow, &body);
    let engine_threads = reviews_per_second(engine_reviewer.clone(), &body, 2);
    let engine_addr = start_in_process(&server_rt, engine_reviewer.clone(), &pki.paths);
    let floor_addr = start_in_process(&server_rt, Arc::new(ConstantAllow), &pki.paths);

    // Show that the engine really rewrites the benchmark pod.
    let answer = client_rt.block_on(async {
        let mut sender = connect(engine_addr, config.clone()).await;
        send(&mut sender, &body).await
    });
    let answer: serde_json::Value = answer
        .and_then(|a| serde_json::from_slice(&a).ok())
        .unwrap_or_default();
    let response = &answer["response"];
    let patched = response["patch"].as_str().map_or(0, str::len);
    println!(
        "review: {} bytes; engine answer: allowed={} patchType={} patch={} bytes (base64){}",
        body.len(),
        response["allowed"],
        response["patchType"],
        patched,
        response["status"]["message"]
            .as_str()
            .map(|m| format!(" message={m:?}"))
            .unwrap_or_default()
    );
    // A benchmark of another path (a denial, an unchanged pod) would publish figures of it
    // under the rewrite's name: it stops here instead.
    assert!(
        response["allowed"] == serde_json::json!(true) && patched > 0,
        "the engine did not rewrite the benchmark pod, so the figures would measure another path: {response}"
    );
    println!(
        "reviewer alone, one thread: engine {engine_alone:.1} µs per review, constant allow {floor_alone:.2} µs; two threads: engine {engine_threads:.0} reviews/s"
    );
    println!(
        "machine: {cpus} CPUs; client and server share them; {seconds} s per run, {rounds} alternating engine/floor rounds, {concurrency} keep-alive connections, fixed rate {rate}/s\n"
    );
    println!(
        "{:<44} {:>10} {:>9} {:>9} {:>9} {:>7} {:>12}",
        "scenario", "req/s", "p50 ms", "p99 ms", "p99.9 ms", "errors", "CPU µs/req"
    );

    // One closed-loop measurement at `concurrency`, printed as a row.
    let measure = |addr: SocketAddr, http2: bool, name: String| {
        let run = client_rt.block_on(async {
            let clients = clients(addr, config.clone(), concurrency, http2).await;
            closed_loop(clients, body.clone(), duration, ticks).await
        });
        row(&name, &run);
        run
    };

    let mut engine_cpu = Vec::with_capacity(rounds);
    let mut floor_cpu = Vec::with_capacity(rounds);
    let mut ratios = Vec::with_capacity(rounds);
    let mut h2_ratios = Vec::with_capacity(rounds);
    for round in 1..=rounds {
        let engine = measure(
            engine_addr,
            false,
            format!("[{round}] in-process engine, {concurrency} conns"),
        );
        let floor = measure(
            floor_addr,
            false,
            format!("[{round}] in-process floor (constant allow), {concurrency} conns"),
        );
        engine_cpu.push(engine.cpu_per_request_us());
        floor_cpu.push(floor.cpu_per_request_us());
        ratios.push(Ratio::of(&engine, &floor));
        let engine = measure(
            engine_addr,
            true,
            format!("[{round}] HTTP/2 engine, 1 conn, {concurrency} streams"),
        );
        let floor = measure(
            floor_addr,
            true,
            format!("[{round}] HTTP/2 floor, 1 conn, {concurrency} streams"),
        );
        h2_ratios.push(Ratio::of(&engine, &floor));
    }
    if breakdown {
        let (answer, summary) = engine_reviewer.review(&body);
        let big = start_in_process(
            &server_rt,
            Arc::new(FloorWithEngineAnswer { answer, summary }),
            &pki.paths,
        );
        let small = start_in_process(
            &server_rt,
            Arc::new(EngineWithFloorAnswer(engine_reviewer.clone())),
            &pki.paths,
        );
        let compute = FloorPlusCompute::calibrated(engine_alone, floor_alone, &body);
        let compute_alone = time_reviewer(&compute, &body);
        let compute = start_in_process(&server_rt, Arc::new(compute), &pki.paths);
        println!(
            "floor + plain arithmetic: {compute_alone:.1} µs per review in a tight loop, like the engine's {engine_alone:.1} µs"
        );
        let runs = [
            ("floor work, engine's answer", big),
            ("engine work, floor's answer", small),
            ("floor + arithmetic, as long as the engine", compute),
        ]
        .map(|(name, addr)| measure(addr, false, format!("{name}, {concurrency} conns")));
        let floor = measure(
            floor_addr,
            false,
            format!("floor (constant allow), {concurrency} conns"),
        );
        let [big, small, compute] = &runs;
        for (what, run) in [
            ("floor work with the engine's answer", big),
            ("engine work with the floor's answer", small),
            (
                "floor + arithmetic as long as the engine (no cache footprint)",
                compute,
            ),
        ] {
            println!(
                "  {what} / floor: {:.1} %",
                Ratio::of(run, &floor).percent()
            );
        }
        let timed_engine = Arc::new(Timed::new(EngineReviewer::new(source.clone())));
        let timed_floor = Arc::new(Timed::new(ConstantAllow));
        let mut inside = Vec::new();
        for (name, addr, timed) in [
            (
                "engine, timed",
                start_in_process(&server_rt, timed_engine.clone(), &pki.paths),
                timed_engine.clone() as Arc<dyn TakeTime>,
            ),
            (
                "floor, timed",
                start_in_process(&server_rt, timed_floor.clone(), &pki.paths),
                timed_floor.clone() as Arc<dyn TakeTime>,
            ),
        ] {
            timed.take();
            measure(addr, false, format!("{name}, {concurrency} conns"));
            inside.push(timed.take());
        }
        println!(
            "time in review() inside the loaded server: engine {:.1} µs, floor {:.2} µs (one thread, warm: {engine_alone:.1} and {floor_alone:.2} µs)",
            inside[0], inside[1]
        );
    }
    let engine_rate = client_rt.block_on(fixed_rate(
        engine_addr,
        config.clone(),
        body.clone(),
        rate,
        duration,
    ));
    row(&format!("in-process engine, {rate} req/s"), &engine_rate);
    let floor_rate = client_rt.block_on(fixed_rate(
        floor_addr,
        config.clone(),
        body.clone(),
        rate,
        duration,
    ));
    row(&format!("in-process floor, {rate} req/s"), &floor_rate);

    // The release binary as a separate process, for its memory.
    let exe = env!("CARGO_BIN_EXE_gpuwarden-webhook");
    let port = free_port();
    let health_port = free_port();
    let child = Command::new(exe)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--health-listen", &format!("127.0.0.1:{health_port}")])
        .arg("--tls-cert")
        .arg(&pki.paths.cert)
        .arg("--tls-key")
        .arg(&pki.paths.key)
        .arg("--policy-file")
        .arg(&policy_file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let Ok(child) = child else {
        println!("\ncould not start {exe}; skipping the process measurements");
        return;
    };
    let binary = Binary(child);
    let pid = binary.0.id();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let up = client_rt.block_on(async {
        for _ in 0..100 {
            if TcpStream::connect(addr).await.is_ok() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    });
    if !up {
        println!("\n{exe} did not start listening; skipping the process measurements");
        return;
    }
    std::thread::sleep(Duration::from_secs(1));
    let idle_rss = vm_rss_kib(pid).unwrap_or(0);

    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let sampling = sampling.clone();
        std::thread::spawn(move || {
            let mut peak = 0;
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(vm_rss_kib(pid).unwrap_or(0));
                std::thread::sleep(Duration::from_millis(50));
            }
            peak
        })
    };
    let mut process = client_rt.block_on(async {
        let clients = clients(addr, config.clone(), concurrency, false).await;
        closed_loop(clients, body.clone(), duration, ticks).await
    });
    // This process is only the client here; its CPU time says nothing of the server's.
    process.cpu = None;
    row(
        &format!("binary (engine, info logs), {concurrency} conns"),
        &process,
    );
    let process_rate = client_rt.block_on(fixed_rate(
        addr,
        config.clone(),
        body.clone(),
        rate,
        duration,
    ));
    row(
        &format!("binary (engine, info logs), {rate} req/s"),
        &process_rate,
    );
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let peak_rss = sampler.join().unwrap_or(0);
    let after_rss = vm_rss_kib(pid).unwrap_or(0);
    drop(binary);

    println!();
    Ratio::print(
        "engine / floor throughput over HTTP/1.1, round by round",
        &ratios,
    );
    Ratio::print(
        "engine / floor throughput over HTTP/2 (one connection), round by round",
        &h2_ratios,
    );
    let floor_cpu = median(&mut floor_cpu);
    println!(
        "CPU per request, client and server together (medians): engine {:.1} µs, floor {floor_cpu:.1} µs; 50 % of the floor's throughput allows {:.1} µs, {:.1} µs more than the floor",
        median(&mut engine_cpu),
        floor_cpu / 0.5,
        floor_cpu / 0.5 - floor_cpu,
    );
    println!(
        "binary VmRSS: idle {:.1} MiB, peak under load {:.1} MiB, after load {:.1} MiB",
        idle_rss as f64 / 1024.0,
        peak_rss as f64 / 1024.0,
        after_rss as f64 / 1024.0
    );
    println!(
        "targets: >= 3000 req/s; p99 <= 5 ms at {rate} req/s; engine >= 50 % of floor; RSS <= 32 MiB idle, <= 64 MiB under load"
    );
}
