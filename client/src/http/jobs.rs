//! Jobs over the REST API: submit (a [`JobSpec`], or the documented JSON as it is), read,
//! wait for, cancel, and follow a job's live events (parsed into [`Event`]s, resuming; or raw
//! [`JobEvent`]s).

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt as _};
use http::{header, Method, StatusCode};
use sandq_schemas::events::{Event, EventKind};
use sandq_schemas::{JobResult, JobSpec, JobStatus};
use serde_json::{json, Value};

use super::sse::{self, JobEvent, SseMessage};
use super::transport::{BoxError, RequestTimeout};
use super::{built, json_of, route, HttpClient, HttpError, Reply, WAIT_STEP};

impl HttpClient {
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
    /// with the same body) and whether it is new (201). The whole request times out after
    /// 120 s.
    ///
    /// # Errors
    /// [`HttpError::Conflict`] when the id was used with another body; the quota problems;
    /// any other of the gateway's or of [`HttpClient::submit_body`].
    pub async fn submit(&self, spec: &JobSpec) -> Result<(JobResult, bool), HttpError> {
        let body = Bytes::from(Self::submit_body(spec)?.to_string());
        let path = "/v1/jobs";
        let reply = self
            .send(path, || {
                let request = self
                    .request(Method::POST, path)
                    .header(header::CONTENT_TYPE, "application/json")
                    .header("Idempotency-Key", &spec.job_id)
                    .extension(RequestTimeout(Duration::from_secs(120)));
                built(request, body.clone(), path)
            })
            .await?;
        let new = reply.status == StatusCode::CREATED;
        Ok((json_of(reply, "POST /v1/jobs").await?, new))
    }

    /// `POST /v1/jobs` with `job` as it is (the fields of docs/gateway.md, no
    /// `Idempotency-Key`): the job as queued.
    ///
    /// # Errors
    /// The gateway's problems (400 invalid, 403/429 quota, 503), or the transport's.
    pub async fn submit_json(&self, job: &Value) -> Result<JobResult, HttpError> {
        self.json(Method::POST, "/v1/jobs", Some(job)).await
    }

    /// `GET /v1/jobs/{id}[?wait=]`: the job now, or once over within `wait` (the gateway caps
    /// it at its `max_wait`). The whole request times out `wait` + 60 s after it is sent.
    ///
    /// # Errors
    /// [`HttpError::NotFound`] for an id the tenant does not have; the transport's.
    pub async fn job(&self, job_id: &str, wait: Option<Duration>) -> Result<JobResult, HttpError> {
        let mut path = route(&["v1", "jobs", job_id]);
        if let Some(wait) = wait {
            path.push_str(&format!("?wait={}ms", wait.as_millis()));
        }
        let timeout = wait.unwrap_or_default() + Duration::from_secs(60);
        let reply = self.send_empty(Method::GET, &path, Some(timeout)).await?;
        json_of(reply, "GET /v1/jobs/{id}").await
    }

