//! The run-time do-no-harm suite, on a real node (docs/design.md, "What a rewritten container
//! keeps"): privileged GPU pods that do at start what real GPU images do (an MPI worker's
//! `sshd` reached by a launcher over ssh; an entrypoint that `chown`s a mounted volume and
//! drops to a user with `gosu` and `su`; `sudo` from a user; supervisord switching users) are
//! submitted privileged, with GPUs, as real manifests write them, and rewritten. Each must do
//! what the same pod does when written unprivileged by hand, and hold exactly the GPUs the
//! kubelet allocated it (pod-resources against its `NVIDIA_VISIBLE_DEVICES` and
//! `/dev/nvidia*`).
//!
//! The image is made here: a Debian bookworm root filesystem from `debootstrap` (openssh,
//! sudo, gosu, supervisor; a user `app`; an ssh key pair; `app` may `sudo` without a
//! password; a supervisord program that runs as `app`), in one layer, imported into the
//! node's containerd. It is kept under `target/e2e-start-up/` between runs.
//!
//! The pods run two ways, each in a namespace at Pod Security `privileged` and one at
//! `baseline`: (1) the in-process webhook with the MutatingAdmissionPolicy rendered from the
//! default policy; (2) the MutatingAdmissionPolicy alone. Both bind the shipped start-up
//! warning (`deploy/admission/start-up-warnings.yaml`), and on both the admission warnings
//! must name each start-up step and say it keeps what it needs. Last, under a policy with
//! `capabilities.dropAll: true` (way 1, which the webhook rewrites), the MPI worker's warnings
//! must say what it loses (the webhook and the API server's policy, in the same words), and
//! its sshd then refuses the launcher: a failure at run time that admission named.
//!
//! It needs a Ready node with NVIDIA's device plugin that is this machine, as root, with
//! `ctr`, `tar`, `sha256sum`, `chroot`, `ssh-keygen` and `debootstrap` (`apt-get install
//! debootstrap openssh-client`) and a Debian mirror (`$GPUWARDEN_E2E_DEBIAN_MIRROR`, default
//! deb.debian.org) for the first run; elsewhere it prints `SKIPPED` and why.
//!
//! ```sh
//! KUBECONFIG=... cargo test -p gpuwarden-e2e --test start_up -- --ignored --nocapture --test-threads=1
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use gpuwarden_crds::GpuPolicy;
use gpuwarden_crds::admission::policies::{MutatingApi, render};
use gpuwarden_crds::manifests::START_UP_WARNINGS;
use gpuwarden_crds::start_up::WARNING_PREFIX;
use gpuwarden_e2e::cluster::{LocalWebhook, namespaces_named, skip, wait_for};
use gpuwarden_e2e::env::Env;
use gpuwarden_e2e::image::write_rootfs_layout;
use gpuwarden_e2e::node::{
    Images, NEEDS_GPU_NODE, SEEN_ONCE_COMMAND, Seen, exec, gpu_node, kubelet_gpus,
    local_node_problem, pod_resources_socket,
};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, LogParams};
use serde_json::{Value, json};

const TEST: &str = "rewritten_pods_start_as_they_do_unprivileged_on_a_real_node";
/// How long a pod may take to show what it did.
const RUN_TIMEOUT: Duration = Duration::from_secs(120);
/// The image's user, that the steps switch to.
const USER: &str = "app";
/// The ssh options of the launcher: no host key to trust beforehand, no prompt.
const SSH: &str = "ssh -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes -o ConnectTimeout=5";

/// How admission is set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    /// The webhook and the MutatingAdmissionPolicy.
    Webhook,
    /// The MutatingAdmissionPolicy alone.
    ApiServer,
}

impl Way {
    fn label(self) -> &'static str {
        match self {
            Way::Webhook => "webhook+MAP",
            Way::ApiServer => "MAP alone",
        }
    }
}

/// How a pod is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    /// Privileged, its GPUs named as the scenario names them: gpuwarden rewrites it.
    Privileged,
    /// The same without privilege, a GPU limit written by hand.
    ByHand,
}

