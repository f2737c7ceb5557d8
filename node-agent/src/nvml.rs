//! The NVML backend. NVML calls block, so they run on threads of their own: a worker thread
//! owns the `Nvml` handle and answers read requests over a channel, and a second thread
//! waits on an NVML event set for XID and ECC events. The async runtime only awaits replies.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::time::Duration;

use async_trait::async_trait;
use gpuwarden_crds::DriverInfo;
use gpuwarden_crds::node::{MigDevice, MigMode};
use jiff::Timestamp;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::enums::device::{SampleValue, UsedGpuMemory};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::FieldValueSample;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::sys_exports::field_id::{
    NVML_FI_DEV_REMAPPED_FAILURE, NVML_FI_DEV_REMAPPED_PENDING,
};
use nvml_wrapper::{Device, Nvml};
use tokio::sync::oneshot;

use crate::backend::{
    BackendError, GpuBackend, GpuEvent, GpuEventKind, GpuInfo, GpuProcess, GpuReading, Reading,
    Telemetry,
};

const MIB: u64 = 1024 * 1024;
/// How long the event thread waits per call, so it notices a stop request.
const EVENT_WAIT_MS: u32 = 5_000;
/// How long a read may take before the sweep gives up on it (a hung GPU can block NVML).
const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// `NVML_DEVICE_MIG_ENABLE` in `nvml.h`.
const NVML_DEVICE_MIG_ENABLE: u32 = 1;

type ReadReply = oneshot::Sender<Result<Reading, BackendError>>;

/// The NVML backend.
pub struct NvmlBackend {
    requests: Mutex<mpsc::Sender<ReadReply>>,
    events: Mutex<mpsc::Receiver<GpuEvent>>,
    stop: Arc<AtomicBool>,
}

/// The service-account token the kubelet mounts into a pod's containers.
pub const SERVICE_ACCOUNT_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

/// What to do about a missing NVML outside a pod.
pub const ADVICE_HOST: &str = "run on a GPU node with the NVIDIA driver, or pass --fake FILE";
/// What a missing library means in a pod: the image has no NVML, the NVIDIA container runtime
/// injects the host driver's, and it did not.
pub const ADVICE_POD_RUNTIME: &str = "in a pod the NVIDIA container runtime injects NVML and \
     the GPU devices, and did not: it is not the node's default runtime (set runtimeClassName, \
     e.g. nvidia, in the pod spec of deploy/node-agent/node-agent.yaml), or it ignores \
     NVIDIA_VISIBLE_DEVICES in unprivileged containers (apply the component \
     deploy/components/node-agent-privileged)";
/// What a driver that is not loaded means in a pod: the runtime did its part.
pub const ADVICE_POD_DRIVER: &str = "the NVIDIA runtime injected NVML, so check the NVIDIA \
     driver on this node (the GPU Operator's driver pod, or nvidia-smi on the host)";

/// Whether this process runs in a Kubernetes pod: the kubelet sets `KUBERNETES_SERVICE_HOST`
/// in every container, and mounts a service-account token unless told not to.
pub fn in_pod() -> bool {
    std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
        || std::path::Path::new(SERVICE_ACCOUNT_TOKEN).exists()
}

/// The one-line error for a node without NVML. `in_pod` picks the advice: in a pod NVML comes
/// from the NVIDIA container runtime, so "install the driver" would send a person to the wrong
/// place.
pub fn unavailable(e: &NvmlError, in_pod: bool) -> BackendError {
    let (detail, advice) = match e {
        NvmlError::LibloadingError(_) | NvmlError::LibraryNotFound => (
            format!("libnvidia-ml.so.1 could not be loaded ({e})"),
            ADVICE_POD_RUNTIME,
        ),
        NvmlError::DriverNotLoaded => (
            format!("the NVIDIA kernel driver is not loaded ({e})"),
            ADVICE_POD_DRIVER,
        ),
        NvmlError::NoPermission => (
            format!("no permission to open the GPU devices ({e})"),
            ADVICE_POD_RUNTIME,
        ),
        other => (
            format!("NVML failed to initialise ({other})"),
            ADVICE_POD_RUNTIME,
        ),
    };
    BackendError::NvmlUnavailable {
        detail,
        advice: if in_pod { advice } else { ADVICE_HOST },
    }
}

