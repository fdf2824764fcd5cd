//! The hostile programs of `tests/hostile/` (`tests/hostile/CASES.md`), each asserting what
//! its header says, then that nothing of the job is left on the host and that the
//! next ordinary job still runs. Run one at a time (they measure the host).
//!
//! `leave_secret.py` runs without sessions here (sessions are issue 5): one job's files are
//! never visible to the next.

use std::path::Path;

use sandq_client::Client;
use sandq_schemas::{JobResult, JobStatus, Sku};
use sandq_tests::{
    client, python_job, repo_root, run, service_config, service_port, worker_alive, worker_data_dir, worker_id, worker_state_dir,
};
use tokio::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::const_new(());

fn case(name: &str) -> String {
    std::fs::read_to_string(repo_root().join("tests/hostile").join(name)).expect("hostile case")
}

async fn run_case(client: &mut Client, name: &str, timeout: &str, stdin: Option<&[u8]>) -> JobResult {
    run_program(client, name, &case(name), timeout, stdin).await
}

/// Runs `code` (called `name` in failure messages) as [`run_case`] runs a case: then checks
/// that nothing of the job is left, that the worker lives and that an ordinary job runs.
async fn run_program(client: &mut Client, name: &str, code: &str, timeout: &str, stdin: Option<&[u8]>) -> JobResult {
    // Through the forked path (the default for notebook jobs).
    let make = || {
        let mut spec = python_job(code, Sku::S);
        spec.timeout = Some(timeout.to_owned());
        spec.stdin = stdin.map(<[u8]>::to_vec);
        spec
    };
    let result = run_through(client, name, make, |s| s.forked, "forked").await;
    let next = run(client, &python_job("print(sum(range(10)))", Sku::S)).await;
    assert_eq!(next.status, JobStatus::Succeeded, "the job after {name} failed: {next:?}");
    assert_eq!(next.stdout.text, "45\n");
    result
}

/// [`run_program`] in script mode, through a warm sandbox for scripts (its init `exec`s the
/// program at the handover).
async fn run_script_warm(client: &mut Client, name: &str, timeout: &str) -> JobResult {
    let make = || {
        let mut spec = python_job(&case(name), Sku::S);
        spec.mode = Some(sandq_schemas::RunMode::Script);
        spec.timeout = Some(timeout.to_owned());
        spec
    };
    run_through(client, name, make, |s| s.warm && !s.forked, "in a warm script sandbox").await
}

/// Runs `make`'s job until its sandbox is one `taken` accepts (`path` in the message): a case
/// that found no warm sandbox ready (its refill still starting) runs again, at most 5 times,
/// each checked to leave nothing behind; then that the worker lives.
async fn run_through(
    client: &mut Client,
    name: &str,
    make: impl Fn() -> sandq_schemas::JobSpec,
    taken: impl Fn(&sandq_schemas::SandboxStart) -> bool,
    path: &str,
) -> JobResult {
    let mut attempts = 0;
    let (spec, result) = loop {
        let spec = make();
        let result = run(client, &spec).await;
        attempts += 1;
        if result.sandbox.as_ref().is_some_and(&taken) || attempts == 5 {
            break (spec, result);
        }
        assert_no_leftovers(&spec.job_id);
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    };
    assert!(result.sandbox.as_ref().is_some_and(&taken), "{name} did not run {path} in 5 tries: {:?}", result.sandbox);
    assert_no_leftovers(&spec.job_id);
    assert!(worker_alive(), "the worker died during {name}");
    result
}

/// The cases about the sandbox's own walls, as scripts in warm sandboxes (the program exec'd
/// by the sandbox's waiter): the same outcomes as above, and the program is the sandbox's only
/// process.
#[tokio::test]
async fn the_sandbox_holds_for_a_script_in_a_warm_sandbox() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let view = run_script_warm(&mut client, "proc_view.py", "30s").await;
    let out = &view.stdout.text;
    assert!(out.starts_with("pids: ['1']\n"), "other processes are visible:\n{out}");
    for line in ["Seccomp:\t2", "NoNewPrivs:\t1", "CapEff:\t0000000000000000"] {
        assert!(out.contains(line), "no {line:?}:\n{out}");
    }
    let privileged = run_script_warm(&mut client, "privileged_ops.py", "30s").await;
    let lines: Vec<&str> = privileged.stdout.text.lines().collect();
    assert_eq!(lines.len(), 16, "{}", privileged.stdout.text);
    assert!(lines.iter().all(|l| !l.contains("RETURNED") && !l.ends_with("-> 0")), "{}", privileged.stdout.text);
    let kill = run_script_warm(&mut client, "kill_everything.py", "30s").await;
    assert_eq!(kill.status, JobStatus::Failed);
    assert!(kill.stderr.text.contains("ProcessLookupError"), "{}", kill.stderr.text);
    let env = run_script_warm(&mut client, "env_leak.py", "30s").await;
    let config = service_config();
    for secret in [&config.s3.access_key_id, &config.s3.secret_access_key, &config.amqp.url, &config.redis.url] {
        assert!(!env.stdout.text.contains(secret.as_str()), "the sandbox sees {secret:?}");
    }
    let hog = run_script_warm(&mut client, "memory_hog.py", "60s").await;
    assert_eq!(hog.status, JobStatus::OomKilled, "{hog:?}");
    let daemon = run_script_warm(&mut client, "orphan_daemon.py", "60s").await;
    assert_eq!(daemon.stdout.text, "main done\n");
    let spin = run_script_warm(&mut client, "cpu_spin.py", "3s").await;
    assert_eq!((spin.status, spin.stdout.text.as_str()), (JobStatus::TimedOut, "starting\n"));
    let next = run(&mut client, &python_job("print(sum(range(10)))", Sku::S)).await;
    assert_eq!(next.stdout.text, "45\n");
}

fn entries_naming(dir: &Path, job_id: &str) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|name| name.contains(job_id)).collect()
        })
        .unwrap_or_default()
}

/// The container id the worker gave `job_id`; never derived from the job id.
fn container_of(job_id: &str) -> String {
    let id = sandq_tests::container_id_in_log(&sandq_tests::worker_log(), job_id)
        .unwrap_or_else(|| panic!("no container id logged for {job_id}"));
    assert!(!id.contains(job_id), "container id {id} names the job");
    id
}

