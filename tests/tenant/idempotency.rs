//! Findings 1 and 2: a job id runs once, counted once; a running job's records live as long as
//! it does.

use super::*;
use sandq_tests::gateway::new_key;

/// The key's Redis names as the gateway spells them (gateway/src/quota.rs).
fn quota_prefix(key_id: &str) -> String {
    format!("{}:apikey:{{{key_id}}}", sandq_tests::namespace())
}

async fn redis() -> sandq_core::redis_conn::RedisConn {
    sandq_core::redis_conn::connect(&sandq_tests::service_config().redis).await.expect("redis")
}

/// Jobs the key was counted for in its per-minute rate counters (all minutes still kept).
async fn rate_counted(key_id: &str) -> u64 {
    let mut redis = redis().await;
    let keys: Vec<String> = redis::cmd("KEYS").arg(format!("{}:rate:*", quota_prefix(key_id))).query_async(&mut redis).await.expect("KEYS");
    let mut total = 0;
    for key in keys {
        let n: Option<u64> = redis::cmd("GET").arg(&key).query_async(&mut redis).await.expect("GET");
        total += n.unwrap_or(0);
    }
    total
}

/// The key's jobs in flight (queue job ids).
async fn in_flight(key_id: &str) -> Vec<String> {
    let mut redis = redis().await;
    redis::cmd("ZRANGE").arg(format!("{}:inflight", quota_prefix(key_id))).arg(0).arg(-1).query_async(&mut redis).await.expect("ZRANGE")
}

