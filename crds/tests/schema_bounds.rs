//! Keeps the CRDs' CEL affordable without a cluster.
//!
//! kube-apiserver estimates each `x-kubernetes-validations` rule's worst case from the sizes
//! the schema allows and refuses the CRD when it is over budget; a list, map or string with
//! no bound is as large as a request can be, which puts any rule that reads it over budget.
//! These tests walk the generated schemas: every list, map and string is bounded (rules or
//! not: bounds also keep a `GpuNode` small), bounds stay under sane ceilings, integer
//! formats are ones the API server knows, and a rough worst-case size of what each rule
//! reads stays far under the API server's per-rule budget. The real estimator is stricter
//! in its own ways; the e2e suite applies the CRDs to a real kube-apiserver.

use gpuwarden_crds::{GpuNode, GpuPolicy};
use kube::CustomResourceExt;
use serde_json::Value;

/// kube-apiserver's per-rule cost limit (`apiextensions` `PerCallLimit`).
const PER_CALL_LIMIT: u64 = 1_000_000;

const MAX_ITEMS_CEILING: u64 = 1024;
const MAX_PROPERTIES_CEILING: u64 = 256;
const MAX_LENGTH_CEILING: u64 = 32 * 1024;
/// Strings a CEL rule reads are matched with regular expressions: keep them short.
const RULE_STRING_CEILING: u64 = 1024;

fn schemas() -> Vec<(String, Value)> {
    [GpuPolicy::crd(), GpuNode::crd()]
        .into_iter()
        .map(|crd| {
            let name = crd.spec.names.plural.clone();
            let schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
            (name, schema["openAPIV3Schema"].clone())
        })
        .collect()
}

/// Calls `f(path, node)` on every schema node.
fn visit(path: &str, node: &Value, f: &mut impl FnMut(&str, &Value)) {
    f(path, node);
    if let Some(props) = node.get("properties").and_then(Value::as_object) {
        for (name, child) in props {
            visit(&format!("{path}.{name}"), child, f);
        }
    }
    if let Some(items) = node.get("items") {
        visit(&format!("{path}[]"), items, f);
    }
    if let Some(values) = node.get("additionalProperties").filter(|v| v.is_object()) {
        visit(&format!("{path}{{}}"), values, f);
    }
}

fn bound(node: &Value, key: &str) -> Option<u64> {
    node.get(key).and_then(Value::as_u64)
}

fn is_map(node: &Value) -> bool {
    node.get("additionalProperties")
        .is_some_and(Value::is_object)
}

/// What is unbounded or over its ceiling at `node` itself.
fn problems_at(path: &str, node: &Value, string_ceiling: u64) -> Vec<String> {
    let mut out = Vec::new();
    let mut check = |key: &str, ceiling: u64| match bound(node, key) {
        None => out.push(format!("{path} has no {key}")),
        Some(n) if n > ceiling => out.push(format!("{path}: {key} {n} is over {ceiling}")),
        Some(_) => {}
    };
    match node.get("type").and_then(Value::as_str) {
        Some("string") if node.get("enum").is_none() => check("maxLength", string_ceiling),
        Some("array") => check("maxItems", MAX_ITEMS_CEILING),
        Some("object") if is_map(node) => check("maxProperties", MAX_PROPERTIES_CEILING),
        _ => {}
    }
    out
}

#[test]
fn every_list_map_and_string_is_bounded() {
    let mut problems = Vec::new();
    for (crd, schema) in schemas() {
        // metadata is the API server's own, with its own limits.
        for part in ["spec", "status"] {
            visit(
                &format!("{crd}.{part}"),
                &schema["properties"][part],
                &mut |path, node| problems.extend(problems_at(path, node, MAX_LENGTH_CEILING)),
            );
        }
    }
    assert!(
        problems.is_empty(),
        "unbounded fields:\n{}",
        problems.join("\n")
    );
}

#[test]
fn integer_formats_are_ones_the_api_server_knows() {
    let mut problems = Vec::new();
    for (crd, schema) in schemas() {
        visit(&crd, &schema, &mut |path, node| {
            if node["type"] == "integer"
                && let Some(format) = node.get("format").and_then(Value::as_str)
                && !matches!(format, "int32" | "int64")
            {
                problems.push(format!("{path}: format {format}"));
            }
        });
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The rough worst-case size of a value: characters of strings, times items of lists and
/// properties of maps.
fn size(node: &Value) -> u64 {
    match node.get("type").and_then(Value::as_str) {
        Some("string") => match node.get("enum").and_then(Value::as_array) {
            Some(values) => values
                .iter()
                .filter_map(Value::as_str)
                .map(|v| v.len() as u64)
                .max()
                .unwrap_or(1),
            None => bound(node, "maxLength").unwrap_or(u64::MAX / 4).max(1),
        },
        Some("array") => bound(node, "maxItems")
            .unwrap_or(u64::MAX / 4)
            .saturating_mul(node.get("items").map_or(1, size)),
        Some("object") if is_map(node) => bound(node, "maxProperties")
            .unwrap_or(u64::MAX / 4)
            .saturating_mul(size(&node["additionalProperties"])),
        Some("object") => node
            .get("properties")
            .and_then(Value::as_object)
            .map_or(1, |p| p.values().map(size).fold(0, u64::saturating_add)),
        _ => 1,
    }
}

#[test]
fn cel_rules_read_only_bounded_values_of_affordable_size() {
    let mut rules = 0;
    let mut problems = Vec::new();
    for (crd, schema) in schemas() {
        visit(&crd, &schema, &mut |path, node| {
            let Some(list) = node
                .get("x-kubernetes-validations")
                .and_then(Value::as_array)
            else {
                return;
            };
            for rule in list {
                rules += 1;
                let text = rule["rule"].as_str().unwrap_or_default();
                visit(path, node, &mut |p, n| {
                    problems.extend(problems_at(p, n, RULE_STRING_CEILING))
                });
                // Regular expressions and `all()` cost about the size of what they read,
                // a few times over; ten times is still under the limit.
                let worst = size(node).saturating_mul(10);
                if worst > PER_CALL_LIMIT {
                    problems.push(format!(
                        "{path}: rule {text:?} reads up to {} characters",
                        size(node)
                    ));
                }
            }
        });
    }
    assert!(
        rules >= 5,
        "found only {rules} rules: is the walk missing some?"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_walk_notices_an_unbounded_field() {
    // The checks above must be able to fail.
    let node = serde_json::json!({"type": "object", "properties": {
        "names": {"type": "array", "items": {"type": "string"}},
        "labels": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 5}},
    }});
    let mut problems = Vec::new();
    visit("x", &node, &mut |p, n| {
        problems.extend(problems_at(p, n, 10))
    });
    assert_eq!(
        problems,
        [
            "x.labels has no maxProperties",
            "x.names has no maxItems",
            "x.names[] has no maxLength"
        ]
    );
    assert!(size(&node["properties"]["names"]) > PER_CALL_LIMIT);
}
