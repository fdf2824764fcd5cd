//! Step 7, collect (with [`crate::artifacts`]): the rich outputs of a notebook-mode job.
//!
//! The runner (`oci-bundles/runner/sandq_runner.py`) appends one JSON object a line to
//! `/sandq/out/outputs.jsonl`, a tmpfs of `max_outputs_bytes` on the host (`<job dir>/out`).
//! The file was written by the sandbox, so it is opened `O_NOFOLLOW | O_NONBLOCK`, must be a
//! regular file, is read up to the tmpfs size, and every line is parsed on its own (a bad
//! line is dropped and counted). Images always go to S3; text goes inline into the result up
//! to `max_inline_output_bytes` per value and [`INLINE_BUDGET`] per job, to S3 beyond.
//!
//! [`parse`] reads the lines (bounded, pure), [`store`] puts their values inline or in S3,
//! [`tail`] follows the file while the job runs; [`collect`] reads it once after the run.

mod parse;
mod store;
mod tail;

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use sandq_core::storage::TransferError;
use sandq_schemas::{ErrorInfo, Output};

use self::parse::parse;
use self::store::{store, Budget};
pub(crate) use self::store::{Sink, Uploaded};
pub(crate) use self::tail::Tail;

/// Inline bytes of all outputs of one job together: keeps the Redis value small (the result
/// is read whole by every poll).
pub(crate) const INLINE_BUDGET: u64 = 256 << 10;

/// The rich outputs of a job.
#[derive(Debug, Clone, Default)]
pub(crate) struct Outputs {
    /// In order of appearance.
    pub outputs: Vec<Output>,
    /// Lines dropped: malformed, or past the count cap.
    pub dropped: u64,
    /// The uncaught exception, if any.
    pub error: Option<ErrorInfo>,
}

/// Why outputs could not be stored (S3 trouble: retried).
#[derive(Debug, thiserror::Error)]
pub(crate) enum OutputsError {
    /// Uploading a representation failed.
    #[error("cannot store output {key}: {source}")]
    Upload {
        /// The S3 key.
        key: String,
        /// The transfer error.
        source: TransferError,
    },
}

/// Reads the outputs file under `out_dir` (absent: no outputs), at most `max_bytes`.
fn read_lines(out_dir: &Path, max_bytes: u64) -> Vec<u8> {
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(out_dir.join("outputs.jsonl"));
    let Ok(file) = opened else { return Vec::new() };
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return Vec::new();
    }
    let mut bytes = Vec::new();
    let _ = file.take(max_bytes).read_to_end(&mut bytes);
    bytes
}

/// What the worker needs to store outputs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caps {
    /// Most outputs kept.
    pub max_outputs: usize,
    /// Bytes read from the outputs file.
    pub max_bytes: u64,
    /// Inline bytes per value.
    pub max_inline_value: u64,
}

impl Caps {
    /// The worker's caps (`worker.max_outputs`, `max_outputs_bytes`, `max_inline_output_bytes`).
    pub(crate) fn of(settings: &crate::settings::OutputSettings) -> Caps {
        Caps {
            max_outputs: settings.max_outputs,
            max_bytes: settings.max_outputs_bytes,
            max_inline_value: settings.max_inline_output_bytes,
        }
    }
}

/// Parses the runner's outputs and stores images and large values in S3 under
/// `jobs/<job_id>/<attempt_id>/outputs/`. Everything is bounded: [`Caps`], [`parse::MAX_MIME_PER_OUTPUT`],
/// [`store::MAX_STORED_PER_JOB`], [`INLINE_BUDGET`] (error outputs included), [`parse::MAX_LINES`];
/// anything past a bound, malformed, or with an invalid MIME name is left out and counted in
/// `dropped`. Parsing runs on a blocking thread. Objects in `uploaded` (stored while the job
/// ran, for its live events) are not uploaded again.
///
/// # Errors
/// [`OutputsError::Upload`] when S3 fails.
pub(crate) async fn collect(job_id: &str, attempt_id: &str, out_dir: &Path, caps: Caps, sink: Sink<'_>) -> Result<Outputs, OutputsError> {
    let out_dir = out_dir.to_path_buf();
    let (parsed, dropped, inline_left) = tokio::task::spawn_blocking(move || {
        let bytes = read_lines(&out_dir, caps.max_bytes);
        parse(&bytes, caps.max_outputs)
    })
    .await
    .unwrap_or_else(|_| (Vec::new(), 0, INLINE_BUDGET));
    let mut budget = Budget { inline_left, stored: 0, dropped };
    let mut result = Outputs::default();
    for (index, p) in parsed.into_iter().enumerate() {
        let output = store(job_id, attempt_id, index, p, caps, &mut budget, sink).await?;
        if output.error.is_some() {
            result.error.clone_from(&output.error);
        }
        result.outputs.push(output);
    }
    result.dropped = budget.dropped;
    Ok(result)
}
