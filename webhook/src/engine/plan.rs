//! Planning the rewrite of a pod (docs/design.md, "Rewrite rules"): per container what changes,
//! as plain data borrowed from the pod and the policy. The patch, the warnings, the audit
//! summary and the `gpuwarden.io/rewritten` report are all written from the plan.

use std::borrow::Cow;
use std::fmt;

use gpuwarden_crds::claims::{POD_CLAIM_PREFIX, template_name};
use gpuwarden_crds::{ANNOTATION_GPU_COUNT, EnvFromGpu, GpuPolicy, RequestAs};

use gpuwarden_crds::exemptions::glob_match;
use gpuwarden_crds::gpu::{
    self, ContainerSpec as _, CountFrom, ENV_DRIVER_CAPABILITIES, ENV_VISIBLE_DEVICES, HostDevice,
    PodSignals, VisibleDevices,
};
use gpuwarden_crds::pod_security::RUNTIME_DEFAULT_CAPABILITIES;
use gpuwarden_crds::rdma;

use super::claims::{ClaimLookup, ClaimSource};
use super::facts::{ContainerFacts, PodFacts, limited_gpus, whole};
use super::input::{ContainerRef, Input};
use super::psa::{self, PsaLevel};
use crate::pod::{Container, ContainerKind, Scalar};

/// The plan for one pod.
#[derive(Debug)]
pub(super) struct Plan<'a> {
    /// The containers the rewrite touches, in the pod's order.
    pub(super) containers: Vec<ContainerPlan<'a>>,
    /// Indices of the `spec.volumes` entries removed, ascending.
    pub(super) volumes: Indices,
    /// Names of the device volumes removed, sorted.
    pub(super) volumes_removed: Names<'a>,
    /// Pod annotations removed (`cdi.k8s.io/*`), sorted.
    pub(super) annotations_removed: Vec<&'a str>,
    /// Why Enforce cannot rewrite the pod as it is.
    pub(super) denials: Vec<String>,
    /// The policy's driver capabilities as `NVIDIA_DRIVER_CAPABILITIES` reads them.
    pub(super) driver_capabilities: String,
    /// The pod's device hostPath volumes, for the paths the messages name.
    pub(super) device_volumes: PodSignals<'a>,
    /// The Pod Security level the namespace enforces.
    pub(super) psa: PsaLevel,
    /// What the rewritten pod would still fail at that level.
    pub(super) psa_left: Vec<String>,
    /// `gpu.requestAs: ResourceClaim`: the pod `resourceClaims` entries added, in order.
    pub(super) claims: Vec<NewClaim>,
    /// What the rewrite leaves to the cluster that the pod's author should know: RDMA use
    /// that must now come from a pod network.
    pub(super) notes: Vec<String>,
    /// What the containers keep and lose of what their start-up steps need, once rewritten:
    /// one phrase per step (docs/design.md, "What a rewritten container keeps"), written by
    /// `start_up::phrases`.
    pub(super) start_up: Vec<String>,
}

/// A pod `resourceClaims` entry the rewrite adds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewClaim {
    /// The entry's name, unused in the pod: `gpuwarden-gpus-<n>`.
    pub name: String,
    /// gpuwarden's ResourceClaimTemplate it is made from.
    pub template: String,
    /// The GPUs it asks for.
    pub count: u32,
}

/// A container's use of a claim the rewrite adds.
#[derive(Debug)]
pub(super) struct ClaimUse<'a> {
    /// Index in [`Plan::claims`].
    pub(super) index: usize,
    /// Where the count came from.
    pub(super) from: CountFrom<'a>,
    /// The container that holds the claim, when this one shares it.
    pub(super) shared_with: Option<&'a str>,
}

/// What the rewrite does to one container.
#[derive(Debug)]
pub(super) struct ContainerPlan<'a> {
    pub(super) at: ContainerRef,
    pub(super) name: &'a str,
    /// Rules 1 and 2 applied; otherwise the container only loses device mounts.
    pub(super) deprivileged: bool,
    /// Whether it is a GPU container (false: a privileged sidecar de-privileged with it).
    pub(super) gpu: bool,
    /// `capabilities.add` after the rewrite.
    pub(super) caps_added: Vec<Cow<'a, str>>,
    /// Whether `capabilities.drop` becomes `[ALL]` and `allowPrivilegeEscalation` false:
    /// the policy's `dropAll`, or Pod Security `restricted`.
    pub(super) drop_all: bool,
    /// Capabilities it asked for that the policy does not allow, sorted, each once.
    pub(super) caps_refused: Vec<Cow<'a, str>>,
    /// Rule 3: the GPU limit added.
    pub(super) limit: Option<Limit<'a>>,
    /// Rule 3 with `gpu.requestAs: ResourceClaim`: the claim it uses instead of a limit.
    pub(super) claim: Option<ClaimUse<'a>>,
    /// The pod `resourceClaims` entry of a GPU claim it already uses: its GPUs, kept.
    pub(super) own_claim: Option<&'a str>,
    /// Claims it uses that could not be read, when the rewrite gives it GPUs: they may hold
    /// GPUs on top of those (entry name, and why).
    pub(super) unread_claims: Vec<(&'a str, String)>,
    /// Rule 4: how its `env` changes.
    pub(super) env: Option<EnvEdit<'a>>,
    /// Rule 5: indices of the `volumeMounts` entries removed, ascending.
    pub(super) mounts: Indices,
    /// Names of the device volumes whose mounts are removed, each once, in order.
    pub(super) mounts_removed: Names<'a>,
    /// Paths of the device-list mounts removed, in order.
    pub(super) device_list_removed: Names<'a>,
    /// Why a container with a GPU signal ends with no GPU (and `NVIDIA_VISIBLE_DEVICES=void`).
    pub(super) no_gpu: Option<String>,
    /// What its `envFrom` means after the rewrite.
    pub(super) env_from: Option<&'static str>,
    /// Capabilities the policy would add that the namespace's Pod Security level forbids.
    pub(super) caps_withheld: Vec<Cow<'a, str>>,
    /// Whether `seccompProfile: RuntimeDefault` is set (Pod Security `restricted`).
    pub(super) seccomp_default: bool,
}

