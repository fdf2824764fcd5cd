//! The gateway calling itself: REST requests of the MCP tools ([`crate::mcp`]) and of the
//! E2B layer ([`crate::e2b`]) answered by the gateway's own REST router, in-process (no
//! network hop), so keys, quotas, scoping and audit apply to them as to any client's.

use axum::body::Body;
use axum::Router;
use futures::{StreamExt as _, TryStreamExt as _};
use sandq_client::http::{BoxError, Reply, Transport};
use tower::ServiceExt as _;

/// REST calls of the MCP tools and of [`crate::e2b`], answered by the gateway's own router
/// (no network hop).
pub(crate) struct InProcess {
    api: Router,
}

impl InProcess {
    /// Calls answered by `api`.
    pub(crate) fn new(api: Router) -> Self {
        InProcess { api }
    }
}

/// The client that reads presigned URLs for the in-process REST client: redirects off, 60 s.
pub(crate) fn fetch_client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(std::time::Duration::from_secs(60))
        .build()
        .unwrap_or_default()
}

/// The key of a request's `Authorization: Bearer` (or `X-Api-Key`) header.
pub(crate) fn bearer_of(headers: &axum::http::HeaderMap) -> Option<String> {
    crate::auth::presented(headers).filter(|k| !k.is_empty()).map(str::to_owned)
}

impl Transport for InProcess {
    fn send(&self, request: axum::http::Request<bytes::Bytes>) -> futures::future::BoxFuture<'static, Result<Reply, BoxError>> {
        let api = self.api.clone();
        Box::pin(async move {
            let response = api.oneshot(request.map(Body::from)).await?;
            let (parts, body) = response.into_parts();
            let body = body.into_data_stream().map_err(|e| Box::new(e) as BoxError).boxed();
            Ok(Reply { status: parts.status, headers: parts.headers, body })
        })
    }
}
