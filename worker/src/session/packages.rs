//! A session's installed packages (`/sandq/packages`, [`crate::packages`]) kept across its
//! jobs as one archive: made after a job ([`pack`]) and extracted before the next ([`unpack`]),
//! each by a `tar` confined like the job (the sandbox uid, a cgroup of the job's size,
//! rlimits and a wall-clock limit), since the tree is what an earlier job of the session left.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use crate::layout::PACKAGES_MOUNT_POINT;
use crate::sandbox::cgroup::SideCgroup;

/// Why a session's packages could not be archived or restored.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PackArchiveError {
    /// `tar` could not be run or failed.
    #[error("tar {action}: {message}")]
    Tar {
        /// `create` or `extract`.
        action: &'static str,
        /// Its error or exit status and stderr.
        message: String,
    },
    /// The archive is larger than allowed.
    #[error("the packages archive is larger than {max} bytes")]
    TooLarge {
        /// The limit (`worker.max_artifact_bytes`), bytes.
        max: u64,
    },
    /// Reading or writing the archive file.
    #[error("packages archive {path}: {source}")]
    File {
        /// The archive on the worker's disk.
        path: PathBuf,
        /// The I/O error of reading or writing it.
        source: std::io::Error,
    },
}

/// Most entries [`holds_files`] looks at.
const MAX_LOOKED_AT: usize = 10_000;

/// True when the tree at `dir` (written by a sandbox: symlinks are not followed) holds
/// anything but directories (or is too large to tell: more than 10,000 entries looked at),
/// false when it is only the empty directories the worker made or is not a directory.
pub(crate) fn holds_files(dir: &Path) -> bool {
    let mut stack = vec![dir.to_path_buf()];
    let mut looked_at = 0;
    while let Some(path) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&path) else { continue };
        for entry in entries.flatten() {
            looked_at += 1;
            if looked_at > MAX_LOOKED_AT {
                return true;
            }
            match entry.file_type() {
                Ok(kind) if kind.is_dir() => stack.push(entry.path()),
                _ => return true,
            }
        }
    }
    false
}

/// Most bytes of `tar`'s stderr kept for an error message.
const MAX_TAR_STDERR: u64 = 4 << 10;

/// Limits `tar` runs under when it archives or extracts a job's packages: it runs after the
/// job's sandbox is gone (or before it starts), so it is bounded here (test:
/// archiving_a_sessions_packages_is_bounded in tests/hostile.rs). GNU tar holds a directory's names in memory while it descends (a tree of 4 x 1.1 M
/// hard links took it to 1.4 GB); 256 MiB of address space and 60 s of CPU are far above what
/// real packages need (88 MiB in 4,193 files took under 1.5 s), and past them the packages are
/// not saved (the session keeps its previous ones) rather than the worker paying. Applied with
/// util-linux `prlimit`, then wall-clock bounded by [`TAR_WALL`].
const TAR_LIMITS: [&str; 2] = ["--as=268435456", "--cpu=60"];

/// The longest a packages `tar` may take, wall clock.
const TAR_WALL: std::time::Duration = std::time::Duration::from_secs(120);

/// Memory of the cgroup `tar` runs in: its address space limit (256 MiB) and as much again of
/// page cache for the files it writes, bytes.
const TAR_CGROUP_MEMORY: u64 = 512 << 20;

/// Run by `sh` as root: writes its own pid into each file up to `--` (the `cgroup.procs` of a
/// [`SideCgroup`]; exit 125 when one refuses it), then executes the rest.
const JOIN_CGROUP_AND_EXEC: &str = r#"while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@""#;

/// `tar` with `args` on `<disk>/packages` in a cgroup of its own limited like the job's SKU
/// (`cpus` cores: unconfined, the archive of a session's packages took 7.6 s of CPU from
/// other jobs' cores), as `uid` without supplementary groups or new privileges
/// (util-linux `setpriv`), under [`TAR_LIMITS`] (`prlimit`), in the C locale, with nothing of
/// the worker's environment, killed if dropped. Every step `exec`s the next: the child's pid is
/// tar's. Without a cgroup (none could be made: logged) tar runs in the worker's, bounded by
/// [`TAR_LIMITS`] alone. The caller sets its stdio, waits for the child, then drops `side`.
fn limited_tar(args: &[&str], disk: &Path, uid: u32, side: Option<&SideCgroup>) -> tokio::process::Command {
    let mut command = confined(uid, side);
    command.arg("tar").args(args).arg("--directory").arg(disk).arg(PACKAGES_MOUNT_POINT);
    command
}

