//! The one module that makes raw system calls. Everything else in the worker is
//! `unsafe`-free (`unsafe_code` is denied workspace-wide and allowed only here).
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

/// Opens a pidfd for `pid` (`pidfd_open(2)`, Linux 5.3+). The fd becomes readable when the
/// process exits, and, unlike the pid, it cannot be recycled for another process.
///
/// # Errors
/// The kernel's error (`ESRCH` when the process is gone, `ENOSYS` on old kernels).
pub(crate) fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and a flags word, touches no memory of ours, and returns
    // either -1 (errno set) or a new fd that nothing else owns.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("pidfd out of range"))?;
    // SAFETY: `fd` was just returned by the kernel, is open, and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends SIGKILL to the process behind `pidfd` (`pidfd_send_signal(2)`, Linux 5.1+): never to
/// another process that reused its pid.
///
/// # Errors
/// The kernel's error (`ESRCH` when it has exited).
pub(crate) fn pidfd_kill(pidfd: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_send_signal takes a descriptor, a signal number, a null siginfo pointer
    // (the kernel fills in a default) and flags 0; it touches no memory of ours.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), libc::SIGKILL, std::ptr::null::<libc::siginfo_t>(), 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Brings the loopback interface of the calling thread's network namespace up
/// (`SIOCGIFFLAGS` then `SIOCSIFFLAGS` with `IFF_UP`). A new network namespace starts with `lo`
/// down, and a sandbox should reach its own 127.0.0.1.
///
/// # Errors
/// The kernel's error (`EPERM` without `CAP_NET_ADMIN` over the namespace).
pub(crate) fn loopback_up() -> io::Result<()> {
    // SAFETY: socket() takes three integers and returns a new fd or -1.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is plain old data (a name array and a union of integers); all zeros is a
    // valid value.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in request.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    use std::os::fd::AsRawFd;
    // SAFETY: SIOCGIFFLAGS reads `ifr_name` and writes `ifr_flags` inside `request`, which we own
    // and which outlives the call.
    if unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFFLAGS, &mut request) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: after SIOCGIFFLAGS the union holds `ifru_flags`; reading and writing it is sound.
    unsafe { request.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    // SAFETY: SIOCSIFFLAGS reads `ifr_name` and `ifr_flags` from `request`, which we own.
    if unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCSIFFLAGS, &request) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Moves up to `len` bytes from the pipe `from` to `to` without copying them through user
/// space (`splice(2)` with `SPLICE_F_NONBLOCK`): how the worker discards a stream's bytes past
/// its capture cap at a small fraction of the CPU a `read` costs (test:
/// an_output_flood_costs_the_worker_little_cpu in tests/hostile.rs).
///
/// # Errors
/// The kernel's error; `WouldBlock` when the pipe is empty.
pub(crate) fn splice_out(from: std::os::fd::BorrowedFd<'_>, to: std::os::fd::BorrowedFd<'_>, len: usize) -> io::Result<usize> {
    use nix::fcntl::{splice, SpliceFFlags};
    splice(from, None, to, None, len, SpliceFFlags::SPLICE_F_NONBLOCK | SpliceFFlags::SPLICE_F_MOVE).map_err(io::Error::from)
}

/// `CLOCK_REALTIME_COARSE` in nanoseconds since the epoch: the clock file timestamps come from
/// (`clock_gettime(2)`; cannot fail for this clock id, 0 if it did).
pub(crate) fn coarse_realtime_ns() -> i128 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_REALTIME_COARSE)
        .map_or(0, |t| i128::from(t.tv_sec()) * 1_000_000_000 + i128::from(t.tv_nsec()))
}

/// The host's boot-time and monotonic clocks (`CLOCK_BOOTTIME`, `CLOCK_MONOTONIC`), whole
/// seconds since boot, as the worker sees them (`clock_gettime(2)`; 0 if a clock could not be
/// read, which these ids cannot fail).
pub(crate) fn boot_and_monotonic_secs() -> (i64, i64) {
    let secs = |clock| nix::time::clock_gettime(clock).map_or(0, |t| t.tv_sec());
    (secs(nix::time::ClockId::CLOCK_BOOTTIME), secs(nix::time::ClockId::CLOCK_MONOTONIC))
}

/// Whether the kernel has time namespaces (`CONFIG_TIME_NS`, Linux 5.6+): `/proc/self/ns/time`
/// exists.
pub(crate) fn time_namespaces_supported() -> bool {
    std::path::Path::new("/proc/self/ns/time").exists()
}

/// Reads into `buf` from `fd` once (`read(2)`), for a non-blocking fd polled by the caller.
///
/// # Errors
/// The kernel's error; `WouldBlock` when nothing is there yet.
pub(crate) fn read_once(fd: std::os::fd::BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    nix::unistd::read(fd.as_raw_fd(), buf).map_err(io::Error::from)
}

