//! envd's filesystem on a sandq session (E2B's `sandbox.files`): `GET /files` (read), `POST
//! /files` (write: octet-stream or multipart), and the Connect-RPC calls `ListDir` and `Stat`
//! (`list`, `exists`, `get_info`) and `Remove` (`remove`); the others answer `unimplemented` (docs/e2b.md says why).
//!
//! A sandbox's files are its session's (`/work`, which every sandbox also sees as
//! `/home/user`): paths under `/home/user` or `/work`, or relative ones (envd resolves those
//! against the user's home, `/home/user`), name a session file; any other path is refused, since
//! nothing else outlives a cell. Files are read and written through the gateway's REST routes
//! with the caller's key (`/v1/sessions/{id}/files`), as a job leaves them: a file a running cell
//! writes is seen once the cell has ended; a write waits (up to [`WRITE_WAIT`]) for a running cell.
//!
//! The Connect protocol (connectrpc.com/docs/protocol): a unary call is a JSON body answered by
//! JSON, an error by its HTTP status and `{"code", "message"}`; E2B's SDKs use the JSON codec.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{FromRequest as _, Query, Request};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::TryStreamExt as _;
use sandq_client::http::{FileInfo, Rest, RestError};
use serde::Deserialize;
use serde_json::{json, Value};

use super::record::{plane_sandbox, Record};
use super::state::{caller_or_401, e2b_error, target, E2b, Refused};
use crate::auth::Caller;

/// The user's home in an E2B sandbox, which sandq binds to the session's `/work`.
pub(super) const HOME: &str = "/home/user";

/// How long a write waits for a running cell of the sandbox (which holds the session) to end.
const WRITE_WAIT: Duration = Duration::from_secs(60);

/// Most files a sandbox's listing looks through: the REST listing's own bound.
const MAX_FILES: usize = 10_000;

/// Most files one multipart write carries (each is a write of the session's manifest).
const MAX_PARTS: usize = 1_000;

/// A Connect error code (connectrpc.com/docs/protocol#error-codes) and the HTTP status a unary
/// call answers it with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Code {
    InvalidArgument,
    NotFound,
    Unimplemented,
    Unavailable,
    Internal,
    DeadlineExceeded,
    ResourceExhausted,
    Unauthenticated,
}

impl Code {
    /// The code's name on the wire.
    pub(super) fn name(self) -> &'static str {
        match self {
            Code::InvalidArgument => "invalid_argument",
            Code::NotFound => "not_found",
            Code::Unimplemented => "unimplemented",
            Code::Unavailable => "unavailable",
            Code::Internal => "internal",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::ResourceExhausted => "resource_exhausted",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    fn status(self) -> StatusCode {
        match self {
            Code::InvalidArgument => StatusCode::BAD_REQUEST,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }

    /// The code of a REST refusal.
    pub(super) fn of_rest(e: &RestError) -> Code {
        match (e.status(), e) {
            (Some(404), _) => Code::NotFound,
            (Some(401), _) => Code::Unauthenticated,
            (Some(429 | 413), _) | (_, RestError::TooLarge { .. }) => Code::ResourceExhausted,
            (Some(400 | 403 | 422), _) => Code::InvalidArgument,
            (Some(503), _) => Code::Unavailable,
            _ => Code::Internal,
        }
    }
}

/// A unary call's error answer.
pub(super) fn connect_error(code: Code, message: impl Into<String>) -> Response {
    (code.status(), Json(json!({"code": code.name(), "message": message.into()}))).into_response()
}

/// A sandbox path as the session's file path: `""` for the home directory itself, else a
/// relative `/`-separated path with no empty, `.` or `..` component.
///
/// # Errors
/// A message naming the path when it is outside `/home/user` (and `/work`) or climbs out of it.
pub(super) fn session_path(path: &str) -> Result<String, String> {
    let under = |dir: &str| path.strip_prefix(dir).filter(|rest| rest.is_empty() || rest.starts_with('/'));
    let relative = match (under(HOME), under("/work")) {
        (Some(rest), _) | (None, Some(rest)) => rest,
        (None, None) if !path.starts_with('/') => path,
        _ => return Err(format!("{path}: sandq keeps a sandbox's files under {HOME} (the same directory as /work) only")),
    };
    let mut parts: Vec<&str> = Vec::new();
    for part in relative.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                if parts.pop().is_none() {
                    return Err(format!("{path}: leaves {HOME}"));
                }
            }
            name => parts.push(name),
        }
    }
    if path.contains('\0') {
        return Err("a path cannot hold NUL".to_owned());
    }
    Ok(parts.join("/"))
}

