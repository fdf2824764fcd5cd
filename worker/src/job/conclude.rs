//! How an attempt ended -> the stored result and the delivery's [`Outcome`].
//!
//! [`decide`] is the pure rule (which result to write, whether this attempt's S3 objects go,
//! what the delivery becomes); [`conclude`] carries it out against Redis and S3. What the
//! broker then does with the delivery is [`crate::ack::classify`]'s, from the [`Outcome`].

use std::time::Duration;

use sandq_core::results::{self, ResultError};
use sandq_core::sessions::SessionError;
use sandq_core::storage::TransferError;
use sandq_core::time::now_ms;
use sandq_schemas::{JobResult, JobStatus, ValidJob};
use tracing::{error, info, warn};

use crate::ack::Outcome;
use crate::context::Context;
use crate::publish::{self, Attempt, HostPaths};
use crate::stage::StageError;
use crate::validate;

/// Reason of a job cancelled after `running` was written (its `started_at_ms` is kept) but
/// before its program started (while its inputs were staged).
pub(crate) const CANCELLED_BEFORE_PROGRAM: &str = "cancelled before its program started";

/// A failure after validation, sorted into the client's fault, ours, or neither.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The job is wrong in a way validation could not see (e.g. a missing input object).
    Rejected(Rejection),
    /// sandq's fault; retried.
    Infrastructure(InfraError),
    /// Killed because the worker is shutting down; requeued without judging the job.
    Interrupted,
    /// Another delivery of the job stored its terminal result first: nothing more is written.
    Duplicate,
    /// The client cancelled the job before it ran; the reason says when.
    Cancelled(&'static str),
    /// Its deadline (latest start) passed while it waited, still `queued`; the reason says how.
    Expired(String),
    /// Another attempt of the job runs (its record says `running`) and holds what this one
    /// waited for (the session's lock): this delivery is handed back without a result, to find
    /// that attempt's result later.
    RunningElsewhere,
}

/// Why a job is the client's fault (stored as a `rejected` result's `reason`).
#[derive(Debug, thiserror::Error)]
pub(crate) enum Rejection {
    /// An input is missing, does not match its digest, or overflows the SKU's disk.
    #[error(transparent)]
    Stage(StageError),
    /// Another job of the session held it for longer than `sessions.lock_wait`.
    #[error("{source} (waited {waited})")]
    SessionBusy {
        /// The session's [`SessionError::Busy`].
        source: SessionError,
        /// How long the job waited, as humantime.
        waited: String,
    },
}

