//! `/v1/sessions`: a tenant's sessions (create, list, delete) and their files (list, read,
//! write) without running a job.
//!
//! A tenant's session `<name>` is the queue's session `<tenant>_<name>`; the gateway keeps the
//! tenant's sessions in `<ns>:tenant:{<tenant>}:sessions` (a sorted set: name -> when it was
//! registered), which bounds their number (`max_sessions`) and lists them. A job naming a
//! session registers it. Files are read from and written to the session's manifest and blobs
//! in S3 as a job leaves them, under the session's lock (never while a job of it runs).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use redis::AsyncCommands as _;
use sandq_core::sessions::{self, FileEntry, Manifest, SessionError};
use sandq_core::storage;
use serde::Deserialize;
use serde_json::json;

use crate::auth::Caller;
use crate::problem::Problem;
use crate::state::Gateway;

/// The tenant's sessions.
pub(crate) fn tenant_sessions_key(gateway: &Gateway, tenant: &str) -> String {
    format!("{}:tenant:{{{tenant}}}:sessions", gateway.names.namespace())
}

/// Checks a tenant's session name: 1 to 64 less the tenant's prefix of `[A-Za-z0-9_.-]`, not
/// starting with `.`; returns the queue's name.
pub(crate) fn session_of(caller: &Caller, name: &str) -> Result<String, Problem> {
    let ok = !name.is_empty()
        && name.len() <= caller.max_id_len()
        && !name.starts_with('.')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
    if ok {
        Ok(caller.scoped(name))
    } else {
        Err(Problem::invalid(format!("session {name:?} is not 1 to {} of [A-Za-z0-9_.-] not starting with '.'", caller.max_id_len())))
    }
}

/// Registers the session for the tenant (a job naming it, or `POST /v1/sessions`).
///
/// # Errors
/// 429 when the tenant already has `max_sessions` other sessions; 503 when Redis fails.
pub(crate) async fn register(gateway: &Gateway, caller: &Caller, name: &str) -> Result<bool, Problem> {
    let mut redis = gateway.redis.clone();
    let key = tenant_sessions_key(gateway, &caller.key.tenant);
    let unavailable = |e: redis::RedisError| Problem::unavailable(format!("redis: {e}"));
    let known: Option<f64> = redis.zscore(&key, name).await.map_err(unavailable)?;
    if known.is_some() {
        return Ok(false);
    }
    // Sessions that expired (no manifest any more, and registered over a day ago) leave the
    // count first.
    let registered: Vec<(String, f64)> = redis.zrange_withscores(&key, 0, -1).await.map_err(unavailable)?;
    let now = sandq_core::time::now_ms();
    for (other, at) in &registered {
        let old = now.saturating_sub(*at as u64) > 24 * 3600 * 1000;
        if old
            && sessions::load(&gateway.s3, &gateway.service.s3.bucket, &gateway.names, &caller.scoped(other)).await.ok().flatten().is_none()
        {
            let _: redis::RedisResult<()> = redis.zrem(&key, other).await;
        }
    }
    let (added, count): (u64, u64) = redis::pipe()
        .atomic()
        .cmd("ZADD")
        .arg(&key)
        .arg("NX")
        .arg(now as f64)
        .arg(name)
        .zcard(&key)
        .query_async(&mut redis)
        .await
        .map_err(unavailable)?;
    if count > u64::from(caller.key.quotas.max_sessions) {
        if added == 1 {
            let _: redis::RedisResult<()> = redis.zrem(&key, name).await;
        }
        return Err(Problem::too_many(format!("at most {} sessions for this key's tenant", caller.key.quotas.max_sessions), 60));
    }
    Ok(added == 1)
}

/// Checks that the tenant registered `name`; returns the queue's name.
async fn owned(gateway: &Gateway, caller: &Caller, name: &str) -> Result<String, Problem> {
    let scoped = session_of(caller, name).map_err(|_| Problem::not_found("session", name))?;
    let mut redis = gateway.redis.clone();
    let known: Option<f64> = redis
        .zscore(tenant_sessions_key(gateway, &caller.key.tenant), name)
        .await
        .map_err(|e| Problem::unavailable(format!("redis: {e}")))?;
    if known.is_some() {
        Ok(scoped)
    } else {
        Err(Problem::not_found("session", name))
    }
}

fn storage_problem(e: impl std::fmt::Display) -> Problem {
    Problem::unavailable(format!("s3: {e}"))
}

fn session_problem(e: SessionError) -> Problem {
    match e {
        SessionError::Busy { name } => Problem::conflict(format!("session {name:?} is in use by a job; retry")).retry_after(2),
        e => Problem::unavailable(e.to_string()),
    }
}

