//! The job a client publishes: [`JobSpec`].

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A job as published to RabbitMQ: one MessagePack map per message.
///
/// Exactly one of `code` and `entrypoint` is set. Durations are humantime strings (`"60s"`,
/// `"2m 30s"`, `"24h"`). See `docs/protocol.md` for the same table in language-neutral terms.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    /// Wire format version; must equal [`crate::SCHEMA_VERSION`].
    #[serde(deserialize_with = "decode::schema_version")]
    pub schema_version: u32,
    /// Chosen by the client: 1 to 64 of `[A-Za-z0-9_-]` (a UUID fits). Unique per job: the
    /// result key and artifact prefix are derived from it.
    #[serde(deserialize_with = "decode::job_id")]
    pub job_id: String,
    /// Sandbox size; decides cpu, memory and pids limits and the queue the job goes to.
    #[serde(deserialize_with = "decode::sku")]
    pub sku: Sku,
    /// Language runtime that runs `code` or `entrypoint`.
    #[serde(deserialize_with = "decode::runtime")]
    pub runtime: Runtime,
    /// Source code to run (UTF-8), at most `Limits::max_code_bytes`. The sandbox sees it as
    /// `/sandq/main.py` (or `main.js`), read-only; the working directory is `/work`.
    #[serde(default, deserialize_with = "decode::code")]
    pub code: Option<String>,
    /// Instead of `code`: the path, relative to `/work`, of an uploaded input file to run.
    #[serde(default, deserialize_with = "decode::entrypoint")]
    pub entrypoint: Option<String>,
    /// Command-line arguments passed to the program (`sys.argv[1:]`, `process.argv.slice(2)`).
    #[serde(default, deserialize_with = "decode::args")]
    pub args: Vec<String>,
    /// Files staged into `/work` before the program starts.
    #[serde(default, deserialize_with = "decode::inputs")]
    pub inputs: Vec<InputFile>,
    /// Bytes fed to the program's standard input (MessagePack bin or str); empty when absent.
    #[serde(default, serialize_with = "serde_bytes::serialize", deserialize_with = "decode::stdin")]
    pub stdin: Option<Vec<u8>>,
    /// Extra environment variables of the program. Names match `[A-Za-z_][A-Za-z0-9_]*`; the
    /// sandbox's own (`PATH`, `HOME`, `SANDQ_*` ...) cannot be overridden.
    #[serde(default, deserialize_with = "decode::env")]
    pub env: BTreeMap<String, String>,
    /// Wall-clock limit of the program, humantime (`"60s"`); default 60 s, at most the worker's
    /// configured maximum.
    #[serde(default, deserialize_with = "decode::timeout")]
    pub timeout: Option<String>,
    /// How long the result stays in Redis after the job ends, humantime; default 24 h.
    #[serde(default, deserialize_with = "decode::result_ttl")]
    pub result_ttl: Option<String>,
    /// Network of the sandbox; default `none` (loopback only).
    #[serde(default, deserialize_with = "decode::network")]
    pub network: NetworkMode,
    /// When the client submitted the job, Unix epoch milliseconds (copied to the result).
    #[serde(default, deserialize_with = "decode::submitted_at_ms")]
    pub submitted_at_ms: Option<u64>,
    /// Latest start, Unix epoch milliseconds: a job still queued then is not run (status
    /// `expired`). `None`: no deadline.
    #[serde(default, deserialize_with = "decode::deadline_ms")]
    pub deadline_ms: Option<u64>,
    /// How the program runs: `notebook` (the default: like one notebook cell, whose last
    /// expression's value (and for Python `display()` calls and figures) comes back as MIME
    /// bundles in `JobResult::outputs`, an uncaught error in `JobResult::error`) or `script`
    /// (`python3 main.py` / `node main.js`). `None`: notebook.
    #[serde(default, deserialize_with = "decode::mode")]
    pub mode: Option<RunMode>,
    /// Session whose files are restored into `/work` before the program runs and saved from
    /// it afterwards: 1 to 64 of `[A-Za-z0-9_.-]`, not starting with `.`. Anyone who knows a
    /// session's name can use its files: choose unguessable names (a UUID). `None`: no session.
    #[serde(default, deserialize_with = "decode::session")]
    pub session: Option<String>,
    /// What another code-execution service's programs expect of the sandbox, for the
    /// gateway's compatibility layers: `e2b` makes `/home/user` (the same directory as `/work`)
    /// the working directory and has PIL's `Image.save` display the image, as E2B's code
    /// interpreter does (docs/e2b.md). `None` (left out of the encoding): sandq's own.
    #[serde(default, deserialize_with = "decode::compat", skip_serializing_if = "Option::is_none")]
    pub compat: Option<Compat>,
    /// A named notebook state within the session (E2B's contexts): a notebook cell restores
    /// and saves that context's variables and counts its own cells, sharing the session's
    /// files; 1 to 64 of `[A-Za-z0-9_.-]`, only with `session`. A session keeps at most 16
    /// contexts, the least recently used dropped first. `None` (left out of the encoding): the
    /// session's own state.
    #[serde(default, deserialize_with = "decode::context", skip_serializing_if = "Option::is_none")]
    pub context: Option<String>,
    /// The language of `code` when it is not the runtime's own: `typescript` (Node.js,
    /// notebook mode only) has its types stripped (TypeScript's `transpileModule`, one file on
    /// its own) before it runs. `None` (left out of the encoding): the runtime's language.
    #[serde(default, deserialize_with = "decode::dialect", skip_serializing_if = "Option::is_none")]
    pub dialect: Option<Dialect>,
}

