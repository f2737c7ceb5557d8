//! DRA on a real node: NVIDIA's DRA driver (`gpu.nvidia.com`) allocates what gpuwarden
//! rewrites, and the node agent binds what it allocated. Each test reads what the process
//! sees on the node (its `/dev/nvidia<N>` and `NVIDIA_VISIBLE_DEVICES`, printed by the
//! container), maps the device nodes to UUIDs through the minor numbers NVML reports (the
//! agent's GpuNode inventory), and holds that against the driver's allocation (the
//! ResourceClaim's devices, by the `uuid` attribute of the driver's ResourceSlices) and
//! against the agent's binding.
//!
//! They need a Ready node where NVIDIA's DRA driver publishes at least two GPUs, a kubelet
//! on containerd >= 1.7 with CDI, the busybox image on the node, and NVML for the in-process
//! agent (`LD_LIBRARY_PATH`, the same NVML, or mock NVML config, as the driver's). Elsewhere
//! they print `SKIPPED` and why. Some need more, and say so when it is missing:
//!
//! - the extended-resource test: a DeviceClass with `extendedResourceName: nvidia.com/gpu`
//!   (KEP-5004) and no device plugin serving `nvidia.com/gpu` on the node;
//! - the device-plugin test: NVIDIA's device plugin beside the driver (allocatable
//!   `nvidia.com/gpu`);
//! - the void-rule test: this machine as the node (root, `ctr`), to import an image whose
//!   config sets `NVIDIA_VISIBLE_DEVICES=all`; a DRA driver of another device (a NIC, or
//!   Kubernetes' `dra-test-driver`) for its non-GPU claim;
//! - the out-of-band test: NVIDIA's mock NVML (`MOCK_NVML_CONFIG`), which is told which
//!   host PIDs run on which GPU.
//!
//! ```sh
//! KUBECONFIG=... cargo test -p gpuwarden-e2e --test dra -- --ignored --nocapture --test-threads=1
//! ```

use std::collections::BTreeSet;
use std::time::Duration;

use gpuwarden_crds::admission::policies::render;
use gpuwarden_crds::claims::template_name;
use gpuwarden_crds::condition_types::ISOLATED;
use gpuwarden_crds::node::Binding;
use gpuwarden_crds::{BindingSource, GpuNode, GpuPolicy, PolicyMode, RESOURCE_GPU, RequestAs};
use gpuwarden_e2e::cluster::{skip, wait_for};
use gpuwarden_e2e::dra::{
    DraNode, GPU_DRIVER, NEEDS_DRA_NODE, allocated_devices, dra_node, extended_resource_class,
};
use gpuwarden_e2e::env::{Env, SHORT};
use gpuwarden_e2e::inproc::{RealNode, binding, inventory, isolated};
use gpuwarden_e2e::node::{
    Images, MockProcesses, SEEN_COMMAND, Seen, busybox, container_host_pids, import_image,
    last_visible, local_node_problem,
};
use http::Method;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use serde_json::{Value, json};

/// How long a pod may take to be allocated, prepared and started.
const RUN_TIMEOUT: Duration = Duration::from_secs(120);

/// The DRA node, or a `SKIPPED` line for `test`.
async fn dra_node_for(env: &Env, test: &str) -> Option<DraNode> {
    let node = dra_node(&env.cluster)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    if node.is_none() {
        skip(test, NEEDS_DRA_NODE);
    }
    node
}

/// A container that prints what it sees ([`SEEN_COMMAND`]).
fn seeing(name: &str, image: &str, extra: Value) -> Value {
    let mut c = json!({"name": name, "image": image, "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", SEEN_COMMAND]});
    if let (Some(c), Some(extra)) = (c.as_object_mut(), extra.as_object()) {
        c.extend(extra.clone());
    }
    c
}

/// A pod of `containers`, quick to delete.
fn pod(name: &str, spec: Value) -> Value {
    let mut spec = spec;
    spec["terminationGracePeriodSeconds"] = json!(1);
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})
}

/// A ResourceClaimTemplate of `count` devices of `class`.
fn claim_template(name: &str, class: &str, count: u32) -> Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "devices",
            "exactly": {"deviceClassName": class, "allocationMode": "ExactCount", "count": count}}]}}}})
}

