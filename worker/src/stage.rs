//! Step 5, launch (`crate::job`): the job's code, stdin, session files and inputs from S3, placed into its job dir
//! ([`crate::jobdir`]): [`stage`] for a cold start (a new dir), [`fill`] for a warm sandbox's.
//!
//! Files are created with `O_EXCL | O_NOFOLLOW` in a directory nothing else has seen yet, and
//! downloads stop one byte past the declared size. Input objects are content-addressed: one
//! whose bytes provably differ from its name is removed, so that the next upload stores it
//! afresh.

use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use sandq_core::storage::{self, TransferError};
use sandq_schemas::ValidJob;

use crate::jobdir::{open_new, prepare, prepare_error, write_new, JobDir, JobDirError, Shape};
use crate::layout::{CA_BUNDLE, NODE_STDIO, NODE_STDIO_JS, RESOLV_CONF, STATE_IN};
use crate::placed::{Restore, Staged, Stamp};

/// Why staging failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StageError {
    /// The job dir could not be made or written (host trouble: retried).
    #[error(transparent)]
    JobDir(#[from] JobDirError),
    /// The inputs do not fit the SKU's disk quota (the client's fault: rejected).
    #[error("inputs are {bytes} bytes, more than the {quota}-byte disk quota of the SKU")]
    OverQuota {
        /// The inputs' declared sizes together, bytes.
        bytes: u64,
        /// The SKU's `disk_bytes`, bytes.
        quota: u64,
    },
    /// Fetching an input failed: missing object or wrong size/digest (the client's fault,
    /// rejected) or S3 trouble (retried); see [`TransferError::is_transient`].
    #[error("cannot stage input {path:?}: {source}")]
    Download {
        /// The input's path in `/work`.
        path: String,
        /// The transfer error, with the key.
        source: TransferError,
    },
    /// A session file cannot be restored into `/work` (a session written before the gateway
    /// checked paths, or behind its back): the client's fault, rejected on the first attempt
    /// with a reason naming the file and how to remove it, since every attempt would fail alike.
    #[error(
        "the session's file {path:?} cannot be restored into /work ({reason}); delete that file \
         (DELETE /v1/sessions/{{session}}/files/{{path}}) or the session, then run the job again"
    )]
    Unrestorable {
        /// The file's path in the session (clipped to 200 characters).
        path: String,
        /// Why.
        reason: Unrestorable,
    },
    /// The content-addressed object of an input does not hold the bytes its name says (another
    /// client wrote it); `removed` when the worker deleted it, so that the next upload of the
    /// file stores it afresh (the client's job is rejected; test:
    /// a_poisoned_input_object_is_removed_and_uploaded_again in tests/untrusted_state.rs).
    #[error("cannot stage input {path:?}: {source}; {}", if *removed { "the object does not hold the bytes its name says and was removed: submitting the job again uploads the file afresh" } else { "the object does not match the job's declared size and digest" })]
    Mismatched {
        /// The input's path in `/work`.
        path: String,
        /// The size or digest error, with the key.
        source: TransferError,
        /// Whether the object was deleted.
        removed: bool,
    },
}

/// How a session file cannot be restored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unrestorable {
    /// Its path breaks the path rule ([`sandq_schemas::paths::check_session_path`]).
    Path(sandq_schemas::paths::PathError),
    /// Another session file is a directory of it, or it of the other.
    Conflict {
        /// The other file's path.
        other: String,
    },
}

impl std::fmt::Display for Unrestorable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unrestorable::Path(e) => write!(f, "its path is refused: {e}"),
            Unrestorable::Conflict { other } => {
                write!(f, "the session also has {other:?}, and one path cannot be both a file and a directory")
            }
        }
    }
}

impl StageError {
    /// Whether the job, not sandq, is at fault: a missing or corrupt input object (not S3
    /// trouble), one whose bytes differ from its name, or inputs over the SKU's disk quota. The
    /// job is then `rejected`; any other staging error is retried.
    #[must_use]
    pub(crate) fn is_client_fault(&self) -> bool {
        match self {
            StageError::Download { source, .. } => !source.is_transient(),
            StageError::Mismatched { .. } | StageError::OverQuota { .. } | StageError::Unrestorable { .. } => true,
            _ => false,
        }
    }
}

