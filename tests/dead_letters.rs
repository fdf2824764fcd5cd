//! No job waits forever (issue 13): a job no worker takes expires through the queue's TTL, a
//! job whose deliveries keep killing their worker ends `internal_error` at the delivery limit,
//! a message without a job id is counted and dropped, a cancelled job waiting for its
//! session's lock never runs, and queues an earlier version declared (without the TTL) keep
//! working.
//!
//! And the dead-letter consumer's verdicts hold against what anyone may publish or write: a
//! forged dead letter never ends a running job before its attempt must have ended, the check of
//! a running job is deferred to then (in Redis, so forged checks cannot crowd out a real one and
//! a check outlives its worker), and values a client wrote to Redis (a status that is not
//! UTF-8, a start time far ahead, a record of another type) neither stop the consumer nor loop
//! a dead letter ahead of the others. Each test starts and kills its own workers in a namespace
//! of its own.

use std::time::Duration;

use sandq_client::Client;
use sandq_schemas::names::Names;
use sandq_schemas::{JobResult, JobStatus, Sku};
use sandq_tests::{exits_within, poll_until, python_job, signal, wait, wait_for_status, Isolated, RawPublisher};

/// Worker settings that keep the tests quick: no warm sandboxes (nothing to drain when a worker
/// is killed), SKU S small.
const SMALL: [(&str, &str); 3] =
    [("SANDQ__WARM__PER_SKU", "0"), ("SANDQ__SKUS__S__MEMORY_BYTES", "536870912"), ("SANDQ__SKUS__S__CPUS", "1")];

