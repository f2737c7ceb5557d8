//! gpuwarden operator: one GpuNode per GPU node with its conditions and summary, GpuPolicy
//! validation, the webhook's certificates, all behind Lease-based leader election.
//!
//! The pure core lives in [`gpunode`], [`policy`] and [`certs`]; the reconcilers in
//! [`node_controller`], [`policy_controller`] and [`webhook_certs`] read caches, call the core
//! and write only differences; [`run`] wires watches, leader election and the health server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;

pub mod admission_policies;
pub mod certs;
pub mod claim_templates;
pub mod feeds;
pub mod gpunode;
pub mod health;
pub mod leader;
pub mod metrics;
pub mod node_controller;
pub mod node_reports;
pub mod policy_controller;
pub mod reports;
mod runner;
pub mod uninstall;
pub mod webhook_certs;
pub mod webhook_conditions;
pub mod wiring;

pub use feeds::trim_node;
pub use leader::Leadership;
pub use runner::{RunError, run, run_with};

/// The current time. Production uses the system clock; tests inject their own.
pub type Clock = Arc<dyn Fn() -> Timestamp + Send + Sync>;

/// The system clock.
pub fn system_clock() -> Clock {
    Arc::new(Timestamp::now)
}

/// Settings of one operator replica.
#[derive(Clone, Debug)]
pub struct Config {
    /// Namespace of the operator, the webhook Secret and the leader Lease.
    pub namespace: String,
    /// Address of `/healthz`, `/readyz` and `/metrics`.
    pub health_listen: SocketAddr,
    /// Keep the webhook's CA, serving certificate and `caBundle` (off for cert-manager).
    pub manage_webhook_certificates: bool,
    /// Taint nodes `gpuwarden.io/gpu-unhealthy:NoSchedule` while `Healthy=False`.
    pub taint_unhealthy_nodes: bool,
    /// Keep the MutatingAdmissionPolicies (and Audit-mode ValidatingAdmissionPolicies)
    /// rendered from the GpuPolicies, where the API server serves them.
    pub admission_policies: bool,
    /// Keep one PolicyReport (and openreports.io Report) per governed namespace, where the
    /// API server serves either kind; this watches every Pod.
    pub policy_reports: bool,
    /// Elect a leader through a Lease; off runs as the only writer.
    pub leader_election: bool,
    /// Most reconciles in flight per controller.
    pub concurrency: u16,
    /// Lifetime of the webhook serving certificate.
    pub cert_validity: Duration,
    /// This replica's identity in the leader Lease (the pod name).
    pub identity: String,
}

impl Config {
    /// Defaults for `namespace`, as the flags document them.
    pub fn new(namespace: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            health_listen: SocketAddr::from(([0, 0, 0, 0], gpuwarden_crds::install::HEALTH_PORT)),
            manage_webhook_certificates: true,
            taint_unhealthy_nodes: false,
            admission_policies: true,
            policy_reports: true,
            leader_election: true,
            concurrency: 16,
            cert_validity: Duration::from_secs(365 * 86400),
            identity: format!("gpuwarden-operator-{}", std::process::id()),
        }
    }
}

/// A bounded label for an API error, used in metrics and to tell transient from permanent.
pub fn api_error_kind(e: &kube::Error) -> &'static str {
    match e {
        kube::Error::Api(s) => match s.code {
            400 | 422 => "invalid",
            401 | 403 => "forbidden",
            404 => "not_found",
            409 => "conflict",
            429 => "throttled",
            500..=599 => "server",
            _ => "api",
        },
        _ => "transport",
    }
}
