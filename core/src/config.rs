//! Where the services are: the `[amqp]`, `[redis]` and `[s3]` sections shared by the worker and
//! every client, read with the `config` crate from a TOML file and `SANDQ__*` environment
//! variables (`SANDQ__S3__ENDPOINT=http://127.0.0.1:3900`; `__` separates levels).

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Config file used when neither `--config` nor `SANDQ_CONFIG` names one; written by
/// `scripts/services.sh`.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/sandq/sandq.toml";

/// The connection sections of the config file. Other top-level sections (the worker's) are
/// ignored here.
#[derive(Debug, Clone, Deserialize)]
pub struct ServiceConfig {
    /// Prefix of every queue, exchange and Redis key ([`sandq_schemas::names::Names`]).
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// The broker (`[amqp]`).
    #[serde(default)]
    pub amqp: AmqpConfig,
    /// Where results and job records are kept (`[redis]`).
    #[serde(default)]
    pub redis: RedisConfig,
    /// S3 (Garage locally).
    #[serde(default)]
    pub s3: S3Config,
    /// The job queues' arguments beyond `[amqp]`'s.
    #[serde(default)]
    pub queues: QueuesConfig,
}

/// `[queues]`: how long a job may wait for a worker.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueuesConfig {
    /// A job that no worker takes within this time (humantime; no worker serves its SKU, or
    /// every one is busy that long) is dead-lettered by the broker (the SKU queues'
    /// `x-message-ttl`) and gets an `expired` result from a worker's dead-letter consumer.
    /// Default `1h`; `0s`: no limit. Like `amqp.delivery_limit`, it is an argument of the
    /// queues: queues declared with another value keep theirs (see docs/operations.md).
    #[serde(default = "default_unserved_ttl", with = "humantime_serde")]
    pub unserved_ttl: std::time::Duration,
}

fn default_unserved_ttl() -> std::time::Duration {
    std::time::Duration::from_secs(3600)
}

impl Default for QueuesConfig {
    fn default() -> Self {
        QueuesConfig { unserved_ttl: default_unserved_ttl() }
    }
}

fn default_namespace() -> String {
    sandq_schemas::names::DEFAULT_NAMESPACE.to_owned()
}

/// RabbitMQ connection: one node (`url`) or several nodes of a cluster (`urls`), which the
/// worker and the clients fail over between (docs/protocol.md, "Several broker addresses").
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AmqpConfig {
    /// AMQP URI of a single node; default `amqp://guest:guest@127.0.0.1:5672/%2f`. Ignored when
    /// `urls` names any address.
    #[serde(default = "default_amqp_url")]
    pub url: String,
    /// AMQP URIs of the nodes of a cluster, tried in order and round-robin after a failure: a
    /// TOML list, or one string of comma-separated URIs (as `SANDQ__AMQP__URLS` gives it).
    /// Default empty: `url` alone.
    #[serde(default, deserialize_with = "one_or_many")]
    pub urls: Vec<String>,
    /// How long a client waits for the broker's publisher confirm of a job before it publishes
    /// the job again on the next address (humantime); default `30s`. The job id makes the
    /// possible duplicate harmless (docs/protocol.md).
    #[serde(default = "default_confirm_timeout", with = "humantime_serde")]
    pub confirm_timeout: std::time::Duration,
    /// Most times a job is delivered before it is dead-lettered (the quorum queues'
    /// `x-delivery-limit`); default 5. Changing it needs new queues (RabbitMQ refuses to
    /// redeclare a queue with other arguments).
    #[serde(default = "default_delivery_limit")]
    pub delivery_limit: u32,
}

impl AmqpConfig {
    /// The addresses to connect to, in order: `urls` when it names any, else `url` alone.
    /// Never empty.
    pub fn addresses(&self) -> Vec<String> {
        if self.urls.is_empty() {
            vec![self.url.clone()]
        } else {
            self.urls.clone()
        }
    }
}

/// `urls` as a TOML list of strings or one string of comma-separated addresses (blank items
/// dropped).
fn one_or_many<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        Many(Vec<String>),
        One(String),
    }
    let items = match OneOrMany::deserialize(deserializer)? {
        OneOrMany::Many(list) => list,
        OneOrMany::One(text) => text.split(',').map(str::to_owned).collect(),
    };
    Ok(items.into_iter().map(|i| i.trim().to_owned()).filter(|i| !i.is_empty()).collect())
}

fn default_amqp_url() -> String {
    "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned()
}

fn default_confirm_timeout() -> std::time::Duration {
    std::time::Duration::from_secs(30)
}

fn default_delivery_limit() -> u32 {
    5
}

impl Default for AmqpConfig {
    fn default() -> Self {
        AmqpConfig {
            url: default_amqp_url(),
            urls: Vec::new(),
            confirm_timeout: default_confirm_timeout(),
            delivery_limit: default_delivery_limit(),
        }
    }
}

