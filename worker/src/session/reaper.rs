//! The reaper: every worker deletes expired sessions (their files, state and packages in S3,
//! their index entry: [`reap`]) and, taking turns through Redis ([`take_rebuild_turn`]),
//! rebuilds the sessions index from the manifests in S3 ([`rebuild_index`]). It uses the
//! session store's primitives (`sandq_core::sessions`: lock, load, delete), which the
//! gateway shares; what it decides on the way (a valid name, a session used again, the gap
//! between rebuilds) are the pure functions at the end.

use std::time::Duration;

use sandq_core::redis_conn::{RedisConn, Script};
use sandq_core::sessions::{self, Manifest, SessionError};
use sandq_core::storage::{self, TransferError};
use sandq_core::time::now_ms;
use sandq_schemas::names::Names;

use crate::context::Context;

/// Deletes expired sessions every `sessions.reap_interval` until `shutdown` turns true.
pub(crate) async fn reaper(ctx: Context, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    let settings = &ctx.settings;
    let reaper_id = format!("reaper-{}", settings.worker_id);
    // The index was found of another type and not rebuilt since: a rebuild is due a minute
    // after the last one, not an hour.
    let mut rebuild_pending = false;
    // When this worker last rebuilt: the turn key in Redis is a client's to delete, so each
    // worker also keeps its own pace (else a client deleting the key every 0.5 s would make
    // every worker rebuild every period).
    let mut last_rebuild: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            () = tokio::time::sleep(settings.sessions.reap_interval) => {}
            _ = shutdown.changed() => return,
        }
        let mut redis = ctx.redis.clone();
        let bucket = &settings.services.s3.bucket;
        let index_reset = match reap(&ctx.s3, bucket, &mut redis, &settings.names, now_ms(), &reaper_id).await {
            Ok(reaped) => {
                if !reaped.deleted.is_empty() {
                    tracing::info!(sessions = ?reaped.deleted, "deleted expired sessions");
                }
                if reaped.index_reset {
                    crate::metrics::session_index("reset");
                }
                reaped.index_reset
            }
            Err(e) => {
                tracing::warn!(error = %e, "session reaper failed; retrying next period");
                false
            }
        };
        // The index is a hint a client can write or that an update can miss: it is rebuilt from
        // the manifests in S3 every `sessions.rebuild_interval` (1 h) across the workers, and
        // within a minute of being found of another type (test:
        // a_sessions_index_a_client_overwrites_neither_reruns_jobs_nor_keeps_sessions_for_ever
        // in tests/untrusted_state.rs).
        rebuild_pending |= index_reset;
        let every = settings.sessions.rebuild_interval;
        let gap = rebuild_gap(rebuild_pending, every);
        if last_rebuild.is_some_and(|at| at.elapsed() < gap) {
            continue;
        }
        match take_rebuild_turn(&mut redis, &settings.names, now_ms(), gap).await {
            Ok(true) => {
                last_rebuild = Some(tokio::time::Instant::now());
                match rebuild_index(&ctx.s3, bucket, &mut redis, &settings.names, now_ms()).await {
                    Ok(seen) => {
                        rebuild_pending = false;
                        crate::metrics::session_index("rebuilt");
                        tracing::info!(sessions = seen, "sessions index rebuilt from S3");
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot rebuild the sessions index; trying again after the gap"),
                }
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "cannot take a turn at rebuilding the sessions index"),
        }
    }
}

/// How much later a due session the reaper cannot handle now is looked at again (its lock is
/// held, or deleting it failed): its index score moves to `now + REAP_RETRY` (never earlier
/// than it is), so that it leaves the head of the index, whose first 100 entries are all a
/// call reads: 100 such names must not pin that window for ever (test:
/// invalid_or_locked_index_members_do_not_stop_the_session_reaper).
pub(crate) const REAP_RETRY: Duration = Duration::from_secs(60);

/// What one [`reap`] call did.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Reaped {
    /// The sessions deleted.
    pub(crate) deleted: Vec<String>,
    /// The index was a key of another type (a client wrote it) and was removed: it holds no
    /// session now, so the caller should [`rebuild_index`] soon.
    pub(crate) index_reset: bool,
}

