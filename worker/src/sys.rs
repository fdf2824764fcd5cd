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
pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
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
