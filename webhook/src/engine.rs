//! The rewrite engine: a pure function from a pod, the policies and the namespace's labels to
//! a [`Decision`] (a verdict, the list of [`Change`]s, warnings and audit annotations).
//! [`crate::patch`] turns the changes into an RFC 6902 patch.
//!
//! The engine reads the pod through a [`PodView`]: the few fields it needs, borrowed from
//! the review's body (or from a manifest's `Value`), rather than a whole typed `Pod`. It
//! never drops fields it does not know, since its output is a patch, and the patch touches
//! only the fields DESIGN.md lists (container `securityContext.privileged`,
//! `allowPrivilegeEscalation`, `capabilities`, GPU limits, `env`, `volumeMounts`; pod
//! `volumes` and `metadata.annotations`).
//!
//! The same functions serve admission reviews ([`crate::admission`]) and the offline
//! `mutate` command ([`crate::mutate`]), where the "pod" is a workload's pod template.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use gpuwarden_crds::{
    ANNOTATION_AUDIT, ANNOTATION_GPU_COUNT, ANNOTATION_POLICY, ANNOTATION_REWRITTEN,
    CDI_ANNOTATION_PREFIX, GpuPolicy, PolicyMode, PrivilegedMatch, RESOURCE_GPU,
    RESOURCE_GPU_SHARED, RESOURCE_MIG_PREFIX, VisibleDevicesAll,
};
use serde::Serialize;

use crate::json_out;
pub use crate::pod::ContainerKind;
use crate::pod::{Container, Map, PodView};

pub use gpuwarden_crds::exemptions::{glob_match, image_exempt};
pub use gpuwarden_crds::selection::{
    LABEL_NAMESPACE_NAME, Selection, namespace_labels_or_default, select_policy,
};

/// Environment variable the NVIDIA runtime reads to pick the GPUs it exposes.
pub const ENV_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// Environment variable naming the driver capabilities (libraries) the runtime mounts.
pub const ENV_DRIVER_CAPABILITIES: &str = "NVIDIA_DRIVER_CAPABILITIES";
/// MIG configuration access; the runtime refuses it in unprivileged containers.
pub const ENV_MIG_CONFIG_DEVICES: &str = "NVIDIA_MIG_CONFIG_DEVICES";
/// MIG monitoring access; the runtime refuses it in unprivileged containers.
pub const ENV_MIG_MONITOR_DEVICES: &str = "NVIDIA_MIG_MONITOR_DEVICES";
/// The command a denial message points users to.
pub const OFFLINE_COMMAND: &str = "gpuwarden-webhook mutate -f <manifest>";
/// Kubernetes may truncate longer warnings; each of ours is kept under this many bytes.
pub const MAX_WARNING_LEN: usize = 256;

/// One container of the pod, by position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContainerRef {
    /// Which list it is in.
    pub kind: ContainerKind,
    /// Index in that list.
    pub index: usize,
}

/// One change to the pod. The patch is derived from these; nothing else is written.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// Rules 1 and 2: `privileged: false`, `allowPrivilegeEscalation: false` and the given
    /// capabilities (`None`: leave that list as it is).
    SecurityContext {
        /// The container.
        container: ContainerRef,
        /// `capabilities.add` after the rewrite.
        add: Vec<String>,
        /// `capabilities.drop` after the rewrite.
        drop: Option<Vec<String>>,
    },
    /// Rule 3: `resources.limits[resource] = count`.
    GpuLimit {
        /// The container.
        container: ContainerRef,
        /// Extended resource name, e.g. `nvidia.com/gpu`.
        resource: String,
        /// Quantity as written into the limit.
        quantity: String,
    },
    /// Rule 4: remove these `env` entries (by index) and append these.
    Env {
        /// The container.
        container: ContainerRef,
        /// Indices of entries to remove, ascending.
        remove: Vec<usize>,
        /// Entries to append: name, value.
        append: Vec<(String, String)>,
    },
    /// Rule 5: remove these `volumeMounts` entries (by index, ascending).
    VolumeMounts {
        /// The container.
        container: ContainerRef,
        /// Indices of entries to remove, ascending.
        remove: Vec<usize>,
    },
    /// Rule 5: remove these `spec.volumes` entries (by index, ascending).
    Volumes {
        /// Indices of entries to remove, ascending.
        remove: Vec<usize>,
    },
    /// Rule 5: remove these pod annotations.
    RemoveAnnotations {
        /// Annotation keys.
        keys: Vec<String>,
    },
    /// Rule 6 and Audit: set these pod annotations.
    SetAnnotations {
        /// Key, value.
        pairs: Vec<(String, String)>,
    },
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
    /// Enforce: the changes rewrite the pod.
    Rewritten,
    /// Audit: admitted; the changes only add the audit annotation.
    Audited,
    /// Rejected: `Decision::denial` says why.
    Denied,
}

/// The engine's answer for one pod.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decision {
    /// The verdict (`None` only on the default value).
    pub verdict: Option<Verdict>,
    /// `name@generation` of the governing policy.
    pub policy: Option<String>,
    /// Changes to apply (empty unless the verdict is `Rewritten` or `Audited`).
    pub changes: Vec<Change>,
    /// Short warnings for the user (kubectl prints them).
    pub warnings: Vec<String>,
    /// Why the pod is rejected (set when the verdict is `Denied`).
    pub denial: Option<String>,
    /// Audit annotations for the API server's audit log.
    pub audit_annotations: BTreeMap<&'static str, String>,
    /// Policies skipped because they are invalid, with the reason (also in `warnings`).
    pub skipped_policies: Vec<String>,
}

impl Decision {
    fn new(verdict: Verdict) -> Self {
        Self {
            verdict: Some(verdict),
            ..Self::default()
        }
    }

    /// The verdict, `NotGoverned` for a default value.
    pub fn verdict(&self) -> Verdict {
        self.verdict.unwrap_or(Verdict::NotGoverned)
    }
}

/// What the engine is asked to judge.
#[derive(Clone, Copy, Debug)]
pub enum Operation<'a> {
    /// A new pod (or a pod template, offline).
    Create,
    /// `pods/ephemeralcontainers` UPDATE; the previous pod tells which containers are new.
    AddEphemeral {
        /// The pod before the update.
        old: &'a PodView<'a>,
    },
}

