//! KubeVirt's VMs judged as the launcher pod the virt-controller renders for them
//! (docs/design.md, "VMs judged like pods"), from KubeVirt v1.9.0's
//! `pkg/virt-controller/services` (`renderLaunchManifest`):
//!
//! - every label of the VirtualMachineInstance, and every annotation but those under
//!   `kubectl.kubernetes.io` and two of KubeVirt's own, reach the pod;
//! - each `spec.domain.devices.gpus[]` and `hostDevices[]` entry with a `deviceName` adds one
//!   of that resource to the limits and requests of the `compute` container, and one with a
//!   `claimRequest` a claim; `spec.domain.resources` is copied into it as it is;
//! - `spec.resourceClaims`, `nodeSelector`, `affinity`, `tolerations`, `schedulerName`
//!   and `priorityClassName` are copied to the pod; a `serviceAccount` volume names its
//!   service account;
//! - each hook sidecar of the `hooks.kubevirt.io/hookSidecars` annotation runs its image in
//!   a container of the pod, and so does each `containerDisk` volume (`volume<name>`): images
//!   the VM's author names, which may set `NVIDIA_VISIBLE_DEVICES` themselves.
//!
//! The pod is judged as the virt-controller's request, so its VM devices pass; everything
//! the VM's author wrote is judged as in any other pod.

use serde_json::{Map, Value, json};

use gpuwarden_crds::vm;

/// The container KubeVirt runs the VM's qemu in, and gives every device.
pub const COMPUTE: &str = "compute";

/// The annotation whose hook sidecars KubeVirt adds to the launcher pod.
const HOOK_SIDECARS: &str = "hooks.kubevirt.io/hookSidecars";

/// Annotation prefixes KubeVirt does not copy to the launcher pod.
const NOT_COPIED: [&str; 3] = [
    "kubectl.kubernetes.io",
    "kubevirt.io/storage-observed-api-version",
    "kubevirt.io/latest-observed-api-version",
];

/// Fields of the VMI spec KubeVirt copies to the pod as they are.
const COPIED_SPEC: [&str; 6] = [
    "resourceClaims",
    "nodeSelector",
    "affinity",
    "tolerations",
    "schedulerName",
    "priorityClassName",
];

/// The launcher pod of a VM and how it was read.
#[derive(Debug)]
pub struct Rendered {
    /// The pod, as KubeVirt would create it (its metadata and spec).
    pub pod: Value,
    /// What could not be read as KubeVirt reads it, for the reader.
    pub notes: Vec<String>,
}

/// Whether `object` is one of KubeVirt's kinds that reach a launcher pod.
pub fn is_vm(object: &Value) -> bool {
    template_pointer(object).is_some()
}

fn template_pointer(object: &Value) -> Option<&'static str> {
    let api_version = object.get("apiVersion")?.as_str()?;
    let kind = object.get("kind")?.as_str()?;
    let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
    vm::vmi_pointer(group, kind)
}

/// Whether two versions of a VM hold the same VirtualMachineInstance template, as far as
/// it reaches a launcher pod: its spec, labels and annotations. KubeVirt writes a VMI's
/// status with updates of the whole object, which this lets through.
pub fn same_template(old: &Value, new: &Value) -> bool {
    let parts = |object: &Value| {
        let template = template_pointer(object).and_then(|p| object.pointer(p))?;
        Some(
            ["/spec", "/metadata/labels", "/metadata/annotations"]
                .map(|p| template.pointer(p).cloned()),
        )
    };
    matches!((parts(old), parts(new)), (Some(a), Some(b)) if a == b)
}

