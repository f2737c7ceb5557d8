//! The rewrite rules of docs/design.md, each mode, exemptions, policy selection, init and
//! ephemeral containers, driven through `handle_review` as the server calls it.

mod engine_support;

use engine_support::*;
use gpuwarden_crds::{
    ANNOTATION_AUDIT, ANNOTATION_POLICY, ANNOTATION_REWRITTEN, PolicyMode, PrivilegedMatch,
    RequestAs, VisibleDevicesAll,
};
use gpuwarden_webhook::admission::{Outcome, StaticSource};
use gpuwarden_webhook::engine::ClaimSource;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use serde_json::{Value, json};
use std::collections::BTreeMap;

fn source() -> StaticSource {
    StaticSource::new([default_policy()])
}

fn env_names(container: &Value) -> Vec<String> {
    container["env"]
        .as_array()
        .map(|e| {
            e.iter()
                .map(|v| v["name"].as_str().unwrap_or("").to_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn env_value<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    container["env"]
        .as_array()?
        .iter()
        .rev()
        .find(|v| v["name"] == name)?["value"]
        .as_str()
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn privileged_training_pod_is_rewritten_by_every_rule() {
    let pod = training_pod();
    let (answer, out) = rewrite(&pod, "ml", &source());
    assert!(answer.allowed());
    assert_eq!(answer.summary.outcome, Outcome::Rewritten);
    assert_eq!(answer.summary.policy.as_deref(), Some("default@1"));
    assert_eq!(answer.summary.pod.as_deref(), Some("ml/train"));
    let c = &out["spec"]["containers"][0];
    // Rule 1: privilege goes; what an ordinary container has stays (setuid programs too).
    assert_eq!(c["securityContext"]["privileged"], false);
    assert!(
        c["securityContext"]
            .get("allowPrivilegeEscalation")
            .is_none()
    );
    // Rule 2: nothing dropped beyond privilege: the runtime's defaults stay.
    assert_eq!(c["securityContext"]["capabilities"], json!({}));
    // Rule 3: `all` with visibleDevicesAll DefaultCount → defaultCount (1).
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "1");
    assert_eq!(
        c["resources"]["requests"]["cpu"], "4",
        "other resources untouched"
    );
    // Rule 4.
    assert_eq!(env_names(c), ["EPOCHS", "NVIDIA_DRIVER_CAPABILITIES"]);
    assert_eq!(
        env_value(c, "NVIDIA_DRIVER_CAPABILITIES"),
        Some("compute,utility")
    );
    // Rule 6.
    let annotations = &out["metadata"]["annotations"];
    assert_eq!(annotations[ANNOTATION_POLICY], "default@1");
    let rewritten: Value =
        serde_json::from_str(annotations[ANNOTATION_REWRITTEN].as_str().unwrap()).unwrap();
    assert_eq!(rewritten["containers"]["trainer"]["privileged"], false);
    assert_eq!(
        rewritten["containers"]["trainer"]["limits"]["nvidia.com/gpu"],
        "1"
    );
    assert_eq!(
        rewritten["containers"]["trainer"]["envRemoved"],
        json!(["NVIDIA_VISIBLE_DEVICES"])
    );
    let warnings = answer.warnings();
    assert_eq!(warnings.len(), 1, "one warning per container: {warnings:?}");
    assert!(warnings[0].contains("container trainer"), "{warnings:?}");
    assert!(warnings[0].contains("privileged removed"), "{warnings:?}");
    let audit = &answer.response()["auditAnnotations"];
    assert_eq!(audit["decision"], "rewritten");
    assert_eq!(audit["policy"], "default@1");
    // Everything else is as it was.
    assert_eq!(c["command"], pod["spec"]["containers"][0]["command"]);
    assert_eq!(out["metadata"]["labels"], pod["metadata"]["labels"]);
}

#[test]
fn the_report_names_containers_in_order_and_the_last_of_a_repeated_name_wins() {
    let mut pod = training_pod();
    let first = pod["spec"]["containers"][0].clone();
    let with_gpus = |name: &str, devices: &str| {
        let mut c = first.clone();
        c["name"] = json!(name);
        c["env"] = json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": devices}]);
        c
    };
    // A malformed pod (the API server refuses repeated names, an offline manifest may
    // not): as in a JSON object, the last container of a name is the one reported.
    pod["spec"]["containers"] = json!([
        with_gpus("zeta", "0"),
        with_gpus("alpha", "1"),
        with_gpus("zeta", "2,3,4"),
    ]);
    let (answer, out) = rewrite(&pod, "ml", &source());
    assert_eq!(answer.summary.outcome, Outcome::Rewritten);
    let text = out["metadata"]["annotations"][ANNOTATION_REWRITTEN]
        .as_str()
        .unwrap();
    let alpha = text.find("\"alpha\"").unwrap();
    let zeta = text.find("\"zeta\"").unwrap();
    assert!(alpha < zeta, "sorted by name: {text}");
    assert_eq!(text.matches("\"zeta\"").count(), 1, "{text}");
    let report: Value = serde_json::from_str(text).unwrap();
    assert_eq!(
        report["containers"]["zeta"]["limits"]["nvidia.com/gpu"],
        "3"
    );
    assert_eq!(
        report["containers"]["alpha"]["limits"]["nvidia.com/gpu"],
        "1"
    );
    // Every container is still rewritten and warned about.
    for c in out["spec"]["containers"].as_array().unwrap() {
        assert_eq!(c["securityContext"]["privileged"], false, "{c}");
    }
    assert_eq!(answer.warnings().len(), 3, "{:?}", answer.warnings());
}

#[test]
fn capabilities_keep_allowed_and_defaults_and_name_the_refused() {
    let mut pod = training_pod();
    pod["spec"]["containers"][0]["securityContext"]["capabilities"] =
        json!({"add": ["SYS_ADMIN", "IPC_LOCK", "CAP_SYS_NICE", "NET_ADMIN"]});
    let src = StaticSource::new([policy("caps", |p| {
        p.spec.capabilities.default = vec!["SYS_PTRACE".into()];
    })]);
    let (answer, out) = rewrite(&pod, "ml", &src);
    let context = &out["spec"]["containers"][0]["securityContext"];
    assert_eq!(
        context["capabilities"],
        json!({"add": ["SYS_PTRACE", "IPC_LOCK", "SYS_NICE"]})
    );
    assert!(context.get("allowPrivilegeEscalation").is_none());
    let w = answer.warnings().join("\n");
    assert!(
        w.contains("NET_ADMIN,SYS_ADMIN dropped (not allowed)"),
        "{w}"
    );
    assert!(!w.contains("drop ALL"), "{w}");

    // What an ordinary container may ask for of the runtime's defaults it keeps asking for;
    // its own drop list stays.
    pod["spec"]["containers"][0]["securityContext"]["capabilities"] =
        json!({"add": ["CHOWN", "setuid", "NET_ADMIN"], "drop": ["ALL"]});
    let (answer, out) = rewrite(&pod, "ml", &src);
    let caps = &out["spec"]["containers"][0]["securityContext"]["capabilities"];
    assert_eq!(
        *caps,
        json!({"add": ["SYS_PTRACE", "CHOWN", "SETUID"], "drop": ["ALL"]})
    );
    let w = answer.warnings().join("\n");
    assert!(
        w.contains("capabilities NET_ADMIN dropped (not allowed)"),
        "{w}"
    );

    // dropAll: stricter than an ordinary container, and the warning says what then fails.
    let strict = StaticSource::new([policy("strict", |p| {
        p.spec.capabilities.drop_all = true;
        p.spec.capabilities.default = vec!["SYS_PTRACE".into()];
    })]);
    let (answer, out) = rewrite(&pod, "ml", &strict);
    let context = &out["spec"]["containers"][0]["securityContext"];
    assert_eq!(
        context["capabilities"],
        json!({"add": ["SYS_PTRACE"], "drop": ["ALL"]})
    );
    assert_eq!(context["allowPrivilegeEscalation"], false);
    let w = answer.warnings().join("\n");
    assert!(
        w.contains("capabilities CHOWN,NET_ADMIN,SETUID dropped (not allowed)"),
        "{w}"
    );
    assert!(
        answer.warnings().contains(&"gpuwarden: container trainer: drop ALL capabilities and privilege escalation (GpuPolicy capabilities.dropAll), so chown, su, sudo, gosu, supervisord and sshd's privilege separation fail there".to_owned()),
        "{w}"
    );
    let report: Value = serde_json::from_str(
        out["metadata"]["annotations"][ANNOTATION_REWRITTEN]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        report["containers"]["trainer"]["allowPrivilegeEscalation"],
        false
    );
}

/// What real images do at start is named at admission: each step a rewritten pod's
/// containers show, and what they keep or lose of what it needs under the policy in force.
#[test]
fn start_up_steps_are_named_with_what_they_keep_and_lose() {
    let mut pod = training_pod();
    pod["metadata"]["labels"]["training.kubeflow.org/job-role"] = json!("worker");
    pod["spec"]["containers"][0]["command"] = json!(["/usr/sbin/sshd", "-De"]);
    pod["spec"]["initContainers"] = json!([{"name": "setup", "image": "busybox",
        "command": ["sh", "-c", "chown -R 1000 /data && exec gosu app true"],
        "securityContext": {"capabilities": {"drop": ["CHOWN"]}}}]);
    let start_up = |answer: &Answer| {
        let steps: Vec<String> = (answer.warnings().into_iter())
            .filter(|w| w.starts_with("gpuwarden: at start, "))
            .collect();
        steps.join("\n")
    };
    let (answer, _) = rewrite(&pod, "ml", &source());
    assert_eq!(
        start_up(&answer),
        "gpuwarden: at start, container trainer runs sshd: keeps NET_BIND_SERVICE,SETUID,SETGID,SYS_CHROOT (a port below 1024, privilege separation and logging users in)\n\
         gpuwarden: at start, init container setup runs gosu: keeps SETUID,SETGID (switching users)\n\
         gpuwarden: at start, init container setup runs chown: loses CHOWN (changing file owners)"
    );
    // Stricter: the rewritten container loses what sshd needs, and the warning says so.
    let strict = StaticSource::new([policy("strict", |p| p.spec.capabilities.drop_all = true)]);
    let (answer, _) = rewrite(&pod, "ml", &strict);
    assert!(
        start_up(&answer).contains("at start, container trainer runs sshd: loses NET_BIND_SERVICE,SETUID,SETGID,SYS_CHROOT (a port below 1024, privilege separation and logging users in)"),
        "{:?}",
        answer.warnings()
    );
    // An MPI worker whose command says nothing, and a sudo under restricted.
    pod["spec"]["containers"][0]["command"] = json!(["/entrypoint.sh"]);
    pod["spec"]["containers"][0]["args"] = json!(["sudo -u app true"]);
    pod["spec"]
        .as_object_mut()
        .unwrap()
        .remove("initContainers");
    let src = source().with_namespace(
        "strict",
        &[("pod-security.kubernetes.io/enforce", "restricted")],
    );
    let (answer, _) = rewrite(&pod, "strict", &src);
    assert_eq!(
        start_up(&answer),
        "gpuwarden: at start, container trainer runs sudo: loses SETUID,SETGID,allowPrivilegeEscalation (switching users)\n\
         gpuwarden: at start, container trainer is an MPI worker (sshd): loses NET_BIND_SERVICE,SETUID,SETGID,SYS_CHROOT (a port below 1024, privilege separation and logging users in)"
    );
    pod["spec"]["containers"][0]
        .as_object_mut()
        .unwrap()
        .remove("args");
    let (answer, _) = rewrite(&pod, "ml", &source());
    assert_eq!(
        start_up(&answer),
        "gpuwarden: at start, container trainer is an MPI worker (sshd): keeps NET_BIND_SERVICE,SETUID,SETGID,SYS_CHROOT (a port below 1024, privilege separation and logging users in)"
    );
    // A pod that is not rewritten gets no such warning.
    pod["spec"]["containers"][0]["securityContext"] = json!({});
    pod["spec"]["containers"][0]["env"] = json!([]);
    let (answer, _) = rewrite(&pod, "ml", &source());
    assert_eq!(start_up(&answer), "", "{:?}", answer.warnings());
}

#[test]
fn gpu_count_comes_from_annotation_then_visible_devices_then_default() {
    let set_visible = |pod: &mut Value, v: &str| {
        pod["spec"]["containers"][0]["env"][0]["value"] = json!(v);
    };
    let count = |pod: &Value| {
        let (_, out) = rewrite(pod, "ml", &source());
        out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"].clone()
    };
    let mut pod = training_pod();
    set_visible(&mut pod, "0,1");
    assert_eq!(count(&pod), "2");
    set_visible(&mut pod, "GPU-8f2c3b1a-1111-2222-3333-444455556666");
    assert_eq!(count(&pod), "1");
    set_visible(
        &mut pod,
        "MIG-2a3b4c5d-aaaa-bbbb-cccc-ddddeeeeffff,MIG-3a3b4c5d-aaaa-bbbb-cccc-ddddeeeeffff,2",
    );
    assert_eq!(count(&pod), "3");
    pod["metadata"]["annotations"] = json!({"gpuwarden.io/gpu-count": "4"});
    assert_eq!(count(&pod), "4");
    pod["metadata"]["annotations"]["gpuwarden.io/gpu-count.trainer"] = json!("6");
    assert_eq!(count(&pod), "6");

    // No signal for the count at all (GPU via a hostPath mount): defaultCount.
    let src = StaticSource::new([policy("two", |p| p.spec.gpu.default_count = 2)]);
    let mut pod = training_pod();
    pod["spec"]["containers"][0]["env"] = json!([]);
    pod["spec"]["containers"][0]["volumeMounts"] =
        json!([{"name": "nv", "mountPath": "/dev/nvidia0"}]);
    pod["spec"]["volumes"] = json!([{"name": "nv", "hostPath": {"path": "/dev/nvidia0"}}]);
    let (_, out) = rewrite(&pod, "ml", &src);
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "2"
    );
}

#[test]
fn existing_gpu_limits_are_kept_and_the_pointer_is_escaped() {
    let mut pod = training_pod();
    pod["spec"]["containers"][0]["resources"]["limits"] = json!({"nvidia.com/mig-1g.10gb": 1});
    let (answer, out) = rewrite(&pod, "ml", &source());
    let limits = &out["spec"]["containers"][0]["resources"]["limits"];
    assert_eq!(limits, &json!({"nvidia.com/mig-1g.10gb": 1}));
    assert!(answer.patch.is_some());

    // A limits object without GPUs: the limit is added at an escaped pointer.
    let mut pod = training_pod();
    pod["spec"]["containers"][0]["resources"]["limits"] = json!({"memory": "16Gi"});
    let (answer, out) = rewrite(&pod, "ml", &source());
    let patch = serde_json::to_string(answer.patch.as_ref().unwrap()).unwrap();
    assert!(
        patch.contains("/resources/limits/nvidia.com~1gpu"),
        "{patch}"
    );
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["limits"]["memory"],
        "16Gi"
    );

    // A GPU request without a limit gets the same limit (extended resources need both).
    let mut pod = training_pod();
    pod["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] = json!("3");
    let (_, out) = rewrite(&pod, "ml", &source());
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "3"
    );
}

#[test]
fn missing_parents_are_created() {
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "bare"},
        "spec": {"containers": [{
            "name": "c", "image": "cuda:12",
            "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"}],
            "securityContext": {"privileged": true}
        }]}
    });
    let (_, out) = rewrite(&pod, "default", &source());
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "1"
    );
    assert!(out["metadata"]["annotations"][ANNOTATION_REWRITTEN].is_string());

    // A pod whose only GPU signal is the limit, with no env at all.
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "bare"},
        "spec": {"containers": [{
            "name": "c", "image": "cuda:12",
            "resources": {"limits": {"nvidia.com/gpu": "1"}},
            "securityContext": {"privileged": true}
        }]}
    });
    let (_, out) = rewrite(&pod, "default", &source());
    let c = &out["spec"]["containers"][0];
    assert_eq!(
        env_value(c, "NVIDIA_DRIVER_CAPABILITIES"),
        Some("compute,utility")
    );
}

