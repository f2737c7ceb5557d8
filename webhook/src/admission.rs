//! AdmissionReview in, AdmissionReview out: the adapter between the HTTP server and the
//! engine. Pure: no I/O, never panics, always returns a review to send with status 200.
//!
//! CONTRACT (shared by the server and the engine; keep these signatures):
//! - `PolicySource` gives the current policies and namespace labels (reflector caches in the
//!   server, fixed values in tests and the CLI). A review reads them through
//!   `PolicySource::lend`, which sources override to lend what they hold without copying.
//! - `handle_review(body, source)` parses the body as `admission.k8s.io/v1` AdmissionReview
//!   and returns the response review as JSON bytes plus a `ReviewSummary` for metrics/logs.
//!   Bad input (not JSON, not a review, not a Pod, missing fields) still yields a review:
//!   with the request uid when one could be read, `allowed: false` and a status saying what
//!   was wrong.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use gpuwarden_crds::GpuPolicy;
use serde_json::Value;

use crate::engine::{self, Decision, Input, NamespaceLabels, Operation, Verdict};
use crate::pod::{PodView, Str};
use crate::{json_out, patch, scan};

/// Where the webhook reads policies and namespace labels from.
pub trait PolicySource: Send + Sync {
    /// Every `GpuPolicy` currently known (any order; the engine sorts).
    fn policies(&self) -> Vec<Arc<GpuPolicy>>;
    /// Labels of namespace `name`, or `None` when the namespace is unknown.
    fn namespace_labels(&self, name: &str) -> Option<BTreeMap<String, String>>;
    /// Calls `read` with what [`PolicySource::policies`] and
    /// [`PolicySource::namespace_labels`] return for `namespace`, lent where the source
    /// holds them instead of copied: every review reads them.
    fn lend(&self, namespace: &str, read: &mut PolicyReader<'_>) {
        let labels = self.namespace_labels(namespace);
        read(&self.policies(), labels.as_ref());
    }
}

/// What [`PolicySource::lend`] calls with the policies and a namespace's labels.
pub type PolicyReader<'r> = dyn FnMut(&[Arc<GpuPolicy>], Option<&BTreeMap<String, String>>) + 'r;

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

/// A [`PolicySource`] with fixed contents: for tests, benchmarks and the offline command.
#[derive(Clone, Debug, Default)]
pub struct StaticSource {
    /// The policies.
    pub policies: Vec<Arc<GpuPolicy>>,
    /// Known namespaces and their labels.
    pub namespaces: BTreeMap<String, BTreeMap<String, String>>,
}

impl StaticSource {
    /// A source holding `policies` and no known namespaces.
    pub fn new(policies: impl IntoIterator<Item = GpuPolicy>) -> Self {
        Self {
            policies: policies.into_iter().map(Arc::new).collect(),
            namespaces: BTreeMap::new(),
        }
    }

    /// Adds a namespace with labels.
    pub fn with_namespace(mut self, name: &str, labels: &[(&str, &str)]) -> Self {
        self.namespaces.insert(
            name.to_owned(),
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        );
        self
    }
}

impl PolicySource for StaticSource {
    fn policies(&self) -> Vec<Arc<GpuPolicy>> {
        self.policies.clone()
    }
    fn namespace_labels(&self, name: &str) -> Option<BTreeMap<String, String>> {
        self.namespaces.get(name).cloned()
    }
    fn lend(&self, namespace: &str, read: &mut PolicyReader<'_>) {
        read(&self.policies, self.namespaces.get(namespace));
    }
}