/// The start of [`limited_tar`]'s command, up to the program: the arguments added next are
/// the program and its arguments, run in `side`, as `uid`, under [`TAR_LIMITS`].
fn confined(uid: u32, side: Option<&SideCgroup>) -> tokio::process::Command {
    let mut command = tokio::process::Command::new("sh");
    command.arg("-c").arg(JOIN_CGROUP_AND_EXEC).arg("sh");
    for procs in side.map(SideCgroup::procs_files).unwrap_or_default() {
        command.arg(procs);
    }
    command
        .arg("--")
        .args(["setpriv", &format!("--reuid={uid}"), &format!("--regid={uid}"), "--clear-groups", "--no-new-privs", "--"])
        .arg("prlimit")
        .args(TAR_LIMITS)
        .arg("--")
        .env_clear()
        .env("LC_ALL", "C")
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .kill_on_drop(true);
    command
}

/// A cgroup for one packages `tar` of a job of `cpus` cores; `None` (logged) when the worker
/// cannot make one.
fn tar_cgroup(cpus: f64) -> Option<SideCgroup> {
    let name = format!("tar-{:016x}", rand::random::<u64>());
    match SideCgroup::create(&name, cpus, TAR_CGROUP_MEMORY) {
        Ok(side) => Some(side),
        Err(e) => {
            tracing::warn!(error = %e, "cannot make a cgroup for the packages tar; it runs in the worker's, bounded by its rlimits");
            None
        }
    }
}

/// Logs the CPU time and peak memory the `tar` of `side` used (`action`: create or extract).
fn log_usage(side: Option<&SideCgroup>, action: &'static str) {
    if let Some(side) = side {
        let used = crate::sandbox::cgroup::read(side.path());
        tracing::info!(action, cpu_ms = used.cpu_ms, peak_memory_bytes = used.peak_memory_bytes, "session packages tar, in its own cgroup");
    }
}

/// The error of a `tar` that ran past [`TAR_WALL`] (`action`: create or extract).
fn too_slow(action: &'static str) -> PackArchiveError {
    PackArchiveError::Tar { action, message: format!("took longer than {}", humantime::format_duration(TAR_WALL)) }
}