#[test]
fn too_many_gpus_and_visible_all_can_be_denials() {
    let mut pod = training_pod();
    pod["spec"]["containers"][0]["env"][0]["value"] = json!("0,1,2,3,4,5,6,7,8");
    let answer = review_pod(&pod, "ml", &source());
    assert!(!answer.allowed());
    assert_eq!(answer.summary.outcome, Outcome::Denied);
    assert!(answer.message().contains("9 GPUs"), "{}", answer.message());
    assert!(
        answer.message().contains("maxPerContainer 8"),
        "{}",
        answer.message()
    );
    assert_eq!(answer.response()["status"]["code"], 403);

    let src = StaticSource::new([policy("strict", |p| {
        p.spec.gpu.visible_devices_all = VisibleDevicesAll::Deny;
    })]);
    let answer = review_pod(&training_pod(), "ml", &src);
    assert!(!answer.allowed());
    assert!(
        answer
            .message()
            .contains("NVIDIA_VISIBLE_DEVICES=all is not allowed"),
        "{}",
        answer.message()
    );
    // The count annotation makes it admissible.
    let mut pod = training_pod();
    pod["metadata"]["annotations"] = json!({"gpuwarden.io/gpu-count": "2"});
    let (answer, _) = rewrite(&pod, "ml", &src);
    assert!(answer.allowed());

    // A bad count annotation is a clear denial, not a panic or a silent default.
    pod["metadata"]["annotations"] = json!({"gpuwarden.io/gpu-count": "two"});
    let answer = review_pod(&pod, "ml", &source());
    assert!(!answer.allowed());
    assert!(
        answer.message().contains("gpuwarden.io/gpu-count"),
        "{}",
        answer.message()
    );
}

#[test]
fn privileged_sidecar_loses_privilege_and_gets_void() {
    let mut pod = training_pod();
    pod["spec"]["containers"].as_array_mut().unwrap().extend([
        json!({
            "name": "log-shipper", "image": "fluent/fluent-bit:3.0",
            "env": [{"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"}],
            "securityContext": {"privileged": true, "capabilities": {"add": ["SYS_ADMIN"]}}
        }),
        json!({"name": "plain", "image": "busybox", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]}),
    ]);
    let (answer, out) = rewrite(&pod, "ml", &source());
    let sidecar = &out["spec"]["containers"][1];
    assert_eq!(sidecar["securityContext"]["privileged"], false);
    assert_eq!(env_value(sidecar, "NVIDIA_VISIBLE_DEVICES"), Some("void"));
    assert!(!env_names(sidecar).contains(&"NVIDIA_MIG_MONITOR_DEVICES".to_owned()));
    assert!(
        sidecar["resources"].is_null(),
        "a non-GPU container gets no GPU"
    );
    assert_eq!(
        out["spec"]["containers"][2], pod["spec"]["containers"][2],
        "unprivileged container untouched"
    );
    assert_eq!(answer.warnings().len(), 2, "{:?}", answer.warnings());

    // Without a privileged or leaking GPU container a privileged sidecar is none of our
    // business.
    let mut pod = training_pod();
    pod["spec"]["containers"][0]["securityContext"]["privileged"] = json!(false);
    pod["spec"]["containers"][0]["env"] = json!([]);
    pod["spec"]["containers"].as_array_mut().unwrap().push(json!({
        "name": "sidecar", "image": "istio/proxyv2:1.22", "securityContext": {"privileged": true}
    }));
    let answer = review_pod(&pod, "ml", &source());
    assert!(answer.allowed());
    // The unprivileged container gets the void rule's entry, the sidecar keeps privilege.
    assert_eq!(answer.voided_only(), ["/spec/containers/0"]);
    assert_eq!(answer.summary.outcome, Outcome::Voided);

    // With match All it counts as a GPU container.
    let src = StaticSource::new([policy("all", |p| {
        p.spec.match_.privileged_containers = PrivilegedMatch::All
    })]);
    let (_, out) = rewrite(&pod, "ml", &src);
    assert_eq!(
        out["spec"]["containers"][1]["resources"]["limits"]["nvidia.com/gpu"],
        "1"
    );

    // But not one that says it wants no GPU: under All, none, void and empty still mean none.
    for value in ["none", " VOID ", ""] {
        let mut pod = pod.clone();
        pod["spec"]["containers"][1]["env"] =
            json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": value}]);
        pod["spec"]["containers"][0]["securityContext"]["privileged"] = json!(true);
        let (_, out) = rewrite(&pod, "ml", &src);
        let sidecar = &out["spec"]["containers"][1];
        assert_eq!(sidecar["securityContext"]["privileged"], false, "{value:?}");
        assert!(sidecar["resources"].is_null(), "{value:?}: {sidecar}");
        assert_eq!(
            env_value(sidecar, "NVIDIA_VISIBLE_DEVICES"),
            Some("void"),
            "{value:?}"
        );
    }
}

#[test]
fn device_host_paths_go_unless_an_exempt_container_mounts_them() {
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "hostdev", "namespace": "gpu-operator"},
        "spec": {
            "containers": [
                {"name": "app", "image": "cuda:12",
                 "volumeMounts": [{"name": "nvidia0", "mountPath": "/dev/nvidia0"}, {"name": "data", "mountPath": "/data"}, {"name": "dri", "mountPath": "/dev/dri"}],
                 "securityContext": {"privileged": true}},
                {"name": "exporter", "image": "nvcr.io/nvidia/k8s/dcgm-exporter:3.3.5-3.4.0-ubuntu22.04",
                 "volumeMounts": [{"name": "dri", "mountPath": "/dev/dri"}],
                 "securityContext": {"privileged": true}}
            ],
            "volumes": [
                {"name": "nvidia0", "hostPath": {"path": "/dev/nvidia0", "type": "CharDevice"}},
                {"name": "data", "emptyDir": {}},
                {"name": "dri", "hostPath": {"path": "/dev/dri"}},
                {"name": "shm", "hostPath": {"path": "/dev/shm"}}
            ]
        }
    });
    // The exporter is exempt in the GPU Operator's namespace, where the rest is governed.
    let (_, out) = rewrite(&pod, "gpu-operator", &source());
    let names: Vec<&str> = out["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["data", "dri", "shm"]);
    let mounts: Vec<&str> = out["spec"]["containers"][0]["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(mounts, ["data"]);
    assert_eq!(
        out["spec"]["containers"][1], pod["spec"]["containers"][1],
        "exempt image untouched"
    );
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "1"
    );

    let src = StaticSource::new([policy("keep", |p| p.spec.strip_device_host_paths = false)]);
    let (_, out) = rewrite(&pod, "ml", &src);
    assert_eq!(out["spec"]["volumes"], pod["spec"]["volumes"]);
}

#[test]
fn cdi_annotations_are_a_signal_and_are_removed() {
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "cdi", "annotations": {"cdi.k8s.io/gpus": "nvidia.com/gpu=all", "team": "vision"}},
        "spec": {"containers": [{"name": "c", "image": "cuda:12", "securityContext": {"privileged": true}}]}
    });
    let (_, out) = rewrite(&pod, "default", &source());
    let annotations = out["metadata"]["annotations"].as_object().unwrap();
    assert!(!annotations.contains_key("cdi.k8s.io/gpus"));
    assert_eq!(annotations["team"], "vision");
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "1"
    );

    let src = StaticSource::new([policy("keepcdi", |p| p.spec.strip_cdi_annotations = false)]);
    let (_, out) = rewrite(&pod, "default", &src);
    assert!(out["metadata"]["annotations"]["cdi.k8s.io/gpus"].is_string());
}

#[test]
fn init_containers_are_rewritten_too() {
    let mut pod = training_pod();
    pod["spec"]["initContainers"] = json!([{
        "name": "warmup", "image": "cuda:12",
        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"}],
        "securityContext": {"privileged": true}
    }]);
    let (answer, out) = rewrite(&pod, "ml", &source());
    let init = &out["spec"]["initContainers"][0];
    assert_eq!(init["securityContext"]["privileged"], false);
    assert_eq!(init["resources"]["limits"]["nvidia.com/gpu"], "1");
    assert!(
        answer
            .warnings()
            .iter()
            .any(|w| w.contains("init container warmup"))
    );
    let report: Value = serde_json::from_str(
        out["metadata"]["annotations"][ANNOTATION_REWRITTEN]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(report["containers"]["warmup"]["kind"], "init");
}

#[test]
fn audit_mode_only_annotates_and_warns() {
    let src = StaticSource::new([policy("audit", |p| p.spec.mode = PolicyMode::Audit)]);
    let pod = training_pod();
    let (answer, out) = rewrite(&pod, "ml", &src);
    assert!(answer.allowed());
    assert_eq!(answer.summary.outcome, Outcome::Audited);
    assert_eq!(
        out["spec"], pod["spec"],
        "Audit changes nothing in the spec"
    );
    let audit: Value = serde_json::from_str(
        out["metadata"]["annotations"][ANNOTATION_AUDIT]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        audit["containers"]["trainer"]["limits"]["nvidia.com/gpu"],
        "1"
    );
    assert!(
        out["metadata"]["annotations"]
            .get(ANNOTATION_REWRITTEN)
            .is_none()
    );
    assert!(
        answer
            .warnings()
            .iter()
            .any(|w| w.starts_with("gpuwarden audit: container trainer")),
        "{:?}",
        answer.warnings()
    );
    assert_eq!(answer.response()["auditAnnotations"]["decision"], "audited");
}

#[test]
fn deny_mode_names_each_change_and_the_offline_command() {
    let src = StaticSource::new([policy("deny", |p| p.spec.mode = PolicyMode::Deny)]);
    let answer = review_pod(&training_pod(), "ml", &src);
    assert!(!answer.allowed());
    assert_eq!(answer.summary.outcome, Outcome::Denied);
    let m = answer.message();
    assert!(m.contains("ml/train"), "{m}");
    assert!(m.contains("deny@1"), "{m}");
    assert!(m.contains("container trainer: privileged removed"), "{m}");
    assert!(m.contains("requests nvidia.com/gpu=1"), "{m}");
    assert!(m.contains("env NVIDIA_VISIBLE_DEVICES removed"), "{m}");
    assert!(m.contains("gpuwarden-webhook mutate -f"), "{m}");
    assert!(answer.patch.is_none());
}

#[test]
fn exemptions_by_namespace_service_account_and_image() {
    let pod = training_pod();
    for ns in ["kube-system", "gpuwarden-system"] {
        let answer = review_pod(&pod, ns, &source());
        assert_eq!(answer.summary.outcome, Outcome::Exempt, "{ns}");
        assert!(answer.allowed() && answer.patch.is_none());
    }
    let src = StaticSource::new([policy("sa", |p| {
        p.spec.exemptions.service_accounts = vec!["ml/trainer".into()]
    })]);
    let answer = review_pod(&pod, "ml", &src);
    assert_eq!(answer.summary.outcome, Outcome::Exempt);
    // The same service account name in another namespace is not exempt.
    let answer = review_pod(&pod, "other", &src);
    assert_eq!(answer.summary.outcome, Outcome::Rewritten);

    let src = StaticSource::new([policy("img", |p| {
        p.spec.exemptions.containers = vec![gpuwarden_crds::ContainerExemption {
            images: vec!["nvcr.io/nvidia/pytorch:*".into()],
            namespaces: vec!["ml".into()],
            ..Default::default()
        }]
    })]);
    let answer = review_pod(&pod, "ml", &src);
    assert_eq!(answer.summary.outcome, Outcome::Exempt);
    assert!(answer.patch.is_none());
    // Only where the exemption says.
    let answer = review_pod(&pod, "research", &src);
    assert_eq!(answer.summary.outcome, Outcome::Rewritten);

    // A pod cannot exempt itself with labels or annotations.
    let mut pod = training_pod();
    pod["metadata"]["labels"]["gpuwarden.io/exempt"] = json!("true");
    pod["metadata"]["annotations"] =
        json!({"gpuwarden.io/exempt": "true", ANNOTATION_REWRITTEN: "{}"});
    let answer = review_pod(&pod, "ml", &source());
    assert_eq!(answer.summary.outcome, Outcome::Rewritten);
}

#[test]
fn policy_selection_by_namespace_labels_pod_labels_and_priority() {
    let team = LabelSelector {
        match_labels: Some(labels(&[("team", "research")])),
        ..Default::default()
    };
    let audit = policy("research-audit", |p| {
        p.spec.priority = 10;
        p.spec.mode = PolicyMode::Audit;
        p.spec.namespace_selector = team.clone();
    });
    let deny = policy("prod-deny", |p| {
        p.spec.priority = 20;
        p.spec.mode = PolicyMode::Deny;
        p.spec.namespace_selector = LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "kubernetes.io/metadata.name".into(),
                operator: "In".into(),
                values: Some(vec!["prod".into()]),
            }]),
            ..Default::default()
        };
        p.spec.pod_selector = Some(LabelSelector {
            match_labels: Some(labels(&[("app", "train")])),
            ..Default::default()
        });
    });
    let src = StaticSource::new([default_policy(), audit, deny])
        .with_namespace("ml", &[("team", "research")]);
    let pod = training_pod();
    assert_eq!(
        review_pod(&pod, "ml", &src).summary.policy.as_deref(),
        Some("research-audit@1")
    );
    // Unknown namespace "prod": the API server's name label still selects it.
    assert_eq!(
        review_pod(&pod, "prod", &src).summary.outcome,
        Outcome::Denied
    );
    // The podSelector narrows: another pod in prod falls to the next policy, not out.
    let mut other = training_pod();
    other["metadata"]["labels"] = json!({"app": "other"});
    assert_eq!(
        review_pod(&other, "prod", &src).summary.policy.as_deref(),
        Some("default@1")
    );
    assert_eq!(
        review_pod(&other, "prod", &src).summary.outcome,
        Outcome::Rewritten
    );

    // Ties go to the name that sorts first.
    let a = policy("a-audit", |p| {
        p.spec.priority = 5;
        p.spec.mode = PolicyMode::Audit;
    });
    let b = policy("b-deny", |p| {
        p.spec.priority = 5;
        p.spec.mode = PolicyMode::Deny;
    });
    let src = StaticSource::new([b, a]);
    assert_eq!(
        review_pod(&pod, "ml", &src).summary.policy.as_deref(),
        Some("a-audit@1")
    );

    // No policy selects the pod: allowed unchanged.
    let src = StaticSource::new([policy("only-prod", |p| {
        p.spec.namespace_selector = LabelSelector {
            match_labels: Some(labels(&[("env", "prod")])),
            ..Default::default()
        }
    })]);
    let answer = review_pod(&pod, "ml", &src);
    assert_eq!(answer.summary.outcome, Outcome::Allowed);
    assert_eq!(answer.summary.policy, None);
    assert!(answer.patch.is_none());
}

