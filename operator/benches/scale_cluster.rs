//! Scale benchmark on a real API server: the `gpuwarden-operator` binary, in its own process,
//! against N Nodes with GPU capacity (5,000 by default) on the cluster in `KUBECONFIG`.
//!
//! Reports the cold-start time until the operator has written every GpuNode's status, the
//! operator's peak and final RSS, the API server's requests per second during the cold start
//! (from its own `apiserver_request_total`, less the rate measured before the operator
//! started), and the operator's writes during a quiet window in which nothing changes.
//!
//! Each Node gets an agent Lease that stays valid for the whole run, so AgentReady is True
//! and nothing is due to expire in the quiet window.
//!
//! ```sh
//! KUBECONFIG=... cargo bench -p gpuwarden-operator --bench scale_cluster
//! ```
//!
//! `GPUWARDEN_BENCH_NODES` (default 5000) and `GPUWARDEN_BENCH_QUIET_SECS` (default 600)
//! change the size and the quiet window. It creates Nodes labelled `gpuwarden.io/bench=scale`
//! and deletes them at the end, with the CRDs and the namespace if it installed them: use a
//! disposable cluster. Without `KUBECONFIG` it says so
//! and does nothing.

#[path = "support/measure.rs"]
mod measure;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use gpuwarden_crds::{AGENT_LEASE_NAMESPACE, GpuNode, GpuPolicy, SYSTEM_NAMESPACE};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, CustomResourceExt, ResourceExt};
use measure::{counter_sum, env_number, mib, operator_metrics, vm_kib};
use serde_json::json;

const LABEL: &str = "gpuwarden.io/bench";
const FIELD_MANAGER: &str = "gpuwarden-scale-bench";

async fn apiserver_requests(client: &Client) -> f64 {
    let request = http::Request::get("/metrics")
        .body(Vec::new())
        .expect("request");
    let text = client.request_text(request).await.unwrap_or_default();
    counter_sum(&text, "apiserver_request_total", "")
}

async fn operator_writes(port: u16, kind: &str) -> f64 {
    measure::operator_writes(port, kind).await.unwrap_or(0.0)
}

/// What [`ensure_api`] created, to delete again at the end.
#[derive(Default)]
struct Installed {
    crds: Vec<String>,
    namespace: bool,
}

async fn ensure_api(client: &Client) -> Installed {
    let mut installed = Installed::default();
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in [GpuPolicy::crd(), GpuNode::crd()] {
        if crds
            .get_opt(&crd.name_any())
            .await
            .expect("read the CRDs")
            .is_none()
        {
            installed.crds.push(crd.name_any());
        }
        crds.patch(
            &crd.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&crd),
        )
        .await
        .expect("apply the CRDs");
    }
    let ns: Namespace =
        serde_json::from_value(json!({"metadata": {"name": SYSTEM_NAMESPACE}})).expect("namespace");
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
    {
        Ok(_) => installed.namespace = true,
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("create namespace {SYSTEM_NAMESPACE}: {e}"),
    }
    installed
}

