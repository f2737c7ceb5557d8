//! GpuPolicy validation beyond what the CRD's CEL rules can check, and the `Ready` condition
//! it yields. Pure: the operator reports it in status, and the webhook's offline command and
//! `serve --policy-file` refuse a policy with a problem (they fail closed).
//!
//! CEL sees one object at a time; overlaps between policies of equal priority, capability
//! names, counts, exemption patterns and selector semantics are checked here.

use std::collections::{BTreeMap, BTreeSet};

use crate::bounds::resource_pattern_problem;
use crate::condition_types::READY;
use crate::conditions::DesiredCondition;
use crate::duration::parse_duration;
use crate::policy::{ContainerExemption, GpuPolicy, GpuPolicySpec, KaiSharing};
use crate::selector;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

/// Linux capabilities (`capabilities(7)`, as of Linux 6.x), without the `CAP_` prefix.
pub const LINUX_CAPABILITIES: &[&str] = &[
    "AUDIT_CONTROL",
    "AUDIT_READ",
    "AUDIT_WRITE",
    "BLOCK_SUSPEND",
    "BPF",
    "CHECKPOINT_RESTORE",
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "IPC_LOCK",
    "IPC_OWNER",
    "KILL",
    "LEASE",
    "LINUX_IMMUTABLE",
    "MAC_ADMIN",
    "MAC_OVERRIDE",
    "MKNOD",
    "NET_ADMIN",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_RAW",
    "PERFMON",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_CHROOT",
    "SYS_MODULE",
    "SYS_NICE",
    "SYS_PACCT",
    "SYS_PTRACE",
    "SYS_RAWIO",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "SYSLOG",
    "WAKE_ALARM",
];

/// One reason a policy is not valid. The first problem found becomes the `Ready` reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// CamelCase reason for the `Ready` condition.
    pub reason: &'static str,
    /// What is wrong and where, for the condition message.
    pub message: String,
}

fn problem(reason: &'static str, message: impl Into<String>) -> Problem {
    Problem {
        reason,
        message: message.into(),
    }
}

/// What one label key is constrained to by a pair of selectors.
#[derive(Default)]
struct KeyConstraint {
    /// The key must exist.
    exists: bool,
    /// The key must not exist.
    absent: bool,
    /// The value must be one of these (intersection of every `In`/`matchLabels`).
    allowed: Option<BTreeSet<String>>,
    /// The value must be none of these.
    forbidden: BTreeSet<String>,
}

impl KeyConstraint {
    fn allow(&mut self, values: impl IntoIterator<Item = String>) {
        let values: BTreeSet<String> = values.into_iter().collect();
        self.exists = true;
        self.allowed = Some(match self.allowed.take() {
            Some(prev) => prev.intersection(&values).cloned().collect(),
            None => values,
        });
    }

    fn satisfiable(&self) -> bool {
        if self.absent {
            return !self.exists;
        }
        match &self.allowed {
            Some(allowed) => allowed.iter().any(|v| !self.forbidden.contains(v)),
            // Exists / NotIn alone leave infinitely many values.
            None => true,
        }
    }
}

fn constrain(constraints: &mut BTreeMap<String, KeyConstraint>, sel: &LabelSelector) {
    for (k, v) in sel.match_labels.iter().flatten() {
        constraints.entry(k.clone()).or_default().allow([v.clone()]);
    }
    for e in sel.match_expressions.iter().flatten() {
        let c = constraints.entry(e.key.clone()).or_default();
        let values = e.values.clone().unwrap_or_default();
        match e.operator.as_str() {
            "In" => c.allow(values),
            "NotIn" => c.forbidden.extend(values),
            "Exists" => c.exists = true,
            "DoesNotExist" => c.absent = true,
            // Malformed selectors are reported on their own; treat them as matching anything.
            _ => {}
        }
    }
}

/// Whether some label set could satisfy both selectors. Two selectors overlap unless they
/// are provably disjoint (conflicting `matchLabels`, disjoint `In` values, `In` against
/// `NotIn`, `Exists` against `DoesNotExist`).
pub fn selectors_overlap(a: &LabelSelector, b: &LabelSelector) -> bool {
    let mut constraints = BTreeMap::new();
    constrain(&mut constraints, a);
    constrain(&mut constraints, b);
    constraints.values().all(KeyConstraint::satisfiable)
}

