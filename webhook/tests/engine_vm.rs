//! GPUs handed to VMs (docs/design.md, "GPUs handed to VMs"): VM devices only for the pods
//! KubeVirt's virt-controller creates or a VM runtime class runs, decided by who made the
//! request; no ephemeral container into a VM's pod. Driven through `handle_review`.

mod engine_support;

use engine_support::*;
use gpuwarden_webhook::admission::{Outcome, StaticSource};
use serde_json::{Value, json};

const CONTROLLER: &str = "system:serviceaccount:kubevirt:kubevirt-controller";

fn source() -> StaticSource {
    StaticSource::new([default_policy()])
}

/// A review of `pod` made by `user`.
fn review_by(pod: &Value, user: &str) -> Answer {
    let mut review: Value = serde_json::from_slice(&create_review(pod, "vms")).unwrap();
    review["request"]["userInfo"]["username"] = json!(user);
    answer(&serde_json::to_vec(&review).unwrap(), &source())
}

/// A pod whose one container asks for `resource`, as a tenant would write it, or as
/// KubeVirt renders a launcher pod (labels, owner and all: a tenant can write them too).
fn pod_with(resource: &str, launcher_marks: bool) -> Value {
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {"containers": [{
            "name": "compute", "image": "quay.io/kubevirt/virt-launcher:v1.9.0",
            "resources": {"limits": {resource: "1"}, "requests": {resource: "1"}},
        }]},
    });
    if launcher_marks {
        pod["metadata"]["labels"] = json!({"kubevirt.io": "virt-launcher"});
        pod["metadata"]["ownerReferences"] = json!([{
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "name": "vm", "uid": "u", "controller": true,
        }]);
    }
    pod
}

#[test]
fn a_plain_pod_asking_for_a_vm_device_is_denied_naming_it_whatever_it_says_of_itself() {
    for resource in [
        "nvidia.com/GRID_T4-1Q",
        "nvidia.com/GA102_HIGH_DEFINITION_AUDIO_CONTROLLER",
        "nvidia.com/GA102GL_RTX_A6000",
        "nvidia.com/pgpu",
    ] {
        for marks in [false, true] {
            let answer = review_by(&pod_with(resource, marks), "alice");
            assert!(!answer.allowed(), "{resource} {marks}: {:#}", answer.review);
            let message = answer.message();
            assert!(
                message.contains(&format!("container compute requests {resource}")),
                "{message}"
            );
            assert!(
                message.contains("VFIO devices beyond what it allocates"),
                "{message}"
            );
        }
    }
}

#[test]
fn the_virt_controller_and_vm_runtime_classes_may_hold_vm_devices() {
    let answer = review_by(&pod_with("nvidia.com/GRID_T4-1Q", true), CONTROLLER);
    assert!(answer.allowed(), "{:#}", answer.review);
    // Another namespace's account of the same name is not KubeVirt's.
    let forged = "system:serviceaccount:vms:kubevirt-controller";
    assert!(!review_by(&pod_with("nvidia.com/GRID_T4-1Q", true), forged).allowed());
    let mut kata = pod_with("nvidia.com/GA102GL_A10", false);
    kata["spec"]["runtimeClassName"] = json!("kata-qemu-nvidia-gpu");
    assert!(review_by(&kata, "alice").allowed());
    kata["spec"]["runtimeClassName"] = json!("nvidia");
    assert!(!review_by(&kata, "alice").allowed());
}

#[test]
fn kubevirt_gets_no_exemption_for_what_it_copies_from_the_vm() {
    // A device-injection annotation the VM's author wrote rides along to the launcher pod.
    let mut pod = pod_with("nvidia.com/GRID_T4-1Q", true);
    pod["metadata"]["annotations"] =
        json!({"devices.noderesource.dev/container.compute": "- path: /dev/nvidia0\n"});
    let answer = review_by(&pod, CONTROLLER);
    assert!(!answer.allowed(), "{:#}", answer.review);
    assert_eq!(answer.summary.outcome, Outcome::Denied);
}

