//! The install and uninstall in the README, run as written against a real API server.
//!
//! The commands are read from the README's "Install" and "Uninstall" code blocks, so the
//! README cannot drift from what is tested. They run through `bash` with the `kubectl` on
//! `PATH`. The `rollout status` loop is left out: without kubelets the workloads stay
//! unscheduled. In their place the operator runs in this process, out of cluster, as its
//! own ServiceAccount (impersonated), so its RBAC is what the API server checks; the test
//! waits until `kubectl get gpupolicies` shows `default` Ready and the operator has written
//! the webhook's certificate. Then it deletes the webhook configuration and applies the
//! install again, as "When the webhook is down" (docs/operations.md) says, and the operator
//! must have written the `caBundle` back within 15 seconds. After the README's uninstall, no
//! object of the install is left, and the uninstall runs a second time without an error.
//! Once with `kubectl apply -k deploy/`, once with `deploy/install.yaml`.
//!
//! ```sh
//! KUBECONFIG=... cargo test -p gpuwarden-e2e --test install -- --ignored --test-threads=1
//! ```
//!
//! They refuse to run (`SKIPPED`) where gpuwarden is already installed: they would delete
//! it. A `gpuwarden-system` that a test before them is deleting is waited for (up to 120 s).

use std::process::Command;
use std::time::{Duration, Instant};

use gpuwarden_crds::install::{MUTATING_WEBHOOK_CONFIGURATION, OPERATOR_NAME, WEBHOOK_TLS_SECRET};
use gpuwarden_e2e::cluster::{Cluster, skip, wait_for};
use gpuwarden_e2e::install::{install_objects, installed, present};
use gpuwarden_e2e::manifests::repo_root;
use gpuwarden_e2e::readme::readme_block_in;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;

/// Which of the README's two install commands to run.
#[derive(Clone, Copy, Debug)]
enum Variant {
    /// `kubectl apply --server-side -k deploy/`.
    Kustomize,
    /// The alternative the README gives after `# or:` (`-f deploy/install.yaml`).
    InstallYaml,
}

/// The commands of a README block: comments dropped, a `# or: ALT` alternative taken in
/// the `InstallYaml` variant, and the `rollout status` loop (which needs kubelets) left out.
fn commands(lines: &[String], variant: Variant) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_loop = false;
    for line in lines {
        let (command, comment) = match line.split_once('#') {
            Some((c, comment)) => (c.trim(), comment.trim()),
            None => (line.trim(), ""),
        };
        if command.starts_with("for ") {
            in_loop = true;
        }
        if in_loop {
            in_loop = command != "done";
            continue;
        }
        if command.is_empty() {
            continue;
        }
        let alternative = comment.strip_prefix("or:").map(str::trim);
        out.push(match (variant, alternative) {
            (Variant::InstallYaml, Some(alt)) => alt.to_owned(),
            _ => command.to_owned(),
        });
    }
    out
}

/// Runs one command line as the README reader would; fails on an error or a warning.
fn run(command: &str) -> String {
    eprintln!("$ {command}");
    let output = Command::new("bash")
        .arg("-c")
        .arg(command)
        .current_dir(repo_root())
        .output()
        .expect("run bash");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprint!("{stdout}{stderr}");
    assert!(output.status.success(), "`{command}` failed: {stderr}");
    assert!(
        !stderr.to_ascii_lowercase().contains("warning"),
        "`{command}` printed a warning: {stderr}"
    );
    stdout.into_owned()
}

/// Whether every webhook of the configuration trusts the CA in the webhook's Secret.
async fn ca_bundle_written(cluster: &Cluster) -> Option<()> {
    let secrets: Api<Secret> =
        Api::namespaced(cluster.client.clone(), gpuwarden_crds::SYSTEM_NAMESPACE);
    let webhooks: Api<MutatingWebhookConfiguration> = Api::all(cluster.client.clone());
    let secret = secrets.get_opt(WEBHOOK_TLS_SECRET).await.ok().flatten()?;
    let ca = secret.data?.get("ca.crt")?.clone();
    let config = webhooks
        .get_opt(MUTATING_WEBHOOK_CONFIGURATION)
        .await
        .ok()
        .flatten()?;
    let entries = config.webhooks?;
    (!entries.is_empty()
        && entries
            .iter()
            .all(|w| w.client_config.ca_bundle.as_ref() == Some(&ca)))
    .then_some(())
}

