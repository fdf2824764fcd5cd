//! The sandbox's file contract: what the worker puts where in a job's `src/` (mounted
//! read-only at `/sandq`) and outputs tmpfs (`/sandq/out`), the notebook runners' files, and
//! the cgroup path of a container. Both sides (the job dir on the host, the OCI spec and the
//! runner inside) take these names from here.

/// The cgroup path of container `container_id` (below the `sandq` parent of every controller).
#[must_use]
pub(crate) fn cgroup_path(container_id: &str) -> String {
    format!("/sandq/{container_id}")
}

/// Where the sandbox sees its packages directory (the job dir's `disk/packages`).
pub(crate) const SANDBOX_PACKAGES: &str = "/sandq/packages";

/// The mount point of [`SANDBOX_PACKAGES`] in the job's `src/` (mounted at `/sandq`), and the
/// packages directory's name on the job's disk: the one member of a packages archive.
pub(crate) const PACKAGES_MOUNT_POINT: &str = "packages";

/// Where a sandbox finds its trusted CAs: the image's bundle path, over which the worker's
/// combined bundle is bind-mounted when `worker.extra_ca_certs` is set.
pub(crate) const SANDBOX_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// The FIFO a warm runner waits on, in the outputs tmpfs (`/sandq/out/.go`).
pub(crate) const WARM_GO: &str = ".go";
/// Created by a warm runner once it is ready for a job (`/sandq/out/.ready`).
pub(crate) const WARM_READY: &str = ".ready";
/// The handover of a warm start, in `src/` (`/sandq/handover.json`, read-only for the
/// sandbox): the job's environment and arguments.
pub(crate) const WARM_HANDOVER: &str = "handover.json";

/// Name of an outbound job's `resolv.conf` in its `src/` (bind-mounted at `/etc/resolv.conf`).
pub(crate) const RESOLV_CONF: &str = ".resolv.conf";

/// The file bind-mounted over the sandbox's `/etc/hostname`, in `src/`.
pub(crate) const HOSTNAME_FILE: &str = ".hostname";

/// What the sandbox reads in `/etc/hostname`: its UTS name. The image's own file is whatever
/// the host that built it had (mmdebstrap copies it), and the worker's default id is that
/// host's name (test: no_host_path_visible_in_the_sandbox_names_the_job in tests/hostile.rs).
pub(crate) const HOSTNAME: &[u8] = b"sandbox\n";

/// The file bind-mounted over `/etc/resolv.conf` of a sandbox without network, in `src/`: no
/// nameserver (the image's file names the build host's resolvers).
pub(crate) const NO_RESOLV_FILE: &str = ".resolv.none";

/// What a sandbox without network reads in `/etc/resolv.conf`.
pub(crate) const NO_RESOLV: &[u8] = b"# no network\n";

/// The file bind-mounted over the sandbox's `/proc/loadavg`, in `src/`.
pub(crate) const LOADAVG_FILE: &str = ".loadavg";

/// What the sandbox reads in `/proc/loadavg`: no load, one runnable task of one, last pid 1.
/// The host's file shows the load of every job on the machine, its task count and the last pid
/// the host allocated, which rises with every process any job starts; `getloadavg(3)` and
/// `os.getloadavg()` still parse this one (test: host_disk_activity_and_paths_are_not_visible
/// in tests/hostile.rs).
pub(crate) const LOADAVG: &[u8] = b"0.00 0.00 0.00 1/1 1\n";

/// Name of an outbound job's CA bundle in its `src/` (bind-mounted over the image's,
/// [`SANDBOX_CA_BUNDLE`]), when the worker has `extra_ca_certs`.
pub(crate) const CA_BUNDLE: &str = ".ca-certificates.crt";

