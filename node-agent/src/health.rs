//! GPU health as a pure state machine over events and readings.
//!
//! A GPU turns unhealthy on a critical XID (one not in the governing policy's ignored list),
//! an uncorrectable ECC error, pending page retirement, pending or failed row remapping (the
//! Ampere-and-later successor of page retirement), or when NVML says it is lost. It turns
//! healthy again once `recoverAfter` has passed without a new such event while the GPU still
//! answers and NVML no longer reports a standing fault (pending retirement or remapping, a
//! failed remapping).

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use gpuwarden_crds::{GpuHealth, GpuStatus, HealthState};
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::backend::{GpuEvent, GpuEventKind, GpuReading};

/// Reasons kept per GPU; the status stays small even on a GPU that floods XIDs.
const MAX_REASONS: usize = 4;

/// The health rules in force on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthRules {
    /// XIDs that are application errors and leave the GPU healthy.
    pub ignored_xids: BTreeSet<u64>,
    /// Quiet time after which an unhealthy GPU that answers is healthy again.
    pub recover_after: Duration,
    /// Name of the policy the rules came from (`""` for the built-in default).
    pub policy: String,
}

impl Default for HealthRules {
    fn default() -> Self {
        Self {
            ignored_xids: gpuwarden_crds::policy::default_ignored_xids()
                .into_iter()
                .collect(),
            recover_after: Duration::from_secs(600),
            policy: String::new(),
        }
    }
}

#[derive(Clone, Debug)]
struct GpuState {
    state: HealthState,
    since: Timestamp,
    reasons: Vec<String>,
    last_event: Option<Timestamp>,
    xid_count: u64,
    last_ecc: Option<u64>,
}

impl GpuState {
    fn new(now: Timestamp) -> Self {
        Self {
            state: HealthState::Healthy,
            since: whole_seconds(now),
            reasons: Vec::new(),
            last_event: None,
            xid_count: 0,
            last_ecc: None,
        }
    }

    fn fault(&mut self, at: Timestamp, reason: String) {
        if self.state == HealthState::Healthy {
            self.state = HealthState::Unhealthy;
            self.since = whole_seconds(at);
            self.reasons.clear();
        }
        self.last_event = Some(self.last_event.map_or(at, |t| t.max(at)));
        if !self.reasons.contains(&reason) {
            if self.reasons.len() == MAX_REASONS {
                self.reasons.remove(0);
            }
            self.reasons.push(reason);
        }
    }
}

/// Health of every GPU the agent has seen, keyed by GPU UUID.
#[derive(Clone, Debug, Default)]
pub struct HealthTracker {
    gpus: HashMap<String, GpuState>,
}

impl HealthTracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes one event into account.
    pub fn observe_event(&mut self, event: &GpuEvent, rules: &HealthRules) {
        let gpu = self
            .gpus
            .entry(event.uuid.clone())
            .or_insert_with(|| GpuState::new(event.at));
        match event.kind {
            GpuEventKind::Xid(code) => {
                gpu.xid_count += 1;
                if !rules.ignored_xids.contains(&code) {
                    gpu.fault(event.at, xid_reason(code));
                }
            }
            GpuEventKind::EccUncorrected => {
                gpu.fault(event.at, "uncorrectable ECC error".to_owned())
            }
            GpuEventKind::Lost => gpu.fault(event.at, LOST.to_owned()),
        }
    }

    /// Takes one read of a GPU into account at `now`, and lets it recover when it may.
    pub fn observe_reading(&mut self, reading: &GpuReading, now: Timestamp, rules: &HealthRules) {
        let gpu = self
            .gpus
            .entry(reading.info.uuid.clone())
            .or_insert_with(|| GpuState::new(now));
        if !reading.answering {
            gpu.fault(now, LOST.to_owned());
        }
        if reading.never_answered {
            gpu.fault(now, NEVER_ANSWERED.to_owned());
        }
        if let Some(count) = reading.ecc_uncorrected {
            // A count above the last one is a new error; a first non-zero count means an error
            // since the driver loaded, which the agent treats as new when it starts.
            if count > gpu.last_ecc.unwrap_or(0) {
                gpu.fault(now, "uncorrectable ECC error".to_owned());
            }
            gpu.last_ecc = Some(count);
        }
        let mut standing = false;
        for reason in standing_faults(reading) {
            gpu.fault(now, reason.to_owned());
            standing = true;
        }
        if gpu.state == HealthState::Unhealthy
            && reading.answering
            && !standing
            && gpu
                .last_event
                .is_none_or(|t| elapsed(t, now) >= rules.recover_after)
        {
            gpu.state = HealthState::Healthy;
            gpu.since = whole_seconds(now);
            gpu.reasons.clear();
        }
    }

    /// Carries health over from the status the agent wrote before it restarted, so a restart
    /// neither forgets a fault (the events behind it are not replayed) nor moves `since`.
    /// An unhealthy GPU counts its quiet time from `now`, the conservative choice.
    pub fn restore(&mut self, gpus: &[GpuStatus], now: Timestamp) {
        for g in gpus {
            let Some(since) = g.health.since.as_ref().map(|t| t.0) else {
                continue;
            };
            let state = self
                .gpus
                .entry(g.uuid.clone())
                .or_insert_with(|| GpuState::new(now));
            state.state = g.health.state;
            state.since = whole_seconds(since);
            state.reasons = g.health.reasons.iter().take(MAX_REASONS).cloned().collect();
            state.last_event = (g.health.state == HealthState::Unhealthy).then_some(now);
        }
    }

    /// Health of a GPU as it goes into the status.
    pub fn health(&self, uuid: &str) -> GpuHealth {
        match self.gpus.get(uuid) {
            Some(g) => GpuHealth {
                state: g.state,
                reasons: g.reasons.clone(),
                since: Some(Time(g.since)),
            },
            None => GpuHealth::default(),
        }
    }

    /// XID events seen on a GPU since the agent started (ignored ones included).
    pub fn xid_count(&self, uuid: &str) -> u64 {
        self.gpus.get(uuid).map_or(0, |g| g.xid_count)
    }
}

