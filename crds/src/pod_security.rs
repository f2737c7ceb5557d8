//! Pod Security Admission's levels as gpuwarden reads them (docs/design.md, "Pod Security"):
//! the namespace label and what `baseline` lets a container add. The engine and the API
//! server's rewrite both bound the capabilities they add by these.

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
