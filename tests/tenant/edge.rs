//! The gateway's edges (issue 36, findings 7, 9 and 11): webhook addresses that only look
//! public, `/metrics` open to anyone, `/mcp` called by a foreign page or a rebound name, and a
//! revoked key's webhooks. docs/threat-model.md "A tenant with a valid key".
//!
//! No test sends traffic beyond loopback: the special addresses of finding 7 are refused at
//! submission, before any connection.

use std::future::Future;
use std::io::{Read as _, Write as _};
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use sandq_core::keys::{self, Quotas};
use sandq_schemas::names::Names;
use sandq_tests::{namespace, service_config};

use super::*;

/// The tenant binary's gateway log (see `gateway()`).
fn shared_log() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("{}-tenant-gateway.log", sandq_tests::namespace()))
}

/// Finding 7: a `callback_url` whose host is an IPv6 form that carries or stands for a
/// non-public address (NAT64 of loopback and of the metadata address, NAT64 local-use, 6to4,
/// Teredo, IPv4-compatible, IPv4-mapped, site-local), or a special IPv4 range the old check
/// missed, is refused at submission by a gateway with its default settings (private
/// webhooks refused), although the key's `webhook_hosts` names each host (written differently
/// from the URL for one, to show literals match by address).
#[tokio::test]
async fn a_callback_url_on_a_special_address_is_refused_whatever_its_form() {
    let log = std::env::temp_dir().join(format!("{}-tenant-edge-webhooks-gateway.log", namespace()));
    let (_child, base) = gw::start(&log, &[]);
    let hosts = [
        "64:ff9b::7f00:1",                      // NAT64 of 127.0.0.1
        "64:ff9b::a9fe:a9fe",                   // NAT64 of 169.254.169.254
        "64:ff9b:1::a00:1",                     // NAT64, local use (RFC 8215)
        "2002:7f00:1::1",                       // 6to4 of 127.0.0.1
        "2001:0:4136:e378:8000:63bf:3fff:fdd2", // Teredo
        "::7f00:1",                             // IPv4-compatible 127.0.0.1
        "::ffff:7f00:1",                        // IPv4-mapped 127.0.0.1
        "fec0::1",                              // site-local
        "100::1",                               // discard-only
        "192.0.0.8",                            // IPv4 dummy address
        "192.88.99.1",                          // deprecated 6to4 relay anycast
        "198.51.100.1",                         // documentation
    ];
    let mut allowed: Vec<String> = hosts.iter().map(|h| (*h).to_owned()).collect();
    allowed[0] = "[64:ff9b:0:0:0:0:7f00:1]".to_owned();
    let (_, key) = new_key(&tenant("hookaddr"), Quotas { webhook_hosts: allowed, ..Quotas::default() }).await;
    for host in hosts {
        let url = if host.contains(':') { format!("http://[{host}]:9/hook") } else { format!("http://{host}:9/hook") };
        let mut body = python("print(1)");
        body["callback_url"] = json!(url);
        let response = http().post(format!("{base}/v1/jobs")).bearer_auth(&key).json(&body).send().await.expect("POST");
        let status = response.status();
        let problem: Value = response.json().await.unwrap_or(Value::Null);
        assert_eq!(status, StatusCode::BAD_REQUEST, "{url}: {problem}");
        assert_eq!(problem["type"], "urn:sandq:problem:invalid-request", "{url}: {problem}");
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(detail.contains("resolves to no public address"), "{url}: {problem}");
    }
}

/// Finding 9: `/metrics` (request counts by route, every tenant's together) is not on the
/// API's listener: tenant B with its key, and a caller without one, get 404 there while tenant
/// A makes requests; the operator's listener has them.
#[tokio::test]
async fn metrics_are_the_operators_and_not_on_the_api_listener() {
    let a = key("metricsa", Quotas::default()).await;
    let b = key("metricsb", Quotas::default()).await;
    for _ in 0..3 {
        let (status, _) = get_json(&a, "/v1/jobs/metrics-a-never-submitted").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }
    for bearer in [Some(b.as_str()), None] {
        let mut request = http().get(format!("{}/metrics", gateway()));
        if let Some(bearer) = bearer {
            request = request.bearer_auth(bearer);
        }
        let response = request.send().await.expect("GET /metrics");
        assert_eq!(response.status(), StatusCode::NOT_FOUND, "with a key: {}", bearer.is_some());
        let text = response.text().await.unwrap_or_default();
        assert!(!text.contains("sandq_gateway_requests_total"), "{text}");
    }
    let operator = gw::operator_url_from_log(&shared_log());
    let text = http().get(format!("{operator}/metrics")).send().await.expect("operator /metrics").text().await.expect("text");
    let line = text
        .lines()
        .find(|l| l.starts_with("sandq_gateway_requests_total{") && l.contains("route=\"/v1/jobs/{id}\"") && l.contains("status=\"4xx\""))
        .unwrap_or_else(|| panic!("no count of A's requests for the operator: {text}"));
    let count: f64 = line.rsplit(' ').next().and_then(|n| n.parse().ok()).expect("a count");
    assert!(count >= 3.0, "{line}");
}

