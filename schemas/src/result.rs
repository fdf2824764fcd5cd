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
    #[serde(deserialize_with = "decode::schema_version")]
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
    #[serde(default, deserialize_with = "decode::stdout")]
    pub stdout: CapturedOutput,
    /// The program's standard error.
    #[serde(default, deserialize_with = "decode::stderr")]
    pub stderr: CapturedOutput,
    /// Files the program created or changed under `/work`, uploaded to S3.
    #[serde(default, deserialize_with = "decode::artifacts")]
    pub artifacts: Vec<Artifact>,
    /// Files under `/work` that were not uploaded, and why (symlink, hard link, special file,
    /// over the count or size cap).
    #[serde(default, deserialize_with = "decode::skipped_artifacts")]
    pub skipped_artifacts: Vec<SkippedArtifact>,
    /// Files not uploaded, in all; `skipped_artifacts` lists at most the first 100.
    #[serde(default, deserialize_with = "decode::skipped_artifacts_total")]
    pub skipped_artifacts_total: u64,
    /// Resources the job used; absent when it never ran.
    #[serde(default)]
    pub usage: Option<ResourceUsage>,
    /// When the client submitted the job (from the `JobSpec`), Unix epoch milliseconds.
    #[serde(default, deserialize_with = "decode::queued_at_ms")]
    pub queued_at_ms: Option<u64>,
    /// When the worker started the container, Unix epoch milliseconds.
    #[serde(default, deserialize_with = "decode::started_at_ms")]
    pub started_at_ms: Option<u64>,
    /// When the worker finished the job, Unix epoch milliseconds.
    #[serde(default, deserialize_with = "decode::finished_at_ms")]
    pub finished_at_ms: Option<u64>,
    /// Id of the worker that wrote this result.
    #[serde(default)]
    pub worker_id: Option<String>,
    /// Delivery attempt that wrote this result, 1 for the first delivery.
    #[serde(default, deserialize_with = "decode::attempt")]
    pub attempt: u32,
    /// Rich outputs of a notebook-mode job, in order of appearance (see [`Output`]); empty in
    /// script mode.
    #[serde(default, deserialize_with = "decode::outputs")]
    pub outputs: Vec<Output>,
    /// Outputs left out because the job produced more than the worker's caps (count
    /// `max_outputs`, 100; bytes `max_outputs_bytes`, 32 MiB).
    #[serde(default, deserialize_with = "decode::outputs_dropped")]
    pub outputs_dropped: u64,
    /// The uncaught exception of a notebook-mode job (also the last entry of `outputs`).
    #[serde(default)]
    pub error: Option<ErrorInfo>,
    /// The job's session, when it named one.
    #[serde(default)]
    pub session: Option<SessionInfo>,
    /// A notebook-mode job's cell number, as Jupyter numbers cells: 1 without a session, and
    /// one more than the session's previous notebook cell with one. Nil in script mode.
    #[serde(default)]
    pub execution_count: Option<u64>,
    /// How the job got its sandbox; nil when it never ran.
    #[serde(default)]
    pub sandbox: Option<SandboxStart>,
}

/// How a job got its sandbox.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxStart {
    /// It was handed a warm sandbox (started before the job arrived, with the runner's modules
    /// preloaded) rather than starting one.
    pub warm: bool,
    /// The warm sandbox's process was forked from a pre-imported template rather than started
    /// in it (docs/threat-model.md, "Forked sandboxes"); false for a cold start.
    #[serde(default)]
    pub forked: bool,
    /// From the job taking its share of the worker's capacity (`started_at_ms`) to the program
    /// starting, milliseconds: staging its files, and for a cold start making and starting the
    /// container; for a warm start staging its files and the handover.
    pub sandbox_wait_ms: u64,
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
            outputs: Vec::new(),
            outputs_dropped: 0,
            error: None,
            session: None,
            execution_count: None,
            sandbox: None,
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
    /// MIME type guessed from the file's name (`image/png`, `text/csv`...).
    pub content_type: String,
    /// Presigned HTTP GET URL of the object (S3 SigV4, through the worker's S3 endpoint),
    /// valid until `url_expires_at_ms`; `None` when the worker does not presign
    /// (`artifact_url_ttl = "0s"`).
    #[serde(default)]
    pub url: Option<String>,
    /// When `url` stops working, Unix epoch milliseconds (the worker's `artifact_url_ttl`,
    /// default 1 h, at most 7 days, the SigV4 limit, and never longer than the job's
    /// `result_ttl`).
    #[serde(default)]
    pub url_expires_at_ms: Option<u64>,
}

