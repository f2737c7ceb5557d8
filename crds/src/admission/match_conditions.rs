//! The webhook's `matchConditions` kept in step with the GpuPolicies (docs/design.md, "The
//! admission path"): a pod that every policy exempts is admitted by the API server without
//! a call, so NVIDIA's components (and anything else exempt everywhere) never wait for the
//! webhook, even during an outage.
//!
//! The condition is CEL the operator writes into the MutatingWebhookConfiguration. It is
//! true (send the pod) unless, under **every** GpuPolicy, the pod is exempt: its namespace
//! or `namespace/serviceAccount` is listed, or (for a policy that is valid: an invalid one
//! fails closed on its image exemptions) every container is covered by one of its
//! container exemptions. Which policy governs a pod depends on namespace labels the
//! condition cannot read, so every policy must agree. Where CEL cannot follow an image
//! glob (a `?`, a `*` before the end) the pattern counts for nothing here: the pod is sent
//! and the webhook decides, so the condition only ever lets through pods the engine would
//! leave unchanged.

use super::cel::{POD, exemption_scope, literal, pod_exempt};
use crate::{ContainerExemption, GpuPolicy};

/// Name of the condition in the webhook configuration.
pub const NOT_EXEMPT_CONDITION: &str = "gpuwarden-not-exempt";

/// The CEL of [`NOT_EXEMPT_CONDITION`] for these policies; `valid` says whether a policy's
/// image exemptions hold (the operator's validation). `true` when there is no policy, or
/// when no pod can be exempt under all of them.
pub fn not_exempt_expression<'p>(
    policies: impl IntoIterator<Item = &'p GpuPolicy>,
    valid: impl Fn(&GpuPolicy) -> bool,
) -> String {
    let mut all = Vec::new();
    for policy in policies {
        match exempt_under(policy, valid(policy)) {
            Some(exempt) => all.push(exempt),
            // Nothing is exempt under this policy, so nothing is exempt under all.
            None => return "true".to_owned(),
        }
    }
    if all.is_empty() {
        return "true".to_owned();
    }
    format!("!({})", all.join(" && "))
}

/// The CEL that says a pod is exempt under `policy`, or `None` when nothing can be.
fn exempt_under(policy: &GpuPolicy, images_hold: bool) -> Option<String> {
    let ex = &policy.spec.exemptions;
    let mut any = pod_exempt(POD, ex);
    let entries: Vec<String> = if images_hold {
        ex.containers.iter().filter_map(entry_covers).collect()
    } else {
        Vec::new()
    };
    if !entries.is_empty() {
        let covered = format!("({})", entries.join(" || "));
        any.push(format!(
            "(object.spec.containers.all(c, {covered}) && (!has(object.spec.initContainers) || object.spec.initContainers.all(c, {covered})) && (!has(object.spec.ephemeralContainers) || object.spec.ephemeralContainers.all(c, {covered})))"
        ));
    }
    (!any.is_empty()).then(|| format!("({})", any.join(" || ")))
}

/// The CEL that says container `c` is covered by `entry`, or `None` when CEL cannot say it
/// for any image (or the entry names neither namespaces nor service accounts, and so
/// exempts nothing).
fn entry_covers(entry: &ContainerExemption) -> Option<String> {
    if entry.namespaces.is_empty() && entry.service_accounts.is_empty() {
        return None;
    }
    let images: Vec<String> = entry.images.iter().filter_map(|p| image_match(p)).collect();
    if images.is_empty() {
        return None;
    }
    let mut all = vec![format!("({})", images.join(" || "))];
    all.extend(exemption_scope(POD, entry, "c.image"));
    Some(format!("({})", all.join(" && ")))
}

/// CEL matching exactly the images a glob matches, where CEL can: a pattern without
/// wildcards is the image itself (its `:latest` spelling is left to the webhook), one whose
/// only wildcard is a final `*` is a prefix. Others give `None`.
fn image_match(pattern: &str) -> Option<String> {
    match pattern.strip_suffix('*') {
        _ if pattern.contains('?') => None,
        Some(prefix) if !prefix.contains('*') => {
            Some(format!("c.image.startsWith({})", literal(prefix)))
        }
        Some(_) => None,
        None if pattern.contains('*') => None,
        None => Some(format!("c.image == {}", literal(pattern))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_cel_cannot_follow_count_for_nothing() {
        assert_eq!(
            image_match("nvcr.io/nvidia/cloud-native/*").as_deref(),
            Some("c.image.startsWith('nvcr.io/nvidia/cloud-native/')")
        );
        assert_eq!(
            image_match("busybox").as_deref(),
            Some("c.image == 'busybox'")
        );
        for beyond in ["registry.*/tools:*", "busybox:1.?", "*/cuda:*", "a*b"] {
            assert_eq!(image_match(beyond), None, "{beyond}");
        }
    }

    #[test]
    fn no_policy_or_a_policy_without_exemptions_sends_every_pod() {
        assert_eq!(not_exempt_expression([], |_| true), "true");
        let mut bare = GpuPolicy::default_policy();
        bare.spec.exemptions = Default::default();
        let default = GpuPolicy::default_policy();
        assert_eq!(not_exempt_expression([&default, &bare], |_| true), "true");
    }

    #[test]
    fn the_default_policy_lets_nvidia_components_through_in_their_namespaces() {
        let default = GpuPolicy::default_policy();
        let cel = not_exempt_expression([&default], |_| true);
        assert!(
            cel.starts_with("!((request.namespace in ['kube-system', 'gpuwarden-system']"),
            "{cel}"
        );
        assert!(
            cel.contains("c.image.startsWith('nvcr.io/nvidia/k8s-device-plugin:')"),
            "{cel}"
        );
        assert!(
            cel.contains("request.namespace in ['gpu-operator', 'nvidia-gpu-operator'"),
            "{cel}"
        );
        // Invalid: image exemptions do not hold, namespaces do.
        let invalid = not_exempt_expression([&default], |_| false);
        assert!(!invalid.contains("c.image"), "{invalid}");
        assert!(invalid.contains("'kube-system'"), "{invalid}");
    }
}
