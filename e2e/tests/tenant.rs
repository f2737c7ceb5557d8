//! The tenant attack suite, on a real node (docs/design.md, "Threat model"): a tenant with
//! its namespace's `admin` role tries every door it can write to reach GPUs it was not
//! allocated, and each attempt is judged by what its process sees on the node.
//!
//! The tenant is ServiceAccount `tenant` of a namespace that gpuwarden's default GpuPolicy
//! governs (Enforce) and that enforces Pod Security `baseline`, as
//! docs/what-happens-to-a-pod.md tells untrusted namespaces to; it is bound to the built-in
//! `admin` ClusterRole (and, as clusters that allow `kubectl debug` grant it, to
//! `pods/ephemeralcontainers`). Every tenant request is impersonated, so the API server's
//! own authorization decides what it may write. Its
//! containers run an image whose OCI config sets `NVIDIA_VISIBLE_DEVICES=all` (busybox from
//! the node's containerd, re-tagged with that `ENV`, as every CUDA base image sets it) and
//! print their environment and `/dev/nvidia*`. Each attempt must be denied at admission, or
//! run with exactly the GPUs the kubelet allocated it (pod-resources), none where it asked
//! for none: `NVIDIA_VISIBLE_DEVICES` unset, `void` or `none`, no MIG access variable, no
//! `/dev/nvidia<N>`. As a node without the NVIDIA container runtime shows a process nothing
//! the runtime would add, every stored pod is also read as the runtime would read it (CDI
//! annotations, device-list mounts, device hostPaths, the image's variable left in force).
//!
//! The attempts run three ways: (1) the in-process webhook (registered as
//! deploy/admission/mutating-webhook.yaml registers it) with the MutatingAdmissionPolicy
//! rendered from the default policy; (2) the API server alone: the MutatingAdmissionPolicy
//! and no webhook; (3) the webhook "scaled to 0": its configuration registered, calling a
//! port where nothing listens, with the MutatingAdmissionPolicy. Each way also binds the
//! shipped backstop ValidatingAdmissionPolicy to its namespace, as the install does. Ways
//! (2) and (3) are skipped where the server does not serve MutatingAdmissionPolicy. In way
//! (1) the offline engine (`gpuwarden-webhook mutate`'s entry, and the webhook's review for
//! an ephemeral container) judges each attempt as submitted, and must agree with what the
//! API server stored: the same containers' env, securityContext and resources, or a denial.
//!
//! It needs what `e2e.rs`'s node tests need (a Ready node with two allocatable
//! `nvidia.com/gpu`, busybox on it), and that node must be this machine, as root, with `ctr`:
//! it imports the image into the node's containerd and reads the kubelet's pod-resources
//! socket (`$GPUWARDEN_E2E_POD_RESOURCES`, default
//! /var/lib/kubelet/pod-resources/kubelet.sock). Elsewhere it prints `SKIPPED` and why.
//! Everything it creates is deleted, also when it fails; it creates no host path.
//!
//! ```sh
//! KUBECONFIG=... cargo test -p gpuwarden-e2e --test tenant -- --ignored --nocapture --test-threads=1
//! ```

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuwarden_crds::GpuPolicy;
use gpuwarden_crds::admission::policies::{MutatingApi, render};
use gpuwarden_e2e::cluster::{
    Cluster, LocalWebhook, RawResponse, namespaces_named, skip, wait_for,
};
use gpuwarden_e2e::dra::{devices_on, other_drivers};
use gpuwarden_e2e::env::{Env, until_admission};
use gpuwarden_e2e::node::{
    Images, NEEDS_GPU_NODE, SEEN_COMMAND, SEEN_ONCE_COMMAND, Seen, gpu_node, import_image,
    kubelet_gpus, last_visible, local_node_problem, pod_resources_socket,
};
use gpuwarden_webhook::admission::{StaticSource, handle_review};
use gpuwarden_webhook::mutate::{EXIT_ADMITTED, EXIT_DENIED, MutateArgs, OutputFormat};
use http::Method;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, ListParams, LogParams};
use serde_json::{Value, json};

const TEST: &str = "tenant_attacks_get_no_gpu_they_were_not_allocated_on_a_real_node";
/// The label on every pod (and pod template) of an attempt: its name.
const ATTEMPT: &str = "gpuwarden.io/e2e-attempt";
/// The tenant's ServiceAccount.
const TENANT: &str = "tenant";
/// How long an attempt's pod may take to run.
const RUN_TIMEOUT: Duration = Duration::from_secs(120);

/// How admission is set up for a way of running the suite.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    /// The webhook and the MutatingAdmissionPolicy.
    Webhook,
    /// The MutatingAdmissionPolicy alone.
    ApiServer,
    /// The webhook's configuration calling nothing, and the MutatingAdmissionPolicy.
    WebhookDown,
}

impl Way {
    fn label(self) -> &'static str {
        match self {
            Way::Webhook => "1 webhook+MAP",
            Way::ApiServer => "2 MAP alone",
            Way::WebhookDown => "3 webhook down",
        }
    }

    fn suffix(self) -> &'static str {
        match self {
            Way::Webhook => "tenant-webhook",
            Way::ApiServer => "tenant-map",
            Way::WebhookDown => "tenant-down",
        }
    }
}

/// What the tenant does once the object under test is stored.
#[derive(Clone, Debug)]
enum Then {
    Nothing,
    /// `kubectl create job --from=cronjob/<name>`.
    JobFromCronJob,
    /// `kubectl debug`: this ephemeral container, added once the pod runs.
    Debug(Value),
}

/// One attempt: objects the tenant writes first, the object under test (a Pod, or a
/// workload whose pods carry the [`ATTEMPT`] label), and what follows.
#[derive(Clone, Debug)]
struct Attempt {
    name: &'static str,
    setup: Vec<Value>,
    object: Value,
    then: Then,
}

