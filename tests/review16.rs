//! Tests of the sixteenth security review's fixes (issue 14; R16-1 is in `review12.rs`'s ACL
//! test). R16-2: a client flushing the server's script cache in a loop (`SCRIPT FLUSH`, which any
//! user with `@scripting` may run) made every `EVALSHA` of the workers fail: a job ran, could not
//! store its result, ran again, and the dead letter after the delivery limit was dropped because
//! the record showed fewer attempts, so the job stayed `running` until its `result_ttl`. The
//! scripts now go by `EVAL`, and a `delivery_limit` dead letter naming a running record with
//! fewer attempts is deferred like the others instead of dropped.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sandq_schemas::names::Names;
use sandq_schemas::{JobResult, JobStatus, Sku};
use sandq_tests::{python_job, wait, Isolated};

/// Jobs submitted and run while another connection flushes the script cache as fast as it can
/// each run once and store their results.
#[tokio::test]
async fn jobs_complete_once_while_a_client_flushes_the_script_cache() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[]));
    let mut client = world.client().await;
    let flushing = Arc::new(AtomicBool::new(true));
    let flushes = Arc::new(AtomicU64::new(0));
    let flooder = {
        let (flushing, flushes) = (flushing.clone(), flushes.clone());
        let url = world.config.redis.url.clone();
        tokio::spawn(async move {
            let mut redis = redis::Client::open(url.as_str()).expect("redis").get_multiplexed_async_connection().await.expect("redis");
            while flushing.load(Ordering::Relaxed) {
                let mut pipe = redis::pipe();
                for _ in 0..50 {
                    pipe.cmd("SCRIPT").arg("FLUSH").ignore();
                }
                let () = pipe.query_async(&mut redis).await.expect("flush");
                flushes.fetch_add(50, Ordering::Relaxed);
            }
        })
    };
    let mut results = Vec::new();
    for i in 0..3 {
        let spec = python_job(&format!("import time\nprint({i})\ntime.sleep(1)\n"), Sku::S);
        results.push(sandq_tests::run(&mut client, &spec).await);
    }
    flushing.store(false, Ordering::Relaxed);
    flooder.await.expect("flooder");
    let log = sandq_tests::isolated_worker_log(&id);
    sandq_tests::stop_worker(worker);
    world.delete_queues().await;
    assert!(flushes.load(Ordering::Relaxed) > 1000, "the flood was too small: {}", flushes.load(Ordering::Relaxed));
    for (i, result) in results.iter().enumerate() {
        assert_eq!((result.status, result.attempt, result.stdout.text.as_str()), (JobStatus::Succeeded, 1, format!("{i}\n").as_str()), "{result:?}");
    }
    assert!(!log.contains("NoScript"), "a script failed on the flushed cache:\n{}", log.lines().filter(|l| l.contains("NoScript")).take(3).collect::<Vec<_>>().join("\n"));
}

/// A `delivery_limit` dead letter naming a `running` record that shows fewer attempts than the
/// limit (deliveries that failed before their own `running` write) is deferred, not dropped: the
/// job gets `internal_error` once its attempt must have ended. A running attempt still alive is
/// not ended by it (that check is `dead_letters.rs`'s forged dead letters).
#[tokio::test]
async fn a_delivery_limit_dead_letter_with_fewer_attempts_is_checked_when_due() {
    // An attempt may store its result until `limits.max_timeout` + 30 minutes after its start.
    const LIFETIME_MS: u64 = (60 + 30 * 60) * 1000;
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[("SANDQ__LIMITS__MAX_TIMEOUT", "60s")]));
    let names = Names::new(world.namespace.clone());
    let mut conn = sandq_submitter::results::connect(&world.config.redis).await.expect("redis");
    let lost = python_job("print(1)", Sku::S);
    let mut running = JobResult::new(lost.job_id.clone(), JobStatus::Running);
    running.sku = Some(Sku::S);
    running.attempt = 2;
    running.started_at_ms = Some(sandq_submitter::client::now_ms() + 15_000 - LIFETIME_MS);
    assert!(sandq_submitter::results::write(&mut conn, &names, &running, Duration::from_secs(1800)).await.expect("running"));
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

/// Eighteenth review R18-1: a client's own session lock holding a list, bytes that are not
/// UTF-8, or terminal escapes with a forged row failed or spoofed `sandq session ls` for every
/// session. Each such holder now lists as `?`, a worker's holder id as itself, and every
/// session is listed.
#[tokio::test]
async fn session_locks_a_client_wrote_neither_fail_nor_spoof_the_listing() {
    let world = Isolated::new().await;
    let names = Names::new(world.namespace.clone());
    let mut redis = redis::Client::open(world.config.redis.url.as_str()).expect("redis").get_multiplexed_async_connection().await.expect("redis");
    let sessions = ["s-list", "s-bytes", "s-escape", "s-held", "s-free"];
    for (i, name) in sessions.iter().enumerate() {
        let () = redis::cmd("ZADD").arg(names.sessions_index()).arg(1_000 + i as u64).arg(*name).query_async(&mut redis).await.expect("zadd");
    }
    let _: i64 = redis::cmd("RPUSH").arg(names.session_lock_key("s-list")).arg("x").query_async(&mut redis).await.expect("rpush");
    let () = redis::cmd("SET").arg(names.session_lock_key("s-bytes")).arg(b"\xff\xfe".as_slice()).query_async(&mut redis).await.expect("set");
    let () = redis::cmd("SET").arg(names.session_lock_key("s-escape")).arg("job\x1b[2J\nFAKE-SESSION 999").query_async(&mut redis).await.expect("set");
    let () = redis::cmd("SET").arg(names.session_lock_key("s-held")).arg("a0123456789abcdef").query_async(&mut redis).await.expect("set");
    let mut client = world.client().await;
    let listed = client.sessions(100).await;
    let mut keys = vec![names.sessions_index()];
    keys.extend(sessions.iter().map(|s| names.session_lock_key(s)));
    let _: i64 = redis::cmd("DEL").arg(&keys).query_async(&mut redis).await.expect("del");
    world.delete_queues().await;
    let listed: Vec<(String, Option<String>)> = listed.expect("the listing").into_iter().map(|l| (l.name, l.in_use_by)).collect();
    let expected: Vec<(String, Option<String>)> = vec![
        ("s-list".into(), Some("?".into())),
        ("s-bytes".into(), Some("?".into())),
        ("s-escape".into(), Some("?".into())),
        ("s-held".into(), Some("a0123456789abcdef".into())),
        ("s-free".into(), None),
    ];
    assert_eq!(listed, expected);
}
