//! Packages installed at run time (`pip install`, `%pip install`, `npm install`) and the TLS
//! trust and package indexes sandboxes use for them.
//!
//! Where installed packages live: `/sandq/packages` ([`SANDBOX_PACKAGES`]), a directory of the
//! job's disk next to `/work` (within the same quota), owned by the sandbox user, so that
//! `/work` holds only what the job brought or wrote:
//! - Python: `PYTHONUSERBASE=/sandq/packages/python`; pip installs there (its "user
//!   installation", chosen by pip itself because the image's site-packages is read-only), and
//!   the user site `/sandq/packages/python/lib/python3.X/site-packages` is made by the worker
//!   before the interpreter starts, so that Python puts it on `sys.path` at start-up (it adds
//!   the user site only if it exists then) and a package installed by the job imports in the
//!   same job, warm sandboxes included. `PIP_BREAK_SYSTEM_PACKAGES=1` lifts Debian's PEP 668
//!   refusal (`EXTERNALLY-MANAGED`) for every pip command: the image's packages stay
//!   read-only, only the user site changes.
//! - Node.js: npm in its global location with `prefix=/sandq/packages/node` (`npm install
//!   NAME` puts the package in `/sandq/packages/node/lib/node_modules`, its commands in
//!   `/sandq/packages/node/bin`), found by `require` through `NODE_PATH` (read when Node
//!   starts, so warm sandboxes start with it).
//!
//! Being outside `/work`, installed packages are never artifacts; in a session they are kept as
//! one archive next to the session's files ([`pack`], [`unpack`]).

use std::path::{Path, PathBuf};
use std::process::Stdio;

use crate::sandbox::cgroup::SideCgroup;

/// Where the sandbox sees its packages directory (the job dir's `disk/packages`).
pub const SANDBOX_PACKAGES: &str = "/sandq/packages";

/// The mount point of [`SANDBOX_PACKAGES`] in the job's `src/` (mounted at `/sandq`), and the
/// packages directory's name on the job's disk: the one member of a packages archive.
pub const PACKAGES_MOUNT_POINT: &str = "packages";

