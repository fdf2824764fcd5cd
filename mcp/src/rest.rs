//! The gateway's REST API (docs/gateway.md) as the MCP tools use it: typed calls made with one
//! API key over a [`Transport`] (the gateway's own router in-process, or HTTP to a gateway).
//!
//! Every answer is read bounded ([`MAX_JSON_BYTES`], or the caller's limit for file bytes), and
//! every error the gateway gives keeps its RFC 9457 problem `type` ([`RestError::Problem`]), so
//! a tool can tell "not found" from "over quota" from "the gateway is down".

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt as _, TryStreamExt as _};
use http::{header, HeaderMap, Method, Request, StatusCode};
use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};
pub use sandq_client::http::SessionInfo;
use sandq_schemas::JobResult;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

/// Any error of a transport or a body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A response body, as it arrives.
pub type BodyStream = BoxStream<'static, Result<Bytes, BoxError>>;

/// Largest JSON answer read from the gateway (a JobResult with its inline text is at most a
/// few hundred KiB: 64 KiB of stdout and of stderr, 256 KiB of inline outputs).
pub const MAX_JSON_BYTES: usize = 16 << 20;

/// An HTTP answer of the gateway.
pub struct Reply {
    /// Its status.
    pub status: StatusCode,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its body, streamed.
    pub body: BodyStream,
}

/// Carries REST requests to a gateway. `request`'s URI is a path and query (`/v1/jobs/x`).
pub trait Transport: Send + Sync + 'static {
    /// Sends one request and returns the answer's head with its body still streaming.
    fn send(&self, request: Request<Bytes>) -> BoxFuture<'static, Result<Reply, BoxError>>;
}

/// [`Transport`] over HTTP to a gateway at a base URL (`https://sandq.example.com`).
pub struct HttpTransport {
    base: String,
    http: reqwest::Client,
}

impl HttpTransport {
    /// A transport to the gateway at `base` (no trailing `/` needed), with `http` (its own
    /// time-outs; redirects must not be followed: artifact and file reads are redirects that
    /// [`Rest`] follows itself, bounded).
    pub fn new(base: &str, http: reqwest::Client) -> Self {
        HttpTransport { base: base.trim_end_matches('/').to_owned(), http }
    }
}

impl Transport for HttpTransport {
    fn send(&self, request: Request<Bytes>) -> BoxFuture<'static, Result<Reply, BoxError>> {
        let (parts, body) = request.into_parts();
        let url = format!("{}{}", self.base, parts.uri.path_and_query().map_or("/", |p| p.as_str()));
        let call = self.http.request(parts.method, url).headers(parts.headers).body(body);
        Box::pin(async move {
            let response = call.send().await?;
            let status = response.status();
            let headers = response.headers().clone();
            let body = response.bytes_stream().map_err(|e| Box::new(e) as BoxError).boxed();
            Ok(Reply { status, headers, body })
        })
    }
}

/// A failed REST call.
#[derive(Debug, thiserror::Error)]
pub enum RestError {
    /// The gateway could not be reached, or its answer broke off.
    #[error("the sandq gateway could not be reached: {0}")]
    Transport(BoxError),
    /// The gateway refused the request with a problem document.
    #[error("{title} ({status}): {detail}")]
    Problem {
        /// HTTP status.
        status: u16,
        /// The problem's stable `type` (`urn:sandq:problem:not-found`).
        kind: String,
        /// Its title.
        title: String,
        /// Its detail.
        detail: String,
        /// `Retry-After`, seconds, when given.
        retry_after: Option<u64>,
    },
    /// An answer that is not what the API documents.
    #[error("the gateway's answer could not be read: {0}")]
    Decode(String),
    /// A body over the limit the caller set.
    #[error("{what} is larger than {limit} bytes")]
    TooLarge {
        /// What was read.
        what: String,
        /// The limit, bytes.
        limit: usize,
    },
}

impl RestError {
    /// Whether the gateway answered 404 (no such job, session, file or artifact for the tenant).
    pub fn is_not_found(&self) -> bool {
        matches!(self, RestError::Problem { status: 404, .. })
    }

    /// Whether the request itself was wrong (4xx other than 401, 404, 429): the caller should
    /// change its arguments rather than retry.
    pub fn is_bad_request(&self) -> bool {
        matches!(self, RestError::Problem { status, .. } if (400..500).contains(status) && ![401, 404, 429].contains(status))
    }
}

