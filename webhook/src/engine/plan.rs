//! Planning the rewrite of a pod (docs/design.md, "Rewrite rules"): per container what changes,
//! as plain data borrowed from the pod and the policy. The patch, the warnings, the audit
//! summary and the `gpuwarden.io/rewritten` report are all written from the plan.

use std::borrow::Cow;
use std::fmt;

use gpuwarden_crds::GpuPolicy;

use gpuwarden_crds::gpu::{self, CountFrom, PodSignals, VisibleDevices};

use super::facts::PodFacts;
use super::{
    ContainerRef, ENV_DRIVER_CAPABILITIES, ENV_MIG_CONFIG_DEVICES, ENV_MIG_MONITOR_DEVICES,
    ENV_VISIBLE_DEVICES,
};
use crate::pod::{Container, Scalar};

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
    /// Whether `capabilities.drop` becomes `[ALL]`.
    pub(super) drop_all: bool,
    /// Capabilities it asked for that the policy does not allow, sorted, each once.
    pub(super) caps_refused: Vec<Cow<'a, str>>,
    /// Rule 3: the GPU limit added.
    pub(super) limit: Option<Limit<'a>>,
    /// Rule 4: how its `env` changes.
    pub(super) env: Option<EnvEdit<'a>>,
    /// Rule 5: indices of the `volumeMounts` entries removed, ascending.
    pub(super) mounts: Indices,
    /// Names of the device volumes whose mounts are removed, each once, in order.
    pub(super) mounts_removed: Names<'a>,
    /// Paths of the device-list mounts removed, in order.
    pub(super) device_list_removed: Names<'a>,
}

/// A GPU limit the rewrite adds.
#[derive(Debug)]
pub(super) struct Limit<'a> {
    /// The extended resource, e.g. `nvidia.com/gpu`.
    pub(super) resource: &'a str,
    pub(super) quantity: Quantity<'a>,
    pub(super) from: CountFrom<'a>,
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
    pod: &'a crate::pod::PodView<'a>,
    facts: PodFacts<'a>,
    policy: &'a GpuPolicy,
    strip: Names<'a>,
) -> Plan<'a> {
    let spec = &policy.spec;
    let mut plan = Plan {
        containers: Vec::with_capacity(facts.containers.len()),
        volumes: Indices::default(),
        volumes_removed: Names::default(),
        annotations_removed: Vec::new(),
        denials: Vec::new(),
        driver_capabilities: spec.driver_capabilities.join(","),
        device_volumes: PodSignals::default(),
    };
    for c in &facts.containers {
        let target = c.privileged && !c.image_exempt;
        // An unprivileged container that reaches GPUs around the kubelet: it keeps its
        // security context, and loses the leak (rules 3 to 5).
        let leaking = !c.privileged && !c.image_exempt && c.signals.leaks();
        let mut p = ContainerPlan {
            at: c.at,
            name: c.name,
            deprivileged: target,
            gpu: c.gpu,
            caps_added: Vec::new(),
            drop_all: false,
            caps_refused: Vec::new(),
            limit: None,
            env: None,
            mounts: Indices::default(),
            mounts_removed: Names::default(),
            device_list_removed: Names::default(),
        };
        if target {
            capabilities(&mut p, c.value, policy);
        }
        if target || leaking {
            // Rule 3.
            if c.gpu && !c.signals.limit {
                match c.gpu_request {
                    Some((resource, quantity)) => {
                        p.limit = Some(Limit {
                            resource,
                            quantity: Quantity::Copied(quantity),
                            from: CountFrom::Request,
                        });
                    }
                    None => match gpu::gpu_count(
                        c.name,
                        &c.signals,
                        |key| {
                            let raw = facts.annotations?.get(key)?;
                            Some((raw.as_str(), raw.to_string()))
                        },
                        policy,
                    ) {
                        Ok((n, from)) if n > spec.gpu.max_per_container => {
                            plan.denials.push(format!(
                                "{} {} would need {n} GPUs ({from}), more than maxPerContainer {}",
                                c.at.kind.noun(),
                                c.name,
                                spec.gpu.max_per_container
                            ));
                        }
                        Ok((n, from)) => {
                            p.limit = Some(Limit {
                                resource: &spec.gpu.resource_name,
                                quantity: Quantity::Count(n),
                                from,
                            });
                        }
                        Err(denial) => {
                            plan.denials
                                .push(format!("{} {}: {denial}", c.at.kind.noun(), c.name))
                        }
                    },
                }
            }
            // Rule 4.
            let (remove, set): (&[&'static str], _) = if c.gpu {
                (
                    &[
                        ENV_VISIBLE_DEVICES,
                        ENV_MIG_CONFIG_DEVICES,
                        ENV_MIG_MONITOR_DEVICES,
                    ],
                    (ENV_DRIVER_CAPABILITIES, EnvValue::DriverCapabilities),
                )
            } else {
                (
                    &[ENV_MIG_CONFIG_DEVICES, ENV_MIG_MONITOR_DEVICES],
                    (ENV_VISIBLE_DEVICES, EnvValue::Fixed("void")),
                )
            };
            let set = if c.gpu && spec.driver_capabilities.is_empty() {
                None
            } else {
                Some(set)
            };
            p.env = rewrite_env(c.value, remove, set, &plan.driver_capabilities);
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
        if (target || leaking) && c.signals.device_list != VisibleDevices::Unset {
            for (i, (_, path)) in c.mounts().enumerate() {
                if gpu::device_list_entry(path).is_some() && !p.mounts.contains(&i) {
                    p.mounts.push(i);
                    p.device_list_removed.push(path);
                }
            }
            p.mounts.sort_unstable();
        }
        if target || leaking || !p.mounts.is_empty() {
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
    plan.device_volumes = facts.pod;
    plan
}

/// Rules 1 and 2 for a container that loses privilege: the capabilities it keeps (the
/// policy's defaults, then what it asked for that the policy allows) and those refused.
fn capabilities<'a>(
    p: &mut ContainerPlan<'a>,
    container: &'a Container<'a>,
    policy: &'a GpuPolicy,
) {
    let caps = &policy.spec.capabilities;
    let asked = container
        .security_context
        .as_ref()
        .and_then(|s| s.capabilities.as_ref())
        .map_or(&[][..], |c| c.add.as_slice());
    let allowed = |cap: &str| caps.allowed.iter().any(|a| normalise_cap(a) == cap);
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
    p.drop_all = caps.drop_all;
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
            let same = entry.value.as_deref() == Some(v) && !entry.value_from;
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
