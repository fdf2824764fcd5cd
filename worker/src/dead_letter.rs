//! The dead-letter consumer: every worker also consumes `<ns>.dead`, so that no job waits
//! forever and no separate process has to be deployed. For each message the broker
//! dead-lettered, the job it names gets a terminal result unless it has one already:
//!
//! | `x-death` reason | how the message got here | result written |
//! |---|---|---|
//! | `expired` | no worker took it within `queues.unserved_ttl` (the queue's `x-message-ttl`) | `expired`: "no worker took it within ..." (`cancelled` when its cancel key is set; `internal_error` when it had started and its worker was lost) |
//! | `delivery_limit` | delivered `amqp.delivery_limit` + 1 times without being settled: each delivery killed or lost its worker | `internal_error`: "its deliveries kept failing (killed its worker N times)" |
//! | `rejected` | a worker dead-lettered it: no usable job id, or its `internal_error` is already stored | `internal_error` when a job id is found and it has no terminal result |
//! | other (`maxlen`) | a policy limit | `internal_error` naming the reason |
//!
//! The job id comes from the body (`job_id`), else the `message_id` property, each only when it
//! is a valid id. A message without one is counted (`sandq_dead_letters_total{action =
//! "no_job_id"}`), logged and acked: there is nowhere to report it. A job still `running` is
//! not given a result on a dead letter's word (anyone allowed to publish to the dead-letter
//! exchange can write `x-death`, and a client's duplicate can expire while the first copy
//! runs: fifth review P1): a `delivery_limit` counts at once only when the job's record shows
//! that many attempts, and otherwise (and for any other reason) the job is checked again once
//! any attempt must have ended, `limits.max_timeout` plus 30 minutes after its start
//! (`deferred`), and given `internal_error` if it is still `running` with the same attempt.
//! Deferred checks are kept in Redis ([`Names::deferred_checks`]: one per job and attempt, by
//! due time) and taken by whichever worker's [`sweeper`] comes first, so a check outlives the
//! worker that deferred it and no count of forged records can crowd a real one out (twelfth
//! security review R12-1: an in-process list of 10,000 was filled by 11,000 forged records,
//! and a really lost job's dead letter was then dropped). A record Redis holds as
//! another type or shape is not retried (`unreadable`: fifth review P3). A message naming a job that
//! is `running` whose body is not a valid job (forged, or broken) is dropped without a result,
//! as the worker drops such messages (security re-review N6). Every message is acked once its
//! result is stored (or found stored); a Redis failure puts it back after a pause.

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Consumer};
use sandq_schemas::{JobResult, JobSpec, JobStatus, Sku};
use sandq_submitter::client::now_ms;
use sandq_submitter::results;
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::job::Context;


/// The largest job record a dead letter's handling reads, bytes. The records it needs are
/// `queued` (a client's, small unless forged) or `running` (a worker's: a few hundred bytes);
/// a terminal record of any size is recognised by its `status` field alone (eighth security
/// review R1: a record is read only after its size is checked in Redis). Only the fields it
/// uses are decoded ([`results::read_head`]), so a record costs about its size (tenth review
/// N1: a whole decode of 1 MiB of empty strings took 24 MiB).
const MAX_RECORD_BYTES: u64 = 1 << 20;

/// Dead-lettered messages handled at once by one worker.
const PREFETCH: u16 = 8;

/// Why the broker dead-lettered a message: the `reason` of the newest `x-death` entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeathReason {
    /// Its TTL passed in the queue: no worker took it (`expired`).
    Expired,
    /// Returned to the queue more often than its `x-delivery-limit` (`delivery_limit`).
    DeliveryLimit,
    /// A consumer rejected it without requeueing (`rejected`).
    Rejected,
    /// Anything else (`maxlen`, or no `x-death` header at all).
    Other,
}

impl DeathReason {
    /// The label value of `sandq_dead_letters_total{reason}`.
    pub fn as_str(self) -> &'static str {
        match self {
            DeathReason::Expired => "expired",
            DeathReason::DeliveryLimit => "delivery_limit",
            DeathReason::Rejected => "rejected",
            DeathReason::Other => "other",
        }
    }
}

/// What the `x-death` header says of a message's last dead-lettering.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Death {
    /// Why.
    pub reason: DeathReason,
    /// The reason as the broker wrote it (`expired`, `delivery_limit`, `maxlen`...).
    pub raw_reason: String,
    /// The queue it was dead-lettered from (`sandq.jobs.M`).
    pub queue: Option<String>,
}

