//! `gpuwarden-webhook`: the mutating admission webhook server.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use gpuwarden_crds::install::{HEALTH_PORT, WEBHOOK_HTTPS_PORT};
use gpuwarden_webhook::mutate::{self, MutateArgs};
use gpuwarden_webhook::server::{self, Limits, ServeOptions};
use gpuwarden_webhook::tls::TlsPaths;

/// mimalloc rather than glibc's malloc: each review makes dozens of short-lived allocations,
/// which mimalloc serves from per-thread free lists in a few instructions, where glibc's
/// frees walked its bins. About 15 % fewer instructions per rewritten review and a higher
/// throughput over HTTPS (see the `http` bench), for about 8 MiB more resident memory.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// gpuwarden's admission webhook: takes `privileged` away from GPU pods without taking
/// their GPUs away.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve POST /mutate over HTTPS, and /healthz, /readyz, /metrics over plain HTTP.
    Serve(ServeArgs),
    /// Rewrite manifests offline as the webhook would, and say why. Exit code 0: all
    /// admitted, 1: something would be denied, 2: bad input.
    Mutate(MutateArgs),
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// HTTPS address of the admission endpoint.
    #[arg(long, env = "GPUWARDEN_LISTEN", default_value_t = SocketAddr::from(([0, 0, 0, 0], WEBHOOK_HTTPS_PORT)))]
    listen: SocketAddr,

    /// Plain-HTTP address of /healthz, /readyz and /metrics.
    #[arg(long, env = "GPUWARDEN_HEALTH_LISTEN", default_value_t = SocketAddr::from(([0, 0, 0, 0], HEALTH_PORT)))]
    health_listen: SocketAddr,

    /// PEM certificate chain served on the HTTPS port; reloaded when the file changes.
    #[arg(
        long,
        env = "GPUWARDEN_TLS_CERT",
        default_value = "/etc/gpuwarden/tls/tls.crt"
    )]
    tls_cert: PathBuf,

    /// PEM private key of the certificate; reloaded when the file changes.
    #[arg(
        long,
        env = "GPUWARDEN_TLS_KEY",
        default_value = "/etc/gpuwarden/tls/tls.key"
    )]
    tls_key: PathBuf,

    /// Seconds between checks of the certificate files for a new pair.
    #[arg(long, env = "GPUWARDEN_TLS_RELOAD_INTERVAL", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    tls_reload_interval: u64,

    /// Reviews handled at once; more wait up to --max-wait-ms, then are denied as overloaded.
    #[arg(long, env = "GPUWARDEN_MAX_CONCURRENCY", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65536))]
    max_concurrency: u32,

    /// Mebibytes of request bodies held in memory at once, across all requests; a review
    /// that finds no room within --max-wait-ms is denied as overloaded.
    #[arg(long, env = "GPUWARDEN_MAX_BUFFERED_MIB", default_value_t = 64, value_parser = clap::value_parser!(u64).range(3..=4096))]
    max_buffered_mib: u64,

    /// Milliseconds a review may wait for a free slot or for room for its body.
    #[arg(long, env = "GPUWARDEN_MAX_WAIT_MS", default_value_t = 1000)]
    max_wait_ms: u64,

    /// Seconds the server keeps accepting after SIGTERM while /readyz reports not ready, so
    /// the API server stops sending before connections are refused.
    #[arg(long, env = "GPUWARDEN_SHUTDOWN_DELAY", default_value_t = 5)]
    shutdown_delay: u64,

    /// Seconds open connections get to finish after the server stops accepting.
    #[arg(long, env = "GPUWARDEN_SHUTDOWN_TIMEOUT", default_value_t = 20)]
    shutdown_timeout: u64,

    /// Serve the GpuPolicy documents in this YAML file instead of watching a cluster
    /// (for trying the webhook outside Kubernetes, e.g. deploy/policies/default.yaml). A
    /// policy with a problem (one the operator would mark not Ready) stops the start.
    #[arg(long, env = "GPUWARDEN_POLICY_FILE")]
    policy_file: Option<PathBuf>,

    /// Log format.
    #[arg(long, env = "GPUWARDEN_LOG_FORMAT", value_enum, default_value_t = LogFormat::Json)]
    log_format: LogFormat,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    /// One JSON object per line.
    Json,
    /// Human-readable lines.
    Text,
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour only for a person at a terminal, never into a file or a log collector.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()));
    match format {
        LogFormat::Json => builder.json().with_current_span(true).init(),
        LogFormat::Text => builder.init(),
    }
}

fn main() -> anyhow::Result<ExitCode> {
    // Ignore the error: it only says a provider is already installed.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            init_tracing(args.log_format);
            serve(args)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Mutate(args) => {
            let code = mutate::run_stdio(&args);
            Ok(ExitCode::from(u8::try_from(code).unwrap_or(2)))
        }
    }
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let defaults = Limits::default();
    let options = ServeOptions {
        listen: args.listen,
        health_listen: args.health_listen,
        tls: TlsPaths {
            cert: args.tls_cert,
            key: args.tls_key,
        },
        cert_poll_interval: Duration::from_secs(args.tls_reload_interval),
        policy_file: args.policy_file,
        limits: Limits {
            max_concurrency: args.max_concurrency as usize,
            max_wait: Duration::from_millis(args.max_wait_ms),
            max_buffered_bytes: usize::try_from(args.max_buffered_mib * 1024 * 1024)
                .unwrap_or(usize::MAX),
            shutdown_delay: Duration::from_secs(args.shutdown_delay),
            drain_timeout: Duration::from_secs(args.shutdown_timeout),
            ..defaults
        },
    };
    let runtime = tokio::runtime::Runtime::new().context("failed to start the async runtime")?;
    runtime
        .block_on(server::run(options))
        .context("webhook server failed")
}
