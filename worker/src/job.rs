//! One delivery through every stage: validate -> stage -> run -> collect -> publish, ending in
//! an [`Outcome`] that [`crate::ack`] turns into ack, requeue or dead-letter.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lapin::message::Delivery;
use sandq_submitter::redis_conn::RedisConn;
use sandq_schemas::{JobResult, JobStatus, ValidJob};
use sandq_submitter::client::now_ms;
use sandq_submitter::results;
use tracing::{error, info, warn, Instrument};

use crate::ack::Outcome;
use crate::publish::Attempt;
use crate::sandbox::Exit;
use crate::settings::{Settings, SkuSettings};
use crate::stage::StageError;
use crate::{collect, outputs, publish, run, session, stage, validate};
use sandq_submitter::sessions;

/// What every job of a worker shares.
#[derive(Clone)]
pub struct Context {
    /// Validated settings.
    pub settings: Arc<Settings>,
    /// S3 client.
    pub s3: aws_sdk_s3::Client,
    /// Redis (reconnects by itself).
    pub redis: RedisConn,
    /// Becomes true when shutdown's grace period is over: running jobs are killed and requeued.
    pub abort: tokio::sync::watch::Receiver<bool>,
    /// Cores and memory left for running jobs.
    pub capacity: Arc<crate::capacity::Capacity>,
    /// Warm sandboxes ready for jobs.
    pub warm: Arc<crate::warm::Pool>,
    /// Job ids this worker is running: a second delivery of one waits for the first attempt.
    pub in_flight: Arc<InFlight>,
}

/// The job ids this worker has an attempt of, so that one job runs at most once at a time here.
///
/// A second delivery of a job this worker is still running comes when the broker took the first
/// back without the connection failing: its channel was closed under the running job (RabbitMQ's
/// `consumer_timeout`, seventh security review T2), and the message went to another consumer
/// slot of the same worker. Without this the job ran twice at once, side by side (reproduced by
/// `tests/channel_close.rs`). The second delivery waits, before it reads the job's state or takes
/// capacity, until the first attempt has ended and stored its result; it then finds that result
/// and is acked as a duplicate. Another worker taking the redelivery cannot be told apart from a
/// worker that died, so it runs the job (at-least-once; the compare-and-set keeps one result).
#[derive(Debug, Default)]
pub struct InFlight {
    ids: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// An attempt's hold on its job id in [`InFlight`]; released on drop.
pub struct Held<'a> {
    in_flight: &'a InFlight,
    job_id: String,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl InFlight {
    /// Waits until no other attempt of `job_id` runs on this worker, then holds the id until the
    /// returned [`Held`] is dropped.
    pub async fn hold(&self, job_id: &str) -> Held<'_> {
        let lock = {
            let mut ids = self.ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            Arc::clone(ids.entry(job_id.to_owned()).or_default())
        };
        let guard = match Arc::clone(&lock).try_lock_owned() {
            Ok(guard) => guard,
            Err(_) => {
                warn!("another delivery of this job is running on this worker (its channel was closed under it); waiting for it to end");
                lock.lock_owned().await
            }
        };
        Held { in_flight: self, job_id: job_id.to_owned(), guard: Some(guard) }
    }

    /// The job ids held or waited for, sorted.
    #[must_use]
    pub fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner).keys().cloned().collect();
        ids.sort();
        ids
    }

    /// Job ids held or waited for (for tests of the bookkeeping).
    #[must_use]
    pub fn len(&self) -> usize {
        self.ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len()
    }

    /// Whether no job id is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut ids = self.in_flight.ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        drop(self.guard.take());
        // Only the map's own reference left: nobody holds or waits for the id.
        if ids.get(&self.job_id).is_some_and(|lock| Arc::strong_count(lock) == 1) {
            ids.remove(&self.job_id);
        }
    }
}

/// Reason of a job cancelled after `running` was written (its `started_at_ms` is kept) but
/// before its program started (while its inputs were staged).
const CANCELLED_BEFORE_PROGRAM: &str = "cancelled before its program started";

/// How often a running job's cancel key is checked (a cancelled job dies within about this).
pub const CANCEL_POLL: Duration = Duration::from_millis(250);

/// Why a running container was stopped early.
const STOP_NONE: u8 = 0;
const STOP_CANCEL: u8 = 1;
const STOP_SHUTDOWN: u8 = 2;

