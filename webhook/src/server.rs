//! `gpuwarden-webhook serve`: `POST /mutate` over HTTPS, and `/healthz`, `/readyz`,
//! `/metrics` over plain HTTP on a second port.
//!
//! TLS is served by hand (tokio-rustls + hyper-util) rather than through a framework so that
//! the certificate is looked up per handshake ([`CertStore`]) and shutdown can stop
//! accepting, then drain open connections within a bound.
//!
//! `/mutate` always answers 200 with an AdmissionReview, even when the request never reached
//! the engine (wrong Content-Type, body over the limit, overload, a body that did not
//! arrive): the API server then shows the user the reason instead of a bare HTTP error.
//! Nothing here calls the API server while answering.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;

use crate::admission::{self, PolicySource, ReviewSummary};
use crate::cache::{ReflectorCache, StaticPolicySource, SyncFlag};
use crate::metrics::{self, Metrics, Refusal};
pub use crate::shutdown::{Shutdown, ShutdownTrigger, shutdown_channel};
use crate::tls::{CertReloader, CertStore, TlsPaths};
use gpuwarden_crds::error_chain;

/// Largest request body accepted: the API server's own request limit.
pub const MAX_BODY_BYTES: usize = 3 * 1024 * 1024;
/// Bodies at most this size run the engine inline; bigger ones (parsing them takes a
/// millisecond or more) move to the blocking pool so they cannot stall other connections.
const INLINE_BODY_BYTES: usize = 64 * 1024;
/// An oversized body is read and thrown away up to this many bytes, so that a well-behaved
/// client still receives the answer; past it the connection is closed.
const DRAIN_BYTES: usize = 4 * MAX_BODY_BYTES;
/// Bound on a TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors running the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A listener could not be bound.
    #[error("failed to listen on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The policy source could not be built.
    #[error("failed to set up the policy source")]
    Cache(#[from] crate::cache::CacheError),
    /// No Kubernetes client could be configured.
    #[error("failed to configure a Kubernetes client (in-cluster or KUBECONFIG)")]
    Kube(#[source] kube::Error),
    /// TLS could not be configured.
    #[error("failed to configure TLS")]
    Tls(#[from] crate::tls::TlsError),
    /// The health server failed.
    #[error("health server on {addr} failed")]
    Health {
        /// Its address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A signal handler could not be installed.
    #[error("failed to install a signal handler")]
    Signal(#[source] std::io::Error),
}

/// Answers one AdmissionReview body: the server's only link to the engine, so that tests
/// can drive the server with answers of their own and the benchmark can measure the same
/// stack around a constant answer.
pub trait Reviewer: Send + Sync + 'static {
    /// The response review (JSON) and a summary for metrics and logs. Never panics on bad
    /// input (a panic is still caught and turned into a denial).
    fn review(&self, body: &[u8]) -> (Vec<u8>, ReviewSummary);

    /// The answer to a request to enter a pod ([`admission::entry_target`]), given the pod
    /// as read. By default such requests are denied: a reviewer that reads no policies
    /// cannot tell a VM's pod.
    fn review_entry(
        &self,
        body: &[u8],
        pod: Result<Option<serde_json::Value>, String>,
    ) -> (Vec<u8>, ReviewSummary) {
        let _ = pod;
        admission::handle_entry(
            body,
            Err("no policies to judge by".into()),
            &admission::StaticSource::new([]),
        )
    }
}

/// A pod being read: as JSON, `Ok(None)` when it does not exist, `Err` why it could not be
/// read.
pub type PodRead<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Option<serde_json::Value>, String>> + Send + 'a>,
>;

/// Reads the pod a request enters, from the API server.
pub trait PodLookup: Send + Sync + 'static {
    /// Reads pod `namespace/name`.
    fn get<'a>(&'a self, namespace: &'a str, name: &'a str) -> PodRead<'a>;
}

/// [`PodLookup`] through the Kubernetes API.
pub struct ApiPods(pub kube::Client);

impl PodLookup for ApiPods {
    fn get<'a>(&'a self, namespace: &'a str, name: &'a str) -> PodRead<'a> {
        Box::pin(async move {
            use k8s_openapi::api::core::v1::Pod;
            let api: kube::Api<Pod> = kube::Api::namespaced(self.0.clone(), namespace);
            let pod = api.get_opt(name).await.map_err(|e| error_chain(&e))?;
            pod.map(|p| serde_json::to_value(p).map_err(|e| e.to_string()))
                .transpose()
        })
    }
}

