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

use gpuwarden_crds::admission::policies::{MutatingApi, render};
use gpuwarden_crds::{BindingSource, GpuPolicy, KaiSharing, SharingSpec};
use gpuwarden_e2e::cluster::{LocalWebhook, base64, namespaces_named, skip, wait_for};
use gpuwarden_e2e::env::Env;
use gpuwarden_e2e::inproc::{binding, inventory, isolated, start_operator_with, start_real_agent};
use gpuwarden_e2e::node::{
    Images, MockProcesses, NEEDS_GPU_NODE, SEEN_COMMAND, Seen, container_host_pids, gpu_node,
    import_image, kubelet_gpus, last_visible, local_node_problem, pod_resources_socket,
};
use gpuwarden_webhook::admission::{Outcome, ReviewSummary};
use gpuwarden_webhook::server::Reviewer;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams, LogParams, PostParams};
use serde_json::{Value, json};

/// The GPU node, when it is this machine and the server serves MutatingAdmissionPolicy:
/// its name and the policy's API; `None`, with a `SKIPPED` line for `test`, otherwise.
async fn this_gpu_node(env: &Env, test: &str) -> Option<(String, MutatingApi)> {
    let node = gpu_node(&env.cluster)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let Some(node) = node else {
        skip(test, NEEDS_GPU_NODE);
        return None;
    };
    if let Some(why) = local_node_problem(&node, &["tar", "sha256sum"]) {
        skip(test, &why);
        return None;
    }
    let Some(api) = env.cluster.mutating_policy_api().await else {
        skip(test, "the server does not serve MutatingAdmissionPolicy");
        return None;
    };
    let name = node["metadata"]["name"].as_str().unwrap_or_default();
    Some((name.to_owned(), api))
}

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
        patch_answer(body, Self::patch)
    }
}

