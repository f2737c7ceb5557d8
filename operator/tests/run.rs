//! The whole operator (`gpuwarden_operator::run`) against the in-process fake API server:
//! watches, caches, change filters, appliers, health endpoints and graceful shutdown.

#[path = "support/fake_api.rs"]
mod fake_api;
#[path = "support/running.rs"]
mod running;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fake_api::{FakeApi, gpunode, lease, node};
use running::{Running, free_port, wait_for};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_runs_end_to_end_against_a_fake_api_server() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let fake = Arc::new(FakeApi::default());
    let now = jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S.%6fZ")
        .to_string();
    // Ten GPU nodes with agents; node 0's agent went silent an hour ago.
    for i in 0..10 {
        let name = format!("gpu-node-{i:05}");
        fake.insert("nodes", &name, node(i));
        fake.insert("gpunodes", &name, gpunode(i));
        let mut l = lease(i, &now);
        if i == 0 {
            l["spec"]["renewTime"] = json!("2020-01-01T00:00:00.000000Z");
            l["spec"]["leaseDurationSeconds"] = json!(40);
        }
        fake.insert("leases", &format!("gpuwarden-agent-{name}"), l);
    }
    // A GPU node nobody has made a GpuNode for yet.
    fake.insert("nodes", "gpu-node-00010", node(10));
    // A node whose GPUs are gone (no label, no allocatable GPUs, no agent), with a stale GpuNode.
    let mut cpu = node(11);
    cpu["metadata"]["labels"] = json!({});
    cpu["status"]["allocatable"] = json!({"cpu": "64"});
    fake.insert("nodes", "gpu-node-00011", cpu);
    fake.insert("gpunodes", "gpu-node-00011", gpunode(11));
    // A GpuNode whose Node is gone.
    fake.insert("gpunodes", "gpu-node-00012", gpunode(12));
    // An invalid policy.
    let mut policy = serde_json::to_value(gpuwarden_crds::GpuPolicy::default_policy()).unwrap();
    policy["metadata"]["generation"] = json!(2);
    policy["spec"]["capabilities"]["allowed"] = json!(["IPC_LOCK", "CAP_SYS_ADMIN"]);
    fake.insert("gpupolicies", "default", policy);

    let addr = free_port();
    let mut config = gpuwarden_operator::Config::new("gpuwarden-system");
    config.health_listen = addr;
    config.leader_election = false;
    config.concurrency = 4;
    let operator = Running::start(&fake, config, None);

    let t = Duration::from_secs(30);
    wait_for("GpuNode and policy statuses", t, || {
        // 11 GpuNodes (10 existing, 1 created) and the policy.
        fake.status_writes.load(Ordering::Relaxed) >= 12
    })
    .await;
    wait_for("stale GpuNodes deleted", t, || {
        fake.deletes.load(Ordering::Relaxed) >= 2
    })
    .await;
    wait_for("webhook Secret", t, || fake.count("secrets") == 1).await;

    // Created for the new GPU node, owned by it.
    let created = fake
        .get("gpunodes", "gpu-node-00010")
        .expect("GpuNode created");
    assert_eq!(created["spec"]["nodeName"], "gpu-node-00010");
    assert_eq!(
        created["metadata"]["ownerReferences"][0]["uid"],
        "uid-gpu-node-00010"
    );
    // Removed: the node without GPUs and the node that is gone.
    assert!(fake.get("gpunodes", "gpu-node-00011").is_none());
    assert!(fake.get("gpunodes", "gpu-node-00012").is_none());

    let conditions =
        |name: &str| fake.get("gpunodes", name).unwrap()["status"]["conditions"].clone();
    let status_of = |name: &str, t: &str| {
        conditions(name)
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == t)
            .map(|c| c["status"].as_str().unwrap_or_default().to_owned())
    };
    assert_eq!(
        status_of("gpu-node-00001", "AgentReady").as_deref(),
        Some("True")
    );
    assert_eq!(
        status_of("gpu-node-00001", "Healthy").as_deref(),
        Some("True")
    );
    assert_eq!(
        status_of("gpu-node-00000", "AgentReady").as_deref(),
        Some("False")
    );
    let sample = fake.get("gpunodes", "gpu-node-00001").unwrap();
    assert_eq!(sample["status"]["summary"]["gpus"], 8);
    assert_eq!(
        sample["status"]["gpus"].as_array().unwrap().len(),
        8,
        "agent fields kept"
    );

    wait_for("policy status", t, || {
        fake.get("gpupolicies", "default")
            .is_some_and(|p| p["status"]["observedGeneration"] == 2)
    })
    .await;
    let policy = fake.get("gpupolicies", "default").unwrap();
    assert_eq!(
        policy["status"]["conditions"][0]["reason"],
        "UnknownCapability"
    );

    // Health endpoints.
    let (code, _) = http_get(addr, "/healthz").await;
    assert_eq!(code, 200);
    let (code, _) = http_get(addr, "/readyz").await;
    assert_eq!(code, 200);
    let (code, metrics) = http_get(addr, "/metrics").await;
    assert_eq!(code, 200);
    assert!(
        metrics.contains(r#"gpuwarden_operator_reconciles_total{controller="gpunode"}"#),
        "{metrics}"
    );
    assert!(metrics.contains("gpuwarden_operator_reconcile_duration_seconds_bucket"));
    assert!(metrics.contains("gpuwarden_operator_caches_synced 1"));

    // Steady state: the operator's own writes came back through the watches; Leases are
    // renewed and kubelets post heartbeats. Nothing is written.
    let mut before = fake.writes.load(Ordering::Relaxed);
    loop {
        // Let the cold start's last writes (events) land first.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = fake.writes.load(Ordering::Relaxed);
        if now == before {
            break;
        }
        before = now;
    }
    for i in 1..10 {
        let name = format!("gpu-node-{i:05}");
        fake.modify("leases", &format!("gpuwarden-agent-{name}"), |l| {
            l["spec"]["renewTime"] = json!(now);
        });
        fake.modify("nodes", &name, |n| {
            n["status"]["conditions"][0]["lastHeartbeatTime"] = json!(now);
        });
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        fake.writes.load(Ordering::Relaxed),
        before,
        "steady state wrote"
    );

    // An agent reports a sick GPU: Healthy turns False.
    fake.modify("gpunodes", "gpu-node-00002", |g| {
        g["status"]["gpus"][3]["health"] =
            json!({"state": "Unhealthy", "reasons": ["Xid79: GPU has fallen off the bus"]});
    });
    wait_for("Healthy=False", t, || {
        status_of("gpu-node-00002", "Healthy").as_deref() == Some("False")
    })
    .await;

    // Graceful shutdown.
    operator.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_is_ready_writes_nothing_and_reconciles_everything_when_it_takes_over() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let fake = Arc::new(FakeApi::default());
    let now = jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S.%6fZ")
        .to_string();
    for i in 0..5 {
        let name = format!("gpu-node-{i:05}");
        fake.insert("nodes", &name, node(i));
        fake.insert("gpunodes", &name, gpunode(i));
        fake.insert("leases", &format!("gpuwarden-agent-{name}"), lease(i, &now));
    }
    let addr = free_port();
    let mut config = gpuwarden_operator::Config::new("gpuwarden-system");
    config.health_listen = addr;
    let (leader_tx, leadership) = gpuwarden_operator::Leadership::channel(false);
    let operator = Running::start(&fake, config, Some(leadership));

    // The standby syncs its caches and reports ready, but writes nothing.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok((200, _)) =
            tokio::time::timeout(Duration::from_secs(1), http_get_ok(addr, "/readyz")).await
        {
            break;
        }
        assert!(Instant::now() < deadline, "standby never became ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(fake.writes.load(Ordering::Relaxed), 0, "a standby wrote");
    let (_, metrics) = http_get(addr, "/metrics").await;
    assert!(metrics.contains("gpuwarden_operator_leader 0"), "{metrics}");

    // The leader's Lease lapsed and this replica won the election: it catches up on everything.
    leader_tx.send(true).unwrap();
    wait_for("statuses after takeover", Duration::from_secs(20), || {
        fake.status_writes.load(Ordering::Relaxed) >= 5 && fake.count("secrets") == 1
    })
    .await;
    let (_, metrics) = http_get(addr, "/metrics").await;
    assert!(metrics.contains("gpuwarden_operator_leader 1"), "{metrics}");

    // Losing leadership stops the writes again.
    leader_tx.send(false).unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = fake.writes.load(Ordering::Relaxed);
    fake.modify("gpunodes", "gpu-node-00001", |g| {
        g["status"]["gpus"][0]["health"] = json!({"state": "Unhealthy", "reasons": ["Xid48: DBE"]});
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        fake.writes.load(Ordering::Relaxed),
        before,
        "a deposed leader wrote"
    );

    operator.stop().await;
}

async fn http_get_ok(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    match tokio::net::TcpStream::connect(addr).await {
        Ok(_) => http_get(addr, path).await,
        Err(_) => (0, String::new()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_election_makes_the_only_replica_leader_and_releases_on_shutdown() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let fake = Arc::new(FakeApi::default());
    let now = jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S.%6fZ")
        .to_string();
    for i in 0..3 {
        let name = format!("gpu-node-{i:05}");
        fake.insert("nodes", &name, node(i));
        fake.insert("gpunodes", &name, gpunode(i));
        fake.insert("leases", &format!("gpuwarden-agent-{name}"), lease(i, &now));
    }
    let addr = free_port();
    let mut config = gpuwarden_operator::Config::new("gpuwarden-system");
    config.health_listen = addr;
    config.identity = "replica-a".into();
    let operator = Running::start(&fake, config, None);
    wait_for("leader writes", Duration::from_secs(30), || {
        fake.status_writes.load(Ordering::Relaxed) >= 3
    })
    .await;
    let lease = fake
        .get("leases", "gpuwarden-operator-leader")
        .expect("leader Lease created");
    assert_eq!(lease["spec"]["holderIdentity"], "replica-a");
    let (_, metrics) = http_get(addr, "/metrics").await;
    assert!(metrics.contains("gpuwarden_operator_leader 1"), "{metrics}");

    operator.stop().await;
    let lease = fake.get("leases", "gpuwarden-operator-leader").unwrap();
    assert_ne!(
        lease["spec"]["holderIdentity"], "replica-a",
        "the Lease is released on shutdown so a standby takes over at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_replica_takes_over_when_the_leader_goes() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let fake = Arc::new(FakeApi::default());
    let now = jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S.%6fZ")
        .to_string();
    for i in 0..3 {
        let name = format!("gpu-node-{i:05}");
        fake.insert("nodes", &name, node(i));
        fake.insert("gpunodes", &name, gpunode(i));
        fake.insert("leases", &format!("gpuwarden-agent-{name}"), lease(i, &now));
    }
    let start = |identity: &str| {
        let addr = free_port();
        let mut config = gpuwarden_operator::Config::new("gpuwarden-system");
        config.health_listen = addr;
        config.identity = identity.into();
        config.manage_webhook_certificates = false;
        (addr, Running::start(&fake, config, None))
    };
    let holder = || {
        fake.get("leases", "gpuwarden-operator-leader").map(|l| {
            l["spec"]["holderIdentity"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
    };

    let (_a_addr, a) = start("replica-a");
    wait_for("replica-a leads", Duration::from_secs(30), || {
        holder().as_deref() == Some("replica-a") && fake.status_writes.load(Ordering::Relaxed) >= 3
    })
    .await;
    let (b_addr, b) = start("replica-b");
    let deadline = Instant::now() + Duration::from_secs(20);
    while http_get_ok(b_addr, "/readyz").await.0 != 200 {
        assert!(Instant::now() < deadline, "standby never became ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, metrics) = http_get(b_addr, "/metrics").await;
    assert!(metrics.contains("gpuwarden_operator_leader 0"), "{metrics}");

    // The leader goes; the standby takes the Lease and writes from then on.
    a.stop().await;
    wait_for("replica-b leads", Duration::from_secs(40), || {
        holder().as_deref() == Some("replica-b")
    })
    .await;
    fake.modify("gpunodes", "gpu-node-00001", |g| {
        g["status"]["gpus"][0]["health"] = json!({"state": "Unhealthy", "reasons": ["Xid48: DBE"]});
    });
    wait_for("new leader writes", Duration::from_secs(20), || {
        fake.get("gpunodes", "gpu-node-00001").is_some_and(|g| {
            g["status"]["conditions"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["type"] == "Healthy" && c["status"] == "False")
            })
        })
    })
    .await;
    b.stop().await;
}

/// The webhook configuration as the manifests create it: no `caBundle`. Two entries, so the
/// test sees every entry patched. The exemption condition is the one the operator keeps
/// where no GpuPolicy exists (send every pod).
fn webhook_configuration() -> serde_json::Value {
    let entry = |name: &str| {
        json!({
            "name": name,
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "clientConfig": {
                "service": {"name": "gpuwarden-webhook", "namespace": "gpuwarden-system", "path": "/mutate"},
            },
            "matchConditions": [
                {"name": "may-reach-gpus", "expression": "true"},
                {"name": gpuwarden_crds::admission::match_conditions::NOT_EXEMPT_CONDITION, "expression": "true"},
            ],
        })
    };
    json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "gpuwarden", "uid": "mwc-1"},
        "webhooks": [entry("pods.gpuwarden.io"), entry("other.gpuwarden.io")],
    })
}

/// The `caBundle` of each entry of the webhook configuration, as stored (base64).
fn bundles(fake: &FakeApi) -> Vec<serde_json::Value> {
    fake.get("mutatingwebhookconfigurations", "gpuwarden")
        .map(|m| {
            m["webhooks"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|w| w["clientConfig"]["caBundle"].clone())
                .collect()
        })
        .unwrap_or_default()
}

/// Requests to the webhook configuration that wrote it.
fn configuration_writes(fake: &FakeApi) -> Vec<String> {
    fake.requests
        .lock()
        .unwrap()
        .iter()
        .filter(|r| !r.starts_with("GET ") && r.contains("/mutatingwebhookconfigurations"))
        .cloned()
        .collect()
}

/// What the emergency procedure of docs/operations.md ("When the webhook is down") leads to:
/// the webhook configuration deleted, then re-created from the manifests, which carry no
/// `caBundle`. The operator notices through its watch and writes the bundle from the Secret
/// into every entry within seconds, under its own field manager; it puts back a bundle
/// someone changed, and leaves a trusted configuration alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_re_created_webhook_configuration_gets_its_ca_bundle_back_within_seconds() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let fake = Arc::new(FakeApi::default());
    let mut config = gpuwarden_operator::Config::new("gpuwarden-system");
    config.health_listen = free_port();
    config.leader_election = false;
    let operator = Running::start(&fake, config, None);
    wait_for("webhook Secret", Duration::from_secs(20), || {
        fake.count("secrets") == 1
    })
    .await;
    let ca = fake.get("secrets", "gpuwarden-webhook-tls").unwrap()["data"]["ca.crt"].clone();
    assert!(ca.is_string(), "{ca}");
    // The operator watches that one configuration by name, as its RBAC requires.
    wait_for(
        "a watch on the configuration",
        Duration::from_secs(5),
        || {
            fake.requests.lock().unwrap().iter().any(|r| {
                r.starts_with(
                    "GET /apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations?",
                ) && r.contains("watch=true")
                    && r.contains("fieldSelector=metadata.name%3Dgpuwarden")
            })
        },
    )
    .await;

    // Re-created without a bundle: every entry trusts the CA again within seconds (the
    // periodic pass alone would take up to five minutes).
    let created = Instant::now();
    fake.create(
        "mutatingwebhookconfigurations",
        "gpuwarden",
        webhook_configuration(),
    );
    wait_for("caBundle restored", Duration::from_secs(5), || {
        bundles(&fake) == [ca.clone(), ca.clone()]
    })
    .await;
    eprintln!("caBundle restored after {:?}", created.elapsed());
    // The operator's own write comes back through the watch and finds nothing to do.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let writes = configuration_writes(&fake);
    assert_eq!(writes.len(), 1, "{writes:#?}");
    assert!(
        writes[0].starts_with("PATCH ") && writes[0].contains("fieldManager=gpuwarden-operator"),
        "{writes:#?}"
    );

    // A bundle someone changed is put back.
    fake.modify("mutatingwebhookconfigurations", "gpuwarden", |m| {
        m["webhooks"][1]["clientConfig"]["caBundle"] = json!("c3RhbGU=");
    });
    wait_for("stale caBundle replaced", Duration::from_secs(5), || {
        bundles(&fake) == [ca.clone(), ca.clone()]
    })
    .await;
    assert_eq!(configuration_writes(&fake).len(), 2);

    // A trusted configuration is not written, whatever else changes in it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    fake.modify("mutatingwebhookconfigurations", "gpuwarden", |m| {
        m["metadata"]["labels"] = json!({"team": "platform"});
        m["webhooks"][0]["timeoutSeconds"] = json!(5);
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        configuration_writes(&fake).len(),
        2,
        "{:#?}",
        configuration_writes(&fake)
    );

    operator.stop().await;
}

/// A standby sees the webhook configuration come back without a bundle and writes nothing;
/// once it leads, it restores the bundle at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_restores_the_ca_bundle() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let fake = Arc::new(FakeApi::default());
    // The Secret a previous leader wrote.
    let params = gpuwarden_operator::certs::CertParams {
        namespace: "gpuwarden-system".into(),
        service: "gpuwarden-webhook".into(),
        validity: Duration::from_secs(365 * 86400),
    };
    let plan =
        gpuwarden_operator::certs::plan(&Default::default(), jiff::Timestamp::now(), &params)
            .unwrap();
    let data: std::collections::BTreeMap<&str, k8s_openapi::ByteString> = plan
        .data
        .iter()
        .map(|(k, v)| (k.as_str(), k8s_openapi::ByteString(v.clone())))
        .collect();
    fake.insert(
        "secrets",
        "gpuwarden-webhook-tls",
        json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "gpuwarden-webhook-tls", "namespace": "gpuwarden-system"},
            "type": "kubernetes.io/tls", "data": data,
        }),
    );
    let ca = serde_json::to_value(k8s_openapi::ByteString(plan.ca_bundle.clone())).unwrap();

    let mut config = gpuwarden_operator::Config::new("gpuwarden-system");
    config.health_listen = free_port();
    let (leader_tx, leadership) = gpuwarden_operator::Leadership::channel(false);
    let operator = Running::start(&fake, config, Some(leadership));
    wait_for(
        "a watch on the configuration",
        Duration::from_secs(20),
        || {
            fake.requests
                .lock()
                .unwrap()
                .iter()
                .any(|r| r.contains("/mutatingwebhookconfigurations?") && r.contains("watch=true"))
        },
    )
    .await;
    fake.create(
        "mutatingwebhookconfigurations",
        "gpuwarden",
        webhook_configuration(),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(configuration_writes(&fake).is_empty(), "a standby wrote");
    assert_eq!(fake.writes.load(Ordering::Relaxed), 0, "a standby wrote");

    leader_tx.send(true).unwrap();
    wait_for(
        "caBundle restored by the new leader",
        Duration::from_secs(5),
        || bundles(&fake) == [ca.clone(), ca.clone()],
    )
    .await;

    operator.stop().await;
}

