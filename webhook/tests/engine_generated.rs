//! Generated tests: thousands of varied pods under varied policies, each checked against the
//! engine's invariants (docs/design.md, "Invariants"). Seeded, so a failure names
//! the seed and case that reproduce it.

mod engine_support;

use std::collections::{BTreeMap, BTreeSet};

use engine_support::*;
use gpuwarden_crds::{GpuPolicy, PolicyMode, PrivilegedMatch, RequestAs, VisibleDevicesAll};
use gpuwarden_webhook::admission::{Outcome, StaticSource};
use gpuwarden_webhook::engine::{
    ClaimSource, ClaimStore, Input, Operation, Requester, Verdict, decide,
    namespace_labels_or_default,
};
use gpuwarden_webhook::patch::patch_for;
use gpuwarden_webhook::pod::PodView;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Map, Value, json};
use std::sync::Arc;

const CASES: usize = 2000;

const NAMESPACES: &[&str] = &[
    "ml",
    "research",
    "prod",
    "kube-system",
    "gpu-operator",
    "batch",
];
const SERVICE_ACCOUNTS: &[&str] = &["default", "trainer", "dcgm", ""];
const IMAGES: &[&str] = &[
    "nvcr.io/nvidia/pytorch:24.05-py3",
    "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04",
    "nvcr.io/nvidia/k8s/dcgm-exporter:3.3.5-3.4.0-ubuntu22.04",
    "nvcr.io/nvidia/k8s-device-plugin:v0.15.0",
    "registry.example.com/team/trainer",
    "busybox",
    "fluent/fluent-bit:3.0@sha256:0123456789abcdef",
    "ghcr.io/example/sidecar:1.2",
    "registry.example.com/team/tools@sha256:eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee",
];
const VISIBLE: &[&str] = &[
    "all",
    "none",
    "void",
    "",
    "0",
    "0,1",
    "1,2,3",
    " 0 , 1 ",
    "ALL",
    "GPU-8f2c3b1a-1111-2222-3333-444455556666",
    "MIG-2a3b4c5d-aaaa-bbbb-cccc-ddddeeeeffff,MIG-GPU-8f2c3b1a-1111-2222-3333-444455556666/1/0",
    "0,1,2,3,4,5,6,7,8,9",
    " NONE ",
    "Void",
    " , ",
];
const HOST_PATHS: &[&str] = &[
    "/dev/nvidia0",
    "/dev/nvidiactl",
    "/dev/dri",
    "/dev/dri/card1",
    "/dev/shm",
    "/var/log",
    "/dev//nvidia1/",
    "/dev/./nvidia0",
];
/// Host devices an unprivileged container cannot open (and the whole `/dev`), which a
/// de-privileged container must not be left mounting: picked less often, since a pod with one
/// is denied.
const HOST_DEVICE_PATHS: &[&str] = &[
    "/dev",
    "/dev/",
    "/dev/fuse",
    "/dev/kvm",
    "/dev/nvidia0/../fuse",
    "/dev/infiniband",
    "/dev/infiniband/uverbs0",
    "/dev//infiniband/",
    "/dev/net",
    "/dev/vfio/12",
];
/// Device plugin resources that hand a container the host devices above.
const DEVICE_RESOURCES: &[&str] = &[
    "rdma/rdma_shared_device_a",
    "rdma/hca",
    "devices.kubevirt.io/kvm",
    "nvidia.com/GH100_H100_PCIE",
];
const CAPS: &[&str] = &[
    "SYS_ADMIN",
    "IPC_LOCK",
    "CAP_SYS_NICE",
    "NET_ADMIN",
    "SYS_PTRACE",
    "sys_resource",
    "ALL",
];
const GPU_RESOURCES: &[&str] = &[
    "nvidia.com/gpu",
    "nvidia.com/mig-1g.10gb",
    "nvidia.com/gpu.shared",
    "example.com/accelerator",
    // Passthrough GPUs of NVIDIA's sandbox device plugin.
    "nvidia.com/GH100_H100_PCIE",
    "nvidia.com/pgpu",
];

const DEVICE_LIST_PATHS: &[&str] = &[
    "/var/run/nvidia-container-devices/all",
    "/var/run/nvidia-container-devices/0",
    "/var/run/nvidia-container-devices/GPU-8f2c3b1a",
    "/var/run/nvidia-container-devices",
    "/var/run/./nvidia-container-devices/1/",
    "/var/run/nvidia-container-devices-x/0",
    "/run/nvidia-container-devices/0",
];

