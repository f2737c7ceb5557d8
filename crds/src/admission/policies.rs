//! GpuPolicies rendered into admission policies that the API server runs itself
//! (docs/design.md, "Inside the API server"). The operator keeps these objects; this module
//! only writes them.
//!
//! For each GpuPolicy in Enforce mode, a MutatingAdmissionPolicy and its binding rewrite the
//! privileged GPU pods CEL can ([`super::rewrite`]) and, with
//! `voidNonGpuContainers`, set `NVIDIA_VISIBLE_DEVICES=void` on every container that holds no
//! GPU (the void rule, `void_rule`). In Audit mode a ValidatingAdmissionPolicy bound with
//! `[Warn, Audit]` names those containers instead. A pod that the API server sends to no
//! webhook still gets them, and nothing here can block a pod: the policies fail open, and the
//! webhook's own fail-closed scope does not change.
//!
//! Which policy governs a pod is the engine's rule ([`crate::selection::select_policy`]):
//! the binding selects the policy's namespaces (less those it exempts) and pods, and the
//! policy's scope leaves out pods that a policy of higher precedence selects. A policy that
//! is invalid governs what it selects and fails closed in the webhook, so it is not rendered
//! (and where its selector is malformed it selects every pod, so nothing it outranks is
//! either). The differential test in `e2e/tests/admission_cel.rs` holds the CEL to the
//! engine.

use serde_json::{Value, json};

use super::cel::{
    DAEMON_SET_POD, POD, Pod, covers, device_list_mount, env_from_spells, glob_regex, gpu_resource,
    has_env, literal, pod_exempt, privileged, scope_terms, selects,
};
use crate::gpu::VOID;
use crate::policy::{GpuPolicy, PolicyMode};
use crate::{GROUP, VERSION};

/// The API group of admission policies.
pub const ADMISSION_GROUP: &str = "admissionregistration.k8s.io";
/// Label on every rendered object: the GpuPolicy it comes from.
pub const LABEL_POLICY: &str = "gpuwarden.io/policy";
/// Label on every rendered object: who keeps it.
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// Value of [`LABEL_MANAGED_BY`].
pub const MANAGED_BY: &str = crate::FIELD_MANAGER_OPERATOR;
/// Kind of the mutating policy.
pub const KIND_MUTATING: &str = "MutatingAdmissionPolicy";
/// Kind of its binding.
pub const KIND_MUTATING_BINDING: &str = "MutatingAdmissionPolicyBinding";
/// Kind of the validating policy (Audit mode).
pub const KIND_VALIDATING: &str = "ValidatingAdmissionPolicy";
/// Kind of its binding.
pub const KIND_VALIDATING_BINDING: &str = "ValidatingAdmissionPolicyBinding";

/// The version of `admissionregistration.k8s.io` the cluster serves MutatingAdmissionPolicy
/// in: `v1` from Kubernetes 1.36, `v1beta1` in 1.34 and 1.35 where the
/// `MutatingAdmissionPolicy` feature gate and API are on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MutatingApi {
    /// `admissionregistration.k8s.io/v1`.
    V1,
    /// `admissionregistration.k8s.io/v1beta1`.
    V1beta1,
}

impl MutatingApi {
    /// The `apiVersion` of the objects.
    pub fn api_version(self) -> &'static str {
        match self {
            MutatingApi::V1 => "admissionregistration.k8s.io/v1",
            MutatingApi::V1beta1 => "admissionregistration.k8s.io/v1beta1",
        }
    }

    /// The version alone.
    pub fn version(self) -> &'static str {
        match self {
            MutatingApi::V1 => "v1",
            MutatingApi::V1beta1 => "v1beta1",
        }
    }
}

/// One object to keep in the cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct Rendered {
    /// Its kind.
    pub kind: &'static str,
    /// Its name (cluster-scoped).
    pub name: String,
    /// The whole object, as it is applied.
    pub object: Value,
}

