//! sandq on a Redis Cluster and on a Sentinel-managed primary, through their failover: a worker
//! and the Rust client configured with `[redis] mode = "cluster"` (or `"sentinel"`) run jobs
//! while the Redis primary holding some of the jobs' keys is SIGKILLed and its replica
//! promoted; no job is lost, each has exactly one terminal result, and the results are readable
//! after the failover.
//!
//! The Redis servers are the test's own, on loopback, with their data in a temp dir, killed and
//! removed when the test ends (`sandq_tests::RedisCluster`, `RedisSentinels`); RabbitMQ and S3
//! are the instance's of `scripts/services.sh` as for every test. Ports: the cluster's clients
//! take `$SANDQ_REDIS_CLUSTER_PORT` .. +5 and its bus `$SANDQ_REDIS_CLUSTER_BUS_PORT` .. +5
//! (`.ci/run` exports base + 10 and base + 30); the Sentinel test takes
//! `$SANDQ_REDIS_CLUSTER_PORT` .. +4 (primary, replica, 3 sentinels), after the cluster test (the
//! two take turns). Unset, they default to 17110 and 17130 for a developer's `cargo test`.

use std::time::Duration;

use sandq_client::Client;
use sandq_core::redis_conn::RedisConn;
use sandq_core::results;
use sandq_schemas::names::Names;
use sandq_schemas::{JobSpec, JobStatus, Sku};
use sandq_tests::{
    dead_letter_count, exits_within, isolated_worker_log, poll_until, python_job, ready_messages, redis_cli, redis_cluster_bus_port,
    redis_cluster_port, Isolated, RedisCluster, RedisSentinels,
};

/// The two tests share one block of ports: one at a time.
static PORTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Jobs per test: enough that some finish before the kill and some after.
const JOBS: u64 = 16;

/// Job `i`: sleeps a little (so that jobs are running when the primary dies) and prints i².
fn job(i: u64) -> JobSpec {
    python_job(&format!("import time\ntime.sleep(0.3)\nprint({i} * {i})\n"), Sku::S)
}

/// What job `i` prints, computed here rather than read from anything sandq wrote.
fn expected_stdout(i: u64) -> String {
    format!("{}\n", i * i)
}

/// Worker settings: SKU S small and 2 slots (as the harness's shared worker, but two jobs at
/// once), Redis as `redis` says, results waited for on one replica.
fn worker_env(redis: &sandq_core::config::RedisConfig) -> Vec<(&'static str, String)> {
    let mode = match redis.mode {
        sandq_core::config::RedisMode::Single => "single",
        sandq_core::config::RedisMode::Cluster => "cluster",
        sandq_core::config::RedisMode::Sentinel => "sentinel",
    };
    vec![
        ("SANDQ__REDIS__MODE", mode.to_owned()),
        ("SANDQ__REDIS__NODES", redis.nodes.join(",")),
        ("SANDQ__REDIS__SERVICE", redis.service.clone()),
        // A terminal result is acknowledged by a replica before its delivery is: after the
        // failover the promoted primary has none, every `WAIT` times out and the job is
        // redelivered, finds its result and is acknowledged (the degraded path runs too).
        ("SANDQ__REDIS__WAIT_REPLICAS", "1".to_owned()),
        ("SANDQ__REDIS__WAIT_TIMEOUT", "500ms".to_owned()),
        ("SANDQ__SKUS__S__CPUS", "1".to_owned()),
        ("SANDQ__SKUS__S__MEMORY_BYTES", (512u64 << 20).to_string()),
        ("SANDQ__SKUS__S__SLOTS", "2".to_owned()),
        ("SANDQ__SKUS__S__DISK_BYTES", (1536u64 << 20).to_string()),
    ]
}

/// Statuses of `ids` now (`None`: unknown).
async fn statuses(client: &mut Client, ids: &[String]) -> Vec<Option<JobStatus>> {
    let mut out = Vec::new();
    for id in ids {
        out.push(client.status(id).await.ok().flatten().map(|r| r.status));
    }
    out
}

