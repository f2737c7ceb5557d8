//! Bad input always gets an AdmissionReview back: never a panic, never a hang.

mod engine_support;

use engine_support::*;
use gpuwarden_webhook::admission::{Outcome, StaticSource};
use serde_json::{Value, json};

fn source() -> StaticSource {
    StaticSource::new([default_policy()])
}

fn invalid(body: &[u8]) -> Answer {
    let a = answer(body, &source());
    assert!(!a.allowed());
    assert_eq!(a.summary.outcome, Outcome::Invalid);
    assert_eq!(a.response()["status"]["code"], 400);
    a
}

#[test]
fn not_json() {
    for body in [
        &b""[..],
        b"not json",
        b"{\"apiVersion\":",
        b"\xff\xfe\x00garbage",
        b"<xml/>",
    ] {
        let a = invalid(body);
        assert!(a.message().contains("not JSON"), "{}", a.message());
        assert_eq!(a.summary.uid, "");
    }
}

#[test]
fn json_that_is_not_an_admission_review() {
    for body in [
        &b"[]"[..],
        b"42",
        b"null",
        b"\"AdmissionReview\"",
        b"{}",
        br#"{"kind":"Pod"}"#,
    ] {
        let a = invalid(body);
        assert!(
            a.message()
                .contains("not an admission.k8s.io/v1 AdmissionReview"),
            "{}",
            a.message()
        );
    }
    // Wrong field types still echo the uid when one can be found.
    let a = invalid(br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u-1","operation":7}}"#);
    assert_eq!(a.summary.uid, "u-1");
}

#[test]
fn missing_request_uid_and_object() {
    let a = invalid(br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#);
    assert!(a.message().contains("no request"), "{}", a.message());

    let mut review: Value = serde_json::from_slice(&create_review(&training_pod(), "ml")).unwrap();
    review["request"].as_object_mut().unwrap().remove("uid");
    let a = invalid(&serde_json::to_vec(&review).unwrap());
    assert!(a.message().contains("no uid"), "{}", a.message());

    for object in [Value::Null, json!("pod"), json!([1])] {
        let mut review: Value =
            serde_json::from_slice(&create_review(&training_pod(), "ml")).unwrap();
        review["request"]["object"] = object;
        let a = invalid(&serde_json::to_vec(&review).unwrap());
        assert!(
            a.message().contains("no pod in request.object"),
            "{}",
            a.message()
        );
        assert_eq!(a.summary.uid, "705ab4f5-6393-11e8-b7cc-42010a800002");
    }

    let old = training_pod();
    let mut review: Value = serde_json::from_slice(&ephemeral_review(&old, &old, "ml")).unwrap();
    review["request"]["oldObject"] = Value::Null;
    let a = invalid(&serde_json::to_vec(&review).unwrap());
    assert!(a.message().contains("oldObject"), "{}", a.message());
}

#[test]
fn a_review_of_something_that_is_not_a_pod() {
    let mut review: Value = serde_json::from_slice(&create_review(&training_pod(), "ml")).unwrap();
    review["request"]["kind"] = json!({"group": "apps", "version": "v1", "kind": "Deployment"});
    review["request"]["resource"] =
        json!({"group": "apps", "version": "v1", "resource": "deployments"});
    let a = invalid(&serde_json::to_vec(&review).unwrap());
    assert!(
        a.message().contains("Deployment.apps, not a Pod"),
        "{}",
        a.message()
    );

    review["request"].as_object_mut().unwrap().remove("kind");
    review["request"]
        .as_object_mut()
        .unwrap()
        .remove("resource");
    invalid(&serde_json::to_vec(&review).unwrap());
}

#[test]
fn delete_and_other_operations_are_allowed_unchanged() {
    for (op, sub) in [
        ("DELETE", None),
        ("CONNECT", Some("exec")),
        ("UPDATE", None),
        ("UPDATE", Some("status")),
    ] {
        let mut review: Value =
            serde_json::from_slice(&create_review(&training_pod(), "ml")).unwrap();
        review["request"]["operation"] = json!(op);
        if let Some(sub) = sub {
            review["request"]["subResource"] = json!(sub);
        }
        if op == "DELETE" {
            review["request"]["oldObject"] = review["request"]["object"].take();
        }
        let a = answer(&serde_json::to_vec(&review).unwrap(), &source());
        assert!(a.allowed(), "{op} {sub:?}");
        assert!(a.patch.is_none());
        assert_eq!(a.summary.outcome, Outcome::Allowed);
    }
}

#[test]
fn a_three_mebibyte_body_is_answered() {
    // A pod with 3 MiB of annotations: judged normally.
    let mut pod = training_pod();
    pod["metadata"]["annotations"] = json!({"blob": "x".repeat(3 * 1024 * 1024)});
    let body = create_review(&pod, "ml");
    assert!(body.len() > 3 * 1024 * 1024);
    let started = std::time::Instant::now();
    let (answer, _) = rewrite(&pod, "ml", &source());
    assert_eq!(answer.summary.outcome, Outcome::Rewritten);
    // Not a timing assertion: a generous bound only catches a hang or quadratic blow-up.
    assert!(started.elapsed() < std::time::Duration::from_secs(30));

    // 3 MiB of garbage and 3 MiB of nesting: rejected, not a stack overflow.
    invalid(&vec![b'x'; 3 * 1024 * 1024]);
    let mut nested = Vec::new();
    nested.extend(std::iter::repeat_n(b'[', 1024 * 1024));
    nested.extend(std::iter::repeat_n(b']', 1024 * 1024));
    invalid(&nested);
}

#[test]
fn odd_but_valid_pods_do_not_panic() {
    // Wrong types in fields the engine reads are ignored, not trusted and not a panic.
    let pod = json!({
        "metadata": {"name": "odd", "generateName": 7, "annotations": {"gpuwarden.io/gpu-count": 3, "cdi.k8s.io/x": null}, "labels": ["x"]},
        "spec": {
            "serviceAccountName": 1,
            "volumes": [{"name": "d", "hostPath": {"path": "/dev"}}, {"hostPath": {"path": "/dev/nvidia0"}}, 5],
            "containers": [
                {"name": "a", "securityContext": {"privileged": true}, "volumeMounts": [{"name": "d"}, "x"],
                 "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"configMapKeyRef": {"name": "gpus", "key": "ids"}}}, 3],
                 "resources": {"limits": "lots"}},
                "not a container",
                {"securityContext": {"privileged": "yes"}}
            ],
            "initContainers": {"not": "a list"}
        }
    });
    let a = review_pod(&pod, "ml", &source());
    // The count annotation is not a string: a clear denial naming it.
    assert!(!a.allowed());
    assert!(
        a.message().contains("gpuwarden.io/gpu-count"),
        "{}",
        a.message()
    );
}

#[test]
fn mangled_reviews_always_get_an_answer() {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    // Truncations, byte flips and splices of a real review: each must come back as a review
    // (allowed, denied or invalid), never a panic.
    let mut pod = training_pod();
    pod["spec"]["volumes"] = json!([{"name": "d", "hostPath": {"path": "/dev/nvidia0"}}]);
    pod["spec"]["containers"][0]["volumeMounts"] =
        json!([{"name": "d", "mountPath": "/dev/nvidia0"}]);
    let body = create_review(&pod, "ml");
    let mut rng = StdRng::seed_from_u64(42);
    let noise = [
        b'"', b'{', b'}', b'[', b']', b',', b':', b'0', b'n', b'\\', 0xff,
    ];
    for _ in 0..3000 {
        let mut b = body.clone();
        match rng.random_range(0..3) {
            0 => b.truncate(rng.random_range(0..body.len())),
            1 => {
                for _ in 0..rng.random_range(1..4) {
                    let i = rng.random_range(0..b.len());
                    b[i] = noise[rng.random_range(0..noise.len())];
                }
            }
            _ => {
                let (i, j) = (rng.random_range(0..b.len()), rng.random_range(0..b.len()));
                let (i, j) = (i.min(j), i.max(j));
                b.drain(i..j);
            }
        }
        let (out, summary) = gpuwarden_webhook::admission::handle_review(&b, &source());
        let review: Value = serde_json::from_slice(&out).expect("always a JSON review");
        assert_eq!(review["kind"], "AdmissionReview");
        assert_eq!(review["response"]["uid"], json!(summary.uid));
    }
}
