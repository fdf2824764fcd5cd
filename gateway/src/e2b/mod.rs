//! E2B compatibility (docs/e2b.md): E2B's own SDKs (`e2b-code-interpreter`, `@e2b/code-interpreter`)
//! run code on sandq by pointing `E2B_API_URL` and `E2B_SANDBOX_URL` at the gateway.
//!
//! - **Control plane** (`/sandboxes`, `/v2/sandboxes`): an E2B sandbox is a sandq session of the
//!   key's tenant, named by the sandbox id, with a record in Redis (`<ns>:e2b:{<id>}`: tenant,
//!   template, end time, metadata, env vars) whose expiry is the sandbox's end. The gateway owns
//!   that lifetime: a sandbox past its end is gone (its record expires), and [`reap`] deletes
//!   its session.
//! - **Sandbox plane**, on the same origin, routed by the `E2b-Sandbox-Id` and `E2b-Sandbox-Port`
//!   headers the SDKs send on every request (or a Host of `<port>-<id>.<domain>`): the code
//!   interpreter's `POST /execute` (port 49999) runs one notebook job in the session and streams
//!   E2B's NDJSON from the job's live events; envd's `GET /health` (port 49983) is 204 while
//!   the sandbox lives and 502 after.
//!
//! Keys: E2B's SDKs (before 2.46) require `E2B_API_KEY` to match `e2b_[0-9a-f]+`, so a sandq key
//! is given as `e2b_` and the hex of its bytes; the raw key is accepted too. The sandbox's
//! access tokens are that same key (the SDK sends them on the sandbox plane, which carries no
//! API key): whoever holds a sandbox's token holds the key that made it (docs/threat-model.md).
//! Every call then goes through the gateway's own REST routes in-process with that key, so
//! quotas, scoping and audit apply as to any REST client.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use futures::StreamExt as _;
use redis::AsyncCommands as _;
use sandq_mcp::rest::{Rest, RestError, Transport};
use sandq_schemas::{JobResult, JobStatus, OutputType};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::auth::Caller;
use crate::state::Gateway;

mod envd;
mod process;

/// envd's port (`ConnectionConfig.envd_port` in E2B's SDKs).
pub(crate) const ENVD_PORT: u16 = 49983;
/// The envd version sandboxes report: 0.4.0 or later sends no default-user header, 0.5.7 or
/// later uploads as octet-stream (`e2b/envd/versions.py`).
const ENVD_VERSION: &str = "0.5.7";
/// A sandbox's lifetime when create names none: E2B's documented default, seconds.
const DEFAULT_TIMEOUT_S: u64 = 300;
/// The longest lifetime a sandbox is given at once, seconds: the workers' default session idle
/// timeout (30 min), so that a sandbox left alone is not outlived by its files' deletion.
const MAX_TIMEOUT_S: u64 = 30 * 60;
/// The longest a cell runs: the queue's `limits.max_timeout` (15 min).
const MAX_CELL_S: u64 = 15 * 60;
/// How often `/execute` writes a keepalive while a cell prints nothing (E2B's server: 5 s), and
/// checks that its sandbox still lives.
const KEEPALIVE: Duration = Duration::from_secs(1);
/// Largest image or other binary representation put into a `result` line (base64).
const MAX_BINARY_BYTES: usize = 16 << 20;
/// Largest `/execute` or control-plane body.
const MAX_BODY_BYTES: usize = 2 << 20;
/// A sandbox's `metadata` and `envVars` each: at most this many entries, of this many bytes in
/// all (the record is read again every second while a cell runs).
const MAX_MAP_ENTRIES: usize = 64;
const MAX_MAP_BYTES: usize = 64 << 10;
/// Longest context `cwd`, bytes.
const MAX_CWD_BYTES: usize = 4096;
/// Most binary bytes (images, PDFs) one cell's results carry, in all: past it a representation
/// is left out (the cell's outputs are in the REST API's result).
const MAX_CELL_BINARY_BYTES: usize = 64 << 20;

/// A sandbox as the gateway keeps it (`<ns>:e2b:{<id>}`, JSON, expiring at `end_ms`).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    id: String,
    tenant: String,
    template: String,
    started_ms: u64,
    end_ms: u64,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    #[serde(default)]
    envs: BTreeMap<String, String>,
    sku: String,
    /// Its code contexts, in creation order (the two defaults first).
    #[serde(default = "default_contexts")]
    contexts: Vec<CodeContext>,
}

/// A code context: a notebook state of its own within the sandbox's session (the job's
/// `context`), sharing the session's files.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct CodeContext {
    id: String,
    language: String,
    cwd: String,
    /// The session's state slot (`JobSpec::context`); `None`: the session's default state.
    /// Restarting a context gives it a new slot (an empty state).
    #[serde(default)]
    slot: Option<String>,
}

/// The contexts every sandbox starts with: `python` (the session's default state) and
/// `javascript` (Node.js cells keep no variables).
fn default_contexts() -> Vec<CodeContext> {
    ["python", "javascript"]
        .into_iter()
        .map(|language| CodeContext { id: language.to_owned(), language: language.to_owned(), cwd: "/home/user".to_owned(), slot: None })
        .collect()
}

/// Contexts with a state of their own a sandbox has at most: the session keeps 16 named
/// states besides its default one, least recently used dropped first, so a deleted or
/// restarted context's old state (never used again) goes before a live one.
const MAX_CONTEXTS: usize = 16;

/// The sandbox's contexts with a state of their own.
fn slotted(record: &Record) -> usize {
    record.contexts.iter().filter(|c| c.slot.is_some()).count()
}