/// Processes one delivery, taken from the queue of SKU `queue` by consumer slot `slot` (which
/// picks the sandbox's user namespace range: [`crate::settings::Settings::id_map_for`]), to
/// its outcome. Never panics on bad input.
pub async fn process(ctx: &Context, delivery: &Delivery, queue: sandq_schemas::Sku, slot: usize) -> Outcome {
    let attempt = crate::ack::attempt_number(delivery.properties.headers().as_ref(), delivery.redelivered);
    let job = match validate::validate(&delivery.data, &ctx.settings, queue) {
        Ok(job) => job,
        Err(e) => return reject_undecodable(ctx, delivery, &e.to_string()).await,
    };
    let span = tracing::info_span!("job", job_id = %job.spec.job_id, attempt, sku = %job.spec.sku);
    process_valid(ctx, job, attempt, slot).instrument(span).await
}

/// Most bytes of a reason logged or stored (a `rejected` or `internal_error` result's
/// `reason`): serde's errors echo the value they refuse ("unknown variant `AAAA...`"), and a
/// 12 MB `runtime` was logged and stored whole for each message (tenth security review N7).
pub const MAX_REASON_BYTES: usize = 1024;

/// `reason` cut to at most [`MAX_REASON_BYTES`] on a character boundary, followed by a marker
/// giving its whole length (`... [clipped: 12000000 bytes in all]`) when it was cut.
#[must_use]
pub fn clip_reason(reason: &str) -> String {
    if reason.len() <= MAX_REASON_BYTES {
        return reason.to_owned();
    }
    let mut end = MAX_REASON_BYTES;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}\u{2026} [clipped: {} bytes in all]", &reason[..end], reason.len())
}