async fn create_nodes(client: &Client, n: u64) {
    let nodes: Api<Node> = Api::all(client.clone());
    let leases: Api<Lease> = Api::namespaced(client.clone(), AGENT_LEASE_NAMESPACE);
    let renewed = jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S.%6fZ")
        .to_string();
    futures::stream::iter(0..n)
        .map(|i| {
            let (nodes, leases, renewed) = (nodes.clone(), leases.clone(), renewed.clone());
            async move {
                let name = format!("gpuwarden-scale-{i:05}");
                let node: Node = serde_json::from_value(json!({
                    "metadata": {"name": name, "labels": {LABEL: "scale"}},
                    "spec": {"unschedulable": true},
                }))?;
                match nodes.create(&PostParams::default(), &node).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 409 => {}
                    Err(e) => return Err(e.into()),
                }
                let status = json!({"status": {
                    "capacity": {"nvidia.com/gpu": "8"},
                    "allocatable": {"nvidia.com/gpu": "8"},
                }});
                nodes
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                    .await?;
                let lease = json!({
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": gpuwarden_crds::agent_lease_name(&name), "labels": {LABEL: "scale"}},
                    "spec": {
                        "holderIdentity": name,
                        "leaseDurationSeconds": 7200,
                        "renewTime": renewed,
                    },
                });
                leases
                    .patch(
                        &gpuwarden_crds::agent_lease_name(&name),
                        &PatchParams::apply(FIELD_MANAGER).force(),
                        &Patch::Apply(&lease),
                    )
                    .await?;
                Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await
        .unwrap_or_else(|e| panic!("failed to create the Nodes: {e}"));
}

async fn delete_all(client: &Client, installed: &Installed) {
    let by_label = ListParams::default().labels(&format!("{LABEL}=scale"));
    let _ = Api::<Node>::all(client.clone())
        .delete_collection(&DeleteParams::background(), &by_label)
        .await;
    let _ = Api::<Lease>::namespaced(client.clone(), AGENT_LEASE_NAMESPACE)
        .delete_collection(&DeleteParams::background(), &by_label)
        .await;
    // GpuNodes are owned by their Nodes; without a garbage collector, delete them too.
    let gpunodes: Api<GpuNode> = Api::all(client.clone());
    if let Ok(list) = gpunodes.list_metadata(&ListParams::default()).await {
        for g in list.items {
            if g.name_any().starts_with("gpuwarden-scale-") {
                let _ = gpunodes
                    .delete(&g.name_any(), &DeleteParams::background())
                    .await;
            }
        }
    }
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in &installed.crds {
        let _ = crds.delete(name, &DeleteParams::background()).await;
    }
    if installed.namespace {
        let _ = Api::<Namespace>::all(client.clone())
            .delete(SYSTEM_NAMESPACE, &DeleteParams::background())
            .await;
    }
}

#[tokio::main]
async fn main() {
    if std::env::var_os("KUBECONFIG").is_none() {
        println!(
            "scale_cluster: needs a cluster; run with KUBECONFIG=... (a disposable one): skipped"
        );
        return;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let n = env_number("GPUWARDEN_BENCH_NODES", 5000);
    let quiet = Duration::from_secs(env_number("GPUWARDEN_BENCH_QUIET_SECS", 600));
    let client = Client::try_default()
        .await
        .expect("a client from KUBECONFIG");
    let version = client.apiserver_version().await.expect("server version");

    let installed = ensure_api(&client).await;
    let created = Instant::now();
    create_nodes(&client, n).await;
    println!(
        "created {n} Nodes with 8 GPUs and their agent Leases in {:.1} s",
        created.elapsed().as_secs_f64()
    );

    // What the API server serves with nobody reconciling: the background rate.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let base_start = (Instant::now(), apiserver_requests(&client).await);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let background =
        (apiserver_requests(&client).await - base_start.1) / base_start.0.elapsed().as_secs_f64();

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let requests_before = apiserver_requests(&client).await;
    let started = Instant::now();
    let mut operator = Command::new(env!("CARGO_BIN_EXE_gpuwarden-operator"))
        .args([
            "run",
            "--health-listen",
            &format!("127.0.0.1:{port}"),
            "--manage-webhook-certificates=false",
            "--identity",
            "scale-bench",
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("start gpuwarden-operator");
    let pid = operator.id();

    let deadline = started + Duration::from_secs(600);
    let mut statuses = 0.0;
    while statuses < n as f64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        statuses = operator_writes(port, "kind=\"status\"").await;
    }
    let cold = started.elapsed();
    let requests_cold = apiserver_requests(&client).await - requests_before;
    let rss_cold = vm_kib(pid, "VmRSS:");

    // Settle, then a quiet window: nothing changes, nothing should be written.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let writes_before = operator_writes(port, "").await;
    let quiet_requests_before = apiserver_requests(&client).await;
    let quiet_start = Instant::now();
    let mut rss_quiet_max = 0;
    while quiet_start.elapsed() < quiet {
        tokio::time::sleep(Duration::from_secs(5)).await;
        rss_quiet_max = rss_quiet_max.max(vm_kib(pid, "VmRSS:"));
    }
    let quiet_writes = operator_writes(port, "").await - writes_before;
    let quiet_rate = (apiserver_requests(&client).await - quiet_requests_before)
        / quiet_start.elapsed().as_secs_f64();
    let hwm = vm_kib(pid, "VmHWM:");
    let rss_end = vm_kib(pid, "VmRSS:");
    let errors = counter_sum(
        &operator_metrics(port).await.unwrap_or_default(),
        "gpuwarden_operator_reconcile_errors_total",
        "",
    );

    let _ = operator.kill();
    let _ = operator.wait();
    delete_all(&client, &installed).await;

    let cold_s = cold.as_secs_f64();
    println!();
    println!(
        "gpuwarden-operator against a real kube-apiserver {} ({n} GPU Nodes)",
        version.git_version
    );
    println!(
        "  cold start, every GpuNode's status written:  {cold_s:.1} s  ({statuses} status writes)"
    );
    println!(
        "  API server requests during the cold start:   {:.0}/s  ({:.0} in all, less {background:.1}/s background)",
        requests_cold / cold_s - background,
        requests_cold
    );
    println!(
        "  operator RSS after the cold start:           {}",
        mib(rss_cold)
    );
    println!(
        "  operator RSS in the quiet window:            {} at most, {} at the end",
        mib(rss_quiet_max),
        mib(rss_end)
    );
    println!(
        "  operator peak RSS (VmHWM):                   {}",
        mib(hwm)
    );
    println!(
        "  operator writes in {:.0} quiet seconds:       {quiet_writes}  (API server: {quiet_rate:.1} requests/s, background {background:.1}/s)",
        quiet.as_secs_f64()
    );
    println!("  reconcile errors:                            {errors}");
}
