//! How a request reaches the gateway: the [`Transport`] trait, which the client's typed calls
//! go through, and [`HttpTransport`], its implementation over HTTP (reqwest). The gateway has
//! another, its own router called in-process (`gateway/src/mcp.rs`), for the MCP tools and the
//! E2B API.

use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{StreamExt as _, TryStreamExt as _};
use http::{HeaderMap, Request, StatusCode};

/// Any error of a transport or a body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A body as it arrives (or leaves), chunk by chunk.
pub type BodyStream = BoxStream<'static, Result<Bytes, BoxError>>;

/// An HTTP answer of the gateway: its head, with its body still streaming.
pub struct Reply {
    /// Its status.
    pub status: StatusCode,
    /// Its headers.
    pub headers: HeaderMap,
    /// Its body, streamed.
    pub body: BodyStream,
}

/// The longest one request may take, its answer's body included, as an extension of the
/// request ([`http::Request::extensions`]). [`HttpTransport`] applies it; a transport with no
/// network to wait for (the gateway's in-process one) may ignore it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestTimeout(pub Duration);

/// Carries REST requests to a gateway. A request's URI is a path and query (`/v1/jobs/x`);
/// the transport knows where the gateway is.
pub trait Transport: Send + Sync + 'static {
    /// Sends one request and returns the answer's head with its body still streaming.
    fn send(&self, request: Request<Bytes>) -> BoxFuture<'static, Result<Reply, BoxError>>;

    /// Sends one request whose body streams (a local file's upload). This default reads the
    /// whole body into memory first and calls [`Transport::send`]; [`HttpTransport`] streams it.
    fn send_streaming(&self, request: Request<BodyStream>) -> BoxFuture<'_, Result<Reply, BoxError>> {
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let chunks: Vec<Bytes> = body.try_collect().await?;
            self.send(Request::from_parts(parts, Bytes::from(chunks.concat()))).await
        })
    }
}

/// [`Transport`] over HTTP to a gateway at a base URL (`https://sandq.example.com`, or with a
/// path prefix).
#[derive(Clone)]
pub struct HttpTransport {
    base: String,
    http: reqwest::Client,
}

impl std::fmt::Debug for HttpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpTransport").field("base", &self.base).finish_non_exhaustive()
    }
}

impl HttpTransport {
    /// A transport to the gateway at `base` (no trailing `/` needed), with `http` (its own
    /// time-outs; redirects must not be followed: artifact and file reads are redirects to
    /// presigned URLs that the client follows itself, once, without the key).
    pub fn new(base: &str, http: reqwest::Client) -> Self {
        HttpTransport { base: base.trim_end_matches('/').to_owned(), http }
    }

    /// Sends `parts` with `body`, within the request's [`RequestTimeout`] when it has one.
    fn call(&self, parts: http::request::Parts, body: reqwest::Body) -> BoxFuture<'static, Result<Reply, BoxError>> {
        let url = format!("{}{}", self.base, parts.uri.path_and_query().map_or("/", |p| p.as_str()));
        let mut call = self.http.request(parts.method, url).headers(parts.headers).body(body);
        if let Some(RequestTimeout(timeout)) = parts.extensions.get::<RequestTimeout>() {
            call = call.timeout(*timeout);
        }
        Box::pin(async move {
            // The URL is the caller's to name (with no query: a presigned one's is a secret).
            let response = call.send().await.map_err(|e| Box::new(e.without_url()) as BoxError)?;
            let status = response.status();
            let headers = response.headers().clone();
            let body = response.bytes_stream().map_err(|e| Box::new(e.without_url()) as BoxError).boxed();
            Ok(Reply { status, headers, body })
        })
    }
}

impl Transport for HttpTransport {
    fn send(&self, request: Request<Bytes>) -> BoxFuture<'static, Result<Reply, BoxError>> {
        let (parts, body) = request.into_parts();
        self.call(parts, reqwest::Body::from(body))
    }

    fn send_streaming(&self, request: Request<BodyStream>) -> BoxFuture<'_, Result<Reply, BoxError>> {
        let (parts, body) = request.into_parts();
        self.call(parts, reqwest::Body::wrap_stream(body))
    }
}

/// Whether `error` (a transport's) is a connection that could not be made: worth trying again.
pub(super) fn is_connect(error: &BoxError) -> bool {
    error.downcast_ref::<reqwest::Error>().is_some_and(reqwest::Error::is_connect)
}