/// Kind of a rich output (Jupyter's `output_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputType {
    /// The value of the cell's last expression.
    ExecuteResult,
    /// A `display(...)` call, `plt.show()`, or a figure still open when the cell ended.
    DisplayData,
    /// An uncaught exception (`error` is set; `data` holds `text/plain` as `Name: value`).
    Error,
}

/// One rich output of a notebook-mode job: a MIME bundle, one representation of the same
/// object per MIME type, as in Jupyter (`text/plain` is always there).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Output {
    /// Kind of output.
    pub output_type: OutputType,
    /// MIME type -> representation: `text/plain`, `text/html`, `text/markdown`, `image/png`,
    /// `image/jpeg`, `image/svg+xml`, `application/json`, `application/vnd.plotly.v1+json`...
    pub data: std::collections::BTreeMap<String, MimeValue>,
    /// Rows and columns of a pandas DataFrame or Series (the whole object; the HTML and
    /// markdown forms show at most 60 and 50 rows).
    #[serde(default)]
    pub table: Option<TableShape>,
    /// Pixel size of the `image/png` (or other image) representation, read from its header.
    #[serde(default)]
    pub image: Option<ImageSize>,
    /// Size to show the image at, in CSS pixels, when the runner's display metadata gives one
    /// other than its pixels: a retina (hidpi) figure has twice the pixels of its display
    /// size, as in Jupyter. `None`: show it at its pixel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display: Option<ImageSize>,
    /// The exception of an `error` output.
    #[serde(default)]
    pub error: Option<ErrorInfo>,
}

/// One representation in a MIME bundle: inline text, or an S3 object. Images are always
/// stored in S3; text (JSON as its serialization) is inline up to the worker's
/// `max_inline_output_bytes` (64 KiB) per value and 256 KiB per job, in S3 beyond.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MimeValue {
    /// The representation as UTF-8 text (JSON types: their JSON serialization).
    #[serde(default)]
    pub text: Option<String>,
    /// The representation in S3 (`jobs/<job_id>/outputs/<n>.<ext>`), with its URL.
    #[serde(default)]
    pub artifact: Option<Artifact>,
    /// Size of the representation, bytes (decoded, for images).
    pub size: u64,
}

/// Shape of a table output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableShape {
    /// Rows of the whole DataFrame or Series.
    pub rows: u64,
    /// Columns (1 for a Series).
    pub columns: u64,
}

/// Pixel size of an image output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageSize {
    /// Width, pixels.
    pub width: u32,
    /// Height, pixels.
    pub height: u32,
}

/// An uncaught exception of a notebook-mode job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorInfo {
    /// Exception class name (`ZeroDivisionError`).
    pub name: String,
    /// Its message (`division by zero`).
    pub value: String,
    /// Plain-text lines as Python prints them, innermost frame last; frames of the user's code
    /// name `/sandq/main.py` (or the entry point) with the user's line numbers; no ANSI colour.
    pub traceback: Vec<String>,
}

