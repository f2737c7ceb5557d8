//! The doors to a device that a tenant writes besides `NVIDIA_VISIBLE_DEVICES`
//! (docs/design.md, "Runtime variables" and "Device-injection annotations"): NVIDIA's other
//! runtime variables, `envFrom` prefixes that spell one, and the annotations node plugins
//! inject devices from. Each is judged as a namespace admin would write it, through
//! `handle_review` as the server calls it.

mod engine_support;

use engine_support::*;
use gpuwarden_crds::{PolicyMode, RuntimeFeature};
use gpuwarden_webhook::admission::{Outcome, StaticSource};
use serde_json::{Value, json};

fn source() -> StaticSource {
    StaticSource::new([default_policy()])
}

/// An unprivileged pod whose one container holds `gpus` GPUs by its limit (none for 0),
/// with `env`, `env_from` and pod annotations as given.
fn pod(gpus: u32, env: Value, env_from: Value, annotations: Value) -> Value {
    let mut container = json!({
        "name": "main",
        "image": "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04",
        "env": env,
        "envFrom": env_from,
    });
    if gpus > 0 {
        container["resources"] = json!({"limits": {"nvidia.com/gpu": gpus.to_string()}});
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "team", "annotations": annotations},
        "spec": {"containers": [container]},
    })
}

fn env_names(pod: &Value) -> Vec<&str> {
    (pod["spec"]["containers"][0]["env"]
        .as_array()
        .into_iter()
        .flatten())
    .filter_map(|e| e["name"].as_str())
    .collect()
}

#[test]
fn imex_nvswitch_and_mig_variables_are_removed_from_a_gpu_container_whatever_the_value() {
    for (name, value) in [
        ("NVIDIA_IMEX_CHANNELS", "0"),
        ("NVIDIA_IMEX_CHANNELS", "none"),
        ("NVIDIA_IMEX_CHANNELS", "channelall"),
        ("NVIDIA_NVSWITCH", "enabled"),
        ("NVIDIA_MIG_MONITOR_DEVICES", "all"),
    ] {
        let p = pod(
            1,
            json!([{"name": name, "value": value}, {"name": "EPOCHS", "value": "1"}]),
            json!([]),
            json!({}),
        );
        let (answer, out) = rewrite(&p, "team", &source());
        assert_eq!(answer.summary.outcome, Outcome::Rewritten, "{name}={value}");
        assert_eq!(
            env_names(&out),
            ["EPOCHS", "NVIDIA_DRIVER_CAPABILITIES"],
            "{name}={value}"
        );
        assert_eq!(
            out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"], "1",
            "{name}: the GPU it holds stays"
        );
        assert!(
            answer.warnings().iter().any(|w| w.contains(name)),
            "{name}: {:?}",
            answer.warnings()
        );
    }
}

#[test]
fn a_runtime_feature_is_kept_where_the_policy_allows_it_and_removed_elsewhere() {
    // DeepEP recipes write NVIDIA_GDRCOPY=enabled in the GPU container: the default keeps it.
    let deep_ep = pod(
        8,
        json!([{"name": "NVIDIA_GDRCOPY", "value": "enabled"}]),
        json!([]),
        json!({}),
    );
    let answer = review_pod(&deep_ep, "team", &source());
    assert_eq!(answer.summary.outcome, Outcome::Allowed);
    assert!(answer.patch.is_none());
    for feature in ["NVIDIA_MOFED", "NVIDIA_GDS"] {
        let p = pod(
            1,
            json!([{"name": feature, "value": "enabled"}]),
            json!([]),
            json!({}),
        );
        let (answer, out) = rewrite(&p, "team", &source());
        assert_eq!(answer.summary.outcome, Outcome::Rewritten, "{feature}");
        assert_eq!(
            env_names(&out),
            ["NVIDIA_DRIVER_CAPABILITIES"],
            "{feature}: {out:#}"
        );
    }
    let strict = StaticSource::new([policy("default", |p| p.spec.runtime_features.clear())]);
    let (_, out) = rewrite(&deep_ep, "team", &strict);
    assert_eq!(env_names(&out), ["NVIDIA_DRIVER_CAPABILITIES"], "{out:#}");
    let open = StaticSource::new([policy("default", |p| {
        p.spec.runtime_features = RuntimeFeature::ALL.to_vec();
    })]);
    let mofed = pod(
        1,
        json!([{"name": "NVIDIA_MOFED", "value": "enabled"}]),
        json!([]),
        json!({}),
    );
    assert!(review_pod(&mofed, "team", &open).patch.is_none());
}