/// Everything the engine reads, besides the policies.
#[derive(Clone, Copy, Debug)]
pub struct Input<'a> {
    /// The pod (or a pod template: an object with `metadata` and `spec`).
    pub pod: &'a PodView<'a>,
    /// The pod's namespace.
    pub namespace: &'a str,
    /// The namespace's labels (see [`namespace_labels_or_default`]).
    pub namespace_labels: &'a BTreeMap<String, String>,
    /// What is being done.
    pub operation: Operation<'a>,
    /// How the pod is named in messages (`namespace/name`).
    pub display_name: &'a str,
}

/// Judges one pod: selects the policy, applies exemptions and the policy's mode.
pub fn decide(input: &Input<'_>, policies: &[Arc<GpuPolicy>]) -> Decision {
    // Only a podSelector reads the pod's labels; most policies have none.
    let pod_labels: BTreeMap<String, String> =
        if policies.iter().any(|p| p.spec.pod_selector.is_some()) {
            input
                .pod
                .metadata
                .as_ref()
                .and_then(|m| m.labels.as_ref())
                .into_iter()
                .flatten()
                .filter_map(|(k, v)| Some((k.to_string(), v.as_str()?.to_owned())))
                .collect()
        } else {
            BTreeMap::new()
        };
    let selection = select_policy(policies, input.namespace_labels, &pod_labels);
    let mut decision = match selection.policy {
        None => Decision::new(Verdict::NotGoverned),
        Some(policy) => match input.operation {
            Operation::Create => decide_create(input, policy),
            Operation::AddEphemeral { old } => decide_ephemeral(input, old, policy),
        },
    };
    for skipped in selection.skipped.iter().rev() {
        decision
            .warnings
            .insert(0, clip(format!("gpuwarden: {skipped}")));
    }
    decision.skipped_policies = selection.skipped;
    decision
}

// ---------------------------------------------------------------------------------------
// Reading the pod.

/// How a container's `NVIDIA_VISIBLE_DEVICES` reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VisibleDevices {
    /// Not set in the pod spec.
    Unset,
    /// `none`, `void` or empty: no GPU.
    NoGpu,
    /// `all`.
    All,
    /// A list of indices, GPU UUIDs or MIG identifiers; the number of distinct entries.
    Devices(u32),
    /// Set from a ConfigMap, Secret or field reference: the value is unknown here.
    Indirect,
}

impl VisibleDevices {
    /// Parses an `NVIDIA_VISIBLE_DEVICES` value.
    pub fn parse(value: &str) -> Self {
        let value = value.trim();
        if value.is_empty()
            || value.eq_ignore_ascii_case("none")
            || value.eq_ignore_ascii_case("void")
        {
            return Self::NoGpu;
        }
        if value.eq_ignore_ascii_case("all") {
            return Self::All;
        }
        let ids: BTreeSet<&str> = value
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        if ids.iter().any(|id| id.eq_ignore_ascii_case("all")) {
            return Self::All;
        }
        if ids.is_empty() {
            return Self::NoGpu;
        }
        Self::Devices(u32::try_from(ids.len()).unwrap_or(u32::MAX))
    }

    /// Whether this value hands GPUs to the container.
    pub fn is_gpu_signal(&self) -> bool {
        matches!(self, Self::All | Self::Devices(_) | Self::Indirect)
    }
}

/// Reads `NVIDIA_VISIBLE_DEVICES` from a container's `env` (the last entry wins, as in the
/// kubelet).
fn visible_devices(container: &Container<'_>) -> (VisibleDevices, Option<String>) {
    let mut found = (VisibleDevices::Unset, None);
    for entry in container.env.iter().flatten() {
        if entry.name.as_deref() != Some(ENV_VISIBLE_DEVICES) {
            continue;
        }
        found = match entry.value.as_deref() {
            Some(v) => (VisibleDevices::parse(v), Some(v.to_owned())),
            None if entry.value_from => (VisibleDevices::Indirect, None),
            None => (VisibleDevices::NoGpu, Some(String::new())),
        };
    }
    found
}

/// Whether `name` is a GPU resource under `policy`.
fn is_gpu_resource(name: &str, policy_resource: &str) -> bool {
    name == RESOURCE_GPU
        || name == RESOURCE_GPU_SHARED
        || name.starts_with(RESOURCE_MIG_PREFIX)
        || name == policy_resource
}

/// Whether a hostPath is a device path: `/dev`, `/dev/nvidia*`, `/dev/dri`, `/dev/dri/...`.
pub fn is_device_host_path(path: &str) -> bool {
    let clean = clean_path(path);
    clean == "/dev"
        || clean.starts_with("/dev/nvidia")
        || clean == "/dev/dri"
        || clean.starts_with("/dev/dri/")
}

/// Lexically cleans an absolute path (`//`, `.`, `..`, trailing `/`), as the kubelet would
/// resolve it, so `/dev/./nvidia0/` and `/dev//dri` are recognised.
fn clean_path(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    let mut out = String::with_capacity(path.len() + 1);
    for p in parts {
        out.push('/');
        out.push_str(p);
    }
    if out.is_empty() {
        out.push('/');
    }
    out
}

/// One container, as the engine sees it.
#[derive(Debug)]
struct ContainerInfo<'a> {
    at: ContainerRef,
    /// `name` (may be empty in a malformed pod).
    name: &'a str,
    value: &'a Container<'a>,
    privileged: bool,
    image_exempt: bool,
    gpu_limit: bool,
    /// A GPU resource requested but not limited: resource, quantity.
    gpu_request: Option<(String, String)>,
    visible: VisibleDevices,
    visible_raw: Option<String>,
    device_mounts: Vec<String>,
    gpu: bool,
}

/// Pod-level facts.
struct PodFacts<'a> {
    containers: Vec<ContainerInfo<'a>>,
    /// Device hostPath volumes: name → path.
    device_volumes: BTreeMap<String, String>,
    cdi_keys: Vec<String>,
    annotations: Option<&'a Map<'a>>,
}