/// What happened to the job's session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionInfo {
    /// The session's name.
    pub name: String,
    /// True when the job started with an empty session: first use, or the session had expired
    /// (then `expired` is true too) or been removed.
    pub fresh: bool,
    /// True when the session existed but had expired: its files were deleted before this job.
    pub expired: bool,
    /// Files restored into `/work` before the program ran.
    pub restored_files: u64,
    /// Files saved to the session afterwards (new or changed content).
    pub saved_files: u64,
    /// Files removed from the session because the program deleted them.
    pub deleted_files: u64,
    /// Files in the session after the job.
    pub files: u64,
    /// Their total size, bytes.
    pub bytes: u64,
    /// Files left in `/work` that the session does not keep: those over its caps (the worker's
    /// `max_artifacts` files and `max_artifact_bytes` bytes, for the whole session) and every
    /// file the artifact walk skipped (`skipped_artifacts_total`).
    #[serde(default)]
    pub unsaved_files: u64,
    /// When the session expires unless another job uses it, Unix epoch milliseconds.
    pub expires_at_ms: u64,
    /// The notebook state (variables, functions, classes, imports) this job restored and left
    /// for the next job of the session; nil in script mode and for a Node.js job.
    #[serde(default)]
    pub state: Option<SessionState>,
}

/// A session's notebook state around one job: what was restored before the cell ran, and what
/// was saved after it ended by itself (on a timeout, OOM kill or cancel the previous state
/// stays, and `saved` is false). Reported by the runner inside the sandbox: it describes the
/// job's own state only.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionState {
    /// Variables restored from the previous job before the cell ran.
    #[serde(default)]
    pub restored: u64,
    /// Variables of the previous state that could not be restored, with the reason.
    #[serde(default)]
    pub not_restored: Vec<UnsavedVariable>,
    /// Whether a new state was saved (false: the previous one, if any, stays).
    #[serde(default)]
    pub saved: bool,
    /// Names of the variables saved (at most 1,000 listed).
    #[serde(default)]
    pub variables: Vec<String>,
    /// Variables left out of the saved state, with the reason (at most 100 listed): objects
    /// that cannot be pickled (open files, sockets, generators...), or over the size or time
    /// cap.
    #[serde(default)]
    pub unsaved: Vec<UnsavedVariable>,
    /// Size of the saved state, bytes.
    #[serde(default)]
    pub bytes: u64,
    /// Time the runner spent saving it, milliseconds.
    #[serde(default)]
    pub save_ms: u64,
    /// Time the runner spent restoring the previous state before the cell, milliseconds
    /// (inside the sandbox, counted in the job's time).
    #[serde(default)]
    pub restore_ms: u64,
}

/// A variable left out of a session's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnsavedVariable {
    /// The variable's name.
    pub name: String,
    /// Why (`TypeError: cannot pickle '_io.TextIOWrapper' object`, `over the size cap`...).
    pub reason: String,
}

/// A file the worker did not collect.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedArtifact {
    /// Path relative to `/work`.
    pub path: String,
    /// Why: `symlink`, `hard_link`, `not_regular`, `too_many`, `too_large`, `too_deep`,
    /// `unreadable`, `changed`, `bad_name`, or `walk_limit` (the walk stopped after 250,000
    /// entries; `path` is the directory it was in).
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

/// Decoders of the top-level fields of [`JobResult`] that are not plain optionals (a client writes the
/// `queued` result, and a JavaScript client may write its integers as floats, or nil for what
/// it leaves out).
pub mod decode {
    use serde::Deserializer;

    use super::{Artifact, CapturedOutput, Output, SkippedArtifact};
    use crate::de::{fields, int, int_or_nil, nil_default, opt_int};

    fields! {
        schema_version => "schema_version": u32 = int;
        attempt => "attempt": u32 = int_or_nil;
        queued_at_ms => "queued_at_ms": Option<u64> = opt_int;
        started_at_ms => "started_at_ms": Option<u64> = opt_int;
        finished_at_ms => "finished_at_ms": Option<u64> = opt_int;
        stdout => "stdout": CapturedOutput = nil_default;
        stderr => "stderr": CapturedOutput = nil_default;
        artifacts => "artifacts": Vec<Artifact> = nil_default;
        skipped_artifacts => "skipped_artifacts": Vec<SkippedArtifact> = nil_default;
        skipped_artifacts_total => "skipped_artifacts_total": u64 = int_or_nil;
        outputs => "outputs": Vec<Output> = nil_default;
        outputs_dropped => "outputs_dropped": u64 = int_or_nil;
    }
}
