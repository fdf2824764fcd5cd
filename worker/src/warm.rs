//! Warm sandboxes (issue 8): for each SKU it serves, the worker keeps `warm.per_sku` sandboxes
//! started before any job arrives: the job dir prepared (its own `/work` filesystem, the
//! `src/` and outputs tmpfs), the container created and started with the SKU's limits,
//! namespaces, seccomp and its own user namespace range, and the notebook runner started in
//! `--warm` mode with its shell made and `warm.preload` imported. A job takes one when it is
//! dequeued: its files are staged into the sandbox's dir ([`crate::stage::fill`]), its
//! environment and arguments handed over, and its timeout starts then
//! ([`crate::run::Started::finish`]).
//!
//! Rules:
//! - a warm sandbox serves exactly one job and is then deleted like any other: never reused,
//!   never shared;
//! - only jobs it can serve exactly as a cold start would take one ([`eligible`]): notebook
//!   mode (Python, or Node.js with its runner started in `--warm` mode and its parser loaded),
//!   code rather than an entry point in `/work`, no network, and no environment variable the
//!   interpreter or a preloaded module reads at start-up ([`read_at_startup`]); the others start
//!   cold, as do jobs that find none ready;
//! - refill happens in the background and only while no job runs (the worker's capacity is all
//!   free), at the lowest CPU weight until its job is handed over (a job arriving while a
//!   sandbox warms up gets the CPU first): warming never delays or slows a running job, so
//!   under sustained load the pool drains and jobs start cold;
//! - warm sandboxes live in this process only: they are removed at shutdown ([`Pool::drain`])
//!   and, after a crash, by the start-up clean-up like any container; a new image, runner or
//!   limit means a new worker process, so a new pool.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sandq_schemas::{NetworkMode, RunMode, Runtime, Sku, ValidJob};
use tracing::{info, warn};

use crate::job::Context;
use crate::run::{self, Launch, Started};
use crate::stage::{self, JobDir, Shape};

/// How often the refill looks at the pool.
const REFILL_PERIOD: Duration = Duration::from_millis(200);

/// A sandbox started ahead of its job.
#[derive(Debug)]
pub struct WarmSandbox {
    /// Its container id (random).
    pub container_id: String,
    /// Its job dir (the job's files go here).
    pub dir: JobDir,
    /// The running helper and container.
    pub started: Started,
    /// Host uid owning `/work` (the sandbox uid in its user namespace range).
    pub sandbox_uid: u32,
    /// When it was started.
    pub created: Instant,
    /// Its user namespace range, given back when the sandbox is gone.
    index: IndexLease,
}

impl WarmSandbox {
    /// Its dir, its running helper, and its user namespace range's lease, which the job must
    /// hold until the sandbox is deleted (the range is then free for another sandbox). From
    /// here on the sandbox is its job's: it gets the default CPU weight, as a cold start has.
    pub fn into_parts(self) -> (JobDir, Started, IndexLease) {
        if let Err(e) = crate::sandbox::cgroup::set_cpu_priority(&format!("/sandq/{}", self.container_id), false) {
            warn!(container_id = self.container_id, error = %e, "cannot give the warm sandbox its CPU weight back");
        }
        (self.dir, self.started, self.index)
    }
}

/// A user namespace range index on loan from the pool, given back on drop.
#[derive(Debug)]
pub struct IndexLease {
    index: usize,
    free: std::sync::Arc<Mutex<Vec<usize>>>,
}

impl Drop for IndexLease {
    fn drop(&mut self) {
        if let Ok(mut free) = self.free.lock() {
            free.push(self.index);
        }
    }
}

/// The warm sandboxes of one worker.
#[derive(Debug)]
pub struct Pool {
    /// Set by [`Pool::drain`]: no sandbox is added any more.
    closed: std::sync::atomic::AtomicBool,
    ready: Mutex<HashMap<(Sku, Runtime), Vec<WarmSandbox>>>,
    free: std::sync::Arc<Mutex<Vec<usize>>>,
    per_sku: usize,
}

/// True when the sandbox's runner has preloaded and waits for a job.
fn is_ready(warm: &WarmSandbox) -> bool {
    warm.dir.out.join(stage::WARM_READY).exists()
}

/// True when `job` can run in a warm sandbox exactly as it would in a cold one.
pub fn eligible(job: &ValidJob) -> bool {
    job.spec.run_mode() == RunMode::Notebook
        && job.spec.entrypoint.is_none()
        && job.spec.code.is_some()
        && job.spec.network == NetworkMode::None
        && !job.spec.env.keys().any(|name| read_at_startup(job.spec.runtime, name))
}