    /// The job's current result (`queued` until a worker takes it); `None` when this tenant
    /// has no such job, or its result expired (404, or 410 `result-expired`).
    ///
    /// # Errors
    /// The gateway's (but `not-found` and `result-expired`).
    pub async fn status(&self, job_id: &str) -> Result<Option<JobResult>, HttpError> {
        match self.job(job_id, None).await {
            Ok(result) => Ok(Some(result)),
            Err(HttpError::NotFound(_)) => Ok(None),
            Err(e) if e.status() == Some(410) => Ok(None),
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
            match self.job(job_id, Some(step).filter(|s| !s.is_zero())).await {
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

    /// Asks for the job to be cancelled (`DELETE /v1/jobs/{id}`, within 60 s): a queued job
    /// is not run, a running one is killed within about a second. False when the job is over,
    /// or this tenant has no such job.
    ///
    /// # Errors
    /// The gateway's (but `not-found` and `conflict`).
    pub async fn cancel(&self, job_id: &str) -> Result<bool, HttpError> {
        match self.send_empty(Method::DELETE, &route(&["v1", "jobs", job_id]), Some(Duration::from_secs(60))).await {
            Ok(_) => Ok(true),
            Err(HttpError::NotFound(_) | HttpError::Conflict(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// As [`HttpClient::cancel`], but a job this tenant does not have is an error: false only
    /// when the job is over (409).
    ///
    /// # Errors
    /// [`HttpError::NotFound`]; any other of the gateway's (but `conflict`).
    pub async fn cancel_existing(&self, job_id: &str) -> Result<bool, HttpError> {
        match self.send_empty(Method::DELETE, &route(&["v1", "jobs", job_id]), Some(Duration::from_secs(60))).await {
            Ok(_) => Ok(true),
            // Any 409, a problem document or not.
            Err(e) if e.status() == Some(409) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Opens the job's event stream after `cursor` (`Last-Event-ID`), or from the first.
    async fn open_events(&self, job_id: &str, cursor: Option<&str>) -> Result<Reply, HttpError> {
        let path = route(&["v1", "jobs", job_id, "events"]);
        self.send(&path, || {
            let mut request = self.request(Method::GET, &path).header(header::ACCEPT, "text/event-stream");
            if let Some(cursor) = cursor {
                request = request.header("Last-Event-ID", cursor);
            }
            built(request, Bytes::new(), &path)
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
            messages: Option<BoxStream<'static, Result<SseMessage, BoxError>>>,
            done: bool,
        }
        let state = State { client: self, job_id, cursor: cursor.map(str::to_owned), messages: None, done: false };
        futures::stream::unfold(state, |mut s| async move {
            loop {
                if s.done {
                    return None;
                }
                let Some(messages) = s.messages.as_mut() else {
                    match s.client.open_events(s.job_id, s.cursor.as_deref()).await {
                        Ok(reply) => s.messages = Some(sse::messages(reply.body).boxed()),
                        Err(e @ (HttpError::Transport { .. } | HttpError::Unavailable(_))) => {
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
                match messages.next().await {
                    Some(Ok(message)) => {
                        let Some(event) = sse::event_of(&message) else { continue };
                        s.cursor = Some(event.id.clone());
                        s.done = matches!(event.kind, EventKind::End { .. });
                        return Some((Ok(event), s));
                    }
                    None => {
                        // The gateway ended the stream without `end`: over (its result
                        // expired, or no `end` was written), or its stream's life is up.
                        s.messages = None;
                        match s.client.status(s.job_id).await {
                            Ok(None) => s.done = true,
                            Ok(Some(result)) if result.status.is_terminal() => s.done = true,
                            // Not over: open it again, not in a tight loop should the streams
                            // keep ending at once (a proxy's time-out).
                            _ => tokio::time::sleep(Duration::from_millis(200)).await,
                        }
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "the live events' connection failed; resuming");
                        s.messages = None;
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
        })
    }

    /// `GET /v1/jobs/{id}/events` once, from the start, as raw [`JobEvent`]s, until the
    /// stream's end (no resuming; keep-alive comments are not items). Each event's data is
    /// bounded by the gateway (1 MiB) and by [`super::MAX_EVENT_BYTES`].
    ///
    /// # Errors
    /// 404, 429 (the key's streams are all open); the transport's, as the stream's items too.
    pub async fn raw_events(&self, job_id: &str) -> Result<impl Stream<Item = Result<JobEvent, HttpError>> + Send + 'static, HttpError> {
        let path = route(&["v1", "jobs", job_id, "events"]);
        let reply = self.send_empty(Method::GET, &path, None).await?;
        let shown = self.shown(&path);
        let events = sse::messages(reply.body).map(move |item| item.map(JobEvent::from).map_err(|e| HttpError::transport(&shown, e)));
        // A message with no type and no JSON data is not one of the job's events.
        Ok(events.filter(|e| std::future::ready(!matches!(e, Ok(JobEvent { kind, data: Value::Null, .. }) if kind == "message"))))
    }
}

#[cfg(test)]
mod tests {
    use sandq_schemas::names::input_key;
    use sandq_schemas::{InputFile, NetworkMode, Runtime, Sku};

    use super::*;

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

    /// A transport answering each request with the next of `answers` (status, body chunks),
    /// recording each request's method, path and query, and key, as the gateway's in-process
    /// router would be called.
    struct Canned {
        answers: std::sync::Mutex<std::collections::VecDeque<(u16, Vec<&'static str>)>>,
        seen: std::sync::Mutex<Vec<(Method, String, String)>>,
    }

    impl super::super::Transport for Canned {
        fn send(&self, request: http::Request<Bytes>) -> futures::future::BoxFuture<'static, Result<Reply, BoxError>> {
            let key = request.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
            self.seen.lock().expect("lock").push((request.method().clone(), request.uri().to_string(), key));
            let (status, chunks) = self.answers.lock().expect("lock").pop_front().expect("an answer");
            Box::pin(async move {
                let body = futures::stream::iter(chunks.into_iter().map(|c| Ok(Bytes::from_static(c.as_bytes())))).boxed();
                Ok(Reply { status: StatusCode::from_u16(status).expect("a status"), headers: http::HeaderMap::new(), body })
            })
        }
    }

    fn over(answers: Vec<(u16, Vec<&'static str>)>) -> (HttpClient, std::sync::Arc<Canned>) {
        let canned = std::sync::Arc::new(Canned { answers: std::sync::Mutex::new(answers.into()), seen: Default::default() });
        (HttpClient::with_transport(canned.clone(), "sq_k".into(), reqwest::Client::new()), canned)
    }

    #[tokio::test]
    async fn over_a_transport_calls_are_tried_once_and_raw_events_come_as_sent() {
        let unavailable = r#"{"type":"urn:sandq:problem:unavailable","title":"t","status":503,"detail":"d"}"#;
        let (client, canned) = over(vec![(503, vec![unavailable])]);
        let error = client.job("a b", Some(Duration::from_millis(1500))).await.expect_err("503");
        assert!(matches!(error, HttpError::Unavailable(_)) && error.status() == Some(503), "{error}");
        assert_eq!(
            canned.seen.lock().expect("lock").clone(),
            vec![(Method::GET, "/v1/jobs/a%20b?wait=1500ms".into(), "Bearer sq_k".into())]
        );

        let not_found = r#"{"type":"urn:sandq:problem:not-found","title":"t","status":404,"detail":""}"#;
        let (client, _) = over(vec![(404, vec![not_found]), (404, vec![not_found]), (409, vec!["{}"])]);
        assert!(!client.cancel("j").await.expect("404 is over for the CLI's cancel"));
        assert!(client.cancel_existing("j").await.expect_err("404 is an error").is_not_found());
        assert!(!client.cancel_existing("j").await.expect("409 is over"));

        // A file's bytes without a redirect are read up to the caller's limit, not past it.
        let (client, _) = over(vec![(200, vec!["12", "345"]), (200, vec!["12", "34"])]);
        assert!(matches!(client.read_file("s", "p", 4).await, Err(HttpError::TooLarge { limit: 4, .. })));
        assert_eq!(client.read_file("s", "p", 4).await.expect("4 bytes"), b"1234");

        let (client, _) = over(vec![(200, vec![": keep-alive\n\nid: 1-0\nevent: std", "out\ndata: {\"text\":\"hi\"}\n\ndata: x\n\n"])]);
        let events: Vec<JobEvent> = client.raw_events("j").await.expect("a stream").map(|e| e.expect("an event")).collect().await;
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!((events[0].id.as_deref(), events[0].kind.as_str(), &events[0].data), (Some("1-0"), "stdout", &json!({"text": "hi"})));
    }
}
