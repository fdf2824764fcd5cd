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

/// The gateway's record of a job it accepted (its marker): `<state>:<digest>` with the body's
/// SHA-256 and one of the states of [`Accepted`].
pub(crate) fn accepted_key(gateway: &Gateway, job_id: &str) -> String {
    format!("{}:gateway", gateway.names.job_key(job_id))
}

/// Where a job id's acceptance stands, as its marker says. It only moves forward:
/// `pending:<digest>` -> `unknown:<digest>` -> `published:<digest>`, each step one `SET`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Accepted {
    /// Claimed; its quotas are being taken (nothing published yet).
    Pending,
    /// Its quotas are taken and its publish is under way, or its outcome was unknown (no
    /// confirm, or the `queued` write failed): the job may or may not be queued. A bare
    /// `<digest>` (an older gateway's marker, written before its publish) means the same.
    Unknown,
    /// Its publish was confirmed and its `queued` record written: the job has a record until
    /// its terminal result expires, so no record means the job ended and its result expired.
    Published,
}

/// Marker prefixes of [`Accepted`]'s states.
pub(crate) const PENDING: &str = "pending:";
/// See [`Accepted::Unknown`].
pub(crate) const UNKNOWN: &str = "unknown:";
/// See [`Accepted::Published`].
pub(crate) const PUBLISHED: &str = "published:";

/// The state a marker's value names.
pub(crate) fn accepted_state(marker: &str) -> Accepted {
    if marker.starts_with(PUBLISHED) {
        Accepted::Published
    } else if marker.starts_with(PENDING) {
        Accepted::Pending
    } else {
        Accepted::Unknown
    }
}

/// The state of `job_id`'s marker; `None` when it has none (not this gateway's, or its
/// idempotency window is over).
///
/// # Errors
/// 503 when Redis fails.
pub(crate) async fn accepted(gateway: &Gateway, job_id: &str) -> Result<Option<Accepted>, Problem> {
    let mut redis = gateway.redis.clone();
    let marker: Option<String> = redis.get(accepted_key(gateway, job_id)).await.map_err(|e| Problem::unavailable(format!("redis: {e}")))?;
    Ok(marker.as_deref().map(accepted_state))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marker_names_its_state_and_a_bare_digest_is_unknown() {
        let digest = "ab".repeat(32);
        assert_eq!(accepted_state(&format!("pending:{digest}")), Accepted::Pending);
        assert_eq!(accepted_state(&format!("unknown:{digest}")), Accepted::Unknown);
        assert_eq!(accepted_state(&format!("published:{digest}")), Accepted::Published);
        assert_eq!(accepted_state(&digest), Accepted::Unknown);
    }
}
