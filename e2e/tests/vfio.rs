//! GPUs handed to VMs, on a real node with NVIDIA's sandbox device plugin (docs/design.md,
//! "GPUs handed to VMs", "No way into a VM's pod"): kubevirt-gpu-device-plugin advertises a
//! vGPU type and a passthrough GPU with its audio function in one IOMMU group, and hands a
//! container more than it allocates. A namespace admin (the `admin` role, impersonated) asks
//! for each of them in a plain pod, with and without KubeVirt's marks, and is refused by the
//! webhook, and by the backstop alone where the webhook is not registered. The same pod asked
//! for by KubeVirt's virt-controller (its ServiceAccount impersonated) is admitted and runs;
//! the tenant can then neither exec, attach, port-forward nor add an ephemeral container
//! into it, while its own ordinary pod stays open. Two such pods, one holding the GPU and
//! one its audio function, are reported by the node agent as holding one IOMMU group, and
//! `Isolated` turns False.
//!
//! It needs the node to be this machine, NVIDIA's sandbox device plugin registered with its
//! kubelet (`../shared/rig/vfio/`, `FAKE_PROFILE=both`; else it prints `SKIPPED`), busybox
//! imported, NVML for the in-process agent, and the plugin's sysfs
//! (`GPUWARDEN_SYSFS_ROOT`, the rig's `/tmp/vfio/fakesys`):
//!
//! A second test runs KubeVirt's own virt-controller, where one runs as
//! `system:serviceaccount:kubevirt:kubevirt-controller` with KubeVirt's CRDs (else it prints
//! `SKIPPED`): the documented GPU VMIs pass the webhook, and the launcher pods the
//! virt-controller creates for them pass the webhook and the backstop; nobody, the cluster
//! admin included, execs into one; a VMI carrying a Kata annotation is refused by the
//! webhook, and where only the backstop runs, the launcher pod the virt-controller creates
//! with the copied annotation is refused.
//!
//! ```sh
//! GPUWARDEN_SYSFS_ROOT=/tmp/vfio/fakesys LD_LIBRARY_PATH=<driver root>/usr/lib64 KUBECONFIG=... \
//!   cargo test -p gpuwarden-e2e --test vfio -- --ignored --nocapture --test-threads=1
//! ```

use std::time::Duration;

use gpuwarden_e2e::cluster::{Cluster, LocalWebhook, namespaces_named, skip, wait_for};
use gpuwarden_e2e::env::{Env, until_admission};
use gpuwarden_e2e::inproc::{RealNode, binding, inventory, isolated};
use gpuwarden_e2e::node::busybox;
use http::Method;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource};
use serde_json::{Value, json};

const TEST: &str = "vm_devices_stay_the_vms";

/// The sandbox plugin's resources on the rig's node (`FAKE_PROFILE=both`).
const VGPU: &str = "nvidia.com/GRID_T4-1Q";
const GPU: &str = "nvidia.com/GA102GL_RTX_A6000";
const AUDIO: &str = "nvidia.com/GA102_HIGH_DEFINITION_AUDIO_CONTROLLER";

/// KubeVirt's virt-controller, as KubeVirt installs it upstream.
const CONTROLLER_NS: &str = "kubevirt";
const CONTROLLER: &str = "kubevirt-controller";

/// A pod `name` whose container `compute` asks for one `resource` and sleeps; with
/// `launcher`, KubeVirt's marks on it as its virt-controller renders a launcher pod (which a
/// tenant can write as well).
fn pod(name: &str, resource: &str, launcher: bool) -> Value {
    let mut pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"terminationGracePeriodSeconds": 1, "restartPolicy": "Never",
            "containers": [{"name": "compute", "image": busybox(), "imagePullPolicy": "Never",
                "command": ["sleep", "3600"],
                "resources": {"limits": {resource: "1"}, "requests": {resource: "1"}}}]}});
    if launcher {
        pod["metadata"]["labels"] =
            json!({"kubevirt.io": "virt-launcher", "kubevirt.io/created-by": "uid"});
        pod["metadata"]["annotations"] = json!({"kubevirt.io/domain": name, "kubectl.kubernetes.io/default-container": "compute"});
        pod["metadata"]["ownerReferences"] = json!([{"apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstance", "name": name, "uid": "0b0e7c1a-0000-4000-8000-000000000001",
            "controller": true, "blockOwnerDeletion": true}]);
    }
    pod
}

