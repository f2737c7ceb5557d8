//! The start-up warning in the API server (docs/design.md, "What a rewritten container
//! keeps"): a ValidatingAdmissionPolicy bound with `[Warn]` that reads every pod gpuwarden
//! rewrote (it carries `gpuwarden.io/rewritten`), whichever path rewrote it, and says per
//! start-up step what its containers keep and lose of what the step needs, word for word as
//! the engine's [`crate::start_up::WARNING_PREFIX`] warnings say it. A MutatingAdmissionPolicy
//! cannot warn, so a pod the API server rewrote is told here; a pod the webhook rewrote is
//! told the same by both (the API server puts its own `Validation failed for ...:` before
//! this policy's words).
//!
//! It reads only the stored pod and the tables of [`crate::start_up`], so it is one static
//! policy for every GpuPolicy, written into `deploy/admission/start-up-warnings.yaml` by
//! crdgen. It fails open and never refuses a pod. The differential test in
//! `e2e/tests/admission_cel.rs` holds it to the engine.

use serde_json::{Value, json};

use super::cel::{list, literal};
use crate::ANNOTATION_REWRITTEN;
use crate::pod_security::RUNTIME_DEFAULT_CAPABILITIES;
use crate::start_up::{
    LABEL_MPI_JOB_ROLE, MPI_WORKER, NEEDS, Need, WARNING_PREFIX, program_pattern,
};

/// The name of the policy and its binding.
pub const NAME: &str = "gpuwarden-start-up";

/// CEL: the strings of container `c`'s `command` and `args`.
fn words(c: &str) -> String {
    format!("((has({c}.command) ? {c}.command : []) + (has({c}.args) ? {c}.args : []))")
}

/// CEL: container `c`'s `securityContext.capabilities.<field>`, or none.
fn capabilities(c: &str, field: &str) -> String {
    format!(
        "(has({c}.securityContext) && has({c}.securityContext.capabilities) && has({c}.securityContext.capabilities.{field}) ? {c}.securityContext.capabilities.{field} : [])"
    )
}

/// CEL: [`crate::start_up::phrase`] of `need`, shown as `shown` (a CEL string), for
/// container `c` labelled `label` (a CEL string), with [`crate::start_up::lost`] computed from
/// its `securityContext`.
fn phrase(c: &str, label: &str, shown: &str, need: &Need) -> String {
    let caps: Vec<String> = need.capabilities.iter().map(|c| (*c).to_owned()).collect();
    let defaults: Vec<String> = (RUNTIME_DEFAULT_CAPABILITIES.iter())
        .map(|c| (*c).to_owned())
        .collect();
    let (add, drop) = (capabilities(c, "add"), capabilities(c, "drop"));
    let lost = format!(
        "{}.filter(x, !(x in {add}) && !(x in {} && !(x in {drop}) && !('ALL' in {drop})))",
        list(&caps),
        list(&defaults),
    );
    let setuid = if need.setuid {
        format!(
            "(has({c}.securityContext) && has({c}.securityContext.allowPrivilegeEscalation) && {c}.securityContext.allowPrivilegeEscalation == false)"
        )
    } else {
        "false".to_owned()
    };
    let what = literal(&format!(" ({})", need.what));
    format!(
        "{label} + ' ' + {shown} + ': ' + (size({lost}) == 0 && !{setuid} ? {} + {what} : 'loses ' + ({lost} + ({setuid} ? ['allowPrivilegeEscalation'] : [])).join(',') + {what})",
        literal(&format!("keeps {}", need.capabilities.join(","))),
    )
}

/// The init containers, or none.
const INIT: &str = "(has(object.spec.initContainers) ? object.spec.initContainers : [])";

