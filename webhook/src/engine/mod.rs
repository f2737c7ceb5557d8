//! The rewrite engine: a pure function from a pod, the policies and the namespace's labels to
//! a [`Decision`]: a verdict and, for a pod it rewrites, audits or denies, the plan of what
//! changes in each container. The list of [`Change`]s, the warnings, the audit annotations
//! and the `gpuwarden.io/rewritten` report are all written from that plan;
//! [`crate::patch`] turns the changes into an RFC 6902 patch.
//!
//! The engine reads the pod through a [`PodView`]: the few fields it needs, borrowed from
//! the review's body (or from a manifest's `Value`), rather than a whole typed `Pod`. A
//! decision borrows from the pod and the policy in turn, so judging a pod copies almost
//! nothing until the answer is built from it. It never
//! drops fields it does not know, since its output is a patch, and the patch touches only
//! the fields docs/design.md ("Rewrite rules") lists (container `securityContext.privileged`,
//! `allowPrivilegeEscalation`, `capabilities`, GPU limits, `env`, `volumeMounts`; pod
//! `volumes` and `metadata.annotations`).
//!
//! The same functions serve admission reviews ([`crate::admission`]) and the offline
//! `mutate` command ([`crate::mutate`]), where the "pod" is a workload's pod template.

mod claims;
mod facts;
mod input;
mod plan;
mod psa;
mod render;
mod sharing;
mod start_up;
mod vm;
mod void;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use gpuwarden_crds::{
    ANNOTATION_AUDIT, ANNOTATION_POLICY, ANNOTATION_REWRITTEN, GpuPolicy, PolicyMode,
};

use crate::pod::{Map, PodView, Scalar};
use plan::{ContainerPlan, Plan};
use sharing::Kai;

pub use crate::pod::ContainerKind;
pub use claims::{ClaimLookup, ClaimSource, ClaimStore, Claims, NoClaims};
pub use gpuwarden_crds::exemptions::{glob_match, image_exempt};
pub use gpuwarden_crds::gpu::{
    ENV_MIG_CONFIG_DEVICES, ENV_MIG_MONITOR_DEVICES, ENV_VISIBLE_DEVICES, VisibleDevices,
    is_device_host_path,
};
pub use gpuwarden_crds::selection::{
    LABEL_NAMESPACE_NAME, NamespaceLabels, Selection, namespace_labels_or_default, select_policy,
};
pub use gpuwarden_crds::selector::Labels;
pub use gpuwarden_crds::vm::Requester;
pub use input::{ContainerRef, Input, Operation};
pub use plan::{NewClaim, Quantity};
pub use psa::{LABEL_PSA_ENFORCE, PsaLevel};
pub use render::MAX_WARNING_LEN;
pub use vm::{entry_denial, may_govern};
pub use void::{Unvoided, Voided};

pub use gpuwarden_crds::gpu::ENV_DRIVER_CAPABILITIES;
/// The command a denial message points users to.
pub const OFFLINE_COMMAND: &str = "gpuwarden-webhook mutate -f <manifest>";

/// One change to the pod, borrowed from a [`Decision`]. The patch is written from these;
/// nothing else is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Change<'c> {
    /// Rules 1 and 2: `privileged: false`, `capabilities.add` as given, and, when `drop_all`,
    /// `capabilities.drop: [ALL]` and `allowPrivilegeEscalation: false` (otherwise the
    /// container's `drop` and `allowPrivilegeEscalation` stay as they are).
    SecurityContext {
        /// The container.
        container: ContainerRef,
        /// `capabilities.add` after the rewrite.
        add: &'c [Cow<'c, str>],
        /// Whether `capabilities.drop` becomes `[ALL]` and `allowPrivilegeEscalation` false.
        drop_all: bool,
        /// Whether `seccompProfile` becomes `{type: RuntimeDefault}`.
        seccomp_default: bool,
    },
    /// Rule 3: `resources.limits[resource] = quantity`.
    GpuLimit {
        /// The container.
        container: ContainerRef,
        /// Extended resource name, e.g. `nvidia.com/gpu`.
        resource: &'c str,
        /// Quantity, written as a string.
        quantity: Quantity<'c>,
    },
    /// Rule 3 with `gpu.requestAs: ResourceClaim`: append `{name: claim}` to the container's
    /// `resources.claims`.
    ClaimUse {
        /// The container.
        container: ContainerRef,
        /// The pod `resourceClaims` entry.
        claim: &'c str,
    },
    /// Rule 3 with `gpu.requestAs: ResourceClaim`: append these `spec.resourceClaims`
    /// entries, each `{name, resourceClaimTemplateName}`.
    PodClaims {
        /// The entries.
        add: &'c [NewClaim],
    },
    /// Rule 4: remove these `env` entries (by index) and append this one.
    Env {
        /// The container.
        container: ContainerRef,
        /// Indices of entries to remove, ascending.
        remove: &'c [usize],
        /// An entry to append: name, value.
        append: Option<(&'c str, &'c str)>,
    },
    /// Rule 5: remove these `volumeMounts` entries (by index, ascending).
    VolumeMounts {
        /// The container.
        container: ContainerRef,
        /// Indices of entries to remove, ascending.
        remove: &'c [usize],
    },
    /// Rule 5: remove these `spec.volumes` entries (by index, ascending).
    Volumes {
        /// Indices of entries to remove, ascending.
        remove: &'c [usize],
    },
    /// Rule 5: remove these pod annotations.
    RemoveAnnotations {
        /// Annotation keys.
        keys: &'c [&'c str],
    },
    /// Rule 6 and Audit: set these pod annotations (the engine sets at most two: the report
    /// and the policy reference).
    SetAnnotations {
        /// Key, value.
        pairs: [Option<(&'c str, AnnotationValue<'c>)>; 2],
    },
}

/// A value the patch sets an annotation to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AnnotationValue<'c> {
    /// Text, as it is.
    Text(&'c str),
    /// What the rewrite does ([`Report`]).
    Report(Report<'c>),
}

/// The `gpuwarden.io/rewritten` (or `gpuwarden.io/audit`) annotation value of a decision:
/// JSON written from its plan when it is needed; the patch carries it as a string.
#[derive(Clone, Copy)]
pub struct Report<'c>(&'c Plan<'c>);

impl Report<'_> {
    /// The report as JSON text.
    pub fn to_json(&self) -> String {
        self.0.report()
    }
}

impl std::fmt::Debug for Report<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_json())
    }
}

impl PartialEq for Report<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.to_json() == other.to_json()
    }
}

