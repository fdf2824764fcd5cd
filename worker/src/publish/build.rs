//! The results a job's attempt writes, built without services: the job's identity ([`base`]),
//! the inline part of a stream (`output`) and the result of a program that ran
//! ([`finished`]).

use sandq_schemas::{CapturedOutput, JobResult, JobStatus, ResourceUsage, ValidJob};

use crate::artifacts::Collected;
use crate::run::{Captured, RunOutput};
use crate::sandbox::Exit;

/// The inline part of a stream: at most `inline_cap` bytes, cut back to a character boundary
/// when the bytes are valid UTF-8 (so a cut never invents a U+FFFD).
fn output(captured: &Captured, inline_cap: u64, log_key: Option<String>) -> CapturedOutput {
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

/// The terminal result, finished at `now`, of a job whose container ran. Status precedence: an OOM kill seen in
/// the cgroup wins over everything (the exit code may be 0 when a child was the victim), then
/// the timeout, then the exit status.
pub(crate) fn finished(
    job: &ValidJob,
    attempt: &Attempt,
    run: &RunOutput,
    collected: Collected,
    memory_limit: u64,
    logs: &Logs,
    now: u64,
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
    result.finished_at_ms = Some(now);
    result
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sandq_schemas::{Artifact, JobSpec, Runtime, Sku};

    use super::*;
    use crate::sandbox::cgroup::CgroupStats;
    use crate::sandbox::SandboxReport;

    fn job() -> ValidJob {
        let mut spec = JobSpec::new("job-7", Sku::L, Runtime::Python, "pass");
        spec.submitted_at_ms = Some(900);
        ValidJob { spec, timeout: Duration::from_secs(90), result_ttl: Duration::from_secs(3600) }
    }

    fn who() -> Attempt {
        Attempt { worker_id: "w-1".into(), id: "a0000000000000002".into(), slot: 1, number: 3, started_at_ms: 1_000 }
    }

    fn ran(exit: Exit, oom_kills: u64) -> RunOutput {
        let stats = CgroupStats { cpu_ms: 40, peak_memory_bytes: 5_000_000, oom_kills };
        let report = SandboxReport {
            exit,
            stats,
            wall_ms: 55,
            create_us: 0,
            start_us: 0,
            delete_us: 0,
            fork_us: 0,
            delete_error: None,
            deleted: true,
        };
        RunOutput { report, stdout: captured(b"out\n", 4), stderr: captured(b"", 0) }
    }

    fn finished_with(exit: Exit, oom_kills: u64) -> JobResult {
        let logs = Logs { inline_cap: 1024, stdout_key: None, stderr_key: Some("jobs/job-7/err".into()) };
        finished(&job(), &who(), &ran(exit, oom_kills), Collected::default(), 1 << 20, &logs, 2_000)
    }

    #[test]
    fn base_names_the_job_and_the_attempt() {
        let result = base(&job(), &who(), JobStatus::Running);
        assert_eq!((result.job_id.as_str(), result.status, result.sku), ("job-7", JobStatus::Running, Some(Sku::L)));
        assert_eq!((result.queued_at_ms, result.worker_id.as_deref(), result.attempt), (Some(900), Some("w-1"), 3));
        assert_eq!((result.started_at_ms, result.finished_at_ms), (None, None));
    }

    #[test]
    fn an_exit_code_decides_success_or_failure() {
        let ok = finished_with(Exit::Exited { code: 0 }, 0);
        assert_eq!((ok.status, ok.exit_code, ok.reason), (JobStatus::Succeeded, Some(0), None));
        assert_eq!((ok.started_at_ms, ok.finished_at_ms), (Some(1_000), Some(2_000)));
        assert_eq!(ok.usage, Some(ResourceUsage { wall_ms: 55, cpu_ms: 40, peak_memory_bytes: 5_000_000 }));
        assert_eq!((ok.stdout.text.as_str(), ok.stdout.total_bytes, ok.stdout.log_key), ("out\n", 4, None));
        assert_eq!((ok.stderr.log_key.as_deref(), ok.stderr.log_bytes), (Some("jobs/job-7/err"), 0));
        let failed = finished_with(Exit::Exited { code: 3 }, 0);
        assert_eq!((failed.status, failed.exit_code, failed.reason.as_deref()), (JobStatus::Failed, Some(3), Some("exit code 3")));
    }

    #[test]
    fn a_signal_or_the_timeout_fails_the_job() {
        let signaled = finished_with(Exit::Signaled { signal: "SIGSEGV".into() }, 0);
        assert_eq!((signaled.status, signaled.signal.as_deref()), (JobStatus::Failed, Some("SIGSEGV")));
        assert_eq!(signaled.reason.as_deref(), Some("killed by SIGSEGV"));
        let late = finished_with(Exit::TimedOut, 0);
        assert_eq!((late.status, late.signal.as_deref()), (JobStatus::TimedOut, Some("SIGKILL")));
        assert_eq!(late.reason.as_deref(), Some("still running after 1m 30s"));
    }

    #[test]
    fn an_oom_kill_wins_over_the_exit_status() {
        for exit in [Exit::Exited { code: 0 }, Exit::TimedOut] {
            let result = finished_with(exit, 2);
            assert_eq!(result.status, JobStatus::OomKilled);
            assert_eq!(result.reason.as_deref(), Some("memory limit of 1048576 bytes exceeded (2 process(es) killed by the kernel)"));
        }
    }

    #[test]
    fn collected_artifacts_are_listed() {
        let artifact = Artifact {
            path: "a.png".into(),
            key: "k".into(),
            size: 3,
            sha256: "0".repeat(64),
            content_type: "image/png".into(),
            url: None,
            url_expires_at_ms: None,
        };
        let collected = Collected { artifacts: vec![artifact.clone()], skipped_total: 4, ..Default::default() };
        let logs = Logs::default();
        let result = finished(&job(), &who(), &ran(Exit::Exited { code: 0 }, 0), collected, 1, &logs, 2_000);
        assert_eq!((result.artifacts, result.skipped_artifacts_total), (vec![artifact], 4));
    }

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