/// What the operator keeps for `policies`: per governing policy in Enforce mode a
/// MutatingAdmissionPolicy and binding, in Audit mode a ValidatingAdmissionPolicy and binding
/// (`[Warn, Audit]`), each named `gpuwarden-<policy>`. `valid` says whether a policy passes
/// validation; rendering stops at the first invalid policy in precedence order.
pub fn render(
    policies: &[&GpuPolicy],
    valid: impl Fn(&GpuPolicy) -> bool,
    api: MutatingApi,
) -> Vec<Rendered> {
    let mut ordered: Vec<&GpuPolicy> = policies.to_vec();
    ordered.sort_by(|a, b| GpuPolicy::precedence(a, b));
    let mut out = Vec::new();
    for (at, policy) in ordered.iter().enumerate() {
        // What an invalid policy selects is the webhook's, which fails closed on it.
        if !valid(policy) {
            continue;
        }
        // A malformed selector above selects anything: that policy governs every pod.
        let Some(conditions) = match_conditions(policy, &ordered[..at], POD) else {
            break;
        };
        match policy.spec.mode {
            PolicyMode::Enforce => {
                out.extend(mutating(policy, conditions, api).into_iter().flatten())
            }
            PolicyMode::Audit if policy.spec.void_non_gpu_containers => {
                out.extend(validating(policy, conditions));
                // Written as the pods' conditions were, so it cannot fail here.
                if let Some(conditions) = match_conditions(policy, &ordered[..at], DAEMON_SET_POD) {
                    out.extend(validating_daemon_sets(policy, conditions));
                }
            }
            PolicyMode::Audit | PolicyMode::Deny => {}
        }
    }
    out
}

/// The name of the objects rendered for `policy`.
pub fn object_name(policy: &str) -> String {
    format!("gpuwarden-{policy}")
}

/// The void rule for container `c` (a CEL expression of one init or regular container of
/// `object`) under `policy`, in CEL: the container is not privileged; has no
/// `NVIDIA_VISIBLE_DEVICES` entry and no entry of a device variable the policy does not let
/// it set, nor an `envFrom` prefix that could spell a runtime variable (the webhook's
/// leaks); no limit or request on a GPU resource (the policy's rules); no mount whose path
/// names the toolkit's device-list directory; and its image is not exempt. A resource claim
/// does not stop it: NVIDIA's DRA driver hands GPUs out through CDI edits that set the
/// variable themselves, after the pod's env, and a claim on another device holds no GPU.
/// The engine's `engine::void` applies the same rule to the same fields.
pub(crate) fn void_rule(policy: &GpuPolicy, pod: Pod, c: &str) -> String {
    let gpu = gpu_resource(policy, "r");
    let mut all = vec![
        format!("!{}", privileged(c)),
        format!(
            "!{}",
            has_env(c, &crate::gpu::Rules::of(policy).judged_variables())
        ),
        format!("!{}", env_from_spells(c)),
        format!(
            "!(has({c}.resources) && ((has({c}.resources.limits) && {c}.resources.limits.exists(r, {gpu})) || (has({c}.resources.requests) && {c}.resources.requests.exists(r, {gpu}))))"
        ),
        format!("!{}", device_list_mount(c)),
    ];
    let exempt: Vec<String> = (policy.spec.exemptions.containers.iter())
        .filter_map(|entry| covers(pod, entry, c))
        .collect();
    if !exempt.is_empty() {
        all.push(format!("!({})", exempt.join(" || ")));
    }
    all.join(" && ")
}

/// The name of the condition that leaves out pods exempt by namespace or service account.
const POD_NOT_EXEMPT: &str = "pod-not-exempt";

/// CEL: the pod's service account is not exempt (its namespace is left out by the binding).
fn service_account_exempt(policy: &GpuPolicy) -> Option<String> {
    let accounts = &policy.spec.exemptions.service_accounts;
    (scope_terms(POD, &[], accounts).pop()).map(|term| format!("!({term})"))
}

