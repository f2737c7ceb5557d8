//! What a rewritten pod's containers keep and lose of what their start-up steps need
//! (docs/design.md, "What a rewritten container keeps"): the steps `crds::start_up` reads
//! from each container's `command` and `args` and the pod's MPI role, judged against the
//! container's `securityContext` as the plan leaves it, in the words the API server's
//! start-up policy uses for the stored pod.

use gpuwarden_crds::start_up;

use super::input::ContainerRef;
use super::plan::Plan;
use crate::pod::{ContainerKind, PodView};

/// What the pod's containers keep and lose, once rewritten as `plan` says, of what their
/// start-up steps need (docs/design.md, "What a rewritten container keeps"): per step, in
/// the order of [`start_up::NEEDS`] (the MPI role last), the [`start_up::phrase`] of each
/// container that shows it (init containers first) joined by `; `. Each container is read
/// from its `securityContext` as the rewrite leaves it, as the API server's warning reads the
/// stored pod.
pub(super) fn phrases(plan: &Plan<'_>, pod: &PodView<'_>, role: Option<&str>) -> Vec<String> {
    let mut steps: Vec<(start_up::Sign, String)> = Vec::new();
    for kind in [ContainerKind::Init, ContainerKind::Regular] {
        for (index, c) in pod.containers(kind).iter().enumerate() {
            // The MPI operator's worker runs sshd in its first container.
            let role = role.filter(|_| kind == ContainerKind::Regular && index == 0);
            let words = (c.command.iter().chain(&c.args)).map(|w| w.as_ref());
            let signs = start_up::signs(words, role);
            if signs.is_empty() {
                continue;
            }
            let at = ContainerRef { kind, index };
            let context = c.security_context.as_ref();
            let caps = context.and_then(|s| s.capabilities.as_ref());
            let own_add: Vec<&str> = caps.map_or(Vec::new(), |caps| {
                caps.add.iter().map(|a| a.as_ref()).collect()
            });
            let own_drop: Vec<&str> = (caps.and_then(|caps| caps.drop.as_ref()?.as_array()))
                .into_iter()
                .flatten()
                .filter_map(|d| d.as_str())
                .collect();
            let own_no_escalation =
                context.and_then(|s| s.allow_privilege_escalation) == Some(false);
            let planned = (plan.containers.iter()).find(|p| p.at == at && p.deprivileged);
            let (add, drop, no_escalation) = match planned {
                Some(p) => (
                    p.caps_added.iter().map(|a| a.as_ref()).collect(),
                    if p.drop_all { vec!["ALL"] } else { own_drop },
                    p.drop_all || own_no_escalation,
                ),
                None => (own_add, own_drop, own_no_escalation),
            };
            let label = format!("{} {}", kind.noun(), c.name.as_deref().unwrap_or_default());
            for sign in signs {
                let (lost, setuid_lost) = start_up::lost(&sign, &add, &drop, no_escalation);
                steps.push((sign, start_up::phrase(&label, &sign, &lost, setuid_lost)));
            }
        }
    }
    // Grouped by step, in the order the API server's policy writes its validations.
    let order = start_up::steps();
    let mut out = Vec::new();
    for step in order {
        let phrases: Vec<&str> = (steps.iter())
            .filter(|(sign, _)| sign.shown_by == step)
            .map(|(_, phrase)| phrase.as_str())
            .collect();
        if !phrases.is_empty() {
            out.push(phrases.join("; "));
        }
    }
    out
}
