//! Request bodies, bounded in bytes (`max_body_bytes`, a key's `max_upload_bytes`), in time
//! (each body has an overall deadline, [`deadline`], and `read_timeout` between chunks) and in
//! number (`max_uploads_per_key` bodies under way per key), so that no key can hold the
//! gateway's request slots with slow bodies; uploads go to a temporary file ([`spool`]), never
//! into memory, so no key can hold the gateway's memory with large ones (issue 36, findings 3
//! and 4).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap};
use futures::StreamExt as _;
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt as _;

use crate::auth::Caller;
use crate::problem::Problem;
use crate::settings::GatewaySettings;
use crate::state::Gateway;

/// A request body that was still arriving at its deadline; the body stream's error (which
/// readers turn into 408).
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub(crate) struct BodyTimedOut(pub(crate) Duration);

/// The overall time a request body may take: `body_timeout`, plus, for a body that declares
/// its length, that length at `min_body_bytes_per_s` (rounded up to whole seconds). A body
/// longer than its route takes is refused by its length before it is read, so a large
/// declared length earns no time on a route that would not take it.
pub(crate) fn deadline(settings: &GatewaySettings, declared: Option<u64>) -> Duration {
    let rate = settings.min_body_bytes_per_s.max(1);
    let extra = declared.map_or(0, |n| n.div_ceil(rate));
    settings.body_timeout.saturating_add(Duration::from_secs(extra))
}

/// The length a request declares (`Content-Length`), if it does.
pub(crate) fn declared(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse().ok())
}

/// `body`, failing with [`BodyTimedOut`] once `within` has passed since now: whoever reads the
/// body (a handler, rmcp, a multipart parser) sees it end with an error, and the request ends.
/// Applied to every request by the observation layer ([`crate::observe::request`]).
pub(crate) fn with_deadline(body: Body, within: Duration) -> Body {
    let until = tokio::time::Instant::now() + within;
    let stream = body.into_data_stream();
    Body::from_stream(futures::stream::unfold(Some(stream), move |stream| async move {
        let mut stream = stream?;
        match tokio::time::timeout_at(until, stream.next()).await {
            Err(_) => Some((Err(axum::Error::new(BodyTimedOut(within))), None)),
            Ok(None) => None,
            Ok(Some(item)) => Some((item, Some(stream))),
        }
    }))
}

/// The deadline of a body that failed for being late, if it did.
pub(crate) fn timed_out(error: &(dyn std::error::Error + 'static)) -> Option<Duration> {
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(late) = e.downcast_ref::<BodyTimedOut>() {
            return Some(late.0);
        }
        next = e.source();
    }
    None
}

/// The problem for a body stream's error: 408 when it was late, else 400 (cut off).
pub(crate) fn stream_problem(error: &axum::Error) -> Problem {
    match timed_out(error) {
        Some(within) => Problem::slow_body(within),
        None => Problem::invalid("the body was cut off"),
    }
}

/// 413 when the request declares a body over `max` bytes (refused before any of it is read).
pub(crate) fn check_declared(headers: &HeaderMap, max: u64) -> Result<(), Problem> {
    if declared(headers).is_some_and(|n| n > max) {
        return Err(Problem::too_large(usize::try_from(max).unwrap_or(usize::MAX)));
    }
    Ok(())
}

/// Reads a JSON request body (415 for another type): at most `max_body_bytes` (413), each
/// chunk within `read_timeout` and the whole within its deadline (408), as one of the key's
/// bodies under way (429 over `max_uploads_per_key`).
pub(crate) async fn read_json(gateway: &Gateway, caller: &Caller, headers: &HeaderMap, body: Body) -> Result<axum::body::Bytes, Problem> {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json")));
    if !json {
        return Err(Problem::media_type());
    }
    let max = gateway.settings.max_body_bytes;
    check_declared(headers, max as u64)?;
    let _permit = gateway.take_upload(&caller.key.id)?;
    let bytes = read_to_memory(gateway, body, max as u64).await?;
    Ok(axum::body::Bytes::from(bytes))
}

