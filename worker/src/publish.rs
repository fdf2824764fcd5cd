//! Stage 6: turn what happened into a [`JobResult`] and write it to Redis (compare-and-set:
//! a terminal result is never overwritten; see `sandq_submitter::results`).

use std::time::Duration;

use redis::aio::ConnectionManager;
use sandq_schemas::names::Names;
use sandq_schemas::{CapturedOutput, JobResult, JobStatus, ResourceUsage, ValidJob};
use sandq_submitter::results::{self, ResultError};

use crate::collect::Collected;
use crate::run::{Captured, RunOutput};
use crate::sandbox::Exit;

fn output(captured: &Captured) -> CapturedOutput {
    CapturedOutput {
        text: String::from_utf8_lossy(&captured.bytes).into_owned(),
        total_bytes: captured.total,
        truncated: captured.truncated(),
    }
}

/// Identity of the attempt that writes a result.
#[derive(Debug, Clone)]
pub struct Attempt {
    /// This worker.
    pub worker_id: String,
    /// Delivery attempt, 1 for the first.
    pub number: u32,
    /// When the container started, Unix epoch ms.
    pub started_at_ms: u64,
}

/// A result with the job's identity filled in and `status`.
pub fn base(job: &ValidJob, attempt: &Attempt, status: JobStatus) -> JobResult {
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
pub fn finished(job: &ValidJob, attempt: &Attempt, run: &RunOutput, collected: Collected, memory_limit: u64) -> JobResult {
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
        result.reason = Some(format!(
            "memory limit of {memory_limit} bytes exceeded ({} process(es) killed by the kernel)",
            report.stats.oom_kills
        ));
    }
    result.stdout = output(&run.stdout);
    result.stderr = output(&run.stderr);
    result.artifacts = collected.artifacts;
    result.skipped_artifacts = collected.skipped;
    result.skipped_artifacts_total = collected.skipped_total;
    result.usage = Some(ResourceUsage {
        wall_ms: report.wall_ms,
        cpu_ms: report.stats.cpu_ms,
        peak_memory_bytes: report.stats.peak_memory_bytes,
    });
    result.started_at_ms = Some(attempt.started_at_ms);
    result.finished_at_ms = Some(sandq_submitter::client::now_ms());
    result
}

/// Writes `result` with `ttl`; true when written (false: a terminal result was already there).
///
/// # Errors
/// [`ResultError`] (Redis trouble: retried).
pub async fn publish(
    redis: &mut ConnectionManager,
    names: &Names,
    result: &JobResult,
    ttl: Duration,
) -> Result<bool, ResultError> {
    results::write(redis, names, result, ttl).await
}
