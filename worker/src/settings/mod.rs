//! The worker's configuration: [`RawConfig`] as read (TOML file + `SANDQ__*` environment, see
//! `sandq_core::config`), converted once into validated [`Settings`].
//!
//! [`raw`] holds the sections as written, [`host`] what validation reads of the host.
//!
//! Keys are lower-case (the `config` crate lower-cases environment keys), so SKU sections are
//! `[skus.s]`, `[skus.m]`, `[skus.l]`, `[skus.xl]`.

mod host;
mod raw;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use sandq_core::config::ServiceConfig;
use sandq_schemas::names::Names;
use sandq_schemas::{Limits, Sku};

pub use host::{DEFAULT_USERNS_HOST_BASE, USERNS_LEASE_RANGES};
pub use raw::{default_sku, RawConfig, RawLimits, RawSessions, RawSku, RawWarm, RawWorker};

use crate::sandbox::spec::SandboxLimits;
/// One SKU as this worker serves it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SkuSettings {
    /// Limits of each sandbox.
    pub limits: SandboxLimits,
    /// Jobs at once.
    pub slots: usize,
    /// `/work` quota, bytes; 0: none.
    pub disk_bytes: u64,
}

/// What a job may leave: captured streams, rich outputs, artifacts, and their URLs (`worker.*`).
#[derive(Debug, Clone)]
pub struct OutputSettings {
    /// Output cap per stream, bytes.
    pub max_output_bytes: u64,
    /// Inline output cap per stream, bytes.
    pub max_inline_output_bytes: u64,
    /// Rich outputs per job.
    pub max_outputs: usize,
    /// Rich output bytes per job (the outputs tmpfs size).
    pub max_outputs_bytes: u64,
    /// Artifact count cap.
    pub max_artifacts: usize,
    /// Artifact bytes cap.
    pub max_artifact_bytes: u64,
    /// Presigned URL validity; zero: no URLs.
    pub artifact_url_ttl: Duration,
    /// Text bytes a job's live event stream carries per attempt; 0: no live events.
    pub stream_max_bytes: u64,
}

/// Sessions: lifetime, locks, the reaper, notebook state (`[sessions]`).
#[derive(Debug, Clone)]
pub struct SessionSettings {
    /// Session inactivity timeout.
    pub idle_timeout: Duration,
    /// Session lock wait.
    pub lock_wait: Duration,
    /// Session reaper period.
    pub reap_interval: Duration,
    /// Period of the sessions index rebuild from S3 (cluster-wide).
    pub rebuild_interval: Duration,
    /// Largest notebook state of a session, bytes.
    pub max_state_bytes: u64,
    /// The worker's own copies of saved states ([`crate::session::cache`]): their dir
    /// (`<data_dir>/<worker id>.state-cache`) and most bytes (0: none).
    pub state_cache: (PathBuf, u64),
    /// Longest time the runner spends saving a notebook state.
    pub max_state_save: Duration,
}

/// Warm sandboxes (`[warm]`).
#[derive(Debug, Clone)]
pub struct WarmSettings {
    /// Warm sandboxes kept per SKU served (0: none).
    pub per_sku: usize,
    /// Memory set aside in the capacity for each warm sandbox (`warm.memory_bytes`, default
    /// 256 MiB), bytes; also the most of a warm-up's memory a job is given on top of its
    /// SKU's at handover.
    pub memory_bytes: u64,
    /// Modules a warm runner preloads (`SANDQ_PRELOAD`).
    pub preload: String,
    /// Runtimes with warm sandboxes.
    pub runtimes: Vec<sandq_schemas::Runtime>,
    /// Python warm sandboxes are forked from a pre-imported template per SKU
    /// (`warm.forked`, default true; [`crate::warm::template`]).
    pub forked: bool,
    /// Light warm sandboxes kept per SKU: forked Python notebook ones (while its template is
    /// ready) and script ones of each runtime (`warm.light_per_sku`, default 2; at least
    /// `per_sku`).
    pub light_per_sku: usize,
    /// How long a template serves before a new one replaces it (`warm.template_lifetime`,
    /// default 1 h).
    pub template_lifetime: Duration,
    /// Script jobs get warm sandboxes too (`warm.script`, default true).
    pub script: bool,
}

