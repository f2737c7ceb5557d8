//! Which `GpuPolicy` governs a pod. The webhook rewrites a pod by this rule and the node
//! agent reports a pod's exemption by it, so the two cannot disagree about a pod.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::GpuPolicy;
use crate::selector::{self, Labels};

/// Label the API server sets on every namespace.
pub const LABEL_NAMESPACE_NAME: &str = "kubernetes.io/metadata.name";

/// The labels of namespace `name`: the known ones, or what the API server sets on every
/// namespace when the namespace is unknown. `kubernetes.io/metadata.name` is always present.
pub fn namespace_labels_or_default(
    name: &str,
    known: Option<BTreeMap<String, String>>,
) -> BTreeMap<String, String> {
    let mut labels = known.unwrap_or_default();
    if !labels.contains_key(LABEL_NAMESPACE_NAME) {
        labels.insert(LABEL_NAMESPACE_NAME.to_owned(), name.to_owned());
    }
    labels
}

/// A namespace's labels as the API server keeps them, read in place: the known ones (none
/// when the namespace is unknown), and `kubernetes.io/metadata.name` set to the namespace's
/// name unless they carry it. The same labels as [`namespace_labels_or_default`], without
/// building a map.
#[derive(Clone, Copy, Debug)]
pub struct NamespaceLabels<'a> {
    /// The namespace's name.
    pub name: &'a str,
    /// Its labels, when it is known.
    pub known: Option<&'a BTreeMap<String, String>>,
}

impl Labels for NamespaceLabels<'_> {
    fn label(&self, key: &str) -> Option<&str> {
        match self.known.and_then(|labels| labels.get(key)) {
            Some(value) => Some(value),
            None if key == LABEL_NAMESPACE_NAME => Some(self.name),
            None => None,
        }
    }
}

/// The result of choosing a policy.
#[derive(Debug)]
pub struct Selection<'p> {
    /// The governing policy, if any.
    pub policy: Option<&'p GpuPolicy>,
    /// Policies skipped because a selector is invalid, with the reason.
    pub skipped: Vec<String>,
}

/// Picks the policy that governs a pod: the highest priority whose `namespaceSelector`
/// matches the namespace labels and whose `podSelector` (if any) matches the pod labels;
/// ties go to the name that sorts first. A policy with an invalid selector is skipped and
/// named in `skipped`, never a panic.
pub fn select_policy<'p, N, P>(
    policies: &'p [Arc<GpuPolicy>],
    namespace_labels: &N,
    pod_labels: &P,
) -> Selection<'p>
where
    N: Labels + ?Sized,
    P: Labels + ?Sized,
{
    let mut skipped = Vec::new();
    let mut governs =
        |policy: &GpuPolicy| governs(policy, namespace_labels, pod_labels, &mut skipped);
    let policy = if let [only] = policies {
        // A single policy, the usual case, needs no ordering.
        Some(only.as_ref()).filter(|p| governs(p))
    } else {
        let mut ordered: Vec<&GpuPolicy> = policies.iter().map(Arc::as_ref).collect();
        ordered.sort_by(|a, b| GpuPolicy::precedence(a, b));
        ordered.into_iter().find(|p| governs(p))
    };
    Selection { policy, skipped }
}

/// Whether `policy` selects the pod. A policy with an invalid selector selects nothing and
/// is named in `skipped`.
fn governs<N, P>(
    policy: &GpuPolicy,
    namespace_labels: &N,
    pod_labels: &P,
    skipped: &mut Vec<String>,
) -> bool
where
    N: Labels + ?Sized,
    P: Labels + ?Sized,
{
    let spec = &policy.spec;
    matches(
        policy,
        &spec.namespace_selector,
        namespace_labels,
        "namespaceSelector",
        skipped,
    ) && spec.pod_selector.as_ref().is_none_or(|pod_selector| {
        matches(policy, pod_selector, pod_labels, "podSelector", skipped)
    })
}

