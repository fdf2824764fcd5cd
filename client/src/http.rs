//! The Rust client over HTTP: [`HttpClient`] talks to `sandq-gateway` (docs/gateway.md) with an
//! API key, instead of to the broker, Redis and S3 as [`crate::Client`] does: upload inputs,
//! submit jobs (idempotently), read and wait for them, stream their live events (resuming with
//! `Last-Event-ID`), cancel them, download their artifacts, list and delete sessions.
//!
//! Every refusal of the gateway is an RFC 9457 problem document whose `type` becomes a variant
//! of [`HttpError`]. A 503 (`unavailable`) and a conflict that asks to be retried (`Retry-After`:
//! a request with the same id under way) are retried after their `Retry-After`, at most
//! [`MAX_TRIES`] times in all; so is a connection that cannot be made.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::Stream;
use reqwest::{header, Method, RequestBuilder, Response, StatusCode, Url};
use sandq_core::events::{Event, EventKind};
use sandq_schemas::names::input_key;
use sandq_schemas::{Artifact, InputFile, JobResult, JobSpec, JobStatus};
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::Digest as _;
use tokio::io::AsyncWriteExt as _;

/// Tries of one request, the first included, when the gateway answers 503 (or a retryable
/// 409) or cannot be reached.
pub const MAX_TRIES: u32 = 5;

/// Longest pause before a retry, whatever `Retry-After` says.
pub const MAX_RETRY_PAUSE: Duration = Duration::from_secs(10);

/// Longest `?wait=` of one request of [`HttpClient::wait`] (the gateway caps it at its
/// `max_wait`, 60 s by default).
pub const WAIT_STEP: Duration = Duration::from_secs(30);

/// A response (or an event stream) that sends no byte for this long is abandoned (an event
/// stream sends a keep-alive comment every `keep_alive`, 15 s by default).
pub const READ_TIMEOUT: Duration = Duration::from_secs(90);

/// Largest single server-sent event read (a display's JSON included); a larger one is dropped.
pub const MAX_EVENT_BYTES: usize = 64 << 20;

/// A problem document (RFC 9457) as the gateway sends it (docs/gateway.md "Errors").
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct Problem {
    /// `urn:sandq:problem:<slug>`.
    #[serde(rename = "type", default)]
    pub kind: String,
    /// The type's summary.
    #[serde(default)]
    pub title: String,
    /// The HTTP status.
    #[serde(default)]
    pub status: u16,
    /// What was wrong with this request.
    #[serde(default)]
    pub detail: String,
    /// Seconds to wait before trying again (`Retry-After`), when the gateway says.
    #[serde(default)]
    pub retry_after: Option<u64>,
}

impl Problem {
    /// The type's slug (`not-found`), or the whole type when it is not sandq's.
    pub fn slug(&self) -> &str {
        self.kind.strip_prefix("urn:sandq:problem:").unwrap_or(&self.kind)
    }
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({} {})", self.detail, self.status, self.slug())?;
        match self.retry_after {
            Some(seconds) if self.status == 429 => write!(f, "; retry after {seconds} s"),
            _ => Ok(()),
        }
    }
}

