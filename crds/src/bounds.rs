//! Bounds on every list, string and map of both CRDs, and the schema transforms that put
//! them there.
//!
//! The API server estimates the worst-case cost of each CEL rule from the sizes the schema
//! allows, and refuses a CRD whose rules could exceed its budget; an unbounded list or
//! string is infinitely large to it. Bounds also keep a `GpuNode` far below etcd's object
//! size limit on a busy node. The node agent never fails a write because of them: it cuts
//! its lists to these limits, most important entries first, and counts what it left out in
//! `status.truncated` (see [`fit_status`]); the operator turns that count into the
//! `StatusComplete` condition.
//!
//! The numbers are for real fleets: 8 GPUs per node is common, 16 the most sold in one
//! chassis today; A100/H100/B200 carve at most 7 MIG devices out of a GPU; a node runs at
//! most a few hundred pods (kubelet `maxPods`, 110 by default).

use schemars::Schema;
use serde_json::{Map, Value, json};

/// CEL for a list of extended-resource globs: a literal domain, then a name that may hold
/// `*` and `?`. A pattern without a domain would match `cpu` or `memory`.
pub(crate) const RESOURCE_PATTERN_RULE: &str =
    "self.all(p, p.matches('^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[-a-zA-Z0-9_.*?]+$'))";
pub(crate) const RESOURCE_PATTERN_MESSAGE: &str =
    "resource patterns are domain/name, with * and ? only in the name, such as rdma/*";

/// What is wrong with an extended-resource glob (`match.gpuResources`, `rdmaResources`), as
/// the CRD's rule says: a DNS-subdomain domain without wildcards, `/`, then a name of
/// letters, digits, `-`, `_`, `.`, `*` and `?`.
pub(crate) fn resource_pattern_problem(pattern: &str) -> Option<&'static str> {
    let Some((domain, name)) = pattern.split_once('/') else {
        return Some("has no domain/ (a pattern without one would match cpu or memory)");
    };
    let domain_ok = !domain.is_empty()
        && domain
            .bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.'))
        && !domain.starts_with(['-', '.'])
        && !domain.ends_with(['-', '.']);
    let name_ok = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'*' | b'?'));
    if !domain_ok {
        Some("needs a literal lower-case domain before the /")
    } else if !name_ok {
        Some("has a name with characters other than letters, digits, -, _, ., * and ?")
    } else {
        None
    }
}

/// Most GPUs one `GpuNode` lists.
pub const MAX_GPUS: usize = 32;
/// Most MIG devices listed under one GPU.
pub const MAX_MIG_DEVICES: usize = 16;
/// Most health reasons listed for one GPU.
pub const MAX_HEALTH_REASONS: usize = 16;
/// Most bindings (pod containers holding GPUs) one `GpuNode` lists: every container of a
/// 250-pod node sharing time-sliced GPUs, with room to spare.
pub const MAX_BINDINGS: usize = 512;
/// Most device UUIDs listed in one binding: all MIG devices of 8 GPUs.
pub const MAX_BINDING_DEVICES: usize = 64;
/// Most privileged GPU pods one `GpuNode` lists.
pub const MAX_PRIVILEGED_PODS: usize = 256;
/// Most conditions on an object.
pub const MAX_CONDITIONS: usize = 16;

/// Longest device UUID (`GPU-<uuid>` is 40 characters; the old MIG form
/// `MIG-GPU-<uuid>/<gi>/<ci>` about 60).
pub const UUID_LEN: usize = 128;
/// Longest product name or version string NVML writes (its buffers are 96 and 80 bytes).
pub const NVML_STRING_LEN: usize = 256;
/// Longest health reason.
pub const REASON_LEN: usize = 512;
/// Longest PCI bus id (`00000000:18:00.0`; NVML's buffer is 32 bytes).
pub const PCI_BUS_ID_LEN: usize = 32;
/// Longest DNS label: namespace and container names.
pub const DNS_LABEL_LEN: usize = 63;
/// Longest DNS subdomain: pod, node and policy names.
pub const DNS_SUBDOMAIN_LEN: usize = 253;
/// Longest qualified name with a prefix (label keys, extended resource names).
pub const QUALIFIED_NAME_LEN: usize = 317;
/// Longest label value.
pub const LABEL_VALUE_LEN: usize = 63;
/// Longest file path (Linux `PATH_MAX`).
pub const PATH_LEN: usize = 4096;
/// Longest free-form message the agent writes (an error it could not read something with).
pub const MESSAGE_LEN: usize = 4096;
/// Longest RFC 3339 timestamp.
pub const TIMESTAMP_LEN: usize = 64;
/// Longest image reference or image pattern: a 255-character name, a 128-character tag and
/// a digest.
pub const IMAGE_LEN: usize = 512;

/// Most labels a selector may require by value, and most expressions it may hold.
const SELECTOR_LABELS: usize = 64;
const SELECTOR_EXPRESSIONS: usize = 32;
const SELECTOR_VALUES: usize = 64;
/// The Kubernetes `metav1.Condition` bounds.
const CONDITION_TYPE_LEN: usize = 316;
const CONDITION_REASON_LEN: usize = 1024;
const CONDITION_MESSAGE_LEN: usize = 32768;

/// Container-level transform for the spec and status types: integers get formats the API
/// server knows. schemars writes Rust's `u32`/`u64` as `format: uint32`/`uint64`, which
/// kube-apiserver warns about on every apply; they become `int32`/`int64` with
/// `minimum: 0`. (A `u64` above `i64::MAX` cannot be stored either way.)
pub fn kubernetes_integers(schema: &mut Schema) {
    let Some(root) = schema.as_object_mut() else {
        return;
    };
    walk(root, &mut |node| {
        let format = match node.get("format").and_then(Value::as_str) {
            Some("uint32" | "uint16" | "uint8") => "int32",
            Some("uint64" | "uint") => "int64",
            _ => return,
        };
        node.insert("format".into(), json!(format));
        let minimum = node.get("minimum").and_then(Value::as_f64).unwrap_or(0.0);
        node.insert("minimum".into(), json!(minimum.max(0.0) as i64));
    });
}

