//! Tests of the tenth security review's fixes (issue 14; its report and repro scripts were in the
//! session that added this file; the kinds are those of docs/threat-model.md).
//!
//! - N1 and N2 are of the kind "the worker's own memory is bounded whatever untrusted data
//!   holds": a record a client writes to Redis, and a body under the size cap, must not decode
//!   to many times their size. Measured as the growth of the worker's peak resident memory
//!   (`VmHWM`), as tests/review8.rs measures R1.
//! - N8: no body of a few bytes overflows a worker thread's stack (a debug build's included).
//! - N3 and N4: one value a client writes to Redis does not stop the dead-letter consumer or the
//!   session reaper for everyone else.
//! - N7: an attacker-sized string in a rejection reason is clipped before it is logged or stored.

use std::time::Duration;

use sandq_schemas::names::Names;
use sandq_schemas::{JobResult, JobStatus, Sku};
use sandq_tests::{poll_until, python_job, wait, wait_for_status, Isolated, RawPublisher};

/// A Redis connection with no response timeout (large values take a while).
async fn plain_redis(world: &Isolated) -> redis::aio::MultiplexedConnection {
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
    redis::Client::open(world.config.redis.url.as_str())
        .expect("redis")
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .expect("redis")
}

/// `bytes` with the first occurrence of `from` replaced by `to`.
fn splice(bytes: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let at = bytes.windows(from.len()).position(|w| w == from).expect("pattern in the encoding");
    [&bytes[..at], to, &bytes[at + from.len()..]].concat()
}

/// `encoded` (a map 16, as a JobSpec's encoding is) with one more entry, `"x"` = `value`.
fn with_field_x(encoded: &[u8], value: &[u8]) -> Vec<u8> {
    assert_eq!(encoded[0], 0xde, "a map 16");
    let entries = u16::from_be_bytes([encoded[1], encoded[2]]) + 1;
    let mut out = vec![0xde];
    out.extend_from_slice(&entries.to_be_bytes());
    out.extend_from_slice(&encoded[3..]);
    out.extend_from_slice(&[0xa1, b'x']);
    out.extend_from_slice(value);
    out
}

/// An array 32 header of `n` elements followed by `n` copies of `element`.
fn array_of(n: u32, element: &[u8]) -> Vec<u8> {
    let mut out = vec![0xdd];
    out.extend_from_slice(&n.to_be_bytes());
    out.extend(element.repeat(n as usize));
    out
}

/// N1: a client that knows a running job's id writes a terminal record of its own while the
/// job runs; the worker's terminal compare-and-set is refused. The refused write's check read
/// that record back (up to 256 MiB) and decoded it whole: a traceback of empty strings decodes
/// to 24 times its size (the review: 40 MB took a debug worker from 51 MB to 1.07 GB). The
/// check is now done in Redis, byte for byte: the record never reaches the worker.
#[tokio::test]
async fn a_client_written_terminal_record_is_not_read_back_by_a_refused_write() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[]));
    let mut client = world.client().await;
    let first = sandq_tests::run(&mut client, &python_job("print(1)", Sku::S)).await;
    assert_eq!(first.status, JobStatus::Succeeded);
    let (peak_before, _) = sandq_tests::process_usage(worker.id());
    let spec = python_job("import time\nprint('started', flush=True)\ntime.sleep(6)\nprint('done')\n", Sku::S);
    client.submit(&spec).await.expect("submit");
    wait_for_status(&mut client, &spec.job_id, JobStatus::Running, Duration::from_secs(60)).await;
    // A decodable `succeeded` record whose traceback holds 16 million empty strings (16 MB).
    let mut record = JobResult::new(spec.job_id.clone(), JobStatus::Succeeded);
    record.error = Some(sandq_schemas::ErrorInfo { name: "E".into(), value: "v".into(), traceback: Vec::new() });
    let encoded = sandq_schemas::encode(&record).expect("encode");
    let strings = 16_000_000u32;
    let forged = splice(&encoded, b"traceback\x90", &[b"traceback".as_slice(), &array_of(strings, &[0xa0])].concat());
    assert!(sandq_schemas::decode::<JobResult>(&forged).is_ok_and(|r| r.error.is_some_and(|e| e.traceback.len() == strings as usize)));
    let names = Names::new(world.namespace.clone());
    let mut redis = plain_redis(&world).await;
    let () = redis::cmd("HSET")
        .arg(names.job_key(&spec.job_id))
        .arg("status")
        .arg("succeeded")
        .arg("result")
        .arg(&forged)
        .query_async(&mut redis)
        .await
        .expect("hset");
    // The worker's own result is refused, and it says why once it has compared.
    let compared = poll_until(Duration::from_secs(120), || {
        sandq_tests::isolated_worker_log(&id).contains("a terminal result was stored by another delivery of this job meanwhile")
    });
    let (peak_after, _) = sandq_tests::process_usage(worker.id());
    let stored: Vec<u8> = redis::cmd("HGET").arg(names.job_key(&spec.job_id)).arg("result").query_async(&mut redis).await.expect("hget");
    sandq_tests::stop_worker(worker);
    world.delete_queues().await;
    assert!(compared, "the refused write was not found another's: {}", sandq_tests::isolated_worker_log(&id));
    assert!(stored == forged, "the stored record changed");
    let grown = peak_after.saturating_sub(peak_before);
    println!("N1: worker peak {} -> {} MiB with a {} MB client record", peak_before >> 20, peak_after >> 20, forged.len() / 1_000_000);
    assert!(grown < 32 << 20, "a {} MB client-written record grew the worker's peak memory by {} MiB", forged.len() / 1_000_000, grown >> 20);
}