/// Messages left in the dead-letter queue after up to 5 s for it to drain.
async fn drained(config: &sandq_core::config::ServiceConfig) -> usize {
    let started = std::time::Instant::now();
    loop {
        let left = sandq_tests::dead_letter_count(config, 0, Duration::ZERO).await;
        if left == 0 || started.elapsed() > Duration::from_secs(5) {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs `rabbitmqctl` on the tests' node (`RABBITMQ_NODENAME` when set).
fn rabbitmqctl(args: &[&str]) {
    let status = std::process::Command::new("rabbitmqctl").args(args).status().expect("rabbitmqctl");
    assert!(status.success(), "rabbitmqctl {args:?} failed");
}

fn env<'a>(extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    SMALL.iter().copied().chain(extra.iter().copied()).collect()
}

/// Runs the `sandq` CLI in `world`'s namespace (with its unserved TTL).
fn cli(world: &Isolated, ttl: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(sandq_tests::bin_dir().join("sandq"))
        .args(args)
        .env("SANDQ__NAMESPACE", &world.namespace)
        .env("SANDQ__QUEUES__UNSERVED_TTL", ttl)
        .output()
        .expect("sandq")
}

/// A job for a SKU no worker serves: the CLI says so on stderr at submission (or refuses it,
/// with `--refuse-unserved`, as the Rust client does with `Unserved::Refuse`), and the job
/// expires after `queues.unserved_ttl` with a reason saying no worker served its SKU.
#[tokio::test]
async fn a_job_for_an_unserved_sku_expires_with_a_reason() {
    let world = Isolated::with_config(|c| c.queues.unserved_ttl = Duration::from_secs(2)).await;
    // One core declared: serves S only (M, L and XL are larger); L's queue has no consumer.
    let extra = [("SANDQ__QUEUES__UNSERVED_TTL", "2s"), ("SANDQ__WORKER__CAPACITY_CPUS", "1")];
    let mut worker = world.start_worker_ready(&format!("{}-w", world.namespace), &env(&extra));
    let mut client = world.client().await;
    assert_eq!(client.consumers(Sku::L).await.expect("consumers"), 0);
    assert!(client.consumers(Sku::S).await.expect("consumers") > 0, "the worker consumes S");

    // Refused: nothing is published, the job is unknown.
    let refused = cli(&world, "2s", &["submit", "--sku", "L", "--refuse-unserved", "--id", "refused-l", "-c", "print(1)"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(125), "{stderr}");
    assert!(stderr.contains("no worker serves sku L right now"), "{stderr}");
    assert_eq!(client.status("refused-l").await.expect("status"), None, "a refused job was recorded");
    client.set_unserved(sandq_client::Unserved::Refuse);
    let refused = client.submit(&python_job("print(1)", Sku::L)).await;
    assert!(matches!(refused, Err(sandq_client::ClientError::Unserved { sku: Sku::L, .. })), "{refused:?}");
    // A served SKU passes the same check.
    let served = sandq_tests::run(&mut client, &python_job("print('served')", Sku::S)).await;
    assert_eq!(served.status, JobStatus::Succeeded, "{served:?}");

    // Warned, submitted.
    let submitted = sandq_core::time::now_ms();
    let out = cli(&world, "2s", &["submit", "--sku", "L", "-c", "open('/work/ran', 'w').write('x')\nprint('ran')\n"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("sandq: no worker serves SKU L right now; the job waits in the queue until one does, or expires after 2s"),
        "{stderr}"
    );
    let job_id = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert_eq!(client.status(&job_id).await.expect("status").map(|r| r.status), Some(JobStatus::Queued));
    // Of a served SKU, no warning.
    let out = cli(&world, "2s", &["submit", "--sku", "S", "-c", "print(2)"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !stderr.contains("no worker serves"), "{stderr}");

    let result = wait(&mut client, &job_id).await;
    assert_eq!(result.status, JobStatus::Expired, "{result:?}");
    assert_eq!(
        result.reason.as_deref(),
        Some("no worker took it within 2s (queues.unserved_ttl): no worker served its sku L (its queue had no consumer when it expired)")
    );
    assert_eq!(result.sku, Some(Sku::L));
    assert!(result.usage.is_none() && result.stdout.text.is_empty() && result.started_at_ms.is_none(), "it ran: {result:?}");
    let took = result.finished_at_ms.expect("finished") - submitted;
    assert!(took >= 2000, "expired after {took} ms, before its TTL");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// A job whose every delivery kills its worker (SIGKILLed by the test while the job runs) is
/// dead-lettered by the queue after the delivery limit, and the next worker's dead-letter
/// consumer gives it `internal_error` naming how many times it killed its worker.
#[tokio::test]
async fn a_poison_job_ends_internal_error_after_the_delivery_limit() {
    const LIMIT: u32 = 2;
    let world = Isolated::with_config(|c| c.amqp.delivery_limit = LIMIT).await;
    let limit = LIMIT.to_string();
    let extra = [("SANDQ__AMQP__DELIVERY_LIMIT", limit.as_str()), ("SANDQ__WORKER__MAX_ATTEMPTS", "1")];
    let mut client = world.client().await;
    let mut spec = python_job("import os, time\nprint('attempt', os.environ['SANDQ_ATTEMPT'], flush=True)\ntime.sleep(600)\n", Sku::S);
    spec.timeout = Some("15m".into());
    client.submit(&spec).await.expect("submit");
    // One worker id throughout: each start cleans up what the killed one left.
    let id = format!("{}-w", world.namespace);
    let mut kills = 0u32;
    let result = loop {
        assert!(kills <= LIMIT + 2, "still not dead-lettered after {kills} kills");
        let mut worker = world.start_worker_ready(&id, &env(&extra));
        let started = std::time::Instant::now();
        let current = loop {
            let current = client.status(&spec.job_id).await.expect("status").expect("result");
            if current.status.is_terminal() || (current.status == JobStatus::Running && current.attempt == kills + 1) {
                break current;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "after {kills} kills: {current:?}\n{}",
                sandq_tests::isolated_worker_log(&id)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        if current.status.is_terminal() {
            drop(worker.stdin.take());
            assert!(exits_within(&mut worker, Duration::from_secs(30)));
            break current;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        signal(&worker, "KILL");
        assert!(exits_within(&mut worker, Duration::from_secs(5)));
        kills += 1;
    };
    assert_eq!(result.status, JobStatus::InternalError, "{result:?}");
    let log = sandq_tests::isolated_worker_log(&id);
    assert!(log.contains(r#"dead_letter_reason="delivery_limit""#), "not written by the dead-letter consumer:\n{log}");
    // RabbitMQ dead-letters a message returned more than `x-delivery-limit` times.
    assert_eq!(kills, LIMIT + 1, "{result:?}");
    let reason = result.reason.as_deref().unwrap_or_default();
    assert!(reason.starts_with(&format!("its deliveries kept failing (killed its worker {kills} times)")), "{reason}");
    assert_eq!(result.attempt, kills, "the last running attempt is kept: {result:?}");
    assert_eq!(result.sku, Some(Sku::S));
    // The dead-letter queue is drained.
    assert_eq!(drained(&world.config).await, 0);
    // The worker restarted under the id cleans up what the last killed one left.
    let mut cleaner = world.start_worker_ready(&id, &env(&extra));
    drop(cleaner.stdin.take());
    assert!(exits_within(&mut cleaner, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// A cancel that lands while a taken job waits for its session's lock: the job never runs and
/// leaves the session as it was.
#[tokio::test]
async fn a_cancelled_job_waiting_on_a_session_lock_never_runs() {
    let world = Isolated::new().await;
    let mut worker = world.start_worker_ready(&format!("{}-w", world.namespace), &env(&[("SANDQ__SKUS__S__SLOTS", "2")]));
    let mut client = world.client().await;
    let session = uuid::Uuid::new_v4().to_string();
    let mut holder = python_job("import time\nopen('a.txt', 'w').write('a')\ntime.sleep(5)\n", Sku::S);
    holder.session = Some(session.clone());
    let mut waiter = python_job("open('b.txt', 'w').write('b')\nprint('ran')\n", Sku::S);
    waiter.session = Some(session.clone());
    client.submit(&holder).await.expect("submit");
    wait_for_status(&mut client, &holder.job_id, JobStatus::Running, Duration::from_secs(30)).await;
    client.submit(&waiter).await.expect("submit");
    // Taken by the second slot (no longer ready in the queue), and waiting: still queued.
    let started = std::time::Instant::now();
    while sandq_tests::ready_messages(&world.config, Sku::S).await > 0 {
        assert!(started.elapsed() < Duration::from_secs(10), "the second slot did not take the job");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(client.status(&waiter.job_id).await.expect("status").map(|r| r.status), Some(JobStatus::Queued));
    assert!(client.cancel(&waiter.job_id).await.expect("cancel"));
    let result = wait(&mut client, &waiter.job_id).await;
    assert_eq!(result.status, JobStatus::Cancelled, "{result:?}");
    assert!(result.usage.is_none() && result.stdout.text.is_empty() && result.sandbox.is_none(), "it ran: {result:?}");
    let held = wait(&mut client, &holder.job_id).await;
    assert_eq!(held.status, JobStatus::Succeeded, "{held:?}");
    assert!(result.finished_at_ms >= held.finished_at_ms, "it did not wait for the session: {result:?} {held:?}");
    let mut lister = python_job("import os\nprint(sorted(os.listdir('.')))\n", Sku::S);
    lister.session = Some(session);
    let listed = sandq_tests::run(&mut client, &lister).await;
    assert_eq!(listed.stdout.text, "['a.txt']\n", "the cancelled job changed the session");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// Queues declared by a version without the unserved TTL (the broker refuses to redeclare a
/// queue with other arguments): topology declaration reports them and goes on, the worker
/// warns and consumes, and clients submit to them.
#[tokio::test]
async fn queues_declared_by_an_earlier_version_keep_working() {
    // The namespace's queues declared as before issue 13: no x-message-ttl.
    let world = Isolated::with_config(|c| c.queues.unserved_ttl = Duration::ZERO).await;
    let mut current = world.config.clone();
    current.queues = sandq_core::config::QueuesConfig::default();
    let connection = lapin::Connection::connect(&current.amqp.url, lapin::ConnectionProperties::default()).await.expect("amqp");
    let names = sandq_schemas::names::Names::new(world.namespace.clone());
    let declared = sandq_core::topology::declare(&connection, &names, &current).await.expect("declare over old queues");
    let expected: Vec<String> = Sku::ALL.iter().map(|s| names.jobs_queue(*s)).collect();
    assert_eq!(declared.with_other_arguments, expected);
    let id = format!("{}-w", world.namespace);
    // Serves S only (one core declared).
    let mut worker = world.start_worker_ready(&id, &env(&[("SANDQ__WORKER__CAPACITY_CPUS", "1")]));
    assert!(sandq_tests::isolated_worker_log(&id).contains("queue exists with other arguments"), "no warning");
    let mut client = Client::connect(current).await.expect("a client declares over old queues");
    let result = sandq_tests::run(&mut client, &python_job("print('old queues')", Sku::S)).await;
    assert_eq!(result.stdout.text, "old queues\n", "{result:?}");
    // docs/operations.md's migration without re-creating the queues: a policy gives them a TTL,
    // and a job nobody takes then expires.
    let policy = format!("{}-unserved-ttl", world.namespace);
    let pattern = format!("^{}\\.jobs\\.(S|M|L|XL)$", world.namespace.replace('-', "\\-"));
    rabbitmqctl(&["set_policy", "--apply-to", "queues", &policy, &pattern, r#"{"message-ttl": 2000}"#]);
    let unserved = python_job("print('ran')", Sku::L);
    client.submit(&unserved).await.expect("submit");
    let expired = wait(&mut client, &unserved.job_id).await;
    rabbitmqctl(&["clear_policy", &policy]);
    assert_eq!(expired.status, JobStatus::Expired, "{expired:?}");
    assert!(expired.reason.as_deref().unwrap_or_default().starts_with("no worker took it within"), "{expired:?}");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// A dead-lettered message with no usable job id (neither body nor `message_id`) is counted
/// and dropped; one naming a job gets a result.
#[tokio::test]
async fn dead_letters_without_a_job_id_are_counted_and_dropped() {
    let world = Isolated::new().await;
    let port = sandq_tests::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut worker = world.start_worker_ready(&format!("{}-w", world.namespace), &env(&[("SANDQ__WORKER__METRICS_ADDR", &addr)]));
    let publisher = sandq_tests::RawPublisher::new(&world.config).await;
    publisher.publish(b"\xc1 not msgpack", Sku::S, None).await;
    publisher.publish(b"\x81\xa6job_id\xa3a/b", Sku::S, Some("also bad!")).await;
    let series = r#"sandq_dead_letters_total{reason="rejected",action="no_job_id"}"#;
    let counted = sandq_tests::wait_for_metric(port, series, 2.0, Duration::from_secs(30)).await;
    assert!((counted - 2.0).abs() < 0.5, "counted {counted}");
    assert_eq!(drained(&world.config).await, 0, "not acked");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// A cancel that lands while a taken job's inputs are being staged (after `running` was
/// written): the job is stopped before its program starts.
#[tokio::test]
async fn a_job_cancelled_while_its_inputs_are_staged_never_runs() {
    let world = Isolated::new().await;
    let mut worker = world.start_worker_ready(&format!("{}-w", world.namespace), &env(&[]));
    let mut client = world.client().await;
    // Big enough that staging (download and SHA-256 check) takes well over the time to see
    // `running` and set the cancel key.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("big.bin");
    let chunk: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let mut data = Vec::with_capacity(256 << 20);
    for i in 0..256u32 {
        data.extend(chunk.iter().map(|b| b ^ (i as u8)));
    }
    std::fs::write(&path, &data).expect("write");
    drop(data);
    let input = client.upload(&path, "big.bin").await.expect("upload");
    let mut spec = python_job("open('/work/ran', 'w').write('x')\nprint('ran')\n", Sku::S);
    spec.inputs = vec![input];
    client.submit(&spec).await.expect("submit");
    wait_for_status(&mut client, &spec.job_id, JobStatus::Running, Duration::from_secs(30)).await;
    assert!(client.cancel(&spec.job_id).await.expect("cancel"));
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Cancelled, "{result:?}");
    assert_eq!(result.reason.as_deref(), Some("cancelled before its program started"), "{result:?}");
    assert!(result.usage.is_none() && result.stdout.text.is_empty() && result.sandbox.is_none(), "it ran: {result:?}");
    assert!(result.started_at_ms.is_some(), "`running` was written: its start is kept: {result:?}");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// A dead letter forged for a running job (any publisher to the dead-letter exchange can write
/// `x-death`; so can a client's own duplicate that expired) does not end it: the job finishes
/// with its own result. A dead letter naming a job whose record Redis holds as another type is
/// dropped at once, not retried forever ahead of the next one.
#[tokio::test]
async fn forged_and_unreadable_dead_letters_do_not_end_a_running_job_or_block_the_queue() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let mut worker = world.start_worker_ready(&id, &env(&[]));
    let mut client = world.client().await;
    let spec = python_job("import time\nprint('start', flush=True)\ntime.sleep(4)\nprint('done')\n", Sku::S);
    client.submit(&spec).await.expect("submit");
    wait_for_status(&mut client, &spec.job_id, JobStatus::Running, Duration::from_secs(60)).await;
    let body = sandq_schemas::encode(&spec).expect("encode");
    for reason in ["expired", "delivery_limit", "rejected"] {
        sandq_tests::forge_dead_letter(&world.config, &body, &spec.job_id, reason).await;
    }
    // A record of another type under a job's key: unreadable, not a Redis outage.
    let bad = uuid::Uuid::new_v4().to_string();
    let names = sandq_schemas::names::Names::new(world.config.namespace.clone());
    let mut redis = sandq_core::results::connect(&world.config.redis).await.expect("redis");
    let () = redis::cmd("SET").arg(names.job_key(&bad)).arg("not a hash").query_async(&mut redis).await.expect("set");
    sandq_tests::forge_dead_letter(&world.config, b"garbage", &bad, "expired").await;
    // Behind it, a queued job's real-looking dead letter is handled at once.
    let queued = python_job("print('never')", Sku::L);
    let mut record = sandq_schemas::JobResult::new(queued.job_id.clone(), JobStatus::Queued);
    record.queued_at_ms = Some(sandq_core::time::now_ms());
    sandq_core::results::write(&mut redis, &names, &record, Duration::from_secs(600)).await.expect("queued");
    let started = std::time::Instant::now();
    sandq_tests::forge_dead_letter(&world.config, &sandq_schemas::encode(&queued).expect("encode"), &queued.job_id, "expired").await;
    let expired = wait(&mut client, &queued.job_id).await;
    assert_eq!(expired.status, JobStatus::Expired, "{expired:?}");
    assert!(started.elapsed() < Duration::from_secs(3), "the unreadable dead letter held the next one {:?}", started.elapsed());

    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Succeeded, "a forged dead letter ended the running job: {result:?}");
    assert_eq!(result.stdout.text, "start\ndone\n");
    assert_eq!(drained(&world.config).await, 0, "dead letters left in the queue");
    drop(worker.stdin.take());
    // Its shutdown grace is 30 s: a delivery still in flight may take all of it.
    assert!(exits_within(&mut worker, Duration::from_secs(60)), "the worker did not stop:\n{}", sandq_tests::isolated_worker_log(&id));
    world.delete_queues().await;
}

/// A `status` a client wrote as bytes that are not UTF-8 is "no known status", not a Redis
/// outage: its dead letter is handled once instead of being put back every second for ever
/// ahead of every other on every worker, a dead letter behind it gets its result, and a
/// delivery of that job is acked at once without running it (its status is not `queued`).
#[tokio::test]
async fn a_status_that_is_not_utf8_does_not_loop_the_dead_letter_queue() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[]));
    let mut client = world.client().await;
    let names = Names::new(world.namespace.clone());
    let mut redis = sandq_tests::plain_redis(&world).await;
    let poisoned: Vec<_> = (0..4).map(|_| python_job("print(1)", Sku::S)).collect();
    for spec in &poisoned {
        let () = redis::cmd("HSET")
            .arg(names.job_key(&spec.job_id))
            .arg("status")
            .arg(b"\xff".as_slice())
            .query_async(&mut redis)
            .await
            .expect("hset");
        sandq_tests::forge_dead_letter(&world.config, &sandq_schemas::encode(spec).expect("encode"), &spec.job_id, "expired").await;
    }
    // A legitimate dead letter behind them: a queued job no worker took.
    let legit = python_job("print(1)", Sku::S);
    let mut queued = JobResult::new(legit.job_id.clone(), JobStatus::Queued);
    queued.sku = Some(Sku::S);
    let mut conn = sandq_core::results::connect(&world.config.redis).await.expect("redis");
    assert!(sandq_core::results::write(&mut conn, &names, &queued, Duration::from_secs(600)).await.expect("queued"));
    sandq_tests::forge_dead_letter(&world.config, &sandq_schemas::encode(&legit).expect("encode"), &legit.job_id, "expired").await;
    let result = wait(&mut client, &legit.job_id).await;
    // The job path: a delivery of a job whose status is those bytes was retried 6 times with
    // backoff ("cannot read the job's state"), then dead-lettered into the loop above. The
    // status is not `queued`, so the job is not started: its delivery is acked at once.
    RawPublisher::new(&world.config)
        .await
        .publish(&sandq_schemas::encode(&poisoned[0]).expect("encode"), Sku::S, Some(&poisoned[0].job_id))
        .await;
    let acked = poll_until(Duration::from_secs(60), || {
        sandq_tests::isolated_worker_log(&id)
            .lines()
            .any(|l| l.contains(&poisoned[0].job_id) && l.contains("acking this one without a result"))
    });
    let drained = sandq_tests::dead_letter_count(&world.config, 0, Duration::from_secs(5)).await;
    let log = sandq_tests::isolated_worker_log(&id);
    sandq_tests::stop_worker(worker);
    world.delete_queues().await;
    assert_eq!(result.status, JobStatus::Expired, "{result:?}");
    assert_eq!(drained, 0, "dead letters left in the queue");
    assert!(acked, "the job's delivery was not acked");
    assert!(!log.contains("cannot read the job's state"), "the job's state was an error");
    let retried: Vec<&str> = log.lines().filter(|l| l.contains("dead letter") && l.contains("retrying")).take(3).collect();
    assert!(retried.is_empty(), "a dead letter was retried:\n{}", retried.join("\n"));
    for spec in &poisoned {
        let status: Vec<u8> =
            redis::cmd("HGET").arg(names.job_key(&spec.job_id)).arg("status").query_async(&mut redis).await.expect("hget");
        assert_eq!(status, b"\xff", "the client's value is left as it is");
    }
}

/// A dead letter naming a `running` record is checked again once that attempt must have ended,
/// counted from its `started_at_ms`, which a client writes: u64::MAX must not overflow the due
/// time (a panic that would end the worker's dead-letter consumer), nor a start decades ahead
/// hold a check for decades. A start in the future counts from now: the worker lives, keeps its
/// dead-letter consumer (a legitimate dead letter behind them gets its result), and nothing panics.
#[tokio::test]
async fn a_client_written_start_time_neither_panics_nor_pins_the_dead_letter_consumer() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[]));
    let mut client = world.client().await;
    let names = Names::new(world.namespace.clone());
    let mut conn = sandq_core::results::connect(&world.config.redis).await.expect("redis");
    let far = sandq_core::time::now_ms() + 50 * 365 * 24 * 3600 * 1000;
    for started in [u64::MAX, u64::MAX - 1, far] {
        let spec = python_job("print(1)", Sku::S);
        let mut running = JobResult::new(spec.job_id.clone(), JobStatus::Running);
        running.sku = Some(Sku::S);
        running.attempt = 1;
        running.started_at_ms = Some(started);
        assert!(sandq_core::results::write(&mut conn, &names, &running, Duration::from_secs(600)).await.expect("running"));
        sandq_tests::forge_dead_letter(&world.config, &sandq_schemas::encode(&spec).expect("encode"), &spec.job_id, "expired").await;
    }
    // Behind them, a queued job no worker took: its dead letter must still get a result.
    let legit = python_job("print(1)", Sku::S);
    let mut queued = JobResult::new(legit.job_id.clone(), JobStatus::Queued);
    queued.sku = Some(Sku::S);
    assert!(sandq_core::results::write(&mut conn, &names, &queued, Duration::from_secs(600)).await.expect("queued"));
    sandq_tests::forge_dead_letter(&world.config, &sandq_schemas::encode(&legit).expect("encode"), &legit.job_id, "expired").await;
    let result = wait(&mut client, &legit.job_id).await;
    let log = sandq_tests::isolated_worker_log(&id);
    let alive = worker.id();
    let running = std::path::Path::new(&format!("/proc/{alive}")).exists();
    sandq_tests::stop_worker(worker);
    world.delete_queues().await;
    assert_eq!(result.status, JobStatus::Expired, "{result:?}");
    assert!(running, "the worker died");
    assert!(!log.contains("panicked"), "a panic:\n{log}");
    // Deferred until the start (clamped to now) plus the attempt's lifetime: minutes, not decades.
    let deferred = log.lines().filter(|l| l.contains("checking again once its attempt must have ended")).count();
    assert_eq!(deferred, 3, "{log}");
}

/// The deferred checks of running jobs are kept in Redis by due time, not in a bounded list of
/// the worker that got the dead letter: 10,001 forged `running` records with dead letters do not
/// crowd out the check of a really lost job, and that check outlives the worker that deferred
/// it (another worker gives the job its `internal_error` when the check is due).
#[tokio::test]
async fn forged_running_jobs_cannot_crowd_out_a_lost_jobs_check_which_outlives_its_worker() {
    const FORGED: usize = 10_001;
    // An attempt may store its result until `limits.max_timeout` + 30 minutes after its start
    // (dead_letter::attempt_lifetime).
    const LIFETIME_MS: u64 = (60 + 30 * 60) * 1000;
    let world = Isolated::new().await;
    let env = sandq_tests::small_worker_env(&[("SANDQ__LIMITS__MAX_TIMEOUT", "60s")]);
    let first_id = format!("{}-w1", world.namespace);
    let first = world.start_worker_ready(&first_id, &env);
    let names = Names::new(world.namespace.clone());
    let mut conn = sandq_core::results::connect(&world.config.redis).await.expect("redis");
    let mut redis = sandq_tests::plain_redis(&world).await;
    let now = sandq_core::time::now_ms();
    let mut forged = Vec::with_capacity(FORGED);
    for _ in 0..FORGED {
        let spec = python_job("print(1)", Sku::S);
        let mut running = JobResult::new(spec.job_id.clone(), JobStatus::Running);
        running.sku = Some(Sku::S);
        running.attempt = 1;
        running.started_at_ms = Some(now);
        assert!(sandq_core::results::write(&mut conn, &names, &running, Duration::from_secs(1800)).await.expect("running"));
        forged.push((sandq_schemas::encode(&spec).expect("encode"), spec.job_id));
    }
    sandq_tests::forge_dead_letters(&world.config, &forged, "expired").await;
    let zcard = |mut redis: redis::aio::MultiplexedConnection, key: String| async move {
        redis::cmd("ZCARD").arg(key).query_async::<usize>(&mut redis).await.expect("zcard")
    };
    let started = std::time::Instant::now();
    while zcard(redis.clone(), names.deferred_checks()).await < FORGED {
        assert!(started.elapsed() < Duration::from_secs(300), "the forged dead letters were not all deferred in 300 s");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The lost job: its worker wrote `running` (attempt 1) and was never heard of again. Its
    // check comes due 40 s from now.
    let lost = python_job("print(1)", Sku::S);
    let mut running = JobResult::new(lost.job_id.clone(), JobStatus::Running);
    running.sku = Some(Sku::S);
    running.attempt = 1;
    running.started_at_ms = Some(sandq_core::time::now_ms() + 40_000 - LIFETIME_MS);
    assert!(sandq_core::results::write(&mut conn, &names, &running, Duration::from_secs(1800)).await.expect("running"));
    sandq_tests::forge_dead_letter(&world.config, &sandq_schemas::encode(&lost).expect("encode"), &lost.job_id, "expired").await;
    let member = format!("1:{}", lost.job_id);
    let started = std::time::Instant::now();
    let mut deferred: Option<f64> = None;
    while deferred.is_none() && started.elapsed() < Duration::from_secs(60) {
        deferred = redis::cmd("ZSCORE").arg(names.deferred_checks()).arg(&member).query_async(&mut redis).await.expect("zscore");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The worker that deferred it stops before it is due; another one starts.
    sandq_tests::stop_worker(first);
    let first_log = sandq_tests::isolated_worker_log(&first_id);
    let second_id = format!("{}-w2", world.namespace);
    let second = world.start_worker_ready(&second_id, &env);
    let mut client = world.client().await;
    let result = wait(&mut client, &lost.job_id).await;
    // The sweeper removes a check once its result is written: the count settles right after.
    let settle = std::time::Instant::now();
    let mut left = zcard(redis.clone(), names.deferred_checks()).await;
    while left != FORGED && settle.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = zcard(redis.clone(), names.deferred_checks()).await;
    }
    let mut still_running = 0;
    for (_, job_id) in forged.iter().step_by(1000) {
        let status: Vec<u8> = redis::cmd("HGET").arg(names.job_key(job_id)).arg("status").query_async(&mut redis).await.expect("hget");
        still_running += usize::from(status == b"running");
    }
    let second_log = sandq_tests::isolated_worker_log(&second_id);
    sandq_tests::stop_worker(second);
    world.delete_queues().await;
    let _: i64 = redis::cmd("DEL").arg(names.deferred_checks()).query_async(&mut redis).await.expect("del");
    let due_ms = running.started_at_ms.expect("start") + LIFETIME_MS;
    assert_eq!(deferred, Some(due_ms as f64), "the lost job's check was not deferred to its due time");
    assert_eq!(result.status, JobStatus::InternalError, "{result:?}");
    assert!(result.reason.as_deref().is_some_and(|r| r.contains("its worker was lost")), "{result:?}");
    assert_eq!(result.worker_id.as_deref(), Some(second_id.as_str()), "given by the worker started after the check was deferred");
    assert!(result.finished_at_ms.expect("finished") >= due_ms, "given before its check was due: {result:?}");
    assert_eq!(left, FORGED, "the forged checks (due in 31 minutes) stay pending");
    assert_eq!(still_running, FORGED.div_ceil(1000), "a forged running job was given a result");
    assert!(!first_log.contains("panicked") && !second_log.contains("panicked"), "a panic");
}

/// A `delivery_limit` dead letter naming a `running` record that shows fewer attempts than the
/// limit (deliveries that failed before their own `running` write, as when a client flushes
/// Redis's script cache) is deferred, not dropped: the job gets `internal_error` once its attempt
/// must have ended, instead of staying `running` until its `result_ttl`. A running attempt still
/// alive is not ended by it
/// (`forged_and_unreadable_dead_letters_do_not_end_a_running_job_or_block_the_queue`).
#[tokio::test]
async fn a_delivery_limit_dead_letter_with_fewer_attempts_is_checked_when_due() {
    // An attempt may store its result until `limits.max_timeout` + 30 minutes after its start.
    const LIFETIME_MS: u64 = (60 + 30 * 60) * 1000;
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[("SANDQ__LIMITS__MAX_TIMEOUT", "60s")]));
    let names = Names::new(world.namespace.clone());
    let mut conn = sandq_core::results::connect(&world.config.redis).await.expect("redis");
    let lost = python_job("print(1)", Sku::S);
    let mut running = JobResult::new(lost.job_id.clone(), JobStatus::Running);
    running.sku = Some(Sku::S);
    running.attempt = 2;
    running.started_at_ms = Some(sandq_core::time::now_ms() + 15_000 - LIFETIME_MS);
    assert!(sandq_core::results::write(&mut conn, &names, &running, Duration::from_secs(1800)).await.expect("running"));
    sandq_tests::forge_dead_letter(&world.config, &sandq_schemas::encode(&lost).expect("encode"), &lost.job_id, "delivery_limit").await;
    let mut client = world.client().await;
    let result = wait(&mut client, &lost.job_id).await;
    let log = sandq_tests::isolated_worker_log(&id);
    sandq_tests::stop_worker(worker);
    world.delete_queues().await;
    let due_ms = running.started_at_ms.expect("start") + LIFETIME_MS;
    assert_eq!(result.status, JobStatus::InternalError, "{result:?}");
    assert!(result.reason.as_deref().is_some_and(|r| r.contains("its worker was lost")), "{result:?}");
    assert!(result.finished_at_ms.expect("finished") >= due_ms, "ended before its attempt must have ended: {result:?}");
    assert!(log.contains("checking again once its attempt must have ended"), "not deferred:\n{log}");
}
