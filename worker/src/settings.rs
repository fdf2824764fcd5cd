//! The worker's configuration: [`RawConfig`] as read (TOML file + `SANDQ__*` environment, see
//! `sandq_submitter::config`), converted once into validated [`Settings`].
//!
//! Keys are lower-case (the `config` crate lower-cases environment keys), so SKU sections are
//! `[skus.s]`, `[skus.m]`, `[skus.l]`, `[skus.xl]`.

use std::collections::BTreeMap;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sandq_schemas::names::Names;
use sandq_schemas::{Limits, Sku};
use sandq_submitter::config::{AmqpConfig, QueuesConfig, RedisConfig, S3Config, ServiceConfig};
use serde::Deserialize;

use crate::sandbox::spec::SandboxLimits;

/// The config file as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Prefix of queues, exchanges and Redis keys; default `sandq`.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// RabbitMQ.
    #[serde(default)]
    pub amqp: AmqpConfig,
    /// Redis.
    #[serde(default)]
    pub redis: RedisConfig,
    /// S3.
    #[serde(default)]
    pub s3: S3Config,
    /// The job queues' arguments (`unserved_ttl`).
    #[serde(default)]
    pub queues: QueuesConfig,
    /// This worker.
    #[serde(default)]
    pub worker: RawWorker,
    /// Limits every job must fit.
    #[serde(default)]
    pub limits: RawLimits,
    /// SKU table, keyed `s`, `m`, `l`, `xl`; missing entries take the defaults of
    /// [`default_sku`].
    #[serde(default)]
    pub skus: BTreeMap<String, RawSku>,
    /// Sessions.
    #[serde(default)]
    pub sessions: RawSessions,
    /// Warm sandboxes.
    #[serde(default)]
    pub warm: RawWarm,
}

/// `[warm]`: sandboxes started before any job arrives ([`crate::warm`]).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawWarm {
    /// Warm sandboxes kept ready per SKU this worker serves; default 1; 0 turns warm starts
    /// off (every job starts cold).
    pub per_sku: Option<usize>,
    /// Modules the warm runner imports before its job, comma-separated; default
    /// `numpy,pandas,matplotlib` (matplotlib with pyplot, Agg backend).
    pub preload: Option<String>,
    /// Memory set aside for each warm sandbox, bytes: taken from `worker.capacity_memory_bytes`
    /// before jobs get any (warm sandboxes count against the worker's memory); default 256 MiB
    /// (measured in the sandbox's memory cgroup: a waiting Python runner with the default
    /// preload 75-83 MiB, a Node.js one 13-17 MiB).
    pub memory_bytes: Option<u64>,
    /// Runtimes that get warm sandboxes, comma-separated (`python`, `node`); default both.
    /// Each costs `per_sku` sandboxes per SKU (and `memory_bytes` each off the capacity).
    pub runtimes: Option<String>,
}

/// `[sessions]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSessions {
    /// A session expires this long after its last job ended; default `30m` (the product
    /// brief's "deleted when it expires", E2B's default sandbox lifetime is of the same order).
    #[serde(default, with = "humantime_serde")]
    pub idle_timeout: Option<Duration>,
    /// How long a job waits for another job of its session to finish before it is rejected
    /// (`session busy`); default `10m`.
    #[serde(default, with = "humantime_serde")]
    pub lock_wait: Option<Duration>,
    /// How often this worker deletes expired sessions; default `60s`.
    #[serde(default, with = "humantime_serde")]
    pub reap_interval: Option<Duration>,
    /// How often the sessions index is rebuilt from the manifests in S3, across all workers
    /// (one of them takes each turn); default `1h`. A session missing from the index (a client
    /// removed it, or its update failed) is deleted at most this long after it expired. The
    /// rebuild after the index was found of another type waits a minute, or this if shorter.
    #[serde(default, with = "humantime_serde")]
    pub rebuild_interval: Option<Duration>,
    /// Largest notebook state (the pickled variables a notebook job leaves for the next job of
    /// its session), bytes; variables past it are left out and listed. Default 64 MiB. The
    /// outputs tmpfs grows by twice this for session notebook jobs (the state restored and the
    /// state saved), charged to the job's memory as it is written.
    pub max_state_bytes: Option<u64>,
    /// Longest time the runner may spend saving the state after the cell; variables not saved
    /// by then are left out and listed. Default `20s` (within the job's own timeout).
    #[serde(default, with = "humantime_serde")]
    pub max_state_save: Option<Duration>,
}