fn text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

fn integer(value: &AMQPValue) -> Option<u64> {
    match value {
        AMQPValue::LongLongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongInt(n) => u64::try_from(*n).ok(),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortShortInt(n) => u64::try_from(*n).ok(),
        AMQPValue::ShortShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::Timestamp(n) => Some(*n),
        _ => None,
    }
}

/// Reads the newest entry of the `x-death` header (RabbitMQ puts the latest first).
pub fn death(headers: Option<&FieldTable>) -> Death {
    let entry = headers.and_then(|h| h.inner().get("x-death")).and_then(|v| match v {
        AMQPValue::FieldArray(entries) => entries.as_slice().first().and_then(|e| match e {
            AMQPValue::FieldTable(t) => Some(t.clone()),
            _ => None,
        }),
        _ => None,
    });
    let field = |name: &str| entry.as_ref().and_then(|t| t.inner().get(name)).and_then(text);
    // Clipped: anyone allowed to publish to the dead-letter exchange writes `x-death`, and the
    // reason is logged and stored (tenth security review N7).
    let raw_reason = crate::job::clip_reason(&field("reason").unwrap_or_default());
    let reason = match raw_reason.as_str() {
        "expired" => DeathReason::Expired,
        "delivery_limit" => DeathReason::DeliveryLimit,
        "rejected" => DeathReason::Rejected,
        _ => DeathReason::Other,
    };
    // The queue name is logged too (eleventh review R11-3: 120 KB names grew the log by 600 KB
    // each); a real one is at most 255 bytes, so a clipped name is never a queue of ours.
    Death { reason, raw_reason, queue: field("queue").map(|q| crate::job::clip_reason(&q)) }
}

/// How many times the message was delivered before the broker gave up: an `x-delivery-count`
/// header when the broker keeps one on dead-lettered messages, else `fallback` (RabbitMQ 3.10
/// does not: its `x-death` entry counts dead-letterings, not deliveries, so the worker passes
/// its `amqp.delivery_limit` + 1, the deliveries a quorum queue makes before it gives up).
pub fn deliveries(headers: Option<&FieldTable>, fallback: u64) -> u64 {
    headers.and_then(|h| h.inner().get("x-delivery-count")).and_then(integer).unwrap_or(fallback)
}

/// The terminal result a dead-lettered job gets, given why it was dead-lettered, what is
/// stored for it now (`current`), whether its cancel key is set, and what its body says
/// (`spec`, when it decodes). `None`: write nothing (see the module doc).
pub fn verdict(
    death: &Death,
    current: Option<&JobResult>,
    cancelled: bool,
    spec_valid: bool,
    deliveries: u64,
    unserved_ttl: Duration,
) -> Option<(JobStatus, String)> {
    let running = current.is_some_and(|r| r.status == JobStatus::Running);
    if current.is_some_and(|r| r.status.is_terminal()) || (running && !spec_valid) {
        return None;
    }
    let ttl = humantime::format_duration(unserved_ttl);
    Some(match death.reason {
        _ if cancelled && !running => (JobStatus::Cancelled, "cancelled before it started".to_owned()),
        DeathReason::Expired if running => (
            JobStatus::InternalError,
            format!("its worker was lost while running it, and no worker took it again within {ttl} (queues.unserved_ttl)"),
        ),
        DeathReason::Expired => (
            JobStatus::Expired,
            format!("no worker took it within {ttl} (queues.unserved_ttl): no running worker serves its sku, or every one was busy"),
        ),
        DeathReason::DeliveryLimit => (
            JobStatus::InternalError,
            format!("its deliveries kept failing (killed its worker {deliveries} times): it was dead-lettered at the queue's delivery limit"),
        ),
        DeathReason::Rejected => (JobStatus::InternalError, "a worker dead-lettered it without storing a result".to_owned()),
        DeathReason::Other => (JobStatus::InternalError, format!("the broker dead-lettered it ({})", death.raw_reason)),
    })
}

