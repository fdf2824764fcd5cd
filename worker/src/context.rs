//! What every task of a worker shares: [`Context`] (settings, clients, capacity, the warm
//! pool) and [`InFlight`], the job ids it is running.
//!
//! Lives apart from the job pipeline so that the stages, the session reaper, the warm refill
//! and the dead-letter consumer depend on it, and nothing depends back on them.

use std::sync::Arc;

use sandq_core::redis_conn::RedisConn;
use tracing::warn;

use crate::settings::Settings;

/// What every job of a worker shares.
#[derive(Clone)]
pub(crate) struct Context {
    /// The worker's configuration, checked at start.
    pub settings: Arc<Settings>,
    /// S3 client.
    pub s3: aws_sdk_s3::Client,
    /// Redis (reconnects by itself).
    pub redis: RedisConn,
    /// A connection of its own for live events ([`crate::live`]): their pipelines of up to a
    /// few MiB never queue in front of results, cancel checks and session leases.
    pub live_redis: RedisConn,
    /// Becomes true when shutdown's grace period is over: running jobs are killed and requeued.
    pub abort: tokio::sync::watch::Receiver<bool>,
    /// Cores and memory left for running jobs.
    pub capacity: Arc<crate::capacity::Capacity>,
    /// Warm sandboxes ready for jobs.
    pub warm: Arc<crate::warm::pool::Pool>,
    /// Job ids this worker is running: a second delivery of one waits for the first attempt.
    pub in_flight: Arc<InFlight>,
}

/// The job ids this worker has an attempt of, so that one job runs at most once at a time here.
///
/// A second delivery of a job this worker is still running comes when the broker took the first
/// back without the connection failing: its channel was closed under the running job (RabbitMQ's
/// `consumer_timeout`), and the message went to another consumer slot of the same worker.
/// Without this the job would run twice at once, side by side (test: `tests/channel_close.rs`).
/// The second delivery waits, before it reads the job's state or takes capacity, until the
/// first attempt has ended and stored its result; it then finds that result and is acked as a
/// duplicate. Another worker taking the redelivery cannot be told apart from a worker that died,
/// so it runs the job (at-least-once; the compare-and-set keeps one result).
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    ids: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// An attempt's hold on its job id in [`InFlight`]; released on drop.
pub(crate) struct Held<'a> {
    in_flight: &'a InFlight,
    job_id: String,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl InFlight {
    /// Waits until no other attempt of `job_id` runs on this worker, then holds the id until the
    /// returned [`Held`] is dropped.
    pub(crate) async fn hold(&self, job_id: &str) -> Held<'_> {
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
    pub(crate) fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner).keys().cloned().collect();
        ids.sort();
        ids
    }

    /// Job ids held or waited for (for tests of the bookkeeping).
    #[cfg(test)]
    #[must_use]
    pub(crate) fn len(&self) -> usize {
        self.ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len()
    }

    /// Whether no job id is held.
    #[cfg(test)]
    #[must_use]
    pub(crate) fn is_empty(&self) -> bool {
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

#[cfg(test)]
mod tests {
    use super::InFlight;
    use std::time::Duration;

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
