//! gpuwarden's ResourceClaimTemplates (docs/design.md, "ResourceClaims"). A policy with
//! `gpu.requestAs: ResourceClaim` rewrites GPU containers into claims from the templates
//! `gpuwarden-<deviceClassName>-<count>`; the operator keeps one per device class and count
//! (1 to `maxPerContainer`) in each namespace such a policy governs, owned by the policies
//! that want it, and deletes those no policy wants any more.
//!
//! [`desired_templates`] is the pure core; [`reconcile_templates`] compares it with the cache
//! of templates carrying [`LABEL_CLAIM_TEMPLATE`] (never anyone else's) and writes only the
//! differences, by server-side apply.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use gpuwarden_crds::claims::{LABEL_CLAIM_TEMPLATE, TEMPLATE_REQUEST, template_name};
use gpuwarden_crds::selection::NamespaceLabels;
use gpuwarden_crds::selector::{self, Labels};
use gpuwarden_crds::{FIELD_MANAGER_OPERATOR, GpuPolicy, RequestAs};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::resource::v1::{
    DeviceClaim, DeviceRequest, ExactDeviceRequest, ResourceClaimSpec, ResourceClaimTemplate,
    ResourceClaimTemplateSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{DeleteParams, PartialObjectMeta, Patch, PatchParams, Preconditions};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::mpsc;
use tracing::{debug, info};

use crate::Leadership;
use crate::feeds::Feeds;
use crate::metrics::Metrics;
use crate::wiring::{Feed, Keeper, Part, Shared, hash_of, keep};

/// Controller name in metrics and logs.
pub const CONTROLLER: &str = "claimtemplates";

/// A template's place: namespace and name.
pub type TemplateKey = (String, String);

/// A template the operator keeps.
#[derive(Clone, Debug, PartialEq)]
pub struct Desired {
    /// The DeviceClass its one request asks for.
    pub class: String,
    /// How many devices.
    pub count: u32,
    /// The policies that want it, sorted by name.
    pub owners: Vec<OwnerReference>,
}

/// What the policies want: for each `ResourceClaim`-mode policy that is not being deleted,
/// in each namespace its `namespaceSelector` selects (not being deleted, and not exempt by
/// `exemptions.namespaces`), one template per count from 1 to `maxPerContainer`. A policy
/// whose selector cannot be read wants none: the webhook denies its pods anyway.
pub fn desired_templates<'n>(
    policies: &[Arc<GpuPolicy>],
    namespaces: impl IntoIterator<Item = (&'n str, Option<&'n BTreeMap<String, String>>)> + Clone,
) -> BTreeMap<TemplateKey, Desired> {
    let mut out: BTreeMap<TemplateKey, Desired> = BTreeMap::new();
    let mut policies: Vec<&GpuPolicy> = (policies.iter())
        .map(Arc::as_ref)
        .filter(|p| p.spec.gpu.request_as == RequestAs::ResourceClaim)
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    policies.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    for policy in policies {
        let Some(owner) = owner_of(policy) else {
            continue;
        };
        let spec = &policy.spec;
        for (namespace, labels) in namespaces.clone() {
            let labels = NamespaceLabels {
                name: namespace,
                known: labels,
            };
            let selected = selector::matches(&spec.namespace_selector, &labels as &dyn Labels);
            if selected != Ok(true) || spec.exemptions.namespaces.iter().any(|n| n == namespace) {
                continue;
            }
            for count in 1..=spec.gpu.max_per_container {
                let class = &spec.gpu.device_class_name;
                let key = (namespace.to_owned(), template_name(class, count));
                let entry = out.entry(key).or_insert_with(|| Desired {
                    class: class.clone(),
                    count,
                    owners: Vec::new(),
                });
                entry.owners.push(owner.clone());
            }
        }
    }
    out
}

/// The owner reference to a policy, once the API server gave it a uid.
fn owner_of(policy: &GpuPolicy) -> Option<OwnerReference> {
    Some(OwnerReference {
        api_version: GpuPolicy::api_version(&()).into_owned(),
        kind: GpuPolicy::kind(&()).into_owned(),
        name: policy.metadata.name.clone()?,
        uid: policy.metadata.uid.clone()?,
        controller: None,
        block_owner_deletion: None,
    })
}

