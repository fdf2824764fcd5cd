//! The delivery at the broker: how a consumer takes its next one ([`next_delivery`]), its
//! attempt number, and, after [`crate::job::process`], what the broker does with it: [`classify`]
//! maps the job's [`Outcome`] (decided by `job::conclude::decide`, which owns the `max_attempts`
//! rule) to ack, requeue or dead-letter, and [`settle`] tells the broker.
//!
//! | outcome | result in Redis | delivery |
//! |---|---|---|
//! | the program ran (any exit, timeout, OOM) | terminal result | ack |
//! | bad input (decode, validation, missing or corrupt input object) | `rejected` | ack (never retried) |
//! | bad input without a readable job id | none | reject, no requeue (dead-lettered; the dead-letter consumer counts and drops it) |
//! | infrastructure failure, attempts left | `running` stays | nack + requeue |
//! | infrastructure failure, last attempt | `internal_error` | reject, no requeue (dead-lettered; the dead-letter consumer finds its result) |
//! | a terminal result already exists (duplicate delivery) | unchanged | ack |
//! | killed by shutdown past its grace period | `running` stays | nack + requeue |
//! | cancelled, or expired (its deadline passed before it started) | `cancelled` / `expired` | ack |
//! | another attempt of the job runs and holds its session | `running` stays | nack + requeue |
//! | last attempt, but its `internal_error` could not be written | `running` stays | nack + requeue (never dropped without a result) |
//!
//! The attempt counter is RabbitMQ's own `x-delivery-count` (quorum queues), so a worker that
//! dies mid-job still counts as an attempt and there is only one counter.

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Acker, Consumer};
use tokio::sync::watch;

/// What to do with a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Disposition {
    /// Done with it: remove from the queue.
    Ack,
    /// Put it back for another attempt.
    Requeue,
    /// Remove it to the dead-letter queue.
    DeadLetter,
}

/// How a job's processing ended, as far as delivery is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// A terminal result is stored (ran, rejected with id, or duplicate).
    Stored,
    /// Bad input with no job id to store a result under.
    Unidentifiable,
    /// The worker stopped the job because it is shutting down.
    Interrupted,
    /// No result of this attempt is to stand (an infrastructure failure, or another attempt of
    /// the job holds it); `final_result_stored` when the last attempt's `internal_error` was
    /// written.
    Infrastructure {
        /// Attempt number (1-based).
        attempt: u32,
        /// True when this was the last attempt and its `internal_error` result is stored.
        final_result_stored: bool,
    },
}

/// The classification table of the module doc.
pub(crate) fn classify(outcome: &Outcome, max_attempts: u32) -> Disposition {
    match outcome {
        Outcome::Stored => Disposition::Ack,
        Outcome::Unidentifiable => Disposition::DeadLetter,
        Outcome::Interrupted => Disposition::Requeue,
        Outcome::Infrastructure { attempt, final_result_stored } => {
            if *attempt >= max_attempts && *final_result_stored {
                Disposition::DeadLetter
            } else {
                Disposition::Requeue
            }
        }
    }
}

/// The delivery's attempt number: RabbitMQ's `x-delivery-count` + 1 (absent on the first).
/// A first delivery (`redelivered` false) is attempt 1 whatever its headers say: the broker
/// sets `x-delivery-count` only on redeliveries, so on a first delivery the header can only
/// come from the publisher, and a forged count of 8 would send a job straight to
/// `internal_error` on its first infrastructure failure (test: attempts_come_from_the_delivery_count).
pub(crate) fn attempt_number(headers: Option<&FieldTable>, redelivered: bool) -> u32 {
    if !redelivered {
        return 1;
    }
    let count = headers.and_then(|h| h.inner().get("x-delivery-count")).and_then(|v| match v {
        AMQPValue::LongLongInt(n) => u32::try_from(*n).ok(),
        AMQPValue::LongInt(n) => u32::try_from(*n).ok(),
        AMQPValue::LongUInt(n) => Some(*n),
        AMQPValue::ShortInt(n) => u32::try_from(*n).ok(),
        AMQPValue::ShortUInt(n) => Some(u32::from(*n)),
        AMQPValue::ShortShortInt(n) => u32::try_from(*n).ok(),
        AMQPValue::ShortShortUInt(n) => Some(u32::from(*n)),
        _ => None,
    });
    count.unwrap_or(0).saturating_add(1)
}

/// Settles the delivery as decided, through the delivery's own acker.
///
/// # Errors
/// The broker's error; the delivery then comes back after the channel closes (at-least-once).
pub(crate) async fn settle(acker: &Acker, disposition: Disposition) -> Result<(), lapin::Error> {
    let sent = match disposition {
        Disposition::Ack => acker.ack(BasicAckOptions::default()).await?,
        Disposition::Requeue => acker.nack(BasicNackOptions { requeue: true, multiple: false }).await?,
        Disposition::DeadLetter => acker.reject(BasicRejectOptions { requeue: false }).await?,
    };
    // lapin answers false when the delivery's channel is gone (closed by the broker, e.g. its
    // consumer_timeout): the settlement was not sent and the broker redelivers the message, so
    // it is an error, not a success (test: a_channel_closed_by_the_broker_is_reopened_alone_and_the_job_runs_once
    // in tests/channel_close.rs).
    if !sent {
        return Err(lapin::Error::from(lapin::ErrorKind::InvalidChannelState(
            lapin::ChannelState::Closed,
            "the delivery's channel is closed: not settled",
        )));
    }
    Ok(())
}

/// The next delivery of `consumer`; `None` once `shutdown` is signalled.
///
/// # Errors
/// The broker's error, or `cancelled` (a closed-channel error) when the broker cancelled the
/// consumer without a shutdown: the caller reconnects.
pub(crate) async fn next_delivery(
    consumer: &mut Consumer,
    shutdown: &mut watch::Receiver<bool>,
    cancelled: &'static str,
) -> Result<Option<lapin::message::Delivery>, lapin::Error> {
    // Already shutting down: `changed()` would wait for a change after this one (a caller that
    // saw the change, in a backoff's select, would then wait for a delivery that never comes).
    if *shutdown.borrow() {
        return Ok(None);
    }
    let delivery = tokio::select! {
        next = consumer.next() => next,
        _ = shutdown.changed() => return Ok(None),
    };
    match delivery {
        Some(Ok(d)) => Ok(Some(d)),
        Some(Err(e)) => Err(e),
        None if *shutdown.borrow() => Ok(None),
        None => Err(lapin::Error::from(lapin::ErrorKind::InvalidChannelState(lapin::ChannelState::Closed, cancelled))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        assert_eq!(classify(&Outcome::Stored, 3), Disposition::Ack);
        assert_eq!(classify(&Outcome::Unidentifiable, 3), Disposition::DeadLetter);
        let infra = |attempt, stored| Outcome::Infrastructure { attempt, final_result_stored: stored };
        assert_eq!(classify(&infra(1, false), 3), Disposition::Requeue);
        assert_eq!(classify(&infra(3, true), 3), Disposition::DeadLetter);
        assert_eq!(classify(&infra(3, false), 3), Disposition::Requeue, "never drop a job without a result");
    }

    #[test]
    fn attempts_come_from_the_delivery_count() {
        assert_eq!(attempt_number(None, false), 1);
        let mut headers = FieldTable::default();
        headers.insert("x-delivery-count".into(), AMQPValue::LongLongInt(2));
        assert_eq!(attempt_number(Some(&headers), true), 3);
        assert_eq!(attempt_number(Some(&headers), false), 1, "a publisher's count on a first delivery is ignored");
    }
}