/// The real reviewer: the admission engine over a [`PolicySource`].
pub struct EngineReviewer {
    source: Arc<dyn PolicySource>,
}

impl EngineReviewer {
    /// A reviewer reading policies and namespace labels from `source`.
    pub fn new(source: Arc<dyn PolicySource>) -> Self {
        Self { source }
    }
}

impl Reviewer for EngineReviewer {
    fn review(&self, body: &[u8]) -> (Vec<u8>, ReviewSummary) {
        admission::handle_review(body, self.source.as_ref())
    }

    fn review_entry(
        &self,
        body: &[u8],
        pod: Result<Option<serde_json::Value>, String>,
    ) -> (Vec<u8>, ReviewSummary) {
        admission::handle_entry(body, pod, self.source.as_ref())
    }
}

/// Bounds on the work one replica takes on.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Requests on `/mutate` handled at once (body read included).
    pub max_concurrency: usize,
    /// How long a request waits for a free slot before it is denied as overloaded.
    pub max_wait: Duration,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// Request bytes held in memory across all requests at once (at least
    /// `max_body_bytes`); a request that cannot get room within `max_wait` is denied as
    /// overloaded.
    pub max_buffered_bytes: usize,
    /// How long the whole body may take to arrive.
    pub body_timeout: Duration,
    /// On shutdown, how long the server keeps accepting while reporting not ready, so that
    /// the API server learns of the endpoint's removal before connections are refused.
    pub shutdown_delay: Duration,
    /// On shutdown, how long open connections get to finish.
    pub drain_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_concurrency: 256,
            max_wait: Duration::from_secs(1),
            max_body_bytes: MAX_BODY_BYTES,
            max_buffered_bytes: 64 * 1024 * 1024,
            // The API server gives up after the webhook's timeoutSeconds (5 s).
            body_timeout: Duration::from_secs(4),
            shutdown_delay: Duration::ZERO,
            drain_timeout: Duration::from_secs(20),
        }
    }
}

/// The webhook as a value: the HTTPS app, the health app, and what they share.
#[derive(Clone)]
pub struct Webhook {
    reviewer: Arc<dyn Reviewer>,
    metrics: Arc<Metrics>,
    certs: Arc<CertStore>,
    synced: SyncFlag,
    limits: Limits,
    slots: Arc<Semaphore>,
    buffer_budget: Arc<Semaphore>,
    draining: Arc<AtomicBool>,
    pods: Option<Arc<dyn PodLookup>>,
}

impl Webhook {
    /// A webhook answering with `reviewer`, serving the pair in `certs`, ready once `synced`
    /// is raised and a certificate is loaded.
    pub fn new(
        reviewer: Arc<dyn Reviewer>,
        certs: Arc<CertStore>,
        synced: SyncFlag,
        metrics: Arc<Metrics>,
        limits: Limits,
    ) -> Self {
        let slots = Arc::new(Semaphore::new(limits.max_concurrency.max(1)));
        let budget = limits
            .max_buffered_bytes
            .max(limits.max_body_bytes)
            .min(Semaphore::MAX_PERMITS);
        let buffer_budget = Arc::new(Semaphore::new(budget));
        Self {
            reviewer,
            metrics,
            certs,
            synced,
            limits,
            slots,
            buffer_budget,
            draining: Arc::new(AtomicBool::new(false)),
            pods: None,
        }
    }

    /// Reads the pods that requests to exec, attach or port-forward enter from `pods`;
    /// without it such requests are denied, saying the pod could not be read.
    pub fn with_pods(mut self, pods: Arc<dyn PodLookup>) -> Self {
        self.pods = Some(pods);
        self
    }

    /// The metrics this webhook records into.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The app served over HTTPS: `POST /mutate`.
    pub fn mutate_router(&self) -> Router {
        Router::new()
            .route(gpuwarden_crds::install::MUTATE_PATH, post(mutate))
            .route(gpuwarden_crds::install::ENTRY_PATH, post(enter))
            .with_state(self.clone())
    }