/// Archives `<disk>/packages` (the job's disk, [`crate::jobdir::JobDir::disk`]) into `archive`
/// (a new file the worker owns), running `tar` as `uid` (the host uid of the sandbox user:
/// everything there was written by the sandbox, and tar as that uid reads only what the
/// sandbox could), without following symlinks, sorted by name so that unchanged packages give
/// the same bytes (owners recorded as 0). Returns `false` (and writes nothing) when there is no packages directory;
/// at most `max_bytes` are written. `tar` runs in a cgroup limited to the job's `cpus` cores
/// ([`limited_tar`]).
///
/// # Errors
/// [`PackArchiveError`].
pub(crate) async fn pack(disk: &Path, archive: &Path, uid: u32, max_bytes: u64, cpus: f64) -> Result<bool, PackArchiveError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = disk.join(PACKAGES_MOUNT_POINT);
    let meta = match std::fs::symlink_metadata(&dir) {
        Ok(m) => m,
        Err(_) => return Ok(false),
    };
    if !meta.is_dir() {
        return Ok(false);
    }
    let tar_error = |message: String| PackArchiveError::Tar { action: "create", message };
    let side = tar_cgroup(cpus);
    // Owners recorded as 0 (extraction never restores them): the same packages archive to the
    // same bytes whichever host id range the sandbox had (a consumer slot's or a warm one's).
    let args = ["--create", "--file=-", "--sort=name", "--one-file-system", "--format=gnu", "--owner=0", "--group=0", "--numeric-owner"];
    let mut child = limited_tar(&args, disk, uid, side.as_ref())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| tar_error(e.to_string()))?;
    let mut stdout = child.stdout.take().ok_or_else(|| tar_error("no stdout".into()))?;
    let stderr = child.stderr.take().ok_or_else(|| tar_error("no stderr".into()))?;
    let file_error = |source| PackArchiveError::File { path: archive.to_path_buf(), source };
    let mut out = tokio::fs::OpenOptions::new().write(true).create_new(true).open(archive).await.map_err(file_error)?;
    let errors = tokio::spawn(async move {
        let mut text = String::new();
        let mut stderr = stderr;
        let _ = (&mut stderr).take(MAX_TAR_STDERR).read_to_string(&mut text).await;
        // The rest is read and dropped: closing the pipe would kill tar with SIGPIPE on its
        // next warning (a tree of many unreadable files is not an error worth losing).
        let _ = tokio::io::copy(&mut stderr, &mut tokio::io::sink()).await;
        text
    });
    let mut written = 0u64;
    let mut buf = vec![0u8; 256 << 10];
    let wall = tokio::time::Instant::now() + TAR_WALL;
    loop {
        let Ok(read) = tokio::time::timeout_at(wall, stdout.read(&mut buf)).await else {
            let _ = child.kill().await;
            return Err(too_slow("create"));
        };
        let n = read.map_err(file_error)?;
        if n == 0 {
            break;
        }
        written += n as u64;
        if written > max_bytes {
            let _ = child.kill().await;
            return Err(PackArchiveError::TooLarge { max: max_bytes });
        }
        out.write_all(&buf[..n]).await.map_err(file_error)?;
    }
    out.flush().await.map_err(file_error)?;
    let Ok(status) = tokio::time::timeout_at(wall, child.wait()).await else {
        let _ = child.kill().await;
        return Err(too_slow("create"));
    };
    let status = status.map_err(|e| tar_error(e.to_string()))?;
    log_usage(side.as_ref(), "create");
    let stderr = errors.await.unwrap_or_default();
    // Exit 1: "some files differ" (changed while being read): the sandbox is gone, so nothing
    // changes now; 2 is fatal.
    if !status.success() && status.code() != Some(1) {
        return Err(tar_error(format!("{status}: {}", stderr.trim())));
    }
    Ok(written > 0)
}

