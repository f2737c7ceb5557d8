//! gpuwarden's mutating admission webhook: a pure rewrite engine, the AdmissionReview adapter
//! around it, the HTTPS server, and the offline `mutate` command.

pub mod admission;
pub mod cache;
pub mod engine;
pub mod kubevirt;
pub mod manifest;
pub mod metrics;
pub mod mutate;
pub mod nim;
pub mod patch;
pub mod pod;
pub mod report;
pub mod server;
pub mod shutdown;
pub mod tls;