/// Whether two policies could select the same pod.
pub fn policies_overlap(a: &GpuPolicy, b: &GpuPolicy) -> bool {
    let all = LabelSelector::default();
    selectors_overlap(&a.spec.namespace_selector, &b.spec.namespace_selector)
        && selectors_overlap(
            a.spec.pod_selector.as_ref().unwrap_or(&all),
            b.spec.pod_selector.as_ref().unwrap_or(&all),
        )
}

/// Whether `pattern` is a well-formed image glob (`*`, `?`, no brackets or empty parts).
fn image_pattern_problem(pattern: &str) -> Option<&'static str> {
    if pattern.trim().is_empty() {
        Some("is empty")
    } else if pattern.chars().any(char::is_whitespace) {
        Some("contains whitespace")
    } else if pattern.contains(['[', ']', '{', '}']) {
        Some("uses brackets or braces; only * and ? are supported")
    } else if pattern.chars().all(|c| c == '*') {
        Some("matches every image, so no container would ever be governed")
    } else {
        None
    }
}

/// Problems with one policy on its own: one check per field group of the spec. The order is
/// the order of the problems, and the first becomes the `Ready` reason.
pub fn validate_policy(policy: &GpuPolicy) -> Vec<Problem> {
    const CHECKS: [fn(&GpuPolicySpec, &mut Vec<Problem>); 9] = [
        check_selectors,
        check_capabilities,
        check_gpu,
        check_health,
        check_container_exemptions,
        check_match,
        check_rdma_resources,
        check_virtual_machines,
        check_pod_exemptions,
    ];
    let mut out = Vec::new();
    for check in CHECKS {
        check(&policy.spec, &mut out);
    }
    out
}

/// `namespaceSelector`, `podSelector` and `health.nodeSelector`: selectors the API server
/// would have rejected.
fn check_selectors(spec: &GpuPolicySpec, out: &mut Vec<Problem>) {
    let namespaces = Some(("namespaceSelector", &spec.namespace_selector));
    let pods = spec.pod_selector.as_ref().map(|pod| ("podSelector", pod));
    let nodes = (spec.health.as_ref()).map(|health| ("health.nodeSelector", &health.node_selector));
    for (field, sel) in [namespaces, pods, nodes].into_iter().flatten() {
        if let Err(e) = selector::validate(sel) {
            out.push(problem("InvalidSelector", format!("spec.{field}: {e}")));
        }
    }
}

/// `capabilities`: Linux capabilities by their names, and never `SYS_ADMIN`.
fn check_capabilities(spec: &GpuPolicySpec, out: &mut Vec<Problem>) {
    for (field, caps) in [
        ("capabilities.default", &spec.capabilities.default),
        ("capabilities.allowed", &spec.capabilities.allowed),
    ] {
        let unknown: Vec<&str> = caps
            .iter()
            .map(String::as_str)
            .filter(|c| !LINUX_CAPABILITIES.contains(c))
            .collect();
        if !unknown.is_empty() {
            out.push(problem(
                "UnknownCapability",
                format!(
                    "spec.{field}: unknown Linux capabilities {} (names are written without CAP_, e.g. IPC_LOCK)",
                    unknown.join(", ")
                ),
            ));
        }
    }
    if spec
        .capabilities
        .default
        .iter()
        .chain(&spec.capabilities.allowed)
        .any(|c| c == "SYS_ADMIN")
    {
        out.push(problem(
            "CapabilityDefeatsPolicy",
            "spec.capabilities: SYS_ADMIN gives back most of what privileged did; remove it",
        ));
    }
}