/// In namespace `ns`: the template `one-gpu` (one GPU of NVIDIA's driver).
async fn one_gpu_template(env: &Env, ns: &str) {
    let templates = format!("/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates");
    create(env, &templates, &claim_template("one-gpu", GPU_DRIVER, 1)).await;
}

/// Creates pod `name` of `spec` in `ns` (its containers printing what they see).
async fn create_seeing(env: &Env, ns: &str, name: &str, spec: Value) {
    create(
        env,
        &format!("/api/v1/namespaces/{ns}/pods"),
        &pod(name, spec),
    )
    .await;
}

/// A pod spec whose container `main` (busybox) holds a claim from the template `one-gpu`.
fn one_gpu_holder() -> Value {
    json!({"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
        "containers": [seeing("main", &busybox(), json!({"resources": {"claims": [{"name": "gpu"}]}}))]})
}

/// POSTs `object` to `path` as cluster admin; the test's cleanup deletes it (with its
/// namespace, or by name where it is cluster-scoped).
async fn create(env: &Env, path: &str, object: &Value) -> Value {
    let r = env
        .cluster
        .raw(Method::POST, path, "application/json", Some(object))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        r.status.is_success(),
        "create {path}: {} {}",
        r.status,
        r.message()
    );
    r.body
}

/// Waits for pod `name` to run, then for what each of `containers` printed it sees.
async fn run(env: &Env, ns: &str, name: &str, containers: &[&str]) -> (Pod, Vec<Seen>) {
    let pods: Api<Pod> = Api::namespaced(env.client(), ns);
    let running = wait_for(RUN_TIMEOUT, || {
        let pods = pods.clone();
        async move {
            let p = pods.get(name).await.ok()?;
            (p.status.as_ref()?.phase.as_deref() == Some("Running")).then_some(p)
        }
    })
    .await;
    let Some(running) = running else {
        let status = pods.get(name).await.map(|p| p.status);
        panic!("pod {ns}/{name} never ran: {status:?}");
    };
    let mut seen = Vec::new();
    for container in containers {
        let params = kube::api::LogParams {
            container: Some((*container).to_owned()),
            ..Default::default()
        };
        let got = wait_for(SHORT, || {
            let (pods, params) = (pods.clone(), params.clone());
            async move { Seen::parse(&pods.logs(name, &params).await.ok()?) }
        })
        .await;
        seen.push(got.unwrap_or_else(|| panic!("{ns}/{name} {container} printed nothing")));
    }
    (running, seen)
}

/// The ResourceClaim behind a pod's `resourceClaims` entry `entry` (or, for `None`, the
/// claim the scheduler made for its extended resources), once allocated.
async fn allocated_claim(env: &Env, ns: &str, pod: &str, entry: Option<&str>) -> Value {
    let claim = wait_for(SHORT, || async move {
        let p = env
            .cluster
            .raw(
                Method::GET,
                &format!("/api/v1/namespaces/{ns}/pods/{pod}"),
                "application/json",
                None,
            )
            .await
            .ok()?
            .body;
        let status = &p["status"];
        let name = match entry {
            Some(entry) => (status["resourceClaimStatuses"].as_array()?.iter())
                .find(|s| s["name"] == entry)?["resourceClaimName"]
                .as_str()?
                .to_owned(),
            None => status["extendedResourceClaimStatus"]["resourceClaimName"]
                .as_str()?
                .to_owned(),
        };
        let claim = env
            .cluster
            .raw(
                Method::GET,
                &format!("/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}"),
                "application/json",
                None,
            )
            .await
            .ok()?
            .body;
        (!allocated_devices(&claim).is_empty()).then_some(claim)
    })
    .await;
    claim.unwrap_or_else(|| panic!("{ns}/{pod}: no allocated ResourceClaim for {entry:?}"))
}

