//! Reading the pod: what each container is (privileged, GPU, exempt by image) and which pod
//! volumes and annotations hand out devices, by the one GPU predicate in
//! [`gpuwarden_crds::gpu`]. Everything here borrows from the pod's view and the policy.

use gpuwarden_crds::GpuPolicy;
use gpuwarden_crds::claims;
use gpuwarden_crds::gpu::{self, ContainerSpec, PodSignals, Rules, Signals, VisibleDevices};
use gpuwarden_crds::{injection, kata};

use super::claims::{ClaimLookup, ClaimSource, Claims};
use super::input::ContainerRef;
use super::sharing;
use crate::pod::{Container, ContainerKind, Map, PodView, Scalar};

/// One container, as the engine sees it.
#[derive(Debug)]
pub(super) struct ContainerFacts<'a> {
    pub(super) at: ContainerRef,
    /// `name` (may be empty in a malformed pod).
    pub(super) name: &'a str,
    pub(super) value: &'a Container<'a>,
    pub(super) privileged: bool,
    /// An init container with `restartPolicy: Always`: it runs beside the others.
    pub(super) sidecar: bool,
    pub(super) image_exempt: bool,
    /// Why it is (or is not) a GPU container.
    pub(super) signals: Signals<'a>,
    /// A GPU resource requested but not limited: its name and quantity.
    pub(super) gpu_request: Option<(&'a str, &'a Scalar<'a>)>,
    pub(super) gpu: bool,
}

impl<'a> ContainerFacts<'a> {
    /// The names of its volume mounts, in order ("" for a mount without one).
    pub(super) fn mount_names(&self) -> impl Iterator<Item = &'a str> + use<'a> {
        self.mounts().map(|(name, _)| name)
    }

    /// Its volume mounts as (name, mountPath), in order ("" for what is missing).
    pub(super) fn mounts(&self) -> impl Iterator<Item = (&'a str, &'a str)> + use<'a> {
        let value: &'a Container<'a> = self.value;
        (value.volume_mounts.iter().flatten()).map(|m| {
            let name = m.name.as_deref().unwrap_or("");
            (name, m.mount_path.as_deref().unwrap_or(""))
        })
    }

    /// Whether it loses privilege (rules 1 and 2): privileged, and its image not exempt.
    pub(super) fn loses_privilege(&self) -> bool {
        self.privileged && !self.image_exempt
    }

    /// Whether the rewrite changes it (rules 3 to 5): it loses privilege, or it leaks and
    /// its image is not exempt.
    pub(super) fn changes(&self) -> bool {
        !self.image_exempt && (self.privileged || self.signals.leaks())
    }

    /// Whether the rewrite must change it: a privileged GPU container, or one that reaches
    /// GPUs around the kubelet (a leak), unless its image is exempt (or `images_count` is
    /// false: an invalid policy's image patterns do not).
    pub(super) fn offends(&self, images_count: bool) -> bool {
        (!self.image_exempt || !images_count)
            && ((self.privileged && self.signals.maybe_gpu()) || self.signals.leaks())
    }
}

/// A GPU quantity as a number of GPUs, when it is a whole number.
pub(super) fn whole(quantity: &Scalar<'_>) -> Option<u32> {
    match quantity {
        Scalar::Str(s) => s.trim().parse().ok(),
        Scalar::Other(v) => v.as_u64().and_then(|n| u32::try_from(n).ok()),
    }
}

/// The GPUs a container's own GPU limits say, when they are whole numbers.
pub(super) fn limited_gpus(c: &ContainerFacts<'_>, policy: &GpuPolicy) -> Option<u32> {
    let rules = Rules::of(policy);
    let limits = c.value.resources.as_ref()?.limits.as_ref()?;
    (limits.iter())
        .filter(|(name, _)| rules.is_gpu_resource(name))
        .map(|(_, q)| whole(q))
        .try_fold(0u32, |sum, n| Some(sum.saturating_add(n?)))
}