/// `POST /v1/sessions`'s body.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CreateSession {
    /// The session's name; default a new UUID.
    #[serde(default)]
    pub(crate) name: Option<String>,
}

/// `POST /v1/sessions`: 201 `{"name"}` (a new session), 200 when the tenant has it already.
#[utoipa::path(post, path = "/v1/sessions", tag = "sessions", request_body(content = Option<CreateSession>),
    responses((status = 201, description = "`{\"name\"}`: a new session", body = serde_json::Value), (status = 200, description = "The tenant has it already", body = serde_json::Value),
        (status = 429, description = "quota-exceeded", body = Problem)),
    security(("api_key" = [])))]
pub(crate) async fn create(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Result<Response, Problem> {
    let request: CreateSession = if headers.contains_key(header::CONTENT_TYPE) {
        let bytes = crate::body::read_json(&gateway, &caller, &headers, body).await?;
        if bytes.is_empty() {
            CreateSession::default()
        } else {
            serde_json::from_slice(&bytes).map_err(|e| Problem::invalid(format!("the body is not a session: {e}")))?
        }
    } else {
        CreateSession::default()
    };
    let name = request.name.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    session_of(&caller, &name)?;
    let new = register(&gateway, &caller, &name).await?;
    let status = if new { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(json!({"name": name})).into_response()).into_response())
}

/// `GET /v1/sessions`: the tenant's sessions (at most 1000), with their files' count and bytes
/// and expiry (`null` for a session no job has used yet).
#[utoipa::path(get, path = "/v1/sessions", tag = "sessions",
    responses((status = 200, description = "`{\"sessions\": [{\"name\", \"files\", \"bytes\", \"expires_at_ms\", \"execution_count\"}]}`", body = serde_json::Value)),
    security(("api_key" = [])))]
pub(crate) async fn list(State(gateway): State<Arc<Gateway>>, caller: Caller) -> Result<Response, Problem> {
    let mut redis = gateway.redis.clone();
    let names: Vec<String> = redis
        .zrange(tenant_sessions_key(&gateway, &caller.key.tenant), 0, 999)
        .await
        .map_err(|e| Problem::unavailable(format!("redis: {e}")))?;
    let mut listed = Vec::with_capacity(names.len());
    for name in names {
        let manifest = sessions::load(&gateway.s3, &gateway.service.s3.bucket, &gateway.names, &caller.scoped(&name))
            .await
            .map_err(session_problem)?;
        listed.push(match manifest {
            Some(m) => json!({"name": name, "files": m.files.len(), "bytes": m.bytes(), "expires_at_ms": m.expires_at_ms, "execution_count": m.execution_count}),
            None => json!({"name": name, "files": 0, "bytes": 0, "expires_at_ms": null, "execution_count": 0}),
        });
    }
    Ok(Json(json!({"sessions": listed})).into_response())
}

/// `DELETE /v1/sessions/{name}`: its files and state deleted (waiting up to 30 s for a job of
/// it to end), and the name given back. 204.
#[utoipa::path(delete, path = "/v1/sessions/{name}", tag = "sessions", params(("name" = String, Path, description = "The session")),
    responses((status = 204, description = "Deleted"), (status = 404, description = "not-found", body = Problem), (status = 409, description = "A job of it still runs", body = Problem)),
    security(("api_key" = [])))]
pub(crate) async fn delete(State(gateway): State<Arc<Gateway>>, caller: Caller, Path(name): Path<String>) -> Result<Response, Problem> {
    let scoped = owned(&gateway, &caller, &name).await?;
    let mut redis = gateway.redis.clone();
    let holder = format!("gateway-{}", uuid::Uuid::new_v4());
    let removed =
        sessions::remove(&gateway.s3, &gateway.service.s3.bucket, &mut redis, &gateway.names, &scoped, &holder, Duration::from_secs(30))
            .await
            .map_err(session_problem)?;
    removed.deleted.map_err(session_problem)?;
    let _: redis::RedisResult<()> = redis.zrem(tenant_sessions_key(&gateway, &caller.key.tenant), &name).await;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Most files listed by `GET /v1/sessions/{name}/files`.
const MAX_LISTED: usize = 10_000;

/// `GET /v1/sessions/{name}/files`: `{"files": [{"path", "size", "sha256"}], "truncated"}`.
#[utoipa::path(get, path = "/v1/sessions/{name}/files", tag = "sessions", params(("name" = String, Path, description = "The session")),
    responses((status = 200, description = "`{\"files\": [{\"path\", \"size\", \"sha256\"}], \"truncated\"}`", body = serde_json::Value), (status = 404, description = "not-found", body = Problem)),
    security(("api_key" = [])))]
