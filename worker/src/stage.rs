//! Stage 3: a fresh per-job directory with the source code and the inputs from S3.
//!
//! ```text
//! <jobs_dir>/<container id>/     0711 root
//!   bundle/config.json           the OCI runtime config
//!   src/                         tmpfs (just large enough), mounted read-only at /sandq:
//!     main.py                    the source code (or main.js), the notebook runner's files
//!                                (sandq_runner.py and sandq_mpl.py, or sandq_runner.js),
//!     .resolv.conf               for an outbound job, bind-mounted at /etc/resolv.conf
//!     .loadavg                   bind-mounted at /proc/loadavg ([`LOADAVG`])
//!     .hostname                  bind-mounted at /etc/hostname ([`HOSTNAME`])
//!     .resolv.none               bind-mounted at /etc/resolv.conf when the job has no network
//!     .ca-certificates.crt       for an outbound job with `worker.extra_ca_certs`,
//!                                bind-mounted over /etc/ssl/certs/ca-certificates.crt
//!     out/                       the mount point of out/ below
//!     packages/                  the mount point of disk/packages below
//!   disk/                        the job's disk: its filesystem when the SKU has a quota
//!     work/                      mounted read-write at /work, owned by the sandbox uid
//!     packages/                  mounted read-write at /sandq/packages, owned by the sandbox
//!                                uid: run-time installs (crate::packages), with an empty
//!                                python/lib/python3.X/site-packages made for Python; a
//!                                session's packages are extracted here
//!   packages.tar                 while a session's packages archive is extracted or made
//!   work.img                     the disk's filesystem, when the SKU has a disk quota
//!   out/                         tmpfs (`max_outputs_bytes`), mounted at /sandq/out: the
//!                                notebook runner's outputs.jsonl
//!   stdin                        fed to the program's stdin
//!   report.json                  the helper's SandboxReport
//! ```
//!
//! Files are created with `O_EXCL | O_NOFOLLOW` in a directory nothing else has seen yet, and
//! downloads stop one byte past the declared size.
//!
//! With a disk quota, `disk/` is the mount point of a per-job ext4 filesystem in a sparse file
//! (`work.img`, the SKU's `disk_bytes` large, loop-mounted `nosuid,nodev`): the program gets
//! ENOSPC at the quota, and the host's disk holds only what was written. Copying a template and
//! mounting it costs about 30 ms a job (cp 5 ms, mount 23 ms, measured on this machine).

use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use sandq_schemas::ValidJob;
use sandq_submitter::storage::{self, TransferError};

/// The directories and files of one job on the host. Dropping it unmounts and removes the
/// directory, so that a job task aborted mid-run (the broker connection lost) leaks nothing.
#[derive(Debug)]
pub struct JobDir {
    /// `<jobs_dir>/<container id>`.
    pub root: PathBuf,
    /// The OCI bundle.
    pub bundle: PathBuf,
    /// Mounted at `/sandq`.
    pub src: PathBuf,
    /// The job's disk: the mount point of its filesystem when the SKU has a disk quota (else a
    /// plain directory), holding `work/` and `packages/`.
    pub disk: PathBuf,
    /// `<disk>/work`, mounted at `/work`.
    pub work: PathBuf,
    /// `<disk>/packages`, mounted at `/sandq/packages` ([`crate::packages`]).
    pub packages: PathBuf,
    /// Program's stdin: a file, empty unless the job has stdin.
    pub stdin: PathBuf,
    /// Helper's report.
    pub report: PathBuf,
    /// The outputs tmpfs, mounted at `/sandq/out` (notebook mode's `outputs.jsonl`).
    pub out: PathBuf,
    /// A pidfd of the `sandq-container` helper while it runs on this dir (see
    /// [`JobDir::helper_started`]).
    helper: std::sync::Mutex<Option<std::os::fd::OwnedFd>>,
}

/// How long a dropped [`JobDir`] waits for a still-running helper (which, its control pipe
/// closed, kills, reaps and deletes the container, then writes its report) before removing the
/// directory anyway. The helper needs well under a second for that; the startup cleanup of the
/// next worker run removes whatever is still left.
const HELPER_EXIT_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

