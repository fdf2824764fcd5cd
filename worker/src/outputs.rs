//! Stage 5 (with [`crate::collect`]): the rich outputs of a notebook-mode job.
//!
//! The runner (`oci-bundles/runner/sandq_runner.py`) appends one JSON object a line to
//! `/sandq/out/outputs.jsonl`, a tmpfs of `max_outputs_bytes` on the host (`<job dir>/out`).
//! The file was written by the sandbox, so it is opened `O_NOFOLLOW | O_NONBLOCK`, must be a
//! regular file, is read up to the tmpfs size, and every line is parsed on its own (a bad
//! line is dropped and counted). Images always go to S3; text goes inline into the result up
//! to `max_inline_output_bytes` per value and [`INLINE_BUDGET`] per job, to S3 beyond.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use base64::Engine;
use sandq_schemas::names::output_key;
use sandq_schemas::{Artifact, ErrorInfo, ImageSize, MimeValue, Output, OutputType, TableShape};
use sandq_submitter::storage::{self, TransferError};
use serde::Deserialize;

/// Inline bytes of all outputs of one job together: keeps the Redis value small (the result
/// is read whole by every poll).
pub const INLINE_BUDGET: u64 = 256 << 10;

/// The rich outputs of a job.
#[derive(Debug, Clone, Default)]
pub struct Outputs {
    /// In order of appearance.
    pub outputs: Vec<Output>,
    /// Lines dropped: malformed, or past the count cap.
    pub dropped: u64,
    /// The uncaught exception, if any.
    pub error: Option<ErrorInfo>,
}

/// Why outputs could not be stored (S3 trouble: retried).
#[derive(Debug, thiserror::Error)]
pub enum OutputsError {
    /// Uploading a representation failed.
    #[error("cannot store output {key}: {source}")]
    Upload {
        /// The S3 key.
        key: String,
        /// The transfer error.
        source: TransferError,
    },
}

/// One line of `outputs.jsonl`, as the runner writes it (Jupyter's nbformat output shape).
#[derive(Debug, Deserialize)]
struct Line {
    output_type: String,
    #[serde(default)]
    data: BTreeMap<String, serde_json::Value>,
    #[serde(default)]
    metadata: BTreeMap<String, serde_json::Value>,
    #[serde(default)]
    ename: String,
    #[serde(default)]
    evalue: String,
    #[serde(default)]
    traceback: Vec<String>,
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

/// File extension of an output representation in S3.
fn extension(mime: &str) -> &'static str {
    match mime {
        "image/png" => "png",
        "image/jpeg" => "jpg",
        "image/gif" => "gif",
        "image/webp" => "webp",
        "image/svg+xml" => "svg",
        "text/html" => "html",
        "text/markdown" => "md",
        "text/latex" => "tex",
        m if m.ends_with("json") => "json",
        m if m.starts_with("text/") => "txt",
        _ => "bin",
    }
}

/// Width and height from a PNG's IHDR chunk (bytes 16..24), `None` when not a PNG.
pub fn png_size(bytes: &[u8]) -> Option<ImageSize> {
    if bytes.len() < 24 || !bytes.starts_with(b"\x89PNG\r\n\x1a\n") || &bytes[12..16] != b"IHDR" {
        return None;
    }
    let width = u32::from_be_bytes(bytes[16..20].try_into().ok()?);
    let height = u32::from_be_bytes(bytes[20..24].try_into().ok()?);
    Some(ImageSize { width, height })
}

fn is_binary(mime: &str) -> bool {
    mime.starts_with("image/") && mime != "image/svg+xml"
}

fn is_json(mime: &str) -> bool {
    mime == "application/json" || mime.ends_with("+json")
}

/// What the worker needs to store outputs.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    /// Most outputs kept.
    pub max_outputs: usize,
    /// Bytes read from the outputs file.
    pub max_bytes: u64,
    /// Inline bytes per value.
    pub max_inline_value: u64,
}

