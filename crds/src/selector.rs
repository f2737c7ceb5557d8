//! Label selector matching, as the API server does it.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use std::collections::BTreeMap;

/// A label selector the API server would have rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SelectorError {
    /// Unknown `operator` in a `matchExpressions` entry.
    #[error("unknown label selector operator {0:?} (use In, NotIn, Exists or DoesNotExist)")]
    UnknownOperator(String),
    /// `In`/`NotIn` without values, or `Exists`/`DoesNotExist` with values.
    #[error("label selector operator {operator} on key {key:?} {problem}")]
    BadValues {
        /// The operator.
        operator: String,
        /// The key.
        key: String,
        /// What is wrong.
        problem: &'static str,
    },
}

/// An object's labels, as a selector reads them: by key.
pub trait Labels: std::fmt::Debug {
    /// The value of label `key`.
    fn label(&self, key: &str) -> Option<&str>;
}

impl Labels for BTreeMap<String, String> {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

/// Whether `selector` selects an object with `labels`. An empty selector selects everything.
pub fn matches<L: Labels + ?Sized>(
    selector: &LabelSelector,
    labels: &L,
) -> Result<bool, SelectorError> {
    validate(selector)?;
    if let Some(ml) = &selector.match_labels
        && ml.iter().any(|(k, v)| labels.label(k) != Some(v.as_str()))
    {
        return Ok(false);
    }
    for expr in selector.match_expressions.iter().flatten() {
        let value = labels.label(&expr.key);
        let values = expr.values.as_deref().unwrap_or_default();
        let ok = match expr.operator.as_str() {
            "In" => value.is_some_and(|v| values.iter().any(|w| w == v)),
            "NotIn" => value.is_none_or(|v| !values.iter().any(|w| w == v)),
            "Exists" => value.is_some(),
            "DoesNotExist" => value.is_none(),
            other => return Err(SelectorError::UnknownOperator(other.to_owned())),
        };
        if !ok {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Checks a selector's expressions are well formed.
pub fn validate(selector: &LabelSelector) -> Result<(), SelectorError> {
    for expr in selector.match_expressions.iter().flatten() {
        let n = expr.values.as_ref().map_or(0, Vec::len);
        let problem = match expr.operator.as_str() {
            "In" | "NotIn" if n == 0 => Some("needs values"),
            "Exists" | "DoesNotExist" if n > 0 => Some("takes no values"),
            "In" | "NotIn" | "Exists" | "DoesNotExist" => None,
            other => return Err(SelectorError::UnknownOperator(other.to_owned())),
        };
        if let Some(problem) = problem {
            return Err(SelectorError::BadValues {
                operator: expr.operator.clone(),
                key: expr.key.clone(),
                problem,
            });
        }
    }
    Ok(())
}

/// Whether the selector is empty (selects everything).
pub fn is_empty(selector: &LabelSelector) -> bool {
    selector
        .match_labels
        .as_ref()
        .is_none_or(BTreeMap::is_empty)
        && selector
            .match_expressions
            .as_ref()
            .is_none_or(Vec::is_empty)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    /// A label map from pairs (the selection tests use it too).
    pub(crate) fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn expr(key: &str, op: &str, values: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: (!values.is_empty()).then(|| values.iter().map(|s| s.to_string()).collect()),
        }
    }

    #[test]
    fn empty_selects_all() {
        assert!(matches(&LabelSelector::default(), &labels(&[])).unwrap());
    }

    #[test]
    fn labels_and_expressions() {
        let sel = LabelSelector {
            match_labels: Some(labels(&[("team", "ml")])),
            match_expressions: Some(vec![
                expr("env", "In", &["prod", "staging"]),
                expr("legacy", "DoesNotExist", &[]),
                expr("tier", "NotIn", &["free"]),
            ]),
        };
        assert!(matches(&sel, &labels(&[("team", "ml"), ("env", "prod")])).unwrap());
        assert!(!matches(&sel, &labels(&[("team", "ml"), ("env", "dev")])).unwrap());
        assert!(
            !matches(
                &sel,
                &labels(&[("team", "ml"), ("env", "prod"), ("legacy", "")])
            )
            .unwrap()
        );
        assert!(
            !matches(
                &sel,
                &labels(&[("team", "ml"), ("env", "prod"), ("tier", "free")])
            )
            .unwrap()
        );
        assert!(!matches(&sel, &labels(&[("env", "prod")])).unwrap());
    }

    #[test]
    fn malformed_selectors_are_errors() {
        let bad = LabelSelector {
            match_expressions: Some(vec![expr("a", "Equals", &["x"])]),
            ..Default::default()
        };
        assert!(matches(&bad, &labels(&[])).is_err());
        let bad = LabelSelector {
            match_expressions: Some(vec![expr("a", "In", &[])]),
            ..Default::default()
        };
        assert!(validate(&bad).is_err());
    }
}