/// Which of gpuwarden's rules a [`Finding`] falls under: the categories its reports name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rule {
    /// A privileged container of a pod with a GPU container loses its privilege, and a GPU
    /// container gets an explicit request (rules 1 to 3).
    PrivilegedGpu,
    /// A container that is not privileged names GPUs or host devices itself (runtime
    /// variables, device-list mounts), or the pod does (CDI or device-injection annotations,
    /// device hostPath volumes): the leak is closed (rules 4 and 5).
    Leak,
    /// A container that holds no GPU gets `NVIDIA_VISIBLE_DEVICES=void`, or one that holds a
    /// GPU resource loses its own `void` (the void rule).
    Void,
    /// What Enforce cannot rewrite and denies: a rewrite that would break the pod (do no
    /// harm), a count over the policy's limits, an annotation it cannot read.
    Denied,
    /// The governing policy is invalid, so the pod is denied (fail closed).
    InvalidPolicy,
    /// A privileged or GPU-naming ephemeral container is denied.
    Ephemeral,
}

impl Rule {
    /// The rule's name in reports (`rule` of a PolicyReport result).
    pub fn name(self) -> &'static str {
        match self {
            Self::PrivilegedGpu => "privileged-gpu",
            Self::Leak => "gpu-leak",
            Self::Void => "void",
            Self::Denied => "denied",
            Self::InvalidPolicy => "invalid-policy",
            Self::Ephemeral => "ephemeral-container",
        }
    }

    /// Whether a pod with this finding is refused (by Enforce or Deny), rather than changed.
    pub fn denies(self) -> bool {
        matches!(self, Self::Denied | Self::InvalidPolicy | Self::Ephemeral)
    }
}

/// One thing gpuwarden changes, would change or refuses in a pod, with the message the
/// webhook gives for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// The rule.
    pub rule: Rule,
    /// The container it is about; `None` for the pod as a whole.
    pub container: Option<String>,
    /// What happens and why, as the webhook's warning or denial says it (without the
    /// `gpuwarden: ` prefix, and not clipped).
    pub message: String,
}

/// What the engine decided about a pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// No policy selects the pod.
    NotGoverned,
    /// The governing policy exempts the pod (namespace, service account, or every privileged
    /// GPU container by image).
    Exempt,
    /// Governed, but nothing to do (no privileged GPU container).
    Unchanged,
    /// Enforce, nothing to rewrite, and containers that hold no GPU get
    /// `NVIDIA_VISIBLE_DEVICES=void` ([`Decision::voided`]).
    Voided,
    /// Enforce: the changes rewrite the pod.
    Rewritten,
    /// Audit: admitted; the changes only add the audit annotation.
    Audited,
    /// Rejected: [`Decision::denial`] says why.
    Denied,
}

/// The engine's answer for one pod, borrowing from the pod, the policy and the input. Its
/// changes, warnings, denial message and audit annotations are written on demand.
#[derive(Debug)]
pub struct Decision<'a> {
    verdict: Verdict,
    policy: Option<&'a GpuPolicy>,
    /// `name@generation` of the governing policy ("" when none governs).
    reference: String,
    /// How the pod is named in messages.
    display_name: &'a str,
    /// The pod's namespace.
    namespace: &'a str,
    /// The DaemonSet that runs the pod on every node, if any (the warnings name it).
    daemon_set: Option<&'a str>,
    detail: Detail<'a>,
    /// The containers the void rule holds for (Enforce: set; Audit: reported).
    voided: Vec<Voided<'a>>,
    /// Containers that hold a GPU resource and lose their `void` entries (Enforce).
    unvoided: Vec<Unvoided<'a>>,
    /// What the pod is to KAI-Scheduler's GPU sharing.
    kai: Kai,
    /// What the pod's device-injection annotations hand out that gpuwarden does not judge.
    notes: Vec<String>,
}

/// What an annotation the patch sets holds.
#[derive(Clone, Copy, Debug)]
enum Set {
    /// The report of what the rewrite does.
    Report,
    /// The governing policy's `name@generation`.
    Reference,
}

/// What a decision holds beyond its verdict.
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "a decision lives on the stack for one review; boxing the plan costs an allocation per rewrite"
)]
enum Detail<'a> {
    /// Nothing more.
    Plain,
    /// Why the pod is exempt.
    Exempt(Cow<'static, str>),
    /// A new pod with privileged GPU containers that its policy governs: what the rewrite
    /// does (Enforce), would do (Audit) or needs (Deny, or Enforce with denials).
    Create {
        plan: Plan<'a>,
        mode: PolicyMode,
        /// Annotations the patch sets: the report and the policy reference, unless the pod
        /// already carries them.
        set: [Option<(&'static str, Set)>; 2],
    },
    /// The governing policy is invalid, and the pod is one it would judge: why.
    Invalid(String),
    /// Privileged ephemeral containers added to a governed pod.
    Ephemeral {
        offending: Vec<&'a str>,
        mode: PolicyMode,
        /// The pod is a VM's: what its containers hold (docs/design.md, "No way into a VM's
        /// pod"). Every new ephemeral container is then offending.
        vm: Option<String>,
    },
}

/// What gpuwarden says of a pod that asks KAI-Scheduler for part of a GPU under a policy
/// that does not name KAI (docs/design.md, "GPU-sharing schedulers").
const KAI_FRACTION_HINT: &str = "KAI-Scheduler GPU fraction: Enforce denies its container once KAI's webhook gives it a GPU from a ConfigMap, unless the policy names KAI (gpu.sharing.kai; see docs/sharing.md)";

/// What gpuwarden says of such a pod before KAI's webhook ran, under a policy that names KAI.
const KAI_NAMED_NOTE: &str = "KAI-Scheduler GPU fraction: the policy names KAI (gpu.sharing.kai), so KAI's webhook replaces the void in its fraction container with KAI's grant, which the node agent holds to KAI's reservation";

/// Why such a pod was denied all the same.
const KAI_NAMED_DENIAL: &str = "KAI's grant is recognised only in KAI's fraction container, unprivileged and holding no GPU resource, reading NVIDIA_VISIBLE_DEVICES from KAI's ConfigMap (<prefix>-<index>), in a pod without nodeName";

pub use gpuwarden_crds::gpu::KIND_DAEMON_SET;

/// Judges one pod: selects the policy, applies exemptions and the policy's mode.
pub fn decide<'a>(input: &Input<'a>, policies: &'a [Arc<GpuPolicy>]) -> Decision<'a> {
    let no_labels = Map::new();
    let pod_labels = input
        .pod
        .metadata
        .as_ref()
        .and_then(|m| m.labels.as_ref())
        .unwrap_or(&no_labels);
    let selection = select_policy(policies, input.namespace_labels, pod_labels);
    let invalid = selection.invalid;
    match selection.policy {
        None => Decision::new(Verdict::NotGoverned, None, String::new(), input),
        Some(policy) => match input.operation {
            Operation::Create => decide_create(input, policy, invalid),
            Operation::AddEphemeral { old } => decide_ephemeral(input, old, policy, invalid),
        },
    }
}

/// Judges a new pod. Under an invalid policy (`invalid` says why) only its namespace and
/// service-account exemptions hold, and a pod it would judge is denied: it fails closed
/// (docs/design.md, "Policies").
fn decide_create<'a>(
    input: &Input<'a>,
    policy: &'a GpuPolicy,
    invalid: Option<String>,
) -> Decision<'a> {
    let reference = policy.reference();
    if let Some(reason) = facts::pod_exemption(input.pod, input.namespace, policy) {
        return Decision::new(Verdict::Exempt, Some(policy), reference, input)
            .with(Detail::Exempt(reason.into()));
    }
    let mut facts = facts::read_pod(input.pod, input.namespace, policy, input.claims);
    let vm_refusals = vm::refusals(input.pod, &facts.containers, input.requester, policy);
    facts.refusals.extend(vm_refusals);
    if let Some(decision) = carried_ephemeral(input, &facts, policy, &invalid) {
        return decision;
    }
    let triggered = (facts.containers.iter()).any(|c| c.offends(invalid.is_none()))
        || !facts.injections.uncovered.is_empty()
        || !facts.refusals.is_empty();
    // The API server's policy is rendered from valid policies in Enforce and Audit only.
    let voids =
        matches!(policy.spec.mode, PolicyMode::Enforce | PolicyMode::Audit) && invalid.is_none();
    if let Some(why) = invalid.filter(|_| triggered) {
        return Decision::new(Verdict::Denied, Some(policy), reference, input)
            .with(Detail::Invalid(why));
    }
    if !triggered {
        let (voided, unvoided) = void_rule(&facts, policy, voids, None);
        return untouched(input, &facts, policy, reference)
            .voiding(voided)
            .unvoiding(unvoided)
            .noting(facts.injections.notes.clone());
    }
    let mut plan = plan_rewrite(input, &facts, policy);
    let mut notes = facts.injections.notes.clone();
    notes.append(&mut plan.notes);
    let (voided, unvoided) = void_rule(&facts, policy, voids, Some(&plan));
    let mode = policy.spec.mode;
    let (verdict, set) = verdict_and_annotations(input, &plan, mode, &reference);
    Decision::new(verdict, Some(policy), reference, input)
        .with(Detail::Create { plan, mode, set })
        .voiding(voided)
        .unvoiding(unvoided)
        .noting(notes)
}

