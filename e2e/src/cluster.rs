//! Driving a real cluster for the end-to-end tests: a client that refuses to start without
//! an explicit `KUBECONFIG`, a cleanup guard that deletes what a test created even when the
//! test fails, raw requests that keep the API server's `Warning` headers, feature
//! discovery, and the in-process webhook with a generated certificate.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use gpuwarden_crds::admission::policies::{
    ADMISSION_GROUP, KIND_MUTATING, KIND_MUTATING_BINDING, MutatingApi, Rendered,
};
use gpuwarden_webhook::admission::{PolicySource, StaticSource};
use gpuwarden_webhook::cache::{ReflectorCache, SyncFlag};
use gpuwarden_webhook::metrics::Metrics;
use gpuwarden_webhook::server::{EngineReviewer, Limits, ShutdownTrigger, Webhook};
use gpuwarden_webhook::tls::{CertStore, TlsPaths};
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use kube::api::{ApiResource, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::{Api, Client};
use serde_json::Value;

/// Errors talking to the cluster or setting up the local components.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// `KUBECONFIG` is not set: the suite never picks a cluster by accident.
    #[error(
        "KUBECONFIG is not set; the end-to-end tests create and delete namespaces, nodes, policies and webhook configurations, so point KUBECONFIG at a disposable cluster (kind, k3d)"
    )]
    NoKubeconfig,
    /// The client could not be built.
    #[error("failed to build a client from KUBECONFIG")]
    Client(#[source] kube::Error),
    /// A request failed.
    #[error("failed to {what}")]
    Api {
        /// What was being done.
        what: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// A body could not be read or parsed.
    #[error("failed to read the answer to {what}: {message}")]
    Body {
        /// What was being done.
        what: String,
        /// Why.
        message: String,
    },
    /// The local webhook could not start.
    #[error("failed to start the local webhook: {0}")]
    Webhook(String),
}

/// A client for the cluster in `KUBECONFIG`, and what the server supports.
#[derive(Clone)]
pub struct Cluster {
    /// The client.
    pub client: Client,
    /// A short random id naming everything this test run creates.
    pub run_id: String,
    /// Server minor version (`1.<minor>`), 0 when the server does not say.
    pub minor: u32,
}

impl Cluster {
    /// Connects to the cluster in `KUBECONFIG` (which must be set).
    pub async fn connect() -> Result<Self, ClusterError> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        if std::env::var_os("KUBECONFIG").is_none() {
            return Err(ClusterError::NoKubeconfig);
        }
        let client = Client::try_default().await.map_err(ClusterError::Client)?;
        let version = client
            .apiserver_version()
            .await
            .map_err(|source| ClusterError::Api {
                what: "read the server version".into(),
                source,
            })?;
        let minor = version
            .minor
            .trim_end_matches(|c: char| !c.is_ascii_digit())
            .parse()
            .unwrap_or(0);
        let run_id = format!("{:08x}", rand::random::<u32>());
        Ok(Self {
            client,
            run_id,
            minor,
        })
    }

    /// The same cluster, every request sent as ServiceAccount `name` of `namespace`
    /// (impersonated, with the groups a ServiceAccount's token carries): the API server's
    /// own authorization decides what it may do.
    pub async fn as_service_account(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Self, ClusterError> {
        let mut config = kube::Config::infer()
            .await
            .map_err(|e| ClusterError::Client(kube::Error::InferConfig(e)))?;
        config.auth_info.impersonate = Some(format!("system:serviceaccount:{namespace}:{name}"));
        config.auth_info.impersonate_groups = Some(vec![
            "system:serviceaccounts".into(),
            format!("system:serviceaccounts:{namespace}"),
            "system:authenticated".into(),
        ]);
        let client = Client::try_from(config).map_err(ClusterError::Client)?;
        Ok(Self {
            client,
            ..self.clone()
        })
    }

    /// Whether `group_version` (e.g. `admissionregistration.k8s.io/v1`) serves `resource`.
    pub async fn serves(&self, group_version: &str, resource: &str) -> bool {
        let path = if group_version == "v1" {
            "/api/v1".to_string()
        } else {
            format!("/apis/{group_version}")
        };
        let Ok(request) = Request::get(path).body(Vec::new()) else {
            return false;
        };
        match self.client.request::<Value>(request).await {
            Ok(list) => list["resources"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|r| r["name"] == resource),
            Err(_) => false,
        }
    }

    /// The version of `admissionregistration.k8s.io` that serves MutatingAdmissionPolicy, if
    /// any.
    pub async fn mutating_policy_api(&self) -> Option<MutatingApi> {
        for api in [MutatingApi::V1, MutatingApi::V1beta1] {
            if self
                .serves(api.api_version(), "mutatingadmissionpolicies")
                .await
            {
                return Some(api);
            }
        }
        None
    }

    /// Creates the MutatingAdmissionPolicy and binding in `rendered` under `name`, the
    /// binding selecting only `namespaces` and the policy owned by nothing (so only `cleanup`
    /// deletes them). Returns the policy as created.
    pub async fn install_mutating_policy(
        &self,
        rendered: Vec<Rendered>,
        api: MutatingApi,
        name: &str,
        namespaces: &[&str],
        cleanup: &Cleanup,
    ) -> Result<Value, ClusterError> {
        let mut policy = Value::Null;
        for mut rendered in rendered {
            let object = &mut rendered.object;
            object["metadata"]["name"] = Value::from(name);
            if let Some(meta) = object["metadata"].as_object_mut() {
                meta.remove("ownerReferences");
            }
            let plural = if rendered.kind == KIND_MUTATING_BINDING {
                object["spec"]["policyName"] = Value::from(name);
                object["spec"]["matchResources"]["namespaceSelector"] =
                    namespaces_named(namespaces);
                "mutatingadmissionpolicybindings"
            } else {
                "mutatingadmissionpolicies"
            };
            let path = format!("/apis/{}/{plural}", api.api_version());
            let what = format!("create {plural} {name}");
            let r = self
                .raw(Method::POST, &path, "application/json", Some(object))
                .await?;
            if !r.status.is_success() {
                return Err(ClusterError::Body {
                    what,
                    message: r.message().to_owned(),
                });
            }
            cleanup.own(
                ApiResource {
                    group: ADMISSION_GROUP.into(),
                    version: api.version().into(),
                    api_version: api.api_version().into(),
                    kind: rendered.kind.into(),
                    plural: plural.into(),
                },
                None,
                name,
            );
            if rendered.kind == KIND_MUTATING {
                policy = r.body;
            }
        }
        Ok(policy)
    }

    /// Sends a request with a JSON body and returns the status, the JSON answer and the
    /// `Warning` headers (kubectl prints these; kube-rs does not surface them).
    pub async fn raw(
        &self,
        method: Method,
        path: &str,
        content_type: &str,
        body: Option<&Value>,
    ) -> Result<RawResponse, ClusterError> {
        self.raw_as(method, path, content_type, body, &[]).await
    }

    /// [`Cluster::raw`] with extra headers (e.g. `Impersonate-User`).
    pub async fn raw_as(
        &self,
        method: Method,
        path: &str,
        content_type: &str,
        body: Option<&Value>,
        headers: &[(&str, &str)],
    ) -> Result<RawResponse, ClusterError> {
        let what = format!("{method} {path}");
        let bytes = match body {
            Some(b) => serde_json::to_vec(b).map_err(|e| ClusterError::Body {
                what: what.clone(),
                message: e.to_string(),
            })?,
            None => Vec::new(),
        };
        let mut builder = Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::CONTENT_TYPE, content_type)
            .header(http::header::ACCEPT, "application/json");
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let request =
            builder
                .body(kube::client::Body::from(bytes))
                .map_err(|e| ClusterError::Body {
                    what: what.clone(),
                    message: e.to_string(),
                })?;
        let response = self
            .client
            .send(request)
            .await
            .map_err(|source| ClusterError::Api {
                what: what.clone(),
                source,
            })?;
        let status = response.status();
        let warnings = response
            .headers()
            .get_all(http::header::WARNING)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(warning_text)
            .collect();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| ClusterError::Body {
                what: what.clone(),
                message: e.to_string(),
            })?
            .to_bytes();
        let json = serde_json::from_slice(&body).unwrap_or(Value::Null);
        Ok(RawResponse {
            status,
            body: json,
            warnings,
        })
    }

    /// Creates a pod through a raw request (so the admission warnings come back).
    pub async fn create_pod(
        &self,
        namespace: &str,
        pod: &Value,
        dry_run: bool,
    ) -> Result<RawResponse, ClusterError> {
        let dry = if dry_run { "?dryRun=All" } else { "" };
        self.raw(
            Method::POST,
            &format!("/api/v1/namespaces/{namespace}/pods{dry}"),
            "application/json",
            Some(pod),
        )
        .await
    }
}

