//! sandq on a RabbitMQ cluster (issue 12, section 2): a 3-node cluster started by the test
//! ([`sandq_tests::cluster::RabbitCluster`]: nodes `sqc<i>-<random>@localhost`, data and logs in
//! a temp dir, one cookie of its own), the SKU and dead-letter quorum queues replicated on the 3
//! nodes, one worker and one client configured with the 3 addresses (`amqp.urls`). Mid-run,
//! first the node the worker and the client are connected to, then the node leading the SKU
//! queue while the worker is connected to another (the leadership is moved off the worker's node
//! first), is stopped (`rabbitmqctl stop`), jobs are submitted while it is down,
//! and it is started again. Then a node a second client is connected to is frozen (SIGSTOP:
//! a hung node) while that client submits: its publish gets no confirm and goes to the next
//! node after `amqp.confirm_timeout`.
//!
//! Asserted: every job ends `succeeded` with the output computed here; each job's `:done` list
//! holds exactly one entry (the compare-and-set pushes it only with the one terminal write); the
//! worker is the same process throughout and reconnected by itself (its log says `consuming`
//! again); one client object made the first 18 submissions and never failed, and the second
//! client's submissions returned while its node was frozen (so another node confirmed them).
//!
//! Ports: `SANDQ_RABBITMQ_CLUSTER_PORT`, the first of 10 consecutive free ports (node i's AMQP
//! port is base + i, its distribution port base + 3 + i); `.ci/run` exports it. Unset: 5700
//! ([`sandq_tests::cluster::DEFAULT_BASE_PORT`]). Redis and S3 are those of `SANDQ_CONFIG`.
//! Wall time on the 2-core test machine: about 1.5 minutes (three node boots in parallel, two
//! joins, two node restarts, 18 two-second jobs).

use std::sync::Arc;
use std::time::{Duration, Instant};

use sandq_client::Client;
use sandq_schemas::names::Names;
use sandq_schemas::{JobSpec, JobStatus, Sku};
use sandq_tests::cluster::RabbitCluster;
use sandq_tests::{exits_within, isolated_worker_log, python_job, Isolated};

/// Job `i`: sleeps 2 s (so that some are running when a node stops), then prints `i * i + 7`.
fn job(i: u64) -> JobSpec {
    python_job(&format!("import time\ntime.sleep(2)\nprint({i} * {i} + 7)\n"), Sku::S)
}

/// What job `i` prints, computed here.
fn expected_stdout(i: u64) -> String {
    format!("{}\n", i * i + 7)
}

async fn submit_range(client: &mut Client, range: std::ops::Range<u64>, jobs: &mut Vec<(u64, String)>) {
    for i in range {
        let spec = job(i);
        client.submit(&spec).await.unwrap_or_else(|e| panic!("submit job {i}: {e}"));
        jobs.push((i, spec.job_id));
    }
}

