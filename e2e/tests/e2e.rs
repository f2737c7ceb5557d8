//! End-to-end tests against a real API server. They need a disposable cluster (kind, k3d,
//! or any API server; kubelets are not needed: pods stay Pending, which is enough for
//! admission) and are ignored by plain `cargo test`:
//!
//! ```sh
//! KUBECONFIG=~/.kube/kind cargo test -p gpuwarden-e2e -- --ignored --test-threads=1
//! ```
//!
//! The webhook, operator and node agent run inside the test process; the API server calls
//! the webhook at `https://$GPUWARDEN_E2E_WEBHOOK_HOST:<port>/mutate` (default host
//! 127.0.0.1). Every test installs the CRDs and the default policy if they are missing and
//! deletes everything it created, also when it fails. Features the server lacks
//! (ValidatingAdmissionPolicy, matchConditions) are skipped with a message, and so are the
//! tests on a real node where no Ready node has two allocatable `nvidia.com/gpu`.

use std::collections::BTreeMap;
use std::time::Duration;

use gpuwarden_crds::{GpuNode, GpuPolicy, PolicyMode, condition_types};
use gpuwarden_e2e::cluster::{RawResponse, admitted, skip, wait_for};
use gpuwarden_e2e::env::{Env, LABEL_RUN, SHORT};
use gpuwarden_e2e::inproc::{RealNode, spawn_agent, start_operator};
use gpuwarden_e2e::node::{SEEN_COMMAND, Seen, busybox};
use http::Method;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

/// A pod with one privileged container that takes GPUs 0 and 1 by environment variable.
fn privileged_gpu_pod(name: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [{
                "name": "train",
                "image": "registry.k8s.io/pause:3.10",
                "securityContext": {"privileged": true},
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,1"}]
            }]
        }
    })
}

fn annotations(body: &Value) -> BTreeMap<String, String> {
    serde_json::from_value(body["metadata"]["annotations"].clone()).unwrap_or_default()
}

fn rewritten(r: &RawResponse) -> bool {
    r.status.is_success() && annotations(&r.body).contains_key(gpuwarden_crds::ANNOTATION_REWRITTEN)
}

/// Enforce (the default policy): a privileged GPU pod is stored unprivileged, with an
/// explicit GPU limit instead of NVIDIA_VISIBLE_DEVICES, the rewritten/policy annotations,
/// and one kubectl warning for its container; a pod without privilege is never sent to the
/// webhook (matchConditions) and is stored as written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG=... cargo test -p gpuwarden-e2e -- --ignored --test-threads=1"]
async fn enforce_rewrites_privileged_gpu_pods_with_warnings() {
    let env = Env::new().await;
    let ns = env.namespace("enforce").await;
    let (webhook, match_conditions) = env.webhook().await;
    let pod = privileged_gpu_pod("train");
    env.until_admission(&ns, &pod, "enforce", rewritten).await;

    let created = env
        .cluster
        .create_pod(&ns, &pod, false)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(created.status.is_success(), "{created:?}");
    assert!(
        created
            .warnings
            .iter()
            .any(|w| w.starts_with("gpuwarden:") && w.contains("train")),
        "no warning names the container: {:?}",
        created.warnings
    );

    let stored = Api::<Pod>::namespaced(env.client(), &ns)
        .get("train")
        .await
        .expect("the pod is stored");
    let c = &stored.spec.as_ref().expect("spec").containers[0];
    let sc = c.security_context.as_ref().expect("securityContext");
    // Privilege goes; what an ordinary container has stays (the default policy).
    assert_eq!(sc.privileged, Some(false));
    assert_eq!(sc.allow_privilege_escalation, None);
    let drop = sc.capabilities.as_ref().and_then(|c| c.drop.clone());
    assert_eq!(drop, None);
    let limits = c
        .resources
        .as_ref()
        .and_then(|r| r.limits.clone())
        .unwrap_or_default();
    assert_eq!(
        limits
            .get(gpuwarden_crds::RESOURCE_GPU)
            .map(|q| q.0.as_str()),
        Some("2"),
        "NVIDIA_VISIBLE_DEVICES=0,1 becomes two requested GPUs"
    );
    let env_vars: BTreeMap<String, Option<String>> = c
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.clone(), e.value.clone()))
        .collect();
    assert!(
        !env_vars.contains_key("NVIDIA_VISIBLE_DEVICES"),
        "{env_vars:?}"
    );
    assert_eq!(
        env_vars
            .get("NVIDIA_DRIVER_CAPABILITIES")
            .cloned()
            .flatten()
            .as_deref(),
        Some("compute,utility")
    );
    let ann = stored.annotations();
    assert!(
        ann.contains_key(gpuwarden_crds::ANNOTATION_REWRITTEN),
        "{ann:?}"
    );
    assert!(
        ann.get(gpuwarden_crds::ANNOTATION_POLICY)
            .is_some_and(|p| p.starts_with(&format!("{}@", gpuwarden_crds::DEFAULT_POLICY_NAME))),
        "{ann:?}"
    );

    // An ordinary GPU pod (unprivileged, a GPU limit, no NVIDIA variable): admitted as
    // written, and (with matchConditions) never sent.
    let before = webhook.reviews();
    let mut plain = privileged_gpu_pod("plain");
    plain["spec"]["containers"][0]["securityContext"] = json!({"privileged": false});
    plain["spec"]["containers"][0]["env"] = json!([{"name": "EPOCHS", "value": "3"}]);
    plain["spec"]["containers"][0]["resources"] = json!({"limits": {"nvidia.com/gpu": "1"}});
    let created = env
        .cluster
        .create_pod(&ns, &plain, false)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(created.status.is_success(), "{created:?}");
    assert!(created.warnings.iter().all(|w| !w.starts_with("gpuwarden")));
    assert!(!annotations(&created.body).contains_key(gpuwarden_crds::ANNOTATION_REWRITTEN));
    if match_conditions {
        assert_eq!(
            webhook.reviews(),
            before,
            "an unprivileged pod reached the webhook"
        );
    }
    webhook.stop().await;
}

/// The doors of admission on a real server: an unprivileged pod that names GPUs through
/// NVIDIA_VISIBLE_DEVICES is stored with an explicit GPU request instead; a tenant running
/// the GPU Operator's dcgm-exporter image in its own namespace is rewritten like anyone
/// else; and a rewritten pod in a namespace enforcing Pod Security `baseline` is admitted
/// by PSA, which runs after the webhook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG=... cargo test -p gpuwarden-e2e -- --ignored --test-threads=1"]
async fn leaks_tenants_and_pod_security_on_a_real_server() {
    let env = Env::new().await;
    let ns = env.namespace("doors").await;
    let (webhook, match_conditions) = env.webhook().await;
    env.until_admission(&ns, &privileged_gpu_pod("probe"), "doors", rewritten)
        .await;

    // Door 1: an unprivileged NVIDIA_VISIBLE_DEVICES=all becomes a request.
    let before = webhook.reviews();
    let mut leak = privileged_gpu_pod("leak");
    leak["spec"]["containers"][0]["securityContext"] = json!({"runAsUser": 1000});
    leak["spec"]["containers"][0]["env"] =
        json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]);
    let created = env
        .cluster
        .create_pod(&ns, &leak, false)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(rewritten(&created), "{created:?}");
    if match_conditions {
        assert!(webhook.reviews() > before, "the leaking pod was never sent");
    }
    let stored = Api::<Pod>::namespaced(env.client(), &ns)
        .get("leak")
        .await
        .expect("stored");
    let c = &stored.spec.as_ref().expect("spec").containers[0];
    let limits = (c.resources.as_ref().and_then(|r| r.limits.clone())).unwrap_or_default();
    assert_eq!(
        limits.get("nvidia.com/gpu").map(|q| q.0.as_str()),
        Some("1")
    );
    assert!(
        c.env
            .iter()
            .flatten()
            .all(|e| e.name != "NVIDIA_VISIBLE_DEVICES"),
        "{:?}",
        c.env
    );
    let sc = c.security_context.as_ref().expect("securityContext");
    assert_eq!(sc.run_as_user, Some(1000));
    assert_eq!(
        sc.privileged, None,
        "an unprivileged container keeps its context"
    );

    // Door 3: the dcgm-exporter image in a tenant's namespace is no exemption.
    let mut dcgm = privileged_gpu_pod("dcgm");
    dcgm["spec"]["containers"][0]["image"] =
        json!("nvcr.io/nvidia/k8s/dcgm-exporter:3.3.5-3.4.0-ubuntu22.04");
    dcgm["spec"]["containers"][0]["command"] = json!(["nsenter", "-t", "1", "-a", "sh"]);
    let created = env
        .cluster
        .create_pod(&ns, &dcgm, true)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(rewritten(&created), "{created:?}");
    assert_eq!(
        created.body["spec"]["containers"][0]["securityContext"]["privileged"],
        json!(false)
    );

    // Door 7: in a `baseline` namespace the rewrite withholds the capabilities baseline
    // forbids, and PSA admits the result.
    let baseline = env.namespace_at("baseline", "baseline").await;
    let mut tuned = privileged_gpu_pod("tuned");
    tuned["spec"]["containers"][0]["securityContext"]["capabilities"] =
        json!({"add": ["IPC_LOCK", "SYS_NICE"]});
    let created = env
        .until_admission(&baseline, &tuned, "baseline", |r| r.status.is_success())
        .await;
    assert!(rewritten(&created), "{created:?}");
    let created = env
        .cluster
        .create_pod(&baseline, &tuned, false)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        created.status.is_success(),
        "PSA refused the rewritten pod: {created:?}"
    );
    assert!(
        created
            .warnings
            .iter()
            .any(|w| w.contains("IPC_LOCK,SYS_NICE not added (Pod Security baseline)")),
        "{:?}",
        created.warnings
    );
    assert!(
        created.body["spec"]["containers"][0]["securityContext"]["capabilities"]
            .get("add")
            .is_none(),
        "{}",
        created.body
    );
    webhook.stop().await;
}

