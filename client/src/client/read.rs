//! Reading a job back through Redis: its result now ([`Client::status`]), waited for
//! ([`Client::wait`], on the job's `:done` list), its live events (a page, or a stream that
//! follows them), and a cancel request.

use std::time::{Duration, Instant};

use futures::Stream;
use sandq_core::results;
use sandq_schemas::events::Event;
use sandq_schemas::{JobResult, JobStatus};

use super::{Client, ClientError};

impl Client {
    /// The job's current result; `None` when the job is unknown.
    ///
    /// # Errors
    /// [`ClientError::Result`].
    pub async fn status(&mut self, job_id: &str) -> Result<Option<JobResult>, ClientError> {
        Ok(results::read(&mut self.redis, &self.names, job_id).await?)
    }

    /// Waits until the job's status is terminal or `timeout` passes, calling `on_change` each
    /// time the status changes. Blocks on the job's `:done` list (`BLPOP`, so no busy polling),
    /// re-reading the result at least every `interval` (to see `running`, and in case another
    /// waiter popped the notification).
    ///
    /// # Errors
    /// [`ClientError::WaitTimeout`] or [`ClientError::Result`].
    pub async fn wait(
        &mut self,
        job_id: &str,
        timeout: Duration,
        interval: Duration,
        mut on_change: impl FnMut(Option<JobStatus>),
    ) -> Result<JobResult, ClientError> {
        let started = Instant::now();
        let mut last: Option<Option<JobStatus>> = None;
        loop {
            let current = match self.status(job_id).await {
                Ok(current) => current,
                // Redis restarting: the connection manager reconnects; keep waiting.
                Err(e) if started.elapsed() < timeout => {
                    tracing::warn!(error = %e, "cannot read the result yet; retrying");
                    tokio::time::sleep(interval).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            let status = current.as_ref().map(|r| r.status);
            if last != Some(status) {
                on_change(status);
                last = Some(status);
            }
            if let Some(result) = current {
                if result.status.is_terminal() {
                    return Ok(result);
                }
            }
            let elapsed = started.elapsed();
            if elapsed >= timeout {
                return Err(ClientError::WaitTimeout { job_id: job_id.to_owned(), waited: elapsed });
            }
            let block = interval.min(timeout - elapsed).max(Duration::from_millis(10));
            self.block_on_done(job_id, block).await?;
        }
    }

    async fn block_on_done(&mut self, job_id: &str, block: Duration) -> Result<(), ClientError> {
        if self.blocking.is_none() {
            match self.redis_target.connect_blocking().await {
                Ok(connection) => self.blocking = Some(connection),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot connect to redis for BLPOP; retrying");
                    tokio::time::sleep(block).await;
                    return Ok(());
                }
            }
        }
        let Some(connection) = self.blocking.as_mut() else { return Ok(()) };
        let popped: redis::RedisResult<Option<(String, String)>> =
            redis::cmd("BLPOP").arg(self.names.done_key(job_id)).arg(block.as_secs_f64()).query_async(connection).await;
        if let Err(e) = popped {
            // Drop the connection; the next wait makes a new one.
            tracing::warn!(error = %e, "BLPOP failed; reconnecting");
            self.blocking = None;
            tokio::time::sleep(block).await;
        }
        Ok(())
    }

    /// One page of the job's live events after `cursor` ([`sandq_core::events::START`] for the
    /// whole stream): at most 500, waiting up to `block` for the first (an empty page: none
    /// came). Uses the blocking connection; a Redis error drops it (the next call makes a new
    /// one) and is returned.
    ///
    /// # Errors
    /// [`ClientError::Result`] when Redis fails.
    pub async fn events_page(&mut self, job_id: &str, cursor: &str, block: Duration) -> Result<Vec<Event>, ClientError> {
        if self.blocking.is_none() {
            self.blocking = Some(self.redis_target.connect_blocking().await.map_err(results::ResultError::from)?);
        }
        let Some(connection) = self.blocking.as_mut() else { return Ok(Vec::new()) };
        let key = self.names.events_key(job_id);
        let block = (!block.is_zero()).then_some(block);
        match sandq_core::events::read(connection, &key, cursor, 500, block).await {
            Ok(events) => Ok(events),
            Err(e) => {
                self.blocking = None;
                Err(results::ResultError::from(e).into())
            }
        }
    }

    /// The job's live events from `cursor` on ([`sandq_core::events::START`]: from the first),
    /// as they come (docs/protocol.md "Live events"): the stream ends after the `end` event,
    /// or when the job's result is terminal and nothing more is to be read (a stream without
    /// `end`: expired, or written by an older worker). Redis errors (a restart) are retried
    /// every `retry` from the last event read, with no gap and no duplicate; the caller bounds
    /// the whole with its own time-out. To resume after dropping it, pass the last event's
    /// `id`.
    pub fn events<'a>(&'a mut self, job_id: &'a str, cursor: &str, retry: Duration) -> impl Stream<Item = Event> + 'a {
        sandq_core::events::follow(JobEvents { client: self, job_id }, cursor, retry, None)
    }

    /// Asks for the job to be cancelled (see [`results::request_cancel`]). Returns false when
    /// the job is unknown or already finished.
    ///
    /// # Errors
    /// [`ClientError::Result`].
    pub async fn cancel(&mut self, job_id: &str) -> Result<bool, ClientError> {
        Ok(results::request_cancel(&mut self.redis, &self.names, job_id, Duration::from_secs(7 * 24 * 3600)).await?)
    }
}

/// A job's live events as [`sandq_core::events::follow`] reads them for [`Client::events`]:
/// pages on the client's blocking connection, over once the result is terminal.
struct JobEvents<'a> {
    client: &'a mut Client,
    job_id: &'a str,
}

impl sandq_core::events::Pages for JobEvents<'_> {
    async fn page(&mut self, cursor: &str, block: Option<Duration>) -> Option<Vec<Event>> {
        match self.client.events_page(self.job_id, cursor, block.unwrap_or(Duration::ZERO)).await {
            Ok(page) => Some(page),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read live events; retrying");
                None
            }
        }
    }

    /// A terminal result (a stream without `end`: expired, or written by an older worker).
    async fn over(&mut self) -> bool {
        self.client.status(self.job_id).await.ok().flatten().is_some_and(|r| r.status.is_terminal())
    }
}
