//! What the engine is asked to judge: the pod, where it is, who asked and what is being
//! done ([`Input`]), and a container of that pod by position ([`ContainerRef`]).

use gpuwarden_crds::gpu::KIND_DAEMON_SET;
use gpuwarden_crds::selector::Labels;
use gpuwarden_crds::vm::Requester;

use super::claims::Claims;
use crate::pod::{ContainerKind, PodView};

/// One container of the pod, by position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContainerRef {
    /// Which list it is in.
    pub kind: ContainerKind,
    /// Index in that list.
    pub index: usize,
}

/// What the engine is asked to judge.
#[derive(Clone, Copy, Debug)]
pub enum Operation<'a> {
    /// A new pod (or a pod template, offline).
    Create,
    /// `pods/ephemeralcontainers` UPDATE; the previous pod tells which containers are new.
    AddEphemeral {
        /// The pod before the update.
        old: &'a PodView<'a>,
    },
}

/// Everything the engine reads, besides the policies.
#[derive(Clone, Copy, Debug)]
pub struct Input<'a> {
    /// The pod (or a pod template: an object with `metadata` and `spec`).
    pub pod: &'a PodView<'a>,
    /// The pod's namespace.
    pub namespace: &'a str,
    /// The namespace's labels: a map from
    /// [`namespace_labels_or_default`](gpuwarden_crds::selection::namespace_labels_or_default),
    /// or the same read in place ([`NamespaceLabels`](gpuwarden_crds::selection::NamespaceLabels)).
    pub namespace_labels: &'a dyn Labels,
    /// What is being done.
    pub operation: Operation<'a>,
    /// How the pod is named in messages (`namespace/name`).
    pub display_name: &'a str,
    /// Where its ResourceClaims and gpuwarden's ResourceClaimTemplates are read.
    pub claims: &'a dyn Claims,
    /// The kind of the workload whose pod template this is, where the pod cannot say so
    /// itself (offline: a DaemonSet's template). A pod's controller `ownerReference` says
    /// the same in a cluster.
    pub owner_kind: Option<&'a str>,
    /// Who asked for the pod: only this decides whether it may hold VM devices.
    pub requester: Requester<'a>,
}

impl<'a> Input<'a> {
    /// The value of the pod's label `key`, when a string.
    pub(crate) fn pod_label(&self, key: &str) -> Option<&'a str> {
        let labels = self.pod.metadata.as_ref()?.labels.as_ref()?;
        labels.get(key)?.as_str()
    }

    /// The name of the DaemonSet (of any API group) that puts this pod on every node: a GPU
    /// request it did not write would take a GPU on each node. Its owner reference is the
    /// pod's own word, so it only ever narrows what the pod is given (a denial, a warning).
    pub(crate) fn daemon_set(&self) -> Option<&'a str> {
        if self.owner_kind == Some(KIND_DAEMON_SET) {
            // Offline the pod is named after its workload, `namespace/name`.
            return Some(self.display_name.rsplit('/').next().unwrap_or_default());
        }
        let owner = self.pod.controller()?;
        (owner.kind.as_deref() == Some(KIND_DAEMON_SET))
            .then(|| owner.name.as_deref().unwrap_or(""))
    }
}
