//! Writes the agent's status fields with server-side apply: only when they changed, never
//! more than once per `min_interval`, and checked against the server on a slow resync.
//!
//! Time is passed in, so the benchmark and tests run minutes of simulated time in
//! microseconds.

use std::time::Duration;

use async_trait::async_trait;
use gpuwarden_crds::{FIELD_MANAGER_NODE_AGENT, GpuNode, GpuNodeStatus};
use jiff::Timestamp;
use kube::Api;
use kube::api::{Patch, PatchParams};

use crate::backoff::Backoff;
use crate::status::agent_fields;

/// The shortest gap between two status writes.
pub const MIN_WRITE_INTERVAL: Duration = Duration::from_secs(10);

/// A source of the current time.
pub trait Clock: Send + Sync {
    /// Now.
    fn now(&self) -> Timestamp;
}

/// The system clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// Errors writing status.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The GpuNode does not exist (yet): the operator creates it.
    #[error("GpuNode {node} does not exist yet")]
    NotFound {
        /// The node.
        node: String,
    },
    /// The API call failed.
    #[error("failed to {verb} GpuNode {node} status")]
    Api {
        /// `apply` or `read`.
        verb: &'static str,
        /// The node.
        node: String,
        /// Why.
        #[source]
        source: Box<kube::Error>,
    },
}

/// Where status goes: the API server, or a counter in benchmarks.
#[async_trait]
pub trait StatusSink: Send + Sync {
    /// Applies the agent's fields.
    async fn apply(&self, status: &GpuNodeStatus) -> Result<(), WriteError>;
    /// The status as the server has it now.
    async fn current(&self) -> Result<GpuNodeStatus, WriteError>;
}

/// The object the agent applies to `gpunodes/<node>/status`: only the agent's fields, in
/// the order a reader expects.
#[derive(Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ApplyObject {
    /// `gpuwarden.io/v1alpha1`.
    pub api_version: String,
    /// `GpuNode`.
    pub kind: String,
    /// Only the name.
    pub metadata: ApplyMetadata,
    /// The agent's fields.
    pub status: GpuNodeStatus,
}

/// Metadata of an [`ApplyObject`].
#[derive(Clone, Debug, serde::Serialize)]
pub struct ApplyMetadata {
    /// The node (and GpuNode) name.
    pub name: String,
}

/// The object applied for `node`: `status` without the operator's fields, lists always
/// present (empty or not) so entries the agent no longer reports go away.
pub fn apply_object(node: &str, status: &GpuNodeStatus) -> ApplyObject {
    let mut fields = status.clone();
    fields.conditions = None;
    fields.summary = None;
    fields.gpus.get_or_insert_with(Vec::new);
    fields.bindings.get_or_insert_with(Vec::new);
    fields.privileged_pods.get_or_insert_with(Vec::new);
    ApplyObject {
        api_version: format!("{}/{}", gpuwarden_crds::GROUP, gpuwarden_crds::VERSION),
        kind: "GpuNode".to_owned(),
        metadata: ApplyMetadata {
            name: node.to_owned(),
        },
        status: fields,
    }
}

/// The body of the server-side apply on `gpunodes/<node>/status`, as JSON.
pub fn apply_body(node: &str, status: &GpuNodeStatus) -> serde_json::Value {
    // Serialising plain data with string keys cannot fail.
    serde_json::to_value(apply_object(node, status)).unwrap_or_default()
}

/// A [`StatusSink`] on the API server.
pub struct KubeSink {
    api: Api<GpuNode>,
    node: String,
}

impl KubeSink {
    /// A sink for the GpuNode named `node`.
    pub fn new(client: kube::Client, node: &str) -> Self {
        Self {
            api: Api::all(client),
            node: node.to_owned(),
        }
    }

    fn error(&self, verb: &'static str, e: kube::Error) -> WriteError {
        match &e {
            kube::Error::Api(s) if s.code == 404 => WriteError::NotFound {
                node: self.node.clone(),
            },
            _ => WriteError::Api {
                verb,
                node: self.node.clone(),
                source: Box::new(e),
            },
        }
    }
}

#[async_trait]
impl StatusSink for KubeSink {
    async fn apply(&self, status: &GpuNodeStatus) -> Result<(), WriteError> {
        // force: these fields are the agent's alone; a stray kubectl edit must not block it.
        let params = PatchParams::apply(FIELD_MANAGER_NODE_AGENT).force();
        self.api
            .patch_status(
                &self.node,
                &params,
                &Patch::Apply(apply_body(&self.node, status)),
            )
            .await
            .map(|_| ())
            .map_err(|e| self.error("apply", e))
    }

