//! The generated files under `deploy/`: CRDs and the default policy.
//!
//! `cargo run -p gpuwarden-crds --bin crdgen` writes them; the tests below fail when the
//! committed files differ from what the types generate.

use kube::CustomResourceExt;
use serde::Serialize;

use crate::{GpuNode, GpuPolicy};

const HEADER: &str = "# Generated from the gpuwarden-crds types by `cargo run -p gpuwarden-crds --bin crdgen`.\n# Do not edit by hand.\n";

/// A generated file: its path relative to the repository root, and its content.
pub struct GeneratedFile {
    /// Path relative to the repository root.
    pub path: &'static str,
    /// File content.
    pub content: String,
}

/// Serialises `value` as a YAML document with the generated-file header.
fn yaml<T: Serialize>(value: &T) -> String {
    // Round-trip through serde_json so maps come out in a stable order with no nulls.
    let json = serde_json::to_value(value).expect("API types serialise to JSON");
    let body = serde_saphyr::to_string(&json).expect("JSON values serialise to YAML");
    format!("{HEADER}---\n{body}")
}

/// Every generated file.
pub fn generated_files() -> Vec<GeneratedFile> {
    vec![
        GeneratedFile {
            path: "deploy/crds/gpupolicies.yaml",
            content: yaml(&GpuPolicy::crd()),
        },
        GeneratedFile {
            path: "deploy/crds/gpunodes.yaml",
            content: yaml(&GpuNode::crd()),
        },
        GeneratedFile {
            path: "deploy/policies/default.yaml",
            content: yaml(&default_policy_manifest()),
        },
        GeneratedFile {
            path: START_UP_WARNINGS,
            content: start_up_warnings(),
        },
        GeneratedFile {
            path: DRIVER_CLAIMS,
            content: driver_claims(),
        },
    ]
}

/// Where the claim guard is written.
pub const DRIVER_CLAIMS: &str = "deploy/admission/driver-claims.yaml";

/// The claim guard and its binding ([`crate::admission::driver_claims`]), with a comment
/// that says what they do.
fn driver_claims() -> String {
    let about = "# DRA claims only a driver's own pods may hold (docs/design.md, \"Claims only a driver's own\n\
# pods may hold\"): in a namespace the default GpuPolicy governs, outside the namespaces its\n\
# driverClaims names, creating a ResourceClaim or ResourceClaimTemplate that names one of its\n\
# driverClaims.deviceClasses (in any request or firstAvailable alternative), or carries an\n\
# opaque config of one of its driverClaims.configKinds, is refused. The NVIDIA DRA driver\n\
# prepares a claim on its ComputeDomain daemon class for any namespace, and hands its\n\
# container every GPU and IMEX channel of the node. An update that leaves the claim as it was\n\
# passes. Audit mode and exempt namespaces check nothing; it fails open. Needs\n\
# ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1, Kubernetes 1.30 and later).\n";
    documents(about, crate::admission::driver_claims::render())
}

/// Where the start-up warning policy is written.
pub const START_UP_WARNINGS: &str = "deploy/admission/start-up-warnings.yaml";

/// The start-up warning policy and its binding ([`crate::admission::start_up`]), with a
/// comment that says what they do.
fn start_up_warnings() -> String {
    let about = "# What rewritten containers keep of what their start-up steps need (docs/design.md,\n\
# \"What a rewritten container keeps\"): for every pod gpuwarden rewrote, whichever path\n\
# rewrote it (the webhook or the MutatingAdmissionPolicy), one warning per step its containers\n\
# show (sshd, su, sudo, gosu, supervisord, chown, an MPI worker) saying what they keep and\n\
# what they lose of what the step needs. Warn only; it fails open. Needs\n\
# ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1, Kubernetes 1.30 and later).\n";
    documents(about, crate::admission::start_up::render())
}

