//! Shared by the server tests: a test PKI, a TLS client that trusts it, and a server started
//! in-process on 127.0.0.1:0.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use gpuwarden_webhook::admission::{Outcome, ReviewSummary};
use gpuwarden_webhook::cache::SyncFlag;
use gpuwarden_webhook::metrics::Metrics;
use gpuwarden_webhook::server::{Limits, Reviewer, ShutdownTrigger, Webhook, shutdown_channel};
use gpuwarden_webhook::tls::{CertReloader, CertStore, TlsPaths};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, SerialNumber};
use rustls::ClientConfig;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;

pub fn init() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// A certificate authority for tests.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl TestCa {
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let key = KeyPair::generate().unwrap();
        Self {
            issuer: CertifiedIssuer::self_signed(params, key).unwrap(),
        }
    }

    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A serving certificate for `localhost` and 127.0.0.1 with `serial`: (cert PEM, key PEM).
    pub fn leaf(&self, serial: u64) -> (String, String) {
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
        params.serial_number = Some(SerialNumber::from(serial));
        params.distinguished_name.push(
            rcgen::DnType::CommonName,
            "gpuwarden-webhook.gpuwarden-system.svc",
        );
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// A client configuration trusting each CA in `ca_pems`, without session resumption.
pub fn client_config(ca_pems: &[String]) -> Arc<ClientConfig> {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for pem in ca_pems {
        for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    // Every connection does a full handshake, so it shows the certificate served now (a
    // resumed TLS 1.3 session reports the certificate of the session it resumes). The API
    // server's Go client does not resume sessions either.
    config.resumption = rustls::client::Resumption::disabled();
    Arc::new(config)
}

/// One keep-alive HTTPS connection.
pub struct Conn {
    pub sender: SendRequest<Full<Bytes>>,
    /// Serial number (hex) of the certificate the server presented.
    pub serial: String,
}

/// Connects over TLS (server name `localhost`).
pub async fn connect(addr: SocketAddr, config: Arc<ClientConfig>) -> Result<Conn, String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    tcp.set_nodelay(true).map_err(|e| e.to_string())?;
    let name = ServerName::try_from("localhost").unwrap();
    let tls = TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS handshake: {e}"))?;
    let leaf = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .ok_or("no peer certificate")?
        .clone();
    let (_, parsed) = x509_parser::parse_x509_certificate(leaf.as_ref()).unwrap();
    let serial = parsed.raw_serial_as_string();
    let (sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    Ok(Conn { sender, serial })
}

/// Sends one request on `conn`: (HTTP status, body).
pub async fn post(
    conn: &mut Conn,
    path: &str,
    content_type: Option<&str>,
    body: impl Into<Bytes>,
) -> Result<(u16, Bytes), String> {
    conn.sender.ready().await.map_err(|e| e.to_string())?;
    let mut request = http::Request::post(path).header("host", "localhost");
    if let Some(content_type) = content_type {
        request = request.header("content-type", content_type);
    }
    let request = request.body(Full::new(body.into())).unwrap();
    let response = conn
        .sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, body))
}

/// Plain-HTTP GET: (status, body text).
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(connection);
    let request = http::Request::get(path)
        .header("host", "localhost")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// A reviewer that allows everything and echoes the request uid, optionally slowly.
pub struct EchoReviewer {
    pub delay: Duration,
}

impl Reviewer for EchoReviewer {
    fn review(&self, body: &[u8]) -> (Vec<u8>, ReviewSummary) {
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        let review: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
        let uid = review["request"]["uid"].as_str().unwrap_or("").to_string();
        let response = serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {"uid": uid, "allowed": true},
        });
        let summary = ReviewSummary {
            uid,
            outcome: Outcome::Allowed,
            policy: None,
            pod: None,
        };
        (response.to_string().into_bytes(), summary)
    }
}

/// [`review_body`] grown past the server's inline limit with an annotation of `padding`
/// bytes, so that the server reviews it on the blocking pool.
pub fn padded_review_body(uid: &str, padding: usize) -> Vec<u8> {
    let mut review: serde_json::Value = serde_json::from_slice(&review_body(uid)).unwrap();
    review["request"]["object"]["metadata"]["annotations"] =
        serde_json::json!({"padding": "x".repeat(padding)});
    review.to_string().into_bytes()
}

