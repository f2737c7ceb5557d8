//! The HTTPS server over real TLS on 127.0.0.1: transport-level bad inputs, readiness,
//! metrics, overload and graceful shutdown. The engine is replaced by a reviewer that echoes
//! the uid, so these tests hold whatever the engine decides.

mod server_support;

use std::sync::Arc;
use std::time::Duration;

use gpuwarden_webhook::cache::SyncFlag;
use gpuwarden_webhook::server::{Limits, MAX_BODY_BYTES};
use serde_json::Value;
use server_support::*;

const JSON: Option<&str> = Some("application/json");

async fn echo_server(
    dir: &std::path::Path,
    synced: SyncFlag,
    limits: Limits,
) -> (TestServer, TestCa) {
    let ca = TestCa::new("test CA");
    let paths = plain_pair(dir, &ca.leaf(1));
    let server = TestServer::start(
        Arc::new(EchoReviewer {
            delay: Duration::ZERO,
        }),
        paths,
        Duration::from_millis(100),
        synced,
        limits,
    )
    .await;
    (server, ca)
}

fn review(body: &[u8]) -> Value {
    serde_json::from_slice(body).unwrap_or_else(|e| {
        panic!(
            "answer is not JSON ({e}): {}",
            String::from_utf8_lossy(body)
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_review_is_answered_over_tls_with_its_uid() {
    let dir = tempfile::tempdir().unwrap();
    let (server, ca) = echo_server(dir.path(), SyncFlag::raised(), Limits::default()).await;
    let mut conn = connect(server.https, client_config(&[ca.pem()]))
        .await
        .unwrap();
    for i in 0..3 {
        let uid = format!("uid-{i}");
        let (status, body) = post(&mut conn, "/mutate", JSON, review_body(&uid))
            .await
            .unwrap();
        assert_eq!(status, 200);
        let answer = review(&body);
        assert_eq!(answer["response"]["uid"], uid.as_str());
        assert_eq!(answer["response"]["allowed"], true);
    }
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_client_cannot_handshake() {
    let dir = tempfile::tempdir().unwrap();
    let (server, _ca) = echo_server(dir.path(), SyncFlag::raised(), Limits::default()).await;
    let other = TestCa::new("someone else");
    let error = connect(server.https, client_config(&[other.pem()]))
        .await
        .err()
        .expect("a client that does not trust the CA must fail the handshake");
    assert!(error.contains("TLS handshake"), "{error}");
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_content_type_gets_a_clear_denial_with_the_uid() {
    let dir = tempfile::tempdir().unwrap();
    let (server, ca) = echo_server(dir.path(), SyncFlag::raised(), Limits::default()).await;
    let mut conn = connect(server.https, client_config(&[ca.pem()]))
        .await
        .unwrap();

    let (status, body) = post(
        &mut conn,
        "/mutate",
        Some("text/plain"),
        review_body("u-ct"),
    )
    .await
    .unwrap();
    assert_eq!(status, 200);
    let answer = review(&body);
    assert_eq!(answer["response"]["uid"], "u-ct");
    assert_eq!(answer["response"]["allowed"], false);
    assert_eq!(answer["response"]["status"]["code"], 415);
    let message = answer["response"]["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("text/plain") && message.contains("application/json"),
        "{message}"
    );

    // No Content-Type at all; the connection stays usable afterwards.
    let (status, body) = post(&mut conn, "/mutate", None, review_body("u-none"))
        .await
        .unwrap();
    assert_eq!(status, 200);
    let message = review(&body)["response"]["status"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(message.contains("missing"), "{message}");

    let (status, body) = post(&mut conn, "/mutate", JSON, review_body("u-ok"))
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(review(&body)["response"]["allowed"], true);

    let (_, metrics) = http_get(server.health, "/metrics").await;
    assert!(
        metrics.contains(r#"gpuwarden_webhook_requests_refused_total{reason="content_type"} 2"#),
        "{metrics}"
    );
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_three_mebibytes_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let (server, ca) = echo_server(dir.path(), SyncFlag::raised(), Limits::default()).await;
    let config = client_config(&[ca.pem()]);

    // Just over the limit: a denial naming the limit, not a reset connection.
    let mut conn = connect(server.https, config.clone()).await.unwrap();
    let (status, body) = post(&mut conn, "/mutate", JSON, vec![b' '; MAX_BODY_BYTES + 1])
        .await
        .unwrap();
    assert_eq!(status, 200);
    let answer = review(&body);
    assert_eq!(answer["response"]["allowed"], false);
    assert_eq!(answer["response"]["status"]["code"], 413);
    let message = answer["response"]["status"]["message"].as_str().unwrap();
    assert!(message.contains(&MAX_BODY_BYTES.to_string()), "{message}");

    // Exactly 3 MiB is within the limit and reaches the reviewer (which gets a JSON
    // document padded with whitespace).
    let mut padded = review_body("u-big");
    padded.resize(MAX_BODY_BYTES, b' ');
    let mut conn = connect(server.https, config.clone()).await.unwrap();
    let (status, body) = post(&mut conn, "/mutate", JSON, padded).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(review(&body)["response"]["uid"], "u-big");

    // Far over the limit (declared 64 MiB): answered without reading it all.
    let mut conn = connect(server.https, config).await.unwrap();
    let huge = post(&mut conn, "/mutate", JSON, vec![b'x'; 64 * 1024 * 1024]);
    match tokio::time::timeout(Duration::from_secs(20), huge).await {
        Ok(Ok((status, body))) => {
            assert_eq!(status, 200);
            assert_eq!(review(&body)["response"]["status"]["code"], 413);
        }
        // The server may close the connection rather than read 64 MiB; it must not hang.
        Ok(Err(_)) => {}
        Err(_) => panic!("a 64 MiB body hung the server"),
    }

    let (_, metrics) = http_get(server.health, "/metrics").await;
    assert!(
        metrics.contains(r#"gpuwarden_webhook_requests_refused_total{reason="too_large"}"#),
        "{metrics}"
    );
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_paths_and_methods_are_not_reviews() {
    let dir = tempfile::tempdir().unwrap();
    let (server, ca) = echo_server(dir.path(), SyncFlag::raised(), Limits::default()).await;
    let mut conn = connect(server.https, client_config(&[ca.pem()]))
        .await
        .unwrap();
    let (status, _) = post(&mut conn, "/validate", JSON, review_body("u"))
        .await
        .unwrap();
    assert_eq!(status, 404);
    // The health endpoints are not on the HTTPS port.
    let (status, _) = post(&mut conn, "/metrics", JSON, "").await.unwrap();
    assert_eq!(status, 404);
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_waits_for_the_caches_and_a_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("test CA");
    let paths = gpuwarden_webhook::tls::TlsPaths {
        cert: dir.path().join("tls.crt"),
        key: dir.path().join("tls.key"),
    };
    let synced = SyncFlag::new();
    // No certificate files yet, caches not synced.
    let server = TestServer::start(
        Arc::new(EchoReviewer {
            delay: Duration::ZERO,
        }),
        paths.clone(),
        Duration::from_millis(50),
        synced.clone(),
        Limits::default(),
    )
    .await;

    assert_eq!(http_get(server.health, "/healthz").await.0, 200);
    let (status, text) = http_get(server.health, "/readyz").await;
    assert_eq!(status, 503);
    assert!(
        text.contains("caches not synced") && text.contains("no serving certificate"),
        "{text}"
    );
    // Without a certificate, handshakes fail instead of serving something wrong.
    assert!(
        connect(server.https, client_config(&[ca.pem()]))
            .await
            .is_err()
    );

    synced.set(true);
    let (status, text) = http_get(server.health, "/readyz").await;
    assert_eq!(status, 503);
    assert!(
        !text.contains("caches") && text.contains("no serving certificate"),
        "{text}"
    );

    let leaf = ca.leaf(9);
    write(&paths.cert, &leaf.0);
    write(&paths.key, &leaf.1);
    assert!(
        eventually(Duration::from_secs(5), async || http_get(
            server.health,
            "/readyz"
        )
        .await
        .0 == 200)
        .await,
        "not ready after the certificate appeared"
    );
    let conn = connect(server.https, client_config(&[ca.pem()]))
        .await
        .unwrap();
    assert_eq!(conn.serial, "09");

    server.shutdown();
    server.task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_reviews_latency_and_the_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (server, ca) = echo_server(dir.path(), SyncFlag::raised(), Limits::default()).await;
    let mut conn = connect(server.https, client_config(&[ca.pem()]))
        .await
        .unwrap();
    for i in 0..5 {
        post(&mut conn, "/mutate", JSON, review_body(&format!("m{i}")))
            .await
            .unwrap();
    }
    let (status, text) = http_get(server.health, "/metrics").await;
    assert_eq!(status, 200);
    for expected in [
        r#"gpuwarden_webhook_reviews_total{outcome="allowed",policy="none"} 5"#,
        "gpuwarden_webhook_review_duration_seconds_count 5",
        "gpuwarden_webhook_reviews_in_flight 0",
        "gpuwarden_webhook_certificate_reloads_total 1",
        "# TYPE gpuwarden_webhook_certificate_not_after_timestamp_seconds gauge",
        "# EOF",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in\n{text}");
    }
    let not_after = server.certs.info().unwrap().not_after;
    assert!(not_after > 1_700_000_000);
    assert!(
        text.contains(&format!(
            "gpuwarden_webhook_certificate_not_after_timestamp_seconds {not_after}"
        )) || text.contains(&format!(
            "gpuwarden_webhook_certificate_not_after_timestamp_seconds {not_after}.0"
        )),
        "{text}"
    );
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overload_is_a_denial_after_a_bounded_wait() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("test CA");
    let paths = plain_pair(dir.path(), &ca.leaf(1));
    let limits = Limits {
        max_concurrency: 1,
        max_wait: Duration::from_millis(100),
        ..Limits::default()
    };
    let server = TestServer::start(
        Arc::new(EchoReviewer {
            delay: Duration::from_millis(800),
        }),
        paths,
        Duration::from_secs(5),
        SyncFlag::raised(),
        limits,
    )
    .await;
    let config = client_config(&[ca.pem()]);
    let mut slow = connect(server.https, config.clone()).await.unwrap();
    let mut second = connect(server.https, config).await.unwrap();
    // A slow review is a big one: the server moves it off the runtime, as it does here, so
    // the 800 ms it takes does not hold up a runtime thread the second request needs.
    let big = padded_review_body("a", 100 * 1024);
    let first = tokio::spawn(async move { post(&mut slow, "/mutate", JSON, big).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = std::time::Instant::now();
    let (status, body) = post(&mut second, "/mutate", JSON, review_body("b"))
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(700),
        "the wait was not bounded"
    );
    assert_eq!(status, 200);
    let answer = review(&body);
    assert_eq!(answer["response"]["allowed"], false);
    assert_eq!(answer["response"]["status"]["code"], 429);
    assert!(
        answer["response"]["status"]["message"]
            .as_str()
            .unwrap()
            .contains("overloaded")
    );

    let (status, body) = first.await.unwrap().unwrap();
    assert_eq!(status, 200);
    assert_eq!(review(&body)["response"]["allowed"], true);
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_drains_the_request_in_flight_and_stops_accepting() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("test CA");
    let paths = plain_pair(dir.path(), &ca.leaf(1));
    let server = TestServer::start(
        Arc::new(EchoReviewer {
            delay: Duration::from_millis(500),
        }),
        paths,
        Duration::from_secs(5),
        SyncFlag::raised(),
        Limits::default(),
    )
    .await;
    let config = client_config(&[ca.pem()]);
    let mut conn = connect(server.https, config.clone()).await.unwrap();
    let in_flight =
        tokio::spawn(async move { post(&mut conn, "/mutate", JSON, review_body("late")).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    server.shutdown();

    let (status, body) = in_flight
        .await
        .unwrap()
        .expect("the request in flight must finish");
    assert_eq!(status, 200);
    assert_eq!(review(&body)["response"]["uid"], "late");
    tokio::time::timeout(Duration::from_secs(5), server.task)
        .await
        .expect("serve() must return once drained")
        .unwrap();
    assert!(
        connect(server.https, config).await.is_err(),
        "still accepting after shutdown"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_the_shutdown_delay_it_is_unready_but_still_answers() {
    let dir = tempfile::tempdir().unwrap();
    let limits = Limits {
        shutdown_delay: Duration::from_millis(600),
        ..Limits::default()
    };
    let (server, ca) = echo_server(dir.path(), SyncFlag::raised(), limits).await;
    let config = client_config(&[ca.pem()]);
    assert_eq!(http_get(server.health, "/readyz").await.0, 200);

    server.shutdown();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, text) = http_get(server.health, "/readyz").await;
    assert_eq!(status, 503);
    assert!(text.contains("shutting down"), "{text}");
    // A client that has not yet heard of the endpoint's removal is still served.
    let mut conn = connect(server.https, config.clone()).await.unwrap();
    let (status, body) = post(&mut conn, "/mutate", JSON, review_body("during-delay"))
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(review(&body)["response"]["uid"], "during-delay");

    tokio::time::timeout(Duration::from_secs(5), server.task)
        .await
        .expect("serve() must return after the delay and the drain")
        .unwrap();
    assert!(connect(server.https, config).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_are_answered_too() {
    // The API server's client negotiates HTTP/2 by ALPN when the server offers it.
    let dir = tempfile::tempdir().unwrap();
    let (server, ca) = echo_server(dir.path(), SyncFlag::raised(), Limits::default()).await;
    let mut config = (*client_config(&[ca.pem()])).clone();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(server.https).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(
            rustls_pki_types::ServerName::try_from("localhost").unwrap(),
            tcp,
        )
        .await
        .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tls),
    )
    .await
    .unwrap();
    tokio::spawn(connection);

    // Several streams at once on the one connection.
    let requests = (0..8).map(|i| {
        let mut sender = sender.clone();
        async move {
            let request = http::Request::post(format!("https://localhost{}", "/mutate"))
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from(review_body(
                    &format!("h2-{i}"),
                ))))
                .unwrap();
            let response = sender.send_request(request).await.unwrap();
            assert_eq!(response.status(), 200);
            let body = http_body_util::BodyExt::collect(response.into_body())
                .await
                .unwrap()
                .to_bytes();
            assert_eq!(review(&body)["response"]["uid"], format!("h2-{i}"));
        }
    });
    futures::future::join_all(requests).await;
    server.shutdown();
}

/// A reviewer with a bug.
struct Panics;

impl gpuwarden_webhook::server::Reviewer for Panics {
    fn review(&self, _body: &[u8]) -> (Vec<u8>, gpuwarden_webhook::admission::ReviewSummary) {
        panic!("a bug in the reviewer")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_the_reviewer_is_a_denial_not_a_dropped_connection() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("test CA");
    let paths = plain_pair(dir.path(), &ca.leaf(1));
    let server = TestServer::start(
        Arc::new(Panics),
        paths,
        Duration::from_secs(5),
        SyncFlag::raised(),
        Limits::default(),
    )
    .await;
    let mut conn = connect(server.https, client_config(&[ca.pem()]))
        .await
        .unwrap();
    // Inline and on the blocking pool (a body over 64 KiB).
    let mut big = review_body("panic-big");
    big.resize(200 * 1024, b' ');
    for (uid, body) in [
        ("panic-small", review_body("panic-small")),
        ("panic-big", big),
    ] {
        let (status, body) = post(&mut conn, "/mutate", JSON, body).await.unwrap();
        assert_eq!(status, 200);
        let answer = review(&body);
        assert_eq!(answer["response"]["uid"], uid);
        assert_eq!(answer["response"]["allowed"], false);
        assert_eq!(answer["response"]["status"]["code"], 500);
    }
    let (_, metrics) = http_get(server.health, "/metrics").await;
    assert!(
        metrics.contains(r#"gpuwarden_webhook_requests_refused_total{reason="internal"} 2"#),
        "{metrics}"
    );
    server.shutdown();
}
