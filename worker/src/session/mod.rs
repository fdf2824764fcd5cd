//! Sessions in the job lifecycle: open (lock, load, expire) before [`crate::stage`], save
//! after [`crate::artifacts`], close (unlock) at the end; and the reaper of expired sessions.
//! Storage layout and locking: [`sandq_core::sessions`]; the packages archive: [`packages`];
//! the reaper: [`reaper`].

pub(crate) mod cache;
pub(crate) mod packages;
mod reaper;

pub(crate) use reaper::reaper;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use sandq_core::sessions::{self, FileEntry, Manifest, SessionError};
use sandq_core::storage;
use sandq_core::time::now_ms;
use sandq_schemas::{SessionInfo, SessionState, UnsavedVariable, ValidJob};

use crate::artifacts::{Baseline, WorkFile};
use crate::context::Context;
use crate::placed::Restore;

/// Lease of a session lock, renewed every third of it while the job holds the lock: a crashed
/// worker's lock frees itself within this, and the redelivered job then takes it. The holder
/// is the attempt id, unique per processing, so that a duplicate delivery of a running job
/// waits for it instead of sharing the session (test:
/// a_duplicate_of_a_running_session_job_does_not_reject_it in tests/delivery.rs).
pub(crate) const LOCK_LEASE: Duration = Duration::from_secs(30);

/// A session opened for one job (its lock held).
#[derive(Debug, Clone)]
pub(crate) struct Opened {
    /// The session's name.
    pub name: String,
    /// Its state before the job (empty when fresh).
    pub manifest: Manifest,
    /// Started empty.
    pub fresh: bool,
    /// Started empty because the session had expired.
    pub expired: bool,
    /// Who holds the lock: the attempt id of the job's processing.
    pub holder: String,
}

impl Opened {
    /// The notebook state to restore (the previous notebook job's of `context`, `None` the
    /// session's default), if there is one.
    pub(crate) fn state(&self, ctx: &Context, context: Option<&str>) -> Option<Restore> {
        self.manifest.context(context).0.map(|f| Restore {
            path: crate::layout::STATE_IN.to_owned(),
            key: ctx.settings.names.session_blob_key(&self.name, &f.sha256),
            size: f.size,
            sha256: f.sha256.clone(),
        })
    }

    /// The packages archive to extract into `/sandq/packages`, if a job of the session left one.
    pub(crate) fn packages(&self, ctx: &Context) -> Option<Restore> {
        self.manifest.packages.as_ref().map(|f| Restore {
            path: crate::layout::PACKAGES_MOUNT_POINT.to_owned(),
            key: ctx.settings.names.session_blob_key(&self.name, &f.sha256),
            size: f.size,
            sha256: f.sha256.clone(),
        })
    }

    /// The files to restore into `/work`.
    pub(crate) fn restore(&self, ctx: &Context) -> Vec<Restore> {
        self.manifest
            .files
            .iter()
            .map(|(path, f)| Restore {
                path: path.clone(),
                key: ctx.settings.names.session_blob_key(&self.name, &f.sha256),
                size: f.size,
                sha256: f.sha256.clone(),
            })
            .collect()
    }

    /// What was in `/work` before the program ran: restored files, then inputs (which win), with
    /// the stamps staging recorded.
    pub(crate) fn baseline(restore: &[Restore], job: &ValidJob, staged: &crate::placed::Staged) -> BTreeMap<String, Baseline> {
        let entry = |path: &str, sha256: &str, size: u64, key: &str| Baseline {
            sha256: sha256.to_owned(),
            size,
            key: key.to_owned(),
            stamp: staged.get(path).copied(),
        };
        let mut baseline: BTreeMap<String, Baseline> =
            restore.iter().map(|r| (r.path.clone(), entry(&r.path, &r.sha256, r.size, &r.key))).collect();
        for input in &job.spec.inputs {
            baseline.insert(input.path.clone(), entry(&input.path, &input.sha256, input.size, &input.key));
        }
        baseline
    }
}

