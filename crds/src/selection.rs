//! Which `GpuPolicy` governs a pod. The webhook rewrites a pod by this rule and the node
//! agent reports a pod's exemption by it, so the two cannot disagree about a pod.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::GpuPolicy;
use crate::selector::{self, Labels};
use crate::validation::validate_policy;

// Defined at the crate root with the other label names, because validation reads it too.
pub use crate::LABEL_NAMESPACE_NAME;

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
    /// Why the governing policy is invalid, when it is (docs/design.md, "Policies"): a
    /// problem of its own ([`validate_policy`]), or a selector that cannot be evaluated, in
    /// which case the policy is taken to select the pod. Callers fail closed on it.
    pub invalid: Option<String>,
}

/// Picks the policy that governs a pod: the highest priority whose `namespaceSelector`
/// matches the namespace labels and whose `podSelector` (if any) matches the pod labels;
/// ties go to the name that sorts first. A policy whose selector cannot be evaluated could
/// select any pod, so it governs every pod it outranks, and [`Selection::invalid`] says why;
/// so does a governing policy with any other problem. Never a panic.
pub fn select_policy<'p, N, P>(
    policies: &'p [Arc<GpuPolicy>],
    namespace_labels: &N,
    pod_labels: &P,
) -> Selection<'p>
where
    N: Labels + ?Sized,
    P: Labels + ?Sized,
{
    let mut unreadable = None;
    let mut governs = |policy: &GpuPolicy| {
        governs(policy, namespace_labels, pod_labels).unwrap_or_else(|why| {
            unreadable = Some(why);
            true
        })
    };
    let policy = if let [only] = policies {
        // A single policy, the usual case, needs no ordering.
        Some(only.as_ref()).filter(|p| governs(p))
    } else {
        let mut ordered: Vec<&GpuPolicy> = policies.iter().map(Arc::as_ref).collect();
        ordered.sort_by(|a, b| GpuPolicy::precedence(a, b));
        ordered.into_iter().find(|p| governs(p))
    };
    let invalid = policy.and_then(|policy| {
        let problem = unreadable.or_else(|| {
            let problem = validate_policy(policy).into_iter().next()?;
            Some(format!("{}: {}", problem.reason, problem.message))
        })?;
        let name = policy.metadata.name.as_deref().unwrap_or("");
        Some(format!("GpuPolicy {name} is invalid ({problem})"))
    });
    Selection { policy, invalid }
}

/// Whether `policy` selects the pod, or why that cannot be told.
fn governs<N, P>(policy: &GpuPolicy, namespace_labels: &N, pod_labels: &P) -> Result<bool, String>
where
    N: Labels + ?Sized,
    P: Labels + ?Sized,
{
    let spec = &policy.spec;
    fn invalid(field: &'static str) -> impl Fn(selector::SelectorError) -> String {
        move |e| format!("InvalidSelector: spec.{field}: {e}")
    }
    if !selector::matches(&spec.namespace_selector, namespace_labels)
        .map_err(invalid("namespaceSelector"))?
    {
        return Ok(false);
    }
    match &spec.pod_selector {
        Some(pod_selector) => {
            selector::matches(pod_selector, pod_labels).map_err(invalid("podSelector"))
        }
        None => Ok(true),
    }
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
    fn a_pod_selector_narrows_and_an_invalid_policy_governs_what_it_outranks() {
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
        let mut policies = vec![policy("default", 0, &[]), Arc::new(render)];
        assert_eq!(
            chosen(&policies, &[], &[("app", "render")]).as_deref(),
            Some("render")
        );
        let selection = select_policy(&policies, &labels(&[]), &labels(&[("app", "x")]));
        assert_eq!(
            selection.policy.and_then(|p| p.metadata.name.as_deref()),
            Some("default")
        );
        assert_eq!(selection.invalid, None);

        // A selector that cannot be read could select anything: the policy governs every
        // pod it outranks, and says why it is invalid.
        policies.push(Arc::new(broken));
        for pod in [&[("app", "render")][..], &[("app", "x")]] {
            let selection = select_policy(&policies, &labels(&[]), &labels(pod));
            assert_eq!(
                selection.policy.and_then(|p| p.metadata.name.as_deref()),
                Some("broken")
            );
            let why = selection.invalid.unwrap_or_default();
            assert!(
                why.starts_with(
                    "GpuPolicy broken is invalid (InvalidSelector: spec.namespaceSelector"
                ),
                "{why}"
            );
        }

        // A policy with a problem of its own is invalid only where it governs.
        let mut greedy = (*policy("greedy", 20, &[("team", "a")])).clone();
        greedy.spec.gpu.default_count = 9;
        policies.push(Arc::new(greedy));
        let selection = select_policy(&policies, &labels(&[("team", "a")]), &labels(&[]));
        assert_eq!(
            selection.policy.and_then(|p| p.metadata.name.as_deref()),
            Some("greedy")
        );
        assert!(
            (selection.invalid.as_deref().unwrap_or_default())
                .starts_with("GpuPolicy greedy is invalid (InvalidCount: spec.gpu.defaultCount 9"),
            "{:?}",
            selection.invalid
        );
        let selection = select_policy(&policies, &labels(&[("team", "b")]), &labels(&[]));
        assert_eq!(
            selection.policy.and_then(|p| p.metadata.name.as_deref()),
            Some("broken")
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