    async fn current(&self) -> Result<GpuNodeStatus, WriteError> {
        let node = self
            .api
            .get_status(&self.node)
            .await
            .map_err(|e| self.error("read", e))?;
        Ok(node.status.unwrap_or_default())
    }
}

/// What one [`StatusWriter::tick`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The status was applied.
    Written,
    /// Nothing changed since the last write.
    Unchanged,
    /// Something changed; it is written once the minimum interval has passed.
    Debounced,
    /// The GpuNode does not exist; the writer tries again later.
    WaitingForGpuNode,
}

/// Decides when to write and writes.
pub struct StatusWriter<S> {
    sink: S,
    min_interval: Duration,
    resync_interval: Duration,
    last_applied: Option<GpuNodeStatus>,
    last_write: Option<Timestamp>,
    last_resync: Option<Timestamp>,
    not_before: Option<Timestamp>,
    missing: Backoff,
    writes: u64,
}

impl<S: StatusSink> StatusWriter<S> {
    /// A writer that applies at most once per `min_interval` and checks the server's copy
    /// every `resync_interval`.
    pub fn new(sink: S, min_interval: Duration, resync_interval: Duration) -> Self {
        Self {
            sink,
            min_interval,
            resync_interval,
            last_applied: None,
            last_write: None,
            last_resync: None,
            not_before: None,
            missing: Backoff::new(Duration::from_secs(2), Duration::from_secs(60)),
            writes: 0,
        }
    }

    /// Status writes so far.
    pub fn writes(&self) -> u64 {
        self.writes
    }

    /// The sink.
    pub fn sink(&self) -> &S {
        &self.sink
    }

    /// Takes `status`, read from the server at `now`, as the last one applied: after a
    /// restart the agent then writes only if what it computes differs.
    pub fn assume_applied(&mut self, status: &GpuNodeStatus, now: Timestamp) {
        self.last_applied = Some(agent_fields(status));
        self.last_resync = Some(now);
    }

    /// Takes the status computed at `now` and writes it if it must.
    pub async fn tick(
        &mut self,
        now: Timestamp,
        status: &GpuNodeStatus,
    ) -> Result<Outcome, WriteError> {
        let wanted = agent_fields(status);
        if let Some(t) = self.not_before
            && now < t
        {
            return Ok(Outcome::WaitingForGpuNode);
        }
        let resync_due = self
            .last_resync
            .is_none_or(|t| since(t, now) >= self.resync_interval);
        if resync_due && self.last_applied.is_some() {
            // A read, not a write: the object may have been recreated or edited. Only a
            // difference leads to a write.
            self.last_resync = Some(now);
            match self.sink.current().await {
                Ok(current) => {
                    if agent_fields(&current) != self.last_applied.clone().unwrap_or_default() {
                        tracing::info!("GpuNode status differs from what was applied; rewriting");
                        self.last_applied = None;
                    }
                }
                Err(WriteError::NotFound { .. }) => return Ok(self.gpunode_missing(now)),
                Err(e) => return Err(e),
            }
        }
        if self.last_applied.as_ref() == Some(&wanted) {
            return Ok(Outcome::Unchanged);
        }
        if let Some(t) = self.last_write
            && since(t, now) < self.min_interval
        {
            return Ok(Outcome::Debounced);
        }
        match self.sink.apply(status).await {
            Ok(()) => {
                self.writes += 1;
                self.last_applied = Some(wanted);
                self.last_write = Some(now);
                self.last_resync.get_or_insert(now);
                self.not_before = None;
                self.missing.reset();
                Ok(Outcome::Written)
            }
            Err(WriteError::NotFound { .. }) => Ok(self.gpunode_missing(now)),
            Err(e) => {
                // Counted as an attempt for the interval: a failing API is not hammered.
                self.last_write = Some(now);
                Err(e)
            }
        }
    }

    fn gpunode_missing(&mut self, now: Timestamp) -> Outcome {
        let wait = self.missing.next_delay();
        tracing::info!(retry_in = ?wait, "GpuNode does not exist yet; the operator creates it");
        self.last_applied = None;
        self.not_before = now
            .checked_add(jiff::SignedDuration::try_from(wait).unwrap_or_default())
            .ok();
        Outcome::WaitingForGpuNode
    }
}

