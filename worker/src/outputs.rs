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

/// Objects this attempt already stored (S3 key -> SHA-256): the live displays' uploads
/// ([`crate::live::displays`]), which [`collect`] does not upload again.
pub(crate) type Uploaded = std::sync::Mutex<std::collections::HashMap<String, String>>;

/// Where outputs are stored: the bucket, and what this attempt stored already.
#[derive(Clone, Copy)]
pub(crate) struct Sink<'a> {
    /// S3.
    pub s3: &'a aws_sdk_s3::Client,
    /// The bucket.
    pub bucket: &'a str,
    /// Objects stored already (not uploaded again).
    pub uploaded: &'a Uploaded,
}

/// What storing outputs has used of the job's bounds so far.
#[derive(Debug)]
struct Budget {
    /// Inline bytes left ([`INLINE_BUDGET`] for the result; per value only for a live event).
    inline_left: u64,
    /// S3 objects stored ([`MAX_STORED_PER_JOB`]).
    stored: usize,
    /// Representations left out.
    dropped: u64,
}

/// Stores one parsed output: its text inline within `budget`, the rest (images always) in S3
/// as `output-<index>-<n>.<ext>` under the attempt's prefix, unless `uploaded` has the same
/// object already.
async fn store(
    job_id: &str,
    attempt_id: &str,
    index: usize,
    p: Parsed,
    caps: Caps,
    budget: &mut Budget,
    sink: Sink<'_>,
) -> Result<Output, OutputsError> {
    let Sink { s3, bucket, uploaded } = sink;
    let mut output =
        Output { output_type: p.output_type, data: BTreeMap::new(), table: p.table, image: p.image, display: p.display, error: p.error };
    for (n, (mime, bytes)) in p.values.into_iter().enumerate() {
        let size = bytes.len() as u64;
        let inline = !is_binary(&mime) && size <= caps.max_inline_value && size <= budget.inline_left;
        let value = if inline {
            budget.inline_left -= size;
            MimeValue { text: Some(String::from_utf8_lossy(&bytes).into_owned()), artifact: None, size }
        } else if budget.stored >= MAX_STORED_PER_JOB {
            budget.dropped += 1;
            continue;
        } else {
            budget.stored += 1;
            let file = format!("output-{index}-{n}.{}", extension(&mime));
            let key = output_key(job_id, attempt_id, &file);
            let sha256 = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&bytes));
            let done = uploaded.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&key) == Some(&sha256);
            if !done {
                storage::put_bytes(s3, bucket, &key, bytes, &mime)
                    .await
                    .map_err(|source| OutputsError::Upload { key: key.clone(), source })?;
                uploaded.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(key.clone(), sha256.clone());
            }
            let artifact =
                Artifact { path: file.clone(), key, size, sha256, content_type: mime.clone(), url: None, url_expires_at_ms: None };
            MimeValue { text: None, artifact: Some(artifact), size }
        };
        output.data.insert(mime, value);
    }
    output.data.entry("text/plain".into()).or_insert(MimeValue { text: Some(String::new()), artifact: None, size: 0 });
    Ok(output)
}

/// Parses the runner's outputs and stores images and large values in S3 under
/// `jobs/<job_id>/<attempt_id>/outputs/`. Everything is bounded: [`Caps`], [`MAX_MIME_PER_OUTPUT`],
/// [`MAX_STORED_PER_JOB`], [`INLINE_BUDGET`] (error outputs included), [`MAX_LINES`];
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

/// Most bytes of the outputs file one [`Tail::next`] reads: a line longer than this (a huge
/// image or plotly figure) is skipped live, and counted so that later indexes stay right.
const TAIL_READ_MAX: u64 = 16 << 20;

/// Reads the outputs file while the job runs: each call parses the complete lines written
/// since the last and stores their images (for [`crate::live::displays`]). Bounded like
/// [`collect`]: at most `max_bytes` of the file in all, `max_outputs` outputs, [`TAIL_READ_MAX`]
/// a line, [`INLINE_BUDGET`] of inline text an attempt (larger values go to S3, as in the
/// result). Each byte is read at most twice, however slowly a line grows: the bytes of a line
/// not yet ended are looked at once for its newline, then once more when it is parsed; nothing
/// is read when the file has not grown.
#[derive(Debug, Default)]
pub(crate) struct Tail {
    /// Bytes of the file consumed (through the last complete line).
    offset: u64,
    /// Bytes after `offset` known to hold no newline (a line being written).
    scanned: u64,
    /// Outputs counted so far: the next one's index in the result.
    index: usize,
    /// S3 objects stored so far.
    stored: usize,
    /// Inline text sent so far, bytes.
    inlined: u64,
    /// Inside a line longer than [`TAIL_READ_MAX`], skipped up to its end.
    skipping: bool,
    /// The file's size when the last call read to its end (`None`: read again).
    size_seen: Option<u64>,
    /// Bytes read from the file in all (for tests).
    pub(crate) read_bytes: u64,
}

