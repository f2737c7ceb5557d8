//! The pods on this node, reduced to what attribution needs: UID, name, and per container
//! its runtime id, whether it is privileged and whether it shows a GPU signal.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;

use gpuwarden_crds::GpuPolicy;
use gpuwarden_crds::gpu::{self, ContainerKind, Rules};
use gpuwarden_crds::injection::{self, GpuName};
use gpuwarden_crds::selection::{namespace_labels_or_default, select_policy};
use gpuwarden_crds::sharing::{self, KAI_CONTAINER_ANNOTATION};
use kube::ResourceExt;

use crate::cgroup::strip_runtime_scheme;

/// Annotation the kubelet puts on a mirror pod: the static pod's UID (used in its cgroups).
const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// One pod on the node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodInfo {
    /// UID in the API.
    pub uid: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// For a mirror pod, the static pod's UID, which its cgroups are named after.
    pub mirror_uid: Option<String>,
    /// `spec.serviceAccountName` (empty: `default`).
    pub service_account: String,
    /// Labels (a policy's `podSelector` reads them).
    pub labels: BTreeMap<String, String>,
    /// Containers (init containers included).
    pub containers: Vec<ContainerInfo>,
    /// The GpuPolicy exemption that lets it keep its privilege, set by [`PodInfo::exempt_by`].
    pub exempt: Option<String>,
    /// Why devices its claims' CDI specs give it beyond their allocation do not count
    /// against the node: it runs where a DRA driver's own pods run, or is exempt
    /// ([`claims_exemption`]).
    pub claims_exempt: Option<String>,
    /// It asks KAI-Scheduler for part of a GPU, under a policy that names KAI.
    pub kai: Option<KaiFraction>,
    /// The GPUs its device-injection annotations name, per container they reach (`None`:
    /// every container), which the kubelet must have allocated to the pod.
    pub injected: Vec<(Option<String>, Vec<GpuName>)>,
}

/// A pod that asks KAI-Scheduler for part of a GPU, under a policy that names KAI
/// (`gpu.sharing.kai`): which container the fraction is for, and where the policy says KAI
/// keeps its reservation pods ([`crate::kai`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KaiFraction {
    /// The fraction container, as KAI finds it.
    pub container: String,
    /// KAI's reservation namespace.
    pub reservation_namespace: String,
}

impl KaiFraction {
    /// The pod's fraction, if it asks KAI for one and `policy` names KAI.
    fn of(pod: &Pod, policy: &GpuPolicy) -> Option<Self> {
        let kai = policy.spec.gpu.sharing.as_ref()?.kai.as_ref()?;
        let spec = pod.spec.as_ref()?;
        let annotations = pod.metadata.annotations.as_ref();
        let asks = sharing::asks_kai(
            spec.scheduler_name.as_deref(),
            |key| annotations.is_some_and(|a| a.contains_key(key)),
            &kai.scheduler_name,
        );
        if !asks {
            return None;
        }
        let named = annotations
            .and_then(|a| a.get(KAI_CONTAINER_ANNOTATION))
            .map(String::as_str);
        let init = spec.init_containers.as_deref().unwrap_or_default();
        let (kind, index) = sharing::fraction_container(
            named,
            init.iter().map(|c| c.name.as_str()),
            spec.containers.iter().map(|c| c.name.as_str()),
        )?;
        let list = if kind == ContainerKind::Init {
            init
        } else {
            &spec.containers
        };
        Some(Self {
            container: list.get(index)?.name.clone(),
            reservation_namespace: kai.reservation_namespace.clone(),
        })
    }
}

/// One container of a pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerInfo {
    /// Name.
    pub name: String,
    /// `containerd://<id>` from the container status, once it has started.
    pub container_id: Option<String>,
    /// Image reference.
    pub image: String,
    /// `securityContext.privileged`.
    pub privileged: bool,
    /// Whether it shows a GPU signal (GPU limit, `NVIDIA_VISIBLE_DEVICES`, device mounts,
    /// NVIDIA CDI annotation on the pod).
    pub gpu: bool,
}

