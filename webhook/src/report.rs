//! Policy reports (docs/design.md, "PolicyReports"): what gpuwarden changes, would change or
//! refuses in a pod, as the results of a `wgpolicyk8s.io/v1alpha2` PolicyReport or an
//! `openreports.io/v1alpha1` Report, the two kinds Kyverno, Policy Reporter and
//! `kubectl get polr` read. Both kinds share one result shape, so one body serves both.
//!
//! Pure: [`results`] turns an engine [`Decision`] into results, [`report`] puts a namespace's
//! results into one bounded object. The operator keeps these objects for the pods that run;
//! `gpuwarden-webhook mutate -o policyreport` prints them for manifests.

use std::collections::BTreeMap;

use gpuwarden_crds::reports::{
    ANNOTATION_RESULTS_OMITTED, CLUSTER_OPEN_REPORT_KIND, CLUSTER_OPEN_REPORT_PLURAL,
    CLUSTER_POLICY_REPORT_KIND, CLUSTER_POLICY_REPORT_PLURAL, LABEL_MANAGED_BY, MAX_MESSAGE_LEN,
    NODES_REPORT_NAME, OPEN_REPORT_GROUP, OPEN_REPORT_KIND, OPEN_REPORT_PLURAL,
    OPEN_REPORT_VERSION, POLICY_REPORT_GROUP, POLICY_REPORT_KIND, POLICY_REPORT_PLURAL,
    POLICY_REPORT_VERSION, REPORT_NAME, SOURCE,
};
use gpuwarden_crds::{PolicyMode, install};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::engine::{Decision, Rule, Verdict};

/// `category` of every result.
pub const CATEGORY: &str = "GPU isolation";

/// Which report kind an object is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ReportKind {
    /// `wgpolicyk8s.io/v1alpha2` PolicyReport.
    PolicyReport,
    /// `openreports.io/v1alpha1` Report.
    OpenReport,
}

impl ReportKind {
    /// Both kinds, in the order gpuwarden looks for them.
    pub const ALL: [Self; 2] = [Self::PolicyReport, Self::OpenReport];

    /// The API group.
    pub fn group(self) -> &'static str {
        match self {
            Self::PolicyReport => POLICY_REPORT_GROUP,
            Self::OpenReport => OPEN_REPORT_GROUP,
        }
    }

    /// The version gpuwarden writes.
    pub fn version(self) -> &'static str {
        match self {
            Self::PolicyReport => POLICY_REPORT_VERSION,
            Self::OpenReport => OPEN_REPORT_VERSION,
        }
    }

    /// `group/version`.
    pub fn api_version(self) -> String {
        format!("{}/{}", self.group(), self.version())
    }

    /// The kind.
    pub fn kind(self) -> &'static str {
        match self {
            Self::PolicyReport => POLICY_REPORT_KIND,
            Self::OpenReport => OPEN_REPORT_KIND,
        }
    }

    /// The resource name.
    pub fn plural(self) -> &'static str {
        match self {
            Self::PolicyReport => POLICY_REPORT_PLURAL,
            Self::OpenReport => OPEN_REPORT_PLURAL,
        }
    }

    /// The cluster-scoped kind of the same group (`ClusterPolicyReport`, `ClusterReport`),
    /// which its CRDs install beside the namespaced one.
    pub fn cluster_kind(self) -> &'static str {
        match self {
            Self::PolicyReport => CLUSTER_POLICY_REPORT_KIND,
            Self::OpenReport => CLUSTER_OPEN_REPORT_KIND,
        }
    }

    /// The cluster-scoped kind's resource name.
    pub fn cluster_plural(self) -> &'static str {
        match self {
            Self::PolicyReport => CLUSTER_POLICY_REPORT_PLURAL,
            Self::OpenReport => CLUSTER_OPEN_REPORT_PLURAL,
        }
    }
}

/// `result` of a report result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// The object passes the rule: only a node's posture reports these, so that every node
    /// has its line.
    Pass,
    /// The pod breaks the rule: it is (or would be) changed or refused.
    Fail,
    /// The pod is (or would be) changed to harden it, and breaks nothing (not scored); or a
    /// node's posture is not known.
    Warn,
}

