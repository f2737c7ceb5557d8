//! The fake GPU backend: a YAML file describing a node's GPUs, the processes on them and a
//! script of events, so tests and `inspect` previews need no GPU.
//!
//! The same file may describe the pods on the node and what the kubelet allocated to them,
//! which `inspect` uses when it has no cluster and no kubelet socket.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use gpuwarden_crds::DriverInfo;
use gpuwarden_crds::node::{MigDevice, MigMode};
use jiff::Timestamp;
use serde::Deserialize;

use crate::backend::{
    BackendError, GpuBackend, GpuEvent, GpuEventKind, GpuInfo, GpuProcess, GpuReading, Reading,
    Telemetry,
};
use crate::podresources::{
    CdiDevice, ClaimResource, ContainerDevices, ContainerResources, DynamicResource, PodResources,
};
use crate::pods::{ContainerInfo, PodInfo};

/// The fake file.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FakeNode {
    /// Driver versions.
    pub driver: DriverInfo,
    /// The GPUs.
    #[serde(default)]
    pub gpus: Vec<FakeGpu>,
    /// Compute processes.
    #[serde(default)]
    pub processes: Vec<FakeProcess>,
    /// Scripted events, by time after the backend started.
    #[serde(default)]
    pub events: Vec<FakeEvent>,
    /// Pods on the node (what the agent's pod reflector would hold). Used by `inspect`.
    #[serde(default)]
    pub pods: Vec<FakePod>,
    /// What the kubelet allocated (what pod-resources `List` would return). Used by `inspect`
    /// without `--pod-resources-socket`, and served by the fake kubelet in tests.
    #[serde(default)]
    pub pod_resources: Vec<FakePodResources>,
}

/// One GPU in the fake file.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FakeGpu {
    /// NVML index.
    pub index: u32,
    /// UUID.
    pub uuid: String,
    /// Product name.
    pub model: String,
    /// Memory in MiB.
    pub memory_mi_b: u64,
    /// PCI bus id.
    #[serde(default)]
    pub pci_bus_id: String,
    /// Minor number.
    #[serde(default)]
    pub minor_number: Option<u32>,
    /// MIG mode (`Enabled`/`Disabled`); absent when unsupported.
    #[serde(default)]
    pub mig_mode: Option<String>,
    /// MIG devices.
    #[serde(default)]
    pub mig_devices: Vec<MigDevice>,
    /// Utilisation percent.
    #[serde(default)]
    pub utilization_percent: Option<u32>,
    /// Memory in use, MiB.
    #[serde(default)]
    pub memory_used_mi_b: Option<u64>,
    /// Temperature, Celsius.
    #[serde(default)]
    pub temperature_celsius: Option<u32>,
    /// Power, watts.
    #[serde(default)]
    pub power_watts: Option<f64>,
    /// Volatile uncorrected ECC errors.
    #[serde(default)]
    pub ecc_uncorrected: Option<u64>,
    /// Pages pending retirement.
    #[serde(default)]
    pub pages_pending_retirement: Option<bool>,
    /// Rows pending remapping.
    #[serde(default)]
    pub row_remapping_pending: Option<bool>,
    /// A row remapping failed.
    #[serde(default)]
    pub row_remapping_failed: Option<bool>,
}

/// A compute process in the fake file.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FakeProcess {
    /// Process id.
    pub pid: u32,
    /// GPU (or MIG device) UUID, or GPU index as a string.
    pub gpu: String,
    /// Memory in use, MiB.
    #[serde(default)]
    pub used_memory_mi_b: Option<u64>,
    /// Its share of the GPU's SM time, percent, as NVML's process utilisation samples give
    /// it; absent where NVML gives none.
    #[serde(default)]
    pub sm_util_percent: Option<u32>,
    /// Content of `/proc/<pid>/cgroup`; absent to read it from `--host-root`.
    #[serde(default)]
    pub cgroup: Option<String>,
}

/// A scripted event.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FakeEvent {
    /// When, after the backend started (Go duration: `0s`, `90s`, `5m`).
    pub after: String,
    /// GPU UUID or index.
    pub gpu: String,
    /// An XID error code.
    #[serde(default)]
    pub xid: Option<u64>,
    /// An uncorrectable ECC error.
    #[serde(default)]
    pub ecc_uncorrected: bool,
    /// The GPU falls off the bus (and stays off).
    #[serde(default)]
    pub lost: bool,
}