fn default_namespace() -> String {
    sandq_schemas::names::DEFAULT_NAMESPACE.to_owned()
}

/// `[worker]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawWorker {
    /// Worker id in results and log lines, and the name of its private dirs; default the host
    /// name. Two workers on one host need distinct ids.
    pub id: Option<String>,
    /// The sandbox image's rootfs (printed by `oci-bundles/build-rootfs.sh`). Required.
    pub rootfs: Option<PathBuf>,
    /// Root of per-job work dirs; default `/var/lib/sandq`.
    pub data_dir: Option<PathBuf>,
    /// Root of libcontainer state; default `/run/sandq`.
    pub state_dir: Option<PathBuf>,
    /// Path of the `sandq-container` helper; default next to the worker binary.
    pub container_helper: Option<PathBuf>,
    /// uid and gid the program runs as inside the sandbox; default 1000.
    pub sandbox_uid: Option<u32>,
    /// Give each sandbox its own user namespace, container ids `0..65536` mapped to the host ids
    /// of its consumer slot, `userns_host_base + slot * 65536 ..+65536`, so that even container
    /// root is an unprivileged host user and concurrent sandboxes share no per-user kernel
    /// counter; default true.
    pub user_namespace: Option<bool>,
    /// First host uid/gid of the user namespace ranges (one range of 65,536 per consumer
    /// slot and warm sandbox); default [`DEFAULT_USERNS_HOST_BASE`]. Workers sharing a host
    /// need disjoint ranges; a range that an `/etc/subuid` or `/etc/subgid` entry covers is
    /// refused (a host user could then act as a sandbox's ids).
    pub userns_host_base: Option<u32>,
    /// A directory that every worker of a host shares (a `hostPath` on Kubernetes, where
    /// several worker pods may run on one node and cannot be given distinct bases by hand).
    /// When set, the worker takes the first free lease `userns-<k>.lock` there (an exclusive
    /// `flock`, held for the worker's life and released by the kernel when it exits, however it
    /// exits) and its ranges start at `userns_host_base + k * 64 * 65536`
    /// ([`USERNS_LEASE_RANGES`]). Unset: the base is used as it is.
    pub userns_lease_dir: Option<PathBuf>,
    /// Apply the seccomp allowlist (`oci-bundles/seccomp.json`); default true.
    pub seccomp: Option<bool>,
    /// Serve `network: "outbound"` jobs (bridge `sandq0`, NAT, firewall rules set up at start;
    /// needs `ip` and `iptables`); default true.
    pub outbound_network: Option<bool>,
    /// Nameservers of outbound sandboxes (their `/etc/resolv.conf`), IPv4 addresses separated
    /// by commas; each is let through the firewall on port 53, even in a blocked range (a
    /// private resolver answers for private zones: name one only on purpose). Default: the
    /// host's non-loopback nameservers outside the blocked ranges, else 1.1.1.1 and 9.9.9.9
    /// (`sandbox::network::default_nameservers`).
    pub nameservers: Option<String>,
    /// IPv4 ranges outbound sandboxes may not reach besides the built-in ones
    /// (`sandbox::network::BLOCKED_RANGES`: private, link-local, CGNAT, reserved, cloud
    /// metadata and platform addresses), CIDR text separated by commas (`198.51.100.0/24,
    /// 203.0.113.7`): a site's own services on public addresses. Every worker of one host must
    /// have the same list (they share the firewall chains).
    pub blocked_ranges: Option<String>,
    /// A PEM file on the worker's host of CA certificates that sandboxes trust besides the
    /// image's (a TLS-intercepting proxy's, a private mirror's): read at start (at most 1 MiB,
    /// every block a certificate), appended to the image's bundle and bind-mounted read-only
    /// over `/etc/ssl/certs/ca-certificates.crt` in outbound sandboxes, with `SSL_CERT_FILE`,
    /// `REQUESTS_CA_BUNDLE`, `PIP_CERT` and `NODE_EXTRA_CA_CERTS` naming it
    /// ([`crate::packages`]). Default: none (the image's bundle alone).
    pub extra_ca_certs: Option<PathBuf>,
    /// The package index `pip install` uses (`PIP_INDEX_URL`), an http(s) URL of a PEP 503
    /// simple index; default pip's own (`https://pypi.org/simple`).
    pub pip_index_url: Option<String>,
    /// Further indexes pip searches (`PIP_EXTRA_INDEX_URL`), comma-separated URLs; default none.
    pub pip_extra_index_urls: Option<String>,
    /// Hosts pip trusts without TLS verification (`PIP_TRUSTED_HOST`), comma-separated
    /// `host` or `host:port`; default none. Prefer `extra_ca_certs`.
    pub pip_trusted_hosts: Option<String>,
    /// The registry `npm install` uses (`npm_config_registry`), an http(s) URL; default npm's
    /// own (`https://registry.npmjs.org/`).
    pub npm_registry: Option<String>,
    /// After SIGTERM, how long running jobs may go on before they are killed and requeued;
    /// default `30s`. Keep it below the pod's `terminationGracePeriodSeconds`.
    #[serde(default, with = "humantime_serde")]
    pub shutdown_grace: Option<Duration>,
    /// Bytes of stdout and of stderr kept per job (stored in S3); default 8 MiB each.
    pub max_output_bytes: Option<u64>,
    /// Bytes of stdout and of stderr inlined in the result in Redis; default 64 KiB each.
    pub max_inline_output_bytes: Option<u64>,
    /// Most artifacts per job; default 100.
    pub max_artifacts: Option<usize>,
    /// Most artifact bytes per job, in all; default 512 MiB.
    pub max_artifact_bytes: Option<u64>,
    /// Validity of the presigned download URL of each artifact and image output; default
    /// `24h`, at most `7days` (the SigV4 limit); `0s` presigns nothing.
    #[serde(default, with = "humantime_serde")]
    pub artifact_url_ttl: Option<Duration>,
    /// Most rich outputs (MIME bundles) per notebook-mode job; default 100.
    pub max_outputs: Option<usize>,
    /// Bytes the notebook runner may write in all (its outputs file lives on a tmpfs of this
    /// size, charged to the job's memory); default 32 MiB.
    pub max_outputs_bytes: Option<u64>,
    /// Cores this worker may hand out to running jobs in all (sum of their SKUs' `cpus`);
    /// default: the host's online CPUs. A SKU bigger than this is not served.
    pub capacity_cpus: Option<f64>,
    /// Memory this worker may hand out to running jobs in all (sum of their SKUs'
    /// `memory_bytes`), bytes; default: the host's MemTotal.
    pub capacity_memory_bytes: Option<u64>,
    /// Infrastructure failures of one job before it gets `internal_error` and is acked;
    /// default 3 (below the queues' delivery limit, so the result is written before RabbitMQ
    /// dead-letters the message).
    pub max_attempts: Option<u32>,
    /// Address of the HTTP endpoints `/metrics` (Prometheus), `/healthz` and `/readyz`;
    /// default `127.0.0.1:9464`. In a pod, `0.0.0.0:9464` so that the kubelet and Prometheus
    /// reach it.
    pub metrics_addr: Option<String>,
}