/// The GPU UUIDs a claim was allocated, by the driver's own `uuid` attributes, sorted.
fn claim_uuids(node: &DraNode, claim: &Value) -> Vec<String> {
    let mut uuids: Vec<String> = allocated_devices(claim)
        .iter()
        .filter(|(driver, _, _)| driver == GPU_DRIVER)
        .map(|(driver, pool, device)| {
            node.uuid_of(driver, pool, device)
                .unwrap_or_else(|| panic!("no ResourceSlice publishes {driver}/{pool}/{device}"))
                .to_owned()
        })
        .collect();
    uuids.sort();
    uuids
}

/// `namespace/name` of a claim.
fn claim_ref(claim: &Value) -> String {
    format!(
        "{}/{}",
        claim["metadata"]["namespace"].as_str().unwrap_or_default(),
        claim["metadata"]["name"].as_str().unwrap_or_default()
    )
}

/// The GPUs a container sees: its device nodes are exactly `uuids`, and its
/// `NVIDIA_VISIBLE_DEVICES` names nothing else (the driver's CDI spec sets `void`; a
/// runtime that reads it anyway must find no other GPU), and no MIG access variable is set.
fn assert_sees_exactly(gn: &GpuNode, what: &str, seen: &Seen, uuids: &[String]) {
    assert_eq!(
        gpuwarden_e2e::inproc::device_uuids(gn, seen),
        uuids,
        "{what}: its device nodes are not its allocation ({})",
        seen.summary()
    );
    let named = seen.visible_ids();
    assert!(
        named.is_empty() || named == uuids,
        "{what}: NVIDIA_VISIBLE_DEVICES names other GPUs ({})",
        seen.summary()
    );
    assert!(seen.mig.is_empty(), "{what}: {}", seen.summary());
}

/// Waits for pod `train` of `ns` to run; its container `main` must see exactly the two GPUs
/// its claim (the pod's `resourceClaims` entry `entry`, or for `None` the claim the scheduler
/// made for its extended resource) was allocated, and the agent must bind them to that claim.
/// Returns what it saw, the claim, its GPUs and the binding.
async fn train_runs_with_two_claimed_gpus(
    env: &Env,
    dra: &DraNode,
    ns: &str,
    entry: Option<&str>,
) -> (Seen, Value, Vec<String>, Binding) {
    let (running, seen) = run(env, ns, "train", &["main"]).await;
    let claim = allocated_claim(env, ns, "train", entry).await;
    let claimed = claim_uuids(dra, &claim);
    assert_eq!(claimed.len(), 2, "{claim:#}");
    let gn = inventory(env, &dra.name).await;
    assert_sees_exactly(&gn, "train/main", &seen[0], &claimed);
    let pod_uid = running.metadata.uid.clone().unwrap_or_default();
    let bound = binding(env, &dra.name, &pod_uid, "main", |b| b.gpu_uuids == claimed).await;
    assert_eq!(bound.claims, [claim_ref(&claim)], "{bound:?}");
    assert_eq!(bound.source, BindingSource::Allocated, "{bound:?}");
    let seen = seen.into_iter().next().expect("main");
    (seen, claim, claimed, bound)
}