/// The sandbox path of a session path.
pub(super) fn sandbox_path(path: &str) -> String {
    if path.is_empty() {
        HOME.to_owned()
    } else {
        format!("{HOME}/{path}")
    }
}

/// `?path=&username=` of the files API (`username` is accepted and ignored: one user).
#[derive(Debug, Deserialize)]
pub(super) struct FilesQuery {
    #[serde(default)]
    path: Option<String>,
}

/// The caller's live sandbox and a REST client with its key, or the answer that ends the call.
async fn sandbox_and_rest(
    e2b: &E2b,
    caller: Result<Caller, crate::problem::Problem>,
    headers: &HeaderMap,
) -> Result<(Record, Rest), Refused> {
    let record = plane_sandbox(e2b, caller, headers).await?;
    let rest = e2b.rest(headers).ok_or_else(|| e2b_error(StatusCode::UNAUTHORIZED, "invalid access token"))?;
    Ok((record, rest))
}

/// A REST refusal in the files API's shape (`{"code", "message"}` with its status).
fn files_error(e: &RestError) -> Response {
    let status = match e {
        _ if e.status().is_some() => e.status().and_then(|s| StatusCode::from_u16(s).ok()).unwrap_or(StatusCode::BAD_GATEWAY),
        RestError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        _ => StatusCode::BAD_GATEWAY,
    };
    e2b_error(status, e.summary())
}

/// `GET /files?path=`: the file's bytes as they come from storage; 404 when the sandbox has no
/// such file, 400 for a path sandq does not keep.
pub(super) async fn read(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    Query(query): Query<FilesQuery>,
) -> Result<Response, Refused> {
    let (record, rest) = sandbox_and_rest(&e2b, caller, &headers).await?;
    let path = match session_path(query.path.as_deref().unwrap_or_default()) {
        Ok(p) if p.is_empty() => return Err(e2b_error(StatusCode::BAD_REQUEST, format!("{HOME} is a directory")).into()),
        Ok(p) => p,
        Err(m) => return Err(e2b_error(StatusCode::BAD_REQUEST, m).into()),
    };
    match rest.file_stream(&record.id, &path).await {
        Ok(body) => {
            let body = Body::from_stream(body.map_err(std::io::Error::other));
            let mut response = body.into_response();
            response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
            Ok(response)
        }
        Err(e) if e.is_not_found() => {
            Err(e2b_error(StatusCode::NOT_FOUND, format!("path '{}' does not exist", sandbox_path(&path))).into())
        }
        Err(e) => Err(files_error(&e).into()),
    }
}

