//! `POST /execute`: a cell run as a notebook job in the sandbox's session, its live events
//! and result streamed as E2B's NDJSON ([`super::ndjson`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt as _;
use redis::AsyncCommands as _;
use sandq_client::http::{Rest, RestError};
use sandq_schemas::{JobResult, JobStatus, OutputType};
use serde::Deserialize;
use serde_json::{json, Value};

use super::contexts::language_name;
use super::ndjson::{self, line, Line, Lines};
use super::record::{job_key, Record};
use super::state::{body_json, caller_or_401, e2b_error, now_ms, rest_error, target, E2b, Refused};
use crate::auth::Caller;

/// The longest a cell runs: the queue's `limits.max_timeout` (15 min).
pub(super) const MAX_CELL_S: u64 = 15 * 60;
/// How often `/execute` writes a keepalive while a cell prints nothing (E2B's server: 5 s), and
/// checks that its sandbox still lives.
pub(super) const KEEPALIVE: Duration = Duration::from_secs(1);
/// Largest image or other binary representation put into a `result` line (base64).
const MAX_BINARY_BYTES: usize = 16 << 20;
/// Most binary bytes (images, PDFs) one cell's results carry, in all: past it a representation
/// is left out (the cell's outputs are in the REST API's result).
const MAX_CELL_BINARY_BYTES: usize = 64 << 20;

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
        return Err((StatusCode::BAD_REQUEST, "only one of context_id and language may be given").into_response().into());
    }
    let (language, slot) = match &execution.context_id {
        Some(id) => match record.contexts.iter().find(|c| &c.id == id) {
            Some(c) => (c.language.clone(), c.slot.clone()),
            None => return Err((StatusCode::NOT_FOUND, format!("Context {id} not found")).into_response().into()),
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
        other => {
            Err((StatusCode::BAD_REQUEST, format!("language {other:?} is not supported by sandq (python, javascript, typescript, bash)"))
                .into_response()
                .into())
        }
    }
}

/// `POST /execute`: runs the cell as a notebook job in the sandbox's session and streams E2B's
/// NDJSON: `stdout`/`stderr` as the job prints (its live events), keepalives, then
/// `number_of_executions`, each `result`, the `error` if any, and `end_of_execution`. A client
/// that goes away cancels the job; a sandbox killed meanwhile breaks the stream off (the SDK
/// then finds `/health` 502 and says the sandbox was killed).
pub(super) async fn execute(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refused> {
    let caller = caller_or_401(caller)?;
    let Some((_, id)) = target(&headers) else { return Err(e2b_error(StatusCode::NOT_FOUND, "no sandbox named").into()) };
    let record = e2b.owned(&caller, &id).await.map_err(|_| e2b_error(StatusCode::BAD_GATEWAY, format!("sandbox {id} is not running")))?;
    let execution: Execution = body_json(body, e2b.gateway.settings.read_timeout).await?;
    let (runtime, code, slot) = cell(&execution, &record)?;
    let typescript = match &execution.context_id {
        Some(id) => record.contexts.iter().any(|c| &c.id == id && c.language == "typescript"),
        None => language_name(execution.language.as_deref()) == "typescript",
    };
    let Some(rest) = e2b.rest(&headers) else { return Err(e2b_error(StatusCode::UNAUTHORIZED, "invalid API key").into()) };
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
    if let Err(e) = rest.submit_json(&job).await {
        return Err(match e {
            _ if matches!(e.status(), Some(400 | 422)) => (StatusCode::BAD_REQUEST, e.summary()).into_response(),
            other => rest_error(other),
        }
        .into());
    }
    let mut redis = e2b.gateway.redis.clone();
    let _: redis::RedisResult<()> = redis.set_ex(job_key(&e2b.gateway, &id), &job_id, MAX_CELL_S + 60).await;
    let (tx, rx) = tokio::sync::mpsc::channel::<Line>(64);
    tokio::spawn(stream_cell(e2b.clone(), rest, id, job_id, tx));
    let body = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|l| (l, rx)) });
    let mut response = Body::from_stream(body).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-ndjson"));
    Ok(response)
}

/// Feeds one cell's lines into `tx` until its end; cancels the job when `tx`'s reader is gone.
async fn stream_cell(e2b: Arc<E2b>, rest: Rest, sandbox: String, job_id: String, tx: tokio::sync::mpsc::Sender<Line>) {
    let mut printed = false;
    let events = rest.raw_events(&job_id).await;
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
                            out.extend(lines[stream].push(text, now_ms()));
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
                        out.extend(l.tick(now_ms()));
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
    for l in lines.iter_mut().filter_map(|l| l.flush(now_ms())) {
        if tx.send(line(&l)).await.is_err() {
            return;
        }
    }
    // The result: wait for it (the end event comes just before it is readable).
    let result = match terminal(&rest, &job_id, &tx, || line(&json!({"type": "keepalive"}))).await {
        Ok(r) => r,
        Err(Some(e)) => {
            let _ = tx.send(Err(std::io::Error::other(e.summary()))).await;
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
pub(super) async fn terminal<T>(
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

/// The closing lines of a cell ([`ndjson::closing`]), with each output's representations
/// read (a binary one from its artifact, within [`MAX_CELL_BINARY_BYTES`] for the cell).
async fn result_lines(rest: &Rest, result: &JobResult, printed: bool, _fetch: &reqwest::Client) -> Vec<bytes::Bytes> {
    let mut results = Vec::new();
    let mut binary_left = MAX_CELL_BINARY_BYTES;
    for output in &result.outputs {
        if output.output_type == OutputType::Error {
            continue;
        }
        let mut representations = Vec::new();
        for (mime, value) in &output.data {
            let text = match (&value.text, &value.artifact) {
                (Some(t), _) => Some(t.clone()),
                (None, Some(a)) if (a.size as usize) <= binary_left => {
                    rest.output(&result.job_id, &a.path, MAX_BINARY_BYTES.min(binary_left)).await.ok().map(|bytes| {
                        binary_left = binary_left.saturating_sub(bytes.len());
                        ndjson::binary_text(mime, &bytes)
                    })
                }
                _ => None,
            };
            if let Some(text) = text {
                representations.push((mime.as_str(), text));
            }
        }
        results.push(ndjson::result(output.output_type == OutputType::ExecuteResult, &representations));
    }
    ndjson::closing(result, printed, results, now_ms()).iter().filter_map(|v| line(v).ok()).collect()
}
