//! Engine benchmark: the whole `handle_review` (parse, decide, patch, encode) on realistic
//! ~3 KB AdmissionReviews, per outcome. Plain std::time; run in release:
//!
//! ```text
//! cargo bench -p gpuwarden-webhook --bench engine
//! ```

use std::hint::black_box;
use std::time::{Duration, Instant};

use gpuwarden_crds::{GpuPolicy, PolicyMode};
use gpuwarden_webhook::admission::{Outcome, StaticSource, handle_review};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde_json::{Value, json};

/// The binary's allocator, so that the bench measures what runs in production.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const WARMUP: usize = 2_000;
const SAMPLES: usize = 20_000;

/// A realistic training pod: probes, tolerations, affinity, a dozen env vars, a sidecar.
fn pod(namespace: &str, image: &str, privileged: bool) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "llm-finetune-7c9f8d5b6-",
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/name": "llm-finetune",
                "app.kubernetes.io/part-of": "research-platform",
                "pod-template-hash": "7c9f8d5b6",
                "team": "nlp"
            },
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": "9100",
                "kubectl.kubernetes.io/default-container": "trainer"
            },
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "llm-finetune-7c9f8d5b6",
                "uid": "0c1a7d5e-3f0b-4a51-9d3e-2b8e6c1f4a77", "controller": true, "blockOwnerDeletion": true
            }]
        },
        "spec": {
            "serviceAccountName": "trainer",
            "priorityClassName": "research-high",
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
            ],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
                "matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB"]}]
            }]}}},
            "containers": [
                {
                    "name": "trainer",
                    "image": image,
                    "command": ["torchrun", "--nproc_per_node=2", "train.py"],
                    "args": ["--config", "/etc/train/config.yaml", "--output", "/checkpoints"],
                    "env": [
                        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,1"},
                        {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "all"},
                        {"name": "NCCL_DEBUG", "value": "WARN"},
                        {"name": "NCCL_IB_DISABLE", "value": "1"},
                        {"name": "OMP_NUM_THREADS", "value": "8"},
                        {"name": "HF_HOME", "value": "/cache/huggingface"},
                        {"name": "WANDB_MODE", "value": "offline"},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}
                    ],
                    "resources": {"requests": {"cpu": "16", "memory": "128Gi"}, "limits": {"memory": "160Gi"}},
                    "ports": [{"name": "metrics", "containerPort": 9100, "protocol": "TCP"}],
                    "readinessProbe": {"httpGet": {"path": "/healthz", "port": 9100}, "periodSeconds": 10},
                    "volumeMounts": [
                        {"name": "config", "mountPath": "/etc/train", "readOnly": true},
                        {"name": "checkpoints", "mountPath": "/checkpoints"},
                        {"name": "shm", "mountPath": "/dev/shm"},
                        {"name": "nvidia0", "mountPath": "/dev/nvidia0"}
                    ],
                    "securityContext": {"privileged": privileged, "capabilities": {"add": ["IPC_LOCK", "SYS_ADMIN"]}}
                },
                {
                    "name": "log-shipper",
                    "image": "fluent/fluent-bit:3.0.7",
                    "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
                    "volumeMounts": [{"name": "checkpoints", "mountPath": "/checkpoints", "readOnly": true}],
                    "securityContext": {"privileged": privileged}
                }
            ],
            "volumes": [
                {"name": "config", "configMap": {"name": "llm-finetune-config"}},
                {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "llm-checkpoints"}},
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}},
                {"name": "nvidia0", "hostPath": {"path": "/dev/nvidia0", "type": "CharDevice"}}
            ]
        }
    })
}

/// The same pod as it should be written: unprivileged, its two GPUs requested through the
/// device plugin, no NVIDIA_VISIBLE_DEVICES and no device hostPath.
fn proper_pod(namespace: &str, image: &str) -> Value {
    let mut pod = pod(namespace, image, false);
    let trainer = &mut pod["spec"]["containers"][0];
    if let Some(env) = trainer["env"].as_array_mut() {
        env.retain(|e| e["name"] != "NVIDIA_VISIBLE_DEVICES");
    }
    if let Some(mounts) = trainer["volumeMounts"].as_array_mut() {
        mounts.retain(|m| m["name"] != "nvidia0");
    }
    trainer["resources"]["limits"]["nvidia.com/gpu"] = json!("2");
    if let Some(volumes) = pod["spec"]["volumes"].as_array_mut() {
        volumes.retain(|v| v["name"] != "nvidia0");
    }
    pod
}

/// The GPU Operator's exporter in its own namespace, where its image is exempt; its log
/// shipper is not privileged.
fn exporter_pod() -> Value {
    let mut pod = pod(
        "gpu-operator",
        "nvcr.io/nvidia/k8s/dcgm-exporter:3.3.5-3.4.0-ubuntu22.04",
        true,
    );
    pod["spec"]["containers"][1]["securityContext"]["privileged"] = json!(false);
    pod
}