    /// The app served over plain HTTP: `/healthz`, `/readyz`, `/metrics`.
    pub fn health_router(&self) -> Router {
        Router::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(readyz))
            .route("/metrics", get(metrics_text))
            .with_state(self.clone())
    }

    /// Serves `/mutate` over TLS on `https` and the health app on `health` until `shutdown`
    /// fires; then reports not ready, keeps accepting for [`Limits::shutdown_delay`], stops
    /// accepting, and gives open connections [`Limits::drain_timeout`] to finish.
    pub async fn serve(
        self,
        https: TcpListener,
        health: TcpListener,
        shutdown: Shutdown,
    ) -> Result<(), ServerError> {
        let tls = self.certs.server_config()?;
        let health_addr = local_addr(&health);
        let health_app = self.health_router();
        // The health port outlives the HTTPS port, so /readyz says "shutting down" meanwhile.
        let (health_stop, health_stopped) = tokio::sync::oneshot::channel::<()>();
        let health_server = tokio::spawn(async move {
            axum::serve(health, health_app)
                .with_graceful_shutdown(async move {
                    let _ = health_stopped.await;
                })
                .await
        });

        let app = self.mutate_router();
        serve_tls(https, tls, app, shutdown, &self.draining, &self.limits).await;
        let _ = health_stop.send(());

        match health_server.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(ServerError::Health {
                addr: health_addr,
                source,
            }),
            Err(join) => Err(ServerError::Health {
                addr: health_addr,
                source: std::io::Error::other(join),
            }),
        }
    }
}

fn local_addr(listener: &TcpListener) -> SocketAddr {
    listener
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)))
}

/// Accepts TLS connections and serves `app` on each (HTTP/1.1 or HTTP/2 by ALPN) until
/// `shutdown`; then drains within `drain_timeout`.
async fn serve_tls(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    app: Router,
    shutdown: Shutdown,
    draining: &AtomicBool,
    limits: &Limits,
) {
    let acceptor = TlsAcceptor::from(tls);
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10))
        .keep_alive(true);
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    let addr = local_addr(&listener);
    tracing::info!(%addr, "serving admission reviews over HTTPS");

    let stop_accepting = async {
        shutdown.wait().await;
        draining.store(true, Ordering::Release);
        if !limits.shutdown_delay.is_zero() {
            tracing::info!(delay = ?limits.shutdown_delay, "shutting down: not ready, still accepting");
            tokio::time::sleep(limits.shutdown_delay).await;
        }
    };
    let mut stop_accepting = std::pin::pin!(stop_accepting);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Usually EMFILE or a connection reset before accept: back off briefly
                    // instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stop_accepting => break,
        };
        // Small request/response pairs: do not wait for Nagle.
        let _ = stream.set_nodelay(true);
        let acceptor = acceptor.clone();
        let builder = builder.clone();
        let app = app.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let tls_stream =
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(tls_stream)) => tls_stream,
                    Ok(Err(error)) => {
                        tracing::debug!(%peer, %error, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "TLS handshake timed out");
                        return;
                    }
                };
            let service = TowerToHyperService::new(app);
            let conn = builder.serve_connection(TokioIo::new(tls_stream), service);
            if let Err(error) = watcher.watch(conn).await {
                tracing::debug!(%peer, error = %error, "connection ended with an error");
            }
        });
    }

    drop(listener);
    let drain_timeout = limits.drain_timeout;
    let open = graceful.count();
    tracing::info!(
        open,
        "shutting down: no new connections, draining open ones"
    );
    if tokio::time::timeout(drain_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            ?drain_timeout,
            "connections still open after the drain timeout; closing them"
        );
    }
}

async fn readyz(State(webhook): State<Webhook>) -> Response {
    let mut missing = Vec::new();
    if !webhook.synced.get() {
        missing.push("policy and namespace caches not synced");
    }
    if !webhook.certs.is_loaded() {
        missing.push("no serving certificate loaded");
    }
    if webhook.draining.load(Ordering::Acquire) {
        missing.push("shutting down");
    }
    if missing.is_empty() {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", missing.join("; ")),
        )
            .into_response()
    }
}

async fn metrics_text(State(webhook): State<Webhook>) -> Response {
    match webhook.metrics.encode() {
        Ok(text) => ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "failed to encode metrics\n",
        )
            .into_response(),
    }
}

/// What a path answers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Route {
    /// `/mutate`: pods and VMs, created or changed.
    Review,
    /// `/enter`: requests to exec, attach or port-forward into a pod.
    Entry,
}

/// `POST /mutate`.
async fn mutate(State(webhook): State<Webhook>, request: Request) -> Response {
    serve(&webhook, request, Route::Review).await
}

