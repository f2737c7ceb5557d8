//! Writing what a plan does, in the three forms the answer carries: a warning per container
//! (kubectl prints them) and one summary line (the `changes` audit annotation), both from
//! the same phrases, and the `gpuwarden.io/rewritten` report, which says the same as JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use gpuwarden_crds::gpu::{self, CountFrom};

use super::plan::{ContainerPlan, EnvValue, Plan};
use super::psa::PsaLevel;
use crate::pod::ContainerKind;

/// Kubernetes may truncate longer warnings; each of ours is kept under this many bytes.
pub const MAX_WARNING_LEN: usize = 256;

/// Phrases written one after another with a separator.
struct Phrases<'o> {
    out: &'o mut String,
    separator: &'static str,
    empty: bool,
}

impl<'o> Phrases<'o> {
    fn new(out: &'o mut String, separator: &'static str) -> Self {
        Self {
            out,
            separator,
            empty: true,
        }
    }

    /// The buffer, ready for the next phrase.
    fn next(&mut self) -> &mut String {
        if !self.empty {
            self.out.push_str(self.separator);
        }
        self.empty = false;
        self.out
    }
}

/// A phrase naming a list, unless it is empty: `<before>a,b<after>`.
fn list_phrase<S: AsRef<str>>(phrases: &mut Phrases<'_>, before: &str, items: &[S], after: &str) {
    if items.is_empty() {
        return;
    }
    let out = phrases.next();
    out.push_str(before);
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(item.as_ref());
    }
    out.push_str(after);
}

/// `container trainer`, `init container setup`.
fn push_label(out: &mut String, kind: ContainerKind, name: &str) {
    out.push_str(kind.noun());
    out.push(' ');
    out.push_str(name);
}