/// Consumes the dead-letter queue on `channel` until `shutdown`.
///
/// # Errors
/// The broker's error (the caller reconnects).
pub async fn run(ctx: Context, channel: Channel, mut shutdown: watch::Receiver<bool>) -> Result<(), lapin::Error> {
    channel.basic_qos(PREFETCH, BasicQosOptions::default()).await?;
    let tag = format!("{}-dead-letters", ctx.settings.worker_id);
    let mut consumer: Consumer = channel
        .basic_consume(
            ctx.settings.names.dead_letter_queue().into(),
            tag.into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    loop {
        let delivery = tokio::select! {
            next = consumer.next() => next,
            _ = shutdown.changed() => return Ok(()),
        };
        let delivery = match delivery {
            Some(Ok(d)) => d,
            Some(Err(e)) => return Err(e),
            None if *shutdown.borrow() => return Ok(()),
            None => return Err(lapin::Error::from(lapin::ErrorKind::InvalidChannelState(
                lapin::ChannelState::Closed,
                "dead-letter consumer cancelled",
            ))),
        };
        // Through ack::settle, which takes lapin's "not sent" (the channel closed) for the
        // error it is: the consumer is then reopened (eighth review note).
        // A panic while handling one message (a defect reachable by a client-written record:
        // eleventh review R11-1) drops that message instead of ending this consumer, which
        // would otherwise leave the worker without one until it restarts.
        let handled = AssertUnwindSafe(handle(&ctx, &delivery)).catch_unwind().await.unwrap_or_else(|_| {
            crate::metrics::dead_letter("other", "panic");
            error!(message_id = ?delivery.properties.message_id(), "handling a dead letter panicked; dropping it");
            true
        });
        if handled {
            crate::ack::settle(&delivery.acker, crate::ack::Disposition::Ack).await?;
        } else {
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = shutdown.changed() => {}
            }
            crate::ack::settle(&delivery.acker, crate::ack::Disposition::Requeue).await?;
        }
    }
}

