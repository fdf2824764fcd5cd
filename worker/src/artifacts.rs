//! Step 7, collect (`crate::job`): upload the files the program created or changed under `/work` as artifacts (each an S3 object and an [`Artifact`] of the result).
//!
//! Runs after every process of the job is dead, so nothing changes under the walk. Still,
//! everything in `/work` was written by hostile code: symlinks are never followed (skipped),
//! hard links (link count > 1) are refused (the program could have linked a host file it can
//! read into `/work`), FIFOs, sockets and devices are skipped without opening them, files are
//! opened `O_NOFOLLOW | O_NONBLOCK` and re-checked with `fstat`, and the count and size caps are
//! applied from the metadata before a byte is read (a sparse 1 TB file is never read).
//!
//! Packages installed at run time are not under `/work` ([`crate::packages`]): never artifacts.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use sandq_schemas::names::artifact_key;
use sandq_schemas::{Artifact, SkippedArtifact, ValidJob};

use sandq_core::storage::{self, TransferError};

/// Deepest directory level walked under `/work`.
const MAX_DEPTH: usize = 32;
/// Most directory entries looked at, in all; past it the walk stops and says so. Each costs a
/// share of a `getdents` and an `fstatat` of the worker's CPU, a few microseconds, so the walk
/// costs the worker well under a second whatever `/work` holds (measured by
/// `a_huge_tree_of_hard_links_costs_the_worker_little`).
const MAX_ENTRIES: usize = 250_000;
/// What opening a directory counts for against [`MAX_ENTRIES`].
const DIR_COST: usize = 16;
/// Largest directory (its own size, as `stat` reports it) the walk reads: 64 MiB, about a
/// million entries with 40-byte names; a larger one is skipped as `too_large`.
const MAX_DIR_BYTES: u64 = 64 << 20;
/// Most skipped files listed by name in the result (all are counted): keeps the Redis value
/// small when a program leaves 200,000 files.
pub(crate) const MAX_SKIPPED_LISTED: usize = 100;

/// The artifacts of a job.
#[derive(Debug, Clone, Default)]
pub(crate) struct Collected {
    /// Uploaded files.
    pub artifacts: Vec<Artifact>,
    /// Files left out, with the reason (the first [`MAX_SKIPPED_LISTED`]).
    pub skipped: Vec<SkippedArtifact>,
    /// Files left out, in all.
    pub skipped_total: u64,
    /// Every regular file under `/work` after the run that is in S3 now: the uploaded ones and
    /// the unchanged baseline ones, with the key holding its content. What a session saves.
    pub files: Vec<WorkFile>,
}

/// A file under `/work` whose content is in S3.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WorkFile {
    /// Path relative to `/work`.
    pub path: String,
    /// SHA-256, hex.
    pub sha256: String,
    /// Size, bytes.
    pub size: u64,
    /// S3 key holding the content (an artifact, input or session blob).
    pub key: String,
}

/// A file that was in `/work` before the program ran (an input, or a file restored from the
/// session), with the S3 key of its content: unchanged, it is not uploaded again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Baseline {
    /// SHA-256, hex.
    pub sha256: String,
    /// Size, bytes: a file of another size changed, and is capped like a new file before a
    /// byte of it is read.
    pub size: u64,
    /// S3 key of the content.
    pub key: String,
    /// How staging left the file, when this worker placed it: an unchanged stamp means an
    /// unchanged file, not read again ([`crate::placed::Stamp`]).
    pub stamp: Option<crate::placed::Stamp>,
}

impl Collected {
    fn skip(&mut self, path: &str, reason: &str) {
        self.skipped_total += 1;
        if self.skipped.len() < MAX_SKIPPED_LISTED {
            self.skipped.push(SkippedArtifact { path: path.to_owned(), reason: reason.to_owned() });
        }
    }

    /// Like [`Collected::skip`], but always listed (taking the last place of a full list): the
    /// walk stopping early must be visible in the result.
    fn skip_listed(&mut self, path: &str, reason: &str) {
        if self.skipped.len() >= MAX_SKIPPED_LISTED {
            self.skipped.pop();
        }
        self.skip(path, reason);
    }
}

/// Why collection failed (S3 or local I/O trouble: retried).
#[derive(Debug, thiserror::Error)]
pub(crate) enum CollectError {
    /// Uploading an artifact failed.
    #[error("cannot upload artifact {path:?}: {source}")]
    Upload {
        /// Path relative to `/work`.
        path: String,
        /// The transfer error.
        source: TransferError,
    },
}

