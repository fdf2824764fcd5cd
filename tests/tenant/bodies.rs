//! Findings 3, 4, 8 and part of 11 (docs/threat-model.md "A tenant with a valid key"): request
//! bodies have an overall deadline and a per-key bound; uploads are spooled to disk on every
//! route (the gateway's memory does not grow with an upload); uploads are addressed per tenant;
//! a revoked key's streams end.

use std::process::Child;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::*;

/// A gateway of the test's own with extra settings; killed when dropped.
struct OwnGateway {
    base: String,
    child: Child,
}

impl Drop for OwnGateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn own_gateway(name: &str, env: &[(&str, &str)]) -> OwnGateway {
    ensure_worker();
    let log = std::env::temp_dir().join(format!("{}-tenant-{name}-gateway.log", sandq_tests::namespace()));
    let (child, base) = gw::start(&log, env);
    OwnGateway { base, child }
}

/// Sends a request whose body (`Content-Length: declared`) comes one byte a second, and returns
/// the gateway's status code (0 when it closed without answering). The bytes stop when the
/// answer comes; at most 120 s.
async fn slow_body(base: &str, method: &str, path: &str, headers: &[(&str, String)], declared: u64) -> u16 {
    let addr = base.trim_start_matches("http://").to_owned();
    let stream = tokio::net::TcpStream::connect(&addr).await.expect("connect");
    let (mut read, mut write) = stream.into_split();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {declared}\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    write.write_all(head.as_bytes()).await.expect("write the head");
    let feeder = tokio::spawn(async move {
        for _ in 0..declared {
            if write.write_all(b" ").await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            match read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
            if answer.windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
    })
    .await;
    feeder.abort();
    let text = String::from_utf8_lossy(&answer);
    text.strip_prefix("HTTP/1.1 ").and_then(|rest| rest.get(..3)).and_then(|code| code.parse().ok()).unwrap_or(0)
}

fn bearer(key: &str) -> (&'static str, String) {
    ("Authorization", format!("Bearer {key}"))
}

async fn create_session(base: &str, key: &str, name: &str) {
    let response = http().post(format!("{base}/v1/sessions")).bearer_auth(key).json(&json!({"name": name})).send().await.expect("POST");
    assert!(response.status().is_success(), "{:?}", response.status());
}

/// Finding 3: one key's slow bodies (a byte a second) on `/v1/files`, a session file's PUT,
/// `/mcp` and `POST /v1/jobs` each end at the body's deadline (408) instead of holding a request
/// slot for as long as the client likes; the key's bodies beyond `max_uploads_per_key` are
/// refused at once (429); and another tenant is served meanwhile, though the gateway has only 6
/// request slots.
#[tokio::test]
async fn slow_bodies_end_at_their_deadline_and_one_key_cannot_hold_the_request_slots() {
    let own = own_gateway(
        "slowbodies",
        &[
            ("SANDQ__GATEWAY__BODY_TIMEOUT", "3s"),
            ("SANDQ__GATEWAY__READ_TIMEOUT", "5s"),
            ("SANDQ__GATEWAY__MAX_REQUESTS", "6"),
            ("SANDQ__GATEWAY__MAX_UPLOADS_PER_KEY", "2"),
        ],
    );
    let base = own.base.clone();
    let a = key("slowa", Quotas::default()).await;
    let b = key("slowb", Quotas::default()).await;
    create_session(&base, &a, "s").await;
    let octets = ("Content-Type", "application/octet-stream".to_owned());
    let json_type = ("Content-Type", "application/json".to_owned());
    let mcp_accept = ("Accept", "application/json, text/event-stream".to_owned());

    // Two slow uploads of A hold its two bodies under way ...
    let held: Vec<_> = (0..2)
        .map(|_| {
            let (base, headers) = (base.clone(), vec![bearer(&a), octets.clone()]);
            tokio::spawn(async move { slow_body(&base, "POST", "/v1/files", &headers, 1000).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // ... so any more of A's, on any route, are refused at once, and free their slot.
    let mut refused = Vec::new();
    for (method, path, headers) in [
        ("POST", "/v1/files", vec![bearer(&a), octets.clone()]),
        ("PUT", "/v1/sessions/s/files/x.bin", vec![bearer(&a), octets.clone()]),
        ("POST", "/mcp", vec![bearer(&a), json_type.clone(), mcp_accept.clone()]),
        ("POST", "/v1/jobs", vec![bearer(&a), json_type.clone()]),
        ("POST", "/v1/files", vec![bearer(&a), octets.clone()]),
        ("POST", "/v1/files", vec![bearer(&a), octets.clone()]),
    ] {
        refused.push((path, slow_body(&base, method, path, &headers, 1000).await));
    }
    assert!(refused.iter().all(|(_, status)| *status == 429), "A's bodies beyond its bound: {refused:?}");
    // B is served meanwhile.
    let response = http().post(format!("{base}/v1/jobs")).bearer_auth(&b).json(&python("print(6 * 7)")).send().await.expect("POST");
    assert_eq!(response.status(), StatusCode::CREATED);
    let upload = http().post(format!("{base}/v1/files")).bearer_auth(&b).body(b"b's bytes".to_vec()).send().await.expect("POST");
    assert_eq!(upload.status(), StatusCode::CREATED);
    // A's two slow uploads end at their deadline (3 s + 1000 bytes at 1 MiB/s), long before their
    // 1000 bytes would have come.
    for task in held {
        assert_eq!(task.await.expect("task"), 408);
    }

    // Every route's body has the deadline: one slow body each, of keys of their own.
    let mut each = Vec::new();
    for (method, path, content_type) in [
        ("POST", "/v1/files", octets.clone()),
        ("PUT", "/v1/sessions/s/files/y.bin", octets.clone()),
        ("POST", "/mcp", json_type.clone()),
        ("POST", "/v1/jobs", json_type.clone()),
        ("POST", "/v1/sessions", json_type.clone()),
    ] {
        let k = if path.starts_with("/v1/sessions/s/") { a.clone() } else { key("slowr", Quotas::default()).await };
        let base = base.clone();
        let headers = vec![bearer(&k), content_type, mcp_accept.clone()];
        each.push((path, tokio::spawn(async move { slow_body(&base, method, path, &headers, 1000).await })));
    }
    for (path, task) in each {
        assert_eq!(task.await.expect("task"), 408, "{path}");
    }
}

/// `VmHWM` (peak resident memory) of a process, bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM");
    line.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()).expect("kB") * 1024
}

/// A multipart body of one `file` part named `name`.
fn multipart(boundary: &str, name: &str, bytes: &[u8]) -> Vec<u8> {
    let mut body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(bytes);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    body
}

/// Finding 4: a 64 MiB upload on every upload route (`/v1/files`, a session file's PUT, E2B's
/// file write as octet-stream and as multipart) raises the gateway's peak memory by far less
/// than its size: the bytes go to a temporary file, then from it to S3. (MCP's `upload_file`
/// takes its file inline in a JSON body, so it is bounded by `max_body_bytes`.)
#[tokio::test]
async fn a_large_upload_on_any_route_does_not_grow_the_gateways_memory() {
    use sha2::Digest as _;
    let own = own_gateway("memory", &[]);
    let base = own.base.clone();
    let pid = own.child.id();
    let a = key("mem", Quotas::default()).await;
    create_session(&base, &a, "m").await;
    let created = http()
        .post(format!("{base}/sandboxes"))
        .header("X-API-Key", &a)
        .json(&json!({"templateID": "code-interpreter-v1", "timeout": 600}))
        .send()
        .await
        .expect("POST /sandboxes");
    assert!(created.status().is_success(), "{:?}", created.status());
    let sandbox = created.json::<Value>().await.expect("json")["sandboxID"].as_str().expect("sandboxID").to_owned();
    let envd = |query: &str| {
        http()
            .post(format!("{base}/files{query}"))
            .header("X-Access-Token", &a)
            .header("E2b-Sandbox-Id", &sandbox)
            .header("E2b-Sandbox-Port", "49983")
    };
    let uploads = |bytes: Vec<u8>, tag: &str| {
        let boundary = format!("b{}", uuid::Uuid::new_v4().simple());
        let mp = multipart(&boundary, &format!("mp-{tag}.bin"), &bytes);
        vec![
            ("/v1/files", http().post(format!("{base}/v1/files")).bearer_auth(&a).body(bytes.clone())),
            ("session PUT", http().put(format!("{base}/v1/sessions/m/files/put-{tag}.bin")).bearer_auth(&a).body(bytes.clone())),
            (
                "E2B octet-stream",
                envd(&format!("?path=/home/user/oct-{tag}.bin")).header("Content-Type", "application/octet-stream").body(bytes.clone()),
            ),
            ("E2B multipart", envd("").header("Content-Type", format!("multipart/form-data; boundary={boundary}")).body(mp)),
        ]
    };
    // Each route once with 1 MiB first, so that what it allocates once is in the baseline.
    for (route, request) in uploads(vec![7u8; 1 << 20], "warm") {
        let response = request.send().await.expect(route);
        assert!(response.status().is_success(), "{route}: {:?}", response.status());
    }
    let mut big = vec![0u8; 64 << 20];
    rand::Rng::fill(&mut rand::rng(), &mut big[..]);
    for (route, request) in uploads(big.clone(), "big") {
        let before = peak_rss(pid);
        let response = request.send().await.expect(route);
        assert!(response.status().is_success(), "{route}: {:?}", response.status());
        let grown = peak_rss(pid).saturating_sub(before);
        eprintln!("{route}: peak RSS +{} KiB for 64 MiB", grown >> 10);
        assert!(grown < 16 << 20, "{route}: a 64 MiB upload raised the gateway's peak memory by {} MiB", grown >> 20);
    }
    // What was written is the 64 MiB: the session's file, and the sandbox's two (its session is
    // named by the sandbox's id), at their size and digest.
    let digest = hex::encode(sha2::Sha256::digest(&big));
    let mut sizes = Vec::new();
    for session in ["m", sandbox.as_str()] {
        let (status, listing) = sandq_tests::gateway::get_json(&base, &a, &format!("/v1/sessions/{session}/files")).await;
        assert_eq!(status, StatusCode::OK, "{listing}");
        sizes.extend(
            listing["files"]
                .as_array()
                .expect("files")
                .iter()
                .filter(|f| f["path"].as_str().is_some_and(|p| p.contains("-big")))
                .map(|f| (f["size"].as_u64().unwrap_or_default(), f["sha256"].as_str().unwrap_or_default().to_owned())),
        );
    }
    assert_eq!(sizes, vec![(64 << 20, digest.clone()); 3]);
}

/// Finding 8: tenant A uploads some bytes, then tenant B the same bytes: B's upload writes an
/// object of B's own (a different S3 key from A's), so it does the whole write whether or not A
/// uploaded them, and its time tells B nothing about A; the shared content address is not
/// used. B's job stages B's copy.
#[tokio::test]
async fn an_upload_is_stored_per_tenant_and_tells_nothing_of_another_tenants() {
    use sha2::Digest as _;
    let a_tenant = tenant("upa");
    let b_tenant = tenant("upb");
    let a = new_key(&a_tenant, Quotas::default()).await.1;
    let b = new_key(&b_tenant, Quotas::default()).await.1;
    let bytes = format!("same bytes {}\n", uuid::Uuid::new_v4()).repeat(1000).into_bytes();
    let digest = hex::encode(sha2::Sha256::digest(&bytes));
    let mut ids = Vec::new();
    for k in [&a, &b] {
        let response = http().post(format!("{}/v1/files", gateway())).bearer_auth(k).body(bytes.clone()).send().await.expect("POST");
        assert_eq!(response.status(), StatusCode::CREATED);
        ids.push(response.json::<Value>().await.expect("json")["file_id"].as_str().expect("file_id").to_owned());
    }
    assert_eq!(ids, vec![digest.clone(), digest.clone()], "the file id is still the bytes' SHA-256");
    let config = sandq_tests::service_config();
    let s3 = sandq_core::storage::client(&config.s3);
    let size = |key: String| {
        let (s3, bucket) = (s3.clone(), config.s3.bucket.clone());
        async move { sandq_core::storage::object_size(&s3, &bucket, &key).await.expect("HEAD") }
    };
    let a_key = sandq_schemas::names::tenant_input_key(&a_tenant, &digest);
    let b_key = sandq_schemas::names::tenant_input_key(&b_tenant, &digest);
    assert_ne!(a_key, b_key);
    assert_eq!(size(a_key).await, Some(bytes.len() as u64), "A's upload is A's object");
    assert_eq!(size(b_key).await, Some(bytes.len() as u64), "B's upload wrote B's own object");
    assert_eq!(size(sandq_schemas::names::input_key(&digest)).await, None, "no upload went to the shared content address");
    // B's job stages B's copy.
    let mut job = python("import hashlib; print(hashlib.sha256(open('/work/in.txt','rb').read()).hexdigest())");
    job["inputs"] = json!([{"file_id": digest, "path": "in.txt"}]);
    let (status, created) = post_job(&b, &job).await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let done = wait_job(&b, created["job_id"].as_str().expect("job_id")).await;
    assert_eq!(done["status"], "succeeded", "{done}");
    assert!(done["stdout"]["text"].as_str().unwrap_or_default().contains(&digest), "{done}");
}

/// Finding 11 (part): revoking a key ends its open streams: an SSE event stream and a
/// `?wait=` on a 60 s job end soon after the key is revoked (the stream without the job's
/// `end` event, the wait with 401), not when the job ends or the stream's 2 h are up.
#[tokio::test]
async fn revoking_a_key_ends_its_event_streams_and_waits() {
    let (key_id, a) = new_key(&tenant("revoke"), Quotas::default()).await;
    let mut job = python("import time; print('started', flush=True); time.sleep(60); print('done')");
    job["timeout"] = json!("120s");
    let (status, created) = post_job(&a, &job).await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let id = created["job_id"].as_str().expect("job_id").to_owned();
    let events = http().get(format!("{}/v1/jobs/{id}/events", gateway())).bearer_auth(&a).send().await.expect("GET events");
    assert_eq!(events.status(), StatusCode::OK);
    let waiting = {
        let (a, id) = (a.clone(), id.clone());
        tokio::spawn(async move {
            http().get(format!("{}/v1/jobs/{id}?wait=60s", gateway())).bearer_auth(&a).send().await.expect("GET").status()
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let config = sandq_tests::service_config();
    let mut redis = sandq_core::redis_conn::connect(&config.redis).await.expect("redis");
    sandq_core::keys::revoke(&mut redis, &sandq_schemas::names::Names::new(sandq_tests::namespace()), &key_id).await.expect("revoke");
    // The stream ends (read to its end) before the job does: it never carries `end`.
    let text = events.text().await.unwrap_or_default();
    assert!(!text.contains("event: end"), "the stream lasted until the job ended: {text}");
    assert_eq!(waiting.await.expect("task"), StatusCode::UNAUTHORIZED, "the wait ends with the key");
}