/// Handles one dead-lettered message; false when Redis failed (requeue it).
async fn handle(ctx: &Context, delivery: &Delivery) -> bool {
    let headers = delivery.properties.headers().as_ref();
    let death = death(headers);
    let settings = &ctx.settings;
    let parsable = delivery.data.len() <= crate::validate::max_body_bytes(&settings.limits);
    let spec: Option<JobSpec> = parsable.then(|| sandq_schemas::decode::<JobSpec>(&delivery.data).ok()).flatten();
    let spec = spec.filter(|s| sandq_schemas::validate::check_job_id(&s.job_id).is_ok());
    let job_id = spec.as_ref().map(|s| s.job_id.clone()).or_else(|| {
        let peeked = parsable.then(|| sandq_schemas::peek_job_id(&delivery.data)).flatten();
        peeked.or_else(|| {
            let id = delivery.properties.message_id().as_ref()?.to_string();
            sandq_schemas::validate::check_job_id(&id).ok().map(|()| id)
        })
    });
    let Some(job_id) = job_id else {
        crate::metrics::dead_letter(death.reason.as_str(), "no_job_id");
        warn!(reason = death.raw_reason, queue = ?death.queue, bytes = delivery.data.len(), "dead-lettered message without a usable job id; dropping it");
        return true;
    };
    let mut redis = ctx.redis.clone();
    let names = &settings.names;
    let current = match results::read_head(&mut redis, names, &job_id, MAX_RECORD_BYTES).await {
        Ok(current) => current,
        Err(results::ResultError::TooLarge { status: Some(status), .. }) if status.is_terminal() => {
            crate::metrics::dead_letter(death.reason.as_str(), "already_final");
            info!(%job_id, %status, "dead-lettered job needs no result");
            return true;
        }
        Err(results::ResultError::Redis(e)) if transient(&e) => {
            warn!(%job_id, error = %e, "dead letter: cannot read the job's result; retrying");
            return false;
        }
        Err(e) => {
            // Not Redis being away: a record of another type or shape (a client can write one).
            // Retrying would hold every dead letter behind this one (fifth review P3).
            crate::metrics::dead_letter(death.reason.as_str(), "unreadable");
            warn!(%job_id, error = %e, "dead letter: the job's record is unreadable; dropping the message");
            return true;
        }
    };
    let cancelled = match results::cancel_requested(&mut redis, names, &job_id).await {
        Ok(c) => c,
        Err(results::ResultError::Redis(e)) if transient(&e) => {
            warn!(%job_id, error = %e, "dead letter: cannot read the cancel key; retrying");
            return false;
        }
        Err(e) => {
            crate::metrics::dead_letter(death.reason.as_str(), "unreadable");
            warn!(%job_id, error = %e, "dead letter: the job's cancel key is unreadable; dropping the message");
            return true;
        }
    };
    // A running job: its attempt may be alive. A dead letter is no proof it is not (anyone who
    // can publish to the dead-letter exchange can forge `x-death`, and a client's duplicate
    // publish can expire while the first copy runs: fifth review P1).
    if let Some(run) = current.as_ref().filter(|r| r.status == JobStatus::Running) {
        let limit = settings.services.amqp.delivery_limit;
        // A `delivery_limit` counts at once only when the record shows that many attempts. With
        // fewer it may be forged, or real: deliveries that failed before their own `running`
        // write (Redis refusing the worker's scripts) leave the record at an earlier attempt,
        // and dropping the dead letter then lost the job for good (sixteenth review R16-2). So
        // it is deferred like any other: checked once its attempt must have ended.
        if death.reason != DeathReason::DeliveryLimit || run.attempt < limit {
            // The record's times are a client's to write: a start in the future counts as now,
            // and nothing overflows (eleventh review R11-1: u64::MAX panicked; a start 50 years
            // ahead held a deferred check, and its place in the list, for 50 years).
            let lifetime = attempt_lifetime(settings).as_millis() as u64;
            let alive_until = run.started_at_ms.unwrap_or(0).min(now_ms()).saturating_add(lifetime);
            if now_ms() < alive_until {
                return match defer(&mut redis, names, &job_id, run.attempt, alive_until).await {
                    Ok(new) => {
                        crate::metrics::dead_letter(death.reason.as_str(), "deferred");
                        info!(%job_id, attempt = run.attempt, new, due_at_ms = alive_until, "dead letter for a running job: checking again once its attempt must have ended");
                        true
                    }
                    Err(e) if transient(&e) => {
                        warn!(%job_id, error = %e, "dead letter: cannot defer the check of a running job; retrying");
                        false
                    }
                    Err(e) => {
                        crate::metrics::dead_letter(death.reason.as_str(), "unreadable");
                        warn!(%job_id, error = %e, "dead letter: cannot defer the check of a running job; dropping the message");
                        true
                    }
                };
            }
        }
    }
    // `x-delivery-limit` returns, plus the delivery that was never returned.
    let count = deliveries(headers, u64::from(settings.services.amqp.delivery_limit) + 1);
    let header_keys: Vec<String> = headers
        .map(|h| h.inner().keys().take(32).map(|k| crate::job::clip_reason(k.as_str())).collect())
        .unwrap_or_default();
    tracing::debug!(%job_id, ?header_keys, deliveries = count, "dead-lettered message");
    let Some((status, reason)) =
        verdict(&death, current.as_ref(), cancelled, spec.is_some(), count, settings.services.queues.unserved_ttl)
    else {
        crate::metrics::dead_letter(death.reason.as_str(), "already_final");
        info!(%job_id, reason = death.raw_reason, status = ?current.map(|c| c.status), "dead-lettered job needs no result");
        return true;
    };
    let mut result = JobResult::new(job_id.clone(), status);
    result.reason = Some(reason.clone());
    result.sku = spec.as_ref().map(|s| s.sku).or_else(|| {
        let queue = death.queue.as_deref()?;
        Sku::ALL.into_iter().find(|s| names.jobs_queue(*s) == queue)
    });
    result.queued_at_ms = spec.as_ref().and_then(|s| s.submitted_at_ms).or_else(|| current.as_ref().and_then(|c| c.queued_at_ms));
    result.attempt = current.as_ref().map_or(0, |c| c.attempt);
    result.started_at_ms = current.as_ref().and_then(|c| c.started_at_ms);
    result.worker_id = Some(settings.worker_id.clone());
    result.finished_at_ms = Some(now_ms());
    let ttl = spec
        .and_then(|s| s.result_ttl)
        .and_then(|t| humantime::parse_duration(&t).ok())
        .filter(|t| !t.is_zero() && *t <= settings.limits.max_result_ttl)
        .unwrap_or(settings.limits.default_result_ttl);
    match crate::publish::publish(&mut redis, names, &result, ttl).await {
        Ok(written) => {
            crate::metrics::dead_letter(death.reason.as_str(), if written { "result_written" } else { "already_final" });
            warn!(%job_id, dead_letter_reason = death.raw_reason, %status, reason, written, "dead-lettered job given its terminal result");
            true
        }
        Err(results::ResultError::Redis(e)) if !transient(&e) => {
            crate::metrics::dead_letter(death.reason.as_str(), "unreadable");
            warn!(%job_id, error = %e, "dead letter: the job's record cannot be written; dropping the message");
            true
        }
        Err(e) => {
            warn!(%job_id, error = %e, "dead letter: cannot store the result; retrying");
            false
        }
    }
}

