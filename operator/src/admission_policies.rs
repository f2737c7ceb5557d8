//! Keeps the admission policies rendered from the GpuPolicies
//! ([`gpuwarden_crds::admission_policies`]; docs/design.md, "Inside the API server"): asks
//! the API server whether it serves MutatingAdmissionPolicy, applies what is rendered with
//! server-side apply, and deletes what gpuwarden rendered before and no longer does.

use gpuwarden_crds::GpuPolicy;
use gpuwarden_crds::admission_policies::{
    ADMISSION_GROUP, KIND_MUTATING, KIND_MUTATING_BINDING, KIND_VALIDATING,
    KIND_VALIDATING_BINDING, LABEL_MANAGED_BY, MANAGED_BY, MutatingApi, Rendered, render,
};
use gpuwarden_crds::{FIELD_MANAGER_OPERATOR, error_chain};
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
};
use kube::{Api, Client};
use tracing::{info, warn};

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
    /// The API error.
    pub fn api_error(&self) -> &kube::Error {
        match self {
            Self::Write { source, .. } => source,
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

/// What to keep for `policies` where the cluster serves `api`: everything rendered, less the
/// MutatingAdmissionPolicies where it serves none.
pub fn desired(
    policies: &[&GpuPolicy],
    valid: impl Fn(&GpuPolicy) -> bool,
    api: Option<MutatingApi>,
) -> Vec<Rendered> {
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