/// The match conditions of `policy`'s objects (name, CEL): pods that a policy in `higher`
/// selects are theirs, a pod exempt by namespace or service account is left alone, and so
/// are pods with a CDI annotation (the webhook's rewrite voids theirs) and pods holding a
/// passthrough GPU in a VM runtime class (their GPU is read inside a VM). A pod's owner references decide nothing:
/// a tenant writes them (docs/design.md, "Threat model"). `None` when a selector in `higher`
/// cannot be written (it is malformed, so that policy is invalid).
fn match_conditions(
    policy: &GpuPolicy,
    higher: &[&GpuPolicy],
    pod: Pod,
) -> Option<Vec<(String, String)>> {
    let (spec, meta) = (pod.spec, pod.meta);
    let mut conditions = Vec::new();
    for other in higher {
        let name = other.metadata.name.as_deref().unwrap_or_default();
        let mut selected = vec![selects(
            &other.spec.namespace_selector,
            "namespaceObject.metadata.labels",
        )?];
        if let Some(pods) = &other.spec.pod_selector {
            selected.push(selects(pods, &format!("{meta}.labels"))?);
        }
        conditions.push((
            format!("not-governed-by-{name}"),
            format!("!({})", selected.join(" && ")),
        ));
    }
    let exempt = pod_exempt(pod, &policy.spec.exemptions);
    if !exempt.is_empty() {
        conditions.push((
            POD_NOT_EXEMPT.to_owned(),
            format!("!({})", exempt.join(" || ")),
        ));
    }
    let mut cdi: Vec<String> = (crate::CDI_ANNOTATION_PREFIXES.iter())
        .map(|p| format!("k.startsWith({})", literal(p)))
        .collect();
    cdi.push(format!("k == {}", literal(crate::CDI_ANNOTATION_BARE_KEY)));
    conditions.push((
        "no-cdi-annotation".to_owned(),
        format!(
            "!(has({meta}.annotations) && {meta}.annotations.exists(k, {}))",
            cdi.join(" || ")
        ),
    ));
    let passthrough = "(r == 'nvidia.com/pgpu' || r.matches('^nvidia[.]com/[A-Z]'))";
    let holds = format!(
        "c, has(c.resources) && ((has(c.resources.limits) && c.resources.limits.exists(r, {passthrough})) || (has(c.resources.requests) && c.resources.requests.exists(r, {passthrough})))"
    );
    // Only a VM runtime class runs the pod in its VM (docs/design.md, "GPUs handed to VMs").
    let classes: Vec<String> = (policy.spec.virtual_machines.runtime_classes.iter())
        .map(|p| {
            format!(
                "{spec}.runtimeClassName.matches({})",
                literal(&glob_regex(p))
            )
        })
        .collect();
    let in_vm = if classes.is_empty() {
        "false".to_owned()
    } else {
        format!("has({spec}.runtimeClassName) && ({})", classes.join(" || "))
    };
    conditions.push((
        "no-passthrough-gpu".to_owned(),
        format!(
            "!({in_vm} && ({spec}.containers.exists({holds}) || (has({spec}.initContainers) && {spec}.initContainers.exists({holds}))))"
        ),
    ));
    Some(conditions)
}

/// The JSONPatch expression of the void rule: for each init and regular container it holds
/// for, add the entry (appending to `env`, or creating it).
pub fn void_patch_expression(policy: &GpuPolicy) -> String {
    format!(
        "(has(object.spec.initContainers) ? {} : []) + {}",
        void_ops(policy, "initContainers", ""),
        void_ops(policy, "containers", "")
    )
}

/// The JSONPatch expression of the void rule for `pods/ephemeralcontainers`: for each
/// ephemeral container the update adds (one `oldObject` does not have) that the rule holds
/// for, add the entry. Those already there cannot change, and got the rule when added.
pub fn ephemeral_void_patch_expression(policy: &GpuPolicy) -> String {
    let new = "!(object.spec.ephemeralContainers[i].name in (has(oldObject.spec.ephemeralContainers) ? oldObject.spec.ephemeralContainers.map(o, o.name) : [])) && ";
    format!(
        "(has(object.spec.ephemeralContainers) ? {} : [])",
        void_ops(policy, "ephemeralContainers", new)
    )
}

/// The void rule's operations on the containers in `field`, for those that pass `filter`
/// (CEL of the index `i`, ending in `&&`, or empty) and the rule.
fn void_ops(policy: &GpuPolicy, field: &str, filter: &str) -> String {
    let entry = format!("{{'name': 'NVIDIA_VISIBLE_DEVICES', 'value': '{VOID}'}}");
    let l = format!("object.spec.{field}");
    let c = format!("{l}[i]");
    let rule = void_rule(policy, POD, &c);
    format!(
        "lists.range(size({l})).filter(i, {filter}{rule}).map(i, has({c}.env) ? JSONPatch{{op: 'add', path: '/spec/{field}/' + string(i) + '/env/-', value: {entry}}} : JSONPatch{{op: 'add', path: '/spec/{field}/' + string(i) + '/env', value: [{entry}]}})"
    )
}