/// The launcher pod of a VirtualMachine, VirtualMachineInstance, replica set or pool:
/// `Err` says where the object is not shaped as KubeVirt reads it.
pub fn launcher_pod(object: &Value) -> Result<Rendered, String> {
    let pointer = template_pointer(object).ok_or("not a KubeVirt VM kind")?;
    let template = object
        .pointer(pointer)
        .filter(|t| t.is_object())
        .ok_or_else(|| format!("no VirtualMachineInstance template at {}", dotted(pointer)))?;
    let meta = template.get("metadata").unwrap_or(&Value::Null);
    let spec = template.get("spec").unwrap_or(&Value::Null);
    if !spec.is_object() {
        return Err(format!("{}.spec is not an object", dotted(pointer)));
    }
    let mut notes = Vec::new();
    let mut labels = object_or_empty(meta.get("labels"));
    labels.insert("kubevirt.io".into(), json!("virt-launcher"));
    let mut annotations: Map<String, Value> = object_or_empty(meta.get("annotations"))
        .into_iter()
        .filter(|(k, _)| !NOT_COPIED.iter().any(|p| k.starts_with(p)))
        .collect();
    annotations.insert(
        "kubectl.kubernetes.io/default-container".into(),
        json!(COMPUTE),
    );
    let mut containers = vec![compute(spec)];
    containers.extend(sidecars(annotations.get(HOOK_SIDECARS), &mut notes));
    containers.extend(container_disks(spec));
    let mut pod_spec = Map::new();
    for field in COPIED_SPEC {
        if let Some(value) = spec.get(field) {
            pod_spec.insert(field.into(), value.clone());
        }
    }
    if let Some(account) = service_account(spec) {
        pod_spec.insert("serviceAccountName".into(), json!(account));
    }
    pod_spec.insert("containers".into(), Value::Array(containers));
    let name = meta.get("name").and_then(Value::as_str).unwrap_or("vm");
    let pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": format!("virt-launcher-{name}-"),
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [{
                "apiVersion": "kubevirt.io/v1", "kind": vm::KIND_VMI, "name": name,
                "uid": "", "controller": true,
            }],
        },
        "spec": pod_spec,
    });
    Ok(Rendered { pod, notes })
}

/// The `compute` container: `spec.domain.resources`, plus one of each device plugin
/// resource a GPU or host device names, and the claims they name.
fn compute(spec: &Value) -> Value {
    let domain = spec.get("domain").unwrap_or(&Value::Null);
    let resources = domain.get("resources").unwrap_or(&Value::Null);
    let mut limits = object_or_empty(resources.get("limits"));
    let mut requests = object_or_empty(resources.get("requests"));
    let mut claims = Vec::new();
    let devices = domain.get("devices").unwrap_or(&Value::Null);
    for list in ["gpus", "hostDevices"] {
        for device in devices
            .get(list)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            match (
                device.get("deviceName").and_then(Value::as_str),
                device.get("claimRequest"),
            ) {
                (Some(name), None) if !name.is_empty() => {
                    for map in [&mut limits, &mut requests] {
                        bump(map, name);
                    }
                }
                (_, Some(claim)) => {
                    let mut entry = Map::new();
                    if let Some(name) = claim.get("claimName") {
                        entry.insert("name".into(), name.clone());
                    }
                    if let Some(request) = claim.get("requestName") {
                        entry.insert("request".into(), request.clone());
                    }
                    claims.push(Value::Object(entry));
                }
                _ => {}
            }
        }
    }
    let mut resources = json!({"limits": limits, "requests": requests});
    if !claims.is_empty() {
        resources["claims"] = Value::Array(claims);
    }
    json!({
        "name": COMPUTE,
        "image": "virt-launcher",
        "securityContext": {"privileged": false},
        "resources": resources,
    })
}

/// One more of `name` in a resource map (quantities KubeVirt adds are whole numbers).
fn bump(map: &mut Map<String, Value>, name: &str) {
    let count = match map.get(name) {
        Some(Value::String(s)) => s.parse::<u64>().unwrap_or(0),
        Some(Value::Number(n)) => n.as_u64().unwrap_or(0),
        _ => 0,
    };
    map.insert(name.into(), json!((count + 1).to_string()));
}

/// The hook sidecar containers: each entry's `image` (and `args`) runs beside `compute`.
fn sidecars(annotation: Option<&Value>, notes: &mut Vec<String>) -> Vec<Value> {
    let Some(text) = annotation.and_then(Value::as_str) else {
        return Vec::new();
    };
    let Ok(Value::Array(entries)) = serde_json::from_str::<Value>(text) else {
        notes.push(format!(
            "annotation {HOOK_SIDECARS} is not a JSON list; KubeVirt refuses such a VM"
        ));
        return Vec::new();
    };
    (entries.iter().enumerate())
        .filter_map(|(i, entry)| {
            let image = entry.get("image").and_then(Value::as_str)?;
            let mut c = json!({"name": format!("hook-sidecar-{i}"), "image": image});
            if let Some(args) = entry.get("args") {
                c["args"] = args.clone();
            }
            Some(c)
        })
        .collect()
}