/// Memory set aside in the capacity for each light warm sandbox, bytes: a forked one (its
/// holder and its forked process's own pages; the template's are shared copy-on-write and
/// charged to the worker), measured at a 7 MiB peak for a job importing numpy, pandas and
/// pyplot (docs/benchmarks.md "Forked sandboxes"), or a script one (its waiter, an interpreter
/// without `site`: ~6 MiB).
pub const LIGHT_WARM_MEMORY_BYTES: u64 = 32 << 20;

impl WarmSettings {
    /// The kinds of warm sandboxes (runtime, mode) kept for each SKU.
    pub fn kinds(&self) -> Vec<(sandq_schemas::Runtime, sandq_schemas::RunMode)> {
        let modes: &[sandq_schemas::RunMode] = if self.script {
            &[sandq_schemas::RunMode::Notebook, sandq_schemas::RunMode::Script]
        } else {
            &[sandq_schemas::RunMode::Notebook]
        };
        self.runtimes.iter().flat_map(|r| modes.iter().map(move |m| (*r, *m))).collect()
    }

    /// Warm sandboxes of `runtime` and `mode` kept per SKU at most (forked ones when the SKU's
    /// template is ready).
    pub fn kept(&self, runtime: sandq_schemas::Runtime, mode: sandq_schemas::RunMode) -> usize {
        if self.light(runtime, mode) {
            self.per_sku.max(self.light_per_sku)
        } else {
            self.per_sku
        }
    }

    /// Whether warm sandboxes of `runtime` and `mode` are light ones ([`LIGHT_WARM_MEMORY_BYTES`]
    /// each, `light_per_sku` kept): script ones, and forked Python notebook ones.
    fn light(&self, runtime: sandq_schemas::Runtime, mode: sandq_schemas::RunMode) -> bool {
        mode == sandq_schemas::RunMode::Script || (runtime == sandq_schemas::Runtime::Python && self.forked)
    }

    /// Memory set aside for the warm sandboxes of `runtime` and `mode` of one SKU, bytes:
    /// `per_sku` preloading sandboxes of `memory_bytes` (also what a Python notebook pool
    /// holds while its template is not ready), or `light_per_sku` light ones of
    /// [`LIGHT_WARM_MEMORY_BYTES`], whichever is more (a pool holds one kind or the other:
    /// see [`crate::warm::refill`]).
    pub fn reserve_bytes(&self, runtime: sandq_schemas::Runtime, mode: sandq_schemas::RunMode) -> u64 {
        let light = self.per_sku.max(self.light_per_sku) as u64 * LIGHT_WARM_MEMORY_BYTES;
        if mode == sandq_schemas::RunMode::Script {
            light
        } else if self.light(runtime, mode) {
            (self.per_sku as u64 * self.memory_bytes).max(light)
        } else {
            self.per_sku as u64 * self.memory_bytes
        }
    }
}

/// The outbound network mode (`worker.outbound_network`, `nameservers`, `blocked_ranges`).
#[derive(Debug, Clone)]
pub struct NetworkSettings {
    /// Outbound network mode served.
    pub outbound: bool,
    /// Nameservers of outbound sandboxes.
    pub nameservers: Vec<std::net::Ipv4Addr>,
    /// Extra ranges outbound sandboxes may not reach, canonical CIDR text.
    pub blocked_ranges: Vec<String>,
}