/// Largest content-addressed object the worker reads whole to prove it does not hold the bytes
/// its name says, after a size mismatch (64 MiB): a larger one is left in place.
const MAX_PROOF_BYTES: u64 = 64 << 20;

/// After a size or digest mismatch of the input object `key` (`inputs/sha256/<hex>` or a
/// tenant's `inputs/tenant/<tenant>/sha256/<hex>`, checked
/// by validation to name the job's declared `sha256`): whether it provably holds other bytes
/// than its name says, and so was deleted. A digest mismatch at the declared size proves it; a
/// size mismatch proves nothing alone (the job may declare a wrong size), so the object is
/// hashed whole, up to [`MAX_PROOF_BYTES`].
async fn remove_if_misnamed(s3: &aws_sdk_s3::Client, bucket: &str, key: &str, sha256: &str, error: &TransferError) -> bool {
    // Inputs only: a session's blob is the worker's own (clients cannot write `sessions/`), and
    // a new upload would not bring it back.
    if !sandq_schemas::names::is_input_key(key, sha256) {
        return false;
    }
    let misnamed = match error {
        TransferError::Digest { .. } => true,
        TransferError::Size { .. } => {
            matches!(storage::digest_object(s3, bucket, key, MAX_PROOF_BYTES).await, Ok(Some((found, _))) if found != sha256)
        }
        _ => false,
    };
    if !misnamed {
        return false;
    }
    let removed = storage::delete_keys(s3, bucket, &[key.to_owned()]).await.is_ok();
    tracing::warn!(key, removed, "an input object did not hold the bytes its name says");
    removed
}

/// Creates the job directory for `container_id` and stages code, stdin and inputs (a cold
/// start: [`prepare`] then [`fill`]).
///
/// # Errors
/// [`StageError`]; the partly made directory is removed.
pub(crate) async fn stage(
    job: &ValidJob,
    place: &Placement<'_>,
    s3: &aws_sdk_s3::Client,
    bucket: &str,
) -> Result<(JobDir, Staged), StageError> {
    check_quota(job, place)?;
    let notebook = job.spec.run_mode() == sandq_schemas::RunMode::Notebook;
    // A Node.js script gets the stdio preload alone (the notebook runner's files include it).
    let node_script = !notebook && job.spec.runtime == sandq_schemas::Runtime::Node;
    let shape = Shape {
        jobs_dir: place.jobs_dir,
        container_id: place.container_id,
        sandbox_uid: place.sandbox_uid,
        // Room for the session state to restore besides the quota: the state is on the job's
        // disk (`in/`), and must not take the user's share of it (a warm sandbox has the same).
        disk_bytes: if place.disk_bytes == 0 { 0 } else { place.disk_bytes + place.state_bytes },
        python_site: place.python_site,
        out_bytes: place.outputs_bytes + place.state_bytes,
        src_bytes: place.src_bytes + if node_script { NODE_STDIO_JS.len() } else { 0 },
        runner: notebook.then_some(job.spec.runtime),
        warm: false,
    };
    let dir = prepare(&shape).await?;
    if node_script {
        write_new(&dir.src.join(NODE_STDIO), NODE_STDIO_JS.as_bytes(), 0o644)?;
    }
    // On error `dir` is dropped here, which removes the partly made directory.
    fill(job, &dir, place, s3, bucket).await.map(|staged| (dir, staged))
}

/// Checks that every session file in `restore` can be placed in `/work`: each path by the path
/// rule ([`sandq_schemas::paths::check_session_path`], what the gateway checks on every write),
/// and no file a directory of another (`data` beside `data/x.csv`). Pure: what passes is what
/// [`create_beneath`] creates (test: `every_accepted_session_restores` below).
///
/// # Errors
/// [`StageError::Unrestorable`] naming the first bad file.
pub(crate) fn check_restorable(restore: &[Restore]) -> Result<(), StageError> {
    use sandq_schemas::paths;
    for file in restore {
        if let Err(e) = paths::check_session_path(&file.path) {
            return Err(StageError::Unrestorable { path: paths::clipped(&file.path), reason: Unrestorable::Path(e) });
        }
    }
    if let Some((dir, file)) = paths::first_conflict(restore.iter().map(|r| r.path.as_str())) {
        return Err(StageError::Unrestorable { path: paths::clipped(dir), reason: Unrestorable::Conflict { other: paths::clipped(file) } });
    }
    Ok(())
}