/// A pod the rules leave as it is: exempt where its offending containers' images are, else
/// unchanged.
fn untouched<'a>(
    input: &Input<'a>,
    facts: &facts::PodFacts<'a>,
    policy: &'a GpuPolicy,
    reference: String,
) -> Decision<'a> {
    let exempt = (facts.containers.iter()).any(|c| c.offends(false));
    if !exempt {
        return Decision::new(Verdict::Unchanged, Some(policy), reference, input);
    }
    let reason = format!(
        "every privileged or leaking GPU container has an image exempt in namespace {}",
        input.namespace
    );
    Decision::new(Verdict::Exempt, Some(policy), reference, input)
        .with(Detail::Exempt(reason.into()))
}

/// The void rule where the policy `voids`: the containers it holds for and those that lose
/// their `void` (Enforce only). In Enforce it holds for the pod as `plan`, the rewrite if
/// there is one, leaves it; Audit reports it for the pod as it is, as the API server's
/// warning does.
fn void_rule<'a>(
    facts: &facts::PodFacts<'a>,
    policy: &GpuPolicy,
    voids: bool,
    plan: Option<&Plan<'_>>,
) -> (Vec<Voided<'a>>, Vec<Unvoided<'a>>) {
    if !voids {
        return (Vec::new(), Vec::new());
    }
    let enforce = policy.spec.mode == PolicyMode::Enforce;
    let plan = plan.filter(|_| enforce);
    let voided = void::void_targets(facts, policy, plan);
    let unvoided = if enforce {
        void::unvoid_targets(facts, policy, plan)
    } else {
        Vec::new()
    };
    (voided, unvoided)
}

/// Plans the rewrite within the namespace's Pod Security level and, where it rewrites
/// (Enforce), names what the containers' start-up steps keep.
fn plan_rewrite<'a>(
    input: &Input<'a>,
    facts: &facts::PodFacts<'a>,
    policy: &'a GpuPolicy,
) -> Plan<'a> {
    let strip = plan::volumes_to_strip(facts, policy);
    let level = PsaLevel::enforced_by(input.namespace_labels);
    let mut plan = plan::plan_pod(input, facts, policy, strip, level);
    // Only a rewrite (Enforce) warns of what its start-up steps keep.
    if policy.spec.mode == PolicyMode::Enforce {
        let role = input.pod_label(gpuwarden_crds::start_up::LABEL_MPI_JOB_ROLE);
        plan.start_up = start_up::phrases(&plan, input.pod, role);
    }
    plan
}

/// The verdict on a planned pod under `mode`, and the annotations the patch sets: the
/// report, and in Enforce the policy's `reference`. The pod's own value of an annotation
/// counts: a pass over a pod already rewritten finds the report and the reference it set,
/// and sets nothing again.
fn verdict_and_annotations(
    input: &Input<'_>,
    plan: &Plan<'_>,
    mode: PolicyMode,
    reference: &str,
) -> (Verdict, [Option<(&'static str, Set)>; 2]) {
    let carried = |key| {
        input
            .pod
            .annotations()
            .and_then(|a| a.get(key))
            .and_then(Scalar::as_str)
    };
    let report_changed = |key| carried(key).is_none_or(|text| !plan.report_is(text));
    let mut set = [None, None];
    let verdict = match mode {
        PolicyMode::Enforce if !plan.denials.is_empty() => Verdict::Denied,
        PolicyMode::Enforce => {
            if report_changed(ANNOTATION_REWRITTEN) {
                set[0] = Some((ANNOTATION_REWRITTEN, Set::Report));
            }
            if carried(ANNOTATION_POLICY) != Some(reference) {
                set[1] = Some((ANNOTATION_POLICY, Set::Reference));
            }
            Verdict::Rewritten
        }
        PolicyMode::Audit => {
            if report_changed(ANNOTATION_AUDIT) {
                set[0] = Some((ANNOTATION_AUDIT, Set::Report));
            }
            Verdict::Audited
        }
        PolicyMode::Deny => Verdict::Denied,
    };
    (verdict, set)
}

fn decide_ephemeral<'a>(
    input: &Input<'a>,
    old: &PodView<'_>,
    policy: &'a GpuPolicy,
    invalid: Option<String>,
) -> Decision<'a> {
    let new = |verdict| Decision::new(verdict, Some(policy), policy.reference(), input);
    if let Some(reason) = facts::pod_exemption(input.pod, input.namespace, policy) {
        return new(Verdict::Exempt).with(Detail::Exempt(reason.into()));
    }
    // New ephemeral containers that are privileged or name GPUs themselves: they cannot
    // request GPUs, so they cannot be rewritten. In a VM's pod, every new one.
    let facts = facts::read_pod(input.pod, input.namespace, policy, input.claims);
    let vm = vm::entered(input.pod, &facts.containers, policy);
    let offending: Vec<&'a str> = (facts.containers.iter())
        .filter(|c| {
            void::added_by_update(c, old)
                && (vm.is_some() || ephemeral_offends(c, &facts, invalid.is_none()))
        })
        .map(|c| c.name)
        .collect();
    let mode = policy.spec.mode;
    if offending.is_empty() {
        // The void rule, as for a new pod: in Enforce the new containers get it, in Audit
        // they are named.
        let voids = matches!(mode, PolicyMode::Enforce | PolicyMode::Audit) && invalid.is_none();
        return new(Verdict::Unchanged).voiding(if voids {
            void::new_ephemeral_targets(&facts, policy, old)
        } else {
            Vec::new()
        });
    }
    if let Some(why) = invalid {
        return new(Verdict::Denied).with(Detail::Invalid(why));
    }
    let verdict = if mode == PolicyMode::Audit {
        Verdict::Audited
    } else {
        Verdict::Denied
    };
    new(verdict).with(Detail::Ephemeral {
        offending,
        mode,
        vm,
    })
}