#[test]
fn an_invalid_policy_fails_closed_where_it_could_govern() {
    // A selector that cannot be read could select any namespace: every pod it outranks
    // that it would judge is denied with the reason, not handed to the next policy.
    let broken = policy("broken", |p| {
        p.spec.priority = 100;
        p.spec.mode = PolicyMode::Deny;
        p.spec.namespace_selector = LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "team".into(),
                operator: "Equals".into(),
                values: Some(vec!["x".into()]),
            }]),
            ..Default::default()
        };
    });
    let src = StaticSource::new([broken, default_policy()]);
    let answer = review_pod(&training_pod(), "ml", &src);
    assert!(!answer.allowed());
    assert!(answer.patch.is_none());
    assert_eq!(answer.summary.policy.as_deref(), Some("broken@1"));
    let message = answer.message();
    assert!(
        message.starts_with(
            "gpuwarden: pod ml/train is denied: GpuPolicy broken is invalid (InvalidSelector: spec.namespaceSelector"
        ) && message.contains("fails closed"),
        "{message}"
    );
    let audit = &answer.response()["auditAnnotations"];
    assert_eq!(audit["decision"], "denied");
    assert!(
        audit["reason"]
            .as_str()
            .unwrap_or_default()
            .starts_with("GpuPolicy broken is invalid")
    );
    // What it would not judge passes: an unprivileged pod, and a privileged pod with no
    // GPU signal.
    let mut unprivileged = training_pod();
    unprivileged["spec"]["containers"][0]["securityContext"] = json!({"privileged": false});
    unprivileged["spec"]["containers"][0]["env"] = json!([]);
    assert!(review_pod(&unprivileged, "ml", &src).allowed());
    let fuse = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "fuse"},
        "spec": {"containers": [{"name": "c", "image": "fuse", "securityContext": {"privileged": true}}]}});
    let answer = review_pod(&fuse, "ml", &src);
    assert!(
        answer.allowed() && answer.patch.is_none(),
        "{:?}",
        answer.review
    );

    // A policy with a problem of its own (an unknown capability) fails closed only where
    // its valid selectors choose, and its namespace exemptions still hold; its image
    // exemptions do not.
    let careless = policy("careless", |p| {
        p.spec.priority = 10;
        p.spec.namespace_selector = LabelSelector {
            match_labels: Some(BTreeMap::from([("team".into(), "a".into())])),
            ..Default::default()
        };
        p.spec.capabilities.allowed.push("SYS_WIZARD".into());
        p.spec.exemptions.namespaces = vec!["team-a-ops".into()];
    });
    let src = StaticSource::new([careless, default_policy()])
        .with_namespace("team-a", &[("team", "a")])
        .with_namespace("team-a-ops", &[("team", "a")]);
    let answer = review_pod(&training_pod(), "team-a", &src);
    assert!(
        answer.message().contains("GpuPolicy careless is invalid (UnknownCapability: spec.capabilities.allowed: unknown Linux capabilities SYS_WIZARD"),
        "{}",
        answer.message()
    );
    assert!(review_pod(&training_pod(), "team-a-ops", &src).allowed());
    let mut dcgm = training_pod();
    dcgm["spec"]["containers"][0]["image"] = json!("nvcr.io/nvidia/k8s/dcgm-exporter:3.3.5");
    assert!(!review_pod(&dcgm, "team-a", &src).allowed());
    // Elsewhere the default policy governs as usual.
    let (answer, _) = rewrite(&training_pod(), "ml", &src);
    assert_eq!(answer.summary.policy.as_deref(), Some("default@1"));
}

#[test]
fn unprivileged_and_non_gpu_pods_pass_unchanged() {
    let mut pod = training_pod();
    pod["spec"]["containers"][0]["securityContext"] = json!({"privileged": false});
    pod["spec"]["containers"][0]["env"] =
        json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]);
    pod["spec"]["containers"][0]["resources"]["limits"] = json!({"nvidia.com/gpu": "1"});
    let answer = review_pod(&pod, "ml", &source());
    assert!(answer.allowed() && answer.patch.is_none());
    assert!(answer.warnings().is_empty());

    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "nginx", "securityContext": {"privileged": true},
                                 "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]}]}});
    let answer = review_pod(&pod, "ml", &source());
    assert!(answer.allowed() && answer.patch.is_none());
}

/// HAMi's webhook runs after gpuwarden's: a container that asks only for device memory
/// (`nvidia.com/gpumem`) holds no GPU resource on gpuwarden's first pass and is voided, then
/// HAMi adds `nvidia.com/gpu: 1`. Called again, gpuwarden removes its `void`, which would
/// override the UUID HAMi's device plugin sets; a container that still holds no GPU keeps
/// its `void`, and a zero limit is no GPU.
#[test]
fn a_void_beside_a_gpu_another_webhook_added_is_removed() {
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "vgpu"},
        "spec": {"containers": [
            {"name": "main", "image": "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04",
             "resources": {"limits": {"nvidia.com/gpumem": "3000"}}},
            {"name": "log", "image": "busybox"}]}});
    let (first, voided) = rewrite(&pod, "ml", &source());
    assert_eq!(first.summary.outcome, Outcome::Voided);
    for c in voided["spec"]["containers"].as_array().expect("containers") {
        assert_eq!(env_value(c, "NVIDIA_VISIBLE_DEVICES"), Some("void"), "{c}");
    }

    // HAMi's webhook, as it mutates such a pod (pkg/device/nvidia/device.go MutateAdmission).
    let mut after_hami = voided.clone();
    after_hami["spec"]["schedulerName"] = json!("hami-scheduler");
    let limits = &mut after_hami["spec"]["containers"][0]["resources"]["limits"];
    limits["nvidia.com/gpu"] = json!("1");
    let (again, out) = rewrite(&after_hami, "ml", &source());
    assert_eq!(again.summary.outcome, Outcome::Voided);
    let main = &out["spec"]["containers"][0];
    assert_eq!(env_value(main, "NVIDIA_VISIBLE_DEVICES"), None, "{main}");
    assert_eq!(
        main["resources"],
        after_hami["spec"]["containers"][0]["resources"]
    );
    let log = &out["spec"]["containers"][1];
    assert_eq!(env_value(log, "NVIDIA_VISIBLE_DEVICES"), Some("void"));
    assert_eq!(
        again.warnings(),
        [
            "gpuwarden: main: NVIDIA_VISIBLE_DEVICES=void removed, as it holds nvidia.com/gpu: the entry would hide the GPUs the kubelet allocates"
        ]
    );
    // A third pass changes nothing.
    let third = review_pod(&out, "ml", &source());
    assert!(
        third.allowed() && third.patch.is_none(),
        "{:?}",
        third.warnings()
    );

    // Only `void`, only beside a GPU limit other than 0, only in Enforce.
    let mut zero = after_hami.clone();
    zero["spec"]["containers"][0]["resources"]["limits"] = json!({"nvidia.com/gpu": "0"});
    assert!(review_pod(&zero, "ml", &source()).patch.is_none());
    let audit = StaticSource::new([policy("default", |p| p.spec.mode = PolicyMode::Audit)]);
    assert!(review_pod(&after_hami, "ml", &audit).patch.is_none());
    let mut none = after_hami;
    none["spec"]["containers"][0]["env"][0]["value"] = json!("none");
    assert!(review_pod(&none, "ml", &source()).patch.is_none());
}

/// A pod asking KAI-Scheduler for part of a GPU is told, at admission, what gpuwarden does
/// with it and what to do; the same annotation on a pod for another scheduler says nothing.
#[test]
fn a_kai_fraction_pod_is_told_why_and_what_to_do() {
    let pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "share", "annotations": {"gpu-fraction": "0.5"}},
        "spec": {"schedulerName": "kai-scheduler", "containers": [
            {"name": "main", "image": "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"}]}});
    let answer = review_pod(&pod, "ml", &source());
    assert!(answer.allowed());
    let warnings = answer.warnings();
    assert!(
        warnings
            .iter()
            .any(|w| w.starts_with("gpuwarden: KAI-Scheduler GPU fraction: ")
                && w.ends_with("(gpu.sharing.kai; see docs/sharing.md)")),
        "{warnings:?}"
    );
    let mut other = pod;
    other["spec"]["schedulerName"] = json!("default-scheduler");
    let warnings = review_pod(&other, "ml", &source()).warnings();
    assert!(!warnings.iter().any(|w| w.contains("KAI")), "{warnings:?}");
}

/// KAI-Scheduler's webhook as it mutates a fraction pod at CREATE (v0.17.0,
/// pkg/admission/webhook/v1alpha2/gpusharing, pkg/binder/common/env_vars.go): the ConfigMap
/// prefix annotation, `runtimeClassName: nvidia`, and in the fraction container (`index` of
/// `list`) its entries replacing any of the same name, from `<prefix>-<[i]index>`, and the
/// `-evar` envFrom.
fn kai_webhook(pod: &Value, list: &str, index: usize) -> Value {
    let mut pod = pod.clone();
    let prefix = "share-x7k2pqr-shared-gpu";
    pod["metadata"]["annotations"]["runai/shared-gpu-configmap"] = json!(prefix);
    pod["spec"]["runtimeClassName"] = json!("nvidia");
    let init = if list == "initContainers" { "i" } else { "" };
    let map = format!("{prefix}-{init}{index}");
    let container = &mut pod["spec"][list][index];
    let names = ["NVIDIA_VISIBLE_DEVICES", "RUNAI_NUM_OF_GPUS", "GPU_PORTION"];
    let mut env: Vec<Value> = (container["env"].as_array().cloned().unwrap_or_default())
        .into_iter()
        .filter(|e| !names.iter().any(|n| e["name"] == *n))
        .collect();
    env.extend(
        names
            .map(|n| json!({"name": n, "valueFrom": {"configMapKeyRef": {"name": map, "key": n}}})),
    );
    container["env"] = json!(env);
    let mut env_from = container["envFrom"].as_array().cloned().unwrap_or_default();
    env_from.push(json!({"configMapRef": {"name": format!("{map}-evar"), "optional": false}}));
    container["envFrom"] = json!(env_from);
    pod
}

