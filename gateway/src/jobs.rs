//! `/v1/jobs`: submit a job, read it (waiting if asked), stream its live events, cancel it.
//!
//! A tenant's job `<id>` is the queue's job `<tenant>_<id>`, so tenants cannot collide or
//! reach each other's jobs; the gateway also records which jobs it accepted
//! (`<ns>:job:{<tenant>_<id>}:gateway`, holding the SHA-256 of the submitted body), and a job
//! without that record is a 404 even to a tenant whose prefix it has (a job an operator
//! published directly).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::{Stream, StreamExt as _};
use redis::AsyncCommands as _;
use sandq_core::events::{self, Event, EventKind};
use sandq_core::redis_conn::RedisConn;
use sandq_core::results;
use sandq_schemas::names::tenant_input_key;
use sandq_schemas::{InputFile, JobResult, JobSpec, JobStatus, NetworkMode, RunMode, Runtime, Sku};
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};

use crate::auth::{note, Caller};
use crate::problem::Problem;
use crate::scope::{accepted_key, job_id_of, owned, view_for_tenant, Accepted};
use crate::state::{Gateway, StreamPermit};

/// `POST /v1/jobs`'s body: a job as JSON. Unknown fields are refused.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct SubmitJob {
    /// The job's id within the tenant: `[A-Za-z0-9_-]`, at most 64 minus the tenant's length
    /// plus one. Absent: from the `Idempotency-Key` header when given, else a new UUID.
    #[serde(default)]
    pub(crate) job_id: Option<String>,
    /// `python` or `node`.
    #[schema(value_type = String, example = "python")]
    pub(crate) runtime: Runtime,
    /// The program (UTF-8, at most 1 MiB).
    pub(crate) code: String,
    /// `S`, `M`, `L`, `XL`; default `S`.
    #[serde(default)]
    #[schema(value_type = Option<String>, example = "M")]
    pub(crate) sku: Option<Sku>,
    /// Command-line arguments.
    #[serde(default)]
    pub(crate) args: Vec<String>,
    /// Standard input, as text.
    #[serde(default)]
    pub(crate) stdin: Option<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub(crate) env: BTreeMap<String, String>,
    /// Wall-clock limit, humantime (`"60s"`); default 60 s.
    #[serde(default)]
    pub(crate) timeout: Option<String>,
    /// How long the result is kept, humantime; default 24 h.
    #[serde(default)]
    pub(crate) result_ttl: Option<String>,
    /// `none` (default) or `outbound`.
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub(crate) network: Option<NetworkMode>,
    /// `notebook` (default) or `script`.
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub(crate) mode: Option<RunMode>,
    /// A session of this tenant (its files and state carry over between its jobs).
    #[serde(default)]
    pub(crate) session: Option<String>,
    /// Latest start, Unix epoch ms: still queued then, the job is not run (`expired`).
    #[serde(default)]
    pub(crate) deadline_ms: Option<u64>,
    /// Files this tenant uploaded (`POST /v1/files`), staged into `/work` before the program.
    #[serde(default)]
    pub(crate) inputs: Vec<InputRef>,
    /// Where the terminal result is POSTed, signed (docs/gateway.md "Webhooks"); its host
    /// must be one of the key's `webhook_hosts`.
    #[serde(default)]
    pub(crate) callback_url: Option<String>,
    /// `e2b`: run as E2B's code interpreter would (working directory `/home/user`, the same
    /// directory as `/work`; `Image.save` displays): docs/e2b.md.
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub(crate) compat: Option<sandq_schemas::Compat>,
    /// A named notebook state within `session` (E2B's contexts): its own variables and cell
    /// count, the session's files (docs/protocol.md "Sessions").
    #[serde(default)]
    pub(crate) context: Option<String>,
    /// `typescript` (with runtime `node`, notebook mode): the code's types are stripped before
    /// it runs.
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub(crate) dialect: Option<sandq_schemas::Dialect>,
}

/// One input of a job: an uploaded file and where it goes.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct InputRef {
    /// The file's id from `POST /v1/files`.
    pub(crate) file_id: String,
    /// Its path under `/work` (relative, no `..`).
    pub(crate) path: String,
}

/// A job's result as the API shows it: the JobResult's JSON with the tenant's ids.
fn view(caller: &Caller, result: &JobResult) -> Value {
    view_for_tenant(&caller.key.tenant, result)
}

