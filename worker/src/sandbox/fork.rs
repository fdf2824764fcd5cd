//! The forked start, helper side: moves a process forked from the pre-imported template
//! (`oci-bundles/runner/sandq_nb/template.py`) into a sandbox whose init is only a holder
//! (`sleep infinity`), made by libcontainer exactly as a cold start's. The design and its
//! threat analysis are in `docs/threat-model.md` ("Forked sandboxes").
//!
//! What the helper hands the template's child, over the template's socket, comes from the
//! sandbox itself, never from the template: the init's namespaces (opened through
//! `/proc/<pid>/ns` after the pidfd pinned the pid), its seccomp program read back from the
//! init (`PTRACE_SECCOMP_GET_FILTER`: byte for byte what libcontainer loaded), and the
//! bundle's `config.json` (user, groups, umask, rlimits, cwd). The job's process is moved into
//! the job's cgroup by the helper before it may go on.

use std::fs::File;
use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use oci_spec::runtime::Spec;

use super::{cgroup, Exit, SandboxRequest};
use crate::sys;

/// The namespaces the job's process joins, the user namespace first (it owns the others, and
/// joining it first gives the capabilities the other joins need, as `nsenter` does).
const NAMESPACES: [&str; 8] = ["user", "mnt", "pid", "net", "ipc", "uts", "cgroup", "time"];

/// How long the template may take to fork and report its child's pid.
const FORK_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a job could not be forked into its sandbox (the sandbox is then killed and deleted; the
/// job is retried like any infrastructure failure).
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    /// The sandbox init's seccomp program could not be read back.
    #[error("cannot read the sandbox's seccomp program: {0}")]
    Seccomp(#[source] io::Error),
    /// A namespace of the sandbox's init could not be opened.
    #[error("cannot open the sandbox's {name} namespace: {source}")]
    Namespace {
        /// `user`, `mnt`, ...
        name: &'static str,
        /// The open error.
        #[source]
        source: io::Error,
    },
    /// The bundle's `config.json` could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Spec {
        /// `<bundle>/config.json`.
        path: PathBuf,
        /// The OCI spec error.
        #[source]
        source: oci_spec::OciSpecError,
    },
    /// The template's socket could not be reached or talked to.
    #[error("template at {}: {source}", path.display())]
    Template {
        /// The template's socket.
        path: PathBuf,
        /// The connect, send or read error.
        #[source]
        source: io::Error,
    },
    /// The template's child said something else than the protocol's lines (or `error ...`).
    #[error("template: {0}")]
    Protocol(String),
    /// The job's process could not be moved into the job's cgroup.
    #[error("cannot move the job's process into {}: {source}", path.display())]
    Cgroup {
        /// A `cgroup.procs` file.
        path: PathBuf,
        /// The write error.
        #[source]
        source: io::Error,
    },
}

/// The request the template's child reads (`template.py`, `_child`).
#[derive(serde::Serialize)]
struct Message {
    namespaces: Vec<&'static str>,
    uid: u32,
    gid: u32,
    /// `None`: the spec names no additional gids and, as libcontainer, the groups are left as
    /// inherited (the worker's, as for a cold start's init).
    groups: Option<Vec<u32>>,
    umask: Option<u32>,
    /// (`RLIMIT_NOFILE`, soft, hard).
    rlimits: Vec<(String, u64, u64)>,
    cwd: String,
    /// The seccomp program, hex (empty: none).
    seccomp: String,
}

/// A job's process running in its sandbox: the connection to the template's child, which
/// reports the process's end.
pub struct Forked {
    stream: UnixStream,
    /// What was read of the end line so far.
    line: Vec<u8>,
}

impl Forked {
    /// The fd to poll for the end of the job's process.
    pub fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.stream.as_fd()
    }

    /// Reads what is readable; `Some` once the end line is complete (or the template's child
    /// is gone without one).
    pub fn poll_end(&mut self) -> Option<Exit> {
        let mut buf = [0u8; 128];
        match self.stream.read(&mut buf) {
            Ok(0) | Err(_) => Some(Exit::Failed { step: "wait".into(), message: "the template's child ended without a report".into() }),
            Ok(n) => {
                self.line.extend_from_slice(&buf[..n]);
                let end = self.line.iter().position(|b| *b == b'\n')?;
                let text = String::from_utf8_lossy(&self.line[..end]).into_owned();
                Some(parse_end(&text))
            }
        }
    }
}

/// The exit a template's end line reports.
fn parse_end(text: &str) -> Exit {
    if let Some(code) = text.strip_prefix("exit ").and_then(|c| c.trim().parse().ok()) {
        return Exit::Exited { code };
    }
    if let Some(number) = text.strip_prefix("signal ").and_then(|c| c.trim().parse::<i32>().ok()) {
        let signal = nix::sys::signal::Signal::try_from(number).map_or_else(|_| format!("signal {number}"), |s| s.as_str().to_owned());
        return Exit::Signaled { signal };
    }
    Exit::Failed { step: "wait".into(), message: format!("template: {text}") }
}