/// The ResourceClaim path end to end: a privileged pod naming GPUs 0 and 1, in a namespace
/// whose policy asks for `requestAs: ResourceClaim`, is rewritten into a claim from the
/// operator's template; NVIDIA's driver allocates it two GPUs; the process sees exactly their
/// device nodes; the agent binds the claim and those UUIDs; the metrics agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a DRA node: NVIDIA's DRA driver publishing 2 GPUs, containerd >= 1.7 with CDI, NVML for the agent; KUBECONFIG=... cargo test -p gpuwarden-e2e --test dra -- --ignored --test-threads=1"]
async fn resource_claim_mode_runs_with_exactly_the_claimed_gpus() {
    let test = "resource_claim_mode_runs_with_exactly_the_claimed_gpus";
    let env = Env::new().await;
    let Some(dra) = dra_node_for(&env, test).await else {
        return;
    };
    let real = RealNode::start_on(&env, dra.name.clone()).await;
    let ns = env.namespace("dra-claim").await;
    env.policy_with(&ns, "claims", |spec| {
        spec.gpu.request_as = RequestAs::ResourceClaim;
        spec.gpu.max_per_container = 2;
    })
    .await;
    let template = template_name(GPU_DRIVER, 2);
    let path =
        format!("/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates/{template}");
    let kept = wait_for(Duration::from_secs(60), || {
        let path = path.clone();
        let env = &env;
        async move {
            let r = env
                .cluster
                .raw(Method::GET, &path, "application/json", None)
                .await;
            r.ok().filter(|r| r.status.is_success())
        }
    })
    .await;
    assert!(kept.is_some(), "the operator never made {ns}/{template}");
    let (webhook, _) = env.webhook().await;

    let privileged = pod(
        "train",
        json!({"containers": [seeing("main", &busybox(), json!({
            "securityContext": {"privileged": true},
            "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,1"}]}))]}),
    );
    let created = env
        .create_admitted(&ns, &privileged, "the claim rewrite", |r| {
            r.status.is_success() && r.body["spec"]["resourceClaims"].is_array()
        })
        .await;
    let stored = &created.body["spec"];
    assert_eq!(
        stored["resourceClaims"],
        json!([{"name": "gpuwarden-gpus-0", "resourceClaimTemplateName": template}])
    );
    let main = &stored["containers"][0];
    assert_eq!(main["securityContext"]["privileged"], false, "{main}");
    assert_eq!(
        main["resources"]["claims"],
        json!([{"name": "gpuwarden-gpus-0"}])
    );

    let (seen, claim, claimed, bound) =
        train_runs_with_two_claimed_gpus(&env, &dra, &ns, Some("gpuwarden-gpus-0")).await;
    assert_eq!(
        bound.resource_name.as_deref(),
        Some(GPU_DRIVER),
        "{bound:?}"
    );
    real.holder_series(&ns, "train", &claimed).await;
    eprintln!(
        "{test}: {ns}/train claim {} allocated {claimed:?}; the process sees {}; binding {:?} {:?}",
        claim_ref(&claim),
        seen.summary(),
        bound.claims,
        bound.gpu_uuids
    );
    webhook.stop().await;
    real.stop().await;
}

/// KEP-5004: where a DeviceClass maps `nvidia.com/gpu` to NVIDIA's driver and no device
/// plugin serves it, the ExtendedResource rewrite (`nvidia.com/gpu: 2`) is allocated through
/// DRA: the scheduler makes a claim for it, the process sees its two GPUs, and the agent
/// binds that claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a DRA node: NVIDIA's DRA driver publishing 2 GPUs and a DeviceClass with extendedResourceName nvidia.com/gpu, no device plugin; KUBECONFIG=... cargo test -p gpuwarden-e2e --test dra -- --ignored --test-threads=1"]
async fn an_extended_resource_served_by_dra_runs_with_its_gpus() {
    let test = "an_extended_resource_served_by_dra_runs_with_its_gpus";
    let env = Env::new().await;
    let Some(dra) = dra_node_for(&env, test).await else {
        return;
    };
    let class = extended_resource_class(&env.cluster, RESOURCE_GPU)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let Some(class) = class else {
        skip(
            test,
            "no DeviceClass has extendedResourceName nvidia.com/gpu (KEP-5004, DRAExtendedResource: beta and on by default in Kubernetes 1.36)",
        );
        return;
    };
    if dra.plugin_gpus() > 0 {
        skip(
            test,
            &format!(
                "a device plugin serves nvidia.com/gpu on {}: the scheduler gives the limit to it, not to DRA",
                dra.name
            ),
        );
        return;
    }
    let real = RealNode::start_on(&env, dra.name.clone()).await;
    let ns = env.namespace("dra-extended").await;
    env.policy_for(&ns, PolicyMode::Enforce, false).await;
    let (webhook, _) = env.webhook().await;

    let privileged = pod(
        "train",
        json!({"containers": [seeing("main", &busybox(), json!({
            "securityContext": {"privileged": true},
            "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,1"}]}))]}),
    );
    let created = env
        .create_admitted(&ns, &privileged, "the extended-resource rewrite", |r| {
            r.status.is_success()
                && r.body["spec"]["containers"][0]["resources"]["limits"][RESOURCE_GPU] == "2"
        })
        .await;
    assert_eq!(created.body["spec"]["resourceClaims"], Value::Null);

    let (seen, claim, claimed, _) = train_runs_with_two_claimed_gpus(&env, &dra, &ns, None).await;
    eprintln!(
        "{test}: DeviceClass {class}; {ns}/train limit nvidia.com/gpu: 2 allocated {claimed:?} through claim {}; the process sees {}",
        claim_ref(&claim),
        seen.summary()
    );
    webhook.stop().await;
    real.stop().await;
}

