//! `sandq-gateway`: the HTTP front door. Tenants call a versioned JSON API (`/v1`) with an API
//! key; the gateway checks the key and its quotas, scopes every id to the key's tenant, and is
//! otherwise one more client of the queue: it publishes jobs with the Rust client, reads
//! results and live events from Redis. It keeps no state of its own (any number of replicas).
//!
//! A request's path: [`serve`] (connection limits: header time-out) -> [`observe`] (metrics,
//! one audit line) -> [`auth::Caller`] (the key) -> the handler in [`jobs`] (body bounds,
//! decoding, quotas, the queue) -> a [`problem::Problem`] or the answer.

pub mod auth;
pub mod body;
pub mod e2b;
pub mod files;
pub mod jobs;
pub mod mcp;
pub mod metrics;
pub mod openapi;
pub mod problem;
pub mod quota;
pub mod scope;
pub mod sessions;
pub mod settings;
pub mod webhooks;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use sandq_client::{Client, ClientError};
use sandq_core::config::ServiceConfig;
use sandq_core::redis_conn::{RedisConn, RedisTarget};
use sandq_schemas::names::Names;
use sandq_schemas::JobSpec;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::auth::{Audit, AuditFields};
use crate::metrics::{Metrics, RequestLabels, RouteLabels};
use crate::problem::{Outcome, Problem};
use crate::settings::GatewaySettings;

/// What every request shares.
pub struct Gateway {
    /// `[gateway]`.
    pub settings: GatewaySettings,
    /// The services.
    pub service: ServiceConfig,
    /// The deployment's names.
    pub names: Names,
    /// Shared, multiplexed (never for blocking commands).
    pub redis: RedisConn,
    /// For connections of their own (`XREAD BLOCK`).
    pub redis_target: RedisTarget,
    /// S3 (uploads, artifacts' URLs).
    pub s3: aws_sdk_s3::Client,
    publishers: Vec<tokio::sync::Mutex<Client>>,
    next: AtomicUsize,
    /// Event streams and long waits open on this gateway (`max_streams`).
    streams: Arc<tokio::sync::Semaphore>,
    /// ... and per key (`max_streams_per_key`).
    streams_per_key: Mutex<std::collections::HashMap<String, usize>>,
    /// Requests being handled (`max_requests`).
    requests: Arc<tokio::sync::Semaphore>,
    /// The metrics.
    pub metrics: Metrics,
}

/// Failure to start the gateway.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A service could not be reached.
    #[error(transparent)]
    Connect(#[from] ClientError),
    /// Redis could not be reached.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

impl Gateway {
    /// Connects `settings.publishers` clients (each declares the topology) and Redis.
    ///
    /// # Errors
    /// [`StartError`] when a service cannot be reached.
    pub async fn connect(service: ServiceConfig, settings: GatewaySettings) -> Result<Arc<Self>, StartError> {
        let names = Names::new(service.namespace.clone());
        let redis_target = RedisTarget::from_config(&service.redis)?;
        let redis = redis_target.connect().await?;
        let mut publishers = Vec::with_capacity(settings.publishers);
        for _ in 0..settings.publishers.max(1) {
            publishers.push(tokio::sync::Mutex::new(Client::connect(service.clone()).await?));
        }
        let s3 = sandq_core::storage::client(&service.s3);
        let streams = Arc::new(tokio::sync::Semaphore::new(settings.max_streams));
        let requests = Arc::new(tokio::sync::Semaphore::new(settings.max_requests));
        Ok(Arc::new(Gateway {
            settings,
            service,
            names,
            redis,
            redis_target,
            s3,
            publishers,
            next: AtomicUsize::new(0),
            streams,
            streams_per_key: Mutex::new(Default::default()),
            requests,
            metrics: Metrics::new(),
        }))
    }

    /// Publishes a job with a free publisher (else the next in turn, waiting at most `wait`),
    /// with confirms, and writes its `queued` status ([`Client::submit`]).
    ///
    /// # Errors
    /// `None` when no publisher was free within `wait` (nothing was published);
    /// [`Client::submit`]'s.
    pub async fn publish(&self, spec: &JobSpec, wait: Duration) -> Result<(), Option<ClientError>> {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let n = self.publishers.len();
        let free = (0..n).find_map(|k| self.publishers[(start + k) % n].try_lock().ok());
        let mut client = match free {
            Some(client) => client,
            None => tokio::time::timeout(wait, self.publishers[start % n].lock()).await.map_err(|_| None)?,
        };
        client.submit(spec).await.map_err(Some)
    }

    /// Takes one of the gateway's and the key's event streams (or long waits), if any is left.
    ///
    /// # Errors
    /// 503 when the gateway has `max_streams` open; 429 when the key has `max_streams_per_key`.
    pub fn take_stream(self: &Arc<Self>, key_id: &str) -> Result<StreamPermit, Problem> {
        let global = self
            .streams
            .clone()
            .try_acquire_owned()
            .map_err(|_| Problem::unavailable("too many open event streams on this gateway").retry_after(5))?;
        let mut per_key = self.streams_per_key.lock().map_err(|_| Problem::unavailable("internal state"))?;
        let open = per_key.entry(key_id.to_owned()).or_insert(0);
        if *open >= self.settings.max_streams_per_key {
            return Err(Problem::too_many(
                format!("at most {} open event streams and waits for this key", self.settings.max_streams_per_key),
                5,
            ));
        }
        *open += 1;
        Ok(StreamPermit { gateway: self.clone(), key_id: key_id.to_owned(), _global: global })
    }
}

/// One open event stream or long wait; given back when dropped.
pub struct StreamPermit {
    gateway: Arc<Gateway>,
    key_id: String,
    _global: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        if let Ok(mut per_key) = self.gateway.streams_per_key.lock() {
            if let Some(open) = per_key.get_mut(&self.key_id) {
                *open = open.saturating_sub(1);
                if *open == 0 {
                    per_key.remove(&self.key_id);
                }
            }
        }
    }
}