/// A namespace `ns` where the webhook and the backstop run, and one, `bare`, where only the
/// backstop does, under one policy of both.
struct Governed {
    ns: String,
    bare: String,
    webhook: LocalWebhook,
}

/// The namespaces of [`Governed`], named after `suffix`.
async fn governed(env: &Env, suffix: &str) -> Governed {
    let ns = env.namespace(suffix).await;
    let bare = env.namespace(&format!("{suffix}-bare")).await;
    let policy = env
        .policy_with(&ns, suffix, |spec| {
            spec.namespace_selector = serde_json::from_value(json!({"matchExpressions": [{
                "key": "kubernetes.io/metadata.name", "operator": "In",
                "values": [ns.clone(), bare.clone()]}]}))
            .expect("selector");
        })
        .await;
    let webhook = env.started_webhook().await;
    env.register_webhook(
        &webhook.url,
        &webhook.ca_pem,
        namespaces_named(&[&ns]),
        suffix,
    )
    .await;
    env.install_policy_with_param(
        "deploy/admission/backstop-policy.yaml",
        &format!("{suffix}-backstop"),
        Some(namespaces_named(&[&ns, &bare])),
        Some(&policy),
    )
    .await;
    Governed { ns, bare, webhook }
}

/// The node's allocatable count of `resource`.
fn allocatable(node: &Value, resource: &str) -> u64 {
    node["status"]["allocatable"][resource]
        .as_str()
        .and_then(|q| q.parse().ok())
        .unwrap_or(0)
}

/// Waits until `who` is refused `pod` in `ns` with a message holding `says`.
async fn refused(who: &Cluster, ns: &str, pod: &Value, what: &str, says: &str) {
    let r = until_admission(who, ns, pod, what, |r| r.status.is_client_error()).await;
    let message = r.message().to_owned();
    assert!(message.contains(says), "{what}: {message}");
    eprintln!("refused, {what}: {message}");
}

