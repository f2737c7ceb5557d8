//! The operator's Prometheus metrics, registered under the `gpuwarden_operator_` prefix.
//!
//! Labels are bounded: controller names, error kinds and write kinds are fixed sets; the
//! per-node condition gauge has one series per GPU node, condition and status, and a node's
//! series go when its GpuNode does.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Content type of [`Metrics::encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabels {
    controller: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    controller: &'static str,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeConditionLabels {
    node: String,
    condition: String,
    status: &'static str,
}

/// The statuses a condition may have, one series each.
const CONDITION_STATUSES: [&str; 3] = ["True", "False", "Unknown"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WriteLabels {
    controller: &'static str,
    kind: &'static str,
}

/// Every metric of the operator.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciles: Family<ControllerLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    writes: Family<WriteLabels, Counter>,
    duration: Family<ControllerLabels, Histogram>,
    leader: Gauge,
    caches_synced: Gauge,
    node_conditions: Family<NodeConditionLabels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("gpuwarden_operator");
        let reconciles = Family::<ControllerLabels, Counter>::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let writes = Family::<WriteLabels, Counter>::default();
        let duration = Family::<ControllerLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0005, 2.0, 16))
        });
        let leader = Gauge::default();
        let caches_synced = Gauge::default();
        let node_conditions = Family::<NodeConditionLabels, Gauge>::default();
        registry.register(
            "reconciles",
            "Reconciles run, by controller",
            reconciles.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Reconciles that failed, by controller and error kind",
            errors.clone(),
        );
        registry.register(
            "writes",
            "Writes to the API server, by controller and kind",
            writes.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time spent in one reconcile, by controller",
            duration.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica holds the leader Lease",
            leader.clone(),
        );
        registry.register(
            "caches_synced",
            "1 once every watch cache has finished its first list",
            caches_synced.clone(),
        );
        registry.register(
            "gpunode_condition",
            "1 for the status each condition of a GpuNode has (kube-state-metrics style: one series per status), by node and condition",
            node_conditions.clone(),
        );
        Self {
            registry,
            reconciles,
            errors,
            writes,
            duration,
            leader,
            caches_synced,
            node_conditions,
        }
    }

    /// Records one finished reconcile.
    pub fn reconciled(
        &self,
        controller: &'static str,
        took: Duration,
        error: Option<&'static str>,
    ) {
        self.reconciles
            .get_or_create(&ControllerLabels { controller })
            .inc();
        self.duration
            .get_or_create(&ControllerLabels { controller })
            .observe(took.as_secs_f64());
        if let Some(kind) = error {
            self.errors
                .get_or_create(&ErrorLabels { controller, kind })
                .inc();
        }
    }

    /// Records one write to the API server.
    pub fn write(&self, controller: &'static str, kind: &'static str) {
        self.writes
            .get_or_create(&WriteLabels { controller, kind })
            .inc();
    }

    /// Number of writes recorded for `controller` and `kind`.
    pub fn writes(&self, controller: &'static str, kind: &'static str) -> u64 {
        self.writes
            .get_or_create(&WriteLabels { controller, kind })
            .get()
    }

    /// Sets the leader gauge.
    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    /// Sets the caches-synced gauge.
    pub fn set_caches_synced(&self, synced: bool) {
        self.caches_synced.set(i64::from(synced));
    }

    /// Sets node `node`'s condition series from `conditions` (`type`, `status`).
    pub fn set_node_conditions<'c>(
        &self,
        node: &str,
        conditions: impl IntoIterator<Item = (&'c str, &'c str)>,
    ) {
        for (condition, status) in conditions {
            for s in CONDITION_STATUSES {
                let labels = NodeConditionLabels {
                    node: node.to_owned(),
                    condition: condition.to_owned(),
                    status: s,
                };
                self.node_conditions
                    .get_or_create(&labels)
                    .set(i64::from(s == status));
            }
        }
    }

    /// Drops node `node`'s condition series (its GpuNode is gone).
    pub fn forget_node(&self, node: &str, conditions: &[&str]) {
        for condition in conditions {
            for status in CONDITION_STATUSES {
                self.node_conditions.remove(&NodeConditionLabels {
                    node: node.to_owned(),
                    condition: (*condition).to_owned(),
                    status,
                });
            }
        }
    }

    /// OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_prefix_and_labels() {
        let m = Metrics::new();
        m.reconciled("gpunode", Duration::from_millis(3), None);
        m.reconciled("gpunode", Duration::from_millis(3), Some("conflict"));
        m.write("gpunode", "status");
        let text = m.encode();
        assert!(
            text.contains(r#"gpuwarden_operator_reconciles_total{controller="gpunode"} 2"#),
            "{text}"
        );
        assert!(text.contains(
            r#"gpuwarden_operator_reconcile_errors_total{controller="gpunode",kind="conflict"} 1"#
        ));
        assert!(text.contains("gpuwarden_operator_reconcile_duration_seconds_bucket"));
        assert_eq!(m.writes("gpunode", "status"), 1);
    }

    #[test]
    fn each_node_condition_has_one_series_per_status() {
        let m = Metrics::new();
        m.set_node_conditions("gpu-1", [("RuntimePatched", "False"), ("Isolated", "True")]);
        let text = m.encode();
        for (status, value) in [("True", 0), ("False", 1), ("Unknown", 0)] {
            let line = format!(
                r#"gpuwarden_operator_gpunode_condition{{node="gpu-1",condition="RuntimePatched",status="{status}"}} {value}"#
            );
            assert!(text.contains(&line), "{line}\n{text}");
        }
        m.forget_node("gpu-1", &["RuntimePatched", "Isolated"]);
        assert!(!m.encode().contains("gpu-1"));
    }
}