/// A regular file found by the walk.
#[derive(Debug, PartialEq, Eq)]
struct Candidate {
    rel: String,
    size: u64,
    dev: u64,
    ino: u64,
    /// Directory levels below `/work` (0 for a top-level file).
    depth: usize,
    /// Last modification, (seconds, nanoseconds) since the epoch.
    mtime: (i64, i64),
}

impl Candidate {
    /// The keep order when there are more new files than the artifact cap: nearest the top of
    /// `/work` first (what a program writes for its user sits there; bulk trees extracted from
    /// an upload sit below), then the most recently modified, then by name.
    fn rank(&self) -> (usize, std::cmp::Reverse<(i64, i64)>, &str) {
        (self.depth, std::cmp::Reverse(self.mtime), self.rel.as_str())
    }
}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.rank().cmp(&other.rank())
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// What the walk keeps. Its size is bounded whatever `/work` holds (keeping every path of
/// 250,000 hard links grew the worker by 1.5 GB; test: a_huge_tree_of_hard_links_costs_the_worker_little
/// in tests/hostile.rs): at most
/// `baseline.len()` files at baseline paths, at most `max_new` other files (each path at most
/// [`sandq_schemas::validate::MAX_PATH_BYTES`]), [`MAX_SKIPPED_LISTED`] skipped names, and one
/// open directory per level of depth.
#[derive(Debug, Default)]
struct Walked {
    /// Files at the path of a baseline file (input or restored session file).
    at_baseline: Vec<Candidate>,
    /// The best `max_new` other files by [`Candidate::rank`]; a max-heap, so the worst kept
    /// file is the one evicted.
    new: std::collections::BinaryHeap<Candidate>,
    skipped: Collected,
}

