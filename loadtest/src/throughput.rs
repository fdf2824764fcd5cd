//! `sandq-loadtest throughput`: N jobs of one program through real workers, at a fixed
//! submission rate or a fixed number of jobs in flight; jobs/s, latency percentiles, and a
//! report directory with the numbers and PNG plots.
//!
//! Latencies are the worker's own timestamps from each result (so the client's polling does
//! not blur them): submitted -> finished (`finished_at_ms - queued_at_ms`; `queued_at_ms` is
//! the `submitted_at_ms` this program sets just before publishing), queue wait
//! (`started_at_ms - queued_at_ms`) and run (`usage.wall_ms`, container start to exit).
//! Queue depth is the SKU queue's ready-message count from a passive `queue.declare`, sampled
//! during the run: messages a worker has taken (prefetched, waiting for capacity, or running)
//! are not in it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use sandq_client::Client;
use sandq_core::config::{self, ServiceConfig};
use sandq_core::time::now_ms;
use sandq_schemas::names::Names;
use sandq_schemas::{JobResult, JobSpec, RunMode, Runtime, Sku};

use crate::plot;
use crate::report::{Percentiles, Report};

/// Options of a throughput run.
#[derive(Debug, clap::Args)]
pub struct ThroughputArgs {
    /// Jobs to run.
    #[arg(long, default_value_t = 200)]
    jobs: usize,
    /// Submit at this fixed rate (jobs per second), whatever the backlog.
    #[arg(long, conflicts_with = "concurrency")]
    rate: Option<f64>,
    /// Keep this many jobs in flight (submit the next when one finishes); the default, 4,
    /// unless --rate is given.
    #[arg(long)]
    concurrency: Option<usize>,
    /// The program (Python) every job runs.
    #[arg(long, default_value = "pass")]
    code: String,
    /// How it runs: notebook (a notebook cell, the default) or script (plain python3 main.py).
    #[arg(long, value_parser = ["notebook", "script"], default_value = "notebook")]
    mode: String,
    /// SKU of every job.
    #[arg(long, default_value = "S")]
    sku: Sku,
    /// Worker processes to start (default settings: the machine's capacity; warm pool on);
    /// 0: use the workers already serving --namespace.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Extra setting NAME=VALUE for the started workers (`SANDQ__WARM__PER_SKU=0`). Repeatable.
    #[arg(long = "worker-env", value_name = "NAME=VALUE")]
    worker_env: Vec<String>,
    /// Namespace; default a fresh one (`sandq-tput-<random>`), its queues deleted at the end.
    #[arg(long)]
    namespace: Option<String>,
    /// Report directory (created; files in it are replaced).
    #[arg(long, default_value = "sandq-loadtest-report")]
    report: PathBuf,
    /// Sample the queue depth this often.
    #[arg(long, default_value = "250ms")]
    sample_every: humantime::Duration,
    /// Font for the plots' text (TrueType; Debian's fonts-dejavu-core).
    #[arg(long, default_value = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")]
    font: PathBuf,
    /// Give up waiting for results after this long.
    #[arg(long, default_value = "10m")]
    timeout: humantime::Duration,
    /// Directory of sandq-worker; default: next to this binary.
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// One job's timings, from its result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct JobTimes {
    /// The job.
    pub job_id: String,
    /// Its terminal status (or the last one seen).
    pub status: String,
    /// `queued_at_ms` (= submission), Unix ms.
    pub submitted_ms: u64,
    /// `started_at_ms`.
    pub started_ms: Option<u64>,
    /// `finished_at_ms`.
    pub finished_ms: Option<u64>,
    /// `usage.wall_ms`.
    pub run_ms: Option<u64>,
    /// Whether it was handed a warm sandbox.
    pub warm: Option<bool>,
}

