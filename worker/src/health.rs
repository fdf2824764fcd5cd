//! The worker's HTTP endpoints, on `worker.metrics_addr`:
//!
//! - `/metrics`: [`crate::metrics`] in the OpenMetrics text format (Prometheus scrapes it);
//! - `/healthz` (liveness): 200 whenever the process and its tokio runtime answer;
//! - `/readyz` (readiness): 200 when the worker consumes from the broker, Redis and the bucket
//!   answer, capacity is configured and it is not shutting down; else 503 with one reason per
//!   line.
//!
//! The broker's state is pushed by [`crate::consume`] ([`set_broker`]); Redis and S3 are asked
//! on each `/readyz` (each within [`CHECK_TIMEOUT`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::context::Context;

/// Longest a readiness check of Redis or S3 may take.
pub(crate) const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest one connection may stay open (a scrape, a probe).
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);

/// The broker connection the consumers use, while they consume.
static BROKER: Mutex<Option<lapin::ConnectionStatus>> = Mutex::new(None);

/// Records the broker connection the worker consumes on (`Some` once every consumer is set
/// up), or that it consumes on none (`None`: connecting, or the connection was lost).
pub(crate) fn set_broker(status: Option<lapin::ConnectionStatus>) {
    if let Ok(mut broker) = BROKER.lock() {
        *broker = status;
    }
}

fn broker_reason() -> Option<String> {
    let broker = BROKER.lock().ok()?;
    match &*broker {
        None => Some("broker: not consuming (connecting, or the connection was lost)".into()),
        Some(status) if !status.connected() => Some("broker: connection lost".into()),
        Some(_) => None,
    }
}

/// Binds `addr`.
///
/// # Errors
/// The bind error (address in use, bad address).
pub(crate) async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves the endpoints on `listener` until the process ends.
pub(crate) async fn serve(listener: TcpListener, ctx: Context, shutdown: watch::Receiver<bool>) {
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, "serving /metrics, /healthz and /readyz");
    }
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                warn!(error = %e, "cannot accept a metrics connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let ctx = ctx.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let ctx = ctx.clone();
                let shutdown = shutdown.clone();
                async move { Ok::<_, Infallible>(respond(&ctx, &shutdown, &request).await) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(5))
                .serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(CONNECTION_TIMEOUT, connection).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => debug!(error = %e, "metrics connection failed"),
                Err(_) => debug!("metrics connection timed out"),
            }
        });
    }
}

fn text(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = hyper::header::HeaderValue::from_str(content_type) {
        response.headers_mut().insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}

const PLAIN: &str = "text/plain; charset=utf-8";

async fn respond(ctx: &Context, shutdown: &watch::Receiver<bool>, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, PLAIN, "GET only\n".into());
    }
    match request.uri().path() {
        "/metrics" => text(StatusCode::OK, "application/openmetrics-text; version=1.0.0; charset=utf-8", crate::metrics::METRICS.encode()),
        "/healthz" => text(StatusCode::OK, PLAIN, "ok\n".into()),
        "/readyz" => {
            let reasons = not_ready(ctx, shutdown).await;
            if reasons.is_empty() {
                text(StatusCode::OK, PLAIN, "ready\n".into())
            } else {
                text(StatusCode::SERVICE_UNAVAILABLE, PLAIN, format!("not ready\n{}\n", reasons.join("\n")))
            }
        }
        _ => text(StatusCode::NOT_FOUND, PLAIN, "not found: /metrics, /healthz, /readyz\n".into()),
    }
}

/// Why the worker is not ready to take jobs; empty when it is.
pub(crate) async fn not_ready(ctx: &Context, shutdown: &watch::Receiver<bool>) -> Vec<String> {
    let mut reasons = Vec::new();
    if *shutdown.borrow() {
        reasons.push("shutting down".to_owned());
    }
    reasons.extend(broker_reason());
    let settings = &ctx.settings;
    if settings.skus.is_empty() || settings.capacity_cpus <= 0.0 || settings.capacity_memory_bytes == 0 {
        reasons.push("capacity: no SKU served".to_owned());
    }
    let redis = async {
        let mut redis = ctx.redis.clone();
        let ping = redis::cmd("PING");
        let ping = ping.query_async::<String>(&mut redis);
        match tokio::time::timeout(CHECK_TIMEOUT, ping).await {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(format!("redis: {e}")),
            Err(_) => Some(format!("redis: no answer within {CHECK_TIMEOUT:?}")),
        }
    };
    let s3 = async {
        let head = ctx.s3.head_bucket().bucket(&settings.services.s3.bucket).send();
        match tokio::time::timeout(CHECK_TIMEOUT, head).await {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(format!("s3: bucket {}: {}", settings.services.s3.bucket, aws_sdk_s3::error::DisplayErrorContext(&e))),
            Err(_) => Some(format!("s3: bucket {}: no answer within {CHECK_TIMEOUT:?}", settings.services.s3.bucket)),
        }
    };
    let (redis, s3) = tokio::join!(redis, s3);
    reasons.extend(redis);
    reasons.extend(s3);
    reasons
}