impl Plan<'_> {
    /// The value a container's environment variable is set to.
    pub(super) fn env_value<'s>(&'s self, value: &EnvValue<'s>) -> &'s str {
        match value {
            EnvValue::DriverCapabilities => &self.driver_capabilities,
            EnvValue::Fixed(value) => value,
        }
    }

    /// The short phrases that say what the rewrite does to one container: `privileged
    /// removed`, `requests nvidia.com/gpu=1 (...)`, `env ... removed`, ...
    fn write_phrases(&self, phrases: &mut Phrases<'_>, c: &ContainerPlan<'_>) {
        self.write_privilege_phrases(phrases, c);
        self.write_gpu_phrases(phrases, c);
        self.write_env_phrases(phrases, c);
        self.write_mount_phrases(phrases, c);
    }

    /// Rules 1 and 2: privilege removed, capabilities refused or withheld, the seccomp
    /// profile set.
    fn write_privilege_phrases(&self, phrases: &mut Phrases<'_>, c: &ContainerPlan<'_>) {
        if c.deprivileged {
            phrases.next().push_str("privileged removed");
        }
        list_phrase(
            phrases,
            "capabilities ",
            &c.caps_refused,
            " dropped (not allowed)",
        );
        if !c.caps_withheld.is_empty() {
            let out = phrases.next();
            out.push_str("capabilities ");
            out.push_str(&c.caps_withheld.join(","));
            let _ = write!(out, " not added (Pod Security {})", self.psa.name());
        }
        if c.seccomp_default {
            phrases
                .next()
                .push_str("seccompProfile RuntimeDefault (Pod Security restricted)");
        }
    }

    /// Rule 3: the GPUs it gets (a limit, its own claim, a claim added or shared), the claims
    /// not counted, or why it gets none.
    fn write_gpu_phrases(&self, phrases: &mut Phrases<'_>, c: &ContainerPlan<'_>) {
        if let Some(limit) = &c.limit {
            let out = phrases.next();
            let from_request = matches!(limit.from, CountFrom::Request);
            out.push_str(if from_request { "limits " } else { "requests " });
            out.push_str(limit.resource);
            out.push('=');
            limit.quantity.with_text(|text| out.push_str(text));
            if from_request {
                out.push_str(" (from its request)");
            } else {
                // Writing into a String cannot fail.
                let _ = write!(out, " ({})", limit.from);
            }
        }
        if let Some(own) = c.own_claim {
            let out = phrases.next();
            out.push_str("GPUs from its ResourceClaim ");
            out.push_str(own);
        }
        if let Some(claim) = &c.claim {
            let new = &self.claims[claim.index];
            let out = phrases.next();
            match claim.shared_with {
                Some(holder) => {
                    let _ = write!(
                        out,
                        "shares claim {} with container {holder} ({})",
                        new.name, claim.from
                    );
                }
                None => {
                    let _ = write!(
                        out,
                        "claims {} GPU{} through {} ({})",
                        new.count,
                        if new.count == 1 { "" } else { "s" },
                        new.name,
                        claim.from
                    );
                }
            }
        }
        for (name, why) in &c.unread_claims {
            let _ = write!(
                phrases.next(),
                "its claim {name} was not counted ({why}): if it holds GPUs, they come on top"
            );
        }
        if let Some(why) = &c.no_gpu {
            let out = phrases.next();
            out.push_str("no GPU: ");
            out.push_str(why);
        }
    }

    /// Rule 4: the variables removed and set, and what its `envFrom` means.
    fn write_env_phrases(&self, phrases: &mut Phrases<'_>, c: &ContainerPlan<'_>) {
        if let Some(env) = &c.env {
            list_phrase(phrases, "env ", &env.removed, " removed");
            // Say where such devices come from, so the way out is in the warning.
            let granted = [
                gpu::ENV_IMEX_CHANNELS,
                gpu::ENV_NVSWITCH,
                gpu::ENV_MOFED,
                gpu::ENV_GDS,
                gpu::ENV_GDRCOPY,
            ];
            if env.removed.iter().any(|r| granted.contains(r)) {
                phrases.next().push_str(
                    "those devices come from a device plugin or DRA driver, or GpuPolicy runtimeFeatures",
                );
            }
            if let Some((name, value)) = &env.set {
                let out = phrases.next();
                out.push_str(name);
                out.push('=');
                out.push_str(self.env_value(value));
            }
        }
        if let Some(note) = c.env_from {
            phrases.next().push_str(note);
        }
    }

    /// Rule 5: the device mounts removed, with the host paths of their volumes, and the
    /// device-list mounts removed.
    fn write_mount_phrases(&self, phrases: &mut Phrases<'_>, c: &ContainerPlan<'_>) {
        if !c.mounts_removed.is_empty() {
            let out = phrases.next();
            out.push_str("device mount ");
            for (i, name) in c.mounts_removed.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(name);
                if let Some(path) = self.device_volumes.device_volume(name) {
                    out.push_str(" (");
                    out.push_str(path);
                    out.push(')');
                }
            }
            out.push_str(" removed");
        }
        list_phrase(
            phrases,
            "device-list mount ",
            &c.device_list_removed,
            " removed",
        );
    }

    /// The warning that names what de-privileged containers lose beyond privilege, where
    /// they drop every capability (the policy's `dropAll`, or Pod Security `restricted`):
    /// `None` where none does (docs/design.md, "What a rewritten container keeps").
    pub(super) fn strict_warning(&self) -> Option<String> {
        let mut strict = (self.containers.iter()).filter(|c| c.deprivileged && c.drop_all);
        let first = strict.next()?;
        let mut out = String::from("gpuwarden: ");
        push_label(&mut out, first.at.kind, first.name);
        for c in strict {
            out.push_str(", ");
            push_label(&mut out, c.at.kind, c.name);
        }
        let why = if self.psa == PsaLevel::Restricted {
            "Pod Security restricted"
        } else {
            "GpuPolicy capabilities.dropAll"
        };
        let _ = write!(
            out,
            ": drop ALL capabilities and privilege escalation ({why}), so chown, su, sudo, gosu, supervisord and sshd's privilege separation fail there"
        );
        Some(out)
    }

    /// The pod-level phrases: claims added, device hostPath volumes and annotations removed.
    fn write_pod_phrases(&self, phrases: &mut Phrases<'_>) {
        if !self.claims.is_empty() {
            let out = phrases.next();
            out.push_str("resourceClaims ");
            for (i, claim) in self.claims.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{} (template {})", claim.name, claim.template);
            }
            out.push_str(" added");
        }
        list_phrase(
            phrases,
            "device hostPath volume ",
            &self.volumes_removed,
            " removed",
        );
        list_phrase(
            phrases,
            "annotation ",
            &self.annotations_removed,
            " removed",
        );
        if !self.psa_left.is_empty() {
            let out = phrases.next();
            let _ = write!(
                out,
                "will still fail Pod Security {}: {}",
                self.psa.name(),
                self.psa_left.join("; ")
            );
        }
    }

    /// Whether the rewrite touches the pod itself (volumes or annotations).
    fn touches_pod(&self) -> bool {
        !self.claims.is_empty()
            || !self.volumes_removed.is_empty()
            || !self.annotations_removed.is_empty()
            || !self.psa_left.is_empty()
    }

    /// Appends one warning per touched container, then one for the pod:
    /// `<prefix><label><middle>` and the phrases joined by `; `.
    pub(super) fn push_warnings(&self, prefix: &str, middle: &str, out: &mut Vec<String>) {
        for c in &self.containers {
            let mut warning = prefix.to_owned();
            push_label(&mut warning, c.at.kind, c.name);
            warning.push_str(middle);
            self.write_phrases(&mut Phrases::new(&mut warning, "; "), c);
            out.push(warning);
        }
        if self.touches_pod() {
            let mut warning = format!("{prefix}pod{middle}");
            self.write_pod_phrases(&mut Phrases::new(&mut warning, "; "));
            out.push(warning);
        }
    }

    /// One line for the audit log: `container train: privileged removed, ...; pod: ...`.
    pub(super) fn write_summary(&self, line: &mut String) {
        for (i, c) in self.containers.iter().enumerate() {
            if i > 0 {
                line.push_str("; ");
            }
            push_label(line, c.at.kind, c.name);
            line.push_str(": ");
            self.write_phrases(&mut Phrases::new(line, ", "), c);
        }
        if self.touches_pod() {
            if !self.containers.is_empty() {
                line.push_str("; ");
            }
            line.push_str("pod: ");
            self.write_pod_phrases(&mut Phrases::new(line, ", "));
        }
    }

    /// The `gpuwarden.io/rewritten` (or `gpuwarden.io/audit`) annotation value as JSON: per
    /// container name, sorted by name, what changed (the last of a repeated name wins, as in
    /// an object); the pod's volumes and annotations removed; and why Enforce would deny the
    /// pod (Audit only).
    pub(super) fn report(&self) -> String {
        let report = ReportJson {
            containers: self
                .containers
                .iter()
                .map(|c| (c.name, self.container_report(c)))
                .collect(),
            resource_claims: (self.claims.iter())
                .map(|c| (c.name.as_str(), c.template.as_str()))
                .collect(),
            volumes_removed: &self.volumes_removed,
            annotations_removed: &self.annotations_removed,
            denials: &self.denials,
            pod_security: (!self.psa_left.is_empty()).then(|| PodSecurityReport {
                level: self.psa.name(),
                still_fails: &self.psa_left,
            }),
        };
        // Strings, lists and maps of strings always serialise.
        serde_json::to_string(&report).unwrap_or_default()
    }

    fn container_report<'p>(&'p self, c: &'p ContainerPlan<'_>) -> ContainerReport<'p> {
        let env = c.env.as_ref();
        ContainerReport {
            kind: match c.at.kind {
                ContainerKind::Init => Some("init"),
                ContainerKind::Ephemeral => Some("ephemeral"),
                ContainerKind::Regular => None,
            },
            // The container lost privilege, or never had it.
            privileged: false,
            allow_privilege_escalation: c.drop_all.then_some(false),
            gpu: c.gpu,
            capabilities_added: &c.caps_added,
            capabilities_dropped: if c.drop_all { &["ALL"] } else { &[] },
            capabilities_refused: &c.caps_refused,
            capabilities_withheld: &c.caps_withheld,
            seccomp_profile: c.seccomp_default.then_some("RuntimeDefault"),
            limits: c.limit.as_ref().map(|limit| {
                BTreeMap::from([(limit.resource, limit.quantity.with_text(str::to_owned))])
            }),
            claim: (c.claim.as_ref())
                .map(|claim| self.claims[claim.index].name.as_str())
                .or(c.own_claim),
            claim_shared_with: c.claim.as_ref().and_then(|claim| claim.shared_with),
            claims_not_read: (c.unread_claims.iter())
                .map(|(name, why)| (*name, why.as_str()))
                .collect(),
            gpu_count_from: (c.limit.as_ref().map(|limit| limit.from.to_string()))
                .or_else(|| c.claim.as_ref().map(|claim| claim.from.to_string())),
            no_gpu: c.no_gpu.as_deref(),
            env_from: c.env_from,
            env_removed: env.map_or(&[], |env| &env.removed),
            env_set: env
                .and_then(|env| env.set.as_ref())
                .map(|(name, value)| BTreeMap::from([(*name, self.env_value(value))])),
            volume_mounts_removed: &c.mounts_removed,
            device_list_mounts_removed: &c.device_list_removed,
        }
    }

    /// Whether `text` is the report, written byte for byte.
    pub(super) fn report_is(&self, text: &str) -> bool {
        self.report() == text
    }
}

