//! Step 7, collect (with [`crate::artifacts`]): the rich outputs of a notebook-mode job.
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
use sandq_core::storage::{self, TransferError};
use sandq_schemas::names::output_key;
use sandq_schemas::{Artifact, ErrorInfo, ImageSize, MimeValue, Output, OutputType, TableShape};
use serde::Deserialize;
use serde_json::value::RawValue;

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

/// Most representations (MIME types) kept per output; Jupyter bundles have a handful.
pub(crate) const MAX_MIME_PER_OUTPUT: usize = 16;
/// Most S3 objects (images, large values) stored per job.
pub(crate) const MAX_STORED_PER_JOB: usize = 100;
/// Longest `ename` / `evalue` / traceback line kept, bytes; most traceback lines kept.
const MAX_ERROR_TEXT: usize = 4096;

/// Most lines of the outputs file parsed; the rest are counted as dropped unread.
const MAX_LINES: usize = 10_000;

/// One line of `outputs.jsonl`, as the runner writes it (Jupyter's nbformat output shape).
/// Maps and lists are read through bounded visitors (entries past the bound are skipped
/// without being stored) and values stay raw JSON text borrowed from the file's bytes until
/// used: the worker's memory is the file's size plus one value at a time.
#[derive(Debug, Deserialize)]
struct Line<'a> {
    output_type: String,
    #[serde(default, borrow)]
    data: Bounded<Vec<(String, &'a RawValue)>>,
    #[serde(default, borrow)]
    metadata: Bounded<Vec<(String, &'a RawValue)>>,
    #[serde(default)]
    ename: String,
    #[serde(default)]
    evalue: String,
    #[serde(default)]
    traceback: Bounded<Vec<String>>,
}

/// The first [`BOUND`] entries of a JSON map or list, and how many more there were.
#[derive(Debug, Default)]
struct Bounded<T> {
    items: T,
    skipped: u64,
}

/// Entries kept by [`Bounded`]: the larger of the MIME and traceback caps.
const BOUND: usize = 200;

impl<'de: 'a, 'a> Deserialize<'de> for Bounded<Vec<(String, &'a RawValue)>> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visit<'a> {
            type Value = Bounded<Vec<(String, &'a RawValue)>>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map")
            }
            fn visit_map<M: serde::de::MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
                let mut out = Bounded { items: Vec::new(), skipped: 0 };
                while out.items.len() < BOUND {
                    match map.next_entry::<String, &'a RawValue>()? {
                        Some(entry) => out.items.push(entry),
                        None => return Ok(out),
                    }
                }
                while map.next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?.is_some() {
                    out.skipped += 1;
                }
                Ok(out)
            }
        }
        deserializer.deserialize_map(Visit(std::marker::PhantomData))
    }
}

impl<'de> Deserialize<'de> for Bounded<Vec<String>> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Bounded<Vec<String>>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of strings")
            }
            fn visit_seq<S: serde::de::SeqAccess<'de>>(self, mut seq: S) -> Result<Self::Value, S::Error> {
                let mut out = Bounded { items: Vec::new(), skipped: 0 };
                while out.items.len() < BOUND {
                    match seq.next_element::<String>()? {
                        Some(line) => out.items.push(clip(line, MAX_ERROR_TEXT)),
                        None => return Ok(out),
                    }
                }
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    out.skipped += 1;
                }
                Ok(out)
            }
        }
        deserializer.deserialize_seq(Visit)
    }
}

#[derive(Debug, Deserialize)]
struct TableMeta {
    rows: u64,
    columns: u64,
}

#[derive(Debug, Deserialize)]
struct ImageMeta {
    width: u32,
    height: u32,
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
        "application/pdf" => "pdf",
        "text/html" => "html",
        "text/markdown" => "md",
        "text/latex" => "tex",
        m if m.ends_with("json") => "json",
        m if m.starts_with("text/") => "txt",
        _ => "bin",
    }
}

/// Width and height from a PNG's IHDR chunk (bytes 16..24), `None` when not a PNG.
pub(crate) fn png_size(bytes: &[u8]) -> Option<ImageSize> {
    if bytes.len() < 24 || !bytes.starts_with(b"\x89PNG\r\n\x1a\n") || &bytes[12..16] != b"IHDR" {
        return None;
    }
    let width = u32::from_be_bytes(bytes[16..20].try_into().ok()?);
    let height = u32::from_be_bytes(bytes[20..24].try_into().ok()?);
    Some(ImageSize { width, height })
}

/// A MIME type the worker accepts as a key: `type/subtype`, lower-case letters, digits and
/// `.+-`, at most 100 bytes (it becomes an S3 `Content-Type` header).
pub(crate) fn valid_mime(mime: &str) -> bool {
    let part = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.".contains(&b));
    mime.len() <= 100 && mime.split_once('/').is_some_and(|(t, s)| part(t) && part(s))
}