/// Replaces every string `uid-of:<Kind>/<name>` in `object` with the uid of that object
/// among `created` (a setup object names one created before it, as a ComputeDomain's
/// claim config does).
fn with_uids(object: &mut Value, created: &[Value]) {
    match object {
        Value::String(text) => {
            let Some((kind, name)) = text.strip_prefix("uid-of:").and_then(|r| r.split_once('/'))
            else {
                return;
            };
            if let Some(uid) = (created.iter())
                .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
                .and_then(|o| o["metadata"]["uid"].as_str())
            {
                *text = uid.to_owned();
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| with_uids(v, created)),
        Value::Object(map) => map.values_mut().for_each(|v| with_uids(v, created)),
        _ => {}
    }
}

/// What became of an attempt.
#[derive(Debug)]
enum Outcome {
    /// Refused by the API server (admission or authorization).
    Denied { stage: String, message: String },
    /// Its pod ran: what each container saw, and the GPUs the kubelet allocated it.
    Ran {
        stored: Value,
        seen: Vec<(String, Seen, Vec<String>)>,
    },
    /// Its pod was stored but did not run.
    NotRun { stored: Value, why: String },
}

impl Outcome {
    fn summary(&self) -> String {
        match self {
            Outcome::Denied { stage, message } => {
                format!("denied ({stage}): {}", first_line(message, 150))
            }
            Outcome::Ran { seen, .. } => {
                let each: Vec<String> = (seen.iter())
                    .map(|(c, s, allocated)| {
                        format!("{c}: {} (allocated {})", s.summary(), allocated.len())
                    })
                    .collect();
                format!("ran: {}", each.join("; "))
            }
            Outcome::NotRun { stored, why } => {
                let env: Vec<String> = all_containers(stored)
                    .iter()
                    .map(|(_, c)| {
                        format!(
                            "{}: NVIDIA_VISIBLE_DEVICES={}",
                            c["name"].as_str().unwrap_or(""),
                            last_visible(c).unwrap_or_else(|| "(unset)".into())
                        )
                    })
                    .collect();
                format!(
                    "stored, not run ({}): {}",
                    first_line(why, 100),
                    env.join("; ")
                )
            }
        }
    }

    fn stored(&self) -> Option<&Value> {
        match self {
            Outcome::Ran { stored, .. } | Outcome::NotRun { stored, .. } => Some(stored),
            Outcome::Denied { .. } => None,
        }
    }
}

fn first_line(text: &str, max: usize) -> String {
    let line = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    let line = line.trim();
    if line.chars().count() > max {
        format!("{}…", line.chars().take(max).collect::<String>())
    } else {
        line.to_owned()
    }
}

/// The attempts, their containers running `image`.
fn attempts(image: &str, node: &str, device_class: Option<&str>) -> Vec<Attempt> {
    let c = |name: &str| {
        json!({"name": name, "image": image, "imagePullPolicy": "Never",
            "command": ["sh", "-c", SEEN_COMMAND]})
    };
    let main = || c("main");
    let with = |extra: Value| {
        let mut container = main();
        for (k, v) in extra.as_object().into_iter().flatten() {
            container[k] = v.clone();
        }
        container
    };
    let pod = |name: &'static str, spec: Value| -> Value {
        let mut spec = spec;
        spec["terminationGracePeriodSeconds"] = json!(1);
        if spec.get("restartPolicy").is_none() {
            spec["restartPolicy"] = json!("Never");
        }
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {ATTEMPT: name}}, "spec": spec})
    };
    let of = |name: &'static str, object: Value| Attempt {
        name,
        setup: vec![],
        object,
        then: Then::Nothing,
    };
    let simple = |name: &'static str, container: Value| {
        of(name, pod(name, json!({"containers": [container]})))
    };
    let template = |name: &str, spec: Value| {
        let mut spec = spec;
        spec["terminationGracePeriodSeconds"] = json!(1);
        json!({"metadata": {"labels": {ATTEMPT: name}}, "spec": spec})
    };
    let config_map = |name: &str| {
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
            "data": {"NVIDIA_VISIBLE_DEVICES": "all"}})
    };
    let owned_by = |name: &'static str, owner: Value| {
        let mut object = pod(name, json!({"containers": [main()]}));
        object["metadata"]["ownerReferences"] = json!([owner]);
        object
    };
    let owned = |name: &'static str, kind: &str, mut spec: Value| {
        let labels = json!({"owner": name});
        spec["selector"] = json!({"matchLabels": labels});
        spec["template"] = json!({"metadata": {"labels": labels}, "spec": {
            "nodeSelector": {"gpuwarden.io/e2e-nowhere": "true"}, "containers": [main()]}});
        Attempt {
            name,
            setup: vec![json!({"apiVersion": "apps/v1", "kind": kind,
                "metadata": {"name": name}, "spec": spec})],
            object: owned_by(
                name,
                json!({"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": "",
                    "controller": true}),
            ),
            then: Then::Nothing,
        }
    };
    let mut out = vec![
        simple("image-env", main()),
        simple(
            "env-all",
            with(json!({"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]})),
        ),
        Attempt {
            name: "envfrom-configmap",
            setup: vec![config_map("envfrom-configmap")],
            object: pod(
                "envfrom-configmap",
                json!({"containers": [with(json!({"envFrom": [{"configMapRef": {"name": "envfrom-configmap"}}]}))]}),
            ),
            then: Then::Nothing,
        },
        // A key of another name: the ConfigMap guard refuses only runtime variables' names.
        Attempt {
            name: "valuefrom-configmap",
            setup: vec![json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "valuefrom-configmap"}, "data": {"gpus": "all"}})],
            object: pod(
                "valuefrom-configmap",
                json!({"containers": [with(json!({"env": [{"name": "NVIDIA_VISIBLE_DEVICES",
                    "valueFrom": {"configMapKeyRef": {"name": "valuefrom-configmap", "key": "gpus"}}}]}))]}),
            ),
            then: Then::Nothing,
        },
        simple(
            "mig-variables",
            with(json!({"env": [
                {"name": "NVIDIA_MIG_CONFIG_DEVICES", "value": "all"},
                {"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"}]})),
        ),
    ];
    for (name, prefix) in [
        ("cdi-annotation", "cdi.k8s.io"),
        ("nvidia-cdi-annotation", "nvidia.cdi.k8s.io"),
    ] {
        let mut object = pod(name, json!({"containers": [main()]}));
        object["metadata"]["annotations"] = json!({format!("{prefix}/gpus"): "nvidia.com/gpu=all"});
        out.push(of(name, object));
    }
    out.extend([
        of("device-list-mount", pod(
                "device-list-mount",
                json!({"volumes": [{"name": "all", "emptyDir": {}}],
                    "containers": [with(json!({"volumeMounts": [
                        {"name": "all", "mountPath": "/var/run/nvidia-container-devices/all"}]}))]}),
            )),
        // CharDevice: the kubelet creates nothing on the host where /dev/nvidia0 is missing.
        of("hostpath-dev-nvidia0", pod(
                "hostpath-dev-nvidia0",
                json!({"volumes": [{"name": "gpu0", "hostPath": {"path": "/dev/nvidia0", "type": "CharDevice"}}],
                    "containers": [with(json!({"volumeMounts": [{"name": "gpu0", "mountPath": "/dev/nvidia0"}]}))]}),
            )),
        simple(
            "privileged",
            with(json!({"securityContext": {"privileged": true}})),
        ),
        simple(
            "privileged-env-all",
            with(json!({"securityContext": {"privileged": true},
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]})),
        ),
        simple(
            "cap-sys-admin",
            with(json!({"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}})),
        ),
        simple(
            "cap-all",
            with(json!({"securityContext": {"capabilities": {"add": ["ALL"]}}})),
        ),
        of("runtimeclass-nvidia", pod(
                "runtimeclass-nvidia",
                json!({"runtimeClassName": "nvidia", "containers": [main()]}),
            )),
        // The tenant's own DaemonSet (on no node: its pods would be another attempt) and
        // ReplicaSet (of no replica), each named as the controller of a bare pod.
        owned("owner-daemonset", "DaemonSet", json!({})),
        owned("owner-replicaset", "ReplicaSet", json!({"replicas": 0})),
        of("owner-made-up-kind", owned_by(
                "owner-made-up-kind",
                json!({"apiVersion": "example.com/v1", "kind": "Trainer", "name": "trainer",
                    "uid": "6f1c2a52-1d0e-4c43-9f3a-000000000001", "controller": true}),
            )),
        of("daemonset", json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
                "metadata": {"name": "daemonset"},
                "spec": {"selector": {"matchLabels": {ATTEMPT: "daemonset"}},
                    "template": template("daemonset", json!({
                        "tolerations": [{"operator": "Exists"}],
                        "containers": [main()]}))}})),
        of("job", json!({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "job"},
                "spec": {"backoffLimit": 0, "template": template("job", json!({
                    "restartPolicy": "Never", "containers": [main()]}))}})),
        Attempt {
            name: "cronjob",
            setup: vec![],
            object: json!({"apiVersion": "batch/v1", "kind": "CronJob",
                "metadata": {"name": "cronjob"},
                "spec": {"schedule": "* * * * *", "suspend": true,
                    "jobTemplate": {"spec": {"backoffLimit": 0, "template": template("cronjob", json!({
                        "restartPolicy": "Never", "containers": [main()]}))}}}}),
            then: Then::JobFromCronJob,
        },
        of("init-container", pod(
                "init-container",
                json!({"initContainers": [{"name": "init", "image": image, "imagePullPolicy": "Never",
                    "command": ["sh", "-c", SEEN_ONCE_COMMAND]}],
                    "containers": [main()]}),
            )),
        of("sidecar", pod(
                "sidecar",
                json!({"initContainers": [{"name": "side", "image": image, "imagePullPolicy": "Never",
                    "restartPolicy": "Always", "command": ["sh", "-c", SEEN_COMMAND]}],
                    "containers": [main()]}),
            )),
        Attempt {
            name: "ephemeral-debug",
            setup: vec![],
            object: pod("ephemeral-debug", json!({"containers": [main()]})),
            then: Then::Debug(json!({"name": "debugger", "image": image,
                "imagePullPolicy": "Never", "targetContainerName": "main",
                "command": ["sh", "-c", SEEN_COMMAND]})),
        },
        // `kubectl debug --env NVIDIA_VISIBLE_DEVICES=all`.
        Attempt {
            name: "ephemeral-debug-env-all",
            setup: vec![],
            object: pod("ephemeral-debug-env-all", json!({"containers": [main()]})),
            then: Then::Debug(json!({"name": "debugger", "image": image,
                "imagePullPolicy": "Never", "targetContainerName": "main",
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
                "command": ["sh", "-c", SEEN_COMMAND]})),
        },
        of("node-name", pod(
                "node-name",
                json!({"nodeName": node, "containers": [main()]}),
            )),
    ]);
    // The doors besides NVIDIA_VISIBLE_DEVICES (docs/design.md, "Runtime variables",
    // "Device-injection annotations"). A GPU container holds one GPU by its limit.
    let gpu = |extra: Value| {
        let mut container = with(extra);
        container["resources"] = json!({"limits": {"nvidia.com/gpu": "1"}});
        container
    };
    let env_from = |name: &'static str, source: Value, prefix: Option<&str>, key: &str| {
        let secret = source["kind"] == "Secret";
        let mut from = json!({if secret { "secretRef" } else { "configMapRef" }: {"name": name}});
        if let Some(prefix) = prefix {
            from["prefix"] = json!(prefix);
        }
        let mut setup = source;
        setup["metadata"] = json!({"name": name});
        let field = if secret { "stringData" } else { "data" };
        setup[field] = json!({key: "all"});
        Attempt {
            name,
            setup: vec![setup],
            object: pod(
                name,
                json!({"containers": [gpu(json!({"envFrom": [from]}))]}),
            ),
            then: Then::Nothing,
        }
    };
    let config_map_kind = || json!({"apiVersion": "v1", "kind": "ConfigMap"});
    let secret_kind = || json!({"apiVersion": "v1", "kind": "Secret"});
    out.extend([
        env_from(
            "envfrom-gpu-configmap",
            config_map_kind(),
            None,
            "NVIDIA_VISIBLE_DEVICES",
        ),
        env_from(
            "envfrom-gpu-secret",
            secret_kind(),
            None,
            "NVIDIA_VISIBLE_DEVICES",
        ),
        env_from(
            "envfrom-gpu-configmap-prefix",
            config_map_kind(),
            Some("NVIDIA_"),
            "VISIBLE_DEVICES",
        ),
        env_from(
            "envfrom-gpu-secret-prefix",
            secret_kind(),
            Some("NVIDIA_VISIBLE_"),
            "DEVICES",
        ),
        env_from(
            "envfrom-gpu-imex-prefix",
            config_map_kind(),
            Some("NVIDIA_IMEX_"),
            "CHANNELS",
        ),
    ]);
    for (name, variable, value) in [
        ("imex-channels", "NVIDIA_IMEX_CHANNELS", "0"),
        ("imex-channelall", "NVIDIA_IMEX_CHANNELS", "channelall"),
        ("nvswitch", "NVIDIA_NVSWITCH", "enabled"),
        ("mofed", "NVIDIA_MOFED", "enabled"),
        ("gds", "NVIDIA_GDS", "enabled"),
    ] {
        out.push(simple(
            name,
            gpu(json!({"env": [{"name": variable, "value": value}]})),
        ));
    }
    out.extend([
        // A container without GPUs: the void leaves the runtime nothing to act on.
        simple(
            "gdrcopy-no-gpu",
            with(json!({"env": [{"name": "NVIDIA_GDRCOPY", "value": "enabled"}]})),
        ),
        // The toolkit's "legacy image": CUDA_VERSION without NVIDIA_REQUIRE_CUDA.
        simple(
            "legacy-cuda-image",
            with(json!({"env": [{"name": "CUDA_VERSION", "value": "8.0"}]})),
        ),
    ]);
    let annotated = |name: &'static str, key: &str, value: &str, container: Value| {
        let mut object = pod(name, json!({"containers": [container]}));
        object["metadata"]["annotations"] = json!({key: value});
        of(name, object)
    };
    let gpu0 = "- path: /dev/nvidia0\n  type: c\n  major: 195\n  minor: 0\n";
    for (name, key, value) in [
        (
            "nri-devices-container",
            "devices.noderesource.dev/container.main",
            gpu0,
        ),
        ("nri-devices-pod", "devices.noderesource.dev/pod", gpu0),
        ("nri-devices-bare", "devices.noderesource.dev", gpu0),
        (
            "nri-old-devices-container",
            "devices.nri.io/container.main",
            gpu0,
        ),
        ("nri-old-devices-pod", "devices.nri.io/pod", gpu0),
        ("nri-old-devices-bare", "devices.nri.io", gpu0),
        (
            "nri-devices-other-path",
            "devices.noderesource.dev/container.main",
            "- path: /dev/innocent\n  type: c\n  major: 195\n  minor: 1\n",
        ),
        (
            "nri-cdi-devices",
            "cdi-devices.noderesource.dev/container.main",
            "- nvidia.com/gpu=all\n",
        ),
        (
            "nri-old-cdi-devices",
            "cdi-devices.nri.io/pod",
            "- nvidia.com/gpu=0\n",
        ),
        (
            "nri-mounts-device-list",
            "mounts.noderesource.dev/container.main",
            "- source: /dev/null\n  destination: /var/run/nvidia-container-devices/all\n  type: bind\n  options: [bind, ro]\n",
        ),
        (
            "gke-devices",
            "devices.gke.io/container.main",
            "- path: /dev/nvidia0\n- path: /dev/nvidiactl\n",
        ),
        ("nvidia-nri-bare", "nvidia.cdi.k8s.io", "nvidia.com/gpu=all"),
        (
            "nvidia-nri-pod",
            "nvidia.cdi.k8s.io/pod",
            "nvidia.com/gpu=all",
        ),
        (
            "nvidia-nri-container",
            "nvidia.cdi.k8s.io/container.main",
            "nvidia.com/gpu=all",
        ),
    ] {
        out.push(annotated(name, key, value, main()));
    }
    // One GPU held, two named.
    out.push(annotated(
        "nri-devices-beyond-limit",
        "devices.noderesource.dev/container.main",
        "- path: /dev/nvidia0\n  type: c\n  major: 195\n  minor: 0\n- path: /dev/nvidia1\n  type: c\n  major: 195\n  minor: 1\n",
        gpu(json!({})),
    ));
    // Do no harm: what real workloads write keeps working.
    out.push(simple(
        "gdrcopy-gpu",
        gpu(json!({"env": [{"name": "NVIDIA_GDRCOPY", "value": "enabled"}]})),
    ));
    out.push(Attempt {
        name: "envfrom-token-secret",
        setup: vec![
            json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"},
            "stringData": {"HF_TOKEN": "hf_not_a_real_token"}}),
        ],
        object: pod(
            "envfrom-token-secret",
            json!({"containers": [gpu(json!({"envFrom": [{"secretRef": {"name": "hf-token"}}]}))]}),
        ),
        then: Then::Nothing,
    });
    // GPUDirect-TCPXO's shape: a sidecar handed the device nodes of every GPU the pod holds
    // (all of the node's) by an annotation, beside the container that holds them.
    let tcpxo_devices: String = (0..TCPXO_GPUS)
        .map(|n| format!("- path: /dev/nvidia{n}\n  type: c\n  major: 195\n  minor: {n}\n"))
        .chain(["- path: /dev/nvidiactl\n  type: c\n  major: 195\n  minor: 255\n".to_owned()])
        .collect();
    let mut worker = c("worker");
    worker["resources"] = json!({"limits": {"nvidia.com/gpu": TCPXO_GPUS.to_string()}});
    let mut tcpxo = pod("tcpxo-shaped", json!({"containers": [c("daemon"), worker]}));
    tcpxo["metadata"]["annotations"] =
        json!({"devices.noderesource.dev/container.daemon": tcpxo_devices});
    out.push(of("tcpxo-shaped", tcpxo));
    // Kata Containers' annotations and its agent's variable (docs/design.md, "Kata
    // Containers"): inert under runc, judged at admission.
    for (name, key, value) in [
        (
            "kata-agent-visible-cdi",
            gpuwarden_crds::kata::KERNEL_PARAMS,
            "agent.visible_cdi_devices=true",
        ),
        (
            "kata-cold-plug",
            "io.katacontainers.config.hypervisor.cold_plug_vfio",
            "root-port",
        ),
    ] {
        out.push(annotated(name, key, value, main()));
    }
    out.push(simple(
        "kata-visible-cdi-env",
        with(json!({"env": [{"name": "VISIBLE_CDI_DEVICES", "value": "nvidia.com/gpu=all"}]})),
    ));
    if device_class.is_some() {
        // Claims on the ComputeDomain daemon's devices (docs/design.md, "Claims only a
        // driver's own pods may hold"), for a ComputeDomain of the tenant's own.
        let domain = |name: &str| {
            json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
                "metadata": {"name": name},
                "spec": {"numNodes": 1, "channel": {"resourceClaimTemplate": {"name": format!("{name}-channel")}}}})
        };
        let daemon_spec = |name: &str, class: &str| {
            json!({"devices": {"requests": [{"name": "daemon", "exactly": {"deviceClassName": class}}],
                "config": [{"opaque": {"driver": "compute-domain.nvidia.com",
                    "parameters": {"apiVersion": "resource.nvidia.com/v1beta1",
                        "kind": gpuwarden_crds::claims::CONFIG_KIND_CD_DAEMON,
                        "domainID": format!("uid-of:ComputeDomain/{name}")}}}]}})
        };
        let claim_pod = |name: &'static str, entry: Value| {
            pod(
                name,
                json!({"resourceClaims": [entry],
                    "containers": [with(json!({"resources": {"claims": [{"name": "cd"}]}}))]}),
            )
        };
        for (name, kind, class) in [
            (
                "cd-daemon-claim",
                "ResourceClaim",
                gpuwarden_crds::claims::DEVICE_CLASS_CD_DAEMON,
            ),
            (
                "cd-daemon-template",
                "ResourceClaimTemplate",
                gpuwarden_crds::claims::DEVICE_CLASS_CD_DAEMON,
            ),
            // The daemon's config on the channel class: the driver reads the config.
            (
                "cd-daemon-config-on-channel",
                "ResourceClaim",
                gpuwarden_crds::claims::DEVICE_CLASS_CD_CHANNEL,
            ),
        ] {
            let (spec, entry) = if kind == "ResourceClaim" {
                (
                    daemon_spec(name, class),
                    json!({"name": "cd", "resourceClaimName": name}),
                )
            } else {
                (
                    json!({"spec": daemon_spec(name, class)}),
                    json!({"name": "cd", "resourceClaimTemplateName": name}),
                )
            };
            out.push(Attempt {
                name,
                setup: vec![
                    domain(name),
                    json!({"apiVersion": "resource.k8s.io/v1", "kind": kind,
                        "metadata": {"name": name}, "spec": spec}),
                ],
                object: claim_pod(name, entry),
                then: Then::Nothing,
            });
        }
    }
    if let Some(class) = device_class {
        out.push(Attempt {
            name: "resource-claim-nic",
            setup: vec![json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": "nic"},
                "spec": {"devices": {"requests": [{"name": "nic", "exactly": {"deviceClassName": class}}]}}})],
            object: pod(
                "resource-claim-nic",
                json!({"resourceClaims": [{"name": "nic", "resourceClaimName": "nic"}],
                    "containers": [with(json!({"resources": {"claims": [{"name": "nic"}]}}))]}),
            ),
            then: Then::Nothing,
        });
    }
    out
}