/// N1, the dead-letter path: a dead letter's handling read a job's record of up to 1 MiB and
/// decoded it whole (about 24 MiB for a traceback of empty strings), for each dead letter. It
/// now decodes only the fields it uses; the rest is skipped without being allocated.
#[tokio::test]
async fn a_dead_letter_decodes_only_the_fields_it_uses_of_a_client_record() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[]));
    let mut client = world.client().await;
    let first = sandq_tests::run(&mut client, &python_job("print(1)", Sku::S)).await;
    assert_eq!(first.status, JobStatus::Succeeded);
    let (peak_before, _) = sandq_tests::process_usage(worker.id());
    let names = Names::new(world.namespace.clone());
    let mut redis = plain_redis(&world).await;
    // Queued records of about 1 MB (under the 1 MiB read), a million empty strings each, written
    // as a client writes its own `queued` record; then a dead letter for each.
    // Without `submitted_at_ms`, the result's `queued_at_ms` can only come from the record.
    let specs: Vec<_> = (0..4)
        .map(|_| {
            let mut spec = python_job("print(1)", Sku::S);
            spec.submitted_at_ms = None;
            spec
        })
        .collect();
    for spec in &specs {
        let mut record = JobResult::new(spec.job_id.clone(), JobStatus::Queued);
        record.queued_at_ms = Some(1_796_047_054_196);
        record.error = Some(sandq_schemas::ErrorInfo { name: "E".into(), value: "v".into(), traceback: Vec::new() });
        let encoded = sandq_schemas::encode(&record).expect("encode");
        let forged = splice(&encoded, b"traceback\x90", &[b"traceback".as_slice(), &array_of(1_000_000, &[0xa0])].concat());
        assert!(forged.len() < 1 << 20, "{} bytes", forged.len());
        let written: i64 = redis::Script::new(sandq_submitter::results::CAS_SCRIPT)
            .key(names.job_key(&spec.job_id))
            .key(names.done_key(&spec.job_id))
            .arg("queued")
            .arg(&forged)
            .arg(600)
            .invoke_async(&mut redis)
            .await
            .expect("write");
        assert_eq!(written, 1);
        sandq_tests::forge_dead_letter(&world.config, &sandq_schemas::encode(spec).expect("encode"), &spec.job_id, "expired").await;
    }
    let mut results = Vec::new();
    for spec in &specs {
        results.push(wait(&mut client, &spec.job_id).await);
    }
    let (peak_after, _) = sandq_tests::process_usage(worker.id());
    sandq_tests::stop_worker(worker);
    world.delete_queues().await;
    for result in &results {
        assert_eq!(result.status, JobStatus::Expired, "{result:?}");
        // Read from the record's head: its queued time.
        assert_eq!(result.queued_at_ms, Some(1_796_047_054_196), "{result:?}");
    }
    let grown = peak_after.saturating_sub(peak_before);
    println!("N1 (dead letters): worker peak {} -> {} MiB with four 1 MB client records", peak_before >> 20, peak_after >> 20);
    assert!(grown < 12 << 20, "four 1 MB client records grew the worker's peak memory by {} MiB", grown >> 20);
}

