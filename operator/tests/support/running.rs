//! The whole operator run in a test against the in-process fake API server, and the waits
//! the tests make on it. Include it beside `fake_api.rs`:
//! `#[path = "support/running.rs"] mod running;`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::fake_api::FakeApi;

/// Waits until `cond` holds, failing the test after `timeout`.
pub async fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A local address no one listens on yet.
pub fn free_port() -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// The operator running against the fake API server until [`Running::stop`].
pub struct Running {
    stop_tx: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), gpuwarden_operator::RunError>>,
}

impl Running {
    /// Starts it; `leadership`, when given, is decided by the test instead of the Lease
    /// election.
    pub fn start(
        fake: &Arc<FakeApi>,
        config: gpuwarden_operator::Config,
        leadership: Option<gpuwarden_operator::Leadership>,
    ) -> Self {
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(gpuwarden_operator::run_with(
            config,
            fake.client(),
            async move {
                let _ = stop_rx.await;
            },
            gpuwarden_operator::system_clock(),
            leadership,
        ));
        Self { stop_tx, task }
    }

    /// Whether it has stopped on its own.
    #[allow(dead_code)] // Not every test that includes this file asks.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Shuts it down gracefully: it stops within 20 s, without error.
    pub async fn stop(self) {
        self.stop_tx.send(()).unwrap();
        let result = tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("operator stops within 20 s")
            .expect("operator task");
        assert!(result.is_ok(), "{result:?}");
    }
}
