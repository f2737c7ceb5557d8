//! gpuwarden node agent: reads the node's GPUs through NVML (or a fake file), judges their
//! health, learns from the kubelet which pod container was allocated which GPU and from
//! `/proc` which container really uses which GPU, writes the node's `GpuNode` status with
//! server-side apply, renews a liveness Lease, and serves per-pod GPU metrics.
//!
//! Pure parts (health, cgroup parsing, status computation, write decisions) are separate
//! from the edges (NVML threads, kubelet gRPC, Kubernetes API), so tests drive them without
//! a GPU or a cluster. [`agent::run`] runs the agent in-process against any
//! `kube::Client`; [`testing`] holds a fake kubelet pod-resources server.

pub mod agent;
pub mod backend;
pub mod backoff;
pub mod cdi;
pub mod cgroup;
pub mod fake;
pub mod health;
mod host;
pub mod http;
pub mod kai;
pub mod lease;
pub mod metrics;
pub mod nvml;
pub mod podresources;
pub mod pods;
pub mod policy;
pub mod posture;
pub mod runtime;
pub mod status;
pub mod testing;
pub mod vfio;
pub mod writer;

pub use agent::{AgentError, Config, InspectConfig, inspect, run};
