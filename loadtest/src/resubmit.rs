//! The chaos run's re-submissions (`--resubmit N`): N jobs whose result is kept and N whose
//! result expires after 1 s, submitted through a `sandq-gateway` of the run (its namespace, its
//! Redis) while the faults happen, each POST retried with the same body and `job_id` until it is
//! answered (a 503 or no answer: the publish's outcome unknown). Once every one has ended (and
//! the short ones' results expired), each is POSTed again with the same body and `job_id`: a
//! kept one must answer 200 with its terminal result, an expired one 410 `result-expired`, and
//! neither may run again (runs are counted from the workers' logs: one `container id` line per
//! attempt started) nor be counted again against the key (its per-minute rate counters and its
//! jobs in flight, read in Redis under the gateway's names).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use sandq_core::config::ServiceConfig;
use sandq_core::redis_conn::RedisConn;
use serde_json::{json, Value};

/// What the re-submissions found (part of the chaos report).
#[derive(Debug, Default, serde::Serialize)]
pub struct Resubmitted {
    /// Jobs submitted through the gateway (kept and expiring).
    pub jobs: usize,
    /// Their first submissions answered other than 201 or 200 in the end.
    pub not_accepted: usize,
    /// Re-submissions answered other than 200 with the terminal result (kept) or 410
    /// `result-expired` (expired).
    pub wrong_answer: usize,
    /// Jobs that started again after their re-submission.
    pub ran_again: usize,
    /// Jobs whose first run never started (as the workers' logs say).
    pub never_ran: usize,
    /// The key's rate counters' sum after the first submissions, less the jobs (must be 0).
    pub miscounted: i64,
    /// What the re-submissions added to the key's rate counters (must be 0).
    pub counted_by_resubmissions: i64,
    /// The key's jobs in flight that are not one of these jobs, or these jobs missing (must be 0).
    pub in_flight_mismatch: usize,
}