/// A GPU limit the rewrite adds.
#[derive(Debug)]
pub(super) struct Limit<'a> {
    /// The extended resource, e.g. `nvidia.com/gpu`.
    pub(super) resource: &'a str,
    pub(super) quantity: Quantity<'a>,
    pub(super) from: CountFrom<'a>,
}

impl<'a> Limit<'a> {
    /// `n` GPUs of `resource`, counted from `from`.
    fn count(resource: &'a str, n: u32, from: CountFrom<'a>) -> Self {
        Self {
            resource,
            quantity: Quantity::Count(n),
            from,
        }
    }
}

/// A limit's quantity: a count the engine worked out, or a request's quantity copied.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Quantity<'a> {
    /// A number of GPUs.
    Count(u32),
    /// A quantity as the pod wrote it: a string as it is, anything else as JSON.
    Copied(&'a Scalar<'a>),
}

impl Quantity<'_> {
    /// Calls `f` with the quantity as a limit holds it: a count in decimal, a string as it
    /// is, any other JSON value as JSON.
    pub fn with_text<R>(&self, f: impl FnOnce(&str) -> R) -> R {
        match self {
            Self::Count(n) => f(&n.to_string()),
            Self::Copied(Scalar::Str(s)) => f(s),
            Self::Copied(Scalar::Other(v)) => f(&v.to_string()),
        }
    }
}

impl fmt::Display for Quantity<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.with_text(|text| f.write_str(text))
    }
}

/// How a container's `env` changes.
#[derive(Debug)]
pub(super) struct EnvEdit<'a> {
    /// Indices of entries to remove, ascending.
    pub(super) remove: Indices,
    /// Whether the pair that is set is appended (it was missing, different or repeated).
    pub(super) append: bool,
    /// Names removed, each once, in the order first seen.
    pub(super) removed: Vec<&'static str>,
    /// The pair the container ends up with, when it was not already so.
    pub(super) set: Option<(&'static str, EnvValue<'a>)>,
}

/// The value the rewrite gives an environment variable.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum EnvValue<'a> {
    /// The policy's driver capabilities, comma-separated ([`Plan::driver_capabilities`]).
    DriverCapabilities,
    /// A fixed value.
    Fixed(&'a str),
}

/// Indices of list entries, ascending.
pub(super) type Indices = Vec<usize>;

/// Names (of volumes), in the order the messages give them.
pub(super) type Names<'a> = Vec<&'a str>;

/// A capability name as the runtime reads it: trimmed, upper case, without `CAP_`. Borrowed
/// when it already is.
pub(super) fn normalise_cap(cap: &str) -> Cow<'_, str> {
    let cap = cap.trim();
    if cap.bytes().any(|b| b.is_ascii_lowercase()) {
        let mut upper = cap.to_ascii_uppercase();
        if upper.starts_with("CAP_") {
            upper.drain(.."CAP_".len());
        }
        return Cow::Owned(upper);
    }
    Cow::Borrowed(cap.strip_prefix("CAP_").unwrap_or(cap))
}

/// Device volumes that go: those no exempt container mounts (none when the policy keeps
/// device hostPaths). Sorted.
pub(super) fn volumes_to_strip<'a>(facts: &PodFacts<'a>, policy: &GpuPolicy) -> Names<'a> {
    if !policy.spec.strip_device_host_paths {
        return Names::default();
    }
    facts
        .pod
        .device_volume_names()
        .filter(|name| {
            !facts
                .containers
                .iter()
                .any(|c| c.image_exempt && c.mount_names().any(|m| m == *name))
        })
        .collect()
}

