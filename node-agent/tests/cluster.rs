//! The agent in-process against a real API server, with the fake GPU backend and a fake
//! kubelet. Run with `cargo test -p gpuwarden-node-agent --test cluster -- --ignored` and a
//! KUBECONFIG for a disposable cluster that has the CRDs from `deploy/crds/` installed.
//!
//! It creates a GpuNode for a made-up node name (no operator should be running, or it may
//! remove a GpuNode without a Node), the agent's Lease in `gpuwarden-system` (and that
//! namespace if it is missing), and removes what it created.

mod support;

use std::time::Duration;

use gpuwarden_crds::{GpuNode, GpuNodeSpec};
use gpuwarden_node_agent::Config;
use gpuwarden_node_agent::testing::{FakeKubelet, FakeKubeletServer};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use support::*;

#[tokio::test]
#[ignore = "needs a cluster: KUBECONFIG with the gpuwarden CRDs installed"]
async fn agent_writes_its_status_and_lease() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = kube::Client::try_default()
        .await
        .expect("a cluster from KUBECONFIG");
    let node = format!("gpuwarden-agent-test-{}", std::process::id());
    let gpunodes: Api<GpuNode> = Api::all(client.clone());
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let leases: Api<Lease> = Api::namespaced(client.clone(), gpuwarden_crds::AGENT_LEASE_NAMESPACE);

    let created_namespace = match namespaces
        .get_opt(gpuwarden_crds::AGENT_LEASE_NAMESPACE)
        .await
        .expect("read namespace")
    {
        Some(_) => false,
        None => {
            let mut ns = Namespace::default();
            ns.metadata.name = Some(gpuwarden_crds::AGENT_LEASE_NAMESPACE.into());
            namespaces
                .create(&PostParams::default(), &ns)
                .await
                .expect("create namespace");
            true
        }
    };
    gpunodes
        .create(
            &PostParams::default(),
            &GpuNode::new(
                &node,
                GpuNodeSpec {
                    node_name: node.clone(),
                },
            ),
        )
        .await
        .expect("create GpuNode");

    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("node.fake.yaml");
    std::fs::write(&fake, FAKE).unwrap();
    let kubelet = FakeKubeletServer::start(
        &dir.path().join("kubelet.sock"),
        FakeKubelet {
            pods: allocations(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let host = host_root();
    let config = Config {
        fake: Some(fake),
        pod_resources_socket: kubelet.socket().to_path_buf(),
        host_root: host.path().to_path_buf(),
        listen: "127.0.0.1:0".parse().unwrap(),
        poll_interval: Duration::from_millis(500),
        ..Config::new(&node)
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(gpuwarden_node_agent::run(config, client.clone(), async {
        let _ = stop_rx.await;
    }));

    let mut status = None;
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if let Ok(n) = gpunodes.get_status(&node).await
            && n.status
                .as_ref()
                .and_then(|s| s.gpus.as_ref())
                .is_some_and(|g| g.len() == 2)
        {
            status = Some(n);
            break;
        }
    }
    let lease = leases
        .get_opt(&gpuwarden_crds::agent_lease_name(&node))
        .await
        .ok()
        .flatten();

    let _ = stop_tx.send(());
    let stopped = agent.await;
    kubelet.stop().await;
    let _ = gpunodes.delete(&node, &DeleteParams::default()).await;
    let _ = leases
        .delete(
            &gpuwarden_crds::agent_lease_name(&node),
            &DeleteParams::default(),
        )
        .await;
    if created_namespace {
        let _ = namespaces
            .delete(
                gpuwarden_crds::AGENT_LEASE_NAMESPACE,
                &DeleteParams::default(),
            )
            .await;
    }

    assert!(matches!(stopped, Ok(Ok(()))), "{stopped:?}");
    let gpunode = status.expect("the agent wrote two GPUs into the GpuNode status within 60 s");
    let managers: Vec<(String, String)> = gpunode
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .map(|m| {
            (
                m.manager.clone().unwrap_or_default(),
                m.subresource.clone().unwrap_or_default(),
            )
        })
        .collect();
    assert!(
        managers.contains(&("gpuwarden-node-agent".into(), "status".into())),
        "{managers:?}"
    );
    let lease = lease.expect("the agent's Lease exists");
    let spec = lease.spec.expect("Lease spec");
    assert_eq!(spec.holder_identity.as_deref(), Some(node.as_str()));
    assert_eq!(spec.lease_duration_seconds, Some(40));
    assert!(spec.renew_time.is_some());
}
