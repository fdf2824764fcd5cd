//! Steps 7 and 8 (collect, conclude): build a [`JobResult`] ([`build`], pure) and write it to
//! Redis ([`publish`]: compare-and-set, a terminal result is never overwritten; see
//! `sandq_core::results`).

mod build;
mod redact;

use std::time::Duration;

pub(crate) use build::{base, finished, Attempt, Logs};
pub(crate) use redact::HostPaths;
use sandq_core::redis_conn::RedisConn;
use sandq_core::results::{self, ResultError};
use sandq_schemas::names::Names;
use sandq_schemas::JobResult;

/// How long the presigned URLs of `job`'s result stay valid: `worker.artifact_url_ttl`, but
/// never longer than the job's `result_ttl` (a URL outliving the result that lists it is a
/// capability nobody can see any more, and one the client did not ask to keep). Zero: none.
#[must_use]
pub(crate) fn url_ttl(configured: Duration, result_ttl: Duration) -> Duration {
    configured.min(result_ttl)
}

/// Fills in a presigned GET URL valid for `ttl` on every artifact and every S3-stored output
/// representation (nothing when `ttl` is zero). Signing is local; a failure leaves `url` empty
/// and is logged.
pub(crate) async fn presign(result: &mut JobResult, s3: &aws_sdk_s3::Client, bucket: &str, ttl: Duration) {
    if ttl.is_zero() {
        return;
    }
    let expires_at_ms = sandq_core::time::now_ms() + ttl.as_millis() as u64;
    let from_outputs = result.outputs.iter_mut().flat_map(|o| o.data.values_mut()).filter_map(|v| v.artifact.as_mut());
    for artifact in result.artifacts.iter_mut().chain(from_outputs) {
        match sandq_core::storage::presign_get(s3, bucket, &artifact.key, ttl).await {
            Ok(url) => {
                artifact.url = Some(url);
                artifact.url_expires_at_ms = Some(expires_at_ms);
            }
            Err(e) => tracing::warn!(key = artifact.key, error = %e, "cannot presign"),
        }
    }
}

/// Writes `result` with `ttl`; true when written (false: a terminal result was already there).
/// A terminal result written is counted in `sandq_jobs_finished_total`.
///
/// # Errors
/// [`ResultError`] (Redis trouble: retried).
pub(crate) async fn publish(redis: &mut RedisConn, names: &Names, result: &JobResult, ttl: Duration) -> Result<bool, ResultError> {
    let written = results::write(redis, names, result, ttl).await?;
    if written && result.status.is_terminal() {
        crate::metrics::finished(result.sku, result.status);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::url_ttl;

    #[test]
    fn a_url_never_outlives_its_result() {
        let hour = Duration::from_secs(3600);
        assert_eq!(url_ttl(hour, Duration::from_secs(600)), Duration::from_secs(600));
        assert_eq!(url_ttl(hour, Duration::from_secs(7 * 24 * 3600)), hour);
        assert_eq!(url_ttl(Duration::ZERO, hour), Duration::ZERO);
    }
}
