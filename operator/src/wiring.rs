//! What every controller of the operator is built from (docs/design.md, "Operator"): one
//! shutdown signal, a [`Feed`] per watched kind (its cache and the controllers it wakes when
//! an object's inputs change), triggers, per-object backoff, the metrics of a reconcile, and
//! [`keep`], the loop of a keeper that reconciles a whole set at once.
//!
//! Each controller's module wires itself from these into a [`Part`]; [`crate::run`] lists
//! the parts and runs them under one shutdown and one leadership.

use std::collections::HashMap;
use std::fmt::Debug;
use std::future::Future;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::{FutureExt, Stream, StreamExt, stream};
use gpuwarden_crds::error_chain;
use kube::runtime::controller::{self, Action};
use kube::runtime::reflector::{self, ObjectRef, Store, store::Writer};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, watch};
use tracing::{debug, warn};

use crate::Clock;
use crate::leader::Leadership;
use crate::metrics::Metrics;

/// The operator's shutdown, as every task sees it.
#[derive(Clone)]
pub struct Shutdown(watch::Receiver<bool>);

impl Shutdown {
    /// A shutdown that follows `signal`: when it resolves, every [`Shutdown::stopped`] does.
    pub fn on(signal: impl Future<Output = ()> + Send + 'static) -> Self {
        let (tx, rx) = watch::channel(false);
        tokio::spawn(async move {
            signal.await;
            tracing::info!("shutting down");
            let _ = tx.send(true);
            // Keep the sender so receivers see `true`, not a closed channel, until they exit.
            tx.closed().await;
        });
        Self(rx)
    }

    /// Resolves once shutdown is asked for (or its sender is gone).
    pub fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.0.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }

    /// The receiving end, for code that takes one.
    pub fn receiver(&self) -> watch::Receiver<bool> {
        self.0.clone()
    }
}

/// What every part of the operator shares: the client, the clock, leadership, metrics,
/// shutdown and the controllers' settings.
#[derive(Clone)]
pub struct Shared {
    /// API client.
    pub client: Client,
    /// Current time; tests inject their own.
    pub clock: Clock,
    /// Whether this replica may write.
    pub leadership: Leadership,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Shutdown.
    pub shutdown: Shutdown,
    /// `kube-runtime` settings of every `Controller` (bounded concurrency).
    pub controller_config: kube::runtime::Config,
}

/// One part of the operator, as its module wires it: the watches it started on kinds only it
/// reads, what its caches need before anything is decided, and its loop.
pub struct Part {
    /// The part's name in logs.
    pub name: &'static str,
    /// The watches it started; they run until shutdown.
    pub watches: Vec<tokio::task::JoinHandle<()>>,
    /// Resolves when the part's own caches hold their first full list.
    pub synced: BoxFuture<'static, ()>,
    /// Its controllers and keepers; runs until shutdown.
    pub run: BoxFuture<'static, ()>,
}

impl Part {
    /// A part with no caches of its own.
    pub fn new(name: &'static str, run: impl Future<Output = ()> + Send + 'static) -> Self {
        Self {
            name,
            watches: Vec::new(),
            synced: async {}.boxed(),
            run: run.boxed(),
        }
    }
}

type Listener<K> = Box<dyn FnMut(&K) + Send>;

/// One watched kind: its cache, a hash of what its readers read of an object (`inputs`),
/// and who is told when that hash changes or the object goes. Listeners are added while the
/// operator is wired; [`Feed::start`] then watches until shutdown.
pub struct Feed<K: Resource<DynamicType = ()> + Clone + 'static> {
    store: Store<K>,
    writer: Writer<K>,
    inputs: Box<dyn Fn(&K) -> u64 + Send>,
    changed: Vec<Listener<K>>,
    deleted: Vec<Listener<K>>,
}