/// True for a Redis error worth a retry: Redis away or failing over (an I/O error, a dropped
/// or refused connection, a timeout, no node or primary found) or an error the server
/// returned (`LOADING`, `READONLY`, `TRYAGAIN`, `OOM`...: sixth review S5), but for a key of
/// another type (`WRONGTYPE`, which no retry changes). Anything else (a reply of an
/// unexpected type or bytes that do not parse, a client-side error) comes from what is stored,
/// and no retry changes it either: retrying held every dead letter behind it, for ever (tenth
/// security review N3).
fn transient(e: &redis::RedisError) -> bool {
    use redis::ErrorKind;
    if e.code() == Some("WRONGTYPE") {
        return false;
    }
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(
            e.kind(),
            ErrorKind::Server(_)
                | ErrorKind::Extension
                | ErrorKind::ClusterConnectionNotFound
                | ErrorKind::MasterNameNotFoundBySentinel
                | ErrorKind::NoValidReplicasFoundBySentinel
        )
}

/// How long after a running job's start its attempt may still store a result: the longest
/// timeout, plus 30 minutes for staging before it and collection after it (uploads of up to
/// 512 MiB of artifacts, the session save). Taken from the worker's settings, never from the
/// dead letter's body (sixth review S2: a forged body said `timeout: 0s`).
fn attempt_lifetime(settings: &crate::settings::Settings) -> Duration {
    settings.limits.max_timeout + Duration::from_secs(30 * 60)
}

/// How often each worker's [`sweeper`] looks for due deferred checks.
pub const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// Due checks one sweep call takes at once.
const SWEEP_BATCH: usize = 100;

/// How long a check a sweeper took stays its own: a sweeper that dies with it leaves it due
/// again this long later, for another worker.
const SWEEP_LEASE: Duration = Duration::from_secs(300);

/// Longest member of the deferred set: an attempt number (10 digits), `:`, and a job id (at
/// most 64 bytes, `validate::check_job_id`), with room to spare. Longer ones are a client's and are
/// removed unread.
const MAX_MEMBER_BYTES: usize = 96;

/// The deferred-set member of `job_id`'s `attempt`: `<attempt>:<job_id>`.
fn deferral_member(job_id: &str, attempt: u32) -> String {
    format!("{attempt}:{job_id}")
}

/// The job id and attempt of a deferred-set member; `None` for anything a worker would not
/// have written (a client may write the set).
fn parse_deferral(member: &[u8]) -> Option<(String, u32)> {
    let (attempt, job_id) = std::str::from_utf8(member).ok()?.split_once(':')?;
    let attempt = attempt.parse::<u32>().ok()?;
    sandq_schemas::validate::check_job_id(job_id).ok()?;
    (deferral_member(job_id, attempt).as_bytes() == member).then(|| (job_id.to_owned(), attempt))
}

/// Adds the check of `job_id`'s `attempt`, due at `due_ms` (Unix ms), to the deferred set,
/// unless one is pending already (which keeps its time); true when added.
///
/// # Errors
/// Redis' error.
async fn defer(redis: &mut sandq_submitter::redis_conn::RedisConn, names: &sandq_schemas::names::Names, job_id: &str, attempt: u32, due_ms: u64) -> Result<bool, redis::RedisError> {
    let added: i64 = sandq_submitter::redis_conn::Script::new(DEFER_SCRIPT).key(names.deferred_checks()).arg(due_ms).arg(deferral_member(job_id, attempt)).invoke_async(redis).await?;
    Ok(added == 1)
}

/// KEYS[1] = the deferred set, ARGV = due (ms), member: a key of another type there (a
/// client's) is deleted first; then `ZADD NX`. Returns 1 when added.
const DEFER_SCRIPT: &str = r"
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'zset' and t ~= 'none' then
  redis.call('DEL', KEYS[1])
end
return redis.call('ZADD', KEYS[1], 'NX', ARGV[1], ARGV[2])
";