/// `POST /files?path=`: writes one file (an `application/octet-stream` body, at `path`) or
/// several (a multipart body: each `file` part at its file name, or at `path` when there is
/// one part), each as a session file, parents implied. 200 `[{"name", "type": "file", "path"}]`.
/// At most the key's `max_upload_bytes` in all, each file spooled to a temporary file (never
/// held in memory), as one of the key's uploads under way (`max_uploads_per_key`).
pub(super) async fn write(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    Query(query): Query<FilesQuery>,
    request: Request,
) -> Result<Response, Refused> {
    let headers = request.headers().clone();
    let key = caller.as_ref().ok().cloned();
    let (record, _) = sandbox_and_rest(&e2b, caller, &headers).await?;
    let Some(caller) = key else { return Err(e2b_error(StatusCode::UNAUTHORIZED, "invalid access token").into()) };
    let max = caller.key.quotas.max_upload_bytes;
    let refused =
        |p: crate::problem::Problem| Refused::from(e2b_error(StatusCode::from_u16(p.status).unwrap_or(StatusCode::BAD_REQUEST), p.detail));
    // A compressed body would be stored compressed: refused rather than guessed at (E2B's SDK
    // compresses only when asked: `gzip=True`).
    if headers.get(header::CONTENT_ENCODING).and_then(|v| v.to_str().ok()).is_some_and(|e| !e.trim().eq_ignore_ascii_case("identity")) {
        return Err(e2b_error(StatusCode::UNSUPPORTED_MEDIA_TYPE, "sandq takes uploads uncompressed (write without gzip)").into());
    }
    let multipart = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().to_ascii_lowercase().starts_with("multipart/form-data"));
    let _permit = e2b.gateway.take_upload(&caller.key.id).map_err(refused)?;
    crate::body::check_declared(&headers, max.saturating_add(MULTIPART_OVERHEAD)).map_err(refused)?;
    let files = if multipart {
        parts(&e2b, request, query.path.as_deref(), max).await?
    } else {
        let Some(path) = query.path.clone() else { return Err(e2b_error(StatusCode::BAD_REQUEST, "path is required").into()) };
        vec![(path, crate::body::spool(&e2b.gateway, &headers, request.into_body(), max).await.map_err(refused)?)]
    };
    // Every part's path checked before any is written: by the path rule (what a job restores;
    // the REST write checks it again, with the session's other files), and no two parts a file
    // and a directory of the same name.
    let mut checked = Vec::with_capacity(files.len());
    for (path, spooled) in files {
        let relative = match session_path(&path) {
            Ok(p) if p.is_empty() => return Err(e2b_error(StatusCode::BAD_REQUEST, format!("{HOME} is a directory")).into()),
            Ok(p) => p,
            Err(m) => return Err(e2b_error(StatusCode::BAD_REQUEST, m).into()),
        };
        if let Err(problem) = crate::sessions::check_path(&relative) {
            return Err(e2b_error(StatusCode::BAD_REQUEST, problem.detail).into());
        }
        checked.push((relative, spooled));
    }
    if let Some((dir, file)) = sandq_schemas::paths::first_conflict(checked.iter().map(|(p, _)| p.as_str())) {
        let message =
            format!("{} and {} cannot both be files: one would be a directory of the other", sandbox_path(dir), sandbox_path(file));
        return Err(e2b_error(StatusCode::CONFLICT, message).into());
    }
    // And none against the session's files now, so that a clash stores no part.
    let paths: Vec<&str> = checked.iter().map(|(p, _)| p.as_str()).collect();
    crate::sessions::check_conflicts(&e2b.gateway, &caller, &record.id, &paths).await.map_err(refused)?;
    let mut written = Vec::with_capacity(checked.len());
    for (relative, spooled) in checked {
        write_waiting(&e2b, &caller, &record.id, &relative, &spooled).await.map_err(refused)?;
        let name = relative.rsplit('/').next().unwrap_or_default().to_owned();
        written.push(json!({"name": name, "type": "file", "path": sandbox_path(&relative)}));
    }
    Ok(Json(Value::Array(written)).into_response())
}

/// What a multipart body may carry beyond its files' bytes (boundaries, part headers).
const MULTIPART_OVERHEAD: u64 = 1 << 20;

/// The files of a multipart body: `(path, spooled file)` for each part, at most `max` bytes in
/// all and [`MAX_PARTS`] parts.
async fn parts(e2b: &E2b, request: Request, path: Option<&str>, max: u64) -> Result<Vec<(String, crate::body::Spooled)>, Refused> {
    let bad = |m: String| Refused::from(e2b_error(StatusCode::BAD_REQUEST, m));
    // A part's error is the body's: 408 when the body was late (its deadline), else 400.
    let failed = |e: axum::extract::multipart::MultipartError| match crate::body::timed_out(&e) {
        Some(within) => Refused::from(e2b_error(StatusCode::REQUEST_TIMEOUT, format!("the body did not arrive within {within:?}"))),
        None => bad(e.body_text()),
    };
    let refused =
        |p: crate::problem::Problem| Refused::from(e2b_error(StatusCode::from_u16(p.status).unwrap_or(StatusCode::BAD_REQUEST), p.detail));
    let mut multipart = axum::extract::Multipart::from_request(request, &()).await.map_err(|e| bad(e.body_text()))?;
    let mut files = Vec::new();
    let mut total = 0u64;
    let within = e2b.gateway.settings.read_timeout;
    loop {
        let next = tokio::time::timeout(within, multipart.next_field())
            .await
            .map_err(|_| e2b_error(StatusCode::REQUEST_TIMEOUT, "the body came too slowly"))?;
        let Some(mut field) = next.map_err(failed)? else { break };
        if files.len() == MAX_PARTS {
            return Err(bad(format!("at most {MAX_PARTS} files in one write")));
        }
        let name = field.file_name().map(str::to_owned).or_else(|| path.map(str::to_owned));
        let Some(name) = name else { return Err(bad("a part has no file name and the call no path".to_owned())) };
        let mut spool = crate::body::Spool::new(&e2b.gateway).map_err(refused)?;
        loop {
            let chunk = tokio::time::timeout(within, field.chunk())
                .await
                .map_err(|_| e2b_error(StatusCode::REQUEST_TIMEOUT, "the body came too slowly"))?
                .map_err(failed)?;
            let Some(chunk) = chunk else { break };
            total += chunk.len() as u64;
            if total > max {
                return Err(e2b_error(StatusCode::PAYLOAD_TOO_LARGE, format!("the files are over {max} bytes in all")).into());
            }
            spool.write(&chunk).await.map_err(refused)?;
        }
        files.push((name, spool.finish().await.map_err(refused)?));
    }
    // One part and a path: the part goes at the path (envd's rule for a single upload).
    if let (Some(p), [only]) = (path, files.as_mut_slice()) {
        only.0 = p.to_owned();
    }
    if files.is_empty() {
        return Err(bad("the body has no file".to_owned()));
    }
    Ok(files)
}

