//! The AdmissionReview adapter: answers borrowed from the body, sources that copy or lend,
//! refused bodies, and the patch the answer carries.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpuwarden_crds::GpuPolicy;
use gpuwarden_webhook::admission::{
    Outcome, PolicyReader, PolicySource, StaticSource, handle_review,
};
use gpuwarden_webhook::engine::{self, Input, Operation, Verdict};
use gpuwarden_webhook::patch;
use gpuwarden_webhook::pod::PodView;
use serde_json::Value;

/// The patch `handle_review` answers with, decoded; `None` when there is none.
fn answered_patch(review: &Value, source: &StaticSource) -> Option<Value> {
    let (out, _) = handle_review(&serde_json::to_vec(review).unwrap(), source);
    let out: Value = serde_json::from_slice(&out).unwrap();
    let encoded = out["response"]["patch"].as_str()?;
    let bytes = base64_simd::STANDARD.decode_to_vec(encoded).unwrap();
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
fn a_field_named_twice_is_refused_with_its_name() {
    // The API server writes reviews from typed objects, so a repeated key never comes
    // from it; a body that has one is refused, naming the field, rather than guessed at.
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
    let (_, summary) = handle_review(body(last).as_bytes(), &source);
    assert_eq!(summary.outcome, Outcome::Rewritten);
    let (answer, summary) = handle_review(body(&repeated).as_bytes(), &source);
    assert_eq!(summary.outcome, Outcome::Invalid);
    assert_eq!(summary.uid, "u");
    let answer: Value = serde_json::from_slice(&answer).unwrap();
    let message = answer["response"]["status"]["message"].as_str().unwrap();
    assert!(
        message.contains("duplicate field `securityContext`"),
        "{message}"
    );
}

#[test]
fn a_body_that_is_not_utf8_is_read_as_bytes() {
    // Invalid UTF-8 in a field the engine skips does not matter, as for any JSON reader
    // that skips it; in a field it reads, the review is refused as not JSON.
    let body = |image: &[u8], annotation: &[u8]| {
        let mut body = br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{
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
        claims: &gpuwarden_webhook::engine::NoClaims("no claims here"),
        owner_kind: None,
        requester: engine::Requester::Unknown,
    };
    let decision = engine::decide(&input, &source.policies);
    assert_eq!(decision.verdict(), Verdict::Rewritten);
    let whole = serde_json::to_value(patch::patch_for(&pod, decision.changes())).unwrap();
    assert_eq!(answered_patch(&review, &source), Some(whole));
}