impl NvmlBackend {
    /// Loads NVML on the worker thread and starts the event thread. Fails with
    /// [`BackendError::NvmlUnavailable`] when `libnvidia-ml.so.1` or the driver is missing.
    pub async fn start() -> Result<Self, BackendError> {
        let (init_tx, init_rx) = oneshot::channel();
        let (req_tx, req_rx) = mpsc::channel::<ReadReply>();
        std::thread::Builder::new()
            .name("nvml".into())
            .spawn(move || {
                let nvml = match Nvml::init() {
                    Ok(n) => n,
                    Err(e) => {
                        let _ = init_tx.send(Err(unavailable(&e, in_pod())));
                        return;
                    }
                };
                let _ = init_tx.send(Ok(()));
                let mut known: HashMap<u32, GpuInfo> = HashMap::new();
                while let Ok(reply) = req_rx.recv() {
                    // A caller that timed out while NVML hung is gone; skip its read.
                    if reply.is_closed() {
                        continue;
                    }
                    let _ = reply.send(read_all(&nvml, &mut known));
                }
            })
            .map_err(|_| BackendError::WorkerStopped)?;
        init_rx.await.map_err(|_| BackendError::WorkerStopped)??;

        let (ev_tx, ev_rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let stop_events = stop.clone();
        std::thread::Builder::new()
            .name("nvml-events".into())
            .spawn(move || {
                // A handle of its own: NVML counts initialisations, and EventSet::wait must
                // not hold up the reads.
                match Nvml::init() {
                    Ok(nvml) => watch_events(&nvml, &ev_tx, &stop_events),
                    Err(e) => tracing::warn!(error = %e, "NVML event thread could not start; XID events are not watched"),
                }
            })
            .map_err(|_| BackendError::WorkerStopped)?;
        Ok(Self {
            requests: Mutex::new(req_tx),
            events: Mutex::new(ev_rx),
            stop,
        })
    }
}

impl Drop for NvmlBackend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[async_trait]
impl GpuBackend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    async fn read(&self, _now: Timestamp) -> Result<Reading, BackendError> {
        let (tx, rx) = oneshot::channel();
        self.requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(tx)
            .map_err(|_| BackendError::WorkerStopped)?;
        match tokio::time::timeout(READ_TIMEOUT, rx).await {
            Ok(reply) => reply.map_err(|_| BackendError::WorkerStopped)?,
            Err(_) => Err(BackendError::Timeout {
                after: READ_TIMEOUT,
            }),
        }
    }

    fn take_events(&self, _now: Timestamp) -> Vec<GpuEvent> {
        let rx = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        rx.try_iter().collect()
    }
}

fn read_all(nvml: &Nvml, known: &mut HashMap<u32, GpuInfo>) -> Result<Reading, BackendError> {
    let call = |call: &'static str| move |source| BackendError::Nvml { call, source };
    let cuda = nvml.sys_cuda_driver_version().ok().map(|v| {
        format!(
            "{}.{}",
            nvml_wrapper::cuda_driver_version_major(v),
            nvml_wrapper::cuda_driver_version_minor(v)
        )
    });
    let driver = DriverInfo {
        driver_version: nvml
            .sys_driver_version()
            .map_err(call("nvmlSystemGetDriverVersion"))?,
        cuda_driver_version: cuda,
        nvml_version: nvml.sys_nvml_version().ok(),
    };
    let count = nvml.device_count().map_err(call("nvmlDeviceGetCount"))?;
    let mut gpus = Vec::with_capacity(count as usize);
    // The driver's own GPU listing, read once per read and only for a GPU that is lost.
    let mut listed: Option<Vec<DriverGpu>> = None;
    for index in 0..count {
        let read = nvml
            .device_by_index(index)
            .and_then(|dev| read_gpu(&dev, index));
        match read {
            Ok(gpu) => {
                known.insert(index, gpu.info.clone());
                gpus.push(gpu);
            }
            Err(e) => {
                tracing::warn!(gpu = index, error = %e, "GPU does not answer NVML");
                let handle = nvml.device_by_index(index).ok();
                let partial = PartialIdentity {
                    uuid: handle.as_ref().and_then(|d| d.uuid().ok()),
                    pci_bus_id: handle
                        .as_ref()
                        .and_then(|d| d.pci_info().ok())
                        .map(|p| p.bus_id),
                    minor_number: handle.as_ref().and_then(|d| d.minor_number().ok()),
                };
                let (info, never_answered) = lost_identity(
                    index,
                    known.get(&index),
                    partial,
                    listed.get_or_insert_with(driver_gpus),
                );
                gpus.push(GpuReading {
                    info,
                    answering: false,
                    never_answered,
                    telemetry: Telemetry::default(),
                    ecc_uncorrected: None,
                    pages_pending_retirement: None,
                    row_remapping_pending: None,
                    row_remapping_failed: None,
                    processes: Vec::new(),
                });
            }
        }
    }
    Ok(Reading { driver, gpus })
}