async fn install_and_uninstall(variant: Variant) {
    let cluster = Cluster::connect().await.unwrap_or_else(|e| panic!("{e}"));
    let crds: Api<CustomResourceDefinition> = Api::all(cluster.client.clone());
    // A test before this one may have left gpuwarden-system Terminating: wait for it.
    let already = installed(&cluster, Duration::from_secs(120))
        .await
        .unwrap_or_else(|why| panic!("cannot tell whether gpuwarden is installed: {why}"));
    if !already.is_empty() {
        skip(
            "the README install",
            &format!(
                "gpuwarden is installed here ({}); uninstall it first",
                already.join(", ")
            ),
        );
        return;
    }

    for command in commands(&readme_block_in("Install", "With the manifests"), variant) {
        run(&command);
    }
    let missing: Vec<String> = {
        let here = present(&cluster).await;
        install_objects()
            .into_iter()
            .map(|d| d.id())
            .filter(|id| !here.contains(id))
            .collect()
    };
    assert!(missing.is_empty(), "not installed: {missing:?}");

    // The operator, out of cluster, with the installed RBAC and its defaults (leader
    // election, webhook certificates).
    let mut config = gpuwarden_operator::Config::new(gpuwarden_crds::SYSTEM_NAMESPACE);
    config.health_listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let client = cluster
        .as_service_account(gpuwarden_crds::SYSTEM_NAMESPACE, OPERATOR_NAME)
        .await
        .expect("a client acting as the operator")
        .client;
    let operator = tokio::spawn(async move {
        let shutdown = async move {
            let _ = stopped.await;
        };
        gpuwarden_operator::run(config, client, shutdown).await
    });

    let ready = wait_for(Duration::from_secs(90), || async {
        let out = run("kubectl get gpupolicies");
        // NAME PRIORITY MODE READY AGE
        out.lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .any(|cols| cols.first() == Some(&"default") && cols.get(3) == Some(&"True"))
            .then_some(out)
    })
    .await;
    assert!(
        ready.is_some(),
        "the default GpuPolicy never showed Ready True"
    );

    let certified = wait_for(Duration::from_secs(60), || ca_bundle_written(&cluster)).await;
    assert!(
        certified.is_some(),
        "the operator never wrote the webhook's certificate and caBundle"
    );

    // The way back in "When the webhook is down": the configuration deleted, then applied
    // again as it was installed. It comes back without a caBundle, and every pod it sends
    // is refused until the operator, which watches it, writes the bundle again.
    let apply = commands(&readme_block_in("Install", "With the manifests"), variant)
        .into_iter()
        .find(|c| c.starts_with("kubectl apply") && !c.contains("deploy/crds"))
        .expect("the install's apply");
    run(&format!(
        "kubectl delete mutatingwebhookconfiguration {MUTATING_WEBHOOK_CONFIGURATION}"
    ));
    let recreated = Instant::now();
    run(&apply);
    let restored = wait_for(Duration::from_secs(15), || ca_bundle_written(&cluster)).await;
    assert!(
        restored.is_some(),
        "the caBundle was not back within 15 s of the configuration's re-creation"
    );
    eprintln!(
        "caBundle back {:?} after the configuration was applied again",
        recreated.elapsed()
    );
    // Written under the operator's name, and owning the bundle alone.
    let config = Api::<MutatingWebhookConfiguration>::all(cluster.client.clone())
        .get(MUTATING_WEBHOOK_CONFIGURATION)
        .await
        .expect("the webhook configuration");
    let managers: Vec<(String, String)> = config
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| serde_json::to_string(&m.fields_v1).is_ok_and(|f| f.contains("\"f:caBundle\"")))
        .map(|m| {
            (
                m.manager.clone().unwrap_or_default(),
                serde_json::to_string(&m.fields_v1).unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        managers.iter().map(|(m, _)| m.as_str()).collect::<Vec<_>>(),
        [gpuwarden_crds::FIELD_MANAGER_OPERATOR],
        "{managers:#?}"
    );
    assert!(
        !managers[0].1.contains("\"f:rules\""),
        "the operator owns more than the caBundle: {}",
        managers[0].1
    );

    // Where the API server serves MutatingAdmissionPolicy, the operator keeps the default
    // policy's, which the uninstall must remove too.
    let api = cluster.mutating_policy_api().await;
    if let Some(api) = api {
        let kept = wait_for(Duration::from_secs(60), || rendered_policies(&cluster, api)).await;
        assert!(
            kept.is_some(),
            "the operator never kept the default policy's MutatingAdmissionPolicy"
        );
    }

    let _ = stop.send(());
    match operator.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("the operator failed: {e}"),
        Err(e) => panic!("the operator panicked: {e}"),
    }

    let uninstall = readme_block_in("Uninstall", "With the manifests");
    for command in commands(&uninstall, variant) {
        run(&command);
    }
    // A person who is not sure it finished runs it again: nothing is left to delete, and
    // nothing fails.
    for command in commands(&uninstall, variant) {
        run(&command);
    }
    let leftovers = wait_for(Duration::from_secs(120), || async {
        let left = present(&cluster).await;
        left.is_empty().then_some(())
    })
    .await;
    assert!(
        leftovers.is_some(),
        "left behind after uninstall: {:?}",
        present(&cluster).await
    );
    for name in ["gpupolicies.gpuwarden.io", "gpunodes.gpuwarden.io"] {
        assert!(
            crds.get_opt(name).await.expect("read CRDs").is_none(),
            "CRD {name} left behind"
        );
    }
    if let Some(api) = api {
        let left = rendered_policies(&cluster, api).await;
        assert!(left.is_none(), "left behind after uninstall: {left:?}");
    }
}