/// Polls (every 200 ms, up to `limit`) until at least `count` of `ids` are terminal.
async fn wait_terminal(client: &mut Client, ids: &[String], count: usize, limit: Duration, log: impl Fn() -> String) {
    let started = std::time::Instant::now();
    loop {
        let now = statuses(client, ids).await;
        if now.iter().filter(|s| s.is_some_and(JobStatus::is_terminal)).count() >= count {
            return;
        }
        assert!(started.elapsed() < limit, "fewer than {count} jobs terminal after {limit:?}: {now:?}\nworker log:\n{}", log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The checks after the failover: every job succeeded with its own output, its done list holds
/// exactly one entry (the compare-and-set pushes it on the one terminal write it accepts), a
/// fresh client reads every result, and nothing is left in the queue or dead-lettered.
async fn check_every_job(world: &Isolated, redis: &mut RedisConn, ids: &[String]) {
    let names = Names::new(world.namespace.clone());
    let mut fresh = world.client().await;
    for (i, id) in ids.iter().enumerate() {
        let result = fresh.wait(id, Duration::from_secs(60), Duration::from_secs(1), |_| {}).await.expect("readable after the failover");
        assert_eq!(result.status, JobStatus::Succeeded, "job {i}: {result:?}");
        assert_eq!(result.stdout.text, expected_stdout(i as u64), "job {i}");
        let done: Vec<String> = redis::cmd("LRANGE").arg(names.done_key(id)).arg(0).arg(-1).query_async(redis).await.expect("LRANGE");
        assert_eq!(done, vec!["succeeded".to_owned()], "job {i}: terminal writes accepted");
    }
    assert_eq!(ready_messages(&world.config, Sku::S).await, 0, "jobs left in the queue");
    assert_eq!(dead_letter_count(&world.config, 0, Duration::ZERO).await, 0, "jobs dead-lettered");
}

#[tokio::test]
async fn jobs_survive_a_redis_cluster_primary_failover() {
    let _ports = PORTS.lock().await;
    let mut cluster =
        tokio::task::spawn_blocking(|| RedisCluster::start(redis_cluster_port(), redis_cluster_bus_port())).await.expect("cluster");
    let redis_config = cluster.redis_config();
    let mut redis = results::connect(&redis_config).await.expect("cluster connection");

    // The control: key layout 1 put a job's hash and its done list in different slots, which a
    // cluster refuses in one script.
    let legacy = redis::Script::new(results::CAS_SCRIPT)
        .key("sandq:job:j1")
        .key("sandq:job:j1:done")
        .arg("queued")
        .arg("x")
        .arg(60)
        .invoke_async::<i64>(&mut redis)
        .await;
    let error = legacy.expect_err("a script over two slots ran on the cluster");
    assert_eq!(error.kind(), redis::ErrorKind::Server(redis::ServerErrorKind::CrossSlot), "{error}");

    let world = Isolated::with_config(|c| c.redis = redis_config.clone()).await;
    let worker_id = format!("{}-w", world.namespace);
    let env = worker_env(&redis_config);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut worker = world.start_worker_ready(&worker_id, &env);
    let log = || isolated_worker_log(&worker_id);
    let mut client = world.client().await;

    let specs: Vec<JobSpec> = (0..JOBS).map(job).collect();
    let ids: Vec<String> = specs.iter().map(|s| s.job_id.clone()).collect();
    for spec in &specs {
        client.submit(spec).await.expect("submit");
    }
    // Some jobs done, the rest queued or running: kill the primary of a job still to finish,
    // so that its `running` or terminal write meets the failover.
    wait_terminal(&mut client, &ids, 3, Duration::from_secs(240), log).await;
    let now = statuses(&mut client, &ids).await;
    let victim = ids.iter().zip(&now).rev().find(|(_, s)| !s.is_some_and(JobStatus::is_terminal)).map(|(id, _)| id.clone());
    let victim = victim.unwrap_or_else(|| panic!("every job finished before the kill: {now:?}"));
    let names = Names::new(world.namespace.clone());
    let (primary, replica) = cluster.primary_and_replica_of(&names.job_key(&victim));
    cluster.fleet.kill(primary);
    let promoted =
        tokio::task::spawn_blocking(move || poll_until(Duration::from_secs(60), || redis_cli(replica, &["role"]).starts_with("master")))
            .await
            .expect("poll");
    assert!(promoted, "replica {replica} of {primary} not promoted: {}", cluster.fleet.log(replica));

    wait_terminal(&mut client, &ids, ids.len(), Duration::from_secs(300), log).await;
    check_every_job(&world, &mut redis, &ids).await;

    // Waiting with BLPOP on the promoted cluster (a job that is not finished when the wait
    // starts).
    let after = job(JOBS);
    client.submit(&after).await.expect("submit after the failover");
    let result = client.wait(&after.job_id, Duration::from_secs(120), Duration::from_secs(2), |_| {}).await.expect("wait");
    assert_eq!((result.status, result.stdout.text.as_str()), (JobStatus::Succeeded, expected_stdout(JOBS).as_str()), "{}", log());

    // A session on the cluster: its lock, the sessions index and the Rust client's list of the
    // session's jobs (keys of another slot than the jobs') all work, and the second job sees
    // the first one's file.
    let session = format!("s-{}", &world.namespace[11..]);
    let mut first = python_job("open('/work/note.txt', 'w').write('kept')\nprint('wrote')\n", Sku::S);
    first.session = Some(session.clone());
    let mut second = python_job("print(open('/work/note.txt').read())\n", Sku::S);
    second.session = Some(session.clone());
    for spec in [&first, &second] {
        client.submit(spec).await.expect("submit a session job");
        let result = client.wait(&spec.job_id, Duration::from_secs(120), Duration::from_secs(2), |_| {}).await.expect("wait");
        assert_eq!(result.status, JobStatus::Succeeded, "{result:?}\n{}", log());
    }
    let second_result = client.status(&second.job_id).await.expect("status").expect("known");
    assert_eq!(second_result.stdout.text, "kept\n");
    assert_eq!(client.session_jobs(&session).await.expect("session jobs"), vec![first.job_id.clone(), second.job_id.clone()]);

    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(40)), "worker did not stop: {}", log());
    world.delete_queues().await;
}

#[tokio::test]
async fn jobs_survive_a_sentinel_failover() {
    let _ports = PORTS.lock().await;
    let mut sentinels = tokio::task::spawn_blocking(|| RedisSentinels::start(redis_cluster_port())).await.expect("sentinels");
    let redis_config = sentinels.redis_config();
    let mut redis = results::connect(&redis_config).await.expect("sentinel connection");

    let world = Isolated::with_config(|c| c.redis = redis_config.clone()).await;
    let worker_id = format!("{}-w", world.namespace);
    let env = worker_env(&redis_config);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut worker = world.start_worker_ready(&worker_id, &env);
    let log = || isolated_worker_log(&worker_id);
    let mut client = world.client().await;

    let specs: Vec<JobSpec> = (0..JOBS).map(job).collect();
    let ids: Vec<String> = specs.iter().map(|s| s.job_id.clone()).collect();
    for spec in &specs {
        client.submit(spec).await.expect("submit");
    }
    wait_terminal(&mut client, &ids, 3, Duration::from_secs(240), log).await;
    let (primary, replica) = (sentinels.primary, sentinels.replica);
    sentinels.fleet.kill(primary);
    let switched = tokio::task::spawn_blocking({
        let watch = sentinels.sentinels.clone();
        move || {
            poll_until(Duration::from_secs(60), || {
                // Every sentinel: the one that led the failover names the replica first, the
                // others once its new configuration reached them (a race CI hit).
                watch.iter().all(|s| redis_cli(*s, &["sentinel", "get-master-addr-by-name", "mymaster"]).contains(&replica.to_string()))
            })
        }
    })
    .await
    .expect("poll");
    assert!(switched, "the sentinels did not promote {replica}: {}", sentinels.fleet.log(sentinels.sentinels[0]));
    assert_eq!(sentinels.current_primary(), Some(replica));

    wait_terminal(&mut client, &ids, ids.len(), Duration::from_secs(300), log).await;
    check_every_job(&world, &mut redis, &ids).await;

    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(40)), "worker did not stop: {}", log());
    world.delete_queues().await;
}