/// Failure of an [`HttpClient`] operation: a problem the gateway answered (one variant per
/// `type`), or a failure on this side.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// 401 `unauthorized`: no key, or a malformed, unknown or revoked one.
    #[error("the gateway refused the API key: {0}")]
    Unauthorized(Problem),
    /// 400 `invalid-request`: the request or a value in it is not valid.
    #[error("the gateway refused the request: {0}")]
    InvalidRequest(Problem),
    /// 415 `unsupported-media-type`.
    #[error("the gateway refused the body's type: {0}")]
    UnsupportedMediaType(Problem),
    /// 413 `body-too-large`: over the gateway's `max_body_bytes`, or the key's largest upload.
    #[error("the request is too large for the gateway: {0}")]
    BodyTooLarge(Problem),
    /// 408 `body-timeout`: the body did not arrive in time.
    #[error("the gateway timed out reading the request: {0}")]
    BodyTimeout(Problem),
    /// 403 `forbidden-by-quota`: more than the key may ever do (SKU, timeout, network).
    #[error("the API key may not do this: {0}")]
    ForbiddenByQuota(Problem),
    /// 429 `quota-exceeded`: over a rate or count now; `retry_after` says when to try again.
    #[error("over the API key's quota: {0}")]
    QuotaExceeded(Problem),
    /// 404 `not-found`: no such job (or session, file, artifact) for this key's tenant.
    #[error("not found: {0}")]
    NotFound(Problem),
    /// 409 `conflict`: the id was used with another body, or the job is over, or the session
    /// is in use.
    #[error("conflict: {0}")]
    Conflict(Problem),
    /// 405 `method-not-allowed`.
    #[error("the gateway does not allow this method here: {0}")]
    MethodNotAllowed(Problem),
    /// 503 `unavailable`, still after [`MAX_TRIES`] tries.
    #[error("the gateway is unavailable, still after retries: {0}")]
    Unavailable(Problem),
    /// A problem of a type this client does not know.
    #[error("the gateway answered a problem: {0}")]
    OtherProblem(Problem),
    /// An error status without a problem document (a proxy's page, say).
    #[error("the gateway answered {status}: {body}")]
    Status {
        /// The HTTP status.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// The gateway could not be reached, or the connection failed mid-answer.
    #[error("cannot reach {url}")]
    Transport {
        /// The request's URL (no key in it).
        url: String,
        /// reqwest's error.
        #[source]
        source: reqwest::Error,
    },
    /// An answer that is not the documented JSON.
    #[error("the gateway's answer to {what} is not the documented JSON: {source}")]
    Decode {
        /// What was asked.
        what: &'static str,
        /// serde's error.
        #[source]
        source: serde_json::Error,
    },
    /// The base URL is not an `http` or `https` URL that can have a path.
    #[error("the gateway URL {url:?} is not valid: {reason}")]
    Url {
        /// The URL as given.
        url: String,
        /// Why.
        reason: String,
    },
    /// No API key was given.
    #[error("no API key: the gateway needs one (sq_...)")]
    MissingKey,
    /// The job has a field the HTTP API cannot carry.
    #[error("the gateway cannot take {field}: {reason}")]
    Unsupported {
        /// The JobSpec field.
        field: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// A local file could not be read or written.
    #[error("{path}: {source}")]
    Local {
        /// The local path.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A download did not match the artifact's size or SHA-256.
    #[error("download of {path} does not match its record: {reason}")]
    Mismatch {
        /// The artifact's path.
        path: String,
        /// What differed.
        reason: String,
    },
    /// An artifact path would leave the download folder.
    #[error("artifact path {path:?} is unsafe")]
    UnsafeArtifactPath {
        /// The path.
        path: String,
    },
    /// A stored output representation with no presigned URL (the worker presigns none), which
    /// the gateway has no route for.
    #[error("output file {key} has no URL to download it from")]
    NoUrl {
        /// Its S3 key.
        key: String,
    },
    /// A redirect without a usable `Location`.
    #[error("the gateway's redirect for {path} has no usable Location")]
    BadRedirect {
        /// The artifact's path.
        path: String,
    },
    /// Waiting ended before the job did.
    #[error("job {job_id} did not finish within {}", humantime::format_duration(Duration::from_secs(waited.as_secs())))]
    WaitTimeout {
        /// The job.
        job_id: String,
        /// How long we waited.
        waited: Duration,
    },
}

impl HttpError {
    /// A transport error of a request to `url` (reqwest's own message without the URL, which
    /// this one names).
    fn transport(url: &str, source: reqwest::Error) -> HttpError {
        HttpError::Transport { url: url.to_owned(), source: source.without_url() }
    }

    /// The problem document the gateway sent, when the error is one.
    pub fn problem(&self) -> Option<&Problem> {
        match self {
            HttpError::Unauthorized(p)
            | HttpError::InvalidRequest(p)
            | HttpError::UnsupportedMediaType(p)
            | HttpError::BodyTooLarge(p)
            | HttpError::BodyTimeout(p)
            | HttpError::ForbiddenByQuota(p)
            | HttpError::QuotaExceeded(p)
            | HttpError::NotFound(p)
            | HttpError::Conflict(p)
            | HttpError::MethodNotAllowed(p)
            | HttpError::Unavailable(p)
            | HttpError::OtherProblem(p) => Some(p),
            _ => None,
        }
    }

    /// The error a problem document of `status` stands for, by its `type` (by the status
    /// when the type is not one of sandq's).
    pub fn from_problem(status: u16, mut problem: Problem) -> HttpError {
        if problem.status == 0 {
            problem.status = status;
        }
        let slug = if problem.kind.starts_with("urn:sandq:problem:") { problem.slug().to_owned() } else { String::new() };
        match (slug.as_str(), status) {
            ("unauthorized", _) | ("", 401) => HttpError::Unauthorized(problem),
            ("invalid-request", _) | ("", 400) => HttpError::InvalidRequest(problem),
            ("unsupported-media-type", _) | ("", 415) => HttpError::UnsupportedMediaType(problem),
            ("body-too-large", _) | ("", 413) => HttpError::BodyTooLarge(problem),
            ("body-timeout", _) | ("", 408) => HttpError::BodyTimeout(problem),
            ("forbidden-by-quota", _) | ("", 403) => HttpError::ForbiddenByQuota(problem),
            ("quota-exceeded", _) | ("", 429) => HttpError::QuotaExceeded(problem),
            ("not-found", _) | ("", 404) => HttpError::NotFound(problem),
            ("conflict", _) | ("", 409) => HttpError::Conflict(problem),
            ("method-not-allowed", _) | ("", 405) => HttpError::MethodNotAllowed(problem),
            ("unavailable", _) | ("", 503) => HttpError::Unavailable(problem),
            _ => HttpError::OtherProblem(problem),
        }
    }

    /// How long to pause before trying the request again, when it should be: a 503, or a 409
    /// that carries `Retry-After` (a request with the same id under way; a session's job
    /// running), or no connection.
    fn retry_pause(&self) -> Option<Duration> {
        let pause = |p: &Problem| Duration::from_secs(p.retry_after.unwrap_or(1).max(1)).min(MAX_RETRY_PAUSE);
        match self {
            HttpError::Unavailable(p) => Some(pause(p)),
            HttpError::Conflict(p) if p.retry_after.is_some() => Some(pause(p)),
            HttpError::Transport { source, .. } if source.is_connect() => Some(Duration::from_secs(1)),
            _ => None,
        }
    }
}

/// A session of the key's tenant, as `GET /v1/sessions` lists it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct SessionInfo {
    /// Its name (the tenant's, without prefix).
    pub name: String,
    /// Files in it.
    #[serde(default)]
    pub files: u64,
    /// Their bytes.
    #[serde(default)]
    pub bytes: u64,
    /// When it expires unless a job uses it, Unix epoch ms; `None` before its first job.
    #[serde(default)]
    pub expires_at_ms: Option<u64>,
    /// Notebook cells run in it.
    #[serde(default)]
    pub execution_count: u64,
}

/// A client of one gateway with one API key.
#[derive(Clone)]
pub struct HttpClient {
    base: Url,
    key: String,
    /// Redirects are not followed: an artifact's presigned URL is fetched without the key.
    http: reqwest::Client,
}

impl std::fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("HttpClient").field("base", &self.base.as_str()).finish_non_exhaustive()
    }
}

