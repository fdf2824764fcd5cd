//! The HTTP gateway (`sandq-gateway`, docs/gateway.md) against the real worker and services:
//! jobs submitted, read, waited for, streamed and cancelled over HTTP with tenant keys; two
//! tenants side by side; every kind of bad request answered with its problem type and nothing
//! stored; quotas, concurrent submissions included; slow clients cut off.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use futures::StreamExt;
use reqwest::StatusCode;
use sandq_core::keys::{self, Quotas};
use sandq_schemas::names::Names;
use sandq_schemas::Sku;
use sandq_tests::gateway::{self as gw, new_key, tenant};
use sandq_tests::{bin_dir, ensure_worker, namespace, service_config};
use serde_json::{json, Value};

/// The gateway of this test binary: started once, in the test namespace, reading headers and
/// bodies within 2 s, 3 event streams a key, SSE keep-alives every second, webhooks to
/// loopback allowed and retried after 200 ms doubling. Its log is [`log_path`].
struct Gateway {
    base: String,
    /// Its stdin's other end: when this process ends, the pipe closes and the gateway stops
    /// (`--exit-on-stdin-eof`; a static is never dropped).
    _child: Child,
}

static GATEWAY: OnceLock<Gateway> = OnceLock::new();

fn log_path() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("{}-gateway.log", namespace()))
}

fn gateway() -> &'static str {
    &GATEWAY
        .get_or_init(|| {
            ensure_worker();
            // Webhooks to loopback allowed: the tests' receivers listen there.
            let (child, base) = gw::start(&log_path(), &[("SANDQ__GATEWAY__WEBHOOK_ALLOW_PRIVATE", "true")]);
            Gateway { base, _child: child }
        })
        .base
}

fn http() -> reqwest::Client {
    gw::http()
}

async fn post_job(key: &str, body: &Value) -> (StatusCode, Value, reqwest::header::HeaderMap) {
    let response = http().post(format!("{}/v1/jobs", gateway())).bearer_auth(key).json(body).send().await.expect("POST");
    let status = response.status();
    let headers = response.headers().clone();
    (status, response.json().await.unwrap_or(Value::Null), headers)
}

async fn get_json(key: &str, path: &str) -> (StatusCode, Value) {
    gw::get_json(gateway(), key, path).await
}

/// Waits for the job over HTTP (`?wait=`) until it is over, at most 3 minutes.
async fn wait_job(key: &str, id: &str) -> Value {
    gw::wait_job(gateway(), key, id).await
}

fn python(code: &str) -> Value {
    json!({"runtime": "python", "code": code, "sku": "S"})
}

#[tokio::test]
async fn a_job_submitted_over_http_runs_and_reads_back_with_the_tenants_id() {
    let (_, key) = new_key(&tenant("acme"), Quotas::default()).await;
    let mut body = python("print(6 * 7)\n'done'");
    body["job_id"] = json!("first-job");
    let (status, job, headers) = post_job(&key, &body).await;
    assert_eq!(status, StatusCode::CREATED, "{job}");
    assert_eq!(job["job_id"], "first-job");
    assert_eq!(job["status"], "queued");
    assert_eq!(headers.get("location").and_then(|v| v.to_str().ok()), Some("/v1/jobs/first-job"));
    let done = wait_job(&key, "first-job").await;
    assert_eq!(done["status"], "succeeded", "{done}");
    assert_eq!(done["job_id"], "first-job", "the tenant sees its own id");
    assert_eq!(done["stdout"]["text"], "42\n");
    assert_eq!(done["outputs"][0]["data"]["text/plain"]["text"], "'done'", "{}", done["outputs"]);
}

#[tokio::test]
async fn two_tenants_with_the_same_job_id_never_see_each_others() {
    let (_, key_a) = new_key(&tenant("a"), Quotas::default()).await;
    let (_, key_b) = new_key(&tenant("b"), Quotas::default()).await;
    for (key, word) in [(&key_a, "alpha"), (&key_b, "beta")] {
        let mut body = python(&format!("print('{word}')"));
        body["job_id"] = json!("shared-id");
        let (status, job, _) = post_job(key, &body).await;
        assert_eq!(status, StatusCode::CREATED, "{job}");
    }
    assert_eq!(wait_job(&key_a, "shared-id").await["stdout"]["text"], "alpha\n");
    assert_eq!(wait_job(&key_b, "shared-id").await["stdout"]["text"], "beta\n");
    // A job only A has: B gets 404 for every verb, exactly as for an id nobody has.
    let mut body = python("print('mine')");
    body["job_id"] = json!("only-a");
    assert_eq!(post_job(&key_a, &body).await.0, StatusCode::CREATED);
    for id in ["only-a", "nobody-has-this"] {
        let (status, problem) = get_json(&key_b, &format!("/v1/jobs/{id}")).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(problem["type"], "urn:sandq:problem:not-found");
        let events = http().get(format!("{}/v1/jobs/{id}/events", gateway())).bearer_auth(&key_b).send().await.expect("GET");
        assert_eq!(events.status(), StatusCode::NOT_FOUND);
        let cancel = http().delete(format!("{}/v1/jobs/{id}", gateway())).bearer_auth(&key_b).send().await.expect("DELETE");
        assert_eq!(cancel.status(), StatusCode::NOT_FOUND);
    }
    assert_eq!(wait_job(&key_a, "only-a").await["stdout"]["text"], "mine\n");
}