/// A minimal review of a Pod CREATE with `uid`.
pub fn review_body(uid: &str) -> Vec<u8> {
    serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "ml",
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "object": {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "train", "namespace": "ml"},
                "spec": {"containers": [{"name": "main", "image": "busybox"}]},
            },
        },
    })
    .to_string()
    .into_bytes()
}

/// Writes `content` to `path` in place (truncate + write, not atomic).
pub fn write(path: &Path, content: &str) {
    std::fs::write(path, content).unwrap();
}

/// A webhook running in-process.
pub struct TestServer {
    pub https: SocketAddr,
    pub health: SocketAddr,
    pub synced: SyncFlag,
    pub certs: Arc<CertStore>,
    pub metrics: Arc<Metrics>,
    trigger: ShutdownTrigger,
    pub task: tokio::task::JoinHandle<()>,
}

impl TestServer {
    /// Starts `reviewer` with the pair at `tls`, polled every `poll`.
    pub async fn start(
        reviewer: Arc<dyn Reviewer>,
        tls: TlsPaths,
        poll: Duration,
        synced: SyncFlag,
        limits: Limits,
    ) -> Self {
        init();
        let metrics = Arc::new(Metrics::new());
        let certs = Arc::new(CertStore::new());
        let (trigger, shutdown) = shutdown_channel();
        let mut reloader = CertReloader::new(tls, certs.clone(), metrics.clone());
        reloader.poll_once().await;
        tokio::spawn(reloader.run(poll, shutdown.clone()));
        let https = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let health = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (https_addr, health_addr) = (https.local_addr().unwrap(), health.local_addr().unwrap());
        let webhook = Webhook::new(
            reviewer,
            certs.clone(),
            synced.clone(),
            metrics.clone(),
            limits,
        );
        let task = tokio::spawn(async move {
            webhook.serve(https, health, shutdown).await.unwrap();
        });
        Self {
            https: https_addr,
            health: health_addr,
            synced,
            certs,
            metrics,
            trigger,
            task,
        }
    }

    pub fn shutdown(&self) {
        self.trigger.trigger();
    }
}

/// Writes a pair into `dir` as plain `tls.crt` / `tls.key`.
pub fn plain_pair(dir: &Path, pair: &(String, String)) -> TlsPaths {
    let paths = TlsPaths {
        cert: dir.join("tls.crt"),
        key: dir.join("tls.key"),
    };
    write(&paths.cert, &pair.0);
    write(&paths.key, &pair.1);
    paths
}

/// Lays a pair out as the kubelet mounts a Secret: `tls.crt` → `..data/tls.crt`,
/// `..data` → `..<version>`.
pub fn secret_volume(dir: &Path, version: &str, pair: &(String, String)) -> TlsPaths {
    let versioned = dir.join(format!("..{version}"));
    std::fs::create_dir(&versioned).unwrap();
    write(&versioned.join("tls.crt"), &pair.0);
    write(&versioned.join("tls.key"), &pair.1);
    std::os::unix::fs::symlink(format!("..{version}"), dir.join("..data")).unwrap();
    for file in ["tls.crt", "tls.key"] {
        std::os::unix::fs::symlink(format!("..data/{file}"), dir.join(file)).unwrap();
    }
    TlsPaths {
        cert: dir.join("tls.crt"),
        key: dir.join("tls.key"),
    }
}

/// Swaps a Secret volume to a new version the way the kubelet does: write the new
/// directory, point a temporary link at it, rename the link over `..data`, remove the old
/// directory.
pub fn swap_secret_volume(dir: &Path, old: &str, new: &str, pair: &(String, String)) {
    let versioned = dir.join(format!("..{new}"));
    std::fs::create_dir(&versioned).unwrap();
    write(&versioned.join("tls.crt"), &pair.0);
    write(&versioned.join("tls.key"), &pair.1);
    let tmp: PathBuf = dir.join("..data_tmp");
    std::os::unix::fs::symlink(format!("..{new}"), &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("..data")).unwrap();
    std::fs::remove_dir_all(dir.join(format!("..{old}"))).unwrap();
}

/// Polls `f` every 20 ms until it returns true or `timeout` passes.
pub async fn eventually(timeout: Duration, mut f: impl AsyncFnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}
