//! Sessions: files that persist in S3 from one job to the next of the same session.
//!
//! ```text
//! S3     sessions/<ns>/<name>/manifest.json       Manifest (JSON): path -> sha256, size; expiry
//!        sessions/<ns>/<name>/blobs/<sha256>      file contents, content-addressed
//! Redis  <ns>:sessions                            sorted set: name -> expires_at_ms
//!        <ns>:sessions:rebuilt                    when a worker last rebuilt it from S3 (ms)
//!        <ns>:session:{<name>}:lock               id of the job using the session (SET NX PX)
//! ```
//!
//! One job of a session runs at a time: a worker takes the lock before it restores the files
//! and releases it after it saved them; a second job of the same session waits for the lock
//! (serialized, in the order workers take it; not necessarily the order of submission). The
//! manifest, written last, is the session's state; a blob is deleted once no path of the
//! manifest refers to it. A session expires `idle_timeout` (default 30 min) after its last job
//! ended: workers reap it (delete every object under its prefix) and the next job naming it
//! starts fresh and is told so (`SessionInfo::fresh`, `expired`).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::redis_conn::RedisConn;
use sandq_schemas::names::Names;
use serde::{Deserialize, Serialize};

use crate::storage::{self, TransferError};

/// Largest manifest read, bytes (a manifest lists at most the worker's `max_artifacts` files
/// of a few hundred bytes each).
pub const MAX_MANIFEST_BYTES: u64 = 16 << 20;

/// A session's state: its files and when it expires.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Path relative to `/work` -> content.
    pub files: BTreeMap<String, FileEntry>,
    /// When the session was first used, Unix epoch milliseconds.
    pub created_at_ms: u64,
    /// When its last job ended, Unix epoch milliseconds.
    pub updated_at_ms: u64,
    /// When it expires unless used again, Unix epoch milliseconds.
    pub expires_at_ms: u64,
    /// Id of the last job that saved it.
    #[serde(default)]
    pub last_job_id: String,
    /// The notebook state the last notebook job left (a pickle written inside a sandbox of
    /// this session; only ever loaded inside one), stored as a blob like the files.
    #[serde(default)]
    pub state: Option<FileEntry>,
    /// Notebook cells run in the session so far (the last one's `execution_count`).
    #[serde(default)]
    pub execution_count: u64,
    /// The packages jobs of the session installed at run time (`/sandq/packages`, see the
    /// worker's `packages` module), as one tar archive stored as a blob like the files.
    #[serde(default)]
    pub packages: Option<FileEntry>,
    /// The notebook states of named contexts (`JobSpec::context`: E2B's contexts), each with
    /// its own cells' count, beside the session's default one (`state`, `execution_count`).
    /// At most [`MAX_CONTEXTS`]: the least recently used is dropped for a new one.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub contexts: BTreeMap<String, ContextState>,
}

/// Named contexts a session keeps at most (each may hold a state of `max_state_bytes`).
pub const MAX_CONTEXTS: usize = 16;

/// One named context's notebook state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextState {
    /// Its state (as [`Manifest::state`]).
    #[serde(default)]
    pub state: Option<FileEntry>,
    /// Its cells so far.
    #[serde(default)]
    pub execution_count: u64,
    /// When a cell of it last ran, Unix epoch milliseconds.
    #[serde(default)]
    pub used_at_ms: u64,
}

impl Manifest {
    /// The notebook state and cell count of `context` (`None`: the session's default).
    pub fn context(&self, context: Option<&str>) -> (Option<&FileEntry>, u64) {
        match context {
            None => (self.state.as_ref(), self.execution_count),
            Some(name) => self.contexts.get(name).map_or((None, 0), |c| (c.state.as_ref(), c.execution_count)),
        }
    }

    /// Every notebook state it refers to (the default one and each context's).
    pub fn states(&self) -> impl Iterator<Item = &FileEntry> {
        self.state.iter().chain(self.contexts.values().filter_map(|c| c.state.as_ref()))
    }