/// What a GPU's device handle still gives when the GPU does not answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct PartialIdentity {
    uuid: Option<String>,
    pci_bus_id: Option<String>,
    minor_number: Option<u32>,
}

/// A GPU as the driver lists it under `/proc/driver/nvidia/gpus/<bus id>/information`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct DriverGpu {
    model: String,
    uuid: String,
    bus_location: String,
    minor_number: Option<u32>,
}

/// Reads one `information` file: `Key: value` lines (`Model`, `GPU UUID`, `Bus Location`,
/// `Device Minor`); other lines are skipped.
fn parse_driver_information(text: &str) -> DriverGpu {
    let mut gpu = DriverGpu::default();
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match key.trim() {
            "Model" => gpu.model = value.to_owned(),
            "GPU UUID" => gpu.uuid = value.to_owned(),
            "Bus Location" => gpu.bus_location = value.to_owned(),
            "Device Minor" => gpu.minor_number = value.parse().ok(),
            _ => {}
        }
    }
    gpu
}

/// The GPUs the driver lists, or none where its files cannot be read.
fn driver_gpus() -> Vec<DriverGpu> {
    let Ok(entries) = std::fs::read_dir("/proc/driver/nvidia/gpus") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("information")).ok())
        .map(|text| parse_driver_information(&text))
        .collect()
}

/// A PCI bus id in one spelling: lower case, with a four-digit domain (NVML writes
/// `00000000:3B:00.0`, the driver's files `0000:3b:00.0`).
fn bus_id_key(bus_id: &str) -> String {
    let lower = bus_id.to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => lower,
    }
}

/// The identity of GPU `index`, which does not answer NVML: the one it had when it last
/// answered; or, for a GPU never seen answering, what its device handle still gives, filled
/// in from the driver's own listing (matched by PCI bus id, else by minor number). The flag
/// says the GPU never answered.
fn lost_identity(
    index: u32,
    known: Option<&GpuInfo>,
    handle: PartialIdentity,
    driver: &[DriverGpu],
) -> (GpuInfo, bool) {
    if let Some(info) = known {
        return (info.clone(), false);
    }
    let listed = driver
        .iter()
        .find(|g| {
            handle
                .pci_bus_id
                .as_deref()
                .is_some_and(|id| bus_id_key(id) == bus_id_key(&g.bus_location))
        })
        .or_else(|| {
            driver
                .iter()
                .find(|g| handle.minor_number.is_some() && g.minor_number == handle.minor_number)
        });
    let uuid = handle
        .uuid
        .or_else(|| listed.map(|g| g.uuid.clone()).filter(|u| !u.is_empty()))
        .unwrap_or_else(|| format!("unknown-gpu-{index}"));
    let info = GpuInfo {
        index,
        uuid,
        model: listed.map(|g| g.model.clone()).unwrap_or_default(),
        pci_bus_id: handle
            .pci_bus_id
            .or_else(|| listed.map(|g| g.bus_location.clone()))
            .unwrap_or_default(),
        minor_number: handle.minor_number.or(listed.and_then(|g| g.minor_number)),
        ..Default::default()
    };
    (info, true)
}