/// Pod-level facts.
#[derive(Debug)]
pub(super) struct PodFacts<'a> {
    /// Init, regular, then ephemeral containers, each list in its order.
    pub(super) containers: Vec<ContainerFacts<'a>>,
    /// Device volumes and CDI annotations.
    pub(super) pod: PodSignals<'a>,
    pub(super) annotations: Option<&'a Map<'a>>,
    /// The pod's `resourceClaims` entries whose claim could not be read: name, and why.
    pub(super) unread_claims: Vec<(&'a str, String)>,
    /// The pod's `resourceClaims` entries whose claim is known to hold no RDMA device.
    pub(super) claims_without_rdma: Vec<&'a str>,
    /// What the pod asks for that no rewrite can make safe, whatever its containers are
    /// (docs/design.md, "Claims only a driver's own pods may hold"): each a denial.
    pub(super) refusals: Vec<String>,
    /// The pod's device-injection annotations, judged against the GPUs it holds (those
    /// that reach only image-exempt containers left out).
    pub(super) injections: injection::Judgement,
}

/// Namespace or service-account exemption of the whole pod, with the reason.
pub(super) fn pod_exemption(
    pod: &PodView<'_>,
    namespace: &str,
    policy: &GpuPolicy,
) -> Option<String> {
    let sa = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.as_deref())
        .unwrap_or("");
    policy.spec.exemptions.pod_exemption(namespace, sa)
}

/// Reads every container of the pod (init, regular, ephemeral) in `namespace` under `policy`;
/// its ResourceClaims through `claims`.
pub(super) fn read_pod<'a>(
    pod: &'a PodView<'a>,
    namespace: &str,
    policy: &'a GpuPolicy,
    claims: &dyn Claims,
) -> PodFacts<'a> {
    let annotations = pod.annotations();
    let claims_read = read_claims(pod, namespace, policy, claims);
    let signals = pod_signals(pod, policy, claims_read.gpu);
    let containers = read_containers(pod, namespace, policy, &signals);
    let injections = judge_injections(annotations, &containers, policy);
    let mut refusals = claims_read.driver_only;
    refusals.extend(kata_refusals(annotations, &containers, policy));
    PodFacts {
        containers,
        pod: signals,
        annotations,
        unread_claims: claims_read.unread,
        claims_without_rdma: claims_read.without_rdma,
        refusals,
        injections,
    }
}

/// What the pod itself says of GPUs: its device volumes and CDI annotations, whether it
/// holds a passthrough GPU read inside a VM, where it asks to be placed, and its
/// `resourceClaims` entries that hold GPUs (`gpu_claims`).
fn pod_signals<'a>(
    pod: &'a PodView<'a>,
    policy: &GpuPolicy,
    gpu_claims: Vec<&'a str>,
) -> PodSignals<'a> {
    let spec = pod.spec.as_ref();
    let annotations = pod.annotations();
    PodSignals::read(
        pod.volumes().iter().filter_map(|v| {
            let path = v.host_path.as_ref().and_then(|h| h.path.as_deref());
            Some((v.name.as_deref()?, path))
        }),
        (annotations.into_iter().flatten()).map(|(k, v)| (k.as_ref(), v.as_str())),
        passthrough_in_vm(pod, policy),
    )
    .placed(
        spec.and_then(|s| s.runtime_class_name.as_deref()),
        (spec
            .and_then(|s| s.node_selector.as_ref())
            .into_iter()
            .flatten())
        .map(|(k, v)| (k.as_ref(), v.as_str())),
        (spec.and_then(|s| {
            s.affinity
                .as_ref()?
                .node_affinity
                .as_ref()?
                .required
                .as_ref()
        }))
        .into_iter()
        .flat_map(|r| r.node_selector_terms.iter().flatten())
        .flat_map(|t| t.match_expressions.iter().flatten())
        .map(|e| {
            (
                e.key.as_deref().unwrap_or(""),
                e.operator.as_deref().unwrap_or(""),
            )
        }),
        (spec
            .and_then(|s| s.tolerations.as_ref())
            .into_iter()
            .flatten())
        .filter_map(|t| t.key.as_deref()),
    )
    .claimed(gpu_claims)
}

/// Whether the pod holds a passthrough GPU that is read inside its VM: only where a VM
/// runtime class runs the pod (Kata). A KubeVirt launcher pod's containers run on the host:
/// what its author wrote (a CDI annotation, a variable) reaches the host's runtime like any
/// other pod's.
fn passthrough_in_vm(pod: &PodView<'_>, policy: &GpuPolicy) -> bool {
    let in_vm = (pod.spec.as_ref())
        .and_then(|s| s.runtime_class_name.as_deref())
        .is_some_and(|class| policy.spec.virtual_machines.is_vm_runtime_class(class));
    in_vm
        && [ContainerKind::Init, ContainerKind::Regular]
            .into_iter()
            .flat_map(|kind| pod.containers(kind))
            .any(gpu::holds_passthrough)
}

