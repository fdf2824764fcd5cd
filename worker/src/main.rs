//! `sandq-worker`: consumes jobs from RabbitMQ and runs them in youki sandboxes.
//!
//! Start-up order matters: the config is read and checked, the host made ready
//! ([`sandq_worker::host::prepare`]: leftover containers of a previous run, a worker killed with
//! SIGKILL, are deleted through the helper), then the multi-threaded tokio runtime starts and
//! every task of the worker is spawned. libcontainer itself never runs in this process.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use sandq_worker::settings::RawConfig;
use tokio::io::AsyncReadExt;

/// sandq worker.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Config file (TOML); default $SANDQ_CONFIG, else /etc/sandq/sandq.toml. `SANDQ__*`
    /// environment variables override it (`SANDQ__WORKER__ID=w1`).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Log as JSON lines instead of text.
    #[arg(long)]
    json_logs: bool,
    /// Shut down gracefully when stdin reaches end-of-file (for supervisors and tests that
    /// hold a pipe to the worker).
    #[arg(long)]
    exit_on_stdin_eof: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,aws=warn,lapin=warn"));
    if args.json_logs {
        tracing_subscriber::fmt().json().with_env_filter(filter).with_writer(std::io::stderr).init();
    } else {
        use std::io::IsTerminal;
        let ansi = std::io::stderr().is_terminal();
        tracing_subscriber::fmt().with_ansi(ansi).with_env_filter(filter).with_writer(std::io::stderr).init();
    }
    let path = sandq_core::config::config_path(args.config.as_deref());
    let raw: RawConfig = sandq_core::config::load(&path)?;
    let nameservers_configured = raw.worker.nameservers.is_some();
    let settings = raw.validate().with_context(|| format!("config {}", path.display()))?;
    sandq_worker::host::prepare(&settings, nameservers_configured).context("cannot prepare the host")?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let result = runtime.block_on(sandq_worker::service::run(settings, wait_for_shutdown_signal(args.exit_on_stdin_eof)));
    // A blocking stdin read (--exit-on-stdin-eof) must not keep the process alive after SIGTERM.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    Ok(result?)
}

async fn wait_for_shutdown_signal(exit_on_stdin_eof: bool) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return std::future::pending().await;
    };
    let stdin_eof = async {
        if !exit_on_stdin_eof {
            return std::future::pending().await;
        }
        let mut stdin = tokio::io::stdin();
        let mut buf = [0u8; 256];
        while let Ok(n) = stdin.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
        () = stdin_eof => {}
    }
}
