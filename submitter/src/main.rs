//! `sandq`: run code in a sandq sandbox from the command line.
//!
//! ```text
//! sandq run [--sku M] [--upload FILE]... [--timeout 60s] (PROGRAM.py | -c CODE)
//! sandq submit ...        (same options; prints the job id and returns)
//! sandq status ID
//! sandq wait ID
//! sandq cancel ID
//! sandq session ls
//! sandq session rm NAME
//! sandq key create --tenant T | ls | revoke ID
//! sandq export ID... -o out.ipynb      (or --session NAME)
//! sandq mcp               (an MCP server on stdio, for assistants: needs --url and --api-key)
//! ```
//!
//! With `--url` (or `SANDQ_URL`) and `--api-key` (or `SANDQ_API_KEY`) every command but `key`
//! and `export` goes to a gateway over HTTP (docs/gateway.md) instead of to the broker, Redis
//! and S3 of the config file, which is then not read.

mod backend;
mod mcp;

use std::collections::BTreeMap;
use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use backend::Backend;
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use sandq_client::{Client, EventKind, HttpClient, Transcript};
use sandq_core::config::{self, ServiceConfig};
use sandq_core::time::now_ms;
use sandq_schemas::{JobResult, JobSpec, JobStatus, NetworkMode, Output, OutputType, RunMode, Runtime, Sku};

/// Run code in sandq sandboxes.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// Config file; default $SANDQ_CONFIG, else /etc/sandq/sandq.toml.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Print results as JSON (the JobResult, as in docs/protocol.md) instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// A sandq gateway's URL (https://...): talk to it over HTTP, with an API key, instead of
    /// to the broker, Redis and S3 of the config file (docs/gateway.md).
    #[arg(long, global = true, env = "SANDQ_URL", value_name = "URL")]
    url: Option<String>,
    /// The API key for --url (sq_..., from `sandq key create`).
    #[arg(long, global = true, env = "SANDQ_API_KEY", hide_env_values = true, value_name = "KEY")]
    api_key: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
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
enum SessionCommand {
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
enum KeyCommand {
    /// Create a key for a tenant and print it (the only time it is shown).
    Create {
        /// The tenant the key acts for: 1 to 23 of [a-z0-9]. Its jobs and sessions are its own.
        #[arg(long)]
        tenant: String,
        /// A label for people.
        #[arg(long, default_value = "")]
        name: String,
        /// Jobs in flight (queued or running) at most.
        #[arg(long, default_value_t = 10)]
        max_in_flight: u32,
        /// Jobs submitted per minute at most.
        #[arg(long, default_value_t = 60)]
        jobs_per_minute: u32,
        /// Largest SKU.
        #[arg(long, default_value = "M")]
        max_sku: Sku,
        /// Longest job timeout.
        #[arg(long, default_value = "5m")]
        max_timeout: humantime::Duration,
        /// Jobs may ask for outbound network.
        #[arg(long)]
        network: bool,
        /// Largest file uploaded in one request, bytes.
        #[arg(long, default_value_t = 100 << 20)]
        max_upload_bytes: u64,
        /// Sessions the tenant may have at once.
        #[arg(long, default_value_t = 100)]
        max_sessions: u32,
        /// A host jobs' `callback_url` may name (repeat for more; `*`: any).
        #[arg(long = "webhook-host")]
        webhook_hosts: Vec<String>,
    },
    /// List keys: id, tenant, name, quotas, created, revoked (never the key).
    Ls,
    /// Revoke a key: every request with it is refused from now on.
    Revoke {
        /// The key's id (the part after `sq_`, 12 characters).
        id: String,
    },
}

#[derive(Debug, Args)]
struct JobArgs {
    /// Sandbox size: S, M, L or XL.
    #[arg(long, default_value = "M")]
    sku: Sku,
    /// Runtime; default from the program's extension (.js: node), else python.
    #[arg(long, value_parser = ["python", "node"])]
    runtime: Option<String>,
    /// Upload FILE into /work (as its file name, or as PATH with FILE:PATH). Repeatable.
    #[arg(long = "upload", value_name = "FILE[:PATH]")]
    uploads: Vec<String>,
    /// Wall-clock limit of the program (humantime); default 60 s (through a gateway: the API
    /// key's longest when that is shorter).
    #[arg(long)]
    timeout: Option<String>,
    /// Feed this file to the program's stdin ("-" reads our stdin).
    #[arg(long)]
    stdin: Option<PathBuf>,
    /// Extra environment variable NAME=VALUE. Repeatable.
    #[arg(long = "env", value_name = "NAME=VALUE")]
    env: Vec<String>,
    /// Network of the sandbox: none (loopback only) or outbound (outbound connections, nothing
    /// inbound).
    #[arg(long, value_parser = ["none", "outbound"], default_value = "none")]
    network: String,
    /// Job id; default a random UUID.
    #[arg(long)]
    id: Option<String>,
    /// How the code runs: notebook (the default: like one notebook cell, the last expression's
    /// value comes back as a rich output, and for Python display(), tables and charts too; an
    /// uncaught error as the result's error; Node.js allows top-level await) or script (plain
    /// python3 main.py / node main.js).
    #[arg(long, value_parser = ["notebook", "script"])]
    mode: Option<String>,
    /// Session: files left in /work are saved and restored into the next job of the same
    /// session (expires after 30 min without jobs). Use an unguessable name.
    #[arg(long)]
    session: Option<String>,
    /// Artifacts go to OUT/<job id>/.
    #[arg(long, default_value = "sandq-out")]
    out: PathBuf,
    /// Give up waiting after this long.
    #[arg(long, default_value = "15m")]
    wait: humantime::Duration,
    /// Refuse to submit (exit 125) when no worker serves the SKU right now (its queue has no
    /// consumer); by default the CLI warns on stderr and submits (the job waits for a worker,
    /// or expires after `queues.unserved_ttl`).
    #[arg(long)]
    refuse_unserved: bool,
    /// Print the output only once the job has ended (by default `run` prints what the job
    /// prints and displays while it runs, from its live events; the summary comes at the end
    /// either way).
    #[arg(long)]
    no_stream: bool,
    /// Code to run instead of a program file.
    #[arg(short = 'c', long = "code", conflicts_with = "program")]
    code: Option<String>,
    /// Program file to run.
    program: Option<PathBuf>,
    /// Arguments for the program.
    #[arg(last = true)]
    args: Vec<String>,
}

/// Exit code when sandq itself (or the command line) failed, as `docker run` does.
const EXIT_SANDQ_FAILED: i32 = 125;

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            // --help and --version are not failures; a wrong command line is sandq's 125.
            let code = if matches!(e.kind(), clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion) {
                0
            } else {
                EXIT_SANDQ_FAILED
            };
            std::process::exit(code)
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    let code = tokio::runtime::Runtime::new()
        .map_err(anyhow::Error::from)
        .and_then(|runtime| runtime.block_on(async_main(cli)))
        .unwrap_or_else(|e| {
            eprintln!("sandq: {e:#}");
            EXIT_SANDQ_FAILED
        });
    std::process::exit(code)
}

