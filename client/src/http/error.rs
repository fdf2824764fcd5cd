//! The one error of [`super::HttpClient`]: [`HttpError`], a problem the gateway answered (an
//! RFC 9457 document, one variant per `type`, [`Problem`] inside with its slug), or a failure
//! on this side (transport, decoding, a local file, a download's check).

use std::time::Duration;

use serde::Deserialize;

use super::transport::{is_connect, BoxError};
use super::MAX_RETRY_PAUSE;

/// A problem document (RFC 9457) as the gateway sends it (docs/gateway.md "Errors").
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct Problem {
    /// `urn:sandq:problem:<slug>`.
    #[serde(rename = "type", default)]
    pub kind: String,
    /// The type's summary.
    #[serde(default)]
    pub title: String,
    /// The HTTP status.
    #[serde(default)]
    pub status: u16,
    /// What was wrong with this request.
    #[serde(default)]
    pub detail: String,
    /// Seconds to wait before trying again (`Retry-After`), when the gateway says.
    #[serde(default)]
    pub retry_after: Option<u64>,
}

impl Problem {
    /// The type's slug (`not-found`), or the whole type when it is not sandq's.
    pub fn slug(&self) -> &str {
        self.kind.strip_prefix("urn:sandq:problem:").unwrap_or(&self.kind)
    }
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({} {})", self.detail, self.status, self.slug())?;
        match self.retry_after {
            Some(seconds) if self.status == 429 => write!(f, "; retry after {seconds} s"),
            _ => Ok(()),
        }
    }
}

