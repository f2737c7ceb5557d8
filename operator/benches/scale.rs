//! Scale benchmark: the whole operator (`gpuwarden_operator::run`: watches, caches, change
//! filters, appliers, reconcilers) against a fake API server that serves paginated list and
//! watch over HTTP for 5,000 Nodes, 5,000 GpuNodes and 5,000 agent Leases, applies the
//! operator's writes and sends them back through the watches as a real API server would.
//!
//! The fake API server runs in a child process (this binary, re-executed), so the RSS
//! reported for the operator is the operator's alone.
//!
//! Reports the cold-start time until every GpuNode has its conditions, the operator's RSS, and
//! the number of writes during a steady-state window in which every Lease is renewed and every
//! Node sends a heartbeat.
//!
//! `cargo bench -p gpuwarden-operator --bench scale` (release). `GPUWARDEN_BENCH_NODES` changes
//! the node count.

#[path = "../tests/support/fake_api.rs"]
mod fake_api;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fake_api::{FakeApi, gpunode, lease, node};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CHILD_ENV: &str = "GPUWARDEN_BENCH_FAKE_API";

fn vm(pid: &str, field: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .map(|l| l.trim_start_matches(field).trim().to_owned())
        })
        .unwrap_or_else(|| "n/a".to_owned())
}

fn mib(kb: &str) -> String {
    kb.trim_end_matches("kB")
        .trim()
        .parse::<f64>()
        .map(|k| format!("{:.1} MiB", k / 1024.0))
        .unwrap_or_else(|_| kb.to_owned())
}

fn micro_time(ts: jiff::Timestamp) -> String {
    ts.strftime("%Y-%m-%dT%H:%M:%S.%6fZ").to_string()
}

fn node_count() -> usize {
    std::env::var("GPUWARDEN_BENCH_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000)
}

/// The child: fills a fake API server, prints its port, serves until killed.
async fn serve_fake(n: usize) {
    let fake = Arc::new(FakeApi::default());
    let renewed = micro_time(jiff::Timestamp::now());
    for i in 0..n {
        let name = format!("gpu-node-{i:05}");
        fake.insert("nodes", &name, node(i));
        fake.insert("gpunodes", &name, gpunode(i));
        fake.insert(
            "leases",
            &format!("gpuwarden-agent-{name}"),
            lease(i, &renewed),
        );
    }
    let stats = fake.clone();
    let steady = fake.clone();
    let app = fake_api::router(fake.clone())
        .route(
            "/bench/stats",
            axum::routing::get(move || {
                let f = stats.clone();
                async move {
                    axum::Json(json!({
                        "writes": f.writes.load(Ordering::Relaxed),
                        "statusWrites": f.status_writes.load(Ordering::Relaxed),
                        "lists": f.lists.load(Ordering::Relaxed),
                    }))
                }
            }),
        )
        .route(
            "/bench/unhealthy",
            axum::routing::post({
                let f = fake.clone();
                move || {
                    let f = f.clone();
                    async move {
                        // One GPU on each of the first 100 nodes fails.
                        for i in 0..n.min(100) {
                            f.modify("gpunodes", &format!("gpu-node-{i:05}"), |g| {
                                g["status"]["gpus"][0]["health"] = json!({
                                    "state": "Unhealthy",
                                    "reasons": ["Xid79: GPU has fallen off the bus"],
                                });
                            });
                        }
                        "ok"
                    }
                }
            }),
        )
        .route(
            "/bench/steady",
            axum::routing::post(move || {
                let f = steady.clone();
                async move {
                    // Every agent renews its Lease and every kubelet posts a heartbeat.
                    let renewed = micro_time(jiff::Timestamp::now());
                    for i in 0..n {
                        let name = format!("gpu-node-{i:05}");
                        f.modify("leases", &format!("gpuwarden-agent-{name}"), |l| {
                            l["spec"]["renewTime"] = json!(renewed);
                        });
                        f.modify("nodes", &name, |node| {
                            if let Some(conds) = node["status"]["conditions"].as_array_mut() {
                                for c in conds {
                                    c["lastHeartbeatTime"] = json!(renewed);
                                }
                            }
                        });
                    }
                    "ok"
                }
            }),
        );
    let listener = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("fake API server: failed to listen: {e}");
            return;
        }
    };
    let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
    println!("{port}");
    let _ = axum::serve(listener, app).await;
}

async fn http(addr: SocketAddr, method: &str, path: &str) -> String {
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return String::new();
    };
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    if s.write_all(req.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    out.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned()
}

async fn stats(addr: SocketAddr) -> (u64, u64, u64) {
    let v: Value =
        serde_json::from_str(&http(addr, "GET", "/bench/stats").await).unwrap_or_default();
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    (n("writes"), n("statusWrites"), n("lists"))
}

