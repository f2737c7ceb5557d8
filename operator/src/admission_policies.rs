//! Keeps the admission policies rendered from the GpuPolicies
//! ([`gpuwarden_crds::admission::policies`]; docs/design.md, "Inside the API server"): one
//! keeper pass applies what is rendered with server-side apply and deletes what gpuwarden
//! rendered before and no longer does. Whether the API server serves MutatingAdmissionPolicy
//! is asked once at start. The GpuPolicy reconciler reads [`Keeping`] for each policy's
//! `AdmissionPolicies` condition.

use std::sync::{Arc, Mutex};

use gpuwarden_crds::GpuPolicy;
use gpuwarden_crds::admission::policies::{
    ADMISSION_GROUP, KIND_MUTATING, KIND_MUTATING_BINDING, KIND_VALIDATING,
    KIND_VALIDATING_BINDING, LABEL_MANAGED_BY, MANAGED_BY, MutatingApi, Rendered, render,
};
use gpuwarden_crds::validation::validate_policy;
use gpuwarden_crds::{FIELD_MANAGER_OPERATOR, error_chain};
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
};
use kube::runtime::reflector::Store;
use kube::{Api, Client};
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::Leadership;
use crate::feeds::Feeds;
use crate::metrics::Metrics;
use crate::wiring::{self, Keeper, Part, Shared};

/// Controller name in metrics and logs.
pub const CONTROLLER: &str = "admission-policies";

/// What the keeper found: which version serves MutatingAdmissionPolicy, and why its last
/// pass failed, if it did.
#[derive(Debug)]
pub struct Keeping {
    /// The version serving MutatingAdmissionPolicy, if any.
    pub api: Option<MutatingApi>,
    failure: Mutex<Option<String>>,
}

impl Keeping {
    /// Nothing kept yet, where `api` serves MutatingAdmissionPolicy.
    pub fn new(api: Option<MutatingApi>) -> Self {
        Self {
            api,
            failure: Mutex::new(None),
        }
    }

    /// Why the last pass failed, if it did.
    pub fn failure(&self) -> Option<String> {
        self.failure.lock().map(|f| f.clone()).unwrap_or_default()
    }

    /// Records a pass; whether that changed what [`Keeping::failure`] says.
    fn record(&self, failure: Option<String>) -> bool {
        let Ok(mut last) = self.failure.lock() else {
            return false;
        };
        let changed = *last != failure;
        *last = failure;
        changed
    }
}

/// What the keeper needs.
pub struct AdmissionContext {
    /// API client.
    pub client: Client,
    /// Every GpuPolicy.
    pub policies: Store<GpuPolicy>,
    /// What was discovered and how the last pass went.
    pub keeping: Arc<Keeping>,
    /// Wakes the GpuPolicy reconciler when the last pass's outcome changes.
    pub policies_changed: mpsc::UnboundedSender<()>,
    /// Whether this replica may write.
    pub leader: Leadership,
    /// Metrics.
    pub metrics: Arc<Metrics>,
}

/// Keeping the admission policies failed.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionPolicyError {
    /// Applying, listing or deleting one failed.
    #[error("failed to {action} {kind} {name}")]
    Write {
        /// What was being done.
        action: &'static str,
        /// The kind.
        kind: &'static str,
        /// The object's name ("" for a list).
        name: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

impl AdmissionPolicyError {
    /// A bounded label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Write { source, .. } => crate::api_error_kind(source),
        }
    }
}

/// Which version of `admissionregistration.k8s.io` serves MutatingAdmissionPolicy: `v1`
/// (Kubernetes 1.36), else `v1beta1` (1.34 and 1.35 with the feature gate and API on), else
/// none. A failed discovery counts as none and is logged.
pub async fn discover(client: &Client) -> Option<MutatingApi> {
    for api in [MutatingApi::V1, MutatingApi::V1beta1] {
        match client.list_api_group_resources(api.api_version()).await {
            Ok(list)
                if list
                    .resources
                    .iter()
                    .any(|r| r.name == "mutatingadmissionpolicies") =>
            {
                return Some(api);
            }
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => {
                warn!(error = %error_chain(&e), version = api.version(), "discovery of MutatingAdmissionPolicy failed")
            }
        }
    }
    None
}

/// What to keep for `policies` where the cluster serves `api`: everything rendered from the
/// valid ones (the webhook's test, [`validate_policy`]), less the MutatingAdmissionPolicies
/// where it serves none.
pub fn desired(policies: &[&GpuPolicy], api: Option<MutatingApi>) -> Vec<Rendered> {
    let valid = |p: &GpuPolicy| validate_policy(p).is_empty();
    let mut out = render(policies, valid, api.unwrap_or(MutatingApi::V1));
    if api.is_none() {
        out.retain(|r| r.kind != KIND_MUTATING && r.kind != KIND_MUTATING_BINDING);
    }
    out
}

