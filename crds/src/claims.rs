//! DRA ResourceClaims (docs/design.md, "ResourceClaims"): which claims hand out GPUs, and the
//! ResourceClaimTemplates the `gpu.requestAs: ResourceClaim` rewrite points pods at. The
//! webhook names templates with [`template_name`]; the operator keeps exactly those. And the
//! claims only a driver's own pods may hold: a policy's [`DriverClaims`], and what of a claim
//! they name ([`ClaimDevices::driver_only`]).

use k8s_openapi::api::resource::v1::ResourceClaimSpec;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use crate::bounds::{DNS_LABEL_LEN, DNS_SUBDOMAIN_LEN};

/// The NVIDIA DRA driver's DeviceClass of whole GPUs, and the default `gpu.deviceClassName`.
pub const DEVICE_CLASS_GPU: &str = "gpu.nvidia.com";
/// DeviceClasses of the NVIDIA DRA driver whose devices are GPUs (whole GPUs, MIG devices,
/// GPUs passed through with VFIO). Its ComputeDomain classes hand out IMEX channels, not GPUs.
pub const NVIDIA_GPU_DEVICE_CLASSES: [&str; 3] =
    [DEVICE_CLASS_GPU, "mig.nvidia.com", "vfio.gpu.nvidia.com"];
/// The DeviceClass of the NVIDIA DRA driver's ComputeDomain daemon devices. The driver's
/// controller starts the IMEX daemon pods with claims on it, in the driver's namespace;
/// preparing such a claim hands the container every GPU, `nvidiactl`, `nvidia-uvm*` and IMEX
/// channel of the node (the CDI device `k8s.compute-domain.nvidia.com/device=all`), and
/// checks no namespace (`applyComputeDomainDaemonConfig`, v25.3 to v25.12).
pub const DEVICE_CLASS_CD_DAEMON: &str = "compute-domain-daemon.nvidia.com";
/// The DeviceClass of the NVIDIA DRA driver's IMEX channels, which the ComputeDomain
/// controller's ResourceClaimTemplates in a workload's namespace name.
pub const DEVICE_CLASS_CD_CHANNEL: &str = "compute-domain-default-channel.nvidia.com";
/// The opaque driver config the ComputeDomain daemon's claims carry (`resource.nvidia.com`).
pub const CONFIG_KIND_CD_DAEMON: &str = "ComputeDomainDaemonConfig";
/// DeviceClasses of drivers known to hand out no RDMA device: the NVIDIA DRA driver's GPU and
/// ComputeDomain classes. A claim on any other class may hold NICs.
const CLASSES_WITHOUT_RDMA: [&str; 5] = [
    DEVICE_CLASS_GPU,
    "mig.nvidia.com",
    "vfio.gpu.nvidia.com",
    DEVICE_CLASS_CD_DAEMON,
    DEVICE_CLASS_CD_CHANNEL,
];

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

/// Longest device class name: a ResourceClaimTemplate name `gpuwarden-<class>-<count>` must
/// stay a DNS subdomain (253).
pub const DEVICE_CLASS_LEN: usize = 240;

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

/// The kinds of the opaque driver configs a claim carries
/// (`spec.devices.config[].opaque.parameters.kind`).
pub fn config_kinds(spec: &ResourceClaimSpec) -> impl Iterator<Item = &str> {
    let configs = spec.devices.as_ref().and_then(|d| d.config.as_ref());
    (configs.into_iter().flatten())
        .filter_map(|c| c.opaque.as_ref()?.parameters.0.get("kind")?.as_str())
}

/// Whether a claim on `class` may hold RDMA devices: any class but those known to hand out
/// none (the NVIDIA DRA driver's GPU and ComputeDomain classes, and the policy's own GPU
/// class `policy_class`).
pub fn may_hold_rdma(class: &str, policy_class: &str) -> bool {
    class != policy_class && !CLASSES_WITHOUT_RDMA.contains(&class)
}

