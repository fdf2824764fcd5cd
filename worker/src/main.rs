//! `sandq-worker`: consumes jobs from RabbitMQ and runs them in youki sandboxes.
//!
//! Start-up order matters: leftover containers of a previous run (a worker killed with
//! SIGKILL) are deleted through the helper, then the multi-threaded tokio runtime starts.
//! libcontainer itself never runs in this process.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser;
use sandq_worker::job::Context;
use sandq_worker::settings::RawConfig;
use tokio::io::AsyncReadExt;
use tracing::{error, info};

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

/// How long in-flight jobs get to stop after the shutdown grace, before the worker exits anyway.
const STOP_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

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
    let path = sandq_submitter::config::config_path(args.config.as_deref());
    let raw: RawConfig = sandq_submitter::config::load(&path)?;
    let nameservers_configured = raw.worker.nameservers.is_some();
    let settings = raw.validate().with_context(|| format!("config {}", path.display()))?;
    for dir in [&settings.jobs_dir, &settings.state_root] {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    // Host tables every sandbox draws from (open files, pids, ptys), sized so that the
    // sandboxes' own limits run out first (eighth security review G1, G2).
    for (path, from, to) in sandq_worker::sandbox::host_limits::ensure(&settings)? {
        info!(path, from, to, "raised a host-wide limit the sandboxes share");
    }
    if sandq_worker::sandbox::host_limits::ensure_sysfs_writable()? {
        info!("remounted /sys read-write: its sysfs was read-only (a Kubernetes pod's), which sandboxes cannot mount their own beside");
    }
    // Crash safety: side cgroups (a packages tar still running), containers and job dirs of a
    // previous run of this worker id.
    sandq_worker::sandbox::cgroup::set_side_owner(&format!("{}\0{}", settings.worker_id, settings.state_root.display()));
    let removed = sandq_worker::sandbox::cgroup::remove_leftover_side_cgroups();
    if removed > 0 {
        info!(removed, "removed side cgroups an earlier run of this worker left (their processes killed)");
    }
    let status = std::process::Command::new(&settings.container_helper)
        .arg("cleanup")
        .arg(&settings.state_root)
        .env_clear()
        .status()
        .context("cannot run sandq-container cleanup")?;
    anyhow::ensure!(status.success(), "sandq-container cleanup failed: {status}");
    for entry in std::fs::read_dir(&settings.jobs_dir)?.flatten() {
        sandq_worker::stage::remove_job_dir(&entry.path());
        anyhow::ensure!(!entry.path().exists(), "cannot remove {}", entry.path().display());
    }
    if settings.outbound_network {
        if !nameservers_configured {
            for ns in sandq_worker::sandbox::network::host_nameservers().into_iter().filter(|ns| !settings.nameservers.contains(ns)) {
                tracing::warn!(%ns, nameservers = ?settings.nameservers, "the host's nameserver is in a blocked range: outbound sandboxes use others (set worker.nameservers to name it on purpose)");
            }
        }
        sandq_worker::sandbox::network::write_resolv_conf(&settings.resolv_conf(), &settings.nameservers)
            .context("cannot write the sandboxes' resolv.conf")?;
        sandq_worker::sandbox::network::setup_host(&settings.nameservers, &settings.blocked_ranges)
            .map_err(|e| anyhow::anyhow!("cannot set up the outbound network (set worker.outbound_network = false to run without it): {e}"))?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let result = runtime.block_on(async_main(settings, args.exit_on_stdin_eof));
    // A blocking stdin read (--exit-on-stdin-eof) must not keep the process alive after SIGTERM.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    result
}

async fn async_main(settings: sandq_worker::settings::Settings, exit_on_stdin_eof: bool) -> anyhow::Result<()> {
    let redis = sandq_submitter::results::connect(&settings.services.redis)
        .await
        .with_context(|| format!("cannot reach redis at {}", settings.services.redis.describe()))?;
    let s3 = sandq_submitter::storage::client(&settings.services.s3);
    s3.head_bucket()
        .bucket(&settings.services.s3.bucket)
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("{:?}", e))
        .with_context(|| format!("cannot reach bucket {} at {}", settings.services.s3.bucket, settings.services.s3.endpoint))?;
    let (abort_tx, abort_rx) = tokio::sync::watch::channel(false);
    let grace = settings.shutdown_grace;
    let capacity = Arc::new(sandq_worker::capacity::Capacity::new(settings.capacity_cpus, settings.capacity_memory_bytes));
    info!(cpus = settings.capacity_cpus, memory_bytes = settings.capacity_memory_bytes, skus = ?settings.skus.keys().collect::<Vec<_>>(), "capacity");
    let warm = Arc::new(sandq_worker::warm::Pool::new(settings.warm_per_sku, settings.total_slots(), settings.warm_ranges()));
    sandq_worker::metrics::init(settings.capacity_cpus, settings.capacity_memory_bytes, settings.skus.keys().copied());
    let metrics_addr = settings.metrics_addr;
    let listener = sandq_worker::health::bind(metrics_addr)
        .await
        .with_context(|| format!("cannot listen on worker.metrics_addr {metrics_addr}"))?;
    let ctx = Context { settings: Arc::new(settings), s3, redis, abort: abort_rx, capacity, warm, in_flight: Arc::default() };
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(sandq_worker::health::serve(listener, ctx.clone(), rx.clone()));
    let in_flight = ctx.in_flight.clone();
    tokio::spawn(async move {
        wait_for_shutdown_signal(exit_on_stdin_eof).await;
        info!(grace = %humantime::format_duration(grace), "shutting down: no new jobs; finishing in-flight jobs");
        let _ = tx.send(true);
        tokio::time::sleep(grace).await;
        info!("shutdown grace over: killing and requeueing in-flight jobs");
        let _ = abort_tx.send(true);
        // Killing a job takes a second or two; a worker still here long after is stuck on
        // something (seen twice, cause not found): it exits rather than hang, naming what it
        // held. The broker requeues the unsettled deliveries when the connection goes, and each
        // sandbox helper kills its container when the worker's end of its pipe closes; the next
        // start of this worker id removes what is left.
        tokio::time::sleep(STOP_LIMIT).await;
        error!(jobs = ?in_flight.ids(), "still running {} after the kill: exiting", humantime::format_duration(STOP_LIMIT));
        std::process::exit(2);
    });
    tokio::spawn(sandq_worker::session::reaper(ctx.clone(), rx.clone()));
    tokio::spawn(sandq_worker::dead_letter::sweeper(ctx.clone(), rx.clone()));
    tokio::spawn(sandq_worker::warm::refill(ctx.clone(), rx.clone()));
    info!(
        worker_id = %ctx.settings.worker_id,
        rootfs = %ctx.settings.rootfs.display(),
        userns_host_base = ctx.settings.id_map.map(|m| m.host_base),
        userns_lease = ctx.settings.userns_lease.as_ref().map(|(k, _)| *k),
        "worker started"
    );
    sandq_worker::consume::run(ctx.clone(), rx).await;
    ctx.warm.drain().await;
    info!("worker stopped");
    Ok(())
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