/// The GPU and compute instance ids of a MIG device, where its UUID carries them: drivers
/// before R470 name MIG devices `MIG-GPU-<gpu uuid>/<gi>/<ci>`. Later drivers write
/// `MIG-<uuid>`, and NVML answers the ids only through `nvmlDeviceGetGpuInstanceId` and
/// `nvmlDeviceGetComputeInstanceId`, which nvml-wrapper 0.13 does not wrap (and this
/// workspace calls no unsafe code), so they stay unknown there.
fn mig_instance_ids(uuid: &str) -> (Option<u32>, Option<u32>) {
    let Some(rest) = uuid.strip_prefix("MIG-GPU-") else {
        return (None, None);
    };
    let mut parts = rest.rsplitn(3, '/');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(ci), Some(gi), Some(_gpu)) => match (gi.parse(), ci.parse()) {
            (Ok(gi), Ok(ci)) => (Some(gi), Some(ci)),
            _ => (None, None),
        },
        _ => (None, None),
    }
}

fn mig_mode_name(mode: u32) -> String {
    if mode == NVML_DEVICE_MIG_ENABLE {
        "Enabled".into()
    } else {
        "Disabled".into()
    }
}

fn read_gpu(dev: &Device<'_>, index: u32) -> Result<GpuReading, NvmlError> {
    let uuid = dev.uuid()?;
    let memory = dev.memory_info()?;
    let mig_mode = match dev.mig_mode() {
        Ok(m) => Some(MigMode {
            current: mig_mode_name(m.current),
            pending: mig_mode_name(m.pending),
        }),
        Err(NvmlError::NotSupported) => None,
        Err(e) => return Err(e),
    };
    let mig_enabled = mig_mode.as_ref().is_some_and(|m| m.current == "Enabled");
    let mut mig_devices = Vec::new();
    let mut processes = Vec::new();
    if mig_enabled {
        let slots = dev.mig_device_count().unwrap_or(0);
        for slot in 0..slots {
            let Ok(mig) = dev.mig_device_by_index(slot) else {
                continue; // an empty slot
            };
            let Ok(mig_uuid) = mig.uuid() else { continue };
            let (gpu_instance_id, compute_instance_id) = mig_instance_ids(&mig_uuid);
            mig_devices.push(MigDevice {
                uuid: mig_uuid.clone(),
                profile: mig.name().ok().and_then(|n| mig_profile(&n)),
                gpu_instance_id,
                compute_instance_id,
                memory_mi_b: mig.memory_info().ok().map(|m| m.total / MIB),
            });
            processes.extend(compute_processes(&mig, &mig_uuid));
        }
    } else {
        processes = compute_processes(dev, &uuid);
        attribute_utilization(dev, &mut processes);
    }
    let remapping = row_remapping(dev);
    Ok(GpuReading {
        info: GpuInfo {
            index,
            uuid,
            model: dev.name()?,
            memory_mib: memory.total / MIB,
            pci_bus_id: dev.pci_info().map(|p| p.bus_id).unwrap_or_default(),
            minor_number: dev.minor_number().ok(),
            mig_mode,
            mig_devices,
        },
        answering: true,
        never_answered: false,
        telemetry: Telemetry {
            utilization_percent: dev.utilization_rates().ok().map(|u| u.gpu),
            memory_used_bytes: Some(memory.used),
            temperature_celsius: dev.temperature(TemperatureSensor::Gpu).ok(),
            power_watts: dev.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
        },
        ecc_uncorrected: dev
            .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            .ok(),
        pages_pending_retirement: dev.are_pages_pending_retired().ok(),
        row_remapping_pending: remapping[0],
        row_remapping_failed: remapping[1],
        processes,
    })
}

/// Row remapping's pending and failure flags, each `None` where the GPU does not report it
/// (before Ampere, or a driver without the fields). Read as NVML field values, one call.
fn row_remapping(dev: &Device<'_>) -> [Option<bool>; 2] {
    let ids = [
        FieldId(NVML_FI_DEV_REMAPPED_PENDING),
        FieldId(NVML_FI_DEV_REMAPPED_FAILURE),
    ];
    match dev.field_values_for(&ids) {
        Ok(samples) => {
            let mut flags = [None; 2];
            for (flag, sample) in flags.iter_mut().zip(samples) {
                *flag = sample.ok().and_then(|s| flag_value(&s));
            }
            flags
        }
        Err(_) => [None; 2],
    }
}

