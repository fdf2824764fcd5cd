//! `/mcp`: the MCP server ([`sandq_mcp`], docs/mcp.md) over streamable HTTP.
//!
//! A request whose `Origin` or `Host` is not allowed is refused first (403: DNS rebinding and
//! cross-origin pages, [`crate::rebinding`]). The request must carry a valid API key (`Authorization: Bearer`), checked here before any
//! MCP message is read (401 otherwise, with `WWW-Authenticate: Bearer`). The server's tools
//! then call this gateway's own REST routes in-process with that key, so quotas, scoping and
//! audit lines apply as to any REST client. MCP sessions are not kept (stateless mode): each
//! POST stands alone, so any replica serves any request, like the rest of the API.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use sandq_mcp::server::KeySource;

use crate::auth::Caller;
use crate::in_process::{fetch_client, InProcess};
use crate::problem::Problem;
use crate::state::Gateway;

/// The `/mcp` service: the `Origin`/`Host` check, the key check, the body bound, then rmcp's streamable HTTP server whose
/// tools call `api` (the REST routes, with their state).
pub(crate) fn service(gateway: Arc<Gateway>, api: Router) -> Router {
    let fetch = fetch_client();
    let server = sandq_mcp::Sandq::new(Arc::new(InProcess::new(api)), KeySource::Bearer, fetch);
    let mut config = StreamableHttpServerConfig::default();
    config.legacy_session_mode = false;
    config.json_response = true;
    // `Host` and `Origin` are checked before this, by `rebinding::guard` (one rule, a 403
    // problem); rmcp's own check is off.
    config.allowed_hosts = Vec::new();
    let mcp: StreamableHttpService<sandq_mcp::Sandq, LocalSessionManager> =
        StreamableHttpService::new(move || Ok(server.clone()), Default::default(), config);
    Router::new()
        .route_service("/mcp", mcp)
        .layer(axum::middleware::from_fn_with_state(gateway.clone(), admit))
        .layer(axum::middleware::from_fn_with_state(gateway.clone(), crate::rebinding::guard))
        .layer(axum::middleware::from_fn_with_state(gateway.clone(), crate::observe::request))
        .with_state(gateway)
}

/// A valid key, and a body within `max_body_bytes`, or the request goes no further.
async fn admit(State(gateway): State<Arc<Gateway>>, caller: Result<Caller, Problem>, request: Request, next: Next) -> Response {
    let key_id = caller.as_ref().map(|c| c.key.id.clone()).unwrap_or_default();
    if let Err(problem) = caller {
        let mut response = problem.into_response();
        if response.status() == axum::http::StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, axum::http::HeaderValue::from_static("Bearer"));
        }
        return response;
    }
    let too_long = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        .is_some_and(|n| n > gateway.settings.max_body_bytes);
    if too_long {
        return Problem::too_large(gateway.settings.max_body_bytes).into_response();
    }
    // The body is read here, bounded in bytes and time (`read_timeout` between chunks, its
    // deadline in all) as one of the key's bodies under way, so that one that is not JSON gets
    // JSON-RPC's parse error (rmcp answers it with a bare 415).
    let (parts, body) = request.into_parts();
    let bytes = {
        let _permit = match gateway.take_upload(&key_id) {
            Ok(permit) => permit,
            Err(problem) => return problem.into_response(),
        };
        match crate::body::read_to_memory(&gateway, body, gateway.settings.max_body_bytes as u64).await {
            Ok(bytes) => bytes,
            Err(problem) => return problem.into_response(),
        }
    };
    if parts.method == axum::http::Method::POST {
        if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(&bytes) {
            let error =
                serde_json::json!({"jsonrpc": "2.0", "id": null, "error": {"code": -32700, "message": format!("parse error: {e}")}});
            return (axum::http::StatusCode::BAD_REQUEST, axum::Json(error)).into_response();
        }
    }
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}
