//! A fair share of each SKU's slots between tenants, at the moment a slot takes a delivery
//! (before step 1 of [`crate::job`]): [`take`] asks [`sandq_core::fair::turn`] whether the job's
//! tenant may have the slot, and when another tenant with fewer jobs running has some waiting,
//! the job goes back to the tail of its queue ([`rotate`]) instead of running, so that the queue
//! turns until the other tenant's job comes up. The counts and the rule are
//! [`sandq_core::fair`]'s; the design is docs/threat-model.md "Finding 10".
//!
//! What keeps the delivery guarantees:
//!
//! - Only a first delivery goes round (attempt 1, not `redelivered`): its copy is a new message
//!   whose delivery count starts at zero, which is honest only for a delivery no attempt was
//!   made of. A retry is never sent round, so `x-delivery-limit` and `max_attempts` count
//!   attempts as before.
//! - The copy is published on the slot's own channel in confirm mode and the original is acked
//!   only once the broker confirmed the copy: a failure before the confirm leaves the original,
//!   which then runs here (fairness gives way); a failure after it leaves both, and the job
//!   id's de-duplication (its stored result, [`crate::context::InFlight`]) runs it once.
//! - A message goes round at most [`MAX_ROTATIONS`] times (header [`ROTATIONS_HEADER`]), so
//!   a stale count (an entry whose job is gone, until its expiry removes it) cannot send a job
//!   round for ever: it costs each job at most that many passes through the queue.
//! - Redis trouble never holds a job: it runs without a turn, uncounted.

use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties as AMQPProperties, Channel, Confirmation};
use sandq_core::fair::{self, Turn};
use sandq_core::time::now_ms;
use sandq_schemas::Sku;
use tracing::{debug, warn};

use crate::context::Context;
use crate::metrics;

/// Header counting how many times a message went round: set by [`rotate`] on the copy.
pub(crate) const ROTATIONS_HEADER: &str = "x-sandq-rotations";

/// Most times one job goes round before it runs whatever the counts say.
pub(crate) const MAX_ROTATIONS: u32 = 4;

/// Longest job id taken from a message's `message_id` (longer ones, never a valid job's, are
/// not counted).
const MAX_ID_LEN: usize = 128;

/// A slot's taken job, counted as running on its SKU until [`Running::end`].
#[derive(Debug)]
pub(crate) struct Running {
    sku: Sku,
    member: String,
}

/// What a slot does with a delivery: [`take`]'s answer.
#[derive(Debug)]
pub(crate) enum Taken {
    /// Run it; counted as running when `Some`.
    Run(Option<Running>),
    /// Another tenant's turn: the job's copy is at the tail of the queue (confirmed); ack the
    /// delivery without running it.
    Rotated,
}

/// The delivery's facts [`take`] decides on.
#[derive(Debug)]
pub(crate) struct Delivery<'a> {
    /// The SKU whose queue it came from.
    pub sku: Sku,
    /// The body, as published (copied as it is when the job goes round).
    pub body: &'a [u8],
    /// Its properties (`message_id` is the job id).
    pub properties: &'a AMQPProperties,
    /// Its attempt number ([`crate::ack::attempt_number`]).
    pub attempt: u32,
    /// The broker's `redelivered` flag.
    pub redelivered: bool,
}

/// How many times the message went round already (0 without the header).
fn rotations(properties: &AMQPProperties) -> u32 {
    let value = properties.headers().as_ref().and_then(|h| h.inner().get(ROTATIONS_HEADER).cloned());
    match value {
        Some(AMQPValue::LongUInt(n)) => n,
        Some(AMQPValue::LongLongInt(n)) => u32::try_from(n).unwrap_or(u32::MAX),
        Some(AMQPValue::LongInt(n)) => u32::try_from(n).unwrap_or(u32::MAX),
        // A header of another type was not set by a worker: no more rounds.
        Some(_) => u32::MAX,
        None => 0,
    }
}

/// Whether a delivery may go round: a first delivery that went round fewer than
/// [`MAX_ROTATIONS`] times.
fn may_rotate(attempt: u32, redelivered: bool, rotations: u32) -> bool {
    attempt == 1 && !redelivered && rotations < MAX_ROTATIONS
}

/// Until when an attempt may hold its slot (Unix ms, from `now`): the longest job timeout, the
/// session lock wait before it, and 10 minutes for staging and collecting.
fn lease_until(ctx: &Context, now: u64) -> u64 {
    let longest = sandq_schemas::Limits::default().max_timeout + ctx.settings.sessions.lock_wait + std::time::Duration::from_secs(600);
    now.saturating_add(u64::try_from(longest.as_millis()).unwrap_or(u64::MAX))
}

/// Until when a message published at `now` may wait in its queue (Unix ms).
fn queued_until(ctx: &Context, now: u64) -> u64 {
    fair::queued_until(ctx.settings.services.queues.unserved_ttl, now)
}

