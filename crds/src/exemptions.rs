//! What a `GpuPolicy`'s exemptions cover. The webhook and the node agent both ask, so the
//! answer is written once: namespace and service account exempt a whole pod; an image glob
//! exempts a container only together with the namespaces or service accounts it names.

use crate::glob::glob_bytes;
pub use crate::glob::glob_match;
use crate::policy::{ContainerExemption, Exemptions};

impl Exemptions {
    /// Why the whole pod is exempt (its namespace or its service account), or `None`. An
    /// empty service account name is `default`, as the API server fills it in.
    pub fn pod_exemption(&self, namespace: &str, service_account: &str) -> Option<String> {
        if self.namespaces.iter().any(|n| n == namespace) {
            return Some(format!("namespace {namespace} is exempt"));
        }
        let sa = account_or_default(service_account);
        lists_account(&self.service_accounts, namespace, sa)
            .then(|| format!("service account {namespace}/{sa} is exempt"))
    }

    /// The container exemption that lets a container with `image`, in a pod of
    /// `namespace` running as `service_account` (empty: `default`), keep what it has.
    pub fn container_exemption(
        &self,
        image: &str,
        namespace: &str,
        service_account: &str,
    ) -> Option<&ContainerExemption> {
        let sa = account_or_default(service_account);
        (self.containers.iter()).find(|entry| entry.covers(image, namespace, sa))
    }
}

impl ContainerExemption {
    /// Whether this entry covers `image` in `namespace` for service account `sa`: every
    /// listed condition holds, and a namespace or service account is listed.
    pub fn covers(&self, image: &str, namespace: &str, sa: &str) -> bool {
        let scoped = !self.namespaces.is_empty() || !self.service_accounts.is_empty();
        let in_namespace =
            self.namespaces.is_empty() || self.namespaces.iter().any(|n| n == namespace);
        let as_account = self.service_accounts.is_empty()
            || lists_account(&self.service_accounts, namespace, sa);
        let pinned = self.digests.is_empty()
            || image
                .rsplit_once('@')
                .is_some_and(|(_, digest)| self.digests.iter().any(|d| d == digest));
        scoped && in_namespace && as_account && pinned && image_exempt(image, &self.images)
    }
}

/// A pod's service account as the API server fills it in: `default` when unset.
fn account_or_default(service_account: &str) -> &str {
    if service_account.is_empty() {
        "default"
    } else {
        service_account
    }
}

/// Whether `namespace/sa` is in a list of `namespace/name` service accounts.
fn lists_account(accounts: &[String], namespace: &str, sa: &str) -> bool {
    (accounts.iter())
        .any(|s| s.strip_prefix(namespace).and_then(|r| r.strip_prefix('/')) == Some(sa))
}

/// Whether a container image matches one of the exempt image patterns. An image with neither
/// tag nor digest is also tried as `<image>:latest`, which is what the runtime pulls.
pub fn image_exempt(image: &str, patterns: &[String]) -> bool {
    if image.is_empty() || patterns.is_empty() {
        return false;
    }
    let last = image.rsplit('/').next().unwrap_or(image);
    let untagged = !last.contains(':') && !image.contains('@');
    let image = image.as_bytes();
    patterns.iter().any(|pattern| {
        let p = pattern.as_bytes();
        // Most patterns name another image and differ from it before their first wildcard:
        // those fail on their common start, read eight bytes at a time. Where the image
        // ends first, its implied `:latest` may still match.
        let common = common_prefix(p, image);
        let at_wildcard = matches!(p.get(common), None | Some(b'*' | b'?'));
        (at_wildcard || common == image.len())
            && (glob_bytes(p, image, b"") || (untagged && glob_bytes(p, image, b":latest")))
    })
}