/// GKE's GPUDirect-TCPXO pod: a device-injection annotation naming the 8 GPUs its pod holds
/// (`webhook/tests/real/gke-gpudirect-tcpxo-nccl.yaml`), in namespace `ml`.
fn tcpxo_pod() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/real/gke-gpudirect-tcpxo-nccl.yaml"
    );
    let text = std::fs::read_to_string(path).expect("the TCPXO fixture");
    let mut pod = gpuwarden_webhook::manifest::yaml_value(&text).expect("the fixture is YAML");
    pod["metadata"]["namespace"] = json!("ml");
    pod
}

fn review(pod: &Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": pod["metadata"]["namespace"],
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller",
                         "uid": "4f8e0c4a-8d1e-4b0a-9c55-1b2d3e4f5a6b",
                         "groups": ["system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"]},
            "object": pod,
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        }
    }))
    .expect("a JSON value serialises")
}

struct Stats {
    mean: Duration,
    p50: Duration,
    p99: Duration,
}

fn measure(mut f: impl FnMut()) -> Stats {
    for _ in 0..WARMUP {
        f();
    }
    let mut samples = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let start = Instant::now();
        f();
        samples.push(start.elapsed());
    }
    samples.sort_unstable();
    let total: Duration = samples.iter().sum();
    Stats {
        mean: total / SAMPLES as u32,
        p50: samples[SAMPLES / 2],
        p99: samples[SAMPLES * 99 / 100],
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn main() {
    // Four policies, as a cluster might have: the default, an Audit policy for one team, a
    // Deny policy for production by label, and one that selects nothing here.
    let mut default = GpuPolicy::default_policy();
    default.metadata.generation = Some(3);
    let mut audit = GpuPolicy::default_policy();
    audit.metadata.name = Some("research-audit".into());
    audit.spec.priority = 10;
    audit.spec.mode = PolicyMode::Audit;
    audit.spec.namespace_selector = LabelSelector {
        match_labels: Some([("team".to_owned(), "vision".to_owned())].into()),
        ..Default::default()
    };
    let mut deny = audit.clone();
    deny.metadata.name = Some("prod-deny".into());
    deny.spec.mode = PolicyMode::Deny;
    deny.spec.priority = 20;
    deny.spec.namespace_selector = LabelSelector {
        match_labels: Some([("env".to_owned(), "prod".to_owned())].into()),
        ..Default::default()
    };
    let mut none = deny.clone();
    none.metadata.name = Some("nothing".into());
    none.spec.namespace_selector = LabelSelector {
        match_labels: Some([("does-not".to_owned(), "exist".to_owned())].into()),
        ..Default::default()
    };
    let source = StaticSource::new([default, audit, deny, none])
        .with_namespace("ml", &[("team", "nlp")])
        .with_namespace("kube-system", &[]);
    let ungoverned = StaticSource::new([]);
    // The default policy requesting GPUs as claims, with gpuwarden's templates in `ml`.
    let mut claiming = GpuPolicy::default_policy();
    claiming.spec.gpu.request_as = gpuwarden_crds::RequestAs::ResourceClaim;
    let mut claims = StaticSource::new([claiming]);
    for n in 1..=8 {
        let template = gpuwarden_crds::claims::template_name("gpu.nvidia.com", n);
        let spec = serde_json::from_value(json!({"devices": {"requests": [
            {"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": n}}
        ]}}))
        .expect("a claim spec");
        let source = gpuwarden_webhook::engine::ClaimSource::Template;
        claims.claims.insert(source, "ml", &template, &spec);
    }

    let cases: Vec<(&str, Vec<u8>, &StaticSource, Outcome)> = vec![
        (
            "unchanged (not governed)",
            review(&pod("ml", "nvcr.io/nvidia/pytorch:24.05-py3", true)),
            &ungoverned,
            Outcome::Allowed,
        ),
        // Its log shipper, which holds no GPU, gets the void rule's entry.
        (
            "voided (governed, unprivileged)",
            review(&proper_pod("ml", "nvcr.io/nvidia/pytorch:24.05-py3")),
            &source,
            Outcome::Voided,
        ),
        (
            "rewritten",
            review(&pod("ml", "nvcr.io/nvidia/pytorch:24.05-py3", true)),
            &source,
            Outcome::Rewritten,
        ),
        (
            "rewritten (as a ResourceClaim)",
            review(&pod("ml", "nvcr.io/nvidia/pytorch:24.05-py3", true)),
            &claims,
            Outcome::Rewritten,
        ),
        (
            "exempt (namespace)",
            review(&pod(
                "kube-system",
                "nvcr.io/nvidia/pytorch:24.05-py3",
                true,
            )),
            &source,
            Outcome::Exempt,
        ),
        (
            "exempt (image)",
            review(&exporter_pod()),
            &source,
            Outcome::Exempt,
        ),
        (
            "voided (GKE TCPXO, injection annotation)",
            review(&tcpxo_pod()),
            &source,
            Outcome::Voided,
        ),
    ];

    println!(
        "handle_review, {SAMPLES} samples after {WARMUP} warm-up, one thread ({} CPUs online)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "{:<36} {:>8} {:>10} {:>10} {:>10} {:>12}",
        "case", "bytes", "mean µs", "p50 µs", "p99 µs", "reviews/s"
    );
    // `ENGINE_BENCH_ONLY=rewritten` runs one case (for a profiler) and skips the rest.
    let only = std::env::var("ENGINE_BENCH_ONLY").ok();
    for (name, body, src, expected) in &cases {
        if only.as_deref().is_some_and(|o| !name.starts_with(o)) {
            continue;
        }
        let (_, summary) = handle_review(body, *src);
        assert_eq!(
            summary.outcome, *expected,
            "{name}: the fixture does not exercise what it says"
        );
        let stats = measure(|| {
            black_box(handle_review(black_box(body), *src));
        });
        println!(
            "{:<36} {:>8} {:>10.1} {:>10.1} {:>10.1} {:>12.0}",
            name,
            body.len(),
            us(stats.mean),
            us(stats.p50),
            us(stats.p99),
            1.0 / stats.mean.as_secs_f64()
        );
    }

    if only.is_some() {
        return;
    }

    // Where the rewritten case's time goes: the engine's decision and the patch, on a pod
    // that is already parsed.
    let parsed: Value = serde_json::from_slice(&cases[2].1).expect("the fixture is JSON");
    let pod = gpuwarden_webhook::pod::PodView::from_value(&parsed["request"]["object"]);
    let labels = gpuwarden_webhook::engine::namespace_labels_or_default(
        "ml",
        Some([("team".to_owned(), "nlp".to_owned())].into()),
    );
    let policies = gpuwarden_webhook::admission::PolicySource::policies(&source);
    let input = gpuwarden_webhook::engine::Input {
        pod: &pod,
        namespace: "ml",
        namespace_labels: &labels,
        operation: gpuwarden_webhook::engine::Operation::Create,
        display_name: "ml/llm-finetune",
        claims: &gpuwarden_webhook::engine::NoClaims("no claims here"),
        owner_kind: None,
        requester: gpuwarden_webhook::engine::Requester::User("alice"),
    };
    let decide = measure(|| {
        black_box(gpuwarden_webhook::engine::decide(
            black_box(&input),
            &policies,
        ));
    });
    let decision = gpuwarden_webhook::engine::decide(&input, &policies);
    let patch = measure(|| {
        let patch = gpuwarden_webhook::patch::patch_for_view(black_box(&pod), decision.changes());
        black_box(serde_json::to_vec(&patch).unwrap_or_default());
    });
    println!();
    println!(
        "{:<36} {:>8} {:>10} {:>10} {:>10}",
        "rewritten, by stage", "", "mean µs", "p50 µs", "p99 µs"
    );
    for (name, stats) in [
        ("engine::decide (parsed pod)", decide),
        ("patch::patch_for_view + serialise", patch),
    ] {
        println!(
            "{:<36} {:>8} {:>10.1} {:>10.1} {:>10.1}",
            name,
            "",
            us(stats.mean),
            us(stats.p50),
            us(stats.p99)
        );
    }

    // For scale, two parses the webhook does not do, on the rewritten case's body: the whole
    // review as a serde_json::Value, and kube's typed AdmissionReview<DynamicObject>. The
    // webhook reads a borrowed view of the pod (pod::PodView) inside handle_review above.
    let body = &cases[2].1;
    let value = measure(|| {
        black_box(serde_json::from_slice::<Value>(black_box(body)).ok());
    });
    let kube = measure(|| {
        black_box(
            serde_json::from_slice::<
                kube::core::admission::AdmissionReview<kube::core::DynamicObject>,
            >(black_box(body))
            .ok(),
        );
    });
    println!();
    println!(
        "{:<36} {:>8} {:>10} {:>10} {:>10}",
        "parse only", "bytes", "mean µs", "p50 µs", "p99 µs"
    );
    for (name, stats) in [
        ("serde_json::Value", value),
        ("kube AdmissionReview<DynamicObject>", kube),
    ] {
        println!(
            "{:<36} {:>8} {:>10.1} {:>10.1} {:>10.1}",
            name,
            body.len(),
            us(stats.mean),
            us(stats.p50),
            us(stats.p99)
        );
    }
}