/// Points the calling process's stdout and stderr (fds 1 and 2) at `/dev/null`, closing its
/// copies of whatever they were: the helper's last hold on the sandbox's output pipes, whose
/// end-of-file tells the worker the report is written (`sandbox::helper`).
///
/// # Errors
/// Opening `/dev/null`, or the kernel's error from `dup2`.
pub(crate) fn detach_stdio() -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let null = std::fs::OpenOptions::new().write(true).open("/dev/null")?;
    for target in [1, 2] {
        nix::unistd::dup2(null.as_raw_fd(), target).map_err(io::Error::from)?;
    }
    Ok(())
}

/// Grows the pipe behind `fd` to `bytes` (`F_SETPIPE_SZ`; the kernel rounds up to a power of
/// two of pages). Returns the new size.
///
/// # Errors
/// The kernel's error (`EPERM` past `/proc/sys/fs/pipe-max-size` without `CAP_SYS_RESOURCE`).
pub(crate) fn set_pipe_size(fd: std::os::fd::BorrowedFd<'_>, bytes: i32) -> io::Result<i32> {
    use nix::fcntl::{fcntl, FcntlArg};
    use std::os::fd::AsRawFd;
    fcntl(fd.as_raw_fd(), FcntlArg::F_SETPIPE_SZ(bytes)).map_err(io::Error::from)
}

/// Puts `fd` in non-blocking mode (`O_NONBLOCK`), keeping its other status flags.
///
/// # Errors
/// The kernel's error.
pub(crate) fn set_nonblocking(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    use std::os::fd::AsRawFd;
    let flags = OFlag::from_bits_truncate(fcntl(fd.as_raw_fd(), FcntlArg::F_GETFL).map_err(io::Error::from)?);
    fcntl(fd.as_raw_fd(), FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK)).map_err(io::Error::from)?;
    Ok(())
}

/// Registers the read end of a pipe with tokio's reactor (in non-blocking mode), for
/// [`read_once`] and [`splice_out`] driven by readiness.
///
/// # Errors
/// The kernel's error from `fcntl`, or the reactor's from registering.
pub(crate) fn async_pipe(fd: OwnedFd) -> io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    use std::os::fd::AsFd;
    set_nonblocking(fd.as_fd())?;
    // SAFETY: an `OwnedFd` is a valid open descriptor that it alone closes, on drop; while the
    // `AsyncFd` owns it, it stays open and `as_raw_fd` returns that same descriptor.
    unsafe { tokio::io::unix::AsyncFd::register(fd) }.map_err(|e| io::Error::other(e.to_string()))
}

/// A process holding a fresh user namespace whose owner is a dedicated host uid, for a
/// container to join (`linux.namespaces[user].path`). Dropping it lets the process exit (the
/// namespace lives on while the container's processes are in it) and reaps it.
///
/// Why: the kernel charges per-user counters of everything inside a user
/// namespace (inotify instances and watches, pending signals, POSIX message queue bytes...)
/// to the namespace's *owner* in the parent namespace as well. A namespace youki creates is
/// owned by host root, so one sandbox could exhaust root's counters for the host and for every
/// other sandbox. Owned by a uid of its own slot's range, a sandbox can only exhaust that uid's
/// (test: a_sandbox_cannot_exhaust_host_roots_per_user_limits in tests/hostile.rs).
#[derive(Debug)]
pub(crate) struct UsernsHolder {
    pid: nix::unistd::Pid,
    /// Write end of the pipe the holder blocks on (closed with the helper, should the helper
    /// die before it kills the holder; the holder also has `PR_SET_PDEATHSIG`).
    release: Option<OwnedFd>,
}

impl UsernsHolder {
    /// `/proc/<pid>/ns/user`, the path a spec's user namespace entry takes.
    pub(crate) fn ns_path(&self) -> std::path::PathBuf {
        std::path::PathBuf::from(format!("/proc/{}/ns/user", self.pid))
    }
}

impl Drop for UsernsHolder {
    fn drop(&mut self) {
        // The container's processes were forked from the helper and inherited the write end
        // too, so closing ours is not enough: kill the holder, then reap it.
        drop(self.release.take());
        let _ = nix::sys::signal::kill(self.pid, nix::sys::signal::Signal::SIGKILL);
        let _ = nix::sys::wait::waitpid(self.pid, None);
    }
}