/// The configuration checked and with its defaults filled in: what the worker runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Connection sections, as the client library takes them.
    pub services: ServiceConfig,
    /// Names of queues and keys.
    pub names: Names,
    /// This worker's id.
    pub worker_id: String,
    /// The sandbox image's root filesystem (`worker.rootfs`), mounted read-only in every sandbox.
    pub rootfs: PathBuf,
    /// `<data_dir>/<worker id>`: this worker's job dirs.
    pub jobs_dir: PathBuf,
    /// `<state_dir>/<worker id>`: this worker's libcontainer state root.
    pub state_root: PathBuf,
    /// The `sandq-container` binary that drives libcontainer (`worker.container_helper`).
    pub container_helper: PathBuf,
    /// uid/gid inside the sandbox.
    pub sandbox_uid: u32,
    /// User namespace mapping, if enabled.
    pub id_map: Option<crate::sandbox::spec::IdMap>,
    /// The lease file whose `flock` reserves `id_map`'s ranges among the host's workers
    /// (`worker.userns_lease_dir`), and its index; held as long as any clone of the settings.
    pub userns_lease: Option<(usize, std::sync::Arc<std::fs::File>)>,
    /// Whether sandboxes get the seccomp filter of the OCI policy (`worker.seccomp`).
    pub seccomp: bool,
    /// Run-time package installs: trusted CAs, indexes, the user site's path.
    pub packages: crate::packages::Packages,
    /// Shutdown grace period.
    pub shutdown_grace: Duration,
    /// What a job may leave: captured streams, rich outputs, artifacts, and their URLs (`worker.*`).
    pub outputs: OutputSettings,
    /// Sessions: lifetime, locks, the reaper, notebook state (`[sessions]`).
    pub sessions: SessionSettings,
    /// Warm sandboxes (`[warm]`).
    pub warm: WarmSettings,
    /// The outbound network mode (`worker.outbound_network`, `nameservers`, `blocked_ranges`).
    pub network: NetworkSettings,
    /// Infrastructure attempts per job.
    pub max_attempts: u32,
    /// What every job must fit: timeouts, result TTL, input bytes (`[limits]`).
    pub limits: Limits,
    /// The SKUs this worker takes jobs of: slots > 0 and within its capacity.
    pub skus: BTreeMap<Sku, SkuSettings>,
    /// Declared capacity: cores.
    pub capacity_cpus: f64,
    /// Memory jobs get, bytes: the declared capacity less the warm sandboxes' share
    /// (`warm.memory_bytes` each).
    pub capacity_memory_bytes: u64,
    /// Address of `/metrics`, `/healthz` and `/readyz`.
    pub metrics_addr: std::net::SocketAddr,
}

/// Why the configuration is unusable.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// A value is wrong; the message names the key.
    #[error("invalid configuration: {0}")]
    Invalid(String),
    /// A run-time package setting (CA certificates, index URLs) is wrong.
    #[error("invalid configuration: {0}")]
    Packages(#[from] crate::packages::PackageSettingsError),
}

impl RawConfig {
    /// Checks and converts the raw config, section by section (in this order: the names, the
    /// sandbox's files, the SKUs, the limits, attempts, the network, the warm pool, user
    /// namespaces, the sandbox's uid, outputs, the metrics address, sessions).
    ///
    /// # Errors
    /// [`SettingsError::Invalid`] naming the offending key; [`SettingsError::Packages`].
    pub fn validate(self) -> Result<Settings, SettingsError> {
        let worker_id = names(&self.namespace, self.worker.id.clone())?;
        let (rootfs, packages, container_helper) = sandbox_files(&self.worker)?;
        let capacity_cpus =
            self.worker.capacity_cpus.unwrap_or_else(|| std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64));
        let capacity_memory_bytes = self.worker.capacity_memory_bytes.unwrap_or_else(host::host_memory_bytes);
        let skus = skus(&self.skus, capacity_cpus, capacity_memory_bytes)?;
        let limits = limits(&self.limits, self.worker.outbound_network.unwrap_or(true))?;
        let max_attempts = self.worker.max_attempts.unwrap_or(3).max(1);
        if max_attempts >= self.amqp.delivery_limit {
            return bad(format!("worker.max_attempts {max_attempts} must be below amqp.delivery_limit {}", self.amqp.delivery_limit));
        }
        let network = network(&self.worker)?;
        let warm = warm(&self.warm)?;
        let warm_sandboxes: usize = skus.len() * warm.kinds().iter().map(|(r, m)| warm.kept(*r, *m)).sum::<usize>();
        let capacity_memory_bytes = memory_left_by_warm(&warm, &skus, warm_sandboxes, capacity_memory_bytes)?;
        let (id_map, userns_lease) = user_namespace(&self.worker, &skus, warm_sandboxes)?;
        let sandbox_uid = self.worker.sandbox_uid.unwrap_or(1000);
        if sandbox_uid >= 65_536 {
            return bad(format!("worker.sandbox_uid {sandbox_uid} must be below 65536 (the mapped range)"));
        }
        let outputs = outputs(&self.worker)?;
        let metrics_addr = metrics_addr(self.worker.metrics_addr.as_deref())?;
        let data_dir = self.worker.data_dir.clone().unwrap_or_else(|| PathBuf::from("/var/lib/sandq"));
        let state_cache_dir = data_dir.join(format!("{worker_id}.state-cache"));
        let state_dir = self.worker.state_dir.clone().unwrap_or_else(|| PathBuf::from("/run/sandq"));
        Ok(Settings {
            names: Names::new(self.namespace.clone()),
            services: ServiceConfig { namespace: self.namespace, amqp: self.amqp, redis: self.redis, s3: self.s3, queues: self.queues },
            jobs_dir: data_dir.join(&worker_id),
            state_root: state_dir.join(&worker_id),
            worker_id,
            rootfs,
            container_helper,
            sandbox_uid,
            id_map,
            userns_lease,
            seccomp: self.worker.seccomp.unwrap_or(true),
            packages,
            shutdown_grace: self.worker.shutdown_grace.unwrap_or(Duration::from_secs(30)),
            outputs,
            sessions: sessions(&self.sessions, state_cache_dir),
            warm,
            network,
            max_attempts,
            limits,
            skus,
            capacity_cpus,
            capacity_memory_bytes,
            metrics_addr,
        })
    }
}

