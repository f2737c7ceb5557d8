//! `/healthz`, `/readyz` and `/metrics` on the plain-HTTP health port.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::{CONTENT_TYPE, Metrics};

/// What the health endpoints report.
#[derive(Clone, Debug)]
pub struct HealthState {
    /// Metrics served on `/metrics`.
    pub metrics: Arc<Metrics>,
    /// Set once every cache has synced; a standby is ready too.
    pub ready: Arc<AtomicBool>,
}

/// The health router.
pub fn router(state: HealthState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn readyz(State(s): State<HealthState>) -> impl IntoResponse {
    if s.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "caches not synced")
    }
}

async fn metrics(State(s): State<HealthState>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], s.metrics.encode())
}
