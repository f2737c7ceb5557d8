//! `gpuwarden-node-agent`: flags, logging, then the library's `run` or `inspect`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use gpuwarden_crds::error_chain;
use gpuwarden_node_agent::{Config, InspectConfig};

/// gpuwarden node agent: NVML inventory and health, kubelet pod-resources bindings,
/// GpuNode status and per-pod GPU metrics.
#[derive(Parser)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent on a node: sweep, write the GpuNode status, renew the Lease, serve metrics.
    Run(RunArgs),
    /// Print the GpuNode status the agent would write, as YAML, without a cluster.
    Inspect(InspectArgs),
    /// Read the NVIDIA runtime's configuration and CDI specs under --host-root every
    /// --interval and write what they say to --report, for an agent run with
    /// --runtime-report: the agent, which runs as root, then needs no view of the host's
    /// /etc, /usr and /var/run. With --check, only tell (for probes) whether the report is
    /// fresh.
    RuntimeReport(RuntimeReportArgs),
}

/// Where the node keeps the configs the posture is read from, when not where packages and the
/// GPU Operator put them.
#[derive(clap::Args)]
struct PostureArgs {
    /// NVIDIA runtime config.toml to read before the usual places (comma-separated).
    #[arg(
        long = "toolkit-config",
        env = "GPUWARDEN_TOOLKIT_CONFIG",
        value_delimiter = ','
    )]
    toolkit_config: Vec<String>,
    /// containerd config.toml to read before the usual places (comma-separated).
    #[arg(
        long = "containerd-config",
        env = "GPUWARDEN_CONTAINERD_CONFIG",
        value_delimiter = ','
    )]
    containerd_config: Vec<String>,
}

impl PostureArgs {
    fn paths(&self) -> gpuwarden_node_agent::posture::Paths {
        gpuwarden_node_agent::posture::Paths::with_first(
            &self.toolkit_config,
            &self.containerd_config,
        )
    }
}

/// Where the host's sysfs is, for the VFIO devices the kubelet advertises.
#[derive(clap::Args)]
struct SysfsArgs {
    /// The host's sysfs: the IOMMU group, driver and mdev type of each device the kubelet
    /// advertises by PCI address or mediated device UUID are read under it
    /// (bus/pci/devices, bus/mdev/devices). Not under --host-root.
    #[arg(long = "sysfs-root", env = "GPUWARDEN_SYSFS_ROOT", default_value = gpuwarden_node_agent::vfio::DEFAULT_SYSFS_ROOT)]
    sysfs_root: PathBuf,
}

impl SysfsArgs {
    /// `posture`'s paths, with this sysfs.
    fn paths(&self, posture: &PostureArgs) -> gpuwarden_node_agent::posture::Paths {
        gpuwarden_node_agent::posture::Paths {
            sysfs_root: self.sysfs_root.clone(),
            ..posture.paths()
        }
    }
}

#[derive(clap::Args)]
struct RunArgs {
    #[command(flatten)]
    posture: PostureArgs,
    #[command(flatten)]
    sysfs: SysfsArgs,
    /// Name of the node this agent runs on (the downward API's spec.nodeName).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// gpuwarden's namespace, where the agent's Lease lives (the downward API's
    /// metadata.namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = gpuwarden_crds::SYSTEM_NAMESPACE)]
    namespace: String,
    /// Read GPUs from this fake YAML file instead of NVML.
    #[arg(long, env = "GPUWARDEN_FAKE")]
    fake: Option<PathBuf>,
    /// The kubelet's pod-resources socket.
    #[arg(long, env = "GPUWARDEN_POD_RESOURCES_SOCKET", default_value = gpuwarden_node_agent::podresources::DEFAULT_SOCKET)]
    pod_resources_socket: PathBuf,
    /// Where the host's filesystem is mounted: /proc/<pid>/cgroup, the NVIDIA runtime config
    /// and CDI specs are read under it. Use the host's PID namespace (hostPID) or mount the
    /// host's /proc there for process attribution.
    #[arg(long, env = "GPUWARDEN_HOST_ROOT", default_value = "/")]
    host_root: PathBuf,
    /// Read the NVIDIA runtime's configuration from this report, written by the
    /// runtime-report subcommand in another container, instead of under --host-root.
    #[arg(long, env = "GPUWARDEN_RUNTIME_REPORT")]
    runtime_report: Option<PathBuf>,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "GPUWARDEN_LISTEN", default_value_t = SocketAddr::from(([0, 0, 0, 0], gpuwarden_crds::install::NODE_AGENT_PORT)))]
    listen: SocketAddr,
    /// Time between sweeps (Go duration).
    #[arg(long, env = "GPUWARDEN_POLL_INTERVAL", default_value = "10s", value_parser = duration)]
    poll_interval: Duration,
    /// Time between checks of the status on the server and of the runtime config (Go duration).
    #[arg(long, env = "GPUWARDEN_RESYNC_INTERVAL", default_value = "10m", value_parser = duration)]
    resync_interval: Duration,
    /// Log format.
    #[arg(long, env = "GPUWARDEN_LOG_FORMAT", value_enum, default_value_t = LogFormat::Json)]
    log_format: LogFormat,
}

