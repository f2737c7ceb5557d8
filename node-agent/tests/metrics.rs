//! The agent's metrics as a dashboard reads them: one series per GPU, one
//! `gpuwarden_gpu_holder_info` series per (GPU, holder) to join on `UUID` (with
//! dcgm-exporter's series too), and per-container figures that add up.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use gpuwarden_node_agent::agent::{AllocationSource, Sweeper};
use gpuwarden_node_agent::fake::{FakeBackend, FakeNode};
use gpuwarden_node_agent::health::HealthRules;
use gpuwarden_node_agent::metrics::Metrics;
use gpuwarden_node_agent::podresources::{ContainerDevices, ContainerResources, PodResources};
use gpuwarden_node_agent::pods::{ContainerInfo, PodInfo};
use support::*;

/// One sample of a text exposition: metric name, labels, value.
#[derive(Clone, Debug, PartialEq)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// The samples of a Prometheus text exposition (label values here hold no escapes).
fn samples(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("name and value");
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => (name, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let labels = labels
            .split("\",")
            .filter(|pair| !pair.is_empty())
            .map(|pair| {
                let (k, v) = pair.split_once("=\"").expect("key=\"value\"");
                (k.to_owned(), v.trim_end_matches('"').to_owned())
            })
            .collect();
        out.push(Sample {
            name: name.to_owned(),
            labels,
            value: value.parse().expect("a number"),
        });
    }
    out
}

fn named<'s>(all: &'s [Sample], name: &str) -> Vec<&'s Sample> {
    all.iter().filter(|s| s.name == name).collect()
}

fn label<'s>(s: &'s Sample, key: &str) -> &'s str {
    s.labels.get(key).map_or("", String::as_str)
}

async fn swept(node: FakeNode, pods: &[PodInfo], allocations: Vec<PodResources>) -> Vec<Sample> {
    let host = host_root();
    let metrics = Arc::new(Metrics::for_node(NODE));
    let mut sweeper = Sweeper::new(
        Arc::new(FakeBackend::new(node, t0())),
        AllocationSource::Static(allocations),
        host.path(),
        Duration::from_secs(600),
        metrics.clone(),
    );
    sweeper
        .sweep(at(0), pods, true, &HealthRules::default())
        .await
        .expect("a sweep");
    samples(&metrics.encode())
}

