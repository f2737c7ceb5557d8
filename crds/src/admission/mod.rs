//! CEL for the API server: what gpuwarden asks the API server to run itself, written from
//! the GpuPolicies (docs/design.md, "Inside the API server"). Everything above this folder is
//! the API (types, names, the rules on a pod); everything in it turns those rules into CEL
//! text, and nothing outside reads its internals.
//!
//! The modules form one line, each importing only those before it:
//! - `cel`: the shared pieces (literals, selectors, a container's fields, exemption scopes);
//! - [`match_conditions`]: the webhook's `matchConditions`, which let exempt pods through;
//! - [`rewrite`]: the privileged-GPU rewrite as JSONPatch CEL;
//! - [`policies`]: the MutatingAdmissionPolicies and ValidatingAdmissionPolicies rendered
//!   from each GpuPolicy, with the void rule and the rewrite;
//! - [`start_up`], beside them on `cel`: the one static warning of what rewritten containers
//!   keep of what their start-up steps need;
//! - [`driver_claims`], beside them on `cel`: the one static guard on claims only a DRA
//!   driver's own pods may hold.

pub(crate) mod cel;
pub mod driver_claims;
pub mod match_conditions;
pub mod policies;
pub mod rewrite;
pub mod start_up;

#[cfg(test)]
mod tests {
    /// Each module's source and the modules of this folder it may not name: the line runs
    /// `cel` ← `match_conditions`, `rewrite` ← `policies`.
    const LAYERS: [(&str, &str, &[&str]); 6] = [
        (
            "driver_claims",
            include_str!("driver_claims.rs"),
            &["match_conditions", "rewrite", "policies", "start_up"],
        ),
        (
            "cel",
            include_str!("cel.rs"),
            &[
                "match_conditions",
                "rewrite",
                "policies",
                "start_up",
                "driver_claims",
            ],
        ),
        (
            "start_up",
            include_str!("start_up.rs"),
            &["match_conditions", "rewrite", "policies"],
        ),
        (
            "match_conditions",
            include_str!("match_conditions.rs"),
            &["rewrite", "policies"],
        ),
        (
            "rewrite",
            include_str!("rewrite.rs"),
            &["match_conditions", "policies", "start_up"],
        ),
        (
            "policies",
            include_str!("policies.rs"),
            &["match_conditions"],
        ),
    ];

    #[test]
    fn the_writers_import_only_the_modules_before_them() {
        for (module, source, forbidden) in LAYERS {
            for other in forbidden {
                for path in [format!("super::{other}"), format!("admission::{other}")] {
                    assert!(
                        !source.contains(&path),
                        "admission::{module} names {path}: the line is cel <- match_conditions, rewrite <- policies"
                    );
                }
            }
        }
    }
}