/// The GPUs the TCPXO-shaped attempt holds, and its sidecar is handed by annotation: the
/// node's (NVIDIA's mock NVML describes 8).
const TCPXO_GPUS: u32 = 8;

/// Containers of an attempt that an annotation hands device nodes of the GPUs their pod
/// holds: judged against the pod's allocation rather than their own.
const INJECTED_INTO: &[(&str, &str)] = &[("tcpxo-shaped", "daemon")];

/// The collection path of an object of the tenant's namespace `ns`.
fn collection(object: &Value, ns: &str) -> String {
    let api_version = object["apiVersion"].as_str().unwrap_or("v1");
    let plural = format!(
        "{}s",
        object["kind"].as_str().unwrap_or_default().to_lowercase()
    );
    let root = if api_version == "v1" {
        "/api/v1".to_owned()
    } else {
        format!("/apis/{api_version}")
    };
    format!("{root}/namespaces/{ns}/{plural}")
}

fn name_of(object: &Value) -> &str {
    object["metadata"]["name"].as_str().unwrap_or_default()
}

/// Every container of a pod (or pod template) with its list: init, regular, ephemeral.
fn all_containers(pod: &Value) -> Vec<(&'static str, &Value)> {
    ["initContainers", "containers", "ephemeralContainers"]
        .into_iter()
        .flat_map(|field| {
            (pod["spec"][field].as_array().into_iter().flatten()).map(move |c| (field, c))
        })
        .collect()
}