/// The void rule with claims, on both admission paths (the webhook alone, the
/// MutatingAdmissionPolicy alone): in one pod of an image whose config sets
/// `NVIDIA_VISIBLE_DEVICES=all`, the container holding a GPU claim sees its GPU and no other,
/// the container holding a claim on another driver's device sees no GPU, and the container
/// holding nothing sees none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a DRA node: NVIDIA's DRA driver publishing 2 GPUs, this machine as the node (root, ctr), another DRA driver for the non-GPU claim; KUBECONFIG=... cargo test -p gpuwarden-e2e --test dra -- --ignored --test-threads=1"]
async fn the_void_rule_holds_beside_claims_on_a_dra_node() {
    let test = "the_void_rule_holds_beside_claims_on_a_dra_node";
    let env = Env::new().await;
    let Some(dra) = dra_node_for(&env, test).await else {
        return;
    };
    if let Some(problem) = local_node_problem(&dra.node, &[]) {
        skip(test, &problem);
        return;
    }
    let other = dra.other_drivers().into_iter().next().map(str::to_owned);
    if other.is_none() {
        skip(
            &format!("{test}: the container with a non-GPU claim"),
            "no DRA driver of another device publishes on the node (a NIC driver, or Kubernetes' dra-test-driver)",
        );
    }
    let image = format!("gpuwarden.test/{}-cuda-like:env-all", env.cluster.run_id);
    let mut images = Images::default();
    import_image(&image, &mut images);
    let real = RealNode::start_on(&env, dra.name.clone()).await;
    let other_class = env.name("other");
    if let Some(driver) = &other {
        create(
            &env,
            "/apis/resource.k8s.io/v1/deviceclasses",
            &json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                "metadata": {"name": other_class},
                "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{driver}'")}}]}}),
        )
        .await;
        env.cleanup.own(
            kube::discovery::ApiResource {
                group: "resource.k8s.io".into(),
                version: "v1".into(),
                api_version: "resource.k8s.io/v1".into(),
                kind: "DeviceClass".into(),
                plural: "deviceclasses".into(),
            },
            None,
            &other_class,
        );
    }
    let policies: Vec<GpuPolicy> = Api::<GpuPolicy>::all(env.client())
        .list(&ListParams::default())
        .await
        .expect("list GpuPolicies")
        .items;
    let map = env.cluster.mutating_policy_api().await;

    for way in ["webhook", "policy"] {
        let ns = env.namespace(&format!("dra-void-{way}")).await;
        let webhook = match way {
            "webhook" => Some(env.webhook().await.0),
            _ => {
                let Some(api) = map else {
                    skip(
                        &format!("{test} through the policy"),
                        "the server does not serve MutatingAdmissionPolicy",
                    );
                    continue;
                };
                let governing: Vec<&GpuPolicy> = policies.iter().collect();
                env.cluster
                    .install_mutating_policy(
                        render(&governing, |_| true, api),
                        api,
                        &env.name(&format!("void-{way}")),
                        &[&ns],
                        &env.cleanup,
                    )
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                None
            }
        };
        one_gpu_template(&env, &ns).await;
        let templates = format!("/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates");
        let mut claims = vec![json!({"name": "gpu", "resourceClaimTemplateName": "one-gpu"})];
        let mut containers = vec![
            seeing(
                "gpu",
                &image,
                json!({"resources": {"claims": [{"name": "gpu"}]}}),
            ),
            seeing("plain", &image, json!({})),
        ];
        if other.is_some() {
            create(
                &env,
                &templates,
                &claim_template("one-other", &other_class, 1),
            )
            .await;
            claims.push(json!({"name": "other", "resourceClaimTemplateName": "one-other"}));
            containers.push(seeing(
                "other",
                &image,
                json!({"resources": {"claims": [{"name": "other"}]}}),
            ));
        }
        let object = pod(
            "claims",
            json!({"resourceClaims": claims, "containers": containers}),
        );
        let names: Vec<&str> = (containers.iter())
            .filter_map(|c| c["name"].as_str())
            .collect();
        env.until_admission(&ns, &object, "the void rule", |r| {
            r.status.is_success()
                && (r.body["spec"]["containers"]
                    .as_array()
                    .into_iter()
                    .flatten())
                .all(|c| last_visible(c).as_deref() == Some("void"))
        })
        .await;
        let created = env
            .cluster
            .create_pod(&ns, &object, false)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(created.status.is_success(), "{created:?}");
        for c in created.body["spec"]["containers"]
            .as_array()
            .expect("containers")
        {
            assert_eq!(last_visible(c).as_deref(), Some("void"), "{way}: {c}");
        }

        let (_, seen) = run(&env, &ns, "claims", &names).await;
        let gn = inventory(&env, &dra.name).await;
        let gpu_claim = allocated_claim(&env, &ns, "claims", Some("gpu")).await;
        let claimed = claim_uuids(&dra, &gpu_claim);
        assert_eq!(claimed.len(), 1, "{gpu_claim:#}");
        let mut report = Vec::new();
        for (name, seen) in names.iter().zip(&seen) {
            let holds = if *name == "gpu" {
                claimed.clone()
            } else {
                Vec::new()
            };
            assert_sees_exactly(&gn, &format!("{way}: claims/{name}"), seen, &holds);
            assert!(
                seen.visible.as_deref() != Some("all"),
                "{way}: claims/{name}: {}",
                seen.summary()
            );
            report.push(format!("{name}: {}", seen.summary()));
        }
        if other.is_some() {
            let other_claim = allocated_claim(&env, &ns, "claims", Some("other")).await;
            let devices = allocated_devices(&other_claim);
            assert!(
                devices.iter().all(|(d, _, _)| Some(d) == other.as_ref()),
                "{other_claim:#}"
            );
            report.push(format!("other claim allocated {devices:?}"));
        }
        eprintln!(
            "{test} ({way}): gpu claim {claimed:?}; {}",
            report.join("; ")
        );
        if let Some(webhook) = webhook {
            webhook.stop().await;
        }
    }
    real.stop().await;
    drop(images);
}