/// Fails when the inputs and restored files alone exceed the `/work` quota.
///
/// # Errors
/// [`StageError::OverQuota`].
pub(crate) fn check_quota(job: &ValidJob, place: &Placement<'_>) -> Result<(), StageError> {
    let input_bytes: u64 = job.spec.inputs.iter().map(|i| i.size).chain(place.restore.iter().map(|r| r.size)).sum();
    if place.disk_bytes != 0 && input_bytes > place.disk_bytes {
        return Err(StageError::OverQuota { bytes: input_bytes, quota: place.disk_bytes });
    }
    Ok(())
}

/// Where and how a job is staged.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Placement<'a> {
    /// This worker's job dirs.
    pub jobs_dir: &'a Path,
    /// The container id (the job dir's name).
    pub container_id: &'a str,
    /// Host uid owning `/work` (the sandbox uid, shifted by the user namespace).
    pub sandbox_uid: u32,
    /// `/work` quota, bytes; 0: none.
    pub disk_bytes: u64,
    /// Size of the outputs tmpfs, bytes.
    pub outputs_bytes: u64,
    /// Session files to restore into `/work` before the inputs (an input of the same path
    /// wins).
    pub restore: &'a [Restore],
    /// For an outbound job: the worker's `resolv.conf`, copied to `src/.resolv.conf`.
    pub resolv_conf: Option<&'a Path>,
    /// For an outbound job: the worker's CA bundle, written to `src/.ca-certificates.crt`.
    pub ca_bundle: Option<&'a [u8]>,
    /// [`Shape::python_site`].
    pub python_site: &'a str,
    /// A session's packages archive ([`crate::session::packages::unpack`]), extracted into
    /// `/sandq/packages` as the sandbox user.
    pub packages: Option<&'a Restore>,
    /// The job's SKU cores: the CPU quota of the cgroup the packages `tar` runs in.
    pub cpus: f64,
    /// A session's notebook state to restore, linked from the worker's copy or downloaded
    /// (size and SHA-256 checked) to `in/state.in` ([`STATE_IN`]); its `path` is not used.
    pub state: Option<&'a Restore>,
    /// Bytes added to the outputs tmpfs for the notebook state the runner saves.
    pub state_bytes: u64,
    /// The worker's cache of saved states: its dir and budget (`sessions.state_cache`).
    pub state_cache: (&'a Path, u64),
    /// Room in `src/` for the job's files (code, `resolv.conf`, a warm start's handover): the
    /// same for every job, so that a cold and a warm start look alike (`mountinfo` shows it).
    pub src_bytes: usize,
}

