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
use futures::Stream;
use redis::AsyncCommands as _;
use sandq_core::events::{self, Event, EventKind};
use sandq_core::redis_conn::RedisConn;
use sandq_core::results;
use sandq_schemas::{JobResult, JobSpec, JobStatus, NetworkMode, RunMode, Runtime, Sku};
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};

use crate::auth::{note, Caller};
use crate::problem::Problem;
use crate::Gateway;

/// `POST /v1/jobs`'s body: a job as JSON. Unknown fields are refused.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubmitJob {
    /// The job's id within the tenant: `[A-Za-z0-9_-]`, at most 64 minus the tenant's length
    /// plus one. Absent: from the `Idempotency-Key` header when given, else a new UUID.
    #[serde(default)]
    pub job_id: Option<String>,
    /// `python` or `node`.
    pub runtime: Runtime,
    /// The program (UTF-8, at most 1 MiB).
    pub code: String,
    /// `S`, `M`, `L`, `XL`; default `S`.
    #[serde(default)]
    pub sku: Option<Sku>,
    /// Command-line arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Standard input, as text.
    #[serde(default)]
    pub stdin: Option<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Wall-clock limit, humantime (`"60s"`); default 60 s.
    #[serde(default)]
    pub timeout: Option<String>,
    /// How long the result is kept, humantime; default 24 h.
    #[serde(default)]
    pub result_ttl: Option<String>,
    /// `none` (default) or `outbound`.
    #[serde(default)]
    pub network: Option<NetworkMode>,
    /// `notebook` (default) or `script`.
    #[serde(default)]
    pub mode: Option<RunMode>,
    /// A session of this tenant (its files and state carry over between its jobs).
    #[serde(default)]
    pub session: Option<String>,
    /// Latest start, Unix epoch ms: still queued then, the job is not run (`expired`).
    #[serde(default)]
    pub deadline_ms: Option<u64>,
}

/// The queue's job id of a tenant's id, after checking the id's shape and length.
fn job_id_of(caller: &Caller, id: &str) -> Result<String, Problem> {
    let ok = !id.is_empty() && id.len() <= caller.max_id_len() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(caller.scoped(id))
    } else {
        Err(Problem::invalid(format!("job_id {id:?} is not 1 to {} of [A-Za-z0-9_-]", caller.max_id_len())))
    }
}

/// The gateway's record of a job it accepted.
fn accepted_key(gateway: &Gateway, job_id: &str) -> String {
    format!("{}:gateway", gateway.names.job_key(job_id))
}

/// A job's result as the API shows it: the JobResult's JSON with the tenant's ids.
fn view(caller: &Caller, result: &JobResult) -> Value {
    let mut value = serde_json::to_value(result).unwrap_or(Value::Null);
    let prefix = format!("{}_", caller.key.tenant);
    if let Some(object) = value.as_object_mut() {
        if let Some(id) = result.job_id.strip_prefix(&prefix) {
            object.insert("job_id".into(), Value::String(id.to_owned()));
        }
        if let Some(session) = object.get_mut("session").and_then(Value::as_object_mut) {
            if let Some(name) = session.get("name").and_then(Value::as_str).and_then(|n| n.strip_prefix(&prefix)).map(str::to_owned) {
                session.insert("name".into(), Value::String(name));
            }
        }
    }
    value
}

/// Reads a request body: at most `max_body_bytes`, within `read_timeout`.
pub(crate) async fn read_body(gateway: &Gateway, headers: &HeaderMap, body: Body) -> Result<axum::body::Bytes, Problem> {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json")));
    if !json {
        return Err(Problem::media_type());
    }
    let max = gateway.settings.max_body_bytes;
    match tokio::time::timeout(gateway.settings.read_timeout, axum::body::to_bytes(body, max)).await {
        Err(_) => Err(Problem::slow_body(gateway.settings.read_timeout)),
        Ok(Err(_)) => Err(Problem::too_large(max)),
        Ok(Ok(bytes)) => Ok(bytes),
    }
}

