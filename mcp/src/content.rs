//! A job's result as MCP content a model reads well: a one-line summary, stdout and stderr as
//! text (cut at [`Limits::text_chars`] with a note and a resource link to the whole text),
//! tables as the markdown pandas wrote, charts and images as `image` content (PNG, JPEG, GIF,
//! WebP within [`Limits::image_bytes`] and [`Limits::image_pixels`]; larger ones as resource
//! links), artifacts as resource links with their presigned URLs, and a failed job as an
//! `isError` result with its traceback.
//!
//! The lessons behind the shape: a model cannot use an image given as base64 text
//! (datalayer/jupyter-mcp-server#200: 70-100k characters a chart), and must be able to reach
//! the files a job wrote (e2b-dev/mcp-server#7).

use base64::Engine as _;
use rmcp::model::{CallToolResult, ContentBlock, Resource};
use sandq_schemas::{CapturedOutput, JobResult, JobStatus, Output, OutputType};

use sandq_client::http::HttpClient;

/// Caps on what one tool result carries inline.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Characters of stdout, of stderr and of one text output given inline (default 20,000:
    /// about 5,000 tokens, a screenful of a model's context).
    pub text_chars: usize,
    /// Bytes of one inline image (default 1 MiB, before base64).
    pub image_bytes: usize,
    /// Pixels of one inline image (default 4,194,304: 2048 x 2048; assistants scale larger
    /// images down anyway).
    pub image_pixels: u64,
    /// Inline images in one result (default 8); later ones are resource links.
    pub images: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { text_chars: 20_000, image_bytes: 1 << 20, image_pixels: 2048 * 2048, images: 8 }
    }
}

/// The URI of a job's whole stdout or stderr (`sandq://jobs/<id>/stdout`), readable with
/// `resources/read`.
pub fn log_uri(job_id: &str, stream: &str) -> String {
    format!("sandq://jobs/{job_id}/{stream}")
}

/// The URI of a session's file (`sandq://sessions/<name>/files/<path>`).
pub fn file_uri(session: &str, path: &str) -> String {
    format!("sandq://sessions/{session}/files/{path}")
}

/// `text` cut to at most `max` characters (on a character boundary); whether it was cut.
pub fn cut(text: &str, max: usize) -> (&str, bool) {
    match text.char_indices().nth(max) {
        Some((at, _)) => (&text[..at], true),
        None => (text, false),
    }
}

/// Whether a job in `status` failed (the result is an MCP error result).
fn failed(status: JobStatus) -> bool {
    status.is_terminal() && status != JobStatus::Succeeded
}

/// The one-line summary: id, status, exit code, reason, cell number, wall time.
fn summary(result: &JobResult) -> String {
    let mut line = format!("job {}: {}", result.job_id, result.status.as_str());
    if let Some(code) = result.exit_code {
        line.push_str(&format!(", exit code {code}"));
    }
    if let Some(signal) = &result.signal {
        line.push_str(&format!(", killed by {signal}"));
    }
    if let Some(usage) = &result.usage {
        line.push_str(&format!(", {} ms", usage.wall_ms));
    }
    if let Some(n) = result.execution_count {
        line.push_str(&format!(", cell {n}"));
    }
    if let Some(session) = &result.session {
        line.push_str(&format!(", session {}", session.name));
    }
    if let Some(reason) = result.reason.as_deref().filter(|r| !r.is_empty()) {
        line.push_str(&format!(" ({reason})"));
    }
    if !result.status.is_terminal() {
        line.push_str(". Still going: call get_job with this job_id for its result, or cancel_job to stop it.");
    }
    line
}

/// A stream's content: its text (cut), and when not whole a note and a link to all of it.
fn stream(job_id: &str, name: &str, out: &CapturedOutput, limits: &Limits, content: &mut Vec<ContentBlock>) {
    if out.text.is_empty() && out.total_bytes == 0 {
        return;
    }
    let (text, cut_here) = cut(&out.text, limits.text_chars);
    let mut block = format!("{name}:\n{text}");
    if cut_here || out.truncated {
        block.push_str(&format!(
            "\n[{name} cut here: {} bytes in all; the whole text is the resource {}]",
            out.total_bytes,
            log_uri(job_id, name)
        ));
        content.push(ContentBlock::text(block));
        content.push(ContentBlock::resource_link(
            Resource::new(log_uri(job_id, name), format!("{name} of job {job_id}")).with_mime_type("text/plain").with_size(out.log_bytes),
        ));
    } else {
        content.push(ContentBlock::text(block));
    }
}

/// The image MIME types given as `image` content.
const IMAGES: [&str; 4] = ["image/png", "image/jpeg", "image/gif", "image/webp"];