/// `sandq key ...`: the key store in Redis only (no broker or S3 needed).
async fn keys(service: &ServiceConfig, command: KeyCommand, json: bool) -> anyhow::Result<i32> {
    use sandq_core::keys;
    let mut redis = sandq_core::redis_conn::connect(&service.redis).await.context("cannot connect to redis")?;
    let names = sandq_schemas::names::Names::new(service.namespace.clone());
    match command {
        KeyCommand::Create {
            tenant,
            name,
            max_in_flight,
            jobs_per_minute,
            max_sku,
            max_timeout,
            network,
            max_upload_bytes,
            max_sessions,
            webhook_hosts,
        } => {
            let webhook_hosts = webhook_hosts.into_iter().map(|h| h.to_ascii_lowercase()).collect();
            let max_timeout = max_timeout.into();
            let quotas = keys::Quotas {
                max_in_flight,
                jobs_per_minute,
                max_sku,
                max_timeout,
                network,
                max_upload_bytes,
                max_sessions,
                webhook_hosts,
            };
            let (record, key) = keys::create(&mut redis, &names, &tenant, &name, quotas).await?;
            if json {
                println!("{}", serde_json::json!({"key": key, "record": record}));
            } else {
                eprintln!("key {} for tenant {}: shown once, store it now", record.id, record.tenant);
                eprintln!("webhook signing secret: {}", record.webhook_secret);
                println!("{key}");
            }
        }
        KeyCommand::Ls => {
            let mut records = keys::list(&mut redis, &names).await?;
            for r in &mut records {
                r.webhook_secret.clear();
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&records)?);
                return Ok(0);
            }
            println!(
                "{:<12} {:<23} {:<20} {:>9} {:>7} {:>3} {:>9} {:>7}  STATE",
                "ID", "TENANT", "NAME", "IN FLIGHT", "PER MIN", "SKU", "TIMEOUT", "NETWORK"
            );
            for r in records {
                let q = &r.quotas;
                println!(
                    "{:<12} {:<23} {:<20} {:>9} {:>7} {:>3} {:>9} {:>7}  {}",
                    r.id,
                    r.tenant,
                    r.name.chars().take(20).collect::<String>(),
                    q.max_in_flight,
                    q.jobs_per_minute,
                    format!("{:?}", q.max_sku),
                    humantime::format_duration(q.max_timeout).to_string(),
                    q.network,
                    if r.revoked_at_ms.is_some() { "revoked" } else { "valid" }
                );
            }
        }
        KeyCommand::Revoke { id } => {
            let record = keys::revoke(&mut redis, &names, &id).await?;
            eprintln!("key {} of tenant {} is revoked", record.id, record.tenant);
        }
    }
    Ok(0)
}