/// Under a policy that names KAI (`gpu.sharing.kai`), KAI's fraction container keeps the
/// GPU KAI's webhook gives it, on gpuwarden's pass after KAI's; every other shape of the
/// same fields, which a tenant can write, is judged as before (docs/design.md,
/// "GPU-sharing schedulers").
#[test]
fn a_kai_grant_is_kept_where_the_policy_names_kai_and_nothing_like_it() {
    let kai = StaticSource::new([policy("default", |p| {
        p.spec.gpu.sharing = Some(gpuwarden_crds::SharingSpec {
            kai: Some(gpuwarden_crds::KaiSharing::default()),
        });
    })]);
    let pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "share", "annotations": {"gpu-fraction": "0.5"}},
        "spec": {"schedulerName": "kai-scheduler", "containers": [
            {"name": "main", "image": "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"},
            {"name": "log", "image": "busybox"}]}});
    // First pass: voided like any container without a GPU, and told why that is fine.
    let (first, voided) = rewrite(&pod, "ml", &kai);
    assert_eq!(first.summary.outcome, Outcome::Voided);
    let warnings = first.warnings();
    assert!(
        warnings.iter().any(|w| w.contains("the policy names KAI")),
        "{warnings:?}"
    );
    // After KAI's webhook: admitted as it is, and nothing said.
    let after_kai = kai_webhook(&voided, "containers", 0);
    let answer = review_pod(&after_kai, "ml", &kai);
    assert!(
        answer.allowed() && answer.patch.is_none(),
        "{}",
        answer.message()
    );
    assert_eq!(answer.warnings(), Vec::<String>::new());
    // The same under the default policy, which does not name KAI: denied, and told why.
    let denied = review_pod(&after_kai, "ml", &source());
    assert!(!denied.allowed());
    assert!(
        denied.message().contains("gpu.sharing.kai"),
        "{}",
        denied.message()
    );
    // An init container picked by name.
    let mut init = pod.clone();
    init["metadata"]["annotations"]["gpu-fraction-container-name"] = json!("prep");
    init["spec"]["initContainers"] =
        json!([{"name": "prep", "image": "nvidia/cuda:13.0.2-base-ubi8"}]);
    let (_, voided) = rewrite(&init, "ml", &kai);
    let answer = review_pod(&kai_webhook(&voided, "initContainers", 0), "ml", &kai);
    assert!(
        answer.allowed() && answer.patch.is_none(),
        "{}",
        answer.message()
    );

    // What a tenant can write that is not KAI's grant: each is judged as a leak.
    let forged: Vec<(&str, Value)> = vec![
        ("a pod that names its node", {
            let mut p = after_kai.clone();
            p["spec"]["nodeName"] = json!("node-1");
            p
        }),
        ("another scheduler", {
            let mut p = after_kai.clone();
            p["spec"]["schedulerName"] = json!("default-scheduler");
            p
        }),
        ("no fraction asked", {
            let mut p = after_kai.clone();
            p["metadata"]["annotations"]
                .as_object_mut()
                .unwrap()
                .remove("gpu-fraction");
            p
        }),
        ("a map KAI would not name", {
            let mut p = after_kai.clone();
            p["spec"]["containers"][0]["env"][0]["valueFrom"]["configMapKeyRef"]["name"] =
                json!("tenant-gpus");
            p
        }),
        ("a prefix outside the guarded names", {
            let mut p = after_kai.clone();
            p["metadata"]["annotations"]["runai/shared-gpu-configmap"] = json!("tenant");
            p["spec"]["containers"][0]["env"][0]["valueFrom"]["configMapKeyRef"]["name"] =
                json!("tenant-0");
            p
        }),
        ("an optional reference", {
            let mut p = after_kai.clone();
            p["spec"]["containers"][0]["env"][0]["valueFrom"]["configMapKeyRef"]["optional"] =
                json!(true);
            p
        }),
        (
            "the reference in another container",
            kai_webhook(&first_pass(&pod, &kai), "containers", 1),
        ),
        ("a privileged fraction container", {
            let mut p = after_kai.clone();
            p["spec"]["containers"][0]["securityContext"] = json!({"privileged": true});
            p
        }),
        ("a fraction container holding a GPU too", {
            let mut p = after_kai.clone();
            p["spec"]["containers"][0]["resources"] = json!({"limits": {"nvidia.com/gpu": "1"}});
            p
        }),
        ("its own value after KAI's", {
            let mut p = after_kai.clone();
            let env = p["spec"]["containers"][0]["env"].as_array_mut().unwrap();
            env.push(json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}));
            p
        }),
    ];
    for (what, pod) in forged {
        let answer = review_pod(&pod, "ml", &kai);
        assert!(
            !(answer.allowed() && answer.patch.is_none()),
            "{what}: admitted as it is"
        );
    }
}

/// The pod after gpuwarden's first pass, for KAI's webhook to act on.
fn first_pass(pod: &Value, source: &StaticSource) -> Value {
    rewrite(pod, "ml", source).1
}

/// Door 1 of the leaks: an unprivileged container that names GPUs through the runtime's
/// own channels (NVIDIA_VISIBLE_DEVICES, MIG access variables, device-list mounts, an
/// NVIDIA CDI annotation) gets them only through the kubelet after the rewrite.
#[test]
fn unprivileged_leaks_become_explicit_requests() {
    let unprivileged = |env: Value| {
        let mut pod = training_pod();
        pod["spec"]["containers"][0]["securityContext"] = json!({"runAsUser": 1000});
        pod["spec"]["containers"][0]["env"] = env;
        pod
    };
    // NVIDIA_VISIBLE_DEVICES=all: the policy's default, the variable gone, the security
    // context as it was.
    let pod = unprivileged(json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
        {"name": "NVIDIA_MIG_CONFIG_DEVICES", "value": "all"}]));
    let (answer, out) = rewrite(&pod, "ml", &source());
    let c = &out["spec"]["containers"][0];
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "1");
    assert_eq!(c["securityContext"], json!({"runAsUser": 1000}));
    assert_eq!(env_names(c), ["NVIDIA_DRIVER_CAPABILITIES"]);
    let warnings = answer.warnings();
    assert_eq!(
        warnings,
        [
            "gpuwarden: container trainer: requests nvidia.com/gpu=1 (NVIDIA_VISIBLE_DEVICES=all, policy default); env NVIDIA_VISIBLE_DEVICES,NVIDIA_MIG_CONFIG_DEVICES removed; NVIDIA_DRIVER_CAPABILITIES=compute,utility"
        ]
    );

    // Two IDs: two GPUs. Beside a GPU limit the variable still goes, since the kubelet puts
    // the container's own value after the device plugin's and the runtime reads the last.
    let pod = unprivileged(json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,1"}]));
    let (_, out) = rewrite(&pod, "ml", &source());
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "2"
    );
    let mut limited = unprivileged(json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]));
    limited["spec"]["containers"][0]["resources"]["limits"] = json!({"nvidia.com/gpu": "1"});
    let (_, out) = rewrite(&limited, "ml", &source());
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["limits"],
        json!({"nvidia.com/gpu": "1"})
    );
    assert_eq!(
        env_names(&out["spec"]["containers"][0]),
        ["NVIDIA_DRIVER_CAPABILITIES"]
    );

    // Device-list mounts (the toolkit's volume-mounts strategy, from any volume): each
    // named device counts once, and the mounts go; other mounts stay.
    let mut mounts = unprivileged(json!([]));
    mounts["spec"]["volumes"] = json!([{"name": "empty", "emptyDir": {}}]);
    mounts["spec"]["containers"][0]["volumeMounts"] = json!([
        {"name": "empty", "mountPath": "/data"},
        {"name": "empty", "mountPath": "/var/run/nvidia-container-devices/0"},
        {"name": "empty", "mountPath": "/var/run//nvidia-container-devices/GPU-1234/"},
        {"name": "empty", "mountPath": "/var/run/nvidia-container-devices/0"}
    ]);
    let (answer, out) = rewrite(&mounts, "ml", &source());
    let c = &out["spec"]["containers"][0];
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "2");
    assert_eq!(
        c["volumeMounts"],
        json!([{"name": "empty", "mountPath": "/data"}])
    );
    let changes = answer.response()["auditAnnotations"]["changes"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        changes.contains("requests nvidia.com/gpu=2 (device-list mounts under /var/run/nvidia-container-devices)")
            && changes.contains("device-list mount /var/run/nvidia-container-devices/0,/var/run//nvidia-container-devices/GPU-1234/,/var/run/nvidia-container-devices/0 removed"),
        "{changes}"
    );
    let report: Value = serde_json::from_str(
        out["metadata"]["annotations"]["gpuwarden.io/rewritten"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        report["containers"]["trainer"]["deviceListMountsRemoved"]
            .as_array()
            .map(Vec::len),
        Some(3)
    );

    // An NVIDIA CDI annotation hands devices to every container: it goes, and each
    // container gets the policy's default. A vendor's CDI annotation is not ours.
    let mut cdi = unprivileged(json!([]));
    cdi["metadata"]["annotations"] = json!({"cdi.k8s.io/gpu": "nvidia.com/gpu=all"});
    let (_, out) = rewrite(&cdi, "ml", &source());
    assert!(
        out["metadata"]["annotations"]
            .get("cdi.k8s.io/gpu")
            .is_none()
    );
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "1"
    );
    let mut vendor = unprivileged(json!([]));
    vendor["metadata"]["annotations"] = json!({"cdi.k8s.io/fpga": "vendor.com/fpga=0"});
    let answer = review_pod(&vendor, "ml", &source());
    assert!(answer.allowed() && answer.patch.is_none());
    // A policy that keeps CDI annotations does not count them as a leak.
    let keep = StaticSource::new([policy("keep", |p| p.spec.strip_cdi_annotations = false)]);
    let answer = review_pod(&cdi, "ml", &keep);
    assert!(answer.allowed() && answer.patch.is_none());

    // Exempt images keep what they have; Audit warns; Deny rejects.
    let mut exempt = unprivileged(json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]));
    exempt["spec"]["containers"][0]["image"] = json!("nvcr.io/nvidia/k8s/dcgm-exporter:3.3.5");
    let answer = review_pod(&exempt, "gpu-operator", &source());
    assert!(answer.allowed() && answer.patch.is_none());
    let leak = unprivileged(json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]));
    let deny = StaticSource::new([policy("deny", |p| p.spec.mode = PolicyMode::Deny)]);
    assert!(!review_pod(&leak, "ml", &deny).allowed());
}

fn pod_with_ephemeral(names: &[(&str, bool, &str)]) -> Value {
    let mut pod = training_pod();
    pod["spec"]["containers"][0]["securityContext"]["privileged"] = json!(false);
    pod["spec"]["ephemeralContainers"] = names
        .iter()
        .map(|(n, privileged, image)| json!({"name": n, "image": image, "securityContext": {"privileged": privileged}}))
        .collect();
    pod
}

#[test]
fn privileged_ephemeral_containers_are_denied_in_enforce_and_deny() {
    let old = pod_with_ephemeral(&[("debugger-old", true, "busybox")]);
    let new = pod_with_ephemeral(&[
        ("debugger-old", true, "busybox"),
        ("debugger-x7k", true, "busybox"),
    ]);
    for mode in [PolicyMode::Enforce, PolicyMode::Deny] {
        let src = StaticSource::new([policy("p", |p| p.spec.mode = mode)]);
        let answer = answer(&ephemeral_review(&old, &new, "ml"), &src);
        assert!(!answer.allowed(), "{mode}");
        assert_eq!(answer.summary.outcome, Outcome::Denied);
        assert!(
            answer.message().contains("debugger-x7k"),
            "{}",
            answer.message()
        );
        assert!(
            !answer.message().contains("debugger-old"),
            "only the new one: {}",
            answer.message()
        );
    }
    let src = StaticSource::new([policy("p", |p| p.spec.mode = PolicyMode::Audit)]);
    let answer = answer(&ephemeral_review(&old, &new, "ml"), &src);
    assert!(answer.allowed());
    assert_eq!(answer.summary.outcome, Outcome::Audited);
    assert!(answer.warnings()[0].contains("debugger-x7k"));

    // Unprivileged, exempt image, exempt namespace: allowed.
    let plain = pod_with_ephemeral(&[("debugger-old", true, "busybox"), ("dbg", false, "busybox")]);
    assert!(self::answer(&ephemeral_review(&old, &plain, "ml"), &source()).allowed());
    let exempt = pod_with_ephemeral(&[
        ("debugger-old", true, "busybox"),
        ("dcgm", true, "nvcr.io/nvidia/cloud-native/dcgm:3.3.5"),
    ]);
    assert!(self::answer(&ephemeral_review(&old, &exempt, "gpu-operator"), &source()).allowed());
    assert!(!self::answer(&ephemeral_review(&old, &exempt, "ml"), &source()).allowed());
    assert!(self::answer(&ephemeral_review(&old, &new, "kube-system"), &source()).allowed());

    // An unprivileged one that names GPUs itself cannot request them either.
    let mut leaking = plain.clone();
    leaking["spec"]["ephemeralContainers"][1]["env"] =
        json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]);
    let answer = self::answer(&ephemeral_review(&old, &leaking, "ml"), &source());
    assert!(!answer.allowed());
    assert!(
        answer
            .message()
            .starts_with("gpuwarden: ephemeral container dbg on pod ml/train is denied"),
        "{}",
        answer.message()
    );
}

/// `kubectl debug` with a CUDA image: a new unprivileged ephemeral container that names no GPU
/// gets `NVIDIA_VISIBLE_DEVICES=void` in Enforce (its image's value would hand it every GPU),
/// is named in Audit, and the ephemeral containers already there are left as they are (the API
/// server refuses any change to them). An exempt image or namespace keeps its value.
#[test]
fn new_ephemeral_containers_get_the_void_rule() {
    let old = pod_with_ephemeral(&[("debugger-old", false, "nvcr.io/nvidia/cuda:12.4.1-base")]);
    let new = pod_with_ephemeral(&[
        ("debugger-old", false, "nvcr.io/nvidia/cuda:12.4.1-base"),
        ("debugger-x7k", false, "nvcr.io/nvidia/cuda:12.4.1-base"),
    ]);
    let answer = answer(&ephemeral_review(&old, &new, "ml"), &source());
    assert!(answer.allowed());
    assert_eq!(answer.summary.outcome, Outcome::Voided);
    let patched = answer.apply(&new);
    let ephemeral = &patched["spec"]["ephemeralContainers"];
    assert_eq!(
        env_value(&ephemeral[1], "NVIDIA_VISIBLE_DEVICES"),
        Some("void")
    );
    assert_eq!(
        ephemeral[0], new["spec"]["ephemeralContainers"][0],
        "the old one as it was"
    );
    assert_eq!(patched["spec"]["containers"], new["spec"]["containers"]);
    // A second pass over the patched pod changes nothing.
    let again = self::answer(&ephemeral_review(&old, &patched, "ml"), &source());
    assert!(again.patch.is_none(), "{:?}", again.patch);

    let audit = StaticSource::new([policy("p", |p| p.spec.mode = PolicyMode::Audit)]);
    let audited = self::answer(&ephemeral_review(&old, &new, "ml"), &audit);
    assert!(audited.allowed() && audited.patch.is_none());
    assert!(
        (audited.warnings().iter())
            .any(|w| w.contains("debugger-x7k would get NVIDIA_VISIBLE_DEVICES=void")),
        "{:?}",
        audited.warnings()
    );
    let exempt = pod_with_ephemeral(&[
        ("debugger-old", false, "nvcr.io/nvidia/cuda:12.4.1-base"),
        ("dcgm", false, "nvcr.io/nvidia/cloud-native/dcgm:3.3.5"),
    ]);
    let kept = self::answer(&ephemeral_review(&old, &exempt, "gpu-operator"), &source());
    assert!(kept.allowed() && kept.patch.is_none());
    let voided = self::answer(&ephemeral_review(&old, &exempt, "ml"), &source());
    assert_eq!(voided.summary.outcome, Outcome::Voided);
}