/// Audit: a policy in Audit mode admits the privileged GPU pod unchanged, annotates it with
/// what Enforce would do, and warns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG=... cargo test -p gpuwarden-e2e -- --ignored --test-threads=1"]
async fn audit_mode_admits_unchanged_with_warnings() {
    let env = Env::new().await;
    let ns = env.namespace("audit").await;
    env.policy_for(&ns, PolicyMode::Audit, false).await;
    let (webhook, _) = env.webhook().await;
    let pod = privileged_gpu_pod("train");
    env.until_admission(&ns, &pod, "audit", |r| {
        annotations(&r.body).contains_key(gpuwarden_crds::ANNOTATION_AUDIT)
    })
    .await;
    let created = env
        .cluster
        .create_pod(&ns, &pod, false)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(created.status.is_success(), "{created:?}");
    assert!(
        created
            .warnings
            .iter()
            .any(|w| w.starts_with("gpuwarden audit:")),
        "{:?}",
        created.warnings
    );
    let stored = Api::<Pod>::namespaced(env.client(), &ns)
        .get("train")
        .await
        .expect("stored");
    let c = &stored.spec.as_ref().expect("spec").containers[0];
    assert_eq!(
        c.security_context.as_ref().and_then(|s| s.privileged),
        Some(true),
        "Audit changes nothing"
    );
    assert!(
        stored
            .annotations()
            .contains_key(gpuwarden_crds::ANNOTATION_AUDIT)
    );
    assert!(
        !stored
            .annotations()
            .contains_key(gpuwarden_crds::ANNOTATION_REWRITTEN)
    );
    webhook.stop().await;
}

/// Deny: a policy in Deny mode rejects the privileged GPU pod with a message that names the
/// changes it needs and the offline command that makes them; nothing is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG=... cargo test -p gpuwarden-e2e -- --ignored --test-threads=1"]
async fn deny_mode_rejects_naming_each_change() {
    let env = Env::new().await;
    let ns = env.namespace("deny").await;
    env.policy_for(&ns, PolicyMode::Deny, false).await;
    let (webhook, _) = env.webhook().await;
    let pod = privileged_gpu_pod("train");
    env.until_admission(&ns, &pod, "deny", |r| r.status.is_client_error())
        .await;
    let denied = env
        .cluster
        .create_pod(&ns, &pod, false)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(denied.status.is_client_error(), "{denied:?}");
    let message = denied.message();
    for needle in ["(Deny)", "train", "privileged", "gpuwarden-webhook mutate"] {
        assert!(message.contains(needle), "{needle:?} not in {message:?}");
    }
    let stored = Api::<Pod>::namespaced(env.client(), &ns)
        .get_opt("train")
        .await
        .expect("read");
    assert!(stored.is_none(), "a denied pod was stored");
    webhook.stop().await;
}

/// An invalid policy fails closed in the cluster: a GpuPolicy whose namespaceSelector the
/// API server accepts but no selector can evaluate (operator `Equals`) governs the pods it
/// outranks, and the webhook denies a privileged GPU pod there naming the problem, rather
/// than falling back to the next policy; an unprivileged pod with nothing to judge passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG=... cargo test -p gpuwarden-e2e -- --ignored --test-threads=1"]
async fn an_invalid_policy_fails_closed() {
    let env = Env::new().await;
    let ns = env.namespace("invalid").await;
    let name = env.policy_for(&ns, PolicyMode::Enforce, false).await;
    let broken = json!({"spec": {"namespaceSelector": {
        "matchLabels": {"kubernetes.io/metadata.name": ns},
        "matchExpressions": [{"key": "team", "operator": "Equals", "values": ["a"]}]
    }}});
    Api::<GpuPolicy>::all(env.client())
        .patch(&name, &PatchParams::default(), &Patch::Merge(&broken))
        .await
        .unwrap_or_else(|e| panic!("the API server refused the selector: {e}"));
    let (webhook, _) = env.webhook().await;
    let pod = privileged_gpu_pod("train");
    let denied = env
        .until_admission(&ns, &pod, "invalid", |r| {
            r.status.is_client_error() && r.message().contains("is invalid")
        })
        .await;
    assert!(
        denied
            .message()
            .contains(&format!("GpuPolicy {name} is invalid (InvalidSelector"))
            && denied.message().contains("fails closed"),
        "{:?}",
        denied.message()
    );
    let mut plain = privileged_gpu_pod("plain");
    plain["spec"]["containers"][0]["securityContext"] = json!({"privileged": false});
    plain["spec"]["containers"][0]["env"] = json!([]);
    let admitted = env
        .cluster
        .create_pod(&ns, &plain, true)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(admitted.status.is_success(), "{admitted:?}");
    webhook.stop().await;
}

/// Exemption: in a namespace the governing policy exempts, the privileged GPU pod is
/// admitted exactly as written, without warnings or annotations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG=... cargo test -p gpuwarden-e2e -- --ignored --test-threads=1"]
async fn exempt_namespace_is_left_alone() {
    let env = Env::new().await;
    let ns = env.namespace("exempt").await;
    env.policy_for(&ns, PolicyMode::Enforce, true).await;
    let (webhook, _) = env.webhook().await;
    let pod = privileged_gpu_pod("operator-component");
    env.until_admission(&ns, &pod, "exempt", |r| {
        r.status.is_success() && annotations(&r.body).is_empty()
    })
    .await;
    let created = env
        .cluster
        .create_pod(&ns, &pod, false)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(created.status.is_success(), "{created:?}");
    assert!(
        created.warnings.iter().all(|w| !w.starts_with("gpuwarden")),
        "{:?}",
        created.warnings
    );
    let stored = Api::<Pod>::namespaced(env.client(), &ns)
        .get("operator-component")
        .await
        .expect("stored");
    let c = &stored.spec.as_ref().expect("spec").containers[0];
    assert_eq!(
        c.security_context.as_ref().and_then(|s| s.privileged),
        Some(true)
    );
    assert!(
        !stored
            .annotations()
            .keys()
            .any(|k| k.starts_with(gpuwarden_crds::ANNOTATION_PREFIX)),
        "{:?}",
        stored.annotations()
    );
    webhook.stop().await;
}

/// Ephemeral containers: adding a privileged one to a running pod (what `kubectl debug
/// --profile=sysadmin` does) is denied in a governed namespace; an unprivileged one is
/// admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG=... cargo test -p gpuwarden-e2e -- --ignored --test-threads=1"]
async fn privileged_ephemeral_container_is_denied() {
    let env = Env::new().await;
    let ns = env.namespace("ephemeral").await;
    let (webhook, _) = env.webhook().await;
    let pod = privileged_gpu_pod("train");
    env.until_admission(&ns, &pod, "enforce", rewritten).await;
    let mut target = privileged_gpu_pod("target");
    target["spec"]["containers"][0]["securityContext"] = json!({"privileged": false});
    target["spec"]["containers"][0]["env"] = json!([]);
    let created = env
        .cluster
        .create_pod(&ns, &target, false)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(created.status.is_success(), "{created:?}");

    let path = format!("/api/v1/namespaces/{ns}/pods/target/ephemeralcontainers");
    let add = |name: &str, privileged: bool| {
        json!({"spec": {"ephemeralContainers": [{
            "name": name,
            "image": "registry.k8s.io/pause:3.10",
            "targetContainerName": "train",
            "securityContext": {"privileged": privileged},
        }]}})
    };
    let denied = env
        .cluster
        .raw(
            Method::PATCH,
            &path,
            "application/strategic-merge-patch+json",
            Some(&add("debugger", true)),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(denied.status.is_client_error(), "{denied:?}");
    assert!(
        denied.message().contains("ephemeral container debugger"),
        "{:?}",
        denied.message()
    );
    let allowed = env
        .cluster
        .raw(
            Method::PATCH,
            &path,
            "application/strategic-merge-patch+json",
            Some(&add("looker", false)),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(allowed.status.is_success(), "{allowed:?}");
    webhook.stop().await;
}

/// Creates a Node object (no kubelet behind it) with `labels` and, if `gpus > 0`, GPU
/// capacity in its status.
async fn fake_node(env: &Env, suffix: &str, labels: Value, gpus: u32) -> Node {
    let name = env.name(suffix);
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"unschedulable": true},
    }))
    .expect("node");
    let api: Api<Node> = Api::all(env.client());
    api.create(&PostParams::default(), &node)
        .await
        .unwrap_or_else(|e| panic!("failed to create Node {name}: {e}"));
    env.cleanup.own_typed::<Node>(None, &name);
    if gpus > 0 {
        let status = json!({"status": {
            "capacity": {gpuwarden_crds::RESOURCE_GPU: gpus.to_string()},
            "allocatable": {gpuwarden_crds::RESOURCE_GPU: gpus.to_string()},
        }});
        api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap_or_else(|e| panic!("failed to set GPU capacity of {name}: {e}"));
    }
    api.get(&name).await.expect("node")
}

