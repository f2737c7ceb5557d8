//! What the claim guard (`deploy/admission/driver-claims.yaml`) costs the API server: it
//! meets every ResourceClaim and ResourceClaimTemplate create and update in the cluster.
//! Claims and templates of two requests (a GPU and a NIC class, one with an opaque config)
//! are created (server-side dry runs) in a namespace the guard is bound to, in one a policy
//! of the same kind with one constant validation is bound to (the floor of any
//! ValidatingAdmissionPolicy with a parameter), and in one nothing is bound to, interleaved
//! in rotating order over one client, in the same run. The guarded namespace's refusal of a
//! claim on the ComputeDomain daemon class is checked before anything is timed.
//!
//! ```sh
//! KUBECONFIG=... cargo bench -p gpuwarden-e2e --bench claim_writes [-- ROUNDS]
//! ```

use std::process::ExitCode;

use gpuwarden_crds::claims::DEVICE_CLASS_CD_DAEMON;
use gpuwarden_crds::manifests::DRIVER_CLAIMS;
use gpuwarden_e2e::cluster::Cleanup;
use gpuwarden_e2e::env::Env;
use http::Method;
use serde_json::{Value, json};

/// A claim spec asking for a device of `class` and a NIC, with an opaque GPU config.
fn claim_spec(class: &str) -> Value {
    json!({"devices": {
        "requests": [
            {"name": "gpu", "exactly": {"deviceClassName": class}},
            {"name": "nic", "firstAvailable": [{"name": "fast", "deviceClassName": "nic.example.com"}]}
        ],
        "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com",
            "parameters": {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                "sharing": {"strategy": "TimeSlicing"}}}}]
    }})
}

/// A ResourceClaim (or, `template`, a ResourceClaimTemplate) named `name` on `class`.
fn object(template: bool, name: &str, class: &str) -> Value {
    let (kind, spec) = if template {
        ("ResourceClaimTemplate", json!({"spec": claim_spec(class)}))
    } else {
        ("ResourceClaim", claim_spec(class))
    };
    json!({"apiVersion": "resource.k8s.io/v1", "kind": kind, "metadata": {"name": name}, "spec": spec})
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    gpuwarden_e2e::bench::exit("claim_writes", run(gpuwarden_e2e::bench::rounds(1000))).await
}

async fn run(rounds: usize) -> Result<(), String> {
    let env = Env::new().await;
    let cluster = &env.cluster;
    let cleanup = Cleanup::new(cluster.client.clone());
    let [guarded, floor, plain] =
        gpuwarden_e2e::bench::guard_namespaces(&env, &cleanup, DRIVER_CLAIMS).await?;
    let write = |ns: &str, body: Value| {
        let plural = format!("{}s", body["kind"].as_str().unwrap_or("").to_lowercase());
        let path = format!("/apis/resource.k8s.io/v1/namespaces/{ns}/{plural}?dryRun=All");
        async move {
            let start = std::time::Instant::now();
            let r = (cluster
                .raw(Method::POST, &path, "application/json", Some(&body))
                .await)
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((start.elapsed().as_secs_f64() * 1000.0, r))
        }
    };
    // In force: the guarded namespace refuses a daemon claim, the other does not.
    for attempt in 0.. {
        let body = object(false, "probe", DEVICE_CLASS_CD_DAEMON);
        let (_, guarded_r) = write(&guarded, body.clone()).await?;
        let (_, plain_r) = write(&plain, body).await?;
        if guarded_r.status.is_client_error() && plain_r.status.is_success() {
            break;
        }
        if attempt == 60 {
            return Err("the guard never refused the daemon claim in its namespace".into());
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    // (label, namespace, template)
    let which = [
        (&guarded, "guarded"),
        (&floor, "constant policy"),
        (&plain, "unguarded"),
    ];
    let series: Vec<(String, &String, bool)> = (which.iter())
        .flat_map(|(ns, which)| {
            [("ResourceClaim", false), ("ResourceClaimTemplate", true)]
                .map(|(kind, template)| (format!("{kind} create, {which}"), *ns, template))
        })
        .collect();
    let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); series.len()];
    let warmup = 50;
    for i in 0..rounds + warmup {
        for k in 0..series.len() {
            let at = (i + k) % series.len();
            let (label, ns, template) = &series[at];
            let body = object(*template, &format!("bench-{i}"), "gpu.nvidia.com");
            let (ms, r) = write(ns, body).await?;
            if !r.status.is_success() {
                return Err(format!("{label}: {}", r.message()));
            }
            if i >= warmup {
                times[at].push(ms);
            }
        }
    }
    println!("{rounds} rounds of server-side dry-run creates of two-request claims, interleaved");
    let labels: Vec<String> = series.into_iter().map(|(label, ..)| label).collect();
    gpuwarden_e2e::bench::report_guard(&labels, &mut times);
    drop(env);
    Ok(())
}