impl HttpClient {
    /// A client of the gateway at `base_url` (`https://sandq.example.com`, or with a path
    /// prefix), sending `api_key` as `Authorization: Bearer`. Nothing is sent yet.
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
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(READ_TIMEOUT)
            .user_agent(concat!("sandq-client/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|source| HttpError::transport(base_url, source))?;
        Ok(HttpClient { base, key: key.to_owned(), http })
    }

    /// The gateway's base URL.
    pub fn base_url(&self) -> &Url {
        &self.base
    }

    /// The URL of `segments` under the base (each percent-encoded as one path segment).
    fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        url
    }

    fn request(&self, method: Method, url: Url) -> RequestBuilder {
        self.http.request(method, url).bearer_auth(&self.key)
    }

    /// Sends the request `build` makes, again after a pause while the gateway answers a
    /// retryable problem or cannot be reached (at most [`MAX_TRIES`] tries). Returns a 2xx or
    /// 3xx response; any other becomes its [`HttpError`].
    async fn send(&self, build: impl Fn() -> Result<RequestBuilder, HttpError>) -> Result<Response, HttpError> {
        let mut tries = 0;
        loop {
            tries += 1;
            let request = build()?.build().map_err(|source| HttpError::transport(self.base.as_str(), source))?;
            let url = request.url().to_string();
            let error = match self.http.execute(request).await {
                Ok(response) if response.status().is_success() || response.status().is_redirection() => return Ok(response),
                Ok(response) => error_of(response).await,
                Err(source) => HttpError::transport(&url, source),
            };
            match error.retry_pause() {
                Some(pause) if tries < MAX_TRIES => {
                    tracing::debug!(error = %error, try_ = tries, "retrying the gateway request");
                    tokio::time::sleep(pause).await;
                }
                _ => return Err(error),
            }
        }
    }

    /// Uploads a local file (`POST /v1/files`, streamed) and returns the input entry that
    /// stages it at `sandbox_path` (relative to `/work`) in a job of this tenant.
    ///
    /// # Errors
    /// [`HttpError::Local`] when the file cannot be read; [`HttpError::BodyTooLarge`] over the
    /// key's `max_upload_bytes`; any other of the gateway's.
    pub async fn upload(&self, local: &Path, sandbox_path: &str) -> Result<InputFile, HttpError> {
        let local_error = |source| HttpError::Local { path: local.display().to_string(), source };
        let size = std::fs::metadata(local).map_err(local_error)?.len();
        let response = self
            .send(|| {
                let file = std::fs::File::open(local).map_err(local_error)?;
                Ok(self
                    .request(Method::POST, self.url(&["v1", "files"]))
                    .header(header::CONTENT_TYPE, "application/octet-stream")
                    .header(header::CONTENT_LENGTH, size)
                    .body(reqwest::Body::from(tokio::fs::File::from_std(file))))
            })
            .await?;
        #[derive(Deserialize)]
        struct Uploaded {
            file_id: String,
            size: u64,
        }
        let uploaded: Uploaded = json_of(response, "POST /v1/files").await?;
        Ok(InputFile { key: input_key(&uploaded.file_id), path: sandbox_path.to_owned(), size: uploaded.size, sha256: uploaded.file_id })
    }

    /// The body of `POST /v1/jobs` for `spec` (docs/gateway.md "Endpoints"): its id, runtime,
    /// code and options, its inputs by `file_id` (their SHA-256, as [`HttpClient::upload`]
    /// returns them). `submitted_at_ms` is the gateway's to set.
    ///
    /// # Errors
    /// [`HttpError::Unsupported`] for what the API cannot carry: an `entrypoint` job, no code,
    /// a `stdin` that is not UTF-8.
    pub fn submit_body(spec: &JobSpec) -> Result<Value, HttpError> {
        if spec.entrypoint.is_some() {
            return Err(HttpError::Unsupported { field: "entrypoint", reason: "the HTTP API runs code only" });
        }
        let Some(code) = &spec.code else {
            return Err(HttpError::Unsupported { field: "the job", reason: "it has no code" });
        };
        let mut fields = serde_json::Map::new();
        fields.insert("job_id".into(), json!(spec.job_id));
        fields.insert("runtime".into(), json!(spec.runtime));
        fields.insert("code".into(), json!(code));
        fields.insert("sku".into(), json!(spec.sku));
        fields.insert("network".into(), json!(spec.network));
        if !spec.args.is_empty() {
            fields.insert("args".into(), json!(spec.args));
        }
        if let Some(stdin) = &spec.stdin {
            let text = std::str::from_utf8(stdin)
                .map_err(|_| HttpError::Unsupported { field: "stdin", reason: "the HTTP API takes stdin as UTF-8 text only" })?;
            fields.insert("stdin".into(), json!(text));
        }
        if !spec.env.is_empty() {
            fields.insert("env".into(), json!(spec.env));
        }
        for (name, value) in [("timeout", &spec.timeout), ("result_ttl", &spec.result_ttl), ("session", &spec.session)] {
            if let Some(value) = value {
                fields.insert(name.into(), json!(value));
            }
        }
        if let Some(mode) = spec.mode {
            fields.insert("mode".into(), json!(mode));
        }
        if let Some(deadline) = spec.deadline_ms {
            fields.insert("deadline_ms".into(), json!(deadline));
        }
        if !spec.inputs.is_empty() {
            let inputs: Vec<Value> = spec.inputs.iter().map(|i| json!({"file_id": i.sha256, "path": i.path})).collect();
            fields.insert("inputs".into(), Value::Array(inputs));
        }
        Ok(Value::Object(fields))
    }