/// Why a request could not be judged. Each becomes a rejected review with the message.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReviewError {
    /// The body is not JSON.
    #[error("request body is not JSON: {0}")]
    NotJson(String),
    /// JSON, but not an AdmissionReview.
    #[error("request body is not an admission.k8s.io/v1 AdmissionReview: {0}")]
    NotAReview(String),
    /// No `request`.
    #[error("AdmissionReview has no request")]
    MissingRequest,
    /// No `request.uid`.
    #[error("AdmissionReview request has no uid")]
    MissingUid,
    /// Not about a Pod.
    #[error("AdmissionReview is for {0}, not a Pod; this webhook only handles pods")]
    NotAPod(String),
    /// No usable `request.object`.
    #[error("AdmissionReview request for {operation} has no pod in request.object")]
    MissingObject {
        /// The operation.
        operation: String,
    },
    /// The policy source lent nothing to judge with.
    #[error("the webhook's policy source answered nothing; this is a bug")]
    NoPolicySource,
    /// No usable `request.oldObject` on an ephemeral-container update.
    #[error("AdmissionReview request for pods/ephemeralcontainers has no pod in request.oldObject")]
    MissingOldObject,
}

/// The incoming review: only what the engine needs, everything optional so that a
/// malformed review gets a precise answer instead of a parse error. Its strings borrow from
/// the body unless they hold escapes.
#[derive(Debug, Default, PartialEq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ReviewIn<'a, O> {
    #[serde(default, borrow, deserialize_with = "optional_str")]
    pub(crate) api_version: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "optional_str")]
    pub(crate) kind: Option<Cow<'a, str>>,
    #[serde(default = "none", borrow)]
    pub(crate) request: Option<RequestIn<'a, O>>,
}

fn none<T>() -> Option<T> {
    None
}

#[derive(Debug, Default, PartialEq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct RequestIn<'a, O> {
    #[serde(default, borrow, deserialize_with = "optional_str")]
    pub(crate) uid: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    pub(crate) kind: Option<GroupVersionKind<'a>>,
    #[serde(default, borrow)]
    pub(crate) resource: Option<GroupVersionResource<'a>>,
    #[serde(default, borrow, deserialize_with = "optional_str")]
    pub(crate) sub_resource: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "optional_str")]
    pub(crate) name: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "optional_str")]
    pub(crate) namespace: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "optional_str")]
    pub(crate) operation: Option<Cow<'a, str>>,
    #[serde(default = "none")]
    pub(crate) object: Option<O>,
    #[serde(default = "none")]
    pub(crate) old_object: Option<O>,
}

/// A string, borrowed when it has no escapes; `null` is `None`, any other type an error (as
/// for an `Option<String>`).
fn optional_str<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Cow<'de, str>>, D::Error> {
    <Option<Str<'de>> as serde::Deserialize>::deserialize(d).map(|s| s.map(|s| s.0))
}

/// A string, borrowed when it has no escapes; any other type is an error (as for a
/// `String`).
fn required_str<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Cow<'de, str>, D::Error> {
    <Str<'de> as serde::Deserialize>::deserialize(d).map(|s| s.0)
}

/// `request.object` or `request.oldObject`: the pod's view when it is a JSON object, read
/// straight from the body (see [`crate::pod`]).
#[derive(Debug, Default, PartialEq)]
pub(crate) struct PodObject<'a>(pub(crate) Option<PodView<'a>>);

impl<'de: 'a, 'a> serde::Deserialize<'de> for PodObject<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        crate::pod::pod_object(d).map(PodObject)
    }
}

impl<'a> ReviewIn<'a, Value> {
    /// The same review with views of its pods, borrowed from the values.
    fn views(&self) -> ReviewIn<'_, PodObject<'_>> {
        fn view(o: &Option<Value>) -> Option<PodObject<'_>> {
            o.as_ref()
                .map(|o| PodObject(o.is_object().then(|| PodView::from_value(o))))
        }
        ReviewIn {
            api_version: self.api_version.clone(),
            kind: self.kind.clone(),
            request: self.request.as_ref().map(|r| RequestIn {
                uid: r.uid.clone(),
                kind: r.kind.clone(),
                resource: r.resource.clone(),
                sub_resource: r.sub_resource.clone(),
                name: r.name.clone(),
                namespace: r.namespace.clone(),
                operation: r.operation.clone(),
                object: view(&r.object),
                old_object: view(&r.old_object),
            }),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
pub(crate) struct GroupVersionKind<'a> {
    #[serde(default, borrow, deserialize_with = "required_str")]
    pub(crate) group: Cow<'a, str>,
    #[serde(default, borrow, deserialize_with = "required_str")]
    pub(crate) kind: Cow<'a, str>,
}

#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
pub(crate) struct GroupVersionResource<'a> {
    #[serde(default, borrow, deserialize_with = "required_str")]
    pub(crate) group: Cow<'a, str>,
    #[serde(default, borrow, deserialize_with = "required_str")]
    pub(crate) resource: Cow<'a, str>,
}

