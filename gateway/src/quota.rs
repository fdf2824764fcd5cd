//! Rate and count quotas of a key ([`sandq_core::keys::Quotas`]), kept in Redis so that every
//! gateway replica counts the same: jobs per calendar minute (`INCR` of
//! `<ns>:apikey:{<id>}:rate:<minute>`, expiring after two minutes) and jobs in flight (a
//! sorted set `<ns>:apikey:{<id>}:inflight` of job ids scored by submission time, pruned of
//! finished jobs at each submission). Both keys share the key's hash slot.

use std::time::Duration;

use redis::AsyncCommands as _;
use sandq_core::redis_conn::RedisConn;
use sandq_core::results;
use sandq_schemas::names::Names;

use crate::problem::Problem;

fn key_prefix(names: &Names, key_id: &str) -> String {
    format!("{}:apikey:{{{key_id}}}", names.namespace())
}

/// A job with no status this long after it was counted is not in flight (its submission
/// failed before `queued` was written, or its result expired).
const UNSEEN_GRACE_MS: u64 = 60_000;

/// Counts one more job of this key in the current minute.
///
/// # Errors
/// 429 when it is over `per_minute` (retry at the next minute); 503 when Redis fails.
pub(crate) async fn take_rate(redis: &mut RedisConn, names: &Names, key_id: &str, per_minute: u32, now_ms: u64) -> Result<(), Problem> {
    let minute = now_ms / 60_000;
    let key = format!("{}:rate:{minute}", key_prefix(names, key_id));
    let (count,): (u64,) = redis::pipe()
        .atomic()
        .incr(&key, 1)
        .expire(&key, 120)
        .ignore()
        .query_async(redis)
        .await
        .map_err(|e| Problem::unavailable(format!("redis: {e}")))?;
    if count > u64::from(per_minute) {
        let retry = 60 - (now_ms / 1000) % 60;
        return Err(Problem::too_many(format!("at most {per_minute} jobs a minute for this key"), retry));
    }
    Ok(())
}

/// Gives back a count [`take_rate`] took at `now_ms` (the submission was refused later).
pub(crate) async fn give_back_rate(redis: &mut RedisConn, names: &Names, key_id: &str, now_ms: u64) {
    let key = format!("{}:rate:{}", key_prefix(names, key_id), now_ms / 60_000);
    let _: redis::RedisResult<i64> = redis.decr(&key, 1).await;
}

/// Adds `job_id` to the key's jobs in flight; when that makes more than `max`, first drops
/// those that finished (a status read each: only then, so a submission under the quota costs
/// one round trip however many jobs are in flight) and counts again. `max_age` is
/// the longest a job can be in flight (queue wait and run), after which it is dropped unread
/// (`None`: the queue has no unserved limit, so age alone drops nothing).
///
/// # Errors
/// 429 when the key already has `max` jobs in flight (the job is not added); 503 when Redis
/// fails.
pub(crate) async fn take_in_flight(
    redis: &mut RedisConn,
    names: &Names,
    key_id: &str,
    job_id: &str,
    max: u32,
    max_age: Option<Duration>,
    now_ms: u64,
) -> Result<(), Problem> {
    let key = format!("{}:inflight", key_prefix(names, key_id));
    let unavailable = |e: redis::RedisError| Problem::unavailable(format!("redis: {e}"));
    // Added first, counted after, in one transaction: of concurrent submissions over the
    // quota, every one sees the others and none is let past it. (`NX`: a member already
    // there, from a concurrent request with the same id, is not counted twice, and is not this
    // request's to remove.)
    let add_and_count = |redis: &mut RedisConn| {
        let mut pipe = redis::pipe();
        pipe.atomic().cmd("ZADD").arg(&key).arg("NX").arg(now_ms as f64).arg(job_id).zcard(&key);
        let mut redis = redis.clone();
        async move { pipe.query_async::<(u64, u64)>(&mut redis).await }
    };
    let (added, count) = add_and_count(redis).await.map_err(unavailable)?;
    if count <= u64::from(max) {
        return Ok(());
    }
    // Over the quota as counted: drop the jobs that are over (one status read each, so only
    // here, not on every submission), then count again.
    if let Some(max_age) = max_age {
        let oldest = now_ms.saturating_sub(max_age.as_millis() as u64);
        let () = redis.zrembyscore(&key, 0, oldest as f64).await.map_err(unavailable)?;
    }
    let members: Vec<(String, f64)> = redis.zrange_withscores(&key, 0, -1).await.map_err(unavailable)?;
    for (member, score) in members {
        if member == job_id {
            continue;
        }
        let status = results::status(redis, names, &member).await.map_err(|e| Problem::unavailable(e.to_string()))?;
        let gone = match status {
            Some(s) => s.is_terminal(),
            None => now_ms.saturating_sub(score as u64) > UNSEEN_GRACE_MS,
        };
        if gone {
            let () = redis.zrem(&key, &member).await.map_err(unavailable)?;
        }
    }
    let count: u64 = redis.zcard(&key).await.map_err(unavailable)?;
    if count > u64::from(max) {
        if added == 1 {
            let () = redis.zrem(&key, job_id).await.map_err(unavailable)?;
        }
        return Err(Problem::too_many(format!("at most {max} jobs in flight for this key"), 1));
    }
    Ok(())
}

/// Takes `job_id` out of the key's jobs in flight (its submission failed).
pub(crate) async fn release(redis: &mut RedisConn, names: &Names, key_id: &str, job_id: &str) {
    let key = format!("{}:inflight", key_prefix(names, key_id));
    let _: redis::RedisResult<()> = redis.zrem(&key, job_id).await;
}
