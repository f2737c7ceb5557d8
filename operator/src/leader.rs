//! Leader election with a coordination.k8s.io Lease (kube-lease-manager). Only the leader
//! writes; standbys keep their caches warm and take over when the leader's Lease lapses.

use std::time::Duration;

use gpuwarden_crds::install::OPERATOR_LEADER_LEASE;
use kube::Client;
use kube_lease_manager::{LeaseManagerBuilder, LeaseManagerError};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

/// Seconds a leader's Lease stays valid after its last renewal.
pub const LEASE_DURATION_SECS: u64 = 15;
/// Seconds before expiry at which the leader renews.
pub const LEASE_GRACE_SECS: u64 = 5;

/// Whether this replica may write. Cheap to clone; every clone sees changes.
#[derive(Clone, Debug)]
pub struct Leadership {
    rx: watch::Receiver<bool>,
    // Held by `always`, so its receiver never sees the channel close.
    _fixed: Option<std::sync::Arc<watch::Sender<bool>>>,
}

impl Leadership {
    /// A replica that always leads (leader election off, or tests).
    pub fn always() -> Self {
        let (tx, rx) = watch::channel(true);
        Self {
            rx,
            _fixed: Some(std::sync::Arc::new(tx)),
        }
    }

    /// Leadership driven by a channel the caller controls.
    pub fn channel(initial: bool) -> (watch::Sender<bool>, Self) {
        let (tx, rx) = watch::channel(initial);
        (tx, Self { rx, _fixed: None })
    }

    /// Whether this replica is the leader now.
    pub fn is_leader(&self) -> bool {
        *self.rx.borrow()
    }

    /// Waits for the next change; returns the new state, or `None` when leadership ended.
    pub async fn changed(&mut self) -> Option<bool> {
        self.rx.changed().await.ok()?;
        Some(*self.rx.borrow_and_update())
    }
}

/// Leader election that failed to start.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// The Lease could not be read or created.
    #[error("failed to set up leader Lease {namespace}/{OPERATOR_LEADER_LEASE}")]
    Setup {
        /// Namespace of the Lease.
        namespace: String,
        /// The lease manager's error.
        #[source]
        source: LeaseManagerError,
    },
}

/// Starts campaigning for [`OPERATOR_LEADER_LEASE`] in `namespace` as `identity`. The task
/// releases the Lease (so a standby takes over at once) when `shutdown` flips to true.
pub async fn elect(
    client: Client,
    namespace: &str,
    identity: &str,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(Leadership, JoinHandle<()>), LeaderError> {
    let manager = LeaseManagerBuilder::new(client, OPERATOR_LEADER_LEASE)
        .with_namespace(namespace)
        .with_identity(identity)
        .with_duration(LEASE_DURATION_SECS)
        .with_grace(LEASE_GRACE_SECS)
        .build()
        .await
        .map_err(|source| LeaderError::Setup {
            namespace: namespace.to_owned(),
            source,
        })?;
    let (mut lm_rx, lm_task) = manager.watch().await;
    let (tx, leadership) = Leadership::channel(*lm_rx.borrow());
    let identity = identity.to_owned();
    let task = tokio::spawn(async move {
        loop {
            tokio::select! {
                changed = lm_rx.changed() => {
                    if changed.is_err() {
                        warn!("leader election task ended; giving up leadership");
                        let _ = tx.send(false);
                        break;
                    }
                    let leader = *lm_rx.borrow_and_update();
                    info!(%identity, leader, "leadership changed");
                    let _ = tx.send(leader);
                }
                _ = shutdown.wait_for(|s| *s) => break,
            }
        }
        // Stop writing before the Lease is released, then release it.
        let _ = tx.send(false);
        drop(lm_rx);
        match tokio::time::timeout(Duration::from_secs(5), lm_task).await {
            Ok(Ok(Ok(_))) => info!("leader Lease released"),
            Ok(Ok(Err(e))) => warn!(error = %e, "failed to release leader Lease"),
            Ok(Err(e)) => warn!(error = %e, "leader election task failed"),
            Err(_) => warn!("timed out releasing leader Lease"),
        }
    });
    Ok((leadership, task))
}