/// `severity` of a report result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Privilege, or a refusal.
    High,
    /// A GPU or device leak.
    Medium,
    /// The void rule.
    Low,
}

/// `metav1.Timestamp`, as both report kinds write it.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Timestamp {
    /// Seconds since the Unix epoch.
    pub seconds: i64,
    /// Nanoseconds within the second.
    pub nanos: i32,
}

impl Timestamp {
    /// The timestamp of an RFC 3339 time (`metadata.creationTimestamp`); `None` if it is not one.
    pub fn parse(rfc3339: &str) -> Option<Self> {
        let t: jiff::Timestamp = rfc3339.parse().ok()?;
        Some(Self::of(t))
    }

    /// The timestamp of `t`.
    pub fn of(t: jiff::Timestamp) -> Self {
        Self {
            seconds: t.as_second(),
            nanos: t.subsec_nanosecond(),
        }
    }
}

/// The object a result is about (`resources[]`, an `ObjectReference`).
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Subject {
    /// `v1` for a Pod, the workload's for a template.
    pub api_version: String,
    /// `Pod`, or the workload's kind.
    pub kind: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its uid, when it exists in a cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

/// One result of a report.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReportResult {
    /// Always [`SOURCE`].
    pub source: String,
    /// The governing GpuPolicy's name.
    pub policy: String,
    /// The rule ([`Rule::name`]).
    pub rule: String,
    /// Always [`CATEGORY`].
    pub category: String,
    /// How much it matters.
    pub severity: Severity,
    /// When it was found: when the pod was created (stable, so an unchanged finding never
    /// rewrites its report), or when the manifest was read.
    pub timestamp: Timestamp,
    /// Fail or warn.
    pub result: Outcome,
    /// Whether it counts against the object (fail: yes; warn: no).
    pub scored: bool,
    /// The pod or workload.
    pub resources: Vec<Subject>,
    /// What gpuwarden does or would do, as its webhook says it.
    pub message: String,
    /// `container`, `mode` (the policy's), `verdict` (what the webhook does with the pod) and
    /// `policyReference` (`name@generation`).
    pub properties: BTreeMap<String, String>,
}

impl ReportResult {
    /// The container the result is about, if any.
    pub fn container(&self) -> Option<&str> {
        self.properties.get("container").map(String::as_str)
    }
}

/// What the webhook does with the pod, for a result's `verdict` property.
fn verdict_name(verdict: Verdict) -> &'static str {
    match verdict {
        Verdict::NotGoverned => "not-governed",
        Verdict::Exempt => "exempt",
        Verdict::Unchanged => "unchanged",
        Verdict::Voided => "voided",
        Verdict::Rewritten => "rewritten",
        Verdict::Audited => "audited",
        Verdict::Denied => "denied",
    }
}

/// How a rule's findings are graded.
fn grade(rule: Rule) -> (Outcome, Severity) {
    match rule {
        Rule::PrivilegedGpu | Rule::Denied | Rule::InvalidPolicy | Rule::Ephemeral => {
            (Outcome::Fail, Severity::High)
        }
        Rule::Leak => (Outcome::Fail, Severity::Medium),
        Rule::Void => (Outcome::Warn, Severity::Low),
    }
}

/// `text` cut to [`MAX_MESSAGE_LEN`] bytes on a character boundary, with `...`.
pub fn clip(mut text: String) -> String {
    if text.len() > MAX_MESSAGE_LEN {
        let mut end = MAX_MESSAGE_LEN - 3;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("...");
    }
    text
}