/// Stores a session file, waiting while a cell of the sandbox holds the session (409), from
/// 250 ms between tries up to 4 s.
async fn write_waiting(
    e2b: &E2b,
    caller: &Caller,
    sandbox: &str,
    path: &str,
    spooled: &crate::body::Spooled,
) -> Result<(), crate::problem::Problem> {
    let deadline = Instant::now() + WRITE_WAIT;
    let mut pause = Duration::from_millis(250);
    loop {
        match crate::sessions::store_file(&e2b.gateway, caller, sandbox, path, spooled).await {
            // The session in use (`conflict`), not a path that clashes (`path-conflict`).
            Err(e) if e.status == 409 && !e.kind.ends_with(":path-conflict") && Instant::now() + pause < deadline => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(4));
            }
            other => return other,
        }
    }
}

/// envd's `EntryInfo` in proto JSON: a file, or a directory (one that holds files: sandq keeps
/// files, and a directory is there while it holds one).
fn entry(path: &str, size: Option<u64>) -> Value {
    let name = if path.is_empty() { "user" } else { path.rsplit('/').next().unwrap_or_default() };
    match size {
        Some(size) => json!({
            "name": name, "type": "FILE_TYPE_FILE", "path": sandbox_path(path), "size": size.to_string(),
            "mode": 0o644, "permissions": "-rw-r--r--", "owner": "user", "group": "user",
        }),
        // The permission bits, as envd reports them (E2B's tests read 0o755 for a directory).
        None => json!({
            "name": name, "type": "FILE_TYPE_DIRECTORY", "path": sandbox_path(path), "size": "0",
            "mode": 0o755, "permissions": "drwxr-xr-x", "owner": "user", "group": "user",
        }),
    }
}

/// What `path` is among the session's files: a file (its size), a directory, or nothing.
#[derive(Debug, PartialEq, Eq)]
enum Found {
    File(u64),
    Dir,
    Nothing,
}

fn find(files: &[FileInfo], path: &str) -> Found {
    if path.is_empty() {
        return Found::Dir;
    }
    if let Some(f) = files.iter().find(|f| f.path == path) {
        return Found::File(f.size);
    }
    let prefix = format!("{path}/");
    if files.iter().any(|f| f.path.starts_with(&prefix)) {
        Found::Dir
    } else {
        Found::Nothing
    }
}

/// The entries under directory `dir` down to `depth` levels (1: its own entries), in path order:
/// each file, and each directory once.
fn list_entries(files: &[FileInfo], dir: &str, depth: usize) -> Vec<Value> {
    let prefix = if dir.is_empty() { String::new() } else { format!("{dir}/") };
    let mut out: BTreeMap<String, Option<u64>> = BTreeMap::new();
    for file in files.iter().filter(|f| f.path.starts_with(&prefix)) {
        let below: Vec<&str> = file.path[prefix.len()..].split('/').collect();
        for level in 1..=below.len().min(depth) {
            let path = format!("{prefix}{}", below[..level].join("/"));
            let is_file = level == below.len();
            out.entry(path).or_insert(if is_file { Some(file.size) } else { None });
        }
    }
    out.into_iter().map(|(path, size)| entry(&path, size)).collect()
}

/// A unary Connect request's JSON (`application/json`), at most 64 KiB.
async fn unary<T: serde::de::DeserializeOwned>(e2b: &E2b, body: Body) -> Result<T, Refused> {
    let bytes = tokio::time::timeout(e2b.gateway.settings.read_timeout, axum::body::to_bytes(body, 64 << 10))
        .await
        .map_err(|_| connect_error(Code::DeadlineExceeded, "the body came too slowly"))?
        .map_err(|_| connect_error(Code::ResourceExhausted, "the body is over 64 KiB"))?;
    let bytes = if bytes.is_empty() { bytes::Bytes::from_static(b"{}") } else { bytes };
    serde_json::from_slice(&bytes).map_err(|e| connect_error(Code::InvalidArgument, format!("invalid request: {e}")).into())
}