/// How gpuwarden runs beside HAMi's webhook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    /// As installed: its webhook and the API server's policy.
    Installed,
    /// Its webhook alone (the operator's `--admission-policies=false`).
    WebhookAlone,
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
    let Some((node, api)) = this_gpu_node(&env, test).await else {
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

    for way in [
        Way::Installed,
        Way::WebhookAlone,
        Way::WebhookDown,
        Way::PolicyAlone,
    ] {
        let suffix = format!("{way:?}").to_lowercase();
        let ns = env
            .namespace_at(&format!("hami-{suffix}"), "baseline")
            .await;
        let only = namespaces_named(&[&ns]);
        if way != Way::WebhookAlone {
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
        }
        match way {
            Way::Installed | Way::WebhookAlone => {
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
        if way != Way::WebhookAlone {
            let mut plain = vgpu_pod(&image, &node);
            plain["metadata"]["name"] = json!("plain");
            plain["spec"]["containers"][0]["resources"] = json!({});
            env.until_admission(&ns, &plain, "the void rule", |r| {
                r.status.is_success()
                    && last_visible(&r.body["spec"]["containers"][0]).as_deref() == Some("void")
            })
            .await;
        }
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
            // Without the API server's policy nothing voided the container before HAMi's
            // webhook gave it its GPU.
            Way::WebhookAlone => {
                assert_eq!(last_visible(stored), None, "{way:?}: {stored}");
                log.holds_exactly(&allocated)
                    .unwrap_or_else(|e| panic!("{way:?}: {e}"));
            }
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
            // than the allocation, and what docs/sharing.md says to install.
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
    register_model(
        env,
        &name,
        hami,
        json!({
            "name": "vgpu.hami.io",
            "failurePolicy": "Ignore",
            "reinvocationPolicy": "Never",
            "namespaceSelector": selector,
            "objectSelector": {"matchExpressions": [
                {"key": "hami.io/webhook", "operator": "NotIn", "values": ["ignore"]}]},
        }),
    )
    .await;
}

/// Registers the MutatingWebhookConfiguration `name` calling `model` for pod CREATE, with
/// the scheduler's own settings in `webhook`; deleted at the end of the test.
async fn register_model(env: &Env, name: &str, model: &LocalWebhook, mut webhook: Value) {
    webhook["admissionReviewVersions"] = json!(["v1"]);
    webhook["sideEffects"] = json!("None");
    webhook["timeoutSeconds"] = json!(10);
    webhook["rules"] = json!([{"apiGroups": [""], "apiVersions": ["v1"],
        "operations": ["CREATE"], "resources": ["pods"], "scope": "Namespaced"}]);
    webhook["clientConfig"] =
        json!({"url": model.url, "caBundle": base64(model.ca_pem.as_bytes())});
    let config: MutatingWebhookConfiguration =
        serde_json::from_value(json!({"metadata": {"name": name}, "webhooks": [webhook]}))
            .expect("MutatingWebhookConfiguration");
    Api::<MutatingWebhookConfiguration>::all(env.client())
        .create(&PostParams::default(), &config)
        .await
        .unwrap_or_else(|e| panic!("failed to register {name}: {e}"));
    env.cleanup
        .own_typed::<MutatingWebhookConfiguration>(None, name);
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

/// KAI-Scheduler's names, as its Helm chart installs it (v0.17.0).
const KAI_SCHEDULER: &str = "kai-scheduler";
const KAI_RESERVATION_NAMESPACE: &str = "kai-resource-reservation";

/// The model of KAI-Scheduler's admission webhook with GPU sharing on (v0.17.0,
/// pkg/admission/webhook/v1alpha2/gpusharing and runtimeenforcement,
/// pkg/binder/common/{gpusharingconfigmap,env_vars,volumes}.go): for a pod with
/// `schedulerName: kai-scheduler` and a `gpu-fraction` or `gpu-memory` annotation, the
/// ConfigMap prefix annotation (a value already there is kept), `runtimeClassName: nvidia`
/// where unset, and in the fraction container (by `gpu-fraction-container-name`, init
/// containers first, else the first container) `NVIDIA_VISIBLE_DEVICES`, `RUNAI_NUM_OF_GPUS`
/// and `GPU_PORTION` from `<prefix>-<[i]index>` in place of any entries of those names, its
/// `-evar` envFrom, and an unmounted volume of the map.
struct KaiModel;

impl KaiModel {
    /// The JSONPatch KAI's webhook answers for `pod`.
    fn patch(pod: &Value) -> Vec<Value> {
        let annotations = &pod["metadata"]["annotations"];
        let fraction = ["gpu-fraction", "gpu-memory"]
            .iter()
            .any(|k| annotations.get(*k).is_some());
        if pod["spec"]["schedulerName"] != KAI_SCHEDULER || !fraction {
            return Vec::new();
        }
        let mut ops = Vec::new();
        let prefix = match annotations["runai/shared-gpu-configmap"].as_str() {
            Some(prefix) => prefix.to_owned(),
            None => {
                let base = (pod["metadata"]["ownerReferences"][0]["name"].as_str())
                    .or(pod["metadata"]["name"].as_str())
                    .unwrap_or("pod");
                let alphabet: Vec<char> = "bcdfghjklmnpqrstvwxz2456789".chars().collect();
                let random: String = (0..7)
                    .map(|_| alphabet[rand::random_range(0..alphabet.len())])
                    .collect();
                let prefix = format!("{base}-{random}-shared-gpu");
                ops.push(json!({"op": "add",
                    "path": "/metadata/annotations/runai~1shared-gpu-configmap", "value": prefix}));
                prefix
            }
        };
        if pod["spec"].get("runtimeClassName").is_none() {
            ops.push(json!({"op": "add", "path": "/spec/runtimeClassName", "value": "nvidia"}));
        }
        let names = |field: &str| -> Vec<String> {
            (pod["spec"][field].as_array().into_iter().flatten())
                .map(|c| c["name"].as_str().unwrap_or_default().to_owned())
                .collect()
        };
        let (init, regular) = (names("initContainers"), names("containers"));
        let named = annotations["gpu-fraction-container-name"].as_str();
        let Some((kind, index)) = gpuwarden_crds::sharing::fraction_container(
            named,
            init.iter().map(String::as_str),
            regular.iter().map(String::as_str),
        ) else {
            return ops;
        };
        let field = match kind {
            gpuwarden_crds::gpu::ContainerKind::Init => "initContainers",
            _ => "containers",
        };
        let map = gpuwarden_crds::sharing::config_map_name(&prefix, kind, index);
        let container = &pod["spec"][field][index];
        let keys = ["NVIDIA_VISIBLE_DEVICES", "RUNAI_NUM_OF_GPUS", "GPU_PORTION"];
        let mut env: Vec<Value> = (container["env"].as_array().into_iter().flatten())
            .filter(|e| !keys.iter().any(|k| e["name"] == *k))
            .cloned()
            .collect();
        env.extend(keys.map(
            |k| json!({"name": k, "valueFrom": {"configMapKeyRef": {"name": map, "key": k}}}),
        ));
        let mut env_from = container["envFrom"].as_array().cloned().unwrap_or_default();
        env_from.push(json!({"configMapRef": {"name": format!("{map}-evar"), "optional": false}}));
        let mut volumes = pod["spec"]["volumes"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        volumes.push(json!({"name": format!("{map}-vol"), "configMap": {"name": map}}));
        let at = format!("/spec/{field}/{index}");
        ops.push(json!({"op": "add", "path": format!("{at}/env"), "value": env}));
        ops.push(json!({"op": "add", "path": format!("{at}/envFrom"), "value": env_from}));
        ops.push(json!({"op": "add", "path": "/spec/volumes", "value": volumes}));
        ops
    }
}

impl Reviewer for KaiModel {
    fn review(&self, body: &[u8]) -> (Vec<u8>, ReviewSummary) {
        patch_answer(body, Self::patch)
    }
}

/// The AdmissionReview answer of a webhook that allows every pod with the JSONPatch
/// `patch` writes for it.
fn patch_answer(body: &[u8], patch: impl Fn(&Value) -> Vec<Value>) -> (Vec<u8>, ReviewSummary) {
    let review: Value = serde_json::from_slice(body).unwrap_or_default();
    let uid = review["request"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let ops = patch(&review["request"]["object"]);
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

#[test]
fn the_kai_model_writes_what_kais_webhook_writes() {
    let pod = json!({"metadata": {"name": "train", "annotations": {"gpu-fraction": "0.5"}},
        "spec": {"schedulerName": "kai-scheduler", "containers": [
            {"name": "main", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
                                     {"name": "A", "value": "1"}]},
            {"name": "log"}]}});
    let ops = KaiModel::patch(&pod);
    let prefix = ops[0]["value"].as_str().expect("the prefix").to_owned();
    let prefix = prefix.as_str();
    assert!(gpuwarden_crds::sharing::is_kai_prefix(prefix), "{prefix}");
    let mut patched = pod.clone();
    let ops: json_patch::Patch = serde_json::from_value(Value::from(ops)).expect("a patch");
    json_patch::patch(&mut patched, &ops).expect("applies");
    let main = &patched["spec"]["containers"][0];
    assert_eq!(main["env"][0], json!({"name": "A", "value": "1"}));
    assert_eq!(
        main["env"][1]["valueFrom"]["configMapKeyRef"],
        json!({"name": format!("{prefix}-0"), "key": "NVIDIA_VISIBLE_DEVICES"})
    );
    assert_eq!(
        main["envFrom"][0]["configMapRef"]["name"],
        format!("{prefix}-0-evar")
    );
    assert_eq!(patched["spec"]["runtimeClassName"], "nvidia");
    assert_eq!(patched["spec"]["containers"][1], json!({"name": "log"}));
    // Another scheduler, or no fraction: nothing.
    let mut other = pod.clone();
    other["spec"]["schedulerName"] = json!("default-scheduler");
    assert!(KaiModel::patch(&other).is_empty());
    let mut whole = pod;
    whole["metadata"]["annotations"] = json!({});
    assert!(KaiModel::patch(&whole).is_empty());
}

/// How gpuwarden runs beside KAI-Scheduler's webhook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// As installed: the API server's policy, then the webhook.
    PolicyAndWebhook,
    /// The webhook alone, sent every pod: it voids on the first pass, and judges what KAI's
    /// webhook wrote when called again. (As shipped, its match conditions do not send a
    /// pod with no GPU signal, and the API server calls again only a webhook it called
    /// before; the first path leaves KAI's grant to the backstop.)
    WebhookAlone,
}

/// KAI-Scheduler's fraction pods under gpuwarden in Enforce mode, on a real API server and
/// node. KAI cannot be built here (its Go modules are not vendored and no module proxy is
/// reachable), so its parts are models of what they write (KAI v0.17.0, read from source):
/// its admission webhook ([`KaiModel`], registered as KAI's operator registers
/// `mutating-kai-admission`), and its scheduler and binder ([`kai_bind`]: the reservation
/// pod in `kai-resource-reservation` holding `nvidia.com/gpu: 1`, the BindRequest, the two
/// ConfigMaps written as KAI's binder ServiceAccount, the binding). Under a GpuPolicy that
/// names KAI, on both admission paths, the fraction container runs with the GPU the
/// reservation pod was allocated, the other container with `void`, and the node agent shows
/// the fraction's process on that GPU as `Shared`, `Isolated` staying True; the same process
/// on another GPU is named out of band. What a namespace admin can forge of KAI's grant (its
/// ConfigMap, its shape in a pod that names its node or another scheduler) gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a node: this machine as a Ready node with 2 allocatable nvidia.com/gpu (NVIDIA's device plugin on NVIDIA's mock NVML), root, ctr; KUBECONFIG=... cargo test -p gpuwarden-e2e --test sharing -- --ignored --nocapture --test-threads=1"]
async fn a_kai_fraction_runs_with_kais_grant_and_a_forged_one_gets_nothing() {
    let test = "a_kai_fraction_runs_with_kais_grant_and_a_forged_one_gets_nothing";
    let env = Env::new().await;
    let Some((node, api)) = this_gpu_node(&env, test).await else {
        return;
    };
    let Some(processes) = MockProcesses::open() else {
        skip(
            test,
            "needs NVIDIA's mock NVML (MOCK_NVML_CONFIG) to report the fraction's process",
        );
        return;
    };
    let admin = &env.cluster;
    if kai_installed(&env).await {
        skip(
            test,
            "KAI-Scheduler itself is installed here: its objects would meet the model's",
        );
        return;
    }
    install_kai_model_kinds(&env).await;
    let image = format!("gpuwarden.test/{}-cuda-like:env-all", env.cluster.run_id);
    let mut images = Images::default();
    import_image(&image, &mut images);
    let gpuwarden = env.started_webhook().await;
    let kai = LocalWebhook::start_reviewer(Arc::new(KaiModel))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let binder = admin
        .as_service_account("kai-scheduler", "binder")
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let paths = [Path::PolicyAndWebhook, Path::WebhookAlone];
    let mut namespaces = Vec::new();
    for path in paths {
        let suffix = format!("kai-{path:?}").to_lowercase();
        namespaces.push(env.namespace_at(&suffix, "baseline").await);
    }
    let names: Vec<&str> = namespaces.iter().map(String::as_str).collect();
    register_kai(&env, &kai, namespaces_named(&names)).await;
    // The operator, for its KaiScheduler condition and the GpuNode's Isolated condition;
    // the test installs the API server's policy itself where the path has one.
    env.system_namespace().await;
    env.cleanup
        .own_typed::<gpuwarden_crds::GpuNode>(None, &node);
    let (stop_operator, operator) =
        start_operator_with(&env, |config| config.admission_policies = false);
    let (stop_agent, agent, _) = start_real_agent(&env, &node);

    for (path, ns) in paths.into_iter().zip(&namespaces) {
        let suffix = format!("kai-{path:?}").to_lowercase();
        let only = namespaces_named(&[ns]);
        let policy = env
            .policy_with(ns, "kai", |spec| {
                spec.gpu.sharing = Some(SharingSpec {
                    kai: Some(KaiSharing::default()),
                })
            })
            .await;
        if path == Path::PolicyAndWebhook {
            // The policy that governs the namespace, rendered as the operator renders it.
            let governing = Api::<GpuPolicy>::all(env.client())
                .get(&policy)
                .await
                .expect("the test's GpuPolicy");
            admin
                .install_mutating_policy(
                    render(&[&governing], |_| true, api),
                    api,
                    &env.name(&suffix),
                    &[ns],
                    &env.cleanup,
                )
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        }
        env.register_webhook(&gpuwarden.url, &gpuwarden.ca_pem, only.clone(), &suffix)
            .await;
        if path == Path::WebhookAlone {
            let r = admin
                .raw(
                    http::Method::PATCH,
                    &format!(
                        "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{}",
                        env.name(&suffix)
                    ),
                    "application/json-patch+json",
                    Some(&json!([{"op": "remove", "path": "/webhooks/0/matchConditions"}])),
                )
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(r.status.is_success(), "{}", r.message());
        }
        env.install_policy_with_param(
            "deploy/admission/backstop-policy.yaml",
            &format!("{suffix}-backstop"),
            Some(only.clone()),
            Some(&policy),
        )
        .await;
        env.install_policy(
            "deploy/admission/kai-sharing.yaml",
            &format!("{suffix}-guard"),
            Some(only.clone()),
        )
        .await;

        // KAI's webhook has run once the fraction container reads KAI's ConfigMap, and
        // gpuwarden's rules once the other container is voided.
        let pod = fraction_pod(&image);
        let created = env
            .create_admitted(ns, &pod, "the KAI fraction pod", |r| {
                let spec = &r.body["spec"];
                r.status.is_success()
                    && last_visible(&spec["containers"][0]).as_deref() == Some("(valueFrom)")
                    && last_visible(&spec["containers"][1]).as_deref() == Some("void")
            })
            .await;
        let (uuid, reservation) = kai_bind(&env, &binder, ns, "train", &node, &image).await;
        let pods: Api<Pod> = Api::namespaced(env.client(), ns);
        let seen = |container: &'static str| {
            let pods = pods.clone();
            async move {
                wait_for(Duration::from_secs(120), || {
                    let pods = pods.clone();
                    async move {
                        let params = LogParams {
                            container: Some(container.into()),
                            ..Default::default()
                        };
                        Seen::parse(&pods.logs("train", &params).await.ok()?)
                    }
                })
                .await
                .unwrap_or_else(|| panic!("{path:?}: {container} never printed what it sees"))
            }
        };
        let (main, log) = (seen("main").await, seen("log").await);
        eprintln!(
            "{test} ({path:?}): warnings {:?}; reservation {reservation} holds {uuid}; main sees {}; log sees {}",
            created.warnings,
            main.summary(),
            log.summary()
        );
        // Under runc the variable is what the NVIDIA runtime would hand over: KAI's grant.
        assert_eq!(main.visible_ids(), std::slice::from_ref(&uuid), "{path:?}");
        assert!(main.mig.is_empty() && log.mig.is_empty());
        log.holds_exactly(&[])
            .unwrap_or_else(|e| panic!("{path:?}: log: {e}"));

        if path == Path::PolicyAndWebhook {
            agent_shows_the_share(&env, &node, ns, &uuid, &reservation, &processes).await;
            let condition = kai_condition(&env, &policy).await;
            eprintln!("{test}: GpuPolicy {policy} KaiScheduler: {condition}");
        }
        forgeries_get_nothing(&env, ns, &node, &image, &path).await;
        let _ = pods.delete("train", &Default::default()).await;
    }
    let _ = stop_agent.send(());
    let _ = agent.await;
    let _ = stop_operator.send(());
    let _ = operator.await;
    gpuwarden.stop().await;
    kai.stop().await;
    drop(processes);
    drop(images);
}

/// A pod asking KAI for half a GPU: `main` (the fraction container) and `log` print what
/// they see; both run the CUDA-like image, which sets `NVIDIA_VISIBLE_DEVICES=all`.
fn fraction_pod(image: &str) -> Value {
    let container = |name: &str| {
        json!({"name": name, "image": image, "imagePullPolicy": "Never",
            "command": ["sh", "-c", SEEN_COMMAND]})
    };
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "train", "annotations": {"gpu-fraction": "0.5"}},
        "spec": {"schedulerName": KAI_SCHEDULER, "terminationGracePeriodSeconds": 1,
            "containers": [container("main"), container("log")]}})
}

/// Whether KAI-Scheduler's own webhook configuration or BindRequest kind is here.
async fn kai_installed(env: &Env) -> bool {
    let webhook = Api::<MutatingWebhookConfiguration>::all(env.client())
        .get_opt("mutating-kai-admission")
        .await
        .expect("read webhook configurations");
    let crd = Api::<CustomResourceDefinition>::all(env.client())
        .get_opt("bindrequests.scheduling.run.ai")
        .await
        .expect("read CRDs");
    webhook.is_some() || crd.is_some()
}

/// What the model needs beside its webhook, each removed at the end: a minimal
/// BindRequest kind (KAI's own CRD is not copied here: the model stores what KAI's scheduler
/// writes), KAI's reservation namespace, the RuntimeClass `nvidia` KAI's webhook names
/// (here on runc), and the binder's right to write ConfigMaps.
async fn install_kai_model_kinds(env: &Env) {
    use http::Method;
    let admin = &env.cluster;
    let post = |path: &'static str, body: Value| async move {
        let r = admin
            .raw(Method::POST, path, "application/json", Some(&body))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            r.status.is_success() || r.status.as_u16() == 409,
            "{path}: {}",
            r.message()
        );
        r.status.is_success()
    };
    let crd = json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "bindrequests.scheduling.run.ai"},
        "spec": {"group": "scheduling.run.ai", "scope": "Namespaced",
            "names": {"plural": "bindrequests", "singular": "bindrequest", "kind": "BindRequest"},
            "versions": [{"name": "v1alpha2", "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object",
                    "x-kubernetes-preserve-unknown-fields": true}}}]}});
    if post(
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
        crd,
    )
    .await
    {
        env.cleanup
            .own_typed::<CustomResourceDefinition>(None, "bindrequests.scheduling.run.ai");
    }
    // KAI's namespace, once no earlier run's copy is still terminating.
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(env.client());
    let created = wait_for(Duration::from_secs(120), || {
        let namespaces = namespaces.clone();
        async move {
            match namespaces.get_opt(KAI_RESERVATION_NAMESPACE).await.ok()? {
                Some(ns) => {
                    let phase = ns.status.and_then(|s| s.phase);
                    (phase.as_deref() != Some("Terminating")).then_some(false)
                }
                None => {
                    let ns = json!({"metadata": {"name": KAI_RESERVATION_NAMESPACE}});
                    let ns = serde_json::from_value(ns).expect("a namespace");
                    namespaces
                        .create(&PostParams::default(), &ns)
                        .await
                        .ok()
                        .map(|_| true)
                }
            }
        }
    })
    .await
    .expect("KAI's reservation namespace");
    if created {
        env.cleanup
            .own_typed::<k8s_openapi::api::core::v1::Namespace>(None, KAI_RESERVATION_NAMESPACE);
    }
    let runtime_class = json!({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
        "metadata": {"name": "nvidia"}, "handler": "runc"});
    if post("/apis/node.k8s.io/v1/runtimeclasses", runtime_class).await {
        env.cleanup
            .own_typed::<k8s_openapi::api::node::v1::RuntimeClass>(None, "nvidia");
    }
    let role = env.name("kai-binder");
    post(
        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        json!({"metadata": {"name": role}, "rules": [{"apiGroups": [""],
            "resources": ["configmaps"], "verbs": ["get", "create", "patch", "update"]}]}),
    )
    .await;
    env.cleanup
        .own_typed::<k8s_openapi::api::rbac::v1::ClusterRole>(None, &role);
    post(
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        json!({"metadata": {"name": role}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole", "name": role}, "subjects": [{"kind": "ServiceAccount",
            "name": "binder", "namespace": "kai-scheduler"}]}),
    )
    .await;
    env.cleanup
        .own_typed::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>(None, &role);
    // The CRD serves once established.
    let crds: Api<CustomResourceDefinition> = Api::all(env.client());
    wait_for(Duration::from_secs(30), || {
        let crds = crds.clone();
        async move {
            let crd = crds
                .get_opt("bindrequests.scheduling.run.ai")
                .await
                .ok()??;
            let established = (crd.status?.conditions?.iter())
                .any(|c| c.type_ == "Established" && c.status == "True");
            established.then_some(())
        }
    })
    .await
    .expect("the BindRequest kind is established");
}