/// Decodes a submission and turns it into the queue's job (ids scoped to the tenant).
///
/// # Errors
/// 400 with the decoder's or the validator's message.
pub(crate) fn decode(caller: &Caller, headers: &HeaderMap, body: &[u8]) -> Result<(JobSpec, Option<String>), Problem> {
    let request: SubmitJob = serde_json::from_slice(body).map_err(|e| Problem::invalid(format!("the body is not a job: {e}")))?;
    let idempotency = headers.get("idempotency-key").map(|v| v.as_bytes());
    let id = match (&request.job_id, idempotency) {
        (Some(id), _) => id.clone(),
        (None, Some(key)) if !key.is_empty() && key.len() <= 255 => {
            // The same key gives the same job id, so a retried POST finds the first job.
            hex_prefix(&Sha256::digest([caller.key.tenant.as_bytes(), b"\0", key].concat()), 32)
        }
        (None, Some(_)) => return Err(Problem::invalid("Idempotency-Key must be 1 to 255 bytes")),
        (None, None) => uuid::Uuid::new_v4().simple().to_string(),
    };
    let job_id = job_id_of(caller, &id)?;
    let mut spec = JobSpec::new(job_id, request.sku.unwrap_or(Sku::S), request.runtime, request.code);
    spec.args = request.args;
    spec.stdin = request.stdin.map(String::into_bytes);
    spec.env = request.env;
    spec.timeout = request.timeout;
    spec.result_ttl = request.result_ttl;
    spec.network = request.network.unwrap_or_default();
    spec.mode = request.mode;
    spec.deadline_ms = request.deadline_ms;
    spec.compat = request.compat;
    spec.context = request.context;
    spec.dialect = request.dialect;
    // Sizes are filled in from the tenant's records by `submit` (0 until then).
    for input in request.inputs {
        if !crate::files::is_file_id(&input.file_id) {
            return Err(Problem::invalid(format!("file_id {:?} is not 64 lower-case hex digits", input.file_id)));
        }
        // The tenant's own copy (`POST /v1/files` stores uploads per tenant).
        spec.inputs.push(InputFile {
            key: tenant_input_key(&caller.key.tenant, &input.file_id),
            path: input.path,
            size: 0,
            sha256: input.file_id,
        });
    }
    spec.submitted_at_ms = Some(sandq_core::time::now_ms());
    if let Some(session) = request.session {
        spec.session = Some(crate::sessions::session_of(caller, &session)?);
    }
    Ok((spec, request.callback_url))
}

fn hex_prefix(bytes: &[u8], len: usize) -> String {
    let mut hex = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        hex.push_str(&format!("{b:02x}"));
    }
    hex.truncate(len);
    hex
}

/// `POST /v1/jobs`: 201 with the job (`queued`) and its `Location`; 200 with the job as it is
/// when the same id (or `Idempotency-Key`) was submitted before with the same body, 410
/// `result-expired` when that job's result has expired (it is not run again); 409 when with
/// another body.
#[utoipa::path(post, path = "/v1/jobs", tag = "jobs", request_body = SubmitJob,
    params(("Idempotency-Key" = Option<String>, Header, description = "Makes a retry safe: the same key and body find the first job")),
    responses(
        (status = 201, description = "Queued: the job (a JobResult, docs/protocol.md) with `Location`", body = serde_json::Value),
        (status = 200, description = "This id or Idempotency-Key was submitted before with the same body: the job as it is (never run again)", body = serde_json::Value),
        (status = 410, description = "result-expired: this id and body were run before and the job's result has expired; it is not run again", body = Problem),
        (status = 400, description = "invalid-request", body = Problem), (status = 403, description = "forbidden-by-quota", body = Problem),
        (status = 409, description = "conflict", body = Problem), (status = 413, description = "body-too-large", body = Problem),
        (status = 415, description = "unsupported-media-type", body = Problem), (status = 429, description = "quota-exceeded", body = Problem),
        (status = 503, description = "unavailable", body = Problem)),
    security(("api_key" = [])))]