    /// Submits `spec` (`POST /v1/jobs`) with `Idempotency-Key` its id, so that a retry (after
    /// a 503, or a lost answer) finds the first job instead of making another. Returns the
    /// job as the gateway answered (`queued`, or as it is when this id was submitted before
    /// with the same body) and whether it is new (201).
    ///
    /// # Errors
    /// [`HttpError::Conflict`] when the id was used with another body; the quota problems;
    /// any other of the gateway's or of [`HttpClient::submit_body`].
    pub async fn submit(&self, spec: &JobSpec) -> Result<(JobResult, bool), HttpError> {
        let body = serde_json::to_vec(&Self::submit_body(spec)?).map_err(|source| HttpError::Decode { what: "the job", source })?;
        let response = self
            .send(|| {
                Ok(self
                    .request(Method::POST, self.url(&["v1", "jobs"]))
                    .header(header::CONTENT_TYPE, "application/json")
                    .header("Idempotency-Key", &spec.job_id)
                    .timeout(Duration::from_secs(120))
                    .body(body.clone()))
            })
            .await?;
        let new = response.status() == StatusCode::CREATED;
        Ok((json_of(response, "POST /v1/jobs").await?, new))
    }

    /// `GET /v1/jobs/{id}`, waiting up to `wait` on the gateway for the job to end.
    async fn get_job(&self, job_id: &str, wait: Duration) -> Result<JobResult, HttpError> {
        let mut url = self.url(&["v1", "jobs", job_id]);
        if !wait.is_zero() {
            url.query_pairs_mut().append_pair("wait", &format!("{}ms", wait.as_millis()));
        }
        let response = self.send(|| Ok(self.request(Method::GET, url.clone()).timeout(wait + Duration::from_secs(60)))).await?;
        json_of(response, "GET /v1/jobs/{id}").await
    }