fn times(result: &JobResult, submitted_ms: u64) -> JobTimes {
    JobTimes {
        job_id: result.job_id.clone(),
        status: result.status.to_string(),
        submitted_ms: result.queued_at_ms.unwrap_or(submitted_ms),
        started_ms: result.started_at_ms,
        finished_ms: result.finished_at_ms,
        run_ms: result.usage.as_ref().map(|u| u.wall_ms),
        warm: result.sandbox.as_ref().map(|s| s.warm),
    }
}

/// The worker's default `worker.userns_host_base` (`sandq_worker::settings::DEFAULT_USERNS_HOST_BASE`).
const USERNS_DEFAULT_BASE: u32 = 0x7000_0000;
/// Id ranges set aside per started worker: its consumer slots and warm sandboxes (10 with the
/// defaults on a 2-core machine), with room for more cores.
const USERNS_BLOCK: u32 = 64;

fn spawn_worker(bin_dir: &Path, config: &ServiceConfig, id: &str, env: &[(String, String)]) -> anyhow::Result<(Child, PathBuf)> {
    let log_path = std::env::temp_dir().join(format!("{id}.log"));
    let log = std::fs::File::create(&log_path)?;
    let mut command = Command::new(bin_dir.join("sandq-worker"));
    command
        .arg("--exit-on-stdin-eof")
        .env("SANDQ__NAMESPACE", &config.namespace)
        .env("SANDQ__WORKER__ID", id)
        // Several workers side by side: any free port for each one's metrics.
        .env("SANDQ__WORKER__METRICS_ADDR", "127.0.0.1:0")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(log);
    for (k, v) in env {
        command.env(k, v);
    }
    Ok((command.spawn().context("sandq-worker")?, log_path))
}

/// Removes what the run's workers, now exited, leave behind: their (empty) job and state dirs
/// and the resolver file beside the state dir (best effort; a non-empty dir stays).
fn remove_worker_dirs(namespace: &str, workers: usize) {
    let dir = |var: &str, default: &str| std::env::var_os(var).map_or_else(|| PathBuf::from(default), PathBuf::from);
    let (data, state) = (dir("SANDQ__WORKER__DATA_DIR", "/var/lib/sandq"), dir("SANDQ__WORKER__STATE_DIR", "/run/sandq"));
    for i in 0..workers {
        let id = format!("{namespace}-w{i}");
        let _ = std::fs::remove_dir(data.join(&id));
        let _ = std::fs::remove_dir(state.join(&id));
        let _ = std::fs::remove_file(state.join(format!("{id}.resolv.conf")));
    }
}

fn spec(args: &ThroughputArgs, namespace: &str, n: usize) -> JobSpec {
    let mut spec = JobSpec::new(format!("{namespace}-{n}"), args.sku, Runtime::Python, args.code.clone());
    spec.mode = Some(if args.mode == "script" { RunMode::Script } else { RunMode::Notebook });
    spec.timeout = Some("60s".into());
    spec.result_ttl = Some("1h".into());
    spec.submitted_at_ms = Some(now_ms());
    spec
}

/// Samples the queue depth every `every` until `stop`; (ms since `t0`, ready messages).
async fn sample_depth(
    config: ServiceConfig,
    sku: Sku,
    every: Duration,
    t0_ms: u64,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<Vec<(u64, u32)>> {
    let connection = sandq_core::broker::connect(&config.amqp.addresses(), 0, &lapin::ConnectionProperties::default()).await?.0;
    let channel = connection.create_channel().await?;
    let queue = Names::new(config.namespace.clone()).jobs_queue(sku);
    let mut samples = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let declared = channel
            .queue_declare(
                queue.as_str().into(),
                lapin::options::QueueDeclareOptions { passive: true, ..Default::default() },
                lapin::types::FieldTable::default(),
            )
            .await?;
        samples.push((now_ms().saturating_sub(t0_ms), declared.message_count()));
        tokio::time::sleep(every).await;
    }
    Ok(samples)
}