/// A fake GPU node (labelled `nvidia.com/gpu.present`) for an in-process agent; its GpuNode
/// and agent Lease are deleted with the test's other objects.
async fn agent_node(env: &Env, suffix: &str, gpus: u32) -> String {
    let node = fake_node(
        env,
        suffix,
        json!({gpuwarden_crds::LABEL_GPU_PRESENT: "true"}),
        gpus,
    )
    .await;
    let name = node.name_any();
    env.cleanup.own_typed::<GpuNode>(None, &name);
    env.cleanup.own_typed::<Lease>(
        Some(gpuwarden_crds::AGENT_LEASE_NAMESPACE),
        &gpuwarden_crds::agent_lease_name(&name),
    );
    name
}

/// A fake GPU file in `dir`: H100s with these UUIDs, indices in order, on driver `version`.
fn fake_gpus(dir: &std::path::Path, version: &str, uuids: &[&str]) -> std::path::PathBuf {
    let mut text = format!(
        "driver:\n  driverVersion: \"{version}\"\n  cudaDriverVersion: \"12.4\"\n  nvmlVersion: \"12.{version}\"\ngpus:\n"
    );
    for (index, uuid) in uuids.iter().enumerate() {
        text.push_str(&format!(
            "  - {{index: {index}, uuid: {uuid}, model: NVIDIA H100 80GB HBM3, memoryMiB: 81559, pciBusId: \"00000000:{:02X}:00.0\", minorNumber: {index}, migMode: Disabled}}\n",
            0x18 + 0x12 * index
        ));
    }
    let path = dir.join("gpus.yaml");
    std::fs::write(&path, text).expect("write the fake GPU file");
    path
}

/// Runs the node agent in-process for `node`, on the fake GPUs and the fake kubelet's
/// socket, until the returned sender fires.
fn start_agent(
    env: &Env,
    node: &str,
    fake: std::path::PathBuf,
    socket: &std::path::Path,
    dir: &std::path::Path,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let mut config = gpuwarden_node_agent::Config::new(node);
    config.fake = Some(fake);
    config.pod_resources_socket = socket.to_path_buf();
    config.host_root = dir.to_path_buf();
    config.listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    spawn_agent(env, config)
}

async fn gpunode(env: &Env, name: &str, timeout: Duration) -> Option<GpuNode> {
    let api: Api<GpuNode> = Api::all(env.client());
    wait_for(timeout, || {
        let api = api.clone();
        let name = name.to_string();
        async move { api.get_opt(&name).await.ok().flatten() }
    })
    .await
}

fn condition(gn: &GpuNode, type_: &str) -> Option<String> {
    gn.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.status.clone())
}

/// The operator: one GpuNode per node with GPUs (by allocatable GPUs or by the
/// nvidia.com/gpu.present label), owned by its Node, none for a node without GPUs; and
/// `kubectl get gpunodes` shows the printer columns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG=... cargo test -p gpuwarden-e2e -- --ignored --test-threads=1"]
async fn operator_keeps_one_gpunode_per_gpu_node() {
    let env = Env::new().await;
    let (stop, task) = start_operator(&env);
    let labelled = fake_node(
        &env,
        "labelled",
        json!({gpuwarden_crds::LABEL_GPU_PRESENT: "true"}),
        0,
    )
    .await;
    let capacity = fake_node(&env, "capacity", json!({}), 8).await;
    let cpu = fake_node(&env, "cpu", json!({}), 0).await;
    for node in [&labelled, &capacity] {
        let name = node.name_any();
        env.cleanup.own_typed::<GpuNode>(None, &name);
        let gn = gpunode(&env, &name, Duration::from_secs(60))
            .await
            .unwrap_or_else(|| panic!("no GpuNode for Node {name}"));
        assert_eq!(gn.spec.node_name, name);
        let owner = &gn.owner_references()[0];
        assert_eq!(owner.kind, "Node");
        assert_eq!(owner.name, name);
        assert_eq!(Some(&owner.uid), node.metadata.uid.as_ref());

        // kubectl's view: the Table the server renders from additionalPrinterColumns.
        let table = || async {
            let request = http::Request::get(format!(
                "/apis/{}/{}/gpunodes/{name}",
                gpuwarden_crds::GROUP,
                gpuwarden_crds::VERSION
            ))
            .header("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
            .body(Vec::new())
            .expect("request");
            env.client().request::<Value>(request).await.expect("Table")
        };
        // Before any agent reports, GPUS is the Node's allocatable count and says so.
        let expected = if name == capacity.name_any() {
            json!([8, "Node"])
        } else {
            json!([null, null])
        };
        let cells = wait_for(SHORT, || async {
            let cells = &table().await["rows"][0]["cells"];
            let shown = json!([cells[2], cells[3]]);
            (shown == expected).then_some(shown)
        })
        .await;
        assert!(
            cells.is_some(),
            "{name}: GPUS and SOURCE never showed {expected}"
        );
        let table = table().await;
        let columns: Vec<&str> = table["columnDefinitions"]
            .as_array()
            .expect("columnDefinitions")
            .iter()
            .filter(|c| c["priority"].as_i64().unwrap_or(0) == 0)
            .filter_map(|c| c["name"].as_str())
            .collect();
        assert_eq!(
            columns,
            [
                "Name",
                "Node",
                "GPUs",
                "Source",
                "Healthy",
                "Allocated",
                "Model",
                "Driver",
                "Toolkit",
                "Patched",
                "Age"
            ]
        );
        assert_eq!(table["rows"][0]["cells"][1], json!(name));
    }
    // No GpuNode for a node without GPUs, after the operator has had its chance.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let none = Api::<GpuNode>::all(env.client())
        .get_opt(&cpu.name_any())
        .await
        .expect("read");
    assert!(none.is_none(), "a GpuNode for a node without GPUs");
    let _ = stop.send(());
    let _ = task.await;
}

/// The node agent (fake GPUs, fake kubelet) writes its GpuNode's inventory and the
/// kubelet's binding of a pod to a GPU, and the operator marks AgentReady=True from the
/// agent's Lease; after the agent stops, AgentReady goes False once the Lease expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG=... cargo test -p gpuwarden-e2e -- --ignored --test-threads=1"]
async fn agent_reports_status_and_bindings_then_goes_silent() {
    use gpuwarden_node_agent::podresources::{ContainerDevices, ContainerResources, PodResources};
    use gpuwarden_node_agent::testing::{FakeKubelet, FakeKubeletServer};

    let env = Env::new().await;
    env.system_namespace().await;
    let ns = env.namespace("agent").await;
    let node_name = agent_node(&env, "agent", 2).await;
    let (stop_operator, operator) = start_operator(&env);

    // A pod bound to the fake node (no scheduler, no kubelet: it stays Pending).
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "trainer"},
        "spec": {
            "nodeName": node_name,
            "containers": [{
                "name": "main",
                "image": "registry.k8s.io/pause:3.10",
                "resources": {"limits": {gpuwarden_crds::RESOURCE_GPU: "1"}}
            }]
        }
    }))
    .expect("pod");
    let pod = Api::<Pod>::namespaced(env.client(), &ns)
        .create(&PostParams::default(), &pod)
        .await
        .expect("create the pod");

    let uuids = [
        "GPU-11111111-2222-3333-4444-555555555555",
        "GPU-66666666-7777-8888-9999-000000000000",
    ];
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = fake_gpus(dir.path(), "550.90.07", &uuids);
    let kubelet = FakeKubeletServer::start(
        &dir.path().join("kubelet.sock"),
        FakeKubelet {
            pods: vec![PodResources {
                name: "trainer".into(),
                namespace: ns.clone(),
                containers: vec![ContainerResources {
                    name: "main".into(),
                    devices: vec![ContainerDevices {
                        resource_name: gpuwarden_crds::RESOURCE_GPU.into(),
                        device_ids: vec![uuids[0].into()],
                    }],
                    dynamic_resources: vec![],
                }],
            }],
            ..FakeKubelet::default()
        },
    )
    .await
    .expect("start the fake kubelet");

    let (stop_agent, agent) = start_agent(&env, &node_name, fake, kubelet.socket(), dir.path());

    let api: Api<GpuNode> = Api::all(env.client());
    let pod_uid = pod.metadata.uid.clone().expect("uid");
    let reported = wait_for(Duration::from_secs(90), || {
        let api = api.clone();
        let node_name = node_name.clone();
        let pod_uid = pod_uid.clone();
        async move {
            let gn = api.get_opt(&node_name).await.ok().flatten()?;
            let status = gn.status.as_ref()?;
            let gpus = status.gpus.as_ref()?;
            let bound = status.bindings.as_ref()?.iter().any(|b| {
                b.pod_uid == pod_uid && b.container == "main" && b.gpu_uuids == [uuids[0]]
            });
            (gpus.len() == 2
                && bound
                && condition(&gn, condition_types::AGENT_READY).as_deref() == Some("True"))
            .then_some(gn)
        }
    })
    .await;
    let gn = match reported {
        Some(gn) => gn,
        None => panic!(
            "the GpuNode never showed 2 GPUs, the binding and AgentReady=True: {:?}",
            api.get_opt(&node_name).await
        ),
    };
    let status = gn.status.expect("status");
    let driver = status.driver.expect("driver");
    assert_eq!(driver.driver_version, "550.90.07");

    let _ = stop_agent.send(());
    let _ = agent.await;
    kubelet.stop().await;
    // The Lease lasts 40 s; the operator then reports the silent agent.
    let silent = wait_for(Duration::from_secs(150), || {
        let api = api.clone();
        let node_name = node_name.clone();
        async move {
            let gn = api.get_opt(&node_name).await.ok().flatten()?;
            (condition(&gn, condition_types::AGENT_READY).as_deref() == Some("False")).then_some(gn)
        }
    })
    .await;
    assert!(
        silent.is_some(),
        "AgentReady never went False after the agent stopped"
    );
    let _ = stop_operator.send(());
    let _ = operator.await;
}