/// A language as E2B's interpreter names it: none is python, `js` is javascript, `ts`
/// typescript, `sh` bash.
fn language_name(language: Option<&str>) -> String {
    match language.map(str::to_ascii_lowercase).as_deref() {
        None | Some("") | Some("python") => "python".to_owned(),
        Some("js" | "javascript") => "javascript".to_owned(),
        Some("ts" | "typescript") => "typescript".to_owned(),
        Some("sh" | "bash") => "bash".to_owned(),
        Some(other) => other.to_owned(),
    }
}

fn record_key(gateway: &Gateway, id: &str) -> String {
    format!("{}:e2b:{{{id}}}", gateway.names.namespace())
}

fn job_key(gateway: &Gateway, id: &str) -> String {
    format!("{}:e2b:{{{id}}}:job", gateway.names.namespace())
}

fn tenant_key(gateway: &Gateway, tenant: &str) -> String {
    format!("{}:e2b:tenant:{{{tenant}}}", gateway.names.namespace())
}

/// Sandboxes by end time, for [`reap`]: members `<tenant>/<id>`.
fn due_key(gateway: &Gateway) -> String {
    format!("{}:e2b:due", gateway.names.namespace())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// An answer that ends a request early (boxed: a `Response` is large).
type Refused = Box<Response>;

/// An E2B error answer: `{"code", "message"}` (the SDKs map 401, 404, 429, 502...).
fn e2b_error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({"code": status.as_u16(), "message": message.into()}))).into_response()
}

/// The sandq key in an E2B credential: `e2b_<hex of the key's bytes>`, or the key itself.
pub(crate) fn sandq_key(presented: &str) -> String {
    presented
        .strip_prefix("e2b_")
        .and_then(|h| hex::decode(h).ok())
        .and_then(|b| String::from_utf8(b).ok())
        .unwrap_or_else(|| presented.to_owned())
}

/// The E2B form of a sandq key (`e2b_` and its hex), for `E2B_API_KEY`.
pub(crate) fn e2b_key(key: &str) -> String {
    format!("e2b_{}", hex::encode(key))
}

/// The E2B routes: the control plane and the sandbox plane, each request's E2B credential
/// turned into the `Authorization` the REST routes read, `api` answering in-process.
pub(crate) fn service(gateway: Arc<Gateway>, api: Router) -> Router {
    let transport: Arc<dyn Transport> = Arc::new(crate::in_process::InProcess::new(api));
    let state = Arc::new(E2b { gateway: gateway.clone(), transport, fetch: crate::in_process::fetch_client() });
    Router::new()
        .route("/sandboxes", post(create).get(list))
        .route("/v2/sandboxes", post(create).get(list))
        .route("/sandboxes/{id}", get(info).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/execute", post(execute))
        .route("/health", get(health))
        .route("/contexts", get(contexts).post(create_context))
        .route("/contexts/{id}", delete(delete_context))
        .route("/contexts/{id}/restart", post(restart_context))
        // The files' own bound (the key's `max_upload_bytes`) applies, not axum's 2 MiB default.
        .route("/files", get(envd::read).post(envd::write).layer(axum::extract::DefaultBodyLimit::disable()))
        .route("/filesystem.Filesystem/ListDir", post(envd::list_dir))
        .route("/filesystem.Filesystem/Stat", post(envd::stat))
        .route("/filesystem.Filesystem/{call}", post(envd::unimplemented))
        .route("/process.Process/Start", post(process::start))
        .route("/process.Process/SendSignal", post(process::send_signal))
        .route("/process.Process/{call}", post(envd::unimplemented))
        .layer(axum::Extension(state))
        .layer(axum::middleware::from_fn(credential))
        .layer(axum::middleware::from_fn_with_state(gateway.clone(), crate::observe::request))
        .with_state(gateway)
}

/// What the E2B handlers share.
struct E2b {
    gateway: Arc<Gateway>,
    transport: Arc<dyn Transport>,
    fetch: reqwest::Client,
}

impl E2b {
    fn rest(&self, headers: &HeaderMap) -> Option<Rest> {
        let key = crate::in_process::bearer_of(headers)?;
        Some(Rest::new(self.transport.clone(), key, self.fetch.clone()))
    }

    async fn record(&self, id: &str) -> Option<Record> {
        self.lookup(id).await.ok().flatten()
    }

    /// The record of `id`: `Ok(None)` when there is none (killed, expired, never made), `Err`
    /// when Redis did not answer (a running cell must not be cancelled for that).
    async fn lookup(&self, id: &str) -> redis::RedisResult<Option<Record>> {
        let mut redis = self.gateway.redis.clone();
        let raw: Option<String> = redis.get(record_key(&self.gateway, id)).await?;
        Ok(raw.and_then(|r| serde_json::from_str(&r).ok()))
    }

    /// The caller's live sandbox `id`: 404 (E2B's "not found") for one that is gone, unknown or
    /// another tenant's.
    async fn owned(&self, caller: &Caller, id: &str) -> Result<Record, Refused> {
        match self.record(id).await {
            Some(r) if r.tenant == caller.key.tenant && r.end_ms > now_ms() => Ok(r),
            _ => Err(Box::new(e2b_error(StatusCode::NOT_FOUND, format!("sandbox {id} not found")))),
        }
    }

    /// Writes `record`, expiring at its end, and indexes it. An update (`create` false) writes
    /// only over a record that still exists (`SET XX`): a sandbox killed meanwhile stays gone.
    /// False when it was gone. Two updates at once may lose one's change (the record is read,
    /// changed and written whole; a client's calls on one sandbox come one at a time).
    async fn store(&self, record: &Record, create: bool) -> redis::RedisResult<bool> {
        let mut redis = self.gateway.redis.clone();
        let now = now_ms();
        let ttl = record.end_ms.saturating_sub(now).max(1);
        let json = serde_json::to_string(record).unwrap_or_default();
        let mut set = redis::cmd("SET");
        set.arg(record_key(&self.gateway, &record.id)).arg(json).arg("PX").arg(ttl).arg(if create { "NX" } else { "XX" });
        let written: Option<String> = set.query_async(&mut redis).await?;
        if written.is_none() {
            return Ok(false);
        }
        let tenant = tenant_key(&self.gateway, &record.tenant);
        let () = redis.zadd(&tenant, &record.id, record.end_ms).await?;
        let () = redis.zrembyscore(&tenant, 0, now).await?;
        let () = redis.zadd(due_key(&self.gateway), format!("{}/{}", record.tenant, record.id), record.end_ms).await?;
        Ok(true)
    }

    /// [`Self::store`] for a handler: 404 when the sandbox is gone, 503 when Redis failed.
    async fn update(&self, record: &Record) -> Result<(), Refused> {
        match self.store(record, false).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(Box::new(e2b_error(StatusCode::NOT_FOUND, format!("sandbox {} not found", record.id)))),
            Err(_) => Err(Box::new(e2b_error(StatusCode::SERVICE_UNAVAILABLE, "cannot store the sandbox now"))),
        }
    }
}