fn read_pod<'a>(pod: &'a PodView<'a>, policy: &GpuPolicy, kinds: &[ContainerKind]) -> PodFacts<'a> {
    let annotations = pod.annotations();
    let mut cdi_keys = Vec::new();
    let mut cdi_nvidia = false;
    for (key, value) in annotations.into_iter().flatten() {
        if key.starts_with(CDI_ANNOTATION_PREFIX) {
            cdi_keys.push(key.to_string());
            if value.as_str().is_some_and(|v| v.contains("nvidia.com/")) {
                cdi_nvidia = true;
            }
        }
    }
    let mut device_volumes = BTreeMap::new();
    for volume in pod.volumes() {
        let (Some(name), Some(path)) = (
            volume.name.as_deref(),
            volume.host_path.as_ref().and_then(|h| h.path.as_deref()),
        ) else {
            continue;
        };
        if is_device_host_path(path) {
            device_volumes.insert(name.to_owned(), path.to_owned());
        }
    }
    let all = policy.spec.match_.privileged_containers == PrivilegedMatch::All;
    let resource = policy.spec.gpu.resource_name.as_str();
    let images = &policy.spec.exemptions.images;
    let mut containers = Vec::new();
    for &kind in kinds {
        for (index, value) in pod.containers(kind).iter().enumerate() {
            let name = value.name.as_deref().unwrap_or("");
            let privileged = value.is_privileged();
            let image = value.image.as_deref().unwrap_or("");
            let resources = value.resources.as_ref();
            let gpu_limit = resources
                .and_then(|r| r.limits.as_ref())
                .is_some_and(|l| l.keys().any(|k| is_gpu_resource(k, resource)));
            let gpu_request = if gpu_limit {
                None
            } else {
                resources
                    .and_then(|r| r.requests.as_ref())
                    .and_then(|r| r.iter().find(|(k, _)| is_gpu_resource(k, resource)))
                    .map(|(k, v)| (k.to_string(), v.to_text()))
            };
            let (visible, visible_raw) = visible_devices(value);
            let device_mounts: Vec<String> = value
                .volume_mounts
                .iter()
                .flatten()
                .filter_map(|m| m.name.as_deref())
                .filter(|n| device_volumes.contains_key(*n))
                .map(str::to_owned)
                .collect();
            let gpu = all
                || gpu_limit
                || gpu_request.is_some()
                || visible.is_gpu_signal()
                || !device_mounts.is_empty()
                || cdi_nvidia;
            containers.push(ContainerInfo {
                at: ContainerRef { kind, index },
                name,
                value,
                privileged,
                image_exempt: image_exempt(image, images),
                gpu_limit,
                gpu_request,
                visible,
                visible_raw,
                device_mounts,
                gpu,
            });
        }
    }
    PodFacts {
        containers,
        device_volumes,
        cdi_keys,
        annotations,
    }
}

/// Namespace or service-account exemption of the whole pod, with the reason.
fn pod_exemption(pod: &PodView<'_>, namespace: &str, policy: &GpuPolicy) -> Option<String> {
    let sa = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.as_deref())
        .unwrap_or("");
    policy.spec.exemptions.pod_exemption(namespace, sa)
}

// ---------------------------------------------------------------------------------------
// Planning.

/// What the rewrite does to one container, as recorded in `gpuwarden.io/rewritten`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerReport {
    /// `init`, `ephemeral`, or absent for a regular container.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// Always `false`: the container lost privilege.
    pub privileged: bool,
    /// Whether it is a GPU container (false: a privileged sidecar de-privileged with it).
    pub gpu: bool,
    /// `capabilities.add` after the rewrite.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub capabilities_added: Vec<String>,
    /// `capabilities.drop` after the rewrite.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub capabilities_dropped: Vec<String>,
    /// Capabilities the container asked for that the policy does not allow.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub capabilities_refused: Vec<String>,
    /// GPU limit added: resource → quantity (written as an object; at most one).
    #[serde(
        skip_serializing_if = "Vec::is_empty",
        serialize_with = "pairs_as_object"
    )]
    pub limits: Vec<(String, String)>,
    /// Where the GPU count came from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_count_from: Option<String>,
    /// Environment variables removed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub env_removed: Vec<String>,
    /// Environment variables set: name → value (written as an object; at most one).
    #[serde(
        skip_serializing_if = "Vec::is_empty",
        serialize_with = "pairs_as_object"
    )]
    pub env_set: Vec<(String, String)>,
    /// Volume mounts removed (by volume name).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts_removed: Vec<String>,
}

/// The `gpuwarden.io/rewritten` (and `gpuwarden.io/audit`) annotation value.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// Per container name, sorted by name, each name once (written as an object).
    #[serde(serialize_with = "pairs_as_object")]
    pub containers: Vec<(String, ContainerReport)>,
    /// Pod volumes removed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volumes_removed: Vec<String>,
    /// Pod annotations removed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub annotations_removed: Vec<String>,
    /// Why Enforce would deny the pod (Audit only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub denials: Vec<String>,
}

impl Report {
    /// The annotation value: the JSON serde writes for this struct, written straight into
    /// one buffer (the admission path's other JSON is written the same way).
    pub fn to_json(&self) -> String {
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(b"{\"containers\":{");
        for (i, (name, c)) in self.containers.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            json_out::string(&mut out, name);
            out.push(b':');
            c.write_json(&mut out);
        }
        out.push(b'}');
        list_field(&mut out, "volumesRemoved", &self.volumes_removed);
        list_field(&mut out, "annotationsRemoved", &self.annotations_removed);
        list_field(&mut out, "denials", &self.denials);
        out.push(b'}');
        // Only whole strings and ASCII punctuation were written.
        String::from_utf8(out).unwrap_or_default()
    }
}