/// A pod in the fake file.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FakePod {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
    /// `spec.serviceAccountName`.
    #[serde(default)]
    pub service_account: String,
    /// Containers.
    #[serde(default)]
    pub containers: Vec<FakeContainer>,
}

/// A container of a fake pod.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FakeContainer {
    /// Name.
    pub name: String,
    /// Image reference (policy image exemptions match it).
    #[serde(default)]
    pub image: String,
    /// `containerd://<id>` as in `status.containerStatuses[].containerID`.
    #[serde(default)]
    pub container_id: Option<String>,
    /// `securityContext.privileged`.
    #[serde(default)]
    pub privileged: bool,
    /// Whether the container shows a GPU signal (GPU limit, `NVIDIA_VISIBLE_DEVICES`, device
    /// mounts).
    #[serde(default)]
    pub gpu: bool,
}

/// What the kubelet allocated to one pod.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FakePodResources {
    /// Namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Per container.
    pub containers: Vec<FakeContainerDevices>,
}

/// Devices allocated to one container: by a device plugin under a resource name, or by a
/// DRA driver for a ResourceClaim.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FakeContainerDevices {
    /// Container name.
    pub name: String,
    /// Resource name, e.g. `nvidia.com/gpu`.
    #[serde(default)]
    pub resource_name: String,
    /// Device IDs as the device plugin names them (UUIDs or indexes).
    #[serde(default)]
    pub device_ids: Vec<String>,
    /// A ResourceClaim the container uses, with the devices allocated for it.
    #[serde(default)]
    pub claim: Option<FakeClaim>,
}

/// A ResourceClaim as the kubelet reports it.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FakeClaim {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// The DRA driver, e.g. `gpu.nvidia.com`.
    pub driver: String,
    /// The pool.
    #[serde(default)]
    pub pool: String,
    /// Device names as the driver publishes them, e.g. `gpu-0`.
    pub devices: Vec<String>,
}

