//! `/v1/files` and artifacts: inputs uploaded over HTTP, spooled to a temporary file and then
//! streamed to S3 under the tenant's own content address (`inputs/tenant/<tenant>/sha256/<hex>`,
//! [`tenant_input_key`]: two tenants' uploads of the same bytes are two objects, so an upload
//! reveals nothing of other tenants'), and a job's artifacts fetched through a redirect to a
//! presigned URL.
//!
//! An upload is recorded for the key's tenant (`<ns>:tenant:{<tenant>}:file:<sha256>`, the
//! size, for `gateway.file_ttl`): a job may name only files its tenant uploaded, so knowing a
//! file's digest is not enough to have another tenant's file staged.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use redis::AsyncCommands as _;
use sandq_core::storage;
use sandq_schemas::names::tenant_input_key;
use serde_json::json;

use crate::auth::{note, Caller};
use crate::problem::Problem;
use crate::state::Gateway;

/// The tenant's record of an uploaded file.
pub(crate) fn file_key(gateway: &Gateway, tenant: &str, sha256: &str) -> String {
    format!("{}:tenant:{{{tenant}}}:file:{sha256}", gateway.names.namespace())
}

/// A file id: 64 lower-case hex digits (the SHA-256 of its bytes).
pub(crate) fn is_file_id(id: &str) -> bool {
    id.len() == 64 && id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The size of a file the tenant uploaded, `None` when it did not (or the record expired).
///
/// # Errors
/// 503 when Redis fails.
pub(crate) async fn uploaded_size(gateway: &Gateway, tenant: &str, sha256: &str) -> Result<Option<u64>, Problem> {
    let mut redis = gateway.redis.clone();
    redis.get(file_key(gateway, tenant, sha256)).await.map_err(|e| Problem::unavailable(format!("redis: {e}")))
}

/// `POST /v1/files`: the body (any content type) is the file. 201 with `file_id` (its
/// SHA-256), `size`; 413 over the key's `max_upload_bytes`; 408 when no bytes came for
/// `read_timeout`, or not whole within its deadline (`body_timeout` plus its declared length at
/// `min_body_bytes_per_s`); 429 when the key has `max_uploads_per_key` bodies under way. The
/// bytes go through a temporary file (never held in memory).
#[utoipa::path(post, path = "/v1/files", tag = "files", request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "The file's bytes"),
    responses((status = 201, description = "`{\"file_id\", \"size\", \"expires_in_s\"}`", body = serde_json::Value), (status = 413, description = "body-too-large", body = Problem),
        (status = 408, description = "body-timeout: the body did not arrive within its deadline", body = Problem), (status = 429, description = "The key has `max_uploads_per_key` bodies under way", body = Problem)),
    security(("api_key" = [])))]
pub(crate) async fn upload(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Problem> {
    let _permit = gateway.take_upload(&caller.key.id)?;
    let spooled = crate::body::spool(&gateway, &headers, body, caller.key.quotas.max_upload_bytes).await?;
    let (sha256, size) = (spooled.sha256.clone(), spooled.size);
    let key = tenant_input_key(&caller.key.tenant, &sha256);
    let bucket = &gateway.service.s3.bucket;
    let unavailable = |e: storage::TransferError| Problem::unavailable(format!("s3: {e}"));
    // An object of the same size under the tenant's own key is kept (the worker checks the
    // digest of what it stages and removes a wrong one); any other is overwritten. Only the
    // tenant's own uploads are looked at: whether another tenant stored these bytes is never
    // asked, so the answer's time tells nothing about other tenants.
    if storage::object_size(&gateway.s3, bucket, &key).await.map_err(unavailable)? != Some(size) {
        let file = spooled.open().await.map_err(|e| Problem::unavailable(format!("cannot read the upload back: {e}")))?;
        storage::put_file(&gateway.s3, bucket, &key, file, &spooled.shown(), "application/octet-stream").await.map_err(unavailable)?;
    }
    drop(spooled);
    let mut redis = gateway.redis.clone();
    let ttl = gateway.settings.file_ttl.as_secs().max(1);
    let () = redis
        .set_ex(file_key(&gateway, &caller.key.tenant, &sha256), size, ttl)
        .await
        .map_err(|e| Problem::unavailable(format!("redis: {e}")))?;
    note(caller.audit.as_ref(), |a| a.job_id = None);
    Ok((StatusCode::CREATED, Json(json!({"file_id": sha256, "size": size, "expires_in_s": ttl}))).into_response())
}

/// How long an artifact's redirect URL is valid.
const ARTIFACT_URL_TTL: Duration = Duration::from_secs(15 * 60);

/// `GET /v1/jobs/{id}/artifacts/{path}`: 307 to a presigned URL of the artifact the job left
/// at `path` (as in the result's `artifacts`), valid 15 minutes; 404 when it has none there.
#[utoipa::path(get, path = "/v1/jobs/{id}/artifacts/{path}", tag = "jobs",
    params(("id" = String, Path, description = "The job's id"), ("path" = String, Path, description = "The artifact's path, as in the result's `artifacts`")),
    responses((status = 307, description = "Redirect to a presigned URL (15 min)"), (status = 404, description = "not-found", body = Problem)),
    security(("api_key" = [])))]
