//! A `sandq-gateway` process for the tests that go through the HTTP API (`gateway.rs`,
//! `tenant.rs`): started in the test namespace, its address read from its log, and keys made in
//! the key store directly.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sandq_core::keys::{self, Quotas};
use sandq_schemas::names::Names;

use crate::{bin_dir, namespace, service_config};

/// Spawns a gateway in the test namespace with extra `SANDQ__GATEWAY__*` settings, logging
/// to `log_name`.
pub fn spawn(log_name: &std::path::Path, env: &[(&str, &str)]) -> Child {
    let log = std::fs::File::create(log_name).expect("log file");
    let mut command = Command::new(bin_dir().join("sandq-gateway"));
    command
        .arg("--exit-on-stdin-eof")
        .env("SANDQ__NAMESPACE", namespace())
        .env("SANDQ__GATEWAY__LISTEN", "127.0.0.1:0")
        .env("SANDQ__GATEWAY__METRICS_LISTEN", "127.0.0.1:0")
        .env("SANDQ__GATEWAY__READ_TIMEOUT", "2s")
        .env("SANDQ__GATEWAY__MAX_BODY_BYTES", (2 << 20).to_string())
        .env("SANDQ__GATEWAY__MAX_STREAMS_PER_KEY", "3")
        .env("SANDQ__GATEWAY__KEEP_ALIVE", "1s")
        .env("SANDQ__GATEWAY__WEBHOOK_BACKOFF", "200ms")
        .env("SANDQ__GATEWAY__WEBHOOK_TIMEOUT", "2s")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(log);
    for (k, v) in env {
        command.env(k, v);
    }
    command.spawn().expect("start sandq-gateway")
}

/// Starts a gateway in the test namespace with extra `SANDQ__GATEWAY__*` settings; returns it
/// and its base URL once it serves. Its log is `<log_name>`.
pub fn start(log_name: &std::path::Path, env: &[(&str, &str)]) -> (Child, String) {
    let child = spawn(log_name, env);
    (child, url_from_log(log_name))
}

/// The base URL a gateway logging to `log_name` serves on, once it says so (at most 60 s).
pub fn url_from_log(log_name: &std::path::Path) -> String {
    address_from_log(log_name, "serving the API")
}

/// The base URL of the operator's listener (`/metrics`) of a gateway logging to `log_name`.
pub fn operator_url_from_log(log_name: &std::path::Path) -> String {
    address_from_log(log_name, "serving the operator's endpoints")
}

fn address_from_log(log_name: &std::path::Path, message: &str) -> String {
    let started = Instant::now();
    loop {
        let text = std::fs::read_to_string(log_name).unwrap_or_default();
        if let Some(addr) = text.lines().find(|l| l.contains(message)).and_then(|l| l.split("addr=").nth(1)) {
            return format!("http://{}", addr.split_whitespace().next().unwrap_or_default());
        }
        assert!(started.elapsed() < Duration::from_secs(60), "the gateway did not start: {text}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A new key for `tenant` with `quotas`, made in the key store directly.
pub async fn new_key(tenant: &str, quotas: Quotas) -> (String, String) {
    let config = service_config();
    let mut redis = sandq_core::redis_conn::connect(&config.redis).await.expect("redis");
    let (record, key) = keys::create(&mut redis, &Names::new(namespace()), tenant, "test", quotas).await.expect("create key");
    (record.id, key)
}

/// A tenant name of its own for each test (tests run in parallel, and tenants' quotas count
/// across the whole namespace).
pub fn tenant(label: &str) -> String {
    format!("{label}{}", &uuid::Uuid::new_v4().simple().to_string()[..8])
}

/// An HTTP client for the tests' requests to a gateway (2 min per request).
pub fn http() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(120)).build().expect("http client")
}

/// `GET <base><path>` with `key`: the status and the JSON body (`null` when it is not JSON).
pub async fn get_json(base: &str, key: &str, path: &str) -> (reqwest::StatusCode, serde_json::Value) {
    let response = http().get(format!("{base}{path}")).bearer_auth(key).send().await.expect("GET");
    let status = response.status();
    (status, response.json().await.unwrap_or(serde_json::Value::Null))
}

/// Waits for job `id` of the gateway at `base` over HTTP (`?wait=`) until it is over, at most
/// 3 minutes; the job as the gateway answers it.
pub async fn wait_job(base: &str, key: &str, id: &str) -> serde_json::Value {
    let started = Instant::now();
    loop {
        let (status, job) = get_json(base, key, &format!("/v1/jobs/{id}?wait=20s")).await;
        assert_eq!(status, reqwest::StatusCode::OK, "{job}");
        let state = job["status"].as_str().unwrap_or_default().to_owned();
        if !["queued", "running"].contains(&state.as_str()) {
            return job;
        }
        assert!(started.elapsed() < Duration::from_secs(180), "job {id} still {state}");
    }
}