/// Puts a job into a prepared dir: `resolv.conf`, code, the session's state and files, stdin,
/// inputs. Returns the placed files' stamps, once the clock has passed them ([`settle`]).
///
/// # Errors
/// [`StageError`].
pub(crate) async fn fill(
    job: &ValidJob,
    dir: &JobDir,
    place: &Placement<'_>,
    s3: &aws_sdk_s3::Client,
    bucket: &str,
) -> Result<Staged, StageError> {
    let mut staged = Staged::new();
    let uid = place.sandbox_uid;
    if let Some(path) = place.resolv_conf {
        let bytes = std::fs::read(path).map_err(prepare_error(path))?;
        write_new(&dir.src.join(RESOLV_CONF), &bytes, 0o644)?;
    }
    if let Some(bytes) = place.ca_bundle {
        write_new(&dir.src.join(CA_BUNDLE), bytes, 0o644)?;
    }
    if let Some(code) = &job.spec.code {
        let path = dir.src.join(job.spec.runtime.main_file());
        write_new(&path, code.as_bytes(), 0o644)?;
    }
    if let Some(state) = place.state {
        // In the job disk's `in/` (read-only to the sandbox): never a tmpfs page the worker
        // writes, which its memory would pay for rather than the job's.
        let path = dir.input.join(STATE_IN);
        // A copy of its own (never a link to the worker's copy: a shared inode's link count
        // and times would tell the sandbox about other jobs). From this worker's own copy when
        // it saved the state (the session's last cell ran here), else S3 (size and SHA-256
        // checked).
        let cache = crate::session::cache::StateCache::new(place.state_cache.0.to_path_buf(), place.state_cache.1);
        let mut file = tokio::fs::File::from_std(open_new(&path, 0o644)?);
        if !cache.copy_to(&state.sha256, state.size, &mut file).await {
            file.set_len(0).await.map_err(prepare_error(&path))?;
            tokio::io::AsyncSeekExt::seek(&mut file, std::io::SeekFrom::Start(0)).await.map_err(prepare_error(&path))?;
            storage::get_to_file(s3, bucket, &state.key, &mut file, STATE_IN, Some(state.size), Some(&state.sha256))
                .await
                .map_err(|source| StageError::Download { path: STATE_IN.to_owned(), source })?;
        }
    }
    // An input wins over a session file of the same path, and over one that is a directory
    // prefix of it or has it as one (`data` vs `data/x.csv`): both cannot exist.
    let clashes = |restored: &str| {
        job.spec.inputs.iter().any(|i| {
            let input = i.path.as_str();
            input == restored
                || input.strip_prefix(restored).is_some_and(|rest| rest.starts_with('/'))
                || restored.strip_prefix(input).is_some_and(|rest| rest.starts_with('/'))
        })
    };
    // Checked before anything is placed (the job launched only after `check_restorable`); again
    // here, so that no path the rule refuses is ever joined to `/work`.
    check_restorable(place.restore)?;
    for file in place.restore.iter().filter(|r| !clashes(&r.path)) {
        let stamp = place_file(dir, uid, &file.path, &file.key, file.size, &file.sha256, s3, bucket).await?;
        staged.insert(file.path.clone(), stamp);
    }
    if let Some(bytes) = &job.spec.stdin {
        // The same inode the container may already hold as its stdin (a warm start).
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&dir.stdin)
            .map_err(prepare_error(&dir.stdin))?;
        std::io::Write::write_all(&mut file, bytes).map_err(prepare_error(&dir.stdin))?;
    }
    for input in &job.spec.inputs {
        // Paths were validated: relative, no '.', '..' or empty components.
        let stamp = place_file(dir, uid, &input.path, &input.key, input.size, &input.sha256, s3, bucket).await?;
        staged.insert(input.path.clone(), stamp);
    }
    if let Some(archive) = place.packages {
        // Downloaded next to the job dirs (the worker's, never the sandbox's), handed to tar
        // as its stdin, then removed.
        let path = dir.root.join("packages.tar");
        let mut file = tokio::fs::File::from_std(open_new(&path, 0o600)?);
        let got = storage::get_to_file(s3, bucket, &archive.key, &mut file, "packages", Some(archive.size), Some(&archive.sha256)).await;
        drop(file);
        let unpacked = match got {
            Ok(_) => {
                // What the archive holds is what an earlier job of the session left (a tree it
                // may have broken on purpose, or one past the quota): a job of the session runs
                // with what could be extracted rather than fail on every attempt.
                if let Err(e) = crate::session::packages::unpack(&path, &dir.disk, uid, place.cpus).await {
                    tracing::warn!(error = %e, "the session's packages were not all restored");
                }
                Ok(())
            }
            Err(source) => Err(StageError::Download { path: "packages".to_owned(), source }),
        };
        let _ = std::fs::remove_file(&path);
        unpacked?;
    }
    settle(&staged).await;
    Ok(staged)
}