async fn run_concurrency(args: &ThroughputArgs, config: &ServiceConfig, lanes: usize, deadline: Instant) -> anyhow::Result<Vec<JobTimes>> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..lanes.max(1) {
        let mut client = Client::connect(config.clone()).await?;
        let next = next.clone();
        let (jobs, namespace) = (args.jobs, config.namespace.clone());
        let template = spec(args, &namespace, 0);
        tasks.push(tokio::spawn(async move {
            let mut done = Vec::new();
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= jobs {
                    break;
                }
                let mut spec = template.clone();
                spec.job_id = format!("{namespace}-{n}");
                spec.submitted_at_ms = Some(now_ms());
                let submitted = spec.submitted_at_ms.unwrap_or_default();
                client.submit(&spec).await?;
                let left = deadline.saturating_duration_since(Instant::now());
                match client.wait(&spec.job_id, left, Duration::from_secs(1), |_| {}).await {
                    Ok(result) => done.push(times(&result, submitted)),
                    Err(e) => {
                        eprintln!("job {}: {e}", spec.job_id);
                        done.push(JobTimes {
                            job_id: spec.job_id,
                            status: "unfinished".into(),
                            submitted_ms: submitted,
                            started_ms: None,
                            finished_ms: None,
                            run_ms: None,
                            warm: None,
                        });
                    }
                }
            }
            anyhow::Ok(done)
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await??);
    }
    Ok(all)
}

