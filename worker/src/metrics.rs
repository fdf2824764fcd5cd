//! The worker's Prometheus metrics (served at `/metrics` by [`crate::health`]): their names, and
//! the helpers that record them at the points of the job lifecycle.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `sandq_jobs_finished_total` | counter: terminal results this worker stored | `sku`, `status` |
//! | `sandq_job_stage_duration_seconds` | histogram | `stage`: [`Stage`] |
//! | `sandq_jobs_in_flight` | gauge: deliveries being processed (waiting for capacity included) | |
//! | `sandq_capacity_cpus`, `sandq_capacity_memory_bytes` | gauge: declared capacity | |
//! | `sandq_capacity_cpus_in_use`, `sandq_capacity_memory_in_use_bytes` | gauge: held by jobs | |
//! | `sandq_warm_sandboxes_ready` | gauge | `sku` |
//! | `sandq_warm_starts_total` | counter: sandboxes a job ran in | `sku`, `warm` (`true`, `false`) |
//! | `sandq_redeliveries_total` | counter: deliveries the broker marked redelivered | |
//! | `sandq_infrastructure_errors_total` | counter | `kind`: [`ErrorKind`] |
//! | `sandq_collect_read_bytes_total` | counter: bytes of `/work` files read (hashed) by collection | |
//! | `sandq_dead_letters_total` | counter: dead-lettered messages handled ([`crate::dead_letter`]) | `reason` (`expired`, `delivery_limit`, `rejected`, `other`), `action` (`result_written`, `already_final`, `no_job_id`, `deferred`, `unreadable`, `panic`) |
//! | `sandq_state_cache_total` | counter: notebook states restored from the worker's own copy ([`crate::session::cache`]) | `outcome` (`hit`; `miss`: downloaded from S3) |
//! | `sandq_live_events_total` | counter: live events ([`crate::live`]) | `outcome` (`sent`; `dropped`: Redis slow or down, or the pending buffer full) |
//! | `sandq_fair_turns_total` | counter: deliveries whose tenant's turn [`crate::fair`] decided | `sku`, `turn` ([`FAIR_TURNS`]: `run`; `rotated`: sent round for another tenant; `rotate_failed`: could not be sent round, ran; `superseded`: handed out again after a newer copy went round, acked without running; `uncounted`: Redis trouble, ran without a turn) |
//! | `sandq_session_index_events_total` | counter: the sessions index (`<ns>:sessions`) | `event` (`update_failed`: a saved session's expiry not indexed; `reset`: the index was a key of another type, deleted; `rebuilt`: indexed again from S3) |
//!
//! Labels are bounded: never a job id, attempt id or container id.
//!
//! A job's stage durations are taken by [`enter`]: each call ends the stage the job was in
//! (observing its duration) and starts the next, so a stage is observed once it ended without
//! an infrastructure failure. The job being processed is known through a task-local set up by
//! [`Tracker::scope`] around one delivery (consume.rs); outside one, the per-job helpers do
//! nothing.

use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use sandq_schemas::{JobStatus, Sku};

use crate::ack::Outcome;

/// A timed stage of a job, the `stage` label of `sandq_job_stage_duration_seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Stage {
    /// Submitted (the client's `submitted_at_ms`) to started (capacity taken, `running`).
    QueueWait,
    /// Inputs fetched into the job dir (into a warm sandbox's dir for a warm start).
    Staging,
    /// Container created and started (cold starts only).
    SandboxStart,
    /// The program, from start (or handover) to its container deleted.
    Run,
    /// Artifacts, rich outputs, session files and logs stored.
    Collect,
    /// The terminal result written to Redis.
    Publish,
}

impl Stage {
    /// Every stage.
    pub(crate) const ALL: [Stage; 6] = [Stage::QueueWait, Stage::Staging, Stage::SandboxStart, Stage::Run, Stage::Collect, Stage::Publish];

    /// The label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Stage::QueueWait => "queue_wait",
            Stage::Staging => "stage",
            Stage::SandboxStart => "sandbox_start",
            Stage::Run => "run",
            Stage::Collect => "collect",
            Stage::Publish => "publish",
        }
    }
}