/// `[limits]`: the job limits of [`sandq_schemas::Limits`], durations as humantime strings.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    /// Default timeout; default `60s`.
    #[serde(default, with = "humantime_serde")]
    pub default_timeout: Option<Duration>,
    /// Largest timeout a job may ask for; default `15m`.
    #[serde(default, with = "humantime_serde")]
    pub max_timeout: Option<Duration>,
    /// Largest result TTL; default `7days`.
    #[serde(default, with = "humantime_serde")]
    pub max_result_ttl: Option<Duration>,
    /// Largest total input size, bytes; default 1 GiB.
    pub max_input_bytes: Option<u64>,
}

/// `[skus.<name>]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSku {
    /// CPU quota, cores.
    pub cpus: f64,
    /// Memory limit (and memory + swap limit), bytes.
    pub memory_bytes: u64,
    /// Most processes and threads.
    #[serde(default = "default_pids")]
    pub pids: i64,
    /// Jobs of this SKU this worker runs at once (0: it does not serve the SKU); default 1.
    #[serde(default = "default_slots")]
    pub slots: usize,
    /// Size of the job's `/work` filesystem (its disk quota, inputs included), bytes; 0: no
    /// quota (a plain directory on the host's disk). Defaults: S 1 GiB, M 2, L 4, XL 8.
    pub disk_bytes: Option<u64>,
}