/// A pod read offline may carry ephemeral containers (`kubectl get pod -o yaml` after
/// `kubectl debug`): they cannot request GPUs, so one that is privileged or names GPUs gets
/// the answer its `pods/ephemeralcontainers` update got, rather than a rewrite.
fn carried_ephemeral<'a>(
    input: &Input<'a>,
    facts: &facts::PodFacts<'a>,
    policy: &'a GpuPolicy,
    invalid: &Option<String>,
) -> Option<Decision<'a>> {
    let offending: Vec<&'a str> = (facts.containers.iter())
        .filter(|c| ephemeral_offends(c, facts, invalid.is_none()))
        .map(|c| c.name)
        .collect();
    if offending.is_empty() {
        return None;
    }
    let new = |verdict| Decision::new(verdict, Some(policy), policy.reference(), input);
    let mode = policy.spec.mode;
    Some(match invalid {
        Some(why) => new(Verdict::Denied).with(Detail::Invalid(why.clone())),
        None if mode == PolicyMode::Audit => new(Verdict::Audited).with(Detail::Ephemeral {
            offending,
            mode,
            vm: None,
        }),
        None => new(Verdict::Denied).with(Detail::Ephemeral {
            offending,
            mode,
            vm: None,
        }),
    })
}

/// Whether `c` is an ephemeral container that cannot be admitted: privileged, naming GPUs
/// itself, or reached by a device-injection annotation that names devices the pod does not
/// hold (it gets what the annotation names); its image exempts it unless `images_count` is
/// false (an invalid policy).
fn ephemeral_offends(
    c: &facts::ContainerFacts<'_>,
    facts: &facts::PodFacts<'_>,
    images_count: bool,
) -> bool {
    let injected = (facts.injections.uncovered.iter()).any(|u| u.reaches(c.name));
    c.at.kind == ContainerKind::Ephemeral
        && (c.privileged || c.signals.leaks() || injected)
        && (!images_count || !c.image_exempt)
}

impl<'a> Decision<'a> {
    fn new(
        verdict: Verdict,
        policy: Option<&'a GpuPolicy>,
        reference: String,
        input: &Input<'a>,
    ) -> Self {
        Self {
            verdict,
            policy,
            reference,
            display_name: input.display_name,
            namespace: input.namespace,
            daemon_set: input.daemon_set(),
            kai: Kai::of(input.pod, policy),
            detail: Detail::Plain,
            voided: Vec::new(),
            unvoided: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// Sets the notes on what the pod's device-injection annotations hand out that the rules
    /// do not judge.
    fn noting(mut self, notes: Vec<String>) -> Self {
        self.notes = notes;
        self
    }

    /// Sets the containers the void rule holds for; an unchanged pod in Enforce mode is then
    /// [`Verdict::Voided`].
    fn voiding(mut self, voided: Vec<Voided<'a>>) -> Self {
        let enforce = self
            .policy
            .is_some_and(|p| p.spec.mode == PolicyMode::Enforce);
        if enforce && self.verdict == Verdict::Unchanged && !voided.is_empty() {
            self.verdict = Verdict::Voided;
        }
        self.voided = voided;
        self
    }

    /// Sets the containers that hold a GPU resource and lose their `void` entries; an
    /// unchanged pod is then [`Verdict::Voided`].
    fn unvoiding(mut self, unvoided: Vec<Unvoided<'a>>) -> Self {
        if self.verdict == Verdict::Unchanged && !unvoided.is_empty() {
            self.verdict = Verdict::Voided;
        }
        self.unvoided = unvoided;
        self
    }

    /// The containers that hold a GPU resource and lose their `NVIDIA_VISIBLE_DEVICES=void`
    /// entries (Enforce).
    pub fn unvoided(&self) -> &[Unvoided<'a>] {
        &self.unvoided
    }

    /// The containers that get (Enforce) or would get (Audit) `NVIDIA_VISIBLE_DEVICES=void`.
    pub fn voided(&self) -> &[Voided<'a>] {
        &self.voided
    }

    /// Whether the void rule's changes go into the patch.
    fn sets_void(&self) -> bool {
        self.policy
            .is_some_and(|p| p.spec.mode == PolicyMode::Enforce)
            && matches!(
                self.verdict,
                Verdict::Rewritten | Verdict::Voided | Verdict::Exempt
            )
    }

    fn with(mut self, detail: Detail<'a>) -> Self {
        self.detail = detail;
        self
    }

    /// The verdict.
    pub fn verdict(&self) -> Verdict {
        self.verdict
    }

    /// The governing policy, if any.
    pub fn policy(&self) -> Option<&'a GpuPolicy> {
        self.policy
    }

    /// `name@generation` of the governing policy, if any.
    pub fn policy_reference(&self) -> Option<&str> {
        self.policy.map(|_| self.reference.as_str())
    }

    /// [`Decision::policy_reference`], taken out of the decision.
    pub fn into_policy_reference(self) -> Option<String> {
        self.policy.map(|_| self.reference)
    }

    /// Why the pod is exempt, when it is.
    pub fn exempt_reason(&self) -> Option<&str> {
        match &self.detail {
            Detail::Exempt(reason) => Some(reason),
            _ => None,
        }
    }

    /// The changes to apply: the rewrite in Enforce, the audit annotation in Audit, none
    /// otherwise.
    pub fn changes(&self) -> Changes<'_> {
        let (plan, set) = match (&self.detail, self.verdict) {
            (Detail::Create { plan, set, .. }, Verdict::Rewritten | Verdict::Audited) => {
                (Some(plan), set)
            }
            _ => (None, &[None, None]),
        };
        let value = |what: &Set| match what {
            Set::Reference => AnnotationValue::Text(&self.reference),
            // A set report implies a plan.
            Set::Report => plan.map_or(AnnotationValue::Text(""), |plan| {
                AnnotationValue::Report(Report(plan))
            }),
        };
        Changes {
            plan: plan.filter(|_| self.verdict == Verdict::Rewritten),
            voided: if self.sets_void() { &self.voided } else { &[] },
            unvoided: if self.sets_void() {
                &self.unvoided
            } else {
                &[]
            },
            set: set.map(|pair| pair.map(|(key, what)| (key, value(&what)))),
            step: Step::Container(0, 0),
        }
    }