#[test]
fn no_ephemeral_container_enters_a_vms_pod_but_one_in_a_kata_vm_may() {
    let old = pod_with("nvidia.com/GRID_T4-1Q", true);
    let mut new = old.clone();
    new["spec"]["ephemeralContainers"] =
        json!([{"name": "debugger", "image": "busybox", "targetContainerName": "compute"}]);
    let answer = answer(&ephemeral_review(&old, &new, "vms"), &source());
    assert!(!answer.allowed(), "{:#}", answer.review);
    let message = answer.message();
    assert!(
        message.contains("ephemeral container debugger"),
        "{message}"
    );
    assert!(
        message.contains("compute: nvidia.com/GRID_T4-1Q"),
        "{message}"
    );
    assert!(message.contains("virtctl console"), "{message}");

    let (mut old, mut new) = (old, new);
    old["spec"]["runtimeClassName"] = json!("kata-qemu-nvidia-gpu");
    new["spec"]["runtimeClassName"] = json!("kata-qemu-nvidia-gpu");
    assert!(answer_allowed(&ephemeral_review(&old, &new, "vms")));
}

fn answer_allowed(body: &[u8]) -> bool {
    answer(body, &source()).allowed()
}

/// A review of KubeVirt `kind` `object` (group `group`), `operation`, made by `user`.
fn vm_review(
    group: &str,
    kind: &str,
    object: &Value,
    old: Option<&Value>,
    operation: &str,
) -> Answer {
    let review = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "vm-1", "namespace": "vms", "operation": operation,
            "name": object["metadata"]["name"],
            "kind": {"group": group, "version": "v1", "kind": kind},
            "resource": {"group": group, "version": "v1", "resource": "virtualmachines"},
            "userInfo": {"username": "alice"},
            "object": object, "oldObject": old,
        }
    });
    answer(&serde_json::to_vec(&review).unwrap(), &source())
}

fn vm(annotations: Value) -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "vm", "namespace": "vms"},
        "spec": {"template": {
            "metadata": {"annotations": annotations},
            "spec": {"domain": {"devices": {"gpus": [
                {"name": "gpu1", "deviceName": "nvidia.com/GRID_T4-1Q"}]}}},
        }},
    })
}

#[test]
fn a_vm_is_judged_for_what_reaches_its_launcher_pod() {
    let plain = vm(json!({}));
    let answer = vm_review("kubevirt.io", "VirtualMachine", &plain, None, "CREATE");
    assert!(answer.allowed(), "{:#}", answer.review);
    assert!(answer.patch.is_none(), "a VM is never patched");

    // A CDI annotation is stripped from the launcher pod when it is created; an NRI device
    // injection cannot be, and the VM is denied.
    let stripped = vm(json!({"cdi.k8s.io/steal": "nvidia.com/gpu=all"}));
    let answer = vm_review("kubevirt.io", "VirtualMachine", &stripped, None, "CREATE");
    assert!(answer.allowed(), "{:#}", answer.review);
    assert!(answer.patch.is_none(), "a VM is never patched");
    let injecting = vm(
        json!({"devices.noderesource.dev/container.compute": "- path: /dev/nvidia0\n  type: c\n  major: 195\n  minor: 0\n"}),
    );
    let answer = vm_review("kubevirt.io", "VirtualMachine", &injecting, None, "CREATE");
    assert!(!answer.allowed(), "{:#}", answer.review);
    let message = answer.message();
    assert!(message.contains("VirtualMachine vms/vm"), "{message}");

    let kata = vm(json!({"io.katacontainers.config_path": "/tmp/evil.toml"}));
    assert!(!vm_review("kubevirt.io", "VirtualMachine", &kata, None, "CREATE").allowed());

    // An update that leaves the template as it was passes, so an older VM can be stopped.
    let mut stopped = injecting.clone();
    stopped["spec"]["runStrategy"] = json!("Halted");
    let answer = vm_review(
        "kubevirt.io",
        "VirtualMachine",
        &stopped,
        Some(&injecting),
        "UPDATE",
    );
    assert!(answer.allowed(), "{:#}", answer.review);
    let answer = vm_review(
        "kubevirt.io",
        "VirtualMachine",
        &injecting,
        Some(&plain),
        "UPDATE",
    );
    assert!(!answer.allowed(), "{:#}", answer.review);
    // A VM already denied before an update that changes its template (KubeVirt writing an
    // annotation) is let through, warning why.
    let mut annotated = injecting.clone();
    annotated["spec"]["template"]["metadata"]["annotations"]["kubevirt.io/latest-observed-api-version"] =
        json!("v1");
    let answer = vm_review(
        "kubevirt.io",
        "VirtualMachine",
        &annotated,
        Some(&injecting),
        "UPDATE",
    );
    assert!(answer.allowed(), "{:#}", answer.review);
    assert!(
        answer
            .warnings()
            .iter()
            .any(|w| w.contains("before this update too")),
        "{:?}",
        answer.warnings()
    );
    // A pool's template, and one that cannot be read, which is named.
    let pool = json!({
        "apiVersion": "pool.kubevirt.io/v1alpha1", "kind": "VirtualMachinePool",
        "metadata": {"name": "pool"},
        "spec": {"virtualMachineTemplate": {"spec": injecting["spec"].clone()}},
    });
    assert!(
        !vm_review(
            "pool.kubevirt.io",
            "VirtualMachinePool",
            &pool,
            None,
            "CREATE"
        )
        .allowed()
    );
    let broken = json!({"apiVersion": "pool.kubevirt.io/v1alpha1", "kind": "VirtualMachinePool",
        "metadata": {"name": "pool"}, "spec": {}});
    let answer = vm_review(
        "pool.kubevirt.io",
        "VirtualMachinePool",
        &broken,
        None,
        "CREATE",
    );
    assert!(!answer.allowed());
    assert!(
        answer
            .message()
            .contains("spec.virtualMachineTemplate.spec.template"),
        "{}",
        answer.message()
    );
}

