//! Keeps the webhook configuration's exemption condition in step with the GpuPolicies
//! ([`gpuwarden_crds::admission::match_conditions`]): a pod every policy exempts (NVIDIA's components in
//! their namespaces, anything in an exempt namespace) is admitted by the API server without
//! a call, so it never waits for the webhook, even while the webhook is down.
//!
//! A pass runs when a policy changes, when the configuration appears or its conditions
//! change, and on becoming the leader; only the leader writes, and only a difference.

use std::sync::Arc;

use gpuwarden_crds::admission::match_conditions::{NOT_EXEMPT_CONDITION, not_exempt_expression};
use gpuwarden_crds::install::{MUTATING_WEBHOOK, MUTATING_WEBHOOK_CONFIGURATION};
use gpuwarden_crds::validation::validate_policy;
use gpuwarden_crds::{FIELD_MANAGER_OPERATOR, GpuPolicy};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::Store;
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::mpsc;
use tracing::info;

use crate::Leadership;
use crate::feeds::Feeds;
use crate::metrics::Metrics;
use crate::wiring::{Keeper, Part, Shared, keep};

/// Controller name in metrics and logs.
pub const CONTROLLER: &str = "webhook-conditions";

/// A pass that failed.
#[derive(Debug, thiserror::Error)]
pub enum ConditionSyncError {
    /// An API call failed.
    #[error("failed to {action} MutatingWebhookConfiguration {MUTATING_WEBHOOK_CONFIGURATION}")]
    Api {
        /// What was being done.
        action: &'static str,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The patch could not be encoded.
    #[error("failed to encode the matchConditions patch")]
    Encode(#[source] serde_json::Error),
}

impl ConditionSyncError {
    /// A bounded label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Api { source, .. } => crate::api_error_kind(source),
            Self::Encode(_) => "encode",
        }
    }
}

/// What the condition keeper needs.
pub struct ConditionContext {
    /// API client.
    pub client: Client,
    /// Every GpuPolicy.
    pub policies: Store<GpuPolicy>,
    /// Whether this replica may write.
    pub leader: Leadership,
    /// Metrics.
    pub metrics: Arc<Metrics>,
}

/// One pass: the condition the policies call for, written where the configuration's
/// differs. Returns whether it wrote.
#[tracing::instrument(skip(ctx), fields(webhook_configuration = MUTATING_WEBHOOK_CONFIGURATION))]
pub async fn reconcile_conditions(ctx: &ConditionContext) -> Result<bool, ConditionSyncError> {
    if !ctx.leader.is_leader() {
        return Ok(false);
    }
    let policies = ctx.policies.state();
    let expression = not_exempt_expression(policies.iter().map(AsRef::as_ref), |p| {
        validate_policy(p).is_empty()
    });
    let api: Api<MutatingWebhookConfiguration> = Api::all(ctx.client.clone());
    let err = |action| move |source| ConditionSyncError::Api { action, source };
    // Gone: its return wakes the keeper.
    let Some(mwc) = api
        .get_opt(MUTATING_WEBHOOK_CONFIGURATION)
        .await
        .map_err(err("read"))?
    else {
        return Ok(false);
    };
    let Some(patch) = conditions_patch(&mwc, &expression).map_err(ConditionSyncError::Encode)?
    else {
        return Ok(false);
    };
    // A JSON patch under the operator's name, as for the caBundle: the operator owns the one
    // condition it writes, and a re-apply of the manifests (which do not carry it) keeps it.
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER_OPERATOR.to_owned()),
        ..PatchParams::default()
    };
    api.patch(
        MUTATING_WEBHOOK_CONFIGURATION,
        &params,
        &Patch::Json::<()>(patch),
    )
    .await
    .map_err(err("patch matchConditions of"))?;
    ctx.metrics.write(CONTROLLER, "match-conditions");
    info!(
        policies = policies.len(),
        bytes = expression.len(),
        "wrote the exemption condition {NOT_EXEMPT_CONDITION}"
    );
    Ok(true)
}