const API_VERSION: &str = "admission.k8s.io/v1";

/// Answers one AdmissionReview body. See the module docs.
pub fn handle_review(body: &[u8], source: &dyn PolicySource) -> (Vec<u8>, ReviewSummary) {
    // Fast path: the pod read as a view borrowed from the body, by the one-pass reader when
    // it is sure of the body, else by serde. A body that is valid UTF-8 as a whole is read
    // as text, so that its strings are not checked again one by one; any other body is read
    // as bytes, with the same answers. A body the view cannot take (a field named twice in
    // one object) is parsed again as values, so that odd input gets the same answer.
    let mut review = ReviewIn::default();
    let fast = match std::str::from_utf8(body) {
        Ok(text) if scan::read_review(text, &mut review) => return answer(&review, source),
        Ok(text) => serde_json::from_str::<ReviewIn<'_, PodObject<'_>>>(text),
        Err(_) => serde_json::from_slice::<ReviewIn<'_, PodObject<'_>>>(body),
    };
    match fast {
        Ok(review) => answer(&review, source),
        Err(_) => match serde_json::from_slice::<ReviewIn<'_, Value>>(body) {
            Ok(review) => answer(&review.views(), source),
            Err(e) => {
                // Say whether it was JSON at all, and echo the uid if one can be found.
                let (error, uid) = match serde_json::from_slice::<Value>(body) {
                    Err(_) => (ReviewError::NotJson(e.to_string()), String::new()),
                    Ok(v) => (
                        ReviewError::NotAReview(e.to_string()),
                        v.pointer("/request/uid")
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_owned(),
                    ),
                };
                invalid(API_VERSION, uid, None, &error)
            }
        },
    }
}

/// Answers a parsed review.
fn answer(
    review: &ReviewIn<'_, PodObject<'_>>,
    source: &dyn PolicySource,
) -> (Vec<u8>, ReviewSummary) {
    let api_version = match review.api_version.as_deref() {
        Some(v @ "admission.k8s.io/v1beta1") => v,
        _ => API_VERSION,
    };
    if review.kind.as_deref() != Some("AdmissionReview") {
        let uid = review
            .request
            .as_ref()
            .and_then(|r| r.uid.as_deref())
            .unwrap_or_default()
            .to_owned();
        let what = match &review.kind {
            Some(kind) => format!("kind is {kind:?}"),
            None => "kind is missing".to_owned(),
        };
        return invalid(api_version, uid, None, &ReviewError::NotAReview(what));
    }
    let Some(request) = &review.request else {
        return invalid(
            api_version,
            String::new(),
            None,
            &ReviewError::MissingRequest,
        );
    };
    let uid = match request.uid.as_deref() {
        Some(uid) if !uid.is_empty() => uid.to_owned(),
        _ => return invalid(api_version, String::new(), None, &ReviewError::MissingUid),
    };
    let (operation, pod) = match target(request) {
        Ok(Some(target)) => target,
        // DELETE, CONNECT, plain UPDATE (privilege is immutable) and other subresources.
        Ok(None) => {
            let body = Response::new(api_version, &uid, true, 0).finish();
            let summary = ReviewSummary {
                uid,
                outcome: Outcome::Allowed,
                policy: None,
                pod: None,
            };
            return (body, summary);
        }
        Err(error) => {
            let empty = PodView::default();
            let pod = request.object.as_ref().map(|o| {
                let view = o.0.as_ref().unwrap_or(&empty);
                let namespace = namespace_of(view, request.namespace.as_deref());
                display_name(view, namespace, request.name.as_deref())
            });
            return invalid(api_version, uid, pod, &error);
        }
    };
    let namespace = namespace_of(pod, request.namespace.as_deref());
    let name = display_name(pod, namespace, request.name.as_deref());
    let mut answer = None;
    source.lend(namespace, &mut |policies, known| {
        let input = Input {
            pod,
            namespace,
            namespace_labels: &NamespaceLabels {
                name: namespace,
                known,
            },
            operation,
            display_name: &name,
        };
        let decision = engine::decide(&input, policies);
        for skipped in decision.skipped_policies() {
            tracing::warn!(pod = %name, "{skipped}");
        }
        answer = Some(respond(api_version, &uid, &name, decision, pod));
    });
    // A source that does not call back is a bug; its reviews are denied, not admitted.
    let Some((body, outcome, policy)) = answer else {
        let error = ReviewError::NoPolicySource;
        return invalid(api_version, uid, Some(name), &error);
    };
    let summary = ReviewSummary {
        uid,
        outcome,
        policy,
        pod: Some(name),
    };
    (body, summary)
}

