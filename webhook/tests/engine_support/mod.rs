//! Shared helpers for the engine tests: build AdmissionReviews, run them, apply the patch.
#![allow(dead_code)]

use gpuwarden_crds::GpuPolicy;
use gpuwarden_webhook::admission::{PolicySource, ReviewSummary, handle_review};
use serde_json::{Value, json};

/// A CREATE review for `pod` in `namespace`.
pub fn create_review(pod: &Value, namespace: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod.pointer("/metadata/name").cloned().unwrap_or(Value::Null),
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": pod,
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        }
    }))
    .unwrap()
}

/// A `pods/ephemeralcontainers` UPDATE review.
pub fn ephemeral_review(old: &Value, new: &Value, namespace: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "e-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "subResource": "ephemeralcontainers",
            "name": new.pointer("/metadata/name").cloned().unwrap_or(Value::Null),
            "namespace": namespace,
            "operation": "UPDATE",
            "object": new,
            "oldObject": old,
        }
    }))
    .unwrap()
}

/// A response review, decoded.
pub struct Answer {
    pub review: Value,
    pub summary: ReviewSummary,
    /// The JSON patch, when there is one.
    pub patch: Option<json_patch::Patch>,
}

impl Answer {
    pub fn response(&self) -> &Value {
        &self.review["response"]
    }
    pub fn allowed(&self) -> bool {
        self.response()["allowed"] == json!(true)
    }
    pub fn warnings(&self) -> Vec<String> {
        self.response()["warnings"]
            .as_array()
            .map(|w| {
                w.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    }
    pub fn message(&self) -> String {
        self.response()
            .pointer("/status/message")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    }
    /// The containers (`/spec/<list>/<index>`) the patch gives `NVIDIA_VISIBLE_DEVICES=void`
    /// by the void rule alone; panics on any other operation.
    pub fn voided_only(&self) -> Vec<String> {
        let ops = serde_json::to_value(self.patch.as_ref().map(|p| &p.0)).unwrap();
        let mut out = Vec::new();
        for op in ops.as_array().into_iter().flatten() {
            let path = op["path"].as_str().unwrap_or_default();
            let entry = json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"});
            let container = match (
                op["op"].as_str(),
                path.strip_suffix("/env/-"),
                path.strip_suffix("/env"),
            ) {
                (Some("add"), Some(c), _) if op["value"] == entry => c,
                (Some("add"), _, Some(c)) if op["value"] == json!([entry]) => c,
                _ => panic!("not the void rule's: {op}"),
            };
            out.push(container.to_owned());
        }
        out
    }

    /// `pod` with the patch applied (a copy of `pod` when there is no patch).
    pub fn apply(&self, pod: &Value) -> Value {
        let mut out = pod.clone();
        if let Some(patch) = &self.patch {
            json_patch::patch(&mut out, &patch.0).unwrap_or_else(|e| {
                panic!(
                    "patch does not apply: {e}\npatch: {}\npod: {pod:#}",
                    serde_json::to_string_pretty(patch).unwrap()
                )
            });
        }
        out
    }
}

/// Runs `body` through `handle_review` and decodes the answer, checking the envelope.
pub fn answer(body: &[u8], source: &dyn PolicySource) -> Answer {
    let (bytes, summary) = handle_review(body, source);
    let review: Value = serde_json::from_slice(&bytes).expect("the answer is JSON");
    assert_eq!(review["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(review["kind"], "AdmissionReview");
    assert_eq!(review["response"]["uid"], json!(summary.uid));
    let patch = review["response"]["patch"].as_str().map(|b64| {
        assert_eq!(review["response"]["patchType"], "JSONPatch");
        let bytes = base64_decode(b64);
        serde_json::from_slice::<json_patch::Patch>(&bytes).expect("the patch is RFC 6902")
    });
    Answer {
        review,
        summary,
        patch,
    }
}

/// Reviews `pod` (CREATE in `namespace`).
pub fn review_pod(pod: &Value, namespace: &str, source: &dyn PolicySource) -> Answer {
    answer(&create_review(pod, namespace), source)
}

/// Reviews `pod`, applies the patch, checks the result is a Pod and that a second pass is a
/// no-op; returns the answer and the patched pod.
pub fn rewrite(pod: &Value, namespace: &str, source: &dyn PolicySource) -> (Answer, Value) {
    let first = review_pod(pod, namespace, source);
    let patched = first.apply(pod);
    serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(patched.clone())
        .unwrap_or_else(|e| panic!("patched pod is not a Pod: {e}\n{patched:#}"));
    let second = review_pod(&patched, namespace, source);
    assert!(
        second.patch.is_none(),
        "second pass is not a no-op: {}",
        serde_json::to_string(&second.patch).unwrap()
    );
    (first, patched)
}

pub fn base64_decode(s: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = 0u32;
    let mut bits = 0;
    for c in s.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' => continue,
            _ => panic!("not base64: {c}"),
        };
        buf = (buf << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((buf >> bits) as u8);
            buf &= (1 << bits) - 1;
        }
    }
    out
}

/// The built-in default policy with generation 1.
pub fn default_policy() -> GpuPolicy {
    let mut p = GpuPolicy::default_policy();
    p.metadata.generation = Some(1);
    p
}

/// A policy named `name` with the default spec, changed by `f`.
pub fn policy(name: &str, f: impl FnOnce(&mut GpuPolicy)) -> GpuPolicy {
    let mut p = default_policy();
    p.metadata.name = Some(name.to_owned());
    f(&mut p);
    p
}

/// A privileged training pod: one container with `NVIDIA_VISIBLE_DEVICES=all`.
pub fn training_pod() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "train", "namespace": "ml", "labels": {"app": "train"}},
        "spec": {
            "serviceAccountName": "trainer",
            "containers": [{
                "name": "trainer",
                "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                "command": ["python", "train.py"],
                "env": [
                    {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                    {"name": "EPOCHS", "value": "10"}
                ],
                "resources": {"requests": {"cpu": "4", "memory": "16Gi"}},
                "securityContext": {"privileged": true}
            }]
        }
    })
}
