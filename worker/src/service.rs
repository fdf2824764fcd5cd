//! The worker as a service: connects to Redis and S3, builds the [`Context`], spawns the
//! long-lived tasks (health server, shutdown watch, session reaper, deferred-check sweeper, warm
//! refill) and consumes jobs until shutdown, then drains the warm pool.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tracing::{error, info};

use crate::context::Context;
use crate::settings::Settings;

/// How long in-flight jobs get to stop after the shutdown grace, before the worker exits anyway.
const STOP_LIMIT: Duration = Duration::from_secs(30);

/// Why the worker could not start serving.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Redis did not answer.
    #[error("cannot reach redis at {at}: {source}")]
    Redis {
        /// Where it was looked for.
        at: String,
        /// The connection's error.
        source: sandq_core::results::ResultError,
    },
    /// The bucket is not there or not reachable.
    #[error("cannot reach bucket {bucket} at {endpoint}: {message}")]
    Bucket {
        /// `s3.bucket`.
        bucket: String,
        /// The S3 endpoint.
        endpoint: String,
        /// The SDK's error, in full.
        message: String,
    },
    /// The metrics address cannot be listened on.
    #[error("cannot listen on worker.metrics_addr {addr}: {source}")]
    Listen {
        /// `worker.metrics_addr`.
        addr: std::net::SocketAddr,
        /// The I/O error of binding it.
        source: std::io::Error,
    },
}

/// Runs the worker until `shutdown` resolves (a signal, or stdin's end), then stops taking
/// jobs, gives in-flight ones `shutdown_grace` to finish, kills and requeues the rest, and
/// returns. Exits the process (status 2) when jobs are still held [`STOP_LIMIT`] after the kill.
///
/// # Errors
/// [`StartError`] when a service is unreachable at start.
pub async fn run(settings: Settings, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), StartError> {
    let redis = sandq_core::results::connect(&settings.services.redis)
        .await
        .map_err(|source| StartError::Redis { at: settings.services.redis.describe(), source })?;
    let live_redis = sandq_core::results::connect(&settings.services.redis)
        .await
        .map_err(|source| StartError::Redis { at: settings.services.redis.describe(), source })?;
    let s3 = sandq_core::storage::client(&settings.services.s3);
    s3.head_bucket().bucket(&settings.services.s3.bucket).send().await.map_err(|e| StartError::Bucket {
        bucket: settings.services.s3.bucket.clone(),
        endpoint: settings.services.s3.endpoint.clone(),
        message: format!("{e:?}"),
    })?;
    let (abort_tx, abort_rx) = tokio::sync::watch::channel(false);
    let grace = settings.shutdown_grace;
    let capacity = Arc::new(crate::capacity::Capacity::new(settings.capacity_cpus, settings.capacity_memory_bytes));
    info!(cpus = settings.capacity_cpus, memory_bytes = settings.capacity_memory_bytes, skus = ?settings.skus.keys().collect::<Vec<_>>(), "capacity");
    let warm = Arc::new(crate::warm::Pool::new(
        settings.warm.per_sku,
        settings.warm.light_per_sku,
        settings.total_slots(),
        settings.warm_ranges(),
    ));
    crate::metrics::init(settings.capacity_cpus, settings.capacity_memory_bytes, settings.skus.keys().copied());
    let addr = settings.metrics_addr;
    let listener = crate::health::bind(addr).await.map_err(|source| StartError::Listen { addr, source })?;
    // A cache of states left by an earlier run of this worker id is not trusted to be whole.
    let _ = std::fs::remove_dir_all(&settings.sessions.state_cache.0);
    let ctx = Context { settings: Arc::new(settings), s3, redis, live_redis, abort: abort_rx, capacity, warm, in_flight: Arc::default() };
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(crate::health::serve(listener, ctx.clone(), rx.clone()));
    let in_flight = ctx.in_flight.clone();
    tokio::spawn(async move {
        shutdown.await;
        info!(grace = %humantime::format_duration(grace), "shutting down: no new jobs; finishing in-flight jobs");
        let _ = tx.send(true);
        tokio::time::sleep(grace).await;
        info!("shutdown grace over: killing and requeueing in-flight jobs");
        let _ = abort_tx.send(true);
        // Killing a job takes a second or two; a worker still here long after is stuck on
        // something: it exits rather than hang, naming what it held. The broker requeues the
        // unsettled deliveries when the connection goes, and each sandbox helper kills its
        // container when the worker's end of its pipe closes; the next start of this worker id
        // removes what is left.
        tokio::time::sleep(STOP_LIMIT).await;
        error!(jobs = ?in_flight.ids(), "still running {} after the kill: exiting", humantime::format_duration(STOP_LIMIT));
        std::process::exit(2);
    });
    tokio::spawn(crate::session::reaper(ctx.clone(), rx.clone()));
    tokio::spawn(crate::dead_letter::sweeper(ctx.clone(), rx.clone()));
    tokio::spawn(crate::warm::template::serve(ctx.clone(), rx.clone()));
    tokio::spawn(crate::warm::refill(ctx.clone(), rx.clone()));
    info!(
        worker_id = %ctx.settings.worker_id,
        rootfs = %ctx.settings.rootfs.display(),
        userns_host_base = ctx.settings.id_map.map(|m| m.host_base),
        userns_lease = ctx.settings.userns_lease.as_ref().map(|(k, _)| *k),
        "worker started"
    );
    crate::consume::run(ctx.clone(), rx).await;
    ctx.warm.drain().await;
    info!("warm sandboxes removed");
    // The states' copies are only worth keeping while this worker runs its sessions' cells.
    let _ = std::fs::remove_dir_all(&ctx.settings.sessions.state_cache.0);
    info!("worker stopped");
    Ok(())
}