/// Failure of an [`super::HttpClient`] operation: a problem the gateway answered (one variant per
/// `type`), or a failure on this side.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// 401 `unauthorized`: no key, or a malformed, unknown or revoked one.
    #[error("the gateway refused the API key: {0}")]
    Unauthorized(Problem),
    /// 400 `invalid-request`: the request or a value in it is not valid.
    #[error("the gateway refused the request: {0}")]
    InvalidRequest(Problem),
    /// 415 `unsupported-media-type`.
    #[error("the gateway refused the body's type: {0}")]
    UnsupportedMediaType(Problem),
    /// 413 `body-too-large`: over the gateway's `max_body_bytes`, or the key's largest upload.
    #[error("the request is too large for the gateway: {0}")]
    BodyTooLarge(Problem),
    /// 408 `body-timeout`: the body did not arrive in time.
    #[error("the gateway timed out reading the request: {0}")]
    BodyTimeout(Problem),
    /// 403 `forbidden-by-quota`: more than the key may ever do (SKU, timeout, network).
    #[error("the API key may not do this: {0}")]
    ForbiddenByQuota(Problem),
    /// 429 `quota-exceeded`: over a rate or count now; `retry_after` says when to try again.
    #[error("over the API key's quota: {0}")]
    QuotaExceeded(Problem),
    /// 404 `not-found`: no such job (or session, file, artifact) for this key's tenant.
    #[error("not found: {0}")]
    NotFound(Problem),
    /// 409 `conflict`: the id was used with another body, or the job is over, or the session
    /// is in use.
    #[error("conflict: {0}")]
    Conflict(Problem),
    /// 409 `path-conflict`: a session file cannot be written where the session has a
    /// directory of its name, or under one of its files (`data` beside `data/x.csv`); not
    /// worth retrying until that file is deleted.
    #[error("the path clashes with a file of the session: {0}")]
    PathConflict(Problem),
    /// 405 `method-not-allowed`.
    #[error("the gateway does not allow this method here: {0}")]
    MethodNotAllowed(Problem),
    /// 503 `unavailable`, still after the client's tries ([`super::MAX_TRIES`] by default).
    #[error("the gateway is unavailable, still after retries: {0}")]
    Unavailable(Problem),
    /// A problem of a type this client does not know.
    #[error("the gateway answered a problem: {0}")]
    OtherProblem(Problem),
    /// An error status without a problem document (a proxy's page, say).
    #[error("the gateway answered {status}: {body}")]
    Status {
        /// The HTTP status.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// The gateway could not be reached, or the connection failed mid-answer.
    #[error("cannot reach {url}")]
    Transport {
        /// The request's URL, or its path for a transport that has no URL (no key, no query).
        url: String,
        /// The transport's error (reqwest's over HTTP).
        #[source]
        source: BoxError,
    },
    /// An answer that is not the documented JSON.
    #[error("the gateway's answer to {what} is not the documented JSON: {source}")]
    Decode {
        /// What was asked (`GET /v1/jobs/{id}`, or the request's path).
        what: String,
        /// serde's error.
        #[source]
        source: serde_json::Error,
    },
    /// An answer that is JSON but lacks what the API documents, or a request that could not be
    /// made from its parts.
    #[error("the gateway's answer to {what} is not usable: {reason}")]
    Malformed {
        /// What was asked.
        what: String,
        /// What was wrong.
        reason: String,
    },
    /// A body over the limit of what reads it ([`super::MAX_JSON_BYTES`] for JSON, the
    /// caller's for file bytes).
    #[error("{what} is larger than {limit} bytes")]
    TooLarge {
        /// What was read.
        what: String,
        /// The limit, bytes.
        limit: usize,
    },
    /// Storage answered a presigned URL with an error status.
    #[error("storage answered {status} for {url}: {body}")]
    Storage {
        /// The URL without its query (the signature).
        url: String,
        /// The HTTP status.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// The base URL is not an `http` or `https` URL that can have a path.
    #[error("the gateway URL {url:?} is not valid: {reason}")]
    Url {
        /// The URL as given.
        url: String,
        /// Why.
        reason: String,
    },
    /// No API key was given.
    #[error("no API key: the gateway needs one (sq_...)")]
    MissingKey,
    /// The job has a field the HTTP API cannot carry.
    #[error("the gateway cannot take {field}: {reason}")]
    Unsupported {
        /// The JobSpec field.
        field: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// A local file could not be read or written.
    #[error("{path}: {source}")]
    Local {
        /// The local path.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A download did not match the artifact's size or SHA-256.
    #[error("download of {path} does not match its record: {reason}")]
    Mismatch {
        /// The artifact's path.
        path: String,
        /// What differed.
        reason: String,
    },
    /// An artifact path would leave the download folder.
    #[error("artifact path {path:?} is unsafe")]
    UnsafeArtifactPath {
        /// The path.
        path: String,
    },
    /// A stored output representation with no presigned URL (the worker presigns none), which
    /// the gateway has no route for.
    #[error("output file {key} has no URL to download it from")]
    NoUrl {
        /// Its S3 key.
        key: String,
    },
    /// A redirect without a usable `Location`.
    #[error("the gateway's redirect for {path} has no usable Location")]
    BadRedirect {
        /// The artifact's path.
        path: String,
    },
    /// Waiting ended before the job did.
    #[error("job {job_id} did not finish within {}", humantime::format_duration(Duration::from_secs(waited.as_secs())))]
    WaitTimeout {
        /// The job.
        job_id: String,
        /// How long we waited.
        waited: Duration,
    },
}

impl HttpError {
    /// A transport error of a request to `url` (which this error names).
    pub(super) fn transport(url: &str, source: BoxError) -> HttpError {
        HttpError::Transport { url: url.to_owned(), source }
    }

    /// The HTTP status the gateway answered, for a problem document or another error status.
    pub fn status(&self) -> Option<u16> {
        match self {
            HttpError::Status { status, .. } => Some(*status),
            other => other.problem().map(|p| p.status),
        }
    }

    /// The problem's slug (`not-found`; the whole `type` when it is not sandq's), when the
    /// gateway answered a problem document.
    pub fn slug(&self) -> Option<&str> {
        self.problem().map(Problem::slug)
    }

    /// Whether the gateway answered 404 (no such job, session, file or artifact for the tenant).
    pub fn is_not_found(&self) -> bool {
        self.status() == Some(404)
    }

    /// Whether the request itself was wrong (4xx other than 401, 404, 429): the caller should
    /// change its arguments rather than retry.
    pub fn is_bad_request(&self) -> bool {
        self.status().is_some_and(|s| (400..500).contains(&s) && ![401, 404, 429].contains(&s))
    }

    /// The problem document the gateway sent, when the error is one.
    pub fn problem(&self) -> Option<&Problem> {
        match self {
            HttpError::Unauthorized(p)
            | HttpError::InvalidRequest(p)
            | HttpError::UnsupportedMediaType(p)
            | HttpError::BodyTooLarge(p)
            | HttpError::BodyTimeout(p)
            | HttpError::ForbiddenByQuota(p)
            | HttpError::QuotaExceeded(p)
            | HttpError::NotFound(p)
            | HttpError::Conflict(p)
            | HttpError::PathConflict(p)
            | HttpError::MethodNotAllowed(p)
            | HttpError::Unavailable(p)
            | HttpError::OtherProblem(p) => Some(p),
            _ => None,
        }
    }

    /// The error a problem document of `status` stands for, by its `type` (by the status
    /// when the type is not one of sandq's).
    pub fn from_problem(status: u16, mut problem: Problem) -> HttpError {
        if problem.status == 0 {
            problem.status = status;
        }
        let slug = if problem.kind.starts_with("urn:sandq:problem:") { problem.slug().to_owned() } else { String::new() };
        match (slug.as_str(), status) {
            ("unauthorized", _) | ("", 401) => HttpError::Unauthorized(problem),
            ("invalid-request", _) | ("", 400) => HttpError::InvalidRequest(problem),
            ("unsupported-media-type", _) | ("", 415) => HttpError::UnsupportedMediaType(problem),
            ("body-too-large", _) | ("", 413) => HttpError::BodyTooLarge(problem),
            ("body-timeout", _) | ("", 408) => HttpError::BodyTimeout(problem),
            ("forbidden-by-quota", _) | ("", 403) => HttpError::ForbiddenByQuota(problem),
            ("quota-exceeded", _) | ("", 429) => HttpError::QuotaExceeded(problem),
            ("not-found", _) | ("", 404) => HttpError::NotFound(problem),
            ("conflict", _) | ("", 409) => HttpError::Conflict(problem),
            ("path-conflict", _) => HttpError::PathConflict(problem),
            ("method-not-allowed", _) | ("", 405) => HttpError::MethodNotAllowed(problem),
            ("unavailable", _) | ("", 503) => HttpError::Unavailable(problem),
            _ => HttpError::OtherProblem(problem),
        }
    }

    /// The error in the words the MCP tools and the E2B API show their callers (as before the
    /// one client): a refusal as `{title} ({status}): {detail}` (the status line, `404 Not
    /// Found`, when the problem has no title or there is no problem document), a failed
    /// transport as `the sandq gateway could not be reached: {cause}`, anything else as its
    /// [`Display`](std::fmt::Display).
    pub fn summary(&self) -> String {
        let line = |status: u16| http::StatusCode::from_u16(status).map_or_else(|_| status.to_string(), |s| s.to_string());
        match (self.status(), self.problem()) {
            (Some(status), Some(p)) => {
                let title = if p.title.is_empty() { line(status) } else { p.title.clone() };
                format!("{title} ({status}): {}", p.detail)
            }
            (Some(status), None) => format!("{} ({status}): ", line(status)),
            (None, _) => match self {
                HttpError::Transport { source, .. } => format!("the sandq gateway could not be reached: {source}"),
                other => other.to_string(),
            },
        }
    }

    /// How long to pause before trying the request again, when it should be: a 503, or a 409
    /// that carries `Retry-After` (a request with the same id under way; a session's job
    /// running), or no connection.
    pub(super) fn retry_pause(&self) -> Option<Duration> {
        let pause = |p: &Problem| Duration::from_secs(p.retry_after.unwrap_or(1).max(1)).min(MAX_RETRY_PAUSE);
        match self {
            HttpError::Unavailable(p) => Some(pause(p)),
            HttpError::Conflict(p) if p.retry_after.is_some() => Some(pause(p)),
            HttpError::Transport { source, .. } if is_connect(source) => Some(Duration::from_secs(1)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_summary_reads_as_the_mcp_and_e2b_callers_read_it() {
        let p = |title: &str| Problem {
            kind: "urn:sandq:problem:not-found".into(),
            title: title.into(),
            status: 404,
            detail: "no job x".into(),
            retry_after: None,
        };
        assert_eq!(HttpError::from_problem(404, p("Not found")).summary(), "Not found (404): no job x");
        assert_eq!(HttpError::from_problem(404, p("")).summary(), "404 Not Found (404): no job x");
        assert_eq!(HttpError::Status { status: 502, body: "<html>".into() }.summary(), "502 Bad Gateway (502): ");
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
        let transport = HttpError::Transport { url: "/v1/jobs".into(), source: Box::new(refused) };
        assert_eq!(transport.summary(), "the sandq gateway could not be reached: connection refused");
    }

    #[test]
    fn problem_types_map_to_their_variants_and_only_unavailable_or_asked_retries() {
        let problem = |slug: &str, retry_after| Problem {
            kind: format!("urn:sandq:problem:{slug}"),
            title: String::new(),
            status: 0,
            detail: "d".into(),
            retry_after,
        };
        assert!(matches!(HttpError::from_problem(401, problem("unauthorized", None)), HttpError::Unauthorized(p) if p.status == 401));
        assert!(matches!(HttpError::from_problem(403, problem("forbidden-by-quota", None)), HttpError::ForbiddenByQuota(_)));
        assert!(matches!(HttpError::from_problem(429, problem("quota-exceeded", Some(3))), HttpError::QuotaExceeded(_)));
        assert!(matches!(HttpError::from_problem(404, problem("not-found", None)), HttpError::NotFound(_)));
        assert!(matches!(HttpError::from_problem(408, problem("body-timeout", None)), HttpError::BodyTimeout(_)));
        assert!(matches!(HttpError::from_problem(418, problem("teapot", None)), HttpError::OtherProblem(_)));
        let clash = HttpError::from_problem(409, problem("path-conflict", None));
        assert!(matches!(clash, HttpError::PathConflict(_)) && clash.retry_pause().is_none());
        let foreign = Problem { kind: "about:blank".into(), ..problem("x", None) };
        assert!(matches!(HttpError::from_problem(404, foreign), HttpError::NotFound(_)));
        assert_eq!(HttpError::from_problem(503, problem("unavailable", Some(2))).retry_pause(), Some(Duration::from_secs(2)));
        assert_eq!(HttpError::from_problem(503, problem("unavailable", Some(3600))).retry_pause(), Some(MAX_RETRY_PAUSE));
        assert_eq!(HttpError::from_problem(409, problem("conflict", Some(1))).retry_pause(), Some(Duration::from_secs(1)));
        assert_eq!(HttpError::from_problem(409, problem("conflict", None)).retry_pause(), None);
        assert_eq!(HttpError::from_problem(429, problem("quota-exceeded", Some(1))).retry_pause(), None);
        let shown = HttpError::from_problem(401, problem("unauthorized", None)).to_string();
        assert_eq!(shown, "the gateway refused the API key: d (401 unauthorized)");
    }
}
