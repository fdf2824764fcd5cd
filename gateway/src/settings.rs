//! `[gateway]` of the config file (and `SANDQ__GATEWAY__*`): where the gateway listens and
//! how it bounds requests. The services it talks to are the shared `[amqp]`, `[redis]` and
//! `[s3]` sections ([`sandq_core::config::ServiceConfig`]).

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

/// The gateway's own settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewaySettings {
    /// Address of the API; default `0.0.0.0:8080`.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Largest request body, bytes; default 10 MiB (a job's code is at most 1 MiB and its
    /// stdin 8 MiB, `sandq_schemas::Limits`). Larger: 413.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// Longest time to receive a request's headers, and then its body (humantime); default
    /// `10s`. A slower client (slowloris) is cut off: 408 for a body, the connection closed
    /// for headers.
    #[serde(default = "default_read_timeout", with = "humantime_serde")]
    pub read_timeout: Duration,
    /// Longest time to receive one request body, whole (humantime); default `60s`. A body
    /// that declares its length (`Content-Length`) is given `body_timeout` plus the time its
    /// length takes at `min_body_bytes_per_s`, so a large upload on a fair link is not cut
    /// off. A body not received in time is answered 408 and its connection closed: a body fed a
    /// byte at a time cannot hold one of the `max_requests` slots for longer (issue 36, finding
    /// 3). `read_timeout` still bounds each pause between a body's chunks.
    #[serde(default = "default_body_timeout", with = "humantime_serde")]
    pub body_timeout: Duration,
    /// The slowest upload rate a declared body length earns time at (bytes per second);
    /// default 1 MiB/s (a 100 MiB upload: `body_timeout` + 100 s). 0 counts as 1.
    #[serde(default = "default_min_body_rate")]
    pub min_body_bytes_per_s: u64,
    /// Request bodies one key may be sending at once (uploads, and any body the gateway reads:
    /// a job's JSON, `/mcp`, E2B file writes); default 8. An upload counts until it is stored.
    /// Over it: 429. With `body_timeout`, this bounds the request slots and the disk (uploads
    /// are spooled to temporary files, `max_upload_bytes` each) one key can hold.
    #[serde(default = "default_max_uploads_per_key")]
    pub max_uploads_per_key: usize,
    /// Bytes of uploads this gateway holds in temporary files at once, all keys together;
    /// default 1 GiB. An upload that would pass it is refused (503, `Retry-After`) and its
    /// file removed, so that tenants together cannot fill the disk under `TMPDIR` (in
    /// Kubernetes an emptyDir whose overflow evicts the pod: keep this below its `sizeLimit`).
    #[serde(default = "default_max_spooled_bytes")]
    pub max_spooled_bytes: u64,
    /// How often an open event stream or long wait checks that its key is still valid
    /// (humantime); default `5s`. A revoked key's streams and waits end at the next check.
    #[serde(default = "default_revocation_check", with = "humantime_serde")]
    pub revocation_check: Duration,
    /// Longest `?wait=` of `GET /v1/jobs/{id}` (humantime); default `60s`. Longer asks are cut
    /// to it (the response is the job as it is then).
    #[serde(default = "default_max_wait", with = "humantime_serde")]
    pub max_wait: Duration,
    /// Broker connections that publish jobs (each publishes one job at a time, waiting for the
    /// broker's confirm); default 4.
    #[serde(default = "default_publishers")]
    pub publishers: usize,
    /// Event streams and long waits (`?wait=`) open at once on this gateway; default 2000.
    /// Each holds a Redis connection (an event stream's `XREAD BLOCK`); over it: 503.
    #[serde(default = "default_max_streams")]
    pub max_streams: usize,
    /// ... of one key; default 100. Over it: 429.
    #[serde(default = "default_max_streams_per_key")]
    pub max_streams_per_key: usize,
    /// Longest life of one event stream (humantime); default `2h`: then it ends, and the
    /// client resumes with `Last-Event-ID`.
    #[serde(default = "default_max_stream_life", with = "humantime_serde")]
    pub max_stream_life: Duration,
    /// Requests handled at once; default 1024. Over it: 503 at once (an event stream counts
    /// only until its head is sent).
    #[serde(default = "default_max_requests")]
    pub max_requests: usize,
    /// How long an uploaded file can be named by the tenant's jobs (humantime); default `7d`.
    #[serde(default = "default_file_ttl", with = "humantime_serde")]
    pub file_ttl: Duration,
    /// Whether webhooks may go to loopback, private, link-local and other non-public
    /// addresses; default false (an operator's receivers inside the network need it).
    #[serde(default)]
    pub webhook_allow_private: bool,
    /// How long after a job ended its webhook is retried (humantime); default `24h`.
    #[serde(default = "default_webhook_retry_for", with = "humantime_serde")]
    pub webhook_retry_for: Duration,
    /// Time-out of one webhook attempt (humantime); default `10s`.
    #[serde(default = "default_webhook_timeout", with = "humantime_serde")]
    pub webhook_timeout: Duration,
    /// Pause after the first failed attempt, doubling after each (at most 10 min); default `1s`.
    #[serde(default = "default_webhook_backoff", with = "humantime_serde")]
    pub webhook_backoff: Duration,
    /// Interval of SSE comments on an idle event stream (keeps proxies from closing it);
    /// default `15s`.
    #[serde(default = "default_keep_alive", with = "humantime_serde")]
    pub keep_alive: Duration,
    // --- Operator endpoints and `/mcp`'s origin checks (issue 36, findings 9 and 11). ---
    /// Address of the operator's listener, which alone serves `/metrics` (and `/healthz`,
    /// `/readyz`); default `127.0.0.1:9465`, loopback: the API's listener answers 404 for
    /// `/metrics`, since request counts by route are the operator's to see, not a tenant's.
    #[serde(default = "default_metrics_listen")]
    pub metrics_listen: SocketAddr,
    /// Host names (`host` or `host:port`; an entry without a port names any) that `/mcp`
    /// answers to (its `Host` header); over others: 403. Default empty: when the API listens
    /// on a loopback address, `localhost`, `127.0.0.1` or `[::1]` with the listener's port
    /// (DNS rebinding, the MCP spec's transport security warning); otherwise any (every `/mcp`
    /// request also needs an API key, which a rebinding page does not have).
    #[serde(default)]
    pub mcp_allowed_hosts: Vec<String>,
    /// Browser origins (`scheme://host[:port]`, as the `Origin` header writes them; `null` for
    /// an opaque origin) allowed to call `/mcp`; a request with any other `Origin` gets 403.
    /// Default empty: no browser page may call it (a request without `Origin`, as every
    /// non-browser MCP client sends, passes). The MCP spec: servers MUST validate `Origin`.
    #[serde(default)]
    pub mcp_allowed_origins: Vec<String>,
}

