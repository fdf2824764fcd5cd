//! The pool: warm sandboxes by SKU and runtime, each waiting for one job, and the user
//! namespace ranges they are lent. [`Pool::take`] hands one to a job; [`super::refill`] adds.

use std::collections::HashMap;
use std::sync::Mutex;

use sandq_schemas::{RunMode, Runtime, Sku};
use tracing::warn;

use crate::jobdir::JobDir;
use crate::layout;
use crate::run::Started;

/// Longest a job waits for a cheap warm sandbox that is starting (a forked one, or a Node.js
/// one) rather than start cold.
const FORKED_WAIT: std::time::Duration = std::time::Duration::from_millis(300);

/// A sandbox started ahead of its job.
#[derive(Debug)]
pub(crate) struct WarmSandbox {
    /// Its container id (random).
    pub container_id: String,
    /// Its job dir (the job's files go here).
    pub dir: JobDir,
    /// The running helper and container.
    pub started: Started,
    /// Host uid owning `/work` (the sandbox uid in its user namespace range).
    pub sandbox_uid: u32,
    /// Its user namespace range, given back when the sandbox is gone.
    pub(super) index: IndexLease,
    /// A forked start: the container's init is only a holder, and the job's process, forked
    /// into it from the SKU's template once it started, waits there for the handover.
    pub forked: bool,
}

impl WarmSandbox {
    /// Its dir, its running helper, and its user namespace range's lease, which the job must
    /// hold until the sandbox is deleted (the range is then free for another sandbox). From
    /// here on the sandbox is its job's: it gets the default CPU weight, as a cold start has.
    pub(crate) fn into_parts(self) -> (JobDir, Started, IndexLease) {
        if let Err(e) = crate::sandbox::cgroup::set_cpu_priority(&crate::layout::cgroup_path(&self.container_id), false) {
            warn!(container_id = self.container_id, error = %e, "cannot give the warm sandbox its CPU weight back");
        }
        (self.dir, self.started, self.index)
    }
}

/// The templates' sockets, by SKU, while each is ready ([`super::template`]).
#[derive(Debug, Default)]
pub(crate) struct Templates {
    ready: Mutex<HashMap<Sku, std::path::PathBuf>>,
    /// SKUs whose template is being started for the first time (not yet ready, not yet failed).
    starting: Mutex<std::collections::HashSet<Sku>>,
    /// SKUs whose forked start failed, until when their template is not used.
    failed: Mutex<HashMap<Sku, std::time::Instant>>,
}

/// How long a SKU's template is not used after a forked start of it failed.
const FORK_FAILURE_PAUSE: std::time::Duration = std::time::Duration::from_secs(60);

impl Templates {
    /// The socket of `sku`'s template if it is ready.
    pub(crate) fn socket(&self, sku: Sku) -> Option<std::path::PathBuf> {
        if self.failed.lock().ok()?.get(&sku).is_some_and(|until| std::time::Instant::now() < *until) {
            return None;
        }
        self.ready.lock().ok()?.get(&sku).cloned()
    }

    /// A forked start of `sku` failed: its template is not used for [`FORK_FAILURE_PAUSE`].
    pub(crate) fn fork_failed(&self, sku: Sku) {
        if let Ok(mut failed) = self.failed.lock() {
            failed.insert(sku, std::time::Instant::now() + FORK_FAILURE_PAUSE);
        }
    }

    /// True while `sku`'s template starts for the first time: a warm sandbox of it waits.
    pub(crate) fn starting(&self, sku: Sku) -> bool {
        self.starting.lock().is_ok_and(|s| s.contains(&sku))
    }

    pub(super) fn set_starting(&self, sku: Sku, starting: bool) {
        if let Ok(mut set) = self.starting.lock() {
            if starting {
                set.insert(sku);
            } else {
                set.remove(&sku);
            }
        }
    }

    pub(super) fn set(&self, sku: Sku, socket: Option<std::path::PathBuf>) {
        if let Ok(mut ready) = self.ready.lock() {
            match socket {
                Some(s) => ready.insert(sku, s),
                None => ready.remove(&sku),
            };
        }
    }
}

