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
use serde_json::Value;

use crate::engine::{self, Decision, Input, Operation, Verdict};
use crate::{json_out, patch};

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
    /// No usable `request.oldObject` on an ephemeral-container update.
    #[error("AdmissionReview request for pods/ephemeralcontainers has no pod in request.oldObject")]
    MissingOldObject,
}

/// The incoming review: only what the engine needs, everything optional so that a
/// malformed review gets a precise answer instead of a parse error.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReviewIn<O> {
    #[serde(default)]
    api_version: Option<String>,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default = "none")]
    request: Option<RequestIn<O>>,
}

fn none<T>() -> Option<T> {
    None
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct RequestIn<O> {
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    kind: Option<GroupVersionKind>,
    #[serde(default)]
    resource: Option<GroupVersionResource>,
    #[serde(default)]
    sub_resource: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    operation: Option<String>,
    #[serde(default = "none")]
    object: Option<O>,
    #[serde(default = "none")]
    old_object: Option<O>,
}

/// Deserialises `T` from a JSON object only. (serde's derived structs also accept arrays,
/// which would let `[1]` pass for a pod.)
struct MapOnly<T>(T);

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for MapOnly<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<T>(std::marker::PhantomData<T>);
        impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for Visit<T> {
            type Value = MapOnly<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<Self::Value, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(MapOnly)
            }
        }
        d.deserialize_map(Visit(std::marker::PhantomData))
    }
}

impl ReviewIn<MapOnly<PodIn>> {
    fn into_values(self) -> ReviewIn<Value> {
        ReviewIn {
            api_version: self.api_version,
            kind: self.kind,
            request: self.request.map(|r| RequestIn {
                uid: r.uid,
                kind: r.kind,
                resource: r.resource,
                sub_resource: r.sub_resource,
                name: r.name,
                namespace: r.namespace,
                operation: r.operation,
                object: r.object.map(|p| p.0.into_value()),
                old_object: r.old_object.map(|p| p.0.into_value()),
            }),
        }
    }
}

/// The parts of a pod the engine reads, and nothing else: parsing a review this way skips
/// (without allocating) probes, affinity, owner references, commands and the like. Fields are
/// kept as JSON values, `null` included, so the engine sees them exactly as sent; list
/// entries keep only the keys the engine reads (see [`EnvVarIn`]). A pod this
/// shape cannot hold (say `containers` is not a list of objects) is parsed whole instead.
#[derive(serde::Deserialize)]
struct PodIn {
    #[serde(default = "none")]
    metadata: Option<MapOnly<MetaIn>>,
    #[serde(default)]
    spec: Option<MapOnly<SpecIn>>,
}

/// Metadata the engine reads: managedFields, ownerReferences and the rest are skipped.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct MetaIn {
    #[serde(default, deserialize_with = "present")]
    name: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    generate_name: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    namespace: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    labels: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    annotations: Option<Value>,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct SpecIn {
    #[serde(default, deserialize_with = "present")]
    service_account_name: Option<Value>,
    #[serde(default = "none")]
    volumes: Option<Vec<MapOnly<VolumeIn>>>,
    #[serde(default = "none")]
    containers: Option<Vec<MapOnly<ContainerIn>>>,
    #[serde(default = "none")]
    init_containers: Option<Vec<MapOnly<ContainerIn>>>,
    #[serde(default = "none")]
    ephemeral_containers: Option<Vec<MapOnly<ContainerIn>>>,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct ContainerIn {
    #[serde(default, deserialize_with = "present")]
    name: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    image: Option<Value>,
    #[serde(default = "none")]
    env: Option<Vec<MapOnly<EnvVarIn>>>,
    #[serde(default, deserialize_with = "present")]
    resources: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    security_context: Option<Value>,
    #[serde(default = "none")]
    volume_mounts: Option<Vec<MapOnly<VolumeMountIn>>>,
}

// List entries the engine only reads a few keys of, and removes by index without copying:
// the other keys (config map sources, mount paths, volume sources) are skipped. A list that
// is `null` reads as absent, which the engine treats the same way.

/// An `env` entry: the engine reads the name, the value, and whether `valueFrom` is set.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct EnvVarIn {
    #[serde(default, deserialize_with = "present")]
    name: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    value: Option<Value>,
    #[serde(default, deserialize_with = "set_or_null")]
    value_from: Option<Value>,
}

