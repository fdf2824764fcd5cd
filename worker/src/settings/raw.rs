//! The worker's configuration as written: TOML file + `SANDQ__*` environment, read with
//! `sandq_core::config`, each section a `Raw*` struct with its defaults. Checked and converted
//! by [`RawConfig::validate`](super::RawConfig::validate).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use sandq_core::config::{AmqpConfig, QueuesConfig, RedisConfig, S3Config};
use sandq_schemas::Sku;
use serde::Deserialize;

/// The config file as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Prefix of queues, exchanges and Redis keys; default `sandq`.
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// The broker connection and delivery limit (`[amqp]`).
    #[serde(default)]
    pub amqp: AmqpConfig,
    /// Where results and session hints are stored (`[redis]`).
    #[serde(default)]
    pub redis: RedisConfig,
    /// Where inputs, artifacts and session files are stored (`[s3]`).
    #[serde(default)]
    pub s3: S3Config,
    /// The job queues' arguments (`unserved_ttl`).
    #[serde(default)]
    pub queues: QueuesConfig,
    /// This worker's own keys: its id, image, capacity, sandbox and output bounds (`[worker]`).
    #[serde(default)]
    pub worker: RawWorker,
    /// Limits every job must fit.
    #[serde(default)]
    pub limits: RawLimits,
    /// SKU table, keyed `s`, `m`, `l`, `xl`; missing entries take the defaults of
    /// [`default_sku`].
    #[serde(default)]
    pub skus: BTreeMap<String, RawSku>,
    /// Session lifetime, locks, the reaper and notebook state (`[sessions]`).
    #[serde(default)]
    pub sessions: RawSessions,
    /// Sandboxes started ahead of jobs (`[warm]`).
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
    /// Python warm sandboxes are forked from a pre-imported template (`true`, the default:
    /// a warm sandbox is then only a prepared container, cheap to refill, and the job's process
    /// is forked into it; docs/threat-model.md "Forked sandboxes"), or each runs a runner of
    /// its own that preloads (`false`). Without a ready template a warm sandbox is made the
    /// second way.
    pub forked: Option<bool>,
    /// Light warm sandboxes kept per SKU: forked Python notebook ones (while its template is
    /// ready: a prepared container and a forked process waiting, ~7 MiB each) and script ones
    /// of each runtime (a waiter, ~6 MiB), all refilled even while jobs run; 32 MiB each set
    /// aside. Default 2, at least `per_sku` (none when `per_sku` is 0). Under sustained load a
    /// job takes one while the next is made: with one a SKU, jobs waited for it (script
    /// `pass`: 17.1 jobs/s with one, 25.4 with two; docs/benchmarks.md "Forked sandboxes").
    pub light_per_sku: Option<usize>,
    /// How long a template serves forks before a new one replaces it (humantime); default
    /// `1h`. Every job forked from one template shares its address-space layout and its `str`
    /// hash secret (docs/threat-model.md, "Forked sandboxes"): a new template draws new ones.
    #[serde(default, with = "humantime_serde")]
    pub template_lifetime: Option<Duration>,
    /// Script jobs get warm sandboxes too (`per_sku` per SKU and runtime): a started container
    /// whose init waits for its job and then `exec`s the job's program, which is then what a
    /// cold start's is (the sandbox's init, with its argv and environment); default `true`.
    pub script: Option<bool>,
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
    /// Bytes of saved notebook states the worker keeps a copy of on its disk, so that the next
    /// cell of a session on this worker restores without S3; default 4 x `max_state_bytes`;
    /// `0` keeps none.
    pub state_cache_bytes: Option<u64>,
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
    /// `1h`, at most `7days` (the SigV4 limit); `0s` presigns nothing. A job's URLs are never
    /// valid longer than its `result_ttl` (`publish::url_ttl`).
    #[serde(default, with = "humantime_serde")]
    pub artifact_url_ttl: Option<Duration>,
    /// Most rich outputs (MIME bundles) per notebook-mode job; default 100.
    pub max_outputs: Option<usize>,
    /// Bytes the notebook runner may write in all (its outputs file lives on a tmpfs of this
    /// size, charged to the job's memory); default 32 MiB.
    pub max_outputs_bytes: Option<u64>,
    /// Bytes of stdout and stderr text together a job's live event stream carries per attempt
    /// (docs/protocol.md "Live events"); default 1 MiB; `0` turns live events off.
    pub stream_max_bytes: Option<u64>,
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