pub(crate) async fn submit(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Problem> {
    let body = crate::body::read_json(&gateway, &caller, &headers, body).await?;
    let (spec, callback_url) = decode(&caller, &headers, &body)?;
    let external = spec.job_id[caller.key.tenant.len() + 1..].to_owned();
    note(caller.audit.as_ref(), |a| a.job_id = Some(external.clone()));
    let quotas = &caller.key.quotas;
    let mut spec = spec;
    let limits = sandq_schemas::Limits::default();
    if spec.timeout.is_none() && limits.default_timeout > quotas.max_timeout {
        // A job that names no timeout gets the key's longest when the default is longer.
        spec.timeout = Some(format!("{}ms", quotas.max_timeout.as_millis()));
    }
    for input in &mut spec.inputs {
        input.size = crate::files::uploaded_size(&gateway, &caller.key.tenant, &input.sha256).await?.ok_or_else(|| {
            Problem::invalid(format!(
                "file_id {:?} (for {:?}) was not uploaded with this tenant's keys, or has expired",
                input.sha256, input.path
            ))
        })?;
    }
    let valid = spec.clone().validate(&limits).map_err(|e| Problem::invalid(e.to_string()))?;
    if spec.sku > quotas.max_sku {
        return Err(Problem::forbidden(format!("SKU {:?} is larger than this key's largest, {:?}", spec.sku, quotas.max_sku)));
    }
    if valid.timeout > quotas.max_timeout {
        return Err(Problem::forbidden(format!(
            "timeout {} is longer than this key's longest, {}",
            humantime::format_duration(valid.timeout),
            humantime::format_duration(quotas.max_timeout)
        )));
    }
    if spec.network == NetworkMode::Outbound && !quotas.network {
        return Err(Problem::forbidden("this key may not use network \"outbound\""));
    }
    if let Some(url) = &callback_url {
        if caller.key.webhook_secret.is_empty() {
            return Err(Problem::forbidden("this key has no webhook secret (made before webhooks): create a new key"));
        }
        let target = crate::webhooks::check_url(url, &quotas.webhook_hosts).map_err(|e| match e {
            crate::webhooks::UrlError::Host(_) => Problem::forbidden(e.to_string()),
            e => Problem::invalid(e.to_string()),
        })?;
        // Checked now for a clear answer, and again at each delivery (DNS may change).
        crate::webhooks::resolve(&target, gateway.settings.webhook_allow_private).await.map_err(|e| Problem::invalid(e.to_string()))?;
    }
    if let Some(session) = &spec.session {
        crate::sessions::register(&gateway, &caller, &session[caller.key.tenant.len() + 1..]).await?;
    }
    let digest = hex_prefix(&Sha256::digest(&body), 64);
    // The whole acceptance runs on a task of its own: a client that disconnects (or a shutdown)
    // cannot stop it between claiming the id and publishing the job.
    let task = tokio::spawn(accept(gateway.clone(), caller.clone(), spec, valid, digest, callback_url));
    let (status, result) = task.await.map_err(|_| Problem::unavailable("the submission failed"))??;
    let mut response = (status, Json(view(&caller, &result))).into_response();
    if let Ok(value) = format!("/v1/jobs/{external}").parse() {
        response.headers_mut().insert(header::LOCATION, value);
    }
    Ok(response)
}

/// What [`CLAIM_SCRIPT`] found.
const CLAIM_NEW: i64 = 0;
const CLAIM_SAME_PUBLISHED: i64 = 1;
const CLAIM_SAME_PENDING: i64 = 2;
const CLAIM_OTHER_BODY: i64 = 3;
const CLAIM_TAKEN: i64 = 4;
const CLAIM_SAME_UNKNOWN: i64 = 5;

/// Claims a job id for the gateway: `KEYS[1]` the marker, `KEYS[2]` the job's hash; `ARGV[1]`
/// the body's digest, `ARGV[2]` the marker's TTL (s). The marker holds `pending:<digest>`
/// until the quotas passed, then `unknown:<digest>` until the publish is confirmed, then
/// `published:<digest>` ([`crate::scope::Accepted`]; a bare `<digest>` is an older gateway's
/// `unknown`). An id whose job exists without a marker (an operator's job) is never claimed.
const CLAIM_SCRIPT: &str = r"
local stored = redis.call('GET', KEYS[1])
if not stored then
  if redis.call('EXISTS', KEYS[2]) == 1 then return 4 end
  redis.call('SET', KEYS[1], 'pending:' .. ARGV[1], 'EX', ARGV[2])
  return 0
end
if stored == 'published:' .. ARGV[1] then return 1 end
if stored == 'pending:' .. ARGV[1] then return 2 end
if stored == 'unknown:' .. ARGV[1] or stored == ARGV[1] then return 5 end
return 3
";

/// Longest wait for a free publisher before the submission is refused (503, nothing kept).
const PUBLISHER_WAIT: Duration = Duration::from_secs(10);

/// Claims the id, takes the quotas, publishes. Every refusal before the publish undoes what it
/// took (marker, counts). A publish whose outcome is unknown (no confirm, the `queued` write
/// failed) keeps them and leaves the marker `unknown`: a retry with the same id and body
/// publishes the same job again (harmless: one result) without counting it again. A
/// confirmed publish makes the marker `published`, after which the same id and body are never
/// published again: a retry reads the job, or its expired state once its result is gone
/// (test: tenant::idempotency::an_expired_job_is_not_run_again_nor_counted).
async fn accept(
    gateway: Arc<Gateway>,
    caller: Caller,
    spec: JobSpec,
    valid: sandq_schemas::ValidJob,
    digest: String,
    callback_url: Option<String>,
) -> Result<(StatusCode, JobResult), Problem> {
    let unavailable = |e: &dyn std::fmt::Display| Problem::unavailable(format!("redis: {e}"));
    let mut redis = gateway.redis.clone();
    let quotas = &caller.key.quotas;
    let marker = accepted_key(&gateway, &spec.job_id);
    // In flight at most: the queue's unserved TTL, then the longest run the key may ask for.
    let unserved = gateway.service.queues.unserved_ttl;
    let max_age = (!unserved.is_zero()).then(|| unserved + quotas.max_timeout + results::LIVE_GRACE);
    // The marker outlives the result: the job's whole life, then its result's TTL. Within it,
    // the id runs at most once (its idempotency window, docs/gateway.md).
    let ttl = (max_age.unwrap_or(results::UNLIMITED_WAIT) + valid.result_ttl).as_secs();
    let claim: i64 = sandq_core::redis_conn::Script::new(CLAIM_SCRIPT)
        .key(&marker)
        .key(gateway.names.job_key(&spec.job_id))
        .arg(&digest)
        .arg(ttl)
        .invoke_async(&mut redis)
        .await
        .map_err(|e| unavailable(&e))?;
    match claim {
        CLAIM_NEW => {}
        CLAIM_SAME_PUBLISHED => {
            // Queued for sure, so it has a record until its result expires: none is its end.
            let result = results::read(&mut redis, &gateway.names, &spec.job_id).await.map_err(|e| unavailable(&e))?;
            return match result {
                Some(result) => Ok((StatusCode::OK, result)),
                None => Err(Problem::result_expired(&spec.job_id[caller.key.tenant.len() + 1..])),
            };
        }
        CLAIM_SAME_UNKNOWN => {
            let result = results::read(&mut redis, &gateway.names, &spec.job_id).await.map_err(|e| unavailable(&e))?;
            if let Some(result) = result {
                // A record: the job reached a queue (a worker, or our `queued` write, wrote it).
                mark_published(&gateway, &marker, &digest).await;
                return Ok((StatusCode::OK, result));
            }
            // Its publish's outcome was unknown: publish it again. Not counted again: the
            // first claim of this id took its rate and in-flight quotas, and kept them.
            publish(&gateway, &spec).await.map_err(|(problem, _)| problem)?;
            mark_published(&gateway, &marker, &digest).await;
            return Ok((StatusCode::OK, queued(&spec)));
        }
        CLAIM_SAME_PENDING => return Err(Problem::conflict("a request with this job id is being handled; retry").retry_after(1)),
        CLAIM_OTHER_BODY => return Err(Problem::conflict("this job id was submitted before with another body")),
        CLAIM_TAKEN => return Err(Problem::conflict("this job id is taken")),
        other => return Err(Problem::unavailable(format!("the claim script answered {other}"))),
    }
    let now = sandq_core::time::now_ms();
    let key_id = &caller.key.id;
    let refused = |problem: Problem, rate: bool, in_flight: bool| {
        let (gateway, mut redis, marker, job_id, key_id) =
            (gateway.clone(), gateway.redis.clone(), marker.clone(), spec.job_id.clone(), key_id.clone());
        async move {
            let _: redis::RedisResult<()> = redis.del(&marker).await;
            if rate {
                crate::quota::give_back_rate(&mut redis, &gateway.names, &key_id, now).await;
            }
            if in_flight {
                crate::quota::release(&mut redis, &gateway.names, &key_id, &job_id).await;
            }
            problem
        }
    };
    if let Err(problem) = crate::quota::take_rate(&mut redis, &gateway.names, key_id, quotas.jobs_per_minute, now).await {
        return Err(refused(problem, false, false).await);
    }
    if let Err(problem) =
        crate::quota::take_in_flight(&mut redis, &gateway.names, key_id, &spec.job_id, quotas.max_in_flight, max_age, now).await
    {
        return Err(refused(problem, true, false).await);
    }
    // From here the job is counted: a retry of an unknown publish publishes without counting.
    let counted: redis::RedisResult<()> =
        redis::cmd("SET").arg(&marker).arg(format!("{}{digest}", crate::scope::UNKNOWN)).arg("KEEPTTL").query_async(&mut redis).await;
    if let Err(e) = counted {
        return Err(refused(unavailable(&e), true, true).await);
    }
    // The webhook is recorded before the publish: a job that is queued always has it.
    if let Some(url) = &callback_url {
        if let Err(problem) = crate::webhooks::schedule(&gateway, &spec.job_id, key_id, url).await {
            return Err(refused(problem, true, true).await);
        }
    }
    match publish(&gateway, &spec).await {
        Ok(()) => {
            mark_published(&gateway, &marker, &digest).await;
            Ok((StatusCode::CREATED, queued(&spec)))
        }
        Err((problem, true)) => {
            if callback_url.is_some() {
                crate::webhooks::unschedule(&gateway, &spec.job_id).await;
            }
            Err(refused(problem, true, true).await)
        }
        Err((problem, false)) => Err(problem),
    }
}

/// Moves a marker to `published` once the job is certainly queued (its publish confirmed and
/// its `queued` written, or a record of it seen). Best effort: a marker left `unknown` costs
/// at most a harmless re-publish of a job that has a record, and is moved on at the next
/// retry that finds the record.
async fn mark_published(gateway: &Gateway, marker: &str, digest: &str) {
    let mut redis = gateway.redis.clone();
    let set: redis::RedisResult<()> = redis::cmd("SET")
        .arg(marker)
        .arg(format!("{}{digest}", crate::scope::PUBLISHED))
        .arg("XX")
        .arg("KEEPTTL")
        .query_async(&mut redis)
        .await;
    if let Err(e) = set {
        tracing::warn!(error = %e, marker, "cannot record the job as published; it stays unknown");
    }
}

/// A job as it is right after its publish.
fn queued(spec: &JobSpec) -> JobResult {
    let mut queued = JobResult::new(spec.job_id.clone(), JobStatus::Queued);
    queued.sku = Some(spec.sku);
    queued.queued_at_ms = spec.submitted_at_ms;
    queued
}

/// Publishes a job; on failure, the problem and whether the job is certainly not queued.
/// The job is first recorded as its tenant's queued job of its SKU (`sandq_core::fair`: what
/// gives a tenant with nothing running the next free slot), and forgotten again when it is
/// certainly not queued; a record that fails or outlives its job only skews the fair share
/// until it expires, so neither stops the publish.
async fn publish(gateway: &Gateway, spec: &JobSpec) -> Result<(), (Problem, bool)> {
    use sandq_client::ClientError;
    let mut redis = gateway.redis.clone();
    let until = sandq_core::fair::queued_until(gateway.service.queues.unserved_ttl, sandq_core::time::now_ms());
    if let Err(e) = sandq_core::fair::queued(&mut redis, &gateway.names, spec.sku, &spec.job_id, until).await {
        tracing::warn!(error = %e, job_id = %spec.job_id, "cannot record the job for the tenants' fair share");
    }
    let published = gateway.publish(spec, PUBLISHER_WAIT).await;
    if matches!(published, Err(None | Some(ClientError::Invalid(_) | ClientError::NotAccepted { .. }))) {
        let _ = sandq_core::fair::not_queued(&mut redis, &gateway.names, spec.sku, &spec.job_id).await;
    }
    match published {
        Ok(()) => Ok(()),
        Err(None) => Err((Problem::unavailable("every publisher is busy; retry"), true)),
        Err(Some(ClientError::Invalid(e))) => Err((Problem::invalid(e.to_string()), true)),
        Err(Some(e @ ClientError::NotAccepted { .. })) => Err((Problem::unavailable(format!("the job was not queued: {e}")), true)),
        Err(Some(e)) => {
            tracing::warn!(error = %e, job_id = %spec.job_id, "the publish's outcome is unknown");
            Err((Problem::unavailable("the job may or may not be queued: retry with the same job_id or Idempotency-Key"), false))
        }
    }
}

/// `GET /v1/jobs/{id}`'s query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct GetQuery {
    /// Wait up to this long (humantime, at most `gateway.max_wait`) for the job to end.
    #[serde(default)]
    pub(crate) wait: Option<String>,
}