/// Every container of the pod, init, regular then ephemeral, each list in its order, as the
/// GPU predicate reads it beside the pod's `signals`.
fn read_containers<'a>(
    pod: &'a PodView<'a>,
    namespace: &str,
    policy: &'a GpuPolicy,
    signals: &PodSignals<'a>,
) -> Vec<ContainerFacts<'a>> {
    let rules = Rules::of(policy);
    let exemptions = &policy.spec.exemptions;
    let service_account = (pod.spec.as_ref())
        .and_then(|s| s.service_account_name.as_deref())
        .unwrap_or("");
    let kinds = [
        ContainerKind::Init,
        ContainerKind::Regular,
        ContainerKind::Ephemeral,
    ];
    let count = kinds.iter().map(|&k| pod.containers(k).len()).sum();
    let kai = (policy.spec.gpu.sharing.as_ref())
        .and_then(|s| s.kai.as_ref())
        .and_then(|kai| sharing::kai_fraction(pod, kai));
    let mut containers = Vec::with_capacity(count);
    for kind in kinds {
        for (index, value) in pod.containers(kind).iter().enumerate() {
            let at = ContainerRef { kind, index };
            let container_signals = container_signals(at, value, signals, rules, kai.as_ref());
            let gpu_request = container_signals.request.and_then(|name| {
                let requests = value.resources.as_ref()?.requests.as_ref()?;
                Some((name, requests.get(name)?))
            });
            containers.push(ContainerFacts {
                at,
                name: value.name.as_deref().unwrap_or(""),
                value,
                privileged: value.is_privileged(),
                sidecar: kind == ContainerKind::Init
                    && value.restart_policy.as_deref() == Some("Always"),
                image_exempt: exemptions
                    .container_exemption(
                        value.image.as_deref().unwrap_or(""),
                        namespace,
                        service_account,
                    )
                    .is_some(),
                gpu: container_signals.is_gpu(),
                signals: container_signals,
                gpu_request,
            });
        }
    }
    containers
}

/// The GPU signals of the container `at`. KAI's grant, in a container that holds no GPU of
/// the kubelet's, is no signal: the variable is read from a ConfigMap only KAI's binder
/// writes, so the predicate reads the container as setting none (docs/design.md,
/// "GPU-sharing schedulers").
fn container_signals<'a>(
    at: ContainerRef,
    value: &'a Container<'a>,
    pod: &PodSignals<'a>,
    rules: Rules<'a>,
    kai: Option<&sharing::KaiFraction>,
) -> Signals<'a> {
    let mut signals = gpu::signals(value, pod, rules);
    let shared = kai.is_some_and(|k| k.at == at && k.granted(value))
        && !signals.limit
        && signals.request.is_none()
        && signals.claim.is_none();
    if shared {
        signals.visible = VisibleDevices::Unset;
        signals.visible_raw = None;
    }
    signals
}

/// The pod's device-injection annotations against the GPUs its init and regular containers'
/// limits hold (docs/design.md, "Device-injection annotations"). One that reaches only
/// containers whose image is exempt is the exemption's.
fn judge_injections<'a>(
    annotations: Option<&'a Map<'a>>,
    containers: &[ContainerFacts<'a>],
    policy: &GpuPolicy,
) -> injection::Judgement {
    let mut all = injection::read_all(
        (annotations.into_iter().flatten()).map(|(k, v)| (k.as_ref(), v.as_str())),
    );
    if all.is_empty() {
        return injection::Judgement::default();
    }
    // One that reaches no container yet (a later ephemeral container's name) is judged
    // with the pod as a whole: unless every container is exempt.
    let judged = |i: &injection::Injection<'_>| {
        let mut reached = (containers.iter())
            .filter(|c| i.target.reaches(c.name))
            .peekable();
        match reached.peek() {
            Some(_) => reached.any(|c| !c.image_exempt),
            None => containers.iter().any(|c| !c.image_exempt),
        }
    };
    all.retain(judged);
    // A VM device hands `/dev/vfio` nodes, never an NVIDIA device node: it holds no GPU an
    // injection could name (docs/design.md, "GPUs handed to VMs").
    let vms = &policy.spec.virtual_machines;
    let held = (containers.iter())
        .filter(|c| c.at.kind != ContainerKind::Ephemeral)
        .filter(|c| !(c.value.limit_names()).any(|r| vms.is_device(r)))
        .filter_map(|c| limited_gpus(c, policy))
        .fold(0u32, u32::saturating_add);
    injection::judge(&all, held, &policy.spec.runtime_features)
}