async fn run_rate(args: &ThroughputArgs, config: &ServiceConfig, rate: f64, deadline: Instant) -> anyhow::Result<Vec<JobTimes>> {
    let mut client = Client::connect(config.clone()).await?;
    let interval = Duration::from_secs_f64(1.0 / rate.max(0.01));
    let start = Instant::now();
    let mut submitted = Vec::new();
    for n in 0..args.jobs {
        tokio::time::sleep_until((start + interval.mul_f64(n as f64)).into()).await;
        let spec = spec(args, &config.namespace, n);
        client.submit(&spec).await?;
        submitted.push((spec.job_id, spec.submitted_at_ms.unwrap_or_default()));
    }
    let mut done: Vec<JobTimes> = Vec::new();
    let mut pending = submitted;
    while !pending.is_empty() && Instant::now() < deadline {
        let mut still = Vec::new();
        for (id, at) in pending {
            match client.status(&id).await? {
                Some(result) if result.status.is_terminal() => done.push(times(&result, at)),
                _ => still.push((id, at)),
            }
        }
        pending = still;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (id, at) in pending {
        done.push(JobTimes {
            job_id: id,
            status: "unfinished".into(),
            submitted_ms: at,
            started_ms: None,
            finished_ms: None,
            run_ms: None,
            warm: None,
        });
    }
    Ok(done)
}

/// Runs the throughput mode; the report is printed and written under `args.report`.
pub async fn run(args: ThroughputArgs) -> anyhow::Result<()> {
    if args.jobs == 0 {
        bail!("--jobs must be at least 1");
    }
    let font = std::fs::read(&args.font)
        .with_context(|| format!("cannot read the plot font {} (apt-get install fonts-dejavu-core, or --font)", args.font.display()))?;
    plot::register_font(font)?;
    let bin_dir = match &args.bin_dir {
        Some(dir) => dir.clone(),
        None => std::env::current_exe()?.parent().context("binary dir")?.to_path_buf(),
    };
    let mut config: ServiceConfig = config::load(&config::config_path(None))?;
    let own_namespace = args.namespace.is_none();
    config.namespace = args.namespace.clone().unwrap_or_else(|| format!("sandq-tput-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]));
    let mut env = Vec::new();
    for pair in &args.worker_env {
        let (k, v) = pair.split_once('=').context("--worker-env takes NAME=VALUE")?;
        env.push((k.to_owned(), v.to_owned()));
    }
    // The topology first (the client declares it), so that workers and the sampler find it.
    drop(Client::connect(config.clone()).await?);
    let mut workers = Vec::new();
    // Workers on one host need disjoint user namespace ranges (docs/threat-model.md): the n-th
    // gets the n-th block of USERNS_BLOCK ranges of 65,536 ids from the base (the setting's
    // value when given, else the worker's default), unless --worker-env sets one itself.
    let base_setting = "SANDQ__WORKER__USERNS_HOST_BASE";
    let base = match std::env::var(base_setting) {
        Ok(v) => v.parse::<u32>().with_context(|| format!("{base_setting}={v}"))?,
        Err(_) => USERNS_DEFAULT_BASE,
    };
    for i in 0..args.workers {
        let mut env = env.clone();
        if !env.iter().any(|(k, _)| k == base_setting) {
            let own = u32::try_from(i)
                .ok()
                .and_then(|i| i.checked_mul(USERNS_BLOCK * 65_536))
                .and_then(|o| base.checked_add(o))
                .context("too many workers for the id space")?;
            env.push((base_setting.to_owned(), own.to_string()));
        }
        workers.push(spawn_worker(&bin_dir, &config, &format!("{}-w{i}", config.namespace), &env)?);
    }
    let ready_by = Instant::now() + Duration::from_secs(60);
    for (_, log) in &workers {
        while !std::fs::read_to_string(log).unwrap_or_default().contains("consuming") {
            if Instant::now() > ready_by {
                bail!("worker did not start: {}", std::fs::read_to_string(log).unwrap_or_default());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // Let a started worker fill its warm pool, as an idle worker has.
    if args.workers > 0 {
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let t0_ms = now_ms();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn(sample_depth(config.clone(), args.sku, args.sample_every.into(), t0_ms, stop.clone()));
    let deadline = Instant::now() + Duration::from(args.timeout);
    let (load, jobs) = match args.rate {
        Some(rate) => (format!("rate {rate}/s"), run_rate(&args, &config, rate, deadline).await),
        None => {
            let lanes = args.concurrency.unwrap_or(4);
            (format!("concurrency {lanes}"), run_concurrency(&args, &config, lanes, deadline).await)
        }
    };
    stop.store(true, Ordering::Relaxed);
    let depth = sampler.await?.unwrap_or_else(|e| {
        eprintln!("queue depth sampling failed: {e:#}");
        Vec::new()
    });
    for (child, _) in &mut workers {
        drop(child.stdin.take());
    }
    for (child, _) in &mut workers {
        let _ = child.wait();
    }
    remove_worker_dirs(&config.namespace, args.workers);
    if own_namespace {
        if let Ok((connection, _)) = sandq_core::broker::connect(&config.amqp.addresses(), 0, &lapin::ConnectionProperties::default()).await
        {
            if let Ok(channel) = connection.create_channel().await {
                let _ = sandq_core::topology::delete_queues(&channel, &Names::new(config.namespace.clone())).await;
            }
        }
    }
    let mut jobs = jobs?;
    jobs.sort_by_key(|j| j.submitted_ms);
    let report = summarize(&args, load, &jobs, &depth);
    write_report(&args.report, &report, &jobs, &depth, t0_ms)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report, &args.report);
    }
    if report.unfinished > 0 {
        std::process::exit(1);
    }
    Ok(())
}

fn summarize(args: &ThroughputArgs, load: String, jobs: &[JobTimes], depth: &[(u64, u32)]) -> Report {
    let mut statuses = BTreeMap::new();
    for j in jobs.iter().filter(|j| j.status != "unfinished") {
        *statuses.entry(j.status.clone()).or_default() += 1;
    }
    let first = jobs.iter().map(|j| j.submitted_ms).min().unwrap_or(0);
    let last = jobs.iter().filter_map(|j| j.finished_ms).max().unwrap_or(first);
    let finished = jobs.iter().filter(|j| j.finished_ms.is_some()).count();
    let seconds = last.saturating_sub(first) as f64 / 1000.0;
    Report {
        load,
        jobs: jobs.len(),
        code: args.code.clone(),
        mode: args.mode.clone(),
        sku: args.sku.to_string(),
        workers: args.workers,
        build: if cfg!(debug_assertions) { "debug" } else { "release" },
        statuses,
        unfinished: jobs.iter().filter(|j| j.status == "unfinished").count(),
        seconds,
        jobs_per_second: if seconds > 0.0 { finished as f64 / seconds } else { 0.0 },
        submitted_to_finished_ms: Percentiles::of(
            jobs.iter().filter_map(|j| Some(j.finished_ms?.saturating_sub(j.submitted_ms))).collect(),
        ),
        queue_wait_ms: Percentiles::of(jobs.iter().filter_map(|j| Some(j.started_ms?.saturating_sub(j.submitted_ms))).collect()),
        run_ms: Percentiles::of(jobs.iter().filter_map(|j| j.run_ms).collect()),
        warm_starts: jobs.iter().filter(|j| j.warm == Some(true)).count(),
        max_queue_depth: depth.iter().map(|d| d.1).max().unwrap_or(0),
    }
}

fn write_report(dir: &Path, report: &Report, jobs: &[JobTimes], depth: &[(u64, u32)], t0_ms: u64) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    std::fs::write(dir.join("report.json"), serde_json::to_string_pretty(report)? + "\n")?;
    let mut csv = String::from("job_id,status,submitted_ms,started_ms,finished_ms,run_ms,warm\n");
    let opt = |v: Option<u64>| v.map_or(String::new(), |v| v.to_string());
    for j in jobs {
        csv.push_str(&format!(
            "{},{},{},{},{},{},{}\n",
            j.job_id,
            j.status,
            j.submitted_ms,
            opt(j.started_ms),
            opt(j.finished_ms),
            opt(j.run_ms),
            j.warm.map_or(String::new(), |w| w.to_string())
        ));
    }
    std::fs::write(dir.join("jobs.csv"), csv)?;
    let mut csv = String::from("ms_since_start,ready_messages\n");
    for (t, d) in depth {
        csv.push_str(&format!("{t},{d}\n"));
    }
    std::fs::write(dir.join("queue_depth.csv"), csv)?;
    let latencies: Vec<u64> = jobs.iter().filter_map(|j| Some(j.finished_ms?.saturating_sub(j.submitted_ms))).collect();
    plot::latency_histogram(&dir.join("latency.png"), &latencies, report)?;
    let submitted: Vec<u64> = jobs.iter().map(|j| j.submitted_ms.saturating_sub(t0_ms)).collect();
    let finished: Vec<u64> = jobs.iter().filter_map(|j| Some(j.finished_ms?.saturating_sub(t0_ms))).collect();
    plot::throughput(&dir.join("throughput.png"), &submitted, &finished, depth, report)?;
    Ok(())
}

fn print_report(r: &Report, dir: &Path) {
    let p =
        |name: &str, v: &Percentiles| println!("  {name:<24} p50 {:>6} | p90 {:>6} | p99 {:>6} | max {:>6} ms", v.p50, v.p90, v.p99, v.max);
    println!(
        "{} jobs ({} {} on SKU {}, {}), {} worker(s), {} build: {:.1} jobs/s over {:.1} s; statuses {:?}, unfinished {}, warm starts {}, max queue depth {}",
        r.jobs, r.mode, r.code.escape_debug(), r.sku, r.load, r.workers, r.build, r.jobs_per_second, r.seconds, r.statuses, r.unfinished, r.warm_starts, r.max_queue_depth
    );
    p("submitted -> finished", &r.submitted_to_finished_ms);
    p("queue wait", &r.queue_wait_ms);
    p("run (usage.wall_ms)", &r.run_ms);
    println!("  report: {}/ (report.json, jobs.csv, queue_depth.csv, latency.png, throughput.png)", dir.display());
}
