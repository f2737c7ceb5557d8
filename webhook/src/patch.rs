//! The RFC 6902 patch for the engine's [`Change`]s, written straight to JSON bytes:
//! pointers escaped (`~0`, `~1`), missing parents created, list entries removed by index from
//! the highest down (so no removal shifts the index of a later one). The admission path sends
//! these bytes as they are; [`patch_for`] reads them back as a [`json_patch::Patch`] for the
//! offline command and the tests, so both see the one patch.

use std::borrow::Cow;

use serde_json::Value;

use crate::engine::{AnnotationValue, Change, ContainerRef, container_value};
use crate::json_out;
use crate::pod::{PodView, SecurityContext};

/// One reference token of a JSON pointer.
#[derive(Clone, Copy)]
enum Token<'a> {
    /// A field name of the Pod API, written as it is: ASCII letters only.
    Field(&'static str),
    /// An object key from the pod or the policy (escaped when written).
    Key(&'a str),
    /// A list index.
    Index(usize),
    /// `-`: past the end of a list.
    End,
}
use Token::{End, Field, Index, Key};

/// The patch's operations, written one after another into a JSON array.
struct Ops<'o> {
    out: &'o mut Vec<u8>,
    count: usize,
}

impl Ops<'_> {
    /// Writes `{"op":"<op>","path":"<base><rest>"`, the object left open: `header` is the
    /// part up to the path's opening quote, `base` a pointer already written ([`Base`]).
    fn open(&mut self, header: &[u8], base: &[u8], rest: &[Token<'_>]) {
        let out = &mut *self.out;
        if self.count > 0 {
            out.push(b',');
        }
        self.count += 1;
        out.extend_from_slice(header);
        out.extend_from_slice(base);
        write_tokens(out, rest);
        out.push(b'"');
    }

    /// An `add` whose value `value` writes.
    fn add(&mut self, base: &[u8], rest: &[Token<'_>], value: impl FnOnce(&mut Vec<u8>)) {
        self.open(b"{\"op\":\"add\",\"path\":\"", base, rest);
        self.out.extend_from_slice(b",\"value\":");
        value(self.out);
        self.out.push(b'}');
    }

    fn remove(&mut self, base: &[u8], rest: &[Token<'_>]) {
        self.open(b"{\"op\":\"remove\",\"path\":\"", base, rest);
        self.out.push(b'}');
    }
}

/// Writes each token of a pointer after a `/`.
fn write_tokens(out: &mut Vec<u8>, tokens: &[Token<'_>]) {
    for token in tokens {
        out.push(b'/');
        match *token {
            Field(name) => {
                debug_assert!(name.bytes().all(|b| b.is_ascii_alphabetic()));
                out.extend_from_slice(name.as_bytes());
            }
            Key(key) => pointer_token(out, key),
            Index(i) => json_out::number(out, i as u64),
            End => out.push(b'-'),
        }
    }
}

/// The pointer to a container, `/spec/<list>/<index>`, written once for all the
/// operations on it.
struct Base {
    bytes: [u8; 64],
    len: usize,
}

impl Base {
    fn container(at: &ContainerRef) -> Self {
        let mut base = Self {
            bytes: [0; 64],
            len: 0,
        };
        // At most 6 + 19 + 1 + 20 bytes: it fits.
        base.push(b"/spec/");
        base.push(at.kind.field().as_bytes());
        base.push(b"/");
        base.push(json_out::decimal(at.index as u64, &mut [0; 20]));
        base
    }

    fn push(&mut self, bytes: &[u8]) {
        if let Some(slot) = self.bytes.get_mut(self.len..self.len + bytes.len()) {
            slot.copy_from_slice(bytes);
            self.len += bytes.len();
        }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// A pointer token inside a JSON string: `~` → `~0`, `/` → `~1` (RFC 6901), then JSON
/// escaping.
fn pointer_token(out: &mut Vec<u8>, token: &str) {
    let mut rest = token;
    while let Some(i) = rest.bytes().position(|b| b == b'~' || b == b'/') {
        json_out::str_contents(out, &rest[..i]);
        out.extend_from_slice(if rest.as_bytes()[i] == b'~' {
            b"~0"
        } else {
            b"~1"
        });
        rest = &rest[i + 1..];
    }
    json_out::str_contents(out, rest);
}

/// `{"add":[...],"drop":[...]}` for `securityContext.capabilities`: `drop` is `["ALL"]`, or
/// the container's current `capabilities.drop` when the change leaves it as it is.
fn capabilities(
    out: &mut Vec<u8>,
    add: &[Cow<'_, str>],
    drop_all: bool,
    current: Option<&SecurityContext<'_>>,
) {
    out.push(b'{');
    if !add.is_empty() {
        out.extend_from_slice(b"\"add\":");
        json_out::string_array(out, add.iter().map(AsRef::as_ref));
    }
    let current_drop = current
        .and_then(|s| s.capabilities.as_ref())
        .and_then(|c| c.drop.as_ref());
    if drop_all || current_drop.is_some() {
        if !add.is_empty() {
            out.push(b',');
        }
        out.extend_from_slice(b"\"drop\":");
        match current_drop {
            Some(current) if !drop_all => json_out::value(out, current),
            _ => out.extend_from_slice(b"[\"ALL\"]"),
        }
    }
    out.push(b'}');
}

/// Edits a list in place: removes entries by index (highest first, so that each index still
/// names the entry it named in the original), then appends `{"name","value"}` entries. A
/// missing list is created.
fn list_edit(
    ops: &mut Ops<'_>,
    is_list: bool,
    base: &[u8],
    field: &'static str,
    remove_ascending: &[usize],
    append: Option<(&str, &str)>,
) {
    let entry = |out: &mut Vec<u8>, (name, value): (&str, &str)| {
        json_out::string_object(out, [("name", name), ("value", value)]);
    };
    if !is_list {
        if let Some(pair) = append {
            ops.add(base, &[Field(field)], |out| {
                out.push(b'[');
                entry(out, pair);
                out.push(b']');
            });
        }
        return;
    }
    for &i in remove_ascending.iter().rev() {
        ops.remove(base, &[Field(field), Index(i)]);
    }
    if let Some(pair) = append {
        ops.add(base, &[Field(field), End], |out| entry(out, pair));
    }
}

/// Appends the patch that applies `changes` to `pod` to `out`, as a JSON array; returns how
/// many operations it holds (0: the changes are already in the pod).
pub fn write_patch<'c>(
    pod: &PodView<'_>,
    changes: impl IntoIterator<Item = Change<'c>>,
    out: &mut Vec<u8>,
) -> usize {
    out.push(b'[');
    let mut ops = Ops {
        out: &mut *out,
        count: 0,
    };
    for change in changes {
        match change {
            Change::SecurityContext {
                container,
                add,
                drop_all,
            } => {
                let base = Base::container(&container);
                let base = base.as_bytes();
                let current =
                    container_value(pod, &container).and_then(|c| c.security_context.as_ref());
                if current.is_some() {
                    let falsy = |out: &mut Vec<u8>| out.extend_from_slice(b"false");
                    ops.add(
                        base,
                        &[Field("securityContext"), Field("privileged")],
                        falsy,
                    );
                    ops.add(
                        base,
                        &[Field("securityContext"), Field("allowPrivilegeEscalation")],
                        falsy,
                    );
                    ops.add(
                        base,
                        &[Field("securityContext"), Field("capabilities")],
                        |out| {
                            capabilities(out, add, drop_all, current);
                        },
                    );
                } else {
                    ops.add(base, &[Field("securityContext")], |out| {
                        out.extend_from_slice(
                            b"{\"allowPrivilegeEscalation\":false,\"capabilities\":",
                        );
                        capabilities(out, add, drop_all, None);
                        out.extend_from_slice(b",\"privileged\":false}");
                    });
                }
            }
            Change::GpuLimit {
                container,
                resource,
                quantity,
            } => {
                let base = Base::container(&container);
                let base = base.as_bytes();
                let resources = container_value(pod, &container).and_then(|c| c.resources.as_ref());
                let limits = resources.and_then(|r| r.limits.as_ref());
                let limit = |out: &mut Vec<u8>| {
                    out.push(b'{');
                    json_out::string(out, resource);
                    out.push(b':');
                    quantity.with_text(|text| json_out::string(out, text));
                    out.push(b'}');
                };
                if resources.is_none() {
                    ops.add(base, &[Field("resources")], |out| {
                        out.extend_from_slice(b"{\"limits\":");
                        limit(out);
                        out.push(b'}');
                    });
                } else if limits.is_none() {
                    ops.add(base, &[Field("resources"), Field("limits")], limit);
                } else {
                    ops.add(
                        base,
                        &[Field("resources"), Field("limits"), Key(resource)],
                        |out| quantity.with_text(|text| json_out::string(out, text)),
                    );
                }
            }
            Change::Env {
                container,
                remove,
                append,
            } => {
                let is_list = container_value(pod, &container).is_some_and(|c| c.env.is_some());
                let base = Base::container(&container);
                let base = base.as_bytes();
                list_edit(&mut ops, is_list, base, "env", remove, append);
            }
            Change::VolumeMounts { container, remove } => {
                let is_list =
                    container_value(pod, &container).is_some_and(|c| c.volume_mounts.is_some());
                let base = Base::container(&container);
                let base = base.as_bytes();
                list_edit(&mut ops, is_list, base, "volumeMounts", remove, None);
            }
            Change::Volumes { remove } => {
                let is_list = pod.spec.as_ref().is_some_and(|s| s.volumes.is_some());
                list_edit(&mut ops, is_list, b"/spec", "volumes", remove, None);
            }
            Change::RemoveAnnotations { keys } => {
                let annotations = pod.annotations();
                for key in keys {
                    if annotations.is_some_and(|a| a.contains_key(key)) {
                        ops.remove(b"/metadata/annotations", &[Key(key)]);
                    }
                }
            }
            Change::SetAnnotations { pairs } => {
                if pairs.iter().all(Option::is_none) {
                    continue;
                }
                let metadata = pod.metadata.as_ref();
                let has_annotations = pod.annotations().is_some();
                if metadata.is_none() {
                    ops.add(b"/metadata", &[], |out| {
                        out.extend_from_slice(b"{\"annotations\":");
                        annotations_object(out, &pairs);
                        out.push(b'}');
                    });
                } else if !has_annotations {
                    ops.add(b"/metadata/annotations", &[], |out| {
                        annotations_object(out, &pairs)
                    });
                } else {
                    for (k, v) in pairs.iter().flatten() {
                        ops.add(b"/metadata/annotations", &[Key(k)], |out| {
                            annotation_value(out, v)
                        });
                    }
                }
            }
        }
    }
    let count = ops.count;
    out.push(b']');
    count
}

/// `pairs` as a JSON object: keys sorted, the last of a repeated key wins.
fn annotations_object(out: &mut Vec<u8>, pairs: &[Option<(&str, AnnotationValue<'_>)>; 2]) {
    let entries = match pairs {
        [Some(a), Some(b)] if a.0 == b.0 => [None, Some(b)],
        [Some(a), Some(b)] if b.0 < a.0 => [Some(b), Some(a)],
        [a, b] => [a.as_ref(), b.as_ref()],
    };
    out.push(b'{');
    for (i, (key, value)) in entries.into_iter().flatten().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        json_out::string(out, key);
        out.push(b':');
        annotation_value(out, value);
    }
    out.push(b'}');
}

/// An annotation's value, as a JSON string.
fn annotation_value(out: &mut Vec<u8>, value: &AnnotationValue<'_>) {
    match value {
        AnnotationValue::Text(text) => json_out::string(out, text),
        AnnotationValue::Report(report) => {
            out.push(b'"');
            report.write_escaped(out);
            out.push(b'"');
        }
    }
}

/// [`write_patch`] for a pod held as a `Value`, read back as a [`json_patch::Patch`]. An
/// error would mean the writer produced text that is not a patch: a bug, reported rather
/// than hidden.
pub fn patch_for<'c>(
    pod: &Value,
    changes: impl IntoIterator<Item = Change<'c>>,
) -> Result<json_patch::Patch, serde_json::Error> {
    let mut out = Vec::new();
    write_patch(&PodView::from_value(pod), changes, &mut out);
    serde_json::from_slice(&out)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::engine::{ContainerKind, Quantity};
    use crate::pod::Scalar;

    fn at(index: usize) -> ContainerRef {
        ContainerRef {
            kind: ContainerKind::Regular,
            index,
        }
    }

    fn written(pod: &Value, changes: &[Change<'_>]) -> Value {
        let mut out = Vec::new();
        let count = write_patch(&PodView::from_value(pod), changes.iter().copied(), &mut out);
        let patch: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(patch.as_array().map(Vec::len), Some(count));
        patch
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
                container: at(0),
                add: &[],
                drop_all: false,
            },
            Change::SecurityContext {
                container: at(1),
                add: &["IPC_LOCK".into()],
                drop_all: true,
            },
            Change::GpuLimit {
                container: at(0),
                resource: "a/b~c",
                quantity: Quantity::Count(1),
            },
            Change::GpuLimit {
                container: at(1),
                resource: "nvidia.com/gpu",
                quantity: Quantity::Copied(&Scalar::Other(json!(2))),
            },
            Change::Env {
                container: at(1),
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
        json_patch::patch(&mut applied, &patch_for(&pod, changes).unwrap()).unwrap();
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
                container: at(0),
                add: &[],
                drop_all: false,
            },
            Change::GpuLimit {
                container: at(0),
                resource: "nvidia.com/gpu",
                quantity: Quantity::Copied(&Scalar::Str("1".into())),
            },
            Change::Env {
                container: at(0),
                remove: &[0, 2],
                append: Some(("D", "d")),
            },
            Change::VolumeMounts {
                container: at(0),
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
        let mut out = Vec::new();
        assert_eq!(
            write_patch(&PodView::from_value(&pod), changes, &mut out),
            0
        );
        assert_eq!(out, b"[]");
    }
}