impl FakeNode {
    /// Reads and checks a fake file.
    pub fn load(path: &Path) -> Result<Self, BackendError> {
        let text = std::fs::read_to_string(path).map_err(|source| BackendError::FakeRead {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and checks fake-file text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, BackendError> {
        let invalid = |problem: String| BackendError::FakeInvalid {
            path: origin.to_owned(),
            problem,
        };
        let node: FakeNode = serde_saphyr::from_str(text).map_err(|e| invalid(e.to_string()))?;
        let mut seen = HashSet::new();
        for gpu in &node.gpus {
            if gpu.uuid.is_empty() {
                return Err(invalid(format!("GPU {} has no uuid", gpu.index)));
            }
            if !seen.insert(gpu.uuid.clone()) {
                return Err(invalid(format!("GPU uuid {} appears twice", gpu.uuid)));
            }
        }
        for p in &node.processes {
            if node.resolve(&p.gpu).is_none() {
                return Err(invalid(format!(
                    "process {} names unknown GPU {:?}",
                    p.pid, p.gpu
                )));
            }
        }
        for e in &node.events {
            gpuwarden_crds::duration::parse_duration(&e.after)
                .map_err(|err| invalid(format!("event on GPU {:?}: {err}", e.gpu)))?;
            if node.resolve(&e.gpu).is_none() {
                return Err(invalid(format!("event names unknown GPU {:?}", e.gpu)));
            }
            if e.xid.is_none() && !e.ecc_uncorrected && !e.lost {
                return Err(invalid(format!(
                    "event on GPU {:?} says nothing happened (set xid, eccUncorrected or lost)",
                    e.gpu
                )));
            }
        }
        Ok(node)
    }

    /// Finds a GPU or MIG device by UUID or GPU index: (GPU UUID, device UUID).
    fn resolve(&self, key: &str) -> Option<(String, String)> {
        for gpu in &self.gpus {
            if gpu.uuid == key || gpu.index.to_string() == key {
                return Some((gpu.uuid.clone(), gpu.uuid.clone()));
            }
            if let Some(mig) = gpu.mig_devices.iter().find(|m| m.uuid == key) {
                return Some((gpu.uuid.clone(), mig.uuid.clone()));
            }
        }
        None
    }

    /// The pods, as the agent's pod index takes them.
    pub fn pod_infos(&self) -> Vec<PodInfo> {
        self.pods
            .iter()
            .map(|p| PodInfo {
                uid: p.uid.clone(),
                namespace: p.namespace.clone(),
                name: p.name.clone(),
                mirror_uid: None,
                service_account: p.service_account.clone(),
                labels: Default::default(),
                exempt: None,
                claims_exempt: None,
                kai: None,
                injected: Vec::new(),
                containers: p
                    .containers
                    .iter()
                    .map(|c| ContainerInfo {
                        name: c.name.clone(),
                        image: c.image.clone(),
                        container_id: c.container_id.clone(),
                        privileged: c.privileged,
                        gpu: c.gpu,
                    })
                    .collect(),
            })
            .collect()
    }

    /// The allocations, as the pod-resources `List` call returns them.
    pub fn pod_resources_list(&self) -> Vec<PodResources> {
        self.pod_resources
            .iter()
            .map(|p| {
                let mut containers: Vec<ContainerResources> = Vec::new();
                for c in &p.containers {
                    let at = match containers.iter().position(|x| x.name == c.name) {
                        Some(at) => at,
                        None => {
                            containers.push(ContainerResources {
                                name: c.name.clone(),
                                ..ContainerResources::default()
                            });
                            containers.len() - 1
                        }
                    };
                    let container = &mut containers[at];
                    if !c.device_ids.is_empty() || c.claim.is_none() {
                        container.devices.push(ContainerDevices {
                            resource_name: c.resource_name.clone(),
                            device_ids: c.device_ids.clone(),
                        });
                    }
                    if let Some(claim) = &c.claim {
                        container.dynamic_resources.push(DynamicResource {
                            claim_name: claim.name.clone(),
                            claim_namespace: claim.namespace.clone(),
                            claim_resources: (claim.devices.iter())
                                .map(|device| ClaimResource {
                                    cdi_devices: vec![CdiDevice {
                                        name: format!("k8s.{}/device={device}", claim.driver),
                                    }],
                                    driver_name: claim.driver.clone(),
                                    pool_name: claim.pool.clone(),
                                    device_name: device.clone(),
                                })
                                .collect(),
                        });
                    }
                }
                PodResources {
                    name: p.pod.clone(),
                    namespace: p.namespace.clone(),
                    containers,
                }
            })
            .collect()
    }
}

/// A [`GpuBackend`] that replays a [`FakeNode`].
pub struct FakeBackend {
    node: FakeNode,
    start: Timestamp,
    /// Index of the first scripted event not yet delivered (events sorted by time).
    next_event: Mutex<usize>,
    /// Scripted events, sorted by time: (at, gpu uuid, kind).
    script: Vec<(Timestamp, String, GpuEventKind)>,
}

impl FakeBackend {
    /// A backend whose script starts at `start`.
    pub fn new(node: FakeNode, start: Timestamp) -> Self {
        let mut script = Vec::new();
        for e in &node.events {
            // `parse` checked both; a FakeNode built by hand with bad values just skips them.
            let (Ok(after), Some((uuid, _))) = (
                gpuwarden_crds::duration::parse_duration(&e.after),
                node.resolve(&e.gpu),
            ) else {
                continue;
            };
            let at = add(start, after);
            if let Some(xid) = e.xid {
                script.push((at, uuid.clone(), GpuEventKind::Xid(xid)));
            }
            if e.ecc_uncorrected {
                script.push((at, uuid.clone(), GpuEventKind::EccUncorrected));
            }
            if e.lost {
                script.push((at, uuid, GpuEventKind::Lost));
            }
        }
        script.sort_by_key(|(at, _, _)| *at);
        Self {
            node,
            start,
            next_event: Mutex::new(0),
            script,
        }
    }

    /// When the script started.
    pub fn start(&self) -> Timestamp {
        self.start
    }

    fn lost(&self, uuid: &str, now: Timestamp) -> bool {
        self.script
            .iter()
            .any(|(at, u, k)| *at <= now && u == uuid && *k == GpuEventKind::Lost)
    }
}

fn add(t: Timestamp, d: Duration) -> Timestamp {
    let span = jiff::SignedDuration::try_from(d).unwrap_or(jiff::SignedDuration::MAX);
    t.checked_add(span).unwrap_or(Timestamp::MAX)
}

#[async_trait]
impl GpuBackend for FakeBackend {
    fn name(&self) -> &'static str {
        "fake"
    }

    async fn read(&self, now: Timestamp) -> Result<Reading, BackendError> {
        let mut gpus = Vec::with_capacity(self.node.gpus.len());
        for g in &self.node.gpus {
            let answering = !self.lost(&g.uuid, now);
            let mig_mode = g.mig_mode.as_ref().map(|m| MigMode {
                current: m.clone(),
                pending: m.clone(),
            });
            let processes = if answering {
                self.node
                    .processes
                    .iter()
                    .filter_map(|p| {
                        let (gpu, device) = self.node.resolve(&p.gpu)?;
                        (gpu == g.uuid).then(|| GpuProcess {
                            pid: p.pid,
                            device_uuid: device,
                            used_memory_bytes: p.used_memory_mi_b.map(|m| m * 1024 * 1024),
                            sm_util_percent: p.sm_util_percent,
                            cgroup: p.cgroup.clone(),
                        })
                    })
                    .collect()
            } else {
                Vec::new()
            };
            gpus.push(GpuReading {
                info: GpuInfo {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    model: g.model.clone(),
                    memory_mib: g.memory_mi_b,
                    pci_bus_id: g.pci_bus_id.clone(),
                    minor_number: g.minor_number,
                    mig_mode,
                    mig_devices: g.mig_devices.clone(),
                },
                answering,
                never_answered: false,
                telemetry: if answering {
                    Telemetry {
                        utilization_percent: g.utilization_percent,
                        memory_used_bytes: g.memory_used_mi_b.map(|m| m * 1024 * 1024),
                        temperature_celsius: g.temperature_celsius,
                        power_watts: g.power_watts,
                    }
                } else {
                    Telemetry::default()
                },
                ecc_uncorrected: g.ecc_uncorrected,
                pages_pending_retirement: g.pages_pending_retirement,
                row_remapping_pending: g.row_remapping_pending,
                row_remapping_failed: g.row_remapping_failed,
                processes,
            });
        }
        Ok(Reading {
            driver: self.node.driver.clone(),
            gpus,
        })
    }

    fn take_events(&self, now: Timestamp) -> Vec<GpuEvent> {
        // A poisoned lock only means another reader panicked mid-read; the index is still valid.
        let mut next = self
            .next_event
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut out = Vec::new();
        while let Some((at, uuid, kind)) = self.script.get(*next) {
            if *at > now {
                break;
            }
            out.push(GpuEvent {
                uuid: uuid.clone(),
                at: *at,
                kind: *kind,
            });
            *next += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: &str = r#"
driver: {driverVersion: "550.54.15", cudaDriverVersion: "12.4"}
gpus:
  - {index: 0, uuid: GPU-a, model: H100, memoryMiB: 81559}
  - {index: 1, uuid: GPU-b, model: H100, memoryMiB: 81559,
     migMode: Enabled, migDevices: [{uuid: MIG-b1, profile: 1g.10gb}],
     rowRemappingPending: true, rowRemappingFailed: false}
processes:
  - {pid: 10, gpu: "0"}
  - {pid: 11, gpu: MIG-b1}
events:
  - {after: 0s, gpu: GPU-a, xid: 79}
  - {after: 1m, gpu: "1", lost: true}
"#;

    #[tokio::test]
    async fn replays_script_and_processes() {
        let start = Timestamp::from_second(1_000_000).unwrap();
        let b = FakeBackend::new(FakeNode::parse(SMALL, "test").unwrap(), start);
        let events = b.take_events(start);
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].kind, GpuEventKind::Xid(79));
        assert!(b.take_events(start).is_empty(), "events are delivered once");

        let r = b.read(start).await.unwrap();
        assert_eq!(r.gpus[0].processes[0].device_uuid, "GPU-a");
        assert_eq!(r.gpus[1].processes[0].device_uuid, "MIG-b1");
        assert!(r.gpus[1].answering);
        assert_eq!(r.gpus[0].row_remapping_pending, None);
        assert_eq!(r.gpus[1].row_remapping_pending, Some(true));
        assert_eq!(r.gpus[1].row_remapping_failed, Some(false));

        let later = add(start, Duration::from_secs(61));
        assert_eq!(b.take_events(later)[0].kind, GpuEventKind::Lost);
        assert!(!b.read(later).await.unwrap().gpus[1].answering);
    }

    #[test]
    fn bad_files_name_the_problem() {
        let err = FakeNode::parse("gpus: [{index: 0, uuid: GPU-a, model: x, memoryMiB: 1}]\nprocesses: [{pid: 1, gpu: GPU-zz}]\ndriver: {driverVersion: x}", "f.yaml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("f.yaml") && err.contains("GPU-zz"), "{err}");
        let err = FakeNode::parse("driver: {driverVersion: x}\nbogus: 1", "f.yaml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("bogus"), "{err}");
    }
}
