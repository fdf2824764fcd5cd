//! The `sandq-container` helper: a single-threaded process exec'd per container that drives
//! libcontainer through the whole lifecycle: create -> start -> wait -> stats -> delete.
//!
//! The pattern: pidfd before start (a recycled pid is never signalled), kill with `all = true`
//! (through the cgroup), reap the init ourselves, read the cgroup before delete (which removes
//! it). Its cost is timed in `docs/benchmarks.md` (Container cycle) by
//! `worker/benches/container_cycle.rs`.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use libcontainer::container::builder::ContainerBuilder;
use libcontainer::container::Container;
use libcontainer::signal::Signal;
use libcontainer::syscall::syscall::SyscallType;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::Signal as NixSignal;
use nix::sys::wait::{waitpid, WaitStatus};

use super::{cgroup, network, CgroupStats, Exit, SandboxReport, SandboxRequest};
use crate::sys;

/// Largest request line the helper reads, bytes.
const MAX_REQUEST_BYTES: usize = 64 * 1024;

fn chain(err: &dyn std::error::Error) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    message
}

/// Reads one `\n`-terminated line from `fd` without buffering past it (the rest of the pipe is
/// the control channel).
fn read_line(mut input: &File, max: usize) -> io::Result<Vec<u8>> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        if input.read(&mut byte)? == 0 || byte[0] == b'\n' {
            return Ok(line);
        }
        line.push(byte[0]);
        if line.len() > max {
            return Err(io::Error::other("request line too long"));
        }
    }
}

/// Entry point of `sandq-container`. Returns the process exit code.
pub fn main() -> i32 {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("run") => run_main(),
        Some("delete") if args.len() == 4 => {
            delete_by_id(Path::new(&args[2]), &args[3]);
            0
        }
        Some("template") if args.len() == 6 => {
            let paths: Vec<&Path> = args[2..6].iter().map(Path::new).collect();
            let error = super::template::launch(paths[0], paths[1], paths[2], paths[3]);
            eprintln!("sandq-container template: {error}");
            1
        }
        Some("cleanup") if args.len() == 3 => {
            let removed = cleanup(Path::new(&args[2]));
            network::release_stale();
            eprintln!("removed {removed} leftover containers");
            0
        }
        _ => {
            eprintln!(
                "usage: sandq-container run (request on stdin) | delete STATE_ROOT ID | cleanup STATE_ROOT | template ROOTFS RUNNER ROOT SOCKET"
            );
            2
        }
    }
}

fn run_main() -> i32 {
    // fd 0 is the request and control pipe; keep our own handle, the container gets its own
    // stdin file.
    let control = match std::io::stdin().as_fd().try_clone_to_owned() {
        Ok(fd) => File::from(fd),
        Err(_) => return 3,
    };
    let request: SandboxRequest = match read_line(&control, MAX_REQUEST_BYTES)
        .map_err(|e| e.to_string())
        .and_then(|line| serde_json::from_slice(&line).map_err(|e| e.to_string()))
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("sandq-container: bad request: {e}");
            return 2;
        }
    };
    let report = run(&request, &control);
    match write_report(&request.report_path, &report) {
        Ok(()) => 0,
        Err(_) => 4,
    }
}

/// Writes `report` to `path` whole or not at all (a temporary file renamed over it): the worker
/// may read it while the helper is still deleting the container, and reads it again after.
fn write_report(path: &Path, report: &SandboxReport) -> io::Result<()> {
    let bytes = serde_json::to_vec(report).map_err(io::Error::other)?;
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    File::create(&partial)?.write_all(&bytes)?;
    std::fs::rename(&partial, path)
}

