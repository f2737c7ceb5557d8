//! The RFC 6902 patch written for the engine's changes: parents created, tokens escaped,
//! list entries removed from the highest index down.

use gpuwarden_webhook::engine::{AnnotationValue, Change, ContainerKind, ContainerRef, Quantity};
use gpuwarden_webhook::patch::patch_for;
use gpuwarden_webhook::pod::Scalar;
use serde_json::{Value, json};

fn regular(index: usize) -> ContainerRef {
    ContainerRef {
        kind: ContainerKind::Regular,
        index,
    }
}

fn written(pod: &Value, changes: &[Change<'_>]) -> Value {
    serde_json::to_value(patch_for(pod, changes.iter().copied())).unwrap()
}

#[test]
fn missing_parents_are_created_and_tokens_escaped() {
    // Container 0 has no securityContext or resources, container 1 a non-object
    // securityContext and resources without limits; the pod has no metadata.
    let pod = json!({"spec": {"containers": [
        {"name": "c0"},
        {"name": "c1", "securityContext": "odd", "resources": {"requests": {}}, "env": null}
    ]}});
    let pairs = [
        Some(("x/y", AnnotationValue::Text("2"))),
        Some(("a~b", AnnotationValue::Text("1"))),
    ];
    let changes = [
        Change::SecurityContext {
            container: regular(0),
            add: &[],
            drop_all: false,
            seccomp_default: false,
        },
        Change::SecurityContext {
            container: regular(1),
            add: &["IPC_LOCK".into()],
            drop_all: true,
            seccomp_default: true,
        },
        Change::GpuLimit {
            container: regular(0),
            resource: "a/b~c",
            quantity: Quantity::Count(1),
        },
        Change::GpuLimit {
            container: regular(1),
            resource: "nvidia.com/gpu",
            quantity: Quantity::Copied(&Scalar::Other(json!(2))),
        },
        Change::Env {
            container: regular(1),
            remove: &[],
            append: Some(("K", "v\"1")),
        },
        Change::SetAnnotations { pairs },
    ];
    let patch = written(&pod, &changes);
    assert_eq!(
        patch,
        json!([
            {"op": "add", "path": "/spec/containers/0/securityContext",
             "value": {"capabilities": {}, "privileged": false}},
            {"op": "add", "path": "/spec/containers/1/securityContext",
             "value": {"allowPrivilegeEscalation": false,
                       "capabilities": {"add": ["IPC_LOCK"], "drop": ["ALL"]}, "privileged": false,
                       "seccompProfile": {"type": "RuntimeDefault"}}},
            {"op": "add", "path": "/spec/containers/0/resources", "value": {"limits": {"a/b~c": "1"}}},
            {"op": "add", "path": "/spec/containers/1/resources/limits", "value": {"nvidia.com/gpu": "2"}},
            {"op": "add", "path": "/spec/containers/1/env", "value": [{"name": "K", "value": "v\"1"}]},
            {"op": "add", "path": "/metadata", "value": {"annotations": {"a~b": "1", "x/y": "2"}}}
        ])
    );
    let mut applied = pod.clone();
    json_patch::patch(&mut applied, &patch_for(&pod, changes)).unwrap();
    assert_eq!(applied["metadata"]["annotations"]["a~b"], "1");
}

#[test]
fn existing_parents_get_leaf_operations() {
    let pod = json!({
        "metadata": {"annotations": {"cdi.k8s.io/gpu": "nvidia.com/gpu=0"}},
        "spec": {
            "volumes": [{"name": "a"}, {"name": "b"}],
            "containers": [{
                "name": "c0",
                "securityContext": {"privileged": true, "capabilities": {"drop": ["NET_RAW"]}},
                "resources": {"limits": {"cpu": "1"}},
                "env": [{"name": "A"}, {"name": "B"}, {"name": "C"}],
                "volumeMounts": [{"name": "a"}, {"name": "b"}]
            }]
        }
    });
    let pairs = [
        Some(("gpuwarden.io/policy", AnnotationValue::Text("p@1"))),
        Some(("a~b/c", AnnotationValue::Text("\n"))),
    ];
    let changes = [
        Change::SecurityContext {
            container: regular(0),
            add: &[],
            drop_all: false,
            seccomp_default: false,
        },
        Change::GpuLimit {
            container: regular(0),
            resource: "nvidia.com/gpu",
            quantity: Quantity::Copied(&Scalar::Str("1".into())),
        },
        Change::Env {
            container: regular(0),
            remove: &[0, 2],
            append: Some(("D", "d")),
        },
        Change::VolumeMounts {
            container: regular(0),
            remove: &[1],
        },
        Change::Volumes { remove: &[1] },
        Change::RemoveAnnotations {
            keys: &["cdi.k8s.io/gpu", "cdi.k8s.io/absent"],
        },
        Change::SetAnnotations { pairs },
    ];
    assert_eq!(
        written(&pod, &changes),
        json!([
            {"op": "add", "path": "/spec/containers/0/securityContext/privileged", "value": false},
            {"op": "add", "path": "/spec/containers/0/securityContext/capabilities", "value": {"drop": ["NET_RAW"]}},
            {"op": "add", "path": "/spec/containers/0/resources/limits/nvidia.com~1gpu", "value": "1"},
            {"op": "remove", "path": "/spec/containers/0/env/2"},
            {"op": "remove", "path": "/spec/containers/0/env/0"},
            {"op": "add", "path": "/spec/containers/0/env/-", "value": {"name": "D", "value": "d"}},
            {"op": "remove", "path": "/spec/containers/0/volumeMounts/1"},
            {"op": "remove", "path": "/spec/volumes/1"},
            {"op": "remove", "path": "/metadata/annotations/cdi.k8s.io~1gpu"},
            {"op": "add", "path": "/metadata/annotations/gpuwarden.io~1policy", "value": "p@1"},
            {"op": "add", "path": "/metadata/annotations/a~0b~1c", "value": "\n"}
        ])
    );
}

#[test]
fn an_annotations_object_holds_the_last_of_a_repeated_key() {
    let pod = json!({"metadata": {}});
    for (pairs, expected) in [
        (
            [
                Some(("k", AnnotationValue::Text("1"))),
                Some(("k", AnnotationValue::Text("2"))),
            ],
            json!({"k": "2"}),
        ),
        (
            [None, Some(("k", AnnotationValue::Text("2")))],
            json!({"k": "2"}),
        ),
        (
            [Some(("b", AnnotationValue::Text("1"))), None],
            json!({"b": "1"}),
        ),
    ] {
        let patch = written(&pod, &[Change::SetAnnotations { pairs }]);
        assert_eq!(
            patch,
            json!([{"op": "add", "path": "/metadata/annotations", "value": expected}])
        );
    }
}

#[test]
fn changes_already_in_place_write_an_empty_patch() {
    let pod = json!({"metadata": {}, "spec": {}});
    let changes = [
        Change::SetAnnotations {
            pairs: [None, None],
        },
        Change::RemoveAnnotations { keys: &["k"] },
        Change::Volumes { remove: &[] },
    ];
    assert!(patch_for(&pod, changes).0.is_empty());
}