/// What the engine is asked about a request that is about a Pod: the operation and the pod,
/// or `None` for an operation it lets through unjudged.
fn target<'r, 'a>(
    request: &'r RequestIn<'a, PodObject<'a>>,
) -> Result<Option<(Operation<'r>, &'r PodView<'a>)>, ReviewError> {
    let is_pod = match (&request.kind, &request.resource) {
        (Some(k), _) if !k.kind.is_empty() => k.group.is_empty() && k.kind == "Pod",
        (_, Some(r)) => r.group.is_empty() && r.resource == "pods",
        _ => false,
    };
    if !is_pod {
        let what = match (&request.kind, &request.resource) {
            (Some(k), _) if !k.kind.is_empty() => {
                if k.group.is_empty() {
                    k.kind.to_string()
                } else {
                    format!("{}.{}", k.kind, k.group)
                }
            }
            (_, Some(r)) if !r.resource.is_empty() => r.resource.to_string(),
            _ => "an unnamed kind".to_owned(),
        };
        return Err(ReviewError::NotAPod(what));
    }
    let operation = request.operation.as_deref().unwrap_or("");
    let sub = request.sub_resource.as_deref().unwrap_or("");
    let op = match (operation, sub) {
        ("CREATE", "") => Operation::Create,
        ("UPDATE", "ephemeralcontainers") => {
            let old = request
                .old_object
                .as_ref()
                .and_then(|o| o.0.as_ref())
                .ok_or(ReviewError::MissingOldObject)?;
            Operation::AddEphemeral { old }
        }
        _ => return Ok(None),
    };
    let pod = request
        .object
        .as_ref()
        .and_then(|o| o.0.as_ref())
        .ok_or_else(|| ReviewError::MissingObject {
            operation: operation.to_owned(),
        })?;
    Ok(Some((op, pod)))
}

/// The pod's namespace: the request's, else the pod's own, else `default`.
fn namespace_of<'p>(pod: &'p PodView<'_>, requested: Option<&'p str>) -> &'p str {
    requested
        .filter(|n| !n.is_empty())
        .or_else(|| pod.metadata.as_ref()?.namespace.as_deref())
        .unwrap_or("default")
}

/// `namespace/name`, or `namespace/generateName*` for a pod not yet named.
fn display_name(pod: &PodView<'_>, namespace: &str, name: Option<&str>) -> String {
    let metadata = pod.metadata.as_ref();
    let name = name
        .filter(|n| !n.is_empty())
        .or_else(|| metadata?.name.as_deref());
    let generate_name = metadata.and_then(|m| m.generate_name.as_deref());
    let mut out = String::with_capacity(namespace.len() + 32);
    out.push_str(namespace);
    out.push('/');
    match (name, generate_name) {
        (Some(name), _) => out.push_str(name),
        (None, Some(generate_name)) => {
            out.push_str(generate_name);
            out.push('*');
        }
        (None, None) => out.push_str("<unnamed>"),
    }
    out
}