fn default_pids() -> i64 {
    1024
}
fn default_slots() -> usize {
    1
}

/// The product's SKU table (brief): S = 1 core / 2 GiB, M = 2 / 4, L = 4 / 8, XL = 8 / 16.
pub fn default_sku(sku: Sku) -> RawSku {
    let (cpus, gib) = match sku {
        Sku::S => (1.0, 2),
        Sku::M => (2.0, 4),
        Sku::L => (4.0, 8),
        Sku::XL => (8.0, 16),
    };
    RawSku { cpus, memory_bytes: gib << 30, pids: default_pids(), slots: default_slots(), disk_bytes: Some(gib << 29) }
}

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

/// Validated settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Connection sections, as the client library takes them.
    pub services: ServiceConfig,
    /// Names of queues and keys.
    pub names: Names,
    /// This worker's id.
    pub worker_id: String,
    /// The image rootfs.
    pub rootfs: PathBuf,
    /// `<data_dir>/<worker id>`: this worker's job dirs.
    pub jobs_dir: PathBuf,
    /// `<state_dir>/<worker id>`: this worker's libcontainer state root.
    pub state_root: PathBuf,
    /// The helper binary.
    pub container_helper: PathBuf,
    /// uid/gid inside the sandbox.
    pub sandbox_uid: u32,
    /// User namespace mapping, if enabled.
    pub id_map: Option<crate::sandbox::spec::IdMap>,
    /// The lease file whose `flock` reserves `id_map`'s ranges among the host's workers
    /// (`worker.userns_lease_dir`), and its index; held as long as any clone of the settings.
    pub userns_lease: Option<(usize, std::sync::Arc<std::fs::File>)>,
    /// Seccomp on.
    pub seccomp: bool,
    /// Outbound network mode served.
    pub outbound_network: bool,
    /// Nameservers of outbound sandboxes.
    pub nameservers: Vec<std::net::Ipv4Addr>,
    /// Extra ranges outbound sandboxes may not reach, canonical CIDR text.
    pub blocked_ranges: Vec<String>,
    /// Run-time package installs: trusted CAs, indexes, the user site's path.
    pub packages: crate::packages::Packages,
    /// Shutdown grace period.
    pub shutdown_grace: Duration,
    /// Output cap per stream, bytes.
    pub max_output_bytes: u64,
    /// Inline output cap per stream, bytes.
    pub max_inline_output_bytes: u64,
    /// Artifact count cap.
    pub max_artifacts: usize,
    /// Artifact bytes cap.
    pub max_artifact_bytes: u64,
    /// Presigned URL validity; zero: no URLs.
    pub artifact_url_ttl: Duration,
    /// Rich outputs per job.
    pub max_outputs: usize,
    /// Rich output bytes per job (the outputs tmpfs size).
    pub max_outputs_bytes: u64,
    /// Session inactivity timeout.
    pub session_idle_timeout: Duration,
    /// Session lock wait.
    pub session_lock_wait: Duration,
    /// Session reaper period.
    pub session_reap_interval: Duration,
    /// Period of the sessions index rebuild from S3 (cluster-wide).
    pub session_rebuild_interval: Duration,
    /// Largest notebook state of a session, bytes.
    pub max_state_bytes: u64,
    /// Longest time the runner spends saving a notebook state.
    pub max_state_save: Duration,
    /// Warm sandboxes kept per SKU served (0: none).
    pub warm_per_sku: usize,
    /// Memory set aside in the capacity for each warm sandbox (`warm.memory_bytes`, default
    /// 256 MiB), bytes; also the most of a warm-up's memory a job is given on top of its
    /// SKU's at handover.
    pub warm_memory_bytes: u64,
    /// Modules a warm runner preloads (`SANDQ_PRELOAD`).
    pub warm_preload: String,
    /// Runtimes with warm sandboxes.
    pub warm_runtimes: Vec<sandq_schemas::Runtime>,
    /// Infrastructure attempts per job.
    pub max_attempts: u32,
    /// Job limits.
    pub limits: Limits,
    /// Served SKUs.
    pub skus: BTreeMap<Sku, SkuSettings>,
    /// Declared capacity: cores.
    pub capacity_cpus: f64,
    /// Memory jobs get, bytes: the declared capacity less the warm sandboxes' share
    /// (`warm.memory_bytes` each).
    pub capacity_memory_bytes: u64,
    /// Address of `/metrics`, `/healthz` and `/readyz`.
    pub metrics_addr: std::net::SocketAddr,
}

