//! GPU-sharing schedulers' admission beside gpuwarden's, on a real API server and node
//! (docs/design.md, "GPU-sharing schedulers"). HAMi cannot be built here, so its webhook is a
//! model that writes into containers what HAMi's NVIDIA device writes at admission
//! (Project-HAMi/HAMi v2.10.0, pkg/device/nvidia/device.go `MutateAdmission`): a container
//! asking for device memory or cores but no `nvidia.com/gpu` gets `nvidia.com/gpu: 1`, and one
//! with a GPU but neither gets `nvidia.com/gpucores: 100`. It is registered as HAMi's is
//! (`CREATE` pods, `failurePolicy: Ignore`, `reinvocationPolicy: Never`) under a name that
//! sorts after gpuwarden's, so the API server calls gpuwarden first and, as gpuwarden's
//! configuration asks (`IfNeeded`), again after it. No HAMi scheduler runs here either: the
//! test binds its pod to the node itself (`nodeName`), and the model leaves `schedulerName`
//! alone; the kubelet admits the memory limit nobody advertises, as it does for HAMi, and
//! NVIDIA's device plugin allocates the GPU.
//!
//! The pod's image sets `NVIDIA_VISIBLE_DEVICES=all` in its config, as CUDA images do. Its
//! process must see exactly the GPU the kubelet allocated: gpuwarden's first pass voids the
//! container (it holds no GPU yet), and its second removes that `void`, which would hide the
//! device plugin's UUID.
//!
//! ```sh
//! KUBECONFIG=... cargo test -p gpuwarden-e2e --test sharing -- --ignored --nocapture --test-threads=1
//! ```

use std::sync::Arc;
use std::time::Duration;

use gpuwarden_crds::GpuPolicy;
use gpuwarden_crds::admission::policies::render;
use gpuwarden_e2e::cluster::{LocalWebhook, base64, namespaces_named, skip, wait_for};
use gpuwarden_e2e::env::Env;
use gpuwarden_e2e::node::{
    Images, NEEDS_GPU_NODE, SEEN_COMMAND, Seen, gpu_node, import_image, kubelet_gpus, last_visible,
    local_node_problem, pod_resources_socket,
};
use gpuwarden_webhook::admission::{Outcome, ReviewSummary};
use gpuwarden_webhook::server::Reviewer;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, LogParams, PostParams};
use serde_json::{Value, json};

/// HAMi's resources that stand for a share of a GPU.
const SHARES: [&str; 3] = [
    "nvidia.com/gpumem",
    "nvidia.com/gpumem-percentage",
    "nvidia.com/gpucores",
];

/// The model of HAMi's mutating webhook (see the module docs).
struct HamiModel;

impl HamiModel {
    /// The JSONPatch HAMi's webhook answers for `pod`.
    fn patch(pod: &Value) -> Vec<Value> {
        let mut ops = Vec::new();
        for field in ["initContainers", "containers"] {
            for (i, c) in (pod["spec"][field].as_array().into_iter().flatten()).enumerate() {
                let limits = &c["resources"]["limits"];
                let has = |r: &str| limits.get(r).is_some();
                let base = format!("/spec/{field}/{i}/resources/limits");
                let add = |ops: &mut Vec<Value>, r: &str, q: &str| {
                    let path = format!("{base}/{}", r.replace('/', "~1"));
                    ops.push(json!({"op": "add", "path": path, "value": q}));
                };
                if SHARES.iter().any(|r| has(r)) && !has("nvidia.com/gpu") {
                    add(&mut ops, "nvidia.com/gpu", "1");
                }
                let whole_memory = !has("nvidia.com/gpumem")
                    || limits["nvidia.com/gpumem-percentage"].as_str() == Some("100");
                if (has("nvidia.com/gpu") || SHARES.iter().any(|r| has(r)))
                    && !has("nvidia.com/gpucores")
                    && whole_memory
                {
                    add(&mut ops, "nvidia.com/gpucores", "100");
                }
            }
        }
        ops
    }
}

impl Reviewer for HamiModel {
    fn review(&self, body: &[u8]) -> (Vec<u8>, ReviewSummary) {
        let review: Value = serde_json::from_slice(body).unwrap_or_default();
        let uid = review["request"]["uid"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let ops = Self::patch(&review["request"]["object"]);
        let mut response = json!({"uid": uid, "allowed": true});
        if !ops.is_empty() {
            response["patchType"] = json!("JSONPatch");
            response["patch"] = json!(base64(Value::from(ops).to_string().as_bytes()));
        }
        let answer = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "response": response});
        let summary = ReviewSummary {
            uid,
            outcome: Outcome::Allowed,
            policy: None,
            pod: None,
        };
        (answer.to_string().into_bytes(), summary)
    }
}

