//! PolicyReport cost on a real API server: the `gpuwarden-operator` binary, in its own
//! process, against N pods (5,000 by default) in M namespaces (200), under an Audit-mode
//! GpuPolicy, with a PolicyReport CRD served.
//!
//! Half the pods run a privileged container with `NVIDIA_VISIBLE_DEVICES=all` (a finding),
//! half an ordinary one (the void rule's warning only). They stay Pending: their nodeSelector
//! matches no node. Reports the time until every namespace's report is written and the
//! writes stop, the operator's peak and steady RSS, and its report writes per pod change:
//! pods deleted one per namespace, a burst of pods created in one namespace, and label
//! edits that change no finding.
//!
//! ```sh
//! KUBECONFIG=... cargo bench -p gpuwarden-operator --bench reports_cluster
//! ```
//!
//! `GPUWARDEN_BENCH_PODS` and `GPUWARDEN_BENCH_NAMESPACES` change the size. It creates
//! namespaces `gpuwarden-bench-reports-*`, the GpuPolicy `bench-reports` and, where missing,
//! the CRDs (a minimal PolicyReport CRD of its own), and deletes them at the end. Without
//! `KUBECONFIG` it says so and does nothing.

#[path = "support/measure.rs"]
mod measure;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use gpuwarden_crds::{GpuNode, GpuPolicy};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, CustomResourceExt, ResourceExt};
use measure::{env_number, mib, vm_kib};
use serde_json::{Value, json};

const LABEL: &str = "gpuwarden.io/bench";
const FIELD_MANAGER: &str = "gpuwarden-reports-bench";
const PREFIX: &str = "gpuwarden-bench-reports-";
const POLICY_REPORT_CRD: &str = "policyreports.wgpolicyk8s.io";

/// The operator's report writes, or -1 where it does not answer.
async fn operator_writes(port: u16) -> f64 {
    measure::operator_writes(port, "controller=\"policyreports\"")
        .await
        .unwrap_or(-1.0)
}

/// Waits until the operator's report writes stop changing for `still`; returns the count and
/// when the last one was seen.
async fn settle(port: u16, still: Duration, limit: Duration) -> (f64, Instant) {
    let start = Instant::now();
    let mut last = operator_writes(port).await;
    let mut changed = Instant::now();
    while start.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = operator_writes(port).await;
        if now != last {
            last = now;
            changed = Instant::now();
        } else if last >= 0.0 && changed.elapsed() >= still {
            break;
        }
    }
    (last, changed)
}

fn pod(i: u64, finding: bool) -> Value {
    let mut container = json!({"name": "main", "image": "docker.io/library/busybox:latest",
        "command": ["sleep", "3600"]});
    if finding {
        container["securityContext"] = json!({"privileged": true});
        container["env"] = json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]);
    }
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("p{i:05}"), "labels": {LABEL: "reports", "app": "bench"}},
        "spec": {"nodeSelector": {"gpuwarden.io/bench-nowhere": "true"}, "containers": [container]}})
}