/// Whether `policy`'s `field` selects `labels`; an invalid one selects nothing and is named
/// in `skipped`.
fn matches<L: Labels + ?Sized>(
    policy: &GpuPolicy,
    selector: &LabelSelector,
    labels: &L,
    field: &str,
    skipped: &mut Vec<String>,
) -> bool {
    selector::matches(selector, labels).unwrap_or_else(|e| {
        let name = policy.metadata.name.as_deref().unwrap_or("");
        skipped.push(format!("GpuPolicy {name} ignored: invalid {field}: {e}"));
        false
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::selector::tests::labels;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

    fn policy(name: &str, priority: i32, namespaces: &[(&str, &str)]) -> Arc<GpuPolicy> {
        let mut p = GpuPolicy::default_policy();
        p.metadata.name = Some(name.into());
        p.spec.priority = priority;
        p.spec.namespace_selector = LabelSelector {
            match_labels: Some(labels(namespaces)),
            ..LabelSelector::default()
        };
        Arc::new(p)
    }

    fn chosen(
        policies: &[Arc<GpuPolicy>],
        namespace: &[(&str, &str)],
        pod: &[(&str, &str)],
    ) -> Option<String> {
        select_policy(policies, &labels(namespace), &labels(pod))
            .policy
            .and_then(|p| p.metadata.name.clone())
    }

    #[test]
    fn the_highest_priority_that_selects_the_namespace_governs_ties_by_name() {
        let policies = [
            policy("default", 0, &[]),
            policy("team-b", 10, &[("team", "b")]),
            policy("team-a", 10, &[("team", "a")]),
            policy("a-also", 10, &[("team", "a")]),
        ];
        assert_eq!(
            chosen(&policies, &[("team", "a")], &[]).as_deref(),
            Some("a-also")
        );
        assert_eq!(
            chosen(&policies, &[("team", "b")], &[]).as_deref(),
            Some("team-b")
        );
        assert_eq!(
            chosen(&policies, &[("team", "c")], &[]).as_deref(),
            Some("default")
        );
        assert_eq!(chosen(&policies[1..], &[("team", "c")], &[]), None);
    }

    #[test]
    fn a_pod_selector_narrows_and_an_invalid_selector_is_skipped_by_name() {
        let mut render = (*policy("render", 5, &[])).clone();
        render.spec.pod_selector = Some(LabelSelector {
            match_labels: Some(labels(&[("app", "render")])),
            ..LabelSelector::default()
        });
        let mut broken = (*policy("broken", 9, &[])).clone();
        broken.spec.namespace_selector.match_expressions = Some(vec![LabelSelectorRequirement {
            key: "team".into(),
            operator: "Near".into(),
            values: None,
        }]);
        let policies = [
            policy("default", 0, &[]),
            Arc::new(render),
            Arc::new(broken),
        ];
        assert_eq!(
            chosen(&policies, &[], &[("app", "render")]).as_deref(),
            Some("render")
        );
        let selection = select_policy(&policies, &labels(&[]), &labels(&[("app", "x")]));
        assert_eq!(
            selection.policy.and_then(|p| p.metadata.name.as_deref()),
            Some("default")
        );
        assert_eq!(selection.skipped.len(), 1);
        assert!(
            selection.skipped[0].starts_with("GpuPolicy broken ignored: invalid namespaceSelector"),
            "{:?}",
            selection.skipped
        );
    }

    #[test]
    fn namespace_labels_read_in_place_are_the_labels_built_in_full() {
        let known = labels(&[("team", "a"), (LABEL_NAMESPACE_NAME, "renamed")]);
        let without_name = labels(&[("team", "a")]);
        for known in [None, Some(&known), Some(&without_name)] {
            let built = namespace_labels_or_default("ml", known.cloned());
            let lent = NamespaceLabels { name: "ml", known };
            for key in ["team", LABEL_NAMESPACE_NAME, "other"] {
                assert_eq!(lent.label(key), built.label(key), "{key} of {known:?}");
            }
        }
    }

    #[test]
    fn an_unknown_namespace_still_has_its_name_label() {
        let labels = namespace_labels_or_default("ml", None);
        assert_eq!(
            labels.get(LABEL_NAMESPACE_NAME).map(String::as_str),
            Some("ml")
        );
        let known =
            namespace_labels_or_default("ml", Some(BTreeMap::from([("team".into(), "a".into())])));
        assert_eq!(known.len(), 2);
    }
}
