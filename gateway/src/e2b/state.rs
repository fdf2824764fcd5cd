//! What every E2B handler shares: the handlers' state ([`E2b`]: the gateway, the in-process
//! REST client), E2B's keys and error answers, the caller and the sandbox a request names,
//! bounded bodies, the clock. A leaf: it imports no handler and no sandbox record.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use sandq_client::http::{Rest, RestError, Transport};
use serde_json::json;

use crate::auth::Caller;
use crate::state::Gateway;

/// Largest `/execute` or control-plane body.
const MAX_BODY_BYTES: usize = 2 << 20;

/// Now, Unix milliseconds.
pub(super) fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Unix milliseconds as RFC 3339 (UTC, milliseconds), as E2B writes times.
pub(super) fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// The answer that ends a request early (an E2B or Connect error, a 401, a bad body): the error
/// of every helper that checks a request (`Result<_, Refused>`), so that a handler returning
/// `Result<Response, Refused>` says `?` and axum answers with the response inside, as it is.
/// Boxed: a `Response` is large (clippy's `result_large_err` refuses it bare as an error).
pub(super) struct Refused(Box<Response>);

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        *self.0
    }
}

impl From<Response> for Refused {
    fn from(response: Response) -> Self {
        Self(Box::new(response))
    }
}

/// An E2B error answer: `{"code", "message"}` (the SDKs map 401, 404, 429, 502...).
pub(super) fn e2b_error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({"code": status.as_u16(), "message": message.into()}))).into_response()
}

/// The sandq key in an E2B credential: `e2b_<hex of the key's bytes>`, or the key itself.
pub(super) fn sandq_key(presented: &str) -> String {
    presented
        .strip_prefix("e2b_")
        .and_then(|h| hex::decode(h).ok())
        .and_then(|b| String::from_utf8(b).ok())
        .unwrap_or_else(|| presented.to_owned())
}

/// The E2B form of a sandq key (`e2b_` and its hex), for `E2B_API_KEY`.
pub(super) fn e2b_key(key: &str) -> String {
    format!("e2b_{}", hex::encode(key))
}

/// What the E2B handlers share.
pub(super) struct E2b {
    pub(super) gateway: Arc<Gateway>,
    pub(super) transport: Arc<dyn Transport>,
    pub(super) fetch: reqwest::Client,
}

impl E2b {
    pub(super) fn rest(&self, headers: &HeaderMap) -> Option<Rest> {
        let key = crate::in_process::bearer_of(headers)?;
        Some(Rest::with_transport(self.transport.clone(), key, self.fetch.clone()))
    }
}

/// A caller, or E2B's 401.
pub(super) fn caller_or_401(caller: Result<Caller, crate::problem::Problem>) -> Result<Caller, Refused> {
    caller.map_err(|p| {
        let status = p.into_response().status();
        e2b_error(status, if status == StatusCode::UNAUTHORIZED { "invalid API key" } else { "cannot check the API key now" }).into()
    })
}

pub(super) async fn body_json<T: serde::de::DeserializeOwned>(body: Body, within: Duration) -> Result<T, Refused> {
    // Within the gateway's `read_timeout`, as every other body: a slow client holds no slot.
    let bytes = tokio::time::timeout(within, axum::body::to_bytes(body, MAX_BODY_BYTES))
        .await
        .map_err(|_| e2b_error(StatusCode::REQUEST_TIMEOUT, "the body came too slowly"))?
        .map_err(|_| e2b_error(StatusCode::PAYLOAD_TOO_LARGE, format!("the body is over {MAX_BODY_BYTES} bytes")))?;
    let bytes = if bytes.is_empty() { bytes::Bytes::from_static(b"{}") } else { bytes };
    serde_json::from_slice(&bytes).map_err(|e| e2b_error(StatusCode::BAD_REQUEST, format!("invalid body: {e}")).into())
}

/// A REST refusal as E2B's error shape, with its status.
pub(super) fn rest_error(e: RestError) -> Response {
    match e {
        _ if e.status().is_some() => {
            e2b_error(e.status().and_then(|s| StatusCode::from_u16(s).ok()).unwrap_or(StatusCode::BAD_GATEWAY), e.summary())
        }
        other => e2b_error(StatusCode::BAD_GATEWAY, other.summary()),
    }
}

/// The sandbox and port a sandbox-plane request is for: the `E2b-Sandbox-Id` and
/// `E2b-Sandbox-Port` headers, else a Host of `<port>-<id>.<domain>`.
pub(super) fn target(headers: &HeaderMap) -> Option<(u16, String)> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    if let (Some(id), Some(port)) = (header("e2b-sandbox-id"), header("e2b-sandbox-port")) {
        return Some((port.parse().ok()?, id));
    }
    let host = header("host")?;
    let (label, _) = host.split_once('.')?;
    let (port, id) = label.split_once('-')?;
    Some((port.parse().ok()?, id.to_owned()))
}

#[cfg(test)]
mod tests {
    use axum::http::{header, HeaderValue};

    use super::*;

    #[test]
    fn keys_round_trip_through_their_e2b_form() {
        let key = "sq_abc123_DEF.456";
        let e2b = e2b_key(key);
        assert!(e2b.starts_with("e2b_") && e2b[4..].bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(sandq_key(&e2b), key);
        assert_eq!(sandq_key(key), key);
        // Not hex, or not UTF-8: taken as is.
        assert_eq!(sandq_key("e2b_zz"), "e2b_zz");
        assert_eq!(sandq_key("e2b_ff"), "e2b_ff");
    }

    #[test]
    fn sandbox_targets_come_from_headers_or_the_host() {
        let mut h = HeaderMap::new();
        h.insert("e2b-sandbox-id", HeaderValue::from_static("iabc"));
        h.insert("e2b-sandbox-port", HeaderValue::from_static("49999"));
        assert_eq!(target(&h), Some((49999, "iabc".to_owned())));
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("49983-iabc.sandq.example:8443"));
        assert_eq!(target(&h), Some((49983, "iabc".to_owned())));
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("gateway.example"));
        assert_eq!(target(&h), None);
    }
}