/// No job dir, container state, cgroup, process or mount of the job is left, within 10 s of its
/// result (the worker removes the job dir right after storing the result).
fn assert_no_leftovers(job_id: &str) {
    let container = container_of(job_id);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let left = leftovers_of(&container);
        if left.is_empty() {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "left of job {job_id} (container {container}): {left:?}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// What is left of container `container` on the host (every host name of a job derives from
/// its container id).
fn leftovers_of(container: &str) -> Vec<String> {
    let mut left = Vec::new();
    let id = worker_id();
    for dir in [worker_data_dir().join(&id), worker_state_dir().join(&id)] {
        left.extend(entries_naming(&dir, container).into_iter().map(|e| format!("{} in {}", e, dir.display())));
    }
    for dir in ["/sys/fs/cgroup/memory/sandq", "/sys/fs/cgroup/pids/sandq", "/sys/fs/cgroup/cpu/sandq", "/sys/fs/cgroup/sandq"] {
        left.extend(entries_naming(Path::new(dir), container).into_iter().map(|e| format!("cgroup {e} in {dir}")));
    }
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        if std::fs::read_to_string(entry.path().join("cgroup")).is_ok_and(|c| c.contains(container)) {
            left.push(format!("process {:?}", entry.file_name()));
        }
    }
    if std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo").contains(container) {
        left.push("a mount".into());
    }
    left
}

#[tokio::test]
async fn cpu_spin_times_out_and_keeps_its_output() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "cpu_spin.py", "3s", None).await;
    assert_eq!(result.status, JobStatus::TimedOut);
    assert_eq!(result.signal.as_deref(), Some("SIGKILL"));
    assert_eq!(result.stdout.text, "starting\n");
    let usage = result.usage.expect("usage");
    assert!(usage.wall_ms >= 3000 && usage.wall_ms < 10_000, "killed at the deadline, not later: {usage:?}");
}

#[tokio::test]
async fn ignoring_sigterm_does_not_extend_the_job() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "ignore_sigterm.py", "2s", None).await;
    assert_eq!(result.status, JobStatus::TimedOut);
    assert!(result.usage.expect("usage").wall_ms < 10_000);
}

#[tokio::test]
async fn fork_bomb_stays_capped_and_ends() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "fork_bomb.py", "5s", None).await;
    // The pids limit, the timeout or (forking copies of the notebook runner) the memory limit.
    assert!(matches!(result.status, JobStatus::TimedOut | JobStatus::Failed | JobStatus::OomKilled), "{result:?}");
}

#[tokio::test]
async fn memory_hog_is_oom_killed() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "memory_hog.py", "60s", None).await;
    assert_eq!(result.status, JobStatus::OomKilled, "{result:?}");
    assert!(result.reason.unwrap_or_default().contains("memory limit"));
}

#[tokio::test]
async fn oom_of_a_child_is_reported_even_with_exit_code_zero() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "memory_hog_child.py", "60s", None).await;
    assert_eq!(result.status, JobStatus::OomKilled, "{result:?}");
    assert_eq!(result.exit_code, Some(0));
    assert_eq!(result.stdout.text, "parent finished\n");
}

#[tokio::test]
async fn environment_holds_no_credentials_or_service_addresses() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "env_leak.py", "30s", None).await;
    assert_eq!(result.status, JobStatus::Succeeded);
    let config = service_config();
    let env = &result.stdout.text;
    for secret in [&config.s3.access_key_id, &config.s3.secret_access_key, &config.amqp.url, &config.redis.url, &config.s3.endpoint] {
        assert!(!secret.is_empty() && !env.contains(secret.as_str()), "the sandbox sees {secret:?}");
    }
    let s3_port = format!(":{}", service_port(&config.s3.endpoint));
    for marker in ["amqp://", "redis://", s3_port.as_str(), "AWS_", "SANDQ__", "SANDQ_CONFIG"] {
        assert!(!env.contains(marker), "the sandbox sees {marker:?}:\n{env}");
    }
}

#[tokio::test]
async fn kill_everything_only_reaches_the_job() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "kill_everything.py", "30s", None).await;
    // kill(-1) from the sandbox's pid 1 finds no other process: ESRCH.
    assert_eq!(result.status, JobStatus::Failed);
    assert!(result.stderr.text.contains("ProcessLookupError"), "{}", result.stderr.text);
}

#[tokio::test]
async fn orphan_daemon_does_not_hold_the_job() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "orphan_daemon.py", "60s", None).await;
    assert_eq!(result.status, JobStatus::Succeeded);
    assert_eq!(result.stdout.text, "main done\n");
    assert!(result.usage.expect("usage").wall_ms < 10_000, "waited for the daemon");
}

#[tokio::test]
async fn network_probe_cannot_reach_host_services() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    // The ports of the services the tests use, on the probe's stdin (CI's are not the defaults).
    let config = service_config();
    let ports = [&config.amqp.url, &config.redis.url, &config.s3.endpoint].map(|url| service_port(url).to_string()).join(" ");
    let result = run_case(&mut client, "network_probe.py", "30s", Some(ports.as_bytes())).await;
    assert_eq!(result.status, JobStatus::Succeeded);
    assert!(!result.stdout.text.contains("CONNECTED"), "{}", result.stdout.text);
    assert_eq!(result.stdout.text.matches("blocked").count(), 4, "{}", result.stdout.text);
}

#[tokio::test]
async fn loopback_works_inside_the_sandbox_only() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let code = "import socket\nsrv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(1)\n\
                c = socket.create_connection(srv.getsockname(), timeout=2); a, _ = srv.accept()\n\
                c.sendall(b'ping'); print(a.recv(4).decode())\n";
    let result = run(&mut client, &python_job(code, Sku::S)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    assert_eq!(result.stdout.text, "ping\n");
}

#[tokio::test]
async fn privileged_operations_all_fail() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "privileged_ops.py", "30s", None).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    let lines: Vec<&str> = result.stdout.text.lines().collect();
    assert_eq!(lines.len(), 16, "{}", result.stdout.text);
    for line in lines {
        assert!(!line.contains("RETURNED") && !line.ends_with("-> 0"), "succeeded in the sandbox: {line}");
    }
}