    /// The warnings for the user, in order: one per changed container and one for the pod
    /// (Enforce and Audit), then what Enforce would deny (Audit). Each is clipped to
    /// [`MAX_WARNING_LEN`].
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        match (&self.detail, self.verdict) {
            (Detail::Create { plan, .. }, Verdict::Rewritten) => {
                plan.push_warnings("gpuwarden: ", ": ", &mut warnings);
                warnings.extend(plan.strict_warning());
                // Word for word what the API server's start-up policy says of the stored pod
                // (docs/design.md, "What a rewritten container keeps").
                warnings.extend(
                    (plan.start_up.iter())
                        .map(|s| format!("{}{s}", gpuwarden_crds::start_up::WARNING_PREFIX)),
                );
            }
            (Detail::Create { plan, .. }, Verdict::Audited) => {
                plan.push_warnings("gpuwarden audit: ", " would change: ", &mut warnings);
                warnings.extend(
                    (plan.denials.iter())
                        .map(|denial| format!("gpuwarden audit: Enforce would deny: {denial}")),
                );
            }
            (Detail::Ephemeral { offending, vm, .. }, Verdict::Audited) => {
                warnings.push(match vm {
                    Some(held) => format!(
                        "gpuwarden audit: ephemeral container {} would be denied by GpuPolicy {}: the pod is a VM's ({held}), and {}",
                        offending.join(", "),
                        self.reference,
                        gpuwarden_crds::vm::NO_ENTRY_REASON
                    ),
                    None => format!(
                        "gpuwarden audit: ephemeral container {} would be denied by GpuPolicy {}: privileged or naming GPUs itself, it reaches GPUs the kubelet never allocated",
                        offending.join(", "),
                        self.reference
                    ),
                })
            }
            _ => {}
        }
        self.push_void_warnings(&mut warnings);
        warnings.extend(self.notes.iter().map(|n| format!("gpuwarden: {n}")));
        let said = matches!(self.verdict, Verdict::Exempt | Verdict::Denied);
        match self.kai {
            Kai::Unnamed if !said => warnings.push(format!("gpuwarden: {KAI_FRACTION_HINT}")),
            // Before KAI's webhook: its fraction container was voided with the rest.
            Kai::Named if !said && self.verdict != Verdict::Unchanged => {
                warnings.push(format!("gpuwarden: {KAI_NAMED_NOTE}"));
            }
            _ => {}
        }
        warnings.iter_mut().for_each(render::clip);
        warnings
    }

    /// What the decision changes, would change or refuses, one [`Finding`] per container and
    /// rule, then the pod's: the rewrite's (Enforce), what Audit would change or Deny
    /// requires, what Enforce denies, the void rule's, an invalid policy, privileged
    /// ephemeral containers. Empty for a pod that is not governed, exempt or needs nothing.
    pub fn findings(&self) -> Vec<Finding> {
        let mut out = Vec::new();
        match &self.detail {
            Detail::Create { plan, .. }
                if matches!(
                    self.verdict,
                    Verdict::Rewritten | Verdict::Audited | Verdict::Denied
                ) =>
            {
                let mut messages = Vec::new();
                plan.push_warnings("", ": ", &mut messages);
                let mut messages = messages.into_iter();
                for (c, message) in plan.containers.iter().zip(messages.by_ref()) {
                    out.push(Finding {
                        rule: if c.deprivileged {
                            Rule::PrivilegedGpu
                        } else {
                            Rule::Leak
                        },
                        container: Some(c.name.to_owned()),
                        message,
                    });
                }
                // What is left is the pod's own line.
                out.extend(messages.map(|message| Finding {
                    rule: Rule::Leak,
                    container: None,
                    message,
                }));
                out.extend(plan.denials.iter().map(|denial| Finding {
                    rule: Rule::Denied,
                    container: None,
                    message: denial.clone(),
                }));
            }
            Detail::Invalid(_) => out.push(Finding {
                rule: Rule::InvalidPolicy,
                container: None,
                message: self.denial().map(unprefixed).unwrap_or_default(),
            }),
            Detail::Ephemeral { offending, .. } => {
                let message = (self.denial())
                    .or_else(|| self.warnings().into_iter().next())
                    .map(unprefixed)
                    .unwrap_or_default();
                out.extend(offending.iter().map(|name| Finding {
                    rule: Rule::Ephemeral,
                    container: Some((*name).to_owned()),
                    message: message.clone(),
                }));
            }
            _ => {}
        }
        self.push_void_findings(&mut out);
        out
    }

    /// The void rule's findings, where its warnings are given.
    fn push_void_findings(&self, out: &mut Vec<Finding>) {
        let Some(policy) = self.policy else { return };
        let enforce = self.sets_void();
        if !enforce && (policy.spec.mode != PolicyMode::Audit || self.verdict == Verdict::Denied) {
            return;
        }
        if enforce {
            out.extend(self.unvoided.iter().map(|u| Finding {
                rule: Rule::Void,
                container: Some(u.name.to_owned()),
                message: format!(
                    "{}: NVIDIA_VISIBLE_DEVICES=void removed, as it holds {}: the entry would hide the GPUs the kubelet allocates",
                    u.name, u.resource
                ),
            }));
        }
        let how = if enforce { "" } else { " in Enforce" };
        out.extend(self.voided.iter().map(|v| Finding {
            rule: Rule::Void,
            container: Some(v.name.to_owned()),
            message: if v.claims {
                format!(
                    "{}: NVIDIA_VISIBLE_DEVICES=void{how}; what its ResourceClaims hold comes through CDI, not this variable",
                    v.name
                )
            } else {
                format!(
                    "{}: NVIDIA_VISIBLE_DEVICES=void{how}, as it holds no GPU (an image's own value would hand it every GPU of the node)",
                    v.name
                )
            },
        }));
    }

    /// The void rule's warnings: which containers get (Enforce) or would get (Audit)
    /// `NVIDIA_VISIBLE_DEVICES=void` and why; for a DaemonSet's pod, the exemption a node agent
    /// that reads every GPU needs, since the rule holds whatever the pod's owner.
    fn push_void_warnings(&self, warnings: &mut Vec<String>) {
        let Some(policy) = self.policy else { return };
        let enforce = self.sets_void();
        if !enforce && (policy.spec.mode != PolicyMode::Audit || self.verdict == Verdict::Denied) {
            return;
        }
        let names = |claims: bool| {
            let names: Vec<&str> = (self.voided.iter())
                .filter(|v| v.claims == claims)
                .map(|v| v.name)
                .collect();
            (!names.is_empty()).then(|| names.join(", "))
        };
        if enforce {
            for u in &self.unvoided {
                warnings.push(format!(
                    "gpuwarden: {}: NVIDIA_VISIBLE_DEVICES=void removed, as it holds {}: the entry would hide the GPUs the kubelet allocates",
                    u.name, u.resource
                ));
            }
        }
        let (no_gpu, claims) = (names(false), names(true));
        if let Some(names) = no_gpu {
            warnings.push(if enforce {
                format!(
                    "gpuwarden: {names}: NVIDIA_VISIBLE_DEVICES=void, as they hold no GPU (an image's own value would hand them every GPU of the node)"
                )
            } else {
                format!(
                    "gpuwarden audit: {names} would get NVIDIA_VISIBLE_DEVICES=void in Enforce: they hold no GPU"
                )
            });
        }
        if let Some(names) = claims {
            let how = "what their ResourceClaims hold comes through CDI, not this variable (NVIDIA's DRA driver sets it to void too)";
            warnings.push(if enforce {
                format!("gpuwarden: {names}: NVIDIA_VISIBLE_DEVICES=void; {how}")
            } else {
                format!(
                    "gpuwarden audit: {names} would get NVIDIA_VISIBLE_DEVICES=void in Enforce; {how}"
                )
            });
        }
        if let Some(daemon_set) = self.daemon_set.filter(|_| !self.voided.is_empty()) {
            let mut images: Vec<&str> = Vec::new();
            for v in &self.voided {
                if !images.contains(&v.image) {
                    images.push(v.image);
                }
            }
            // Kept under the warning's length: the exemption is what the reader needs.
            let hint = format!(
                "if it reads GPUs, add to GpuPolicy {} exemptions.containers: images [{}], namespaces [{}]",
                policy.metadata.name.as_deref().unwrap_or_default(),
                images.join(", "),
                self.namespace
            );
            warnings.push(if enforce {
                format!(
                    "gpuwarden: DaemonSet {daemon_set} runs with NVIDIA_VISIBLE_DEVICES=void; {hint}"
                )
            } else {
                format!(
                    "gpuwarden audit: DaemonSet {daemon_set} would run with NVIDIA_VISIBLE_DEVICES=void in Enforce; {hint}"
                )
            });
        }
    }

    /// Why the pod is rejected, when the verdict is [`Verdict::Denied`].
    pub fn denial(&self) -> Option<String> {
        if self.verdict != Verdict::Denied {
            return None;
        }
        let (name, reference) = (self.display_name, &self.reference);
        match &self.detail {
            Detail::Create {
                plan,
                mode: PolicyMode::Deny,
                ..
            } => {
                let mut message = format!(
                    "gpuwarden: pod {name} has privileged GPU containers, which GpuPolicy {reference} (Deny) rejects. To be admitted it needs: "
                );
                plan.write_summary(&mut message);
                if !plan.denials.is_empty() {
                    message.push_str(". It also cannot be rewritten as is: ");
                    message.push_str(&plan.denials.join("; "));
                }
                message.push_str(". `");
                message.push_str(OFFLINE_COMMAND);
                message.push_str("` writes the admissible manifest.");
                Some(message)
            }
            Detail::Create { plan, .. } => {
                let mut message = format!(
                    "gpuwarden: pod {name} is denied by GpuPolicy {reference} (Enforce): {}",
                    plan.denials.join("; ")
                );
                match self.kai {
                    Kai::Unnamed => message.push_str(&format!(". {KAI_FRACTION_HINT}")),
                    Kai::Named => message.push_str(&format!(". {KAI_NAMED_DENIAL}")),
                    Kai::No => {}
                }
                Some(message)
            }
            Detail::Ephemeral {
                offending,
                mode,
                vm: Some(held),
            } => Some(format!(
                "gpuwarden: ephemeral container {} on pod {name} is denied by GpuPolicy {reference} ({mode}): the pod is a VM's ({held}), and {}",
                offending.join(", "),
                gpuwarden_crds::vm::NO_ENTRY_REASON
            )),
            Detail::Ephemeral {
                offending, mode, ..
            } => Some(format!(
                "gpuwarden: ephemeral container {} on pod {name} is denied by GpuPolicy {reference} ({mode}): privileged or naming GPUs itself (NVIDIA_VISIBLE_DEVICES, a device-list mount), it reaches GPUs the kubelet never allocated, and ephemeral containers cannot request GPUs; use an unprivileged debug profile such as `kubectl debug --profile=general` without NVIDIA_VISIBLE_DEVICES",
                offending.join(", "),
            )),
            Detail::Invalid(why) => Some(format!(
                "gpuwarden: pod {name} is denied: {why}. gpuwarden fails closed until the policy is fixed; `kubectl get gpupolicies -o wide` shows each policy's Ready reason"
            )),
            Detail::Plain | Detail::Exempt(_) => None,
        }
    }

    /// The audit annotations for the API server's audit log: `changes` (what the rewrite
    /// does), `decision`, `exempt` (why), `policy`, `reason` (why Enforce denies).
    pub fn audit_annotations(&self) -> BTreeMap<&'static str, String> {
        let decision = match self.verdict {
            Verdict::Rewritten => "rewritten",
            Verdict::Audited => "audited",
            _ => "denied",
        };
        let mut annotations = BTreeMap::new();
        match &self.detail {
            Detail::Plain => {}
            Detail::Exempt(reason) => {
                annotations.insert("exempt", reason.to_string());
            }
            Detail::Create { plan, mode, .. } => {
                let denied_in_enforce = *mode == PolicyMode::Enforce && !plan.denials.is_empty();
                if denied_in_enforce {
                    annotations.insert("reason", plan.denials.join("; "));
                } else {
                    let mut summary = String::new();
                    plan.write_summary(&mut summary);
                    annotations.insert("changes", summary);
                }
                annotations.insert("decision", decision.to_owned());
                annotations.insert("policy", self.reference.to_string());
            }
            Detail::Ephemeral { .. } => {
                annotations.insert("decision", decision.to_owned());
                annotations.insert("policy", self.reference.to_string());
            }
            Detail::Invalid(why) => {
                annotations.insert("decision", decision.to_owned());
                annotations.insert("policy", self.reference.to_string());
                annotations.insert("reason", why.clone());
            }
        }
        annotations
    }
}

