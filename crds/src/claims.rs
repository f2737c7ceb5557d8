//! DRA ResourceClaims (docs/design.md, "ResourceClaims"): which claims hand out GPUs, and the
//! ResourceClaimTemplates the `gpu.requestAs: ResourceClaim` rewrite points pods at. The
//! webhook names templates with [`template_name`]; the operator keeps exactly those.

use k8s_openapi::api::resource::v1::ResourceClaimSpec;

/// The NVIDIA DRA driver's DeviceClass of whole GPUs, and the default `gpu.deviceClassName`.
pub const DEVICE_CLASS_GPU: &str = "gpu.nvidia.com";
/// DeviceClasses of the NVIDIA DRA driver whose devices are GPUs (whole GPUs, MIG devices,
/// GPUs passed through with VFIO). Its ComputeDomain classes hand out IMEX channels, not GPUs.
pub const NVIDIA_GPU_DEVICE_CLASSES: [&str; 3] =
    [DEVICE_CLASS_GPU, "mig.nvidia.com", "vfio.gpu.nvidia.com"];
/// Prefix of the ResourceClaimTemplates gpuwarden keeps.
pub const TEMPLATE_PREFIX: &str = "gpuwarden-";
/// Label on every ResourceClaimTemplate the operator keeps: its watch and its clean-up select
/// on it, so templates of anyone else are never touched.
pub const LABEL_CLAIM_TEMPLATE: &str = "gpuwarden.io/claim-template";
/// Name of the one device request in a gpuwarden template.
pub const TEMPLATE_REQUEST: &str = "gpus";
/// Prefix of the pod `resourceClaims` entries the rewrite adds; an index follows.
pub const POD_CLAIM_PREFIX: &str = "gpuwarden-gpus-";

/// The ResourceClaimTemplate that asks for `count` devices of `class`:
/// `gpuwarden-<class>-<count>`, e.g. `gpuwarden-gpu.nvidia.com-2`.
pub fn template_name(class: &str, count: u32) -> String {
    format!("{TEMPLATE_PREFIX}{class}-{count}")
}

/// The device class and count a [`template_name`] names, or `None` for any other name.
pub fn template_parts(name: &str) -> Option<(&str, u32)> {
    let (class, count) = name.strip_prefix(TEMPLATE_PREFIX)?.rsplit_once('-')?;
    let count = count.parse().ok().filter(|n| *n > 0)?;
    (!class.is_empty()).then_some((class, count))
}

/// Whether claims of `class` hand out GPUs: one of the NVIDIA DRA driver's GPU classes, or
/// the governing policy's `gpu.deviceClassName`.
pub fn is_gpu_device_class(class: &str, policy_class: &str) -> bool {
    class == policy_class || NVIDIA_GPU_DEVICE_CLASSES.contains(&class)
}

/// The DeviceClasses a claim's requests name: each request's `exactly.deviceClassName`, and
/// every `firstAvailable` alternative's.
pub fn device_classes(spec: &ResourceClaimSpec) -> impl Iterator<Item = &str> {
    let requests = spec.devices.as_ref().and_then(|d| d.requests.as_ref());
    requests.into_iter().flatten().flat_map(|r| {
        let exact = r.exactly.iter().map(|e| e.device_class_name.as_str());
        let alternatives =
            (r.first_available.iter().flatten()).map(|s| s.device_class_name.as_str());
        exact.chain(alternatives)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{
        DeviceClaim, DeviceRequest, DeviceSubRequest, ExactDeviceRequest,
    };

    #[test]
    fn template_names_are_dns_subdomains_that_say_class_and_count() {
        assert_eq!(
            template_name("gpu.nvidia.com", 2),
            "gpuwarden-gpu.nvidia.com-2"
        );
        let longest = template_name(&"a".repeat(crate::policy::DEVICE_CLASS_LEN), 64);
        assert!(longest.len() <= 253, "{}", longest.len());
        for (class, count) in [("gpu.nvidia.com", 2), ("a-b.example.com", 64)] {
            assert_eq!(
                template_parts(&template_name(class, count)),
                Some((class, count))
            );
        }
        for other in [
            "gpuwarden-gpu.nvidia.com-0",
            "gpuwarden--1",
            "gpuwarden-x",
            "one-h100-1",
        ] {
            assert_eq!(template_parts(other), None, "{other}");
        }
    }

    #[test]
    fn every_request_and_alternative_names_its_class() {
        let spec = ResourceClaimSpec {
            devices: Some(DeviceClaim {
                requests: Some(vec![
                    DeviceRequest {
                        name: "a".into(),
                        exactly: Some(ExactDeviceRequest {
                            device_class_name: "nic.example.com".into(),
                            ..Default::default()
                        }),
                        ..Default::default()
                    },
                    DeviceRequest {
                        name: "b".into(),
                        first_available: Some(vec![DeviceSubRequest {
                            name: "big".into(),
                            device_class_name: "mig.nvidia.com".into(),
                            ..Default::default()
                        }]),
                        ..Default::default()
                    },
                ]),
                ..Default::default()
            }),
        };
        let classes: Vec<&str> = device_classes(&spec).collect();
        assert_eq!(classes, ["nic.example.com", "mig.nvidia.com"]);
        assert!(
            classes
                .iter()
                .any(|c| is_gpu_device_class(c, DEVICE_CLASS_GPU))
        );
        assert!(!is_gpu_device_class(
            "compute-domain-default-channel.nvidia.com",
            DEVICE_CLASS_GPU
        ));
        assert!(is_gpu_device_class("gpus.example.com", "gpus.example.com"));
        assert_eq!(device_classes(&ResourceClaimSpec::default()).count(), 0);
    }
}