/// What a command with no HTTP route does instead, for its refusal in URL mode.
fn direct_only(command: &Command) -> Option<&'static str> {
    match command {
        Command::Key { .. } => Some("`sandq key` writes the key store in Redis"),
        Command::Export { .. } => Some("`sandq export` reads the code this client recorded in Redis"),
        _ => None,
    }
}

async fn async_main(cli: Cli) -> anyhow::Result<i32> {
    if let Command::Mcp = cli.command {
        let (Some(url), Some(key)) = (cli.url.as_deref(), cli.api_key.as_deref().filter(|k| !k.trim().is_empty())) else {
            bail!("sandq mcp needs a gateway: give --url and --api-key (or set SANDQ_URL and SANDQ_API_KEY)");
        };
        mcp::serve(url, key).await?;
        return Ok(0);
    }
    // Directly: how long an unserved job waits before it expires (the warning says it).
    let mut unserved_ttl = Duration::ZERO;
    let mut backend = match &cli.url {
        Some(url) => {
            if let Some(what) = direct_only(&cli.command) {
                bail!("{what}: it has no HTTP equivalent; run it without --url (and SANDQ_URL), on a host with the deployment's config");
            }
            let key = cli.api_key.as_deref().filter(|k| !k.trim().is_empty()).context(
                "--url needs an API key: give --api-key or set SANDQ_API_KEY (`sandq key create` makes one, on the deployment's host)",
            )?;
            Backend::Http(HttpClient::new(url, key)?)
        }
        None => {
            let path = config::config_path(cli.config.as_deref());
            let service: ServiceConfig = config::load(&path)?;
            if let Command::Key { command } = cli.command {
                return keys(&service, command, cli.json).await;
            }
            unserved_ttl = service.queues.unserved_ttl;
            Backend::Direct(Box::new(Client::connect(service).await.context("cannot connect to sandq's services")?))
        }
    };
    match cli.command {
        Command::Submit(args) => {
            let spec = build_job(&backend, &args).await?;
            backend.submit(&spec, args.refuse_unserved, unserved_ttl).await?;
            println!("{}", spec.job_id);
            Ok(0)
        }
        Command::Run(args) => {
            let spec = build_job(&backend, &args).await?;
            backend.submit(&spec, args.refuse_unserved, unserved_ttl).await?;
            let live =
                if args.no_stream || cli.json { None } else { Some(stream_live(&mut backend, &spec.job_id, args.wait.into()).await) };
            finish(&mut backend, &spec.job_id, &args.out, args.wait.into(), cli.json, live.as_ref()).await
        }
        Command::Export { ids, session, output } => {
            let Backend::Direct(client) = &mut backend else { bail!("`sandq export` works on sandq's services directly") };
            export(client, ids, session.as_deref(), &output).await?;
            Ok(0)
        }
        Command::Wait { id, out, wait } => finish(&mut backend, &id, &out, wait.into(), cli.json, None).await,
        Command::Key { .. } => bail!("`sandq key` works on the key store directly"),
        Command::Mcp => bail!("`sandq mcp` is served before any backend is made"),
        Command::Session { command: SessionCommand::Ls } => {
            let client = match &mut backend {
                Backend::Direct(client) => client,
                Backend::Http(http) => return http_sessions(http, cli.json).await,
            };
            let sessions = client.sessions(1000).await?;
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&sessions)?);
                return Ok(0);
            }
            println!("{:<40} {:>6} {:>12} {:>12}  IN USE BY", "SESSION", "FILES", "BYTES", "EXPIRES IN");
            let now = now_ms();
            for s in sessions {
                let left = Duration::from_secs(s.expires_at_ms.saturating_sub(now) / 1000);
                println!(
                    "{:<40} {:>6} {:>12} {:>12}  {}",
                    s.name,
                    s.files.map_or("-".into(), |f| f.to_string()),
                    s.bytes.map_or("-".into(), |b| b.to_string()),
                    humantime::format_duration(left).to_string(),
                    s.in_use_by.unwrap_or_default()
                );
            }
            Ok(0)
        }
        Command::Session { command: SessionCommand::Rm { name, wait } } => {
            match &mut backend {
                Backend::Direct(client) => {
                    let deleted = client.remove_session(&name, wait.into()).await?;
                    eprintln!("session {name}: {deleted} objects deleted");
                }
                Backend::Http(http) => {
                    http.remove_session(&name, wait.into()).await.with_context(|| format!("cannot delete session {name}"))?;
                    eprintln!("session {name}: deleted");
                }
            }
            Ok(0)
        }
        Command::Cancel { id } => {
            if backend.cancel(&id).await? {
                eprintln!("cancellation of {id} requested");
                Ok(0)
            } else {
                eprintln!("job {id} is unknown or already finished");
                Ok(2)
            }
        }
        Command::Status { id } => {
            if let Err(e) = sandq_schemas::validate::check_job_id(&id) {
                bail!("{e}");
            }
            match backend.status(&id).await? {
                None => {
                    eprintln!("job {id} is unknown (never submitted, or its result expired)");
                    Ok(2)
                }
                Some(result) if cli.json => {
                    println!("{}", serde_json::to_string_pretty(&result)?);
                    Ok(0)
                }
                Some(result) if result.status.is_terminal() => {
                    print_result(&result, &[], &BTreeMap::new(), None)?;
                    Ok(0)
                }
                Some(result) => {
                    println!("{} {}", result.job_id, result.status);
                    Ok(0)
                }
            }
        }
    }
}