/// A language a runtime runs by translation (`JobSpec::dialect`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dialect {
    /// TypeScript on Node.js: the types are stripped.
    Typescript,
}

/// A compatibility profile (`JobSpec::compat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Compat {
    /// E2B's code interpreter: working directory `/home/user`, `Image.save` displays.
    E2b,
}

/// How a program runs (`JobSpec::mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunMode {
    /// The code runs as one notebook cell (Python: in IPython's `InteractiveShell`; Node.js:
    /// as the body of an async function, top-level `await` allowed); the result's `outputs`
    /// holds its rich outputs and `error` its uncaught error.
    Notebook,
    /// `python3 main.py` / `node main.js`: stdout, stderr and the exit code only.
    Script,
}

impl JobSpec {
    /// A job running `code` with every optional field empty: no inputs, args, stdin or env,
    /// the worker's default timeout and result TTL, no network, notebook mode, no session, no
    /// deadline. Set the rest on the returned value.
    pub fn new(job_id: impl Into<String>, sku: Sku, runtime: Runtime, code: impl Into<String>) -> Self {
        JobSpec {
            schema_version: crate::SCHEMA_VERSION,
            job_id: job_id.into(),
            sku,
            runtime,
            code: Some(code.into()),
            entrypoint: None,
            args: Vec::new(),
            inputs: Vec::new(),
            stdin: None,
            env: BTreeMap::new(),
            timeout: None,
            result_ttl: None,
            network: NetworkMode::None,
            submitted_at_ms: None,
            deadline_ms: None,
            mode: None,
            session: None,
            compat: None,
            context: None,
            dialect: None,
        }
    }

    /// The mode this job runs in: the one it names, else `notebook` (for every runtime).
    pub fn run_mode(&self) -> RunMode {
        self.mode.unwrap_or(RunMode::Notebook)
    }
}

/// An input file: an S3 object the client uploaded, and where it appears in the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputFile {
    /// S3 object key in the sandq bucket. Clients use the content-addressed layout
    /// [`crate::names::input_key`] (`inputs/sha256/<hex>`).
    #[serde(deserialize_with = "decode_input::key")]
    pub key: String,
    /// Path inside `/work`, relative, `/`-separated, no `..`, no empty or `.` components.
    #[serde(deserialize_with = "decode_input::path")]
    pub path: String,
    /// Size in bytes; the staged object must have exactly this size.
    #[serde(deserialize_with = "decode_input::size")]
    pub size: u64,
    /// SHA-256 of the content, 64 lower-case hex digits; the staged bytes must match it.
    #[serde(deserialize_with = "decode_input::sha256")]
    pub sha256: String,
}