/// Walks `work` by directory fds (`openat` with `O_NOFOLLOW`, `fstatat` with
/// `AT_SYMLINK_NOFOLLOW`: nothing the program planted is followed), reading each directory
/// incrementally and applying every cap before anything is stored. Runs on a blocking thread.
fn walk(work: &Path, baseline: &BTreeSet<String>, links_ok: bool, max_new: usize) -> Walked {
    use nix::dir::Dir;
    use nix::fcntl::{AtFlags, OFlag};
    use nix::sys::stat::{fstatat, Mode, SFlag};
    use std::os::fd::AsRawFd;

    let dir_flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut walked = Walked::default();
    let Ok(root) = Dir::open(work, dir_flags, Mode::empty()) else { return walked };
    let mut stack = vec![(root.into_iter(), String::new(), 0usize)];
    let mut seen = 0usize;
    while let Some((entries, rel, depth)) = stack.last_mut() {
        let entry = match entries.next() {
            Some(Ok(entry)) => entry,
            // The end of the directory, or it cannot be read on: go back up.
            Some(Err(_)) | None => {
                stack.pop();
                continue;
            }
        };
        let name = entry.file_name();
        if name.to_bytes() == b"." || name.to_bytes() == b".." {
            continue;
        }
        seen += 1;
        if seen > MAX_ENTRIES {
            walked.skipped.skip_listed(rel, "walk_limit");
            break;
        }
        let Ok(name_str) = name.to_str() else {
            walked.skipped.skip(&format!("{rel}/{}", name.to_string_lossy()), "unreadable");
            continue;
        };
        // Most names are printable ASCII: checked a byte at a time (`is_ascii` is std's, fast
        // in any build) before the per-character check.
        let bytes = name.to_bytes();
        let plain = bytes.is_ascii() && !bytes.iter().any(u8::is_ascii_control);
        if !plain && name_str.chars().any(unprintable) {
            // A name with control or bidi-override characters: it would reach a terminal
            // (`sandq run` prints artifact paths) and S3 listings (whose XML cannot carry
            // control characters: a dropped attempt's objects were left behind) as it is.
            // Kept in the skip list escaped (test: names_with_control_or_bidi_characters_are_not_collected
            // in tests/hostile.rs).
            let shown = if rel.is_empty() { name_str.escape_debug().to_string() } else { format!("{rel}/{}", name_str.escape_debug()) };
            walked.skipped.skip(&shown, "bad_name");
            continue;
        }
        if rel.len() + 1 + name_str.len() > sandq_schemas::validate::MAX_PATH_BYTES {
            // No name under here could be staged or restored; nothing below is walked, and
            // the long path is not even kept for the skip list.
            walked.skipped.skip(&format!("{}...", truncate(rel, 64)), "bad_name");
            continue;
        }
        let child_rel = if rel.is_empty() { name_str.to_owned() } else { format!("{rel}/{name_str}") };
        let dir_fd = entries.as_raw_fd();
        let Ok(stat) = fstatat(Some(dir_fd), name, AtFlags::AT_SYMLINK_NOFOLLOW) else {
            walked.skipped.skip(&child_rel, "unreadable");
            continue;
        };
        let kind = SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT;
        if kind == SFlag::S_IFLNK {
            walked.skipped.skip(&child_rel, "symlink");
        } else if kind == SFlag::S_IFDIR {
            let child_depth = *depth + 1;
            // Opening a directory costs more than an entry, and reading one that once held a
            // million entries costs getdents over all its emptied blocks: each counts for
            // DIR_COST entries, and one over MAX_DIR_BYTES is not read.
            seen += DIR_COST;
            if child_depth > MAX_DEPTH {
                walked.skipped.skip(&child_rel, "too_deep");
            } else if u64::try_from(stat.st_size).unwrap_or(u64::MAX) > MAX_DIR_BYTES {
                walked.skipped.skip(&child_rel, "too_large");
            } else if let Ok(dir) = Dir::openat(Some(dir_fd), name, dir_flags, Mode::empty()) {
                stack.push((dir.into_iter(), child_rel, child_depth));
            } else {
                walked.skipped.skip(&child_rel, "unreadable");
            }
        } else if kind != SFlag::S_IFREG {
            walked.skipped.skip(&child_rel, "not_regular");
        } else if stat.st_nlink > 1 && !links_ok {
            walked.skipped.skip(&child_rel, "hard_link");
        } else if sandq_schemas::validate::check_relative_path(&child_rel).is_err() {
            // A name no client could stage or restore (backslash...).
            walked.skipped.skip(&child_rel, "bad_name");
        } else {
            let candidate = Candidate {
                size: u64::try_from(stat.st_size).unwrap_or(0),
                dev: stat.st_dev,
                ino: stat.st_ino,
                depth: *depth,
                mtime: (stat.st_mtime, stat.st_mtime_nsec),
                rel: child_rel,
            };
            if baseline.contains(&candidate.rel) {
                walked.at_baseline.push(candidate);
            } else {
                walked.new.push(candidate);
                if walked.new.len() > max_new {
                    if let Some(evicted) = walked.new.pop() {
                        walked.skipped.skip(&evicted.rel, "too_many");
                    }
                }
            }
        }
    }
    walked
}

/// At most `max` bytes of `text`, cut on a character boundary.
fn truncate(text: &str, max: usize) -> &str {
    let mut cut = text.len().min(max);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    &text[..cut]
}

/// MIME type of an artifact from its name (`image/png`, `text/csv`...).
pub(crate) fn content_type(path: &str) -> String {
    mime_guess::from_path(path).first_or_octet_stream().essence_str().to_owned()
}

