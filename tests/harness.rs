//! Test harness: one real `sandq-worker` process per test binary, on the real RabbitMQ, Redis
//! and Garage that `scripts/services.sh` brought up, in its own namespace (`sandq-test`), so
//! tests never touch a deployment's queues.
//!
//! The worker is started with `--exit-on-stdin-eof` and a pipe on its stdin: when the test
//! process ends, the pipe closes and the worker shuts down by itself.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use lapin::options::{BasicPublishOptions, QueuePurgeOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use sandq_client::Client;
use sandq_core::config::{self, ServiceConfig};
use sandq_schemas::{JobResult, JobSpec, Runtime, Sku};

/// Name of this test binary (`e2e`, `hostile`), from its path (`target/debug/deps/e2e-<hash>`).
pub fn binary_name() -> String {
    let exe = std::env::current_exe().expect("current exe");
    let stem = exe.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    stem.rsplit_once('-').map_or(stem.clone(), |(name, _)| name.to_owned())
}

/// Namespace of every queue and key this test binary uses: `sandq-test-<binary>`, so that test
/// binaries (run one after another) never share queues, and never touch a deployment's.
/// `$SANDQ_TEST_SUFFIX`, when set, is appended (`sandq-test-<binary>-<suffix>`), so that two
/// checkouts can run the same binary side by side against the same services.
pub fn namespace() -> String {
    format!("sandq-test-{}{}", binary_name(), suffix())
}

/// Worker id of this binary's worker (its private job and state dirs), with the same suffix.
pub fn worker_id() -> String {
    format!("test-{}{}", binary_name(), suffix())
}

/// `-<$SANDQ_TEST_SUFFIX>`, or nothing.
fn suffix() -> String {
    std::env::var("SANDQ_TEST_SUFFIX").ok().filter(|s| !s.is_empty()).map(|s| format!("-{s}")).unwrap_or_default()
}

/// The repository's root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("repo root").to_path_buf()
}

/// Directory of the built binaries (`target/debug`), found from the test binary's own path
/// (`target/debug/deps/e2e-<hash>`); `SANDQ_TEST_BIN_DIR` when set: a copy of this tree's
/// binaries (`sandq-worker` with `sandq-container` beside it, `sandq`, `sandq-loadtest` for
/// the tests that run them), on a host whose target dir other trees share and overwrite.
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SANDQ_TEST_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let exe = std::env::current_exe().expect("current exe");
    exe.parent().and_then(Path::parent).expect("target dir").to_path_buf()
}

/// The service config written by `scripts/services.sh`, moved to the test namespace.
pub fn service_config() -> ServiceConfig {
    let path = config::config_path(None);
    let mut config: ServiceConfig = config::load(&path).expect("service config (run scripts/services.sh first)");
    config.namespace = namespace();
    config
}

/// Garage's directory in the services the tests use: `$SANDQ_GARAGE_DIR` when set (CI's
/// instance of its own, `.ci/run`), else the default of `scripts/services.sh`.
pub fn garage_dir() -> PathBuf {
    std::env::var_os("SANDQ_GARAGE_DIR").map_or_else(|| PathBuf::from("/var/lib/sandq-garage"), PathBuf::from)
}

/// SIGKILLs the Garage server of the services the tests use (an outage as a crash), and only
/// that one: another Garage on the machine keeps running. True when one was running.
pub fn kill_garage() -> bool {
    let pattern = format!("garage -c {} server", garage_dir().join("garage.toml").display());
    Command::new("pkill").args(["-KILL", "-f", &pattern]).status().expect("pkill").success()
}

/// Brings the services the tests use back up with `scripts/services.sh`, which restarts what is
/// down; the script inherits the environment that chose the instance (`SANDQ_CONFIG`,
/// `SANDQ_GARAGE_DIR`, the ports). True when it succeeded.
pub fn restart_services() -> bool {
    Command::new(repo_root().join("scripts/services.sh")).stderr(Stdio::null()).status().expect("services.sh").success()
}

/// Where the workers keep their job dirs (`<dir>/<worker id>/`): `SANDQ__WORKER__DATA_DIR` when
/// set (the workers the tests start inherit it; CI sets one per run), else the worker's default.
pub fn worker_data_dir() -> PathBuf {
    std::env::var_os("SANDQ__WORKER__DATA_DIR").map_or_else(|| PathBuf::from("/var/lib/sandq"), PathBuf::from)
}