/// `POST /enter`.
async fn enter(State(webhook): State<Webhook>, request: Request) -> Response {
    serve(&webhook, request, Route::Entry).await
}

/// The HTTP answer to one review on `route`.
async fn serve(webhook: &Webhook, request: Request, route: Route) -> Response {
    let started = Instant::now();
    let _in_flight = webhook.metrics.in_flight();
    let (body, summary) = answer(webhook, request, route).await;
    webhook.metrics.observe_duration(started.elapsed());
    if let Some(summary) = summary {
        webhook.metrics.observe_review(&summary);
    }
    // An exact-size buffer becomes the response body as it is; one with spare room costs
    // `Bytes` a second allocation to track it. Shrinking usually keeps the block in place.
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        body.into_boxed_slice(),
    )
        .into_response()
}

/// A response body, and the engine's summary when the engine answered.
type Answer = (Vec<u8>, Option<ReviewSummary>);

/// The answer to one request on `route`: it waits for a slot, its body is read, then the
/// reviewer answers it. A request refused on the way is answered with why.
async fn answer(webhook: &Webhook, request: Request, route: Route) -> Answer {
    let _slot = match webhook.take_slot().await {
        Ok(slot) => slot,
        Err(refused) => return refused,
    };
    let (parts, body) = request.into_parts();
    let content_type_error = check_content_type(&parts.headers);
    let (body, _buffered) = match webhook.receive(body, &parts.headers).await {
        Ok(read) => read,
        Err(refused) => return refused,
    };
    if let Some(message) = content_type_error {
        // The uid is still worth echoing: the API server then shows this message.
        let uid = admission::request_uid(&body);
        return webhook.refuse(Refusal::ContentType, &uid, 415, message);
    }
    match route {
        Route::Entry => (entry(webhook, &body).await, None),
        Route::Review => review(webhook, &body).await,
    }
}

impl Webhook {
    /// The answer to a request refused before the reviewer saw it, counted and logged.
    fn refuse(&self, refusal: Refusal, uid: &str, code: u16, message: String) -> Answer {
        self.metrics.observe_refusal(refusal);
        tracing::warn!(uid, reason = refusal.as_str(), %message, "review refused");
        (refusal_review(uid, code, &message), None)
    }

    /// The answer to a request that found no `what` within [`Limits::max_wait`].
    fn overloaded(&self, what: &str) -> Answer {
        self.refuse(
            Refusal::Overloaded,
            "",
            429,
            format!(
                "gpuwarden webhook is overloaded: no {what} within {:?}; retry",
                self.limits.max_wait
            ),
        )
    }

    /// One of the [`Limits::max_concurrency`] slots, held while the request is answered.
    async fn take_slot(&self) -> Result<OwnedSemaphorePermit, Answer> {
        let slot = self.slots.clone().acquire_owned();
        match tokio::time::timeout(self.limits.max_wait, slot).await {
            Ok(Ok(slot)) => Ok(slot),
            _ => Err(self.overloaded(&format!(
                "free slot ({} requests in progress)",
                self.limits.max_concurrency
            ))),
        }
    }

    /// The request body within [`Limits::body_timeout`], with the room it holds in the
    /// buffer budget ([`read_body`]).
    async fn receive(
        &self,
        body: Body,
        headers: &HeaderMap,
    ) -> Result<(Bytes, Option<OwnedSemaphorePermit>), Answer> {
        let budget = Budget {
            semaphore: &self.buffer_budget,
            wait: self.limits.max_wait,
        };
        let read = read_body(body, headers, self.limits.max_body_bytes, budget);
        match tokio::time::timeout(self.limits.body_timeout, read).await {
            Ok(Ok(read)) => Ok(read),
            Ok(Err(BodyError::Overloaded)) => Err(self.overloaded("memory for the request body")),
            Ok(Err(BodyError::TooLarge)) => Err(self.refuse(
                Refusal::TooLarge,
                "",
                413,
                format!(
                    "request body is larger than the webhook's limit of {} bytes",
                    self.limits.max_body_bytes
                ),
            )),
            Ok(Err(BodyError::Read(error))) => Err(self.refuse(
                Refusal::BodyRead,
                "",
                400,
                format!("failed to read the request body: {error}"),
            )),
            Err(_) => Err(self.refuse(
                Refusal::BodyRead,
                "",
                408,
                format!(
                    "request body did not arrive within {:?}",
                    self.limits.body_timeout
                ),
            )),
        }
    }
}