/// A failed check: [`SettingsError::Invalid`] with `message`.
fn bad<T>(message: String) -> Result<T, SettingsError> {
    Err(SettingsError::Invalid(message))
}

/// `namespace` and `worker.id` (default: the host's name), both `[A-Za-z0-9_-]`; the worker's
/// id.
fn names(namespace: &str, id: Option<String>) -> Result<String, SettingsError> {
    if namespace.is_empty() || !namespace.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        return bad(format!("namespace {namespace:?}: use [A-Za-z0-9_-]"));
    }
    let worker_id = match id {
        Some(id) => id,
        None => host::hostname(),
    };
    if worker_id.is_empty() || !worker_id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        return bad(format!("worker.id {worker_id:?}: use [A-Za-z0-9_-]"));
    }
    Ok(worker_id)
}

/// `worker.rootfs` (a sandbox image), the run-time package settings read against it, and
/// `worker.container_helper` (default: beside the worker's own binary).
fn sandbox_files(worker: &RawWorker) -> Result<(PathBuf, crate::packages::Packages, PathBuf), SettingsError> {
    let Some(rootfs) = worker.rootfs.clone() else {
        return bad("worker.rootfs is not set: run oci-bundles/build-rootfs.sh and put its output there".into());
    };
    if !rootfs.join("usr/bin/python3").exists() {
        return bad(format!("worker.rootfs {} holds no sandbox image (no usr/bin/python3)", rootfs.display()));
    }
    let packages = crate::packages::RawPackages {
        extra_ca_certs: worker.extra_ca_certs.as_deref(),
        pip_index_url: worker.pip_index_url.as_deref(),
        pip_extra_index_urls: worker.pip_extra_index_urls.as_deref(),
        pip_trusted_hosts: worker.pip_trusted_hosts.as_deref(),
        npm_registry: worker.npm_registry.as_deref(),
    }
    .validate(&rootfs)?;
    let container_helper = match worker.container_helper.clone() {
        Some(p) => p,
        None => host::beside_own_binary("sandq-container").map_err(|e| SettingsError::Invalid(format!("cannot find own binary: {e}")))?,
    };
    if !container_helper.exists() {
        return bad(format!("worker.container_helper {} does not exist", container_helper.display()));
    }
    Ok((rootfs, packages, container_helper))
}