/// Takes the session's lock (waiting up to `sessions.lock_wait` for another job of it), loads
/// its manifest, and deletes it first if it has expired.
///
/// # Errors
/// [`SessionError::Busy`] when the wait ran out; storage and Redis errors.
pub(crate) async fn open(ctx: &Context, name: &str, holder: &str) -> Result<Opened, SessionError> {
    let settings = &ctx.settings;
    let (names, bucket) = (&settings.names, &settings.services.s3.bucket);
    let mut redis = ctx.redis.clone();
    sessions::lock(&mut redis, names, name, holder, LOCK_LEASE, settings.sessions.lock_wait).await?;
    let opened = async {
        let mut expired = sessions::take_expired_mark(&mut redis, names, name).await?;
        let loaded = match sessions::load(&ctx.s3, bucket, names, name).await {
            // Malformed or oversized (written by an older or differently configured worker):
            // unusable; the session starts afresh rather than failing every job.
            Err(e @ (SessionError::Manifest { .. } | SessionError::Storage(sandq_core::storage::TransferError::Size { .. }))) => {
                tracing::warn!(session = name, error = %e, "unusable session manifest; starting the session afresh");
                sessions::delete(&ctx.s3, bucket, &mut redis, names, name).await?;
                None
            }
            other => other?,
        };
        let manifest = match loaded {
            Some(m) if m.expires_at_ms <= now_ms() => {
                sessions::delete(&ctx.s3, bucket, &mut redis, names, name).await?;
                expired = true;
                None
            }
            other => other,
        };
        let fresh = manifest.is_none();
        Ok(Opened { name: name.to_owned(), manifest: manifest.unwrap_or_default(), fresh, expired, holder: holder.to_owned() })
    }
    .await;
    if opened.is_err() {
        close(ctx, name, holder).await;
    }
    opened
}

/// Most bytes of the runner's state report read.
const MAX_STATE_REPORT_BYTES: u64 = 256 << 10;

/// The notebook state a job left in its outputs tmpfs.
#[derive(Debug, Default)]
pub(crate) struct LeftState {
    /// The new state file (open), its SHA-256 and size; `None`: nothing new to save (the job
    /// did not end by itself, or the runner saved nothing), the previous state stays.
    pub file: Option<(tokio::fs::File, String, u64)>,
    /// What the runner reported, bounded.
    pub report: SessionState,
}

/// What the runner writes to `state.json` (untrusted: bounded on read, clipped after).
#[derive(Debug, Default, serde::Deserialize)]
struct RunnerReport {
    #[serde(default)]
    restored: u64,
    #[serde(default)]
    not_restored: Vec<UnsavedVariable>,
    #[serde(default)]
    variables: Vec<String>,
    #[serde(default)]
    unsaved: Vec<UnsavedVariable>,
    #[serde(default)]
    save_ms: u64,
    #[serde(default)]
    restore_ms: u64,
    /// The cell left the state byte for byte as restored and wrote no new one (a claim the
    /// sandbox can only use to keep its own session's previous state).
    #[serde(default)]
    unchanged: bool,
}

fn clip(text: &mut String, max: usize) {
    if text.len() > max {
        let mut cut = max;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
}

/// Opens `path` for reading without following a symlink or blocking on a FIFO, if it is a
/// regular file of at most `max` bytes.
fn open_regular(path: &Path, max: u64) -> Option<(std::fs::File, u64)> {
    use std::os::unix::fs::OpenOptionsExt;
    let file =
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC).open(path).ok()?;
    let meta = file.metadata().ok()?;
    (meta.is_file() && meta.len() <= max).then_some((file, meta.len()))
}