async fn reject_undecodable(ctx: &Context, delivery: &Delivery, reason: &str) -> Outcome {
    let reason = clip_reason(reason);
    let reason = reason.as_str();
    // A body over the size limit is not parsed at all (peeking parses the whole message):
    // its job id can only come from `message_id`.
    let parsable = delivery.data.len() <= validate::max_body_bytes(&ctx.settings.limits);
    let job_id = parsable.then(|| sandq_schemas::peek_job_id(&delivery.data)).flatten().or_else(|| {
        let id = delivery.properties.message_id().as_ref()?.to_string();
        sandq_schemas::validate::check_job_id(&id).ok().map(|()| id)
    });
    let Some(job_id) = job_id else {
        warn!(reason, "rejected a message without a usable job id; dead-lettering it");
        return Outcome::Unidentifiable;
    };
    // A message that names a job already running elsewhere (forged, or a broken duplicate)
    // must not end that job (security re-review N6): drop it.
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

async fn store_terminal(ctx: &Context, result: &JobResult, ttl: std::time::Duration) -> Outcome {
    let mut redis = ctx.redis.clone();
    match publish::publish(&mut redis, &ctx.settings.names, result, ttl).await {
        Ok(_) => Outcome::Stored,
        Err(e) => {
            error!(error = %e, "cannot store result");
            Outcome::Infrastructure { attempt: result.attempt, final_result_stored: false }
        }
    }
}

/// A failure after validation, sorted into the client's fault or ours.
enum Failure {
    /// The job is wrong in a way validation could not see (e.g. a missing input object).
    Rejected(String),
    /// sandq's fault; retried.
    Infrastructure(String),
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
    /// that attempt's result later (eighth review U1).
    RunningElsewhere,
}

/// Reads the job's stored status: `Some(reason)` when it must not run (it has a terminal
/// result, or its cancel key is set), checked when a delivery is taken and again after every
/// wait (session lock, capacity), since a duplicate delivery or a cancel may land meanwhile.
async fn still_wanted(ctx: &Context, job: &ValidJob) -> Result<Wanted, Failure> {
    let mut redis = ctx.redis.clone();
    let names = &ctx.settings.names;
    // The status field only: the record is the client's to write while `queued`, of any size
    // (eighth review R1).
    let started = match results::status(&mut redis, names, &job.spec.job_id).await {
        Ok(Some(status)) if status.is_terminal() => return Ok(Wanted::Finished),
        Ok(status) => status == Some(JobStatus::Running),
        Err(e) => return Err(Failure::Infrastructure(format!("cannot read result: {e}"))),
    };
    match results::cancel_requested(&mut redis, names, &job.spec.job_id).await {
        Ok(true) => Ok(Wanted::Cancelled),
        Ok(false) => Ok(Wanted::Yes { started }),
        Err(e) => Err(Failure::Infrastructure(format!("cannot read cancel key: {e}"))),
    }
}

/// How late a job is to start (ms past its `deadline_ms`, its latest start), if it is; `None`
/// once an attempt of it has started (its record says `running`: the deadline was met, and
/// this delivery is a retry or a duplicate of that attempt, which must not be expired over it:
/// eighth review U2).
fn late_ms(job: &ValidJob, started: bool, now_ms: u64) -> Option<u64> {
    let deadline = job.spec.deadline_ms.filter(|_| !started)?;
    (deadline < now_ms).then(|| now_ms - deadline)
}

/// Whether the job's record says `running` (an attempt of it runs, or ran and died: then the
/// session lock it held expires with its lease, and the session is not busy). A Redis error
/// counts as running: the delivery is handed back rather than the job rejected.
async fn running_elsewhere(ctx: &Context, job: &ValidJob) -> bool {
    let mut redis = ctx.redis.clone();
    results::status(&mut redis, &ctx.settings.names, &job.spec.job_id).await.map_or(true, |s| s == Some(JobStatus::Running))
}

/// Whether a taken job should still run.
enum Wanted {
    /// Yes; `started` when its record says `running` (an attempt of it started already).
    Yes { started: bool },
    /// It already has a terminal result (a duplicate delivery): ack without running.
    Finished,
    /// A client cancelled it.
    Cancelled,
}

async fn process_valid(ctx: &Context, job: ValidJob, attempt: u32, slot: usize) -> Outcome {
    let mut who = Attempt {
        id: format!("a{:016x}", rand::random::<u64>()),
        slot,
        worker_id: ctx.settings.worker_id.clone(),
        number: attempt,
        started_at_ms: now_ms(),
    };
    // Held until the attempt has ended (its result stored, its sandbox gone), whichever way.
    let _held = ctx.in_flight.hold(&job.spec.job_id).await;
    let started = match still_wanted(ctx, &job).await {
        Ok(Wanted::Yes { started }) => started,
        Ok(Wanted::Finished) => {
            info!("job already has a terminal result; acking the duplicate");
            return Outcome::Stored;
        }
        Ok(Wanted::Cancelled) => return conclude(ctx, &job, &who, Err(Failure::Cancelled("cancelled before it started"))).await,
        Err(Failure::Infrastructure(reason)) => {
            error!(reason, "cannot read the job's state");
            return Outcome::Infrastructure { attempt, final_result_stored: false };
        }
        Err(_) => unreachable!("still_wanted fails only on infrastructure"),
    };
    if let Some(late) = late_ms(&job, started, who.started_at_ms) {
        let mut result = publish::base(&job, &who, JobStatus::Expired);
        result.reason = Some(format!("its deadline passed {late} ms before a worker took it"));
        result.finished_at_ms = Some(now_ms());
        info!("job expired in the queue");
        return store_or_retry(ctx, &result, job.result_ttl, attempt).await;
    }
    // Validation only lets through SKUs this worker serves.
    let Some(sku) = ctx.settings.skus.get(&job.spec.sku).copied() else {
        let mut result = publish::base(&job, &who, JobStatus::Rejected);
        result.reason = Some(format!("sku {} is not served by this worker", job.spec.sku));
        return store_or_retry(ctx, &result, job.result_ttl, attempt).await;
    };
    // Random, not derived from the job id: the container id names the job dir, and paths of
    // the host leak into sandboxes (a loop device's backing file in sysfs did); a job id is
    // a capability (its result can be read, and a duplicate submitted, by whoever knows it).
    let container_id = format!("j-{:032x}", rand::random::<u128>());
    info!(container_id, attempt_id = who.id, "container id");
    execute(ctx, &job, sku, &mut who, &container_id).await
}

/// Turns how the job ended into the stored result and the delivery's [`Outcome`]. Called with
/// the session lock (if any) still held, so that the next job of the session, or a duplicate
/// delivery waiting for it, sees this result when it gets the lock. A result that loses the
/// compare-and-set (another delivery of the job finished first) is dropped with the S3
/// objects of this attempt: the stored result keeps pointing at its own.
async fn conclude(ctx: &Context, job: &ValidJob, who: &Attempt, ended: Result<JobResult, Failure>) -> Outcome {
    let attempt = who.number;
    let result = match ended {
        Ok(result) => result,
        Err(Failure::Duplicate) => {
            info!("another delivery of this job finished first; acking this one without a result");
            drop_attempt_objects(ctx, job, who).await;
            return Outcome::Stored;
        }
        Err(Failure::Cancelled(reason)) => {
            info!(reason, "job cancelled");
            let mut result = publish::base(job, who, JobStatus::Cancelled);
            result.reason = Some(reason.to_owned());
            if reason == CANCELLED_BEFORE_PROGRAM {
                result.started_at_ms = Some(who.started_at_ms);
            }
            result.finished_at_ms = Some(now_ms());
            result
        }
        Err(Failure::Expired(reason)) => {
            info!(reason, "job expired before it could start");
            let mut result = publish::base(job, who, JobStatus::Expired);
            result.reason = Some(reason);
            result.finished_at_ms = Some(now_ms());
            result
        }
        Err(Failure::RunningElsewhere) => {
            info!("another attempt of this job runs and holds its session; handing this delivery back");
            return Outcome::Infrastructure { attempt, final_result_stored: false };
        }
        Err(Failure::Rejected(reason)) => {
            let reason = clip_reason(&reason);
            warn!(reason, "rejected job");
            let mut result = publish::base(job, who, JobStatus::Rejected);
            result.reason = Some(reason);
            result.finished_at_ms = Some(now_ms());
            result
        }
        Err(Failure::Interrupted) => {
            info!("job interrupted by shutdown; requeueing");
            drop_attempt_objects(ctx, job, who).await;
            return Outcome::Interrupted;
        }
        Err(Failure::Infrastructure(reason)) => {
            let reason = clip_reason(&reason);
            error!(reason, "job failed on infrastructure");
            drop_attempt_objects(ctx, job, who).await;
            if attempt < ctx.settings.max_attempts {
                return Outcome::Infrastructure { attempt, final_result_stored: false };
            }
            let mut result = publish::base(job, who, JobStatus::InternalError);
            result.reason = Some(format!("gave up after {attempt} attempts: {reason}"));
            result.finished_at_ms = Some(now_ms());
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
            // that failed ambiguously (a timeout) had reached Redis and was sent again (ninth
            // security review P2): objects are dropped only when the stored result is
            // another's; when it cannot be told, they are kept (a leak, not a loss). Compared
            // in Redis, byte for byte: the stored record may be a client's, of any size (tenth
            // security review N1), and is neither read back nor decoded here.
            let mut redis = ctx.redis.clone();
            match results::compare_stored(&mut redis, &ctx.settings.names, &result).await {
                Ok(results::Stored::Same) => info!("this attempt's result was stored by an earlier send of the same write"),
                Ok(results::Stored::Other) => {
                    warn!("a terminal result was stored by another delivery of this job meanwhile; this attempt's result and objects are dropped");
                    drop_attempt_objects(ctx, job, who).await;
                }
                other => warn!(compared = ?other, "the stored result cannot be compared with this attempt's; keeping this attempt's objects"),
            }
            Outcome::Stored
        }
        Err(e) => {
            error!(error = %e, "cannot store result");
            Outcome::Infrastructure { attempt, final_result_stored: false }
        }
    }
}

/// Deletes what this attempt wrote under `jobs/<id>/<attempt id>/` (best effort: logged).
async fn drop_attempt_objects(ctx: &Context, job: &ValidJob, who: &Attempt) {
    let prefix = sandq_schemas::names::attempt_prefix(&job.spec.job_id, &who.id);
    if let Err(e) = sandq_submitter::storage::delete_prefix(&ctx.s3, &ctx.settings.services.s3.bucket, &prefix).await {
        warn!(prefix, error = %e, "cannot delete the objects of a dropped attempt");
    }
}

async fn store_or_retry(ctx: &Context, result: &JobResult, ttl: Duration, attempt: u32) -> Outcome {
    match store_terminal(ctx, result, ttl).await {
        Outcome::Stored => Outcome::Stored,
        _ => Outcome::Infrastructure { attempt, final_result_stored: false },
    }
}

/// Resolves when the job's cancel key is set or the shutdown grace is over, recording which.
async fn stop_signal(ctx: &Context, job_id: &str, reason: &AtomicU8) {
    let mut redis = ctx.redis.clone();
    let mut abort = ctx.abort.clone();
    let cancelled = async {
        loop {
            tokio::time::sleep(CANCEL_POLL).await;
            if results::cancel_requested(&mut redis, &ctx.settings.names, job_id).await.unwrap_or(false) {
                return;
            }
        }
    };
    tokio::select! {
        () = cancelled => reason.store(STOP_CANCEL, Ordering::SeqCst),
        _ = abort.wait_for(|a| *a) => reason.store(STOP_SHUTDOWN, Ordering::SeqCst),
    }
}

/// Fails with [`Failure::Duplicate`] or [`Failure::Cancelled`] when the job must not run on
/// (see [`still_wanted`]).
async fn recheck(ctx: &Context, job: &ValidJob, when: &'static str) -> Result<(), Failure> {
    match still_wanted(ctx, job).await? {
        // The deadline too (eighth review U3): a job that waited past it (for its session or
        // for capacity) is still `queued`, and is not started.
        Wanted::Yes { started } => match late_ms(job, started, now_ms()) {
            Some(late) => Err(Failure::Expired(format!("its deadline passed {late} ms before it could start (it waited for its session or for capacity)"))),
            None => Ok(()),
        },
        Wanted::Finished => Err(Failure::Duplicate),
        Wanted::Cancelled => Err(Failure::Cancelled(when)),
    }
}

/// Waits (still `queued`) until the SKU's share of the worker's capacity is free, checks
/// again that the job is wanted, then writes `running`. Returns the reservation, held until
/// the job ends.
///
/// # Errors
/// [`Failure::Duplicate`] when the `running` compare-and-set finds a terminal result.
async fn start<'c>(
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
    let written = publish::publish(&mut redis, &ctx.settings.names, &running, job.result_ttl)
        .await
        .map_err(|e| Failure::Infrastructure(format!("cannot write running status: {e}")))?;
    if !written {
        return Err(Failure::Duplicate);
    }
    Ok(reservation)
}

