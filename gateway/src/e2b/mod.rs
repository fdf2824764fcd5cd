//! E2B compatibility (docs/e2b.md): E2B's own SDKs (`e2b-code-interpreter`, `@e2b/code-interpreter`)
//! run code on sandq by pointing `E2B_API_URL` and `E2B_SANDBOX_URL` at the gateway.
//!
//! - **Control plane** (`/sandboxes`, `/v2/sandboxes`): an E2B sandbox is a sandq session of the
//!   key's tenant, named by the sandbox id, with a record in Redis (`<ns>:e2b:{<id>}`: tenant,
//!   template, end time, metadata, env vars) whose expiry is the sandbox's end. The gateway owns
//!   that lifetime: a sandbox past its end is gone (its record expires), and [`reap`] deletes
//!   its session.
//! - **Sandbox plane**, on the same origin, routed by the `E2b-Sandbox-Id` and `E2b-Sandbox-Port`
//!   headers the SDKs send on every request (or a Host of `<port>-<id>.<domain>`): the code
//!   interpreter's `POST /execute` (port 49999) runs one notebook job in the session and streams
//!   E2B's NDJSON from the job's live events; envd's `GET /health` (port 49983) is 204 while
//!   the sandbox lives and 502 after.
//!
//! Keys: E2B's SDKs (before 2.46) require `E2B_API_KEY` to match `e2b_[0-9a-f]+`, so a sandq key
//! is given as `e2b_` and the hex of its bytes; the raw key is accepted too. The sandbox's
//! access tokens are that same key (the SDK sends them on the sandbox plane, which carries no
//! API key): whoever holds a sandbox's token holds the key that made it (docs/threat-model.md).
//! Every call then goes through the gateway's own REST routes in-process with that key, so
//! quotas, scoping and audit apply as to any REST client.
//!
//! One file per verb (this one holds the routes): `sandboxes` (create, info, list, timeout,
//! connect, kill, health), `contexts`, `execute` (with its NDJSON in `ndjson`, pure), `envd`
//! (files), `process` (commands), `reaper`; what they share is `state` (the handlers' state,
//! keys, errors, the request's target) and `record` (the sandbox record and its store), which
//! import no handler.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{delete, get, post};
use axum::Router;
use sandq_client::http::Transport;

use crate::state::Gateway;

mod contexts;
mod envd;
mod execute;
mod ndjson;
mod process;
mod reaper;
mod record;
mod sandboxes;
mod state;

pub use reaper::reap;

/// The E2B routes: the control plane and the sandbox plane, each request's E2B credential
/// turned into the `Authorization` the REST routes read, `api` answering in-process.
pub(crate) fn service(gateway: Arc<Gateway>, api: Router) -> Router {
    let transport: Arc<dyn Transport> = Arc::new(crate::in_process::InProcess::new(api));
    let state = Arc::new(state::E2b { gateway: gateway.clone(), transport, fetch: crate::in_process::fetch_client() });
    Router::new()
        .route("/sandboxes", post(sandboxes::create).get(sandboxes::list))
        .route("/v2/sandboxes", post(sandboxes::create).get(sandboxes::list))
        .route("/sandboxes/{id}", get(sandboxes::info).delete(sandboxes::kill))
        .route("/sandboxes/{id}/timeout", post(sandboxes::set_timeout))
        .route("/sandboxes/{id}/connect", post(sandboxes::connect))
        .route("/v2/sandboxes/{id}/connect", post(sandboxes::connect))
        .route("/execute", post(execute::execute))
        .route("/health", get(sandboxes::health))
        .route("/contexts", get(contexts::contexts).post(contexts::create_context))
        .route("/contexts/{id}", delete(contexts::delete_context))
        .route("/contexts/{id}/restart", post(contexts::restart_context))
        // The files' own bound (the key's `max_upload_bytes`) applies, not axum's 2 MiB default.
        .route("/files", get(envd::read).post(envd::write).layer(axum::extract::DefaultBodyLimit::disable()))
        .route("/filesystem.Filesystem/ListDir", post(envd::list_dir))
        .route("/filesystem.Filesystem/Stat", post(envd::stat))
        .route("/filesystem.Filesystem/Remove", post(envd::remove))
        .route("/filesystem.Filesystem/{call}", post(envd::unimplemented))
        .route("/process.Process/Start", post(process::start))
        .route("/process.Process/SendSignal", post(process::send_signal))
        .route("/process.Process/{call}", post(envd::unimplemented))
        .layer(axum::Extension(state))
        .layer(axum::middleware::from_fn(credential))
        .layer(axum::middleware::from_fn_with_state(gateway.clone(), crate::observe::request))
        .with_state(gateway)
}

/// Moves the E2B credential of a request (`X-API-Key`, `X-Access-Token`, or
/// `E2B-Traffic-Access-Token`, in the `e2b_<hex>` form or not) into `Authorization: Bearer`.
async fn credential(mut request: Request, next: Next) -> Response {
    let headers = request.headers();
    let presented = ["x-api-key", "x-access-token", "e2b-traffic-access-token"]
        .iter()
        .find_map(|name| headers.get(*name).and_then(|v| v.to_str().ok()).filter(|v| !v.is_empty()))
        .map(state::sandq_key);
    if let Some(value) = presented.and_then(|key| HeaderValue::from_str(&format!("Bearer {key}")).ok()) {
        request.headers_mut().insert(header::AUTHORIZATION, value);
        request.headers_mut().remove("x-api-key");
    }
    next.run(request).await
}
