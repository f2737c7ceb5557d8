//! The GpuPolicy reconciler: validates each policy against itself and the others, and writes
//! `Ready`, `AdmissionPolicies` (what the API server does for it, as
//! [`crate::admission_policies`] keeps it) and `observedGeneration` to its status, only when
//! they change.

use std::sync::Arc;

use gpuwarden_crds::conditions::{DesiredCondition, merge_conditions};
use gpuwarden_crds::{FIELD_MANAGER_OPERATOR, GpuPolicy};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, Resource};
use serde_json::json;
use tracing::{debug, info};

use crate::admission_policies::{self, Keeping};
use gpuwarden_crds::admission::policies::{CONDITION_ADMISSION_POLICIES, admission_condition};

use crate::metrics::Metrics;
use crate::node_controller::synced;
use crate::{Clock, Leadership};
use gpuwarden_crds::validation::ready_condition;

/// Controller name in metrics and logs.
pub const CONTROLLER: &str = "gpupolicy";

/// A GpuPolicy reconcile that failed.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// Writing the status failed.
    #[error("failed to apply status of GpuPolicy {policy}")]
    Apply {
        /// The policy.
        policy: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

impl PolicyError {
    /// A bounded label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Apply { source, .. } => crate::api_error_kind(source),
        }
    }
}

/// What the GpuPolicy reconciler needs.
pub struct PolicyContext {
    /// API client.
    pub client: Client,
    /// GpuPolicy cache.
    pub policies: Store<GpuPolicy>,
    /// Current time.
    pub clock: Clock,
    /// Whether this replica may write.
    pub leader: Leadership,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The admission policies' keeper, where they are kept (the operator's
    /// `--admission-policies`).
    pub admission_policies: Option<Arc<Keeping>>,
}

fn same(a: &[Condition], b: &[Condition]) -> bool {
    a.len() == b.len()
        && a.iter().all(|x| {
            b.iter().any(|y| {
                x.type_ == y.type_
                    && x.status == y.status
                    && x.reason == y.reason
                    && x.message == y.message
                    && x.observed_generation == y.observed_generation
            })
        })
}

/// `policy`'s `AdmissionPolicies` condition: what is rendered for it, unless the keeper's
/// last pass failed to keep it.
fn admission_policies_condition(
    policy: &GpuPolicy,
    all: &[&GpuPolicy],
    keeping: &Keeping,
) -> DesiredCondition {
    let rendered = admission_policies::desired(all, keeping.api);
    let (status, reason, message) = admission_condition(policy, keeping.api, &rendered);
    match keeping.failure() {
        Some(why) if status == "True" => DesiredCondition::new(
            CONDITION_ADMISSION_POLICIES,
            false,
            "KeepFailed",
            format!("the operator could not keep the admission policies: {why}"),
        ),
        _ => DesiredCondition::new(
            CONDITION_ADMISSION_POLICIES,
            status == "True",
            reason,
            message,
        ),
    }
}

/// Reconciles one policy's status. Valid or not, it then waits for a change: an invalid
/// policy is fixed by editing it, not by retrying.
#[tracing::instrument(skip(ctx), fields(policy = %name))]
pub async fn reconcile_policy(name: &str, ctx: &PolicyContext) -> Result<Action, PolicyError> {
    if !ctx.leader.is_leader() {
        return Ok(Action::await_change());
    }
    if !synced(&ctx.policies) {
        return Ok(Action::requeue(std::time::Duration::from_secs(2)));
    }
    let Some(policy) = ctx.policies.get(&ObjectRef::new(name)) else {
        return Ok(Action::await_change());
    };
    if policy.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let all = ctx.policies.state();
    let all_refs: Vec<&GpuPolicy> = all.iter().map(Arc::as_ref).collect();
    let mut desired = vec![ready_condition(&policy, &all_refs)];
    if let Some(keeping) = &ctx.admission_policies {
        desired.push(admission_policies_condition(&policy, &all_refs, keeping));
    }
    let generation = policy.metadata.generation;
    let status = policy.status.clone().unwrap_or_default();
    let merged = merge_conditions(
        &status.conditions,
        &desired,
        generation,
        Time((ctx.clock)()),
    );
    if status.observed_generation == generation && same(&merged, &status.conditions) {
        debug!("status already current");
        return Ok(Action::await_change());
    }
    if desired[0].status != "True" {
        info!(reason = %desired[0].reason, message = %desired[0].message, "GpuPolicy is invalid");
    }
    let body = json!({
        "apiVersion": GpuPolicy::api_version(&()),
        "kind": GpuPolicy::kind(&()),
        "metadata": { "name": name },
        "status": { "observedGeneration": generation, "conditions": merged },
    });
    let api: Api<GpuPolicy> = Api::all(ctx.client.clone());
    api.patch_status(
        name,
        &PatchParams::apply(FIELD_MANAGER_OPERATOR).force(),
        &Patch::Apply(body),
    )
    .await
    .map_err(|source| PolicyError::Apply {
        policy: name.to_owned(),
        source,
    })?;
    ctx.metrics.write(CONTROLLER, "status");
    Ok(Action::await_change())
}
