//! The worker's `/metrics`, `/healthz` and `/readyz` (issue 10), scraped from real workers in a
//! namespace of their own, each on a port the test picked (`SANDQ__WORKER__METRICS_ADDR`).
//!
//! Expected values come from what the tests did (how many jobs, which statuses, how long they
//! slept), never from the worker's code. The tests take turns: one stops the broker, and one
//! kills Garage, of the instance the tests use (`rabbitmqctl` follows `RABBITMQ_NODENAME`,
//! [`kill_garage`] `SANDQ_GARAGE_DIR`).

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use sandq_schemas::{JobStatus, Sku};
use sandq_tests::{exits_within, free_port, http_get, kill_garage, python_job, restart_services, wait, wait_for_status, Isolated};
use tokio::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::const_new(());

/// The label keys a metric of the worker may have: bounded ones only.
const ALLOWED_LABELS: [&str; 11] = ["sku", "status", "stage", "warm", "kind", "le", "reason", "action", "event", "outcome", "turn"];

/// One scrape of `/metrics`: every sample, by name and sorted labels.
struct Scrape {
    text: String,
    samples: BTreeMap<(String, Vec<(String, String)>), f64>,
}

impl Scrape {
    fn parse(text: String) -> Self {
        let mut samples = BTreeMap::new();
        for line in text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
            let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("bad sample line {line:?}"));
            let value: f64 = value.parse().unwrap_or_else(|_| panic!("bad value in {line:?}"));
            let (name, labels) = match series.split_once('{') {
                None => (series.to_owned(), Vec::new()),
                Some((name, rest)) => {
                    let mut labels: Vec<(String, String)> = rest
                        .trim_end_matches('}')
                        .split(',')
                        .filter(|p| !p.is_empty())
                        .map(|p| {
                            let (k, v) = p.split_once('=').unwrap_or_else(|| panic!("bad label in {line:?}"));
                            (k.to_owned(), v.trim_matches('"').to_owned())
                        })
                        .collect();
                    labels.sort();
                    (name.to_owned(), labels)
                }
            };
            samples.insert((name, labels), value);
        }
        Scrape { text, samples }
    }

    /// The sample's value; 0 when the series is absent.
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let mut labels: Vec<(String, String)> = labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        labels.sort();
        self.samples.get(&(name.to_owned(), labels)).copied().unwrap_or(0.0)
    }

    /// The sum of every series of `name`.
    fn total(&self, name: &str) -> f64 {
        self.samples.iter().filter(|((n, _), _)| n == name).map(|(_, v)| v).sum()
    }

    fn stage_count(&self, stage: &str) -> f64 {
        self.value("sandq_job_stage_duration_seconds_count", &[("stage", stage)])
    }

    fn stage_sum(&self, stage: &str) -> f64 {
        self.value("sandq_job_stage_duration_seconds_sum", &[("stage", stage)])
    }
}

fn scrape(port: u16) -> Scrape {
    let (status, body) = http_get(port, "/metrics").expect("the worker's /metrics does not answer");
    assert_eq!(status, 200, "{body}");
    Scrape::parse(body)
}