/// Out-of-band detection stays quiet for processes on GPUs their claim was allocated, and
/// `Isolated` stays True; the same detection names a container that runs on a GPU it holds
/// no claim to. The mock NVML is told the containers' host PIDs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a DRA node: NVIDIA's DRA driver publishing 2 GPUs on NVIDIA's mock NVML (MOCK_NVML_CONFIG), this machine as the node; KUBECONFIG=... cargo test -p gpuwarden-e2e --test dra -- --ignored --test-threads=1"]
async fn claim_allocated_processes_are_not_out_of_band() {
    let test = "claim_allocated_processes_are_not_out_of_band";
    let env = Env::new().await;
    let Some(dra) = dra_node_for(&env, test).await else {
        return;
    };
    if let Some(problem) = local_node_problem(&dra.node, &[]) {
        skip(test, &problem);
        return;
    }
    let Some(processes) = MockProcesses::open() else {
        skip(
            test,
            "MOCK_NVML_CONFIG is unset: on real NVML the containers would have to run CUDA",
        );
        return;
    };
    let real = RealNode::start_on(&env, dra.name.clone()).await;
    let ns = env.namespace("dra-oob").await;
    one_gpu_template(&env, &ns).await;
    create_seeing(&env, &ns, "holder", one_gpu_holder()).await;
    let plain = json!({"containers": [seeing("main", &busybox(), json!({}))]});
    create_seeing(&env, &ns, "rogue", plain).await;
    let (holder, _) = run(&env, &ns, "holder", &["main"]).await;
    let (rogue, _) = run(&env, &ns, "rogue", &["main"]).await;
    let claim = allocated_claim(&env, &ns, "holder", Some("gpu")).await;
    let claimed = claim_uuids(&dra, &claim);
    let gn = inventory(&env, &dra.name).await;
    let gpus = gn
        .status
        .as_ref()
        .and_then(|s| s.gpus.clone())
        .unwrap_or_default();
    let index_of = |uuid: &str| {
        (gpus.iter())
            .find(|g| g.uuid == uuid)
            .map(|g| g.index)
            .unwrap_or_else(|| panic!("NVML lists no {uuid}"))
    };
    let held = index_of(&claimed[0]);
    let free = (gpus.iter())
        .find(|g| g.uuid != claimed[0])
        .map(|g| g.index)
        .expect("a second GPU");
    let pid_of = |p: &Pod| {
        let id = (p
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref()))
        .and_then(|c| c.first()?.container_id.clone())
        .unwrap_or_default();
        *container_host_pids(&id)
            .first()
            .unwrap_or_else(|| panic!("no host process of container {id}"))
    };
    let (holder_pid, rogue_pid) = (pid_of(&holder), pid_of(&rogue));

    // The claim holder runs on its GPU: allocated and observed, nothing out of band.
    processes.set(&[(held, holder_pid)]);
    let holder_uid = holder.metadata.uid.clone().unwrap_or_default();
    let seen_on_claim = binding(&env, &dra.name, &holder_uid, "main", |b| {
        b.source == BindingSource::AllocatedAndObserved
    })
    .await;
    assert_eq!(seen_on_claim.gpu_uuids, claimed, "{seen_on_claim:?}");
    assert_eq!(seen_on_claim.claims, [claim_ref(&claim)]);
    let isolated = |status: &'static str| isolated(&env, &dra.name, status);
    let quiet = isolated("True").await.expect("Isolated stays True");

    // A container with no claim on another GPU is named.
    processes.set(&[(held, holder_pid), (free, rogue_pid)]);
    let named = isolated("False")
        .await
        .expect("Isolated turns False for the rogue container");
    assert_eq!(named.reason, "OutOfBandGpuUse", "{named:?}");
    assert!(named.message.contains(&format!("{ns}/rogue")), "{named:?}");
    assert!(
        !named.message.contains(&format!("{ns}/holder")),
        "{named:?}"
    );
    processes.set(&[(held, holder_pid)]);
    isolated("True").await.expect("Isolated back to True");
    eprintln!(
        "{test}: holder pid {holder_pid} on GPU {held} ({:?}): {:?}, Isolated {}; rogue pid {rogue_pid} on GPU {free}: {}",
        claimed, seen_on_claim.source, quiet.reason, named.message
    );
    drop(processes);
    real.stop().await;
}

