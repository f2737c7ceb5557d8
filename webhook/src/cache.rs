//! Where the server reads policies and namespace labels: reflector caches of `GpuPolicy`
//! and `Namespace` in a cluster (and of DRA ResourceClaims and ResourceClaimTemplates where
//! the cluster serves `resource.k8s.io/v1`), or a fixed set of policies from a file outside
//! one.
//!
//! Either way a review never calls the API server: it reads memory. Readiness is a
//! [`SyncFlag`] the source raises once its caches hold a complete list, so the server can be
//! tested with any [`PolicySource`] and a flag the test flips.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::StreamExt;
use gpuwarden_crds::{GpuPolicy, validation};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};

use crate::admission::{PolicyReader, PolicySource};
use crate::engine::{ClaimLookup, ClaimSource, Claims};
use crate::metrics::Metrics;
use crate::shutdown::Shutdown;

/// Errors building a policy source.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The policy file could not be read.
    #[error("failed to read policy file {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The policy file is not YAML.
    #[error("policy file {} is not valid YAML", path.display())]
    Yaml {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<serde_saphyr::Error>,
    },
    /// A document is not a usable `GpuPolicy`.
    #[error("policy file {} document {index}: {reason}", path.display())]
    Document {
        /// The file.
        path: PathBuf,
        /// Zero-based index among the file's non-empty documents.
        index: usize,
        /// Why.
        reason: String,
    },
    /// A policy has a problem the operator would report as `Ready=False`: served, it would
    /// govern pods by rules nobody meant, so the webhook refuses to start on it.
    #[error("policy file {} policy {name}: {reason}: {message}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The policy's name.
        name: String,
        /// The `Ready` reason.
        reason: &'static str,
        /// What is wrong and where.
        message: String,
    },
    /// The file holds no policy.
    #[error("policy file {} holds no GpuPolicy", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
}

/// Raised once a policy source holds complete data; `/readyz` reads it. Clones share state.
#[derive(Clone, Debug, Default)]
pub struct SyncFlag(Arc<AtomicBool>);

impl SyncFlag {
    /// A lowered flag.
    pub fn new() -> Self {
        Self::default()
    }

    /// A raised flag, for sources that are complete from the start.
    pub fn raised() -> Self {
        let flag = Self::new();
        flag.set(true);
        flag
    }

    /// Raises or lowers the flag.
    pub fn set(&self, synced: bool) {
        self.0.store(synced, Ordering::Release);
    }

    /// Whether the flag is raised.
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Fixed policies, for running outside a cluster (`serve --policy-file`) and for tests.
///
/// It knows no namespaces, so it answers every namespace with the one label the API server
/// always sets, `kubernetes.io/metadata.name=<name>`: selectors on it work as in a cluster.
#[derive(Clone, Debug)]
pub struct StaticPolicySource {
    policies: Vec<Arc<GpuPolicy>>,
}

impl StaticPolicySource {
    /// A source serving `policies`.
    pub fn new(policies: Vec<GpuPolicy>) -> Self {
        Self {
            policies: policies.into_iter().map(Arc::new).collect(),
        }
    }