/// How gpuwarden runs beside HAMi's webhook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    /// As installed: its webhook and the API server's policy.
    Installed,
    /// Its webhook configuration, calling a port where nothing listens, and the policy.
    WebhookDown,
    /// The API server's policy alone.
    PolicyAlone,
}

/// A pod asking HAMi for 3000 MiB of one GPU's memory and nothing else of GPUs, bound to
/// `node`, whose process prints what it sees.
fn vgpu_pod(image: &str, node: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "vgpu"},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1, "containers": [{
            "name": "main", "image": image, "imagePullPolicy": "Never",
            "command": ["sh", "-c", SEEN_COMMAND],
            "resources": {"limits": {"nvidia.com/gpumem": "3000"}}}]}})
}

/// gpuwarden, then HAMi's webhook, then gpuwarden again: a container that asks HAMi for a
/// share of a GPU runs with exactly the GPU the kubelet allocated it, never with the image's
/// `all`; where gpuwarden's webhook is down the pod is refused, and where only the API
/// server's policy runs (once, before HAMi's webhook) it keeps the `void`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a node: this machine as a Ready node with 2 allocatable nvidia.com/gpu (NVIDIA's device plugin), root, ctr; KUBECONFIG=... cargo test -p gpuwarden-e2e --test sharing -- --ignored --nocapture --test-threads=1"]
async fn a_hami_share_runs_with_the_gpu_the_kubelet_allocated() {
    let test = "a_hami_share_runs_with_the_gpu_the_kubelet_allocated";
    let env = Env::new().await;
    let node = gpu_node(&env.cluster)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let Some(node) = node else {
        skip(test, NEEDS_GPU_NODE);
        return;
    };
    if let Some(why) = local_node_problem(&node, &["tar", "sha256sum"]) {
        skip(test, &why);
        return;
    }
    let node = node["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let Some(api) = env.cluster.mutating_policy_api().await else {
        skip(test, "the server does not serve MutatingAdmissionPolicy");
        return;
    };
    let image = format!("gpuwarden.test/{}-cuda-like:env-all", env.cluster.run_id);
    let mut images = Images::default();
    import_image(&image, &mut images);
    let gpuwarden = env.started_webhook().await;
    let hami = LocalWebhook::start_reviewer(Arc::new(HamiModel))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let policies: Vec<GpuPolicy> = Api::<GpuPolicy>::all(env.client())
        .list(&ListParams::default())
        .await
        .expect("list GpuPolicies")
        .items;
    let governing: Vec<&GpuPolicy> = policies.iter().collect();

    for way in [Way::Installed, Way::WebhookDown, Way::PolicyAlone] {
        let suffix = format!("{way:?}").to_lowercase();
        let ns = env
            .namespace_at(&format!("hami-{suffix}"), "baseline")
            .await;
        let only = namespaces_named(&[&ns]);
        env.cluster
            .install_mutating_policy(
                render(&governing, |_| true, api),
                api,
                &env.name(&format!("hami-{suffix}")),
                &[&ns],
                &env.cleanup,
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        match way {
            Way::Installed => {
                env.register_webhook(&gpuwarden.url, &gpuwarden.ca_pem, only.clone(), &suffix)
                    .await;
            }
            Way::WebhookDown => {
                env.register_unreachable_webhook(only.clone(), &suffix)
                    .await;
            }
            Way::PolicyAlone => {}
        }
        register_hami(&env, &hami, only, &suffix).await;

        // The policy is in force once a container without a GPU comes back voided.
        let mut plain = vgpu_pod(&image, &node);
        plain["metadata"]["name"] = json!("plain");
        plain["spec"]["containers"][0]["resources"] = json!({});
        env.until_admission(&ns, &plain, "the void rule", |r| {
            r.status.is_success()
                && last_visible(&r.body["spec"]["containers"][0]).as_deref() == Some("void")
        })
        .await;
        let pod = vgpu_pod(&image, &node);
        // The configurations take a moment to reach the API server's admission chain.
        let probe = |r: &gpuwarden_e2e::cluster::RawResponse| match way {
            Way::WebhookDown => r.message().contains("failed calling webhook"),
            _ => {
                let c = &r.body["spec"]["containers"][0];
                r.status.is_success() && c["resources"]["limits"]["nvidia.com/gpu"] == "1"
            }
        };
        let dry = env
            .until_admission(&ns, &pod, "HAMi's webhook", probe)
            .await;
        if way == Way::WebhookDown {
            eprintln!("{test} ({way:?}): refused: {}", dry.message());
            continue;
        }
        let created = env
            .create_admitted(&ns, &pod, "the vGPU pod", |r| r.status.is_success())
            .await;
        let stored = &created.body["spec"]["containers"][0];
        let pods: Api<Pod> = Api::namespaced(env.client(), &ns);
        let log = wait_for(Duration::from_secs(120), || {
            let pods = pods.clone();
            async move { Seen::parse(&pods.logs("vgpu", &LogParams::default()).await.ok()?) }
        })
        .await
        .unwrap_or_else(|| panic!("{way:?}: the pod never printed what it sees"));
        let allocated = kubelet_gpus(&pod_resources_socket(), &ns, "vgpu").await;
        let allocated = (allocated.into_iter())
            .find(|(c, _)| c == "main")
            .map(|(_, ids)| ids)
            .unwrap_or_default();
        assert_eq!(
            allocated.len(),
            1,
            "{way:?}: the kubelet allocated {allocated:?}"
        );
        eprintln!(
            "{test} ({way:?}): stored NVIDIA_VISIBLE_DEVICES={}, limits {}; the process sees {}; the kubelet allocated {allocated:?}",
            last_visible(stored).unwrap_or_else(|| "(unset)".into()),
            stored["resources"]["limits"],
            log.summary()
        );
        assert!(
            log.visible.as_deref() != Some("all"),
            "{way:?}: the image's value is in force"
        );
        match way {
            Way::Installed => {
                assert_eq!(last_visible(stored), None, "{way:?}: {stored}");
                assert!(
                    (created.warnings.iter()).any(|w| w.contains(
                        "main: NVIDIA_VISIBLE_DEVICES=void removed, as it holds nvidia.com/gpu"
                    )),
                    "{way:?}: gpuwarden's second pass said nothing: {:?}",
                    created.warnings
                );
                log.holds_exactly(&allocated)
                    .unwrap_or_else(|e| panic!("{way:?}: {e}"));
            }
            // Runs once, before HAMi's webhook: the void stays and hides the GPU. Never more
            // than the allocation, and what the README says to install.
            _ => {
                assert_eq!(last_visible(stored).as_deref(), Some("void"), "{stored}");
                assert!(log.visible_ids().is_empty(), "{}", log.summary());
            }
        }
        let _ = pods.delete("vgpu", &Default::default()).await;
    }
    gpuwarden.stop().await;
    hami.stop().await;
    drop(images);
}

/// Registers the HAMi model as HAMi's chart registers its webhook, for the namespaces
/// `selector` selects, under a name that sorts after gpuwarden's configurations.
async fn register_hami(env: &Env, hami: &LocalWebhook, selector: Value, suffix: &str) {
    let name = format!("hami-webhook-{}-{suffix}", env.cluster.run_id);
    let config: MutatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": name},
        "webhooks": [{
            "name": "vgpu.hami.io",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "failurePolicy": "Ignore",
            "reinvocationPolicy": "Never",
            "timeoutSeconds": 10,
            "namespaceSelector": selector,
            "objectSelector": {"matchExpressions": [
                {"key": "hami.io/webhook", "operator": "NotIn", "values": ["ignore"]}]},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                "resources": ["pods"], "scope": "Namespaced"}],
            "clientConfig": {"url": hami.url, "caBundle": base64(hami.ca_pem.as_bytes())},
        }],
    }))
    .expect("MutatingWebhookConfiguration");
    Api::<MutatingWebhookConfiguration>::all(env.client())
        .create(&PostParams::default(), &config)
        .await
        .unwrap_or_else(|e| panic!("failed to register the HAMi model: {e}"));
    env.cleanup
        .own_typed::<MutatingWebhookConfiguration>(None, &name);
}

#[test]
fn the_hami_model_writes_what_hamis_webhook_writes() {
    let pod = json!({"spec": {"containers": [
        {"name": "mem", "resources": {"limits": {"nvidia.com/gpumem": "3000"}}},
        {"name": "whole", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
        {"name": "cores", "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30"}}},
        {"name": "none"}]}});
    let ops = HamiModel::patch(&pod);
    assert_eq!(
        ops,
        [
            json!({"op": "add", "path": "/spec/containers/0/resources/limits/nvidia.com~1gpu", "value": "1"}),
            json!({"op": "add", "path": "/spec/containers/1/resources/limits/nvidia.com~1gpucores", "value": "100"}),
        ]
    );
}