/// Plans the rewrite of every container, and of the pod's device volumes and CDI
/// annotations. `strip` are the device volumes that go ([`volumes_to_strip`]).
pub(super) fn plan_pod<'a>(
    input: &Input<'a>,
    facts: &PodFacts<'a>,
    policy: &'a GpuPolicy,
    strip: Names<'a>,
    psa: PsaLevel,
) -> Plan<'a> {
    let pod = input.pod;
    let spec = &policy.spec;
    let mut plan = Plan {
        containers: Vec::with_capacity(facts.containers.len()),
        volumes: Indices::default(),
        volumes_removed: Names::default(),
        annotations_removed: Vec::new(),
        denials: Vec::new(),
        driver_capabilities: spec.driver_capabilities.join(","),
        device_volumes: PodSignals::default(),
        psa,
        psa_left: Vec::new(),
        claims: Vec::new(),
        notes: Vec::new(),
        start_up: Vec::new(),
    };
    // Device-injection annotations that name NVIDIA devices the pod does not hold: the
    // rewrite cannot make them safe, since the node plugin hands the devices over whatever
    // the container's privilege or limits.
    plan.denials
        .extend(facts.injections.uncovered.iter().map(|u| u.message.clone()));
    // Claims only a driver's own pods may hold, and the like: no rewrite makes them safe.
    plan.denials.extend(facts.refusals.iter().cloned());
    // What Pod Security Admission would still refuse once the rewrite is done.
    plan.psa_left = psa::still_fails(
        psa,
        pod,
        facts,
        |i| (facts.containers.get(i)).is_some_and(ContainerFacts::loses_privilege),
        |name| !strip.contains(&name),
    );
    let mut counts = gpu_counts(facts, policy, &mut plan.denials).into_iter();
    // Per container (by its index in `facts`), the claim it holds and where its count came
    // from, for those that share it.
    let mut held: Vec<Option<(usize, CountFrom<'a>)>> = vec![None; facts.containers.len()];
    let taken: Vec<&str> = (pod.resource_claims().iter())
        .filter_map(|c| c.name.as_deref())
        .collect();
    let host_paths: Vec<(&str, &str)> = (pod.volumes().iter())
        .filter_map(|v| {
            let path = v.host_path.as_ref()?.path.as_deref()?;
            Some((v.name.as_deref()?, path))
        })
        .collect();
    let daemon_set = input.daemon_set();
    // Rule 4: what a container loses of its own variables (docs/design.md, "Runtime
    // variables"): with its GPUs from the runtime, NVIDIA_VISIBLE_DEVICES too.
    let rules = gpu::Rules::of(policy);
    let (device_variables, with_visible) = (rules.device_variables(), rules.judged_variables());
    for (i, c) in facts.containers.iter().enumerate() {
        let count = counts.next();
        let target = c.loses_privilege();
        // A container that leaks without privilege keeps its security context and loses
        // the leak (rules 3 to 5).
        let changed = c.changes();
        let mut p = ContainerPlan {
            at: c.at,
            name: c.name,
            deprivileged: target,
            gpu: c.gpu,
            caps_added: Vec::new(),
            drop_all: false,
            caps_refused: Vec::new(),
            limit: None,
            claim: None,
            own_claim: None,
            unread_claims: Vec::new(),
            env: None,
            mounts: Indices::default(),
            mounts_removed: Names::default(),
            device_list_removed: Names::default(),
            no_gpu: None,
            env_from: None,
            caps_withheld: Vec::new(),
            seccomp_default: false,
        };
        if target {
            if let Some(denial) = host_device_denial(c, &host_paths, input, policy) {
                plan.denials.push(denial);
            } else if let Some(rdma) =
                rdma_left_behind(c, &facts.claims_without_rdma, &host_paths, input, policy)
            {
                match rdma {
                    RdmaUse::Lost(denial) => plan.denials.push(denial),
                    RdmaUse::FromNetwork(note) => plan.notes.push(note),
                }
            }
            capabilities(&mut p, c.value, policy, psa);
            let pod_seccomp = (pod.spec.as_ref())
                .and_then(|s| s.security_context.as_ref())
                .is_some_and(|s| s.seccomp_profile);
            let own_seccomp =
                (c.value.security_context.as_ref()).is_some_and(|s| s.seccomp_profile);
            p.seccomp_default = psa == PsaLevel::Restricted && !pod_seccomp && !own_seccomp;
        }
        if changed {
            p.own_claim = c.signals.claim;
            // Rule 3.
            let gpu = match count {
                Some(Count::Limit(limit)) => {
                    if let Some(name) = daemon_set.filter(|_| !limit.from.asked_by_pod()) {
                        plan.denials
                            .push(daemon_set_denial(c, &limit, name, input, policy));
                    }
                    match claim_count(&limit, spec.gpu.request_as) {
                        Some(n) => {
                            let index = add_claim(&mut plan, &taken, input, policy, n);
                            held[i] = Some((index, limit.from));
                            p.claim = Some(ClaimUse {
                                index,
                                from: limit.from,
                                shared_with: None,
                            });
                        }
                        None => p.limit = Some(limit),
                    }
                    true
                }
                Some(Count::Share(first)) => {
                    // The holder always has its claim: a count it was denied never shares.
                    if let Some((index, from)) = held[first] {
                        p.claim = Some(ClaimUse {
                            index,
                            from,
                            shared_with: Some(facts.containers[first].name),
                        });
                    }
                    true
                }
                Some(Count::Zero(why)) => {
                    p.gpu = false;
                    p.no_gpu = Some(why);
                    false
                }
                _ => c.gpu,
            };
            if p.limit.is_some() || p.claim.is_some() {
                p.unread_claims = (facts.unread_claims.iter())
                    .filter(|(name, _)| c.value.claim_names().any(|n| n == *name))
                    .map(|(name, why)| (*name, why.clone()))
                    .collect();
            }
            // Only a GPU resource limit has the runtime read the container's GPUs from
            // NVIDIA_VISIBLE_DEVICES (the device plugin sets it). One whose GPUs come from a
            // claim gets them through the DRA driver's CDI edits, which set the variable to
            // `void` themselves: the void rule holds for it as for a container without GPUs.
            let through_runtime =
                gpu && (c.signals.limit || c.signals.request.is_some() || p.limit.is_some());
            // `envFrom` may set NVIDIA_VISIBLE_DEVICES unseen. An `env` entry overrides it,
            // so a container that gets `void` is safe; a container whose GPUs the runtime
            // reads from the variable cannot be given one (it would override the allocation).
            // A prefix that could spell a runtime variable with a key of what envFrom reads
            // is the same door, whatever the ConfigMap guard refuses of keys.
            if c.signals.env_from {
                let spells = c.signals.env_from_spells;
                if !through_runtime {
                    p.env_from = Some("the void overrides whatever envFrom sets");
                } else if let Some((prefix, variable)) = spells {
                    plan.denials.push(format!(
                        "{} {}: envFrom prefix {prefix} spells {variable} with a key {}, which would hand the container devices beyond the GPUs the kubelet allocates; use a prefix that starts no NVIDIA runtime variable",
                        c.at.kind.noun(),
                        c.name,
                        &variable[prefix.len()..],
                    ));
                } else if spec.gpu.env_from == EnvFromGpu::Warn {
                    // The runtime's setting that ignores NVIDIA_VISIBLE_DEVICES in
                    // unprivileged containers leaves the other variables in force: Warn
                    // covers that one variable only.
                    p.env_from = Some(
                        "envFrom may still set NVIDIA_VISIBLE_DEVICES over the allocated GPUs (gpu.envFrom: Warn)",
                    );
                } else {
                    plan.denials.push(format!(
                        "{} {}: envFrom may set NVIDIA_VISIBLE_DEVICES, which would override the GPUs the kubelet allocates; list the variables it needs under env instead, or set gpu.envFrom: Warn where nodes ignore the variable in unprivileged containers",
                        c.at.kind.noun(),
                        c.name
                    ));
                }
            }
            // Rule 4.
            let (remove, set): (&[&'static str], _) = if through_runtime {
                (
                    &with_visible,
                    (ENV_DRIVER_CAPABILITIES, EnvValue::DriverCapabilities),
                )
            } else {
                (
                    &device_variables,
                    (ENV_VISIBLE_DEVICES, EnvValue::Fixed("void")),
                )
            };
            let set = if through_runtime && spec.driver_capabilities.is_empty() {
                None
            } else {
                Some(set)
            };
            // In a pod that holds a passthrough GPU the variables are read inside its VM,
            // among the GPUs passed through (Kata needs `NVIDIA_VISIBLE_DEVICES=all` there):
            // a GPU container keeps its environment.
            if !(gpu && c.signals.passthrough) {
                p.env = rewrite_env(c.value, remove, set, &plan.driver_capabilities);
            }
        }

        // Rule 5: mounts of removed device volumes go from every container that is not
        // exempt; a rewritten container also loses its mounts of device volumes that stay
        // because an exempt container still mounts them.
        let strips = |name: &str| {
            strip.contains(&name)
                || (target
                    && spec.strip_device_host_paths
                    && facts.pod.device_volume(name).is_some())
        };
        if !c.image_exempt && c.signals.device_mount && c.mount_names().any(strips) {
            for (i, name) in c.mount_names().enumerate() {
                if strips(name) {
                    p.mounts.push(i);
                    push_new(&mut p.mounts_removed, name);
                }
            }
        }
        // Mounts the toolkit would read as a device list go from every container that is
        // changed.
        if changed && c.signals.device_list != VisibleDevices::Unset {
            for (i, (_, path)) in c.mounts().enumerate() {
                if gpu::device_list_entry(path).is_some() && !p.mounts.contains(&i) {
                    p.mounts.push(i);
                    p.device_list_removed.push(path);
                }
            }
            p.mounts.sort_unstable();
        }
        if changed || !p.mounts.is_empty() {
            plan.containers.push(p);
        }
    }

    // Pod-level rule 5.
    if !strip.is_empty() {
        plan.volumes = pod
            .volumes()
            .iter()
            .enumerate()
            .filter(|(_, v)| v.name.as_deref().is_some_and(|n| strip.contains(&n)))
            .map(|(i, _)| i)
            .collect();
        if !plan.volumes.is_empty() {
            plan.volumes_removed = strip;
        }
    }
    if spec.strip_cdi_annotations {
        plan.annotations_removed = facts.pod.cdi_keys().to_vec();
    }
    plan.device_volumes = facts.pod.clone();
    plan
}

/// How to exempt a container in messages that point to an exemption.
fn exemption_hint(c: &ContainerFacts<'_>, input: &Input<'_>, policy: &GpuPolicy) -> String {
    format!(
        "exempt it in GpuPolicy {}: exemptions.containers with images [{}] and namespaces [{}]",
        policy.metadata.name.as_deref().unwrap_or(""),
        c.value.image.as_deref().unwrap_or(""),
        input.namespace,
    )
}

/// Do no harm (docs/design.md): a pod that a DaemonSet runs on every node would be given
/// GPUs it never asked for (the policy's default, for a hint, a device mount or `all`), which
/// would take a GPU on every node or keep the pods Pending. It is denied, naming the way out.
fn daemon_set_denial(
    c: &ContainerFacts<'_>,
    limit: &Limit<'_>,
    name: &str,
    input: &Input<'_>,
    policy: &GpuPolicy,
) -> String {
    format!(
        "{} {} would be given {} GPU(s) it did not ask for ({}), and DaemonSet {name} runs it on every node: that would take a GPU on each. If it is a node agent that needs the node's GPUs, {}; if it should hold GPUs, ask for them (limits {} or annotation {ANNOTATION_GPU_COUNT})",
        c.at.kind.noun(),
        c.name,
        limit.quantity,
        limit.from,
        exemption_hint(c, input, policy),
        policy.spec.gpu.resource_name,
    )
}

/// Do no harm (docs/design.md): a container that loses privilege but mounts host devices an
/// unprivileged container cannot open would be admitted broken; it is denied, naming the
/// devices and the way out, unless it requests a device plugin resource that hands them over.
fn host_device_denial(
    c: &ContainerFacts<'_>,
    host_paths: &[(&str, &str)],
    input: &Input<'_>,
    policy: &GpuPolicy,
) -> Option<String> {
    if host_paths.is_empty() {
        return None;
    }
    let requested: Vec<&str> = c
        .value
        .limit_names()
        .chain(c.value.request_names())
        .collect();
    let provided = |device: &HostDevice| {
        requested.iter().any(|r| {
            let from_policy = match device.path {
                RDMA_DEVICES => (policy.spec.rdma_resources.iter()).any(|p| glob_match(p, r)),
                VFIO_DEVICES => gpu::is_passthrough_resource(r),
                _ => false,
            };
            from_policy || device.resources.iter().any(|p| glob_match(p, r))
        })
    };
    let mut found: Vec<(HostDevice, &str, &str)> = Vec::new();
    for name in c.mount_names() {
        // The last volume of a name wins, as in the kubelet.
        let Some(&(_, path)) = host_paths.iter().rev().find(|(n, _)| *n == name) else {
            continue;
        };
        let Some(device) = gpu::host_device(path).filter(|d| !provided(d)) else {
            continue;
        };
        if !found
            .iter()
            .any(|(d, v, _)| d.path == device.path && *v == name)
        {
            found.push((device, name, path));
        }
    }
    if found.is_empty() {
        return None;
    }
    let devices: Vec<String> = (found.iter())
        .map(|(d, volume, path)| format!("{} ({path}, volume {volume})", d.what))
        .collect();
    let mut ways: Vec<String> = Vec::new();
    for (device, ..) in &found {
        let way = match device.path {
            RDMA_DEVICES => format!(
                "request the RDMA devices from an RDMA device plugin (a resource matching rdmaResources {}, such as rdma/rdma_shared_device_a)",
                policy.spec.rdma_resources.join(", ")
            ),
            VFIO_DEVICES => "request the GPU from NVIDIA's sandbox device plugin (nvidia.com/pgpu or nvidia.com/<GPU model>)".to_owned(),
            _ if device.path == gpu::HOST_DEV_TREE.path => {
                "mount only the GPU device paths it needs (gpuwarden turns them into a GPU request)".to_owned()
            }
            _ if !device.resources.is_empty() => {
                format!("request {} from its device plugin", device.resources.join(" or "))
            }
            _ => continue,
        };
        push_new(&mut ways, way);
    }
    ways.push(exemption_hint(c, input, policy));
    Some(format!(
        "{} {} loses privilege, and an unprivileged container cannot open {}: the device cgroup admits only devices the kubelet allocated. To be admitted: {}",
        c.at.kind.noun(),
        c.name,
        devices.join(", "),
        ways.join("; or "),
    ))
}

/// What becomes of RDMA a container used through privilege (docs/design.md, "RDMA").
enum RdmaUse {
    /// Nothing would hand it verbs devices once unprivileged: the denial.
    Lost(String),
    /// A pod network may hand them over: the note.
    FromNetwork(String),
}

/// Do no harm (docs/design.md, "RDMA"): a GPU container that loses privilege and shows RDMA
/// use in its own spec ([`rdma`]), without an RDMA device plugin's resource or a claim to
/// hand it verbs devices, would be admitted cut off from the HCAs privilege gave it. It is
/// denied, naming the sign and the way out; where the pod names an RDMA network, the
/// network may hand the devices over, and the rewrite says so.
fn rdma_left_behind(
    c: &ContainerFacts<'_>,
    claims_without_rdma: &[&str],
    host_paths: &[(&str, &str)],
    input: &Input<'_>,
    policy: &GpuPolicy,
) -> Option<RdmaUse> {
    if !c.gpu {
        return None;
    }
    let mut requested = c.value.limit_names().chain(c.value.request_names());
    if requested.any(|r| (policy.spec.rdma_resources.iter()).any(|p| glob_match(p, r)))
        || c.value
            .claim_names()
            .any(|n| !claims_without_rdma.contains(&n))
    {
        return None;
    }
    let env = (c.value.env.iter().flatten())
        .filter_map(|e| Some((e.name.as_deref()?, e.value.as_deref()?)));
    let sign = rdma::env_signal(env).or_else(|| {
        c.mounts().find_map(|(volume, mount_path)| {
            let host = host_paths.iter().rev().find(|(n, _)| *n == volume);
            rdma::is_plugin_mount(mount_path, host.map(|(_, p)| *p))
                .then(|| format!("an RDMA NCCL plugin mounted at {mount_path} (volume {volume})"))
        })
    })?;
    let networks = (input.pod.annotations())
        .map(|a| {
            rdma::networks(
                a.iter()
                    .filter_map(|(k, v)| Some((k.as_ref(), v.as_str()?))),
            )
        })
        .unwrap_or_default();
    let (noun, name) = (c.at.kind.noun(), c.name);
    if !networks.is_empty() {
        return Some(RdmaUse::FromNetwork(format!(
            "{noun} {name} shows RDMA use ({sign}) and loses privilege: its verbs devices must now come from the RDMA networks its annotations name ({}). If those networks do not hand them to the pod, request them from an RDMA device plugin (a resource matching rdmaResources)",
            networks.join(", ")
        )));
    }
    Some(RdmaUse::Lost(format!(
        "{noun} {name} loses privilege, and it shows RDMA use ({sign}): privilege gave it the host's verbs devices (/dev/infiniband), which an unprivileged container cannot open, so NCCL would fail or fall back to sockets. To be admitted: request the RDMA devices from an RDMA device plugin (a resource matching rdmaResources {}); or {}",
        policy.spec.rdma_resources.join(", "),
        exemption_hint(c, input, policy),
    )))
}

/// [`gpu::HOST_DEVICES`] whose device plugin resources the policy and the passthrough GPU
/// resources name.
const RDMA_DEVICES: &str = "/dev/infiniband";
const VFIO_DEVICES: &str = "/dev/vfio";

/// The GPUs a claim gives a container in place of `limit`, when the policy asks for claims
/// (`gpu.requestAs: ResourceClaim`). A request the container wrote stays an extended
/// resource: it chose that itself.
fn claim_count(limit: &Limit<'_>, request_as: RequestAs) -> Option<u32> {
    match (request_as, limit.quantity, limit.from) {
        (_, _, CountFrom::Request) | (RequestAs::ExtendedResource, _, _) => None,
        (RequestAs::ResourceClaim, Quantity::Count(n), _) => Some(n),
        (RequestAs::ResourceClaim, Quantity::Copied(_), _) => None,
    }
}

/// Adds a pod `resourceClaims` entry for `count` GPUs, under a name the pod does not use
/// (`taken`), and returns its index. The template must exist in the pod's namespace: when it
/// does not, or cannot be read, the pod is denied with the reason.
fn add_claim<'a>(
    plan: &mut Plan<'a>,
    taken: &[&str],
    input: &Input<'a>,
    policy: &GpuPolicy,
    count: u32,
) -> usize {
    let template = template_name(&policy.spec.gpu.device_class_name, count);
    if !plan.claims.iter().any(|c| c.template == template) {
        let namespace = input.namespace;
        let missing = match input
            .claims
            .lookup(ClaimSource::Template, namespace, &template)
        {
            ClaimLookup::Found(_) => None,
            ClaimLookup::Missing => Some("does not exist".to_owned()),
            ClaimLookup::Unknown(why) => Some(format!("cannot be read ({why})")),
        };
        if let Some(why) = missing {
            plan.denials.push(format!(
                "ResourceClaimTemplate {namespace}/{template} {why}: the operator keeps it in every namespace GpuPolicy {} governs (gpu.requestAs: ResourceClaim); see `kubectl get resourceclaimtemplates -n {namespace} -l {}` and the operator's log",
                policy.metadata.name.as_deref().unwrap_or(""),
                gpuwarden_crds::claims::LABEL_CLAIM_TEMPLATE,
            ));
        }
    }
    let mut n = plan.claims.len();
    let name = loop {
        let name = format!("{POD_CLAIM_PREFIX}{n}");
        if !taken.contains(&name.as_str()) && !plan.claims.iter().any(|c| c.name == name) {
            break name;
        }
        n += 1;
    };
    plan.claims.push(NewClaim {
        name,
        template,
        count,
    });
    plan.claims.len() - 1
}