#[tokio::test]
async fn seccomp_user_namespace_and_capabilities_are_in_force() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "proc_view.py", "30s", None).await;
    assert_eq!(result.status, JobStatus::Succeeded);
    let out = &result.stdout.text;
    // A forked start's sandbox holds two processes, both its own: its init, the holder, and
    // the job (docs/threat-model.md, "Forked sandboxes"); a cold start's only the job.
    let forked = result.sandbox.is_some_and(|s| s.forked);
    let expected = if forked { "pids: ['1', '2']\n1 b'/bin/sleep infinity '\n" } else { "pids: ['1']\n" };
    assert!(out.starts_with(expected), "other processes are visible (forked: {forked}):\n{out}");
    assert!(out.contains("Seccomp:\t2"), "no seccomp filter:\n{out}");
    assert!(out.contains("NoNewPrivs:\t1"));
    assert!(out.contains("CapEff:\t0000000000000000"));
    let uid_map: Vec<&str> = out.lines().find(|l| l.trim_start().starts_with('0')).expect("uid_map line").split_whitespace().collect();
    // Each consumer slot and warm sandbox has its own range of 65,536 ids from the configured
    // base on (default 0x7000_0000: above Debian's subordinate ids and systemd's containers).
    let first: u64 = std::env::var("SANDQ__WORKER__USERNS_HOST_BASE").map_or(0x7000_0000, |v| v.parse().expect("base"));
    let base: u64 = uid_map[1].parse().expect("host base");
    assert!(
        uid_map[0] == "0" && uid_map[2] == "65536" && base >= first && (base - first).is_multiple_of(65_536),
        "container root is not an unprivileged host uid: {uid_map:?}"
    );
    // A syscall outside the allowlist fails with EPERM; namespace-creating clone too.
    let code = "import ctypes, errno, os, signal\nlibc = ctypes.CDLL(None, use_errno=True)\n\
                r = libc.syscall(56, 0x10000000 | signal.SIGCHLD, 0, 0, 0, 0)\n\
                if r == 0: os._exit(0)\n\
                print('clone', r, errno.errorcode[ctypes.get_errno()])\n\
                print('keyctl', libc.syscall(250, 0, 0, 0, 0, 0), errno.errorcode[ctypes.get_errno()])\n\
                open('f', 'w').close()\n\
                try:\n    os.chmod('f', 0o4755); print('setuid allowed')\n\
                except PermissionError: print('setuid refused')\n\
                pid = os.fork()\n\
                if pid == 0: os._exit(3)\n\
                print('fork', os.waitpid(pid, 0)[1] >> 8)\n";
    let result = run(&mut client, &python_job(code, Sku::S)).await;
    assert_eq!(result.stdout.text, "clone -1 EPERM\nkeyctl -1 EPERM\nsetuid refused\nfork 3\n", "{}", result.stderr.text);
}

/// A thread's scheduling policy may be set, as Docker's profile allows (libzmq sets it for each
/// of its threads and aborts on EPERM: a Jupyter kernel could not start), but only to what an
/// unprivileged process may have: no real-time policy (RLIMIT_RTPRIO 0, no CAP_SYS_NICE) and no
/// higher priority (RLIMIT_NICE 0).
#[tokio::test]
async fn scheduling_policies_are_settable_but_never_real_time_or_higher_priority() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let code = r#"
import errno, os
def attempt(f):
    try:
        f()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
print("fifo", attempt(lambda: os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))))
print("rr", attempt(lambda: os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))))
print("batch", attempt(lambda: os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))), os.sched_getscheduler(0) == os.SCHED_BATCH)
print("other", attempt(lambda: os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))))
print("nicer", attempt(lambda: os.setpriority(os.PRIO_PROCESS, 0, -5)))
"#;
    let result = run(&mut client, &python_job(code, Sku::S)).await;
    assert_eq!(result.stdout.text, "fifo EPERM\nrr EPERM\nbatch ok True\nother ok\nnicer EACCES\n", "{}", result.stderr.text);
}

/// The unique mount id `statx` returns (`STATX_MNT_ID_UNIQUE`) counts every mount of the host,
/// so two jobs of a tenant could count the sandboxes other tenants started between them: a
/// `statx` asking for it is refused with EINVAL by seccomp, ordinary `stat` and `statx` work.
#[tokio::test]
async fn statx_refuses_the_unique_mount_id_and_stat_works() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "mount_id_counter.py", "30s", None).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    assert_eq!(
        result.stdout.text,
        "os.stat True True\nstatx basic 0 True\nstatx mnt_id 0 True\nstatx mnt_id_unique -1 EINVAL\nstatx basic+mnt_id_unique -1 EINVAL\n"
    );
}

#[tokio::test]
async fn planted_symlinks_are_never_followed() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "symlink_artifact.py", "30s", None).await;
    assert_eq!(result.status, JobStatus::Succeeded);
    assert!(result.artifacts.is_empty(), "{:?}", result.artifacts);
    for name in ["passwd.txt", "shadow.txt", "proc_env.txt", "up", "loop", "out/root"] {
        assert!(
            result.skipped_artifacts.iter().any(|s| s.path == name && s.reason == "symlink"),
            "{name} not reported as a skipped symlink: {:?}",
            result.skipped_artifacts
        );
    }
}

#[tokio::test]
async fn hard_links_to_host_files_are_refused() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "hardlink_artifact.py", "30s", None).await;
    assert!(result.artifacts.is_empty(), "{:?}", result.artifacts);
    assert_eq!(result.stdout.text.matches("refused").count(), 2, "{}", result.stdout.text);
}

#[tokio::test]
async fn special_files_are_skipped_without_blocking() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "special_files.py", "30s", None).await;
    assert_eq!(result.status, JobStatus::Succeeded);
    let reason = |path: &str| result.skipped_artifacts.iter().find(|s| s.path == path).map(|s| s.reason.as_str());
    assert_eq!(reason("pipe"), Some("not_regular"));
    assert_eq!(reason("sock"), Some("not_regular"));
    assert_eq!(reason("sparse.bin"), Some("too_large"));
    assert!(result.artifacts.is_empty());
}

#[tokio::test]
async fn stdin_reader_sees_eof_or_its_input() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "stdin_reader.py", "30s", None).await;
    assert_eq!(result.stdout.text, "read 0 bytes\n\n");
    let result = run_case(&mut client, "stdin_reader.py", "30s", Some(b"hello hostile world\n")).await;
    assert_eq!(result.stdout.text, "read 20 bytes\nhello hostile world\n\n");
}

#[tokio::test]
async fn stdout_flood_is_truncated_and_bounded() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "stdout_flood.py", "60s", None).await;
    assert_eq!(result.status, JobStatus::Succeeded);
    assert!(result.stdout.truncated);
    assert_eq!(result.stdout.total_bytes, 2 * 1024 * 1024 * 1024, "every byte is counted");
    assert_eq!(result.stdout.text.len(), 64 << 10, "inlined up to the 64 KiB cap");
    assert_eq!(result.stdout.log_bytes, 8 << 20, "kept in S3 up to the 8 MiB cap");
    let log = client.fetch_log(result.stdout.log_key.as_deref().expect("log key"), result.stdout.log_bytes).await.expect("log");
    let line = format!("{}\n", "x".repeat(1023));
    assert_eq!(log, line.repeat(8 * 1024).into_bytes(), "the stored log is the program's first 8 MiB");
    let stored = sandq_schemas::encode(&result).expect("encode").len();
    assert!(stored < 128 << 10, "result in Redis is {stored} bytes");
}

#[tokio::test]
async fn tmp_fill_is_bounded_by_the_tmpfs() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "tmp_fill.py", "30s", None).await;
    assert!(matches!(result.status, JobStatus::Failed | JobStatus::OomKilled), "{result:?}");
    if result.status == JobStatus::Failed {
        assert!(result.stderr.text.contains("No space left on device"), "{}", result.stderr.text);
    }
}