/// Sandbox sizes. Defaults (worker config `[skus]`): S = 1 core / 2 GiB, M = 2 / 4, L = 4 / 8,
/// XL = 8 / 16 (the product brief).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Sku {
    /// 1 core, 2 GiB.
    S,
    /// 2 cores, 4 GiB.
    M,
    /// 4 cores, 8 GiB.
    L,
    /// 8 cores, 16 GiB.
    XL,
}

impl Sku {
    /// Every SKU, smallest first.
    pub const ALL: [Sku; 4] = [Sku::S, Sku::M, Sku::L, Sku::XL];

    /// The wire name: `"S"`, `"M"`, `"L"`, `"XL"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Sku::S => "S",
            Sku::M => "M",
            Sku::L => "L",
            Sku::XL => "XL",
        }
    }
}

impl fmt::Display for Sku {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Sku {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_uppercase().as_str() {
            "S" => Ok(Sku::S),
            "M" => Ok(Sku::M),
            "L" => Ok(Sku::L),
            "XL" => Ok(Sku::XL),
            _ => Err(format!("unknown SKU {s:?}: expected one of S, M, L, XL")),
        }
    }
}

/// Language runtime of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Runtime {
    /// CPython 3.11+ (the image has 3.13) with the data-science libraries; `python3 main.py`.
    Python,
    /// Node.js 20+; `node main.js`.
    Node,
}

impl Runtime {
    /// The wire name: `"python"` or `"node"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Runtime::Python => "python",
            Runtime::Node => "node",
        }
    }

    /// File name the source code gets inside the sandbox (`main.py`, `main.js`).
    pub fn main_file(self) -> &'static str {
        match self {
            Runtime::Python => "main.py",
            Runtime::Node => "main.js",
        }
    }
}

/// Network of the sandbox.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NetworkMode {
    /// Own network namespace with loopback only (default).
    #[default]
    None,
    /// Outbound connections allowed (through NAT), nothing inbound, no private or link-local
    /// destination, not the worker's host. A worker with `outbound_network = false` rejects it.
    Outbound,
}

/// Decoders of [`JobSpec`]'s fields (see [`crate::de`]): one `deserialize_with` function per field.
pub mod decode {
    use std::collections::BTreeMap;

    use serde::Deserializer;

    use crate::de::{args_list, bytes, env_map, fields, inputs_list, int, nil_default, opt_int, plain};
    use crate::{Compat, Dialect, InputFile, NetworkMode, RunMode, Runtime, Sku};

    fields! {
        schema_version => "schema_version": u32 = int;
        job_id => "job_id": String = plain;
        sku => "sku": Sku = plain;
        runtime => "runtime": Runtime = plain;
        code => "code": Option<String> = plain;
        entrypoint => "entrypoint": Option<String> = plain;
        args => "args": Vec<String> = args_list;
        inputs => "inputs": Vec<InputFile> = inputs_list;
        stdin => "stdin": Option<Vec<u8>> = bytes;
        env => "env": BTreeMap<String, String> = env_map;
        timeout => "timeout": Option<String> = plain;
        result_ttl => "result_ttl": Option<String> = plain;
        network => "network": NetworkMode = nil_default;
        submitted_at_ms => "submitted_at_ms": Option<u64> = opt_int;
        deadline_ms => "deadline_ms": Option<u64> = opt_int;
        mode => "mode": Option<RunMode> = plain;
        session => "session": Option<String> = plain;
        compat => "compat": Option<Compat> = plain;
        context => "context": Option<String> = plain;
        dialect => "dialect": Option<Dialect> = plain;
    }
}

/// Decoders of [`InputFile`]'s fields (named `inputs[].<field>` in errors).
pub mod decode_input {
    use serde::Deserializer;

    use crate::de::{fields, int, plain};

    fields! {
        key => "inputs[].key": String = plain;
        path => "inputs[].path": String = plain;
        size => "inputs[].size": u64 = int;
        sha256 => "inputs[].sha256": String = plain;
    }
}
