//! The summary of a throughput run (`report.json`), shared by the run and its plots.

use std::collections::BTreeMap;

/// Percentiles of one latency, milliseconds (nearest rank).
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: u64,
    /// 90th percentile.
    pub p90: u64,
    /// 99th percentile.
    pub p99: u64,
    /// Largest.
    pub max: u64,
    /// Mean.
    pub mean: f64,
}

impl Percentiles {
    pub fn of(mut values: Vec<u64>) -> Self {
        if values.is_empty() {
            return Percentiles::default();
        }
        values.sort_unstable();
        let rank = |p: f64| values[((p / 100.0 * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
        Percentiles {
            p50: rank(50.0),
            p90: rank(90.0),
            p99: rank(99.0),
            max: values[values.len() - 1],
            mean: values.iter().sum::<u64>() as f64 / values.len() as f64,
        }
    }
}

/// The summary of a run (`report.json`).
#[derive(Debug, serde::Serialize)]
pub struct Report {
    /// `rate 10/s` or `concurrency 4`.
    pub load: String,
    /// Jobs submitted.
    pub jobs: usize,
    /// The program, its mode and SKU.
    pub code: String,
    /// `notebook` or `script`.
    pub mode: String,
    /// The SKU.
    pub sku: String,
    /// Workers started by the run (0: existing ones).
    pub workers: usize,
    /// `debug` or `release`: how this binary (and the workers beside it) was built.
    pub build: &'static str,
    /// Terminal statuses.
    pub statuses: BTreeMap<String, usize>,
    /// Jobs without a terminal result at the end.
    pub unfinished: usize,
    /// First submission to last finish, seconds.
    pub seconds: f64,
    /// Finished jobs per second over that span.
    pub jobs_per_second: f64,
    /// `finished_at_ms - queued_at_ms`.
    pub submitted_to_finished_ms: Percentiles,
    /// `started_at_ms - queued_at_ms`.
    pub queue_wait_ms: Percentiles,
    /// `usage.wall_ms`.
    pub run_ms: Percentiles,
    /// Jobs handed a warm sandbox.
    pub warm_starts: usize,
    /// Largest queue depth sampled.
    pub max_queue_depth: u32,
}
