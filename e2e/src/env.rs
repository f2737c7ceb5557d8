//! A test's cluster handle for the end-to-end suites: the connection, the cleanup guard, the
//! CRDs and default policy installed where missing, namespaces of this run, the in-process
//! webhook registered as the shipped configuration registers it, and the shipped admission
//! policies bound to chosen namespaces.

use std::time::Duration;

use gpuwarden_crds::{GpuNode, GpuPolicy, PolicyMode};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, LogParams, PostParams};
use kube::{CustomResourceExt, ResourceExt};
use serde_json::{Value, json};

use crate::cluster::{
    Cleanup, Cluster, LocalWebhook, RawResponse, base64, certificate_for, settled, skip, wait_for,
};
use crate::manifests::load_file;

/// The label every namespace of a run carries (its value: the run id).
pub const LABEL_RUN: &str = "gpuwarden.io/e2e";
/// How long a test waits for the server to catch up (caches, configurations).
pub const SHORT: Duration = Duration::from_secs(30);

/// A test's cluster handle and cleanup guard.
pub struct Env {
    /// The cluster.
    pub cluster: Cluster,
    /// Deletes what the test created, also when it fails.
    pub cleanup: Cleanup,
}

impl Env {
    /// Connects (KUBECONFIG must be set), refuses a cluster where gpuwarden is installed,
    /// removes admission policies an earlier operator left, and installs the CRDs and the
    /// default policy when they are missing.
    pub async fn new() -> Env {
        let cluster = Cluster::connect().await.unwrap_or_else(|e| panic!("{e}"));
        let cleanup = Cleanup::new(cluster.client.clone());
        let env = Env { cluster, cleanup };
        env.refuse_stale_state().await;
        env.ensure_api().await;
        env
    }

    /// A cluster someone has used: an installed gpuwarden would admit this run's pods before
    /// its own webhook does, so the run refuses, saying what is there; admission policies an
    /// operator rendered and nobody keeps any more are removed, saying which.
    async fn refuse_stale_state(&self) {
        match crate::install::acting(&self.cluster, Duration::from_secs(120)).await {
            Err(why) => panic!("cannot tell whether gpuwarden is installed: {why}"),
            Ok(found) if !found.is_empty() => panic!(
                "gpuwarden is installed here ({}): its webhook, admission policies and operator would act on this run's pods before the test's own. Run the suites on a cluster without it, or uninstall it first (README, Uninstall); its CRDs and default GpuPolicy may stay",
                found.join(", ")
            ),
            Ok(_) => {}
        }
        match crate::install::clear_rendered(&self.cluster).await {
            Err(why) => panic!("cannot clear admission policies a gpuwarden operator left: {why}"),
            Ok(cleared) if !cleared.is_empty() => eprintln!(
                "removed admission policies a gpuwarden operator rendered and no operator keeps: {}",
                cleared.join(", ")
            ),
            Ok(_) => {}
        }
    }

    /// The admin client.
    pub fn client(&self) -> kube::Client {
        self.cluster.client.clone()
    }

    /// A name of this run: `gpuwarden-e2e-<run id>-<suffix>`.
    pub fn name(&self, suffix: &str) -> String {
        format!("gpuwarden-e2e-{}-{suffix}", self.cluster.run_id)
    }

    /// The namespace selector of every namespace this run creates.
    pub fn run_selector(&self) -> Value {
        json!({"matchLabels": {LABEL_RUN: self.cluster.run_id}})
    }