/// Where an infrastructure failure happened: the `kind` label of
/// `sandq_infrastructure_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorKind {
    /// Before staging: reading the job's state, its session, writing `running` (Redis, S3).
    Queue,
    /// Fetching inputs (S3) or preparing the job dir.
    Stage,
    /// Creating or starting the container.
    SandboxStart,
    /// Running the program (the helper or the sandbox failed).
    Run,
    /// Storing artifacts, outputs, session files or logs (S3).
    Collect,
    /// Writing the terminal result (Redis).
    Publish,
    /// Job processing panicked.
    Panic,
    /// The broker connection was lost.
    Broker,
}

impl ErrorKind {
    /// Every kind.
    pub(crate) const ALL: [ErrorKind; 8] = [
        ErrorKind::Queue,
        ErrorKind::Stage,
        ErrorKind::SandboxStart,
        ErrorKind::Run,
        ErrorKind::Collect,
        ErrorKind::Publish,
        ErrorKind::Panic,
        ErrorKind::Broker,
    ];

    /// The label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Queue => "queue",
            ErrorKind::Stage => "stage",
            ErrorKind::SandboxStart => "sandbox_start",
            ErrorKind::Run => "run",
            ErrorKind::Collect => "collect",
            ErrorKind::Publish => "publish",
            ErrorKind::Panic => "panic",
            ErrorKind::Broker => "broker",
        }
    }

    fn of(stage: Option<Stage>) -> Self {
        match stage {
            None | Some(Stage::QueueWait) => ErrorKind::Queue,
            Some(Stage::Staging) => ErrorKind::Stage,
            Some(Stage::SandboxStart) => ErrorKind::SandboxStart,
            Some(Stage::Run) => ErrorKind::Run,
            Some(Stage::Collect) => ErrorKind::Collect,
            Some(Stage::Publish) => ErrorKind::Publish,
        }
    }
}

type Labels2 = [(&'static str, &'static str); 2];
type Labels1 = [(&'static str, &'static str); 1];

/// Buckets of the stage durations, seconds: 5 ms to 15 min.
const DURATION_BUCKETS: [f64; 16] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0];

/// Every metric of the worker, in one registry.
pub(crate) struct Metrics {
    /// The registry `/metrics` encodes.
    pub registry: Registry,
    finished: Family<Labels2, Counter>,
    stage_duration: Family<Labels1, Histogram, fn() -> Histogram>,
    in_flight: Gauge,
    capacity_cpus: Gauge<f64, std::sync::atomic::AtomicU64>,
    capacity_memory: Gauge,
    cpus_in_use: Gauge<f64, std::sync::atomic::AtomicU64>,
    memory_in_use: Gauge,
    warm_ready: Family<Labels1, Gauge>,
    warm_starts: Family<Labels2, Counter>,
    redeliveries: Counter,
    infrastructure_errors: Family<Labels1, Counter>,
    collect_read: Counter,
    dead_letters: Family<Labels2, Counter>,
    session_index: Family<Labels1, Counter>,
    live_events: Family<Labels1, Counter>,
    state_cache: Family<Labels1, Counter>,
    fair_turns: Family<Labels2, Counter>,
}

fn duration_histogram() -> Histogram {
    Histogram::new(DURATION_BUCKETS)
}

