//! Is the job still wanted? Checked when a delivery is taken and again after every wait
//! (session lock, capacity, staging), since a duplicate delivery, a cancel or the job's
//! deadline may land meanwhile; then the capacity is taken and `running` written.

use sandq_core::results;
use sandq_core::sessions::SessionError;
use sandq_core::time::now_ms;
use sandq_schemas::{JobStatus, ValidJob};
use tracing::{error, info};

use super::conclude::{self, Failure, InfraError, Rejection};
use crate::ack::Outcome;
use crate::context::Context;
use crate::publish::{self, Attempt};
use crate::settings::SkuSettings;

/// Whether a taken job should still run.
enum Wanted {
    /// Yes; `started` when its record says `running` (an attempt of it started already).
    Yes { started: bool },
    /// It already has a terminal result (a duplicate delivery): ack without running.
    Finished,
    /// A client cancelled it.
    Cancelled,
}

/// The first check of a taken delivery: the SKU's settings when the job is to run; otherwise
/// the delivery's [`Outcome`], with the result stored when there is one to store (cancelled,
/// expired in the queue, a SKU this worker does not serve).
pub(super) async fn admit(ctx: &Context, job: &ValidJob, who: &Attempt) -> Result<SkuSettings, Outcome> {
    let attempt = who.number;
    let started = match still_wanted(ctx, job).await {
        Ok(Wanted::Yes { started }) => started,
        Ok(Wanted::Finished) => {
            info!("job already has a terminal result; acking the duplicate");
            return Err(Outcome::Stored);
        }
        Ok(Wanted::Cancelled) => {
            return Err(conclude::conclude(ctx, job, who, Err(Failure::Cancelled("cancelled before it started"))).await)
        }
        Err(e) => {
            error!(reason = %e, "cannot read the job's state");
            return Err(Outcome::Infrastructure { attempt, final_result_stored: false });
        }
    };
    if let Some(late) = late_ms(job, started, who.started_at_ms) {
        let mut result = publish::base(job, who, JobStatus::Expired);
        result.reason = Some(format!("its deadline passed {late} ms before a worker took it"));
        result.finished_at_ms = Some(now_ms());
        info!("job expired in the queue");
        return Err(conclude::store_or_retry(ctx, &result, job.result_ttl, attempt).await);
    }
    // Validation only lets through SKUs this worker serves.
    let Some(sku) = ctx.settings.skus.get(&job.spec.sku).copied() else {
        let mut result = publish::base(job, who, JobStatus::Rejected);
        result.reason = Some(format!("sku {} is not served by this worker", job.spec.sku));
        return Err(conclude::store_or_retry(ctx, &result, job.result_ttl, attempt).await);
    };
    Ok(sku)
}

/// Reads the job's stored status and cancel key.
async fn still_wanted(ctx: &Context, job: &ValidJob) -> Result<Wanted, InfraError> {
    let mut redis = ctx.redis.clone();
    let names = &ctx.settings.names;
    // The status field only: the record is the client's to write while `queued`, of any size.
    let started = match results::status(&mut redis, names, &job.spec.job_id).await {
        Ok(Some(status)) if status.is_terminal() => return Ok(Wanted::Finished),
        Ok(status) => status == Some(JobStatus::Running),
        Err(e) => return Err(InfraError::ReadStatus(e)),
    };
    match results::cancel_requested(&mut redis, names, &job.spec.job_id).await {
        Ok(true) => Ok(Wanted::Cancelled),
        Ok(false) => Ok(Wanted::Yes { started }),
        Err(e) => Err(InfraError::ReadCancel(e)),
    }
}

/// How late a job is to start (ms past its `deadline_ms`, its latest start), if it is; `None`
/// once an attempt of it has started (its record says `running`: the deadline was met, and
/// this delivery is a retry or a duplicate of that attempt, which must not be expired over it).
fn late_ms(job: &ValidJob, started: bool, now_ms: u64) -> Option<u64> {
    let deadline = job.spec.deadline_ms.filter(|_| !started)?;
    (deadline < now_ms).then(|| now_ms - deadline)
}

/// Fails with [`Failure::Duplicate`], [`Failure::Cancelled`] (reason `when`) or
/// [`Failure::Expired`] when the job must not run on.
pub(super) async fn recheck(ctx: &Context, job: &ValidJob, when: &'static str) -> Result<(), Failure> {
    match still_wanted(ctx, job).await? {
        // The deadline too: a job that waited past it (for its session or for capacity) is
        // still `queued`, and is not started.
        Wanted::Yes { started } => match late_ms(job, started, now_ms()) {
            Some(late) => Err(Failure::Expired(format!(
                "its deadline passed {late} ms before it could start (it waited for its session or for capacity)"
            ))),
            None => Ok(()),
        },
        Wanted::Finished => Err(Failure::Duplicate),
        Wanted::Cancelled => Err(Failure::Cancelled(when)),
    }
}

/// Why a session could not be opened: busy (the client's, after `sessions.lock_wait`), held
/// by another attempt of this very job (a duplicate delivery: handed back), or sandq's.
pub(super) async fn session_failure(ctx: &Context, job: &ValidJob, e: SessionError) -> Failure {
    match e {
        // The lock is held by an attempt of this very job (a duplicate delivery of a running
        // session job): not a busy session.
        SessionError::Busy { .. } if running_elsewhere(ctx, job).await => Failure::RunningElsewhere,
        SessionError::Busy { .. } => Failure::Rejected(Rejection::SessionBusy {
            source: e,
            waited: humantime::format_duration(ctx.settings.sessions.lock_wait).to_string(),
        }),
        _ => Failure::Infrastructure(InfraError::Session(e)),
    }
}

/// Whether the job's record says `running` (an attempt of it runs, or ran and died: then the
/// session lock it held expires with its lease, and the session is not busy). A Redis error
/// counts as running: the delivery is handed back rather than the job rejected.
async fn running_elsewhere(ctx: &Context, job: &ValidJob) -> bool {
    let mut redis = ctx.redis.clone();
    results::status(&mut redis, &ctx.settings.names, &job.spec.job_id).await.map_or(true, |s| s == Some(JobStatus::Running))
}

/// Waits (still `queued`) until the SKU's share of the worker's capacity is free, checks
/// again that the job is wanted, then writes `running` and sets `who.started_at_ms`. Returns
/// the reservation, held until the job ends.
///
/// # Errors
/// [`Failure::Duplicate`] when the `running` compare-and-set finds a terminal result; those of
/// [`recheck`]; Redis trouble.
pub(super) async fn reserve_and_start<'c>(
    ctx: &'c Context,
    job: &ValidJob,
    sku: SkuSettings,
    who: &mut Attempt,
) -> Result<crate::capacity::Reservation<'c>, Failure> {
    let reservation = ctx.capacity.reserve(sku.limits.cpus, sku.limits.memory_bytes).await;
    recheck(ctx, job, "cancelled before it started").await?;
    who.started_at_ms = now_ms();
    let mut running = publish::base(job, who, JobStatus::Running);
    running.started_at_ms = Some(who.started_at_ms);
    let mut redis = ctx.redis.clone();
    let written = publish::publish(&mut redis, &ctx.settings.names, &running, job.result_ttl).await.map_err(InfraError::WriteRunning)?;
    if !written {
        return Err(Failure::Duplicate);
    }
    Ok(reservation)
}