/// Why an attempt failed on sandq's side (retried; the last attempt stores `internal_error`
/// with this as its reason).
#[derive(Debug, thiserror::Error)]
pub(crate) enum InfraError {
    /// The job's status could not be read.
    #[error("cannot read result: {0}")]
    ReadStatus(#[source] ResultError),
    /// The job's cancel key could not be read.
    #[error("cannot read cancel key: {0}")]
    ReadCancel(#[source] ResultError),
    /// `running` could not be written.
    #[error("cannot write running status: {0}")]
    WriteRunning(#[source] ResultError),
    /// The session could not be opened or saved.
    #[error(transparent)]
    Session(#[from] SessionError),
    /// The job dir could not be made, or an input could not be fetched (S3 trouble).
    #[error(transparent)]
    Stage(StageError),
    /// A warm sandbox could not be pinned to the job's CPUs.
    #[error("cannot pin the warm sandbox to its CPUs: {0}")]
    PinWarm(#[source] std::io::Error),
    /// A warm sandbox's cgroup could not be given the job's memory.
    #[error("cannot give the warm sandbox its job's memory: {0}")]
    WarmMemory(#[source] std::io::Error),
    /// The sandbox helper could not start or run the container.
    #[error(transparent)]
    Run(#[from] crate::run::RunError),
    /// A libcontainer lifecycle step failed inside the helper.
    #[error("sandbox {step} failed: {message}")]
    Sandbox {
        /// The step (`create`, `start`, `wait`).
        step: String,
        /// libcontainer's error, with its sources.
        message: String,
    },
    /// The artifacts could not be collected.
    #[error(transparent)]
    Artifacts(#[from] crate::artifacts::CollectError),
    /// The rich outputs could not be collected.
    #[error(transparent)]
    Outputs(#[from] crate::outputs::OutputsError),
    /// A captured stream could not be stored in S3.
    #[error("cannot store {stream}: {source}")]
    StoreLog {
        /// `stdout` or `stderr`.
        stream: &'static str,
        /// The transfer error.
        source: TransferError,
    },
}

impl From<StageError> for Failure {
    /// The client's fault when [`StageError::is_client_fault`], else sandq's.
    fn from(e: StageError) -> Self {
        if e.is_client_fault() {
            Failure::Rejected(Rejection::Stage(e))
        } else {
            Failure::Infrastructure(InfraError::Stage(e))
        }
    }
}

impl From<InfraError> for Failure {
    fn from(e: InfraError) -> Self {
        Failure::Infrastructure(e)
    }
}

/// Most bytes of a reason logged or stored (a `rejected` or `internal_error` result's
/// `reason`): serde's errors echo the value they refuse ("unknown variant `AAAA...`"), so an
/// attacker-sized field would otherwise be logged and stored whole for each message.
pub(crate) const MAX_REASON_BYTES: usize = 1024;

/// `reason` cut to at most [`MAX_REASON_BYTES`] on a character boundary, followed by a marker
/// giving its whole length (`... [clipped: 12000000 bytes in all]`) when it was cut.
#[must_use]
pub(crate) fn clip_reason(reason: &str) -> String {
    if reason.len() <= MAX_REASON_BYTES {
        return reason.to_owned();
    }
    let mut end = MAX_REASON_BYTES;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}\u{2026} [clipped: {} bytes in all]", &reason[..end], reason.len())
}

/// What to do once an attempt has ended: the pure part of [`conclude`].
#[derive(Debug, PartialEq)]
pub(crate) enum Decision {
    /// Write this terminal result (compare-and-set); a write refused because another
    /// delivery's result is stored drops this attempt's objects.
    Publish(JobResult),
    /// The last attempt failed on infrastructure: drop this attempt's objects, then store this
    /// `internal_error` result; the delivery is dead-lettered only once it is stored.
    GiveUp(JobResult),
    /// Write nothing; drop this attempt's S3 objects when `drop_objects`; settle as `outcome`.
    Settle {
        /// What the delivery becomes.
        outcome: Outcome,
        /// Whether this attempt's objects (`jobs/<id>/<attempt id>/`) are deleted.
        drop_objects: bool,
    },
}

/// The rule: how `ended` (the attempt's result, or why it has none) becomes a [`Decision`],
/// given the broker's `max_attempts` and the time now (Unix ms, for `finished_at_ms`). A
/// stored reason names no host path (`host`: the worker's directories, rewritten as the sandbox
/// paths or neutral words, [`HostPaths::redact`]); the log keeps the error as it was.
///
/// | ended | decision |
/// |---|---|
/// | a result | publish it |
/// | cancelled, expired, rejected | publish a result of that status, with the reason |
/// | duplicate (another delivery finished first) | ack, drop this attempt's objects |
/// | running elsewhere | requeue, nothing written |
/// | interrupted by shutdown | requeue, drop objects |
/// | infrastructure, attempts left | requeue, drop objects |
/// | infrastructure, last attempt | drop objects, store `internal_error` |
pub(crate) fn decide(
    job: &ValidJob,
    who: &Attempt,
    ended: Result<JobResult, Failure>,
    max_attempts: u32,
    now: u64,
    host: &HostPaths,
) -> Decision {
    let attempt = who.number;
    let terminal = |status: JobStatus, reason: String| {
        let mut result = publish::base(job, who, status);
        result.reason = Some(clip_reason(&host.redact(&reason)));
        result.finished_at_ms = Some(now);
        result
    };
    match ended {
        Ok(mut result) => {
            result.reason = result.reason.map(|r| host.redact(&r));
            Decision::Publish(result)
        }
        Err(Failure::Duplicate) => {
            info!("another delivery of this job finished first; acking this one without a result");
            Decision::Settle { outcome: Outcome::Stored, drop_objects: true }
        }
        Err(Failure::Cancelled(reason)) => {
            info!(reason, "job cancelled");
            let mut result = terminal(JobStatus::Cancelled, reason.to_owned());
            if reason == CANCELLED_BEFORE_PROGRAM {
                result.started_at_ms = Some(who.started_at_ms);
            }
            Decision::Publish(result)
        }
        Err(Failure::Expired(reason)) => {
            info!(reason, "job expired before it could start");
            Decision::Publish(terminal(JobStatus::Expired, reason))
        }
        Err(Failure::RunningElsewhere) => {
            info!("another attempt of this job runs and holds its session; handing this delivery back");
            Decision::Settle { outcome: Outcome::Infrastructure { attempt, final_result_stored: false }, drop_objects: false }
        }
        Err(Failure::Rejected(rejection)) => {
            let reason = rejection.to_string();
            warn!(reason = clip_reason(&reason), "rejected job");
            Decision::Publish(terminal(JobStatus::Rejected, reason))
        }
        Err(Failure::Interrupted) => {
            info!("job interrupted by shutdown; requeueing");
            Decision::Settle { outcome: Outcome::Interrupted, drop_objects: true }
        }
        Err(Failure::Infrastructure(e)) => {
            let reason = e.to_string();
            error!(reason = clip_reason(&reason), "job failed on infrastructure");
            if attempt < max_attempts {
                return Decision::Settle { outcome: Outcome::Infrastructure { attempt, final_result_stored: false }, drop_objects: true };
            }
            Decision::GiveUp(terminal(JobStatus::InternalError, format!("gave up after {attempt} attempts: {reason}")))
        }
    }
}

/// Carries out [`decide`]: stores the result and returns the delivery's [`Outcome`]. Called
/// with the session lock (if any) still held, so that the next job of the session, or a
/// duplicate delivery waiting for it, sees this result when it gets the lock. A result that
/// loses the compare-and-set (another delivery of the job finished first) is dropped with the
/// S3 objects of this attempt: the stored result keeps pointing at its own.
pub(crate) async fn conclude(ctx: &Context, job: &ValidJob, who: &Attempt, ended: Result<JobResult, Failure>) -> Outcome {
    let attempt = who.number;
    let result = match decide(job, who, ended, ctx.settings.max_attempts, now_ms(), &HostPaths::of(&ctx.settings)) {
        Decision::Publish(result) => result,
        Decision::Settle { outcome, drop_objects } => {
            if drop_objects {
                drop_attempt_objects(ctx, job, who).await;
            }
            return outcome;
        }
        Decision::GiveUp(result) => {
            drop_attempt_objects(ctx, job, who).await;
            let stored = matches!(store_terminal(ctx, &result, job.result_ttl).await, Outcome::Stored);
            return Outcome::Infrastructure { attempt, final_result_stored: stored };
        }
    };
    info!(status = %result.status, exit_code = ?result.exit_code, artifacts = result.artifacts.len(), "job finished");
    crate::metrics::enter(crate::metrics::Stage::Publish);
    let mut redis = ctx.redis.clone();
    match publish::publish(&mut redis, &ctx.settings.names, &result, job.result_ttl).await {
        Ok(true) => Outcome::Stored,
        Ok(false) => {
            // Refused: a terminal result is stored. It may be this very result, when a write
            // that failed ambiguously (a timeout) had reached Redis and was sent again: objects
            // are dropped only when the stored result is another's; when it cannot be told,
            // they are kept (a leak, not a loss). Compared in Redis, byte for byte: the stored
            // record may be a client's, of any size, and is neither read back nor decoded here.
            let mut redis = ctx.redis.clone();
            match results::compare_stored(&mut redis, &ctx.settings.names, &result).await {
                Ok(results::Stored::Same) => info!("this attempt's result was stored by an earlier send of the same write"),
                Ok(results::Stored::Other) => {
                    warn!("a terminal result was stored by another delivery of this job meanwhile; this attempt's result and objects are dropped");
                    drop_attempt_objects(ctx, job, who).await;
                }
                other => {
                    warn!(compared = ?other, "the stored result cannot be compared with this attempt's; keeping this attempt's objects")
                }
            }
            Outcome::Stored
        }
        Err(e) => {
            error!(error = %e, "cannot store result");
            Outcome::Infrastructure { attempt, final_result_stored: false }
        }
    }
}

/// A message that did not validate: `rejected` under its job id when it has one that names no
/// running or finished job; dead-lettered when it has none.
pub(crate) async fn reject_undecodable(ctx: &Context, message: &super::Message, reason: &str) -> Outcome {
    // Redacted before it is clipped, so that a clip never cuts a host path short of its rule.
    let reason = clip_reason(&HostPaths::of(&ctx.settings).redact(reason));
    let reason = reason.as_str();
    // A body over the size limit is not parsed at all (peeking parses the whole message):
    // its job id can only come from `message_id`.
    let parsable = message.body.len() <= validate::max_body_bytes(&ctx.settings.limits);
    let job_id = parsable.then(|| sandq_schemas::peek_job_id(&message.body)).flatten().or_else(|| {
        let id = message.message_id.clone()?;
        sandq_schemas::validate::check_job_id(&id).ok().map(|()| id)
    });
    let Some(job_id) = job_id else {
        warn!(reason, "rejected a message without a usable job id; dead-lettering it");
        return Outcome::Unidentifiable;
    };
    // A message that names a job already running elsewhere (forged, or a broken duplicate)
    // must not end that job: drop it.
    let mut redis = ctx.redis.clone();
    if let Ok(Some(current)) = results::status(&mut redis, &ctx.settings.names, &job_id).await {
        if current == JobStatus::Running || current.is_terminal() {
            warn!(%job_id, reason, status = %current, "rejected a message naming a job that is running or finished; dropping it");
            return Outcome::Stored;
        }
    }
    warn!(%job_id, reason, "rejected job");
    let mut result = JobResult::new(job_id, JobStatus::Rejected);
    result.reason = Some(reason.to_owned());
    result.worker_id = Some(ctx.settings.worker_id.clone());
    result.finished_at_ms = Some(now_ms());
    store_terminal(ctx, &result, ctx.settings.limits.default_result_ttl).await
}

/// Writes a terminal result: [`Outcome::Stored`], or an infrastructure outcome (requeued) when
/// Redis fails.
async fn store_terminal(ctx: &Context, result: &JobResult, ttl: Duration) -> Outcome {
    let mut redis = ctx.redis.clone();
    match publish::publish(&mut redis, &ctx.settings.names, result, ttl).await {
        Ok(_) => Outcome::Stored,
        Err(e) => {
            error!(error = %e, "cannot store result");
            Outcome::Infrastructure { attempt: result.attempt, final_result_stored: false }
        }
    }
}

/// Writes a terminal result decided before the job ran (expired in the queue, SKU not
/// served); requeued when Redis fails.
pub(crate) async fn store_or_retry(ctx: &Context, result: &JobResult, ttl: Duration, attempt: u32) -> Outcome {
    match store_terminal(ctx, result, ttl).await {
        Outcome::Stored => Outcome::Stored,
        _ => Outcome::Infrastructure { attempt, final_result_stored: false },
    }
}

/// Deletes what this attempt wrote under `jobs/<id>/<attempt id>/` (best effort: logged).
async fn drop_attempt_objects(ctx: &Context, job: &ValidJob, who: &Attempt) {
    let prefix = sandq_schemas::names::attempt_prefix(&job.spec.job_id, &who.id);
    if let Err(e) = sandq_core::storage::delete_prefix(&ctx.s3, &ctx.settings.services.s3.bucket, &prefix).await {
        warn!(prefix, error = %e, "cannot delete the objects of a dropped attempt");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandq_schemas::{JobSpec, Runtime, Sku};

    /// A reason is cut to 1 KiB on a character boundary, with a marker.
    #[test]
    fn long_reasons_are_clipped_on_a_character_boundary() {
        assert_eq!(clip_reason("short"), "short");
        let exact = "a".repeat(MAX_REASON_BYTES);
        assert_eq!(clip_reason(&exact), exact, "at the limit it is whole");
        let long = format!("unknown variant `{}`", "A".repeat(12_000_000));
        let clipped = clip_reason(&long);
        assert_eq!(clipped, format!("unknown variant `{}\u{2026} [clipped: 12000018 bytes in all]", "A".repeat(1024 - 17)));
        // 'é' is 2 bytes: 1023 'a's then 'é' puts a boundary at 1023, not 1024.
        let split = format!("{}é{}", "a".repeat(1023), "b".repeat(10));
        assert_eq!(clip_reason(&split), format!("{}\u{2026} [clipped: 1035 bytes in all]", "a".repeat(1023)));
    }

    #[test]
    fn a_stored_reason_names_the_sandbox_path_not_the_hosts() {
        let host = HostPaths::of_jobs_dir(std::path::Path::new("/data/w1"));
        let message = "cannot prepare /data/w1/j-1/disk/work/d/x.csv: Not a directory".to_owned();
        let failure = Failure::Infrastructure(InfraError::Sandbox { step: "start".into(), message });
        let Decision::GiveUp(result) = decide(&job(), &attempt(3), Err(failure), 3, NOW, &host) else { panic!("gives up") };
        assert_eq!(
            result.reason.as_deref(),
            Some("gave up after 3 attempts: sandbox start failed: cannot prepare /work/d/x.csv: Not a directory")
        );
    }

    fn job() -> ValidJob {
        let spec = JobSpec::new("job-1", Sku::S, Runtime::Python, "pass");
        ValidJob { spec, timeout: Duration::from_secs(60), result_ttl: Duration::from_secs(3600) }
    }

    fn attempt(number: u32) -> Attempt {
        Attempt { worker_id: "w".into(), id: "a0000000000000001".into(), slot: 0, number, started_at_ms: 1_000 }
    }

    fn infra() -> Failure {
        Failure::Infrastructure(InfraError::Sandbox { step: "start".into(), message: "boom".into() })
    }

    const NOW: u64 = 5_000;

    #[test]
    fn a_result_is_published_as_it_is() {
        let result = JobResult::new("job-1", JobStatus::Succeeded);
        assert_eq!(decide(&job(), &attempt(1), Ok(result.clone()), 3, NOW, &HostPaths::default()), Decision::Publish(result));
    }

    #[test]
    fn infrastructure_failures_requeue_until_the_last_attempt_then_give_up() {
        for number in [1, 2] {
            assert_eq!(
                decide(&job(), &attempt(number), Err(infra()), 3, NOW, &HostPaths::default()),
                Decision::Settle { outcome: Outcome::Infrastructure { attempt: number, final_result_stored: false }, drop_objects: true },
                "attempt {number} of 3"
            );
        }
        for number in [3, 4] {
            let Decision::GiveUp(result) = decide(&job(), &attempt(number), Err(infra()), 3, NOW, &HostPaths::default()) else {
                panic!("attempt {number} of 3 must give up");
            };
            assert_eq!(result.status, JobStatus::InternalError);
            assert_eq!(result.reason.as_deref(), Some(format!("gave up after {number} attempts: sandbox start failed: boom").as_str()));
            assert_eq!((result.attempt, result.finished_at_ms, result.worker_id.as_deref()), (number, Some(NOW), Some("w")));
        }
    }

    #[test]
    fn failures_without_a_result_settle_without_writing() {
        let settle = |failure, number| decide(&job(), &attempt(number), Err(failure), 3, NOW, &HostPaths::default());
        assert_eq!(settle(Failure::Duplicate, 1), Decision::Settle { outcome: Outcome::Stored, drop_objects: true });
        assert_eq!(settle(Failure::Interrupted, 3), Decision::Settle { outcome: Outcome::Interrupted, drop_objects: true });
        assert_eq!(
            settle(Failure::RunningElsewhere, 3),
            Decision::Settle { outcome: Outcome::Infrastructure { attempt: 3, final_result_stored: false }, drop_objects: false },
            "another attempt's objects are never touched"
        );
    }

    #[test]
    fn cancelled_expired_and_rejected_jobs_get_a_result_with_their_reason() {
        let publish = |failure| match decide(&job(), &attempt(2), Err(failure), 3, NOW, &HostPaths::default()) {
            Decision::Publish(result) => result,
            other => panic!("expected a result, got {other:?}"),
        };
        let cancelled = publish(Failure::Cancelled("cancelled before it started"));
        assert_eq!((cancelled.status, cancelled.started_at_ms), (JobStatus::Cancelled, None));
        let staging = publish(Failure::Cancelled(CANCELLED_BEFORE_PROGRAM));
        assert_eq!(staging.started_at_ms, Some(1_000), "a job cancelled while staged keeps its start");
        let expired = publish(Failure::Expired("late".into()));
        assert_eq!((expired.status, expired.reason.as_deref()), (JobStatus::Expired, Some("late")));
        let over = StageError::OverQuota { bytes: 10, quota: 5 };
        let expected = over.to_string();
        let rejected = publish(Failure::from(over));
        assert_eq!((rejected.status, rejected.reason.clone()), (JobStatus::Rejected, Some(expected)));
        assert!(
            [cancelled, staging, expired, rejected].iter().all(|r| r.finished_at_ms == Some(NOW) && r.attempt == 2),
            "every terminal result says when and which attempt"
        );
    }

    #[test]
    fn staging_errors_are_the_clients_fault_only_when_they_say_so() {
        assert!(matches!(Failure::from(StageError::OverQuota { bytes: 10, quota: 5 }), Failure::Rejected(_)));
        assert!(matches!(
            Failure::from(StageError::JobDir(crate::jobdir::JobDirError::Filesystem("no loop device".into()))),
            Failure::Infrastructure(_)
        ));
    }
}