pub(crate) async fn files(State(gateway): State<Arc<Gateway>>, caller: Caller, Path(name): Path<String>) -> Result<Response, Problem> {
    let scoped = owned(&gateway, &caller, &name).await?;
    let manifest = sessions::load(&gateway.s3, &gateway.service.s3.bucket, &gateway.names, &scoped)
        .await
        .map_err(session_problem)?
        .unwrap_or_default();
    let files: Vec<_> =
        manifest.files.iter().take(MAX_LISTED).map(|(path, f)| json!({"path": path, "size": f.size, "sha256": f.sha256})).collect();
    Ok(Json(json!({"files": files, "truncated": manifest.files.len() > MAX_LISTED})).into_response())
}

/// `GET /v1/sessions/{name}/files/{path}`: 307 to a presigned URL of the file (15 min); 404
/// when the session has no such file.
#[utoipa::path(get, path = "/v1/sessions/{name}/files/{path}", tag = "sessions",
    params(("name" = String, Path, description = "The session"), ("path" = String, Path, description = "The file's path under /work")),
    responses((status = 307, description = "Redirect to a presigned URL (15 min)"), (status = 404, description = "not-found", body = Problem)),
    security(("api_key" = [])))]
pub(crate) async fn read(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    Path((name, path)): Path<(String, String)>,
) -> Result<Response, Problem> {
    let scoped = owned(&gateway, &caller, &name).await?;
    let manifest = sessions::load(&gateway.s3, &gateway.service.s3.bucket, &gateway.names, &scoped)
        .await
        .map_err(session_problem)?
        .unwrap_or_default();
    let entry = manifest.files.get(&path).ok_or_else(|| Problem::not_found("file", &path))?;
    let key = gateway.names.session_blob_key(&scoped, &entry.sha256);
    let url =
        storage::presign_get(&gateway.s3, &gateway.service.s3.bucket, &key, Duration::from_secs(15 * 60)).await.map_err(storage_problem)?;
    let mut response = StatusCode::TEMPORARY_REDIRECT.into_response();
    response.headers_mut().insert(header::LOCATION, url.parse().map_err(|_| Problem::unavailable("the file's URL"))?);
    Ok(response)
}

/// A session file's path by the one path rule ([`sandq_schemas::paths::check_session_path`]:
/// what the worker restores under `/work`).
///
/// # Errors
/// 400 `invalid-request` naming the path and the rule it breaks.
pub(crate) fn check_path(path: &str) -> Result<(), Problem> {
    sandq_schemas::paths::check_session_path(path).map(drop).map_err(|e| {
        Problem::invalid(format!(
            "path {:?} cannot be a session file: {e} (a path under /work: relative, '/'-separated, \
             each component 1 to 255 bytes and not '.' or '..', at most 1024 bytes, no NUL or backslash)",
            sandq_schemas::paths::clipped(path)
        ))
    })
}

/// Refuses `path` when the session already has a file it cannot stand beside (`data` beside
/// `data/x.csv`).
///
/// # Errors
/// 409 `path-conflict` naming the other file.
fn check_conflict(manifest: &Manifest, path: &str) -> Result<(), Problem> {
    match sandq_schemas::paths::conflict(manifest.files.keys().map(String::as_str), path) {
        None => Ok(()),
        Some(other) => Err(Problem::path_conflict(format!(
            "path {:?} clashes with the session's file {:?}: one path cannot be both a file and a directory; \
             delete that file first (DELETE /v1/sessions/{{name}}/files/{{path}})",
            sandq_schemas::paths::clipped(path),
            sandq_schemas::paths::clipped(other)
        ))),
    }
}

/// How long a session written to without a job lives (the worker's default idle time-out).
const NEW_SESSION_TTL: Duration = Duration::from_secs(30 * 60);

/// `PUT /v1/sessions/{name}/files/{path}`: the body (any type, at most the key's
/// `max_upload_bytes`) becomes the file at `path` in the session, as if a job had written it;
/// the next job of the session finds it in `/work`. 201 `{"path", "size", "sha256"}`; 400
/// for a path the worker could not restore (the path rule); 409 `path-conflict` when the session
/// has a file that is a directory of `path` or has it as one, 409 `conflict` while a job of the
/// session runs (retry); 408 for a body not whole within its deadline; 429 when the key has
/// `max_uploads_per_key` bodies under way.
#[utoipa::path(put, path = "/v1/sessions/{name}/files/{path}", tag = "sessions",
    params(("name" = String, Path, description = "The session"), ("path" = String, Path, description = "The file's path under /work")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "The file's bytes"),
    responses((status = 201, description = "`{\"path\", \"size\", \"sha256\"}`", body = serde_json::Value), (status = 400, description = "invalid-request: a path the rule refuses", body = Problem),
        (status = 404, description = "not-found", body = Problem), (status = 409, description = "path-conflict: a file of the session is a directory of the path, or under it; conflict: a job of the session runs", body = Problem),
        (status = 408, description = "body-timeout: the body did not arrive within its deadline", body = Problem), (status = 429, description = "The key has `max_uploads_per_key` bodies under way", body = Problem)),
    security(("api_key" = [])))]
