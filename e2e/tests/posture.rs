//! The node's posture on a real node (docs/design.md, "Node posture"): what the agent reads
//! of the NVIDIA Container Toolkit and the CRI from the node's real configs and binaries,
//! what the operator judges of it, and what a process really gets from the runtime the node
//! runs: its `/dev/nvidia<N>`, not its `NVIDIA_VISIBLE_DEVICES` (every CDI spec the toolkit
//! generates sets that to `void`).
//!
//! It needs the GPU node to be this machine, busybox imported, and NVML for the in-process
//! agent. On a node that runs NVIDIA's runtime as containerd's default it also checks the
//! toolkit's version and mode; on plain runc, that the runtime hands out nothing by variable.
//! A node whose configs are not where packages put them names them:
//!
//! ```sh
//! GPUWARDEN_E2E_CONTAINERD_CONFIG=/tmp/node/containerd-nvidia.toml \
//! GPUWARDEN_E2E_TOOLKIT_CONFIG=/tmp/node/toolkit/config.toml \
//! LD_LIBRARY_PATH=<driver root>/usr/lib64 KUBECONFIG=... \
//!   cargo test -p gpuwarden-e2e --test posture -- --ignored --nocapture --test-threads=1
//! ```

use std::time::Duration;

use gpuwarden_crds::condition_types::{RUNTIME_ISOLATION, RUNTIME_PATCHED};
use gpuwarden_crds::toolkit::Version;
use gpuwarden_crds::{GpuNode, RuntimeStatus};
use gpuwarden_e2e::cluster::wait_for;
use gpuwarden_e2e::env::Env;
use gpuwarden_e2e::inproc::RealNode;
use gpuwarden_e2e::node::{SEEN_COMMAND, busybox};
use kube::api::Api;
use serde_json::{Value, json};

const TEST: &str = "the_node_says_which_doors_it_closes_and_processes_get_what_it_says";

/// A busybox pod `name` that prints what it sees, with `env` and no GPU request.
fn pod(name: &str, env: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"terminationGracePeriodSeconds": 1, "restartPolicy": "Never",
            "containers": [{"name": "c", "image": busybox(), "imagePullPolicy": "Never",
                "command": ["sh", "-c", SEEN_COMMAND], "env": env}]}})
}