/// The API's routes, with the metrics and audit layer, and `/mcp` (the MCP server, whose tools
/// call the other routes in-process: [`mcp`]).
pub fn router(gateway: Arc<Gateway>) -> Router {
    let api = rest(gateway.clone());
    api.clone().merge(mcp::service(gateway.clone(), api.clone())).merge(e2b::service(gateway, api))
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
        .route("/v1/sessions/{name}/files/{*path}", get(sessions::read).put(sessions::write))
        .route("/v1/openapi.json", get(|| async { ([(header::CONTENT_TYPE, "application/json")], openapi::json()) }))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics_text))
        .fallback(|| async { Problem::not_found("route", "") })
        .method_not_allowed_fallback(|| async { Problem::method_not_allowed() })
        .layer(axum::middleware::from_fn_with_state(gateway.clone(), observe))
        .with_state(gateway)
}

async fn metrics_text(State(gateway): State<Arc<Gateway>>) -> Response {
    let mut response = gateway.metrics.encode().into_response();
    if let Ok(value) = "application/openmetrics-text; version=1.0.0; charset=utf-8".parse() {
        response.headers_mut().insert(header::CONTENT_TYPE, value);
    }
    response
}

/// `/readyz`: 200 when Redis answers a `PING` within a second, else 503.
async fn ready(State(gateway): State<Arc<Gateway>>) -> Response {
    let mut redis = gateway.redis.clone();
    let ping = tokio::time::timeout(Duration::from_secs(1), redis::cmd("PING").query_async::<String>(&mut redis)).await;
    match ping {
        Ok(Ok(_)) => "ready\n".into_response(),
        _ => (StatusCode::SERVICE_UNAVAILABLE, "not ready: redis\n").into_response(),
    }
}

/// Bounds the requests under way, counts the request, times it, and writes its audit line (target `audit`): method, route,
/// status, key id, tenant, job id, outcome; never the key.
pub(crate) async fn observe(State(gateway): State<Arc<Gateway>>, mut request: Request, next: Next) -> Response {
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

/// Serves `router` on `listener` until `shutdown` turns true, then lets requests under way
/// finish (at most `grace`). Each connection's headers must arrive within `read_timeout`
/// (hyper's `header_read_timeout`), so slow headers cannot hold connections open.
pub async fn serve(listener: TcpListener, router: Router, read_timeout: Duration, mut shutdown: watch::Receiver<bool>, grace: Duration) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = shutdown.wait_for(|stop| *stop) => break,
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(read_timeout)
            .serve_connection(TokioIo::new(stream), service);
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
        tracing::warn!("requests still under way at the end of the grace period were cut off");
    }
}
