//! `gpuwarden-operator uninstall`: removes what the operator wrote at run time, which an
//! uninstall of the chart's objects alone would leave behind, and hands the CRDs to garbage
//! collection. The Helm chart runs it as a pre-delete hook, while the CRDs, the operator and
//! the chart's ClusterRole still exist:
//!
//! 1. every GpuPolicy is deleted and waited for: the operator (still running) stops rendering
//!    admission policies from them, and garbage collection, which can still resolve the
//!    GpuPolicy kind, deletes the ResourceClaimTemplates they own;
//! 2. what is left of the admission policies the operator keeps (label
//!    `app.kubernetes.io/managed-by=gpuwarden-operator`), of its ResourceClaimTemplates
//!    (label `gpuwarden.io/claim-template`) and of its PolicyReports and Reports (the same
//!    label; they have no owner) is deleted, where the API server serves the kind;
//! 3. both CRDs get an owner reference to the chart's ClusterRole `gpuwarden-operator`. Helm
//!    never deletes CRDs it installed from a chart's `crds/`; once Helm has deleted that
//!    ClusterRole, garbage collection deletes the CRDs, and with them the GpuNodes.
//!
//! Every step is idempotent: a second run, or one after a partial uninstall, finds less to do.

use std::time::{Duration, Instant};

use gpuwarden_crds::claims::LABEL_CLAIM_TEMPLATE;
use gpuwarden_crds::{GpuNode, GpuPolicy};
use k8s_openapi::api::rbac::v1::ClusterRole;
use k8s_openapi::api::resource::v1::ResourceClaimTemplate;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, Client, CustomResourceExt, ResourceExt};
use serde_json::json;
use tracing::info;

use crate::admission_policies::{self, AdmissionPolicyError};

/// How often the wait for the GpuPolicies to go looks again.
const POLL: Duration = Duration::from_secs(1);

/// What the uninstall needs.
#[derive(Clone, Debug)]
pub struct UninstallConfig {
    /// The ClusterRole the CRDs are handed to (the chart's `gpuwarden-operator`).
    pub owner_cluster_role: String,
    /// How long to wait for the GpuPolicies to be deleted.
    pub timeout: Duration,
}

/// The uninstall failed.
#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    /// An API call failed.
    #[error("failed to {action} {what}")]
    Api {
        /// What was being done.
        action: &'static str,
        /// The object or kind.
        what: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// The GpuPolicies were not gone in time.
    #[error("{left} GpuPolicies still exist after {waited:?} (finalizers?): {names}")]
    PoliciesRemain {
        /// How many.
        left: usize,
        /// Their names.
        names: String,
        /// How long was waited.
        waited: Duration,
    },
    /// The ClusterRole the CRDs would be handed to does not exist.
    #[error(
        "ClusterRole {0} not found: nothing would delete the CRDs; delete them yourself (kubectl delete crd gpupolicies.gpuwarden.io gpunodes.gpuwarden.io)"
    )]
    NoOwner(String),
    /// Deleting the admission policies the operator kept failed.
    #[error(transparent)]
    AdmissionPolicies(#[from] AdmissionPolicyError),
    /// Deleting the policy reports the operator kept failed.
    #[error(transparent)]
    Reports(#[from] crate::reports::ReportError),
}

fn api_err(
    action: &'static str,
    what: impl Into<String>,
) -> impl FnOnce(kube::Error) -> UninstallError {
    let what = what.into();
    move |source| UninstallError::Api {
        action,
        what,
        source,
    }
}

/// Whether `e` says the kind is not served (or the object is gone).
fn not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(status) if status.code == 404)
}

/// Runs the steps (module documentation).
#[tracing::instrument(skip(client), fields(owner = %config.owner_cluster_role))]
pub async fn uninstall(client: Client, config: &UninstallConfig) -> Result<(), UninstallError> {
    delete_policies(&client, config.timeout).await?;
    let api = admission_policies::discover(&client).await;
    admission_policies::keep(&client, &[], api).await?;
    delete_claim_templates(&client).await?;
    let reports = crate::reports::delete_all(&client).await?;
    info!(reports, "deleted the policy reports the operator kept");
    hand_crds_to(&client, &config.owner_cluster_role).await
}

