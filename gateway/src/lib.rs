//! `sandq-gateway`: the HTTP front door. Tenants call a versioned JSON API (`/v1`) with an API
//! key; the gateway checks the key and its quotas, scopes every id to the key's tenant, and is
//! otherwise one more client of the queue: it publishes jobs with the Rust client, reads
//! results and live events from Redis. It keeps no state of its own (any number of replicas).
//!
//! A request's path: [`serve`] (connection limits: header time-out) -> [`observe`] (metrics,
//! one audit line) -> [`auth::Caller`] (the key) -> the handler in [`jobs`] (body bounds,
//! decoding, quotas, the queue) -> a [`problem::Problem`] or the answer.

pub mod auth;
pub mod jobs;
pub mod metrics;
pub mod problem;
pub mod quota;
pub mod settings;

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
    /// For connections of their own (`BLPOP`, `XREAD BLOCK`).
    pub redis_target: RedisTarget,
    publishers: Vec<tokio::sync::Mutex<Client>>,
    next: AtomicUsize,
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
        Ok(Arc::new(Gateway {
            settings,
            service,
            names,
            redis,
            redis_target,
            publishers,
            next: AtomicUsize::new(0),
            metrics: Metrics::new(),
        }))
    }

    /// Publishes a job with a free publisher (else the next in turn), with confirms, and writes
    /// its `queued` status ([`Client::submit`]).
    ///
    /// # Errors
    /// [`Client::submit`]'s.
    pub async fn publish(&self, spec: &JobSpec) -> Result<(), ClientError> {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let n = self.publishers.len();
        let free = (0..n).find_map(|k| self.publishers[(start + k) % n].try_lock().ok());
        let mut client = match free {
            Some(client) => client,
            None => self.publishers[start % n].lock().await,
        };
        client.submit(spec).await
    }
}

/// The API's routes, with the metrics and audit layer.
pub fn router(gateway: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/jobs", axum::routing::post(jobs::submit))
        .route("/v1/jobs/{id}", get(jobs::get).delete(jobs::cancel))
        .route("/v1/jobs/{id}/events", get(jobs::events))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics_text))
        .fallback(|| async { Problem::not_found("route", "") })
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

/// Counts the request, times it, and writes its audit line (target `audit`): method, route,
/// status, key id, tenant, job id, outcome; never the key.
async fn observe(State(gateway): State<Arc<Gateway>>, mut request: Request, next: Next) -> Response {
    let started = Instant::now();
    let route = request.extensions().get::<MatchedPath>().map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let method = request.method().to_string();
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
