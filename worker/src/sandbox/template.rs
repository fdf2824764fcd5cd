//! `sandq-container template`: starts a pre-imported template (the notebook runner in
//! `--template` mode, `oci-bundles/runner/sandq_nb/template.py`) from which forked starts are
//! made ([`super::fork`]; design in `docs/threat-model.md`, "Forked sandboxes").
//!
//! The template is trusted code (the image's interpreter and the runner; no job's data ever
//! reaches it) but runs as root in the host's user and pid namespaces, which joining a
//! sandbox's namespaces needs. So that it touches nothing of the host, it gets mount, network,
//! IPC and UTS namespaces of its own and a root of its own: the image's rootfs read-only, the
//! runner read-only at `/sandq`, a private `/tmp`, `/dev` with null, zero, random and urandom,
//! read-only `/proc` and `/sys`; the host's tree is unmounted (`pivot_root`). It listens on a
//! Unix socket (fd 3, bound before the switch, mode 0600) and exits when its stdin, a pipe
//! from the worker, closes.

use std::ffi::CString;
use std::os::fd::IntoRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};

/// Why the template could not be started (printed by the helper, which exits 1).
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The socket could not be bound.
    #[error("cannot listen on {}: {source}", path.display())]
    Listen {
        /// The socket's path.
        path: PathBuf,
        /// The bind error.
        #[source]
        source: std::io::Error,
    },
    /// A namespace, mount or root switch failed.
    #[error("{step}: {source}")]
    Setup {
        /// What was being done (`unshare`, `mount /tmp`, ...).
        step: String,
        /// The kernel's error.
        #[source]
        source: nix::Error,
    },
    /// The interpreter could not be exec'd.
    #[error("exec python3: {0}")]
    Exec(#[source] nix::Error),
}

fn setup(step: &str) -> impl FnOnce(nix::Error) -> TemplateError + '_ {
    move |source| TemplateError::Setup { step: step.to_owned(), source }
}

/// Sets up the template's namespaces and root and execs the runner; returns only on failure.
/// `root` is an empty directory (the new root's mount point), `runner` the runner's files,
/// `socket` where to listen.
///
/// # Errors
/// [`TemplateError`].
pub fn launch(rootfs: &Path, runner: &Path, root: &Path, socket: &Path) -> TemplateError {
    match launch_inner(rootfs, runner, root, socket) {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

fn launch_inner(rootfs: &Path, runner: &Path, root: &Path, socket: &Path) -> Result<std::convert::Infallible, TemplateError> {
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket).map_err(|source| TemplateError::Listen { path: socket.to_path_buf(), source })?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .map_err(|source| TemplateError::Listen { path: socket.to_path_buf(), source })?;
    unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWNET | CloneFlags::CLONE_NEWIPC | CloneFlags::CLONE_NEWUTS)
        .map_err(setup("unshare"))?;
    let none: Option<&str> = None;
    mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none).map_err(setup("make / private"))?;
    mount(Some(rootfs), root, none, MsFlags::MS_BIND | MsFlags::MS_REC, none).map_err(setup("bind the rootfs"))?;
    let ro = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID;
    mount(none, root, none, ro, none).map_err(setup("remount the rootfs read-only"))?;
    let sandq = root.join("sandq");
    mount(Some(runner), &sandq, none, MsFlags::MS_BIND, none).map_err(setup("bind the runner"))?;
    mount(none, &sandq, none, ro | MsFlags::MS_NODEV, none).map_err(setup("remount the runner read-only"))?;
    let tmpfs = |dir: &str, options: &str| {
        mount(Some("tmpfs"), &root.join(dir), Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some(options))
            .map_err(setup("mount a tmpfs"))
    };
    tmpfs("tmp", "mode=1777,size=64m")?;
    tmpfs("dev", "mode=755,size=64k")?;
    for device in ["null", "zero", "random", "urandom"] {
        let target = root.join("dev").join(device);
        std::fs::write(&target, b"").map_err(|e| TemplateError::Setup { step: format!("create /dev/{device}"), source: io_errno(&e) })?;
        mount(Some(&Path::new("/dev").join(device)), &target, none, MsFlags::MS_BIND, none).map_err(setup("bind a device"))?;
    }
    let nosys = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    // Read-only as a whole: the template is root in the host's user namespace, and a writable
    // /proc would let it change the host's kernel settings (`/proc/sys`) and `/proc/sysrq-trigger`;
    // nothing it does writes there (test: sandbox::the_templates_proc_is_read_only in
    // tests/tenant). Made read-only by a bind remount, which changes this mount's flags only,
    // never the superblock's (on kernels before 5.8 one procfs superblock serves a whole pid
    // namespace, the host's /proc included).
    let proc = root.join("proc");
    mount(Some("proc"), &proc, Some("proc"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC, none)
        .map_err(setup("mount /proc"))?;
    mount(none, &proc, none, ro | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC, none).map_err(setup("remount /proc read-only"))?;
    mount(Some("sysfs"), &root.join("sys"), Some("sysfs"), nosys, none).map_err(setup("mount /sys"))?;
    nix::unistd::pivot_root(root, &root.join("mnt")).map_err(setup("pivot_root"))?;
    nix::unistd::chdir("/").map_err(setup("chdir /"))?;
    umount2("/mnt", MntFlags::MNT_DETACH).map_err(setup("unmount the host's tree"))?;
    // The listener becomes fd 3, inherited across exec.
    let fd = listener.into_raw_fd();
    if fd != 3 {
        nix::unistd::dup2(fd, 3).map_err(setup("dup2 the listener"))?;
        nix::unistd::close(fd).map_err(setup("close the listener"))?;
    }
    let flags = nix::fcntl::fcntl(3, nix::fcntl::FcntlArg::F_GETFD).map_err(setup("F_GETFD"))?;
    let flags = nix::fcntl::FdFlag::from_bits_truncate(flags) - nix::fcntl::FdFlag::FD_CLOEXEC;
    nix::fcntl::fcntl(3, nix::fcntl::FcntlArg::F_SETFD(flags)).map_err(setup("F_SETFD"))?;
    let args: Vec<CString> = ["python3", "/sandq/sandq_runner.py", "--template"].iter().filter_map(|a| CString::new(*a).ok()).collect();
    let env: Vec<CString> =
        std::env::vars_os().filter_map(|(k, v)| CString::new(format!("{}={}", k.to_string_lossy(), v.to_string_lossy())).ok()).collect();
    let python = CString::new("/usr/bin/python3").map_err(|_| TemplateError::Exec(nix::Error::EINVAL))?;
    nix::unistd::execve(&python, &args, &env).map_err(TemplateError::Exec)
}

fn io_errno(e: &std::io::Error) -> nix::Error {
    nix::Error::from_raw(e.raw_os_error().unwrap_or(libc::EIO))
}