/// Extracts a packages archive (made by [`pack`]) into `disk`, running `tar` as `uid` (the
/// sandbox's host uid, the owner of `disk/packages`): whatever the archive holds (it was made
/// from files a sandbox wrote), tar can write only where the sandbox user can. Only `packages`
/// members are extracted; owners are not restored; the times of the directories the worker
/// made are (so that unchanged packages archive to the same bytes again). `tar` runs in a
/// cgroup limited to the job's `cpus` cores ([`limited_tar`]).
///
/// # Errors
/// [`PackArchiveError`].
pub(crate) async fn unpack(archive: &Path, disk: &Path, uid: u32, cpus: f64) -> Result<(), PackArchiveError> {
    use tokio::io::AsyncReadExt;
    let file = std::fs::File::open(archive).map_err(|source| PackArchiveError::File { path: archive.to_path_buf(), source })?;
    let tar_error = |message: String| PackArchiveError::Tar { action: "extract", message };
    let side = tar_cgroup(cpus);
    let mut child = limited_tar(&["--extract", "--file=-", "--no-same-owner", "--delay-directory-restore"], disk, uid, side.as_ref())
        .stdin(Stdio::from(file))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| tar_error(e.to_string()))?;
    let ended = tokio::time::timeout(TAR_WALL, async {
        let mut stderr = String::new();
        if let Some(mut err) = child.stderr.take() {
            let _ = (&mut err).take(MAX_TAR_STDERR).read_to_string(&mut stderr).await;
            let _ = tokio::io::copy(&mut err, &mut tokio::io::sink()).await;
        }
        (child.wait().await, stderr)
    })
    .await;
    let Ok((status, stderr)) = ended else {
        let _ = child.kill().await;
        return Err(too_slow("extract"));
    };
    let status = status.map_err(|e| tar_error(e.to_string()))?;
    log_usage(side.as_ref(), "extract");
    if !status.success() {
        return Err(tar_error(format!("{status}: {}", stderr.trim())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn packages_round_trip_through_an_archive_and_links_are_kept_as_links() {
        let uid = nix::unistd::geteuid().as_raw();
        let root = tempfile::tempdir().expect("tempdir");
        let (work, again) = (root.path().join("disk"), root.path().join("again"));
        let site = work.join("packages/python/lib/python3.13/site-packages");
        std::fs::create_dir_all(&site).expect("site");
        std::fs::create_dir_all(&again).expect("again");
        assert!(!holds_files(&work.join(PACKAGES_MOUNT_POINT)), "empty directories hold no files");
        assert!(!holds_files(&root.path().join("missing")));
        std::fs::create_dir(site.join("probe")).expect("probe");
        std::fs::write(site.join("probe/__init__.py"), "VALUE = 42\n").expect("module");
        std::os::unix::fs::symlink("/etc/hostname", site.join("link")).expect("symlink");
        std::fs::create_dir(work.join("work")).expect("work");
        std::fs::write(work.join("work/mine.txt"), "not a package").expect("own file");
        assert!(holds_files(&work.join(PACKAGES_MOUNT_POINT)));
        let archive = root.path().join("packages.tar");
        assert!(pack(&work, &archive, uid, 1 << 20, 1.0).await.expect("pack"));
        // The same tree archives to the same bytes.
        let second = root.path().join("second.tar");
        assert!(pack(&work, &second, uid, 1 << 20, 1.0).await.expect("pack again"));
        assert_eq!(std::fs::read(&archive).expect("archive"), std::fs::read(&second).expect("second"));
        unpack(&archive, &again, uid, 1.0).await.expect("unpack");
        let restored = again.join("packages/python/lib/python3.13/site-packages");
        assert_eq!(std::fs::read_to_string(restored.join("probe/__init__.py")).expect("module"), "VALUE = 42\n");
        assert_eq!(std::fs::read_link(restored.join("link")).expect("link"), Path::new("/etc/hostname"));
        assert!(!again.join("work").exists(), "only packages/ is archived");
        // Past the cap: an error, not a truncated archive.
        let small = root.path().join("small.tar");
        assert!(matches!(pack(&work, &small, uid, 100, 1.0).await, Err(PackArchiveError::TooLarge { max: 100 })));
    }

    /// The packages `tar` runs in a cgroup of its own with the job's CPU quota, as the
    /// sandbox's uid with no supplementary groups, and the cgroup is gone afterwards.
    /// Root only (it makes a cgroup), as the worker runs.
    #[tokio::test]
    async fn the_packages_tar_runs_confined_to_a_cgroup_of_the_jobs_size() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: making a cgroup needs root");
            return;
        }
        let side = tar_cgroup(0.5).expect("a cgroup for the tar");
        let path = side.path().to_owned();
        let v2 = crate::sandbox::cgroup::is_v2();
        // 0.5 cores of a 100 ms period: 50 ms.
        let quota = if v2 {
            std::fs::read_to_string(format!("/sys/fs/cgroup{path}/cpu.max")).expect("cpu.max")
        } else {
            std::fs::read_to_string(format!("/sys/fs/cgroup/cpu{path}/cpu.cfs_quota_us")).expect("quota")
        };
        assert_eq!(quota.trim(), if v2 { "50000 100000" } else { "50000" });
        let out = confined(65_534, Some(&side))
            .args(["sh", "-c", "cat /proc/self/cgroup; echo uid=$(id -u) groups=$(id -G)"])
            .stdout(Stdio::piped())
            .output()
            .await
            .expect("run");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
        let lines: Vec<&str> = text.lines().collect();
        let joined = |controller: &str| {
            lines.iter().any(|l| l.split(':').nth(1).is_some_and(|c| c.split(',').any(|c| c == controller)) && l.ends_with(path.as_str()))
        };
        if v2 {
            assert!(lines.contains(&format!("0::{path}").as_str()), "{text}");
        } else {
            for controller in ["cpu", "cpuacct", "memory", "pids"] {
                assert!(joined(controller), "not in {path} for {controller}:\n{text}");
            }
        }
        assert!(text.contains("uid=65534 groups=65534\n"), "{text}");
        let dirs: Vec<String> = if v2 {
            vec![format!("/sys/fs/cgroup{path}")]
        } else {
            vec![format!("/sys/fs/cgroup/cpu{path}"), format!("/sys/fs/cgroup/memory{path}")]
        };
        drop(side);
        for dir in dirs {
            assert!(!Path::new(&dir).exists(), "{dir} left behind");
        }
    }
}