impl<K> Feed<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    /// A feed whose readers read `inputs` of each object.
    pub fn new(inputs: impl Fn(&K) -> u64 + Send + 'static) -> Self {
        let (store, writer) = reflector::store::<K>();
        Self {
            store,
            writer,
            inputs: Box::new(inputs),
            changed: Vec::new(),
            deleted: Vec::new(),
        }
    }

    /// The kind's cache.
    pub fn store(&self) -> Store<K> {
        self.store.clone()
    }

    /// Calls `f` with each object whose inputs changed.
    pub fn on_change(&mut self, f: impl FnMut(&K) + Send + 'static) {
        self.changed.push(Box::new(f));
    }

    /// Calls `f` with each deleted object.
    pub fn on_delete(&mut self, f: impl FnMut(&K) + Send + 'static) {
        self.deleted.push(Box::new(f));
    }

    /// Wakes `wake` on every change and deletion, for a keeper that reconciles everything.
    pub fn wake_on_any(&mut self, wake: &mpsc::UnboundedSender<()>) {
        let (a, b) = (wake.clone(), wake.clone());
        self.on_change(move |_| {
            let _ = a.send(());
        });
        self.on_delete(move |_| {
            let _ = b.send(());
        });
    }

    /// A trigger stream of the objects whose inputs changed, and, with `deletions`, of those
    /// deleted too.
    pub fn trigger(
        &mut self,
        deletions: bool,
    ) -> impl Stream<Item = Result<K, watcher::Error>> + Send + 'static {
        let (tx, stream) = trigger::<K>();
        if deletions {
            let tx = tx.clone();
            self.on_delete(move |o| {
                let _ = tx.send(o.clone());
            });
        }
        self.on_change(move |o| {
            let _ = tx.send(o.clone());
        });
        stream
    }

    /// A trigger stream of the deleted objects.
    pub fn deletions(&mut self) -> impl Stream<Item = Result<K, watcher::Error>> + Send + 'static {
        let (tx, stream) = trigger::<K>();
        self.on_delete(move |o| {
            let _ = tx.send(o.clone());
        });
        stream
    }

    /// Watches `api` with `config` until shutdown: each event goes into the cache (after
    /// `trim`), then, where its inputs changed, to the listeners. The watcher retries with
    /// backoff and the cache keeps serving what it has.
    pub fn start(
        self,
        api: Api<K>,
        config: watcher::Config,
        trim: fn(&mut K),
        shutdown: &Shutdown,
    ) -> tokio::task::JoinHandle<()> {
        let Self {
            writer,
            inputs,
            mut changed,
            mut deleted,
            ..
        } = self;
        let events = watcher(api, config)
            .default_backoff()
            .modify(trim)
            .reflect(writer)
            .take_until(shutdown.stopped());
        let mut filter = ChangeFilter::default();
        tokio::spawn(async move {
            futures::pin_mut!(events);
            while let Some(event) = events.next().await {
                match event {
                    Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                        if filter.changed(&key(&o), inputs(&o)) {
                            changed.iter_mut().for_each(|f| f(&o));
                        }
                    }
                    Ok(watcher::Event::Delete(o)) => {
                        filter.forget(&key(&o));
                        deleted.iter_mut().for_each(|f| f(&o));
                    }
                    Ok(watcher::Event::Init | watcher::Event::InitDone) => {}
                    Err(e) => warn!(error = %e, "watch failed; retrying"),
                }
            }
        })
    }
}

/// An object's key: namespace and name, or the name of a cluster-scoped one.
fn key<K: Resource>(o: &K) -> String {
    match o.meta().namespace.as_deref() {
        Some(namespace) => format!("{namespace}/{}", o.name_any()),
        None => o.name_any(),
    }
}

/// A hash of `value`, for the inputs of a [`Feed`].
pub fn hash_of(value: &impl Hash) -> u64 {
    let mut h = DefaultHasher::new();
    value.hash(&mut h);
    h.finish()
}

/// Remembers the last input hash per object and says whether a new one differs.
#[derive(Default)]
struct ChangeFilter(HashMap<String, u64>);

impl ChangeFilter {
    fn changed(&mut self, key: &str, hash: u64) -> bool {
        self.0.insert(key.to_owned(), hash) != Some(hash)
    }
    fn forget(&mut self, key: &str) {
        self.0.remove(key);
    }
}

