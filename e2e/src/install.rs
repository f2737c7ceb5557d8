//! gpuwarden's install (`deploy/install.yaml`) in a cluster: which of its objects are there,
//! and whether gpuwarden is really installed, for the tests that install and uninstall it
//! and must never delete an install they did not make.

use std::time::Duration;

use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams};

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
    installed_where(cluster, timeout, |doc| doc.kind() != "Namespace").await
}

/// The objects of an install that act on pods the end-to-end suites create: the webhook
/// configuration, the admission policies, the components. The CRDs and the default GpuPolicy
/// an install leaves behind act on nothing by themselves, and the suites use them as they
/// find them. Waits as [`installed`] does.
pub async fn acting(cluster: &Cluster, timeout: Duration) -> Result<Vec<String>, String> {
    installed_where(cluster, timeout, |doc| {
        !matches!(
            doc.kind(),
            "Namespace" | "CustomResourceDefinition" | "GpuPolicy"
        )
    })
    .await
}

async fn installed_where(
    cluster: &Cluster,
    timeout: Duration,
    counts: impl Fn(&Document) -> bool,
) -> Result<Vec<String>, String> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut out = Vec::new();
    // Every object is waited for, counted or not: a namespace still terminating would refuse
    // what an install creates in it.
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
            Some(Some(_)) if counts(&doc) => out.push(doc.id()),
            Some(_) => {}
        }
    }
    Ok(out)
}

/// The kinds an operator renders admission policies as, bindings first.
const RENDERED_KINDS: [&str; 4] = [
    "MutatingAdmissionPolicyBinding",
    "MutatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "ValidatingAdmissionPolicy",
];

/// Deletes the admission policies a gpuwarden operator rendered (labelled
/// `app.kubernetes.io/managed-by=gpuwarden-operator`) and returns them. Where no operator
/// runs, nobody keeps them: an in-process operator of an earlier run rendered them for a
/// GpuPolicy it found and did not make, or an uninstall missed them. Left in place, the API
/// server would rewrite a run's pods before its webhook saw them. Every served version of
/// each kind is swept (MutatingAdmissionPolicy is `v1beta1` before Kubernetes 1.36).
pub async fn clear_rendered(cluster: &Cluster) -> Result<Vec<String>, String> {
    let discovery = kube::discovery::Discovery::new(cluster.client.clone())
        .filter(&["admissionregistration.k8s.io"])
        .run()
        .await
        .map_err(|e| format!("discover admissionregistration.k8s.io: {e}"))?;
    let selector = format!(
        "app.kubernetes.io/managed-by={}",
        gpuwarden_crds::FIELD_MANAGER_OPERATOR
    );
    let mut cleared = Vec::new();
    for kind in RENDERED_KINDS {
        for group in discovery.groups() {
            for version in group.versions() {
                for (resource, _) in group.versioned_resources(version) {
                    if resource.kind != kind {
                        continue;
                    }
                    let api: Api<DynamicObject> = Api::all_with(cluster.client.clone(), &resource);
                    let listed = api
                        .list_metadata(&ListParams::default().labels(&selector))
                        .await
                        .map_err(|e| format!("list {}: {e}", resource.plural))?;
                    for object in listed.items {
                        let name = object.metadata.name.unwrap_or_default();
                        match api.delete(&name, &DeleteParams::background()).await {
                            Ok(_) => cleared.push(format!("{kind}/{name}")),
                            Err(kube::Error::Api(status)) if status.code == 404 => {}
                            Err(e) => return Err(format!("delete {kind}/{name}: {e}")),
                        }
                    }
                }
            }
        }
    }
    cleared.dedup();
    Ok(cleared)
}

/// For a test that installs gpuwarden and then removes it: panics, naming what it found,
/// where gpuwarden is installed (the test would delete an install it did not make),
/// once what a test before it was deleting is gone.
pub fn refuse_where_installed() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let found = runtime.block_on(async {
        let cluster = Cluster::connect().await.unwrap_or_else(|e| panic!("{e}"));
        installed(&cluster, Duration::from_secs(120)).await
    });
    match found {
        Err(why) => panic!("cannot tell whether gpuwarden is installed: {why}"),
        Ok(objects) if !objects.is_empty() => panic!(
            "gpuwarden is installed here ({}); this test would delete it: uninstall it first (README, Uninstall), CRDs and GpuPolicies included",
            objects.join(", ")
        ),
        Ok(_) => {}
    }
}
