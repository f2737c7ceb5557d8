//! Keeps the webhook's TLS Secret and the MutatingWebhookConfiguration's `caBundle` in step
//! with [`crate::certs::plan`]. The `caBundle` is patched before the Secret is written, so by
//! the time the webhook serves a certificate from a new CA, the API server already trusts it.
//!
//! A pass runs when the certificates are due, when the webhook configuration appears or its
//! bundles change (the runner watches that one object), and every [`MAX_RECHECK`] otherwise.
//! A configuration re-created from the manifests, which carry no `caBundle`, is thus trusted
//! again within seconds rather than refusing every pod it sends until the next pass.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuwarden_crds::install::{MUTATING_WEBHOOK_CONFIGURATION, WEBHOOK_TLS_SECRET};
use gpuwarden_crds::{FIELD_MANAGER_OPERATOR, error_chain};
use jiff::Timestamp;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::certs::{self, CertError, CertParams};
use crate::feeds::Feeds;
use crate::metrics::Metrics;
use crate::wiring::{Backoffs, Part, Shared, wait_for_turn};
use crate::{Clock, Leadership};

/// Controller name in metrics and logs.
pub const CONTROLLER: &str = "webhook-certificates";
/// Longest wait between two passes. The watch on the webhook configuration wakes a pass at
/// once; this is the net under it (a watch the RBAC does not allow yet, a Secret edited by
/// hand).
pub const MAX_RECHECK: Duration = Duration::from_secs(300);

/// A certificate reconcile that failed.
#[derive(Debug, thiserror::Error)]
pub enum CertSyncError {
    /// An API call failed.
    #[error("failed to {action} {namespace}/{name}")]
    Api {
        /// What was being done.
        action: &'static str,
        /// Namespace ("" for cluster-scoped objects).
        namespace: String,
        /// Object name.
        name: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Generating certificates failed.
    #[error("failed to plan webhook certificates")]
    Plan(#[from] CertError),
    /// A patch could not be encoded.
    #[error("failed to encode the caBundle patch")]
    Encode(#[source] serde_json::Error),
}

impl CertSyncError {
    /// A bounded label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Api { source, .. } => crate::api_error_kind(source),
            Self::Plan(_) => "certificate",
            Self::Encode(_) => "encode",
        }
    }
}

/// What the certificate keeper needs.
pub struct CertContext {
    /// API client.
    pub client: Client,
    /// Namespace of the Secret and the webhook Service.
    pub namespace: String,
    /// Certificate parameters.
    pub params: CertParams,
    /// Current time.
    pub clock: Clock,
    /// Whether this replica may write.
    pub leader: Leadership,
    /// Metrics.
    pub metrics: Arc<Metrics>,
}

/// One pass: read the Secret and webhook configuration, write what differs. Returns when the
/// next pass is due.
#[tracing::instrument(skip(ctx), fields(secret = WEBHOOK_TLS_SECRET, namespace = %ctx.namespace))]
pub async fn reconcile_certificates(ctx: &CertContext) -> Result<Timestamp, CertSyncError> {
    let now = (ctx.clock)();
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
    let existing = secret_data(ctx, &secrets).await?;
    let plan = certs::plan(&existing, now, &ctx.params)?;
    if !ctx.leader.is_leader() {
        return Ok(now + MAX_RECHECK);
    }
    patch_ca_bundle(ctx, &plan.ca_bundle).await?;
    if plan.changed() {
        apply_secret(ctx, &secrets, &plan).await?;
    }
    let recheck = now + MAX_RECHECK;
    Ok(if plan.next_renewal < recheck {
        plan.next_renewal.max(now)
    } else {
        recheck
    })
}

/// A failed `action` on the object `namespace/name`, for `map_err`.
fn api_error(
    action: &'static str,
    namespace: &str,
    name: &str,
) -> impl FnOnce(kube::Error) -> CertSyncError + use<> {
    let (namespace, name) = (namespace.to_owned(), name.to_owned());
    move |source| CertSyncError::Api {
        action,
        namespace,
        name,
        source,
    }
}

/// What the webhook's TLS Secret holds; empty when there is no Secret yet.
async fn secret_data(
    ctx: &CertContext,
    secrets: &Api<Secret>,
) -> Result<BTreeMap<String, Vec<u8>>, CertSyncError> {
    let secret = secrets
        .get_opt(WEBHOOK_TLS_SECRET)
        .await
        .map_err(api_error("read Secret", &ctx.namespace, WEBHOOK_TLS_SECRET))?;
    Ok(secret
        .and_then(|s| s.data)
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.0))
        .collect())
}

/// Sets `bundle` as the `caBundle` of every webhook of the MutatingWebhookConfiguration
/// whose bundle differs ([`ca_bundle_patch`]). A configuration that does not exist yet gets
/// it on a later pass.
async fn patch_ca_bundle(ctx: &CertContext, bundle: &[u8]) -> Result<(), CertSyncError> {
    let mwcs: Api<MutatingWebhookConfiguration> = Api::all(ctx.client.clone());
    let mwc = mwcs
        .get_opt(MUTATING_WEBHOOK_CONFIGURATION)
        .await
        .map_err(api_error(
            "read MutatingWebhookConfiguration",
            "",
            MUTATING_WEBHOOK_CONFIGURATION,
        ))?;
    let Some(mwc) = mwc else {
        warn!(
            "MutatingWebhookConfiguration {MUTATING_WEBHOOK_CONFIGURATION} not found; its caBundle will be set once it exists"
        );
        return Ok(());
    };
    let Some(patch) = ca_bundle_patch(&mwc, bundle).map_err(CertSyncError::Encode)? else {
        return Ok(());
    };
    // A JSON patch under the operator's own name rather than a server-side apply: the
    // operator then owns each `caBundle` it sets and nothing else. An apply would also co-own
    // each webhook entry by its key, so a re-apply of the user's manifests that drops an entry
    // would leave a stub of it, which the API server refuses. Each `add` is guarded by a
    // `test` of the entry's name.
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER_OPERATOR.to_owned()),
        ..PatchParams::default()
    };
    mwcs.patch(
        MUTATING_WEBHOOK_CONFIGURATION,
        &params,
        &Patch::Json::<()>(patch),
    )
    .await
    .map_err(api_error(
        "patch caBundle of",
        "",
        MUTATING_WEBHOOK_CONFIGURATION,
    ))?;
    ctx.metrics.write(CONTROLLER, "ca-bundle");
    info!(
        cas = certs::bundle_len(bundle),
        "patched caBundle of MutatingWebhookConfiguration {MUTATING_WEBHOOK_CONFIGURATION}"
    );
    Ok(())
}