/// Characters escaped in one path segment (RFC 3986 `pchar` keeps the rest).
const SEGMENT: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b'"')
    .add(b'#')
    .add(b'%')
    .add(b'/')
    .add(b'<')
    .add(b'>')
    .add(b'?')
    .add(b'`')
    .add(b'{')
    .add(b'}')
    .add(b'\\')
    .add(b'^')
    .add(b'|');

/// `path` (`a/b c.csv`) with each `/`-separated segment escaped (`a/b%20c.csv`).
pub fn encode_path(path: &str) -> String {
    path.split('/').map(|s| utf8_percent_encode(s, SEGMENT).to_string()).collect::<Vec<_>>().join("/")
}

/// One file of a session, as `GET /v1/sessions/{name}/files` lists it.
#[derive(Debug, Clone, Deserialize)]
pub struct FileInfo {
    /// Path under `/work`.
    pub path: String,
    /// Bytes.
    pub size: u64,
    /// SHA-256, hex.
    #[serde(default)]
    pub sha256: String,
}

#[derive(Deserialize)]
struct Files {
    files: Vec<FileInfo>,
    #[serde(default)]
    truncated: bool,
}

#[derive(Deserialize)]
struct Sessions {
    sessions: Vec<SessionInfo>,
}

/// One server-sent event of `GET /v1/jobs/{id}/events` (docs/gateway.md "Live events").
#[derive(Debug, Clone)]
pub struct JobEvent {
    /// Its stream id (the resume cursor).
    pub id: Option<String>,
    /// `stdout`, `stderr`, `display`, `attempt`, `started`, `finished`, `truncated`, `end`...
    pub kind: String,
    /// Its JSON data.
    pub data: Value,
}

/// The REST API with one key.
#[derive(Clone)]
pub struct Rest {
    transport: Arc<dyn Transport>,
    key: String,
    fetch: reqwest::Client,
}

impl Rest {
    /// Calls through `transport` with the API key `key`; `fetch` follows the presigned URLs of
    /// artifacts and files (redirects off; its own time-outs).
    pub fn new(transport: Arc<dyn Transport>, key: String, fetch: reqwest::Client) -> Self {
        Rest { transport, key, fetch }
    }

    async fn send(&self, method: Method, path: &str, body: Option<(&str, Bytes)>) -> Result<Reply, RestError> {
        let mut request = Request::builder().method(method).uri(path).header(header::AUTHORIZATION, format!("Bearer {}", self.key));
        let body = match body {
            Some((content_type, bytes)) => {
                request = request.header(header::CONTENT_TYPE, content_type);
                bytes
            }
            None => Bytes::new(),
        };
        let request = request.body(body).map_err(|e| RestError::Decode(format!("request {path}: {e}")))?;
        self.transport.send(request).await.map_err(RestError::Transport)
    }

    /// A JSON answer (2xx), else its problem.
    async fn json<T: DeserializeOwned>(&self, method: Method, path: &str, body: Option<&Value>) -> Result<T, RestError> {
        let body = body.map(|v| ("application/json", Bytes::from(v.to_string())));
        let reply = self.send(method, path, body).await?;
        let reply = ok(reply).await?;
        let bytes = read_bounded(reply.body, MAX_JSON_BYTES, path).await?;
        serde_json::from_slice(&bytes).map_err(|e| RestError::Decode(format!("{path}: {e}")))
    }

    /// `POST /v1/jobs`: submits `job` (the fields of docs/gateway.md); the job as queued.
    ///
    /// # Errors
    /// The gateway's problems (400 invalid, 403/429 quota, 503), or the transport's.
    pub async fn submit(&self, job: &Value) -> Result<JobResult, RestError> {
        self.json(Method::POST, "/v1/jobs", Some(job)).await
    }

    /// `GET /v1/jobs/{id}[?wait=]`: the job now, or once over within `wait`.
    ///
    /// # Errors
    /// 404 for an id the tenant does not have; the transport's.
    pub async fn job(&self, id: &str, wait: Option<Duration>) -> Result<JobResult, RestError> {
        let id = encode_path(id);
        let path = match wait {
            Some(w) => format!("/v1/jobs/{id}?wait={}ms", w.as_millis()),
            None => format!("/v1/jobs/{id}"),
        };
        self.json(Method::GET, &path, None).await
    }

