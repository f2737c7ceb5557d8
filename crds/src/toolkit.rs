//! The NVIDIA Container Toolkit as a node runs it: its versions, the advisories that affect
//! them, and the runtime mode a version resolves `auto` to (docs/design.md, "Node
//! posture").
//!
//! [`ADVISORIES`] is the one table of known container escapes and tampering in the
//! toolkit. Add a row with NVIDIA's bulletin as its source; the operator's `RuntimePatched`
//! condition, the summary column and the reports read it from here.

use std::cmp::Ordering;
use std::fmt;

/// One NVIDIA security advisory on the toolkit: the CVEs it fixed and in which version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Advisory {
    /// The CVE.
    pub cve: &'static str,
    /// The first release that fixes it; every earlier release is affected.
    pub fixed_in: Version,
    /// What it lets a container do.
    pub impact: &'static str,
    /// NVIDIA's bulletin.
    pub source: &'static str,
}

/// NVIDIA's bulletins on the Container Toolkit, oldest first.
pub const ADVISORIES: &[Advisory] = &[
    Advisory {
        cve: "CVE-2024-0132",
        fixed_in: Version::new(1, 16, 2),
        impact: "a crafted image escapes the container (time-of-check time-of-use on mounts)",
        source: "https://nvidia.custhelp.com/app/answers/detail/a_id/5582",
    },
    Advisory {
        cve: "CVE-2024-0133",
        fixed_in: Version::new(1, 16, 2),
        impact: "a crafted image creates empty files or directories on the host",
        source: "https://nvidia.custhelp.com/app/answers/detail/a_id/5582",
    },
    Advisory {
        cve: "CVE-2025-23359",
        fixed_in: Version::new(1, 17, 4),
        impact: "a crafted image escapes the container (the CVE-2024-0132 fix bypassed)",
        source: "https://nvidia.custhelp.com/app/answers/detail/a_id/5616",
    },
    Advisory {
        cve: "CVE-2025-23266",
        fixed_in: Version::new(1, 17, 8),
        impact: "a crafted image runs code on the host as root through the createContainer hooks",
        source: "https://nvidia.custhelp.com/app/answers/detail/a_id/5659",
    },
    Advisory {
        cve: "CVE-2025-23267",
        fixed_in: Version::new(1, 17, 8),
        impact: "a crafted image makes the update-ldcache hook follow links on the host",
        source: "https://nvidia.custhelp.com/app/answers/detail/a_id/5659",
    },
];

/// A toolkit release: `major.minor.patch`, and whether it is a pre-release of it
/// (`1.17.8~rc.1`, `1.18.0-rc.2`), which comes before the release and is taken to lack its
/// fixes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Version {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Patch.
    pub patch: u32,
    /// A release candidate or other pre-release of this version.
    pub pre_release: bool,
}

impl Version {
    /// A release.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self {
            major,
            minor,
            patch,
            pre_release: false,
        }
    }

    /// Reads the version in a package version (`1.17.8-1`, `1.17.8~rc.1-1`, `1:1.17.8-1.el9`),
    /// an image tag (`v1.17.8-ubuntu20.04`) or a build's own (`1.18.2`). `None` for anything
    /// that does not start with three dot-separated numbers after an optional epoch and `v`.
    pub fn parse(text: &str) -> Option<Self> {
        let text = text.trim();
        // A Debian or RPM epoch.
        let text = match text.split_once(':') {
            Some((epoch, rest)) if epoch.bytes().all(|b| b.is_ascii_digit()) => rest,
            _ => text,
        };
        let text = text.strip_prefix('v').unwrap_or(text);
        let end = text
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(text.len());
        let (numbers, rest) = text.split_at(end);
        let mut parts = numbers.split('.');
        let mut next = || -> Option<u32> { parts.next()?.parse().ok() };
        let (major, minor, patch) = (next()?, next()?, next()?);
        // `~rc.1` (Debian) and `-rc.1` (tags, RPM) mark a pre-release; `-1`, `-ubuntu20.04`
        // and `.el9` are packaging.
        let lower = rest.to_ascii_lowercase();
        let pre_release = lower.starts_with('~')
            || ["-rc", "-alpha", "-beta", "-pre", "-dev"]
                .iter()
                .any(|p| lower.starts_with(p));
        Some(Self {
            major,
            minor,
            patch,
            pre_release,
        })
    }

    /// The advisories this version is affected by, oldest first.
    pub fn advisories(&self) -> Vec<&'static Advisory> {
        ADVISORIES.iter().filter(|a| *self < a.fixed_in).collect()
    }
}

