//! A borrowed, typed view of the parts of a pod the engine reads, and nothing else.
//!
//! Read straight from an AdmissionReview's bytes, the view borrows its strings from the body
//! and skips everything else (probes, affinity, commands, owner references) without building
//! it; read from a `serde_json::Value` (a manifest's pod template), it borrows from the value.
//!
//! Every field is lenient: a field of the wrong JSON type reads as absent, the way the engine
//! read `Value`s before (`as_str`, `as_bool`, `as_array`, `as_object`), and a list entry that
//! is not an object reads as an empty entry, so indices into the list stay right. Objects are
//! read as sorted maps in which the last of a repeated key wins, as `serde_json::Map` does.
//! A field named twice in one object is an error from bytes (the API server never writes
//! one); a `Value` cannot hold one.
//!
//! On the admission path serde reads these types in the same pass as the review around
//! them ([`crate::admission`]).

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

pub use gpuwarden_crds::gpu::ContainerKind;

/// A JSON object's string keys and their values, sorted by key; the last of a repeated key
/// wins, as in `serde_json::Map`. A sorted list rather than a tree: the maps a pod carries
/// (labels, annotations, resource quantities) hold a handful of entries each.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Map<'a>(Vec<(Cow<'a, str>, Scalar<'a>)>);

impl<'a> Map<'a> {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` to `value`, replacing an earlier value.
    pub fn insert(&mut self, key: Cow<'a, str>, value: Scalar<'a>) {
        // The API server writes maps sorted, so most keys go at the end.
        if self.0.last().is_none_or(|(last, _)| *last < key) {
            self.0.push((key, value));
            return;
        }
        match self
            .0
            .binary_search_by(|(k, _)| k.as_ref().cmp(key.as_ref()))
        {
            Ok(i) => self.0[i].1 = value,
            Err(i) => self.0.insert(i, (key, value)),
        }
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&Scalar<'a>> {
        self.0
            .binary_search_by(|(k, _)| k.as_ref().cmp(key))
            .ok()
            .map(|i| &self.0[i].1)
    }

    /// Whether `key` is set.
    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// The keys, sorted.
    pub fn keys(&self) -> impl Iterator<Item = &Cow<'a, str>> {
        self.0.iter().map(|(k, _)| k)
    }

    /// The entries, sorted by key.
    pub fn iter(&self) -> impl Iterator<Item = (&Cow<'a, str>, &Scalar<'a>)> + Clone {
        self.0.iter().map(|(k, v)| (k, v))
    }

    /// How many entries it holds.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A pod's labels: the string values (a label of another type selects nothing).
impl gpuwarden_crds::selector::Labels for Map<'_> {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Scalar::as_str)
    }
}

impl<'m, 'a> IntoIterator for &'m Map<'a> {
    type Item = (&'m Cow<'a, str>, &'m Scalar<'a>);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'m, (Cow<'a, str>, Scalar<'a>)>,
        fn(&'m (Cow<'a, str>, Scalar<'a>)) -> (&'m Cow<'a, str>, &'m Scalar<'a>),
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

/// A pod, or a pod template: `metadata` and `spec`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, bound(deserialize = "'de: 'a"))]
pub struct PodView<'a> {
    /// `metadata`, when it is an object.
    #[serde(deserialize_with = "object")]
    pub metadata: Option<Metadata<'a>>,
    /// `spec`, when it is an object.
    #[serde(deserialize_with = "object")]
    pub spec: Option<Spec<'a>>,
}

/// `metadata`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase", bound(deserialize = "'de: 'a"))]
pub struct Metadata<'a> {
    /// `name`.
    #[serde(deserialize_with = "text")]
    pub name: Option<Cow<'a, str>>,
    /// `generateName`.
    #[serde(deserialize_with = "text")]
    pub generate_name: Option<Cow<'a, str>>,
    /// `namespace`.
    #[serde(deserialize_with = "text")]
    pub namespace: Option<Cow<'a, str>>,
    /// `labels`, when an object.
    #[serde(deserialize_with = "map")]
    pub labels: Option<Map<'a>>,
    /// `annotations`, when an object.
    #[serde(deserialize_with = "map")]
    pub annotations: Option<Map<'a>>,
    /// `ownerReferences`, when a list.
    #[serde(deserialize_with = "list")]
    pub owner_references: Option<Vec<OwnerReference<'a>>>,
}

/// A `metadata.ownerReferences` entry: the engine asks which workload controls the pod.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase", bound(deserialize = "'de: 'a"))]
pub struct OwnerReference<'a> {
    /// `apiVersion`.
    #[serde(deserialize_with = "text")]
    pub api_version: Option<Cow<'a, str>>,
    /// `kind`.
    #[serde(deserialize_with = "text")]
    pub kind: Option<Cow<'a, str>>,
    /// `name`.
    #[serde(deserialize_with = "text")]
    pub name: Option<Cow<'a, str>>,
    /// `controller`, when a boolean.
    #[serde(deserialize_with = "boolean")]
    pub controller: Option<bool>,
}

/// `spec`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase", bound(deserialize = "'de: 'a"))]
pub struct Spec<'a> {
    /// `serviceAccountName`.
    #[serde(deserialize_with = "text")]
    pub service_account_name: Option<Cow<'a, str>>,
    /// `volumes`, when a list.
    #[serde(deserialize_with = "list")]
    pub volumes: Option<Vec<Volume<'a>>>,
    /// `containers`, when a list.
    #[serde(deserialize_with = "list")]
    pub containers: Option<Vec<Container<'a>>>,
    /// `initContainers`, when a list.
    #[serde(deserialize_with = "list")]
    pub init_containers: Option<Vec<Container<'a>>>,
    /// `ephemeralContainers`, when a list.
    #[serde(deserialize_with = "list")]
    pub ephemeral_containers: Option<Vec<Container<'a>>>,
    /// `runtimeClassName`.
    #[serde(deserialize_with = "text")]
    pub runtime_class_name: Option<Cow<'a, str>>,
    /// `schedulerName`.
    #[serde(deserialize_with = "text")]
    pub scheduler_name: Option<Cow<'a, str>>,
    /// `nodeName`: set at creation, the pod skips every scheduler.
    #[serde(deserialize_with = "text")]
    pub node_name: Option<Cow<'a, str>>,
    /// `nodeSelector`, when an object.
    #[serde(deserialize_with = "map")]
    pub node_selector: Option<Map<'a>>,
    /// `affinity`, when an object.
    #[serde(deserialize_with = "object")]
    pub affinity: Option<Affinity<'a>>,
    /// `tolerations`, when a list.
    #[serde(deserialize_with = "list")]
    pub tolerations: Option<Vec<Toleration<'a>>>,
    /// `hostNetwork`, when a boolean.
    #[serde(deserialize_with = "boolean")]
    pub host_network: Option<bool>,
    /// `hostPID`, when a boolean.
    #[serde(rename = "hostPID", deserialize_with = "boolean")]
    pub host_pid: Option<bool>,
    /// `hostIPC`, when a boolean.
    #[serde(rename = "hostIPC", deserialize_with = "boolean")]
    pub host_ipc: Option<bool>,
    /// `securityContext`, when an object.
    #[serde(deserialize_with = "object")]
    pub security_context: Option<PodSecurityContext>,
    /// `resourceClaims`, when a list.
    #[serde(deserialize_with = "list")]
    pub resource_claims: Option<Vec<PodResourceClaim<'a>>>,
}

/// A pod `resourceClaims` entry: a name the containers use, and the ResourceClaim or
/// ResourceClaimTemplate it stands for.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase", bound(deserialize = "'de: 'a"))]
pub struct PodResourceClaim<'a> {
    /// `name`.
    #[serde(deserialize_with = "text")]
    pub name: Option<Cow<'a, str>>,
    /// `resourceClaimName`.
    #[serde(deserialize_with = "text")]
    pub resource_claim_name: Option<Cow<'a, str>>,
    /// `resourceClaimTemplateName`.
    #[serde(deserialize_with = "text")]
    pub resource_claim_template_name: Option<Cow<'a, str>>,
}

/// A container `resources.claims` entry.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, bound(deserialize = "'de: 'a"))]
pub struct ClaimUse<'a> {
    /// `name`: the pod `resourceClaims` entry.
    #[serde(deserialize_with = "text")]
    pub name: Option<Cow<'a, str>>,
}

/// `affinity`: the engine reads its required node affinity.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase", bound(deserialize = "'de: 'a"))]
pub struct Affinity<'a> {
    /// `nodeAffinity`, when an object.
    #[serde(deserialize_with = "object")]
    pub node_affinity: Option<NodeAffinity<'a>>,
}

/// `affinity.nodeAffinity`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, bound(deserialize = "'de: 'a"))]
pub struct NodeAffinity<'a> {
    /// `requiredDuringSchedulingIgnoredDuringExecution`, when an object.
    #[serde(
        rename = "requiredDuringSchedulingIgnoredDuringExecution",
        deserialize_with = "object"
    )]
    pub required: Option<NodeSelector<'a>>,
}

/// A node selector: terms, any of which may hold.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase", bound(deserialize = "'de: 'a"))]
pub struct NodeSelector<'a> {
    /// `nodeSelectorTerms`, when a list.
    #[serde(deserialize_with = "list")]
    pub node_selector_terms: Option<Vec<NodeSelectorTerm<'a>>>,
}

/// One node selector term.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase", bound(deserialize = "'de: 'a"))]
pub struct NodeSelectorTerm<'a> {
    /// `matchExpressions`, when a list.
    #[serde(deserialize_with = "list")]
    pub match_expressions: Option<Vec<Requirement<'a>>>,
}

/// A node selector requirement: its key and operator.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, bound(deserialize = "'de: 'a"))]
pub struct Requirement<'a> {
    /// `key`.
    #[serde(deserialize_with = "text")]
    pub key: Option<Cow<'a, str>>,
    /// `operator`.
    #[serde(deserialize_with = "text")]
    pub operator: Option<Cow<'a, str>>,
}

/// A toleration: its key.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, bound(deserialize = "'de: 'a"))]
pub struct Toleration<'a> {
    /// `key`.
    #[serde(deserialize_with = "text")]
    pub key: Option<Cow<'a, str>>,
}

/// A pod volume: its name and host path.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase", bound(deserialize = "'de: 'a"))]
pub struct Volume<'a> {
    /// `name`.
    #[serde(deserialize_with = "text")]
    pub name: Option<Cow<'a, str>>,
    /// `hostPath`, when an object.
    #[serde(deserialize_with = "object")]
    pub host_path: Option<HostPath<'a>>,
}

/// `hostPath`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, bound(deserialize = "'de: 'a"))]
pub struct HostPath<'a> {
    /// `path`.
    #[serde(deserialize_with = "text")]
    pub path: Option<Cow<'a, str>>,
}

/// A container (regular, init or ephemeral).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase", bound(deserialize = "'de: 'a"))]
pub struct Container<'a> {
    /// `name`.
    #[serde(deserialize_with = "text")]
    pub name: Option<Cow<'a, str>>,
    /// `image`.
    #[serde(deserialize_with = "text")]
    pub image: Option<Cow<'a, str>>,
    /// The strings in `command` (other entries skipped): read for what it does at start.
    #[serde(deserialize_with = "texts")]
    pub command: Vec<Cow<'a, str>>,
    /// The strings in `args`.
    #[serde(deserialize_with = "texts")]
    pub args: Vec<Cow<'a, str>>,
    /// `env`, when a list.
    #[serde(deserialize_with = "list")]
    pub env: Option<Vec<EnvVar<'a>>>,
    /// `resources`, when an object.
    #[serde(deserialize_with = "object")]
    pub resources: Option<Resources<'a>>,
    /// `securityContext`, when an object.
    #[serde(deserialize_with = "object")]
    pub security_context: Option<SecurityContext<'a>>,
    /// `volumeMounts`, when a list.
    #[serde(deserialize_with = "list")]
    pub volume_mounts: Option<Vec<VolumeMount<'a>>>,
    /// `envFrom`, when a list: only each entry's `prefix` is read (what it reads is a
    /// ConfigMap or Secret admission cannot see).
    #[serde(deserialize_with = "list")]
    pub env_from: Option<Vec<EnvFromSource<'a>>>,
    /// `restartPolicy` (`Always` makes an init container a sidecar).
    #[serde(deserialize_with = "text")]
    pub restart_policy: Option<Cow<'a, str>>,
}

/// An `envFrom` entry.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, bound(deserialize = "'de: 'a"))]
pub struct EnvFromSource<'a> {
    /// `prefix`.
    #[serde(deserialize_with = "text")]
    pub prefix: Option<Cow<'a, str>>,
}

/// An `env` entry.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase", bound(deserialize = "'de: 'a"))]
pub struct EnvVar<'a> {
    /// `name`.
    #[serde(deserialize_with = "text")]
    pub name: Option<Cow<'a, str>>,
    /// `value`.
    #[serde(deserialize_with = "text")]
    pub value: Option<Cow<'a, str>>,
    /// `valueFrom` when set (present and not `null`): of its content only a ConfigMap key
    /// reference is read (a GPU-sharing scheduler's grant); anything else reads as set.
    #[serde(rename = "valueFrom", deserialize_with = "value_from")]
    pub value_from: Option<ValueFrom<'a>>,
}

/// An `env` entry's `valueFrom`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase", bound(deserialize = "'de: 'a"))]
pub struct ValueFrom<'a> {
    /// `configMapKeyRef`, when an object.
    #[serde(deserialize_with = "object")]
    pub config_map_key_ref: Option<KeyRef<'a>>,
}

/// A `configMapKeyRef`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, bound(deserialize = "'de: 'a"))]
pub struct KeyRef<'a> {
    /// `name`.
    #[serde(deserialize_with = "text")]
    pub name: Option<Cow<'a, str>>,
    /// `key`.
    #[serde(deserialize_with = "text")]
    pub key: Option<Cow<'a, str>>,
    /// `optional`, when a boolean.
    #[serde(deserialize_with = "boolean")]
    pub optional: Option<bool>,
}

/// `resources`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, bound(deserialize = "'de: 'a"))]
pub struct Resources<'a> {
    /// `limits`, when an object.
    #[serde(deserialize_with = "map")]
    pub limits: Option<Map<'a>>,
    /// `requests`, when an object.
    #[serde(deserialize_with = "map")]
    pub requests: Option<Map<'a>>,
    /// `claims`, when a list.
    #[serde(deserialize_with = "list")]
    pub claims: Option<Vec<ClaimUse<'a>>>,
}

/// `securityContext`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, bound(deserialize = "'de: 'a"))]
pub struct SecurityContext<'a> {
    /// `privileged`, when a boolean.
    #[serde(deserialize_with = "boolean")]
    pub privileged: Option<bool>,
    /// `capabilities`, when an object.
    #[serde(deserialize_with = "object")]
    pub capabilities: Option<Capabilities<'a>>,
    /// `runAsNonRoot`, when a boolean.
    #[serde(rename = "runAsNonRoot", deserialize_with = "boolean")]
    pub run_as_non_root: Option<bool>,
    /// `allowPrivilegeEscalation`, when a boolean.
    #[serde(rename = "allowPrivilegeEscalation", deserialize_with = "boolean")]
    pub allow_privilege_escalation: Option<bool>,
    /// Whether `seccompProfile` is set.
    #[serde(rename = "seccompProfile", deserialize_with = "set")]
    pub seccomp_profile: bool,
}

/// The pod's `securityContext`: what Pod Security Admission reads of it.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct PodSecurityContext {
    /// `runAsNonRoot`, when a boolean.
    #[serde(deserialize_with = "boolean")]
    pub run_as_non_root: Option<bool>,
    /// Whether `seccompProfile` is set.
    #[serde(deserialize_with = "set")]
    pub seccomp_profile: bool,
}

/// `securityContext.capabilities`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, bound(deserialize = "'de: 'a"))]
pub struct Capabilities<'a> {
    /// The strings in `add` (other entries skipped).
    #[serde(deserialize_with = "texts")]
    pub add: Vec<Cow<'a, str>>,
    /// `drop` as written, `null` included: a rewrite that keeps it copies it.
    #[serde(deserialize_with = "present")]
    pub drop: Option<Value>,
}

/// A volume mount: the engine reads its volume name and where it is mounted.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, rename_all = "camelCase", bound(deserialize = "'de: 'a"))]
pub struct VolumeMount<'a> {
    /// `name`.
    #[serde(deserialize_with = "text")]
    pub name: Option<Cow<'a, str>>,
    /// `mountPath`.
    #[serde(deserialize_with = "text")]
    pub mount_path: Option<Cow<'a, str>>,
}

impl Container<'_> {
    /// Whether `securityContext.privileged` is `true`.
    pub fn is_privileged(&self) -> bool {
        self.security_context.as_ref().and_then(|s| s.privileged) == Some(true)
    }
}

/// The GPU predicate reads the view directly.
impl gpuwarden_crds::gpu::ContainerSpec for Container<'_> {
    fn name(&self) -> &str {
        self.name.as_deref().unwrap_or("")
    }
    fn image(&self) -> &str {
        self.image.as_deref().unwrap_or("")
    }
    fn privileged(&self) -> bool {
        self.is_privileged()
    }
    fn limit_names(&self) -> impl Iterator<Item = &str> {
        let limits = self.resources.as_ref().and_then(|r| r.limits.as_ref());
        limits.into_iter().flat_map(|l| l.keys()).map(AsRef::as_ref)
    }
    fn request_names(&self) -> impl Iterator<Item = &str> {
        let requests = self.resources.as_ref().and_then(|r| r.requests.as_ref());
        requests
            .into_iter()
            .flat_map(|r| r.keys())
            .map(AsRef::as_ref)
    }
    fn env_entries(&self) -> impl Iterator<Item = gpuwarden_crds::gpu::EnvEntry<'_>> {
        self.env
            .iter()
            .flatten()
            .map(|e| gpuwarden_crds::gpu::EnvEntry {
                name: e.name.as_deref().unwrap_or(""),
                value: e.value.as_deref(),
                value_from: e.value_from.is_some(),
            })
    }
    fn env_from(&self) -> bool {
        self.env_from.as_ref().is_some_and(|e| !e.is_empty())
    }
    fn env_from_prefixes(&self) -> impl Iterator<Item = &str> {
        (self.env_from.iter().flatten()).map(|e| e.prefix.as_deref().unwrap_or(""))
    }
    fn mounts(&self) -> impl Iterator<Item = (&str, &str)> {
        (self.volume_mounts.iter().flatten()).map(|m| {
            let name = m.name.as_deref().unwrap_or("");
            (name, m.mount_path.as_deref().unwrap_or(""))
        })
    }
    fn claim_names(&self) -> impl Iterator<Item = &str> {
        let claims = self.resources.as_ref().and_then(|r| r.claims.as_ref());
        (claims.into_iter().flatten()).filter_map(|c| c.name.as_deref())
    }
}

/// A value in a map the engine reads (labels, annotations, resource quantities): a string,
/// or whatever else was written there.
#[derive(Clone, Debug, PartialEq)]
pub enum Scalar<'a> {
    /// A string.
    Str(Cow<'a, str>),
    /// Anything else, as written.
    Other(Value),
}

impl Scalar<'_> {
    /// The string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::Str(s) => Some(s),
            Self::Other(_) => None,
        }
    }

    /// The string as it is, anything else as JSON (how a quantity is copied into a limit).
    pub fn to_text(&self) -> String {
        match self {
            Self::Str(s) => s.to_string(),
            Self::Other(v) => v.to_string(),
        }
    }
}

/// As JSON: a string is quoted, as in messages that quote a bad value.
impl fmt::Display for Scalar<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Str(s) => write!(f, "{}", Value::String(s.to_string())),
            Self::Other(v) => write!(f, "{v}"),
        }
    }
}

impl<'a> PodView<'a> {
    /// The view of a pod held as a `Value`, borrowing its strings. Anything that is not an
    /// object gives an empty view.
    pub fn from_value(pod: &'a Value) -> Self {
        // Reading a Value cannot fail: it has no repeated keys and every field is lenient.
        object(pod).ok().flatten().unwrap_or_default()
    }

    /// The containers of one kind (empty when absent).
    pub fn containers(&self, kind: ContainerKind) -> &[Container<'a>] {
        let Some(spec) = &self.spec else {
            return &[];
        };
        let list = match kind {
            ContainerKind::Init => &spec.init_containers,
            ContainerKind::Regular => &spec.containers,
            ContainerKind::Ephemeral => &spec.ephemeral_containers,
        };
        list.as_deref().unwrap_or_default()
    }

    /// `spec.volumes` (empty when absent).
    pub fn volumes(&self) -> &[Volume<'a>] {
        self.spec
            .as_ref()
            .and_then(|s| s.volumes.as_deref())
            .unwrap_or_default()
    }

    /// `spec.resourceClaims`, when a list.
    pub fn resource_claims(&self) -> &[PodResourceClaim<'a>] {
        self.spec
            .as_ref()
            .and_then(|s| s.resource_claims.as_deref())
            .unwrap_or_default()
    }

    /// `metadata.annotations`, when an object.
    pub fn annotations(&self) -> Option<&Map<'a>> {
        self.metadata.as_ref()?.annotations.as_ref()
    }

    /// The `metadata.ownerReferences` entry of the pod's controller (`controller: true`).
    pub fn controller(&self) -> Option<&OwnerReference<'a>> {
        (self.metadata.as_ref()?.owner_references.as_deref()?)
            .iter()
            .find(|r| r.controller == Some(true))
    }
}

// ---------------------------------------------------------------------------------------
// Lenient readers. Each reads one JSON value and keeps it only when it has the expected
// type; anything else is skipped and reads as `None`.

/// What one field keeps of each JSON type.
trait Reader<'de>: Sized {
    type Out;
    fn string(self, _s: Cow<'de, str>) -> Option<Self::Out> {
        None
    }
    fn boolean(self, _b: bool) -> Option<Self::Out> {
        None
    }
    /// Numbers and `null`.
    fn other(self, _v: Value) -> Option<Self::Out> {
        None
    }
    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<Self::Out>, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(None)
    }
    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<Self::Out>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(None)
    }
}

struct Lenient<R>(R);

impl<'de, R: Reader<'de>> Visitor<'de> for Lenient<R> {
    type Value = Option<R::Out>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(self.0.string(Cow::Borrowed(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(self.0.string(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(self.0.string(Cow::Owned(v)))
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Ok(self.0.boolean(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok(self.0.other(Value::from(v)))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(self.0.other(Value::from(v)))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Ok(self.0.other(Value::from(v)))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(self.0.other(Value::Null))
    }
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(self.0.other(Value::Null))
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        self.0.map(map)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        self.0.seq(seq)
    }
}

fn read<'de, D: Deserializer<'de>, R: Reader<'de>>(
    d: D,
    reader: R,
) -> Result<Option<R::Out>, D::Error> {
    d.deserialize_any(Lenient(reader))
}

struct TextReader;
impl<'de> Reader<'de> for TextReader {
    type Out = Cow<'de, str>;
    fn string(self, s: Cow<'de, str>) -> Option<Self::Out> {
        Some(s)
    }
}

struct BoolReader;
impl<'de> Reader<'de> for BoolReader {
    type Out = bool;
    fn boolean(self, b: bool) -> Option<bool> {
        Some(b)
    }
}

/// An object read as `T` (a derived struct: unknown fields skipped).
struct ObjectReader<T>(PhantomData<T>);
impl<'de, T: Deserialize<'de>> Reader<'de> for ObjectReader<T> {
    type Out = T;
    fn map<A: MapAccess<'de>>(self, map: A) -> Result<Option<T>, A::Error> {
        T::deserialize(MapAccessDeserializer::new(map)).map(Some)
    }
}

/// A list of `T`, each entry read by [`Wrapped<T>`].
struct ListReader<T>(PhantomData<T>);
impl<'de, T> Reader<'de> for ListReader<T>
where
    Wrapped<T>: Deserialize<'de>,
{
    type Out = Vec<T>;
    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<Vec<T>>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(Wrapped(item)) = seq.next_element()? {
            out.push(item);
        }
        Ok(Some(out))
    }
}

/// An object read as a [`Map`]: the last of a repeated key wins.
struct MapReader;
impl<'de> Reader<'de> for MapReader {
    type Out = Map<'de>;
    fn map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<Map<'de>>, A::Error> {
        let mut out = Map::new();
        while let Some(Str(key)) = map.next_key()? {
            out.insert(key, map.next_value()?);
        }
        Ok(Some(out))
    }
}

/// Any value, kept as a [`Scalar`].
struct ScalarReader;
impl<'de> Reader<'de> for ScalarReader {
    type Out = Scalar<'de>;
    fn string(self, s: Cow<'de, str>) -> Option<Self::Out> {
        Some(Scalar::Str(s))
    }
    fn boolean(self, b: bool) -> Option<Self::Out> {
        Some(Scalar::Other(Value::Bool(b)))
    }
    fn other(self, v: Value) -> Option<Self::Out> {
        Some(Scalar::Other(v))
    }
    fn map<A: MapAccess<'de>>(self, map: A) -> Result<Option<Self::Out>, A::Error> {
        Value::deserialize(MapAccessDeserializer::new(map)).map(|v| Some(Scalar::Other(v)))
    }
    fn seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Option<Self::Out>, A::Error> {
        Value::deserialize(SeqAccessDeserializer::new(seq)).map(|v| Some(Scalar::Other(v)))
    }
}

/// A string (an object key, or a field of the review), borrowed when it has no escapes; any
/// other type is an error.
pub(crate) struct Str<'a>(pub(crate) Cow<'a, str>);
impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Cow<'de, str>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Cow::Borrowed(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v))
            }
        }
        d.deserialize_str(KeyVisitor).map(Str)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Scalar<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // ScalarReader keeps every JSON type.
        read(d, ScalarReader).map(|s| s.unwrap_or(Scalar::Other(Value::Null)))
    }
}

/// List entries: an object is read as the entry, anything else as an empty entry, so that
/// an index still names the same entry in the pod.
macro_rules! lenient_entry {
    ($($entry:ident),*) => {$(
        impl<'de: 'a, 'a> Deserialize<'de> for Wrapped<$entry<'a>> {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                read(d, ObjectReader::<$entry<'a>>(PhantomData)).map(|e| Wrapped(e.unwrap_or_default()))
            }
        }
    )*};
}

/// A list entry, read leniently.
struct Wrapped<T>(T);
lenient_entry!(
    EnvFromSource,
    Volume,
    OwnerReference,
    Container,
    EnvVar,
    VolumeMount,
    NodeSelectorTerm,
    Requirement,
    Toleration,
    PodResourceClaim,
    ClaimUse
);

/// A field holding a pod: its view when it is a JSON object, `None` otherwise.
pub fn pod_object<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PodView<'de>>, D::Error> {
    object(d)
}

fn object<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    read(d, ObjectReader(PhantomData))
}

fn text<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Cow<'de, str>>, D::Error> {
    read(d, TextReader)
}

fn boolean<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    read(d, BoolReader)
}

fn map<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Map<'de>>, D::Error> {
    read(d, MapReader)
}

fn list<'de, D: Deserializer<'de>, T>(d: D) -> Result<Option<Vec<T>>, D::Error>
where
    Wrapped<T>: Deserialize<'de>,
{
    read(d, ListReader(PhantomData))
}

/// A string list entry: other entries read as `None`.
impl<'de: 'a, 'a> Deserialize<'de> for Wrapped<Option<Cow<'a, str>>> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        read(d, TextReader).map(Wrapped)
    }
}

/// The strings of a list; other entries are skipped.
fn texts<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Cow<'de, str>>, D::Error> {
    Ok(read(d, TextsReader)?.unwrap_or_default())
}

/// A list's strings, read into one vector as they come (each entry as [`TextReader`] reads
/// it, others skipped).
struct TextsReader;
impl<'de> Reader<'de> for TextsReader {
    type Out = Vec<Cow<'de, str>>;
    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<Self::Out>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(Wrapped(text)) = seq.next_element::<Wrapped<Option<Cow<'de, str>>>>()? {
            out.extend(text);
        }
        Ok(Some(out))
    }
}

/// `valueFrom`: an object is read, any other value but `null` reads as set with nothing in it.
fn value_from<'de, D: Deserializer<'de>>(d: D) -> Result<Option<ValueFrom<'de>>, D::Error> {
    read(d, ValueFromReader)
}

struct ValueFromReader;
impl<'de> Reader<'de> for ValueFromReader {
    type Out = ValueFrom<'de>;
    fn string(self, _s: Cow<'de, str>) -> Option<Self::Out> {
        Some(ValueFrom::default())
    }
    fn boolean(self, _b: bool) -> Option<Self::Out> {
        Some(ValueFrom::default())
    }
    fn other(self, v: Value) -> Option<Self::Out> {
        (!v.is_null()).then(ValueFrom::default)
    }
    fn map<A: MapAccess<'de>>(self, map: A) -> Result<Option<Self::Out>, A::Error> {
        ValueFrom::deserialize(MapAccessDeserializer::new(map)).map(Some)
    }
    fn seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Option<Self::Out>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Some(ValueFrom::default()))
    }
}

/// Whether the field is set: present and not `null`.
fn set<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<IgnoredAny>::deserialize(d)?.is_some())
}

/// Whether the field is a list with at least one entry; anything else is no list, and the
/// entries are skipped unread.
/// The field as written, `null` included.
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn from_bytes(text: &str) -> Result<PodView<'_>, serde_json::Error> {
        let mut de = serde_json::Deserializer::from_str(text);
        pod_object(&mut de).map(Option::unwrap_or_default)
    }

    #[test]
    fn a_map_keeps_its_keys_sorted_and_the_last_of_a_repeated_key() {
        // Against a BTreeMap fed the same entries: keys in order, out of order and repeated.
        let mut state: u64 = 0x2545_f491_4f6c_dd1d;
        for round in 0..500 {
            let mut map = Map::new();
            let mut tree = std::collections::BTreeMap::new();
            for i in 0..(round % 12) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let key = ["a", "b", "c", "d", "e", "ab", ""][(state % 7) as usize];
                let value = Scalar::Str(format!("{round}-{i}").into());
                map.insert(Cow::Borrowed(key), value.clone());
                tree.insert(key, value);
            }
            let entries: Vec<(&str, &Scalar<'_>)> =
                map.iter().map(|(k, v)| (k.as_ref(), v)).collect();
            let expected: Vec<(&str, &Scalar<'_>)> = tree.iter().map(|(k, v)| (*k, v)).collect();
            assert_eq!(entries, expected);
            for key in ["a", "b", "ab", "", "z"] {
                assert_eq!(map.get(key), tree.get(key), "{key:?}");
            }
            assert_eq!(map.len(), tree.len());
        }
    }

    #[test]
    fn strings_are_borrowed_unless_escaped() {
        let text = r#"{"metadata": {"name": "plain", "namespace": "tab\tbed"}}"#;
        let pod = from_bytes(text).unwrap();
        let meta = pod.metadata.unwrap();
        assert!(matches!(meta.name, Some(Cow::Borrowed("plain"))));
        assert!(matches!(meta.namespace, Some(Cow::Owned(ref s)) if s == "tab\tbed"));
    }

    #[test]
    fn wrong_types_read_as_absent_and_entries_keep_their_index() {
        let pod = json!({
            "metadata": {"name": 7, "labels": {"a": "1", "b": 2}, "annotations": "x"},
            "spec": {
                "serviceAccountName": ["sa"],
                "volumes": {"name": "v"},
                "containers": [
                    "not a container",
                    {
                        "name": "c",
                        "env": [null, {"name": "A", "value": 1, "valueFrom": null},
                                {"name": "B", "valueFrom": {"fieldRef": {}}}],
                        "resources": {"limits": [], "requests": {"nvidia.com/gpu": 2}},
                        "securityContext": {"privileged": "true",
                                            "capabilities": {"add": ["A", 3, "B"], "drop": null}},
                        "volumeMounts": "m"
                    }
                ],
                "initContainers": 5
            }
        });
        let text = pod.to_string();
        for view in [PodView::from_value(&pod), from_bytes(&text).unwrap()] {
            let meta = view.metadata.as_ref().unwrap();
            assert_eq!(meta.name, None);
            let labels = meta.labels.as_ref().unwrap();
            assert_eq!(labels.get("a").and_then(Scalar::as_str), Some("1"));
            assert_eq!(labels.get("b"), Some(&Scalar::Other(json!(2))));
            assert_eq!(meta.annotations, None);
            let spec = view.spec.as_ref().unwrap();
            assert_eq!(spec.service_account_name, None);
            assert_eq!(spec.volumes, None);
            assert_eq!(spec.init_containers, None);
            let containers = view.containers(ContainerKind::Regular);
            assert_eq!(containers.len(), 2);
            assert_eq!(containers[0], Container::default());
            let c = &containers[1];
            let env = c.env.as_ref().unwrap();
            assert_eq!(env.len(), 3);
            assert_eq!(env[0], EnvVar::default());
            assert_eq!((env[1].value.as_deref(), &env[1].value_from), (None, &None));
            assert_eq!(env[2].value_from, Some(ValueFrom::default()));
            let resources = c.resources.as_ref().unwrap();
            assert_eq!(resources.limits, None);
            assert_eq!(
                resources
                    .requests
                    .as_ref()
                    .unwrap()
                    .get("nvidia.com/gpu")
                    .unwrap()
                    .to_text(),
                "2"
            );
            let security = c.security_context.as_ref().unwrap();
            assert_eq!(security.privileged, None);
            let caps = security.capabilities.as_ref().unwrap();
            assert_eq!(caps.add, ["A", "B"]);
            assert_eq!(caps.drop, Some(Value::Null));
            assert_eq!(c.volume_mounts, None);
        }
    }

    #[test]
    fn a_repeated_map_key_keeps_its_last_value() {
        let text = r#"{"metadata": {"annotations": {"k": "1", "j": "x", "k": "2"}}}"#;
        let pod = from_bytes(text).unwrap();
        let annotations = pod.annotations().unwrap();
        assert_eq!(annotations.len(), 2);
        assert_eq!(annotations.get("k").and_then(Scalar::as_str), Some("2"));
        let value: Value = serde_json::from_str(text).unwrap();
        assert_eq!(PodView::from_value(&value), pod);
    }

    #[test]
    fn a_repeated_field_is_an_error_from_bytes() {
        // The admission adapter then reads the body as a Value, where the last one wins.
        assert!(from_bytes(r#"{"spec": {"containers": [], "containers": []}}"#).is_err());
        assert!(from_bytes(r#"{"metadata": {"name": "a", "name": "b"}}"#).is_err());
    }

    #[test]
    fn scalars_display_as_json() {
        assert_eq!(Scalar::Str("two".into()).to_string(), "\"two\"");
        assert_eq!(Scalar::Other(json!(2)).to_string(), "2");
        assert_eq!(Scalar::Str("two".into()).to_text(), "two");
        assert_eq!(Scalar::Other(json!(1.5)).to_text(), "1.5");
    }
}