/// Decides a delivery's turn and, when it is another tenant's, sends the job round on
/// `channel` (in confirm mode). Never fails: without its counts the job runs.
pub(crate) async fn take(ctx: &Context, channel: &Channel, delivery: &Delivery<'_>) -> Taken {
    let Some(job_id) = delivery.properties.message_id().as_ref().map(ToString::to_string).filter(|id| id.len() <= MAX_ID_LEN) else {
        return Taken::Run(None);
    };
    let names = &ctx.settings.names;
    let mut redis = ctx.redis.clone();
    let now = now_ms();
    let shares = match fair::shares(&mut redis, names, delivery.sku, &job_id, now).await {
        Ok(shares) => shares,
        Err(e) => {
            warn!(error = %e, job_id, "cannot read the tenants' shares; the job runs without its turn");
            metrics::fair_turn(delivery.sku, "uncounted");
            return Taken::Run(None);
        }
    };
    let rounds = rotations(delivery.properties);
    let mut turn = "run";
    if may_rotate(delivery.attempt, delivery.redelivered, rounds) {
        if let Turn::Rotate { waiting } = fair::turn(&shares.tenant, &shares.all) {
            match rotate(channel, ctx, delivery, rounds + 1).await {
                Ok(()) => {
                    debug!(job_id, tenant = %shares.tenant, waiting, round = rounds + 1, "another tenant's turn: the job went to the tail of the queue");
                    if let Err(e) = fair::requeued_at_tail(&mut redis, names, delivery.sku, &job_id, queued_until(ctx, now)).await {
                        warn!(error = %e, job_id, "cannot move the job's queued entry's expiry");
                    }
                    metrics::fair_turn(delivery.sku, "rotated");
                    return Taken::Rotated;
                }
                Err(e) => {
                    warn!(error = %e, job_id, "cannot put the job at the tail of its queue; it runs now");
                    turn = "rotate_failed";
                }
            }
        }
    }
    let member = shares.member(&job_id);
    metrics::fair_turn(delivery.sku, turn);
    match fair::start(&mut redis, names, delivery.sku, &job_id, &member, lease_until(ctx, now)).await {
        Ok(()) => Taken::Run(Some(Running { sku: delivery.sku, member })),
        Err(e) => {
            warn!(error = %e, job_id, "cannot count the job as running");
            Taken::Run(None)
        }
    }
}

/// Why a job could not be sent round.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RotateError {
    /// The publish or its confirm failed.
    #[error("publishing the job's copy: {0}")]
    Publish(#[from] lapin::Error),
    /// The broker did not take the copy (nacked, or returned it unroutable).
    #[error("the broker did not take the job's copy: {0}")]
    Refused(String),
}

/// Publishes the delivery's body again to its SKU (the tail of the same queue) with its
/// properties and [`ROTATIONS_HEADER`] set to `round`, and waits for the broker's confirm.
async fn rotate(channel: &Channel, ctx: &Context, delivery: &Delivery<'_>, round: u32) -> Result<(), RotateError> {
    let names = &ctx.settings.names;
    let mut headers = FieldTable::default();
    if let Some(old) = delivery.properties.headers() {
        for (key, value) in old.inner() {
            // The broker's own headers belong to the original message.
            if !key.as_str().starts_with("x-") {
                headers.insert(key.clone(), value.clone());
            }
        }
    }
    headers.insert(ROTATIONS_HEADER.into(), AMQPValue::LongUInt(round));
    let properties = delivery.properties.clone().with_headers(headers).with_delivery_mode(2);
    let confirm = channel
        .basic_publish(
            names.jobs_exchange().into(),
            names.routing_key(delivery.sku).into(),
            BasicPublishOptions { mandatory: true, ..Default::default() },
            delivery.body,
            properties,
        )
        .await?
        .await?;
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(returned)) => Err(RotateError::Refused(format!("returned: {}", returned.reply_text))),
        Confirmation::Nack(_) => Err(RotateError::Refused("nacked".into())),
        Confirmation::NotRequested => Err(RotateError::Refused("the channel is not in confirm mode".into())),
    }
}

impl Running {
    /// The attempt ended: the job no longer runs; `requeued` when its delivery goes back to the
    /// queue (then it is queued again, as it is). Best effort: a failure leaves the entry to
    /// its expiry.
    pub(crate) async fn end(self, ctx: &Context, requeued: bool) {
        let mut redis = ctx.redis.clone();
        let back = requeued.then(|| queued_until(ctx, now_ms()));
        if let Err(e) = fair::end(&mut redis, &ctx.settings.names, self.sku, &self.member, back).await {
            warn!(error = %e, member = self.member, "cannot count the job's attempt as over; its entry expires by itself");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_first_delivery_goes_round_and_a_bounded_number_of_times() {
        assert!(may_rotate(1, false, 0));
        assert!(may_rotate(1, false, MAX_ROTATIONS - 1));
        assert!(!may_rotate(1, false, MAX_ROTATIONS), "bounded");
        assert!(!may_rotate(2, true, 0), "a retry keeps its attempt count: never sent round");
        assert!(!may_rotate(1, true, 0), "redelivered (the broker counted a delivery)");
    }

    #[test]
    fn the_round_count_is_read_from_its_header() {
        let with = |value: Option<AMQPValue>| {
            let mut headers = FieldTable::default();
            if let Some(value) = value {
                headers.insert(ROTATIONS_HEADER.into(), value);
            }
            rotations(&AMQPProperties::default().with_headers(headers))
        };
        assert_eq!(rotations(&AMQPProperties::default()), 0);
        assert_eq!(with(None), 0);
        assert_eq!(with(Some(AMQPValue::LongUInt(3))), 3);
        assert_eq!(with(Some(AMQPValue::LongLongInt(2))), 2);
        assert_eq!(with(Some(AMQPValue::LongLongInt(-1))), u32::MAX);
        assert_eq!(with(Some(AMQPValue::LongString("1".into()))), u32::MAX, "not a worker's: no more rounds");
    }
}