/// Rule 3 for one container of the pod, in the pod's order.
#[derive(Debug)]
enum Count<'a> {
    /// Nothing to add: not changed, not a GPU container, or it has a GPU limit or a GPU
    /// claim.
    Keep,
    /// This limit.
    Limit(Limit<'a>),
    /// It ends with no GPU, for this reason.
    Zero(String),
    /// `gpu.requestAs: ResourceClaim`: it names the same GPUs as the container at this index
    /// in the pod's facts, and shares its claim.
    Share(usize),
}

/// Rule 3 over the whole pod (docs/design.md, "GPU counts"): per container, the limit it
/// gets or why it gets none. A container's own GPU limit or request says first (an
/// explicit 0 means no GPU), then its annotation `gpuwarden.io/gpu-count.<name>`, then the
/// pod's `gpuwarden.io/gpu-count` as the total of the containers left (regular containers
/// split it, each init container may use all of it), then its own signals, where regular
/// containers naming the same GPUs share them rather than each asking for them. Why the pod
/// cannot be rewritten as it is goes to `denials`: a bad annotation, a container over
/// `maxPerContainer`, a pod over `maxPerPod`.
fn gpu_counts<'a>(
    facts: &PodFacts<'a>,
    policy: &'a GpuPolicy,
    denials: &mut Vec<String>,
) -> Vec<Count<'a>> {
    let spec = &policy.spec.gpu;
    let annotation = |key: &str| {
        let raw = facts.annotations?.get(key)?;
        Some((raw.as_str(), raw.to_string()))
    };
    let pod_total = annotation(ANNOTATION_GPU_COUNT)
        .map(|(text, shown)| gpu::annotation_count(ANNOTATION_GPU_COUNT, text, &shown, 1));
    if let Some(Err(denial)) = &pod_total {
        denials.push(denial.clone());
    }
    let label = |c: &ContainerFacts<'_>| format!("{} {}", c.at.kind.noun(), c.name);
    let mut counts = Vec::with_capacity(facts.containers.len());
    // Containers that take their count from the pod's total: regular (and sidecar) ones
    // split it, init ones may each use all of it.
    let (mut split, mut whole_total) = (Vec::new(), Vec::new());
    // The GPUs named in NVIDIA_VISIBLE_DEVICES by a regular container, and which (its name
    // and index).
    let mut named: Vec<(String, &str, usize)> = Vec::new();
    let claim_mode = spec.request_as == RequestAs::ResourceClaim;
    for (i, c) in facts.containers.iter().enumerate() {
        if !c.changes() || !c.gpu {
            counts.push(Count::Keep);
            continue;
        }
        let requested = c.gpu_request.map(|(_, quantity)| whole(quantity));
        let zero = match (c.signals.limit, requested) {
            (true, _) => limited_gpus(c, policy) == Some(0),
            (false, Some(n)) => n == Some(0),
            (false, None) => false,
        };
        if zero {
            counts.push(Count::Zero(format!(
                "asks for 0 GPUs explicitly, so it gets none and {ENV_VISIBLE_DEVICES}=void keeps the image's own value out"
            )));
            continue;
        }
        // A limit, or GPUs through a ResourceClaim of its own: nothing is added on top.
        if c.signals.limit || c.signals.claim.is_some() {
            counts.push(Count::Keep);
            continue;
        }
        if let Some((resource, quantity)) = c.gpu_request {
            counts.push(Count::Limit(Limit {
                resource,
                quantity: Quantity::Copied(quantity),
                from: CountFrom::Request,
            }));
            continue;
        }
        let own = format!("{ANNOTATION_GPU_COUNT}.{}", c.name);
        let counted = if let Some((text, shown)) = annotation(&own) {
            gpu::annotation_count(&own, text, &shown, 1)
                .map(|n| (n, CountFrom::ContainerAnnotation(c.name)))
        } else if let Some(total) = &pod_total {
            match total {
                Ok(_) if c.at.kind == ContainerKind::Init && !c.sidecar => whole_total.push(i),
                Ok(_) => split.push(i),
                // Already denied.
                Err(_) => {}
            }
            counts.push(Count::Keep);
            continue;
        } else {
            gpu::signal_count(&c.signals, policy)
        };
        match counted {
            Ok((n, from)) if n > spec.max_per_container => {
                denials.push(format!(
                    "{} would need {n} GPUs ({from}), more than maxPerContainer {}",
                    label(c),
                    spec.max_per_container
                ));
                counts.push(Count::Keep);
            }
            Ok((n, from)) => {
                let shared = (c.at.kind == ContainerKind::Regular || c.sidecar)
                    .then(|| c.signals.visible_key())
                    .flatten()
                    .filter(|_| matches!(from, CountFrom::Visible(_) | CountFrom::VisibleAll));
                let first = (shared.as_ref()).and_then(|key| {
                    (named.iter().find(|(k, _, _)| k == key)).map(|(_, name, at)| (*name, *at))
                });
                match (shared, first) {
                    (_, Some((_, at))) if claim_mode => counts.push(Count::Share(at)),
                    (_, Some((first, _))) => counts.push(Count::Zero(gpu::shared_gpus_text(
                        first,
                        c.signals.visible_raw.unwrap_or(""),
                    ))),
                    (Some(key), None) => {
                        named.push((key, c.name, i));
                        counts.push(Count::Limit(Limit::count(&spec.resource_name, n, from)));
                    }
                    (None, None) => {
                        counts.push(Count::Limit(Limit::count(&spec.resource_name, n, from)))
                    }
                }
            }
            Err(denial) => {
                denials.push(format!("{}: {denial}", label(c)));
                counts.push(Count::Keep);
            }
        }
    }

    // The pod's total: split evenly over the regular containers that take it, the first
    // ones in the pod's order taking the remainder; each init container may use all of it.
    if let Some(Ok(total)) = pod_total {
        let ways = u32::try_from(split.len()).unwrap_or(u32::MAX);
        for (k, &i) in split.iter().enumerate() {
            let k = u32::try_from(k).unwrap_or(u32::MAX);
            let n = total / ways + u32::from(k < total % ways);
            counts[i] = if n == 0 {
                Count::Zero(format!(
                    "annotation {ANNOTATION_GPU_COUNT}={total} split over {ways} containers leaves it none"
                ))
            } else {
                Count::Limit(Limit::count(
                    &spec.resource_name,
                    n,
                    CountFrom::PodAnnotation { total, ways },
                ))
            };
        }
        for &i in &whole_total {
            counts[i] = Count::Limit(Limit::count(
                &spec.resource_name,
                total,
                CountFrom::PodAnnotation { total, ways: 1 },
            ));
        }
        for &i in split.iter().chain(&whole_total) {
            if let Count::Limit(Limit {
                quantity: Quantity::Count(n),
                ..
            }) = counts[i]
                && n > spec.max_per_container
            {
                denials.push(format!(
                    "{} would need {n} GPUs (annotation {ANNOTATION_GPU_COUNT}={total}), more than maxPerContainer {}",
                    label(&facts.containers[i]),
                    spec.max_per_container
                ));
            }
        }
    }

    // What the pod holds at once: its regular and sidecar containers together, or its
    // largest init container, whichever is more; and every claim added, which the pod holds
    // from start to end (a shared one once).
    let (mut running, mut init, mut claimed) = (0u32, 0u32, 0u32);
    for (c, count) in facts.containers.iter().zip(&counts) {
        let n = match count {
            Count::Limit(limit) => match (claim_count(limit, spec.request_as), limit.quantity) {
                (Some(n), _) => {
                    claimed = claimed.saturating_add(n);
                    continue;
                }
                (None, Quantity::Count(n)) => n,
                (None, Quantity::Copied(q)) => whole(q).unwrap_or(0),
            },
            Count::Zero(_) | Count::Share(_) => 0,
            Count::Keep => limited_gpus(c, policy).unwrap_or(0),
        };
        match c.at.kind {
            ContainerKind::Init if !c.sidecar => init = init.max(n),
            ContainerKind::Ephemeral => {}
            _ => running = running.saturating_add(n),
        }
    }
    let held = running.max(init).saturating_add(claimed);
    if held > spec.max_per_pod {
        denials.push(format!(
            "the pod would hold {held} GPUs at once, more than maxPerPod {}: no node is expected to fit it",
            spec.max_per_pod
        ));
    }
    counts
}