/// One start-up behaviour.
struct Scenario {
    name: &'static str,
    /// The shell script the container runs after printing what it sees.
    script: String,
    /// The pod's labels.
    labels: Value,
    /// What the privileged form adds to its container beyond `privileged: true`: its
    /// `securityContext` fields, `resources` and `env`.
    privileged: Value,
    /// The `securityContext` both forms share (`runAsUser`).
    context: Value,
    /// GPUs the container holds once admitted.
    gpus: u32,
    /// A second pod, given the first's IP, whose log shows the step worked (the launcher).
    client: Option<fn(&str, &str) -> Value>,
    /// Lines the log (the client's, where there is one) must hold.
    markers: &'static [&'static str],
    /// What the warning on way 1 must say of the step, for the privileged form.
    warned: &'static [&'static str],
}

fn scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            name: "mpi-worker",
            script: "mkdir -p /run/sshd && exec /usr/sbin/sshd -D -e".into(),
            labels: json!({gpuwarden_crds::start_up::LABEL_MPI_JOB_ROLE: "worker"}),
            privileged: json!({"resources": {"limits": {"nvidia.com/gpu": "1"}}}),
            context: json!({}),
            gpus: 1,
            client: Some(launcher),
            markers: &["SSH-OK-app"],
            warned: &["runs sshd: keeps NET_BIND_SERVICE,SETUID,SETGID,SYS_CHROOT"],
        },
        Scenario {
            name: "chown-gosu-su",
            script: format!(
                "chown {USER}:{USER} /data && gosu {USER} sh -c 'touch /data/own && echo GOSU-OK-$(id -un)' && su {USER} -s /bin/sh -c 'echo SU-OK-$(id -un)'; sleep 3600"
            ),
            labels: json!({}),
            privileged: json!({"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"}]}),
            context: json!({}),
            gpus: 1,
            client: None,
            markers: &["GOSU-OK-app", "SU-OK-app"],
            warned: &[
                "runs su: keeps SETUID,SETGID",
                "runs gosu: keeps SETUID,SETGID",
                "runs chown: keeps CHOWN",
            ],
        },
        Scenario {
            name: "sudo",
            script: "sudo -n sh -c 'echo SUDO-OK-$(id -un)'; sleep 3600".into(),
            labels: json!({}),
            privileged: json!({"resources": {"requests": {"nvidia.com/gpu": "1"}}}),
            context: json!({"runAsUser": 1000, "runAsGroup": 1000}),
            gpus: 1,
            client: None,
            markers: &["SUDO-OK-root"],
            warned: &["runs sudo: keeps SETUID,SETGID"],
        },
        Scenario {
            name: "supervisord",
            script: "exec supervisord -n -c /etc/supervisor/supervisord.conf".into(),
            labels: json!({}),
            privileged: json!({"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}),
            context: json!({}),
            gpus: 1,
            client: None,
            markers: &["SUPERVISED-app"],
            warned: &["runs supervisord: keeps SETUID,SETGID"],
        },
    ]
}

/// The MPI launcher: an ordinary pod that logs into the worker at `ip` as the image's user
/// and runs a command there.
fn launcher(image: &str, ip: &str) -> Value {
    let script = format!(
        "for i in $(seq 1 15); do {SSH} {USER}@{ip} 'echo SSH-OK-$(id -un)' && exit 0; sleep 2; done; exit 1"
    );
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "launcher",
            "labels": {gpuwarden_crds::start_up::LABEL_MPI_JOB_ROLE: "launcher"}},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "launcher", "image": image, "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", script]}]}})
}

impl Scenario {
    /// The pod, written as `form`.
    fn pod(&self, image: &str, form: Form) -> Value {
        let mut context = self.context.clone();
        let mut c = json!({"name": "main", "image": image, "imagePullPolicy": "Never",
            "command": ["/bin/sh", "-c", format!("{SEEN_ONCE_COMMAND}; {}", self.script)],
            "volumeMounts": [{"name": "data", "mountPath": "/data"}]});
        match form {
            Form::Privileged => {
                context["privileged"] = json!(true);
                for (key, value) in self.privileged.as_object().into_iter().flatten() {
                    c[key] = value.clone();
                }
            }
            Form::ByHand => {
                c["resources"] = json!({"limits": {"nvidia.com/gpu": self.gpus.to_string()}});
            }
        }
        if context.as_object().is_some_and(|o| !o.is_empty()) {
            c["securityContext"] = context;
        }
        let name = format!(
            "{}-{}",
            self.name,
            match form {
                Form::Privileged => "rewritten",
                Form::ByHand => "by-hand",
            }
        );
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": self.labels},
            "spec": {"terminationGracePeriodSeconds": 1,
                "volumes": [{"name": "data", "emptyDir": {}}], "containers": [c]}})
    }
}