fn pick<'a>(rng: &mut StdRng, items: &'a [&'a str]) -> &'a str {
    items.choose(rng).copied().unwrap_or_default()
}

fn gen_container(rng: &mut StdRng, name: &str, volumes: &[String]) -> Value {
    let mut c = Map::new();
    c.insert("name".into(), json!(name));
    c.insert("image".into(), json!(pick(rng, IMAGES)));
    if rng.random_bool(0.3) {
        c.insert("command".into(), json!(["sh", "-c", "sleep infinity"]));
    }
    // Environment.
    if rng.random_bool(0.8) {
        let mut env = Vec::new();
        if rng.random_bool(0.5) {
            env.push(json!({"name": "HOME", "value": "/root"}));
        }
        let n = rng.random_range(0..3);
        for _ in 0..n {
            env.push(json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": pick(rng, VISIBLE)}));
        }
        if rng.random_bool(0.1) {
            env.push(json!({"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"configMapKeyRef": {"name": "gpus", "key": "ids"}}}));
        }
        if rng.random_bool(0.2) {
            env.push(json!({"name": "NVIDIA_DRIVER_CAPABILITIES", "value": pick(rng, &["all", "compute,utility", "graphics"])}));
        }
        if rng.random_bool(0.15) {
            env.push(json!({"name": pick(rng, &["NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_MIG_MONITOR_DEVICES"]), "value": "all"}));
        }
        if rng.random_bool(0.3) {
            env.push(json!({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}));
        }
        c.insert("env".into(), Value::Array(env));
    }
    if rng.random_bool(0.1) {
        c.insert(
            "envFrom".into(),
            json!([{"configMapRef": {"name": "app-env"}}]),
        );
    }
    // Resources.
    match rng.random_range(0..7) {
        0 => {}
        1 => {
            c.insert(
                "resources".into(),
                json!({"requests": {"cpu": "1", "memory": "2Gi"}}),
            );
        }
        2 => {
            c.insert(
                "resources".into(),
                json!({"limits": {pick(rng, GPU_RESOURCES): rng.random_range(1..4).to_string()}}),
            );
        }
        3 => {
            c.insert(
                "resources".into(),
                json!({"limits": {"memory": "8Gi"}, "requests": {"cpu": "2"}}),
            );
        }
        4 => {
            c.insert(
                "resources".into(),
                json!({"requests": {"nvidia.com/gpu": 2}}),
            );
        }
        5 if rng.random_bool(0.5) => {
            c.insert(
                "resources".into(),
                json!({"limits": {pick(rng, DEVICE_RESOURCES): 1}}),
            );
        }
        _ => {
            c.insert("resources".into(), json!({}));
        }
    }
    // Security context.
    let privileged = rng.random_bool(0.6);
    match rng.random_range(0..5) {
        0 if !privileged => {}
        _ => {
            let mut sc = Map::new();
            sc.insert("privileged".into(), json!(privileged));
            if rng.random_bool(0.3) {
                sc.insert("runAsUser".into(), json!(1000));
            }
            if rng.random_bool(0.2) {
                sc.insert("allowPrivilegeEscalation".into(), json!(true));
            }
            if rng.random_bool(0.4) {
                let n = rng.random_range(0..4);
                let add: Vec<&str> = (0..n).map(|_| pick(rng, CAPS)).collect();
                let mut caps = json!({"add": add});
                if rng.random_bool(0.3) {
                    caps["drop"] = json!(["NET_RAW"]);
                }
                sc.insert("capabilities".into(), caps);
            }
            c.insert("securityContext".into(), Value::Object(sc));
        }
    }
    // Mounts.
    let mut mounts = Vec::new();
    for v in volumes {
        if rng.random_bool(0.35) {
            mounts.push(json!({"name": v, "mountPath": format!("/mnt/{v}")}));
        }
        // The toolkit's device-list mounts, from any volume, and look-alikes.
        if rng.random_bool(0.1) {
            mounts.push(json!({"name": v, "mountPath": pick(rng, DEVICE_LIST_PATHS)}));
        }
    }
    if !mounts.is_empty() {
        c.insert("volumeMounts".into(), Value::Array(mounts));
    }
    Value::Object(c)
}

fn gen_pod(rng: &mut StdRng, case: usize) -> (Value, String) {
    let namespace = pick(rng, NAMESPACES).to_owned();
    let mut volumes = Vec::new();
    let mut volume_names = Vec::new();
    for i in 0..rng.random_range(0..4) {
        let name = format!("vol{i}");
        if rng.random_bool(0.07) {
            volumes.push(json!({"name": name, "hostPath": {"path": pick(rng, HOST_DEVICE_PATHS)}}));
        } else if rng.random_bool(0.7) {
            volumes.push(json!({"name": name, "hostPath": {"path": pick(rng, HOST_PATHS)}}));
        } else {
            volumes.push(json!({"name": name, "emptyDir": {}}));
        }
        volume_names.push(name);
    }
    let containers: Vec<Value> = (0..rng.random_range(1..4))
        .map(|i| gen_container(rng, &format!("main-{i}"), &volume_names))
        .collect();
    let mut spec = Map::new();
    spec.insert("containers".into(), Value::Array(containers));
    if rng.random_bool(0.3) {
        let init: Vec<Value> = (0..rng.random_range(1..3))
            .map(|i| {
                let mut c = gen_container(rng, &format!("init-{i}"), &volume_names);
                // Some are sidecars, which run beside the regular containers.
                if rng.random_bool(0.3) {
                    c["restartPolicy"] = json!("Always");
                }
                c
            })
            .collect();
        spec.insert("initContainers".into(), Value::Array(init));
    }
    if !volumes.is_empty() {
        spec.insert("volumes".into(), Value::Array(volumes));
    }
    let sa = pick(rng, SERVICE_ACCOUNTS);
    if !sa.is_empty() {
        spec.insert("serviceAccountName".into(), json!(sa));
    }
    spec.insert("restartPolicy".into(), json!("Never"));
    if rng.random_bool(0.2) {
        spec.insert(
            "nodeSelector".into(),
            json!({"nvidia.com/gpu.present": "true"}),
        );
    }
    let mut metadata = Map::new();
    metadata.insert("name".into(), json!(format!("pod-{case}")));
    metadata.insert("namespace".into(), json!(namespace));
    metadata.insert(
        "labels".into(),
        json!({"app": pick(rng, &["train", "serve", "debug"])}),
    );
    let mut annotations = Map::new();
    if rng.random_bool(0.03) {
        // The prefix the NVIDIA runtime reads where the GPU Operator enables CDI.
        annotations.insert(
            "nvidia.cdi.k8s.io/container.main-0".into(),
            json!("management.nvidia.com/gpu=all"),
        );
    }
    if rng.random_bool(0.15) {
        annotations.insert(
            "cdi.k8s.io/gpu".into(),
            json!(pick(
                rng,
                &[
                    "nvidia.com/gpu=all",
                    "nvidia.com/gpu=0",
                    "example.com/fpga=1",
                    "nvidia.com/pgpu=0",
                    "nvidia.com/pgpu=0,nvidia.com/gpu=1",
                ]
            )),
        );
    }
    if rng.random_bool(0.15) {
        annotations.insert(
            "gpuwarden.io/gpu-count".into(),
            json!(pick(rng, &["1", "2", "3", "8", "16", "0", "x"])),
        );
    }
    if rng.random_bool(0.1) {
        annotations.insert("gpuwarden.io/gpu-count.main-0".into(), json!("3"));
    }
    if rng.random_bool(0.3) {
        annotations.insert("team".into(), json!("vision"));
    }
    if !annotations.is_empty() || rng.random_bool(0.5) {
        metadata.insert("annotations".into(), Value::Object(annotations));
    }
    // Some pods are a DaemonSet's, which runs them on every node.
    if rng.random_bool(0.15) {
        metadata.insert(
            "ownerReferences".into(),
            json!([{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "agent", "uid": "u", "controller": true}]),
        );
    }
    let mut pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec});
    // Some pods hold a passthrough GPU for a Kata VM, named by a CDI annotation too; others
    // ask for one outside any VM, which only KubeVirt may do.
    if rng.random_bool(0.05) {
        pod["metadata"]["annotations"]["cdi.k8s.io/gpu"] = json!("nvidia.com/pgpu=0");
        pod["spec"]["containers"][0]["resources"] =
            json!({"limits": {"nvidia.com/GH100_H100_PCIE": 1}});
        pod["spec"]["runtimeClassName"] = json!("kata-qemu-nvidia-gpu");
    } else if rng.random_bool(0.03) {
        let vm_device = pick(rng, &["nvidia.com/GRID_T4-1Q", "nvidia.com/GA102GL_A10"]);
        pod["spec"]["containers"][0]["resources"] = json!({"limits": {vm_device: 1}});
    }
    // Some pods have two privileged containers naming the same GPUs, which share them.
    if rng.random_bool(0.2) {
        let same = pick(rng, &["0,1", "all", "2"]);
        for c in pod["spec"]["containers"]
            .as_array_mut()
            .into_iter()
            .flatten()
            .take(2)
        {
            c["securityContext"]["privileged"] = json!(true);
            let entry = json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": same});
            match c["env"].as_array_mut() {
                Some(env) => env.push(entry),
                None => c["env"] = json!([entry]),
            }
        }
    }
    // Some pods have DRA claims: a GPU claim from a template and a NIC claim, which some of
    // their containers use.
    if rng.random_bool(0.2) {
        pod["spec"]["resourceClaims"] = json!([
            {"name": "dra", "resourceClaimTemplateName": "dra-gpu"},
            {"name": "nic", "resourceClaimName": "nic"}
        ]);
        for field in ["initContainers", "containers"] {
            for c in pod["spec"][field].as_array_mut().into_iter().flatten() {
                let uses: &[&str] = pick_claims(rng);
                if !uses.is_empty() {
                    let entries: Vec<Value> = uses.iter().map(|n| json!({"name": n})).collect();
                    c["resources"]["claims"] = Value::Array(entries);
                }
            }
        }
    }
    (pod, namespace)
}

/// Which of the pod's claims a container uses.
fn pick_claims(rng: &mut StdRng) -> &'static [&'static str] {
    [&[][..], &[], &["dra"], &["nic"], &["nic", "dra"]]
        .choose(rng)
        .copied()
        .unwrap_or(&[])
}

/// The claims every generated pod may meet: in every namespace a GPU template `dra-gpu` and
/// a NIC claim `nic`; and gpuwarden's templates everywhere but in `batch`, where the
/// `ResourceClaim` rewrite is denied for want of them.
fn claim_store(policy: &GpuPolicy) -> ClaimStore {
    let spec = |class: &str| {
        serde_json::from_value(json!({"devices": {"requests": [
            {"name": "r", "exactly": {"deviceClassName": class}}
        ]}}))
        .unwrap()
    };
    let mut store = ClaimStore::new();
    for namespace in NAMESPACES {
        store.insert(
            ClaimSource::Template,
            namespace,
            "dra-gpu",
            &spec("gpu.nvidia.com"),
        );
        store.insert(
            ClaimSource::Claim,
            namespace,
            "nic",
            &spec("nic.example.com"),
        );
        if *namespace == "batch" {
            continue;
        }
        let class = &policy.spec.gpu.device_class_name;
        for n in 1..=64 {
            let name = gpuwarden_crds::claims::template_name(class, n);
            store.insert(ClaimSource::Template, namespace, &name, &spec(class));
        }
    }
    store
}

/// The GPUs of gpuwarden's claims in a pod's `resourceClaims`, by the count its template
/// names.
fn claimed_gpus(pod: &Value) -> u32 {
    (pod["spec"]["resourceClaims"]
        .as_array()
        .into_iter()
        .flatten())
    .filter_map(|c| c["resourceClaimTemplateName"].as_str())
    .filter_map(|t| {
        t.strip_prefix("gpuwarden-")?
            .rsplit_once('-')?
            .1
            .parse::<u32>()
            .ok()
    })
    .sum()
}

/// Whether the container uses the pod's GPU claim `dra`.
fn oracle_gpu_claim(c: &Value, pod: &Value) -> bool {
    let entry = (pod["spec"]["resourceClaims"]
        .as_array()
        .into_iter()
        .flatten())
    .any(|e| e["name"] == "dra" && e["resourceClaimTemplateName"] == "dra-gpu");
    entry && (c["resources"]["claims"].as_array().into_iter().flatten()).any(|u| u["name"] == "dra")
}

fn gen_policy(rng: &mut StdRng) -> GpuPolicy {
    let mut p = default_policy();
    p.spec.mode = *[
        PolicyMode::Enforce,
        PolicyMode::Enforce,
        PolicyMode::Audit,
        PolicyMode::Deny,
    ]
    .choose(rng)
    .unwrap_or(&PolicyMode::Enforce);
    if rng.random_bool(0.2) {
        p.spec.match_.privileged_containers = PrivilegedMatch::All;
    }
    if rng.random_bool(0.2) {
        p.spec.gpu.visible_devices_all = VisibleDevicesAll::Deny;
    }
    if rng.random_bool(0.2) {
        p.spec.gpu.resource_name = "example.com/accelerator".into();
    }
    p.spec.gpu.default_count = rng.random_range(1..3);
    p.spec.gpu.max_per_container = rng.random_range(2..9);
    p.spec.gpu.max_per_pod = rng.random_range(2..12);
    if rng.random_bool(0.5) {
        p.spec.gpu.env_from = gpuwarden_crds::EnvFromGpu::Warn;
    }
    p.spec.capabilities.drop_all = rng.random_bool(0.8);
    if rng.random_bool(0.3) {
        p.spec.capabilities.default = vec!["SYS_PTRACE".into()];
    }
    if rng.random_bool(0.2) {
        p.spec.driver_capabilities = vec!["compute".into(), "utility".into(), "video".into()];
    }
    p.spec.strip_device_host_paths = rng.random_bool(0.8);
    p.spec.strip_cdi_annotations = rng.random_bool(0.8);
    if rng.random_bool(0.3) {
        p.spec.exemptions.service_accounts = vec!["ml/dcgm".into(), "batch/trainer".into()];
    }
    if rng.random_bool(0.3) {
        // A scoped image exemption: in one namespace, for one service account, or pinned.
        let mut entry = gpuwarden_crds::ContainerExemption {
            images: vec!["registry.example.com/team/*".into()],
            ..Default::default()
        };
        match rng.random_range(0..3) {
            0 => entry.namespaces = vec!["ml".into()],
            1 => entry.service_accounts = vec!["batch/trainer".into(), "ml/dcgm".into()],
            _ => {
                entry.namespaces = vec!["ml".into(), "research".into()];
                entry.digests = vec![format!("sha256:{}", "e".repeat(64))];
            }
        }
        p.spec.exemptions.containers.push(entry);
    }
    p
}

fn containers_of(pod: &Value) -> impl Iterator<Item = &Value> {
    ["initContainers", "containers", "ephemeralContainers"]
        .into_iter()
        .flat_map(move |f| pod["spec"][f].as_array().into_iter().flatten())
}

/// The oracle's device path (docs/design.md, "The GPU predicate"), written apart from the
/// predicate's: the path resolved part by part, then `/dev`, `/dev/nvidia*`, `/dev/dri` or
/// under `/dev/dri/`.
fn oracle_device_path(path: &str) -> bool {
    match oracle_parts(path).as_slice() {
        ["dev"] | ["dev", "dri", ..] => true,
        ["dev", device] => device.starts_with("nvidia"),
        ["dev", first, ..] => first.starts_with("nvidia"),
        _ => false,
    }
}

/// The oracle's container exemption: an entry of `exemptions.containers` whose namespaces
/// (when listed) hold the pod's, whose service accounts (when listed) hold the pod's,
/// whose digests (when listed) pin the image, and one of whose patterns matches it; an
/// entry that names neither namespaces nor service accounts exempts nothing.
fn oracle_container_exempt(c: &Value, pod: &Value, namespace: &str, policy: &GpuPolicy) -> bool {
    let image = c["image"].as_str().unwrap_or("");
    let sa = pod["spec"]["serviceAccountName"]
        .as_str()
        .filter(|s| !s.is_empty())
        .unwrap_or("default");
    policy.spec.exemptions.containers.iter().any(|x| {
        (!x.namespaces.is_empty() || !x.service_accounts.is_empty())
            && (x.namespaces.is_empty() || x.namespaces.iter().any(|n| n == namespace))
            && (x.service_accounts.is_empty()
                || x.service_accounts.contains(&format!("{namespace}/{sa}")))
            && (x.digests.is_empty() || x.digests.iter().any(|d| image.ends_with(&format!("@{d}"))))
            && oracle_image_exempt(image, &x.images)
    })
}

/// The oracle's image exemption: `*` any run of characters, `?` one, the rest literal; an
/// image with neither tag nor digest is also tried as `<image>:latest`.
fn oracle_image_exempt(image: &str, patterns: &[String]) -> bool {
    fn glob(pattern: &[char], text: &[char]) -> bool {
        match pattern.split_first() {
            None => text.is_empty(),
            Some(('*', rest)) => (0..=text.len()).any(|i| glob(rest, &text[i..])),
            Some(('?', rest)) => !text.is_empty() && glob(rest, &text[1..]),
            Some((c, rest)) => text.first() == Some(c) && glob(rest, &text[1..]),
        }
    }
    if image.is_empty() {
        return false;
    }
    let untagged = !image.rsplit('/').next().unwrap_or("").contains(':') && !image.contains('@');
    let latest = format!("{image}:latest");
    patterns.iter().any(|p| {
        let p: Vec<char> = p.chars().collect();
        let chars = |s: &str| s.chars().collect::<Vec<char>>();
        glob(&p, &chars(image)) || (untagged && glob(&p, &chars(&latest)))
    })
}

/// An independent reading of "privileged GPU container" (docs/design.md), for the Enforce
/// check.
fn privileged_gpu_containers(pod: &Value, namespace: &str, policy: &GpuPolicy) -> Vec<String> {
    let device_volumes: BTreeSet<&str> = pod["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| {
            v["hostPath"]["path"]
                .as_str()
                .is_some_and(oracle_device_path)
        })
        .filter_map(|v| v["name"].as_str())
        .collect();
    let cdi = oracle_cdi(pod);
    containers_of(pod)
        .filter(|c| c["securityContext"]["privileged"] == json!(true))
        .filter(|c| !oracle_container_exempt(c, pod, namespace, policy))
        .filter(|c| {
            let resource = |r: &Value| {
                r.as_object().is_some_and(|m| {
                    m.keys().any(|k| {
                        k.starts_with("nvidia.com/") || *k == policy.spec.gpu.resource_name
                    })
                })
            };
            // The last entry of a duplicated name wins, as in the kubelet. Without one, `All`
            // counts the container; with one, its value decides.
            // In a pod that holds a passthrough GPU the variable is read inside its VM only.
            let all = policy.spec.match_.privileged_containers == PrivilegedMatch::All;
            let env = c["env"]
                .as_array()
                .filter(|_| !oracle_holds_passthrough(pod))
                .map(|a| a.as_slice())
                .unwrap_or_default()
                .iter()
                .rev()
                .find(|e| e["name"] == "NVIDIA_VISIBLE_DEVICES")
                .map_or(all, |e| match e["value"].as_str() {
                    // Devices named: not none/void, and some entry between the commas.
                    Some(v) => {
                        let v = v.trim().to_ascii_lowercase();
                        v != "none" && v != "void" && v.split(',').any(|d| !d.trim().is_empty())
                    }
                    None => e.get("valueFrom").is_some(),
                });
            // envFrom may set NVIDIA_VISIBLE_DEVICES unless an env entry overrides it.
            let env_from = c["envFrom"].as_array().is_some_and(|e| !e.is_empty())
                && !(c["env"].as_array().into_iter().flatten())
                    .any(|e| e["name"] == "NVIDIA_VISIBLE_DEVICES");
            let mounts = c["volumeMounts"].as_array().into_iter().flatten().any(|m| {
                m["name"]
                    .as_str()
                    .is_some_and(|n| device_volumes.contains(n))
            });
            resource(&c["resources"]["limits"])
                || resource(&c["resources"]["requests"])
                || oracle_gpu_claim(c, pod)
                || env
                || env_from
                || mounts
                || cdi
        })
        .map(|c| c["name"].as_str().unwrap_or("").to_owned())
        .collect()
}

/// The GPUs a pod holds at once, by its GPU limits: its regular and sidecar containers
/// together, or its largest init container, whichever is more.
fn pod_gpus(pod: &Value, policy: &GpuPolicy) -> u32 {
    let gpus = |c: &Value| -> u32 {
        (c["resources"]["limits"].as_object().into_iter().flatten())
            .filter(|(k, _)| k.starts_with("nvidia.com/") || **k == policy.spec.gpu.resource_name)
            .filter_map(|(_, v)| match v {
                Value::String(s) => s.trim().parse::<u32>().ok(),
                v => v.as_u64().map(|n| n as u32),
            })
            .sum()
    };
    let list = |field: &str| pod["spec"][field].as_array().cloned().unwrap_or_default();
    let running: u32 = list("containers").iter().map(gpus).sum::<u32>()
        + (list("initContainers").iter())
            .filter(|c| c["restartPolicy"] == "Always")
            .map(gpus)
            .sum::<u32>();
    let init = (list("initContainers").iter())
        .filter(|c| c["restartPolicy"] != "Always")
        .map(gpus)
        .max()
        .unwrap_or(0);
    // Claims are held from the pod's start to its end.
    running.max(init) + claimed_gpus(pod)
}

/// Whether the pod carries a `cdi.k8s.io/*` annotation naming an NVIDIA device, other than
/// one naming only the passthrough GPUs (`nvidia.com/pgpu=`) of a pod that holds one.
fn oracle_cdi(pod: &Value) -> bool {
    pod["metadata"]["annotations"].as_object().is_some_and(|a| {
        a.iter().any(|(k, v)| {
            (k.starts_with("cdi.k8s.io/") || k.starts_with("nvidia.cdi.k8s.io/"))
                && v.as_str().is_some_and(|v| {
                    v.contains("nvidia.com/")
                        && !(oracle_holds_passthrough(pod)
                            && v.split(',').all(|d| d.starts_with("nvidia.com/pgpu=")))
                })
        })
    })
}

/// Whether a resource is a passthrough GPU of NVIDIA's sandbox device plugin: `pgpu`, or
/// a device name in capitals.
fn oracle_passthrough(resource: &str) -> bool {
    resource == "nvidia.com/pgpu"
        || resource
            .strip_prefix("nvidia.com/")
            .and_then(|r| r.chars().next())
            .is_some_and(|c| c.is_ascii_uppercase())
}

/// Whether a container asks for one of the resources `matches` accepts.
fn oracle_asks(c: &Value, matches: impl Fn(&str) -> bool) -> bool {
    ["limits", "requests"].iter().any(|what| {
        (c["resources"][what].as_object().into_iter().flatten()).any(|(k, _)| matches(k))
    })
}

/// Whether the pod says how many GPUs the container gets itself: a GPU request, a count
/// annotation, the IDs its last `NVIDIA_VISIBLE_DEVICES` names, or the devices its
/// device-list mounts name (not `all`, which the toolkit reads first).
fn oracle_asked_count(c: &Value, pod: &Value) -> bool {
    let annotations = &pod["metadata"]["annotations"];
    let name = c["name"].as_str().unwrap_or("");
    if annotations.get("gpuwarden.io/gpu-count").is_some()
        || annotations
            .get(format!("gpuwarden.io/gpu-count.{name}"))
            .is_some()
        || oracle_asks(c, |r| r.starts_with("nvidia.com/"))
    {
        return true;
    }
    let lists: Vec<Vec<&str>> = (c["volumeMounts"].as_array().into_iter().flatten())
        .filter_map(|m| m["mountPath"].as_str())
        .filter(|p| oracle_device_list_path(p))
        .map(oracle_parts)
        .collect();
    if !lists.is_empty() {
        return lists
            .iter()
            .all(|parts| parts.get(3).is_some_and(|d| !d.eq_ignore_ascii_case("all")));
    }
    let env = c["env"].as_array().map(Vec::as_slice).unwrap_or_default();
    (env.iter().rev())
        .find(|e| e["name"] == "NVIDIA_VISIBLE_DEVICES")
        .and_then(|e| e["value"].as_str())
        .is_some_and(|v| {
            let v = v.trim().to_ascii_lowercase();
            !["none", "void", "all"].contains(&v.as_str())
                && v.split(',').any(|d| !d.trim().is_empty())
        })
}

/// Whether an init or regular container of the pod holds a passthrough GPU.
fn oracle_holds_passthrough(pod: &Value) -> bool {
    ["initContainers", "containers"].iter().any(|f| {
        (pod["spec"][f].as_array().into_iter().flatten())
            .any(|c| oracle_asks(c, oracle_passthrough))
    })
}

/// The host devices a container mounts that it could not open without privilege and that no
/// device plugin resource it asks for hands over: `/dev/infiniband`, `/dev/vfio`,
/// `/dev/kvm`, `/dev/net/tun`, `/dev/vhost-net`, `/dev/fuse`, paths under them, and
/// directories holding them; the RDMA resources are those of the default `rdmaResources`.
fn oracle_unopenable_mounts(c: &Value, pod: &Value) -> Vec<String> {
    /// A device's path parts, and the resources that hand it over.
    type Device = (&'static [&'static str], fn(&str) -> bool);
    const DEVICES: &[Device] = &[
        (&["dev", "infiniband"], |r| r.starts_with("rdma/")),
        (&["dev", "vfio"], oracle_passthrough),
        (&["dev", "kvm"], |r| r == "devices.kubevirt.io/kvm"),
        (&["dev", "net", "tun"], |r| r == "devices.kubevirt.io/tun"),
        (&["dev", "vhost-net"], |r| {
            r == "devices.kubevirt.io/vhost-net"
        }),
        (&["dev", "fuse"], |_| false),
    ];
    let volumes = pod["spec"]["volumes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut found = Vec::new();
    for m in c["volumeMounts"].as_array().into_iter().flatten() {
        let Some(path) = (volumes.iter().rev())
            .find(|v| v["name"] == m["name"])
            .and_then(|v| v["hostPath"]["path"].as_str())
        else {
            continue;
        };
        let parts = oracle_parts(path);
        for (device, provided) in DEVICES {
            let under = parts.starts_with(device);
            let above =
                !parts.is_empty() && device.starts_with(&parts) && parts.len() < device.len();
            if (under && !oracle_asks(c, provided)) || above {
                found.push(path.to_owned());
            }
        }
    }
    found
}

/// The oracle's path resolution: the parts of an absolute path after `.`, `..` and empty
/// parts are resolved, as the kubelet would.
fn oracle_parts(path: &str) -> Vec<&str> {
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            part => parts.push(part),
        }
    }
    parts
}