fn pod(uid: &str, name: &str, container_id: &str) -> PodInfo {
    PodInfo {
        uid: uid.into(),
        namespace: "ml".into(),
        name: name.into(),
        containers: vec![ContainerInfo {
            name: "main".into(),
            container_id: Some(format!("containerd://{container_id}")),
            gpu: true,
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn allocated(pod: &str, device: &str) -> PodResources {
    PodResources {
        name: pod.into(),
        namespace: "ml".into(),
        containers: vec![ContainerResources {
            name: "main".into(),
            devices: vec![ContainerDevices {
                resource_name: "nvidia.com/gpu".into(),
                device_ids: vec![device.into()],
            }],
            dynamic_resources: vec![],
        }],
    }
}

#[tokio::test]
async fn holder_info_says_allocated_observed_or_both() {
    // The trainer is allocated GPU 0 and runs there; the legacy pod runs on GPU 1 with
    // nothing allocated; an idle pod is allocated GPU 1 and runs nothing.
    let mut pods = pods();
    pods.push(pod("c0ffee00-0000-0000-0000-000000000001", "idle", "aa11"));
    let mut allocations = allocations();
    allocations.push(allocated("idle", "GPU-bbbb"));
    let all = swept(fake_node(), &pods, allocations).await;
    let mut info: Vec<(&str, &str, &str, &str)> = named(&all, "gpuwarden_gpu_holder_info")
        .into_iter()
        .map(|s| {
            assert_eq!(s.value, 1.0);
            assert_eq!(label(s, "Hostname"), NODE);
            (
                label(s, "UUID"),
                label(s, "pod"),
                label(s, "container"),
                label(s, "source"),
            )
        })
        .collect();
    info.sort();
    assert_eq!(
        info,
        [
            ("GPU-aaaa", "trainer-0", "trainer", "both"),
            ("GPU-bbbb", "idle", "main", "allocated"),
            ("GPU-bbbb", "legacy", "render", "observed"),
        ]
    );
    // GPU series carry the GPU's labels only: one each, never one per holder.
    let util = named(&all, "gpuwarden_node_agent_gpu_utilization_ratio");
    assert_eq!(util.len(), 2);
    assert!(util.iter().all(|s| !s.labels.contains_key("pod")));
}

/// Three pods time-slice one GPU: the GPU's utilisation is one series, each container's
/// share comes from NVML's per-process samples, and the shares add up to no more than it.
/// A container's memory is the sum of its processes'.
#[tokio::test]
async fn a_time_sliced_gpu_with_three_holders_is_counted_once() {
    let uids = [
        "0a000000-0000-0000-0000-00000000000a",
        "0b000000-0000-0000-0000-00000000000b",
        "0c000000-0000-0000-0000-00000000000c",
    ];
    let ids = ["a1", "b2", "c3"];
    let cgroup = |i: usize| {
        format!(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{}.scope",
            uids[i].replace('-', "_"),
            ids[i]
        )
    };
    let node = FakeNode::parse(
        &format!(
            r#"
driver: {{driverVersion: "550.90.07"}}
gpus:
  - {{index: 0, uuid: GPU-aaaa, model: NVIDIA A100-SXM4-40GB, memoryMiB: 40960, utilizationPercent: 60}}
processes:
  - {{pid: 101, gpu: "0", usedMemoryMiB: 100, smUtilPercent: 20, cgroup: "{a}"}}
  - {{pid: 102, gpu: "0", usedMemoryMiB: 200, smUtilPercent: 10, cgroup: "{a}"}}
  - {{pid: 201, gpu: "0", usedMemoryMiB: 1000, smUtilPercent: 20, cgroup: "{b}"}}
  - {{pid: 301, gpu: "0", usedMemoryMiB: 50, smUtilPercent: 10, cgroup: "{c}"}}
"#,
            a = cgroup(0),
            b = cgroup(1),
            c = cgroup(2)
        ),
        "time-sliced.yaml",
    )
    .unwrap();
    let names = ["a", "b", "c"];
    let pods: Vec<PodInfo> = (0..3).map(|i| pod(uids[i], names[i], ids[i])).collect();
    let allocations = (0..3)
        .map(|i| allocated(names[i], &format!("GPU-aaaa::{i}")))
        .collect();
    let all = swept(node, &pods, allocations).await;

    let gpu = named(&all, "gpuwarden_node_agent_gpu_utilization_ratio");
    assert_eq!(gpu.len(), 1, "{gpu:?}");
    assert_eq!(gpu[0].value, 0.6);
    let holders = named(&all, "gpuwarden_gpu_holder_info");
    assert_eq!(holders.len(), 3);
    assert!(holders.iter().all(|s| label(s, "source") == "both"));

    let by_pod = |name: &str| -> BTreeMap<String, f64> {
        named(&all, name)
            .into_iter()
            .map(|s| (label(s, "pod").to_owned(), s.value))
            .collect()
    };
    let shares = by_pod("gpuwarden_container_gpu_utilization_ratio");
    assert_eq!(
        shares,
        BTreeMap::from([("a".into(), 0.3), ("b".into(), 0.2), ("c".into(), 0.1)])
    );
    let sum: f64 = shares.values().sum();
    assert!(sum <= gpu[0].value + 1e-9, "{sum} > {}", gpu[0].value);
    let memory = by_pod("gpuwarden_container_gpu_memory_used_bytes");
    let mib = 1024.0 * 1024.0;
    assert_eq!(
        memory,
        BTreeMap::from([
            ("a".into(), 300.0 * mib),
            ("b".into(), 1000.0 * mib),
            ("c".into(), 50.0 * mib)
        ])
    );
}

/// Where NVML gives no per-process samples (MIG, older GPUs), no per-container share is made
/// up: the GPU's figure and its holders are all there is.
#[tokio::test]
async fn no_share_is_invented_without_process_samples() {
    let all = swept(fake_node(), &pods(), allocations()).await;
    assert!(named(&all, "gpuwarden_container_gpu_utilization_ratio").is_empty());
}

/// dcgm-exporter's series (a checked-in exposition) joined with the agent's on `UUID`, as
/// `DCGM_FI_DEV_GPU_UTIL * on(UUID) group_left(namespace, pod, container)
/// gpuwarden_gpu_holder_info` does: each gets the namespace, pod and container that hold
/// its GPU.
#[tokio::test]
async fn dcgm_exporter_series_get_their_pods_by_a_join_on_uuid() {
    let agent = swept(fake_node(), &pods(), allocations()).await;
    let dcgm = samples(include_str!("fixtures/dcgm-exporter.prom"));
    let info = named(&agent, "gpuwarden_gpu_holder_info");
    let joined: Vec<(String, String, String, String, f64)> = named(&dcgm, "DCGM_FI_DEV_GPU_UTIL")
        .into_iter()
        .map(|d| {
            let matching: Vec<&&Sample> = info
                .iter()
                .filter(|i| label(i, "UUID") == label(d, "UUID"))
                .collect();
            // group_left: at most one series on the right per UUID (one holder per GPU here).
            assert_eq!(matching.len(), 1, "{d:?}");
            let i = matching[0];
            (
                label(d, "UUID").to_owned(),
                label(i, "namespace").to_owned(),
                label(i, "pod").to_owned(),
                label(i, "container").to_owned(),
                d.value * i.value,
            )
        })
        .collect();
    assert_eq!(
        joined,
        [
            (
                "GPU-aaaa".into(),
                "ml".into(),
                "trainer-0".into(),
                "trainer".into(),
                90.0
            ),
            (
                "GPU-bbbb".into(),
                "research".into(),
                "legacy".into(),
                "render".into(),
                40.0
            ),
        ]
    );
}