/// `POST`s a request to enter pod `ns/name` (`exec`, `attach`, `portforward`) as `who`:
/// the status and message. Admission runs before the connection is upgraded, so a request
/// let through fails on the missing upgrade instead (400), never with 403.
async fn enter(who: &Cluster, ns: &str, name: &str, sub: &str) -> (u16, String) {
    let query = match sub {
        "portforward" => "ports=80",
        _ => "container=compute&stdout=true&command=true",
    };
    let path = format!("/api/v1/namespaces/{ns}/pods/{name}/{sub}?{query}");
    let r = (who.raw(Method::POST, &path, "application/json", None).await)
        .unwrap_or_else(|e| panic!("{e}"));
    (r.status.as_u16(), r.message().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a node: this machine as a Ready node with NVIDIA's sandbox device plugin (../shared/rig/vfio, FAKE_PROFILE=both), busybox imported; KUBECONFIG=... cargo test -p gpuwarden-e2e --test vfio -- --ignored --nocapture --test-threads=1"]
async fn vm_devices_stay_the_vms() {
    let env = Env::new().await;
    if !env.on_this_gpu_node(TEST).await {
        return;
    }
    let nodes = (env.cluster)
        .raw(Method::GET, "/api/v1/nodes", "application/json", None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let node = (nodes.body["items"].as_array().into_iter().flatten())
        .find(|n| {
            allocatable(n, VGPU) >= 2 && allocatable(n, GPU) >= 1 && allocatable(n, AUDIO) >= 1
        })
        .cloned();
    let Some(node) = node else {
        skip(
            TEST,
            "no node advertises the sandbox plugin's GRID_T4-1Q, RTX A6000 and its audio function (../shared/rig/vfio, FAKE_PROFILE=both)",
        );
        return;
    };
    let node_name = node["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    // The operator and the agent, reading the plugin's sysfs (GPUWARDEN_SYSFS_ROOT).
    let real = RealNode::start_on(&env, node_name.clone()).await;

    let Governed { ns, bare, webhook } = governed(&env, "vfio").await;
    let tenant = env.namespace_admin(&ns, "tenant").await;
    let bare_tenant = env.namespace_admin(&bare, "tenant").await;

    // 1. Every plain-pod attempt is refused, whatever the pod says of itself.
    for (resource, what) in [(VGPU, "vgpu"), (GPU, "gpu"), (AUDIO, "audio")] {
        for launcher in [false, true] {
            let name = format!("steal-{what}{}", if launcher { "-marked" } else { "" });
            let attempt = pod(&name, resource, launcher);
            refused(
                &tenant,
                &ns,
                &attempt,
                &format!("{name} (webhook)"),
                &format!("container compute requests {resource}, a VM device"),
            )
            .await;
            refused(
                &bare_tenant,
                &bare,
                &attempt,
                &format!("{name} (backstop alone)"),
                "request a VM device",
            )
            .await;
        }
    }
    // A runtime class that runs no VM (the cluster admin's, handler runc).
    let class = env.name("runc");
    let created = (env.cluster)
        .raw(
            Method::POST,
            "/apis/node.k8s.io/v1/runtimeclasses",
            "application/json",
            Some(&json!({"metadata": {"name": class}, "handler": "runc"})),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        created.status.is_success(),
        "RuntimeClass: {}",
        created.message()
    );
    env.cleanup
        .own_typed::<k8s_openapi::api::node::v1::RuntimeClass>(None, &class);
    let mut runc = pod("steal-runc-class", VGPU, true);
    runc["spec"]["runtimeClassName"] = json!(class);
    refused(
        &tenant,
        &ns,
        &runc,
        "a runtime class that runs no VM",
        "a VM device",
    )
    .await;

    // 2. The same request made by KubeVirt's virt-controller is admitted and runs.
    let post = |path: String, body: Value| {
        let env = &env;
        async move {
            let r = (env
                .cluster
                .raw(Method::POST, &path, "application/json", Some(&body))
                .await)
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(r.status.is_success(), "POST {path}: {}", r.message());
        }
    };
    post(
        format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings"),
        json!({"metadata": {"name": "kubevirt-controller"},
            "subjects": [{"kind": "ServiceAccount", "name": CONTROLLER, "namespace": CONTROLLER_NS}],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"}}),
    )
    .await;
    let kubevirt = (env
        .cluster
        .as_service_account(CONTROLLER_NS, CONTROLLER)
        .await)
        .unwrap_or_else(|e| panic!("{e}"));
    let pods: Api<Pod> = Api::namespaced(env.client(), &ns);
    let mut launchers = Vec::new();
    for (name, resource) in [("virt-launcher-gpu", GPU), ("virt-launcher-audio", AUDIO)] {
        // No owner reference: where KubeVirt is installed, the garbage collector deletes a
        // pod whose VirtualMachineInstance does not exist.
        let mut launcher = pod(name, resource, true);
        launcher["metadata"]
            .as_object_mut()
            .map(|m| m.remove("ownerReferences"));
        let r = until_admission(&kubevirt, &ns, &launcher, name, |r| r.status.is_success()).await;
        assert!(r.status.is_success(), "{name}: {}", r.message());
        let created =
            (kubevirt.create_pod(&ns, &launcher, false).await).unwrap_or_else(|e| panic!("{e}"));
        assert!(created.status.is_success(), "{name}: {}", created.message());
        env.cleanup.own_typed::<Pod>(Some(&ns), name);
        launchers.push(name);
    }
    for name in &launchers {
        let running = wait_for(Duration::from_secs(90), || {
            let pods = pods.clone();
            async move {
                let p = pods.get_opt(name).await.ok()??;
                (p.status?.phase.as_deref() == Some("Running")).then_some(())
            }
        })
        .await;
        assert!(running.is_some(), "{name} never ran");
    }

    // 3. No way into a VM's pod; the tenant's ordinary pod stays open.
    for sub in ["exec", "attach", "portforward"] {
        let (status, message) = enter(&tenant, &ns, "virt-launcher-gpu", sub).await;
        assert_eq!(status, 403, "pods/{sub}: {message}");
        assert!(
            message.contains("it is a VM's pod"),
            "pods/{sub}: {message}"
        );
        eprintln!("refused, pods/{sub}: {message}");
    }
    // As clusters that allow `kubectl debug` grant it.
    post(
        format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles"),
        json!({"metadata": {"name": "tenant-debug"}, "rules": [{"apiGroups": [""],
            "resources": ["pods/ephemeralcontainers"], "verbs": ["get", "patch", "update"]}]}),
    )
    .await;
    post(
        format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings"),
        json!({"metadata": {"name": "tenant-debug"},
            "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": ns}],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant-debug"}}),
    )
    .await;
    let debug = json!({"spec": {"ephemeralContainers": [{"name": "debugger", "image": busybox(),
        "imagePullPolicy": "Never", "targetContainerName": "compute", "command": ["sleep", "60"]}]}});
    let r = (tenant
        .raw(
            Method::PATCH,
            &format!("/api/v1/namespaces/{ns}/pods/virt-launcher-gpu/ephemeralcontainers"),
            "application/strategic-merge-patch+json",
            Some(&debug),
        )
        .await)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(r.status.is_client_error(), "kubectl debug: {r:?}");
    assert!(r.message().contains("the pod is a VM's"), "{}", r.message());
    let ordinary = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ordinary"},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": [{"name": "compute",
            "image": busybox(), "imagePullPolicy": "Never", "command": ["sleep", "3600"]}]}});
    let r = (tenant.create_pod(&ns, &ordinary, false).await).unwrap_or_else(|e| panic!("{e}"));
    assert!(r.status.is_success(), "ordinary: {}", r.message());
    env.cleanup.own_typed::<Pod>(Some(&ns), "ordinary");
    let (status, message) = enter(&tenant, &ns, "ordinary", "exec").await;
    assert_ne!(status, 403, "exec into an ordinary pod: {message}");

    // 4. The node agent reports the group both launcher pods hold, and the node is no
    //    longer isolated: the audio function's pod can open the GPU's group.
    let gn = wait_for(Duration::from_secs(90), || {
        let env = &env;
        let node = node_name.clone();
        async move {
            let gn = inventory(env, &node).await;
            let vfio = gn.status.as_ref()?.vfio.clone()?;
            let shared = vfio.shared_groups.iter().any(|g| g.devices.len() >= 2);
            shared.then_some(gn)
        }
    })
    .await
    .expect("the GpuNode lists the shared IOMMU group");
    let vfio = gn.status.and_then(|s| s.vfio).unwrap_or_default();
    eprintln!(
        "status.vfio: {}",
        serde_json::to_string(&vfio).unwrap_or_default()
    );
    for resource in [VGPU, GPU, AUDIO] {
        assert!(
            vfio.resources.iter().any(|r| r.name == resource),
            "{resource} is VFIO-backed: {vfio:?}"
        );
    }
    let group = (vfio.shared_groups.iter())
        .find(|g| g.devices.iter().any(|d| d.resource_name == AUDIO))
        .expect("the audio function's group is shared")
        .group;
    for name in &launchers {
        let uid = (pods.get(name).await)
            .unwrap_or_else(|e| panic!("{e}"))
            .metadata
            .uid
            .unwrap_or_default();
        let held = binding(&env, &real.name, &uid, "compute", |b| {
            b.iommu_groups.iter().any(|g| g.group == group)
        })
        .await;
        eprintln!("binding of {name}: {held:?}");
    }
    let named = isolated(&env, &real.name, "False")
        .await
        .expect("Isolated turns False for the shared group");
    assert_eq!(named.reason, "SharedIommuGroup", "{named:?}");
    for name in &launchers {
        assert!(named.message.contains(name), "{}", named.message);
    }
    eprintln!("Isolated: {}: {}", named.reason, named.message);

    webhook.stop().await;
    real.stop().await;
}

const KUBEVIRT_TEST: &str = "kubevirts_own_launcher_pods_are_admitted_and_judged";

/// A VirtualMachineInstance `name` asking for `gpus` (device plugin resources), with
/// `annotations`, as KubeVirt's GPU examples write it (a container disk, q35, no virt-api
/// to default it).
fn vmi(name: &str, gpus: &[&str], annotations: Value) -> Value {
    let gpus: Vec<Value> = (gpus.iter().enumerate())
        .map(|(i, d)| json!({"name": format!("gpu{i}"), "deviceName": d}))
        .collect();
    json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"architecture": "amd64", "terminationGracePeriodSeconds": 0,
            "domain": {"machine": {"type": "q35"}, "resources": {"requests": {"memory": "128Mi"}},
                "devices": {"gpus": gpus,
                    "disks": [{"name": "containerdisk", "disk": {"bus": "virtio"}}]}},
            "volumes": [{"name": "containerdisk",
                "containerDisk": {"image": "quay.io/kubevirt/cirros-container-disk-demo:v1.9.0"}}]}})
}