/// How many bytes `a` and `b` share at their start.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let mut at = 0;
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        let x = u64::from_le_bytes(<[u8; 8]>::try_from(x).unwrap_or_default());
        let y = u64::from_le_bytes(<[u8; 8]>::try_from(y).unwrap_or_default());
        if x != y {
            return at + ((x ^ y).trailing_zeros() / 8) as usize;
        }
        at += 8;
    }
    at + a[at..]
        .iter()
        .zip(&b[at..])
        .take_while(|(x, y)| x == y)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match(
            "nvcr.io/nvidia/k8s/dcgm-exporter:*",
            "nvcr.io/nvidia/k8s/dcgm-exporter:3.3.5-3.4.0-ubuntu22.04"
        ));
        assert!(!glob_match(
            "nvcr.io/nvidia/k8s/dcgm-exporter:*",
            "nvcr.io/nvidia/k8s/dcgm-exporter-evil:1"
        ));
        assert!(glob_match(
            "registry.local/*/gpu-?",
            "registry.local/a/b/gpu-1"
        ));
        assert!(!glob_match(
            "registry.local/*/gpu-?",
            "registry.local/a/gpu-12"
        ));
        assert!(glob_match("*", ""));
        assert!(glob_match("a[1]", "a[1]"));
        assert!(image_exempt(
            "nvcr.io/nvidia/k8s/dcgm-exporter",
            &["nvcr.io/nvidia/k8s/dcgm-exporter:*".to_owned()]
        ));
        assert!(!image_exempt(
            "docker.io/me/dcgm-exporter:1",
            &["nvcr.io/nvidia/k8s/dcgm-exporter:*".to_owned()]
        ));
    }

    /// Plain recursion over the whole text: slow and plainly right.
    fn reference(p: &[u8], t: &[u8]) -> bool {
        match (p.split_first(), t.split_first()) {
            (None, _) => t.is_empty(),
            (Some((b'*', rest)), _) => {
                reference(rest, t) || (!t.is_empty() && reference(p, &t[1..]))
            }
            (Some((&c, rest)), Some((&d, after))) => {
                (c == b'?' || c == d) && reference(rest, after)
            }
            (Some(_), None) => false,
        }
    }

    /// Pseudo-random numbers below `n` from a seed: the same sequence on every run.
    fn numbers(seed: u64) -> impl FnMut(u64) -> u64 {
        let mut state = seed;
        move |n| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            (state >> 33) % n
        }
    }

    #[test]
    fn globs_match_the_reference_wherever_the_text_is_split() {
        // Small alphabets, so that matches, near misses and prefixes that run into the
        // tail all come up.
        let mut next = numbers(0x9e37_79b9_7f4a_7c15);
        for _ in 0..20_000 {
            let p: Vec<u8> = (0..next(7)).map(|_| b"ab:*?"[next(5) as usize]).collect();
            let t: Vec<u8> = (0..next(8)).map(|_| b"ab:"[next(3) as usize]).collect();
            let want = reference(&p, &t);
            for split in 0..=t.len() {
                let (head, tail) = t.split_at(split);
                assert_eq!(
                    glob_bytes(&p, head, tail),
                    want,
                    "pattern {:?}, text {:?} split at {split}",
                    String::from_utf8_lossy(&p),
                    String::from_utf8_lossy(&t),
                );
            }
        }
    }

    #[test]
    fn image_exemption_matches_the_reference_with_and_without_a_tag() {
        // Patterns whose literal start is shorter or longer than the image, runs into the
        // implied `:latest`, or is empty.
        let mut next = numbers(0x2545_f491_4f6c_dd1d);
        for _ in 0..20_000 {
            let image: String = (0..next(6))
                .map(|_| ["a", "b", "/", ":", "l", "@"][next(6) as usize])
                .collect();
            let pattern: String = (0..next(9))
                .map(|_| ["a", "b", "/", ":", "l", "*", "?", ":latest"][next(8) as usize])
                .collect();
            let last = image.rsplit('/').next().unwrap_or(&image);
            let untagged = !last.contains(':') && !image.contains('@');
            let tagged = format!("{image}:latest");
            let want = !image.is_empty()
                && (reference(pattern.as_bytes(), image.as_bytes())
                    || (untagged && reference(pattern.as_bytes(), tagged.as_bytes())));
            assert_eq!(
                image_exempt(&image, std::slice::from_ref(&pattern)),
                want,
                "image {image:?}, pattern {pattern:?}"
            );
        }
    }

    #[test]
    fn the_common_start_is_found_at_every_offset() {
        for len in 0..20 {
            let a = vec![b'x'; len];
            for at in 0..=len {
                let mut b = a.clone();
                if at < len {
                    b[at] = b'y';
                }
                assert_eq!(common_prefix(&a, &b), at, "length {len}");
                assert_eq!(common_prefix(&a, &a[..at]), at, "length {len}");
                assert_eq!(common_prefix(&a[..at], &a), at, "length {len}");
            }
        }
    }

    #[test]
    fn container_exemptions_are_a_conjunction() {
        let digest = format!("sha256:{}", "a".repeat(64));
        let ex = Exemptions {
            containers: vec![
                ContainerExemption {
                    images: vec!["nvcr.io/nvidia/k8s/dcgm-exporter:*".into()],
                    namespaces: vec!["gpu-operator".into()],
                    ..ContainerExemption::default()
                },
                ContainerExemption {
                    images: vec!["registry.example.com/tools/*".into()],
                    namespaces: vec!["tools".into()],
                    service_accounts: vec!["tools/debugger".into()],
                    digests: vec![digest.clone()],
                },
                // No scope: exempts nothing.
                ContainerExemption {
                    images: vec!["busybox:*".into()],
                    ..ContainerExemption::default()
                },
            ],
            ..Exemptions::default()
        };
        let dcgm = "nvcr.io/nvidia/k8s/dcgm-exporter:3.3.5";
        assert!(ex.container_exemption(dcgm, "gpu-operator", "").is_some());
        assert!(
            ex.container_exemption(dcgm, "team-a", "").is_none(),
            "another namespace"
        );
        let tool = format!("registry.example.com/tools/nsenter@{digest}");
        assert!(ex.container_exemption(&tool, "tools", "debugger").is_some());
        assert!(
            ex.container_exemption(&tool, "tools", "").is_none(),
            "another account"
        );
        assert!(
            ex.container_exemption("registry.example.com/tools/nsenter:1", "tools", "debugger")
                .is_none(),
            "not pinned"
        );
        let other = format!(
            "registry.example.com/tools/nsenter@sha256:{}",
            "b".repeat(64)
        );
        assert!(
            ex.container_exemption(&other, "tools", "debugger")
                .is_none(),
            "another digest"
        );
        assert!(
            ex.container_exemption("busybox:1", "tools", "").is_none(),
            "unscoped"
        );
    }

    #[test]
    fn pod_exemptions() {
        let ex = Exemptions {
            namespaces: vec!["gpu-operator".into()],
            service_accounts: vec!["monitoring/dcgm".into(), "tools/default".into()],
            images: vec![],
            containers: vec![],
        };
        assert_eq!(
            ex.pod_exemption("gpu-operator", "anything").as_deref(),
            Some("namespace gpu-operator is exempt")
        );
        assert_eq!(
            ex.pod_exemption("monitoring", "dcgm").as_deref(),
            Some("service account monitoring/dcgm is exempt")
        );
        assert!(ex.pod_exemption("tools", "").is_some(), "empty is default");
        assert!(ex.pod_exemption("monitoring", "other").is_none());
        assert!(ex.pod_exemption("team-a", "dcgm").is_none());
    }
}