/// A channel of objects for a controller's trigger: the sending half, and the receiving
/// half as the stream `Controller` reads.
pub fn trigger<K: Send + 'static>() -> (
    mpsc::UnboundedSender<K>,
    impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    let stream = stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|o| (Ok(o), rx)) },
    );
    (tx, stream)
}

/// The wake-ups of `rx` as a stream, for `Controller::reconcile_all_on`.
pub fn wakes(rx: mpsc::UnboundedReceiver<()>) -> impl Stream<Item = ()> + Send + 'static {
    stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|()| ((), rx)) },
    )
}

/// Fires each time this replica becomes the leader: a new leader reconciles everything, as
/// the old one may have died mid-way.
pub fn leader_gained(leadership: Leadership) -> impl Stream<Item = ()> + Send {
    stream::unfold(leadership, |mut leadership| async move {
        loop {
            if leadership.changed().await? {
                return Some(((), leadership));
            }
        }
    })
}

/// Drains a controller's results: reconcile errors are logged where they happen, objects
/// gone from the cache before their turn are not errors.
pub async fn drain<K: Resource, E: std::error::Error + 'static, Q: std::error::Error + 'static>(
    results: impl Stream<Item = Result<(ObjectRef<K>, Action), controller::Error<E, Q>>>,
) {
    results
        .for_each(|result| async move {
            if let Err(e) = result {
                debug!(error = %error_chain(&e), "controller");
            }
        })
        .await;
}

/// Per-object retry delays: doubling from 1 s to 5 min on transient errors, reset on success.
#[derive(Default)]
pub struct Backoffs(Mutex<HashMap<String, u32>>);

impl Backoffs {
    /// The next delay for `key`.
    pub fn next(&self, key: &str) -> Duration {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(key.to_owned()).or_insert(0);
        *n = n.saturating_add(1);
        Duration::from_secs(1u64 << (*n - 1).min(9)).min(Duration::from_secs(300))
    }

    /// Forgets `key`'s failures.
    pub fn reset(&self, key: &str) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(key);
    }
}

/// A controller's name, its error's kind for metrics, and its backoffs: what
/// [`Reconciles::timed`] and [`Reconciles::error_action`] need around each reconcile.
pub struct Reconciles<E> {
    controller: &'static str,
    kind: fn(&E) -> &'static str,
    permanent: fn(&E) -> bool,
    backoffs: Arc<Backoffs>,
}

// By hand: a derive would ask `E: Clone`.
impl<E> Clone for Reconciles<E> {
    fn clone(&self) -> Self {
        Self {
            backoffs: self.backoffs.clone(),
            ..*self
        }
    }
}

impl<E: std::error::Error> Reconciles<E> {
    /// The reconciles of `controller`; `permanent` says which errors no retry can fix.
    pub fn new(
        controller: &'static str,
        kind: fn(&E) -> &'static str,
        permanent: fn(&E) -> bool,
    ) -> Self {
        Self {
            controller,
            kind,
            permanent,
            backoffs: Arc::default(),
        }
    }

    /// Runs one reconcile of `key`, records its duration and outcome, and resets the object's
    /// backoff on success.
    pub async fn timed(
        &self,
        metrics: &Metrics,
        key: &str,
        fut: impl Future<Output = Result<Action, E>>,
    ) -> Result<Action, E> {
        let start = Instant::now();
        let result = fut.await;
        let error = result.as_ref().err().map(self.kind);
        metrics.reconciled(self.controller, start.elapsed(), error);
        if result.is_ok() {
            self.backoffs.reset(key);
        }
        result
    }

    /// What follows a failed reconcile of `key`.
    pub fn error_action(&self, key: &str, err: &E) -> Action {
        error_action(&self.backoffs, key, (self.permanent)(err), err)
    }
}

