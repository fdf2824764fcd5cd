//! The dead-letter consumer: every worker also consumes `<ns>.dead`, so that no job waits
//! forever and no separate process has to be deployed. For each message the broker
//! dead-lettered, the job it names gets a terminal result unless it has one already:
//!
//! | `x-death` reason | how the message got here | result written |
//! |---|---|---|
//! | `expired` | no worker took it within `queues.unserved_ttl` (the queue's `x-message-ttl`, or the `expiration` of a copy sent round for another tenant's turn: the rest of that TTL, `crate::fair`) | `expired`: "no worker took it within ...", saying whether its SKU's queue had a consumer when it expired (`cancelled` when its cancel key is set; `internal_error` when it had started and its worker was lost) |
//! | `delivery_limit` | delivered `amqp.delivery_limit` + 1 times without being settled: each delivery killed or lost its worker | `internal_error`: "its deliveries kept failing (killed its worker N times)" |
//! | `rejected` | a worker dead-lettered it: no usable job id, or its `internal_error` is already stored | `internal_error` when a job id is found and it has no terminal result |
//! | other (`maxlen`) | a policy limit | `internal_error` naming the reason |
//!
//! The job id comes from the body (`job_id`), else the `message_id` property, each only when it
//! is a valid id. A message without one is counted (`sandq_dead_letters_total{action =
//! "no_job_id"}`), logged and acked: there is nowhere to report it. A job still `running` is
//! not given a result on a dead letter's word (anyone allowed to publish to the dead-letter
//! exchange can write `x-death`, and a client's duplicate can expire while the first copy
//! runs): a `delivery_limit` counts at once only when the job's record shows
//! that many attempts, and otherwise (and for any other reason) the job is checked again once
//! any attempt must have ended, `limits.max_timeout` plus 30 minutes after its start
//! (`deferred`), and given `internal_error` if it is still `running` with the same attempt.
//! Deferred checks are kept in Redis ([`Names::deferred_checks`]: one per job and attempt, by
//! due time) and taken by whichever worker's [`sweeper`] comes first, so a check outlives the
//! worker that deferred it and no count of forged records can crowd a real one out (an
//! in-process list of 10,000 could be filled by 11,000 forged records, and a really lost job's
//! dead letter would then be dropped; test: forged_running_jobs_cannot_crowd_out_a_lost_jobs_check_which_outlives_its_worker
//! in tests/dead_letters.rs). A record Redis holds as another type or shape is not retried
//! (`unreadable`: a retry would hold every dead letter behind it; test:
//! forged_and_unreadable_dead_letters_do_not_end_a_running_job_or_block_the_queue). A message
//! naming a job that is `running` whose body is not a valid job (forged, or broken) is dropped
//! without a result, as the worker drops such messages (test:
//! a_malformed_message_never_ends_a_running_job in tests/hostile.rs). Every message is acked
//! once its result is stored (or found stored); a Redis failure puts it back after a pause.

mod deferred;
mod verdict;

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, Consumer};
use sandq_core::results;
use sandq_core::time::now_ms;
use sandq_schemas::{JobResult, JobSpec, JobStatus, Sku};
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::context::Context;

use deferred::defer;
pub(crate) use deferred::sweeper;
pub(crate) use verdict::{death, deliveries, verdict, DeathReason};

/// The largest job record a dead letter's handling reads, bytes. The records it needs are
/// `queued` (a client's, small unless forged) or `running` (a worker's: a few hundred bytes);
/// a terminal record of any size is recognised by its `status` field alone (a record is read
/// only after its size is checked in Redis). Only the fields it uses are decoded
/// ([`results::read_head`]), so a record costs about its size (a whole decode of 1 MiB of empty
/// strings took 24 MiB; test: a_dead_letter_decodes_only_the_fields_it_uses_of_a_client_record
/// in tests/limits.rs).
const MAX_RECORD_BYTES: u64 = 1 << 20;

/// Dead-lettered messages handled at once by one worker.
const PREFETCH: u16 = 8;