    /// Total bytes of the files.
    pub fn bytes(&self) -> u64 {
        self.files.values().map(|f| f.size).sum()
    }
}

/// One file of a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// SHA-256 of the content, 64 lower-case hex digits (the blob's key).
    pub sha256: String,
    /// Size, bytes.
    pub size: u64,
}

/// Failure of a session operation.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// S3 failed.
    #[error("session storage: {0}")]
    Storage(#[from] TransferError),
    /// Redis failed.
    #[error("session index: {0}")]
    Redis(#[from] redis::RedisError),
    /// The stored manifest is not valid JSON of the expected shape.
    #[error("manifest of session {name} is malformed: {message}")]
    Manifest {
        /// The session.
        name: String,
        /// The parser's message.
        message: String,
    },
    /// Another job holds the session's lock. The holder is not named: a job id is a
    /// capability (docs/threat-model.md, "Known gaps"), and a session name must not yield one.
    #[error("session {name} is in use by another job")]
    Busy {
        /// The session.
        name: String,
    },
}

/// Reads a session's manifest; `None` when the session does not exist.
///
/// # Errors
/// [`SessionError::Storage`] or [`SessionError::Manifest`].
pub async fn load(s3: &aws_sdk_s3::Client, bucket: &str, names: &Names, name: &str) -> Result<Option<Manifest>, SessionError> {
    match storage::get_bytes(s3, bucket, &names.session_manifest_key(name), MAX_MANIFEST_BYTES).await {
        Ok(bytes) => {
            serde_json::from_slice(&bytes).map(Some).map_err(|e| SessionError::Manifest { name: name.to_owned(), message: e.to_string() })
        }
        Err(TransferError::Missing { .. }) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// What [`store`] did with the sessions index after the manifest was stored.
#[derive(Debug)]
pub enum IndexUpdate {
    /// The session's expiry is in the index.
    Done,
    /// The index could not be updated (for example a client made `<ns>:sessions` a key of
    /// another type: `WRONGTYPE`). The session is stored all the same: the manifest is its
    /// state, and the reaper's rebuild ([`rebuild_index`]) indexes it again from S3.
    Failed(redis::RedisError),
}

/// Writes a session's manifest, then its expiry in the index.
///
/// The manifest is the session's state; the index only tells the reaper when to look. So a
/// failed index update is returned as [`IndexUpdate::Failed`], never as an error: the job that
/// saved the session has succeeded, and retrying it would run its program again on files it
/// already changed (a client can write the index: a `SET <ns>:sessions x` must not make every
/// session job run again and end `internal_error`; test:
/// a_sessions_index_a_client_overwrites_neither_reruns_jobs_nor_keeps_sessions_for_ever).
///
/// # Errors
/// [`SessionError::Storage`] or [`SessionError::Manifest`] (the manifest was not stored).
pub async fn store(
    s3: &aws_sdk_s3::Client,
    bucket: &str,
    redis: &mut RedisConn,
    names: &Names,
    name: &str,
    manifest: &Manifest,
) -> Result<IndexUpdate, SessionError> {
    let bytes = serde_json::to_vec(manifest).map_err(|e| SessionError::Manifest { name: name.to_owned(), message: e.to_string() })?;
    storage::put_bytes(s3, bucket, &names.session_manifest_key(name), bytes, "application/json").await?;
    let indexed: Result<(), redis::RedisError> =
        redis::cmd("ZADD").arg(names.sessions_index()).arg(manifest.expires_at_ms).arg(name).query_async(redis).await;
    Ok(match indexed {
        Ok(()) => IndexUpdate::Done,
        Err(e) => IndexUpdate::Failed(e),
    })
}

/// Deletes every object of a session, then its index entry; returns the objects deleted.
/// Removing the index entry is advisory (logged when it fails): a member whose session is gone
/// is dropped by the reaper when its score comes due, and a deployment may deny clients write
/// access to the index (docs/operations.md "Redis ACL").
///
/// # Errors
/// [`SessionError::Storage`].
pub async fn delete(
    s3: &aws_sdk_s3::Client,
    bucket: &str,
    redis: &mut RedisConn,
    names: &Names,
    name: &str,
) -> Result<usize, SessionError> {
    // The manifest first: a session without a manifest is gone even if blob deletion stops
    // half way (the rest is deleted by the next delete or reap of the same name).
    storage::delete_keys(s3, bucket, &[names.session_manifest_key(name)]).await?;
    let deleted = storage::delete_prefix(s3, bucket, &names.session_prefix(name)).await?;
    let removed: Result<i64, redis::RedisError> = redis::cmd("ZREM").arg(names.sessions_index()).arg(name).query_async(redis).await;
    if let Err(e) = removed {
        tracing::warn!(session = name, error = %e, "session deleted; its index entry stays until the reaper drops it");
    }
    Ok(deleted)
}

/// How long the "this session expired" tombstone stays: 7 days.
pub const TOMBSTONE_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

/// Records that `name` expired (see [`Names::session_tombstone_key`]).
///
/// # Errors
/// [`SessionError::Redis`].
pub async fn mark_expired(redis: &mut RedisConn, names: &Names, name: &str) -> Result<(), SessionError> {
    let _: () =
        redis::cmd("SET").arg(names.session_tombstone_key(name)).arg(1).arg("EX").arg(TOMBSTONE_TTL.as_secs()).query_async(redis).await?;
    Ok(())
}

/// Whether `name` expired and was deleted (within the last [`TOMBSTONE_TTL`]); clears the
/// mark, since the caller is about to start the session afresh.
///
/// # Errors
/// [`SessionError::Redis`].
pub async fn take_expired_mark(redis: &mut RedisConn, names: &Names, name: &str) -> Result<bool, SessionError> {
    let removed: i64 = redis::cmd("DEL").arg(names.session_tombstone_key(name)).query_async(redis).await?;
    Ok(removed > 0)
}

/// Releases the lock only if `job_id` still holds it. KEYS[1] = lock key, ARGV[1] = job id.
const RELEASE_SCRIPT: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// Takes the session's lock for `holder` with a lease of `lease`, waiting up to `wait` for
/// another holder to release it (polling every 200 ms).
///
/// # Errors
/// [`SessionError::Busy`] after `wait`; [`SessionError::Redis`].
pub async fn lock(
    redis: &mut RedisConn,
    names: &Names,
    name: &str,
    holder: &str,
    lease: Duration,
    wait: Duration,
) -> Result<(), SessionError> {
    let key = names.session_lock_key(name);
    let until = tokio::time::Instant::now() + wait;
    loop {
        let taken: Option<String> =
            redis::cmd("SET").arg(&key).arg(holder).arg("NX").arg("PX").arg(lease.as_millis() as u64).query_async(redis).await?;
        if taken.is_some() {
            return Ok(());
        }
        // Already this holder's (its own earlier call): the lease is renewed. Compared in Redis,
        // so that a lock value of any size a client wrote is never sent here.
        let ours: i64 = crate::redis_conn::Script::new(RENEW_IF_HELD_SCRIPT)
            .key(&key)
            .arg(holder)
            .arg(lease.as_millis() as u64)
            .invoke_async(redis)
            .await?;
        if ours == 1 {
            return Ok(());
        }
        if tokio::time::Instant::now() >= until {
            return Err(SessionError::Busy { name: name.to_owned() });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Extends the lease of the session's lock to `lease` if `holder` still holds it; returns
/// whether it did. `KEYS[1]` = lock key, `ARGV` = holder, lease in ms.
///
/// # Errors
/// [`SessionError::Redis`].
pub async fn renew(redis: &mut RedisConn, names: &Names, name: &str, holder: &str, lease: Duration) -> Result<bool, SessionError> {
    const RENEW_SCRIPT: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";
    let renewed: i64 = crate::redis_conn::Script::new(RENEW_SCRIPT)
        .key(names.session_lock_key(name))
        .arg(holder)
        .arg(lease.as_millis() as u64)
        .invoke_async(redis)
        .await?;
    Ok(renewed == 1)
}

/// Releases the session's lock if `holder` still holds it.
///
/// # Errors
/// [`SessionError::Redis`].
pub async fn unlock(redis: &mut RedisConn, names: &Names, name: &str, holder: &str) -> Result<(), SessionError> {
    let _: i64 = crate::redis_conn::Script::new(RELEASE_SCRIPT).key(names.session_lock_key(name)).arg(holder).invoke_async(redis).await?;
    Ok(())
}

/// How long [`remove`] holds a session's lock at most: longer than deleting a session takes.
pub const REMOVE_LEASE: Duration = Duration::from_secs(60);

/// What [`remove`] did once it held the session's lock: the delete's outcome (the S3 objects
/// deleted) and the release's. A caller decides whether a failed release matters: the lock's
/// lease ([`REMOVE_LEASE`]) ends it anyway.
#[derive(Debug)]
pub struct Removed {
    /// [`delete`]'s result.
    pub deleted: Result<usize, SessionError>,
    /// [`unlock`]'s result.
    pub unlocked: Result<(), SessionError>,
}

/// Deletes session `name` under its lock: takes the lock for `holder` (lease
/// [`REMOVE_LEASE`], waiting up to `wait` for a job of the session to end), [`delete`]s,
/// releases the lock (also when the delete failed).
///
/// # Errors
/// [`lock`]'s ([`SessionError::Busy`] after `wait`): nothing was deleted. The delete's and the
/// release's own are in [`Removed`].
pub async fn remove(
    s3: &aws_sdk_s3::Client,
    bucket: &str,
    redis: &mut RedisConn,
    names: &Names,
    name: &str,
    holder: &str,
    wait: Duration,
) -> Result<Removed, SessionError> {
    lock(redis, names, name, holder, REMOVE_LEASE, wait).await?;
    let deleted = delete(s3, bucket, redis, names, name).await;
    let unlocked = unlock(redis, names, name, holder).await;
    Ok(Removed { deleted, unlocked })
}

/// A session as listed by [`list`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Listed {
    /// Its name.
    pub name: String,
    /// When it expires, Unix epoch milliseconds.
    pub expires_at_ms: u64,
    /// Its files and their total size (`None` when the manifest is missing).
    pub files: Option<u64>,
    /// Total bytes.
    pub bytes: Option<u64>,
    /// The job using it now, if any.
    pub in_use_by: Option<String>,
}

/// Lists the sessions of the index (soonest expiry first), at most `max`.
///
/// # Errors
/// [`SessionError`].
pub async fn list(
    s3: &aws_sdk_s3::Client,
    bucket: &str,
    redis: &mut RedisConn,
    names: &Names,
    max: usize,
) -> Result<Vec<Listed>, SessionError> {
    let members: Vec<(Vec<u8>, f64)> = redis::cmd("ZRANGE")
        .arg(names.sessions_index())
        .arg(0)
        .arg(max.saturating_sub(1) as i64)
        .arg("WITHSCORES")
        .query_async(redis)
        .await?;
    let mut listed = Vec::new();
    for (member, score) in members {
        // Bytes, and only valid names: a client can write the index, and one member that is
        // not UTF-8 must not fail the listing.
        let Some(name) = std::str::from_utf8(&member).ok().filter(|n| sandq_schemas::validate::check_session_name(n).is_ok()) else {
            continue;
        };
        let name = name.to_owned();
        // A session whose manifest cannot be read is listed without its files.
        let manifest = match load(s3, bucket, names, &name).await {
            Ok(m) => m,
            Err(e @ SessionError::Storage(TransferError::Request { .. })) => return Err(e),
            Err(e) => {
                tracing::warn!(session = name, error = %e, "unreadable session manifest");
                None
            }
        };
        // The lock's value is a client's to write (its own session's): read in Redis, only
        // when it is a holder id a worker writes, else `?`, so that a list, bytes that are not
        // UTF-8 or terminal escapes under one session's lock neither fail nor spoof the whole
        // listing (test: session_locks_a_client_wrote_neither_fail_nor_spoof_the_listing).
        let in_use_by: Option<String> =
            match crate::redis_conn::Script::new(LOCK_HOLDER_SCRIPT).key(names.session_lock_key(&name)).invoke_async(redis).await {
                Ok(holder) => holder,
                Err(e) if e.kind() == redis::ErrorKind::Io || e.is_connection_dropped() || e.is_timeout() => return Err(e.into()),
                Err(e) => {
                    tracing::warn!(session = name, error = %e, "unreadable session lock");
                    Some("?".to_owned())
                }
            };
        listed.push(Listed {
            expires_at_ms: score as u64,
            files: manifest.as_ref().map(|m| m.files.len() as u64),
            bytes: manifest.as_ref().map(Manifest::bytes),
            in_use_by,
            name,
        });
    }
    Ok(listed)
}

/// How much later a due session the reaper cannot handle now is looked at again (its lock is
/// held, or deleting it failed): its index score moves to `now + REAP_RETRY` (never earlier
/// than it is), so that it leaves the head of the index, whose first 100 entries are all a
/// call reads: 100 such names must not pin that window for ever (test:
/// invalid_or_locked_index_members_do_not_stop_the_session_reaper).
pub const REAP_RETRY: Duration = Duration::from_secs(60);

/// What one [`reap`] call did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reaped {
    /// The sessions deleted.
    pub deleted: Vec<String>,
    /// The index was a key of another type (a client wrote it) and was removed: it holds no
    /// session now, so the caller should [`rebuild_index`] soon.
    pub index_reset: bool,
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
pub async fn reap(
    s3: &aws_sdk_s3::Client,
    bucket: &str,
    redis: &mut RedisConn,
    names: &Names,
    now_ms: u64,
    reaper_id: &str,
) -> Result<Reaped, SessionError> {
    let reset: i64 = crate::redis_conn::Script::new(RESET_FOREIGN_INDEX_SCRIPT).key(names.sessions_index()).invoke_async(redis).await?;
    if reset == 1 {
        tracing::warn!(key = names.sessions_index(), "the sessions index was a key of another type; deleted it (to be rebuilt from S3)");
    }
    // Bytes: one member that is not UTF-8 must not fail the whole call, every period.
    let due: Vec<Vec<u8>> =
        crate::redis_conn::Script::new(DUE_SESSIONS_SCRIPT).key(names.sessions_index()).arg(now_ms).invoke_async(redis).await?;
    let mut reaped = Vec::new();
    let retry_at = now_ms.saturating_add(REAP_RETRY.as_millis() as u64);
    for member in due {
        let Some(name) = std::str::from_utf8(&member).ok().filter(|n| sandq_schemas::validate::check_session_name(n).is_ok()) else {
            // Not a session's (a client can write the index): dropped, never an S3 prefix.
            tracing::warn!(member = %String::from_utf8_lossy(&member), "removing an invalid name from the sessions index");
            let _: i64 = redis::cmd("ZREM").arg(names.sessions_index()).arg(&member).query_async(redis).await?;
            continue;
        };
        let name = name.to_owned();
        if let Err(e) = lock(redis, names, &name, reaper_id, Duration::from_secs(300), Duration::ZERO).await {
            tracing::info!(session = name, error = %e, "session due but locked; looking again later");
            reschedule(redis, names, &name, retry_at).await?;
            continue;
        }
        let outcome: Result<bool, SessionError> = async {
            let manifest = match load(s3, bucket, names, &name).await {
                // Malformed or oversized: nothing to keep.
                Err(SessionError::Manifest { .. } | SessionError::Storage(TransferError::Size { .. })) => None,
                other => other?,
            };
            match manifest {
                Some(m) if m.expires_at_ms > now_ms => {
                    // Used again: the index is behind; fix it.
                    let _: () = redis::cmd("ZADD").arg(names.sessions_index()).arg(m.expires_at_ms).arg(&name).query_async(redis).await?;
                    Ok(false)
                }
                _ => {
                    delete(s3, bucket, redis, names, &name).await?;
                    mark_expired(redis, names, &name).await?;
                    Ok(true)
                }
            }
        }
        .await;
        // A lock key a client turned into another type cannot be released (the lease frees
        // it): logged for that session, never an error of the whole call.
        if let Err(e) = unlock(redis, names, &name, reaper_id).await {
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
pub const REBUILD_MAX_SESSIONS: usize = 100_000;

/// How soon after another rebuild one may start when the index was found of another type
/// ([`Reaped::index_reset`]), unless the worker's periodic rebuild (`sessions.rebuild_interval`,
/// default 1 h) is shorter: a client resetting the index over and over costs at most one
/// rebuild a minute across all workers.
pub const REBUILD_AFTER_RESET: Duration = Duration::from_secs(60);

/// How long a rebuild turn's start time is kept in Redis: longer than any sane rebuild period.
const REBUILD_TURN_KEPT: Duration = Duration::from_secs(24 * 3600);

/// Whether this caller takes the next rebuild of the sessions index: true when no worker
/// started one within `gap` (kept in [`Names::sessions_rebuilt_key`] as a start time in ms;
/// a value that is not a time, or one in the future, counts as none: a client may write it).
///
/// # Errors
/// [`SessionError::Redis`].
pub async fn take_rebuild_turn(redis: &mut RedisConn, names: &Names, now_ms: u64, gap: Duration) -> Result<bool, SessionError> {
    let taken: i64 = crate::redis_conn::Script::new(REBUILD_TURN_SCRIPT)
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
pub async fn rebuild_index(
    s3: &aws_sdk_s3::Client,
    bucket: &str,
    redis: &mut RedisConn,
    names: &Names,
    now_ms: u64,
) -> Result<usize, SessionError> {
    let dirs = storage::list_dirs(s3, bucket, &names.sessions_prefix(), REBUILD_MAX_SESSIONS).await?;
    let mut seen = 0;
    for name in dirs.iter().filter(|n| sandq_schemas::validate::check_session_name(n).is_ok()) {
        let expires_at_ms = match load(s3, bucket, names, name).await {
            Ok(Some(m)) => m.expires_at_ms,
            Ok(None) | Err(SessionError::Manifest { .. } | SessionError::Storage(TransferError::Size { .. })) => now_ms,
            Err(e) => return Err(e),
        };
        let _: i64 = crate::redis_conn::Script::new(ADD_OR_LATER_SCRIPT)
            .key(names.sessions_index())
            .arg(name)
            .arg(expires_at_ms)
            .invoke_async(redis)
            .await?;
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
    let _: i64 = crate::redis_conn::Script::new(LATER_SCRIPT).key(names.sessions_index()).arg(name).arg(at).invoke_async(redis).await?;
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

/// KEYS[1] = a session's lock: its holder when it is a string of at most 80 bytes of
/// `[A-Za-z0-9_.-]` (what workers write: an attempt or reaper id), `?` for any other value or
/// type, nil when there is none.
const LOCK_HOLDER_SCRIPT: &str = r"
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return false end
if t ~= 'string' or redis.call('STRLEN', KEYS[1]) > 80 then return '?' end
local v = redis.call('GET', KEYS[1])
if string.find(v, '^[%w_.-]+$') then return v end
return '?'
";

/// KEYS[1] = a session's lock, ARGV = holder, lease in ms: renews the lease and returns 1 when
/// the lock holds `holder`, else 0. The value is compared in Redis, never sent.
const RENEW_IF_HELD_SCRIPT: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
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
