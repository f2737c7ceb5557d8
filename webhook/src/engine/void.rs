//! The void rule (docs/design.md, "Inside the API server"): in Enforce mode, every init and
//! regular container that holds no GPU gets `NVIDIA_VISIBLE_DEVICES=void`, which overrides
//! the image's own value; and one that holds a GPU resource loses the `void` entries it has,
//! which would hide the GPUs the kubelet allocates (another webhook gave it the resource
//! after gpuwarden voided it: HAMi's, for a container that asked for `nvidia.com/gpumem`). The API server applies the same rule by a MutatingAdmissionPolicy
//! rendered from the policy ([`gpuwarden_crds::admission::policies`]); both read the same raw
//! fields, so that the rule never depends on what CEL cannot compute.

use gpuwarden_crds::GpuPolicy;
use gpuwarden_crds::gpu::{
    ContainerSpec, DEVICE_LIST_MARK, ENV_VISIBLE_DEVICES, Rules, VOID, spelled_by_prefix,
};

use super::facts::{ContainerFacts, PodFacts};
use super::input::ContainerRef;
use super::plan::Plan;
use crate::pod::{Container, ContainerKind, PodView, Scalar};

/// A container the void rule holds for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Voided<'a> {
    /// Where it is.
    pub at: ContainerRef,
    /// Its name.
    pub name: &'a str,
    /// Its image, as written.
    pub image: &'a str,
    /// It holds resource claims: what they give comes through CDI, not the variable.
    pub claims: bool,
}

/// A container that holds a GPU resource and `NVIDIA_VISIBLE_DEVICES=void` entries, which the
/// rule removes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unvoided<'a> {
    /// Where it is.
    pub at: ContainerRef,
    /// Its name.
    pub name: &'a str,
    /// The GPU resource it holds.
    pub resource: &'a str,
    /// Indices of its `void` entries, ascending.
    pub entries: Vec<usize>,
}

/// The init and regular containers of a pod that `policy` governs (not exempt as a whole)
/// which hold a GPU resource (a limit other than `0`) beside `NVIDIA_VISIBLE_DEVICES=void`
/// entries of their own, in the pod as `plan` leaves it (a container the rewrite changes
/// is the rewrite's). The variable in the pod's env overrides what the device plugin sets,
/// so `void` there hides the GPUs the kubelet allocated; removing it hands the container
/// nothing beyond them. The API server's policy runs once, before other webhooks, so this is
/// the webhook's: it runs again when another webhook changed the pod.
pub(super) fn unvoid_targets<'a>(
    facts: &PodFacts<'a>,
    policy: &GpuPolicy,
    plan: Option<&Plan<'_>>,
) -> Vec<Unvoided<'a>> {
    if !applies(facts, policy, plan) {
        return Vec::new();
    }
    let rules = Rules::of(policy);
    let mut out = Vec::new();
    for c in &facts.containers {
        if c.at.kind == ContainerKind::Ephemeral || c.image_exempt {
            continue;
        }
        if plan.is_some() && c.changes() {
            continue;
        }
        let limits = (c.value.resources.as_ref()).and_then(|r| r.limits.as_ref());
        let held = (limits.into_iter().flat_map(|l| l.iter()))
            .find(|(name, q)| rules.is_gpu_resource(name) && !zero(q));
        let Some((resource, _)) = held else { continue };
        let entries: Vec<usize> = (c.value.env_entries().enumerate())
            .filter(|(_, e)| e.name == ENV_VISIBLE_DEVICES && e.value == Some(VOID))
            .map(|(i, _)| i)
            .collect();
        if !entries.is_empty() {
            out.push(Unvoided {
                at: c.at,
                name: c.name,
                resource: resource.as_ref(),
                entries,
            });
        }
    }
    out
}

/// Whether a quantity is written as zero (`"0"`, or the number 0).
fn zero(quantity: &Scalar<'_>) -> bool {
    match quantity {
        Scalar::Str(s) => s.trim() == "0",
        Scalar::Other(v) => v.as_f64() == Some(0.0),
    }
}

/// The containers of a pod that `policy` governs (not exempt as a whole) which the void rule
/// holds for, in the pod as `plan` (the rewrite, if there is one) leaves it: the API server
/// applies its policy again once the webhook has changed the pod. None for a pod holding a
/// passthrough GPU or a pod with a CDI annotation left; no container the rewrite changes (it
/// sets its own `NVIDIA_VISIBLE_DEVICES` or GPUs). Whatever the pod's owner: a tenant writes
/// its owner references, and a node agent that reads every GPU is exempted by the policy
/// (docs/design.md, "Threat model").
pub(super) fn void_targets<'a>(
    facts: &PodFacts<'a>,
    policy: &GpuPolicy,
    plan: Option<&Plan<'_>>,
) -> Vec<Voided<'a>> {
    targets(facts, policy, plan, None)
}