#[tokio::test]
async fn many_files_are_capped_and_counted() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "many_files.py", "60s", None).await;
    assert_eq!(result.status, JobStatus::Succeeded);
    assert_eq!(result.artifacts.len(), 100, "the artifact count cap");
    assert_eq!(result.skipped_artifacts_total, 200_000 - 100);
    assert_eq!(result.skipped_artifacts.len(), 100, "the listed skips are capped");
    assert!(result.skipped_artifacts.iter().all(|s| s.reason == "too_many"));
    // 100 artifacts of about 700 bytes each (path, key, sha256, presigned URL) and 100 listed
    // skips: bounded, whatever the program leaves.
    let stored = sandq_schemas::encode(&result).expect("encode").len();
    assert!(stored < 128 << 10, "result in Redis is {stored} bytes");
}

#[tokio::test]
async fn non_utf8_output_is_kept_exactly() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let result = run_case(&mut client, "nonutf8_output.py", "30s", None).await;
    assert_eq!(result.status, JobStatus::Succeeded);
    for (stream, expected) in [(&result.stdout, &b"ok \xff\xfe\x00 end\n"[..]), (&result.stderr, &b"\x80\x81 err\n"[..])] {
        assert!(stream.lossy, "invalid UTF-8 must be flagged");
        let log = client.fetch_log(stream.log_key.as_deref().expect("log key"), stream.log_bytes).await.expect("log");
        assert_eq!(log, expected, "the stored bytes are exact");
    }
}

#[tokio::test]
async fn disk_fill_stops_at_the_job_quota() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    // Measured with the warm pool full both times: each warm sandbox's filesystem holds some
    // of the host's disk (its ext4 metadata) while it waits.
    settle_warm_pool().await;
    let held_before = allocated_bytes(&worker_data_dir());
    let result = run_case(&mut client, "disk_fill.py", "60s", None).await;
    settle_warm_pool().await;
    assert!(result.stderr.text.contains("No space left on device"), "no ENOSPC: {}", result.stderr.text);
    assert_eq!(result.status, JobStatus::Failed, "{result:?}");
    let held_after = allocated_bytes(&worker_data_dir());
    assert!(held_after <= held_before + (64 << 20), "the worker's data dir grew by {} bytes", held_after.saturating_sub(held_before));
}

/// Waits until the worker has started no warm sandbox for 3 s (its pool is full again).
async fn settle_warm_pool() {
    let count = || sandq_tests::worker_log().matches("warm sandbox started").count();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut last = (count(), std::time::Instant::now());
    while last.1.elapsed() < std::time::Duration::from_secs(3) && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let now = count();
        if now != last.0 {
            last = (now, std::time::Instant::now());
        }
    }
}

/// Disk space allocated to the files under `dir` (blocks, without crossing into other
/// filesystems): what the worker's data dir holds, whatever else writes to the same disk (a
/// shared machine's builds made the disk's free space useless for this).
fn allocated_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(top) = std::fs::symlink_metadata(dir) else { return 0 };
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&path) else { continue };
        for entry in entries.flatten() {
            let Ok(meta) = entry.path().symlink_metadata() else { continue };
            if meta.dev() != top.dev() {
                continue;
            }
            total += meta.blocks() * 512;
            if meta.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    total
}

#[tokio::test]
async fn a_job_never_sees_the_files_of_the_previous_one() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let first = run_case(&mut client, "leave_secret.py", "30s", None).await;
    assert_eq!(first.stdout.text, "before: False False\n");
    assert!(first.artifacts.iter().any(|a| a.path == "secret.txt"), "the file was written and collected");
    let second = run_case(&mut client, "leave_secret.py", "30s", None).await;
    assert_eq!(second.stdout.text, "before: False False\n", "the second job saw the first one's files");
}

/// A job id is a capability (whoever knows it reads the result, or submits a duplicate): no
/// host path a sandbox can see names its own job, so none names another's either (loop
/// devices' backing files in sysfs once did).
#[tokio::test]
async fn no_host_path_visible_in_the_sandbox_names_the_job() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let code = r#"
import glob, os
job = os.environ["SANDQ_JOB_ID"]
seen = []
for path in ["/proc/self/mountinfo", "/proc/self/cgroup", "/proc/self/mounts"] + glob.glob("/sys/block/*/loop/backing_file") + glob.glob("/sys/devices/virtual/block/*/loop/backing_file"):
    try:
        if job in open(path).read():
            seen.append(path)
    except OSError:
        pass
print("loop devices visible:", len(glob.glob("/sys/block/loop*")))
print("paths naming the job:", seen)
print("cgroup paths:", sorted({line.rstrip("\n").split(":", 2)[2] for line in open("/proc/self/cgroup")}))
print("etc:", [open(p).read() for p in ["/etc/hostname", "/etc/resolv.conf", "/proc/cmdline"]])
"#;
    let result = run(&mut client, &python_job(code, Sku::S)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    // A cgroup namespace rooted at the sandbox's cgroup: no path of the host's hierarchy (a
    // Kubernetes pod's UID, the worker's cgroup) shows. /etc/hostname and resolv.conf are the
    // sandbox's own, not the image build host's, and /proc/cmdline (the host kernel's) is empty.
    assert_eq!(
        result.stdout.text,
        "loop devices visible: 0\npaths naming the job: []\ncgroup paths: ['/']\netc: ['sandbox\\n', '# no network\\n', '']\n"
    );
}

// --- The worker's own costs, per-user counters, duplicates and the host's view ---------------

/// A program chooses what the worker's artifact walk finds in `/work`: 250,000 hard links with
/// long names under a 3,845-byte path, and 260,000 in one flat directory, past the walk's entry
/// cap. The walk must cost the worker no more than walking any `/work` of as many files: it
/// keeps no path it cannot use, stops at its cap and counts what it skipped. The worker's peak
/// memory grows by less than 64 MiB (an unbounded walk kept every path: ~1.5 GB), and its CPU
/// for the job is within a small factor of its CPU for a baseline job measured in the same run:
/// as many hard links with short names in two flat directories (links, not plain files: the
/// shared worker's 1.5 GiB `/work` has one inode per 4 KiB, fewer than 510,000). A bound in
/// seconds would fail on a slower machine or a busier one.
#[tokio::test]
async fn a_huge_tree_of_hard_links_costs_the_worker_little() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    // Start the worker (and warm it up) before the baseline is read.
    let warm = run(&mut client, &python_job("print(1)", Sku::S)).await;
    assert_eq!(warm.status, JobStatus::Succeeded);
    let pid = sandq_tests::worker_pid();
    let (peak_before, cpu_before) = sandq_tests::process_usage(pid);
    let result = run_case(&mut client, "deep_links.py", "120s", None).await;
    let (peak_after, cpu_after) = sandq_tests::process_usage(pid);
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    // At most the artifact cap of the (empty) flat links; nothing of the deep tree, whose
    // paths are too long for artifacts.
    assert!(result.artifacts.len() <= 100 && result.artifacts.iter().all(|a| a.size == 0 && a.path.len() == 199));
    // The walk stops at its entry cap (250,000); the files it saw are counted as skipped
    // (too many; the deep tree, whose paths are too long to be artifacts, as one bad_name).
    assert!(result.skipped_artifacts_total >= 249_000, "skipped {}", result.skipped_artifacts_total);
    assert!(result.skipped_artifacts.len() <= 100);
    assert!(
        result.skipped_artifacts.iter().any(|s| s.reason == "walk_limit"),
        "total {} stdout {} last {:?}",
        result.skipped_artifacts_total,
        result.stdout.text,
        result.skipped_artifacts.last()
    );
    let grown = peak_after.saturating_sub(peak_before);
    eprintln!("worker peak memory {peak_before} -> {peak_after} bytes, CPU {:.2} s", cpu_after - cpu_before);
    assert!(grown < 64 << 20, "the worker's peak memory grew by {grown} bytes");
    // Both include the ordinary job run_case runs after each, and all their S3 and Redis traffic,
    // and tearing down /work (freeing as many dentries).
    let cpu = cpu_after - cpu_before;
    // As many entries as deep_links.py makes, the walk's ordinary work past its cap.
    let baseline_code = r"