/// Door 5: counts are the pod's. The pod annotation is the total of the containers that do
/// not say their own; containers naming the same GPUs share them; an explicit 0 means no
/// GPU; a pod over maxPerPod is denied.
#[test]
fn gpu_counts_are_the_pods() {
    let gpu_container = |name: &str, visible: &str| {
        json!({"name": name, "image": "nvcr.io/nvidia/pytorch:24.05-py3",
            "securityContext": {"privileged": true},
            "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": visible}]})
    };
    let pod_of = |containers: Value, annotations: Value| {
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "annotations": annotations},
            "spec": {"containers": containers}})
    };
    let limits = |out: &Value| -> Vec<Value> {
        (out["spec"]["containers"].as_array().unwrap().iter())
            .map(|c| c["resources"]["limits"]["nvidia.com/gpu"].clone())
            .collect()
    };

    // gpu-count 8 on two containers: 4 each, not 16.
    let two = json!([gpu_container("a", "all"), gpu_container("b", "all")]);
    let (answer, out) = rewrite(
        &pod_of(two.clone(), json!({"gpuwarden.io/gpu-count": "8"})),
        "ml",
        &source(),
    );
    assert_eq!(limits(&out), [json!("4"), json!("4")]);
    assert!(
        answer.warnings()[0].contains(
            "(annotation gpuwarden.io/gpu-count=8, the pod's total split over 2 containers)"
        ),
        "{:?}",
        answer.warnings()
    );
    // 3 over two: the first takes the remainder; the container's own annotation wins and
    // takes no share.
    let (_, out) = rewrite(
        &pod_of(two.clone(), json!({"gpuwarden.io/gpu-count": "3"})),
        "ml",
        &source(),
    );
    assert_eq!(limits(&out), [json!("2"), json!("1")]);
    let (_, out) = rewrite(
        &pod_of(
            two.clone(),
            json!({"gpuwarden.io/gpu-count": "3", "gpuwarden.io/gpu-count.a": "1"}),
        ),
        "ml",
        &source(),
    );
    assert_eq!(limits(&out), [json!("1"), json!("3")]);
    // 1 over two: the second gets none, and `void` keeps the image's ENV out.
    let (_, out) = rewrite(
        &pod_of(two.clone(), json!({"gpuwarden.io/gpu-count": "1"})),
        "ml",
        &source(),
    );
    assert_eq!(limits(&out), [json!("1"), Value::Null]);
    assert_eq!(
        env_value(&out["spec"]["containers"][1], "NVIDIA_VISIBLE_DEVICES"),
        Some("void")
    );
    // An init container runs before the others: it may use the whole total; a sidecar
    // (restartPolicy Always) runs beside them and takes a share.
    let mut with_init = pod_of(two.clone(), json!({"gpuwarden.io/gpu-count": "4"}));
    let mut sidecar = gpu_container("side", "all");
    sidecar["restartPolicy"] = json!("Always");
    with_init["spec"]["initContainers"] = json!([gpu_container("warm", "all"), sidecar]);
    let (_, out) = rewrite(&with_init, "ml", &source());
    let init = &out["spec"]["initContainers"];
    assert_eq!(init[0]["resources"]["limits"]["nvidia.com/gpu"], "4");
    assert_eq!(init[1]["resources"]["limits"]["nvidia.com/gpu"], "2");
    assert_eq!(limits(&out), [json!("1"), json!("1")]);

    // Two containers naming the same GPUs share them: 2, not 4. The warning says so, and
    // what DRA would do.
    let shared = json!([gpu_container("a", "0,1"), gpu_container("b", " 1,0")]);
    let (answer, out) = rewrite(&pod_of(shared, json!({})), "ml", &source());
    assert_eq!(limits(&out), [json!("2"), Value::Null]);
    assert_eq!(
        env_value(&out["spec"]["containers"][1], "NVIDIA_VISIBLE_DEVICES"),
        Some("void")
    );
    let changes = answer.response()["auditAnnotations"]["changes"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        changes.contains(
            "container b: privileged removed, no GPU: names the same GPUs as container a"
        ) && changes.contains(
            "a DRA ResourceClaim that both containers reference would give both the same GPUs"
        ),
        "{changes}"
    );
    // Different GPUs are not shared.
    let apart = json!([gpu_container("a", "0,1"), gpu_container("b", "2")]);
    let (_, out) = rewrite(&pod_of(apart, json!({})), "ml", &source());
    assert_eq!(limits(&out), [json!("2"), json!("1")]);

    // An explicit 0 beside a GPU signal: no GPU, and `void` rather than nothing, so a CUDA
    // image's own NVIDIA_VISIBLE_DEVICES=all cannot hand them over again.
    let mut zero = gpu_container("a", "all");
    zero["resources"] = json!({"limits": {"nvidia.com/gpu": "0"}});
    let (_, out) = rewrite(&pod_of(json!([zero.clone()]), json!({})), "ml", &source());
    let c = &out["spec"]["containers"][0];
    assert_eq!(c["resources"]["limits"], json!({"nvidia.com/gpu": "0"}));
    assert_eq!(env_value(c, "NVIDIA_VISIBLE_DEVICES"), Some("void"));
    zero["resources"] = json!({"requests": {"nvidia.com/gpu": 0}});
    let (_, out) = rewrite(&pod_of(json!([zero]), json!({})), "ml", &source());
    let c = &out["spec"]["containers"][0];
    assert!(c["resources"]["limits"].is_null(), "{c}");
    assert_eq!(env_value(c, "NVIDIA_VISIBLE_DEVICES"), Some("void"));

    // More than one node holds: denied with the reason, per container and per pod.
    let answer = review_pod(
        &pod_of(
            two.clone(),
            json!({"gpuwarden.io/gpu-count.a": "6", "gpuwarden.io/gpu-count.b": "6"}),
        ),
        "ml",
        &source(),
    );
    assert!(!answer.allowed());
    assert!(
        answer
            .message()
            .contains("the pod would hold 12 GPUs at once, more than maxPerPod 8"),
        "{}",
        answer.message()
    );
    let roomy = StaticSource::new([policy("roomy", |p| {
        p.spec.gpu.max_per_container = 16;
        p.spec.gpu.max_per_pod = 16;
    })]);
    assert!(
        review_pod(
            &pod_of(
                two,
                json!({"gpuwarden.io/gpu-count.a": "6", "gpuwarden.io/gpu-count.b": "6"})
            ),
            "ml",
            &roomy
        )
        .allowed()
    );
    let answer = review_pod(
        &pod_of(
            json!([gpu_container("a", "all")]),
            json!({"gpuwarden.io/gpu-count": "16"}),
        ),
        "ml",
        &source(),
    );
    assert!(
        answer.message().contains("container a would need 16 GPUs (annotation gpuwarden.io/gpu-count=16), more than maxPerContainer 8"),
        "{}",
        answer.message()
    );
}

/// Door 2: a container whose environment gpuwarden cannot fully see never passes as "no
/// GPU" unseen.
#[test]
fn env_from_never_passes_unseen() {
    let triton = |env: Value| {
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "triton"},
            "spec": {"containers": [{"name": "triton", "image": "registry.example.com/inference/proxy:1.4",
                "securityContext": {"privileged": true},
                "envFrom": [{"configMapRef": {"name": "triton-env"}}],
                "env": env}]}})
    };
    // Privileged with envFrom and nothing else: it may be handed GPUs by the ConfigMap, so
    // it is judged; without a GPU of its own it gets `void`, which overrides envFrom.
    let (answer, out) = rewrite(&triton(json!([])), "ml", &source());
    let c = &out["spec"]["containers"][0];
    assert_eq!(c["securityContext"]["privileged"], false);
    assert_eq!(env_value(c, "NVIDIA_VISIBLE_DEVICES"), Some("void"));
    assert!(c["resources"].is_null(), "{c}");
    assert!(
        answer.warnings()[0]
            .ends_with("NVIDIA_VISIBLE_DEVICES=void; the void overrides whatever envFrom sets"),
        "{:?}",
        answer.warnings()
    );
    // An explicit `none` overrides envFrom, so it decides: no GPU, and a privileged
    // container without one is none of our business.
    let answer = review_pod(
        &triton(json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}])),
        "ml",
        &source(),
    );
    assert!(answer.allowed() && answer.patch.is_none());

    // A GPU container with envFrom: removing its NVIDIA_VISIBLE_DEVICES would let the
    // ConfigMap's value through, and no value can be set without overriding the
    // allocation. Denied by default, naming the container and the knob.
    let gpu = triton(json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]));
    let answer = review_pod(&gpu, "ml", &source());
    assert!(!answer.allowed());
    assert!(
        answer.message().contains("container triton: envFrom may set NVIDIA_VISIBLE_DEVICES, which would override the GPUs the kubelet allocates")
            && answer.message().contains("gpu.envFrom: Warn"),
        "{}",
        answer.message()
    );
    // gpu.envFrom: Warn rewrites it and says what is left.
    let warn = StaticSource::new([policy("warn", |p| {
        p.spec.gpu.env_from = gpuwarden_crds::EnvFromGpu::Warn
    })]);
    let (answer, out) = rewrite(&gpu, "ml", &warn);
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "1"
    );
    let changes = answer.response()["auditAnnotations"]["changes"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        changes.ends_with("envFrom may still set NVIDIA_VISIBLE_DEVICES over the allocated GPUs (gpu.envFrom: Warn)"),
        "{changes}"
    );
    // An unprivileged container with envFrom and no signal gets the void rule's entry,
    // which overrides whatever envFrom sets.
    let mut plain = triton(json!([]));
    plain["spec"]["containers"][0]["securityContext"] = json!({});
    let answer = review_pod(&plain, "ml", &source());
    assert!(answer.allowed());
    assert_eq!(answer.voided_only(), ["/spec/containers/0"]);
    // So is an empty envFrom.
    let mut empty = triton(json!([]));
    empty["spec"]["containers"][0]["envFrom"] = json!([]);
    empty["spec"]["containers"][0]["image"] = json!("busybox");
    let answer = review_pod(&empty, "ml", &source());
    assert!(
        answer.allowed() && answer.patch.is_none(),
        "{:?}",
        answer.review
    );
}

/// Door 4: a privileged pod that says "GPU" only through where it runs or what it runs is
/// a GPU pod, and the rewrite says which hint made it one.
#[test]
fn placement_and_image_hints_make_gpu_containers() {
    let base = || {
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c", "image": "registry.example.com/render:2",
                "securityContext": {"privileged": true}}]}})
    };
    let hinted = |field: &str, value: Value| {
        let mut pod = base();
        pod["spec"][field] = value;
        pod
    };
    let mut image = base();
    image["spec"]["containers"][0]["image"] = json!("nvidia/cuda:12.4.1-runtime-ubuntu22.04");
    let cases = [
        (
            hinted("runtimeClassName", json!("nvidia")),
            "GPU by runtimeClassName nvidia",
        ),
        (
            hinted("nodeSelector", json!({"nvidia.com/gpu.present": "true"})),
            "GPU by node label nvidia.com/gpu.present",
        ),
        (
            hinted(
                "affinity",
                json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
                {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-A100-SXM4-80GB"]}]}]}}}),
            ),
            "GPU by node label nvidia.com/gpu.product",
        ),
        (
            hinted(
                "tolerations",
                json!([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]),
            ),
            "GPU by toleration of nvidia.com/gpu",
        ),
        (image, "GPU by image pattern */cuda:*"),
    ];
    for (pod, why) in &cases {
        let (answer, out) = rewrite(pod, "ml", &source());
        let c = &out["spec"]["containers"][0];
        assert_eq!(c["securityContext"]["privileged"], false, "{why}");
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "1", "{why}");
        assert!(
            answer.warnings()[0].contains(&format!(
                "requests nvidia.com/gpu=1 (policy default, {why})"
            )),
            "{why}: {:?}",
            answer.warnings()
        );
    }

    // No hint: a privileged container on a node that says it is no GPU node, or that
    // tolerates every taint, is none of our business; nor is an unprivileged one.
    for pod in [
        base(),
        hinted("nodeSelector", json!({"nvidia.com/gpu.present": "false"})),
        hinted("tolerations", json!([{"operator": "Exists"}])),
        hinted(
            "affinity",
            json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
            {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "nvidia.com/gpu.present", "operator": "DoesNotExist"}]}]}}}),
        ),
    ] {
        let answer = review_pod(&pod, "ml", &source());
        assert!(answer.allowed() && answer.patch.is_none(), "{pod}");
    }
    let mut unprivileged = hinted("runtimeClassName", json!("nvidia"));
    unprivileged["spec"]["containers"][0]["securityContext"] = json!({});
    let answer = review_pod(&unprivileged, "ml", &source());
    assert_eq!(answer.voided_only(), ["/spec/containers/0"]);
    // `none` in the container outweighs a hint about the pod.
    let mut none = hinted("runtimeClassName", json!("nvidia"));
    none["spec"]["containers"][0]["env"] =
        json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "none"}]);
    assert!(review_pod(&none, "ml", &source()).patch.is_none());
    // Empty lists turn the hints off.
    let off = StaticSource::new([policy("off", |p| {
        p.spec.match_.runtime_class_names.clear();
        p.spec.match_.gpu_node_labels.clear();
        p.spec.match_.gpu_taints.clear();
        p.spec.match_.gpu_images.clear();
    })]);
    for (pod, why) in &cases {
        assert!(review_pod(pod, "ml", &off).patch.is_none(), "{why}");
    }
}