/// Where the workers keep container state (`<dir>/<worker id>/`): `SANDQ__WORKER__STATE_DIR`
/// when set, else the worker's default.
pub fn worker_state_dir() -> PathBuf {
    std::env::var_os("SANDQ__WORKER__STATE_DIR").map_or_else(|| PathBuf::from("/run/sandq"), PathBuf::from)
}

/// The port of a service URL (`amqp://guest:guest@127.0.0.1:5672/%2f` -> 5672): tests read the
/// services' ports from the config, never assume the defaults.
pub fn service_port(url: &str) -> u16 {
    let authority = url.split_once("://").map_or(url, |(_, rest)| rest).split('/').next().unwrap_or_default();
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, host_port)| host_port);
    host_port.rsplit_once(':').and_then(|(_, port)| port.parse().ok()).unwrap_or_else(|| panic!("no port in {url}"))
}

pub mod cluster;
#[path = "harness/gateway.rs"]
pub mod gateway;

/// Connects to the broker of `config`: the first of `amqp.urls` that answers, else `amqp.url`
/// ([`sandq_core::broker::connect`]).
///
/// # Errors
/// The last address's error.
pub async fn amqp_connect(config: &ServiceConfig) -> Result<Connection, lapin::Error> {
    Ok(sandq_core::broker::connect(&config.amqp.addresses(), 0, &ConnectionProperties::default()).await?.0)
}

static WORKER: OnceLock<Mutex<Child>> = OnceLock::new();

/// Starts the shared worker once per test binary (purging the test queues first). SKU S is
/// served with 512 MiB of memory so that memory tests are quick, and a 1.5 GiB `/work`.
pub fn ensure_worker() {
    WORKER.get_or_init(|| {
        // Tests call this from inside their own runtime: purge on a thread of our own.
        std::thread::spawn(|| tokio::runtime::Runtime::new().expect("runtime").block_on(purge_queues())).join().expect("purge test queues");
        let worker = bin_dir().join("sandq-worker");
        assert!(worker.exists(), "{} missing: build the workspace first", worker.display());
        let log = std::fs::File::create(worker_log_path()).expect("log file");
        let child = Command::new(worker)
            .arg("--exit-on-stdin-eof")
            .env("SANDQ__NAMESPACE", namespace())
            .env("SANDQ__WORKER__ID", worker_id())
            .env("SANDQ__SKUS__S__CPUS", "1")
            .env("SANDQ__SKUS__S__MEMORY_BYTES", (512u64 << 20).to_string())
            .env("SANDQ__SKUS__S__SLOTS", "1")
            .env("SANDQ__SKUS__S__DISK_BYTES", (1536u64 << 20).to_string())
            // Declared capacity above this 2-core machine's, so that every SKU is served.
            .env("SANDQ__WORKER__CAPACITY_CPUS", "16")
            .env("SANDQ__WORKER__CAPACITY_MEMORY_BYTES", (64u64 << 30).to_string())
            // Workers of several test binaries and tests run at once: each on a port of its
            // own, whichever is free (tests of the endpoints pick one: [`free_port`]).
            .env("SANDQ__WORKER__METRICS_ADDR", "127.0.0.1:0")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start sandq-worker");
        Mutex::new(child)
    });
}

/// True while the shared worker process is alive.
pub fn worker_alive() -> bool {
    let Some(worker) = WORKER.get() else { return false };
    let mut child = worker.lock().expect("worker lock");
    matches!(child.try_wait(), Ok(None))
}

/// The shared worker's process id.
pub fn worker_pid() -> u32 {
    WORKER.get().expect("worker started").lock().expect("worker lock").id()
}

/// A process's peak resident memory (`VmHWM`, bytes) and CPU time used so far (user + system,
/// seconds), from `/proc/<pid>/status` and `/proc/<pid>/stat`.
pub fn process_usage(pid: u32) -> (u64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let hwm_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmHWM");
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    // Fields after the command name (which may hold spaces) start at field 3; utime and
    // stime are fields 14 and 15, in clock ticks.
    let rest: Vec<&str> = stat.rsplit_once(')').expect("stat").1.split_whitespace().collect();
    let ticks: f64 = rest[11].parse::<f64>().expect("utime") + rest[12].parse::<f64>().expect("stime");
    // USER_HZ, the unit of these fields, is 100 on Linux (`man 5 proc`).
    (hwm_kb * 1024, ticks / 100.0)
}

/// The worker's log so far (for failure messages).
pub fn worker_log() -> String {
    std::fs::read_to_string(worker_log_path()).unwrap_or_default()
}