/// Registers the KAI model as KAI's operator registers its webhook (`CREATE` pods,
/// `failurePolicy: Fail`, `reinvocationPolicy: IfNeeded`, the scheduler-name match
/// condition), named as KAI names it, for the namespaces `selector` selects.
async fn register_kai(env: &Env, kai: &LocalWebhook, selector: Value) {
    register_model(
        env,
        "mutating-kai-admission",
        kai,
        json!({
            "name": "admission.kai-scheduler.svc",
            "failurePolicy": "Fail",
            "reinvocationPolicy": "IfNeeded",
            "namespaceSelector": selector,
            "matchConditions": [{"name": "scheduler-name-match",
                "expression": format!("object.spec.schedulerName == '{KAI_SCHEDULER}'")}],
        }),
    )
    .await;
}

/// KAI's scheduler and binder, as they bind fraction pod `ns/pod` to `node` (v0.17.0,
/// pkg/scheduler/cache/cache.go, pkg/binder/binding): a reservation pod for a new GPU group
/// in KAI's namespace, holding one GPU the kubelet allocates; the BindRequest, owned by the
/// pod; the GPU's UUID in the pod's ConfigMap and an empty `-evar` map, written as KAI's
/// binder; the group label; the binding. Returns the GPU and `namespace/name` of the
/// reservation pod.
async fn kai_bind(
    env: &Env,
    binder: &gpuwarden_e2e::cluster::Cluster,
    ns: &str,
    pod: &str,
    node: &str,
    image: &str,
) -> (String, String) {
    use http::Method;
    let admin = &env.cluster;
    let call =
        |cluster: &gpuwarden_e2e::cluster::Cluster, method: Method, path: String, body: Value| {
            let cluster = cluster.clone();
            async move {
                let content = if method == Method::PATCH {
                    "application/merge-patch+json"
                } else {
                    "application/json"
                };
                let r = cluster
                    .raw(method, &path, content, Some(&body))
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                assert!(
                    r.status.is_success(),
                    "{path}: {} {}",
                    r.status,
                    r.message()
                );
                r.body
            }
        };
    let stored = Api::<Pod>::namespaced(env.client(), ns)
        .get(pod)
        .await
        .expect("the fraction pod");
    let uid = stored.metadata.uid.clone().unwrap_or_default();
    let prefix = (stored.metadata.annotations.as_ref())
        .and_then(|a| a.get("runai/shared-gpu-configmap").cloned())
        .expect("KAI's prefix annotation");
    let group = format!("{}-{ns}", env.cluster.run_id);
    // KAI names it by a hash of node and group.
    let reservation = {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        format!("{node}/{group}").hash(&mut hasher);
        format!("gpu-reservation-{:016x}", hasher.finish())
    };
    let owner = json!([{"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid}]);

    // The reservation pod: one GPU, in KAI's namespace, bound to the node.
    call(
        admin,
        Method::POST,
        format!("/api/v1/namespaces/{KAI_RESERVATION_NAMESPACE}/pods"),
        json!({"metadata": {"name": reservation,
                "labels": {"app": "kai-resource-reservation", "runai-gpu-group": group},
                "annotations": {"karpenter.sh/do-not-disrupt": "true"}},
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1, "containers": [{
                "name": "resource-reservation", "image": image, "imagePullPolicy": "Never",
                "command": ["sh", "-c", "sleep 3600"],
                "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}),
    )
    .await;
    env.cleanup
        .own_typed::<Pod>(Some(KAI_RESERVATION_NAMESPACE), &reservation);
    // What the reservation container reads from NVML and annotates itself with: the GPU the
    // kubelet allocated it.
    let uuid = wait_for(Duration::from_secs(90), || async {
        let held = kubelet_gpus(
            &pod_resources_socket(),
            KAI_RESERVATION_NAMESPACE,
            &reservation,
        )
        .await;
        let ids = held
            .into_iter()
            .find(|(c, _)| c == "resource-reservation")?
            .1;
        (ids.len() == 1).then(|| ids[0].clone())
    })
    .await
    .expect("the kubelet allocates the reservation pod one GPU");
    call(
        admin,
        Method::PATCH,
        format!("/api/v1/namespaces/{KAI_RESERVATION_NAMESPACE}/pods/{reservation}"),
        json!({"metadata": {"annotations": {"run.ai/reserve_for_gpu_index": uuid}}}),
    )
    .await;

    // The scheduler's BindRequest, and the binder's word that it succeeded.
    let requests = format!("/apis/scheduling.run.ai/v1alpha2/namespaces/{ns}/bindrequests");
    call(
        admin,
        Method::POST,
        requests.clone(),
        json!({"apiVersion": "scheduling.run.ai/v1alpha2", "kind": "BindRequest",
            "metadata": {"name": pod, "labels": {"selected-node": node}, "ownerReferences": owner},
            "spec": {"podName": pod, "selectedNode": node, "selectedGPUGroups": [group],
                "receivedResourceType": "Fraction",
                "receivedGPU": {"count": 1, "portion": "0.50"}}}),
    )
    .await;
    call(
        admin,
        Method::PATCH,
        format!("{requests}/{pod}/status"),
        json!({"status": {"phase": "Succeeded"}}),
    )
    .await;

    // The binder's ConfigMaps, as the binder.
    let map = format!("{prefix}-0");
    for (name, data) in [
        (
            map.clone(),
            json!({"NVIDIA_VISIBLE_DEVICES": uuid, "GPU_PORTION": "0.50", "RUNAI_NUM_OF_GPUS": "0.50"}),
        ),
        (format!("{map}-evar"), json!({})),
    ] {
        call(
            binder,
            Method::POST,
            format!("/api/v1/namespaces/{ns}/configmaps"),
            json!({"metadata": {"name": name, "ownerReferences": owner}, "data": data}),
        )
        .await;
    }
    call(
        admin,
        Method::PATCH,
        format!("/api/v1/namespaces/{ns}/pods/{pod}"),
        json!({"metadata": {"labels": {"runai-gpu-group": group},
            "annotations": {"received-resource-type": "Fraction"}}}),
    )
    .await;
    call(
        admin,
        Method::POST,
        format!("/api/v1/namespaces/{ns}/pods/{pod}/binding"),
        json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}),
    )
    .await;
    (uuid, format!("{KAI_RESERVATION_NAMESPACE}/{reservation}"))
}

/// The node agent's view of the fraction on the real node: its process on the reservation's
/// GPU `uuid` is a `Shared` binding naming the reservation pod, and `Isolated` stays True;
/// the same process on another GPU is named out of band, and `Isolated` turns False until
/// it is back.
async fn agent_shows_the_share(
    env: &Env,
    node: &str,
    ns: &str,
    uuid: &str,
    reservation: &str,
    processes: &MockProcesses,
) {
    let gn = inventory(env, node).await;
    let gpus = gn.status.and_then(|s| s.gpus).unwrap_or_default();
    let index_of = |u: &str| {
        (gpus.iter())
            .find(|g| g.uuid == u)
            .map(|g| g.index)
            .unwrap_or_else(|| panic!("NVML lists no {u}"))
    };
    let held = index_of(uuid);
    let other = (gpus.iter())
        .find(|g| g.uuid != uuid)
        .map(|g| g.index)
        .expect("a second GPU");
    let pod = Api::<Pod>::namespaced(env.client(), ns)
        .get("train")
        .await
        .expect("the fraction pod");
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let id = (pod.status.and_then(|s| s.container_statuses))
        .and_then(|c| c.into_iter().find(|c| c.name == "main")?.container_id)
        .unwrap_or_default();
    let pid = *container_host_pids(&id)
        .first()
        .unwrap_or_else(|| panic!("no host process of container {id}"));

    processes.set(&[(held, pid)]);
    let shared = binding(env, node, &uid, "main", |b| {
        b.source == BindingSource::Shared
    })
    .await;
    assert_eq!(shared.gpu_uuids, [uuid.to_owned()], "{shared:?}");
    assert_eq!(shared.shared_from, [reservation.to_owned()], "{shared:?}");
    let quiet = match isolated(env, node, "True").await {
        Some(c) => c,
        None => panic!(
            "Isolated is not True for KAI's share: {:?}",
            isolated(env, node, "False").await
        ),
    };

    // Forged at run time: the same container on a GPU KAI did not grant it.
    processes.set(&[(other, pid)]);
    let named = isolated(env, node, "False")
        .await
        .expect("Isolated turns False for a fraction on another GPU");
    assert_eq!(named.reason, "OutOfBandGpuUse", "{named:?}");
    assert!(
        named
            .message
            .contains(&format!("{ns}/train container main")),
        "{named:?}"
    );
    processes.set(&[(held, pid)]);
    isolated(env, node, "True")
        .await
        .expect("Isolated back to True");
    processes.set(&[]);
    eprintln!(
        "fraction pid {pid} on GPU {held} ({uuid}): {:?} from {:?}, Isolated {} ({}); on GPU {other}: {} ({})",
        shared.source, shared.shared_from, quiet.reason, quiet.message, named.reason, named.message
    );
}

/// The `KaiScheduler` condition the operator writes on GpuPolicy `policy`, once it says KAI
/// is installed, as `reason: message`.
async fn kai_condition(env: &Env, policy: &str) -> String {
    let api: Api<GpuPolicy> = Api::all(env.client());
    let found = wait_for(Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let p = api.get_opt(policy).await.ok()??;
            let c = (p.status?.conditions.into_iter()).find(|c| c.type_ == "KaiScheduler")?;
            (c.status == "True").then(|| format!("{}: {}", c.reason, c.message))
        }
    })
    .await;
    found.unwrap_or_else(|| panic!("GpuPolicy {policy} never said KAI-Scheduler is installed"))
}

/// What a namespace admin of `ns` can write of KAI's grant without KAI, each refused:
/// a ConfigMap named as KAI names its maps, a change to the data of the binder's map, and
/// KAI's exact shape in a pod that names its node or another scheduler, reading the
/// binder's map or one of its own.
async fn forgeries_get_nothing(env: &Env, ns: &str, node: &str, image: &str, path: &Path) {
    use http::Method;
    let tenant = env.namespace_admin(ns, "tenant").await;
    let stored = Api::<Pod>::namespaced(env.client(), ns)
        .get("train")
        .await
        .expect("the fraction pod");
    let prefix = (stored.metadata.annotations.as_ref())
        .and_then(|a| a.get("runai/shared-gpu-configmap").cloned())
        .expect("KAI's prefix annotation");
    let mut refused = Vec::new();

    // Its own map under KAI's name, and the binder's map changed.
    let forged_map = json!({"metadata": {"name": "forged-bcdfghj-shared-gpu-0"},
        "data": {"NVIDIA_VISIBLE_DEVICES": "all"}});
    let r = tenant
        .raw(
            Method::POST,
            &format!("/api/v1/namespaces/{ns}/configmaps"),
            "application/json",
            Some(&forged_map),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        r.status.as_u16(),
        403,
        "{path:?}: a ConfigMap under KAI's name: {}",
        r.message()
    );
    refused.push(format!(
        "create forged-bcdfghj-shared-gpu-0: {}",
        r.message()
    ));
    let r = tenant
        .raw(
            Method::PATCH,
            &format!("/api/v1/namespaces/{ns}/configmaps/{prefix}-0"),
            "application/merge-patch+json",
            Some(&json!({"data": {"NVIDIA_VISIBLE_DEVICES": "all"}})),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        r.status.as_u16(),
        403,
        "{path:?}: the binder's map changed: {}",
        r.message()
    );
    refused.push(format!("patch {prefix}-0: refused: {}", r.message()));
    // Its own map under any other name is its business, and grants nothing.
    let own = json!({"metadata": {"name": "my-gpus"}, "data": {"NVIDIA_VISIBLE_DEVICES": "all"}});
    let r = tenant
        .raw(
            Method::POST,
            &format!("/api/v1/namespaces/{ns}/configmaps?dryRun=All"),
            "application/json",
            Some(&own),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(r.status.is_success(), "{}", r.message());

    // KAI's stored shape, written by the tenant.
    let mut shaped = fraction_pod(image);
    shaped["metadata"]["name"] = json!("forged");
    shaped["metadata"]["annotations"]["runai/shared-gpu-configmap"] = json!(prefix);
    let kai_env = |map: &str| {
        json!([{"name": "NVIDIA_VISIBLE_DEVICES",
            "valueFrom": {"configMapKeyRef": {"name": map, "key": "NVIDIA_VISIBLE_DEVICES"}}}])
    };
    shaped["spec"]["containers"][0]["env"] = kai_env(&format!("{prefix}-0"));
    shaped["spec"]["containers"][1]["env"] =
        json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]);
    let mut on_node = shaped.clone();
    on_node["spec"]["nodeName"] = json!(node);
    let mut on_node_own_map = on_node.clone();
    on_node_own_map["metadata"]["annotations"]["runai/shared-gpu-configmap"] = json!("my");
    on_node_own_map["spec"]["containers"][0]["env"] = kai_env("my-gpus");
    let mut other_scheduler = shaped.clone();
    other_scheduler["spec"]["schedulerName"] = json!("default-scheduler");
    for (what, pod) in [
        ("KAI's shape on a pod that names its node", on_node),
        ("its own map on a pod that names its node", on_node_own_map),
        ("KAI's shape for the default scheduler", other_scheduler),
    ] {
        // Refused, or rewritten as any pod naming GPUs around the kubelet is: the reference
        // gone, one GPU requested from the kubelet (docs/design.md, "Leaks").
        let r = tenant
            .create_pod(ns, &pod, true)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let main = &r.body["spec"]["containers"][0];
        if r.status.is_success() {
            assert!(
                last_visible(main).as_deref() != Some("(valueFrom)")
                    && main["resources"]["limits"]["nvidia.com/gpu"].is_string(),
                "{path:?}: {what}: admitted as it is: {main}"
            );
            refused.push(format!(
                "{what}: rewritten: NVIDIA_VISIBLE_DEVICES {}, limits {}",
                last_visible(main).unwrap_or_else(|| "(unset)".into()),
                main["resources"]["limits"]
            ));
        } else {
            assert!(
                r.message().contains("gpuwarden"),
                "{path:?}: {what}: {}",
                r.message()
            );
            refused.push(format!("{what}: refused: {}", r.message()));
        }
    }
    for line in &refused {
        eprintln!("  {path:?}: {line}");
    }
}
