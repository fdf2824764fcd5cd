//! Is the job still wanted? Checked when a delivery is taken and again after every wait
//! (session lock, capacity, staging), since a duplicate delivery, a cancel or the job's
//! deadline may land meanwhile; then the capacity is taken and `running` written.

use sandq_core::results;
use sandq_core::sessions::SessionError;
use sandq_core::time::now_ms;
use sandq_schemas::{JobResult, JobStatus, ValidJob};
use tracing::error;

use super::conclude::{Failure, InfraError, Rejection};
use crate::context::Context;
use crate::publish::{self, Attempt};
use crate::settings::SkuSettings;

/// Whether a taken job should still run.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Wanted {
    /// Yes; `started` when its record says `running` (an attempt of it started already).
    Yes { started: bool },
    /// It already has a terminal result (a duplicate delivery): ack without running.
    Finished,
    /// A client cancelled it.
    Cancelled,
}

/// What the first check of a taken delivery decided; [`super::attempt_job`] carries it out.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Admission {
    /// Run it with the SKU's settings.
    Run(SkuSettings),
    /// It already has a terminal result (a duplicate delivery): ack without running.
    Duplicate,
    /// A client cancelled it before it started: concluded as cancelled.
    Cancelled,
    /// Its deadline passed in the queue: store this `expired` result (retried on Redis trouble).
    Expired(JobResult),
    /// Its SKU is not served by this worker: store this `rejected` result (retried on Redis
    /// trouble).
    NotServed(JobResult),
    /// Its state could not be read: handed back.
    Unreadable,
}

/// The first check of a taken delivery: reads the job's state, then [`decide`]s. Stores
/// nothing.
pub(super) async fn admit(ctx: &Context, job: &ValidJob, who: &Attempt) -> Admission {
    let wanted = still_wanted(ctx, job).await.map_err(|e| error!(reason = %e, "cannot read the job's state"));
    decide(job, who, wanted.ok(), ctx.settings.skus.get(&job.spec.sku).copied(), now_ms())
}

/// What becomes of a taken job whose state reads `wanted` (`None`: unreadable), served here
/// with `sku` (`None`: not served), at `now` (a stored result's `finished_at_ms`). Late is
/// judged at `who.started_at_ms`, when the delivery was taken.
fn decide(job: &ValidJob, who: &Attempt, wanted: Option<Wanted>, sku: Option<SkuSettings>, now: u64) -> Admission {
    let started = match wanted {
        Some(Wanted::Yes { started }) => started,
        Some(Wanted::Finished) => return Admission::Duplicate,
        Some(Wanted::Cancelled) => return Admission::Cancelled,
        None => return Admission::Unreadable,
    };
    if let Some(late) = late_ms(job, started, who.started_at_ms) {
        let mut result = publish::base(job, who, JobStatus::Expired);
        result.reason = Some(format!("its deadline passed {late} ms before a worker took it"));
        result.finished_at_ms = Some(now);
        return Admission::Expired(result);
    }
    // Validation only lets through SKUs this worker serves.
    let Some(sku) = sku else {
        let mut result = publish::base(job, who, JobStatus::Rejected);
        result.reason = Some(format!("sku {} is not served by this worker", job.spec.sku));
        return Admission::NotServed(result);
    };
    Admission::Run(sku)
}

/// How long [`still_wanted`] tries again when Redis drops or refuses its connection (a restart,
/// a failover): both reads are idempotent, and an attempt must not be spent on a blip (test:
/// `faults::a_short_chaos_run_loses_no_job`, which restarts Redis under load).
const READ_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(10);