    /// Reads one or more `GpuPolicy` documents from a YAML or JSON file.
    pub fn from_file(path: &Path) -> Result<Self, CacheError> {
        let text = std::fs::read_to_string(path).map_err(|source| CacheError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Self::new(parse_policies(&text, path)?))
    }
}

/// Parses the `GpuPolicy` documents of a multi-document YAML (or JSON) text.
pub fn parse_policies(text: &str, path: &Path) -> Result<Vec<GpuPolicy>, CacheError> {
    let documents: Vec<serde_json::Value> =
        serde_saphyr::from_multiple(text).map_err(|source| CacheError::Yaml {
            path: path.to_path_buf(),
            source: Box::new(source),
        })?;
    let mut policies = Vec::with_capacity(documents.len());
    for (index, document) in documents.into_iter().enumerate() {
        let error = |reason: String| CacheError::Document {
            path: path.to_path_buf(),
            index,
            reason,
        };
        let kind = document.get("kind").and_then(|k| k.as_str()).unwrap_or("");
        if kind != "GpuPolicy" {
            return Err(error(format!("kind is {kind:?}, expected \"GpuPolicy\"")));
        }
        let policy: GpuPolicy = serde_json::from_value(document)
            .map_err(|e| error(format!("not a valid GpuPolicy: {e}")))?;
        if policy.metadata.name.as_deref().unwrap_or("").is_empty() {
            return Err(error("metadata.name is missing".into()));
        }
        policies.push(policy);
    }
    if policies.is_empty() {
        return Err(CacheError::Empty {
            path: path.to_path_buf(),
        });
    }
    let all: Vec<&GpuPolicy> = policies.iter().collect();
    if let Some((at, problem)) = validation::first_problem(&all) {
        return Err(CacheError::Invalid {
            path: path.to_path_buf(),
            name: all[at].metadata.name.clone().unwrap_or_default(),
            reason: problem.reason,
            message: problem.message,
        });
    }
    Ok(policies)
}

impl PolicySource for StaticPolicySource {
    fn policies(&self) -> Vec<Arc<GpuPolicy>> {
        self.policies.clone()
    }

    fn namespace_labels(&self, name: &str) -> Option<BTreeMap<String, String>> {
        Some(BTreeMap::from([(
            gpuwarden_crds::LABEL_NAMESPACE_NAME.to_owned(),
            name.to_owned(),
        )]))
    }

    fn lend(&self, _: &str, read: &mut PolicyReader<'_>) {
        // The name label is all it knows of a namespace, and the engine adds that itself.
        read(&self.policies, None);
    }
}

/// Reflector caches of every `GpuPolicy`, of every Namespace's metadata and, where the
/// cluster serves DRA, of every ResourceClaim and ResourceClaimTemplate.
#[derive(Clone)]
pub struct ReflectorCache {
    policies: Store<GpuPolicy>,
    namespaces: Store<PartialObjectMeta<Namespace>>,
    /// Set once discovery has said whether `resource.k8s.io/v1` is served.
    claims: Arc<OnceLock<ClaimCaches>>,
}

/// The DRA caches, when the API is served.
enum ClaimCaches {
    /// `resource.k8s.io/v1` is not served: no claim can be read.
    NotServed,
    /// Watched; `synced` is raised once both hold a complete list.
    Watched {
        claims: Store<ResourceClaim>,
        templates: Store<ResourceClaimTemplate>,
        synced: SyncFlag,
    },
}

impl std::fmt::Debug for ReflectorCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let claims = match self.claims.get() {
            None => "not discovered".to_owned(),
            Some(ClaimCaches::NotServed) => "not served".to_owned(),
            Some(ClaimCaches::Watched {
                claims, templates, ..
            }) => format!("{} claims, {} templates", claims.len(), templates.len()),
        };
        f.debug_struct("ReflectorCache")
            .field("policies", &self.policies.len())
            .field("namespaces", &self.namespaces.len())
            .field("claims", &claims)
            .finish()
    }
}

/// Whether the API server serves ResourceClaims and ResourceClaimTemplates in
/// `resource.k8s.io/v1`. Other errors than "not found" are retried until shutdown.
async fn dra_served(client: &kube::Client, shutdown: &Shutdown) -> Option<bool> {
    loop {
        match client.list_api_group_resources("resource.k8s.io/v1").await {
            Ok(list) => {
                let has = |name: &str| list.resources.iter().any(|r| r.name == name);
                return Some(has("resourceclaims") && has("resourceclaimtemplates"));
            }
            Err(kube::Error::Api(status)) if status.code == 404 => return Some(false),
            Err(error) => {
                tracing::warn!(error = %gpuwarden_crds::error_chain(&error), "discovery of resource.k8s.io/v1 failed; retrying");
            }
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(5)) => {}
            () = shutdown.wait() => return None,
        }
    }
}