/// The reviewer's answer to a pod or VM review, in a span naming its uid and pod: inline
/// for a small body, on the blocking pool for a large one.
async fn review(webhook: &Webhook, body: &Bytes) -> Answer {
    let span = tracing::info_span!(
        "review",
        uid = tracing::field::Empty,
        pod = tracing::field::Empty
    );
    let reviewer = webhook.reviewer.clone();
    let result = if body.len() <= INLINE_BODY_BYTES {
        span.in_scope(|| run_reviewer(reviewer.as_ref(), body))
    } else {
        let body = body.clone();
        let blocking_span = span.clone();
        let run = tokio::task::spawn_blocking(move || {
            blocking_span.in_scope(|| run_reviewer(reviewer.as_ref(), &body))
        });
        run.await.unwrap_or_default()
    };
    let Some((response, summary)) = result else {
        return webhook.refuse(
            Refusal::Internal,
            &admission::request_uid(body),
            500,
            "gpuwarden webhook failed internally while reviewing this request; see its logs".into(),
        );
    };

    span.record("uid", summary.uid.as_str());
    if let Some(pod) = &summary.pod {
        span.record("pod", pod.as_str());
    }
    span.in_scope(|| {
        let outcome = summary.outcome.as_str();
        let policy = summary.policy.as_deref().unwrap_or("");
        match summary.outcome {
            admission::Outcome::Allowed | admission::Outcome::Exempt => {
                tracing::debug!(outcome, policy, "review answered");
            }
            _ => tracing::info!(outcome, policy, "review answered"),
        }
    });
    (response, Some(summary))
}

/// How long the webhook waits for the API server to return a pod being entered.
const POD_READ_TIMEOUT: Duration = Duration::from_secs(3);

/// The answer to a request to enter a pod ([`admission::entry_target`]): the pod is read,
/// then judged ([`Reviewer::review_entry`]), which answers any other request as malformed.
async fn entry(webhook: &Webhook, body: &[u8]) -> Vec<u8> {
    let target = admission::entry_target(body);
    let pod = match (&webhook.pods, &target) {
        (_, None) => Err("not a request to enter a pod".to_owned()),
        (Some(pods), Some(target)) => {
            let read = pods.get(&target.namespace, &target.name);
            match tokio::time::timeout(POD_READ_TIMEOUT, read).await {
                Ok(read) => read,
                Err(_) => Err(format!("no answer within {POD_READ_TIMEOUT:?}")),
            }
        }
        (None, Some(_)) => Err("this webhook reads no pods: it runs without a cluster".to_owned()),
    };
    let (body, summary) = webhook.reviewer.review_entry(body, pod);
    tracing::info!(uid = summary.uid, pod = ?summary.pod, outcome = summary.outcome.as_str(), "entry reviewed");
    body
}

/// Runs the reviewer, turning a panic (a bug) into `None` so the request gets a denial
/// instead of a dropped connection.
fn run_reviewer(reviewer: &dyn Reviewer, body: &[u8]) -> Option<(Vec<u8>, ReviewSummary)> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| reviewer.review(body))) {
        Ok(result) => Some(result),
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(panic = %message, "reviewer panicked");
            None
        }
    }
}

/// `None` when the request says it carries JSON, otherwise why not.
fn check_content_type(headers: &HeaderMap) -> Option<String> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Some("Content-Type is missing; expected application/json".into());
    };
    let text = String::from_utf8_lossy(value.as_bytes());
    let media_type = text.split(';').next().unwrap_or("").trim();
    if media_type.eq_ignore_ascii_case("application/json") {
        None
    } else {
        Some(format!(
            "Content-Type is {:?}; expected application/json",
            text.chars().take(100).collect::<String>()
        ))
    }
}

#[derive(Debug)]
enum BodyError {
    TooLarge,
    Overloaded,
    Read(axum::Error),
}

/// Room for request bodies shared by all requests, in bytes.
#[derive(Clone, Copy)]
struct Budget<'a> {
    semaphore: &'a Arc<Semaphore>,
    wait: Duration,
}

impl Budget<'_> {
    /// Reserves `bytes` more, adding them to `held`.
    async fn reserve(
        self,
        bytes: usize,
        held: &mut Option<OwnedSemaphorePermit>,
    ) -> Result<(), BodyError> {
        let bytes = u32::try_from(bytes).map_err(|_| BodyError::TooLarge)?;
        let permit =
            tokio::time::timeout(self.wait, self.semaphore.clone().acquire_many_owned(bytes))
                .await
                .map_err(|_| BodyError::Overloaded)?
                .map_err(|_| BodyError::Overloaded)?;
        match held {
            Some(held) => held.merge(permit),
            None => *held = Some(permit),
        }
        Ok(())
    }
}

