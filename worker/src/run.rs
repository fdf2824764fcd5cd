//! Steps 5 and 6 (launch, run): run the program in its sandbox through the `sandq-container` helper, capturing
//! stdout and stderr up to a cap (the rest is counted and discarded, so the worker's memory
//! stays bounded whatever the program prints).

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use sandq_schemas::{Runtime, ValidJob};
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use std::sync::{Arc, OnceLock};

use crate::jobdir::JobDir;
use crate::live::{Live, Text};
use crate::sandbox::spec::{self, JobSandbox, SandboxLimits, SpecError};
use crate::sandbox::{SandboxReport, SandboxRequest};
use crate::settings::Settings;

/// Time the helper gets beyond the job's timeout to kill, reap and delete the container before
/// the worker kills the helper itself.
pub(crate) const HELPER_GRACE: Duration = Duration::from_secs(30);

/// A captured output stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Captured {
    /// The first `cap` bytes.
    pub bytes: Vec<u8>,
    /// Bytes the program wrote in all.
    pub total: u64,
}

/// What running the program produced.
#[derive(Debug, Clone)]
pub(crate) struct RunOutput {
    /// The helper's report: exit, usage, lifecycle timings.
    pub report: SandboxReport,
    /// What the program wrote to stdout, up to `worker.max_output_bytes` (the rest counted).
    pub stdout: Captured,
    /// What it wrote to stderr, capped the same way.
    pub stderr: Captured,
}

/// Why the sandbox could not be run (infrastructure: retried).
#[derive(Debug, thiserror::Error)]
pub(crate) enum RunError {
    /// The OCI config could not be made or written.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// The helper could not be started or talked to.
    #[error("cannot run sandq-container: {0}")]
    Helper(std::io::Error),
    /// The helper ended without a readable report.
    #[error("sandq-container exited with {status} without a report: {source}")]
    NoReport {
        /// Its exit status, as [`std::process::ExitStatus`] prints it (`exit status: 2`).
        status: String,
        /// Why the report could not be read.
        #[source]
        source: ReportError,
    },
    /// A warm start's handover could not be made (the runner is not waiting).
    #[error("cannot hand the job over to the warm sandbox: {0}")]
    Handover(std::io::Error),
    /// The helper overran the timeout plus [`HELPER_GRACE`] and was killed.
    #[error("sandq-container did not finish within the timeout plus {HELPER_GRACE:?}")]
    HelperHung,
}

/// Where the notebook runner writes its outputs inside the sandbox (one JSON object a line;
/// `oci-bundles/runner/README.md`).
pub(crate) const OUTPUTS_FILE: &str = "/sandq/out/outputs.jsonl";

/// The program's argv inside the sandbox: `python3 /sandq/sandq_runner.py <script> args...`
/// or `node --require /sandq/sandq_stdio.js /sandq/sandq_runner.js <script> args...` in
/// notebook mode, `python3 <script> args...` or `node --require /sandq/sandq_stdio.js <script>
/// args...` in script mode.
pub(crate) fn command(job: &ValidJob) -> Vec<String> {
    let interpreter = match job.spec.runtime {
        Runtime::Python => "python3",
        Runtime::Node => "node",
    };
    let script = match &job.spec.entrypoint {
        Some(entry) => format!("/work/{entry}"),
        None => format!("/sandq/{}", job.spec.runtime.main_file()),
    };
    let mut argv = vec![interpreter.to_owned()];
    if job.spec.runtime == Runtime::Node {
        argv.extend(["--require".to_owned(), format!("/sandq/{}", crate::layout::NODE_STDIO)]);
    }
    if job.spec.run_mode() == sandq_schemas::RunMode::Notebook {
        if let Some((runner, _)) = crate::layout::runner_files(job.spec.runtime).first() {
            argv.push(format!("/sandq/{runner}"));
        }
    }
    argv.push(script);
    argv.extend(job.spec.args.iter().cloned());
    argv
}

