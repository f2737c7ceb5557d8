//! GPU-sharing schedulers' own grants (docs/design.md, "GPU-sharing schedulers").
//!
//! KAI-Scheduler gives its fraction container no GPU resource: its admission webhook sets
//! `NVIDIA_VISIBLE_DEVICES` from a ConfigMap its binder writes, in the pod's namespace, with
//! the UUID of the GPU KAI's reservation pod holds. Under a policy that names KAI
//! (`gpu.sharing.kai`) the engine reads that one variable, in that one container, as KAI's
//! grant rather than a leak. Every field it reads is the pod author's, so what makes the
//! grant KAI's lies elsewhere: only KAI's binder may write ConfigMaps of that name
//! (`deploy/admission/kai-sharing.yaml`), the pod must go through a scheduler (no `nodeName`
//! at creation), and the node agent holds each fraction process to the GPU that KAI's
//! reservation pod holds for the group of the pod's BindRequest.

use gpuwarden_crds::gpu::ENV_VISIBLE_DEVICES;
use gpuwarden_crds::sharing::{
    KAI_CONFIG_MAP_ANNOTATION, KAI_CONTAINER_ANNOTATION, config_map_name, fraction_container,
    is_kai_prefix,
};
use gpuwarden_crds::{GpuPolicy, KaiSharing};

use super::input::ContainerRef;
use crate::pod::{Container, ContainerKind, PodView, Scalar};

/// KAI-Scheduler's fraction container of a pod, as KAI's webhook finds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct KaiFraction {
    /// Where it is.
    pub(super) at: ContainerRef,
    /// The ConfigMap KAI's binder writes its GPU into: `<prefix>-<index>`, `-i<index>` for
    /// an init container.
    pub(super) config_map: String,
}

/// KAI-Scheduler's name for itself, in `schedulerName`, where no policy names it otherwise.
const KAI_SCHEDULER: &str = "kai-scheduler";

/// What a pod is to KAI-Scheduler's GPU sharing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kai {
    /// It asks KAI for no fraction.
    No,
    /// It asks for one; the governing policy does not name KAI.
    Unnamed,
    /// It asks for one, and the governing policy names KAI (`gpu.sharing.kai`).
    Named,
}

impl Kai {
    /// What `pod` is to KAI-Scheduler under `policy` (fields the pod's author writes: they
    /// decide what gpuwarden says here, never what it grants).
    pub(super) fn of(pod: &PodView<'_>, policy: Option<&GpuPolicy>) -> Self {
        let named = policy
            .and_then(|p| p.spec.gpu.sharing.as_ref())
            .and_then(|s| s.kai.as_ref());
        match named {
            Some(kai) if asks_kai(pod, &kai.scheduler_name) => Self::Named,
            None if asks_kai(pod, KAI_SCHEDULER) => Self::Unnamed,
            _ => Self::No,
        }
    }
}

/// Whether the pod asks KAI-Scheduler (`scheduler_name`) for part of a GPU: that scheduler
/// and a `gpu-fraction` or `gpu-memory` annotation.
pub(super) fn asks_kai(pod: &PodView<'_>, scheduler_name: &str) -> bool {
    let annotations = pod.annotations();
    gpuwarden_crds::sharing::asks_kai(
        (pod.spec.as_ref()).and_then(|s| s.scheduler_name.as_deref()),
        |key| annotations.is_some_and(|a| a.get(key).is_some()),
        scheduler_name,
    )
}

