//! The outputs file followed while the job runs (for [`crate::live::displays`]).

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use sandq_schemas::Output;

use super::parse::{parse, Parsed};
use super::store::{store, Budget, Sink};
use super::{Caps, INLINE_BUDGET};

/// Most bytes of the outputs file one [`Tail::next`] reads: a line longer than this (a huge
/// image or plotly figure) is skipped live, and counted so that later indexes stay right.
const TAIL_READ_MAX: u64 = 16 << 20;

/// Reads the outputs file while the job runs: each call parses the complete lines written
/// since the last and stores their images (for [`crate::live::displays`]). Bounded like
/// [`super::collect`]: at most `max_bytes` of the file in all, `max_outputs` outputs, [`TAIL_READ_MAX`]
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
/// [`super::read_lines`] opens it: no symlink, a regular file); nothing read when the size is still
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
    use crate::outputs::Uploaded;

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
}