/// A field value read as a flag: non-zero is set.
fn flag_value(sample: &FieldValueSample) -> Option<bool> {
    match sample.value.as_ref().ok()? {
        SampleValue::U32(v) => Some(*v != 0),
        SampleValue::U64(v) => Some(*v != 0),
        SampleValue::I64(v) => Some(*v != 0),
        SampleValue::F64(v) => Some(*v != 0.0),
    }
}

fn compute_processes(dev: &Device<'_>, device_uuid: &str) -> Vec<GpuProcess> {
    match dev.running_compute_processes() {
        Ok(list) => list
            .into_iter()
            .map(|p| GpuProcess {
                pid: p.pid,
                device_uuid: device_uuid.to_owned(),
                used_memory_bytes: match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => Some(b),
                    UsedGpuMemory::Unavailable => None,
                },
                sm_util_percent: None,
                cgroup: None,
            })
            .collect(),
        Err(e) => {
            tracing::debug!(device = device_uuid, error = %e, "no process list");
            Vec::new()
        }
    }
}

/// Sets each process's share of SM time from NVML's buffered process utilisation samples
/// (the latest per process). NVML samples only processes that used the GPU in the period, so
/// one without a sample used none of it. Where NVML has no samples to give (MIG, older GPUs),
/// the shares stay unknown.
fn attribute_utilization(dev: &Device<'_>, processes: &mut [GpuProcess]) {
    let samples = match dev.process_utilization_stats(None) {
        Ok(samples) => samples,
        Err(e) => {
            tracing::debug!(error = %e, "no process utilisation samples");
            return;
        }
    };
    let mut latest: HashMap<u32, (u64, u32)> = HashMap::new();
    for s in samples {
        let entry = latest.entry(s.pid).or_insert((s.timestamp, s.sm_util));
        if s.timestamp >= entry.0 {
            *entry = (s.timestamp, s.sm_util);
        }
    }
    for p in processes {
        p.sm_util_percent = Some(latest.get(&p.pid).map_or(0, |&(_, util)| util.min(100)));
    }
}

/// `NVIDIA H100 80GB HBM3 MIG 1g.10gb` → `1g.10gb`.
fn mig_profile(name: &str) -> Option<String> {
    name.rsplit_once("MIG ").map(|(_, p)| p.trim().to_owned())
}

fn watch_events(nvml: &Nvml, tx: &mpsc::Sender<GpuEvent>, stop: &AtomicBool) {
    let wanted = EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR;
    let count = match nvml.device_count() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "XID events are not watched");
            return;
        }
    };
    let mut registered: Vec<u32> = Vec::new();
    let mut set = match nvml.create_event_set() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "XID events are not watched");
            return;
        }
    };
    for index in 0..count {
        let Ok(dev) = nvml.device_by_index(index) else {
            continue;
        };
        let types = dev.supported_event_types().unwrap_or(EventTypes::empty()) & wanted;
        if types.is_empty() {
            continue;
        }
        match dev.register_events(types, set) {
            Ok(s) => {
                set = s;
                registered.push(index);
            }
            Err(e) => {
                // NVML frees the set on failure: start a new one with the GPUs that worked.
                tracing::warn!(gpu = index, error = %e, "XID events of this GPU are not watched");
                set = match rebuild(nvml, &registered, wanted) {
                    Some(s) => s,
                    None => return,
                };
            }
        }
    }
    tracing::info!(gpus = registered.len(), "watching XID and ECC events");
    while !stop.load(Ordering::Relaxed) {
        match set.wait(EVENT_WAIT_MS) {
            Ok(data) => {
                let uuid = event_gpu_uuid(&data.device);
                let at = Timestamp::now();
                let send = |kind| {
                    let _ = tx.send(GpuEvent {
                        uuid: uuid.clone(),
                        at,
                        kind,
                    });
                };
                if data.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
                    let code = match data.event_data {
                        Some(XidError::Value(v)) => v,
                        _ => 0,
                    };
                    send(GpuEventKind::Xid(code));
                }
                if data.event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
                    send(GpuEventKind::EccUncorrected);
                }
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => {
                // GpuLost and friends: the next read marks the GPU; avoid a hot loop.
                tracing::warn!(error = %e, "waiting for NVML events failed");
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    }
}