/// Deletes the sessions whose expiry has passed (at most 100 per call); returns their names.
/// Each is locked while it is deleted, and skipped when in use or when its manifest says it
/// was used again since the index was read. A member of the index that is not a valid session
/// name (`check_session_name`; bytes that are not UTF-8 included) is removed from the index
/// and never used as an S3 prefix. A session that is locked, or whose deletion fails, is
/// logged and moved [`REAP_RETRY`] later in the index (tried again then). A malformed manifest
/// counts as expired. An index that is a key of another type (a client wrote it) is deleted
/// first and reported in [`Reaped::index_reset`].
///
/// # Errors
/// [`SessionError::Redis`] when the index cannot be read or updated.
pub(crate) async fn reap(
    s3: &aws_sdk_s3::Client,
    bucket: &str,
    redis: &mut RedisConn,
    names: &Names,
    now_ms: u64,
    reaper_id: &str,
) -> Result<Reaped, SessionError> {
    let reset: i64 = Script::new(RESET_FOREIGN_INDEX_SCRIPT).key(names.sessions_index()).invoke_async(redis).await?;
    if reset == 1 {
        tracing::warn!(key = names.sessions_index(), "the sessions index was a key of another type; deleted it (to be rebuilt from S3)");
    }
    // Bytes: one member that is not UTF-8 must not fail the whole call, every period.
    let due: Vec<Vec<u8>> = Script::new(DUE_SESSIONS_SCRIPT).key(names.sessions_index()).arg(now_ms).invoke_async(redis).await?;
    let mut reaped = Vec::new();
    let retry_at = retry_at(now_ms);
    for member in due {
        let Some(name) = session_name(&member) else {
            // Not a session's (a client can write the index): dropped, never an S3 prefix.
            tracing::warn!(member = %String::from_utf8_lossy(&member), "removing an invalid name from the sessions index");
            let _: i64 = redis::cmd("ZREM").arg(names.sessions_index()).arg(&member).query_async(redis).await?;
            continue;
        };
        let name = name.to_owned();
        if let Err(e) = sessions::lock(redis, names, &name, reaper_id, Duration::from_secs(300), Duration::ZERO).await {
            tracing::info!(session = name, error = %e, "session due but locked; looking again later");
            reschedule(redis, names, &name, retry_at).await?;
            continue;
        }
        let outcome: Result<bool, SessionError> = async {
            let manifest = readable(sessions::load(s3, bucket, names, &name).await)?;
            match used_again(manifest.as_ref(), now_ms) {
                Some(expires_at_ms) => {
                    // Used again: the index is behind; fix it.
                    let _: () = redis::cmd("ZADD").arg(names.sessions_index()).arg(expires_at_ms).arg(&name).query_async(redis).await?;
                    Ok(false)
                }
                None => {
                    sessions::delete(s3, bucket, redis, names, &name).await?;
                    sessions::mark_expired(redis, names, &name).await?;
                    Ok(true)
                }
            }
        }
        .await;
        // A lock key a client turned into another type cannot be released (the lease frees
        // it): logged for that session, never an error of the whole call.
        if let Err(e) = sessions::unlock(redis, names, &name, reaper_id).await {
            tracing::warn!(session = name, error = %e, "cannot release the reaper's session lock; its lease will");
        }
        match outcome {
            Ok(true) => reaped.push(name),
            Ok(false) => {}
            // One session that cannot be deleted (an S3 error, a key of another type) must not
            // stop the others: it is logged, and moved later so that it does not hold the
            // head of the index.
            Err(e) => {
                tracing::warn!(session = name, error = %e, "cannot reap session; trying again later");
                reschedule(redis, names, &name, retry_at).await?;
            }
        }
    }
    Ok(Reaped { deleted: reaped, index_reset: reset == 1 })
}

/// Most sessions one [`rebuild_index`] call looks at.
pub(crate) const REBUILD_MAX_SESSIONS: usize = 100_000;

/// How soon after another rebuild one may start when the index was found of another type
/// ([`Reaped::index_reset`]), unless the worker's periodic rebuild (`sessions.rebuild_interval`,
/// default 1 h) is shorter: a client resetting the index over and over costs at most one
/// rebuild a minute across all workers.
pub(crate) const REBUILD_AFTER_RESET: Duration = Duration::from_secs(60);

/// How long a rebuild turn's start time is kept in Redis: longer than any sane rebuild period.
const REBUILD_TURN_KEPT: Duration = Duration::from_secs(24 * 3600);