/// A gateway of the chaos run, and its key.
pub struct Gateway {
    child: Child,
    base: String,
    key: String,
    key_id: String,
    namespace: String,
    http: reqwest::Client,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

impl Gateway {
    /// Starts `sandq-gateway` from `bin_dir` on `config`'s namespace and Redis, loopback only,
    /// and makes a key with quotas the run never reaches.
    pub async fn start(bin_dir: &Path, config: &ServiceConfig) -> anyhow::Result<Gateway> {
        let log_path = std::env::temp_dir().join(format!("{}-gateway.log", config.namespace));
        let log = std::fs::File::create(&log_path)?;
        let child = Command::new(bin_dir.join("sandq-gateway"))
            .arg("--exit-on-stdin-eof")
            .env("SANDQ__NAMESPACE", &config.namespace)
            .env("SANDQ__REDIS__URL", &config.redis.url)
            .env("SANDQ__GATEWAY__LISTEN", "127.0.0.1:0")
            // Its operator listener too: another gateway on this host may hold the default.
            .env("SANDQ__GATEWAY__METRICS_LISTEN", "127.0.0.1:0")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("sandq-gateway")?;
        let started = Instant::now();
        let base = loop {
            let text = std::fs::read_to_string(&log_path).unwrap_or_default();
            if let Some(addr) = text.lines().find(|l| l.contains("serving the API")).and_then(|l| l.split("addr=").nth(1)) {
                break format!("http://{}", addr.split_whitespace().next().unwrap_or_default());
            }
            if started.elapsed() > Duration::from_secs(60) {
                bail!("the gateway did not start: {text}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let mut redis = sandq_core::redis_conn::connect(&config.redis).await?;
        let names = sandq_schemas::names::Names::new(config.namespace.clone());
        let quotas =
            sandq_core::keys::Quotas { max_in_flight: 1_000_000, jobs_per_minute: 1_000_000, ..sandq_core::keys::Quotas::default() };
        let (record, key) = sandq_core::keys::create(&mut redis, &names, "chaos", "sandq-loadtest chaos", quotas).await?;
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
        Ok(Gateway { child, base, key, key_id: record.id, namespace: config.namespace.clone(), http })
    }

    fn body(id: &str, n: usize, expiring: bool) -> Value {
        json!({
            "job_id": id,
            "runtime": "python",
            "code": format!("print('resubmitted {n}')"),
            "sku": "S",
            "timeout": "60s",
            "result_ttl": if expiring { "1s" } else { "1h" },
        })
    }

    /// POSTs a job until the gateway answers other than 503, or a 409 with `Retry-After` (the
    /// same submission under way), or no answer, for at most 2 minutes: the same body and
    /// `job_id` each time, as a client unsure whether it was queued does.
    async fn post(&self, body: &Value) -> (u16, Value) {
        let started = Instant::now();
        loop {
            let sent = self.http.post(format!("{}/v1/jobs", self.base)).bearer_auth(&self.key).json(body).send().await;
            let again = match &sent {
                Ok(r) => r.status().as_u16() == 503 || (r.status().as_u16() == 409 && r.headers().contains_key("retry-after")),
                Err(_) => true,
            };
            if !again || started.elapsed() > Duration::from_secs(120) {
                return match sent {
                    Ok(r) => {
                        let status = r.status().as_u16();
                        (status, r.json().await.unwrap_or(Value::Null))
                    }
                    Err(e) => (0, json!(e.to_string())),
                };
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    async fn get(&self, id: &str) -> (u16, Value) {
        match self.http.get(format!("{}/v1/jobs/{id}?wait=10s", self.base)).bearer_auth(&self.key).send().await {
            Ok(r) => {
                let status = r.status().as_u16();
                (status, r.json().await.unwrap_or(Value::Null))
            }
            Err(e) => (0, json!(e.to_string())),
        }
    }

    /// The key's per-minute rate counters (those Redis still keeps: two minutes each).
    async fn rate_counters(&self, redis: &mut RedisConn) -> anyhow::Result<BTreeMap<String, i64>> {
        let pattern = format!("{}:apikey:{{{}}}:rate:*", self.namespace, self.key_id);
        let keys: Vec<String> = redis::cmd("KEYS").arg(pattern).query_async(redis).await?;
        let mut counters = BTreeMap::new();
        for key in keys {
            let n: Option<i64> = redis::cmd("GET").arg(&key).query_async(redis).await?;
            counters.insert(key, n.unwrap_or(0));
        }
        Ok(counters)
    }
}

/// Submits `n` kept and `n` expiring jobs (ids `rs-keep-<i>`, `rs-gone-<i>`); returns their ids,
/// whether each expires, and the key's rate counters then.
pub async fn submit(gateway: &Gateway, config: &ServiceConfig, n: usize, report: &mut Resubmitted) -> anyhow::Result<Vec<(String, bool)>> {
    let mut ids = Vec::new();
    for i in 0..n {
        for expiring in [false, true] {
            let id = format!("rs-{}-{i}", if expiring { "gone" } else { "keep" });
            let (status, answer) = gateway.post(&Gateway::body(&id, i, expiring)).await;
            if status != 201 && status != 200 {
                eprintln!("resubmit: {id} not accepted: {status} {answer}");
                report.not_accepted += 1;
            }
            ids.push((id, expiring));
        }
    }
    report.jobs = ids.len();
    let mut redis = sandq_core::redis_conn::connect(&config.redis).await?;
    let counted: i64 = gateway.rate_counters(&mut redis).await?.values().sum();
    report.miscounted = counted - ids.len() as i64;
    Ok(ids)
}

/// Runs started of the gateway job `id` (scoped `chaos_<id>`) in the workers' logs.
fn runs(logs: &[String], id: &str) -> usize {
    let needle = format!("job_id=chaos_{id} ");
    logs.iter().map(|log| log.lines().filter(|l| l.contains(&needle) && l.contains("container_id=")).count()).sum()
}

/// Once every job has ended (and the expiring ones' results expired), POSTs each again and
/// checks its answer, its runs and its count.
pub async fn resubmit(
    gateway: &Gateway,
    config: &ServiceConfig,
    ids: &[(String, bool)],
    worker_logs: &dyn Fn() -> Vec<String>,
    deadline: Instant,
    report: &mut Resubmitted,
) -> anyhow::Result<()> {
    for (id, expiring) in ids {
        loop {
            let (status, job) = gateway.get(id).await;
            let state = job["status"].as_str().unwrap_or_default();
            let ended = if *expiring { status == 410 } else { status == 200 && !["queued", "running"].contains(&state) };
            if ended || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let before = worker_logs();
    let mut redis = sandq_core::redis_conn::connect(&config.redis).await?;
    let counters = gateway.rate_counters(&mut redis).await?;
    for (i, (id, expiring)) in ids.iter().enumerate() {
        let (status, answer) = gateway.post(&Gateway::body(id, i / 2, *expiring)).await;
        let right = if *expiring {
            status == 410 && answer["type"] == "urn:sandq:problem:result-expired"
        } else {
            status == 200 && answer["status"] == "succeeded"
        };
        if !right {
            eprintln!("resubmit: {id} answered {status} {answer}");
            report.wrong_answer += 1;
        }
    }
    let after = gateway.rate_counters(&mut redis).await?;
    report.counted_by_resubmissions = after.iter().map(|(k, n)| n - counters.get(k).copied().unwrap_or(0)).sum();
    // A job published again would be taken within moments: give the workers the queues' drain.
    let names = sandq_schemas::names::Names::new(config.namespace.clone());
    let (connection, _) = sandq_core::broker::connect(&config.amqp.addresses(), 0, &lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let drained = Instant::now();
    loop {
        let declared = channel
            .queue_declare(
                names.jobs_queue(sandq_schemas::Sku::S).into(),
                lapin::options::QueueDeclareOptions { passive: true, ..Default::default() },
                lapin::types::FieldTable::default(),
            )
            .await?;
        if declared.message_count() == 0 || drained.elapsed() > Duration::from_secs(30) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = worker_logs();
    for (id, _) in ids {
        let (first, last) = (runs(&before, id), runs(&later, id));
        if first == 0 {
            report.never_ran += 1;
        }
        if last > first {
            eprintln!("resubmit: {id} started {first} times before its re-submission, {last} after");
            report.ran_again += 1;
        }
    }
    let in_flight: Vec<String> = redis::cmd("ZRANGE")
        .arg(format!("{}:apikey:{{{}}}:inflight", gateway.namespace, gateway.key_id))
        .arg(0)
        .arg(-1)
        .query_async(&mut redis)
        .await?;
    let expected: Vec<String> = ids.iter().map(|(id, _)| format!("chaos_{id}")).collect();
    report.in_flight_mismatch =
        in_flight.iter().filter(|m| !expected.contains(m)).count() + expected.iter().filter(|e| !in_flight.contains(e)).count();
    Ok(())
}
