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
    /// state, and the worker's reaper, rebuilding the index, indexes it again from S3.
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
    /// The session's name as the index holds it (for a gateway tenant, `<tenant>_<name>`).
    pub name: String,
    /// When it expires, Unix epoch milliseconds.
    pub expires_at_ms: u64,
    /// How many files its manifest lists (`None` when the manifest is missing or unreadable).
    pub files: Option<u64>,
    /// The total size of those files in bytes (`None` when the manifest is missing or unreadable).
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