/// Redis connection: a single server (the default), a Redis Cluster or a Sentinel-managed
/// primary (docs/protocol.md "Redis deployments"; `crate::redis_conn`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// `single`, `cluster` or `sentinel`; default `single`.
    #[serde(default)]
    pub mode: RedisMode,
    /// Redis URL of the single server; default `redis://127.0.0.1:6379/`. Unused by the other
    /// modes.
    #[serde(default = "default_redis_url")]
    pub url: String,
    /// `cluster`: URLs of some of the cluster's nodes (`redis://127.0.0.1:7000/`), from which
    /// the rest is learnt; `sentinel`: URLs of the sentinels. A TOML array, or one string of
    /// comma-separated URLs (`SANDQ__REDIS__NODES=redis://a:7000/,redis://b:7000/`).
    #[serde(default, deserialize_with = "string_or_list")]
    pub nodes: Vec<String>,
    /// `sentinel`: the primary's name in the sentinels' configuration; default `mymaster`.
    #[serde(default = "default_sentinel_service")]
    pub service: String,
    /// Replicas that must have a job's terminal result before the worker acknowledges the job's
    /// delivery (`WAIT`); default 0: not waited for. With 1 on a cluster or Sentinel setup, a
    /// primary's death cannot lose a result whose job was acknowledged: a write too few
    /// replicas took in time leaves the delivery to be redelivered (docs/protocol.md "Redis
    /// deployments").
    #[serde(default)]
    pub wait_replicas: u32,
    /// Longest `WAIT` for them (humantime); default `1s`.
    #[serde(default = "default_wait_timeout", with = "humantime_serde")]
    pub wait_timeout: std::time::Duration,
}

fn default_wait_timeout() -> std::time::Duration {
    std::time::Duration::from_secs(1)
}

/// How Redis is deployed ([`RedisConfig::mode`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RedisMode {
    /// One server at [`RedisConfig::url`].
    #[default]
    Single,
    /// A Redis Cluster reached through [`RedisConfig::nodes`].
    Cluster,
    /// The primary the sentinels at [`RedisConfig::nodes`] name [`RedisConfig::service`].
    Sentinel,
}

fn default_redis_url() -> String {
    "redis://127.0.0.1:6379/".to_owned()
}

fn default_sentinel_service() -> String {
    "mymaster".to_owned()
}

/// A list of strings from a sequence, or from one string split at commas (how an environment
/// variable gives a list), blanks dropped.
fn string_or_list<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        One(String),
        Many(Vec<String>),
    }
    let items = match Either::deserialize(d)? {
        Either::One(s) => s.split(',').map(str::to_owned).collect(),
        Either::Many(v) => v,
    };
    Ok(items.into_iter().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect())
}

impl RedisConfig {
    /// Where Redis is, for messages: `redis://127.0.0.1:6379/`, `cluster [redis://a:7000/, ...]`
    /// or `sentinel service mymaster via [redis://a:26379/, ...]`.
    pub fn describe(&self) -> String {
        match self.mode {
            RedisMode::Single => self.url.clone(),
            RedisMode::Cluster => format!("cluster {:?}", self.nodes),
            RedisMode::Sentinel => format!("sentinel service {} via {:?}", self.service, self.nodes),
        }
    }
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            mode: RedisMode::Single,
            url: default_redis_url(),
            nodes: Vec::new(),
            service: default_sentinel_service(),
            wait_replicas: 0,
            wait_timeout: default_wait_timeout(),
        }
    }
}

/// S3 endpoint, bucket and credentials.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Config {
    /// Endpoint URL; default `http://127.0.0.1:3900` (Garage's S3 API).
    #[serde(default = "default_s3_endpoint")]
    pub endpoint: String,
    /// Region name the server expects; default `garage`.
    #[serde(default = "default_s3_region")]
    pub region: String,
    /// Bucket of inputs and artifacts; default `sandq`.
    #[serde(default = "default_s3_bucket")]
    pub bucket: String,
    /// The id of the access key every S3 request is signed with.
    #[serde(default)]
    pub access_key_id: String,
    /// That access key's secret.
    #[serde(default)]
    pub secret_access_key: String,
}

fn default_s3_endpoint() -> String {
    "http://127.0.0.1:3900".to_owned()
}
fn default_s3_region() -> String {
    "garage".to_owned()
}
fn default_s3_bucket() -> String {
    "sandq".to_owned()
}

impl Default for S3Config {
    fn default() -> Self {
        S3Config {
            endpoint: default_s3_endpoint(),
            region: default_s3_region(),
            bucket: default_s3_bucket(),
            access_key_id: String::new(),
            secret_access_key: String::new(),
        }
    }
}

/// Failure to read the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file does not exist.
    #[error("config file {path} does not exist (scripts/services.sh writes one; or pass --config / SANDQ_CONFIG)")]
    Missing {
        /// The path tried.
        path: PathBuf,
    },
    /// The file or an environment variable could not be read or has a wrong value.
    #[error("cannot load configuration from {path}: {source}")]
    Load {
        /// The config file tried.
        path: PathBuf,
        /// The config crate's error (names the key).
        source: config::ConfigError,
    },
}