import os
os.chdir('/work')
for d, n in (('a', 260000), ('b', 249600)):
    os.mkdir(d)
    for i in range(n):
        src = '%s/src%d' % (d, i // 50000)  # ext4 allows 65,000 links to one inode
        if i % 50000 == 0:
            open(src, 'w').close()
        os.link(src, '%s/%06d' % (d, i))
";
    let (_, baseline_before) = sandq_tests::process_usage(pid);
    let baseline = run_program(&mut client, "the baseline of short-named links", baseline_code, "120s", None).await;
    let (_, baseline_after) = sandq_tests::process_usage(pid);
    assert_eq!(baseline.status, JobStatus::Succeeded, "{}", baseline.stderr.text);
    assert!(
        baseline.skipped_artifacts.iter().any(|s| s.reason == "walk_limit"),
        "the baseline's walk did not reach its cap: {:?}",
        baseline.skipped_artifacts.last()
    );
    let baseline_cpu = baseline_after - baseline_before;
    eprintln!("worker CPU: deep and long-named links {cpu:.2} s, baseline of short-named links {baseline_cpu:.2} s");
    // The same number of entries walked, but 200-byte names against 7-byte ones: each costs
    // the kernel's lookup and the walk's name check more, and their dentries more to free at
    // unmount (a debug build, measured: 4.4 s against 1.6 s). What this guards against, the
    // walk following the deep tree or keeping its paths, cost an order of magnitude more.
    assert!(cpu < 3.0 * baseline_cpu + 1.0, "the worker used {cpu:.2} s of CPU on the links, {baseline_cpu:.2} s on the baseline");
}

/// A sandbox that exhausts every per-user counter it can reach (inotify, queued signals, message
/// queues) leaves host root's intact: the kernel charges them to the slot's own uid.
#[tokio::test]
async fn a_sandbox_cannot_exhaust_host_roots_per_user_limits() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let mut spec = python_job(&case("ucount_exhaust.py"), Sku::S);
    spec.timeout = Some("60s".into());
    client.submit(&spec).await.expect("submit");
    sandq_tests::wait_for_status(&mut client, &spec.job_id, JobStatus::Running, std::time::Duration::from_secs(60)).await;
    // The job needs a few seconds to use everything up, then holds it for 10 s.
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    let probe = r#"
import ctypes, errno, os, signal
libc = ctypes.CDLL(None, use_errno=True)
rt = ctypes.CDLL("librt.so.1", use_errno=True)
err = lambda: errno.errorcode.get(ctypes.get_errno(), "?")
fd = libc.inotify_init1(0)
print("inotify_init1", "ok" if fd >= 0 else err())
print("inotify_add_watch", "ok" if fd >= 0 and libc.inotify_add_watch(fd, b"/etc", 0x2) >= 0 else err())
class sigval(ctypes.Union):
    _fields_ = [("i", ctypes.c_int), ("p", ctypes.c_void_p)]
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
print("sigqueue", "ok" if libc.sigqueue(os.getpid(), signal.SIGRTMIN, sigval(0)) == 0 else err())
name = b"/sandq-host-probe-%d" % os.getpid()
q = rt.mq_open(name, os.O_CREAT | os.O_RDWR, 0o600, None)
print("mq_open", "ok" if q >= 0 else err())
if q >= 0:
    rt.mq_unlink(name)
"#;
    let host = std::process::Command::new("python3").args(["-c", probe]).output().expect("python3 on the host");
    let host = String::from_utf8_lossy(&host.stdout).into_owned();
    let result = sandq_tests::wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    let out = &result.stdout.text;
    // The sandbox did run into its limits...
    assert!(out.contains("inotify instances 128 EMFILE"), "{out}");
    assert!(out.contains("queued signals 16384 EAGAIN"), "the OCI rlimit is in force: {out}");
    assert!(out.contains("message queues") && out.contains("holding"), "{out}");
    // ...while host root's own calls went through.
    assert_eq!(host, "inotify_init1 ok\ninotify_add_watch ok\nsigqueue ok\nmq_open ok\n", "host root was starved while the job ran: {out}");
    assert_no_leftovers(&spec.job_id);
}