/// `sandq session ls` over HTTP: the tenant's sessions (`GET /v1/sessions`).
async fn http_sessions(http: &HttpClient, json: bool) -> anyhow::Result<i32> {
    let sessions = http.sessions().await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&sessions)?);
        return Ok(0);
    }
    println!("{:<40} {:>6} {:>12} {:>12}  CELLS", "SESSION", "FILES", "BYTES", "EXPIRES IN");
    let now = now_ms();
    for s in sessions {
        let left = s
            .expires_at_ms
            .map_or("-".into(), |at| humantime::format_duration(Duration::from_secs(at.saturating_sub(now) / 1000)).to_string());
        println!("{:<40} {:>6} {:>12} {:>12}  {}", s.name, s.files, s.bytes, left, s.execution_count);
    }
    Ok(0)
}

/// `sandq export`: reads each job's terminal result and recorded code, writes the notebook.
async fn export(client: &mut Client, ids: Vec<String>, session: Option<&str>, path: &Path) -> anyhow::Result<()> {
    let mut results = Vec::new();
    let ids = match session {
        Some(name) => {
            sandq_schemas::validate::check_session_name(name)?;
            client.session_jobs(name).await?
        }
        None => ids,
    };
    for id in &ids {
        sandq_schemas::validate::check_job_id(id).map_err(|e| anyhow::anyhow!("{e}"))?;
        if results.iter().any(|r: &JobResult| &r.job_id == id) {
            // A session's list names a job again when it was submitted again with its id.
            if session.is_some() {
                continue;
            }
            bail!("job {id} is listed twice");
        }
        match client.status(id).await? {
            Some(result) if result.status.is_terminal() => results.push(result),
            // A session's list may name jobs whose results expired or that never ran: skip them.
            Some(result) if session.is_some() => eprintln!("sandq: job {id} is {}; left out", result.status),
            None if session.is_some() => eprintln!("sandq: job {id} is unknown (expired?); left out"),
            Some(result) => bail!("job {id} is {}, not finished", result.status),
            None => bail!("job {id} is unknown (never submitted, or its result expired)"),
        }
    }
    if let Some(name) = session {
        // Cells in the order they ran, from the session's last fresh start.
        results.sort_by_key(|r| r.started_at_ms.unwrap_or(u64::MAX));
        if let Some(start) = results.iter().rposition(|r| r.session.as_ref().is_some_and(|s| s.fresh)) {
            results.drain(..start);
        }
        if results.is_empty() {
            bail!("no finished job of session {name} was submitted with this client (or their results expired)");
        }
    }
    let mut cells = Vec::new();
    let mut runtime = None;
    for result in &results {
        let source = client.job_source(&result.job_id).await?;
        if source.is_none() {
            eprintln!("sandq: the code of job {} was not recorded; its cell says so", result.job_id);
        }
        runtime = runtime.or(source.as_ref().map(|s| s.runtime));
        cells.push(sandq_client::notebook::cell(client, result, source.as_ref()).await?);
    }
    let notebook = sandq_client::notebook::notebook(cells, runtime.unwrap_or(Runtime::Python));
    let mut text = serde_json::to_string_pretty(&notebook)?;
    text.push('\n');
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("sandq: wrote {} cells to {}", results.len(), path.display());
    Ok(())
}

