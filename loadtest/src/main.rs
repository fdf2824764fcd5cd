//! `sandq-loadtest`: load runs against real sandq workers.
//!
//! `sandq-loadtest throughput ...` (module [`throughput`]): N jobs of one program at a fixed rate
//! or concurrency; jobs/s, latency percentiles, a report directory with PNG plots.
//!
//! `sandq-loadtest live ...` (module [`live`]): live events' latency, Redis memory and cost.
//!
//! `sandq-loadtest gateway ...` (module [`gateway`]): the HTTP gateway's overhead and memory.
//!
//! `sandq-loadtest [--jobs ...]` (no subcommand), the chaos run: many jobs through several real
//! workers while workers are SIGKILLed and restarted, RabbitMQ is restarted and Redis is
//! restarted; then every job is accounted for. With `--resubmit N`, also 2N jobs through a
//! gateway of the run, each submitted again once over (kept, or its result expired): none may run
//! or be counted again (module [`resubmit`]).
//!
//! The run uses a namespace of its own and a Redis of its own (`redis-server` on
//! `--redis-port`, append-only file fsynced always, so that a restart keeps results, as a
//! production Redis must), and the RabbitMQ and S3 of the config (`SANDQ_CONFIG`); the broker
//! restarted is the node `rabbitmqctl` targets (`RABBITMQ_NODENAME` when set, as in CI's own
//! instance). Everything it talks to is on 127.0.0.1. Report: submitted, each terminal status,
//! dead-lettered, lost (must be 0), how many jobs ran more than once, and the re-submissions'
//! findings (each must be 0).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use sandq_client::Client;
use sandq_core::config::{self, ServiceConfig};
use sandq_core::time::now_ms;
use sandq_schemas::names::Names;
use sandq_schemas::{JobSpec, JobStatus, Runtime, Sku};

mod gateway;
mod live;
mod mcp;
mod plot;
mod report;
mod resubmit;
mod throughput;

/// Load runs against real sandq workers: the chaos run (no subcommand) or a throughput run.
#[derive(Debug, Parser)]
#[command(version, about, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Mode>,
    #[command(flatten)]
    chaos: Args,
}

#[derive(Debug, Subcommand)]
enum Mode {
    /// N jobs of one program at a fixed rate or concurrency: jobs/s, latency percentiles
    /// (submitted -> finished, queue wait, run), a report directory with PNG plots.
    Throughput(throughput::ThroughputArgs),
    /// Live events: write -> read latency (p50, p99, the worker's share), Redis memory per
    /// running job, the cost of streaming on a flood of lines (against workers that do not
    /// stream). scripts/bench-live.sh starts the workers.
    Live(live::LiveArgs),
    /// The HTTP gateway: its overhead on a submission and a read against the direct client,
    /// reads per second, memory with idle event streams. scripts/bench-gateway.sh starts it.
    Gateway(gateway::GatewayArgs),
    /// The MCP server: a trivial `run_code` through `/mcp` against the same job through REST,
    /// and `get_job` against `GET /v1/jobs/{id}`. scripts/bench-mcp.sh starts the gateway and
    /// a worker.
    Mcp(mcp::McpArgs),
}

/// Chaos run against real sandq workers.
#[derive(Debug, clap::Args)]
struct Args {
    /// Jobs to submit.
    #[arg(long, default_value_t = 500)]
    jobs: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Submission rate, jobs per second.
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    /// SIGKILL one worker (round robin) this often, then restart it; 0s: never.
    #[arg(long, default_value = "4s")]
    kill_every: humantime::Duration,
    /// Restart RabbitMQ (stop_app/start_app) this long after the start; 0s: never.
    #[arg(long, default_value = "10s")]
    broker_restart_at: humantime::Duration,
    /// Restart the run's Redis this long after the start; 0s: never.
    #[arg(long, default_value = "18s")]
    redis_restart_at: humantime::Duration,
    /// Port of the run's own Redis (127.0.0.1).
    #[arg(long, env = "SANDQ_CHAOS_REDIS_PORT", default_value_t = 6390)]
    redis_port: u16,
    /// Give up waiting for results after this long.
    #[arg(long, default_value = "10m")]
    timeout: humantime::Duration,
    /// Directory of sandq-worker; default: next to this binary.
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Also submit this many jobs whose result is kept, and as many whose result expires after
    /// 1 s, through a gateway of the run while the faults happen; once over, submit each again
    /// (module `resubmit`): none may run or be counted again. 0: no gateway.
    #[arg(long, default_value_t = 0)]
    resubmit: usize,
}

