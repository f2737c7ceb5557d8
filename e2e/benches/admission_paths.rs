//! The added create latency of a privileged GPU pod through each admission path on a real API
//! server: the MutatingAdmissionPolicy rendered from the default GpuPolicy, with no webhook,
//! and gpuwarden's webhook (in this process, over TLS), with no policy; and of a pod without
//! privilege through the policy (the void rule; the webhook is not sent such a pod). Beside
//! them, the floor of the machine: the same privileged pod through a policy of two constant
//! operations (privileged off, a GPU limit), the least a rewrite by the API server costs; and
//! what the shipped start-up warning (`deploy/admission/start-up-warnings.yaml`) adds beside
//! the policy, to a pod it reads (rewritten) and to one it only matches against.
//! Each is interleaved with the same create in a namespace that nothing touches, in rotating
//! order, as server-side dry-run creates over one client; the stored pods of both paths are
//! compared.
//!
//! ```sh
//! KUBECONFIG=... cargo bench -p gpuwarden-e2e --bench admission_paths [-- ROUNDS]
//! ```

use std::collections::BTreeMap;
use std::process::ExitCode;

use gpuwarden_crds::GpuPolicy;
use gpuwarden_crds::admission::policies::render;
use gpuwarden_e2e::bench::quantile;
use gpuwarden_e2e::cluster::{Cleanup, Cluster, LocalWebhook, admitted, base64};
use gpuwarden_e2e::manifests::load_file;
use gpuwarden_webhook::admission::StaticSource;
use http::Method;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

/// The pod: one privileged container that takes GPUs 0 and 1 by environment variable.
fn pod(i: usize) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": format!("bench-{i}")},
        "spec": {"containers": [{"name": "train", "image": "nvcr.io/nvidia/pytorch:24.05-py3",
            "securityContext": {"privileged": true, "capabilities": {"add": ["IPC_LOCK"]}},
            "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,1"}]}]}})
}

/// The same pod as an MPI worker starts it: `sshd`, a step the start-up warning names.
fn sshd(i: usize) -> Value {
    let mut pod = pod(i);
    pod["spec"]["containers"][0]["command"] = json!(["/usr/sbin/sshd", "-De"]);
    pod
}

/// A pod without privilege, two containers holding no GPU: what the void rule is for.
fn ordinary(i: usize) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": format!("plain-{i}")},
        "spec": {"containers": [
            {"name": "app", "image": "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"},
            {"name": "side", "image": "busybox"}]}})
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    gpuwarden_e2e::bench::exit("admission_paths", run(gpuwarden_e2e::bench::rounds(1000))).await
}