    /// The job's current result (`queued` until a worker takes it); `None` when this tenant
    /// has no such job (or its result expired).
    ///
    /// # Errors
    /// The gateway's (but `not-found`).
    pub async fn status(&self, job_id: &str) -> Result<Option<JobResult>, HttpError> {
        match self.get_job(job_id, Duration::ZERO).await {
            Ok(result) => Ok(Some(result)),
            Err(HttpError::NotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Waits until the job's status is terminal or `timeout` passes (`?wait=` requests of at
    /// most [`WAIT_STEP`]), calling `on_change` each time the status changes. A gateway that
    /// cannot be reached for a while (a restart) is asked again until `timeout`.
    ///
    /// # Errors
    /// [`HttpError::WaitTimeout`]; [`HttpError::NotFound`] for a job the tenant does not have;
    /// any other of the gateway's.
    pub async fn wait(
        &self,
        job_id: &str,
        timeout: Duration,
        mut on_change: impl FnMut(Option<JobStatus>),
    ) -> Result<JobResult, HttpError> {
        let started = Instant::now();
        let mut last = None;
        loop {
            let step = timeout.saturating_sub(started.elapsed()).min(WAIT_STEP);
            match self.get_job(job_id, step).await {
                Ok(result) => {
                    if last != Some(result.status) {
                        on_change(Some(result.status));
                        last = Some(result.status);
                    }
                    if result.status.is_terminal() {
                        return Ok(result);
                    }
                }
                Err(e @ (HttpError::Transport { .. } | HttpError::Unavailable(_))) if started.elapsed() < timeout => {
                    tracing::warn!(error = %e, "cannot read the job yet; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(e) => return Err(e),
            }
            let elapsed = started.elapsed();
            if elapsed >= timeout {
                return Err(HttpError::WaitTimeout { job_id: job_id.to_owned(), waited: elapsed });
            }
        }
    }

    /// Asks for the job to be cancelled (`DELETE /v1/jobs/{id}`): a queued job is not run, a
    /// running one is killed within about a second. False when the job is over, or this
    /// tenant has no such job.
    ///
    /// # Errors
    /// The gateway's (but `not-found` and `conflict`).
    pub async fn cancel(&self, job_id: &str) -> Result<bool, HttpError> {
        match self.send(|| Ok(self.request(Method::DELETE, self.url(&["v1", "jobs", job_id])).timeout(Duration::from_secs(60)))).await {
            Ok(_) => Ok(true),
            Err(HttpError::NotFound(_) | HttpError::Conflict(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Opens the job's event stream after `cursor` (`Last-Event-ID`), or from the first.
    async fn open_events(&self, job_id: &str, cursor: Option<&str>) -> Result<Response, HttpError> {
        self.send(|| {
            let mut request =
                self.request(Method::GET, self.url(&["v1", "jobs", job_id, "events"])).header(header::ACCEPT, "text/event-stream");
            if let Some(cursor) = cursor {
                request = request.header("Last-Event-ID", cursor);
            }
            Ok(request)
        })
        .await
    }

    /// The job's live events (`GET /v1/jobs/{id}/events`, docs/gateway.md "Live events") from
    /// after `cursor` (an event's `id`; `None`: from the first), as they come. A connection
    /// that drops, or a stream the gateway ends before the job's `end` (its `max_stream_life`),
    /// is opened again after the last event read (`Last-Event-ID`): no gap, no duplicate. The
    /// stream ends after `end`, or once the job is over with nothing more to read; an error
    /// the gateway answers to opening it (401, 404...) is its last item. The caller bounds the
    /// whole with a time-out of its own.
    pub fn events<'a>(&'a self, job_id: &'a str, cursor: Option<&str>) -> impl Stream<Item = Result<Event, HttpError>> + 'a {
        struct State<'a> {
            client: &'a HttpClient,
            job_id: &'a str,
            cursor: Option<String>,
            response: Option<Response>,
            parser: SseParser,
            page: VecDeque<Event>,
            done: bool,
        }
        let state = State {
            client: self,
            job_id,
            cursor: cursor.map(str::to_owned),
            response: None,
            parser: SseParser::default(),
            page: VecDeque::new(),
            done: false,
        };
        futures::stream::unfold(state, |mut s| async move {
            loop {
                if let Some(event) = s.page.pop_front() {
                    s.cursor = Some(event.id.clone());
                    if matches!(event.kind, EventKind::End { .. }) {
                        s.done = true;
                        s.page.clear();
                    }
                    return Some((Ok(event), s));
                }
                if s.done {
                    return None;
                }
                let Some(response) = s.response.as_mut() else {
                    match s.client.open_events(s.job_id, s.cursor.as_deref()).await {
                        Ok(response) => {
                            s.parser = SseParser::default();
                            s.response = Some(response);
                        }
                        Err(e @ HttpError::Transport { .. }) | Err(e @ HttpError::Unavailable(_)) => {
                            tracing::warn!(error = %e, "cannot open the live events; retrying");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        Err(e) => {
                            s.done = true;
                            return Some((Err(e), s));
                        }
                    }
                    continue;
                };
                match response.chunk().await {
                    Ok(Some(bytes)) => {
                        let mut messages = Vec::new();
                        s.parser.feed(&bytes, &mut messages);
                        s.page.extend(messages.iter().filter_map(event_of));
                    }
                    Ok(None) => {
                        // The gateway ended the stream without `end`: over (its result
                        // expired, or no `end` was written), or its stream's life is up.
                        s.response = None;
                        match s.client.status(s.job_id).await {
                            Ok(None) => s.done = true,
                            Ok(Some(result)) if result.status.is_terminal() => s.done = true,
                            // Not over: open it again, not in a tight loop should the streams
                            // keep ending at once (a proxy's time-out).
                            _ => tokio::time::sleep(Duration::from_millis(200)).await,
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the live events' connection failed; resuming");
                        s.response = None;
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
        })
    }

    /// Downloads one of the job's artifacts into `dir`, at its path relative to `/work`,
    /// through the gateway's redirect (`GET /v1/jobs/{id}/artifacts/{path}`) to a presigned
    /// URL, fetched without the key; checks size and SHA-256 against `artifact` and only then
    /// gives the file its name. Returns the local path.
    ///
    /// # Errors
    /// [`HttpError::UnsafeArtifactPath`], [`HttpError::NotFound`], [`HttpError::Mismatch`],
    /// [`HttpError::Local`], [`HttpError::Transport`].
    pub async fn download_artifact(&self, job_id: &str, artifact: &Artifact, dir: &Path) -> Result<PathBuf, HttpError> {
        sandq_schemas::validate::check_relative_path(&artifact.path)
            .map_err(|_| HttpError::UnsafeArtifactPath { path: artifact.path.clone() })?;
        let mut segments = vec!["v1", "jobs", job_id, "artifacts"];
        segments.extend(artifact.path.split('/'));
        let url = self.url(&segments);
        let response = self.send(|| Ok(self.request(Method::GET, url.clone()).timeout(Duration::from_secs(60)))).await?;
        let response = if response.status().is_redirection() {
            let location = response
                .headers()
                .get(header::LOCATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|l| response.url().join(l).ok())
                .ok_or_else(|| HttpError::BadRedirect { path: artifact.path.clone() })?;
            self.fetch_plain(location).await?
        } else {
            response
        };
        save(response, artifact, &dir.join(&artifact.path)).await
    }

    /// Downloads a stored representation of a rich output (an image, a large text) into `dir`
    /// from its presigned URL (the worker's; the gateway has no route for outputs), checking
    /// size and SHA-256. Returns the local path.
    ///
    /// # Errors
    /// [`HttpError::NoUrl`] when the worker presigned none; as [`HttpClient::download_artifact`].
    pub async fn download_output(&self, artifact: &Artifact, dir: &Path) -> Result<PathBuf, HttpError> {
        sandq_schemas::validate::check_relative_path(&artifact.path)
            .map_err(|_| HttpError::UnsafeArtifactPath { path: artifact.path.clone() })?;
        let url = artifact.url.as_deref().and_then(|u| Url::parse(u).ok()).ok_or_else(|| HttpError::NoUrl { key: artifact.key.clone() })?;
        let response = self.fetch_plain(url).await?;
        save(response, artifact, &dir.join(&artifact.path)).await
    }

    /// GETs a presigned URL: no key, no redirect followed.
    async fn fetch_plain(&self, url: Url) -> Result<Response, HttpError> {
        let shown = url.as_str().split('?').next().unwrap_or_default().to_owned();
        let response = self.http.get(url).send().await.map_err(|source| HttpError::transport(&shown, source))?;
        if !response.status().is_success() {
            let status = response.status().as_u16();
            let body = response.text().await.unwrap_or_default().chars().take(300).collect();
            return Err(HttpError::Status { status, body });
        }
        Ok(response)
    }

    /// The tenant's sessions (`GET /v1/sessions`, at most 1000).
    ///
    /// # Errors
    /// The gateway's.
    pub async fn sessions(&self) -> Result<Vec<SessionInfo>, HttpError> {
        #[derive(Deserialize)]
        struct Listed {
            sessions: Vec<SessionInfo>,
        }
        let response = self.send(|| Ok(self.request(Method::GET, self.url(&["v1", "sessions"])).timeout(Duration::from_secs(60)))).await?;
        Ok(json_of::<Listed>(response, "GET /v1/sessions").await?.sessions)
    }

    /// Deletes a session's files and state now (`DELETE /v1/sessions/{name}`); while a job of
    /// it runs the gateway waits up to 30 s, and this asks again until `wait` has passed. The
    /// next job naming it starts fresh.
    ///
    /// # Errors
    /// [`HttpError::NotFound`] for a session the tenant does not have; [`HttpError::Conflict`]
    /// when a job of it still ran after `wait`.
    pub async fn remove_session(&self, name: &str, wait: Duration) -> Result<(), HttpError> {
        let started = Instant::now();
        loop {
            let deleted =
                self.send(|| Ok(self.request(Method::DELETE, self.url(&["v1", "sessions", name])).timeout(Duration::from_secs(90)))).await;
            match deleted {
                Err(HttpError::Conflict(_)) if started.elapsed() < wait => tokio::time::sleep(Duration::from_secs(1)).await,
                other => return other.map(|_| ()),
            }
        }
    }
}

/// The error an unsuccessful response stands for: its problem document, else its status.
async fn error_of(response: Response) -> HttpError {
    let status = response.status().as_u16();
    let retry_after = response.headers().get(header::RETRY_AFTER).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
    let body = response.bytes().await.unwrap_or_default();
    match serde_json::from_slice::<Problem>(&body) {
        Ok(mut problem) if !problem.kind.is_empty() => {
            problem.retry_after = problem.retry_after.or(retry_after);
            HttpError::from_problem(status, problem)
        }
        _ => HttpError::Status { status, body: String::from_utf8_lossy(&body).chars().take(300).collect() },
    }
}

/// A successful response's JSON body.
async fn json_of<T: serde::de::DeserializeOwned>(response: Response, what: &'static str) -> Result<T, HttpError> {
    let url = response.url().to_string();
    let body = response.bytes().await.map_err(|source| HttpError::transport(&url, source))?;
    serde_json::from_slice(&body).map_err(|source| HttpError::Decode { what, source })
}

/// Writes a download to a temporary file beside `dest`, stopping one byte past the expected
/// size, and renames it to `dest` once size and SHA-256 match `artifact`: a failed download
/// never leaves a partial file under the artifact's name.
async fn save(mut response: Response, artifact: &Artifact, dest: &Path) -> Result<PathBuf, HttpError> {
    let local = |source| HttpError::Local { path: dest.display().to_string(), source };
    let mismatch = |reason: String| HttpError::Mismatch { path: artifact.path.clone(), reason };
    if let Some(parent) = dest.parent() {
        tokio::fs::create_dir_all(parent).await.map_err(local)?;
    }
    let partial = dest.with_file_name(format!(".sandq-partial-{}", uuid::Uuid::new_v4().simple()));
    let written = async {
        let mut file = tokio::fs::File::create(&partial).await.map_err(local)?;
        let mut hasher = sha2::Sha256::new();
        let mut size = 0u64;
        let url = response.url().as_str().split('?').next().unwrap_or_default().to_owned();
        while let Some(chunk) = response.chunk().await.map_err(|source| HttpError::transport(&url, source))? {
            size += chunk.len() as u64;
            if size > artifact.size {
                return Err(mismatch(format!("more than its {} bytes", artifact.size)));
            }
            hasher.update(&chunk);
            file.write_all(&chunk).await.map_err(local)?;
        }
        file.flush().await.map_err(local)?;
        if size != artifact.size {
            return Err(mismatch(format!("{size} bytes, not {}", artifact.size)));
        }
        let found = hex::encode(hasher.finalize());
        if found != artifact.sha256 {
            return Err(mismatch(format!("SHA-256 {found}, not {}", artifact.sha256)));
        }
        Ok(())
    }
    .await;
    if let Err(e) = written {
        let _ = tokio::fs::remove_file(&partial).await;
        return Err(e);
    }
    tokio::fs::rename(&partial, dest).await.map_err(local)?;
    Ok(dest.to_path_buf())
}

/// One server-sent event as read: its `id:` (the last one seen on the stream), `event:` and
/// `data:` lines joined.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SseMessage {
    id: Option<String>,
    event: String,
    data: String,
}

/// Reads `text/event-stream` (the WHATWG grammar: lines ended by LF, CRLF or CR; `:`
/// comments; `field: value`; an event ends at a blank line), chunk by chunk.
#[derive(Debug, Default)]
struct SseParser {
    line: Vec<u8>,
    /// The line is over [`MAX_EVENT_BYTES`]: its event is dropped.
    overflow: bool,
    after_cr: bool,
    id: Option<String>,
    event: String,
    data: String,
    has_data: bool,
}

impl SseParser {
    fn feed(&mut self, bytes: &[u8], out: &mut Vec<SseMessage>) {
        for &b in bytes {
            match b {
                b'\n' if self.after_cr => self.after_cr = false,
                b'\n' | b'\r' => {
                    self.after_cr = b == b'\r';
                    let line = std::mem::take(&mut self.line);
                    self.line_done(&line, out);
                }
                _ => {
                    self.after_cr = false;
                    if self.line.len() + self.data.len() >= MAX_EVENT_BYTES {
                        self.overflow = true;
                    } else {
                        self.line.push(b);
                    }
                }
            }
        }
    }

    fn line_done(&mut self, line: &[u8], out: &mut Vec<SseMessage>) {
        if line.is_empty() {
            let (event, data) = (std::mem::take(&mut self.event), std::mem::take(&mut self.data));
            if self.has_data && !self.overflow {
                let data = data.strip_suffix('\n').unwrap_or(&data).to_owned();
                out.push(SseMessage { id: self.id.clone(), event: if event.is_empty() { "message".into() } else { event }, data });
            }
            self.has_data = false;
            self.overflow = false;
            return;
        }
        if self.overflow || line.starts_with(b":") {
            return;
        }
        let line = String::from_utf8_lossy(line);
        let (field, value) = line.split_once(':').unwrap_or((&line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "event" => value.clone_into(&mut self.event),
            "data" => {
                self.data.push_str(value);
                self.data.push('\n');
                self.has_data = true;
            }
            "id" if !value.contains('\0') => self.id = Some(value.to_owned()),
            _ => {}
        }
    }
}

/// The live event a gateway's SSE message stands for (its `data`: `attempt`, `seq` and the
/// type's fields, docs/gateway.md); `None` without an id (not one of the job's events).
fn event_of(message: &SseMessage) -> Option<Event> {
    let id = message.id.clone().filter(|id| !id.is_empty())?;
    let data: Value = serde_json::from_str(&message.data).unwrap_or(Value::Null);
    let text = |name: &str| data.get(name).and_then(Value::as_str).unwrap_or_default().to_owned();
    let number = |name: &str| data.get(name).and_then(Value::as_u64);
    let kind = match message.event.as_str() {
        "attempt" => EventKind::Attempt { attempt_id: text("attempt_id") },
        "started" => EventKind::Started { warm: data.get("warm").and_then(Value::as_bool).unwrap_or(false) },
        "finished" => EventKind::Finished { exit_code: data.get("exit_code").and_then(Value::as_i64).and_then(|c| i32::try_from(c).ok()) },
        "requeued" => EventKind::Requeued { reason: text("reason") },
        "stdout" => EventKind::Stdout(text("text")),
        "stderr" => EventKind::Stderr(text("text")),
        "display" => EventKind::Display {
            index: number("index").unwrap_or(0),
            output: data.get("output").and_then(|o| serde_json::from_value(o.clone()).ok()).map(Box::new),
        },
        "truncated" => EventKind::Truncated { stream: text("stream"), limit: number("limit").unwrap_or(0) },
        "end" => EventKind::End { status: text("status") },
        other => {
            let fields: BTreeMap<String, String> = data
                .as_object()
                .map(|o| o.iter().map(|(k, v)| (k.clone(), v.as_str().map_or_else(|| v.to_string(), str::to_owned))).collect())
                .unwrap_or_default();
            EventKind::Other { kind: other.to_owned(), fields }
        }
    };
    let attempt = number("attempt").and_then(|a| u32::try_from(a).ok()).unwrap_or(0);
    Some(Event { id, attempt, seq: number("seq"), kind })
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandq_schemas::{NetworkMode, Runtime, Sku};

    fn parse(chunks: &[&[u8]]) -> Vec<SseMessage> {
        let mut parser = SseParser::default();
        let mut out = Vec::new();
        for chunk in chunks {
            parser.feed(chunk, &mut out);
        }
        out
    }

    #[test]
    fn server_sent_events_parse_across_chunks_and_line_endings() {
        let whole = b": keep-alive\n\nid: 1-0\nevent: stdout\ndata: {\"text\":\"a\"}\n\nid:2-0\r\nevent:end\r\ndata:{}\r\n\r\n";
        let expected = vec![
            SseMessage { id: Some("1-0".into()), event: "stdout".into(), data: "{\"text\":\"a\"}".into() },
            SseMessage { id: Some("2-0".into()), event: "end".into(), data: "{}".into() },
        ];
        assert_eq!(parse(&[whole]), expected);
        // Any split into chunks reads the same, a CRLF cut in two included.
        for cut in 0..whole.len() {
            assert_eq!(parse(&[&whole[..cut], &whole[cut..]]), expected, "cut at {cut}");
        }
        let bytes: Vec<&[u8]> = whole.chunks(1).collect();
        assert_eq!(parse(&bytes), expected);
        // Multi-line data joins with LF; a CR alone ends a line; the id carries over.
        assert_eq!(
            parse(&[b"id: 3-0\rdata: a\rdata: b\r\rdata: c\n\n"]),
            vec![
                SseMessage { id: Some("3-0".into()), event: "message".into(), data: "a\nb".into() },
                SseMessage { id: Some("3-0".into()), event: "message".into(), data: "c".into() },
            ]
        );
        // A comment or an event without data dispatches nothing.
        assert!(parse(&[b": hi\n\nevent: x\n\n"]).is_empty());
    }

    #[test]
    fn gateway_events_become_the_live_events_of_the_core() {
        let message = |event: &str, data: Value| SseMessage { id: Some("5-1".into()), event: event.into(), data: data.to_string() };
        let stdout = event_of(&message("stdout", json!({"attempt": 2, "seq": 7, "text": "hi\n"}))).expect("an event");
        assert_eq!(stdout, Event { id: "5-1".into(), attempt: 2, seq: Some(7), kind: EventKind::Stdout("hi\n".into()) });
        let end = event_of(&message("end", json!({"attempt": 1, "seq": null, "status": "succeeded"}))).expect("an event");
        assert_eq!(end.kind, EventKind::End { status: "succeeded".into() });
        assert_eq!(end.seq, None);
        let finished = event_of(&message("finished", json!({"attempt": 1, "seq": 3, "exit_code": null}))).expect("an event");
        assert_eq!(finished.kind, EventKind::Finished { exit_code: None });
        let display = event_of(&message(
            "display",
            json!({"attempt": 1, "seq": 4, "index": 2, "output": {"output_type": "display_data", "data": {"text/plain": {"text": "x", "size": 1}}}}),
        ))
        .expect("an event");
        let EventKind::Display { index: 2, output: Some(output) } = display.kind else { panic!("{display:?}") };
        assert_eq!(output.data["text/plain"].text.as_deref(), Some("x"));
        let other = event_of(&message("newer", json!({"attempt": 1, "n": 5}))).expect("an event");
        assert!(matches!(other.kind, EventKind::Other { ref kind, ref fields } if kind == "newer" && fields["n"] == "5"), "{other:?}");
        assert_eq!(event_of(&SseMessage { id: None, event: "stdout".into(), data: "{}".into() }), None);
    }

    #[test]
    fn problem_types_map_to_their_variants_and_only_unavailable_or_asked_retries() {
        let problem = |slug: &str, retry_after| Problem {
            kind: format!("urn:sandq:problem:{slug}"),
            title: String::new(),
            status: 0,
            detail: "d".into(),
            retry_after,
        };
        assert!(matches!(HttpError::from_problem(401, problem("unauthorized", None)), HttpError::Unauthorized(p) if p.status == 401));
        assert!(matches!(HttpError::from_problem(403, problem("forbidden-by-quota", None)), HttpError::ForbiddenByQuota(_)));
        assert!(matches!(HttpError::from_problem(429, problem("quota-exceeded", Some(3))), HttpError::QuotaExceeded(_)));
        assert!(matches!(HttpError::from_problem(404, problem("not-found", None)), HttpError::NotFound(_)));
        assert!(matches!(HttpError::from_problem(408, problem("body-timeout", None)), HttpError::BodyTimeout(_)));
        assert!(matches!(HttpError::from_problem(418, problem("teapot", None)), HttpError::OtherProblem(_)));
        let foreign = Problem { kind: "about:blank".into(), ..problem("x", None) };
        assert!(matches!(HttpError::from_problem(404, foreign), HttpError::NotFound(_)));
        assert_eq!(HttpError::from_problem(503, problem("unavailable", Some(2))).retry_pause(), Some(Duration::from_secs(2)));
        assert_eq!(HttpError::from_problem(503, problem("unavailable", Some(3600))).retry_pause(), Some(MAX_RETRY_PAUSE));
        assert_eq!(HttpError::from_problem(409, problem("conflict", Some(1))).retry_pause(), Some(Duration::from_secs(1)));
        assert_eq!(HttpError::from_problem(409, problem("conflict", None)).retry_pause(), None);
        assert_eq!(HttpError::from_problem(429, problem("quota-exceeded", Some(1))).retry_pause(), None);
        let shown = HttpError::from_problem(401, problem("unauthorized", None)).to_string();
        assert_eq!(shown, "the gateway refused the API key: d (401 unauthorized)");
    }

    #[test]
    fn a_job_becomes_the_documented_body_and_what_the_api_cannot_carry_is_refused() {
        let mut spec = JobSpec::new("j-1", Sku::M, Runtime::Python, "print(1)");
        spec.inputs = vec![InputFile { key: input_key(&"a".repeat(64)), path: "d/x.csv".into(), size: 3, sha256: "a".repeat(64) }];
        spec.stdin = Some(b"text".to_vec());
        spec.timeout = Some("5s".into());
        spec.network = NetworkMode::Outbound;
        spec.session = Some("s1".into());
        spec.submitted_at_ms = Some(1);
        let body = HttpClient::submit_body(&spec).expect("a body");
        assert_eq!(
            body,
            json!({"job_id": "j-1", "runtime": "python", "code": "print(1)", "sku": "M", "network": "outbound", "stdin": "text",
                   "timeout": "5s", "session": "s1", "inputs": [{"file_id": "a".repeat(64), "path": "d/x.csv"}]})
        );
        spec.stdin = Some(vec![0xff]);
        assert!(matches!(HttpClient::submit_body(&spec), Err(HttpError::Unsupported { field: "stdin", .. })));
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
        let client = HttpClient::new("http://127.0.0.1:8080/prefix/", "sq_k").expect("a client");
        assert_eq!(client.url(&["v1", "jobs", "a b/c#?"]).as_str(), "http://127.0.0.1:8080/prefix/v1/jobs/a%20b%2Fc%23%3F");
        let client = HttpClient::new("https://sandq.example.com", "sq_k").expect("a client");
        assert_eq!(client.url(&["v1", "files"]).as_str(), "https://sandq.example.com/v1/files");
        assert!(matches!(HttpClient::new("ftp://x", "k"), Err(HttpError::Url { .. })));
        assert!(matches!(HttpClient::new("http://x?a=1", "k"), Err(HttpError::Url { .. })));
        assert!(matches!(HttpClient::new("http://x", " "), Err(HttpError::MissingKey)));
    }
}