/// Reads the state a notebook job left in `out` (its outputs tmpfs; everything there was
/// written by the sandbox): the report, and the new state when the job `ended_by_itself` (an
/// exit, not a timeout, OOM kill or cancel) and it is a regular file of at most `max_bytes`.
/// The state itself is only hashed here, never parsed: it is loaded only inside a sandbox of
/// the same session. A runner that reports the state `unchanged` (and leaves no new one) keeps
/// the state it restored, of `restored_bytes`: saved, with nothing to hash or store.
pub(crate) async fn read_state(out: &Path, max_bytes: u64, ended_by_itself: bool, restored_bytes: Option<u64>) -> LeftState {
    let mut left = LeftState::default();
    let mut unchanged = false;
    if let Some((file, len)) = open_regular(&out.join(crate::layout::STATE_REPORT), MAX_STATE_REPORT_BYTES) {
        use std::io::Read;
        let mut bytes = Vec::with_capacity(len as usize);
        if file.take(MAX_STATE_REPORT_BYTES).read_to_end(&mut bytes).is_ok() {
            let report: RunnerReport = serde_json::from_slice(&bytes).unwrap_or_default();
            let listed = |mut list: Vec<UnsavedVariable>| {
                list.truncate(100);
                for v in &mut list {
                    clip(&mut v.name, 200);
                    clip(&mut v.reason, 200);
                }
                list
            };
            left.report.restored = report.restored;
            left.report.not_restored = listed(report.not_restored);
            left.report.unsaved = listed(report.unsaved);
            left.report.variables = report.variables;
            left.report.variables.truncate(1000);
            for name in &mut left.report.variables {
                clip(name, 200);
            }
            left.report.save_ms = report.save_ms;
            left.report.restore_ms = report.restore_ms;
            unchanged = report.unchanged;
        }
    }
    if ended_by_itself {
        if let Some((file, size)) = open_regular(&out.join(crate::layout::STATE_OUT), max_bytes) {
            let mut file = tokio::fs::File::from_std(file);
            if let Ok((sha256, hashed)) = storage::digest_open_file(&mut file).await {
                use tokio::io::AsyncSeekExt;
                if hashed == size && file.seek(std::io::SeekFrom::Start(0)).await.is_ok() {
                    left.report.saved = true;
                    left.report.bytes = size;
                    left.file = Some((file, sha256, size));
                }
            }
        } else if let Some(bytes) = restored_bytes.filter(|_| unchanged) {
            left.report.saved = true;
            left.report.bytes = bytes;
        }
    }
    if !left.report.saved {
        left.report.variables.clear();
        left.report.unsaved.clear();
        left.report.save_ms = 0;
    }
    left
}

/// An archive of a job's `/sandq/packages` ([`left_packages`]): the open file, its SHA-256
/// and size; `Some(None)`: the job left no packages; `None`: not archived.
pub(crate) type LeftPackages = Option<Option<(tokio::fs::File, String, u64)>>;

/// What a job left besides its files, for [`save`].
#[derive(Debug, Default)]
pub(crate) struct Left {
    /// A notebook job's state.
    pub state: Option<LeftState>,
    /// The packages it left.
    pub packages: LeftPackages,
}

/// Archives the packages a session job left in `/sandq/packages` ([`packages::pack`],
/// as `sandbox_uid`, at most `worker.max_artifact_bytes`, in a cgroup of the job's `cpus`), for [`save`]: `Some(None)` when
/// it holds no file (nothing to keep), `None` when it cannot be archived (logged; the
/// session keeps its previous packages).
pub(crate) async fn left_packages(ctx: &Context, dir: &crate::jobdir::JobDir, sandbox_uid: u32, cpus: f64) -> LeftPackages {
    let packages = dir.packages.clone();
    if !tokio::task::spawn_blocking(move || packages::holds_files(&packages)).await.unwrap_or(true) {
        return Some(None);
    }
    let archive = dir.root.join("packages.out.tar");
    match packages::pack(&dir.disk, &archive, sandbox_uid, ctx.settings.outputs.max_artifact_bytes, cpus).await {
        Ok(true) => {}
        Ok(false) => return Some(None),
        Err(e) => {
            tracing::warn!(error = %e, "cannot archive the session's packages; the session keeps its previous ones");
            return None;
        }
    }
    let opened = tokio::fs::File::open(&archive).await;
    // The open file stays readable once unlinked; the job dir goes anyway.
    let _ = std::fs::remove_file(&archive);
    let mut file = opened.ok()?;
    let (sha256, size) = storage::digest_open_file(&mut file).await.ok()?;
    use tokio::io::AsyncSeekExt;
    file.seek(std::io::SeekFrom::Start(0)).await.ok()?;
    Some(Some((file, sha256, size)))
}

