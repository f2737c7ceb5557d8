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
use gpuwarden_e2e::bench::quantile;
use gpuwarden_e2e::cluster::Cleanup;
use gpuwarden_e2e::env::Env;
use http::Method;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PostParams};
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
    let (guarded, floor, plain) = (env.name("guarded"), env.name("floor"), env.name("plain"));
    let namespaces: Api<Namespace> = Api::all(cluster.client.clone());
    for (ns, label) in [(&guarded, "true"), (&floor, "floor"), (&plain, "false")] {
        let object: Namespace = serde_json::from_value(json!({"metadata": {"name": ns,
            "labels": {"gpuwarden.io/e2e-guarded": label}}}))
        .map_err(|e| e.to_string())?;
        (namespaces.create(&PostParams::default(), &object).await)
            .map_err(|e| format!("create namespace {ns}: {e}"))?;
        cleanup.own_typed::<Namespace>(None, ns);
    }
    let guarded_only = json!({"matchLabels": {"gpuwarden.io/e2e-guarded": "true"}});
    env.install_policy(DRIVER_CLAIMS, "guard", Some(guarded_only))
        .await;
    // The floor: the same policy kind, parameter and match, with one constant validation.
    let mut docs = gpuwarden_e2e::manifests::load_file(DRIVER_CLAIMS).map_err(|e| e.to_string())?;
    let spec = &mut docs[0].value["spec"];
    spec["variables"] = json!([]);
    spec["validations"] = json!([{"expression": "true"}]);
    let file = tempfile::NamedTempFile::new().map_err(|e| e.to_string())?;
    let text: Vec<String> = docs.iter().map(|d| d.value.to_string()).collect();
    std::fs::write(file.path(), text.join("\n---\n")).map_err(|e| e.to_string())?;
    env.install_policy(
        &file.path().display().to_string(),
        "floor",
        Some(json!({"matchLabels": {"gpuwarden.io/e2e-guarded": "floor"}})),
    )
    .await;
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
    for t in &mut times {
        t.sort_by(f64::total_cmp);
    }
    println!("{rounds} rounds of server-side dry-run creates of two-request claims, interleaved");
    // The guarded and the constant-policy series, each against the same write unguarded.
    let unguarded = 2 * series.len() / 3;
    for (at, (label, ..)) in series.iter().enumerate() {
        let (p50, p95) = (quantile(&times[at], 0.5), quantile(&times[at], 0.95));
        let base = &times[unguarded + at % (series.len() / 3)];
        let delta = if at < unguarded {
            format!(
                "  added p50 {:+.3} ms  p95 {:+.3} ms",
                p50 - quantile(base, 0.5),
                p95 - quantile(base, 0.95)
            )
        } else {
            String::new()
        };
        println!("{label:40} p50 {p50:.3} ms  p95 {p95:.3} ms{delta}");
    }
    drop(env);
    Ok(())
}