async fn build_job(backend: &Backend, args: &JobArgs) -> anyhow::Result<JobSpec> {
    let runtime = match (&args.runtime, &args.program) {
        (Some(r), _) if r == "node" => Runtime::Node,
        (Some(_), _) => Runtime::Python,
        (None, Some(p)) if p.extension().is_some_and(|e| e == "js" || e == "mjs") => Runtime::Node,
        _ => Runtime::Python,
    };
    let code = match (&args.code, &args.program) {
        (Some(code), _) => code.clone(),
        (None, Some(program)) => std::fs::read_to_string(program).with_context(|| format!("cannot read {}", program.display()))?,
        (None, None) => bail!("give a program file or -c CODE"),
    };
    let mut inputs = Vec::new();
    for upload in &args.uploads {
        let (local, sandbox_path) = match upload.split_once(':') {
            Some((l, p)) => (PathBuf::from(l), p.to_owned()),
            None => {
                let local = PathBuf::from(upload);
                let name = local.file_name().context("upload has no file name")?.to_string_lossy().into_owned();
                (local, name)
            }
        };
        inputs.push(backend.upload(&local, &sandbox_path).await.with_context(|| format!("cannot upload {}", local.display()))?);
    }
    let stdin = match &args.stdin {
        None => None,
        Some(p) if p == Path::new("-") => {
            let mut buf = Vec::new();
            std::io::stdin().read_to_end(&mut buf)?;
            Some(buf)
        }
        Some(p) => Some(std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?),
    };
    let mut env = BTreeMap::new();
    for pair in &args.env {
        let (k, v) = pair.split_once('=').context("--env takes NAME=VALUE")?;
        env.insert(k.to_owned(), v.to_owned());
    }
    let job_id = args.id.clone().unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let mut spec = JobSpec::new(job_id, args.sku, runtime, code);
    spec.args = args.args.clone();
    spec.inputs = inputs;
    spec.stdin = stdin;
    spec.env = env;
    spec.timeout = args.timeout.clone();
    spec.network = if args.network == "outbound" { NetworkMode::Outbound } else { NetworkMode::None };
    spec.submitted_at_ms = Some(now_ms());
    spec.mode = match args.mode.as_deref() {
        Some("script") => Some(RunMode::Script),
        Some(_) => Some(RunMode::Notebook),
        None => None,
    };
    spec.session = args.session.clone();
    Ok(spec)
}

