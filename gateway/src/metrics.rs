//! The gateway's Prometheus metrics, served at `/metrics` (OpenMetrics text): requests by
//! route, method and status class, and their latency. No job id or key in any label.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Labels of a request.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RequestLabels {
    /// The matched route (`/v1/jobs/{id}`), or `unmatched`.
    pub(crate) route: String,
    /// `GET`, `POST`...
    pub(crate) method: String,
    /// `2xx`, `4xx`, `5xx`...
    pub(crate) status: String,
}

/// Labels of a request's latency.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RouteLabels {
    /// The matched route.
    pub(crate) route: String,
}

/// The metrics of one gateway process.
pub(crate) struct Metrics {
    registry: Registry,
    /// `sandq_gateway_requests_total`.
    pub(crate) requests: Family<RequestLabels, Counter>,
    /// `sandq_gateway_request_seconds`: until the response's head is sent (an event stream's
    /// body is not counted).
    pub(crate) latency: Family<RouteLabels, Histogram>,
}

impl Metrics {
    /// A registry with the gateway's metrics.
    pub(crate) fn new() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register("sandq_gateway_requests", "HTTP requests handled, by route, method and status class", requests.clone());
        let latency = Family::<RouteLabels, Histogram>::new_with_constructor(|| {
            Histogram::new([0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 60.0])
        });
        registry.register("sandq_gateway_request_seconds", "Time to the response's head", latency.clone());
        Metrics { registry, requests, latency }
    }

    /// The OpenMetrics text.
    pub(crate) fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
