//! The Rust client of the gateway's REST API (docs/gateway.md): [`HttpClient`] talks to
//! `sandq-gateway` with an API key, instead of to the broker, Redis and S3 as the `direct`
//! client does: upload inputs, submit jobs (idempotently), read and wait for them, stream their
//! live events (resuming with `Last-Event-ID`), cancel them, download their artifacts and
//! outputs, make, list, fill, read and delete sessions. The `sandq` CLI (`--url`), the MCP
//! server and the gateway's E2B API all use it.
//!
//! Requests go through a [`Transport`]: [`HttpTransport`] over HTTP ([`HttpClient::new`]), or
//! the gateway's own router in-process ([`HttpClient::with_transport`]). Every answer is read
//! bounded ([`MAX_JSON_BYTES`] for JSON, the caller's limit for file bytes); an artifact's or
//! file's redirect to a presigned URL is followed by hand, once, without the key.
//!
//! Every refusal of the gateway is an RFC 9457 problem document whose `type` becomes a variant
//! of [`HttpError`] (its [`Problem`], slug and status readable). A client made by
//! [`HttpClient::new`] retries a 503 (`unavailable`) and a conflict that asks to be retried
//! (`Retry-After`: a request with the same id under way) after their `Retry-After`, at most
//! [`MAX_TRIES`] times in all, and so a connection that cannot be made; one made with
//! [`HttpClient::with_transport`] tries once unless [`HttpClient::with_max_tries`] says more.

mod error;
mod files;
mod jobs;
mod sessions;
mod sse;
mod transport;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt as _;
use http::{header, Method, Request};
use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};
use reqwest::Url;
use serde::de::DeserializeOwned;

pub use error::{HttpError, Problem};
pub use sessions::{FileInfo, SessionInfo};
pub use sse::{JobEvent, MAX_EVENT_BYTES};
pub use transport::{BodyStream, BoxError, HttpTransport, Reply, RequestTimeout, Transport};

/// The client under the name the MCP server and the gateway's E2B API knew it by.
pub type Rest = HttpClient;

/// The error under the name the MCP server and the gateway's E2B API knew it by.
pub type RestError = HttpError;

/// Tries of one request, the first included, when the gateway answers 503 (or a retryable
/// 409) or cannot be reached: the default of a client made by [`HttpClient::new`].
pub const MAX_TRIES: u32 = 5;

/// Longest pause before a retry, whatever `Retry-After` says.
pub const MAX_RETRY_PAUSE: Duration = Duration::from_secs(10);

/// Longest `?wait=` of one request of [`HttpClient::wait`] (the gateway caps it at its
/// `max_wait`, 60 s by default).
pub const WAIT_STEP: Duration = Duration::from_secs(30);

/// A response (or an event stream) that sends no byte for this long is abandoned (an event
/// stream sends a keep-alive comment every `keep_alive`, 15 s by default); [`HttpClient::new`]'s
/// HTTP client.
pub const READ_TIMEOUT: Duration = Duration::from_secs(90);

/// Largest JSON answer read from the gateway (a JobResult with its inline text is at most a
/// few hundred KiB: 64 KiB of stdout and of stderr, 256 KiB of inline outputs).
pub const MAX_JSON_BYTES: usize = 16 << 20;

/// Largest problem document read from an error answer; the rest is not read.
const MAX_PROBLEM_BYTES: usize = 64 << 10;

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

/// The route of `segments` (`["v1", "jobs", id]` -> `/v1/jobs/<id escaped>`), each escaped as
/// one path segment.
fn route(segments: &[&str]) -> String {
    segments.iter().map(|s| format!("/{}", utf8_percent_encode(s, SEGMENT))).collect()
}

/// A client of one gateway with one API key.
#[derive(Clone)]
pub struct HttpClient {
    transport: Arc<dyn Transport>,
    key: String,
    /// Reads presigned URLs (artifacts, files, outputs), without the key; redirects off.
    fetch: reqwest::Client,
    /// The gateway's URL, when it has one (not in-process): names requests in errors, and
    /// resolves a relative `Location`.
    base: Option<Url>,
    max_tries: u32,
}

impl std::fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("HttpClient").field("base", &self.base.as_ref().map(Url::as_str)).finish_non_exhaustive()
    }
}

/// One request to send (again, on a retry): whole, or streamed from a source made anew each
/// try.
enum Outgoing {
    Whole(Request<Bytes>),
    Streamed(Request<BodyStream>),
}

