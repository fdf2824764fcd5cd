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

/// Brings the loopback interface of the calling thread's network namespace up
/// (`SIOCGIFFLAGS` then `SIOCSIFFLAGS` with `IFF_UP`). A new network namespace starts with `lo`
/// down, and a sandbox should reach its own 127.0.0.1.
///
/// # Errors
/// The kernel's error (`EPERM` without `CAP_NET_ADMIN` over the namespace).
pub fn loopback_up() -> io::Result<()> {
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
