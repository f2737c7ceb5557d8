//! GPUs handed whole to virtual machines (docs/design.md, "GPUs handed to VMs").
//!
//! NVIDIA's sandbox device plugin (kubevirt-gpu-device-plugin, the GPU Operator's
//! `sandboxWorkloads`) advertises a passthrough GPU under its PCI database name
//! (`nvidia.com/GA102GL_A10`, and the GPU's audio function as
//! `nvidia.com/GA102_HIGH_DEFINITION_AUDIO_CONTROLLER`) and a vGPU under its type
//! (`nvidia.com/GRID_T4-1Q`, `nvidia.com/NVIDIA_A10-12Q`). It hands a container the VFIO
//! group nodes under `/dev/vfio`, more than it allocates: a vGPU gets the whole directory,
//! a function its whole IOMMU group. Only a VM may hold them: a KubeVirt launcher pod, which
//! the virt-controller creates, or a pod whose runtime class runs it in its own VM (Kata).
//! Who made a pod decides, never what its author wrote on it.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use crate::bounds::{
    DNS_SUBDOMAIN_LEN, QUALIFIED_NAME_LEN, RESOURCE_PATTERN_MESSAGE, RESOURCE_PATTERN_RULE,
};
use crate::glob::glob_match;

/// The API group of KubeVirt's VirtualMachine, VirtualMachineInstance and
/// VirtualMachineInstanceReplicaSet.
pub const KUBEVIRT_GROUP: &str = "kubevirt.io";
/// The API group of KubeVirt's VirtualMachinePool.
pub const KUBEVIRT_POOL_GROUP: &str = "pool.kubevirt.io";
/// The kind that owns a launcher pod.
pub const KIND_VMI: &str = "VirtualMachineInstance";

/// KubeVirt's kinds that reach a launcher pod, with the JSON pointer of the
/// VirtualMachineInstance spec and metadata they hold ("" for the object itself).
pub const VM_KINDS: [(&str, &str, &str); 4] = [
    (KUBEVIRT_GROUP, KIND_VMI, ""),
    (KUBEVIRT_GROUP, "VirtualMachine", "/spec/template"),
    (
        KUBEVIRT_GROUP,
        "VirtualMachineInstanceReplicaSet",
        "/spec/template",
    ),
    (
        KUBEVIRT_POOL_GROUP,
        "VirtualMachinePool",
        "/spec/virtualMachineTemplate/spec/template",
    ),
];

/// Where in an object of `group`/`kind` the VirtualMachineInstance template is: `None` for
/// a kind that is not KubeVirt's.
pub fn vmi_pointer(group: &str, kind: &str) -> Option<&'static str> {
    (VM_KINDS.iter())
        .find(|(g, k, _)| *g == group && *k == kind)
        .map(|(_, _, p)| *p)
}

/// The resource names of [`VM_KINDS`], for webhook rules: (group, resource).
pub const VM_RESOURCES: [(&str, &str); 4] = [
    (KUBEVIRT_GROUP, "virtualmachineinstances"),
    (KUBEVIRT_GROUP, "virtualmachines"),
    (KUBEVIRT_GROUP, "virtualmachineinstancereplicasets"),
    (KUBEVIRT_POOL_GROUP, "virtualmachinepools"),
];

/// The pod subresources that reach into a running container. KubeVirt's console, VNC and
/// port-forward go through its own `subresources.kubevirt.io` API and never use them.
pub const POD_ENTRY_SUBRESOURCES: [&str; 3] = ["exec", "attach", "portforward"];

/// Why a pod that is not a VM may not hold a VM device resource, for denials.
pub const VM_ONLY_REASON: &str = "its device plugin hands the container VFIO devices beyond what it allocates (a vGPU gets every group of the node, a GPU function its whole IOMMU group), so only a VM may hold it: a KubeVirt launcher pod created by the virt-controller, or a pod of a VM runtime class";

/// What to do instead, for denials.
pub const VM_ONLY_HINT: &str = "ask for the GPU through a KubeVirt VirtualMachine (spec.domain.devices.gpus or hostDevices), or run the pod in a runtime class the GpuPolicy lists under virtualMachines.runtimeClasses";

/// Why no one may exec, attach or port-forward into a VM's pod, for denials.
pub const NO_ENTRY_REASON: &str = "its containers hold the VM's VFIO devices; use KubeVirt's console, VNC or port-forward (virtctl console, virtctl vnc, virtctl port-forward), which reach the VM, not its pod";

