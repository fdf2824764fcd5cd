//! The refill: while the worker is idle, starts warm sandboxes until the pool holds
//! `warm.per_sku` of each SKU and runtime (`warm.light_per_sku` light ones), at the lowest
//! CPU weight.

use std::time::{Duration, Instant};

use sandq_schemas::{RunMode, Runtime, Sku};
use tracing::{info, warn};

use super::pool::{IndexLease, WarmSandbox};
use super::src_bytes;
use crate::context::Context;
use crate::jobdir::{self, JobDirError, Shape};
use crate::layout;
use crate::run::{self, Launch, RunError};

/// How often the refill looks at the pool.
const REFILL_PERIOD: Duration = Duration::from_millis(200);

/// Why a warm sandbox could not be started (logged; tried again later).
#[derive(Debug, thiserror::Error)]
enum WarmError {
    /// The worker does not serve the SKU.
    #[error("sku not served")]
    NotServed,
    /// Its job dir could not be made.
    #[error(transparent)]
    JobDir(#[from] JobDirError),
    /// Its container could not be started.
    #[error(transparent)]
    Run(#[from] RunError),
}

/// Starts one warm sandbox of `sku` for `runtime`'s jobs in `mode`.
async fn make(ctx: &Context, (sku, runtime, mode): (Sku, Runtime, RunMode), index: IndexLease) -> Result<WarmSandbox, WarmError> {
    let settings = &ctx.settings;
    let sku_settings = settings.skus.get(&sku).copied().ok_or(WarmError::NotServed)?;
    let container_id = format!("j-{:032x}", rand::random::<u128>());
    let id_map = settings.id_map_for(index.index);
    let sandbox_uid = id_map.map_or(settings.sandbox_uid, |m| m.host_base + settings.sandbox_uid);
    let notebook = mode == RunMode::Notebook;
    // The outputs tmpfs a cold job of the runtime and mode gets: Python notebook jobs have room
    // for a session state (crate::job::launch), others do not.
    let state_bytes = if notebook && runtime == Runtime::Python { settings.sessions.max_state_bytes } else { 0 };
    // A Node.js script gets the stdio preload alone, as a cold one (crate::stage::stage).
    let node_script = !notebook && runtime == Runtime::Node;
    let shape = Shape {
        jobs_dir: &settings.jobs_dir,
        container_id: &container_id,
        sandbox_uid,
        // As a cold job's: the quota and room for a session state (crate::stage::stage).
        disk_bytes: if sku_settings.disk_bytes == 0 { 0 } else { sku_settings.disk_bytes + state_bytes },
        python_site: &settings.packages.python_site,
        out_bytes: settings.outputs.max_outputs_bytes + state_bytes,
        src_bytes: src_bytes(settings) + if node_script { layout::NODE_STDIO_JS.len() } else { 0 },
        runner: notebook.then_some(runtime),
        warm: true,
    };
    let dir = jobdir::prepare(&shape).await?;
    if node_script {
        jobdir::write_new(&dir.src.join(layout::NODE_STDIO), layout::NODE_STDIO_JS.as_bytes(), 0o644)?;
    }
    let mut env = run::sandbox_environment(&settings.packages, sku, &sku_settings.limits, Some(settings.outputs.max_outputs_bytes));
    let runner = layout::runner_files(runtime).first().map_or("", |(name, _)| name);
    let interpreter = match runtime {
        Runtime::Python => {
            env.push(format!("SANDQ_PRELOAD={}", settings.warm.preload));
            "python3"
        }
        Runtime::Node => "node",
    };
    // A forked start when the SKU's template is ready: the container holds only a holder (its
    // init, pid 1, as `sleep` never exits on its own), and the job's process is forked into it
    // once it has started. Else as run::command starts a cold job of the runtime, with `--warm`.
    let fork = if notebook && runtime == Runtime::Python && settings.warm.forked { ctx.warm.templates.socket(sku) } else { None };
    let mut args = vec![interpreter.to_owned()];
    if runtime == Runtime::Node {
        args.extend(["--require".to_owned(), format!("/sandq/{}", layout::NODE_STDIO)]);
    }
    args.extend([format!("/sandq/{runner}"), "--warm".to_owned()]);
    if fork.is_some() {
        // Only holds the sandbox: the job's process, forked into it once it has started, says
        // it is ready and waits for its job as a warm runner does.
        args = vec!["/bin/sleep".to_owned(), "infinity".to_owned()];
    }
    if !notebook {
        // A script job's waiter: at the handover it becomes the job's program (`execvpe`), so
        // that the program is the sandbox's init with the job's argv and environment, exactly
        // as a cold start's. Isolated (`-I`: no environment variable, no user site) and without
        // `site` (`-S`): nothing of the sandbox changes before the job.
        args = ["python3", "-I", "-S", "-c", layout::EXEC_WAITER].map(str::to_owned).to_vec();
    }
    let launch = Launch {
        container_id: &container_id,
        args,
        env,
        limits: sku_settings.limits,
        id_map,
        outbound: false,
        warm: true,
        timeout: settings.limits.max_timeout,
        fork: fork.clone(),
    };
    // Warming (the preload: ~0.4 s of CPU) yields to any job that arrives meanwhile: the
    // spec gives a warm sandbox the lowest CPU weight (run::start).
    let started = run::start(&dir, settings, &launch).await?;
    Ok(WarmSandbox { container_id, dir, started, sandbox_uid, index, forked: fork.is_some() })
}

/// Keeps the pool filled while the worker is idle, until `shutdown` turns true.
pub(crate) async fn refill(ctx: Context, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    let pool = ctx.warm.clone();
    if pool.per_sku == 0 {
        return;
    }
    // A pass that started a sandbox is followed at once by another (back-to-back jobs drain
    // a forked pool faster than one a period).
    let mut made = false;
    loop {
        let pause = if made { Duration::ZERO } else { REFILL_PERIOD };
        made = false;
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = pool.taken.notified() => {}
            _ = shutdown.changed() => return,
        }
        if *shutdown.borrow() {
            return;
        }
        let kinds: Vec<(Sku, Runtime, RunMode)> =
            ctx.settings.skus.keys().flat_map(|sku| ctx.settings.warm.kinds().into_iter().map(move |(r, m)| (*sku, r, m))).collect();
        for kind in kinds {
            let (sku, runtime, mode) = kind;
            crate::metrics::warm_ready(sku, pool.ready_count(sku));
            // Only into idle capacity, never beside a running job: except the cheap kinds
            // (super::pool::cheap: a forked start's sandbox, which preloads nothing, a container
            // with a holder: ~0.1 s of the helper's CPU, at the lowest weight; a Node.js one,
            // whose warm-up is the interpreter's start; a script one, whose waiter is a bare
            // interpreter), so that under load jobs still find one.
            let python_notebook = runtime == Runtime::Python && mode == RunMode::Notebook;
            let forked = python_notebook && ctx.warm.templates.socket(sku).is_some();
            // While a SKU's template starts, its Python sandboxes wait for it rather than each
            // preload on its own (the same CPU spent twice).
            if python_notebook && !forked && ctx.warm.templates.starting(sku) {
                continue;
            }
            if (!super::pool::cheap(runtime, mode, forked) && !ctx.capacity.is_idle()) || !pool.wants(kind, forked) {
                continue;
            }
            let Some(index) = pool.free.lock().ok().and_then(|mut f| f.pop()) else { continue };
            let lease = IndexLease { index, free: pool.free.clone() };
            let t0 = Instant::now();
            match make(&ctx, kind, lease).await {
                Ok(warm) => {
                    made = true;
                    info!(%sku, ?runtime, ?mode, container_id = warm.container_id, forked = warm.forked, ms = t0.elapsed().as_millis() as u64, "warm sandbox started");
                    let mut warm = Some(warm);
                    if let Ok(mut ready) = pool.ready.lock() {
                        // Checked under the lock drain() takes: a sandbox made while the
                        // worker shuts down is never left in the pool.
                        if !pool.closed.load(std::sync::atomic::Ordering::SeqCst) {
                            ready.entry(kind).or_default().extend(warm.take());
                        }
                    }
                    if let Some(late) = warm {
                        late.started.discard(&late.dir).await;
                        return;
                    }
                }
                Err(e) => {
                    warn!(%sku, ?runtime, error = %e, "cannot start a warm sandbox; retrying later");
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            }
        }
    }
}