/// The names of the containers the void rule holds for, as CEL (Audit mode's report).
pub(crate) fn void_names_expression(policy: &GpuPolicy) -> String {
    format!("{}.map(c, c.name)", voided_containers(policy, POD))
}

/// The init and regular containers of `pod` the void rule holds for, as CEL.
fn voided_containers(policy: &GpuPolicy, pod: Pod) -> String {
    let rule = void_rule(policy, pod, "c");
    let s = pod.spec;
    format!(
        "((has({s}.initContainers) ? {s}.initContainers.filter(c, {rule}) : []) + {s}.containers.filter(c, {rule}))"
    )
}

fn metadata(policy: &GpuPolicy, name: &str) -> Value {
    let source = policy.metadata.name.as_deref().unwrap_or_default();
    let mut meta = json!({
        "name": name,
        "labels": {
            "app.kubernetes.io/part-of": "gpuwarden",
            LABEL_MANAGED_BY: MANAGED_BY,
            LABEL_POLICY: source,
        },
    });
    // Deleting the GpuPolicy (or its CRD, on uninstall) deletes what was rendered from it.
    if let Some(uid) = &policy.metadata.uid {
        meta["ownerReferences"] = json!([{
            "apiVersion": format!("{GROUP}/{VERSION}"),
            "kind": "GpuPolicy",
            "name": source,
            "uid": uid,
        }]);
    }
    meta
}

fn conditions_json(conditions: Vec<(String, String)>) -> Value {
    Value::Array(
        conditions
            .into_iter()
            .map(|(name, expression)| json!({"name": name, "expression": expression}))
            .collect(),
    )
}

/// The binding's selection: the policy's namespaces, less those it exempts (a label test the
/// API server makes before it evaluates any CEL), and its pods.
fn match_resources(policy: &GpuPolicy, pod: Pod) -> Value {
    let mut namespaces = policy.spec.namespace_selector.clone();
    let exempt = &policy.spec.exemptions.namespaces;
    if !exempt.is_empty() {
        (namespaces.match_expressions.get_or_insert_with(Vec::new)).push(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
                key: crate::LABEL_NAMESPACE_NAME.to_owned(),
                operator: "NotIn".to_owned(),
                values: Some(exempt.clone()),
            },
        );
    }
    let mut resources = json!({
        "namespaceSelector": namespaces,
    });
    // A workload's own labels are not its pods': there the conditions read the template's.
    if let Some(pods) = policy.spec.pod_selector.as_ref().filter(|_| pod == POD) {
        resources["objectSelector"] = json!(pods);
    }
    resources
}

const POD_CREATE: &str = "pods";

/// The subresource `kubectl debug` adds ephemeral containers through.
const POD_EPHEMERAL: &str = "pods/ephemeralcontainers";

/// What the DaemonSet warning is called for: DaemonSets written or changed.
fn daemon_set_constraints() -> Value {
    json!({"resourceRules": [{
        "apiGroups": ["apps"],
        "apiVersions": ["v1"],
        "operations": ["CREATE", "UPDATE"],
        "resources": ["daemonsets"],
    }]})
}

/// The requests a policy is called for: new pods and, with `ephemeral`, ephemeral containers
/// added to running ones.
fn constraints(ephemeral: bool) -> Value {
    let rule = |operation: &str, resource: &str| {
        json!({
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": [operation],
            "resources": [resource],
        })
    };
    let mut rules = vec![rule("CREATE", POD_CREATE)];
    if ephemeral {
        rules.push(rule("UPDATE", POD_EPHEMERAL));
    }
    json!({ "resourceRules": rules })
}

