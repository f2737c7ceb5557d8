//! Prometheus metrics: one series per GPU for its readings; one `gpuwarden_gpu_holder_info`
//! series per (GPU, holder) to join them, or dcgm-exporter's, with the pod container that
//! holds the GPU (allocated, only observed, or both); per-container figures only where NVML
//! attributes them to processes, so sums never count a shared GPU twice; and the agent's own
//! work. Label names of GPU series follow dcgm-exporter's (`gpu`, `UUID`, `modelName`,
//! `Hostname`), so a join on `UUID` needs no relabelling.

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
use crate::status::Computed;

/// Labels of per-GPU series, named as dcgm-exporter names them.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
#[allow(non_snake_case)]
pub struct GpuLabels {
    /// NVML index.
    pub gpu: String,
    /// GPU UUID: the join key.
    pub UUID: String,
    /// Product name.
    pub modelName: String,
    /// The node.
    pub Hostname: String,
}

/// Labels of `gpuwarden_gpu_holder_info`: a GPU's labels and one pod container holding it.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
#[allow(non_snake_case)]
pub struct HolderLabels {
    /// NVML index.
    pub gpu: String,
    /// GPU UUID: the join key.
    pub UUID: String,
    /// Product name.
    pub modelName: String,
    /// The node.
    pub Hostname: String,
    /// Holder's namespace.
    pub namespace: String,
    /// Holder's pod.
    pub pod: String,
    /// Holder's container.
    pub container: String,
    /// `allocated` (by the kubelet), `observed` (a process seen, nothing allocated), `both`,
    /// or `shared` (a KAI fraction on its reservation's GPU).
    pub source: String,
}

/// Labels of per-container series: the GPU and the pod container.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
#[allow(non_snake_case)]
pub struct ContainerLabels {
    /// NVML index.
    pub gpu: String,
    /// GPU UUID.
    pub UUID: String,
    /// The node.
    pub Hostname: String,
    /// Namespace.
    pub namespace: String,
    /// Pod.
    pub pod: String,
    /// Container.
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
    /// Reading the CDI specs of the devices prepared for claims.
    cdi,
    /// Reading the IOMMU groups of the VFIO devices the kubelet advertises, under sysfs.
    sysfs,
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
    holder_info: Family<HolderLabels, Gauge>,
    container_memory: Family<ContainerLabels, FloatGauge>,
    container_utilization: Family<ContainerLabels, FloatGauge>,
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
    current: Mutex<Series>,
    node: String,
}

/// The labelled series one sweep set, so the next can remove those that are gone.
#[derive(Default)]
struct Series {
    gpus: HashSet<GpuLabels>,
    holders: HashSet<HolderLabels>,
    containers: HashSet<ContainerLabels>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// The metrics of an agent that does not know its node (`Hostname` empty).
    pub fn new() -> Self {
        Self::for_node("")
    }

    /// Registers every metric: the join and per-container series under `gpuwarden_`, the
    /// rest under `gpuwarden_node_agent_`; `node` is the `Hostname` label.
    pub fn for_node(node: &str) -> Self {
        let mut m = Self::unregistered(node);
        let mut root = Registry::default();
        m.register_holder_series(&mut root);
        let registry = root.sub_registry_with_prefix("gpuwarden_node_agent");
        m.register_gpu_series(registry);
        m.register_agent_series(registry);
        m.registry = root;
        m
    }

    /// Every metric, empty, in a registry that holds none of them.
    fn unregistered(node: &str) -> Self {
        Self {
            registry: Registry::default(),
            utilization: Family::default(),
            memory_used: Family::default(),
            temperature: Family::default(),
            power: Family::default(),
            xid: Family::default(),
            healthy: Family::default(),
            holder_info: Family::default(),
            container_memory: Family::default(),
            container_utilization: Family::default(),
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
            current: Mutex::new(Series::default()),
            node: node.to_owned(),
        }
    }

    /// The holder join and the per-container series, under `gpuwarden_`.
    fn register_holder_series(&self, root: &mut Registry) {
        root.register(
            "gpuwarden_gpu_holder_info",
            "1 for each pod container that holds a GPU: allocated by the kubelet, observed using it, or both. Join GPU series on UUID to label them with the holder",
            self.holder_info.clone(),
        );
        root.register(
            "gpuwarden_container_gpu_memory_used_bytes",
            "GPU memory held by the container's processes on the GPU, summed from NVML's per-process figures",
            self.container_memory.clone(),
        );
        root.register(
            "gpuwarden_container_gpu_utilization_ratio",
            "The container's share (0-1) of the GPU's SM time, summed from NVML's per-process utilisation samples; absent where NVML gives none",
            self.container_utilization.clone(),
        );
    }

