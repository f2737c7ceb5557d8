//! Pod Security Admission's levels as gpuwarden reads them (docs/design.md, "Pod Security"):
//! the namespace label, what `baseline` lets a container add, and what an ordinary container
//! gets from its runtime. The engine and the API server's rewrite both bound the capabilities
//! they keep by these.

/// The namespace label that sets the enforced level.
pub const LABEL_PSA_ENFORCE: &str = "pod-security.kubernetes.io/enforce";

/// Capabilities `baseline` lets a container add.
pub const BASELINE_CAPABILITIES: &[&str] = &[
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
];

/// The capabilities containerd (and Docker) give a container that is not privileged and
/// drops none: `baseline`'s set and `NET_RAW`. A container without privilege gets these
/// whatever gpuwarden writes, unless it drops them itself; CRI-O's default is smaller.
/// A rewritten container may keep asking for any of them (docs/design.md, "What a rewritten
/// container keeps"), as an ordinary container of its namespace may.
pub const RUNTIME_DEFAULT_CAPABILITIES: &[&str] = &[
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "NET_RAW",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baseline_admits_every_runtime_default_but_net_raw() {
        let beyond: Vec<&str> = (RUNTIME_DEFAULT_CAPABILITIES.iter())
            .filter(|c| !BASELINE_CAPABILITIES.contains(c))
            .copied()
            .collect();
        assert_eq!(beyond, ["NET_RAW"]);
        assert!((BASELINE_CAPABILITIES.iter()).all(|c| RUNTIME_DEFAULT_CAPABILITIES.contains(c)));
    }
}
