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
use kube::core::Status;
use kube::core::admission::AdmissionResponse;
use serde::Serialize;

use crate::engine::{
    self, ClaimStore, Claims, Decision, Input, NamespaceLabels, NoClaims, Operation, Requester,
    Verdict,
};
use crate::pod::{PodView, Str};
use crate::{kubevirt, patch};

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
    /// Where ResourceClaims and ResourceClaimTemplates are read: by default nowhere, so a
    /// claim counts by nothing and the `ResourceClaim` rewrite is denied, saying so.
    fn claims(&self) -> &dyn Claims {
        &NoClaims("this webhook reads no ResourceClaims: it runs without a cluster")
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
    /// Enforce, nothing to rewrite: allowed with `NVIDIA_VISIBLE_DEVICES=void` set on the
    /// containers that hold no GPU.
    Voided,
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
            Self::Voided => "voided",
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
    /// ResourceClaims and ResourceClaimTemplates: those inserted, and no others.
    pub claims: ClaimStore,
}

impl StaticSource {
    /// A source holding `policies` and no known namespaces.
    pub fn new(policies: impl IntoIterator<Item = GpuPolicy>) -> Self {
        Self {
            policies: policies.into_iter().map(Arc::new).collect(),
            namespaces: BTreeMap::new(),
            claims: ClaimStore::new(),
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
    fn claims(&self) -> &dyn Claims {
        &self.claims
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
    /// A KubeVirt VM whose launcher pod cannot be read from it.
    #[error("{kind} {name}: {message}")]
    BadVm {
        /// The kind.
        kind: String,
        /// `namespace/name`.
        name: String,
        /// What is wrong, and where.
        message: String,
    },
    /// No usable `request.object`.
    #[error("AdmissionReview request for {operation} has no pod in request.object")]
    MissingObject {
        /// The operation.
        operation: String,
    },
    /// The patch could not be serialised (a bug; the review is denied, never admitted
    /// without it).
    #[error("the rewrite's patch could not be serialised: {0}")]
    Patch(String),
    /// The policy source lent nothing to judge with.
    #[error("the webhook's policy source answered nothing; this is a bug")]
    NoPolicySource,
    /// No usable `request.oldObject` on an ephemeral-container update.
    #[error("AdmissionReview request for pods/ephemeralcontainers has no pod in request.oldObject")]
    MissingOldObject,
}

/// The incoming review: only what the engine needs, everything optional so that a
/// malformed review gets a precise answer instead of a parse error. Its strings borrow from
/// the body unless they hold escapes; the pods are the engine's view ([`crate::pod`]), read
/// in the same single pass.
#[derive(Debug, Default, PartialEq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReviewIn<'a> {
    #[serde(default, borrow, deserialize_with = "optional_str")]
    api_version: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "optional_str")]
    kind: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    request: Option<RequestIn<'a>>,
}

#[derive(Debug, Default, PartialEq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct RequestIn<'a> {
    #[serde(default, borrow, deserialize_with = "optional_str")]
    uid: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    kind: Option<GroupVersionKind<'a>>,
    #[serde(default, borrow)]
    resource: Option<GroupVersionResource<'a>>,
    #[serde(default, borrow, deserialize_with = "optional_str")]
    sub_resource: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "optional_str")]
    name: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "optional_str")]
    namespace: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "optional_str")]
    operation: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    object: Option<PodObject<'a>>,
    #[serde(default, borrow)]
    old_object: Option<PodObject<'a>>,
    #[serde(default, borrow)]
    user_info: Option<UserInfoIn<'a>>,
}

/// `request.userInfo`: who made the request, which only the API server writes.
#[derive(Debug, Default, PartialEq, serde::Deserialize)]
struct UserInfoIn<'a> {
    #[serde(default, borrow, deserialize_with = "optional_str")]
    username: Option<Cow<'a, str>>,
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
struct PodObject<'a>(Option<PodView<'a>>);

impl<'de: 'a, 'a> serde::Deserialize<'de> for PodObject<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        crate::pod::pod_object(d).map(PodObject)
    }
}

#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
struct GroupVersionKind<'a> {
    #[serde(default, borrow, deserialize_with = "required_str")]
    group: Cow<'a, str>,
    #[serde(default, borrow, deserialize_with = "required_str")]
    kind: Cow<'a, str>,
}

