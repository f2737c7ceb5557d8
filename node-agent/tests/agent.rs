//! The agent's sweeps and status writes against in-process fakes: a fake GPU backend, a fake
//! kubelet pod-resources server on a temporary unix socket, a fake /proc under a temporary
//! host root, and a mock API server that counts requests.

mod support;

use std::sync::Arc;
use std::time::Duration;

use gpuwarden_crds::{BindingSource, HealthState};
use gpuwarden_node_agent::agent::{AllocationSource, Sweeper};
use gpuwarden_node_agent::fake::{FakeBackend, FakeNode};
use gpuwarden_node_agent::health::HealthRules;
use gpuwarden_node_agent::metrics::Metrics;
use gpuwarden_node_agent::podresources::{ContainerDevices, Timeouts};
use gpuwarden_node_agent::status::{Holder, HolderSource};
use gpuwarden_node_agent::testing::{FakeKubelet, FakeKubeletServer};
use gpuwarden_node_agent::writer::{KubeSink, MIN_WRITE_INTERVAL, Outcome, StatusWriter};
use http::Method;
use support::*;

fn sweeper(node: FakeNode, allocations: AllocationSource, host: &std::path::Path) -> Sweeper {
    Sweeper::new(
        Arc::new(FakeBackend::new(node, t0())),
        allocations,
        host,
        Duration::from_secs(600),
        Arc::new(Metrics::new()),
    )
}

fn kubelet(socket: &std::path::Path, strict: bool) -> AllocationSource {
    AllocationSource::Kubelet {
        socket: socket.to_path_buf(),
        timeouts: Timeouts {
            connect: Duration::from_secs(2),
            request: Duration::from_secs(2),
        },
        strict,
    }
}