/// Whether this caller takes the next rebuild of the sessions index: true when no worker
/// started one within `gap` (kept in [`sandq_schemas::names::Names::sessions_rebuilt_key`] as a start time in ms;
/// a value that is not a time, or one in the future, counts as none: a client may write it).
///
/// # Errors
/// [`SessionError::Redis`].
pub(crate) async fn take_rebuild_turn(redis: &mut RedisConn, names: &Names, now_ms: u64, gap: Duration) -> Result<bool, SessionError> {
    let taken: i64 = Script::new(REBUILD_TURN_SCRIPT)
        .key(names.sessions_rebuilt_key())
        .arg(now_ms)
        .arg(gap.as_millis() as u64)
        .arg(REBUILD_TURN_KEPT.as_millis() as u64)
        .invoke_async(redis)
        .await?;
    Ok(taken == 1)
}

/// Indexes every session that has a prefix in S3 (at most [`REBUILD_MAX_SESSIONS`]), by its
/// manifest's expiry; returns how many sessions it looked at. A member already indexed keeps
/// a later score (a job saving the session meanwhile). A prefix with no readable manifest (a
/// deletion that stopped half way, a session whose first save is under way) is indexed as due
/// now, so the reaper deletes it when nobody holds its lock. Names that are not valid session
/// names are skipped.
///
/// # Errors
/// [`SessionError::Storage`] when S3 cannot be listed or a manifest read fails for a reason
/// other than its content; [`SessionError::Redis`].
pub(crate) async fn rebuild_index(
    s3: &aws_sdk_s3::Client,
    bucket: &str,
    redis: &mut RedisConn,
    names: &Names,
    now_ms: u64,
) -> Result<usize, SessionError> {
    let dirs = storage::list_dirs(s3, bucket, &names.sessions_prefix(), REBUILD_MAX_SESSIONS).await?;
    let mut seen = 0;
    for name in dirs.iter().filter(|n| session_name(n.as_bytes()).is_some()) {
        let expires_at_ms = readable(sessions::load(s3, bucket, names, name).await)?.map_or(now_ms, |m| m.expires_at_ms);
        let _: i64 = Script::new(ADD_OR_LATER_SCRIPT).key(names.sessions_index()).arg(name).arg(expires_at_ms).invoke_async(redis).await?;
        seen += 1;
    }
    Ok(seen)
}

/// KEYS[1] = the sessions index: deletes it and returns 1 when it is a key of another type
/// than a sorted set (a client wrote it), else 0.
const RESET_FOREIGN_INDEX_SCRIPT: &str = r"
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'zset' and t ~= 'none' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
";