/// `[skus.*]`: the SKUs served (slots > 0, within the capacity); at least one.
fn skus(
    raw: &BTreeMap<String, RawSku>,
    capacity_cpus: f64,
    capacity_memory_bytes: u64,
) -> Result<BTreeMap<Sku, SkuSettings>, SettingsError> {
    for key in raw.keys() {
        if key.parse::<Sku>().is_err() || key.to_ascii_lowercase() != *key {
            return bad(format!("skus.{key}: expected one of s, m, l, xl"));
        }
    }
    let mut skus = BTreeMap::new();
    for sku in Sku::ALL {
        let raw = raw.get(&sku.as_str().to_ascii_lowercase()).cloned().unwrap_or_else(|| default_sku(sku));
        if !raw.cpus.is_finite() || raw.cpus <= 0.0 || raw.memory_bytes < (64 << 20) || raw.pids < 16 {
            return bad(format!("skus.{sku}: cpus > 0, memory_bytes >= 64 MiB and pids >= 16 are required"));
        }
        let fits = raw.cpus <= capacity_cpus && raw.memory_bytes <= capacity_memory_bytes;
        if raw.slots > 0 && !fits {
            tracing::warn!(
                %sku, cpus = raw.cpus, memory_bytes = raw.memory_bytes, capacity_cpus, capacity_memory_bytes,
                "SKU is larger than this worker's capacity; not serving it"
            );
        }
        if raw.slots > 0 && fits {
            let limits = SandboxLimits { cpus: raw.cpus, memory_bytes: raw.memory_bytes, pids: raw.pids };
            let disk_bytes = raw.disk_bytes.unwrap_or_else(|| default_sku(sku).disk_bytes.unwrap_or(0));
            if disk_bytes != 0 && disk_bytes < (16 << 20) {
                return bad(format!("skus.{sku}.disk_bytes: at least 16 MiB, or 0 for no quota"));
            }
            skus.insert(sku, SkuSettings { limits, slots: raw.slots, disk_bytes });
        }
    }
    if skus.is_empty() {
        return bad("no SKU has slots > 0 and fits worker.capacity_cpus / capacity_memory_bytes".into());
    }
    Ok(skus)
}

/// `[limits]` over the defaults, with `worker.outbound_network` (`outbound`).
fn limits(raw: &RawLimits, outbound: bool) -> Result<Limits, SettingsError> {
    let mut limits = Limits::default();
    if let Some(t) = raw.default_timeout {
        limits.default_timeout = t;
    }
    if let Some(t) = raw.max_timeout {
        limits.max_timeout = t;
    }
    if let Some(t) = raw.max_result_ttl {
        limits.max_result_ttl = t;
    }
    if let Some(b) = raw.max_input_bytes {
        limits.max_input_bytes = b;
    }
    limits.outbound_network = outbound;
    if limits.default_timeout > limits.max_timeout {
        return bad("limits.default_timeout is above limits.max_timeout".into());
    }
    Ok(limits)
}

/// `worker.outbound_network`, `worker.blocked_ranges` and `worker.nameservers` (default: the
/// host's that are not blocked).
fn network(worker: &RawWorker) -> Result<NetworkSettings, SettingsError> {
    let mut blocked_ranges = Vec::new();
    for item in worker.blocked_ranges.as_deref().unwrap_or("").split(',').map(str::trim).filter(|i| !i.is_empty()) {
        match crate::sandbox::network::parse_range(item) {
            Ok(range) => blocked_ranges.push(range),
            Err(e) => return bad(format!("worker.blocked_ranges: {e}")),
        }
    }
    let nameservers = match &worker.nameservers {
        None => crate::sandbox::network::default_nameservers(&blocked_ranges),
        Some(list) => {
            let mut parsed = Vec::new();
            for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
                match item.parse::<std::net::Ipv4Addr>() {
                    Ok(a) => parsed.push(a),
                    Err(_) => return bad(format!("worker.nameservers: {item:?} is not an IPv4 address")),
                }
            }
            parsed
        }
    };
    Ok(NetworkSettings { outbound: worker.outbound_network.unwrap_or(true), nameservers, blocked_ranges })
}