/// `gpu`: a default count the maximum allows, a device class that is a DNS subdomain, and
/// KAI sharing ([`check_kai_sharing`]).
fn check_gpu(spec: &GpuPolicySpec, out: &mut Vec<Problem>) {
    let gpu = &spec.gpu;
    if gpu.default_count > gpu.max_per_container {
        out.push(problem(
            "InvalidCount",
            format!(
                "spec.gpu.defaultCount {} is more than spec.gpu.maxPerContainer {}: every container given the default would be denied",
                gpu.default_count, gpu.max_per_container
            ),
        ));
    }
    let class = gpu.device_class_name.as_str();
    if class.len() > crate::claims::DEVICE_CLASS_LEN || !class.split('.').all(is_label) {
        out.push(problem(
            "InvalidDeviceClass",
            format!(
                "spec.gpu.deviceClassName {class:?} is not a DNS subdomain of at most {} characters, such as gpu.nvidia.com",
                crate::claims::DEVICE_CLASS_LEN
            ),
        ));
    }
    if let Some(kai) = gpu.sharing.as_ref().and_then(|s| s.kai.as_ref()) {
        check_kai_sharing(kai, out);
    }
}

/// Whether `l` is spelled as a DNS label: lower-case letters, digits and `-`, not at either
/// end. Its length is checked apart.
fn is_label(l: &str) -> bool {
    !l.is_empty()
        && l.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !l.starts_with('-')
        && !l.ends_with('-')
}