/// How often a `?wait=` re-reads the job's status.
const WAIT_POLL: Duration = Duration::from_millis(100);

/// A query string that does not decode is a 400 problem like a bad body.
fn query<T>(query: Result<Query<T>, axum::extract::rejection::QueryRejection>) -> Result<T, Problem> {
    query.map(|Query(q)| q).map_err(|e| Problem::invalid(format!("the query string: {}", e.body_text())))
}

/// `GET /v1/jobs/{id}[?wait=30s]`: the job's result (200), as it is now or once it ended
/// within `wait`; 401 when the key is revoked while it waits; 410 `result-expired` once it ended and
/// its result expired.
#[utoipa::path(get, path = "/v1/jobs/{id}", tag = "jobs",
    params(("id" = String, Path, description = "The job's id"), ("wait" = Option<String>, Query, description = "Wait up to this long (humantime, at most `max_wait`) for the job to end")),
    responses((status = 200, description = "The job: a JobResult (docs/protocol.md)", body = serde_json::Value), (status = 404, description = "not-found", body = Problem),
        (status = 401, description = "unauthorized: the key was revoked while the request waited", body = Problem),
        (status = 410, description = "result-expired: the job ended and its result is no longer kept (result_ttl)", body = Problem)),
    security(("api_key" = [])))]