#[tokio::test]
async fn a_job_the_gateway_did_not_accept_is_not_found_even_under_the_tenants_prefix() {
    let tenant = tenant("ops");
    let (_, key) = new_key(&tenant, Quotas::default()).await;
    // Published straight to the queue by an operator, with an id that has the tenant's prefix.
    let mut client = sandq_tests::client().await;
    let spec = sandq_tests::python_job("print('operator')", Sku::S);
    let mut spec = spec.clone();
    spec.job_id = format!("{tenant}_direct");
    client.submit(&spec).await.expect("submit");
    let (status, _) = get_json(&key, "/v1/jobs/direct").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // Nor can the tenant take the id over by submitting it.
    let mut body = python("print('mine now')");
    body["job_id"] = json!("direct");
    let (status, problem, _) = post_job(&key, &body).await;
    assert_eq!(status, StatusCode::CONFLICT, "{problem}");
    assert_eq!(get_json(&key, "/v1/jobs/direct").await.0, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn bad_requests_get_their_problem_type_and_store_nothing() {
    let tenant = tenant("bad");
    let (key_id, key) = new_key(&tenant, Quotas::default()).await;
    let url = format!("{}/v1/jobs", gateway());
    let send = |body: Vec<u8>, content_type: &'static str, auth: Option<String>| {
        let url = url.clone();
        async move {
            let mut request = http().post(url).header("content-type", content_type).body(body);
            if let Some(auth) = auth {
                request = request.header("authorization", auth);
            }
            let response = request.send().await.expect("POST");
            let status = response.status();
            let problem: Value = response.json().await.unwrap_or(Value::Null);
            (status, problem["type"].as_str().unwrap_or_default().trim_start_matches("urn:sandq:problem:").to_owned())
        }
    };
    let bearer = Some(format!("Bearer {key}"));
    let good = serde_json::to_vec(&python("print(1)")).expect("json");
    let with = |field: &str, value: Value| {
        let mut body = python("print(1)");
        body[field] = value;
        serde_json::to_vec(&body).expect("json")
    };
    let wrong_secret = format!("Bearer {}{}", &key[..key.len() - 1], if key.ends_with('A') { 'B' } else { 'A' });
    // (what, body, content type, authorization, expected status, expected problem type)
    type Case = (&'static str, Vec<u8>, &'static str, Option<String>, StatusCode, &'static str);
    let cases: Vec<Case> = vec![
        ("no key", good.clone(), "application/json", None, StatusCode::UNAUTHORIZED, "unauthorized"),
        ("a malformed key", good.clone(), "application/json", Some("Bearer nope".into()), StatusCode::UNAUTHORIZED, "unauthorized"),
        ("a wrong secret", good.clone(), "application/json", Some(wrong_secret), StatusCode::UNAUTHORIZED, "unauthorized"),
        ("malformed JSON", b"{\"runtime\": ".to_vec(), "application/json", bearer.clone(), StatusCode::BAD_REQUEST, "invalid-request"),
        ("a wrong type", with("sku", json!(3)), "application/json", bearer.clone(), StatusCode::BAD_REQUEST, "invalid-request"),
        (
            "an unknown field",
            with("priority", json!("high")),
            "application/json",
            bearer.clone(),
            StatusCode::BAD_REQUEST,
            "invalid-request",
        ),
        (
            "a NUL in the id",
            with("job_id", json!("a\u{0}b")),
            "application/json",
            bearer.clone(),
            StatusCode::BAD_REQUEST,
            "invalid-request",
        ),
        (
            "a path in the id",
            with("job_id", json!("../../x")),
            "application/json",
            bearer.clone(),
            StatusCode::BAD_REQUEST,
            "invalid-request",
        ),
        (
            "an id too long",
            with("job_id", json!("x".repeat(64))),
            "application/json",
            bearer.clone(),
            StatusCode::BAD_REQUEST,
            "invalid-request",
        ),
        (
            "a path in the session",
            with("session", json!("../s")),
            "application/json",
            bearer.clone(),
            StatusCode::BAD_REQUEST,
            "invalid-request",
        ),
        ("a bad timeout", with("timeout", json!("soon")), "application/json", bearer.clone(), StatusCode::BAD_REQUEST, "invalid-request"),
        (
            "a reserved env name",
            with("env", json!({"PATH": "/x"})),
            "application/json",
            bearer.clone(),
            StatusCode::BAD_REQUEST,
            "invalid-request",
        ),
        ("not JSON", good.clone(), "text/plain", bearer.clone(), StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported-media-type"),
        (
            "a body over the cap",
            with("code", json!("#".repeat(3 << 20))),
            "application/json",
            bearer.clone(),
            StatusCode::PAYLOAD_TOO_LARGE,
            "body-too-large",
        ),
    ];
    for (what, body, content_type, auth, status, kind) in cases {
        assert_eq!(send(body, content_type, auth).await, (status, kind.to_owned()), "{what}");
    }
    // Nothing of any of them is in Redis: no job of the tenant, no count against the key.
    let config = service_config();
    let mut redis = sandq_core::redis_conn::connect(&config.redis).await.expect("redis");
    let jobs: Vec<String> =
        redis::cmd("KEYS").arg(format!("{}:job:{{{tenant}_*", namespace())).query_async(&mut redis).await.expect("KEYS");
    assert!(jobs.is_empty(), "{jobs:?}");
    let in_flight: u64 =
        redis::cmd("ZCARD").arg(format!("{}:apikey:{{{key_id}}}:inflight", namespace())).query_async(&mut redis).await.expect("ZCARD");
    assert_eq!(in_flight, 0);
    // A revoked key is refused from the next request on.
    assert_eq!(send(good.clone(), "application/json", bearer.clone()).await.0, StatusCode::CREATED);
    let revoked = Command::new(bin_dir().join("sandq"))
        .args(["key", "revoke", &key_id])
        .env("SANDQ__NAMESPACE", namespace())
        .output()
        .expect("sandq key revoke");
    assert!(revoked.status.success(), "{}", String::from_utf8_lossy(&revoked.stderr));
    assert_eq!(send(good, "application/json", bearer).await, (StatusCode::UNAUTHORIZED, "unauthorized".to_owned()));
    // The audit log names the key and why it was refused, never the key itself.
    let log = std::fs::read_to_string(log_path()).expect("gateway log");
    assert!(
        log.lines().any(|l| l.contains(&format!("key_id=\"{key_id}\"")) || l.contains(&format!("key_id={key_id}"))),
        "no audit line names the key"
    );
    assert!(log.contains("refused=\"revoked\"") || log.contains("refused=revoked"), "no audit line says the key was revoked");
    assert!(!log.contains(&key), "the key's secret is in the log");
}

#[tokio::test]
async fn what_a_key_may_never_do_is_403_and_over_a_rate_is_429_with_retry_after() {
    let quotas = Quotas { max_sku: Sku::S, max_timeout: Duration::from_secs(30), jobs_per_minute: 2, ..Quotas::default() };
    let (_, key) = new_key(&tenant("quota"), quotas).await;
    for (field, value) in [("sku", json!("M")), ("timeout", json!("2m")), ("network", json!("outbound"))] {
        let mut body = python("print(1)");
        body[field] = value;
        let (status, problem, _) = post_job(&key, &body).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{field}: {problem}");
        assert_eq!(problem["type"], "urn:sandq:problem:forbidden-by-quota");
    }
    // Two a minute: the third within the same minute is refused until the next one.
    let second_of_minute = sandq_core::time::now_ms() / 1000 % 60;
    if second_of_minute > 50 {
        tokio::time::sleep(Duration::from_secs(61 - second_of_minute)).await;
    }
    for _ in 0..2 {
        assert_eq!(post_job(&key, &python("print(1)")).await.0, StatusCode::CREATED);
    }
    let (status, problem, headers) = post_job(&key, &python("print(1)")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{problem}");
    assert_eq!(problem["type"], "urn:sandq:problem:quota-exceeded");
    let retry: u64 = headers.get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()).expect("Retry-After");
    assert!((1..=60).contains(&retry), "{retry}");
}

#[tokio::test]
async fn concurrent_submissions_never_pass_the_in_flight_quota() {
    let quotas = Quotas { max_in_flight: 3, jobs_per_minute: 1000, ..Quotas::default() };
    let (key_id, key) = new_key(&tenant("flight"), quotas).await;
    let submissions = (0..12).map(|_| {
        let key = key.clone();
        async move { post_job(&key, &python("import time\ntime.sleep(4)")).await }
    });
    let answers = futures::future::join_all(submissions).await;
    let accepted: Vec<String> =
        answers.iter().filter(|a| a.0 == StatusCode::CREATED).map(|a| a.1["job_id"].as_str().unwrap_or_default().to_owned()).collect();
    let refused = answers.iter().filter(|a| a.0 == StatusCode::TOO_MANY_REQUESTS).count();
    assert!((1..=3).contains(&accepted.len()), "accepted {}", accepted.len());
    assert_eq!(accepted.len() + refused, 12, "{:?}", answers.iter().map(|a| a.0).collect::<Vec<_>>());
    // Only the accepted ones count against the rate (refused ones are given back).
    let config = service_config();
    let mut redis = sandq_core::redis_conn::connect(&config.redis).await.expect("redis");
    let minute = sandq_core::time::now_ms() / 60_000;
    let mut counted = 0i64;
    for m in [minute - 1, minute] {
        let n: Option<i64> =
            redis::cmd("GET").arg(format!("{}:apikey:{{{key_id}}}:rate:{m}", namespace())).query_async(&mut redis).await.expect("GET");
        counted += n.unwrap_or(0);
    }
    assert_eq!(counted, accepted.len() as i64);
    // Once they are over, the key may submit again.
    for id in &accepted {
        assert_eq!(wait_job(&key, id).await["status"], "succeeded");
    }
    assert_eq!(post_job(&key, &python("print(1)")).await.0, StatusCode::CREATED);
}

#[tokio::test]
async fn a_retry_with_the_same_idempotency_key_finds_the_first_job() {
    let (_, key) = new_key(&tenant("idem"), Quotas::default()).await;
    let post = |body: Value, idempotency: &'static str| {
        let key = key.clone();
        async move {
            let response = http()
                .post(format!("{}/v1/jobs", gateway()))
                .bearer_auth(&key)
                .header("idempotency-key", idempotency)
                .json(&body)
                .send()
                .await
                .expect("POST");
            let status = response.status();
            (status, response.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let (first, job) = post(python("print('once')"), "order-17").await;
    assert_eq!(first, StatusCode::CREATED, "{job}");
    let (again, same) = post(python("print('once')"), "order-17").await;
    assert_eq!(again, StatusCode::OK, "{same}");
    assert_eq!(same["job_id"], job["job_id"]);
    let (other, problem) = post(python("print('twice')"), "order-17").await;
    assert_eq!(other, StatusCode::CONFLICT, "{problem}");
    let id = job["job_id"].as_str().expect("id").to_owned();
    let done = wait_job(&key, &id).await;
    assert_eq!(done["stdout"]["text"], "once\n");
    assert_eq!(done["attempt"], 1, "the retry did not run the job again");
}

#[tokio::test]
async fn a_running_job_is_cancelled_with_delete() {
    let (_, key) = new_key(&tenant("cancel"), Quotas::default()).await;
    let mut body = python("import time\nprint('started', flush=True)\ntime.sleep(60)");
    body["job_id"] = json!("long");
    assert_eq!(post_job(&key, &body).await.0, StatusCode::CREATED);
    let started = Instant::now();
    while get_json(&key, "/v1/jobs/long").await.1["status"] != "running" {
        assert!(started.elapsed() < Duration::from_secs(120), "never ran");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let response = http().delete(format!("{}/v1/jobs/long", gateway())).bearer_auth(&key).send().await.expect("DELETE");
    assert_eq!(response.status(), StatusCode::ACCEPTED);
    let done = wait_job(&key, "long").await;
    assert_eq!(done["status"], "cancelled", "{done}");
    let again = http().delete(format!("{}/v1/jobs/long", gateway())).bearer_auth(&key).send().await.expect("DELETE");
    assert_eq!(again.status(), StatusCode::CONFLICT);
}

/// One server-sent event: (`id`, `event`, `data` as JSON).
type Sse = (String, String, Value);

/// Reads server-sent events from `response` until `stop` says so or the stream ends.
async fn read_sse(response: reqwest::Response, mut stop: impl FnMut(&Sse) -> bool) -> Vec<Sse> {
    let mut events = Vec::new();
    let mut buffer = String::new();
    let mut body = response.bytes_stream();
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(120), body.next()).await.expect("an event within 2 min") {
        buffer.push_str(&String::from_utf8_lossy(&chunk.expect("chunk")));
        while let Some(end) = buffer.find("\n\n") {
            let block: String = buffer.drain(..end + 2).collect();
            let (mut id, mut kind, mut data) = (String::new(), String::new(), String::new());
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("id:") {
                    id = v.trim().to_owned();
                } else if let Some(v) = line.strip_prefix("event:") {
                    kind = v.trim().to_owned();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.trim_start());
                }
            }
            if kind.is_empty() {
                continue; // a keep-alive comment
            }
            let event = (id, kind, serde_json::from_str(&data).expect("data is JSON"));
            let done = stop(&event);
            events.push(event);
            if done {
                return events;
            }
        }
    }
    events
}

#[tokio::test]
async fn events_stream_as_sse_and_resume_after_the_last_event_id() {
    let (_, key) = new_key(&tenant("sse"), Quotas::default()).await;
    let lines = 20;
    let mut body = python(&format!("import time\nfor i in range({lines}):\n    print('line', i, flush=True)\n    time.sleep(0.1)"));
    body["job_id"] = json!("printer");
    assert_eq!(post_job(&key, &body).await.0, StatusCode::CREATED);
    let url = format!("{}/v1/jobs/printer/events", gateway());
    let first = http().get(&url).bearer_auth(&key).send().await.expect("GET events");
    assert_eq!(first.status(), StatusCode::OK);
    assert!(first.headers()["content-type"].to_str().unwrap_or_default().starts_with("text/event-stream"));
    // Read up to the first stdout event, then disconnect.
    let head = read_sse(first, |(_, kind, _)| kind == "stdout").await;
    let last_id = head.last().expect("an event").0.clone();
    let resumed = http().get(&url).bearer_auth(&key).header("last-event-id", &last_id).send().await.expect("GET events again");
    let tail = read_sse(resumed, |_| false).await;
    let all: Vec<&Sse> = head.iter().chain(tail.iter()).collect();
    let ids: Vec<&str> = all.iter().map(|e| e.0.as_str()).collect();
    let mut unique = ids.clone();
    unique.dedup();
    assert_eq!(ids, unique, "no event twice");
    let stdout: String = all.iter().filter(|e| e.1 == "stdout").map(|e| e.2["text"].as_str().unwrap_or_default()).collect();
    let expected: String = (0..lines).map(|i| format!("line {i}\n")).collect();
    assert_eq!(stdout, expected);
    assert_eq!(all.first().map(|e| e.1.as_str()), Some("attempt"));
    let end = all.last().expect("events");
    assert_eq!((end.1.as_str(), end.2["status"].as_str()), ("end", Some("succeeded")));
    // A cursor of another shape is refused.
    let bad = http().get(&url).bearer_auth(&key).header("last-event-id", "$").send().await.expect("GET");
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
}

/// Connects to the gateway's port over plain TCP.
fn raw_connection() -> TcpStream {
    let addr = gateway().trim_start_matches("http://").to_owned();
    let stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    stream
}

#[tokio::test]
async fn slow_headers_and_slow_bodies_are_cut_off_and_others_are_served_meanwhile() {
    let (_, key) = new_key(&tenant("slow"), Quotas::default()).await;
    // Headers that never end: the connection is closed after the read time-out (2 s here).
    let slow_headers = std::thread::spawn(|| {
        let mut stream = raw_connection();
        stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").expect("write");
        let started = Instant::now();
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
        (started.elapsed(), rest)
    });
    // A body announced and never sent: 408 after the read time-out.
    let key_for_body = key.clone();
    let slow_body = std::thread::spawn(move || {
        let mut stream = raw_connection();
        let head = format!(
            "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key_for_body}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
        );
        stream.write_all(head.as_bytes()).expect("write");
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        String::from_utf8_lossy(&answer).into_owned()
    });
    // Meanwhile the gateway answers others.
    let (status, _) = get_json(&key, "/v1/jobs/none").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (waited, rest) = slow_headers.join().expect("thread");
    assert!(waited < Duration::from_secs(20), "the connection was held {waited:?}");
    assert!(!String::from_utf8_lossy(&rest).contains("200 OK"), "slow headers were served");
    let answer = slow_body.join().expect("thread");
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("urn:sandq:problem:body-timeout"), "{answer}");
}

#[tokio::test]
async fn health_readiness_metrics_and_the_openapi_document_are_served_without_a_key() {
    let base = gateway();
    let document = std::fs::read_to_string(sandq_tests::repo_root().join("docs/openapi.json")).expect("docs/openapi.json");
    for (path, expect) in [("/healthz", "ok"), ("/readyz", "ready"), ("/v1/openapi.json", document.as_str())] {
        let response = http().get(format!("{base}{path}")).send().await.expect("GET");
        assert_eq!(response.status(), StatusCode::OK, "{path}");
        assert!(response.text().await.expect("text").contains(expect), "{path}");
    }
    // `/metrics` is the operator's (issue 36): not on the API's listener, on the operator's.
    let response = http().get(format!("{base}/metrics")).send().await.expect("GET");
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    let operator = gw::operator_url_from_log(&log_path());
    for (path, expect) in [("/metrics", "sandq_gateway_requests_total"), ("/healthz", "ok"), ("/readyz", "ready")] {
        let response = http().get(format!("{operator}{path}")).send().await.expect("GET");
        assert_eq!(response.status(), StatusCode::OK, "{path}");
        assert!(response.text().await.expect("text").contains(expect), "{path}");
    }
}

#[tokio::test]
async fn a_bad_query_string_or_method_is_a_problem_document_too() {
    let (_, key) = new_key(&tenant("query"), Quotas::default()).await;
    let mut body = python("print(1)");
    body["job_id"] = json!("q");
    assert_eq!(post_job(&key, &body).await.0, StatusCode::CREATED);
    for path in ["/v1/jobs/q?wait=soon", "/v1/jobs/q?colour=red", "/v1/jobs/q/events?after=1-0&x=1"] {
        let response = http().get(format!("{}{path}", gateway())).bearer_auth(&key).send().await.expect("GET");
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(response.headers()["content-type"], "application/problem+json", "{path}");
    }
    let response = http().put(format!("{}/v1/jobs/q", gateway())).bearer_auth(&key).send().await.expect("PUT");
    assert_eq!(response.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(response.json::<Value>().await.expect("json")["type"], "urn:sandq:problem:method-not-allowed");
}

#[tokio::test]
async fn a_key_holds_at_most_its_share_of_event_streams() {
    let (_, key) = new_key(&tenant("streams"), Quotas::default()).await;
    let mut body = python("import time\ntime.sleep(20)");
    body["job_id"] = json!("sleeper");
    assert_eq!(post_job(&key, &body).await.0, StatusCode::CREATED);
    let url = format!("{}/v1/jobs/sleeper/events", gateway());
    // This test binary's gateway allows 3 a key.
    let mut open = Vec::new();
    for _ in 0..3 {
        let response = http().get(&url).bearer_auth(&key).send().await.expect("GET");
        assert_eq!(response.status(), StatusCode::OK);
        open.push(response);
    }
    let fourth = http().get(&url).bearer_auth(&key).send().await.expect("GET");
    assert_eq!(fourth.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(fourth.headers().contains_key("retry-after"));
    // Another key is not held back by this one's streams, and a closed stream is given back.
    let (_, other) = new_key(&tenant("streams"), Quotas::default()).await;
    assert_eq!(
        http().get(format!("{}/v1/jobs/none/events", gateway())).bearer_auth(&other).send().await.expect("GET").status(),
        StatusCode::NOT_FOUND
    );
    drop(open.pop());
    let started = Instant::now();
    loop {
        let again = http().get(&url).bearer_auth(&key).send().await.expect("GET");
        if again.status() == StatusCode::OK {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "the closed stream was not given back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let cancel = http().delete(format!("{}/v1/jobs/sleeper", gateway())).bearer_auth(&key).send().await.expect("DELETE");
    assert_eq!(cancel.status(), StatusCode::ACCEPTED);
}

#[tokio::test]
async fn an_uploaded_file_is_staged_for_its_tenant_only_and_artifacts_redirect_to_their_bytes() {
    let quotas = Quotas { max_upload_bytes: 1 << 20, ..Quotas::default() };
    let (_, key) = new_key(&tenant("files"), quotas.clone()).await;
    let (_, other) = new_key(&tenant("files"), quotas).await;
    let csv: String = (0..1000).map(|i| format!("{i},{}\n", i * i)).collect();
    let upload = |key: String, bytes: Vec<u8>| async move {
        let response = http().post(format!("{}/v1/files", gateway())).bearer_auth(&key).body(bytes).send().await.expect("POST /v1/files");
        let status = response.status();
        (status, response.json::<Value>().await.unwrap_or(Value::Null))
    };
    let (status, file) = upload(key.clone(), csv.clone().into_bytes()).await;
    assert_eq!(status, StatusCode::CREATED, "{file}");
    let expected_id = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(csv.as_bytes()));
    assert_eq!(file["file_id"], expected_id.as_str());
    assert_eq!(file["size"], csv.len());
    let code = "import pandas as pd\ndf = pd.read_csv('data/squares.csv', header=None)\nprint(int(df[1].sum()))\nopen('out.txt', 'w').write('total ' + str(int(df[1].sum())))";
    let mut body = python(code);
    body["job_id"] = json!("with-input");
    body["inputs"] = json!([{"file_id": expected_id, "path": "data/squares.csv"}]);
    let (status, job, _) = post_job(&key, &body).await;
    assert_eq!(status, StatusCode::CREATED, "{job}");
    let done = wait_job(&key, "with-input").await;
    let total: u64 = (0..1000u64).map(|i| i * i).sum();
    assert_eq!(done["stdout"]["text"], format!("{total}\n"), "{done}");
    // The artifact: a redirect to a presigned URL serving its bytes.
    let no_redirects = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().expect("client");
    let response =
        no_redirects.get(format!("{}/v1/jobs/with-input/artifacts/out.txt", gateway())).bearer_auth(&key).send().await.expect("GET");
    assert_eq!(response.status(), StatusCode::TEMPORARY_REDIRECT);
    let location = response.headers()["location"].to_str().expect("location").to_owned();
    assert!(location.starts_with("http://127.0.0.1:"), "{location}");
    assert_eq!(http().get(&location).send().await.expect("GET artifact").text().await.expect("text"), format!("total {total}"));
    let missing =
        no_redirects.get(format!("{}/v1/jobs/with-input/artifacts/nope.txt", gateway())).bearer_auth(&key).send().await.expect("GET");
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    // Another tenant knowing the digest cannot have the file staged.
    let mut theirs = python("print(open('x.csv').read()[:10])");
    theirs["inputs"] = json!([{"file_id": expected_id, "path": "x.csv"}]);
    let (status, problem, _) = post_job(&other, &theirs).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{problem}");
    // Over the key's upload cap: 413, whether announced or not.
    let (status, problem) = upload(key.clone(), vec![b'x'; (1 << 20) + 1]).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{problem}");
    let chunks = futures::stream::iter((0..20).map(|_| Ok::<_, std::io::Error>(vec![b'y'; 64 << 10])));
    let response = http()
        .post(format!("{}/v1/files", gateway()))
        .bearer_auth(&key)
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
}

/// What a webhook receiver saw: each request's delivery id, signature header and body, and
/// the status it answered.
#[derive(Default)]
struct Received {
    requests: Vec<(String, String, Vec<u8>, u16)>,
}

type Shared = std::sync::Arc<std::sync::Mutex<Received>>;

/// Whether the receiver fails its `n`-th request (from 0).
type Failing = std::sync::Arc<dyn Fn(usize) -> bool + Send + Sync>;

/// A webhook receiver on 127.0.0.1 that answers 500 while `failing()` says so, else 200.
async fn receiver(failing: impl Fn(usize) -> bool + Send + Sync + 'static) -> (String, Shared) {
    let seen: Shared = Default::default();
    let failing = std::sync::Arc::new(failing);
    let state = (seen.clone(), failing);
    let app = axum::Router::new()
        .route(
            "/hook",
            axum::routing::post(
                |axum::extract::State((seen, failing)): axum::extract::State<(Shared, Failing)>,
                 headers: axum::http::HeaderMap,
                 body: axum::body::Bytes| async move {
                    let mut seen = seen.lock().expect("lock");
                    let n = seen.requests.len();
                    let status = if failing(n) { 500 } else { 200 };
                    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
                    seen.requests.push((header("sandq-delivery"), header("sandq-signature"), body.to_vec(), status));
                    axum::http::StatusCode::from_u16(status).expect("status")
                },
            ),
        )
        .with_state((state.0, state.1 as Failing));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}

/// Checks `t=<s>,v1=<hex>` against HMAC-SHA256(secret, "<s>.<body>"), computed here.
fn signed_by(secret: &str, header: &str, body: &[u8]) -> bool {
    use hmac::Mac;
    let Some((t, v1)) = header.split_once(',').and_then(|(t, v)| Some((t.strip_prefix("t=")?, v.strip_prefix("v1=")?))) else {
        return false;
    };
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).expect("key");
    mac.update(format!("{t}.").as_bytes());
    mac.update(body);
    hex::encode(mac.finalize().into_bytes()) == v1
}

/// A key whose jobs may call back to 127.0.0.1, and its webhook secret.
async fn webhook_key(label: &str) -> (String, String) {
    let config = service_config();
    let mut redis = sandq_core::redis_conn::connect(&config.redis).await.expect("redis");
    let quotas = Quotas { webhook_hosts: vec!["127.0.0.1".into()], ..Quotas::default() };
    let (record, key) = keys::create(&mut redis, &Names::new(namespace()), &tenant(label), "test", quotas).await.expect("create key");
    assert!(record.webhook_secret.starts_with("whsec_"));
    (key, record.webhook_secret)
}

/// Waits (up to `limit`) until the receiver answered 200 once.
async fn until_delivered(seen: &Shared, limit: Duration) {
    let started = Instant::now();
    while !seen.lock().expect("lock").requests.iter().any(|r| r.3 == 200) {
        assert!(started.elapsed() < limit, "no delivery within {limit:?}: {} attempts", seen.lock().expect("lock").requests.len());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_webhook_is_signed_retried_after_failures_and_delivered_once() {
    let (key, secret) = webhook_key("hook").await;
    let (url, seen) = receiver(|n| n < 2).await;
    let mut body = python("print('called back')");
    body["job_id"] = json!("hooked");
    body["callback_url"] = json!(url);
    let (status, job, _) = post_job(&key, &body).await;
    assert_eq!(status, StatusCode::CREATED, "{job}");
    until_delivered(&seen, Duration::from_secs(120)).await;
    // Nothing more comes once it was taken.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let seen = seen.lock().expect("lock");
    let statuses: Vec<u16> = seen.requests.iter().map(|r| r.3).collect();
    assert_eq!(statuses, vec![500, 500, 200], "two failures, then one delivery");
    let delivery = &seen.requests[0].0;
    assert!(uuid::Uuid::parse_str(delivery).is_ok(), "{delivery:?}");
    for (id, signature, body, _) in &seen.requests {
        assert_eq!(id, delivery, "one delivery id on every attempt");
        assert!(signed_by(&secret, signature, body), "a bad signature: {signature}");
        assert!(!signed_by("whsec_other", signature, body));
    }
    let payload: Value = serde_json::from_slice(&seen.requests[2].2).expect("JSON");
    assert_eq!(payload["type"], "job.finished");
    assert_eq!(payload["delivery_id"], delivery.as_str());
    assert_eq!(payload["job"]["job_id"], "hooked");
    assert_eq!(payload["job"]["status"], "succeeded");
    assert_eq!(payload["job"]["stdout"]["text"], "called back\n");
}

#[tokio::test]
async fn a_webhook_survives_the_death_of_the_gateway_that_accepted_it() {
    let (key, secret) = webhook_key("restart").await;
    let fail = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let failing = fail.clone();
    let (url, seen) = receiver(move |_| failing.load(std::sync::atomic::Ordering::SeqCst)).await;
    let log = std::env::temp_dir().join(format!("{}-gateway-b.log", namespace()));
    let allow = [("SANDQ__GATEWAY__WEBHOOK_ALLOW_PRIVATE", "true")];
    let (mut b, base) = gw::start(&log, &allow);
    let mut body = python("print('survivor')");
    body["callback_url"] = json!(url);
    let response = http().post(format!("{base}/v1/jobs")).bearer_auth(&key).json(&body).send().await.expect("POST");
    assert_eq!(response.status(), StatusCode::CREATED);
    // Retries are under way when the gateway that took the job dies.
    let started = Instant::now();
    while seen.lock().expect("lock").requests.is_empty() {
        assert!(started.elapsed() < Duration::from_secs(120), "no attempt");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    b.kill().expect("kill");
    b.wait().expect("wait");
    fail.store(false, std::sync::atomic::Ordering::SeqCst);
    let (mut b, _) = gw::start(&log, &allow);
    until_delivered(&seen, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let seen = seen.lock().expect("lock");
    assert_eq!(seen.requests.iter().filter(|r| r.3 == 200).count(), 1, "delivered once");
    let delivery = &seen.requests[0].0;
    assert!(seen.requests.iter().all(|r| &r.0 == delivery && signed_by(&secret, &r.1, &r.2)));
    b.kill().expect("kill");
    let _ = b.wait();
}

#[tokio::test]
async fn callback_urls_to_hosts_not_allowed_or_private_addresses_are_refused() {
    let (key, _) = webhook_key("ssrf").await;
    let log = std::env::temp_dir().join(format!("{}-gateway-c.log", namespace()));
    // A gateway as deployed: private destinations not allowed.
    let (mut c, base) = gw::start(&log, &[]);
    let post = |url: &'static str| {
        let (key, base) = (key.clone(), base.clone());
        async move {
            let mut body = python("print(1)");
            body["callback_url"] = json!(url);
            let response = http().post(format!("{base}/v1/jobs")).bearer_auth(&key).json(&body).send().await.expect("POST");
            let status = response.status();
            (status, response.json::<Value>().await.unwrap_or(Value::Null)["type"].as_str().unwrap_or_default().to_owned())
        }
    };
    assert_eq!(post("http://127.0.0.1:9/hook").await, (StatusCode::BAD_REQUEST, "urn:sandq:problem:invalid-request".to_owned()));
    assert_eq!(post("http://localhost:9/hook").await.0, StatusCode::FORBIDDEN, "a host the key may not call");
    assert_eq!(post("ftp://127.0.0.1/x").await.0, StatusCode::BAD_REQUEST);
    assert_eq!(post("http://user:pw@127.0.0.1/x").await.0, StatusCode::BAD_REQUEST);
    c.kill().expect("kill");
    let _ = c.wait();
}

#[tokio::test]
async fn session_files_are_written_and_read_without_a_job_and_kept_between_jobs_for_their_tenant() {
    let quotas = Quotas { max_sessions: 2, ..Quotas::default() };
    let (_, key) = new_key(&tenant("sess"), quotas).await;
    let (_, other) = new_key(&tenant("sess"), Quotas::default()).await;
    let base = gateway();
    let create = |key: String, name: &'static str| async move {
        http().post(format!("{base}/v1/sessions")).bearer_auth(&key).json(&json!({"name": name})).send().await.expect("POST").status()
    };
    assert_eq!(create(key.clone(), "work").await, StatusCode::CREATED);
    assert_eq!(create(key.clone(), "work").await, StatusCode::OK, "already the tenant's");
    // A file written without a job...
    let put = http()
        .put(format!("{base}/v1/sessions/work/files/data/in.txt"))
        .bearer_auth(&key)
        .body("hello from outside")
        .send()
        .await
        .expect("PUT");
    assert_eq!(put.status(), StatusCode::CREATED);
    let written: Value = put.json().await.expect("json");
    assert_eq!(written["sha256"], hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b"hello from outside")));
    // ... is in /work for the session's next job, whose files stay for the one after.
    let mut body = python("print(open('data/in.txt').read())\nopen('out.txt', 'w').write('made inside')\nx = 41");
    body["session"] = json!("work");
    let (status, job, _) = post_job(&key, &body).await;
    assert_eq!(status, StatusCode::CREATED, "{job}");
    let done = wait_job(&key, job["job_id"].as_str().expect("id")).await;
    assert_eq!(done["stdout"]["text"], "hello from outside\n", "{done}");
    assert_eq!(done["session"]["name"], "work", "the tenant's name in the result");
    let mut body = python("print(x + 1, open('out.txt').read())");
    body["session"] = json!("work");
    let (_, job, _) = post_job(&key, &body).await;
    assert_eq!(wait_job(&key, job["job_id"].as_str().expect("id")).await["stdout"]["text"], "42 made inside\n");
    let (status, listing) = get_json(&key, "/v1/sessions/work/files").await;
    assert_eq!(status, StatusCode::OK);
    let paths: Vec<&str> = listing["files"].as_array().expect("files").iter().filter_map(|f| f["path"].as_str()).collect();
    assert_eq!(paths, vec!["data/in.txt", "out.txt"]);
    let read = http().get(format!("{base}/v1/sessions/work/files/out.txt")).bearer_auth(&key).send().await.expect("GET");
    assert_eq!(read.text().await.expect("text"), "made inside", "the redirect serves the file's bytes");
    let (_, sessions) = get_json(&key, "/v1/sessions").await;
    assert_eq!(sessions["sessions"][0]["name"], "work");
    assert_eq!(sessions["sessions"][0]["files"], 2);
    // Another tenant reaches none of it.
    assert_eq!(get_json(&other, "/v1/sessions/work/files").await.0, StatusCode::NOT_FOUND);
    let theirs = http().put(format!("{base}/v1/sessions/work/files/x")).bearer_auth(&other).body("x").send().await.expect("PUT");
    assert_eq!(theirs.status(), StatusCode::NOT_FOUND);
    assert_eq!(get_json(&other, "/v1/sessions").await.1["sessions"], json!([]));
    // Paths stay under /work.
    // (Sent raw: an HTTP client library would normalise the dots away before sending.)
    for bad in ["../x", "a/../../x", "a%00b", "./x"] {
        let key = key.clone();
        let answer = tokio::task::spawn_blocking(move || {
            let mut stream = raw_connection();
            let request = format!("PUT /v1/sessions/work/files/{bad} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx");
            stream.write_all(request.as_bytes()).expect("write");
            let mut answer = String::new();
            let _ = stream.read_to_string(&mut answer);
            answer
        })
        .await
        .expect("thread");
        assert!(answer.starts_with("HTTP/1.1 400"), "{bad}: {answer}");
    }
    // Two sessions at most; deleting one frees its place.
    assert_eq!(create(key.clone(), "second").await, StatusCode::CREATED);
    assert_eq!(create(key.clone(), "third").await, StatusCode::TOO_MANY_REQUESTS);
    let deleted = http().delete(format!("{base}/v1/sessions/work")).bearer_auth(&key).send().await.expect("DELETE");
    assert_eq!(deleted.status(), StatusCode::NO_CONTENT);
    assert_eq!(get_json(&key, "/v1/sessions/work/files").await.0, StatusCode::NOT_FOUND);
    assert_eq!(create(key.clone(), "third").await, StatusCode::CREATED);
}
