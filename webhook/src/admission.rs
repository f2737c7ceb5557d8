//! AdmissionReview in, AdmissionReview out: the adapter between the HTTP server and the
//! engine. Pure: no I/O, never panics, always returns a review to send with status 200.
//!
//! CONTRACT (shared by the server and the engine; keep these signatures):
//! - `PolicySource` gives the current policies and namespace labels (reflector caches in the
//!   server, fixed values in tests and the CLI).
//! - `handle_review(body, source)` parses the body as `admission.k8s.io/v1` AdmissionReview
//!   and returns the response review as JSON bytes plus a `ReviewSummary` for metrics/logs.
//!   Bad input (not JSON, not a review, not a Pod, missing fields) still yields a review:
//!   with the request uid when one could be read, `allowed: false` and a status saying what
//!   was wrong.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpuwarden_crds::GpuPolicy;

/// Where the webhook reads policies and namespace labels from.
pub trait PolicySource: Send + Sync {
    /// Every `GpuPolicy` currently known (any order; the engine sorts).
    fn policies(&self) -> Vec<Arc<GpuPolicy>>;
    /// Labels of namespace `name`, or `None` when the namespace is unknown.
    fn namespace_labels(&self, name: &str) -> Option<BTreeMap<String, String>>;
}

/// What happened to one review, for metrics and logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReviewSummary {
    /// Request uid ("" when the body had none).
    pub uid: String,
    /// Outcome.
    pub outcome: Outcome,
    /// `name@generation` of the governing policy, if any.
    pub policy: Option<String>,
    /// `namespace/name` (or generateName) of the pod, if known.
    pub pod: Option<String>,
}

/// The outcome of one review.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// No policy governs the pod, or it needed nothing: allowed unchanged.
    Allowed,
    /// A policy selects the pod but it is exempt: allowed unchanged.
    Exempt,
    /// Enforce: allowed with a patch.
    Rewritten,
    /// Audit: allowed unchanged with warnings and an annotation.
    Audited,
    /// Deny, or Enforce on something that cannot be rewritten: rejected.
    Denied,
    /// The request itself was malformed: rejected with a reason.
    Invalid,
}

impl Outcome {
    /// Metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Exempt => "exempt",
            Self::Rewritten => "rewritten",
            Self::Audited => "audited",
            Self::Denied => "denied",
            Self::Invalid => "invalid",
        }
    }
}

/// Answers one AdmissionReview body. See the module docs.
pub fn handle_review(body: &[u8], source: &dyn PolicySource) -> (Vec<u8>, ReviewSummary) {
    let _ = (body, source);
    unimplemented!("engine owner fills this in")
}