/// The container id a worker gave `job_id` (random, not derived from the job id), read from
/// its log: the line `container id container_id=...` in the job's span. The last one when
/// the job ran more than once on that worker.
pub fn container_id_in_log(log: &str, job_id: &str) -> Option<String> {
    let line = log.lines().rev().find(|l| l.contains(job_id) && l.contains("container_id="))?;
    let start = line.find("container_id=")? + "container_id=".len();
    let id: String = line[start..].trim_start_matches('"').chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
    (id.starts_with("j-") && id.len() == 34).then_some(id)
}

/// The log of a worker started with [`Isolated::start_worker`] under `id`.
pub fn isolated_worker_log(id: &str) -> String {
    std::fs::read_to_string(std::env::temp_dir().join(format!("sandq-{id}-worker.log"))).unwrap_or_default()
}

/// Where the worker of this binary logs.
pub fn worker_log_path() -> PathBuf {
    std::env::temp_dir().join(format!("sandq-{}-worker.log", worker_id()))
}

async fn purge_queues() {
    let config = service_config();
    let names = sandq_schemas::names::Names::new(namespace());
    let connection = amqp_connect(&config).await.expect("amqp");
    sandq_core::topology::declare(&connection, &names, &config).await.expect("topology");
    let channel = connection.create_channel().await.expect("channel");
    for sku in Sku::ALL {
        channel.queue_purge(names.jobs_queue(sku).into(), QueuePurgeOptions::default()).await.expect("purge");
    }
    channel.queue_purge(names.dead_letter_queue().into(), QueuePurgeOptions::default()).await.expect("purge");
}

/// A connected client in the test namespace, with the worker running.
pub async fn client() -> Client {
    ensure_worker();
    Client::connect(service_config()).await.expect("client connect")
}

/// A Python job running `code` on `sku`.
pub fn python_job(code: &str, sku: Sku) -> JobSpec {
    let mut spec = JobSpec::new(uuid::Uuid::new_v4().to_string(), sku, Runtime::Python, code);
    spec.timeout = Some("60s".into());
    spec.result_ttl = Some("10m".into());
    spec.submitted_at_ms = Some(sandq_core::time::now_ms());
    spec
}

/// Submits `spec` and waits (up to 3 minutes) for its terminal result.
pub async fn run(client: &mut Client, spec: &JobSpec) -> JobResult {
    client.submit(spec).await.expect("submit");
    wait(client, &spec.job_id).await
}

/// Waits (up to 3 minutes) for a job's terminal result.
pub async fn wait(client: &mut Client, job_id: &str) -> JobResult {
    match client.wait(job_id, Duration::from_secs(180), Duration::from_secs(1), |_| {}).await {
        Ok(result) => result,
        Err(e) => panic!("job {job_id}: {e}\nworker log:\n{}", worker_log()),
    }
}

/// Publishes raw bytes to a SKU's queue, bypassing the client's encoding and validation.
pub async fn publish_raw(body: &[u8], sku: Sku, message_id: Option<&str>) {
    publish_raw_to(&service_config(), body, sku, message_id).await;
}

/// [`publish_raw`] in the namespace of `config`.
pub async fn publish_raw_to(config: &ServiceConfig, body: &[u8], sku: Sku, message_id: Option<&str>) {
    RawPublisher::new(config).await.publish(body, sku, message_id).await;
}

/// Publishes raw bytes (with confirms) on one channel, bypassing the client's encoding and
/// validation.
pub struct RawPublisher {
    _connection: Connection,
    channel: lapin::Channel,
    names: sandq_schemas::names::Names,
}

impl RawPublisher {
    /// Connects in the namespace of `config`.
    pub async fn new(config: &ServiceConfig) -> Self {
        let connection = amqp_connect(config).await.expect("amqp");
        let channel = connection.create_channel().await.expect("channel");
        channel.confirm_select(Default::default()).await.expect("confirms");
        RawPublisher { _connection: connection, channel, names: sandq_schemas::names::Names::new(config.namespace.clone()) }
    }

