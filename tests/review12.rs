//! Tests of the twelfth security review's fixes (issue 14; the kinds are those of
//! docs/threat-model.md). Both are of the kind "a value a client writes to Redis, or messages it
//! publishes, must not lose or rerun anybody's job":
//!
//! - R12-2: a client made the sessions index (`<ns>:sessions`) a string; every session job's
//!   index update then failed with `WRONGTYPE`, was retried as an infrastructure failure (the
//!   program ran three times on its advancing files, then `internal_error`), and the reaper
//!   failed every period. The index update is advisory now, a foreign key is deleted and the
//!   index rebuilt from the manifests in S3.
//! - R12-1: the dead-letter consumer kept its deferred checks of running jobs in a list of
//!   10,000 per worker; 11,000 forged `running` records and dead letters filled it, and a really
//!   lost job's dead letter was then dropped (the job stayed `running`). The checks are kept in
//!   Redis now, by due time, and any worker makes them: no count crowds one out, and a check
//!   outlives the worker that deferred it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sandq_schemas::names::Names;
use sandq_schemas::{JobResult, JobSpec, JobStatus, Sku};
use sandq_submitter::storage;
use sandq_tests::{python_job, wait, Isolated};

async fn plain_redis(world: &Isolated) -> redis::aio::MultiplexedConnection {
    redis::Client::open(world.config.redis.url.as_str()).expect("redis").get_multiplexed_async_connection().await.expect("redis")
}

/// A job of `session` that appends a line to `runs.txt` (a session file) and prints how many
/// lines it has: a job run twice prints one more than it should.
fn counting_job(session: &str) -> JobSpec {
    let mut spec = python_job("with open('runs.txt', 'a') as f:\n    f.write('run\\n')\nprint(len(open('runs.txt').read().splitlines()))\n", Sku::S);
    spec.session = Some(session.to_owned());
    spec
}

