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
use crate::pod::{Container, ContainerKind, PodView, Scalar};

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
    let mut plan = Plan::new(facts, policy, psa);
    plan.denials = what_no_rewrite_makes_safe(facts);
    plan.psa_left = still_fails_pod_security(input.pod, facts, psa, &strip);
    let counts = gpu_counts(facts, policy, &mut plan.denials);
    let mut planning = Planning::new(plan, input, facts, policy, &strip);
    for (i, (c, count)) in facts.containers.iter().zip(counts).enumerate() {
        planning.plan_container(i, c, count);
    }
    let mut plan = planning.plan;
    remove_device_volumes(&mut plan, input.pod, strip);
    remove_cdi_annotations(&mut plan, facts, policy);
    plan
}

impl<'a> Plan<'a> {
    /// A plan that changes nothing yet.
    fn new(facts: &PodFacts<'a>, policy: &GpuPolicy, psa: PsaLevel) -> Self {
        Self {
            containers: Vec::with_capacity(facts.containers.len()),
            volumes: Indices::default(),
            volumes_removed: Names::default(),
            annotations_removed: Vec::new(),
            denials: Vec::new(),
            driver_capabilities: policy.spec.driver_capabilities.join(","),
            device_volumes: facts.pod.clone(),
            psa,
            psa_left: Vec::new(),
            claims: Vec::new(),
            notes: Vec::new(),
            start_up: Vec::new(),
        }
    }
}

impl<'a> ContainerPlan<'a> {
    /// A plan that changes nothing yet in `c`, but for whether it loses privilege.
    fn new(c: &ContainerFacts<'a>) -> Self {
        Self {
            at: c.at,
            name: c.name,
            deprivileged: c.loses_privilege(),
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
        }
    }
}

/// What the pod asks for that no rewrite makes safe, whatever its containers become:
/// device-injection annotations that name NVIDIA devices the pod does not hold (the node
/// plugin hands the devices over whatever the container's privilege or limits), claims only
/// a driver's own pods may hold, and the like.
fn what_no_rewrite_makes_safe(facts: &PodFacts<'_>) -> Vec<String> {
    let injections = facts.injections.uncovered.iter().map(|u| u.message.clone());
    injections.chain(facts.refusals.iter().cloned()).collect()
}

/// What Pod Security Admission would still refuse once the rewrite is done: the containers
/// that lose privilege are rewritten, the device volumes in `strip` go.
fn still_fails_pod_security(
    pod: &PodView<'_>,
    facts: &PodFacts<'_>,
    psa: PsaLevel,
    strip: &[&str],
) -> Vec<String> {
    psa::still_fails(
        psa,
        pod,
        facts,
        |i| (facts.containers.get(i)).is_some_and(ContainerFacts::loses_privilege),
        |name| !strip.contains(&name),
    )
}

/// Pod-level rule 5: the device volumes in `strip` go from `spec.volumes`.
fn remove_device_volumes<'a>(plan: &mut Plan<'a>, pod: &PodView<'_>, strip: Names<'a>) {
    if strip.is_empty() {
        return;
    }
    plan.volumes = (pod.volumes().iter().enumerate())
        .filter(|(_, v)| v.name.as_deref().is_some_and(|n| strip.contains(&n)))
        .map(|(i, _)| i)
        .collect();
    if !plan.volumes.is_empty() {
        plan.volumes_removed = strip;
    }
}

/// Pod-level rule 5: the `cdi.k8s.io/*` annotations go, where the policy says so.
fn remove_cdi_annotations<'a>(plan: &mut Plan<'a>, facts: &PodFacts<'a>, policy: &GpuPolicy) {
    if policy.spec.strip_cdi_annotations {
        plan.annotations_removed = facts.pod.cdi_keys().to_vec();
    }
}