/// What one read of the outputs file found.
#[derive(Default)]
struct TailRead {
    parsed: Vec<Parsed>,
    /// New `offset`, `scanned`, `skipping`, `size_seen`.
    offset: u64,
    scanned: u64,
    skipping: bool,
    size_seen: Option<u64>,
    /// Lines skipped whole (too long), counted as outputs.
    skipped: usize,
    read_bytes: u64,
}

impl Tail {
    /// The outputs completed since the last call, with their index in the result. An output
    /// whose upload fails is left out (collection stores it again); its index stays taken.
    pub(crate) async fn next(
        &mut self,
        job_id: &str,
        attempt_id: &str,
        out_dir: &Path,
        caps: Caps,
        sink: Sink<'_>,
    ) -> Vec<(usize, Output)> {
        let left = caps.max_outputs.saturating_sub(self.index);
        if left == 0 || self.offset >= caps.max_bytes {
            return Vec::new();
        }
        let path = out_dir.join("outputs.jsonl");
        let state = (self.offset, self.scanned, self.skipping, self.size_seen);
        let read = tokio::task::spawn_blocking(move || tail_read(&path, state, caps.max_bytes, left)).await.unwrap_or_default();
        (self.offset, self.scanned, self.skipping, self.size_seen) = (read.offset, read.scanned, read.skipping, read.size_seen);
        self.read_bytes += read.read_bytes;
        self.index += read.skipped;
        // The whole batch is counted before anything is uploaded: an upload that fails, or a
        // call dropped halfway (the run ended), leaves later indexes right.
        let first = self.index;
        self.index += read.parsed.len();
        let mut outputs = Vec::new();
        for (k, p) in read.parsed.into_iter().enumerate() {
            let mut budget = Budget { inline_left: INLINE_BUDGET.saturating_sub(self.inlined), stored: self.stored, dropped: 0 };
            let stored = store(job_id, attempt_id, first + k, p, caps, &mut budget, sink).await;
            self.stored = budget.stored;
            self.inlined = INLINE_BUDGET - budget.inline_left;
            match stored {
                Ok(output) => outputs.push((first + k, output)),
                Err(e) => tracing::debug!(error = %e, index = first + k, "a live display was not stored"),
            }
        }
        outputs
    }
}

/// One [`Tail::next`] read of the file at `path` from `(offset, scanned, skipping,
/// size_seen)`, never past `max_bytes` of the file, at most `left` outputs parsed.
fn tail_read(path: &Path, (offset, scanned, skipping, size_seen): (u64, u64, bool, Option<u64>), max_bytes: u64, left: usize) -> TailRead {
    let mut read = TailRead { offset, scanned, skipping, size_seen, ..TailRead::default() };
    // The new bytes: after what is known to hold no newline, at most to the end of a line of
    // TAIL_READ_MAX.
    let limit = (max_bytes - offset).min(TAIL_READ_MAX);
    let (new, size) = read_from(path, offset + scanned, limit.saturating_sub(scanned), size_seen);
    read.read_bytes += new.len() as u64;
    read.size_seen = (offset + scanned + new.len() as u64 >= size).then_some(size);
    let Some(last_newline) = new.iter().rposition(|b| *b == b'\n') else {
        read.scanned += new.len() as u64;
        if read.skipping || read.scanned >= limit {
            // A line too long (or the rest of one): dropped without being kept; counted once.
            read.skipped = usize::from(!read.skipping && read.scanned >= limit);
            read.skipping = true;
            read.offset += read.scanned;
            read.scanned = 0;
        }
        return read;
    };
    // Complete lines end at `last_newline`: the whole of them, from `offset`.
    let end = offset + scanned + last_newline as u64 + 1;
    let mut lines = if scanned == 0 {
        new[..=last_newline].to_vec()
    } else {
        let (head, _) = read_from(path, offset, scanned, None);
        read.read_bytes += head.len() as u64;
        let mut lines = head;
        lines.extend_from_slice(&new[..=last_newline]);
        lines
    };
    if lines.len() as u64 != end - offset {
        // The file was rewritten under us: start again after what we have.
        lines.clear();
    }
    let mut start = 0;
    if read.skipping {
        // The end of a skipped line.
        match lines.iter().position(|b| *b == b'\n') {
            Some(i) => (start, read.skipping) = (i + 1, false),
            None => start = lines.len(),
        }
    }
    read.parsed = parse(&lines[start.min(lines.len())..], left).0;
    read.offset = end;
    read.scanned = 0;
    read
}