/// Deletes every GpuPolicy and waits until none is left; nothing where the kind is not served.
async fn delete_policies(client: &Client, timeout: Duration) -> Result<(), UninstallError> {
    let policies: Api<GpuPolicy> = Api::all(client.clone());
    let start = Instant::now();
    let mut deleted = false;
    loop {
        let names: Vec<String> = match policies.list_metadata(&ListParams::default()).await {
            Ok(list) => list.items.iter().map(ResourceExt::name_any).collect(),
            Err(e) if not_found(&e) => return Ok(()),
            Err(e) => return Err(api_err("list", "GpuPolicies")(e)),
        };
        if names.is_empty() {
            return Ok(());
        }
        if !deleted {
            for name in &names {
                match policies.delete(name, &DeleteParams::foreground()).await {
                    Ok(_) => info!(policy = %name, "deleting GpuPolicy"),
                    Err(e) if not_found(&e) => {}
                    Err(e) => return Err(api_err("delete GpuPolicy", name.clone())(e)),
                }
            }
            deleted = true;
        }
        if start.elapsed() >= timeout {
            return Err(UninstallError::PoliciesRemain {
                left: names.len(),
                names: names.join(", "),
                waited: timeout,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Deletes the ResourceClaimTemplates the operator kept; nothing where DRA is not served.
async fn delete_claim_templates(client: &Client) -> Result<(), UninstallError> {
    let templates: Api<ResourceClaimTemplate> = Api::all(client.clone());
    let listed = match templates
        .list_metadata(&ListParams::default().labels(LABEL_CLAIM_TEMPLATE))
        .await
    {
        Ok(list) => list.items,
        Err(e) if not_found(&e) => return Ok(()),
        Err(e) => return Err(api_err("list", "ResourceClaimTemplates")(e)),
    };
    for template in listed {
        let (Some(namespace), name) = (template.namespace(), template.name_any()) else {
            continue;
        };
        let api: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), &namespace);
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {
                info!(namespace = %namespace, template = %name, "deleted ResourceClaimTemplate")
            }
            Err(e) if not_found(&e) => {}
            Err(e) => {
                return Err(api_err(
                    "delete ResourceClaimTemplate",
                    format!("{namespace}/{name}"),
                )(e));
            }
        }
    }
    Ok(())
}

/// Gives both CRDs an owner reference to the ClusterRole `owner`.
async fn hand_crds_to(client: &Client, owner: &str) -> Result<(), UninstallError> {
    let roles: Api<ClusterRole> = Api::all(client.clone());
    let role = roles
        .get_opt(owner)
        .await
        .map_err(api_err("get ClusterRole", owner))?
        .ok_or_else(|| UninstallError::NoOwner(owner.to_owned()))?;
    let Some(uid) = role.metadata.uid else {
        return Err(UninstallError::NoOwner(owner.to_owned()));
    };
    let patch = owner_patch(owner, &uid);
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in [GpuPolicy::crd_name(), GpuNode::crd_name()] {
        match crds
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => info!(crd = name, owner, "CRD handed to garbage collection"),
            Err(e) if not_found(&e) => {}
            Err(e) => return Err(api_err("patch the owner of CRD", name)(e)),
        }
    }
    Ok(())
}

/// The merge patch that makes the ClusterRole `name` (uid `uid`) a CRD's only owner.
fn owner_patch(name: &str, uid: &str) -> serde_json::Value {
    json!({
        "metadata": {
            "ownerReferences": [{
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "name": name,
                "uid": uid,
            }]
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    #[test]
    fn the_owner_patch_names_the_cluster_role_by_uid() {
        let patch = owner_patch("gpuwarden-operator", "1234");
        let refs: Vec<OwnerReference> =
            serde_json::from_value(patch["metadata"]["ownerReferences"].clone()).unwrap();
        assert_eq!(refs.len(), 1);
        assert_eq!(refs[0].kind, "ClusterRole");
        assert_eq!(refs[0].api_version, "rbac.authorization.k8s.io/v1");
        assert_eq!(refs[0].name, "gpuwarden-operator");
        assert_eq!(refs[0].uid, "1234");
        assert_eq!(refs[0].controller, None);
    }
}
