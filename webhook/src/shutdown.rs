//! Shutdown, signalled once: the server, the caches and the certificate reloader all stop
//! on it.

use tokio::sync::watch;

/// Fires once; every clone of the paired [`Shutdown`] sees it.
#[derive(Debug)]
pub struct ShutdownTrigger(watch::Sender<bool>);

impl ShutdownTrigger {
    /// Starts shutdown.
    pub fn trigger(&self) {
        self.0.send_replace(true);
    }
}

/// Resolves when shutdown has started (or the trigger was dropped).
#[derive(Clone, Debug)]
pub struct Shutdown(watch::Receiver<bool>);

impl Shutdown {
    /// Waits for shutdown.
    pub async fn wait(&self) {
        let mut rx = self.0.clone();
        // An Err means the trigger is gone: nothing can start shutdown any more, so stop.
        let _ = rx.wait_for(|started| *started).await;
    }

    /// Whether shutdown has started.
    pub fn is_started(&self) -> bool {
        *self.0.borrow()
    }
}

/// A new shutdown trigger and its receiver.
pub fn shutdown_channel() -> (ShutdownTrigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (ShutdownTrigger(tx), Shutdown(rx))
}