/// `gpu.sharing.kai`: the binder's service account, the reservation namespace and the
/// scheduler. The CRD's schema says the same; an object written before it, or a file given
/// to `mutate --policy`, meets it here.
fn check_kai_sharing(kai: &KaiSharing, out: &mut Vec<Problem>) {
    let binder = kai.binder.split_once('/');
    let binder_ok = binder.is_some_and(|(ns, sa)| {
        is_label(ns) && ns.len() <= crate::bounds::DNS_LABEL_LEN && sa.split('.').all(is_label)
    });
    let namespace_ok = is_label(&kai.reservation_namespace)
        && kai.reservation_namespace.len() <= crate::bounds::DNS_LABEL_LEN;
    let wrong: Vec<String> = [
        (!binder_ok).then(|| {
            format!(
                "binder {:?} is not <namespace>/<service account>",
                kai.binder
            )
        }),
        (!namespace_ok).then(|| {
            format!(
                "reservationNamespace {:?} is not a namespace name",
                kai.reservation_namespace
            )
        }),
        kai.scheduler_name
            .is_empty()
            .then(|| "schedulerName is empty".to_owned()),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !wrong.is_empty() {
        out.push(problem(
            "InvalidKaiSharing",
            format!("spec.gpu.sharing.kai: {}", wrong.join("; ")),
        ));
    }
}

/// `health`: `recoverAfter` is a duration (its `nodeSelector` is checked with the other
/// selectors).
fn check_health(spec: &GpuPolicySpec, out: &mut Vec<Problem>) {
    if let Some(health) = &spec.health
        && let Err(e) = parse_duration(&health.recover_after)
    {
        out.push(problem(
            "InvalidRecoverAfter",
            format!("spec.health.recoverAfter: {e}"),
        ));
    }
}

/// `exemptions.images` and `exemptions.containers`: what exempts a container by its image.
/// The removed field is a problem of its own; each container entry is checked by
/// [`check_container_exemption`].
fn check_container_exemptions(spec: &GpuPolicySpec, out: &mut Vec<Problem>) {
    let ex = &spec.exemptions;
    if !ex.images.is_empty() {
        out.push(problem(
            "RemovedField",
            format!(
                "spec.exemptions.images was removed: an image pattern alone no longer exempts anything. Move {} under spec.exemptions.containers with the namespaces or serviceAccounts where it applies",
                ex.images.join(", ")
            ),
        ));
    }
    for (i, entry) in ex.containers.iter().enumerate() {
        check_container_exemption(ContainersAt(i), entry, out);
    }
}

/// One `exemptions.containers` entry: scoped to namespaces or service accounts, with image
/// patterns, `namespace/name` accounts and `sha256:` digests.
fn check_container_exemption(at: ContainersAt, entry: &ContainerExemption, out: &mut Vec<Problem>) {
    if entry.namespaces.is_empty() && entry.service_accounts.is_empty() {
        out.push(problem(
            "ConflictingExemptions",
            format!("{at}: names no namespaces or serviceAccounts, so it would exempt its images everywhere"),
        ));
    }
    if entry.images.is_empty() {
        out.push(problem(
            "ConflictingExemptions",
            format!("{at}.images is empty"),
        ));
    }
    for pattern in &entry.images {
        if let Some(why) = image_pattern_problem(pattern) {
            out.push(problem(
                "ConflictingExemptions",
                format!("{at}.images: pattern {pattern:?} {why}"),
            ));
        }
    }
    for sa in &entry.service_accounts {
        if !matches!(sa.split_once('/'), Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/'))
        {
            out.push(problem(
                "ConflictingExemptions",
                format!("{at}.serviceAccounts: {sa:?} is not namespace/name"),
            ));
        }
    }
    for digest in &entry.digests {
        let hex = digest.strip_prefix("sha256:").unwrap_or("");
        if hex.len() != 64 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            out.push(problem(
                "ConflictingExemptions",
                format!("{at}.digests: {digest:?} is not sha256:<64 lower-case hex digits>"),
            ));
        }
    }
}

/// `match`: the GPU image patterns, and the GPU resource patterns.
fn check_match(spec: &GpuPolicySpec, out: &mut Vec<Problem>) {
    for pattern in &spec.match_.gpu_images {
        // `*` alone is allowed here: it makes every privileged container a GPU container.
        if let Some(why) =
            image_pattern_problem(pattern).filter(|_| !pattern.chars().all(|c| c == '*'))
        {
            out.push(problem(
                "InvalidPattern",
                format!("spec.match.gpuImages: pattern {pattern:?} {why}"),
            ));
        }
    }
    check_resource_patterns("match.gpuResources", &spec.match_.gpu_resources, out);
}

/// `rdmaResources`: resource patterns.
fn check_rdma_resources(spec: &GpuPolicySpec, out: &mut Vec<Problem>) {
    check_resource_patterns("rdmaResources", &spec.rdma_resources, out);
}

/// Each of `patterns`, the list at `spec.<field>`, is an extended-resource glob
/// ([`resource_pattern_problem`]).
fn check_resource_patterns(field: &str, patterns: &[String], out: &mut Vec<Problem>) {
    for pattern in patterns {
        if let Some(why) = resource_pattern_problem(pattern) {
            out.push(problem(
                "InvalidPattern",
                format!("spec.{field}: pattern {pattern:?} {why}"),
            ));
        }
    }
}

/// `virtualMachines`: resource patterns, controllers' user names, and runtime-class patterns
/// that do not match every class.
fn check_virtual_machines(spec: &GpuPolicySpec, out: &mut Vec<Problem>) {
    let vms = &spec.virtual_machines;
    check_resource_patterns(
        "virtualMachines.deviceResources",
        &vms.device_resources,
        out,
    );
    for user in &vms.controllers {
        if user.is_empty() || user.trim() != user {
            out.push(problem(
                "InvalidPattern",
                format!("spec.virtualMachines.controllers: {user:?} is not a user name"),
            ));
        }
    }
    for pattern in &vms.runtime_classes {
        let why = match image_pattern_problem(pattern) {
            _ if pattern.chars().all(|c| c == '*') && !pattern.is_empty() => {
                Some("matches every runtime class, so any pod could hold VM devices")
            }
            why => why,
        };
        if let Some(why) = why {
            out.push(problem(
                "InvalidPattern",
                format!("spec.virtualMachines.runtimeClasses: pattern {pattern:?} {why}"),
            ));
        }
    }
}

/// `exemptions.serviceAccounts` and `exemptions.namespaces`: what exempts a whole pod. An
/// account is `namespace/name` outside the exempt namespaces, and the exempt namespaces do
/// not cover every namespace the selector picks by name.
fn check_pod_exemptions(spec: &GpuPolicySpec, out: &mut Vec<Problem>) {
    let ex = &spec.exemptions;
    // Checked on every admission review (fail closed), so the valid path allocates nothing.
    let exempt_ns = |ns: &str| ex.namespaces.iter().any(|n| n == ns);
    for sa in &ex.service_accounts {
        match sa.split_once('/') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                if exempt_ns(ns) {
                    out.push(problem(
                        "ConflictingExemptions",
                        format!(
                            "spec.exemptions.serviceAccounts: {sa:?} is in namespace {ns:?}, which is exempt as a whole"
                        ),
                    ));
                }
            }
            _ => out.push(problem(
                "ConflictingExemptions",
                format!("spec.exemptions.serviceAccounts: {sa:?} is not namespace/name"),
            )),
        }
    }
    // A policy that selects namespaces only by name, all of which are exempt, governs nothing.
    if let Some(selected) = names_selected_only(&spec.namespace_selector)
        && !selected.is_empty()
        && selected.iter().all(|n| exempt_ns(n))
    {
        out.push(problem(
            "ConflictingExemptions",
            format!(
                "spec.exemptions.namespaces exempts every namespace spec.namespaceSelector selects ({})",
                selected.into_iter().collect::<Vec<_>>().join(", ")
            ),
        ));
    }
}