/// The results of one pod's decision: one per [`crate::engine::Finding`], each naming
/// `subject`, the container, the rule and the webhook's message. None for a pod that no
/// policy governs, that is exempt, or that needs nothing.
pub fn results(decision: &Decision<'_>, subject: &Subject, found: Timestamp) -> Vec<ReportResult> {
    let Some(policy) = decision.policy() else {
        return Vec::new();
    };
    let policy_name = policy.metadata.name.clone().unwrap_or_default();
    let mode = match policy.spec.mode {
        PolicyMode::Enforce => "Enforce",
        PolicyMode::Audit => "Audit",
        PolicyMode::Deny => "Deny",
    };
    let reference = decision.policy_reference().unwrap_or_default().to_owned();
    let verdict = verdict_name(decision.verdict());
    (decision.findings().into_iter())
        .map(|finding| {
            let (result, severity) = grade(finding.rule);
            let mut properties = BTreeMap::from([
                ("mode".to_owned(), mode.to_owned()),
                ("verdict".to_owned(), verdict.to_owned()),
                ("policyReference".to_owned(), reference.clone()),
            ]);
            if let Some(container) = finding.container {
                properties.insert("container".to_owned(), container);
            }
            ReportResult {
                source: SOURCE.to_owned(),
                policy: policy_name.clone(),
                rule: finding.rule.name().to_owned(),
                category: CATEGORY.to_owned(),
                severity,
                timestamp: found,
                result,
                scored: result == Outcome::Fail,
                resources: vec![subject.clone()],
                message: clip(finding.message),
                properties,
            }
        })
        .collect()
}

/// Counts of a report's results by outcome (`summary`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// Results that pass (only in the nodes' report: a namespace's reports only what is
    /// changed or refused).
    pub pass: usize,
    /// Results that fail.
    pub fail: usize,
    /// Results that warn.
    pub warn: usize,
    /// Always 0.
    pub error: usize,
    /// Always 0.
    pub skip: usize,
}

impl Summary {
    /// Counts one result.
    pub fn count(&mut self, outcome: Outcome) {
        match outcome {
            Outcome::Pass => self.pass += 1,
            Outcome::Fail => self.fail += 1,
            Outcome::Warn => self.warn += 1,
        }
    }
}

/// The cluster-scoped report of the GPU nodes' posture (docs/design.md, "Node posture"):
/// one result per node and condition, as an object of `kind`'s cluster kind named
/// [`NODES_REPORT_NAME`].
pub fn nodes_report_object(kind: ReportKind, results: &[ReportResult]) -> Value {
    let mut summary = Summary::default();
    for r in results {
        summary.count(r.result);
    }
    let mut object = json!({
        "apiVersion": kind.api_version(),
        "kind": kind.cluster_kind(),
        "metadata": {
            "name": NODES_REPORT_NAME,
            "labels": { LABEL_MANAGED_BY: install::OPERATOR_NAME },
        },
        "summary": summary,
        "results": results,
    });
    if kind == ReportKind::OpenReport {
        object["source"] = json!(SOURCE);
    }
    object
}

/// One namespace's report, before it is written as an object of either kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceReport {
    /// The namespace.
    pub namespace: String,
    /// The results it holds, sorted by pod, container and rule; at most the cap.
    pub results: Vec<ReportResult>,
    /// Counts of every result found, those left out included.
    pub summary: Summary,
    /// How many results were left out by the cap.
    pub omitted: usize,
}

impl NamespaceReport {
    /// A namespace's report of `results`, sorted (by pod, container, rule, message) and cut
    /// to `cap`; the summary counts them all, and `omitted` says how many were left out.
    pub fn new(namespace: &str, mut results: Vec<ReportResult>, cap: usize) -> Self {
        let mut summary = Summary::default();
        for r in &results {
            summary.count(r.result);
        }
        results.sort_by(|a, b| {
            let key = |r: &ReportResult| {
                (
                    r.resources
                        .first()
                        .map(|s| (s.kind.clone(), s.name.clone())),
                    r.container().map(str::to_owned),
                    r.rule.clone(),
                    r.message.clone(),
                )
            };
            key(a).cmp(&key(b))
        });
        let omitted = results.len().saturating_sub(cap);
        results.truncate(cap);
        Self {
            namespace: namespace.to_owned(),
            results,
            summary,
            omitted,
        }
    }

    /// Whether there is nothing to report.
    pub fn is_empty(&self) -> bool {
        self.results.is_empty() && self.omitted == 0
    }

