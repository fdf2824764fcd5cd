//! Steps 7 and 8 (collect, conclude): build a [`JobResult`] and write it to Redis (compare-and-set:
//! a terminal result is never overwritten; see `sandq_core::results`).

use std::time::Duration;

use sandq_core::redis_conn::RedisConn;
use sandq_core::results::{self, ResultError};
use sandq_schemas::names::Names;
use sandq_schemas::{CapturedOutput, JobResult, JobStatus, ResourceUsage, ValidJob};

use crate::artifacts::Collected;
use crate::run::{Captured, RunOutput};
use crate::sandbox::Exit;

/// The inline part of a stream: at most `inline_cap` bytes, cut back to a character boundary
/// when the bytes are valid UTF-8 (so a cut never invents a U+FFFD).
pub(crate) fn output(captured: &Captured, inline_cap: u64, log_key: Option<String>) -> CapturedOutput {
    let bytes = &captured.bytes;
    let valid = std::str::from_utf8(bytes).is_ok();
    let mut cut = bytes.len().min(usize::try_from(inline_cap).unwrap_or(usize::MAX));
    if valid {
        while cut > 0 && cut < bytes.len() && (bytes[cut] & 0xC0) == 0x80 {
            cut -= 1;
        }
    }
    CapturedOutput {
        text: String::from_utf8_lossy(&bytes[..cut]).into_owned(),
        total_bytes: captured.total,
        truncated: (cut as u64) < captured.total,
        lossy: !valid,
        log_bytes: if log_key.is_some() { bytes.len() as u64 } else { 0 },
        log_key,
    }
}

/// Where the captured streams went, and how much of them is inlined.
#[derive(Debug, Clone, Default)]
pub(crate) struct Logs {
    /// Inline cap per stream, bytes.
    pub inline_cap: u64,
    /// S3 key of stdout, if it was stored.
    pub stdout_key: Option<String>,
    /// S3 key of stderr, if it was stored.
    pub stderr_key: Option<String>,
}

/// Identity of the attempt that writes a result.
#[derive(Debug, Clone)]
pub(crate) struct Attempt {
    /// This worker.
    pub worker_id: String,
    /// This processing's own id (`a<16 hex digits>`): every S3 object it writes is under
    /// `jobs/<job_id>/<id>/` ([`sandq_schemas::names::attempt_prefix`]).
    pub id: String,
    /// The consumer slot running it (picks the user namespace range).
    pub slot: usize,
    /// Delivery attempt, 1 for the first.
    pub number: u32,
    /// When the container started, Unix epoch ms.
    pub started_at_ms: u64,
}

/// A result with the job's identity filled in and `status`.
pub(crate) fn base(job: &ValidJob, attempt: &Attempt, status: JobStatus) -> JobResult {
    let mut result = JobResult::new(job.spec.job_id.clone(), status);
    result.sku = Some(job.spec.sku);
    result.queued_at_ms = job.spec.submitted_at_ms;
    result.worker_id = Some(attempt.worker_id.clone());
    result.attempt = attempt.number;
    result
}

/// The terminal result of a job whose container ran. Status precedence: an OOM kill seen in
/// the cgroup wins over everything (the exit code may be 0 when a child was the victim), then
/// the timeout, then the exit status.
pub(crate) fn finished(
    job: &ValidJob,
    attempt: &Attempt,
    run: &RunOutput,
    collected: Collected,
    memory_limit: u64,
    logs: &Logs,
) -> JobResult {
    let report = &run.report;
    let mut result = base(job, attempt, JobStatus::Succeeded);
    match &report.exit {
        Exit::Exited { code } => {
            result.exit_code = Some(*code);
            if *code != 0 {
                result.status = JobStatus::Failed;
                result.reason = Some(format!("exit code {code}"));
            }
        }
        Exit::Signaled { signal } => {
            result.status = JobStatus::Failed;
            result.signal = Some(signal.clone());
            result.reason = Some(format!("killed by {signal}"));
        }
        Exit::TimedOut => {
            result.status = JobStatus::TimedOut;
            result.signal = Some("SIGKILL".into());
            result.reason = Some(format!("still running after {}", humantime::format_duration(job.timeout)));
        }
        Exit::Killed | Exit::Failed { .. } => {
            // Not produced here: the job module treats these as infrastructure failures.
            result.status = JobStatus::InternalError;
            result.reason = Some(format!("{:?}", report.exit));
        }
    }
    if report.stats.oom_kills > 0 {
        result.status = JobStatus::OomKilled;
        result.reason =
            Some(format!("memory limit of {memory_limit} bytes exceeded ({} process(es) killed by the kernel)", report.stats.oom_kills));
    }
    result.stdout = output(&run.stdout, logs.inline_cap, logs.stdout_key.clone());
    result.stderr = output(&run.stderr, logs.inline_cap, logs.stderr_key.clone());
    result.artifacts = collected.artifacts;
    result.skipped_artifacts = collected.skipped;
    result.skipped_artifacts_total = collected.skipped_total;
    result.usage =
        Some(ResourceUsage { wall_ms: report.wall_ms, cpu_ms: report.stats.cpu_ms, peak_memory_bytes: report.stats.peak_memory_bytes });
    result.started_at_ms = Some(attempt.started_at_ms);
    result.finished_at_ms = Some(sandq_core::time::now_ms());
    result
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
    use super::*;

    fn captured(bytes: &[u8], total: u64) -> Captured {
        Captured { bytes: bytes.to_vec(), total }
    }

    #[test]
    fn inline_text_is_cut_on_a_character_boundary() {
        let text = "aé€"; // 1 + 2 + 3 bytes
        let out = output(&captured(text.as_bytes(), 6), 4, None);
        assert_eq!(out.text, "aé");
        assert!(out.truncated && !out.lossy);
    }

    #[test]
    fn invalid_utf8_is_flagged_lossy() {
        let out = output(&captured(b"ok \xff\xfe\x00 end\n", 11), 1024, Some("k".into()));
        assert!(out.lossy);
        assert_eq!(out.text, "ok \u{fffd}\u{fffd}\0 end\n");
        assert_eq!(out.log_bytes, 11);
        assert!(!out.truncated);
    }
}
