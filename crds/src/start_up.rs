//! What a container does at start that needs more than a container without capabilities
//! (docs/design.md, "What a rewritten container keeps"): sshd's privilege separation,
//! switching users, changing file owners. The signs are words of its `command` and `args`,
//! and the MPI operator's worker role.
//!
//! A tenant writes every one of these signs, so they grant nothing: the engine reads them
//! only to say, at admission, what a de-privileged container keeps of what it needs and what
//! it loses under the policy in force, so that a failure at run time is never silent. The
//! API server says the same of the pods it rewrote itself, through the policy that
//! `admission::start_up` renders from these tables ([`pattern`] is the same test in CEL).

use crate::pod_security::RUNTIME_DEFAULT_CAPABILITIES;

/// The MPI operator's label for a pod's role in its MPIJob (`launcher` or `worker`).
pub const LABEL_MPI_JOB_ROLE: &str = "training.kubeflow.org/job-role";
/// [`LABEL_MPI_JOB_ROLE`]'s value on an MPIJob's workers, which run `sshd` for the launcher.
pub const MPI_WORKER: &str = "worker";

/// [`Sign::shown_by`] for the MPI operator's worker role.
pub const MPI_WORKER_SIGN: &str = "MPI worker";

/// What some start-up step needs of its container.
#[derive(Debug, PartialEq, Eq)]
pub struct Need {
    /// The programs whose name shows the step.
    pub programs: &'static [&'static str],
    /// The capabilities it needs.
    pub capabilities: &'static [&'static str],
    /// Whether a user other than root runs it through its setuid bit, which
    /// `allowPrivilegeEscalation: false` turns off.
    pub setuid: bool,
    /// What the step does, for the warning.
    pub what: &'static str,
}

/// sshd's need: what an MPI worker has.
const SSHD: Need = Need {
    programs: &["sshd", "dropbear"],
    capabilities: &["NET_BIND_SERVICE", "SETUID", "SETGID", "SYS_CHROOT"],
    setuid: false,
    what: "a port below 1024, privilege separation and logging users in",
};

/// Each start-up step gpuwarden names, by the programs that show it.
pub const NEEDS: &[Need] = &[
    SSHD,
    Need {
        programs: &["su", "sudo", "doas"],
        capabilities: &["SETUID", "SETGID"],
        setuid: true,
        what: "switching users",
    },
    Need {
        programs: &[
            "gosu",
            "su-exec",
            "runuser",
            "setpriv",
            "chpst",
            "s6-setuidgid",
            "supervisord",
        ],
        capabilities: &["SETUID", "SETGID"],
        setuid: false,
        what: "switching users",
    },
    Need {
        programs: &["chown", "chgrp"],
        capabilities: &["CHOWN"],
        setuid: false,
        what: "changing file owners",
    },
];

/// What separates the words of a command line, as a shell reads it: blanks, the control
/// operators and quotes. A word's program is what follows its last `/`.
const SEPARATORS: &[char] = &[
    ' ', '\t', '\n', '\r', '\x0c', ';', '&', '|', '(', ')', '\'', '"', '`',
];

/// A start-up step a container shows: the program (or `MPI worker`) and its need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sign {
    /// The program named, or `MPI worker` for the MPI operator's role.
    pub shown_by: &'static str,
    /// What it needs.
    pub need: &'static Need,
}