#[derive(clap::Args)]
struct InspectArgs {
    #[command(flatten)]
    posture: PostureArgs,
    #[command(flatten)]
    sysfs: SysfsArgs,
    /// Read GPUs from this fake YAML file instead of NVML.
    #[arg(long, env = "GPUWARDEN_FAKE")]
    fake: Option<PathBuf>,
    /// Also read bindings from the kubelet's pod-resources socket.
    #[arg(long, env = "GPUWARDEN_POD_RESOURCES_SOCKET")]
    pod_resources_socket: Option<PathBuf>,
    /// Where the host's filesystem is mounted.
    #[arg(long, env = "GPUWARDEN_HOST_ROOT", default_value = "/")]
    host_root: PathBuf,
    /// Node name in the output.
    #[arg(long, env = "NODE_NAME", default_value = "this-node")]
    node_name: String,
}

#[derive(clap::Args)]
struct RuntimeReportArgs {
    #[command(flatten)]
    posture: PostureArgs,
    /// Where the host's filesystem is mounted: the runtime's config.toml and the CDI spec
    /// directories are read under it.
    #[arg(long, env = "GPUWARDEN_HOST_ROOT", default_value = "/")]
    host_root: PathBuf,
    /// The report to write (JSON, replaced whole each time).
    #[arg(long, env = "GPUWARDEN_RUNTIME_REPORT", default_value = gpuwarden_node_agent::runtime::DEFAULT_REPORT)]
    report: PathBuf,
    /// Time between reads (Go duration).
    #[arg(long, env = "GPUWARDEN_RUNTIME_REPORT_INTERVAL", default_value = "1m", value_parser = duration)]
    interval: Duration,
    /// Only check that the report was written within three intervals, and exit 0 if so.
    #[arg(long)]
    check: bool,
    /// Log format.
    #[arg(long, env = "GPUWARDEN_LOG_FORMAT", value_enum, default_value_t = LogFormat::Json)]
    log_format: LogFormat,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Json,
    Text,
}

fn duration(s: &str) -> Result<Duration, String> {
    match gpuwarden_crds::duration::parse_duration(s) {
        Ok(d) if d.is_zero() => Err("must be longer than zero".to_owned()),
        Ok(d) => Ok(d),
        Err(e) => Err(e.to_string()),
    }
}

fn init_tracing(format: LogFormat, default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    // Colour only for a person at a terminal, never into a file or a log collector.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // Ignore the error: a provider may already be installed.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let result = match cli.command {
        Command::Run(args) => run(args).await,
        Command::Inspect(args) => inspect(args).await,
        Command::RuntimeReport(args) => runtime_report(args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}", error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    init_tracing(args.log_format, "info");
    let config = Config {
        node_name: args.node_name,
        namespace: args.namespace,
        fake: args.fake,
        pod_resources_socket: args.pod_resources_socket,
        host_root: args.host_root,
        runtime_report: args.runtime_report,
        posture_paths: args.sysfs.paths(&args.posture),
        listen: args.listen,
        poll_interval: args.poll_interval,
        resync_interval: args.resync_interval,
        ..Config::new("")
    };
    let client = kube::Client::try_default().await?;
    gpuwarden_node_agent::run(config, client, shutdown_signal()).await?;
    Ok(())
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

async fn runtime_report(args: RuntimeReportArgs) -> anyhow::Result<()> {
    if args.check {
        gpuwarden_node_agent::runtime::check_report(&args.report, args.interval * 3)?;
        return Ok(());
    }
    init_tracing(args.log_format, "info");
    gpuwarden_node_agent::runtime::report_loop(
        &args.host_root,
        &args.posture.paths(),
        &args.report,
        args.interval,
        shutdown_signal(),
    )
    .await;
    Ok(())
}

async fn inspect(args: InspectArgs) -> anyhow::Result<()> {
    // Only problems on stderr: stdout is the YAML.
    init_tracing(LogFormat::Text, "warn");
    let config = InspectConfig {
        node_name: args.node_name.clone(),
        fake: args.fake,
        pod_resources_socket: args.pod_resources_socket,
        host_root: args.host_root,
        posture_paths: args.sysfs.paths(&args.posture),
    };
    let status = gpuwarden_node_agent::inspect(&config).await?;
    let body = gpuwarden_node_agent::writer::apply_object(&args.node_name, &status);
    print!(
        "# The GpuNode status gpuwarden-node-agent would apply (field manager {}).\n{}",
        gpuwarden_crds::FIELD_MANAGER_NODE_AGENT,
        serde_saphyr::to_string(&body)?
    );
    Ok(())
}
