//! Delivery guarantees with real workers that the tests start, stop and kill: cancellation,
//! deadlines, unknown ids, graceful shutdown, redelivery after a worker is SIGKILLed, and
//! duplicates. A second delivery of a job (a client's retried publish after a lost confirm, or
//! the broker's redelivery after it closed a channel) never changes the result of the attempt
//! that ran; a deadline binds only a job no attempt has started, and is checked again after
//! every wait. `tests/delivery/` holds scripts that reproduce duplicates by hand (its README).

use std::time::Duration;

use sandq_core::time::now_ms;
use sandq_schemas::{JobStatus, Sku};
use sandq_tests::{exits_within, python_job, signal, wait, wait_for_status, worker_data_dir, worker_state_dir, Isolated, RawPublisher};

/// Sleeps `seconds` on the first delivery attempt, then prints its attempt number.
fn sleeps_on_first_attempt(seconds: u32) -> String {
    format!(
        "import os, time\nprint('attempt', os.environ['SANDQ_ATTEMPT'], flush=True)\n\
         if os.environ['SANDQ_ATTEMPT'] == '1':\n    time.sleep({seconds})\nprint('done')\n"
    )
}

#[tokio::test]
async fn a_running_job_is_cancelled_within_a_second() {
    let world = Isolated::new().await;
    let mut worker = world.start_worker(&format!("{}-w", world.namespace), &[]);
    let mut client = world.client().await;
    let spec = python_job("import time\nprint('started', flush=True)\ntime.sleep(60)\n", Sku::S);
    client.submit(&spec).await.expect("submit");
    wait_for_status(&mut client, &spec.job_id, JobStatus::Running, Duration::from_secs(30)).await;
    // Time for the program to print (a cold start beside the worker's first warm-ups).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let asked = now_ms();
    assert!(client.cancel(&spec.job_id).await.expect("cancel"));
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Cancelled, "{result:?}");
    assert_eq!(result.stdout.text, "started\n", "output up to the kill is kept");
    let took = result.finished_at_ms.expect("finished") - asked;
    assert!(took < 5_000, "cancellation took {took} ms");
    assert!(!client.cancel(&spec.job_id).await.expect("cancel"), "a finished job cannot be cancelled");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

#[tokio::test]
async fn a_queued_job_is_cancelled_without_running() {
    let world = Isolated::new().await;
    // No worker yet: the job stays queued.
    let mut client = world.client().await;
    let spec = python_job("open('/work/ran', 'w').write('x')\nprint('ran')\n", Sku::S);
    client.submit(&spec).await.expect("submit");
    assert_eq!(client.status(&spec.job_id).await.expect("status").map(|r| r.status), Some(JobStatus::Queued));
    assert!(client.cancel(&spec.job_id).await.expect("cancel"));
    let mut worker = world.start_worker(&format!("{}-w", world.namespace), &[]);
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Cancelled);
    assert!(result.usage.is_none() && result.stdout.text.is_empty() && result.artifacts.is_empty(), "it ran: {result:?}");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

#[tokio::test]
async fn a_job_past_its_deadline_expires_unrun_and_unknown_ids_are_unknown() {
    let world = Isolated::new().await;
    let mut worker = world.start_worker(&format!("{}-w", world.namespace), &[]);
    let mut client = world.client().await;
    let mut spec = python_job("print('ran')", Sku::S);
    spec.deadline_ms = Some(now_ms() - 1);
    client.submit(&spec).await.expect("submit");
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Expired);
    assert!(result.stdout.text.is_empty());
    let mut fresh = python_job("print('ran')", Sku::S);
    fresh.deadline_ms = Some(now_ms() + 600_000);
    let result = sandq_tests::run(&mut client, &fresh).await;
    assert_eq!(result.status, JobStatus::Succeeded);
    let unknown = uuid::Uuid::new_v4().to_string();
    assert!(client.status(&unknown).await.expect("status").is_none(), "an unknown id must not look pending");
    assert!(!client.cancel(&unknown).await.expect("cancel"));
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