/// A pod volume: the engine reads the name and the host path.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct VolumeIn {
    #[serde(default, deserialize_with = "present")]
    name: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    host_path: Option<Value>,
}

/// A container's volume mount: the engine reads the name.
#[derive(serde::Deserialize)]
struct VolumeMountIn {
    #[serde(default, deserialize_with = "present")]
    name: Option<Value>,
}

/// A field that is present, even as `null`, is `Some`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    <Value as serde::Deserialize>::deserialize(d).map(Some)
}

/// A field whose content is never read, only whether it is set: `null` stays `null`,
/// anything else becomes an empty object, skipped without being built.
fn set_or_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    let set = <Option<serde::de::IgnoredAny> as serde::Deserialize>::deserialize(d)?;
    Ok(Some(match set {
        Some(_) => Value::Object(serde_json::Map::new()),
        None => Value::Null,
    }))
}

/// A list of reduced objects (entries, containers), as JSON.
fn entries<T>(list: Option<Vec<MapOnly<T>>>, entry: impl Fn(T) -> Value) -> Option<Value> {
    list.map(|l| Value::Array(l.into_iter().map(|MapOnly(e)| entry(e)).collect()))
}

/// A JSON object of the fields that are present.
fn object<const N: usize>(fields: [(&str, Option<Value>); N]) -> Value {
    // Inserted one by one: collecting into the map would sort a buffer first, which costs
    // more for these few keys.
    let mut map = serde_json::Map::new();
    for (key, value) in fields {
        if let Some(value) = value {
            map.insert(key.to_owned(), value);
        }
    }
    Value::Object(map)
}

impl PodIn {
    fn into_value(self) -> Value {
        let container = |c: ContainerIn| {
            object([
                ("name", c.name),
                ("image", c.image),
                (
                    "env",
                    entries(c.env, |e| {
                        object([
                            ("name", e.name),
                            ("value", e.value),
                            ("valueFrom", e.value_from),
                        ])
                    }),
                ),
                ("resources", c.resources),
                ("securityContext", c.security_context),
                (
                    "volumeMounts",
                    entries(c.volume_mounts, |v| object([("name", v.name)])),
                ),
            ])
        };
        object([
            (
                "metadata",
                self.metadata.map(|MapOnly(meta)| {
                    object([
                        ("name", meta.name),
                        ("generateName", meta.generate_name),
                        ("namespace", meta.namespace),
                        ("labels", meta.labels),
                        ("annotations", meta.annotations),
                    ])
                }),
            ),
            (
                "spec",
                self.spec.map(|MapOnly(spec)| {
                    object([
                        ("serviceAccountName", spec.service_account_name),
                        (
                            "volumes",
                            entries(spec.volumes, |v| {
                                object([("name", v.name), ("hostPath", v.host_path)])
                            }),
                        ),
                        ("containers", entries(spec.containers, container)),
                        ("initContainers", entries(spec.init_containers, container)),
                        (
                            "ephemeralContainers",
                            entries(spec.ephemeral_containers, container),
                        ),
                    ])
                }),
            ),
        ])
    }
}

#[derive(serde::Deserialize)]
struct GroupVersionKind {
    #[serde(default)]
    group: String,
    #[serde(default)]
    kind: String,
}

#[derive(serde::Deserialize)]
struct GroupVersionResource {
    #[serde(default)]
    group: String,
    #[serde(default)]
    resource: String,
}