/// The namespace selector of the namespaces named `names`.
pub fn namespaces_named(names: &[&str]) -> Value {
    serde_json::json!({"matchExpressions": [{"key": gpuwarden_crds::LABEL_NAMESPACE_NAME,
        "operator": "In", "values": names}]})
}

/// What admission decided of a stored pod, for comparing two admission paths: its init and
/// regular containers less their volume mounts (the service-account token's volume has a
/// random name), and gpuwarden's annotations.
pub fn admitted(pod: &Value) -> Value {
    let containers = |field: &str| -> Vec<Value> {
        (pod["spec"][field].as_array().into_iter().flatten())
            .map(|c| {
                let mut c = c.clone();
                c.as_object_mut().map(|c| c.remove("volumeMounts"));
                c
            })
            .collect()
    };
    let ours: serde_json::Map<String, Value> = (pod["metadata"]["annotations"].as_object())
        .into_iter()
        .flatten()
        .filter(|(k, _)| k.starts_with(gpuwarden_crds::ANNOTATION_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    serde_json::json!({"initContainers": containers("initContainers"),
        "containers": containers("containers"), "annotations": ours})
}

/// The text of a `Warning` header (`299 - "text"`).
pub fn warning_text(header: &str) -> String {
    let rest = header
        .strip_prefix("299 - ")
        .or_else(|| header.strip_prefix("299 "))
        .unwrap_or(header);
    rest.trim_matches('"').replace("\\\"", "\"")
}

/// A raw answer: status, JSON body, warnings.
#[derive(Clone, Debug)]
pub struct RawResponse {
    /// HTTP status.
    pub status: StatusCode,
    /// JSON body (`Null` when not JSON).
    pub body: Value,
    /// `Warning` header texts.
    pub warnings: Vec<String>,
}

impl RawResponse {
    /// The `message` of a failure `Status`.
    pub fn message(&self) -> &str {
        self.body["message"].as_str().unwrap_or_default()
    }
}

/// One object to delete at the end of a test.
#[derive(Clone, Debug)]
struct Owned {
    resource: ApiResource,
    namespace: Option<String>,
    name: String,
}

/// Deletes, in reverse order of creation, everything registered with it, when dropped:
/// also when the test panics. Deletion runs on its own thread and runtime, because drop
/// may happen inside (or after) the test's runtime.
pub struct Cleanup {
    client: Client,
    owned: Arc<Mutex<Vec<Owned>>>,
}

impl Cleanup {
    /// A guard deleting through `client`.
    pub fn new(client: Client) -> Self {
        Self {
            client,
            owned: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// Registers an object to delete (`namespace` `None` for cluster-scoped objects).
    pub fn own(&self, resource: ApiResource, namespace: Option<&str>, name: &str) {
        self.owned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Owned {
                resource,
                namespace: namespace.map(str::to_string),
                name: name.to_string(),
            });
    }

    /// Registers a typed object to delete.
    pub fn own_typed<K>(&self, namespace: Option<&str>, name: &str)
    where
        K: kube::Resource<DynamicType = ()>,
    {
        self.own(ApiResource::erase::<K>(&()), namespace, name);
    }

    /// Deletes everything now (and forgets it).
    pub async fn run(&self) {
        let owned: Vec<Owned> =
            std::mem::take(&mut *self.owned.lock().unwrap_or_else(PoisonError::into_inner));
        for o in owned.into_iter().rev() {
            let api: Api<DynamicObject> = match &o.namespace {
                Some(ns) => Api::namespaced_with(self.client.clone(), ns, &o.resource),
                None => Api::all_with(self.client.clone(), &o.resource),
            };
            match api.delete(&o.name, &DeleteParams::background()).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => eprintln!(
                    "cleanup: failed to delete {} {}: {e}",
                    o.resource.kind, o.name
                ),
            }
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let has_work = !self
            .owned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty();
        if !has_work {
            return;
        }
        let guard = Cleanup {
            client: self.client.clone(),
            owned: self.owned.clone(),
        };
        let done = std::thread::spawn(move || {
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(async {
                    // A client of this runtime: the test's runtime may be unwinding or
                    // blocked on this very thread's join.
                    let guard = match Client::try_default().await {
                        Ok(client) => Cleanup {
                            client,
                            owned: guard.owned.clone(),
                        },
                        Err(_) => guard,
                    };
                    let _ = tokio::time::timeout(Duration::from_secs(60), guard.run()).await;
                }),
                Err(e) => eprintln!("cleanup: failed to start a runtime: {e}"),
            }
            // The guard's own Drop sees an empty list.
        });
        let _ = done.join();
    }
}

/// Polls `check` every 500 ms until it returns `Some` or `timeout` passes.
pub async fn wait_for<T, F, Fut>(timeout: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Waits up to `timeout` while `name` is being deleted (a previous test removed what it
/// made, and the server is not done): `Some` of what is there then (`None` for nothing),
/// `None` when it is still being deleted.
///
/// A CustomResourceDefinition deleted just after it was created can fail its cleanup while
/// its storage reinitializes ("storage is (re)initializing"); the API server then retries
/// with a backoff that soon grows to minutes. Every 10 s of waiting, its metadata is touched
/// (an annotation), which requeues that cleanup at once.
pub async fn settled<K>(api: &Api<K>, name: &str, timeout: Duration) -> Option<Option<K>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let crd = api.resource_url().ends_with("/customresourcedefinitions");
    let deadline = Instant::now() + timeout;
    let mut touched = Instant::now();
    let mut requeues = 0u32;
    loop {
        match api.get_opt(name).await {
            Ok(Some(o)) if o.meta().deletion_timestamp.is_some() => {
                if crd && touched.elapsed() >= Duration::from_secs(10) {
                    touched = Instant::now();
                    requeues += 1;
                    let requeue = serde_json::json!({"metadata": {"annotations": {
                        "gpuwarden.io/e2e-requeue": requeues.to_string()}}});
                    let _ = api
                        .patch(name, &PatchParams::default(), &Patch::Merge(&requeue))
                        .await;
                }
            }
            Ok(current) => return Some(current),
            // Its type is not served (a CRD's kind, once the CRD is gone): nothing is there.
            Err(kube::Error::Api(e)) if e.code == 404 => return Some(None),
            Err(_) => {}
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Prints why a test (or part of one) is skipped. The test then returns successfully: the
/// server lacks the feature, which is not gpuwarden's failure.
pub fn skip(what: &str, why: &str) {
    eprintln!("SKIPPED {what}: {why}");
}

/// The gpuwarden webhook, running in this process over real TLS with a certificate for
/// `$GPUWARDEN_E2E_WEBHOOK_HOST`, reading GpuPolicy objects from the cluster.
pub struct LocalWebhook {
    /// `https://HOST:PORT/mutate`, what the API server calls.
    pub url: String,
    /// The CA that signed the serving certificate (PEM), for `caBundle`.
    pub ca_pem: String,
    /// The webhook's metrics.
    pub metrics: Arc<Metrics>,
    /// Raised once the policy and namespace caches have synced.
    pub synced: SyncFlag,
    trigger: ShutdownTrigger,
    task: tokio::task::JoinHandle<()>,
}

/// Where the API server reaches the local webhook: `$GPUWARDEN_E2E_WEBHOOK_HOST`, default
/// 127.0.0.1 (right for an API server on this machine; for kind or k3d use an address of
/// this machine the control-plane container can reach, e.g. the docker bridge gateway).
pub fn webhook_host() -> String {
    std::env::var("GPUWARDEN_E2E_WEBHOOK_HOST")
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "127.0.0.1".to_string())
}

impl LocalWebhook {
    /// Starts the webhook on an ephemeral port (`$GPUWARDEN_E2E_WEBHOOK_PORT` to pick one),
    /// listening on every address unless the host is loopback.
    pub async fn start(client: Client) -> Result<Self, ClusterError> {
        let (trigger, shutdown) = gpuwarden_webhook::server::shutdown_channel();
        let metrics = Arc::new(Metrics::new());
        let synced = SyncFlag::new();
        let cache = ReflectorCache::start(
            client.clone(),
            metrics.clone(),
            synced.clone(),
            shutdown.clone(),
        );
        let reviewer = Arc::new(EngineReviewer::new(Arc::new(cache)));
        let pods: Arc<dyn gpuwarden_webhook::server::PodLookup> =
            Arc::new(gpuwarden_webhook::server::ApiPods(client));
        Self::serve_with(reviewer, metrics, synced, (trigger, shutdown), Some(pods)).await
    }

    /// [`LocalWebhook::start`] answering from fixed policies and namespace labels, with no
    /// cluster to watch.
    pub async fn start_static(source: StaticSource) -> Result<Self, ClusterError> {
        let channel = gpuwarden_webhook::server::shutdown_channel();
        let metrics = Arc::new(Metrics::new());
        Self::serve(Arc::new(source), metrics, SyncFlag::raised(), channel).await
    }

    /// A webhook over real TLS that answers with `reviewer` instead of gpuwarden's engine
    /// (a model of another project's webhook), with no cluster to watch.
    pub async fn start_reviewer(
        reviewer: Arc<dyn gpuwarden_webhook::server::Reviewer>,
    ) -> Result<Self, ClusterError> {
        let channel = gpuwarden_webhook::server::shutdown_channel();
        let metrics = Arc::new(Metrics::new());
        Self::serve_with(reviewer, metrics, SyncFlag::raised(), channel, None).await
    }

    async fn serve(
        source: Arc<dyn PolicySource>,
        metrics: Arc<Metrics>,
        synced: SyncFlag,
        channel: (ShutdownTrigger, gpuwarden_webhook::server::Shutdown),
    ) -> Result<Self, ClusterError> {
        let reviewer = Arc::new(EngineReviewer::new(source));
        Self::serve_with(reviewer, metrics, synced, channel, None).await
    }

    async fn serve_with(
        reviewer: Arc<dyn gpuwarden_webhook::server::Reviewer>,
        metrics: Arc<Metrics>,
        synced: SyncFlag,
        (trigger, shutdown): (ShutdownTrigger, gpuwarden_webhook::server::Shutdown),
        pods: Option<Arc<dyn gpuwarden_webhook::server::PodLookup>>,
    ) -> Result<Self, ClusterError> {
        let host = webhook_host();
        let err = |e: &dyn std::fmt::Display| ClusterError::Webhook(e.to_string());
        let (ca_pem, cert_pem, key_pem) = certificate_for(&host).map_err(|e| err(&e))?;
        let paths = TlsPaths {
            cert: "generated.crt".into(),
            key: "generated.key".into(),
        };
        let pair =
            gpuwarden_webhook::tls::parse_pair(cert_pem.as_bytes(), key_pem.as_bytes(), &paths)
                .map_err(|e| err(&e))?;
        let certs = Arc::new(CertStore::new());
        certs.set(pair);

        let port: u16 = std::env::var("GPUWARDEN_E2E_WEBHOOK_PORT")
            .ok()
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        let bind_ip: IpAddr = match host.parse::<IpAddr>() {
            Ok(ip) if ip.is_loopback() => ip,
            _ => IpAddr::from([0, 0, 0, 0]),
        };
        let https = tokio::net::TcpListener::bind(SocketAddr::new(bind_ip, port))
            .await
            .map_err(|e| err(&e))?;
        let health = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .map_err(|e| err(&e))?;
        let port = https.local_addr().map_err(|e| err(&e))?.port();
        let url_host = match host.parse::<IpAddr>() {
            Ok(IpAddr::V6(v6)) => format!("[{v6}]"),
            _ => host.clone(),
        };

        let mut webhook = Webhook::new(
            reviewer,
            certs,
            synced.clone(),
            metrics.clone(),
            Limits {
                drain_timeout: Duration::from_secs(2),
                ..Limits::default()
            },
        );
        if let Some(pods) = pods {
            webhook = webhook.with_pods(pods);
        }
        let task = tokio::spawn(async move {
            if let Err(e) = webhook.serve(https, health, shutdown).await {
                eprintln!("local webhook stopped: {e}");
            }
        });
        Ok(Self {
            url: format!(
                "https://{url_host}:{port}{}",
                gpuwarden_crds::install::MUTATE_PATH
            ),
            ca_pem,
            metrics,
            synced,
            trigger,
            task,
        })
    }

    /// Waits until the caches have synced.
    pub async fn wait_synced(&self, timeout: Duration) -> bool {
        let synced = self.synced.clone();
        wait_for(timeout, || {
            let synced = synced.clone();
            async move { synced.get().then_some(()) }
        })
        .await
        .is_some()
    }

    /// Reviews the engine answered so far (all outcomes).
    pub fn reviews(&self) -> u64 {
        let text = self.metrics.encode().unwrap_or_default();
        text.lines()
            .filter(|l| l.starts_with("gpuwarden_webhook_reviews_total"))
            .filter_map(|l| l.rsplit(' ').next())
            .filter_map(|v| v.parse::<f64>().ok())
            .sum::<f64>() as u64
    }

    /// Stops the webhook and waits for it.
    pub async fn stop(self) {
        self.trigger.trigger();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.task).await;
    }
}

/// A CA and a serving certificate for `host` (an IP SAN for an address, a DNS SAN
/// otherwise): (CA PEM, certificate PEM, key PEM).
pub fn certificate_for(host: &str) -> Result<(String, String, String), rcgen::Error> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "gpuwarden e2e CA");
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(vec![host.to_string()])?;
    params
        .distinguished_name
        .push(DnType::CommonName, "gpuwarden e2e webhook");
    let cert = params.signed_by(&key, &issuer)?;
    Ok((ca_cert.pem(), cert.pem(), key.serialize_pem()))
}

/// Standard base64 (what `caBundle` holds).
pub fn base64(bytes: &[u8]) -> String {
    const CHARS: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(CHARS[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The GPU UUIDs a container printed as `NVIDIA_VISIBLE_DEVICES=...` lines of its log, sorted.
pub fn visible_in_log(log: &str) -> Vec<String> {
    let mut ids: Vec<String> = (log.lines())
        .filter_map(|l| l.strip_prefix("NVIDIA_VISIBLE_DEVICES="))
        .flat_map(|v| v.split(',').map(str::to_owned))
        .collect();
    ids.sort();
    ids
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime, pem::PemObject};

    #[test]
    fn base64_matches_the_standard_alphabet_and_padding() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"\xff\xfe\xfd\xfc"), "//79/A==");
    }

    #[test]
    fn warning_headers_lose_their_code_and_quotes() {
        assert_eq!(
            warning_text(r#"299 - "gpuwarden: container train: privileged removed""#),
            "gpuwarden: container train: privileged removed"
        );
    }

    /// The generated certificate verifies for the webhook host as the API server checks
    /// it: against the CA in caBundle, with the host as an IP SAN (or a DNS SAN).
    #[test]
    fn generated_certificate_verifies_for_the_host() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        for (host, name) in [
            ("127.0.0.1", ServerName::try_from("127.0.0.1").expect("ip")),
            (
                "host.docker.internal",
                ServerName::try_from("host.docker.internal").expect("dns"),
            ),
        ] {
            let (ca, cert, key) = certificate_for(host).expect("certificate");
            let paths = TlsPaths {
                cert: "c".into(),
                key: "k".into(),
            };
            gpuwarden_webhook::tls::parse_pair(cert.as_bytes(), key.as_bytes(), &paths)
                .expect("the webhook accepts the pair");
            let mut roots = rustls::RootCertStore::empty();
            roots
                .add(CertificateDer::from_pem_slice(ca.as_bytes()).expect("CA PEM"))
                .expect("CA");
            let verifier = rustls::client::WebPkiServerVerifier::builder(Arc::new(roots))
                .build()
                .expect("verifier");
            let leaf = CertificateDer::from_pem_slice(cert.as_bytes()).expect("leaf PEM");
            verifier
                .verify_server_cert(&leaf, &[], &name, &[], UnixTime::now())
                .unwrap_or_else(|e| panic!("{host}: {e}"));
            let other = ServerName::try_from("10.1.2.3").expect("ip");
            assert!(
                verifier
                    .verify_server_cert(&leaf, &[], &other, &[], UnixTime::now())
                    .is_err()
            );
        }
    }
}
