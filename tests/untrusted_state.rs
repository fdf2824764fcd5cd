//! State a client may write cannot lose, rerun or leak anybody's job. Clients write Redis
//! (their jobs' records, their sessions' keys, and without the ACL of docs/operations.md any
//! key) and S3 (`inputs/sha256/<digest>`), so everything read from there is untrusted data. A
//! client's record never makes the worker delete a stored result's objects; a sessions index,
//! session members, session locks or a script cache a client rewrote never rerun a job, keep a
//! session for ever or break the session listing; a poisoned input object is removed and
//! uploaded again; and under the ACL recipe a client keeps its own jobs and sessions but cannot
//! write the workers' keys or list anybody else's.
//!
//! Each test starts its own worker (when it needs one) in a namespace of its own.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sandq_core::storage;
use sandq_schemas::names::Names;
use sandq_schemas::{JobResult, JobSpec, JobStatus, Sku};
use sandq_tests::{python_job, Isolated};
use sha2::Digest;

/// A job of `session` that appends a line to `runs.txt` (a session file) and prints how many
/// lines it has: a job run twice prints one more than it should.
fn counting_job(session: &str) -> JobSpec {
    let mut spec =
        python_job("with open('runs.txt', 'a') as f:\n    f.write('run\\n')\nprint(len(open('runs.txt').read().splitlines()))\n", Sku::S);
    spec.session = Some(session.to_owned());
    spec
}

/// The public file's bytes: unique to this run (content-addressed keys are shared by every
/// namespace of the bucket).
fn public_file() -> Vec<u8> {
    format!("id,value\n1,{}\n", uuid::Uuid::new_v4().simple()).into_bytes()
}

/// When an attempt's terminal write is refused, its objects are deleted only if another result
/// is stored, whatever a client wrote there: the stored record is this attempt's when its bytes
/// are those of the refused result (a write that reached Redis, then was sent again), another's
/// when they differ under a terminal status, and unknown otherwise (the objects are then kept).
/// Checked against Redis directly.
#[tokio::test]
async fn a_refused_result_is_compared_in_redis_byte_for_byte() {
    use sandq_core::results::{self, Stored};
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
    let () =
        redis::cmd("HSET").arg(names.job_key(&job_id)).arg("status").arg(b"\xff".as_slice()).query_async(&mut redis).await.expect("hset");
    assert_eq!(results::compare_stored(&mut redis, &names, &theirs).await.expect("compare"), Stored::Unknown);
    let () = redis::cmd("DEL").arg(names.job_key(&job_id)).arg(names.done_key(&job_id)).query_async(&mut redis).await.expect("del");
    world.delete_queues().await;
}

