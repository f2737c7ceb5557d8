//! The operator's list of parts (docs/design.md, "Operator"), run under one shutdown and one
//! leadership, behind the health server. Each part wires its own controller or keeper, its
//! triggers and the caches only it reads ([`crate::wiring`]); the kinds several parts read
//! are watched once ([`crate::feeds`]).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::future::join_all;
use gpuwarden_crds::error_chain;
use kube::Client;
use tracing::{debug, info, warn};

use crate::certs::CertParams;
use crate::feeds::Feeds;
use crate::health::{self, HealthState};
use crate::leader::{self, LeaderError, Leadership};
use crate::metrics::Metrics;
use crate::wiring::{Part, Shared, Shutdown};
use crate::{
    Clock, Config, admission_policies, claim_templates, node_controller, policy_controller,
    reports, system_clock, webhook_certs, webhook_conditions,
};

/// The operator failed to start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The health listener could not be bound.
    #[error("failed to listen on {addr} for /healthz, /readyz and /metrics")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Leader election could not start.
    #[error(transparent)]
    Leader(#[from] LeaderError),
}

/// Runs the operator until `shutdown` resolves, then finishes in-flight reconciles, releases
/// the leader Lease and stops the health server.
pub async fn run<F>(config: Config, client: Client, shutdown: F) -> Result<(), RunError>
where
    F: Future<Output = ()> + Send + 'static,
{
    run_with(config, client, shutdown, system_clock(), None).await
}

/// [`run`] with an injected clock and, optionally, leadership decided by the caller instead
/// of the Lease election (`config.leader_election` is then ignored).
pub async fn run_with<F>(
    config: Config,
    client: Client,
    shutdown: F,
    clock: Clock,
    leadership: Option<Leadership>,
) -> Result<(), RunError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let shutdown = Shutdown::on(shutdown);
    let metrics = Arc::new(Metrics::new());
    let ready = Arc::new(AtomicBool::new(false));
    let health = serve_health(&config, &metrics, &ready, &shutdown).await?;
    let (leadership, election) = lead(&config, &client, leadership, &shutdown).await?;
    let shared = Shared {
        client: client.clone(),
        clock,
        leadership,
        metrics: metrics.clone(),
        shutdown: shutdown.clone(),
        controller_config: kube::runtime::Config::default().concurrency(config.concurrency.max(1)),
    };
    let mut feeds = Feeds::default();
    let keeping = admission_policies::keeping(&client, config.admission_policies).await;
    let (revalidate_tx, revalidate) = tokio::sync::mpsc::unbounded_channel();
    let dra = dra_served(&client).await;
    let parts = vec![
        leadership_part(&shared),
        node_controller::wire(
            &shared,
            &mut feeds,
            &config.namespace,
            &config.identity,
            config.taint_unhealthy_nodes,
        ),
        policy_controller::wire(&shared, &mut feeds, keeping.clone(), revalidate),
        admission_policies::wire(&shared, &mut feeds, keeping, revalidate_tx),
        reports::keeper::wire(&shared, &mut feeds, config.policy_reports),
        webhook_certs::wire(
            &shared,
            &mut feeds,
            config.manage_webhook_certificates,
            CertParams {
                namespace: config.namespace.clone(),
                service: gpuwarden_crds::install::WEBHOOK_NAME.to_owned(),
                validity: config.cert_validity,
            },
        ),
        webhook_conditions::wire(&shared, &mut feeds),
        claim_templates::wire(&shared, &mut feeds, dra),
    ];
    run_parts(parts, feeds, &shared, &ready).await;
    finish(election, health).await
}