/// Consumes the dead-letter queue on `channel` until `shutdown`; `connection` (the channel's)
/// opens the short channels that read a SKU queue's consumer count.
///
/// # Errors
/// The broker's error (the caller reconnects).
pub(crate) async fn run(
    ctx: Context,
    channel: Channel,
    connection: Arc<Connection>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), lapin::Error> {
    channel.basic_qos(PREFETCH, BasicQosOptions::default()).await?;
    let tag = format!("{}-dead-letters", ctx.settings.worker_id);
    let mut consumer: Consumer = channel
        .basic_consume(ctx.settings.names.dead_letter_queue().into(), tag.into(), BasicConsumeOptions::default(), FieldTable::default())
        .await?;
    loop {
        let Some(delivery) = crate::ack::next_delivery(&mut consumer, &mut shutdown, "dead-letter consumer cancelled").await? else {
            return Ok(());
        };
        // Through ack::settle, which takes lapin's "not sent" (the channel closed) for the
        // error it is: the consumer is then reopened.
        // A panic while handling one message (a defect reachable by a client-written record)
        // drops that message instead of ending this consumer, which would otherwise leave the
        // worker without one until it restarts (test:
        // a_client_written_start_time_neither_panics_nor_pins_the_dead_letter_consumer in
        // tests/dead_letters.rs).
        let handled = AssertUnwindSafe(handle(&ctx, &connection, &delivery)).catch_unwind().await.unwrap_or_else(|_| {
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
async fn handle(ctx: &Context, connection: &Connection, delivery: &Delivery) -> bool {
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
            // Retrying would hold every dead letter behind this one (test:
            // forged_and_unreadable_dead_letters_do_not_end_a_running_job_or_block_the_queue).
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
    // publish can expire while the first copy runs; test:
    // forged_and_unreadable_dead_letters_do_not_end_a_running_job_or_block_the_queue).
    if let Some(run) = current.as_ref().filter(|r| r.status == JobStatus::Running) {
        let limit = settings.services.amqp.delivery_limit;
        // A `delivery_limit` counts at once only when the record shows that many attempts. With
        // fewer it may be forged, or real: deliveries that failed before their own `running`
        // write (Redis refusing the worker's scripts) leave the record at an earlier attempt,
        // and dropping the dead letter would lose the job for good. So it is deferred like any
        // other: checked once its attempt must have ended (test:
        // a_delivery_limit_dead_letter_with_fewer_attempts_is_checked_when_due).
        if death.reason != DeathReason::DeliveryLimit || run.attempt < limit {
            // The record's times are a client's to write: a start in the future counts as now,
            // and nothing overflows (a start of u64::MAX would panic, and one 50 years ahead
            // would hold its deferred check for 50 years; test:
            // a_client_written_start_time_neither_panics_nor_pins_the_dead_letter_consumer).
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
    let header_keys: Vec<String> =
        headers.map(|h| h.inner().keys().take(32).map(|k| crate::job::conclude::clip_reason(k.as_str())).collect()).unwrap_or_default();
    tracing::debug!(%job_id, ?header_keys, deliveries = count, "dead-lettered message");
    // The SKU: of the queue it was dead-lettered from when that is one of ours, else its body's.
    let sku = death
        .queue
        .as_deref()
        .and_then(|queue| Sku::ALL.into_iter().find(|s| names.jobs_queue(*s) == queue))
        .or_else(|| spec.as_ref().map(|s| s.sku));
    // An expired job's reason says whether any worker served its SKU when it expired.
    let served = match (death.reason, sku) {
        (DeathReason::Expired, Some(sku)) => consumers(connection, &names.jobs_queue(sku)).await.map(|n| (sku, n)),
        _ => None,
    };
    let Some((status, reason)) =
        verdict(&death, current.as_ref(), cancelled, spec.is_some(), count, settings.services.queues.unserved_ttl, served)
    else {
        crate::metrics::dead_letter(death.reason.as_str(), "already_final");
        info!(%job_id, reason = death.raw_reason, status = ?current.map(|c| c.status), "dead-lettered job needs no result");
        return true;
    };
    let mut result = JobResult::new(job_id.clone(), status);
    result.reason = Some(reason.clone());
    result.sku = spec.as_ref().map(|s| s.sku).or(sku);
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

/// The consumer count of `queue` (worker slots serving its SKU) now, 0 when it does not
/// exist, read by a passive declare on a channel of its own (a passive declare of a missing
/// queue closes its channel, which must not be the dead-letter consumer's); `None` when the
/// broker does not answer.
async fn consumers(connection: &Connection, queue: &str) -> Option<u32> {
    let channel = connection.create_channel().await.ok()?;
    let passive = QueueDeclareOptions { passive: true, ..Default::default() };
    let declared = channel.queue_declare(queue.into(), passive, FieldTable::default()).await;
    if channel.status().connected() {
        let _ = tokio::time::timeout(Duration::from_secs(5), channel.close(200, "consumer count read".into())).await;
    }
    match declared {
        Ok(queue) => Some(queue.consumer_count()),
        Err(e) if sandq_core::topology::not_found(&e) => Some(0),
        Err(e) => {
            warn!(queue, error = %e, "dead letter: cannot read the queue's consumer count");
            None
        }
    }
}

/// True for a Redis error worth a retry: Redis away or failing over (an I/O error, a dropped
/// or refused connection, a timeout, no node or primary found) or an error the server
/// returned (`LOADING`, `READONLY`, `TRYAGAIN`, `OOM`...), but for a key of another type
/// (`WRONGTYPE`, which no retry changes). Anything else (a reply of an unexpected type or bytes
/// that do not parse, a client-side error) comes from what is stored, and no retry changes it
/// either: retrying would hold every dead letter behind it, for ever (tests:
/// only_connection_and_server_errors_are_transient;
/// a_status_that_is_not_utf8_does_not_loop_the_dead_letter_queue in tests/dead_letters.rs).
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
/// dead letter's body (a forged body can say `timeout: 0s`).
fn attempt_lifetime(settings: &crate::settings::Settings) -> Duration {
    settings.limits.max_timeout + Duration::from_secs(30 * 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only Redis being away or refusing is retried; an error of what is stored is not.
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
}