/// Reads the job's stored status and cancel key, trying again for up to [`READ_RETRY_FOR`]
/// while the failure is a lost connection ([`transient`]).
async fn still_wanted(ctx: &Context, job: &ValidJob) -> Result<Wanted, InfraError> {
    let started = tokio::time::Instant::now();
    let mut pause = std::time::Duration::from_millis(50);
    loop {
        match read_wanted(ctx, job).await {
            Err(InfraError::ReadStatus(e) | InfraError::ReadCancel(e)) if transient(&e) && started.elapsed() < READ_RETRY_FOR => {
                tracing::warn!(error = %e, "redis unavailable while reading the job's state; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_secs(1));
            }
            other => return other,
        }
    }
}

/// Whether a read failed because the connection was lost or refused (worth trying again), not
/// because of what Redis answered.
fn transient(e: &results::ResultError) -> bool {
    match e {
        results::ResultError::Redis(e) => e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout(),
        _ => false,
    }
}

/// Reads the job's stored status and cancel key once.
async fn read_wanted(ctx: &Context, job: &ValidJob) -> Result<Wanted, InfraError> {
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
    // Kept for the rest of the job's life, not its `result_ttl` (only the terminal result takes
    // that): a running job must keep its status, its cancel and its place in its key's jobs in
    // flight (test: tenant::idempotency::a_running_job_with_a_short_result_ttl_stays_visible).
    let ttl = live_ttl(ctx, job);
    let written = publish::publish(&mut redis, &ctx.settings.names, &running, ttl).await.map_err(InfraError::WriteRunning)?;
    if !written {
        return Err(Failure::Duplicate);
    }
    Ok(reservation)
}

/// The TTL of what an attempt writes while the job is not over (`running`, its live events):
/// [`results::live_ttl`] with the queues' `unserved_ttl`.
pub(super) fn live_ttl(ctx: &Context, job: &ValidJob) -> std::time::Duration {
    results::live_ttl(ctx.settings.services.queues.unserved_ttl, job.timeout, job.result_ttl)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sandq_schemas::{JobSpec, Runtime, Sku};

    use super::*;
    use crate::sandbox::spec::SandboxLimits;

    const SKU: SkuSettings = SkuSettings { limits: SandboxLimits { cpus: 1.0, memory_bytes: 1 << 30, pids: 64 }, slots: 1, disk_bytes: 0 };
    const TAKEN: u64 = 10_000;
    const NOW: u64 = 10_005;

    #[test]
    fn only_a_lost_connection_is_tried_again() {
        let dropped = std::io::Error::new(std::io::ErrorKind::BrokenPipe, "broken pipe");
        assert!(transient(&results::ResultError::Redis(redis::RedisError::from(dropped))));
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert!(transient(&results::ResultError::Redis(redis::RedisError::from(refused))));
        let answered = redis::RedisError::from((redis::ErrorKind::UnexpectedReturnType, "not a hash"));
        assert!(!transient(&results::ResultError::Redis(answered)));
        let large = results::ResultError::TooLarge { job_id: "j".into(), bytes: 1 << 30, status: None };
        assert!(!transient(&large));
    }

    fn job(deadline_ms: Option<u64>) -> ValidJob {
        let mut spec = JobSpec::new("job-1", Sku::M, Runtime::Python, "pass");
        spec.deadline_ms = deadline_ms;
        ValidJob { spec, timeout: Duration::from_secs(60), result_ttl: Duration::from_secs(3600) }
    }

    fn who() -> Attempt {
        Attempt { worker_id: "w".into(), id: "a0000000000000001".into(), slot: 0, number: 2, started_at_ms: TAKEN }
    }

    fn decided(job: &ValidJob, wanted: Option<Wanted>, sku: Option<SkuSettings>) -> Admission {
        decide(job, &who(), wanted, sku, NOW)
    }

    #[test]
    fn a_wanted_job_on_a_served_sku_runs() {
        let wanted = Some(Wanted::Yes { started: false });
        assert_eq!(decided(&job(None), wanted, Some(SKU)), Admission::Run(SKU));
        assert_eq!(decided(&job(Some(TAKEN)), wanted, Some(SKU)), Admission::Run(SKU), "a deadline reached, not passed");
    }

    #[test]
    fn finished_cancelled_and_unreadable_jobs_do_not_run() {
        assert_eq!(decided(&job(None), Some(Wanted::Finished), Some(SKU)), Admission::Duplicate);
        assert_eq!(decided(&job(None), Some(Wanted::Cancelled), Some(SKU)), Admission::Cancelled);
        assert_eq!(decided(&job(None), None, Some(SKU)), Admission::Unreadable);
    }

    #[test]
    fn a_job_taken_past_its_deadline_is_expired() {
        let Admission::Expired(result) = decided(&job(Some(TAKEN - 250)), Some(Wanted::Yes { started: false }), Some(SKU)) else {
            panic!("a late job must be stored as expired");
        };
        assert_eq!(result.status, JobStatus::Expired);
        assert_eq!(result.reason.as_deref(), Some("its deadline passed 250 ms before a worker took it"));
        assert_eq!((result.attempt, result.finished_at_ms, result.worker_id.as_deref()), (2, Some(NOW), Some("w")));
    }

    #[test]
    fn a_late_retry_of_a_started_job_runs() {
        let admitted = decided(&job(Some(TAKEN - 250)), Some(Wanted::Yes { started: true }), Some(SKU));
        assert_eq!(admitted, Admission::Run(SKU));
    }

    #[test]
    fn a_sku_not_served_here_is_rejected() {
        let Admission::NotServed(result) = decided(&job(None), Some(Wanted::Yes { started: false }), None) else {
            panic!("an unserved SKU must be stored as rejected");
        };
        assert_eq!((result.status, result.reason.as_deref()), (JobStatus::Rejected, Some("sku M is not served by this worker")));
        assert_eq!(result.finished_at_ms, None);
    }
}
