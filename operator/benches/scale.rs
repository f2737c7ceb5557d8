//! Scale benchmark: the whole operator (`gpuwarden_operator::run`: watches, caches, change
//! filters, appliers, reconcilers) against an in-process fake API server that serves list and
//! watch for 5,000 Nodes, 5,000 GpuNodes and 5,000 agent Leases, applies the operator's
//! writes and sends them back through the watches as a real API server would.
//!
//! Reports the cold-start time until every GpuNode has its conditions, the process RSS, and
//! the number of writes during a steady-state window in which every Lease is renewed and every
//! Node sends a heartbeat.
//!
//! `cargo bench -p gpuwarden-operator --bench scale` (release). `GPUWARDEN_BENCH_NODES` changes
//! the node count.

#[path = "../tests/support/fake_api.rs"]
mod fake_api;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fake_api::{FakeApi, gpunode, lease, node};
use serde_json::{Value, json};

fn vm(field: &str) -> String {
    std::fs::read_to_string("/proc/self/status")
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

#[tokio::main]
async fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let n: usize = std::env::var("GPUWARDEN_BENCH_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000);
    let rss_start = vm("VmRSS:");

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
    let rss_fake = vm("VmRSS:");

    let client = fake.client();
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
    while fake.status_writes.load(Ordering::Relaxed) < n as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cold = started.elapsed();
    let cold_writes = fake.writes.load(Ordering::Relaxed);
    let cold_status = fake.status_writes.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let settled_writes = fake.writes.load(Ordering::Relaxed);
    let rss_cold = vm("VmRSS:");

    // Steady state: every agent renews its Lease and every kubelet posts a heartbeat; the
    // operator's own status writes have already come back through the watch.
    let before = fake.writes.load(Ordering::Relaxed);
    let renewed = micro_time(jiff::Timestamp::now());
    let steady_start = Instant::now();
    for i in 0..n {
        let name = format!("gpu-node-{i:05}");
        fake.modify("leases", &format!("gpuwarden-agent-{name}"), |l| {
            l["spec"]["renewTime"] = json!(renewed);
        });
        fake.modify("nodes", &name, |node| {
            if let Some(conds) = node["status"]["conditions"].as_array_mut() {
                for c in conds {
                    c["lastHeartbeatTime"] = json!(renewed);
                }
            }
        });
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let steady_writes = fake.writes.load(Ordering::Relaxed) - before;
    let rss_steady = vm("VmRSS:");
    let hwm = vm("VmHWM:");

    let _ = stop_tx.send(());
    let stopped = tokio::time::timeout(Duration::from_secs(30), operator).await;

    let status_sample = fake
        .collections
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get("gpunodes")
        .and_then(|c| c.objects.values().next().cloned())
        .and_then(|o| serde_json::from_slice::<Value>(&o).ok())
        .map(|o| o["status"]["summary"].clone())
        .unwrap_or(Value::Null);

    println!();
    println!(
        "gpuwarden-operator scale benchmark: full operator against an in-process fake API server"
    );
    println!("(list + watch, writes applied and echoed back through the watches)");
    println!();
    println!("| measurement                                   | value            | target   |");
    println!("|-----------------------------------------------|------------------|----------|");
    println!("| Nodes / GpuNodes / agent Leases               | {n} / {n} / {n}  |          |");
    println!(
        "| cold start: all GpuNodes have conditions      | {:>13.2} s  | <= 60 s  |",
        cold.as_secs_f64()
    );
    println!(
        "| writes during cold start (status / all)       | {cold_status} / {cold_writes}      |          |"
    );
    println!(
        "| writes in the 2 s after cold start            | {:>16} |          |",
        settled_writes - cold_writes
    );
    println!(
        "| steady state: writes after {n} Lease renewals + {n} Node heartbeats, 10 s | {steady_writes} | 0 |"
    );
    println!(
        "| VmRSS before objects were generated           | {:>16} |          |",
        mib(&rss_start)
    );
    println!(
        "| VmRSS with the fake API server's objects      | {:>16} |          |",
        mib(&rss_fake)
    );
    println!(
        "| VmRSS after cold start (operator + fake)      | {:>16} |          |",
        mib(&rss_cold)
    );
    println!(
        "| VmRSS in steady state (operator + fake)       | {:>16} |          |",
        mib(&rss_steady)
    );
    println!(
        "| VmHWM (peak RSS, operator + fake)             | {:>16} |          |",
        mib(&hwm)
    );
    println!(
        "| list requests served                          | {:>16} |          |",
        fake.lists.load(Ordering::Relaxed)
    );
    println!(
        "| steady-state window                           | {:>13.2} s  |          |",
        steady_start.elapsed().as_secs_f64()
    );
    println!(
        "| operator stopped cleanly                      | {:>16} |          |",
        matches!(stopped, Ok(Ok(Ok(()))))
    );
    println!();
    println!("sample summary written: {status_sample}");
    println!(
        "note: RSS is the whole process; the fake API server's own copy of the objects is the"
    );
    println!("difference between the first two RSS rows, so the operator's share is roughly");
    println!("'steady state' minus 'with the fake API server's objects'.");
}