/// Deleting a Node deletes its GpuNode through the owner reference, with the operator
/// stopped so only the garbage collector can do it. Where no garbage collector runs (an
/// API server without kube-controller-manager) this is skipped after a minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG=... cargo test -p gpuwarden-e2e -- --ignored --test-threads=1"]
async fn deleting_a_node_removes_its_gpunode() {
    let env = Env::new().await;
    let node = fake_node(
        &env,
        "gone",
        json!({gpuwarden_crds::LABEL_GPU_PRESENT: "true"}),
        0,
    )
    .await;
    let name = node.name_any();
    env.cleanup.own_typed::<GpuNode>(None, &name);
    let (stop, task) = start_operator(&env);
    assert!(
        gpunode(&env, &name, Duration::from_secs(60))
            .await
            .is_some(),
        "no GpuNode for Node {name}"
    );
    let _ = stop.send(());
    let _ = task.await;
    Api::<Node>::all(env.client())
        .delete(&name, &Default::default())
        .await
        .expect("delete the Node");
    let api: Api<GpuNode> = Api::all(env.client());
    let gone = wait_for(Duration::from_secs(60), || {
        let api = api.clone();
        let name = name.clone();
        async move {
            match api.get_opt(&name).await {
                Ok(None) => Some(()),
                _ => None,
            }
        }
    })
    .await;
    if gone.is_none() {
        skip(
            "garbage collection",
            "the GpuNode outlived its Node by a minute: no garbage collector runs on this server",
        );
    }
}

/// The ValidatingAdmissionPolicies under deploy/admission compile on a real server with no
/// type-checking warning, and the backstop rejects a privileged GPU pod that reaches the
/// API server unrewritten (no webhook here) while admitting a privileged pod without GPU
/// signals. Skipped where the server has no admissionregistration.k8s.io/v1
/// ValidatingAdmissionPolicy (before 1.30).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG=... cargo test -p gpuwarden-e2e -- --ignored --test-threads=1"]
async fn admission_policies_compile_and_the_backstop_rejects() {
    let env = Env::new().await;
    if !env
        .cluster
        .serves(
            "admissionregistration.k8s.io/v1",
            "validatingadmissionpolicies",
        )
        .await
    {
        skip(
            "ValidatingAdmissionPolicy",
            "the server does not serve admissionregistration.k8s.io/v1 validatingadmissionpolicies (Kubernetes 1.30+)",
        );
        return;
    }
    for (file, suffix, bind) in [
        (
            "deploy/admission/agent-own-node.yaml",
            "agent-own-node",
            false,
        ),
        ("deploy/admission/backstop-policy.yaml", "backstop", true),
    ] {
        let selector = bind.then(|| env.run_selector());
        let policy = env.install_policy(file, suffix, selector).await;
        let warnings = policy
            .status
            .and_then(|s| s.type_checking)
            .and_then(|t| t.expression_warnings)
            .unwrap_or_default();
        assert!(
            warnings.is_empty(),
            "{file}: the server's type checker warns: {warnings:?}"
        );
    }
    let ns = env.namespace("backstop").await;
    let pod = privileged_gpu_pod("train");
    let denied = env
        .until_admission(&ns, &pod, "backstop", |r| r.status.is_client_error())
        .await;
    assert!(
        denied
            .message()
            .contains("are not admitted in this namespace")
            && denied.message().contains("train"),
        "{:?}",
        denied.message()
    );
    // An unprivileged container that names GPUs to the NVIDIA runtime itself is refused
    // too: without the webhook nothing turns it into a request.
    let mut leak = privileged_gpu_pod("leak");
    leak["spec"]["containers"][0]["securityContext"] = json!({"privileged": false});
    leak["spec"]["containers"][0]["env"] =
        json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]);
    let refused = env
        .cluster
        .create_pod(&ns, &leak, true)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        refused.status.is_client_error() && refused.message().contains("train"),
        "the backstop admitted a leaking pod: {refused:?}"
    );
    let mut no_gpu = privileged_gpu_pod("tools");
    no_gpu["spec"]["containers"][0]["env"] = json!([]);
    let allowed = env
        .cluster
        .create_pod(&ns, &no_gpu, true)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        allowed.status.is_success(),
        "a privileged pod without GPU signals is not the backstop's business: {allowed:?}"
    );

    // With the webhook in front: a privileged GPU pod is rewritten and then passes the
    // backstop, and a privileged FUSE pod (a /dev/fuse hostPath, no GPU) reaches the webhook,
    // is left as written, and is admitted.
    let (webhook, _) = env.webhook().await;
    env.until_admission(&ns, &privileged_gpu_pod("probe"), "backstop", rewritten)
        .await;
    let fuse = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "fuse"},
        "spec": {
            "containers": [{
                "name": "mount",
                "image": "registry.k8s.io/pause:3.10",
                "securityContext": {"privileged": true},
                "volumeMounts": [{"name": "fuse", "mountPath": "/dev/fuse"}]
            }],
            "volumes": [{"name": "fuse", "hostPath": {"path": "/dev/fuse", "type": "CharDevice"}}]
        }
    });
    let before = webhook.reviews();
    let created = env
        .cluster
        .create_pod(&ns, &fuse, false)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        created.status.is_success(),
        "the FUSE pod was refused: {created:?}"
    );
    assert!(
        webhook.reviews() > before,
        "the FUSE pod never reached the webhook"
    );
    assert!(!annotations(&created.body).contains_key(gpuwarden_crds::ANNOTATION_REWRITTEN));
    assert_eq!(
        created.body["spec"]["containers"][0]["securityContext"]["privileged"],
        json!(true),
        "the FUSE pod was changed"
    );
    webhook.stop().await;
}

