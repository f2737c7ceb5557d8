//! What the ConfigMap guard (`deploy/admission/runtime-variables.yaml`) costs the API server:
//! it meets every ConfigMap and Secret create and update in the cluster. ConfigMaps and
//! Secrets of a few keys each are created (server-side dry runs) in a namespace the guard is
//! bound to, in one a policy of the same kind with one constant validation is bound to (the
//! floor of any ValidatingAdmissionPolicy with a parameter), and in one nothing is bound to,
//! interleaved in rotating order over one client, in the same run; and updates of an
//! existing object that change one value. The guarded namespace's
//! refusal of a runtime variable key is checked before anything is timed.
//!
//! ```sh
//! KUBECONFIG=... cargo bench -p gpuwarden-e2e --bench config_writes [-- ROUNDS]
//! ```

use std::process::ExitCode;

use gpuwarden_e2e::cluster::Cleanup;
use gpuwarden_e2e::env::Env;
use http::Method;
use serde_json::{Value, json};

/// An object of `kind` with ten keys, one of them `key`.
fn object(kind: &str, name: &str, key: &str) -> Value {
    let mut data = serde_json::Map::new();
    for k in 0..9 {
        data.insert(format!("SETTING_{k}"), json!("dmFsdWU="));
    }
    data.insert(key.to_owned(), json!("dmFsdWU="));
    json!({"apiVersion": "v1", "kind": kind, "metadata": {"name": name}, "data": data})
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    gpuwarden_e2e::bench::exit("config_writes", run(gpuwarden_e2e::bench::rounds(1000))).await
}

async fn run(rounds: usize) -> Result<(), String> {
    let env = Env::new().await;
    let cluster = &env.cluster;
    let cleanup = Cleanup::new(cluster.client.clone());
    let [guarded, floor, plain] = gpuwarden_e2e::bench::guard_namespaces(
        &env,
        &cleanup,
        "deploy/admission/runtime-variables.yaml",
    )
    .await?;
    let write = |method: Method, ns: &str, kind: &str, body: Value| {
        let plural = if kind == "Secret" {
            "secrets"
        } else {
            "configmaps"
        };
        let name = body["metadata"]["name"].as_str().unwrap_or("").to_owned();
        let path = match method {
            Method::PUT => format!("/api/v1/namespaces/{ns}/{plural}/{name}?dryRun=All"),
            _ => format!("/api/v1/namespaces/{ns}/{plural}?dryRun=All"),
        };
        async move {
            let start = std::time::Instant::now();
            let r = (cluster
                .raw(method, &path, "application/json", Some(&body))
                .await)
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((start.elapsed().as_secs_f64() * 1000.0, r))
        }
    };
    // In force: the guarded namespace refuses a runtime variable key, the other does not.
    for attempt in 0.. {
        let body = object("ConfigMap", "probe", "NVIDIA_VISIBLE_DEVICES");
        let (_, guarded_r) = write(Method::POST, &guarded, "ConfigMap", body.clone()).await?;
        let (_, plain_r) = write(Method::POST, &plain, "ConfigMap", body).await?;
        if guarded_r.status.is_client_error() && plain_r.status.is_success() {
            break;
        }
        if attempt == 60 {
            return Err("the guard never refused the key in its namespace".into());
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    // The objects updates are timed on, created for real.
    for ns in [&guarded, &floor, &plain] {
        for kind in ["ConfigMap", "Secret"] {
            let path = format!("/api/v1/namespaces/{ns}/{}s", kind.to_lowercase());
            let body = object(kind, "existing", "APP");
            let r = (cluster
                .raw(Method::POST, &path, "application/json", Some(&body))
                .await)
                .map_err(|e| e.to_string())?;
            if !r.status.is_success() {
                return Err(format!("create {kind} existing in {ns}: {}", r.message()));
            }
        }
    }
    let current = |ns: &str, kind: &str| {
        let path = format!("/api/v1/namespaces/{ns}/{}s/existing", kind.to_lowercase());
        async move {
            (cluster
                .raw(Method::GET, &path, "application/json", None)
                .await)
                .map(|r| r.body)
                .map_err(|e| e.to_string())
        }
    };
    let mut existing = Vec::new();
    for ns in [&guarded, &floor, &plain] {
        for kind in ["ConfigMap", "Secret"] {
            existing.push(((*ns).clone(), kind, current(ns, kind).await?));
        }
    }
    // (label, method, namespace, kind)
    let series: Vec<(String, Method, &String, &str)> = [&guarded, &floor, &plain]
        .into_iter()
        .flat_map(|ns| {
            let which = match ns {
                n if n == &guarded => "guarded",
                n if n == &floor => "constant policy",
                _ => "unguarded",
            };
            ["ConfigMap", "Secret"].into_iter().flat_map(move |kind| {
                [
                    (format!("{kind} create, {which}"), Method::POST, ns, kind),
                    (format!("{kind} update, {which}"), Method::PUT, ns, kind),
                ]
            })
        })
        .collect();
    let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); series.len()];
    let warmup = 50;
    for i in 0..rounds + warmup {
        for k in 0..series.len() {
            let at = (i + k) % series.len();
            let (label, method, ns, kind) = &series[at];
            let body = if *method == Method::POST {
                object(kind, &format!("bench-{i}"), "APP")
            } else {
                let (_, _, base) = (existing.iter())
                    .find(|(n, k, _)| n == *ns && k == kind)
                    .ok_or("no existing object")?;
                let mut body = base.clone();
                body["data"]["SETTING_0"] = json!("dXBkYXRlZA==");
                body
            };
            let (ms, r) = write(method.clone(), ns, kind, body).await?;
            if !r.status.is_success() {
                return Err(format!("{label}: {}", r.message()));
            }
            if i >= warmup {
                times[at].push(ms);
            }
        }
    }
    println!("{rounds} rounds of server-side dry-run writes of 10-key objects, interleaved");
    let labels: Vec<String> = series.into_iter().map(|(label, ..)| label).collect();
    gpuwarden_e2e::bench::report_guard(&labels, &mut times);
    drop(env);
    Ok(())
}
