//! `/mcp`'s `Origin` and `Host` checks: the MCP spec's transport security warning (Streamable
//! HTTP: servers MUST validate the `Origin` header to prevent DNS rebinding, and a local server
//! should bind to localhost). A browser page of another site cannot call `/mcp` (a request
//! carrying an `Origin` not in `gateway.mcp_allowed_origins` is refused), and a page that
//! rebinds its own name to a loopback gateway is refused by its `Host`.
//!
//! The rule ([`decide`], a pure function):
//! - `Origin` absent (every non-browser MCP client): passes. Present: it must equal, once
//!   normalized (lower case, the scheme's default port dropped), an entry of
//!   `mcp_allowed_origins`; `null` only if that list says `null`. Default: the list is empty, so
//!   no browser origin may call `/mcp`; the gateway serves no page of its own, so there is no
//!   same origin to allow.
//! - `Host`: when `mcp_allowed_hosts` is set, one of its entries (`host` names any port,
//!   `host:port` that port only); otherwise, when the API listens on a loopback address,
//!   `localhost`, `127.0.0.1` or `[::1]` with the listener's port; otherwise any (a network
//!   gateway is reached by whatever names its operator gives it, and every `/mcp` request
//!   needs an API key, which a rebinding page does not have).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::problem::Problem;
use crate::state::Gateway;

/// What the check compares with: the settings, and where the API listens.
pub(crate) struct Rules<'a> {
    /// `gateway.mcp_allowed_hosts`.
    pub(crate) allowed_hosts: &'a [String],
    /// `gateway.mcp_allowed_origins`.
    pub(crate) allowed_origins: &'a [String],
    /// The API's bound address.
    pub(crate) listen: SocketAddr,
}

/// Why a request is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The `Origin` header names an origin not allowed (or cannot be read).
    #[error("Origin {0:?} may not call /mcp (gateway.mcp_allowed_origins)")]
    Origin(String),
    /// The `Host` header names a host this gateway does not serve `/mcp` to (or is missing).
    #[error("Host {0:?} is not one /mcp answers to (gateway.mcp_allowed_hosts; a loopback gateway answers only to localhost, 127.0.0.1 or [::1] with its port)")]
    Host(String),
}

/// `host[:port]` split, the host lower case and without brackets; `None` when unreadable.
fn authority(value: &str) -> Option<(String, Option<u16>)> {
    let authority = value.trim().parse::<axum::http::uri::Authority>().ok()?;
    if authority.as_str().contains('@') {
        return None;
    }
    let host = authority.host().trim_start_matches('[').trim_end_matches(']').to_ascii_lowercase();
    (!host.is_empty()).then_some((host, authority.port_u16()))
}

/// Two hosts are the same name, or the same IP address however written.
fn same_host(a: &str, b: &str) -> bool {
    match (a.parse::<IpAddr>(), b.parse::<IpAddr>()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// An origin normalized: `scheme://host[:port]`, lower case, without the scheme's default port
/// (RFC 6454 §6.2); `null` as is; `None` when unreadable.
fn origin(value: &str) -> Option<String> {
    let value = value.trim();
    if value.eq_ignore_ascii_case("null") {
        return Some("null".to_owned());
    }
    let uri = value.parse::<axum::http::Uri>().ok()?;
    let scheme = uri.scheme_str()?.to_ascii_lowercase();
    if uri.path_and_query().is_some_and(|p| p.as_str() != "/" && !p.as_str().is_empty()) {
        return None;
    }
    let (host, port) = authority(uri.authority()?.as_str())?;
    let default = match scheme.as_str() {
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    };
    let host = match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(ip)) => format!("[{ip}]"),
        Ok(IpAddr::V4(ip)) => ip.to_string(),
        Err(_) => host,
    };
    Some(match port.filter(|p| Some(*p) != default) {
        Some(port) => format!("{scheme}://{host}:{port}"),
        None => format!("{scheme}://{host}"),
    })
}