async fn create_pods(client: &Client, namespaces: &[String], range: std::ops::Range<u64>) {
    let n = namespaces.len() as u64;
    futures::stream::iter(range)
        .map(|i| {
            let api: Api<Pod> = Api::namespaced(client.clone(), &namespaces[(i % n) as usize]);
            async move {
                // Every other pod of a namespace has a finding.
                let pod: Pod = serde_json::from_value(pod(i, (i / n).is_multiple_of(2)))?;
                // A new namespace's default ServiceAccount comes a moment after it.
                let mut tries = 0;
                loop {
                    match api.create(&PostParams::default(), &pod).await {
                        Ok(_) => return Ok(()),
                        Err(kube::Error::Api(s)) if s.code == 409 => return Ok(()),
                        Err(kube::Error::Api(s))
                            if s.code == 403
                                && s.message.contains("serviceaccount")
                                && tries < 60 =>
                        {
                            tries += 1;
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                        Err(e) => return Err(Box::<dyn std::error::Error + Send + Sync>::from(e)),
                    }
                }
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await
        .unwrap_or_else(|e| panic!("failed to create the pods: {e}"));
}

/// The CRDs it made, to delete at the end.
async fn ensure_crds(client: &Client) -> Vec<String> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let report_crd: CustomResourceDefinition = serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": POLICY_REPORT_CRD},
        "spec": {"group": "wgpolicyk8s.io", "scope": "Namespaced",
            "names": {"plural": "policyreports", "singular": "policyreport", "kind": "PolicyReport",
                "listKind": "PolicyReportList", "shortNames": ["polr"]},
            "versions": [{"name": "v1alpha2", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]},
    }))
    .expect("CRD");
    let mut made = Vec::new();
    for crd in [GpuPolicy::crd(), GpuNode::crd(), report_crd] {
        let name = crd.name_any();
        if crds.get_opt(&name).await.expect("read the CRDs").is_none() {
            crds.create(&PostParams::default(), &crd)
                .await
                .expect("create a CRD");
            made.push(name);
        }
    }
    // Established and served before the operator asks.
    tokio::time::sleep(Duration::from_secs(3)).await;
    made
}

#[tokio::main]
async fn main() {
    if std::env::var_os("KUBECONFIG").is_none() {
        println!("reports_cluster: needs a cluster; run with KUBECONFIG=...: skipped");
        return;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pods = env_number("GPUWARDEN_BENCH_PODS", 5000);
    let namespace_count = env_number("GPUWARDEN_BENCH_NAMESPACES", 200);
    let client = Client::try_default()
        .await
        .expect("a client from KUBECONFIG");
    let version = client.apiserver_version().await.expect("server version");
    let made = ensure_crds(&client).await;
    let gpunodes_before: Vec<String> = Api::<GpuNode>::all(client.clone())
        .list_metadata(&ListParams::default())
        .await
        .map(|l| l.items.iter().map(ResourceExt::name_any).collect())
        .unwrap_or_default();

    let namespaces: Vec<String> = (0..namespace_count)
        .map(|i| format!("{PREFIX}{i:03}"))
        .collect();
    let ns_api: Api<Namespace> = Api::all(client.clone());
    for ns in &namespaces {
        let object: Namespace = serde_json::from_value(json!({"metadata": {"name": ns,
            "labels": {LABEL: "reports", "pod-security.kubernetes.io/enforce": "privileged"}}}))
        .expect("namespace");
        match ns_api.create(&PostParams::default(), &object).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("create namespace {ns}: {e}"),
        }
    }
    let mut policy = serde_json::to_value(GpuPolicy::default_policy()).expect("policy");
    policy["metadata"] = json!({"name": "bench-reports"});
    policy["spec"]["priority"] = json!(1000);
    policy["spec"]["mode"] = json!("Audit");
    policy["spec"]["namespaceSelector"] = json!({"matchLabels": {LABEL: "reports"}});
    Api::<GpuPolicy>::all(client.clone())
        .patch(
            "bench-reports",
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&policy),
        )
        .await
        .expect("apply the bench policy");
    // Namespaces need their default ServiceAccount before pods.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let created = Instant::now();
    create_pods(&client, &namespaces, 0..pods).await;
    println!(
        "created {pods} pods in {namespace_count} namespaces in {:.1} s",
        created.elapsed().as_secs_f64()
    );

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let started = Instant::now();
    let mut operator = Command::new(env!("CARGO_BIN_EXE_gpuwarden-operator"))
        .args([
            "run",
            "--health-listen",
            &format!("127.0.0.1:{port}"),
            "--manage-webhook-certificates=false",
            "--admission-policies=false",
            "--leader-election=false",
            "--identity",
            "reports-bench",
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("start gpuwarden-operator");
    let pid = operator.id();
    let mut peak = 0;
    let deadline = started + Duration::from_secs(600);
    while operator_writes(port).await < namespace_count as f64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        peak = peak.max(vm_kib(pid, "VmRSS:"));
    }
    let (cold_writes, last) = settle(port, Duration::from_secs(10), Duration::from_secs(120)).await;
    let cold = last.duration_since(started);
    let rss_steady = vm_kib(pid, "VmRSS:");

    // One pod with a finding deleted in each of 20 namespaces, one at a time (3 s apart,
    // beyond the debounce).
    let before = operator_writes(port).await;
    for ns in namespaces.iter().take(20) {
        let api: Api<Pod> = Api::namespaced(client.clone(), ns);
        let victim = api
            .list_metadata(&ListParams::default())
            .await
            .expect("pods")
            .items
            .into_iter()
            .map(|p| p.name_any())
            .find(|name| {
                name[1..]
                    .parse::<u64>()
                    .is_ok_and(|i| (i / namespace_count).is_multiple_of(2))
            })
            .expect("a pod with a finding");
        api.delete(&victim, &DeleteParams::default().grace_period(0))
            .await
            .expect("delete a pod");
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let (after, _) = settle(port, Duration::from_secs(5), Duration::from_secs(60)).await;
    let deletes = after - before;

    // A burst: 50 pods created at once in one namespace.
    let burst_ns = vec![namespaces[namespaces.len() - 1].clone()];
    let before = after;
    create_pods(&client, &burst_ns, pods..pods + 50).await;
    let (after, _) = settle(port, Duration::from_secs(5), Duration::from_secs(60)).await;
    let burst = after - before;

    // 100 label edits that change no finding.
    let before = after;
    for i in 0..100u64 {
        let ns = &namespaces[(i % namespace_count) as usize];
        let name = format!("p{:05}", i + 20 * namespace_count);
        let _ = Api::<Pod>::namespaced(client.clone(), ns)
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"edited": "yes"}}})),
            )
            .await;
    }
    let (after, _) = settle(port, Duration::from_secs(5), Duration::from_secs(60)).await;
    let edits = after - before;
    let hwm = vm_kib(pid, "VmHWM:");
    let rss_end = vm_kib(pid, "VmRSS:");

    let _ = operator.kill();
    let _ = operator.wait();
    for ns in &namespaces {
        let _ = ns_api.delete(ns, &DeleteParams::background()).await;
    }
    let _ = Api::<GpuPolicy>::all(client.clone())
        .delete("bench-reports", &DeleteParams::default())
        .await;
    let gpunodes: Api<GpuNode> = Api::all(client.clone());
    if let Ok(list) = gpunodes.list_metadata(&ListParams::default()).await {
        for g in list
            .items
            .iter()
            .filter(|g| !gpunodes_before.contains(&g.name_any()))
        {
            let _ = gpunodes
                .delete(&g.name_any(), &DeleteParams::background())
                .await;
        }
    }
    // Wait for the namespaces to go before their CRD does.
    let gone = Instant::now();
    while gone.elapsed() < Duration::from_secs(180) {
        let left = ns_api
            .list_metadata(&ListParams::default().labels(&format!("{LABEL}=reports")))
            .await
            .map(|l| l.items.len())
            .unwrap_or(0);
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in &made {
        let _ = crds.delete(name, &DeleteParams::background()).await;
    }

    println!();
    println!(
        "gpuwarden-operator PolicyReports against a real kube-apiserver {} ({pods} pods, {namespace_count} namespaces)",
        version.git_version
    );
    println!(
        "  start to steady reports (last write):   {:.1} s  ({cold_writes} report writes)",
        cold.as_secs_f64()
    );
    println!(
        "  operator RSS: peak while starting {}, steady {}, at the end {}, VmHWM {}",
        mib(peak),
        mib(rss_steady),
        mib(rss_end),
        mib(hwm)
    );
    println!("  writes for 20 pods deleted in 20 namespaces: {deletes}");
    println!("  writes for 50 pods created at once in one namespace: {burst}");
    println!("  writes for 100 label edits that change no finding: {edits}");
}
