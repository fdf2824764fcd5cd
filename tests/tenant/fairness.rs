//! Finding 10: a fair share of each SKU's slots between tenants (docs/threat-model.md
//! "Finding 10"). One tenant's backlog must not hold every slot of a SKU for as long as it
//! lasts: a tenant with nothing running gets the next free slot.

use std::collections::BTreeMap;

use sandq_core::events::{self, EventKind};
use sandq_core::keys::{self, Quotas};
use sandq_schemas::names::Names;
use sandq_tests::gateway as gw;
use sandq_tests::{free_port, metric, small_worker_env, stop_worker, Isolated};

use super::*;

/// Jobs tenant A queues before tenant B submits its one cell.
const BACKLOG: usize = 50;

/// Slots of the worker's SKU S (`small_worker_env`).
const SLOTS: usize = 2;

/// A gateway of this test's own namespace (where its own worker of known slots is the only
/// one), with a key per tenant.
struct World {
    world: Isolated,
    base: String,
    gateway: Child,
    worker: Child,
    /// The worker's `/metrics` port.
    metrics: u16,
}

impl World {
    /// A namespace of its own with a worker of [`SLOTS`] S slots and a gateway.
    async fn start() -> Self {
        let world = Isolated::new().await;
        let metrics = free_port();
        let addr = format!("127.0.0.1:{metrics}");
        let mut env = small_worker_env(&[]);
        env.push(("SANDQ__WORKER__METRICS_ADDR", addr.as_str()));
        let worker = world.start_worker_ready(&format!("{}-fair", world.namespace), &env);
        let log = std::env::temp_dir().join(format!("{}-fair-gateway.log", world.namespace));
        let (gateway, base) = gw::start(&log, &[("SANDQ__NAMESPACE", world.namespace.as_str())]);
        World { world, base, gateway, worker, metrics }
    }

    /// Stops the gateway and the worker, deletes the namespace's queues.
    /// How many deliveries the worker sent round the queue for another tenant's turn.
    fn rotated(&self) -> f64 {
        metric(self.metrics, r#"sandq_fair_turns_total{sku="S",turn="rotated"}"#).expect("the worker's /metrics")
    }

    async fn stop(self) {
        let World { world, mut gateway, worker, .. } = self;
        drop(gateway.stdin.take());
        let _ = gateway.wait();
        stop_worker(worker);
        world.delete_queues().await;
    }

    /// How many `attempt` events job `job_id` (the queue's id) has in its live stream.
    async fn attempts(&self, job_id: &str) -> usize {
        let mut redis = sandq_core::redis_conn::connect(&self.world.config.redis).await.expect("redis");
        let key = Names::new(self.world.namespace.clone()).events_key(job_id);
        let page = events::read(&mut redis, &key, events::START, 10_000, None).await.expect("events");
        page.iter().filter(|e| matches!(e.kind, EventKind::Attempt { .. })).count()
    }

    /// A new tenant and its key: `(tenant, key)`.
    async fn key(&self, label: &str) -> (String, String) {
        let quotas = Quotas { max_in_flight: 200, jobs_per_minute: 500, ..Quotas::default() };
        let mut redis = sandq_core::redis_conn::connect(&self.world.config.redis).await.expect("redis");
        let names = Names::new(self.world.namespace.clone());
        let tenant = gw::tenant(label);
        let key = keys::create(&mut redis, &names, &tenant, "test", quotas).await.expect("create key").1;
        (tenant, key)
    }

    async fn post(&self, key: &str, body: &Value) -> Value {
        let response = http().post(format!("{}/v1/jobs", self.base)).bearer_auth(key).json(body).send().await.expect("POST");
        let status = response.status();
        let job: Value = response.json().await.unwrap_or(Value::Null);
        assert_eq!(status, StatusCode::CREATED, "{job}");
        job
    }

    async fn wait(&self, key: &str, id: &str) -> Value {
        let started = Instant::now();
        loop {
            let response = http().get(format!("{}/v1/jobs/{id}?wait=20s", self.base)).bearer_auth(key).send().await.expect("GET");
            assert_eq!(response.status(), StatusCode::OK);
            let job: Value = response.json().await.expect("json");
            if !["queued", "running"].contains(&job["status"].as_str().unwrap_or_default()) {
                return job;
            }
            assert!(started.elapsed() < Duration::from_secs(150), "job {id} still {}", job["status"]);
        }
    }
}

fn started_at(job: &Value) -> Option<u64> {
    job["started_at_ms"].as_u64()
}

/// Finding 10: tenant A queues 50 jobs of 2 s on SKU S of a 2-slot worker, then
/// tenant B submits one trivial cell. First come, first served, B's cell started only after
/// all of A's (seen: 18-32 s behind another client's backlog). Now B's cell takes the first
/// slot that frees: no more of A's jobs start before it than had started when B submitted, plus
/// at most one (a slot deciding at that very moment). A's jobs are then cancelled, and every one
/// of them is over exactly once: none lost, none run twice (at most one attempt each, exactly
/// one for those that succeeded).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_with_nothing_running_gets_the_next_slot_ahead_of_another_tenants_backlog() {
    let world = World::start().await;
    let ((a_tenant, a), (_, b)) = (world.key("faira").await, world.key("fairb").await);