/// Runs `command` and returns its standard output, or why it failed.
fn run(command: &mut Command) -> Result<String, String> {
    let out = exec(command, None);
    if out.ok {
        Ok(out.stdout)
    } else {
        Err(format!("{command:?}: {}", out.stderr))
    }
}

/// Which recipe made a root filesystem: one made by another is made again.
const RECIPE: &str = "3";

/// The root filesystem of the image, made once into `dir` (a complete one has the file
/// `<dir>.complete` beside it, holding its [`RECIPE`]).
fn rootfs(dir: &Path) -> Result<(), String> {
    let complete = dir.with_extension("complete");
    if std::fs::read_to_string(&complete).is_ok_and(|r| r == RECIPE) {
        return Ok(());
    }
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(|e| format!("remove {}: {e}", dir.display()))?;
    }
    let mirror = std::env::var("GPUWARDEN_E2E_DEBIAN_MIRROR")
        .unwrap_or_else(|_| "http://deb.debian.org/debian".into());
    run(Command::new("debootstrap")
        .args([
            "--variant=minbase",
            "--include=openssh-server,openssh-client,sudo,gosu,supervisor",
            "bookworm",
        ])
        .arg(dir)
        .arg(&mirror))?;
    let root = |path: &str| dir.join(path);
    run(Command::new("chroot")
        .arg(dir)
        .args(["useradd", "-m", "-u", "1000", "-U", "-s", "/bin/sh", USER]))?;
    let write = |path: &str, text: &str, mode: u32| -> Result<(), String> {
        use std::os::unix::fs::PermissionsExt;
        let path = root(path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        }
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| format!("{}: {e}", path.display()))
    };
    write(
        "etc/sudoers.d/app",
        &format!("{USER} ALL=(ALL) NOPASSWD: ALL\n"),
        0o440,
    )?;
    write(
        "etc/supervisor/conf.d/whoami.conf",
        &format!(
            "[program:whoami]\ncommand=/bin/sh -c \"echo SUPERVISED-$(id -un)\"\nuser={USER}\nautorestart=false\nstartsecs=0\nstdout_logfile=/dev/fd/1\nstdout_logfile_maxbytes=0\nredirect_stderr=true\n"
        ),
        0o644,
    )?;
    // As the usual sshd images do: a container cannot set its login uid.
    let pam = root("etc/pam.d/sshd");
    let text = std::fs::read_to_string(&pam).map_err(|e| format!("{}: {e}", pam.display()))?;
    std::fs::write(
        &pam,
        text.replace(
            "session    required     pam_loginuid.so",
            "session    optional     pam_loginuid.so",
        ),
    )
    .map_err(|e| format!("{}: {e}", pam.display()))?;
    std::fs::create_dir_all(root("root/.ssh")).map_err(|e| e.to_string())?;
    run(Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(root("root/.ssh/id_ed25519")))?;
    let public = std::fs::read_to_string(root("root/.ssh/id_ed25519.pub"))
        .map_err(|e| format!("the public key: {e}"))?;
    // Root's, and readable by the user sshd reads it as.
    write("home/app/.ssh/authorized_keys", &public, 0o644)?;
    // No device nodes, no package cache in the layer.
    for path in ["dev", "var/cache/apt/archives"] {
        let path = root(path);
        for entry in std::fs::read_dir(&path)
            .map_err(|e| e.to_string())?
            .flatten()
        {
            let p = entry.path();
            let _ = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
        }
    }
    std::fs::write(&complete, RECIPE).map_err(|e| e.to_string())
}