/// N1's compare (ninth review P2's behaviour kept): the stored record is this attempt's when its
/// bytes are those of the refused result, another's when they differ under a terminal status,
/// and unknown otherwise (the objects are then kept). Checked against Redis directly.
#[tokio::test]
async fn a_refused_result_is_compared_in_redis_byte_for_byte() {
    use sandq_submitter::results::{self, Stored};
    let world = Isolated::new().await;
    let names = Names::new(world.namespace.clone());
    let mut redis = results::connect(&world.config.redis).await.expect("redis");
    let job_id = format!("cmp-{}", uuid::Uuid::new_v4().simple());
    let mut ours = JobResult::new(job_id.clone(), JobStatus::Succeeded);
    ours.stdout.text = "ours\n".into();
    ours.attempt = 1;
    assert_eq!(results::compare_stored(&mut redis, &names, &ours).await.expect("compare"), Stored::Unknown, "no record");
    let mut running = JobResult::new(job_id.clone(), JobStatus::Running);
    running.attempt = 1;
    assert!(results::write(&mut redis, &names, &running, Duration::from_secs(60)).await.expect("running"));
    assert_eq!(results::compare_stored(&mut redis, &names, &ours).await.expect("compare"), Stored::Unknown, "not terminal");
    assert!(results::write(&mut redis, &names, &ours, Duration::from_secs(60)).await.expect("write"));
    // The same write sent again is refused, and found to be this very result.
    assert!(!results::write(&mut redis, &names, &ours, Duration::from_secs(60)).await.expect("again"));
    assert_eq!(results::compare_stored(&mut redis, &names, &ours).await.expect("compare"), Stored::Same);
    // Another attempt's result, one byte different (its attempt number), is another's.
    let mut theirs = ours.clone();
    theirs.attempt = 2;
    assert_eq!(results::compare_stored(&mut redis, &names, &theirs).await.expect("compare"), Stored::Other);
    // A client's record under a status that is not one of the terminal names: unknown.
    let () = redis::cmd("HSET").arg(names.job_key(&job_id)).arg("status").arg(b"\xff".as_slice()).query_async(&mut redis).await.expect("hset");
    assert_eq!(results::compare_stored(&mut redis, &names, &theirs).await.expect("compare"), Stored::Unknown);
    let () = redis::cmd("DEL").arg(names.job_key(&job_id)).arg(names.done_key(&job_id)).query_async(&mut redis).await.expect("del");
    world.delete_queues().await;
}

/// N2: a JobSpec of 13,000,084 bytes (under the 13 MiB body cap) whose `args` are 13 million
/// empty strings decoded to 13 million `String`s before validation refused it (the review:
/// +318 MB on a release worker). The count is checked while decoding, from the array's header.
#[tokio::test]
async fn a_body_under_the_cap_does_not_decode_to_many_times_its_size() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[]));
    let mut client = world.client().await;
    let first = sandq_tests::run(&mut client, &python_job("print(1)", Sku::S)).await;
    assert_eq!(first.status, JobStatus::Succeeded);
    let (peak_before, _) = sandq_tests::process_usage(worker.id());
    let mut spec = python_job("print(1)", Sku::S);
    spec.args = vec!["x".into()];
    let encoded = sandq_schemas::encode(&spec).expect("encode");
    let body = splice(&encoded, b"args\x91\xa1x", &[b"args".as_slice(), &array_of(13_000_000, &[0xa0])].concat());
    assert!(body.len() > 13_000_000 && body.len() < 13 << 20, "{} bytes", body.len());
    RawPublisher::new(&world.config).await.publish(&body, Sku::S, Some(&spec.job_id)).await;
    let result = wait(&mut client, &spec.job_id).await;
    let (peak_after, _) = sandq_tests::process_usage(worker.id());
    sandq_tests::stop_worker(worker);
    world.delete_queues().await;
    assert_eq!(result.status, JobStatus::Rejected, "{result:?}");
    assert_eq!(result.reason.as_deref(), Some("malformed message: args: 13000000 elements, more than the 1024 a job may have"));
    let grown = peak_after.saturating_sub(peak_before);
    println!("N2: worker peak {} -> {} MiB with a {} MB body", peak_before >> 20, peak_after >> 20, body.len() / 1_000_000);
    // The body itself is held (by the AMQP client, and assembled from its frames): at most
    // about twice its size, never the 24 times of its decoded strings.
    assert!(grown < 3 * body.len() as u64, "a {} MB body grew the worker's peak memory by {} MiB", body.len() / 1_000_000, grown >> 20);
}