/// See [`crate::GpuPolicySpec::driver_claims`].
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DriverClaims {
    /// DeviceClasses whose devices a driver hands only to its own pods. The default is the
    /// NVIDIA DRA driver's `compute-domain-daemon.nvidia.com`: preparing a claim on it hands
    /// the container every GPU and IMEX channel of the node, checking no namespace.
    #[serde(default = "default_driver_classes")]
    #[x_kube(validation = Rule::new(DNS_SUBDOMAINS_RULE).message("deviceClasses are DNS subdomains such as compute-domain-daemon.nvidia.com"))]
    #[schemars(length(max = 32), inner(length(max = DNS_SUBDOMAIN_LEN)))]
    pub device_classes: Vec<String>,

    /// Kinds of opaque driver config (`spec.devices.config[].opaque.parameters.kind`) meant
    /// only for a driver's own pods, whatever class the claim names. The default is the
    /// NVIDIA DRA driver's `ComputeDomainDaemonConfig`.
    #[serde(default = "default_driver_config_kinds")]
    #[schemars(length(max = 32), inner(length(min = 1, max = DNS_LABEL_LEN)))]
    pub config_kinds: Vec<String>,

    /// The namespaces the drivers' own pods run in, where such claims are theirs. The
    /// default is the namespaces of NVIDIA's official installs.
    #[serde(default = "default_driver_namespaces")]
    #[schemars(length(max = 64), inner(length(max = DNS_LABEL_LEN)))]
    pub namespaces: Vec<String>,
}

impl Default for DriverClaims {
    fn default() -> Self {
        Self {
            device_classes: default_driver_classes(),
            config_kinds: default_driver_config_kinds(),
            namespaces: default_driver_namespaces(),
        }
    }
}

fn default_driver_classes() -> Vec<String> {
    vec![DEVICE_CLASS_CD_DAEMON.to_owned()]
}
fn default_driver_config_kinds() -> Vec<String> {
    vec![CONFIG_KIND_CD_DAEMON.to_owned()]
}
fn default_driver_namespaces() -> Vec<String> {
    crate::NVIDIA_COMPONENT_NAMESPACES
        .map(String::from)
        .to_vec()
}

/// CEL: every item of a list is a DNS subdomain.
const DNS_SUBDOMAINS_RULE: &str = "self.all(c, c.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$'))";

/// What a claim's devices are, as far as admission judges them: the DeviceClasses its
/// requests name and the kinds of its opaque driver configs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimDevices {
    /// [`device_classes`], in order.
    pub classes: Vec<String>,
    /// [`config_kinds`], in order.
    pub config_kinds: Vec<String>,
}

impl ClaimDevices {
    /// Reads a claim's spec (a ResourceClaim's, or a ResourceClaimTemplate's `spec.spec`).
    pub fn of(spec: &ResourceClaimSpec) -> Self {
        Self {
            classes: device_classes(spec).map(str::to_owned).collect(),
            config_kinds: config_kinds(spec).map(str::to_owned).collect(),
        }
    }

    /// What of it only a driver's own pods may hold under `rules`, for messages: each listed
    /// class as `DeviceClass <name>`, each listed config kind as `opaque config <kind>`, once
    /// each, in the claim's order.
    pub fn driver_only(&self, rules: &DriverClaims) -> Vec<String> {
        let classes = (self.classes.iter())
            .filter(|c| rules.device_classes.contains(c))
            .map(|c| format!("DeviceClass {c}"));
        let kinds = (self.config_kinds.iter())
            .filter(|k| rules.config_kinds.contains(k))
            .map(|k| format!("opaque config {k}"));
        let mut out: Vec<String> = Vec::new();
        for item in classes.chain(kinds) {
            if !out.contains(&item) {
                out.push(item);
            }
        }
        out
    }

    /// Whether it may hold RDMA devices ([`may_hold_rdma`]): a class that may, or no class
    /// at all (nothing says what it holds).
    pub fn may_hold_rdma(&self, policy_class: &str) -> bool {
        self.classes.is_empty() || (self.classes.iter()).any(|c| may_hold_rdma(c, policy_class))
    }
}

/// What follows the things a claim names that only a driver's own pods may hold, in every
/// refusal of it: the engine's, `mutate`'s and the API server's
/// (`deploy/admission/driver-claims.yaml`).
pub const DRIVER_ONLY_REASON: &str = "meant only for a DRA driver's own pods: the driver prepares such a claim in any namespace, and the NVIDIA DRA driver's ComputeDomain daemon device hands its container every GPU and IMEX channel of the node, whatever the scheduler allocated (GpuPolicy driverClaims)";

/// Why a claim is refused: what of it is a driver's only ([`ClaimDevices::driver_only`]),
/// then [`DRIVER_ONLY_REASON`].
pub fn driver_only_reason(what: &[String]) -> String {
    let verb = if what.len() == 1 { "is" } else { "are" };
    format!("{} {verb} {DRIVER_ONLY_REASON}", what.join(", "))
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
        let longest = template_name(&"a".repeat(DEVICE_CLASS_LEN), 64);
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
