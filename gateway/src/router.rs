//! The routes: the REST API (`/v1`, with the health endpoints) behind the observation layer,
//! then `/mcp` and the E2B routes, which call the REST routes in-process; and, on a listener of
//! its own, the operator's (`/metrics`).
//! Nothing imports this module but the crate's root: handlers never reach the router.

use std::sync::Arc;

use axum::http::header;
use axum::routing::get;
use axum::Router;

use crate::problem::Problem;
use crate::state::Gateway;
use crate::{e2b, files, jobs, mcp, observe, openapi, sessions};

/// The API's routes, with the metrics and audit layer, and `/mcp` (the MCP server, whose tools
/// call the other routes in-process: [`mcp`]) and the E2B routes ([`e2b`], likewise).
pub fn router(gateway: Arc<Gateway>) -> Router {
    let api = rest(gateway.clone());
    api.clone().merge(mcp::service(gateway.clone(), api.clone())).merge(e2b::service(gateway, api))
}

/// The operator's routes, served on `gateway.metrics_listen` only: `/metrics` (request counts
/// and latency by route, of every tenant together, hence not on the API's listener),
/// `/healthz`, `/readyz`. No key: whoever reaches this listener is the operator.
pub fn operator_router(gateway: Arc<Gateway>) -> Router {
    Router::new()
        .route("/metrics", get(observe::metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(observe::ready))
        .fallback(|| async { Problem::not_found("route", "") })
        .with_state(gateway)
}

/// The REST routes, with the metrics and audit layer.
fn rest(gateway: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/jobs", axum::routing::post(jobs::submit))
        .route("/v1/jobs/{id}", get(jobs::get).delete(jobs::cancel))
        .route("/v1/jobs/{id}/events", get(jobs::events))
        .route("/v1/jobs/{id}/artifacts/{*path}", get(files::artifact))
        .route("/v1/jobs/{id}/outputs/{name}", get(files::output))
        .route("/v1/jobs/{id}/logs/{stream}", get(files::log))
        .route("/v1/files", axum::routing::post(files::upload))
        .route("/v1/sessions", get(sessions::list).post(sessions::create))
        .route("/v1/sessions/{name}", axum::routing::delete(sessions::delete))
        .route("/v1/sessions/{name}/files", get(sessions::files))
        .route("/v1/sessions/{name}/files/{*path}", get(sessions::read).put(sessions::write).delete(sessions::remove))
        .route("/v1/openapi.json", get(|| async { ([(header::CONTENT_TYPE, "application/json")], openapi::json()) }))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(observe::ready))
        .fallback(|| async { Problem::not_found("route", "") })
        .method_not_allowed_fallback(|| async { Problem::method_not_allowed() })
        .layer(axum::middleware::from_fn_with_state(gateway.clone(), observe::request))
        .with_state(gateway)
}
