//! PolicyReports (docs/design.md, "PolicyReports"): one report per governed namespace, listing
//! what gpuwarden's webhook would change or refuse in the pods that run there (Audit mode's
//! findings, and pods created before their policy or while the webhook was bypassed).
//!
//! [`judge`] is the pure core: the webhook's own engine ([`gpuwarden_webhook::engine::decide`])
//! on a pod, its findings turned into results by [`gpuwarden_webhook::report`], the same
//! module `mutate -o policyreport` prints with. The Pod watch ([`judging`]) judges each pod as
//! it comes and keeps only the results, in [`Findings`]: the controller's memory follows what
//! it found, not the pods it watched. [`reconcile_namespace`] writes a namespace's report by
//! server-side apply in each report kind the API server serves ([`discover_kinds`]), only
//! when it differs from what was last written, and deletes it when there is nothing to
//! report. [`sweep`] lists the reports gpuwarden left (by label), so that those of namespaces
//! with nothing to report go too. [`keeper::wire`] puts them together.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex, RwLock};

use gpuwarden_crds::reports::{FIELD_MANAGER_REPORTS, LABEL_MANAGED_BY, MAX_RESULTS, REPORT_NAME};
use gpuwarden_crds::{GpuPolicy, error_chain, install};
use gpuwarden_webhook::engine::{self, ClaimStore, Input, Operation};
use gpuwarden_webhook::pod::PodView;
use gpuwarden_webhook::report::ReportResult;
use gpuwarden_webhook::report::{self, NamespaceReport, ReportKind, Subject, Timestamp};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PartialObjectMeta,
    Patch, PatchParams,
};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, ResourceExt};
use tokio::sync::watch;
use tracing::{debug, info, instrument};

use crate::Leadership;
use crate::metrics::Metrics;

mod findings;
mod judging;
pub(crate) mod keeper;

pub use findings::Findings;

/// Controller name in metrics and logs.
pub const CONTROLLER: &str = "policyreports";

/// How long a namespace's changes gather before its report is computed: a Deployment
/// scaled up is one write, not one per pod.
pub const DEBOUNCE: std::time::Duration = std::time::Duration::from_secs(2);

/// How often the operator asks again which report kinds are served (a CRD installed later is
/// found within this time), and lists the reports it left behind.
pub const RECHECK: std::time::Duration = std::time::Duration::from_secs(300);

/// Whether the pod's containers have all stopped for good: it holds no GPU any more.
fn finished(pod: &Pod) -> bool {
    let phase = (pod.status.as_ref()).and_then(|s| s.phase.as_deref());
    matches!(phase, Some("Succeeded" | "Failed"))
}

/// What the webhook's engine finds in `pod`, under `policies` with its namespace's `labels`,
/// as a pod created now would be judged: its report results. A pod that has finished holds
/// no GPU and adds none; neither does one the webhook already rewrote. ResourceClaims are read
/// as `mutate` reads a manifest's: gpuwarden's own templates are taken to exist, and anything
/// else counts by nothing.
pub fn judge(
    pod: &Pod,
    labels: Option<&BTreeMap<String, String>>,
    policies: &[Arc<GpuPolicy>],
) -> Vec<ReportResult> {
    let (Some(namespace), Ok(value)) =
        (pod.metadata.namespace.as_deref(), serde_json::to_value(pod))
    else {
        return Vec::new();
    };
    if finished(pod) {
        return Vec::new();
    }
    let labels = engine::namespace_labels_or_default(namespace, labels.cloned());
    let claims = ClaimStore::offline();
    let view = PodView::from_value(&value);
    let name = pod.name_any();
    let display = format!("{namespace}/{name}");
    let input = Input {
        pod: &view,
        namespace,
        namespace_labels: &labels,
        operation: Operation::Create,
        display_name: &display,
        claims: &claims,
        owner_kind: None,
        requester: engine::Requester::Unknown,
    };
    let decision = engine::decide(&input, policies);
    let subject = Subject {
        api_version: "v1".to_owned(),
        kind: "Pod".to_owned(),
        namespace: namespace.to_owned(),
        name,
        uid: pod.metadata.uid.clone(),
    };
    let found = (pod.metadata.creation_timestamp.as_ref())
        .map(|t| Timestamp::of(t.0))
        .unwrap_or_default();
    report::results(&decision, &subject, found)
}

/// The report of `namespace`: the results of every pod of it in `pods` ([`judge`]), cut to
/// `cap` results.
pub fn namespace_report<'p>(
    namespace: &str,
    labels: Option<&BTreeMap<String, String>>,
    pods: impl IntoIterator<Item = &'p Pod>,
    policies: &[Arc<GpuPolicy>],
    cap: usize,
) -> NamespaceReport {
    let results = (pods.into_iter())
        .filter(|pod| pod.metadata.namespace.as_deref() == Some(namespace))
        .flat_map(|pod| judge(pod, labels, policies))
        .collect();
    NamespaceReport::new(namespace, results, cap)
}

