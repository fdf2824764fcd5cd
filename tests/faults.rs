//! Infrastructure faults: the broker restarted while jobs run, and a short chaos run. Its own
//! test binary, because it restarts the services the tests use (cargo runs test binaries one
//! after another); its tests take turns.
//!
//! They act on the instance the tests use, chosen by environment variables (`.ci/run` brings up
//! one of its own): `rabbitmqctl` follows `RABBITMQ_NODENAME`, Garage is found by
//! `SANDQ_GARAGE_DIR` ([`kill_garage`]), and `scripts/services.sh` inherits all of them.

use std::process::Command;
use std::time::Duration;

use sandq_schemas::{JobStatus, Sku};
use sandq_tests::{bin_dir, exits_within, kill_garage, python_job, restart_services, wait, wait_for_status, worker_data_dir, Isolated};
use tokio::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::const_new(());

/// Runs `rabbitmqctl` on the tests' node (`RABBITMQ_NODENAME` when set, else the default node).
fn rabbitmqctl(args: &[&str]) {
    let status = Command::new("rabbitmqctl").args(args).status().expect("rabbitmqctl");
    assert!(status.success(), "rabbitmqctl {args:?} failed");
}

#[tokio::test]
async fn a_broker_restart_loses_no_job() {
    let _serial = SERIAL.lock().await;
    let world = Isolated::new().await;
    let mut worker = world.start_worker(&format!("{}-w", world.namespace), &[]);
    let mut client = world.client().await;
    let mut jobs = Vec::new();
    for i in 0..10 {
        let sku = if i % 2 == 0 { Sku::S } else { Sku::M };
        let spec = python_job(&format!("import time\ntime.sleep(0.5)\nprint({i})\n"), sku);
        client.submit(&spec).await.expect("submit");
        jobs.push((i, spec.job_id));
    }
    wait_for_status(&mut client, &jobs[0].1, JobStatus::Running, Duration::from_secs(30)).await;
    rabbitmqctl(&["stop_app"]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    rabbitmqctl(&["start_app"]);
    rabbitmqctl(&["await_startup"]);
    for (i, id) in &jobs {
        let result = wait(&mut client, id).await;
        assert_eq!(result.status, JobStatus::Succeeded, "job {i}: {result:?}");
        assert_eq!(result.stdout.text, format!("{i}\n"));
    }
    assert!(matches!(worker.try_wait(), Ok(None)), "the worker died with the broker");
    // The client reconnects by itself too.
    let spec = python_job("print('after the restart')", Sku::S);
    let result = sandq_tests::run(&mut client, &spec).await;
    assert_eq!(result.stdout.text, "after the restart\n");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    // Jobs aborted when the connection dropped left no job dir or mount behind.
    let jobs_dir = worker_data_dir().join(format!("{}-w", world.namespace));
    let left: Vec<_> = std::fs::read_dir(&jobs_dir).expect("jobs dir").flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "job dirs left after the broker restart: {left:?}");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    assert!(!mounts.contains(&*jobs_dir.to_string_lossy()), "a work filesystem is still mounted");
    world.delete_queues().await;
}

/// The CI-sized chaos run (`sandq-loadtest`; the full one is in docs/benchmarks.md): 60 jobs
/// through 3 workers, one SIGKILLed and restarted every 3 s, RabbitMQ restarted once and the
/// run's Redis restarted once. Every job must end with exactly one terminal result. Beside
/// them, 5 jobs whose result is kept and 5 whose result expires after 1 s go through a gateway
/// of the run, and are submitted again once over: each answers its result or 410
/// `result-expired`, none runs again, and each was counted once against its key.
#[tokio::test]
async fn a_short_chaos_run_loses_no_job() {
    let _serial = SERIAL.lock().await;
    let output = tokio::process::Command::new(bin_dir().join("sandq-loadtest"))
        .args(["--jobs", "60", "--workers", "3", "--rate", "10", "--kill-every", "3s"])
        .args(["--broker-restart-at", "4s", "--redis-restart-at", "7s", "--timeout", "5m", "--resubmit", "5", "--json"])
        .output()
        .await
        .expect("sandq-loadtest");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let report: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("no report ({e}): {stdout}\n{}", String::from_utf8_lossy(&output.stderr)));
    assert_eq!(report["submitted"], 60, "{report}");
    assert_eq!(report["lost"], 0, "{report}");
    assert_eq!(report["wrong_output"], 0, "{report}");
    assert_eq!(report["succeeded"], 60, "every job of this run should succeed: {report}");
    assert!(report["worker_kills"].as_u64().unwrap_or(0) >= 1, "{report}");
    assert_eq!(report["broker_restarts"], 1, "{report}");
    assert_eq!(report["redis_restarts"], 1, "{report}");
    let resubmitted = &report["resubmitted"];
    assert_eq!(resubmitted["jobs"], 10, "{report}");
    for field in ["not_accepted", "wrong_answer", "ran_again", "never_ran", "miscounted", "counted_by_resubmissions", "in_flight_mismatch"]
    {
        assert_eq!(resubmitted[field], 0, "{field}: {report}");
    }
    assert!(output.status.success());
}