fn names_none(value: &str) -> bool {
    let v = value.trim();
    v.is_empty() || v.eq_ignore_ascii_case("void") || v.eq_ignore_ascii_case("none")
}

/// What the NVIDIA runtime would hand the pod's containers beyond their allocation, read
/// from the stored pod: an NVIDIA CDI annotation, a device-list mount, a device hostPath, a
/// privileged container, `NVIDIA_VISIBLE_DEVICES` or a MIG variable naming devices (or set
/// beside a GPU limit, which it would override), and, in a container of `image` (whose
/// config sets `NVIDIA_VISIBLE_DEVICES=all`) without a GPU, the image's value left in force.
fn stored_gives(pod: &Value, image: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (key, value) in pod["metadata"]["annotations"]
        .as_object()
        .into_iter()
        .flatten()
    {
        let value = value.as_str().unwrap_or_default();
        if gpuwarden_crds::is_cdi_annotation(key) && value.contains("nvidia.com/") {
            out.push(format!("CDI annotation {key}: {value}"));
        }
    }
    // Device-injection annotations, where no injector runs on the node: what they name
    // beyond the GPUs the pod's limits hold (the node agent checks the GPUs themselves).
    let held: u32 = (all_containers(pod).iter())
        .filter(|(field, _)| *field != "ephemeralContainers")
        .filter_map(|(_, c)| {
            c["resources"]["limits"]["nvidia.com/gpu"]
                .as_str()?
                .parse::<u32>()
                .ok()
        })
        .sum();
    let annotations = (pod["metadata"]["annotations"]
        .as_object()
        .into_iter()
        .flatten())
    .map(|(k, v)| (k.as_str(), v.as_str()));
    let injections = gpuwarden_crds::injection::read_all(annotations);
    let features = [gpuwarden_crds::RuntimeFeature::Gdrcopy];
    for u in gpuwarden_crds::injection::judge(&injections, held, &features).uncovered {
        out.push(u.message);
    }
    let volumes = pod["spec"]["volumes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for (_, c) in all_containers(pod) {
        let name = c["name"].as_str().unwrap_or_default();
        if c["securityContext"]["privileged"] == true {
            out.push(format!("{name}: privileged"));
        }
        let gpus = ["limits", "requests"].iter().any(|k| {
            (c["resources"][k].as_object().into_iter().flatten()).any(|(r, q)| {
                gpuwarden_crds::gpu::is_gpu_resource(r) && q.as_str().is_some_and(|q| q != "0")
            })
        });
        match last_visible(c) {
            Some(v) if gpus => out.push(format!(
                "{name}: NVIDIA_VISIBLE_DEVICES={v} beside a GPU limit overrides the allocation"
            )),
            Some(v) if !names_none(&v) => out.push(format!("{name}: NVIDIA_VISIBLE_DEVICES={v}")),
            None if !gpus && c["image"] == image => out.push(format!(
                "{name}: no NVIDIA_VISIBLE_DEVICES entry: the image's NVIDIA_VISIBLE_DEVICES=all is in force"
            )),
            _ => {}
        }
        let voided = last_visible(c).as_deref().map(str::trim) == Some("void");
        for e in c["env"].as_array().into_iter().flatten() {
            let var = e["name"].as_str().unwrap_or_default();
            if var.starts_with("NVIDIA_MIG_") && !e["value"].as_str().is_some_and(names_none) {
                out.push(format!("{name}: {var} set"));
            }
            // The runtime acts on these where NVIDIA_VISIBLE_DEVICES is not void.
            let device = [
                "NVIDIA_IMEX_CHANNELS",
                "NVIDIA_NVSWITCH",
                "NVIDIA_MOFED",
                "NVIDIA_GDS",
            ];
            if device.contains(&var) && !voided {
                out.push(format!("{name}: {var} set"));
            }
        }
        for from in c["envFrom"].as_array().into_iter().flatten() {
            let prefix = from["prefix"].as_str().unwrap_or_default();
            if let Some(v) = gpuwarden_crds::gpu::spelled_by_prefix(prefix).filter(|_| !voided) {
                out.push(format!("{name}: envFrom prefix {prefix} may spell {v}"));
            }
        }
        for m in c["volumeMounts"].as_array().into_iter().flatten() {
            let path = m["mountPath"].as_str().unwrap_or_default();
            if path.contains("nvidia-container-devices") {
                out.push(format!("{name}: device-list mount {path}"));
            }
            let host = (volumes.iter())
                .find(|v| v["name"] == m["name"])
                .and_then(|v| v["hostPath"]["path"].as_str());
            if let Some(host) = host
                && (host == "/dev"
                    || host.starts_with("/dev/nvidia")
                    || host.starts_with("/dev/dri"))
            {
                out.push(format!("{name}: device hostPath {host}"));
            }
        }
    }
    out
}

/// A container's env, securityContext and resources, as the API server stores them: a
/// limit without a request gets the request, and empty fields are no fields.
fn judged_fields(pod: &Value) -> Value {
    let mut out = serde_json::Map::new();
    for (field, c) in all_containers(pod) {
        let mut resources = c["resources"].clone();
        if let Some(limits) = resources["limits"].as_object().cloned() {
            for (k, v) in limits {
                if resources["requests"].get(&k).is_none() {
                    resources["requests"][&k] = v;
                }
            }
        }
        let mut fields = serde_json::Map::new();
        for (key, value) in [
            ("env", c["env"].clone()),
            ("securityContext", c["securityContext"].clone()),
            ("resources", resources),
        ] {
            let empty = value.is_null()
                || value.as_object().is_some_and(|o| o.is_empty())
                || value.as_array().is_some_and(|a| a.is_empty());
            if !empty {
                fields.insert(key.to_owned(), value);
            }
        }
        let name = c["name"].as_str().unwrap_or_default();
        out.insert(format!("{field}/{name}"), Value::Object(fields));
    }
    Value::Object(out)
}

/// The pod (template) inside a workload as the offline engine returns it.
fn pod_of(object: &Value) -> Value {
    match object["kind"].as_str() {
        Some("Pod") => object.clone(),
        Some("CronJob") => object["spec"]["jobTemplate"]["spec"]["template"].clone(),
        _ => object["spec"]["template"].clone(),
    }
}

/// What the offline engine makes of a submitted object.
enum Offline {
    Denied(String),
    Admitted(Value),
}

