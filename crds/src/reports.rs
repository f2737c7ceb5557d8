//! The names gpuwarden's policy reports use (docs/design.md, "PolicyReports"): the two report
//! kinds it writes, where the API server serves them, one object per governed namespace, and
//! what marks them as gpuwarden's. The report body is written by the webhook crate's
//! `report` module; the operator keeps the objects.

/// `wgpolicyk8s.io`: the Policy WG's PolicyReport (Kyverno, Policy Reporter).
pub const POLICY_REPORT_GROUP: &str = "wgpolicyk8s.io";
/// The PolicyReport version gpuwarden writes.
pub const POLICY_REPORT_VERSION: &str = "v1alpha2";
/// Its kind.
pub const POLICY_REPORT_KIND: &str = "PolicyReport";
/// Its resource name.
pub const POLICY_REPORT_PLURAL: &str = "policyreports";

/// `openreports.io`: the OpenReports Report, PolicyReport's successor.
pub const OPEN_REPORT_GROUP: &str = "openreports.io";
/// The Report version gpuwarden writes.
pub const OPEN_REPORT_VERSION: &str = "v1alpha1";
/// Its kind.
pub const OPEN_REPORT_KIND: &str = "Report";
/// Its resource name.
pub const OPEN_REPORT_PLURAL: &str = "reports";

/// `wgpolicyk8s.io`'s cluster-scoped kind.
pub const CLUSTER_POLICY_REPORT_KIND: &str = "ClusterPolicyReport";
/// Its resource name.
pub const CLUSTER_POLICY_REPORT_PLURAL: &str = "clusterpolicyreports";
/// `openreports.io`'s cluster-scoped kind.
pub const CLUSTER_OPEN_REPORT_KIND: &str = "ClusterReport";
/// Its resource name.
pub const CLUSTER_OPEN_REPORT_PLURAL: &str = "clusterreports";
/// Name of gpuwarden's cluster-scoped report of the GPU nodes' posture.
pub const NODES_REPORT_NAME: &str = "gpuwarden-nodes";
/// Policy name of the nodes' posture results.
pub const NODE_POSTURE_POLICY: &str = "gpuwarden-node-posture";

/// Name of gpuwarden's report in each namespace it reports on.
pub const REPORT_NAME: &str = "gpuwarden";
/// `source` of every result, as Policy Reporter groups them.
pub const SOURCE: &str = "gpuwarden";
/// Label every report gpuwarden keeps carries, with value [`crate::install::OPERATOR_NAME`];
/// the operator lists reports by it to find those left over.
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// Field manager of the operator's server-side apply of reports.
pub const FIELD_MANAGER_REPORTS: &str = "gpuwarden-operator-reports";
/// Annotation on a report that holds fewer results than were found: how many were left out.
pub const ANNOTATION_RESULTS_OMITTED: &str = "gpuwarden.io/results-omitted";
/// Most results one report holds; the rest are counted in [`ANNOTATION_RESULTS_OMITTED`] and
/// in the summary. With messages clipped to [`MAX_MESSAGE_LEN`], a full report stays well
/// under the API server's 1.5 MiB object limit.
pub const MAX_RESULTS: usize = 500;
/// Longest result message, in bytes.
pub const MAX_MESSAGE_LEN: usize = 1024;