/// A hash of what a report says; equal hashes need no write.
fn report_hash(report: &NamespaceReport) -> u64 {
    let mut h = DefaultHasher::new();
    report.results.hash(&mut h);
    (report.summary.fail, report.summary.warn, report.omitted).hash(&mut h);
    h.finish()
}

/// The report API of `kind`.
fn report_api(client: &Client, kind: ReportKind, namespace: Option<&str>) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(kind.group(), kind.version(), kind.kind());
    let resource = ApiResource::from_gvk_with_plural(&gvk, kind.plural());
    match namespace {
        Some(namespace) => {
            Api::<DynamicObject>::namespaced_with(client.clone(), namespace, &resource)
        }
        None => Api::<DynamicObject>::all_with(client.clone(), &resource),
    }
}

/// Which report kinds the API server serves, in [`ReportKind::ALL`]'s order. A group that is
/// not served (404) counts as no; so does one whose discovery fails, with the reason logged,
/// until the next check.
pub async fn discover_kinds(client: &Client) -> Vec<ReportKind> {
    let mut served = Vec::new();
    for kind in ReportKind::ALL {
        match client.list_api_group_resources(&kind.api_version()).await {
            Ok(list) if list.resources.iter().any(|r| r.name == kind.plural()) => {
                served.push(kind);
            }
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => {
                tracing::warn!(
                    api = %kind.api_version(),
                    error = %error_chain(&e),
                    "discovery of a report kind failed; taken as not served until the next check"
                );
            }
        }
    }
    served
}

/// A report reconcile that failed.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Applying a report failed.
    #[error("failed to apply {kind} {namespace}/{}", REPORT_NAME)]
    Apply {
        /// The report kind.
        kind: &'static str,
        /// Its namespace.
        namespace: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Deleting a report failed.
    #[error("failed to delete {kind} {namespace}/{}", REPORT_NAME)]
    Delete {
        /// The report kind.
        kind: &'static str,
        /// Its namespace.
        namespace: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// Listing gpuwarden's reports failed.
    #[error("failed to list {kind} objects labelled {}", LABEL_MANAGED_BY)]
    List {
        /// The report kind.
        kind: &'static str,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

impl ReportError {
    /// A bounded label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Apply { source, .. }
            | Self::Delete { source, .. }
            | Self::List { source, .. } => crate::api_error_kind(source),
        }
    }

    /// Whether retrying cannot help: the API server refuses the object itself.
    pub fn is_permanent(&self) -> bool {
        self.kind() == "invalid"
    }
}

/// What the report keeper reads and remembers.
pub struct ReportContext {
    /// API client.
    pub client: Client,
    /// What was judged of each pod that has findings.
    pub findings: Findings,
    /// Namespace labels.
    pub namespaces: Store<PartialObjectMeta<Namespace>>,
    /// GpuPolicies.
    pub policies: Store<GpuPolicy>,
    /// Only the leader writes.
    pub leader: Leadership,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The report kinds the API server serves, from the last discovery.
    pub kinds: RwLock<Vec<ReportKind>>,
    /// Whether every Pod has been judged once (a complete list).
    pub pods_judged: watch::Sender<bool>,
    /// Per namespace with a report of gpuwarden's: the hash of what was last written there
    /// (`None` when it was found by [`sweep`], its content unknown).
    pub written: Mutex<HashMap<String, Option<u64>>>,
    /// Most results per report.
    pub cap: usize,
}

impl ReportContext {
    /// A context with nothing written, no kind served and the default cap.
    pub fn new(
        client: Client,
        namespaces: Store<PartialObjectMeta<Namespace>>,
        policies: Store<GpuPolicy>,
        leader: Leadership,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            client,
            findings: Findings::default(),
            namespaces,
            policies,
            leader,
            metrics,
            kinds: RwLock::new(Vec::new()),
            pods_judged: watch::Sender::new(false),
            written: Mutex::new(HashMap::new()),
            cap: MAX_RESULTS,
        }
    }

    /// Whether every Pod has been judged once.
    pub fn pods_judged(&self) -> bool {
        *self.pods_judged.borrow()
    }

    /// The kinds served now.
    pub fn kinds(&self) -> Vec<ReportKind> {
        self.kinds.read().map(|k| k.clone()).unwrap_or_default()
    }

    /// Forgets what each report was last written with, so the next reconcile writes each
    /// again (a new kind, another leader's writes).
    pub fn forget_contents(&self) {
        self.written().values_mut().for_each(|v| *v = None);
    }

    fn written(&self) -> std::sync::MutexGuard<'_, HashMap<String, Option<u64>>> {
        self.written.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Keeps the report of one namespace: computes it from the caches, applies it where it
/// changed, deletes it where there is nothing to report. Does nothing on a replica that is
/// not the leader, where no report kind is served, or before the Pod cache is complete (an
/// empty cache would delete every report).
#[instrument(skip(ctx), fields(namespace = %namespace))]
pub async fn reconcile_namespace(
    namespace: &str,
    ctx: &ReportContext,
) -> Result<Action, ReportError> {
    let kinds = ctx.kinds();
    if !ctx.leader.is_leader() || kinds.is_empty() || !ctx.pods_judged() {
        return Ok(Action::await_change());
    }
    let report = NamespaceReport::new(namespace, ctx.findings.of(namespace), ctx.cap);
    let last = ctx.written().get(namespace).copied();
    if report.is_empty() {
        if last.is_some() {
            for kind in &kinds {
                delete_report(ctx, *kind, namespace).await?;
            }
            ctx.written().remove(namespace);
            info!(namespace, "nothing to report: report deleted");
        }
        return Ok(Action::await_change());
    }
    let hash = report_hash(&report);
    if last == Some(Some(hash)) {
        debug!(namespace, "report unchanged");
        return Ok(Action::await_change());
    }
    for kind in &kinds {
        apply_report(ctx, *kind, &report).await?;
    }
    ctx.written().insert(namespace.to_owned(), Some(hash));
    info!(
        namespace,
        fail = report.summary.fail,
        warn = report.summary.warn,
        omitted = report.omitted,
        "report written"
    );
    Ok(Action::await_change())
}

async fn apply_report(
    ctx: &ReportContext,
    kind: ReportKind,
    report: &NamespaceReport,
) -> Result<(), ReportError> {
    let api = report_api(&ctx.client, kind, Some(&report.namespace));
    let params = PatchParams::apply(FIELD_MANAGER_REPORTS).force();
    api.patch(REPORT_NAME, &params, &Patch::Apply(report.to_object(kind)))
        .await
        .map_err(|source| ReportError::Apply {
            kind: kind.kind(),
            namespace: report.namespace.clone(),
            source,
        })?;
    ctx.metrics.write(CONTROLLER, "apply");
    Ok(())
}

async fn delete_report(
    ctx: &ReportContext,
    kind: ReportKind,
    namespace: &str,
) -> Result<(), ReportError> {
    if remove(&ctx.client, kind, namespace).await? {
        ctx.metrics.write(CONTROLLER, "delete");
    }
    Ok(())
}

/// Deletes gpuwarden's report of `kind` in `namespace`; whether there was one.
async fn remove(client: &Client, kind: ReportKind, namespace: &str) -> Result<bool, ReportError> {
    let api = report_api(client, kind, Some(namespace));
    match api.delete(REPORT_NAME, &DeleteParams::default()).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(false),
        Err(source) => Err(ReportError::Delete {
            kind: kind.kind(),
            namespace: namespace.to_owned(),
            source,
        }),
    }
}