#[tokio::test]
async fn sigterm_finishes_the_job_in_flight_then_exits() {
    let world = Isolated::new().await;
    let mut worker = world.start_worker(&format!("{}-w", world.namespace), &[("SANDQ__WORKER__SHUTDOWN_GRACE", "30s")]);
    let mut client = world.client().await;
    let spec = python_job("import time\ntime.sleep(2)\nprint('finished')\n", Sku::S);
    client.submit(&spec).await.expect("submit");
    wait_for_status(&mut client, &spec.job_id, JobStatus::Running, Duration::from_secs(30)).await;
    signal(&worker, "TERM");
    assert!(exits_within(&mut worker, Duration::from_secs(20)), "the worker did not exit after SIGTERM");
    let result = client.status(&spec.job_id).await.expect("status").expect("result");
    assert_eq!(result.status, JobStatus::Succeeded, "the in-flight job was not finished: {result:?}");
    assert_eq!(result.stdout.text, "finished\n");
    world.delete_queues().await;
}

#[tokio::test]
async fn sigterm_past_the_grace_period_requeues_the_job() {
    let world = Isolated::new().await;
    let mut first = world.start_worker(&format!("{}-a", world.namespace), &[("SANDQ__WORKER__SHUTDOWN_GRACE", "1s")]);
    let mut client = world.client().await;
    let spec = python_job(&sleeps_on_first_attempt(60), Sku::S);
    client.submit(&spec).await.expect("submit");
    wait_for_status(&mut client, &spec.job_id, JobStatus::Running, Duration::from_secs(30)).await;
    signal(&first, "TERM");
    assert!(exits_within(&mut first, Duration::from_secs(20)), "the worker did not exit after its grace period");
    let status = client.status(&spec.job_id).await.expect("status").map(|r| r.status);
    assert_eq!(status, Some(JobStatus::Running), "an interrupted job has no terminal result");
    let mut second = world.start_worker(&format!("{}-b", world.namespace), &[]);
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Succeeded);
    assert_eq!(result.attempt, 2);
    assert_eq!(result.stdout.text, "attempt 2\ndone\n");
    assert_eq!(result.worker_id, Some(format!("{}-b", world.namespace)));
    drop(second.stdin.take());
    assert!(exits_within(&mut second, Duration::from_secs(30)));
    world.delete_queues().await;
}