/// Walks `work` and uploads every new or changed regular file (not in `baseline` with the same
/// content), within the caps. `own_filesystem`: `work` is the job's own filesystem (the SKU
/// has a disk quota), so a hard link can only join two of the job's own files and is
/// collected; on a shared filesystem it could name a host file and is refused.
///
/// # Errors
/// [`CollectError::Upload`] when S3 fails.
#[allow(clippy::too_many_arguments)] // each is one of the walk's inputs; a struct would only rename them
pub(crate) async fn collect(
    job: &ValidJob,
    attempt_id: &str,
    work: &Path,
    baseline: &BTreeMap<String, Baseline>,
    own_filesystem: bool,
    s3: &aws_sdk_s3::Client,
    bucket: &str,
    max_artifacts: usize,
    max_artifact_bytes: u64,
) -> Result<Collected, CollectError> {
    let (root, paths) = (work.to_path_buf(), baseline.keys().cloned().collect::<BTreeSet<_>>());
    let walked = tokio::task::spawn_blocking(move || walk(&root, &paths, own_filesystem, max_artifacts)).await.unwrap_or_default();
    let mut collected = walked.skipped;
    let mut candidates = walked.at_baseline;
    candidates.extend(walked.new.into_sorted_vec());
    candidates.sort();
    let mut budget = max_artifact_bytes;
    for candidate in candidates {
        let skip = |collected: &mut Collected, reason: &str| collected.skip(&candidate.rel, reason);
        // Unchanged only if the size still matches: a staged file the program grew (or made a
        // sparse 16 TB file) is treated like a new one, caps first.
        let staged = baseline.get(candidate.rel.as_str()).filter(|b| b.size == candidate.size);
        if staged.is_none() && collected.artifacts.len() >= max_artifacts {
            skip(&mut collected, "too_many");
            continue;
        }
        if staged.is_none() && candidate.size > budget {
            skip(&mut collected, "too_large");
            continue;
        }
        let path = work.join(&candidate.rel);
        let opened = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC).open(&path);
        let Ok(file) = opened else {
            skip(&mut collected, "unreadable");
            continue;
        };
        let Ok(meta) = file.metadata() else {
            skip(&mut collected, "unreadable");
            continue;
        };
        if !meta.is_file() || meta.dev() != candidate.dev || meta.ino() != candidate.ino || meta.len() != candidate.size {
            skip(&mut collected, "changed");
            continue;
        }
        if let Some(before) = staged.filter(|b| b.stamp == Some(crate::placed::Stamp::of(&meta))) {
            // Placed by staging and not touched since: no need to read it again.
            collected.files.push(WorkFile {
                path: candidate.rel,
                sha256: before.sha256.clone(),
                size: before.size,
                key: before.key.clone(),
            });
            continue;
        }
        let mut file = tokio::fs::File::from_std(file);
        crate::metrics::collect_read(candidate.size);
        let Ok((sha256, size)) = storage::digest_open_file(&mut file).await else {
            skip(&mut collected, "unreadable");
            continue;
        };
        if let Some(before) = staged.filter(|b| b.sha256 == sha256) {
            // An input or session file, unchanged: its content is in S3 already.
            collected.files.push(WorkFile { path: candidate.rel, sha256, size, key: before.key.clone() });
            continue;
        }
        if collected.artifacts.len() >= max_artifacts {
            skip(&mut collected, "too_many");
            continue;
        }
        if size > budget {
            skip(&mut collected, "too_large");
            continue;
        }
        use tokio::io::AsyncSeekExt;
        if file.seek(std::io::SeekFrom::Start(0)).await.is_err() {
            skip(&mut collected, "unreadable");
            continue;
        }
        let key = artifact_key(&job.spec.job_id, attempt_id, &candidate.rel);
        let mime = content_type(&candidate.rel);
        storage::put_file(s3, bucket, &key, file, &candidate.rel, &mime)
            .await
            .map_err(|source| CollectError::Upload { path: candidate.rel.clone(), source })?;
        budget -= size;
        collected.files.push(WorkFile { path: candidate.rel.clone(), sha256: sha256.clone(), size, key: key.clone() });
        collected.artifacts.push(Artifact {
            path: candidate.rel,
            key,
            size,
            sha256,
            content_type: mime,
            url: None,
            url_expires_at_ms: None,
        });
    }
    Ok(collected)
}

/// Whether `c` may not appear in an artifact's name: control characters (C0, DEL, C1); the
/// bidirectional overrides and isolates (U+202A..U+202E, U+2066..U+2069), which reorder what a
/// terminal shows; the invisible directional marks (U+200E, U+200F, U+061C), which move the
/// neutral characters around them; and the line and paragraph separators (U+2028, U+2029),
/// which break a line in JavaScript strings and some terminals and log viewers (an outside
/// review found the marks and separators collected).
fn unprintable(c: char) -> bool {
    c.is_control()
        || ('\u{202a}'..='\u{202e}').contains(&c)
        || ('\u{2066}'..='\u{2069}').contains(&c)
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{061c}' | '\u{2028}' | '\u{2029}')
}

#[cfg(test)]
mod tests {
    use super::unprintable;

    #[test]
    fn names_that_reorder_or_break_lines_are_unprintable() {
        for c in ['\u{1}', '\u{1b}', '\u{7f}', '\u{85}', '\u{202e}', '\u{2067}', '\u{200e}', '\u{200f}', '\u{61c}', '\u{2028}', '\u{2029}']
        {
            assert!(unprintable(c), "{:?}", c);
        }
        // Zero-width joiners and spaces (emoji sequences need them), accents, CJK: kept.
        for c in ['a', 'é', '日', '\u{200d}', '\u{200b}', '😀', ' '] {
            assert!(!unprintable(c), "{:?}", c);
        }
    }
}