/// How long readiness waits for the DRA caches.
const CLAIM_SYNC_GRACE: Duration = Duration::from_secs(30);

/// Raises `synced` (and the metric) once both DRA caches hold a complete list.
async fn sync_claims(
    claims: Store<ResourceClaim>,
    templates: Store<ResourceClaimTemplate>,
    synced: SyncFlag,
    metrics: Arc<Metrics>,
) {
    if claims.wait_until_ready().await.is_ok() && templates.wait_until_ready().await.is_ok() {
        synced.set(true);
        metrics.set_cache_synced("resourceclaims", true);
        tracing::info!(
            claims = claims.len(),
            templates = templates.len(),
            "ResourceClaim caches synced"
        );
    }
}

/// Starts the ResourceClaim and ResourceClaimTemplate caches, keeping only what the engine
/// reads: their device requests.
fn watch_claims(client: kube::Client, shutdown: &Shutdown) -> ClaimCaches {
    let (claims, claim_writer) = reflector::store::<ResourceClaim>();
    let (templates, template_writer) = reflector::store::<ResourceClaimTemplate>();
    let claim_stream = watcher(
        Api::<ResourceClaim>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .modify(|c| {
        c.metadata.managed_fields = None;
        c.metadata.annotations = None;
        c.status = None;
    })
    .reflect(claim_writer)
    .applied_objects();
    let template_stream = watcher(
        Api::<ResourceClaimTemplate>::all(client),
        watcher::Config::default(),
    )
    .default_backoff()
    .modify(|t| {
        t.metadata.managed_fields = None;
        t.metadata.annotations = None;
        t.spec.metadata = None;
    })
    .reflect(template_writer)
    .applied_objects();
    tokio::spawn(drive("resourceclaims", claim_stream, shutdown.clone()));
    tokio::spawn(drive(
        "resourceclaimtemplates",
        template_stream,
        shutdown.clone(),
    ));
    ClaimCaches::Watched {
        claims,
        templates,
        synced: SyncFlag::new(),
    }
}

impl Claims for ReflectorCache {
    fn lookup(&self, source: ClaimSource, namespace: &str, name: &str) -> ClaimLookup {
        match self.claims.get() {
            None => ClaimLookup::Unknown(Cow::Borrowed(
                "the webhook has not yet discovered whether the cluster serves resource.k8s.io/v1",
            )),
            Some(ClaimCaches::NotServed) => ClaimLookup::Unknown(Cow::Borrowed(
                "the cluster does not serve resource.k8s.io/v1 ResourceClaims",
            )),
            Some(ClaimCaches::Watched { synced, .. }) if !synced.get() => ClaimLookup::Unknown(
                Cow::Borrowed("the webhook's ResourceClaim caches are not synced yet"),
            ),
            Some(ClaimCaches::Watched {
                claims, templates, ..
            }) => {
                let found = match source {
                    ClaimSource::Claim => (claims.get(&ObjectRef::new(name).within(namespace)))
                        .map(|c| ClaimLookup::of(&c.spec)),
                    ClaimSource::Template => (templates
                        .get(&ObjectRef::new(name).within(namespace)))
                    .map(|t| ClaimLookup::of(&t.spec.spec)),
                };
                found.unwrap_or(ClaimLookup::Missing)
            }
        }
    }
}

impl ReflectorCache {
    /// Starts watching through `client` on the current runtime. `synced` is raised once both
    /// caches hold a complete list. The watches retry with backoff on errors and stop when
    /// `shutdown` fires.
    pub fn start(
        client: kube::Client,
        metrics: Arc<Metrics>,
        synced: SyncFlag,
        shutdown: Shutdown,
    ) -> Self {
        let cache = Self {
            policies: watch_policies(client.clone(), &shutdown),
            namespaces: watch_namespaces(client.clone(), &shutdown),
            claims: Arc::new(OnceLock::new()),
        };
        tokio::spawn(
            cache
                .clone()
                .raise_when_synced(client, metrics, synced, shutdown),
        );
        cache
    }

    /// Raises `synced` once the policy and namespace caches hold a complete list and the
    /// DRA caches are discovered and synced (or their grace is over), unless `shutdown`
    /// fires first.
    async fn raise_when_synced(
        self,
        client: kube::Client,
        metrics: Arc<Metrics>,
        synced: SyncFlag,
        shutdown: Shutdown,
    ) {
        metrics.set_cache_synced("gpupolicies", false);
        metrics.set_cache_synced("namespaces", false);
        let wait = async {
            let policies = async {
                if self.policies.wait_until_ready().await.is_ok() {
                    metrics.set_cache_synced("gpupolicies", true);
                    tracing::info!(count = self.policies.len(), "GpuPolicy cache synced");
                }
            };
            let namespaces = async {
                if self.namespaces.wait_until_ready().await.is_ok() {
                    metrics.set_cache_synced("namespaces", true);
                    tracing::info!(count = self.namespaces.len(), "Namespace cache synced");
                }
            };
            let claims = self.start_claims(&client, &metrics, &shutdown);
            tokio::join!(policies, namespaces, claims);
            synced.set(true);
        };
        tokio::select! {
            () = wait => {}
            () = shutdown.wait() => {}
        }
    }

    /// Discovers whether the cluster serves DRA, starts the claim caches where it does, and
    /// waits a while for them to sync. DRA is optional: without it claims count by nothing
    /// and the ResourceClaim mode is denied, saying why.
    async fn start_claims(
        &self,
        client: &kube::Client,
        metrics: &Arc<Metrics>,
        shutdown: &Shutdown,
    ) {
        let Some(served) = dra_served(client, shutdown).await else {
            return;
        };
        let caches = if served {
            watch_claims(client.clone(), shutdown)
        } else {
            tracing::info!("resource.k8s.io/v1 is not served: DRA claims are not read");
            ClaimCaches::NotServed
        };
        let caches = self.claims.get_or_init(|| caches);
        if let ClaimCaches::Watched {
            claims,
            templates,
            synced,
        } = caches
        {
            metrics.set_cache_synced("resourceclaims", false);
            let sync = tokio::spawn(sync_claims(
                claims.clone(),
                templates.clone(),
                synced.clone(),
                metrics.clone(),
            ));
            // Readiness waits a while for the optional DRA caches, not for ever: without
            // them (RBAC not yet updated, say) claims are unknown, and the reviews that need
            // them say so.
            if tokio::time::timeout(CLAIM_SYNC_GRACE, sync).await.is_err() {
                tracing::warn!(
                    grace = ?CLAIM_SYNC_GRACE,
                    "the ResourceClaim caches have not synced; ready without them until they do (check the webhook's RBAC for resource.k8s.io)"
                );
            }
        }
    }
}

/// Starts the GpuPolicy cache. Only the fields the engine reads are kept: managedFields
/// alone is often most of an object's size.
fn watch_policies(client: kube::Client, shutdown: &Shutdown) -> Store<GpuPolicy> {
    let (policies, writer) = reflector::store::<GpuPolicy>();
    let stream = watcher(Api::<GpuPolicy>::all(client), watcher::Config::default())
        .default_backoff()
        .modify(|p| p.metadata.managed_fields = None)
        .reflect(writer)
        .applied_objects();
    tokio::spawn(drive("gpupolicies", stream, shutdown.clone()));
    policies
}

/// Starts the Namespace cache. Labels are all the engine needs of a Namespace: it watches
/// metadata only.
fn watch_namespaces(
    client: kube::Client,
    shutdown: &Shutdown,
) -> Store<PartialObjectMeta<Namespace>> {
    let (namespaces, writer) = reflector::store::<PartialObjectMeta<Namespace>>();
    let stream = watcher(
        Api::<PartialObjectMeta<Namespace>>::all(client),
        watcher::Config::default(),
    )
    .default_backoff()
    .modify(|ns| {
        ns.metadata.managed_fields = None;
        ns.metadata.annotations = None;
    })
    .reflect(writer)
    .applied_objects();
    tokio::spawn(drive("namespaces", stream, shutdown.clone()));
    namespaces
}

/// Polls one watch stream until shutdown, logging its errors (the stream backs off itself).
async fn drive<S, T, E>(cache: &'static str, stream: S, shutdown: Shutdown)
where
    S: futures::Stream<Item = Result<T, E>> + Send,
    E: std::error::Error,
{
    let mut stream = std::pin::pin!(stream);
    loop {
        tokio::select! {
            item = stream.next() => match item {
                Some(Ok(_)) => {}
                Some(Err(error)) => {
                    tracing::warn!(cache, error = %gpuwarden_crds::error_chain(&error), "watch failed; retrying with backoff");
                }
                None => {
                    tracing::error!(cache, "watch stream ended");
                    return;
                }
            },
            () = shutdown.wait() => return,
        }
    }
}

impl PolicySource for ReflectorCache {
    fn policies(&self) -> Vec<Arc<GpuPolicy>> {
        self.policies.state()
    }

    fn namespace_labels(&self, name: &str) -> Option<BTreeMap<String, String>> {
        self.namespaces
            .get(&ObjectRef::new(name))
            .map(|ns| ns.metadata.labels.clone().unwrap_or_default())
    }

    fn lend(&self, namespace: &str, read: &mut PolicyReader<'_>) {
        let no_labels = BTreeMap::new();
        let known = self.namespaces.get(&ObjectRef::new(namespace));
        let labels = known
            .as_ref()
            .map(|ns| ns.metadata.labels.as_ref().unwrap_or(&no_labels));
        read(&self.policies.state(), labels);
    }

    fn claims(&self) -> &dyn Claims {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_policy_file_parses_to_the_builtin_default() {
        let path = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/policies/default.yaml"
        ));
        let source = StaticPolicySource::from_file(path).unwrap();
        let policies = source.policies();
        assert_eq!(policies.len(), 1);
        assert_eq!(policies[0].spec, GpuPolicy::default_policy().spec);
        assert_eq!(
            source.namespace_labels("ml").unwrap()[gpuwarden_crds::LABEL_NAMESPACE_NAME],
            "ml"
        );
    }

    #[test]
    fn policy_file_errors_name_the_document() {
        let path = Path::new("p.yaml");
        let text = "apiVersion: gpuwarden.io/v1alpha1\nkind: GpuPolicy\nmetadata: {name: a}\nspec: {}\n---\nkind: ConfigMap\n";
        let error = parse_policies(text, path).unwrap_err().to_string();
        assert!(
            error.contains("document 1") && error.contains("ConfigMap"),
            "{error}"
        );
        let error = parse_policies("", path).unwrap_err().to_string();
        assert!(error.contains("holds no GpuPolicy"), "{error}");
        let error = parse_policies("a: [", path).unwrap_err().to_string();
        assert!(error.contains("not valid YAML"), "{error}");
    }

    #[test]
    fn a_policy_file_with_an_invalid_policy_is_refused() {
        // `serve --policy-file` builds its source here: it refuses to start rather than serve
        // a policy that governs pods by rules nobody meant.
        let path = Path::new("p.yaml");
        let text = "apiVersion: gpuwarden.io/v1alpha1\nkind: GpuPolicy\nmetadata: {name: ok}\nspec: {}\n---\n\
            apiVersion: gpuwarden.io/v1alpha1\nkind: GpuPolicy\nmetadata: {name: bad}\n\
            spec: {priority: 5, namespaceSelector: {matchExpressions: [{key: team, operator: In}]}}\n";
        let error = parse_policies(text, path).unwrap_err().to_string();
        assert!(
            error.starts_with(
                "policy file p.yaml policy bad: InvalidSelector: spec.namespaceSelector"
            ),
            "{error}"
        );
    }

    #[test]
    fn sync_flag_is_shared_by_clones() {
        let flag = SyncFlag::new();
        let other = flag.clone();
        assert!(!other.get());
        flag.set(true);
        assert!(other.get());
    }
}