/// The response review's `response`, written by [`encode`].
struct ResponseOut {
    uid: String,
    allowed: bool,
    status: Option<StatusOut>,
    /// The JSON patch, sent base64-encoded with `patchType: JSONPatch`.
    patch: Option<Vec<u8>>,
    warnings: Vec<String>,
    audit_annotations: BTreeMap<String, String>,
}

struct StatusOut {
    code: u16,
    reason: &'static str,
    message: String,
}

const API_VERSION: &str = "admission.k8s.io/v1";

/// Answers one AdmissionReview body. See the module docs.
pub fn handle_review(body: &[u8], source: &dyn PolicySource) -> (Vec<u8>, ReviewSummary) {
    // Fast path: only the fields the engine reads. Anything it cannot take is parsed again,
    // whole, so that odd input gets the same precise answer.
    let review: ReviewIn<Value> = match serde_json::from_slice::<ReviewIn<MapOnly<PodIn>>>(body) {
        Ok(review) => review.into_values(),
        Err(_) => match serde_json::from_slice::<ReviewIn<Value>>(body) {
            Ok(review) => review,
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
                return invalid(API_VERSION, uid, None, &error);
            }
        },
    };
    let api_version = match review.api_version.as_deref() {
        Some(v @ "admission.k8s.io/v1beta1") => v,
        _ => API_VERSION,
    };
    if review.kind.as_deref() != Some("AdmissionReview") {
        let uid = review
            .request
            .as_ref()
            .and_then(|r| r.uid.clone())
            .unwrap_or_default();
        let what = match review.kind {
            Some(kind) => format!("kind is {kind:?}"),
            None => "kind is missing".to_owned(),
        };
        return invalid(api_version, uid, None, &ReviewError::NotAReview(what));
    }
    let Some(request) = review.request else {
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
    match review_request(&request, source) {
        Ok((decision, pod)) => respond(api_version, uid, pod, decision, request.object.as_ref()),
        Err(error) => {
            let pod = request
                .object
                .as_ref()
                .map(|o| display_name(o, request.namespace.as_deref(), request.name.as_deref()));
            invalid(api_version, uid, pod, &error)
        }
    }
}

/// Runs the engine on a parsed request. `Ok` carries the decision and the pod's display name.
fn review_request(
    request: &RequestIn<Value>,
    source: &dyn PolicySource,
) -> Result<(Decision, Option<String>), ReviewError> {
    let is_pod = match (&request.kind, &request.resource) {
        (Some(k), _) if !k.kind.is_empty() => k.group.is_empty() && k.kind == "Pod",
        (_, Some(r)) => r.group.is_empty() && r.resource == "pods",
        _ => false,
    };
    if !is_pod {
        let what = match (&request.kind, &request.resource) {
            (Some(k), _) if !k.kind.is_empty() => {
                if k.group.is_empty() {
                    k.kind.clone()
                } else {
                    format!("{}.{}", k.kind, k.group)
                }
            }
            (_, Some(r)) if !r.resource.is_empty() => r.resource.clone(),
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
                .filter(|o| o.is_object())
                .ok_or(ReviewError::MissingOldObject)?;
            Operation::AddEphemeral { old }
        }
        // DELETE, CONNECT, plain UPDATE (privilege is immutable) and other subresources.
        _ => return Ok((Decision::default(), None)),
    };
    let pod = request
        .object
        .as_ref()
        .filter(|o| o.is_object())
        .ok_or_else(|| ReviewError::MissingObject {
            operation: operation.to_owned(),
        })?;
    let namespace = request
        .namespace
        .as_deref()
        .filter(|n| !n.is_empty())
        .or_else(|| {
            pod.get("metadata")
                .and_then(|m| m.get("namespace"))
                .and_then(Value::as_str)
        })
        .unwrap_or("default");
    let name = display_name(pod, Some(namespace), request.name.as_deref());
    let labels = engine::namespace_labels_or_default(namespace, source.namespace_labels(namespace));
    let policies = source.policies();
    let input = Input {
        pod,
        namespace,
        namespace_labels: &labels,
        operation: op,
        display_name: &name,
    };
    let decision = engine::decide(&input, &policies);
    for skipped in &decision.skipped_policies {
        tracing::warn!(pod = %name, "{skipped}");
    }
    Ok((decision, Some(name)))
}

