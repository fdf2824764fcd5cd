//! `sandq-loadtest live`: issue 22's benchmark of live events (docs/benchmarks.md "Live
//! output"), against running workers (scripts/bench-live.sh starts them):
//!
//! - latency from the program's write to the client reading it: a job prints its clock
//!   (`time.time_ns()`) every `--interval`, `--lines` times; each line's latency is the
//!   client's clock when the event was read less the printed clock (one machine, one clock),
//!   split into the worker's share (the stream entry's id is Redis's clock at `XADD`) and the
//!   rest (Redis and the client's read); p50 and p99;
//! - Redis memory of a running job's stream (`MEMORY USAGE` while it runs, and at its end);
//! - the cost of streaming: a job printing `--flood` lines, run alternately `--reps` times
//!   against the workers of the config's namespace (streaming) and of `--off-namespace`
//!   (`worker.stream_max_bytes = 0`); median end-to-end time (submitted -> result read) and
//!   the program's wall time, and their ratio.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use futures::StreamExt;
use sandq_client::{Client, EventKind};
use sandq_core::config::{self, ServiceConfig};
use sandq_schemas::{JobResult, JobSpec, JobStatus, RunMode, Runtime, Sku};

/// What `sandq-loadtest live` measures.
#[derive(Debug, clap::Args)]
pub struct LiveArgs {
    /// Lines of the latency job.
    #[arg(long, default_value_t = 200)]
    lines: u32,
    /// Pause between two lines of the latency job.
    #[arg(long, default_value = "20ms")]
    interval: humantime::Duration,
    /// Lines of the flood job.
    #[arg(long, default_value_t = 200_000)]
    flood: u32,
    /// Runs of the flood job per namespace.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Namespace of workers that do not stream (`worker.stream_max_bytes = 0`).
    #[arg(long)]
    off_namespace: String,
    /// SKU of the jobs.
    #[arg(long, default_value = "S")]
    sku: Sku,
}

fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

fn job(code: String, sku: Sku, mode: RunMode) -> JobSpec {
    let mut spec = JobSpec::new(uuid::Uuid::new_v4().to_string(), sku, Runtime::Python, code);
    spec.timeout = Some("5m".into());
    spec.result_ttl = Some("10m".into());
    spec.mode = Some(mode);
    spec
}

/// The `p`-th percentile (0..=100) of sorted `values`, nearest rank.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    percentile(values, 50.0)
}

async fn wait(client: &mut Client, job_id: &str) -> anyhow::Result<JobResult> {
    let result = client.wait(job_id, Duration::from_secs(600), Duration::from_millis(200), |_| {}).await?;
    if result.status != JobStatus::Succeeded {
        bail!("job {job_id} {}: {}", result.status, result.stderr.text);
    }
    Ok(result)
}