/// KEYS[1] = the deferred set, ARGV = now (ms), lease end (ms), batch: takes up to `batch`
/// members due by now, moving each to the lease end (so no other sweeper takes it meanwhile),
/// and returns them; members longer than any a worker writes are removed instead; a key of
/// another type is deleted.
const CLAIM_SCRIPT: &str = r"
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'zset' then
  if t ~= 'none' then redis.call('DEL', KEYS[1]) end
  return {}
end
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local out = {}
for _, m in ipairs(due) do
  if #m <= tonumber(ARGV[4]) then
    redis.call('ZADD', KEYS[1], ARGV[2], m)
    out[#out + 1] = m
  else
    redis.call('ZREM', KEYS[1], m)
  end
end
return out
";

/// Every [`SWEEP_EVERY`] until `shutdown`, takes the due deferred checks (any worker's) and
/// gives each job still `running` the same attempt an `internal_error`: its worker was lost.
/// A check whose Redis calls fail stays in the set and comes due again after [`SWEEP_LEASE`].
pub async fn sweeper(ctx: Context, mut shutdown: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(SWEEP_EVERY) => {}
            _ = shutdown.changed() => return,
        }
        if let Err(e) = sweep(&ctx).await {
            warn!(error = %e, "cannot sweep the deferred dead-letter checks; trying again");
        }
    }
}

/// Takes and handles due checks until none is left; returns how many it handled.
///
/// # Errors
/// Redis' error when the set cannot be read.
async fn sweep(ctx: &Context) -> Result<usize, redis::RedisError> {
    let mut redis = ctx.redis.clone();
    let key = ctx.settings.names.deferred_checks();
    let mut handled = 0;
    loop {
        let now = now_ms();
        let due: Vec<Vec<u8>> = sandq_submitter::redis_conn::Script::new(CLAIM_SCRIPT)
            .key(&key)
            .arg(now)
            .arg(now.saturating_add(SWEEP_LEASE.as_millis() as u64))
            .arg(SWEEP_BATCH)
            .arg(MAX_MEMBER_BYTES)
            .invoke_async(&mut redis)
            .await?;
        let batch = due.len();
        for member in due {
            if let Some((job_id, attempt)) = parse_deferral(&member) {
                if let Err(e) = recheck_lost(ctx, &job_id, attempt).await {
                    if let results::ResultError::Redis(e) = &e {
                        if transient(e) {
                            // Left claimed: due again once the lease ends.
                            warn!(%job_id, error = %e, "deferred dead-letter check failed; trying again later");
                            continue;
                        }
                    }
                    warn!(%job_id, error = %e, "deferred dead-letter check: the job's record is unreadable; dropping the check");
                }
            } else {
                warn!(member = %String::from_utf8_lossy(&member), "removing a deferred check no worker wrote");
            }
            let _: i64 = redis::cmd("ZREM").arg(&key).arg(&member).query_async(&mut redis).await?;
            handled += 1;
        }
        if batch < SWEEP_BATCH {
            return Ok(handled);
        }
    }
}