/// The template as the operator applies it.
pub fn template_object(key: &TemplateKey, desired: &Desired) -> ResourceClaimTemplate {
    ResourceClaimTemplate {
        metadata: ObjectMeta {
            name: Some(key.1.clone()),
            namespace: Some(key.0.clone()),
            labels: Some(BTreeMap::from([
                (LABEL_CLAIM_TEMPLATE.to_owned(), "true".to_owned()),
                (
                    "app.kubernetes.io/managed-by".to_owned(),
                    gpuwarden_crds::install::OPERATOR_NAME.to_owned(),
                ),
            ])),
            owner_references: Some(desired.owners.clone()),
            ..ObjectMeta::default()
        },
        spec: ResourceClaimTemplateSpec {
            metadata: None,
            spec: ResourceClaimSpec {
                devices: Some(DeviceClaim {
                    requests: Some(vec![DeviceRequest {
                        name: TEMPLATE_REQUEST.to_owned(),
                        exactly: Some(ExactDeviceRequest {
                            device_class_name: desired.class.clone(),
                            allocation_mode: Some("ExactCount".to_owned()),
                            count: Some(i64::from(desired.count)),
                            ..ExactDeviceRequest::default()
                        }),
                        first_available: None,
                    }]),
                    ..DeviceClaim::default()
                }),
            },
        },
    }
}

/// Whether `existing` already is what `desired` says: the same owners (by uid) and the same
/// request. The spec of a template cannot change; the name says what it holds.
pub fn is_current(existing: &ResourceClaimTemplate, desired: &Desired) -> bool {
    let uids = |owners: &[OwnerReference]| -> BTreeSet<String> {
        owners.iter().map(|o| o.uid.clone()).collect()
    };
    let owners = existing
        .metadata
        .owner_references
        .as_deref()
        .unwrap_or_default();
    let request = (existing.spec.spec.devices.as_ref())
        .and_then(|d| d.requests.as_deref())
        .and_then(|r| r.first())
        .and_then(|r| r.exactly.as_ref());
    uids(owners) == uids(&desired.owners)
        && request.is_some_and(|r| {
            r.device_class_name == desired.class && r.count == Some(i64::from(desired.count))
        })
}

/// A template reconcile that failed.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// Applying a template failed.
    #[error("failed to apply ResourceClaimTemplate {namespace}/{name}")]
    Apply {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Deleting a template failed.
    #[error("failed to delete ResourceClaimTemplate {namespace}/{name}")]
    Delete {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

impl TemplateError {
    /// A bounded label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Apply { source, .. } | Self::Delete { source, .. } => {
                crate::api_error_kind(source)
            }
        }
    }
}

/// What the template reconciler needs.
pub struct TemplateContext {
    /// API client.
    pub client: Client,
    /// GpuPolicy cache.
    pub policies: Store<GpuPolicy>,
    /// Namespace cache (metadata).
    pub namespaces: Store<PartialObjectMeta<Namespace>>,
    /// Cache of the templates carrying [`LABEL_CLAIM_TEMPLATE`].
    pub templates: Store<ResourceClaimTemplate>,
    /// Whether this replica may write.
    pub leader: Leadership,
    /// Metrics.
    pub metrics: Arc<Metrics>,
}

/// What one reconcile wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Written {
    /// Templates applied.
    pub applied: usize,
    /// Templates deleted.
    pub deleted: usize,
}