/// See [`crate::GpuPolicySpec::virtual_machines`].
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachines {
    /// Extended resources (globs, `domain/name`) whose device plugin hands a container a
    /// whole device for a VM (VFIO): only a VM's pod may request one. The default names
    /// NVIDIA's sandbox device plugin: `nvidia.com/pgpu`, passthrough GPUs by their PCI
    /// name (`nvidia.com/GA102GL_A10`, `nvidia.com/GH100_H100_PCIE`,
    /// `nvidia.com/TU104GL_TESLA_T4`, `nvidia.com/AD102GL_L40S`, and their audio functions)
    /// and vGPU types (`nvidia.com/GRID_T4-1Q`, `nvidia.com/NVIDIA_A10-12Q`). GpuNode
    /// `status.vfio` lists what each node's VFIO plugin advertises, and the operator names
    /// a VFIO resource this list misses.
    #[serde(default = "default_device_resources")]
    #[x_kube(validation = Rule::new(RESOURCE_PATTERN_RULE).message(RESOURCE_PATTERN_MESSAGE))]
    #[schemars(length(max = 32), inner(length(max = QUALIFIED_NAME_LEN)))]
    pub device_resources: Vec<String>,

    /// Users whose pod creations are KubeVirt's: the virt-controller's service account, as
    /// `system:serviceaccount:<namespace>:<name>`. A pod one of them creates may hold VM
    /// devices; it is judged like any other pod for everything else, since KubeVirt copies
    /// the VM's labels and annotations onto it. The default names KubeVirt's install
    /// namespaces upstream (`kubevirt`) and on OpenShift (`openshift-cnv`).
    #[serde(default = "default_controllers")]
    #[x_kube(validation = Rule::new("self.all(u, size(u) > 0)").message("controllers are user names such as system:serviceaccount:kubevirt:kubevirt-controller"))]
    #[schemars(length(max = 16), inner(length(max = 512)))]
    pub controllers: Vec<String>,

    /// Runtime classes (globs) that run each pod in its own VM (Kata Containers): a pod of
    /// one may hold VM devices, which its runtime plugs into the pod's VM. The RuntimeClass
    /// objects are the cluster admin's; the default names Kata's (`kata-*`, the GPU
    /// Operator's `kata-qemu-nvidia-gpu*` among them) and Contrast's (`contrast-cc*`).
    /// `[]` lets no pod outside KubeVirt hold one.
    #[serde(default = "default_runtime_classes")]
    #[schemars(length(max = 16), inner(length(max = DNS_SUBDOMAIN_LEN)))]
    pub runtime_classes: Vec<String>,
}

impl Default for VirtualMachines {
    fn default() -> Self {
        Self {
            device_resources: default_device_resources(),
            controllers: default_controllers(),
            runtime_classes: default_runtime_classes(),
        }
    }
}

/// The defaults of [`VirtualMachines::device_resources`].
pub const DEFAULT_DEVICE_RESOURCES: [&str; 5] = [
    "nvidia.com/pgpu",
    // GA, GB, GH, GK, GM, GP, GV chips; GRID vGPU types.
    "nvidia.com/G*",
    "nvidia.com/TU*",
    "nvidia.com/AD*",
    "nvidia.com/NVIDIA_*",
];

/// The defaults of [`VirtualMachines::controllers`].
pub const DEFAULT_CONTROLLERS: [&str; 2] = [
    "system:serviceaccount:kubevirt:kubevirt-controller",
    "system:serviceaccount:openshift-cnv:kubevirt-controller",
];

/// The defaults of [`VirtualMachines::runtime_classes`].
pub const DEFAULT_RUNTIME_CLASSES: [&str; 2] = ["kata-*", "contrast-cc*"];

fn default_device_resources() -> Vec<String> {
    DEFAULT_DEVICE_RESOURCES.map(String::from).to_vec()
}
fn default_controllers() -> Vec<String> {
    DEFAULT_CONTROLLERS.map(String::from).to_vec()
}
fn default_runtime_classes() -> Vec<String> {
    DEFAULT_RUNTIME_CLASSES.map(String::from).to_vec()
}

/// Who asked for a pod, as far as the engine can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Requester<'a> {
    /// The user of an admission request (`request.userInfo.username`).
    User(&'a str),
    /// KubeVirt's virt-controller, rendering a VM's launcher pod (a VM judged for what
    /// reaches its pod).
    KubeVirt,
    /// No request names one: a manifest read offline, or a pod already running. Its
    /// controller reference stands in, which only an admission request could check.
    Unknown,
}

impl VirtualMachines {
    /// Whether `resource` is a VM device resource.
    pub fn is_device(&self, resource: &str) -> bool {
        (self.device_resources.iter()).any(|p| glob_match(p, resource))
    }