/// `namespace/name`, or `namespace/generateName*` for a pod not yet named.
fn display_name(pod: &Value, namespace: Option<&str>, name: Option<&str>) -> String {
    let namespace = namespace
        .filter(|n| !n.is_empty())
        .or_else(|| {
            pod.get("metadata")
                .and_then(|m| m.get("namespace"))
                .and_then(Value::as_str)
        })
        .unwrap_or("default");
    let name = name
        .filter(|n| !n.is_empty())
        .or_else(|| {
            pod.get("metadata")
                .and_then(|m| m.get("name"))
                .and_then(Value::as_str)
        })
        .map(str::to_owned)
        .or_else(|| {
            pod.get("metadata")
                .and_then(|m| m.get("generateName"))
                .and_then(Value::as_str)
                .map(|g| format!("{g}*"))
        })
        .unwrap_or_else(|| "<unnamed>".to_owned());
    format!("{namespace}/{name}")
}

fn respond(
    api_version: &str,
    uid: String,
    pod_name: Option<String>,
    decision: Decision,
    pod: Option<&Value>,
) -> (Vec<u8>, ReviewSummary) {
    let outcome = match decision.verdict() {
        Verdict::NotGoverned | Verdict::Unchanged => Outcome::Allowed,
        Verdict::Exempt => Outcome::Exempt,
        Verdict::Rewritten => Outcome::Rewritten,
        Verdict::Audited => Outcome::Audited,
        Verdict::Denied => Outcome::Denied,
    };
    let mut response = ResponseOut {
        uid: uid.clone(),
        allowed: outcome != Outcome::Denied,
        status: None,
        patch: None,
        warnings: decision.warnings,
        audit_annotations: decision.audit_annotations,
    };
    if let Some(message) = decision.denial {
        response.status = Some(StatusOut {
            code: 403,
            reason: "Forbidden",
            message,
        });
    }
    if response.allowed
        && !decision.changes.is_empty()
        && let Some(pod) = pod
    {
        // Sized up front: growing the buffer step by step shows in profiles.
        let mut bytes = Vec::with_capacity(PATCH_BUFFER_BYTES);
        if patch::write_patch(pod, &decision.changes, &mut bytes) > 0 {
            response.patch = Some(bytes);
        }
    }
    tracing::debug!(uid = %uid, pod = pod_name.as_deref().unwrap_or(""), outcome = outcome.as_str(), "admission review answered");
    let summary = ReviewSummary {
        uid,
        outcome,
        policy: decision.policy,
        pod: pod_name,
    };
    (encode(api_version, response), summary)
}

fn invalid(
    api_version: &str,
    uid: String,
    pod: Option<String>,
    error: &ReviewError,
) -> (Vec<u8>, ReviewSummary) {
    tracing::debug!(uid = %uid, error = %error, "malformed admission review");
    let response = ResponseOut {
        uid: uid.clone(),
        allowed: false,
        status: Some(StatusOut {
            code: 400,
            reason: "BadRequest",
            message: format!("gpuwarden: {error}"),
        }),
        patch: None,
        warnings: Vec::new(),
        audit_annotations: BTreeMap::new(),
    };
    let summary = ReviewSummary {
        uid,
        outcome: Outcome::Invalid,
        policy: None,
        pod,
    };
    (encode(api_version, response), summary)
}

/// Room reserved for a serialised patch before base64; most patches fit.
const PATCH_BUFFER_BYTES: usize = 2048;