fn resource(kind: &'static str, api: Option<MutatingApi>) -> Option<ApiResource> {
    let version = match kind {
        KIND_VALIDATING | KIND_VALIDATING_BINDING => "v1",
        _ => api?.version(),
    };
    Some(ApiResource::from_gvk(&GroupVersionKind::gvk(
        ADMISSION_GROUP,
        version,
        kind,
    )))
}

/// One pass: what the policies call for, kept; the outcome recorded in [`Keeping`], and the
/// GpuPolicy reconciler woken when it changed. Only the leader writes.
#[tracing::instrument(skip(ctx))]
pub async fn reconcile_admission_policies(
    ctx: &AdmissionContext,
) -> Result<(), AdmissionPolicyError> {
    if !ctx.leader.is_leader() {
        return Ok(());
    }
    let policies = ctx.policies.state();
    let refs: Vec<&GpuPolicy> = policies.iter().map(AsRef::as_ref).collect();
    let api = ctx.keeping.api;
    let result = keep(&ctx.client, &desired(&refs, api), api).await;
    let failure = result.as_ref().err().map(|e| error_chain(e));
    if ctx.keeping.record(failure) {
        let _ = ctx.policies_changed.send(());
    }
    result
}

/// Applies `desired` and deletes every object of the four kinds that carries gpuwarden's
/// managed-by label and is not in it.
pub async fn keep(
    client: &Client,
    desired: &[Rendered],
    api: Option<MutatingApi>,
) -> Result<(), AdmissionPolicyError> {
    let params = PatchParams::apply(FIELD_MANAGER_OPERATOR).force();
    // Policies before their bindings, so a binding never names a policy that is missing.
    for object in desired {
        let Some(resource) = resource(object.kind, api) else {
            continue;
        };
        let objects: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
        objects
            .patch(&object.name, &params, &Patch::Apply(&object.object))
            .await
            .map_err(|source| AdmissionPolicyError::Write {
                action: "apply",
                kind: object.kind,
                name: object.name.clone(),
                source,
            })?;
    }
    let selector = format!("{LABEL_MANAGED_BY}={MANAGED_BY}");
    // Bindings before their policies.
    for kind in [
        KIND_MUTATING_BINDING,
        KIND_MUTATING,
        KIND_VALIDATING_BINDING,
        KIND_VALIDATING,
    ] {
        let Some(resource) = resource(kind, api) else {
            continue;
        };
        let objects: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
        let listed = objects
            .list_metadata(&ListParams::default().labels(&selector))
            .await
            .map_err(|source| AdmissionPolicyError::Write {
                action: "list",
                kind,
                name: String::new(),
                source,
            })?;
        for stale in listed.items {
            let name = stale.metadata.name.unwrap_or_default();
            if desired.iter().any(|d| d.kind == kind && d.name == name) {
                continue;
            }
            info!(
                kind,
                name, "deleting an admission policy no GpuPolicy renders any more"
            );
            match objects.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(source) => {
                    return Err(AdmissionPolicyError::Write {
                        action: "delete",
                        kind,
                        name,
                        source,
                    });
                }
            }
        }
    }
    Ok(())
}
/// Whether the operator keeps admission policies (`enabled`, its `--admission-policies`),
/// and in which version of the API, asked once.
pub async fn keeping(client: &Client, enabled: bool) -> Option<Arc<Keeping>> {
    if !enabled {
        return None;
    }
    let api = discover(client).await;
    match api {
        Some(api) => info!(version = api.version(), "keeping MutatingAdmissionPolicies"),
        None => warn!(
            "the API server does not serve MutatingAdmissionPolicy: containers that hold no GPU keep their image's NVIDIA_VISIBLE_DEVICES"
        ),
    }
    Some(Arc::new(Keeping::new(api)))
}

/// The admission policies' keeper: a pass whenever a GpuPolicy changes, once the policies'
/// cache is complete (an empty one would delete every policy kept). A change in what failed
/// wakes `revalidate`, the GpuPolicy controller, whose conditions say it.
pub fn wire(
    shared: &Shared,
    feeds: &mut Feeds,
    keeping: Option<Arc<Keeping>>,
    revalidate: mpsc::UnboundedSender<()>,
) -> Part {
    let Some(keeping) = keeping else {
        return Part::new(CONTROLLER, async {});
    };
    let (wake_tx, wake) = mpsc::unbounded_channel();
    feeds.policies.wake_on_any(&wake_tx);
    let ctx = AdmissionContext {
        client: shared.client.clone(),
        policies: feeds.policies.store(),
        keeping,
        policies_changed: revalidate,
        leader: shared.leadership.clone(),
        metrics: shared.metrics.clone(),
    };
    let shared = shared.clone();
    Part::new(CONTROLLER, async move {
        let keeper = Keeper {
            controller: CONTROLLER,
            kind: AdmissionPolicyError::kind,
            wake,
        };
        let ready = async {
            let _ = ctx.policies.wait_until_ready().await;
        };
        wiring::keep(&shared, keeper, ready, || {
            reconcile_admission_policies(&ctx)
        })
        .await;
    })
}
