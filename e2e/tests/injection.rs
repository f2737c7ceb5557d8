//! Device-injection annotations on a real node (docs/design.md, "Device-injection
//! annotations"): containerd's NRI device injector hands a container the device nodes a pod
//! annotation names, by `major:minor`, and the node agent says whether they are GPUs the
//! kubelet allocated to the pod. Admission counts the GPUs an annotation names; the agent
//! checks which. The pods here are created by the cluster admin with no gpuwarden admission
//! in the way, as a cluster whose webhook was bypassed would store them.
//!
//! It needs the GPU node to be this machine, with containerd's NRI and containerd/nri's
//! `device-injector` plugin running (else it prints `SKIPPED`), busybox imported, and NVML
//! for the in-process agent:
//!
//! ```sh
//! LD_LIBRARY_PATH=<driver root>/usr/lib64 KUBECONFIG=... \
//!   cargo test -p gpuwarden-e2e --test injection -- --ignored --nocapture --test-threads=1
//! ```

use std::time::Duration;

use gpuwarden_crds::BindingSource;
use gpuwarden_e2e::cluster::{skip, wait_for};
use gpuwarden_e2e::env::Env;
use gpuwarden_e2e::inproc::{RealNode, binding, inventory, isolated};
use gpuwarden_e2e::node::{SEEN_COMMAND, Seen, busybox};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};
use serde_json::{Value, json};

const TEST: &str = "the_agent_names_gpus_an_annotation_injects_beyond_the_pods_allocation";

/// A pod whose container `holder` holds `gpus` GPUs and whose container `daemon` is handed,
/// by an NRI device annotation, the device nodes of the GPUs of minor numbers `minors`.
fn pod(name: &str, gpus: usize, minors: &[u32]) -> Value {
    let devices: String = (minors.iter())
        .map(|n| format!("- path: /dev/nvidia{n}\n  type: c\n  major: 195\n  minor: {n}\n"))
        .collect();
    let c = |name: &str| {
        json!({"name": name, "image": busybox(), "imagePullPolicy": "Never",
            "command": ["sh", "-c", SEEN_COMMAND]})
    };
    let mut holder = c("holder");
    holder["resources"] = json!({"limits": {"nvidia.com/gpu": gpus.to_string()}});
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name,
            "annotations": {"devices.noderesource.dev/container.daemon": devices}},
        "spec": {"terminationGracePeriodSeconds": 1, "restartPolicy": "Never",
            "containers": [c("daemon"), holder]}})
}

/// Runs `pod` in `ns` and returns it with what its daemon container sees.
async fn run(env: &Env, ns: &str, pod: &Value) -> (Pod, Seen) {
    env.run_seen(ns, pod, Some("daemon")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a node: this machine as a Ready GPU node with containerd's NRI device injector, NVML, busybox imported; KUBECONFIG=... cargo test -p gpuwarden-e2e --test injection -- --ignored --nocapture --test-threads=1"]
async fn the_agent_names_gpus_an_annotation_injects_beyond_the_pods_allocation() {
    let env = Env::new().await;
    if !env.on_this_gpu_node(TEST).await {
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
    let minors: Vec<u32> = gpus.iter().filter_map(|g| g.minor_number).collect();
    assert_eq!(
        minors.len(),
        gpus.len(),
        "NVML gives every GPU a minor number"
    );
    let ns = env.namespace("injection").await;
    let pods: Api<Pod> = Api::namespaced(env.client(), &ns);

    // GPUDirect-TCPXO's shape: the pod holds every GPU of the node, and its daemon is
    // handed all of them by the annotation. Nothing is out of band.
    let (covered, seen) = run(&env, &ns, &pod("covered", minors.len(), &minors)).await;
    if seen.gpu_devices.is_empty() {
        skip(
            TEST,
            "no device reached the daemon: containerd's NRI device injector does not run on the node",
        );
        real.stop().await;
        return;
    }
    assert_eq!(seen.gpu_devices.len(), minors.len(), "{}", seen.summary());
    let uid = covered.metadata.uid.clone().unwrap_or_default();
    let held = binding(&env, &real.name, &uid, "holder", |b| {
        b.gpu_uuids.len() == minors.len()
    })
    .await;
    assert_eq!(held.source, BindingSource::Allocated, "{held:?}");
    let quiet = isolated(&env, &real.name, "True")
        .await
        .expect("Isolated True while the annotation names the pod's own GPUs");
    (pods
        .delete("covered", &DeleteParams::default().grace_period(0))
        .await)
        .unwrap_or_else(|e| panic!("{e}"));
    wait_for(Duration::from_secs(90), || {
        let pods = pods.clone();
        async move { pods.get_opt("covered").await.ok()?.is_none().then_some(()) }
    })
    .await
    .expect("the covered pod is gone");

    // One GPU held, every GPU named: the daemon gets them all, and the agent names the
    // others as injected beyond the allocation.
    let (beyond, seen) = run(&env, &ns, &pod("beyond", 1, &minors)).await;
    assert_eq!(seen.gpu_devices.len(), minors.len(), "{}", seen.summary());
    let uid = beyond.metadata.uid.clone().unwrap_or_default();
    let injected = binding(&env, &real.name, &uid, "daemon", |b| {
        b.source == BindingSource::Injected
    })
    .await;
    assert_eq!(injected.gpu_uuids.len(), minors.len() - 1, "{injected:?}");
    let named = isolated(&env, &real.name, "False")
        .await
        .expect("Isolated turns False for the injected GPUs");
    assert_eq!(named.reason, "OutOfBandGpuUse", "{named:?}");
    assert!(
        named.message.contains(&format!(
            "{ns}/beyond container daemon (by a device-injection annotation)"
        )),
        "{named:?}"
    );
    eprintln!(
        "{TEST}: covered: daemon saw {} device nodes, Isolated {}; beyond: daemon saw {}, injected binding {:?}, Isolated False: {}",
        minors.len(),
        quiet.reason,
        seen.gpu_devices.len(),
        injected.gpu_uuids,
        named.message
    );
    (pods
        .delete("beyond", &DeleteParams::default().grace_period(0))
        .await)
        .unwrap_or_else(|e| panic!("{e}"));
    real.stop().await;
}