/// Moves the E2B credential of a request (`X-API-Key`, `X-Access-Token`, or
/// `E2B-Traffic-Access-Token`, in the `e2b_<hex>` form or not) into `Authorization: Bearer`.
async fn credential(mut request: Request, next: Next) -> Response {
    let headers = request.headers();
    let presented = ["x-api-key", "x-access-token", "e2b-traffic-access-token"]
        .iter()
        .find_map(|name| headers.get(*name).and_then(|v| v.to_str().ok()).filter(|v| !v.is_empty()))
        .map(sandq_key);
    if let Some(value) = presented.and_then(|key| HeaderValue::from_str(&format!("Bearer {key}")).ok()) {
        request.headers_mut().insert(header::AUTHORIZATION, value);
        request.headers_mut().remove("x-api-key");
    }
    next.run(request).await
}

/// A caller, or E2B's 401.
fn caller_or_401(caller: Result<Caller, crate::problem::Problem>) -> Result<Caller, Refused> {
    caller.map_err(|p| {
        let status = p.into_response().status();
        Box::new(e2b_error(status, if status == StatusCode::UNAUTHORIZED { "invalid API key" } else { "cannot check the API key now" }))
    })
}

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

async fn body_json<T: serde::de::DeserializeOwned>(body: Body, within: Duration) -> Result<T, Refused> {
    // Within the gateway's `read_timeout`, as every other body: a slow client holds no slot.
    let bytes = tokio::time::timeout(within, axum::body::to_bytes(body, MAX_BODY_BYTES))
        .await
        .map_err(|_| Box::new(e2b_error(StatusCode::REQUEST_TIMEOUT, "the body came too slowly")))?
        .map_err(|_| Box::new(e2b_error(StatusCode::PAYLOAD_TOO_LARGE, format!("the body is over {MAX_BODY_BYTES} bytes"))))?;
    let bytes = if bytes.is_empty() { bytes::Bytes::from_static(b"{}") } else { bytes };
    serde_json::from_slice(&bytes).map_err(|e| Box::new(e2b_error(StatusCode::BAD_REQUEST, format!("invalid body: {e}"))))
}

/// `POST /sandboxes`, `POST /v2/sandboxes`: a new session of the tenant named by a new id.
async fn create(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let caller = match caller_or_401(caller) {
        Ok(c) => c,
        Err(r) => return *r,
    };
    let new: NewSandbox = match body_json(body, e2b.gateway.settings.read_timeout).await {
        Ok(n) => n,
        Err(r) => return *r,
    };
    let metadata = new.metadata.unwrap_or_default();
    let envs = new.env_vars.unwrap_or_default();
    for (what, map) in [("metadata", &metadata), ("envVars", &envs)] {
        let bytes: usize = map.iter().map(|(k, v)| k.len() + v.len()).sum();
        if map.len() > MAX_MAP_ENTRIES || bytes > MAX_MAP_BYTES {
            return e2b_error(
                StatusCode::BAD_REQUEST,
                format!("{what}: at most {MAX_MAP_ENTRIES} entries of {MAX_MAP_BYTES} bytes in all"),
            );
        }
    }
    let Some(rest) = e2b.rest(&headers) else { return e2b_error(StatusCode::UNAUTHORIZED, "invalid API key") };
    // A DNS label and a session name: "i" and 128 random bits in hex.
    let id = format!("i{}", uuid::Uuid::new_v4().simple());
    if let Err(e) = rest.create_session(Some(&id)).await {
        return rest_error(e);
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
        return e2b_error(StatusCode::SERVICE_UNAVAILABLE, "cannot store the sandbox now");
    }
    let key = crate::in_process::bearer_of(&headers).unwrap_or_default();
    (StatusCode::CREATED, Json(sandbox_json(&record, &key, &domain_of(&headers)))).into_response()
}

/// A REST refusal as E2B's error shape, with its status.
fn rest_error(e: RestError) -> Response {
    match e {
        RestError::Problem { status, .. } => e2b_error(StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY), e.to_string()),
        other => e2b_error(StatusCode::BAD_GATEWAY, other.to_string()),
    }
}

