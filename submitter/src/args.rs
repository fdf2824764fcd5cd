//! The command line of `sandq`: clap's types, and what each command needs of it.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use sandq_schemas::Sku;

/// Run code in sandq sandboxes.
#[derive(Debug, Parser)]
#[command(version, about)]
pub(crate) struct Cli {
    /// Config file; default $SANDQ_CONFIG, else /etc/sandq/sandq.toml.
    #[arg(long, global = true)]
    pub(crate) config: Option<PathBuf>,
    /// Print results as JSON (the JobResult, as in docs/protocol.md) instead of text.
    #[arg(long, global = true)]
    pub(crate) json: bool,
    /// A sandq gateway's URL (https://...): talk to it over HTTP, with an API key, instead of
    /// to the broker, Redis and S3 of the config file (docs/gateway.md).
    #[arg(long, global = true, env = "SANDQ_URL", value_name = "URL")]
    pub(crate) url: Option<String>,
    /// The API key for --url (sq_..., from `sandq key create`).
    #[arg(long, global = true, env = "SANDQ_API_KEY", hide_env_values = true, value_name = "KEY")]
    pub(crate) api_key: Option<String>,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Submit a job, wait for it, print its output, download its artifacts; exit with its exit
    /// code.
    Run(JobArgs),
    /// Serve MCP (the Model Context Protocol, docs/mcp.md) on stdin and stdout, for an AI
    /// assistant that starts sandq as a tool server; its tools call the gateway of --url with
    /// the key of --api-key.
    Mcp,
    /// Submit a job and print its id.
    Submit(JobArgs),
    /// Print a job's current status and result.
    Status {
        /// Job id.
        id: String,
    },
    /// Cancel a job: a queued job is skipped, a running one is killed within a second.
    Cancel {
        /// Job id.
        id: String,
    },
    /// List or remove sessions.
    Session {
        #[command(subcommand)]
        command: SessionCommand,
    },
    /// Create, list or revoke the HTTP gateway's API keys (docs/gateway.md).
    Key {
        #[command(subcommand)]
        command: KeyCommand,
    },
    /// Write finished jobs as a Jupyter notebook (nbformat 4.5): one code cell per job, in the
    /// order given, with its code (as recorded by this client at submission), execution count
    /// and outputs (streams, results, displays with images embedded, errors).
    Export {
        /// Job ids, in cell order.
        #[arg(required_unless_present = "session", conflicts_with = "session")]
        ids: Vec<String>,
        /// Every job of this session submitted with this client, in the order they started,
        /// from the last one that found the session fresh.
        #[arg(long)]
        session: Option<String>,
        /// The notebook file to write.
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
    },
    /// Wait for a job to finish, then print it like `run`.
    Wait {
        /// Job id.
        id: String,
        /// Artifacts go to OUT/<job id>/.
        #[arg(long, default_value = "sandq-out")]
        out: PathBuf,
        /// Give up waiting after this long.
        #[arg(long, default_value = "15m")]
        wait: humantime::Duration,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum SessionCommand {
    /// List sessions: name, files, bytes, expiry, the job using it.
    Ls,
    /// Delete a session's files now; the next job naming it starts fresh.
    Rm {
        /// Session name.
        name: String,
        /// Wait this long for a running job of the session to end.
        #[arg(long, default_value = "60s")]
        wait: humantime::Duration,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum KeyCommand {
    /// Create a key for a tenant and print it (the only time it is shown).
    Create(NewKey),
    /// List keys: id, tenant, name, quotas, created, revoked (never the key).
    Ls,
    /// Revoke a key: every request with it is refused from now on.
    Revoke {
        /// The key's id (the part after `sq_`, 12 characters).
        id: String,
    },
}

// `sandq key create`: the tenant, a label and the quotas of the new key.
#[derive(Debug, Args)]
pub(crate) struct NewKey {
    /// The tenant the key acts for: 1 to 23 of [a-z0-9]. Its jobs and sessions are its own.
    #[arg(long)]
    pub(crate) tenant: String,
    /// A label for people.
    #[arg(long, default_value = "")]
    pub(crate) name: String,
    /// Jobs in flight (queued or running) at most.
    #[arg(long, default_value_t = 10)]
    pub(crate) max_in_flight: u32,
    /// Jobs submitted per minute at most.
    #[arg(long, default_value_t = 60)]
    pub(crate) jobs_per_minute: u32,
    /// Largest SKU.
    #[arg(long, default_value = "M")]
    pub(crate) max_sku: Sku,
    /// Longest job timeout.
    #[arg(long, default_value = "5m")]
    pub(crate) max_timeout: humantime::Duration,
    /// Jobs may ask for outbound network.
    #[arg(long)]
    pub(crate) network: bool,
    /// Largest file uploaded in one request, bytes.
    #[arg(long, default_value_t = 100 << 20)]
    pub(crate) max_upload_bytes: u64,
    /// Sessions the tenant may have at once.
    #[arg(long, default_value_t = 100)]
    pub(crate) max_sessions: u32,
    /// A host jobs' `callback_url` may name (repeat for more; `*`: any).
    #[arg(long = "webhook-host")]
    pub(crate) webhook_hosts: Vec<String>,
}

#[derive(Debug, Args)]
pub(crate) struct JobArgs {
    /// Sandbox size: S, M, L or XL.
    #[arg(long, default_value = "M")]
    pub(crate) sku: Sku,
    /// Runtime; default from the program's extension (.js: node), else python.
    #[arg(long, value_parser = ["python", "node"])]
    pub(crate) runtime: Option<String>,
    /// Upload FILE into /work (as its file name, or as PATH with FILE:PATH). Repeatable.
    #[arg(long = "upload", value_name = "FILE[:PATH]")]
    pub(crate) uploads: Vec<String>,
    /// Wall-clock limit of the program (humantime); default 60 s (through a gateway: the API
    /// key's longest when that is shorter).
    #[arg(long)]
    pub(crate) timeout: Option<String>,
    /// Feed this file to the program's stdin ("-" reads our stdin).
    #[arg(long)]
    pub(crate) stdin: Option<PathBuf>,
    /// Extra environment variable NAME=VALUE. Repeatable.
    #[arg(long = "env", value_name = "NAME=VALUE")]
    pub(crate) env: Vec<String>,
    /// Network of the sandbox: none (loopback only) or outbound (outbound connections, nothing
    /// inbound).
    #[arg(long, value_parser = ["none", "outbound"], default_value = "none")]
    pub(crate) network: String,
    /// Job id; default a random UUID.
    #[arg(long)]
    pub(crate) id: Option<String>,
    /// How the code runs: notebook (the default: like one notebook cell, the last expression's
    /// value comes back as a rich output, and for Python display(), tables and charts too; an
    /// uncaught error as the result's error; Node.js allows top-level await) or script (plain
    /// python3 main.py / node main.js).
    #[arg(long, value_parser = ["notebook", "script"])]
    pub(crate) mode: Option<String>,
    /// Session: files left in /work are saved and restored into the next job of the same
    /// session (expires after 30 min without jobs). Use an unguessable name.
    #[arg(long)]
    pub(crate) session: Option<String>,
    /// Artifacts go to OUT/<job id>/.
    #[arg(long, default_value = "sandq-out")]
    pub(crate) out: PathBuf,
    /// Give up waiting after this long.
    #[arg(long, default_value = "15m")]
    pub(crate) wait: humantime::Duration,
    /// Refuse to submit (exit 125) when no worker serves the SKU right now (its queue has no
    /// consumer); by default the CLI warns on stderr and submits (the job waits for a worker,
    /// or expires after `queues.unserved_ttl`).
    #[arg(long)]
    pub(crate) refuse_unserved: bool,
    /// Print the output only once the job has ended (by default `run` prints what the job
    /// prints and displays while it runs, from its live events; the summary comes at the end
    /// either way).
    #[arg(long)]
    pub(crate) no_stream: bool,
    /// Code to run instead of a program file.
    #[arg(short = 'c', long = "code", conflicts_with = "program")]
    pub(crate) code: Option<String>,
    /// Program file to run.
    pub(crate) program: Option<PathBuf>,
    /// Arguments for the program.
    #[arg(last = true)]
    pub(crate) args: Vec<String>,
}

impl Command {
    /// What a command with no HTTP route does instead, for its refusal in URL mode.
    pub(crate) fn direct_only(&self) -> Option<&'static str> {
        match self {
            Command::Key { .. } => Some("`sandq key` writes the key store in Redis"),
            Command::Export { .. } => Some("`sandq export` reads the code this client recorded in Redis"),
            _ => None,
        }
    }
}