#[test]
fn a_container_without_gpus_that_sets_a_device_variable_loses_it_and_is_voided() {
    let p = pod(
        0,
        json!([{"name": "NVIDIA_IMEX_CHANNELS", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "k"}}}]),
        json!([]),
        json!({}),
    );
    let (_, out) = rewrite(&p, "team", &source());
    let env = &out["spec"]["containers"][0]["env"];
    assert_eq!(
        env,
        &json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}])
    );
}

#[test]
fn an_env_from_prefix_that_spells_a_runtime_variable_is_a_leak() {
    for prefix in ["NVIDIA_", "NVIDIA_VISIBLE_", "N", "NVIDIA_IMEX_"] {
        let p = pod(
            1,
            json!([]),
            json!([{"prefix": prefix, "configMapRef": {"name": "settings"}}]),
            json!({}),
        );
        let answer = review_pod(&p, "team", &source());
        assert_eq!(answer.summary.outcome, Outcome::Denied, "{prefix}");
        assert!(
            answer
                .message()
                .contains(&format!("envFrom prefix {prefix} spells")),
            "{prefix}: {}",
            answer.message()
        );
    }
    // Without GPUs the void entry, after envFrom, overrides whatever it sets.
    let p = pod(
        0,
        json!([]),
        json!([{"prefix": "NVIDIA_", "secretRef": {"name": "settings"}}]),
        json!({}),
    );
    let (answer, out) = rewrite(&p, "team", &source());
    assert_eq!(answer.summary.outcome, Outcome::Rewritten);
    assert_eq!(env_names(&out), ["NVIDIA_VISIBLE_DEVICES"]);
}

#[test]
fn a_token_secret_in_env_from_keeps_working() {
    // As inference operators render a Hugging Face token into their GPU workers.
    for env_from in [
        json!([{"secretRef": {"name": "hf-token"}}]),
        json!([{"prefix": "HF_", "secretRef": {"name": "hf-token"}}]),
        json!([{"prefix": "NVIDIA_VISIBLE_DEVICES", "configMapRef": {"name": "x"}}]),
    ] {
        let p = pod(1, json!([]), env_from.clone(), json!({}));
        let answer = review_pod(&p, "team", &source());
        assert_eq!(answer.summary.outcome, Outcome::Allowed, "{env_from}");
        assert!(answer.patch.is_none(), "{env_from}");
    }
}

#[test]
fn a_legacy_cuda_image_without_gpus_is_voided() {
    // Unset NVIDIA_VISIBLE_DEVICES, CUDA_VERSION and no NVIDIA_REQUIRE_CUDA: the toolkit hands
    // a "legacy image" every GPU. The void entry sets the variable.
    let p = pod(
        0,
        json!([{"name": "CUDA_VERSION", "value": "8.0"}]),
        json!([]),
        json!({}),
    );
    let answer = review_pod(&p, "team", &source());
    assert_eq!(answer.summary.outcome, Outcome::Voided);
    assert_eq!(answer.voided_only(), ["/spec/containers/0"]);
}

fn gke(paths: &[&str]) -> String {
    paths.iter().map(|p| format!("- path: {p}\n")).collect()
}

