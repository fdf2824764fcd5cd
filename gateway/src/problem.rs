//! Errors as RFC 9457 problem documents (`application/problem+json`): `type` is a stable URN
//! (`urn:sandq:problem:<slug>`) a client can match on, `title` its summary, `detail` this
//! occurrence. The slugs are listed in docs/gateway.md.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// One problem: an HTTP status, a stable type and what happened.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub(crate) struct Problem {
    /// `urn:sandq:problem:<slug>`.
    #[serde(rename = "type")]
    pub(crate) kind: String,
    /// The type's summary (the same for every occurrence).
    pub(crate) title: &'static str,
    /// The HTTP status, repeated.
    pub(crate) status: u16,
    /// What was wrong with this request.
    pub(crate) detail: String,
    /// Seconds to wait before trying again (429, 503); also sent as `Retry-After`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) retry_after: Option<u64>,
}

impl Problem {
    fn new(status: StatusCode, slug: &str, title: &'static str, detail: impl Into<String>) -> Self {
        Problem { kind: format!("urn:sandq:problem:{slug}"), title, status: status.as_u16(), detail: detail.into(), retry_after: None }
    }

    /// 401 `unauthorized`: no key, or a key that is malformed, unknown or revoked (the same
    /// answer for each, so a caller learns nothing about other keys).
    pub(crate) fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "Missing or invalid API key",
            "send `Authorization: Bearer sq_...` with a valid key",
        )
    }

    /// 404 `not-found`: no such job for this key's tenant (another tenant's ids included).
    pub(crate) fn not_found(what: &str, id: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not-found", "Not found", format!("no {what} {id:?}"))
    }

    /// 400 `invalid-request`: the body is not the documented JSON (syntax, types, unknown
    /// fields) or a field's value is refused by validation.
    pub(crate) fn invalid(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid-request", "The request is not valid", detail)
    }

    /// 403 `origin-not-allowed`: `/mcp` called from a browser origin, or by a `Host`, it does
    /// not serve (cross-origin pages and DNS rebinding; `gateway.mcp_allowed_origins`,
    /// `gateway.mcp_allowed_hosts`).
    pub(crate) fn origin_not_allowed(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "origin-not-allowed", "The request's origin or host is not allowed", detail)
    }

    /// 403 `forbidden-by-quota`: the job asks for more than the key may ever have (SKU,
    /// timeout, network).
    pub(crate) fn forbidden(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden-by-quota", "The key may not do this", detail)
    }

    /// 429 `quota-exceeded`: over a rate or count quota now; try again after `retry_after` s.
    pub(crate) fn too_many(detail: impl Into<String>, retry_after: u64) -> Self {
        Problem {
            retry_after: Some(retry_after.max(1)),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, "quota-exceeded", "Over quota", detail)
        }
    }

    /// 409 `conflict`: the id (or `Idempotency-Key`) names a job submitted with another body,
    /// or the job is already over.
    pub(crate) fn conflict(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", "Conflict with the job's state", detail)
    }

    /// 409 `path-conflict`: the session file would be a file and a directory at once (`data`
    /// beside `data/x.csv`), which no job could restore; the detail names the other file.
    pub(crate) fn path_conflict(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "path-conflict", "The path clashes with a file of the session", detail)
    }

    /// 410 `result-expired`: the job was queued, has ended, and its result is no longer kept
    /// (`result_ttl`); the same id is not run again.
    pub(crate) fn result_expired(id: &str) -> Self {
        Self::new(
            StatusCode::GONE,
            "result-expired",
            "The job's result has expired",
            format!(
                "job {id:?} has ended and its result is no longer kept (result_ttl); it is not run again: submit it under a new job_id"
            ),
        )
    }

    /// 413 `body-too-large`.
    pub(crate) fn too_large(max: usize) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "body-too-large", "The request body is too large", format!("at most {max} bytes"))
    }

    /// 408 `body-timeout`: the body did not arrive in time.
    pub(crate) fn slow_body(limit: std::time::Duration) -> Self {
        Self::new(StatusCode::REQUEST_TIMEOUT, "body-timeout", "The request body was too slow", format!("send the body within {limit:?}"))
    }

    /// 415 `unsupported-media-type`: a body that is not `application/json`.
    pub(crate) fn media_type() -> Self {
        Self::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported-media-type", "Send JSON", "Content-Type must be application/json")
    }

    /// 405 `method-not-allowed`.
    pub(crate) fn method_not_allowed() -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "method-not-allowed", "Method not allowed", "see docs/gateway.md for the routes' methods")
    }

    /// The same problem, asking the client to retry after `seconds` (`Retry-After`).
    pub(crate) fn retry_after(self, seconds: u64) -> Self {
        Problem { retry_after: Some(seconds.max(1)), ..self }
    }

    /// 503 `unavailable`: a service behind the gateway (broker, Redis) failed; nothing was
    /// stored; retry.
    pub(crate) fn unavailable(detail: impl Into<String>) -> Self {
        Problem { retry_after: Some(1), ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "A service is unavailable", detail) }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_vec(&self).unwrap_or_default();
        let mut response = (status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Some(seconds) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if self.status == 401 {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response.extensions_mut().insert(Outcome(self.kind.trim_start_matches("urn:sandq:problem:").to_owned()));
        response
    }
}

/// What the audit line says a request came to (a problem's slug), set on the response.
#[derive(Debug, Clone)]
pub(crate) struct Outcome(pub(crate) String);