/// Where a sandbox finds its trusted CAs: the image's bundle path, over which the worker's
/// combined bundle is bind-mounted when `worker.extra_ca_certs` is set.
pub const SANDBOX_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Most bytes of `worker.extra_ca_certs` read (a bundle of a few hundred certificates is
/// well under it: Debian's whole bundle of 146 CAs is 222 KB).
pub const MAX_EXTRA_CA_BYTES: u64 = 1 << 20;

/// The package settings of the worker, validated ([`crate::settings::RawWorker`]).
#[derive(Debug, Clone, Default)]
pub struct Packages {
    /// The user site below `/sandq/packages/python`: `lib/python3.X/site-packages`, from the
    /// image's `python3` link.
    pub python_site: String,
    /// The image's CA bundle followed by `worker.extra_ca_certs`, when that is set: written to
    /// each outbound job's `src/` and bind-mounted at [`SANDBOX_CA_BUNDLE`].
    pub ca_bundle: Option<std::sync::Arc<[u8]>>,
    /// `PIP_INDEX_URL`.
    pub pip_index_url: Option<String>,
    /// `PIP_EXTRA_INDEX_URL` (space-separated there).
    pub pip_extra_index_urls: Vec<String>,
    /// `PIP_TRUSTED_HOST` (space-separated there).
    pub pip_trusted_hosts: Vec<String>,
    /// `npm_config_registry`.
    pub npm_registry: Option<String>,
}

/// Why a package setting is unusable.
#[derive(Debug, thiserror::Error)]
pub enum PackageSettingsError {
    /// `worker.extra_ca_certs` cannot be read.
    #[error("worker.extra_ca_certs {path}: cannot read it: {source}")]
    ReadCa {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// `worker.extra_ca_certs` is not a PEM file of certificates.
    #[error("worker.extra_ca_certs {path}: {problem}")]
    BadCa {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// The image has no CA bundle to add the extra certificates to.
    #[error("the sandbox image has no CA bundle at {path}: {source}")]
    ImageBundle {
        /// The image's bundle.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The image's `python3` is not a link to `python3.X`.
    #[error("cannot tell the image's Python version from {path}: {problem}")]
    PythonVersion {
        /// `usr/bin/python3` in the rootfs.
        path: PathBuf,
        /// What was found.
        problem: String,
    },
    /// An index or registry URL is malformed.
    #[error("{key}: {value:?} is not an http(s) URL with a host")]
    Url {
        /// The setting.
        key: &'static str,
        /// Its value.
        value: String,
    },
    /// A trusted host is malformed.
    #[error("worker.pip_trusted_hosts: {0:?} is not a host name or host:port")]
    Host(String),
}

/// The settings as written in `[worker]`.
#[derive(Debug, Clone, Default)]
pub struct RawPackages<'a> {
    /// `worker.extra_ca_certs`.
    pub extra_ca_certs: Option<&'a Path>,
    /// `worker.pip_index_url`.
    pub pip_index_url: Option<&'a str>,
    /// `worker.pip_extra_index_urls`, comma-separated.
    pub pip_extra_index_urls: Option<&'a str>,
    /// `worker.pip_trusted_hosts`, comma-separated.
    pub pip_trusted_hosts: Option<&'a str>,
    /// `worker.npm_registry`.
    pub npm_registry: Option<&'a str>,
}

/// True for `http://` or `https://` followed by a host, with no whitespace or quote (the value
/// goes into an environment variable that pip splits on whitespace).
fn is_http_url(value: &str) -> bool {
    let rest = value.strip_prefix("https://").or_else(|| value.strip_prefix("http://"));
    rest.is_some_and(|rest| {
        let host = rest.split(['/', '?', '#']).next().unwrap_or("");
        let host = host.rsplit('@').next().unwrap_or("");
        !host.is_empty() && !host.starts_with(':')
    }) && !value.chars().any(|c| c.is_whitespace() || c == '"' || c == '\'' || c.is_control())
}

/// The PEM certificates of `text`: each `-----BEGIN CERTIFICATE-----` block must decode as
/// base64 to a DER SEQUENCE (first byte 0x30). Returns how many there are.
///
/// # Errors
/// The problem, in words.
pub fn count_pem_certificates(text: &str) -> Result<usize, String> {
    use base64::Engine;
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let mut count = 0;
    let mut rest = text;
    while let Some(start) = rest.find(BEGIN) {
        let body_start = start + BEGIN.len();
        let Some(len) = rest[body_start..].find(END) else {
            return Err(format!("certificate {} has no {END} line", count + 1));
        };
        let body: String = rest[body_start..body_start + len].chars().filter(|c| !c.is_whitespace()).collect();
        match base64::engine::general_purpose::STANDARD.decode(body.as_bytes()) {
            Ok(der) if der.first() == Some(&0x30) && der.len() > 16 => count += 1,
            _ => return Err(format!("certificate {} is not base64 DER", count + 1)),
        }
        rest = &rest[body_start + len + END.len()..];
    }
    if count == 0 {
        return Err(format!("no {BEGIN} block"));
    }
    Ok(count)
}

impl RawPackages<'_> {
    /// Checks the settings against the image at `rootfs` and makes the combined CA bundle.
    ///
    /// # Errors
    /// [`PackageSettingsError`] naming the setting.
    pub fn validate(&self, rootfs: &Path) -> Result<Packages, PackageSettingsError> {
        let link = rootfs.join("usr/bin/python3");
        let target = std::fs::read_link(&link)
            .map_err(|e| PackageSettingsError::PythonVersion { path: link.clone(), problem: e.to_string() })?;
        let name = target.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let version = name.strip_prefix("python3.").filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()));
        let Some(version) = version else {
            return Err(PackageSettingsError::PythonVersion { path: link, problem: format!("it points to {}", target.display()) });
        };
        let ca_bundle = match self.extra_ca_certs {
            None => None,
            Some(path) => {
                use std::io::Read;
                let bad = |problem: String| PackageSettingsError::BadCa { path: path.to_path_buf(), problem };
                let file = std::fs::File::open(path).map_err(|source| PackageSettingsError::ReadCa { path: path.to_path_buf(), source })?;
                let mut extra = Vec::new();
                file.take(MAX_EXTRA_CA_BYTES + 1)
                    .read_to_end(&mut extra)
                    .map_err(|source| PackageSettingsError::ReadCa { path: path.to_path_buf(), source })?;
                if extra.len() as u64 > MAX_EXTRA_CA_BYTES {
                    return Err(bad(format!("larger than {MAX_EXTRA_CA_BYTES} bytes")));
                }
                let text = std::str::from_utf8(&extra).map_err(|_| bad("not UTF-8 text (PEM expected)".into()))?;
                count_pem_certificates(text).map_err(bad)?;
                let image = rootfs.join(SANDBOX_CA_BUNDLE.trim_start_matches('/'));
                let mut bundle =
                    std::fs::read(&image).map_err(|source| PackageSettingsError::ImageBundle { path: image.clone(), source })?;
                if !bundle.ends_with(b"\n") {
                    bundle.push(b'\n');
                }
                bundle.extend_from_slice(&extra);
                Some(std::sync::Arc::from(bundle))
            }
        };
        let url = |key: &'static str, value: &str| {
            if is_http_url(value) {
                Ok(value.to_owned())
            } else {
                Err(PackageSettingsError::Url { key, value: value.to_owned() })
            }
        };
        let list = |text: Option<&str>| -> Vec<String> {
            text.unwrap_or("").split(',').map(str::trim).filter(|i| !i.is_empty()).map(str::to_owned).collect()
        };
        let pip_extra_index_urls =
            list(self.pip_extra_index_urls).iter().map(|u| url("worker.pip_extra_index_urls", u)).collect::<Result<_, _>>()?;
        let pip_trusted_hosts = list(self.pip_trusted_hosts);
        for host in &pip_trusted_hosts {
            if !host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b)) {
                return Err(PackageSettingsError::Host(host.clone()));
            }
        }
        Ok(Packages {
            python_site: format!("lib/python3.{version}/site-packages"),
            ca_bundle,
            pip_index_url: self.pip_index_url.map(|u| url("worker.pip_index_url", u)).transpose()?,
            pip_extra_index_urls,
            pip_trusted_hosts,
            npm_registry: self.npm_registry.map(|u| url("worker.npm_registry", u)).transpose()?,
        })
    }
}