/// The notebook state restored for the job, in its input dir (`/sandq/in/state.in`): on the
/// job's disk, read-only to the sandbox, never in a tmpfs (a tmpfs page the worker writes is
/// charged to the worker's memory, not the job's).
pub(crate) const STATE_IN: &str = "state.in";
/// Where the job's input dir is mounted (read-only), and its mount point in `src/`.
pub(crate) const SANDBOX_INPUT: &str = "/sandq/in";
pub(crate) const INPUT_MOUNT_POINT: &str = "in";
/// The notebook state the runner saves, in the outputs tmpfs (`/sandq/out/state.out`).
pub(crate) const STATE_OUT: &str = "state.out";
/// The runner's report on the state (JSON), in the outputs tmpfs (`/sandq/out/state.json`).
pub(crate) const STATE_REPORT: &str = "state.json";

/// The Python notebook runner and its matplotlib backend, written next to the user's code
/// (the image stays as built; see `oci-bundles/runner/README.md`).
const RUNNER_FILES: [(&str, &str); 14] = [
    ("sandq_runner.py", include_str!("../../oci-bundles/runner/sandq_runner.py")),
    ("sandq_mpl.py", include_str!("../../oci-bundles/runner/sandq_mpl.py")),
    ("sandq_nb/__init__.py", include_str!("../../oci-bundles/runner/sandq_nb/__init__.py")),
    ("sandq_nb/bundles.py", include_str!("../../oci-bundles/runner/sandq_nb/bundles.py")),
    ("sandq_nb/common.py", include_str!("../../oci-bundles/runner/sandq_nb/common.py")),
    ("sandq_nb/formatters.py", include_str!("../../oci-bundles/runner/sandq_nb/formatters.py")),
    ("sandq_nb/imports.py", include_str!("../../oci-bundles/runner/sandq_nb/imports.py")),
    ("sandq_nb/outputs.py", include_str!("../../oci-bundles/runner/sandq_nb/outputs.py")),
    ("sandq_nb/run.py", include_str!("../../oci-bundles/runner/sandq_nb/run.py")),
    ("sandq_nb/shell.py", include_str!("../../oci-bundles/runner/sandq_nb/shell.py")),
    ("sandq_nb/state.py", include_str!("../../oci-bundles/runner/sandq_nb/state.py")),
    ("sandq_nb/tracebacks.py", include_str!("../../oci-bundles/runner/sandq_nb/tracebacks.py")),
    ("sandq_nb/template.py", include_str!("../../oci-bundles/runner/sandq_nb/template.py")),
    ("sandq_nb/warm.py", include_str!("../../oci-bundles/runner/sandq_nb/warm.py")),
];

/// The Node.js notebook runner, written next to the user's code like [`RUNNER_FILES`].
/// With it the stdio preload, [`NODE_STDIO`].
const NODE_RUNNER_FILES: [(&str, &str); 2] =
    [("sandq_runner.js", include_str!("../../oci-bundles/runner/sandq_runner.js")), (NODE_STDIO, NODE_STDIO_JS)];

pub(crate) const NODE_STDIO_JS: &str = include_str!("../../oci-bundles/runner/sandq_stdio.js");

/// The Node.js preload every Node.js job runs with (`node --require /sandq/sandq_stdio.js`, both
/// modes): blocking writes to stdout and stderr, so that `process.exit` loses nothing.
pub(crate) const NODE_STDIO: &str = "sandq_stdio.js";

/// The waiter of a warm sandbox for script jobs, run as `python3 -I -S -c <it>` (no file in
/// `/sandq`, where a cold script job has none): it waits for the handover, then `execvpe`s
/// the job's argv with its environment ([`crate::warm`]).
pub(crate) const EXEC_WAITER: &str = include_str!("../../oci-bundles/runner/sandq_exec.py");

/// The notebook runner's files for a runtime: the first is the one the interpreter runs
/// ([`crate::run::command`]).
pub(crate) fn runner_files(runtime: sandq_schemas::Runtime) -> &'static [(&'static str, &'static str)] {
    match runtime {
        sandq_schemas::Runtime::Python => &RUNNER_FILES,
        sandq_schemas::Runtime::Node => &NODE_RUNNER_FILES,
    }
}