    async fn ensure_api(&self) {
        let crds: Api<CustomResourceDefinition> = Api::all(self.client());
        for crd in [GpuPolicy::crd(), GpuNode::crd()] {
            let name = crd.name_any();
            // A previous test may have removed the CRD it installed: let that finish.
            let current = settled(&crds, &name, Duration::from_secs(90))
                .await
                .unwrap_or_else(|| panic!("CRD {name} is stuck terminating"));
            if current.is_none() {
                eprintln!("installing CRD {name}");
                crds.create(&PostParams::default(), &crd)
                    .await
                    .unwrap_or_else(|e| panic!("failed to create CRD {name}: {e}"));
                self.cleanup
                    .own_typed::<CustomResourceDefinition>(None, &name);
            }
            let established = wait_for(SHORT, || {
                let crds = crds.clone();
                let name = name.clone();
                async move {
                    let crd = crds.get(&name).await.ok()?;
                    crd.status?
                        .conditions?
                        .iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                        .then_some(())
                }
            })
            .await;
            assert!(established.is_some(), "CRD {name} is not Established");
        }
        let policies: Api<GpuPolicy> = Api::all(self.client());
        if policies
            .get_opt(gpuwarden_crds::DEFAULT_POLICY_NAME)
            .await
            .expect("read the default GpuPolicy")
            .is_none()
        {
            eprintln!("installing the default GpuPolicy");
            let manifest = gpuwarden_crds::manifests::default_policy_manifest();
            let policy: GpuPolicy = serde_json::from_value(manifest).expect("default policy");
            policies
                .create(&PostParams::default(), &policy)
                .await
                .expect("create the default GpuPolicy");
            self.cleanup
                .own_typed::<GpuPolicy>(None, gpuwarden_crds::DEFAULT_POLICY_NAME);
        }
    }

    /// Whether this machine is the cluster's Ready GPU node, as the node suites need; where
    /// it is not, prints `SKIPPED` for `test` and why.
    pub async fn on_this_gpu_node(&self, test: &str) -> bool {
        let node = crate::node::gpu_node(&self.cluster)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let Some(node) = node else {
            crate::cluster::skip(test, "no Ready node with 2 allocatable nvidia.com/gpu");
            return false;
        };
        if let Some(problem) = crate::node::local_node_problem(&node, &[]) {
            crate::cluster::skip(test, &problem);
            return false;
        }
        true
    }

    /// Creates `pod` in `ns` as the cluster admin and returns it with what its container
    /// `container` (the only one, when `None`) printed ([`crate::node::SEEN_COMMAND`]);
    /// panics after 120 s.
    pub async fn run_seen(
        &self,
        ns: &str,
        pod: &Value,
        container: Option<&str>,
    ) -> (Pod, crate::node::Seen) {
        let r = (self.cluster.create_pod(ns, pod, false).await).unwrap_or_else(|e| panic!("{e}"));
        assert!(r.status.is_success(), "create: {}", r.message());
        let name = pod["metadata"]["name"].as_str().unwrap_or_default();
        let pods: Api<Pod> = Api::namespaced(self.client(), ns);
        let params = LogParams {
            container: container.map(str::to_owned),
            ..LogParams::default()
        };
        let seen = wait_for(Duration::from_secs(120), || {
            let (pods, params) = (pods.clone(), params.clone());
            async move {
                let p = pods.get(name).await.ok()?;
                let seen = crate::node::Seen::parse(&pods.logs(name, &params).await.ok()?)?;
                Some((p, seen))
            }
        })
        .await;
        seen.unwrap_or_else(|| panic!("{ns}/{name}: the container never printed what it sees"))
    }

    /// A fresh namespace labelled with this run's id (the e2e webhook configuration only
    /// selects such namespaces).
    pub async fn namespace(&self, suffix: &str) -> String {
        // Privileged pods are what the tests create: Pod Security must not refuse them first.
        self.namespace_at(suffix, "privileged").await
    }