/// Text types, as the runner sees them (`_is_text_mime`): sent as plain strings.
fn is_text(mime: &str) -> bool {
    mime.starts_with("text/")
        || mime.ends_with("+xml")
        || matches!(mime, "application/javascript" | "application/ecmascript" | "application/xml" | "application/x-latex")
}

fn is_json(mime: &str) -> bool {
    mime == "application/json" || mime.ends_with("+json")
}

/// Representations stored in S3 whatever their size: every non-text, non-JSON type (images,
/// PDF...), sent base64-encoded.
fn is_binary(mime: &str) -> bool {
    !is_text(mime) && !is_json(mime)
}

/// The bytes of one representation, or `None` when it is malformed.
fn decode_value(mime: &str, raw: &RawValue) -> Option<Vec<u8>> {
    if is_json(mime) {
        return Some(raw.get().as_bytes().to_vec());
    }
    if is_binary(mime) {
        let encoded: String = serde_json::from_str(raw.get()).ok()?;
        let cleaned: String = encoded.chars().filter(|c| !c.is_ascii_whitespace()).collect();
        return base64::engine::general_purpose::STANDARD.decode(cleaned).ok();
    }
    if let Ok(text) = serde_json::from_str::<String>(raw.get()) {
        return Some(text.into_bytes());
    }
    // Jupyter allows text as a list of lines: joined as they are read.
    serde_json::from_str::<Joined>(raw.get()).ok().map(|joined| joined.0.into_bytes())
}

/// Jupyter's text as a list of lines, joined while it is read: one `String` no longer than the
/// JSON text, whatever the number of lines (a `Vec<String>` of a million one-letter lines
/// cost the worker ~15 times the outputs file; test:
/// a_text_output_of_millions_of_lines_costs_the_worker_little_memory in tests/hostile.rs).
struct Joined(String);

impl<'de> Deserialize<'de> for Joined {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Joined;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of strings")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Joined, A::Error> {
                let mut joined = String::new();
                while let Some(line) = seq.next_element::<std::borrow::Cow<'de, str>>()? {
                    joined.push_str(&line);
                }
                Ok(Joined(joined))
            }
        }
        deserializer.deserialize_seq(Visit)
    }
}

fn clip(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut cut = max;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    text
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

/// One output, parsed and decoded, before anything is stored.
struct Parsed {
    output_type: OutputType,
    /// (MIME type, bytes) in the order of the line.
    values: Vec<(String, Vec<u8>)>,
    table: Option<TableShape>,
    image: Option<ImageSize>,
    display: Option<ImageSize>,
    error: Option<ErrorInfo>,
}

/// What [`parse`] returns: the outputs, how many outputs or representations were dropped, and
/// the inline budget left after the error outputs.
type ParseResult = (Vec<Parsed>, u64, u64);

/// Parses and decodes the outputs file (CPU work: runs on a blocking thread).
fn parse(bytes: &[u8], max_outputs: usize) -> ParseResult {
    let mut parsed = Vec::new();
    let mut dropped = 0u64;
    let mut inline_left = INLINE_BUDGET;
    for (n, raw) in bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()).enumerate() {
        if n >= MAX_LINES || parsed.len() >= max_outputs {
            dropped += 1;
            continue;
        }
        let Ok(line) = serde_json::from_slice::<Line<'_>>(raw) else {
            dropped += 1;
            continue;
        };
        let output_type = match line.output_type.as_str() {
            "execute_result" => OutputType::ExecuteResult,
            "display_data" => OutputType::DisplayData,
            "error" => OutputType::Error,
            _ => {
                dropped += 1;
                continue;
            }
        };
        let mut values: Vec<(String, Vec<u8>)> = Vec::new();
        let mut error = None;
        if output_type == OutputType::Error {
            // Counted against the inline budget: the innermost lines are kept.
            let name = clip(line.ename, MAX_ERROR_TEXT);
            let value = clip(line.evalue, MAX_ERROR_TEXT);
            let mut traceback = line.traceback.items;
            let size = |t: &[String]| (name.len() + value.len() + t.iter().map(String::len).sum::<usize>()) as u64;
            while !traceback.is_empty() && size(&traceback) > inline_left {
                traceback.remove(0);
            }
            if size(&traceback) > inline_left {
                dropped += 1;
                continue;
            }
            inline_left -= size(&traceback);
            values.push(("text/plain".into(), format!("{name}: {value}").into_bytes()));
            error = Some(ErrorInfo { name, value, traceback });
        }
        dropped += line.data.skipped;
        for (mime, raw) in &line.data.items {
            if values.len() >= MAX_MIME_PER_OUTPUT || !valid_mime(mime) || values.iter().any(|(m, _)| m == mime) {
                dropped += 1;
                continue;
            }
            match decode_value(mime, raw) {
                Some(bytes) => values.push((mime.clone(), bytes)),
                None => dropped += 1,
            }
        }
        // The runner's display size of the image (its metadata).
        let meta = line
            .metadata
            .items
            .iter()
            .filter(|(k, _)| k.starts_with("image/"))
            .find_map(|(_, raw)| serde_json::from_str::<ImageMeta>(raw.get()).ok())
            .map(|m| ImageSize { width: m.width, height: m.height });
        // Not a PNG (JPEG, GIF...): the runner's metadata, the only size there is.
        let image = values.iter().find(|(m, _)| m == "image/png").and_then(|(_, b)| png_size(b)).or(meta);
        let display = meta.filter(|m| image.is_some_and(|i| i != *m));
        let table = line
            .metadata
            .items
            .iter()
            .find(|(k, _)| k == "sandq/table")
            .and_then(|(_, raw)| serde_json::from_str::<TableMeta>(raw.get()).ok())
            .map(|t| TableShape { rows: t.rows, columns: t.columns });
        parsed.push(Parsed { output_type, values, table, image, display, error });
    }
    (parsed, dropped, inline_left)
}

