//! DRA on the cluster the tests drive: the node NVIDIA's DRA driver publishes GPUs for, what
//! each published device is (its UUID, from the driver's own attribute), the devices a
//! ResourceClaim was allocated, and the DeviceClass that serves an extended resource through
//! DRA (KEP-5004).

use std::collections::BTreeSet;

use http::Method;
use serde_json::Value;

use crate::cluster::{Cluster, ClusterError};
use crate::node::is_ready;

/// NVIDIA's DRA driver for GPUs.
pub const GPU_DRIVER: &str = "gpu.nvidia.com";

/// The drivers NVIDIA's DRA driver runs (GPUs, and IMEX channels for compute domains).
const NVIDIA_DRIVERS: &[&str] = &[GPU_DRIVER, "compute-domain.nvidia.com"];

/// What the DRA tests need, for their `SKIPPED` line where a cluster has none.
pub const NEEDS_DRA_NODE: &str = "no Ready node where NVIDIA's DRA driver (gpu.nvidia.com) publishes 2 GPUs in ResourceSlices (its kubelet plugin on GPUs or NVIDIA's mock NVML, containerd >= 1.7 with CDI; GPUWARDEN_E2E_NODE names the node)";

/// One device a ResourceSlice publishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DraDevice {
    /// The driver, e.g. `gpu.nvidia.com`.
    pub driver: String,
    /// The pool (for node-local drivers, the node).
    pub pool: String,
    /// The device's name in its pool, e.g. `gpu-0`.
    pub name: String,
    /// Its `type` attribute (NVIDIA's driver: `gpu`, `mig`, `vfio`).
    pub kind: Option<String>,
    /// Its `uuid` attribute.
    pub uuid: Option<String>,
}

/// A Ready node and every device the ResourceSlices of its node publish.
#[derive(Clone, Debug)]
pub struct DraNode {
    /// The node's name.
    pub name: String,
    /// The Node as listed.
    pub node: Value,
    /// The devices, every driver.
    pub devices: Vec<DraDevice>,
}

impl DraNode {
    /// The full GPUs NVIDIA's driver publishes.
    pub fn gpus(&self) -> impl Iterator<Item = &DraDevice> {
        (self.devices.iter())
            .filter(|d| d.driver == GPU_DRIVER && d.kind.as_deref().is_none_or(|k| k == "gpu"))
    }

    /// The drivers on the node that hand out no NVIDIA device ([`other_drivers`]).
    pub fn other_drivers(&self) -> BTreeSet<&str> {
        other_drivers(&self.devices)
    }

