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
//! - The copy waits no longer than the original could have: it expires (AMQP `expiration`)
//!   when `queues.unserved_ttl` from the original publish (its AMQP `timestamp`) is over, and is
//!   then dead-lettered `expired` like any job nobody took. So the job's records, which the
//!   gateway keeps for one `unserved_ttl` of waiting ([`sandq_core::results::live_ttl`]), outlive
//!   it. A delivery with no timestamp, or with little of that time left ([`copy_expiry`]),
//!   runs instead of going round.
//! - The copy is published on the slot's own channel in confirm mode; once the broker
//!   confirmed it, the job's round count is recorded in Redis ([`fair::went_round`]) and only
//!   then is the original acked. A failure before the confirm leaves the original, which then
//!   runs here (fairness gives way). If the ack fails after it, the broker hands the original
//!   out again: its round count, lower than the recorded one, shows that a newer copy is
//!   queued, and it is acked without running ([`superseded`]). The record is written only once
//!   a copy is confirmed, so no delivery is dropped unless a newer one is durably queued.
//! - A session's job never goes round (two cells of one session would change places), nor one
//!   whose `deadline_ms` passed (admission expires it) or whose body does not decode (the job
//!   flow rejects it).
//! - A message goes round at most [`MAX_ROTATIONS`] times (header [`ROTATIONS_HEADER`]), so
//!   a stale count (an entry whose job is gone, until its expiry removes it) cannot send a job
//!   round for ever: it costs each job at most that many passes through the queue.
//! - Redis trouble never holds a job: it runs without a turn, uncounted.

use std::time::Duration;

use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties as AMQPProperties, Channel, Confirmation};
use sandq_core::fair::{self, Turn};
use sandq_core::time::now_ms;
use sandq_schemas::{JobSpec, Sku};
use tracing::{debug, info, warn};

use crate::context::Context;
use crate::metrics;

/// Header counting how many times a message went round: set by [`rotate`] on the copy.
pub(crate) const ROTATIONS_HEADER: &str = "x-sandq-rotations";

/// Most times one job goes round before it runs whatever the counts say.
pub(crate) const MAX_ROTATIONS: u32 = 4;

/// Least time a copy must have left to wait in its queue for the job to go round, ms (with
/// less, the job runs: a copy about to expire would only be dead-lettered).
const MIN_COPY_WAIT_MS: u64 = 60_000;

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
    /// A delivery handed out again after a newer copy of it went round (confirmed and
    /// recorded): that copy runs the job; ack this one without running it.
    Superseded,
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

/// Whether a delivery that went round `own` times is a stale one, superseded by a copy that
/// went round `recorded` times ([`fair::rounds`]): a newer copy is durably queued (or ran), so
/// this one must not run too.
fn superseded(own: u32, recorded: Option<u32>) -> bool {
    recorded.is_some_and(|recorded| own < recorded)
}

/// How long a job's copy may wait in its queue: [`copy_expiry`]'s answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CopyExpiry {
    /// The queues set no unserved TTL: no expiry either.
    Unlimited,
    /// This many ms: what is left of `unserved_ttl` since the original publish.
    In(u64),
    /// Too little left, or unknown: the job runs instead of going round.
    Run,
}

/// The expiry of the copy of a job published at `timestamp_s` (the AMQP `timestamp`, Unix
/// seconds, kept by every copy) that goes round at `now_ms` in a queue whose unserved TTL is
/// `unserved_ttl`: the rest of that TTL, so that however many times the job goes round it
/// waits at most one `unserved_ttl` in all. Without a timestamp (a publisher that sets none),
/// with one more than a minute ahead of `now_ms` (no publish time to trust), or with less left
/// than a minute or a tenth of the TTL, the job runs.
fn copy_expiry(unserved_ttl: Duration, timestamp_s: Option<u64>, now_ms: u64) -> CopyExpiry {
    if unserved_ttl.is_zero() {
        return CopyExpiry::Unlimited;
    }
    let Some(published_ms) = timestamp_s.map(|s| s.saturating_mul(1000)) else {
        return CopyExpiry::Run;
    };
    if published_ms > now_ms.saturating_add(60_000) {
        return CopyExpiry::Run;
    }
    let ttl = u64::try_from(unserved_ttl.as_millis()).unwrap_or(u64::MAX);
    let left = ttl.saturating_sub(now_ms.saturating_sub(published_ms));
    if left < MIN_COPY_WAIT_MS || left < ttl / 10 {
        CopyExpiry::Run
    } else {
        CopyExpiry::In(left)
    }
}