/// The outcome of a run.
#[derive(Debug, Default, serde::Serialize)]
struct Report {
    submitted: usize,
    statuses: BTreeMap<String, usize>,
    succeeded: usize,
    wrong_output: usize,
    dead_lettered: usize,
    lost: usize,
    ran_more_than_once: usize,
    worker_kills: usize,
    broker_restarts: usize,
    redis_restarts: usize,
    seconds: f64,
    /// The jobs that did not succeed: `<job id> <status> attempt <n>: <reason>`.
    failures: Vec<String>,
    /// The re-submissions of finished and expired jobs through the gateway (`--resubmit`).
    #[serde(skip_serializing_if = "Option::is_none")]
    resubmitted: Option<resubmit::Resubmitted>,
}

struct OwnRedis {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl OwnRedis {
    fn start(port: u16) -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!("sandq-chaos-redis-{port}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let mut redis = OwnRedis { port, dir, child: None };
        redis.spawn()?;
        Ok(redis)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string(), "--appendonly", "yes"])
            .args(["--appendfsync", "always", "--save", "", "--dir"])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .spawn()
            .context("redis-server")?;
        self.child = Some(child);
        for _ in 0..100 {
            if Command::new("redis-cli").args(["-p", &self.port.to_string(), "ping"]).output().is_ok_and(|o| o.stdout.starts_with(b"PONG"))
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("redis-server on port {} did not start", self.port)
    }

    fn restart(&mut self) -> anyhow::Result<()> {
        let _ = Command::new("redis-cli").args(["-p", &self.port.to_string(), "shutdown"]).output();
        if let Some(mut child) = self.child.take() {
            child.wait()?;
        }
        std::thread::sleep(Duration::from_secs(1));
        self.spawn()
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        let _ = Command::new("redis-cli").args(["-p", &self.port.to_string(), "shutdown", "nosave"]).output();
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn spawn_worker(bin_dir: &std::path::Path, config: &ServiceConfig, id: &str) -> anyhow::Result<Child> {
    // Appended to: a worker restarted under the same id keeps its earlier runs' lines.
    let log = std::fs::OpenOptions::new().create(true).append(true).open(std::env::temp_dir().join(format!("{id}.log")))?;
    Command::new(bin_dir.join("sandq-worker"))
        .arg("--exit-on-stdin-eof")
        .env("SANDQ__NAMESPACE", &config.namespace)
        .env("SANDQ__REDIS__URL", &config.redis.url)
        .env("SANDQ__WORKER__ID", id)
        .env("SANDQ__WORKER__SHUTDOWN_GRACE", "5s")
        // Several workers on one host: each its own (unused) metrics port.
        .env("SANDQ__WORKER__METRICS_ADDR", "127.0.0.1:0")
        // Declared capacity above a small machine's, so that every SKU is served.
        .env("SANDQ__WORKER__CAPACITY_CPUS", "16")
        .env("SANDQ__WORKER__CAPACITY_MEMORY_BYTES", (64u64 << 30).to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("sandq-worker")
}

/// Runs `rabbitmqctl` on the node of `RABBITMQ_NODENAME` when set, else the default node.
fn rabbitmqctl(args: &[&str]) -> anyhow::Result<()> {
    let status = Command::new("rabbitmqctl").args(args).stdout(Stdio::null()).status()?;
    anyhow::ensure!(status.success(), "rabbitmqctl {args:?}: {status}");
    Ok(())
}

fn job(n: usize, namespace: &str) -> JobSpec {
    let sku = Sku::ALL[n % Sku::ALL.len()];
    let code = format!("import time\ntime.sleep({:.2})\nprint('job {n}')\n", 0.1 + (n % 7) as f64 * 0.1);
    let mut spec = JobSpec::new(format!("{namespace}-{n}"), sku, Runtime::Python, code);
    spec.timeout = Some("60s".into());
    spec.result_ttl = Some("1h".into());
    spec.submitted_at_ms = Some(now_ms());
    spec
}

async fn dead_letter_count(config: &ServiceConfig) -> anyhow::Result<usize> {
    let connection = sandq_core::broker::connect(&config.amqp.addresses(), 0, &lapin::ConnectionProperties::default()).await?.0;
    let channel = connection.create_channel().await?;
    Ok(sandq_core::topology::dead_letter_count(&channel, &Names::new(config.namespace.clone())).await? as usize)
}

async fn delete_queues(config: &ServiceConfig) {
    let Ok((connection, _)) = sandq_core::broker::connect(&config.amqp.addresses(), 0, &lapin::ConnectionProperties::default()).await
    else {
        return;
    };
    let Ok(channel) = connection.create_channel().await else { return };
    let _ = sandq_core::topology::delete_queues(&channel, &Names::new(config.namespace.clone())).await;
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "error".into()))
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Some(Mode::Throughput(args)) => throughput::run(args).await,
        Some(Mode::Live(args)) => live::run(args).await,
        Some(Mode::Gateway(args)) => gateway::run(args).await,
        Some(Mode::Mcp(args)) => mcp::run(args).await,
        None => chaos(cli.chaos).await,
    }
}