/// Field transform for a `LabelSelector` (or `Option<LabelSelector>`): bounds its labels,
/// expressions and values.
pub fn label_selector(schema: &mut Schema) {
    let Some(props) = schema.get_mut("properties").and_then(Value::as_object_mut) else {
        return;
    };
    if let Some(labels) = props.get_mut("matchLabels").and_then(Value::as_object_mut) {
        labels.insert("maxProperties".into(), json!(SELECTOR_LABELS));
        if let Some(value) = labels
            .get_mut("additionalProperties")
            .and_then(Value::as_object_mut)
        {
            value.insert("maxLength".into(), json!(LABEL_VALUE_LEN));
        }
    }
    let Some(expressions) = props
        .get_mut("matchExpressions")
        .and_then(Value::as_object_mut)
    else {
        return;
    };
    expressions.insert("maxItems".into(), json!(SELECTOR_EXPRESSIONS));
    let Some(item) = expressions.get_mut("items").and_then(|i| properties(i)) else {
        return;
    };
    set_max_length(item, "key", QUALIFIED_NAME_LEN);
    // In, NotIn, Exists, DoesNotExist.
    set_max_length(item, "operator", 16);
    if let Some(values) = item.get_mut("values").and_then(Value::as_object_mut) {
        values.insert("maxItems".into(), json!(SELECTOR_VALUES));
        if let Some(v) = values.get_mut("items").and_then(Value::as_object_mut) {
            v.insert("maxLength".into(), json!(LABEL_VALUE_LEN));
        }
    }
}

/// Field transform for a list of `metav1.Condition`: the bounds Kubernetes gives them.
pub fn conditions(schema: &mut Schema) {
    let Some(list) = schema.as_object_mut() else {
        return;
    };
    list.insert("maxItems".into(), json!(MAX_CONDITIONS));
    let Some(item) = list.get_mut("items").and_then(|i| properties(i)) else {
        return;
    };
    set_max_length(item, "type", CONDITION_TYPE_LEN);
    set_max_length(item, "reason", CONDITION_REASON_LEN);
    set_max_length(item, "message", CONDITION_MESSAGE_LEN);
    set_max_length(item, "lastTransitionTime", TIMESTAMP_LEN);
    if let Some(status) = item.get_mut("status").and_then(Value::as_object_mut) {
        status.insert("enum".into(), json!(["True", "False", "Unknown"]));
    }
}

/// Field transform for a timestamp (`metav1.Time`).
pub fn timestamp(schema: &mut Schema) {
    if let Some(node) = schema.as_object_mut() {
        node.insert("maxLength".into(), json!(TIMESTAMP_LEN));
    }
}

fn properties(node: &mut Value) -> Option<&mut Map<String, Value>> {
    node.get_mut("properties")?.as_object_mut()
}

fn set_max_length(props: &mut Map<String, Value>, name: &str, max: usize) {
    if let Some(p) = props.get_mut(name).and_then(Value::as_object_mut) {
        p.insert("maxLength".into(), json!(max));
    }
}

/// Calls `f` on every schema object under `obj`, itself included.
fn walk(obj: &mut Map<String, Value>, f: &mut impl FnMut(&mut Map<String, Value>)) {
    f(obj);
    for key in ["properties", "patternProperties"] {
        if let Some(map) = obj.get_mut(key).and_then(Value::as_object_mut) {
            for child in map.values_mut().filter_map(Value::as_object_mut) {
                walk(child, f);
            }
        }
    }
    for key in ["items", "additionalProperties", "not"] {
        if let Some(child) = obj.get_mut(key).and_then(Value::as_object_mut) {
            walk(child, f);
        }
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(list) = obj.get_mut(key).and_then(Value::as_array_mut) {
            for child in list.iter_mut().filter_map(Value::as_object_mut) {
                walk(child, f);
            }
        }
    }
}

/// A status whose lists the node agent cuts to the schema's bounds before it writes it. The
/// `GpuNode` status implements it beside its type, where its lists are.
pub trait FitToBounds {
    /// Cuts its lists and strings to their bounds, most important entries first, and
    /// records what it left out.
    fn fit_to_bounds(&mut self);
}

/// Cuts the agent's lists in `status` to the schema's bounds and records in
/// `status.truncated` how many entries each lost; `truncated` is `None` when nothing was
/// cut. Each list keeps its order; which entries matter most, and are kept first, the status
/// type says ([`FitToBounds`]).
pub fn fit_status(status: &mut impl FitToBounds) {
    status.fit_to_bounds();
}

/// Keeps at most `max` entries of `list`, the `important` ones first, in their order, and
/// returns how many it dropped.
pub(crate) fn keep<T>(list: &mut Vec<T>, max: usize, important: impl Fn(&T) -> bool) -> u32 {
    let dropped = list.len().saturating_sub(max);
    if dropped == 0 {
        return 0;
    }
    let mut kept = vec![false; list.len()];
    let (first, rest): (Vec<usize>, Vec<usize>) =
        (0..list.len()).partition(|&i| important(&list[i]));
    for i in first.into_iter().chain(rest).take(max) {
        kept[i] = true;
    }
    let mut kept = kept.into_iter();
    list.retain(|_| kept.next().unwrap_or(false));
    count(dropped)
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

pub(crate) fn truncate_chars(s: &mut String, max: usize) {
    if let Some((i, _)) = s.char_indices().nth(max) {
        s.truncate(i);
    }
}