/// Prints the job's live events as they come (docs/protocol.md "Live events"): stdout and
/// stderr text to ours, a line per display, a line when an attempt starts over. Returns what
/// was printed, so that the end prints only what the stream missed. Gives up after `wait`.
async fn stream_live(backend: &mut Backend, job_id: &str, wait: Duration) -> Transcript {
    let mut transcript = Transcript::default();
    let printing = async {
        let mut events = backend.events(job_id);
        while let Some(event) = futures::StreamExt::next(&mut events).await {
            let restarted = event.attempt > transcript.attempt() && transcript.attempt() > 0;
            transcript.push(&event);
            // Best effort, as the stream: a closed stdout does not stop the job's wait.
            let _ = match &event.kind {
                EventKind::Stdout(text) => std::io::stdout().write_all(text.as_bytes()).and_then(|()| std::io::stdout().flush()),
                EventKind::Stderr(text) => std::io::stderr().write_all(text.as_bytes()),
                EventKind::Display { index, output: Some(output) } => print_live_display(*index, output),
                EventKind::Attempt { .. } if restarted => {
                    writeln!(
                        std::io::stderr(),
                        "[sandq: attempt {} starts over; what attempt {} printed is not in the result]",
                        event.attempt,
                        event.attempt - 1
                    )
                }
                EventKind::Truncated { stream, limit } => {
                    writeln!(std::io::stderr(), "[sandq: live {stream} stopped at its cap ({limit}); the rest comes at the end]")
                }
                _ => Ok(()),
            };
        }
    };
    let _ = tokio::time::timeout(wait, printing).await;
    transcript
}

/// One line for a display shown live: its text, or what it is and where it is (an image's
/// URL or key).
fn print_live_display(index: u64, output: &Output) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    if output.output_type == OutputType::Error {
        return Ok(()); // the traceback comes on stderr
    }
    if let Some((mime, value)) = output.data.iter().find(|(m, v)| v.artifact.is_some() && (m.starts_with("image/") || m.contains("plotly")))
    {
        let artifact = value.artifact.as_ref().map(|a| a.url.clone().unwrap_or_else(|| a.key.clone())).unwrap_or_default();
        let size = output.image.map(|i| format!(" {}x{}", i.width, i.height)).unwrap_or_default();
        writeln!(out, "[display {index}: {mime}{size} {artifact}]")?;
    } else if let Some(text) = output.data.get("text/markdown").or_else(|| output.data.get("text/plain")).and_then(|v| v.text.as_ref()) {
        writeln!(out, "{}", text.trim_end())?;
    }
    out.flush()
}

