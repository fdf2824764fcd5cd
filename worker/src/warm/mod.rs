//! Warm sandboxes: for each SKU it serves, the worker keeps `warm.per_sku` sandboxes
//! started before any job arrives: the job dir prepared (its own `/work` filesystem, the
//! `src/` and outputs tmpfs), the container created and started with the SKU's limits,
//! namespaces, seccomp and its own user namespace range, and the notebook runner started in
//! `--warm` mode with its shell made and `warm.preload` imported (a Python one forked from a
//! template: [`template`]), or for script jobs a waiter that `exec`s the job's program at the
//! handover (`oci-bundles/runner/sandq_exec.py`). A job takes one when it is
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
//!   interpreter or a preloaded module reads at start-up ([`read_at_startup`]); script mode
//!   (`warm.script`) with no network: the sandbox's init is a waiter (`sandq_exec.py`) that
//!   `exec`s the job's program at the handover; the others start cold, as do jobs that find
//!   none ready;
//! - refill happens in the background, at the lowest CPU weight until its job is handed over
//!   (a job arriving while a sandbox warms up gets the CPU first); a preloading Python runner
//!   only while no job runs (the worker's capacity is all free), so that warming never slows a
//!   running job, the cheap kinds (forked, Node.js, script: [`pool::cheap`]) also while jobs
//!   run, and a job waits up to 0.3 s for one being made rather than start cold;
//! - warm sandboxes live in this process only: they are removed at shutdown ([`Pool::drain`])
//!   and, after a crash, by the start-up clean-up like any container; a new image, runner or
//!   limit means a new worker process, so a new pool.

pub(crate) mod pool;
mod refill;
pub(crate) mod template;

use sandq_schemas::{NetworkMode, RunMode, Runtime, ValidJob};

pub(crate) use pool::{IndexLease, Pool};
pub(crate) use refill::refill;

/// True when `job` can run in a warm sandbox exactly as it would in a cold one. A script job
/// only needs no network (its program starts at the handover, with its own environment); a
/// notebook job's runner has started before, so it also needs code rather than an entry point
/// and no variable the interpreter reads at start-up.
pub(crate) fn eligible(job: &ValidJob) -> bool {
    match job.spec.run_mode() {
        RunMode::Script => job.spec.network == NetworkMode::None,
        RunMode::Notebook => {
            job.spec.entrypoint.is_none()
                && job.spec.code.is_some()
                && job.spec.network == NetworkMode::None
                && !job.spec.env.keys().any(|name| read_at_startup(job.spec.runtime, name))
        }
    }
}

/// True for an environment variable that `runtime`'s interpreter (or a module a warm Python
/// runner preloads) reads when it starts, so that a warm sandbox, started with the warm-up
/// environment, would not honour the job's value: Python's `PYTHON*` (hash seed, path,
/// warnings, I/O encoding...), the locale (`LANG`, `LC_*`: the standard streams' encoding), `TZ`,
/// and the thread-pool sizes numpy's BLAS reads at import (`OMP_*`, `OPENBLAS_*`, `MKL_*`,
/// `NUMEXPR_*`) and matplotlib's `MPL*`; Node.js's `NODE_*` (`NODE_OPTIONS`,
/// `NODE_EXTRA_CA_CERTS`...), libuv's `UV_*`, `TZ` and the locale. A job setting one starts cold.
pub(crate) fn read_at_startup(runtime: Runtime, name: &str) -> bool {
    let common = name == "TZ" || name == "LANG" || name.starts_with("LC_");
    common
        || match runtime {
            Runtime::Python => ["PYTHON", "OMP_", "OPENBLAS_", "MKL_", "NUMEXPR_", "MPL"].iter().any(|p| name.starts_with(p)),
            Runtime::Node => name.starts_with("NODE_") || name.starts_with("UV_"),
        }
}
/// Room in `src/` for a job's files, warm or cold: the largest code, and a handover (args and
/// env are at most 1 MiB together) or a `resolv.conf`, and the CA bundle of an outbound job.
pub(crate) fn src_bytes(settings: &crate::settings::Settings) -> usize {
    settings.limits.max_code_bytes + (2 << 20) + settings.packages.ca_bundle_bytes()
}
