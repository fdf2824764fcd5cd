//! Job results in Redis: one hash per job (`<ns>:job:{<id>}`, fields `status` and `result`),
//! written with a compare-and-set so that a status only moves forward:
//! `queued` < `running` < any terminal status, and a terminal status is never replaced.
//! This is what keeps a late `queued` write (the submitter's, racing a fast worker) or a
//! duplicate delivery from overwriting a finished job.

use std::time::Duration;

use crate::redis_conn::RedisConn;
use sandq_schemas::names::Names;
use sandq_schemas::{JobResult, JobStatus};

/// Compare-and-set of a job's hash: `schemas/protocol/cas.lua`, the one script every party
/// writes statuses with (see [`sandq_schemas::protocol::CAS_SCRIPT`]).
pub use sandq_schemas::protocol::CAS_SCRIPT;

/// Failure to read or write a result.
#[derive(Debug, thiserror::Error)]
pub enum ResultError {
    /// Redis refused or could not be reached.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The stored record is larger than the reader takes.
    #[error("stored record of {job_id} is {bytes} bytes: larger than read")]
    TooLarge {
        /// The job.
        job_id: String,
        /// The record's length.
        bytes: u64,
        /// Its `status` field, when readable.
        status: Option<JobStatus>,
    },
    /// The stored result could not be decoded.
    #[error("stored result of {job_id} is malformed: {source}")]
    Decode {
        /// The job.
        job_id: String,
        /// The decoder's error.
        source: sandq_schemas::DecodeError,
    },
    /// The result could not be encoded.
    #[error("cannot encode result: {0}")]
    Encode(#[from] sandq_schemas::EncodeError),
    /// A terminal result was written, but fewer replicas than `[redis] wait_replicas` took it
    /// in time: it may not survive the primary's death.
    #[error("result of {job_id} written but not replicated: {source}")]
    NotReplicated {
        /// The job.
        job_id: String,
        /// What `WAIT` found.
        source: crate::redis_conn::NotReplicated,
    },
}

/// Connects to the Redis `config` describes: a single server (a connection manager, which
/// reconnects by itself), a Redis Cluster or a Sentinel-managed primary
/// ([`crate::redis_conn`]).
///
/// # Errors
/// [`ResultError::Redis`] when the configuration is invalid or Redis cannot be reached.
pub async fn connect(config: &crate::config::RedisConfig) -> Result<RedisConn, ResultError> {
    Ok(crate::redis_conn::connect(config).await?)
}

/// How long a job may wait in its queue when the queues set no limit (`queues.unserved_ttl`
/// of 0): a bound on how long its record is kept while it is not over.
pub const UNLIMITED_WAIT: Duration = Duration::from_secs(7 * 24 * 3600);

/// What a job's life may take beyond its queue wait and its `timeout`: staging its inputs
/// before, collecting and storing its result after (uploads of up to 512 MiB of artifacts, the
/// session save); the worker's dead-letter checks allow an attempt as long.
pub const LIVE_GRACE: Duration = Duration::from_secs(30 * 60);

/// The TTL of a record written while the job is not over (`queued`, `running`, its live
/// events): at least the rest of its life from the write, `unserved_ttl` (the longest it can
/// wait in a queue, again after a requeue; 0 is [`UNLIMITED_WAIT`]) + `timeout` +
/// [`LIVE_GRACE`], and never shorter than `result_ttl`. Only the terminal result takes
/// `result_ttl` alone: a short `result_ttl` must not make a queued or running job look gone
/// (its status unknown, its cancel refused, its events empty; test:
/// tenant::idempotency::a_running_job_with_a_short_result_ttl_stays_visible).
#[must_use]
pub fn live_ttl(unserved_ttl: Duration, timeout: Duration, result_ttl: Duration) -> Duration {
    let wait = if unserved_ttl.is_zero() { UNLIMITED_WAIT } else { unserved_ttl };
    (wait + timeout + LIVE_GRACE).max(result_ttl)
}

/// Writes `result` unless the stored status ranks higher (see the module doc). Returns true
/// when written. A terminal result also appends the `end` event to the job's event stream
/// ([`Names::events_key`]), in the same script. `ttl` is rounded up to whole seconds. A terminal result written is then waited
/// for on `[redis] wait_replicas` replicas, when set ([`RedisConn::wait_replicated`]).
///
/// # Errors
/// [`ResultError::Redis`], [`ResultError::Encode`], or [`ResultError::NotReplicated`] (the
/// result is stored on the primary).
pub async fn write(redis: &mut RedisConn, names: &Names, result: &JobResult, ttl: Duration) -> Result<bool, ResultError> {
    let bytes = sandq_schemas::encode(result)?;
    // Whole seconds rounded up, at least 1 (docs/protocol.md "Durations").
    let ttl_s = (ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0)).max(1);
    let script = crate::redis_conn::Script::new(CAS_SCRIPT)
        .key(names.job_key(&result.job_id))
        .key(names.done_key(&result.job_id))
        .arg(result.status.as_str())
        .arg(bytes)
        .arg(ttl_s);
    // Only a terminal write names the stream (clients, which write `queued`, may only read it:
    // docs/operations.md "Redis ACL for clients").
    let script = if result.status.is_terminal() { script.key(names.events_key(&result.job_id)).arg(result.attempt) } else { script };
    let written: i64 = script.invoke_async(redis).await?;
    if written == 1 && result.status.is_terminal() {
        match redis.wait_replicated(&names.job_key(&result.job_id)).await {
            Ok(()) => {}
            Err(crate::redis_conn::WaitError::Redis(e)) => return Err(e.into()),
            Err(crate::redis_conn::WaitError::NotReplicated(source)) => {
                return Err(ResultError::NotReplicated { job_id: result.job_id.clone(), source })
            }
        }
    }
    Ok(written == 1)
}

