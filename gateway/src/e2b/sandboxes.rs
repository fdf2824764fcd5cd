//! The control plane: create, info, list, timeout, connect and kill a sandbox (an E2B sandbox
//! is a session of the key's tenant with a record), and the sandbox plane's `GET /health`.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::Path;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use redis::AsyncCommands as _;
use serde::Deserialize;
use serde_json::{json, Value};

use super::record::{default_contexts, due_key, job_key, record_key, tenant_key, Record};
use super::state::{body_json, caller_or_401, e2b_error, e2b_key, now_ms, rest_error, rfc3339, target, E2b, Refused};
use crate::auth::Caller;

/// envd's port (`ConnectionConfig.envd_port` in E2B's SDKs).
const ENVD_PORT: u16 = 49983;
/// The envd version sandboxes report: 0.4.0 or later sends no default-user header, 0.5.7 or
/// later uploads as octet-stream (`e2b/envd/versions.py`).
const ENVD_VERSION: &str = "0.5.7";
/// A sandbox's lifetime when create names none: E2B's documented default, seconds.
const DEFAULT_TIMEOUT_S: u64 = 300;
/// The longest lifetime a sandbox is given at once, seconds: the workers' default session idle
/// timeout (30 min), so that a sandbox left alone is not outlived by its files' deletion.
const MAX_TIMEOUT_S: u64 = 30 * 60;
/// A sandbox's `metadata` and `envVars` each: at most this many entries, of this many bytes in
/// all (the record is read again every second while a cell runs).
const MAX_MAP_ENTRIES: usize = 64;
const MAX_MAP_BYTES: usize = 64 << 10;

/// The create body (E2B's `NewSandbox` / `NewSandboxV2`); fields sandq has no use for are
/// ignored (`secure`, `autoPause`, `network`, `mcp`, `volumeMounts`).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID", default)]
    template_id: Option<String>,
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
}

/// The SKU a template names: `sandq-S`, `sandq-M`, `sandq-L`, `sandq-XL`; any other template
/// (E2B's `code-interpreter-v1`, `base`) runs on S.
fn sku_of(template: &str) -> &'static str {
    match template.strip_prefix("sandq-") {
        Some("M") => "M",
        Some("L") => "L",
        Some("XL") => "XL",
        _ => "S",
    }
}

/// CPUs and memory (MiB) of a SKU (the brief's table).
fn size_of(sku: &str) -> (u32, u32) {
    match sku {
        "M" => (2, 4096),
        "L" => (4, 8192),
        "XL" => (8, 16384),
        _ => (1, 2048),
    }
}

/// The `Sandbox` answer of create and connect.
fn sandbox_json(record: &Record, key: &str, domain: &str) -> Value {
    let token = e2b_key(key);
    json!({
        "templateID": record.template,
        "sandboxID": record.id,
        "clientID": "sandq",
        "alias": record.template,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": token,
        "trafficAccessToken": token,
        "domain": domain,
    })
}

/// `SandboxDetail` / `ListedSandbox`.
fn detail_json(record: &Record) -> Value {
    let (cpus, memory) = size_of(&record.sku);
    json!({
        "templateID": record.template,
        "alias": record.template,
        "sandboxID": record.id,
        "clientID": "sandq",
        "startedAt": rfc3339(record.started_ms),
        "endAt": rfc3339(record.end_ms),
        "envdVersion": ENVD_VERSION,
        "cpuCount": cpus,
        "memoryMB": memory,
        "diskSizeMB": 0,
        "metadata": record.metadata,
        "state": "running",
    })
}

/// The host name sandboxes are reached under (the request's, without its port).
fn domain_of(headers: &HeaderMap) -> String {
    headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(|h| h.rsplit_once(':').map_or(h, |(name, _)| name).to_owned())
        .unwrap_or_else(|| "localhost".to_owned())
}

fn clamp_timeout(seconds: Option<u64>) -> u64 {
    seconds.unwrap_or(DEFAULT_TIMEOUT_S).clamp(1, MAX_TIMEOUT_S)
}