/// The report, field by field in the order it is written.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ReportJson<'p> {
    containers: BTreeMap<&'p str, ContainerReport<'p>>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    resource_claims: BTreeMap<&'p str, &'p str>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    volumes_removed: &'p [&'p str],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    annotations_removed: &'p [&'p str],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    denials: &'p [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    pod_security: Option<PodSecurityReport<'p>>,
}

/// What the rewritten pod would still fail under the namespace's Pod Security level.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct PodSecurityReport<'p> {
    level: &'static str,
    still_fails: &'p [String],
}

/// What changed in one container.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ContainerReport<'p> {
    #[serde(skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
    privileged: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    allow_privilege_escalation: Option<bool>,
    gpu: bool,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    capabilities_added: &'p [std::borrow::Cow<'p, str>],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    capabilities_dropped: &'static [&'static str],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    capabilities_refused: &'p [std::borrow::Cow<'p, str>],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    capabilities_withheld: &'p [std::borrow::Cow<'p, str>],
    #[serde(skip_serializing_if = "Option::is_none")]
    seccomp_profile: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    limits: Option<BTreeMap<&'p str, String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    claim: Option<&'p str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    claim_shared_with: Option<&'p str>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    claims_not_read: BTreeMap<&'p str, &'p str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu_count_from: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    no_gpu: Option<&'p str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    env_from: Option<&'static str>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    env_removed: &'p [&'static str],
    #[serde(skip_serializing_if = "Option::is_none")]
    env_set: Option<BTreeMap<&'static str, &'p str>>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    volume_mounts_removed: &'p [&'p str],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    device_list_mounts_removed: &'p [&'p str],
}

/// The text cut to [`MAX_WARNING_LEN`] bytes on a character boundary, with `...`.
pub(super) fn clip(text: &mut String) {
    if text.len() > MAX_WARNING_LEN {
        let mut end = MAX_WARNING_LEN - 3;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("...");
    }
}