/// The policy pinning node agents to their own node, on a real server: acting as the node
/// agent's service account with a token bound to node A (impersonation with the
/// `authentication.kubernetes.io/node-name` extra), a status write to A's GpuNode is
/// admitted and one to B's is refused; without the extra, both are refused. Skipped where
/// the server has no ValidatingAdmissionPolicy v1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG=... cargo test -p gpuwarden-e2e -- --ignored --test-threads=1"]
async fn agent_policy_pins_status_writes_to_the_agents_node() {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};

    let env = Env::new().await;
    if !env
        .cluster
        .serves(
            "admissionregistration.k8s.io/v1",
            "validatingadmissionpolicies",
        )
        .await
    {
        skip(
            "ValidatingAdmissionPolicy",
            "the server does not serve admissionregistration.k8s.io/v1 validatingadmissionpolicies (Kubernetes 1.30+)",
        );
        return;
    }
    env.install_policy(
        "deploy/admission/agent-own-node.yaml",
        "agent-own-node",
        None,
    )
    .await;

    // The agent's status grant, bound to its service account (impersonated below).
    let role_name = env.name("agent-status");
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": role_name},
        "rules": [{"apiGroups": [gpuwarden_crds::GROUP], "resources": ["gpunodes/status"],
                   "verbs": ["get", "patch"]}]
    }))
    .expect("role");
    Api::<ClusterRole>::all(env.client())
        .create(&PostParams::default(), &role)
        .await
        .expect("create ClusterRole");
    env.cleanup.own_typed::<ClusterRole>(None, &role_name);
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": role_name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": gpuwarden_crds::install::NODE_AGENT_NAME,
                      "namespace": gpuwarden_crds::SYSTEM_NAMESPACE}]
    }))
    .expect("binding");
    Api::<ClusterRoleBinding>::all(env.client())
        .create(&PostParams::default(), &binding)
        .await
        .expect("create ClusterRoleBinding");
    env.cleanup
        .own_typed::<ClusterRoleBinding>(None, &role_name);

    let gpunodes: Api<GpuNode> = Api::all(env.client());
    let mut names = Vec::new();
    for suffix in ["node-a", "node-b"] {
        let name = env.name(suffix);
        let gn = GpuNode::new(
            &name,
            gpuwarden_crds::GpuNodeSpec {
                node_name: name.clone(),
            },
        );
        gpunodes
            .create(&PostParams::default(), &gn)
            .await
            .unwrap_or_else(|e| panic!("failed to create GpuNode {name}: {e}"));
        env.cleanup.own_typed::<GpuNode>(None, &name);
        names.push(name);
    }
    let user = format!(
        "system:serviceaccount:{}:{}",
        gpuwarden_crds::SYSTEM_NAMESPACE,
        gpuwarden_crds::install::NODE_AGENT_NAME
    );
    let write = |target: String, bound_to: Option<String>, n: usize| {
        let cluster = env.cluster.clone();
        let user = user.clone();
        async move {
            let mut headers = vec![("Impersonate-User", user.as_str())];
            if let Some(node) = bound_to.as_deref() {
                headers.push((
                    "Impersonate-Extra-authentication.kubernetes.io%2fnode-name",
                    node,
                ));
            }
            // A real change each time, so the write cannot be skipped as a no-op.
            let body = json!({"status": {"privilegedPods": [{
                "namespace": "e2e", "name": format!("p{n}"),
                "uid": format!("00000000-0000-0000-0000-{n:012}")
            }]}});
            cluster
                .raw_as(
                    Method::PATCH,
                    &format!(
                        "/apis/{}/{}/gpunodes/{target}/status",
                        gpuwarden_crds::GROUP,
                        gpuwarden_crds::VERSION
                    ),
                    "application/merge-patch+json",
                    Some(&body),
                    &headers,
                )
                .await
                .unwrap_or_else(|e| panic!("{e}"))
        }
    };
    // Wait until the policy is in force: B's GpuNode refuses A's agent.
    let mut n = 0;
    let refused = wait_for(SHORT, || {
        n += 1;
        let attempt = write(names[1].clone(), Some(names[0].clone()), n);
        async move {
            let r = attempt.await;
            r.status.is_client_error().then_some(r)
        }
    })
    .await
    .expect("a node agent wrote another node's GpuNode status");
    assert!(
        refused.message().contains("may write only its own node"),
        "{:?}",
        refused.message()
    );
    let own = write(names[0].clone(), Some(names[0].clone()), 1000).await;
    assert!(own.status.is_success(), "its own node's GpuNode: {own:?}");
    let unbound = write(names[0].clone(), None, 1001).await;
    assert!(
        unbound.status.is_client_error(),
        "a token without a node: {unbound:?}"
    );
    assert!(
        unbound.message().contains("names no node"),
        "{:?}",
        unbound.message()
    );
}

/// DRA (issue: the ResourceClaim mode): a policy with `gpu.requestAs: ResourceClaim` makes
/// the operator keep gpuwarden's ResourceClaimTemplates in its namespace; a privileged pod
/// whose two containers name the same GPUs is admitted with one claim from the 2-GPU
/// template that both use; kube-controller-manager creates the ResourceClaim from it and
/// the pod stays Pending; a missing template is a denial naming it, until the operator puts
/// it back; the node agent, fed a fake kubelet that reports the claim's devices, lists the
/// bindings as allocated through the claim; deleting the policy removes the templates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG=... cargo test -p gpuwarden-e2e -- --ignored --test-threads=1"]
async fn resource_claim_mode_on_a_real_server() {
    use gpuwarden_crds::claims::{LABEL_CLAIM_TEMPLATE, template_name};
    use gpuwarden_node_agent::podresources::{
        CdiDevice, ClaimResource, ContainerResources, DynamicResource, PodResources,
    };
    use gpuwarden_node_agent::testing::{FakeKubelet, FakeKubeletServer};
    use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};

    let env = Env::new().await;
    if !env
        .cluster
        .serves("resource.k8s.io/v1", "resourceclaimtemplates")
        .await
    {
        skip(
            "DRA",
            "the server does not serve resource.k8s.io/v1 (Kubernetes before 1.34)",
        );
        return;
    }
    env.system_namespace().await;
    let ns = env.namespace("dra").await;
    let policy_name = format!("{ns}-claims");
    let mut policy = GpuPolicy::default_policy();
    policy.metadata = kube::api::ObjectMeta {
        name: Some(policy_name.clone()),
        ..Default::default()
    };
    policy.spec.priority = 1000;
    policy.spec.namespace_selector =
        serde_json::from_value(json!({"matchLabels": {"kubernetes.io/metadata.name": ns}}))
            .expect("selector");
    policy.spec.gpu.request_as = gpuwarden_crds::RequestAs::ResourceClaim;
    policy.spec.gpu.max_per_container = 2;
    let policies: Api<GpuPolicy> = Api::all(env.client());
    policies
        .create(&PostParams::default(), &policy)
        .await
        .unwrap_or_else(|e| panic!("failed to create GpuPolicy {policy_name}: {e}"));
    env.cleanup.own_typed::<GpuPolicy>(None, &policy_name);

    // The operator keeps one template per count, 1 and 2, owned by the policy.
    let (stop_operator, operator) = start_operator(&env);
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(env.client(), &ns);
    let wanted = [
        template_name("gpu.nvidia.com", 1),
        template_name("gpu.nvidia.com", 2),
    ];
    let listed = |templates: Api<ResourceClaimTemplate>| async move {
        let params = kube::api::ListParams::default().labels(LABEL_CLAIM_TEMPLATE);
        let list = templates.list(&params).await.ok()?;
        let mut names: Vec<String> = list.items.iter().map(ResourceExt::name_any).collect();
        names.sort();
        Some((names, list.items))
    };
    let kept = wait_for(Duration::from_secs(60), || {
        let templates = templates.clone();
        async move {
            listed(templates)
                .await
                .filter(|(names, _)| names.len() == 2)
        }
    })
    .await
    .expect("the operator never created the two templates");
    assert_eq!(kept.0, wanted);
    let two = kept
        .1
        .iter()
        .find(|t| t.name_any() == wanted[1])
        .expect("template 2");
    let owner = &two.metadata.owner_references.as_ref().expect("owners")[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str()),
        ("GpuPolicy", policy_name.as_str())
    );
    let request = &two
        .spec
        .spec
        .devices
        .as_ref()
        .expect("devices")
        .requests
        .as_ref()
        .expect("requests")[0];
    let exactly = request.exactly.as_ref().expect("exactly");
    assert_eq!(
        (exactly.device_class_name.as_str(), exactly.count),
        ("gpu.nvidia.com", Some(2))
    );

    let node_name = agent_node(&env, "dra", 0).await;

    let (webhook, _) = env.webhook().await;
    let container = |name: &str, visible: &str| {
        json!({
            "name": name,
            "image": "registry.k8s.io/pause:3.10",
            "securityContext": {"privileged": true},
            "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": visible}]
        })
    };
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "dra-train"},
        "spec": {"nodeName": node_name, "containers": [container("a", "0,1"), container("b", "1,0")]}
    });
    env.until_admission(&ns, &pod, "claims", |r| {
        r.status.is_success() && r.body["spec"]["resourceClaims"].is_array()
    })
    .await;
    let created = env
        .cluster
        .create_pod(&ns, &pod, false)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(created.status.is_success(), "{created:?}");
    let spec = &created.body["spec"];
    assert_eq!(
        spec["resourceClaims"],
        json!([{"name": "gpuwarden-gpus-0", "resourceClaimTemplateName": wanted[1]}])
    );
    for c in spec["containers"].as_array().expect("containers") {
        assert_eq!(
            c["resources"]["claims"],
            json!([{"name": "gpuwarden-gpus-0"}]),
            "{c}"
        );
        assert_eq!(c["resources"]["limits"], Value::Null, "{c}");
        assert_eq!(c["securityContext"]["privileged"], false, "{c}");
    }
    assert!(
        created
            .warnings
            .iter()
            .any(|w| w.contains("shares claim gpuwarden-gpus-0 with container a")),
        "{:?}",
        created.warnings
    );
    let pod_uid = created.body["metadata"]["uid"]
        .as_str()
        .expect("uid")
        .to_owned();

    // kube-controller-manager makes the pod's ResourceClaim from the template.
    let claims: Api<ResourceClaim> = Api::namespaced(env.client(), &ns);
    let pods: Api<Pod> = Api::namespaced(env.client(), &ns);
    let claim = wait_for(Duration::from_secs(60), || {
        let (claims, pods, pod_uid) = (claims.clone(), pods.clone(), pod_uid.clone());
        async move {
            let pod = pods.get("dra-train").await.ok()?;
            let status = pod.status?.resource_claim_statuses?;
            let name = status
                .iter()
                .find(|s| s.name == "gpuwarden-gpus-0")?
                .resource_claim_name
                .clone()?;
            let claim = claims.get(&name).await.ok()?;
            let owned =
                (claim.metadata.owner_references.iter().flatten()).any(|o| o.uid == pod_uid);
            owned.then_some(claim)
        }
    })
    .await
    .expect("no ResourceClaim was made from the template (is kube-controller-manager running?)");
    let request = &claim
        .spec
        .devices
        .as_ref()
        .expect("devices")
        .requests
        .as_ref()
        .expect("requests")[0];
    assert_eq!(request.exactly.as_ref().and_then(|e| e.count), Some(2));
    let phase = pods
        .get("dra-train")
        .await
        .expect("pod")
        .status
        .and_then(|s| s.phase);
    assert_eq!(
        phase.as_deref(),
        Some("Pending"),
        "no driver, no kubelet: it waits"
    );
    let allocated = claims
        .get(&claim.name_any())
        .await
        .expect("the claim")
        .status;
    assert!(
        allocated.and_then(|s| s.allocation).is_none(),
        "no DRA driver publishes devices here, so nothing can be allocated"
    );

    // A template the namespace lacks is a denial naming it; the operator puts it back.
    let _ = stop_operator.send(());
    let _ = operator.await;
    templates
        .delete(&wanted[0], &Default::default())
        .await
        .expect("delete template 1");
    let single = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "dra-one"},
        "spec": {"containers": [container("c", "all")]}
    });
    let denied = env
        .until_admission(&ns, &single, "missing template", |r| {
            r.status.is_client_error()
        })
        .await;
    assert!(
        denied.message().contains(&format!(
            "ResourceClaimTemplate {ns}/{} does not exist",
            wanted[0]
        )),
        "{}",
        denied.message()
    );
    let (stop_operator, operator) = start_operator(&env);
    env.until_admission(&ns, &single, "template back", |r| r.status.is_success())
        .await;

    // The node agent lists the claim's GPUs as allocated to both containers.
    let uuids = [
        "GPU-11111111-2222-3333-4444-555555555555",
        "GPU-66666666-7777-8888-9999-000000000000",
    ];
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = fake_gpus(dir.path(), "580.65.06", &uuids);
    let claim_name = claim.name_any();
    let dynamic = DynamicResource {
        claim_name: claim_name.clone(),
        claim_namespace: ns.clone(),
        claim_resources: (0..2)
            .map(|i| ClaimResource {
                cdi_devices: vec![CdiDevice {
                    name: format!("k8s.gpu.nvidia.com/device=gpu-{i}"),
                }],
                driver_name: "gpu.nvidia.com".into(),
                pool_name: node_name.clone(),
                device_name: format!("gpu-{i}"),
            })
            .collect(),
    };
    let kubelet = FakeKubeletServer::start(
        &dir.path().join("kubelet.sock"),
        FakeKubelet {
            pods: vec![PodResources {
                name: "dra-train".into(),
                namespace: ns.clone(),
                containers: ["a", "b"]
                    .map(|name| ContainerResources {
                        name: name.into(),
                        devices: vec![],
                        dynamic_resources: vec![dynamic.clone()],
                    })
                    .to_vec(),
            }],
            ..FakeKubelet::default()
        },
    )
    .await
    .expect("start the fake kubelet");
    let (stop_agent, agent) = start_agent(&env, &node_name, fake, kubelet.socket(), dir.path());
    let gpunodes: Api<GpuNode> = Api::all(env.client());
    let expected_claim = format!("{ns}/{claim_name}");
    let bound = wait_for(Duration::from_secs(90), || {
        let (gpunodes, node_name, pod_uid, expected_claim) = (
            gpunodes.clone(),
            node_name.clone(),
            pod_uid.clone(),
            expected_claim.clone(),
        );
        async move {
            let gn = gpunodes.get_opt(&node_name).await.ok().flatten()?;
            let bindings = gn.status?.bindings?;
            let ok = ["a", "b"].iter().all(|c| {
                bindings.iter().any(|b| {
                    b.pod_uid == pod_uid
                        && b.container == *c
                        && b.gpu_uuids == uuids
                        && b.claims == [expected_claim.clone()]
                        && b.source == gpuwarden_crds::BindingSource::Allocated
                })
            });
            ok.then_some(bindings)
        }
    })
    .await;
    assert!(
        bound.is_some(),
        "the GpuNode never listed both containers' claim bindings: {:?}",
        gpunodes
            .get_opt(&node_name)
            .await
            .ok()
            .flatten()
            .and_then(|g| g.status)
            .and_then(|s| s.bindings)
    );
    let _ = stop_agent.send(());
    let _ = agent.await;
    kubelet.stop().await;

    // Without the policy its templates go (the operator deletes them; the garbage collector
    // would too, through the owner reference).
    policies
        .delete(&policy_name, &Default::default())
        .await
        .expect("delete the policy");
    let gone = wait_for(Duration::from_secs(60), || {
        let templates = templates.clone();
        async move {
            listed(templates)
                .await
                .filter(|(names, _)| names.is_empty())
        }
    })
    .await;
    assert!(gone.is_some(), "the templates outlived their policy");
    let _ = stop_operator.send(());
    let _ = operator.await;
    webhook.stop().await;
}