/// A notebook cell's place in its session, for the runner.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Cell {
    /// This cell's `execution_count` (`SANDQ_EXECUTION_COUNT`).
    pub execution_count: u64,
    /// For a session job: save the state after the cell, within this many bytes
    /// (`SANDQ_STATE_LIMIT`) and this time (`SANDQ_STATE_TIME_LIMIT`), to
    /// `/sandq/out/state.out` (`SANDQ_STATE_OUT`), with a report at `/sandq/out/state.json`
    /// (`SANDQ_STATE_REPORT`).
    pub save_state: Option<(u64, Duration)>,
    /// The session's previous state is at `/sandq/in/state.in` (`SANDQ_STATE_IN`, read-only).
    pub restore_state: bool,
}

/// The program's environment: the sandbox's own variables, then the job's (validated not to
/// override them). Nothing of the worker's environment (credentials, service addresses) is
/// passed, except OpenBLAS's CPU-type overrides, which some hosts need for correct results.
///
/// Notebook mode adds `SANDQ_OUTPUTS` ([`OUTPUTS_FILE`]), `SANDQ_OUTPUT_LIMIT` (bytes the
/// runner may write there: `outputs_bytes` less 64 KiB of slack for the tmpfs's own use) and
/// the session state variables of [`Cell`].
pub(crate) fn environment(
    job: &ValidJob,
    packages: &crate::packages::Packages,
    limits: &SandboxLimits,
    attempt: u32,
    outputs_bytes: u64,
    cell: &Cell,
) -> Vec<String> {
    let notebook = job.spec.run_mode() == sandq_schemas::RunMode::Notebook;
    let mut env = sandbox_environment(packages, job.spec.sku, limits, notebook.then_some(outputs_bytes));
    env.push(format!("SANDQ_JOB_ID={}", job.spec.job_id));
    env.push(format!("SANDQ_ATTEMPT={attempt}"));
    if notebook {
        env.push(format!("SANDQ_EXECUTION_COUNT={}", cell.execution_count.max(1)));
        if let Some((bytes, time)) = cell.save_state {
            env.push(format!("SANDQ_STATE_OUT=/sandq/out/{}", crate::layout::STATE_OUT));
            env.push(format!("SANDQ_STATE_REPORT=/sandq/out/{}", crate::layout::STATE_REPORT));
            env.push(format!("SANDQ_STATE_LIMIT={bytes}"));
            env.push(format!("SANDQ_STATE_TIME_LIMIT={}", time.as_secs_f64()));
        }
        if cell.restore_state {
            env.push(format!("SANDQ_STATE_IN={}/{}", crate::layout::SANDBOX_INPUT, crate::layout::STATE_IN));
            // What the restore may allocate is bounded by what the SKU's memory leaves: an
            // allocation past it fails that variable alone (MemoryError), not the whole cell.
            env.push(format!("SANDQ_STATE_MEMORY_LIMIT={}", limits.memory_bytes));
        }
    }
    if job.spec.dialect == Some(sandq_schemas::Dialect::Typescript) {
        // The Node.js runner strips the cell's types first (validated: node, notebook mode).
        env.push("SANDQ_TYPESCRIPT=1".to_owned());
    }
    if job.spec.compat == Some(sandq_schemas::Compat::E2b) {
        // E2B's code interpreter runs in /home/user (bound to the same directory as /work in
        // every sandbox) and displays an image `Image.save` writes (docs/e2b.md).
        env.push("SANDQ_WORKDIR=/home/user".to_owned());
        env.push("SANDQ_PIL_SAVE_DISPLAYS=1".to_owned());
    }
    env.extend(job.spec.env.iter().map(|(k, v)| format!("{k}={v}")));
    env
}