/// Door 3: an image exempts a container only together with the namespaces or service
/// accounts its entry names, and with its digests when pinned; the GPU Operator's images
/// are exempt only in the GPU Operator's namespace.
#[test]
fn image_exemptions_are_scoped() {
    // A tenant runs the dcgm-exporter image privileged with its own command.
    let mut tenant = training_pod();
    tenant["spec"]["containers"][0]["image"] =
        json!("nvcr.io/nvidia/k8s/dcgm-exporter:3.3.5-3.4.0-ubuntu22.04");
    tenant["spec"]["containers"][0]["command"] = json!(["nsenter", "-t", "1", "-a", "sh"]);
    let (answer, out) = rewrite(&tenant, "team-a", &source());
    assert_eq!(answer.summary.outcome, Outcome::Rewritten);
    assert_eq!(
        out["spec"]["containers"][0]["securityContext"]["privileged"],
        false
    );
    // The same pod in the GPU Operator's namespace is exempt.
    let answer = review_pod(&tenant, "gpu-operator", &source());
    assert_eq!(answer.summary.outcome, Outcome::Exempt);

    // Scoped to a service account and pinned to a digest: every condition must hold.
    let digest = format!("sha256:{}", "f".repeat(64));
    let src = StaticSource::new([policy("tools", |p| {
        p.spec.exemptions.containers = vec![gpuwarden_crds::ContainerExemption {
            images: vec!["registry.example.com/tools/*".into()],
            service_accounts: vec!["team-a/debugger".into()],
            digests: vec![digest.clone()],
            ..Default::default()
        }]
    })]);
    let tool = |image: &str, sa: &str| {
        let mut pod = training_pod();
        pod["spec"]["containers"][0]["image"] = json!(image);
        pod["spec"]["serviceAccountName"] = json!(sa);
        pod
    };
    let pinned = format!("registry.example.com/tools/nsenter@{digest}");
    let outcome = |pod: &Value| review_pod(pod, "team-a", &src).summary.outcome;
    assert_eq!(outcome(&tool(&pinned, "debugger")), Outcome::Exempt);
    assert_eq!(outcome(&tool(&pinned, "trainer")), Outcome::Rewritten);
    assert_eq!(
        outcome(&tool("registry.example.com/tools/nsenter:1", "debugger")),
        Outcome::Rewritten
    );

    // A policy that still uses the removed field fails closed, saying how to move.
    let old = StaticSource::new([policy("old", |p| {
        p.spec.exemptions.images = vec!["nvcr.io/nvidia/k8s/dcgm-exporter:*".into()]
    })]);
    let answer = review_pod(&tenant, "team-a", &old);
    assert!(!answer.allowed());
    assert!(
        answer
            .message()
            .contains("RemovedField: spec.exemptions.images was removed"),
        "{}",
        answer.message()
    );
}

/// Door 7: the namespace's Pod Security level bounds what the rewrite adds, and what the
/// rewritten pod would still fail is named.
#[test]
fn the_rewrite_stays_inside_the_namespaces_pod_security_level() {
    let mut pod = training_pod();
    pod["spec"]["containers"][0]["securityContext"]["capabilities"] =
        json!({"add": ["IPC_LOCK", "SYS_PTRACE", "CHOWN"]});
    pod["spec"]["containers"][0]["securityContext"]["runAsUser"] = json!(1000);
    let mut src = StaticSource::new([policy("p", |p| {
        p.spec.capabilities.allowed.push("CHOWN".into());
    })]);
    src = src
        .with_namespace(
            "base",
            &[("pod-security.kubernetes.io/enforce", "baseline")],
        )
        .with_namespace(
            "strict",
            &[("pod-security.kubernetes.io/enforce", "restricted")],
        )
        .with_namespace(
            "odd",
            &[("pod-security.kubernetes.io/enforce", "Restricted")],
        )
        .with_namespace(
            "open",
            &[("pod-security.kubernetes.io/enforce", "privileged")],
        );
    let context = |out: &Value| out["spec"]["containers"][0]["securityContext"].clone();

    // No level (or privileged): what the policy allows.
    for ns in ["ml", "open"] {
        let (_, out) = rewrite(&pod, ns, &src);
        assert_eq!(
            context(&out)["capabilities"]["add"],
            json!(["IPC_LOCK", "SYS_PTRACE", "CHOWN"]),
            "{ns}"
        );
        assert!(context(&out).get("seccompProfile").is_none());
    }
    // baseline: only baseline capabilities; the others are named.
    let (answer, out) = rewrite(&pod, "base", &src);
    assert_eq!(context(&out)["capabilities"], json!({"add": ["CHOWN"]}));
    assert!(context(&out).get("allowPrivilegeEscalation").is_none());
    assert!(context(&out).get("seccompProfile").is_none());
    assert!(
        answer.warnings()[0]
            .contains("capabilities IPC_LOCK,SYS_PTRACE not added (Pod Security baseline)"),
        "{:?}",
        answer.warnings()
    );
    // restricted (and a value PSA does not know, which it reads as restricted): nothing
    // beyond NET_BIND_SERVICE, every capability dropped, RuntimeDefault seccomp, and what
    // gpuwarden cannot set is named.
    for ns in ["strict", "odd"] {
        let (answer, out) = rewrite(&pod, ns, &src);
        let c = context(&out);
        assert!(c["capabilities"].get("add").is_none(), "{ns}: {c}");
        assert_eq!(c["capabilities"]["drop"], json!(["ALL"]));
        assert_eq!(c["seccompProfile"], json!({"type": "RuntimeDefault"}));
        assert_eq!(c["allowPrivilegeEscalation"], false);
        let pod_warning = (answer.warnings().into_iter())
            .find(|w| w.starts_with("gpuwarden: pod: "))
            .unwrap_or_default();
        assert_eq!(
            pod_warning,
            "gpuwarden: pod: will still fail Pod Security restricted: runAsNonRoot (container trainer)"
        );
    }
    // With runAsNonRoot set there is nothing left to say; a pod-level seccomp profile is
    // not overridden.
    let mut ready = pod.clone();
    ready["spec"]["securityContext"] = json!({"runAsNonRoot": true, "seccompProfile": {"type": "Localhost", "localhostProfile": "gpu.json"}});
    let (answer, out) = rewrite(&ready, "strict", &src);
    assert!(context(&out).get("seccompProfile").is_none());
    assert!(
        answer
            .warnings()
            .iter()
            .all(|w| !w.contains("will still fail")),
        "{:?}",
        answer.warnings()
    );

    // What cannot be fixed safely is named: host namespaces, a hostPath that stays, and
    // a container the rewrite does not touch.
    let mut host = pod.clone();
    host["spec"]["hostNetwork"] = json!(true);
    host["spec"]["volumes"] = json!([{"name": "logs", "hostPath": {"path": "/var/log"}}]);
    host["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "side", "image": "busybox"}));
    let answer = review_pod(&host, "base", &src);
    let changes = answer.response()["auditAnnotations"]["changes"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        changes.ends_with(
            "pod: will still fail Pod Security baseline: hostNetwork; hostPath volume logs"
        ),
        "{changes}"
    );
    let answer = review_pod(&host, "strict", &src);
    let changes = answer.response()["auditAnnotations"]["changes"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        changes.contains("runAsNonRoot, allowPrivilegeEscalation: false, capabilities drop ALL, seccompProfile (container side)"),
        "{changes}"
    );
}

/// A claim spec asking for one device of each class.
fn claim_spec(classes: &[&str]) -> k8s_openapi::api::resource::v1::ResourceClaimSpec {
    let requests: Vec<Value> = (classes.iter().enumerate())
        .map(|(i, class)| json!({"name": format!("r{i}"), "exactly": {"deviceClassName": class}}))
        .collect();
    serde_json::from_value(json!({"devices": {"requests": requests}})).unwrap()
}

/// gpuwarden's templates of `gpu.nvidia.com`, 1 to 8 GPUs, in `namespace`.
fn with_templates(mut source: StaticSource, namespace: &str) -> StaticSource {
    for n in 1..=8 {
        let name = gpuwarden_crds::claims::template_name("gpu.nvidia.com", n);
        let spec = claim_spec(&["gpu.nvidia.com"]);
        (source.claims).insert(ClaimSource::Template, namespace, &name, &spec);
    }
    source
}

#[test]
fn resource_claims_of_gpu_device_classes_are_gpu_signals() {
    let mut source = source();
    let claims = &mut source.claims;
    claims.insert(
        ClaimSource::Template,
        "ml",
        "dra-gpu",
        &claim_spec(&["gpu.nvidia.com"]),
    );
    claims.insert(
        ClaimSource::Claim,
        "ml",
        "a-mig",
        &claim_spec(&["nic.example.com", "mig.nvidia.com"]),
    );
    claims.insert(
        ClaimSource::Claim,
        "ml",
        "nic",
        &claim_spec(&["nic.example.com"]),
    );
    claims.insert(
        ClaimSource::Claim,
        "other",
        "a-mig",
        &claim_spec(&["mig.nvidia.com"]),
    );
    let pod = json!({
        "metadata": {"name": "dra"},
        "spec": {
            "resourceClaims": [
                {"name": "gpu", "resourceClaimTemplateName": "dra-gpu"},
                {"name": "mig", "resourceClaimName": "a-mig"},
                {"name": "nic", "resourceClaimName": "nic"},
                {"name": "gone", "resourceClaimTemplateName": "not-there"}
            ],
            "containers": [
                // A GPU through its claim, and the variable on top: the claim's GPUs stay, no
                // limit is added, and the variable becomes `void`, as the DRA driver's CDI
                // edits set it.
                {"name": "train", "securityContext": {"privileged": true},
                 "resources": {"claims": [{"name": "nic"}, {"name": "gpu"}]},
                 "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]},
                // A MIG device through a claim that also asks for a NIC.
                {"name": "infer", "securityContext": {"privileged": true},
                 "resources": {"claims": [{"name": "mig"}]}},
                // A NIC only: privileged, but no GPU container.
                {"name": "net", "securityContext": {"privileged": true},
                 "resources": {"claims": [{"name": "nic"}]}},
                // A claim that cannot be found counts by nothing: its variable makes it a GPU
                // container given the policy's default.
                {"name": "lost", "securityContext": {"privileged": true},
                 "resources": {"claims": [{"name": "gone"}]},
                 "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}
            ]
        }
    });
    let (answer, patched) = rewrite(&pod, "ml", &source);
    assert_eq!(answer.summary.outcome, Outcome::Rewritten);
    let containers = &patched["spec"]["containers"];
    let limits = |i: usize| containers[i]["resources"]["limits"].clone();
    assert_eq!(limits(0), Value::Null, "no limit on top of a GPU claim");
    // The claim's GPUs come through CDI: the runtime reads no variable for them.
    for i in [0, 1] {
        assert_eq!(
            env_value(&containers[i], "NVIDIA_VISIBLE_DEVICES"),
            Some("void")
        );
        assert_eq!(
            env_value(&containers[i], "NVIDIA_DRIVER_CAPABILITIES"),
            None
        );
    }
    assert_eq!(limits(1), Value::Null);
    assert_eq!(
        env_value(&containers[2], "NVIDIA_VISIBLE_DEVICES"),
        Some("void"),
        "not a GPU container"
    );
    assert_eq!(limits(3), json!({"nvidia.com/gpu": "1"}));
    assert_eq!(
        patched["spec"]["resourceClaims"], pod["spec"]["resourceClaims"],
        "claims untouched"
    );
    let report: Value = serde_json::from_str(
        patched["metadata"]["annotations"][ANNOTATION_REWRITTEN]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(report["containers"]["train"]["claim"], "gpu");
    assert_eq!(report["containers"]["train"]["gpu"], true);
    assert_eq!(report["containers"]["infer"]["claim"], "mig");
    assert_eq!(report["containers"]["net"]["gpu"], false);
    let warnings = answer.warnings().join("\n");
    assert!(
        warnings.contains("container train: privileged removed; GPUs from its ResourceClaim gpu;"),
        "{warnings}"
    );
    assert!(
        warnings.contains("its claim gone was not counted (ResourceClaimTemplate ml/not-there does not exist): if it holds GPUs, they come on top"),
        "{warnings}"
    );
    assert_eq!(
        report["containers"]["lost"]["claimsNotRead"]["gone"],
        "ResourceClaimTemplate ml/not-there does not exist"
    );

    // The same claim names another namespace's objects there: `a-mig` in `other` is a MIG
    // claim, and nothing else is known.
    let answer = review_pod(&pod, "other", &source);
    let patched = answer.apply(&pod);
    let containers = &patched["spec"]["containers"];
    assert_eq!(
        containers[0]["resources"]["limits"],
        json!({"nvidia.com/gpu": "1"})
    );
    assert_eq!(containers[1]["resources"]["limits"], Value::Null);
}

#[test]
fn the_resource_claim_mode_requests_gpus_from_templates_and_shares_them() {
    let claim_policy = |max_per_pod| {
        policy("dra", |p| {
            p.spec.gpu.request_as = RequestAs::ResourceClaim;
            p.spec.gpu.max_per_pod = max_per_pod;
        })
    };
    let mut dra = with_templates(StaticSource::new([claim_policy(8)]), "ml");
    dra.claims.insert(
        ClaimSource::Claim,
        "ml",
        "scratch",
        &claim_spec(&["disk.example.com"]),
    );
    let pod = json!({
        "metadata": {"name": "p", "annotations": {"gpuwarden.io/gpu-count.setup": "2"}},
        "spec": {
            // An entry of the pod's own already has the first name the rewrite would use.
            "resourceClaims": [{"name": "gpuwarden-gpus-0", "resourceClaimName": "scratch"}],
            "initContainers": [
                {"name": "setup", "securityContext": {"privileged": true}, "resources": {},
                 "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"}]}
            ],
            "containers": [
                {"name": "a", "securityContext": {"privileged": true},
                 "resources": {"claims": [{"name": "gpuwarden-gpus-0"}]},
                 "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "1,0"}]},
                {"name": "b", "securityContext": {"privileged": true},
                 "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0, 1"}]},
                {"name": "c", "securityContext": {"privileged": true},
                 "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]},
                // Its own request stays an extended resource.
                {"name": "d", "securityContext": {"privileged": true},
                 "resources": {"requests": {"nvidia.com/gpu": "1"}}}
            ]
        }
    });
    let (answer, patched) = rewrite(&pod, "ml", &dra);
    assert_eq!(
        answer.summary.outcome,
        Outcome::Rewritten,
        "{}",
        answer.message()
    );
    assert_eq!(
        patched["spec"]["resourceClaims"],
        json!([
            {"name": "gpuwarden-gpus-0", "resourceClaimName": "scratch"},
            {"name": "gpuwarden-gpus-1", "resourceClaimTemplateName": "gpuwarden-gpu.nvidia.com-2"},
            {"name": "gpuwarden-gpus-2", "resourceClaimTemplateName": "gpuwarden-gpu.nvidia.com-2"},
            {"name": "gpuwarden-gpus-3", "resourceClaimTemplateName": "gpuwarden-gpu.nvidia.com-1"}
        ])
    );
    let claims = |list: &str, i: usize| patched["spec"][list][i]["resources"]["claims"].clone();
    assert_eq!(
        claims("initContainers", 0),
        json!([{"name": "gpuwarden-gpus-1"}])
    );
    assert_eq!(
        claims("containers", 0),
        json!([{"name": "gpuwarden-gpus-0"}, {"name": "gpuwarden-gpus-2"}])
    );
    assert_eq!(
        claims("containers", 1),
        json!([{"name": "gpuwarden-gpus-2"}]),
        "b shares a's GPUs"
    );
    assert_eq!(
        claims("containers", 2),
        json!([{"name": "gpuwarden-gpus-3"}])
    );
    assert_eq!(
        patched["spec"]["containers"][3]["resources"]["limits"],
        json!({"nvidia.com/gpu": "1"})
    );
    // Claims hand GPUs out through CDI and the limit through the device plugin: the pod's
    // own variable is `void` in the first and gone from the second.
    for (i, c) in patched["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let expected = if i == 3 { None } else { Some("void") };
        assert_eq!(env_value(c, "NVIDIA_VISIBLE_DEVICES"), expected, "{c}");
        assert_eq!(c["securityContext"]["privileged"], false);
    }
    let warnings = answer.warnings().join("\n");
    assert!(
        warnings.contains("claims 2 GPUs through gpuwarden-gpus-2 (NVIDIA_VISIBLE_DEVICES=1,0)"),
        "{warnings}"
    );
    assert!(
        warnings.contains(
            "container b: privileged removed; shares claim gpuwarden-gpus-2 with container a"
        ),
        "{warnings}"
    );
    assert!(
        warnings.contains(
            "resourceClaims gpuwarden-gpus-1 (template gpuwarden-gpu.nvidia.com-2),gpuwarden-gpus-2"
        ),
        "{warnings}"
    );
    let report: Value = serde_json::from_str(
        patched["metadata"]["annotations"][ANNOTATION_REWRITTEN]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        report["resourceClaims"]["gpuwarden-gpus-3"],
        "gpuwarden-gpu.nvidia.com-1"
    );
    assert_eq!(report["containers"]["b"]["claimSharedWith"], "a");

    // Claims are held from start to end: 2 + 2 + 1 claimed and 1 limited is 6 at once.
    let tight = with_templates(StaticSource::new([claim_policy(5)]), "ml");
    let answer = review_pod(&pod, "ml", &tight);
    assert!(!answer.allowed());
    assert!(
        answer
            .message()
            .contains("the pod would hold 6 GPUs at once, more than maxPerPod 5"),
        "{}",
        answer.message()
    );

    // Where the templates are missing the pod is denied, naming each one once.
    let answer = review_pod(&pod, "empty", &dra);
    assert!(!answer.allowed());
    let message = answer.message();
    assert!(message.contains("ResourceClaimTemplate empty/gpuwarden-gpu.nvidia.com-2 does not exist: the operator keeps it in every namespace GpuPolicy dra governs"), "{message}");
    assert_eq!(
        message
            .matches("gpuwarden-gpu.nvidia.com-2 does not exist")
            .count(),
        1,
        "{message}"
    );
    assert!(
        message.contains("empty/gpuwarden-gpu.nvidia.com-1 does not exist"),
        "{message}"
    );

    // In the default mode the same pod gets limits, and b gets none.
    let (_, patched) = rewrite(&pod, "ml", &with_templates(source(), "ml"));
    assert_eq!(
        patched["spec"]["resourceClaims"],
        pod["spec"]["resourceClaims"]
    );
    assert_eq!(
        patched["spec"]["containers"][0]["resources"]["limits"],
        json!({"nvidia.com/gpu": "2"})
    );
    assert_eq!(
        env_value(&patched["spec"]["containers"][1], "NVIDIA_VISIBLE_DEVICES"),
        Some("void")
    );
}

/// A privileged DaemonSet pod as its controller writes it: `ownerReferences` naming it.
fn daemon_set_pod(name: &str, image: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": format!("{name}-x7k2p"),
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": name,
                "uid": "6f1c", "controller": true, "blockOwnerDeletion": true}]
        },
        "spec": {
            "containers": [{
                "name": name,
                "image": image,
                "securityContext": {"privileged": true}
            }]
        }
    })
}