/// The GPUs the pod's device-injection annotations name, per container they reach.
fn injected_gpus(pod: &Pod) -> Vec<(Option<String>, Vec<GpuName>)> {
    let annotations =
        (pod.metadata.annotations.iter().flatten()).map(|(k, v)| (k.as_str(), Some(v.as_str())));
    injection::read_all(annotations)
        .into_iter()
        .filter_map(|i| {
            let gpus: Vec<GpuName> = i.gpus().cloned().collect();
            let container = match i.target {
                injection::Target::Pod => None,
                injection::Target::Container(c) => Some(c.to_owned()),
            };
            (!gpus.is_empty()).then_some((container, gpus))
        })
        .collect()
}

impl PodInfo {
    /// The pod's facts under the policy that governs it (chosen from `policies` as the
    /// webhook chooses it, with `namespace_labels` as [`PodInfo::exempt_by`] reads them);
    /// `None` for a pod without a UID or one that has finished. Its containers are judged
    /// by the one GPU predicate ([`gpu::pod_containers`]) under that policy's rules.
    pub fn from_pod(
        pod: &Pod,
        policies: &[Arc<GpuPolicy>],
        namespace_labels: Option<BTreeMap<String, String>>,
    ) -> Option<Self> {
        let uid = pod.metadata.uid.clone()?;
        let status = pod.status.as_ref();
        if matches!(
            status.and_then(|s| s.phase.as_deref()),
            Some("Succeeded" | "Failed")
        ) {
            return None;
        }
        let spec = pod.spec.as_ref()?;
        let mut ids: HashMap<&str, &str> = HashMap::new();
        if let Some(s) = status {
            for cs in s
                .container_statuses
                .iter()
                .flatten()
                .chain(s.init_container_statuses.iter().flatten())
                .chain(s.ephemeral_container_statuses.iter().flatten())
            {
                if let Some(id) = cs.container_id.as_deref() {
                    ids.insert(cs.name.as_str(), id);
                }
            }
        }
        let mut info = PodInfo {
            uid,
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            mirror_uid: (pod.metadata.annotations.as_ref())
                .and_then(|a| a.get(MIRROR_ANNOTATION).cloned()),
            service_account: spec.service_account_name.clone().unwrap_or_default(),
            labels: pod.metadata.labels.clone().unwrap_or_default(),
            containers: Vec::new(),
            exempt: None,
            claims_exempt: None,
            kai: None,
            injected: injected_gpus(pod),
        };
        let policy = info.governing_policy(policies, namespace_labels);
        let rules = policy.map(Rules::of).unwrap_or_default();
        info.containers = gpu::pod_containers(pod, rules)
            .into_iter()
            .map(|c| ContainerInfo {
                name: c.name.to_owned(),
                image: c.image.to_owned(),
                container_id: ids.get(c.name).map(|s| s.to_string()),
                privileged: c.privileged,
                gpu: c.signals.is_gpu(),
            })
            .collect();
        info.exempt = policy.and_then(|policy| info.exemption(policy));
        info.claims_exempt = claims_exemption(policy, &info.namespace, &info.service_account);
        info.kai = policy.and_then(|policy| KaiFraction::of(pod, policy));
        Some(info)
    }