/// One rich output's content: an image (bounded) or a link to it, else markdown, else text.
async fn output(
    rest: &HttpClient,
    job_id: &str,
    index: usize,
    out: &Output,
    limits: &Limits,
    images: &mut usize,
    content: &mut Vec<ContentBlock>,
) {
    if out.output_type == OutputType::Error {
        return; // given with the error below
    }
    if let Some((mime, value)) = IMAGES.iter().find_map(|m| out.data.get(*m).map(|v| (*m, v))) {
        if let Some(artifact) = &value.artifact {
            let link = || {
                let uri = artifact.url.clone().unwrap_or_else(|| format!("sandq://jobs/{job_id}/outputs/{}", artifact.path));
                ContentBlock::resource_link(Resource::new(uri, artifact.path.clone()).with_mime_type(mime).with_size(artifact.size))
            };
            let pixels = out.image.map(|s| u64::from(s.width) * u64::from(s.height));
            let small = value.size as usize <= limits.image_bytes && pixels.is_none_or(|p| p <= limits.image_pixels);
            if !small || *images >= limits.images {
                content.push(ContentBlock::text(format!(
                    "[output {index}: a {mime} image of {} bytes{}, too large to show inline: linked below]",
                    value.size,
                    out.image.map(|s| format!(", {}x{}", s.width, s.height)).unwrap_or_default()
                )));
                content.push(link());
                return;
            }
            match rest.output(job_id, &artifact.path, limits.image_bytes).await {
                Ok(bytes) => {
                    // The header's size, not the result's word, decides (a program controls both).
                    let fits =
                        imagesize::blob_size(&bytes).map(|s| (s.width as u64) * (s.height as u64) <= limits.image_pixels).unwrap_or(false);
                    if fits {
                        *images += 1;
                        content.push(ContentBlock::image(base64::engine::general_purpose::STANDARD.encode(&bytes), mime));
                    } else {
                        content.push(ContentBlock::text(format!(
                            "[output {index}: an image that is not a readable {mime} within the size limits: linked below]"
                        )));
                        content.push(link());
                    }
                }
                Err(e) => {
                    content.push(ContentBlock::text(format!("[output {index}: the image could not be fetched ({e}): linked below]")));
                    content.push(link());
                }
            }
            return;
        }
    }
    let text_of = |mime: &str| out.data.get(mime).and_then(|v| v.text.as_deref());
    let shape = out.table.map(|t| format!(" (a table of {} rows x {} columns)", t.rows, t.columns)).unwrap_or_default();
    let kind = match out.output_type {
        OutputType::ExecuteResult => "result",
        _ => "display",
    };
    if let Some(markdown) = text_of("text/markdown") {
        let (text, was_cut) = cut(markdown, limits.text_chars);
        content.push(ContentBlock::text(format!("[{kind}{shape}]\n{text}{}", if was_cut { "\n[cut here]" } else { "" })));
    } else if let Some(plain) = text_of("text/plain") {
        let (text, was_cut) = cut(plain, limits.text_chars);
        content.push(ContentBlock::text(format!("[{kind}{shape}]\n{text}{}", if was_cut { "\n[cut here]" } else { "" })));
    }
}

/// `result` as a tool result: `isError` when the job failed (or was refused, timed out,
/// cancelled...), with its summary, streams, outputs, artifacts and traceback.
pub async fn job_result(rest: &HttpClient, result: &JobResult, limits: &Limits) -> CallToolResult {
    let mut content = vec![ContentBlock::text(summary(result))];
    let job_id = result.job_id.as_str();
    stream(job_id, "stdout", &result.stdout, limits, &mut content);
    // In notebook mode an uncaught exception's traceback is also the whole of stderr: given once.
    let traceback = result.error.as_ref().map(|e| e.traceback.join("\n")).unwrap_or_default();
    if result.error.is_none() || result.stderr.text.trim() != traceback.trim() {
        stream(job_id, "stderr", &result.stderr, limits, &mut content);
    }
    let mut images = 0;
    for (index, out) in result.outputs.iter().enumerate() {
        output(rest, job_id, index, out, limits, &mut images, &mut content).await;
    }
    if result.outputs_dropped > 0 {
        content.push(ContentBlock::text(format!("[{} outputs left out: over the caps]", result.outputs_dropped)));
    }
    for artifact in &result.artifacts {
        let uri = artifact.url.clone().unwrap_or_else(|| format!("sandq://jobs/{job_id}/artifacts/{}", artifact.path));
        content.push(ContentBlock::resource_link(
            Resource::new(uri, artifact.path.clone())
                .with_description(format!("a file the job wrote: /work/{}", artifact.path))
                .with_mime_type(artifact.content_type.clone())
                .with_size(artifact.size),
        ));
    }
    if let Some(state) = result.session.as_ref().and_then(|s| s.state.as_ref()) {
        let lost: Vec<String> = state.unsaved.iter().chain(&state.not_restored).map(|v| format!("{} ({})", v.name, v.reason)).collect();
        if !lost.is_empty() {
            content.push(ContentBlock::text(format!("[variables the session could not keep: {}]", lost.join("; "))));
        }
    }
    if let Some(error) = &result.error {
        let (text, _) = cut(&traceback, limits.text_chars);
        content.push(ContentBlock::text(format!("error: {}: {}\n{text}", error.name, error.value)));
    }
    if failed(result.status) {
        CallToolResult::error(content)
    } else {
        CallToolResult::success(content)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_cut_on_a_character_boundary() {
        assert_eq!(cut("héllo", 2), ("hé", true));
        assert_eq!(cut("héllo", 5), ("héllo", false));
        assert_eq!(cut("", 0), ("", false));
    }
}