/// Whether a mount path is where the toolkit reads a device list: at or under
/// `/var/run/nvidia-container-devices`, once resolved part by part.
fn oracle_device_list_path(path: &str) -> bool {
    oracle_parts(path).starts_with(&["var", "run", "nvidia-container-devices"])
}

/// The containers that reach GPUs around the kubelet whatever their privilege (a leak):
/// `NVIDIA_VISIBLE_DEVICES` naming devices or set from elsewhere, a MIG access variable, a
/// device-list mount, or an NVIDIA CDI annotation the policy strips; image exemptions hold.
fn leaking_containers(pod: &Value, namespace: &str, policy: &GpuPolicy) -> Vec<String> {
    let cdi = policy.spec.strip_cdi_annotations && oracle_cdi(pod);
    // In a pod that holds a passthrough GPU the variables are read inside its VM only.
    let passthrough = oracle_holds_passthrough(pod);
    containers_of(pod)
        .filter(|c| !oracle_container_exempt(c, pod, namespace, policy))
        .filter(|c| {
            let env = (c["env"].as_array().filter(|_| !passthrough))
                .map(Vec::as_slice)
                .unwrap_or_default();
            let visible = (env.iter().rev())
                .find(|e| e["name"] == "NVIDIA_VISIBLE_DEVICES")
                .is_some_and(|e| match e["value"].as_str() {
                    Some(v) => {
                        let v = v.trim().to_ascii_lowercase();
                        v != "none" && v != "void" && v.split(',').any(|d| !d.trim().is_empty())
                    }
                    None => e.get("valueFrom").is_some(),
                });
            let mig = env.iter().any(|e| {
                e["name"] == "NVIDIA_MIG_CONFIG_DEVICES"
                    || e["name"] == "NVIDIA_MIG_MONITOR_DEVICES"
            });
            let list = (c["volumeMounts"].as_array().into_iter().flatten())
                .any(|m| m["mountPath"].as_str().is_some_and(oracle_device_list_path));
            visible || mig || list || cdi
        })
        .map(|c| c["name"].as_str().unwrap_or("").to_owned())
        .collect()
}