/// The names of the MutatingAdmissionPolicies and bindings the operator keeps, when there
/// are any.
async fn rendered_policies(
    cluster: &Cluster,
    api: gpuwarden_crds::admission::policies::MutatingApi,
) -> Option<Vec<String>> {
    let mut names = Vec::new();
    for plural in [
        "mutatingadmissionpolicies",
        "mutatingadmissionpolicybindings",
    ] {
        let path = format!(
            "/apis/{}/{plural}?labelSelector={}%3D{}",
            api.api_version(),
            gpuwarden_crds::admission::policies::LABEL_MANAGED_BY,
            gpuwarden_crds::admission::policies::MANAGED_BY
        );
        let r = (cluster.raw(http::Method::GET, &path, "application/json", None))
            .await
            .expect("list the admission policies");
        assert!(r.status.is_success(), "{plural}: {}", r.message());
        for item in r.body["items"].as_array().into_iter().flatten() {
            names.push(format!(
                "{plural}/{}",
                item["metadata"]["name"].as_str().unwrap_or("")
            ));
        }
    }
    (!names.is_empty()).then_some(names)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG=... cargo test -p gpuwarden-e2e --test install -- --ignored --test-threads=1"]
async fn readme_install_with_kustomize_then_uninstall_leaves_nothing() {
    install_and_uninstall(Variant::Kustomize).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: KUBECONFIG=... cargo test -p gpuwarden-e2e --test install -- --ignored --test-threads=1"]
async fn readme_install_with_install_yaml_then_uninstall_leaves_nothing() {
    install_and_uninstall(Variant::InstallYaml).await;
}

#[test]
fn the_readme_blocks_are_the_commands_this_test_runs() {
    let install = readme_block_in("Install", "With the manifests");
    assert_eq!(
        commands(&install, Variant::Kustomize),
        [
            "kubectl apply --server-side -f deploy/crds/",
            "kubectl wait --for condition=Established --timeout=60s crd/gpupolicies.gpuwarden.io crd/gpunodes.gpuwarden.io",
            "kubectl apply --server-side -k deploy/",
        ]
    );
    assert_eq!(
        commands(&install, Variant::InstallYaml)[2],
        "kubectl apply --server-side -f deploy/install.yaml"
    );
    // Every wait of the README's install ends by itself.
    for line in install
        .iter()
        .filter(|l| l.contains("rollout status") || l.contains("kubectl wait"))
    {
        assert!(
            line.contains("--timeout="),
            "a wait without a timeout: {line}"
        );
    }
    // The uninstall can run twice: every delete ignores what is gone (a pipeline ends in
    // one, fed the kinds the server serves), and none names a custom resource, which
    // kubectl cannot map once its CRD is gone.
    let uninstall = commands(
        &readme_block_in("Uninstall", "With the manifests"),
        Variant::Kustomize,
    );
    assert_eq!(
        uninstall,
        commands(
            &readme_block_in("Uninstall", "With the manifests"),
            Variant::InstallYaml
        )
    );
    for command in &uninstall {
        let delete = command.rsplit(" | ").next().unwrap_or_default();
        assert!(
            delete.starts_with("kubectl delete --ignore-not-found ")
                || delete.starts_with("xargs -r kubectl delete --ignore-not-found "),
            "{command}"
        );
        assert!(
            !command.contains(" -k ") && !command.contains(" -f "),
            "{command}: deleting the manifests names the default GpuPolicy"
        );
    }
}