/// R12-2: while a client keeps `<ns>:sessions` a string, two jobs of one session each run once
/// and succeed (their files carried from one to the next); once the client also removed the
/// session from the index, the session is still deleted after it expired: the index is rebuilt
/// from S3.
#[tokio::test]
async fn a_sessions_index_a_client_overwrites_neither_reruns_jobs_nor_keeps_sessions_for_ever() {
    let world = Isolated::new().await;
    let env = sandq_tests::small_worker_env(&[
        ("SANDQ__SESSIONS__IDLE_TIMEOUT", "5s"),
        ("SANDQ__SESSIONS__REAP_INTERVAL", "500ms"),
        ("SANDQ__SESSIONS__REBUILD_INTERVAL", "2s"),
    ]);
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &env);
    let names = Names::new(world.namespace.clone());
    let mut client = world.client().await;
    let session = format!("s12-{}", uuid::Uuid::new_v4().simple());
    // The client's write, repeated every 5 ms: the reaper deletes a foreign index each period.
    let attacking = Arc::new(AtomicBool::new(true));
    let attacker = {
        let (attacking, mut redis, key) = (attacking.clone(), plain_redis(&world).await, names.sessions_index());
        tokio::spawn(async move {
            let mut writes = 0u64;
            while attacking.load(Ordering::Relaxed) {
                let () = redis::cmd("SET").arg(&key).arg("x").query_async(&mut redis).await.expect("set");
                writes += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            writes
        })
    };
    let first = sandq_tests::run(&mut client, &counting_job(&session)).await;
    let second = sandq_tests::run(&mut client, &counting_job(&session)).await;
    attacking.store(false, Ordering::Relaxed);
    let writes = attacker.await.expect("attacker");
    // The client also drops the session from the index: only a rebuild from S3 finds it now.
    let mut redis = plain_redis(&world).await;
    let () = redis::cmd("DEL").arg(names.sessions_index()).query_async(&mut redis).await.expect("del");
    let (s3, bucket) = (storage::client(&world.config.s3), world.config.s3.bucket.clone());
    let stored_before = storage::list(&s3, &bucket, &names.session_prefix(&session), 100).await.expect("list");
    let started = std::time::Instant::now();
    let mut gone_after = None;
    while started.elapsed() < Duration::from_secs(90) {
        if storage::list(&s3, &bucket, &names.session_prefix(&session), 100).await.expect("list").is_empty() {
            gone_after = Some(started.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let third = sandq_tests::run(&mut client, &counting_job(&session)).await;
    let log = sandq_tests::isolated_worker_log(&id);
    sandq_tests::stop_worker(worker);
    world.delete_queues().await;
    let _: i64 = redis::cmd("DEL").arg(names.sessions_index()).arg(names.sessions_rebuilt_key()).query_async(&mut redis).await.expect("del");
    let _ = client.remove_session(&session, Duration::from_secs(10)).await;
    assert!(writes > 10, "the attacker wrote the index {writes} times");
    for (n, result) in [(1, &first), (2, &second)] {
        assert_eq!((result.status, result.attempt, result.stdout.text.as_str()), (JobStatus::Succeeded, 1, format!("{n}\n").as_str()), "job {n}: {result:?}");
    }
    assert!(log.contains("its expiry is not indexed"), "no index update failed while the index was a string:\n{log}");
    assert!(log.contains("the sessions index was a key of another type"), "the foreign index was not reset:\n{log}");
    assert!(!stored_before.is_empty(), "the session was stored");
    assert!(gone_after.is_some(), "the expired session, missing from the index, is still in S3 90 s later");
    // Deleted as expired: the next job of the name starts afresh and is told so.
    assert_eq!((third.status, third.stdout.text.as_str()), (JobStatus::Succeeded, "1\n"), "{third:?}");
    let info = third.session.as_ref().expect("session info");
    assert!(info.fresh && info.expired, "{info:?}");
}

/// R12-1: 10,001 forged `running` records with dead letters (more than the old per-worker list
/// held) do not crowd out the check of a really lost job, and that check outlives the worker
/// that deferred it: another worker gives the job its `internal_error` when the check is due.
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
    let mut conn = sandq_submitter::results::connect(&world.config.redis).await.expect("redis");
    let mut redis = plain_redis(&world).await;
    let now = sandq_submitter::client::now_ms();
    let mut forged = Vec::with_capacity(FORGED);
    for _ in 0..FORGED {
        let spec = python_job("print(1)", Sku::S);
        let mut running = JobResult::new(spec.job_id.clone(), JobStatus::Running);
        running.sku = Some(Sku::S);
        running.attempt = 1;
        running.started_at_ms = Some(now);
        assert!(sandq_submitter::results::write(&mut conn, &names, &running, Duration::from_secs(1800)).await.expect("running"));
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
    running.started_at_ms = Some(sandq_submitter::client::now_ms() + 40_000 - LIFETIME_MS);
    assert!(sandq_submitter::results::write(&mut conn, &names, &running, Duration::from_secs(1800)).await.expect("running"));
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
    let left = zcard(redis.clone(), names.deferred_checks()).await;
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

/// The deployment that closes R12-2 for good (docs/operations.md "Redis ACL for clients"): a
/// client whose Redis user may use only its jobs' and sessions' own keys still submits, waits,
/// runs session jobs and removes a session; its writes of the index, the rebuild turn and the
/// deferred checks are refused (`NOPERM`), and so are listing the sessions, scanning the
/// keyspace (thirteenth review R13-8), client-side caching's broadcast of written keys
/// (fourteenth review R14-1) and a cluster's keys by slot (sixteenth review R16-1), which named
/// every other client's sessions and job ids, and flushing the server's script cache (R16-2).
#[tokio::test]
async fn a_client_denied_the_workers_keys_by_acl_still_runs_and_removes_sessions() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[]));
    let names = Names::new(world.namespace.clone());
    let mut admin = plain_redis(&world).await;
    let (user, password) = (format!("client-{}", world.namespace), uuid::Uuid::new_v4().simple().to_string());
    // The rules of docs/operations.md, for this namespace.
    let ns = &world.namespace;
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(&user)
        .arg("reset")
        .arg("on")
        .arg(format!(">{password}"))
        .arg(format!("~{ns}:job:*"))
        .arg(format!("~{ns}:session:*"))
        .arg("+@all")
        .arg("-@admin")
        .arg("-@dangerous")
        .arg("-scan")
        .arg("-randomkey")
        .arg("-client|tracking")
        .arg("-dbsize")
        .arg("-memory")
        .arg("-cluster|getkeysinslot")
        .arg("-cluster|countkeysinslot")
        .arg("-script|flush")
        .arg("-script|kill")
        .arg("-script|debug")
        .arg("-function|flush")
        .arg("-function|delete")
        .arg("-function|load")
        .arg("-function|restore")
        .arg("-function|kill")
        .query_async(&mut admin)
        .await
        .expect("acl setuser");
    let mut config = world.config.clone();
    assert!(config.redis.url.starts_with("redis://") && !config.redis.url.contains('@'), "a plain URL: {}", config.redis.url);
    config.redis.url = config.redis.url.replacen("redis://", &format!("redis://{user}:{password}@"), 1);
    let outcome = async {
        let mut client = sandq_submitter::client::Client::connect(config.clone()).await.expect("client as the ACL user");
        let session = format!("acl-{}", uuid::Uuid::new_v4().simple());
        let first = sandq_tests::run(&mut client, &counting_job(&session)).await;
        let second = sandq_tests::run(&mut client, &counting_job(&session)).await;
        let listed = client.sessions(100).await.map(|l| l.len()).map_err(|e| e.to_string());
        let removed = client.remove_session(&session, Duration::from_secs(10)).await.expect("remove session");
        let (s3, bucket) = (storage::client(&world.config.s3), world.config.s3.bucket.clone());
        let left = storage::list(&s3, &bucket, &names.session_prefix(&session), 100).await.expect("list");
        let mut as_client = redis::Client::open(config.redis.url.as_str()).expect("redis").get_multiplexed_async_connection().await.expect("redis");
        let mut refused = Vec::new();
        for (command, key) in [("SET", names.sessions_index()), ("ZREM", names.sessions_index()), ("SET", names.sessions_rebuilt_key()), ("SET", names.deferred_checks())] {
            let mut cmd = redis::cmd(command);
            cmd.arg(&key).arg("x");
            let reply: Result<redis::Value, redis::RedisError> = cmd.query_async(&mut as_client).await;
            refused.push((format!("{command} {key}"), reply.err().and_then(|e| e.code().map(str::to_owned))));
        }
        for command in [vec!["ZRANGE".to_owned(), names.sessions_index(), "0".to_owned(), "-1".to_owned()], vec!["SCAN".to_owned(), "0".to_owned()], vec!["RANDOMKEY".to_owned()], vec!["KEYS".to_owned(), "*".to_owned()], ["CLIENT", "TRACKING", "ON", "BCAST"].map(str::to_owned).to_vec(), vec!["DBSIZE".to_owned()], ["MEMORY", "STATS"].map(str::to_owned).to_vec(), ["CLUSTER", "GETKEYSINSLOT", "0", "10"].map(str::to_owned).to_vec(), ["SCRIPT", "FLUSH"].map(str::to_owned).to_vec(), ["FUNCTION", "FLUSH"].map(str::to_owned).to_vec()] {
            let mut cmd = redis::cmd(&command[0]);
            for arg in &command[1..] {
                cmd.arg(arg);
            }
            let reply: Result<redis::Value, redis::RedisError> = cmd.query_async(&mut as_client).await;
            refused.push((command.join(" "), reply.err().and_then(|e| e.code().map(str::to_owned))));
        }
        (first, second, listed, removed, left, refused)
    }
    .await;
    let log = sandq_tests::isolated_worker_log(&id);
    let _: i64 = redis::cmd("ACL").arg("DELUSER").arg(&user).query_async(&mut admin).await.expect("acl deluser");
    sandq_tests::stop_worker(worker);
    world.delete_queues().await;
    let (first, second, listed, removed, left, refused) = outcome;
    assert_eq!((first.status, first.stdout.text.as_str()), (JobStatus::Succeeded, "1\n"), "{first:?}");
    assert_eq!((second.status, second.stdout.text.as_str()), (JobStatus::Succeeded, "2\n"), "{second:?}");
    assert!(listed.as_ref().is_err_and(|e| e.to_ascii_uppercase().contains("NOPERM")), "a client listed the sessions: {listed:?}");
    assert!(removed >= 2, "the manifest and the file's blob: {removed}");
    assert!(left.is_empty(), "{left:?}");
    for (what, code) in refused {
        assert_eq!(code.as_deref(), Some("NOPERM"), "{what}");
    }
    assert!(!log.contains("panicked"), "{log}");
}