#[test]
fn nvidia_components_are_left_alone_where_their_installs_put_them() {
    // NVIDIA's own privileged static device plugin: exempt in its namespace, where a GPU
    // request would keep it Pending on a node that advertises no GPU yet.
    let plugin = daemon_set_pod(
        "nvidia-device-plugin-daemonset",
        "nvcr.io/nvidia/k8s-device-plugin:v0.19.1",
    );
    for namespace in [
        "nvidia-device-plugin",
        "gpu-operator",
        "nvidia-gpu-operator",
    ] {
        let answer = review_pod(&plugin, namespace, &source());
        assert_eq!(answer.summary.outcome, Outcome::Exempt, "{namespace}");
        assert!(answer.patch.is_none());
    }
    // The sandbox device plugin, pinned by digest as OLM installs it.
    let sandbox = daemon_set_pod(
        "nvidia-sandbox-device-plugin-daemonset",
        &format!(
            "nvcr.io/nvidia/kubevirt-gpu-device-plugin@sha256:{}",
            "a".repeat(64)
        ),
    );
    assert_eq!(
        review_pod(&sandbox, "nvidia-gpu-operator", &source())
            .summary
            .outcome,
        Outcome::Exempt
    );
    // A tenant cannot run the same image privileged elsewhere: it is judged, and as a
    // DaemonSet given a GPU it never asked for, denied.
    let answer = review_pod(&plugin, "ml", &source());
    assert_eq!(answer.summary.outcome, Outcome::Denied);
    assert!(
        answer.message().contains("runs it on every node"),
        "{}",
        answer.message()
    );
}

#[test]
fn a_daemon_set_is_never_made_a_gpu_consumer() {
    // An exporter mounting /dev/nvidia0 and /dev/nvidiactl, as the nvidia_gpu_exporter chart
    // rendered it: a GPU request would take one GPU on every node.
    let mut exporter = daemon_set_pod("gpu-exporter", "utkuozdemir/nvidia_gpu_exporter:1.2.0");
    exporter["spec"]["containers"][0]["volumeMounts"] = json!([
        {"name": "nvidia0", "mountPath": "/dev/nvidia0"},
        {"name": "nvidiactl", "mountPath": "/dev/nvidiactl"}
    ]);
    exporter["spec"]["volumes"] = json!([
        {"name": "nvidia0", "hostPath": {"path": "/dev/nvidia0"}},
        {"name": "nvidiactl", "hostPath": {"path": "/dev/nvidiactl"}}
    ]);
    let answer = review_pod(&exporter, "monitoring", &source());
    assert_eq!(answer.summary.outcome, Outcome::Denied);
    let message = answer.message();
    for part in [
        "container gpu-exporter would be given 1 GPU(s) it did not ask for (policy default, GPU by a device mount)",
        "DaemonSet gpu-exporter runs it on every node",
        "exemptions.containers with images [utkuozdemir/nvidia_gpu_exporter:1.2.0] and namespaces [monitoring]",
        "limits nvidia.com/gpu or annotation gpuwarden.io/gpu-count",
    ] {
        assert!(message.contains(part), "{part:?} not in {message}");
    }
    // Audit admits it and says what Enforce would do.
    let audit = StaticSource::new([policy("default", |p| p.spec.mode = PolicyMode::Audit)]);
    let answer = review_pod(&exporter, "monitoring", &audit);
    assert_eq!(answer.summary.outcome, Outcome::Audited);
    assert!(
        answer.warnings().iter().any(|w| w.starts_with(
            "gpuwarden audit: Enforce would deny: container gpu-exporter would be given 1 GPU(s)"
        )),
        "{:?}",
        answer.warnings()
    );
    // Hints and `all` are counts it did not write either.
    let mut all = daemon_set_pod("agent", "registry.example.com/agent:1");
    all["spec"]["containers"][0]["env"] =
        json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]);
    assert_eq!(
        review_pod(&all, "monitoring", &source()).summary.outcome,
        Outcome::Denied
    );
    let hinted = daemon_set_pod("agent", "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04");
    assert_eq!(
        review_pod(&hinted, "monitoring", &source()).summary.outcome,
        Outcome::Denied
    );
    // GPUs it names, a count annotation or a request it wrote are its own: rewritten.
    let mut named = daemon_set_pod("agent", "registry.example.com/agent:1");
    named["spec"]["containers"][0]["env"] =
        json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"}]);
    let (answer, out) = rewrite(&named, "monitoring", &source());
    assert_eq!(answer.summary.outcome, Outcome::Rewritten);
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "1"
    );
    let mut annotated = hinted.clone();
    annotated["metadata"]["annotations"] = json!({"gpuwarden.io/gpu-count": "1"});
    assert_eq!(
        review_pod(&annotated, "monitoring", &source())
            .summary
            .outcome,
        Outcome::Rewritten
    );
    // A pod owned by anything else is not node-wide.
    let mut replica = hinted.clone();
    replica["metadata"]["ownerReferences"][0]["kind"] = json!("ReplicaSet");
    assert_eq!(
        review_pod(&replica, "monitoring", &source())
            .summary
            .outcome,
        Outcome::Rewritten
    );
}

#[test]
fn gpus_held_through_other_nvidia_resources_are_not_requested_twice() {
    // A Kata confidential-computing pod, as in the Contrast docs: a passthrough GPU from the
    // sandbox device plugin, named for the VM by a CDI annotation.
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "gpu-tester", "annotations": {"cdi.k8s.io/gpu": "nvidia.com/pgpu=0"}},
        "spec": {
            "runtimeClassName": "contrast-cc",
            "containers": [{"name": "main", "image": "ubuntu:24.04",
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
                "resources": {"limits": {"nvidia.com/GH100_H100_PCIE": 1}}}]
        }
    });
    let answer = review_pod(&pod, "ml", &source());
    assert_eq!(
        answer.summary.outcome,
        Outcome::Allowed,
        "{:?}",
        answer.warnings()
    );
    assert!(answer.patch.is_none());
    // Privileged, it loses privilege and gets nothing on top; the CDI annotation stays.
    let mut privileged = pod.clone();
    privileged["spec"]["containers"][0]["securityContext"] = json!({"privileged": true});
    let (answer, out) = rewrite(&privileged, "ml", &source());
    assert_eq!(answer.summary.outcome, Outcome::Rewritten);
    let c = &out["spec"]["containers"][0];
    assert_eq!(c["securityContext"]["privileged"], false);
    assert_eq!(
        c["resources"]["limits"],
        json!({"nvidia.com/GH100_H100_PCIE": 1})
    );
    assert_eq!(
        out["metadata"]["annotations"]["cdi.k8s.io/gpu"],
        "nvidia.com/pgpu=0"
    );
    // Inside the VM, NVIDIA_VISIBLE_DEVICES=all reaches only the GPU passed through (Contrast
    // needs it): no leak, and a rewritten GPU container keeps it.
    let mut all = privileged.clone();
    all["spec"]["containers"][0]["env"] =
        json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]);
    let (_, out) = rewrite(&all, "ml", &source());
    assert_eq!(
        out["spec"]["containers"][0]["env"],
        all["spec"]["containers"][0]["env"]
    );
    all["spec"]["containers"][0]["securityContext"] = json!({});
    assert_eq!(
        review_pod(&all, "ml", &source()).summary.outcome,
        Outcome::Allowed
    );
    // Without the passthrough GPU the same annotation is a leak, and goes.
    let mut leak = pod.clone();
    leak["spec"]["containers"][0]["resources"] = json!({});
    let (answer, out) = rewrite(&leak, "ml", &source());
    assert_eq!(answer.summary.outcome, Outcome::Rewritten);
    assert!(
        out["metadata"]["annotations"]
            .get("cdi.k8s.io/gpu")
            .is_none()
    );
    // Time-slicing and MIG resources hold GPUs too; the policy can name more.
    for resource in [
        "nvidia.com/gpu.shared",
        "nvidia.com/mig-1g.10gb",
        "nvidia.com/pgpu",
    ] {
        let mut shared = training_pod();
        shared["spec"]["containers"][0]["resources"]["limits"] = json!({resource: 1});
        let (_, out) = rewrite(&shared, "ml", &source());
        assert_eq!(
            out["spec"]["containers"][0]["resources"]["limits"],
            json!({resource: 1}),
            "{resource}"
        );
    }
    let mut vgpu = training_pod();
    vgpu["spec"]["containers"][0]["resources"]["limits"] = json!({"example.com/vgpu-8g": 1});
    let named = StaticSource::new([policy("default", |p| {
        p.spec.match_.gpu_resources = vec!["example.com/vgpu-*".into()]
    })]);
    let (_, out) = rewrite(&vgpu, "ml", &named);
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["limits"],
        json!({"example.com/vgpu-8g": 1})
    );
    let (_, out) = rewrite(&vgpu, "ml", &source());
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "1"
    );
}