impl ContainerReport {
    fn write_json(&self, out: &mut Vec<u8>) {
        out.push(b'{');
        if let Some(kind) = self.kind {
            out.extend_from_slice(b"\"kind\":");
            json_out::string(out, kind);
            out.push(b',');
        }
        out.extend_from_slice(if self.privileged {
            b"\"privileged\":true"
        } else {
            b"\"privileged\":false"
        });
        out.extend_from_slice(if self.gpu {
            b",\"gpu\":true"
        } else {
            b",\"gpu\":false"
        });
        list_field(out, "capabilitiesAdded", &self.capabilities_added);
        list_field(out, "capabilitiesDropped", &self.capabilities_dropped);
        list_field(out, "capabilitiesRefused", &self.capabilities_refused);
        map_field(out, "limits", &self.limits);
        if let Some(from) = &self.gpu_count_from {
            out.extend_from_slice(b",\"gpuCountFrom\":");
            json_out::string(out, from);
        }
        list_field(out, "envRemoved", &self.env_removed);
        map_field(out, "envSet", &self.env_set);
        list_field(out, "volumeMountsRemoved", &self.volume_mounts_removed);
        out.push(b'}');
    }
}

/// `,"<key>":[...]` unless `items` is empty (after the first field of an object).
fn list_field(out: &mut Vec<u8>, key: &str, items: &[String]) {
    if items.is_empty() {
        return;
    }
    out.push(b',');
    json_out::string(out, key);
    out.push(b':');
    json_out::string_array(out, items.iter().map(String::as_str));
}

/// `,"<key>":{...}` unless `pairs` is empty (after the first field of an object).
fn map_field(out: &mut Vec<u8>, key: &str, pairs: &[(String, String)]) {
    if pairs.is_empty() {
        return;
    }
    out.push(b',');
    json_out::string(out, key);
    out.push(b':');
    json_out::string_object(out, pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())));
}

/// Serialises pairs as an object, in their order: small maps of the report are kept as
/// lists, which cost less to build than a `BTreeMap`'s node.
fn pairs_as_object<S: serde::Serializer, V: Serialize>(
    pairs: &[(String, V)],
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_map(pairs.iter().map(|(k, v)| (k, v)))
}

/// The plan for one pod: the changes, what they mean, and what cannot be rewritten.
struct Plan<'f> {
    changes: Vec<Change>,
    /// The containers the rewrite touches, in the pod's order.
    containers: Vec<ContainerPlan<'f>>,
    /// Pod volumes removed.
    volumes_removed: Vec<String>,
    /// Pod annotations removed.
    annotations_removed: Vec<String>,
    denials: Vec<String>,
}

/// What the rewrite does to one container: its part of the report, from which the warnings
/// and the audit summary are also written (see [`write_phrases`]).
struct ContainerPlan<'f> {
    kind: ContainerKind,
    name: &'f str,
    /// Rules 1 and 2 applied; otherwise the container only loses device mounts.
    deprivileged: bool,
    /// The GPU limit was copied from the container's request.
    limit_from_request: bool,
    report: ContainerReport,
}

/// A capability name as the runtime reads it: trimmed, upper case, without `CAP_`. Borrowed
/// when it already is.
fn normalise_cap(cap: &str) -> Cow<'_, str> {
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

/// Plans the rewrite of every container; `strip_volumes` are the device volumes that go
/// (see [`volumes_to_strip`]).
fn plan_pod<'f>(
    facts: &PodFacts<'f>,
    policy: &GpuPolicy,
    strip_volumes: &BTreeSet<&str>,
) -> Plan<'f> {
    let spec = &policy.spec;
    let mut plan = Plan {
        changes: Vec::new(),
        containers: Vec::new(),
        volumes_removed: Vec::new(),
        annotations_removed: Vec::new(),
        denials: Vec::new(),
    };
    let defaults: Vec<Cow<'_, str>> = spec
        .capabilities
        .default
        .iter()
        .map(|c| normalise_cap(c))
        .collect();
    let allowed: Vec<Cow<'_, str>> = spec
        .capabilities
        .allowed
        .iter()
        .map(|c| normalise_cap(c))
        .collect();
    let driver_caps = spec.driver_capabilities.join(",");

    for c in &facts.containers {
        let target = c.privileged && !c.image_exempt;
        let mut report = ContainerReport {
            kind: match c.at.kind {
                ContainerKind::Init => Some("init"),
                ContainerKind::Regular => None,
                ContainerKind::Ephemeral => Some("ephemeral"),
            },
            gpu: c.gpu,
            ..ContainerReport::default()
        };
        let mut limit_from_request = false;
        let mut mounts_removed = false;

        if target {
            // Rules 1 and 2.
            let asked: Vec<Cow<'_, str>> = c
                .value
                .security_context
                .as_ref()
                .and_then(|s| s.capabilities.as_ref())
                .map(|caps| caps.add.iter().map(|a| normalise_cap(a)).collect())
                .unwrap_or_default();
            let mut add: Vec<String> = Vec::new();
            for cap in defaults
                .iter()
                .chain(asked.iter().filter(|a| allowed.contains(*a)))
            {
                if !add.iter().any(|a| a == cap) {
                    add.push(cap.to_string());
                }
            }
            let refused: Vec<String> = asked
                .iter()
                .filter(|a| !add.iter().any(|added| added == *a))
                .map(|a| a.as_ref())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .map(str::to_owned)
                .collect();
            let drop = if spec.capabilities.drop_all {
                Some(vec!["ALL".to_owned()])
            } else {
                None
            };
            report.privileged = false;
            report.capabilities_added = add.clone();
            report.capabilities_dropped = drop.clone().unwrap_or_default();
            report.capabilities_refused = refused;
            plan.changes.push(Change::SecurityContext {
                container: c.at,
                add,
                drop,
            });

            // Rule 3.
            if c.gpu && !c.gpu_limit {
                if let Some((resource, quantity)) = &c.gpu_request {
                    let q = quantity.clone();
                    limit_from_request = true;
                    report.limits.push((resource.clone(), q.clone()));
                    report.gpu_count_from = Some("request".to_owned());
                    plan.changes.push(Change::GpuLimit {
                        container: c.at,
                        resource: resource.clone(),
                        quantity: q,
                    });
                } else {
                    match gpu_count(c, facts, policy) {
                        Ok((n, from)) if n > spec.gpu.max_per_container => {
                            plan.denials.push(format!(
                                "{} {} would need {n} GPUs ({from}), more than maxPerContainer {}",
                                c.at.kind.noun(),
                                c.name,
                                spec.gpu.max_per_container
                            ));
                        }
                        Ok((n, from)) => {
                            let resource = spec.gpu.resource_name.clone();
                            report.limits.push((resource.clone(), n.to_string()));
                            report.gpu_count_from = Some(from);
                            plan.changes.push(Change::GpuLimit {
                                container: c.at,
                                resource,
                                quantity: n.to_string(),
                            });
                        }
                        Err(denial) => {
                            plan.denials
                                .push(format!("{} {}: {denial}", c.at.kind.noun(), c.name))
                        }
                    }
                }
            }

            // Rule 4.
            let (remove, set): (&[&str], (&str, &str)) = if c.gpu {
                (
                    &[
                        ENV_VISIBLE_DEVICES,
                        ENV_MIG_CONFIG_DEVICES,
                        ENV_MIG_MONITOR_DEVICES,
                    ],
                    (ENV_DRIVER_CAPABILITIES, driver_caps.as_str()),
                )
            } else {
                (
                    &[ENV_MIG_CONFIG_DEVICES, ENV_MIG_MONITOR_DEVICES],
                    (ENV_VISIBLE_DEVICES, "void"),
                )
            };
            let set = if c.gpu && spec.driver_capabilities.is_empty() {
                None
            } else {
                Some(set)
            };
            if let Some(edit) = rewrite_env(c.value, remove, set) {
                if let Some((k, v)) = edit.set {
                    report.env_set.push((k.to_owned(), v.to_owned()));
                }
                report.env_removed = edit.removed;
                plan.changes.push(Change::Env {
                    container: c.at,
                    remove: edit.remove,
                    append: edit.append,
                });
            }
        }

        // Rule 5: mounts of removed device volumes go from every container that is not
        // exempt; a rewritten container also loses its mounts of device volumes that stay
        // because an exempt container still mounts them.
        let strips = |name: &str| {
            strip_volumes.contains(name)
                || (target
                    && spec.strip_device_host_paths
                    && facts.device_volumes.contains_key(name))
        };
        if !c.image_exempt && c.device_mounts.iter().any(|m| strips(m)) {
            let mut removed: Vec<String> = Vec::new();
            let mut indices = Vec::new();
            for (i, m) in c.value.volume_mounts.iter().flatten().enumerate() {
                let name = m.name.as_deref().unwrap_or("");
                if strips(name) {
                    indices.push(i);
                    if !removed.iter().any(|r| r == name) {
                        removed.push(name.to_owned());
                    }
                }
            }
            mounts_removed = true;
            report.volume_mounts_removed = removed;
            plan.changes.push(Change::VolumeMounts {
                container: c.at,
                remove: indices,
            });
        }

        if target || mounts_removed {
            plan.containers.push(ContainerPlan {
                kind: c.at.kind,
                name: c.name,
                deprivileged: target,
                limit_from_request,
                report,
            });
        }
    }
    plan
}

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
fn list_phrase(phrases: &mut Phrases<'_>, before: &str, items: &[String], after: &str) {
    if items.is_empty() {
        return;
    }
    let out = phrases.next();
    out.push_str(before);
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(item);
    }
    out.push_str(after);
}

