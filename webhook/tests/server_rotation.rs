//! Certificate rotation under load: requests keep flowing from a background task (new
//! connections and one long-lived keep-alive connection) while the certificate files are
//! rewritten in place and swapped the way the kubelet updates a mounted Secret. New
//! connections must see the new certificate, and no request may fail.

mod server_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use gpuwarden_webhook::cache::SyncFlag;
use gpuwarden_webhook::server::Limits;
use rustls::ClientConfig;
use server_support::*;

const POLL: Duration = Duration::from_millis(100);

/// Counts of what the background load saw.
#[derive(Default)]
struct Load {
    ok: AtomicUsize,
    failed: AtomicUsize,
    stop: AtomicBool,
    failures: std::sync::Mutex<Vec<String>>,
}

impl Load {
    fn fail(&self, what: String) {
        self.failed.fetch_add(1, Ordering::SeqCst);
        self.failures.lock().unwrap().push(what);
    }

    fn check(&self, result: Result<(u16, bytes::Bytes), String>, uid: &str) {
        match result {
            Ok((200, body)) => {
                let answer: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                if answer["response"]["uid"] == uid && answer["response"]["allowed"] == true {
                    self.ok.fetch_add(1, Ordering::SeqCst);
                } else {
                    self.fail(format!("unexpected answer: {answer}"));
                }
            }
            Ok((status, _)) => self.fail(format!("status {status}")),
            Err(error) => self.fail(error),
        }
    }
}