async fn chaos(args: Args) -> anyhow::Result<()> {
    let bin_dir = match &args.bin_dir {
        Some(dir) => dir.clone(),
        None => std::env::current_exe()?.parent().context("binary dir")?.to_path_buf(),
    };
    let mut redis = OwnRedis::start(args.redis_port)?;
    let mut config: ServiceConfig = config::load(&config::config_path(None))?;
    config.namespace = format!("sandq-chaos-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    config.redis.url = format!("redis://127.0.0.1:{}/", args.redis_port);
    let started = Instant::now();
    let mut workers: Vec<(String, Child)> = Vec::new();
    for i in 0..args.workers {
        let id = format!("{}-w{i}", config.namespace);
        workers.push((id.clone(), spawn_worker(&bin_dir, &config, &id)?));
    }
    let mut client = Client::connect(config.clone()).await?;
    let mut report = Report::default();
    // The gateway's jobs go first, so that they run while the faults happen.
    let mut resubmitted = resubmit::Resubmitted::default();
    let gateway = match args.resubmit {
        0 => None,
        n => {
            let gateway = resubmit::Gateway::start(&bin_dir, &config).await?;
            let ids = resubmit::submit(&gateway, &config, n, &mut resubmitted).await?;
            Some((gateway, ids))
        }
    };
    let mut next_kill = Duration::from(args.kill_every);
    let broker_at = Duration::from(args.broker_restart_at);
    let redis_at = Duration::from(args.redis_restart_at);
    let mut victim = 0;
    let interval = Duration::from_secs_f64(1.0 / args.rate.max(0.1));
    let mut ids = Vec::new();
    let deadline = started + Duration::from(args.timeout);
    // Submit at the given rate while the faults happen; then wait for every job.
    let mut pending: Vec<String> = Vec::new();
    let mut n = 0;
    loop {
        let elapsed = started.elapsed();
        if n < args.jobs {
            let spec = job(n, &config.namespace);
            loop {
                match client.submit(&spec).await {
                    Ok(()) => break,
                    Err(e) => {
                        eprintln!("submit {} failed ({e}); retrying", spec.job_id);
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        if let Ok(fresh) = Client::connect(config.clone()).await {
                            client = fresh;
                        }
                    }
                }
            }
            ids.push(spec.job_id.clone());
            pending.push(spec.job_id);
            n += 1;
            report.submitted = n;
        }
        if !next_kill.is_zero() && elapsed >= next_kill && n < args.jobs {
            let (id, child) = &mut workers[victim % args.workers.max(1)];
            let _ = Command::new("kill").args(["-KILL", &child.id().to_string()]).status();
            let _ = child.wait();
            *child = spawn_worker(&bin_dir, &config, id)?;
            report.worker_kills += 1;
            victim += 1;
            next_kill += Duration::from(args.kill_every);
        }
        if !broker_at.is_zero() && report.broker_restarts == 0 && elapsed >= broker_at {
            rabbitmqctl(&["stop_app"])?;
            tokio::time::sleep(Duration::from_secs(2)).await;
            rabbitmqctl(&["start_app"])?;
            rabbitmqctl(&["await_startup"])?;
            report.broker_restarts += 1;
        }
        if !redis_at.is_zero() && report.redis_restarts == 0 && elapsed >= redis_at {
            redis.restart()?;
            report.redis_restarts += 1;
        }
        if n >= args.jobs {
            let mut still = Vec::new();
            for id in pending {
                match client.status(&id).await {
                    Ok(Some(r)) if r.status.is_terminal() => {}
                    _ => still.push(id),
                }
            }
            pending = still;
            let faults_done = (broker_at.is_zero() || report.broker_restarts > 0) && (redis_at.is_zero() || report.redis_restarts > 0);
            if (pending.is_empty() && faults_done) || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        } else {
            tokio::time::sleep(interval).await;
        }
    }
    for id in &ids {
        match client.status(id).await? {
            Some(result) if result.status.is_terminal() => {
                *report.statuses.entry(result.status.to_string()).or_default() += 1;
                if result.attempt > 1 {
                    report.ran_more_than_once += 1;
                }
                if result.status != JobStatus::Succeeded {
                    let reason = result.reason.as_deref().unwrap_or("");
                    report.failures.push(format!("{id} {} attempt {}: {reason}", result.status, result.attempt));
                }
                if result.status == JobStatus::Succeeded {
                    report.succeeded += 1;
                    let n = id.rsplit('-').next().unwrap_or_default();
                    if result.stdout.text != format!("job {n}\n") {
                        report.wrong_output += 1;
                    }
                }
            }
            _ => report.lost += 1,
        }
    }
    if let Some((gateway, ids)) = &gateway {
        let logs = || {
            workers
                .iter()
                .map(|(id, _)| std::fs::read_to_string(std::env::temp_dir().join(format!("{id}.log"))).unwrap_or_default())
                .collect()
        };
        resubmit::resubmit(gateway, &config, ids, &logs, deadline, &mut resubmitted).await?;
        report.resubmitted = Some(resubmitted);
    }
    drop(gateway);
    report.dead_lettered = dead_letter_count(&config).await.unwrap_or(0);
    // A dead-lettered job without a result is accounted for, not lost.
    report.lost = report.lost.saturating_sub(report.dead_lettered);
    report.seconds = started.elapsed().as_secs_f64();
    for (_, child) in &mut workers {
        drop(child.stdin.take());
    }
    for (_, child) in &mut workers {
        let _ = child.wait();
    }
    delete_queues(&config).await;
    drop(redis);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "submitted {} | succeeded {} | statuses {:?} | dead-lettered {} | lost {} | ran more than once {} | wrong output {} | {} worker kills, {} broker restarts, {} redis restarts | {:.1} s",
            report.submitted,
            report.succeeded,
            report.statuses,
            report.dead_lettered,
            report.lost,
            report.ran_more_than_once,
            report.wrong_output,
            report.worker_kills,
            report.broker_restarts,
            report.redis_restarts,
            report.seconds
        );
        for failure in &report.failures {
            println!("  not succeeded: {failure}");
        }
        if let Some(r) = &report.resubmitted {
            println!("re-submitted {} through the gateway: {r:?}", r.jobs);
        }
    }
    let resubmissions_wrong = report.resubmitted.as_ref().is_some_and(|r| {
        r.not_accepted + r.wrong_answer + r.ran_again + r.in_flight_mismatch > 0 || r.miscounted != 0 || r.counted_by_resubmissions != 0
    });
    if report.lost > 0 || report.wrong_output > 0 || resubmissions_wrong {
        std::process::exit(1);
    }
    Ok(())
}