/// Up to `max` bytes of the file at `path` from `offset`, and the file's size (opened as
/// [`read_lines`] opens it: no symlink, a regular file); nothing read when the size is still
/// `size_seen` or the file cannot be read (its size then 0).
fn read_from(path: &Path, offset: u64, max: u64, size_seen: Option<u64>) -> (Vec<u8>, u64) {
    use std::io::{Seek, SeekFrom};
    let opened = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC).open(path);
    let Ok(mut file) = opened else { return (Vec::new(), 0) };
    let Ok(meta) = file.metadata() else { return (Vec::new(), 0) };
    if !meta.is_file() || Some(meta.len()) == size_seen || file.seek(SeekFrom::Start(offset)).is_err() {
        return (Vec::new(), meta.len());
    }
    let mut bytes = Vec::new();
    let _ = file.take(max).read_to_end(&mut bytes);
    (bytes, meta.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line as the runner writes it: a `display_data` with `text/plain`.
    fn line(text: &str) -> String {
        format!("{}\n", serde_json::json!({"output_type": "display_data", "data": {"text/plain": text}, "metadata": {}}))
    }

    #[tokio::test]
    async fn the_tail_sends_complete_lines_once_with_their_result_index() {
        use std::io::Write;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("outputs.jsonl");
        let mut file = std::fs::File::create(&path).expect("create");
        let s3 = aws_sdk_s3::Client::from_conf(
            aws_sdk_s3::Config::builder().behavior_version_latest().region(aws_sdk_s3::config::Region::new("none")).build(),
        );
        let uploaded = Uploaded::default();
        // Text only: nothing goes to S3.
        let sink = Sink { s3: &s3, bucket: "none", uploaded: &uploaded };
        let caps = Caps { max_outputs: 100, max_bytes: 64 << 20, max_inline_value: 1 << 20 };
        let mut tail = Tail::default();
        let next = async |tail: &mut Tail| -> Vec<(usize, String)> {
            let got = tail.next("j", "a", dir.path(), caps, sink).await;
            got.into_iter().map(|(i, o)| (i, o.data["text/plain"].text.clone().expect("inline"))).collect()
        };
        assert!(next(&mut tail).await.is_empty(), "an empty file");
        let third = line("c");
        write!(file, "{}{}{}", line("a"), line("b"), &third[..5]).expect("write");
        assert_eq!(next(&mut tail).await, vec![(0, "a".into()), (1, "b".into())], "complete lines only");
        assert!(next(&mut tail).await.is_empty(), "unchanged: nothing again");
        writeln!(file, "{}not json", &third[5..]).expect("write");
        assert_eq!(next(&mut tail).await, vec![(2, "c".into())], "a malformed line is not an output");
        // A line longer than a read is skipped but counted; the next one keeps its index.
        let huge = line(&"x".repeat(TAIL_READ_MAX as usize + 10));
        write!(file, "{huge}").expect("write");
        assert!(next(&mut tail).await.is_empty());
        write!(file, "{}", line("e")).expect("write");
        let mut got = next(&mut tail).await;
        got.extend(next(&mut tail).await);
        assert_eq!(got, vec![(4, "e".into())], "the huge line was index 3");
        assert!(uploaded.lock().expect("lock").is_empty());
        // A line that grows a little at a time is read about twice, not once per call.
        let before = tail.read_bytes;
        // (Inline, within the attempt's 256 KiB: a test that reaches no S3.)
        let long = line(&"y".repeat(200 << 10));
        let mut got = Vec::new();
        for piece in long.as_bytes().chunks(16 << 10) {
            file.write_all(piece).expect("write");
            got.extend(next(&mut tail).await.into_iter().map(|(i, text)| (i, text.len())));
        }
        assert_eq!(got, vec![(5, 200 << 10)]);
        let read = tail.read_bytes - before;
        assert!(read <= 2 * long.len() as u64 + 16, "read {read} bytes for a line of {}", long.len());
        write!(file, "{}", line("f")).expect("write");
        assert_eq!(next(&mut tail).await, vec![(6, "f".into())]);
    }

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