/// `container trainer`, `init container setup`.
fn push_label(out: &mut String, kind: ContainerKind, name: &str) {
    out.push_str(kind.noun());
    out.push(' ');
    out.push_str(name);
}

/// The short phrases that say what the rewrite does to one container: `privileged removed`,
/// `requests nvidia.com/gpu=1 (...)`, `env ... removed`, ...
fn write_phrases(phrases: &mut Phrases<'_>, c: &ContainerPlan<'_>, facts: &PodFacts<'_>) {
    let report = &c.report;
    if c.deprivileged {
        phrases.next().push_str("privileged removed");
    }
    list_phrase(
        phrases,
        "capabilities ",
        &report.capabilities_refused,
        " dropped (not allowed)",
    );
    for (resource, quantity) in &report.limits {
        let out = phrases.next();
        out.push_str(if c.limit_from_request {
            "limits "
        } else {
            "requests "
        });
        out.push_str(resource);
        out.push('=');
        out.push_str(quantity);
        if c.limit_from_request {
            out.push_str(" (from its request)");
        } else {
            out.push_str(" (");
            out.push_str(report.gpu_count_from.as_deref().unwrap_or_default());
            out.push(')');
        }
    }
    list_phrase(phrases, "env ", &report.env_removed, " removed");
    for (name, value) in &report.env_set {
        let out = phrases.next();
        out.push_str(name);
        out.push('=');
        out.push_str(value);
    }
    if !report.volume_mounts_removed.is_empty() {
        let out = phrases.next();
        out.push_str("device mount ");
        for (i, name) in report.volume_mounts_removed.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(name);
            if let Some(path) = facts.device_volumes.get(name) {
                out.push_str(" (");
                out.push_str(path);
                out.push(')');
            }
        }
        out.push_str(" removed");
    }
}

/// The pod-level phrases: device hostPath volumes and annotations removed.
fn write_pod_phrases(phrases: &mut Phrases<'_>, plan: &Plan<'_>) {
    list_phrase(
        phrases,
        "device hostPath volume ",
        &plan.volumes_removed,
        " removed",
    );
    list_phrase(
        phrases,
        "annotation ",
        &plan.annotations_removed,
        " removed",
    );
}

/// Whether the rewrite touches the pod itself (volumes or annotations).
fn touches_pod(plan: &Plan<'_>) -> bool {
    !plan.volumes_removed.is_empty() || !plan.annotations_removed.is_empty()
}

/// One warning per touched container, then one for the pod: `<prefix><label><middle>` and
/// the phrases joined by `; `.
fn push_warnings(
    warnings: &mut Vec<String>,
    plan: &Plan<'_>,
    facts: &PodFacts<'_>,
    prefix: &str,
    middle: &str,
) {
    for c in &plan.containers {
        let mut w = String::with_capacity(160);
        w.push_str(prefix);
        push_label(&mut w, c.kind, c.name);
        w.push_str(middle);
        write_phrases(&mut Phrases::new(&mut w, "; "), c, facts);
        warnings.push(clip(w));
    }
    if touches_pod(plan) {
        let mut w = String::with_capacity(96);
        w.push_str(prefix);
        w.push_str("pod");
        w.push_str(middle);
        write_pod_phrases(&mut Phrases::new(&mut w, "; "), plan);
        warnings.push(clip(w));
    }
}

