//! Deferred checks: a job still `running` when its dead letter comes is checked again once any
//! attempt of it must have ended. The checks are kept in Redis (a sorted set by due time, one
//! member per job and attempt) and taken by whichever worker's [`sweeper`] comes first, so a
//! check outlives the worker that deferred it and no count of forged records can crowd a real
//! one out.

use std::time::Duration;

use sandq_core::results;
use sandq_core::time::now_ms;
use sandq_schemas::{JobResult, JobStatus};
use tokio::sync::watch;
use tracing::warn;

use super::MAX_RECORD_BYTES;
use crate::context::Context;

/// How often each worker's [`sweeper`] looks for due deferred checks.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(5);

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
pub(super) async fn defer(
    redis: &mut sandq_core::redis_conn::RedisConn,
    names: &sandq_schemas::names::Names,
    job_id: &str,
    attempt: u32,
    due_ms: u64,
) -> Result<bool, redis::RedisError> {
    let added: i64 = sandq_core::redis_conn::Script::new(DEFER_SCRIPT)
        .key(names.deferred_checks())
        .arg(due_ms)
        .arg(deferral_member(job_id, attempt))
        .invoke_async(redis)
        .await?;
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
pub(crate) async fn sweeper(ctx: Context, mut shutdown: watch::Receiver<bool>) {
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
        let due: Vec<Vec<u8>> = sandq_core::redis_conn::Script::new(CLAIM_SCRIPT)
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
                        if super::transient(e) {
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

    #[test]
    fn deferral_members_round_trip_and_nothing_else_parses() {
        assert_eq!(parse_deferral(deferral_member("job-1", 3).as_bytes()), Some(("job-1".to_owned(), 3)));
        for bad in [&b"3"[..], b":job", b"x:job", b"03:job", b"+3:job", b"3:", b"3:bad id", b"\xff:job", b"4294967296:job"] {
            assert_eq!(parse_deferral(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }
}