/// KAI's fraction container of a pod that asks `kai` for a fraction, carries the ConfigMap
/// prefix KAI's webhook sets, and has no `nodeName` (KAI's binder binds it; a pod that names
/// its node skips the scheduler and so any grant). `None` for any other pod, and for a
/// fraction container KAI would not find.
pub(super) fn kai_fraction(pod: &PodView<'_>, kai: &KaiSharing) -> Option<KaiFraction> {
    if !asks_kai(pod, &kai.scheduler_name) {
        return None;
    }
    let spec = pod.spec.as_ref()?;
    if spec.node_name.as_deref().is_some_and(|n| !n.is_empty()) {
        return None;
    }
    let annotations = pod.annotations()?;
    let prefix = annotations
        .get(KAI_CONFIG_MAP_ANNOTATION)
        .and_then(Scalar::as_str)
        .filter(|p| is_kai_prefix(p))?;
    let named = match annotations.get(KAI_CONTAINER_ANNOTATION) {
        Some(name) => Some(name.as_str()?),
        None => None,
    };
    let names = |kind| (pod.containers(kind).iter()).map(|c| c.name.as_deref().unwrap_or(""));
    let (kind, index) = fraction_container(
        named,
        names(ContainerKind::Init),
        names(ContainerKind::Regular),
    )?;
    Some(KaiFraction {
        at: ContainerRef { kind, index },
        config_map: config_map_name(prefix, kind, index),
    })
}