/// Saves the files now in `/work` as the session's new state: blobs for new content
/// (server-side copies of the artifacts just uploaded, or of the inputs), the manifest, and
/// deletion of blobs nothing refers to any more. `left_out`: files in `/work` the artifact
/// walk did not collect (its `skipped_total`), which the session does not keep either and
/// reports in `unsaved_files` rather than dropping them unsaid. For a notebook job, `cell` is its
/// `execution_count` and `state` the notebook state it left (stored as a blob; without a new
/// one the previous state stays), both in `left`, with the archive of `/sandq/packages`
/// ([`packages::pack`]): `Some(Some(..))` a new one, `Some(None)` none left (the job
/// left no packages), `None` unknown (not archived: the previous one stays).
///
/// # Errors
/// Storage and Redis errors.
pub(crate) async fn save(
    ctx: &Context,
    job: &ValidJob,
    opened: &Opened,
    files: &[WorkFile],
    left_out: u64,
    cell: Option<u64>,
    left: Left,
) -> Result<SessionInfo, SessionError> {
    let Left { state, packages } = left;
    let settings = &ctx.settings;
    let (names, bucket, name) = (&settings.names, &settings.services.s3.bucket, opened.name.as_str());
    let old_blobs: BTreeSet<&str> = opened
        .manifest
        .files
        .values()
        .chain(opened.manifest.states())
        .chain(opened.manifest.packages.as_ref())
        .map(|f| f.sha256.as_str())
        .collect();
    let mut new_blobs = BTreeSet::new();
    let context = job.spec.context.as_deref();
    let mut state_entry = opened.manifest.context(context).0.cloned();
    let mut state_report = None;
    if let Some(left) = state {
        if let Some((mut file, sha256, size)) = left.file {
            // The next cell on this worker restores it from here, not from S3.
            let (dir, budget) = &settings.sessions.state_cache;
            cache::StateCache::new(dir.clone(), *budget).keep(&mut file, &sha256, size).await;
            if !old_blobs.contains(sha256.as_str()) {
                let blob = names.session_blob_key(name, &sha256);
                storage::put_file(&ctx.s3, bucket, &blob, file, "state", "application/octet-stream").await?;
            }
            state_entry = Some(FileEntry { sha256, size });
        }
        state_report = Some(left.report);
    }
    // The cell's context gets the new state and count; the other contexts keep theirs (the
    // least recently used one dropped when a new one would pass MAX_CONTEXTS).
    let now = now_ms();
    let mut default_state = opened.manifest.state.clone();
    let mut default_count = opened.manifest.execution_count;
    let mut contexts = opened.manifest.contexts.clone();
    match context {
        None => {
            default_state = state_entry;
            default_count = cell.unwrap_or(default_count);
        }
        Some(name) => {
            if !contexts.contains_key(name) && contexts.len() >= sessions::MAX_CONTEXTS {
                if let Some(oldest) = contexts.iter().min_by_key(|(_, c)| c.used_at_ms).map(|(n, _)| n.clone()) {
                    contexts.remove(&oldest);
                }
            }
            let slot = contexts.entry(name.to_owned()).or_default();
            slot.state = state_entry;
            slot.execution_count = cell.unwrap_or(slot.execution_count);
            slot.used_at_ms = now;
        }
    }
    for entry in default_state.iter().chain(contexts.values().filter_map(|c| c.state.as_ref())) {
        new_blobs.insert(entry.sha256.clone());
    }
    let packages_entry = match packages {
        None => opened.manifest.packages.clone(),
        Some(None) => None,
        Some(Some((file, sha256, size))) => {
            if !old_blobs.contains(sha256.as_str()) {
                let blob = names.session_blob_key(name, &sha256);
                storage::put_file(&ctx.s3, bucket, &blob, file, "packages", "application/x-tar").await?;
            }
            Some(FileEntry { sha256, size })
        }
    };
    if let Some(entry) = &packages_entry {
        new_blobs.insert(entry.sha256.clone());
    }
    let mut saved = 0;
    let mut unsaved = left_out;
    let mut manifest_files = BTreeMap::new();
    let mut bytes = 0u64;
    // `files` come from the artifact walk of a real file system, which keeps only paths the
    // path rule accepts (crate::artifacts) and cannot hold a file beside a directory of its
    // name: what a job saves, the next job restores (crate::stage::check_restorable).
    for file in files {
        // The whole session within the artifact caps (restored, unchanged files included), so
        // that it cannot grow job after job.
        if manifest_files.len() >= settings.outputs.max_artifacts || bytes + file.size > settings.outputs.max_artifact_bytes {
            unsaved += 1;
            continue;
        }
        bytes += file.size;
        let blob = names.session_blob_key(name, &file.sha256);
        if !old_blobs.contains(file.sha256.as_str()) && !new_blobs.contains(&file.sha256) && file.key != blob {
            storage::copy(&ctx.s3, bucket, &file.key, &blob).await?;
        }
        if opened.manifest.files.get(&file.path).is_none_or(|f| f.sha256 != file.sha256) {
            saved += 1;
        }
        new_blobs.insert(file.sha256.clone());
        manifest_files.insert(file.path.clone(), FileEntry { sha256: file.sha256.clone(), size: file.size });
    }
    let deleted = opened.manifest.files.keys().filter(|p| !manifest_files.contains_key(*p)).count() as u64;
    let manifest = Manifest {
        files: manifest_files,
        created_at_ms: if opened.fresh { now } else { opened.manifest.created_at_ms },
        updated_at_ms: now,
        expires_at_ms: now + settings.sessions.idle_timeout.as_millis() as u64,
        last_job_id: job.spec.job_id.clone(),
        state: default_state,
        packages: packages_entry,
        execution_count: default_count,
        contexts,
    };
    let mut redis = ctx.redis.clone();
    // Fencing, as far as a lease goes: a job that lost the session (its lease ran out and
    // another job or the reaper took it) must not overwrite the manifest or delete blobs.
    if !sessions::renew(&mut redis, names, name, &opened.holder, LOCK_LEASE).await? {
        return Err(SessionError::Busy { name: name.to_owned() });
    }
    if let sessions::IndexUpdate::Failed(e) = sessions::store(&ctx.s3, bucket, &mut redis, names, name, &manifest).await? {
        // Advisory: the manifest is stored; the reaper's rebuild indexes the session again.
        tracing::warn!(session = name, error = %e, "session saved, but its expiry is not indexed (the reaper's rebuild will)");
        crate::metrics::session_index("update_failed");
    }
    // After the manifest: a blob is deleted only once no manifest refers to it.
    let unreferenced: Vec<String> =
        old_blobs.iter().filter(|sha| !new_blobs.contains(**sha)).map(|sha| names.session_blob_key(name, sha)).collect();
    storage::delete_keys(&ctx.s3, bucket, &unreferenced).await?;
    Ok(SessionInfo {
        name: name.to_owned(),
        fresh: opened.fresh,
        expired: opened.expired,
        restored_files: opened.manifest.files.len() as u64,
        saved_files: saved,
        deleted_files: deleted,
        files: manifest.files.len() as u64,
        bytes: manifest.bytes(),
        unsaved_files: unsaved,
        expires_at_ms: manifest.expires_at_ms,
        state: state_report,
    })
}