    /// `DELETE /v1/jobs/{id}`: asks for the job to be cancelled. `false` when it was over.
    ///
    /// # Errors
    /// 404; the transport's.
    pub async fn cancel(&self, id: &str) -> Result<bool, RestError> {
        match self.json::<Value>(Method::DELETE, &format!("/v1/jobs/{}", encode_path(id)), None).await {
            Ok(_) => Ok(true),
            Err(RestError::Problem { status: 409, .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// `GET /v1/jobs/{id}/events`: the job's live events, from the start, until `end` (or the
    /// stream's end). Each event's data is bounded by the gateway (1 MiB).
    ///
    /// # Errors
    /// 404, 429 (the key's streams are all open); the transport's.
    pub async fn events(&self, id: &str) -> Result<impl Stream<Item = Result<JobEvent, RestError>> + Send + 'static, RestError> {
        let reply = self.send(Method::GET, &format!("/v1/jobs/{}/events", encode_path(id)), None).await?;
        let reply = ok(reply).await?;
        let body = reply.body.map_err(std::io::Error::other);
        let events = sse_stream::SseStream::from_bytes_stream(body).map(|item| match item {
            Ok(sse) => Ok(JobEvent {
                id: sse.id,
                kind: sse.event.unwrap_or_else(|| "message".into()),
                data: sse.data.as_deref().and_then(|d| serde_json::from_str(d).ok()).unwrap_or(Value::Null),
            }),
            Err(e) => Err(RestError::Transport(Box::new(e))),
        });
        // SSE comments (keep-alives) come through as events with no data and no type.
        Ok(events.filter(|e| std::future::ready(!matches!(e, Ok(JobEvent { kind, data: Value::Null, .. }) if kind == "message"))))
    }

    /// `POST /v1/sessions`: a new session of the tenant named `name` (or a new UUID's).
    ///
    /// # Errors
    /// 400 for a bad name, 429 over `max_sessions`; the transport's.
    pub async fn create_session(&self, name: Option<&str>) -> Result<String, RestError> {
        let body = match name {
            Some(n) => serde_json::json!({ "name": n }),
            None => serde_json::json!({}),
        };
        let created: Value = self.json(Method::POST, "/v1/sessions", Some(&body)).await?;
        created.get("name").and_then(Value::as_str).map(str::to_owned).ok_or_else(|| RestError::Decode("no session name".into()))
    }

    /// `GET /v1/sessions`: the tenant's sessions (at most 1000).
    ///
    /// # Errors
    /// The transport's.
    pub async fn sessions(&self) -> Result<Vec<SessionInfo>, RestError> {
        Ok(self.json::<Sessions>(Method::GET, "/v1/sessions", None).await?.sessions)
    }

    /// `DELETE /v1/sessions/{name}`: its files and state deleted.
    ///
    /// # Errors
    /// 404, 409 (a job of it still runs); the transport's.
    pub async fn delete_session(&self, name: &str) -> Result<(), RestError> {
        let reply = self.send(Method::DELETE, &format!("/v1/sessions/{}", encode_path(name)), None).await?;
        ok(reply).await.map(drop)
    }

    /// `GET /v1/sessions/{name}/files`: its files, and whether the list was cut.
    ///
    /// # Errors
    /// 404; the transport's.
    pub async fn session_files(&self, name: &str) -> Result<(Vec<FileInfo>, bool), RestError> {
        let files: Files = self.json(Method::GET, &format!("/v1/sessions/{}/files", encode_path(name)), None).await?;
        Ok((files.files, files.truncated))
    }

    /// `PUT /v1/sessions/{name}/files/{path}`: `bytes` become the file.
    ///
    /// # Errors
    /// 400 (a bad path), 409 (a job of it runs), 413; the transport's.
    pub async fn write_file(&self, name: &str, path: &str, bytes: impl Into<Bytes>) -> Result<(), RestError> {
        let route = format!("/v1/sessions/{}/files/{}", encode_path(name), encode_path(path));
        let reply = self.send(Method::PUT, &route, Some(("application/octet-stream", bytes.into()))).await?;
        ok(reply).await.map(drop)
    }

    /// A session's file's bytes (at most `max`), through its redirect.
    ///
    /// # Errors
    /// 404; [`RestError::TooLarge`]; the transport's.
    pub async fn read_file(&self, name: &str, path: &str, max: usize) -> Result<Vec<u8>, RestError> {
        self.redirected(&format!("/v1/sessions/{}/files/{}", encode_path(name), encode_path(path)), path, max).await
    }

    /// A job's artifact's bytes (at most `max`), through its redirect.
    ///
    /// # Errors
    /// 404; [`RestError::TooLarge`]; the transport's.
    pub async fn artifact(&self, id: &str, path: &str, max: usize) -> Result<Vec<u8>, RestError> {
        self.redirected(&format!("/v1/jobs/{}/artifacts/{}", encode_path(id), encode_path(path)), path, max).await
    }

    /// A job's rich output's stored representation (`output-<i>-<n>.<ext>`), at most `max`.
    ///
    /// # Errors
    /// 404; [`RestError::TooLarge`]; the transport's.
    pub async fn output(&self, id: &str, name: &str, max: usize) -> Result<Vec<u8>, RestError> {
        self.redirected(&format!("/v1/jobs/{}/outputs/{}", encode_path(id), encode_path(name)), name, max).await
    }

    /// A job's whole `stdout` or `stderr` as stored (at most `max` bytes).
    ///
    /// # Errors
    /// 404 (the stream was empty); [`RestError::TooLarge`]; the transport's.
    pub async fn log(&self, id: &str, stream: &str, max: usize) -> Result<Vec<u8>, RestError> {
        self.redirected(&format!("/v1/jobs/{}/logs/{stream}", encode_path(id)), stream, max).await
    }

    /// A session's file as it comes from storage (not read into memory), through its redirect.
    ///
    /// # Errors
    /// 404; the transport's; storage's answer when not a success.
    pub async fn file_stream(&self, name: &str, path: &str) -> Result<BodyStream, RestError> {
        self.follow(&format!("/v1/sessions/{}/files/{}", encode_path(name), encode_path(path)), path).await
    }

    /// The bytes behind a `307` of the gateway (a presigned URL), at most `max`.
    async fn redirected(&self, route: &str, what: &str, max: usize) -> Result<Vec<u8>, RestError> {
        let body = self.follow(route, what).await?;
        Ok(read_bounded(body, max, what).await?.to_vec())
    }

    /// The body behind a `307` of the gateway (a presigned URL), or the answer's own body.
    async fn follow(&self, route: &str, what: &str) -> Result<BodyStream, RestError> {
        let reply = ok(self.send(Method::GET, route, None).await?).await?;
        let location = reply.headers.get(header::LOCATION).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let Some(url) = location else {
            return Ok(reply.body);
        };
        let response = self.fetch.get(&url).send().await.map_err(|e| RestError::Transport(Box::new(e)))?;
        if !response.status().is_success() {
            return Err(RestError::Decode(format!("{what}: storage answered {}", response.status())));
        }
        Ok(response.bytes_stream().map_err(|e| Box::new(e) as BoxError).boxed())
    }
}

/// `reply` when it is a success (2xx, or a 3xx redirect), else its problem document.
async fn ok(reply: Reply) -> Result<Reply, RestError> {
    if reply.status.is_success() || reply.status.is_redirection() {
        return Ok(reply);
    }
    let status = reply.status.as_u16();
    let retry_after = reply.headers.get(header::RETRY_AFTER).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
    let bytes = read_bounded(reply.body, 64 << 10, "problem").await.unwrap_or_default();
    let problem: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let field = |name: &str| problem.get(name).and_then(Value::as_str).unwrap_or_default().to_owned();
    Err(RestError::Problem {
        status,
        kind: field("type"),
        title: Some(field("title")).filter(|t| !t.is_empty()).unwrap_or_else(|| reply.status.to_string()),
        detail: field("detail"),
        retry_after,
    })
}

/// Reads `body` whole, refusing more than `max` bytes.
async fn read_bounded(mut body: BodyStream, max: usize, what: &str) -> Result<Bytes, RestError> {
    let mut out = bytes::BytesMut::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(RestError::Transport)?;
        if out.len() + chunk.len() > max {
            return Err(RestError::TooLarge { what: what.to_owned(), limit: max });
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_keeps_its_slashes_and_escapes_the_rest() {
        assert_eq!(encode_path("out/a b#1?.csv"), "out/a%20b%231%3F.csv");
        assert_eq!(encode_path("données.csv"), "donn%C3%A9es.csv");
    }
}