/// KEYS[1] = the rebuild turn key, ARGV = now (ms), gap (ms), expiry (ms): takes the turn
/// (stores now, returns 1) when the stored start is missing, not a number, of another type, in
/// the future, or at least `gap` ago; else 0.
const REBUILD_TURN_SCRIPT: &str = r"
local ok, v = pcall(redis.call, 'GET', KEYS[1])
local last = ok and tonumber(v) or nil
local now = tonumber(ARGV[1])
if last == nil or last > now or now - last >= tonumber(ARGV[2]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  return 1
end
return 0
";

/// KEYS[1] = the sessions index, ARGV = member, score: adds the member, or raises its score
/// to `score` when it is indexed with a lower one; returns 1 when it changed anything.
const ADD_OR_LATER_SCRIPT: &str = r"
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
  return 1
end
return 0
";

/// Moves `name`'s index score to `at` (ms) if it is still indexed and `at` is later than its
/// score (a job saving the session meanwhile set a later expiry, which stays; `ZADD XX GT` in
/// Redis 6.2 and later, a script here so that older servers serve it too).
async fn reschedule(redis: &mut RedisConn, names: &Names, name: &str, at: u64) -> Result<(), SessionError> {
    let _: i64 = Script::new(LATER_SCRIPT).key(names.sessions_index()).arg(name).arg(at).invoke_async(redis).await?;
    Ok(())
}

/// KEYS[1] = the sessions index, ARGV = member, score: sets the member's score when the member
/// is indexed with a lower one; returns 1 when moved.
const LATER_SCRIPT: &str = r"
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
  return 1
end
return 0
";

/// KEYS[1] = the sessions index, ARGV[1] = now (ms): the names of at most 100 sessions due,
/// in Redis; a member longer than any valid session name (256 bytes) is removed from the
/// index instead of returned (a client can write the index, with members of any size Redis
/// takes: those never leave Redis).
const DUE_SESSIONS_SCRIPT: &str = r"
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 100)
local out = {}
for _, name in ipairs(due) do
  if #name <= 256 then
    out[#out + 1] = name
  else
    redis.call('ZREM', KEYS[1], name)
  end
end
return out
";

/// `member` of the index as a session's name, when it is one (`check_session_name`; bytes that
/// are not UTF-8 are not): anything else a client wrote is never used as an S3 prefix.
fn session_name(member: &[u8]) -> Option<&str> {
    std::str::from_utf8(member).ok().filter(|n| sandq_schemas::validate::check_session_name(n).is_ok())
}

/// A session's manifest as the reaper reads it: a malformed or oversized one is none (nothing
/// to keep).
///
/// # Errors
/// Other failures to read it.
fn readable(loaded: Result<Option<Manifest>, SessionError>) -> Result<Option<Manifest>, SessionError> {
    match loaded {
        Err(SessionError::Manifest { .. } | SessionError::Storage(TransferError::Size { .. })) => Ok(None),
        other => other,
    }
}

/// When a due session was used again since the index was read (its manifest expires after
/// `now_ms`): its expiry, for the index; `None` when it is to be deleted.
fn used_again(manifest: Option<&Manifest>, now_ms: u64) -> Option<u64> {
    manifest.map(|m| m.expires_at_ms).filter(|&at| at > now_ms)
}

/// When a session the reaper could not handle at `now_ms` comes due again.
fn retry_at(now_ms: u64) -> u64 {
    now_ms.saturating_add(REAP_RETRY.as_millis() as u64)
}

/// The least time between two rebuilds of the index: `every` (`sessions.rebuild_interval`), or
/// [`REBUILD_AFTER_RESET`] if shorter while a rebuild is `pending` (the index was found of
/// another type).
fn rebuild_gap(pending: bool, every: Duration) -> Duration {
    if pending {
        REBUILD_AFTER_RESET.min(every)
    } else {
        every
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_valid_session_names_leave_the_index() {
        assert_eq!(session_name(b"my-session_1"), Some("my-session_1"));
        assert_eq!(session_name(b"\xff\xfe"), None, "not UTF-8");
        assert_eq!(session_name(b"../other"), None, "not a session name");
        assert_eq!(session_name(b""), None);
    }

    #[test]
    fn a_malformed_or_oversized_manifest_counts_as_none() {
        let malformed = SessionError::Manifest { name: "s".into(), message: "eof".into() };
        assert_eq!(readable(Err(malformed)).expect("malformed is none"), None);
        let oversized = SessionError::Storage(TransferError::Size { key: "k".into(), found: 17, expected: 16 });
        assert_eq!(readable(Err(oversized)).expect("oversized is none"), None);
        let missing = SessionError::Storage(TransferError::Missing { key: "k".into() });
        assert!(readable(Err(missing)).is_err(), "another storage error stops the session's reap");
        let manifest = Manifest { expires_at_ms: 7, ..Manifest::default() };
        assert_eq!(readable(Ok(Some(manifest.clone()))).expect("read"), Some(manifest));
    }

    #[test]
    fn a_session_used_again_is_kept_with_its_new_expiry() {
        let at = |expires_at_ms| Manifest { expires_at_ms, ..Manifest::default() };
        assert_eq!(used_again(Some(&at(5_001)), 5_000), Some(5_001));
        assert_eq!(used_again(Some(&at(5_000)), 5_000), None, "expiring now is expired");
        assert_eq!(used_again(Some(&at(10)), 5_000), None);
        assert_eq!(used_again(None, 5_000), None, "no manifest: deleted");
    }

    #[test]
    fn a_session_not_handled_now_comes_due_a_minute_later() {
        assert_eq!(retry_at(1_000), 61_000);
        assert_eq!(retry_at(u64::MAX - 1), u64::MAX);
    }

    #[test]
    fn a_reset_index_is_rebuilt_within_a_minute_unless_the_period_is_shorter() {
        let hour = Duration::from_secs(3600);
        assert_eq!(rebuild_gap(false, hour), hour);
        assert_eq!(rebuild_gap(true, hour), Duration::from_secs(60));
        assert_eq!(rebuild_gap(true, Duration::from_secs(5)), Duration::from_secs(5));
    }
}
