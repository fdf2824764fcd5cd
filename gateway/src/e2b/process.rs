//! envd's processes on sandq (E2B's `sandbox.commands.run`): `process.Process/Start` runs the
//! command as a script job in the sandbox's session (its files, its env vars, `/home/user`)
//! and streams envd's events from the job's live events: `start` with a pid, `data` with
//! stdout and stderr as they come, `keepalive`s, then `end` with the exit code. `SendSignal`
//! (the handle's `kill`) cancels the job. A client that goes away cancels it too.
//!
//! Start is a Connect server-streaming call (connectrpc.com/docs/protocol): the request and
//! each response message are enveloped (a flags byte, a 4-byte big-endian length, the JSON);
//! the last envelope (flags `0x02`) ends the stream, with the error if the call failed.
//!
//! Not carried: stdin, PTYs, `connect` to a running command, `list` (each command is a job
//! of its own; docs/e2b.md).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt as _;
use redis::AsyncCommands as _;
use sandq_client::http::Rest;
use sandq_schemas::{JobResult, JobStatus};
use serde::Deserialize;
use serde_json::{json, Value};

use super::envd::{connect_error, Code};
use super::execute::{terminal, KEEPALIVE, MAX_CELL_S};
use super::record::plane_caller;
use super::state::{now_ms, E2b, Refused};
use crate::auth::Caller;

/// How often a command's stream carries a keepalive while it prints nothing (E2B's SDK asks
/// for one every 50 s: `Keepalive-Ping-Interval`).
const KEEPALIVE_TICKS: u32 = 5;

/// Largest Start request, bytes (a command line and its environment).
const MAX_REQUEST_BYTES: usize = 256 << 10;

/// Envelope flag of the message that ends a Connect stream.
const END_STREAM: u8 = 0x02;