fn since(from: Timestamp, to: Timestamp) -> Duration {
    Duration::try_from(to.duration_since(from)).unwrap_or(Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuwarden_crds::{DriverInfo, GpuNodeSummary};
    use std::sync::Mutex;

    #[derive(Default)]
    struct Recorder {
        applied: Mutex<Vec<GpuNodeStatus>>,
        server: Mutex<Option<GpuNodeStatus>>,
        missing: Mutex<bool>,
    }

    #[async_trait]
    impl StatusSink for &Recorder {
        async fn apply(&self, status: &GpuNodeStatus) -> Result<(), WriteError> {
            if *self.missing.lock().unwrap() {
                return Err(WriteError::NotFound { node: "n".into() });
            }
            self.applied.lock().unwrap().push(status.clone());
            *self.server.lock().unwrap() = Some(status.clone());
            Ok(())
        }
        async fn current(&self) -> Result<GpuNodeStatus, WriteError> {
            Ok(self.server.lock().unwrap().clone().unwrap_or_default())
        }
    }

    fn status(driver: &str) -> GpuNodeStatus {
        GpuNodeStatus {
            driver: Some(DriverInfo {
                driver_version: driver.into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }
    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).unwrap()
    }

    #[tokio::test]
    async fn debounces_and_skips_unchanged() {
        let rec = Recorder::default();
        let mut w = StatusWriter::new(&rec, MIN_WRITE_INTERVAL, Duration::from_secs(600));
        assert_eq!(w.tick(t(0), &status("a")).await.unwrap(), Outcome::Written);
        assert_eq!(
            w.tick(t(1), &status("a")).await.unwrap(),
            Outcome::Unchanged
        );
        assert_eq!(
            w.tick(t(2), &status("b")).await.unwrap(),
            Outcome::Debounced
        );
        assert_eq!(
            w.tick(t(5), &status("c")).await.unwrap(),
            Outcome::Debounced
        );
        assert_eq!(w.tick(t(10), &status("c")).await.unwrap(), Outcome::Written);
        assert_eq!(rec.applied.lock().unwrap().len(), 2);
        assert_eq!(w.writes(), 2);
        // Ten quiet minutes with resyncs that find the server in agreement: no write.
        for s in (20..=620).step_by(10) {
            assert_eq!(
                w.tick(t(s), &status("c")).await.unwrap(),
                Outcome::Unchanged
            );
        }
        assert_eq!(w.writes(), 2);
    }

    #[tokio::test]
    async fn resync_repairs_a_changed_server_copy_and_ignores_operator_fields() {
        let rec = Recorder::default();
        let mut w = StatusWriter::new(&rec, MIN_WRITE_INTERVAL, Duration::from_secs(600));
        w.tick(t(0), &status("a")).await.unwrap();
        // The operator's fields on the server are not a difference.
        rec.server.lock().unwrap().as_mut().unwrap().summary = Some(GpuNodeSummary::default());
        assert_eq!(
            w.tick(t(600), &status("a")).await.unwrap(),
            Outcome::Unchanged
        );
        // Someone wiped the agent's fields: the next resync rewrites them.
        *rec.server.lock().unwrap() = Some(GpuNodeStatus::default());
        assert_eq!(
            w.tick(t(1200), &status("a")).await.unwrap(),
            Outcome::Written
        );
    }

    #[tokio::test]
    async fn waits_with_backoff_while_gpunode_is_missing() {
        let rec = Recorder::default();
        *rec.missing.lock().unwrap() = true;
        let mut w = StatusWriter::new(&rec, MIN_WRITE_INTERVAL, Duration::from_secs(600));
        assert_eq!(
            w.tick(t(0), &status("a")).await.unwrap(),
            Outcome::WaitingForGpuNode
        );
        // Within the 2 s backoff no call is made.
        assert_eq!(
            w.tick(t(1), &status("a")).await.unwrap(),
            Outcome::WaitingForGpuNode
        );
        *rec.missing.lock().unwrap() = false;
        assert_eq!(w.tick(t(2), &status("a")).await.unwrap(), Outcome::Written);
    }

    #[tokio::test]
    async fn a_restart_with_nothing_changed_writes_nothing() {
        let rec = Recorder::default();
        let mut w = StatusWriter::new(&rec, MIN_WRITE_INTERVAL, Duration::from_secs(600));
        w.assume_applied(&status("a"), t(0));
        assert_eq!(
            w.tick(t(0), &status("a")).await.unwrap(),
            Outcome::Unchanged
        );
        assert_eq!(w.tick(t(10), &status("b")).await.unwrap(), Outcome::Written);
    }

    #[test]
    fn apply_body_holds_only_agent_fields() {
        let mut s = status("a");
        s.summary = Some(GpuNodeSummary::default());
        s.conditions = Some(vec![]);
        let body = apply_body("node-1", &s);
        let mut keys: Vec<&String> = body["status"].as_object().unwrap().keys().collect();
        keys.sort();
        assert_eq!(keys, ["bindings", "driver", "gpus", "privilegedPods"]);
        assert_eq!(body["metadata"]["name"], "node-1");
        assert_eq!(body["apiVersion"], "gpuwarden.io/v1alpha1");
    }
}