/// A `CONNECT` review of `pods/<sub>` on pod `p` by `user`.
fn connect(sub: &str, user: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "c-1", "namespace": "vms", "name": "p", "operation": "CONNECT",
            "subResource": sub,
            "kind": {"group": "", "version": "v1", "kind": "PodExecOptions"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "userInfo": {"username": user},
            "object": {"kind": "PodExecOptions", "command": ["sh"], "container": "compute"},
        }
    }))
    .unwrap()
}

fn entered(body: &[u8], pod: Result<Option<Value>, String>) -> Value {
    use gpuwarden_webhook::admission::handle_entry;
    let (bytes, _) = handle_entry(body, pod, &source());
    serde_json::from_slice(&bytes).unwrap()
}

#[test]
fn nobody_enters_a_vms_pod_and_ordinary_pods_stay_open() {
    use gpuwarden_webhook::admission::entry_target;
    let launcher = pod_with("nvidia.com/GRID_T4-1Q", true);
    for sub in ["exec", "attach", "portforward"] {
        let body = connect(sub, "alice");
        assert!(entry_target(&body).is_some(), "{sub}");
        let answer = entered(&body, Ok(Some(launcher.clone())));
        assert_eq!(answer["response"]["allowed"], false, "{sub}: {answer:#}");
        let message = answer["response"]["status"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("pods/{sub} into pod vms/p")),
            "{message}"
        );
        assert!(message.contains("virtctl console"), "{message}");
    }
    // The VM devices decide even where the marks were removed; the marks alone refuse too.
    let unmarked = pod_with("nvidia.com/GA102GL_A10", false);
    let answer = entered(&connect("exec", "alice"), Ok(Some(unmarked)));
    assert_eq!(answer["response"]["allowed"], false);
    let mut marked_only = pod_with("cpu", true);
    marked_only["spec"]["containers"][0]["resources"] = json!({});
    assert_eq!(
        entered(&connect("exec", "alice"), Ok(Some(marked_only)))["response"]["allowed"],
        false
    );
    // An ordinary pod, a Kata pod, a pod that is gone: open.
    let ordinary = pod_with("nvidia.com/gpu", false);
    assert_eq!(
        entered(&connect("exec", "alice"), Ok(Some(ordinary)))["response"]["allowed"],
        true
    );
    let mut kata = pod_with("nvidia.com/GA102GL_A10", false);
    kata["spec"]["runtimeClassName"] = json!("kata-qemu-nvidia-gpu");
    assert_eq!(
        entered(&connect("exec", "alice"), Ok(Some(kata)))["response"]["allowed"],
        true
    );
    assert_eq!(
        entered(&connect("exec", "alice"), Ok(None))["response"]["allowed"],
        true
    );
    // A pod that cannot be read is not entered.
    let answer = entered(&connect("exec", "alice"), Err("timed out".into()));
    assert_eq!(answer["response"]["allowed"], false);
    // Unless no policy could govern it.
    let (bytes, _) = gpuwarden_webhook::admission::handle_entry(
        &connect("exec", "alice"),
        Err("timed out".into()),
        &StaticSource::new([]),
    );
    let ungoverned: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(ungoverned["response"]["allowed"], true, "{ungoverned:#}");
    // Not an entry: logs, a pod create.
    assert!(entry_target(&connect("log", "alice")).is_none());
    assert!(entry_target(&create_review(&launcher, "vms")).is_none());
}