// ---------------------------------------------------------------------------------------
// On a real node: a kubelet with NVIDIA's device plugin (on the GPUs of the node, or on
// NVIDIA's mock NVML). Run with the same command; the agent loads the NVML the device
// plugin uses (`LD_LIBRARY_PATH` pointing at it where it is not installed system-wide), and
// the busybox image must be on the node (`$GPUWARDEN_E2E_BUSYBOX`, default
// docker.io/library/busybox:latest, never pulled).

/// The privileged-pod path end to end: a privileged pod naming GPUs 0 and 1 is rewritten by
/// the webhook, scheduled, allocated two GPUs by NVIDIA's device plugin and started; its
/// process sees exactly those two UUIDs; the agent's GpuNode binding lists them as
/// allocated, and its metrics have one holder series per GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a node: a kubelet with NVIDIA's device plugin, NVML for the agent (LD_LIBRARY_PATH), KUBECONFIG=... cargo test -p gpuwarden-e2e -- --ignored --test-threads=1"]
async fn privileged_pod_runs_with_exactly_its_gpus_on_a_real_node() {
    let env = Env::new().await;
    let Some(real) = RealNode::start(
        &env,
        "privileged_pod_runs_with_exactly_its_gpus_on_a_real_node",
    )
    .await
    else {
        return;
    };
    let node = real.name.clone();
    let ns = env.namespace("node").await;
    let (webhook, _) = env.webhook().await;

    let mut pod = privileged_gpu_pod("train");
    pod["spec"]["containers"][0]["image"] = json!(busybox());
    pod["spec"]["containers"][0]["imagePullPolicy"] = json!("IfNotPresent");
    pod["spec"]["containers"][0]["command"] = json!(["sh", "-c", SEEN_COMMAND]);
    pod["spec"]["terminationGracePeriodSeconds"] = json!(1);
    env.until_admission(&ns, &pod, "rewrite on the node", rewritten)
        .await;
    let created = env
        .cluster
        .create_pod(&ns, &pod, false)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(created.status.is_success(), "{created:?}");
    let stored = &created.body["spec"]["containers"][0];
    assert_eq!(stored["securityContext"]["privileged"], false);
    assert_eq!(
        stored["resources"]["limits"][gpuwarden_crds::RESOURCE_GPU],
        "2"
    );
    assert!(
        !(stored["env"].as_array().into_iter().flatten())
            .any(|e| e["name"] == "NVIDIA_VISIBLE_DEVICES"),
        "{stored:#}"
    );

    let pods: Api<Pod> = Api::namespaced(env.client(), &ns);
    let running = wait_for(Duration::from_secs(120), || {
        let pods = pods.clone();
        async move {
            let p = pods.get("train").await.ok()?;
            (p.status.as_ref()?.phase.as_deref() == Some("Running")).then_some(p)
        }
    })
    .await;
    let Some(running) = running else {
        panic!(
            "the pod never ran: {:?}",
            pods.get("train").await.map(|p| p.status)
        );
    };
    assert_eq!(
        running
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .as_deref(),
        Some(node.as_str())
    );
    let pod_uid = running.metadata.uid.clone().expect("uid");
    let printed = wait_for(SHORT, || {
        let pods = pods.clone();
        async move { Seen::parse(&pods.logs("train", &Default::default()).await.ok()?) }
    })
    .await
    .expect("the container printed what it sees");
    // The GPUs it holds, by its device nodes. On plain runc the device plugin's variable
    // names them too; under NVIDIA's runtime the process's own variable reads void.
    let inventory = gpuwarden_e2e::inproc::inventory(&env, &node).await;
    let seen = gpuwarden_e2e::inproc::device_uuids(&inventory, &printed);
    assert_eq!(seen.len(), 2, "the process sees {}", printed.summary());
    let visible = printed.visible_ids();
    assert!(
        visible == seen || printed.visible.as_deref() == Some("void"),
        "{}",
        printed.summary()
    );

    // The kubelet's allocation, as the agent reports it, is what the process sees.
    let gpunodes: Api<GpuNode> = Api::all(env.client());
    let binding = wait_for(Duration::from_secs(90), || {
        let gpunodes = gpunodes.clone();
        let (node, pod_uid) = (node.clone(), pod_uid.clone());
        async move {
            let gn = gpunodes.get_opt(&node).await.ok().flatten()?;
            let bindings = gn.status?.bindings?;
            bindings.into_iter().find(|b| b.pod_uid == pod_uid)
        }
    })
    .await
    .expect("the GpuNode lists the pod's binding");
    let mut allocated = binding.gpu_uuids.clone();
    allocated.sort();
    assert_eq!(allocated, seen, "{binding:?}");
    assert_eq!(
        binding.source,
        gpuwarden_crds::BindingSource::Allocated,
        "{binding:?}"
    );
    assert_eq!(
        binding.resource_name.as_deref(),
        Some(gpuwarden_crds::RESOURCE_GPU)
    );

    // One holder series per GPU, joinable on UUID.
    let series = real.holder_series(&ns, "train", &seen).await;
    eprintln!(
        "node {node}: pod {ns}/train sees {seen:?}; binding {:?}; series {series:?}",
        binding.gpu_uuids
    );

    let _ = pods.delete("train", &Default::default()).await;
    webhook.stop().await;
    real.stop().await;
}

