//! Which jobs are a tenant's: its job `<id>` is the queue's `<tenant>_<id>`, and the gateway
//! serves it only if it recorded accepting it (`<ns>:job:{<tenant>_<id>}:gateway`).

use redis::AsyncCommands as _;
use sandq_schemas::JobResult;
use serde_json::Value;

use crate::auth::{note, Caller};
use crate::problem::Problem;
use crate::state::Gateway;

/// The queue's job id of a tenant's id, after checking the id's shape and length.
pub(crate) fn job_id_of(caller: &Caller, id: &str) -> Result<String, Problem> {
    let ok = !id.is_empty() && id.len() <= caller.max_id_len() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(caller.scoped(id))
    } else {
        Err(Problem::invalid(format!("job_id {id:?} is not 1 to {} of [A-Za-z0-9_-]", caller.max_id_len())))
    }
}

/// The gateway's record of a job it accepted.
pub(crate) fn accepted_key(gateway: &Gateway, job_id: &str) -> String {
    format!("{}:gateway", gateway.names.job_key(job_id))
}

/// Checks that the gateway accepted `id` for this tenant; returns the queue's job id.
pub(crate) async fn owned(gateway: &Gateway, caller: &Caller, id: &str) -> Result<String, Problem> {
    note(caller.audit.as_ref(), |a| a.job_id = Some(id.to_owned()));
    let job_id = job_id_of(caller, id).map_err(|_| Problem::not_found("job", id))?;
    let mut redis = gateway.redis.clone();
    let known: bool = redis.exists(accepted_key(gateway, &job_id)).await.map_err(|e| Problem::unavailable(format!("redis: {e}")))?;
    if known {
        Ok(job_id)
    } else {
        Err(Problem::not_found("job", id))
    }
}

/// A job's result as `tenant` sees it: the JobResult's JSON with the tenant's ids (its job
/// id and session name without the `<tenant>_` prefix).
pub(crate) fn view_for_tenant(tenant: &str, result: &JobResult) -> Value {
    let mut value = serde_json::to_value(result).unwrap_or(Value::Null);
    let prefix = format!("{tenant}_");
    if let Some(object) = value.as_object_mut() {
        if let Some(id) = result.job_id.strip_prefix(&prefix) {
            object.insert("job_id".into(), Value::String(id.to_owned()));
        }
        if let Some(session) = object.get_mut("session").and_then(Value::as_object_mut) {
            if let Some(name) = session.get("name").and_then(Value::as_str).and_then(|n| n.strip_prefix(&prefix)).map(str::to_owned) {
                session.insert("name".into(), Value::String(name));
            }
        }
    }
    value
}
