//! Helpers for gpuwarden's install tests: loading the manifests under `deploy/` as typed
//! documents, and (for the ignored end-to-end tests) driving a real cluster and its node.

pub mod bench;
pub mod cluster;
pub mod dra;
pub mod env;
pub mod helm;
pub mod image;
pub mod inproc;
pub mod install;
pub mod kubectl;
pub mod manifests;
pub mod node;
pub mod readme;