    for n in 0..BACKLOG {
        let body = json!({"job_id": format!("a{n}"), "runtime": "python", "code": "import time; time.sleep(2)", "sku": "S"});
        world.post(&a, &body).await;
    }
    let queued = world.post(&b, &json!({"job_id": "b", "runtime": "python", "code": "print('b')", "sku": "S"})).await;
    let b_queued_at = queued["queued_at_ms"].as_u64().expect("queued_at_ms");
    let b_job = world.wait(&b, "b").await;
    assert_eq!(b_job["status"], "succeeded", "{b_job}");
    let b_started = started_at(&b_job).expect("B's cell started");

    // A's jobs as they are now: which started before B's cell, and before B submitted it.
    let mut a_jobs = BTreeMap::new();
    for n in 0..BACKLOG {
        let response = http().get(format!("{}/v1/jobs/a{n}", world.base)).bearer_auth(&a).send().await.expect("GET");
        assert_eq!(response.status(), StatusCode::OK);
        a_jobs.insert(n, response.json::<Value>().await.expect("json"));
    }
    let started_before = |instant: u64| a_jobs.values().filter(|j| started_at(j).is_some_and(|s| s < instant)).count();
    let first_wave = started_before(b_queued_at);
    let ahead_of_b = started_before(b_started);
    assert!(world.rotated() >= 1.0, "B's turn comes by sending A's jobs round the queue");
    eprintln!("A's jobs started before B submitted: {first_wave}; before B's cell started: {ahead_of_b}");
    assert!(
        first_wave + SLOTS < BACKLOG / 2,
        "the test needs A's backlog still queued when B submits: {first_wave} of A's jobs had started by then"
    );
    assert!(
        ahead_of_b <= first_wave + 1,
        "{ahead_of_b} of A's jobs started before B's cell, of which {first_wave} before B submitted it: \
         B waited behind A's backlog"
    );

    // Cancel A's leftovers (those over answer 409), then every one of A's jobs is over once.
    for n in 0..BACKLOG {
        let response = http().delete(format!("{}/v1/jobs/a{n}", world.base)).bearer_auth(&a).send().await.expect("DELETE");
        assert!([StatusCode::ACCEPTED, StatusCode::CONFLICT].contains(&response.status()), "a{n}: {}", response.status());
    }
    let (mut succeeded, mut cancelled) = (0, 0);
    for n in 0..BACKLOG {
        let job = world.wait(&a, &format!("a{n}")).await;
        let status = job["status"].as_str().unwrap_or_default().to_owned();
        let attempts = world.attempts(&format!("{a_tenant}_a{n}")).await;
        match status.as_str() {
            "succeeded" => {
                succeeded += 1;
                assert_eq!(attempts, 1, "a{n} succeeded after {attempts} attempts: {job}");
                assert_eq!(job["attempt"], 1, "a{n}: {job}");
            }
            "cancelled" => {
                cancelled += 1;
                assert!(attempts <= 1, "a{n} was cancelled after {attempts} attempts: {job}");
            }
            other => panic!("a{n} ended {other}: {job}"),
        }
    }
    eprintln!("A's jobs: {succeeded} succeeded, {cancelled} cancelled");
    assert_eq!(succeeded + cancelled, BACKLOG);
    assert!(succeeded >= first_wave.min(SLOTS), "A's running jobs ran to their end: {succeeded}");