pub(crate) async fn write(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    Path((name, path)): Path<(String, String)>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Result<Response, Problem> {
    check_path(&path)?;
    let scoped = owned(&gateway, &caller, &name).await?;
    // A clash refused before the body is read (the check under the lock in `store_file` decides).
    if let Some(manifest) =
        sessions::load(&gateway.s3, &gateway.service.s3.bucket, &gateway.names, &scoped).await.map_err(session_problem)?
    {
        check_conflict(&manifest, &path)?;
    }
    // One of the key's uploads under way until the file is stored; the bytes go through a
    // temporary file, never into memory (issue 36, findings 3 and 4).
    let _permit = gateway.take_upload(&caller.key.id)?;
    let spooled = crate::body::spool(&gateway, &headers, body, caller.key.quotas.max_upload_bytes).await?;
    store_file(&gateway, &caller, &name, &path, &spooled).await?;
    Ok((StatusCode::CREATED, Json(json!({"path": path, "size": spooled.size, "sha256": spooled.sha256}))).into_response())
}

/// Refuses (409 `path-conflict`) when any of `paths` clashes with a file the tenant's session
/// `name` holds now: checked before a write of several files stores any of them (the check
/// under the lock in [`store_file`] decides each one).
///
/// # Errors
/// 404 when the tenant has no such session; 409 `path-conflict`; 503 when a service fails.
pub(crate) async fn check_conflicts(gateway: &Gateway, caller: &Caller, name: &str, paths: &[&str]) -> Result<(), Problem> {
    let scoped = owned(gateway, caller, name).await?;
    if let Some(manifest) =
        sessions::load(&gateway.s3, &gateway.service.s3.bucket, &gateway.names, &scoped).await.map_err(session_problem)?
    {
        for path in paths {
            check_conflict(&manifest, path)?;
        }
    }
    Ok(())
}

/// Stores a spooled upload as the file at `path` in the tenant's session `name`, as if a job
/// had written it (`PUT /v1/sessions/{name}/files/{path}`, and the E2B plane's file writes).
/// The blob streams from the temporary file to S3.
///
/// # Errors
/// 400 for a path a session cannot hold; 404 when the tenant has no such session; 409 while a
/// job of the session runs (retry); 503 when a service fails.
pub(crate) async fn store_file(
    gateway: &Gateway,
    caller: &Caller,
    name: &str,
    path: &str,
    spooled: &crate::body::Spooled,
) -> Result<(), Problem> {
    check_path(path)?;
    let scoped = owned(gateway, caller, name).await?;
    let (sha256, size) = (spooled.sha256.clone(), spooled.size);
    let bucket = &gateway.service.s3.bucket;
    let mut redis = gateway.redis.clone();
    let holder = format!("gateway-{}", uuid::Uuid::new_v4());
    sessions::lock(&mut redis, &gateway.names, &scoped, &holder, Duration::from_secs(60), Duration::ZERO).await.map_err(session_problem)?;
    let written = async {
        let file = spooled.open().await.map_err(|e| Problem::unavailable(format!("cannot read the upload back: {e}")))?;
        storage::put_file(
            &gateway.s3,
            bucket,
            &gateway.names.session_blob_key(&scoped, &sha256),
            file,
            &spooled.shown(),
            "application/octet-stream",
        )
        .await
        .map_err(storage_problem)?;
        let now = sandq_core::time::now_ms();
        let mut manifest = sessions::load(&gateway.s3, bucket, &gateway.names, &scoped)
            .await
            .map_err(session_problem)?
            .unwrap_or_else(|| Manifest { created_at_ms: now, ..Manifest::default() });
        // Under the session's lock, which a job, a write and a delete of the session each hold
        // while they change it: of two concurrent writes of `data` and `data/x`, the second to
        // take the lock sees the first's file here and is refused. A session that holds such a
        // pair nonetheless (written before this check, or straight into S3) fails its jobs with
        // a reason naming the file (the worker's `StageError::Unrestorable`), and
        // `DELETE /v1/sessions/{name}/files/{path}` mends it.
        if let Err(refused) = check_conflict(&manifest, path) {
            if !manifest.files.values().chain(manifest.states()).chain(manifest.packages.as_ref()).any(|f| f.sha256 == sha256) {
                let blob = gateway.names.session_blob_key(&scoped, &sha256);
                let _ = storage::delete_keys(&gateway.s3, bucket, &[blob]).await;
            }
            return Err(refused);
        }
        manifest.files.insert(path.to_owned(), FileEntry { sha256: sha256.clone(), size });
        manifest.updated_at_ms = now;
        manifest.expires_at_ms = manifest.expires_at_ms.max(now + NEW_SESSION_TTL.as_millis() as u64);
        sessions::store(&gateway.s3, bucket, &mut redis, &gateway.names, &scoped, &manifest).await.map_err(session_problem)?;
        Ok::<_, Problem>(())
    }
    .await;
    let _ = sessions::unlock(&mut gateway.redis.clone(), &gateway.names, &scoped, &holder).await;
    written
}

/// `DELETE /v1/sessions/{name}/files/{path}`: the file at `path` removed from the session (any
/// path the session holds, including one the path rule now refuses, so that a session written
/// before it can be mended); its content deleted once no other entry of the session refers to
/// it. 204; 404 when the tenant has no such session or the session no such file; 409 while a
/// job of the session runs (retry).
#[utoipa::path(delete, path = "/v1/sessions/{name}/files/{path}", tag = "sessions",
    params(("name" = String, Path, description = "The session"), ("path" = String, Path, description = "The file's path under /work, as listed")),
    responses((status = 204, description = "Deleted"), (status = 404, description = "not-found: no such session or file", body = Problem),
        (status = 409, description = "A job of the session runs", body = Problem)),
    security(("api_key" = [])))]