/// Waits until the kernel's coarse clock, which file timestamps come from (at most one tick:
/// 1-10 ms, and usually no wait, downloads being slower), has passed every staged file's ctime,
/// so that a change the program makes cannot get the ctime staging left.
async fn settle(staged: &Staged) {
    let Some(latest) = staged.values().map(|s| s.ctime_ns).max() else { return };
    for _ in 0..100 {
        if crate::sys::coarse_realtime_ns() > latest {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// Downloads `key` to `/work/<rel>` (parents made as needed, owned by `uid`), checking size
/// and digest. Returns the placed file's [`Stamp`].
#[allow(clippy::too_many_arguments)]
async fn place_file(
    dir: &JobDir,
    uid: u32,
    rel: &str,
    key: &str,
    size: u64,
    sha256: &str,
    s3: &aws_sdk_s3::Client,
    bucket: &str,
) -> Result<Stamp, StageError> {
    let dest = dir.work.join(rel);
    let file = create_beneath(&dir.work, rel, Some(uid))?;
    let mut file = tokio::fs::File::from_std(file);
    match storage::get_to_file(s3, bucket, key, &mut file, rel, Some(size), Some(sha256)).await {
        Ok(_) => {}
        Err(source @ (TransferError::Size { .. } | TransferError::Digest { .. })) => {
            let removed = remove_if_misnamed(s3, bucket, key, sha256, &source).await;
            return Err(StageError::Mismatched { path: rel.to_owned(), source, removed });
        }
        Err(source) => return Err(StageError::Download { path: rel.to_owned(), source }),
    }
    std::os::unix::fs::chown(&dest, Some(uid), Some(uid)).map_err(prepare_error(&dest))?;
    let meta = file.metadata().await.map_err(prepare_error(&dest))?;
    Ok(Stamp::of(&meta))
}

/// Creates the new file `<work>/<rel>` (mode 0644, `O_EXCL | O_NOFOLLOW`) and its missing
/// parents (0755, given to `uid` when set). `rel` passed the path rule.
///
/// # Errors
/// [`JobDirError::Prepare`] naming the directory or file that could not be made.
fn create_beneath(work: &Path, rel: &str, uid: Option<u32>) -> Result<std::fs::File, JobDirError> {
    let mut parent = work.to_path_buf();
    let components: Vec<&str> = rel.split('/').collect();
    for component in &components[..components.len() - 1] {
        parent.push(component);
        match std::fs::DirBuilder::new().mode(0o755).create(&parent) {
            Ok(()) => {
                if let Some(uid) = uid {
                    std::os::unix::fs::chown(&parent, Some(uid), Some(uid)).map_err(prepare_error(&parent))?;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(JobDirError::Prepare { path: parent.clone(), source: e }),
        }
    }
    open_new(&work.join(rel), 0o644)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn restore(paths: &[&str]) -> Vec<Restore> {
        paths.iter().map(|p| Restore { path: (*p).to_owned(), key: String::new(), size: 0, sha256: String::new() }).collect()
    }

    #[test]
    fn sessions_that_cannot_be_restored_are_named() {
        let long = "x".repeat(256);
        for (paths, bad) in [
            (vec!["a\\b"], "a\\b"),
            (vec!["ok", long.as_str()], long.as_str()),
            (vec!["data", "data/x.csv"], "data"),
            (vec!["a/b/c", "z", "a/b"], "a/b"),
        ] {
            let err = check_restorable(&restore(&paths)).expect_err(bad);
            assert!(err.is_client_fault(), "{err}");
            assert!(matches!(&err, StageError::Unrestorable { path, .. } if *path == sandq_schemas::paths::clipped(bad)), "{err}");
            assert!(err.to_string().contains("DELETE /v1/sessions/"), "{err}");
        }
        check_restorable(&restore(&["data/x.csv", "data/y.csv", "data2", "d"])).expect("restorable");
    }

    proptest! {
        /// Every session the rule accepts (each path, and no conflict), the worker's restore
        /// accepts and places: each file created beneath `/work` on a real file system.
        #[test]
        fn every_accepted_session_restores(paths in proptest::collection::btree_set("([a-c.\\\\]{1,3}|x{250,256})(/([a-c.]{1,3}|x{250,256})){0,3}", 1..6)) {
            let paths: Vec<&str> = paths.iter().map(String::as_str).collect();
            let accepted = paths.iter().all(|p| sandq_schemas::paths::check_session_path(p).is_ok())
                && sandq_schemas::paths::first_conflict(paths.iter().copied()).is_none();
            let checked = check_restorable(&restore(&paths));
            prop_assert_eq!(accepted, checked.is_ok(), "{:?}", checked.err());
            if accepted {
                let work = tempfile::tempdir().expect("tempdir");
                for path in &paths {
                    create_beneath(work.path(), path, None).map_err(|e| TestCaseError::fail(format!("{path:?}: {e}")))?;
                    prop_assert!(work.path().join(path).is_file());
                }
            }
        }
    }
}
