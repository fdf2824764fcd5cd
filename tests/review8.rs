//! Reproductions of the eighth security review's findings (issue 14; report in the session that
//! added this file). Each test fails until its finding is fixed: it states what should happen.
//!
//! Both findings are of the kind "no second delivery of a job changes a finished job": a second
//! delivery of a job whose first attempt is still running stores a terminal result of its own
//! that never ran the program, and the real result, which comes later, loses the
//! compare-and-set and is dropped with its artifacts and logs. The second delivery is an
//! ordinary one: the client's own retry after a lost confirm (`Client::submit` publishes again,
//! "at-least-once execution and the result's compare-and-set absorb that"), or the broker's
//! redelivery after a `consumer_timeout` closed the first delivery's channel (seventh review T2:
//! the first attempt then runs on). Here it is published as the broker would deliver it.
//!
//! U3 is of the same "re-check after every wait" kind: a deadline passing during the capacity
//! wait is not seen.
//!
//! R1 is of the kind "the worker's own memory is bounded whatever untrusted data holds": a
//! record a client writes to Redis is read and decoded whole.
//!
//! W2 is of the warm-sandbox kind: a job handed a warm sandbox gets less of its SKU's memory
//! than the same job started cold (the warm-up's preload is charged to it).

use std::time::Duration;

use sandq_schemas::{JobStatus, Sku};
use sandq_submitter::client::now_ms;
use sandq_tests::{exits_within, python_job, wait, wait_for_status, Isolated, RawPublisher};

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

/// U2: a job's `deadline_ms` is its latest *start*. A second delivery taken after it, while
/// the first attempt runs, stores `expired` ("its deadline passed ... before a worker took
/// it"), and the program's own result is then dropped.
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

/// U1: a second delivery of a running session job waits for the session's lock, which its own
/// first attempt holds; after `sessions.lock_wait` it stores `rejected` ("session ... is in use
/// by another job"). The first attempt then saves the session (its files and execution count
/// move on) but its result is dropped: the client is told the cell was rejected though the
/// session holds its effects, and re-running it applies them twice.
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

/// U3: `deadline_ms` is "latest start: a job still queued then is not run" (docs/protocol.md),
/// and a job waiting for the worker's capacity is still `queued`; but the deadline is checked
/// only when the delivery is taken, not after the capacity (or session) wait, so the job runs
/// after it.
#[tokio::test]
async fn a_job_whose_deadline_passes_while_it_waits_for_capacity_does_not_run() {
    let world = Isolated::new().await;
    // Capacity for one S job at a time, two S slots: the second job waits, `queued`.
    let mut worker = world.start_worker_ready(&format!("{}-w", world.namespace), &sandq_tests::small_worker_env(&[("SANDQ__WORKER__CAPACITY_CPUS", "1")]));
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

/// R1: a client writes its job's `queued` record itself, through the compare-and-set script,
/// with whatever bytes it likes (docs/protocol.md: "A client writes only `queued`"). The
/// worker reads that record whole (`results::read`: `HGET`, then decodes it) when it takes the
/// job, after every wait, and in the dead-letter consumer. A 100 MB record (Redis allows 512
/// MB) costs the worker over twice that in peak memory; a few such jobs at once exhaust it.
#[tokio::test]
async fn a_huge_client_written_record_costs_the_worker_little_memory() {
    let world = Isolated::new().await;
    let worker = world.start_worker_ready(&format!("{}-w", world.namespace), &sandq_tests::small_worker_env(&[]));
    let mut client = world.client().await;
    // The worker's baseline, once it has run a job.
    let first = sandq_tests::run(&mut client, &python_job("print(1)", Sku::S)).await;
    assert_eq!(first.status, JobStatus::Succeeded);
    let (peak_before, _) = sandq_tests::process_usage(worker.id());
    let spec = python_job("print('ok')", Sku::S);
    let mut record = sandq_schemas::JobResult::new(spec.job_id.clone(), JobStatus::Queued);
    record.reason = Some("x".repeat(100 << 20));
    // Written as a client writes its `queued` record (the compare-and-set script), on a plain
    // connection with no response timeout (100 MiB take a while).
    let names = sandq_schemas::names::Names::new(world.namespace.clone());
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
    let mut redis = redis::Client::open(world.config.redis.url.as_str())
        .expect("redis")
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .expect("redis");
    let written: i64 = redis::Script::new(sandq_submitter::results::CAS_SCRIPT)
        .key(names.job_key(&spec.job_id))
        .key(names.done_key(&spec.job_id))
        .arg("queued")
        .arg(sandq_schemas::encode(&record).expect("encode"))
        .arg(600)
        .invoke_async(&mut redis)
        .await
        .expect("write");
    let written = written == 1;
    assert!(written, "the client's queued record");
    client.submit(&spec).await.expect("submit");
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Succeeded);
    let (peak_after, _) = sandq_tests::process_usage(worker.id());
    let grown = peak_after.saturating_sub(peak_before);
    let mut worker = worker;
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(40)));
    world.delete_queues().await;
    assert!(grown < 32 << 20, "a 100 MiB record grew the worker's peak memory by {} MiB", grown >> 20);
}