#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
struct GroupVersionResource<'a> {
    #[serde(default, borrow, deserialize_with = "required_str")]
    group: Cow<'a, str>,
    #[serde(default, borrow, deserialize_with = "required_str")]
    resource: Cow<'a, str>,
}

const API_VERSION: &str = "admission.k8s.io/v1";

/// Answers one AdmissionReview body. See the module docs.
pub fn handle_review(body: &[u8], source: &dyn PolicySource) -> (Vec<u8>, ReviewSummary) {
    // One pass: serde reads the review and the pod's view together, borrowing from the body.
    match serde_json::from_slice::<ReviewIn<'_>>(body) {
        Ok(review) => answer(&review, body, source),
        Err(e) => {
            let error = if e.is_data() {
                ReviewError::NotAReview(e.to_string())
            } else {
                ReviewError::NotJson(e.to_string())
            };
            invalid(API_VERSION, request_uid(body), None, &error)
        }
    }
}

/// A request to exec, attach or port-forward into a pod: where the pod is, for the server
/// to read it before [`handle_entry`] judges the request, and who asks for what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryTarget {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// `exec`, `attach` or `portforward`.
    pub subresource: String,
    /// `request.userInfo.username` ("" when missing).
    pub username: String,
}

/// The pod a review's request enters (`CONNECT` on `pods/exec`, `pods/attach` or
/// `pods/portforward`), or `None` for any other request. Reads nothing else.
pub fn entry_target(body: &[u8]) -> Option<EntryTarget> {
    #[derive(serde::Deserialize)]
    struct Review<'a> {
        #[serde(borrow)]
        request: Option<Request<'a>>,
    }
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Request<'a> {
        #[serde(borrow)]
        operation: Option<Cow<'a, str>>,
        #[serde(borrow)]
        sub_resource: Option<Cow<'a, str>>,
        #[serde(borrow)]
        namespace: Option<Cow<'a, str>>,
        #[serde(borrow)]
        name: Option<Cow<'a, str>>,
        #[serde(borrow)]
        resource: Option<GroupVersionResource<'a>>,
        #[serde(borrow)]
        user_info: Option<UserInfoIn<'a>>,
    }
    let request = serde_json::from_slice::<Review<'_>>(body).ok()?.request?;
    let resource = request.resource?;
    let sub = request.sub_resource.as_deref().unwrap_or("");
    let entry = request.operation.as_deref() == Some("CONNECT")
        && resource.group.is_empty()
        && resource.resource == "pods"
        && gpuwarden_crds::vm::POD_ENTRY_SUBRESOURCES.contains(&sub);
    entry.then(|| EntryTarget {
        subresource: sub.to_owned(),
        namespace: request.namespace.unwrap_or_default().into_owned(),
        name: request.name.unwrap_or_default().into_owned(),
        username: (request.user_info.and_then(|u| u.username))
            .unwrap_or_default()
            .into_owned(),
    })
}

/// Answers a request to enter a pod ([`entry_target`]), given the pod as read from the API
/// server (`Ok(None)`: it is gone; `Err`: why it could not be read). A pod that cannot be
/// read is not entered: the request is denied, saying why, so that a VM's pod is never
/// entered for want of an answer (docs/design.md, "No way into a VM's pod").
pub fn handle_entry(
    body: &[u8],
    pod: Result<Option<serde_json::Value>, String>,
    source: &dyn PolicySource,
) -> (Vec<u8>, ReviewSummary) {
    let uid = request_uid(body);
    let Some(target) = entry_target(body) else {
        let error = ReviewError::NotAReview("not a request to enter a pod".into());
        return invalid(API_VERSION, uid, None, &error);
    };
    let (sub, username) = (target.subresource.as_str(), target.username.as_str());
    let name = format!("{}/{}", target.namespace, target.name);
    let mut response = allowed(&uid);
    let mut outcome = Outcome::Allowed;
    let view = match &pod {
        Ok(Some(pod)) => Some(PodView::from_value(pod)),
        _ => None,
    };
    let mut denial = None;
    source.lend(&target.namespace, &mut |policies, known| {
        let labels = NamespaceLabels {
            name: &target.namespace,
            known,
        };
        denial = match (&pod, &view) {
            (Ok(_), Some(view)) => {
                engine::entry_denial(view, &target.namespace, &labels, policies, username, sub)
            }
            (Ok(_), None) => None,
            (Err(why), _) => engine::may_govern(&labels, policies).then(|| format!(
                "gpuwarden: pods/{sub} into pod {name} is denied: the webhook could not read the pod to tell whether it is a VM's ({why}); retry"
            )),
        };
    });
    if let Some(message) = denial {
        outcome = Outcome::Denied;
        response.allowed = false;
        response.result = Status::failure(&message, "Forbidden").with_code(403);
    }
    let summary = ReviewSummary {
        uid,
        outcome,
        policy: None,
        pod: Some(name),
    };
    (review_body(API_VERSION, response), summary)
}