/// A container per `containerDisk` volume, running its image (KubeVirt serves the disk from
/// it).
fn container_disks(spec: &Value) -> Vec<Value> {
    (spec
        .get("volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten())
    .filter_map(|v| {
        let image = v.pointer("/containerDisk/image")?.as_str()?;
        let name = v.get("name").and_then(Value::as_str).unwrap_or_default();
        Some(json!({"name": format!("volume{name}"), "image": image}))
    })
    .collect()
}

/// The service account a `serviceAccount` volume names.
fn service_account(spec: &Value) -> Option<&str> {
    (spec.get("volumes")?.as_array()?.iter())
        .find_map(|v| v.pointer("/serviceAccount/serviceAccountName")?.as_str())
}

fn object_or_empty(value: Option<&Value>) -> Map<String, Value> {
    value
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default()
}

/// `/spec/template` as users write it: `spec.template`.
fn dotted(pointer: &str) -> String {
    if pointer.is_empty() {
        "the object".to_owned()
    } else {
        pointer.trim_start_matches('/').replace('/', ".")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_and_host_devices_become_the_compute_containers_resources() {
        let vm = json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "vm"},
            "spec": {"template": {
                "metadata": {
                    "labels": {"app": "a", "kubevirt.io": "forged"},
                    "annotations": {"cdi.k8s.io/x": "nvidia.com/gpu=all", "kubectl.kubernetes.io/last-applied-configuration": "{}"},
                },
                "spec": {"domain": {
                    "devices": {
                        "gpus": [{"name": "g1", "deviceName": "nvidia.com/GRID_T4-1Q"},
                                 {"name": "g2", "deviceName": "nvidia.com/GRID_T4-1Q"},
                                 {"name": "g3", "claimRequest": {"claimName": "c", "requestName": "r"}}],
                        "hostDevices": [{"name": "h", "deviceName": "nvidia.com/GA102_HIGH_DEFINITION_AUDIO_CONTROLLER"}],
                    },
                    "resources": {"limits": {"nvidia.com/gpu": 1}, "requests": {"memory": "1Gi"}},
                }, "resourceClaims": [{"name": "c", "resourceClaimName": "claim"}]},
            }},
        });
        let Rendered { pod, notes } = launcher_pod(&vm).unwrap();
        assert!(notes.is_empty());
        let c = &pod["spec"]["containers"][0];
        assert_eq!(c["resources"]["limits"]["nvidia.com/GRID_T4-1Q"], "2");
        assert_eq!(c["resources"]["requests"]["nvidia.com/GRID_T4-1Q"], "2");
        assert_eq!(
            c["resources"]["limits"]["nvidia.com/GA102_HIGH_DEFINITION_AUDIO_CONTROLLER"],
            "1"
        );
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], 1);
        assert_eq!(
            c["resources"]["claims"],
            json!([{"name": "c", "request": "r"}])
        );
        assert_eq!(pod["spec"]["resourceClaims"][0]["name"], "c");
        assert_eq!(pod["metadata"]["labels"]["kubevirt.io"], "virt-launcher");
        assert_eq!(pod["metadata"]["labels"]["app"], "a");
        let annotations = &pod["metadata"]["annotations"];
        assert_eq!(annotations["cdi.k8s.io/x"], "nvidia.com/gpu=all");
        assert!(
            annotations
                .get("kubectl.kubernetes.io/last-applied-configuration")
                .is_none()
        );
    }

    #[test]
    fn hook_sidecars_run_their_images_and_bad_shapes_are_named() {
        let vmi = json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "v", "annotations": {
                HOOK_SIDECARS: r#"[{"image": "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04", "args": ["--version", "v1alpha2"]}]"#,
            }},
            "spec": {"domain": {}},
        });
        let mut with_disk = vmi.clone();
        with_disk["spec"]["volumes"] = json!([{"name": "disk", "containerDisk": {"image": "quay.io/containerdisks/fedora:41"}}]);
        let pod = launcher_pod(&with_disk).unwrap().pod;
        assert_eq!(
            pod["spec"]["containers"][1]["image"],
            "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"
        );
        assert_eq!(pod["spec"]["containers"][2]["name"], "volumedisk");
        assert_eq!(
            pod["spec"]["containers"][2]["image"],
            "quay.io/containerdisks/fedora:41"
        );
        let pool = json!({"apiVersion": "pool.kubevirt.io/v1alpha1", "kind": "VirtualMachinePool", "spec": {}});
        let error = launcher_pod(&pool).unwrap_err();
        assert!(
            error.contains("spec.virtualMachineTemplate.spec.template"),
            "{error}"
        );
        let mut broken = vmi.clone();
        broken["metadata"]["annotations"][HOOK_SIDECARS] = json!("not json");
        assert_eq!(launcher_pod(&broken).unwrap().notes.len(), 1);
    }
}