    /// A namespace of this run whose Pod Security Admission enforces `level`.
    pub async fn namespace_at(&self, suffix: &str, level: &str) -> String {
        let name = self.name(suffix);
        let ns: Namespace = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {
                LABEL_RUN: self.cluster.run_id,
                "pod-security.kubernetes.io/enforce": level,
            }}
        }))
        .expect("namespace");
        Api::<Namespace>::all(self.client())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("failed to create namespace {name}: {e}"));
        self.cleanup.own_typed::<Namespace>(None, &name);
        // Pods need the namespace's default ServiceAccount, which kube-controller-manager
        // creates shortly; on a bare API server nobody does, so create it after a wait.
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client(), &name);
        let exists = wait_for(Duration::from_secs(5), || {
            let accounts = accounts.clone();
            async move { accounts.get_opt("default").await.ok().flatten() }
        })
        .await;
        if exists.is_none() {
            let sa: ServiceAccount =
                serde_json::from_value(json!({"metadata": {"name": "default"}})).expect("sa");
            match accounts.create(&PostParams::default(), &sa).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => panic!("failed to create the default ServiceAccount in {name}: {e}"),
            }
        }
        name
    }

    /// Makes sure `gpuwarden-system` exists (agent Leases live there).
    pub async fn system_namespace(&self) {
        let api: Api<Namespace> = Api::all(self.client());
        // A previous test may have removed the namespace it created: let that finish.
        let current = settled(
            &api,
            gpuwarden_crds::SYSTEM_NAMESPACE,
            Duration::from_secs(120),
        )
        .await
        .expect("namespace gpuwarden-system is stuck terminating");
        if current.is_none() {
            let ns: Namespace = serde_json::from_value(json!({
                "metadata": {"name": gpuwarden_crds::SYSTEM_NAMESPACE}
            }))
            .expect("namespace");
            api.create(&PostParams::default(), &ns)
                .await
                .expect("create gpuwarden-system");
            self.cleanup
                .own_typed::<Namespace>(None, gpuwarden_crds::SYSTEM_NAMESPACE);
        }
    }

    /// A namespace admin of `ns`: ServiceAccount `name` there, bound to the `admin`
    /// ClusterRole by the RoleBinding `<name>-admin`, and the cluster as it, as the API server
    /// authorizes it. A tenant in the threat model writes every field of its own objects.
    pub async fn namespace_admin(&self, ns: &str, name: &str) -> Cluster {
        let post = |path: String, body: Value| async move {
            let r = self
                .cluster
                .raw(http::Method::POST, &path, "application/json", Some(&body))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(r.status.is_success(), "POST {path}: {}", r.message());
        };
        post(
            format!("/api/v1/namespaces/{ns}/serviceaccounts"),
            json!({"metadata": {"name": name}}),
        )
        .await;
        post(
            format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings"),
            json!({"metadata": {"name": format!("{name}-admin")},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "admin"}}),
        )
        .await;
        self.cluster
            .as_service_account(ns, name)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// A temporary policy that outranks the default one in namespace `ns`.
    pub async fn policy_for(&self, ns: &str, mode: PolicyMode, exempt_namespace: bool) -> String {
        let suffix = format!("{mode:?}").to_lowercase();
        self.policy_with(ns, &suffix, |spec| {
            spec.mode = mode;
            if exempt_namespace {
                spec.exemptions.namespaces = vec![ns.to_string()];
            }
        })
        .await
    }

    /// A temporary policy `<ns>-<suffix>` that outranks the default one in namespace `ns`:
    /// the default policy's spec, as `edit` changes it.
    pub async fn policy_with(
        &self,
        ns: &str,
        suffix: &str,
        edit: impl FnOnce(&mut gpuwarden_crds::GpuPolicySpec),
    ) -> String {
        let name = format!("{ns}-{suffix}");
        let mut policy = GpuPolicy::default_policy();
        policy.metadata = kube::api::ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        };
        policy.status = None;
        policy.spec.priority = 1000;
        policy.spec.namespace_selector =
            serde_json::from_value(json!({"matchLabels": {"kubernetes.io/metadata.name": ns}}))
                .expect("selector");
        edit(&mut policy.spec);
        Api::<GpuPolicy>::all(self.client())
            .create(&PostParams::default(), &policy)
            .await
            .unwrap_or_else(|e| panic!("failed to create GpuPolicy {name}: {e}"));
        self.cleanup.own_typed::<GpuPolicy>(None, &name);
        name
    }

    /// Starts the local webhook and registers it ([`Env::register_webhook`]) for this run's
    /// namespaces. Returns it, and whether the server kept the matchConditions.
    pub async fn webhook(&self) -> (LocalWebhook, bool) {
        let webhook = self.started_webhook().await;
        let match_conditions = self
            .register_webhook(
                &webhook.url,
                &webhook.ca_pem,
                self.run_selector(),
                "webhook",
            )
            .await;
        (webhook, match_conditions)
    }

    /// Starts the local webhook and waits for its caches; registers nothing.
    pub async fn started_webhook(&self) -> LocalWebhook {
        let webhook = LocalWebhook::start(self.client())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            webhook.wait_synced(SHORT).await,
            "the webhook's policy and namespace caches did not sync"
        );
        eprintln!("webhook at {}", webhook.url);
        webhook
    }

    /// Registers a MutatingWebhookConfiguration `<run>-<suffix>` built from
    /// deploy/admission/mutating-webhook.yaml (same rules, matchConditions, failure policy
    /// and timeouts) that calls `url`, trusting `ca_pem`, for the namespaces `selector`
    /// selects. Returns whether the server kept the matchConditions.
    pub async fn register_webhook(
        &self,
        url: &str,
        ca_pem: &str,
        selector: Value,
        suffix: &str,
    ) -> bool {
        let shipped = load_file("deploy/admission/mutating-webhook.yaml").expect("manifest");
        let mut mwc = shipped[0].value.clone();
        let name = self.name(suffix);
        mwc["metadata"] = json!({"name": name});
        // Every entry (pods, VMs, pod entry) calls the local webhook on its own path, in the
        // run's namespaces.
        for hook in mwc["webhooks"].as_array_mut().into_iter().flatten() {
            let path = hook["clientConfig"]["service"]["path"]
                .as_str()
                .unwrap_or_default();
            let url = url.replace(gpuwarden_crds::install::MUTATE_PATH, path);
            hook["clientConfig"] = json!({"url": url, "caBundle": base64(ca_pem.as_bytes())});
            hook["namespaceSelector"] = selector.clone();
        }
        let mwc: MutatingWebhookConfiguration =
            serde_json::from_value(mwc).expect("MutatingWebhookConfiguration");
        let api: Api<MutatingWebhookConfiguration> = Api::all(self.client());
        let created = api
            .create(&PostParams::default(), &mwc)
            .await
            .unwrap_or_else(|e| panic!("failed to register the webhook configuration: {e}"));
        self.cleanup
            .own_typed::<MutatingWebhookConfiguration>(None, &name);
        let match_conditions = (created.webhooks.iter().flatten())
            .filter(|w| w.name == gpuwarden_crds::install::MUTATING_WEBHOOK)
            .all(|w| w.match_conditions.as_ref().is_some_and(|m| !m.is_empty()));
        if !match_conditions {
            skip(
                "matchConditions",
                "the server dropped them (Kubernetes before 1.28, or the feature is off): every pod in the selected namespaces is sent",
            );
        }
        match_conditions
    }

    /// Registers gpuwarden's webhook configuration ([`Env::register_webhook`]) as when its
    /// replicas are scaled to 0: calling a port on this machine where nothing listens, with
    /// a CA nobody holds the key of. Returns whether the server kept the matchConditions.
    pub async fn register_unreachable_webhook(&self, selector: Value, suffix: &str) -> bool {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let (ca, _, _) = certificate_for("127.0.0.1").expect("a CA");
        let url = format!(
            "https://127.0.0.1:{port}{}",
            gpuwarden_crds::install::MUTATE_PATH
        );
        self.register_webhook(&url, &ca, selector, suffix).await
    }

    /// Creates a renamed copy of the admission policy and binding in `file`, the binding
    /// selecting the namespaces `selector` selects (`None`: as shipped), and returns the
    /// policy as the server stored it once type-checked.
    pub async fn install_policy(
        &self,
        file: &str,
        suffix: &str,
        selector: Option<Value>,
    ) -> ValidatingAdmissionPolicy {
        self.install_policy_with_param(file, suffix, selector, None)
            .await
    }

    /// [`Env::install_policy`], with the binding's parameter the GpuPolicy `param` (`None`:
    /// as shipped).
    pub async fn install_policy_with_param(
        &self,
        file: &str,
        suffix: &str,
        selector: Option<Value>,
        param: Option<&str>,
    ) -> ValidatingAdmissionPolicy {
        let docs = load_file(file).expect("manifest");
        let name = self.name(suffix);
        let policy_api: Api<ValidatingAdmissionPolicy> = Api::all(self.client());
        let binding_api: Api<ValidatingAdmissionPolicyBinding> = Api::all(self.client());
        let mut policy = docs[0].value.clone();
        policy["metadata"] = json!({"name": name});
        let policy: ValidatingAdmissionPolicy = serde_json::from_value(policy).expect("policy");
        policy_api
            .create(&PostParams::default(), &policy)
            .await
            .unwrap_or_else(|e| panic!("the server refused {file}: {e}"));
        self.cleanup
            .own_typed::<ValidatingAdmissionPolicy>(None, &name);
        let mut binding = docs[1].value.clone();
        binding["metadata"] = json!({"name": name});
        binding["spec"]["policyName"] = json!(name);
        if let Some(selector) = selector {
            binding["spec"]["matchResources"] = json!({"namespaceSelector": selector});
        }
        if let Some(param) = param {
            binding["spec"]["paramRef"] = json!({"name": param, "parameterNotFoundAction": "Deny"});
        }
        let binding: ValidatingAdmissionPolicyBinding =
            serde_json::from_value(binding).expect("binding");
        binding_api
            .create(&PostParams::default(), &binding)
            .await
            .unwrap_or_else(|e| panic!("the server refused the binding in {file}: {e}"));
        self.cleanup
            .own_typed::<ValidatingAdmissionPolicyBinding>(None, &name);
        wait_for(SHORT, || {
            let api = policy_api.clone();
            let name = name.clone();
            async move {
                let p = api.get(&name).await.ok()?;
                let checked = p.status.as_ref()?.observed_generation == p.metadata.generation;
                checked.then_some(p)
            }
        })
        .await
        .unwrap_or_else(|| panic!("{file}: the server never type-checked the policy"))
    }

    /// Creates `pod` in `ns` once a dry run satisfies `ready` ([`Env::until_admission`]), and
    /// returns the server's answer, which must be a success.
    pub async fn create_admitted(
        &self,
        ns: &str,
        pod: &Value,
        what: &str,
        ready: impl Fn(&RawResponse) -> bool,
    ) -> RawResponse {
        self.until_admission(ns, pod, what, ready).await;
        let created = self
            .cluster
            .create_pod(ns, pod, false)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(created.status.is_success(), "{what}: {created:?}");
        created
    }

    /// Waits until a dry-run create of `pod` in `ns` satisfies `ready` (the webhook
    /// configuration and the webhook's policy cache take a moment to catch up).
    pub async fn until_admission(
        &self,
        ns: &str,
        pod: &Value,
        what: &str,
        ready: impl Fn(&RawResponse) -> bool,
    ) -> RawResponse {
        until_admission(&self.cluster, ns, pod, what, ready).await
    }
}

/// [`Env::until_admission`] as whoever `cluster` acts as.
pub async fn until_admission(
    cluster: &Cluster,
    ns: &str,
    pod: &Value,
    what: &str,
    ready: impl Fn(&RawResponse) -> bool,
) -> RawResponse {
    let mut last = None;
    for _ in 0..60 {
        let r = cluster
            .create_pod(ns, pod, true)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        if ready(&r) {
            return r;
        }
        last = Some(r);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("{what}: admission never reached the expected state; last answer: {last:?}");
}