async fn finish(
    backend: &mut Backend,
    job_id: &str,
    out: &Path,
    wait: Duration,
    json: bool,
    live: Option<&Transcript>,
) -> anyhow::Result<i32> {
    let progress = if std::io::stderr().is_terminal() && !json {
        let bar = ProgressBar::new_spinner();
        bar.set_style(ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")?);
        bar.enable_steady_tick(Duration::from_millis(100));
        Some(bar)
    } else {
        None
    };
    let result = backend
        .wait(job_id, wait, |status| {
            if let Some(bar) = &progress {
                bar.set_message(format!("job {job_id}: {}", status.map_or("unknown".to_owned(), |s| s.to_string())));
            }
        })
        .await;
    if let Some(bar) = &progress {
        bar.finish_and_clear();
    }
    let result = result?;
    let dir = out.join(job_id);
    let mut downloaded = Vec::new();
    // A failed download (a file of the job in the way, a full disk, content that does not
    // match its digest) is reported and makes the exit code 125 when the job itself succeeded,
    // but the result is printed whatever happens here.
    let mut download_failed = false;
    for artifact in &result.artifacts {
        match backend.download_artifact(job_id, artifact, &dir).await {
            Ok(path) => downloaded.push((artifact, path)),
            Err(e) => {
                download_failed = true;
                eprintln!("sandq: cannot download artifact {}: {e}", artifact.path);
            }
        }
    }
    let outputs_dir = dir.join("outputs");
    let mut saved_outputs = BTreeMap::new();
    for (index, output) in result.outputs.iter().enumerate() {
        match save_output(backend, output, index, &outputs_dir).await {
            Ok(Some(saved)) => {
                saved_outputs.insert(index, saved);
            }
            Ok(None) => {}
            Err(e) => eprintln!("sandq: cannot save output {index}: {e:#}"),
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        print_result(&result, &downloaded, &saved_outputs, live)?;
    }
    let code = exit_code(&result);
    Ok(if download_failed && code == 0 { EXIT_SANDQ_FAILED } else { code })
}

/// The CLI's exit code: the program's own when it exited, 137 when it was killed or ran out of
/// memory, 124 for a timeout (as `timeout(1)`), 125 for everything else (sandq failed, the job
/// was rejected, cancelled or expired).
fn exit_code(result: &JobResult) -> i32 {
    match result.status {
        JobStatus::Succeeded | JobStatus::Failed if result.exit_code.is_some() => result.exit_code.unwrap_or(1),
        JobStatus::Failed | JobStatus::OomKilled => 137,
        JobStatus::TimedOut => 124,
        _ => EXIT_SANDQ_FAILED,
    }
}

/// Saves the representation of a rich output a person wants as a file: an image, or the HTML
/// of a plotly figure, or any representation stored only in S3 (too large to inline). Returns
/// the local path.
async fn save_output(backend: &Backend, output: &Output, index: usize, dir: &Path) -> anyhow::Result<Option<PathBuf>> {
    let image = output.data.iter().find(|(mime, _)| mime.starts_with("image/"));
    let plotly_html = output.data.contains_key("application/vnd.plotly.v1+json").then(|| output.data.get("text/html")).flatten();
    let chosen = image.map(|(_, v)| v).or(plotly_html).or_else(|| {
        let shown = output.data.get("text/markdown").or_else(|| output.data.get("text/plain"));
        shown.filter(|v| v.text.is_none())
    });
    let Some(value) = chosen else { return Ok(None) };
    if let Some(artifact) = &value.artifact {
        return Ok(Some(backend.download_output(artifact, dir).await?));
    }
    let Some(text) = &value.text else { return Ok(None) };
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("output-{index}.html"));
    std::fs::write(&path, text)?;
    Ok(Some(path))
}

/// Prints rich outputs for a person: tables as markdown tables, text as text, files for the
/// rest (images, figures), each with where it was saved.
fn print_outputs(result: &JobResult, saved: &BTreeMap<usize, PathBuf>, out: &mut impl Write) -> std::io::Result<()> {
    for (index, output) in result.outputs.iter().enumerate() {
        if output.output_type == OutputType::Error {
            continue; // its traceback is on stderr already
        }
        let label = if output.output_type == OutputType::ExecuteResult { "result" } else { "display" };
        if let Some(path) = saved.get(&index) {
            let what = output.data.keys().find(|m| m.starts_with("image/") || m.contains("plotly")).cloned().unwrap_or_default();
            let size = output.image.map(|i| format!(" {}x{}", i.width, i.height)).unwrap_or_default();
            writeln!(out, "[{label} {index}: {what}{size} saved to {}]", path.display())?;
            continue;
        }
        let text = output
            .data
            .get("text/markdown")
            .and_then(|v| v.text.as_ref())
            .or_else(|| output.data.get("text/plain").and_then(|v| v.text.as_ref()));
        if let Some(text) = text {
            writeln!(out, "{}", text.trim_end())?;
        }
        if let Some(table) = output.table {
            writeln!(out, "[{label} {index}: table, {} rows x {} columns]", table.rows, table.columns)?;
        }
    }
    if result.outputs_dropped > 0 {
        writeln!(out, "[sandq: {} outputs dropped over the caps]", result.outputs_dropped)?;
    }
    Ok(())
}

/// What of the stored `text` was not printed live: the part after `streamed` when it starts
/// with it (the stream may also hold more than the result's inline text); all of it when the
/// stream went another way (a gap, another attempt).
fn not_yet_printed<'a>(text: &'a str, streamed: &str) -> &'a str {
    if let Some(rest) = text.strip_prefix(streamed) {
        rest
    } else if streamed.starts_with(text) {
        ""
    } else {
        text
    }
}

/// Where the displays shown live were saved.
fn print_saved(result: &JobResult, saved: &BTreeMap<usize, PathBuf>, out: &mut impl Write) -> std::io::Result<()> {
    for (index, path) in saved {
        let label =
            if result.outputs.get(*index).is_some_and(|o| o.output_type == OutputType::ExecuteResult) { "result" } else { "display" };
        writeln!(out, "[{label} {index} saved to {}]", path.display())?;
    }
    Ok(())
}