fn host_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().find_map(|l| l.strip_prefix("MemTotal:").map(|v| v.trim().trim_end_matches("kB").trim().to_owned())))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
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

/// Default first host id of the sandboxes' user namespace ranges: `0x7000_0000`
/// (1,879,048,192). It lies above Debian's subordinate ids (`SUB_UID_MIN` 100,000 to
/// `SUB_UID_MAX` 600,100,000 in `login.defs`, which `useradd` hands out) and above systemd's
/// container ranges (524,288 to 1,879,048,191, `nspawn`), in the range systemd leaves unused
/// below its foreign range at 2,147,352,576 (<https://systemd.io/UIDS-GIDS/>): room for 4,094
/// ranges of 65,536 ids.
pub const DEFAULT_USERNS_HOST_BASE: u32 = 0x7000_0000;

/// Ranges of 65,536 ids in one lease of `worker.userns_lease_dir`: the same for every worker,
/// so that workers of different sizes sharing the dir never overlap (64 covers, say, 16 slots and
/// 24 warm sandboxes); from the default base, 576 leases fit below `u32::MAX`.
pub const USERNS_LEASE_RANGES: u64 = 64;

/// Takes the first free lease `userns-<k>.lock` (`k < leases`) in `dir`, creating the dir and the
/// file as needed: an exclusive, non-blocking `flock` (`File::try_lock`) that the kernel drops
/// when the last descriptor of the file closes, so a killed worker's lease is free at once.
///
/// # Errors
/// A message naming the dir: it cannot be made or opened, or all `leases` are taken.
fn take_userns_lease(dir: &Path, leases: usize) -> Result<(usize, std::fs::File), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("worker.userns_lease_dir {}: {e}", dir.display()))?;
    for k in 0..leases {
        let path = dir.join(format!("userns-{k}.lock"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| format!("worker.userns_lease_dir: {}: {e}", path.display()))?;
        match file.try_lock() {
            Ok(()) => return Ok((k, file)),
            Err(std::fs::TryLockError::WouldBlock) => continue,
            Err(std::fs::TryLockError::Error(e)) => return Err(format!("worker.userns_lease_dir: lock {}: {e}", path.display())),
        }
    }
    Err(format!("worker.userns_lease_dir {}: all {leases} leases of user-namespace ids are held by other workers", dir.display()))
}

/// The first line of an `/etc/subuid` / `/etc/subgid` text (`name:first:count`) whose ids
/// overlap `range`; malformed lines are ignored (the file is the shadow tools' to check).
pub fn subordinate_overlap(text: &str, range: std::ops::Range<u64>) -> Option<String> {
    text.lines().find_map(|line| {
        let mut fields = line.trim().split(':');
        let (_, first, count) = (fields.next()?, fields.next()?.parse::<u64>().ok()?, fields.next()?.parse::<u64>().ok()?);
        (first < range.end && range.start < first + count).then(|| line.trim().to_owned())
    })
}

