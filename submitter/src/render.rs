//! What `sandq` prints of a job, and the exit code it ends with: pure functions over a
//! [`JobResult`] or its live events, writing to any [`Write`] (stdout and stderr in the
//! commands, buffers in the tests below).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use sandq_client::{Event, EventKind, Transcript};
use sandq_schemas::{Artifact, JobResult, JobStatus, Output, OutputType, Sku};

/// Exit code when sandq itself (or the command line) failed, as `docker run` does.
pub(crate) const EXIT_SANDQ_FAILED: i32 = 125;

/// The CLI's exit code: the program's own when it exited, 137 when it was killed or ran out of
/// memory, 124 for a timeout (as `timeout(1)`), 125 for everything else (sandq failed, the job
/// was rejected, cancelled or expired).
pub(crate) fn exit_code(result: &JobResult) -> i32 {
    match result.status {
        JobStatus::Succeeded | JobStatus::Failed if result.exit_code.is_some() => result.exit_code.unwrap_or(1),
        JobStatus::Failed | JobStatus::OomKilled => 137,
        JobStatus::TimedOut => 124,
        _ => EXIT_SANDQ_FAILED,
    }
}

/// The exit code of `run` and `wait`: [`exit_code`], but 125 when the job succeeded and an
/// artifact could not be downloaded.
pub(crate) fn finish_code(result: &JobResult, download_failed: bool) -> i32 {
    let code = exit_code(result);
    if download_failed && code == 0 {
        EXIT_SANDQ_FAILED
    } else {
        code
    }
}

/// The warning of a job submitted to a SKU no worker serves right now, which expires after
/// `ttl` (zero: never).
pub(crate) fn unserved_warning(sku: Sku, ttl: Duration) -> String {
    let expiry = if ttl.is_zero() {
        "never expires (queues.unserved_ttl is 0)".to_owned()
    } else {
        format!("expires after {} (queues.unserved_ttl)", humantime::format_duration(ttl))
    };
    format!("sandq: no worker serves SKU {sku} right now; the job waits in the queue until one does, or {expiry}")
}

/// Prints one live event (docs/protocol.md "Live events") and folds it into `transcript`:
/// stdout and stderr text to `stdout` and `stderr`, a line per display, a line when an attempt
/// starts over or a stream reached its cap.
pub(crate) fn live_event(
    event: &Event,
    transcript: &mut Transcript,
    stdout: &mut impl Write,
    stderr: &mut impl Write,
) -> std::io::Result<()> {
    let restarted = event.attempt > transcript.attempt() && transcript.attempt() > 0;
    transcript.push(event);
    match &event.kind {
        EventKind::Stdout(text) => stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()),
        EventKind::Stderr(text) => stderr.write_all(text.as_bytes()),
        EventKind::Display { index, output: Some(output) } => live_display(*index, output, stdout),
        EventKind::Attempt { .. } if restarted => {
            writeln!(
                stderr,
                "[sandq: attempt {} starts over; what attempt {} printed is not in the result]",
                event.attempt,
                event.attempt - 1
            )
        }
        EventKind::Truncated { stream, limit } => {
            writeln!(stderr, "[sandq: live {stream} stopped at its cap ({limit}); the rest comes at the end]")
        }
        _ => Ok(()),
    }
}

/// One line for a display shown live: its text, or what it is and where it is (an image's
/// URL or key).
fn live_display(index: u64, output: &Output, out: &mut impl Write) -> std::io::Result<()> {
    if output.output_type == OutputType::Error {
        return Ok(()); // the traceback comes on stderr
    }
    if let Some((mime, value)) = output.data.iter().find(|(m, v)| v.artifact.is_some() && (m.starts_with("image/") || m.contains("plotly")))
    {
        let artifact = value.artifact.as_ref().map(|a| a.url.clone().unwrap_or_else(|| a.key.clone())).unwrap_or_default();
        let size = output.image.map(|i| format!(" {}x{}", i.width, i.height)).unwrap_or_default();
        writeln!(out, "[display {index}: {mime}{size} {artifact}]")?;
    } else if let Some(text) = output.data.get("text/markdown").or_else(|| output.data.get("text/plain")).and_then(|v| v.text.as_ref()) {
        writeln!(out, "{}", text.trim_end())?;
    }
    out.flush()
}

/// Prints rich outputs for a person: tables as markdown tables, text as text, files for the
/// rest (images, figures), each with where it was saved.
fn print_outputs(result: &JobResult, saved: &BTreeMap<usize, PathBuf>, out: &mut impl Write) -> std::io::Result<()> {
    for (index, output) in result.outputs.iter().enumerate() {
        if output.output_type == OutputType::Error {
            continue; // its traceback is on stderr already
        }
        let label = if output.output_type == OutputType::ExecuteResult { "result" } else { "display" };
        if let Some(path) = saved.get(&index) {
            let what = output.data.keys().find(|m| m.starts_with("image/") || m.contains("plotly")).cloned().unwrap_or_default();
            let size = output.image.map(|i| format!(" {}x{}", i.width, i.height)).unwrap_or_default();
            writeln!(out, "[{label} {index}: {what}{size} saved to {}]", path.display())?;
            continue;
        }
        let text = output
            .data
            .get("text/markdown")
            .and_then(|v| v.text.as_ref())
            .or_else(|| output.data.get("text/plain").and_then(|v| v.text.as_ref()));
        if let Some(text) = text {
            writeln!(out, "{}", text.trim_end())?;
        }
        if let Some(table) = output.table {
            writeln!(out, "[{label} {index}: table, {} rows x {} columns]", table.rows, table.columns)?;
        }
    }
    if result.outputs_dropped > 0 {
        writeln!(out, "[sandq: {} outputs dropped over the caps]", result.outputs_dropped)?;
    }
    Ok(())
}