/// Reads at most `limit` bytes of body, holding room for them in `budget` (returned with
/// the body, to be dropped once the answer is built). A larger body is read on and
/// discarded (never stored) up to [`DRAIN_BYTES`], so the client can still read the answer.
async fn read_body(
    body: Body,
    headers: &HeaderMap,
    limit: usize,
    budget: Budget<'_>,
) -> Result<(Bytes, Option<OwnedSemaphorePermit>), BodyError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let too_large = declared.is_some_and(|len| len > limit as u64);
    if too_large && declared.is_some_and(|len| len > DRAIN_BYTES as u64) {
        return Err(BodyError::TooLarge);
    }
    let mut held = None;
    // A declared length is reserved and allocated at once; hyper ends the body there.
    let reserved = match declared {
        Some(len) if !too_large => {
            budget.reserve(len as usize, &mut held).await?;
            len as usize
        }
        _ => 0,
    };
    let mut buffer = BytesMut::with_capacity(reserved);
    let mut seen = 0usize;
    let mut body = body;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(BodyError::Read)?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        seen = seen.saturating_add(data.len());
        if seen > DRAIN_BYTES {
            return Err(BodyError::TooLarge);
        }
        if !too_large && seen <= limit {
            if seen > reserved {
                budget.reserve(data.len(), &mut held).await?;
            }
            buffer.extend_from_slice(&data);
        }
    }
    if too_large || seen > limit {
        return Err(BodyError::TooLarge);
    }
    Ok((buffer.freeze(), held))
}

/// A denial review for a request the engine never saw.
pub fn refusal_review(uid: &str, code: u16, message: &str) -> Vec<u8> {
    serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {
            "uid": uid,
            "allowed": false,
            "status": {
                "status": "Failure",
                "code": code,
                "message": message,
            },
        },
    })
    .to_string()
    .into_bytes()
}

/// Everything `gpuwarden-webhook serve` needs.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// HTTPS address of `/mutate`.
    pub listen: SocketAddr,
    /// Plain-HTTP address of `/healthz`, `/readyz`, `/metrics`.
    pub health_listen: SocketAddr,
    /// Certificate and key files.
    pub tls: TlsPaths,
    /// How often the certificate files are checked for a new pair.
    pub cert_poll_interval: Duration,
    /// Serve these policies instead of watching a cluster.
    pub policy_file: Option<PathBuf>,
    /// Concurrency and size bounds.
    pub limits: Limits,
}

/// Runs the webhook until SIGTERM or SIGINT.
pub async fn run(options: ServeOptions) -> Result<(), ServerError> {
    let (trigger, shutdown) = shutdown_channel();
    let metrics = Arc::new(Metrics::new());

    let certs = Arc::new(CertStore::new());
    let mut reloader = CertReloader::new(options.tls.clone(), certs.clone(), metrics.clone());
    // Load now so a valid pair is served from the first connection; a missing Secret is
    // not fatal (the operator may create it later): readiness waits for it.
    reloader.poll_once().await;

    let mut client = None;
    let (source, synced): (Arc<dyn PolicySource>, SyncFlag) = match &options.policy_file {
        Some(path) => {
            let source = StaticPolicySource::from_file(path)?;
            tracing::info!(path = %path.display(), policies = source.policies().len(), "serving policies from a file; not watching a cluster");
            metrics.set_cache_synced("gpupolicies", true);
            metrics.set_cache_synced("namespaces", true);
            (Arc::new(source), SyncFlag::raised())
        }
        None => {
            let kube = kube::Client::try_default()
                .await
                .map_err(ServerError::Kube)?;
            client = Some(kube.clone());
            let synced = SyncFlag::new();
            let cache =
                ReflectorCache::start(kube, metrics.clone(), synced.clone(), shutdown.clone());
            (Arc::new(cache), synced)
        }
    };

    let https = TcpListener::bind(options.listen)
        .await
        .map_err(|source| ServerError::Bind {
            addr: options.listen,
            source,
        })?;
    let health = TcpListener::bind(options.health_listen)
        .await
        .map_err(|source| ServerError::Bind {
            addr: options.health_listen,
            source,
        })?;
    tracing::info!(addr = %options.health_listen, "serving /healthz, /readyz and /metrics over HTTP");

    tokio::spawn(reloader.run(options.cert_poll_interval, shutdown.clone()));
    tokio::spawn(async move {
        match wait_for_signal().await {
            Ok(signal) => tracing::info!(signal, "shutdown requested"),
            Err(error) => {
                tracing::error!(error = %error_chain(&error), "cannot wait for signals; shutting down")
            }
        }
        trigger.trigger();
    });

    let mut webhook = Webhook::new(
        Arc::new(EngineReviewer::new(source)),
        certs,
        synced,
        metrics,
        options.limits,
    );
    if let Some(client) = client {
        webhook = webhook.with_pods(Arc::new(ApiPods(client)));
    }
    webhook.serve(https, health, shutdown).await?;
    tracing::info!("stopped");
    Ok(())
}