impl RawConfig {
    /// Checks and converts the raw config.
    ///
    /// # Errors
    /// [`SettingsError::Invalid`] naming the offending key; [`SettingsError::Packages`].
    pub fn validate(self) -> Result<Settings, SettingsError> {
        let bad = |m: String| Err(SettingsError::Invalid(m));
        if self.namespace.is_empty()
            || !self.namespace.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return bad(format!("namespace {:?}: use [A-Za-z0-9_-]", self.namespace));
        }
        let worker_id = match self.worker.id {
            Some(id) => id,
            None => std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_owned()).unwrap_or_else(|_| "worker".into()),
        };
        if worker_id.is_empty() || !worker_id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return bad(format!("worker.id {worker_id:?}: use [A-Za-z0-9_-]"));
        }
        let Some(rootfs) = self.worker.rootfs else {
            return bad("worker.rootfs is not set: run oci-bundles/build-rootfs.sh and put its output there".into());
        };
        if !rootfs.join("usr/bin/python3").exists() {
            return bad(format!("worker.rootfs {} holds no sandbox image (no usr/bin/python3)", rootfs.display()));
        }
        let packages = crate::packages::RawPackages {
            extra_ca_certs: self.worker.extra_ca_certs.as_deref(),
            pip_index_url: self.worker.pip_index_url.as_deref(),
            pip_extra_index_urls: self.worker.pip_extra_index_urls.as_deref(),
            pip_trusted_hosts: self.worker.pip_trusted_hosts.as_deref(),
            npm_registry: self.worker.npm_registry.as_deref(),
        }
        .validate(&rootfs)?;
        let container_helper = match self.worker.container_helper {
            Some(p) => p,
            None => std::env::current_exe()
                .map_err(|e| SettingsError::Invalid(format!("cannot find own binary: {e}")))?
                .with_file_name("sandq-container"),
        };
        if !container_helper.exists() {
            return bad(format!("worker.container_helper {} does not exist", container_helper.display()));
        }
        let capacity_cpus = self
            .worker
            .capacity_cpus
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64));
        let capacity_memory_bytes = self.worker.capacity_memory_bytes.unwrap_or_else(host_memory_bytes);
        let mut skus = BTreeMap::new();
        for key in self.skus.keys() {
            if key.parse::<Sku>().is_err() || key.to_ascii_lowercase() != *key {
                return bad(format!("skus.{key}: expected one of s, m, l, xl"));
            }
        }
        for sku in Sku::ALL {
            let raw = self.skus.get(&sku.as_str().to_ascii_lowercase()).cloned().unwrap_or_else(|| default_sku(sku));
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
        let mut limits = Limits::default();
        if let Some(t) = self.limits.default_timeout {
            limits.default_timeout = t;
        }
        if let Some(t) = self.limits.max_timeout {
            limits.max_timeout = t;
        }
        if let Some(t) = self.limits.max_result_ttl {
            limits.max_result_ttl = t;
        }
        if let Some(b) = self.limits.max_input_bytes {
            limits.max_input_bytes = b;
        }
        limits.outbound_network = self.worker.outbound_network.unwrap_or(true);
        if limits.default_timeout > limits.max_timeout {
            return bad("limits.default_timeout is above limits.max_timeout".into());
        }
        let max_attempts = self.worker.max_attempts.unwrap_or(3).max(1);
        if max_attempts >= self.amqp.delivery_limit {
            return bad(format!(
                "worker.max_attempts {max_attempts} must be below amqp.delivery_limit {}",
                self.amqp.delivery_limit
            ));
        }
        let mut blocked_ranges = Vec::new();
        for item in self.worker.blocked_ranges.as_deref().unwrap_or("").split(',').map(str::trim).filter(|i| !i.is_empty()) {
            match crate::sandbox::network::parse_range(item) {
                Ok(range) => blocked_ranges.push(range),
                Err(e) => return bad(format!("worker.blocked_ranges: {e}")),
            }
        }
        let nameservers = match &self.worker.nameservers {
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
        let mut warm_runtimes = Vec::new();
        for name in self.warm.runtimes.as_deref().unwrap_or("python,node").split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let runtime = match name {
                "python" => sandq_schemas::Runtime::Python,
                "node" => sandq_schemas::Runtime::Node,
                other => return bad(format!("warm.runtimes: unknown runtime {other:?} (python, node)")),
            };
            if !warm_runtimes.contains(&runtime) {
                warm_runtimes.push(runtime);
            }
        }
        // The warm pool's memory comes off the capacity jobs get.
        let warm_sandboxes = self.warm.per_sku.unwrap_or(1) * skus.len() * warm_runtimes.len();
        let warm_memory_bytes = self.warm.memory_bytes.unwrap_or(256 << 20);
        let warm_reserve = warm_sandboxes as u64 * warm_memory_bytes;
        let capacity_memory_bytes = match capacity_memory_bytes.checked_sub(warm_reserve) {
            Some(left) if skus.values().all(|s| s.limits.memory_bytes <= left) => left,
            _ => {
                return bad(format!(
                    "{warm_sandboxes} warm sandboxes take {warm_reserve} bytes of the {capacity_memory_bytes} bytes of \
                     worker.capacity_memory_bytes, leaving too little for the largest SKU served: lower warm.per_sku or warm.memory_bytes"
                ))
            }
        };
        let mut id_map = self.worker.user_namespace.unwrap_or(true).then(|| crate::sandbox::spec::IdMap {
            host_base: self.worker.userns_host_base.unwrap_or(DEFAULT_USERNS_HOST_BASE),
            size: 65_536,
        });
        let mut userns_lease = None;
        if let Some(map) = id_map.as_mut() {
            // Consumer slots, then the warm sandboxes' ranges (twice per SKU: a warm sandbox
            // keeps its range while its job runs, and one is made meanwhile).
            let slots: usize =
                skus.values().map(|s| s.slots).sum::<usize>() + 2 * self.warm.per_sku.unwrap_or(1) * skus.len() * warm_runtimes.len();
            let span = slots as u64 * u64::from(map.size);
            if let Some(dir) = &self.worker.userns_lease_dir {
                if slots as u64 > USERNS_LEASE_RANGES {
                    return bad(format!(
                        "worker.userns_lease_dir: this worker needs {slots} id ranges, a lease holds {USERNS_LEASE_RANGES}: lower the slots or warm sandboxes"
                    ));
                }
                let lease_span = USERNS_LEASE_RANGES * u64::from(map.size);
                let leases = (u64::from(u32::MAX) - u64::from(map.host_base)) / lease_span;
                let (k, file) = take_userns_lease(dir, leases as usize).map_err(SettingsError::Invalid)?;
                map.host_base = u32::try_from(u64::from(map.host_base) + k as u64 * lease_span)
                    .map_err(|_| SettingsError::Invalid(format!("worker.userns_lease_dir: lease {k} is past the id space")))?;
                userns_lease = Some((k, std::sync::Arc::new(file)));
            }
            let map = *map;
            let end = u64::from(map.host_base) + span;
            if end > u64::from(u32::MAX) {
                return bad(format!("worker.userns_host_base {} leaves no room for {slots} slots of 65536 ids", map.host_base));
            }
            for file in ["/etc/subuid", "/etc/subgid"] {
                let text = std::fs::read_to_string(file).unwrap_or_default();
                if let Some(entry) = subordinate_overlap(&text, u64::from(map.host_base)..end) {
                    return bad(format!(
                        "worker.userns_host_base {}: its ids {}..{end} overlap {file} entry {entry:?}; choose a range no host user is given",
                        map.host_base, map.host_base
                    ));
                }
            }
        }
        let sandbox_uid = self.worker.sandbox_uid.unwrap_or(1000);
        if sandbox_uid >= 65_536 {
            return bad(format!("worker.sandbox_uid {sandbox_uid} must be below 65536 (the mapped range)"));
        }
        let artifact_url_ttl = self.worker.artifact_url_ttl.unwrap_or(Duration::from_secs(24 * 3600));
        if artifact_url_ttl > Duration::from_secs(7 * 24 * 3600) {
            return bad("worker.artifact_url_ttl: at most 7days (the SigV4 presigning limit)".into());
        }
        let metrics_addr = self.worker.metrics_addr.as_deref().unwrap_or("127.0.0.1:9464");
        let Ok(metrics_addr) = metrics_addr.parse::<std::net::SocketAddr>() else {
            return bad(format!("worker.metrics_addr {metrics_addr:?}: expected an address and port (127.0.0.1:9464, 0.0.0.0:9464, [::]:9464)"));
        };
        let data_dir = self.worker.data_dir.unwrap_or_else(|| PathBuf::from("/var/lib/sandq"));
        let state_dir = self.worker.state_dir.unwrap_or_else(|| PathBuf::from("/run/sandq"));
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
            outbound_network: self.worker.outbound_network.unwrap_or(true),
            nameservers,
            blocked_ranges,
            packages,
            shutdown_grace: self.worker.shutdown_grace.unwrap_or(Duration::from_secs(30)),
            max_output_bytes: self.worker.max_output_bytes.unwrap_or(8 << 20),
            max_inline_output_bytes: self.worker.max_inline_output_bytes.unwrap_or(64 << 10),
            max_artifacts: self.worker.max_artifacts.unwrap_or(100),
            max_artifact_bytes: self.worker.max_artifact_bytes.unwrap_or(512 << 20),
            artifact_url_ttl,
            max_outputs: self.worker.max_outputs.unwrap_or(100),
            max_outputs_bytes: self.worker.max_outputs_bytes.unwrap_or(32 << 20).max(1 << 20),
            session_idle_timeout: self.sessions.idle_timeout.unwrap_or(Duration::from_secs(30 * 60)),
            session_lock_wait: self.sessions.lock_wait.unwrap_or(Duration::from_secs(10 * 60)),
            session_reap_interval: self.sessions.reap_interval.unwrap_or(Duration::from_secs(60)).max(Duration::from_millis(100)),
            session_rebuild_interval: self.sessions.rebuild_interval.unwrap_or(Duration::from_secs(3600)).max(Duration::from_secs(1)),
            max_state_bytes: self.sessions.max_state_bytes.unwrap_or(64 << 20),
            max_state_save: self.sessions.max_state_save.unwrap_or(Duration::from_secs(20)),
            warm_per_sku: self.warm.per_sku.unwrap_or(1),
            warm_memory_bytes,
            warm_preload: self.warm.preload.clone().unwrap_or_else(|| "numpy,pandas,matplotlib".to_owned()),
            warm_runtimes,
            max_attempts,
            limits,
            skus,
            capacity_cpus,
            capacity_memory_bytes,
            metrics_addr,
        })
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
    /// pending signals, message queues) is shared between concurrent sandboxes (security review
    /// F2). `None` without user namespaces.
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
        2 * self.warm_per_sku * self.skus.len() * self.warm_runtimes.len()
    }

    /// The host uid (and gid) that owns files the program in slot `slot` writes: the sandbox
    /// uid, shifted by the slot's user namespace mapping when there is one.
    pub fn host_sandbox_uid(&self, slot: usize) -> u32 {
        self.id_map_for(slot).map_or(self.sandbox_uid, |m| m.host_base + self.sandbox_uid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subordinate_ranges_that_touch_the_sandbox_ids_are_found() {
        // Debian's first `useradd` entry: ids 100000..165536.
        let text = "# comment\nalice:100000:65536\nbroken line\nbob:165536:65536\n";
        assert_eq!(subordinate_overlap(text, 165_535..165_536).as_deref(), Some("alice:100000:65536"));
        assert_eq!(subordinate_overlap(text, 165_536..165_537).as_deref(), Some("bob:165536:65536"));
        assert_eq!(subordinate_overlap(text, 50_000..100_000), None, "ends right before alice's first id");
        assert_eq!(subordinate_overlap(text, 231_072..300_000), None, "starts right after bob's last id");
        let base = u64::from(DEFAULT_USERNS_HOST_BASE);
        assert_eq!(subordinate_overlap(text, base..base + 40 * 65_536), None);
        // The default sits above login.defs' SUB_UID_MAX (600,100,000) and systemd's container
        // ranges (up to 1,879,048,191), below its foreign range (2,147,352,576).
        assert!(base > 1_879_048_191 && base + 4094 * 65_536 <= 2_147_352_576);
    }

    #[test]
    fn workers_sharing_a_lease_dir_take_distinct_leases_and_a_closed_one_is_free_again() {
        let dir = std::env::temp_dir().join(format!("sandq-lease-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (a, file_a) = take_userns_lease(&dir, 3).expect("a free lease");
        let (b, _file_b) = take_userns_lease(&dir, 3).expect("a free lease");
        let (c, _file_c) = take_userns_lease(&dir, 3).expect("a free lease");
        assert_eq!((a, b, c), (0, 1, 2), "each lock is its own open file description, so each taker waits its turn");
        let full = take_userns_lease(&dir, 3).expect_err("all taken");
        assert!(full.contains("all 3 leases"), "{full}");
        drop(file_a); // the kernel drops the flock with the last descriptor, as at a worker's exit
        assert_eq!(take_userns_lease(&dir, 3).expect("lease 0 again").0, 0);
        // A planted symlink is not followed (O_NOFOLLOW): the lease is refused, not taken.
        let dir2 = dir.join("planted");
        std::fs::create_dir_all(&dir2).expect("dir");
        std::os::unix::fs::symlink("/etc/hostname", dir2.join("userns-0.lock")).expect("symlink");
        assert!(take_userns_lease(&dir2, 1).is_err());
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