/// The part of the environment that depends on the sandbox, not the job: what a warm sandbox
/// starts with before its job's environment replaces it. `outputs_bytes`: notebook mode's
/// outputs budget (`SANDQ_OUTPUTS`, `SANDQ_OUTPUT_LIMIT`). `packages`: where installed
/// packages go and which indexes and CAs the installers use ([`crate::packages`]).
pub(crate) fn sandbox_environment(
    packages: &crate::packages::Packages,
    sku: sandq_schemas::Sku,
    limits: &SandboxLimits,
    outputs_bytes: Option<u64>,
) -> Vec<String> {
    // The CPUs the sandbox is pinned to (`sandbox::cpuset`): what every CPU count reads.
    let threads = crate::sandbox::cpuset::CpuPool::global().count_for(limits.cpus);
    let mut env = vec![
        // The commands of packages the job installs come after the image's.
        format!("PATH=/usr/local/bin:/usr/bin:/bin{}", crate::packages::Packages::path_suffix()),
        "HOME=/tmp".to_owned(),
        "TMPDIR=/tmp".to_owned(),
        "LANG=C.UTF-8".to_owned(),
        "MPLBACKEND=Agg".to_owned(),
        "MPLCONFIGDIR=/tmp/matplotlib".to_owned(),
        "PYTHONDONTWRITEBYTECODE=1".to_owned(),
        // Unbuffered stdout and stderr: what a program printed before a timeout, an OOM kill or
        // a cancel (SIGKILL, no chance to flush) is already in the pipe. Inherited by child
        // Python processes, and set before the interpreter starts (a warm sandbox too).
        "PYTHONUNBUFFERED=1".to_owned(),
        // Python 3.13's override of os.cpu_count() and os.process_cpu_count(), which otherwise
        // count every online CPU whatever the affinity (multiprocessing, the default process
        // pools and joblib/loky follow them).
        format!("PYTHON_CPU_COUNT={threads}"),
        // Also what `nproc` prints (it honours OMP_NUM_THREADS).
        format!("OMP_NUM_THREADS={threads}"),
        format!("OPENBLAS_NUM_THREADS={threads}"),
        format!("SANDQ_SKU={sku}"),
    ];
    env.extend(packages.environment());
    if let Some(bytes) = outputs_bytes {
        env.push(format!("SANDQ_OUTPUTS={OUTPUTS_FILE}"));
        env.push(format!("SANDQ_OUTPUT_LIMIT={}", bytes.saturating_sub(64 << 10)));
    }
    for name in ["OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"] {
        if let Ok(value) = std::env::var(name) {
            env.push(format!("{name}={value}"));
        }
    }
    env
}

/// Bytes per second the worker drains from a stream past its capture cap. Past the cap the
/// bytes are spliced to `/dev/null` (no copy through the worker), and a program writing
/// faster than this waits on its full pipe: an output flood costs the worker a few
/// milliseconds of CPU a second instead of as much CPU as the job (test:
/// an_output_flood_costs_the_worker_little_cpu in tests/hostile.rs).
pub(crate) const DISCARD_BYTES_PER_S: u64 = 64 << 20;

/// Pipe size while discarding, bytes: the most one splice moves.
const DISCARD_PIPE_BYTES: usize = 1 << 20;

/// Least time between two splices of one stream: with [`DISCARD_PIPE_BYTES`], at most 200 MiB/s
/// a stream drains, for at most 200 wake-ups a second.
const DISCARD_INTERVAL: Duration = Duration::from_millis(5);