#[derive(Debug, Deserialize)]
struct PathRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    depth: Option<u32>,
}

/// The sandbox's files for a filesystem call, or its error answer.
async fn session_files(e2b: &E2b, caller: Result<Caller, crate::problem::Problem>, headers: &HeaderMap) -> Result<Vec<FileInfo>, Refused> {
    let caller = caller_or_401(caller)?;
    let Some((_, id)) = target(headers) else { return Err(connect_error(Code::NotFound, "no sandbox named").into()) };
    let record = e2b.owned(&caller, &id).await.map_err(|_| connect_error(Code::Unavailable, format!("sandbox {id} is not running")))?;
    let rest = e2b.rest(headers).ok_or_else(|| connect_error(Code::Unauthenticated, "invalid access token"))?;
    match rest.session_files(&record.id).await {
        Ok((files, _)) => Ok(files.into_iter().take(MAX_FILES).collect()),
        // A session no job has used yet has no files.
        Err(e) if e.is_not_found() => Ok(Vec::new()),
        Err(e) => Err(connect_error(Code::of_rest(&e), e.summary()).into()),
    }
}

/// A filesystem call's sandbox files and request, or the answer that ends it.
async fn fs_call(
    e2b: &E2b,
    caller: Result<Caller, crate::problem::Problem>,
    headers: &HeaderMap,
    body: Body,
) -> Result<(Vec<FileInfo>, PathRequest), Refused> {
    let files = session_files(e2b, caller, headers).await?;
    Ok((files, unary(e2b, body).await?))
}