/// Reads a job's result; `None` when the job is unknown (never submitted, or its result
/// expired).
///
/// # Errors
/// [`ResultError::Redis`] or [`ResultError::Decode`].
pub async fn read(redis: &mut RedisConn, names: &Names, job_id: &str) -> Result<Option<JobResult>, ResultError> {
    let bytes: Option<Vec<u8>> = redis::cmd("HGET").arg(names.job_key(job_id)).arg("result").query_async(redis).await?;
    bytes.map(|b| sandq_schemas::decode(&b).map_err(|source| ResultError::Decode { job_id: job_id.to_owned(), source })).transpose()
}

/// Reads a job's record only if it is at most `max_bytes` long (the size is checked in Redis
/// before the bytes are sent: a client writes its own `queued` record, of any size Redis
/// takes, and the worker reads it; test:
/// a_huge_client_written_record_costs_the_worker_little_memory); `None` when unknown.
///
/// # Errors
/// [`ResultError::TooLarge`] (with the record's `status` field, when it has a readable one),
/// [`ResultError::Redis`] or [`ResultError::Decode`].
pub async fn read_bounded(redis: &mut RedisConn, names: &Names, job_id: &str, max_bytes: u64) -> Result<Option<JobResult>, ResultError> {
    let record = read_bounded_bytes(redis, names, job_id, max_bytes).await?;
    record.map(|b| sandq_schemas::decode(&b).map_err(|source| ResultError::Decode { job_id: job_id.to_owned(), source })).transpose()
}

/// [`read_bounded`], decoding only the fields a worker needs of a record it did not write
/// (`job_id`, `status`, `sku`, `attempt`, `queued_at_ms`, `started_at_ms`): every other field
/// is skipped without being allocated, so a record of `max_bytes` costs about `max_bytes`,
/// whatever it holds (decoded whole, a 1 MiB traceback of empty strings takes 24 MiB; test:
/// a_dead_letter_decodes_only_the_fields_it_uses_of_a_client_record). The other fields of the
/// returned result are their defaults.
///
/// # Errors
/// As [`read_bounded`].
pub async fn read_head(redis: &mut RedisConn, names: &Names, job_id: &str, max_bytes: u64) -> Result<Option<JobResult>, ResultError> {
    let Some(record) = read_bounded_bytes(redis, names, job_id, max_bytes).await? else { return Ok(None) };
    let head: RecordHead = sandq_schemas::decode(&record).map_err(|source| ResultError::Decode { job_id: job_id.to_owned(), source })?;
    let mut result = JobResult::new(head.job_id, head.status);
    result.sku = head.sku;
    result.attempt = head.attempt;
    result.queued_at_ms = head.queued_at_ms;
    result.started_at_ms = head.started_at_ms;
    Ok(Some(result))
}