/// Reads a body into memory: at most `max` bytes (413), each chunk within `read_timeout` and
/// the whole within its deadline (408). For bodies bounded by `max_body_bytes` only (uploads
/// go through [`spool`]).
pub(crate) async fn read_to_memory(gateway: &Gateway, body: Body, max: u64) -> Result<Vec<u8>, Problem> {
    let mut bytes = Vec::new();
    let mut stream = body.into_data_stream();
    while let Some(chunk) = next_chunk(gateway, &mut stream).await? {
        if bytes.len() as u64 + chunk.len() as u64 > max {
            return Err(Problem::too_large(usize::try_from(max).unwrap_or(usize::MAX)));
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

/// The next chunk of a body: `None` at its end; 408 when none came within `read_timeout` or
/// the body's deadline passed, 400 when it was cut off.
async fn next_chunk(gateway: &Gateway, stream: &mut axum::body::BodyDataStream) -> Result<Option<axum::body::Bytes>, Problem> {
    let within = gateway.settings.read_timeout;
    match tokio::time::timeout(within, stream.next()).await {
        Err(_) => Err(Problem::slow_body(within)),
        Ok(None) => Ok(None),
        Ok(Some(Err(e))) => Err(stream_problem(&e)),
        Ok(Some(Ok(chunk))) => Ok(Some(chunk)),
    }
}

/// An upload received whole into a temporary file (removed when this is dropped): its
/// SHA-256 (64 lower-case hex digits) and size in bytes.
#[derive(Debug)]
pub(crate) struct Spooled {
    /// Its bytes' share of the gateway's spool budget, given back when the file goes.
    _budget: Budget,
    path: tempfile::TempPath,
    /// The SHA-256 of its bytes.
    pub(crate) sha256: String,
    /// Its size, bytes.
    pub(crate) size: u64,
}

impl Spooled {
    /// The bytes, from the start (each call opens the file anew, so a write may be retried).
    pub(crate) async fn open(&self) -> std::io::Result<tokio::fs::File> {
        tokio::fs::File::open(&self.path).await
    }

    /// The temporary file's path, for error messages.
    pub(crate) fn shown(&self) -> String {
        self.path.display().to_string()
    }
}

/// Bytes taken from the gateway's spool budget (`max_spooled_bytes`, all keys together),
/// given back when dropped.
#[derive(Debug)]
struct Budget {
    used: Arc<AtomicU64>,
    limit: u64,
    held: u64,
}

impl Budget {
    /// Takes `n` more bytes; false (nothing taken) when the budget would be passed.
    fn take(&mut self, n: u64) -> bool {
        let taken =
            self.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| used.checked_add(n).filter(|&total| total <= self.limit));
        if taken.is_ok() {
            self.held += n;
        }
        taken.is_ok()
    }
}

impl Drop for Budget {
    fn drop(&mut self) {
        self.used.fetch_sub(self.held, Ordering::AcqRel);
    }
}

/// A temporary file being filled, hashed as it goes.
pub(crate) struct Spool {
    budget: Budget,
    file: tokio::fs::File,
    path: tempfile::TempPath,
    hasher: Sha256,
    size: u64,
}

fn spool_failed(e: std::io::Error) -> Problem {
    tracing::warn!(error = %e, "cannot spool an upload");
    Problem::unavailable("cannot store the upload now")
}

impl Spool {
    /// A new empty temporary file (in the gateway's `TMPDIR`), its bytes counted against the
    /// gateway's `max_spooled_bytes`.
    ///
    /// # Errors
    /// 503 when it cannot be made.
    pub(crate) fn new(gateway: &Gateway) -> Result<Self, Problem> {
        let budget = Budget { used: gateway.spooled_bytes.clone(), limit: gateway.settings.max_spooled_bytes, held: 0 };
        let (file, path) = tempfile::NamedTempFile::new().map_err(spool_failed)?.into_parts();
        Ok(Spool { budget, file: tokio::fs::File::from_std(file), path, hasher: Sha256::new(), size: 0 })
    }

    /// Appends a chunk.
    ///
    /// # Errors
    /// 503 (`Retry-After`) when the gateway's uploads together would pass `max_spooled_bytes`;
    /// 503 when the disk fails.
    pub(crate) async fn write(&mut self, chunk: &[u8]) -> Result<(), Problem> {
        if !self.budget.take(chunk.len() as u64) {
            return Err(Problem::unavailable("the gateway holds as many uploads as it may now; retry").retry_after(5));
        }
        self.hasher.update(chunk);
        self.size += chunk.len() as u64;
        self.file.write_all(chunk).await.map_err(spool_failed)
    }

    /// Bytes written so far.
    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// The file, complete.
    ///
    /// # Errors
    /// 503 when the disk fails.
    pub(crate) async fn finish(mut self) -> Result<Spooled, Problem> {
        // Flushed to the OS (read back through the page cache by this process; no fsync: the
        // file does not outlive the request).
        self.file.flush().await.map_err(spool_failed)?;
        let sha256 = self.hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
        Ok(Spooled { _budget: self.budget, path: self.path, sha256, size: self.size })
    }
}

/// Receives an upload into a temporary file, never holding more than a chunk in memory: at
/// most `max` bytes (413, refused before reading when it declares more), each chunk within
/// `read_timeout` and the whole within its deadline (408). The caller holds the key's upload
/// permit ([`Gateway::take_upload`]) until the upload is stored.
pub(crate) async fn spool(gateway: &Gateway, headers: &HeaderMap, body: Body, max: u64) -> Result<Spooled, Problem> {
    check_declared(headers, max)?;
    let mut spool = Spool::new(gateway)?;
    let mut stream = body.into_data_stream();
    while let Some(chunk) = next_chunk(gateway, &mut stream).await? {
        if spool.size() + chunk.len() as u64 > max {
            return Err(Problem::too_large(usize::try_from(max).unwrap_or(usize::MAX)));
        }
        spool.write(&chunk).await?;
    }
    spool.finish().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spool_budget_refuses_what_would_pass_it_and_is_given_back_on_drop() {
        let used = Arc::new(AtomicU64::new(0));
        let budget = || Budget { used: used.clone(), limit: 100, held: 0 };
        let mut a = budget();
        assert!(a.take(60));
        let mut b = budget();
        assert!(!b.take(41), "60 + 41 passes 100");
        assert!(b.take(40));
        assert_eq!(used.load(Ordering::Acquire), 100);
        drop(a);
        assert_eq!(used.load(Ordering::Acquire), 40);
        drop(b);
        assert_eq!(used.load(Ordering::Acquire), 0);
    }

    #[test]
    fn a_declared_length_earns_time_at_the_minimum_rate() {
        let settings = GatewaySettings { body_timeout: Duration::from_secs(60), min_body_bytes_per_s: 1 << 20, ..Default::default() };
        assert_eq!(deadline(&settings, None), Duration::from_secs(60));
        assert_eq!(deadline(&settings, Some(0)), Duration::from_secs(60));
        assert_eq!(deadline(&settings, Some(1)), Duration::from_secs(61));
        assert_eq!(deadline(&settings, Some(100 << 20)), Duration::from_secs(160));
        assert_eq!(deadline(&settings, Some((100 << 20) + 1)), Duration::from_secs(161));
        // Any declared length gives a finite deadline.
        assert!(deadline(&settings, Some(u64::MAX)) > Duration::from_secs(60));
    }

    #[tokio::test]
    async fn a_body_still_arriving_at_its_deadline_fails_as_late() {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<axum::body::Bytes, std::io::Error>>(1);
        let slow = Body::from_stream(futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) }));
        tx.send(Ok(axum::body::Bytes::from_static(b"a"))).await.expect("send");
        let mut stream = with_deadline(slow, Duration::from_millis(200)).into_data_stream();
        assert_eq!(stream.next().await.expect("a chunk").expect("in time"), "a");
        let late = stream.next().await.expect("an error").expect_err("late");
        assert_eq!(timed_out(&late), Some(Duration::from_millis(200)));
        assert_eq!(stream_problem(&late).status, 408);
        assert!(stream.next().await.is_none(), "nothing after the error");
        drop(tx);
        let whole = with_deadline(Body::from("abc"), Duration::from_secs(5));
        assert_eq!(axum::body::to_bytes(whole, 10).await.expect("in time"), "abc");
    }
}
