//! A hostile tenant with a valid key (issue 36, docs/threat-model.md "A tenant with a valid
//! key"): each finding of the review reproduced through the real gateway and worker with two
//! tenants' keys, and shown to fail. One module per finding group, each test's doc comment names
//! its finding.

use std::process::Child;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use sandq_core::keys::Quotas;
use sandq_tests::ensure_worker;
use sandq_tests::gateway::{self as gw, new_key, tenant};
use serde_json::{json, Value};

#[path = "tenant/bodies.rs"]
mod bodies;
#[path = "tenant/edge.rs"]
mod edge;
#[path = "tenant/fairness.rs"]
mod fairness;
#[path = "tenant/idempotency.rs"]
mod idempotency;
#[path = "tenant/paths.rs"]
mod paths;
#[path = "tenant/sandbox.rs"]
mod sandbox;

/// The gateway of this test binary: started once, in the test namespace, webhooks to loopback
/// allowed (the tests' receivers listen there). Its log is `$TMPDIR/<namespace>-tenant-gateway.log`.
struct Gateway {
    base: String,
    _child: Child,
}

static GATEWAY: OnceLock<Gateway> = OnceLock::new();

fn gateway() -> &'static str {
    &GATEWAY
        .get_or_init(|| {
            ensure_worker();
            let log = std::env::temp_dir().join(format!("{}-tenant-gateway.log", sandq_tests::namespace()));
            let (child, base) = gw::start(&log, &[("SANDQ__GATEWAY__WEBHOOK_ALLOW_PRIVATE", "true")]);
            Gateway { base, _child: child }
        })
        .base
}

fn http() -> reqwest::Client {
    gw::http()
}

/// A key of a tenant of its own (tests run in parallel; quotas count per key and tenant).
async fn key(label: &str, quotas: Quotas) -> String {
    new_key(&tenant(label), quotas).await.1
}

async fn post_job(key: &str, body: &Value) -> (StatusCode, Value) {
    let response = http().post(format!("{}/v1/jobs", gateway())).bearer_auth(key).json(body).send().await.expect("POST");
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
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