/// `GET /sandboxes/{id}`.
async fn info(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    Path(id): Path<String>,
) -> Response {
    let caller = match caller_or_401(caller) {
        Ok(c) => c,
        Err(r) => return *r,
    };
    match e2b.owned(&caller, &id).await {
        Ok(record) => Json(detail_json(&record)).into_response(),
        Err(r) => *r,
    }
}

/// `GET /sandboxes`, `GET /v2/sandboxes[?metadata=k%3Dv%26...]`: the tenant's live sandboxes.
async fn list(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    let caller = match caller_or_401(caller) {
        Ok(c) => c,
        Err(r) => return *r,
    };
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
    Json(Value::Array(out)).into_response()
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
async fn set_timeout(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    Path(id): Path<String>,
    body: Body,
) -> Response {
    let (mut record, body) = match timeout_call(&e2b, caller, &id, body).await {
        Ok(x) => x,
        Err(r) => return *r,
    };
    record.end_ms = now_ms() + clamp_timeout(body.timeout) * 1000;
    match e2b.update(&record).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(r) => *r,
    }
}

/// `POST /(v2/)sandboxes/{id}/connect {"timeout"}`: a running sandbox (never shortened).
async fn connect(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Body,
) -> Response {
    let (mut record, body) = match timeout_call(&e2b, caller, &id, body).await {
        Ok(x) => x,
        Err(r) => return *r,
    };
    record.end_ms = record.end_ms.max(now_ms() + clamp_timeout(body.timeout) * 1000);
    if let Err(r) = e2b.update(&record).await {
        return *r;
    }
    let key = crate::in_process::bearer_of(&headers).unwrap_or_default();
    Json(sandbox_json(&record, &key, &domain_of(&headers))).into_response()
}

/// `DELETE /sandboxes/{id}`: the sandbox is gone at once (its record, so `/health` is 502 and a
/// running `/execute` breaks off); its running cell is cancelled and its session deleted.
async fn kill(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let caller = match caller_or_401(caller) {
        Ok(c) => c,
        Err(r) => return *r,
    };
    let record = match e2b.owned(&caller, &id).await {
        Ok(r) => r,
        Err(r) => return *r,
    };
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
    StatusCode::NO_CONTENT.into_response()
}

/// Deletes the sessions of sandboxes past their end, every 10 s until `shutdown`: one replica
/// takes each (`ZREM` answers 1 to one only).
pub async fn reap(gateway: Arc<Gateway>, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(10)) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        let mut redis = gateway.redis.clone();
        let due: Vec<String> = redis.zrangebyscore_limit(due_key(&gateway), 0, now_ms(), 0, 100).await.unwrap_or_default();
        for member in due {
            let taken: i64 = redis.zrem(due_key(&gateway), &member).await.unwrap_or(0);
            let Some((tenant, id)) = member.split_once('/') else { continue };
            if taken != 1 {
                continue;
            }
            let scoped = format!("{tenant}_{id}");
            let holder = format!("gateway-e2b-{}", uuid::Uuid::new_v4());
            if sandq_core::sessions::lock(&mut redis, &gateway.names, &scoped, &holder, Duration::from_secs(60), Duration::from_secs(30))
                .await
                .is_ok()
            {
                if let Err(e) =
                    sandq_core::sessions::delete(&gateway.s3, &gateway.service.s3.bucket, &mut redis, &gateway.names, &scoped).await
                {
                    tracing::warn!(sandbox = %id, error = %e, "cannot delete an expired E2B sandbox's session");
                }
                let _ = sandq_core::sessions::unlock(&mut redis, &gateway.names, &scoped, &holder).await;
            }
            let _: redis::RedisResult<()> = redis.zrem(crate::sessions::tenant_sessions_key(&gateway, tenant), id).await;
        }
    }
}

/// The sandbox and port a sandbox-plane request is for: the `E2b-Sandbox-Id` and
/// `E2b-Sandbox-Port` headers, else a Host of `<port>-<id>.<domain>`.
fn target(headers: &HeaderMap) -> Option<(u16, String)> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    if let (Some(id), Some(port)) = (header("e2b-sandbox-id"), header("e2b-sandbox-port")) {
        return Some((port.parse().ok()?, id));
    }
    let host = header("host")?;
    let (label, _) = host.split_once('.')?;
    let (port, id) = label.split_once('-')?;
    Some((port.parse().ok()?, id.to_owned()))
}

