//! The sandbox: an OCI bundle per job ([`spec`]) run by libcontainer in a single-threaded
//! helper process ([`helper`], the `sandq-container` binary), never in the worker's
//! multi-threaded tokio process (libcontainer forks and `chdir`s the whole process: hangs and
//! races were reproduced there; `docs/STYLE.md`, The sandbox).
//!
//! Protocol between the worker and the helper, one helper process per container:
//! - argv: `sandq-container run` (or `sandq-container cleanup <state_root>`);
//! - stdin: one line of JSON, a [`SandboxRequest`]; then the pipe stays open as the control
//!   channel: a line `kill` or end-of-file (the worker died or gave up) kills the container;
//!   for a warm start, a line `go <timeout_ms>` starts the job's clock;
//! - stdout / stderr: handed to the container as its own stdout / stderr (the helper writes
//!   nothing to them);
//! - the [`SandboxReport`] is written as JSON to `report_path` (replaced whole) as soon as the
//!   program has ended and every process of the sandbox is gone; the helper then points its
//!   stdout and stderr at `/dev/null`, so that the end of both pipes tells the worker the
//!   report is there, deletes the container and writes the report again with the delete's
//!   (`deleted`); exit code 0 when the final report was written.

pub mod cgroup;
pub mod cpuset;
pub mod fork;
pub mod helper;
pub mod host_limits;
pub mod network;
pub mod spec;
pub mod template;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use cgroup::CgroupStats;

/// What the worker asks the helper to run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxRequest {
    /// Container id: `[A-Za-z0-9_+.-]`, unique on this host.
    pub container_id: String,
    /// Bundle directory holding `config.json`.
    pub bundle: PathBuf,
    /// libcontainer's state root (`<root>/<id>/state.json`).
    pub state_root: PathBuf,
    /// File fed to the program's stdin; `/dev/null` when `None`.
    pub stdin_path: Option<PathBuf>,
    /// Wall-clock limit from start, milliseconds; then every process of the job is killed.
    pub timeout_ms: u64,
    /// Where the helper writes its [`SandboxReport`].
    pub report_path: PathBuf,
    /// The spec's `linux.cgroupsPath`, to read usage before delete.
    pub cgroups_path: String,
    /// Attach the sandbox to the outbound network ([`network`]); otherwise loopback only.
    #[serde(default)]
    pub outbound: bool,
    /// The user namespace's id map: the helper creates the namespace itself, owned by the
    /// range's first host uid, and points the bundle's user namespace entry at it (see
    /// [`crate::sys::UsernsHolder`]). `None`: the spec's own user namespace settings stand.
    #[serde(default)]
    pub userns: Option<spec::IdMap>,
    /// A warm start: after `start`, wait (without a deadline) for a control line
    /// `go <timeout_ms>`; the timeout runs from then. The program is the notebook runner in
    /// `--warm` mode, which waits for its job itself.
    #[serde(default)]
    pub warm: bool,
    /// A forked start (with `warm`): the container's process is only a holder, and once it has
    /// started the job's process is forked into the sandbox from the template listening on
    /// this socket ([`fork`]); it then waits for `go` as a warm runner does.
    #[serde(default)]
    pub fork: Option<PathBuf>,
}

/// How the program ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Exit {
    /// It exited with `code`.
    Exited {
        /// Exit code, 0..=255.
        code: i32,
    },
    /// A signal killed it (not one the helper sent).
    Signaled {
        /// Signal name (`SIGSEGV`).
        signal: String,
    },
    /// It ran past the timeout and the helper killed it.
    TimedOut,
    /// The worker asked for a kill (control line `kill`) or went away (EOF).
    Killed,
    /// The container could not be created or started.
    Failed {
        /// The lifecycle step (`create`, `start`, `wait`).
        step: String,
        /// libcontainer's error, with its sources.
        message: String,
    },
}

/// What the helper reports after the container is gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxReport {
    /// How the program ended.
    pub exit: Exit,
    /// Usage from the cgroup (zero when the container never started).
    pub stats: CgroupStats,
    /// From `start()` to the init's exit, milliseconds.
    pub wall_ms: u64,
    /// Time spent in `build()` (create), `start()`, and `delete()`, microseconds.
    pub create_us: u64,
    /// See `create_us`.
    pub start_us: u64,
    /// See `create_us`.
    pub delete_us: u64,
    /// A forked start: the fork into the started sandbox (the seccomp program read back, the
    /// template's fork, the namespaces joined, the move into the cgroup), microseconds, before
    /// the job arrived; 0 for other starts.
    #[serde(default)]
    pub fork_us: u64,
    /// Error of `delete`, if it failed (the container may be left behind; startup cleanup
    /// retries).
    pub delete_error: Option<String>,
    /// The report is the final one, written after the delete: the first, written as soon as
    /// the program has ended and its processes are gone, has no delete's time or error yet.
    #[serde(default)]
    pub deleted: bool,
}