async fn post_with(key: &str, body: &Value, idempotency: Option<&str>) -> (StatusCode, Value) {
    let mut request = http().post(format!("{}/v1/jobs", gateway())).bearer_auth(key).json(body);
    if let Some(k) = idempotency {
        request = request.header("Idempotency-Key", k);
    }
    let response = request.send().await.expect("POST");
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

const RESULT_EXPIRED: &str = "urn:sandq:problem:result-expired";

/// Waits until the job has ended and its (1 s) result has expired: `GET` answers 410
/// `result-expired`. Returns the terminal result when a read caught it.
async fn wait_expired(key: &str, id: &str) -> Option<Value> {
    let started = Instant::now();
    let mut seen = None;
    loop {
        let (status, job) = get_json(key, &format!("/v1/jobs/{id}?wait=5s")).await;
        match status {
            StatusCode::GONE => {
                assert_eq!(job["type"], RESULT_EXPIRED, "{job}");
                return seen;
            }
            StatusCode::OK => {
                let state = job["status"].as_str().unwrap_or_default();
                if !["queued", "running"].contains(&state) {
                    seen = Some(job);
                }
            }
            other => panic!("GET {id}: {other} {job}"),
        }
        assert!(started.elapsed() < Duration::from_secs(180), "job {id} did not end and expire");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Finding 1: the same body POSTed again with the same `job_id`, and with the same
/// `Idempotency-Key`, after the job ended and its result expired (`result_ttl: "1s"`) used to
/// publish it again: the program ran twice, uncounted. Now the retry (and `GET`) answer 410
/// `result-expired`, the program ran once (each run appends a line to a session file, which a
/// later job of the session counts), and the key's rate counter counted each job once.
/// Another tenant's same `job_id` is its own job.
#[tokio::test]
async fn an_expired_job_is_not_run_again_nor_counted() {
    let me = tenant("idem");
    let (key_id, key) = new_key(&me, Quotas::default()).await;
    let (other_id, other) = new_key(&tenant("idem"), Quotas::default()).await;
    let session = "runs";
    let job = |file: &str| {
        let mut body = python(&format!("open('{file}', 'a').write('ran\\n')\nprint('appended')"));
        body["result_ttl"] = json!("1s");
        body["session"] = json!(session);
        body
    };

    // By job_id.
    let mut by_id = job("by_id.txt");
    by_id["job_id"] = json!("once");
    let (status, first) = post_job(&key, &by_id).await;
    assert_eq!(status, StatusCode::CREATED, "{first}");
    if let Some(done) = wait_expired(&key, "once").await {
        assert_eq!(done["status"], "succeeded", "{done}");
    }
    let (status, again) = post_job(&key, &by_id).await;
    assert_eq!((status, again["type"].as_str()), (StatusCode::GONE, Some(RESULT_EXPIRED)), "{again}");
    let (status, read) = get_json(&key, "/v1/jobs/once").await;
    assert_eq!((status, read["type"].as_str()), (StatusCode::GONE, Some(RESULT_EXPIRED)), "{read}");
    // A cancel of it is refused as over; its events end at once.
    let cancel = http().delete(format!("{}/v1/jobs/once", gateway())).bearer_auth(&key).send().await.expect("DELETE");
    assert_eq!(cancel.status(), StatusCode::CONFLICT);

    // By Idempotency-Key.
    let by_key = job("by_key.txt");
    let (status, first) = post_with(&key, &by_key, Some("retry-me")).await;
    assert_eq!(status, StatusCode::CREATED, "{first}");
    let id = first["job_id"].as_str().expect("job_id").to_owned();
    wait_expired(&key, &id).await;
    let (status, again) = post_with(&key, &by_key, Some("retry-me")).await;
    assert_eq!((status, again["type"].as_str()), (StatusCode::GONE, Some(RESULT_EXPIRED)), "{again}");

    // The other tenant's `once` is a job of its own: queued and run.
    let mut theirs = python("print('theirs')");
    theirs["job_id"] = json!("once");
    let (status, job_theirs) = post_job(&other, &theirs).await;
    assert_eq!(status, StatusCode::CREATED, "{job_theirs}");
    assert_eq!(wait_job(&other, "once").await["stdout"]["text"], "theirs\n");

    // Each program ran once: the session's files have one line each.
    let mut count = python("print(len(open('by_id.txt').readlines()), len(open('by_key.txt').readlines()))");
    count["session"] = json!(session);
    let (status, counter) = post_with(&key, &count, None).await;
    assert_eq!(status, StatusCode::CREATED, "{counter}");
    let counted = wait_job(&key, counter["job_id"].as_str().expect("id")).await;
    assert_eq!(counted["stdout"]["text"], "1 1\n", "{counted}");

    // Counted once each: three jobs of this key (two programs and the counter), one of the other.
    assert_eq!(rate_counted(&key_id).await, 3);
    assert_eq!(rate_counted(&other_id).await, 1);
    let mine = in_flight(&key_id).await;
    let expected: Vec<String> =
        ["once", id.as_str(), counter["job_id"].as_str().expect("id")].iter().map(|i| format!("{me}_{i}")).collect();
    assert!(mine.iter().all(|m| expected.contains(m)), "in flight {mine:?}, expected among {expected:?}");
}

/// Reads server-sent events (`event:`, `data:` as JSON) until one of type `until` (included) or
/// the stream's end.
async fn next_events(response: &mut reqwest::Response, buffer: &mut String, until: &str) -> Vec<(String, Value)> {
    let mut events = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        while let Some(end) = buffer.find("\n\n") {
            let block: String = buffer.drain(..end + 2).collect();
            let mut kind = String::new();
            let mut data = Value::Null;
            for line in block.lines() {
                if let Some(k) = line.strip_prefix("event:") {
                    kind = k.trim().to_owned();
                } else if let Some(d) = line.strip_prefix("data:") {
                    data = serde_json::from_str(d.trim()).unwrap_or(Value::Null);
                }
            }
            if kind.is_empty() {
                continue;
            }
            let done = kind == until;
            events.push((kind, data));
            if done {
                return events;
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, response.chunk()).await {
            Ok(Ok(Some(chunk))) => buffer.push_str(&String::from_utf8_lossy(&chunk)),
            Ok(Ok(None)) => return events,
            Ok(Err(e)) => panic!("event stream: {e}"),
            Err(_) => panic!("no `{until}` event within 2 minutes: {events:?}"),
        }
    }
}

/// Finding 2: a job with `result_ttl: "1s"` used to look gone while it ran (its `running`
/// record and live events expired after 1 s): `queued`, an empty event stream, a cancel
/// refused as over. Now, well past that second: it reads `running`, it is in its key's jobs in
/// flight (a second job of a key allowed one is refused), its event stream has its events,
/// and a cancel is accepted and ends it `cancelled`. Another tenant reaches none of it.
#[tokio::test]
async fn a_running_job_with_a_short_result_ttl_stays_visible() {
    let (key_id, key) = new_key(&tenant("live"), Quotas { max_in_flight: 1, ..Quotas::default() }).await;
    let other = super::key("live", Quotas::default()).await;
    let mut body = python("print('started')\nimport time\ntime.sleep(60)\nprint('not cancelled')");
    body["result_ttl"] = json!("1s");
    body["timeout"] = json!("120s");
    body["job_id"] = json!("sleeper");
    let (status, job) = post_with(&key, &body, None).await;
    assert_eq!(status, StatusCode::CREATED, "{job}");
    let started = Instant::now();
    let running = loop {
        let (status, job) = get_json(&key, "/v1/jobs/sleeper").await;
        assert_eq!(status, StatusCode::OK, "{job}");
        if job["status"] == "running" {
            break job;
        }
        assert_eq!(job["status"], "queued", "{job}");
        assert!(started.elapsed() < Duration::from_secs(120), "never ran");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let since = running["started_at_ms"].as_u64().expect("started_at_ms");
    // Longer than its result_ttl after it started (what used to expire its records).
    while sandq_core::time::now_ms() < since + 3_000 {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (status, job) = get_json(&key, "/v1/jobs/sleeper").await;
    assert_eq!((status, job["status"].as_str()), (StatusCode::OK, Some("running")), "{job}");
    let mine = in_flight(&key_id).await;
    assert!(mine.iter().any(|m| m.ends_with("_sleeper")), "in flight: {mine:?}");
    let (status, refused) = post_with(&key, &python("print(1)"), None).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "one job in flight at most: {refused}");
    // The other tenant sees none of it.
    assert_eq!(get_json(&other, "/v1/jobs/sleeper").await.0, StatusCode::NOT_FOUND);
    let theirs = http().delete(format!("{}/v1/jobs/sleeper", gateway())).bearer_auth(&other).send().await.expect("DELETE");
    assert_eq!(theirs.status(), StatusCode::NOT_FOUND);

    // Its events so far, then its end after the cancel, on one stream.
    let mut stream = http().get(format!("{}/v1/jobs/sleeper/events", gateway())).bearer_auth(&key).send().await.expect("GET events");
    assert_eq!(stream.status(), StatusCode::OK);
    let mut buffer = String::new();
    let before = next_events(&mut stream, &mut buffer, "stdout").await;
    let kinds: Vec<&str> = before.iter().map(|(k, _)| k.as_str()).collect();
    assert!(kinds.contains(&"started"), "{before:?}");
    assert_eq!(before.last().map(|(_, d)| d["text"].clone()), Some(json!("started\n")), "{before:?}");
    let cancel = http().delete(format!("{}/v1/jobs/sleeper", gateway())).bearer_auth(&key).send().await.expect("DELETE");
    assert_eq!(cancel.status(), StatusCode::ACCEPTED);
    let after = next_events(&mut stream, &mut buffer, "end").await;
    assert_eq!(after.last().map(|(k, d)| (k.as_str(), d["status"].clone())), Some(("end", json!("cancelled"))), "{after:?}");
    assert!(!after.iter().any(|(_, d)| d["text"] == "not cancelled\n"), "{after:?}");
}