/// The steps a container whose `command` and `args` are `words`, in a pod whose
/// [`LABEL_MPI_JOB_ROLE`] is `role`, shows: each program once, in the order of [`NEEDS`].
pub fn signs<'w>(words: impl IntoIterator<Item = &'w str>, role: Option<&str>) -> Vec<Sign> {
    let mut seen: Vec<&'static str> = Vec::new();
    for word in words {
        for token in word.split(SEPARATORS) {
            let program = token.rsplit('/').next().unwrap_or(token);
            let known = NEEDS.iter().flat_map(|n| n.programs.iter());
            if let Some(known) = known.into_iter().find(|p| **p == program)
                && !seen.contains(known)
            {
                seen.push(known);
            }
        }
    }
    let mut out: Vec<Sign> = NEEDS
        .iter()
        .flat_map(|need| {
            let seen = &seen;
            (need.programs.iter())
                .filter(move |p| seen.contains(p))
                .map(move |p| Sign { shown_by: p, need })
        })
        .collect();
    if role == Some(MPI_WORKER) && !out.iter().any(|s| s.need == &SSHD) {
        out.push(Sign {
            shown_by: MPI_WORKER_SIGN,
            need: &NEEDS[0],
        });
    }
    out
}

/// Every step's [`Sign::shown_by`], in the order the warnings name them: each program of
/// [`NEEDS`], then [`MPI_WORKER_SIGN`].
pub fn steps() -> impl Iterator<Item = &'static str> {
    (NEEDS.iter())
        .flat_map(|n| n.programs.iter().copied())
        .chain([MPI_WORKER_SIGN])
}

/// The start of each warning that names, for a rewritten pod, what its containers keep and
/// lose of what one start-up step needs; a [`phrase`] per container follows, joined by `; `.
pub const WARNING_PREFIX: &str = "gpuwarden: at start, ";

/// The capabilities of `sign`'s need that a container whose `securityContext.capabilities`
/// ends as `add` and `drop` does not have (a capability is had where it is added, or where
/// the runtime gives it by default and neither it nor `ALL` is dropped), in the need's order;
/// and whether its setuid programs stop working (`allowPrivilegeEscalation` ends `false`,
/// `no_escalation`, and the step runs one). Names are compared as written.
pub fn lost(
    sign: &Sign,
    add: &[&str],
    drop: &[&str],
    no_escalation: bool,
) -> (Vec<&'static str>, bool) {
    let has = |cap: &str| {
        add.contains(&cap)
            || (RUNTIME_DEFAULT_CAPABILITIES.contains(&cap)
                && !drop.contains(&cap)
                && !drop.contains(&"ALL"))
    };
    let lost = (sign.need.capabilities.iter())
        .filter(|cap| !has(cap))
        .copied()
        .collect();
    (lost, sign.need.setuid && no_escalation)
}

/// What the warning says of one step of the container called `label` (`container main`,
/// `init container setup`): `<label> runs sshd: keeps NET_BIND_SERVICE,SETUID,SETGID,SYS_CHROOT (privilege
/// separation and logging users in)`, or `... loses SYS_CHROOT,allowPrivilegeEscalation
/// (...)` with what [`lost`] found.
pub fn phrase(label: &str, sign: &Sign, lost: &[&str], setuid_lost: bool) -> String {
    let (program, what) = (sign.shown_by, sign.need.what);
    let mpi = program == MPI_WORKER_SIGN;
    if lost.is_empty() && !setuid_lost {
        let kept = sign.need.capabilities.join(",");
        return if mpi {
            format!("{label} is an MPI worker (sshd): keeps {kept} ({what})")
        } else {
            format!("{label} runs {program}: keeps {kept} ({what})")
        };
    }
    let mut items = lost.to_vec();
    if setuid_lost {
        items.push("allowPrivilegeEscalation");
    }
    let items = items.join(",");
    if mpi {
        format!("{label} is an MPI worker (sshd): loses {items} ({what})")
    } else {
        format!("{label} runs {program}: loses {items} ({what})")
    }
}

/// An RE2 pattern that matches a `command` or `args` entry exactly where [`signs`] finds a
/// program in it (a word's program preceded by the start, a separator or `/`, and followed by
/// the end or a separator), for the API server's rewrite.
pub fn pattern() -> String {
    let programs: Vec<&str> = (NEEDS.iter())
        .flat_map(|n| n.programs.iter().copied())
        .collect();
    program_pattern(&programs.join("|"))
}