const LOST: &str = "GPU is lost (fell off the bus or needs a reset)";
/// The reason beside [`LOST`] for a GPU that has not answered once since the agent started:
/// it was never seen healthy, and its identity is what NVML and the driver still give.
const NEVER_ANSWERED: &str = "never seen healthy: lost before its first answer to NVML";

/// Faults that hold for as long as NVML reports them, each with its reason.
fn standing_faults(reading: &GpuReading) -> impl Iterator<Item = &'static str> {
    [
        (
            reading.pages_pending_retirement,
            "pages pending retirement (GPU reset needed)",
        ),
        (
            reading.row_remapping_pending,
            "row remapping pending (GPU reset needed)",
        ),
        (
            reading.row_remapping_failed,
            "row remapping failed (GPU needs service)",
        ),
    ]
    .into_iter()
    .filter(|(flag, _)| *flag == Some(true))
    .map(|(_, reason)| reason)
}

fn elapsed(from: Timestamp, to: Timestamp) -> Duration {
    Duration::try_from(to.duration_since(from)).unwrap_or(Duration::ZERO)
}

/// Kubernetes times have whole seconds; the status compares equal to what the server returns.
fn whole_seconds(t: Timestamp) -> Timestamp {
    Timestamp::from_second(t.as_second()).unwrap_or(t)
}