#[tokio::test]
async fn a_job_whose_worker_is_sigkilled_completes_on_another_worker() {
    let world = Isolated::new().await;
    let mut first = world.start_worker(&format!("{}-a", world.namespace), &[]);
    let mut client = world.client().await;
    let spec = python_job(&sleeps_on_first_attempt(60), Sku::S);
    client.submit(&spec).await.expect("submit");
    wait_for_status(&mut client, &spec.job_id, JobStatus::Running, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let first_id = format!("{}-a", world.namespace);
    let container_id = sandq_tests::container_id_in_log(&sandq_tests::isolated_worker_log(&first_id), &spec.job_id)
        .expect("the first worker logged the job's container id");
    signal(&first, "KILL");
    assert!(exits_within(&mut first, Duration::from_secs(5)));
    // The orphaned helper sees its control pipe close and kills the container.
    let started = std::time::Instant::now();
    loop {
        let left = std::fs::read_dir("/proc")
            .expect("/proc")
            .flatten()
            .filter(|e| std::fs::read_to_string(e.path().join("cgroup")).is_ok_and(|c| c.contains(&container_id)))
            .count();
        if left == 0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{left} processes of the job outlived its worker");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut second = world.start_worker(&format!("{}-b", world.namespace), &[]);
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.attempt, 2, "redelivered once");
    assert_eq!(result.stdout.text, "attempt 2\ndone\n");
    drop(second.stdin.take());
    assert!(exits_within(&mut second, Duration::from_secs(30)));
    // The killed worker, restarted under its id, removes what it left: the job dir with its
    // mounted work filesystem, container state, cgroups.
    assert!(std::fs::read_dir(worker_data_dir().join(&first_id)).expect("job dirs").next().is_some(), "nothing was left to clean");
    // No warm sandboxes for the restarted worker: the dirs checked below must hold only what
    // the killed worker left.
    let mut restarted = world.start_worker(&first_id, &[("SANDQ__WARM__PER_SKU", "0")]);
    let started = std::time::Instant::now();
    while !std::fs::read_to_string(std::env::temp_dir().join(format!("sandq-{first_id}-worker.log")))
        .unwrap_or_default()
        .contains("consuming")
    {
        assert!(started.elapsed() < Duration::from_secs(30), "the restarted worker did not start");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for dir in [worker_data_dir().join(&first_id), worker_state_dir().join(&first_id)] {
        assert_eq!(std::fs::read_dir(&dir).expect("dir").count(), 0, "{} not cleaned", dir.display());
    }
    for dir in ["/sys/fs/cgroup/memory/sandq", "/sys/fs/cgroup/pids/sandq", "/sys/fs/cgroup/sandq"] {
        let left = std::fs::read_dir(dir)
            .map(|d| d.flatten().filter(|e| e.file_name().to_string_lossy().contains(&container_id)).count())
            .unwrap_or(0);
        assert_eq!(left, 0, "cgroup of the job left in {dir}");
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    assert!(!mounts.contains(&first_id), "a mount of the killed worker is left");
    drop(restarted.stdin.take());
    assert!(exits_within(&mut restarted, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// Random and mutated MessagePack bodies through the real broker: every message ends as a
/// terminal result (when a job id can be read from the body or `message_id`) or dead-lettered
/// and counted by the dead-letter consumer, the worker never crashes or stalls, and the next
/// job runs.
#[tokio::test]
async fn fuzzed_messages_each_end_as_a_result_or_dead_letter() {
    use rand::{Rng, SeedableRng};
    let world = Isolated::new().await;
    let port = sandq_tests::free_port();
    let metrics_addr = format!("127.0.0.1:{port}");
    let mut worker = world.start_worker(&format!("{}-w", world.namespace), &[("SANDQ__WORKER__METRICS_ADDR", &metrics_addr)]);
    let mut client = world.client().await;
    // SANDQ_TEST_FUZZ_SEED=<hex> replays a run that failed (its seed is in every message).
    let seed: u64 = std::env::var("SANDQ_TEST_FUZZ_SEED")
        .ok()
        .and_then(|s| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok())
        .unwrap_or_else(rand::random);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let valid = sandq_schemas::encode(&python_job("print(1)", Sku::S)).expect("encode");
    let mut expect_results = Vec::new();
    let mut expect_dead = 0usize;
    let publisher = sandq_tests::RawPublisher::new(&world.config).await;
    const MESSAGES: usize = 2000;
    for i in 0..MESSAGES {
        let mut body: Vec<u8> = if i % 3 == 0 {
            (0..rng.random_range(0..200)).map(|_| rng.random()).collect()
        } else {
            let mut b = valid.clone();
            for _ in 0..rng.random_range(1..6) {
                let at = rng.random_range(0..b.len());
                match rng.random_range(0..3) {
                    0 => b[at] = rng.random(),
                    1 => b.truncate(at.max(1)),
                    _ => b.insert(at, rng.random()),
                }
            }
            b
        };
        if body.is_empty() {
            body.push(0xc1);
        }
        let message_id = (i % 2 == 0).then(|| format!("fuzz-{seed:x}-{i}"));
        // Where the result must land: the body's own job id if it has a readable one, else the
        // message id, else nowhere (dead-lettered).
        match sandq_schemas::peek_job_id(&body).or_else(|| message_id.clone()) {
            Some(id) => expect_results.push(id),
            None => expect_dead += 1,
        }
        publisher.publish(&body, Sku::S, message_id.as_deref()).await;
    }
    // Duplicate ids (the same valid body mutated twice) have one result: count distinct ids.
    expect_results.sort();
    expect_results.dedup();
    let started = std::time::Instant::now();
    for id in &expect_results {
        loop {
            let status = client.status(id).await.expect("status").map(|r| r.status);
            if status.is_some_and(JobStatus::is_terminal) {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(300), "seed {seed:x}: no terminal result for {id} ({status:?})");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // The worker dead-letters them, and its dead-letter consumer counts and drops them.
    let series = r#"sandq_dead_letters_total{reason="rejected",action="no_job_id"}"#;
    #[allow(clippy::cast_precision_loss)]
    let dead = sandq_tests::wait_for_metric(port, series, expect_dead as f64, Duration::from_secs(60)).await;
    #[allow(clippy::cast_precision_loss)]
    let expected = expect_dead as f64;
    assert!((dead - expected).abs() < 0.5, "seed {seed:x}: dead-lettered messages without an id: {dead}, expected {expect_dead}");
    assert!(matches!(worker.try_wait(), Ok(None)), "seed {seed:x}: the worker died");
    let result = sandq_tests::run(&mut client, &python_job("print('still fine')", Sku::S)).await;
    assert_eq!(result.stdout.text, "still fine\n");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// A job the broker cannot route (its SKU queue is gone) is not reported as queued: the client
/// gets an error and the job id stays unknown.
#[tokio::test]
async fn an_unroutable_job_is_refused_not_queued() {
    let world = Isolated::new().await;
    let mut client = world.client().await;
    world.delete_queues().await;
    let spec = python_job("print(1)", Sku::M);
    let err = client.submit(&spec).await.expect_err("an unroutable job must be refused");
    assert!(matches!(err, sandq_client::ClientError::NotAccepted { .. }), "{err}");
    assert!(client.status(&spec.job_id).await.expect("status").is_none(), "reported as queued");
}

/// A second delivery of a finished job (a duplicate publish) is acked without running again,
/// and the terminal result does not change.
#[tokio::test]
async fn a_duplicate_delivery_does_not_run_again() {
    let world = Isolated::new().await;
    let mut worker = world.start_worker(&format!("{}-w", world.namespace), &[]);
    let mut client = world.client().await;
    let spec = python_job("import uuid\nprint(uuid.uuid4())\n", Sku::S);
    let first = sandq_tests::run(&mut client, &spec).await;
    assert_eq!(first.status, JobStatus::Succeeded);
    let publisher = sandq_tests::RawPublisher::new(&world.config).await;
    publisher.publish(&sandq_schemas::encode(&spec).expect("encode"), Sku::S, Some(&spec.job_id)).await;
    // A marker job behind it on the same queue: when it is done, the duplicate was handled.
    let marker = sandq_tests::run(&mut client, &python_job("print('marker')", Sku::S)).await;
    assert_eq!(marker.status, JobStatus::Succeeded);
    let after = client.status(&spec.job_id).await.expect("status").expect("result");
    assert_eq!(after, first, "the terminal result changed");
    let log = std::fs::read_to_string(std::env::temp_dir().join(format!("sandq-{}-w-worker.log", world.namespace))).expect("log");
    assert!(log.contains("already has a terminal result"), "the duplicate was not recognised");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// Slots never oversubscribe the declared capacity: with 1 core declared and two SKU S slots,
/// two S jobs (1 core each) run one after the other.
#[tokio::test]
async fn jobs_never_exceed_the_declared_capacity() {
    let world = Isolated::new().await;
    let env = [
        ("SANDQ__WORKER__CAPACITY_CPUS", "1"),
        ("SANDQ__SKUS__S__SLOTS", "2"),
        ("SANDQ__SKUS__S__CPUS", "1"),
        ("SANDQ__SKUS__S__MEMORY_BYTES", "536870912"),
    ];
    let mut worker = world.start_worker(&format!("{}-w", world.namespace), &env);
    let mut client = world.client().await;
    let specs: Vec<_> = (0..2).map(|_| python_job("import time\ntime.sleep(1)\n", Sku::S)).collect();
    for spec in &specs {
        client.submit(spec).await.expect("submit");
    }
    let mut results = Vec::new();
    for spec in &specs {
        results.push(wait(&mut client, &spec.job_id).await);
    }
    results.sort_by_key(|r| r.started_at_ms);
    let (first, second) = (&results[0], &results[1]);
    assert!(
        second.started_at_ms.expect("started") >= first.finished_at_ms.expect("finished"),
        "two 1-core jobs overlapped on a 1-core capacity: {first:?} {second:?}"
    );
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// Where the second delivery of a running job is taken.
#[derive(Debug, Clone, Copy)]
enum Layout {
    /// Another slot of the worker running the first attempt (one worker, two S slots).
    SameWorker,
    /// Another worker (two workers of one S slot each): it cannot tell the first attempt from
    /// one whose worker died.
    OtherWorker,
}

/// Starts the workers of `layout` in `world`, with `extra` settings.
fn start_workers(world: &Isolated, layout: Layout, extra: &[(&'static str, &'static str)]) -> Vec<std::process::Child> {
    match layout {
        Layout::SameWorker => vec![world.start_worker_ready(&format!("{}-w", world.namespace), &sandq_tests::small_worker_env(extra))],
        Layout::OtherWorker => {
            // Disjoint user namespace ranges (64 ranges apart), as workers sharing a host need.
            let base = std::env::var("SANDQ__WORKER__USERNS_HOST_BASE").ok().and_then(|v| v.parse::<u32>().ok()).unwrap_or(0x7000_0000);
            let bases = [base.to_string(), (base + 64 * 65_536).to_string()];
            bases
                .iter()
                .enumerate()
                .map(|(i, base)| {
                    let mut env: Vec<(&str, &str)> = sandq_tests::small_worker_env(extra);
                    env.push(("SANDQ__SKUS__S__SLOTS", "1"));
                    env.push(("SANDQ__WORKER__USERNS_HOST_BASE", base.as_str()));
                    world.start_worker_ready(&format!("{}-w{i}", world.namespace), &env)
                })
                .collect()
        }
    }
}

/// Stops `workers` (each within 40 s).
fn stop_workers(workers: Vec<std::process::Child>) {
    for mut worker in workers {
        drop(worker.stdin.take());
        assert!(exits_within(&mut worker, Duration::from_secs(40)));
    }
}

/// A job's `deadline_ms` is its latest *start*. A second delivery (a client's retried publish,
/// or the broker's redelivery after it closed the first delivery's channel) taken after the
/// deadline, while the first attempt runs, must not store `expired`: the program's own result
/// would then lose the compare-and-set and be dropped. The duplicate is taken by another slot
/// of the same worker, then by another worker.
#[tokio::test]
async fn a_duplicate_taken_after_the_deadline_does_not_expire_a_running_job() {
    for layout in [Layout::SameWorker, Layout::OtherWorker] {
        duplicate_after_the_deadline(layout).await;
    }
}

async fn duplicate_after_the_deadline(layout: Layout) {
    let world = Isolated::new().await;
    let workers = start_workers(&world, layout, &[]);
    let mut client = world.client().await;
    let mut spec = python_job("import time\nprint('started', flush=True)\ntime.sleep(15)\nprint('finished')\n", Sku::S);
    let deadline = now_ms() + 5_000;
    spec.deadline_ms = Some(deadline);
    client.submit(&spec).await.expect("submit");
    wait_for_status(&mut client, &spec.job_id, JobStatus::Running, Duration::from_secs(30)).await;
    // The job started in time; the duplicate comes after its deadline, while it still runs.
    tokio::time::sleep(Duration::from_millis(deadline.saturating_sub(now_ms()) + 1_000)).await;
    let body = sandq_schemas::encode(&spec).expect("encode");
    RawPublisher::new(&world.config).await.publish(&body, Sku::S, Some(&spec.job_id)).await;
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(
        (result.status, result.stdout.text.as_str()),
        (JobStatus::Succeeded, "started\nfinished\n"),
        "{layout:?}: the job started before its deadline and ran to its end, yet its result is {:?} ({:?})",
        result.status,
        result.reason
    );
    stop_workers(workers);
    world.delete_queues().await;
}

/// A second delivery of a running session job waits for the session's lock, which its own first
/// attempt holds; it must not store `rejected` ("session ... is in use by another job") once
/// `sessions.lock_wait` passes, while the first attempt goes on to save the session: the client
/// would be told the cell was rejected though the session holds its effects, and re-running it
/// would apply them twice. The duplicate is handed back instead, and finds the real result.
#[tokio::test]
async fn a_duplicate_of_a_running_session_job_does_not_reject_it() {
    for layout in [Layout::SameWorker, Layout::OtherWorker] {
        duplicate_of_a_session_job(layout).await;
    }
}

async fn duplicate_of_a_session_job(layout: Layout) {
    let world = Isolated::new().await;
    let workers = start_workers(&world, layout, &[("SANDQ__SESSIONS__LOCK_WAIT", "3s")]);
    let mut client = world.client().await;
    let session = format!("s-{}", uuid::Uuid::new_v4());
    let mut spec = python_job(
        "import pathlib, time\npathlib.Path('/work/ran.txt').write_text('x')\nprint('started', flush=True)\ntime.sleep(12)\nprint('finished')\n",
        Sku::S,
    );
    spec.session = Some(session.clone());
    client.submit(&spec).await.expect("submit");
    wait_for_status(&mut client, &spec.job_id, JobStatus::Running, Duration::from_secs(30)).await;
    let body = sandq_schemas::encode(&spec).expect("encode");
    RawPublisher::new(&world.config).await.publish(&body, Sku::S, Some(&spec.job_id)).await;
    let result = wait(&mut client, &spec.job_id).await;
    // The session's next cell sees what the first attempt left (once that attempt has let the
    // session go: until then the cell is rejected as busy, and tried again).
    let mut after = None;
    for _ in 0..15 {
        let mut next = python_job("import os\nprint(sorted(os.listdir('/work')))\n", Sku::S);
        next.session = Some(session.clone());
        let ran = sandq_tests::run(&mut client, &next).await;
        if ran.status != JobStatus::Rejected {
            after = Some(ran);
            break;
        }
    }
    let after = after.expect("the session stayed busy");
    assert_eq!(after.stdout.text, "['ran.txt']\n", "the first attempt's session save");
    assert_eq!(
        (result.status, result.stdout.text.as_str()),
        (JobStatus::Succeeded, "started\nfinished\n"),
        "{layout:?}: the session kept the job's effects (next cell: execution_count {:?}), yet its result is {:?} ({:?})",
        after.execution_count,
        result.status,
        result.reason
    );
    stop_workers(workers);
    world.delete_queues().await;
}

/// `deadline_ms` is "latest start: a job still queued then is not run" (docs/protocol.md), and a
/// job waiting for the worker's capacity is still `queued`: a deadline that passes during that
/// wait (or a session wait) is checked again when it ends, and the job expires unrun.
#[tokio::test]
async fn a_job_whose_deadline_passes_while_it_waits_for_capacity_does_not_run() {
    let world = Isolated::new().await;
    // Capacity for one S job at a time, two S slots: the second job waits, `queued`.
    let mut worker = world
        .start_worker_ready(&format!("{}-w", world.namespace), &sandq_tests::small_worker_env(&[("SANDQ__WORKER__CAPACITY_CPUS", "1")]));
    let mut client = world.client().await;
    let first = python_job("import time\ntime.sleep(10)\n", Sku::S);
    client.submit(&first).await.expect("submit");
    wait_for_status(&mut client, &first.job_id, JobStatus::Running, Duration::from_secs(30)).await;
    let mut late = python_job("print('ran')\n", Sku::S);
    late.deadline_ms = Some(now_ms() + 3_000);
    client.submit(&late).await.expect("submit");
    let result = wait(&mut client, &late.job_id).await;
    let started = result.started_at_ms.unwrap_or(0);
    assert_eq!(
        result.status,
        JobStatus::Expired,
        "it started {} ms after its deadline (stdout {:?})",
        started.saturating_sub(late.deadline_ms.unwrap_or(0)),
        result.stdout.text
    );
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(40)));
    world.delete_queues().await;
}
