//! The GpuPolicy reconciler: validates each policy against itself and the others, and writes
//! `Ready`, `AdmissionPolicies` (what the API server does for it, as
//! [`crate::admission_policies`] keeps it), `KaiScheduler` (for a policy that names KAI:
//! whether KAI-Scheduler is installed as the policy says) and `observedGeneration` to its
//! status, only when they change.

use std::sync::Arc;

use futures::{StreamExt, stream};
use gpuwarden_crds::conditions::{DesiredCondition, merge_conditions};
use gpuwarden_crds::{FIELD_MANAGER_OPERATOR, GpuPolicy};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tokio::sync::mpsc;
use tracing::{debug, info};

use crate::admission_policies::{self, Keeping};
use gpuwarden_crds::admission::policies::{CONDITION_ADMISSION_POLICIES, admission_condition};

use crate::feeds::Feeds;
use crate::metrics::Metrics;
use crate::node_controller::synced;
use crate::wiring::{Part, Reconciles, Shared, drain, leader_gained, wakes};
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

/// The condition type of a policy that names KAI-Scheduler (`gpu.sharing.kai`).
pub const CONDITION_KAI_SCHEDULER: &str = "KaiScheduler";
/// KAI-Scheduler's mutating webhook configuration: it gives fraction containers their grant.
pub const KAI_ADMISSION: &str = "mutating-kai-admission";
/// The CustomResourceDefinition of KAI's BindRequests, which the node agent reads.
pub const KAI_BIND_REQUESTS_CRD: &str = "bindrequests.scheduling.run.ai";
/// How often a policy that names KAI looks again for KAI.
const KAI_RECHECK: std::time::Duration = std::time::Duration::from_secs(300);

/// `KaiScheduler` from what was found of KAI: its webhook configuration and its
/// BindRequest kind, each present, absent, or not readable (why).
fn kai_condition(
    webhook: Result<bool, String>,
    bind_requests: Result<bool, String>,
) -> DesiredCondition {
    match (webhook, bind_requests) {
        (Ok(true), Ok(true)) => DesiredCondition::new(
            CONDITION_KAI_SCHEDULER,
            true,
            "Installed",
            format!(
                "KAI-Scheduler's admission webhook ({KAI_ADMISSION}) and its BindRequest kind are installed: its fraction containers keep the GPU KAI grants them, and the node agent holds each to KAI's reservation"
            ),
        ),
        (Err(why), _) | (_, Err(why)) => DesiredCondition::unknown(
            CONDITION_KAI_SCHEDULER,
            "CannotRead",
            format!("the operator could not look for KAI-Scheduler: {why}"),
        ),
        (webhook, _) => {
            let missing = if webhook == Ok(false) {
                format!("the MutatingWebhookConfiguration {KAI_ADMISSION}")
            } else {
                format!("the CustomResourceDefinition {KAI_BIND_REQUESTS_CRD}")
            };
            DesiredCondition::new(
                CONDITION_KAI_SCHEDULER,
                false,
                "NotInstalled",
                format!(
                    "gpu.sharing.kai is set, but {missing} is not installed: KAI fraction pods are not given their GPU here (install KAI-Scheduler with GPU sharing on, or remove gpu.sharing.kai)"
                ),
            )
        }
    }
}

/// Whether the object `name` exists, through `api`.
async fn exists<K>(api: Api<K>, name: &str) -> Result<bool, String>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.get_metadata_opt(name).await {
        Ok(found) => Ok(found.is_some()),
        Err(e) => Err(gpuwarden_crds::error_chain(&e)),
    }
}

/// Looks for KAI-Scheduler's webhook configuration and BindRequest kind.
async fn look_for_kai(client: &Client) -> DesiredCondition {
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    kai_condition(
        exists(
            Api::<MutatingWebhookConfiguration>::all(client.clone()),
            KAI_ADMISSION,
        )
        .await,
        exists(
            Api::<CustomResourceDefinition>::all(client.clone()),
            KAI_BIND_REQUESTS_CRD,
        )
        .await,
    )
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
    let names_kai = (policy.spec.gpu.sharing.as_ref()).is_some_and(|s| s.kai.is_some());
    if names_kai {
        desired.push(look_for_kai(&ctx.client).await);
    }
    // KAI may be installed or removed at any time: look again now and then.
    let done = if names_kai {
        Action::requeue(KAI_RECHECK)
    } else {
        Action::await_change()
    };
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
        return Ok(done);
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
    Ok(done)
}

/// The GpuPolicy controller: it runs on GpuPolicies and re-validates every one when any
/// changes (overlaps are between policies), when `revalidate` fires (the admission policies'
/// keeper, whose outcome the policies' conditions say) and on becoming the leader.
pub fn wire(
    shared: &Shared,
    feeds: &mut Feeds,
    keeping: Option<Arc<Keeping>>,
    revalidate: mpsc::UnboundedReceiver<()>,
) -> Part {
    let (all_tx, all) = mpsc::unbounded_channel();
    feeds.policies.wake_on_any(&all_tx);
    let ctx = Arc::new(PolicyContext {
        client: shared.client.clone(),
        policies: feeds.policies.store(),
        clock: shared.clock.clone(),
        leader: shared.leadership.clone(),
        metrics: shared.metrics.clone(),
        admission_policies: keeping,
    });
    let reconciles = Reconciles::new(CONTROLLER, PolicyError::kind, |e: &PolicyError| {
        e.kind() == "invalid"
    });
    let everything = stream::select_all([
        wakes(all).boxed(),
        wakes(revalidate).boxed(),
        leader_gained(shared.leadership.clone()).boxed(),
    ]);
    let controller = Controller::for_stream(feeds.policies.trigger(false), ctx.policies.clone())
        .reconcile_all_on(everything)
        .with_config(shared.controller_config.clone())
        .graceful_shutdown_on(shared.shutdown.stopped())
        .run(
            {
                let reconciles = reconciles.clone();
                move |p: Arc<GpuPolicy>, ctx: Arc<PolicyContext>| {
                    let reconciles = reconciles.clone();
                    async move {
                        let name = p.name_any();
                        let reconcile = reconcile_policy(&name, &ctx);
                        reconciles.timed(&ctx.metrics, &name, reconcile).await
                    }
                }
            },
            move |p: Arc<GpuPolicy>, err: &PolicyError, _| {
                reconciles.error_action(&p.name_any(), err)
            },
            ctx,
        );
    Part::new(CONTROLLER, drain(controller))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kai_is_reported_as_found() {
        let c = kai_condition(Ok(true), Ok(true));
        assert_eq!((c.status, c.reason.as_str()), ("True", "Installed"));
        let c = kai_condition(Ok(false), Ok(true));
        assert_eq!((c.status, c.reason.as_str()), ("False", "NotInstalled"));
        assert!(
            c.message
                .contains("MutatingWebhookConfiguration mutating-kai-admission"),
            "{}",
            c.message
        );
        let c = kai_condition(Ok(true), Ok(false));
        assert!(
            c.message
                .contains("CustomResourceDefinition bindrequests.scheduling.run.ai"),
            "{}",
            c.message
        );
        let c = kai_condition(Ok(true), Err("forbidden".into()));
        assert_eq!((c.status, c.reason.as_str()), ("Unknown", "CannotRead"));
    }
}