/// `Xid79: GPU has fallen off the bus`, for the XIDs operators meet most.
pub fn xid_reason(code: u64) -> String {
    let what = match code {
        // NVML reports a critical XID without its code as 0.
        0 => return "Xid (code unknown)".to_owned(),
        48 => Some("double-bit ECC error"),
        61 | 62 => Some("internal micro-controller error"),
        63 => Some("ECC page retirement or row remapping event"),
        64 => Some("ECC page retirement or row remapper recording failure"),
        74 => Some("NVLink error"),
        79 => Some("GPU has fallen off the bus"),
        92 => Some("high single-bit ECC error rate"),
        94 => Some("contained ECC error"),
        95 => Some("uncontained ECC error"),
        119 | 120 => Some("GSP error"),
        _ => None,
    };
    match what {
        Some(what) => format!("Xid{code}: {what}"),
        None => format!("Xid{code}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{GpuInfo, Telemetry};

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).unwrap()
    }
    fn reading(answering: bool) -> GpuReading {
        GpuReading {
            info: GpuInfo {
                uuid: "GPU-0".into(),
                ..Default::default()
            },
            answering,
            never_answered: false,
            telemetry: Telemetry::default(),
            ecc_uncorrected: Some(0),
            pages_pending_retirement: Some(false),
            row_remapping_pending: Some(false),
            row_remapping_failed: Some(false),
            processes: vec![],
        }
    }
    fn xid(code: u64, at: i64) -> GpuEvent {
        GpuEvent {
            uuid: "GPU-0".into(),
            at: t(at),
            kind: GpuEventKind::Xid(code),
        }
    }

    #[test]
    fn critical_xid_makes_unhealthy_until_recover_after() {
        let rules = HealthRules::default();
        let mut h = HealthTracker::new();
        h.observe_reading(&reading(true), t(0), &rules);
        assert_eq!(h.health("GPU-0").state, HealthState::Healthy);

        h.observe_event(&xid(79, 10), &rules);
        h.observe_reading(&reading(true), t(11), &rules);
        let health = h.health("GPU-0");
        assert_eq!(health.state, HealthState::Unhealthy);
        assert_eq!(health.reasons, vec!["Xid79: GPU has fallen off the bus"]);
        assert_eq!(health.since, Some(Time(t(10))));

        // Still within recoverAfter (10m): stays unhealthy.
        h.observe_reading(&reading(true), t(10 + 599), &rules);
        assert_eq!(h.health("GPU-0").state, HealthState::Unhealthy);
        // A new event restarts the clock.
        h.observe_event(&xid(48, 300), &rules);
        h.observe_reading(&reading(true), t(10 + 600), &rules);
        assert_eq!(h.health("GPU-0").state, HealthState::Unhealthy);
        assert_eq!(h.health("GPU-0").reasons.len(), 2);
        // recoverAfter after the last event, while answering: healthy, reasons gone.
        h.observe_reading(&reading(true), t(900), &rules);
        let health = h.health("GPU-0");
        assert_eq!(health.state, HealthState::Healthy);
        assert!(health.reasons.is_empty());
        assert_eq!(health.since, Some(Time(t(900))));
        assert_eq!(h.xid_count("GPU-0"), 2);
    }

    #[test]
    fn ignored_xids_stay_healthy_and_rules_come_from_policy() {
        let mut h = HealthTracker::new();
        let rules = HealthRules::default();
        for code in [13, 31, 43, 45, 68, 109] {
            h.observe_event(&xid(code, 1), &rules);
        }
        h.observe_reading(&reading(true), t(2), &rules);
        assert_eq!(h.health("GPU-0").state, HealthState::Healthy);
        assert_eq!(h.xid_count("GPU-0"), 6);

        // A policy that ignores nothing makes XID 13 critical.
        let strict = HealthRules {
            ignored_xids: BTreeSet::new(),
            recover_after: Duration::from_secs(60),
            policy: "strict".into(),
        };
        h.observe_event(&xid(13, 3), &strict);
        h.observe_reading(&reading(true), t(4), &strict);
        assert_eq!(h.health("GPU-0").state, HealthState::Unhealthy);
        h.observe_reading(&reading(true), t(63), &strict);
        assert_eq!(h.health("GPU-0").state, HealthState::Healthy);
    }

    #[test]
    fn ecc_and_page_retirement() {
        let rules = HealthRules::default();
        let mut h = HealthTracker::new();
        let mut r = reading(true);
        h.observe_reading(&r, t(0), &rules);
        r.ecc_uncorrected = Some(1);
        h.observe_reading(&r, t(5), &rules);
        assert_eq!(h.health("GPU-0").state, HealthState::Unhealthy);
        assert_eq!(h.health("GPU-0").reasons, vec!["uncorrectable ECC error"]);
        // The same count is no new error: it recovers.
        h.observe_reading(&r, t(605), &rules);
        assert_eq!(h.health("GPU-0").state, HealthState::Healthy);

        // Pending retirement holds it unhealthy however long it lasts.
        r.pages_pending_retirement = Some(true);
        h.observe_reading(&r, t(700), &rules);
        h.observe_reading(&r, t(5000), &rules);
        assert_eq!(h.health("GPU-0").state, HealthState::Unhealthy);
        r.pages_pending_retirement = Some(false);
        h.observe_reading(&r, t(5000 + 600), &rules);
        assert_eq!(h.health("GPU-0").state, HealthState::Healthy);

        // An ECC event from the event set counts too.
        h.observe_event(
            &GpuEvent {
                uuid: "GPU-0".into(),
                at: t(6000),
                kind: GpuEventKind::EccUncorrected,
            },
            &rules,
        );
        assert_eq!(h.health("GPU-0").state, HealthState::Unhealthy);
    }

    #[test]
    fn row_remapping_holds_unhealthy_while_reported() {
        let rules = HealthRules::default();
        let mut h = HealthTracker::new();
        // An H100 reports no page retirement at all, only row remapping.
        let mut r = reading(true);
        r.pages_pending_retirement = None;
        h.observe_reading(&r, t(0), &rules);
        assert_eq!(h.health("GPU-0").state, HealthState::Healthy);

        r.row_remapping_pending = Some(true);
        h.observe_reading(&r, t(10), &rules);
        h.observe_reading(&r, t(10_000), &rules);
        let health = h.health("GPU-0");
        assert_eq!(health.state, HealthState::Unhealthy);
        assert_eq!(
            health.reasons,
            vec!["row remapping pending (GPU reset needed)"]
        );
        assert_eq!(health.since, Some(Time(t(10))));

        // After the reset the remap is applied: healthy once recoverAfter passes quietly.
        r.row_remapping_pending = Some(false);
        h.observe_reading(&r, t(10_001), &rules);
        assert_eq!(h.health("GPU-0").state, HealthState::Unhealthy);
        h.observe_reading(&r, t(10_000 + 600), &rules);
        assert_eq!(h.health("GPU-0").state, HealthState::Healthy);

        // A failed remapping holds however long it lasts, and says so beside other faults.
        r.row_remapping_failed = Some(true);
        r.ecc_uncorrected = Some(3);
        h.observe_reading(&r, t(20_000), &rules);
        h.observe_reading(&r, t(90_000), &rules);
        let health = h.health("GPU-0");
        assert_eq!(health.state, HealthState::Unhealthy);
        assert_eq!(
            health.reasons,
            vec![
                "uncorrectable ECC error",
                "row remapping failed (GPU needs service)"
            ]
        );
        // Unknown (not supported) is not a fault.
        r.row_remapping_failed = None;
        h.observe_reading(&r, t(90_000 + 600), &rules);
        assert_eq!(h.health("GPU-0").state, HealthState::Healthy);
    }

    #[test]
    fn a_gpu_lost_before_its_first_answer_says_it_was_never_seen_healthy() {
        let rules = HealthRules::default();
        let mut h = HealthTracker::new();
        let mut never = reading(false);
        never.never_answered = true;
        h.observe_reading(&never, t(0), &rules);
        let health = h.health("GPU-0");
        assert_eq!(health.state, HealthState::Unhealthy);
        assert_eq!(health.reasons, [LOST, NEVER_ANSWERED]);
        // Lost after answering once: only lost.
        let mut h = HealthTracker::new();
        h.observe_reading(&reading(true), t(0), &rules);
        h.observe_reading(&reading(false), t(10), &rules);
        assert_eq!(h.health("GPU-0").reasons, [LOST]);
    }

    #[test]
    fn lost_gpu_does_not_recover_while_silent() {
        let rules = HealthRules::default();
        let mut h = HealthTracker::new();
        h.observe_reading(&reading(false), t(0), &rules);
        assert_eq!(h.health("GPU-0").state, HealthState::Unhealthy);
        assert!(h.health("GPU-0").reasons[0].contains("lost"));
        h.observe_reading(&reading(false), t(100_000), &rules);
        assert_eq!(h.health("GPU-0").state, HealthState::Unhealthy);
        // Back on the bus (after a reset): healthy once recoverAfter passes quietly.
        h.observe_reading(&reading(true), t(100_001), &rules);
        assert_eq!(h.health("GPU-0").state, HealthState::Unhealthy);
        h.observe_reading(&reading(true), t(100_000 + 600), &rules);
        assert_eq!(h.health("GPU-0").state, HealthState::Healthy);
    }

    #[test]
    fn restart_keeps_faults_and_since() {
        let rules = HealthRules::default();
        let mut before = HealthTracker::new();
        before.observe_reading(&reading(true), t(0), &rules);
        before.observe_event(&xid(79, 100), &rules);
        let saved = GpuStatus {
            uuid: "GPU-0".into(),
            health: before.health("GPU-0"),
            ..Default::default()
        };
        let healthy = GpuStatus {
            uuid: "GPU-1".into(),
            health: GpuHealth {
                state: HealthState::Healthy,
                reasons: vec![],
                since: Some(Time(t(5))),
            },
            ..Default::default()
        };

        let mut after = HealthTracker::new();
        after.restore(&[saved.clone(), healthy], t(200));
        let mut r1 = reading(true);
        r1.info.uuid = "GPU-1".into();
        after.observe_reading(&reading(true), t(210), &rules);
        after.observe_reading(&r1, t(210), &rules);
        assert_eq!(after.health("GPU-0"), saved.health);
        assert_eq!(after.health("GPU-1").since, Some(Time(t(5))));
        // recoverAfter counts from the restart.
        after.observe_reading(&reading(true), t(799), &rules);
        assert_eq!(after.health("GPU-0").state, HealthState::Unhealthy);
        after.observe_reading(&reading(true), t(800), &rules);
        assert_eq!(after.health("GPU-0").state, HealthState::Healthy);
    }

    #[test]
    fn reasons_are_bounded() {
        let rules = HealthRules::default();
        let mut h = HealthTracker::new();
        for (i, code) in [48, 61, 63, 64, 74, 79, 92].into_iter().enumerate() {
            h.observe_event(&xid(code, i as i64), &rules);
        }
        let reasons = h.health("GPU-0").reasons;
        assert_eq!(reasons.len(), MAX_REASONS);
        assert!(reasons.last().unwrap().starts_with("Xid92"));
    }
}