/// Gives `job_id` an `internal_error` if it is still `running` its `attempt`: its worker was
/// lost (no result past the longest time an attempt may take).
///
/// # Errors
/// [`results::ResultError`] when the record cannot be read or the result stored.
async fn recheck_lost(ctx: &Context, job_id: &str, attempt: u32) -> Result<(), results::ResultError> {
    let mut redis = ctx.redis.clone();
    let names = &ctx.settings.names;
    let current = match results::read_head(&mut redis, names, job_id, MAX_RECORD_BYTES).await {
        Ok(Some(current)) => current,
        Ok(None) => return Ok(()),
        Err(results::ResultError::TooLarge { .. }) => return Ok(()),
        Err(e) => return Err(e),
    };
    if current.status != JobStatus::Running || current.attempt != attempt {
        return Ok(());
    }
    let mut result = JobResult::new(job_id.to_owned(), JobStatus::InternalError);
    result.reason = Some("its worker was lost while running it (no result past its timeout), and no worker took it again".into());
    result.sku = current.sku;
    result.queued_at_ms = current.queued_at_ms;
    result.attempt = current.attempt;
    result.started_at_ms = current.started_at_ms;
    result.worker_id = Some(ctx.settings.worker_id.clone());
    result.finished_at_ms = Some(now_ms());
    let written = crate::publish::publish(&mut redis, names, &result, ctx.settings.limits.default_result_ttl).await?;
    warn!(%job_id, written, "dead-lettered running job given its terminal result");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::FieldArray;

    fn headers(reason: &str, delivery_count: Option<i64>) -> FieldTable {
        let mut entry = FieldTable::default();
        entry.insert("reason".into(), AMQPValue::LongString(reason.into()));
        entry.insert("queue".into(), AMQPValue::LongString("sandq.jobs.L".into()));
        entry.insert("count".into(), AMQPValue::LongLongInt(1));
        let mut older = FieldTable::default();
        older.insert("reason".into(), AMQPValue::LongString("maxlen".into()));
        let mut h = FieldTable::default();
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(entry), AMQPValue::FieldTable(older)])),
        );
        if let Some(n) = delivery_count {
            h.insert("x-delivery-count".into(), AMQPValue::LongLongInt(n));
        }
        h
    }

    /// Only what [`deferral_member`] writes is read back (a client may write the set).
    #[test]
    fn deferral_members_round_trip_and_nothing_else_parses() {
        assert_eq!(parse_deferral(deferral_member("job-1", 3).as_bytes()), Some(("job-1".to_owned(), 3)));
        for bad in [&b"3"[..], b":job", b"x:job", b"03:job", b"+3:job", b"3:", b"3:bad id", b"\xff:job", b"4294967296:job"] {
            assert_eq!(parse_deferral(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn the_newest_death_decides() {
        let d = death(Some(&headers("expired", None)));
        assert_eq!(d.reason, DeathReason::Expired);
        assert_eq!(d.queue.as_deref(), Some("sandq.jobs.L"));
        assert_eq!(death(Some(&headers("delivery_limit", None))).reason, DeathReason::DeliveryLimit);
        assert_eq!(death(Some(&headers("rejected", None))).reason, DeathReason::Rejected);
        assert_eq!(death(None).reason, DeathReason::Other);
        assert_eq!(deliveries(Some(&headers("delivery_limit", Some(5))), 9), 5);
        assert_eq!(deliveries(Some(&headers("delivery_limit", None)), 6), 6);
    }

    /// Tenth review N3: only Redis being away or refusing is retried; an error of what is
    /// stored is not.
    #[test]
    fn only_connection_and_server_errors_are_transient() {
        let io: redis::RedisError = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset").into();
        assert!(transient(&io));
        let timeout: redis::RedisError = std::io::Error::new(std::io::ErrorKind::TimedOut, "slow").into();
        assert!(transient(&timeout));
        // What a reply of bytes that are not UTF-8 gives, read as a String.
        let utf8 = redis::from_redis_value::<String>(redis::Value::BulkString(vec![0xff])).expect_err("not UTF-8");
        assert!(!transient(&redis::RedisError::from(utf8)), "a stored value's type or bytes: permanent");
    }

    #[test]
    fn verdicts() {
        let ttl = Duration::from_secs(3600);
        let expired = death(Some(&headers("expired", None)));
        let limit = death(Some(&headers("delivery_limit", None)));
        let queued = JobResult::new("j", JobStatus::Queued);
        let running = JobResult::new("j", JobStatus::Running);
        let done = JobResult::new("j", JobStatus::Succeeded);
        let (status, reason) = verdict(&expired, Some(&queued), false, true, 1, ttl).expect("expired");
        assert_eq!(status, JobStatus::Expired);
        assert_eq!(reason, "no worker took it within 1h (queues.unserved_ttl): no running worker serves its sku, or every one was busy");
        assert_eq!(verdict(&expired, None, false, false, 1, ttl).map(|v| v.0), Some(JobStatus::Expired), "no queued record");
        assert_eq!(verdict(&expired, Some(&queued), true, true, 1, ttl).map(|v| v.0), Some(JobStatus::Cancelled));
        assert_eq!(verdict(&expired, Some(&running), false, true, 1, ttl).map(|v| v.0), Some(JobStatus::InternalError));
        let (status, reason) = verdict(&limit, Some(&running), false, true, 6, ttl).expect("limit");
        assert_eq!(status, JobStatus::InternalError);
        assert!(reason.starts_with("its deliveries kept failing (killed its worker 6 times)"), "{reason}");
        assert_eq!(verdict(&limit, Some(&done), false, true, 6, ttl), None, "terminal results stay");
        assert_eq!(verdict(&limit, Some(&running), false, false, 6, ttl), None, "a broken message never ends a running job");
    }
}
