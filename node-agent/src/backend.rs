//! What the agent reads from the GPUs, and the trait both backends (NVML and the fake)
//! implement. Readings are plain values so the rest of the agent is pure over them.

use async_trait::async_trait;
use gpuwarden_crds::DriverInfo;
use gpuwarden_crds::node::{MigDevice, MigMode};
use jiff::Timestamp;

/// One read of every GPU on the node.
#[derive(Clone, Debug, PartialEq)]
pub struct Reading {
    /// Driver, CUDA and NVML versions.
    pub driver: DriverInfo,
    /// The GPUs, in NVML index order.
    pub gpus: Vec<GpuReading>,
}

/// One GPU as read now.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuReading {
    /// Inventory: slow-changing facts.
    pub info: GpuInfo,
    /// False when NVML says the GPU is lost (fell off the bus, needs a reset).
    pub answering: bool,
    /// True for a GPU that has not answered once since the agent started: its identity is
    /// what its device handle and the driver's files still give, not a full reading.
    pub never_answered: bool,
    /// Fast-changing readings, exported as metrics only.
    pub telemetry: Telemetry,
    /// Volatile uncorrected ECC error count (since the driver loaded), when supported.
    pub ecc_uncorrected: Option<u64>,
    /// Whether pages wait for retirement (a reset is needed), when supported (before Ampere).
    pub pages_pending_retirement: Option<bool>,
    /// Whether rows wait to be remapped (a reset is needed), when supported (Ampere and later,
    /// where row remapping replaces page retirement).
    pub row_remapping_pending: Option<bool>,
    /// Whether a row remapping failed (the GPU needs service), when supported.
    pub row_remapping_failed: Option<bool>,
    /// Compute processes running on this GPU or its MIG devices.
    pub processes: Vec<GpuProcess>,
}

/// Inventory of one GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuInfo {
    /// NVML index.
    pub index: u32,
    /// GPU UUID.
    pub uuid: String,
    /// Product name.
    pub model: String,
    /// Total memory in MiB.
    pub memory_mib: u64,
    /// PCI bus id.
    pub pci_bus_id: String,
    /// Minor number of `/dev/nvidia<N>`.
    pub minor_number: Option<u32>,
    /// MIG mode, when the GPU supports MIG.
    pub mig_mode: Option<MigMode>,
    /// MIG devices, in MIG index order.
    pub mig_devices: Vec<MigDevice>,
}

/// Per-poll readings; never written to the API, only to metrics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Telemetry {
    /// GPU utilisation, percent.
    pub utilization_percent: Option<u32>,
    /// Memory in use, bytes.
    pub memory_used_bytes: Option<u64>,
    /// Die temperature, degrees Celsius.
    pub temperature_celsius: Option<u32>,
    /// Power draw, watts.
    pub power_watts: Option<f64>,
}

/// A compute process on a GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuProcess {
    /// Process id as the host (or the agent's PID namespace) sees it.
    pub pid: u32,
    /// UUID of the GPU, or of the MIG device, the process runs on.
    pub device_uuid: String,
    /// GPU memory the process holds, bytes.
    pub used_memory_bytes: Option<u64>,
    /// Its share of the GPU's SM time in NVML's latest process utilisation sample,
    /// percent; `None` where NVML gives no per-process samples (MIG devices, older GPUs).
    pub sm_util_percent: Option<u32>,
    /// The content of `/proc/<pid>/cgroup` when the backend already knows it (the fake);
    /// `None` means the agent reads it from the host.
    pub cgroup: Option<String>,
}

/// Something that happened to a GPU between two reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuEvent {
    /// UUID of the GPU.
    pub uuid: String,
    /// When it was seen.
    pub at: Timestamp,
    /// What it was.
    pub kind: GpuEventKind,
}

/// Kinds of GPU events that bear on health.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuEventKind {
    /// An XID error with its code.
    Xid(u64),
    /// An uncorrectable (double-bit) ECC error.
    EccUncorrected,
    /// The GPU fell off the bus.
    Lost,
}

/// Errors of a GPU backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// `libnvidia-ml.so.1` is missing or NVML did not initialise.
    #[error("NVML is not available: {detail}; {advice}")]
    NvmlUnavailable {
        /// What NVML said.
        detail: String,
        /// What to check: in a pod the NVIDIA runtime hands over NVML, on a host the driver.
        advice: &'static str,
    },
    /// An NVML call that the whole read depends on failed.
    #[error("NVML call {call} failed")]
    Nvml {
        /// The NVML call.
        call: &'static str,
        /// NVML's error.
        #[source]
        source: nvml_wrapper::error::NvmlError,
    },
    /// NVML did not answer in time.
    #[error("NVML did not answer within {after:?}")]
    Timeout {
        /// The limit.
        after: std::time::Duration,
    },
    /// The NVML worker thread is gone (it panicked or could not start).
    #[error("the NVML worker thread stopped")]
    WorkerStopped,
    /// The fake backend's file could not be read.
    #[error("failed to read fake GPU file {path}")]
    FakeRead {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The fake backend's file is not valid.
    #[error("invalid fake GPU file {path}: {problem}")]
    FakeInvalid {
        /// The file.
        path: String,
        /// What is wrong.
        problem: String,
    },
}

/// A source of GPU readings: NVML on a real node, a file in tests and previews.
///
/// Implementations must not block the async runtime: NVML calls happen on threads of the
/// backend's own.
#[async_trait]
pub trait GpuBackend: Send + Sync {
    /// A short name for logs and metrics (`nvml`, `fake`).
    fn name(&self) -> &'static str;

    /// Reads inventory, telemetry and processes of every GPU. `now` is the agent's clock
    /// (the fake replays its script against it; NVML ignores it).
    async fn read(&self, now: Timestamp) -> Result<Reading, BackendError>;

    /// Events seen since the last call, oldest first. Never blocks.
    fn take_events(&self, now: Timestamp) -> Vec<GpuEvent>;
}