/// envd's and the interpreter's `GET /health`: 204 (envd) or `OK` while the sandbox lives, 502
/// once it is killed, expired or unknown (the SDK then reports it killed).
async fn health(axum::Extension(e2b): axum::Extension<Arc<E2b>>, headers: HeaderMap) -> Response {
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

/// The caller's live sandbox of a sandbox-plane request (502, as E2B's proxy answers for a
/// sandbox that is gone, otherwise).
async fn plane_sandbox(e2b: &E2b, caller: Result<Caller, crate::problem::Problem>, headers: &HeaderMap) -> Result<Record, Refused> {
    plane_caller(e2b, caller, headers).await.map(|(_, record)| record)
}

/// [`plane_sandbox`], with the caller.
async fn plane_caller(
    e2b: &E2b,
    caller: Result<Caller, crate::problem::Problem>,
    headers: &HeaderMap,
) -> Result<(Caller, Record), Refused> {
    let caller = caller_or_401(caller)?;
    let Some((_, id)) = target(headers) else { return Err(Box::new(e2b_error(StatusCode::NOT_FOUND, "no sandbox named"))) };
    match e2b.owned(&caller, &id).await {
        Ok(record) => Ok((caller, record)),
        Err(_) => Err(Box::new(e2b_error(StatusCode::BAD_GATEWAY, format!("sandbox {id} is not running")))),
    }
}

fn context_json(c: &CodeContext) -> Value {
    json!({"id": c.id, "language": c.language, "cwd": c.cwd})
}

/// `GET /contexts`: the sandbox's contexts, in creation order.
async fn contexts(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
) -> Response {
    match plane_sandbox(&e2b, caller, &headers).await {
        Ok(record) => Json(Value::Array(record.contexts.iter().map(context_json).collect())).into_response(),
        Err(r) => *r,
    }
}

#[derive(Debug, Default, Deserialize)]
struct NewContext {
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    cwd: Option<String>,
}

/// `POST /contexts {"language"?, "cwd"?}`: a new context with an empty state of its own.
async fn create_context(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let mut record = match plane_sandbox(&e2b, caller, &headers).await {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let new: NewContext = match body_json(body, e2b.gateway.settings.read_timeout).await {
        Ok(n) => n,
        Err(r) => return *r,
    };
    let language = language_name(new.language.as_deref());
    if !matches!(language.as_str(), "python" | "javascript" | "typescript" | "bash") {
        return (
            StatusCode::BAD_REQUEST,
            format!("language {language:?} is not supported by sandq (python, javascript, typescript, bash)"),
        )
            .into_response();
    }
    if slotted(&record) >= MAX_CONTEXTS {
        return (StatusCode::BAD_REQUEST, format!("a sandbox has at most {MAX_CONTEXTS} contexts with states of their own"))
            .into_response();
    }
    let cwd = new.cwd.unwrap_or_else(|| "/home/user".to_owned());
    if cwd.len() > MAX_CWD_BYTES {
        return (StatusCode::BAD_REQUEST, format!("cwd is over {MAX_CWD_BYTES} bytes")).into_response();
    }
    let id = uuid::Uuid::new_v4().simple().to_string();
    let context = CodeContext { slot: Some(id.clone()), id, language, cwd };
    record.contexts.push(context.clone());
    if let Err(r) = e2b.update(&record).await {
        return *r;
    }
    Json(context_json(&context)).into_response()
}

/// `DELETE /contexts/{id}`: the context is gone (its state is dropped from the session when
/// newer ones need the room).
async fn delete_context(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    Path(context): Path<String>,
) -> Response {
    let mut record = match plane_sandbox(&e2b, caller, &headers).await {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let before = record.contexts.len();
    record.contexts.retain(|c| c.id != context);
    if record.contexts.len() == before {
        return (StatusCode::NOT_FOUND, format!("Context {context} not found")).into_response();
    }
    match e2b.update(&record).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(r) => *r,
    }
}

/// `POST /contexts/{id}/restart`: the context starts over with an empty state (a new slot in
/// the session); the files stay.
async fn restart_context(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    Path(context): Path<String>,
) -> Response {
    let mut record = match plane_sandbox(&e2b, caller, &headers).await {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let full = slotted(&record) >= MAX_CONTEXTS;
    let Some(found) = record.contexts.iter_mut().find(|c| c.id == context) else {
        return (StatusCode::NOT_FOUND, format!("Context {context} not found")).into_response();
    };
    // A default context restarted gets a state of its own: within the cap too.
    if found.slot.is_none() && full {
        return (StatusCode::BAD_REQUEST, format!("a sandbox has at most {MAX_CONTEXTS} contexts with states of their own"))
            .into_response();
    }
    found.slot = Some(format!("{}.{}", found.id, &uuid::Uuid::new_v4().simple().to_string()[..12]));
    match e2b.update(&record).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(r) => *r,
    }
}

/// `/execute`'s body (the code interpreter's `ExecutionRequest`).
#[derive(Debug, Deserialize)]
struct Execution {
    code: String,
    #[serde(default)]
    context_id: Option<String>,
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
}

/// The job a cell is: its runtime, code (bash as an IPython `%%bash` cell) and state slot,
/// from its language or its context.
fn cell(execution: &Execution, record: &Record) -> Result<(&'static str, String, Option<String>), Refused> {
    if execution.context_id.is_some() && execution.language.is_some() {
        return Err(Box::new((StatusCode::BAD_REQUEST, "only one of context_id and language may be given").into_response()));
    }
    let (language, slot) = match &execution.context_id {
        Some(id) => match record.contexts.iter().find(|c| &c.id == id) {
            Some(c) => (c.language.clone(), c.slot.clone()),
            None => return Err(Box::new((StatusCode::NOT_FOUND, format!("Context {id} not found")).into_response())),
        },
        None => {
            // The language's default context: restarted, it has a state of its own.
            let language = language_name(execution.language.as_deref());
            let default = if matches!(language.as_str(), "javascript" | "typescript") { "javascript" } else { "python" };
            let slot = record.contexts.iter().find(|c| c.id == default).and_then(|c| c.slot.clone());
            (language, slot)
        }
    };
    match language.as_str() {
        "python" => Ok(("python", execution.code.clone(), slot)),
        "javascript" | "typescript" => Ok(("node", execution.code.clone(), slot)),
        "bash" => Ok(("python", format!("%%bash\n{}", execution.code), slot)),
        other => Err(Box::new(
            (StatusCode::BAD_REQUEST, format!("language {other:?} is not supported by sandq (python, javascript, typescript, bash)"))
                .into_response(),
        )),
    }
}

type Line = Result<bytes::Bytes, std::io::Error>;

fn line(value: &Value) -> Line {
    let mut bytes = serde_json::to_vec(value).unwrap_or_default();
    bytes.push(b'\n');
    Ok(bytes.into())
}

/// `POST /execute`: runs the cell as a notebook job in the sandbox's session and streams E2B's
/// NDJSON: `stdout`/`stderr` as the job prints (its live events), keepalives, then
/// `number_of_executions`, each `result`, the `error` if any, and `end_of_execution`. A client
/// that goes away cancels the job; a sandbox killed meanwhile breaks the stream off (the SDK
/// then finds `/health` 502 and says the sandbox was killed).
async fn execute(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let caller = match caller_or_401(caller) {
        Ok(c) => c,
        Err(r) => return *r,
    };
    let Some((_, id)) = target(&headers) else { return e2b_error(StatusCode::NOT_FOUND, "no sandbox named") };
    let record = match e2b.owned(&caller, &id).await {
        Ok(r) => r,
        Err(_) => return e2b_error(StatusCode::BAD_GATEWAY, format!("sandbox {id} is not running")),
    };
    let execution: Execution = match body_json(body, e2b.gateway.settings.read_timeout).await {
        Ok(x) => x,
        Err(r) => return *r,
    };
    let (runtime, code, slot) = match cell(&execution, &record) {
        Ok(c) => c,
        Err(r) => return *r,
    };
    let typescript = match &execution.context_id {
        Some(id) => record.contexts.iter().any(|c| &c.id == id && c.language == "typescript"),
        None => language_name(execution.language.as_deref()) == "typescript",
    };
    let Some(rest) = e2b.rest(&headers) else { return e2b_error(StatusCode::UNAUTHORIZED, "invalid API key") };
    let mut env = record.envs.clone();
    env.extend(execution.env_vars.clone().unwrap_or_default());
    // The cell may run until the sandbox ends, within the queue's and the key's longest.
    let longest = MAX_CELL_S.min(caller.key.quotas.max_timeout.as_secs()).max(1);
    let left_s = record.end_ms.saturating_sub(now_ms()) / 1000;
    let job_id = uuid::Uuid::new_v4().to_string();
    let mut job = json!({
        "job_id": job_id,
        "sku": record.sku,
        "runtime": runtime,
        "code": code,
        "mode": "notebook",
        "session": id,
        "env": env,
        "timeout": format!("{}s", left_s.clamp(1, longest)),
        "compat": "e2b",
    });
    if let Some(slot) = slot {
        job["context"] = json!(slot);
    }
    if typescript {
        job["dialect"] = json!("typescript");
    }
    if let Err(e) = rest.submit(&job).await {
        return match e {
            RestError::Problem { status, .. } if status == 400 || status == 422 => (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
            other => rest_error(other),
        };
    }
    let mut redis = e2b.gateway.redis.clone();
    let _: redis::RedisResult<()> = redis.set_ex(job_key(&e2b.gateway, &id), &job_id, MAX_CELL_S + 60).await;
    let (tx, rx) = tokio::sync::mpsc::channel::<Line>(64);
    tokio::spawn(stream_cell(e2b.clone(), rest, id, job_id, tx));
    let body = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|l| (l, rx)) });
    let mut response = Body::from_stream(body).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
    response
}