/// The MutatingAdmissionPolicy of an Enforce policy and its binding: the privileged-GPU
/// rewrite where CEL can do it ([`super::rewrite`]), then the void rule on the pod
/// as the rewrite leaves it. `None` when it would do neither.
fn mutating(
    policy: &GpuPolicy,
    conditions: Vec<(String, String)>,
    api: MutatingApi,
) -> Option<[Rendered; 2]> {
    let name = object_name(policy.metadata.name.as_deref().unwrap_or_default());
    let patch = |expression: String| json!({"patchType": "JSONPatch", "jsonPatch": {"expression": expression}});
    let mut variables = Vec::new();
    let mut expressions = Vec::new();
    if let Some((vars, expression)) = super::rewrite::rewrite(policy, &gpu_resource(policy, "r")) {
        variables = (vars.into_iter())
            .map(|(name, expression)| json!({"name": name, "expression": expression}))
            .collect();
        expressions.push(expression);
    }
    // One patch, applied once: the void rule holds for the pod as the rewrite leaves it,
    // and the rewrite never touches a container the rule voids (one that is not privileged
    // and names no GPU), so both read the pod as it came.
    if policy.spec.void_non_gpu_containers {
        expressions.push(format!("({})", void_patch_expression(policy)));
    }
    if expressions.is_empty() {
        return None;
    }
    // The match conditions are the first variable rather than matchConditions: the API
    // server evaluates matchConditions in an activation of their own, and again on every
    // reinvocation of the admission chain, which costs more than the conditions themselves.
    // Exempt namespaces are left out by the binding's selector instead.
    let scope: Vec<String> = (conditions.iter())
        .filter(|(name, _)| name != POD_NOT_EXEMPT)
        .map(|(_, expression)| format!("({expression})"))
        .chain(service_account_exempt(policy))
        .collect();
    variables.insert(
        0,
        json!({"name": "scope", "expression": scope.join(" && ")}),
    );
    // An update is `pods/ephemeralcontainers` (the only one the constraints admit): only the
    // containers it adds can change.
    let void = policy.spec.void_non_gpu_containers;
    let expression = if void {
        format!(
            "!variables.scope ? [] : request.operation == 'UPDATE' ? {} : {}",
            ephemeral_void_patch_expression(policy),
            expressions.join(" + ")
        )
    } else {
        format!("!variables.scope ? [] : {}", expressions.join(" + "))
    };
    let policy_object = json!({
        "apiVersion": api.api_version(),
        "kind": KIND_MUTATING,
        "metadata": metadata(policy, &name),
        "spec": {
            // A failure leaves the pod as it is: the API server's policy never blocks a pod.
            "failurePolicy": "Ignore",
            "matchConstraints": constraints(void),
            // Run once. Re-running after a later webhook changed the pod would double the
            // policy's cost for every pod; gpuwarden's webhook, which runs after it and again
            // when the pod changes, still rewrites any privileged or leaking container a later
            // webhook adds.
            "reinvocationPolicy": "Never",
            "variables": variables,
            "mutations": [patch(expression)],
        },
    });
    let binding = json!({
        "apiVersion": api.api_version(),
        "kind": KIND_MUTATING_BINDING,
        "metadata": metadata(policy, &name),
        "spec": {
            "policyName": name,
            "matchResources": match_resources(policy, POD),
        },
    });
    Some([
        Rendered {
            kind: KIND_MUTATING,
            name: name.clone(),
            object: policy_object,
        },
        Rendered {
            kind: KIND_MUTATING_BINDING,
            name,
            object: binding,
        },
    ])
}

fn validating(policy: &GpuPolicy, conditions: Vec<(String, String)>) -> [Rendered; 2] {
    let policy_name = policy.metadata.name.as_deref().unwrap_or_default();
    let message = format!(
        "'GpuPolicy {policy_name} (Audit): in Enforce mode these containers would get NVIDIA_VISIBLE_DEVICES=void, because they hold no GPU and their image may set NVIDIA_VISIBLE_DEVICES: ' + variables.voided.join(', ')"
    );
    warning(
        policy,
        object_name(policy_name),
        POD,
        json!({
            "matchConstraints": constraints(false),
            "matchConditions": conditions_json(conditions),
            "variables": [{"name": "voided", "expression": void_names_expression(policy)}],
        }),
        message,
    )
}

/// The name of the DaemonSet warning rendered for `policy`.
pub fn daemon_set_object_name(policy: &str) -> String {
    format!("{}-daemonsets", object_name(policy))
}

