//! The sandbox record (`<ns>:e2b:{<id>}`: tenant, template, end, metadata, env vars, code
//! contexts) and its store: read, the caller's live sandbox, write with its expiry and indexes.

use std::collections::BTreeMap;

use axum::http::{HeaderMap, StatusCode};
use redis::AsyncCommands as _;
use serde::{Deserialize, Serialize};

use super::state::{caller_or_401, e2b_error, now_ms, target, E2b, Refused};
use crate::auth::Caller;
use crate::state::Gateway;

/// A sandbox as the gateway keeps it (`<ns>:e2b:{<id>}`, JSON, expiring at `end_ms`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Record {
    pub(super) id: String,
    pub(super) tenant: String,
    pub(super) template: String,
    pub(super) started_ms: u64,
    pub(super) end_ms: u64,
    #[serde(default)]
    pub(super) metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub(super) envs: BTreeMap<String, String>,
    pub(super) sku: String,
    /// Its code contexts, in creation order (the two defaults first).
    #[serde(default = "default_contexts")]
    pub(super) contexts: Vec<CodeContext>,
}

/// A code context: a notebook state of its own within the sandbox's session (the job's
/// `context`), sharing the session's files.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct CodeContext {
    pub(super) id: String,
    pub(super) language: String,
    pub(super) cwd: String,
    /// The session's state slot (`JobSpec::context`); `None`: the session's default state.
    /// Restarting a context gives it a new slot (an empty state).
    #[serde(default)]
    pub(super) slot: Option<String>,
}

/// The contexts every sandbox starts with: `python` (the session's default state) and
/// `javascript` (Node.js cells keep no variables).
pub(super) fn default_contexts() -> Vec<CodeContext> {
    ["python", "javascript"]
        .into_iter()
        .map(|language| CodeContext { id: language.to_owned(), language: language.to_owned(), cwd: "/home/user".to_owned(), slot: None })
        .collect()
}

pub(super) fn record_key(gateway: &Gateway, id: &str) -> String {
    format!("{}:e2b:{{{id}}}", gateway.names.namespace())
}

pub(super) fn job_key(gateway: &Gateway, id: &str) -> String {
    format!("{}:e2b:{{{id}}}:job", gateway.names.namespace())
}

pub(super) fn tenant_key(gateway: &Gateway, tenant: &str) -> String {
    format!("{}:e2b:tenant:{{{tenant}}}", gateway.names.namespace())
}

/// Sandboxes by end time, for [`reap`]: members `<tenant>/<id>`.
pub(super) fn due_key(gateway: &Gateway) -> String {
    format!("{}:e2b:due", gateway.names.namespace())
}

impl E2b {
    pub(super) async fn record(&self, id: &str) -> Option<Record> {
        self.lookup(id).await.ok().flatten()
    }

    /// The record of `id`: `Ok(None)` when there is none (killed, expired, never made), `Err`
    /// when Redis did not answer (a running cell must not be cancelled for that).
    pub(super) async fn lookup(&self, id: &str) -> redis::RedisResult<Option<Record>> {
        let mut redis = self.gateway.redis.clone();
        let raw: Option<String> = redis.get(record_key(&self.gateway, id)).await?;
        Ok(raw.and_then(|r| serde_json::from_str(&r).ok()))
    }

    /// The caller's live sandbox `id`: 404 (E2B's "not found") for one that is gone, unknown or
    /// another tenant's.
    pub(super) async fn owned(&self, caller: &Caller, id: &str) -> Result<Record, Refused> {
        match self.record(id).await {
            Some(r) if r.tenant == caller.key.tenant && r.end_ms > now_ms() => Ok(r),
            _ => Err(e2b_error(StatusCode::NOT_FOUND, format!("sandbox {id} not found")).into()),
        }
    }

    /// Writes `record`, expiring at its end, and indexes it. An update (`create` false) writes
    /// only over a record that still exists (`SET XX`): a sandbox killed meanwhile stays gone.
    /// False when it was gone. Two updates at once may lose one's change (the record is read,
    /// changed and written whole; a client's calls on one sandbox come one at a time).
    pub(super) async fn store(&self, record: &Record, create: bool) -> redis::RedisResult<bool> {
        let mut redis = self.gateway.redis.clone();
        let now = now_ms();
        let ttl = record.end_ms.saturating_sub(now).max(1);
        let json = serde_json::to_string(record).unwrap_or_default();
        let mut set = redis::cmd("SET");
        set.arg(record_key(&self.gateway, &record.id)).arg(json).arg("PX").arg(ttl).arg(if create { "NX" } else { "XX" });
        let written: Option<String> = set.query_async(&mut redis).await?;
        if written.is_none() {
            return Ok(false);
        }
        let tenant = tenant_key(&self.gateway, &record.tenant);
        let () = redis.zadd(&tenant, &record.id, record.end_ms).await?;
        let () = redis.zrembyscore(&tenant, 0, now).await?;
        let () = redis.zadd(due_key(&self.gateway), format!("{}/{}", record.tenant, record.id), record.end_ms).await?;
        Ok(true)
    }

    /// [`Self::store`] for a handler: 404 when the sandbox is gone, 503 when Redis failed.
    pub(super) async fn update(&self, record: &Record) -> Result<(), Refused> {
        match self.store(record, false).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(e2b_error(StatusCode::NOT_FOUND, format!("sandbox {} not found", record.id)).into()),
            Err(_) => Err(e2b_error(StatusCode::SERVICE_UNAVAILABLE, "cannot store the sandbox now").into()),
        }
    }
}

/// The caller's live sandbox of a sandbox-plane request (502, as E2B's proxy answers for a
/// sandbox that is gone, otherwise).
pub(super) async fn plane_sandbox(
    e2b: &E2b,
    caller: Result<Caller, crate::problem::Problem>,
    headers: &HeaderMap,
) -> Result<Record, Refused> {
    plane_caller(e2b, caller, headers).await.map(|(_, record)| record)
}

/// [`plane_sandbox`], with the caller.
pub(super) async fn plane_caller(
    e2b: &E2b,
    caller: Result<Caller, crate::problem::Problem>,
    headers: &HeaderMap,
) -> Result<(Caller, Record), Refused> {
    let caller = caller_or_401(caller)?;
    let Some((_, id)) = target(headers) else { return Err(e2b_error(StatusCode::NOT_FOUND, "no sandbox named").into()) };
    match e2b.owned(&caller, &id).await {
        Ok(record) => Ok((caller, record)),
        Err(_) => Err(e2b_error(StatusCode::BAD_GATEWAY, format!("sandbox {id} is not running")).into()),
    }
}
