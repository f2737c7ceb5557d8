//! The operator's Prometheus metrics, registered under the `gpuwarden_operator_` prefix.
//!
//! Labels are bounded: controller names, error kinds and write kinds are fixed sets.

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
        Self {
            registry,
            reconciles,
            errors,
            writes,
            duration,
            leader,
            caches_synced,
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
}