/// The worker's metrics.
pub(crate) static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::default();
        let finished = Family::<Labels2, Counter>::default();
        registry.register("sandq_jobs_finished", "Terminal results this worker stored, by SKU and status", finished.clone());
        let stage_duration = Family::<Labels1, Histogram, fn() -> Histogram>::new_with_constructor(duration_histogram as fn() -> Histogram);
        registry.register_with_unit(
            "sandq_job_stage_duration",
            "Duration of each stage of a job (queue_wait, stage, sandbox_start, run, collect, publish)",
            Unit::Seconds,
            stage_duration.clone(),
        );
        let in_flight = Gauge::default();
        registry.register("sandq_jobs_in_flight", "Deliveries being processed, waiting for capacity included", in_flight.clone());
        let capacity_cpus = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register("sandq_capacity_cpus", "Cores this worker hands out to running jobs in all", capacity_cpus.clone());
        let capacity_memory = Gauge::default();
        registry.register_with_unit(
            "sandq_capacity_memory",
            "Memory this worker hands out to running jobs in all",
            Unit::Bytes,
            capacity_memory.clone(),
        );
        let cpus_in_use = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register("sandq_capacity_cpus_in_use", "Cores held by running jobs", cpus_in_use.clone());
        let memory_in_use = Gauge::default();
        registry.register_with_unit("sandq_capacity_memory_in_use", "Memory held by running jobs", Unit::Bytes, memory_in_use.clone());
        let warm_ready = Family::<Labels1, Gauge>::default();
        registry.register("sandq_warm_sandboxes_ready", "Warm sandboxes started and waiting for a job", warm_ready.clone());
        let warm_starts = Family::<Labels2, Counter>::default();
        registry.register("sandq_warm_starts", "Sandboxes jobs ran in, warm (started ahead) or cold", warm_starts.clone());
        let redeliveries = Counter::default();
        registry.register("sandq_redeliveries", "Deliveries the broker marked as redelivered", redeliveries.clone());
        let infrastructure_errors = Family::<Labels1, Counter>::default();
        registry.register(
            "sandq_infrastructure_errors",
            "Infrastructure failures (sandq's fault, retried), by where they happened",
            infrastructure_errors.clone(),
        );
        let collect_read = Counter::default();
        registry.register_with_unit(
            "sandq_collect_read",
            "Bytes of files under /work that collection read to hash them (unchanged staged files are not read)",
            Unit::Bytes,
            collect_read.clone(),
        );
        let dead_letters = Family::<Labels2, Counter>::default();
        registry.register(
            "sandq_dead_letters",
            "Dead-lettered messages this worker handled, by the broker's reason and what was done",
            dead_letters.clone(),
        );
        let session_index = Family::<Labels1, Counter>::default();
        registry.register(
            "sandq_session_index_events",
            "Events of the sessions index: update_failed (a saved session not indexed), reset (a key of another type deleted), rebuilt (indexed again from S3)",
            session_index.clone(),
        );
        let live_events = Family::<Labels1, Counter>::default();
        registry.register(
            "sandq_live_events",
            "Live events of running jobs (docs/protocol.md, Live events): sent to Redis, or dropped (Redis slow or down, or the pending buffer full)",
            live_events.clone(),
        );
        let state_cache = Family::<Labels1, Counter>::default();
        registry.register(
            "sandq_state_cache",
            "Notebook states a session job restored from this worker's own copy (hit) or from S3 (miss)",
            state_cache.clone(),
        );
        let fair_turns = Family::<Labels2, Counter>::default();
        registry.register(
            "sandq_fair_turns",
            "Deliveries whose tenant's turn was decided (docs/operations.md, Fair share between tenants): run, rotated (sent round for another tenant), rotate_failed (ran), uncounted (Redis trouble, ran)",
            fair_turns.clone(),
        );
        for sku in Sku::ALL {
            for turn in FAIR_TURNS {
                let _ = fair_turns.get_or_create(&[("sku", sku.as_str()), ("turn", turn)]);
            }
        }
        for outcome in ["hit", "miss"] {
            let _ = state_cache.get_or_create(&[("outcome", outcome)]);
        }
        for outcome in ["sent", "dropped"] {
            let _ = live_events.get_or_create(&[("outcome", outcome)]);
        }
        for event in SESSION_INDEX_EVENTS {
            let _ = session_index.get_or_create(&[("event", event)]);
        }
        for stage in Stage::ALL {
            let _ = stage_duration.get_or_create(&[("stage", stage.as_str())]);
        }
        for kind in ErrorKind::ALL {
            let _ = infrastructure_errors.get_or_create(&[("kind", kind.as_str())]);
        }
        Metrics {
            registry,
            finished,
            stage_duration,
            in_flight,
            capacity_cpus,
            capacity_memory,
            cpus_in_use,
            memory_in_use,
            warm_ready,
            warm_starts,
            redeliveries,
            infrastructure_errors,
            collect_read,
            dead_letters,
            session_index,
            live_events,
            state_cache,
            fair_turns,
        }
    }

    /// The registry in the OpenMetrics text format.
    pub(crate) fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