/// Waits (up to 2 minutes) until one of `jobs` is `running`.
async fn wait_any_running(client: &mut Client, jobs: &[(u64, String)], log: impl Fn() -> String) {
    let started = Instant::now();
    loop {
        for (_, id) in jobs {
            if client.status(id).await.expect("status").is_some_and(|r| r.status == JobStatus::Running) {
                return;
            }
        }
        assert!(started.elapsed() < Duration::from_secs(120), "no job started\nworker log:\n{}", log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits (up to 2 minutes) until the worker's log says `consuming` more than `before` times.
async fn wait_reconnected(worker_id: &str, before: usize) {
    let started = Instant::now();
    while isolated_worker_log(worker_id).matches("consuming").count() <= before {
        assert!(started.elapsed() < Duration::from_secs(120), "the worker did not reconnect\n{}", isolated_worker_log(worker_id));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("blocking task")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_survive_a_node_stop_and_the_queue_leaders_stop() {
    let cluster = Arc::new(blocking(|| RabbitCluster::start(3)).await);
    let urls = cluster.urls();
    let world = Isolated::with_config(|c| {
        c.amqp.urls = urls.clone();
        c.amqp.confirm_timeout = Duration::from_secs(10);
    })
    .await;
    let names = Names::new(world.namespace.clone());
    let queue = names.jobs_queue(Sku::S);
    for q in [queue.clone(), names.dead_letter_queue()] {
        assert_eq!(cluster.queue_members(0, &q), vec![0, 1, 2], "{q} is not replicated on the 3 nodes");
    }
    let worker_id = format!("{}-w", world.namespace);
    let mut worker = world.start_worker_ready(
        &worker_id,
        &[
            ("SANDQ__WARM__PER_SKU", "0"),
            ("SANDQ__SKUS__S__SLOTS", "2"),
            ("SANDQ__SKUS__S__CPUS", "1"),
            ("SANDQ__SKUS__S__MEMORY_BYTES", "536870912"),
        ],
    );
    let log = {
        let id = worker_id.clone();
        move || isolated_worker_log(&id)
    };
    let mut client = world.client().await;
    let mut jobs = Vec::new();

    // 1. The node the worker is connected to stops mid-run.
    submit_range(&mut client, 0..4, &mut jobs).await;
    wait_any_running(&mut client, &jobs, &log).await;
    let on = cluster.connection_nodes(0, &format!("sandq-worker {worker_id}"));
    assert_eq!(on.len(), 1, "the worker has one connection: {on:?}");
    let victim = on[0];
    // Both connected to the first address: the client loses its connection too, and fails
    // over on its next submission.
    assert_eq!(cluster.connection_nodes(0, "sandq-client"), vec![victim], "the client is not on the worker's node");
    eprintln!("stopping node {} (the worker's and the client's)", cluster.nodes[victim].name);
    let consuming = log().matches("consuming").count();
    let c = cluster.clone();
    blocking(move || c.stop_node(victim)).await;
    submit_range(&mut client, 4..8, &mut jobs).await;
    let client_on = cluster.connection_nodes((victim + 1) % 3, "sandq-client");
    assert!(client_on.len() == 1 && client_on[0] != victim, "the client is on {client_on:?}, not on a live node");
    wait_reconnected(&worker_id, consuming).await;
    let c = cluster.clone();
    blocking(move || c.start_node(victim)).await;
    submit_range(&mut client, 8..10, &mut jobs).await;

    // 2. The node leading the SKU queue stops mid-run, while the worker's connection is on
    // another node (the leadership is moved off the worker's node first): the queue elects a
    // new leader and the worker's consumers go on through it.
    let ask = (victim + 1) % 3;
    let worker_on = cluster.connection_nodes(ask, &format!("sandq-worker {worker_id}"));
    assert_eq!(worker_on.len(), 1, "the worker has one connection: {worker_on:?}");
    // Always through the same steps, wherever the leader is: the worker's node's replica is
    // removed (a leader there steps down) and added back.
    let (c, q, from) = (cluster.clone(), queue.clone(), worker_on[0]);
    let other = (from + 1) % 3;
    let leader = blocking(move || c.move_leader_off(other, &q, from)).await;
    let (c, q) = (cluster.clone(), queue.clone());
    let members = blocking(move || {
        // add_member returns before the replica has joined: wait for it.
        let started = Instant::now();
        loop {
            let members = c.queue_members(0, &q);
            if members.len() == 3 || started.elapsed() > Duration::from_secs(60) {
                return members;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    })
    .await;
    assert_eq!(members, vec![0, 1, 2], "{queue} lost a replica");
    submit_range(&mut client, 10..14, &mut jobs).await;
    wait_any_running(&mut client, &jobs[10..], &log).await;
    eprintln!(
        "stopping node {} (the leader of {queue}; the worker is on {})",
        cluster.nodes[leader].name, cluster.nodes[worker_on[0]].name
    );
    let consuming = log().matches("consuming").count();
    let c = cluster.clone();
    blocking(move || c.stop_node(leader)).await;
    submit_range(&mut client, 14..18, &mut jobs).await;
    let c = cluster.clone();
    blocking(move || c.start_node(leader)).await;
    let reconnections = log().matches("consuming").count() - consuming;
    eprintln!("the worker reconnected {reconnections} times while the leader was down (its node stayed up)");

    // 3. A node that hangs (frozen: its connections stay open, it answers nothing) under a
    // client connected to it, neither the worker's node nor the queue's leader if there is
    // such a node: the client's publish gets no confirm within `amqp.confirm_timeout` and is
    // published again on the next node. A submit that returns while the node is frozen was
    // confirmed by another node. When the node resumes, it may still route the first publish:
    // a duplicate delivery, which must not make a second terminal result.
    let worker_node = cluster.connection_nodes(ask, &format!("sandq-worker {worker_id}"))[0];
    let leader_now = cluster.queue_leader(worker_node, &queue).unwrap_or(worker_node);
    let frozen = (0..3).find(|i| *i != worker_node && *i != leader_now).unwrap_or((worker_node + 1) % 3);
    let mut rotated = world.config.clone();
    rotated.amqp.urls = (0..3).map(|k| urls[(frozen + k) % 3].clone()).collect();
    rotated.amqp.confirm_timeout = Duration::from_secs(5);
    let mut hung_client = Client::connect(rotated).await.expect("client on the node to freeze");
    eprintln!(
        "freezing node {} (a client's; the worker is on {}, the leader on {})",
        cluster.nodes[frozen].name, cluster.nodes[worker_node].name, cluster.nodes[leader_now].name
    );
    // (Should a submit panic, the cluster's drop resumes the node before stopping it.)
    cluster.freeze_node(frozen);
    let frozen_at = Instant::now();
    submit_range(&mut hung_client, 18..20, &mut jobs).await;
    let submitted_in = frozen_at.elapsed();
    cluster.thaw_node(frozen);
    eprintln!(
        "the 2 submissions to the frozen node's client returned after {submitted_in:?}; node resumed at {} ms since the epoch",
        sandq_core::time::now_ms()
    );

    // Every job: one terminal result, the right one.
    let mut redis =
        redis::Client::open(world.config.redis.url.as_str()).expect("redis url").get_multiplexed_async_connection().await.expect("redis");
    let started = Instant::now();
    for (i, id) in &jobs {
        let result = loop {
            let current = client.status(id).await.expect("status");
            if let Some(result) = current.filter(|r| r.status.is_terminal()) {
                break result;
            }
            assert!(started.elapsed() < Duration::from_secs(300), "job {i} ({id}) did not finish\nworker log:\n{}", log());
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(result.status, JobStatus::Succeeded, "job {i}: {result:?}\nworker log:\n{}", log());
        assert_eq!(result.stdout.text, expected_stdout(*i), "job {i}");
        let done: usize = redis::cmd("LLEN").arg(names.done_key(id)).query_async(&mut redis).await.expect("LLEN");
        assert_eq!(done, 1, "job {i} ({id}) has {done} terminal writes");
    }
    assert!(matches!(worker.try_wait(), Ok(None)), "the worker exited\n{}", log());
    assert!(log().contains("broker connection lost"), "the worker never lost its connection?\n{}", log());
    assert_eq!(jobs.len(), 20);

    let new_leader = cluster.queue_leader(leader, &queue);
    eprintln!("after the restarts: leader of {queue} on {:?}", new_leader.map(|i| &cluster.nodes[i].name));
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(60)), "the worker did not stop\n{}", log());
    world.delete_queues().await;
}

/// Broker addresses that refuse (a node that is down) or accept TCP but never answer (a node
/// that hangs), listed before the live one: the client skips both (the second after
/// `broker::CONNECT_TIMEOUT`, 10 s) and its job runs. Only loopback: a port nothing listens on and a
/// listener of this test that never accepts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addresses_that_refuse_or_hang_are_skipped() {
    let world = Isolated::new().await;
    let mut worker = world.start_worker_ready(&format!("{}-w", world.namespace), &[("SANDQ__WARM__PER_SKU", "0")]);
    let refusing = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr").port()
    };
    // Bound and listening: the kernel completes TCP handshakes into the backlog, nobody reads.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let silent_port = silent.local_addr().expect("addr").port();
    let mut config = world.config.clone();
    config.amqp.urls = vec![
        format!("amqp://guest:guest@127.0.0.1:{refusing}/%2f"),
        format!("amqp://guest:guest@127.0.0.1:{silent_port}/%2f"),
        world.config.amqp.url.clone(),
    ];
    let mut client = Client::connect(config).await.expect("connect past the dead addresses");
    // The silent address was tried: its connection waits in the backlog.
    silent.set_nonblocking(true).expect("nonblocking");
    assert!(silent.accept().is_ok(), "the client never tried the silent address");
    let spec = job(5);
    client.submit(&spec).await.expect("submit");
    let result = sandq_tests::wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, expected_stdout(5));
    drop(silent);
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(60)));
    world.delete_queues().await;
}
