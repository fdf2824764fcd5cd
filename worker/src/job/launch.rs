//! A sandbox for the job: a warm one that fits takes it (its inputs staged into the running
//! sandbox's dir, its resources grown to the SKU's), or the inputs are staged into a new job
//! dir and a cold sandbox starts.

use sandq_core::time::now_ms;
use sandq_schemas::{NetworkMode, RunMode, Runtime, ValidJob};
use tracing::info;

use super::admit::recheck;
use super::conclude::{Failure, InfraError, CANCELLED_BEFORE_PROGRAM};
use crate::capacity::Reservation;
use crate::context::Context;
use crate::jobdir::JobDir;
use crate::placed::{Restore, Staged};
use crate::publish::Attempt;
use crate::run::{self, Cell, Handover, Started};
use crate::session::Opened;
use crate::settings::SkuSettings;
use crate::stage;
use crate::warm::IndexLease;

/// A sandbox started for the job, its program not yet running.
pub(super) struct Launched {
    /// The helper process, with the container created (cold) or waiting (warm).
    pub started: Started,
    /// What staging recorded of the inputs (for the artifacts' baseline).
    pub staged: Staged,
    /// The session files restored into `/work` (also part of the baseline).
    pub restore: Vec<Restore>,
    /// The cell's place in its session, and whether its state is saved.
    pub cell: Cell,
    /// A warm start's handover (environment, args) and its user namespace range, held until
    /// the job is over; `None` for a cold start.
    pub handover: Option<(Handover, IndexLease)>,
    /// The sandbox's uid on the host (for the session packages archive).
    pub sandbox_uid: u32,
    /// From `running` (capacity taken) to the sandbox ready for the program, ms.
    pub staged_ms: u64,
    /// A warm start forked from a template.
    pub forked: bool,
}