/// Whether a request with these `Host` and `Origin` headers may reach `/mcp`.
///
/// # Errors
/// [`Refusal::Origin`], [`Refusal::Host`].
pub(crate) fn decide(host: Option<&str>, origin_header: Option<&str>, rules: &Rules<'_>) -> Result<(), Refusal> {
    if let Some(value) = origin_header {
        let allowed = origin(value).is_some_and(|o| rules.allowed_origins.iter().filter_map(|a| origin(a)).any(|a| a == o));
        if !allowed {
            return Err(Refusal::Origin(value.to_owned()));
        }
    }
    let refused = || Refusal::Host(host.unwrap_or_default().to_owned());
    if rules.allowed_hosts.is_empty() && !rules.listen.ip().is_loopback() {
        return Ok(());
    }
    let (name, port) = host.and_then(authority).ok_or_else(refused)?;
    let allowed = if rules.allowed_hosts.is_empty() {
        // A loopback gateway: the names of loopback, with the port it listens on (a request
        // without a port in `Host` is for port 80).
        ["localhost", "127.0.0.1", "::1"].iter().any(|n| same_host(n, &name)) && port.unwrap_or(80) == rules.listen.port()
    } else {
        rules
            .allowed_hosts
            .iter()
            .filter_map(|a| authority(a))
            .any(|(a_host, a_port)| same_host(&a_host, &name) && a_port.is_none_or(|p| Some(p) == port))
    };
    if allowed {
        Ok(())
    } else {
        Err(refused())
    }
}

/// The middleware: [`decide`] on the request's headers; a refusal is a 403
/// `origin-not-allowed` problem, logged.
pub(crate) async fn guard(State(gateway): State<Arc<Gateway>>, request: Request, next: Next) -> Response {
    let decided = {
        let header = |name| request.headers().get(name).map(|v| v.to_str().unwrap_or("\u{fffd}"));
        let rules = Rules {
            allowed_hosts: &gateway.settings.mcp_allowed_hosts,
            allowed_origins: &gateway.settings.mcp_allowed_origins,
            listen: gateway.settings.listen,
        };
        decide(header(header::HOST), header(header::ORIGIN), &rules)
    };
    if let Err(refusal) = decided {
        tracing::warn!(error = %refusal, "/mcp refused: origin or host not allowed (DNS rebinding or a cross-origin page?)");
        return Problem::origin_not_allowed(refusal.to_string()).into_response();
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules<'a>(hosts: &'a [String], origins: &'a [String], listen: &str) -> Rules<'a> {
        Rules { allowed_hosts: hosts, allowed_origins: origins, listen: listen.parse().expect("listen") }
    }

    #[test]
    fn a_loopback_gateway_answers_only_to_loopback_names_with_its_port() {
        let r = rules(&[], &[], "127.0.0.1:8080");
        for ok in ["127.0.0.1:8080", "localhost:8080", "LOCALHOST:8080", "[::1]:8080"] {
            assert_eq!(decide(Some(ok), None, &r), Ok(()), "{ok}");
        }
        for bad in ["evil.example:8080", "127.0.0.1:8081", "localhost", "attacker.test", "127.0.0.1.nip.io:8080", "", "a@b:8080"] {
            assert!(matches!(decide(Some(bad), None, &r), Err(Refusal::Host(_))), "{bad}");
        }
        assert!(decide(None, None, &r).is_err());
        // On port 80 a Host without a port is right.
        assert_eq!(decide(Some("localhost"), None, &rules(&[], &[], "[::1]:80")), Ok(()));
    }

    #[test]
    fn a_network_gateway_answers_to_any_host_unless_told_which() {
        assert_eq!(decide(Some("sandq.example.com"), None, &rules(&[], &[], "0.0.0.0:8080")), Ok(()));
        let hosts = vec!["sandq.example.com".to_owned(), "10.0.0.5:8080".to_owned()];
        let r = rules(&hosts, &[], "0.0.0.0:8080");
        for ok in ["sandq.example.com", "SANDQ.example.com:443", "10.0.0.5:8080"] {
            assert_eq!(decide(Some(ok), None, &r), Ok(()), "{ok}");
        }
        for bad in ["other.example.com", "10.0.0.5:9090", "10.0.0.5"] {
            assert!(decide(Some(bad), None, &r).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_listed_origins_pass_and_no_origin_passes() {
        let none: Vec<String> = Vec::new();
        let r = rules(&none, &none, "0.0.0.0:8080");
        assert_eq!(decide(Some("h"), None, &r), Ok(()));
        for origin in ["https://evil.example", "null", "http://localhost:8080", "not a url"] {
            assert!(matches!(decide(Some("h"), Some(origin), &r), Err(Refusal::Origin(_))), "{origin}");
        }
        let origins = vec!["https://app.example.com".to_owned(), "http://[::1]:3000".to_owned()];
        let r = rules(&none, &origins, "0.0.0.0:8080");
        for ok in ["https://app.example.com", "HTTPS://APP.example.com:443", "http://[0:0::1]:3000"] {
            assert_eq!(decide(Some("h"), Some(ok), &r), Ok(()), "{ok}");
        }
        for bad in ["http://app.example.com", "https://app.example.com:8443", "https://app.example.com.evil", "null", "http://[::1]:3001"] {
            assert!(decide(Some("h"), Some(bad), &r).is_err(), "{bad}");
        }
    }
}