impl HttpClient {
    /// A client of the gateway at `base_url` (`https://sandq.example.com`, or with a path
    /// prefix) over HTTP, sending `api_key` as `Authorization: Bearer`, retrying as the module
    /// says ([`MAX_TRIES`]). Connects time out after 10 s, reads after [`READ_TIMEOUT`].
    /// Nothing is sent yet.
    ///
    /// # Errors
    /// [`HttpError::Url`] for a URL that is not `http(s)://host[/path]`;
    /// [`HttpError::MissingKey`] for an empty key.
    pub fn new(base_url: &str, api_key: &str) -> Result<Self, HttpError> {
        let bad = |reason: &str| HttpError::Url { url: base_url.to_owned(), reason: reason.to_owned() };
        let base = Url::parse(base_url).map_err(|e| bad(&e.to_string()))?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(bad("the scheme must be http or https"));
        }
        if base.cannot_be_a_base() || base.host().is_none() {
            return Err(bad("it has no host"));
        }
        if base.query().is_some() || base.fragment().is_some() {
            return Err(bad("it has a query or fragment"));
        }
        let key = api_key.trim();
        if key.is_empty() {
            return Err(HttpError::MissingKey);
        }
        // Redirects are not followed: an artifact's presigned URL is fetched without the key.
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(READ_TIMEOUT)
            .user_agent(concat!("sandq-client/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|source| HttpError::transport(base_url, Box::new(source)))?;
        let transport = Arc::new(HttpTransport::new(base.as_str(), http.clone()));
        Ok(HttpClient { transport, key: key.to_owned(), fetch: http, base: Some(base), max_tries: MAX_TRIES })
    }

    /// A client whose requests go through `transport` with the API key `key`, tried once each;
    /// `fetch` follows the presigned URLs of artifacts and files (redirects off; its own
    /// time-outs).
    pub fn with_transport(transport: Arc<dyn Transport>, key: String, fetch: reqwest::Client) -> Self {
        HttpClient { transport, key, fetch, base: None, max_tries: 1 }
    }

    /// This client trying each request at most `tries` times (at least once) when the gateway
    /// answers 503 or a retryable 409, or cannot be reached.
    #[must_use]
    pub fn with_max_tries(mut self, tries: u32) -> Self {
        self.max_tries = tries.max(1);
        self
    }

    /// The gateway's base URL; `None` for a client made [`HttpClient::with_transport`].
    pub fn base_url(&self) -> Option<&Url> {
        self.base.as_ref()
    }

    /// A request to `path` (a route and query) with the key.
    fn request(&self, method: Method, path: &str) -> http::request::Builder {
        Request::builder().method(method).uri(path).header(header::AUTHORIZATION, format!("Bearer {}", self.key))
    }

    /// `path` as errors name it: under the base URL, without its query.
    fn shown(&self, path: &str) -> String {
        let path = path.split('?').next().unwrap_or_default();
        match &self.base {
            Some(base) => format!("{}{path}", base.as_str().trim_end_matches('/')),
            None => path.to_owned(),
        }
    }

    /// Sends the request `make` builds (again on each try) to `path`; the answer when it is a
    /// success (2xx, or a redirect), else the error its problem document stands for. Retried
    /// as the module says, at most this client's tries.
    async fn send(&self, path: &str, make: impl Fn() -> Result<Outgoing, HttpError>) -> Result<Reply, HttpError> {
        let mut tries = 0;
        loop {
            tries += 1;
            let sent = match make()? {
                Outgoing::Whole(request) => self.transport.send(request).await,
                Outgoing::Streamed(request) => self.transport.send_streaming(request).await,
            };
            let error = match sent {
                Ok(reply) if reply.status.is_success() || reply.status.is_redirection() => return Ok(reply),
                Ok(reply) => error_of(reply).await,
                Err(source) => HttpError::transport(&self.shown(path), source),
            };
            match error.retry_pause() {
                Some(pause) if tries < self.max_tries => {
                    tracing::debug!(error = %error, try_ = tries, "retrying the gateway request");
                    tokio::time::sleep(pause).await;
                }
                _ => return Err(error),
            }
        }
    }

    /// Sends a request without a body to `path` (within `timeout` when given).
    async fn send_empty(&self, method: Method, path: &str, timeout: Option<Duration>) -> Result<Reply, HttpError> {
        self.send(path, || {
            let mut request = self.request(method.clone(), path);
            if let Some(timeout) = timeout {
                request = request.extension(RequestTimeout(timeout));
            }
            built(request, Bytes::new(), path)
        })
        .await
    }

    /// The JSON answer of `method path` with `body` (JSON) when given.
    async fn json<T: DeserializeOwned>(&self, method: Method, path: &str, body: Option<&serde_json::Value>) -> Result<T, HttpError> {
        let reply = match body {
            Some(body) => {
                let bytes = Bytes::from(body.to_string());
                self.send(path, || {
                    let request = self.request(method.clone(), path).header(header::CONTENT_TYPE, "application/json");
                    built(request, bytes.clone(), path)
                })
                .await?
            }
            None => self.send_empty(method, path, None).await?,
        };
        json_of(reply, path).await
    }
}

/// The request `builder` makes with `body`, to send whole.
fn built(builder: http::request::Builder, body: Bytes, path: &str) -> Result<Outgoing, HttpError> {
    builder.body(body).map(Outgoing::Whole).map_err(|e| HttpError::Malformed { what: path.to_owned(), reason: e.to_string() })
}

/// The error an unsuccessful answer stands for: its problem document, else its status.
async fn error_of(reply: Reply) -> HttpError {
    let status = reply.status.as_u16();
    let retry_after = reply.headers.get(header::RETRY_AFTER).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
    let body = read_bounded(reply.body, MAX_PROBLEM_BYTES, "problem").await.unwrap_or_default();
    match serde_json::from_slice::<Problem>(&body) {
        Ok(mut problem) if !problem.kind.is_empty() => {
            problem.retry_after = problem.retry_after.or(retry_after);
            HttpError::from_problem(status, problem)
        }
        _ => HttpError::Status { status, body: String::from_utf8_lossy(&body).chars().take(300).collect() },
    }
}

/// A successful answer's JSON body (at most [`MAX_JSON_BYTES`]); `what` names the request.
async fn json_of<T: DeserializeOwned>(reply: Reply, what: &str) -> Result<T, HttpError> {
    let body = read_bounded(reply.body, MAX_JSON_BYTES, what).await?;
    serde_json::from_slice(&body).map_err(|source| HttpError::Decode { what: what.to_owned(), source })
}

/// Reads `body` whole, refusing more than `max` bytes ([`HttpError::TooLarge`]).
async fn read_bounded(mut body: BodyStream, max: usize, what: &str) -> Result<Bytes, HttpError> {
    let mut out = bytes::BytesMut::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|source| HttpError::transport(what, source))?;
        if out.len() + chunk.len() > max {
            return Err(HttpError::TooLarge { what: what.to_owned(), limit: max });
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out.freeze())
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use sandq_schemas::{Artifact, JobResult, JobSpec, JobStatus, Runtime, Sku};
    use serde_json::json;
    use tokio::io::AsyncWriteExt as _;