impl JobDir {
    /// Records that a helper (pidfd `pidfd`) now works on this dir, so that dropping the dir
    /// while it runs (the job task aborted) waits for it to finish before removing anything:
    /// otherwise the helper's last writes race the removal and leave a directory behind.
    pub fn helper_started(&self, pidfd: std::os::fd::OwnedFd) {
        if let Ok(mut slot) = self.helper.lock() {
            *slot = Some(pidfd);
        }
    }

    /// Records that the helper has exited (its status was collected).
    pub fn helper_exited(&self) {
        if let Ok(mut slot) = self.helper.lock() {
            *slot = None;
        }
    }

    /// Unmounts and removes the dir on a blocking thread, and waits for it: tearing down a
    /// job's filesystem frees every dentry and inode the job left in the kernel's caches, in
    /// the caller's context, which a job can make cost seconds of CPU (third review R2: 10
    /// million failed lookups, 6.75 s of system CPU at unmount). Never on an async runtime
    /// thread, and before the job's capacity is given back.
    pub async fn remove(self) {
        if let Err(e) = tokio::task::spawn_blocking(move || drop(self)).await {
            tracing::warn!(error = %e, "the job dir's removal failed");
        }
    }
}

impl Drop for JobDir {
    fn drop(&mut self) {
        let helper = self.helper.get_mut().ok().and_then(Option::take);
        match helper {
            None => remove_job_dir(&self.root),
            Some(pidfd) => {
                // Dropped mid-run: wait for the helper off the async runtime, then clean up.
                let root = self.root.clone();
                let spawned = std::thread::Builder::new().name("jobdir-cleanup".into()).spawn(move || {
                    wait_for_exit(&pidfd, HELPER_EXIT_WAIT);
                    remove_job_dir(&root);
                });
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "cannot start a cleanup thread; removing the job dir now");
                    remove_job_dir(&self.root);
                }
            }
        }
    }
}

/// Waits up to `limit` for the process behind `pidfd` to exit (the pidfd turns readable).
fn wait_for_exit(pidfd: &std::os::fd::OwnedFd, limit: std::time::Duration) {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let until = std::time::Instant::now() + limit;
    loop {
        let left = until.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return;
        }
        let timeout = PollTimeout::try_from(left.as_millis().min(i32::MAX as u128) as i32).unwrap_or(PollTimeout::MAX);
        let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, timeout) {
            Err(nix::errno::Errno::EINTR) => {}
            _ => return,
        }
    }
}

/// Unmounts `<root>/disk` (if a filesystem is mounted there; `<root>/work` in job dirs of
/// earlier versions) and removes `root`: for this run's job dirs and for those a killed worker
/// left behind.
pub fn remove_job_dir(root: &Path) {
    for mounted in [root.join("disk"), root.join("work"), root.join("out"), root.join("src")] {
        // MNT_DETACH: a leftover process holding the mount must not keep the directory.
        match nix::mount::umount2(&mounted, nix::mount::MntFlags::MNT_DETACH) {
            Ok(()) | Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT) => {}
            Err(e) => tracing::warn!(dir = %mounted.display(), error = %e, "cannot unmount"),
        }
    }
    if let Err(e) = std::fs::remove_dir_all(root) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(dir = %root.display(), error = %e, "cannot remove job dir");
        }
    }
}