fn rebuild<'n>(
    nvml: &'n Nvml,
    indexes: &[u32],
    wanted: EventTypes,
) -> Option<nvml_wrapper::EventSet<'n>> {
    let mut set = nvml.create_event_set().ok()?;
    for &index in indexes {
        let dev = nvml.device_by_index(index).ok()?;
        let types = dev.supported_event_types().unwrap_or(EventTypes::empty()) & wanted;
        set = dev.register_events(types, set).ok()?;
    }
    Some(set)
}

/// The physical GPU's UUID for an event on a GPU or on one of its MIG devices.
fn event_gpu_uuid(dev: &Device<'_>) -> String {
    if dev.mig_is_mig_device_handle().unwrap_or(false)
        && let Ok(parent) = dev.mig_parent_device()
        && let Ok(uuid) = parent.uuid()
    {
        return uuid;
    }
    dev.uuid().unwrap_or_else(|_| "unknown-gpu".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `/proc/driver/nvidia/gpus/0000:3b:00.0/information` as the 550 driver writes it.
    const INFORMATION: &str = "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 335\n\
        GPU UUID: \t GPU-5f4f1ca4-8c51-1c2c-9b1e-0d3a9b0e7c11\nVideo BIOS: \t 96.00.89.00.01\n\
        Bus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\n\
        Bus Location: \t 0000:3b:00.0\nDevice Minor: \t 2\nGPU Firmware: \t 550.54.15\n\
        GPU Excluded:\t No\n";

    #[test]
    fn a_lost_gpu_seen_before_keeps_its_last_identity() {
        let seen = GpuInfo {
            index: 1,
            uuid: "GPU-seen".into(),
            model: "NVIDIA H100 80GB HBM3".into(),
            memory_mib: 81559,
            pci_bus_id: "00000000:3B:00.0".into(),
            minor_number: Some(2),
            ..Default::default()
        };
        let (info, never) = lost_identity(1, Some(&seen), PartialIdentity::default(), &[]);
        assert_eq!((info, never), (seen, false));
    }

    #[test]
    fn a_gpu_lost_before_its_first_answer_keeps_what_nvml_and_the_driver_still_give() {
        let listed = [parse_driver_information(INFORMATION)];
        assert_eq!(
            listed[0],
            DriverGpu {
                model: "NVIDIA H100 80GB HBM3".into(),
                uuid: "GPU-5f4f1ca4-8c51-1c2c-9b1e-0d3a9b0e7c11".into(),
                bus_location: "0000:3b:00.0".into(),
                minor_number: Some(2),
            }
        );
        // The handle gives the bus id (NVML's spelling): the driver's listing gives the rest.
        let handle = PartialIdentity {
            pci_bus_id: Some("00000000:3B:00.0".into()),
            ..Default::default()
        };
        let (info, never) = lost_identity(1, None, handle, &listed);
        assert!(never);
        assert_eq!(info.index, 1);
        assert_eq!(info.uuid, "GPU-5f4f1ca4-8c51-1c2c-9b1e-0d3a9b0e7c11");
        assert_eq!(info.model, "NVIDIA H100 80GB HBM3");
        assert_eq!(info.pci_bus_id, "00000000:3B:00.0");
        assert_eq!(info.minor_number, Some(2));
        // Only the minor number: matched by it.
        let handle = PartialIdentity {
            minor_number: Some(2),
            ..Default::default()
        };
        let (info, _) = lost_identity(1, None, handle, &listed);
        assert_eq!(info.pci_bus_id, "0000:3b:00.0");
        // A UUID from the handle wins; nothing at all leaves the index and a placeholder.
        let handle = PartialIdentity {
            uuid: Some("GPU-handle".into()),
            ..Default::default()
        };
        assert_eq!(lost_identity(1, None, handle, &listed).0.uuid, "GPU-handle");
        let (info, never) = lost_identity(3, None, PartialIdentity::default(), &listed);
        assert!(never);
        assert_eq!((info.index, info.uuid.as_str()), (3, "unknown-gpu-3"));
        assert_eq!(info.model, "");
    }

    #[test]
    fn mig_instance_ids_from_legacy_uuids_only() {
        assert_eq!(
            mig_instance_ids("MIG-GPU-8f2c3b1a-1111-2222-3333-444455556666/7/0"),
            (Some(7), Some(0))
        );
        assert_eq!(
            mig_instance_ids("MIG-2a3b4c5d-aaaa-bbbb-cccc-ddddeeeeffff"),
            (None, None)
        );
        assert_eq!(mig_instance_ids("MIG-GPU-x/a/0"), (None, None));
        assert_eq!(mig_instance_ids("MIG-GPU-x/1"), (None, None));
    }

    #[test]
    fn mig_profile_from_name() {
        assert_eq!(
            mig_profile("NVIDIA H100 80GB HBM3 MIG 1g.10gb").as_deref(),
            Some("1g.10gb")
        );
        assert_eq!(mig_profile("NVIDIA H100"), None);
    }

    #[test]
    fn unavailable_message_is_one_clear_line() {
        let e = unavailable(&NvmlError::LibraryNotFound, false).to_string();
        assert!(
            e.starts_with("NVML is not available: libnvidia-ml.so.1 could not be loaded")
                && e.ends_with("run on a GPU node with the NVIDIA driver, or pass --fake FILE")
                && !e.contains('\n'),
            "{e}"
        );
    }

    /// In a pod a missing library is the runtime's doing, not a missing driver: the message
    /// names the two ways that happens and where to fix each, and no longer sends a person to
    /// install a driver or pass a fake file.
    #[test]
    fn unavailable_in_a_pod_names_the_runtime_causes() {
        for e in [
            NvmlError::LibraryNotFound,
            NvmlError::NoPermission,
            NvmlError::Unknown,
        ] {
            let msg = unavailable(&e, true).to_string();
            assert!(msg.starts_with("NVML is not available: "), "{msg}");
            for needle in [
                "not the node's default runtime",
                "runtimeClassName",
                "deploy/node-agent/node-agent.yaml",
                "ignores NVIDIA_VISIBLE_DEVICES in unprivileged containers",
                "deploy/components/node-agent-privileged",
            ] {
                assert!(msg.contains(needle), "{needle}: {msg}");
            }
            assert!(!msg.contains("--fake") && !msg.contains('\n'), "{msg}");
        }
        let driver = unavailable(&NvmlError::DriverNotLoaded, true).to_string();
        assert!(
            driver.contains("driver is not loaded") && driver.contains("check the NVIDIA driver"),
            "{driver}"
        );
        assert!(!driver.contains("runtimeClassName"), "{driver}");
    }

    /// The paths the pod advice names exist, and the DaemonSet has the commented-out
    /// runtimeClassName it tells a person to set.
    #[test]
    fn the_pod_advice_names_real_places() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let daemonset =
            std::fs::read_to_string(root.join("deploy/node-agent/node-agent.yaml")).unwrap();
        assert!(
            daemonset.contains("# runtimeClassName: nvidia"),
            "the DaemonSet no longer shows where runtimeClassName goes"
        );
        assert!(
            root.join("deploy/components/node-agent-privileged/kustomization.yaml")
                .is_file()
        );
    }

    #[test]
    fn field_values_read_as_flags() {
        let sample = |value| FieldValueSample {
            field: FieldId(NVML_FI_DEV_REMAPPED_PENDING),
            timestamp: 0,
            latency: 0,
            value,
        };
        assert_eq!(flag_value(&sample(Ok(SampleValue::U32(1)))), Some(true));
        assert_eq!(flag_value(&sample(Ok(SampleValue::U64(0)))), Some(false));
        assert_eq!(flag_value(&sample(Ok(SampleValue::I64(2)))), Some(true));
        assert_eq!(flag_value(&sample(Err(NvmlError::NotSupported))), None);
    }

    /// On a machine without the NVIDIA driver the real start fails with the clear error.
    #[tokio::test]
    async fn start_without_driver_says_so() {
        match NvmlBackend::start().await {
            Ok(_) => eprintln!("NVML is present here; nothing to check"),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.starts_with("NVML is not available: "), "{msg}");
                let advice = if in_pod() {
                    "runtimeClassName"
                } else {
                    "--fake FILE"
                };
                assert!(msg.contains(advice), "{msg}");
            }
        }
    }
}