/// The plan as its containers are planned one by one, in the pod's order, with what each
/// reads of the pod besides its own facts.
struct Planning<'p, 'a> {
    plan: Plan<'a>,
    input: &'p Input<'a>,
    facts: &'p PodFacts<'a>,
    policy: &'a GpuPolicy,
    /// The device volumes that go.
    strip: &'p [&'a str],
    /// The names of the pod's `resourceClaims` entries: a claim added takes another.
    taken: Vec<&'a str>,
    /// The pod's hostPath volumes: name and path.
    host_paths: Vec<(&'a str, &'a str)>,
    daemon_set: Option<&'a str>,
    /// Rule 4: the variables a container loses (docs/design.md, "Runtime variables"); with
    /// its GPUs from the runtime, NVIDIA_VISIBLE_DEVICES too (`with_visible`).
    device_variables: Vec<&'static str>,
    with_visible: Vec<&'static str>,
    /// Per container (by its index in `facts`), the claim it holds and where its count came
    /// from, for those that share it.
    held: Vec<Option<(usize, CountFrom<'a>)>>,
}

impl<'p, 'a> Planning<'p, 'a> {
    fn new(
        plan: Plan<'a>,
        input: &'p Input<'a>,
        facts: &'p PodFacts<'a>,
        policy: &'a GpuPolicy,
        strip: &'p [&'a str],
    ) -> Self {
        let pod = input.pod;
        let rules = gpu::Rules::of(policy);
        Self {
            plan,
            input,
            facts,
            policy,
            strip,
            taken: (pod.resource_claims().iter())
                .filter_map(|c| c.name.as_deref())
                .collect(),
            host_paths: (pod.volumes().iter())
                .filter_map(|v| {
                    let path = v.host_path.as_ref()?.path.as_deref()?;
                    Some((v.name.as_deref()?, path))
                })
                .collect(),
            daemon_set: input.daemon_set(),
            device_variables: rules.device_variables(),
            with_visible: rules.judged_variables(),
            held: vec![None; facts.containers.len()],
        }
    }

    /// Plans container `i` of the facts, whose GPU count is `count`: it loses privilege
    /// (rules 1 and 2, unless its image is exempt), its leaks close (rules 3 to 5: a
    /// container that leaks without privilege keeps its security context), and its mounts of
    /// device volumes go. Added to the plan when anything changes.
    fn plan_container(&mut self, i: usize, c: &ContainerFacts<'a>, count: Count<'a>) {
        let mut p = ContainerPlan::new(c);
        if c.loses_privilege() {
            self.do_no_harm(c);
            self.lose_privilege(&mut p, c);
        }
        if c.changes() {
            let gpu = self.request_gpus(&mut p, i, c, count);
            // Only a GPU resource limit has the runtime read the container's GPUs from
            // NVIDIA_VISIBLE_DEVICES (the device plugin sets it). One whose GPUs come from a
            // claim gets them through the DRA driver's CDI edits, which set the variable to
            // `void` themselves: the void rule holds for it as for a container without GPUs.
            let through_runtime =
                gpu && (c.signals.limit || c.signals.request.is_some() || p.limit.is_some());
            self.judge_env_from(&mut p, c, through_runtime);
            self.rewrite_runtime_variables(&mut p, c, gpu, through_runtime);
        }
        self.remove_device_mounts(&mut p, c);
        if c.changes() || !p.mounts.is_empty() {
            self.plan.containers.push(p);
        }
    }

    /// Do no harm (docs/design.md): a container that loses privilege must still open its
    /// host devices and reach its RDMA devices; where it could not, the pod is denied, and
    /// where a pod network may hand them over, the rewrite says so.
    fn do_no_harm(&mut self, c: &ContainerFacts<'a>) {
        let (input, policy) = (self.input, self.policy);
        if let Some(denial) = host_device_denial(c, &self.host_paths, input, policy) {
            self.plan.denials.push(denial);
            return;
        }
        let without_rdma = &self.facts.claims_without_rdma;
        match rdma_left_behind(c, without_rdma, &self.host_paths, input, policy) {
            Some(RdmaUse::Lost(denial)) => self.plan.denials.push(denial),
            Some(RdmaUse::FromNetwork(note)) => self.plan.notes.push(note),
            None => {}
        }
    }

    /// Rules 1 and 2: what it keeps of capabilities, and `seccompProfile: RuntimeDefault`
    /// where Pod Security `restricted` asks for a profile neither it nor the pod sets.
    fn lose_privilege(&self, p: &mut ContainerPlan<'a>, c: &ContainerFacts<'a>) {
        let psa = self.plan.psa;
        capabilities(p, c.value, self.policy, psa);
        let pod_seccomp = (self.input.pod.spec.as_ref())
            .and_then(|s| s.security_context.as_ref())
            .is_some_and(|s| s.seccomp_profile);
        let own_seccomp = (c.value.security_context.as_ref()).is_some_and(|s| s.seccomp_profile);
        p.seccomp_default = psa == PsaLevel::Restricted && !pod_seccomp && !own_seccomp;
    }

    /// Rule 3: the GPUs it gets as `count` says: a limit, or with `gpu.requestAs:
    /// ResourceClaim` a claim added (or shared with the container that holds it), or none.
    /// A DaemonSet's pod given GPUs it did not ask for itself is denied. Whether it ends
    /// with GPUs.
    fn request_gpus(
        &mut self,
        p: &mut ContainerPlan<'a>,
        i: usize,
        c: &ContainerFacts<'a>,
        count: Count<'a>,
    ) -> bool {
        p.own_claim = c.signals.claim;
        let (input, policy) = (self.input, self.policy);
        let gpu = match count {
            Count::Limit(limit) => {
                if let Some(name) = self.daemon_set.filter(|_| !limit.from.asked_by_pod()) {
                    let denial = daemon_set_denial(c, &limit, name, input, policy);
                    self.plan.denials.push(denial);
                }
                match claim_count(&limit, policy.spec.gpu.request_as) {
                    Some(n) => p.claim = Some(self.claim_gpus(i, n, limit.from)),
                    None => p.limit = Some(limit),
                }
                true
            }
            Count::Share(first) => {
                // The holder always has its claim: a count it was denied never shares.
                p.claim = self.held[first].map(|(index, from)| ClaimUse {
                    index,
                    from,
                    shared_with: Some(self.facts.containers[first].name),
                });
                true
            }
            Count::Zero(why) => {
                p.gpu = false;
                p.no_gpu = Some(why);
                false
            }
            Count::Keep => c.gpu,
        };
        if p.limit.is_some() || p.claim.is_some() {
            p.unread_claims = (self.facts.unread_claims.iter())
                .filter(|(name, _)| c.value.claim_names().any(|n| n == *name))
                .map(|(name, why)| (*name, why.clone()))
                .collect();
        }
        gpu
    }

    /// A claim added for `n` GPUs, counted from `from`, that container `i` holds.
    fn claim_gpus(&mut self, i: usize, n: u32, from: CountFrom<'a>) -> ClaimUse<'a> {
        let index = add_claim(&mut self.plan, &self.taken, self.input, self.policy, n);
        self.held[i] = Some((index, from));
        ClaimUse {
            index,
            from,
            shared_with: None,
        }
    }

    /// `envFrom` may set NVIDIA_VISIBLE_DEVICES unseen. An `env` entry overrides it, so a
    /// container that gets `void` is safe; a container whose GPUs the runtime reads from the
    /// variable (`through_runtime`) cannot be given one (it would override the allocation).
    /// A prefix that could spell a runtime variable with a key of what envFrom reads is the
    /// same door, whatever the ConfigMap guard refuses of keys.
    fn judge_env_from(
        &mut self,
        p: &mut ContainerPlan<'a>,
        c: &ContainerFacts<'a>,
        through_runtime: bool,
    ) {
        if !c.signals.env_from {
            return;
        }
        let spells = c.signals.env_from_spells;
        if !through_runtime {
            p.env_from = Some("the void overrides whatever envFrom sets");
        } else if let Some((prefix, variable)) = spells {
            self.plan.denials.push(format!(
                "{} {}: envFrom prefix {prefix} spells {variable} with a key {}, which would hand the container devices beyond the GPUs the kubelet allocates; use a prefix that starts no NVIDIA runtime variable",
                c.at.kind.noun(),
                c.name,
                &variable[prefix.len()..],
            ));
        } else if self.policy.spec.gpu.env_from == EnvFromGpu::Warn {
            // The runtime's setting that ignores NVIDIA_VISIBLE_DEVICES in unprivileged
            // containers leaves the other variables in force: Warn covers that one variable
            // only.
            p.env_from = Some(
                "envFrom may still set NVIDIA_VISIBLE_DEVICES over the allocated GPUs (gpu.envFrom: Warn)",
            );
        } else {
            self.plan.denials.push(format!(
                "{} {}: envFrom may set NVIDIA_VISIBLE_DEVICES, which would override the GPUs the kubelet allocates; list the variables it needs under env instead, or set gpu.envFrom: Warn where nodes ignore the variable in unprivileged containers",
                c.at.kind.noun(),
                c.name
            ));
        }
    }

    /// Rule 4: a container whose GPUs the runtime reads from NVIDIA_VISIBLE_DEVICES
    /// (`through_runtime`) loses it with the device variables and gets the policy's
    /// NVIDIA_DRIVER_CAPABILITIES; any other loses the device variables and gets
    /// `NVIDIA_VISIBLE_DEVICES=void`.
    fn rewrite_runtime_variables(
        &self,
        p: &mut ContainerPlan<'a>,
        c: &ContainerFacts<'a>,
        gpu: bool,
        through_runtime: bool,
    ) {
        // In a pod that holds a passthrough GPU the variables are read inside its VM, among
        // the GPUs passed through (Kata needs `NVIDIA_VISIBLE_DEVICES=all` there): a GPU
        // container keeps its environment.
        if gpu && c.signals.passthrough {
            return;
        }
        let (remove, set): (&[&'static str], _) = if through_runtime {
            (
                &self.with_visible,
                (ENV_DRIVER_CAPABILITIES, EnvValue::DriverCapabilities),
            )
        } else {
            (
                &self.device_variables,
                (ENV_VISIBLE_DEVICES, EnvValue::Fixed("void")),
            )
        };
        let no_capabilities = self.policy.spec.driver_capabilities.is_empty();
        let set = (!(through_runtime && no_capabilities)).then_some(set);
        p.env = rewrite_env(c.value, remove, set, &self.plan.driver_capabilities);
    }

    /// Rule 5: mounts of removed device volumes go from every container that is not exempt;
    /// a rewritten container also loses its mounts of device volumes that stay because an
    /// exempt container still mounts them. Mounts the toolkit would read as a device list go
    /// from every container that is changed.
    fn remove_device_mounts(&self, p: &mut ContainerPlan<'a>, c: &ContainerFacts<'a>) {
        let strips = |name: &str| {
            self.strip.contains(&name)
                || (c.loses_privilege()
                    && self.policy.spec.strip_device_host_paths
                    && self.facts.pod.device_volume(name).is_some())
        };
        if !c.image_exempt && c.signals.device_mount && c.mount_names().any(strips) {
            for (i, name) in c.mount_names().enumerate() {
                if strips(name) {
                    p.mounts.push(i);
                    push_new(&mut p.mounts_removed, name);
                }
            }
        }
        if c.changes() && c.signals.device_list != VisibleDevices::Unset {
            for (i, (_, path)) in c.mounts().enumerate() {
                if gpu::device_list_entry(path).is_some() && !p.mounts.contains(&i) {
                    p.mounts.push(i);
                    p.device_list_removed.push(path);
                }
            }
            p.mounts.sort_unstable();
        }
    }
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
    let mut counting = Counting::new(facts, policy, denials);
    let mut counts: Vec<Count<'a>> = (facts.containers.iter().enumerate())
        .map(|(i, c)| counting.count(i, c))
        .collect();
    counting.split_pod_total(&mut counts);
    deny_over_max_per_pod(facts, &counts, policy, denials);
    counts
}

/// `container trainer`, `init container setup`: how the count denials name a container.
fn label(c: &ContainerFacts<'_>) -> String {
    format!("{} {}", c.at.kind.noun(), c.name)
}

/// The GPUs of the containers counted one by one, in the pod's order.
struct Counting<'f, 'a> {
    facts: &'f PodFacts<'a>,
    policy: &'a GpuPolicy,
    denials: &'f mut Vec<String>,
    /// The pod's `gpuwarden.io/gpu-count`, read, when it has one.
    pod_total: Option<Result<u32, String>>,
    /// Containers that take their count from the pod's total: regular (and sidecar) ones
    /// split it (`split`), init ones may each use all of it (`whole_total`).
    split: Vec<usize>,
    whole_total: Vec<usize>,
    /// The GPUs named in NVIDIA_VISIBLE_DEVICES by a regular container, and which (its name
    /// and index).
    named: Vec<(String, &'a str, usize)>,
}

impl<'f, 'a> Counting<'f, 'a> {
    /// Counting that starts with the pod's total; an annotation that cannot be read is a
    /// denial.
    fn new(facts: &'f PodFacts<'a>, policy: &'a GpuPolicy, denials: &'f mut Vec<String>) -> Self {
        let mut counting = Self {
            facts,
            policy,
            denials,
            pod_total: None,
            split: Vec::new(),
            whole_total: Vec::new(),
            named: Vec::new(),
        };
        counting.pod_total = (counting.annotation(ANNOTATION_GPU_COUNT))
            .map(|(text, shown)| gpu::annotation_count(ANNOTATION_GPU_COUNT, text, &shown, 1));
        if let Some(Err(denial)) = &counting.pod_total {
            counting.denials.push(denial.clone());
        }
        counting
    }

    /// The pod's annotation `key`: its text, and how a message shows it.
    fn annotation(&self, key: &str) -> Option<(Option<&'a str>, String)> {
        let raw = self.facts.annotations?.get(key)?;
        Some((raw.as_str(), raw.to_string()))
    }

    /// Rule 3 for container `i` of the facts: its own limit or request, its annotation, its
    /// part of the pod's total (left [`Count::Keep`] here and given by
    /// [`Counting::split_pod_total`]), or its own signals.
    fn count(&mut self, i: usize, c: &ContainerFacts<'a>) -> Count<'a> {
        if !c.changes() || !c.gpu {
            return Count::Keep;
        }
        if asks_for_no_gpu(c, self.policy) {
            return Count::Zero(format!(
                "asks for 0 GPUs explicitly, so it gets none and {ENV_VISIBLE_DEVICES}=void keeps the image's own value out"
            ));
        }
        // A limit, or GPUs through a ResourceClaim of its own: nothing is added on top.
        if c.signals.limit || c.signals.claim.is_some() {
            return Count::Keep;
        }
        if let Some((resource, quantity)) = c.gpu_request {
            return Count::Limit(Limit {
                resource,
                quantity: Quantity::Copied(quantity),
                from: CountFrom::Request,
            });
        }
        let own = format!("{ANNOTATION_GPU_COUNT}.{}", c.name);
        let counted = if let Some((text, shown)) = self.annotation(&own) {
            gpu::annotation_count(&own, text, &shown, 1)
                .map(|n| (n, CountFrom::ContainerAnnotation(c.name)))
        } else if let Some(total) = &self.pod_total {
            match total {
                Ok(_) if c.at.kind == ContainerKind::Init && !c.sidecar => self.whole_total.push(i),
                Ok(_) => self.split.push(i),
                // Already denied.
                Err(_) => {}
            }
            return Count::Keep;
        } else {
            gpu::signal_count(&c.signals, self.policy)
        };
        let max = self.policy.spec.gpu.max_per_container;
        match counted {
            Ok((n, from)) if n > max => {
                self.denials.push(format!(
                    "{} would need {n} GPUs ({from}), more than maxPerContainer {max}",
                    label(c),
                ));
                Count::Keep
            }
            Ok((n, from)) => self.limit_or_share(i, c, n, from),
            Err(denial) => {
                self.denials.push(format!("{}: {denial}", label(c)));
                Count::Keep
            }
        }
    }

    /// `n` GPUs counted from `from` for container `i`: its limit, unless a regular container
    /// before it named the same GPUs in NVIDIA_VISIBLE_DEVICES. It then shares that one's
    /// claim (`gpu.requestAs: ResourceClaim`), or gets none: an extended resource cannot be
    /// shared.
    fn limit_or_share(
        &mut self,
        i: usize,
        c: &ContainerFacts<'a>,
        n: u32,
        from: CountFrom<'a>,
    ) -> Count<'a> {
        let spec = &self.policy.spec.gpu;
        let claim_mode = spec.request_as == RequestAs::ResourceClaim;
        let shared = (c.at.kind == ContainerKind::Regular || c.sidecar)
            .then(|| c.signals.visible_key())
            .flatten()
            .filter(|_| matches!(from, CountFrom::Visible(_) | CountFrom::VisibleAll));
        let first = (shared.as_ref()).and_then(|key| {
            (self.named.iter().find(|(k, _, _)| k == key)).map(|(_, name, at)| (*name, *at))
        });
        match (shared, first) {
            (_, Some((_, at))) if claim_mode => Count::Share(at),
            (_, Some((first, _))) => Count::Zero(gpu::shared_gpus_text(
                first,
                c.signals.visible_raw.unwrap_or(""),
            )),
            (Some(key), None) => {
                self.named.push((key, c.name, i));
                Count::Limit(Limit::count(&spec.resource_name, n, from))
            }
            (None, None) => Count::Limit(Limit::count(&spec.resource_name, n, from)),
        }
    }

    /// The pod's total: split evenly over the regular containers that take it, the first
    /// ones in the pod's order taking the remainder; each init container may use all of it.
    /// A container it gives more than `maxPerContainer` is a denial.
    fn split_pod_total(&mut self, counts: &mut [Count<'a>]) {
        let Some(Ok(total)) = self.pod_total else {
            return;
        };
        let spec = &self.policy.spec.gpu;
        let ways = u32::try_from(self.split.len()).unwrap_or(u32::MAX);
        for (k, &i) in self.split.iter().enumerate() {
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
        for &i in &self.whole_total {
            counts[i] = Count::Limit(Limit::count(
                &spec.resource_name,
                total,
                CountFrom::PodAnnotation { total, ways: 1 },
            ));
        }
        for &i in self.split.iter().chain(&self.whole_total) {
            if let Count::Limit(Limit {
                quantity: Quantity::Count(n),
                ..
            }) = counts[i]
                && n > spec.max_per_container
            {
                self.denials.push(format!(
                    "{} would need {n} GPUs (annotation {ANNOTATION_GPU_COUNT}={total}), more than maxPerContainer {}",
                    label(&self.facts.containers[i]),
                    spec.max_per_container
                ));
            }
        }
    }
}

/// Whether the container's own GPU limit or request (without a limit) is an explicit 0:
/// no GPU.
fn asks_for_no_gpu(c: &ContainerFacts<'_>, policy: &GpuPolicy) -> bool {
    let requested = c.gpu_request.map(|(_, quantity)| whole(quantity));
    match (c.signals.limit, requested) {
        (true, _) => limited_gpus(c, policy) == Some(0),
        (false, Some(n)) => n == Some(0),
        (false, None) => false,
    }
}

/// A pod that would hold more than `maxPerPod` GPUs at once, as `counts` leave it, is a
/// denial: no node is expected to fit it.
fn deny_over_max_per_pod(
    facts: &PodFacts<'_>,
    counts: &[Count<'_>],
    policy: &GpuPolicy,
    denials: &mut Vec<String>,
) {
    let held = gpus_held_at_once(facts, counts, policy);
    let max = policy.spec.gpu.max_per_pod;
    if held > max {
        denials.push(format!(
            "the pod would hold {held} GPUs at once, more than maxPerPod {max}: no node is expected to fit it"
        ));
    }
}

/// What the pod holds at once: its regular and sidecar containers together, or its largest
/// init container, whichever is more; and every claim added, which the pod holds from start
/// to end (a shared one once).
fn gpus_held_at_once(facts: &PodFacts<'_>, counts: &[Count<'_>], policy: &GpuPolicy) -> u32 {
    let (mut running, mut init, mut claimed) = (0u32, 0u32, 0u32);
    for (c, count) in facts.containers.iter().zip(counts) {
        let n = match count {
            Count::Limit(limit) => {
                match (
                    claim_count(limit, policy.spec.gpu.request_as),
                    limit.quantity,
                ) {
                    (Some(n), _) => {
                        claimed = claimed.saturating_add(n);
                        continue;
                    }
                    (None, Quantity::Count(n)) => n,
                    (None, Quantity::Copied(q)) => whole(q).unwrap_or(0),
                }
            }
            Count::Zero(_) | Count::Share(_) => 0,
            Count::Keep => limited_gpus(c, policy).unwrap_or(0),
        };
        match c.at.kind {
            ContainerKind::Init if !c.sidecar => init = init.max(n),
            ContainerKind::Ephemeral => {}
            _ => running = running.saturating_add(n),
        }
    }
    running.max(init).saturating_add(claimed)
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