    /// Publishes `body` to `sku`'s queue and waits for the broker's confirm.
    pub async fn publish(&self, body: &[u8], sku: Sku, message_id: Option<&str>) {
        let mut properties = BasicProperties::default().with_delivery_mode(2);
        if let Some(id) = message_id {
            properties = properties.with_message_id(id.into());
        }
        let confirm = self
            .channel
            .basic_publish(
                self.names.jobs_exchange().into(),
                self.names.routing_key(sku).into(),
                BasicPublishOptions { mandatory: true, ..Default::default() },
                body,
                properties,
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
        assert!(matches!(confirm, lapin::Confirmation::Ack(None)), "broker refused raw message: {confirm:?}");
    }
}

/// A namespace of its own, for tests that start and kill their own workers.
pub struct Isolated {
    /// The namespace (`sandq-test-<random>`).
    pub namespace: String,
    /// Service config moved to it.
    pub config: ServiceConfig,
}

impl Isolated {
    /// A fresh namespace with its topology declared.
    pub async fn new() -> Self {
        Self::with_config(|_| {}).await
    }

    /// A fresh namespace with its topology declared from the service config changed by `edit`
    /// (a delivery limit or an unserved TTL of its own: give its workers the same values).
    pub async fn with_config(edit: impl FnOnce(&mut ServiceConfig)) -> Self {
        let namespace = format!("sandq-test-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let mut config = service_config();
        config.namespace = namespace.clone();
        edit(&mut config);
        let connection = amqp_connect(&config).await.expect("amqp");
        let names = sandq_schemas::names::Names::new(namespace.clone());
        sandq_core::topology::declare(&connection, &names, &config).await.expect("topology");
        Isolated { namespace, config }
    }

    /// Starts a worker in this namespace with `id` and extra `SANDQ__*` settings. It runs until
    /// killed or until the returned child's stdin is closed.
    pub fn start_worker(&self, id: &str, env: &[(&str, &str)]) -> Child {
        let log = std::fs::File::create(std::env::temp_dir().join(format!("sandq-{id}-worker.log"))).expect("log file");
        let mut command = Command::new(bin_dir().join("sandq-worker"));
        command
            .arg("--exit-on-stdin-eof")
            .env("SANDQ__NAMESPACE", &self.namespace)
            .env("SANDQ__WORKER__ID", id)
            .env("SANDQ__WORKER__CAPACITY_CPUS", "16")
            .env("SANDQ__WORKER__CAPACITY_MEMORY_BYTES", (64u64 << 30).to_string())
            .env("SANDQ__WORKER__METRICS_ADDR", "127.0.0.1:0")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(log);
        if !self.config.amqp.urls.is_empty() {
            // The namespace's broker is a cluster of its own (tests/rabbitmq_cluster.rs).
            command.env("SANDQ__AMQP__URLS", self.config.amqp.urls.join(","));
        }
        for (k, v) in env {
            command.env(k, v);
        }
        command.spawn().expect("start sandq-worker")
    }

    /// [`Isolated::start_worker`], then waits (up to 60 s) until the worker consumes.
    pub fn start_worker_ready(&self, id: &str, env: &[(&str, &str)]) -> Child {
        let child = self.start_worker(id, env);
        let log = std::env::temp_dir().join(format!("sandq-{id}-worker.log"));
        let started = std::time::Instant::now();
        while !std::fs::read_to_string(&log).unwrap_or_default().contains("consuming") {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "worker {id} did not start: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        child
    }

    /// A client in this namespace.
    pub async fn client(&self) -> Client {
        Client::connect(self.config.clone()).await.expect("client connect")
    }

    /// Deletes this namespace's queues and the (empty) private dirs of its workers, whose ids
    /// all start with the namespace (best effort).
    pub async fn delete_queues(&self) {
        for root in [worker_data_dir(), worker_state_dir()] {
            for entry in std::fs::read_dir(root).into_iter().flatten().flatten() {
                if entry.file_name().to_string_lossy().starts_with(&self.namespace) {
                    let _ = std::fs::remove_dir(entry.path());
                }
            }
        }
        let Ok(connection) = amqp_connect(&self.config).await else { return };
        let Ok(channel) = connection.create_channel().await else { return };
        let names = sandq_schemas::names::Names::new(self.namespace.clone());
        let _ = sandq_core::topology::delete_queues(&channel, &names).await;
    }
}

/// Polls (every 50 ms, up to `limit`) until the job has `status`.
pub async fn wait_for_status(client: &mut Client, job_id: &str, status: sandq_schemas::JobStatus, limit: Duration) {
    let started = std::time::Instant::now();
    loop {
        let current = client.status(job_id).await.expect("status").map(|r| r.status);
        if current == Some(status) {
            return;
        }
        assert!(started.elapsed() < limit, "job {job_id} still {current:?} after {limit:?}, expected {status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends `signal` (`TERM`, `KILL`) to a child process with kill(1).
pub fn signal(child: &Child, signal: &str) {
    let status = Command::new("kill").arg(format!("-{signal}")).arg(child.id().to_string()).status().expect("kill");
    assert!(status.success());
}

/// Waits (up to `limit`) for a child to exit; true when it did.
pub fn exits_within(child: &mut Child, limit: Duration) -> bool {
    let started = std::time::Instant::now();
    while started.elapsed() < limit {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// Waits (up to `limit`) until the dead-letter queue of `config`'s namespace holds `expected`
/// messages, and returns how many it holds then.
pub async fn dead_letter_count(config: &ServiceConfig, expected: usize, limit: Duration) -> usize {
    let connection = amqp_connect(config).await.expect("amqp");
    let channel = connection.create_channel().await.expect("channel");
    let names = sandq_schemas::names::Names::new(config.namespace.clone());
    let started = std::time::Instant::now();
    loop {
        let count = sandq_core::topology::dead_letter_count(&channel, &names).await.expect("dead-letter queue") as usize;
        if count >= expected || started.elapsed() > limit {
            return count;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The value of one series of a worker's `/metrics` (`name{labels}` exactly as the endpoint
/// writes it, e.g. `sandq_dead_letters_total{reason="rejected",action="no_job_id"}`); 0 when
/// the series is absent, `None` when nothing answers.
pub fn metric(port: u16, series: &str) -> Option<f64> {
    let (_, body) = http_get(port, "/metrics")?;
    Some(
        body.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0),
    )
}

/// Polls [`metric`] (every 200 ms, up to `limit`) until it reaches `expected`; returns the last
/// value read.
pub async fn wait_for_metric(port: u16, series: &str, expected: f64, limit: Duration) -> f64 {
    let started = std::time::Instant::now();
    loop {
        let value = metric(port, series).unwrap_or(0.0);
        if value >= expected || started.elapsed() > limit {
            return value;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A loopback TCP port free at the time of the call (bound, then released), for a worker's
/// `SANDQ__WORKER__METRICS_ADDR`.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("local addr").port()
}

/// `GET http://127.0.0.1:<port><path>` over plain HTTP/1.1: the status code and the body.
/// `None` when nothing answers.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// Messages ready (not delivered) in the queue of `sku` in `config`'s namespace.
pub async fn ready_messages(config: &ServiceConfig, sku: Sku) -> u32 {
    let connection = amqp_connect(config).await.expect("amqp");
    let channel = connection.create_channel().await.expect("channel");
    let names = sandq_schemas::names::Names::new(config.namespace.clone());
    let queue = channel
        .queue_declare(
            names.jobs_queue(sku).as_str().into(),
            lapin::options::QueueDeclareOptions { passive: true, ..Default::default() },
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("queue");
    queue.message_count()
}

/// CPUs this machine has online (`available_parallelism`).
pub fn host_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
}

/// First of the 10 loopback ports the Redis Cluster and Sentinel tests use
/// (`tests/redis_cluster.rs`): `$SANDQ_REDIS_CLUSTER_PORT` (`.ci/run` exports base + 10), else
/// 17110 for a developer's `cargo test`.
pub fn redis_cluster_port() -> u16 {
    std::env::var("SANDQ_REDIS_CLUSTER_PORT").ok().and_then(|p| p.parse().ok()).unwrap_or(17110)
}

/// First of the 6 ports of the cluster's bus (node-to-node; `cluster-port`):
/// `$SANDQ_REDIS_CLUSTER_BUS_PORT` (`.ci/run` exports base + 30), else
/// [`redis_cluster_port`] + 20.
pub fn redis_cluster_bus_port() -> u16 {
    std::env::var("SANDQ_REDIS_CLUSTER_BUS_PORT").ok().and_then(|p| p.parse().ok()).unwrap_or(redis_cluster_port() + 20)
}

/// `redis-cli -p <port> <args>`: its stdout, empty when it could not run or connect.
pub fn redis_cli(port: u16, args: &[&str]) -> String {
    Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// Polls `check` every 100 ms until it is true or `limit` passed; true when it became true.
pub fn poll_until(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let started = std::time::Instant::now();
    while started.elapsed() < limit {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    check()
}

/// Redis servers (and sentinels) a test starts on loopback, with their data in a temp dir;
/// all killed and the dir removed on drop.
pub struct RedisFleet {
    dir: PathBuf,
    /// Client port -> the server's process.
    pub servers: std::collections::BTreeMap<u16, Child>,
}

impl RedisFleet {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("sandq-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("fleet dir");
        RedisFleet { dir, servers: std::collections::BTreeMap::new() }
    }

    /// Starts `redis-server` (in sentinel mode when `sentinel`) on `port` with `extra`
    /// config lines, in a dir of its own, and waits (up to 20 s) for it to answer PING.
    fn spawn(&mut self, port: u16, sentinel: bool, extra: &str) {
        let dir = self.dir.join(port.to_string());
        std::fs::create_dir_all(&dir).expect("node dir");
        let conf = dir.join("redis.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {}\nsave \"\"\nlogfile {}\n{extra}\n",
                dir.display(),
                dir.join("log").display()
            ),
        )
        .expect("conf");
        let mut command = Command::new("redis-server");
        command.arg(&conf).stdout(Stdio::null()).stderr(Stdio::null());
        if sentinel {
            command.arg("--sentinel");
        }
        let child = command.spawn().expect("start redis-server");
        self.servers.insert(port, child);
        assert!(poll_until(Duration::from_secs(20), || redis_cli(port, &["ping"]).starts_with("PONG")), "redis on {port} did not start");
    }

    /// One plain Redis on `port` that keeps its data across restarts (an append-only file),
    /// as a deployed one does.
    pub fn single(name: &str, port: u16) -> Self {
        let mut fleet = RedisFleet::new(name);
        fleet.spawn(port, false, "appendonly yes\nappendfsync always");
        fleet
    }

    /// Restarts the server on `port` (`SHUTDOWN`, then started again with its data): its
    /// clients see their connections drop and the server refuse connections meanwhile.
    pub fn restart(&mut self, port: u16, down_for: Duration) {
        let _ = redis_cli(port, &["shutdown"]);
        let mut child = self.servers.remove(&port).expect("no server on that port");
        let _ = child.wait();
        std::thread::sleep(down_for);
        self.spawn(port, false, "appendonly yes\nappendfsync always");
    }

    /// SIGKILLs the server on `port` (a crash).
    pub fn kill(&mut self, port: u16) {
        let mut child = self.servers.remove(&port).expect("no server on that port");
        let _ = child.kill();
        let _ = child.wait();
    }

    /// A server's log (for failure messages).
    pub fn log(&self, port: u16) -> String {
        std::fs::read_to_string(self.dir.join(port.to_string()).join("log")).unwrap_or_default()
    }
}

impl Drop for RedisFleet {
    fn drop(&mut self) {
        for child in self.servers.values_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Redis Cluster of 3 primaries with a replica each on loopback ports `port`..`port + 5`
/// (bus `bus`..`bus + 5`), `cluster-node-timeout` 1 s so that a replica is promoted within a
/// few seconds of its primary's death. Append-only file fsynced on every write.
pub struct RedisCluster {
    /// The servers.
    pub fleet: RedisFleet,
    /// Their client ports.
    pub ports: Vec<u16>,
}

impl RedisCluster {
    /// Starts the 6 servers and creates the cluster (`redis-cli --cluster create
    /// --cluster-replicas 1`); returns once every slot is served and every replica in sync.
    pub fn start(port: u16, bus: u16) -> Self {
        let mut fleet = RedisFleet::new("redis-cluster");
        let ports: Vec<u16> = (port..port + 6).collect();
        for (i, p) in ports.iter().enumerate() {
            fleet.spawn(
                *p,
                false,
                &format!(
                    "cluster-enabled yes\ncluster-config-file nodes.conf\ncluster-node-timeout 1000\ncluster-port {}\nappendonly yes\nappendfsync always\n",
                    bus + i as u16
                ),
            );
        }
        let addresses: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli --cluster create");
        assert!(created.success(), "redis-cli --cluster create failed");
        let cluster = RedisCluster { fleet, ports };
        assert!(
            poll_until(Duration::from_secs(60), || cluster.healthy()),
            "the cluster did not become ready: {}",
            redis_cli(port, &["cluster", "nodes"])
        );
        cluster
    }

    /// True when every live node says `cluster_state:ok` and every replica's link to its
    /// primary is up.
    pub fn healthy(&self) -> bool {
        self.fleet.servers.keys().all(|p| {
            let info = redis_cli(*p, &["cluster", "info"]);
            let replication = redis_cli(*p, &["info", "replication"]);
            info.contains("cluster_state:ok") && (!replication.contains("role:slave") || replication.contains("master_link_status:up"))
        })
    }

    /// The config of a client or worker of this cluster.
    pub fn redis_config(&self) -> sandq_core::config::RedisConfig {
        sandq_core::config::RedisConfig {
            mode: sandq_core::config::RedisMode::Cluster,
            nodes: self.ports.iter().map(|p| format!("redis://127.0.0.1:{p}/")).collect(),
            ..Default::default()
        }
    }

    /// The port of the live primary serving `key`'s slot, and of its replica (`CLUSTER NODES`).
    pub fn primary_and_replica_of(&self, key: &str) -> (u16, u16) {
        let any = *self.fleet.servers.keys().next().expect("a live node");
        let slot: u16 = redis_cli(any, &["cluster", "keyslot", key]).trim().parse().expect("keyslot");
        let nodes = redis_cli(any, &["cluster", "nodes"]);
        // `<id> <ip:port@bus> <flags> <primary id|-> <ping> <pong> <epoch> <link> <slot ranges>...`
        let rows: Vec<Vec<&str>> = nodes.lines().map(|l| l.split_whitespace().collect()).collect();
        let port_of = |row: &Vec<&str>| -> u16 { row[1].split(['@', ':']).nth(1).and_then(|p| p.parse().ok()).expect("port") };
        let primary = rows
            .iter()
            .find(|row| {
                row[2].contains("master")
                    && !row[2].contains("fail")
                    && row[8..].iter().any(|range| {
                        let (a, b) = range.split_once('-').unwrap_or((range, range));
                        matches!((a.parse::<u16>(), b.parse::<u16>()), (Ok(a), Ok(b)) if a <= slot && slot <= b)
                    })
            })
            .unwrap_or_else(|| panic!("no primary for slot {slot}: {nodes}"));
        let replica = rows.iter().find(|row| row[3] == primary[0]).unwrap_or_else(|| panic!("no replica of {}: {nodes}", primary[1]));
        (port_of(primary), port_of(replica))
    }
}

/// The value after the line `name` in redis-cli's output of a flat reply (`SENTINEL MASTER`
/// answers `name`, value, `name`, value, ... one a line); empty when absent.
fn reply_field(reply: &str, name: &str) -> String {
    let mut lines = reply.lines();
    while let Some(line) = lines.next() {
        if line == name {
            return lines.next().unwrap_or_default().to_owned();
        }
    }
    String::new()
}

/// A primary, its replica and 3 sentinels watching them as `mymaster` (quorum 2,
/// `down-after-milliseconds` 1000, `failover-timeout` 5000) on ports `port`..`port + 4`:
/// primary, replica, then the sentinels.
pub struct RedisSentinels {
    /// The servers and sentinels.
    pub fleet: RedisFleet,
    /// Port of the first primary.
    pub primary: u16,
    /// Port of its replica.
    pub replica: u16,
    /// Ports of the sentinels.
    pub sentinels: Vec<u16>,
}

impl RedisSentinels {
    /// Starts them and returns once the sentinels know the replica and each other.
    pub fn start(port: u16) -> Self {
        let mut fleet = RedisFleet::new("redis-sentinel");
        let (primary, replica) = (port, port + 1);
        let sentinels: Vec<u16> = (port + 2..port + 5).collect();
        fleet.spawn(primary, false, "appendonly yes\nappendfsync always\n");
        fleet.spawn(replica, false, &format!("appendonly yes\nappendfsync always\nreplicaof 127.0.0.1 {primary}\n"));
        assert!(
            poll_until(Duration::from_secs(30), || redis_cli(replica, &["info", "replication"]).contains("master_link_status:up")),
            "replica not in sync"
        );
        for s in &sentinels {
            fleet.spawn(
                *s,
                true,
                &format!(
                    "sentinel monitor mymaster 127.0.0.1 {primary} 2\nsentinel down-after-milliseconds mymaster 1000\nsentinel failover-timeout mymaster 5000\n"
                ),
            );
        }
        let ready = poll_until(Duration::from_secs(60), || {
            sentinels.iter().all(|s| {
                let master = redis_cli(*s, &["sentinel", "master", "mymaster"]);
                let field = |name: &str| reply_field(&master, name);
                field("num-slaves") == "1" && field("num-other-sentinels") == "2"
            })
        });
        assert!(ready, "sentinels did not discover each other: {}", redis_cli(sentinels[0], &["sentinel", "master", "mymaster"]));
        RedisSentinels { fleet, primary, replica, sentinels }
    }

    /// The config of a client or worker using these sentinels.
    pub fn redis_config(&self) -> sandq_core::config::RedisConfig {
        sandq_core::config::RedisConfig {
            mode: sandq_core::config::RedisMode::Sentinel,
            nodes: self.sentinels.iter().map(|p| format!("redis://127.0.0.1:{p}/")).collect(),
            service: "mymaster".into(),
            ..Default::default()
        }
    }

    /// The port the sentinels give as the primary (`SENTINEL GET-MASTER-ADDR-BY-NAME`).
    pub fn current_primary(&self) -> Option<u16> {
        self.sentinels
            .iter()
            .find_map(|s| redis_cli(*s, &["sentinel", "get-master-addr-by-name", "mymaster"]).lines().nth(1)?.trim().parse().ok())
    }
}

/// Publishes `body` to the dead-letter exchange as the broker would dead-letter it from the S
/// queue: `message_id` and one `x-death` entry with `reason` (anyone allowed to publish there can
/// forge this; the dead-letter tests check the worker does not trust it).
pub async fn forge_dead_letter(config: &sandq_core::config::ServiceConfig, body: &[u8], message_id: &str, reason: &str) {
    forge_dead_letters(config, &[(body.to_vec(), message_id.to_owned())], reason).await;
}

/// [`forge_dead_letter`] for many `(body, message_id)` at once, on one channel, in order;
/// returns once the broker confirmed them all.
pub async fn forge_dead_letters(config: &sandq_core::config::ServiceConfig, messages: &[(Vec<u8>, String)], reason: &str) {
    use lapin::types::{AMQPValue, FieldArray, FieldTable};
    let names = sandq_schemas::names::Names::new(config.namespace.clone());
    let connection = lapin::Connection::connect(&config.amqp.url, lapin::ConnectionProperties::default()).await.expect("amqp");
    let channel = connection.create_channel().await.expect("channel");
    channel.confirm_select(Default::default()).await.expect("confirms");
    let mut death = FieldTable::default();
    death.insert("reason".into(), AMQPValue::LongString(reason.into()));
    death.insert("queue".into(), AMQPValue::LongString(names.jobs_queue(Sku::S).into()));
    death.insert("count".into(), AMQPValue::LongLongInt(1));
    let mut headers = FieldTable::default();
    headers.insert("x-death".into(), AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])));
    for chunk in messages.chunks(500) {
        let mut confirms = Vec::with_capacity(chunk.len());
        for (body, message_id) in chunk {
            let properties = lapin::BasicProperties::default().with_message_id(message_id.as_str().into()).with_headers(headers.clone());
            confirms.push(
                channel
                    .basic_publish(names.dead_letter_exchange().into(), "".into(), Default::default(), body, properties)
                    .await
                    .expect("publish"),
            );
        }
        for confirm in confirms {
            assert!(confirm.await.expect("confirm").is_ack(), "the broker refused a forged dead letter");
        }
    }
}

/// Worker settings of the tests that start one small worker of their own (`limits.rs`,
/// `untrusted_state.rs`, `dead_letters.rs`, `delivery.rs`, `warm.rs`): two S slots of 1 core,
/// 512 MiB and 1 GiB of disk, no warm sandboxes, no outbound network; `extra` after them (the
/// later value of a variable wins).
pub fn small_worker_env(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
    let mut env = vec![
        ("SANDQ__SKUS__S__CPUS", "1"),
        ("SANDQ__SKUS__S__MEMORY_BYTES", "536870912"),
        ("SANDQ__SKUS__S__DISK_BYTES", "1073741824"),
        ("SANDQ__SKUS__S__SLOTS", "2"),
        ("SANDQ__WARM__PER_SKU", "0"),
        ("SANDQ__WORKER__OUTBOUND_NETWORK", "false"),
    ];
    env.extend_from_slice(extra);
    env
}

/// Stops a worker started with `--exit-on-stdin-eof` (closes its stdin) and asserts it exits
/// within 40 s.
pub fn stop_worker(mut worker: Child) {
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(40)), "the worker did not exit within 40 s of its stdin closing");
}

/// A Redis connection to `world`'s Redis with no response timeout: tests that write or read
/// large values, or wait on a busy server, must not fail on the client's default 500 ms.
pub async fn plain_redis(world: &Isolated) -> redis::aio::MultiplexedConnection {
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
    redis::Client::open(world.config.redis.url.as_str())
        .expect("redis")
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .expect("redis")
}