/// The namespaces holding gpuwarden's report of `kind` (named [`REPORT_NAME`], labelled
/// [`LABEL_MANAGED_BY`]).
async fn kept_in(client: &Client, kind: ReportKind) -> Result<Vec<String>, ReportError> {
    let selector = format!("{LABEL_MANAGED_BY}={}", install::OPERATOR_NAME);
    let list = report_api(client, kind, None)
        .list_metadata(&ListParams::default().labels(&selector))
        .await
        .map_err(|source| ReportError::List {
            kind: kind.kind(),
            source,
        })?;
    Ok((list.items.into_iter())
        .filter(|r| r.metadata.name.as_deref() == Some(REPORT_NAME))
        .filter_map(|r| r.metadata.namespace)
        .collect())
}

/// Finds the reports gpuwarden keeps (by [`LABEL_MANAGED_BY`]) in every kind served, so that
/// the next reconcile of their namespaces deletes those with nothing to report; forgets
/// namespaces that are gone. Run on becoming the leader and on every periodic check.
pub async fn sweep(ctx: &ReportContext) -> Result<usize, ReportError> {
    let mut found = Vec::new();
    for kind in ctx.kinds() {
        found.extend(kept_in(&ctx.client, kind).await?);
    }
    let mut written = ctx.written();
    for namespace in found {
        written.entry(namespace).or_insert(None);
    }
    let namespaces = &ctx.namespaces;
    written.retain(|ns, _| namespaces.get(&ObjectRef::new(ns)).is_some());
    Ok(written.len())
}