/// The generated header, `about`, then each document.
fn documents(about: &str, documents: impl IntoIterator<Item = serde_json::Value>) -> String {
    let mut out = format!("{HEADER}{about}");
    for document in documents {
        let body = serde_saphyr::to_string(&document).expect("JSON values serialise to YAML");
        out.push_str("---\n");
        out.push_str(&body);
    }
    out
}

/// The default policy as a manifest (with apiVersion and kind, no status).
pub fn default_policy_manifest() -> serde_json::Value {
    let mut value =
        serde_json::to_value(GpuPolicy::default_policy()).expect("GpuPolicy serialises");
    if let Some(obj) = value.as_object_mut() {
        obj.remove("status");
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn repo_root() -> &'static Path {
        Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
    }

    #[test]
    fn generated_files_are_committed_and_current() {
        for file in generated_files() {
            let path = repo_root().join(file.path);
            let on_disk = std::fs::read_to_string(&path).unwrap_or_else(|e| {
                panic!(
                    "{}: {e}; run `cargo run -p gpuwarden-crds --bin crdgen`",
                    file.path
                )
            });
            assert!(
                on_disk == file.content,
                "{} is out of date; run `cargo run -p gpuwarden-crds --bin crdgen`",
                file.path
            );
        }
    }

    #[test]
    fn default_policy_file_parses_back_to_the_builtin() {
        let text =
            std::fs::read_to_string(repo_root().join("deploy/policies/default.yaml")).unwrap();
        let parsed: GpuPolicy = serde_saphyr::from_str(&text).unwrap();
        let builtin = GpuPolicy::default_policy();
        assert_eq!(parsed.spec, builtin.spec);
        assert_eq!(parsed.metadata.name, builtin.metadata.name);
    }

    #[test]
    fn crds_are_cluster_scoped_with_names_and_columns() {
        let crd = GpuNode::crd();
        assert_eq!(crd.spec.scope, "Cluster");
        assert_eq!(
            crd.spec.names.short_names.as_deref(),
            Some(&["gpun".to_string()][..])
        );
        assert_eq!(
            crd.spec.names.categories.as_deref(),
            Some(&["gpuwarden".to_string()][..])
        );
        let version = &crd.spec.versions[0];
        assert!(version.subresources.as_ref().unwrap().status.is_some());
        let columns: Vec<_> = version
            .additional_printer_columns
            .iter()
            .flatten()
            .filter(|c| c.priority.unwrap_or(0) == 0)
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(
            columns,
            [
                "Node",
                "GPUs",
                "Source",
                "Healthy",
                "Allocated",
                "Model",
                "Driver",
                "Toolkit",
                "Patched",
                "Age"
            ]
        );

        let crd = GpuPolicy::crd();
        assert_eq!(crd.spec.scope, "Cluster");
        assert_eq!(
            crd.spec.names.short_names.as_deref(),
            Some(&["gpup".to_string()][..])
        );
    }

    #[test]
    fn schemas_carry_cel_rules_list_maps_and_docs() {
        let policy = serde_json::to_string(&GpuPolicy::crd()).unwrap();
        assert!(policy.contains("x-kubernetes-validations"));
        assert!(policy.contains("defaultCount must not exceed maxPerContainer"));
        assert!(policy.contains("without the CAP_ prefix"));
        let node = serde_json::to_string(&GpuNode::crd()).unwrap();
        assert!(node.contains(r#""x-kubernetes-list-map-keys":["podUid","container"]"#));
        assert!(node.contains(r#""x-kubernetes-list-map-keys":["uuid"]"#));
        // Every property documented, so `kubectl explain` says something.
        for crd in [GpuPolicy::crd(), GpuNode::crd()] {
            let schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
            assert_documented(&schema["openAPIV3Schema"]["properties"]["spec"], "spec");
        }
    }

    fn assert_documented(schema: &serde_json::Value, path: &str) {
        if let Some(props) = schema.get("properties").and_then(|p| p.as_object()) {
            for (name, prop) in props {
                let p = format!("{path}.{name}");
                assert!(prop.get("description").is_some(), "{p} has no description");
                assert_documented(prop, &p);
            }
        }
    }
}