/// Any client may write `inputs/sha256/<digest>`: other bytes stored under a digest it could
/// guess (a public dataset's) must not deny that file to everyone. The worker removes an object
/// that provably does not hold the bytes its name says, the Rust client uploads again when the
/// stored size differs, and a job that merely declares a wrong size removes nothing.
#[tokio::test]
async fn a_poisoned_input_object_is_removed_and_uploaded_again() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[]));
    let mut client = world.client().await;
    let (s3, bucket) = (storage::client(&world.config.s3), world.config.s3.bucket.clone());
    let dir = tempfile::tempdir().expect("tempdir");
    let job_reading = |input: sandq_schemas::InputFile| {
        let mut spec = python_job("print(open('data.csv').read().splitlines()[1])", Sku::S);
        spec.inputs = vec![input];
        spec
    };

    // 1. Other bytes of another size under the file's digest: the client sees the size differ
    //    and uploads again; the job reads the right bytes.
    let bytes = public_file();
    let digest = hex::encode(sha2::Sha256::digest(&bytes));
    let key = sandq_schemas::names::input_key(&digest);
    storage::put_bytes(&s3, &bucket, &key, b"garbage".to_vec(), "text/plain").await.expect("poison");
    let local = dir.path().join("public.csv");
    std::fs::write(&local, &bytes).expect("write");
    let input = client.upload(&local, "data.csv").await.expect("upload");
    let first = sandq_tests::run(&mut client, &job_reading(input)).await;
    let expected_line = format!("{}\n", String::from_utf8_lossy(&bytes).lines().nth(1).expect("line 2"));

    // 2. Other bytes of the same size: the client cannot tell and skips the upload; the job is
    //    rejected, the worker removes the object, and the job submitted again runs.
    let bytes2 = public_file();
    let digest2 = hex::encode(sha2::Sha256::digest(&bytes2));
    let key2 = sandq_schemas::names::input_key(&digest2);
    let same_size: Vec<u8> = vec![b'x'; bytes2.len()];
    storage::put_bytes(&s3, &bucket, &key2, same_size, "text/plain").await.expect("poison");
    let local2 = dir.path().join("public2.csv");
    std::fs::write(&local2, &bytes2).expect("write");
    let input2 = client.upload(&local2, "data.csv").await.expect("upload");
    let poisoned = sandq_tests::run(&mut client, &job_reading(input2.clone())).await;
    let after_reject = storage::object_size(&s3, &bucket, &key2).await.expect("head");
    let input2 = client.upload(&local2, "data.csv").await.expect("upload again");
    let again = sandq_tests::run(&mut client, &job_reading(input2)).await;
    let expected_line2 = format!("{}\n", String::from_utf8_lossy(&bytes2).lines().nth(1).expect("line 2"));

    // 3. A job that declares a wrong size for a good object: rejected, and the object stays
    //    (the worker hashed it and found it holds its name's bytes).
    let mut wrong = client.upload(&local, "data.csv").await.expect("upload");
    wrong.size += 1;
    let lying = sandq_tests::run(&mut client, &job_reading(wrong)).await;
    let kept = storage::object_size(&s3, &bucket, &key).await.expect("head");

    let log = sandq_tests::isolated_worker_log(&id);
    sandq_tests::stop_worker(worker);
    world.delete_queues().await;
    let _ = storage::delete_keys(&s3, &bucket, &[key.clone(), key2.clone()]).await;
    assert_eq!((first.status, first.stdout.text.as_str()), (JobStatus::Succeeded, expected_line.as_str()), "{first:?}");
    assert_eq!(poisoned.status, JobStatus::Rejected, "{poisoned:?}");
    let reason = poisoned.reason.as_deref().unwrap_or("");
    assert!(reason.contains("was removed: submitting the job again uploads the file afresh"), "{reason}");
    assert_eq!(after_reject, None, "the poisoned object is still there");
    assert_eq!((again.status, again.stdout.text.as_str()), (JobStatus::Succeeded, expected_line2.as_str()), "{again:?}");
    assert_eq!(lying.status, JobStatus::Rejected, "{lying:?}");
    assert!(lying.reason.as_deref().is_some_and(|r| r.contains("does not match the job's declared size")), "{lying:?}");
    assert_eq!(kept, Some(bytes.len() as u64), "a good object was removed on a job's wrong size");
    assert!(!log.contains("panicked"), "{log}");
}

/// The sessions index (`<ns>:sessions`) is a hint that clients may write; the manifests in S3
/// are the state. While a client keeps the index a string, two jobs of one session each run once
/// and succeed (their files carried from one to the next): a failed index update is never
/// retried as an infrastructure failure. Once the client also removed the session from the
/// index, the session is still deleted after it expired: the index is rebuilt from S3.
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
        let (attacking, mut redis, key) = (attacking.clone(), sandq_tests::plain_redis(&world).await, names.sessions_index());
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
    let mut redis = sandq_tests::plain_redis(&world).await;
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
    let _: i64 =
        redis::cmd("DEL").arg(names.sessions_index()).arg(names.sessions_rebuilt_key()).query_async(&mut redis).await.expect("del");
    let _ = client.remove_session(&session, Duration::from_secs(10)).await;
    assert!(writes > 10, "the attacker wrote the index {writes} times");
    for (n, result) in [(1, &first), (2, &second)] {
        assert_eq!(
            (result.status, result.attempt, result.stdout.text.as_str()),
            (JobStatus::Succeeded, 1, format!("{n}\n").as_str()),
            "job {n}: {result:?}"
        );
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

/// The session reaper reads members of the sessions index that clients may write: one that is
/// not UTF-8 or not a valid session name (`victim/blobs` would name another session's S3
/// prefix) is removed and never used as a prefix, and a due name whose lock is held is moved
/// later rather than kept at the head of the index, where 100 of them would fill the reaper's
/// window of 100 for ever. An expired session behind them is still reaped.
#[tokio::test]
async fn invalid_or_locked_index_members_do_not_stop_the_session_reaper() {
    let world = Isolated::new().await;
    let env = sandq_tests::small_worker_env(&[("SANDQ__SESSIONS__IDLE_TIMEOUT", "2s"), ("SANDQ__SESSIONS__REAP_INTERVAL", "500ms")]);
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &env);
    let names = Names::new(world.namespace.clone());
    let mut redis = sandq_tests::plain_redis(&world).await;
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
        let (s3, bucket, prefix) =
            (sandq_core::storage::client(&world.config.s3), world.config.s3.bucket.clone(), names.session_prefix(&session));
        async move { sandq_core::storage::list(&s3, &bucket, &prefix, 1000).await.expect("list") }
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
    let score: Option<f64> =
        redis::cmd("ZSCORE").arg(names.sessions_index()).arg(&locked[0]).query_async(&mut redis).await.expect("zscore");
    let log = sandq_tests::isolated_worker_log(&id);
    sandq_tests::stop_worker(worker);
    for name in &locked {
        let () = redis::cmd("DEL").arg(names.session_lock_key(name)).query_async(&mut redis).await.expect("del");
    }
    let () = redis::cmd("DEL").arg(names.sessions_index()).query_async(&mut redis).await.expect("del");
    world.delete_queues().await;
    assert!(
        reaped,
        "the expired session is still in S3 60 s later; reaper log:\n{}",
        log.lines().filter(|l| l.contains("reap")).take(5).collect::<Vec<_>>().join("\n")
    );
    assert_eq!(invalid_left, vec![None, None], "invalid members are removed from the index");
    assert!(score.is_some_and(|s| s > 0.0), "a locked due name is moved later in the index: {score:?}");
    assert!(!log.contains("session reaper failed"), "the reaper failed:\n{log}");
}

