//! The RFC 6902 patch for the engine's [`Change`]s, as a [`json_patch::Patch`]: missing
//! parents created, list entries removed by index from the highest down (so no removal
//! shifts the index of a later one). The admission answer carries this patch and the
//! offline command applies it, so both see the one patch.

use std::borrow::Cow;

use json_patch::jsonptr::{PointerBuf, Token};
use json_patch::{AddOperation, Patch, PatchOperation, RemoveOperation};
use serde_json::{Map, Value, json};

use crate::engine::{AnnotationValue, Change, ContainerRef, container_value};
use crate::pod::{PodView, SecurityContext};

/// The patch's operations, in order.
#[derive(Default)]
struct Ops(Vec<PatchOperation>);

impl Ops {
    fn add(&mut self, path: PointerBuf, value: Value) {
        self.0
            .push(PatchOperation::Add(AddOperation { path, value }));
    }

    fn remove(&mut self, path: PointerBuf) {
        self.0
            .push(PatchOperation::Remove(RemoveOperation { path }));
    }
}

/// `base` followed by `tokens`.
fn at<'t>(base: &PointerBuf, tokens: impl IntoIterator<Item: Into<Token<'t>>>) -> PointerBuf {
    let mut path = base.clone();
    for token in tokens {
        path.push_back(token);
    }
    path
}

/// The pointer to a container: `/spec/<list>/<index>`.
fn container_base(container: &ContainerRef) -> PointerBuf {
    PointerBuf::from_tokens([
        Token::new("spec"),
        Token::new(container.kind.field()),
        Token::from(container.index),
    ])
}

