//! What a dead letter says and what the job it names gets: the newest `x-death` entry
//! ([`death`]), the deliveries it took ([`deliveries`]), and [`verdict`], the pure rule from
//! those and the job's stored state to the result written (the table of [`super`]).

use lapin::types::{AMQPValue, FieldTable};
use std::time::Duration;

use sandq_schemas::{JobResult, JobStatus, Sku};

/// Why the broker dead-lettered a message: the `reason` of the newest `x-death` entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeathReason {
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
    pub(crate) fn as_str(self) -> &'static str {
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
pub(crate) struct Death {
    /// The reason, classified; an unknown one is [`DeathReason::Other`].
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
pub(crate) fn death(headers: Option<&FieldTable>) -> Death {
    let entry = headers.and_then(|h| h.inner().get("x-death")).and_then(|v| match v {
        AMQPValue::FieldArray(entries) => entries.as_slice().first().and_then(|e| match e {
            AMQPValue::FieldTable(t) => Some(t.clone()),
            _ => None,
        }),
        _ => None,
    });
    let field = |name: &str| entry.as_ref().and_then(|t| t.inner().get(name)).and_then(text);
    // Clipped: anyone allowed to publish to the dead-letter exchange writes `x-death`, and the
    // reason is logged and stored (test: an_attacker_sized_rejection_reason_is_clipped in
    // tests/limits.rs).
    let raw_reason = crate::job::conclude::clip_reason(&field("reason").unwrap_or_default());
    let reason = match raw_reason.as_str() {
        "expired" => DeathReason::Expired,
        "delivery_limit" => DeathReason::DeliveryLimit,
        "rejected" => DeathReason::Rejected,
        _ => DeathReason::Other,
    };
    // The queue name is logged too (unclipped, 120 KB names grew the log by 600 KB each); a
    // real one is at most 255 bytes, so a clipped name is never a queue of ours.
    Death { reason, raw_reason, queue: field("queue").map(|q| crate::job::conclude::clip_reason(&q)) }
}

/// How many times the message was delivered before the broker gave up: an `x-delivery-count`
/// header when the broker keeps one on dead-lettered messages, else `fallback` (RabbitMQ 3.10
/// does not: its `x-death` entry counts dead-letterings, not deliveries, so the worker passes
/// its `amqp.delivery_limit` + 1, the deliveries a quorum queue makes before it gives up).
pub(crate) fn deliveries(headers: Option<&FieldTable>, fallback: u64) -> u64 {
    headers.and_then(|h| h.inner().get("x-delivery-count")).and_then(integer).unwrap_or(fallback)
}

/// The terminal result a dead-lettered job gets, given why it was dead-lettered, what is
/// stored for it now (`current`), whether its cancel key is set, and what its body says
/// (`spec`, when it decodes); `served` is the job's SKU and its queue's consumer count when the
/// dead letter came (`None` when not known), which an expired job's reason states. `None`:
/// write nothing (see the module doc).
pub(crate) fn verdict(
    death: &Death,
    current: Option<&JobResult>,
    cancelled: bool,
    spec_valid: bool,
    deliveries: u64,
    unserved_ttl: Duration,
    served: Option<(Sku, u32)>,
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
            match served {
                Some((sku, 0)) => {
                    format!("no worker took it within {ttl} (queues.unserved_ttl): no worker served its sku {sku} (its queue had no consumer when it expired)")
                }
                Some((sku, n)) => format!(
                    "no worker took it within {ttl} (queues.unserved_ttl): every worker serving its sku {sku} was busy ({n} consumer{} when it expired)",
                    if n == 1 { "" } else { "s" }
                ),
                None => format!("no worker took it within {ttl} (queues.unserved_ttl): no running worker serves its sku, or every one was busy"),
            },
        ),
        DeathReason::DeliveryLimit => (
            JobStatus::InternalError,
            format!(
                "its deliveries kept failing (killed its worker {deliveries} times): it was dead-lettered at the queue's delivery limit"
            ),
        ),
        DeathReason::Rejected => (JobStatus::InternalError, "a worker dead-lettered it without storing a result".to_owned()),
        DeathReason::Other => (JobStatus::InternalError, format!("the broker dead-lettered it ({})", death.raw_reason)),
    })
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

    /// Each dead letter's terminal result; a finished job keeps its own, and a message that is
    /// not a valid job never ends a running one.
    #[test]
    fn verdicts() {
        let ttl = Duration::from_secs(3600);
        let expired = death(Some(&headers("expired", None)));
        let limit = death(Some(&headers("delivery_limit", None)));
        let queued = JobResult::new("j", JobStatus::Queued);
        let running = JobResult::new("j", JobStatus::Running);
        let done = JobResult::new("j", JobStatus::Succeeded);
        let (status, reason) = verdict(&expired, Some(&queued), false, true, 1, ttl, None).expect("expired");
        assert_eq!(status, JobStatus::Expired);
        assert_eq!(reason, "no worker took it within 1h (queues.unserved_ttl): no running worker serves its sku, or every one was busy");
        let (_, reason) = verdict(&expired, Some(&queued), false, true, 1, ttl, Some((Sku::L, 0))).expect("expired");
        assert_eq!(
            reason,
            "no worker took it within 1h (queues.unserved_ttl): no worker served its sku L (its queue had no consumer when it expired)"
        );
        let (_, reason) = verdict(&expired, Some(&queued), false, true, 1, ttl, Some((Sku::M, 3))).expect("expired");
        assert_eq!(
            reason,
            "no worker took it within 1h (queues.unserved_ttl): every worker serving its sku M was busy (3 consumers when it expired)"
        );
        assert_eq!(verdict(&expired, None, false, false, 1, ttl, None).map(|v| v.0), Some(JobStatus::Expired), "no queued record");
        assert_eq!(verdict(&expired, Some(&queued), true, true, 1, ttl, None).map(|v| v.0), Some(JobStatus::Cancelled));
        assert_eq!(verdict(&expired, Some(&running), false, true, 1, ttl, None).map(|v| v.0), Some(JobStatus::InternalError));
        let (status, reason) = verdict(&limit, Some(&running), false, true, 6, ttl, None).expect("limit");
        assert_eq!(status, JobStatus::InternalError);
        assert!(reason.starts_with("its deliveries kept failing (killed its worker 6 times)"), "{reason}");
        assert_eq!(verdict(&limit, Some(&done), false, true, 6, ttl, None), None, "terminal results stay");
        assert_eq!(verdict(&limit, Some(&running), false, false, 6, ttl, None), None, "a broken message never ends a running job");
    }
}