/// N8: 600 nested one-element arrays in an unknown field (a body of about 1 KB) overflowed a
/// debug worker's tokio thread stack, aborting the worker at each redelivery; past 32 levels a
/// body is now refused. The same nesting through the dead-letter exchange: the dead-letter
/// consumer decodes it too.
#[tokio::test]
async fn a_deeply_nested_body_is_rejected_and_the_worker_lives() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let mut worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[]));
    let mut client = world.client().await;
    let spec = python_job("print(1)", Sku::S);
    // 1,000 nested one-element arrays around a nil.
    let deep = [vec![0x91; 1_000], vec![0xc0]].concat();
    let body = with_field_x(&sandq_schemas::encode(&spec).expect("encode"), &deep);
    assert!(body.len() < 2_000, "{} bytes", body.len());
    RawPublisher::new(&world.config).await.publish(&body, Sku::S, Some(&spec.job_id)).await;
    let result = wait(&mut client, &spec.job_id).await;
    // And the same body as a dead letter, for a job of its own.
    let dead = python_job("print(1)", Sku::S);
    let dead_body = with_field_x(&sandq_schemas::encode(&dead).expect("encode"), &deep);
    sandq_tests::forge_dead_letter(&world.config, &dead_body, &dead.job_id, "expired").await;
    let dead_result = wait(&mut client, &dead.job_id).await;
    let exited = worker.try_wait().expect("try_wait");
    if exited.is_none() {
        sandq_tests::stop_worker(worker);
    }
    world.delete_queues().await;
    assert!(exited.is_none(), "the worker exited ({exited:?}); log tail:\n{}", sandq_tests::isolated_worker_log(&id).lines().rev().take(3).collect::<Vec<_>>().join("\n"));
    assert_eq!(result.status, JobStatus::Rejected, "{result:?}");
    assert!(result.reason.as_deref().is_some_and(|r| r.contains("depth limit exceeded")), "{result:?}");
    // The dead letter's body is not a job: it gets the dead-letter result by its message id.
    assert_eq!(dead_result.status, JobStatus::Expired, "{dead_result:?}");
}

/// N3: a 1-byte status that is not UTF-8 (`HSET ... status "\xff"`) made reading the status a
/// type error, which the dead-letter consumer took for Redis being away: the dead letter was
/// put back once a second, for ever, delaying every other. It is now "no known status", and
/// the dead letter is handled once; a dead letter behind it gets its result.
#[tokio::test]
async fn a_status_that_is_not_utf8_does_not_loop_the_dead_letter_queue() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[]));
    let mut client = world.client().await;
    let names = Names::new(world.namespace.clone());
    let mut redis = plain_redis(&world).await;
    let poisoned: Vec<_> = (0..4).map(|_| python_job("print(1)", Sku::S)).collect();
    for spec in &poisoned {
        let () = redis::cmd("HSET").arg(names.job_key(&spec.job_id)).arg("status").arg(b"\xff".as_slice()).query_async(&mut redis).await.expect("hset");
        sandq_tests::forge_dead_letter(&world.config, &sandq_schemas::encode(spec).expect("encode"), &spec.job_id, "expired").await;
    }
    // A legitimate dead letter behind them: a queued job no worker took.
    let legit = python_job("print(1)", Sku::S);
    let mut queued = JobResult::new(legit.job_id.clone(), JobStatus::Queued);
    queued.sku = Some(Sku::S);
    let mut conn = sandq_submitter::results::connect(&world.config.redis).await.expect("redis");
    assert!(sandq_submitter::results::write(&mut conn, &names, &queued, Duration::from_secs(600)).await.expect("queued"));
    sandq_tests::forge_dead_letter(&world.config, &sandq_schemas::encode(&legit).expect("encode"), &legit.job_id, "expired").await;
    let result = wait(&mut client, &legit.job_id).await;
    // The job path: a delivery of a job whose status is those bytes was retried 6 times with
    // backoff ("cannot read the job's state"), then dead-lettered into the loop above. The
    // status is not `queued`, so the job is not started: its delivery is acked at once.
    RawPublisher::new(&world.config).await.publish(&sandq_schemas::encode(&poisoned[0]).expect("encode"), Sku::S, Some(&poisoned[0].job_id)).await;
    let acked = poll_until(Duration::from_secs(60), || {
        sandq_tests::isolated_worker_log(&id).lines().any(|l| l.contains(&poisoned[0].job_id) && l.contains("acking this one without a result"))
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
        let status: Vec<u8> = redis::cmd("HGET").arg(names.job_key(&spec.job_id)).arg("status").query_async(&mut redis).await.expect("hget");
        assert_eq!(status, b"\xff", "the client's value is left as it is");
    }
}

