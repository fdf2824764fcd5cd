//! `sandq-gateway`: serves the HTTP API (docs/gateway.md) until SIGTERM or SIGINT.

use std::io::IsTerminal as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;

/// The HTTP front door of sandq.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Config file; default $SANDQ_CONFIG, else /etc/sandq/sandq.toml.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Logs as JSON lines.
    #[arg(long, env = "SANDQ_JSON_LOGS")]
    json_logs: bool,
    /// Stop (as on SIGTERM) when standard input reaches its end: a parent that holds the
    /// other end of a pipe (a test) stops the gateway by ending, however it ends.
    #[arg(long)]
    exit_on_stdin_eof: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,lapin=warn"));
    if args.json_logs {
        tracing_subscriber::fmt().json().with_env_filter(filter).with_writer(std::io::stderr).init();
    } else {
        tracing_subscriber::fmt().with_ansi(std::io::stderr().is_terminal()).with_env_filter(filter).with_writer(std::io::stderr).init();
    }
    let path = sandq_core::config::config_path(args.config.as_deref());
    let service: sandq_core::config::ServiceConfig =
        sandq_core::config::load(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut settings = sandq_gateway::settings::load(&path).with_context(|| format!("reading [gateway] of {}", path.display()))?;
    let listener = tokio::net::TcpListener::bind(settings.listen).await.with_context(|| format!("binding {}", settings.listen))?;
    let operator =
        tokio::net::TcpListener::bind(settings.metrics_listen).await.with_context(|| format!("binding {}", settings.metrics_listen))?;
    // The addresses bound (a port 0 is now the one given): `/mcp`'s Host check reads it.
    settings.listen = listener.local_addr()?;
    settings.metrics_listen = operator.local_addr()?;
    let read_timeout = settings.read_timeout;
    let gateway = sandq_gateway::Gateway::connect(service, settings).await.context("connecting to the services")?;
    tokio::spawn(sandq_gateway::dispatch_webhooks(gateway.clone()));
    tracing::info!(addr = %operator.local_addr()?, "serving the operator's endpoints");
    tracing::info!(addr = %listener.local_addr()?, "serving the API");
    let (stop, shutdown) = tokio::sync::watch::channel(false);
    tokio::spawn(sandq_gateway::reap_e2b(gateway.clone(), shutdown.clone()));
    if args.exit_on_stdin_eof {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
            tracing::info!("standard input ended: stopping");
            let _ = stop.send(true);
        });
    }
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("stopping: no new connections; requests under way may finish");
        let _ = stop.send(true);
    });
    tokio::spawn(sandq_gateway::serve(
        operator,
        sandq_gateway::operator_router(gateway.clone()),
        read_timeout,
        shutdown.clone(),
        Duration::from_secs(1),
    ));
    sandq_gateway::serve(listener, sandq_gateway::router(gateway), read_timeout, shutdown, Duration::from_secs(30)).await;
    Ok(())
}