/// The ephemeral containers that `pods/ephemeralcontainers` adds to a pod `policy` governs
/// (those not in `old`) which the void rule holds for: `kubectl debug` with a CUDA image
/// would otherwise run with the image's `NVIDIA_VISIBLE_DEVICES`. The containers already
/// there cannot be changed, and got the rule when they were added.
pub(super) fn new_ephemeral_targets<'a>(
    facts: &PodFacts<'a>,
    policy: &GpuPolicy,
    old: &PodView<'_>,
) -> Vec<Voided<'a>> {
    targets(facts, policy, None, Some(old))
}

fn targets<'a>(
    facts: &PodFacts<'a>,
    policy: &GpuPolicy,
    plan: Option<&Plan<'_>>,
    ephemeral_since: Option<&PodView<'_>>,
) -> Vec<Voided<'a>> {
    if !applies(facts, policy, plan) {
        return Vec::new();
    }
    let rules = Rules::of(policy);
    let mut out = Vec::new();
    for c in &facts.containers {
        let wanted = match ephemeral_since {
            None => c.at.kind != ContainerKind::Ephemeral,
            Some(old) => added_by_update(c, old),
        };
        if !wanted || c.image_exempt {
            continue;
        }
        let planned = plan.and_then(|p| p.containers.iter().find(|p| p.at == c.at));
        if plan.is_some() && c.changes() {
            continue;
        }
        let gone = planned.map_or(&[][..], |p| &p.mounts[..]);
        let mounts = (c.value.mounts().enumerate())
            .filter(|(i, _)| !gone.contains(i))
            .map(|(_, (_, path))| path);
        if holds_no_gpu(c.value, &rules, mounts) {
            out.push(Voided {
                at: c.at,
                name: c.name,
                image: c.value.image.as_deref().unwrap_or_default(),
                claims: c.value.claim_names().next().is_some(),
            });
        }
    }
    out
}

/// Whether the rule applies to the pod at all: the policy asks for it, the pod holds no
/// passthrough GPU, and no CDI annotation is left once `plan` ran.
fn applies(facts: &PodFacts<'_>, policy: &GpuPolicy, plan: Option<&Plan<'_>>) -> bool {
    let removed = plan.map_or(&[][..], |p| &p.annotations_removed);
    let cdi = (facts.annotations.into_iter().flatten())
        .any(|(key, _)| gpuwarden_crds::is_cdi_annotation(key) && !removed.contains(&key.as_ref()));
    policy.spec.void_non_gpu_containers && !facts.pod.holds_passthrough() && !cdi
}

/// Whether `c` is an ephemeral container that `pods/ephemeralcontainers` adds to `old`: the
/// only ones the update can change.
pub(super) fn added_by_update(c: &ContainerFacts<'_>, old: &PodView<'_>) -> bool {
    c.at.kind == ContainerKind::Ephemeral
        && !(old.containers(ContainerKind::Ephemeral).iter())
            .any(|o| o.name.as_deref() == Some(c.name))
}

/// The rule's test of one container's own fields: not privileged, no GPU variable of its
/// own (`NVIDIA_VISIBLE_DEVICES` or a device variable the policy does not let it set), no
/// `envFrom` prefix that could spell a runtime variable (those two are the rewrite's
/// leaks), no GPU resource, no mount (of `mount_paths`) at a device-list path. A resource claim
/// holds no GPU through the variable: NVIDIA's DRA driver sets it in its own CDI edits,
/// after the pod's env, and a claim on another device must not leave the image's value.
fn holds_no_gpu<'m>(
    c: &Container<'_>,
    rules: &Rules<'_>,
    mut mount_paths: impl Iterator<Item = &'m str>,
) -> bool {
    !c.is_privileged()
        && !(c.env_entries()).any(|e| rules.is_judged_variable(e.name))
        && !(c.env_from_prefixes()).any(|p| spelled_by_prefix(p).is_some())
        && !(c.limit_names().chain(c.request_names())).any(|r| rules.is_gpu_resource(r))
        && !mount_paths.any(|path| path.contains(DEVICE_LIST_MARK))
}