impl Packages {
    /// The sandbox's environment for installing and finding packages (every sandbox, warm ones
    /// from their start: `NODE_PATH` and `NODE_EXTRA_CA_CERTS` are read when Node starts).
    pub fn environment(&self) -> Vec<String> {
        let base = SANDBOX_PACKAGES;
        let mut env = vec![
            format!("PYTHONUSERBASE={base}/python"),
            // Debian's pip refuses any install into its Python (PEP 668), user installs too;
            // the image stays read-only whatever pip does, so the refusal protects nothing here.
            "PIP_BREAK_SYSTEM_PACKAGES=1".to_owned(),
            "PIP_DISABLE_PIP_VERSION_CHECK=1".to_owned(),
            // pip's cache would sit in /tmp, a tmpfs charged to the job's memory.
            "PIP_NO_CACHE_DIR=1".to_owned(),
            format!("NODE_PATH={base}/node/lib/node_modules"),
            format!("npm_config_prefix={base}/node"),
            "npm_config_location=global".to_owned(),
            "npm_config_update_notifier=false".to_owned(),
            "npm_config_fund=false".to_owned(),
            "npm_config_audit=false".to_owned(),
        ];
        if let Some(url) = &self.pip_index_url {
            env.push(format!("PIP_INDEX_URL={url}"));
        }
        if !self.pip_extra_index_urls.is_empty() {
            env.push(format!("PIP_EXTRA_INDEX_URL={}", self.pip_extra_index_urls.join(" ")));
        }
        if !self.pip_trusted_hosts.is_empty() {
            env.push(format!("PIP_TRUSTED_HOST={}", self.pip_trusted_hosts.join(" ")));
        }
        if let Some(url) = &self.npm_registry {
            env.push(format!("npm_config_registry={url}"));
        }
        if self.ca_bundle.is_some() {
            // OpenSSL (Python's ssl, curl...) reads the bundle at its usual path anyway; these
            // reach what does not: Node's own root store, requests, pip.
            for name in ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "NODE_EXTRA_CA_CERTS"] {
                env.push(format!("{name}={SANDBOX_CA_BUNDLE}"));
            }
        }
        env
    }

    /// `PATH` additions: the commands of installed packages, after the image's.
    pub fn path_suffix() -> String {
        format!(":{SANDBOX_PACKAGES}/python/bin:{SANDBOX_PACKAGES}/node/bin")
    }

    /// Bytes the CA bundle takes in a job's `src/`.
    pub fn ca_bundle_bytes(&self) -> usize {
        self.ca_bundle.as_ref().map_or(0, |b| b.len())
    }
}