/// Why the job of `body` (decoded with the worker's codec, `max_bytes` at most) runs although
/// it is another tenant's turn, if it does: it is a session's (going round, a cell could run
/// after the next cell of its session), its `deadline_ms` has passed at `now_ms` (admission
/// expires it), or the body is not a job (the job flow rejects it).
fn must_run(body: &[u8], max_bytes: usize, now_ms: u64) -> Option<&'static str> {
    if body.len() > max_bytes {
        return Some("not a job");
    }
    let Ok(spec) = sandq_schemas::decode::<JobSpec>(body) else {
        return Some("not a job");
    };
    if spec.session.is_some() {
        Some("a session's job")
    } else if spec.deadline_ms.is_some_and(|deadline| deadline < now_ms) {
        Some("its deadline passed")
    } else {
        None
    }
}

/// Until when an attempt may hold its slot (Unix ms, from `now`): the longest job timeout the
/// worker accepts (`limits.max_timeout`), the session lock wait before it, and 10 minutes for
/// staging and collecting.
fn lease_until(ctx: &Context, now: u64) -> u64 {
    let longest = ctx.settings.limits.max_timeout + ctx.settings.sessions.lock_wait + Duration::from_secs(600);
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
    let rounds = rotations(delivery.properties);
    // Only a delivery the broker hands out again can be superseded: the original of a copy is
    // acked once the copy is recorded, and comes back only if that ack was lost (its channel
    // dropped, the worker died), marked redelivered.
    if delivery.redelivered || delivery.attempt > 1 {
        match fair::rounds(&mut redis, names, &job_id, MAX_ROTATIONS).await {
            Ok(recorded) if superseded(rounds, recorded) => {
                info!(job_id, round = rounds, recorded, "a newer copy of this delivery went round the queue; acked without running");
                metrics::fair_turn(delivery.sku, "superseded");
                return Taken::Superseded;
            }
            Ok(_) => {}
            // Runs: the job id's de-duplication is what is left against a copy also running.
            Err(e) => warn!(error = %e, job_id, "cannot read how many times the job went round; it runs"),
        }
    }
    let shares = match fair::shares(&mut redis, names, delivery.sku, &job_id, now).await {
        Ok(shares) => shares,
        Err(e) => {
            warn!(error = %e, job_id, "cannot read the tenants' shares; the job runs without its turn");
            metrics::fair_turn(delivery.sku, "uncounted");
            return Taken::Run(None);
        }
    };
    let mut turn = "run";
    if may_rotate(delivery.attempt, delivery.redelivered, rounds) {
        if let Turn::Rotate { waiting } = fair::turn(&shares.tenant, &shares.all) {
            let unserved_ttl = ctx.settings.services.queues.unserved_ttl;
            let timestamp = *delivery.properties.timestamp();
            let expiry = copy_expiry(unserved_ttl, timestamp, now);
            let held = must_run(delivery.body, crate::validate::max_body_bytes(&ctx.settings.limits), now)
                .or((expiry == CopyExpiry::Run).then_some("too little of its unserved_ttl left, or no publish time"));
            if let Some(why) = held {
                debug!(job_id, tenant = %shares.tenant, waiting, why, "another tenant's turn, but the job runs");
            } else {
                let round = rounds + 1;
                match rotate(channel, ctx, delivery, round, expiry).await {
                    Ok(()) => {
                        debug!(job_id, tenant = %shares.tenant, waiting, round, "another tenant's turn: the job went to the tail of the queue");
                        // Before the ack: a lost ack then hands out a delivery known as
                        // superseded. If this write fails the ack still goes ahead: the
                        // original cannot be kept to run here, its copy is queued anyway; only a
                        // lost ack on top of it leaves both to run (the job id's de-duplication
                        // is then what is left).
                        let ttl = sandq_core::results::live_ttl(unserved_ttl, ctx.settings.limits.max_timeout, Duration::ZERO);
                        if let Err(e) = fair::went_round(&mut redis, names, &job_id, round, ttl).await {
                            warn!(error = %e, job_id, "cannot record that the job went round; acking its delivery anyway");
                        }
                        let until = match expiry {
                            CopyExpiry::In(left) => now.saturating_add(left),
                            CopyExpiry::Unlimited | CopyExpiry::Run => queued_until(ctx, now),
                        };
                        if let Err(e) = fair::requeued_at_tail(&mut redis, names, delivery.sku, &job_id, until).await {
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
/// properties, [`ROTATIONS_HEADER`] set to `round` and `expiry` as its AMQP `expiration`, and
/// waits for the broker's confirm.
async fn rotate(channel: &Channel, ctx: &Context, delivery: &Delivery<'_>, round: u32, expiry: CopyExpiry) -> Result<(), RotateError> {
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
    let mut properties = delivery.properties.clone().with_headers(headers).with_delivery_mode(2);
    if let CopyExpiry::In(left) = expiry {
        // Dead-lettered `expired` when it passes, as the queue's own TTL would.
        properties = properties.with_expiration(left.to_string().into());
    }
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
    fn a_delivery_older_than_the_recorded_round_is_superseded() {
        assert!(!superseded(0, None), "never went round");
        assert!(superseded(0, Some(1)), "the original of a confirmed copy");
        assert!(superseded(2, Some(3)));
        assert!(!superseded(3, Some(3)), "the newest copy itself (a retry of it) runs");
        assert!(!superseded(4, Some(3)));
    }

    #[test]
    fn a_copy_waits_what_is_left_of_one_unserved_ttl_since_the_publish() {
        let hour = Duration::from_secs(3600);
        let published_s = 1_000_000;
        let at = |after_ms: u64| published_s * 1000 + after_ms;
        assert_eq!(copy_expiry(hour, Some(published_s), at(0)), CopyExpiry::In(3_600_000));
        assert_eq!(copy_expiry(hour, Some(published_s), at(600_000)), CopyExpiry::In(3_000_000), "10 min waited");
        assert_eq!(copy_expiry(hour, Some(published_s), at(3_240_000)), CopyExpiry::In(360_000), "a tenth left");
        assert_eq!(copy_expiry(hour, Some(published_s), at(3_240_001)), CopyExpiry::Run, "less than a tenth left");
        assert_eq!(copy_expiry(hour, Some(published_s), at(7_200_000)), CopyExpiry::Run, "over");
        assert_eq!(copy_expiry(hour, None, at(0)), CopyExpiry::Run, "no publish time");
        assert_eq!(copy_expiry(hour, Some(published_s + 61), at(0)), CopyExpiry::Run, "published in the future");
        assert_eq!(copy_expiry(hour, Some(published_s + 30), at(0)), CopyExpiry::In(3_600_000), "clocks a little apart");
        assert_eq!(copy_expiry(hour, Some(u64::MAX), at(0)), CopyExpiry::Run);
        // A short TTL: at least a minute must be left.
        let two_min = Duration::from_secs(120);
        assert_eq!(copy_expiry(two_min, Some(published_s), at(60_000)), CopyExpiry::In(60_000));
        assert_eq!(copy_expiry(two_min, Some(published_s), at(60_001)), CopyExpiry::Run);
        assert_eq!(copy_expiry(Duration::from_secs(30), Some(published_s), at(0)), CopyExpiry::Run, "a TTL under a minute");
        // No TTL: no expiry, timestamp or not.
        assert_eq!(copy_expiry(Duration::ZERO, None, at(0)), CopyExpiry::Unlimited);
        assert_eq!(copy_expiry(Duration::ZERO, Some(published_s), at(99_999_999)), CopyExpiry::Unlimited);
    }

    #[test]
    fn session_jobs_late_jobs_and_bad_bodies_never_go_round() {
        let body = |session: Option<&str>, deadline_ms: Option<u64>| {
            let mut spec = JobSpec::new("t_1", Sku::S, sandq_schemas::Runtime::Python, "print(1)");
            spec.session = session.map(Into::into);
            spec.deadline_ms = deadline_ms;
            sandq_schemas::encode(&spec).expect("encode")
        };
        assert_eq!(must_run(&body(None, None), 1 << 20, 1_000), None);
        assert_eq!(must_run(&body(None, Some(1_000)), 1 << 20, 1_000), None, "its deadline is now: not passed");
        assert_eq!(must_run(&body(Some("s1"), None), 1 << 20, 1_000), Some("a session's job"));
        assert_eq!(must_run(&body(None, Some(999)), 1 << 20, 1_000), Some("its deadline passed"));
        assert_eq!(must_run(b"not msgpack", 1 << 20, 1_000), Some("not a job"));
        assert_eq!(must_run(&body(None, None), 4, 1_000), Some("not a job"), "larger than any job: not decoded");
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