/// Feeds one cell's lines into `tx` until its end; cancels the job when `tx`'s reader is gone.
async fn stream_cell(e2b: Arc<E2b>, rest: Rest, sandbox: String, job_id: String, tx: tokio::sync::mpsc::Sender<Line>) {
    let mut printed = false;
    let events = rest.events(&job_id).await;
    let mut ticker = tokio::time::interval(KEEPALIVE);
    ticker.tick().await;
    // Whole lines, as a kernel's stream messages carry them: a `print` of an unbuffered
    // program arrives as its text and then its newline, two chunks apart.
    let mut lines = [Lines::new("stdout"), Lines::new("stderr")];
    if let Ok(events) = events {
        let mut events = std::pin::pin!(events);
        loop {
            let mut out = Vec::new();
            tokio::select! {
                event = events.next() => match event {
                    Some(Ok(event)) => match event.kind.as_str() {
                        "stdout" | "stderr" => {
                            let text = event.data.get("text").and_then(Value::as_str).unwrap_or_default();
                            printed |= !text.is_empty();
                            let stream = usize::from(event.kind == "stderr");
                            out.extend(lines[stream].push(text));
                        }
                        "end" => break,
                        _ => {}
                    },
                    _ => break,
                },
                _ = ticker.tick() => {
                    // Gone (killed, expired): not a Redis that did not answer this once.
                    let gone = match e2b.lookup(&sandbox).await {
                        Ok(None) => true,
                        Ok(Some(r)) => r.end_ms <= now_ms(),
                        Err(_) => false,
                    };
                    if gone {
                        // Killed or expired: the job is cancelled (by the kill, or here) and
                        // the stream broken off.
                        let _ = rest.cancel(&job_id).await;
                        let _ = tx.send(Err(std::io::Error::other("the sandbox is gone"))).await;
                        return;
                    }
                    // A partial line waiting since the tick before goes out as it is (a
                    // progress bar, a prompt).
                    for l in &mut lines {
                        out.extend(l.tick());
                    }
                    out.push(json!({"type": "keepalive"}));
                }
                () = tx.closed() => {
                    let _ = rest.cancel(&job_id).await;
                    return;
                }
            }
            for l in out {
                if tx.send(line(&l)).await.is_err() {
                    let _ = rest.cancel(&job_id).await;
                    return;
                }
            }
        }
    }
    for l in lines.iter_mut().filter_map(Lines::flush) {
        if tx.send(line(&l)).await.is_err() {
            return;
        }
    }
    // The result: wait for it (the end event comes just before it is readable).
    let result = match terminal(&rest, &job_id, &tx, || line(&json!({"type": "keepalive"}))).await {
        Ok(r) => r,
        Err(Some(e)) => {
            let _ = tx.send(Err(std::io::Error::other(e.to_string()))).await;
            return;
        }
        Err(None) => return,
    };
    if result.status == JobStatus::Cancelled || matches!(e2b.lookup(&sandbox).await, Ok(None)) {
        let _ = tx.send(Err(std::io::Error::other("the cell was cancelled"))).await;
        return;
    }
    for l in result_lines(&rest, &result, printed, &e2b.fetch).await {
        if tx.send(Ok(l)).await.is_err() {
            return;
        }
    }
}