/// `gpuwarden-webhook mutate` (its library entry) on `object` as submitted, in `namespace`
/// (the Namespace object, for its labels), with the cluster's GpuPolicies in `policies` and
/// the tenant's ResourceClaims in `claims`.
fn offline(policies: &Path, namespace: &Value, claims: &[&Value], object: &Value) -> Offline {
    let mut items = vec![namespace.clone()];
    items.extend(claims.iter().map(|c| (*c).clone()));
    items.push(object.clone());
    let input = json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string();
    let args = MutateArgs {
        filenames: vec!["-".into()],
        policies: vec![policies.to_path_buf()],
        output: OutputFormat::Json,
        namespace: Some(name_of(namespace).to_owned()),
        namespace_labels: None,
    };
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = gpuwarden_webhook::mutate::run(&args, &mut input.as_bytes(), &mut out, &mut err);
    let stderr = String::from_utf8_lossy(&err).into_owned();
    match code {
        EXIT_DENIED => Offline::Denied(stderr),
        EXIT_ADMITTED => {
            let written: Value = serde_json::from_slice(&out).expect("mutate's JSON");
            let found = if written["kind"] == "List" {
                (written["items"].as_array().into_iter().flatten())
                    .find(|i| i["kind"] == object["kind"] && name_of(i) == name_of(object))
                    .cloned()
            } else {
                Some(written)
            };
            Offline::Admitted(found.expect("mutate printed the object"))
        }
        other => panic!("mutate exited {other}: {stderr}"),
    }
}

/// The webhook's own review, offline, of `pods/ephemeralcontainers` adding what `new` has
/// beyond `old`: the pod it would store, or its denial.
fn offline_ephemeral(
    policies: &[GpuPolicy],
    namespace: &Value,
    old: &Value,
    new: &Value,
) -> Offline {
    let ns = name_of(namespace);
    let labels: Vec<(&str, &str)> = (namespace["metadata"]["labels"]
        .as_object()
        .into_iter()
        .flatten())
    .filter_map(|(k, v)| Some((k.as_str(), v.as_str()?)))
    .collect();
    let source = StaticSource::new(policies.iter().cloned()).with_namespace(ns, &labels);
    let review = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "offline", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "subResource": "ephemeralcontainers", "name": name_of(new), "namespace": ns,
            "operation": "UPDATE", "object": new, "oldObject": old}});
    let body = serde_json::to_vec(&review).expect("review");
    let (answer, _) = handle_review(&body, &source);
    let answer: Value = serde_json::from_slice(&answer).expect("the review's answer");
    let response = &answer["response"];
    if response["allowed"] != true {
        return Offline::Denied(
            response["status"]["message"]
                .as_str()
                .unwrap_or("")
                .to_owned(),
        );
    }
    let mut pod = new.clone();
    if let Some(patch) = response["patch"].as_str() {
        let bytes = base64_simd::STANDARD.decode_to_vec(patch).expect("base64");
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).expect("a JSON patch");
        json_patch::patch(&mut pod, &patch).expect("the webhook's patch applies");
    }
    Offline::Admitted(pod)
}

/// What an attempt left to check in way (1): the object as submitted, with the setup
/// objects, and for `kubectl debug` the pod before and the container added.
struct Submitted {
    object: Value,
    claims: Vec<Value>,
    debug: Option<(Value, Value)>,
}

/// One way's namespace, its tenant, and what the tenant may reach.
struct Tenancy {
    way: Way,
    ns: String,
    namespace: Value,
    tenant: Cluster,
}

/// The context shared by the ways.
struct Suite<'e> {
    env: &'e Env,
    image: String,
    node: String,
    device_class: Option<String>,
    socket: PathBuf,
    policies_file: PathBuf,
    policies: Vec<GpuPolicy>,
}

/// One line of the table, and what failed.
struct Row {
    attempt: &'static str,
    way: Way,
    outcome: String,
    engine: String,
    problems: Vec<String>,
}

impl Row {
    /// `| attempt | way | outcome | engine |`, and what failed (a leak, a disagreement).
    fn line(&self) -> String {
        let mut line = format!(
            "| {} | {} | {} | {} |",
            self.attempt,
            self.way.label(),
            self.outcome,
            if self.engine.is_empty() {
                "-"
            } else {
                &self.engine
            }
        );
        if !self.problems.is_empty() {
            line.push_str(&format!(" FAILED: {} |", self.problems.join("; ")));
        }
        line
    }
}