/// Deletes every report gpuwarden keeps, in every kind served (an uninstall: once no
/// GpuPolicy governs a namespace, nothing writes them again). Returns how many went.
pub async fn delete_all(client: &Client) -> Result<usize, ReportError> {
    let mut deleted = 0;
    for kind in discover_kinds(client).await {
        for namespace in kept_in(client, kind).await? {
            deleted += usize::from(remove(client, kind, &namespace).await?);
        }
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn privileged(namespace: &str, name: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{name}")},
            "spec": {"containers": [{"name": "trainer", "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                "securityContext": {"privileged": true},
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,1"}]}]},
            "status": {"phase": "Running"}})
    }

    fn pod(value: Value) -> Pod {
        serde_json::from_value(value).unwrap()
    }

    fn default_policy() -> Vec<Arc<GpuPolicy>> {
        vec![Arc::new(GpuPolicy::default_policy())]
    }

    /// The pod as the webhook admits it: the engine's patch applied.
    fn admitted(mut value: Value, policies: &[Arc<GpuPolicy>]) -> Value {
        let namespace = value["metadata"]["namespace"].as_str().unwrap().to_owned();
        let labels = engine::namespace_labels_or_default(&namespace, None);
        let patch = {
            let view = PodView::from_value(&value);
            let input = Input {
                pod: &view,
                namespace: &namespace,
                namespace_labels: &labels,
                operation: Operation::Create,
                display_name: "x",
                claims: &ClaimStore::offline(),
                owner_kind: None,
                requester: engine::Requester::Unknown,
            };
            let decision = engine::decide(&input, policies);
            gpuwarden_webhook::patch::patch_for_view(&view, decision.changes())
        };
        json_patch::patch(&mut value, &patch.0).unwrap();
        value
    }

    #[test]
    fn a_pod_the_webhook_admitted_adds_nothing_one_that_bypassed_it_does() {
        let policies = default_policy();
        let before = privileged("ml", "bypassed");
        let mut after = admitted(privileged("ml", "admitted"), &policies);
        after["metadata"]["name"] = json!("admitted");
        let mut done = privileged("ml", "done");
        done["status"]["phase"] = json!("Succeeded");
        let pods = [
            pod(before),
            pod(after),
            pod(done),
            pod(privileged("other", "elsewhere")),
        ];
        let report = namespace_report("ml", None, &pods, &policies, MAX_RESULTS);
        let names: std::collections::BTreeSet<&str> = (report.results.iter())
            .map(|r| r.resources[0].name.as_str())
            .collect();
        assert_eq!(names, ["bypassed"].into(), "{report:#?}");
        let rules: Vec<&str> = report.results.iter().map(|r| r.rule.as_str()).collect();
        assert!(rules.contains(&"privileged-gpu"), "{rules:?}");
        assert!(
            report
                .results
                .iter()
                .all(|r| r.properties["verdict"] == "rewritten")
        );
    }

    #[test]
    fn a_namespace_no_policy_governs_has_nothing_to_report() {
        let pods = [pod(privileged("kube-system", "driver"))];
        let report = namespace_report("kube-system", None, &pods, &default_policy(), MAX_RESULTS);
        assert!(report.is_empty(), "exempt namespace: {report:#?}");
        let report = namespace_report("ml", None, &[pod(privileged("ml", "x"))], &[], MAX_RESULTS);
        assert!(report.is_empty(), "no policy");
    }

    #[test]
    fn a_crowded_namespace_is_cut_to_the_cap_and_says_how_many_were_left_out() {
        let pods: Vec<Pod> = (0..40)
            .map(|i| pod(privileged("ml", &format!("p{i:02}"))))
            .collect();
        let full = namespace_report("ml", None, &pods, &default_policy(), usize::MAX);
        let per_pod = full.results.len() / 40;
        assert!(per_pod >= 1);
        let cut = namespace_report("ml", None, &pods, &default_policy(), 25);
        assert_eq!(cut.results.len(), 25);
        assert_eq!(cut.omitted, full.results.len() - 25);
        assert_eq!(cut.summary, full.summary, "the summary counts every result");
        assert_eq!(
            cut.results[..],
            full.results[..25],
            "the first in order are kept"
        );
    }

    #[test]
    fn a_finished_pod_or_one_without_a_namespace_has_nothing_to_report() {
        let policies = default_policy();
        let running = pod(privileged("ml", "p"));
        assert!(!judge(&running, None, &policies).is_empty());
        let mut done = privileged("ml", "p");
        done["status"]["phase"] = json!("Succeeded");
        assert!(judge(&pod(done), None, &policies).is_empty());
        let mut nowhere = running.clone();
        nowhere.metadata.namespace = None;
        assert!(judge(&nowhere, None, &policies).is_empty());
        // What the watch sees change without a spec change finds the same.
        let mut status = privileged("ml", "p");
        status["status"]["podIP"] = json!("10.0.0.1");
        status["metadata"]["resourceVersion"] = json!("42");
        assert_eq!(
            judge(&pod(status), None, &policies),
            judge(&running, None, &policies)
        );
    }
}
