//! The pool: warm sandboxes by SKU and runtime, each waiting for one job, and the user
//! namespace ranges they are lent. [`Pool::take`] hands one to a job; [`super::refill`] adds.

use std::collections::HashMap;
use std::sync::Mutex;

use sandq_schemas::{Runtime, Sku};
use tracing::warn;

use crate::jobdir::JobDir;
use crate::layout;
use crate::run::Started;

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
    pub(super) ready: Mutex<HashMap<(Sku, Runtime), Vec<WarmSandbox>>>,
    /// User namespace range indexes not lent to a sandbox.
    pub(super) free: std::sync::Arc<Mutex<Vec<usize>>>,
    /// Sandboxes kept per SKU and runtime.
    pub(super) per_sku: usize,
}

/// True when the sandbox's runner has preloaded and waits for a job.
fn is_ready(warm: &WarmSandbox) -> bool {
    warm.dir.out.join(layout::WARM_READY).exists()
}

impl Pool {
    /// An empty pool keeping `per_sku` sandboxes per SKU, with the user namespace range indexes
    /// `first_index..first_index + ranges` to hand out.
    pub(crate) fn new(per_sku: usize, first_index: usize, ranges: usize) -> Self {
        Pool {
            closed: std::sync::atomic::AtomicBool::new(false),
            ready: Mutex::new(HashMap::new()),
            free: std::sync::Arc::new(Mutex::new((first_index..first_index + ranges).rev().collect())),
            per_sku,
        }
    }

    /// Takes a ready warm sandbox of `sku` and `runtime` (its runner waiting for a job), if
    /// there is one. Sandboxes found dead on the way are dropped (their dirs removed).
    pub(crate) fn take(&self, sku: Sku, runtime: Runtime) -> Option<WarmSandbox> {
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
    pub(super) fn ready_count(&self, sku: Sku) -> usize {
        self.ready
            .lock()
            .map(|r| r.iter().filter(|((s, _), _)| *s == sku).map(|(_, l)| l.iter().filter(|w| is_ready(w)).count()).sum())
            .unwrap_or(0)
    }

    /// Sandboxes of `sku` and `runtime`, ready or warming up.
    pub(super) fn count(&self, sku: Sku, runtime: Runtime) -> usize {
        self.ready.lock().map(|r| r.get(&(sku, runtime)).map_or(0, Vec::len)).unwrap_or(0)
    }

    /// Removes every warm sandbox, waiting for each helper to kill and delete its container.
    pub(crate) async fn drain(&self) {
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
