//! The worker's own resources stay bounded whatever untrusted data holds. A record a client
//! writes to Redis, a job body under the size cap, nesting in a body or in a message's AMQP
//! headers, and an attacker-sized value echoed in a rejection reason each cost the worker little
//! memory and never stop it; a sandbox takes a bounded share of the host-wide kernel tables; and
//! the broker refuses messages over 16 MiB, so no worker buffers a larger one.
//!
//! Memory is measured as the growth of the worker's peak resident memory (`VmHWM`) around the
//! job, once the worker has run a first job. Each test starts its own worker in a namespace of
//! its own. `tests/limits/` holds the scripts that reproduce these by hand (its README).

use std::time::Duration;

use sandq_schemas::names::Names;
use sandq_schemas::{JobResult, JobStatus, Sku};
use sandq_tests::{exits_within, poll_until, python_job, wait, wait_for_status, Isolated, RawPublisher};

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

/// The tests' broker (configured by scripts/services.sh) takes no message over 16 MiB, so
/// that an oversized job body is refused by the broker rather than buffered whole by a worker.
#[test]
fn the_broker_refuses_messages_over_16_mib() {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["eval", "application:get_env(rabbit, max_message_size)."])
        .output()
        .expect("rabbitmqctl");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "{ok,16777216}");
}

/// The worker's AMQP client parses a message's header table on its I/O thread: a message whose
/// headers nest tables 18,000 deep (a content header may be 128 KiB) must not overflow that
/// thread's stack and abort the worker. Every running job would be lost with it, and since the
/// message stays queued the worker would die at every start, then (after the delivery limit,
/// through the dead-letter queue) every worker of the namespace. Any client that can publish
/// can send one; the vendored amq-protocol-types skips tables nested past 32 levels
/// (vendor/README.md). Published with a raw AMQP client (`tests/limits/nested_headers.py`: a
/// recursive encoder overflows first).
#[tokio::test]
async fn a_message_with_deeply_nested_headers_does_not_stop_the_worker() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let mut worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[]));
    let port = sandq_tests::service_port(&world.config.amqp.url).to_string();
    let exchange = sandq_schemas::names::Names::new(world.namespace.clone()).jobs_exchange();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("limits/nested_headers.py");
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
    assert!(
        exited.is_none(),
        "the worker exited ({exited:?}) on one message with nested headers; log tail:\n{}",
        log.lines().rev().take(3).collect::<Vec<_>>().join("\n")
    );
}

/// A body of about 1 KB nesting 1,000 one-element arrays in an unknown field must not overflow
/// a worker thread's stack (a debug build's 2 MiB included), which would abort the worker at
/// every redelivery: every decode stops at 32 levels and the body is rejected. The same body
/// through the dead-letter exchange: the dead-letter consumer decodes it too.
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
    assert!(
        exited.is_none(),
        "the worker exited ({exited:?}); log tail:\n{}",
        sandq_tests::isolated_worker_log(&id).lines().rev().take(3).collect::<Vec<_>>().join("\n")
    );
    assert_eq!(result.status, JobStatus::Rejected, "{result:?}");
    assert!(result.reason.as_deref().is_some_and(|r| r.contains("depth limit exceeded")), "{result:?}");
    // The dead letter's body is not a job: it gets the dead-letter result by its message id.
    assert_eq!(dead_result.status, JobStatus::Expired, "{dead_result:?}");
}

/// A JobSpec under the 13 MiB body cap whose `args` are 13 million empty strings must not
/// decode to 13 million `String`s before validation refuses it: lists are counted while they
/// are decoded, from the array's header, so a body decodes to about its own size at most.
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

/// A client writes its job's `queued` record itself, through the compare-and-set script, with
/// whatever bytes it likes (docs/protocol.md: "A client writes only `queued`"), and the worker
/// reads that record when it takes the job, after every wait and in the dead-letter consumer.
/// A 100 MiB record (Redis takes values of 512 MB) must cost the worker little memory: read and
/// decoded whole, a few such jobs at once would exhaust it.
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
    let written: i64 = redis::Script::new(sandq_core::results::CAS_SCRIPT)
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

/// A client that knows a running job's id may write a terminal record of its own while the job
/// runs. The worker's own terminal write is then refused, and it must tell whose record is
/// stored without reading it back: this one, a traceback of 16 million empty strings (16 MB),
/// would decode to 24 times its size. The comparison is made in Redis, byte for byte; the
/// record never reaches the worker and is left as the client wrote it.
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
    // Made before the job is submitted: in a debug build on a loaded machine, making it took
    // longer than the job's 6 s, and the worker's own result was stored first.
    // A decodable `succeeded` record whose traceback holds 16 million empty strings (16 MB).
    let mut record = JobResult::new(spec.job_id.clone(), JobStatus::Succeeded);
    record.error = Some(sandq_schemas::ErrorInfo { name: "E".into(), value: "v".into(), traceback: Vec::new() });
    let encoded = sandq_schemas::encode(&record).expect("encode");
    let strings = 16_000_000u32;
    let forged = splice(&encoded, b"traceback\x90", &[b"traceback".as_slice(), &array_of(strings, &[0xa0])].concat());
    assert!(sandq_schemas::decode::<JobResult>(&forged).is_ok_and(|r| r.error.is_some_and(|e| e.traceback.len() == strings as usize)));
    client.submit(&spec).await.expect("submit");
    wait_for_status(&mut client, &spec.job_id, JobStatus::Running, Duration::from_secs(60)).await;
    let names = Names::new(world.namespace.clone());
    let mut redis = sandq_tests::plain_redis(&world).await;
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
    assert!(
        grown < 32 << 20,
        "a {} MB client-written record grew the worker's peak memory by {} MiB",
        forged.len() / 1_000_000,
        grown >> 20
    );
}

/// A dead letter's handling reads its job's record (up to 1 MiB, a client's to write) and must
/// decode only the fields it uses, skipping the rest without allocating it: four 1 MB records
/// of a million empty strings each (about 24 MiB each decoded whole) grow the worker's peak
/// memory by less than 12 MiB, and the fields it uses are still read.
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
    let mut redis = sandq_tests::plain_redis(&world).await;
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
        let written: i64 = redis::Script::new(sandq_core::results::CAS_SCRIPT)
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

/// serde's errors echo the value they refuse: a `runtime` of 2 MB must not be logged and stored
/// whole as the rejection's reason. Reasons are clipped to 1 KiB on a character boundary, with
/// a marker giving the whole length.
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
    assert!(
        reason == expected,
        "a reason of {} bytes, expected {} bytes: {:?}",
        reason.len(),
        expected.len(),
        reason.chars().rev().take(60).collect::<String>()
    );
    assert!(logged < 16 << 10, "one message logged {logged} bytes");
}

/// A sandbox takes a bounded share of the host-wide tables every process draws from: it opens at
/// most 64 ptys (its devpts instance's `max=`), and the worker raises the open file, pid and pty
/// tables at its start so that a sandbox's own memory and pids limits run out first. The tables
/// are sized for the node, not for one worker (several workers may share it): `fs.file-max` at
/// least one file per 256 bytes of the node's memory (and of the worker's capacity, 64 GiB here),
/// `kernel.pid_max` and `kernel.pty.max` the kernel's largest (2^22, 2^20).
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