/// `pod` with every field the engine may change taken out, and empty objects pruned, so two
/// pods that differ only in those fields compare equal.
fn without_allowed_fields(
    pod: &Value,
    device_volumes: &BTreeSet<String>,
    gpu_resource: &str,
) -> Value {
    let mut pod = pod.clone();
    if let Some(a) = pod
        .pointer_mut("/metadata/annotations")
        .and_then(Value::as_object_mut)
    {
        a.retain(|k, _| {
            !k.starts_with("gpuwarden.io/") && !gpuwarden_crds::is_cdi_annotation(k)
                || k.starts_with("gpuwarden.io/gpu-count")
        });
    }
    if let Some(c) = pod
        .pointer_mut("/spec/resourceClaims")
        .and_then(Value::as_array_mut)
    {
        c.retain(|c| {
            !c["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("gpuwarden-gpus-"))
        });
    }
    if let Some(v) = pod
        .pointer_mut("/spec/volumes")
        .and_then(Value::as_array_mut)
    {
        v.retain(|v| {
            !v["name"]
                .as_str()
                .is_some_and(|n| device_volumes.contains(n))
        });
    }
    for field in ["initContainers", "containers", "ephemeralContainers"] {
        let Some(list) = pod
            .pointer_mut(&format!("/spec/{field}"))
            .and_then(Value::as_array_mut)
        else {
            continue;
        };
        for c in list {
            let Some(c) = c.as_object_mut() else { continue };
            if let Some(sc) = c.get_mut("securityContext").and_then(Value::as_object_mut) {
                sc.remove("privileged");
                sc.remove("allowPrivilegeEscalation");
                sc.remove("capabilities");
                sc.remove("seccompProfile");
            }
            if let Some(l) = c
                .get_mut("resources")
                .and_then(|r| r.get_mut("limits"))
                .and_then(Value::as_object_mut)
            {
                for r in ["nvidia.com/gpu", gpu_resource] {
                    // Only a limit equal to a same-named request may have been added; keep others.
                    l.remove(r);
                }
            }
            if let Some(claims) = c
                .get_mut("resources")
                .and_then(|r| r.get_mut("claims"))
                .and_then(Value::as_array_mut)
            {
                claims.retain(|u| {
                    !u["name"]
                        .as_str()
                        .is_some_and(|n| n.starts_with("gpuwarden-gpus-"))
                });
            }
            if let Some(env) = c.get_mut("env").and_then(Value::as_array_mut) {
                env.retain(|e| !e["name"].as_str().is_some_and(|n| n.starts_with("NVIDIA_")));
            }
            if let Some(m) = c.get_mut("volumeMounts").and_then(Value::as_array_mut) {
                m.retain(|m| {
                    !m["name"]
                        .as_str()
                        .is_some_and(|n| device_volumes.contains(n))
                        && !m["mountPath"].as_str().is_some_and(oracle_device_list_path)
                });
            }
        }
    }
    prune(&mut pod);
    pod
}

fn prune(v: &mut Value) {
    match v {
        Value::Object(m) => {
            for child in m.values_mut() {
                prune(child);
            }
            m.retain(|_, c| {
                !matches!(c, Value::Object(o) if o.is_empty())
                    && !matches!(c, Value::Array(a) if a.is_empty())
            });
        }
        Value::Array(a) => a.iter_mut().for_each(prune),
        _ => {}
    }
}

#[test]
fn generated_pods_hold_the_invariants() {
    generated_pods_hold_the_invariants_in(RequestAs::ExtendedResource);
}

#[test]
fn generated_pods_hold_the_invariants_when_gpus_are_claimed() {
    generated_pods_hold_the_invariants_in(RequestAs::ResourceClaim);
}

/// Every generated pod, judged by a generated policy that requests GPUs as `request_as`.
fn generated_pods_hold_the_invariants_in(request_as: RequestAs) {
    let seed: u64 = 0x0067_7075_7761_7264;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut outcomes: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut vm_devices_outside_vms = 0;
    let mut patched_count = 0;
    let mut leaks_seen = 0;
    let (mut claimed, mut shared) = (0, 0);
    let (mut daemon_set_denied, mut device_denied, mut passthrough_cdi_kept) = (0, 0, 0);
    for case in 0..CASES {
        let (pod, namespace) = gen_pod(&mut rng, case);
        let mut policy = gen_policy(&mut rng);
        policy.spec.gpu.request_as = request_as;
        let mode = policy.spec.mode;
        // Some namespaces enforce a Pod Security level, which bounds the rewrite.
        let level = *["", "", "baseline", "restricted"]
            .choose(&mut rng)
            .unwrap_or(&"");
        let mut source = StaticSource::new([policy.clone()]);
        source.claims = claim_store(&policy);
        if !level.is_empty() {
            source =
                source.with_namespace(&namespace, &[("pod-security.kubernetes.io/enforce", level)]);
        }
        let ctx =
            || format!("seed {seed:#x} case {case} mode {mode} level {level:?}\npod: {pod:#}");

        let first = review_pod(&pod, &namespace, &source);
        *outcomes.entry(first.summary.outcome.as_str()).or_default() += 1;
        assert_ne!(first.summary.outcome, Outcome::Invalid, "{}", ctx());
        // A VM device outside a VM is never admitted as it is or rewritten, unless the
        // container's image is exempt (an NVIDIA component in its own namespace).
        let sa = pod["spec"]["serviceAccountName"].as_str().unwrap_or("");
        let vm_device_unexempt = ["initContainers", "containers"]
            .iter()
            .flat_map(|list| pod["spec"][list].as_array().into_iter().flatten())
            .filter(|c| oracle_asks(c, oracle_passthrough))
            .any(|c| {
                let image = c["image"].as_str().unwrap_or("");
                (policy.spec.exemptions)
                    .container_exemption(image, &namespace, sa)
                    .is_none()
            });
        if vm_device_unexempt && pod["spec"]["runtimeClassName"].is_null() {
            vm_devices_outside_vms += 1;
            assert!(
                !matches!(first.summary.outcome, Outcome::Allowed | Outcome::Rewritten),
                "a VM device outside a VM was {:?}\n{}",
                first.summary.outcome,
                ctx()
            );
        }
        let patched = first.apply(&pod);
        // The adapter reads the pod's view straight from the review's bytes; the engine on
        // the view of the whole pod held as a Value must produce the very same patch.
        let known = (!level.is_empty()).then(|| {
            BTreeMap::from([(
                "pod-security.kubernetes.io/enforce".to_owned(),
                level.to_owned(),
            )])
        });
        let labels = namespace_labels_or_default(&namespace, known);
        let view = PodView::from_value(&pod);
        let input = Input {
            pod: &view,
            namespace: &namespace,
            namespace_labels: &labels,
            operation: Operation::Create,
            display_name: "",
            claims: &source.claims,
            owner_kind: None,
            requester: Requester::Unknown,
        };
        let policies = [Arc::new(policy.clone())];
        let direct = decide(&input, &policies);
        if direct.verdict() != Verdict::Denied {
            let direct = patch_for(&pod, direct.changes());
            let direct = (!direct.0.is_empty()).then(|| serde_json::to_value(&direct).unwrap());
            let via_review = first
                .patch
                .as_ref()
                .map(|p| serde_json::to_value(p).unwrap());
            assert_eq!(direct, via_review, "{}", ctx());
        }
        if first.patch.is_some() {
            patched_count += 1;
        }
        // The result is a Pod.
        serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(patched.clone())
            .unwrap_or_else(|e| panic!("not a Pod after the patch: {e}\n{}\n{patched:#}", ctx()));
        // A second pass is a no-op.
        let second = review_pod(&patched, &namespace, &source);
        assert!(
            second.patch.is_none(),
            "second pass patched: {:?}\n{}\n{patched:#}",
            second.patch,
            ctx()
        );
        assert_eq!(
            second.allowed(),
            first.allowed(),
            "second pass changed the verdict\n{}",
            ctx()
        );

        match first.summary.outcome {
            Outcome::Denied => {
                assert!(!first.allowed() && first.patch.is_none(), "{}", ctx());
                assert!(!first.message().is_empty(), "{}", ctx());
            }
            Outcome::Audited => assert_eq!(
                patched["spec"],
                pod["spec"],
                "Audit changed the spec\n{}",
                ctx()
            ),
            // The void rule may still set NVIDIA_VISIBLE_DEVICES=void; nothing else changes.
            Outcome::Exempt | Outcome::Allowed => {
                assert_eq!(without_void(&patched), without_void(&pod), "{}", ctx())
            }
            Outcome::Voided => {
                assert_eq!(mode, PolicyMode::Enforce, "{}", ctx());
                assert_eq!(without_void(&patched), without_void(&pod), "{}", ctx());
                assert_ne!(patched, pod, "{}", ctx());
            }
            Outcome::Rewritten => assert_eq!(mode, PolicyMode::Enforce, "{}", ctx()),
            Outcome::Invalid => unreachable!(),
        }

        // Enforce leaves no privileged GPU container outside the exemptions.
        let pod_exempt = ["kube-system", "gpuwarden-system"].contains(&namespace.as_str())
            || policy.spec.exemptions.service_accounts.contains(&format!(
                "{namespace}/{}",
                pod["spec"]["serviceAccountName"]
                    .as_str()
                    .unwrap_or("default")
            ));
        if mode == PolicyMode::Enforce && first.allowed() && !pod_exempt {
            let left = privileged_gpu_containers(&patched, &namespace, &policy);
            assert!(
                left.is_empty(),
                "privileged GPU containers left: {left:?}\n{}\n{patched:#}",
                ctx()
            );
            // The pod never holds more GPUs at once than maxPerPod: its regular and sidecar
            // containers together, or its largest init container.
            let held = pod_gpus(&patched, &policy);
            assert!(
                first.summary.outcome != Outcome::Rewritten || held <= policy.spec.gpu.max_per_pod,
                "the pod holds {held} GPUs, more than maxPerPod {}\n{}\n{patched:#}",
                policy.spec.gpu.max_per_pod,
                ctx()
            );
            // Every claim a container uses is the pod's; every claim the rewrite adds is
            // used. In the ResourceClaim mode no GPU limit is added but one copied from the
            // container's own request; in the other no claim is added.
            let entries: Vec<&str> = (patched["spec"]["resourceClaims"].as_array().into_iter())
                .flatten()
                .filter_map(|e| e["name"].as_str())
                .collect();
            let uses: Vec<&str> = containers_of(&patched)
                .flat_map(|c| c["resources"]["claims"].as_array().into_iter().flatten())
                .filter_map(|u| u["name"].as_str())
                .collect();
            assert!(
                uses.iter().all(|u| entries.contains(u)),
                "a container uses a claim the pod lacks\n{}\n{patched:#}",
                ctx()
            );
            let added: Vec<&&str> = (entries.iter())
                .filter(|e| e.starts_with("gpuwarden-gpus-"))
                .collect();
            assert!(
                added.iter().all(|e| uses.contains(e)),
                "a claim no container uses\n{}\n{patched:#}",
                ctx()
            );
            claimed += usize::from(!added.is_empty());
            shared += usize::from(
                added
                    .iter()
                    .any(|a| uses.iter().filter(|u| *u == *a).count() > 1),
            );
            match request_as {
                RequestAs::ExtendedResource => {
                    assert!(added.is_empty(), "claims added\n{}", ctx());
                }
                RequestAs::ResourceClaim => {
                    let resource = policy.spec.gpu.resource_name.as_str();
                    for (before, after) in containers_of(&pod).zip(containers_of(&patched)) {
                        let has =
                            |c: &Value, what: &str| c["resources"][what].get(resource).is_some();
                        assert!(
                            !has(after, "limits")
                                || has(before, "limits")
                                || has(before, "requests"),
                            "a limit added in the ResourceClaim mode\n{}\n{patched:#}",
                            ctx()
                        );
                    }
                }
            }
            // Nothing the rewrite adds is beyond the namespace's Pod Security level.
            if level == "baseline" || level == "restricted" {
                let allowed: &[&str] = if level == "restricted" {
                    &["NET_BIND_SERVICE"]
                } else {
                    &[
                        "AUDIT_WRITE",
                        "CHOWN",
                        "DAC_OVERRIDE",
                        "FOWNER",
                        "FSETID",
                        "KILL",
                        "MKNOD",
                        "NET_BIND_SERVICE",
                        "SETFCAP",
                        "SETGID",
                        "SETPCAP",
                        "SETUID",
                        "SYS_CHROOT",
                    ]
                };
                for (before, after) in containers_of(&pod).zip(containers_of(&patched)) {
                    let rewritten = before["securityContext"]["privileged"] == json!(true)
                        && after["securityContext"]["privileged"] == json!(false);
                    let added = after["securityContext"]["capabilities"]["add"].as_array();
                    if rewritten {
                        assert!(
                            added
                                .into_iter()
                                .flatten()
                                .all(|c| c.as_str().is_some_and(|c| allowed.contains(&c))),
                            "capabilities beyond {level}: {added:?}\n{}",
                            ctx()
                        );
                        if level == "restricted" {
                            assert_eq!(
                                after["securityContext"]["capabilities"]["drop"],
                                json!(["ALL"]),
                                "{}",
                                ctx()
                            );
                        }
                    }
                }
            }
            // ... and no container that reaches GPUs around the kubelet.
            let leaking = leaking_containers(&patched, &namespace, &policy);
            assert!(
                leaking.is_empty(),
                "leaking containers left: {leaking:?}\n{}\n{patched:#}",
                ctx()
            );
            // Do no harm: no container loses privilege while it mounts host devices it
            // could then not open; a DaemonSet's pod is given no GPUs it did not ask for; a
            // passthrough GPU is not requested again, and its CDI annotation stays.
            let daemon_set = pod["metadata"]["ownerReferences"][0]["kind"] == "DaemonSet";
            let resource = policy.spec.gpu.resource_name.as_str();
            for (before, after) in containers_of(&pod).zip(containers_of(&patched)) {
                let name = before["name"].as_str().unwrap_or("");
                if before["securityContext"]["privileged"] == json!(true)
                    && after["securityContext"]["privileged"] == json!(false)
                {
                    let left = oracle_unopenable_mounts(before, &pod);
                    assert!(
                        left.is_empty(),
                        "{name} lost privilege but mounts {left:?}\n{}\n{patched:#}",
                        ctx()
                    );
                }
                let gained = |c: &Value| {
                    c["resources"]["limits"].get(resource).is_some()
                        || (c["resources"]["claims"].as_array().into_iter().flatten()).any(|u| {
                            u["name"]
                                .as_str()
                                .is_some_and(|n| n.starts_with("gpuwarden-gpus-"))
                        })
                };
                let given = gained(after) && !gained(before);
                assert!(
                    !(daemon_set && given) || oracle_asked_count(before, &pod),
                    "DaemonSet container {name} given GPUs it did not ask for\n{}\n{patched:#}",
                    ctx()
                );
                assert!(
                    !(given && oracle_asks(before, oracle_passthrough)),
                    "{name} holds a passthrough GPU and was given another\n{}\n{patched:#}",
                    ctx()
                );
            }
            if oracle_holds_passthrough(&pod) {
                for (key, value) in
                    (pod["metadata"]["annotations"].as_object().into_iter()).flatten()
                {
                    let kept = key.starts_with("cdi.k8s.io/")
                        && value.as_str().is_some_and(|v| {
                            v.split(',').all(|d| d.starts_with("nvidia.com/pgpu="))
                        });
                    if kept {
                        passthrough_cdi_kept += 1;
                        assert_eq!(
                            patched["metadata"]["annotations"][key],
                            *value,
                            "the passthrough CDI annotation {key} was removed\n{}",
                            ctx()
                        );
                    }
                }
            }
        }
        if !first.allowed() {
            let message = first.message();
            daemon_set_denied += usize::from(message.contains("runs it on every node"));
            device_denied += usize::from(message.contains("an unprivileged container cannot open"));
        }
        let offending = !privileged_gpu_containers(&pod, &namespace, &policy).is_empty()
            || !leaking_containers(&pod, &namespace, &policy).is_empty();
        if offending {
            leaks_seen +=
                usize::from(privileged_gpu_containers(&pod, &namespace, &policy).is_empty());
        }
        if !pod_exempt && mode == PolicyMode::Deny && offending {
            assert_eq!(first.summary.outcome, Outcome::Denied, "{}", ctx());
        }

        // Nothing outside the listed fields changed.
        let device_volumes: BTreeSet<String> = pod["spec"]["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|v| {
                v["hostPath"]["path"]
                    .as_str()
                    .is_some_and(oracle_device_path)
            })
            .filter_map(|v| v["name"].as_str().map(str::to_owned))
            .collect();
        let added_from_request: Vec<String> = containers_of(&patched)
            .flat_map(|c| {
                c["resources"]["limits"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, _)| k.clone())
            })
            .collect();
        let mut before =
            without_allowed_fields(&pod, &device_volumes, &policy.spec.gpu.resource_name);
        let mut after =
            without_allowed_fields(&patched, &device_volumes, &policy.spec.gpu.resource_name);
        // A GPU limit copied from a GPU request may also appear.
        for r in added_from_request
            .iter()
            .filter(|r| r.starts_with("nvidia.com/"))
        {
            for v in [&mut before, &mut after] {
                for field in ["initContainers", "containers"] {
                    for c in v["spec"][field].as_array_mut().into_iter().flatten() {
                        if let Some(l) = c
                            .pointer_mut("/resources/limits")
                            .and_then(Value::as_object_mut)
                        {
                            l.remove(r);
                        }
                    }
                }
                prune(v);
            }
        }
        assert_eq!(
            before,
            after,
            "fields outside the allowed ones changed\n{}\n{patched:#}",
            ctx()
        );
    }
    // The generator must actually exercise every outcome, or the invariants above prove little.
    for outcome in ["allowed", "exempt", "rewritten", "audited", "denied"] {
        assert!(
            outcomes.get(outcome).copied().unwrap_or(0) >= 20,
            "too few {outcome}: {outcomes:?}"
        );
    }
    assert!(
        patched_count >= 300,
        "too few patched pods: {patched_count} ({outcomes:?})"
    );
    assert!(
        leaks_seen >= 50,
        "too few pods with only a leak: {leaks_seen}"
    );
    assert!(
        vm_devices_outside_vms >= 10,
        "too few VM devices outside VMs: {vm_devices_outside_vms}"
    );
    assert!(
        daemon_set_denied >= 20 && device_denied >= 20 && passthrough_cdi_kept >= 5,
        "too few DaemonSet denials ({daemon_set_denied}), host-device denials ({device_denied}) or passthrough CDI annotations kept ({passthrough_cdi_kept})"
    );
    if request_as == RequestAs::ResourceClaim {
        assert!(
            claimed >= 200 && shared >= 10,
            "too few claimed ({claimed}) or shared ({shared})"
        );
    }
    println!(
        "{CASES} generated pods ({request_as}): {outcomes:?}, {patched_count} patched, {leaks_seen} leaking only, {claimed} given claims, {shared} sharing one, denied as DaemonSet {daemon_set_denied}, for host devices {device_denied}, passthrough CDI kept {passthrough_cdi_kept}"
    );
}

#[test]
fn generated_workload_templates_in_every_namespace_kind() {
    // The same engine on pods whose metadata lacks annotations and namespace entirely.
    let mut rng = StdRng::seed_from_u64(7);
    let source = StaticSource::new([default_policy()]);
    for case in 0..200 {
        let (mut pod, namespace) = gen_pod(&mut rng, case);
        pod["metadata"] = json!({"generateName": "job-"});
        let first = review_pod(&pod, &namespace, &source);
        let patched = first.apply(&pod);
        let second = review_pod(&patched, &namespace, &source);
        assert!(second.patch.is_none(), "case {case}: {pod:#}");
    }
}

/// The pod without `NVIDIA_VISIBLE_DEVICES=void` entries, and without empty `env` lists.
fn without_void(pod: &Value) -> Value {
    let mut pod = pod.clone();
    for list in ["initContainers", "containers"] {
        for c in pod["spec"][list].as_array_mut().into_iter().flatten() {
            let Some(env) = c.get_mut("env").and_then(Value::as_array_mut) else {
                continue;
            };
            env.retain(|e| *e != json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}));
            if env.is_empty() {
                c.as_object_mut().map(|c| c.remove("env"));
            }
        }
    }
    pod
}
