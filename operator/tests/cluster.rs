//! Against a real cluster (KUBECONFIG): the operator in-process creates a GpuNode for a GPU
//! Node, follows the agent Lease, and the GpuNode goes when the Node does.
//!
//! Needs the gpuwarden CRDs installed, the `gpuwarden-system` namespace, rights to create Nodes
//! and Leases, and no other gpuwarden operator writing (scale the installed one to 0). The Node
//! it creates has no kubelet behind it and is deleted at the end.
//!
//! `cargo test -p gpuwarden-operator --test cluster -- --ignored`

use std::time::{Duration, Instant};

use gpuwarden_crds::condition_types::AGENT_READY;
use gpuwarden_crds::{AGENT_LEASE_NAMESPACE, GpuNode, LABEL_GPU_PRESENT, agent_lease_name};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};

async fn eventually<T>(what: &str, timeout: Duration, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn agent_ready(gn: &GpuNode) -> Option<String> {
    gn.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == AGENT_READY)
        .map(|c| c.status.clone())
}

#[tokio::test]
#[ignore = "needs a cluster: KUBECONFIG with gpuwarden CRDs installed and no other gpuwarden operator running"]
async fn gpunode_follows_its_node_and_agent_lease() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = Client::try_default().await.expect("KUBECONFIG");
    let name = format!("gpuwarden-test-node-{}", std::process::id());
    let nodes: Api<Node> = Api::all(client.clone());
    let gpunodes: Api<GpuNode> = Api::all(client.clone());
    let leases: Api<Lease> = Api::namespaced(client.clone(), AGENT_LEASE_NAMESPACE);

    let mut config = gpuwarden_operator::Config::new(gpuwarden_crds::SYSTEM_NAMESPACE);
    config.health_listen = ([127, 0, 0, 1], 0).into();
    config.manage_webhook_certificates = false;
    config.identity = format!("{name}-operator");
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let operator = tokio::spawn(gpuwarden_operator::run(
        config,
        client.clone(),
        async move {
            let _ = stop_rx.await;
        },
    ));

    let mut node = Node::default();
    node.metadata.name = Some(name.clone());
    node.metadata.labels = Some([(LABEL_GPU_PRESENT.to_owned(), "true".to_owned())].into());
    let node = nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("create Node");

    let gn = eventually("GpuNode", Duration::from_secs(60), async || {
        gpunodes.get_opt(&name).await.ok().flatten()
    })
    .await;
    assert_eq!(gn.spec.node_name, name);
    let owner = &gn
        .metadata
        .owner_references
        .as_ref()
        .expect("ownerReferences")[0];
    assert_eq!(owner.kind, "Node");
    assert_eq!(Some(&owner.uid), node.metadata.uid.as_ref());

    // A live agent Lease: AgentReady=True; left to lapse: False.
    let mut lease = Lease::default();
    lease.metadata.name = Some(agent_lease_name(&name));
    lease.spec = Some(LeaseSpec {
        holder_identity: Some("test-agent".into()),
        lease_duration_seconds: Some(15),
        renew_time: Some(MicroTime(jiff::Timestamp::now())),
        ..Default::default()
    });
    leases
        .create(&PostParams::default(), &lease)
        .await
        .expect("create Lease");
    eventually("AgentReady=True", Duration::from_secs(30), async || {
        let gn = gpunodes.get_opt(&name).await.ok().flatten()?;
        (agent_ready(&gn)? == "True").then_some(())
    })
    .await;
    eventually(
        "AgentReady=False after the Lease lapsed",
        Duration::from_secs(60),
        async || {
            let gn = gpunodes.get_opt(&name).await.ok().flatten()?;
            (agent_ready(&gn)? == "False").then_some(())
        },
    )
    .await;

    // The Node goes, and so does its GpuNode (garbage collector or operator).
    nodes
        .delete(&name, &DeleteParams::default())
        .await
        .expect("delete Node");
    let _ = leases
        .delete(&agent_lease_name(&name), &DeleteParams::default())
        .await;
    eventually(
        "GpuNode removed",
        Duration::from_secs(60),
        async || match gpunodes.get_opt(&name).await {
            Ok(None) => Some(()),
            _ => None,
        },
    )
    .await;

    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(20), operator).await;
}