/// Waits for the job's terminal result, sending `keepalive()` into `tx` after each 5 s wait.
/// `Err(Some(e))`: reading it failed; `Err(None)`: the reader went away, and the job is
/// cancelled.
async fn terminal<T>(
    rest: &Rest,
    job_id: &str,
    tx: &tokio::sync::mpsc::Sender<T>,
    keepalive: impl Fn() -> T,
) -> Result<JobResult, Option<RestError>> {
    loop {
        tokio::select! {
            read = rest.job(job_id, Some(Duration::from_secs(5))) => match read {
                Ok(r) if r.status.is_terminal() => return Ok(r),
                Ok(_) => {}
                Err(e) => return Err(Some(e)),
            },
            () = tx.closed() => {
                let _ = rest.cancel(job_id).await;
                return Err(None);
            }
        }
        if tx.send(keepalive()).await.is_err() {
            let _ = rest.cancel(job_id).await;
            return Err(None);
        }
    }
}

/// One stream's text on its way to NDJSON lines: whole lines go out as they complete, a
/// partial one after a keepalive tick has passed over it, or at the end.
struct Lines {
    kind: &'static str,
    partial: String,
    ticks: u8,
}

impl Lines {
    fn new(kind: &'static str) -> Self {
        Lines { kind, partial: String::new(), ticks: 0 }
    }

    fn message(&self, text: String) -> Value {
        json!({"type": self.kind, "text": text, "timestamp": rfc3339(now_ms())})
    }

    /// The complete lines `text` finishes, as one message.
    fn push(&mut self, text: &str) -> Option<Value> {
        self.partial.push_str(text);
        let end = self.partial.rfind('\n')? + 1;
        let rest = self.partial.split_off(end);
        let whole = std::mem::replace(&mut self.partial, rest);
        self.ticks = 0;
        Some(self.message(whole))
    }

    /// The partial line, once it has waited a whole tick.
    fn tick(&mut self) -> Option<Value> {
        if self.partial.is_empty() {
            return None;
        }
        self.ticks += 1;
        (self.ticks >= 2).then(|| self.flush()).flatten()
    }

    fn flush(&mut self) -> Option<Value> {
        self.ticks = 0;
        (!self.partial.is_empty()).then(|| std::mem::take(&mut self.partial)).map(|t| self.message(t))
    }
}

/// The closing lines of a cell: its streams (when no live event carried them), the execution
/// count, its results, its error, and `end_of_execution`.
async fn result_lines(rest: &Rest, result: &JobResult, printed: bool, _fetch: &reqwest::Client) -> Vec<bytes::Bytes> {
    let mut out = Vec::new();
    let mut push = |v: Value| {
        if let Ok(l) = line(&v) {
            out.push(l);
        }
    };
    if !printed {
        for (kind, captured) in [("stdout", &result.stdout), ("stderr", &result.stderr)] {
            if !captured.text.is_empty() {
                push(json!({"type": kind, "text": captured.text, "timestamp": rfc3339(now_ms())}));
            }
        }
    }
    if let Some(count) = result.execution_count {
        push(json!({"type": "number_of_executions", "execution_count": count}));
    }
    let mut binary_left = MAX_CELL_BINARY_BYTES;
    for output in &result.outputs {
        if output.output_type == OutputType::Error {
            continue;
        }
        let mut item = serde_json::Map::new();
        item.insert("type".into(), json!("result"));
        item.insert("is_main_result".into(), json!(output.output_type == OutputType::ExecuteResult));
        let mut extra = serde_json::Map::new();
        for (mime, value) in &output.data {
            let text = match (&value.text, &value.artifact) {
                (Some(t), _) => Some(t.clone()),
                (None, Some(a)) if (a.size as usize) <= binary_left => {
                    rest.output(&result.job_id, &a.path, MAX_BINARY_BYTES.min(binary_left)).await.ok().map(|bytes| {
                        binary_left = binary_left.saturating_sub(bytes.len());
                        if mime.starts_with("image/") && mime != "image/svg+xml" || mime == "application/pdf" {
                            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, bytes)
                        } else {
                            String::from_utf8_lossy(&bytes).into_owned()
                        }
                    })
                }
                _ => None,
            };
            let Some(text) = text else { continue };
            let (name, value) = match mime.as_str() {
                "text/plain" => ("text", json!(strip_quotes(&text))),
                "text/html" => ("html", json!(text)),
                "text/markdown" => ("markdown", json!(text)),
                "image/svg+xml" => ("svg", json!(text)),
                "image/png" => ("png", json!(text)),
                "image/jpeg" => ("jpeg", json!(text)),
                "application/pdf" => ("pdf", json!(text)),
                "text/latex" => ("latex", json!(text)),
                "application/json" => ("json", serde_json::from_str(&text).unwrap_or(json!(text))),
                "application/javascript" => ("javascript", json!(text)),
                "application/vnd.sandq.chart+json" | "e2b/chart" => ("chart", serde_json::from_str(&text).unwrap_or(Value::Null)),
                "e2b/data" => ("data", serde_json::from_str(&text).unwrap_or(Value::Null)),
                "application/vnd.dataresource+json" => match serde_json::from_str::<Value>(&text).ok().and_then(|t| columns(&t)) {
                    Some(data) => ("data", data),
                    None => continue,
                },
                other => {
                    extra.insert(other.to_owned(), serde_json::from_str(&text).unwrap_or(json!(text)));
                    continue;
                }
            };
            item.insert(name.into(), value);
        }
        item.insert("extra".into(), Value::Object(extra));
        push(Value::Object(item));
    }
    if let Some(error) = &result.error {
        push(json!({"type": "error", "name": error.name, "value": error.value, "traceback": error.traceback.join("\n")}));
    } else if !matches!(result.status, JobStatus::Succeeded) {
        let name = match result.status {
            JobStatus::TimedOut => "TimeoutError",
            JobStatus::OomKilled => "OOMKilled",
            _ => "SandqError",
        };
        let value = result.reason.clone().unwrap_or_else(|| result.status.to_string());
        push(json!({"type": "error", "name": name, "value": value, "traceback": ""}));
    }
    push(json!({"type": "end_of_execution"}));
    out
}