/// Sends requests until told to stop: on a fresh connection each time (so handshakes happen
/// during the rotation) and on one keep-alive connection opened before it.
fn start_load(
    server: &TestServer,
    config: Arc<ClientConfig>,
) -> (Arc<Load>, tokio::task::JoinHandle<()>) {
    let load = Arc::new(Load::default());
    let addr = server.https;
    let task = {
        let load = load.clone();
        tokio::spawn(async move {
            let mut keep_alive = connect(addr, config.clone()).await.unwrap();
            let mut i = 0u64;
            while !load.stop.load(Ordering::SeqCst) {
                i += 1;
                let uid = format!("fresh-{i}");
                match connect(addr, config.clone()).await {
                    Ok(mut conn) => {
                        let result = post(
                            &mut conn,
                            "/mutate",
                            Some("application/json"),
                            review_body(&uid),
                        )
                        .await;
                        load.check(result, &uid);
                    }
                    Err(error) => load.fail(format!("connect: {error}")),
                }
                let uid = format!("kept-{i}");
                let result = post(
                    &mut keep_alive,
                    "/mutate",
                    Some("application/json"),
                    review_body(&uid),
                )
                .await;
                load.check(result, &uid);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    (load, task)
}

async fn wait_for_requests(load: &Load, at_least: usize) {
    let start = load.ok.load(Ordering::SeqCst);
    assert!(
        eventually(Duration::from_secs(10), async || load
            .ok
            .load(Ordering::SeqCst)
            >= start + at_least)
        .await,
        "load stalled"
    );
}

async fn wait_for_serial(server: &TestServer, config: &Arc<ClientConfig>, serial: &str) {
    let mut last = String::new();
    let seen = eventually(Duration::from_secs(10), async || {
        last = match connect(server.https, config.clone()).await {
            Ok(conn) => conn.serial,
            Err(error) => error,
        };
        last == serial
    })
    .await;
    assert!(
        seen,
        "new connections never saw certificate serial {serial}; last saw {last}"
    );
}

async fn stop(load: Arc<Load>, task: tokio::task::JoinHandle<()>) {
    load.stop.store(true, Ordering::SeqCst);
    task.await.unwrap();
    let failures = load.failures.lock().unwrap().clone();
    assert_eq!(
        load.failed.load(Ordering::SeqCst),
        0,
        "failed requests: {failures:?}"
    );
    assert!(load.ok.load(Ordering::SeqCst) > 20);
}

fn reload_errors(metrics: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("gpuwarden_webhook_certificate_reload_errors_total "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn echo() -> Arc<EchoReviewer> {
    Arc::new(EchoReviewer {
        delay: Duration::ZERO,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewriting_the_files_rotates_to_another_ca_without_a_failed_request() {
    let dir = tempfile::tempdir().unwrap();
    let (ca_a, ca_b) = (TestCa::new("CA A"), TestCa::new("CA B"));
    let paths = plain_pair(dir.path(), &ca_a.leaf(0x71));
    let server = TestServer::start(
        echo(),
        paths.clone(),
        POLL,
        SyncFlag::raised(),
        Limits::default(),
    )
    .await;
    // Clients trust both CAs, as the API server does while caBundle holds old and new.
    let config = client_config(&[ca_a.pem(), ca_b.pem()]);
    assert_eq!(
        connect(server.https, config.clone()).await.unwrap().serial,
        "71"
    );

    let (load, task) = start_load(&server, config.clone());
    wait_for_requests(&load, 20).await;

    // Written in place, certificate first: for a moment the files do not match. That pair
    // must be rejected and the old one kept, then the matching pair taken.
    let pair_b = ca_b.leaf(0x72);
    write(&paths.cert, &pair_b.0);
    tokio::time::sleep(POLL * 3).await;
    assert_eq!(
        connect(server.https, config.clone()).await.unwrap().serial,
        "71"
    );
    write(&paths.key, &pair_b.1);
    wait_for_serial(&server, &config, "72").await;
    wait_for_requests(&load, 20).await;
    stop(load, task).await;

    let (_, metrics) = http_get(server.health, "/metrics").await;
    assert!(
        metrics.contains("gpuwarden_webhook_certificate_reloads_total 2"),
        "{metrics}"
    );
    assert!(
        reload_errors(&metrics) >= 1,
        "the mismatched pair was not reported: {metrics}"
    );
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_symlink_swap_rotates_without_a_failed_request() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("CA");
    let other_ca = TestCa::new("next CA");
    let paths = secret_volume(dir.path(), "2026_11_22_01_00_00.1", &ca.leaf(0x11));
    let server =
        TestServer::start(echo(), paths, POLL, SyncFlag::raised(), Limits::default()).await;
    let config = client_config(&[ca.pem(), other_ca.pem()]);
    assert_eq!(
        connect(server.https, config.clone()).await.unwrap().serial,
        "11"
    );

    let (load, task) = start_load(&server, config.clone());
    wait_for_requests(&load, 20).await;

    // Same CA, new serial.
    swap_secret_volume(
        dir.path(),
        "2026_11_22_01_00_00.1",
        "2026_11_22_02_00_00.2",
        &ca.leaf(0x22),
    );
    wait_for_serial(&server, &config, "22").await;
    wait_for_requests(&load, 20).await;

    // And again, to a certificate from another CA.
    swap_secret_volume(
        dir.path(),
        "2026_11_22_02_00_00.2",
        "2026_11_22_03_00_00.3",
        &other_ca.leaf(0x33),
    );
    wait_for_serial(&server, &config, "33").await;
    wait_for_requests(&load, 20).await;
    stop(load, task).await;

    let (_, metrics) = http_get(server.health, "/metrics").await;
    assert!(
        metrics.contains("gpuwarden_webhook_certificate_reloads_total 3"),
        "{metrics}"
    );
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_new_pair_is_rejected_and_the_old_one_kept() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("CA");
    let paths = plain_pair(dir.path(), &ca.leaf(0x42));
    let server = TestServer::start(
        echo(),
        paths.clone(),
        POLL,
        SyncFlag::raised(),
        Limits::default(),
    )
    .await;
    let config = client_config(&[ca.pem()]);

    let (load, task) = start_load(&server, config.clone());
    wait_for_requests(&load, 10).await;
    write(
        &paths.cert,
        "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
    );
    write(&paths.key, "garbage");
    tokio::time::sleep(POLL * 5).await;
    wait_for_requests(&load, 10).await;
    assert_eq!(
        connect(server.https, config.clone()).await.unwrap().serial,
        "42"
    );
    assert_eq!(http_get(server.health, "/readyz").await.0, 200);
    let (_, metrics) = http_get(server.health, "/metrics").await;
    assert!(
        metrics.contains("gpuwarden_webhook_certificate_reloads_total 1"),
        "{metrics}"
    );
    assert!(reload_errors(&metrics) >= 1, "{metrics}");

    // Deleting the files (a Secret removed) also keeps the pair in use.
    std::fs::remove_file(&paths.cert).unwrap();
    tokio::time::sleep(POLL * 3).await;
    assert_eq!(
        connect(server.https, config.clone()).await.unwrap().serial,
        "42"
    );

    // A good pair afterwards is taken.
    let good = ca.leaf(0x43);
    write(&paths.cert, &good.0);
    write(&paths.key, &good.1);
    wait_for_serial(&server, &config, "43").await;
    stop(load, task).await;
    server.shutdown();
}