/// Rules 1 and 2 for a container that loses privilege: the capabilities it keeps (the
/// policy's defaults, then what it asked for that the policy allows) and those refused.
fn capabilities<'a>(
    p: &mut ContainerPlan<'a>,
    container: &'a Container<'a>,
    policy: &'a GpuPolicy,
    psa: PsaLevel,
) {
    let caps = &policy.spec.capabilities;
    // What an ordinary container of the namespace may ask for, it keeps asking for: the
    // runtime gives it those anyway unless it drops them (docs/design.md, "What a rewritten
    // container keeps").
    let ordinary = |cap: &str| !caps.drop_all && RUNTIME_DEFAULT_CAPABILITIES.contains(&cap);
    let asked = container
        .security_context
        .as_ref()
        .and_then(|s| s.capabilities.as_ref())
        .map_or(&[][..], |c| c.add.as_slice());
    let allowed = |cap: &str| ordinary(cap) || caps.allowed.iter().any(|a| normalise_cap(a) == cap);
    let asked = asked.iter().map(|a| normalise_cap(a));
    for cap in caps
        .default
        .iter()
        .map(|d| normalise_cap(d))
        .chain(asked.clone().filter(|a| allowed(a)))
    {
        if !p.caps_added.contains(&cap) {
            p.caps_added.push(cap);
        }
    }
    for cap in asked {
        if !p.caps_added.contains(&cap) && !p.caps_refused.contains(&cap) {
            p.caps_refused.push(cap);
        }
    }
    p.caps_refused.sort_unstable();
    // Pod Security Admission bounds what may be added: what it forbids is withheld
    // (docs/design.md, "Pod Security"), and `restricted` also needs every other dropped.
    if psa != PsaLevel::Privileged {
        let (kept, withheld) = std::mem::take(&mut p.caps_added)
            .into_iter()
            .partition(|cap| psa.allows_capability(cap));
        p.caps_added = kept;
        p.caps_withheld = withheld;
    }
    p.drop_all = caps.drop_all || psa == PsaLevel::Restricted;
}