/// Runs `spec` (made afresh each time) until its result's `sandbox.warm` is `warm`.
async fn run_until(client: &mut sandq_submitter::Client, make: impl Fn() -> sandq_schemas::JobSpec, warm: bool) -> sandq_schemas::JobResult {
    for _ in 0..60 {
        let result = sandq_tests::run(client, &make()).await;
        if result.sandbox.is_some_and(|s| s.warm == warm) {
            return result;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    panic!("no {} start", if warm { "warm" } else { "cold" });
}

/// W2: docs/protocol.md (Warm starts) says a warm sandbox has the same limits as a cold one, and
/// `warm::eligible` takes only jobs it can serve "exactly as a cold start would". But the
/// warm-up's preload (numpy, pandas, matplotlib: about 100 MiB resident) is in the job's memory
/// cgroup: a job that fits its SKU's memory cold is OOM-killed warm. (Its `usage.cpu_ms` and
/// `peak_memory_bytes` also count the warm-up: W1, `tests/review8/warm_usage.sh`.)
#[tokio::test]
async fn a_warm_start_leaves_the_job_the_memory_of_a_cold_one() {
    let world = Isolated::new().await;
    // Set after worker_env's `0` (the later value of a variable wins).
    let env = sandq_tests::small_worker_env(&[("SANDQ__WARM__PER_SKU", "1"), ("SANDQ__WARM__RUNTIMES", "python")]);
    let mut worker = world.start_worker_ready(&format!("{}-w", world.namespace), &env);
    let mut client = world.client().await;
    // 440 MiB touched, of S's 512 MiB (memory + swap): what a cold start leaves a cell.
    let job = |cold: bool| {
        let mut spec = python_job("b = bytearray(440 << 20)\nfor i in range(0, len(b), 4096):\n    b[i] = 1\nprint(len(b) >> 20)\n", Sku::S);
        if cold {
            // Read by the interpreter at start-up: such a job always starts cold.
            spec.env.insert("TZ".into(), "UTC".into());
        }
        spec
    };
    let cold = run_until(&mut client, || job(true), false).await;
    assert_eq!((cold.status, cold.stdout.text.as_str()), (JobStatus::Succeeded, "440\n"), "{:?}", cold.reason);
    let warm = run_until(&mut client, || job(false), true).await;
    assert_eq!(
        (warm.status, warm.stdout.text.as_str()),
        (JobStatus::Succeeded, "440\n"),
        "the same job cold: succeeded (peak {:?}); warm: {:?} ({:?}, peak {:?})",
        cold.usage.map(|u| u.peak_memory_bytes),
        warm.status,
        warm.reason,
        warm.usage.map(|u| u.peak_memory_bytes)
    );
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(60)));
    world.delete_queues().await;
}


