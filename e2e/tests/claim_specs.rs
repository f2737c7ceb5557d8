//! What a claim's CDI spec hands a container, on a real node (docs/design.md, "What a
//! claim's CDI spec hands out"): NVIDIA's DRA driver prepares claims, the kubelet lists
//! their CDI devices, and the node agent reads the specs the driver wrote and names any
//! device beyond the allocation. The objects are created by the cluster admin with no
//! gpuwarden admission in the way, under a policy that lists no driver class, as a cluster
//! whose claim guard was left out would store them.
//!
//! It needs the GPU node to be this machine, with NVIDIA's DRA driver (both kubelet
//! plugins) running on it (else it prints `SKIPPED`), busybox imported, and NVML for the
//! in-process agent:
//!
//! ```sh
//! LD_LIBRARY_PATH=<driver root>/usr/lib64 KUBECONFIG=... \
//!   cargo test -p gpuwarden-e2e --test claim_specs -- --ignored --nocapture --test-threads=1
//! ```

use std::time::Duration;

use gpuwarden_crds::BindingSource;
use gpuwarden_crds::claims::DEVICE_CLASS_CD_DAEMON;
use gpuwarden_e2e::cluster::{skip, wait_for};
use gpuwarden_e2e::env::Env;
use gpuwarden_e2e::inproc::{RealNode, binding, inventory, isolated};
use gpuwarden_e2e::node::{SEEN_COMMAND, Seen, busybox};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DeleteParams};
use serde_json::{Value, json};

const TEST: &str = "the_agent_names_what_a_claims_cdi_spec_hands_out_beyond_its_allocation";

/// Where NVIDIA's DRA driver runs its own pods.
const DRIVER_NAMESPACE: &str = "nvidia-dra-driver-gpu";

/// POSTs `body` to `path` as the cluster admin; the answer's JSON.
async fn post(env: &Env, path: &str, body: &Value) -> Value {
    let r = (env.cluster)
        .raw(http::Method::POST, path, "application/json", Some(body))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(r.status.is_success(), "POST {path}: {}", r.message());
    r.body
}

/// A ComputeDomain `name` in `ns`; its UID.
async fn domain(env: &Env, ns: &str, name: &str) -> String {
    let cd = post(
        env,
        &format!("/apis/resource.nvidia.com/v1beta1/namespaces/{ns}/computedomains"),
        &json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
            "metadata": {"name": name},
            "spec": {"numNodes": 0, "channel": {"resourceClaimTemplate": {"name": format!("{name}-channel")}}}}),
    )
    .await;
    let resource = ApiResource {
        group: "resource.nvidia.com".into(),
        version: "v1beta1".into(),
        api_version: "resource.nvidia.com/v1beta1".into(),
        kind: "ComputeDomain".into(),
        plural: "computedomains".into(),
    };
    env.cleanup.own(resource, Some(ns), name);
    cd["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// A ResourceClaim `name` in `ns` with one request of `class`, and `config` when given.
async fn claim(env: &Env, ns: &str, name: &str, class: &str, config: Option<Value>) {
    let mut spec =
        json!({"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": class}}]}});
    if let Some(config) = config {
        spec["devices"]["config"] = json!([{"requests": ["r"], "opaque": config}]);
    }
    post(
        env,
        &format!("/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"),
        &json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name}, "spec": spec}),
    )
    .await;
    env.cleanup.own(
        ApiResource::erase::<k8s_openapi::api::resource::v1::ResourceClaim>(&()),
        Some(ns),
        name,
    );
}

/// The daemon's config for ComputeDomain `uid`, as the driver's controller writes it.
fn daemon_config(uid: &str) -> Value {
    json!({"driver": "compute-domain.nvidia.com", "parameters": {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainDaemonConfig",
        "domainID": uid}})
}

/// Runs a pod `name` in `ns` whose container `c` uses claim `claim`, and returns it with
/// what the container sees.
async fn run(env: &Env, ns: &str, name: &str, claim: &str) -> (Pod, Seen) {
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"terminationGracePeriodSeconds": 1, "restartPolicy": "Never",
            "resourceClaims": [{"name": "d", "resourceClaimName": claim}],
            "containers": [{"name": "c", "image": busybox(), "imagePullPolicy": "Never",
                "command": ["sh", "-c", SEEN_COMMAND], "resources": {"claims": [{"name": "d"}]}}]}});
    let seen = env.run_seen(ns, &pod, None).await;
    env.cleanup.own_typed::<Pod>(Some(ns), name);
    seen
}