/// `POST /sandboxes`, `POST /v2/sandboxes`: a new session of the tenant named by a new id.
pub(super) async fn create(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refused> {
    let caller = caller_or_401(caller)?;
    let new: NewSandbox = body_json(body, e2b.gateway.settings.read_timeout).await?;
    let metadata = new.metadata.unwrap_or_default();
    let envs = new.env_vars.unwrap_or_default();
    for (what, map) in [("metadata", &metadata), ("envVars", &envs)] {
        let bytes: usize = map.iter().map(|(k, v)| k.len() + v.len()).sum();
        if map.len() > MAX_MAP_ENTRIES || bytes > MAX_MAP_BYTES {
            return Err(e2b_error(
                StatusCode::BAD_REQUEST,
                format!("{what}: at most {MAX_MAP_ENTRIES} entries of {MAX_MAP_BYTES} bytes in all"),
            )
            .into());
        }
    }
    let Some(rest) = e2b.rest(&headers) else { return Err(e2b_error(StatusCode::UNAUTHORIZED, "invalid API key").into()) };
    // A DNS label and a session name: "i" and 128 random bits in hex.
    let id = format!("i{}", uuid::Uuid::new_v4().simple());
    if let Err(e) = rest.create_session(Some(&id)).await {
        return Err(rest_error(e).into());
    }
    let template = new.template_id.unwrap_or_else(|| "code-interpreter-v1".to_owned());
    let started_ms = now_ms();
    let record = Record {
        id,
        tenant: caller.key.tenant.clone(),
        sku: sku_of(&template).to_owned(),
        template,
        started_ms,
        end_ms: started_ms + clamp_timeout(new.timeout) * 1000,
        metadata,
        envs,
        contexts: default_contexts(),
    };
    if !matches!(e2b.store(&record, true).await, Ok(true)) {
        tracing::warn!(sandbox = %record.id, "cannot store an E2B sandbox");
        // The session made for it must not hold one of the tenant's `max_sessions`.
        let _ = rest.delete_session(&record.id).await;
        return Err(e2b_error(StatusCode::SERVICE_UNAVAILABLE, "cannot store the sandbox now").into());
    }
    let key = crate::in_process::bearer_of(&headers).unwrap_or_default();
    Ok((StatusCode::CREATED, Json(sandbox_json(&record, &key, &domain_of(&headers)))).into_response())
}

/// `GET /sandboxes/{id}`.
pub(super) async fn info(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    Path(id): Path<String>,
) -> Result<Response, Refused> {
    let caller = caller_or_401(caller)?;
    let record = e2b.owned(&caller, &id).await?;
    Ok(Json(detail_json(&record)).into_response())
}

/// `GET /sandboxes`, `GET /v2/sandboxes[?metadata=k%3Dv%26...]`: the tenant's live sandboxes.
pub(super) async fn list(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Result<Response, Refused> {
    let caller = caller_or_401(caller)?;
    let mut redis = e2b.gateway.redis.clone();
    let tenant = tenant_key(&e2b.gateway, &caller.key.tenant);
    let now = now_ms();
    let _: redis::RedisResult<()> = redis.zrembyscore(&tenant, 0, now).await;
    let ids: Vec<String> = redis.zrangebyscore_limit(&tenant, now, "+inf", 0, 1000).await.unwrap_or_default();
    // `metadata` filters as E2B's API does: every `key=value` pair given must match.
    let wanted: Vec<(String, String)> = query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .filter(|(k, _)| *k == "metadata")
        .flat_map(|(_, v)| {
            let decoded = percent_decode(v);
            decoded.split('&').filter_map(|p| p.split_once('=').map(|(a, b)| (percent_decode(a), percent_decode(b)))).collect::<Vec<_>>()
        })
        .collect();
    let mut out = Vec::new();
    for id in ids {
        if let Some(r) = e2b.record(&id).await.filter(|r| r.tenant == caller.key.tenant) {
            if wanted.iter().all(|(k, v)| r.metadata.get(k) == Some(v)) {
                out.push(detail_json(&r));
            }
        }
    }
    Ok(Json(Value::Array(out)).into_response())
}

fn percent_decode(s: &str) -> String {
    let s = s.replace('+', " ");
    percent_encoding::percent_decode_str(&s).decode_utf8_lossy().into_owned()
}

#[derive(Debug, Default, Deserialize)]
struct TimeoutBody {
    #[serde(default)]
    timeout: Option<u64>,
}

/// The caller's live sandbox `id` and the `{"timeout"}` body of a call that extends it, or the
/// answer that ends the call (401, 404, a bad body).
async fn timeout_call(
    e2b: &E2b,
    caller: Result<Caller, crate::problem::Problem>,
    id: &str,
    body: Body,
) -> Result<(Record, TimeoutBody), Refused> {
    let caller = caller_or_401(caller)?;
    let body: TimeoutBody = body_json(body, e2b.gateway.settings.read_timeout).await?;
    Ok((e2b.owned(&caller, id).await?, body))
}

/// `POST /sandboxes/{id}/timeout {"timeout": seconds}`: the sandbox now ends that long from now.
pub(super) async fn set_timeout(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    Path(id): Path<String>,
    body: Body,
) -> Result<Response, Refused> {
    let (mut record, body) = timeout_call(&e2b, caller, &id, body).await?;
    record.end_ms = now_ms() + clamp_timeout(body.timeout) * 1000;
    e2b.update(&record).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `POST /(v2/)sandboxes/{id}/connect {"timeout"}`: a running sandbox (never shortened).
pub(super) async fn connect(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Body,
) -> Result<Response, Refused> {
    let (mut record, body) = timeout_call(&e2b, caller, &id, body).await?;
    record.end_ms = record.end_ms.max(now_ms() + clamp_timeout(body.timeout) * 1000);
    e2b.update(&record).await?;
    let key = crate::in_process::bearer_of(&headers).unwrap_or_default();
    Ok(Json(sandbox_json(&record, &key, &domain_of(&headers))).into_response())
}

/// `DELETE /sandboxes/{id}`: the sandbox is gone at once (its record, so `/health` is 502 and a
/// running `/execute` breaks off); its running cell is cancelled and its session deleted.
pub(super) async fn kill(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, Refused> {
    let caller = caller_or_401(caller)?;
    let record = e2b.owned(&caller, &id).await?;
    let mut redis = e2b.gateway.redis.clone();
    let _: redis::RedisResult<()> = redis.del(record_key(&e2b.gateway, &id)).await;
    let _: redis::RedisResult<()> = redis.zrem(tenant_key(&e2b.gateway, &record.tenant), &id).await;
    // Due now: the reaper deletes the session too, again until it can, should the delete
    // below fail.
    let _: redis::RedisResult<()> = redis.zadd(due_key(&e2b.gateway), format!("{}/{id}", record.tenant), now_ms()).await;
    let job: Option<String> = redis.get(job_key(&e2b.gateway, &id)).await.unwrap_or(None);
    if let Some(rest) = e2b.rest(&headers) {
        // The session is locked while its cell runs: cancel the cell, then delete the session
        // once the lock is free (the REST route waits for it).
        tokio::spawn(async move {
            if let Some(job) = job {
                let _ = rest.cancel(&job).await;
            }
            if let Err(e) = rest.delete_session(&id).await {
                if !e.is_not_found() {
                    tracing::warn!(sandbox = %id, error = %e, "cannot delete a killed E2B sandbox's session");
                }
            }
        });
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// envd's and the interpreter's `GET /health`: 204 (envd) or `OK` while the sandbox lives, 502
/// once it is killed, expired or unknown (the SDK then reports it killed).
pub(super) async fn health(axum::Extension(e2b): axum::Extension<Arc<E2b>>, headers: HeaderMap) -> Response {
    let Some((port, id)) = target(&headers) else { return e2b_error(StatusCode::NOT_FOUND, "no sandbox named") };
    match e2b.record(&id).await {
        Some(r) if r.end_ms > now_ms() => {
            if port == ENVD_PORT {
                StatusCode::NO_CONTENT.into_response()
            } else {
                "OK".into_response()
            }
        }
        _ => e2b_error(StatusCode::BAD_GATEWAY, format!("sandbox {id} is not running")),
    }
}