/// Captures a stream (the read end of the sandbox's stdout or stderr pipe): the first `cap`
/// bytes are kept, the rest counted and discarded at most [`DISCARD_BYTES_PER_S`]. What is kept
/// is also handed to the attempt's live events once `live` is set ([`Started::stream_to`];
/// what came before, at the next read), never waiting on them.
async fn capture(stream: std::os::fd::OwnedFd, cap: u64, (live, text): (Arc<OnceLock<Live>>, Text)) -> Captured {
    use std::os::fd::AsFd;
    let mut captured = Captured::default();
    let Ok(stream) = crate::sys::async_pipe(stream) else {
        return captured;
    };
    // A 1 MiB pipe, read at most every DISCARD_INTERVAL: a program writing a byte at a time
    // wakes the worker 200 times a second, not once per write; the pipe holds what comes
    // meanwhile (best effort: the default size only costs more wake-ups).
    let _ = crate::sys::set_pipe_size(stream.get_ref().as_fd(), DISCARD_PIPE_BYTES as i32);
    let mut buf = vec![0u8; DISCARD_PIPE_BYTES];
    // Bytes of `captured` handed to `live` so far.
    let mut streamed = 0;
    while (captured.bytes.len() as u64) < cap {
        let Ok(mut ready) = stream.readable().await else { return captured };
        match ready.try_io(|fd| crate::sys::read_once(fd.get_ref().as_fd(), &mut buf)) {
            Ok(Ok(0)) | Ok(Err(_)) => return captured,
            Ok(Ok(n)) => {
                captured.total += n as u64;
                let room = cap.saturating_sub(captured.bytes.len() as u64) as usize;
                captured.bytes.extend_from_slice(&buf[..n.min(room)]);
                if let Some(live) = live.get() {
                    live.text(text, &captured.bytes[streamed..]);
                    streamed = captured.bytes.len();
                }
                tokio::time::sleep(DISCARD_INTERVAL).await;
            }
            Err(_would_block) => {}
        }
    }
    drop(buf);
    let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") else { return captured };
    let started = tokio::time::Instant::now();
    let mut discarded = 0u64;
    loop {
        let Ok(mut ready) = stream.readable().await else { return captured };
        match ready.try_io(|fd| crate::sys::splice_out(fd.get_ref().as_fd(), null.as_fd(), DISCARD_PIPE_BYTES)) {
            Ok(Ok(0)) | Ok(Err(_)) => return captured,
            Ok(Ok(n)) => {
                captured.total += n as u64;
                discarded += n as u64;
                // At most one wake-up per DISCARD_INTERVAL (the pipe fills meanwhile), and no
                // faster than DISCARD_BYTES_PER_S on average.
                let due = started + Duration::from_secs_f64(discarded as f64 / DISCARD_BYTES_PER_S as f64);
                tokio::time::sleep_until(due.max(tokio::time::Instant::now() + DISCARD_INTERVAL)).await;
            }
            Err(_would_block) => {}
        }
    }
}

/// What a sandbox is started with.
#[derive(Debug, Clone)]
pub(crate) struct Launch<'a> {
    /// Its container id (random).
    pub container_id: &'a str,
    /// The program's argv.
    pub args: Vec<String>,
    /// The program's environment.
    pub env: Vec<String>,
    /// CPU, memory and process limits of the job's SKU.
    pub limits: SandboxLimits,
    /// The user namespace range ([`Settings::id_map_for`]).
    pub id_map: Option<crate::sandbox::spec::IdMap>,
    /// Attach to the outbound network.
    pub outbound: bool,
    /// A warm start: the program waits for its job, and the clock starts at the handover.
    pub warm: bool,
    /// Wall-clock limit (a cold start's, from the start; a warm start sends its job's own).
    pub timeout: Duration,
    /// A forked start (with `warm`): the program is a holder, and the job's process is forked
    /// into the sandbox once it has started, from the template listening here.
    pub fork: Option<std::path::PathBuf>,
}

/// A started helper and its container (running, or for a warm start waiting for its job).
/// Dropped unfinished, its control pipe closes and the helper kills and deletes the container.
#[derive(Debug)]
pub(crate) struct Started {
    container_id: String,
    child: tokio::process::Child,
    control: tokio::process::ChildStdin,
    stdout: tokio::task::JoinHandle<Captured>,
    stderr: tokio::task::JoinHandle<Captured>,
    /// The attempt's live events, once the sandbox is a job's: the capture tasks copy text there.
    live: Arc<OnceLock<Live>>,
    warm: bool,
    /// The CPUs the container is pinned to, held until its program has ended; none for a warm
    /// sandbox until its job is handed over ([`Started::pin`]).
    _cpus: Option<crate::sandbox::cpuset::CpuLease>,
    /// CPU time the sandbox used before its job was handed over (a warm sandbox's warm-up),
    /// ms: not the job's, taken off the report's usage (a warm job's `cpu_ms` would count the
    /// warm-up: 1,027 ms against 194 cold).
    cpu_ms_before_job: u64,
}