/// Deletes pod `ns/name` and waits until it is gone.
async fn delete(env: &Env, ns: &str, name: &str) {
    let pods: Api<Pod> = Api::namespaced(env.client(), ns);
    (pods
        .delete(name, &DeleteParams::default().grace_period(0))
        .await)
        .unwrap_or_else(|e| panic!("{e}"));
    wait_for(Duration::from_secs(90), || {
        let pods = pods.clone();
        async move { pods.get_opt(name).await.ok()?.is_none().then_some(()) }
    })
    .await
    .unwrap_or_else(|| panic!("{ns}/{name} is gone"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a node: this machine as a Ready GPU node with NVIDIA's DRA driver (GPU and compute-domain kubelet plugins), NVML, busybox imported; KUBECONFIG=... cargo test -p gpuwarden-e2e --test claim_specs -- --ignored --nocapture --test-threads=1"]
async fn the_agent_names_what_a_claims_cdi_spec_hands_out_beyond_its_allocation() {
    let env = Env::new().await;
    if !env.on_this_gpu_node(TEST).await {
        return;
    }
    let classes = (env.cluster)
        .raw(
            http::Method::GET,
            &format!("/apis/resource.k8s.io/v1/deviceclasses/{DEVICE_CLASS_CD_DAEMON}"),
            "application/json",
            None,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    if !classes.status.is_success() {
        skip(
            TEST,
            "NVIDIA's DRA driver (compute-domain plugin) is not installed",
        );
        return;
    }
    let Some(real) = RealNode::start(&env, TEST).await else {
        return;
    };
    let gpus = inventory(&env, &real.name)
        .await
        .status
        .and_then(|s| s.gpus)
        .unwrap_or_default();
    let ns = env.namespace("claimspec").await;
    // The tenant's namespace is governed by a policy that lists no driver class or config:
    // the node side does not depend on it.
    env.policy_with(&ns, "nolist", |spec| {
        spec.driver_claims.device_classes = vec![];
        spec.driver_claims.config_kinds = vec![];
    })
    .await;

    // A GPU claim of the GPU plugin: its spec hands out its own GPU, nothing beyond.
    claim(&env, &ns, "one-gpu", "gpu.nvidia.com", None).await;
    let (pod, seen) = run(&env, &ns, "gpu-claim", "one-gpu").await;
    assert_eq!(seen.gpu_devices.len(), 1, "{}", seen.summary());
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let held = binding(&env, &real.name, &uid, "c", |b| !b.gpu_uuids.is_empty()).await;
    assert_eq!(held.source, BindingSource::Allocated, "{held:?}");
    assert_eq!(held.claims, [format!("{ns}/one-gpu")], "{held:?}");
    delete(&env, &ns, "gpu-claim").await;

    // The tenant's own ComputeDomain, and a claim on the daemon class with its config.
    let cd = domain(&env, &ns, "mine").await;
    claim(
        &env,
        &ns,
        "steal",
        DEVICE_CLASS_CD_DAEMON,
        Some(daemon_config(&cd)),
    )
    .await;
    let (pod, seen) = run(&env, &ns, "thief", "steal").await;
    assert_eq!(seen.gpu_devices.len(), gpus.len(), "{}", seen.summary());
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let beyond = binding(&env, &real.name, &uid, "c", |b| {
        b.source == BindingSource::BeyondClaim
    })
    .await;
    assert_eq!(beyond.claims, [format!("{ns}/steal")], "{beyond:?}");
    assert_eq!(beyond.gpu_uuids.len(), gpus.len(), "{beyond:?}");
    assert_eq!(beyond.device_nodes.len(), gpus.len(), "{beyond:?}");
    assert_eq!(beyond.exempt, None);
    let named = isolated(&env, &real.name, "False")
        .await
        .expect("Isolated turns False for the claim");
    assert_eq!(named.reason, "DevicesBeyondClaim", "{named:?}");
    assert!(
        named.message.contains(&format!(
            "{ns}/thief container c (the CDI spec of claim {ns}/steal hands it "
        )),
        "{named:?}"
    );
    eprintln!(
        "{TEST}: GPU claim: 1 device node, {:?}; daemon claim: {} device nodes, binding {:?} {:?}; Isolated False: {}",
        held.source,
        seen.gpu_devices.len(),
        beyond.claims,
        beyond.device_nodes,
        named.message
    );
    delete(&env, &ns, "thief").await;

    // The same in the driver's own namespace: reported, exempt, and the node isolated.
    let own = env.name("imex");
    claim(
        &env,
        DRIVER_NAMESPACE,
        &own,
        DEVICE_CLASS_CD_DAEMON,
        Some(daemon_config(&cd)),
    )
    .await;
    let (pod, seen) = run(&env, DRIVER_NAMESPACE, &own, &own).await;
    assert_eq!(seen.gpu_devices.len(), gpus.len(), "{}", seen.summary());
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let theirs = binding(&env, &real.name, &uid, "c", |b| {
        b.source == BindingSource::BeyondClaim
    })
    .await;
    assert!(
        theirs
            .exempt
            .as_deref()
            .is_some_and(|e| e.contains(DRIVER_NAMESPACE)),
        "{theirs:?}"
    );
    let quiet = isolated(&env, &real.name, "True")
        .await
        .expect("Isolated True with only the driver's own pod");
    eprintln!(
        "{TEST}: driver's namespace: exempt {:?}; Isolated {}",
        theirs.exempt, quiet.reason
    );
    delete(&env, DRIVER_NAMESPACE, &own).await;
    real.stop().await;
}