async fn wait_for_signal() -> Result<&'static str, ServerError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).map_err(ServerError::Signal)?;
    let mut int = signal(SignalKind::interrupt()).map_err(ServerError::Signal)?;
    Ok(tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_type_accepts_json_with_parameters_only() {
        let mut headers = HeaderMap::new();
        assert!(check_content_type(&headers).unwrap().contains("missing"));
        headers.insert(
            header::CONTENT_TYPE,
            "Application/JSON; charset=utf-8".parse().unwrap(),
        );
        assert_eq!(check_content_type(&headers), None);
        headers.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
        assert!(check_content_type(&headers).unwrap().contains("text/plain"));
    }

    #[test]
    fn uid_is_read_only_from_a_review_shape() {
        assert_eq!(
            admission::request_uid(br#"{"request":{"uid":"abc"}}"#),
            "abc"
        );
        assert_eq!(admission::request_uid(b"not json"), "");
        assert_eq!(admission::request_uid(br#"{"request":"x"}"#), "");
    }

    #[test]
    fn refusal_review_is_a_denial_with_status() {
        let review: serde_json::Value =
            serde_json::from_slice(&refusal_review("u1", 413, "too big")).unwrap();
        assert_eq!(review["response"]["uid"], "u1");
        assert_eq!(review["response"]["allowed"], false);
        assert_eq!(review["response"]["status"]["code"], 413);
        assert_eq!(review["response"]["status"]["message"], "too big");
    }

    #[tokio::test]
    async fn body_over_limit_is_refused_without_being_kept() {
        let semaphore = Arc::new(Semaphore::new(4096));
        let budget = Budget {
            semaphore: &semaphore,
            wait: Duration::from_millis(50),
        };
        let headers = HeaderMap::new();
        let body = Body::from(vec![b'x'; 2048]);
        assert!(matches!(
            read_body(body, &headers, 1024, budget).await,
            Err(BodyError::TooLarge)
        ));
        assert_eq!(
            semaphore.available_permits(),
            4096,
            "room kept after a refusal"
        );
        let body = Body::from(vec![b'x'; 1024]);
        let (body, held) = read_body(body, &headers, 1024, budget).await.unwrap();
        assert_eq!(body.len(), 1024);
        assert_eq!(semaphore.available_permits(), 4096 - 1024);
        drop(held);
        assert_eq!(semaphore.available_permits(), 4096);
    }

    #[tokio::test]
    async fn bodies_wait_for_room_then_are_refused_as_overload() {
        let semaphore = Arc::new(Semaphore::new(1500));
        let budget = Budget {
            semaphore: &semaphore,
            wait: Duration::from_millis(50),
        };
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, "1000".parse().unwrap());
        let (_, first) = read_body(Body::from(vec![b'x'; 1000]), &headers, 2000, budget)
            .await
            .unwrap();
        assert!(matches!(
            read_body(Body::from(vec![b'x'; 1000]), &headers, 2000, budget).await,
            Err(BodyError::Overloaded)
        ));
        drop(first);
        assert!(
            read_body(Body::from(vec![b'x'; 1000]), &headers, 2000, budget)
                .await
                .is_ok()
        );
    }

    #[test]
    fn a_panicking_reviewer_becomes_none() {
        struct Panics;
        impl Reviewer for Panics {
            fn review(&self, _: &[u8]) -> (Vec<u8>, ReviewSummary) {
                panic!("boom")
            }
        }
        assert!(run_reviewer(&Panics, b"{}").is_none());
    }
}