/// True for an environment variable that `runtime`'s interpreter (or a module a warm Python
/// runner preloads) reads when it starts, so that a warm sandbox, started with the warm-up
/// environment, would not honour the job's value: Python's `PYTHON*` (hash seed, path,
/// warnings, I/O encoding...), the locale (`LANG`, `LC_*`: the standard streams' encoding), `TZ`,
/// and the thread-pool sizes numpy's BLAS reads at import (`OMP_*`, `OPENBLAS_*`, `MKL_*`,
/// `NUMEXPR_*`) and matplotlib's `MPL*`; Node.js's `NODE_*` (`NODE_OPTIONS`,
/// `NODE_EXTRA_CA_CERTS`...), libuv's `UV_*`, `TZ` and the locale. A job setting one starts cold.
pub fn read_at_startup(runtime: Runtime, name: &str) -> bool {
    let common = name == "TZ" || name == "LANG" || name.starts_with("LC_");
    common
        || match runtime {
            Runtime::Python => ["PYTHON", "OMP_", "OPENBLAS_", "MKL_", "NUMEXPR_", "MPL"].iter().any(|p| name.starts_with(p)),
            Runtime::Node => name.starts_with("NODE_") || name.starts_with("UV_"),
        }
}
impl Pool {
    /// An empty pool keeping `per_sku` sandboxes per SKU, with the user namespace range indexes
    /// `first_index..first_index + ranges` to hand out.
    pub fn new(per_sku: usize, first_index: usize, ranges: usize) -> Self {
        Pool {
            closed: std::sync::atomic::AtomicBool::new(false),
            ready: Mutex::new(HashMap::new()),
            free: std::sync::Arc::new(Mutex::new((first_index..first_index + ranges).rev().collect())),
            per_sku,
        }
    }

    /// Takes a ready warm sandbox of `sku` and `runtime` (its runner waiting for a job), if
    /// there is one. Sandboxes found dead on the way are dropped (their dirs removed).
    pub fn take(&self, sku: Sku, runtime: Runtime) -> Option<WarmSandbox> {
        let mut ready = self.ready.lock().ok()?;
        let list = ready.get_mut(&(sku, runtime))?;
        let mut taken = None;
        while let Some(index) = list.iter().position(is_ready) {
            let mut warm = list.swap_remove(index);
            if warm.started.alive() {
                taken = Some(warm);
                break;
            }
            warn!(container_id = warm.container_id, "a warm sandbox died while waiting; discarding it");
        }
        drop(ready);
        crate::metrics::warm_ready(sku, self.ready_count(sku));
        taken
    }

    /// Sandboxes of `sku` (any runtime) whose runner waits for a job (for
    /// `sandq_warm_sandboxes_ready`).
    fn ready_count(&self, sku: Sku) -> usize {
        self.ready
            .lock()
            .map(|r| r.iter().filter(|((s, _), _)| *s == sku).map(|(_, l)| l.iter().filter(|w| is_ready(w)).count()).sum())
            .unwrap_or(0)
    }

    fn count(&self, sku: Sku, runtime: Runtime) -> usize {
        self.ready.lock().map(|r| r.get(&(sku, runtime)).map_or(0, Vec::len)).unwrap_or(0)
    }

    /// Removes every warm sandbox, waiting for each helper to kill and delete its container.
    pub async fn drain(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        let all: Vec<WarmSandbox> = match self.ready.lock() {
            Ok(mut ready) => {
                for (sku, _) in ready.keys() {
                    crate::metrics::warm_ready(*sku, 0);
                }
                std::mem::take(&mut *ready).into_values().flatten().collect()
            }
            Err(_) => return,
        };
        for warm in all {
            warm.started.discard(&warm.dir).await;
        }
    }
}

/// Room in `src/` for a job's files, warm or cold: the largest code, and a handover (args and
/// env are at most 1 MiB together) or a `resolv.conf`, and the CA bundle of an outbound job.
pub fn src_bytes(settings: &crate::settings::Settings) -> usize {
    settings.limits.max_code_bytes + (2 << 20) + settings.packages.ca_bundle_bytes()
}

