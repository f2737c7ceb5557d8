//! Where the engine reads DRA claims (docs/design.md, "ResourceClaims"): a pod's
//! `resourceClaims` name ResourceClaims and ResourceClaimTemplates, whose device classes say
//! whether they hold GPUs; and the `ResourceClaim` rewrite needs gpuwarden's templates to
//! exist. In a cluster the webhook's caches answer; offline, the manifest's own documents.

use std::borrow::Cow;
use std::collections::BTreeMap;

use gpuwarden_crds::claims::{self, ClaimDevices};
use k8s_openapi::api::resource::v1::ResourceClaimSpec;

/// Which object a pod `resourceClaims` entry stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ClaimSource {
    /// `resourceClaimName`: a ResourceClaim.
    Claim,
    /// `resourceClaimTemplateName`: a ResourceClaimTemplate.
    Template,
}

impl ClaimSource {
    /// The kind, for messages.
    pub fn kind(self) -> &'static str {
        match self {
            Self::Claim => "ResourceClaim",
            Self::Template => "ResourceClaimTemplate",
        }
    }
}

/// What a lookup found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimLookup {
    /// The object exists; the device classes its requests name and its opaque configs' kinds.
    Found(ClaimDevices),
    /// The object does not exist.
    Missing,
    /// It cannot be known: why (the API is not served, the cache is not synced, ...).
    Unknown(Cow<'static, str>),
}

impl ClaimLookup {
    /// The lookup of an object with this spec.
    pub fn of(spec: &ResourceClaimSpec) -> Self {
        Self::Found(ClaimDevices::of(spec))
    }
}

/// Reads ResourceClaims and ResourceClaimTemplates by namespace and name, from memory.
pub trait Claims: Sync + std::fmt::Debug {
    /// What `namespace/name` of `source`'s kind is.
    fn lookup(&self, source: ClaimSource, namespace: &str, name: &str) -> ClaimLookup;
}

/// A source that can read no claims, saying why.
#[derive(Clone, Copy, Debug)]
pub struct NoClaims(pub &'static str);

impl Claims for NoClaims {
    fn lookup(&self, _: ClaimSource, _: &str, _: &str) -> ClaimLookup {
        ClaimLookup::Unknown(Cow::Borrowed(self.0))
    }
}

/// Claims held in memory: those inserted and no others ([`ClaimStore::new`]); or, for the
/// offline command, a manifest's ResourceClaim and ResourceClaimTemplate documents and
/// gpuwarden's own templates, which the operator keeps in every namespace a
/// `ResourceClaim`-mode policy governs and which are taken to exist
/// ([`ClaimStore::offline`]).
#[derive(Clone, Debug, Default)]
pub struct ClaimStore {
    objects: BTreeMap<(ClaimSource, String, String), ClaimLookup>,
    offline: bool,
}

impl ClaimStore {
    /// A store of exactly what is inserted: anything else is missing.
    pub fn new() -> Self {
        Self::default()
    }

    /// A store for a manifest read offline: gpuwarden's templates are taken to exist, and
    /// anything else not inserted is unknown (it may be in the cluster).
    pub fn offline() -> Self {
        Self {
            offline: true,
            ..Self::default()
        }
    }

    /// Adds a document of either kind in `namespace`.
    pub fn insert(
        &mut self,
        source: ClaimSource,
        namespace: &str,
        name: &str,
        spec: &ResourceClaimSpec,
    ) {
        let key = (source, namespace.to_owned(), name.to_owned());
        self.objects.insert(key, ClaimLookup::of(spec));
    }
}

impl Claims for ClaimStore {
    fn lookup(&self, source: ClaimSource, namespace: &str, name: &str) -> ClaimLookup {
        let key = (source, namespace.to_owned(), name.to_owned());
        if let Some(found) = self.objects.get(&key) {
            return found.clone();
        }
        if !self.offline {
            return ClaimLookup::Missing;
        }
        let own = (source == ClaimSource::Template)
            .then(|| claims::template_parts(name))
            .flatten();
        match own {
            Some((class, _)) => ClaimLookup::Found(ClaimDevices {
                classes: vec![class.to_owned()],
                config_kinds: Vec::new(),
            }),
            None => ClaimLookup::Unknown(Cow::Borrowed("not in the manifest")),
        }
    }
}