/// Writes the plan's data to the webhook's TLS Secret by server-side apply.
async fn apply_secret(
    ctx: &CertContext,
    secrets: &Api<Secret>,
    plan: &certs::CertPlan,
) -> Result<(), CertSyncError> {
    let data: BTreeMap<&str, ByteString> = plan
        .data
        .iter()
        .map(|(k, v)| (k.as_str(), ByteString(v.clone())))
        .collect();
    let body = json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": WEBHOOK_TLS_SECRET,
            "namespace": ctx.namespace,
            "labels": { "app.kubernetes.io/managed-by": FIELD_MANAGER_OPERATOR },
        },
        "type": "kubernetes.io/tls",
        "data": data,
    });
    secrets
        .patch(
            WEBHOOK_TLS_SECRET,
            &PatchParams::apply(FIELD_MANAGER_OPERATOR).force(),
            &Patch::Apply(body),
        )
        .await
        .map_err(api_error(
            "apply Secret",
            &ctx.namespace,
            WEBHOOK_TLS_SECRET,
        ))?;
    ctx.metrics.write(CONTROLLER, "secret");
    info!(reasons = ?plan.reasons, "webhook certificates written");
    Ok(())
}

/// A JSON patch setting `caBundle` on every webhook whose bundle differs, each guarded by a
/// `test` of the webhook's name so a concurrent reorder fails instead of patching the wrong one.
pub fn ca_bundle_patch(
    mwc: &MutatingWebhookConfiguration,
    bundle: &[u8],
) -> Result<Option<json_patch::Patch>, serde_json::Error> {
    let mut ops = Vec::new();
    for (i, wh) in mwc.webhooks.iter().flatten().enumerate() {
        if wh.client_config.ca_bundle.as_ref().map(|b| b.0.as_slice()) == Some(bundle) {
            continue;
        }
        ops.push(json!({ "op": "test", "path": format!("/webhooks/{i}/name"), "value": wh.name }));
        ops.push(json!({
            "op": "add",
            "path": format!("/webhooks/{i}/clientConfig/caBundle"),
            "value": ByteString(bundle.to_vec()),
        }));
    }
    if ops.is_empty() {
        return Ok(None);
    }
    serde_json::from_value(serde_json::Value::Array(ops)).map(Some)
}
/// The certificate keeper, unless the certificates are managed elsewhere (`manage` off):
/// a pass when they are due, when the webhook configuration appears or its bundles change,
/// on becoming the leader, and after a failure (with backoff).
pub fn wire(shared: &Shared, feeds: &mut Feeds, manage: bool, params: CertParams) -> Part {
    if !manage {
        info!("webhook certificates are managed elsewhere (e.g. cert-manager)");
        return Part::new(CONTROLLER, async {});
    }
    let (wake_tx, wake) = mpsc::unbounded_channel();
    // Nothing to restore on a configuration that is gone; its return wakes the keeper.
    feeds.webhook_configuration.on_change(move |_| {
        let _ = wake_tx.send(());
    });
    let ctx = CertContext {
        client: shared.client.clone(),
        namespace: params.namespace.clone(),
        params,
        clock: shared.clock.clone(),
        leader: shared.leadership.clone(),
        metrics: shared.metrics.clone(),
    };
    let shared = shared.clone();
    Part::new(
        CONTROLLER,
        async move { cert_loop(&shared, ctx, wake).await },
    )
}

/// Keeps the webhook's certificates until shutdown: a pass when they are due, when woken,
/// on becoming the leader, and after a failure (with backoff).
async fn cert_loop(shared: &Shared, ctx: CertContext, mut wake: mpsc::UnboundedReceiver<()>) {
    let mut leadership = ctx.leader.clone();
    let backoffs = Backoffs::default();
    loop {
        let wait = if ctx.leader.is_leader() {
            pass(&ctx, &backoffs).await
        } else {
            MAX_RECHECK
        };
        debug!(?wait, "next webhook certificate check");
        if !wait_for_turn(shared, &mut leadership, &mut wake, wait).await {
            return;
        }
    }
}

/// One timed pass; returns how long until the next.
async fn pass(ctx: &CertContext, backoffs: &Backoffs) -> Duration {
    let start = Instant::now();
    match reconcile_certificates(ctx).await {
        Ok(next) => {
            ctx.metrics.reconciled(CONTROLLER, start.elapsed(), None);
            backoffs.reset(CONTROLLER);
            let left = next.duration_since((ctx.clock)());
            Duration::try_from(left)
                .unwrap_or_default()
                .max(Duration::from_secs(1))
        }
        Err(e) => {
            (ctx.metrics).reconciled(CONTROLLER, start.elapsed(), Some(e.kind()));
            let delay = backoffs.next(CONTROLLER);
            warn!(error = %error_chain(&e), retry_in = ?delay, "webhook certificate sync failed");
            delay
        }
    }
}
