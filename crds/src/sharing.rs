//! What KAI-Scheduler writes, as gpuwarden reads it (KAI v0.17.0; docs/design.md,
//! "GPU-sharing schedulers"): the webhook's engine, the backstop's CEL and the node agent
//! find KAI's fraction container and its grant by the same names.

use crate::gpu::ContainerKind;

/// The annotations that ask KAI-Scheduler for part of a GPU.
pub const KAI_FRACTION_ANNOTATIONS: [&str; 2] = ["gpu-fraction", "gpu-memory"];
/// The annotation naming the container a KAI fraction is for (init containers first).
pub const KAI_CONTAINER_ANNOTATION: &str = "gpu-fraction-container-name";
/// The annotation KAI's webhook sets: the prefix of its ConfigMaps' names.
pub const KAI_CONFIG_MAP_ANNOTATION: &str = "runai/shared-gpu-configmap";
/// How every prefix KAI writes ends; the ConfigMap guard matches names built on it.
const KAI_PREFIX_END: &str = "-shared-gpu";

/// The label KAI's binder puts on a reservation pod: the GPU group it holds a GPU for.
pub const KAI_GPU_GROUP_LABEL: &str = "runai-gpu-group";
/// The `app` label of KAI's reservation pods.
pub const KAI_RESERVATION_APP: (&str, &str) = ("app", "kai-resource-reservation");

/// KAI's BindRequest: the scheduler's decision for one pod, which tenants cannot write.
pub mod bind_request {
    /// API group.
    pub const GROUP: &str = "scheduling.run.ai";
    /// Version.
    pub const VERSION: &str = "v1alpha2";
    /// Kind.
    pub const KIND: &str = "BindRequest";
    /// Plural.
    pub const PLURAL: &str = "bindrequests";
    /// The label naming the node the pod is bound to.
    pub const NODE_LABEL: &str = "selected-node";
}

/// Whether a pod with `scheduler` and annotations (`has_annotation`) asks KAI-Scheduler,
/// serving `scheduler_name`, for part of a GPU.
pub fn asks_kai(
    scheduler: Option<&str>,
    has_annotation: impl Fn(&str) -> bool,
    scheduler_name: &str,
) -> bool {
    scheduler == Some(scheduler_name) && KAI_FRACTION_ANNOTATIONS.iter().any(|k| has_annotation(k))
}

/// KAI's fraction container, as KAI finds it: the one `named` by its annotation among the
/// init containers, then the regular ones; without the annotation the first regular
/// container. `None` where there is none.
pub fn fraction_container<'n>(
    named: Option<&str>,
    init: impl IntoIterator<Item = &'n str>,
    regular: impl IntoIterator<Item = &'n str>,
) -> Option<(ContainerKind, usize)> {
    let mut regular = regular.into_iter();
    let Some(named) = named else {
        return regular.next().map(|_| (ContainerKind::Regular, 0));
    };
    (init
        .into_iter()
        .position(|n| n == named)
        .map(|i| (ContainerKind::Init, i)))
    .or_else(|| {
        regular
            .position(|n| n == named)
            .map(|i| (ContainerKind::Regular, i))
    })
}

/// Whether `prefix` is a ConfigMap prefix KAI writes: a DNS subdomain's characters ending in
/// `-shared-gpu`, so that every name built on it is one the ConfigMap guard covers.
pub fn is_kai_prefix(prefix: &str) -> bool {
    let Some(base) = prefix.strip_suffix(KAI_PREFIX_END) else {
        return false;
    };
    let alphanumeric =
        |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    alphanumeric(base.chars().next())
        && alphanumeric(base.chars().last())
        && (base.chars())
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.'))
}

/// The ConfigMap KAI's binder writes the GPU of the fraction container at `kind`/`index`
/// into: `<prefix>-<index>`, `<prefix>-i<index>` for an init container.
pub fn config_map_name(prefix: &str, kind: ContainerKind, index: usize) -> String {
    let init = if kind == ContainerKind::Init { "i" } else { "" };
    format!("{prefix}-{init}{index}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fraction_container_is_found_as_kai_finds_it() {
        let init = ["x", "gpu"];
        let regular = ["gpu", "main"];
        let find = |named| fraction_container(named, init, regular);
        assert_eq!(find(None), Some((ContainerKind::Regular, 0)));
        assert_eq!(find(Some("gpu")), Some((ContainerKind::Init, 1)));
        assert_eq!(find(Some("main")), Some((ContainerKind::Regular, 1)));
        assert_eq!(find(Some("nowhere")), None);
        assert_eq!(fraction_container(None, [], []), None);
    }

    #[test]
    fn only_kais_prefixes_are_read() {
        for good in ["p-bcdfghj-shared-gpu", "a.b-shared-gpu", "0-shared-gpu"] {
            assert!(is_kai_prefix(good), "{good}");
        }
        for bad in [
            "tenant-map",
            "-shared-gpu",
            "P-shared-gpu",
            "a b-shared-gpu",
            "x-shared-gpu-0",
            "a--shared-gpu",
        ] {
            assert!(!is_kai_prefix(bad), "{bad}");
        }
        assert_eq!(
            config_map_name("p-shared-gpu", ContainerKind::Init, 2),
            "p-shared-gpu-i2"
        );
        assert_eq!(
            config_map_name("p-shared-gpu", ContainerKind::Regular, 0),
            "p-shared-gpu-0"
        );
    }
}