    /// The per-GPU readings and health.
    fn register_gpu_series(&self, registry: &mut Registry) {
        registry.register(
            "gpu_utilization_ratio",
            "GPU utilisation (0-1) over NVML's last sample period",
            self.utilization.clone(),
        );
        registry.register(
            "gpu_memory_used_bytes",
            "GPU framebuffer memory in use",
            self.memory_used.clone(),
        );
        registry.register(
            "gpu_temperature_celsius",
            "GPU die temperature",
            self.temperature.clone(),
        );
        registry.register("gpu_power_watts", "GPU power draw", self.power.clone());
        registry.register(
            "gpu_xid_errors",
            "XID errors seen on the GPU since the agent started, ignored ones included",
            self.xid.clone(),
        );
        registry.register(
            "gpu_healthy",
            "1 when the agent judges the GPU healthy, 0 when not",
            self.healthy.clone(),
        );
    }

    /// The node's counts (out-of-band bindings, host processes, the kubelet's devices) and
    /// the agent's own work.
    fn register_agent_series(&self, registry: &mut Registry) {
        registry.register(
            "out_of_band_bindings",
            "Pod containers using GPUs the kubelet did not allocate to them",
            self.out_of_band.clone(),
        );
        registry.register(
            "host_gpu_processes",
            "GPU compute processes outside any pod",
            self.host_processes.clone(),
        );
        registry.register(
            "kubelet_allocatable_gpu_devices",
            "Devices the kubelet can allocate that name a GPU or MIG device on this node",
            self.allocatable_known.clone(),
        );
        registry.register(
            "kubelet_unknown_gpu_devices",
            "GPU devices the kubelet can allocate that name no GPU NVML reports",
            self.allocatable_unknown.clone(),
        );
        registry.register(
            "nvml_call_duration_seconds",
            "Duration of GPU backend calls",
            self.nvml_call_seconds.clone(),
        );
        registry.register(
            "sweep_duration_seconds",
            "Duration of a full sweep (GPUs, kubelet, processes, status)",
            self.sweep_seconds.clone(),
        );
        registry.register(
            "status_writes",
            "GpuNode status writes",
            self.status_writes.clone(),
        );
        registry.register("errors", "Errors by source", self.errors.clone());
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

    /// Sets the series from one sweep, removing those of GPUs and holders that are gone.
    pub fn update(&self, reading: &Reading, health: &HealthTracker, computed: &Computed) {
        let mut now = Series::default();
        for g in &reading.gpus {
            let uuid = &g.info.uuid;
            let labels = GpuLabels {
                gpu: g.info.index.to_string(),
                UUID: uuid.clone(),
                modelName: g.info.model.clone(),
                Hostname: self.node.clone(),
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
                .set(i64::try_from(health.xid_count(uuid)).unwrap_or(i64::MAX));
            let healthy = health.health(uuid).state == gpuwarden_crds::HealthState::Healthy;
            self.healthy.get_or_create(&labels).set(i64::from(healthy));
            for held in computed.holders.get(uuid).into_iter().flatten() {
                let h = &held.holder;
                let info = HolderLabels {
                    gpu: labels.gpu.clone(),
                    UUID: uuid.clone(),
                    modelName: labels.modelName.clone(),
                    Hostname: self.node.clone(),
                    namespace: h.namespace.clone(),
                    pod: h.pod.clone(),
                    container: h.container.clone(),
                    source: held.source.as_str().to_owned(),
                };
                self.holder_info.get_or_create(&info).set(1);
                now.holders.insert(info);
                let usage = ContainerLabels {
                    gpu: labels.gpu.clone(),
                    UUID: uuid.clone(),
                    Hostname: self.node.clone(),
                    namespace: h.namespace.clone(),
                    pod: h.pod.clone(),
                    container: h.container.clone(),
                };
                let memory = held.usage.memory_bytes.map(|b| b as f64);
                let utilization = held.usage.sm_util_percent.map(|u| f64::from(u) / 100.0);
                set_opt(&self.container_memory, &usage, memory);
                set_opt(&self.container_utilization, &usage, utilization);
                if memory.is_some() || utilization.is_some() {
                    now.containers.insert(usage);
                }
            }
            now.gpus.insert(labels);
        }
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for gone in current.gpus.difference(&now.gpus) {
            self.utilization.remove(gone);
            self.memory_used.remove(gone);
            self.temperature.remove(gone);
            self.power.remove(gone);
            self.xid.remove(gone);
            self.healthy.remove(gone);
        }
        for gone in current.holders.difference(&now.holders) {
            self.holder_info.remove(gone);
        }
        for gone in current.containers.difference(&now.containers) {
            self.container_memory.remove(gone);
            self.container_utilization.remove(gone);
        }
        *current = now;
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

fn set_opt<L: Clone + std::hash::Hash + Eq + EncodeLabelSet>(
    family: &Family<L, FloatGauge>,
    labels: &L,
    value: Option<f64>,
) {
    match value {
        Some(v) => {
            family.get_or_create(labels).set(v);
        }
        None => {
            family.remove(labels);
        }
    }
}
