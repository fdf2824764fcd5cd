//! The outputs file's lines parsed and decoded, bounded, before anything is stored (pure).

use base64::Engine;
use sandq_schemas::{ErrorInfo, ImageSize, OutputType, TableShape};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::INLINE_BUDGET;

/// Most representations (MIME types) kept per output; Jupyter bundles have a handful.
pub(super) const MAX_MIME_PER_OUTPUT: usize = 16;
/// Longest `ename` / `evalue` / traceback line kept, bytes; most traceback lines kept.
const MAX_ERROR_TEXT: usize = 4096;

/// Most lines of the outputs file parsed; the rest are counted as dropped unread.
pub(super) const MAX_LINES: usize = 10_000;

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
pub(super) fn is_binary(mime: &str) -> bool {
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

/// One output, parsed and decoded, before anything is stored.
pub(super) struct Parsed {
    pub(super) output_type: OutputType,
    /// (MIME type, bytes) in the order of the line.
    pub(super) values: Vec<(String, Vec<u8>)>,
    pub(super) table: Option<TableShape>,
    pub(super) image: Option<ImageSize>,
    pub(super) display: Option<ImageSize>,
    pub(super) error: Option<ErrorInfo>,
}

/// What [`parse`] returns: the outputs, how many outputs or representations were dropped, and
/// the inline budget left after the error outputs.
type ParseResult = (Vec<Parsed>, u64, u64);

/// Parses and decodes the outputs file (CPU work: runs on a blocking thread).
pub(super) fn parse(bytes: &[u8], max_outputs: usize) -> ParseResult {
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
