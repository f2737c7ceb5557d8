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
        ops.change(pod, change);
    }
    Patch(ops.0)
}

impl Ops {
    /// The operations for one change to `pod`.
    fn change(&mut self, pod: &PodView<'_>, change: Change<'_>) {
        match change {
            Change::SecurityContext {
                container,
                add,
                drop_all,
                seccomp_default,
            } => self.security_context(pod, &container, add, drop_all, seccomp_default),
            Change::GpuLimit {
                container,
                resource,
                quantity,
            } => {
                let quantity = quantity.with_text(|text| Value::from(text));
                self.gpu_limit(pod, &container, resource, quantity);
            }
            Change::ClaimUse { container, claim } => self.claim_use(pod, &container, claim),
            Change::PodClaims { add } => {
                let entries = add
                    .iter()
                    .map(|c| json!({"name": c.name, "resourceClaimTemplateName": c.template}));
                self.pod_claims(pod, entries);
            }
            Change::Env {
                container,
                remove,
                append,
            } => {
                let is_list = container_value(pod, &container).is_some_and(|c| c.env.is_some());
                list_edit(
                    self,
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
                list_edit(self, is_list, &base, "volumeMounts", remove, None);
            }
            Change::Volumes { remove } => {
                let is_list = pod.spec.as_ref().is_some_and(|s| s.volumes.is_some());
                let base = PointerBuf::from_tokens(["spec"]);
                list_edit(self, is_list, &base, "volumes", remove, None);
            }
            Change::RemoveAnnotations { keys } => self.remove_annotations(pod, keys),
            Change::SetAnnotations { pairs } => {
                let pairs = (pairs.iter().flatten()).map(|(k, v)| (*k, annotation_value(v)));
                self.set_annotations(pod, pairs);
            }
        }
    }

    /// `container` unprivileged, with capabilities `add`; the other fields of a
    /// `securityContext` it has stay.
    fn security_context(
        &mut self,
        pod: &PodView<'_>,
        container: &ContainerRef,
        add: &[Cow<'_, str>],
        drop_all: bool,
        seccomp_default: bool,
    ) {
        let base = container_base(container);
        let current = container_value(pod, container).and_then(|c| c.security_context.as_ref());
        let capabilities = capabilities(add, drop_all, current);
        let seccomp = json!({"type": "RuntimeDefault"});
        if current.is_some() {
            let context = at(&base, ["securityContext"]);
            self.add(at(&context, ["privileged"]), Value::Bool(false));
            if drop_all {
                self.add(
                    at(&context, ["allowPrivilegeEscalation"]),
                    Value::Bool(false),
                );
            }
            self.add(at(&context, ["capabilities"]), capabilities);
            if seccomp_default {
                self.add(at(&context, ["seccompProfile"]), seccomp);
            }
        } else {
            let mut context = json!({
                "capabilities": capabilities,
                "privileged": false,
            });
            if drop_all {
                context["allowPrivilegeEscalation"] = Value::Bool(false);
            }
            if seccomp_default {
                context["seccompProfile"] = seccomp;
            }
            self.add(at(&base, ["securityContext"]), context);
        }
    }

    /// `resources.limits[resource] = quantity` on `container`.
    fn gpu_limit(
        &mut self,
        pod: &PodView<'_>,
        container: &ContainerRef,
        resource: &str,
        quantity: Value,
    ) {
        let base = container_base(container);
        let resources = container_value(pod, container).and_then(|c| c.resources.as_ref());
        let limits = resources.and_then(|r| r.limits.as_ref());
        let limit = json!({ resource: quantity.clone() });
        if resources.is_none() {
            self.add(at(&base, ["resources"]), json!({ "limits": limit }));
        } else if limits.is_none() {
            self.add(at(&base, ["resources", "limits"]), limit);
        } else {
            self.add(at(&base, ["resources", "limits", resource]), quantity);
        }
    }

    /// `{name: claim}` appended to `container`'s `resources.claims`.
    fn claim_use(&mut self, pod: &PodView<'_>, container: &ContainerRef, claim: &str) {
        let base = container_base(container);
        let resources = container_value(pod, container).and_then(|c| c.resources.as_ref());
        let entry = json!({ "name": claim });
        if resources.is_none() {
            self.add(at(&base, ["resources"]), json!({ "claims": [entry] }));
        } else if resources.is_some_and(|r| r.claims.is_none()) {
            self.add(at(&base, ["resources", "claims"]), json!([entry]));
        } else {
            self.add(at(&base, ["resources", "claims", "-"]), entry);
        }
    }

    /// `entries` appended to the pod's `spec.resourceClaims`.
    fn pod_claims(&mut self, pod: &PodView<'_>, entries: impl Iterator<Item = Value>) {
        let exists = pod
            .spec
            .as_ref()
            .is_some_and(|s| s.resource_claims.is_some());
        if exists {
            for entry in entries {
                self.add(
                    PointerBuf::from_tokens(["spec", "resourceClaims", "-"]),
                    entry,
                );
            }
        } else {
            let list = Value::Array(entries.collect());
            self.add(PointerBuf::from_tokens(["spec", "resourceClaims"]), list);
        }
    }

    /// The pod annotations `keys` removed, where the pod has them.
    fn remove_annotations(&mut self, pod: &PodView<'_>, keys: &[&str]) {
        let annotations = pod.annotations();
        let base = PointerBuf::from_tokens(["metadata", "annotations"]);
        for key in keys {
            if annotations.is_some_and(|a| a.contains_key(key)) {
                self.remove(at(&base, [*key]));
            }
        }
    }

    /// The pod annotations `pairs` set, creating the map (and `metadata`) where missing.
    fn set_annotations<'k>(
        &mut self,
        pod: &PodView<'_>,
        pairs: impl Iterator<Item = (&'k str, Value)>,
    ) {
        if pod.metadata.is_none() || pod.annotations().is_none() {
            // A map: the last of a repeated key wins.
            let object: Map<String, Value> = pairs.map(|(k, v)| (k.to_owned(), v)).collect();
            if object.is_empty() {
                return;
            }
            if pod.metadata.is_none() {
                self.add(
                    PointerBuf::from_tokens(["metadata"]),
                    json!({ "annotations": object }),
                );
            } else {
                self.add(
                    PointerBuf::from_tokens(["metadata", "annotations"]),
                    Value::Object(object),
                );
            }
        } else {
            let base = PointerBuf::from_tokens(["metadata", "annotations"]);
            for (k, v) in pairs {
                self.add(at(&base, [k]), v);
            }
        }
    }
}

/// [`patch_for_view`] for a pod held as a `Value` (a manifest's pod template).
pub fn patch_for<'c>(pod: &Value, changes: impl IntoIterator<Item = Change<'c>>) -> Patch {
    patch_for_view(&PodView::from_value(pod), changes)
}
