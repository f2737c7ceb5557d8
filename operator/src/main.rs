//! `gpuwarden-operator run`: GpuNode lifecycle and conditions, GpuPolicy status, webhook
//! certificates, behind Lease-based leader election.

use std::net::SocketAddr;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use gpuwarden_operator::Config;

/// gpuwarden operator.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the operator against the cluster in KUBECONFIG or the in-cluster service account.
    Run(RunArgs),
    /// Before the chart's objects are deleted: delete every GpuPolicy and what the operator
    /// kept for them, and hand the CRDs to garbage collection through a ClusterRole that the
    /// uninstall deletes. The Helm chart's pre-delete hook.
    Uninstall(UninstallArgs),
}

#[derive(Parser, Debug)]
struct UninstallArgs {
    /// The ClusterRole whose deletion deletes the CRDs.
    #[arg(long, default_value = "gpuwarden-operator")]
    owner_cluster_role: String,

    /// How long to wait for the GpuPolicies to go (Go duration).
    #[arg(long, default_value = "2m", value_parser = parse_timeout)]
    timeout: std::time::Duration,

    /// Log format.
    #[arg(long, env = "GPUWARDEN_LOG_FORMAT", value_enum, default_value = "json")]
    log_format: LogFormat,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Json,
    Text,
}

#[derive(Parser, Debug)]
struct RunArgs {
    /// gpuwarden's namespace (the downward API's metadata.namespace): holds the webhook TLS
    /// Secret, the leader Lease and the node agents' Leases.
    #[arg(long, env = "POD_NAMESPACE", default_value = gpuwarden_crds::SYSTEM_NAMESPACE)]
    namespace: String,

    /// Address of the plain-HTTP /healthz, /readyz and /metrics listener.
    #[arg(long, env = "GPUWARDEN_HEALTH_LISTEN", default_value = "0.0.0.0:8080")]
    health_listen: SocketAddr,

    /// Keep the webhook's CA, serving certificate (Secret gpuwarden-webhook-tls) and the
    /// MutatingWebhookConfiguration's caBundle up to date. Turn off when cert-manager does it.
    #[arg(long, env = "GPUWARDEN_MANAGE_WEBHOOK_CERTIFICATES", default_value_t = true, action = clap::ArgAction::Set)]
    manage_webhook_certificates: bool,

    /// Taint nodes gpuwarden.io/gpu-unhealthy:NoSchedule while their GpuNode says Healthy=False,
    /// and remove the taint when they are healthy again.
    #[arg(long, env = "GPUWARDEN_TAINT_UNHEALTHY_NODES", default_value_t = false)]
    taint_unhealthy_nodes: bool,

    /// Keep a MutatingAdmissionPolicy per GpuPolicy in Enforce mode that rewrites the
    /// privileged GPU pods its CEL can (the webhook rewrites the others) and sets
    /// NVIDIA_VISIBLE_DEVICES=void on containers that hold no GPU (a warning
    /// ValidatingAdmissionPolicy in Audit mode), where the API server serves
    /// MutatingAdmissionPolicy. Turned off, the operator writes none and deletes none: remove
    /// those it kept with `kubectl delete mutatingadmissionpolicies,mutatingadmissionpolicybindings,validatingadmissionpolicies,validatingadmissionpolicybindings -l app.kubernetes.io/managed-by=gpuwarden-operator`.
    #[arg(long, env = "GPUWARDEN_ADMISSION_POLICIES", default_value_t = true, action = clap::ArgAction::Set)]
    admission_policies: bool,

    /// Keep one wgpolicyk8s.io PolicyReport (and openreports.io Report) named gpuwarden per
    /// governed namespace, listing what the webhook would change or refuse in the pods that
    /// run there, where the API server serves either kind. This caches every Pod; turned
    /// off, the operator watches no Pods and writes no reports.
    #[arg(long, env = "GPUWARDEN_POLICY_REPORTS", default_value_t = true, action = clap::ArgAction::Set)]
    policy_reports: bool,

    /// Elect a leader through the Lease gpuwarden-operator-leader; only the leader writes.
    /// Turn off only when exactly one replica runs.
    #[arg(long, env = "GPUWARDEN_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    leader_election: bool,

    /// Most reconciles in flight per controller.
    #[arg(long, env = "GPUWARDEN_CONCURRENCY", default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    concurrency: u16,

    /// Lifetime of the webhook serving certificate (Go duration, e.g. 8760h); it is renewed
    /// when less than a third is left. The CA lives four times as long.
    #[arg(long, env = "GPUWARDEN_CERT_VALIDITY", default_value = "8760h", value_parser = parse_validity)]
    cert_validity: std::time::Duration,

    /// This replica's identity in the leader Lease.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,

    /// Log format.
    #[arg(long, env = "GPUWARDEN_LOG_FORMAT", value_enum, default_value = "json")]
    log_format: LogFormat,
}

fn parse_validity(s: &str) -> Result<std::time::Duration, String> {
    let d = gpuwarden_crds::duration::parse_duration(s).map_err(|e| e.to_string())?;
    if d < std::time::Duration::from_secs(3600) {
        return Err(format!("certificate validity {s} is shorter than 1h"));
    }
    Ok(d)
}

fn parse_timeout(s: &str) -> Result<std::time::Duration, String> {
    gpuwarden_crds::duration::parse_duration(s).map_err(|e| e.to_string())
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour only for a person at a terminal, never into a file or a log collector.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()));
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Two rustls providers would make the first TLS handshake panic; ring is the one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = match cli.command {
        Command::Run(args) => args,
        Command::Uninstall(args) => return uninstall(args).await,
    };
    init_tracing(args.log_format);

    let mut config = Config::new(args.namespace);
    config.health_listen = args.health_listen;
    config.manage_webhook_certificates = args.manage_webhook_certificates;
    config.taint_unhealthy_nodes = args.taint_unhealthy_nodes;
    config.admission_policies = args.admission_policies;
    config.policy_reports = args.policy_reports;
    config.leader_election = args.leader_election;
    config.concurrency = args.concurrency;
    config.cert_validity = args.cert_validity;
    if let Some(identity) = args.identity {
        config.identity = identity;
    } else if let Ok(host) = std::env::var("HOSTNAME") {
        config.identity = format!("{host}-{}", std::process::id());
    }

    let client = kube::Client::try_default().await.context(
        "failed to build a Kubernetes client from KUBECONFIG or the in-cluster service account",
    )?;
    gpuwarden_operator::run(config, client, shutdown_signal())
        .await
        .context("operator failed")
}

async fn uninstall(args: UninstallArgs) -> anyhow::Result<()> {
    init_tracing(args.log_format);
    let client = kube::Client::try_default().await.context(
        "failed to build a Kubernetes client from KUBECONFIG or the in-cluster service account",
    )?;
    let config = gpuwarden_operator::uninstall::UninstallConfig {
        owner_cluster_role: args.owner_cluster_role,
        timeout: args.timeout,
    };
    gpuwarden_operator::uninstall::uninstall(client, &config)
        .await
        .context("uninstall failed")
}
