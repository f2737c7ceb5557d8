//! Which `GpuPolicy.spec.health` governs this node: the highest-priority policy whose
//! `health.nodeSelector` matches the node's labels (ties by name), else the built-in default.

use std::collections::BTreeMap;

use gpuwarden_crds::GpuPolicy;
use gpuwarden_crds::duration::parse_duration;

use crate::health::HealthRules;

/// The health rules for a node with `labels`, from `policies`.
pub fn health_rules(policies: &[&GpuPolicy], labels: &BTreeMap<String, String>) -> HealthRules {
    let mut candidates: Vec<(&GpuPolicy, &gpuwarden_crds::HealthSpec)> = policies
        .iter()
        .filter_map(|p| p.spec.health.as_ref().map(|h| (*p, h)))
        .filter(
            |(p, h)| match gpuwarden_crds::selector::matches(&h.node_selector, labels) {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(policy = p.metadata.name.as_deref().unwrap_or(""), error = %e,
                    "ignoring GpuPolicy health.nodeSelector");
                    false
                }
            },
        )
        .collect();
    candidates.sort_by(|(a, _), (b, _)| GpuPolicy::precedence(a, b));
    let Some((policy, health)) = candidates.first() else {
        return HealthRules::default();
    };
    let name = policy.metadata.name.clone().unwrap_or_default();
    let recover_after = match parse_duration(&health.recover_after) {
        Ok(d) => d,
        Err(e) => {
            // The CRD's pattern rejects this; an older object may still carry it.
            tracing::warn!(policy = %name, error = %e, "using the default recoverAfter");
            HealthRules::default().recover_after
        }
    };
    HealthRules {
        ignored_xids: health.ignored_xids.iter().copied().collect(),
        recover_after,
        policy: name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuwarden_crds::HealthSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    use std::time::Duration;

    fn policy(
        name: &str,
        priority: i32,
        selector: &[(&str, &str)],
        xids: &[u64],
        recover: &str,
    ) -> GpuPolicy {
        let mut p = GpuPolicy::default_policy();
        p.metadata.name = Some(name.into());
        p.spec.priority = priority;
        p.spec.health = Some(HealthSpec {
            node_selector: LabelSelector {
                match_labels: Some(
                    selector
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            ignored_xids: xids.to_vec(),
            recover_after: recover.into(),
        });
        p
    }

    #[test]
    fn highest_priority_matching_policy_wins() {
        let labels: BTreeMap<String, String> = [("pool".to_string(), "h100".to_string())].into();
        let a = policy("a", 10, &[], &[13], "5m");
        let b = policy("b", 50, &[("pool", "h100")], &[31], "1h");
        let c = policy("c", 99, &[("pool", "a100")], &[43], "1m");
        let rules = health_rules(&[&a, &b, &c], &labels);
        assert_eq!(rules.policy, "b");
        assert_eq!(rules.recover_after, Duration::from_secs(3600));
        assert!(rules.ignored_xids.contains(&31) && !rules.ignored_xids.contains(&13));

        // Ties by name; no health section is no candidate.
        let a2 = policy("a2", 50, &[], &[], "2m");
        let mut none = policy("0", 100, &[], &[], "1m");
        none.spec.health = None;
        assert_eq!(health_rules(&[&b, &a2, &none], &labels).policy, "a2");

        // Nothing matches: the built-in default.
        assert_eq!(health_rules(&[&c], &labels), HealthRules::default());
    }
}