pub(crate) async fn get(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
    q: Result<Query<GetQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let q = query(q)?;
    let job_id = owned(&gateway, &caller, &id).await?;
    let wait = match &q.wait {
        None => Duration::ZERO,
        Some(text) => humantime::parse_duration(text)
            .map_err(|e| Problem::invalid(format!("wait {text:?} is not a duration such as \"30s\": {e}")))?,
    }
    .min(gateway.settings.max_wait);
    let mut redis = gateway.redis.clone();
    let started = Instant::now();
    let mut _permit = None;
    // A wait ends (401) once its key is revoked, within about `revocation_check`.
    let mut revoked = std::pin::pin!(gateway.revoked(&caller.key.id));
    loop {
        let result = results::read(&mut redis, &gateway.names, &job_id).await.map_err(|e| Problem::unavailable(e.to_string()))?;
        let result = match result {
            Some(result) => result,
            // A job certainly queued has a record until its result expires: it ended.
            None if crate::scope::accepted(&gateway, &job_id).await? == Some(Accepted::Published) => {
                return Err(Problem::result_expired(&id));
            }
            // Not (yet) known to be queued: its publish may still be under way or retried.
            None => JobResult::new(job_id.clone(), JobStatus::Queued),
        };
        if result.status.is_terminal() || started.elapsed() >= wait {
            return Ok((StatusCode::OK, Json(view(&caller, &result))).into_response());
        }
        if _permit.is_none() {
            _permit = Some(gateway.take_stream(&caller.key.id)?);
        }
        // The status (a small script) is polled; the result is read again once it is over.
        loop {
            tokio::select! {
                () = tokio::time::sleep(WAIT_POLL) => {}
                () = &mut revoked => return Err(Problem::unauthorized()),
            }
            let status = results::status(&mut redis, &gateway.names, &job_id).await.map_err(|e| Problem::unavailable(e.to_string()))?;
            // No status: its result just expired (or it is not yet queued): read again.
            if status.is_none_or(JobStatus::is_terminal) || started.elapsed() >= wait {
                break;
            }
        }
    }
}