    use super::*;

    #[test]
    fn a_path_keeps_its_slashes_and_escapes_the_rest() {
        assert_eq!(encode_path("out/a b#1?.csv"), "out/a%20b%231%3F.csv");
        assert_eq!(encode_path("donn\u{e9}es.csv"), "donn%C3%A9es.csv");
    }

    /// A loopback stand-in for the gateway that answers each request with the next of
    /// `answers` (status, `Retry-After`, body; the last one again once they run out) and
    /// records each request's `Idempotency-Key` and body.
    async fn canned(answers: Vec<(u16, Option<u64>, String)>) -> (String, std::sync::Arc<std::sync::Mutex<Vec<(String, Vec<u8>)>>>) {
        use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = seen.clone();
        tokio::spawn(async move {
            for n in 0.. {
                let Ok((stream, _)) = listener.accept().await else { return };
                let mut reader = tokio::io::BufReader::new(stream);
                let (mut length, mut key) = (0usize, String::new());
                loop {
                    let mut line = String::new();
                    reader.read_line(&mut line).await.expect("a header line");
                    let line = line.trim_end().to_ascii_lowercase();
                    if line.is_empty() {
                        break;
                    }
                    if let Some(v) = line.strip_prefix("content-length:") {
                        length = v.trim().parse().expect("a length");
                    }
                    if let Some(v) = line.strip_prefix("idempotency-key:") {
                        key = v.trim().to_owned();
                    }
                }
                let mut body = vec![0; length];
                reader.read_exact(&mut body).await.expect("the body");
                record.lock().expect("lock").push((key, body));
                let (status, retry_after, text) = answers[n.min(answers.len() - 1)].clone();
                let retry = retry_after.map(|s| format!("retry-after: {s}\r\n")).unwrap_or_default();
                let answer = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{retry}connection: close\r\n\r\n{text}",
                    text.len()
                );
                let mut stream = reader.into_inner();
                stream.write_all(answer.as_bytes()).await.expect("answer");
                let _ = stream.shutdown().await;
            }
        });
        (base, seen)
    }

    fn problem_body(slug: &str, status: u16) -> String {
        json!({"type": format!("urn:sandq:problem:{slug}"), "title": "t", "status": status, "detail": "d"}).to_string()
    }

    #[tokio::test]
    async fn a_submission_answered_503_is_sent_again_with_the_same_key_and_body_a_bounded_number_of_times() {
        let spec = JobSpec::new("job-7", Sku::S, Runtime::Python, "print(1)");
        let queued = serde_json::to_string(&JobResult::new("job-7", JobStatus::Queued)).expect("JSON");
        let (base, seen) = canned(vec![
            (503, Some(1), problem_body("unavailable", 503)),
            (503, Some(1), problem_body("unavailable", 503)),
            (201, None, queued),
        ])
        .await;
        let client = HttpClient::new(&base, "sq_k").expect("a client");
        let started = Instant::now();
        let (result, new) = client.submit(&spec).await.expect("submitted on the third try");
        assert_eq!((result.job_id.as_str(), result.status, new), ("job-7", JobStatus::Queued, true));
        assert!(started.elapsed() >= Duration::from_secs(2), "each retry waited its Retry-After");
        let seen = seen.lock().expect("lock").clone();
        assert_eq!(seen.len(), 3);
        assert!(seen.iter().all(|(key, body)| key == "job-7" && *body == seen[0].1), "{seen:?}");

        // Always 503: given up after MAX_TRIES, as `unavailable`.
        let (base, seen) = canned(vec![(503, Some(1), problem_body("unavailable", 503))]).await;
        let error = HttpClient::new(&base, "sq_k").expect("a client").submit(&spec).await.expect_err("never accepted");
        assert!(matches!(error, HttpError::Unavailable(_)), "{error}");
        assert_eq!(seen.lock().expect("lock").len(), MAX_TRIES as usize);

        // Any other problem is not retried.
        let (base, seen) = canned(vec![(429, Some(30), problem_body("quota-exceeded", 429))]).await;
        let error = HttpClient::new(&base, "sq_k").expect("a client").submit(&spec).await.expect_err("over quota");
        assert!(matches!(&error, HttpError::QuotaExceeded(p) if p.retry_after == Some(30)), "{error}");
        assert!(error.to_string().ends_with("(429 quota-exceeded); retry after 30 s"), "{error}");
        assert_eq!(seen.lock().expect("lock").len(), 1);
    }

    #[test]
    fn a_result_as_the_gateway_shows_it_decodes_whole() {
        let mut result = JobResult::new("j-1", JobStatus::Succeeded);
        result.exit_code = Some(0);
        result.stdout.text = "hi\n".into();
        result.queued_at_ms = Some(1_733_150_000_000);
        result.artifacts = vec![Artifact {
            path: "out/a b.bin".into(),
            key: "jobs/j-1/a1/artifacts/out/a b.bin".into(),
            size: 3,
            sha256: "0".repeat(64),
            content_type: "application/octet-stream".into(),
            url: Some("http://s3/x?sig=1".into()),
            url_expires_at_ms: Some(1),
        }];
        let shown = serde_json::to_vec(&result).expect("JSON");
        assert_eq!(serde_json::from_slice::<JobResult>(&shown).expect("decodes"), result);
    }

    #[test]
    fn the_base_url_keeps_its_path_and_segments_are_encoded() {
        assert_eq!(route(&["v1", "jobs", "a b/c#?"]), "/v1/jobs/a%20b%2Fc%23%3F");
        let client = HttpClient::new("http://127.0.0.1:8080/prefix/", "sq_k").expect("a client");
        assert_eq!(client.shown("/v1/jobs/x?wait=5ms"), "http://127.0.0.1:8080/prefix/v1/jobs/x");
        let client = HttpClient::new("https://sandq.example.com", "sq_k").expect("a client");
        assert_eq!(client.shown(&route(&["v1", "files"])), "https://sandq.example.com/v1/files");
        assert!(matches!(HttpClient::new("ftp://x", "k"), Err(HttpError::Url { .. })));
        assert!(matches!(HttpClient::new("http://x?a=1", "k"), Err(HttpError::Url { .. })));
        assert!(matches!(HttpClient::new("http://x", " "), Err(HttpError::MissingKey)));
    }
}