/// Eleventh review R11-1: a dead letter naming a `running` record whose `started_at_ms` is a
/// client's u64::MAX overflowed the deferred check's deadline (a panic that ended the worker's
/// dead-letter consumer for good), and a start decades ahead held a deferred check, and its
/// place in the bounded list, for decades. Both now count from now at the latest: the worker
/// lives, keeps its dead-letter consumer (a legitimate dead letter behind them gets its result),
/// and neither panics.
#[tokio::test]
async fn a_client_written_start_time_neither_panics_nor_pins_the_dead_letter_consumer() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[]));
    let mut client = world.client().await;
    let names = Names::new(world.namespace.clone());
    let mut conn = sandq_submitter::results::connect(&world.config.redis).await.expect("redis");
    let far = sandq_submitter::client::now_ms() + 50 * 365 * 24 * 3600 * 1000;
    for started in [u64::MAX, u64::MAX - 1, far] {
        let spec = python_job("print(1)", Sku::S);
        let mut running = JobResult::new(spec.job_id.clone(), JobStatus::Running);
        running.sku = Some(Sku::S);
        running.attempt = 1;
        running.started_at_ms = Some(started);
        assert!(sandq_submitter::results::write(&mut conn, &names, &running, Duration::from_secs(600)).await.expect("running"));
        sandq_tests::forge_dead_letter(&world.config, &sandq_schemas::encode(&spec).expect("encode"), &spec.job_id, "expired").await;
    }
    // Behind them, a queued job no worker took: its dead letter must still get a result.
    let legit = python_job("print(1)", Sku::S);
    let mut queued = JobResult::new(legit.job_id.clone(), JobStatus::Queued);
    queued.sku = Some(Sku::S);
    assert!(sandq_submitter::results::write(&mut conn, &names, &queued, Duration::from_secs(600)).await.expect("queued"));
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