/// `spec.exemptions.containers[i]`, written only when a problem names it.
struct ContainersAt(usize);

impl std::fmt::Display for ContainersAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "spec.exemptions.containers[{}]", self.0)
    }
}

/// The namespaces a selector picks when it selects by `kubernetes.io/metadata.name` only.
fn names_selected_only(sel: &LabelSelector) -> Option<BTreeSet<String>> {
    let mut c = BTreeMap::new();
    constrain(&mut c, sel);
    if c.len() != 1 {
        return None;
    }
    let k = c.get(crate::LABEL_NAMESPACE_NAME)?;
    let allowed = k.allowed.as_ref()?;
    Some(allowed.difference(&k.forbidden).cloned().collect())
}

/// Problems a policy has with the others: equal priority and selectors that could select the
/// same pod, which leaves the winner to name order.
pub fn conflicts(policy: &GpuPolicy, all: &[&GpuPolicy]) -> Vec<Problem> {
    let name = policy.metadata.name.as_deref().unwrap_or_default();
    let mut others: Vec<&str> = all
        .iter()
        .filter(|o| o.metadata.name.as_deref().unwrap_or_default() != name)
        .filter(|o| o.metadata.deletion_timestamp.is_none())
        .filter(|o| o.spec.priority == policy.spec.priority)
        .filter(|o| policies_overlap(policy, o))
        .map(|o| o.metadata.name.as_deref().unwrap_or_default())
        .collect();
    others.sort_unstable();
    if others.is_empty() {
        return Vec::new();
    }
    vec![problem(
        "OverlappingPriority",
        format!(
            "priority {} is shared with {} whose selectors can select the same pods; the winner \
             would be decided by name order. Give them different priorities or disjoint selectors",
            policy.spec.priority,
            others.join(", ")
        ),
    )]
}

/// Every problem of `policy`: on its own, and with the other policies in `all`.
pub fn problems(policy: &GpuPolicy, all: &[&GpuPolicy]) -> Vec<Problem> {
    let mut problems = validate_policy(policy);
    problems.extend(conflicts(policy, all));
    problems
}

/// The first problem of any of `policies` (in their order), with its policy's index: what
/// a fail-closed reader of a policy file refuses the file for.
pub fn first_problem(policies: &[&GpuPolicy]) -> Option<(usize, Problem)> {
    policies.iter().enumerate().find_map(|(i, p)| {
        problems(p, policies)
            .into_iter()
            .next()
            .map(|problem| (i, problem))
    })
}