/// Session open -> (capacity, `running`) -> stage -> run -> collect -> session save -> the
/// stored result ([`conclude`]). A job of a busy session waits for the session before it takes
/// any of the worker's capacity. The session lock is held until the result is stored, then
/// released whatever happened (if this future is dropped, its lease frees it).
async fn execute(ctx: &Context, job: &ValidJob, sku: SkuSettings, who: &mut Attempt, container_id: &str) -> Outcome {
    let opened = match &job.spec.session {
        None => None,
        Some(name) => match session::open(ctx, name, &who.id).await {
            Ok(opened) => Some(opened),
            Err(e) => {
                let failure = match e {
                    // The lock is held by an attempt of this very job (a duplicate delivery of
                    // a running session job): not a busy session (eighth review U1).
                    sessions::SessionError::Busy { .. } if running_elsewhere(ctx, job).await => Failure::RunningElsewhere,
                    sessions::SessionError::Busy { .. } => {
                        Failure::Rejected(format!("{e} (waited {})", humantime::format_duration(ctx.settings.session_lock_wait)))
                    }
                    _ => Failure::Infrastructure(e.to_string()),
                };
                return conclude(ctx, job, who, Err(failure)).await;
            }
        },
    };
    let body = async {
        let (mut reservation, mut leftover) = (None, None);
        let ended = async {
            if opened.is_some() {
                recheck(ctx, job, "cancelled while it waited for its session").await?;
            }
            let reserved = reservation.insert(start(ctx, job, sku, who).await?);
            execute_in(ctx, job, sku, who, container_id, opened.as_ref(), (reserved, &mut leftover)).await
        }
        .await;
        let outcome = conclude(ctx, job, who, ended).await;
        // The job dir goes once the result is out (tearing its filesystem down takes a few ms,
        // and can take seconds: third review R2), with the job's capacity held until it is gone.
        if let Some(dir) = leftover {
            dir.remove().await;
        }
        drop(reservation);
        outcome
    };
    let outcome = match &opened {
        None => body.await,
        Some(o) => tokio::select! {
            outcome = body => outcome,
            () = session::keep(ctx, &o.name, &o.holder) => unreachable!("keep never returns"),
        },
    };
    if let Some(opened) = &opened {
        session::close(ctx, &opened.name, &opened.holder).await;
    }
    outcome
}