/// The report, with the containers' parts moved out of the plan.
fn take_report(plan: &mut Plan<'_>, denials: Vec<String>) -> Report {
    let mut report = Report {
        volumes_removed: std::mem::take(&mut plan.volumes_removed),
        annotations_removed: std::mem::take(&mut plan.annotations_removed),
        denials,
        ..Report::default()
    };
    let mut containers: Vec<(String, ContainerReport)> = plan
        .containers
        .drain(..)
        .map(|c| (c.name.to_owned(), c.report))
        .collect();
    // Stable: of containers sharing a name (a malformed pod), the last stays last.
    containers.sort_by(|a, b| a.0.cmp(&b.0));
    for entry in containers {
        match report.containers.last_mut() {
            // As in an object, the last of a repeated name wins.
            Some(last) if last.0 == entry.0 => *last = entry,
            _ => report.containers.push(entry),
        }
    }
    report
}

/// Device volumes that go: those no exempt container mounts (none when the policy keeps
/// device hostPaths).
fn volumes_to_strip<'f>(facts: &'f PodFacts<'_>, policy: &GpuPolicy) -> BTreeSet<&'f str> {
    if !policy.spec.strip_device_host_paths {
        return BTreeSet::new();
    }
    facts
        .device_volumes
        .keys()
        .map(String::as_str)
        .filter(|v| !mounted_by_exempt(facts, v))
        .collect()
}

/// Whether an exempt container mounts volume `name` (it then stays in the pod).
fn mounted_by_exempt(facts: &PodFacts<'_>, name: &str) -> bool {
    facts
        .containers
        .iter()
        .any(|c| c.image_exempt && c.device_mounts.iter().any(|m| m == name))
}

/// How many GPUs a container gets, and where that number came from.
fn gpu_count(
    c: &ContainerInfo<'_>,
    facts: &PodFacts<'_>,
    policy: &GpuPolicy,
) -> Result<(u32, String), String> {
    let mut per_container = String::with_capacity(ANNOTATION_GPU_COUNT.len() + 1 + c.name.len());
    per_container.push_str(ANNOTATION_GPU_COUNT);
    per_container.push('.');
    per_container.push_str(c.name);
    for key in [per_container.as_str(), ANNOTATION_GPU_COUNT] {
        if let Some(raw) = facts.annotations.and_then(|a| a.get(key)) {
            let text = raw.as_str().map(str::trim).unwrap_or("");
            return match text.parse::<u32>() {
                Ok(n) if n >= 1 => Ok((n, concat(&["annotation ", key]))),
                _ => Err(format!(
                    "annotation {key}={raw} is not a whole number of GPUs of at least 1"
                )),
            };
        }
    }
    let default = policy.spec.gpu.default_count;
    match &c.visible {
        VisibleDevices::All => match policy.spec.gpu.visible_devices_all {
            VisibleDevicesAll::DefaultCount => Ok((
                default,
                concat(&[ENV_VISIBLE_DEVICES, "=all, policy default"]),
            )),
            VisibleDevicesAll::Deny => Err(format!(
                "{ENV_VISIBLE_DEVICES}=all is not allowed: request GPUs with limits {} or annotation {ANNOTATION_GPU_COUNT}",
                policy.spec.gpu.resource_name
            )),
        },
        VisibleDevices::Devices(n) => Ok((
            *n,
            concat(&[
                ENV_VISIBLE_DEVICES,
                "=",
                c.visible_raw.as_deref().unwrap_or_default(),
            ]),
        )),
        _ => Ok((default, "policy default".to_owned())),
    }
}

/// How a container's `env` changes.
struct EnvEdit<'s> {
    /// Indices to remove, ascending.
    remove: Vec<usize>,
    /// Entries to append: name, value.
    append: Vec<(String, String)>,
    /// Names removed (each once).
    removed: Vec<String>,
    /// The pair set, when it was not already so.
    set: Option<(&'s str, &'s str)>,
}

/// The edit that removes the `remove` names from a container's env and sets `set`, or `None`
/// when the env is already so. An entry already holding the value stays where it is.
fn rewrite_env<'s>(
    container: &Container<'_>,
    remove: &[&str],
    set: Option<(&'s str, &'s str)>,
) -> Option<EnvEdit<'s>> {
    let env = container.env.as_deref().unwrap_or_default();
    let mut edit = EnvEdit {
        remove: Vec::new(),
        append: Vec::new(),
        removed: Vec::new(),
        set: None,
    };
    let mut set_done = false;
    let mut set_changed = false;
    for (i, entry) in env.iter().enumerate() {
        let name = entry.name.as_deref().unwrap_or("");
        if remove.contains(&name) {
            if !edit.removed.iter().any(|r| r == name) {
                edit.removed.push(name.to_owned());
            }
            edit.remove.push(i);
            continue;
        }
        if let Some((k, v)) = set
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
    if let Some((k, v)) = set
        && !set_done
    {
        set_changed = true;
        edit.append.push((k.to_owned(), v.to_owned()));
    }
    if edit.remove.is_empty() && edit.append.is_empty() {
        return None;
    }
    edit.set = set.filter(|_| set_changed);
    Some(edit)
}

// ---------------------------------------------------------------------------------------
// Deciding.