/// A JSON patch giving every webhook of `mwc` the condition [`NOT_EXEMPT_CONDITION`] with
/// `expression`, where it lacks it or holds another; each change is guarded by a `test` of
/// what it replaces, so a concurrent edit fails the patch instead of being overwritten.
pub fn conditions_patch(
    mwc: &MutatingWebhookConfiguration,
    expression: &str,
) -> Result<Option<json_patch::Patch>, serde_json::Error> {
    let mut ops = Vec::new();
    // Only the pods' webhook judges pods; the VM and pod-entry webhooks' objects are no pod,
    // and the condition would fail on them.
    let pods =
        (mwc.webhooks.iter().flatten().enumerate()).filter(|(_, wh)| wh.name == MUTATING_WEBHOOK);
    for (i, wh) in pods {
        ops.push(json!({"op": "test", "path": format!("/webhooks/{i}/name"), "value": wh.name}));
        let condition = json!({"name": NOT_EXEMPT_CONDITION, "expression": expression});
        let conditions = wh.match_conditions.as_deref();
        match conditions.and_then(|c| c.iter().position(|c| c.name == NOT_EXEMPT_CONDITION)) {
            Some(j) => {
                let current = &conditions.unwrap_or_default()[j].expression;
                if current == expression {
                    ops.pop();
                    continue;
                }
                let path = format!("/webhooks/{i}/matchConditions/{j}");
                ops.push(
                    json!({"op": "test", "path": format!("{path}/expression"), "value": current}),
                );
                ops.push(json!({"op": "replace", "path": path, "value": condition}));
            }
            None if conditions.is_some() => ops.push(json!({
                "op": "add",
                "path": format!("/webhooks/{i}/matchConditions/-"),
                "value": condition,
            })),
            None => ops.push(json!({
                "op": "add",
                "path": format!("/webhooks/{i}/matchConditions"),
                "value": [condition],
            })),
        }
    }
    if ops.is_empty() {
        return Ok(None);
    }
    serde_json::from_value(serde_json::Value::Array(ops)).map(Some)
}

/// The condition keeper: a pass whenever a GpuPolicy changes or the webhook configuration
/// appears or its bundles or conditions change.
pub fn wire(shared: &Shared, feeds: &mut Feeds) -> Part {
    let (wake_tx, wake) = mpsc::unbounded_channel();
    feeds.policies.wake_on_any(&wake_tx);
    // Nothing to restore on a configuration that is gone; its return wakes the keeper.
    feeds.webhook_configuration.on_change(move |_| {
        let _ = wake_tx.send(());
    });
    let ctx = ConditionContext {
        client: shared.client.clone(),
        policies: feeds.policies.store(),
        leader: shared.leadership.clone(),
        metrics: shared.metrics.clone(),
    };
    let shared = shared.clone();
    Part::new(CONTROLLER, async move {
        let keeper = Keeper {
            controller: CONTROLLER,
            kind: ConditionSyncError::kind,
            wake,
        };
        let pass = || async { reconcile_conditions(&ctx).await.map(|_| ()) };
        keep(&shared, keeper, async {}, pass).await;
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn configuration(conditions: serde_json::Value) -> MutatingWebhookConfiguration {
        let mut hook = json!({
            "name": "pods.gpuwarden.io",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "clientConfig": {"url": "https://example.invalid/mutate"},
        });
        if !conditions.is_null() {
            hook["matchConditions"] = conditions;
        }
        let vms = json!({
            "name": "vms.gpuwarden.io",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "clientConfig": {"url": "https://example.invalid/mutate"},
        });
        serde_json::from_value(json!({"metadata": {"name": "gpuwarden"}, "webhooks": [hook, vms]}))
            .expect("a configuration")
    }

    fn apply(mwc: &MutatingWebhookConfiguration, expression: &str) -> serde_json::Value {
        let mut value = serde_json::to_value(mwc).unwrap();
        if let Some(patch) = conditions_patch(mwc, expression).unwrap() {
            json_patch::patch(&mut value, &patch.0).unwrap();
        }
        value
    }

    #[test]
    fn the_condition_is_added_beside_the_shipped_one_replaced_and_then_left_alone() {
        let shipped = json!([{"name": "may-reach-gpus", "expression": "true"}]);
        let mwc = configuration(shipped.clone());
        let added = apply(&mwc, "!(a)");
        assert_eq!(
            added["webhooks"][0]["matchConditions"],
            json!([shipped[0], {"name": NOT_EXEMPT_CONDITION, "expression": "!(a)"}])
        );
        let current: MutatingWebhookConfiguration = serde_json::from_value(added).unwrap();
        assert!(conditions_patch(&current, "!(a)").unwrap().is_none());
        let replaced = apply(&current, "true");
        assert_eq!(
            replaced["webhooks"][0]["matchConditions"][1]["expression"],
            "true"
        );
        assert_eq!(replaced["webhooks"][0]["matchConditions"][0], shipped[0]);
        // The VM webhook's objects are no pods: it gets no pod condition.
        assert!(replaced["webhooks"][1].get("matchConditions").is_none());
        // A configuration without conditions gets the list.
        let bare = apply(&configuration(serde_json::Value::Null), "!(b)");
        assert_eq!(
            bare["webhooks"][0]["matchConditions"],
            json!([{"name": NOT_EXEMPT_CONDITION, "expression": "!(b)"}])
        );
    }

    #[test]
    fn a_concurrent_edit_fails_the_patch() {
        let mwc = configuration(json!([{"name": NOT_EXEMPT_CONDITION, "expression": "old"}]));
        let patch = conditions_patch(&mwc, "new").unwrap().unwrap();
        let mut edited = serde_json::to_value(&mwc).unwrap();
        edited["webhooks"][0]["matchConditions"][0]["expression"] = json!("edited");
        assert!(json_patch::patch(&mut edited, &patch.0).is_err());
    }
}