#[tokio::test]
async fn bindings_from_fake_kubelet_and_an_out_of_band_process() {
    let sock = tempfile::tempdir().unwrap();
    let server = FakeKubeletServer::start(
        &sock.path().join("kubelet.sock"),
        FakeKubelet {
            pods: allocations(),
            allocatable: vec![ContainerDevices {
                resource_name: "nvidia.com/gpu".into(),
                device_ids: vec!["GPU-aaaa".into(), "GPU-bbbb".into(), "GPU-gone".into()],
            }],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let host = host_root();
    let metrics = Arc::new(Metrics::new());
    let mut s = Sweeper::new(
        Arc::new(FakeBackend::new(fake_node(), t0())),
        kubelet(server.socket(), true),
        host.path(),
        Duration::from_secs(600),
        metrics.clone(),
    );
    let pods = pods();
    let c = s
        .sweep(t0(), &pods, true, &HealthRules::default())
        .await
        .unwrap();

    let bindings = c.status.bindings.clone().unwrap();
    assert_eq!(bindings.len(), 2, "{bindings:#?}");
    let trainer = bindings.iter().find(|b| b.container == "trainer").unwrap();
    assert_eq!(trainer.pod_uid, POD_UID);
    assert_eq!(
        (trainer.namespace.as_str(), trainer.pod.as_str()),
        ("ml", "trainer-0")
    );
    assert_eq!(trainer.resource_name.as_deref(), Some("nvidia.com/gpu"));
    assert_eq!(trainer.gpu_uuids, vec!["GPU-aaaa"]);
    assert_eq!(trainer.source, BindingSource::AllocatedAndObserved);

    // A privileged pod that asked for nothing but runs on GPU 1: out of band.
    let rogue = bindings.iter().find(|b| b.container == "render").unwrap();
    assert_eq!(rogue.pod_uid, ROGUE_UID);
    assert_eq!(
        (rogue.namespace.as_str(), rogue.pod.as_str()),
        ("research", "legacy")
    );
    assert_eq!(rogue.source, BindingSource::Observed);
    assert!(rogue.is_out_of_band());
    assert_eq!(rogue.resource_name, None);
    assert_eq!(rogue.gpu_uuids, vec!["GPU-bbbb"]);
    let privileged = c.status.privileged_pods.clone().unwrap();
    assert_eq!(privileged.len(), 1);
    assert_eq!(privileged[0].name, "legacy");

    // Metrics name the holder, even for the pod that got its GPU without a request.
    let holders: Vec<(&Holder, HolderSource)> = c.holders["GPU-bbbb"]
        .iter()
        .map(|h| (&h.holder, h.source))
        .collect();
    assert_eq!(
        holders,
        [(
            &Holder {
                namespace: "research".into(),
                pod: "legacy".into(),
                container: "render".into()
            },
            HolderSource::Observed
        )]
    );
    // List and GetAllocatableResources; the kubelet offers a GPU NVML does not know.
    assert_eq!(server.calls(), 2);
    let text = metrics.encode();
    assert!(
        text.contains("gpuwarden_node_agent_kubelet_allocatable_gpu_devices 2"),
        "{text}"
    );
    assert!(
        text.contains("gpuwarden_node_agent_kubelet_unknown_gpu_devices 1"),
        "{text}"
    );
    assert!(
        text.contains(r#"gpuwarden_node_agent_gpu_utilization_ratio{gpu="1",UUID="GPU-bbbb",modelName="NVIDIA H100 80GB HBM3",Hostname=""} 0.4"#),
        "{text}"
    );
    server.stop().await;
}

#[tokio::test]
async fn an_idle_allocation_is_allocated_only() {
    let mut node = fake_node();
    node.processes.clear();
    let host = tempfile::tempdir().unwrap();
    let mut s = sweeper(node, AllocationSource::Static(allocations()), host.path());
    let pods = pods();
    let c = s
        .sweep(t0(), &pods, true, &HealthRules::default())
        .await
        .unwrap();
    let bindings = c.status.bindings.unwrap();
    assert_eq!(bindings.len(), 1);
    assert_eq!(bindings[0].source, BindingSource::Allocated);
}

#[tokio::test]
async fn a_container_using_more_gpus_than_allocated_is_out_of_band() {
    let mut node = fake_node();
    // The trainer (allocated GPU 0) also runs a process on GPU 1, e.g. NVIDIA_VISIBLE_DEVICES=all.
    node.processes[1].pid = 4243;
    let host = host_root();
    let uid_ = POD_UID.replace('-', "_");
    write_cgroup(
        host.path(),
        4243,
        &format!("0::/kubepods.slice/kubepods-pod{uid_}.slice/cri-containerd-{TRAINER_ID}.scope\n"),
    );
    let mut s = sweeper(node, AllocationSource::Static(allocations()), host.path());
    let pods = pods();
    let c = s
        .sweep(t0(), &pods, true, &HealthRules::default())
        .await
        .unwrap();
    let bindings = c.status.bindings.unwrap();
    assert_eq!(bindings.len(), 1);
    assert_eq!(bindings[0].gpu_uuids, vec!["GPU-aaaa", "GPU-bbbb"]);
    assert_eq!(bindings[0].source, BindingSource::Observed);
}

#[tokio::test]
async fn kubelet_rate_limit_is_respected() {
    let sock = tempfile::tempdir().unwrap();
    let server = FakeKubeletServer::start(
        &sock.path().join("kubelet.sock"),
        FakeKubelet {
            pods: allocations(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let host = host_root();
    let mut s = sweeper(fake_node(), kubelet(server.socket(), false), host.path());
    let pods = pods();
    let rules = HealthRules::default();
    s.sweep(t0(), &pods, true, &rules).await.unwrap();
    // List, and GetAllocatableResources once per refresh.
    assert_eq!(server.calls(), 2);

    server.reject_next(1);
    let c = s.sweep(at(10), &pods, true, &rules).await.unwrap();
    assert_eq!(server.calls(), 3);
    // The last known allocations stand in while the kubelet refuses.
    let trainer = c.status.bindings.unwrap();
    assert!(
        trainer
            .iter()
            .any(|b| b.source == BindingSource::AllocatedAndObserved)
    );

    // Within the backoff the kubelet is not asked at all.
    s.sweep(at(11), &pods, true, &rules).await.unwrap();
    assert_eq!(server.calls(), 3);

    tokio::time::sleep(Duration::from_millis(1100)).await;
    s.sweep(at(20), &pods, true, &rules).await.unwrap();
    assert_eq!(server.calls(), 4);
    server.stop().await;
}

#[tokio::test]
async fn kubelet_missing_is_clear_and_retried() {
    let sock = tempfile::tempdir().unwrap();
    let path = sock.path().join("kubelet.sock");
    let host = host_root();
    let pods = pods();
    let rules = HealthRules::default();

    // inspect --pod-resources-socket: a clear error.
    let mut strict = sweeper(fake_node(), kubelet(&path, true), host.path());
    let err = strict
        .sweep(t0(), &pods, true, &rules)
        .await
        .expect_err("a missing socket fails a strict sweep")
        .to_string();
    assert_eq!(
        err,
        format!(
            "kubelet pod-resources socket {} does not exist: is the kubelet running, and is its pod-resources directory mounted into the agent? (--pod-resources-socket)",
            path.display()
        )
    );

    // run: the sweep goes on without allocations, and picks them up once the kubelet is back.
    let mut s = sweeper(fake_node(), kubelet(&path, false), host.path());
    let c = s.sweep(t0(), &pods, true, &rules).await.unwrap();
    assert!(
        c.status
            .bindings
            .unwrap()
            .iter()
            .all(|b| b.source == BindingSource::Observed)
    );
    let server = FakeKubeletServer::start(
        &path,
        FakeKubelet {
            pods: allocations(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let c = s.sweep(at(10), &pods, true, &rules).await.unwrap();
    assert!(
        c.status
            .bindings
            .unwrap()
            .iter()
            .any(|b| b.source == BindingSource::AllocatedAndObserved)
    );
    server.stop().await;
}

#[tokio::test]
async fn no_write_when_nothing_changed_and_exactly_one_after_a_change() {
    let (client, api) = MockApi::start();
    let mut writer = StatusWriter::new(
        KubeSink::new(client, NODE),
        MIN_WRITE_INTERVAL,
        Duration::from_secs(600),
    );
    let host = host_root();
    let mut s = sweeper(
        fake_node(),
        AllocationSource::Static(allocations()),
        host.path(),
    );
    let pods = pods();
    let rules = HealthRules::default();

    let c = s.sweep(at(0), &pods, true, &rules).await.unwrap();
    assert_eq!(
        writer.tick(at(0), &c.status).await.unwrap(),
        Outcome::Written
    );
    assert_eq!(api.patches().len(), 1);

    // Nothing changes for almost five minutes: no write.
    for sec in (10..300).step_by(10) {
        let c = s.sweep(at(sec), &pods, true, &rules).await.unwrap();
        assert_eq!(
            writer.tick(at(sec), &c.status).await.unwrap(),
            Outcome::Unchanged
        );
    }
    assert_eq!(api.patches().len(), 1);

    // XID 79 on GPU 1 at 5m: exactly one write.
    let c = s.sweep(at(300), &pods, true, &rules).await.unwrap();
    assert_eq!(
        writer.tick(at(300), &c.status).await.unwrap(),
        Outcome::Written
    );
    for sec in (310..=620).step_by(10) {
        let c = s.sweep(at(sec), &pods, true, &rules).await.unwrap();
        writer.tick(at(sec), &c.status).await.unwrap();
    }
    let patches = api.patches();
    assert_eq!(patches.len(), 2);
    // The resync at 10m read the object instead of writing it.
    assert!(
        api.seen
            .lock()
            .unwrap()
            .iter()
            .any(|r| r.method == Method::GET
                && r.path_and_query.ends_with("/gpunodes/gpu-node-1/status"))
    );

    // The apply: the status subresource, the agent's field manager, only the agent's fields.
    let p = &patches[1];
    assert!(
        p.path_and_query
            .starts_with("/apis/gpuwarden.io/v1alpha1/gpunodes/gpu-node-1/status?"),
        "{}",
        p.path_and_query
    );
    assert!(
        p.path_and_query
            .contains("fieldManager=gpuwarden-node-agent")
    );
    assert!(p.path_and_query.contains("force=true"));
    assert_eq!(p.content_type, "application/apply-patch+yaml");
    let mut keys: Vec<&str> = p.body["status"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        ["bindings", "driver", "gpus", "privilegedPods", "runtime"]
    );
    assert_eq!(p.body["status"]["gpus"][1]["health"]["state"], "Unhealthy");
    assert_eq!(
        p.body["status"]["gpus"][1]["health"]["reasons"][0],
        "Xid79: GPU has fallen off the bus"
    );
    // No per-poll values in status.
    let text = p.body.to_string();
    assert!(!text.contains("utilization") && !text.contains("temperature"));
}

#[tokio::test]
async fn waits_while_the_gpunode_does_not_exist() {
    let (client, api) = MockApi::start();
    *api.exists.lock().unwrap() = false;
    let mut writer = StatusWriter::new(
        KubeSink::new(client, NODE),
        MIN_WRITE_INTERVAL,
        Duration::from_secs(600),
    );
    let host = host_root();
    let mut s = sweeper(fake_node(), AllocationSource::None, host.path());
    let c = s
        .sweep(at(0), &[], true, &HealthRules::default())
        .await
        .unwrap();
    assert_eq!(
        writer.tick(at(0), &c.status).await.unwrap(),
        Outcome::WaitingForGpuNode
    );
    // Within the backoff: no request at all.
    let before = api.seen.lock().unwrap().len();
    assert_eq!(
        writer.tick(at(1), &c.status).await.unwrap(),
        Outcome::WaitingForGpuNode
    );
    assert_eq!(api.seen.lock().unwrap().len(), before);
    // The operator creates it: the next attempt writes.
    *api.exists.lock().unwrap() = true;
    assert_eq!(
        writer.tick(at(2), &c.status).await.unwrap(),
        Outcome::Written
    );
}

#[tokio::test]
async fn health_follows_the_script_and_recovers() {
    let host = host_root();
    let mut s = sweeper(fake_node(), AllocationSource::None, host.path());
    let rules = HealthRules {
        recover_after: Duration::from_secs(120),
        ..HealthRules::default()
    };
    let gpu1 = |c: &gpuwarden_node_agent::status::Computed| {
        c.status.gpus.as_ref().unwrap()[1].health.clone()
    };
    let c = s.sweep(at(0), &[], true, &rules).await.unwrap();
    assert_eq!(gpu1(&c).state, HealthState::Healthy);
    let c = s.sweep(at(300), &[], true, &rules).await.unwrap();
    assert_eq!(gpu1(&c).state, HealthState::Unhealthy);
    let c = s.sweep(at(419), &[], true, &rules).await.unwrap();
    assert_eq!(gpu1(&c).state, HealthState::Unhealthy);
    let c = s.sweep(at(420), &[], true, &rules).await.unwrap();
    assert_eq!(gpu1(&c).state, HealthState::Healthy);
    assert_eq!(s.health().xid_count("GPU-bbbb"), 1);
}

/// A GPU whose NVML reading says pages wait for retirement (before Ampere; a reset is
/// needed) is unhealthy with that reason for as long as NVML says so, through the fake
/// backend, the sweep and the status it computes; its neighbour stays healthy.
#[tokio::test]
async fn pending_page_retirement_makes_a_gpu_unhealthy_while_reported() {
    let host = host_root();
    let node = FakeNode::parse(
        r#"
driver: {driverVersion: "470.256.02"}
gpus:
  - {index: 0, uuid: GPU-v100-0, model: Tesla V100-SXM2-32GB, memoryMiB: 32768,
     pagesPendingRetirement: true, eccUncorrected: 0}
  - {index: 1, uuid: GPU-v100-1, model: Tesla V100-SXM2-32GB, memoryMiB: 32768,
     pagesPendingRetirement: false}
"#,
        "v100.yaml",
    )
    .unwrap();
    let mut s = sweeper(node, AllocationSource::None, host.path());
    let rules = HealthRules::default();
    for now in [0, 3600] {
        let c = s.sweep(at(now), &[], true, &rules).await.unwrap();
        let gpus = c.status.gpus.as_ref().unwrap();
        assert_eq!(gpus[0].health.state, HealthState::Unhealthy, "at {now}s");
        assert_eq!(
            gpus[0].health.reasons,
            ["pages pending retirement (GPU reset needed)"],
            "at {now}s"
        );
        assert_eq!(gpus[1].health.state, HealthState::Healthy, "at {now}s");
    }
}

/// In the DaemonSet the runtime configuration comes from the report of the pod's other
/// container. Until it is written the status says so (RuntimeIsolation Unknown, naming the
/// report), and the next sweep reads it, without waiting for the refresh interval; the
/// agent's own host root is not read for it.
#[tokio::test]
async fn the_runtime_comes_from_the_report_once_it_is_written() {
    let host = host_root();
    // A config under the agent's own host root, which must not be what it reports.
    let etc = host.path().join("etc/nvidia-container-runtime");
    std::fs::create_dir_all(&etc).unwrap();
    std::fs::write(etc.join("config.toml"), "").unwrap();
    let shared = tempfile::tempdir().unwrap();
    let report = shared.path().join("runtime.json");
    let mut s = sweeper(fake_node(), AllocationSource::None, host.path())
        .with_runtime_report(Some(report.clone()));
    let rules = HealthRules::default();

    let first = s.sweep(t0(), &[], true, &rules).await.unwrap();
    let runtime = first.status.runtime.unwrap();
    assert_eq!(runtime.config_path, None);
    assert!(
        runtime
            .error
            .as_deref()
            .is_some_and(|e| e.contains("runtime.json has not been written yet")),
        "{runtime:?}"
    );

    let written = gpuwarden_crds::RuntimeStatus {
        config_path: Some(gpuwarden_node_agent::runtime::CONFIG_PATHS[1].to_owned()),
        accept_env_var_when_unprivileged: Some(false),
        mode: Some("cdi".to_owned()),
        device_list_strategy: None,
        cdi_enabled: true,
        error: Some("/etc/cdi does not exist".to_owned()),
        ..Default::default()
    };
    gpuwarden_node_agent::runtime::write_report(&report, &written).unwrap();
    let next = s
        .sweep(t0() + Duration::from_secs(10), &[], true, &rules)
        .await
        .unwrap();
    assert_eq!(next.status.runtime, Some(written));
}

/// The compute-domain driver's specs for a daemon claim prepared on the node: the claim's
/// own device, and the driver's `device=all` with every GPU (v25.12.0).
const DAEMON_CLAIM_SPECS: [(&str, &str); 2] = [
    (
        "k8s.compute-domain.nvidia.com-claim_c1.yaml",
        r#"
cdiVersion: 0.5.0
kind: k8s.compute-domain.nvidia.com/claim
devices:
  - name: c1-daemon-0
    containerEdits:
      deviceNodes: [{path: /dev/nvidia-caps/nvidia-cap3, type: c, major: 235, minor: 3}]
"#,
    ),
    (
        "k8s.compute-domain.nvidia.com-device_base.yaml",
        r#"
cdiVersion: 0.5.0
kind: k8s.compute-domain.nvidia.com/device
devices:
  - name: all
    containerEdits:
      deviceNodes:
        - {path: /dev/nvidia-uvm}
        - {path: /dev/nvidia0}
        - {path: /dev/nvidia1}
        - {path: /dev/nvidiactl}
"#,
    ),
];

/// A tenant's pod holding a claim on the compute-domain daemon class, which requests no GPU:
/// the kubelet allocates it `daemon-0`, and the CDI spec the driver prepared hands it every
/// GPU. The agent reads the spec and reports the container as holding them beyond its claim;
/// a CDI device no spec defines is counted as an error.
#[tokio::test]
async fn a_claim_whose_cdi_spec_hands_out_every_gpu_is_reported_beyond_it() {
    use gpuwarden_node_agent::podresources::{
        CdiDevice, ClaimResource, ContainerResources, DynamicResource, PodResources,
    };
    let host = host_root();
    let cdi = host.path().join("var/run/cdi");
    std::fs::create_dir_all(&cdi).unwrap();
    for (name, text) in DAEMON_CLAIM_SPECS {
        std::fs::write(cdi.join(name), text).unwrap();
    }
    let claim = |name: &str, cdi: &[&str]| DynamicResource {
        claim_name: name.into(),
        claim_namespace: "research".into(),
        claim_resources: vec![ClaimResource {
            cdi_devices: (cdi.iter())
                .map(|n| CdiDevice {
                    name: n.to_string(),
                })
                .collect(),
            driver_name: "compute-domain.nvidia.com".into(),
            pool_name: NODE.into(),
            device_name: "daemon-0".into(),
        }],
    };
    let mut list = allocations();
    list.push(PodResources {
        name: "legacy".into(),
        namespace: "research".into(),
        containers: vec![ContainerResources {
            name: "render".into(),
            devices: vec![],
            dynamic_resources: vec![claim(
                "steal",
                &[
                    "k8s.compute-domain.nvidia.com/device=all",
                    "k8s.compute-domain.nvidia.com/claim=c1-daemon-0",
                ],
            )],
        }],
    });
    let mut node = fake_node();
    node.processes.clear();
    let metrics = Arc::new(Metrics::new());
    let mut s = Sweeper::new(
        Arc::new(FakeBackend::new(node, t0())),
        AllocationSource::Static(list.clone()),
        host.path(),
        Duration::from_secs(600),
        metrics.clone(),
    );
    let mut pods = pods();
    pods[1].containers[0].privileged = false;
    let c = s
        .sweep(t0(), &pods, true, &HealthRules::default())
        .await
        .unwrap();
    let bindings = c.status.bindings.unwrap();
    let thief = bindings.iter().find(|b| b.pod == "legacy").unwrap();
    assert_eq!(thief.source, BindingSource::BeyondClaim);
    assert!(thief.is_out_of_band());
    assert_eq!(thief.claims, ["research/steal"]);
    assert_eq!(thief.gpu_uuids, ["GPU-aaaa", "GPU-bbbb"]);
    assert_eq!(thief.device_nodes, ["/dev/nvidia0", "/dev/nvidia1"]);
    // The trainer's own GPU is its allocation, nothing beyond.
    let trainer = bindings.iter().find(|b| b.pod == "trainer-0").unwrap();
    assert_eq!(trainer.source, BindingSource::Allocated);
    assert!(!metrics.encode().contains(r#"source="cdi""#));

    // A CDI device no spec defines: nothing to judge, said and counted.
    list[1].containers[0].dynamic_resources = vec![claim(
        "other",
        &["k8s.compute-domain.nvidia.com/claim=gone-daemon-0"],
    )];
    let mut s = Sweeper::new(
        Arc::new(FakeBackend::new(fake_node(), t0())),
        AllocationSource::Static(list),
        host.path(),
        Duration::from_secs(600),
        metrics.clone(),
    );
    let c = s
        .sweep(t0(), &pods, true, &HealthRules::default())
        .await
        .unwrap();
    let bindings = c.status.bindings.unwrap();
    assert!(
        bindings
            .iter()
            .all(|b| b.source != BindingSource::BeyondClaim),
        "{bindings:?}"
    );
    let text = metrics.encode();
    assert!(
        text.contains(r#"gpuwarden_node_agent_errors_total{source="cdi"} 1"#),
        "{text}"
    );
}
