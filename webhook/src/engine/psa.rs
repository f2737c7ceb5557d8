//! Pod Security Admission (docs/design.md, "Pod Security"): the level a namespace enforces
//! bounds what the rewrite adds, and what the rewritten pod would still fail is named.
//! PSA runs after every mutating webhook, so a rewrite it would reject is a denial with a
//! message that does not mention gpuwarden; this keeps the rewrite inside the level.

use gpuwarden_crds::selector::Labels;

use super::facts::PodFacts;
use crate::pod::PodView;

use gpuwarden_crds::pod_security::BASELINE_CAPABILITIES;
pub use gpuwarden_crds::pod_security::LABEL_PSA_ENFORCE;

/// A Pod Security Standards level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PsaLevel {
    /// No restriction (also when the namespace sets no level).
    Privileged,
    /// `baseline`.
    Baseline,
    /// `restricted`.
    Restricted,
}

impl PsaLevel {
    /// The level a namespace's labels enforce. A value PSA does not know is read as
    /// `restricted`, as PSA itself does.
    pub fn enforced_by(labels: &dyn Labels) -> Self {
        match labels.label(LABEL_PSA_ENFORCE) {
            None | Some("privileged") => Self::Privileged,
            Some("baseline") => Self::Baseline,
            Some(_) => Self::Restricted,
        }
    }

    /// Its name, as the label writes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Privileged => "privileged",
            Self::Baseline => "baseline",
            Self::Restricted => "restricted",
        }
    }

    /// Whether a container may add `capability` at this level.
    pub fn allows_capability(self, capability: &str) -> bool {
        match self {
            Self::Privileged => true,
            Self::Baseline => BASELINE_CAPABILITIES.contains(&capability),
            Self::Restricted => capability == "NET_BIND_SERVICE",
        }
    }
}

/// What the pod would still fail at `level` once rewritten, in the pod's order: checks
/// gpuwarden cannot fix safely (host namespaces, hostPath volumes that stay, privileged
/// containers that stay exempt, `runAsNonRoot`) and, for containers the rewrite does not
/// touch, what `restricted` asks of every container. `rewritten(i)` says whether the rewrite
/// changes the security context of container `i` of `facts`; `volume_stays(name)` whether a
/// hostPath volume stays.
pub(super) fn still_fails(
    level: PsaLevel,
    pod: &PodView<'_>,
    facts: &PodFacts<'_>,
    rewritten: impl Fn(usize) -> bool,
    volume_stays: impl Fn(&str) -> bool,
) -> Vec<String> {
    let mut out = Vec::new();
    if level == PsaLevel::Privileged {
        return out;
    }
    let spec = pod.spec.as_ref();
    for (field, set) in [
        ("hostNetwork", spec.and_then(|s| s.host_network)),
        ("hostPID", spec.and_then(|s| s.host_pid)),
        ("hostIPC", spec.and_then(|s| s.host_ipc)),
    ] {
        if set == Some(true) {
            out.push(field.to_owned());
        }
    }
    for volume in pod.volumes() {
        let name = volume.name.as_deref().unwrap_or("");
        if volume.host_path.is_some() && volume_stays(name) {
            out.push(format!("hostPath volume {name}"));
        }
    }
    let pod_context = spec.and_then(|s| s.security_context.as_ref());
    let pod_non_root = pod_context.and_then(|c| c.run_as_non_root) == Some(true);
    let pod_seccomp = pod_context.is_some_and(|c| c.seccomp_profile);
    for (i, c) in facts.containers.iter().enumerate() {
        let context = c.value.security_context.as_ref();
        let changed = rewritten(i);
        if c.privileged && !changed {
            out.push(format!("privileged ({} {})", c.at.kind.noun(), c.name));
        }
        if level < PsaLevel::Restricted {
            continue;
        }
        let mut missing = Vec::new();
        if !pod_non_root && context.and_then(|s| s.run_as_non_root) != Some(true) {
            missing.push("runAsNonRoot");
        }
        if !changed {
            if context.and_then(|s| s.allow_privilege_escalation) != Some(false) {
                missing.push("allowPrivilegeEscalation: false");
            }
            let drops_all = (context.and_then(|s| s.capabilities.as_ref()))
                .and_then(|caps| caps.drop.as_ref()?.as_array().cloned())
                .is_some_and(|drop| drop.iter().any(|d| d == "ALL"));
            if !drops_all {
                missing.push("capabilities drop ALL");
            }
            if !pod_seccomp && !context.is_some_and(|s| s.seccomp_profile) {
                missing.push("seccompProfile");
            }
        }
        if !missing.is_empty() {
            out.push(format!(
                "{} ({} {})",
                missing.join(", "),
                c.at.kind.noun(),
                c.name
            ));
        }
    }
    out
}