/// `request.uid` of a body, or `""`: for answers to a body that could not be judged, so that
/// the API server still shows their message. Reads nothing else.
pub fn request_uid(body: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct Review<'a> {
        #[serde(borrow)]
        request: Option<Request<'a>>,
    }
    #[derive(serde::Deserialize)]
    struct Request<'a> {
        #[serde(borrow)]
        uid: Option<Cow<'a, str>>,
    }
    serde_json::from_slice::<Review<'_>>(body)
        .ok()
        .and_then(|r| r.request?.uid)
        .map(Cow::into_owned)
        .unwrap_or_default()
}

/// Answers a parsed review; `body` is what it was read from.
fn answer(
    review: &ReviewIn<'_>,
    body: &[u8],
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
    if let Some(kind) = vm_kind(request) {
        return answer_vm(api_version, uid, kind, body, request, source);
    }
    let (operation, pod) = match target(request) {
        Ok(Some(target)) => target,
        // DELETE, CONNECT, plain UPDATE (privilege is immutable) and other subresources.
        Ok(None) => {
            let body = review_body(api_version, allowed(&uid));
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
    answer_pod(api_version, uid, operation, pod, request, source)
}

/// Judges the pod of a request ([`engine::decide`]) by the policies governing its
/// namespace, as `source` lends them.
fn answer_pod(
    api_version: &str,
    uid: String,
    operation: Operation<'_>,
    pod: &PodView<'_>,
    request: &RequestIn<'_>,
    source: &dyn PolicySource,
) -> (Vec<u8>, ReviewSummary) {
    let namespace = namespace_of(pod, request.namespace.as_deref());
    let name = display_name(pod, namespace, request.name.as_deref());
    // A request without a user is no one's: it may hold no VM device.
    let username = (request.user_info.as_ref())
        .and_then(|u| u.username.as_deref())
        .unwrap_or_default();
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
            claims: source.claims(),
            owner_kind: None,
            requester: Requester::User(username),
        };
        let decision = engine::decide(&input, policies);
        answer = Some(respond(api_version, &uid, &name, decision, Some(pod)));
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

/// The kind of a request about one of KubeVirt's VM kinds, written or changed (not a
/// subresource, which cannot change the VM's template).
fn vm_kind<'r>(request: &'r RequestIn<'_>) -> Option<&'r str> {
    let kind = request.kind.as_ref()?;
    let sub = request.sub_resource.as_deref().unwrap_or("");
    (sub.is_empty() && gpuwarden_crds::vm::vmi_pointer(&kind.group, &kind.kind).is_some())
        .then_some(&*kind.kind)
}

/// A KubeVirt VM, judged as the launcher pod the virt-controller renders for it
/// ([`kubevirt`]), made by KubeVirt: its VM devices pass, and whatever its author wrote that
/// reaches the pod is judged (docs/design.md, "VMs judged like pods"). The VM is never
/// patched. An update whose template is unchanged passes, and so does one of a VM that was
/// denied before it (with a warning), so that an older VM can always be stopped and deleted.
fn answer_vm(
    api_version: &str,
    uid: String,
    kind: &str,
    body: &[u8],
    request: &RequestIn<'_>,
    source: &dyn PolicySource,
) -> (Vec<u8>, ReviewSummary) {
    let pass = |uid: String| {
        let summary = ReviewSummary {
            uid: uid.clone(),
            outcome: Outcome::Allowed,
            policy: None,
            pod: None,
        };
        (review_body(api_version, allowed(&uid)), summary)
    };
    let operation = request.operation.as_deref().unwrap_or("");
    if !matches!(operation, "CREATE" | "UPDATE") {
        return pass(uid);
    }
    let Some((object, old)) = vm_objects(body) else {
        let error = ReviewError::MissingObject {
            operation: operation.to_owned(),
        };
        return invalid(api_version, uid, None, &error);
    };
    let namespace = (request.namespace.as_deref())
        .filter(|n| !n.is_empty())
        .or_else(|| object.pointer("/metadata/namespace")?.as_str())
        .unwrap_or("default")
        .to_owned();
    let vm_name = (request.name.as_deref())
        .filter(|n| !n.is_empty())
        .or_else(|| object.pointer("/metadata/name")?.as_str())
        .unwrap_or("<unnamed>");
    let name = format!("of {kind} {namespace}/{vm_name}");
    if operation == "UPDATE"
        && old
            .as_ref()
            .is_some_and(|old| kubevirt::same_template(old, &object))
    {
        return pass(uid);
    }
    let rendered = match kubevirt::launcher_pod(&object) {
        Ok(rendered) => rendered,
        Err(message) => {
            let error = ReviewError::BadVm {
                kind: kind.to_owned(),
                name: format!("{namespace}/{vm_name}"),
                message,
            };
            return invalid(api_version, uid, Some(name), &error);
        }
    };
    let old = old
        .as_ref()
        .and_then(|old| kubevirt::launcher_pod(old).ok());
    let answer = judge_vm(api_version, &uid, &name, &namespace, &rendered, old, source);
    let Some((body, outcome, policy)) = answer else {
        return invalid(api_version, uid, Some(name), &ReviewError::NoPolicySource);
    };
    let summary = ReviewSummary {
        uid,
        outcome,
        policy,
        pod: Some(name),
    };
    (body, summary)
}

/// Why a VM denied before an update is let through all the same.
const LET_THROUGH: &str =
    "it was before this update too, which is let through so that the VM can be stopped and deleted";

/// `request.object` and `request.oldObject` of a review about a VM, as they are.
fn vm_objects(body: &[u8]) -> Option<(serde_json::Value, Option<serde_json::Value>)> {
    #[derive(serde::Deserialize)]
    struct Raw {
        request: RawRequest,
    }
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct RawRequest {
        #[serde(default)]
        object: Option<serde_json::Value>,
        #[serde(default)]
        old_object: Option<serde_json::Value>,
    }
    let request = serde_json::from_slice::<Raw>(body).ok()?.request;
    Some((request.object?, request.old_object))
}

/// The answer for a VM whose launcher pod is `rendered` (and was `old` before an update),
/// named `name` in messages: the engine's decision on the pod, as made by KubeVirt.
fn judge_vm(
    api_version: &str,
    uid: &str,
    name: &str,
    namespace: &str,
    rendered: &kubevirt::Rendered,
    old: Option<kubevirt::Rendered>,
    source: &dyn PolicySource,
) -> Option<(Vec<u8>, Outcome, Option<String>)> {
    let view = PodView::from_value(&rendered.pod);
    // The VM as it was, on an update: one its author cannot change any more, written before
    // gpuwarden or its policy, is never held up (KubeVirt updates a VMI's annotations itself).
    let before = old.as_ref().map(|r| PodView::from_value(&r.pod));
    let mut answer = None;
    source.lend(namespace, &mut |policies, known| {
        let labels = NamespaceLabels {
            name: namespace,
            known,
        };
        let judge = |pod| {
            let input = Input {
                pod,
                namespace,
                namespace_labels: &labels,
                operation: Operation::Create,
                display_name: name,
                claims: source.claims(),
                owner_kind: Some(gpuwarden_crds::vm::KIND_VMI),
                requester: Requester::KubeVirt,
            };
            engine::decide(&input, policies)
        };
        let decision = judge(&view);
        let denied = |d: &Decision<'_>| d.verdict() == Verdict::Denied;
        let denied_before = (before.as_ref()).is_some_and(|b| denied(&judge(b)));
        answer = Some(if denied(&decision) && denied_before {
            let mut response = allowed(uid);
            let why = decision.denial().unwrap_or_default();
            response.warnings = Some(vec![format!("{why} ({LET_THROUGH})")]);
            let body = review_body(api_version, response);
            (body, Outcome::Audited, decision.into_policy_reference())
        } else {
            respond(api_version, uid, name, decision, None)
        });
    });
    answer
}

/// What the engine is asked about a request that is about a Pod: the operation and the pod,
/// or `None` for an operation it lets through unjudged.
fn target<'r, 'a>(
    request: &'r RequestIn<'a>,
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

/// The answer for a decision, its outcome and the governing policy's reference; `pod` is
/// what the patch changes (`None`: the object judged is not the pod, which is not patched).
fn respond(
    api_version: &str,
    uid: &str,
    pod_name: &str,
    decision: Decision<'_>,
    pod: Option<&PodView<'_>>,
) -> (Vec<u8>, Outcome, Option<String>) {
    let outcome = match decision.verdict() {
        Verdict::NotGoverned | Verdict::Unchanged => Outcome::Allowed,
        Verdict::Exempt => Outcome::Exempt,
        Verdict::Rewritten => Outcome::Rewritten,
        Verdict::Voided => Outcome::Voided,
        Verdict::Audited => Outcome::Audited,
        Verdict::Denied => Outcome::Denied,
    };
    tracing::debug!(
        uid,
        pod = pod_name,
        outcome = outcome.as_str(),
        "admission review answered"
    );
    let mut response = allowed(uid);
    if let Some(message) = decision.denial() {
        response.allowed = false;
        response.result = Status::failure(&message, "Forbidden").with_code(403);
    }
    let patch = pod.map_or_else(
        || json_patch::Patch(Vec::new()),
        |pod| patch::patch_for_view(pod, decision.changes()),
    );
    if response.allowed && !patch.0.is_empty() {
        response = match response.with_patch(patch) {
            Ok(response) => response,
            Err(e) => {
                let error = ReviewError::Patch(e.to_string());
                return (
                    invalid(api_version, uid.to_owned(), None, &error).0,
                    Outcome::Invalid,
                    None,
                );
            }
        };
    }
    let warnings = decision.warnings();
    response.warnings = (!warnings.is_empty()).then_some(warnings);
    response.audit_annotations = (decision.audit_annotations().into_iter())
        .map(|(key, value)| (key.to_owned(), value))
        .collect();
    let body = review_body(api_version, response);
    (body, outcome, decision.into_policy_reference())
}

fn invalid(
    api_version: &str,
    uid: String,
    pod: Option<String>,
    error: &ReviewError,
) -> (Vec<u8>, ReviewSummary) {
    tracing::debug!(uid = %uid, error = %error, "malformed admission review");
    let mut response = allowed(&uid);
    response.allowed = false;
    response.result = Status::failure(&format!("gpuwarden: {error}"), "BadRequest").with_code(400);
    let summary = ReviewSummary {
        uid,
        outcome: Outcome::Invalid,
        policy: None,
        pod,
    };
    (review_body(api_version, response), summary)
}

/// An answer that allows request `uid`, to which a denial, a patch, warnings and audit
/// annotations are added.
fn allowed(uid: &str) -> AdmissionResponse {
    let mut response = AdmissionResponse::invalid("");
    response.uid = uid.to_owned();
    response.allowed = true;
    response.result = Status::default();
    response
}

/// The response review as JSON, under `api_version`: `AdmissionResponse`'s own fields, but
/// `patch` as the API requires it, base64 text (`AdmissionResponse` would write its bytes
/// as a list of numbers), and the audit annotations sorted, so that one review always gets
/// the same bytes.
fn review_body(api_version: &str, mut response: AdmissionResponse) -> Vec<u8> {
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Review<'r> {
        api_version: &'r str,
        kind: &'static str,
        response: Body<'r>,
    }
    #[derive(Serialize)]
    struct Body<'r> {
        #[serde(flatten)]
        response: &'r AdmissionResponse,
        #[serde(skip_serializing_if = "Option::is_none")]
        patch: Option<String>,
        #[serde(
            rename = "auditAnnotations",
            skip_serializing_if = "BTreeMap::is_empty"
        )]
        audit_annotations: BTreeMap<String, String>,
    }
    let patch = response
        .patch
        .take()
        .map(|bytes| base64_simd::STANDARD.encode_to_string(bytes));
    let audit_annotations = std::mem::take(&mut response.audit_annotations)
        .into_iter()
        .collect();
    let review = Review {
        api_version,
        kind: "AdmissionReview",
        response: Body {
            response: &response,
            patch,
            audit_annotations,
        },
    };
    // Strings, booleans, numbers and maps of strings: serialising cannot fail.
    serde_json::to_vec(&review).unwrap_or_default()
}