/// Decodes a submission and turns it into the queue's job (ids scoped to the tenant).
///
/// # Errors
/// 400 with the decoder's or the validator's message.
pub fn decode(caller: &Caller, headers: &HeaderMap, body: &[u8]) -> Result<JobSpec, Problem> {
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
    spec.submitted_at_ms = Some(sandq_core::time::now_ms());
    if let Some(session) = request.session {
        let ok = !session.is_empty()
            && session.len() <= caller.max_id_len()
            && !session.starts_with('.')
            && session.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if !ok {
            return Err(Problem::invalid(format!(
                "session {session:?} is not 1 to {} of [A-Za-z0-9_.-] not starting with '.'",
                caller.max_id_len()
            )));
        }
        spec.session = Some(caller.scoped(&session));
    }
    Ok(spec)
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
/// when the same id (or `Idempotency-Key`) was submitted before with the same body; 409 when
/// with another body.
pub async fn submit(State(gateway): State<Arc<Gateway>>, caller: Caller, headers: HeaderMap, body: Body) -> Result<Response, Problem> {
    let body = read_body(&gateway, &headers, body).await?;
    let spec = decode(&caller, &headers, &body)?;
    let external = spec.job_id[caller.key.tenant.len() + 1..].to_owned();
    note(caller.audit.as_ref(), |a| a.job_id = Some(external.clone()));
    let quotas = &caller.key.quotas;
    let mut spec = spec;
    let limits = sandq_schemas::Limits::default();
    if spec.timeout.is_none() && limits.default_timeout > quotas.max_timeout {
        // A job that names no timeout gets the key's longest when the default is longer.
        spec.timeout = Some(format!("{}ms", quotas.max_timeout.as_millis()));
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
    let mut redis = gateway.redis.clone();
    let digest = hex_prefix(&Sha256::digest(&body), 64);
    let marker = accepted_key(&gateway, &spec.job_id);
    if let Some(response) = existing(&gateway, &caller, &mut redis, &marker, &spec.job_id, &digest).await? {
        return Ok(response);
    }
    let now = sandq_core::time::now_ms();
    crate::quota::take_rate(&mut redis, &gateway.names, &caller.key.id, quotas.jobs_per_minute, now).await?;
    // In flight at most: the queue's unserved TTL, then the run.
    let max_age = gateway.service.queues.unserved_ttl + valid.timeout + Duration::from_secs(300);
    crate::quota::take_in_flight(&mut redis, &gateway.names, &caller.key.id, &spec.job_id, quotas.max_in_flight, max_age, now).await?;
    // The record outlives the result: the job's whole life, then its result's TTL.
    let ttl = (max_age + valid.result_ttl).as_secs();
    let fresh: bool = redis::cmd("SET")
        .arg(&marker)
        .arg(&digest)
        .arg("NX")
        .arg("EX")
        .arg(ttl)
        .query_async::<Option<String>>(&mut redis)
        .await
        .map(|reply| reply.is_some())
        .map_err(|e| Problem::unavailable(format!("redis: {e}")))?;
    if !fresh {
        // A concurrent request with the same id won.
        crate::quota::release(&mut redis, &gateway.names, &caller.key.id, &spec.job_id).await;
        if let Some(response) = existing(&gateway, &caller, &mut redis, &marker, &spec.job_id, &digest).await? {
            return Ok(response);
        }
    }
    if let Err(e) = gateway.publish(&spec).await {
        // Nothing of the job stays: a retry with the same id submits it again.
        let _: redis::RedisResult<()> = redis.del(&marker).await;
        crate::quota::release(&mut redis, &gateway.names, &caller.key.id, &spec.job_id).await;
        return Err(match e {
            sandq_client::ClientError::Invalid(e) => Problem::invalid(e.to_string()),
            e => Problem::unavailable(format!("the job was not queued: {e}")),
        });
    }
    let mut queued = JobResult::new(spec.job_id.clone(), JobStatus::Queued);
    queued.sku = Some(spec.sku);
    queued.queued_at_ms = spec.submitted_at_ms;
    let location = format!("/v1/jobs/{external}");
    let mut response = (StatusCode::CREATED, Json(view(&caller, &queued))).into_response();
    if let Ok(value) = location.parse() {
        response.headers_mut().insert(header::LOCATION, value);
    }
    Ok(response)
}

/// The answer to a submission whose id the gateway already accepted: the job as it is (200)
/// when the body is the same, 409 when not; `None` when the id is new.
async fn existing(
    gateway: &Gateway,
    caller: &Caller,
    redis: &mut RedisConn,
    marker: &str,
    job_id: &str,
    digest: &str,
) -> Result<Option<Response>, Problem> {
    let stored: Option<String> = redis.get(marker).await.map_err(|e| Problem::unavailable(format!("redis: {e}")))?;
    let Some(stored) = stored else { return Ok(None) };
    if stored != digest {
        return Err(Problem::conflict("this job id was submitted before with another body"));
    }
    let result = results::read(redis, &gateway.names, job_id).await.map_err(|e| Problem::unavailable(e.to_string()))?;
    let result = result.unwrap_or_else(|| JobResult::new(job_id.to_owned(), JobStatus::Queued));
    Ok(Some((StatusCode::OK, Json(view(caller, &result))).into_response()))
}

/// Checks that the gateway accepted `id` for this tenant; returns the queue's job id.
async fn owned(gateway: &Gateway, caller: &Caller, id: &str) -> Result<String, Problem> {
    note(caller.audit.as_ref(), |a| a.job_id = Some(id.to_owned()));
    let job_id = job_id_of(caller, id).map_err(|_| Problem::not_found("job", id))?;
    let mut redis = gateway.redis.clone();
    let known: bool = redis.exists(accepted_key(gateway, &job_id)).await.map_err(|e| Problem::unavailable(format!("redis: {e}")))?;
    if known {
        Ok(job_id)
    } else {
        Err(Problem::not_found("job", id))
    }
}

/// `GET /v1/jobs/{id}`'s query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GetQuery {
    /// Wait up to this long (humantime, at most `gateway.max_wait`) for the job to end.
    #[serde(default)]
    pub wait: Option<String>,
}

/// `GET /v1/jobs/{id}[?wait=30s]`: the job's result (200), as it is now or once it ended
/// within `wait`.
pub async fn get(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<GetQuery>,
) -> Result<Response, Problem> {
    let job_id = owned(&gateway, &caller, &id).await?;
    let wait = match &query.wait {
        None => Duration::ZERO,
        Some(text) => humantime::parse_duration(text)
            .map_err(|e| Problem::invalid(format!("wait {text:?} is not a duration such as \"30s\": {e}")))?,
    }
    .min(gateway.settings.max_wait);
    let mut redis = gateway.redis.clone();
    let read = |redis: &mut RedisConn| {
        let names = gateway.names.clone();
        let job_id = job_id.clone();
        let mut redis = redis.clone();
        async move { results::read(&mut redis, &names, &job_id).await }
    };
    let started = Instant::now();
    let mut blocking: Option<RedisConn> = None;
    loop {
        let result = read(&mut redis).await.map_err(|e| Problem::unavailable(e.to_string()))?;
        let result = result.unwrap_or_else(|| JobResult::new(job_id.clone(), JobStatus::Queued));
        let left = wait.saturating_sub(started.elapsed());
        if result.status.is_terminal() || left.is_zero() {
            return Ok((StatusCode::OK, Json(view(&caller, &result))).into_response());
        }
        // The worker pushes the terminal status onto the job's done list: block on it (a
        // connection of our own), at most a second at a time to see another waiter's pop.
        if blocking.is_none() {
            blocking = Some(gateway.redis_target.connect_blocking().await.map_err(|e| Problem::unavailable(format!("redis: {e}")))?);
        }
        if let Some(connection) = blocking.as_mut() {
            let block = left.min(Duration::from_secs(1)).max(Duration::from_millis(10));
            let popped: redis::RedisResult<Option<(String, String)>> =
                redis::cmd("BLPOP").arg(gateway.names.done_key(&job_id)).arg(block.as_secs_f64()).query_async(connection).await;
            if let Ok(Some((list, status))) = popped {
                // Put it back for other waiters (a direct client's BLPOP); it keeps its TTL.
                let _: redis::RedisResult<()> = redis.lpush(list, status).await;
            } else if popped.is_err() {
                blocking = None;
                tokio::time::sleep(block).await;
            }
        }
    }
}

/// `DELETE /v1/jobs/{id}`: asks for the job to be cancelled (202): a queued job is not run, a
/// running one is killed within about a second. 409 when it is already over.
pub async fn cancel(State(gateway): State<Arc<Gateway>>, caller: Caller, Path(id): Path<String>) -> Result<Response, Problem> {
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
pub struct EventsQuery {
    /// Resume after this event id (as `Last-Event-ID`, which wins when both are sent).
    #[serde(default)]
    pub after: Option<String>,
}

/// Longest `XREAD BLOCK` of an event stream; the job's status is checked after one that
/// returned nothing.
const EVENTS_BLOCK: Duration = Duration::from_secs(5);

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

/// `GET /v1/jobs/{id}/events`: the job's live events as server-sent events, from the first or
/// after `Last-Event-ID` (or `?after=`); the stream ends after `end`, or once the job is over
/// with nothing left to read.
pub async fn events(
    State(gateway): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<EventsQuery>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, Problem> {
    let job_id = owned(&gateway, &caller, &id).await?;
    let cursor = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or(query.after)
        .unwrap_or_else(|| events::START.to_owned());
    if !is_stream_id(&cursor) {
        return Err(Problem::invalid(format!("event id {cursor:?} is not of the form <ms>-<n>")));
    }
    let connection = gateway.redis_target.connect_blocking().await.map_err(|e| Problem::unavailable(format!("redis: {e}")))?;
    struct State {
        gateway: Arc<Gateway>,
        connection: Option<RedisConn>,
        key: String,
        job_id: String,
        cursor: String,
        page: std::collections::VecDeque<Event>,
        done: bool,
    }
    let key = gateway.names.events_key(&job_id);
    let keep_alive = gateway.settings.keep_alive;
    let state = State { gateway, connection: Some(connection), key, job_id, cursor, page: Default::default(), done: false };
    let stream = futures::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(event) = s.page.pop_front() {
                s.cursor.clone_from(&event.id);
                if matches!(event.kind, EventKind::End { .. }) {
                    s.done = true;
                    s.page.clear();
                }
                match sse_event(&event) {
                    Some(sse) => return Some((Ok(sse), s)),
                    None => continue,
                }
            }
            if s.done {
                return None;
            }
            if s.connection.is_none() {
                match s.gateway.redis_target.connect_blocking().await {
                    Ok(c) => s.connection = Some(c),
                    Err(_) => {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                }
            }
            let Some(connection) = s.connection.as_mut() else { continue };
            match events::read(connection, &s.key, &s.cursor, 500, Some(EVENTS_BLOCK)).await {
                Ok(page) if !page.is_empty() => s.page.extend(page),
                Ok(_) => {
                    let mut redis = s.gateway.redis.clone();
                    let terminal =
                        results::status(&mut redis, &s.gateway.names, &s.job_id).await.ok().flatten().is_some_and(JobStatus::is_terminal);
                    if terminal {
                        let rest = events::read(connection, &s.key, &s.cursor, 500, None).await.unwrap_or_default();
                        s.done = rest.is_empty();
                        s.page.extend(rest);
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cannot read live events; retrying");
                    s.connection = None;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    });
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
            let decoded = decode(&caller(&tenant), &HeaderMap::new(), body.as_bytes());
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
            let a = decode(&caller("one"), &headers, body).expect("decodes").job_id;
            let again = decode(&caller("one"), &headers, body).expect("decodes").job_id;
            let b = decode(&caller("two"), &headers, body).expect("decodes").job_id;
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