/// A message without the `gpuwarden: ` prefix a warning or denial starts with.
fn unprefixed(message: String) -> String {
    match message.strip_prefix("gpuwarden: ") {
        Some(rest) => rest.to_owned(),
        None => message,
    }
}

/// The changes of a [`Decision`], in the order the patch applies them: per container
/// (in the pod's order) its security context, GPU limit or claim, environment and mounts;
/// then the pod's claims, volumes, annotations removed and annotations set.
#[derive(Clone, Debug)]
pub struct Changes<'c> {
    /// The plan whose container and pod changes go into the patch (Enforce only).
    plan: Option<&'c Plan<'c>>,
    /// The containers that get `NVIDIA_VISIBLE_DEVICES=void`.
    voided: &'c [Voided<'c>],
    /// The containers that lose their `void` entries.
    unvoided: &'c [Unvoided<'c>],
    set: [Option<(&'c str, AnnotationValue<'c>)>; 2],
    step: Step,
}

/// Where [`Changes`] is: a container and which of its changes is next, or a pod-level one.
#[derive(Clone, Copy, Debug)]
enum Step {
    Container(usize, u8),
    Void(usize),
    Unvoid(usize),
    PodClaims,
    Volumes,
    RemoveAnnotations,
    SetAnnotations,
    Done,
}