/// N4: the reaper read the due names of the sessions index as strings (one member that is not
/// UTF-8 failed every call, on every worker), and left a due name it could not handle (its lock
/// held) at the head of the index, where 100 of them pinned its window of 100 for ever. Invalid
/// members are now removed (never used as S3 prefixes), and locked ones moved later.
#[tokio::test]
async fn invalid_or_locked_index_members_do_not_stop_the_session_reaper() {
    let world = Isolated::new().await;
    let env = sandq_tests::small_worker_env(&[("SANDQ__SESSIONS__IDLE_TIMEOUT", "2s"), ("SANDQ__SESSIONS__REAP_INTERVAL", "500ms")]);
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &env);
    let names = Names::new(world.namespace.clone());
    let mut redis = plain_redis(&world).await;
    // 100 due names whose locks are held without expiry, and two invalid members, all at
    // score 0: the head of the index.
    let locked: Vec<String> = (0..100).map(|i| format!("p{i:02}-{}", &world.namespace[11..])).collect();
    for name in &locked {
        let () = redis::cmd("SET").arg(names.session_lock_key(name)).arg("someone").query_async(&mut redis).await.expect("set");
        let () = redis::cmd("ZADD").arg(names.sessions_index()).arg(0).arg(name).query_async(&mut redis).await.expect("zadd");
    }
    for member in [b"\xff\xfe".as_slice(), b"victim/blobs".as_slice()] {
        let () = redis::cmd("ZADD").arg(names.sessions_index()).arg(0).arg(member).query_async(&mut redis).await.expect("zadd");
    }
    let mut client = world.client().await;
    let session = format!("victim-{}", uuid::Uuid::new_v4().simple());
    let mut spec = python_job("open('data.csv', 'w').write('1,2\\n')", Sku::S);
    spec.session = Some(session.clone());
    let first = sandq_tests::run(&mut client, &spec).await;
    assert_eq!(first.status, JobStatus::Succeeded, "{first:?}");
    let listed = || {
        let (s3, bucket, prefix) = (sandq_submitter::storage::client(&world.config.s3), world.config.s3.bucket.clone(), names.session_prefix(&session));
        async move { sandq_submitter::storage::list(&s3, &bucket, &prefix, 1000).await.expect("list") }
    };
    assert!(!listed().await.is_empty(), "the session was saved");
    // Reaped once expired (2 s), despite what sits ahead of it in the index.
    let started = std::time::Instant::now();
    let mut reaped = false;
    while started.elapsed() < Duration::from_secs(60) {
        if listed().await.is_empty() {
            reaped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let invalid_left: Vec<Option<f64>> = {
        let mut left = Vec::new();
        for member in [b"\xff\xfe".as_slice(), b"victim/blobs".as_slice()] {
            left.push(redis::cmd("ZSCORE").arg(names.sessions_index()).arg(member).query_async(&mut redis).await.expect("zscore"));
        }
        left
    };
    let score: Option<f64> = redis::cmd("ZSCORE").arg(names.sessions_index()).arg(&locked[0]).query_async(&mut redis).await.expect("zscore");
    let log = sandq_tests::isolated_worker_log(&id);
    sandq_tests::stop_worker(worker);
    for name in &locked {
        let () = redis::cmd("DEL").arg(names.session_lock_key(name)).query_async(&mut redis).await.expect("del");
    }
    let () = redis::cmd("DEL").arg(names.sessions_index()).query_async(&mut redis).await.expect("del");
    world.delete_queues().await;
    assert!(reaped, "the expired session is still in S3 60 s later; reaper log:\n{}", log.lines().filter(|l| l.contains("reap")).take(5).collect::<Vec<_>>().join("\n"));
    assert_eq!(invalid_left, vec![None, None], "invalid members are removed from the index");
    assert!(score.is_some_and(|s| s > 0.0), "a locked due name is moved later in the index: {score:?}");
    assert!(!log.contains("session reaper failed"), "the reaper failed:\n{log}");
}

/// N7: serde's error echoes the value it refuses; a `runtime` of 2 MB was logged and stored
/// whole as the rejection's reason. It is clipped to 1 KiB, with a marker giving its length.
#[tokio::test]
async fn an_attacker_sized_rejection_reason_is_clipped() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[]));
    let mut client = world.client().await;
    let spec = python_job("print(1)", Sku::S);
    let encoded = sandq_schemas::encode(&spec).expect("encode");
    let huge = "A".repeat(2_000_000);
    let mut runtime = vec![0xdb];
    runtime.extend_from_slice(&u32::try_from(huge.len()).expect("fits").to_be_bytes());
    runtime.extend_from_slice(huge.as_bytes());
    let body = splice(&encoded, b"runtime\xa6python", &[b"runtime".as_slice(), &runtime].concat());
    let log_before = sandq_tests::isolated_worker_log(&id).len();
    RawPublisher::new(&world.config).await.publish(&body, Sku::S, Some(&spec.job_id)).await;
    let result = wait(&mut client, &spec.job_id).await;
    let logged = sandq_tests::isolated_worker_log(&id).len() - log_before;
    sandq_tests::stop_worker(worker);
    world.delete_queues().await;
    assert_eq!(result.status, JobStatus::Rejected, "{result:?}");
    let reason = result.reason.expect("reason");
    let whole = format!("malformed message: runtime: unknown variant `{huge}`, expected `python` or `node`");
    let cut = whole.char_indices().map(|(i, _)| i).take_while(|i| *i <= 1024).last().expect("boundary");
    let expected = format!("{}\u{2026} [clipped: {} bytes in all]", &whole[..cut], whole.len());
    assert!(reason == expected, "a reason of {} bytes, expected {} bytes: {:?}", reason.len(), expected.len(), reason.chars().rev().take(60).collect::<String>());
    assert!(logged < 16 << 10, "one message logged {logged} bytes");
}