/// The fields of a record [`read_head`] decodes (decoded as [`JobResult`] decodes them).
#[derive(serde::Deserialize)]
struct RecordHead {
    job_id: String,
    status: JobStatus,
    #[serde(default)]
    sku: Option<sandq_schemas::Sku>,
    #[serde(default, deserialize_with = "sandq_schemas::result::decode::attempt")]
    attempt: u32,
    #[serde(default, deserialize_with = "sandq_schemas::result::decode::queued_at_ms")]
    queued_at_ms: Option<u64>,
    #[serde(default, deserialize_with = "sandq_schemas::result::decode::started_at_ms")]
    started_at_ms: Option<u64>,
}

/// The record's bytes, when at most `max_bytes` (see [`read_bounded`]).
async fn read_bounded_bytes(redis: &mut RedisConn, names: &Names, job_id: &str, max_bytes: u64) -> Result<Option<Vec<u8>>, ResultError> {
    let (status, bytes, record): (Option<Vec<u8>>, u64, Option<Vec<u8>>) =
        crate::redis_conn::Script::new(BOUNDED_READ_SCRIPT).key(names.job_key(job_id)).arg(max_bytes).invoke_async(redis).await?;
    if bytes > max_bytes {
        let status = status.as_deref().and_then(parse_status);
        return Err(ResultError::TooLarge { job_id: job_id.to_owned(), bytes, status });
    }
    Ok(record)
}

/// Reads only a job's status, from its record's `status` field (at most 32 bytes read, as
/// bytes; the record itself is neither sent nor decoded, whatever its size); `None` when the
/// job is unknown or the field is missing or not a status (bytes that are not UTF-8 included:
/// they are "no known status", not an error, which a caller would retry as Redis being away;
/// test: a_status_that_is_not_utf8_does_not_loop_the_dead_letter_queue).
///
/// # Errors
/// [`ResultError::Redis`].
pub async fn status(redis: &mut RedisConn, names: &Names, job_id: &str) -> Result<Option<JobStatus>, ResultError> {
    let (status, _, _): (Option<Vec<u8>>, u64, Option<Vec<u8>>) =
        crate::redis_conn::Script::new(BOUNDED_READ_SCRIPT).key(names.job_key(job_id)).arg(0).invoke_async(redis).await?;
    Ok(status.as_deref().and_then(parse_status))
}

/// The status a wire name names (`None` for any other bytes).
fn parse_status(name: &[u8]) -> Option<JobStatus> {
    use JobStatus::*;
    [Queued, Running, Succeeded, Failed, TimedOut, OomKilled, Rejected, Cancelled, Expired, InternalError]
        .into_iter()
        .find(|s| s.as_str().as_bytes() == name)
}

/// KEYS[1] = job key, ARGV[1] = the most record bytes to send. Returns {status field (false
/// when missing or over 32 bytes), the record's length, the record (false when missing or over
/// ARGV[1])}. HSTRLEN is O(1): nothing large is copied.
const BOUNDED_READ_SCRIPT: &str = r"
local status = false
if redis.call('HSTRLEN', KEYS[1], 'status') <= 32 then
  status = redis.call('HGET', KEYS[1], 'status')
end
local n = redis.call('HSTRLEN', KEYS[1], 'result')
local record = false
if n <= tonumber(ARGV[1]) then
  record = redis.call('HGET', KEYS[1], 'result')
end
return {status, n, record}
";

