//! The claim guard in the API server (docs/design.md, "Claims only a driver's own pods may
//! hold"): a ValidatingAdmissionPolicy that refuses a ResourceClaim or ResourceClaimTemplate
//! naming a DeviceClass, or carrying an opaque config kind, that the default GpuPolicy's
//! `driverClaims` keeps for a DRA driver's own pods, outside the namespaces it names. The
//! words are [`crate::claims::driver_only_reason`]'s.
//!
//! Its parameter is the default GpuPolicy, as for the backstop and the ConfigMap guard, so
//! it is one static policy, written into `deploy/admission/driver-claims.yaml` by crdgen; the
//! defaults it falls back to where a stored policy lacks the field are
//! [`crate::DriverClaims::default`]. The differential test in `e2e/tests/admission_cel.rs`
//! holds it to `gpuwarden-webhook mutate`.

use serde_json::{Value, json};

use super::cel::{list, literal};
use crate::DriverClaims;
use crate::claims::DRIVER_ONLY_REASON;

/// The name of the policy and its binding.
pub const NAME: &str = "gpuwarden-driver-claims";

/// CEL: `params.spec.driverClaims.<field>`, or its default.
fn rule(field: &str, default: &[String]) -> String {
    format!(
        "has(params.spec.driverClaims) && has(params.spec.driverClaims.{field}) ? params.spec.driverClaims.{field} : {}",
        list(default)
    )
}

/// The policy's variables, in order: (name, expression). Each is evaluated only where a
/// validation reads it, so most writes never read a claim's requests.
fn variables() -> Vec<(&'static str, String)> {
    let defaults = DriverClaims::default();
    vec![
        (
            "claim",
            "request.resource.resource == 'resourceclaimtemplates' ? dyn(object).spec.spec : dyn(object).spec".to_owned(),
        ),
        ("classes", rule("deviceClasses", &defaults.device_classes)),
        ("kinds", rule("configKinds", &defaults.config_kinds)),
        ("namespaces", rule("namespaces", &defaults.namespaces)),
        // The listed classes a request or a firstAvailable alternative names.
        (
            "named",
            "has(variables.claim.devices) && has(variables.claim.devices.requests) ? variables.classes.filter(k, variables.claim.devices.requests.exists(r, (has(r.exactly) && r.exactly.deviceClassName == k) || (has(r.firstAvailable) && r.firstAvailable.exists(s, s.deviceClassName == k)))) : []".to_owned(),
        ),
        // The listed kinds an opaque config carries.
        (
            "configs",
            "has(variables.claim.devices) && has(variables.claim.devices.config) ? variables.kinds.filter(k, variables.claim.devices.config.exists(c, has(c.opaque) && has(c.opaque.parameters) && has(c.opaque.parameters.kind) && c.opaque.parameters.kind == k)) : []".to_owned(),
        ),
    ]
}

/// CEL: the write is let through before its claim is read: Audit mode, a namespace the
/// policy exempts or a driver's own, or an update that leaves the claim as it was (so that
/// removing a finalizer from an older claim is never refused).
const PASSES: &str = "params.spec.mode == 'Audit' || (has(params.spec.exemptions) && has(params.spec.exemptions.namespaces) && request.namespace in params.spec.exemptions.namespaces) || request.namespace in variables.namespaces || (request.operation == 'UPDATE' && dyn(oldObject).spec == dyn(object).spec)";

/// The policy and its binding, as they are applied.
pub fn render() -> [Value; 2] {
    let labels = json!({"app.kubernetes.io/part-of": "gpuwarden"});
    let variables: Vec<Value> = (variables().into_iter())
        .map(|(name, expression)| json!({"name": name, "expression": expression}))
        .collect();
    let what = "variables.named.map(c, 'DeviceClass ' + c) + variables.configs.map(k, 'opaque config ' + k)";
    let message = format!(
        "'gpuwarden: ' + request.kind.kind + ' ' + object.metadata.name + ': ' + ({what}).join(', ') + (size({what}) == 1 ? ' is ' : ' are ') + {}",
        literal(DRIVER_ONLY_REASON)
    );
    let policy = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": NAME, "labels": labels},
        "spec": {
            // Every claim write in the cluster meets it; were the GpuPolicy kind gone, a
            // failing policy would refuse them all. Nothing a writer controls makes its
            // expressions fail, and the webhook still denies a pod using such a claim.
            "failurePolicy": "Ignore",
            "paramKind": {"apiVersion": "gpuwarden.io/v1alpha1", "kind": "GpuPolicy"},
            "matchConstraints": {"resourceRules": [{
                "apiGroups": ["resource.k8s.io"],
                "apiVersions": ["v1"],
                "operations": ["CREATE", "UPDATE"],
                "resources": ["resourceclaims", "resourceclaimtemplates"],
            }]},
            "variables": variables,
            "validations": [{
                "expression": format!("{PASSES} || size(variables.named) + size(variables.configs) == 0"),
                "messageExpression": message,
                "reason": "Forbidden",
            }],
        },
    });
    let binding = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": NAME, "labels": labels},
        "spec": {
            "policyName": NAME,
            "validationActions": ["Deny"],
            // No default policy: nothing is governed, as with the webhook.
            "paramRef": {"name": crate::DEFAULT_POLICY_NAME, "parameterNotFoundAction": "Allow"},
            "matchResources": {"namespaceSelector": {"matchExpressions": [{
                "key": crate::LABEL_NAMESPACE_NAME,
                "operator": "NotIn",
                "values": ["kube-system", crate::SYSTEM_NAMESPACE],
            }]}},
        },
    });
    [policy, binding]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_policys_and_the_words_are_the_engines() {
        let [policy, binding] = render();
        let text = policy.to_string();
        assert!(
            text.contains("'compute-domain-daemon.nvidia.com'"),
            "{text}"
        );
        assert!(text.contains("'ComputeDomainDaemonConfig'"), "{text}");
        assert!(text.contains("'nvidia-dra-driver-gpu'"), "{text}");
        assert!(text.contains(&DRIVER_ONLY_REASON[..27]), "{text}");
        assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));
        assert_eq!(binding["spec"]["paramRef"]["name"], "default");
    }
}