#[test]
fn the_nvidia_runtimes_own_cdi_annotation_prefix_is_a_leak_too() {
    // Where the GPU Operator turns CDI on, the NVIDIA runtime reads nvidia.cdi.k8s.io/* as
    // well: an unprivileged pod carrying one would get every GPU and the management devices.
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "annotations": {
            "nvidia.cdi.k8s.io/container.main": "management.nvidia.com/gpu=all"}},
        "spec": {"containers": [{"name": "main", "image": "ubuntu:24.04"}]}
    });
    let (answer, out) = rewrite(&pod, "ml", &source());
    assert_eq!(answer.summary.outcome, Outcome::Rewritten);
    assert!(
        out["metadata"]["annotations"]
            .get("nvidia.cdi.k8s.io/container.main")
            .is_none()
    );
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "1"
    );
}

#[test]
fn a_rewrite_never_leaves_a_container_without_the_host_devices_it_mounts() {
    // OCI's NCCL test on OKE: privileged MPI workers that mount the host's /dev/infiniband.
    let mut worker = training_pod();
    worker["spec"]["containers"][0]["resources"]["limits"] = json!({"nvidia.com/gpu": 8});
    worker["spec"]["containers"][0]["volumeMounts"] =
        json!([{"name": "ib", "mountPath": "/dev/infiniband"}]);
    worker["spec"]["volumes"] = json!([{"name": "ib", "hostPath": {"path": "/dev/infiniband"}}]);
    let answer = review_pod(&worker, "ml", &source());
    assert_eq!(answer.summary.outcome, Outcome::Denied);
    let message = answer.message();
    for part in [
        "container trainer loses privilege, and an unprivileged container cannot open RDMA devices (/dev/infiniband, volume ib)",
        "request the RDMA devices from an RDMA device plugin (a resource matching rdmaResources rdma/*",
        "exempt it in GpuPolicy default",
    ] {
        assert!(message.contains(part), "{part:?} not in {message}");
    }
    // With an RDMA resource the device plugin hands it the HCA: rewritten, the mount kept.
    let mut with_rdma = worker.clone();
    with_rdma["spec"]["containers"][0]["resources"]["limits"]["rdma/rdma_shared_device_a"] =
        json!(1);
    let (answer, out) = rewrite(&with_rdma, "ml", &source());
    assert_eq!(answer.summary.outcome, Outcome::Rewritten);
    assert_eq!(out["spec"]["volumes"], worker["spec"]["volumes"]);
    assert_eq!(
        out["spec"]["containers"][0]["volumeMounts"],
        worker["spec"]["containers"][0]["volumeMounts"]
    );
    // Other devices, paths written unclean, directories that hold them, the whole /dev.
    for (path, what) in [
        ("/dev/kvm", "KVM (/dev/kvm"),
        ("/dev/vfio/12", "VFIO passthrough devices (/dev/vfio/12"),
        ("/dev/nvidia0/../fuse", "FUSE (/dev/nvidia0/../fuse"),
        ("/dev//net/tun/", "TUN/TAP (/dev//net/tun/"),
        ("/dev/net", "every host device (/dev/net"),
        ("/dev", "every host device (/dev,"),
        ("/dev/", "every host device (/dev/,"),
    ] {
        let mut pod = training_pod();
        pod["spec"]["containers"][0]["volumeMounts"] =
            json!([{"name": "d", "mountPath": "/host-dev"}]);
        pod["spec"]["volumes"] = json!([{"name": "d", "hostPath": {"path": path}}]);
        let answer = review_pod(&pod, "ml", &source());
        assert_eq!(answer.summary.outcome, Outcome::Denied, "{path}");
        assert!(
            answer.message().contains(what),
            "{path}: {}",
            answer.message()
        );
    }
    // An exempt container keeps its privilege and its devices; Audit only warns.
    let audit = StaticSource::new([policy("default", |p| p.spec.mode = PolicyMode::Audit)]);
    let answer = review_pod(&worker, "ml", &audit);
    assert_eq!(answer.summary.outcome, Outcome::Audited);
    assert!(
        answer
            .warnings()
            .iter()
            .any(|w| w.contains("Enforce would deny: container trainer loses privilege"))
    );
    let exempt = StaticSource::new([policy("default", |p| {
        p.spec
            .exemptions
            .containers
            .push(gpuwarden_crds::ContainerExemption {
                images: vec!["nvcr.io/nvidia/pytorch:*".into()],
                namespaces: vec!["ml".into()],
                ..Default::default()
            })
    })]);
    assert_eq!(
        review_pod(&worker, "ml", &exempt).summary.outcome,
        Outcome::Exempt
    );
    // /dev/shm and GPU device paths are not such devices.
    let mut shm = training_pod();
    shm["spec"]["containers"][0]["volumeMounts"] =
        json!([{"name": "shm", "mountPath": "/dev/shm"}]);
    shm["spec"]["volumes"] = json!([{"name": "shm", "hostPath": {"path": "/dev/shm"}}]);
    assert_eq!(
        review_pod(&shm, "ml", &source()).summary.outcome,
        Outcome::Rewritten
    );
}

/// A claim spec on `class` carrying an opaque config of `kind` for the ComputeDomain driver.
fn claim_with_config(class: &str, kind: &str) -> k8s_openapi::api::resource::v1::ResourceClaimSpec {
    serde_json::from_value(json!({"devices": {
        "requests": [{"name": "r", "exactly": {"deviceClassName": class}}],
        "config": [{"requests": ["r"], "opaque": {
            "driver": "compute-domain.nvidia.com",
            "parameters": {"apiVersion": "resource.nvidia.com/v1beta1", "kind": kind, "domainID": "x"}}}]
    }}))
    .unwrap()
}

#[test]
fn claims_only_a_drivers_own_pods_may_hold_are_denied_outside_its_namespaces() {
    let mut source = source();
    for namespace in ["ml", "nvidia-dra-driver-gpu"] {
        let claims = &mut source.claims;
        claims.insert(
            ClaimSource::Template,
            namespace,
            "daemon",
            &claim_spec(&["compute-domain-daemon.nvidia.com"]),
        );
        // The daemon's config on a channel class: the driver reads the config, not the name.
        claims.insert(
            ClaimSource::Claim,
            namespace,
            "disguised",
            &claim_with_config(
                "compute-domain-default-channel.nvidia.com",
                "ComputeDomainDaemonConfig",
            ),
        );
        claims.insert(
            ClaimSource::Template,
            namespace,
            "channel",
            &claim_with_config(
                "compute-domain-default-channel.nvidia.com",
                "ComputeDomainChannelConfig",
            ),
        );
    }
    let pod = |entry: Value| {
        json!({
            "metadata": {"name": "tenant"},
            "spec": {
                "resourceClaims": [entry],
                "containers": [{"name": "c", "image": "busybox",
                                "resources": {"claims": [{"name": "x"}]}}]
            }
        })
    };
    for (entry, what) in [
        (
            json!({"name": "x", "resourceClaimTemplateName": "daemon"}),
            "resourceClaims entry x uses ResourceClaimTemplate ml/daemon: DeviceClass compute-domain-daemon.nvidia.com is meant only for a DRA driver's own pods",
        ),
        (
            json!({"name": "x", "resourceClaimName": "disguised"}),
            "resourceClaims entry x uses ResourceClaim ml/disguised: opaque config ComputeDomainDaemonConfig is meant only",
        ),
    ] {
        // A pod that is neither privileged nor asks for a GPU is denied all the same.
        let answer = review_pod(&pod(entry.clone()), "ml", &source);
        assert_eq!(answer.summary.outcome, Outcome::Denied);
        let message = answer.message();
        assert!(message.contains(what), "{what:?} not in {message}");
        assert!(
            message.contains("every GPU and IMEX channel of the node"),
            "{message}"
        );
        // In the driver's own namespace the same claim is the driver's.
        let answer = review_pod(&pod(entry), "nvidia-dra-driver-gpu", &source);
        assert_ne!(
            answer.summary.outcome,
            Outcome::Denied,
            "{}",
            answer.message()
        );
    }
    // A workload's IMEX channel claim is what ComputeDomains are for.
    let channel = pod(json!({"name": "x", "resourceClaimTemplateName": "channel"}));
    let answer = review_pod(&channel, "ml", &source);
    assert_ne!(
        answer.summary.outcome,
        Outcome::Denied,
        "{}",
        answer.message()
    );

    // A policy that lists no class judges by what the rest of the rules say.
    let mut policy = default_policy();
    policy.spec.driver_claims.device_classes.clear();
    policy.spec.driver_claims.config_kinds.clear();
    let mut open = StaticSource::new([policy]);
    open.claims = source.claims.clone();
    let daemon = pod(json!({"name": "x", "resourceClaimTemplateName": "daemon"}));
    let answer = review_pod(&daemon, "ml", &open);
    assert_ne!(
        answer.summary.outcome,
        Outcome::Denied,
        "{}",
        answer.message()
    );
}

#[test]
fn an_imex_channel_claim_is_no_source_of_rdma_devices() {
    let mut source = source();
    source.claims.insert(
        ClaimSource::Template,
        "ml",
        "channel",
        &claim_with_config(
            "compute-domain-default-channel.nvidia.com",
            "ComputeDomainChannelConfig",
        ),
    );
    source.claims.insert(
        ClaimSource::Claim,
        "ml",
        "nic",
        &claim_spec(&["rdma.example.com"]),
    );
    // A privileged host-network NCCL worker on InfiniBand with an IMEX channel claim: the
    // channel hands it no verbs device, so losing privilege would cut it off the HCAs.
    let worker = |claims: Value| {
        json!({
            "metadata": {"name": "nccl"},
            "spec": {
                "hostNetwork": true,
                "resourceClaims": [
                    {"name": "imex", "resourceClaimTemplateName": "channel"},
                    {"name": "net", "resourceClaimName": "nic"}
                ],
                "containers": [{"name": "worker", "image": "nccl-tests",
                    "securityContext": {"privileged": true},
                    "env": [{"name": "NCCL_IB_HCA", "value": "mlx5_0"}],
                    "resources": {"limits": {"nvidia.com/gpu": 4}, "claims": claims}}]
            }
        })
    };
    let answer = review_pod(&worker(json!([{"name": "imex"}])), "ml", &source);
    assert_eq!(answer.summary.outcome, Outcome::Denied);
    let message = answer.message();
    assert!(
        message.contains("shows RDMA use (NCCL_IB_HCA=mlx5_0)"),
        "{message}"
    );
    // A claim of a class that may hold NICs is a source.
    let answer = review_pod(
        &worker(json!([{"name": "imex"}, {"name": "net"}])),
        "ml",
        &source,
    );
    assert_eq!(
        answer.summary.outcome,
        Outcome::Rewritten,
        "{}",
        answer.message()
    );
}

#[test]
fn kata_annotations_and_visible_cdi_devices_that_hand_devices_are_denied() {
    let pod = |annotations: Value, sidecar_env: Value| {
        json!({
            "metadata": {"name": "kata", "annotations": annotations},
            "spec": {
                "runtimeClassName": "kata-qemu-nvidia-gpu",
                "containers": [
                    {"name": "gpu", "image": "nvcr.io/nvidia/k8s/cuda-sample:vectoradd-cuda12.5.0",
                     "resources": {"limits": {"nvidia.com/pgpu": "1", "memory": "16Gi"}}},
                    {"name": "sidecar", "image": "busybox", "env": sidecar_env}
                ]
            }
        })
    };
    // Kata's documented GPU pod, and its confidential NIM's agent settings, stay as they are.
    let documented = pod(
        json!({"io.katacontainers.config.hypervisor.kernel_params":
               "agent.guest_components_procs=confidential-data-hub agent.aa_kbc_params=cc_kbc::http://kbs",
               "io.katacontainers.config.hypervisor.default_memory": "16384"}),
        json!([]),
    );
    let answer = review_pod(&documented, "ml", &source());
    assert_ne!(
        answer.summary.outcome,
        Outcome::Denied,
        "{}",
        answer.message()
    );
    assert!(answer.patch.is_none(), "{:?}", answer.patch);
    for (annotations, env, what) in [
        (
            json!({"io.katacontainers.config.hypervisor.kernel_params": "agent.visible_cdi_devices=true"}),
            json!([]),
            "annotation io.katacontainers.config.hypervisor.kernel_params sets agent.visible_cdi_devices for Kata's agent",
        ),
        (
            json!({"io.katacontainers.config.hypervisor.cold_plug_vfio": "root-port"}),
            json!([]),
            "annotation io.katacontainers.config.hypervisor.cold_plug_vfio changes which devices",
        ),
        (
            json!({}),
            json!([{"name": "VISIBLE_CDI_DEVICES", "value": "nvidia.com/gpu=all"}]),
            "container sidecar sets VISIBLE_CDI_DEVICES and holds no GPU",
        ),
    ] {
        let answer = review_pod(&pod(annotations, env), "ml", &source());
        assert_eq!(answer.summary.outcome, Outcome::Denied);
        let message = answer.message();
        assert!(message.contains(what), "{what:?} not in {message}");
    }
    // A container holding its own GPU may name what the agent hands it.
    let mut own = pod(json!({}), json!([]));
    own["spec"]["containers"][0]["env"] =
        json!([{"name": "VISIBLE_CDI_DEVICES", "value": "nvidia.com/gpu=0"}]);
    let answer = review_pod(&own, "ml", &source());
    assert_ne!(
        answer.summary.outcome,
        Outcome::Denied,
        "{}",
        answer.message()
    );
}

#[test]
fn a_pod_read_offline_with_a_gpu_naming_debug_container_gets_the_debug_answer() {
    // `kubectl get pod -o yaml` after `kubectl debug --env NVIDIA_VISIBLE_DEVICES=all`.
    let pod = json!({
        "metadata": {"name": "running"},
        "spec": {
            "containers": [{"name": "app", "image": "busybox"}],
            "ephemeralContainers": [{"name": "debugger", "image": "nvidia/cuda:12.4.0-base-ubuntu22.04",
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]
        }
    });
    let answer = review_pod(&pod, "ml", &source());
    assert_eq!(answer.summary.outcome, Outcome::Denied);
    let message = answer.message();
    assert!(
        message.contains("ephemeral container debugger on pod"),
        "{message}"
    );
    assert!(
        message.contains("kubectl debug --profile=general` without NVIDIA_VISIBLE_DEVICES"),
        "{message}"
    );
    // No GPU resource is given to an ephemeral container, which the API server refuses.
    assert!(answer.patch.is_none(), "{:?}", answer.patch);
}