/// Why staging failed.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// Making or mounting the work filesystem failed (host trouble: retried).
    #[error("cannot make the work filesystem: {0}")]
    Filesystem(String),
    /// The inputs do not fit the SKU's disk quota (the client's fault: rejected).
    #[error("inputs are {bytes} bytes, more than the {quota}-byte disk quota of the SKU")]
    OverQuota {
        /// Input bytes.
        bytes: u64,
        /// The quota.
        quota: u64,
    },
    /// Creating a local directory or file failed (host trouble: retried).
    #[error("cannot prepare {path}: {source}")]
    Prepare {
        /// The path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
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
    /// The content-addressed object of an input does not hold the bytes its name says (another
    /// client wrote it: fourteenth review R14-5); `removed` when the worker deleted it, so that
    /// the next upload of the file stores it afresh (the client's job is rejected).
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

/// Largest content-addressed object the worker reads whole to prove it does not hold the bytes
/// its name says, after a size mismatch (64 MiB): a larger one is left in place.
const MAX_PROOF_BYTES: u64 = 64 << 20;

/// After a size or digest mismatch of the input object `key` (`inputs/sha256/<hex>`, checked
/// by validation to name the job's declared `sha256`): whether it provably holds other bytes
/// than its name says, and so was deleted. A digest mismatch at the declared size proves it; a
/// size mismatch proves nothing alone (the job may declare a wrong size), so the object is
/// hashed whole, up to [`MAX_PROOF_BYTES`].
async fn remove_if_misnamed(s3: &aws_sdk_s3::Client, bucket: &str, key: &str, sha256: &str, error: &TransferError) -> bool {
    // Inputs only: a session's blob is the worker's own (clients cannot write `sessions/`), and
    // a new upload would not bring it back (fifteenth review, note).
    if key != sandq_schemas::names::input_key(sha256) {
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

fn prepare_error(path: &Path) -> impl FnOnce(std::io::Error) -> StageError + '_ {
    move |source| StageError::Prepare { path: path.to_path_buf(), source }
}

fn mkdir(path: &Path, mode: u32) -> Result<(), StageError> {
    std::fs::DirBuilder::new().mode(mode).create(path).map_err(prepare_error(path))
}

/// Creates the job directory for `container_id` and stages code, stdin and inputs (a cold
/// start: [`prepare`] then [`fill`]).
///
/// # Errors
/// [`StageError`]; the partly made directory is removed.
pub async fn stage(job: &ValidJob, place: &Placement<'_>, s3: &aws_sdk_s3::Client, bucket: &str) -> Result<(JobDir, Staged), StageError> {
    check_quota(job, place)?;
    let notebook = job.spec.run_mode() == sandq_schemas::RunMode::Notebook;
    // A Node.js script gets the stdio preload alone (the notebook runner's files include it).
    let node_script = !notebook && job.spec.runtime == sandq_schemas::Runtime::Node;
    let shape = Shape {
        jobs_dir: place.jobs_dir,
        container_id: place.container_id,
        sandbox_uid: place.sandbox_uid,
        disk_bytes: place.disk_bytes,
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

/// Fails when the inputs and restored files alone exceed the `/work` quota.
///
/// # Errors
/// [`StageError::OverQuota`].
pub fn check_quota(job: &ValidJob, place: &Placement<'_>) -> Result<(), StageError> {
    let input_bytes: u64 = job.spec.inputs.iter().map(|i| i.size).chain(place.restore.iter().map(|r| r.size)).sum();
    if place.disk_bytes != 0 && input_bytes > place.disk_bytes {
        return Err(StageError::OverQuota { bytes: input_bytes, quota: place.disk_bytes });
    }
    Ok(())
}

/// What a job dir is made for, before its job is known (a warm sandbox) or with it.
#[derive(Debug, Clone, Copy)]
pub struct Shape<'a> {
    /// This worker's job dirs.
    pub jobs_dir: &'a Path,
    /// The container id (the job dir's name).
    pub container_id: &'a str,
    /// Host uid owning `/work` and the outputs tmpfs.
    pub sandbox_uid: u32,
    /// `/work` quota, bytes; 0: none.
    pub disk_bytes: u64,
    /// The Python user site below `/sandq/packages/python` (`lib/python3.X/site-packages`),
    /// made empty for the sandbox user.
    pub python_site: &'a str,
    /// Size of the outputs tmpfs, bytes (outputs, and a session's state twice).
    pub out_bytes: u64,
    /// Bytes the job's own files need in `src/` beyond the runner's (code, `resolv.conf`, the
    /// handover of a warm start).
    pub src_bytes: usize,
    /// Put this runtime's notebook runner files in `src/`.
    pub runner: Option<sandq_schemas::Runtime>,
    /// A warm sandbox: also the FIFO `out/.go` its runner waits on.
    pub warm: bool,
}

/// Makes a job dir without anything of a job in it: directories, the `src/` and `out/` tmpfs
/// (with the runner's files), the `/work` filesystem, an empty `stdin` file, and for a warm
/// sandbox the FIFO its runner waits on.
///
/// # Errors
/// [`StageError`]; the partly made directory is removed.
pub async fn prepare(shape: &Shape<'_>) -> Result<JobDir, StageError> {
    let root = shape.jobs_dir.join(shape.container_id);
    let dir = JobDir {
        bundle: root.join("bundle"),
        src: root.join("src"),
        disk: root.join("disk"),
        work: root.join("disk/work"),
        packages: root.join("disk/packages"),
        stdin: root.join("stdin"),
        report: root.join("report.json"),
        out: root.join("out"),
        root,
        helper: std::sync::Mutex::new(None),
    };
    prepare_into(&dir, shape).await.map(|()| dir)
}

async fn prepare_into(dir: &JobDir, shape: &Shape<'_>) -> Result<(), StageError> {
    let uid = shape.sandbox_uid;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir.root.parent().unwrap_or(Path::new("/")))
        .map_err(prepare_error(&dir.root))?;
    // 0711: the container's init, an unprivileged host uid under a user namespace, must
    // traverse it to bind-mount work/ and src/; it cannot list it.
    mkdir(&dir.root, 0o711)?;
    mkdir(&dir.bundle, 0o700)?;
    mkdir(&dir.src, 0o755)?;
    // src/ and out/ are filesystems of their own, so that the sandbox's mountinfo shows `/` as
    // their root rather than a host path naming the worker (security review I5).
    let runner = shape.runner.map(runner_files).unwrap_or_default();
    let runner_bytes: usize = runner.iter().map(|(_, text)| text.len()).sum();
    // Each file takes whole pages; 64 KiB of slack covers the rounding of the few files.
    let src_options = format!("size={},nr_inodes=24,mode=0755", shape.src_bytes + runner_bytes + (64 << 10));
    let flags = nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV | nix::mount::MsFlags::MS_NOEXEC;
    nix::mount::mount(Some("tmpfs"), &dir.src, Some("tmpfs"), flags, Some(src_options.as_str()))
        .map_err(|e| StageError::Filesystem(format!("source tmpfs: {e}")))?;
    mkdir(&dir.disk, 0o755)?;
    if shape.disk_bytes != 0 {
        mount_work_fs(&dir.root, &dir.disk, shape.disk_bytes).await?;
        std::fs::set_permissions(&dir.disk, std::os::unix::fs::PermissionsExt::from_mode(0o755)).map_err(prepare_error(&dir.disk))?;
        // mkfs leaves a lost+found the program does not need.
        let _ = std::fs::remove_dir(dir.disk.join("lost+found"));
    }
    // /work and the installed packages share the job's disk (and its quota), in directories of
    // their own: /work holds only what the job brought or wrote.
    mkdir(&dir.work, 0o755)?;
    std::os::unix::fs::chown(&dir.work, Some(uid), Some(uid)).map_err(prepare_error(&dir.work))?;
    // The Python user site, before the interpreter starts: Python puts it on sys.path only if
    // it exists then, and a package the job installs must import in the same job
    // (crate::packages). The disk is new: nothing the sandbox made is in the way.
    let mut packages = dir.packages.clone();
    mkdir(&packages, 0o755)?;
    std::os::unix::fs::chown(&packages, Some(uid), Some(uid)).map_err(prepare_error(&packages))?;
    for part in ["python"].into_iter().chain(shape.python_site.split('/')) {
        packages.push(part);
        mkdir(&packages, 0o755)?;
        std::os::unix::fs::chown(&packages, Some(uid), Some(uid)).map_err(prepare_error(&packages))?;
    }
    mkdir(&dir.out, 0o700)?;
    mkdir(&dir.src.join("out"), 0o755)?;
    mkdir(&dir.src.join(crate::packages::PACKAGES_MOUNT_POINT), 0o755)?;
    for (name, text) in runner {
        write_new(&dir.src.join(name), text.as_bytes(), 0o644)?;
    }
    write_new(&dir.src.join(LOADAVG_FILE), LOADAVG, 0o444)?;
    write_new(&dir.src.join(HOSTNAME_FILE), HOSTNAME, 0o444)?;
    write_new(&dir.src.join(NO_RESOLV_FILE), NO_RESOLV, 0o444)?;
    // nr_inodes: the outputs dir holds a handful of files; a cap keeps a job from filling it
    // with empty ones (their memory is charged to the job, third review).
    let options = format!("size={},nr_inodes=256,mode=0755,uid={uid},gid={uid}", shape.out_bytes);
    nix::mount::mount(Some("tmpfs"), &dir.out, Some("tmpfs"), flags, Some(options.as_str()))
        .map_err(|e| StageError::Filesystem(format!("outputs tmpfs: {e}")))?;
    // Always a file, empty unless the job has stdin: a cold and a warm start look the same.
    write_new(&dir.stdin, b"", 0o600)?;
    if shape.warm {
        let go = dir.out.join(WARM_GO);
        nix::unistd::mkfifo(&go, nix::sys::stat::Mode::from_bits_truncate(0o600))
            .map_err(|e| StageError::Filesystem(format!("warm-start fifo: {e}")))?;
        std::os::unix::fs::lchown(&go, Some(uid), Some(uid)).map_err(prepare_error(&go))?;
    }
    Ok(())
}

/// The FIFO a warm runner waits on, in the outputs tmpfs (`/sandq/out/.go`).
pub const WARM_GO: &str = ".go";
/// Created by a warm runner once it is ready for a job (`/sandq/out/.ready`).
pub const WARM_READY: &str = ".ready";
/// The handover of a warm start, in `src/` (`/sandq/handover.json`, read-only for the
/// sandbox): the job's environment and arguments.
pub const WARM_HANDOVER: &str = "handover.json";

/// Name of an outbound job's `resolv.conf` in its `src/` (bind-mounted at `/etc/resolv.conf`).
pub const RESOLV_CONF: &str = ".resolv.conf";

/// The file bind-mounted over the sandbox's `/etc/hostname`, in `src/`.
pub const HOSTNAME_FILE: &str = ".hostname";

/// What the sandbox reads in `/etc/hostname`: its UTS name. The image's own file is whatever
/// the host that built it had (mmdebstrap copies it: seventeenth security review R17-1), and
/// the worker's default id is that host's name.
pub const HOSTNAME: &[u8] = b"sandbox\n";

/// The file bind-mounted over `/etc/resolv.conf` of a sandbox without network, in `src/`: no
/// nameserver (the image's file names the build host's resolvers, R17-1).
pub const NO_RESOLV_FILE: &str = ".resolv.none";

/// What a sandbox without network reads in `/etc/resolv.conf`.
pub const NO_RESOLV: &[u8] = b"# no network\n";

/// The file bind-mounted over the sandbox's `/proc/loadavg`, in `src/`.
pub const LOADAVG_FILE: &str = ".loadavg";

/// What the sandbox reads in `/proc/loadavg`: no load, one runnable task of one, last pid 1.
/// The host's file shows the load of every job on the machine, its task count and the last pid
/// the host allocated, which rises with every process any job starts (twelfth security review
/// R12-3); `getloadavg(3)` and `os.getloadavg()` still parse this one.
pub const LOADAVG: &[u8] = b"0.00 0.00 0.00 1/1 1\n";

/// Name of an outbound job's CA bundle in its `src/` (bind-mounted over the image's,
/// [`crate::packages::SANDBOX_CA_BUNDLE`]), when the worker has `extra_ca_certs`.
pub const CA_BUNDLE: &str = ".ca-certificates.crt";

/// Where and how a job is staged.
#[derive(Debug, Clone, Copy)]
pub struct Placement<'a> {
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
    /// A session's packages archive ([`crate::packages::unpack`]), extracted into
    /// `/sandq/packages` as the sandbox user.
    pub packages: Option<&'a Restore>,
    /// The job's SKU cores: the CPU quota of the cgroup the packages `tar` runs in.
    pub cpus: f64,
    /// A session's notebook state to restore, downloaded (size and SHA-256 checked) to
    /// `out/state.in` ([`STATE_IN`]); its `path` is not used.
    pub state: Option<&'a Restore>,
    /// Bytes added to the outputs tmpfs for the notebook state (restored and saved).
    pub state_bytes: u64,
    /// Room in `src/` for the job's files (code, `resolv.conf`, a warm start's handover): the
    /// same for every job, so that a cold and a warm start look alike (`mountinfo` shows it).
    pub src_bytes: usize,
}

/// The notebook state restored for the job, in its outputs tmpfs (`/sandq/out/state.in`).
pub const STATE_IN: &str = "state.in";
/// The notebook state the runner saves, in the outputs tmpfs (`/sandq/out/state.out`).
pub const STATE_OUT: &str = "state.out";
/// The runner's report on the state (JSON), in the outputs tmpfs (`/sandq/out/state.json`).
pub const STATE_REPORT: &str = "state.json";

/// A session file to restore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restore {
    /// Path relative to `/work` (checked again like an input path).
    pub path: String,
    /// S3 key of the content.
    pub key: String,
    /// Size, bytes.
    pub size: u64,
    /// SHA-256, hex.
    pub sha256: String,
}