/// Makes the templates what the policies want: applies the missing and the changed, deletes
/// the unwanted, and writes nothing when they already are. Every write is tried; the first
/// error is returned after.
#[tracing::instrument(skip(ctx))]
pub async fn reconcile_templates(ctx: &TemplateContext) -> Result<Written, TemplateError> {
    let mut written = Written::default();
    if !ctx.leader.is_leader() {
        return Ok(written);
    }
    let namespaces = ctx.namespaces.state();
    let live = (namespaces.iter())
        .filter(|ns| ns.metadata.deletion_timestamp.is_none())
        .map(|ns| {
            (
                ns.metadata.name.as_deref().unwrap_or(""),
                ns.metadata.labels.as_ref(),
            )
        });
    let desired = desired_templates(&ctx.policies.state(), live);
    let existing: BTreeMap<TemplateKey, Arc<ResourceClaimTemplate>> = (ctx.templates.state())
        .into_iter()
        .map(|t| ((t.namespace().unwrap_or_default(), t.name_any()), t))
        .collect();
    let mut first_error = None;
    for (key, want) in &desired {
        if existing.get(key).is_some_and(|t| is_current(t, want)) {
            continue;
        }
        let (namespace, name) = key;
        let api: Api<ResourceClaimTemplate> = Api::namespaced(ctx.client.clone(), namespace);
        let params = PatchParams::apply(FIELD_MANAGER_OPERATOR).force();
        match api
            .patch(name, &params, &Patch::Apply(template_object(key, want)))
            .await
        {
            Ok(_) => {
                written.applied += 1;
                ctx.metrics.write(CONTROLLER, "apply");
                debug!(namespace, name, "ResourceClaimTemplate applied");
            }
            Err(source) => {
                first_error.get_or_insert(TemplateError::Apply {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    source,
                });
            }
        }
    }
    for ((namespace, name), template) in &existing {
        if desired.contains_key(&(namespace.clone(), name.clone())) {
            continue;
        }
        let api: Api<ResourceClaimTemplate> = Api::namespaced(ctx.client.clone(), namespace);
        // Only the template this cache saw: one recreated since is judged on its own.
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: template.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(name, &params).await {
            Ok(_) => {
                written.deleted += 1;
                ctx.metrics.write(CONTROLLER, "delete");
                debug!(namespace, name, "ResourceClaimTemplate deleted");
            }
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(source) => {
                first_error.get_or_insert(TemplateError::Delete {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    source,
                });
            }
        }
    }
    if written != Written::default() {
        info!(
            applied = written.applied,
            deleted = written.deleted,
            "ResourceClaimTemplates reconciled"
        );
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(written),
    }
}