impl KaiFraction {
    /// Whether `container` (the fraction container) takes its GPU from KAI's grant: not
    /// privileged, and its last `NVIDIA_VISIBLE_DEVICES` entry reads the key of that name
    /// from KAI's ConfigMap, not optionally (a missing map then stops the container rather
    /// than leave the image's own value in force). Whether it also holds a GPU resource is
    /// the caller's to judge.
    pub(super) fn granted(&self, container: &Container<'_>) -> bool {
        let last = (container.env.iter().flatten())
            .rfind(|e| e.name.as_deref() == Some(ENV_VISIBLE_DEVICES));
        let Some(reference) = last
            .filter(|e| e.value.is_none())
            .and_then(|e| e.value_from.as_ref())
            .and_then(|v| v.config_map_key_ref.as_ref())
        else {
            return false;
        };
        !container.is_privileged()
            && reference.name.as_deref() == Some(self.config_map.as_str())
            && reference.key.as_deref() == Some(ENV_VISIBLE_DEVICES)
            && reference.optional != Some(true)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn pod(annotations: Value, spec: Value) -> Value {
        json!({"metadata": {"name": "p", "annotations": annotations}, "spec": spec})
    }

    fn kai_env(map: &str) -> Value {
        json!([{"name": "NVIDIA_VISIBLE_DEVICES",
                "valueFrom": {"configMapKeyRef": {"name": map, "key": "NVIDIA_VISIBLE_DEVICES"}}}])
    }

    fn fraction(value: &Value) -> Option<KaiFraction> {
        kai_fraction(&PodView::from_value(value), &KaiSharing::default())
    }

    #[test]
    fn kai_finds_the_fraction_container_as_kai_does() {
        let first = pod(
            json!({"gpu-fraction": "0.5", "runai/shared-gpu-configmap": "p-bcdfghj-shared-gpu"}),
            json!({"schedulerName": "kai-scheduler", "containers": [{"name": "a"}, {"name": "b"}]}),
        );
        let f = fraction(&first).unwrap();
        assert_eq!(f.at.kind, ContainerKind::Regular);
        assert_eq!(
            (f.at.index, f.config_map.as_str()),
            (0, "p-bcdfghj-shared-gpu-0")
        );

        // By name: init containers first, then regular ones.
        let named = |name: &str| {
            pod(
                json!({"gpu-memory": "2000", "gpu-fraction-container-name": name,
                       "runai/shared-gpu-configmap": "p-bcdfghj-shared-gpu"}),
                json!({"schedulerName": "kai-scheduler",
                       "initContainers": [{"name": "x"}, {"name": "gpu"}],
                       "containers": [{"name": "gpu"}, {"name": "main"}]}),
            )
        };
        let f = fraction(&named("gpu")).unwrap();
        assert_eq!(f.at.kind, ContainerKind::Init);
        assert_eq!(f.config_map, "p-bcdfghj-shared-gpu-i1");
        let f = fraction(&named("main")).unwrap();
        assert_eq!(f.at.kind, ContainerKind::Regular);
        assert_eq!(f.config_map, "p-bcdfghj-shared-gpu-1");
        assert_eq!(fraction(&named("nowhere")), None);
    }

    #[test]
    fn kai_recognises_only_its_scheduler_an_unbound_pod_and_its_prefix() {
        let good =
            json!({"gpu-fraction": "0.5", "runai/shared-gpu-configmap": "p-bcdfghj-shared-gpu"});
        let spec = json!({"schedulerName": "kai-scheduler", "containers": [{"name": "a"}]});
        assert!(fraction(&pod(good.clone(), spec.clone())).is_some());
        // Another scheduler, or a pod that names its node, gets no grant.
        let mut other = spec.clone();
        other["schedulerName"] = json!("default-scheduler");
        assert_eq!(fraction(&pod(good.clone(), other)), None);
        let mut bound = spec.clone();
        bound["nodeName"] = json!("node-1");
        assert_eq!(fraction(&pod(good.clone(), bound)), None);
        // No fraction asked, or a prefix whose names the guard would not cover.
        assert_eq!(
            fraction(&pod(
                json!({"runai/shared-gpu-configmap": "p-bcdfghj-shared-gpu"}),
                spec.clone()
            )),
            None
        );
        for prefix in [
            "tenant-map",
            "-shared-gpu",
            "P-shared-gpu",
            "a b-shared-gpu",
            "x-shared-gpu-0",
        ] {
            let a = json!({"gpu-fraction": "0.5", "runai/shared-gpu-configmap": prefix});
            assert_eq!(fraction(&pod(a, spec.clone())), None, "{prefix}");
        }
        assert_eq!(fraction(&pod(json!({"gpu-fraction": "0.5"}), spec)), None);
    }

    #[test]
    fn a_grant_is_kais_exact_reference() {
        let f = KaiFraction {
            at: ContainerRef {
                kind: ContainerKind::Regular,
                index: 0,
            },
            config_map: "p-bcdfghj-shared-gpu-0".into(),
        };
        let granted = |container: Value| {
            let pod = json!({"spec": {"containers": [container]}});
            let view = PodView::from_value(&pod);
            f.granted(&view.containers(ContainerKind::Regular)[0])
        };
        assert!(granted(json!({"env": kai_env("p-bcdfghj-shared-gpu-0")})));
        // The last entry wins: a value after KAI's is the container's own.
        let mut env = kai_env("p-bcdfghj-shared-gpu-0");
        env.as_array_mut()
            .unwrap()
            .push(json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}));
        assert!(!granted(json!({"env": env})));
        // Another map, another key, an optional reference, a privileged container.
        assert!(!granted(json!({"env": kai_env("tenant-shared-gpu-0")})));
        assert!(!granted(json!({"env": [{"name": "NVIDIA_VISIBLE_DEVICES",
            "valueFrom": {"configMapKeyRef": {"name": "p-bcdfghj-shared-gpu-0", "key": "GPUS"}}}]})));
        assert!(!granted(json!({"env": [{"name": "NVIDIA_VISIBLE_DEVICES",
            "valueFrom": {"configMapKeyRef": {"name": "p-bcdfghj-shared-gpu-0",
                "key": "NVIDIA_VISIBLE_DEVICES", "optional": true}}}]})));
        assert!(!granted(json!({"env": [{"name": "NVIDIA_VISIBLE_DEVICES",
            "valueFrom": {"secretKeyRef": {"name": "p-bcdfghj-shared-gpu-0", "key": "NVIDIA_VISIBLE_DEVICES"}}}]})));
        assert!(!granted(json!({"env": kai_env("p-bcdfghj-shared-gpu-0"),
            "securityContext": {"privileged": true}})));
        assert!(!granted(json!({})));
    }
}