/// A second delivery with a finished job's id (a benign redelivery, or a client reusing an id),
/// running at the same time or after, never changes anything the stored result points at.
#[tokio::test]
async fn a_duplicate_delivery_never_changes_a_finished_job() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let victim_code = "import time\nopen('report.txt', 'w').write('victim data')\nprint('VICTIM OUTPUT')\ntime.sleep(3)\n";
    let mut victim = python_job(victim_code, Sku::M);
    victim.timeout = Some("60s".into());
    client.submit(&victim).await.expect("submit");
    sandq_tests::wait_for_status(&mut client, &victim.job_id, JobStatus::Running, std::time::Duration::from_secs(60)).await;
    // The same id on another SKU while the victim runs; it would finish after the victim.
    let mut attacker =
        python_job("import time\ntime.sleep(6)\nopen('report.txt', 'w').write('ATTACKER DATA')\nprint('ATTACKER OUTPUT')\n", Sku::S);
    attacker.job_id = victim.job_id.clone();
    attacker.timeout = Some("60s".into());
    client.submit(&attacker).await.expect("submit the duplicate");
    let first = sandq_tests::wait(&mut client, &victim.job_id).await;
    assert_eq!(first.status, JobStatus::Succeeded);
    assert_eq!(first.stdout.text, "VICTIM OUTPUT\n");
    // Until the duplicate's processing is over. On this (the only) worker it waits for the
    // running attempt (context::InFlight) and is then acked without running; on another worker it
    // would run its 6 s and lose the compare-and-set.
    let acked = || sandq_tests::worker_log().matches("job already has a terminal result; acking the duplicate").count();
    let dropped = || sandq_tests::worker_log().contains("this attempt's result and objects are dropped");
    let acked_before = acked();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    // The duplicate's own line (its span names the S attempt), whichever module logs it.
    let duplicate_span = format!("job_id={} attempt=1 sku=S}}", victim.job_id);
    let duplicate_acked =
        || sandq_tests::worker_log().lines().any(|l| l.contains(&duplicate_span) && l.contains("job already has a terminal result"));
    while !(dropped() || duplicate_acked()) {
        assert!(std::time::Instant::now() < deadline, "the duplicate was not dropped:\n{}", sandq_tests::worker_log());
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    // A duplicate after the end is acked without running.
    let acked_before_late = acked().max(acked_before);
    client.submit(&attacker).await.expect("submit the late duplicate");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while acked() <= acked_before_late {
        assert!(std::time::Instant::now() < deadline, "the late duplicate was not acked");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let stored = client.status(&victim.job_id).await.expect("result").expect("stored");
    assert_eq!(stored, first, "the stored result changed");
    let dir = tempfile::tempdir().expect("tempdir");
    let report = stored.artifacts.iter().find(|a| a.path == "report.txt").expect("report.txt");
    let path = client.download_artifact(report, dir.path()).await.expect("the artifact still matches its digest");
    assert_eq!(std::fs::read_to_string(path).expect("read"), "victim data");
    let log = client.fetch_log(stored.stdout.log_key.as_deref().expect("log key"), stored.stdout.log_bytes).await.expect("log");
    assert_eq!(log, b"VICTIM OUTPUT\n");
    // Nothing of the losing attempt is left in S3: every object of the job is under the
    // winning attempt's prefix.
    let config = service_config();
    let s3 = sandq_core::storage::client(&config.s3);
    let keys = sandq_core::storage::list(&s3, &config.s3.bucket, &format!("jobs/{}/", victim.job_id), 100).await.expect("list");
    let prefix = report.key.rsplit_once("/artifacts/").expect("attempt prefix").0;
    assert!(!keys.is_empty() && keys.iter().all(|k| k.starts_with(prefix)), "objects of another attempt: {keys:?}");
}

/// An output flood costs the worker little CPU beyond what any job with full logs costs.
/// The baseline job writes what the flood's logs keep (8 MiB a stream) and lives as long; the
/// flood writes as fast as it can for 8 s. Before the fix the worker spent about as much CPU
/// reading and discarding as the job spent writing.
#[tokio::test]
async fn an_output_flood_costs_the_worker_little_cpu() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let warm = run(&mut client, &python_job("print(1)", Sku::S)).await;
    assert_eq!(warm.status, JobStatus::Succeeded);
    let pid = sandq_tests::worker_pid();
    let mut worker_cpu = Vec::new();
    for code in [
        "import os, time\nchunk = b'x' * (1 << 20)\nfor i in range(9):\n    os.write(1, chunk)\n    os.write(2, chunk)\ntime.sleep(8)\n",
        "import os, time\nchunk = b'x' * (1 << 20)\nend = time.time() + 8\nwhile time.time() < end:\n    os.write(1, chunk)\n    os.write(2, chunk)\n",
    ] {
        let (_, before) = sandq_tests::process_usage(pid);
        let mut spec = python_job(code, Sku::S);
        spec.mode = Some(sandq_schemas::RunMode::Script);
        let result = run(&mut client, &spec).await;
        let (_, after) = sandq_tests::process_usage(pid);
        assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
        assert!(result.stdout.truncated && result.stderr.truncated);
        assert_eq!(result.stdout.log_bytes, 8 << 20);
        worker_cpu.push(after - before);
    }
    let extra = worker_cpu[1] - worker_cpu[0];
    eprintln!("worker CPU: baseline job {:.2} s, flood job {:.2} s", worker_cpu[0], worker_cpu[1]);
    assert!(extra < 1.0, "the flood cost the worker {extra} s of CPU more than the baseline ({worker_cpu:?})");
}

/// Nothing in the sandbox shows other jobs' disk activity (block device counters, I/O pressure,
/// the disk's interrupt counts, the host's file and inode counts) or the host's layout: each is
/// a side channel on another job's timing and size, or names the host.
#[tokio::test]
async fn host_disk_activity_and_paths_are_not_visible() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let code = r#"
import os
def listing(path):
    try:
        return sorted(os.listdir(path))
    except OSError as e:
        return type(e).__name__
print("diskstats", repr(open("/proc/diskstats").read()))
print("partitions", repr(open("/proc/partitions").read()))
print("uevent_seqnum", repr(open("/sys/kernel/uevent_seqnum").read()))
print("interrupts", repr(open("/proc/interrupts").read()), "softirqs", repr(open("/proc/softirqs").read()))
print("fs counters", [open("/proc/sys/fs/" + name).read() for name in ["file-nr", "inode-nr", "inode-state", "dentry-state"]])
print("host-wide memory and ids", [open(path).read() for path in ["/proc/sys/kernel/random/boot_id", "/proc/zoneinfo", "/proc/buddyinfo", "/proc/sys/kernel/pty/nr"]])
print("loadavg", repr(open("/proc/loadavg").read()))
for path in ["/sys/fs/ext4", "/sys/class/block", "/sys/dev/block", "/proc/fs", "/sys/fs/xfs", "/sys/class/bdi", "/sys/devices/virtual/bdi", "/proc/pressure", "/proc/irq", "/sys/kernel/irq", "/proc/sys/fs/quota", "/sys/module/page_reporting"]:
    print(path, listing(path))
for path in DISK_DIRS:
    print("disk", listing(path))
mountinfo = open("/proc/self/mountinfo").read()
print("mountinfo names the data dir:", DATA_DIR in mountinfo)
print("mountinfo names the worker:", os.environ.get("WORKER_ID", "?") in mountinfo)
"#;
    let code = code
        .replace("os.environ.get(\"WORKER_ID\", \"?\")", &format!("{:?}", worker_id()))
        .replace("DATA_DIR", &format!("{:?}", sandq_tests::worker_data_dir().display().to_string()));
    // The host's disks under their real paths (`/sys/devices/.../block/<disk>`, not only the
    // `/sys/block` aliases), found here from the host's /sys/block: the sandbox must see each as
    // an empty dir.
    let disks: Vec<String> = std::fs::read_dir("/sys/block")
        .expect("/sys/block")
        .flatten()
        .filter_map(|e| std::fs::canonicalize(e.path()).ok())
        .filter(|p| !p.starts_with("/sys/devices/virtual"))
        .map(|p| p.display().to_string())
        .collect();
    assert!(!disks.is_empty(), "this host shows no disk in /sys/block: the check below would check nothing");
    let code = code.replace("DISK_DIRS", &format!("{disks:?}"));
    let mut spec = python_job(&code, Sku::S);
    spec.network = sandq_schemas::NetworkMode::Outbound;
    let result = run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    let expected = format!(
        "diskstats ''\npartitions ''\nuevent_seqnum ''\ninterrupts '' softirqs ''\nfs counters ['', '', '', '']\n\
         host-wide memory and ids ['', '', '', '']\nloadavg '0.00 0.00 0.00 1/1 1\\n'\n/sys/fs/ext4 []\n/sys/class/block []\n/sys/dev/block []\n\
         /proc/fs []\n/sys/fs/xfs []\n/sys/class/bdi []\n/sys/devices/virtual/bdi []\n/proc/pressure []\n/proc/irq []\n/sys/kernel/irq []\n/proc/sys/fs/quota []\n/sys/module/page_reporting []\n{}\
         mountinfo names the data dir: False\nmountinfo names the worker: False\n",
        "disk []\n".repeat(disks.len())
    );
    assert_eq!(result.stdout.text, expected);
}