    world.stop().await;
}

/// Finding 10, the bound: a count that names a job nobody will ever take (here a tenant's job
/// recorded as queued by a gateway that died before publishing it) makes another tenant's jobs
/// go round while it lasts, but each at most `MAX_ROTATIONS` times: every job still runs, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_count_sends_a_job_round_a_bounded_number_of_times_and_it_runs_once() {
    let world = World::start().await;
    let mut redis = sandq_core::redis_conn::connect(&world.world.config.redis).await.expect("redis");
    let names = Names::new(world.world.namespace.clone());
    let phantom = format!("{}_never-published", gw::tenant("ghost"));
    let hour_from_now = sandq_core::time::now_ms() + 3_600_000;
    sandq_core::fair::queued(&mut redis, &names, sandq_schemas::Sku::S, &phantom, hour_from_now).await.expect("record");
    let (a_tenant, a) = world.key("stalea").await;

    // While one of A's jobs runs, the ghost tenant "waits" with none running: A's others go round.
    let jobs = 4;
    for n in 0..jobs {
        world.post(&a, &json!({"job_id": format!("s{n}"), "runtime": "python", "code": "import time; time.sleep(2)", "sku": "S"})).await;
    }
    for n in 0..jobs {
        let job = world.wait(&a, &format!("s{n}")).await;
        assert_eq!(job["status"], "succeeded", "s{n}: {job}");
        assert_eq!(job["attempt"], 1, "s{n}: {job}");
        assert_eq!(world.attempts(&format!("{a_tenant}_s{n}")).await, 1, "s{n} ran once: {job}");
    }
    // Jobs went round (the ghost tenant "waited"), each at most MAX_ROTATIONS (4) times.
    let rotated = world.rotated();
    assert!((1.0..=(4 * jobs) as f64).contains(&rotated), "{rotated} rounds for {jobs} jobs");
    sandq_core::fair::not_queued(&mut redis, &names, sandq_schemas::Sku::S, &phantom).await.expect("forget the ghost's record");
    world.stop().await;
}

/// Finding 10: a session's job never goes round: sent round, a cell could run after the next
/// cell of its session. With a waiting tenant that has nothing running (a stale count, as
/// above) and one of A's jobs running, every cell of A's session would be A's to send round;
/// none goes round, and the cells run in the order submitted (each appends its number to a
/// session file and prints it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_job_never_goes_round() {
    let world = World::start().await;
    let mut redis = sandq_core::redis_conn::connect(&world.world.config.redis).await.expect("redis");
    let names = Names::new(world.world.namespace.clone());
    let phantom = format!("{}_never-published", gw::tenant("ghost"));
    let hour_from_now = sandq_core::time::now_ms() + 3_600_000;
    sandq_core::fair::queued(&mut redis, &names, sandq_schemas::Sku::S, &phantom, hour_from_now).await.expect("record");
    let (_, a) = world.key("sessa").await;

    world.post(&a, &json!({"job_id": "long", "runtime": "python", "code": "import time; time.sleep(8)", "sku": "S"})).await;
    let cells = 3;
    for n in 1..=cells {
        let code = format!("open('order.txt', 'a').write('{n}')\nprint(open('order.txt').read())");
        world.post(&a, &json!({"job_id": format!("c{n}"), "runtime": "python", "code": code, "sku": "S", "session": "order"})).await;
    }
    for n in 1..=cells {
        let job = world.wait(&a, &format!("c{n}")).await;
        assert_eq!(job["status"], "succeeded", "c{n}: {job}");
        let expected: String = (1..=n).map(|k| k.to_string()).collect();
        assert_eq!(job["stdout"]["text"], format!("{expected}\n"), "c{n} ran after the cells before it only: {job}");
    }
    assert_eq!(world.wait(&a, "long").await["status"], "succeeded");
    assert!(world.rotated() < 0.5, "no session cell went round: {}", world.rotated());
    sandq_core::fair::not_queued(&mut redis, &names, sandq_schemas::Sku::S, &phantom).await.expect("forget the ghost's record");
    world.stop().await;
}