    /// The policy that governs this pod, chosen as the webhook chooses it
    /// ([`select_policy`]) from `namespace_labels` (the labels of the pod's namespace;
    /// `None` when the namespace is not known, which leaves only its name label) and the
    /// pod's labels.
    fn governing_policy<'p>(
        &self,
        policies: &'p [Arc<GpuPolicy>],
        namespace_labels: Option<BTreeMap<String, String>>,
    ) -> Option<&'p GpuPolicy> {
        let namespace_labels = namespace_labels_or_default(&self.namespace, namespace_labels);
        let selection = select_policy(policies, &namespace_labels, &self.labels);
        if let Some(invalid) = &selection.invalid {
            // The webhook denies what this policy would judge; here it still governs.
            tracing::debug!(pod = %self.name, namespace = %self.namespace, "{invalid}");
        }
        selection.policy
    }

    /// Records which exemption, if any, lets this pod keep a privileged GPU container: its
    /// namespace or service account, or the images of all its privileged GPU containers,
    /// as the policy that governs the pod says. That policy is chosen as the webhook chooses
    /// it ([`select_policy`]), from `namespace_labels` (the labels of the pod's namespace;
    /// `None` when the namespace is not known, which leaves only its name label) and the
    /// pod's labels. Another policy's exemptions do not count, and a pod no policy governs
    /// has no exemption: its privileged containers count against the node.
    pub fn exempt_by(
        mut self,
        policies: &[Arc<GpuPolicy>],
        namespace_labels: Option<BTreeMap<String, String>>,
    ) -> Self {
        let policy = self.governing_policy(policies, namespace_labels);
        self.exempt = policy.and_then(|policy| self.exemption(policy));
        self.claims_exempt = claims_exemption(policy, &self.namespace, &self.service_account);
        self
    }

    fn exemption(&self, policy: &GpuPolicy) -> Option<String> {
        let pick = |gpu_only: bool| -> Vec<&ContainerInfo> {
            self.containers
                .iter()
                .filter(|c| c.privileged && (c.gpu || !gpu_only))
                .collect()
        };
        // The privileged GPU containers; failing those, every privileged container (one may
        // be seen on a GPU without showing a GPU signal, say through `envFrom`).
        let mut privileged = pick(true);
        if privileged.is_empty() {
            privileged = pick(false);
        }
        if privileged.is_empty() {
            return None;
        }
        let ex = &policy.spec.exemptions;
        let why = ex
            .pod_exemption(&self.namespace, &self.service_account)
            .or_else(|| {
                let covered = |c: &&ContainerInfo| {
                    (ex.container_exemption(&c.image, &self.namespace, &self.service_account))
                        .is_some()
                };
                (privileged.iter().all(covered)).then(|| {
                    format!(
                        "image {} is exempt in namespace {}",
                        privileged[0].image, self.namespace
                    )
                })
            })?;
        Some(format!("GpuPolicy {}: {why}", policy.name_any()))
    }

    /// Whether a privileged container of this pod shows a GPU signal.
    pub fn has_privileged_gpu_container(&self) -> bool {
        self.containers.iter().any(|c| c.privileged && c.gpu)
    }
}

/// Why a pod in `namespace` under `service_account` may hold what its claims' CDI specs give
/// beyond their allocation: the policy that governs it lists the namespace in
/// `driverClaims.namespaces` (a DRA driver's own pods, such as the IMEX daemons, get every
/// GPU of the node by design), or exempts the pod. A pod no policy governs is judged by the
/// built-in `driverClaims`, so that a driver's own namespace left out of every policy does
/// not mark its nodes.
pub fn claims_exemption(
    policy: Option<&GpuPolicy>,
    namespace: &str,
    service_account: &str,
) -> Option<String> {
    let Some(policy) = policy else {
        return (gpuwarden_crds::DriverClaims::default().namespaces.iter())
            .any(|n| n == namespace)
            .then(|| {
                format!("built-in driverClaims: namespace {namespace} runs DRA drivers' own pods")
            });
    };
    let name = policy.name_any();
    if (policy.spec.driver_claims.namespaces.iter()).any(|n| n == namespace) {
        return Some(format!(
            "GpuPolicy {name}: namespace {namespace} runs DRA drivers' own pods (driverClaims.namespaces)"
        ));
    }
    (policy.spec.exemptions)
        .pod_exemption(namespace, service_account)
        .map(|why| format!("GpuPolicy {name}: {why}"))
}

/// Lookups over the pods on the node, built once per sweep.
#[derive(Debug, Default)]
pub struct PodIndex<'a> {
    pods: &'a [PodInfo],
    by_uid: HashMap<&'a str, &'a PodInfo>,
    by_name: HashMap<(&'a str, &'a str), &'a PodInfo>,
    by_container_id: HashMap<&'a str, (&'a PodInfo, &'a str)>,
    /// Whether the pods come from the API (a miss means "not a pod we know") rather than
    /// being absent (`inspect` without a cluster).
    authoritative: bool,
}