/// Scrapes until `done` holds (up to `limit`), and returns that scrape.
async fn scrape_until(port: u16, limit: Duration, done: impl Fn(&Scrape) -> bool) -> Scrape {
    let started = Instant::now();
    loop {
        let s = scrape(port);
        if done(&s) {
            return s;
        }
        assert!(started.elapsed() < limit, "metrics did not settle within {limit:?}:\n{}", s.text);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls `path` until it answers `status` (up to `limit`); returns the body.
async fn http_until(port: u16, path: &str, status: u16, limit: Duration) -> String {
    let started = Instant::now();
    loop {
        let answer = http_get(port, path);
        if let Some((s, body)) = &answer {
            if *s == status {
                return body.clone();
            }
        }
        assert!(started.elapsed() < limit, "{path} did not answer {status} within {limit:?}: {answer:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A worker of `world` whose endpoints listen on a port picked here.
fn start_worker(world: &Isolated, env: &[(&str, &str)]) -> (std::process::Child, u16) {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut all = vec![("SANDQ__WORKER__METRICS_ADDR", addr.as_str())];
    all.extend_from_slice(env);
    let worker = world.start_worker_ready(&format!("{}-w", world.namespace), &all);
    (worker, port)
}

/// Runs `rabbitmqctl` on the tests' node (`RABBITMQ_NODENAME` when set, else the default node).
fn rabbitmqctl(args: &[&str]) {
    let status = Command::new("rabbitmqctl").args(args).status().expect("rabbitmqctl");
    assert!(status.success(), "rabbitmqctl {args:?} failed");
}

/// Starts the broker's app again when dropped, whatever the test did meanwhile.
struct BrokerBack;

impl Drop for BrokerBack {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl").arg("start_app").status();
        let _ = Command::new("rabbitmqctl").arg("await_startup").status();
    }
}

/// Brings Garage back (scripts/services.sh) when dropped.
struct GarageBack;

impl Drop for GarageBack {
    fn drop(&mut self) {
        let _ = restart_services();
    }
}

/// Three succeeded and one failed S job, all cold: every counter and histogram moves by exactly
/// the number of jobs, and the gauges show the one running job while it runs.
#[tokio::test]
async fn jobs_move_the_counters_and_histograms_by_exactly_their_number() {
    let _serial = SERIAL.lock().await;
    let world = Isolated::new().await;
    let (mut worker, port) = start_worker(&world, &[("SANDQ__WARM__PER_SKU", "0")]);
    let mut client = world.client().await;
    let before = scrape(port);
    // Declared as the harness declares it.
    assert_eq!(before.value("sandq_capacity_cpus", &[]), 16.0);
    assert_eq!(before.value("sandq_capacity_memory_bytes", &[]), (64u64 << 30) as f64);

    let sleeper = python_job("import time\nprint('sleeping', flush=True)\ntime.sleep(3)\n", Sku::S);
    client.submit(&sleeper).await.expect("submit");
    wait_for_status(&mut client, &sleeper.job_id, JobStatus::Running, Duration::from_secs(60)).await;
    // While it runs: one delivery in flight, S's share of the capacity held (1 core, 2 GiB: the
    // default S), nothing finished yet.
    let during = scrape(port);
    assert_eq!(during.value("sandq_jobs_in_flight", &[]), 1.0, "{}", during.text);
    assert_eq!(during.value("sandq_capacity_cpus_in_use", &[]), 1.0, "{}", during.text);
    assert_eq!(during.value("sandq_capacity_memory_in_use_bytes", &[]), (2u64 << 30) as f64, "{}", during.text);
    assert_eq!(during.total("sandq_jobs_finished_total"), before.total("sandq_jobs_finished_total"));

    // Queued behind the sleeper (one S slot): they wait about its 3 s.
    let mut others = Vec::new();
    for code in ["print('a')", "print('b')", "import sys\nprint('c')\nsys.exit(3)\n"] {
        let spec = python_job(code, Sku::S);
        client.submit(&spec).await.expect("submit");
        others.push(spec);
    }
    let mut statuses = vec![wait(&mut client, &sleeper.job_id).await.status];
    for spec in &others {
        statuses.push(wait(&mut client, &spec.job_id).await.status);
    }
    assert_eq!(statuses, [JobStatus::Succeeded, JobStatus::Succeeded, JobStatus::Succeeded, JobStatus::Failed]);

    // The result is readable before the worker has acked: wait for the delivery to be done.
    let after = scrape_until(port, Duration::from_secs(30), |s| {
        s.value("sandq_jobs_in_flight", &[]) == 0.0 && s.stage_count("publish") == before.stage_count("publish") + 4.0
    })
    .await;
    let delta = |name: &str, labels: &[(&str, &str)]| after.value(name, labels) - before.value(name, labels);
    assert_eq!(delta("sandq_jobs_finished_total", &[("sku", "S"), ("status", "succeeded")]), 3.0, "{}", after.text);
    assert_eq!(delta("sandq_jobs_finished_total", &[("sku", "S"), ("status", "failed")]), 1.0, "{}", after.text);
    assert_eq!(after.total("sandq_jobs_finished_total") - before.total("sandq_jobs_finished_total"), 4.0, "{}", after.text);
    for stage in ["queue_wait", "stage", "sandbox_start", "run", "collect", "publish"] {
        assert_eq!(after.stage_count(stage) - before.stage_count(stage), 4.0, "stage {stage}:\n{}", after.text);
        let inf = after.value("sandq_job_stage_duration_seconds_bucket", &[("stage", stage), ("le", "+Inf")]);
        assert_eq!(inf, after.stage_count(stage), "stage {stage}: +Inf bucket and count differ");
    }
    // The sleeper ran at least its 3 s; the others waited behind it.
    assert!(after.stage_sum("run") - before.stage_sum("run") >= 3.0, "{}", after.text);
    assert!(after.stage_sum("queue_wait") - before.stage_sum("queue_wait") >= 2.0, "{}", after.text);
    assert_eq!(delta("sandq_warm_starts_total", &[("sku", "S"), ("warm", "false")]), 4.0, "{}", after.text);
    assert_eq!(delta("sandq_warm_starts_total", &[("sku", "S"), ("warm", "true")]), 0.0, "{}", after.text);
    assert_eq!(delta("sandq_redeliveries_total", &[]), 0.0);
    assert_eq!(after.total("sandq_infrastructure_errors_total"), 0.0, "{}", after.text);
    assert_eq!(after.value("sandq_capacity_cpus_in_use", &[]), 0.0);
    assert_eq!(after.value("sandq_capacity_memory_in_use_bytes", &[]), 0.0);
    // No job's id anywhere, and only bounded labels.
    for id in std::iter::once(&sleeper.job_id).chain(others.iter().map(|s| &s.job_id)) {
        assert!(!after.text.contains(id.as_str()), "job id {id} in the metrics");
    }
    for (name, labels) in after.samples.keys() {
        for (key, _) in labels {
            assert!(ALLOWED_LABELS.contains(&key.as_str()), "{name} has label {key}");
        }
    }
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// `/readyz` goes 503 (naming the broker) when RabbitMQ stops and 200 again when it is back;
/// `/healthz` stays 200 throughout; the lost connection is counted.
#[tokio::test]
async fn readiness_follows_the_broker() {
    let _serial = SERIAL.lock().await;
    let world = Isolated::new().await;
    let (mut worker, port) = start_worker(&world, &[("SANDQ__WARM__PER_SKU", "0")]);
    http_until(port, "/readyz", 200, Duration::from_secs(30)).await;
    assert_eq!(http_get(port, "/healthz").map(|(s, _)| s), Some(200));
    assert_eq!(http_get(port, "/nowhere").map(|(s, _)| s), Some(404));
    {
        let _back = BrokerBack;
        rabbitmqctl(&["stop_app"]);
        let reason = http_until(port, "/readyz", 503, Duration::from_secs(30)).await;
        assert!(reason.contains("broker"), "{reason}");
        assert!(!reason.contains("redis") && !reason.contains("s3"), "only the broker is down: {reason}");
        assert_eq!(http_get(port, "/healthz").map(|(s, _)| s), Some(200), "liveness does not depend on the broker");
    }
    // Reconnection backs off up to 10 s.
    http_until(port, "/readyz", 200, Duration::from_secs(60)).await;
    assert!(scrape(port).value("sandq_infrastructure_errors_total", &[("kind", "broker")]) >= 1.0);
    let mut client = world.client().await;
    let result = sandq_tests::run(&mut client, &python_job("print('back')", Sku::S)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// `/readyz` goes 503 (naming S3) while Garage is down, and 200 when it is back.
#[tokio::test]
async fn readiness_follows_s3() {
    let _serial = SERIAL.lock().await;
    let world = Isolated::new().await;
    let (mut worker, port) = start_worker(&world, &[("SANDQ__WARM__PER_SKU", "0")]);
    http_until(port, "/readyz", 200, Duration::from_secs(30)).await;
    {
        let _back = GarageBack;
        assert!(kill_garage(), "garage was not running");
        let reason = http_until(port, "/readyz", 503, Duration::from_secs(30)).await;
        assert!(reason.contains("s3"), "{reason}");
        assert!(!reason.contains("broker"), "the broker is up: {reason}");
    }
    http_until(port, "/readyz", 200, Duration::from_secs(60)).await;
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// A warm sandbox is counted ready, taken by an eligible job (a warm start), and refilled.
#[tokio::test]
async fn warm_sandboxes_are_counted_ready_taken_and_refilled() {
    let _serial = SERIAL.lock().await;
    let world = Isolated::new().await;
    // One core: only S (1 core) fits, so only S keeps a warm sandbox (one: Python notebook
    // jobs only here, one forked sandbox).
    let (mut worker, port) = start_worker(
        &world,
        &[
            ("SANDQ__WORKER__CAPACITY_CPUS", "1"),
            ("SANDQ__WARM__RUNTIMES", "python"),
            ("SANDQ__WARM__SCRIPT", "false"),
            ("SANDQ__WARM__LIGHT_PER_SKU", "1"),
            ("SANDQ__WARM__MEMORY_BYTES", "300000000"),
        ],
    );
    let ready = [("sku", "S")];
    let before = scrape_until(port, Duration::from_secs(120), |s| s.value("sandq_warm_sandboxes_ready", &ready) == 1.0).await;
    // The one warm sandbox's share comes off the memory jobs get.
    assert_eq!(before.value("sandq_capacity_memory_bytes", &[]), ((64u64 << 30) - 300_000_000) as f64);
    let mut client = world.client().await;
    let result = sandq_tests::run(&mut client, &python_job("print(6 * 7)", Sku::S)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert!(result.sandbox.as_ref().is_some_and(|s| s.warm), "not a warm start: {result:?}");
    let after = scrape_until(port, Duration::from_secs(30), |s| s.value("sandq_jobs_in_flight", &[]) == 0.0).await;
    let warm = |s: &Scrape, w: &str| s.value("sandq_warm_starts_total", &[("sku", "S"), ("warm", w)]);
    assert_eq!(warm(&after, "true") - warm(&before, "true"), 1.0, "{}", after.text);
    assert_eq!(warm(&after, "false") - warm(&before, "false"), 0.0, "{}", after.text);
    // A warm start has no sandbox_start stage.
    assert_eq!(after.stage_count("sandbox_start") - before.stage_count("sandbox_start"), 0.0);
    assert_eq!(after.stage_count("run") - before.stage_count("run"), 1.0);
    // The pool is refilled once the worker is idle.
    scrape_until(port, Duration::from_secs(120), |s| s.value("sandq_warm_sandboxes_ready", &ready) == 1.0).await;
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// A job whose worker is SIGKILLed runs again on another worker, which counts exactly one
/// redelivery; a job whose inputs cannot be staged while S3 is down counts infrastructure
/// errors of kind `stage` (one per attempt during the outage) and nothing else.
#[tokio::test]
async fn redeliveries_and_infrastructure_errors_are_counted() {
    let _serial = SERIAL.lock().await;
    let world = Isolated::new().await;
    let first_id = format!("{}-a", world.namespace);
    let mut first = world.start_worker(&first_id, &[("SANDQ__WARM__PER_SKU", "0")]);
    let mut client = world.client().await;
    let code = "import os, time\nif os.environ['SANDQ_ATTEMPT'] == '1':\n    time.sleep(60)\nprint('done')\n";
    let spec = python_job(code, Sku::S);
    client.submit(&spec).await.expect("submit");
    wait_for_status(&mut client, &spec.job_id, JobStatus::Running, Duration::from_secs(30)).await;
    sandq_tests::signal(&first, "KILL");
    assert!(exits_within(&mut first, Duration::from_secs(5)));
    let (mut second, port) = start_worker(&world, &[("SANDQ__WARM__PER_SKU", "0"), ("SANDQ__WORKER__MAX_ATTEMPTS", "4")]);
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!((result.status, result.attempt), (JobStatus::Succeeded, 2), "{result:?}");
    let after = scrape_until(port, Duration::from_secs(30), |s| s.value("sandq_jobs_in_flight", &[]) == 0.0).await;
    assert_eq!(after.value("sandq_redeliveries_total", &[]), 1.0, "{}", after.text);
    assert_eq!(after.value("sandq_jobs_finished_total", &[("sku", "S"), ("status", "succeeded")]), 1.0);
    assert_eq!(after.total("sandq_infrastructure_errors_total"), 0.0, "{}", after.text);

    // S3 down while the next job stages its input.
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data.txt");
    std::fs::write(&data, "staged\n").expect("write");
    let input = client.upload(&data, "data.txt").await.expect("upload");
    let mut spec = python_job("print(open('data.txt').read(), end='')", Sku::S);
    spec.inputs = vec![input];
    {
        let _back = GarageBack;
        assert!(kill_garage(), "garage was not running");
        client.submit(&spec).await.expect("submit");
        scrape_until(port, Duration::from_secs(120), |s| s.value("sandq_infrastructure_errors_total", &[("kind", "stage")]) >= 1.0).await;
    }
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, "staged\n");
    let end = scrape_until(port, Duration::from_secs(30), |s| s.value("sandq_jobs_in_flight", &[]) == 0.0).await;
    let stage_errors = end.value("sandq_infrastructure_errors_total", &[("kind", "stage")]);
    // One error per failed attempt, each requeued and redelivered; the last attempt succeeded.
    assert_eq!(stage_errors, f64::from(result.attempt - 1), "{}", end.text);
    assert_eq!(end.total("sandq_infrastructure_errors_total"), stage_errors, "{}", end.text);
    assert_eq!(end.value("sandq_redeliveries_total", &[]), 1.0 + stage_errors, "{}", end.text);
    assert_eq!(end.value("sandq_jobs_finished_total", &[("sku", "S"), ("status", "succeeded")]), 2.0);
    drop(second.stdin.take());
    assert!(exits_within(&mut second, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// Collection reads a staged input again only when the program changed it (otherwise every
/// input is hashed twice, at staging and at collection). A 24 MiB input the program only reads
/// costs no collection read; one it rewrites in place (same size, mtime put back) is read and
/// returned as an artifact with its new digest; a new file is read once. Warm and cold starts
/// alike (the worker keeps a warm S).
#[tokio::test]
async fn collection_reads_only_what_the_program_changed() {
    use rand::RngCore;
    use sha2::{Digest, Sha256};
    let _serial = SERIAL.lock().await;
    let world = Isolated::new().await;
    let (mut worker, port) = start_worker(&world, &[]);
    let mut client = world.client().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut data = vec![0u8; 24 << 20];
    rand::rng().fill_bytes(&mut data);
    let path = dir.path().join("big.bin");
    std::fs::write(&path, &data).expect("write");
    let input = client.upload(&path, "big.bin").await.expect("upload");
    let read_bytes = || scrape(port).value("sandq_collect_read_bytes_total", &[]);

    for round in 0..2 {
        let before = read_bytes();
        let mut spec = python_job("import hashlib\nprint(hashlib.sha256(open('big.bin', 'rb').read()).hexdigest())\n", Sku::S);
        spec.inputs = vec![input.clone()];
        client.submit(&spec).await.expect("submit");
        let result = wait(&mut client, &spec.job_id).await;
        assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
        assert_eq!(result.stdout.text.trim(), hex::encode(Sha256::digest(&data)));
        assert!(result.artifacts.is_empty(), "round {round}: an unchanged input came back: {:?}", result.artifacts);
        assert_eq!(read_bytes() - before, 0.0, "round {round} ({:?}): the unchanged input was read again", result.sandbox);
    }

    // Rewritten in place at once: same inode and size, the mtime put back to staging's.
    let before = read_bytes();
    let code = "import os\nst = os.stat('big.bin')\nwith open('big.bin', 'r+b') as f:\n    f.write(b'\\xff' * 4096)\n\
                os.utime('big.bin', ns=(st.st_atime_ns, st.st_mtime_ns))\nopen('new.txt', 'w').write('n' * 1000)\n";
    let mut spec = python_job(code, Sku::S);
    spec.inputs = vec![input.clone()];
    client.submit(&spec).await.expect("submit");
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    let mut changed = data.clone();
    changed[..4096].fill(0xff);
    let big = result.artifacts.iter().find(|a| a.path == "big.bin").expect("the rewritten input is an artifact");
    assert_eq!(big.sha256, hex::encode(Sha256::digest(&changed)));
    assert!(result.artifacts.iter().any(|a| a.path == "new.txt" && a.size == 1000), "{:?}", result.artifacts);
    assert_eq!(read_bytes() - before, (data.len() + 1000) as f64);

    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}