/// A pandas table schema (`application/vnd.dataresource+json`: `schema.fields`, `primaryKey`,
/// `data` rows) as E2B's `data`: `DataFrame.to_dict(orient="list")`, a list per column, the
/// index (the primary key's columns) left out. `None` when it is not that shape.
fn columns(table: &Value) -> Option<Value> {
    let schema = table.get("schema")?;
    let key: Vec<&str> =
        schema.get("primaryKey").and_then(Value::as_array).map_or_else(Vec::new, |k| k.iter().filter_map(Value::as_str).collect());
    let rows = table.get("data")?.as_array()?;
    let mut out = serde_json::Map::new();
    for field in schema.get("fields")?.as_array()? {
        let name = field.get("name")?.as_str()?;
        if key.contains(&name) {
            continue;
        }
        let column: Vec<Value> = rows.iter().map(|row| row.get(name).cloned().unwrap_or(Value::Null)).collect();
        out.insert(name.to_owned(), Value::Array(column));
    }
    Some(Value::Object(out))
}

/// Jupyter's `text/plain` of a string is its repr: E2B's server strips the quotes around it.
fn strip_quotes(text: &str) -> String {
    for q in ['\'', '"'] {
        if text.len() >= 2 && text.starts_with(q) && text.ends_with(q) {
            return text[1..text.len() - 1].to_owned();
        }
    }
    text.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_through_their_e2b_form() {
        let key = "sq_abc123_DEF.456";
        let e2b = e2b_key(key);
        assert!(e2b.starts_with("e2b_") && e2b[4..].bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(sandq_key(&e2b), key);
        assert_eq!(sandq_key(key), key);
        // Not hex, or not UTF-8: taken as is.
        assert_eq!(sandq_key("e2b_zz"), "e2b_zz");
        assert_eq!(sandq_key("e2b_ff"), "e2b_ff");
    }

    #[test]
    fn sandbox_targets_come_from_headers_or_the_host() {
        let mut h = HeaderMap::new();
        h.insert("e2b-sandbox-id", HeaderValue::from_static("iabc"));
        h.insert("e2b-sandbox-port", HeaderValue::from_static("49999"));
        assert_eq!(target(&h), Some((49999, "iabc".to_owned())));
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("49983-iabc.sandq.example:8443"));
        assert_eq!(target(&h), Some((49983, "iabc".to_owned())));
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("gateway.example"));
        assert_eq!(target(&h), None);
    }

    #[test]
    fn a_table_schema_becomes_lists_by_column_without_the_index() {
        let table = json!({
            "schema": {"fields": [{"name": "index", "type": "integer"}, {"name": "a", "type": "integer"}, {"name": "b", "type": "string"}], "primaryKey": ["index"]},
            "data": [{"index": 0, "a": 1, "b": "x"}, {"index": 1, "a": 2, "b": "y"}],
        });
        assert_eq!(columns(&table), Some(json!({"a": [1, 2], "b": ["x", "y"]})));
        assert_eq!(columns(&json!({"data": []})), None);
    }

    #[test]
    fn streams_go_out_as_whole_lines_and_a_partial_one_after_a_tick() {
        let mut lines = Lines::new("stdout");
        assert_eq!(lines.push("1"), None);
        let out = lines.push("\n2\n3").expect("a line");
        assert_eq!(out["text"], "1\n2\n");
        assert_eq!(out["type"], "stdout");
        assert_eq!(lines.tick(), None, "waits one tick");
        assert_eq!(lines.tick().expect("then goes")["text"], "3");
        assert_eq!(lines.flush(), None);
        lines.push("tail");
        assert_eq!(lines.flush().expect("at the end")["text"], "tail");
    }

    #[test]
    fn string_reprs_lose_their_quotes_and_other_text_is_kept() {
        assert_eq!(strip_quotes("'hello'"), "hello");
        assert_eq!(strip_quotes("\"it's\""), "it's");
        assert_eq!(strip_quotes("1"), "1");
        assert_eq!(strip_quotes("'"), "'");
    }
}