/// `[warm]`: the warm pool.
fn warm(raw: &RawWarm) -> Result<WarmSettings, SettingsError> {
    let mut runtimes = Vec::new();
    for name in raw.runtimes.as_deref().unwrap_or("python,node").split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let runtime = match name {
            "python" => sandq_schemas::Runtime::Python,
            "node" => sandq_schemas::Runtime::Node,
            other => return bad(format!("warm.runtimes: unknown runtime {other:?} (python, node)")),
        };
        if !runtimes.contains(&runtime) {
            runtimes.push(runtime);
        }
    }
    let per_sku = raw.per_sku.unwrap_or(1);
    Ok(WarmSettings {
        per_sku,
        memory_bytes: raw.memory_bytes.unwrap_or(256 << 20),
        preload: raw.preload.clone().unwrap_or_else(|| "numpy,pandas,matplotlib".to_owned()),
        runtimes,
        forked: raw.forked.unwrap_or(true),
        light_per_sku: if per_sku == 0 { 0 } else { raw.light_per_sku.unwrap_or(2).max(per_sku) },
        template_lifetime: match raw.template_lifetime.unwrap_or(Duration::from_secs(3600)) {
            lifetime if lifetime < Duration::from_secs(1) => return bad("warm.template_lifetime: at least 1s".into()),
            lifetime => lifetime,
        },
        script: raw.script.unwrap_or(true),
    })
}

/// The memory jobs get: `capacity_memory_bytes` less the warm pool's (`warm_sandboxes` kept
/// over the SKUs served), which must leave room for the largest SKU.
fn memory_left_by_warm(
    warm: &WarmSettings,
    skus: &BTreeMap<Sku, SkuSettings>,
    warm_sandboxes: usize,
    capacity_memory_bytes: u64,
) -> Result<u64, SettingsError> {
    let warm_reserve = skus.len() as u64 * warm.kinds().iter().map(|(r, m)| warm.reserve_bytes(*r, *m)).sum::<u64>();
    match capacity_memory_bytes.checked_sub(warm_reserve) {
        Some(left) if skus.values().all(|s| s.limits.memory_bytes <= left) => Ok(left),
        _ => bad(format!(
            "{warm_sandboxes} warm sandboxes take {warm_reserve} bytes of the {capacity_memory_bytes} bytes of \
             worker.capacity_memory_bytes, leaving too little for the largest SKU served: lower warm.per_sku or warm.memory_bytes"
        )),
    }
}

/// The id map and its lease.
type UserNamespace = (Option<crate::sandbox::spec::IdMap>, Option<(usize, std::sync::Arc<std::fs::File>)>);

/// `worker.user_namespace`, `userns_host_base` and `userns_lease_dir`: the sandboxes' id map
/// (a range per consumer slot of `skus` and two per warm sandbox) and the lease that reserves
/// it among the host's workers (taken here).
fn user_namespace(worker: &RawWorker, skus: &BTreeMap<Sku, SkuSettings>, warm_sandboxes: usize) -> Result<UserNamespace, SettingsError> {
    let mut id_map = worker
        .user_namespace
        .unwrap_or(true)
        .then(|| crate::sandbox::spec::IdMap { host_base: worker.userns_host_base.unwrap_or(DEFAULT_USERNS_HOST_BASE), size: 65_536 });
    let mut userns_lease = None;
    if let Some(map) = id_map.as_mut() {
        // Consumer slots, then the warm sandboxes' ranges (twice per SKU: a warm sandbox
        // keeps its range while its job runs, and one is made meanwhile).
        let slots: usize = skus.values().map(|s| s.slots).sum::<usize>() + 2 * warm_sandboxes;
        let span = slots as u64 * u64::from(map.size);
        if let Some(dir) = &worker.userns_lease_dir {
            if slots as u64 > USERNS_LEASE_RANGES {
                return bad(format!(
                    "worker.userns_lease_dir: this worker needs {slots} id ranges, a lease holds {USERNS_LEASE_RANGES}: lower the slots or warm sandboxes"
                ));
            }
            let lease_span = USERNS_LEASE_RANGES * u64::from(map.size);
            let leases = (u64::from(u32::MAX) - u64::from(map.host_base)) / lease_span;
            let (k, file) = host::take_userns_lease(dir, leases as usize).map_err(|e| SettingsError::Invalid(e.to_string()))?;
            map.host_base = u32::try_from(u64::from(map.host_base) + k as u64 * lease_span)
                .map_err(|_| SettingsError::Invalid(format!("worker.userns_lease_dir: lease {k} is past the id space")))?;
            userns_lease = Some((k, std::sync::Arc::new(file)));
        }
        let map = *map;
        let end = u64::from(map.host_base) + span;
        if end > u64::from(u32::MAX) {
            return bad(format!("worker.userns_host_base {} leaves no room for {slots} slots of 65536 ids", map.host_base));
        }
        if let Some((file, entry)) = host::subordinate_conflict(u64::from(map.host_base)..end) {
            return bad(format!(
                "worker.userns_host_base {}: its ids {}..{end} overlap {file} entry {entry:?}; choose a range no host user is given",
                map.host_base, map.host_base
            ));
        }
    }
    Ok((id_map, userns_lease))
}