/// Forks the job's process from the template at `socket` into the sandbox whose init is
/// `init_pid`, with `stdin`, `stdout` and `stderr` as its standard streams, and lets it go on
/// once it is in the job's cgroup.
///
/// # Errors
/// [`ForkError`]; the caller kills the sandbox (the job's process, if any, is in it or
/// waiting on a gate that closes with the template's child).
pub fn fork_into(
    init_pid: i32,
    request: &SandboxRequest,
    socket: &Path,
    stdin: &File,
    stdout: BorrowedFd<'_>,
    stderr: BorrowedFd<'_>,
) -> Result<Forked, ForkError> {
    let config = request.bundle.join("config.json");
    let spec = Spec::load(&config).map_err(|source| ForkError::Spec { path: config.clone(), source })?;
    let process = spec.process().as_ref();
    let seccomp = match spec.linux().as_ref().and_then(|l| l.seccomp().as_ref()) {
        Some(_) => sys::seccomp_filter_of(init_pid).map_err(ForkError::Seccomp)?,
        None => Vec::new(),
    };
    let mut names = Vec::new();
    let mut namespaces = Vec::new();
    for name in NAMESPACES {
        match File::open(format!("/proc/{init_pid}/ns/{name}")) {
            Ok(f) => {
                names.push(name);
                namespaces.push(f);
            }
            // A kernel without time namespaces: the sandbox has none either.
            Err(e) if name == "time" && e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => return Err(ForkError::Namespace { name, source }),
        }
    }
    let user = process.map(|p| p.user().clone()).unwrap_or_default();
    let message = Message {
        namespaces: names,
        uid: user.uid(),
        gid: user.gid(),
        groups: user.additional_gids().clone().filter(|g| !g.is_empty()),
        umask: user.umask(),
        rlimits: process
            .and_then(|p| p.rlimits().clone())
            .unwrap_or_default()
            .iter()
            .map(|r| (r.typ().to_string(), r.soft(), r.hard()))
            .collect(),
        cwd: process.map_or_else(|| "/".to_owned(), |p| p.cwd().to_string_lossy().into_owned()),
        seccomp: seccomp.iter().map(|b| format!("{b:02x}")).collect(),
    };
    let body = serde_json::to_vec(&message).map_err(|e| ForkError::Protocol(e.to_string()))?;
    let template = |source: io::Error| ForkError::Template { path: socket.to_path_buf(), source };
    let mut stream = UnixStream::connect(socket).map_err(template)?;
    stream.set_read_timeout(Some(FORK_TIMEOUT)).map_err(template)?;
    let mut framed = u32::try_from(body.len()).map_err(|_| ForkError::Protocol("request too large".into()))?.to_le_bytes().to_vec();
    framed.extend_from_slice(&body);
    let mut fds: Vec<RawFd> = namespaces.iter().map(AsRawFd::as_raw_fd).collect();
    fds.extend([stdin.as_raw_fd(), stdout.as_raw_fd(), stderr.as_raw_fd()]);
    let sent = sendmsg::<()>(stream.as_raw_fd(), &[IoSlice::new(&framed)], &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None)
        .map_err(|e| template(e.into()))?;
    stream.write_all(&framed[sent..]).map_err(template)?;
    drop(namespaces);
    let line = read_line(&mut stream).map_err(template)?;
    let pid: i32 = match line.strip_prefix("pid ").and_then(|p| p.trim().parse().ok()) {
        Some(pid) => pid,
        None => return Err(ForkError::Protocol(line)),
    };
    // The hierarchies libcontainer made the job's cgroup in (on a hybrid host not the
    // unified one, where the job's process stays in the template's, as a cold init stays in
    // the helper's).
    for dir in cgroup::dirs(&request.cgroups_path).into_iter().filter(|d| d.is_dir()) {
        let path = dir.join("cgroup.procs");
        std::fs::write(&path, pid.to_string()).map_err(|source| ForkError::Cgroup { path, source })?;
    }
    stream.write_all(b"go\n").map_err(template)?;
    stream.set_read_timeout(None).map_err(template)?;
    Ok(Forked { stream, line: Vec::new() })
}

/// Reads one short `\n`-terminated line (at most 4 KiB), byte by byte: nothing past it is
/// consumed.
fn read_line(stream: &mut UnixStream) -> io::Result<String> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < 4096 {
        if stream.read(&mut byte)? == 0 {
            break;
        }
        if byte[0] == b'\n' {
            return Ok(String::from_utf8_lossy(&line).into_owned());
        }
        line.push(byte[0]);
    }
    Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("no line from the template ({:?})", String::from_utf8_lossy(&line))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_lines_become_exits() {
        assert_eq!(parse_end("exit 3"), Exit::Exited { code: 3 });
        assert_eq!(parse_end("signal 9"), Exit::Signaled { signal: "SIGKILL".into() });
        assert!(matches!(parse_end("error boom"), Exit::Failed { .. }));
        assert!(matches!(parse_end("exit x"), Exit::Failed { .. }));
    }
}