/// Parses the runner's outputs and stores images and large values in S3 under
/// `jobs/<job_id>/outputs/`.
///
/// # Errors
/// [`OutputsError::Upload`] when S3 fails.
pub async fn collect(
    job_id: &str,
    out_dir: &Path,
    caps: Caps,
    s3: &aws_sdk_s3::Client,
    bucket: &str,
) -> Result<Outputs, OutputsError> {
    let bytes = read_lines(out_dir, caps.max_bytes);
    let mut result = Outputs::default();
    let mut inline_left = INLINE_BUDGET;
    for raw in bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        let Ok(line) = serde_json::from_slice::<Line>(raw) else {
            result.dropped += 1;
            continue;
        };
        if result.outputs.len() >= caps.max_outputs {
            result.dropped += 1;
            continue;
        }
        let index = result.outputs.len();
        let output_type = match line.output_type.as_str() {
            "execute_result" => OutputType::ExecuteResult,
            "display_data" => OutputType::DisplayData,
            "error" => OutputType::Error,
            _ => {
                result.dropped += 1;
                continue;
            }
        };
        let mut output = Output { output_type, data: BTreeMap::new(), table: None, image: None, error: None };
        let mut data = line.data;
        if output_type == OutputType::Error {
            let error = ErrorInfo { name: line.ename, value: line.evalue, traceback: line.traceback };
            data.insert("text/plain".into(), serde_json::Value::String(error.traceback.join("\n")));
            output.error = Some(error.clone());
            result.error = Some(error);
        }
        for (n, (mime, value)) in data.into_iter().enumerate() {
            let bytes = if is_binary(&mime) {
                let Some(encoded) = value.as_str() else { continue };
                let cleaned: String = encoded.chars().filter(|c| !c.is_ascii_whitespace()).collect();
                let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(cleaned) else { continue };
                if mime == "image/png" {
                    output.image = png_size(&decoded);
                }
                decoded
            } else if is_json(&mime) {
                serde_json::to_vec(&value).unwrap_or_default()
            } else {
                match value {
                    serde_json::Value::String(s) => s.into_bytes(),
                    // Jupyter allows text as a list of lines.
                    serde_json::Value::Array(lines) => lines.iter().filter_map(|l| l.as_str()).collect::<String>().into_bytes(),
                    _ => continue,
                }
            };
            let size = bytes.len() as u64;
            let inline = !is_binary(&mime) && size <= caps.max_inline_value && size <= inline_left;
            let value = if inline {
                inline_left -= size;
                MimeValue { text: Some(String::from_utf8_lossy(&bytes).into_owned()), artifact: None, size }
            } else {
                let file = format!("output-{index}-{n}.{}", extension(&mime));
                let key = output_key(job_id, &file);
                let sha256 = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&bytes));
                storage::put_bytes(s3, bucket, &key, bytes, &mime)
                    .await
                    .map_err(|source| OutputsError::Upload { key: key.clone(), source })?;
                let artifact = Artifact {
                    path: file.clone(),
                    key,
                    size,
                    sha256,
                    content_type: mime.clone(),
                    url: None,
                    url_expires_at_ms: None,
                };
                MimeValue { text: None, artifact: Some(artifact), size }
            };
            output.data.insert(mime, value);
        }
        if output.image.is_none() {
            output.image = line.metadata.values().find_map(|m| {
                Some(ImageSize { width: m.get("width")?.as_u64()? as u32, height: m.get("height")?.as_u64()? as u32 })
            });
        }
        if let Some(table) = line.metadata.get("sandq/table") {
            if let (Some(rows), Some(columns)) = (table.get("rows").and_then(|v| v.as_u64()), table.get("columns").and_then(|v| v.as_u64())) {
                output.table = Some(TableShape { rows, columns });
            }
        }
        result.outputs.push(output);
    }
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn png_size_reads_the_header() {
        // A 1x1 PNG made by hand: signature, IHDR length 13, "IHDR", width 3, height 2.
        let mut png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR".to_vec();
        png.extend_from_slice(&3u32.to_be_bytes());
        png.extend_from_slice(&2u32.to_be_bytes());
        assert_eq!(png_size(&png), Some(ImageSize { width: 3, height: 2 }));
        assert_eq!(png_size(b"GIF89a not a png at all...."), None);
    }
}