/// A namespace with a fixed name (`nvidia-device-plugin`, `monitoring`) that this run's
/// webhook selects: made and deleted here, or, where it exists, labelled for the run and
/// unlabelled after.
async fn fixed_namespace(env: &Env, name: &str) {
    let api: Api<Namespace> = Api::all(env.client());
    let label = json!({"metadata": {"labels": {
        LABEL_RUN: env.cluster.run_id,
        "pod-security.kubernetes.io/enforce": "privileged",
    }}});
    if api.get_opt(name).await.expect("read namespace").is_some() {
        api.patch(name, &PatchParams::default(), &Patch::Merge(&label))
            .await
            .expect("label the namespace");
        eprintln!(
            "namespace {name} exists: labelled for this run; remove the label {LABEL_RUN} if the test is interrupted"
        );
        return;
    }
    let mut ns = label;
    ns["metadata"]["name"] = json!(name);
    let ns: Namespace = serde_json::from_value(ns).expect("namespace");
    api.create(&PostParams::default(), &ns)
        .await
        .expect("create namespace");
    env.cleanup.own_typed::<Namespace>(None, name);
}

/// NVIDIA's device plugin, as its official privileged static manifest
/// (k8s-device-plugin `deployments/static/nvidia-device-plugin-privileged-with-service-account.yml`)
/// deploys it, and a privileged exporter DaemonSet mounting /dev/nvidia0 (as the
/// nvidia_gpu_exporter chart rendered it) hold no GPU on a real node: the first is admitted
/// unchanged and the kubelet allocates it nothing; the second is denied, and the
/// DaemonSet's events say why. A privileged pod mounting /dev/infiniband is denied with
/// the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a node: a kubelet with NVIDIA's device plugin, NVML for the agent (LD_LIBRARY_PATH), KUBECONFIG=... cargo test -p gpuwarden-e2e -- --ignored --test-threads=1"]
async fn nvidia_components_and_node_agents_hold_no_gpu_on_a_real_node() {
    let env = Env::new().await;
    let Some(real) = RealNode::start(
        &env,
        "nvidia_components_and_node_agents_hold_no_gpu_on_a_real_node",
    )
    .await
    else {
        return;
    };
    let node = real.name.clone();
    let (webhook, _) = env.webhook().await;
    for ns in ["nvidia-device-plugin", "monitoring"] {
        fixed_namespace(&env, ns).await;
    }
    let daemon_sets: Api<k8s_openapi::api::apps::v1::DaemonSet> =
        Api::namespaced(env.client(), "nvidia-device-plugin");
    let plugin: k8s_openapi::api::apps::v1::DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": "nvidia-device-plugin-daemonset"},
        "spec": {
            "selector": {"matchLabels": {"name": "nvidia-device-plugin-ds"}},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {"labels": {"name": "nvidia-device-plugin-ds"}},
                "spec": {
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "priorityClassName": "system-node-critical",
                    "containers": [{
                        "name": "nvidia-device-plugin-ctr",
                        "image": "nvcr.io/nvidia/k8s-device-plugin:v0.19.1",
                        "imagePullPolicy": "IfNotPresent",
                        "env": [{"name": "FAIL_ON_INIT_ERROR", "value": "false"}],
                        "securityContext": {"privileged": true},
                        "volumeMounts": [{"name": "device-plugin", "mountPath": "/var/lib/kubelet/device-plugins"}]
                    }],
                    "volumes": [{"name": "device-plugin", "hostPath": {"path": "/var/lib/kubelet/device-plugins"}}]
                }
            }
        }
    }))
    .expect("DaemonSet");
    daemon_sets
        .create(&PostParams::default(), &plugin)
        .await
        .expect("create the device plugin DaemonSet");
    let exporter: k8s_openapi::api::apps::v1::DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": "gpu-exporter"},
        "spec": {
            "selector": {"matchLabels": {"app": "gpu-exporter"}},
            "template": {
                "metadata": {"labels": {"app": "gpu-exporter"}},
                "spec": {
                    "containers": [{
                        "name": "exporter",
                        "image": busybox(),
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["sleep", "3600"],
                        "securityContext": {"privileged": true},
                        "volumeMounts": [
                            {"name": "nvidiactl", "mountPath": "/dev/nvidiactl"},
                            {"name": "nvidia0", "mountPath": "/dev/nvidia0"}
                        ]
                    }],
                    "volumes": [
                        {"name": "nvidiactl", "hostPath": {"path": "/dev/nvidiactl"}},
                        {"name": "nvidia0", "hostPath": {"path": "/dev/nvidia0"}}
                    ]
                }
            }
        }
    }))
    .expect("DaemonSet");
    Api::<k8s_openapi::api::apps::v1::DaemonSet>::namespaced(env.client(), "monitoring")
        .create(&PostParams::default(), &exporter)
        .await
        .expect("create the exporter DaemonSet");

    // The device plugin's pod is made, on the node, as written: privileged, no GPU asked.
    let pods: Api<Pod> = Api::namespaced(env.client(), "nvidia-device-plugin");
    let plugin_pod = wait_for(Duration::from_secs(60), || {
        let pods = pods.clone();
        async move {
            let list = pods.list(&Default::default()).await.ok()?;
            list.items
                .into_iter()
                .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
        }
    })
    .await
    .expect("the device plugin DaemonSet made a pod on the node");
    let c = &plugin_pod.spec.as_ref().expect("spec").containers[0];
    assert_eq!(
        c.security_context.as_ref().and_then(|s| s.privileged),
        Some(true)
    );
    assert!(
        c.resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .is_none_or(|l| l.is_empty()),
        "{c:?}"
    );
    // The exporter's pods are denied: the DaemonSet controller's events say why.
    let events: Api<k8s_openapi::api::core::v1::Event> =
        Api::namespaced(env.client(), "monitoring");
    let denied = wait_for(Duration::from_secs(60), || {
        let events = events.clone();
        async move {
            let list = events.list(&Default::default()).await.ok()?;
            list.items.into_iter().find_map(|e| {
                let message = e.message.unwrap_or_default();
                (e.reason.as_deref() == Some("FailedCreate")
                    && message.contains("runs it on every node"))
                .then_some(message)
            })
        }
    })
    .await
    .expect("a FailedCreate event naming the reason");
    assert!(
        denied.contains("exemptions.containers with images ["),
        "{denied}"
    );
    let exporter_pods = Api::<Pod>::namespaced(env.client(), "monitoring")
        .list(&Default::default())
        .await
        .expect("list");
    assert!(
        exporter_pods.items.is_empty(),
        "the exporter has pods: {:?}",
        exporter_pods.items.len()
    );
    // After a few of the agent's polls the kubelet has allocated the device plugin nothing.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let gn = Api::<GpuNode>::all(env.client())
        .get(&node)
        .await
        .expect("GpuNode");
    let plugin_uid = plugin_pod.metadata.uid.clone().expect("uid");
    let bindings = gn.status.and_then(|s| s.bindings).unwrap_or_default();
    assert!(
        !bindings
            .iter()
            .any(|b| b.pod_uid == plugin_uid || b.namespace == "monitoring"),
        "{bindings:?}"
    );

    // A privileged pod mounting /dev/infiniband is denied, saying why.
    let ns = env.namespace("rdma").await;
    let mut rdma = privileged_gpu_pod("nccl");
    rdma["spec"]["containers"][0]["volumeMounts"] =
        json!([{"name": "ib", "mountPath": "/dev/infiniband"}]);
    rdma["spec"]["volumes"] = json!([{"name": "ib", "hostPath": {"path": "/dev/infiniband"}}]);
    let answer = env
        .until_admission(&ns, &rdma, "the /dev/infiniband denial", |r| {
            !r.status.is_success()
        })
        .await;
    assert!(
        answer.message().contains(
            "an unprivileged container cannot open RDMA devices (/dev/infiniband, volume ib)"
        ),
        "{answer:?}"
    );
    eprintln!(
        "device plugin pod {} admitted as written, no GPU allocated; exporter denied: {denied}",
        plugin_pod.name_any()
    );

    daemon_sets
        .delete("nvidia-device-plugin-daemonset", &Default::default())
        .await
        .ok();
    Api::<k8s_openapi::api::apps::v1::DaemonSet>::namespaced(env.client(), "monitoring")
        .delete("gpu-exporter", &Default::default())
        .await
        .ok();
    webhook.stop().await;
    real.stop().await;
}

