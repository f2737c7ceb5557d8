//! VM devices (docs/design.md, "GPUs handed to VMs"): a pod that requests a resource whose
//! device plugin hands out whole devices for a VM (`virtualMachines.deviceResources`) is
//! refused unless it is a VM's pod: created by KubeVirt's virt-controller (who made the
//! request, never what the pod says of itself) or run in a VM runtime class.

use std::sync::Arc;

use gpuwarden_crds::GpuPolicy;
use gpuwarden_crds::gpu::ContainerSpec;
use gpuwarden_crds::selection::select_policy;
use gpuwarden_crds::selector::Labels;
use gpuwarden_crds::vm::{self, Requester};

use super::claims::NoClaims;
use super::facts::{self, ContainerFacts};
use crate::pod::{ContainerKind, Map, PodView};

/// The pod's refusals: one per init or regular container that requests VM devices, naming
/// them, unless the pod is a VM's.
pub(super) fn refusals(
    pod: &PodView<'_>,
    containers: &[ContainerFacts<'_>],
    requester: Requester<'_>,
    policy: &GpuPolicy,
) -> Vec<String> {
    let out = held(containers, policy);
    if out.is_empty() {
        return Vec::new();
    }
    if policy
        .spec
        .virtual_machines
        .is_vm_pod(requester, runtime_class(pod), controller(pod))
    {
        return Vec::new();
    }
    out.into_iter()
        .map(|(container, names)| {
            format!(
                "container {container} requests {names}, a VM device (virtualMachines.deviceResources), in a pod neither KubeVirt's virt-controller created nor a VM runtime class runs: {}; {}",
                vm::VM_ONLY_REASON,
                vm::VM_ONLY_HINT
            )
        })
        .collect()
}

/// Whether a pod is a VM's pod on the host, which nobody may enter (docs/design.md, "No way
/// into a VM's pod"): what its containers hold (`compute: nvidia.com/GRID_T4-1Q`), when
/// one holds VM devices and no VM runtime class runs it (there the container is inside the
/// VM, and entering it reaches only the VM).
pub(super) fn entered(
    pod: &PodView<'_>,
    containers: &[ContainerFacts<'_>],
    policy: &GpuPolicy,
) -> Option<String> {
    let held = held(containers, policy);
    let in_vm = runtime_class(pod)
        .is_some_and(|class| policy.spec.virtual_machines.is_vm_runtime_class(class));
    (!held.is_empty() && !in_vm).then(|| {
        (held.iter())
            .map(|(c, names)| format!("{c}: {names}"))
            .collect::<Vec<_>>()
            .join("; ")
    })
}

fn runtime_class<'a>(pod: &'a PodView<'_>) -> Option<&'a str> {
    pod.spec.as_ref()?.runtime_class_name.as_deref()
}

/// The pod's controller reference as (apiVersion, kind).
fn controller<'a>(pod: &'a PodView<'_>) -> Option<(&'a str, &'a str)> {
    pod.controller().map(|r| {
        (
            r.api_version.as_deref().unwrap_or_default(),
            r.kind.as_deref().unwrap_or_default(),
        )
    })
}

/// The init and regular containers that request VM devices, with the devices, sorted; those
/// whose image the policy exempts are left out, as from every other rule.
fn held<'a>(containers: &[ContainerFacts<'a>], policy: &GpuPolicy) -> Vec<(&'a str, String)> {
    let vms = &policy.spec.virtual_machines;
    let mut out = Vec::new();
    for c in containers {
        if c.at.kind == ContainerKind::Ephemeral || c.image_exempt {
            continue;
        }
        let value = c.value;
        let mut names: Vec<&str> = (value.limit_names().chain(value.request_names()))
            .filter(|r| vms.is_device(r))
            .collect();
        names.sort_unstable();
        names.dedup();
        if !names.is_empty() {
            out.push((c.name, names.join(", ")));
        }
    }
    out
}

/// Why `username` may not exec, attach or port-forward into `pod` in `namespace` (docs/
/// design.md, "No way into a VM's pod"): the pod is a VM's on the host, by the VM devices
/// its containers hold, or by KubeVirt's marks on it (which a pod's author may write, so
/// they only ever refuse more), under the policy that governs it. `None` lets it through:
/// no policy governs the pod, its namespace or service account is exempt, it runs in a VM
/// runtime class, or `username` is one of KubeVirt's controllers.
pub fn entry_denial(
    pod: &PodView<'_>,
    namespace: &str,
    namespace_labels: &dyn Labels,
    policies: &[Arc<GpuPolicy>],
    username: &str,
    subresource: &str,
) -> Option<String> {
    let no_labels = Map::new();
    let pod_labels = (pod.metadata.as_ref())
        .and_then(|m| m.labels.as_ref())
        .unwrap_or(&no_labels);
    let policy = select_policy(policies, namespace_labels, pod_labels).policy?;
    if facts::pod_exemption(pod, namespace, policy).is_some() {
        return None;
    }
    let vms = &policy.spec.virtual_machines;
    if vms.controllers.iter().any(|c| c == username)
        || runtime_class(pod).is_some_and(|c| vms.is_vm_runtime_class(c))
    {
        return None;
    }
    let facts = facts::read_pod(pod, namespace, policy, &NoClaims(""));
    let held = held(&facts.containers, policy);
    let marked = pod_labels.get("kubevirt.io").and_then(|v| v.as_str()) == Some("virt-launcher")
        || controller(pod).is_some_and(|(v, k)| vm::is_vmi_reference(v, k));
    if held.is_empty() && !marked {
        return None;
    }
    let what = if held.is_empty() {
        "a KubeVirt launcher pod".to_owned()
    } else {
        let held: Vec<String> = (held.iter())
            .map(|(c, names)| format!("{c}: {names}"))
            .collect();
        format!("a VM's pod ({})", held.join("; "))
    };
    let name = (pod.metadata.as_ref())
        .and_then(|m| m.name.as_deref())
        .unwrap_or_default();
    Some(format!(
        "gpuwarden: pods/{subresource} into pod {namespace}/{name} is denied by GpuPolicy {}: it is {what}, and {}",
        policy.reference(),
        vm::NO_ENTRY_REASON
    ))
}

/// Whether a policy could govern a pod of the namespace whose labels are given, whatever the
/// pod's labels: one selects the namespace, or one selects pods by their labels. Where none
/// could, a pod there that cannot be read may be entered.
pub fn may_govern(namespace_labels: &dyn Labels, policies: &[Arc<GpuPolicy>]) -> bool {
    policies.iter().any(|p| p.spec.pod_selector.is_some())
        || (select_policy(policies, namespace_labels, &Map::new()).policy).is_some()
}