/// What of the stored `text` was not printed live: the part after `streamed` when it starts
/// with it (the stream may also hold more than the result's inline text); all of it when the
/// stream went another way (a gap, another attempt).
fn not_yet_printed<'a>(text: &'a str, streamed: &str) -> &'a str {
    if let Some(rest) = text.strip_prefix(streamed) {
        rest
    } else if streamed.starts_with(text) {
        ""
    } else {
        text
    }
}

/// Where the displays shown live were saved.
fn print_saved(result: &JobResult, saved: &BTreeMap<usize, PathBuf>, out: &mut impl Write) -> std::io::Result<()> {
    for (index, path) in saved {
        let label =
            if result.outputs.get(*index).is_some_and(|o| o.output_type == OutputType::ExecuteResult) { "result" } else { "display" };
        writeln!(out, "[{label} {index} saved to {}]", path.display())?;
    }
    Ok(())
}

/// Prints a terminal result for a person: to `stdout` what the program printed and displayed
/// (only what `live` did not show already), to `stderr` its stderr and the summary (status,
/// reason, exit code, usage, timings, error, artifacts with where they were downloaded,
/// session, skipped files).
pub(crate) fn print_result(
    result: &JobResult,
    downloaded: &[(&Artifact, PathBuf)],
    saved_outputs: &BTreeMap<usize, PathBuf>,
    live: Option<&Transcript>,
    stdout: &mut impl Write,
    stderr: &mut impl Write,
) -> std::io::Result<()> {
    let (streamed_out, streamed_err) = live.map_or(("", ""), |t| (t.stdout.as_str(), t.stderr.as_str()));
    let rest_out = not_yet_printed(&result.stdout.text, streamed_out);
    let rest_err = not_yet_printed(&result.stderr.text, streamed_err);
    if live.is_some() && (rest_out.len() < result.stdout.text.len() || rest_err.len() < result.stderr.text.len()) {
        // Some was printed live: only the rest follows.
    } else if live.is_some_and(|t| !t.stdout.is_empty() || !t.stderr.is_empty()) {
        writeln!(stderr, "[sandq: the live output differs from the stored one, which follows]")?;
    }
    stdout.write_all(rest_out.as_bytes())?;
    if live.is_none_or(|t| t.displays.is_empty()) {
        print_outputs(result, saved_outputs, stdout)?;
    } else {
        print_saved(result, saved_outputs, stdout)?;
    }
    stdout.flush()?;
    stderr.write_all(rest_err.as_bytes())?;
    if result.stdout.truncated {
        writeln!(stderr, "[sandq: stdout truncated: {} bytes in all]", result.stdout.total_bytes)?;
    }
    if result.stderr.truncated {
        writeln!(stderr, "[sandq: stderr truncated: {} bytes in all]", result.stderr.total_bytes)?;
    }
    print_summary(result, downloaded, stderr)
}

/// The summary of a terminal result, after the program's output.
fn print_summary(result: &JobResult, downloaded: &[(&Artifact, PathBuf)], stderr: &mut impl Write) -> std::io::Result<()> {
    writeln!(stderr, "--- sandq: job {} {}", result.job_id, result.status)?;
    if let Some(reason) = &result.reason {
        writeln!(stderr, "    reason: {reason}")?;
    }
    if let Some(code) = result.exit_code {
        writeln!(stderr, "    exit code: {code}")?;
    }
    if let Some(signal) = &result.signal {
        writeln!(stderr, "    signal: {signal}")?;
    }
    if let Some(usage) = &result.usage {
        writeln!(
            stderr,
            "    wall {} ms, cpu {} ms, peak memory {:.1} MiB",
            usage.wall_ms,
            usage.cpu_ms,
            usage.peak_memory_bytes as f64 / (1 << 20) as f64
        )?;
    }
    if let (Some(q), Some(s), Some(f)) = (result.queued_at_ms, result.started_at_ms, result.finished_at_ms) {
        writeln!(
            stderr,
            "    queued -> started {} ms, started -> finished {} ms, submitted -> finished {} ms",
            s.saturating_sub(q),
            f.saturating_sub(s),
            f.saturating_sub(q)
        )?;
    }
    if let Some(error) = &result.error {
        writeln!(stderr, "    error: {}: {}", error.name, error.value)?;
    }
    for artifact in &result.artifacts {
        match downloaded.iter().find(|(a, _)| a.key == artifact.key) {
            Some((_, path)) => writeln!(
                stderr,
                "    artifact {} ({}, {} bytes) -> {}",
                artifact.path,
                artifact.content_type,
                artifact.size,
                path.display()
            )?,
            None => writeln!(
                stderr,
                "    artifact {} ({}, {} bytes) at {}",
                artifact.path,
                artifact.content_type,
                artifact.size,
                artifact.url.as_deref().unwrap_or(&artifact.key)
            )?,
        }
    }
    if let Some(session) = &result.session {
        let state = if session.expired {
            " (fresh: the session had expired)"
        } else if session.fresh {
            " (fresh)"
        } else {
            ""
        };
        writeln!(
            stderr,
            "    session {}{state}: restored {}, saved {}, deleted {} files; now {} files, {} bytes",
            session.name, session.restored_files, session.saved_files, session.deleted_files, session.files, session.bytes
        )?;
    }
    for skipped in &result.skipped_artifacts {
        writeln!(stderr, "    skipped {} ({})", skipped.path, skipped.reason)?;
    }
    let unlisted = result.skipped_artifacts_total.saturating_sub(result.skipped_artifacts.len() as u64);
    if unlisted > 0 {
        writeln!(stderr, "    ... and {unlisted} more files skipped")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
