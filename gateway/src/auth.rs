//! Who is calling: the API key from `Authorization: Bearer <key>` (or `X-Api-Key`), checked
//! against the key store on every request ([`sandq_core::keys::authenticate`]), so a revoked
//! key stops working at once. Every refusal is the same 401.

use std::sync::{Arc, Mutex};

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use sandq_core::keys::{self, KeyRecord};

use crate::problem::Problem;
use crate::state::Gateway;

/// What the audit line of a request says beyond its route and status; filled in as the request
/// is handled (never the key's secret).
#[derive(Debug, Default, Clone)]
pub(crate) struct AuditFields {
    /// The key's public id.
    pub(crate) key_id: Option<String>,
    /// Its tenant.
    pub(crate) tenant: Option<String>,
    /// The job the request was about (the client's id, without the tenant).
    pub(crate) job_id: Option<String>,
    /// Why a key was refused (`malformed`, `unknown`, `revoked`, `missing`).
    pub(crate) refused: Option<&'static str>,
}

/// The audit fields of one request, shared by the middleware that logs them and the handlers.
pub(crate) type Audit = Arc<Mutex<AuditFields>>;

/// Sets a field of the request's audit line (a request without one, in a unit test, is fine).
pub(crate) fn note(parts_or_audit: Option<&Audit>, f: impl FnOnce(&mut AuditFields)) {
    if let Some(audit) = parts_or_audit {
        if let Ok(mut fields) = audit.lock() {
            f(&mut fields);
        }
    }
}

/// An authenticated caller: the key's record (tenant, quotas).
#[derive(Debug, Clone)]
pub(crate) struct Caller {
    /// The key, as stored.
    pub(crate) key: KeyRecord,
    /// The request's audit fields.
    pub(crate) audit: Option<Audit>,
}

impl Caller {
    /// The id the queue knows a job (or session) of this tenant by: `<tenant>_<id>`.
    pub(crate) fn scoped(&self, id: &str) -> String {
        format!("{}_{id}", self.key.tenant)
    }

    /// The longest id a client of this tenant may choose (64 with the tenant's prefix).
    pub(crate) fn max_id_len(&self) -> usize {
        64 - self.key.tenant.len() - 1
    }
}

/// The API key a request presents: `Authorization: Bearer <key>`, else `X-Api-Key`.
pub(crate) fn presented(headers: &axum::http::HeaderMap) -> Option<&str> {
    let bearer = headers.get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, token) = v.split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then_some(token.trim())
    });
    bearer.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
}

impl FromRequestParts<Arc<Gateway>> for Caller {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, gateway: &Arc<Gateway>) -> Result<Self, Problem> {
        let audit = parts.extensions.get::<Audit>().cloned();
        let Some(key) = presented(&parts.headers) else {
            note(audit.as_ref(), |a| a.refused = Some("missing"));
            return Err(Problem::unauthorized());
        };
        let mut redis = gateway.redis.clone();
        match keys::authenticate(&mut redis, &gateway.names, key).await {
            Ok(Ok(record)) => {
                note(audit.as_ref(), |a| {
                    a.key_id = Some(record.id.clone());
                    a.tenant = Some(record.tenant.clone());
                });
                Ok(Caller { key: record, audit })
            }
            Ok(Err(refusal)) => {
                note(audit.as_ref(), |a| {
                    a.refused = Some(match refusal {
                        keys::AuthError::Malformed => "malformed",
                        keys::AuthError::Unknown => "unknown",
                        keys::AuthError::Revoked => "revoked",
                    })
                });
                Err(Problem::unauthorized())
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot check an API key");
                Err(Problem::unavailable("cannot check the API key now"))
            }
        }
    }
}
