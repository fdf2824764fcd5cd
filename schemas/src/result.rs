//! What the worker writes back: [`JobResult`] and its [`JobStatus`].

use serde::{Deserialize, Serialize};

use crate::Sku;

/// State of a job as a client sees it in Redis.
///
/// `queued` and `running` are transient; every other status is terminal and never changes
/// once written (see [`JobStatus::is_terminal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    /// Published and confirmed by the broker; no worker has started it yet.
    Queued,
    /// A worker staged it and is running it (`worker_id`, `attempt` set).
    Running,
    /// The program exited with code 0.
    Succeeded,
    /// The program exited non-zero or was killed by a signal (`exit_code` or `signal` set).
    Failed,
    /// The program was still running at its timeout; every process of the job was killed.
    TimedOut,
    /// The job's cgroup hit its memory limit and the kernel killed a process of the job.
    OomKilled,
    /// The job was invalid (bad MessagePack, missing field, unknown SKU, bad input path...):
    /// never retried. `reason` says why.
    Rejected,
    /// Cancelled by a client before it finished.
    Cancelled,
    /// Its deadline passed while it waited in the queue; not started.
    Expired,
    /// sandq itself failed (storage, broker, sandbox) after its retries. `reason` says what.
    InternalError,
}

impl JobStatus {
    /// True for every status after which the job never changes.
    pub fn is_terminal(self) -> bool {
        !matches!(self, JobStatus::Queued | JobStatus::Running)
    }

    /// The wire name (`"succeeded"`, `"timed_out"`...).
    pub fn as_str(self) -> &'static str {
        match self {
            JobStatus::Queued => "queued",
            JobStatus::Running => "running",
            JobStatus::Succeeded => "succeeded",
            JobStatus::Failed => "failed",
            JobStatus::TimedOut => "timed_out",
            JobStatus::OomKilled => "oom_killed",
            JobStatus::Rejected => "rejected",
            JobStatus::Cancelled => "cancelled",
            JobStatus::Expired => "expired",
            JobStatus::InternalError => "internal_error",
        }
    }
}

impl std::fmt::Display for JobStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The result of a job, as stored in Redis (field `result` of the job's hash).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobResult {
    /// Wire format version ([`crate::SCHEMA_VERSION`]).
    pub schema_version: u32,
    /// The job's id, as the client chose it.
    pub job_id: String,
    /// Where the job stands.
    pub status: JobStatus,
    /// Why the job ended as it did, for people: the validation error of a `rejected` job, the
    /// failing operation of an `internal_error`, the signal of a killed program. `None` when
    /// the status says it all.
    #[serde(default)]
    pub reason: Option<String>,
    /// The SKU it ran on.
    #[serde(default)]
    pub sku: Option<Sku>,
    /// Exit code of the program (0..=255) when it exited by itself.
    #[serde(default)]
    pub exit_code: Option<i32>,
    /// Name of the signal that killed the program (`"SIGKILL"`), when one did.
    #[serde(default)]
    pub signal: Option<String>,
    /// The program's standard output.
    #[serde(default)]
    pub stdout: CapturedOutput,
    /// The program's standard error.
    #[serde(default)]
    pub stderr: CapturedOutput,
    /// Files the program created or changed under `/work`, uploaded to S3.
    #[serde(default)]
    pub artifacts: Vec<Artifact>,
    /// Files under `/work` that were not uploaded, and why (symlink, hard link, special file,
    /// over the count or size cap).
    #[serde(default)]
    pub skipped_artifacts: Vec<SkippedArtifact>,
    /// Files not uploaded, in all; `skipped_artifacts` lists at most the first 100.
    #[serde(default)]
    pub skipped_artifacts_total: u64,
    /// Resources the job used; absent when it never ran.
    #[serde(default)]
    pub usage: Option<ResourceUsage>,
    /// When the client submitted the job (from the `JobSpec`), Unix epoch milliseconds.
    #[serde(default)]
    pub queued_at_ms: Option<u64>,
    /// When the worker started the container, Unix epoch milliseconds.
    #[serde(default)]
    pub started_at_ms: Option<u64>,
    /// When the worker finished the job, Unix epoch milliseconds.
    #[serde(default)]
    pub finished_at_ms: Option<u64>,
    /// Id of the worker that wrote this result.
    #[serde(default)]
    pub worker_id: Option<String>,
    /// Delivery attempt that wrote this result, 1 for the first delivery.
    #[serde(default)]
    pub attempt: u32,
}

impl JobResult {
    /// A result with `status` and every optional field empty.
    pub fn new(job_id: impl Into<String>, status: JobStatus) -> Self {
        JobResult {
            schema_version: crate::SCHEMA_VERSION,
            job_id: job_id.into(),
            status,
            reason: None,
            sku: None,
            exit_code: None,
            signal: None,
            stdout: CapturedOutput::default(),
            stderr: CapturedOutput::default(),
            artifacts: Vec::new(),
            skipped_artifacts: Vec::new(),
            skipped_artifacts_total: 0,
            usage: None,
            queued_at_ms: None,
            started_at_ms: None,
            finished_at_ms: None,
            worker_id: None,
            attempt: 0,
        }
    }
}

/// A captured output stream (stdout or stderr): a small inline part for display, and the
/// exact bytes (up to a larger cap) in S3.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapturedOutput {
    /// The first bytes of the stream, at most the worker's `max_inline_output_bytes` (64 KiB),
    /// decoded as UTF-8; invalid sequences are replaced by U+FFFD (then `lossy` is true).
    pub text: String,
    /// Bytes the program wrote to the stream in all (may exceed what `text` holds).
    pub total_bytes: u64,
    /// True when `text` holds less than `total_bytes`.
    pub truncated: bool,
    /// True when the stored bytes are not valid UTF-8, so `text` is not exact: read the log.
    #[serde(default)]
    pub lossy: bool,
    /// S3 key of the stream's exact bytes (`jobs/<job_id>/stdout` or `stderr`), up to the
    /// worker's `max_output_bytes` (8 MiB); `None` when the stream was empty.
    #[serde(default)]
    pub log_key: Option<String>,
    /// Bytes stored at `log_key`.
    #[serde(default)]
    pub log_bytes: u64,
}

/// A file the program left under `/work`, stored in S3.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifact {
    /// Path relative to `/work`, `/`-separated.
    pub path: String,
    /// S3 object key ([`crate::names::artifact_key`]).
    pub key: String,
    /// Size in bytes.
    pub size: u64,
    /// SHA-256 of the content, 64 lower-case hex digits (of the whole file, also for multipart
    /// uploads).
    pub sha256: String,
    /// MIME type guessed from the file's first bytes and name (`image/png`, `text/csv`...).
    pub content_type: String,
}

/// A file the worker did not collect.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedArtifact {
    /// Path relative to `/work`.
    pub path: String,
    /// Why: `symlink`, `hard_link`, `not_regular`, `too_many`, `too_large`, `too_deep`,
    /// `unreadable`, `changed`, or `walk_limit` (the walk stopped after 250,000 entries; `path`
    /// is the directory it was in).
    pub reason: String,
}

/// Resources a job used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceUsage {
    /// Wall-clock time from container start to exit, milliseconds.
    pub wall_ms: u64,
    /// CPU time of every process of the job (user + system), milliseconds, from the cgroup.
    pub cpu_ms: u64,
    /// Peak memory of the job's cgroup, bytes (v1 `memory.max_usage_in_bytes`, v2
    /// `memory.peak`; 0 when the kernel does not report it).
    pub peak_memory_bytes: u64,
}