/// The Python notebook runner and its matplotlib backend, written next to the user's code
/// (the image stays as built; see `oci-bundles/runner/README.md`).
const RUNNER_FILES: [(&str, &str); 2] = [
    ("sandq_runner.py", include_str!("../../oci-bundles/runner/sandq_runner.py")),
    ("sandq_mpl.py", include_str!("../../oci-bundles/runner/sandq_mpl.py")),
];

/// The Node.js notebook runner, written next to the user's code like [`RUNNER_FILES`].
/// With it the stdio preload, [`NODE_STDIO`].
const NODE_RUNNER_FILES: [(&str, &str); 2] =
    [("sandq_runner.js", include_str!("../../oci-bundles/runner/sandq_runner.js")), (NODE_STDIO, NODE_STDIO_JS)];

const NODE_STDIO_JS: &str = include_str!("../../oci-bundles/runner/sandq_stdio.js");

/// The Node.js preload every Node.js job runs with (`node --require /sandq/sandq_stdio.js`, both
/// modes): blocking writes to stdout and stderr, so that `process.exit` loses nothing.
pub const NODE_STDIO: &str = "sandq_stdio.js";

/// The notebook runner's files for a runtime: the first is the one the interpreter runs
/// ([`crate::run::command`]).
pub fn runner_files(runtime: sandq_schemas::Runtime) -> &'static [(&'static str, &'static str)] {
    match runtime {
        sandq_schemas::Runtime::Python => &RUNNER_FILES,
        sandq_schemas::Runtime::Node => &NODE_RUNNER_FILES,
    }
}