impl Suite<'_> {
    fn admin(&self) -> &Cluster {
        &self.env.cluster
    }

    /// A namespace governed by the default policy and enforcing Pod Security baseline, its
    /// tenant bound to `admin` (and to `pods/ephemeralcontainers`), acting as that tenant.
    async fn tenancy(&self, way: Way) -> Tenancy {
        let ns = self.env.namespace_at(way.suffix(), "baseline").await;
        let admin = self.admin();
        let post = |path: String, body: Value| async move {
            let r = admin
                .raw(Method::POST, &path, "application/json", Some(&body))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(r.status.is_success(), "POST {path}: {}", r.message());
        };
        let tenant = self.env.namespace_admin(&ns, TENANT).await;
        let subject = json!([{"kind": "ServiceAccount", "name": TENANT, "namespace": ns}]);
        let rbac = format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}");
        post(
            format!("{rbac}/roles"),
            json!({"metadata": {"name": "tenant-debug"}, "rules": [{"apiGroups": [""],
                "resources": ["pods/ephemeralcontainers"], "verbs": ["get", "patch", "update"]},
                // A tenant may create ComputeDomains: they are made for workloads.
                {"apiGroups": ["resource.nvidia.com"], "resources": ["computedomains"],
                "verbs": ["create", "get", "list", "delete"]}]}),
        )
        .await;
        post(
            format!("{rbac}/rolebindings"),
            json!({"metadata": {"name": "tenant-debug"}, "subjects": subject,
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant-debug"}}),
        )
        .await;
        let namespace = admin
            .raw(
                Method::GET,
                &format!("/api/v1/namespaces/{ns}"),
                "application/json",
                None,
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .body;
        Tenancy {
            way,
            ns,
            namespace,
            tenant,
        }
    }

    /// Runs every attempt in `t`'s namespace; in way (1) holds the offline engine to what
    /// was stored.
    async fn run_way(&self, t: &Tenancy) -> Vec<Row> {
        let mut rows = Vec::new();
        let device_class = self.device_class.as_deref();
        for attempt in attempts(&self.image, &self.node, device_class) {
            let started = Instant::now();
            let (outcome, submitted) = self.attempt(t, &attempt).await;
            let mut problems = Vec::new();
            if let Some(stored) = outcome.stored() {
                problems.extend(stored_gives(stored, &self.image));
            }
            if let Outcome::Ran { seen, .. } = &outcome {
                let pod_gpus: Vec<String> = (seen.iter())
                    .flat_map(|(_, _, allocated)| allocated.iter().cloned())
                    .collect();
                for (container, seen, allocated) in seen {
                    let injected = INJECTED_INTO.contains(&(attempt.name, container.as_str()));
                    if injected && seen.gpu_devices.len() > pod_gpus.len() {
                        problems.push(format!(
                            "{container} sees {:?}, more than the {} GPUs its pod holds",
                            seen.gpu_devices,
                            pod_gpus.len()
                        ));
                    } else if injected {
                        let own = Seen {
                            gpu_devices: Vec::new(),
                            ..seen.clone()
                        };
                        if let Err(why) = own.holds_exactly(allocated) {
                            problems.push(format!("{container} sees {why}"));
                        }
                    } else if let Err(why) = seen.holds_exactly(allocated) {
                        problems.push(format!("{container} sees {why}"));
                    }
                }
            }
            let engine = if t.way == Way::Webhook {
                match self.engine_agrees(t, &outcome, &submitted).await {
                    Ok(text) => text,
                    Err(why) => {
                        problems.push(format!("the offline engine disagrees: {why}"));
                        "DISAGREES".to_owned()
                    }
                }
            } else {
                String::new()
            };
            let held = self.remove(t, &attempt, &outcome).await;
            let row = Row {
                attempt: attempt.name,
                way: t.way,
                outcome: outcome.summary(),
                engine,
                problems,
            };
            eprintln!(
                "{} {:.0} s{}",
                row.line(),
                started.elapsed().as_secs_f64(),
                if held { ", GPUs released" } else { "" },
            );
            if !row.problems.is_empty() {
                eprintln!(
                    "  stored: {}",
                    outcome
                        .stored()
                        .map_or_else(|| "(nothing)".to_owned(), |s| judged_fields(s).to_string())
                );
            }
            rows.push(row);
        }
        rows
    }

    /// Creates an attempt's objects as the tenant and follows them to a process.
    async fn attempt(&self, t: &Tenancy, attempt: &Attempt) -> (Outcome, Submitted) {
        let mut submitted = Submitted {
            object: attempt.object.clone(),
            claims: Vec::new(),
            debug: None,
        };
        let mut created: Vec<Value> = Vec::new();
        for object in &attempt.setup {
            let mut object = object.clone();
            with_uids(&mut object, &created);
            let object = &object;
            // What the tenant submitted, refused or not, is what the offline engine reads.
            if matches!(
                object["kind"].as_str(),
                Some("ResourceClaim" | "ResourceClaimTemplate")
            ) {
                submitted.claims.push(object.clone());
            }
            let r = self.create(t, object).await;
            if !r.status.is_success() {
                let stage = format!(
                    "setup {} {}",
                    object["kind"].as_str().unwrap_or(""),
                    name_of(object)
                );
                return (denied(stage, &r), submitted);
            }
            created.push(r.body);
        }
        // Owner references name the setup objects by uid.
        for owner in (submitted.object["metadata"]["ownerReferences"].as_array_mut())
            .into_iter()
            .flatten()
        {
            if let Some(o) = created
                .iter()
                .find(|o| o["kind"] == owner["kind"] && o["metadata"]["name"] == owner["name"])
            {
                owner["uid"] = o["metadata"]["uid"].clone();
            }
        }
        let r = self.create(t, &submitted.object).await;
        if !r.status.is_success() {
            let stage = submitted.object["kind"].as_str().unwrap_or("").to_owned();
            return (denied(stage, &r), submitted);
        }
        if matches!(attempt.then, Then::JobFromCronJob) {
            let cron = &r.body;
            let job = json!({"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": format!("{}-manual", attempt.name),
                    "annotations": {"cronjob.kubernetes.io/instantiate": "manual"},
                    "ownerReferences": [{"apiVersion": "batch/v1", "kind": "CronJob",
                        "name": name_of(cron), "uid": cron["metadata"]["uid"], "controller": true}]},
                "spec": cron["spec"]["jobTemplate"]["spec"]});
            let r = self.create(t, &job).await;
            if !r.status.is_success() {
                return (denied("Job from the CronJob".into(), &r), submitted);
            }
        }
        let pod = match self.pod_of_attempt(t, attempt.name).await {
            Ok(pod) => pod,
            Err(message) => {
                let stage = format!(
                    "the {} controller's pod",
                    attempt.object["kind"].as_str().unwrap_or("")
                );
                return (Outcome::Denied { stage, message }, submitted);
            }
        };
        let pod_name = name_of(&pod).to_owned();
        let mut outcome = self.watch(t, &pod_name).await;
        if let (Then::Debug(container), Outcome::Ran { stored, .. }) = (&attempt.then, &outcome) {
            let before = stored.clone();
            let mut after = before.clone();
            after["spec"]["ephemeralContainers"] = json!([container]);
            submitted.debug = Some((before, after));
            let path = format!(
                "/api/v1/namespaces/{}/pods/{pod_name}/ephemeralcontainers",
                t.ns
            );
            let body = json!({"spec": {"ephemeralContainers": [container]}});
            let r = t
                .tenant
                .raw(
                    Method::PATCH,
                    &path,
                    "application/strategic-merge-patch+json",
                    Some(&body),
                )
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            outcome = if r.status.is_success() {
                self.watch(t, &pod_name).await
            } else {
                denied("ephemeral container".into(), &r)
            };
        }
        (outcome, submitted)
    }

    async fn create(&self, t: &Tenancy, object: &Value) -> RawResponse {
        t.tenant
            .raw(
                Method::POST,
                &collection(object, &t.ns),
                "application/json",
                Some(object),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The pod of an attempt (labelled with its name), or why its controller made none
    /// (its `FailedCreate` event: the API server refused the pod).
    async fn pod_of_attempt(&self, t: &Tenancy, name: &str) -> Result<Value, String> {
        let pods: Api<Pod> = Api::namespaced(self.env.client(), &t.ns);
        let events: Api<Event> = Api::namespaced(self.env.client(), &t.ns);
        let selector = format!("{ATTEMPT}={name}");
        let found = wait_for(Duration::from_secs(60), || {
            let (pods, events, selector) = (pods.clone(), events.clone(), selector.clone());
            async move {
                let list = pods
                    .list(&ListParams::default().labels(&selector))
                    .await
                    .ok()?;
                if let Some(pod) = list.items.into_iter().next() {
                    return Some(Ok(serde_json::to_value(pod).expect("pod")));
                }
                let events = events.list(&ListParams::default()).await.ok()?;
                events.items.into_iter().find_map(|e| {
                    let about = e.involved_object.name.as_deref().unwrap_or("");
                    (e.reason.as_deref() == Some("FailedCreate") && about.starts_with(name))
                        .then(|| Err(e.message.unwrap_or_default()))
                })
            }
        })
        .await;
        found.unwrap_or_else(|| {
            Err(format!(
                "no pod labelled {selector} and no FailedCreate event after 60 s"
            ))
        })
    }

    /// Follows a pod until every container printed what it sees: then what each saw and
    /// what the kubelet allocated it; or why it did not run.
    async fn watch(&self, t: &Tenancy, name: &str) -> Outcome {
        let pods: Api<Pod> = Api::namespaced(self.env.client(), &t.ns);
        let events: Api<Event> = Api::namespaced(self.env.client(), &t.ns);
        let start = Instant::now();
        let mut last = Value::Null;
        loop {
            let stored = match pods.get(name).await {
                Ok(p) => serde_json::to_value(p).expect("pod"),
                Err(e) => {
                    let why = format!("the pod went away: {e}");
                    return Outcome::NotRun { stored: last, why };
                }
            };
            last = stored.clone();
            let mut seen = Vec::new();
            for (_, c) in all_containers(&stored) {
                let container = c["name"].as_str().unwrap_or_default().to_owned();
                let params = LogParams {
                    container: Some(container.clone()),
                    ..LogParams::default()
                };
                if let Some(s) = (pods.logs(name, &params).await.ok()).and_then(|l| Seen::parse(&l))
                {
                    seen.push((container, s));
                }
            }
            if seen.len() == all_containers(&stored).len() {
                let allocated = self.allocated(&t.ns, name).await;
                let seen = (seen.into_iter())
                    .map(|(c, s)| {
                        let gpus = allocated
                            .iter()
                            .find(|(n, _)| *n == c)
                            .map(|(_, g)| g.clone());
                        (c, s, gpus.unwrap_or_default())
                    })
                    .collect();
                return Outcome::Ran { stored, seen };
            }
            let unschedulable = (stored["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten())
            .find(|c| c["type"] == "PodScheduled" && c["reason"] == "Unschedulable");
            let stuck = (stored["status"]["containerStatuses"]
                .as_array()
                .into_iter()
                .flatten())
            .chain(
                stored["status"]["initContainerStatuses"]
                    .as_array()
                    .into_iter()
                    .flatten(),
            )
            .filter_map(|s| s["state"]["waiting"]["reason"].as_str().map(|r| (r, s)))
            .find(|(r, _)| *r != "ContainerCreating" && *r != "PodInitializing");
            let warning = if start.elapsed() > Duration::from_secs(15) {
                let params = ListParams::default()
                    .fields(&format!("involvedObject.name={name},type=Warning"));
                (events.list(&params).await.ok())
                    .and_then(|l| l.items.into_iter().next_back())
                    .map(|e| {
                        format!(
                            "{}: {}",
                            e.reason.unwrap_or_default(),
                            e.message.unwrap_or_default()
                        )
                    })
            } else {
                None
            };
            let why = match (unschedulable, stuck, warning) {
                (Some(c), _, _) if start.elapsed() > Duration::from_secs(5) => Some(format!(
                    "unschedulable: {}",
                    c["message"].as_str().unwrap_or("")
                )),
                (_, Some((reason, s)), _) if start.elapsed() > Duration::from_secs(10) => {
                    Some(format!(
                        "{reason}: {}",
                        s["state"]["waiting"]["message"].as_str().unwrap_or("")
                    ))
                }
                (_, _, Some(w)) => Some(w),
                _ if start.elapsed() > RUN_TIMEOUT => Some(format!(
                    "not running after {} s: phase {}",
                    RUN_TIMEOUT.as_secs(),
                    stored["status"]["phase"]
                )),
                _ => None,
            };
            if let Some(why) = why {
                return Outcome::NotRun { stored, why };
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// The GPUs the kubelet allocated each container of a pod ([`kubelet_gpus`]).
    async fn allocated(&self, ns: &str, pod: &str) -> Vec<(String, Vec<String>)> {
        kubelet_gpus(&self.socket, ns, pod).await
    }

    /// Way (1): the offline engine, on what the tenant submitted, against the API server.
    async fn engine_agrees(
        &self,
        t: &Tenancy,
        outcome: &Outcome,
        submitted: &Submitted,
    ) -> Result<String, String> {
        let claims: Vec<&Value> = submitted.claims.iter().collect();
        let mut engine = offline(
            &self.policies_file,
            &t.namespace,
            &claims,
            &submitted.object,
        );
        if let (Some((before, after)), Offline::Admitted(pod)) = (&submitted.debug, &engine) {
            let base = pod.clone();
            engine = match offline_ephemeral(&self.policies, &t.namespace, before, after) {
                Offline::Admitted(debugged) => {
                    let mut pod = base;
                    pod["spec"]["ephemeralContainers"] =
                        debugged["spec"]["ephemeralContainers"].clone();
                    Offline::Admitted(pod)
                }
                denied => denied,
            };
        }
        match (outcome, engine) {
            // The ConfigMap guard refused what the pod would read; the pre-flight names
            // such keys.
            (Outcome::Denied { stage, message }, _)
                if stage.starts_with("setup")
                    && message.contains("a variable of the NVIDIA container runtime") =>
            {
                Ok("its ConfigMap/Secret refused by the guard".into())
            }
            // The claim guard refused the claim the pod would use; the engine denies the
            // claim and the pod.
            (Outcome::Denied { stage, message }, Offline::Denied(why))
                if stage.starts_with("setup")
                    && message.contains(gpuwarden_crds::claims::DRIVER_ONLY_REASON)
                    && why.contains(gpuwarden_crds::claims::DRIVER_ONLY_REASON) =>
            {
                Ok("its claim refused by the claim guard; denies the claim and the pod too".into())
            }
            (Outcome::Denied { message, .. }, Offline::Denied(why)) => {
                if message.contains("pods.gpuwarden.io") {
                    Ok("denies too".into())
                } else {
                    Err(format!(
                        "the server denied ({}) what gpuwarden did not: engine: {}",
                        first_line(message, 120),
                        first_line(&why, 120)
                    ))
                }
            }
            (Outcome::Denied { message, .. }, Offline::Admitted(object)) => {
                if message.contains("pods.gpuwarden.io") {
                    return Err(format!(
                        "the webhook denied ({}), the engine admits",
                        first_line(message, 120)
                    ));
                }
                // Refused after gpuwarden (Pod Security, the backstop): the engine's pod
                // must be refused too.
                let mut pod = pod_of(&object);
                pod["apiVersion"] = json!("v1");
                pod["kind"] = json!("Pod");
                pod["metadata"]["name"] = json!(format!("engine-{}", name_of(&submitted.object)));
                let r = t
                    .tenant
                    .create_pod(&t.ns, &pod, true)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                if r.status.is_success() {
                    Err(format!(
                        "the server denied ({}), the engine's pod is admitted",
                        first_line(message, 120)
                    ))
                } else {
                    Ok(format!(
                        "admits; its pod is refused too: {}",
                        first_line(r.message(), 60)
                    ))
                }
            }
            (
                Outcome::Ran { stored, .. } | Outcome::NotRun { stored, .. },
                Offline::Admitted(object),
            ) => {
                let (server, engine) = (judged_fields(stored), judged_fields(&pod_of(&object)));
                if server == engine {
                    Ok("same env/securityContext/resources".into())
                } else {
                    Err(format!("stored {server}, engine {engine}"))
                }
            }
            (Outcome::Ran { .. } | Outcome::NotRun { .. }, Offline::Denied(why)) => Err(format!(
                "stored, the engine denies: {}",
                first_line(&why, 160)
            )),
        }
    }

    /// Deletes an attempt's objects; where its pod held GPUs, waits until it is gone so the
    /// next attempt finds them free. Returns whether it held any.
    async fn remove(&self, t: &Tenancy, attempt: &Attempt, outcome: &Outcome) -> bool {
        let mut objects: Vec<Value> = attempt.setup.clone();
        objects.push(attempt.object.clone());
        if matches!(attempt.then, Then::JobFromCronJob) {
            objects.push(json!({"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": format!("{}-manual", attempt.name)}}));
        }
        let options = json!({"propagationPolicy": "Background", "gracePeriodSeconds": 0});
        for object in objects.iter().rev() {
            let path = format!("{}/{}", collection(object, &t.ns), name_of(object));
            let _ = self
                .admin()
                .raw(Method::DELETE, &path, "application/json", Some(&options))
                .await;
        }
        let held = matches!(outcome, Outcome::Ran { seen, .. } if seen.iter().any(|(_, _, g)| !g.is_empty()));
        if held {
            let pods: Api<Pod> = Api::namespaced(self.env.client(), &t.ns);
            let selector = format!("{ATTEMPT}={}", attempt.name);
            let gone = wait_for(Duration::from_secs(90), || {
                let (pods, selector) = (pods.clone(), selector.clone());
                async move {
                    let list = pods
                        .list(&ListParams::default().labels(&selector))
                        .await
                        .ok()?;
                    list.items.is_empty().then_some(())
                }
            })
            .await;
            assert!(
                gone.is_some(),
                "{}: its pod outlived 90 s after deletion",
                attempt.name
            );
        }
        held
    }
}

fn denied(stage: String, r: &RawResponse) -> Outcome {
    Outcome::Denied {
        stage,
        message: format!("{} {}", r.status.as_u16(), r.message()),
    }
}

/// As cluster admin: an object the attempts need, created unless one of its name exists
/// (then used as it is), deleted after only if created here.
async fn cluster_object(env: &Env, path: &str, object: Value, gvk: (&str, &str, &str)) {
    let name = name_of(&object).to_owned();
    let admin = &env.cluster;
    let exists = admin
        .raw(
            Method::GET,
            &format!("{path}/{name}"),
            "application/json",
            None,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    if exists.status.is_success() {
        eprintln!(
            "{} {name} exists: used as it is",
            object["kind"].as_str().unwrap_or("")
        );
        return;
    }
    let r = admin
        .raw(Method::POST, path, "application/json", Some(&object))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        r.status.is_success(),
        "create {path}/{name}: {}",
        r.message()
    );
    let (group, version, kind) = gvk;
    env.cleanup.own(
        kube::api::ApiResource {
            group: group.into(),
            version: version.into(),
            api_version: format!("{group}/{version}"),
            kind: kind.into(),
            plural: path.rsplit('/').next().unwrap_or_default().into(),
        },
        None,
        &name,
    );
}

/// Creates `object` in `ns` as `cluster` (a dry run) until the API server refuses it: an
/// admission policy just bound is in force.
async fn until_refused(cluster: &Cluster, ns: &str, object: &Value, what: &str) {
    let path = format!("{}?dryRun=All", collection(object, ns));
    let mut last = None;
    for _ in 0..60 {
        let r = (cluster
            .raw(Method::POST, &path, "application/json", Some(object))
            .await)
            .unwrap_or_else(|e| panic!("{e}"));
        if r.status.is_client_error() {
            return;
        }
        last = Some(r.status);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("{what}: never refused {object}; last answer {last:?}");
}

/// The admission pieces of a way, bound to its namespace; waits until they are in force.
async fn admission(
    suite: &Suite<'_>,
    t: &Tenancy,
    map: Option<MutatingApi>,
    backstop: bool,
    webhook: Option<&LocalWebhook>,
) {
    let env = suite.env;
    let only = namespaces_named(&[&t.ns]);
    if let Some(api) = map {
        let default: Vec<&GpuPolicy> = suite.policies.iter().collect();
        env.cluster
            .install_mutating_policy(
                render(&default, |_| true, api),
                api,
                &env.name(t.way.suffix()),
                &[&t.ns],
                &env.cleanup,
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    if backstop {
        env.install_policy(
            "deploy/admission/backstop-policy.yaml",
            &format!("{}-backstop", t.way.suffix()),
            Some(only.clone()),
        )
        .await;
        env.install_policy(
            "deploy/admission/runtime-variables.yaml",
            &format!("{}-runtime-variables", t.way.suffix()),
            Some(only.clone()),
        )
        .await;
        let map = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "probe-guard"}, "data": {"NVIDIA_VISIBLE_DEVICES": "all"}});
        until_refused(&t.tenant, &t.ns, &map, "the ConfigMap guard").await;
        if suite.device_class.is_some() {
            env.install_policy(
                gpuwarden_crds::manifests::DRIVER_CLAIMS,
                &format!("{}-driver-claims", t.way.suffix()),
                Some(only.clone()),
            )
            .await;
            let claim = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": "probe-guard"},
                "spec": {"devices": {"requests": [{"name": "d", "exactly": {
                    "deviceClassName": gpuwarden_crds::claims::DEVICE_CLASS_CD_DAEMON}}]}}});
            until_refused(&t.tenant, &t.ns, &claim, "the claim guard").await;
        }
    }
    match (t.way, webhook) {
        (Way::Webhook, Some(webhook)) => {
            env.register_webhook(&webhook.url, &webhook.ca_pem, only, t.way.suffix())
                .await;
        }
        (Way::WebhookDown, _) => {
            env.register_unreachable_webhook(only, t.way.suffix()).await;
        }
        _ => {}
    }
    // In force: the image's variable is voided, and a leak (an unprivileged
    // NVIDIA_VISIBLE_DEVICES=all) is rewritten (1), refused by the backstop (2) or refused
    // by the dead webhook (3).
    let probe = |name: &str, env_all: bool| {
        let mut c = json!({"name": "main", "image": suite.image, "imagePullPolicy": "Never",
            "command": ["sh", "-c", "true"]});
        if env_all {
            c["env"] = json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]);
        }
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [c]}})
    };
    if map.is_some() || webhook.is_some() {
        until_admission(
            &t.tenant,
            &t.ns,
            &probe("probe-void", false),
            "the void rule",
            |r| {
                r.status.is_success()
                    && last_visible(&r.body["spec"]["containers"][0]).as_deref() == Some("void")
            },
        )
        .await;
    }
    let leak = probe("probe-leak", true);
    match t.way {
        Way::Webhook => {
            until_admission(&t.tenant, &t.ns, &leak, "the webhook", |r| {
                r.status.is_success()
                    && r.body["metadata"]["annotations"][gpuwarden_crds::ANNOTATION_REWRITTEN]
                        .is_string()
            })
            .await;
        }
        Way::ApiServer if backstop => {
            until_admission(&t.tenant, &t.ns, &leak, "the backstop", |r| {
                r.status.is_client_error()
            })
            .await;
        }
        Way::WebhookDown => {
            until_admission(&t.tenant, &t.ns, &leak, "the dead webhook", |r| {
                r.message().contains("failed calling webhook")
            })
            .await;
        }
        Way::ApiServer => {}
    }
}

