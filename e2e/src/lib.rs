//! Helpers for gpuwarden's install tests: loading the manifests under `deploy/` as typed
//! documents, and (for the ignored end-to-end tests) driving a real cluster.

pub mod cluster;
pub mod image;
pub mod manifests;
pub mod readme;