impl<'a> PodIndex<'a> {
    /// An index over `pods`; `authoritative` when they are the node's full pod list.
    pub fn new(pods: &'a [PodInfo], authoritative: bool) -> Self {
        let mut index = Self {
            pods,
            authoritative,
            ..Default::default()
        };
        for pod in pods {
            index.by_uid.insert(pod.uid.as_str(), pod);
            if let Some(m) = &pod.mirror_uid {
                index.by_uid.insert(m.as_str(), pod);
            }
            index
                .by_name
                .insert((pod.namespace.as_str(), pod.name.as_str()), pod);
            for c in &pod.containers {
                if let Some(id) = &c.container_id {
                    index
                        .by_container_id
                        .insert(strip_runtime_scheme(id), (pod, c.name.as_str()));
                }
            }
        }
        index
    }

    /// Every pod.
    pub fn all(&self) -> &'a [PodInfo] {
        self.pods
    }

    /// Whether a miss means the pod does not exist.
    pub fn authoritative(&self) -> bool {
        self.authoritative
    }

    /// A pod by its UID (or a static pod's config UID).
    pub fn by_uid(&self, uid: &str) -> Option<&'a PodInfo> {
        self.by_uid.get(uid).copied()
    }

    /// A pod by namespace and name.
    pub fn by_name(&self, namespace: &str, name: &str) -> Option<&'a PodInfo> {
        self.by_name.get(&(namespace, name)).copied()
    }

    /// A container by its runtime id (without scheme): the pod and the container name.
    pub fn by_container_id(&self, id: &str) -> Option<(&'a PodInfo, &'a str)> {
        self.by_container_id.get(id).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

    fn pod(json: serde_json::Value) -> Pod {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn reads_containers_ids_and_privileged_gpu() {
        let p = pod(serde_json::json!({
            "metadata": {"name": "train", "namespace": "ml", "uid": "u1",
                         "annotations": {"kubernetes.io/config.mirror": "abc"}},
            "spec": {
                "containers": [
                    {"name": "main", "securityContext": {"privileged": true},
                     "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]},
                    {"name": "sidecar", "securityContext": {"privileged": true},
                     "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]},
                    {"name": "limited", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
                    {"name": "devmount", "volumeMounts": [{"name": "dev", "mountPath": "/dev"}]}
                ],
                "volumes": [{"name": "dev", "hostPath": {"path": "/dev"}}],
                "ephemeralContainers": [
                    {"name": "debugger", "securityContext": {"privileged": true},
                     "volumeMounts": [{"name": "dev", "mountPath": "/host-dev"}]}
                ]
            },
            "status": {"phase": "Running", "containerStatuses": [
                {"name": "main", "containerID": "containerd://aaa", "image": "", "imageID": "",
                 "ready": true, "restartCount": 0}
            ]}
        }));
        let info = PodInfo::from_pod(&p, &[], None).unwrap();
        let by: HashMap<_, _> = info
            .containers
            .iter()
            .map(|c| (c.name.as_str(), c))
            .collect();
        assert!(by["main"].gpu && by["main"].privileged);
        assert_eq!(by["main"].container_id.as_deref(), Some("containerd://aaa"));
        assert!(!by["sidecar"].gpu);
        assert!(by["limited"].gpu && !by["limited"].privileged);
        assert!(by["devmount"].gpu);
        assert!(by["debugger"].gpu && by["debugger"].privileged);
        assert!(info.has_privileged_gpu_container());
        assert_eq!(info.mirror_uid.as_deref(), Some("abc"));

        let pods = vec![info];
        let idx = PodIndex::new(&pods, true);
        assert_eq!(idx.by_container_id("aaa").unwrap().1, "main");
        assert_eq!(idx.by_uid("abc").unwrap().name, "train");
        assert_eq!(idx.by_name("ml", "train").unwrap().uid, "u1");
    }

    #[test]
    fn gpu_signals_read_as_the_webhook_reads_them() {
        let p = pod(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ml", "uid": "u1"},
            "spec": {
                "containers": [
                    {"name": "fuse", "volumeMounts": [{"name": "fuse", "mountPath": "/dev/fuse"}]},
                    {"name": "dotted", "volumeMounts": [{"name": "dotted", "mountPath": "/dev/x"}]},
                    {"name": "upper-none", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": " NONE "}]},
                    {"name": "last-wins", "env": [
                        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}
                    ]},
                    {"name": "from-configmap", "env": [{"name": "NVIDIA_VISIBLE_DEVICES",
                        "valueFrom": {"configMapKeyRef": {"name": "gpus", "key": "devices"}}}]},
                    {"name": "mig", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}}
                ],
                "volumes": [
                    {"name": "fuse", "hostPath": {"path": "/dev/fuse"}},
                    {"name": "dotted", "hostPath": {"path": "/dev/./nvidia0/"}}
                ]
            }
        }));
        let info = PodInfo::from_pod(&p, &[], None).unwrap();
        let gpu: Vec<(&str, bool)> = info
            .containers
            .iter()
            .map(|c| (c.name.as_str(), c.gpu))
            .collect();
        assert_eq!(
            gpu,
            [
                ("fuse", false),
                ("dotted", true),
                ("upper-none", false),
                ("last-wins", false),
                ("from-configmap", true),
                ("mig", true),
            ]
        );
    }

    #[test]
    fn policy_exemptions_mark_privileged_gpu_pods() {
        let privileged_gpu =
            |ns: &str, sa: &str, image: &str| {
                PodInfo::from_pod(&pod(serde_json::json!({
                "metadata": {"name": "p", "namespace": ns, "uid": "u"},
                "spec": {"serviceAccountName": sa, "containers": [
                    {"name": "main", "image": image, "securityContext": {"privileged": true},
                     "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]},
                    {"name": "plain", "image": "busybox"}
                ]}
            })), &[], None)
            .unwrap()
            };
        // `team` governs the namespaces labelled team=ml, the default policy the others.
        let default = GpuPolicy::default_policy();
        let mut team = GpuPolicy::default_policy();
        team.metadata.name = Some("team".into());
        team.spec.priority = 10;
        team.spec.namespace_selector.match_labels =
            Some(BTreeMap::from([("team".into(), "ml".into())]));
        team.spec.exemptions.namespaces = vec![];
        team.spec.exemptions.containers = vec![];
        team.spec.exemptions.service_accounts = vec!["ml/render".into()];
        let policies = [Arc::new(default), Arc::new(team)];
        let team_ml = || Some(BTreeMap::from([("team".to_owned(), "ml".to_owned())]));

        let exempt_in = |p: PodInfo, labels| p.exempt_by(&policies, labels).exempt;
        let exempt = |p: PodInfo| exempt_in(p, None);
        assert_eq!(
            exempt(privileged_gpu("kube-system", "", "x")).as_deref(),
            Some("GpuPolicy default: namespace kube-system is exempt")
        );
        assert_eq!(
            exempt_in(privileged_gpu("ml", "render", "x"), team_ml()).as_deref(),
            Some("GpuPolicy team: service account ml/render is exempt"),
        );
        // Only the governing policy's exemptions count: `team` governs this namespace and
        // does not exempt the image the default policy exempts, and the default policy
        // does not exempt the service account `team` exempts.
        let dcgm = "nvcr.io/nvidia/k8s/dcgm-exporter:3.3.5-3.4.0-ubuntu22.04";
        assert_eq!(exempt_in(privileged_gpu("ml", "", dcgm), team_ml()), None);
        assert_eq!(exempt(privileged_gpu("ml", "render", "x")), None);
        assert_eq!(
            exempt(privileged_gpu("gpu-operator", "", dcgm)).as_deref(),
            Some(
                "GpuPolicy default: image nvcr.io/nvidia/k8s/dcgm-exporter:3.3.5-3.4.0-ubuntu22.04 is exempt in namespace gpu-operator"
            )
        );
        // The image is exempt only in the namespace the exemption names.
        assert_eq!(exempt(privileged_gpu("monitoring", "", dcgm)), None);
        assert_eq!(exempt(privileged_gpu("ml", "trainer", "pytorch:2")), None);
        // A pod no policy governs has no exemption, whatever another policy exempts.
        assert_eq!(
            privileged_gpu("gpu-operator", "", dcgm)
                .exempt_by(&policies[1..], None)
                .exempt,
            None
        );
        // A podSelector reads the pod's labels.
        let mut render = GpuPolicy::default_policy();
        render.metadata.name = Some("render".into());
        render.spec.priority = 20;
        render.spec.pod_selector = Some(LabelSelector {
            match_labels: Some(BTreeMap::from([("app".into(), "render".into())])),
            ..LabelSelector::default()
        });
        render.spec.exemptions.containers = vec![gpuwarden_crds::ContainerExemption {
            images: vec!["me/render:*".into()],
            namespaces: vec!["ml".into()],
            ..Default::default()
        }];
        let with_render = [policies[0].clone(), Arc::new(render)];
        let mut labelled = privileged_gpu("ml", "", "me/render:1");
        assert_eq!(labelled.clone().exempt_by(&with_render, None).exempt, None);
        labelled.labels.insert("app".into(), "render".into());
        assert_eq!(
            labelled.exempt_by(&with_render, None).exempt.as_deref(),
            Some("GpuPolicy render: image me/render:1 is exempt in namespace ml")
        );

        // An exempt image on one privileged GPU container does not cover another.
        let mixed = PodInfo::from_pod(
            &pod(serde_json::json!({
                "metadata": {"name": "p", "namespace": "gpu-operator", "uid": "u"},
                "spec": {"containers": [
                    {"name": "dcgm", "image": "nvcr.io/nvidia/k8s/dcgm-exporter:3",
                     "securityContext": {"privileged": true},
                     "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]},
                    {"name": "mine", "image": "me/tool:1", "securityContext": {"privileged": true},
                     "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}
                ]}
            })),
            &[],
            None,
        )
        .unwrap();
        assert_eq!(exempt(mixed), None);
        // Nothing to exempt in a pod without a privileged container.
        let plain = PodInfo::from_pod(
            &pod(serde_json::json!({
                "metadata": {"name": "p", "namespace": "gpu-operator", "uid": "u"},
                "spec": {"containers": [{"name": "c", "image": "busybox"}]}
            })),
            &[],
            None,
        )
        .unwrap();
        assert_eq!(exempt(plain), None);
        // A privileged container with no GPU signal (it may still be seen on a GPU).
        let hidden = PodInfo::from_pod(
            &pod(serde_json::json!({
                "metadata": {"name": "p", "namespace": "gpu-operator", "uid": "u"},
                "spec": {"containers": [{"name": "c", "image": "nvcr.io/nvidia/k8s/dcgm-exporter:3",
                                         "securityContext": {"privileged": true}}]}
            })),
            &[],
            None,
        )
        .unwrap();
        assert!(exempt(hidden).is_some());
    }

    #[test]
    fn finished_pods_are_left_out() {
        let p = pod(serde_json::json!({
            "metadata": {"name": "done", "namespace": "ml", "uid": "u2"},
            "spec": {"containers": [{"name": "c"}]},
            "status": {"phase": "Succeeded"}
        }));
        assert_eq!(PodInfo::from_pod(&p, &[], None), None);
    }

    #[test]
    fn requests_and_the_governing_policys_rules_count() {
        let p = pod(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ml", "uid": "u1"},
            "spec": {"containers": [
                {"name": "requested", "resources": {"requests": {"nvidia.com/gpu": "1"}}},
                {"name": "vendor", "resources": {"limits": {"example.com/accel": "1"}}},
                {"name": "plain", "securityContext": {"privileged": true}}
            ]}
        }));
        let gpu = |policies: &[Arc<GpuPolicy>]| -> Vec<bool> {
            let info = PodInfo::from_pod(&p, policies, None).unwrap();
            info.containers.iter().map(|c| c.gpu).collect()
        };
        assert_eq!(gpu(&[]), [true, false, false]);
        let mut policy = GpuPolicy::default_policy();
        policy.spec.gpu.resource_name = "example.com/accel".into();
        assert_eq!(gpu(&[Arc::new(policy.clone())]), [true, true, false]);
        policy.spec.match_.privileged_containers = gpuwarden_crds::PrivilegedMatch::All;
        assert_eq!(gpu(&[Arc::new(policy)]), [true, true, true]);
    }
}