async fn run(rounds: usize) -> Result<(), String> {
    let cluster = Cluster::connect().await.map_err(|e| e.to_string())?;
    let api = (cluster.mutating_policy_api().await)
        .ok_or("the API server does not serve MutatingAdmissionPolicy")?;
    let cleanup = Cleanup::new(cluster.client.clone());
    let name = |suffix: &str| format!("gpuwarden-bench-{}-{suffix}", cluster.run_id);
    let (policy_ns, webhook_ns, plain_ns) = (name("policy"), name("webhook"), name("plain"));
    let (floor_ns, warned_ns) = (name("floor"), name("warned"));
    let namespaces: Api<Namespace> = Api::all(cluster.client.clone());
    for ns in [&policy_ns, &webhook_ns, &plain_ns, &floor_ns, &warned_ns] {
        let object: Namespace =
            serde_json::from_value(json!({"metadata": {"name": ns}})).map_err(|e| e.to_string())?;
        (namespaces.create(&PostParams::default(), &object).await)
            .map_err(|e| format!("create namespace {ns}: {e}"))?;
        cleanup.own_typed::<Namespace>(None, ns);
    }

    let mut policy = GpuPolicy::default_policy();
    policy.metadata.name = Some(gpuwarden_crds::DEFAULT_POLICY_NAME.to_owned());
    let rendered = render(&[&policy], |_| true, api);
    let mut floor = rendered.clone();
    floor[0].object["spec"]["variables"] = json!([]);
    floor[0].object["spec"]["mutations"] = json!([{"patchType": "JSONPatch", "jsonPatch": {
        "expression": "[JSONPatch{op: 'add', path: '/spec/containers/0/securityContext/privileged', value: false}, JSONPatch{op: 'add', path: '/spec/containers/0/resources', value: {'limits': {'nvidia.com/gpu': '2'}}}]"}}]);
    (cluster.install_mutating_policy(
        rendered.clone(),
        api,
        &name("policy"),
        &[&policy_ns],
        &cleanup,
    ))
    .await
    .map_err(|e| e.to_string())?;
    (cluster.install_mutating_policy(rendered, api, &name("warned"), &[&warned_ns], &cleanup))
        .await
        .map_err(|e| e.to_string())?;
    install_start_up_warning(&cluster, &name("warned"), &warned_ns, &cleanup).await?;
    (cluster.install_mutating_policy(floor, api, &name("floor"), &[&floor_ns], &cleanup))
        .await
        .map_err(|e| e.to_string())?;

    let mut source = StaticSource::new([policy]);
    source.namespaces.insert(
        webhook_ns.clone(),
        BTreeMap::from([(
            gpuwarden_crds::LABEL_NAMESPACE_NAME.to_owned(),
            webhook_ns.clone(),
        )]),
    );
    let webhook = LocalWebhook::start_static(source)
        .await
        .map_err(|e| e.to_string())?;
    let shipped = load_file("deploy/admission/mutating-webhook.yaml").map_err(|e| e.to_string())?;
    let mut mwc = shipped[0].value.clone();
    mwc["metadata"] = json!({"name": name("webhook")});
    mwc["webhooks"][0]["clientConfig"] =
        json!({"url": webhook.url, "caBundle": base64(webhook.ca_pem.as_bytes())});
    mwc["webhooks"][0]["namespaceSelector"] =
        json!({"matchLabels": {gpuwarden_crds::LABEL_NAMESPACE_NAME: webhook_ns}});
    let mwc: MutatingWebhookConfiguration =
        serde_json::from_value(mwc).map_err(|e| e.to_string())?;
    (Api::<MutatingWebhookConfiguration>::all(cluster.client.clone()))
        .create(&PostParams::default(), &mwc)
        .await
        .map_err(|e| format!("register the webhook: {e}"))?;
    cleanup.own_typed::<MutatingWebhookConfiguration>(None, &name("webhook"));

    let result = measure(
        &cluster,
        rounds,
        [&policy_ns, &webhook_ns, &plain_ns, &floor_ns, &warned_ns],
    )
    .await;
    webhook.stop().await;
    cleanup.run().await;
    result
}

/// The shipped start-up warning, renamed `name` and bound to namespace `ns`.
async fn install_start_up_warning(
    cluster: &Cluster,
    name: &str,
    ns: &str,
    cleanup: &Cleanup,
) -> Result<(), String> {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    let docs =
        load_file(gpuwarden_crds::manifests::START_UP_WARNINGS).map_err(|e| e.to_string())?;
    let mut policy = docs[0].value.clone();
    policy["metadata"] = json!({"name": name});
    let mut binding = docs[1].value.clone();
    binding["metadata"] = json!({"name": name});
    binding["spec"]["policyName"] = json!(name);
    binding["spec"]["matchResources"] = json!({"namespaceSelector":
        {"matchLabels": {gpuwarden_crds::LABEL_NAMESPACE_NAME: ns}}});
    let policy: ValidatingAdmissionPolicy =
        serde_json::from_value(policy).map_err(|e| e.to_string())?;
    let binding: ValidatingAdmissionPolicyBinding =
        serde_json::from_value(binding).map_err(|e| e.to_string())?;
    (Api::<ValidatingAdmissionPolicy>::all(cluster.client.clone()))
        .create(&PostParams::default(), &policy)
        .await
        .map_err(|e| format!("create the start-up warning: {e}"))?;
    cleanup.own_typed::<ValidatingAdmissionPolicy>(None, name);
    (Api::<ValidatingAdmissionPolicyBinding>::all(cluster.client.clone()))
        .create(&PostParams::default(), &binding)
        .await
        .map_err(|e| format!("bind the start-up warning: {e}"))?;
    cleanup.own_typed::<ValidatingAdmissionPolicyBinding>(None, name);
    Ok(())
}

