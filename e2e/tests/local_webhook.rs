//! The end-to-end suite's local webhook, checked without a cluster: it serves `/mutate` over
//! TLS at the URL it registers, with a certificate the CA it puts in `caBundle` verifies for
//! the webhook host, and answers an AdmissionReview. (Its policy cache points at an API
//! server that does not exist; the answer is whatever the webhook gives before it has
//! policies, which is still a well-formed review.)

use std::sync::Arc;
use std::time::Duration;

use gpuwarden_e2e::cluster::LocalWebhook;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Sends one HTTP/1.1 request over TLS to `url`, trusting only `ca_pem`, and returns the
/// status code and body.
async fn post(url: &str, ca_pem: &str, body: &[u8]) -> (u16, Vec<u8>) {
    let rest = url.strip_prefix("https://").expect("https URL");
    let (authority, path) = rest.split_at(rest.find('/').expect("path"));
    let (host, port) = authority.rsplit_once(':').expect("port");
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).expect("CA PEM"))
        .expect("CA");
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(authority)
        .await
        .expect("connect to the webhook");
    let name = ServerName::try_from(host.trim_matches(['[', ']']).to_string()).expect("name");
    let mut tls = connector
        .connect(name, tcp)
        .await
        .expect("TLS handshake verified against caBundle");
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    tls.write_all(head.as_bytes()).await.expect("write");
    tls.write_all(body).await.expect("write");
    let mut response = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut response)).await;
    let text = String::from_utf8_lossy(&response);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("HTTP status");
    let body_start = text.find("\r\n\r\n").map_or(response.len(), |i| i + 4);
    let mut body = response[body_start..].to_vec();
    if text
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    (status, body)
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(line_end) = data.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size = usize::from_str_radix(
            std::str::from_utf8(&data[..line_end]).unwrap_or("0").trim(),
            16,
        )
        .unwrap_or(0);
        if size == 0 {
            return out;
        }
        let start = line_end + 2;
        out.extend_from_slice(&data[start..start + size]);
        data = &data[start + size + 2..];
    }
}

/// The local webhook is reachable at its URL over verified TLS and answers an
/// AdmissionReview for the request it was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_webhook_answers_over_verified_tls() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    // An API server that is not there: the webhook's caches never sync, which is fine here.
    let config = kube::Config::new("http://127.0.0.1:9".parse().expect("url"));
    let client = kube::Client::try_from(config).expect("client");
    let webhook = LocalWebhook::start(client).await.expect("start");
    assert!(
        webhook.url.starts_with("https://127.0.0.1:") && webhook.url.ends_with("/mutate"),
        "{}",
        webhook.url
    );
    let review = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "e2e-0001",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "team-a",
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "object": {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "p", "namespace": "team-a"},
                "spec": {"containers": [{"name": "c", "image": "busybox"}]}
            }
        }
    });
    let (status, body) = post(
        &webhook.url,
        &webhook.ca_pem,
        &serde_json::to_vec(&review).expect("json"),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let answer: Value = serde_json::from_slice(&body).expect("an AdmissionReview");
    assert_eq!(answer["kind"], "AdmissionReview");
    assert_eq!(answer["response"]["uid"], "e2e-0001");
    assert!(answer["response"]["allowed"].is_boolean(), "{answer}");
    webhook.stop().await;
}