/// The answer for a decision, its outcome and the governing policy's reference.
fn respond(
    api_version: &str,
    uid: &str,
    pod_name: &str,
    decision: Decision<'_>,
    pod: &PodView<'_>,
) -> (Vec<u8>, Outcome, Option<String>) {
    let outcome = match decision.verdict() {
        Verdict::NotGoverned | Verdict::Unchanged => Outcome::Allowed,
        Verdict::Exempt => Outcome::Exempt,
        Verdict::Rewritten => Outcome::Rewritten,
        Verdict::Audited => Outcome::Audited,
        Verdict::Denied => Outcome::Denied,
    };
    let allowed = outcome != Outcome::Denied;
    tracing::debug!(
        uid,
        pod = pod_name,
        outcome = outcome.as_str(),
        "admission review answered"
    );
    let body = PATCH_SCRATCH.with_borrow_mut(|patch| {
        patch.clear();
        let ops = if allowed {
            patch::write_patch(pod, decision.changes(), patch)
        } else {
            0
        };
        let patch_len = if ops > 0 { patch.len() } else { 0 };
        let mut response = Response::new(api_version, uid, allowed, patch_len);
        if let Some(message) = decision.denial() {
            response.status(403, "Forbidden", &message);
        }
        if ops > 0 {
            response.patch(patch);
        }
        decision.for_each_warning(|warning| response.warning(warning));
        decision.for_each_audit_annotation(|key, value| response.audit_annotation(key, value));
        if patch.capacity() > PATCH_SCRATCH_KEPT_BYTES {
            *patch = Vec::with_capacity(PATCH_SCRATCH_BYTES);
        }
        response.finish()
    });
    (body, outcome, decision.into_policy_reference())
}

fn invalid(
    api_version: &str,
    uid: String,
    pod: Option<String>,
    error: &ReviewError,
) -> (Vec<u8>, ReviewSummary) {
    tracing::debug!(uid = %uid, error = %error, "malformed admission review");
    let mut response = Response::new(api_version, &uid, false, 0);
    response.status(400, "BadRequest", &format!("gpuwarden: {error}"));
    let summary = ReviewSummary {
        uid,
        outcome: Outcome::Invalid,
        policy: None,
        pod,
    };
    (response.finish(), summary)
}

/// Room reserved for a serialised patch before base64; most patches fit.
const PATCH_SCRATCH_BYTES: usize = 2048;
/// A scratch buffer grown past this by an unusual pod is given back after its review, so
/// that each thread (the server's blocking threads too) keeps at most this much.
const PATCH_SCRATCH_KEPT_BYTES: usize = 16 * 1024;

thread_local! {
    /// The serialised patch before base64, reused by the next review on the same thread.
    /// A fresh buffer per review is a large allocation, and glibc answers one by first
    /// consolidating the small chunks the engine has just freed: a walk over memory that is
    /// no longer in cache once the server is busy.
    static PATCH_SCRATCH: std::cell::RefCell<Vec<u8>> =
        std::cell::RefCell::new(Vec::with_capacity(PATCH_SCRATCH_BYTES));
}

/// The response review, written field by field in the order of `AdmissionResponse`'s fields:
/// `uid`, `allowed`, `status`, `patch` (base64) and `patchType`, `warnings`,
/// `auditAnnotations`.
struct Response {
    out: Vec<u8>,
    /// Which list or object is open: warnings, then audit annotations.
    open: Open,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    Nothing,
    Warnings,
    AuditAnnotations,
}

impl Response {
    /// Room for the envelope, the patch in base64 and the usual warnings and annotations,
    /// so that the buffer is seldom regrown.
    fn new(api_version: &str, uid: &str, allowed: bool, patch_len: usize) -> Self {
        let capacity = 256 + uid.len() + patch_len.div_ceil(3) * 4 + 1024;
        let mut out = Vec::with_capacity(capacity);
        out.extend_from_slice(b"{\"apiVersion\":");
        json_out::string(&mut out, api_version);
        out.extend_from_slice(b",\"kind\":\"AdmissionReview\",\"response\":{\"uid\":");
        json_out::string(&mut out, uid);
        out.extend_from_slice(if allowed {
            b",\"allowed\":true"
        } else {
            b",\"allowed\":false"
        });
        Self {
            out,
            open: Open::Nothing,
        }
    }