fn decide_create(input: &Input<'_>, policy: &GpuPolicy) -> Decision {
    let reference = policy.reference();
    if let Some(reason) = pod_exemption(input.pod, input.namespace, policy) {
        let mut d = Decision::new(Verdict::Exempt);
        d.audit_annotations.insert("exempt", reason);
        d.policy = Some(reference);
        return d;
    }
    let facts = read_pod(
        input.pod,
        policy,
        &[
            ContainerKind::Init,
            ContainerKind::Regular,
            ContainerKind::Ephemeral,
        ],
    );
    let triggered = facts
        .containers
        .iter()
        .any(|c| c.privileged && c.gpu && !c.image_exempt);
    if !triggered {
        let exempt = facts
            .containers
            .iter()
            .any(|c| c.privileged && c.gpu && c.image_exempt);
        let mut d = Decision::new(if exempt {
            Verdict::Exempt
        } else {
            Verdict::Unchanged
        });
        if exempt {
            d.audit_annotations.insert(
                "exempt",
                "every privileged GPU container has an exempt image".into(),
            );
        }
        d.policy = Some(reference);
        return d;
    }
    let spec = &policy.spec;
    let strip = volumes_to_strip(&facts, policy);
    let mut plan = plan_pod(&facts, policy, &strip);

    // Pod-level rule 5.
    if !strip.is_empty() {
        let indices: Vec<usize> = input
            .pod
            .volumes()
            .iter()
            .enumerate()
            .filter(|(_, v)| v.name.as_deref().is_some_and(|n| strip.contains(n)))
            .map(|(i, _)| i)
            .collect();
        if !indices.is_empty() {
            plan.volumes_removed = strip.iter().map(|s| (*s).to_owned()).collect();
            plan.changes.push(Change::Volumes { remove: indices });
        }
    }
    if spec.strip_cdi_annotations && !facts.cdi_keys.is_empty() {
        plan.annotations_removed = facts.cdi_keys.clone();
        plan.changes.push(Change::RemoveAnnotations {
            keys: facts.cdi_keys.clone(),
        });
    }

    let mut d = Decision::new(Verdict::Unchanged);
    d.policy = Some(reference.clone());
    d.audit_annotations.insert("policy", reference.clone());
    let summary = summary_line(&plan, &facts);
    match spec.mode {
        PolicyMode::Enforce if !plan.denials.is_empty() => {
            let reasons = plan.denials.join("; ");
            d.verdict = Some(Verdict::Denied);
            d.denial = Some(format!(
                "gpuwarden: pod {} is denied by GpuPolicy {reference} (Enforce): {reasons}",
                input.display_name,
            ));
            d.audit_annotations.insert("decision", "denied".into());
            d.audit_annotations.insert("reason", reasons);
        }
        PolicyMode::Enforce => {
            d.verdict = Some(Verdict::Rewritten);
            push_warnings(&mut d.warnings, &plan, &facts, "gpuwarden: ", ": ");
            let report = take_report(&mut plan, Vec::new()).to_json();
            let mut pairs = Vec::new();
            push_if_changed(&mut pairs, facts.annotations, ANNOTATION_REWRITTEN, report);
            push_if_changed(&mut pairs, facts.annotations, ANNOTATION_POLICY, reference);
            plan.changes.push(Change::SetAnnotations { pairs });
            d.changes = plan.changes;
            d.audit_annotations.insert("decision", "rewritten".into());
            d.audit_annotations.insert("changes", summary);
        }
        PolicyMode::Audit => {
            d.verdict = Some(Verdict::Audited);
            push_warnings(
                &mut d.warnings,
                &plan,
                &facts,
                "gpuwarden audit: ",
                " would change: ",
            );
            for denial in &plan.denials {
                d.warnings.push(clip(concat(&[
                    "gpuwarden audit: Enforce would deny: ",
                    denial,
                ])));
            }
            let denials = std::mem::take(&mut plan.denials);
            let report = take_report(&mut plan, denials).to_json();
            let mut pairs = Vec::new();
            push_if_changed(&mut pairs, facts.annotations, ANNOTATION_AUDIT, report);
            if !pairs.is_empty() {
                d.changes.push(Change::SetAnnotations { pairs });
            }
            d.audit_annotations.insert("decision", "audited".into());
            d.audit_annotations.insert("changes", summary);
        }
        PolicyMode::Deny => {
            d.verdict = Some(Verdict::Denied);
            let mut message = format!(
                "gpuwarden: pod {} has privileged GPU containers, which GpuPolicy {reference} (Deny) rejects. To be admitted it needs: {summary}",
                input.display_name,
            );
            if !plan.denials.is_empty() {
                message.push_str(". It also cannot be rewritten as is: ");
                message.push_str(&plan.denials.join("; "));
            }
            message.push_str(". `");
            message.push_str(OFFLINE_COMMAND);
            message.push_str("` writes the admissible manifest.");
            d.denial = Some(message);
            d.audit_annotations.insert("decision", "denied".into());
            d.audit_annotations.insert("changes", summary);
        }
    }
    d
}

fn push_if_changed(
    pairs: &mut Vec<(String, String)>,
    annotations: Option<&Map<'_>>,
    key: &str,
    value: String,
) {
    if annotations
        .and_then(|a| a.get(key))
        .and_then(|v| v.as_str())
        != Some(value.as_str())
    {
        pairs.push((key.to_owned(), value));
    }
}

/// One line for the audit log: `container train: privileged removed, ...; pod: ...`.
fn summary_line(plan: &Plan<'_>, facts: &PodFacts<'_>) -> String {
    let mut line = String::with_capacity(256);
    for (i, c) in plan.containers.iter().enumerate() {
        if i > 0 {
            line.push_str("; ");
        }
        push_label(&mut line, c.kind, c.name);
        line.push_str(": ");
        write_phrases(&mut Phrases::new(&mut line, ", "), c, facts);
    }
    if touches_pod(plan) {
        if !plan.containers.is_empty() {
            line.push_str("; ");
        }
        line.push_str("pod: ");
        write_pod_phrases(&mut Phrases::new(&mut line, ", "), plan);
    }
    line
}