/// Parses the runner's outputs and stores images and large values in S3 under
/// `jobs/<job_id>/<attempt_id>/outputs/`. Everything is bounded: [`Caps`], [`MAX_MIME_PER_OUTPUT`],
/// [`MAX_STORED_PER_JOB`], [`INLINE_BUDGET`] (error outputs included), [`MAX_LINES`];
/// anything past a bound, malformed, or with an invalid MIME name is left out and counted in
/// `dropped`. Parsing runs on a blocking thread.
///
/// # Errors
/// [`OutputsError::Upload`] when S3 fails.
pub(crate) async fn collect(
    job_id: &str,
    attempt_id: &str,
    out_dir: &Path,
    caps: Caps,
    s3: &aws_sdk_s3::Client,
    bucket: &str,
) -> Result<Outputs, OutputsError> {
    let out_dir = out_dir.to_path_buf();
    let (parsed, dropped, mut inline_left) = tokio::task::spawn_blocking(move || {
        let bytes = read_lines(&out_dir, caps.max_bytes);
        parse(&bytes, caps.max_outputs)
    })
    .await
    .unwrap_or_else(|_| (Vec::new(), 0, INLINE_BUDGET));
    let mut result = Outputs { dropped, ..Outputs::default() };
    let mut stored = 0;
    for (index, p) in parsed.into_iter().enumerate() {
        let mut output = Output {
            output_type: p.output_type,
            data: BTreeMap::new(),
            table: p.table,
            image: p.image,
            display: p.display,
            error: p.error,
        };
        for (n, (mime, bytes)) in p.values.into_iter().enumerate() {
            let size = bytes.len() as u64;
            let inline = !is_binary(&mime) && size <= caps.max_inline_value && size <= inline_left;
            let value = if inline {
                inline_left -= size;
                MimeValue { text: Some(String::from_utf8_lossy(&bytes).into_owned()), artifact: None, size }
            } else if stored >= MAX_STORED_PER_JOB {
                result.dropped += 1;
                continue;
            } else {
                stored += 1;
                let file = format!("output-{index}-{n}.{}", extension(&mime));
                let key = output_key(job_id, attempt_id, &file);
                let sha256 = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&bytes));
                storage::put_bytes(s3, bucket, &key, bytes, &mime)
                    .await
                    .map_err(|source| OutputsError::Upload { key: key.clone(), source })?;
                let artifact =
                    Artifact { path: file.clone(), key, size, sha256, content_type: mime.clone(), url: None, url_expires_at_ms: None };
                MimeValue { text: None, artifact: Some(artifact), size }
            };
            output.data.insert(mime, value);
        }
        output.data.entry("text/plain".into()).or_insert(MimeValue { text: Some(String::new()), artifact: None, size: 0 });
        if output.error.is_some() {
            result.error.clone_from(&output.error);
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
        assert!(valid_mime("image/png") && valid_mime("application/vnd.plotly.v1+json"));
        assert!(!valid_mime("Image/PNG") && !valid_mime("text/html\r\nX: y") && !valid_mime("text") && !valid_mime("/x"));
        let mut png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR".to_vec();
        png.extend_from_slice(&3u32.to_be_bytes());
        png.extend_from_slice(&2u32.to_be_bytes());
        assert_eq!(png_size(&png), Some(ImageSize { width: 3, height: 2 }));
        assert_eq!(png_size(b"GIF89a not a png at all...."), None);
    }
}