/// Why a session's packages could not be archived or restored.
#[derive(Debug, thiserror::Error)]
pub enum PackArchiveError {
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
        /// The limit.
        max: u64,
    },
    /// Reading or writing the archive file.
    #[error("packages archive {path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// Most entries [`holds_files`] looks at.
const MAX_LOOKED_AT: usize = 10_000;

/// True when the tree at `dir` (written by a sandbox: symlinks are not followed) holds
/// anything but directories (or is too large to tell: more than 10,000 entries looked at),
/// false when it is only the empty directories the worker made or is not a directory.
pub fn holds_files(dir: &Path) -> bool {
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

/// Limits `tar` runs under when it archives or extracts a job's packages (ninth security
/// review P1): it runs after the job's sandbox is gone (or before it starts), so it is bounded
/// here. GNU tar holds a directory's names in memory while it descends (a tree of 4 x 1.1 M
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
/// (`cpus` cores: tenth security review N5, the archive of a session's packages took 7.6 s of
/// CPU from other jobs' cores), as `uid` without supplementary groups or new privileges
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

/// Archives `<disk>/packages` (the job's disk, [`crate::stage::JobDir::disk`]) into `archive`
/// (a new file the worker owns), running `tar` as `uid` (the host uid of the sandbox user:
/// everything there was written by the sandbox, and tar as that uid reads only what the
/// sandbox could), without following symlinks, sorted by name so that unchanged packages give
/// the same bytes. Returns `false` (and writes nothing) when there is no packages directory;
/// at most `max_bytes` are written. `tar` runs in a cgroup limited to the job's `cpus` cores
/// ([`limited_tar`]).
///
/// # Errors
/// [`PackArchiveError`].
pub async fn pack(disk: &Path, archive: &Path, uid: u32, max_bytes: u64, cpus: f64) -> Result<bool, PackArchiveError> {
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
    let mut child = limited_tar(&["--create", "--file=-", "--sort=name", "--one-file-system", "--format=gnu"], disk, uid, side.as_ref())
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
pub async fn unpack(archive: &Path, disk: &Path, uid: u32, cpus: f64) -> Result<(), PackArchiveError> {
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

    #[test]
    fn urls_and_pem_are_checked() {
        assert!(is_http_url("https://pypi.example.com/simple/"));
        assert!(is_http_url("http://10.0.0.5:3141/root/pypi/+simple/"));
        assert!(is_http_url("https://user:pw@mirror.example/simple"));
        for bad in ["ftp://x/", "https://", "https:///simple", "https://a b/", "pypi.org/simple", "https://:80/"] {
            assert!(!is_http_url(bad), "{bad}");
        }
        // A DER SEQUENCE (0x30 0x82 ...) of 20 bytes, base64.
        use base64::Engine;
        let der: Vec<u8> = [0x30u8, 0x12].into_iter().chain(std::iter::repeat_n(7u8, 18)).collect();
        let b64 = base64::engine::general_purpose::STANDARD.encode(&der);
        let pem = format!("-----BEGIN CERTIFICATE-----\n{b64}\n-----END CERTIFICATE-----\n");
        assert_eq!(count_pem_certificates(&format!("junk\n{pem}{pem}")), Ok(2));
        assert!(count_pem_certificates("nothing").is_err());
        assert!(count_pem_certificates("-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----").is_err());
        assert!(count_pem_certificates("-----BEGIN CERTIFICATE-----\nMIIB").is_err());
    }

    #[test]
    fn settings_are_checked_against_the_image_and_the_ca_file() {
        use base64::Engine;
        let dir = tempfile::tempdir().expect("tempdir");
        let rootfs = dir.path().join("rootfs");
        std::fs::create_dir_all(rootfs.join("usr/bin")).expect("usr/bin");
        std::fs::create_dir_all(rootfs.join("etc/ssl/certs")).expect("certs");
        std::os::unix::fs::symlink("python3.13", rootfs.join("usr/bin/python3")).expect("python3");
        std::fs::write(rootfs.join("etc/ssl/certs/ca-certificates.crt"), "IMAGE BUNDLE").expect("bundle");
        let der: Vec<u8> = [0x30u8, 0x12].into_iter().chain(std::iter::repeat_n(7u8, 18)).collect();
        let pem = format!("-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n", base64::engine::general_purpose::STANDARD.encode(&der));
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, &pem).expect("ca");
        let raw = RawPackages {
            extra_ca_certs: Some(&ca),
            pip_index_url: Some("https://pypi.example/simple/"),
            pip_extra_index_urls: Some("https://a.example/simple/, https://b.example/simple/"),
            pip_trusted_hosts: Some("pypi.example,10.0.0.5:3141"),
            npm_registry: Some("https://npm.example/"),
        };
        let packages = raw.validate(&rootfs).expect("valid");
        assert_eq!(packages.python_site, "lib/python3.13/site-packages");
        assert_eq!(packages.ca_bundle.as_deref(), Some(format!("IMAGE BUNDLE\n{pem}").as_bytes()));
        let env = packages.environment();
        for expected in [
            "PIP_INDEX_URL=https://pypi.example/simple/",
            "PIP_EXTRA_INDEX_URL=https://a.example/simple/ https://b.example/simple/",
            "PIP_TRUSTED_HOST=pypi.example 10.0.0.5:3141",
            "npm_config_registry=https://npm.example/",
            "NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt",
            "PYTHONUSERBASE=/sandq/packages/python",
            "NODE_PATH=/sandq/packages/node/lib/node_modules",
        ] {
            assert!(env.iter().any(|e| e == expected), "{expected} missing from {env:?}");
        }
        // Each bad value is refused with the error naming it.
        let bad_url = RawPackages { npm_registry: Some("registry.npmjs.org"), ..Default::default() };
        assert!(matches!(bad_url.validate(&rootfs), Err(PackageSettingsError::Url { key: "worker.npm_registry", .. })));
        let missing = dir.path().join("missing.pem");
        let no_file = RawPackages { extra_ca_certs: Some(&missing), ..Default::default() };
        assert!(matches!(no_file.validate(&rootfs), Err(PackageSettingsError::ReadCa { .. })));
        let key = dir.path().join("key.pem");
        std::fs::write(&key, "-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n").expect("key");
        let not_a_cert = RawPackages { extra_ca_certs: Some(&key), ..Default::default() };
        assert!(matches!(not_a_cert.validate(&rootfs), Err(PackageSettingsError::BadCa { .. })));
        let host = RawPackages { pip_trusted_hosts: Some("a b"), ..Default::default() };
        assert!(matches!(host.validate(&rootfs), Err(PackageSettingsError::Host(_))));
        // Without settings: no CA bundle, no index variables.
        let plain = RawPackages::default().validate(&rootfs).expect("defaults");
        assert!(plain.ca_bundle.is_none());
        assert!(!plain.environment().iter().any(|e| e.starts_with("PIP_INDEX_URL") || e.starts_with("NODE_EXTRA_CA_CERTS")));
        std::fs::remove_file(rootfs.join("usr/bin/python3")).expect("rm");
        std::os::unix::fs::symlink("python", rootfs.join("usr/bin/python3")).expect("python3");
        assert!(matches!(RawPackages::default().validate(&rootfs), Err(PackageSettingsError::PythonVersion { .. })));
    }

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

    /// Tenth review N5: the packages `tar` runs in a cgroup of its own with the job's CPU quota,
    /// as the sandbox's uid with no supplementary groups, and the cgroup is gone afterwards.
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
        let joined = |controller: &str| lines.iter().any(|l| l.split(':').nth(1).is_some_and(|c| c.split(',').any(|c| c == controller)) && l.ends_with(path.as_str()));
        if v2 {
            assert!(lines.contains(&format!("0::{path}").as_str()), "{text}");
        } else {
            for controller in ["cpu", "cpuacct", "memory", "pids"] {
                assert!(joined(controller), "not in {path} for {controller}:\n{text}");
            }
        }
        assert!(text.contains("uid=65534 groups=65534\n"), "{text}");
        let dirs: Vec<String> = if v2 { vec![format!("/sys/fs/cgroup{path}")] } else { vec![format!("/sys/fs/cgroup/cpu{path}"), format!("/sys/fs/cgroup/memory{path}")] };
        drop(side);
        for dir in dirs {
            assert!(!Path::new(&dir).exists(), "{dir} left behind");
        }
    }
}
