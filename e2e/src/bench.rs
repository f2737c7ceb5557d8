//! What the benchmarks against a real API server share: the number of rounds from the
//! command line, quantiles of sorted timings, and the exit code of a run.

use std::future::Future;
use std::process::ExitCode;

/// The rounds the command line asks for (its first number), else `default`.
pub fn rounds(default: usize) -> usize {
    std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(default)
}

/// The `q` quantile of `sorted` timings (nearest rank); NaN for none.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    let at = ((sorted.len().saturating_sub(1)) as f64 * q).round() as usize;
    sorted.get(at).copied().unwrap_or(f64::NAN)
}

/// Runs benchmark `name`: success, or its error on standard error and a failure.
pub async fn exit(name: &str, run: impl Future<Output = Result<(), String>>) -> ExitCode {
    match run.await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The three namespaces a guard bench writes in, in this order: one the guard is bound to,
/// one a constant policy of the same kind is bound to (the floor of any parametrised
/// ValidatingAdmissionPolicy), and one nothing is bound to. The guard is the policy in
/// `file`; both are installed, and the namespaces are deleted by `cleanup`.
pub async fn guard_namespaces(
    env: &crate::env::Env,
    cleanup: &crate::cluster::Cleanup,
    file: &str,
) -> Result<[String; 3], String> {
    use k8s_openapi::api::core::v1::Namespace;
    use kube::api::{Api, PostParams};
    use serde_json::json;
    let names = [env.name("guarded"), env.name("floor"), env.name("plain")];
    let namespaces: Api<Namespace> = Api::all(env.cluster.client.clone());
    for (ns, label) in names.iter().zip(["true", "floor", "false"]) {
        let object: Namespace = serde_json::from_value(json!({"metadata": {"name": ns,
            "labels": {"gpuwarden.io/e2e-guarded": label}}}))
        .map_err(|e| e.to_string())?;
        (namespaces.create(&PostParams::default(), &object).await)
            .map_err(|e| format!("create namespace {ns}: {e}"))?;
        cleanup.own_typed::<Namespace>(None, ns);
    }
    env.install_policy(
        file,
        "guard",
        Some(json!({"matchLabels": {"gpuwarden.io/e2e-guarded": "true"}})),
    )
    .await;
    // The floor: the same policy kind, parameter and match, with one constant validation.
    let mut docs = crate::manifests::load_file(file).map_err(|e| e.to_string())?;
    let spec = &mut docs[0].value["spec"];
    spec["matchConditions"] = json!([]);
    spec["variables"] = json!([]);
    spec["validations"] = json!([{"expression": "true"}]);
    let floor = tempfile::NamedTempFile::new().map_err(|e| e.to_string())?;
    let text: Vec<String> = docs.iter().map(|d| d.value.to_string()).collect();
    std::fs::write(floor.path(), text.join("\n---\n")).map_err(|e| e.to_string())?;
    env.install_policy(
        &floor.path().display().to_string(),
        "floor",
        Some(json!({"matchLabels": {"gpuwarden.io/e2e-guarded": "floor"}})),
    )
    .await;
    Ok(names)
}

/// Prints each series' p50 and p95 (`times` sorted in place), and for the first two thirds
/// (guarded, then the floor) what each adds to the same write in the last third (unguarded).
pub fn report_guard(labels: &[String], times: &mut [Vec<f64>]) {
    for t in times.iter_mut() {
        t.sort_by(f64::total_cmp);
    }
    let third = labels.len() / 3;
    let unguarded = 2 * third;
    for (at, label) in labels.iter().enumerate() {
        let (p50, p95) = (quantile(&times[at], 0.5), quantile(&times[at], 0.95));
        let base = &times[unguarded + at % third.max(1)];
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
}