/// What follows a failed reconcile: a wait for a change where retrying cannot help, else a
/// retry after the object's next backoff.
pub fn error_action(
    backoffs: &Backoffs,
    key: &str,
    permanent: bool,
    err: &dyn std::error::Error,
) -> Action {
    let chain = error_chain(err);
    if permanent {
        // Retrying cannot help; the next change to the object (or its inputs) will.
        warn!(object = key, error = %chain, "reconcile failed; waiting for a change");
        return Action::await_change();
    }
    let delay = backoffs.next(key);
    warn!(object = key, error = %chain, retry_in = ?delay, "reconcile failed; retrying");
    Action::requeue(delay)
}

/// A keeper that reconciles one whole set of objects at once: its name, its error's kind for
/// metrics, and what wakes it.
pub struct Keeper<E> {
    /// Controller name in metrics and logs.
    pub controller: &'static str,
    /// The error's kind for metrics.
    pub kind: fn(&E) -> &'static str,
    /// Wakes it; a burst of wake-ups is one pass.
    pub wake: mpsc::UnboundedReceiver<()>,
}

/// Runs `keeper`'s `pass`: once `ready` resolves, then whenever it is woken, on becoming
/// the leader, after a failure (with backoff), and every ten minutes, until shutdown.
pub async fn keep<E, F, Fut>(
    shared: &Shared,
    mut keeper: Keeper<E>,
    ready: impl Future<Output = ()>,
    mut pass: F,
) where
    E: std::error::Error + 'static,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), E>>,
{
    tokio::select! {
        () = ready => {}
        () = shared.shutdown.stopped() => return,
    }
    let controller = keeper.controller;
    let backoffs = Backoffs::default();
    let mut leadership = shared.leadership.clone();
    loop {
        let start = Instant::now();
        let wait = match pass().await {
            Ok(()) => {
                shared.metrics.reconciled(controller, start.elapsed(), None);
                backoffs.reset(controller);
                Duration::from_secs(600)
            }
            Err(e) => {
                let kind = (keeper.kind)(&e);
                shared
                    .metrics
                    .reconciled(controller, start.elapsed(), Some(kind));
                let delay = backoffs.next(controller);
                warn!(controller, error = %error_chain(&e), retry_in = ?delay, "sync failed");
                delay
            }
        };
        if !wait_for_turn(shared, &mut leadership, &mut keeper.wake, wait).await {
            return;
        }
    }
}

/// Waits `wait`, or until woken (a burst of wake-ups is one) or `leadership` changes (the
/// loop's own clone, which remembers what it has seen); false once the operator stops or the
/// wake-ups can no longer come.
pub async fn wait_for_turn(
    shared: &Shared,
    leadership: &mut Leadership,
    wake: &mut mpsc::UnboundedReceiver<()>,
    wait: Duration,
) -> bool {
    tokio::select! {
        () = tokio::time::sleep(wait) => true,
        woken = wake.recv() => {
            if woken.is_none() {
                return false;
            }
            // A burst of changes (a re-applied object may come as a create and a few
            // updates) is one pass.
            tokio::time::sleep(Duration::from_millis(200)).await;
            while wake.try_recv().is_ok() {}
            true
        }
        changed = leadership.changed() => changed.is_some(),
        () = shared.shutdown.stopped() => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("boom")]
    struct Boom;

    #[test]
    fn backoff_doubles_per_object_caps_and_resets_on_success() {
        let b = Backoffs::default();
        let delays: Vec<u64> = (0..11).map(|_| b.next("a").as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        // Another object has its own backoff.
        assert_eq!(b.next("b"), Duration::from_secs(1));
        b.reset("a");
        assert_eq!(b.next("a"), Duration::from_secs(1));
    }

    #[test]
    fn invalid_objects_wait_for_a_change_transient_errors_requeue() {
        let b = Backoffs::default();
        assert_eq!(error_action(&b, "x", true, &Boom), Action::await_change());
        assert_eq!(
            error_action(&b, "x", false, &Boom),
            Action::requeue(Duration::from_secs(1))
        );
        assert_eq!(
            error_action(&b, "x", false, &Boom),
            Action::requeue(Duration::from_secs(2))
        );
    }
}