fn default_metrics_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9465))
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 8080))
}
fn default_max_body() -> usize {
    10 << 20
}
fn default_read_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_body_timeout() -> Duration {
    Duration::from_secs(60)
}
fn default_min_body_rate() -> u64 {
    1 << 20
}
fn default_max_uploads_per_key() -> usize {
    8
}
fn default_max_spooled_bytes() -> u64 {
    1 << 30
}
fn default_revocation_check() -> Duration {
    Duration::from_secs(5)
}
fn default_max_wait() -> Duration {
    Duration::from_secs(60)
}
fn default_publishers() -> usize {
    4
}
fn default_max_streams() -> usize {
    2000
}
fn default_max_streams_per_key() -> usize {
    100
}
fn default_max_stream_life() -> Duration {
    Duration::from_secs(2 * 3600)
}
fn default_max_requests() -> usize {
    1024
}
fn default_file_ttl() -> Duration {
    Duration::from_secs(7 * 24 * 3600)
}
fn default_webhook_retry_for() -> Duration {
    Duration::from_secs(24 * 3600)
}
fn default_webhook_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_webhook_backoff() -> Duration {
    Duration::from_secs(1)
}
fn default_keep_alive() -> Duration {
    Duration::from_secs(15)
}

impl Default for GatewaySettings {
    fn default() -> Self {
        GatewaySettings {
            listen: default_listen(),
            max_body_bytes: default_max_body(),
            read_timeout: default_read_timeout(),
            body_timeout: default_body_timeout(),
            min_body_bytes_per_s: default_min_body_rate(),
            max_uploads_per_key: default_max_uploads_per_key(),
            max_spooled_bytes: default_max_spooled_bytes(),
            revocation_check: default_revocation_check(),
            max_wait: default_max_wait(),
            publishers: default_publishers(),
            max_streams: default_max_streams(),
            max_streams_per_key: default_max_streams_per_key(),
            max_stream_life: default_max_stream_life(),
            max_requests: default_max_requests(),
            file_ttl: default_file_ttl(),
            webhook_allow_private: false,
            webhook_retry_for: default_webhook_retry_for(),
            webhook_timeout: default_webhook_timeout(),
            webhook_backoff: default_webhook_backoff(),
            keep_alive: default_keep_alive(),
            metrics_listen: default_metrics_listen(),
            mcp_allowed_hosts: Vec::new(),
            mcp_allowed_origins: Vec::new(),
        }
    }
}

/// The config file as the gateway reads it: `[gateway]` (other sections are the services' or
/// the worker's).
#[derive(Debug, Deserialize)]
struct File {
    #[serde(default)]
    gateway: GatewaySettings,
}

/// Reads `[gateway]` from the config file at `path` and the environment.
///
/// # Errors
/// The config crate's (a value of the wrong type, an unknown key in `[gateway]`).
pub fn load(path: &Path) -> Result<GatewaySettings, Box<sandq_core::config::ConfigError>> {
    let file: File = sandq_core::config::load(path).map_err(Box::new)?;
    let mut settings = file.gateway;
    settings.publishers = settings.publishers.clamp(1, 64);
    settings.max_streams = settings.max_streams.max(1);
    settings.max_requests = settings.max_requests.max(1);
    settings.min_body_bytes_per_s = settings.min_body_bytes_per_s.max(1);
    settings.revocation_check = settings.revocation_check.max(Duration::from_millis(100));
    Ok(settings)
}
