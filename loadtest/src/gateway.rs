//! `sandq-loadtest gateway`: issue 23's benchmark of the HTTP gateway (docs/benchmarks.md
//! "HTTP gateway"), against a running gateway in a namespace with no worker
//! (scripts/bench-gateway.sh starts it), so jobs stay queued and only the gateway and the queue
//! are measured:
//!
//! - the gateway's overhead on a submission: `POST /v1/jobs` against the direct Rust client's
//!   `submit` of the same job (publish with confirm, `queued` written), alternated one by one;
//!   and on a read: `GET /v1/jobs/{id}` against `Client::status`; p50 and p99 of each and the
//!   differences;
//! - requests per second of `GET /v1/jobs/{id}` at `--concurrency`, against direct reads at the
//!   same concurrency in the same run;
//! - the gateway's memory (RSS, from `/proc/<pid>/status`) with `--streams` idle event streams
//!   open, against before.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt;
use sandq_client::Client;
use sandq_core::config::{self, ServiceConfig};
use sandq_schemas::{JobSpec, Runtime, Sku};

/// What `sandq-loadtest gateway` measures.
#[derive(Debug, clap::Args)]
pub struct GatewayArgs {
    /// The gateway's base URL (`http://127.0.0.1:8080`).
    #[arg(long)]
    url: String,
    /// The gateway's process id (its memory is read from /proc).
    #[arg(long)]
    pid: u32,
    /// Submissions (and reads) of each kind in the overhead run.
    #[arg(long, default_value_t = 300)]
    requests: usize,
    /// How long each requests-per-second run lasts.
    #[arg(long, default_value = "10s")]
    duration: humantime::Duration,
    /// Concurrent readers in the requests-per-second runs.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Idle event streams opened for the memory run.
    #[arg(long, default_value_t = 1000)]
    streams: usize,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn trivial(job_id: String) -> JobSpec {
    let mut spec = JobSpec::new(job_id, Sku::S, Runtime::Python, "1");
    spec.result_ttl = Some("10m".into());
    spec
}

/// Runs the benchmark and prints its tables (markdown).
///
/// # Errors
/// A service or the gateway that cannot be reached, a request refused.
pub async fn run(args: GatewayArgs) -> anyhow::Result<()> {
    let service: ServiceConfig = config::load(&config::config_path(None))?;
    let names = sandq_schemas::names::Names::new(service.namespace.clone());
    let mut redis = sandq_core::redis_conn::connect(&service.redis).await?;
    let quotas = sandq_core::keys::Quotas { max_in_flight: 1_000_000, jobs_per_minute: 1_000_000, ..Default::default() };
    let (record, key) = sandq_core::keys::create(&mut redis, &names, "bench", "sandq-loadtest gateway", quotas).await?;
    let mut client = Client::connect(service.clone()).await.context("connect")?;
    let http = reqwest::Client::builder().pool_max_idle_per_host(1024).build()?;
    let jobs_url = format!("{}/v1/jobs", args.url);

    // 1. Overhead, one request at a time, alternated.
    let (mut post, mut submit, mut get, mut status) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut an_id = String::new();
    for k in 0..args.requests + 20 {
        let started = Instant::now();
        let response = http.post(&jobs_url).bearer_auth(&key).json(&serde_json::json!({"runtime": "python", "code": "1"})).send().await?;
        let posted = started.elapsed();
        if response.status() != reqwest::StatusCode::CREATED {
            bail!("POST /v1/jobs: {} {}", response.status(), response.text().await.unwrap_or_default());
        }
        let id = response.json::<serde_json::Value>().await?["job_id"].as_str().unwrap_or_default().to_owned();
        let started = Instant::now();
        client.submit(&trivial(uuid::Uuid::new_v4().to_string())).await?;
        let submitted = started.elapsed();
        let started = Instant::now();
        let response = http.get(format!("{jobs_url}/{id}")).bearer_auth(&key).send().await?;
        let body = response.bytes().await?;
        let got = started.elapsed();
        if body.is_empty() {
            bail!("GET /v1/jobs/{id}: empty");
        }
        let started = Instant::now();
        client.status(&format!("bench_{id}")).await?.context("the job's result")?;
        let read = started.elapsed();
        // The first 20 of each warm the connections up.
        if k >= 20 {
            post.push(posted.as_secs_f64() * 1000.0);
            submit.push(submitted.as_secs_f64() * 1000.0);
            get.push(got.as_secs_f64() * 1000.0);
            status.push(read.as_secs_f64() * 1000.0);
        }
        an_id = id;
    }
    for v in [&mut post, &mut submit, &mut get, &mut status] {
        v.sort_by(f64::total_cmp);
    }
    println!("| {} requests each, alternated (ms) | p50 | p99 |\n|---|---|---|", args.requests);
    println!("| `POST /v1/jobs` | {:.2} | {:.2} |", percentile(&post, 50.0), percentile(&post, 99.0));
    println!("| `Client::submit` (direct) | {:.2} | {:.2} |", percentile(&submit, 50.0), percentile(&submit, 99.0));
    println!(
        "| **submission overhead** | **{:.2}** | **{:.2}** |",
        percentile(&post, 50.0) - percentile(&submit, 50.0),
        percentile(&post, 99.0) - percentile(&submit, 99.0)
    );
    println!("| `GET /v1/jobs/{{id}}` | {:.2} | {:.2} |", percentile(&get, 50.0), percentile(&get, 99.0));
    println!("| `Client::status` (direct) | {:.2} | {:.2} |", percentile(&status, 50.0), percentile(&status, 99.0));
    println!(
        "| **read overhead** | **{:.2}** | **{:.2}** |",
        percentile(&get, 50.0) - percentile(&status, 50.0),
        percentile(&get, 99.0) - percentile(&status, 99.0)
    );

    // 2. Requests per second of reads, through the gateway and direct.
    let duration: Duration = args.duration.into();
    let through_gateway = {
        let url = format!("{jobs_url}/{an_id}");
        let tasks = (0..args.concurrency).map(|_| {
            let (http, url, key) = (http.clone(), url.clone(), key.clone());
            tokio::spawn(async move {
                let (started, mut n) = (Instant::now(), 0u64);
                while started.elapsed() < duration {
                    let Ok(response) = http.get(&url).bearer_auth(&key).send().await else { return Err(()) };
                    if !response.status().is_success() || response.bytes().await.is_err() {
                        return Err(());
                    }
                    n += 1;
                }
                Ok(n)
            })
        });
        let counts = futures::future::join_all(tasks).await;
        let mut total = 0;
        for count in counts {
            total += count.ok().and_then(Result::ok).context("a read through the gateway failed")?;
        }
        total as f64 / duration.as_secs_f64()
    };
    let direct = {
        let job_id = format!("bench_{an_id}");
        let tasks = (0..args.concurrency).map(|_| {
            let (mut redis, names, job_id) = (redis.clone(), names.clone(), job_id.clone());
            tokio::spawn(async move {
                let (started, mut n) = (Instant::now(), 0u64);
                while started.elapsed() < duration {
                    if sandq_core::results::read(&mut redis, &names, &job_id).await.is_err() {
                        return Err(());
                    }
                    n += 1;
                }
                Ok(n)
            })
        });
        let counts = futures::future::join_all(tasks).await;
        let mut total = 0;
        for count in counts {
            total += count.ok().and_then(Result::ok).context("a direct read failed")?;
        }
        total as f64 / duration.as_secs_f64()
    };
    println!("\n| reads of one job's result, {} concurrent, {:?} each | requests/s |\n|---|---|", args.concurrency, duration);
    println!("| `GET /v1/jobs/{{id}}` through the gateway | {through_gateway:.0} |");
    println!("| `results::read` direct (one shared Redis connection) | {direct:.0} |");
    println!("| ratio | {:.2} |", through_gateway / direct);

    // 3. Memory with idle event streams (the job stays queued: no worker serves this namespace).
    let streams = idle_streams(&args, &key, &format!("{jobs_url}/{an_id}/events"), &mut redis).await;

    // The run's namespace goes, whatever happened above: its queues (holding the jobs) and
    // its key.
    let connection = sandq_core::broker::connect(&service.amqp.addresses(), 0, &lapin::ConnectionProperties::default()).await?.0;
    sandq_core::topology::delete_queues(&connection.create_channel().await?, &names).await?;
    let () = redis::cmd("DEL")
        .arg(format!("{}:apikey:{{{}}}", names.namespace(), record.id))
        .arg(format!("{}:apikeys", names.namespace()))
        .query_async(&mut redis)
        .await?;
    streams
}

/// Opens `--streams` idle event streams on `url` and prints the gateway's memory before and
/// with them.
async fn idle_streams(args: &GatewayArgs, key: &str, url: &str, redis: &mut sandq_core::redis_conn::RedisConn) -> anyhow::Result<()> {
    let before = rss_kib(args.pid);
    let mut open = Vec::with_capacity(args.streams);
    for _ in 0..args.streams {
        let response = reqwest::Client::new().get(url).bearer_auth(key).send().await?;
        if !response.status().is_success() {
            bail!("GET events: {}", response.status());
        }
        open.push(response.bytes_stream());
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let with_streams = rss_kib(args.pid);
    let redis_clients: String = redis::cmd("INFO").arg("clients").query_async(redis).await?;
    let connected = redis_clients.lines().find_map(|l| l.strip_prefix("connected_clients:")).unwrap_or("?").trim().to_owned();
    // Each stream is still open: a first poll would wait for an event.
    if let Some(first) = open.first_mut() {
        if tokio::time::timeout(Duration::from_millis(100), first.next()).await.is_ok() {
            println!("(a stream ended or sent data while idle)");
        }
    }
    println!("\n| gateway memory (RSS) | KiB |\n|---|---|");
    println!("| before | {before} |");
    println!("| with {} idle event streams | {with_streams} |", args.streams);
    println!("| per stream | {:.1} |", (with_streams.saturating_sub(before)) as f64 / args.streams as f64);
    println!("\nRedis clients connected with the streams open: {connected} (each stream holds one connection for `XREAD BLOCK`)");
    drop(open);
    Ok(())
}
