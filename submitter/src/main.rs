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

mod args;
mod export;
mod keys;
mod mcp;
mod render;
mod run;
mod sessions;
mod status;

use std::io::IsTerminal;

use anyhow::bail;
use args::{Cli, Command, SessionCommand};
use clap::Parser;
use render::EXIT_SANDQ_FAILED;
use sandq_client::{Backend, BackendError, Target};

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

/// Picks the backend and runs the command; its exit code.
async fn async_main(cli: Cli) -> anyhow::Result<i32> {
    if let Command::Mcp = cli.command {
        let (Some(url), Some(key)) = (cli.url.as_deref(), cli.api_key.as_deref().filter(|k| !k.trim().is_empty())) else {
            bail!("sandq mcp needs a gateway: give --url and --api-key (or set SANDQ_URL and SANDQ_API_KEY)");
        };
        mcp::serve(url, key).await?;
        return Ok(0);
    }
    if cli.url.is_some() {
        if let Some(what) = cli.command.direct_only() {
            bail!("{what}: it has no HTTP equivalent; run it without --url (and SANDQ_URL), on a host with the deployment's config");
        }
    }
    let target = match Target::choose(cli.url.as_deref(), cli.api_key.as_deref(), cli.config.as_deref()) {
        Err(BackendError::MissingApiKey) => {
            bail!("--url needs an API key: give --api-key or set SANDQ_API_KEY (`sandq key create` makes one, on the deployment's host)")
        }
        target => target?,
    };
    if let Command::Key { command } = cli.command {
        let Target::Services(service) = target else { bail!("`sandq key` works on the key store directly") };
        return keys::run(&service, command, cli.json).await;
    }
    let backend = &mut Backend::connect(target).await?;
    match cli.command {
        Command::Submit(args) => run::submit(backend, &args).await,
        Command::Run(args) => run::run(backend, &args, cli.json).await,
        Command::Wait { id, out, wait } => run::finish(backend, &id, &out, wait.into(), cli.json, None).await,
        Command::Status { id } => status::status(backend, &id, cli.json).await,
        Command::Cancel { id } => status::cancel(backend, &id).await,
        Command::Session { command: SessionCommand::Ls } => sessions::list(backend, cli.json).await,
        Command::Session { command: SessionCommand::Rm { name, wait } } => sessions::remove(backend, &name, wait.into()).await,
        Command::Export { ids, session, output } => {
            let Backend::Direct { client, .. } = backend else { bail!("`sandq export` works on sandq's services directly") };
            export::export(client, ids, session.as_deref(), &output).await?;
            Ok(0)
        }
        Command::Key { .. } => bail!("`sandq key` works on the key store directly"),
        Command::Mcp => bail!("`sandq mcp` is served before any backend is made"),
    }
}