#[tokio::main]
async fn main() {
    let n = node_count();
    if std::env::var_os(CHILD_ENV).is_some() {
        serve_fake(n).await;
        return;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();

    let exe = std::env::current_exe().expect("bench executable path");
    let generate = Instant::now();
    let mut child = Command::new(exe)
        .env(CHILD_ENV, "1")
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the fake API server");
    let child_pid = child.id().to_string();
    let mut port = String::new();
    BufReader::new(child.stdout.take().expect("child stdout"))
        .read_line(&mut port)
        .expect("fake API server port");
    let addr: SocketAddr = format!("127.0.0.1:{}", port.trim()).parse().expect("port");
    let generated = generate.elapsed();

    let rss_before = vm("self", "VmRSS:");
    let kube_config = kube::Config::new(format!("http://{addr}").parse().expect("url"));
    let client = kube::Client::try_from(kube_config).expect("client");
    let mut config = gpuwarden_operator::Config::new("gpuwarden-system");
    config.health_listen = ([127, 0, 0, 1], 0).into();
    config.leader_election = false;
    config.concurrency = 16;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let started = Instant::now();
    let operator = tokio::spawn(gpuwarden_operator::run(config, client, async move {
        let _ = stop_rx.await;
    }));

    // Cold start: until every GpuNode carries the operator's conditions.
    let deadline = started + Duration::from_secs(600);
    let mut status_writes = 0;
    while status_writes < n as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        status_writes = stats(addr).await.1;
    }
    let cold = started.elapsed();
    let (cold_writes, cold_status, _) = stats(addr).await;
    let rss_cold = vm("self", "VmRSS:");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (settled_writes, _, _) = stats(addr).await;

    // Steady state: renewals and heartbeats for every node, then 10 s of watching.
    let before = settled_writes;
    let steady_start = Instant::now();
    http(addr, "POST", "/bench/steady").await;
    let sent = steady_start.elapsed();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (after, _, _) = stats(addr).await;
    let steady_writes = after - before;
    let rss_steady = vm("self", "VmRSS:");

    // The watches are live: 100 GPUs fail, and exactly those GpuNodes are written.
    let before_fail = stats(addr).await.0;
    let fail_start = Instant::now();
    http(addr, "POST", "/bench/unhealthy").await;
    let expected_fail = 2 * n.min(100) as u64; // a status apply and a Warning event each
    let mut fail_writes = 0;
    while fail_writes < expected_fail && fail_start.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        fail_writes = stats(addr).await.0 - before_fail;
    }
    let fail_time = fail_start.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let fail_writes = stats(addr).await.0 - before_fail;
    let hwm = vm("self", "VmHWM:");
    let lists = stats(addr).await.2;
    let child_rss = vm(&child_pid, "VmRSS:");

    let _ = stop_tx.send(());
    let stopped = tokio::time::timeout(Duration::from_secs(30), operator).await;
    let _ = child.kill();
    let _ = child.wait();

    println!();
    println!(
        "gpuwarden-operator scale benchmark: the full operator (run()) against a fake API server"
    );
    println!(
        "in a child process (HTTP list + watch; writes applied and echoed back through watches)"
    );
    println!();
    println!(
        "| measurement                                                  | value              | target  |"
    );
    println!(
        "|--------------------------------------------------------------|--------------------|---------|"
    );
    println!(
        "| Nodes / GpuNodes / agent Leases                              | {n} / {n} / {n} |         |"
    );
    println!(
        "| cold start until every GpuNode has its conditions            | {:>16.2} s | <= 60 s |",
        cold.as_secs_f64()
    );
    println!(
        "| writes during cold start (status applies / all)              | {cold_status:>7} / {cold_writes:<8} |         |"
    );
    println!(
        "| writes in the 2 s after cold start (own writes echoed back)  | {:>18} |         |",
        settled_writes - cold_writes
    );
    println!(
        "| writes in steady state: {n} Lease renewals + {n} Node heartbeats, then 10 s | {steady_writes:>6} | 0 |"
    );
    println!(
        "| {} GPUs fail, on as many nodes: writes (status + event each)   | {fail_writes:>6} in {:>5.2} s | {expected_fail} |",
        n.min(100),
        fail_time.as_secs_f64()
    );
    println!(
        "| operator VmRSS before start                                  | {:>18} |         |",
        mib(&rss_before)
    );
    println!(
        "| operator VmRSS after cold start                              | {:>18} |         |",
        mib(&rss_cold)
    );
    println!(
        "| operator VmRSS in steady state                               | {:>18} | <= 150 MiB |",
        mib(&rss_steady)
    );
    println!(
        "| operator VmHWM (peak RSS)                                    | {:>18} |         |",
        mib(&hwm)
    );
    println!(
        "| fake API server VmRSS (child process, not the operator)     | {:>18} |         |",
        mib(&child_rss)
    );
    println!(
        "| list requests served (500 per page)                          | {lists:>18} |         |"
    );
    println!(
        "| fake API server start-up (objects generated)                 | {:>16.2} s |         |",
        generated.as_secs_f64()
    );
    println!(
        "| renewal/heartbeat events sent in                             | {:>16.2} s |         |",
        sent.as_secs_f64()
    );
    println!(
        "| operator stopped cleanly                                     | {:>18} |         |",
        matches!(stopped, Ok(Ok(Ok(()))))
    );
}
