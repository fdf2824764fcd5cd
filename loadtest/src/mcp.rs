//! `sandq-loadtest mcp`: issue 24's benchmark of the MCP layer (docs/benchmarks.md "MCP"),
//! against a running gateway and worker (scripts/bench-mcp.sh starts them), alternated one by
//! one in the same run:
//!
//! - end to end: a trivial `run_code` (`pass`) through `POST /mcp` against the same notebook
//!   job through the REST API (`POST /v1/jobs`, then `GET /v1/jobs/{id}?wait=`), in pairs whose
//!   order alternates, p50 and p99 and the difference: what a client pays for MCP on a cell;
//! - the layer alone: `get_job` of a finished job through `/mcp` against `GET /v1/jobs/{id}`
//!   of the same job: no worker in the path, so the difference is the MCP server's own cost
//!   (JSON-RPC, argument decoding, the in-process REST call, the content it builds).

use std::time::Instant;

use anyhow::{bail, Context};
use sandq_core::config::{self, ServiceConfig};
use serde_json::{json, Value};

/// What `sandq-loadtest mcp` measures.
#[derive(Debug, clap::Args)]
pub struct McpArgs {
    /// The gateway's base URL (`http://127.0.0.1:8080`).
    #[arg(long)]
    url: String,
    /// Cells of each kind in the end-to-end run.
    #[arg(long, default_value_t = 60)]
    cells: usize,
    /// Reads of each kind in the layer-alone run.
    #[arg(long, default_value_t = 300)]
    reads: usize,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// One `tools/call` through `/mcp` (stateless: no session); its result.
async fn call(http: &reqwest::Client, url: &str, key: &str, id: usize, tool: &str, arguments: Value) -> anyhow::Result<Value> {
    let body = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": tool, "arguments": arguments}});
    let response = http
        .post(format!("{url}/mcp"))
        .bearer_auth(key)
        .header("Accept", "application/json, text/event-stream")
        .header("MCP-Protocol-Version", "2025-06-18")
        .json(&body)
        .send()
        .await?;
    let status = response.status();
    let text = response.text().await?;
    // One JSON answer, or an SSE stream whose last `data:` line is the answer.
    let json_text =
        if text.starts_with('{') { text.as_str() } else { text.lines().filter_map(|l| l.strip_prefix("data:")).next_back().unwrap_or("") };
    let answer: Value = serde_json::from_str(json_text.trim()).with_context(|| format!("{tool}: {status} {text}"))?;
    let result = answer.get("result").cloned().with_context(|| format!("{tool}: {answer}"))?;
    if result.get("isError") == Some(&Value::Bool(true)) {
        bail!("{tool}: {result}");
    }
    Ok(result)
}

fn ms(started: Instant) -> f64 {
    started.elapsed().as_secs_f64() * 1000.0
}

fn row(label: &str, sorted: &[f64]) {
    println!("| {label} | {:.2} | {:.2} |", percentile(sorted, 50.0), percentile(sorted, 99.0));
}

/// Runs the benchmark and prints its tables (markdown).
///
/// # Errors
/// The services or the gateway that cannot be reached, a call refused.
pub async fn run(args: McpArgs) -> anyhow::Result<()> {
    let service: ServiceConfig = config::load(&config::config_path(None))?;
    let names = sandq_schemas::names::Names::new(service.namespace.clone());
    let mut redis = sandq_core::redis_conn::connect(&service.redis).await?;
    let quotas = sandq_core::keys::Quotas { max_in_flight: 1_000_000, jobs_per_minute: 1_000_000, ..Default::default() };
    let (_record, key) = sandq_core::keys::create(&mut redis, &names, "bench", "sandq-loadtest mcp", quotas).await?;
    let http = reqwest::Client::builder().pool_max_idle_per_host(64).build()?;
    let url = args.url.trim_end_matches('/');

    // 1. End to end, alternated: a cell through MCP, then the same through REST.
    let (mut mcp, mut rest) = (Vec::new(), Vec::new());
    let mut finished = String::new();
    // Which goes first alternates: the second of a pair starts right after the first, when the
    // worker's warm sandbox may not be back yet (a cold start), so neither side always gets it.
    for k in 0..args.cells + 6 {
        let (mut through_mcp, mut through_rest) = (0.0, 0.0);
        for side in [k % 2, 1 - k % 2] {
            if side == 0 {
                let started = Instant::now();
                let result = call(&http, url, &key, k, "run_code", json!({"code": "pass"})).await?;
                through_mcp = ms(started);
                let text = result["content"][0]["text"].as_str().unwrap_or_default().to_owned();
                if !text.contains("succeeded") {
                    bail!("run_code: {text}");
                }
            } else {
                let started = Instant::now();
                let body = json!({"runtime": "python", "code": "pass", "mode": "notebook", "timeout": "60s"});
                let posted = http.post(format!("{url}/v1/jobs")).bearer_auth(&key).json(&body).send().await?.json::<Value>().await?;
                let id = posted["job_id"].as_str().context("job_id")?.to_owned();
                let done = http.get(format!("{url}/v1/jobs/{id}?wait=60s")).bearer_auth(&key).send().await?.json::<Value>().await?;
                through_rest = ms(started);
                if done["status"] != "succeeded" {
                    bail!("REST job: {done}");
                }
                finished = id;
            }
        }
        if k >= 6 {
            mcp.push(through_mcp);
            rest.push(through_rest);
        }
    }

    // 2. The layer alone: the same finished job read both ways.
    let (mut get_job, mut get) = (Vec::new(), Vec::new());
    for k in 0..args.reads + 20 {
        let started = Instant::now();
        call(&http, url, &key, k, "get_job", json!({"job_id": finished})).await?;
        let through_mcp = ms(started);
        let started = Instant::now();
        let body = http.get(format!("{url}/v1/jobs/{finished}")).bearer_auth(&key).send().await?.bytes().await?;
        let through_rest = ms(started);
        if body.is_empty() {
            bail!("GET /v1/jobs/{finished}: empty");
        }
        if k >= 20 {
            get_job.push(through_mcp);
            get.push(through_rest);
        }
    }
    for v in [&mut mcp, &mut rest, &mut get_job, &mut get] {
        v.sort_by(f64::total_cmp);
    }
    println!("| {} cells each, alternated (ms) | p50 | p99 |\n|---|---|---|", args.cells);
    row("`run_code` `pass` through `/mcp`", &mcp);
    row("the same job through REST (`POST /v1/jobs`, `GET ?wait=`)", &rest);
    let (d50, d99) = (percentile(&mcp, 50.0) - percentile(&rest, 50.0), percentile(&mcp, 99.0) - percentile(&rest, 99.0));
    println!("| **MCP's added latency, end to end** | **{d50:.2}** | **{d99:.2}** |\n");
    println!("| {} reads each, alternated (ms) | p50 | p99 |\n|---|---|---|", args.reads);
    row("`get_job` of a finished job through `/mcp`", &get_job);
    row("`GET /v1/jobs/{id}` of the same job", &get);
    let (d50, d99) = (percentile(&get_job, 50.0) - percentile(&get, 50.0), percentile(&get_job, 99.0) - percentile(&get, 99.0));
    println!("| **the MCP layer's own cost** | **{d50:.2}** | **{d99:.2}** |");
    Ok(())
}