/// A warm start's handover: the job's environment and arguments (the program after the
/// runner's own argv).
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Handover {
    /// `NAME` -> value, the whole environment a cold start would have had.
    pub env: std::collections::BTreeMap<String, String>,
    /// Arguments after the script.
    pub args: Vec<String>,
    /// A script job's whole argv ([`command`]): its warm sandbox's waiter `exec`s it with
    /// `env` (none for a notebook job, whose runner is already running).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
}

/// Whether sandboxes get a time namespace of their own: the kernel has them; without, the
/// worker says once that sandboxes see the host's boot time.
fn time_namespaces() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        let supported = crate::sys::time_namespaces_supported();
        if !supported {
            tracing::warn!("the kernel has no time namespaces (CONFIG_TIME_NS, Linux 5.6+): sandboxes see the host's boot time and uptime");
        }
        supported
    })
}

/// Writes the bundle and starts the helper, which creates and starts the container.
///
/// # Errors
/// [`RunError`], infrastructure failures.
pub(crate) async fn start(dir: &JobDir, settings: &Settings, launch: &Launch<'_>) -> Result<Started, RunError> {
    let cgroups_path = crate::layout::cgroup_path(launch.container_id);
    let resolv_conf = dir.src.join(crate::layout::RESOLV_CONF);
    let ca_bundle = dir.src.join(crate::layout::CA_BUNDLE);
    // A warm sandbox holds no CPUs while it waits (idle warm sandboxes' pins would make running
    // jobs share CPUs): it may run on any, at the lowest weight, and is pinned when its job
    // arrives (test: a_warm_start_and_a_cold_one_get_cpus_of_their_own in tests/warm.rs).
    let pool = crate::sandbox::cpuset::CpuPool::global();
    let cpus = (!launch.warm).then(|| pool.lease(launch.limits.cpus));
    let cpuset = cpus.as_ref().map_or_else(|| pool.all_list(), crate::sandbox::cpuset::CpuLease::cpu_list);
    let sandbox = JobSandbox {
        rootfs: &settings.rootfs,
        work_dir: &dir.work,
        src_dir: &dir.src,
        cgroups_path: &cgroups_path,
        args: launch.args.clone(),
        env: launch.env.clone(),
        uid: settings.sandbox_uid,
        gid: settings.sandbox_uid,
        limits: launch.limits,
        cpuset: Some(&cpuset),
        id_map: launch.id_map,
        seccomp: settings.seccomp,
        resolv_conf: launch.outbound.then_some(resolv_conf.as_path()),
        // Written by staging for an outbound job when the worker has extra CAs.
        ca_bundle: (launch.outbound && settings.packages.ca_bundle.is_some()).then_some(ca_bundle.as_path()),
        out_dir: Some(&dir.out),
        in_dir: Some(&dir.input),
        packages_dir: Some(&dir.packages),
        host_clocks: time_namespaces().then(spec::host_clocks).flatten(),
        low_cpu_weight: launch.warm,
    };
    spec::write(&spec::build(&sandbox)?, &dir.bundle)?;
    let request = SandboxRequest {
        container_id: launch.container_id.to_owned(),
        bundle: dir.bundle.clone(),
        state_root: settings.state_root.clone(),
        stdin_path: Some(dir.stdin.clone()),
        timeout_ms: launch.timeout.as_millis() as u64,
        report_path: dir.report.clone(),
        cgroups_path,
        outbound: launch.outbound,
        userns: launch.id_map,
        warm: launch.warm,
        fork: launch.fork.clone(),
    };
    let mut line = serde_json::to_vec(&request).map_err(|e| RunError::Helper(e.into()))?;
    line.push(b'\n');
    let mut child = Command::new(&settings.container_helper)
        .arg("run")
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Not kill_on_drop: if this is dropped (the job task aborted, a warm sandbox
        // discarded), closing the control pipe makes the helper kill, reap and delete the
        // container; a SIGKILLed helper would leave it running.
        .kill_on_drop(false)
        .spawn()
        .map_err(RunError::Helper)?;
    // Until its status is collected, a dropped job dir waits for this helper.
    if let Some(pidfd) = child.id().and_then(|pid| i32::try_from(pid).ok()).and_then(|pid| crate::sys::pidfd_open(pid).ok()) {
        dir.helper_started(pidfd);
    }
    let mut control = child.stdin.take().ok_or_else(|| RunError::Helper(std::io::Error::other("no stdin pipe")))?;
    control.write_all(&line).await.map_err(RunError::Helper)?;
    let cap = settings.outputs.max_output_bytes;
    let pipe = |fd: Option<std::io::Result<std::os::fd::OwnedFd>>, name: &str| {
        fd.unwrap_or_else(|| Err(std::io::Error::other(format!("no {name} pipe")))).map_err(RunError::Helper)
    };
    let live = Arc::new(OnceLock::new());
    let stdout = tokio::spawn(capture(pipe(child.stdout.take().map(|s| s.into_owned_fd()), "stdout")?, cap, (live.clone(), Text::Stdout)));
    let stderr = tokio::spawn(capture(pipe(child.stderr.take().map(|s| s.into_owned_fd()), "stderr")?, cap, (live.clone(), Text::Stderr)));
    Ok(Started {
        container_id: launch.container_id.to_owned(),
        child,
        control,
        stdout,
        stderr,
        live,
        warm: launch.warm,
        _cpus: cpus,
        cpu_ms_before_job: 0,
    })
}

impl Started {
    /// The program's text also goes to `live`, from its first byte (a warm sandbox's warm-up
    /// prints nothing).
    pub(crate) fn stream_to(&self, live: &Live) {
        let _ = self.live.set(live.clone());
    }

    /// Pins a warm sandbox, now its job's, to CPUs of its own for `cores` (the SKU's), as a cold
    /// start is pinned from the start: the cpuset cgroup is rewritten, which moves its
    /// processes.
    ///
    /// # Errors
    /// The cgroup write's error.
    pub(crate) fn pin(&mut self, cores: f64) -> std::io::Result<()> {
        let lease = crate::sandbox::cpuset::CpuPool::global().lease(cores);
        crate::sandbox::cgroup::set_cpuset(&crate::layout::cgroup_path(&self.container_id), &lease.cpu_list())?;
        self._cpus = Some(lease);
        Ok(())
    }

    /// The memory a warm sandbox's warm-up holds now (the interpreter and its preloaded
    /// modules), at most `reserve` (`warm.memory_bytes`), bytes; `reserve` when unreadable.
    pub(crate) fn warmup_memory(&self, reserve: u64) -> u64 {
        crate::sandbox::cgroup::memory_current(&crate::layout::cgroup_path(&self.container_id)).unwrap_or(reserve).min(reserve)
    }

    /// Hands a warm sandbox's resources to its job: notes the warm-up's CPU time, which is not
    /// the job's usage, and, when `extra_memory_bytes` is not 0, raises its memory limit to
    /// `memory_bytes` (the SKU's) plus that, so that a program that fits a cold start fits a
    /// warm one (test: a_warm_start_leaves_the_job_the_memory_of_a_cold_one in tests/warm.rs).
    /// The caller takes `extra_memory_bytes` from the worker's capacity first
    /// ([`crate::capacity::Reservation::try_grow_memory`]).
    ///
    /// # Errors
    /// The cgroup write's error.
    pub(crate) fn hand_over_resources(&mut self, memory_bytes: u64, extra_memory_bytes: u64) -> std::io::Result<()> {
        let path = crate::layout::cgroup_path(&self.container_id);
        self.cpu_ms_before_job = crate::sandbox::cgroup::read(&path).cpu_ms;
        if extra_memory_bytes == 0 {
            return Ok(());
        }
        crate::sandbox::cgroup::raise_memory_limit(&path, memory_bytes.saturating_add(extra_memory_bytes))
    }
}

impl Started {
    /// True while the helper runs (a warm sandbox that died is discarded).
    pub(crate) fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Stops a container nobody will use (a warm sandbox at shutdown) and waits for its
    /// helper to delete it, so that dropping `dir` then removes the dir at once.
    pub(crate) async fn discard(mut self, dir: &JobDir) {
        let _ = self.control.write_all(b"kill\n").await;
        drop(self.control);
        if tokio::time::timeout(HELPER_GRACE, self.child.wait()).await.is_ok() {
            dir.helper_exited();
        }
    }

    /// Runs the container to completion and reads the helper's report. A warm start first
    /// hands the job over (`handover` into `src/`, a byte into the runner's FIFO, then
    /// `go <timeout_ms>` to the helper). When `stop` resolves first (cancellation, shutdown
    /// past its grace), the helper kills the container and the report's exit is
    /// [`crate::sandbox::Exit::Killed`].
    ///
    /// # Errors
    /// [`RunError`], all infrastructure failures; the program's own failures are in the
    /// report.
    pub(crate) async fn finish(
        mut self,
        dir: &JobDir,
        settings: &Settings,
        timeout: Duration,
        handover: Option<&Handover>,
        stop: impl std::future::Future<Output = ()>,
    ) -> Result<RunOutput, RunError> {
        if self.warm {
            let handover = handover.ok_or_else(|| RunError::Helper(std::io::Error::other("a warm start needs a handover")))?;
            hand_over(dir, handover).await.map_err(RunError::Handover)?;
            let line = format!("go {}\n", timeout.as_millis());
            self.control.write_all(line.as_bytes()).await.map_err(RunError::Helper)?;
        }
        // The helper closes its copies of the program's streams once the sandbox's processes
        // are gone and its report is written, then deletes the container: the end of both
        // streams is the program's end, and the result does not wait for the delete (the job
        // dir's removal does: `JobDir::remove`).
        let Started { container_id, mut child, mut control, stdout, stderr, cpu_ms_before_job, .. } = self;
        let deadline = tokio::time::Instant::now() + timeout + HELPER_GRACE;
        let streams = async {
            let stdout = stdout.await.unwrap_or_default();
            (stdout, stderr.await.unwrap_or_default())
        };
        tokio::pin!(streams);
        tokio::pin!(stop);
        let mut stopped = false;
        let ((stdout, stderr), status) = loop {
            tokio::select! {
                streams = &mut streams => break (streams, None),
                status = child.wait() => {
                    dir.helper_exited();
                    let status = status.map_err(RunError::Helper)?;
                    // Every writer of the pipes is gone with the helper and the container's pid
                    // namespace; the bound only guards against a leaked writer.
                    let streams = tokio::time::timeout(Duration::from_secs(5), &mut streams).await.unwrap_or_default();
                    break (streams, Some(status));
                }
                () = &mut stop, if !stopped => {
                    // Cancelled or shutting down: the helper kills the container and reports
                    // `Killed`.
                    stopped = true;
                    let _ = control.write_all(b"kill\n").await;
                }
                () = tokio::time::sleep_until(deadline) => {
                    let _ = child.kill().await;
                    dir.helper_exited();
                    delete_container(settings, &container_id).await;
                    return Err(RunError::HelperHung);
                }
            }
        };
        drop(control);
        let report = match (read_report(&dir.report).await, status) {
            (Ok(report), _) => report,
            (Err(source), Some(status)) => return Err(RunError::NoReport { status: status.to_string(), source }),
            // The streams ended without a report while the helper runs (it could not write
            // one): its exit says why.
            (Err(_), None) => {
                let status = match tokio::time::timeout_at(deadline, child.wait()).await {
                    Ok(status) => status.map_err(RunError::Helper)?,
                    Err(_) => {
                        let _ = child.kill().await;
                        dir.helper_exited();
                        delete_container(settings, &container_id).await;
                        return Err(RunError::HelperHung);
                    }
                };
                dir.helper_exited();
                read_report(&dir.report).await.map_err(|source| RunError::NoReport { status: status.to_string(), source })?
            }
        };
        let mut report = report;
        report.stats.cpu_ms = report.stats.cpu_ms.saturating_sub(cpu_ms_before_job);
        Ok(RunOutput { report, stdout, stderr })
    }
}

/// Writes the handover where the warm runner reads it, then wakes the runner through its FIFO
/// (opened non-blocking: no reader means the runner is not waiting, and the start fails
/// rather than hangs).
async fn hand_over(dir: &JobDir, handover: &Handover) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let bytes = serde_json::to_vec(handover).map_err(std::io::Error::other)?;
    let path = dir.src.join(crate::layout::WARM_HANDOVER);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, &bytes))?;
    let go = dir.out.join(crate::layout::WARM_GO);
    let mut last = None;
    for _ in 0..100 {
        let opened = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC).open(&go);
        match opened {
            Ok(mut fifo) => return std::io::Write::write_all(&mut fifo, b"g"),
            // ENXIO: the runner has not opened its end yet (it is about to).
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => last = Some(e),
            Err(e) => return Err(e),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("the warm runner is not waiting")))
}