/// What a job's record holds, compared with a result whose write was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// Exactly the bytes of that result (an earlier send of the same write reached Redis).
    Same,
    /// Other bytes, under a terminal status (one of the eight names): another attempt's result
    /// (or a client's, written over the worker's `running`).
    Other,
    /// No record, or no status of the eight terminal names: it cannot be told.
    Unknown,
}

/// Compares the stored record of `result`'s job with `result`'s encoding, inside Redis: the
/// stored record is never sent nor decoded, and it is read (copied inside Redis) only when its
/// length is that of `result`'s bytes (a client may have written that record, and decoding it
/// would cost the worker up to 24 times its size; test:
/// a_client_written_terminal_record_is_not_read_back_by_a_refused_write).
///
/// # Errors
/// [`ResultError::Encode`] or [`ResultError::Redis`].
pub async fn compare_stored(redis: &mut RedisConn, names: &Names, result: &JobResult) -> Result<Stored, ResultError> {
    let bytes = sandq_schemas::encode(result)?;
    let found: i64 =
        crate::redis_conn::Script::new(COMPARE_SCRIPT).key(names.job_key(&result.job_id)).arg(bytes).invoke_async(redis).await?;
    Ok(match found {
        1 => Stored::Same,
        0 => Stored::Other,
        _ => Stored::Unknown,
    })
}

/// KEYS[1] = job key, ARGV[1] = a result's bytes. Returns 1 when the stored `result` field is
/// those bytes, 0 when it is other bytes under a terminal status, -1 otherwise (no record, or
/// a status that is not terminal). The field is fetched only when its length matches.
const COMPARE_SCRIPT: &str = r"
local status = false
if redis.call('HSTRLEN', KEYS[1], 'status') <= 32 then
  status = redis.call('HGET', KEYS[1], 'status')
end
local terminal = false
for _, name in ipairs({'succeeded', 'failed', 'timed_out', 'oom_killed', 'rejected', 'cancelled', 'expired', 'internal_error'}) do
  if status == name then terminal = true end
end
if redis.call('HSTRLEN', KEYS[1], 'result') == string.len(ARGV[1]) and redis.call('HGET', KEYS[1], 'result') == ARGV[1] then
  return 1
end
if terminal then return 0 end
return -1
";

/// Asks for a job to be cancelled: sets its cancel key (`<ns>:job:{<id>}:cancel`) for `ttl`. A
/// worker skips a queued job whose key is set (status `cancelled`), and kills a running one
/// within a second. Returns false when the job is unknown or already finished (nothing set).
///
/// # Errors
/// [`ResultError::Redis`].
pub async fn request_cancel(redis: &mut RedisConn, names: &Names, job_id: &str, ttl: Duration) -> Result<bool, ResultError> {
    match status(redis, names, job_id).await? {
        Some(s) if !s.is_terminal() => {
            let () = redis::cmd("SET").arg(names.cancel_key(job_id)).arg(1).arg("EX").arg(ttl.as_secs().max(1)).query_async(redis).await?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// True when a client asked for the job to be cancelled.
///
/// # Errors
/// [`ResultError::Redis`].
pub async fn cancel_requested(redis: &mut RedisConn, names: &Names, job_id: &str) -> Result<bool, ResultError> {
    let exists: bool = redis::cmd("EXISTS").arg(names.cancel_key(job_id)).query_async(redis).await?;
    Ok(exists)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_record_outlasts_the_wait_the_run_and_the_grace() {
        let (s, m) = (Duration::from_secs(1), Duration::from_secs(60));
        // unserved 1 h, timeout 60 s, result_ttl 1 s: 3600 + 60 + 1800 s.
        assert_eq!(live_ttl(3600 * s, m, s), Duration::from_secs(5460));
        // No queue limit: a week stands for the wait.
        assert_eq!(live_ttl(Duration::ZERO, m, s), Duration::from_secs(7 * 24 * 3600 + 1860));
        // A result kept longer than that: the result's TTL.
        assert_eq!(live_ttl(3600 * s, m, 48 * 3600 * s), Duration::from_secs(48 * 3600));
    }
}