/// Forks a holder that drops to host uid/gid `owner` (no supplementary groups) and unshares a
/// user namespace, then writes its id maps: container ids `0..size` are host ids
/// `host_base..host_base+size`. Must be called from a single-threaded process (the
/// `sandq-container` helper).
///
/// # Errors
/// The kernel's error from `pipe2`, `fork`, the holder's set-up (reported through a pipe), or
/// writing the maps.
pub(crate) fn spawn_userns_holder(owner: u32, host_base: u32, size: u32) -> io::Result<UsernsHolder> {
    use nix::fcntl::OFlag;
    use nix::unistd::{ForkResult, Gid, Uid};
    use std::io::{Read, Write};
    let (ready_r, ready_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(io::Error::from)?;
    let (hold_r, hold_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(io::Error::from)?;
    // SAFETY: the helper is single-threaded (no lock can be held by another thread across the
    // fork), and the child calls only async-signal-safe system calls (close, setgroups,
    // setres[ug]id, prctl, unshare, write, read, _exit) before it exits; it never returns into
    // the caller's code.
    match unsafe { nix::unistd::fork() }.map_err(io::Error::from)? {
        ForkResult::Child => {
            drop(ready_r);
            drop(hold_w);
            let setup = nix::unistd::setgroups(&[])
                .and_then(|()| nix::unistd::setresgid(Gid::from_raw(owner), Gid::from_raw(owner), Gid::from_raw(owner)))
                .and_then(|()| nix::unistd::setresuid(Uid::from_raw(owner), Uid::from_raw(owner), Uid::from_raw(owner)))
                // After the uid change, which clears it: die with the helper.
                .and_then(|()| nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL))
                .and_then(|()| nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUSER));
            let status = match setup {
                Ok(()) => 0u8,
                Err(e) => u8::try_from(e as i32).unwrap_or(255),
            };
            let mut ready = std::fs::File::from(ready_w);
            let _ = ready.write_all(&[status]);
            drop(ready);
            let mut hold = std::fs::File::from(hold_r);
            let mut byte = [0u8; 1];
            let _ = hold.read(&mut byte);
            // SAFETY: _exit ends the child at once, without running the parent's atexit
            // handlers or destructors of state it shares with the parent.
            unsafe { libc::_exit(0) }
        }
        ForkResult::Parent { child } => {
            drop(ready_w);
            drop(hold_r);
            let holder = UsernsHolder { pid: child, release: Some(hold_w) };
            let mut status = [255u8; 1];
            std::fs::File::from(ready_r).read_exact(&mut status)?;
            if status[0] != 0 {
                return Err(io::Error::other(format!(
                    "user namespace holder set-up failed: {}",
                    nix::errno::Errno::from_raw(i32::from(status[0]))
                )));
            }
            let map = format!("0 {host_base} {size}\n");
            for file in ["uid_map", "gid_map"] {
                std::fs::write(format!("/proc/{child}/{file}"), &map)
                    .map_err(|e| io::Error::other(format!("/proc/{child}/{file}: {e}")))?;
            }
            Ok(holder)
        }
    }
}

/// The seccomp program of `pid` (a stopped-and-resumed child of the caller or any process the
/// caller may trace), as the raw `struct sock_filter` array (8 bytes an instruction), read
/// with `PTRACE_SECCOMP_GET_FILTER` (index 0: the newest filter; a sandbox's init has one).
/// The process is seized, interrupted, read and detached: it goes on as before. Empty when
/// the process has no filter. Needs `CAP_SYS_ADMIN` and `CAP_SYS_PTRACE` (the helper is root).
///
/// # Errors
/// The kernel's error for the seize, the wait or the read (`EINVAL` on kernels without
/// `CONFIG_CHECKPOINT_RESTORE`).
pub(crate) fn seccomp_filter_of(pid: i32) -> io::Result<Vec<u8>> {
    const PTRACE_SECCOMP_GET_FILTER: libc::c_uint = 0x420c;
    let null = std::ptr::null_mut::<libc::c_void>();
    // SAFETY: PTRACE_SEIZE takes a pid and no memory of ours (addr and data are null/0).
    if unsafe { libc::ptrace(libc::PTRACE_SEIZE, pid, null, null) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let read = (|| {
        // SAFETY: PTRACE_INTERRUPT on a seized tracee; no memory of ours.
        if unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, pid, null, null) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut status = 0;
        // SAFETY: waitpid writes one int into `status`, which we own.
        if unsafe { libc::waitpid(pid, &mut status, libc::__WALL) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: with a null buffer the call only returns the program's length.
        let count = unsafe { libc::ptrace(PTRACE_SECCOMP_GET_FILTER, pid, null, null) };
        if count < 0 {
            let err = io::Error::last_os_error();
            return if err.raw_os_error() == Some(libc::ENOENT) { Ok(Vec::new()) } else { Err(err) };
        }
        let mut program = vec![0u8; usize::try_from(count).unwrap_or(0) * 8];
        // SAFETY: the kernel writes `count` sock_filter structs (8 bytes each) into `program`,
        // which holds exactly that many bytes and outlives the call.
        let again = unsafe { libc::ptrace(PTRACE_SECCOMP_GET_FILTER, pid, null, program.as_mut_ptr().cast::<libc::c_void>()) };
        if again != count {
            return Err(io::Error::other(format!("seccomp filter changed length ({count} then {again})")));
        }
        Ok(program)
    })();
    // SAFETY: PTRACE_DETACH of our tracee, signal 0; no memory of ours.
    let detached = unsafe { libc::ptrace(libc::PTRACE_DETACH, pid, null, null) };
    let program = read?;
    if detached < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(program)
}
