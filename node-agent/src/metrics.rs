//! Prometheus metrics: per-GPU readings labelled with the pod container that holds the GPU
//! (allocated or only observed), and the agent's own work.

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::backend::Reading;
use crate::health::HealthTracker;
use crate::status::{Computed, Holder};

/// Labels of per-GPU series. `namespace`/`pod`/`container` are empty when the GPU is free.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GpuLabels {
    /// NVML index.
    pub gpu: String,
    /// GPU UUID.
    pub uuid: String,
    /// Product name.
    pub model: String,
    /// Holder's namespace.
    pub namespace: String,
    /// Holder's pod.
    pub pod: String,
    /// Holder's container.
    pub container: String,
}

/// Where an error came from.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum ErrorSource {
    /// NVML or the fake backend.
    nvml,
    /// The kubelet's pod-resources API.
    pod_resources,
    /// Reading `/proc/<pid>/cgroup`.
    proc,
    /// Writing status to the API server.
    status,
    /// Renewing the Lease.
    lease,
}

/// Labels of the error counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// Where.
    pub source: ErrorSource,
}

/// Labels of the NVML call histogram.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    /// Which call (`read`).
    pub call: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// The agent's metrics and their registry.
pub struct Metrics {
    registry: Registry,
    utilization: Family<GpuLabels, FloatGauge>,
    memory_used: Family<GpuLabels, FloatGauge>,
    temperature: Family<GpuLabels, FloatGauge>,
    power: Family<GpuLabels, FloatGauge>,
    xid: Family<GpuLabels, Gauge>,
    healthy: Family<GpuLabels, Gauge>,
    out_of_band: Gauge,
    host_processes: Gauge,
    allocatable_known: Gauge,
    allocatable_unknown: Gauge,
    /// Duration of backend calls.
    pub nvml_call_seconds: Family<CallLabels, Histogram>,
    /// Duration of a full sweep.
    pub sweep_seconds: Histogram,
    /// Status writes.
    pub status_writes: Counter,
    /// Errors by source.
    pub errors: Family<ErrorLabels, Counter>,
    current: Mutex<HashSet<GpuLabels>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric under `gpuwarden_node_agent_`.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("gpuwarden_node_agent");
        let m = Self {
            registry: Registry::default(),
            utilization: Family::default(),
            memory_used: Family::default(),
            temperature: Family::default(),
            power: Family::default(),
            xid: Family::default(),
            healthy: Family::default(),
            out_of_band: Gauge::default(),
            host_processes: Gauge::default(),
            allocatable_known: Gauge::default(),
            allocatable_unknown: Gauge::default(),
            nvml_call_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0005, 2.0, 14))
            }),
            sweep_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            status_writes: Counter::default(),
            errors: Family::default(),
            current: Mutex::new(HashSet::new()),
        };
        registry.register(
            "gpu_utilization_ratio",
            "GPU utilisation (0-1) over NVML's last sample period",
            m.utilization.clone(),
        );
        registry.register(
            "gpu_memory_used_bytes",
            "GPU framebuffer memory in use",
            m.memory_used.clone(),
        );
        registry.register(
            "gpu_temperature_celsius",
            "GPU die temperature",
            m.temperature.clone(),
        );
        registry.register("gpu_power_watts", "GPU power draw", m.power.clone());
        registry.register(
            "gpu_xid_errors",
            "XID errors seen on the GPU since the agent started, ignored ones included",
            m.xid.clone(),
        );
        registry.register(
            "gpu_healthy",
            "1 when the agent judges the GPU healthy, 0 when not",
            m.healthy.clone(),
        );
        registry.register(
            "out_of_band_bindings",
            "Pod containers using GPUs the kubelet did not allocate to them",
            m.out_of_band.clone(),
        );
        registry.register(
            "host_gpu_processes",
            "GPU compute processes outside any pod",
            m.host_processes.clone(),
        );
        registry.register(
            "kubelet_allocatable_gpu_devices",
            "Devices the kubelet can allocate that name a GPU or MIG device on this node",
            m.allocatable_known.clone(),
        );
        registry.register(
            "kubelet_unknown_gpu_devices",
            "GPU devices the kubelet can allocate that name no GPU NVML reports",
            m.allocatable_unknown.clone(),
        );
        registry.register(
            "nvml_call_duration_seconds",
            "Duration of GPU backend calls",
            m.nvml_call_seconds.clone(),
        );
        registry.register(
            "sweep_duration_seconds",
            "Duration of a full sweep (GPUs, kubelet, processes, status)",
            m.sweep_seconds.clone(),
        );
        registry.register(
            "status_writes",
            "GpuNode status writes",
            m.status_writes.clone(),
        );
        registry.register("errors", "Errors by source", m.errors.clone());
        Self { registry, ..m }
    }

    /// Counts one error.
    pub fn error(&self, source: ErrorSource) {
        self.errors.get_or_create(&ErrorLabels { source }).inc();
    }

    /// Sets the kubelet's allocatable GPU device counts.
    pub fn set_allocatable(&self, known: usize, unknown: usize) {
        self.allocatable_known
            .set(i64::try_from(known).unwrap_or(i64::MAX));
        self.allocatable_unknown
            .set(i64::try_from(unknown).unwrap_or(i64::MAX));
    }

    /// Sets the per-GPU series from one sweep, removing series of holders that are gone.
    pub fn update(&self, reading: &Reading, health: &HealthTracker, computed: &Computed) {
        let free = [Holder {
            namespace: String::new(),
            pod: String::new(),
            container: String::new(),
        }];
        let mut now_present = HashSet::new();
        for g in &reading.gpus {
            let holders: &[Holder] = computed
                .holders
                .get(&g.info.uuid)
                .map_or(&free[..], |v| v.as_slice());
            let healthy = health.health(&g.info.uuid).state == gpuwarden_crds::HealthState::Healthy;
            for h in holders {
                let labels = GpuLabels {
                    gpu: g.info.index.to_string(),
                    uuid: g.info.uuid.clone(),
                    model: g.info.model.clone(),
                    namespace: h.namespace.clone(),
                    pod: h.pod.clone(),
                    container: h.container.clone(),
                };
                let t = &g.telemetry;
                set_opt(
                    &self.utilization,
                    &labels,
                    t.utilization_percent.map(|u| f64::from(u) / 100.0),
                );
                set_opt(
                    &self.memory_used,
                    &labels,
                    t.memory_used_bytes.map(|b| b as f64),
                );
                set_opt(
                    &self.temperature,
                    &labels,
                    t.temperature_celsius.map(f64::from),
                );
                set_opt(&self.power, &labels, t.power_watts);
                self.xid
                    .get_or_create(&labels)
                    .set(i64::try_from(health.xid_count(&g.info.uuid)).unwrap_or(i64::MAX));
                self.healthy.get_or_create(&labels).set(i64::from(healthy));
                now_present.insert(labels);
            }
        }
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for gone in current.difference(&now_present) {
            self.utilization.remove(gone);
            self.memory_used.remove(gone);
            self.temperature.remove(gone);
            self.power.remove(gone);
            self.xid.remove(gone);
            self.healthy.remove(gone);
        }
        *current = now_present;
        let oob = computed
            .status
            .bindings
            .iter()
            .flatten()
            .filter(|b| b.is_out_of_band())
            .count();
        self.out_of_band.set(i64::try_from(oob).unwrap_or(i64::MAX));
        let host: u32 = computed.host_processes.values().sum();
        self.host_processes.set(i64::from(host));
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

fn set_opt(family: &Family<GpuLabels, FloatGauge>, labels: &GpuLabels, value: Option<f64>) {
    match value {
        Some(v) => {
            family.get_or_create(labels).set(v);
        }
        None => {
            family.remove(labels);
        }
    }
}