/// One raw HTTP/1.1 POST of an MCP `initialize` to `/mcp` with these `Host` and `Origin`
/// headers; the status and the body.
fn mcp_initialize(base: &str, key: &str, host: &str, origin: Option<&str>) -> (u16, String) {
    let addr = base.trim_start_matches("http://");
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"edge","version":"1"}}}"#;
    let origin = origin.map(|o| format!("Origin: {o}\r\n")).unwrap_or_default();
    let request = format!(
        "POST /mcp HTTP/1.1\r\nHost: {host}\r\n{origin}Authorization: Bearer {key}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    stream.write_all(request.as_bytes()).expect("write");
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    let status = answer.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, answer)
}

/// Finding 11: a browser page of another site (its `Origin`), or one that rebinds its own name
/// to the loopback gateway (its `Host`), cannot call `/mcp`, even with a valid key; the same
/// request without `Origin`, by a loopback name with the port, is served.
#[tokio::test]
async fn mcp_refuses_a_foreign_origin_and_a_rebound_host() {
    let a = key("mcporigin", Quotas::default()).await;
    let base = gateway();
    let port = base.rsplit(':').next().expect("port").to_owned();
    let own = format!("127.0.0.1:{port}");
    let refused = [
        (own.clone(), Some("https://evil.example")),
        (own.clone(), Some("null")),
        (own.clone(), Some(&*format!("http://127.0.0.1:{port}"))),
        (format!("evil.example:{port}"), None),
        (format!("rebind.attacker.test:{port}"), Some("http://rebind.attacker.test")),
        ("127.0.0.1:1".to_owned(), None),
    ];
    for (host, origin) in &refused {
        let (status, answer) = mcp_initialize(base, &a, host, *origin);
        assert_eq!(status, 403, "Host {host}, Origin {origin:?}: {answer}");
        assert!(answer.contains("urn:sandq:problem:origin-not-allowed"), "{answer}");
    }
    for host in [own.clone(), format!("localhost:{port}"), format!("[::1]:{port}")] {
        let (status, answer) = mcp_initialize(base, &a, &host, None);
        assert_eq!(status, 200, "Host {host}: {answer}");
        assert!(answer.contains("protocolVersion"), "{answer}");
    }
}

/// What a receiver saw: each request's status as it answered.
type Seen = Arc<Mutex<Vec<u16>>>;

/// What a receiver does before answering its first request.
type OnFirst = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// A loopback webhook receiver. `on_first` runs before the first request is answered (with a
/// 500); every later request is answered 200.
async fn receiver(on_first: OnFirst) -> (String, Seen) {
    let seen: Seen = Default::default();
    let app = axum::Router::new()
        .route(
            "/hook",
            axum::routing::post(|axum::extract::State((seen, on_first)): axum::extract::State<(Seen, OnFirst)>| async move {
                let first = seen.lock().expect("lock").is_empty();
                if first {
                    on_first().await;
                }
                let status = if first { 500 } else { 200 };
                seen.lock().expect("lock").push(status);
                axum::http::StatusCode::from_u16(status).expect("status")
            }),
        )
        .with_state((seen.clone(), on_first));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}

/// Waits (at most 3 minutes) for a line of the shared gateway's log holding every one of
/// `parts`.
async fn until_logged(parts: &[&str]) -> String {
    let started = Instant::now();
    loop {
        let text = std::fs::read_to_string(shared_log()).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| parts.iter().all(|p| l.contains(p))) {
            return line.to_owned();
        }
        assert!(started.elapsed() < Duration::from_secs(180), "no log line with {parts:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Finding 11: revoking a key ends its webhooks. Tenant A's delivery fails once, and its key is
/// revoked before that failure is answered; the delivery is then dropped (an audit line says
/// so) and the receiver, which would now accept, gets nothing more. Tenant B's delivery, which
/// fails once too, is delivered: only the revoked key's deliveries end.
#[tokio::test]
async fn revoking_a_key_ends_its_webhooks() {
    gateway();
    let hooks = Quotas { webhook_hosts: vec!["127.0.0.1".into()], ..Quotas::default() };
    let (a_id, a) = new_key(&tenant("revokedhook"), hooks.clone()).await;
    let (_, b) = new_key(&tenant("kepthook"), hooks).await;
    let revoke: OnFirst = Arc::new(move || {
        let id = a_id.clone();
        Box::pin(async move {
            let mut redis = sandq_core::redis_conn::connect(&service_config().redis).await.expect("redis");
            keys::revoke(&mut redis, &Names::new(namespace()), &id).await.expect("revoke");
        })
    });
    let (a_url, a_seen) = receiver(revoke).await;
    let (b_url, b_seen) = receiver(Arc::new(|| Box::pin(async {}))).await;
    let a_job = format!("revoked-{}", uuid::Uuid::new_v4().simple());
    let b_job = format!("kept-{}", uuid::Uuid::new_v4().simple());
    for (key, job, url) in [(&a, &a_job, &a_url), (&b, &b_job, &b_url)] {
        let mut body = python("print('hooked')");
        body["job_id"] = json!(job);
        body["callback_url"] = json!(url);
        let (status, answer) = post_job(key, &body).await;
        assert_eq!(status, StatusCode::CREATED, "{answer}");
    }
    let dropped = until_logged(&["webhook dropped: its key was revoked", &a_job]).await;
    assert!(dropped.contains("revoked_at_ms"), "{dropped}");
    assert_eq!(wait_job(&b, &b_job).await["status"], "succeeded");
    until_logged(&["webhook delivered", &b_job]).await;
    assert_eq!(*a_seen.lock().expect("lock"), vec![500], "A's receiver got a delivery after the revocation");
    assert_eq!(*b_seen.lock().expect("lock"), vec![500, 200]);
}