#[test]
fn every_injection_annotation_form_naming_gpus_the_pod_does_not_hold_is_denied() {
    let gpu0 = "- path: /dev/nvidia0\n  type: c\n  major: 195\n  minor: 0\n";
    let forms = [
        ("devices.noderesource.dev/container.main", gpu0.to_owned()),
        ("devices.noderesource.dev/pod", gpu0.to_owned()),
        ("devices.noderesource.dev", gpu0.to_owned()),
        ("devices.nri.io/container.main", gpu0.to_owned()),
        ("devices.nri.io/pod", gpu0.to_owned()),
        ("devices.nri.io", gpu0.to_owned()),
        (
            "devices.noderesource.dev/container.main",
            "- path: /dev/innocent\n  type: c\n  major: 195\n  minor: 3\n".to_owned(),
        ),
        (
            "cdi-devices.noderesource.dev/container.main",
            "- nvidia.com/gpu=0\n".to_owned(),
        ),
        (
            "cdi-devices.nri.io/pod",
            "- nvidia.com/gpu=all\n".to_owned(),
        ),
        (
            "mounts.noderesource.dev/pod",
            "- source: /dev/null\n  destination: /var/run/nvidia-container-devices/all\n"
                .to_owned(),
        ),
        ("devices.gke.io/container.main", gke(&["/dev/nvidia0"])),
        (
            "devices.gke.io/container.main",
            gke(&["/dev/nvidia-caps-imex-channels/channel0"]),
        ),
        ("devices.gke.io/container.main", gke(&["/dev/nvidiactl"])),
        ("devices.noderesource.dev/pod", "{not a list".to_owned()),
    ];
    for (key, value) in forms {
        let p = pod(0, json!([]), json!([]), json!({key: value}));
        let answer = review_pod(&p, "team", &source());
        assert_eq!(answer.summary.outcome, Outcome::Denied, "{key}: {value}");
        assert!(
            answer.message().contains(&format!("annotation {key}")),
            "{key}: {}",
            answer.message()
        );
    }
    // Audit names it and admits.
    let audit = StaticSource::new([policy("default", |p| p.spec.mode = PolicyMode::Audit)]);
    let p = pod(
        0,
        json!([]),
        json!([]),
        json!({"devices.gke.io/container.main": gke(&["/dev/nvidia0"])}),
    );
    let answer = review_pod(&p, "team", &audit);
    assert_eq!(answer.summary.outcome, Outcome::Audited);
    assert!(
        (answer.warnings().iter())
            .any(|w| w.contains("Enforce would deny: annotation devices.gke.io/container.main")),
        "{:?}",
        answer.warnings()
    );
}

#[test]
fn nvidias_nri_plugin_reads_the_bare_key_too() {
    let p = pod(
        0,
        json!([]),
        json!([]),
        json!({"nvidia.cdi.k8s.io": "nvidia.com/gpu=all"}),
    );
    let (answer, out) = rewrite(&p, "team", &source());
    assert_eq!(answer.summary.outcome, Outcome::Rewritten);
    assert!(
        out["metadata"]["annotations"]
            .get("nvidia.cdi.k8s.io")
            .is_none()
    );
}

#[test]
fn a_tcpxo_pod_keeps_its_daemons_devices_and_hears_of_the_one_gpuwarden_does_not_judge() {
    let text = std::fs::read_to_string("tests/real/gke-gpudirect-tcpxo-nccl.yaml").unwrap();
    let tcpxo = gpuwarden_webhook::manifest::yaml_value(&text).unwrap();
    let answer = review_pod(&tcpxo, "default", &source());
    assert!(answer.allowed(), "{}", answer.message());
    assert_ne!(answer.summary.outcome, Outcome::Denied);
    assert!(
        (answer.warnings().iter()).any(|w| w.contains("/dev/dmabuf_import_helper")
            && w.contains("devices.gke.io/container.tcpxo-daemon")),
        "{:?}",
        answer.warnings()
    );
    // The same pod asking for fewer GPUs than its daemon names is refused.
    let mut short = tcpxo.clone();
    for c in short["spec"]["containers"].as_array_mut().unwrap() {
        if c["resources"]["limits"].get("nvidia.com/gpu").is_some() {
            c["resources"]["limits"]["nvidia.com/gpu"] = json!("2");
        }
    }
    let answer = review_pod(&short, "default", &source());
    assert_eq!(answer.summary.outcome, Outcome::Denied);
    assert!(
        answer.message().contains("8 GPUs named"),
        "{}",
        answer.message()
    );
}

#[test]
fn an_nri_mount_or_another_vendors_device_is_named_in_a_warning() {
    let p = pod(
        0,
        json!([]),
        json!([]),
        json!({
            "mounts.noderesource.dev/container.main": "- source: /var/cache/models\n  destination: /models\n  type: bind\n",
            "devices.noderesource.dev/container.main": "- path: /dev/fuse\n  type: c\n  major: 10\n  minor: 229\n",
        }),
    );
    let answer = review_pod(&p, "team", &source());
    assert!(answer.allowed());
    let warnings = answer.warnings();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("/var/cache/models at /models")),
        "{warnings:?}"
    );
    assert!(
        warnings.iter().any(|w| w.contains("/dev/fuse (10:229)")),
        "{warnings:?}"
    );
}