/// The `Ready` condition for a policy, given every policy in the cluster.
pub fn ready_condition(policy: &GpuPolicy, all: &[&GpuPolicy]) -> DesiredCondition {
    match problems(policy, all).split_first() {
        None => DesiredCondition::new(
            READY,
            true,
            "Valid",
            format!("policy is valid and in force ({} mode)", policy.spec.mode),
        ),
        Some((first, rest)) => {
            let mut message = first.message.clone();
            for p in rest {
                message.push_str("; ");
                message.push_str(&p.message);
            }
            DesiredCondition::new(READY, false, first.reason, message)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GpuPolicySpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    #[test]
    fn the_crd_knows_the_same_capabilities() {
        use kube::CustomResourceExt;
        let crd = serde_json::to_value(GpuPolicy::crd()).unwrap();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        for field in ["default", "allowed"] {
            let rule =
                spec["properties"]["capabilities"]["properties"][field]["x-kubernetes-validations"]
                    [0]["rule"]
                    .as_str()
                    .unwrap_or_default();
            let listed: Vec<&str> = rule
                .split(['[', ']'])
                .nth(1)
                .unwrap_or_default()
                .split(", ")
                .map(|c| c.trim_matches('\''))
                .collect();
            assert_eq!(listed, LINUX_CAPABILITIES, "capabilities.{field}: {rule}");
        }
    }

    fn policy(name: &str, priority: i32, ns: LabelSelector) -> GpuPolicy {
        let mut p = GpuPolicy::default_policy();
        p.metadata.name = Some(name.into());
        p.spec = GpuPolicySpec {
            priority,
            namespace_selector: ns,
            ..p.spec
        };
        p
    }

    fn ml(pairs: &[(&str, &str)]) -> LabelSelector {
        LabelSelector {
            match_labels: Some(
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            match_expressions: None,
        }
    }

    fn expr(key: &str, op: &str, values: &[&str]) -> LabelSelector {
        LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: key.into(),
                operator: op.into(),
                values: (!values.is_empty())
                    .then(|| values.iter().map(|s| s.to_string()).collect()),
            }]),
        }
    }

    #[test]
    fn default_policy_is_valid() {
        let p = GpuPolicy::default_policy();
        assert_eq!(validate_policy(&p), vec![]);
        let c = ready_condition(&p, &[&p]);
        assert_eq!((c.status, c.reason.as_str()), ("True", "Valid"));
    }

    #[test]
    fn kai_sharing_names_a_binder_and_a_namespace() {
        let mut p = GpuPolicy::default_policy();
        p.spec.gpu.sharing = Some(crate::SharingSpec {
            kai: Some(crate::KaiSharing::default()),
        });
        assert_eq!(validate_policy(&p), vec![]);
        let kai = p
            .spec
            .gpu
            .sharing
            .as_mut()
            .and_then(|s| s.kai.as_mut())
            .unwrap();
        kai.binder = "not a service account".into();
        kai.reservation_namespace = "KAI".into();
        kai.scheduler_name = String::new();
        let problems = validate_policy(&p);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(problems[0].reason, "InvalidKaiSharing");
        for part in [
            "binder \"not a service account\"",
            "reservationNamespace \"KAI\"",
            "schedulerName is empty",
        ] {
            assert!(
                problems[0].message.contains(part),
                "{}",
                problems[0].message
            );
        }
        let kai = p
            .spec
            .gpu
            .sharing
            .as_mut()
            .and_then(|s| s.kai.as_mut())
            .unwrap();
        *kai = crate::KaiSharing {
            binder: "kai/binder.v2".into(),
            ..Default::default()
        };
        assert_eq!(validate_policy(&p), vec![]);
    }

    #[test]
    fn overlap_unless_provably_disjoint() {
        let all = LabelSelector::default();
        assert!(selectors_overlap(&all, &ml(&[("team", "a")])));
        assert!(!selectors_overlap(
            &ml(&[("team", "a")]),
            &ml(&[("team", "b")])
        ));
        assert!(selectors_overlap(
            &ml(&[("team", "a")]),
            &ml(&[("env", "prod")])
        ));
        assert!(!selectors_overlap(
            &expr("team", "In", &["a", "b"]),
            &expr("team", "In", &["c"])
        ));
        assert!(selectors_overlap(
            &expr("team", "In", &["a", "b"]),
            &expr("team", "In", &["b"])
        ));
        assert!(!selectors_overlap(
            &ml(&[("team", "a")]),
            &expr("team", "NotIn", &["a"])
        ));
        assert!(!selectors_overlap(
            &expr("team", "Exists", &[]),
            &expr("team", "DoesNotExist", &[])
        ));
        assert!(!selectors_overlap(
            &ml(&[("team", "a")]),
            &expr("team", "DoesNotExist", &[])
        ));
        assert!(selectors_overlap(
            &expr("team", "NotIn", &["a"]),
            &expr("team", "NotIn", &["b"])
        ));
    }

    #[test]
    fn equal_priority_overlap_is_reported_on_both() {
        let a = policy("a", 10, ml(&[("team", "ml")]));
        let b = policy("b", 10, LabelSelector::default());
        let c = policy("c", 10, ml(&[("team", "web")]));
        let d = policy("d", 20, LabelSelector::default());
        let all = [&a, &b, &c, &d];
        let ra = ready_condition(&a, &all);
        assert_eq!(
            (ra.status, ra.reason.as_str()),
            ("False", "OverlappingPriority")
        );
        assert!(ra.message.contains("shared with b whose"), "{}", ra.message);
        let rb = ready_condition(&b, &all);
        assert!(rb.message.contains("a, c"), "{}", rb.message);
        assert_eq!(ready_condition(&d, &all).status, "True");
        // Disjoint pod selectors make equal priorities fine.
        let mut e = policy("e", 30, LabelSelector::default());
        e.spec.pod_selector = Some(ml(&[("app", "x")]));
        let mut f = policy("f", 30, LabelSelector::default());
        f.spec.pod_selector = Some(ml(&[("app", "y")]));
        assert_eq!(ready_condition(&e, &[&e, &f]).status, "True");
    }

    #[test]
    fn bad_fields_are_reported_with_reasons() {
        let mut p = policy("p", 1, LabelSelector::default());
        p.spec.capabilities.allowed.push("NET_PWN".into());
        let c = ready_condition(&p, &[&p]);
        assert_eq!(
            (c.status, c.reason.as_str()),
            ("False", "UnknownCapability")
        );
        assert!(c.message.contains("NET_PWN"));

        let mut p = policy("p", 1, expr("team", "Equals", &["a"]));
        assert_eq!(ready_condition(&p, &[&p]).reason, "InvalidSelector");
        p.spec.namespace_selector = LabelSelector::default();
        p.spec.health.as_mut().unwrap().recover_after = "soon".into();
        let c = ready_condition(&p, &[&p]);
        assert_eq!(c.reason, "InvalidRecoverAfter");
        assert!(c.message.contains("soon"));

        let mut p = policy("p", 1, LabelSelector::default());
        p.spec.exemptions.containers[0].images.push("*".into());
        assert_eq!(ready_condition(&p, &[&p]).reason, "ConflictingExemptions");
        let mut p = policy("p", 1, LabelSelector::default());
        p.spec.exemptions.containers[0].namespaces.clear();
        let c = ready_condition(&p, &[&p]);
        assert_eq!(c.reason, "ConflictingExemptions");
        assert!(
            c.message
                .contains("spec.exemptions.containers[0]: names no namespaces"),
            "{}",
            c.message
        );
        let mut p = policy("p", 1, LabelSelector::default());
        p.spec.virtual_machines.runtime_classes.push("*".into());
        p.spec.virtual_machines.controllers.push(String::new());
        p.spec
            .virtual_machines
            .device_resources
            .push("GRID_*".into());
        let c = ready_condition(&p, &[&p]);
        assert_eq!(c.reason, "InvalidPattern");
        for field in ["runtimeClasses", "controllers", "deviceResources"] {
            assert!(c.message.contains(field), "{field}: {}", c.message);
        }
        // The removed field: a policy that still relies on it is invalid, and says how to move.
        let mut p = policy("p", 1, LabelSelector::default());
        p.spec
            .exemptions
            .images
            .push("nvcr.io/nvidia/k8s/dcgm-exporter:*".into());
        let c = ready_condition(&p, &[&p]);
        assert_eq!(c.reason, "RemovedField");
        assert!(
            c.message.contains("under spec.exemptions.containers"),
            "{}",
            c.message
        );
        let mut p = policy("p", 1, LabelSelector::default());
        p.spec
            .exemptions
            .service_accounts
            .push("kube-system/foo".into());
        assert_eq!(ready_condition(&p, &[&p]).reason, "ConflictingExemptions");
        let p = policy(
            "p",
            1,
            expr(
                "kubernetes.io/metadata.name",
                "In",
                &["kube-system", "gpuwarden-system"],
            ),
        );
        let c = ready_condition(&p, &[&p]);
        assert_eq!(c.reason, "ConflictingExemptions");
        assert!(c.message.contains("every namespace"), "{}", c.message);
        let mut p = policy("p", 1, LabelSelector::default());
        p.spec.capabilities.default.push("SYS_ADMIN".into());
        assert_eq!(ready_condition(&p, &[&p]).reason, "CapabilityDefeatsPolicy");
    }
}