/// gpuwarden's ResourceClaimTemplates, where the cluster serves DRA (`dra`): once the
/// policies', namespaces' and templates' caches are complete, a pass whenever a policy, a
/// namespace's labels or one of the templates change, on becoming the leader, after a failure
/// (with backoff), and every ten minutes.
pub fn wire(shared: &Shared, feeds: &mut Feeds, dra: bool) -> Part {
    if !dra {
        info!("the cluster does not serve resource.k8s.io/v1: no ResourceClaimTemplates are kept");
        return Part::new(CONTROLLER, async {});
    }
    let (wake_tx, wake) = mpsc::unbounded_channel();
    feeds.policies.wake_on_any(&wake_tx);
    feeds.namespaces.wake_on_any(&wake_tx);
    let mut templates = Feed::<ResourceClaimTemplate>::new(|t| {
        hash_of(&(
            t.metadata.namespace.as_deref(),
            t.metadata.uid.as_deref(),
            serde_json::to_string(&t.metadata.owner_references).unwrap_or_default(),
        ))
    });
    templates.wake_on_any(&wake_tx);
    let ctx = TemplateContext {
        client: shared.client.clone(),
        policies: feeds.policies.store(),
        namespaces: feeds.namespaces.store(),
        templates: templates.store(),
        leader: shared.leadership.clone(),
        metrics: shared.metrics.clone(),
    };
    let watch = templates.start(
        Api::<ResourceClaimTemplate>::all(shared.client.clone()),
        watcher::Config::default().labels(LABEL_CLAIM_TEMPLATE),
        |t| t.metadata.managed_fields = None,
        &shared.shutdown,
    );
    let shared = shared.clone();
    let mut part = Part::new(CONTROLLER, async move {
        let keeper = Keeper {
            controller: CONTROLLER,
            kind: TemplateError::kind,
            wake,
        };
        let ready = async {
            let _ = ctx.policies.wait_until_ready().await;
            let _ = ctx.namespaces.wait_until_ready().await;
            let _ = ctx.templates.wait_until_ready().await;
        };
        let pass = || async { reconcile_templates(&ctx).await.map(|_| ()) };
        keep(&shared, keeper, ready, pass).await;
    });
    part.watches.push(watch);
    part
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

    fn claim_policy(name: &str, uid: &str, f: impl FnOnce(&mut GpuPolicy)) -> Arc<GpuPolicy> {
        let mut p = GpuPolicy::default_policy();
        p.metadata.name = Some(name.to_owned());
        p.metadata.uid = Some(uid.to_owned());
        p.spec.gpu.request_as = RequestAs::ResourceClaim;
        p.spec.gpu.max_per_container = 2;
        f(&mut p);
        Arc::new(p)
    }

    #[test]
    fn each_claim_policy_wants_one_template_per_count_in_each_namespace_it_governs() {
        let team = BTreeMap::from([("team".to_owned(), "a".to_owned())]);
        let namespaces = [("ml", Some(&team)), ("kube-system", None), ("web", None)];
        let policies = [
            // Every namespace but the exempt kube-system.
            claim_policy("all", "u-all", |_| {}),
            // Team a's namespaces, with its own class and three counts.
            claim_policy("team", "u-team", |p| {
                p.spec.namespace_selector = LabelSelector {
                    match_labels: Some(team.clone()),
                    ..LabelSelector::default()
                };
                p.spec.gpu.device_class_name = "a100.example.com".into();
                p.spec.gpu.max_per_container = 3;
            }),
            // The default mode wants none; a policy not yet stored (no uid) neither.
            Arc::new(GpuPolicy::default_policy()),
            claim_policy("new", "", |p| p.metadata.uid = None),
        ];
        let desired = desired_templates(&policies, namespaces);
        let keys: Vec<String> = desired.keys().map(|(ns, n)| format!("{ns}/{n}")).collect();
        assert_eq!(
            keys,
            [
                "ml/gpuwarden-a100.example.com-1",
                "ml/gpuwarden-a100.example.com-2",
                "ml/gpuwarden-a100.example.com-3",
                "ml/gpuwarden-gpu.nvidia.com-1",
                "ml/gpuwarden-gpu.nvidia.com-2",
                "web/gpuwarden-gpu.nvidia.com-1",
                "web/gpuwarden-gpu.nvidia.com-2",
            ]
        );
        let key = ("ml".to_owned(), "gpuwarden-a100.example.com-3".to_owned());
        let want = &desired[&key];
        assert_eq!((want.class.as_str(), want.count), ("a100.example.com", 3));
        assert_eq!(want.owners.len(), 1);
        assert_eq!(want.owners[0].uid, "u-team");

        // Two policies wanting the same template both own it.
        let twin = claim_policy("twin", "u-twin", |_| {});
        let desired = desired_templates(&[policies[0].clone(), twin], namespaces);
        let owners: Vec<&str> =
            (desired[&("web".to_owned(), "gpuwarden-gpu.nvidia.com-1".to_owned())].owners)
                .iter()
                .map(|o| o.name.as_str())
                .collect();
        assert_eq!(owners, ["all", "twin"]);

        // A policy being deleted, or whose selector cannot be read, wants none.
        let going = claim_policy("going", "u-going", |p| {
            p.metadata.deletion_timestamp = Some(
                k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
            );
        });
        let unreadable = claim_policy("bad", "u-bad", |p| {
            p.spec.namespace_selector = serde_json::from_value(serde_json::json!(
                {"matchExpressions": [{"key": "team", "operator": "Equals", "values": ["a"]}]}
            ))
            .unwrap();
        });
        assert!(desired_templates(&[going, unreadable], namespaces).is_empty());
    }

    #[test]
    fn the_applied_template_asks_for_its_count_of_its_class_and_names_its_owners() {
        let policies = [claim_policy("all", "u-all", |_| {})];
        let desired = desired_templates(&policies, [("ml", None)]);
        let (key, want) = desired.iter().nth(1).unwrap();
        let object = template_object(key, want);
        let json = serde_json::to_value(&object).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {
                    "name": "gpuwarden-gpu.nvidia.com-2", "namespace": "ml",
                    "labels": {"gpuwarden.io/claim-template": "true", "app.kubernetes.io/managed-by": "gpuwarden-operator"},
                    "ownerReferences": [{"apiVersion": "gpuwarden.io/v1alpha1", "kind": "GpuPolicy", "name": "all", "uid": "u-all"}]
                },
                "spec": {"spec": {"devices": {"requests": [
                    {"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 2}}
                ]}}}
            })
        );
        assert!(is_current(&object, want));
        let mut other = want.clone();
        other.owners[0].uid = "u-other".into();
        assert!(!is_current(&object, &other), "another owner");
        other = want.clone();
        other.count = 3;
        assert!(!is_current(&object, &other), "another count");
    }
}