    /// The GPUs a device plugin offers on the node: its allocatable `nvidia.com/gpu`.
    pub fn plugin_gpus(&self) -> u32 {
        (self.node["status"]["allocatable"][gpuwarden_crds::RESOURCE_GPU].as_str())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// The UUID of a published device.
    pub fn uuid_of(&self, driver: &str, pool: &str, device: &str) -> Option<&str> {
        (self.devices.iter())
            .find(|d| d.driver == driver && d.pool == pool && d.name == device)
            .and_then(|d| d.uuid.as_deref())
    }
}

/// A device attribute's string value: `attributes[name].string`, under its short name or
/// qualified by the driver's domain.
fn string_attribute(device: &Value, driver: &str, name: &str) -> Option<String> {
    let attributes = &device["attributes"];
    [name.to_owned(), format!("{driver}/{name}")]
        .iter()
        .find_map(|key| attributes[key]["string"].as_str())
        .map(str::to_owned)
}

/// Every device the slices of `slices` (a `ResourceSliceList`, JSON) publish for node `name`.
fn devices_of(slices: &[Value], name: &str) -> Vec<DraDevice> {
    (slices.iter())
        .filter(|s| s["spec"]["nodeName"] == name)
        .flat_map(|s| {
            let driver = s["spec"]["driver"].as_str().unwrap_or_default();
            let pool = s["spec"]["pool"]["name"].as_str().unwrap_or_default();
            (s["spec"]["devices"].as_array().into_iter().flatten()).map(move |d| DraDevice {
                driver: driver.to_owned(),
                pool: pool.to_owned(),
                name: d["name"].as_str().unwrap_or_default().to_owned(),
                kind: string_attribute(d, driver, "type"),
                uuid: string_attribute(d, driver, "uuid"),
            })
        })
        .collect()
}

/// Of a `NodeList` and a `ResourceSliceList` (JSON), the Ready node on which NVIDIA's driver
/// publishes at least two GPUs (`$GPUWARDEN_E2E_NODE` picks one by name), with every
/// device its node's slices publish.
pub fn dra_node_in(nodes: &Value, slices: &Value) -> Option<DraNode> {
    let wanted = std::env::var("GPUWARDEN_E2E_NODE").ok();
    let slices = slices["items"].as_array()?;
    (nodes["items"].as_array()?.iter())
        .filter(|n| is_ready(n))
        .filter_map(|n| Some((n["metadata"]["name"].as_str()?, n)))
        .filter(|(name, _)| wanted.as_deref().is_none_or(|w| w == *name))
        .map(|(name, node)| DraNode {
            name: name.to_owned(),
            node: node.clone(),
            devices: devices_of(slices, name),
        })
        .find(|n| n.gpus().count() >= 2)
}

/// GET `path` as JSON, an error naming `what` where the server refuses.
async fn get(cluster: &Cluster, path: &str, what: &str) -> Result<Value, ClusterError> {
    let r = cluster
        .raw(Method::GET, path, "application/json", None)
        .await?;
    if !r.status.is_success() {
        return Err(ClusterError::Body {
            what: what.into(),
            message: r.message().to_owned(),
        });
    }
    Ok(r.body)
}

/// The cluster's DRA node ([`dra_node_in`]), `None` where it has none (or does not serve
/// `resource.k8s.io/v1`).
pub async fn dra_node(cluster: &Cluster) -> Result<Option<DraNode>, ClusterError> {
    if !cluster.serves("resource.k8s.io/v1", "resourceslices").await {
        return Ok(None);
    }
    let nodes = get(cluster, "/api/v1/nodes", "list nodes").await?;
    let slices = get(
        cluster,
        "/apis/resource.k8s.io/v1/resourceslices",
        "list ResourceSlices",
    )
    .await?;
    Ok(dra_node_in(&nodes, &slices))
}

/// The drivers among `devices` that hand out no NVIDIA device (a NIC driver, a test
/// driver), sorted.
pub fn other_drivers(devices: &[DraDevice]) -> BTreeSet<&str> {
    (devices.iter())
        .map(|d| d.driver.as_str())
        .filter(|d| !NVIDIA_DRIVERS.contains(d))
        .collect()
}

/// Every device the ResourceSlices of node `name` publish (none where the server does not
/// serve `resource.k8s.io/v1`).
pub async fn devices_on(cluster: &Cluster, name: &str) -> Result<Vec<DraDevice>, ClusterError> {
    if !cluster.serves("resource.k8s.io/v1", "resourceslices").await {
        return Ok(Vec::new());
    }
    let slices = get(
        cluster,
        "/apis/resource.k8s.io/v1/resourceslices",
        "list ResourceSlices",
    )
    .await?;
    Ok(devices_of(
        slices["items"].as_array().map_or(&[], Vec::as_slice),
        name,
    ))
}

/// The devices a ResourceClaim (JSON) was allocated: `(driver, pool, device)`, in the
/// order of its allocation.
pub fn allocated_devices(claim: &Value) -> Vec<(String, String, String)> {
    let results = &claim["status"]["allocation"]["devices"]["results"];
    (results.as_array().into_iter().flatten())
        .map(|r| {
            let field = |k: &str| r[k].as_str().unwrap_or_default().to_owned();
            (field("driver"), field("pool"), field("device"))
        })
        .collect()
}

/// The DeviceClass that maps the extended resource `resource` (`nvidia.com/gpu`) to DRA
/// (`spec.extendedResourceName`, KEP-5004), if one does.
pub async fn extended_resource_class(
    cluster: &Cluster,
    resource: &str,
) -> Result<Option<String>, ClusterError> {
    if !cluster.serves("resource.k8s.io/v1", "deviceclasses").await {
        return Ok(None);
    }
    let classes = get(
        cluster,
        "/apis/resource.k8s.io/v1/deviceclasses",
        "list DeviceClasses",
    )
    .await?;
    Ok((classes["items"].as_array().into_iter().flatten())
        .find(|c| c["spec"]["extendedResourceName"] == resource)
        .and_then(|c| c["metadata"]["name"].as_str())
        .map(str::to_owned))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn slice(node: &str, driver: &str, devices: Value) -> Value {
        json!({"spec": {"nodeName": node, "driver": driver, "pool": {"name": node},
            "devices": devices}})
    }

    fn gpu(name: &str, uuid: &str) -> Value {
        json!({"name": name, "attributes": {"type": {"string": "gpu"}, "uuid": {"string": uuid}}})
    }

    #[test]
    fn the_dra_node_is_ready_with_two_gpus_of_nvidias_driver() {
        if std::env::var_os("GPUWARDEN_E2E_NODE").is_some() {
            return;
        }
        let node = |name: &str, ready: &str| {
            json!({"metadata": {"name": name},
                "status": {"conditions": [{"type": "Ready", "status": ready}]}})
        };
        let mut c = node("c", "True");
        c["status"]["allocatable"] = json!({"nvidia.com/gpu": "8"});
        let nodes = json!({"items": [node("a", "True"), node("b", "False"), c]});
        let slices = json!({"items": [
            slice("a", GPU_DRIVER, json!([gpu("gpu-0", "GPU-a0"),
                {"name": "gpu-0-mig-1g.10gb-0-1", "attributes": {"type": {"string": "mig"}}}])),
            slice("b", GPU_DRIVER, json!([gpu("gpu-0", "GPU-b0"), gpu("gpu-1", "GPU-b1")])),
            slice("c", GPU_DRIVER, json!([gpu("gpu-0", "GPU-c0")])),
            slice("c", GPU_DRIVER, json!([{"name": "gpu-1", "attributes": {
                "type": {"string": "gpu"}, "gpu.nvidia.com/uuid": {"string": "GPU-c1"}}}])),
            slice("c", "test-driver.cdi.k8s.io", json!([{"name": "dev-0"}])),
        ]});
        let found = dra_node_in(&nodes, &slices).expect("node c");
        assert_eq!(found.name, "c");
        assert_eq!(
            found.plugin_gpus(),
            8,
            "the device plugin beside the driver"
        );
        let uuids: Vec<_> = found.gpus().filter_map(|d| d.uuid.as_deref()).collect();
        assert_eq!(uuids, ["GPU-c0", "GPU-c1"]);
        assert_eq!(found.uuid_of(GPU_DRIVER, "c", "gpu-1"), Some("GPU-c1"));
        assert_eq!(
            found.other_drivers().into_iter().collect::<Vec<_>>(),
            ["test-driver.cdi.k8s.io"]
        );
        let none = json!({"items": [slice("a", GPU_DRIVER, json!([gpu("gpu-0", "GPU-a0")]))]});
        assert!(dra_node_in(&nodes, &none).is_none(), "a has one GPU");
    }

    #[test]
    fn a_claims_allocation_lists_its_devices() {
        let claim = json!({"status": {"allocation": {"devices": {"results": [
            {"request": "gpus", "driver": GPU_DRIVER, "pool": "vm", "device": "gpu-3"},
            {"request": "gpus", "driver": GPU_DRIVER, "pool": "vm", "device": "gpu-1"}]}}}});
        assert_eq!(
            allocated_devices(&claim),
            [
                (GPU_DRIVER.into(), "vm".into(), "gpu-3".into()),
                (GPU_DRIVER.into(), "vm".into(), "gpu-1".into())
            ]
        );
        assert!(allocated_devices(&json!({"status": {}})).is_empty());
    }
}