impl<'c> Iterator for Changes<'c> {
    type Item = Change<'c>;

    fn next(&mut self) -> Option<Change<'c>> {
        loop {
            let plan = self.plan;
            let (step, change) = match self.step {
                Step::Container(index, part) => match plan.and_then(|p| p.containers.get(index)) {
                    Some(c) => {
                        let next = if part == 4 {
                            Step::Container(index + 1, 0)
                        } else {
                            Step::Container(index, part + 1)
                        };
                        (next, container_change(plan?, c, part))
                    }
                    None => (Step::Void(0), None),
                },
                Step::Void(k) => match self.voided.get(k) {
                    Some(v) => (
                        Step::Void(k + 1),
                        Some(Change::Env {
                            container: v.at,
                            remove: &[],
                            append: Some((ENV_VISIBLE_DEVICES, gpuwarden_crds::gpu::VOID)),
                        }),
                    ),
                    None => (Step::Unvoid(0), None),
                },
                Step::Unvoid(k) => match self.unvoided.get(k) {
                    Some(u) => (
                        Step::Unvoid(k + 1),
                        Some(Change::Env {
                            container: u.at,
                            remove: &u.entries,
                            append: None,
                        }),
                    ),
                    None => (Step::PodClaims, None),
                },
                Step::PodClaims => (
                    Step::Volumes,
                    plan.filter(|p| !p.claims.is_empty())
                        .map(|p| Change::PodClaims { add: &p.claims }),
                ),
                Step::Volumes => (
                    Step::RemoveAnnotations,
                    plan.filter(|p| !p.volumes.is_empty())
                        .map(|p| Change::Volumes { remove: &p.volumes }),
                ),
                Step::RemoveAnnotations => (
                    Step::SetAnnotations,
                    plan.filter(|p| !p.annotations_removed.is_empty()).map(|p| {
                        Change::RemoveAnnotations {
                            keys: &p.annotations_removed,
                        }
                    }),
                ),
                Step::SetAnnotations => (
                    Step::Done,
                    self.set
                        .iter()
                        .any(Option::is_some)
                        .then_some(Change::SetAnnotations { pairs: self.set }),
                ),
                Step::Done => return None,
            };
            self.step = step;
            if change.is_some() {
                return change;
            }
        }
    }
}

/// Change number `part` (0 to 4) of a container, if it has that one.
fn container_change<'c>(
    plan: &'c Plan<'_>,
    c: &'c ContainerPlan<'_>,
    part: u8,
) -> Option<Change<'c>> {
    let container = c.at;
    match part {
        0 => c.deprivileged.then_some(Change::SecurityContext {
            container,
            add: &c.caps_added,
            drop_all: c.drop_all,
            seccomp_default: c.seccomp_default,
        }),
        1 => c.limit.as_ref().map(|limit| Change::GpuLimit {
            container,
            resource: limit.resource,
            quantity: limit.quantity,
        }),
        2 => (c.claim.as_ref()).map(|claim| Change::ClaimUse {
            container,
            claim: &plan.claims[claim.index].name,
        }),
        3 => c.env.as_ref().map(|env| Change::Env {
            container,
            remove: &env.remove,
            append: env
                .set
                .as_ref()
                .filter(|_| env.append)
                .map(|(name, value)| (*name, plan.env_value(value))),
        }),
        _ => (!c.mounts.is_empty()).then_some(Change::VolumeMounts {
            container,
            remove: &c.mounts,
        }),
    }
}

// ---------------------------------------------------------------------------------------
// Reading values.