    fn status(&mut self, code: u16, reason: &str, message: &str) {
        let out = &mut self.out;
        out.extend_from_slice(b",\"status\":{\"status\":\"Failure\",\"code\":");
        json_out::number(out, code);
        out.extend_from_slice(b",\"reason\":");
        json_out::string(out, reason);
        out.extend_from_slice(b",\"message\":");
        json_out::string(out, message);
        out.push(b'}');
    }

    /// `patch`: the serialised JSON patch, base64-encoded.
    fn patch(&mut self, patch: &[u8]) {
        self.out.extend_from_slice(b",\"patch\":\"");
        json_out::base64(&mut self.out, patch);
        self.out
            .extend_from_slice(b"\",\"patchType\":\"JSONPatch\"");
    }

    /// Moves on to `part`, closing the one before and opening this one on its first entry.
    fn enter(&mut self, part: Open) {
        if self.open == part {
            self.out.push(b',');
            return;
        }
        self.close();
        self.out.extend_from_slice(match part {
            Open::Warnings => b",\"warnings\":[",
            Open::AuditAnnotations => b",\"auditAnnotations\":{",
            Open::Nothing => b"",
        });
        self.open = part;
    }

    fn close(&mut self) {
        match self.open {
            Open::Warnings => self.out.push(b']'),
            Open::AuditAnnotations => self.out.push(b'}'),
            Open::Nothing => {}
        }
        self.open = Open::Nothing;
    }

    fn warning(&mut self, warning: &str) {
        self.enter(Open::Warnings);
        json_out::string(&mut self.out, warning);
    }

    fn audit_annotation(&mut self, key: &str, value: &str) {
        self.enter(Open::AuditAnnotations);
        json_out::string(&mut self.out, key);
        self.out.push(b':');
        json_out::string(&mut self.out, value);
    }