/// S3 (Garage) down while a job stages its input: the job waits out the outage (the S3
/// client's retries, then requeues with backoff) and succeeds once S3 is back.
#[tokio::test]
async fn an_s3_outage_delays_jobs_but_loses_none() {
    let _serial = SERIAL.lock().await;
    let world = Isolated::new().await;
    let mut worker = world.start_worker_ready(&format!("{}-w", world.namespace), &[("SANDQ__WORKER__MAX_ATTEMPTS", "4")]);
    let mut client = world.client().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("numbers.txt");
    std::fs::write(&data, format!("{}\n", uuid::Uuid::new_v4())).expect("write");
    let input = client.upload(&data, "numbers.txt").await.expect("upload");
    let expected = std::fs::read_to_string(&data).expect("read");
    // SIGKILL: an outage as a crash (a SIGTERMed Garage lingers up to 10 s draining).
    assert!(kill_garage(), "garage was not running");
    let mut spec = python_job("print(open('numbers.txt').read(), end='')", Sku::S);
    spec.inputs = vec![input];
    client.submit(&spec).await.expect("submit");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let restarting_ms = sandq_core::time::now_ms();
    assert!(restart_services(), "garage did not come back");
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    // Staging needed S3, so the job can only have finished after Garage came back (the S3
    // client's own retries or a requeue with backoff bridged the outage).
    assert!(result.finished_at_ms.expect("finished") > restarting_ms, "finished during the outage? {result:?}");
    assert_eq!(result.stdout.text, expected);
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// S3 down for longer than every attempt: the job gets `internal_error` with the reason and is
/// dead-lettered, after `worker.max_attempts` attempts with backoff; never an endless loop.
#[tokio::test]
async fn a_job_that_keeps_failing_on_infrastructure_is_dead_lettered_with_internal_error() {
    let _serial = SERIAL.lock().await;
    let world = Isolated::new().await;
    let port = sandq_tests::free_port();
    let metrics_addr = format!("127.0.0.1:{port}");
    let mut worker = world.start_worker_ready(
        &format!("{}-w", world.namespace),
        &[("SANDQ__WORKER__MAX_ATTEMPTS", "2"), ("SANDQ__WORKER__METRICS_ADDR", &metrics_addr)],
    );
    let mut client = world.client().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data.txt");
    std::fs::write(&data, "x").expect("write");
    let input = client.upload(&data, "data.txt").await.expect("upload");
    assert!(kill_garage(), "garage was not running");
    let mut spec = python_job("print(1)", Sku::S);
    spec.inputs = vec![input];
    client.submit(&spec).await.expect("submit");
    // Not the panicking harness wait: Garage must come back whatever happens.
    let result = client.wait(&spec.job_id, Duration::from_secs(240), Duration::from_secs(1), |_| {}).await;
    assert!(restart_services(), "garage did not come back");
    let result = result.expect("no result within 4 minutes");
    assert_eq!(result.status, JobStatus::InternalError, "{result:?}");
    assert_eq!(result.attempt, 2);
    assert!(result.reason.as_deref().unwrap_or_default().contains("gave up after 2 attempts"), "{result:?}");
    // Dead-lettered, then seen by the dead-letter consumer with its result already stored.
    let series = r#"sandq_dead_letters_total{reason="rejected",action="already_final"}"#;
    let dead = sandq_tests::wait_for_metric(port, series, 1.0, Duration::from_secs(30)).await;
    assert!((dead - 1.0).abs() < 0.5, "the job was not dead-lettered once: {dead}");
    let after = client.status(&spec.job_id).await.expect("status").expect("result");
    assert_eq!(after, result, "the dead-letter consumer changed a terminal result");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// A short `sandq-loadtest throughput` run (the full one is in docs/benchmarks.md): every job
/// succeeds, the report's numbers agree with each other and with its per-job rows, and the
/// plots are PNG files. Its speed is not asserted. Here because it needs the broker undisturbed
/// (this binary's tests take turns).
#[tokio::test]
async fn a_short_throughput_run_writes_its_report_and_plots() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let output = tokio::process::Command::new(bin_dir().join("sandq-loadtest"))
        .args(["throughput", "--jobs", "12", "--concurrency", "3", "--mode", "script", "--json", "--report"])
        .arg(dir.path())
        .output()
        .await
        .expect("sandq-loadtest");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let report: serde_json::Value =
        serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("no report ({e}): {stdout}\n{}", String::from_utf8_lossy(&output.stderr)));
    assert!(output.status.success(), "{report}");
    assert_eq!(report["jobs"], 12, "{report}");
    assert_eq!(report["statuses"]["succeeded"], 12, "{report}");
    assert_eq!(report["unfinished"], 0, "{report}");
    assert!(report["jobs_per_second"].as_f64().unwrap_or(0.0) > 0.0, "{report}");
    // Percentiles from the per-job rows, computed here.
    let csv = std::fs::read_to_string(dir.path().join("jobs.csv")).expect("jobs.csv");
    let mut latencies: Vec<u64> = csv
        .lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            f[4].parse::<u64>().expect("finished_ms") - f[2].parse::<u64>().expect("submitted_ms")
        })
        .collect();
    latencies.sort_unstable();
    assert_eq!(latencies.len(), 12);
    let p = &report["submitted_to_finished_ms"];
    assert_eq!(p["max"], latencies[11], "{report}");
    assert_eq!(p["p50"], latencies[5], "nearest rank: the 6th of 12: {report}");
    for p in ["submitted_to_finished_ms", "queue_wait_ms", "run_ms"] {
        let v = &report[p];
        assert!(
            v["p50"].as_u64() <= v["p90"].as_u64() && v["p90"].as_u64() <= v["p99"].as_u64() && v["p99"].as_u64() <= v["max"].as_u64(),
            "{p}: {report}"
        );
    }
    for plot in ["latency.png", "throughput.png"] {
        let bytes = std::fs::read(dir.path().join(plot)).expect(plot);
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{plot} is a PNG");
        assert_eq!(u32::from_be_bytes(bytes[16..20].try_into().expect("width")), 900, "{plot}");
    }
}