/// Watches the shared kinds, waits until every cache holds its first full list (nothing is
/// decided before; what changed meanwhile waits in the triggers), then runs every part until
/// shutdown and waits for the watches to end.
async fn run_parts(parts: Vec<Part>, feeds: Feeds, shared: &Shared, ready: &AtomicBool) {
    let stores = (
        feeds.nodes.store(),
        feeds.gpunodes.store(),
        feeds.policies.store(),
        feeds.namespaces.store(),
    );
    let mut watches = feeds.start(&shared.client, &shared.shutdown);
    let mut synced = Vec::new();
    let mut runs = Vec::new();
    for part in parts {
        watches.extend(part.watches);
        synced.push(part.synced);
        let (name, run) = (part.name, part.run);
        runs.push(async move {
            run.await;
            debug!(part = name, "stopped");
        });
    }
    let caches = async {
        let _ = stores.3.wait_until_ready().await;
        let _ = stores.0.wait_until_ready().await;
        let _ = stores.1.wait_until_ready().await;
        let _ = stores.2.wait_until_ready().await;
        join_all(synced).await;
    };
    tokio::select! {
        () = caches => {
            ready.store(true, Ordering::Release);
            shared.metrics.set_caches_synced(true);
            info!(
                nodes = stores.0.len(),
                gpunodes = stores.1.len(),
                policies = stores.2.len(),
                "caches synced"
            );
            join_all(runs).await;
        }
        () = shared.shutdown.stopped() => {}
    }
    join_all(watches).await;
}

/// Serves `/healthz`, `/readyz` (once `ready`) and `/metrics` until shutdown.
async fn serve_health(
    config: &Config,
    metrics: &Arc<Metrics>,
    ready: &Arc<AtomicBool>,
    shutdown: &Shutdown,
) -> Result<tokio::task::JoinHandle<std::io::Result<()>>, RunError> {
    let listener = tokio::net::TcpListener::bind(config.health_listen)
        .await
        .map_err(|source| RunError::Bind {
            addr: config.health_listen,
            source,
        })?;
    info!(addr = %config.health_listen, "serving /healthz, /readyz and /metrics");
    let state = HealthState {
        metrics: metrics.clone(),
        ready: ready.clone(),
    };
    Ok(tokio::spawn(
        axum::serve(listener, health::router(state))
            .with_graceful_shutdown(shutdown.stopped())
            .into_future(),
    ))
}

/// This replica's leadership: `given`, else the Lease election where it is on, else always.
async fn lead(
    config: &Config,
    client: &Client,
    given: Option<Leadership>,
    shutdown: &Shutdown,
) -> Result<(Leadership, Option<tokio::task::JoinHandle<()>>), RunError> {
    if let Some(given) = given {
        return Ok((given, None));
    }
    if !config.leader_election {
        return Ok((Leadership::always(), None));
    }
    let (leadership, task) = leader::elect(
        client.clone(),
        &config.namespace,
        &config.identity,
        shutdown.receiver(),
    )
    .await?;
    Ok((leadership, Some(task)))
}

/// Follows leadership for the metric and the log, until shutdown.
fn leadership_part(shared: &Shared) -> Part {
    let (mut leadership, metrics) = (shared.leadership.clone(), shared.metrics.clone());
    metrics.set_leader(leadership.is_leader());
    let stopped = shared.shutdown.stopped();
    Part::new("leadership", async move {
        let changes = async {
            while let Some(leader) = leadership.changed().await {
                metrics.set_leader(leader);
                if leader {
                    info!("became leader; reconciling everything");
                } else {
                    info!("not the leader; standing by");
                }
            }
        };
        tokio::select! {
            () = changes => {}
            () = stopped => {}
        }
    })
}

async fn finish(
    election: Option<tokio::task::JoinHandle<()>>,
    health: tokio::task::JoinHandle<std::io::Result<()>>,
) -> Result<(), RunError> {
    if let Some(t) = election {
        let _ = t.await;
    }
    match health.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => warn!(error = %e, "health server failed"),
        Err(e) => warn!(error = %e, "health server task failed"),
    }
    info!("stopped");
    Ok(())
}

/// Whether the API server serves ResourceClaimTemplates in `resource.k8s.io/v1`. Asked once
/// at start; an error counts as no (and is logged), since templates are only needed where a
/// webhook could point pods at them, and the webhook asks for itself.
async fn dra_served(client: &Client) -> bool {
    match client.list_api_group_resources("resource.k8s.io/v1").await {
        Ok(list) => list
            .resources
            .iter()
            .any(|r| r.name == "resourceclaimtemplates"),
        Err(kube::Error::Api(status)) if status.code == 404 => false,
        Err(e) => {
            warn!(error = %error_chain(&e), "discovery of resource.k8s.io/v1 failed; no ResourceClaimTemplates are kept until restart");
            false
        }
    }
}