/// Audit mode's warning for a DaemonSet whose pods the void rule would hold for, with the
/// container exemption a node agent that reads every GPU needs: the warning the engine gives
/// its pods (`mutate` on the DaemonSet), word for word, to whoever writes the DaemonSet.
/// The pods' own warnings go to the DaemonSet controller, where nobody reads them.
fn validating_daemon_sets(
    policy: &GpuPolicy,
    mut conditions: Vec<(String, String)>,
) -> [Rendered; 2] {
    let policy_name = policy.metadata.name.as_deref().unwrap_or_default();
    if let Some(selector) = &policy.spec.pod_selector
        && let Some(selected) = selects(selector, &format!("{}.labels", DAEMON_SET_POD.meta))
    {
        conditions.push(("pods-selected".to_owned(), selected));
    }
    let message = format!(
        "'gpuwarden audit: DaemonSet ' + object.metadata.name + ' would run with NVIDIA_VISIBLE_DEVICES=void in Enforce; if it reads GPUs, add to GpuPolicy ' + {} + ' exemptions.containers: images [' + variables.images.join(', ') + '], namespaces [' + request.namespace + ']'",
        literal(policy_name)
    );
    warning(
        policy,
        daemon_set_object_name(policy_name),
        DAEMON_SET_POD,
        json!({
            "matchConstraints": daemon_set_constraints(),
            "matchConditions": conditions_json(conditions),
            "variables": [
                {"name": "voided", "expression": voided_containers(policy, DAEMON_SET_POD)},
                {"name": "images", "expression": "variables.voided.map(c, has(c.image) ? c.image : '').distinct()"},
            ],
        }),
        message,
    )
}

/// An Audit-mode ValidatingAdmissionPolicy named `name` and its `[Warn, Audit]` binding: the
/// `spec` given (what it matches and its variables, `voided` among them) warns with
/// `message` (CEL) where `variables.voided` is not empty, and never refuses.
fn warning(
    policy: &GpuPolicy,
    name: String,
    pod: Pod,
    mut spec: Value,
    message: String,
) -> [Rendered; 2] {
    spec["failurePolicy"] = json!("Ignore");
    spec["validations"] = json!([{
        "expression": "size(variables.voided) == 0",
        "messageExpression": message,
        "reason": "Invalid",
    }]);
    let policy_object = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": KIND_VALIDATING,
        "metadata": metadata(policy, &name),
        "spec": spec,
    });
    let binding = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": KIND_VALIDATING_BINDING,
        "metadata": metadata(policy, &name),
        "spec": {
            "policyName": name,
            "validationActions": ["Warn", "Audit"],
            "matchResources": match_resources(policy, pod),
        },
    });
    [
        Rendered {
            kind: KIND_VALIDATING,
            name: name.clone(),
            object: policy_object,
        },
        Rendered {
            kind: KIND_VALIDATING_BINDING,
            name,
            object: binding,
        },
    ]
}

/// Condition type on a GpuPolicy: what the API server does for it without the webhook.
pub const CONDITION_ADMISSION_POLICIES: &str = "AdmissionPolicies";