/// Why the helper's report file could not be read ([`read_report`]).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReportError {
    /// The file could not be read (the helper died before writing it).
    #[error("{0}")]
    Read(#[source] std::io::Error),
    /// The file is not a [`SandboxReport`] in JSON (a partial write).
    #[error("{0}")]
    Decode(#[source] serde_json::Error),
}

/// The [`SandboxReport`] the helper wrote at `path`.
async fn read_report(path: &Path) -> Result<SandboxReport, ReportError> {
    let bytes = tokio::fs::read(path).await.map_err(ReportError::Read)?;
    serde_json::from_slice(&bytes).map_err(ReportError::Decode)
}

/// Deletes one container through the helper (never from this process).
pub(crate) async fn delete_container(settings: &Settings, container_id: &str) {
    let status =
        Command::new(&settings.container_helper).arg("delete").arg(&settings.state_root).arg(container_id).env_clear().status().await;
    if let Err(e) = status {
        tracing::error!(container_id, error = %e, "cannot run sandq-container delete");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandq_schemas::{validate::Limits, JobSpec, RunMode, Sku};

    fn argv(runtime: Runtime, mode: Option<RunMode>) -> Vec<String> {
        let mut spec = JobSpec::new("job-1", Sku::S, runtime, "1");
        spec.mode = mode;
        spec.args = vec!["a".into()];
        command(&spec.validate(&Limits::default()).expect("valid"))
    }

    #[test]
    fn notebook_mode_runs_the_runtimes_runner_and_script_mode_the_interpreter() {
        assert_eq!(argv(Runtime::Python, None), ["python3", "/sandq/sandq_runner.py", "/sandq/main.py", "a"]);
        let stdio = ["--require", "/sandq/sandq_stdio.js"];
        assert_eq!(argv(Runtime::Node, None), ["node", stdio[0], stdio[1], "/sandq/sandq_runner.js", "/sandq/main.js", "a"]);
        assert_eq!(
            argv(Runtime::Node, Some(RunMode::Notebook)),
            ["node", stdio[0], stdio[1], "/sandq/sandq_runner.js", "/sandq/main.js", "a"]
        );
        assert_eq!(argv(Runtime::Python, Some(RunMode::Script)), ["python3", "/sandq/main.py", "a"]);
        assert_eq!(argv(Runtime::Node, Some(RunMode::Script)), ["node", stdio[0], stdio[1], "/sandq/main.js", "a"]);
        // The runner and preload named are files the stage writes.
        for runtime in [Runtime::Python, Runtime::Node] {
            for file in argv(runtime, None).iter().filter_map(|a| a.strip_prefix("/sandq/")).filter(|f| *f != "main.py" && *f != "main.js")
            {
                assert!(crate::layout::runner_files(runtime).iter().any(|(name, _)| *name == file), "{runtime:?} {file}");
            }
        }
    }
}