/// One Connect envelope: `flags`, the JSON's length (big-endian u32), the JSON.
pub(super) fn envelope(flags: u8, message: &Value) -> bytes::Bytes {
    let json = serde_json::to_vec(message).unwrap_or_default();
    let mut out = Vec::with_capacity(5 + json.len());
    out.push(flags);
    out.extend_from_slice(&u32::try_from(json.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(&json);
    out.into()
}

/// The message of an enveloped request (or a bare JSON body, which some clients send).
fn unenvelope(bytes: &[u8]) -> Option<&[u8]> {
    match bytes.first() {
        Some(b'{') => Some(bytes),
        Some(_) if bytes.len() >= 5 => {
            let len = u32::from_be_bytes(bytes[1..5].try_into().ok()?) as usize;
            bytes.get(5..5 + len)
        }
        _ => None,
    }
}

/// The envelope that ends a stream: `{}`, or `{"error": {"code", "message"}}`.
fn end_stream(error: Option<(Code, String)>) -> bytes::Bytes {
    let message = match error {
        Some((code, message)) => json!({"error": {"code": code.name(), "message": message}}),
        None => json!({}),
    };
    envelope(END_STREAM, &message)
}

/// A stream answered by an error alone (Connect streams answer 200 and carry it at the end).
fn failed_stream(code: Code, message: impl Into<String>) -> Response {
    streaming(Body::from(end_stream(Some((code, message.into())))))
}

fn streaming(body: Body) -> Response {
    let mut response = body.into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/connect+json"));
    response
}

#[derive(Debug, Deserialize)]
struct StartRequest {
    process: ProcessConfig,
}

#[derive(Debug, Deserialize)]
struct ProcessConfig {
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: BTreeMap<String, String>,
    #[serde(default)]
    cwd: Option<String>,
}

/// The script job that runs `config`: Python starts the command (its environment the job's
/// and the call's, in `cwd` when given) and exits with its code (128 + N for a signal N).
fn wrapper(config: &ProcessConfig) -> String {
    let mut argv = vec![config.cmd.clone()];
    argv.extend(config.args.iter().cloned());
    let spec = json!({"argv": argv, "envs": config.envs, "cwd": config.cwd}).to_string();
    // A JSON string is a Python string literal with the same meaning (serde_json writes no
    // `\/`), so the spec goes in as data, never as code.
    let literal = serde_json::to_string(&spec).unwrap_or_default();
    format!(
        "import json, os, subprocess, sys\n\
         spec = json.loads({literal})\n\
         env = dict(os.environ)\n\
         env.update(spec['envs'])\n\
         try:\n    code = subprocess.call(spec['argv'], env=env, cwd=spec['cwd'] or None)\n\
         except (OSError, ValueError) as e:\n    sys.stderr.write(f\"sandq: cannot start {{spec['argv'][0]}}: {{e}}\\n\")\n    code = 127\n\
         sys.exit(code if code >= 0 else 128 - code)\n"
    )
}

fn pid_counter_key(e2b: &E2b, sandbox: &str) -> String {
    format!("{}:e2b:{{{sandbox}}}:pids", e2b.gateway.names.namespace())
}

fn pid_key(e2b: &E2b, sandbox: &str, pid: u32) -> String {
    format!("{}:e2b:{{{sandbox}}}:pid:{pid}", e2b.gateway.names.namespace())
}

/// The call's deadline (`Connect-Timeout-Ms`), whole seconds rounded up.
fn deadline_s(headers: &HeaderMap) -> Option<u64> {
    let ms: u64 = headers.get("connect-timeout-ms")?.to_str().ok()?.trim().parse().ok()?;
    Some(ms.div_ceil(1000).max(1))
}

/// `process.Process/Start`: the command as a job; its events streamed.
pub(super) async fn start(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refused> {
    // A sandbox that is gone is E2B's proxy's 502 (the SDK reports it ended).
    let (caller, record) = plane_caller(&e2b, caller, &headers).await?;
    let id = record.id.clone();
    let bytes = match tokio::time::timeout(e2b.gateway.settings.read_timeout, axum::body::to_bytes(body, MAX_REQUEST_BYTES)).await {
        Ok(Ok(b)) => b,
        Ok(Err(_)) => return Err(failed_stream(Code::ResourceExhausted, format!("the request is over {MAX_REQUEST_BYTES} bytes")).into()),
        Err(_) => return Err(failed_stream(Code::DeadlineExceeded, "the request came too slowly").into()),
    };
    let request: StartRequest = match unenvelope(&bytes).map(serde_json::from_slice) {
        Some(Ok(r)) => r,
        Some(Err(e)) => return Err(failed_stream(Code::InvalidArgument, format!("invalid request: {e}")).into()),
        None => return Err(failed_stream(Code::InvalidArgument, "the request is not one Connect envelope").into()),
    };
    if request.process.cmd.is_empty() {
        return Err(failed_stream(Code::InvalidArgument, "process.cmd is empty").into());
    }
    let Some(rest) = e2b.rest(&headers) else { return Err(failed_stream(Code::Unauthenticated, "invalid access token").into()) };
    let longest = MAX_CELL_S.min(caller.key.quotas.max_timeout.as_secs()).max(1);
    let left_s = record.end_ms.saturating_sub(now_ms()) / 1000;
    let timeout = deadline_s(&headers).unwrap_or(longest).min(left_s.max(1)).min(longest);
    let job_id = uuid::Uuid::new_v4().to_string();
    let job = json!({
        "job_id": job_id,
        "sku": record.sku,
        "runtime": "python",
        "mode": "script",
        "code": wrapper(&request.process),
        "session": id,
        "env": record.envs,
        "timeout": format!("{timeout}s"),
        "compat": "e2b",
    });
    // The pid first (nothing runs yet if the client goes now), then the job is submitted by
    // the task that streams it, which cancels it once its reader is gone.
    let mut redis = e2b.gateway.redis.clone();
    let counter = pid_counter_key(&e2b, &id);
    let counted: redis::RedisResult<(u64, bool)> = redis::pipe()
        .atomic()
        .incr(&counter, 1)
        .expire(&counter, i64::try_from(MAX_CELL_S * 4).unwrap_or(i64::MAX))
        .query_async(&mut redis)
        .await;
    let Ok((n, _)) = counted else { return Err(failed_stream(Code::Unavailable, "cannot number the command now (Redis)").into()) };
    let pid = 1000 + u32::try_from(n % 1_000_000).unwrap_or(0);
    if redis.set_ex::<_, _, ()>(pid_key(&e2b, &id, pid), &job_id, MAX_CELL_S + 60).await.is_err() {
        return Err(failed_stream(Code::Unavailable, "cannot number the command now (Redis)").into());
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(8);
    tokio::spawn(async move {
        if let Err(e) = rest.submit_json(&job).await {
            let _ = tx.send(Ok(end_stream(Some((Code::of_rest(&e), e.summary()))))).await;
            return;
        }
        stream_command(e2b.clone(), rest, id, job_id, pid, tx).await;
    });
    Ok(streaming(Body::from_stream(futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|l| (l, rx)) }))))
}

fn message(event: Value) -> bytes::Bytes {
    envelope(0, &json!({"event": event}))
}

fn data(kind: &str, text: &[u8]) -> bytes::Bytes {
    message(json!({"data": {kind: base64::Engine::encode(&base64::engine::general_purpose::STANDARD, text)}}))
}

/// Feeds one command's envelopes into `tx` until its end; cancels the job when the reader is
/// gone or the sandbox is.
async fn stream_command(
    e2b: Arc<E2b>,
    rest: Rest,
    sandbox: String,
    job_id: String,
    pid: u32,
    tx: tokio::sync::mpsc::Sender<Result<bytes::Bytes, std::io::Error>>,
) {
    if tx.send(Ok(message(json!({"start": {"pid": pid}})))).await.is_err() {
        let _ = rest.cancel(&job_id).await;
        return;
    }
    let mut printed = false;
    let mut ticker = tokio::time::interval(KEEPALIVE);
    ticker.tick().await;
    let mut quiet = 0u32;
    if let Ok(events) = rest.raw_events(&job_id).await {
        let mut events = std::pin::pin!(events);
        loop {
            let out = tokio::select! {
                event = events.next() => match event {
                    Some(Ok(event)) => match event.kind.as_str() {
                        "stdout" | "stderr" => {
                            let text = event.data.get("text").and_then(Value::as_str).unwrap_or_default();
                            printed |= !text.is_empty();
                            quiet = 0;
                            (!text.is_empty()).then(|| data(&event.kind, text.as_bytes()))
                        }
                        "end" => break,
                        _ => None,
                    },
                    _ => break,
                },
                _ = ticker.tick() => {
                    if gone(&e2b, &sandbox).await {
                        let _ = rest.cancel(&job_id).await;
                        let _ = tx.send(Err(std::io::Error::other("the sandbox is gone"))).await;
                        return;
                    }
                    quiet += 1;
                    quiet.is_multiple_of(KEEPALIVE_TICKS).then(|| message(json!({"keepalive": {}})))
                }
                () = tx.closed() => {
                    let _ = rest.cancel(&job_id).await;
                    return;
                }
            };
            if let Some(out) = out {
                if tx.send(Ok(out)).await.is_err() {
                    let _ = rest.cancel(&job_id).await;
                    return;
                }
            }
        }
    }
    let result = match terminal(&rest, &job_id, &tx, || Ok(message(json!({"keepalive": {}})))).await {
        Ok(r) => r,
        Err(Some(e)) => {
            let _ = tx.send(Ok(end_stream(Some((Code::of_rest(&e), e.summary()))))).await;
            return;
        }
        Err(None) => return,
    };
    if gone(&e2b, &sandbox).await {
        let _ = tx.send(Err(std::io::Error::other("the sandbox is gone"))).await;
        return;
    }
    for out in closing(&result, printed) {
        if tx.send(Ok(out)).await.is_err() {
            return;
        }
    }
}

/// Whether the sandbox is killed or past its end (not: Redis did not answer this once).
async fn gone(e2b: &E2b, sandbox: &str) -> bool {
    match e2b.lookup(sandbox).await {
        Ok(None) => true,
        Ok(Some(r)) => r.end_ms <= now_ms(),
        Err(_) => false,
    }
}

/// The last envelopes of a command: its output when no live event carried it, then `end` (or
/// the error the stream ends with) and the end of the stream.
fn closing(result: &JobResult, printed: bool) -> Vec<bytes::Bytes> {
    let mut out = Vec::new();
    if !printed {
        for (kind, captured) in [("stdout", &result.stdout), ("stderr", &result.stderr)] {
            if !captured.text.is_empty() {
                out.push(data(kind, captured.text.as_bytes()));
            }
        }
    }
    let killed = |error: Option<&str>| {
        let mut end = json!({"exitCode": -1, "exited": false, "status": "signal: killed"});
        if let Some(e) = error {
            end["error"] = json!(e);
        }
        end
    };
    let end = match result.status {
        JobStatus::Succeeded | JobStatus::Failed => match (result.exit_code, &result.signal) {
            (Some(code), _) => Some(json!({"exitCode": code, "exited": true, "status": format!("exit status {code}")})),
            (None, Some(signal)) => Some(
                json!({"exitCode": -1, "exited": false, "status": format!("signal: {}", signal.trim_start_matches("SIG").to_lowercase())}),
            ),
            (None, None) => Some(json!({"exitCode": -1, "exited": false, "status": "unknown"})),
        },
        JobStatus::Cancelled => Some(killed(None)),
        JobStatus::OomKilled => Some(killed(Some("out of memory: the sandbox's SKU limit was reached"))),
        _ => None,
    };
    match end {
        Some(end) => {
            out.push(message(json!({"end": end})));
            out.push(end_stream(None));
        }
        None => {
            let (code, what) = match result.status {
                JobStatus::TimedOut => (Code::DeadlineExceeded, "the command ran past its timeout"),
                JobStatus::Rejected => (Code::InvalidArgument, "the command was refused"),
                JobStatus::Expired => (Code::Unavailable, "no worker took the command in time"),
                _ => (Code::Internal, "the command could not run"),
            };
            let reason = result.reason.clone().unwrap_or_else(|| result.status.to_string());
            out.push(end_stream(Some((code, format!("{what}: {reason}")))));
        }
    }
    out
}

#[derive(Debug, Deserialize)]
struct SignalRequest {
    #[serde(default)]
    process: Option<Selector>,
}

#[derive(Debug, Deserialize)]
struct Selector {
    #[serde(default)]
    pid: Option<u32>,
}

/// `process.Process/SendSignal {"process": {"pid"}, "signal"}`: the command's job is cancelled
/// (SIGKILL and SIGTERM alike: a job is stopped whole). `not_found` for a pid the sandbox has
/// no command under.
pub(super) async fn send_signal(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refused> {
    let (_, record) = plane_caller(&e2b, caller, &headers).await?;
    let bytes = match tokio::time::timeout(e2b.gateway.settings.read_timeout, axum::body::to_bytes(body, 64 << 10)).await {
        Ok(Ok(b)) => b,
        _ => return Err(connect_error(Code::InvalidArgument, "the request could not be read (64 KiB at most)").into()),
    };
    let request: SignalRequest = match serde_json::from_slice(&bytes) {
        Ok(r) => r,
        Err(e) => return Err(connect_error(Code::InvalidArgument, format!("invalid request: {e}")).into()),
    };
    let Some(pid) = request.process.and_then(|p| p.pid) else {
        return Err(connect_error(Code::InvalidArgument, "process.pid is required (tags are not carried)").into());
    };
    let mut redis = e2b.gateway.redis.clone();
    let job: Option<String> = redis.get(pid_key(&e2b, &record.id, pid)).await.unwrap_or(None);
    let Some(job) = job else { return Err(connect_error(Code::NotFound, format!("process with pid {pid} not found")).into()) };
    let Some(rest) = e2b.rest(&headers) else { return Err(connect_error(Code::Unauthenticated, "invalid access token").into()) };
    match rest.cancel_existing(&job).await {
        Ok(true) => Ok(Json(json!({})).into_response()),
        Ok(false) => Err(connect_error(Code::NotFound, format!("process with pid {pid} not found (it has ended)")).into()),
        Err(e) if e.is_not_found() => Err(connect_error(Code::NotFound, e.summary()).into()),
        Err(e) => Err(connect_error(Code::of_rest(&e), e.summary()).into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_carry_their_length_and_requests_come_out_whole() {
        let e = envelope(0, &json!({"a": 1}));
        assert_eq!(e[0], 0);
        assert_eq!(u32::from_be_bytes(e[1..5].try_into().expect("test value")) as usize, e.len() - 5);
        assert_eq!(unenvelope(&e), Some(&b"{\"a\":1}"[..]));
        assert_eq!(unenvelope(b"{\"bare\":true}"), Some(&b"{\"bare\":true}"[..]));
        // A length past the body: not a message.
        assert_eq!(unenvelope(&[0, 0, 0, 0, 9, b'{']), None);
        let end = end_stream(Some((Code::NotFound, "x".into())));
        assert_eq!(end[0], END_STREAM);
        let parsed: Value = serde_json::from_slice(&end[5..]).expect("test value");
        assert_eq!(parsed, json!({"error": {"code": "not_found", "message": "x"}}));
    }

    #[test]
    fn the_wrapper_carries_the_command_as_data() {
        let config = ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-l".into(), "-c".into(), "echo \"$X\" '\\n' \u{2028} ''' \"\"\" {}".into()],
            envs: BTreeMap::from([("X".into(), "y".into())]),
            cwd: None,
        };
        let code = wrapper(&config);
        let line = code.lines().find(|l| l.starts_with("spec = json.loads(")).expect("test value");
        let literal = &line["spec = json.loads(".len()..line.len() - 1];
        // The literal decodes (as JSON, which Python reads alike) to the spec with the argv.
        let spec: Value = serde_json::from_str(&serde_json::from_str::<String>(literal).expect("test value")).expect("test value");
        assert_eq!(spec["argv"][3], config.args[2]);
        assert_eq!(spec["envs"]["X"], "y");
    }

    #[test]
    fn deadlines_round_up_to_seconds() {
        let mut h = HeaderMap::new();
        assert_eq!(deadline_s(&h), None);
        h.insert("connect-timeout-ms", HeaderValue::from_static("60000"));
        assert_eq!(deadline_s(&h), Some(60));
        h.insert("connect-timeout-ms", HeaderValue::from_static("1"));
        assert_eq!(deadline_s(&h), Some(1));
    }
}