/// Puts a job into a prepared dir: `resolv.conf`, code, the session's state and files, stdin,
/// inputs. Returns the placed files' stamps, once the clock has passed them ([`settle`]).
///
/// # Errors
/// [`StageError`].
pub async fn fill(job: &ValidJob, dir: &JobDir, place: &Placement<'_>, s3: &aws_sdk_s3::Client, bucket: &str) -> Result<Staged, StageError> {
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
        let path = dir.out.join(STATE_IN);
        let mut file = tokio::fs::File::from_std(open_new(&path, 0o644)?);
        storage::get_to_file(s3, bucket, &state.key, &mut file, STATE_IN, Some(state.size), Some(&state.sha256))
            .await
            .map_err(|source| StageError::Download { path: STATE_IN.to_owned(), source })?;
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
    for file in place.restore.iter().filter(|r| !clashes(&r.path)) {
        sandq_schemas::validate::check_relative_path(&file.path)
            .map_err(|e| StageError::Filesystem(format!("session path {:?}: {e}", file.path)))?;
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
                if let Err(e) = crate::packages::unpack(&path, &dir.disk, uid, place.cpus).await {
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

/// The placed files of a job (path relative to `/work` -> how staging left it): what
/// collection may trust without reading the file again ([`Stamp`]).
pub type Staged = std::collections::BTreeMap<String, Stamp>;

/// How staging left a file: its identity, size and times. Collection hashes a staged file again
/// only when its stamp changed (second security review, N3: every input was hashed twice,
/// worker CPU proportional to the inputs' size). Any write, truncation, hole punch, `utimes`,
/// `chmod`, `chown` or rename sets a file's ctime to the current time, which the program cannot
/// choose, and [`settle`] makes that time later than any staged file's ctime: an unchanged stamp
/// means unchanged content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// Device and inode.
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
    /// Size, bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i128,
    /// Status change time, nanoseconds since the epoch.
    pub ctime_ns: i128,
}

impl Stamp {
    /// The stamp of `meta` (from `fstat` of an open file, or `fstatat` without following).
    pub fn of(meta: &std::fs::Metadata) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.len(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
        }
    }
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
    let mut parent = dir.work.clone();
    let components: Vec<&str> = rel.split('/').collect();
    for component in &components[..components.len() - 1] {
        parent.push(component);
        match std::fs::DirBuilder::new().mode(0o755).create(&parent) {
            Ok(()) => std::os::unix::fs::chown(&parent, Some(uid), Some(uid)).map_err(prepare_error(&parent))?,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(StageError::Prepare { path: parent.clone(), source: e }),
        }
    }
    let file = open_new(&dest, 0o644)?;
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

/// Puts a `size`-byte ext4 filesystem in the sparse file `<root>/work.img` and loop-mounts it on
/// `work` (`nosuid,nodev`). The filesystem is a sparse copy of a template formatted once per
/// size (`<data_dir>/templates/`; no journal, no reserved blocks, one inode per 4 KiB): copying
/// takes ~5 ms where mkfs.ext4 takes ~23 ms.
async fn mount_work_fs(root: &Path, work: &Path, size: u64) -> Result<(), StageError> {
    let fs_error = |what: &str, e: String| StageError::Filesystem(format!("{what}: {e}"));
    let templates = root
        .parent()
        .and_then(Path::parent)
        .map(|data_dir| data_dir.join("templates"))
        .ok_or_else(|| fs_error("templates", "job dir has no data dir".into()))?;
    let template = templates.join(format!("ext4-{size}-i4096.img"));
    if !template.exists() {
        std::fs::create_dir_all(&templates).map_err(prepare_error(&templates))?;
        // Made under a unique name and renamed, so that workers sharing the data dir never
        // copy a half-formatted template.
        let partial = templates.join(format!(".ext4-{size}-{}-{:08x}.img", std::process::id(), rand::random::<u32>()));
        let file = open_new(&partial, 0o600)?;
        file.set_len(size).map_err(prepare_error(&partial))?;
        drop(file);
        let mkfs = tokio::process::Command::new("mkfs.ext4")
            .args(["-q", "-F", "-O", "^has_journal", "-m", "0", "-i", "4096", "-E", "lazy_itable_init=1,nodiscard"])
            .arg(&partial)
            .output()
            .await
            .map_err(|e| fs_error("mkfs.ext4", e.to_string()))?;
        if !mkfs.status.success() {
            let _ = std::fs::remove_file(&partial);
            return Err(fs_error("mkfs.ext4", String::from_utf8_lossy(&mkfs.stderr).into_owned()));
        }
        std::fs::rename(&partial, &template).map_err(prepare_error(&template))?;
    }
    let image = root.join("work.img");
    let copy = tokio::process::Command::new("cp")
        .arg("--sparse=always")
        .arg(&template)
        .arg(&image)
        .output()
        .await
        .map_err(|e| fs_error("cp", e.to_string()))?;
    if !copy.status.success() {
        return Err(fs_error("cp", String::from_utf8_lossy(&copy.stderr).into_owned()));
    }
    let mount = tokio::process::Command::new("mount")
        .args(["-t", "ext4", "-o", "loop,nosuid,nodev"])
        .arg(&image)
        .arg(work)
        .output()
        .await
        .map_err(|e| fs_error("mount", e.to_string()))?;
    if !mount.status.success() {
        return Err(fs_error("mount", String::from_utf8_lossy(&mount.stderr).into_owned()));
    }
    Ok(())
}

fn open_new(path: &Path, mode: u32) -> Result<std::fs::File, StageError> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(prepare_error(path))
}

fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), StageError> {
    use std::io::Write;
    open_new(path, mode)?.write_all(bytes).map_err(prepare_error(path))
}
