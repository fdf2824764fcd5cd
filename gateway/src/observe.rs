//! Observation: the layer every request passes first (the bound on requests under way, the
//! metrics, one audit line), and the endpoints that report on the gateway (`/metrics`,
//! `/readyz`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::auth::{Audit, AuditFields};
use crate::metrics::{RequestLabels, RouteLabels};
use crate::problem::{Outcome, Problem};
use crate::state::Gateway;

/// Bounds the requests under way (and each one's body in time: [`crate::body::deadline`]), counts the request, times it, and writes its audit line
/// (target `audit`): method, route, status, key id, tenant, job id, outcome; never the key.
pub(crate) async fn request(State(gateway): State<Arc<Gateway>>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let route = request.extensions().get::<MatchedPath>().map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    // Only the methods the API knows become labels (any other is `other`): an unauthenticated
    // client cannot grow the metrics.
    let method = match request.method().as_str() {
        m @ ("GET" | "POST" | "DELETE" | "HEAD" | "PUT" | "PATCH" | "OPTIONS") => m.to_owned(),
        _ => "other".to_owned(),
    };
    // Requests beyond `max_requests` at once are refused at once (503), before any work.
    let Ok(_permit) = gateway.requests.clone().try_acquire_owned() else {
        gateway.metrics.requests.get_or_create(&RequestLabels { route, method, status: "5xx".into() }).inc();
        return Problem::unavailable("the gateway is busy").retry_after(1).into_response();
    };
    // Every body has an overall deadline, whoever reads it: a request slot is held by a slow
    // body for at most that long (issue 36, finding 3).
    let within = crate::body::deadline(&gateway.settings, crate::body::declared(request.headers()));
    let mut request = request.map(|body| crate::body::with_deadline(body, within));
    let audit: Audit = Arc::new(Mutex::new(AuditFields::default()));
    request.extensions_mut().insert(audit.clone());
    let response = next.run(request).await;
    let status = response.status();
    let seconds = started.elapsed().as_secs_f64();
    let class = format!("{}xx", status.as_u16() / 100);
    gateway.metrics.requests.get_or_create(&RequestLabels { route: route.clone(), method: method.clone(), status: class }).inc();
    gateway.metrics.latency.get_or_create(&RouteLabels { route: route.clone() }).observe(seconds);
    if route != "/metrics" && route != "/healthz" && route != "/readyz" {
        let fields = audit.lock().map(|f| f.clone()).unwrap_or_default();
        let outcome = response.extensions().get::<Outcome>().map_or("ok", |o| o.0.as_str());
        tracing::info!(
            target: "audit",
            method,
            route,
            status = status.as_u16(),
            key_id = fields.key_id.as_deref().unwrap_or(""),
            tenant = fields.tenant.as_deref().unwrap_or(""),
            job_id = fields.job_id.as_deref().unwrap_or(""),
            refused = fields.refused.unwrap_or(""),
            outcome,
            ms = (seconds * 1000.0) as u64,
            "request"
        );
    }
    response
}

/// `/metrics`: the OpenMetrics text.
pub(crate) async fn metrics_text(State(gateway): State<Arc<Gateway>>) -> Response {
    let mut response = gateway.metrics.encode().into_response();
    if let Ok(value) = "application/openmetrics-text; version=1.0.0; charset=utf-8".parse() {
        response.headers_mut().insert(header::CONTENT_TYPE, value);
    }
    response
}

/// `/readyz`: 200 when Redis answers a `PING` within a second, else 503.
pub(crate) async fn ready(State(gateway): State<Arc<Gateway>>) -> Response {
    let mut redis = gateway.redis.clone();
    let ping = tokio::time::timeout(Duration::from_secs(1), redis::cmd("PING").query_async::<String>(&mut redis)).await;
    match ping {
        Ok(Ok(_)) => "ready\n".into_response(),
        _ => (StatusCode::SERVICE_UNAVAILABLE, "not ready: redis\n").into_response(),
    }
}