/// Sets the declared capacity, and creates the per-SKU series of the SKUs served (at 0), so that
/// they are scraped before the first job.
pub(crate) fn init(cpus: f64, memory_bytes: u64, skus: impl IntoIterator<Item = Sku>) {
    let m = &*METRICS;
    m.capacity_cpus.set(cpus);
    m.capacity_memory.set(i64::try_from(memory_bytes).unwrap_or(i64::MAX));
    for sku in skus {
        let sku = sku.as_str();
        for status in TERMINAL {
            let _ = m.finished.get_or_create(&[("sku", sku), ("status", status.as_str())]);
        }
        for warm in ["true", "false"] {
            let _ = m.warm_starts.get_or_create(&[("sku", sku), ("warm", warm)]);
        }
        let _ = m.warm_ready.get_or_create(&[("sku", sku)]);
    }
}

const TERMINAL: [JobStatus; 8] = [
    JobStatus::Succeeded,
    JobStatus::Failed,
    JobStatus::TimedOut,
    JobStatus::OomKilled,
    JobStatus::Rejected,
    JobStatus::Cancelled,
    JobStatus::Expired,
    JobStatus::InternalError,
];

/// A terminal result was stored for a job of `sku` (the delivery's queue when the result names
/// none).
pub(crate) fn finished(sku: Option<Sku>, status: JobStatus) {
    let sku = sku.or_else(|| JOB.try_with(|j| j.lock().ok().map(|j| j.sku)).ok().flatten());
    let sku = sku.map_or("unknown", Sku::as_str);
    METRICS.finished.get_or_create(&[("sku", sku), ("status", status.as_str())]).inc();
}

/// Capacity taken (positive) or given back (negative) by a job.
pub(crate) fn capacity_held(cpus: f64, memory_bytes: i64) {
    METRICS.cpus_in_use.inc_by(cpus);
    METRICS.memory_in_use.inc_by(memory_bytes);
}

/// `ready` warm sandboxes of `sku` wait for a job.
pub(crate) fn warm_ready(sku: Sku, ready: usize) {
    METRICS.warm_ready.get_or_create(&[("sku", sku.as_str())]).set(i64::try_from(ready).unwrap_or(i64::MAX));
}

/// Collection read `bytes` of a file under `/work` to hash it.
pub(crate) fn collect_read(bytes: u64) {
    METRICS.collect_read.inc_by(bytes);
}

/// An infrastructure failure outside any job (`kind` [`ErrorKind::Broker`]).
pub(crate) fn infrastructure_error(kind: ErrorKind) {
    METRICS.infrastructure_errors.get_or_create(&[("kind", kind.as_str())]).inc();
}

/// A dead-lettered message was handled: the broker's `reason` ([`crate::dead_letter::DeathReason::as_str`])
/// and the `action` taken (`result_written`, `already_final`, `no_job_id`).
pub(crate) fn dead_letter(reason: &'static str, action: &'static str) {
    METRICS.dead_letters.get_or_create(&[("reason", reason), ("action", action)]).inc();
}

/// The `turn` values of `sandq_fair_turns_total`.
pub(crate) const FAIR_TURNS: [&str; 5] = ["run", "rotated", "rotate_failed", "superseded", "uncounted"];

/// A delivery of SKU `sku` whose turn was decided: one of [`FAIR_TURNS`].
pub(crate) fn fair_turn(sku: Sku, turn: &'static str) {
    METRICS.fair_turns.get_or_create(&[("sku", sku.as_str()), ("turn", turn)]).inc();
}

/// The `event` values of `sandq_session_index_events_total`.
pub(crate) const SESSION_INDEX_EVENTS: [&str; 3] = ["update_failed", "reset", "rebuilt"];

/// An event of the sessions index: one of [`SESSION_INDEX_EVENTS`].
pub(crate) fn session_index(event: &'static str) {
    METRICS.session_index.get_or_create(&[("event", event)]).inc();
}

/// A notebook state restored from the worker's cache (`hit`) or from S3 (`miss`).
pub(crate) fn state_cache(outcome: &'static str) {
    METRICS.state_cache.get_or_create(&[("outcome", outcome)]).inc();
}

/// Live events sent to Redis (`outcome` `sent`) or dropped (`dropped`).
pub(crate) fn live_events(outcome: &'static str, n: u64) {
    METRICS.live_events.get_or_create(&[("outcome", outcome)]).inc_by(n);
}

/// What is known of the job being processed.
#[derive(Debug)]
struct Job {
    sku: Sku,
    stage: Option<(Stage, Instant)>,
}

tokio::task_local! {
    static JOB: Arc<Mutex<Job>>;
}