/// The session as it stands when the job did not save it (cancelled): unchanged.
pub(crate) fn unchanged(opened: &Opened) -> SessionInfo {
    SessionInfo {
        name: opened.name.clone(),
        fresh: opened.fresh,
        expired: opened.expired,
        restored_files: opened.manifest.files.len() as u64,
        saved_files: 0,
        deleted_files: 0,
        files: opened.manifest.files.len() as u64,
        bytes: opened.manifest.bytes(),
        unsaved_files: 0,
        expires_at_ms: opened.manifest.expires_at_ms,
        state: None,
    }
}

/// Keeps the session's lock while the job runs: renews its lease every third of it. Never
/// returns; dropped when the job ends.
pub(crate) async fn keep(ctx: &Context, name: &str, holder: &str) {
    let mut redis = ctx.redis.clone();
    loop {
        tokio::time::sleep(LOCK_LEASE / 3).await;
        match sessions::renew(&mut redis, &ctx.settings.names, name, holder, LOCK_LEASE).await {
            Ok(true) => {}
            Ok(false) => tracing::warn!(session = name, "session lock lost (lease ran out); another job may use the session"),
            Err(e) => tracing::warn!(session = name, error = %e, "cannot renew session lock"),
        }
    }
}

/// Releases the session's lock (logged, not returned, on failure: the lease frees it).
pub(crate) async fn close(ctx: &Context, name: &str, holder: &str) {
    let mut redis = ctx.redis.clone();
    if let Err(e) = sessions::unlock(&mut redis, &ctx.settings.names, name, holder).await {
        tracing::warn!(session = name, error = %e, "cannot release session lock; its lease will");
    }
}