pub(crate) async fn artifact(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, Problem> {
    let result = owned_result(&gateway, &caller, &id).await?;
    let artifact = result.artifacts.iter().find(|a| a.path == path).ok_or_else(|| Problem::not_found("artifact", &path))?;
    redirect(&gateway, &artifact.key).await
}

/// `GET /v1/jobs/{id}/outputs/{name}`: 307 to a presigned URL of a rich output's stored
/// representation (`output-<i>-<n>.<ext>`, the `artifact.path` of a value in the result's
/// `outputs`: a chart's PNG), valid 15 minutes; 404 when the job has none of that name.
#[utoipa::path(get, path = "/v1/jobs/{id}/outputs/{name}", tag = "jobs",
    params(("id" = String, Path, description = "The job's id"), ("name" = String, Path, description = "The representation's `artifact.path` in the result's `outputs`")),
    responses((status = 307, description = "Redirect to a presigned URL (15 min)"), (status = 404, description = "not-found", body = Problem)),
    security(("api_key" = [])))]
pub(crate) async fn output(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    Path((id, name)): Path<(String, String)>,
) -> Result<Response, Problem> {
    let result = owned_result(&gateway, &caller, &id).await?;
    let stored = result.outputs.iter().flat_map(|o| o.data.values()).filter_map(|v| v.artifact.as_ref()).find(|a| a.path == name);
    let stored = stored.ok_or_else(|| Problem::not_found("output", &name))?;
    redirect(&gateway, &stored.key).await
}

/// `GET /v1/jobs/{id}/logs/{stream}`: 307 to a presigned URL of the job's whole `stdout` or
/// `stderr` as stored (up to the worker's `max_output_bytes`, 8 MiB; the result's `text` holds
/// the first 64 KiB), valid 15 minutes; 404 for an empty stream or another name.
#[utoipa::path(get, path = "/v1/jobs/{id}/logs/{stream}", tag = "jobs",
    params(("id" = String, Path, description = "The job's id"), ("stream" = String, Path, description = "`stdout` or `stderr`")),
    responses((status = 307, description = "Redirect to a presigned URL (15 min)"), (status = 404, description = "not-found", body = Problem)),
    security(("api_key" = [])))]
pub(crate) async fn log(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    Path((id, stream)): Path<(String, String)>,
) -> Result<Response, Problem> {
    let result = owned_result(&gateway, &caller, &id).await?;
    let captured = match stream.as_str() {
        "stdout" => &result.stdout,
        "stderr" => &result.stderr,
        _ => return Err(Problem::not_found("log", &stream)),
    };
    let key = captured.log_key.as_deref().ok_or_else(|| Problem::not_found("log", &stream))?;
    redirect(&gateway, key).await
}

/// The tenant's job `id`'s result; 404 when it has none (yet) or the job is not the tenant's.
async fn owned_result(gateway: &Gateway, caller: &Caller, id: &str) -> Result<sandq_schemas::JobResult, Problem> {
    let job_id = crate::scope::owned(gateway, caller, id).await?;
    let mut redis = gateway.redis.clone();
    let result = sandq_core::results::read(&mut redis, &gateway.names, &job_id).await.map_err(|e| Problem::unavailable(e.to_string()))?;
    result.ok_or_else(|| Problem::not_found("job", id))
}

/// 307 to a presigned GET of `key`, valid [`ARTIFACT_URL_TTL`].
async fn redirect(gateway: &Gateway, key: &str) -> Result<Response, Problem> {
    let url = storage::presign_get(&gateway.s3, &gateway.service.s3.bucket, key, ARTIFACT_URL_TTL)
        .await
        .map_err(|e| Problem::unavailable(format!("s3: {e}")))?;
    let mut response = StatusCode::TEMPORARY_REDIRECT.into_response();
    response.headers_mut().insert(header::LOCATION, url.parse().map_err(|_| Problem::unavailable("the object's URL"))?);
    Ok(response)
}
