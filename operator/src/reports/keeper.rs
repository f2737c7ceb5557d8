//! The PolicyReports part of the operator: the report controller runs on Namespaces and is
//! woken by the Pod watch for the namespaces whose findings changed; a keeper of the report
//! kinds starts that watch once a kind is served, and the GPU nodes' posture report runs
//! beside them.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Namespace;
use kube::ResourceExt;
use kube::api::PartialObjectMeta;
use kube::runtime::controller::Controller;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::judging::{Judging, Rejudge};
use super::{CONTROLLER, DEBOUNCE, RECHECK, ReportContext, ReportError, discover_kinds};
use super::{reconcile_namespace, sweep};
use crate::feeds::Feeds;
use crate::wiring::{Part, Reconciles, Shared, Shutdown, drain, trigger, wakes};
use gpuwarden_crds::error_chain;
use gpuwarden_webhook::report::ReportKind;

/// The report controller, the keeper of the report kinds and the nodes' posture report;
/// `enabled` is the operator's `--policy-reports`.
pub fn wire(shared: &Shared, feeds: &mut Feeds, enabled: bool) -> Part {
    let ctx = Arc::new(ReportContext::new(
        shared.client.clone(),
        feeds.namespaces.store(),
        feeds.policies.store(),
        shared.leadership.clone(),
        shared.metrics.clone(),
    ));
    // A policy's change judges every pod again; a namespace's labels, the pods in it.
    let rejudge = Arc::new(Rejudge::default());
    let (on_change, on_delete, on_labels) = (rejudge.clone(), rejudge.clone(), rejudge.clone());
    feeds.policies.on_change(move |_| on_change.all());
    feeds.policies.on_delete(move |_| on_delete.all());
    (feeds.namespaces).on_change(move |ns| on_labels.namespace(&ns.name_any()));
    let (changed, namespaces_changed) = trigger::<PartialObjectMeta<Namespace>>();
    let (all_tx, all) = mpsc::unbounded_channel();
    let judging = Judging {
        client: shared.client.clone(),
        ctx: ctx.clone(),
        rejudge,
        wake: changed,
    };
    let kinds = kinds_loop(
        ctx.clone(),
        enabled.then_some(judging),
        all_tx,
        shared.shutdown.clone(),
    );
    let nodes_report = enabled.then(|| {
        let gpunodes = feeds.gpunodes.store();
        crate::node_reports::run(ctx.clone(), gpunodes, shared.shutdown.receiver())
    });
    let reconciles = Reconciles::new(CONTROLLER, ReportError::kind, ReportError::is_permanent);
    let controller = Controller::for_stream(namespaces_changed, feeds.namespaces.store())
        .reconcile_all_on(wakes(all))
        .with_config(shared.controller_config.clone().debounce(DEBOUNCE))
        .graceful_shutdown_on(shared.shutdown.stopped())
        .run(
            {
                let reconciles = reconciles.clone();
                move |ns: Arc<PartialObjectMeta<Namespace>>, ctx: Arc<ReportContext>| {
                    let reconciles = reconciles.clone();
                    async move {
                        let name = ns.name_any();
                        let reconcile = reconcile_namespace(&name, &ctx);
                        reconciles.timed(&ctx.metrics, &name, reconcile).await
                    }
                }
            },
            move |ns: Arc<PartialObjectMeta<Namespace>>, err: &ReportError, _| {
                reconciles.error_action(&ns.name_any(), err)
            },
            ctx,
        );
    Part::new(CONTROLLER, async move {
        let nodes_report = async {
            if let Some(run) = nodes_report {
                run.await;
            }
        };
        tokio::join!(drain(controller), kinds, nodes_report);
    })
}

/// Asks which report kinds the API server serves, at start and every few minutes, and says so
/// once per change: where none is, the operator writes no reports and keeps running. Once one
/// is, it starts the Pod watch (`judging`; `None` when reports are switched off) and, when
/// every pod is judged and on every check and leadership gain, lists the reports left behind
/// ([`sweep`]) and wakes the report controller for every namespace (`all`).
async fn kinds_loop(
    ctx: Arc<ReportContext>,
    mut judging: Option<Judging>,
    all: mpsc::UnboundedSender<()>,
    shutdown: Shutdown,
) {
    if judging.is_none() {
        info!("PolicyReports are switched off (--policy-reports=false)");
        return;
    }
    let mut leadership = ctx.leader.clone();
    let mut known: Option<Vec<ReportKind>> = None;
    loop {
        let kinds = discover_kinds(&ctx.client).await;
        if known.as_ref() != Some(&kinds) {
            say_kinds(&kinds);
            if let Ok(mut k) = ctx.kinds.write() {
                k.clone_from(&kinds);
            }
            // A kind that appeared holds none of what was written in the others.
            ctx.forget_contents();
            known = Some(kinds.clone());
        }
        if !kinds.is_empty() {
            if let Some(judging) = judging.take() {
                tokio::spawn(judging.run(shutdown.clone()));
                info!("watching Pods for policy reports");
                let mut judged = ctx.pods_judged.subscribe();
                tokio::select! {
                    _ = judged.wait_for(|j| *j) => {}
                    () = shutdown.stopped() => return,
                }
            }
            if ctx.leader.is_leader() {
                if let Err(e) = sweep(&ctx).await {
                    warn!(error = %error_chain(&e), "listing gpuwarden's reports failed; retrying at the next check");
                }
                let _ = all.send(());
            }
        }
        tokio::select! {
            () = tokio::time::sleep(RECHECK) => {}
            changed = leadership.changed() => {
                match changed {
                    None => return,
                    // Another leader may have written since: every report is written again.
                    Some(true) => ctx.forget_contents(),
                    Some(false) => {}
                }
            }
            () = shutdown.stopped() => return,
        }
    }
}

/// Logs which report kinds are served now.
fn say_kinds(kinds: &[ReportKind]) {
    if kinds.is_empty() {
        warn!(
            "neither wgpolicyk8s.io/v1alpha2 PolicyReport nor openreports.io/v1alpha1 Report is served: no policy reports are written (checked again every {} s)",
            RECHECK.as_secs()
        );
    } else {
        let names: Vec<String> = kinds
            .iter()
            .map(|k| format!("{}/{}", k.api_version(), k.kind()))
            .collect();
        info!(kinds = %names.join(", "), "writing one policy report per governed namespace");
    }
}