/// Builds the image `name` and imports it into the node's containerd.
fn import(name: &str, images: &mut Images) -> Result<(), String> {
    let cache = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/e2e-start-up");
    let dir = cache.join("rootfs");
    std::fs::create_dir_all(&cache).map_err(|e| e.to_string())?;
    rootfs(&dir)?;
    let work = tempfile::tempdir().map_err(|e| e.to_string())?;
    let out = work.path().join("image.tar");
    let digest =
        write_rootfs_layout(work.path(), &dir, &out, name, None).map_err(|e| e.to_string())?;
    images.import(&out)?;
    eprintln!("image {name} ({digest}): Debian bookworm with openssh, sudo, gosu, supervisor");
    Ok(())
}

/// What became of one pod.
#[derive(Debug)]
struct Outcome {
    /// Whether every marker showed.
    worked: bool,
    /// Whether it held exactly its GPUs, or what it held beyond them.
    gpus: Result<(), String>,
    /// The stored container's security context.
    context: Value,
    /// The admission warnings.
    warnings: Vec<String>,
    /// The log lines that tell (the markers' lines, or the last lines).
    log: String,
}

/// Waits for the log of `container` of pod `name` to hold every marker, and returns it (or
/// the last log seen, when the time is up).
async fn log_with(pods: &Api<Pod>, name: &str, container: &str, markers: &[&str]) -> String {
    let params = LogParams {
        container: Some(container.into()),
        ..LogParams::default()
    };
    let found = wait_for(RUN_TIMEOUT, || {
        let pods = pods.clone();
        let params = params.clone();
        async move {
            let log = pods.logs(name, &params).await.ok()?;
            markers.iter().all(|m| log.contains(m)).then_some(log)
        }
    })
    .await;
    match found {
        Some(log) => log,
        None => pods.logs(name, &params).await.unwrap_or_default(),
    }
}

async fn delete(pods: &Api<Pod>, name: &str) {
    let _ = pods
        .delete(name, &DeleteParams::default().grace_period(0))
        .await;
    wait_for(Duration::from_secs(90), || {
        let pods = pods.clone();
        async move { pods.get_opt(name).await.ok()?.is_none().then_some(()) }
    })
    .await;
}

/// Runs scenario `s` written as `form` in `ns`, and its client where it has one.
async fn run_one(
    env: &Env,
    ns: &str,
    image: &str,
    socket: &Path,
    s: &Scenario,
    form: Form,
) -> Outcome {
    let pod = s.pod(image, form);
    let name = pod["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let created = (env.cluster.create_pod(ns, &pod, false).await).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        created.status.is_success(),
        "{ns}/{name}: {}",
        created.message()
    );
    let context = created.body["spec"]["containers"][0]["securityContext"].clone();
    let pods: Api<Pod> = Api::namespaced(env.client(), ns);
    let seen = wait_for(RUN_TIMEOUT, || {
        let pods = pods.clone();
        let name = name.clone();
        async move {
            let params = LogParams {
                container: Some("main".into()),
                ..LogParams::default()
            };
            Seen::parse(&pods.logs(&name, &params).await.ok()?)
        }
    })
    .await
    .unwrap_or_else(|| panic!("{ns}/{name}: the container never printed what it sees"));
    let allocated = (kubelet_gpus(socket, ns, &name).await.into_iter())
        .find(|(c, _)| c == "main")
        .map(|(_, ids)| ids)
        .unwrap_or_default();
    let mut gpus = seen.holds_exactly(&allocated);
    if gpus.is_ok() && allocated.len() != s.gpus as usize {
        gpus = Err(format!(
            "the kubelet allocated {} GPU(s), not {}",
            allocated.len(),
            s.gpus
        ));
    }
    let log = match s.client {
        None => log_with(&pods, &name, "main", s.markers).await,
        Some(client) => {
            let ip = wait_for(RUN_TIMEOUT, || {
                let pods = pods.clone();
                let name = name.clone();
                async move { pods.get(&name).await.ok()?.status?.pod_ip }
            })
            .await
            .unwrap_or_else(|| panic!("{ns}/{name} got no IP"));
            let client = client(image, &ip);
            let r = (env.cluster.create_pod(ns, &client, false).await)
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(r.status.is_success(), "{ns}/launcher: {}", r.message());
            let log = log_with(&pods, "launcher", "launcher", s.markers).await;
            delete(&pods, "launcher").await;
            log
        }
    };
    let worked = s.markers.iter().all(|m| log.contains(m));
    let tail: Vec<&str> = if worked {
        (log.lines())
            .filter(|l| s.markers.iter().any(|m| l.contains(m)))
            .collect()
    } else {
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(4)..].to_vec()
    };
    delete(&pods, &name).await;
    Outcome {
        worked,
        gpus,
        context,
        warnings: created.warnings,
        log: tail.join(" | "),
    }
}