fn with_job(f: impl FnOnce(&mut Job)) {
    let _ = JOB.try_with(|job| {
        if let Ok(mut job) = job.lock() {
            f(&mut job);
        }
    });
}

fn observe(stage: Stage, took: Duration) {
    METRICS.stage_duration.get_or_create(&[("stage", stage.as_str())]).observe(took.as_secs_f64());
}

/// The job moves on to `stage`: the stage it was in is observed as ended.
pub(crate) fn enter(stage: Stage) {
    with_job(|job| {
        if let Some((previous, since)) = job.stage.replace((stage, Instant::now())) {
            observe(previous, since.elapsed());
        }
    });
}

/// The job started (capacity taken, `running` written at `started_at_ms`) and begins staging:
/// observes its queue wait from the client's `submitted_at_ms` (when given, and not after the
/// start by the clocks' skew) and enters [`Stage::Staging`].
pub(crate) fn started(submitted_at_ms: Option<u64>, started_at_ms: u64) {
    if let Some(submitted) = submitted_at_ms.filter(|s| *s <= started_at_ms) {
        if JOB.try_with(|_| ()).is_ok() {
            observe(Stage::QueueWait, Duration::from_millis(started_at_ms - submitted));
        }
    }
    enter(Stage::Staging);
}

/// The job's program starts: in a warm sandbox or a cold one (counted), entering [`Stage::Run`].
pub(crate) fn running(warm: bool) {
    with_job(|job| {
        let warm = if warm { "true" } else { "false" };
        METRICS.warm_starts.get_or_create(&[("sku", job.sku.as_str()), ("warm", warm)]).inc();
    });
    enter(Stage::Run);
}

/// One delivery being processed: counted in flight while it lives.
#[derive(Debug)]
pub(crate) struct Tracker {
    job: Arc<Mutex<Job>>,
}

impl Tracker {
    /// A delivery taken from the queue of `sku`; `redelivered` as the broker flagged it.
    pub(crate) fn new(sku: Sku, redelivered: bool) -> Self {
        METRICS.in_flight.inc();
        if redelivered {
            METRICS.redeliveries.inc();
        }
        Tracker { job: Arc::new(Mutex::new(Job { sku, stage: None })) }
    }

    /// Runs the delivery's processing with this tracker as the current job.
    pub(crate) async fn scope<F: std::future::Future>(&self, processing: F) -> F::Output {
        JOB.scope(self.job.clone(), processing).await
    }

    /// Records how the processing ended: an infrastructure failure counted by where it happened
    /// (`panicked`: [`ErrorKind::Panic`]); a stored result ends its publish stage.
    pub(crate) fn settled(&self, outcome: &Outcome, panicked: bool) {
        let Ok(mut job) = self.job.lock() else { return };
        let current = job.stage.take();
        match outcome {
            Outcome::Infrastructure { .. } => {
                let kind = if panicked { ErrorKind::Panic } else { ErrorKind::of(current.map(|(s, _)| s)) };
                infrastructure_error(kind);
            }
            Outcome::Stored => {
                if let Some((Stage::Publish, since)) = current {
                    observe(Stage::Publish, since.elapsed());
                }
            }
            Outcome::Unidentifiable | Outcome::Interrupted => {}
        }
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        METRICS.in_flight.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_count() -> u64 {
        let text = METRICS.encode();
        let line = text.lines().find_map(|l| l.strip_prefix("sandq_job_stage_duration_seconds_count{stage=\"run\"} "));
        line.and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("no run count in {text}"))
    }

    #[tokio::test]
    async fn stages_are_observed_when_the_next_begins() {
        let before = run_count();
        let tracker = Tracker::new(Sku::S, false);
        tracker
            .scope(async {
                started(Some(1), 2);
                running(false);
                enter(Stage::Collect);
                enter(Stage::Publish);
            })
            .await;
        tracker.settled(&Outcome::Stored, false);
        drop(tracker);
        assert_eq!(run_count(), before + 1);
        let text = METRICS.encode();
        assert!(text.contains("sandq_job_stage_duration_seconds_count{stage=\"publish\"}"), "{text}");
        assert!(text.contains("sandq_warm_starts_total{sku=\"S\",warm=\"false\"}"), "{text}");
        // Outside a job's scope the per-job helpers do nothing.
        enter(Stage::Run);
        assert_eq!(run_count(), before + 1);
    }
}