/// `DELETE /v1/jobs/{id}`: asks for the job to be cancelled (202): a queued job is not run, a
/// running one is killed within about a second. 409 when it is already over.
#[utoipa::path(delete, path = "/v1/jobs/{id}", tag = "jobs", params(("id" = String, Path, description = "The job's id")),
    responses((status = 202, description = "Cancellation requested", body = serde_json::Value), (status = 404, description = "not-found", body = Problem),
        (status = 409, description = "The job is over", body = Problem)),
    security(("api_key" = [])))]
pub(crate) async fn cancel(State(gateway): State<Arc<Gateway>>, caller: Caller, Path(id): Path<String>) -> Result<Response, Problem> {
    let job_id = owned(&gateway, &caller, &id).await?;
    let mut redis = gateway.redis.clone();
    let requested = results::request_cancel(&mut redis, &gateway.names, &job_id, Duration::from_secs(7 * 24 * 3600))
        .await
        .map_err(|e| Problem::unavailable(e.to_string()))?;
    if requested {
        Ok((StatusCode::ACCEPTED, Json(json!({"job_id": id, "cancel_requested": true}))).into_response())
    } else {
        Err(Problem::conflict(format!("job {id:?} is already over (or not yet queued)")))
    }
}

/// `GET /v1/jobs/{id}/events`'s query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct EventsQuery {
    /// Resume after this event id (as `Last-Event-ID`, which wins when both are sent).
    #[serde(default)]
    pub(crate) after: Option<String>,
}