/// Every door a tenant with `admin` can write, three ways; see the module docs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a node: this machine as a Ready node with 2 allocatable nvidia.com/gpu (NVIDIA's device plugin), root, ctr, busybox imported; KUBECONFIG=... cargo test -p gpuwarden-e2e --test tenant -- --ignored --nocapture --test-threads=1"]
async fn tenant_attacks_get_no_gpu_they_were_not_allocated_on_a_real_node() {
    let cluster = Cluster::connect().await.unwrap_or_else(|e| panic!("{e}"));
    let Some(node) = gpu_node(&cluster).await.unwrap_or_else(|e| panic!("{e}")) else {
        skip(TEST, NEEDS_GPU_NODE);
        return;
    };
    if let Some(why) = local_node_problem(&node, &["tar", "sha256sum"]) {
        skip(TEST, &why);
        return;
    }
    let socket = pod_resources_socket();
    if !socket.exists() {
        skip(
            TEST,
            &format!(
                "no kubelet pod-resources socket at {} (GPUWARDEN_E2E_POD_RESOURCES names it)",
                socket.display()
            ),
        );
        return;
    }
    let node = node["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    // Declared before the Env, dropped after its cleanup: the pods go before their image.
    let mut images = Images::default();
    let env = Env::new().await;
    let image = format!("localhost/gpuwarden-e2e/env-all:{}", env.cluster.run_id);
    import_image(&image, &mut images);

    let map = env.cluster.mutating_policy_api().await;
    let backstop = env
        .cluster
        .serves(
            "admissionregistration.k8s.io/v1",
            "validatingadmissionpolicies",
        )
        .await;
    if !backstop {
        skip(
            "the backstop",
            "the server does not serve admissionregistration.k8s.io/v1 validatingadmissionpolicies",
        );
    }
    cluster_object(
        &env,
        "/apis/node.k8s.io/v1/runtimeclasses",
        json!({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
            "metadata": {"name": "nvidia"}, "handler": "runc"}),
        ("node.k8s.io", "v1", "RuntimeClass"),
    )
    .await;
    let device_class = if env
        .cluster
        .serves("resource.k8s.io/v1", "deviceclasses")
        .await
    {
        let name = env.name("nic");
        // A DRA driver of another device on the node makes the claim's pod run (a NIC
        // driver, Kubernetes' dra-test-driver); with none, the pod is stored and waits.
        let on_node = devices_on(&env.cluster, &node)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let driver = match other_drivers(&on_node).into_iter().next() {
            Some(driver) => driver.to_owned(),
            None => {
                skip(
                    "resource-claim-nic on the node",
                    "no DRA driver of a non-GPU device publishes on the node: the claim's pod is judged as stored",
                );
                "nic.example.com".to_owned()
            }
        };
        cluster_object(
            &env,
            "/apis/resource.k8s.io/v1/deviceclasses",
            json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                "metadata": {"name": name},
                "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{driver}'")}}]}}),
            ("resource.k8s.io", "v1", "DeviceClass"),
        )
        .await;
        Some(name)
    } else {
        skip(
            "resource-claim-nic",
            "the server does not serve resource.k8s.io/v1 deviceclasses",
        );
        None
    };

    // The cluster's GpuPolicies, for the offline engine.
    let policies: Vec<GpuPolicy> = Api::<GpuPolicy>::all(env.client())
        .list(&ListParams::default())
        .await
        .expect("list GpuPolicies")
        .items;
    let work = tempfile::tempdir().expect("a temporary directory");
    let policies_file = work.path().join("policies.json");
    let items: Vec<Value> = (policies.iter())
        .map(|p| {
            let mut p = serde_json::to_value(p).expect("policy");
            if let Some(meta) = p["metadata"].as_object_mut() {
                meta.remove("managedFields");
            }
            p
        })
        .collect();
    let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
    std::fs::write(&policies_file, list.to_string()).expect("write the policies");
    let suite = Suite {
        env: &env,
        image,
        node,
        device_class,
        socket,
        policies_file,
        policies,
    };

    let mut rows = Vec::new();
    for way in [Way::Webhook, Way::ApiServer, Way::WebhookDown] {
        if way != Way::Webhook && map.is_none() {
            skip(
                &format!("{TEST} way {}", way.label()),
                "the server does not serve MutatingAdmissionPolicy",
            );
            continue;
        }
        let t = suite.tenancy(way).await;
        let webhook = match way {
            Way::Webhook => Some(env.started_webhook().await),
            _ => None,
        };
        admission(&suite, &t, map, backstop, webhook.as_ref()).await;
        eprintln!(
            "\nway {}: namespace {} (Pod Security baseline; default GpuPolicy, Enforce), as system:serviceaccount:{}:{TENANT}; MutatingAdmissionPolicy {}; backstop {}",
            way.label(),
            t.ns,
            t.ns,
            if map.is_some() { "bound" } else { "not served" },
            if backstop { "bound" } else { "not served" },
        );
        eprintln!("| attempt | way | outcome | offline engine (way 1) | time");
        rows.extend(suite.run_way(&t).await);
        if let Some(webhook) = webhook {
            webhook.stop().await;
        }
    }

    eprintln!("\nSUMMARY: {} attempt runs", rows.len());
    for row in &rows {
        eprintln!("{}", row.line());
    }
    let failures: Vec<String> = (rows.iter())
        .filter(|r| !r.problems.is_empty())
        .map(|r| {
            format!(
                "{} ({}): {}",
                r.attempt,
                r.way.label(),
                r.problems.join("; ")
            )
        })
        .collect();
    let held = rows.len() - failures.len();
    let denied = (rows.iter())
        .filter(|r| r.problems.is_empty() && r.outcome.starts_with("denied"))
        .count();
    eprintln!(
        "{held} held ({denied} denied, {} ran or stored with exactly their GPUs), {} failed",
        held - denied,
        failures.len()
    );
    env.cleanup.run().await;
    drop(images);
    assert!(
        failures.is_empty(),
        "attempts that reach GPUs they were not allocated, or where the engine disagrees:\n{}",
        failures.join("\n")
    );
}