pub(crate) async fn remove(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    Path((name, path)): Path<(String, String)>,
) -> Result<Response, Problem> {
    let scoped = owned(&gateway, &caller, &name).await?;
    let bucket = &gateway.service.s3.bucket;
    let mut redis = gateway.redis.clone();
    let holder = format!("gateway-{}", uuid::Uuid::new_v4());
    sessions::lock(&mut redis, &gateway.names, &scoped, &holder, Duration::from_secs(60), Duration::ZERO).await.map_err(session_problem)?;
    let removed = async {
        let mut manifest = sessions::load(&gateway.s3, bucket, &gateway.names, &scoped)
            .await
            .map_err(session_problem)?
            .ok_or_else(|| Problem::not_found("file", &path))?;
        let entry = manifest.files.remove(&path).ok_or_else(|| Problem::not_found("file", &path))?;
        manifest.updated_at_ms = sandq_core::time::now_ms();
        sessions::store(&gateway.s3, bucket, &mut redis, &gateway.names, &scoped, &manifest).await.map_err(session_problem)?;
        // After the manifest: a blob goes only once no manifest refers to it.
        if !manifest.files.values().chain(manifest.states()).chain(manifest.packages.as_ref()).any(|f| f.sha256 == entry.sha256) {
            let blob = gateway.names.session_blob_key(&scoped, &entry.sha256);
            storage::delete_keys(&gateway.s3, bucket, &[blob]).await.map_err(storage_problem)?;
        }
        Ok::<_, Problem>(())
    }
    .await;
    let _ = sessions::unlock(&mut gateway.redis.clone(), &gateway.names, &scoped, &holder).await;
    removed?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_file_paths_stay_under_work() {
        for good in ["a.txt", "data/x.csv", "deep/er/file"] {
            assert!(check_path(good).is_ok(), "{good}");
        }
        for bad in ["", "/etc/passwd", "../x", "a/../b", "a//b", "./a", "a/", "a\0b", &"x".repeat(1025), "a\\b", &"x".repeat(256)] {
            let refused = check_path(bad).expect_err(bad);
            assert_eq!(refused.status, 400, "{bad:?}");
        }
    }

    #[test]
    fn a_file_beside_a_directory_of_its_name_is_refused() {
        let mut manifest = Manifest::default();
        manifest.files.insert("data/x.csv".into(), FileEntry { sha256: "0".repeat(64), size: 1 });
        let refused = check_conflict(&manifest, "data").expect_err("data beside data/x.csv");
        assert_eq!((refused.status, refused.kind.as_str()), (409, "urn:sandq:problem:path-conflict"));
        assert!(refused.detail.contains("\"data/x.csv\""), "{}", refused.detail);
        check_conflict(&manifest, "data/y.csv").expect("a sibling");
        check_conflict(&manifest, "data/x.csv").expect("the same file, replaced");
    }
}