/// Any Redis user with `@scripting` may `SCRIPT FLUSH`. Jobs submitted and run while another
/// connection flushes the script cache as fast as it can each run once and store their results:
/// every sandq script goes by `EVAL` with its source, so nothing depends on the server's cache.
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
        assert_eq!(
            (result.status, result.attempt, result.stdout.text.as_str()),
            (JobStatus::Succeeded, 1, format!("{i}\n").as_str()),
            "{result:?}"
        );
    }
    assert!(
        !log.contains("NoScript"),
        "a script failed on the flushed cache:\n{}",
        log.lines().filter(|l| l.contains("NoScript")).take(3).collect::<Vec<_>>().join("\n")
    );
}

/// A client may write its own session's lock: a lock holding a list, bytes that are not UTF-8,
/// or terminal escapes with a forged row must neither fail nor spoof `sandq session ls` for
/// every session. Each such holder lists as `?`, a worker's holder id as itself, and every
/// session is listed.
#[tokio::test]
async fn session_locks_a_client_wrote_neither_fail_nor_spoof_the_listing() {
    let world = Isolated::new().await;
    let names = Names::new(world.namespace.clone());
    let mut redis =
        redis::Client::open(world.config.redis.url.as_str()).expect("redis").get_multiplexed_async_connection().await.expect("redis");
    let sessions = ["s-list", "s-bytes", "s-escape", "s-held", "s-free"];
    for (i, name) in sessions.iter().enumerate() {
        let () =
            redis::cmd("ZADD").arg(names.sessions_index()).arg(1_000 + i as u64).arg(*name).query_async(&mut redis).await.expect("zadd");
    }
    let _: i64 = redis::cmd("RPUSH").arg(names.session_lock_key("s-list")).arg("x").query_async(&mut redis).await.expect("rpush");
    let () =
        redis::cmd("SET").arg(names.session_lock_key("s-bytes")).arg(b"\xff\xfe".as_slice()).query_async(&mut redis).await.expect("set");
    let () = redis::cmd("SET")
        .arg(names.session_lock_key("s-escape"))
        .arg("job\x1b[2J\nFAKE-SESSION 999")
        .query_async(&mut redis)
        .await
        .expect("set");
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

/// The deployment that keeps clients to their own keys (docs/operations.md "Redis ACL for
/// clients"): a client whose Redis user may use only its jobs' and sessions' keys still submits,
/// waits, runs session jobs and removes a session. Its writes of the sessions index, the rebuild
/// turn, the deferred checks and a job's round count (the fair share's) are refused (`NOPERM`),
/// and so is every command that would name
/// other clients' sessions and job ids (listing the sessions, `SCAN`, `KEYS`, `RANDOMKEY`,
/// client-side caching's broadcast of written keys, a cluster's keys by slot) or break every
/// client's scripts (`SCRIPT FLUSH`, `FUNCTION FLUSH`).
#[tokio::test]
async fn a_client_denied_the_workers_keys_by_acl_still_runs_and_removes_sessions() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[]));
    let names = Names::new(world.namespace.clone());
    let mut admin = sandq_tests::plain_redis(&world).await;
    let (user, password) = (format!("client-{}", world.namespace), uuid::Uuid::new_v4().simple().to_string());
    // The rules of docs/operations.md, for this namespace.
    let ns = &world.namespace;
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(&user)
        .arg("reset")
        .arg("on")
        .arg(format!(">{password}"))
        .arg(format!("~{ns}:job:{{*}}"))
        .arg(format!("~{ns}:job:{{*}}:done"))
        .arg(format!("~{ns}:job:{{*}}:cancel"))
        .arg(format!("~{ns}:job:{{*}}:source"))
        .arg(format!("%R~{ns}:job:{{*}}:events"))
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
        let mut client = sandq_client::Client::connect(config.clone()).await.expect("client as the ACL user");
        let session = format!("acl-{}", uuid::Uuid::new_v4().simple());
        let first = sandq_tests::run(&mut client, &counting_job(&session)).await;
        let second = sandq_tests::run(&mut client, &counting_job(&session)).await;
        // Its job's live events: read, not written.
        let events = sandq_core::events::read(
            &mut sandq_core::results::connect(&config.redis).await.expect("redis as the ACL user"),
            &names.events_key(&first.job_id),
            sandq_core::events::START,
            100,
            None,
        )
        .await
        // The stream's stdout whole: an unbuffered `print` writes its text and its newline
        // apart, and under load they land in two entries.
        .map(|events| {
            let stdout: String = events
                .iter()
                .filter_map(|e| match &e.kind {
                    sandq_core::events::EventKind::Stdout(t) => Some(t.as_str()),
                    _ => None,
                })
                .collect();
            stdout == "1\n"
        })
        .map_err(|e| e.to_string());
        let listed = client.sessions(100).await.map(|l| l.len()).map_err(|e| e.to_string());
        let removed = client.remove_session(&session, Duration::from_secs(10)).await.expect("remove session");
        let (s3, bucket) = (storage::client(&world.config.s3), world.config.s3.bucket.clone());
        let left = storage::list(&s3, &bucket, &names.session_prefix(&session), 100).await.expect("list");
        let mut as_client =
            redis::Client::open(config.redis.url.as_str()).expect("redis").get_multiplexed_async_connection().await.expect("redis");
        let mut refused = Vec::new();
        for (command, key, args) in [
            ("XADD", names.events_key(&first.job_id), &["*", "type", "end"][..]),
            ("SET", names.sessions_index(), &["x"][..]),
            ("ZREM", names.sessions_index(), &["x"][..]),
            ("SET", names.sessions_rebuilt_key(), &["x"][..]),
            ("SET", names.deferred_checks(), &["x"][..]),
            ("SET", names.rounds_key(&first.job_id), &["1"][..]),
        ] {
            let mut cmd = redis::cmd(command);
            cmd.arg(&key).arg(args);
            let reply: Result<redis::Value, redis::RedisError> = cmd.query_async(&mut as_client).await;
            refused.push((format!("{command} {key}"), reply.err().and_then(|e| e.code().map(str::to_owned))));
        }
        for command in [
            vec!["ZRANGE".to_owned(), names.sessions_index(), "0".to_owned(), "-1".to_owned()],
            vec!["SCAN".to_owned(), "0".to_owned()],
            vec!["RANDOMKEY".to_owned()],
            vec!["KEYS".to_owned(), "*".to_owned()],
            ["CLIENT", "TRACKING", "ON", "BCAST"].map(str::to_owned).to_vec(),
            vec!["DBSIZE".to_owned()],
            ["MEMORY", "STATS"].map(str::to_owned).to_vec(),
            ["CLUSTER", "GETKEYSINSLOT", "0", "10"].map(str::to_owned).to_vec(),
            ["SCRIPT", "FLUSH"].map(str::to_owned).to_vec(),
            ["FUNCTION", "FLUSH"].map(str::to_owned).to_vec(),
        ] {
            let mut cmd = redis::cmd(&command[0]);
            for arg in &command[1..] {
                cmd.arg(arg);
            }
            let reply: Result<redis::Value, redis::RedisError> = cmd.query_async(&mut as_client).await;
            refused.push((command.join(" "), reply.err().and_then(|e| e.code().map(str::to_owned))));
        }
        (first, second, listed, removed, left, refused, events)
    }
    .await;
    let log = sandq_tests::isolated_worker_log(&id);
    let _: i64 = redis::cmd("ACL").arg("DELUSER").arg(&user).query_async(&mut admin).await.expect("acl deluser");
    sandq_tests::stop_worker(worker);
    world.delete_queues().await;
    let (first, second, listed, removed, left, refused, events) = outcome;
    assert_eq!(events, Ok(true), "the client reads its job's live events");
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