/// Stages the job into a warm sandbox or a cold one and starts it; `reserved` grows by a warm
/// sandbox's warm-up memory when the worker has it free. Returns the job dir apart, so that
/// the caller owns its removal whatever happens next.
///
/// # Errors
/// Staging errors ([`StageError::is_client_fault`](stage::StageError::is_client_fault) sorts
/// them); a cancel or deadline noticed after staging; sandbox start-up failures.
pub(super) async fn launch(
    ctx: &Context,
    job: &ValidJob,
    sku: SkuSettings,
    who: &Attempt,
    container_id: &str,
    opened: Option<&Opened>,
    reserved: &mut Reservation<'_>,
) -> Result<(JobDir, Launched), Failure> {
    let settings = &ctx.settings;
    let bucket = &settings.services.s3.bucket;
    let restore = opened.map(|o| o.restore(ctx)).unwrap_or_default();
    // A session the worker cannot restore (a path the rule refuses, or a file beside a directory
    // of its name, stored before the gateway checked them) is refused here, before a sandbox is
    // taken: `rejected` on the first attempt, its reason naming the file to delete.
    stage::check_restorable(&restore)?;
    // Notebook cells are numbered within their session, and a session's notebook state (its
    // variables) travels with it: restored before the cell, saved after it.
    let notebook = job.spec.run_mode() == RunMode::Notebook;
    // The state is Python's (pickles); a Node.js cell neither reads nor changes it.
    let python_cell = notebook && job.spec.runtime == Runtime::Python;
    // A context (JobSpec::context) has a state and a cell count of its own in the session.
    let context = job.spec.context.as_deref();
    let state = opened.filter(|_| python_cell).and_then(|o| o.state(ctx, context));
    // The packages a job of the session installed (crate::packages), for /sandq/packages.
    let packages = opened.and_then(|o| o.packages(ctx));
    let cell = Cell {
        execution_count: opened.map_or(0, |o| o.manifest.context(context).1) + 1,
        save_state: (python_cell && opened.is_some()).then_some((settings.sessions.max_state_bytes, settings.sessions.max_state_save)),
        restore_state: state.is_some(),
    };
    let outbound = job.spec.network == NetworkMode::Outbound;
    let resolv_conf = outbound.then(|| settings.resolv_conf());
    // A warm sandbox when one fits the job and is ready; else a cold start.
    let warm =
        if crate::warm::eligible(job) { ctx.warm.take_or_wait(job.spec.sku, job.spec.runtime, job.spec.run_mode()).await } else { None };
    let warm_id = warm.as_ref().map(|w| w.container_id.clone());
    let (container_id, sandbox_uid) = match (&warm_id, &warm) {
        (Some(id), Some(w)) => (id.as_str(), w.sandbox_uid),
        _ => (container_id, settings.host_sandbox_uid(who.slot)),
    };
    let forked = warm.as_ref().is_some_and(|w| w.forked);
    if warm.is_some() {
        info!(container_id, warm = true, forked, "container id");
    }
    let place = stage::Placement {
        jobs_dir: &settings.jobs_dir,
        container_id,
        sandbox_uid,
        disk_bytes: sku.disk_bytes,
        outputs_bytes: settings.outputs.max_outputs_bytes,
        restore: &restore,
        resolv_conf: resolv_conf.as_deref(),
        ca_bundle: settings.packages.ca_bundle.as_deref().filter(|_| outbound),
        python_site: &settings.packages.python_site,
        packages: packages.as_ref(),
        cpus: sku.limits.cpus,
        state: state.as_ref(),
        // Every Python notebook job gets room for a session state: the same tmpfs as a warm
        // sandbox's, session or not.
        state_bytes: if python_cell { settings.sessions.max_state_bytes } else { 0 },
        src_bytes: crate::warm::src_bytes(settings),
        state_cache: (&settings.sessions.state_cache.0, settings.sessions.state_cache.1),
    };
    let env = run::environment(job, &settings.packages, &sku.limits, who.number, settings.outputs.max_outputs_bytes, &cell);
    crate::metrics::started(job.spec.submitted_at_ms, who.started_at_ms);
    let (dir, staged, started, handover) = match warm {
        Some(w) => {
            stage::check_quota(job, &place)?;
            let (dir, mut started, lease) = w.into_parts();
            started.pin(sku.limits.cpus).map_err(InfraError::PinWarm)?;
            // The warm-up's memory, on top of the SKU's, when the worker has it free (else the
            // job runs with the warm-up charged to its SKU's memory). A script job's waiter
            // frees its own when it becomes the job's program: none.
            let held = if notebook { started.warmup_memory(settings.warm.memory_bytes) } else { 0 };
            let extra = if reserved.try_grow_memory(held) { held } else { 0 };
            started.hand_over_resources(sku.limits.memory_bytes, extra).map_err(InfraError::WarmMemory)?;
            let staged = stage::fill(job, &dir, &place, &ctx.s3, bucket).await?;
            // Staging can take a while: a cancel that landed meanwhile stops the job here.
            recheck(ctx, job, CANCELLED_BEFORE_PROGRAM).await?;
            let env = env.iter().filter_map(|e| e.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
            let argv = (!notebook).then(|| run::command(job));
            (dir, staged, started, Some((Handover { env, args: job.spec.args.clone(), argv }, lease)))
        }
        None => {
            let (dir, staged) = stage::stage(job, &place, &ctx.s3, bucket).await?;
            // Staging can take a while: a cancel that landed meanwhile stops the job here.
            recheck(ctx, job, CANCELLED_BEFORE_PROGRAM).await?;
            crate::metrics::enter(crate::metrics::Stage::SandboxStart);
            let launch = run::Launch {
                container_id,
                args: run::command(job),
                env,
                limits: sku.limits,
                id_map: settings.id_map_for(who.slot),
                outbound,
                warm: false,
                timeout: job.timeout,
                fork: None,
            };
            let started = run::start(&dir, settings, &launch).await.map_err(InfraError::Run)?;
            (dir, staged, started, None)
        }
    };
    crate::metrics::running(handover.is_some());
    let staged_ms = now_ms().saturating_sub(who.started_at_ms);
    Ok((dir, Launched { started, staged, restore, cell, handover, sandbox_uid, staged_ms, forked }))
}