async fn measure(cluster: &Cluster, rounds: usize, namespaces: [&String; 5]) -> Result<(), String> {
    let create = |ns: &str, body: Value| {
        let ns = ns.to_owned();
        async move {
            let path = format!("/api/v1/namespaces/{ns}/pods?dryRun=All");
            let start = std::time::Instant::now();
            let r = cluster
                .raw(Method::POST, &path, "application/json", Some(&body))
                .await
                .map_err(|e| e.to_string())?;
            let ms = start.elapsed().as_secs_f64() * 1000.0;
            if !r.status.is_success() {
                return Err(format!("create in {ns}: {}", r.message()));
            }
            Ok::<_, String>((ms, r.body))
        }
    };
    // Every path must rewrite before anything is timed (the API server loads policies and
    // webhook configurations a moment after they are created).
    let rewritten =
        |pod: &Value| pod["spec"]["containers"][0]["securityContext"]["privileged"] == false;
    for attempt in 0.. {
        let (_, by_policy) = create(namespaces[0], pod(0)).await?;
        let (_, by_webhook) = create(namespaces[1], pod(0)).await?;
        let (_, by_floor) = create(namespaces[3], pod(0)).await?;
        let (_, warned) = create(namespaces[4], pod(0)).await?;
        if rewritten(&by_policy)
            && rewritten(&by_webhook)
            && rewritten(&by_floor)
            && rewritten(&warned)
        {
            if admitted(&by_policy) != admitted(&by_webhook) {
                return Err(format!(
                    "the paths store different pods:\n{}\n{}",
                    admitted(&by_policy),
                    admitted(&by_webhook)
                ));
            }
            break;
        }
        if attempt == 60 {
            return Err("a policy or the webhook never rewrote the pod".into());
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    // (label, namespace, privileged pod or not), timed against the untouched namespace's
    // create of the same pod.
    let series = [
        (
            "privileged GPU pod, API server's policy",
            namespaces[0],
            true,
        ),
        ("privileged GPU pod, webhook", namespaces[1], true),
        ("privileged GPU pod, untouched", namespaces[2], true),
        (
            "privileged GPU pod, two-operation policy",
            namespaces[3],
            true,
        ),
        (
            "pod without privilege, API server's policy",
            namespaces[0],
            false,
        ),
        ("pod without privilege, untouched", namespaces[2], false),
        (
            "privileged GPU pod, policy and start-up warning",
            namespaces[4],
            true,
        ),
        (
            "pod without privilege, policy and start-up warning",
            namespaces[4],
            false,
        ),
        (
            "privileged GPU pod running sshd, policy",
            namespaces[0],
            true,
        ),
        (
            "privileged GPU pod running sshd, policy and warning",
            namespaces[4],
            true,
        ),
    ];
    let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); series.len()];
    let warmup = 50;
    for i in 0..rounds + warmup {
        for k in 0..series.len() {
            let at = (i + k) % series.len();
            let (label, ns, privileged) = series[at];
            let body = match (privileged, label.contains("sshd")) {
                (true, true) => sshd(i),
                (true, false) => pod(i),
                (false, _) => ordinary(i),
            };
            let (ms, stored) = create(ns, body).await?;
            let touched = ns != namespaces[2];
            if privileged && touched && !rewritten(&stored) {
                return Err(format!("{label}: pod {i} not rewritten"));
            }
            let voided = stored["spec"]["containers"][0]["env"][0]["value"] == "void";
            if !privileged && touched != voided {
                return Err(format!("{label}: pod {i} voided: {voided}"));
            }
            if i >= warmup {
                times[at].push(ms);
            }
        }
    }
    for t in &mut times {
        t.sort_by(f64::total_cmp);
    }
    println!("{rounds} rounds of server-side dry-run creates, interleaved");
    for (at, (label, _, privileged)) in series.iter().enumerate() {
        let base = &times[if *privileged { 2 } else { 5 }];
        let (p50, p95) = (quantile(&times[at], 0.5), quantile(&times[at], 0.95));
        println!(
            "{label:50} p50 {p50:.3} ms  p95 {p95:.3} ms  added p50 {:+.3} ms  p95 {:+.3} ms",
            p50 - quantile(base, 0.5),
            p95 - quantile(base, 0.95)
        );
    }
    Ok(())
}