/// stage -> run -> collect (and session save), with the job's capacity `reserved` (a warm start
/// grows it by the warm-up's memory when it can). The job dir, once the program ran, is left in
/// `leftover` for the caller to remove after the result is stored; on a failure before that,
/// and when this future is dropped, [`stage::JobDir`] cleans up on drop.
async fn execute_in(
    ctx: &Context,
    job: &ValidJob,
    sku: SkuSettings,
    who: &Attempt,
    container_id: &str,
    opened: Option<&session::Opened>,
    (reserved, leftover): (&mut crate::capacity::Reservation<'_>, &mut Option<stage::JobDir>),
) -> Result<JobResult, Failure> {
    let settings = &ctx.settings;
    let bucket = &settings.services.s3.bucket;
    let restore = opened.map(|o| o.restore(ctx)).unwrap_or_default();
    // Notebook cells are numbered within their session, and a session's notebook state (its
    // variables) travels with it: restored before the cell, saved after it.
    let notebook = job.spec.run_mode() == sandq_schemas::RunMode::Notebook;
    // The state is Python's (pickles); a Node.js cell neither reads nor changes it.
    let python_cell = notebook && job.spec.runtime == sandq_schemas::Runtime::Python;
    let state = opened.filter(|_| python_cell).and_then(|o| o.state(ctx));
    // The packages a job of the session installed (crate::packages), for /sandq/packages.
    let packages = opened.and_then(|o| o.packages(ctx));
    let cell = run::Cell {
        execution_count: opened.map_or(0, |o| o.manifest.execution_count) + 1,
        save_state: (python_cell && opened.is_some()).then_some((settings.max_state_bytes, settings.max_state_save)),
        restore_state: state.is_some(),
    };
    let resolv_conf = (job.spec.network == sandq_schemas::NetworkMode::Outbound).then(|| settings.resolv_conf());
    let stage_failure = |e: StageError| match &e {
        StageError::Download { source, .. } if !source.is_transient() => Failure::Rejected(e.to_string()),
        StageError::Mismatched { .. } => Failure::Rejected(e.to_string()),
        StageError::OverQuota { .. } => Failure::Rejected(e.to_string()),
        _ => Failure::Infrastructure(e.to_string()),
    };
    // A warm sandbox when one fits the job and is ready; else a cold start.
    let warm = if crate::warm::eligible(job) { ctx.warm.take(job.spec.sku, job.spec.runtime) } else { None };
    let warm_id = warm.as_ref().map(|w| w.container_id.clone());
    let (container_id, sandbox_uid) = match (&warm_id, &warm) {
        (Some(id), Some(w)) => (id.as_str(), w.sandbox_uid),
        _ => (container_id, settings.host_sandbox_uid(who.slot)),
    };
    if warm.is_some() {
        info!(container_id, warm = true, "container id");
    }
    let place = stage::Placement {
        jobs_dir: &settings.jobs_dir,
        container_id,
        sandbox_uid,
        disk_bytes: sku.disk_bytes,
        outputs_bytes: settings.max_outputs_bytes,
        restore: &restore,
        resolv_conf: resolv_conf.as_deref(),
        ca_bundle: settings.packages.ca_bundle.as_deref().filter(|_| job.spec.network == sandq_schemas::NetworkMode::Outbound),
        python_site: &settings.packages.python_site,
        packages: packages.as_ref(),
        cpus: sku.limits.cpus,
        state: state.as_ref(),
        // Every Python notebook job gets room for a session state: the same tmpfs as a warm
        // sandbox's, session or not.
        state_bytes: if python_cell { 2 * settings.max_state_bytes } else { 0 },
        src_bytes: crate::warm::src_bytes(settings),
    };
    let env = run::environment(job, &settings.packages, &sku.limits, who.number, settings.max_outputs_bytes, &cell);
    crate::metrics::started(job.spec.submitted_at_ms, who.started_at_ms);
    let (dir, staged, started, handover) = match warm {
        Some(w) => {
            stage::check_quota(job, &place).map_err(stage_failure)?;
            let (dir, mut started, lease) = w.into_parts();
            started.pin(sku.limits.cpus).map_err(|e| Failure::Infrastructure(format!("cannot pin the warm sandbox to its CPUs: {e}")))?;
            // The warm-up's memory, on top of the SKU's, when the worker has it free (else the
            // job runs with the warm-up charged to its SKU's memory, as before the eighth review).
            let held = started.warmup_memory(settings.warm_memory_bytes);
            let extra = if reserved.try_grow_memory(held) { held } else { 0 };
            started
                .hand_over_resources(sku.limits.memory_bytes, extra)
                .map_err(|e| Failure::Infrastructure(format!("cannot give the warm sandbox its job's memory: {e}")))?;
            let staged = stage::fill(job, &dir, &place, &ctx.s3, bucket).await.map_err(stage_failure)?;
            // Staging can take a while: a cancel that landed meanwhile stops the job here.
            recheck(ctx, job, CANCELLED_BEFORE_PROGRAM).await?;
            let env = env.iter().filter_map(|e| e.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
            (dir, staged, started, Some((run::Handover { env, args: job.spec.args.clone() }, lease)))
        }
        None => {
            let (dir, staged) = stage::stage(job, &place, &ctx.s3, bucket).await.map_err(stage_failure)?;
            // Staging can take a while: a cancel that landed meanwhile stops the job here.
            recheck(ctx, job, CANCELLED_BEFORE_PROGRAM).await?;
            crate::metrics::enter(crate::metrics::Stage::SandboxStart);
            let launch = run::Launch {
                container_id,
                args: run::command(job),
                env,
                limits: sku.limits,
                id_map: settings.id_map_for(who.slot),
                outbound: job.spec.network == sandq_schemas::NetworkMode::Outbound,
                warm: false,
                timeout: job.timeout,
            };
            let started = run::start(&dir, settings, &launch).await.map_err(|e| Failure::Infrastructure(e.to_string()))?;
            (dir, staged, started, None)
        }
    };
    let warm_start = handover.is_some();
    crate::metrics::running(warm_start);
    // The warm sandbox's user namespace range stays taken until the job is over.
    let (handover, _lease) = handover.map_or((None, None), |(h, l)| (Some(h), Some(l)));
    // From `running` (capacity taken) to the sandbox ready for the program.
    let staged_ms = now_ms().saturating_sub(who.started_at_ms);
    let stop_reason = AtomicU8::new(STOP_NONE);
    let outcome = async {
        let stop = stop_signal(ctx, &job.spec.job_id, &stop_reason);
        let output = started
            .finish(&dir, settings, job.timeout, handover.as_ref(), stop)
            .await
            .map_err(|e| Failure::Infrastructure(e.to_string()))?;
        crate::metrics::enter(crate::metrics::Stage::Collect);
        // Until the program started: staging (and the handover), or for a cold start also
        // making and starting the container.
        let start_ms = if warm_start { 0 } else { (output.report.create_us + output.report.start_us) / 1000 };
        let sandbox = sandq_schemas::SandboxStart { warm: warm_start, sandbox_wait_ms: staged_ms + start_ms };
        if let Exit::Failed { step, message } = &output.report.exit {
            return Err(Failure::Infrastructure(format!("sandbox {step} failed: {message}")));
        }
        if output.report.exit == Exit::Killed {
            if stop_reason.load(Ordering::SeqCst) != STOP_CANCEL {
                return Err(Failure::Interrupted);
            }
            let logs = store_logs(ctx, job, who, &output).await?;
            let mut result =
                publish::finished(job, who, &output, collect::Collected::default(), sku.limits.memory_bytes, &logs);
            result.status = JobStatus::Cancelled;
            result.signal = Some("SIGKILL".into());
            result.reason = Some("cancelled while running".into());
            result.session = opened.map(session::unchanged);
            result.sandbox = Some(sandbox);
            return Ok(result);
        }
        let r = &output.report;
        info!(create_us = r.create_us, start_us = r.start_us, delete_us = r.delete_us, wall_ms = r.wall_ms, "container cycle");
        let baseline = session::Opened::baseline(&restore, job, &staged);
        let collected = collect::collect(job, &who.id, &dir.work, &baseline, sku.disk_bytes != 0, &ctx.s3, bucket, settings.max_artifacts, settings.max_artifact_bytes)
            .await
            .map_err(|e| Failure::Infrastructure(e.to_string()))?;
        let caps = outputs::Caps {
            max_outputs: settings.max_outputs,
            max_bytes: settings.max_outputs_bytes,
            max_inline_value: settings.max_inline_output_bytes,
        };
        let rich = if job.spec.run_mode() == sandq_schemas::RunMode::Notebook {
            outputs::collect(&job.spec.job_id, &who.id, &dir.out, caps, &ctx.s3, bucket)
                .await
                .map_err(|e| Failure::Infrastructure(e.to_string()))?
        } else {
            outputs::Outputs::default()
        };
        let session_info = match opened {
            Some(opened) => Some(
                {
                    let left = match cell.save_state {
                        Some(_) => {
                            // Saved only when the cell ended by itself: a timeout or an OOM kill
                            // leaves the previous state.
                            let by_itself = matches!(output.report.exit, Exit::Exited { .. }) && output.report.stats.oom_kills == 0;
                            Some(session::read_state(&dir.out, settings.max_state_bytes, by_itself).await)
                        }
                        None => None,
                    };
                    let count = notebook.then_some(cell.execution_count);
                    let packages = session::left_packages(ctx, &dir, sandbox_uid, sku.limits.cpus).await;
                    session::save(ctx, job, opened, &collected.files, collected.skipped_total, count, session::Left { state: left, packages })
                        .await
                        .map_err(|e| Failure::Infrastructure(e.to_string()))?
                },
            ),
            None => None,
        };
        let logs = store_logs(ctx, job, who, &output).await?;
        let mut result = publish::finished(job, who, &output, collected, sku.limits.memory_bytes, &logs);
        result.outputs = rich.outputs;
        result.outputs_dropped = rich.dropped;
        result.error = rich.error;
        result.session = session_info;
        result.execution_count = notebook.then_some(cell.execution_count);
        result.sandbox = Some(sandbox);
        publish::presign(&mut result, &ctx.s3, bucket, settings.artifact_url_ttl).await;
        Ok(result)
    }
    .await;
    *leftover = Some(dir);
    outcome
}

/// Stores the captured streams' exact bytes in S3 (`jobs/<id>/<attempt id>/stdout` and `stderr`).
async fn store_logs(ctx: &Context, job: &ValidJob, who: &Attempt, output: &run::RunOutput) -> Result<publish::Logs, Failure> {
    let bucket = &ctx.settings.services.s3.bucket;
    let mut logs = publish::Logs { inline_cap: ctx.settings.max_inline_output_bytes, ..Default::default() };
    for (stream, captured) in [("stdout", &output.stdout), ("stderr", &output.stderr)] {
        if captured.bytes.is_empty() {
            continue;
        }
        let key = sandq_schemas::names::log_key(&job.spec.job_id, &who.id, stream);
        sandq_submitter::storage::put_bytes(&ctx.s3, bucket, &key, captured.bytes.clone(), "application/octet-stream")
            .await
            .map_err(|e| Failure::Infrastructure(format!("cannot store {stream}: {e}")))?;
        if stream == "stdout" {
            logs.stdout_key = Some(key);
        } else {
            logs.stderr_key = Some(key);
        }
    }
    Ok(logs)
}

#[cfg(test)]
mod tests {
    use super::InFlight;
    use std::time::Duration;

    /// Tenth review N7: a reason is cut to 1 KiB on a character boundary, with a marker.
    #[test]
    fn long_reasons_are_clipped_on_a_character_boundary() {
        use super::{clip_reason, MAX_REASON_BYTES};
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

    #[tokio::test]
    async fn a_second_attempt_of_a_job_waits_for_the_first() {
        let in_flight = InFlight::default();
        let first = in_flight.hold("job-1").await;
        let other = in_flight.hold("job-2").await;
        assert_eq!(in_flight.len(), 2, "another job id does not wait");
        let second = in_flight.hold("job-1");
        tokio::pin!(second);
        assert!(tokio::time::timeout(Duration::from_millis(100), &mut second).await.is_err(), "the second attempt ran beside the first");
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), second).await.expect("the second attempt goes on once the first ends");
        assert_eq!(in_flight.len(), 2);
        drop(second);
        drop(other);
        assert!(in_flight.is_empty(), "ids are forgotten once nobody holds them");
    }
}