/// The config file to read: `explicit` if given, else `$SANDQ_CONFIG`, else
/// [`DEFAULT_CONFIG_PATH`].
pub fn config_path(explicit: Option<&Path>) -> PathBuf {
    explicit
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os("SANDQ_CONFIG").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG_PATH))
}

/// Reads `T` from the TOML file at `path` overlaid with `SANDQ__*` environment variables.
///
/// # Errors
/// [`ConfigError::Missing`] when the file does not exist; [`ConfigError::Load`] when it is
/// unreadable or a value has the wrong type.
pub fn load<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    if !path.exists() {
        return Err(ConfigError::Missing { path: path.to_path_buf() });
    }
    let err = |source| ConfigError::Load { path: path.to_path_buf(), source };
    config::Config::builder()
        .add_source(config::File::from(path).format(config::FileFormat::Toml).required(true))
        .add_source(config::Environment::with_prefix("SANDQ").prefix_separator("__").separator("__"))
        .build()
        .map_err(err)?
        .try_deserialize()
        .map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redis_section(toml: &str) -> RedisConfig {
        #[derive(Deserialize)]
        struct File {
            redis: RedisConfig,
        }
        let file: File = config::Config::builder()
            .add_source(config::File::from_str(toml, config::FileFormat::Toml))
            .build()
            .and_then(config::Config::try_deserialize)
            .expect("parse");
        file.redis
    }

    #[test]
    fn redis_modes_and_nodes_as_a_list_or_a_string() {
        let single = redis_section("[redis]\nurl = \"redis://10.0.0.1:6379/\"\n");
        assert_eq!((single.mode, single.nodes.len(), single.wait_replicas), (RedisMode::Single, 0, 0));
        let cluster = redis_section("[redis]\nmode = \"cluster\"\nnodes = [\"redis://a:1/\", \"redis://b:2/\"]\n");
        assert_eq!((cluster.mode, cluster.nodes), (RedisMode::Cluster, vec!["redis://a:1/".to_owned(), "redis://b:2/".to_owned()]));
        let sentinel = redis_section(
            "[redis]\nmode = \"sentinel\"\nnodes = \" redis://a:26379/, ,redis://b:26379/\"\nservice = \"p1\"\nwait_replicas = 1\nwait_timeout = \"250ms\"\n",
        );
        assert_eq!(sentinel.nodes, vec!["redis://a:26379/".to_owned(), "redis://b:26379/".to_owned()]);
        assert_eq!((sentinel.service.as_str(), sentinel.wait_replicas), ("p1", 1));
        assert_eq!(sentinel.wait_timeout, std::time::Duration::from_millis(250));
    }

    /// Loads a config file holding `toml` (written to a fresh temp file).
    fn load_text(toml: &str) -> ServiceConfig {
        let path = std::env::temp_dir().join(format!("sandq-config-test-{}.toml", uuid::Uuid::new_v4()));
        std::fs::write(&path, toml).expect("write config");
        let loaded = load(&path);
        let _ = std::fs::remove_file(&path);
        loaded.expect("config loads")
    }

    #[test]
    fn one_url_is_the_only_address() {
        let config = load_text("[amqp]\nurl = \"amqp://a:1/%2f\"\n");
        assert_eq!(config.amqp.addresses(), vec!["amqp://a:1/%2f".to_owned()]);
        assert_eq!(config.amqp.confirm_timeout, std::time::Duration::from_secs(30));
    }

    #[test]
    fn urls_as_a_list_replace_url() {
        let config =
            load_text("[amqp]\nurl = \"amqp://x:9/%2f\"\nurls = [\"amqp://a:1/%2f\", \"amqp://b:2/%2f\"]\nconfirm_timeout = \"5s\"\n");
        assert_eq!(config.amqp.addresses(), vec!["amqp://a:1/%2f".to_owned(), "amqp://b:2/%2f".to_owned()]);
        assert_eq!(config.amqp.confirm_timeout, std::time::Duration::from_secs(5));
    }

    /// The form `SANDQ__AMQP__URLS` gives: one string, comma-separated, blanks dropped.
    #[test]
    fn urls_as_one_comma_separated_string() {
        let config = load_text("[amqp]\nurls = \" amqp://a:1/%2f, amqp://b:2/%2f,,amqp://c:3/%2f \"\n");
        assert_eq!(config.amqp.addresses(), ["amqp://a:1/%2f", "amqp://b:2/%2f", "amqp://c:3/%2f"].map(str::to_owned).to_vec());
    }

    #[test]
    fn empty_urls_fall_back_to_url() {
        let config = load_text("[amqp]\nurl = \"amqp://x:9/%2f\"\nurls = \"\"\n");
        assert_eq!(config.amqp.addresses(), vec!["amqp://x:9/%2f".to_owned()]);
    }
}