/// `filesystem.Filesystem/ListDir {"path", "depth"}`: `{"entries"}` under the directory, to
/// `depth` levels (0 counts as 1, as E2B's SDK sends it).
pub(super) async fn list_dir(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refused> {
    let (files, request) = fs_call(&e2b, caller, &headers, body).await?;
    let dir = match session_path(&request.path) {
        Ok(d) => d,
        Err(m) => return Err(connect_error(Code::InvalidArgument, m).into()),
    };
    match find(&files, &dir) {
        Found::Dir => {}
        Found::File(_) => return Err(connect_error(Code::InvalidArgument, format!("path is not a directory: {}", request.path)).into()),
        Found::Nothing => return Err(connect_error(Code::NotFound, format!("directory not found: {}", request.path)).into()),
    }
    let depth = request.depth.unwrap_or(1).max(1) as usize;
    Ok(Json(json!({"entries": list_entries(&files, &dir, depth)})).into_response())
}

/// `filesystem.Filesystem/Stat {"path"}`: `{"entry"}`, or `not_found`.
pub(super) async fn stat(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refused> {
    let (files, request) = fs_call(&e2b, caller, &headers, body).await?;
    let path = match session_path(&request.path) {
        // Outside what sandq keeps: nothing is there for the sandbox's files.
        Err(_) => return Err(connect_error(Code::NotFound, format!("no such file or directory: {}", request.path)).into()),
        Ok(p) => p,
    };
    match find(&files, &path) {
        Found::File(size) => Ok(Json(json!({"entry": entry(&path, Some(size))})).into_response()),
        Found::Dir => Ok(Json(json!({"entry": entry(&path, None)})).into_response()),
        Found::Nothing => Err(connect_error(Code::NotFound, format!("no such file or directory: {}", request.path)).into()),
    }
}

/// `filesystem.Filesystem/Remove {"path"}` (E2B's `files.remove`): `{}` once the file, or every
/// file under the directory, is deleted from the session (`DELETE /v1/sessions/{id}/files/{path}`,
/// waiting for a running cell like a write); `not_found` when there is nothing at `path`.
pub(super) async fn remove(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refused> {
    let (files, request) = fs_call(&e2b, caller, &headers, body).await?;
    let rest = e2b.rest(&headers).ok_or_else(|| connect_error(Code::Unauthenticated, "invalid access token"))?;
    let Some((_, id)) = target(&headers) else { return Err(connect_error(Code::NotFound, "no sandbox named").into()) };
    let path = match session_path(&request.path) {
        Ok(p) if p.is_empty() => return Err(connect_error(Code::InvalidArgument, format!("{HOME} cannot be removed")).into()),
        Ok(p) => p,
        Err(m) => return Err(connect_error(Code::InvalidArgument, m).into()),
    };
    let doomed: Vec<&str> = match find(&files, &path) {
        Found::File(_) => vec![path.as_str()],
        Found::Dir => {
            let prefix = format!("{path}/");
            files.iter().filter(|f| f.path.starts_with(&prefix)).map(|f| f.path.as_str()).collect()
        }
        Found::Nothing => return Err(connect_error(Code::NotFound, format!("no such file or directory: {}", request.path)).into()),
    };
    for file in doomed {
        match delete_waiting(&rest, &id, file).await {
            Ok(()) => {}
            // Deleted meanwhile (by a cell or another call): gone either way.
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(connect_error(Code::of_rest(&e), e.summary()).into()),
        }
    }
    Ok(Json(json!({})).into_response())
}

/// Deletes a session file, waiting while a cell of the sandbox holds the session (409), as
/// [`write_waiting`] does.
async fn delete_waiting(rest: &Rest, sandbox: &str, path: &str) -> Result<(), RestError> {
    let deadline = Instant::now() + WRITE_WAIT;
    let mut pause = Duration::from_millis(250);
    loop {
        match rest.delete_file(sandbox, path).await {
            // The session in use (`conflict`), not a path that clashes (`path-conflict`).
            Err(RestError::Conflict(_)) if Instant::now() + pause < deadline => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(4));
            }
            other => return other,
        }
    }
}

/// The filesystem calls sandq does not carry (`MakeDir`, `Move`, watchers): sandq
/// keeps a sandbox's files, not directories, and changes them through cells and writes.
pub(super) async fn unimplemented(uri: axum::http::Uri) -> Response {
    connect_error(
        Code::Unimplemented,
        format!(
            "{} is not carried by sandq: a sandbox keeps its files (write, read, list), not empty directories; \
             move files with a command (sandbox.commands.run)",
            uri.path()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, size: u64) -> FileInfo {
        FileInfo { path: path.to_owned(), size, sha256: String::new() }
    }

    #[test]
    fn sandbox_paths_map_to_session_files_under_home_only() {
        assert_eq!(session_path("/home/user/a.txt").as_deref(), Ok("a.txt"));
        assert_eq!(session_path("/home/user").as_deref(), Ok(""));
        assert_eq!(session_path("/home/user/").as_deref(), Ok(""));
        assert_eq!(session_path("/work/d/./x.csv").as_deref(), Ok("d/x.csv"));
        assert_eq!(session_path("rel/../b").as_deref(), Ok("b"));
        assert_eq!(session_path("x").as_deref(), Ok("x"));
        for bad in ["/etc/passwd", "/home/username/x", "/home/user/../x", "..", "/tmp", "a\0b"] {
            assert!(session_path(bad).is_err(), "{bad:?}");
        }
        assert_eq!(sandbox_path(""), "/home/user");
        assert_eq!(sandbox_path("d/x"), "/home/user/d/x");
    }

    #[test]
    fn listings_show_files_and_the_directories_that_hold_them_to_a_depth() {
        let files = [file("a.txt", 3), file("d/b.txt", 5), file("d/e/c.txt", 7), file("dd.txt", 1)];
        let paths = |v: Vec<Value>| {
            v.iter()
                .map(|e| (e["path"].as_str().expect("test value").to_owned(), e["type"].as_str().expect("test value").to_owned()))
                .collect::<Vec<_>>()
        };
        let f = |p: &str| (format!("/home/user/{p}"), "FILE_TYPE_FILE".to_owned());
        let d = |p: &str| (format!("/home/user/{p}"), "FILE_TYPE_DIRECTORY".to_owned());
        assert_eq!(paths(list_entries(&files, "", 1)), vec![f("a.txt"), d("d"), f("dd.txt")]);
        assert_eq!(paths(list_entries(&files, "d", 1)), vec![f("d/b.txt"), d("d/e")]);
        assert_eq!(paths(list_entries(&files, "", 3)), vec![f("a.txt"), d("d"), f("d/b.txt"), d("d/e"), f("d/e/c.txt"), f("dd.txt")]);
        assert_eq!(find(&files, "d"), Found::Dir);
        assert_eq!(find(&files, "d/e/c.txt"), Found::File(7));
        // "d" is a directory, "dd" is not a directory because "dd.txt" starts with "d".
        assert_eq!(find(&files, "dd"), Found::Nothing);
        assert_eq!(find(&files, ""), Found::Dir);
        assert_eq!(list_entries(&files, "d", 1)[0]["size"], "5");
    }
}
