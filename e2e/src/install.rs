//! gpuwarden's install (`deploy/install.yaml`) in a cluster: which of its objects are there,
//! and whether gpuwarden is really installed, for the tests that install and uninstall it
//! and must never delete an install they did not make.

use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};

use crate::cluster::{Cluster, settled};
use crate::manifests::{Document, load_file};

/// Every object the install creates.
pub fn install_objects() -> Vec<Document> {
    load_file("deploy/install.yaml").expect("deploy/install.yaml")
}

/// The API of the object `doc` describes.
pub fn api_for(cluster: &Cluster, doc: &Document) -> Api<DynamicObject> {
    let (group, version) = match doc.api_version().split_once('/') {
        Some((g, v)) => (g, v),
        None => ("", doc.api_version()),
    };
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, doc.kind()));
    match doc.namespace() {
        Some(ns) => Api::namespaced_with(cluster.client.clone(), ns, &resource),
        None => Api::all_with(cluster.client.clone(), &resource),
    }
}

/// The objects of the install that exist now (also those being deleted).
pub async fn present(cluster: &Cluster) -> Vec<String> {
    let mut out = Vec::new();
    for doc in install_objects() {
        if let Ok(Some(_)) = api_for(cluster, &doc).get_opt(doc.name()).await {
            out.push(doc.id());
        }
    }
    out
}

/// Whether gpuwarden is installed: the objects of the install that exist, once those being
/// deleted are gone (a test before this one removed what it made: `gpuwarden-system`
/// Terminating, a CRD finalizing), waiting at most `timeout`. The namespace alone is no
/// install; the objects in it are. `Err` names what is still being deleted after `timeout`.
pub async fn installed(cluster: &Cluster, timeout: Duration) -> Result<Vec<String>, String> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut out = Vec::new();
    for doc in install_objects() {
        let api = api_for(cluster, &doc);
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match settled(&api, doc.name(), left).await {
            None => {
                return Err(format!(
                    "{} is still being deleted after {} s (a previous test's cleanup, or a stuck finalizer: `kubectl get {} {} -o yaml`); wait for it, or remove it",
                    doc.id(),
                    timeout.as_secs(),
                    doc.kind().to_lowercase(),
                    doc.name()
                ));
            }
            Some(Some(_)) if doc.kind() != "Namespace" => out.push(doc.id()),
            Some(_) => {}
        }
    }
    Ok(out)
}