/// Starts one warm sandbox of `sku` for `runtime`.
async fn make(ctx: &Context, sku: Sku, runtime: Runtime, index: IndexLease) -> Result<WarmSandbox, String> {
    let settings = &ctx.settings;
    let sku_settings = settings.skus.get(&sku).copied().ok_or("sku not served")?;
    let container_id = format!("j-{:032x}", rand::random::<u128>());
    let id_map = settings.id_map_for(index.index);
    let sandbox_uid = id_map.map_or(settings.sandbox_uid, |m| m.host_base + settings.sandbox_uid);
    // The outputs tmpfs a cold job of the runtime gets: Python notebook jobs have room for a
    // session state (job.rs), Node.js jobs do not.
    let state_bytes = if runtime == Runtime::Python { 2 * settings.max_state_bytes } else { 0 };
    let shape = Shape {
        jobs_dir: &settings.jobs_dir,
        container_id: &container_id,
        sandbox_uid,
        disk_bytes: sku_settings.disk_bytes,
        python_site: &settings.packages.python_site,
        out_bytes: settings.max_outputs_bytes + state_bytes,
        src_bytes: src_bytes(settings),
        runner: Some(runtime),
        warm: true,
    };
    let dir = stage::prepare(&shape).await.map_err(|e| e.to_string())?;
    let mut env = run::sandbox_environment(&settings.packages, sku, &sku_settings.limits, Some(settings.max_outputs_bytes));
    let runner = stage::runner_files(runtime).first().map_or("", |(name, _)| name);
    let interpreter = match runtime {
        Runtime::Python => {
            env.push(format!("SANDQ_PRELOAD={}", settings.warm_preload));
            "python3"
        }
        Runtime::Node => "node",
    };
    // As run::command starts a cold job of the runtime, with `--warm` for the script.
    let mut args = vec![interpreter.to_owned()];
    if runtime == Runtime::Node {
        args.extend(["--require".to_owned(), format!("/sandq/{}", stage::NODE_STDIO)]);
    }
    args.extend([format!("/sandq/{runner}"), "--warm".to_owned()]);
    let launch = Launch {
        container_id: &container_id,
        args,
        env,
        limits: sku_settings.limits,
        id_map,
        outbound: false,
        warm: true,
        timeout: settings.limits.max_timeout,
    };
    // Warming (the preload: ~0.4 s of CPU) yields to any job that arrives meanwhile: the
    // spec gives a warm sandbox the lowest CPU weight (run::start).
    let started = run::start(&dir, settings, &launch).await.map_err(|e| e.to_string())?;
    Ok(WarmSandbox { container_id, dir, started, sandbox_uid, created: Instant::now(), index })
}

/// Keeps the pool filled while the worker is idle, until `shutdown` turns true.
pub async fn refill(ctx: Context, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    let pool = ctx.warm.clone();
    if pool.per_sku == 0 {
        return;
    }
    loop {
        tokio::select! {
            () = tokio::time::sleep(REFILL_PERIOD) => {}
            _ = shutdown.changed() => return,
        }
        if *shutdown.borrow() {
            return;
        }
        let kinds: Vec<(Sku, Runtime)> =
            ctx.settings.skus.keys().flat_map(|sku| ctx.settings.warm_runtimes.iter().map(move |r| (*sku, *r))).collect();
        for (sku, runtime) in kinds {
            crate::metrics::warm_ready(sku, pool.ready_count(sku));
            // Only into idle capacity: never beside a running job.
            if !ctx.capacity.is_idle() || pool.count(sku, runtime) >= pool.per_sku {
                continue;
            }
            let Some(index) = pool.free.lock().ok().and_then(|mut f| f.pop()) else { continue };
            let lease = IndexLease { index, free: pool.free.clone() };
            let t0 = Instant::now();
            match make(&ctx, sku, runtime, lease).await {
                Ok(warm) => {
                    info!(%sku, ?runtime, container_id = warm.container_id, ms = t0.elapsed().as_millis() as u64, "warm sandbox started");
                    let mut warm = Some(warm);
                    if let Ok(mut ready) = pool.ready.lock() {
                        // Checked under the lock drain() takes: a sandbox made while the
                        // worker shuts down is never left in the pool.
                        if !pool.closed.load(std::sync::atomic::Ordering::SeqCst) {
                            ready.entry((sku, runtime)).or_default().extend(warm.take());
                        }
                    }
                    if let Some(late) = warm {
                        late.started.discard(&late.dir).await;
                        return;
                    }
                }
                Err(e) => {
                    warn!(%sku, ?runtime, error = e, "cannot start a warm sandbox; retrying later");
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            }
        }
    }
}
