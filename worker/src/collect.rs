//! Stage 5: upload the files the program created or changed under `/work` as artifacts.
//!
//! Runs after every process of the job is dead, so nothing changes under the walk. Still,
//! everything in `/work` was written by hostile code: symlinks are never followed (skipped),
//! hard links (link count > 1) are refused (the program could have linked a host file it can
//! read into `/work`), FIFOs, sockets and devices are skipped without opening them, files are
//! opened `O_NOFOLLOW | O_NONBLOCK` and re-checked with `fstat`, and the count and size caps are
//! applied from the metadata before a byte is read (a sparse 1 TB file is never read).

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use sandq_schemas::names::artifact_key;
use sandq_schemas::{Artifact, SkippedArtifact, ValidJob};

use sandq_submitter::storage::{self, TransferError};

/// Deepest directory level walked under `/work`.
const MAX_DEPTH: usize = 32;
/// Most directory entries looked at, in all; past it the walk stops and says so.
const MAX_ENTRIES: usize = 250_000;
/// Most skipped files listed by name in the result (all are counted): keeps the Redis value
/// small when a program leaves 200,000 files.
pub const MAX_SKIPPED_LISTED: usize = 100;

/// The artifacts of a job.
#[derive(Debug, Clone, Default)]
pub struct Collected {
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
pub struct WorkFile {
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
pub struct Baseline {
    /// SHA-256, hex.
    pub sha256: String,
    /// Size, bytes: a file of another size changed, and is capped like a new file before a
    /// byte of it is read.
    pub size: u64,
    /// S3 key of the content.
    pub key: String,
}

impl Collected {
    fn skip(&mut self, path: &str, reason: &str) {
        self.skipped_total += 1;
        if self.skipped.len() < MAX_SKIPPED_LISTED {
            self.skipped.push(SkippedArtifact { path: path.to_owned(), reason: reason.to_owned() });
        }
    }
}

/// Why collection failed (S3 or local I/O trouble: retried).
#[derive(Debug, thiserror::Error)]
pub enum CollectError {
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
struct Candidate {
    rel: String,
    size: u64,
    dev: u64,
    ino: u64,
}

fn walk(dir: &Path, rel: &str, depth: usize, seen: &mut usize, out: &mut Vec<Candidate>, skipped: &mut Collected, links_ok: bool) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<_> = entries.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        *seen += 1;
        if *seen == MAX_ENTRIES + 1 {
            skipped.skip(rel, "walk_limit");
        }
        if *seen > MAX_ENTRIES {
            return;
        }
        let name = entry.file_name().to_string_lossy().into_owned();
        let child_rel = if rel.is_empty() { name } else { format!("{rel}/{name}") };
        let skip = |skipped: &mut Collected, reason: &str| skipped.skip(&child_rel, reason);
        // symlink_metadata: lstat, never follows.
        let Ok(meta) = std::fs::symlink_metadata(entry.path()) else {
            skip(skipped, "unreadable");
            continue;
        };
        let kind = meta.file_type();
        if kind.is_symlink() {
            skip(skipped, "symlink");
        } else if kind.is_dir() {
            if depth < MAX_DEPTH {
                walk(&entry.path(), &child_rel, depth + 1, seen, out, skipped, links_ok);
            } else {
                skip(skipped, "too_deep");
            }
        } else if !kind.is_file() {
            skip(skipped, "not_regular");
        } else if meta.nlink() > 1 && !links_ok {
            skip(skipped, "hard_link");
        } else {
            out.push(Candidate { rel: child_rel, size: meta.len(), dev: meta.dev(), ino: meta.ino() });
        }
    }
}

/// MIME type of an artifact from its name (`image/png`, `text/csv`...).
pub fn content_type(path: &str) -> String {
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
pub async fn collect(
    job: &ValidJob,
    work: &Path,
    baseline: &BTreeMap<String, Baseline>,
    own_filesystem: bool,
    s3: &aws_sdk_s3::Client,
    bucket: &str,
    max_artifacts: usize,
    max_artifact_bytes: u64,
) -> Result<Collected, CollectError> {
    let mut candidates = Vec::new();
    let mut collected = Collected::default();
    let mut seen = 0;
    walk(work, "", 0, &mut seen, &mut candidates, &mut collected, own_filesystem);
    let mut budget = max_artifact_bytes;
    for candidate in candidates {
        let skip = |collected: &mut Collected, reason: &str| collected.skip(&candidate.rel, reason);
        // Unchanged only if the size still matches: a staged file the program grew (or made a
        // sparse 16 TB file) is treated like a new one, caps first.
        let staged = baseline.get(candidate.rel.as_str()).filter(|b| b.size == candidate.size);
        if sandq_schemas::validate::check_relative_path(&candidate.rel).is_err() {
            // A name no client could stage or restore (backslash, over 1,024 bytes...).
            skip(&mut collected, "bad_name");
            continue;
        }
        if staged.is_none() && collected.artifacts.len() >= max_artifacts {
            skip(&mut collected, "too_many");
            continue;
        }
        if staged.is_none() && candidate.size > budget {
            skip(&mut collected, "too_large");
            continue;
        }
        let path = work.join(&candidate.rel);
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&path);
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
        let mut file = tokio::fs::File::from_std(file);
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
        let key = artifact_key(&job.spec.job_id, &candidate.rel);
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
