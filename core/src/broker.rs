//! Connecting to RabbitMQ when it is a cluster: [`connect`] tries the configured addresses
//! (`amqp.urls`, else `amqp.url`) from a given one on, round-robin, each within
//! [`CONNECT_TIMEOUT`], and says which one answered, so that after a failure the caller can
//! start from the next (docs/protocol.md, "Several broker addresses").
//!
//! Any node of a cluster serves every queue: a connection to one node reaches the quorum queues
//! whose leader is on another, so a client or worker needs one live node, not a particular one.

use std::sync::Arc;
use std::time::Duration;

use lapin::{Connection, ConnectionProperties, ErrorKind};

/// Longest wait for one address to complete the AMQP handshake before the next is tried: a
/// node that accepts TCP but does not answer (overloaded, partitioned) must not stall the
/// failover. 10 s is a choice, not a measured bound: a live node on loopback answers in
/// milliseconds (docs/benchmarks.md), and 10 s leaves room for a slow network while staying well
/// under RabbitMQ's default 60 s heartbeat timeout.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// `url` with any password replaced by `***`, for logs (`amqp://guest:***@127.0.0.1:5672/%2f`).
pub fn redact(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else { return url.to_owned() };
    let authority_end = url[scheme_end..].find('/').map_or(url.len(), |i| scheme_end + i);
    let Some(at) = url[scheme_end..authority_end].rfind('@').map(|i| scheme_end + i) else { return url.to_owned() };
    match url[scheme_end..at].find(':') {
        Some(colon) => format!("{}***{}", &url[..=scheme_end + colon], &url[at..]),
        None => url.to_owned(),
    }
}

/// Connects to the first of `addresses` that answers, trying them in order from index
/// `start` (modulo their count) and wrapping around, each at most once and each within
/// [`CONNECT_TIMEOUT`]. Returns the connection and the index of the address it went to.
/// `properties` are cloned for each attempt (a connection name, say).
///
/// # Errors
/// The last address's error when none answers (a handshake that timed out is an
/// [`ErrorKind::IOError`] of kind `TimedOut`); an `IOError` of kind `InvalidInput` when
/// `addresses` is empty.
pub async fn connect(addresses: &[String], start: usize, properties: &ConnectionProperties) -> Result<(Connection, usize), lapin::Error> {
    let io = |kind, message: String| lapin::Error::from(ErrorKind::IOError(Arc::new(std::io::Error::new(kind, message))));
    let mut last = io(std::io::ErrorKind::InvalidInput, "no AMQP address configured (amqp.url, amqp.urls)".to_owned());
    for offset in 0..addresses.len() {
        let index = (start + offset) % addresses.len();
        let address = &addresses[index];
        match tokio::time::timeout(CONNECT_TIMEOUT, Connection::connect(address, properties.clone())).await {
            Ok(Ok(connection)) => return Ok((connection, index)),
            Ok(Err(e)) => {
                tracing::warn!(address = %redact(address), error = %e, "cannot connect to this broker address");
                last = e;
            }
            Err(_) => {
                tracing::warn!(address = %redact(address), "broker address did not answer within {CONNECT_TIMEOUT:?}");
                last = io(std::io::ErrorKind::TimedOut, format!("{} did not answer within {CONNECT_TIMEOUT:?}", redact(address)));
            }
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact("amqp://guest:secret@10.0.0.1:5672/%2f"), "amqp://guest:***@10.0.0.1:5672/%2f");
        assert_eq!(redact("amqp://u:p%40ss@h/v"), "amqp://u:***@h/v");
        assert_eq!(redact("amqp://user@host:5672"), "amqp://user@host:5672");
        assert_eq!(redact("amqp://host:5672/%2f"), "amqp://host:5672/%2f");
        assert_eq!(redact("not a url"), "not a url");
    }
}