/// An event's SSE form: `event:` its type, `id:` its stream id, `data:` JSON with `attempt`,
/// `seq` and its own fields (docs/gateway.md).
fn sse_event(event: &Event) -> Option<SseEvent> {
    let (kind, mut data) = match &event.kind {
        EventKind::Attempt { attempt_id } => ("attempt", json!({"attempt_id": attempt_id})),
        EventKind::Started { warm } => ("started", json!({"warm": warm})),
        EventKind::Finished { exit_code } => ("finished", json!({"exit_code": exit_code})),
        EventKind::Requeued { reason } => ("requeued", json!({"reason": reason})),
        EventKind::Stdout(text) => ("stdout", json!({"text": text})),
        EventKind::Stderr(text) => ("stderr", json!({"text": text})),
        EventKind::Display { index, output } => ("display", json!({"index": index, "output": output})),
        EventKind::Truncated { stream, limit } => ("truncated", json!({"stream": stream, "limit": limit})),
        EventKind::End { status } => ("end", json!({"status": status})),
        EventKind::Other { .. } => return None,
    };
    if let Some(object) = data.as_object_mut() {
        object.insert("attempt".into(), json!(event.attempt));
        object.insert("seq".into(), json!(event.seq));
    }
    Some(SseEvent::default().event(kind).id(event.id.clone()).data(data.to_string()))
}

/// A stream id (`<ms>-<n>`), the only cursor shape accepted.
fn is_stream_id(cursor: &str) -> bool {
    cursor.split_once('-').is_some_and(|(ms, n)| {
        !ms.is_empty()
            && !n.is_empty()
            && ms.len() <= 20
            && n.len() <= 20
            && ms.bytes().all(|b| b.is_ascii_digit())
            && n.bytes().all(|b| b.is_ascii_digit())
    })
}

/// A job's live events as [`events::follow`] reads them for `GET /v1/jobs/{id}/events`: on a
/// blocking connection of the stream's own (made again after a failure), holding one of the
/// key's open streams while it lasts.
struct JobEvents {
    _permit: StreamPermit,
    gateway: Arc<Gateway>,
    connection: Option<RedisConn>,
    key: String,
    job_id: String,
}

impl events::Pages for JobEvents {
    async fn page(&mut self, cursor: &str, block: Option<Duration>) -> Option<Vec<Event>> {
        if self.connection.is_none() {
            self.connection = Some(self.gateway.redis_target.connect_blocking().await.ok()?);
        }
        let connection = self.connection.as_mut()?;
        match events::read(connection, &self.key, cursor, 500, block).await {
            Ok(page) => Some(page),
            Err(e) => {
                tracing::debug!(error = %e, "cannot read live events; retrying");
                self.connection = None;
                None
            }
        }
    }

    /// A job that is over, or whose result expired (no status).
    async fn over(&mut self) -> bool {
        let mut redis = self.gateway.redis.clone();
        match results::status(&mut redis, &self.gateway.names, &self.job_id).await {
            Ok(status) => status.is_none_or(JobStatus::is_terminal),
            Err(_) => false,
        }
    }
}