/// The container `at` points to in `pod`.
pub(crate) fn container_value<'p, 'a>(
    pod: &'p PodView<'a>,
    at: &ContainerRef,
) -> Option<&'p crate::pod::Container<'a>> {
    pod.containers(at.kind).get(at.index)
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    #[test]
    fn capability_names_are_normalised() {
        for (raw, normal, borrowed) in [
            ("SYS_ADMIN", "SYS_ADMIN", true),
            (" CAP_IPC_LOCK ", "IPC_LOCK", true),
            ("cap_sys_nice", "SYS_NICE", false),
            ("Cap_Net_Raw", "NET_RAW", false),
            ("net_admin", "NET_ADMIN", false),
            ("CAP_", "", true),
        ] {
            let cap = plan::normalise_cap(raw);
            assert_eq!(cap, normal, "{raw:?}");
            assert_eq!(matches!(cap, Cow::Borrowed(_)), borrowed, "{raw:?}");
        }
    }

    #[test]
    fn warnings_are_clipped_on_char_boundaries() {
        let mut text = "é".repeat(300);
        render::clip(&mut text);
        assert!(text.len() <= MAX_WARNING_LEN);
        assert!(text.ends_with("..."));
        let mut short = "short".to_owned();
        render::clip(&mut short);
        assert_eq!(short, "short");
    }

    /// The decision for `pod` (a Pod as JSON) in namespace `ml` under `policy`.
    fn decision_of<'a>(
        view: &'a PodView<'a>,
        labels: &'a BTreeMap<String, String>,
        policies: &'a [Arc<GpuPolicy>],
    ) -> Decision<'a> {
        let input = Input {
            pod: view,
            namespace: "ml",
            namespace_labels: labels,
            operation: Operation::Create,
            display_name: "ml/p",
            claims: &NoClaims("no claims here"),
            owner_kind: None,
            requester: Requester::Unknown,
        };
        decide(&input, policies)
    }

    #[test]
    fn the_report_says_per_container_what_changed_as_json() {
        // An init container that asks for capabilities, one allowed and one not; a container
        // whose name needs escaping, with a GPU request copied into its limit, a device
        // mount and a MIG variable; a privileged sidecar; a repeated name.
        let pod = json!({
            "metadata": {"name": "p", "annotations": {"cdi.k8s.io/gpu": "nvidia.com/gpu=0"}},
            "spec": {
                "volumes": [{"name": "dev", "hostPath": {"path": "/dev/nvidia0"}}],
                "initContainers": [{
                    "name": "setup", "securityContext": {"privileged": true,
                        "capabilities": {"add": ["cap_ipc_lock", "SYS_ADMIN"]}},
                    "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,1"}]
                }],
                "containers": [
                    {"name": "trainer \"a\"", "securityContext": {"privileged": true},
                     "resources": {"requests": {"nvidia.com/gpu": 2}},
                     "env": [{"name": "NVIDIA_MIG_CONFIG_DEVICES", "value": "all"}],
                     "volumeMounts": [{"name": "dev", "mountPath": "/dev/nvidia0"}]},
                    {"name": "side", "securityContext": {"privileged": true}},
                    {"name": "side", "securityContext": {"privileged": true},
                     "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]}
                ]
            }
        });
        let mut policy = GpuPolicy::default_policy();
        policy.spec.capabilities.default = vec!["SYS_NICE".into()];
        let policies = [Arc::new(policy)];
        let labels = namespace_labels_or_default("ml", None);
        let view = PodView::from_value(&pod);
        let decision = decision_of(&view, &labels, &policies);
        assert_eq!(decision.verdict(), Verdict::Rewritten);
        let Some(Change::SetAnnotations { pairs }) = decision.changes().last() else {
            panic!("no annotations set: {decision:?}");
        };
        let [
            Some((ANNOTATION_REWRITTEN, AnnotationValue::Report(report))),
            Some((ANNOTATION_POLICY, AnnotationValue::Text("default@0"))),
        ] = pairs
        else {
            panic!("not the report and the reference: {pairs:?}");
        };
        let report: Value = serde_json::from_str(&report.to_json()).unwrap();
        assert_eq!(
            report,
            json!({
                "containers": {
                    "setup": {
                        "kind": "init", "privileged": false, "gpu": true,
                        "capabilitiesAdded": ["SYS_NICE", "IPC_LOCK"],
                        "capabilitiesRefused": ["SYS_ADMIN"],
                        "limits": {"nvidia.com/gpu": "2"},
                        "gpuCountFrom": "NVIDIA_VISIBLE_DEVICES=0,1",
                        "envRemoved": ["NVIDIA_VISIBLE_DEVICES"],
                        "envSet": {"NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}
                    },
                    "side": {
                        "privileged": false, "gpu": true,
                        "capabilitiesAdded": ["SYS_NICE"],
                        "limits": {"nvidia.com/gpu": "1"},
                        "gpuCountFrom": "policy default, GPU by an NVIDIA CDI annotation",
                        "envRemoved": ["NVIDIA_VISIBLE_DEVICES"],
                        "envSet": {"NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}
                    },
                    "trainer \"a\"": {
                        "privileged": false, "gpu": true,
                        "capabilitiesAdded": ["SYS_NICE"],
                        "limits": {"nvidia.com/gpu": "2"},
                        "gpuCountFrom": "request",
                        "envRemoved": ["NVIDIA_MIG_CONFIG_DEVICES"],
                        "envSet": {"NVIDIA_DRIVER_CAPABILITIES": "compute,utility"},
                        "volumeMountsRemoved": ["dev"]
                    }
                },
                "volumesRemoved": ["dev"],
                "annotationsRemoved": ["cdi.k8s.io/gpu"]
            })
        );
        // Every container holds a GPU through the CDI annotation, so the second `side`,
        // whose report wins, loses its `void`. The summary says what the report says, in the
        // pod's order.
        let annotations = decision.audit_annotations();
        assert_eq!(
            annotations["changes"],
            "init container setup: privileged removed, capabilities SYS_ADMIN dropped (not allowed), requests nvidia.com/gpu=2 (NVIDIA_VISIBLE_DEVICES=0,1), env NVIDIA_VISIBLE_DEVICES removed, NVIDIA_DRIVER_CAPABILITIES=compute,utility; container trainer \"a\": privileged removed, limits nvidia.com/gpu=2 (from its request), env NVIDIA_MIG_CONFIG_DEVICES removed, NVIDIA_DRIVER_CAPABILITIES=compute,utility, device mount dev (/dev/nvidia0) removed; container side: privileged removed, requests nvidia.com/gpu=1 (policy default, GPU by an NVIDIA CDI annotation), NVIDIA_DRIVER_CAPABILITIES=compute,utility; container side: privileged removed, requests nvidia.com/gpu=1 (policy default, GPU by an NVIDIA CDI annotation), env NVIDIA_VISIBLE_DEVICES removed, NVIDIA_DRIVER_CAPABILITIES=compute,utility; pod: device hostPath volume dev removed, annotation cdi.k8s.io/gpu removed"
        );
        assert_eq!(annotations["decision"], "rewritten");
        assert_eq!(decision.warnings().len(), 5, "{:?}", decision.warnings());
    }

    #[test]
    fn the_report_is_not_set_again_when_the_pod_already_carries_it() {
        let mut pod = json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c", "securityContext": {"privileged": true},
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}
        });
        let policies = [Arc::new(GpuPolicy::default_policy())];
        let labels = namespace_labels_or_default("ml", None);
        let view = PodView::from_value(&pod);
        let decision = decision_of(&view, &labels, &policies);
        let Some(Change::SetAnnotations { pairs }) = decision.changes().last() else {
            panic!("no annotations set");
        };
        let Some((_, AnnotationValue::Report(report))) = pairs[0] else {
            panic!("no report set: {pairs:?}");
        };
        let report = report.to_json();
        pod["metadata"]["annotations"] = json!({
            ANNOTATION_REWRITTEN: report,
            ANNOTATION_POLICY: "default@0"
        });
        let view = PodView::from_value(&pod);
        let decision = decision_of(&view, &labels, &policies);
        assert!(
            !decision
                .changes()
                .any(|c| matches!(c, Change::SetAnnotations { .. })),
            "{decision:?}"
        );
    }
}
