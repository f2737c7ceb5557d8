//! The serving certificate: loaded from PEM files and reloaded without a restart.
//!
//! A mounted Secret is updated by the kubelet with an atomic symlink swap (`tls.crt` →
//! `..data/tls.crt`, `..data` → a new timestamped directory), so neither the paths nor
//! reliable mtimes change. [`CertReloader`] therefore reads both files through their links
//! every poll and compares the bytes with what it saw last. A changed, valid pair replaces
//! the one in [`CertStore`], which rustls asks for every new handshake; connections already
//! open keep theirs. A changed pair that does not load (a half-written rotation, a key that
//! does not match) is logged and counted, and the previous pair stays in use.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use gpuwarden_crds::error_chain;

use crate::shutdown::Shutdown;
use rustls::ServerConfig;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::metrics::Metrics;

/// Errors loading a certificate pair.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("failed to read {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The certificate file holds no usable PEM certificate.
    #[error("no PEM certificate in {}", path.display())]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// A PEM block could not be decoded.
    #[error("invalid PEM in {}", path.display())]
    Pem {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    /// The leaf certificate is not valid X.509.
    #[error("invalid X.509 certificate in {}: {reason}", path.display())]
    X509 {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The key is unusable or does not belong to the certificate.
    #[error("key {} does not load or does not match certificate {}", key.display(), cert.display())]
    Key {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// Why.
        #[source]
        source: rustls::Error,
    },
    /// The rustls server configuration could not be built.
    #[error("failed to build the TLS server configuration")]
    Config(#[source] rustls::Error),
}

/// Where the certificate and key live.
#[derive(Clone, Debug)]
pub struct TlsPaths {
    /// PEM certificate chain, leaf first (`tls.crt`).
    pub cert: PathBuf,
    /// PEM private key (`tls.key`): PKCS#8, PKCS#1 or SEC1.
    pub key: PathBuf,
}

/// What is known about the pair in use, for logs and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertInfo {
    /// Subject of the leaf certificate.
    pub subject: String,
    /// Serial number of the leaf certificate (hex).
    pub serial: String,
    /// notAfter of the leaf certificate, Unix seconds.
    pub not_after: i64,
}

/// A parsed, consistent certificate pair.
#[derive(Debug)]
pub struct LoadedPair {
    /// What rustls serves.
    pub key: Arc<CertifiedKey>,
    /// What the leaf says.
    pub info: CertInfo,
}

/// Parses a PEM certificate chain and key and checks that they belong together.
/// `paths` only name the files in errors.
pub fn parse_pair(
    cert_pem: &[u8],
    key_pem: &[u8],
    paths: &TlsPaths,
) -> Result<LoadedPair, TlsError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            path: paths.cert.clone(),
            source,
        })?;
    let leaf = chain.first().ok_or_else(|| TlsError::NoCertificate {
        path: paths.cert.clone(),
    })?;
    let info = cert_info(leaf).map_err(|reason| TlsError::X509 {
        path: paths.cert.clone(),
        reason,
    })?;
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|source| TlsError::Pem {
        path: paths.key.clone(),
        source,
    })?;
    let provider = rustls::crypto::ring::default_provider();
    let certified =
        CertifiedKey::from_der(chain, key, &provider).map_err(|source| TlsError::Key {
            cert: paths.cert.clone(),
            key: paths.key.clone(),
            source,
        })?;
    Ok(LoadedPair {
        key: Arc::new(certified),
        info,
    })
}

fn cert_info(der: &CertificateDer<'_>) -> Result<CertInfo, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).map_err(|e| e.to_string())?;
    Ok(CertInfo {
        subject: cert.subject().to_string(),
        serial: cert.raw_serial_as_string(),
        not_after: cert.validity().not_after.timestamp(),
    })
}

/// The certificate pair new handshakes get. Empty until the first pair loads: handshakes
/// then fail, and `/readyz` says not ready.
#[derive(Debug, Default)]
pub struct CertStore {
    current: RwLock<Option<(Arc<CertifiedKey>, CertInfo)>>,
}