    fn finish(mut self) -> Vec<u8> {
        self.close();
        self.out.extend_from_slice(b"}}");
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The patch `handle_review` answers with, decoded; `None` when there is none.
    fn answered_patch(review: &Value, source: &StaticSource) -> Option<Value> {
        let (out, _) = handle_review(&serde_json::to_vec(review).unwrap(), source);
        let out: Value = serde_json::from_slice(&out).unwrap();
        let encoded = out["response"]["patch"].as_str()?;
        let bytes = json_out::decode_base64(encoded.as_bytes());
        Some(serde_json::from_slice(&bytes).unwrap())
    }

    /// A Pod CREATE review of `pod` in namespace `ml`.
    fn create_review(pod: &Value) -> Value {
        serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u", "namespace": "ml", "operation": "CREATE",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "object": pod
            }
        })
    }

    #[test]
    fn a_source_that_copies_answers_as_one_that_lends() {
        // A source with only the two required methods goes through the default `lend`.
        struct Copying(StaticSource);
        impl PolicySource for Copying {
            fn policies(&self) -> Vec<Arc<GpuPolicy>> {
                self.0.policies()
            }
            fn namespace_labels(&self, name: &str) -> Option<BTreeMap<String, String>> {
                self.0.namespace_labels(name)
            }
        }
        let mut team = GpuPolicy::default_policy();
        team.metadata.name = Some("team".into());
        team.spec.priority = 5;
        team.spec.mode = gpuwarden_crds::PolicyMode::Deny;
        team.spec.namespace_selector.match_labels = Some([("team".into(), "a".into())].into());
        let lending = StaticSource::new([GpuPolicy::default_policy(), team])
            .with_namespace("ml", &[("team", "a")]);
        let copying = Copying(lending.clone());
        let pod = serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c", "securityContext": {"privileged": true},
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"}]}]}
        });
        for namespace in ["ml", "other"] {
            let mut review = create_review(&pod);
            review["request"]["namespace"] = serde_json::json!(namespace);
            let body = serde_json::to_vec(&review).unwrap();
            let lent = handle_review(&body, &lending);
            assert_eq!(lent, handle_review(&body, &copying), "{namespace}");
            let expected = if namespace == "ml" {
                Outcome::Denied
            } else {
                Outcome::Rewritten
            };
            assert_eq!(lent.1.outcome, expected, "{namespace}");
        }
    }

    #[test]
    fn a_source_that_lends_nothing_gets_its_reviews_denied() {
        struct Silent;
        impl PolicySource for Silent {
            fn policies(&self) -> Vec<Arc<GpuPolicy>> {
                Vec::new()
            }
            fn namespace_labels(&self, _: &str) -> Option<BTreeMap<String, String>> {
                None
            }
            fn lend(&self, _: &str, _: &mut PolicyReader<'_>) {}
        }
        let body = serde_json::to_vec(&create_review(
            &serde_json::json!({"metadata": {"name": "p"}}),
        ))
        .unwrap();
        let (answer, summary) = handle_review(&body, &Silent);
        assert_eq!(summary.outcome, Outcome::Invalid);
        let answer: Value = serde_json::from_slice(&answer).unwrap();
        assert_eq!(answer["response"]["allowed"], false);
        assert!(
            answer["response"]["status"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("policy source")),
            "{answer}"
        );
    }

    #[test]
    fn a_repeated_field_is_read_as_the_api_server_reads_it() {
        // serde_json and the API server keep the last of a repeated key; the view cannot
        // read such a body, so the adapter reads it again as values.
        let body = |security: &str| {
            format!(
                r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{
                "uid":"u","namespace":"ml","operation":"CREATE",
                "kind":{{"group":"","version":"v1","kind":"Pod"}},
                "object":{{"metadata":{{"name":"p"}},"spec":{{"containers":[{{"name":"a",
                "image":"train",{security}
                "env":[{{"name":"NVIDIA_VISIBLE_DEVICES","value":"0"}}]}}]}}}}}}}}"#
            )
        };
        let source = StaticSource::new([GpuPolicy::default_policy()]);
        let last = r#""securityContext":{"privileged":true},"#;
        let repeated = format!(r#""securityContext":{{"privileged":false}},{last}"#);
        let (plain, summary) = handle_review(body(last).as_bytes(), &source);
        assert_eq!(summary.outcome, Outcome::Rewritten);
        assert_eq!(handle_review(body(&repeated).as_bytes(), &source).0, plain);
    }

    #[test]
    fn the_reused_patch_buffer_carries_nothing_over() {
        // Each thread keeps its patch buffer between reviews. An unusual pod grows it past
        // what is kept (thousands of env entries to remove); the reviews after it, on the
        // same thread, answer exactly as on a thread of their own.
        let review = |env_entries: usize, image: &str| {
            let env: Vec<Value> = (0..env_entries)
                .map(|i| serde_json::json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": i.to_string()}))
                .collect();
            serde_json::to_vec(&create_review(&serde_json::json!({
                "metadata": {"name": "p"},
                "spec": {"containers": [{"name": "a", "image": image, "env": env,
                    "securityContext": {"privileged": true}}]}
            })))
            .unwrap()
        };
        let source = Arc::new(StaticSource::new([GpuPolicy::default_policy()]));
        let small = [review(1, "train"), review(3, "other")];
        let alone: Vec<Vec<u8>> = small
            .iter()
            .map(|body| {
                let (body, source) = (body.clone(), source.clone());
                std::thread::spawn(move || handle_review(&body, source.as_ref()).0)
                    .join()
                    .unwrap()
            })
            .collect();
        let (_, summary) = handle_review(&review(3000, "big"), source.as_ref());
        assert_eq!(summary.outcome, Outcome::Rewritten);
        PATCH_SCRATCH.with_borrow(|bytes| {
            assert!(
                bytes.capacity() <= PATCH_SCRATCH_KEPT_BYTES,
                "{}",
                bytes.capacity()
            );
        });
        for (body, expected) in small
            .iter()
            .chain(small.iter().rev())
            .zip(alone.iter().chain(alone.iter().rev()))
        {
            assert_eq!(&handle_review(body, source.as_ref()).0, expected);
        }
    }

    #[test]
    fn a_body_that_is_not_utf8_is_read_as_bytes() {
        // Invalid UTF-8 in a field the engine skips does not matter, as for any JSON reader
        // that skips it; in a field it reads, the review is refused as not JSON.
        let body = |image: &[u8], annotation: &[u8]| {
            let mut body =
                br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{
                "uid":"u","namespace":"ml","operation":"CREATE",
                "kind":{"group":"","version":"v1","kind":"Pod"},"userInfo":{"extra":""#
                    .to_vec();
            body.extend_from_slice(annotation);
            body.extend_from_slice(
                br#""},"object":{"metadata":{"name":"p"},"spec":{"containers":[{"name":"a","image":""#,
            );
            body.extend_from_slice(image);
            body.extend_from_slice(
                br#"","securityContext":{"privileged":true},
                "env":[{"name":"NVIDIA_VISIBLE_DEVICES","value":"0"}]}]}}}}"#,
            );
            body
        };
        let source = StaticSource::new([GpuPolicy::default_policy()]);
        let (text, summary) = handle_review(&body(b"train", b"x"), &source);
        assert_eq!(summary.outcome, Outcome::Rewritten);
        let (skipped, summary) = handle_review(&body(b"train", b"\xff\xfe"), &source);
        assert_eq!(summary.outcome, Outcome::Rewritten);
        assert_eq!(skipped, text);
        let (_, summary) = handle_review(&body(b"tr\xffain", b"x"), &source);
        assert_eq!(summary.outcome, Outcome::Invalid);
    }

    #[test]
    fn the_view_from_the_body_gives_the_whole_pods_patch() {
        // Lists the view reads a few keys of (env, volumeMounts, volumes), with the shapes
        // that could tell them apart from whole entries: null lists, null and set valueFrom,
        // extra keys, a device hostPath volume to strip.
        let pod = serde_json::json!({
            "metadata": {"name": "p", "namespace": "ml"},
            "spec": {
                "volumes": [
                    {"name": "cfg", "configMap": {"name": "c"}},
                    {"name": "dev", "hostPath": {"path": "/dev/nvidia0", "type": "CharDevice"}}
                ],
                "containers": [
                    {
                        "name": "a",
                        "image": "train",
                        "securityContext": {"privileged": true},
                        "env": [
                            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "0", "valueFrom": null},
                            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
                        ],
                        "volumeMounts": [
                            {"name": "cfg", "mountPath": "/cfg", "readOnly": true},
                            {"name": "dev", "mountPath": "/dev/nvidia0"}
                        ]
                    },
                    {
                        "name": "b",
                        "image": "side",
                        "securityContext": {"privileged": true},
                        "env": null,
                        "volumeMounts": null
                    },
                    {
                        "name": "c",
                        "image": "indirect",
                        "securityContext": {"privileged": true},
                        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"configMapKeyRef": {"name": "g", "key": "k"}}}]
                    }
                ]
            }
        });
        let review = create_review(&pod);
        let source = StaticSource::new([GpuPolicy::default_policy()]);
        let labels = engine::namespace_labels_or_default("ml", None);
        let view = PodView::from_value(&pod);
        let input = Input {
            pod: &view,
            namespace: "ml",
            namespace_labels: &labels,
            operation: Operation::Create,
            display_name: "ml/p",
        };
        let decision = engine::decide(&input, &source.policies);
        assert_eq!(decision.verdict(), Verdict::Rewritten);
        let whole =
            serde_json::to_value(patch::patch_for(&pod, decision.changes()).unwrap()).unwrap();
        assert_eq!(answered_patch(&review, &source), Some(whole));
    }
}