/// Pods the API server's rewrite and the webhook both judge: privileged containers that
/// name their GPUs plainly (IDs shared by two containers, a limit, a request, `all`), with a
/// container and an init container that hold none; and two the API server leaves to the
/// webhook (a device hostPath mount, a zero limit). They are compared as stored and never
/// run: a scheduling gate keeps them off every node (where no webhook is registered, the
/// device pod is stored privileged, and on a real node it would create `/dev/nvidia0`).
fn both_paths_pods() -> Vec<(Value, bool)> {
    let image = "registry.k8s.io/pause:3.10";
    let pod = |name: &str, mut spec: Value| {
        spec["schedulingGates"] = json!([{"name": "gpuwarden.io/compared-not-run"}]);
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})
    };
    let privileged = json!({"privileged": true});
    vec![
        (
            pod(
                "shared",
                json!({"containers": [
            {"name": "train", "image": image,
             "securityContext": {"privileged": true, "capabilities": {"add": ["IPC_LOCK", "NET_ADMIN"]}},
             "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,1"}]},
            {"name": "side", "image": image, "securityContext": privileged,
             "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "1, 0"}]},
            {"name": "plain", "image": image}]}),
            ),
            true,
        ),
        (
            pod(
                "limit",
                json!({"containers": [
            {"name": "train", "image": image,
             "securityContext": {"privileged": true, "capabilities": {"add": ["SYS_PTRACE"], "drop": ["NET_RAW"]}},
             "resources": {"limits": {"nvidia.com/gpu": "1"}},
             "env": [{"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "all"}]}]}),
            ),
            true,
        ),
        (
            pod(
                "request",
                json!({"containers": [
            {"name": "train", "image": image, "securityContext": privileged,
             "resources": {"requests": {"nvidia.com/gpu": "2"}}}]}),
            ),
            true,
        ),
        (
            pod(
                "all",
                json!({
            "initContainers": [{"name": "setup", "image": image}],
            "containers": [{"name": "train", "image": image, "securityContext": privileged,
             "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}),
            ),
            true,
        ),
        (
            pod(
                "device",
                json!({
            "volumes": [{"name": "gpu0", "hostPath": {"path": "/dev/nvidia0"}}],
            "containers": [{"name": "train", "image": image, "securityContext": privileged,
             "volumeMounts": [{"name": "gpu0", "mountPath": "/dev/nvidia0"}]}]}),
            ),
            false,
        ),
        (
            pod(
                "zero",
                json!({"containers": [
            {"name": "train", "image": image, "securityContext": privileged,
             "resources": {"limits": {"nvidia.com/gpu": "0"}},
             "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}),
            ),
            false,
        ),
    ]
}

/// The privileged-GPU rewrite in the API server: with no webhook registered, the
/// MutatingAdmissionPolicy rendered from the default GpuPolicy stores privileged GPU pods
/// rewritten (unprivileged with what an ordinary container has, the GPU limit, no
/// NVIDIA_VISIBLE_DEVICES) and
/// leaves the pods it cannot rewrite as they are; with the webhook registered too, the
/// stored pods are those the webhook alone stores, field for field and report byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG=... cargo test -p gpuwarden-e2e -- --ignored --test-threads=1"]
async fn api_server_rewrite_stores_what_the_webhook_stores() {
    use gpuwarden_crds::admission::policies::render;
    let env = Env::new().await;
    let Some(api) = env.cluster.mutating_policy_api().await else {
        skip(
            "api_server_rewrite_stores_what_the_webhook_stores",
            "the server does not serve MutatingAdmissionPolicy",
        );
        return;
    };
    let webhooks: Api<MutatingWebhookConfiguration> = Api::all(env.client());
    let registered = webhooks
        .list(&Default::default())
        .await
        .expect("list webhooks");
    assert!(
        registered.items.is_empty(),
        "this test needs a cluster with no mutating webhook registered: {:?}",
        registered
            .items
            .iter()
            .map(|w| w.name_any())
            .collect::<Vec<_>>()
    );
    let alone = env.namespace("api-alone").await;
    let chain = env.namespace("api-chain").await;
    let hook = env.namespace("api-hook").await;

    // The default policy's MutatingAdmissionPolicy, bound to the first two namespaces only.
    let policy: GpuPolicy = Api::<GpuPolicy>::all(env.client())
        .get(gpuwarden_crds::DEFAULT_POLICY_NAME)
        .await
        .expect("the default GpuPolicy");
    let created = env
        .cluster
        .install_mutating_policy(
            render(&[&policy], |_| true, api),
            api,
            &env.name("api-rewrite"),
            &[&alone, &chain],
            &env.cleanup,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        created["spec"]["variables"]
            .as_array()
            .is_some_and(|v| !v.is_empty()),
        "the rewrite's variables: {created}"
    );
    let pods = both_paths_pods();
    env.until_admission(&alone, &pods[0].0, "the API server's rewrite", rewritten)
        .await;

    // No webhook: the API server alone.
    let mut stored_alone = BTreeMap::new();
    for (pod, by_api_server) in &pods {
        let r = env
            .cluster
            .create_pod(&alone, pod, false)
            .await
            .expect("create");
        assert!(r.status.is_success(), "{}", r.message());
        let name = r.body["metadata"]["name"].as_str().unwrap_or("").to_owned();
        let containers = r.body["spec"]["containers"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let train = containers
            .iter()
            .find(|c| c["name"] == "train")
            .expect("train");
        let gpu_limit = &train["resources"]["limits"]["nvidia.com/gpu"];
        if !*by_api_server {
            assert_eq!(
                train["securityContext"]["privileged"], true,
                "{name}: left to the webhook"
            );
            assert!(!annotations(&r.body).contains_key(gpuwarden_crds::ANNOTATION_REWRITTEN));
            continue;
        }
        assert_eq!(train["securityContext"]["privileged"], false, "{name}");
        // What an ordinary container has stays: escalation and the runtime's defaults.
        assert!(
            train["securityContext"]
                .get("allowPrivilegeEscalation")
                .is_none(),
            "{name}"
        );
        let own_drop = if name == "limit" {
            json!(["NET_RAW"])
        } else {
            Value::Null
        };
        assert_eq!(
            train["securityContext"]["capabilities"]["drop"], own_drop,
            "{name}: the container's own drop, nothing more"
        );
        assert!(gpu_limit.is_string(), "{name}: no GPU limit: {train}");
        let visible = (train["env"].as_array().into_iter().flatten())
            .any(|e| e["name"] == "NVIDIA_VISIBLE_DEVICES");
        assert!(!visible, "{name}: NVIDIA_VISIBLE_DEVICES kept: {train}");
        assert!(rewritten(&r), "{name}: no report");
        stored_alone.insert(name, admitted(&r.body));
    }
    assert_eq!(
        stored_alone["shared"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "2"
    );

    // The webhook too: the API server's path (policy, then webhook where it still sends the
    // pod) against the webhook alone.
    let (webhook, _) = env.webhook().await;
    env.until_admission(&hook, &pods[0].0, "the webhook", rewritten)
        .await;
    let mut chain_reviews = 0;
    for (pod, by_api_server) in &pods {
        let before = webhook.reviews();
        let via_policy = env
            .cluster
            .create_pod(&chain, pod, false)
            .await
            .expect("create");
        let reviewed = webhook.reviews() - before;
        chain_reviews += reviewed;
        let via_webhook = env
            .cluster
            .create_pod(&hook, pod, false)
            .await
            .expect("create");
        let name = pod["metadata"]["name"].as_str().unwrap_or("");
        assert!(
            via_policy.status.is_success(),
            "{name}: {}",
            via_policy.message()
        );
        assert!(
            via_webhook.status.is_success(),
            "{name}: {}",
            via_webhook.message()
        );
        assert_eq!(
            admitted(&via_policy.body),
            admitted(&via_webhook.body),
            "{name}: the API server's path and the webhook store different pods"
        );
        if *by_api_server {
            assert_eq!(
                reviewed, 0,
                "{name}: rewritten by the API server, yet sent to the webhook"
            );
            assert_eq!(stored_alone[name], admitted(&via_webhook.body), "{name}");
        }
    }
    eprintln!(
        "{} pods compared; the webhook reviewed {chain_reviews} on the API server's path",
        pods.len()
    );
    webhook.stop().await;
    env.cleanup.run().await;
}