/// What Kata Containers would hand the pod's containers beyond their own devices
/// (docs/design.md, "Kata Containers"): its annotations that change the devices, and
/// `VISIBLE_CDI_DEVICES` in a container that holds no GPU. A container whose image is exempt
/// keeps its variable; the annotations are the pod's, judged unless every container is exempt.
fn kata_refusals(
    annotations: Option<&Map<'_>>,
    containers: &[ContainerFacts<'_>],
    policy: &GpuPolicy,
) -> Vec<String> {
    let every_exempt = !containers.is_empty() && containers.iter().all(|c| c.image_exempt);
    let mut out: Vec<String> = (annotations.into_iter().flatten())
        .filter(|_| !every_exempt)
        .filter_map(|(k, v)| kata::judge(k.as_ref(), v.as_str()?))
        .collect();
    let resource = policy.spec.gpu.resource_name.as_str();
    for c in containers.iter().filter(|c| !c.image_exempt) {
        let value = c.value;
        let sets = (value.env_entries()).any(|e| e.name == kata::ENV_VISIBLE_CDI_DEVICES);
        let resources = value.limit_names().chain(value.request_names());
        let claims = value.claim_names().next().is_some();
        if sets && !kata::holds_gpu_of_its_own(resources, claims, resource) {
            out.push(kata::visible_cdi_reason(&format!(
                "{} {}",
                c.at.kind.noun(),
                c.name
            )));
        }
    }
    out
}

/// The pod's `resourceClaims` entries, read.
struct ClaimsRead<'a> {
    /// Those whose ResourceClaim or ResourceClaimTemplate requests devices of a GPU
    /// DeviceClass.
    gpu: Vec<&'a str>,
    /// Those that could not be read, and why: not counted, the container's other signals
    /// still judge it, and the rewrite says so.
    unread: Vec<(&'a str, String)>,
    /// Those known to hold no RDMA device ([`gpuwarden_crds::claims::ClaimDevices::may_hold_rdma`]).
    without_rdma: Vec<&'a str>,
    /// Why the pod may not use those only a driver's own pods may hold.
    driver_only: Vec<String>,
}

fn read_claims<'a>(
    pod: &'a PodView<'a>,
    namespace: &str,
    policy: &GpuPolicy,
    claims: &dyn Claims,
) -> ClaimsRead<'a> {
    let class = policy.spec.gpu.device_class_name.as_str();
    let rules = &policy.spec.driver_claims;
    let drivers_own = rules.namespaces.iter().any(|n| n == namespace);
    let mut read = ClaimsRead {
        gpu: Vec::new(),
        unread: Vec::new(),
        without_rdma: Vec::new(),
        driver_only: Vec::new(),
    };
    for entry in pod.resource_claims() {
        let Some(name) = entry.name.as_deref() else {
            continue;
        };
        let (source, target) = match (
            entry.resource_claim_name.as_deref(),
            entry.resource_claim_template_name.as_deref(),
        ) {
            (Some(claim), _) => (ClaimSource::Claim, claim),
            (None, Some(template)) => (ClaimSource::Template, template),
            (None, None) => continue,
        };
        let kind = source.kind();
        let why = match claims.lookup(source, namespace, target) {
            ClaimLookup::Found(devices) => {
                if (devices.classes.iter()).any(|c| claims::is_gpu_device_class(c, class)) {
                    read.gpu.push(name);
                }
                if !devices.may_hold_rdma(class) {
                    read.without_rdma.push(name);
                }
                let driver_only = devices.driver_only(rules);
                if !drivers_own && !driver_only.is_empty() {
                    read.driver_only.push(format!(
                        "resourceClaims entry {name} uses {kind} {namespace}/{target}: {}. Outside the driver's namespaces ({}) use the ComputeDomain's channel claim ({}) for IMEX channels, or a GPU claim",
                        claims::driver_only_reason(&driver_only),
                        rules.namespaces.join(", "),
                        claims::DEVICE_CLASS_CD_CHANNEL,
                    ));
                }
                continue;
            }
            ClaimLookup::Missing => "does not exist".to_owned(),
            ClaimLookup::Unknown(why) => format!("cannot be read: {why}"),
        };
        read.unread
            .push((name, format!("{kind} {namespace}/{target} {why}")));
    }
    read
}