/// One variable and one validation per step, in the order of
/// [`crate::start_up::steps`]: (variable name, CEL list of phrases).
fn steps() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for need in NEEDS {
        for program in need.programs {
            let shows = format!(
                "{}.exists(w, w.matches({}))",
                words("c"),
                literal(&program_pattern(program))
            );
            let shown = literal(&format!("runs {program}"));
            let of = |containers: &str, noun: &str| {
                format!(
                    "{containers}.filter(c, {shows}).map(c, {})",
                    phrase("c", &format!("{} + c.name", literal(noun)), &shown, need)
                )
            };
            out.push((
                format!("step{}", out.len()),
                format!(
                    "{} + {}",
                    of(INIT, "init container "),
                    of("object.spec.containers", "container ")
                ),
            ));
        }
    }
    // The MPI operator's worker runs sshd in its first container, where nothing names it.
    let sshd = &NEEDS[0];
    let first = "object.spec.containers[0]";
    let role = literal(LABEL_MPI_JOB_ROLE);
    out.push((
        format!("step{}", out.len()),
        format!(
            "has(object.metadata.labels) && {role} in object.metadata.labels && object.metadata.labels[{role}] == {} && !{}.exists(w, w.matches({})) ? [{}] : []",
            literal(MPI_WORKER),
            words(first),
            literal(&program_pattern(&sshd.programs.join("|"))),
            phrase(
                first,
                &format!("'container ' + {first}.name"),
                &literal("is an MPI worker (sshd)"),
                sshd
            ),
        ),
    ));
    out
}

/// CEL: some init or regular container's words name a program of [`NEEDS`], or the pod is
/// an MPI worker.
fn shows_a_step() -> String {
    let all = literal(&crate::start_up::pattern());
    let role = literal(LABEL_MPI_JOB_ROLE);
    format!(
        "(has(object.metadata.labels) && {role} in object.metadata.labels && object.metadata.labels[{role}] == {}) || ({INIT} + object.spec.containers).exists(c, {}.exists(w, w.matches({all})))",
        literal(MPI_WORKER),
        words("c"),
    )
}

/// The policy and its binding, as they are applied.
pub fn render() -> [Value; 2] {
    let labels = json!({"app.kubernetes.io/part-of": "gpuwarden"});
    let steps = steps();
    let variables: Vec<Value> = (steps.iter())
        .map(|(name, expression)| json!({"name": name, "expression": expression}))
        .collect();
    let validations: Vec<Value> = (steps.iter())
        .map(|(name, _)| {
            json!({
                "expression": format!("size(variables.{name}) == 0"),
                "messageExpression": format!("{} + variables.{name}.join('; ')", literal(WARNING_PREFIX)),
                "reason": "Invalid",
            })
        })
        .collect();
    let policy = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": NAME, "labels": labels},
        "spec": {
            // A warning only: a failure admits the pod as it is.
            "failurePolicy": "Ignore",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "operations": ["CREATE"],
                "resources": ["pods"],
            }]},
            // Most rewritten pods show no step: one pattern over their words tells, and the
            // steps' variables are read only for those that do.
            "matchConditions": [
                {
                    "name": "rewritten-by-gpuwarden",
                    "expression": format!(
                        "has(object.metadata.annotations) && {} in object.metadata.annotations",
                        literal(ANNOTATION_REWRITTEN)
                    ),
                },
                {"name": "shows-a-start-up-step", "expression": shows_a_step()},
            ],
            "variables": variables,
            "validations": validations,
        },
    });
    let binding = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": NAME, "labels": labels},
        "spec": {
            "policyName": NAME,
            "validationActions": ["Warn"],
        },
    });
    [policy, binding]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_validation_per_step_warns_and_never_refuses() {
        let [policy, binding] = render();
        let steps = crate::start_up::steps().count();
        assert_eq!(
            policy["spec"]["validations"].as_array().unwrap().len(),
            steps
        );
        assert_eq!(policy["spec"]["failurePolicy"], "Ignore");
        assert_eq!(binding["spec"]["validationActions"], json!(["Warn"]));
        // Only pods gpuwarden rewrote that show a step are read.
        let step = policy["spec"]["matchConditions"][1]["expression"]
            .as_str()
            .unwrap();
        assert!(step.contains("'training.kubeflow.org/job-role'"), "{step}");
        let condition = policy["spec"]["matchConditions"][0]["expression"]
            .as_str()
            .unwrap();
        assert!(
            condition.contains("'gpuwarden.io/rewritten'"),
            "{condition}"
        );
    }
}