/// The exemption condition follows the GpuPolicies: written into every webhook entry of the
/// configuration under the operator's field manager, rewritten when a policy changes, back
/// within seconds on a configuration re-created from the manifests, and left alone when
/// current. Without certificate management (cert-manager) too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exemption_condition_follows_the_policies() {
    use gpuwarden_crds::GpuPolicy;
    use gpuwarden_crds::admission::match_conditions::{
        NOT_EXEMPT_CONDITION, not_exempt_expression,
    };

    let fake = Arc::new(FakeApi::default());
    let policy = GpuPolicy::default_policy();
    fake.insert(
        "gpupolicies",
        "default",
        serde_json::to_value(&policy).unwrap(),
    );
    let mut shipped = webhook_configuration();
    for hook in shipped["webhooks"].as_array_mut().unwrap() {
        hook["matchConditions"] = json!([{"name": "may-reach-gpus", "expression": "true"}]);
    }
    fake.insert(
        "mutatingwebhookconfigurations",
        "gpuwarden",
        shipped.clone(),
    );
    let mut config = gpuwarden_operator::Config::new("gpuwarden-system");
    config.health_listen = free_port();
    config.leader_election = false;
    config.manage_webhook_certificates = false;
    let operator = Running::start(&fake, config, None);
    let conditions = |fake: &FakeApi| -> Vec<serde_json::Value> {
        let mwc = fake
            .get("mutatingwebhookconfigurations", "gpuwarden")
            .unwrap_or_default();
        (mwc["webhooks"].as_array().into_iter().flatten())
            .map(|w| w["matchConditions"].clone())
            .collect()
    };
    let expected = |expression: &str| {
        json!([
            {"name": "may-reach-gpus", "expression": "true"},
            {"name": NOT_EXEMPT_CONDITION, "expression": expression},
        ])
    };
    // The other entry (VMs, pod entry) judges no pod: it is left as shipped.
    let shipped_only = || json!([{"name": "may-reach-gpus", "expression": "true"}]);
    let default = not_exempt_expression([&policy], |_| true);
    assert!(
        default.contains("nvcr.io/nvidia/k8s-device-plugin:"),
        "{default}"
    );
    wait_for("the condition written", Duration::from_secs(10), || {
        conditions(&fake) == [expected(&default), shipped_only()]
    })
    .await;
    let writes = configuration_writes(&fake);
    assert_eq!(writes.len(), 1, "{writes:#?}");
    assert!(
        writes[0].contains("fieldManager=gpuwarden-operator"),
        "{writes:#?}"
    );

    // A policy that exempts one more namespace: the condition follows.
    let mut more = policy.clone();
    more.spec.exemptions.namespaces.push("monitoring".into());
    fake.modify("gpupolicies", "default", |p| {
        p["spec"]["exemptions"]["namespaces"] = json!(more.spec.exemptions.namespaces);
        p["metadata"]["generation"] = json!(2);
    });
    let updated = not_exempt_expression([&more], |_| true);
    assert!(updated.contains("'monitoring'"), "{updated}");
    wait_for("the condition rewritten", Duration::from_secs(10), || {
        conditions(&fake) == [expected(&updated), shipped_only()]
    })
    .await;

    // Re-created from the manifests: back within seconds.
    fake.remove("mutatingwebhookconfigurations", "gpuwarden");
    let mut recreated = shipped;
    recreated["metadata"]["uid"] = json!("mwc-2");
    fake.create("mutatingwebhookconfigurations", "gpuwarden", recreated);
    let created = Instant::now();
    wait_for("the condition restored", Duration::from_secs(5), || {
        conditions(&fake) == [expected(&updated), shipped_only()]
    })
    .await;
    eprintln!("exemption condition restored after {:?}", created.elapsed());
    // Its own write comes back through the watch and finds nothing to do.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        configuration_writes(&fake).len(),
        3,
        "{:#?}",
        configuration_writes(&fake)
    );
    operator.stop().await;
}