/// `worker.artifact_url_ttl` unless set: an hour, long enough to fetch what a job left right
/// after it ends, short enough that a URL copied out of a result (a log, a chat, a notebook)
/// stops working soon; the gateway's artifact route presigns afresh at each request.
pub const DEFAULT_ARTIFACT_URL_TTL: Duration = Duration::from_secs(3600);

/// The `worker.*` keys of what a job may leave (streams, rich outputs, artifacts, their URLs).
fn outputs(worker: &RawWorker) -> Result<OutputSettings, SettingsError> {
    let artifact_url_ttl = worker.artifact_url_ttl.unwrap_or(DEFAULT_ARTIFACT_URL_TTL);
    if artifact_url_ttl > Duration::from_secs(7 * 24 * 3600) {
        return bad("worker.artifact_url_ttl: at most 7days (the SigV4 presigning limit)".into());
    }
    Ok(OutputSettings {
        max_output_bytes: worker.max_output_bytes.unwrap_or(8 << 20),
        max_inline_output_bytes: worker.max_inline_output_bytes.unwrap_or(64 << 10),
        max_artifacts: worker.max_artifacts.unwrap_or(100),
        max_artifact_bytes: worker.max_artifact_bytes.unwrap_or(512 << 20),
        artifact_url_ttl,
        max_outputs: worker.max_outputs.unwrap_or(100),
        max_outputs_bytes: worker.max_outputs_bytes.unwrap_or(32 << 20).max(1 << 20),
        stream_max_bytes: worker.stream_max_bytes.unwrap_or(1 << 20),
    })
}

/// `worker.metrics_addr` (default `127.0.0.1:9464`).
fn metrics_addr(raw: Option<&str>) -> Result<std::net::SocketAddr, SettingsError> {
    let metrics_addr = raw.unwrap_or("127.0.0.1:9464");
    let Ok(metrics_addr) = metrics_addr.parse::<std::net::SocketAddr>() else {
        return bad(format!(
            "worker.metrics_addr {metrics_addr:?}: expected an address and port (127.0.0.1:9464, 0.0.0.0:9464, [::]:9464)"
        ));
    };
    Ok(metrics_addr)
}

/// `[sessions]`, the state cache in `state_cache_dir`.
fn sessions(raw: &RawSessions, state_cache_dir: PathBuf) -> SessionSettings {
    SessionSettings {
        idle_timeout: raw.idle_timeout.unwrap_or(Duration::from_secs(30 * 60)),
        lock_wait: raw.lock_wait.unwrap_or(Duration::from_secs(10 * 60)),
        reap_interval: raw.reap_interval.unwrap_or(Duration::from_secs(60)).max(Duration::from_millis(100)),
        rebuild_interval: raw.rebuild_interval.unwrap_or(Duration::from_secs(3600)).max(Duration::from_secs(1)),
        max_state_bytes: raw.max_state_bytes.unwrap_or(64 << 20),
        state_cache: (state_cache_dir, raw.state_cache_bytes.unwrap_or(4 * raw.max_state_bytes.unwrap_or(64 << 20))),
        max_state_save: raw.max_state_save.unwrap_or(Duration::from_secs(20)),
    }
}