/// A body whose SKU is not its queue's is rejected, with a reason, and never runs (a
/// routing-key permission bounds the sandbox size a client gets).
#[tokio::test]
async fn a_sku_other_than_the_queues_is_rejected() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let spec = python_job("print('ran')", Sku::M);
    let body = sandq_schemas::encode(&spec).expect("encode");
    sandq_tests::publish_raw(&body, Sku::S, None).await;
    let result = sandq_tests::wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Rejected);
    assert_eq!(result.reason.as_deref(), Some("sku M in the job does not match the queue of sku S it was published to"));
}

/// A body larger than any valid job is refused before it is decoded (a
/// crafted message of 5-byte input entries once cost the worker 17 times its size), with a
/// `rejected` result under its `message_id`.
#[tokio::test]
async fn an_oversize_message_is_refused_before_decoding() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let warm = run(&mut client, &python_job("print(1)", Sku::S)).await;
    assert_eq!(warm.status, JobStatus::Succeeded);
    let pid = sandq_tests::worker_pid();
    let (peak_before, _) = sandq_tests::process_usage(pid);
    // A map whose job_id comes first, then `inputs` as 3 million 5-byte entries (15 MB).
    let job_id = uuid::Uuid::new_v4().to_string();
    let mut body = vec![0x82, 0xa6];
    body.extend_from_slice(b"job_id");
    body.push(0xd9);
    body.push(job_id.len() as u8);
    body.extend_from_slice(job_id.as_bytes());
    body.push(0xa6);
    body.extend_from_slice(b"inputs");
    let n: u32 = 3_000_000;
    body.push(0xdd);
    body.extend_from_slice(&n.to_be_bytes());
    for _ in 0..n {
        body.extend_from_slice(&[0x94, 0xa0, 0xa0, 0x00, 0xa0]);
    }
    // Not parsed at all, so the result goes to the id in `message_id`.
    sandq_tests::publish_raw(&body, Sku::S, Some(&job_id)).await;
    let result = sandq_tests::wait(&mut client, &job_id).await;
    let (peak_after, _) = sandq_tests::process_usage(pid);
    assert_eq!(result.status, JobStatus::Rejected);
    let max: usize = (1 << 20) + (8 << 20) + (4 << 20); // code and stdin limits, and 4 MiB
    assert_eq!(
        result.reason.as_deref(),
        Some(format!("message of {} bytes is larger than any valid job ({max} bytes at most)", body.len()).as_str())
    );
    let grown = peak_after.saturating_sub(peak_before);
    assert!(grown < 64 << 20, "the worker's peak memory grew by {grown} bytes");
}

/// A text value written as a list of 4 million two-letter lines (Jupyter's
/// list-of-lines form) is joined as it is read: the worker's memory stays flat (it once took
/// 15 times the outputs file), and the text comes back whole, as S3 content past the inline cap.
#[tokio::test]
async fn a_text_output_of_millions_of_lines_costs_the_worker_little_memory() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let warm = run(&mut client, &python_job("print(1)", Sku::S)).await;
    assert_eq!(warm.status, JobStatus::Succeeded);
    let pid = sandq_tests::worker_pid();
    let (peak_before, _) = sandq_tests::process_usage(pid);
    let n = 4_000_000; // a 20 MB outputs file
    let code = format!(
        "import os\nwith open(os.environ['SANDQ_OUTPUTS'], 'a') as f:\n             f.write('{{\"output_type\":\"display_data\",\"data\":{{\"text/plain\":[' + '\"ab\",' * ({n} - 1) + '\"ab\"]}},\"metadata\":{{}}}}\\n')\n"
    );
    let result = run(&mut client, &python_job(&code, Sku::S)).await;
    let (peak_after, _) = sandq_tests::process_usage(pid);
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    let output = result.outputs.first().expect("the output");
    let text = output.data.get("text/plain").expect("text/plain");
    assert_eq!(text.size, 2 * n, "the joined text's size");
    let grown = peak_after.saturating_sub(peak_before);
    eprintln!("worker peak memory {peak_before} -> {peak_after} bytes");
    assert!(grown < 64 << 20, "the worker's peak memory grew by {grown} bytes");
}

/// TCP socket buffers are the job's memory. On cgroup v1 they count only
/// against the host's `tcp_mem` unless the job's kmem.tcp limit is set: 40 loopback pairs with
/// 8 MiB buffers, written without reading, queue at most that limit (64 MiB for S, plus what
/// the kernel grants a socket under pressure); on v2 whatever is queued is in the job's peak
/// memory.
#[tokio::test]
async fn tcp_buffers_are_charged_to_the_job() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let code = r#"
import socket
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(100)
pairs, queued = [], 0
chunk = b"x" * (1 << 20)
for _ in range(40):
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    c.connect(listener.getsockname())
    s, _ = listener.accept()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    c.setblocking(False)
    while True:
        try:
            queued += c.send(chunk)
        except BlockingIOError:
            break
    pairs.append((c, s))
print(queued)
"#;
    let result = run(&mut client, &python_job(code, Sku::S)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    let queued: u64 = result.stdout.text.trim().parse().expect("bytes queued");
    let peak = result.usage.expect("usage").peak_memory_bytes;
    eprintln!("queued {queued} bytes in socket buffers; job peak memory {peak}");
    if std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        assert!(peak >= queued, "v2: {queued} bytes queued, peak memory only {peak}");
    } else {
        // Without the limit this queues ~40 x 16 MiB = 640 MiB.
        assert!(queued < 128 << 20, "v1: {queued} bytes queued outside the job's memory");
    }
}

/// A malformed message carrying a running job's id (as `message_id`) does not end that job: it
/// is dropped, and the job finishes with its own result.
#[tokio::test]
async fn a_malformed_message_never_ends_a_running_job() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let spec = python_job("import time\ntime.sleep(3)\nprint('finished')", Sku::M);
    client.submit(&spec).await.expect("submit");
    sandq_tests::wait_for_status(&mut client, &spec.job_id, JobStatus::Running, std::time::Duration::from_secs(60)).await;
    sandq_tests::publish_raw(b"\xc1 not msgpack", Sku::S, Some(&spec.job_id)).await;
    let result = sandq_tests::wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, "finished\n");
}