/// [`pattern`] for the program (or alternation of programs) `programs`, written as RE2.
pub fn program_pattern(programs: &str) -> String {
    let class: String = SEPARATORS
        .iter()
        .map(|c| match c {
            ' ' => " ".to_owned(),
            '\t' => "\\t".to_owned(),
            '\n' => "\\n".to_owned(),
            '\r' => "\\r".to_owned(),
            '\x0c' => "\\f".to_owned(),
            '|' | '(' | ')' => format!("\\{c}"),
            c => c.to_string(),
        })
        .collect();
    format!("(^|[{class}/])({programs})($|[{class}])")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(words: &[&str], role: Option<&str>) -> Vec<&'static str> {
        signs(words.iter().copied(), role)
            .iter()
            .map(|s| s.shown_by)
            .collect()
    }

    #[test]
    fn programs_are_read_from_words_as_a_shell_splits_them() {
        assert_eq!(shown(&["/usr/sbin/sshd", "-De"], None), ["sshd"]);
        assert_eq!(
            shown(
                &[
                    "/bin/sh",
                    "-c",
                    "chown -R app /data && exec gosu app python"
                ],
                None
            ),
            ["gosu", "chown"]
        );
        assert_eq!(shown(&["sh", "-c", "(sudo -u x id)|cat"], None), ["sudo"]);
        assert_eq!(shown(&["supervisord", "-n"], None), ["supervisord"]);
        // Words that only contain a program's name show nothing.
        assert!(shown(&["/opt/sshd/run", "x-sudo", "--su", "sum", "chowner"], None).is_empty());
    }

    #[test]
    fn an_mpi_worker_needs_what_sshd_needs() {
        let signs = signs([], Some("worker"));
        assert_eq!(signs.len(), 1);
        assert_eq!(
            signs[0].need.capabilities,
            ["NET_BIND_SERVICE", "SETUID", "SETGID", "SYS_CHROOT"]
        );
        assert!(shown(&[], Some("launcher")).is_empty());
        assert_eq!(shown(&["sshd"], Some("worker")), ["sshd"]);
    }

    #[test]
    fn a_step_keeps_what_the_runtime_gives_unless_dropped() {
        let sshd = signs(["sshd"], None)[0];
        assert_eq!(lost(&sshd, &[], &[], false), (vec![], false));
        assert_eq!(
            phrase("container worker", &sshd, &[], false),
            "container worker runs sshd: keeps NET_BIND_SERVICE,SETUID,SETGID,SYS_CHROOT (a port below 1024, privilege separation and logging users in)"
        );
        assert_eq!(
            lost(&sshd, &["SETUID"], &["ALL"], true),
            (vec!["NET_BIND_SERVICE", "SETGID", "SYS_CHROOT"], false)
        );
        assert_eq!(lost(&sshd, &[], &["SYS_CHROOT"], false).0, ["SYS_CHROOT"]);
        let sudo = signs(["sudo"], None)[0];
        let (caps, setuid) = lost(&sudo, &[], &["ALL"], true);
        assert_eq!(
            phrase("init container setup", &sudo, &caps, setuid),
            "init container setup runs sudo: loses SETUID,SETGID,allowPrivilegeEscalation (switching users)"
        );
        let worker = signs([], Some(MPI_WORKER))[0];
        assert_eq!(
            phrase("container w", &worker, &[], false),
            "container w is an MPI worker (sshd): keeps NET_BIND_SERVICE,SETUID,SETGID,SYS_CHROOT (a port below 1024, privilege separation and logging users in)"
        );
    }

    #[test]
    fn the_pattern_names_every_program_and_separator() {
        let pattern = pattern();
        for need in NEEDS {
            for program in need.programs {
                assert!(pattern.contains(program));
            }
        }
        assert!(pattern.starts_with("(^|[ \\t\\n\\r\\f;&\\|\\(\\)'\"`/])("));
    }
}