fn decide_ephemeral(input: &Input<'_>, old: &PodView<'_>, policy: &GpuPolicy) -> Decision {
    let reference = policy.reference();
    if let Some(reason) = pod_exemption(input.pod, input.namespace, policy) {
        let mut d = Decision::new(Verdict::Exempt);
        d.audit_annotations.insert("exempt", reason);
        d.policy = Some(reference);
        return d;
    }
    let kind = ContainerKind::Ephemeral;
    let existing: BTreeSet<&str> = old
        .containers(kind)
        .iter()
        .filter_map(|c| c.name.as_deref())
        .collect();
    let images = &policy.spec.exemptions.images;
    let offending: Vec<String> = input
        .pod
        .containers(kind)
        .iter()
        .filter(|c| {
            let name = c.name.as_deref().unwrap_or("");
            let privileged = c.is_privileged();
            let image = c.image.as_deref().unwrap_or("");
            !existing.contains(name) && privileged && !image_exempt(image, images)
        })
        .map(|c| c.name.as_deref().unwrap_or("").to_owned())
        .collect();
    let mut d = Decision::new(Verdict::Unchanged);
    d.policy = Some(reference.clone());
    if offending.is_empty() {
        return d;
    }
    d.audit_annotations.insert("policy", reference.clone());
    let names = offending.join(", ");
    if policy.spec.mode == PolicyMode::Audit {
        d.verdict = Some(Verdict::Audited);
        d.warnings.push(clip(format!(
            "gpuwarden audit: privileged ephemeral container {names} would be denied by GpuPolicy {reference}; it sees every GPU on the node"
        )));
        d.audit_annotations.insert("decision", "audited".into());
    } else {
        d.verdict = Some(Verdict::Denied);
        d.denial = Some(format!(
            "gpuwarden: privileged ephemeral container {names} on pod {} is denied by GpuPolicy {reference} ({}): a privileged container sees every GPU on the node and ephemeral containers cannot request GPUs; use an unprivileged debug profile such as `kubectl debug --profile=general`",
            input.display_name, policy.spec.mode
        ));
        d.audit_annotations.insert("decision", "denied".into());
    }
    d
}

// ---------------------------------------------------------------------------------------
// Small helpers.

/// The container `at` points to in `pod`.
pub(crate) fn container_value<'p, 'a>(
    pod: &'p PodView<'a>,
    at: &ContainerRef,
) -> Option<&'p Container<'a>> {
    pod.containers(at.kind).get(at.index)
}

/// The parts in one string, allocated once.
fn concat(parts: &[&str]) -> String {
    let mut out = String::with_capacity(parts.iter().map(|p| p.len()).sum());
    for part in parts {
        out.push_str(part);
    }
    out
}

/// Cuts a warning to [`MAX_WARNING_LEN`] bytes on a character boundary.
fn clip(mut s: String) -> String {
    if s.len() > MAX_WARNING_LEN {
        let mut end = MAX_WARNING_LEN - 3;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("...");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visible_devices_parsing() {
        assert_eq!(VisibleDevices::parse("all"), VisibleDevices::All);
        assert_eq!(VisibleDevices::parse(" ALL "), VisibleDevices::All);
        assert_eq!(VisibleDevices::parse("none"), VisibleDevices::NoGpu);
        assert_eq!(VisibleDevices::parse("void"), VisibleDevices::NoGpu);
        assert_eq!(VisibleDevices::parse(""), VisibleDevices::NoGpu);
        assert_eq!(VisibleDevices::parse(" , "), VisibleDevices::NoGpu);
        assert_eq!(VisibleDevices::parse("0,1"), VisibleDevices::Devices(2));
        assert_eq!(VisibleDevices::parse("0, 1,1"), VisibleDevices::Devices(2));
        assert_eq!(
            VisibleDevices::parse("GPU-8f2c3b1a-1111-2222-3333-444455556666"),
            VisibleDevices::Devices(1)
        );
        assert_eq!(
            VisibleDevices::parse(
                "MIG-2a3b4c5d-aaaa-bbbb-cccc-ddddeeeeffff,MIG-GPU-8f2c3b1a-1111-2222-3333-444455556666/1/0,0:1"
            ),
            VisibleDevices::Devices(3)
        );
        assert!(!VisibleDevices::parse("void").is_gpu_signal());
        assert!(VisibleDevices::parse("3").is_gpu_signal());
    }

    #[test]
    fn device_paths() {
        for p in [
            "/dev",
            "/dev/",
            "/dev/nvidia0",
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/dri",
            "/dev/dri/card0",
            "//dev/./nvidia1",
            "/host/../dev",
        ] {
            assert!(is_device_host_path(p), "{p}");
        }
        for p in [
            "/dev/shm",
            "/devices",
            "/var/lib/nvidia",
            "/dev/fuse",
            "/",
            "/driver",
        ] {
            assert!(!is_device_host_path(p), "{p}");
        }
    }

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
            let cap = normalise_cap(raw);
            assert_eq!(cap, normal, "{raw:?}");
            assert_eq!(matches!(cap, Cow::Borrowed(_)), borrowed, "{raw:?}");
        }
    }

    #[test]
    fn warnings_are_clipped_on_char_boundaries() {
        let s = clip("é".repeat(300));
        assert!(s.len() <= MAX_WARNING_LEN);
        assert!(s.ends_with("..."));
    }

    #[test]
    fn the_report_is_written_as_serde_writes_it() {
        let full = ContainerReport {
            kind: Some("init"),
            privileged: false,
            gpu: true,
            capabilities_added: vec!["SYS_NICE".into(), "IPC_LOCK".into()],
            capabilities_dropped: vec!["ALL".into()],
            capabilities_refused: vec!["SYS_ADMIN".into()],
            limits: vec![("nvidia.com/gpu".into(), "2".into())],
            gpu_count_from: Some("annotation gpuwarden.io/gpu-count".into()),
            env_removed: vec!["NVIDIA_VISIBLE_DEVICES".into()],
            env_set: vec![
                (
                    "NVIDIA_DRIVER_CAPABILITIES".into(),
                    "compute,utility".into(),
                ),
                ("B".into(), "quote \" backslash \\ tab \t é\u{1}".into()),
            ],
            volume_mounts_removed: vec!["dev".into()],
        };
        let sidecar = ContainerReport {
            privileged: true,
            ..ContainerReport::default()
        };
        let reports = [
            Report::default(),
            Report {
                containers: vec![("side".into(), sidecar), ("trainer \"a\"".into(), full)],
                volumes_removed: vec!["dev".into()],
                annotations_removed: vec!["cdi.k8s.io/x".into()],
                denials: vec!["init container x: too many GPUs".into()],
            },
        ];
        for report in reports {
            assert_eq!(report.to_json(), serde_json::to_string(&report).unwrap());
        }
    }
}