fn encode(api_version: &str, response: ResponseOut) -> Vec<u8> {
    // Room for the envelope plus the variable parts, so the buffer is not regrown.
    let capacity = 256
        + response.uid.len()
        + response
            .patch
            .as_ref()
            .map_or(0, |p| p.len().div_ceil(3) * 4)
        + response.status.as_ref().map_or(0, |s| s.message.len())
        + response.warnings.iter().map(|w| w.len() + 3).sum::<usize>()
        + response
            .audit_annotations
            .iter()
            .map(|(k, v)| k.len() + v.len() + 8)
            .sum::<usize>();
    let mut out = Vec::with_capacity(capacity);
    out.extend_from_slice(b"{\"apiVersion\":");
    json_out::string(&mut out, api_version);
    out.extend_from_slice(b",\"kind\":\"AdmissionReview\",\"response\":{\"uid\":");
    json_out::string(&mut out, &response.uid);
    out.extend_from_slice(if response.allowed {
        b",\"allowed\":true"
    } else {
        b",\"allowed\":false"
    });
    if let Some(status) = &response.status {
        out.extend_from_slice(b",\"status\":{\"status\":\"Failure\",\"code\":");
        json_out::number(&mut out, status.code);
        out.extend_from_slice(b",\"reason\":");
        json_out::string(&mut out, status.reason);
        out.extend_from_slice(b",\"message\":");
        json_out::string(&mut out, &status.message);
        out.push(b'}');
    }
    if let Some(patch) = &response.patch {
        out.extend_from_slice(b",\"patch\":\"");
        json_out::base64(&mut out, patch);
        out.extend_from_slice(b"\",\"patchType\":\"JSONPatch\"");
    }
    if !response.warnings.is_empty() {
        out.extend_from_slice(b",\"warnings\":");
        json_out::string_array(&mut out, response.warnings.iter().map(String::as_str));
    }
    if !response.audit_annotations.is_empty() {
        out.extend_from_slice(b",\"auditAnnotations\":");
        json_out::string_object(
            &mut out,
            response
                .audit_annotations
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str())),
        );
    }
    out.extend_from_slice(b"}}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The patch `handle_review` answers with, decoded; `None` when there is none.
    fn answered_patch(review: &Value, source: &StaticSource) -> Option<Value> {
        let (out, _) = handle_review(&serde_json::to_vec(review).unwrap(), source);
        let out: Value = serde_json::from_slice(&out).unwrap();
        let encoded = out["response"]["patch"].as_str()?;
        let table = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut bits = Vec::new();
        for c in encoded.bytes().filter(|&c| c != b'=') {
            let v = table.iter().position(|&t| t == c).unwrap();
            bits.extend((0..6).rev().map(|i| (v >> i) & 1));
        }
        let bytes: Vec<u8> = bits
            .chunks_exact(8)
            .map(|b| b.iter().fold(0u8, |acc, &bit| (acc << 1) | bit as u8))
            .collect();
        Some(serde_json::from_slice(&bytes).unwrap())
    }

    #[test]
    fn reduced_list_entries_give_the_whole_pods_patch() {
        // Lists the adapter reduces (env, volumeMounts, volumes), with the shapes that could
        // tell a reduced entry from a whole one: null lists, null and set valueFrom, extra
        // keys, a device hostPath volume to strip.
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
        let review = serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u", "namespace": "ml", "operation": "CREATE",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "object": pod
            }
        });
        let source = StaticSource::new([GpuPolicy::default_policy()]);
        let labels = engine::namespace_labels_or_default("ml", None);
        let input = Input {
            pod: &pod,
            namespace: "ml",
            namespace_labels: &labels,
            operation: Operation::Create,
            display_name: "ml/p",
        };
        let decision = engine::decide(&input, &source.policies);
        assert_eq!(decision.verdict(), Verdict::Rewritten);
        let whole =
            serde_json::to_value(patch::patch_for(&pod, &decision.changes).unwrap()).unwrap();
        assert_eq!(answered_patch(&review, &source), Some(whole));
    }
}