/// `GET /v1/jobs/{id}/events`: the job's live events as server-sent events, from the first or
/// after `Last-Event-ID` (or `?after=`); the stream ends after `end`, or once the job is over
/// with nothing left to read, or once the key is revoked (within `revocation_check`).
#[utoipa::path(get, path = "/v1/jobs/{id}/events", tag = "jobs",
    params(("id" = String, Path, description = "The job's id"), ("after" = Option<String>, Query, description = "Resume after this event id"),
        ("Last-Event-ID" = Option<String>, Header, description = "Resume after this event id (wins over `after`)")),
    responses((status = 200, description = "Server-sent events: attempt, started, stdout, stderr, display, truncated, finished, requeued, end (docs/gateway.md)", content_type = "text/event-stream", body = String),
        (status = 404, description = "not-found", body = Problem), (status = 429, description = "Too many open streams for the key", body = Problem)),
    security(("api_key" = [])))]
pub(crate) async fn events(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
    q: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, Problem> {
    let q = query(q)?;
    let job_id = owned(&gateway, &caller, &id).await?;
    let cursor = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or(q.after)
        .unwrap_or_else(|| events::START.to_owned());
    if !is_stream_id(&cursor) {
        return Err(Problem::invalid(format!("event id {cursor:?} is not of the form <ms>-<n>")));
    }
    let permit = gateway.take_stream(&caller.key.id)?;
    let connection = gateway.redis_target.connect_blocking().await.map_err(|e| Problem::unavailable(format!("redis: {e}")))?;
    let key = gateway.names.events_key(&job_id);
    let keep_alive = gateway.settings.keep_alive;
    let until = Instant::now() + gateway.settings.max_stream_life;
    // The stream ends once its key is revoked, within about `revocation_check`.
    let revoked = gateway.revoked(&caller.key.id);
    let pages = JobEvents { _permit: permit, gateway, connection: Some(connection), key, job_id };
    let stream = events::follow(pages, &cursor, Duration::from_secs(1), Some(until))
        .take_until(revoked)
        .filter_map(|event| std::future::ready(sse_event(&event).map(Ok)));
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(keep_alive)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn caller(tenant: &str) -> Caller {
        let key = sandq_core::keys::KeyRecord {
            id: "abcdefghij12".into(),
            tenant: tenant.into(),
            name: String::new(),
            sha256: String::new(),
            created_at_ms: 0,
            revoked_at_ms: None,
            quotas: Default::default(),
            webhook_secret: String::new(),
        };
        Caller { key, audit: None }
    }

    proptest! {
        #[test]
        fn any_body_decodes_or_is_a_400(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Err(problem) = decode(&caller("t"), &HeaderMap::new(), &body) {
                prop_assert_eq!(problem.status, 400);
            }
        }

        #[test]
        fn a_job_id_is_accepted_exactly_when_the_queue_would_take_it_scoped(tenant in "[a-z0-9]{1,23}", id in "\\PC{0,70}") {
            let body = json!({"runtime": "python", "code": "1", "job_id": id}).to_string();
            let decoded = decode(&caller(&tenant), &HeaderMap::new(), body.as_bytes()).map(|(spec, _)| spec);
            let shape = !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            let fits = id.len() + tenant.len() < 64;
            prop_assert_eq!(decoded.is_ok(), shape && fits);
            if let Ok(spec) = decoded {
                prop_assert_eq!(&spec.job_id, &format!("{tenant}_{id}"));
                prop_assert!(sandq_schemas::validate::check_job_id(&spec.job_id).is_ok());
            }
        }

        #[test]
        fn the_same_idempotency_key_gives_the_same_id_and_tenants_differ(key in "[ -~]{1,100}") {
            let mut headers = HeaderMap::new();
            headers.insert("idempotency-key", key.parse().expect("printable"));
            let body = br#"{"runtime": "python", "code": "1"}"#;
            let a = decode(&caller("one"), &headers, body).expect("decodes").0.job_id;
            let again = decode(&caller("one"), &headers, body).expect("decodes").0.job_id;
            let b = decode(&caller("two"), &headers, body).expect("decodes").0.job_id;
            prop_assert_eq!(&a, &again);
            prop_assert_ne!(&a["one_".len()..], &b["two_".len()..]);
        }
    }

    #[test]
    fn stream_ids_are_two_decimal_numbers() {
        for good in ["0-0", "1733150000000-0", "1-12"] {
            assert!(is_stream_id(good), "{good}");
        }
        for bad in ["", "0", "-1", "1-", "a-1", "1-1-1", "$", ">", "1 -1", "+", &format!("{}-0", "9".repeat(21))] {
            assert!(!is_stream_id(bad), "{bad}");
        }
    }
}