/// Binds the rewrite to `ns` the `way` asks (the MutatingAdmissionPolicies rendered from
/// `policies`; on way 1 the webhook too) and the shipped start-up warning, and waits until
/// they are in force. Returns the webhook of way 1, to stop once its pods ran.
async fn admission(
    env: &Env,
    way: Way,
    ns: &str,
    api: MutatingApi,
    suffix: &str,
    policies: &[GpuPolicy],
) -> Option<LocalWebhook> {
    let refs: Vec<&GpuPolicy> = policies.iter().collect();
    env.cluster
        .install_mutating_policy(
            render(&refs, |_| true, api),
            api,
            &env.name(suffix),
            &[ns],
            &env.cleanup,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let warning = env
        .install_policy(
            START_UP_WARNINGS,
            &format!("{suffix}-start-up"),
            Some(namespaces_named(&[ns])),
        )
        .await;
    let checked = serde_json::to_string(&warning.status).unwrap_or_default();
    assert!(
        !checked.contains("expressionWarnings"),
        "the API server's type check of {START_UP_WARNINGS}: {checked}"
    );
    let webhook = if way == Way::Webhook {
        let webhook = env.started_webhook().await;
        env.register_webhook(
            &webhook.url,
            &webhook.ca_pem,
            namespaces_named(&[ns]),
            suffix,
        )
        .await;
        // A leak without privilege: only the webhook rewrites it.
        let leak = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "leak"},
            "spec": {"containers": [{"name": "main", "image": "probe",
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}});
        env.until_admission(ns, &leak, "the webhook", |r| {
            r.body["metadata"]["annotations"][gpuwarden_crds::ANNOTATION_REWRITTEN].is_string()
        })
        .await;
        Some(webhook)
    } else {
        None
    };
    let probe = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
        "spec": {"containers": [{"name": "main", "image": "probe", "command": ["sshd"],
            "securityContext": {"privileged": true},
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}});
    env.until_admission(ns, &probe, "the rewrite and its start-up warning", |r| {
        r.body["spec"]["containers"][0]["securityContext"]["privileged"] == json!(false)
            && r.warnings.iter().any(|w| w.contains(WARNING_PREFIX))
    })
    .await;
    webhook
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a node: this machine as a Ready node with NVIDIA's device plugin, root, ctr, debootstrap, ssh-keygen; KUBECONFIG=... cargo test -p gpuwarden-e2e --test start_up -- --ignored --nocapture --test-threads=1"]
async fn rewritten_pods_start_as_they_do_unprivileged_on_a_real_node() {
    let env = Env::new().await;
    let Some(node) = gpu_node(&env.cluster)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    else {
        skip(TEST, NEEDS_GPU_NODE);
        return;
    };
    if let Some(why) = local_node_problem(
        &node,
        &["tar", "sha256sum", "chroot", "ssh-keygen", "debootstrap"],
    ) {
        skip(TEST, &why);
        return;
    }
    let socket = pod_resources_socket();
    let Some(api) = env.cluster.mutating_policy_api().await else {
        skip(TEST, "the server does not serve MutatingAdmissionPolicy");
        return;
    };
    let mut images = Images::default();
    let image = format!("localhost/gpuwarden-e2e/start-up:{}", env.cluster.run_id);
    if let Err(why) = import(&image, &mut images) {
        skip(TEST, &format!("the image could not be made: {why}"));
        return;
    }
    let scenarios = scenarios();
    let mut failures = Vec::new();
    eprintln!(
        "| scenario | way | Pod Security | form | ran | GPUs | securityContext | warning | log"
    );
    for way in [Way::Webhook, Way::ApiServer] {
        for level in ["privileged", "baseline"] {
            let suffix = format!(
                "start-{}-{level}",
                if way == Way::Webhook { "wh" } else { "map" }
            );
            let ns = env.namespace_at(&suffix, level).await;
            let policies = [GpuPolicy::default_policy()];
            let webhook = admission(&env, way, &ns, api, &suffix, &policies).await;
            for s in &scenarios {
                let rewritten = run_one(&env, &ns, &image, &socket, s, Form::Privileged).await;
                let by_hand = run_one(&env, &ns, &image, &socket, s, Form::ByHand).await;
                for (form, o) in [("rewritten", &rewritten), ("by hand", &by_hand)] {
                    let warning = (o.warnings.iter())
                        .filter(|w| w.contains(WARNING_PREFIX))
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(" / ");
                    eprintln!(
                        "| {} | {} | {level} | {form} | {} | {} | {} | {warning} | {}",
                        s.name,
                        way.label(),
                        if o.worked { "yes" } else { "NO" },
                        match &o.gpus {
                            Ok(()) => format!("exactly {}", s.gpus),
                            Err(e) => e.clone(),
                        },
                        o.context,
                        o.log
                    );
                }
                let at = format!("{} ({}, {level})", s.name, way.label());
                if rewritten.worked != by_hand.worked || !rewritten.worked {
                    failures.push(format!(
                        "{at}: rewritten {}, by hand {}",
                        rewritten.log, by_hand.log
                    ));
                }
                for (form, o) in [("rewritten", &rewritten), ("by hand", &by_hand)] {
                    if let Err(e) = &o.gpus {
                        failures.push(format!("{at} {form}: {e}"));
                    }
                }
                if rewritten.context["privileged"] != json!(false) {
                    failures.push(format!("{at}: stored {}", rewritten.context));
                }
                {
                    for phrase in s.warned {
                        if !rewritten.warnings.iter().any(|w| w.contains(phrase)) {
                            failures.push(format!(
                                "{at}: no warning says {phrase:?}: {:?}",
                                rewritten.warnings
                            ));
                        }
                    }
                }
            }
            if let Some(webhook) = webhook {
                webhook.stop().await;
            }
        }
    }

    // Stricter than an ordinary container: the loss is named at admission, then felt.
    let ns = env.namespace_at("start-dropall", "privileged").await;
    let strict = env
        .policy_with(&ns, "dropall", |spec| spec.capabilities.drop_all = true)
        .await;
    let strict = Api::<GpuPolicy>::all(env.client())
        .get(&strict)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // The policy that governs the namespace: its MutatingAdmissionPolicy rewrites nothing
    // (a dropAll policy's pods are the webhook's) and voids the rest.
    let policies = [strict];
    let webhook = admission(&env, Way::Webhook, &ns, api, "start-dropall", &policies).await;
    let worker = &scenarios[0];
    let strict = run_one(&env, &ns, &image, &socket, worker, Form::Privileged).await;
    let warning = (strict.warnings.iter())
        .filter(|w| w.contains("container main"))
        .cloned()
        .collect::<Vec<_>>()
        .join(" / ");
    eprintln!(
        "| {} | webhook, capabilities.dropAll | privileged | rewritten | {} | {:?} | {} | {warning} | {}",
        worker.name,
        if strict.worked { "yes" } else { "no" },
        strict.gpus,
        strict.context,
        strict.log
    );
    if let Some(webhook) = webhook {
        webhook.stop().await;
    }
    // The webhook says it, and the API server's policy in the same words.
    let named = "gpuwarden: at start, container main runs sshd: loses NET_BIND_SERVICE,SETUID,SETGID,SYS_CHROOT";
    let said = (strict.warnings.iter())
        .filter(|w| w.contains(named))
        .count();
    let lost = "gpuwarden: container main: drop ALL capabilities and privilege escalation";
    if said != 2 || !strict.warnings.iter().any(|w| w.starts_with(lost)) || strict.worked {
        failures.push(format!(
            "dropAll: the warnings {:?} should say {named:?} twice (the webhook, the policy) and {lost:?}, and sshd should refuse the launcher (ran: {})",
            strict.warnings, strict.worked
        ));
    }
    env.cleanup.run().await;
    drop(images);
    assert!(
        failures.is_empty(),
        "rewritten pods that do not run as their unprivileged twins:\n{}",
        failures.join("\n")
    );
}