/// A user namespace range index on loan from the pool, given back on drop.
#[derive(Debug)]
pub(crate) struct IndexLease {
    pub(super) index: usize,
    pub(super) free: std::sync::Arc<Mutex<Vec<usize>>>,
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
pub(crate) struct Pool {
    /// Set by [`Pool::drain`]: no sandbox is added any more.
    pub(super) closed: std::sync::atomic::AtomicBool,
    /// Sandboxes by SKU and runtime, waiting for a job or still warming up.
    pub(super) ready: Mutex<HashMap<(Sku, Runtime, RunMode), Vec<WarmSandbox>>>,
    /// User namespace range indexes not lent to a sandbox.
    pub(super) free: std::sync::Arc<Mutex<Vec<usize>>>,
    /// Sandboxes kept per SKU and runtime (`warm.per_sku`).
    pub(super) per_sku: usize,
    /// Light sandboxes kept per SKU (`warm.light_per_sku`): forked Python notebook ones, and
    /// script ones.
    pub(super) light_per_sku: usize,
    /// The templates forked starts come from ([`super::template`]).
    pub(crate) templates: Templates,
    /// Wakes the refill when a sandbox is taken.
    pub(super) taken: tokio::sync::Notify,
}

/// True for a warm sandbox cheap enough to make while jobs run, and to wait for: a forked one
/// (a container and a fork, no preload), a Node.js notebook one (the interpreter's start) and
/// a script one (a container whose waiter is an interpreter without its site: ~10 ms of CPU).
pub(super) fn cheap(runtime: Runtime, mode: RunMode, forked: bool) -> bool {
    forked || runtime == Runtime::Node || mode == RunMode::Script
}

/// Drops the sandboxes of `list` whose helper has exited (one that died before it was ready:
/// its runner or waiter failed, or its fork did, its template having just ended), so that they
/// neither count against the pool's size nor look like one being made. Their dirs are removed
/// and their id ranges given back on drop.
fn prune(list: &mut Vec<WarmSandbox>) {
    list.retain_mut(|w| {
        let alive = w.started.alive();
        if !alive {
            warn!(container_id = w.container_id, "a warm sandbox ended before its job; discarding it");
        }
        alive
    });
}

/// True when the sandbox's runner (or a forked start's process) is ready and waits for a job.
fn is_ready(warm: &WarmSandbox) -> bool {
    warm.dir.out.join(layout::WARM_READY).exists()
}

impl Pool {
    /// An empty pool keeping `per_sku` sandboxes per SKU (`light_per_sku` light ones), with
    /// the user namespace range indexes `first_index..first_index + ranges` to hand out.
    pub(crate) fn new(per_sku: usize, light_per_sku: usize, first_index: usize, ranges: usize) -> Self {
        Pool {
            closed: std::sync::atomic::AtomicBool::new(false),
            ready: Mutex::new(HashMap::new()),
            free: std::sync::Arc::new(Mutex::new((first_index..first_index + ranges).rev().collect())),
            per_sku,
            light_per_sku,
            templates: Templates::default(),
            taken: tokio::sync::Notify::new(),
        }
    }

    /// Takes a ready warm sandbox of `sku`, `runtime` and `mode` (its runner waiting for a
    /// job), if there is one. Sandboxes found dead on the way are dropped (their dirs removed).
    pub(crate) fn take(&self, sku: Sku, runtime: Runtime, mode: RunMode) -> Option<WarmSandbox> {
        let mut ready = self.ready.lock().ok()?;
        let list = ready.get_mut(&(sku, runtime, mode))?;
        let mut taken = None;
        // A forked sandbox's process was forked when it was made: it runs its job whatever its
        // template has become since (ended, restarted, failed another fork).
        prune(list);
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
        if taken.is_some() {
            self.taken.notify_one();
        }
        taken
    }

    /// [`Pool::take`], or, when none is ready but a cheap one is starting (a forked start's,
    /// whose container is being made: ~0.1 s, against ~0.5 s for a cold start; or a Node.js
    /// one, whose interpreter starts: ~0.1 s, against ~0.17 s cold), that one once it is
    /// ready, waiting at most [`FORKED_WAIT`].
    pub(crate) async fn take_or_wait(&self, sku: Sku, runtime: Runtime, mode: RunMode) -> Option<WarmSandbox> {
        let deadline = tokio::time::Instant::now() + FORKED_WAIT;
        loop {
            if let Some(warm) = self.take(sku, runtime, mode) {
                return Some(warm);
            }
            let cheap = |w: &WarmSandbox| cheap(runtime, mode, w.forked);
            let starting = self.ready.lock().ok().is_some_and(|r| r.get(&(sku, runtime, mode)).is_some_and(|l| l.iter().any(cheap)));
            if !starting || tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// Sandboxes of `sku` (any runtime) whose runner waits for a job (for
    /// `sandq_warm_sandboxes_ready`).
    pub(super) fn ready_count(&self, sku: Sku) -> usize {
        self.ready
            .lock()
            .map(|r| r.iter().filter(|((s, _, _), _)| *s == sku).map(|(_, l)| l.iter().filter(|w| is_ready(w)).count()).sum())
            .unwrap_or(0)
    }

    /// Sandboxes of `kind` (SKU, runtime, mode), ready or warming up, and how many of them are
    /// not forked.
    pub(super) fn count(&self, kind: (Sku, Runtime, RunMode)) -> (usize, usize) {
        self.ready
            .lock()
            .map(|mut r| {
                r.get_mut(&kind).map_or((0, 0), |l| {
                    prune(l);
                    (l.len(), l.iter().filter(|w| !w.forked).count())
                })
            })
            .unwrap_or((0, 0))
    }

    /// Whether another sandbox of `kind` may be made, `forked` or not: up to `light_per_sku`
    /// script ones, or forked ones while all of the kind are forked, else `per_sku` (the memory
    /// set aside covers either: [`crate::settings::WarmSettings::reserve_bytes`]).
    pub(super) fn wants(&self, kind: (Sku, Runtime, RunMode), forked: bool) -> bool {
        let (all, unforked) = self.count(kind);
        let light = kind.2 == RunMode::Script || (forked && unforked == 0);
        let kept = if light { self.light_per_sku.max(self.per_sku) } else { self.per_sku };
        all < kept
    }

    /// Removes every warm sandbox, waiting for each helper to kill and delete its container.
    pub(crate) async fn drain(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        let all: Vec<WarmSandbox> = match self.ready.lock() {
            Ok(mut ready) => {
                for (sku, _, _) in ready.keys() {
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