#[test]
fn a_stored_pod_is_read_as_the_nvidia_runtime_would_read_it() {
    let image = "localhost/env-all";
    let pod = json!({
        "metadata": {"annotations": {"cdi.k8s.io/gpus": "nvidia.com/gpu=all",
            "cdi.k8s.io/nic": "example.com/nic=a"}},
        "spec": {
            "volumes": [{"name": "dev", "hostPath": {"path": "/dev/nvidia0"}},
                {"name": "list", "emptyDir": {}}],
            "initContainers": [{"name": "init", "image": image}],
            "containers": [
                {"name": "voided", "image": image, "env": [
                    {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                    {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]},
                {"name": "gpu", "image": image, "resources": {"limits": {"nvidia.com/gpu": "1"}}},
                {"name": "over", "image": image, "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]},
                {"name": "from", "image": "busybox", "env": [{"name": "NVIDIA_VISIBLE_DEVICES",
                    "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]},
                {"name": "mig", "image": "busybox",
                    "env": [{"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"}]},
                {"name": "mounts", "image": "busybox", "securityContext": {"privileged": true},
                    "volumeMounts": [{"name": "dev", "mountPath": "/dev/nvidia0"},
                        {"name": "list", "mountPath": "/var/run/nvidia-container-devices/all"}]},
            ]
        }
    });
    assert_eq!(
        stored_gives(&pod, image),
        [
            "CDI annotation cdi.k8s.io/gpus: nvidia.com/gpu=all",
            "init: no NVIDIA_VISIBLE_DEVICES entry: the image's NVIDIA_VISIBLE_DEVICES=all is in force",
            "over: NVIDIA_VISIBLE_DEVICES=none beside a GPU limit overrides the allocation",
            "from: NVIDIA_VISIBLE_DEVICES=(valueFrom)",
            "mig: NVIDIA_MIG_MONITOR_DEVICES set",
            "mounts: privileged",
            "mounts: device hostPath /dev/nvidia0",
            "mounts: device-list mount /var/run/nvidia-container-devices/all",
        ]
    );
}

#[test]
fn stored_and_offline_containers_compare_as_the_api_server_defaults_them() {
    let submitted = json!({"spec": {"containers": [{"name": "main", "env": [],
        "resources": {"limits": {"nvidia.com/gpu": "1"}}, "securityContext": {}}]}});
    let stored = json!({"spec": {"containers": [{"name": "main", "image": "x",
        "resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1"}}}]}});
    assert_eq!(judged_fields(&submitted), judged_fields(&stored));
    let voided = json!({"spec": {"containers": [{"name": "main",
        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
        "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}});
    assert_ne!(judged_fields(&voided), judged_fields(&stored));
}