fn print_result(
    result: &JobResult,
    downloaded: &[(&sandq_schemas::Artifact, PathBuf)],
    saved_outputs: &BTreeMap<usize, PathBuf>,
    live: Option<&Transcript>,
) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    let mut stderr = std::io::stderr().lock();
    let (streamed_out, streamed_err) = live.map_or(("", ""), |t| (t.stdout.as_str(), t.stderr.as_str()));
    let rest_out = not_yet_printed(&result.stdout.text, streamed_out);
    let rest_err = not_yet_printed(&result.stderr.text, streamed_err);
    if live.is_some() && (rest_out.len() < result.stdout.text.len() || rest_err.len() < result.stderr.text.len()) {
        // Some was printed live: only the rest follows.
    } else if live.is_some_and(|t| !t.stdout.is_empty() || !t.stderr.is_empty()) {
        writeln!(stderr, "[sandq: the live output differs from the stored one, which follows]")?;
    }
    stdout.write_all(rest_out.as_bytes())?;
    if live.is_none_or(|t| t.displays.is_empty()) {
        print_outputs(result, saved_outputs, &mut stdout)?;
    } else {
        print_saved(result, saved_outputs, &mut stdout)?;
    }
    stdout.flush()?;
    stderr.write_all(rest_err.as_bytes())?;
    if result.stdout.truncated {
        writeln!(stderr, "[sandq: stdout truncated: {} bytes in all]", result.stdout.total_bytes)?;
    }
    if result.stderr.truncated {
        writeln!(stderr, "[sandq: stderr truncated: {} bytes in all]", result.stderr.total_bytes)?;
    }
    writeln!(stderr, "--- sandq: job {} {}", result.job_id, result.status)?;
    if let Some(reason) = &result.reason {
        writeln!(stderr, "    reason: {reason}")?;
    }
    if let Some(code) = result.exit_code {
        writeln!(stderr, "    exit code: {code}")?;
    }
    if let Some(signal) = &result.signal {
        writeln!(stderr, "    signal: {signal}")?;
    }
    if let Some(usage) = &result.usage {
        writeln!(
            stderr,
            "    wall {} ms, cpu {} ms, peak memory {:.1} MiB",
            usage.wall_ms,
            usage.cpu_ms,
            usage.peak_memory_bytes as f64 / (1 << 20) as f64
        )?;
    }
    if let (Some(q), Some(s), Some(f)) = (result.queued_at_ms, result.started_at_ms, result.finished_at_ms) {
        writeln!(
            stderr,
            "    queued -> started {} ms, started -> finished {} ms, submitted -> finished {} ms",
            s.saturating_sub(q),
            f.saturating_sub(s),
            f.saturating_sub(q)
        )?;
    }
    if let Some(error) = &result.error {
        writeln!(stderr, "    error: {}: {}", error.name, error.value)?;
    }
    for artifact in &result.artifacts {
        match downloaded.iter().find(|(a, _)| a.key == artifact.key) {
            Some((_, path)) => writeln!(
                stderr,
                "    artifact {} ({}, {} bytes) -> {}",
                artifact.path,
                artifact.content_type,
                artifact.size,
                path.display()
            )?,
            None => writeln!(
                stderr,
                "    artifact {} ({}, {} bytes) at {}",
                artifact.path,
                artifact.content_type,
                artifact.size,
                artifact.url.as_deref().unwrap_or(&artifact.key)
            )?,
        }
    }
    if let Some(session) = &result.session {
        let state = if session.expired {
            " (fresh: the session had expired)"
        } else if session.fresh {
            " (fresh)"
        } else {
            ""
        };
        writeln!(
            stderr,
            "    session {}{state}: restored {}, saved {}, deleted {} files; now {} files, {} bytes",
            session.name, session.restored_files, session.saved_files, session.deleted_files, session.files, session.bytes
        )?;
    }
    for skipped in &result.skipped_artifacts {
        writeln!(stderr, "    skipped {} ({})", skipped.path, skipped.reason)?;
    }
    let unlisted = result.skipped_artifacts_total.saturating_sub(result.skipped_artifacts.len() as u64);
    if unlisted > 0 {
        writeln!(stderr, "    ... and {unlisted} more files skipped")?;
    }
    Ok(())
}