/// The [`CONDITION_ADMISSION_POLICIES`] condition of `policy` (status, reason, message) when
/// the cluster serves MutatingAdmissionPolicy in `api` (`None`: not served) and `rendered`
/// is what the operator keeps.
pub fn admission_condition(
    policy: &GpuPolicy,
    api: Option<MutatingApi>,
    rendered: &[Rendered],
) -> (&'static str, &'static str, String) {
    let name = policy.metadata.name.as_deref().unwrap_or_default();
    let mine = |kind: &str| {
        (rendered.iter())
            .any(|r| r.kind == kind && r.object["metadata"]["labels"][LABEL_POLICY] == name)
    };
    let object = object_name(name);
    let void = policy.spec.void_non_gpu_containers;
    let rewrites = super::rewrite::renders(policy);
    match (policy.spec.mode, api) {
        (PolicyMode::Deny, _) => (
            "False",
            "DenyMode",
            "Deny mode rejects privileged GPU pods and changes none: the API server rewrites and voids nothing".to_owned(),
        ),
        (PolicyMode::Audit, _) if mine(KIND_VALIDATING) => (
            "True",
            "Warning",
            format!("ValidatingAdmissionPolicy {object} warns (and audits) where Enforce would set NVIDIA_VISIBLE_DEVICES=void, and {} names each DaemonSet it would void with the exemption to add; the webhook audits privileged GPU pods", daemon_set_object_name(name)),
        ),
        (PolicyMode::Audit, _) if !void => (
            "False",
            "Disabled",
            "voidNonGpuContainers is false: containers that hold no GPU keep their image's NVIDIA_VISIBLE_DEVICES; the webhook audits privileged GPU pods".to_owned(),
        ),
        (_, None) => (
            "False",
            "NotServed",
            "the API server does not serve MutatingAdmissionPolicy (admissionregistration.k8s.io/v1 from Kubernetes 1.36, v1beta1 with its feature gate in 1.34 and 1.35): containers that hold no GPU keep their image's NVIDIA_VISIBLE_DEVICES; the webhook still rewrites privileged GPU pods".to_owned(),
        ),
        (PolicyMode::Enforce, Some(api)) if mine(KIND_MUTATING) => {
            let mut does = Vec::new();
            if rewrites {
                does.push("rewrites the privileged GPU pods its CEL can (the webhook the others)");
            } else {
                does.push("leaves privileged GPU pods to the webhook (gpu.requestAs: ResourceClaim needs the namespace's ResourceClaimTemplates)");
            }
            if void {
                does.push("sets NVIDIA_VISIBLE_DEVICES=void on containers that hold no GPU");
            } else {
                does.push("voids nothing (voidNonGpuContainers is false)");
            }
            (
                "True",
                "Kept",
                format!("MutatingAdmissionPolicy {object} ({}) {}", api.api_version(), does.join(" and ")),
            )
        }
        (PolicyMode::Enforce, Some(_)) if !void && !rewrites => (
            "False",
            "Disabled",
            "voidNonGpuContainers is false and gpu.requestAs: ResourceClaim needs the webhook: the API server does nothing for this policy".to_owned(),
        ),
        _ => (
            "False",
            "NotRendered",
            "this policy or one that outranks it is invalid, so the webhook judges its pods (see Ready)".to_owned(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(name: &str, priority: i32, mode: PolicyMode) -> GpuPolicy {
        let mut policy = GpuPolicy::default_policy();
        policy.metadata.name = Some(name.to_owned());
        policy.spec.priority = priority;
        policy.spec.mode = mode;
        policy
    }

    #[test]
    fn an_enforce_policy_gets_a_mutating_policy_and_an_audit_policy_a_warning() {
        let enforce = named("default", 0, PolicyMode::Enforce);
        let audit = named("trial", 10, PolicyMode::Audit);
        let out = render(&[&enforce, &audit], |_| true, MutatingApi::V1);
        let kinds: Vec<(&str, &str)> = out.iter().map(|r| (r.kind, r.name.as_str())).collect();
        assert_eq!(
            kinds,
            [
                (KIND_VALIDATING, "gpuwarden-trial"),
                (KIND_VALIDATING_BINDING, "gpuwarden-trial"),
                (KIND_VALIDATING, "gpuwarden-trial-daemonsets"),
                (KIND_VALIDATING_BINDING, "gpuwarden-trial-daemonsets"),
                (KIND_MUTATING, "gpuwarden-default"),
                (KIND_MUTATING_BINDING, "gpuwarden-default"),
            ]
        );
        let scope = &out[4].object["spec"]["variables"][0];
        assert_eq!(scope["name"], "scope");
        // The Audit policy above selects every namespace: nothing is left to this one.
        assert!(
            scope["expression"]
                .as_str()
                .unwrap()
                .starts_with("(!(true))"),
            "{scope}"
        );
        let selector = &out[5].object["spec"]["matchResources"]["namespaceSelector"];
        assert_eq!(
            selector["matchExpressions"][0]["operator"], "NotIn",
            "{selector}"
        );
        assert_eq!(
            out[4].object["apiVersion"],
            "admissionregistration.k8s.io/v1"
        );
        assert_eq!(out[5].object["spec"]["policyName"], "gpuwarden-default");
        // The DaemonSet warning is called for DaemonSets and reads their pod template.
        let daemon_sets = &out[2].object["spec"];
        assert_eq!(
            daemon_sets["matchConstraints"]["resourceRules"][0]["resources"],
            json!(["daemonsets"])
        );
        let voided = daemon_sets["variables"][0]["expression"].as_str().unwrap();
        assert!(
            voided.contains("object.spec.template.spec.containers.filter"),
            "{voided}"
        );
        assert!(!voided.contains("object.spec.containers"), "{voided}");
        // The Enforce policy is also called for ephemeral containers.
        let rules = &out[4].object["spec"]["matchConstraints"]["resourceRules"];
        assert_eq!(
            rules[1]["resources"],
            json!(["pods/ephemeralcontainers"]),
            "{rules}"
        );
        assert_eq!(rules[1]["operations"], json!(["UPDATE"]), "{rules}");
    }

    #[test]
    fn an_invalid_policy_is_left_to_the_webhook() {
        let mut high = named("high", 10, PolicyMode::Enforce);
        let low = named("low", 0, PolicyMode::Enforce);
        let not_high = |p: &GpuPolicy| p.metadata.name.as_deref() != Some("high");
        let out = render(&[&high, &low], not_high, MutatingApi::V1beta1);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].name, "gpuwarden-low");
        // What the invalid policy above selects is left out.
        let scope = out[0].object["spec"]["variables"][0]["expression"]
            .as_str()
            .unwrap();
        assert!(scope.starts_with("(!("), "{scope}");
        // A malformed selector selects everything: nothing is left below it.
        high.spec.namespace_selector = serde_json::from_value(json!(
            {"matchExpressions": [{"key": "a", "operator": "Near"}]}
        ))
        .unwrap();
        assert!(render(&[&high, &low], not_high, MutatingApi::V1beta1).is_empty());
        let out = render(
            &[&high, &low],
            |p| p.metadata.name.as_deref() != Some("low"),
            MutatingApi::V1beta1,
        );
        assert_eq!(out.len(), 2);
        assert_eq!(
            out[0].object["apiVersion"],
            "admissionregistration.k8s.io/v1beta1"
        );
    }

    #[test]
    fn the_condition_says_what_the_api_server_does_for_the_policy() {
        let enforce = named("default", 0, PolicyMode::Enforce);
        let out = render(&[&enforce], |_| true, MutatingApi::V1);
        let (status, reason, message) = admission_condition(&enforce, Some(MutatingApi::V1), &out);
        assert_eq!((status, reason), ("True", "Kept"), "{message}");
        assert!(message.contains("gpuwarden-default"), "{message}");
        let (status, reason, _) = admission_condition(&enforce, None, &[]);
        assert_eq!((status, reason), ("False", "NotServed"));
        let (_, reason, _) = admission_condition(&enforce, Some(MutatingApi::V1), &[]);
        assert_eq!(reason, "NotRendered");
        let audit = named("trial", 0, PolicyMode::Audit);
        let out = render(&[&audit], |_| true, MutatingApi::V1);
        assert_eq!(admission_condition(&audit, None, &out).1, "Warning");
    }

    #[test]
    fn deny_mode_and_both_rules_turned_off_render_nothing() {
        let deny = named("deny", 0, PolicyMode::Deny);
        assert!(render(&[&deny], |_| true, MutatingApi::V1).is_empty());
        let mut off = named("off", 0, PolicyMode::Enforce);
        off.spec.void_non_gpu_containers = false;
        // The rewrite alone is still the API server's.
        let out = render(&[&off], |_| true, MutatingApi::V1);
        assert_eq!(
            out[0].object["spec"]["mutations"].as_array().unwrap().len(),
            1
        );
        let (_, reason, message) = admission_condition(&off, Some(MutatingApi::V1), &out);
        assert_eq!(reason, "Kept", "{message}");
        assert!(message.contains("voids nothing"), "{message}");
        off.spec.gpu.request_as = crate::policy::RequestAs::ResourceClaim;
        assert!(render(&[&off], |_| true, MutatingApi::V1).is_empty());
        let (_, reason, _) = admission_condition(&off, Some(MutatingApi::V1), &[]);
        assert_eq!(reason, "Disabled");
        let mut audit = named("trial", 0, PolicyMode::Audit);
        audit.spec.void_non_gpu_containers = false;
        assert!(render(&[&audit], |_| true, MutatingApi::V1).is_empty());
        assert_eq!(admission_condition(&audit, None, &[]).1, "Disabled");
    }
}
