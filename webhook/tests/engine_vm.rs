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