impl Ord for Version {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.major, self.minor, self.patch)
            .cmp(&(other.major, other.minor, other.patch))
            // A pre-release comes before its release.
            .then(other.pre_release.cmp(&self.pre_release))
    }
}

impl PartialOrd for Version {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)?;
        if self.pre_release {
            f.write_str(" (pre-release)")?;
        }
        Ok(())
    }
}

/// The first release whose `auto` mode resolves to `jit-cdi` on a node where NVML answers;
/// before it, `auto` is `legacy` unless a container names CDI devices.
pub const JIT_CDI_BY_DEFAULT: Version = Version::new(1, 18, 0);

/// The mode the runtime runs in, from its configured `mode` (absent: `auto`) and, for `auto`,
/// its version: `jit-cdi` from 1.18 on (NVIDIA's `internal/info/auto.go`, on a node with
/// NVML, which a GPU node is), `legacy` before. `None` where `auto` meets an unknown version.
pub fn resolved_mode(configured: Option<&str>, version: Option<&Version>) -> Option<String> {
    match configured.unwrap_or("auto") {
        "auto" => version.map(|v| {
            if *v >= JIT_CDI_BY_DEFAULT {
                "jit-cdi".to_owned()
            } else {
                "legacy".to_owned()
            }
        }),
        other => Some(other.to_owned()),
    }
}

/// What `RuntimePatched` says of a version: the advisories that affect it, one line each,
/// `CVE (fixed in X): impact`.
pub fn describe(advisories: &[&Advisory]) -> Vec<String> {
    advisories
        .iter()
        .map(|a| format!("{} (fixed in {}): {}", a.cve, a.fixed_in, a.impact))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_from_packages_tags_and_builds() {
        for (text, want) in [
            ("1.17.8-1", Some(Version::new(1, 17, 8))),
            ("1:1.17.8-1.el9", Some(Version::new(1, 17, 8))),
            ("v1.17.8-ubuntu20.04", Some(Version::new(1, 17, 8))),
            ("1.18.2", Some(Version::new(1, 18, 2))),
            (" v1.16.2 ", Some(Version::new(1, 16, 2))),
            ("1.16", None),
            ("latest", None),
            ("", None),
            ("1.x.2", None),
            ("99999999999.1.1", None),
        ] {
            assert_eq!(Version::parse(text), want, "{text}");
        }
        for pre in ["1.17.8~rc.1-1", "v1.18.0-rc.2", "1.17.8-rc.1"] {
            let v = Version::parse(pre).unwrap();
            assert!(v.pre_release, "{pre}");
            assert!(v < Version::new(v.major, v.minor, v.patch), "{pre}");
        }
    }

    #[test]
    fn advisories_follow_the_fixed_versions() {
        let ids = |v: &str| -> Vec<&str> {
            (Version::parse(v).unwrap().advisories().iter())
                .map(|a| a.cve)
                .collect()
        };
        assert_eq!(ids("1.14.6-1").len(), 5);
        assert_eq!(
            ids("1.16.2-1"),
            ["CVE-2025-23359", "CVE-2025-23266", "CVE-2025-23267"]
        );
        assert_eq!(ids("1.17.4"), ["CVE-2025-23266", "CVE-2025-23267"]);
        // The release candidate of the fix is not the fix.
        assert_eq!(ids("1.17.8~rc.1-1"), ["CVE-2025-23266", "CVE-2025-23267"]);
        assert!(ids("v1.17.8-ubuntu20.04").is_empty());
        assert!(ids("1.18.2").is_empty());
        // Every row names a bulletin, and the table is in order.
        assert!(ADVISORIES.iter().all(|a| a.source.starts_with("https://")));
        assert!(
            ADVISORIES
                .windows(2)
                .all(|w| w[0].fixed_in <= w[1].fixed_in)
        );
    }

    #[test]
    fn auto_resolves_by_version() {
        let v = |s: &str| Version::parse(s);
        assert_eq!(
            resolved_mode(None, v("1.18.2").as_ref()).as_deref(),
            Some("jit-cdi")
        );
        assert_eq!(
            resolved_mode(Some("auto"), v("1.17.8").as_ref()).as_deref(),
            Some("legacy")
        );
        assert_eq!(resolved_mode(Some("auto"), None), None);
        assert_eq!(resolved_mode(Some("cdi"), None).as_deref(), Some("cdi"));
    }
}