/// H1: the worker's AMQP client (lapin 4.12.3 / amq-protocol 10.6.3) parses a message's header
/// table recursively on its `lapin-io-loop` thread, without a depth limit: a message whose
/// headers nest tables a few thousand deep (28 KB; a content header may be 128 KiB) overflows
/// that thread's stack and aborts the whole worker (every running job is lost with it). Any
/// client that can publish sends one; the message stays in the queue, so the worker dies again
/// at every start, and after `amqp.delivery_limit` returns it sits in the dead-letter queue,
/// which every worker consumes: every worker of the namespace, whatever its SKUs, then dies at
/// every start until an operator purges it. Published here with a raw AMQP client
/// (`tests/review8/nested_headers.py`: a recursive encoder overflows first).
#[tokio::test]
async fn a_message_with_deeply_nested_headers_does_not_stop_the_worker() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let mut worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[]));
    let port = sandq_tests::service_port(&world.config.amqp.url).to_string();
    let exchange = sandq_schemas::names::Names::new(world.namespace.clone()).jobs_exchange();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("review8/nested_headers.py");
    let published = std::process::Command::new("python3")
        .args([script.to_str().expect("path"), "127.0.0.1", &port, &exchange, "S", "18000"])
        .output()
        .expect("python3");
    assert!(published.status.success(), "{}", String::from_utf8_lossy(&published.stderr));
    tokio::time::sleep(Duration::from_secs(10)).await;
    let exited = worker.try_wait().expect("try_wait");
    let log = sandq_tests::isolated_worker_log(&id);
    if exited.is_none() {
        drop(worker.stdin.take());
        assert!(exits_within(&mut worker, Duration::from_secs(40)));
    }
    world.delete_queues().await;
    assert!(exited.is_none(), "the worker exited ({exited:?}) on one message with nested headers; log tail:\n{}", log.lines().rev().take(3).collect::<Vec<_>>().join("\n"));
}

/// G1, G2: a sandbox opens at most 64 ptys (its devpts instance's `max=`), and the host tables
/// every sandbox draws from were raised at the worker's start so that the sandboxes' memory and
/// pids limits run out first. Sized for the node, not for one worker (thirteenth review
/// R13-6: several workers on a node left the tables at the largest one's need): `fs.file-max`
/// at least one file per 256 bytes of the node's memory (and of the worker's capacity, 64 GiB
/// here), `kernel.pid_max` and `kernel.pty.max` the kernel's largest (2^22, 2^20).
#[tokio::test]
async fn a_sandbox_takes_a_bounded_share_of_the_hosts_tables() {
    let world = Isolated::new().await;
    let mut worker = world.start_worker_ready(&format!("{}-w", world.namespace), &sandq_tests::small_worker_env(&[]));
    let read = |path: &str| std::fs::read_to_string(path).expect("sysctl").trim().parse::<u64>().expect("number");
    // Isolated workers get 64 GiB of capacity (harness); 2 S slots of 1024 pids.
    let mem_total_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .expect("meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .expect("MemTotal")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .expect("kB");
    assert!(read("/proc/sys/fs/file-max") >= (64u64 << 30) / 256);
    assert!(read("/proc/sys/fs/file-max") >= mem_total_kib * 1024 / 256);
    assert_eq!(read("/proc/sys/kernel/pid_max"), 1 << 22);
    assert_eq!(read("/proc/sys/kernel/pty/max"), 1 << 20);
    let mut client = world.client().await;
    let spec = python_job(
        "import os\nfds = []\ntry:\n    while len(fds) < 1000:\n        fds.append(os.openpty())\nexcept OSError as e:\n    print(len(fds), e.errno)\n",
        Sku::S,
    );
    let result = sandq_tests::run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    // ENOSPC (28) at the 65th.
    assert_eq!(result.stdout.text, "64 28\n", "{result:?}");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(40)));
    world.delete_queues().await;
}

/// R2: the tests' broker (configured by scripts/services.sh) takes no message over 16 MiB, so
/// that an oversized job body is refused by the broker rather than buffered whole by a worker.
#[test]
fn the_broker_refuses_messages_over_16_mib() {
    let out = std::process::Command::new("rabbitmqctl").args(["eval", "application:get_env(rabbit, max_message_size)."]).output().expect("rabbitmqctl");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "{ok,16777216}");
}