/// `{"add":[...],"drop":[...]}` for `securityContext.capabilities`: `drop` is `["ALL"]`, or
/// the container's current `capabilities.drop` when the change leaves it as it is.
fn capabilities(
    add: &[Cow<'_, str>],
    drop_all: bool,
    current: Option<&SecurityContext<'_>>,
) -> Value {
    let mut out = Map::new();
    if !add.is_empty() {
        out.insert("add".into(), json!(add));
    }
    let current_drop = current
        .and_then(|s| s.capabilities.as_ref())
        .and_then(|c| c.drop.as_ref());
    match current_drop {
        Some(current) if !drop_all => {
            out.insert("drop".into(), current.clone());
        }
        _ if drop_all => {
            out.insert("drop".into(), json!(["ALL"]));
        }
        _ => {}
    }
    Value::Object(out)
}

/// Edits a list in place: removes entries by index (highest first, so that each index still
/// names the entry it named in the original), then appends a `{"name","value"}` entry. A
/// missing list is created.
fn list_edit(
    ops: &mut Ops,
    is_list: bool,
    base: &PointerBuf,
    field: &'static str,
    remove_ascending: &[usize],
    append: Option<(&str, &str)>,
) {
    let entry = |(name, value): (&str, &str)| json!({"name": name, "value": value});
    if !is_list {
        if let Some(pair) = append {
            ops.add(at(base, [field]), json!([entry(pair)]));
        }
        return;
    }
    for &i in remove_ascending.iter().rev() {
        ops.remove(at(base, [Token::new(field), Token::from(i)]));
    }
    if let Some(pair) = append {
        ops.add(at(base, [field, "-"]), entry(pair));
    }
}

/// An annotation's value, as a JSON string.
fn annotation_value(value: &AnnotationValue<'_>) -> Value {
    match value {
        AnnotationValue::Text(text) => Value::from(*text),
        AnnotationValue::Report(report) => Value::from(report.to_json()),
    }
}

/// The patch that applies `changes` to `pod`; empty when the changes are already in it.
pub fn patch_for_view<'c>(
    pod: &PodView<'_>,
    changes: impl IntoIterator<Item = Change<'c>>,
) -> Patch {
    let mut ops = Ops::default();
    for change in changes {
        match change {
            Change::SecurityContext {
                container,
                add,
                drop_all,
            } => {
                let base = container_base(&container);
                let current =
                    container_value(pod, &container).and_then(|c| c.security_context.as_ref());
                let capabilities = capabilities(add, drop_all, current);
                if current.is_some() {
                    let context = at(&base, ["securityContext"]);
                    ops.add(at(&context, ["privileged"]), Value::Bool(false));
                    ops.add(
                        at(&context, ["allowPrivilegeEscalation"]),
                        Value::Bool(false),
                    );
                    ops.add(at(&context, ["capabilities"]), capabilities);
                } else {
                    ops.add(
                        at(&base, ["securityContext"]),
                        json!({
                            "allowPrivilegeEscalation": false,
                            "capabilities": capabilities,
                            "privileged": false,
                        }),
                    );
                }
            }
            Change::GpuLimit {
                container,
                resource,
                quantity,
            } => {
                let base = container_base(&container);
                let resources = container_value(pod, &container).and_then(|c| c.resources.as_ref());
                let limits = resources.and_then(|r| r.limits.as_ref());
                let quantity = quantity.with_text(|text| Value::from(text));
                let limit = json!({ resource: quantity.clone() });
                if resources.is_none() {
                    ops.add(at(&base, ["resources"]), json!({ "limits": limit }));
                } else if limits.is_none() {
                    ops.add(at(&base, ["resources", "limits"]), limit);
                } else {
                    ops.add(at(&base, ["resources", "limits", resource]), quantity);
                }
            }
            Change::Env {
                container,
                remove,
                append,
            } => {
                let is_list = container_value(pod, &container).is_some_and(|c| c.env.is_some());
                list_edit(
                    &mut ops,
                    is_list,
                    &container_base(&container),
                    "env",
                    remove,
                    append,
                );
            }
            Change::VolumeMounts { container, remove } => {
                let is_list =
                    container_value(pod, &container).is_some_and(|c| c.volume_mounts.is_some());
                let base = container_base(&container);
                list_edit(&mut ops, is_list, &base, "volumeMounts", remove, None);
            }
            Change::Volumes { remove } => {
                let is_list = pod.spec.as_ref().is_some_and(|s| s.volumes.is_some());
                let base = PointerBuf::from_tokens(["spec"]);
                list_edit(&mut ops, is_list, &base, "volumes", remove, None);
            }
            Change::RemoveAnnotations { keys } => {
                let annotations = pod.annotations();
                let base = PointerBuf::from_tokens(["metadata", "annotations"]);
                for key in keys {
                    if annotations.is_some_and(|a| a.contains_key(key)) {
                        ops.remove(at(&base, [*key]));
                    }
                }
            }
            Change::SetAnnotations { pairs } => {
                let pairs = pairs.iter().flatten();
                if pod.metadata.is_none() || pod.annotations().is_none() {
                    // A map: the last of a repeated key wins.
                    let object: Map<String, Value> = pairs
                        .map(|(k, v)| ((*k).to_owned(), annotation_value(v)))
                        .collect();
                    if object.is_empty() {
                        continue;
                    }
                    if pod.metadata.is_none() {
                        ops.add(
                            PointerBuf::from_tokens(["metadata"]),
                            json!({ "annotations": object }),
                        );
                    } else {
                        ops.add(
                            PointerBuf::from_tokens(["metadata", "annotations"]),
                            Value::Object(object),
                        );
                    }
                } else {
                    let base = PointerBuf::from_tokens(["metadata", "annotations"]);
                    for (k, v) in pairs {
                        ops.add(at(&base, [*k]), annotation_value(v));
                    }
                }
            }
        }
    }
    Patch(ops.0)
}

/// [`patch_for_view`] for a pod held as a `Value` (a manifest's pod template).
pub fn patch_for<'c>(pod: &Value, changes: impl IntoIterator<Item = Change<'c>>) -> Patch {
    patch_for_view(&PodView::from_value(pod), changes)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::engine::{ContainerKind, Quantity};
    use crate::pod::Scalar;

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
            },
            Change::SecurityContext {
                container: regular(1),
                add: &["IPC_LOCK".into()],
                drop_all: true,
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
                 "value": {"allowPrivilegeEscalation": false, "capabilities": {}, "privileged": false}},
                {"op": "add", "path": "/spec/containers/1/securityContext",
                 "value": {"allowPrivilegeEscalation": false,
                           "capabilities": {"add": ["IPC_LOCK"], "drop": ["ALL"]}, "privileged": false}},
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
                {"op": "add", "path": "/spec/containers/0/securityContext/allowPrivilegeEscalation", "value": false},
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
}