/// The edit that removes the `remove` names from a container's env and sets `set`, or `None`
/// when the env is already so. An entry already holding the value stays where it is.
fn rewrite_env<'a>(
    container: &Container<'_>,
    remove: &[&'static str],
    set: Option<(&'static str, EnvValue<'a>)>,
    driver_capabilities: &str,
) -> Option<EnvEdit<'a>> {
    let env = container.env.as_deref().unwrap_or_default();
    let mut edit = EnvEdit {
        remove: Indices::default(),
        append: false,
        removed: Vec::new(),
        set: None,
    };
    let wanted = set.map(|(k, v)| {
        let value = match v {
            EnvValue::DriverCapabilities => driver_capabilities,
            EnvValue::Fixed(value) => value,
        };
        (k, value)
    });
    let mut set_done = false;
    let mut set_changed = false;
    for (i, entry) in env.iter().enumerate() {
        let name = entry.name.as_deref().unwrap_or("");
        if let Some(&known) = remove.iter().find(|r| **r == name) {
            push_new(&mut edit.removed, known);
            edit.remove.push(i);
            continue;
        }
        if let Some((k, v)) = wanted
            && name == k
        {
            let same = entry.value.as_deref() == Some(v) && entry.value_from.is_none();
            if same && !set_done {
                set_done = true;
            } else {
                // A different value, or a duplicate: replaced by the one entry below.
                set_changed = true;
                edit.remove.push(i);
            }
        }
    }
    if set.is_some() && !set_done {
        set_changed = true;
        edit.append = true;
    }
    if edit.remove.is_empty() && !edit.append {
        return None;
    }
    edit.set = set.filter(|_| set_changed);
    Some(edit)
}

/// Appends `item` unless `list` already holds it.
fn push_new<T: PartialEq>(list: &mut Vec<T>, item: T) {
    if !list.contains(&item) {
        list.push(item);
    }
}