/// Runs the benchmark and prints its tables (markdown).
///
/// # Errors
/// A service that cannot be reached, a job that does not succeed.
pub async fn run(args: LiveArgs) -> anyhow::Result<()> {
    let path = config::config_path(None);
    let on: ServiceConfig = config::load(&path)?;
    let mut off = on.clone();
    off.namespace.clone_from(&args.off_namespace);
    let mut client = Client::connect(on.clone()).await.context("connect")?;
    let mut reader = Client::connect(on.clone()).await.context("connect")?;
    let mut client_off = Client::connect(off).await.context("connect")?;
    let mut redis = sandq_core::results::connect(&on.redis).await?;

    // 1. Latency, and the stream's memory while the job runs.
    let interval = Duration::from(args.interval).as_secs_f64();
    let code = format!("import time\nfor i in range({}):\n    print(time.time_ns(), flush=True)\n    time.sleep({interval})\n", args.lines);
    let spec = job(code, args.sku, RunMode::Script);
    client.submit(&spec).await?;
    let key = client.names().events_key(&spec.job_id);
    let (mut total, mut worker_share) = (Vec::new(), Vec::new());
    let mut memory_running = 0u64;
    {
        let events = reader.events(&spec.job_id, sandq_core::events::START, Duration::from_millis(200));
        futures::pin_mut!(events);
        let mut partial = String::new();
        while let Some(event) = events.next().await {
            let read_ns = now_ns();
            let EventKind::Stdout(text) = &event.kind else { continue };
            let added_ms: u128 = event.id.split('-').next().and_then(|ms| ms.parse().ok()).unwrap_or(0);
            partial.push_str(text);
            while let Some(newline) = partial.find('\n') {
                let line: String = partial.drain(..=newline).collect();
                let Ok(printed_ns) = line.trim().parse::<u128>() else { continue };
                total.push(read_ns.saturating_sub(printed_ns) as f64 / 1e6);
                worker_share.push((added_ms * 1_000_000).saturating_sub(printed_ns) as f64 / 1e6);
            }
            if memory_running == 0 && total.len() >= (args.lines / 2) as usize {
                memory_running =
                    redis::cmd("MEMORY").arg("USAGE").arg(&key).arg("SAMPLES").arg(0).query_async(&mut redis).await.unwrap_or(0);
            }
        }
    }
    wait(&mut client, &spec.job_id).await?;
    let memory_end: u64 = redis::cmd("MEMORY").arg("USAGE").arg(&key).arg("SAMPLES").arg(0).query_async(&mut redis).await.unwrap_or(0);
    if total.len() != args.lines as usize {
        bail!("read {} of {} lines live", total.len(), args.lines);
    }
    total.sort_by(f64::total_cmp);
    worker_share.sort_by(f64::total_cmp);
    println!("| latency, write -> client read (ms) | p50 | p99 | max |\n|---|---|---|---|");
    println!("| total | {:.1} | {:.1} | {:.1} |", percentile(&total, 50.0), percentile(&total, 99.0), percentile(&total, 100.0));
    println!(
        "| worker's share (write -> XADD) | {:.1} | {:.1} | {:.1} |",
        percentile(&worker_share, 50.0),
        percentile(&worker_share, 99.0),
        percentile(&worker_share, 100.0)
    );
    println!(
        "\n{} lines {} ms apart; Redis memory of the stream: {memory_running} bytes half-way, {memory_end} bytes at the end\n",
        args.lines,
        interval * 1000.0
    );

    // 2. The cost of streaming on a flood of lines, on and off alternately.
    let code = format!("for i in range({}):\n    print('line', i)\n", args.flood);
    let (mut e2e_on, mut e2e_off, mut wall_on, mut wall_off) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut flood_memory = 0u64;
    for _ in 0..args.reps {
        for streaming in [true, false] {
            let spec = job(code.clone(), args.sku, RunMode::Script);
            let c = if streaming { &mut client } else { &mut client_off };
            let started = std::time::Instant::now();
            c.submit(&spec).await?;
            let result = wait(c, &spec.job_id).await?;
            let e2e = started.elapsed().as_secs_f64() * 1000.0;
            let wall = result.usage.map_or(f64::NAN, |u| u.wall_ms as f64);
            if streaming {
                e2e_on.push(e2e);
                wall_on.push(wall);
                let key = c.names().events_key(&spec.job_id);
                flood_memory = redis::cmd("MEMORY").arg("USAGE").arg(&key).arg("SAMPLES").arg(0).query_async(&mut redis).await.unwrap_or(0);
            } else {
                e2e_off.push(e2e);
                wall_off.push(wall);
            }
        }
    }
    let (e_on, e_off, w_on, w_off) = (median(&mut e2e_on), median(&mut e2e_off), median(&mut wall_on), median(&mut wall_off));
    println!("| {} lines, median of {} | streaming on | streaming off | ratio |\n|---|---|---|---|", args.flood, args.reps);
    println!("| submitted -> result read (ms) | {e_on:.0} | {e_off:.0} | {:.3} |", e_on / e_off);
    println!("| program wall time (ms) | {w_on:.0} | {w_off:.0} | {:.3} |", w_on / w_off);
    println!("\nRedis memory of the flood job's stream (capped): {flood_memory} bytes");
    Ok(())
}
