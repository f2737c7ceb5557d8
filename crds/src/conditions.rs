//! Condition helpers: `lastTransitionTime` moves only when a condition's status does.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// A condition as computed, before it is merged with what the object already holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredCondition {
    /// Condition type, e.g. `AgentReady`.
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: &'static str,
    /// CamelCase reason.
    pub reason: String,
    /// Human-readable message.
    pub message: String,
}

impl DesiredCondition {
    /// A condition of `type_` with the given status, reason and message.
    pub fn new(
        type_: &str,
        status: bool,
        reason: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            type_: type_.to_owned(),
            status: if status { "True" } else { "False" },
            reason: reason.into(),
            message: message.into(),
        }
    }

    /// A condition whose truth is not known.
    pub fn unknown(type_: &str, reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            type_: type_.to_owned(),
            status: "Unknown",
            reason: reason.into(),
            message: message.into(),
        }
    }
}

/// Merges `desired` into `existing`: a condition keeps its `lastTransitionTime` unless its
/// status changed. Returns the merged list in the order of `desired`.
pub fn merge_conditions(
    existing: &[Condition],
    desired: &[DesiredCondition],
    observed_generation: Option<i64>,
    now: Time,
) -> Vec<Condition> {
    desired
        .iter()
        .map(|d| {
            let previous = existing.iter().find(|c| c.type_ == d.type_);
            let last_transition_time = match previous {
                Some(p) if p.status == d.status => p.last_transition_time.clone(),
                _ => now.clone(),
            };
            Condition {
                type_: d.type_.clone(),
                status: d.status.to_owned(),
                reason: d.reason.clone(),
                message: d.message.clone(),
                observed_generation,
                last_transition_time,
            }
        })
        .collect()
}

/// Finds a condition by type.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether the condition of `type_` is `True`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    find(conditions, type_).is_some_and(|c| c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: i64) -> Time {
        Time(jiff::Timestamp::from_second(secs).unwrap())
    }

    #[test]
    fn transition_time_moves_only_on_status_change() {
        let first = merge_conditions(
            &[],
            &[DesiredCondition::new(
                "Healthy",
                true,
                "AllHealthy",
                "8 of 8",
            )],
            Some(1),
            t(100),
        );
        assert_eq!(first[0].last_transition_time, t(100));

        let same = merge_conditions(
            &first,
            &[DesiredCondition::new(
                "Healthy",
                true,
                "AllHealthy",
                "8 of 8 now",
            )],
            Some(2),
            t(200),
        );
        assert_eq!(same[0].last_transition_time, t(100));
        assert_eq!(same[0].message, "8 of 8 now");

        let flipped = merge_conditions(
            &same,
            &[DesiredCondition::new("Healthy", false, "XidError", "GPU 3")],
            Some(2),
            t(300),
        );
        assert_eq!(flipped[0].last_transition_time, t(300));
        assert!(!is_true(&flipped, "Healthy"));
    }
}