    /// Whether a pod may hold VM devices: made by KubeVirt (by request, or offline by its
    /// controller reference, `(apiVersion, kind)`), or run in a VM runtime class.
    pub fn is_vm_pod(
        &self,
        requester: Requester<'_>,
        runtime_class: Option<&str>,
        controller: Option<(&str, &str)>,
    ) -> bool {
        let made_by_kubevirt = match requester {
            Requester::User(user) => self.controllers.iter().any(|c| c == user),
            Requester::KubeVirt => true,
            Requester::Unknown => controller.is_some_and(|(v, k)| is_vmi_reference(v, k)),
        };
        made_by_kubevirt || runtime_class.is_some_and(|class| self.is_vm_runtime_class(class))
    }

    /// Whether `class` runs each pod in its own VM.
    pub fn is_vm_runtime_class(&self, class: &str) -> bool {
        matches_runtime_class(&self.runtime_classes, class)
    }
}

/// Whether runtime class `class` is one of `patterns` (globs): [`VirtualMachines::runtime_classes`].
pub fn matches_runtime_class(patterns: &[String], class: &str) -> bool {
    patterns.iter().any(|p| glob_match(p, class))
}

/// Whether an owner reference (`apiVersion`, `kind`) names a VirtualMachineInstance of
/// KubeVirt.
pub fn is_vmi_reference(api_version: &str, kind: &str) -> bool {
    kind == KIND_VMI
        && (api_version.rsplit_once('/')).is_some_and(|(group, _)| group == KUBEVIRT_GROUP)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sandbox_plugins_names_are_vm_devices_and_nvidias_others_are_not() {
        let vms = VirtualMachines::default();
        for name in [
            "nvidia.com/pgpu",
            "nvidia.com/GA102GL_A10",
            "nvidia.com/GA102_HIGH_DEFINITION_AUDIO_CONTROLLER",
            "nvidia.com/GH100_H100_PCIE",
            "nvidia.com/TU104GL_TESLA_T4",
            "nvidia.com/AD102GL_L40S",
            "nvidia.com/GRID_T4-1Q",
            "nvidia.com/NVIDIA_A10-12Q",
        ] {
            assert!(vms.is_device(name), "{name}");
        }
        for name in [
            "nvidia.com/gpu",
            "nvidia.com/gpu.shared",
            "nvidia.com/mig-1g.10gb",
            "nvidia.com/hostdev",
            "devices.kubevirt.io/kvm",
            "rdma/rdma_shared_device_a",
        ] {
            assert!(!vms.is_device(name), "{name}");
        }
    }

    #[test]
    fn only_the_request_decides_and_offline_the_controller_reference_stands_in() {
        let vms = VirtualMachines::default();
        let vmi = ("kubevirt.io/v1", KIND_VMI);
        let controller = "system:serviceaccount:kubevirt:kubevirt-controller";
        assert!(vms.is_vm_pod(Requester::User(controller), None, None));
        // A tenant's pod that names a VMI as its owner is still the tenant's.
        assert!(!vms.is_vm_pod(Requester::User("alice"), None, Some(vmi)));
        assert!(!vms.is_vm_pod(
            Requester::User("system:serviceaccount:tenant:kubevirt-controller"),
            None,
            None
        ));
        assert!(vms.is_vm_pod(Requester::KubeVirt, None, None));
        assert!(vms.is_vm_pod(Requester::Unknown, None, Some(vmi)));
        assert!(!vms.is_vm_pod(Requester::Unknown, None, None));
        let forged = ("example.com/v1", KIND_VMI);
        assert!(!vms.is_vm_pod(Requester::Unknown, None, Some(forged)));
        assert!(vms.is_vm_pod(Requester::User("alice"), Some("kata-qemu-nvidia-gpu"), None));
        assert!(!vms.is_vm_pod(Requester::User("alice"), Some("nvidia"), None));
    }

    #[test]
    fn every_kubevirt_kind_has_its_template_and_no_other_kind_does() {
        assert_eq!(
            vmi_pointer("kubevirt.io", "VirtualMachine"),
            Some("/spec/template")
        );
        assert_eq!(vmi_pointer("kubevirt.io", KIND_VMI), Some(""));
        assert_eq!(
            vmi_pointer("pool.kubevirt.io", "VirtualMachinePool"),
            Some("/spec/virtualMachineTemplate/spec/template")
        );
        assert_eq!(vmi_pointer("apps", "Deployment"), None);
        assert_eq!(vmi_pointer("example.com", "VirtualMachine"), None);
    }
}