/// The GpuNode once the agent has reported its runtime and the operator judged it.
async fn judged(env: &Env, node: &str) -> GpuNode {
    let api: Api<GpuNode> = Api::all(env.client());
    let found = wait_for(Duration::from_secs(90), || {
        let api = api.clone();
        async move {
            let gn = api.get_opt(node).await.ok().flatten()?;
            let status = gn.status.as_ref()?;
            status.runtime.as_ref()?;
            let conditions = status.conditions.as_ref()?;
            // Judged from a status that holds the runtime, not from one before it.
            conditions
                .iter()
                .any(|c| c.type_ == RUNTIME_PATCHED && c.reason != "NotReported")
                .then_some(gn)
        }
    })
    .await;
    found.expect("the GpuNode never showed the runtime and RuntimePatched")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a node: this machine as a Ready GPU node, NVML, busybox imported; GPUWARDEN_E2E_CONTAINERD_CONFIG / GPUWARDEN_E2E_TOOLKIT_CONFIG where the node keeps them elsewhere; KUBECONFIG=... cargo test -p gpuwarden-e2e --test posture -- --ignored --nocapture --test-threads=1"]
async fn the_node_says_which_doors_it_closes_and_processes_get_what_it_says() {
    let env = Env::new().await;
    if !env.on_this_gpu_node(TEST).await {
        return;
    }
    let Some(real) = RealNode::start(&env, TEST).await else {
        return;
    };
    let gn = judged(&env, &real.name).await;
    let status = gn.status.clone().unwrap_or_default();
    let runtime: RuntimeStatus = status.runtime.clone().unwrap_or_default();
    let gpus = status.gpus.clone().unwrap_or_default().len();
    let condition = |t: &str| {
        (status.conditions.iter().flatten())
            .find(|c| c.type_ == t)
            .cloned()
            .expect("condition")
    };
    let patched = condition(RUNTIME_PATCHED);
    let cri = runtime.container_runtime.clone();
    let nvidia_default = cri.as_ref().and_then(|c| c.nvidia_default) == Some(true);
    eprintln!(
        "{TEST}: posture read: toolkit {:?}, mode {:?} resolved {:?}, volume mounts {:?}, ignore IMEX requests {:?}, CRI {:?}, CDI kinds {:?}, injectors {:?}, unknown {:?}",
        runtime.toolkit,
        runtime.mode,
        runtime.resolved_mode,
        runtime.accept_volume_mounts,
        runtime.ignore_imex_channel_requests,
        cri,
        runtime.cdi_kinds,
        runtime.device_injectors,
        runtime.unknown
    );
    eprintln!(
        "{TEST}: RuntimePatched {} {}: {}; RuntimeIsolation: {}",
        patched.status,
        patched.reason,
        patched.message,
        condition(RUNTIME_ISOLATION).message
    );

    // What the operator says follows the version the agent read, and the summary shows it.
    match runtime.toolkit.as_ref() {
        Some(toolkit) => {
            let version = Version::parse(&toolkit.version).expect("a version that reads");
            let expected = if version.advisories().is_empty() {
                "True"
            } else {
                "False"
            };
            assert_eq!(patched.status, expected, "{patched:?}");
            assert_eq!(
                status.summary.as_ref().and_then(|s| s.toolkit.as_deref()),
                Some(toolkit.version.as_str())
            );
        }
        None => {
            assert_eq!(
                (patched.status.as_str(), patched.reason.as_str()),
                ("Unknown", "VersionUnknown")
            );
            assert!(runtime.unknown.iter().any(|u| u.field == "toolkit"));
        }
    }
    if nvidia_default {
        // The toolkit runs every container: its version and mode are known from the node.
        let toolkit = runtime.toolkit.as_ref().expect("the toolkit's version");
        assert!(
            toolkit.source.starts_with("build flags of ") || toolkit.source.starts_with("package "),
            "{toolkit:?}"
        );
        assert!(runtime.resolved_mode.is_some(), "{runtime:?}");
    }

    // What a process gets, by its device nodes: a container that holds no GPU and sets
    // NVIDIA_VISIBLE_DEVICES=all, created with no gpuwarden admission in the way.
    let ns = env.namespace("posture").await;
    let env_all = json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]);
    let (_, bare) = env
        .run_seen(&ns, &pod("env-all", env_all.clone()), None)
        .await;
    let leak = runtime.env_var_leak() && nvidia_default;
    let expected = if leak { gpus } else { 0 };
    assert_eq!(
        bare.gpu_devices.len(),
        expected,
        "with NVIDIA's runtime {} the default and the variable {}accepted: {}",
        if nvidia_default { "" } else { "not" },
        if runtime.env_var_leak() { "" } else { "not " },
        bare.summary()
    );
    if leak {
        // Its own variable reads void: every spec the toolkit generates sets it.
        assert_eq!(bare.visible.as_deref(), Some("void"), "{}", bare.summary());
    }

    // The same pod through gpuwarden's webhook: the policy reads `all` as a request for its
    // default count, which the kubelet allocates; the process sees exactly those, on either
    // runtime.
    let (webhook, _) = env.webhook().await;
    let (stored, through) = env
        .run_seen(&ns, &pod("env-all-admitted", env_all), None)
        .await;
    let spec = serde_json::to_value(&stored.spec).unwrap_or_default();
    let limit = spec["containers"][0]["resources"]["limits"][gpuwarden_crds::RESOURCE_GPU]
        .as_str()
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(0);
    assert_eq!(through.gpu_devices.len(), limit, "{}", through.summary());
    eprintln!(
        "{TEST}: no admission: the process saw {} of {gpus} GPU device nodes ({}); through the webhook: limit {limit}, env {}, saw {}",
        bare.gpu_devices.len(),
        bare.summary(),
        spec["containers"][0]["env"],
        through.summary()
    );
    webhook.stop().await;
    real.stop().await;
}