    /// The report as an object of `kind`, named [`REPORT_NAME`] and labelled as gpuwarden's.
    pub fn to_object(&self, kind: ReportKind) -> Value {
        let mut metadata = json!({
            "name": REPORT_NAME,
            "namespace": self.namespace,
            "labels": { LABEL_MANAGED_BY: install::OPERATOR_NAME },
        });
        if self.omitted > 0 {
            metadata["annotations"] = json!({
                ANNOTATION_RESULTS_OMITTED: format!(
                    "{} of {} results are left out (at most {} are kept); the summary counts them all",
                    self.omitted,
                    self.omitted + self.results.len(),
                    self.results.len()
                ),
            });
        }
        let mut object = json!({
            "apiVersion": kind.api_version(),
            "kind": kind.kind(),
            "metadata": metadata,
            "summary": self.summary,
            "results": self.results,
        });
        if kind == ReportKind::OpenReport {
            object["source"] = json!(SOURCE);
        }
        object
    }
}

/// Groups results by namespace into one report each (namespaces in name order), each cut to
/// `cap` results.
pub fn reports_by_namespace(
    results: impl IntoIterator<Item = ReportResult>,
    cap: usize,
) -> Vec<NamespaceReport> {
    let mut by_namespace: BTreeMap<String, Vec<ReportResult>> = BTreeMap::new();
    for r in results {
        let namespace = (r.resources.first())
            .map(|s| s.namespace.clone())
            .unwrap_or_default();
        by_namespace.entry(namespace).or_default().push(r);
    }
    (by_namespace.into_iter())
        .map(|(namespace, results)| NamespaceReport::new(&namespace, results, cap))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A result as large as gpuwarden writes one: the longest names Kubernetes allows and a
    /// message at the clip.
    fn largest(i: usize) -> ReportResult {
        let name = format!("{i:05}{}", "p".repeat(248));
        ReportResult {
            source: SOURCE.to_owned(),
            policy: "q".repeat(253),
            rule: Rule::PrivilegedGpu.name().to_owned(),
            category: CATEGORY.to_owned(),
            severity: Severity::High,
            timestamp: Timestamp::default(),
            result: Outcome::Fail,
            scored: true,
            resources: vec![Subject {
                api_version: "v1".to_owned(),
                kind: "Pod".to_owned(),
                namespace: "n".repeat(63),
                name,
                uid: Some("0".repeat(36)),
            }],
            message: clip("m".repeat(10 * MAX_MESSAGE_LEN)),
            properties: BTreeMap::from([
                ("container".to_owned(), "c".repeat(63)),
                ("mode".to_owned(), "Enforce".to_owned()),
                ("verdict".to_owned(), "rewritten".to_owned()),
                (
                    "policyReference".to_owned(),
                    format!("{}@1000000", "q".repeat(253)),
                ),
            ]),
        }
    }

    #[test]
    fn a_full_report_of_the_largest_results_stays_under_the_object_limit() {
        let results: Vec<ReportResult> = (0..3 * gpuwarden_crds::reports::MAX_RESULTS)
            .map(largest)
            .collect();
        assert_eq!(results[0].message.len(), MAX_MESSAGE_LEN);
        let report = NamespaceReport::new("n", results, gpuwarden_crds::reports::MAX_RESULTS);
        assert_eq!(report.results.len(), gpuwarden_crds::reports::MAX_RESULTS);
        assert_eq!(report.omitted, 2 * gpuwarden_crds::reports::MAX_RESULTS);
        assert_eq!(
            report.summary.fail,
            3 * gpuwarden_crds::reports::MAX_RESULTS
        );
        for kind in ReportKind::ALL {
            let object = report.to_object(kind);
            let bytes = serde_json::to_vec(&object).unwrap().len();
            assert!(bytes < 1_400_000, "{kind:?}: {bytes} bytes");
            let note = object["metadata"]["annotations"][ANNOTATION_RESULTS_OMITTED]
                .as_str()
                .unwrap();
            assert!(
                note.starts_with("1000 of 1500 results are left out"),
                "{note}"
            );
        }
    }

    #[test]
    fn results_are_sorted_by_pod_and_container_and_a_small_report_has_no_omission_note() {
        let mut a = largest(2);
        a.resources[0].name = "b".into();
        let mut b = largest(1);
        b.resources[0].name = "a".into();
        b.result = Outcome::Warn;
        let report = NamespaceReport::new("n", vec![a, b], 10);
        let names: Vec<&str> = (report.results.iter())
            .map(|r| r.resources[0].name.as_str())
            .collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!((report.summary.fail, report.summary.warn), (1, 1));
        let object = report.to_object(ReportKind::PolicyReport);
        assert!(object["metadata"].get("annotations").is_none());
        assert!(
            object.get("source").is_none(),
            "PolicyReport has no top-level source"
        );
        assert_eq!(object["summary"]["fail"], 1);
    }

    /// The results of a pod in namespace `ml` under the built-in default policy (Enforce).
    fn judged(pod: Value) -> Vec<ReportResult> {
        use crate::engine::{self, ClaimStore, Input, Operation};
        let policies = vec![std::sync::Arc::new(
            gpuwarden_crds::GpuPolicy::default_policy(),
        )];
        let labels = engine::namespace_labels_or_default("ml", None);
        let view = crate::pod::PodView::from_value(&pod);
        let claims = ClaimStore::offline();
        let input = Input {
            pod: &view,
            namespace: "ml",
            namespace_labels: &labels,
            operation: Operation::Create,
            display_name: "ml/p",
            claims: &claims,
            owner_kind: None,
            requester: engine::Requester::Unknown,
        };
        let subject = Subject {
            api_version: "v1".into(),
            kind: "Pod".into(),
            namespace: "ml".into(),
            name: "p".into(),
            uid: None,
        };
        results(
            &engine::decide(&input, &policies),
            &subject,
            Timestamp::default(),
        )
    }

    #[test]
    fn each_rule_is_named_and_graded() {
        // An unprivileged container that names every GPU itself: a leak, closed.
        let leak = judged(json!({"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "c", "image": "cuda", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}}));
        let rules: Vec<(&str, Outcome, Severity)> = (leak.iter())
            .map(|r| (r.rule.as_str(), r.result, r.severity))
            .collect();
        assert_eq!(
            rules,
            [("gpu-leak", Outcome::Fail, Severity::Medium)],
            "{leak:#?}"
        );
        assert_eq!(leak[0].container(), Some("c"));
        assert!(
            leak[0].message.starts_with("container c: "),
            "{}",
            leak[0].message
        );

        // A privileged GPU container beside a container without a GPU: privilege and void.
        let both = judged(json!({"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "gpu", "image": "cuda", "securityContext": {"privileged": true},
                "resources": {"limits": {"nvidia.com/gpu": "1"}}},
            {"name": "log", "image": "fluent-bit"}]}}));
        let rules: Vec<(&str, Option<&str>, Outcome)> = (both.iter())
            .map(|r| (r.rule.as_str(), r.container(), r.result))
            .collect();
        assert_eq!(
            rules,
            [
                ("privileged-gpu", Some("gpu"), Outcome::Fail),
                ("void", Some("log"), Outcome::Warn)
            ]
        );
        assert!(both.iter().all(|r| r.scored == (r.result == Outcome::Fail)));

        // Nothing to say of an ordinary pod voided already, or of a pod no policy governs.
        let quiet = judged(json!({"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "web", "image": "nginx", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]}]}}));
        assert!(quiet.is_empty(), "{quiet:#?}");
    }

    #[test]
    fn clip_cuts_on_a_character_boundary() {
        let text = "é".repeat(MAX_MESSAGE_LEN);
        let clipped = clip(text);
        assert!(clipped.len() <= MAX_MESSAGE_LEN);
        assert!(clipped.ends_with("..."));
        assert_eq!(clip("short".into()), "short");
    }

    #[test]
    fn timestamps_read_rfc3339() {
        let t = Timestamp::parse("2026-01-02T03:04:05Z").unwrap();
        assert_eq!((t.seconds, t.nanos), (1_767_323_045, 0));
        assert!(Timestamp::parse("yesterday").is_none());
    }
}