impl CertStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Replaces the pair served to new handshakes.
    pub fn set(&self, pair: LoadedPair) {
        // A poisoned lock only means a writer panicked mid-assignment of an Option;
        // the value is still whole, so keep serving.
        let mut slot = self.current.write().unwrap_or_else(|e| e.into_inner());
        *slot = Some((pair.key, pair.info));
    }

    /// Whether a pair is loaded.
    pub fn is_loaded(&self) -> bool {
        self.read().is_some()
    }

    /// What is known about the pair in use.
    pub fn info(&self) -> Option<CertInfo> {
        self.read().as_ref().map(|(_, info)| info.clone())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Option<(Arc<CertifiedKey>, CertInfo)>> {
        self.current.read().unwrap_or_else(|e| e.into_inner())
    }

    /// A rustls server configuration that asks this store on every handshake and offers
    /// HTTP/2 and HTTP/1.1 by ALPN.
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<ServerConfig>, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Config)?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.read().as_ref().map(|(key, _)| key.clone())
    }
}

/// What one poll found.
#[derive(Debug, PartialEq, Eq)]
pub enum PollResult {
    /// The files hold what was seen last time.
    Unchanged,
    /// A new pair was loaded and is now served.
    Loaded(CertInfo),
    /// The files changed but do not load; the previous pair (if any) stays.
    Rejected,
}

/// Watches the certificate files and feeds [`CertStore`].
#[derive(Debug)]
pub struct CertReloader {
    paths: TlsPaths,
    store: Arc<CertStore>,
    metrics: Arc<Metrics>,
    /// Bytes of the last pair seen, loaded or not, so a bad pair is reported once and a
    /// good one is not reparsed every poll.
    last_seen: Option<(Vec<u8>, Vec<u8>)>,
    /// Whether the last poll could not read the files.
    unreadable: bool,
}

impl CertReloader {
    /// A reloader for `paths` feeding `store`.
    pub fn new(paths: TlsPaths, store: Arc<CertStore>, metrics: Arc<Metrics>) -> Self {
        Self {
            paths,
            store,
            metrics,
            last_seen: None,
            unreadable: false,
        }
    }

    /// Reads both files and loads them if they changed.
    pub async fn poll_once(&mut self) -> PollResult {
        let read = async |path: &Path| {
            tokio::fs::read(path)
                .await
                .map_err(|source| TlsError::Read {
                    path: path.to_path_buf(),
                    source,
                })
        };
        let files = match (read(&self.paths.cert).await, read(&self.paths.key).await) {
            (Ok(cert), Ok(key)) => (cert, key),
            (Err(error), _) | (_, Err(error)) => {
                // Missing files are normal before the Secret exists, and stay missing for
                // many polls: report and count the change to unreadable once.
                if !self.unreadable {
                    self.unreadable = true;
                    self.last_seen = None;
                    self.metrics.observe_cert_error();
                    tracing::warn!(
                        error = %error_chain(&error),
                        serving = ?self.store.info().map(|i| i.serial),
                        "serving certificate files not readable; keeping the current pair"
                    );
                }
                return PollResult::Rejected;
            }
        };
        self.unreadable = false;
        if self.last_seen.as_ref() == Some(&files) {
            return PollResult::Unchanged;
        }
        let result = parse_pair(&files.0, &files.1, &self.paths);
        self.last_seen = Some(files);
        match result {
            Ok(pair) => {
                let info = pair.info.clone();
                self.store.set(pair);
                self.metrics.observe_cert_loaded(info.not_after);
                tracing::info!(
                    subject = %info.subject,
                    serial = %info.serial,
                    not_after = info.not_after,
                    "serving certificate loaded"
                );
                PollResult::Loaded(info)
            }
            Err(error) => {
                self.metrics.observe_cert_error();
                tracing::error!(
                    error = %error_chain(&error),
                    serving = ?self.store.info().map(|i| i.serial),
                    "new serving certificate rejected; keeping the current one"
                );
                PollResult::Rejected
            }
        }
    }

    /// Polls every `interval` until `shutdown` fires.
    pub async fn run(mut self, interval: Duration, shutdown: Shutdown) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {
                    self.poll_once().await;
                }
                () = shutdown.wait() => return,
            }
        }
    }
}
