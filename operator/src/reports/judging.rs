//! The report controller's Pod watch: each pod is judged as it comes ([`super::judge`]) and
//! only its results are kept ([`super::Findings`]); the namespaces whose findings changed are woken.
//! A change of a GpuPolicy judges every pod again (a new listing); a change of a namespace's
//! labels, the pods of that namespace. Every listing forgets the pods it no longer holds.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use gpuwarden_crds::error_chain;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{ListParams, PartialObjectMeta};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::sync::{Notify, mpsc};
use tracing::{info, warn};

use super::{ReportContext, judge};
use crate::wiring::Shutdown;

/// How long asks to judge again gather before they are acted on: a policy applied with its
/// namespaces is one listing.
const GATHER: Duration = Duration::from_secs(1);

/// Pods per page of a namespace's listing.
const PAGE: u32 = 500;

/// What is to be judged again: every pod, or the pods of some namespaces.
#[derive(Debug, Default)]
pub struct Rejudge {
    pending: Mutex<Pending>,
    asked: Notify,
}

#[derive(Debug, Default)]
struct Pending {
    all: bool,
    namespaces: BTreeSet<String>,
}

impl Rejudge {
    /// Asks for every pod to be judged again.
    pub fn all(&self) {
        self.pending().all = true;
        self.asked.notify_one();
    }

    /// Asks for the pods of `namespace` to be judged again.
    pub fn namespace(&self, namespace: &str) {
        self.pending().namespaces.insert(namespace.to_owned());
        self.asked.notify_one();
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take(&self) -> Pending {
        std::mem::take(&mut *self.pending())
    }
}

/// The Pod watch and what it needs.
pub struct Judging {
    /// The API client.
    pub client: Client,
    /// Where the findings go, and the caches the judge reads.
    pub ctx: Arc<ReportContext>,
    /// What is to be judged again.
    pub rejudge: Arc<Rejudge>,
    /// The report controller's trigger: namespaces whose findings changed.
    pub wake: mpsc::UnboundedSender<PartialObjectMeta<Namespace>>,
}

impl Judging {
    /// Watches every Pod until shutdown.
    pub async fn run(self, shutdown: Shutdown) {
        // The first listing judges every pod under what is asked until now.
        self.rejudge.take();
        let mut round = 0;
        let mut events = self.watch();
        loop {
            tokio::select! {
                event = events.next() => match event {
                    Some(Ok(event)) => self.apply(event, &mut round),
                    Some(Err(e)) => warn!(error = %e, "Pod watch failed; retrying"),
                    None => return,
                },
                () = self.rejudge.asked.notified() => {
                    tokio::time::sleep(GATHER).await;
                    let pending = self.rejudge.take();
                    if pending.all {
                        info!("a GpuPolicy changed: judging every Pod again");
                        events = self.watch();
                    } else {
                        for namespace in pending.namespaces {
                            self.judge_namespace(&namespace, round).await;
                        }
                    }
                }
                () = shutdown.stopped() => return,
            }
        }
    }

    /// A new watch of every Pod: it starts with a full listing.
    fn watch(&self) -> BoxStream<'static, Result<watcher::Event<Pod>, watcher::Error>> {
        let api = Api::<Pod>::all(self.client.clone());
        watcher(api, watcher::Config::default())
            .default_backoff()
            .boxed()
    }

    fn apply(&self, event: watcher::Event<Pod>, round: &mut u64) {
        match event {
            watcher::Event::Init => *round += 1,
            watcher::Event::InitApply(pod) | watcher::Event::Apply(pod) => self.judge(&pod, *round),
            watcher::Event::Delete(pod) => {
                if let Some(namespace) = pod.namespace()
                    && self.ctx.findings.forget(&namespace, &pod.name_any())
                {
                    self.wake(&namespace);
                }
            }
            watcher::Event::InitDone => {
                for namespace in self.ctx.findings.forget_unseen(*round) {
                    self.wake(&namespace);
                }
                if !self.ctx.pods_judged() {
                    self.ctx.pods_judged.send_replace(true);
                    let pods = self.ctx.findings.pods();
                    info!(pods_with_findings = pods, "every Pod judged");
                }
            }
        }
    }

    /// Judges `pod`, seen in listing `round`, and wakes its namespace where its findings
    /// changed.
    fn judge(&self, pod: &Pod, round: u64) {
        let Some(namespace) = pod.namespace() else {
            return;
        };
        let labels = (self.ctx.namespaces)
            .get(&ObjectRef::new(&namespace))
            .and_then(|ns| ns.metadata.labels.clone());
        let results = judge(pod, labels.as_ref(), &self.ctx.policies.state());
        if (self.ctx.findings).record(&namespace, &pod.name_any(), results, round) {
            self.wake(&namespace);
        }
    }

    /// Judges the pods of `namespace` again, from a listing of its own; where that fails, it
    /// is asked again.
    async fn judge_namespace(&self, namespace: &str, round: u64) {
        let api = Api::<Pod>::namespaced(self.client.clone(), namespace);
        let mut listed = BTreeSet::new();
        let mut params = ListParams::default().limit(PAGE);
        loop {
            let page = match api.list(&params).await {
                Ok(page) => page,
                Err(e) => {
                    warn!(namespace, error = %error_chain(&e), "listing the namespace's Pods failed; trying again");
                    self.rejudge.namespace(namespace);
                    return;
                }
            };
            for pod in &page.items {
                listed.insert(pod.name_any());
                self.judge(pod, round);
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => break,
            }
        }
        self.ctx.findings.keep_only(namespace, &listed);
        self.wake(namespace);
    }

    fn wake(&self, namespace: &str) {
        let mut ns = PartialObjectMeta::<Namespace>::default();
        ns.metadata.name = Some(namespace.to_owned());
        let _ = self.wake.send(ns);
    }
}