impl Settings {
    /// The `resolv.conf` bind-mounted into outbound sandboxes (written at start), beside the
    /// state root (which holds only container state dirs): `<state_dir>/<worker id>.resolv.conf`.
    pub fn resolv_conf(&self) -> PathBuf {
        self.state_root.with_file_name(format!("{}.resolv.conf", self.worker_id))
    }

    /// The user namespace mapping of the job in consumer slot `slot` (0-based, over all SKUs):
    /// each slot has a range of its own, `host_base + slot * size`, so that no per-user kernel
    /// counter (pipe buffers, epoll watches, and those charged to the namespace's owner: inotify,
    /// pending signals, message queues) is shared between concurrent sandboxes (test:
    /// a_sandbox_cannot_exhaust_host_roots_per_user_limits in tests/hostile.rs). `None` without
    /// user namespaces.
    pub fn id_map_for(&self, slot: usize) -> Option<crate::sandbox::spec::IdMap> {
        self.id_map.map(|m| crate::sandbox::spec::IdMap {
            host_base: m.host_base + u32::try_from(slot).unwrap_or(u32::MAX / m.size) * m.size,
            size: m.size,
        })
    }

    /// Consumer slots over all SKUs: slot indexes are `0..total_slots()`; warm sandboxes
    /// take the indexes after them, `total_slots()..total_slots() + warm_ranges()`.
    pub fn total_slots(&self) -> usize {
        self.skus.values().map(|s| s.slots).sum()
    }

    /// User namespace ranges set aside for warm sandboxes.
    pub fn warm_ranges(&self) -> usize {
        2 * self.skus.len() * self.warm.kinds().iter().map(|(r, m)| self.warm.kept(*r, *m)).sum::<usize>()
    }

    /// The host uid (and gid) that owns files the program in slot `slot` writes: the sandbox
    /// uid, shifted by the slot's user namespace mapping when there is one.
    pub fn host_sandbox_uid(&self, slot: usize) -> u32 {
        self.id_map_for(slot).map_or(self.sandbox_uid, |m| m.host_base + self.sandbox_uid)
    }
}

#[cfg(test)]
mod tests {
    use super::WarmSettings;
    use sandq_schemas::{RunMode, Runtime};

    fn warm(per_sku: usize, light_per_sku: usize, forked: bool, script: bool) -> WarmSettings {
        WarmSettings {
            per_sku,
            memory_bytes: 256 << 20,
            preload: String::new(),
            runtimes: vec![Runtime::Python, Runtime::Node],
            forked,
            light_per_sku,
            template_lifetime: std::time::Duration::from_secs(3600),
            script,
        }
    }

    #[test]
    fn the_memory_set_aside_covers_what_each_kind_of_pool_holds() {
        let w = warm(1, 2, true, true);
        assert_eq!(w.kinds().len(), 4);
        // Python notebook: two forked (2 x 32 MiB) or one preloading (256 MiB) while its template
        // is not ready: the larger.
        assert_eq!((w.kept(Runtime::Python, RunMode::Notebook), w.reserve_bytes(Runtime::Python, RunMode::Notebook)), (2, 256 << 20));
        // Script ones: two of 32 MiB, for either runtime.
        assert_eq!((w.kept(Runtime::Node, RunMode::Script), w.reserve_bytes(Runtime::Node, RunMode::Script)), (2, 64 << 20));
        // A Node.js notebook one preloads its runner: per_sku of memory_bytes.
        assert_eq!((w.kept(Runtime::Node, RunMode::Notebook), w.reserve_bytes(Runtime::Node, RunMode::Notebook)), (1, 256 << 20));
        // Ten light ones (320 MiB) take more than one preloading one.
        assert_eq!(warm(1, 10, true, true).reserve_bytes(Runtime::Python, RunMode::Notebook), 320 << 20);
        // Unforked, no scripts: one preloading Python sandbox, and no script kinds.
        let w = warm(1, 2, false, false);
        assert_eq!((w.kept(Runtime::Python, RunMode::Notebook), w.kinds().len()), (1, 2));
    }
}