/// NVIDIA's device plugin beside the DRA driver on one node. The two allocators do not know
/// of each other, so a pod that takes every GPU the device plugin offers shares one with a
/// pod holding a GPU claim. Each pod sees what its own allocator gave it; each binding names
/// where its GPUs came from (the resource name, or the driver and its claim); the GpuNode
/// counts each GPU once, and `Isolated` turns False naming the GPU handed out twice and both
/// holders, until one of them goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a DRA node: NVIDIA's DRA driver publishing 2 GPUs beside NVIDIA's device plugin, NVML for the agent; KUBECONFIG=... cargo test -p gpuwarden-e2e --test dra -- --ignored --test-threads=1"]
async fn the_device_plugin_beside_the_driver_is_named_where_both_hand_out_a_gpu() {
    let test = "the_device_plugin_beside_the_driver_is_named_where_both_hand_out_a_gpu";
    let env = Env::new().await;
    let Some(dra) = dra_node_for(&env, test).await else {
        return;
    };
    let plugin_gpus = dra.plugin_gpus();
    if plugin_gpus == 0 {
        skip(
            test,
            &format!("no device plugin serves nvidia.com/gpu on {}", dra.name),
        );
        return;
    }
    let real = RealNode::start_on(&env, dra.name.clone()).await;
    let ns = env.namespace("dra-both").await;
    one_gpu_template(&env, &ns).await;
    create_seeing(&env, &ns, "claim", one_gpu_holder()).await;
    let (claim_pod, claim_seen) = run(&env, &ns, "claim", &["main"]).await;
    let claim = allocated_claim(&env, &ns, "claim", Some("gpu")).await;
    let claimed = claim_uuids(&dra, &claim);
    let gn = inventory(&env, &dra.name).await;
    assert_sees_exactly(&gn, "claim/main", &claim_seen[0], &claimed);
    let every_gpu = json!({"resources": {"limits": {RESOURCE_GPU: plugin_gpus.to_string()}}});
    let plugin = json!({"containers": [seeing("main", &busybox(), every_gpu)]});
    create_seeing(&env, &ns, "plugin", plugin).await;
    let (plugin_pod, plugin_seen) = run(&env, &ns, "plugin", &["main"]).await;
    // The device plugin's allocation is the UUIDs it sets (envvar strategy) and the device
    // nodes it passes.
    let plugin_gave = plugin_seen[0].visible_ids();
    assert_eq!(
        plugin_gave.len(),
        plugin_gpus as usize,
        "{}",
        plugin_seen[0].summary()
    );
    assert_eq!(
        gpuwarden_e2e::inproc::device_uuids(&gn, &plugin_seen[0]),
        plugin_gave
    );
    assert!(
        plugin_gave.contains(&claimed[0]),
        "every GPU of the device plugin, the claimed one among them: {plugin_gave:?}"
    );

    let uid = |p: &Pod| p.metadata.uid.clone().unwrap_or_default();
    let from_plugin = binding(&env, &dra.name, &uid(&plugin_pod), "main", |b| {
        b.gpu_uuids == plugin_gave
    })
    .await;
    assert_eq!(from_plugin.resource_name.as_deref(), Some(RESOURCE_GPU));
    assert!(from_plugin.claims.is_empty(), "{from_plugin:?}");
    let from_claim = binding(&env, &dra.name, &uid(&claim_pod), "main", |b| {
        b.gpu_uuids == claimed
    })
    .await;
    assert_eq!(from_claim.resource_name.as_deref(), Some(GPU_DRIVER));
    assert_eq!(from_claim.claims, [claim_ref(&claim)]);

    // Each GPU counts once, and the GPU handed out twice is named with both holders.
    let api: Api<GpuNode> = Api::all(env.client());
    let named = wait_for(Duration::from_secs(60), || {
        let api = api.clone();
        let name = dra.name.clone();
        async move {
            let gn = api.get_opt(&name).await.ok().flatten()?;
            let status = gn.status?;
            let held: BTreeSet<String> = (status.bindings?.into_iter())
                .flat_map(|b| b.gpu_uuids)
                .collect();
            let allocated = status.summary?.allocated?;
            let isolated = (status.conditions?.into_iter()).find(|c| c.type_ == ISOLATED)?;
            (allocated as usize == held.len() && isolated.reason == "GpuAllocatedTwice")
                .then_some((allocated, isolated))
        }
    })
    .await;
    let (allocated, isolated) =
        named.expect("Isolated False with GpuAllocatedTwice, each GPU counted once");
    assert_eq!(isolated.status, "False");
    for needle in [
        format!(
            "{}: {ns}/plugin container main (nvidia.com/gpu)",
            claimed[0]
        ),
        format!("{ns}/claim container main (claim {})", claim_ref(&claim)),
    ] {
        assert!(
            isolated.message.contains(&needle),
            "{needle} in {}",
            isolated.message
        );
    }
    let plugin_api: Api<Pod> = Api::namespaced(env.client(), &ns);
    let _ = plugin_api.delete("plugin", &Default::default()).await;
    let alone = wait_for(Duration::from_secs(90), || {
        let api = api.clone();
        let name = dra.name.clone();
        async move {
            let gn = api.get_opt(&name).await.ok().flatten()?;
            let c = (gn.status?.conditions?.into_iter()).find(|c| c.type_ == ISOLATED)?;
            (c.status == "True").then_some(c)
        }
    })
    .await;
    assert!(
        alone.is_some(),
        "Isolated back to True once the device plugin's pod is gone"
    );
    eprintln!(
        "{test}: the driver gave {claimed:?} through {} ({}); the device plugin gave {plugin_gave:?}; {allocated} GPUs allocated; Isolated {}: {}",
        claim_ref(&claim),
        claim_seen[0].summary(),
        isolated.reason,
        isolated.message
    );
    real.stop().await;
}