/// Creates `object` under `path` as the cluster admin: the answer.
async fn create(env: &Env, path: &str, object: &Value) -> gpuwarden_e2e::cluster::RawResponse {
    (env.cluster)
        .raw(Method::POST, path, "application/json", Some(object))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The launcher pod KubeVirt created for VMI `uid` in `ns`, once there.
async fn launcher_of(env: &Env, ns: &str, uid: &str) -> Option<Pod> {
    let pods: Api<Pod> = Api::namespaced(env.client(), ns);
    let selector = format!("kubevirt.io/created-by={uid}");
    wait_for(Duration::from_secs(60), || {
        let pods = pods.clone();
        let selector = selector.clone();
        async move {
            let list = pods
                .list(&kube::api::ListParams::default().labels(&selector))
                .await
                .ok()?;
            list.items.into_iter().next()
        }
    })
    .await
}

/// The message of the first `FailedCreate` event of VMI `name` in `ns`, once there.
async fn failed_create(env: &Env, ns: &str, name: &str) -> Option<String> {
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(env.client(), ns);
    wait_for(Duration::from_secs(60), || {
        let events = events.clone();
        async move {
            let list = events.list(&Default::default()).await.ok()?;
            (list.items.into_iter())
                .filter(|e| e.involved_object.name.as_deref() == Some(name))
                .find(|e| e.reason.as_deref() == Some("FailedCreate"))
                .and_then(|e| e.message)
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KubeVirt's CRDs and its real virt-controller running as system:serviceaccount:kubevirt:kubevirt-controller, permitting the sandbox plugin's nvidia.com/GRID_T4-1Q and nvidia.com/GA102GL_RTX_A6000; KUBECONFIG=... cargo test -p gpuwarden-e2e --test vfio -- --ignored --nocapture --test-threads=1"]
async fn kubevirts_own_launcher_pods_are_admitted_and_judged() {
    let env = Env::new().await;
    if !env
        .cluster
        .serves("kubevirt.io/v1", "virtualmachineinstances")
        .await
    {
        skip(KUBEVIRT_TEST, "KubeVirt's CRDs are not installed");
        return;
    }
    let Governed { ns, bare, webhook } = governed(&env, "kubevirt").await;
    let vmis = |ns: &str| format!("/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances");
    let owned = ApiResource {
        group: "kubevirt.io".into(),
        version: "v1".into(),
        api_version: "kubevirt.io/v1".into(),
        kind: "VirtualMachineInstance".into(),
        plural: "virtualmachineinstances".into(),
    };

    // 1. The documented VMs (a vGPU, and a passthrough GPU) pass the webhook's VM entry, and
    //    KubeVirt's own launcher pods, holding the VM devices, pass the webhook and the
    //    backstop: the virt-controller made them.
    let probe = vmi("probe", &[VGPU], json!({}));
    let r = until_admission_of(&env, &vmis(&ns), &probe, |r| r.status.is_success()).await;
    env.cleanup.own(owned.clone(), Some(&ns), "probe");
    let first = launcher_of(
        &env,
        &ns,
        r.body["metadata"]["uid"].as_str().unwrap_or_default(),
    )
    .await;
    let Some(launcher) = first else {
        skip(
            KUBEVIRT_TEST,
            "KubeVirt's virt-controller created no launcher pod: is it running?",
        );
        webhook.stop().await;
        return;
    };
    let compute = (launcher.spec.as_ref())
        .and_then(|s| s.containers.iter().find(|c| c.name == "compute"))
        .cloned()
        .expect("a compute container");
    let limits = compute.resources.and_then(|r| r.limits).unwrap_or_default();
    assert!(limits.contains_key(VGPU), "{limits:?}");
    let managers: Vec<String> = (launcher.metadata.managed_fields.iter().flatten())
        .filter_map(|m| m.manager.clone())
        .collect();
    eprintln!(
        "launcher pod {} created by {managers:?}, compute limits {:?}",
        launcher.metadata.name.clone().unwrap_or_default(),
        limits.keys().collect::<Vec<_>>()
    );
    // Nobody, the cluster admin included, execs into it.
    let launcher_name = launcher.metadata.name.clone().unwrap_or_default();
    let (status, message) = enter(&env.cluster, &ns, &launcher_name, "exec").await;
    assert_eq!(status, 403, "exec into KubeVirt's launcher pod: {message}");
    eprintln!("refused, exec into KubeVirt's launcher pod: {message}");
    let passthrough = vmi("passthrough", &[GPU], json!({}));
    let r = create(&env, &vmis(&ns), &passthrough).await;
    assert!(r.status.is_success(), "passthrough VMI: {}", r.message());
    env.cleanup.own(owned.clone(), Some(&ns), "passthrough");
    let uid = r.body["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        launcher_of(&env, &ns, &uid).await.is_some(),
        "no launcher pod for the passthrough VMI"
    );

    // 2. What a VM's author writes that reaches the pod is judged: the webhook refuses the
    //    VM itself, and where only the backstop runs, the launcher pod the virt-controller
    //    creates with the copied annotation is refused.
    let kata = json!({"io.katacontainers.config_path": "/tmp/evil.toml"});
    let evil = vmi("copied", &[VGPU], kata);
    let r = create(&env, &vmis(&ns), &evil).await;
    assert!(
        r.status.is_client_error(),
        "a VMI with a Kata annotation: {r:?}"
    );
    assert!(
        r.message().contains("VirtualMachineInstance"),
        "{}",
        r.message()
    );
    eprintln!("refused, VMI with a copied annotation: {}", r.message());
    let r = create(&env, &vmis(&bare), &evil).await;
    assert!(
        r.status.is_success(),
        "the VMI where no webhook runs: {}",
        r.message()
    );
    env.cleanup.own(owned, Some(&bare), "copied");
    let message = failed_create(&env, &bare, "copied")
        .await
        .expect("the virt-controller's launcher pod is refused");
    assert!(message.contains("Kata Containers annotations"), "{message}");
    eprintln!("refused, the virt-controller's launcher pod: {message}");
    webhook.stop().await;
}

/// Retries creating `object` at `path` as the cluster admin until `ready` holds for the
/// answer (the webhook configuration and caches take a moment).
async fn until_admission_of(
    env: &Env,
    path: &str,
    object: &Value,
    ready: impl Fn(&gpuwarden_e2e::cluster::RawResponse) -> bool,
) -> gpuwarden_e2e::cluster::RawResponse {
    let mut last = None;
    for _ in 0..40 {
        let r = create(env, path, object).await;
        if ready(&r) {
            return r;
        }
        last = Some(r);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("{path}: never admitted; last answer {last:?}");
}