/// A session job's packages are archived by `tar` on the host after the job's
/// cgroup is gone; a tree of 600,000 hard links with long names in one directory took tar to
/// over 300 MB (GNU tar holds a directory's names while it descends; 4 x 1.1 M took 1.4 GB).
/// Now tar runs under 256 MiB of address space and 60 s of CPU: it stops with "memory
/// exhausted", the session keeps its previous packages, and the next job of the session runs.
#[tokio::test]
async fn archiving_a_sessions_packages_is_bounded() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let session = format!("links-{}", uuid::Uuid::new_v4().simple());
    // A new target every 60,000 links (ext4 allows 65,000 links to one inode).
    let code = concat!(
        "import os\n",
        "d = '/sandq/packages/python/lib/python3.13/site-packages/d'\n",
        "os.makedirs(d)\n",
        "for i in range(600000):\n",
        "    if i % 60000 == 0:\n",
        "        target = d + '/t%d' % i\n",
        "        open(target, 'w').write('x')\n",
        "    os.link(target, d + '/%010d' % i + 'L' * 240)\n",
        "print('links', len(os.listdir(d)) - 10)\n",
    );
    let mut spec = python_job(code, Sku::S);
    spec.mode = Some(sandq_schemas::RunMode::Script);
    spec.session = Some(session.clone());
    spec.timeout = Some("5m".into());
    let result = run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    assert_eq!(result.stdout.text, "links 600000\n");
    let line = sandq_tests::worker_log()
        .lines()
        .find(|l| l.contains(&spec.job_id) && l.contains("cannot archive the session's packages"))
        .map(str::to_owned);
    let line = line.expect("the archive of 600,000 links was not refused");
    assert!(line.contains("memory exhausted"), "stopped by something else than its memory bound: {line}");
    let mut next = python_job("import os\nprint(os.path.exists('/sandq/packages/python/lib/python3.13/site-packages/d'))\n", Sku::S);
    next.session = Some(session);
    let after = run(&mut client, &next).await;
    assert_eq!(after.status, JobStatus::Succeeded, "{}", after.stderr.text);
    assert_eq!(after.stdout.text, "False\n", "the session kept packages it could not archive");
    assert!(worker_alive());
}

/// A session job can leave the `tar` limits' worth of small files in
/// `/sandq/packages`, and every later job of the session unpacks and repacks them on the host.
/// That `tar` now runs in a cgroup of its own with the job's SKU CPU quota (it can take no more
/// CPU than the job could, and the job's capacity is held meanwhile), whose usage the worker
/// logs: both the archive after the first job and the extract before the second are seen there,
/// and the files come back.
#[tokio::test]
async fn a_sessions_packages_tar_runs_in_a_cgroup_of_the_jobs_size() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let session = format!("pkgcg-{}", uuid::Uuid::new_v4().simple());
    let code = concat!(
        "import os\n",
        "d = '/sandq/packages/python/lib/python3.13/site-packages/many'\n",
        "os.makedirs(d)\n",
        "for i in range(20000):\n",
        "    open(d + '/f%05d' % i, 'w').write(str(i))\n",
        "print(len(os.listdir(d)))\n",
    );
    let mut spec = python_job(code, Sku::S);
    spec.mode = Some(sandq_schemas::RunMode::Script);
    spec.session = Some(session.clone());
    spec.timeout = Some("5m".into());
    let first = run(&mut client, &spec).await;
    assert_eq!((first.status, first.stdout.text.as_str()), (JobStatus::Succeeded, "20000\n"), "{}", first.stderr.text);
    let mut next = python_job("import os\nd = '/sandq/packages/python/lib/python3.13/site-packages/many'\nprint(len(os.listdir(d)), open(d + '/f12345').read())\n", Sku::S);
    next.session = Some(session.clone());
    let second = run(&mut client, &next).await;
    assert_eq!((second.status, second.stdout.text.as_str()), (JobStatus::Succeeded, "20000 12345\n"), "{}", second.stderr.text);
    let log = sandq_tests::worker_log();
    let usage = |job_id: &str, action: &str| {
        log.lines()
            .filter(|l| {
                l.contains(job_id) && l.contains("session packages tar, in its own cgroup") && l.contains(&format!("action=\"{action}\""))
            })
            .find_map(|l| l.split("cpu_ms=").nth(1)?.split(|c: char| !c.is_ascii_digit()).next()?.parse::<u64>().ok())
    };
    let created = usage(&first.job_id, "create");
    let extracted = usage(&second.job_id, "extract");
    client.remove_session(&session, std::time::Duration::from_secs(10)).await.expect("rm");
    // 20,000 files cost tar some CPU; the cgroup saw it (the counter is read after tar exited).
    assert!(created.is_some_and(|ms| ms > 0), "no confined archive of {} in the log (cpu_ms {created:?})", first.job_id);
    assert!(extracted.is_some_and(|ms| ms > 0), "no confined extract for {} in the log (cpu_ms {extracted:?})", second.job_id);
    assert!(worker_alive());
}

/// A file name with control or bidi-override characters must reach neither the operator's
/// terminal as it is (`sandq run` prints artifact paths: escapes could erase and forge its
/// summary) nor S3 keys, whose listing Garage returns as XML that cannot carry them (a dropped
/// attempt's objects could not be deleted). Such names are not collected: they are skipped as
/// `bad_name`, listed escaped.
#[tokio::test]
async fn names_with_control_or_bidi_characters_are_not_collected() {
    let _serial = SERIAL.lock().await;
    let mut client = client().await;
    let code = concat!(
        "import os\n",
        "for name in ['ok.txt', 'ctl\\x01.txt', 'esc\\x1b[31m.txt', 'rtl\\u202etxt.exe', 'bell\\x07', 'ls\\u2028.txt', 'mark\\u200f.txt']:\n",
        "    open(name, 'w').write('x')\n",
        "os.mkdir('d\\n')\n",
        "open('d\\n/inner.txt', 'w').write('x')\n",
    );
    let result = run(&mut client, &python_job(code, Sku::S)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    let artifacts: Vec<&str> = result.artifacts.iter().map(|a| a.path.as_str()).collect();
    assert_eq!(artifacts, ["ok.txt"], "{result:?}");
    let mut skipped: Vec<(&str, &str)> = result.skipped_artifacts.iter().map(|s| (s.path.as_str(), s.reason.as_str())).collect();
    skipped.sort_unstable();
    assert_eq!(
        skipped,
        [
            ("bell\\u{7}", "bad_name"),
            ("ctl\\u{1}.txt", "bad_name"),
            ("d\\n", "bad_name"),
            ("esc\\u{1b}[31m.txt", "bad_name"),
            ("ls\\u{2028}.txt", "bad_name"),
            ("mark\\u{200f}.txt", "bad_name"),
            ("rtl\\u{202e}txt.exe", "bad_name")
        ],
        "{result:?}"
    );
}
