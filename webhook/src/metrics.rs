//! The webhook's Prometheus metrics, served as OpenMetrics text on the health port.
//!
//! Every label is bounded: outcomes and refusal reasons are fixed sets, and the policy label
//! is the policy *name* (the `@generation` suffix would grow without bound).

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::admission::ReviewSummary;

/// Content type of [`Metrics::encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Labels of `gpuwarden_webhook_reviews_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReviewLabels {
    outcome: &'static str,
    policy: String,
}

/// Labels of `gpuwarden_webhook_requests_refused_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusedLabels {
    reason: &'static str,
}

/// Labels of `gpuwarden_webhook_cache_synced`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheLabels {
    cache: &'static str,
}

/// Why a request was answered before it reached the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The Content-Type was not JSON.
    ContentType,
    /// The body was larger than the limit.
    TooLarge,
    /// No concurrency slot became free within the bounded wait.
    Overloaded,
    /// The body did not arrive in time, or the connection broke while reading it.
    BodyRead,
    /// The engine panicked (a bug); the request was denied instead of dropped.
    Internal,
}

impl Refusal {
    /// Metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ContentType => "content_type",
            Self::TooLarge => "too_large",
            Self::Overloaded => "overloaded",
            Self::BodyRead => "body_read",
            Self::Internal => "internal",
        }
    }
}

/// All metrics of the webhook, registered under the `gpuwarden_webhook_` prefix.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reviews: Family<ReviewLabels, Counter>,
    refused: Family<RefusedLabels, Counter>,
    duration: Histogram,
    in_flight: Gauge,
    cert_reloads: Counter,
    cert_reload_errors: Counter,
    cert_not_after: Gauge<f64, AtomicU64>,
    cache_synced: Family<CacheLabels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("gpuwarden_webhook");
        let reviews = Family::<ReviewLabels, Counter>::default();
        registry.register(
            "reviews",
            "AdmissionReviews answered by the engine, by outcome and governing policy",
            reviews.clone(),
        );
        let refused = Family::<RefusedLabels, Counter>::default();
        registry.register(
            "requests_refused",
            "Requests answered with a denial before reaching the engine, by reason",
            refused.clone(),
        );
        // 50 µs .. ~1.6 s: the engine takes microseconds, the API server gives up after 5 s.
        let duration = Histogram::new(exponential_buckets(0.000_05, 2.0, 16));
        registry.register(
            "review_duration_seconds",
            "Time from the request's arrival to its answer, body read included",
            duration.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "reviews_in_flight",
            "Requests on /mutate being read or answered right now",
            in_flight.clone(),
        );
        let cert_reloads = Counter::default();
        registry.register(
            "certificate_reloads",
            "Serving certificate pairs loaded from disk (the first load included)",
            cert_reloads.clone(),
        );
        let cert_reload_errors = Counter::default();
        registry.register(
            "certificate_reload_errors",
            "Certificate pairs on disk that could not be loaded (the previous pair stays in use)",
            cert_reload_errors.clone(),
        );
        let cert_not_after = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "certificate_not_after_timestamp_seconds",
            "Expiry (notAfter, Unix seconds) of the serving certificate in use; 0 before one is loaded",
            cert_not_after.clone(),
        );
        let cache_synced = Family::<CacheLabels, Gauge>::default();
        registry.register(
            "cache_synced",
            "1 once a policy/namespace cache finished its initial list",
            cache_synced.clone(),
        );
        Self {
            registry,
            reviews,
            refused,
            duration,
            in_flight,
            cert_reloads,
            cert_reload_errors,
            cert_not_after,
            cache_synced,
        }
    }

    /// Counts one review the engine answered.
    pub fn observe_review(&self, summary: &ReviewSummary) {
        let policy = summary
            .policy
            .as_deref()
            .map(policy_name)
            .unwrap_or("none")
            .to_string();
        self.reviews
            .get_or_create(&ReviewLabels {
                outcome: summary.outcome.as_str(),
                policy,
            })
            .inc();
    }

    /// Counts one request answered before it reached the engine.
    pub fn observe_refusal(&self, refusal: Refusal) {
        self.refused
            .get_or_create(&RefusedLabels {
                reason: refusal.as_str(),
            })
            .inc();
    }

    /// Records how long one request took to answer.
    pub fn observe_duration(&self, elapsed: Duration) {
        self.duration.observe(elapsed.as_secs_f64());
    }

    /// The in-flight gauge; hold the returned guard while a request is being handled.
    pub fn in_flight(&self) -> InFlight {
        self.in_flight.inc();
        InFlight(self.in_flight.clone())
    }

    /// Records a certificate pair loaded, with its expiry in Unix seconds.
    pub fn observe_cert_loaded(&self, not_after_unix: i64) {
        self.cert_reloads.inc();
        self.cert_not_after.set(not_after_unix as f64);
    }

    /// Records a certificate pair that could not be loaded.
    pub fn observe_cert_error(&self) {
        self.cert_reload_errors.inc();
    }

    /// Records whether `cache` finished its initial list.
    pub fn set_cache_synced(&self, cache: &'static str, synced: bool) {
        self.cache_synced
            .get_or_create(&CacheLabels { cache })
            .set(i64::from(synced));
    }

    /// Encodes every metric as OpenMetrics text.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::with_capacity(4096);
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// Decrements the in-flight gauge when dropped, so an aborted request cannot leak a count.
#[derive(Debug)]
pub struct InFlight(Gauge);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// `name@generation` → `name`.
fn policy_name(reference: &str) -> &str {
    reference
        .rsplit_once('@')
        .map_or(reference, |(name, _)| name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::Outcome;

    #[test]
    fn review_counter_uses_policy_name_without_generation() {
        let metrics = Metrics::new();
        let summary = ReviewSummary {
            uid: "u".into(),
            outcome: Outcome::Rewritten,
            policy: Some("default@7".into()),
            pod: Some("ml/train".into()),
        };
        metrics.observe_review(&summary);
        metrics.observe_review(&ReviewSummary {
            policy: Some("default@8".into()),
            ..summary
        });
        let text = metrics.encode().unwrap();
        assert!(
            text.contains(
                r#"gpuwarden_webhook_reviews_total{outcome="rewritten",policy="default"} 2"#
            ),
            "{text}"
        );
    }

    #[test]
    fn in_flight_guard_decrements_on_drop() {
        let metrics = Metrics::new();
        let a = metrics.in_flight();
        let b = metrics.in_flight();
        drop(a);
        assert!(
            metrics
                .encode()
                .unwrap()
                .contains("gpuwarden_webhook_reviews_in_flight 1")
        );
        drop(b);
        assert!(
            metrics
                .encode()
                .unwrap()
                .contains("gpuwarden_webhook_reviews_in_flight 0")
        );
    }
}