/// Why the container's own user namespace could not be made ready ([`join_own_userns`]).
#[derive(Debug, thiserror::Error)]
enum UsernsError {
    /// The process holding the namespace could not be spawned.
    #[error("user namespace: {0}")]
    Holder(#[source] io::Error),
    /// The bundle's `config.json` could not be read.
    #[error("cannot read {}: {source}", path.display())]
    ReadSpec {
        /// `<bundle>/config.json`.
        path: PathBuf,
        /// The OCI spec error.
        #[source]
        source: oci_spec::OciSpecError,
    },
    /// The spec declares no user namespace whose path could be set.
    #[error("the spec has no user namespace to point at the holder's")]
    NoUserNamespace,
    /// The rewritten `config.json` could not be saved.
    #[error("cannot write {}: {source}", path.display())]
    WriteSpec {
        /// `<bundle>/config.json`.
        path: PathBuf,
        /// The OCI spec error.
        #[source]
        source: oci_spec::OciSpecError,
    },
}

/// Creates the user namespace of `map` owned by `map.host_base` ([`sys::spawn_userns_holder`])
/// and rewrites `<bundle>/config.json` so that the container joins it.
fn join_own_userns(bundle: &Path, map: super::spec::IdMap) -> Result<sys::UsernsHolder, UsernsError> {
    use oci_spec::runtime::{LinuxNamespaceType, Spec};
    let holder = sys::spawn_userns_holder(map.host_base, map.host_base, map.size).map_err(UsernsError::Holder)?;
    let config = bundle.join("config.json");
    let mut spec = Spec::load(&config).map_err(|source| UsernsError::ReadSpec { path: config.clone(), source })?;
    let user = spec
        .linux_mut()
        .as_mut()
        .and_then(|l| l.namespaces_mut().as_mut())
        .and_then(|n| n.iter_mut().find(|n| n.typ() == LinuxNamespaceType::User))
        .ok_or(UsernsError::NoUserNamespace)?;
    user.set_path(Some(holder.ns_path()));
    spec.save(&config).map_err(|source| UsernsError::WriteSpec { path: config.clone(), source })?;
    Ok(holder)
}

fn failed(step: &str, message: String) -> Exit {
    Exit::Failed { step: step.to_owned(), message }
}

/// Runs one container to completion and deletes it. Never panics on libcontainer errors: each
/// becomes [`Exit::Failed`]. Once the program has ended, the report (without the delete's) is
/// written and the helper's stdout and stderr detached before the delete (the protocol in
/// [`super`]).
pub fn run(request: &SandboxRequest, control: &File) -> SandboxReport {
    let mut report = SandboxReport {
        exit: Exit::Killed,
        stats: CgroupStats::default(),
        wall_ms: 0,
        create_us: 0,
        start_us: 0,
        delete_us: 0,
        fork_us: 0,
        delete_error: None,
        deleted: false,
    };
    let stdin = match File::open(request.stdin_path.as_deref().unwrap_or(Path::new("/dev/null"))) {
        Ok(f) => f,
        Err(e) => {
            report.exit = failed("create", format!("cannot open stdin file: {e}"));
            return report;
        }
    };
    let (stdout, stderr) = match (io::stdout().as_fd().try_clone_to_owned(), io::stderr().as_fd().try_clone_to_owned()) {
        (Ok(o), Ok(e)) => (o, e),
        _ => {
            report.exit = failed("create", "cannot duplicate stdout/stderr".into());
            return report;
        }
    };
    // A forked start's job process gets the same streams as a cold start's init.
    let fork_stdio = match request.fork.as_ref().map(|_| fork_stdio(request)).transpose() {
        Ok(stdio) => stdio,
        Err(e) => {
            report.exit = failed("create", format!("cannot open the forked job's streams: {e}"));
            return report;
        }
    };
    let t0 = Instant::now();
    // The user namespace, owned by the slot's own uid: made here, joined by the container.
    let holder = match request.userns.map(|map| join_own_userns(&request.bundle, map)).transpose() {
        Ok(holder) => holder,
        Err(e) => {
            report.exit = failed("create", e.to_string());
            return report;
        }
    };
    let built = ContainerBuilder::new(request.container_id.clone(), SyscallType::default())
        .with_root_path(request.state_root.clone())
        .and_then(|b| b.with_stdin(stdin).with_stdout(stdout).with_stderr(stderr).validate_id())
        .and_then(|b| b.as_init(&request.bundle).with_systemd(false).with_detach(true).build());
    // The container's processes are in the namespace now (or creation failed): the holder
    // can go.
    drop(holder);
    report.create_us = t0.elapsed().as_micros() as u64;
    let mut container = match built {
        Ok(c) => c,
        Err(e) => {
            report.exit = failed("create", chain(&e));
            // A half-created container may have left state behind.
            delete_by_id(&request.state_root, &request.container_id);
            return report;
        }
    };
    let mut address = None;
    report.exit = supervise(&mut container, request, control, fork_stdio.as_ref(), &mut report, &mut address);
    report.stats = cgroup::read(&request.cgroups_path);
    // The program's end is known and every process of the sandbox is gone: the report is
    // written now and the output pipes closed, so that the worker publishes the result while
    // the container is deleted; the report is written again, with the delete's, at the end.
    drop(fork_stdio);
    if write_report(&request.report_path, &report).is_ok() {
        let _ = sys::detach_stdio();
    }
    let t2 = Instant::now();
    if let Err(e) = container.delete(true) {
        report.delete_error = Some(chain(&e));
    }
    report.delete_us = t2.elapsed().as_micros() as u64;
    report.deleted = true;
    // The veth pair went with the container's network namespace; the address is free again.
    if let Some(address) = address {
        network::release_address(address);
    }
    report
}

/// The job's stdin, stdout and stderr for a forked start: the same file and pipes the
/// container's init got.
fn fork_stdio(request: &SandboxRequest) -> io::Result<(File, std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    let stdin = File::open(request.stdin_path.as_deref().unwrap_or(Path::new("/dev/null")))?;
    Ok((stdin, io::stdout().as_fd().try_clone_to_owned()?, io::stderr().as_fd().try_clone_to_owned()?))
}

/// Starts the container and waits for its init (or, for a forked start, for the job's process
/// forked into it), enforcing the timeout and the control channel.
fn supervise(
    container: &mut Container,
    request: &SandboxRequest,
    control: &File,
    fork_stdio: Option<&(File, std::os::fd::OwnedFd, std::os::fd::OwnedFd)>,
    report: &mut SandboxReport,
    address: &mut Option<std::net::Ipv4Addr>,
) -> Exit {
    let Some(pid) = container.pid() else {
        return failed("create", "container has no pid after create".into());
    };
    // The pidfd is opened before start so that the pid cannot be recycled under us.
    let pidfd = match sys::pidfd_open(pid.as_raw()) {
        Ok(fd) => fd,
        Err(e) => return failed("start", format!("pidfd_open: {e}")),
    };
    if let Err(e) = setup_network(pid.as_raw(), request, address) {
        kill_all(container);
        let _ = waitpid(pid, None);
        return failed("start", format!("cannot set up the sandbox's network: {e}"));
    }
    let t1 = Instant::now();
    if let Err(e) = container.start() {
        kill_all(container);
        let _ = waitpid(pid, None);
        return failed("start", chain(&e));
    }
    report.start_us = t1.elapsed().as_micros() as u64;
    let mut timeout_ms = request.timeout_ms;
    // A forked start: the job's process is forked from the template into the sandbox as soon
    // as it is made (off the job's critical path), and waits there for its job as an unforked
    // warm runner does; its end comes on the template's connection, the init being a holder.
    let mut forked = None;
    if let (Some(socket), Some((stdin, stdout, stderr))) = (request.fork.as_deref(), fork_stdio) {
        let t = Instant::now();
        match super::fork::fork_into(pid.as_raw(), request, socket, stdin, stdout.as_fd(), stderr.as_fd()) {
            Ok(f) => {
                report.fork_us = t.elapsed().as_micros() as u64;
                forked = Some(f);
            }
            Err(e) => {
                kill_all(container);
                let _ = waitpid(pid, None);
                return failed("fork", chain(&e));
            }
        }
    }
    if request.warm {
        // Started ahead of its job: no clock until the worker hands the job over.
        let watched = forked.as_ref().map_or(pidfd.as_fd(), super::fork::Forked::fd);
        match wait_for_go(watched, control) {
            Go::Start(ms) => timeout_ms = ms,
            Go::Exited => {
                // The warm runner (or the forked process) died before any job: report how,
                // like any exit.
                if let Some(f) = forked.as_mut() {
                    let exit = f.poll_end().unwrap_or(Exit::Killed);
                    kill_all(container);
                    let _ = waitpid(pid, None);
                    return exit;
                }
                return match waitpid(pid, None) {
                    Ok(WaitStatus::Exited(_, code)) => Exit::Exited { code },
                    Ok(WaitStatus::Signaled(_, signal, _)) => Exit::Signaled { signal: signal.as_str().to_owned() },
                    other => failed("wait", format!("warm sandbox ended: {other:?}")),
                };
            }
            Go::Stop(exit) => {
                kill_all(container);
                let _ = waitpid(pid, None);
                return exit;
            }
        }
    }
    let started = Instant::now();
    let deadline = started + Duration::from_millis(timeout_ms);
    let mut outcome: Option<Exit> = None;
    let mut forked_exit: Option<Exit> = None;
    loop {
        let now = Instant::now();
        if now >= deadline {
            outcome = Some(Exit::TimedOut);
            break;
        }
        let remaining = (deadline - now).as_millis().min(i32::MAX as u128) as i32;
        let watched = forked.as_ref().map_or(pidfd.as_fd(), super::fork::Forked::fd);
        let ready = poll_two(watched, control.as_fd(), remaining);
        match ready {
            Ok((true, _)) => match forked.as_mut() {
                None => break,
                Some(f) => {
                    if let Some(exit) = f.poll_end() {
                        forked_exit = Some(exit);
                        break;
                    }
                }
            },
            Ok((false, true)) => {
                let mut buf = [0u8; 64];
                match (&*control).read(&mut buf) {
                    Ok(0) | Err(_) => {
                        outcome = Some(Exit::Killed);
                        break;
                    }
                    Ok(n) if buf[..n].windows(4).any(|w| w == b"kill") => {
                        outcome = Some(Exit::Killed);
                        break;
                    }
                    Ok(_) => {}
                }
            }
            Ok((false, false)) => {}
            Err(e) => {
                outcome = Some(failed("wait", format!("poll: {e}")));
                break;
            }
        }
    }
    if outcome.is_some() || forked_exit.is_some() {
        // Timeout, kill request or error: kill every process of the cgroup, not just the init.
        // A forked job's end: what it left running goes as with a cold start's init, whose
        // exit ends its pid namespace.
        kill_all(container);
    }
    let status = waitpid(pid, None);
    report.wall_ms = started.elapsed().as_millis() as u64;
    if let Some(outcome) = outcome.or(forked_exit) {
        return outcome;
    }
    match status {
        Ok(WaitStatus::Exited(_, code)) => Exit::Exited { code },
        Ok(WaitStatus::Signaled(_, signal, _)) => Exit::Signaled { signal: signal.as_str().to_owned() },
        Ok(other) => failed("wait", format!("unexpected wait status {other:?}")),
        Err(e) => failed("wait", format!("waitpid: {e}")),
    }
}

/// How the wait of a warm sandbox for its job ended.
enum Go {
    /// `go <timeout_ms>`: the job is handed over.
    Start(u64),
    /// The sandbox's init exited first.
    Exited,
    /// `kill`, end-of-file or an error: stop the container with this exit.
    Stop(Exit),
}

/// Waits without a deadline for the control line `go <timeout_ms>`, a kill, or the init's exit.
fn wait_for_go(pidfd: BorrowedFd<'_>, control: &File) -> Go {
    let mut line = Vec::new();
    loop {
        match poll_two(pidfd, control.as_fd(), -1) {
            Ok((true, _)) => return Go::Exited,
            Ok((false, true)) => {
                let mut buf = [0u8; 64];
                match (&*control).read(&mut buf) {
                    Ok(0) | Err(_) => return Go::Stop(Exit::Killed),
                    Ok(n) => line.extend_from_slice(&buf[..n]),
                }
                if line.windows(4).any(|w| w == b"kill") || line.len() > 256 {
                    return Go::Stop(Exit::Killed);
                }
                if let Some(end) = line.iter().position(|b| *b == b'\n') {
                    let text = String::from_utf8_lossy(&line[..end]).into_owned();
                    return match text.strip_prefix("go ").and_then(|ms| ms.trim().parse().ok()) {
                        Some(ms) => Go::Start(ms),
                        None => Go::Stop(failed("wait", format!("bad control line {text:?}"))),
                    };
                }
            }
            Ok((false, false)) => {}
            Err(e) => return Go::Stop(failed("wait", format!("poll: {e}"))),
        }
    }
}

/// Polls the pidfd and the control fd; returns (exited, control readable).
fn poll_two(pidfd: BorrowedFd<'_>, control: BorrowedFd<'_>, timeout_ms: i32) -> nix::Result<(bool, bool)> {
    let mut fds = [PollFd::new(pidfd, PollFlags::POLLIN), PollFd::new(control, PollFlags::POLLIN)];
    let timeout = PollTimeout::try_from(timeout_ms).unwrap_or(PollTimeout::MAX);
    match poll(&mut fds, timeout) {
        Ok(_) => {}
        Err(nix::errno::Errno::EINTR) => return Ok((false, false)),
        Err(e) => return Err(e),
    }
    let exited = fds[0].revents().is_some_and(|r| !r.is_empty());
    let control_ready = fds.get(1).and_then(|f| f.revents()).is_some_and(|r| !r.is_empty());
    Ok((exited, control_ready))
}

/// Why a sandbox's network namespace could not be set up ([`setup_network`]).
#[derive(Debug, thiserror::Error)]
enum NetworkSetupError {
    /// Reserving an address, the veth pair or the configuration inside failed.
    #[error(transparent)]
    Network(#[from] network::NetworkError),
    /// The helper's own network namespace could not be opened (to come back to).
    #[error("own netns: {0}")]
    OwnNamespace(#[source] io::Error),
    /// The container's network namespace (`/proc/<pid>/ns/net`) could not be opened.
    #[error("sandbox netns: {0}")]
    SandboxNamespace(#[source] io::Error),
    /// `setns` into the container's network namespace failed.
    #[error("setns: {0}")]
    Enter(#[source] nix::errno::Errno),
    /// `lo` could not be brought up inside (the `SIOCSIFFLAGS` ioctl failed).
    #[error("SIOCSIFFLAGS: {0}")]
    Loopback(#[source] io::Error),
    /// `setns` back into the helper's own network namespace failed.
    #[error("setns back: {0}")]
    Leave(#[source] nix::errno::Errno),
}

/// Sets up the network namespace of `pid` (the created, not yet started init): `lo` up, and
/// for an outbound job a veth on the host bridge with a reserved address. The helper is
/// single-threaded, so `setns` moves the whole helper (and the `ip` commands it runs) there
/// and back.
fn setup_network(pid: i32, request: &SandboxRequest, address: &mut Option<std::net::Ipv4Addr>) -> Result<(), NetworkSetupError> {
    use nix::sched::{setns, CloneFlags};
    let mut device = None;
    if request.outbound {
        let owner = request.state_root.join(&request.container_id);
        let reserved = network::reserve_address(&owner)?;
        *address = Some(reserved);
        device = Some((network::attach(pid, &owner)?, reserved));
    }
    let own = File::open("/proc/self/ns/net").map_err(NetworkSetupError::OwnNamespace)?;
    let target = File::open(format!("/proc/{pid}/ns/net")).map_err(NetworkSetupError::SandboxNamespace)?;
    setns(&target, CloneFlags::CLONE_NEWNET).map_err(NetworkSetupError::Enter)?;
    let inside = sys::loopback_up().map_err(NetworkSetupError::Loopback).and_then(|()| match &device {
        Some((name, reserved)) => network::configure_inside(name, *reserved).map_err(NetworkSetupError::from),
        None => Ok(()),
    });
    setns(&own, CloneFlags::CLONE_NEWNET).map_err(NetworkSetupError::Leave)?;
    inside
}

fn kill_all(container: &mut Container) {
    // all = true kills through the cgroup, so a recycled init pid is never hit.
    let _ = container.kill(Signal::from(NixSignal::SIGKILL), true);
}

fn delete_by_id(state_root: &Path, id: &str) {
    if let Ok(mut c) = Container::load(state_root.join(id)) {
        let _ = c.delete(true);
    }
}

/// Deletes (with force: kills, removes cgroups and state) every container under `state_root`,
/// left by a worker that died. Returns how many were removed.
pub fn cleanup(state_root: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(state_root) else { return 0 };
    let mut removed = 0;
    let mut ids = Vec::new();
    for entry in entries.flatten() {
        let dir: PathBuf = entry.path();
        ids.push(entry.file_name());
        match Container::load(dir.clone()) {
            Ok(mut c) => {
                if c.delete(true).is_ok() {
                    removed += 1;
                } else {
                    let _ = std::fs::remove_dir_all(&dir);
                }
            }
            Err(_) => {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
    // The dead worker's helpers may still be killing their containers (they do so when their
    // control pipe closes), racing this delete for the cgroups: remove what is left once the
    // processes are gone (a cgroup with processes cannot be removed), for up to 5 s.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left: Vec<PathBuf> =
            ids.iter().flat_map(|id| cgroup::dirs(&crate::layout::cgroup_path(&id.to_string_lossy()))).filter(|d| d.exists()).collect();
        for dir in &left {
            let _ = std::fs::remove_dir(dir);
        }
        if left.iter().all(|d| !d.exists()) || Instant::now() >= deadline {
            return removed;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
