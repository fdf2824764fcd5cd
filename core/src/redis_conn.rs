//! One Redis connection type for a single server, a Redis Cluster or a Sentinel-managed primary,
//! chosen by configuration (`[redis] mode`, see [`crate::config::RedisConfig`]).
//!
//! - `single` (the default): the `redis` crate's `ConnectionManager`, as before: one multiplexed
//!   connection that reconnects by itself; a command that fails while Redis is down is not
//!   retried (callers retry).
//! - `cluster`: the crate's `cluster_async::ClusterConnection`: it learns the slot map from the
//!   seed nodes, routes every command by its key's slot, follows `MOVED`/`ASK`, refreshes the
//!   map and retries (the crate's default 16 times with exponential waits of at least 1.28 s,
//!   `ClusterClientBuilder::retries`) when a node is down or a replica was promoted.
//! - `sentinel`: the primary the sentinels name for `[redis] service`; on a connection error or
//!   a `READONLY` reply (the old primary came back as a replica) the connection is dropped, the
//!   sentinels are asked again and the command retried, for up to [`SENTINEL_RETRY_FOR`].
//!
//! Commands and scripts must name keys of one hash slot (`sandq_schemas::names` tags them), and a
//! pipeline must stay in one slot: the cluster refuses others (`CROSSSLOT`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{AsyncConnectionConfig, Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};

use crate::config::{RedisConfig, RedisMode};

/// How long a command is retried on a Sentinel-managed primary while it fails over: longer than
/// a failover takes with the sentinels' default `down-after-milliseconds` (30 s, the Redis
/// Sentinel docs) plus the election and promotion (seconds), and short enough that a caller
/// sees a real outage. Every failed try waits [`SENTINEL_RETRY_WAIT`].
pub const SENTINEL_RETRY_FOR: Duration = Duration::from_secs(60);

/// Wait between tries on a Sentinel-managed primary.
pub const SENTINEL_RETRY_WAIT: Duration = Duration::from_millis(250);

/// Response time-out of a command on a cluster node (one try; the crate retries on another
/// connection after it). `BLPOP` uses a connection of its own without one.
pub const CLUSTER_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Where Redis is, from the configuration; opens connections ([`Self::connect`] for commands,
/// [`Self::connect_blocking`] for `BLPOP`).
#[derive(Clone)]
pub struct RedisTarget {
    kind: TargetKind,
    /// `[redis] wait_replicas`, given to the command connections.
    wait: Option<WaitReplicas>,
}

#[derive(Clone)]
enum TargetKind {
    /// One server (`redis://host:port/db`).
    Single(redis::Client),
    /// A Redis Cluster, from its seed nodes.
    Cluster {
        /// For command connections (a response time-out per try).
        commands: Box<ClusterClient>,
        /// For blocking commands (no response time-out).
        blocking: Box<ClusterClient>,
    },
    /// The primary named `service` by the sentinels.
    Sentinel {
        /// Sentinel addresses (`redis://host:port/`).
        sentinels: Vec<String>,
        /// The primary's name in the sentinels' configuration.
        service: String,
    },
}

impl std::fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            TargetKind::Single(_) => f.write_str("RedisTarget::Single"),
            TargetKind::Cluster { .. } => f.write_str("RedisTarget::Cluster"),
            TargetKind::Sentinel { sentinels, service } => write!(f, "RedisTarget::Sentinel({service} via {sentinels:?})"),
        }
    }
}

/// The `redis` crate's default response time-out of a single connection (its
/// `DEFAULT_RESPONSE_TIMEOUT`, not exported), kept for the single and Sentinel paths unless a
/// `WAIT` needs longer.
const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_millis(500);

impl RedisTarget {
    /// The target `config` describes.
    ///
    /// # Errors
    /// A [`RedisError`] when a URL is invalid, or `cluster`/`sentinel` has no `nodes`.
    pub fn from_config(config: &RedisConfig) -> RedisResult<Self> {
        let no_nodes =
            || RedisError::from((redis::ErrorKind::InvalidClientConfig, "redis.nodes is empty: cluster and sentinel modes need it"));
        let wait = (config.wait_replicas > 0).then_some(WaitReplicas { replicas: config.wait_replicas, timeout: config.wait_timeout });
        // A `WAIT` blocks its connection for up to `wait_timeout`: answers may take that long.
        let slack = |floor: Duration| wait.map_or(floor, |w| floor.max(w.timeout + Duration::from_secs(1)));
        let kind = match config.mode {
            RedisMode::Single => TargetKind::Single(redis::Client::open(config.url.as_str())?),
            RedisMode::Cluster => {
                if config.nodes.is_empty() {
                    return Err(no_nodes());
                }
                let builder = || ClusterClient::builder(config.nodes.iter().map(String::as_str).collect::<Vec<_>>());
                TargetKind::Cluster {
                    commands: Box::new(builder().response_timeout(slack(CLUSTER_RESPONSE_TIMEOUT)).overall_response_timeout(None).build()?),
                    blocking: Box::new(builder().build()?),
                }
            }
            RedisMode::Sentinel => {
                if config.nodes.is_empty() {
                    return Err(no_nodes());
                }
                // Checks the URLs now rather than on first use.
                SentinelClient::build(config.nodes.clone(), config.service.clone(), None, SentinelServerType::Master)?;
                TargetKind::Sentinel { sentinels: config.nodes.clone(), service: config.service.clone() }
            }
        };
        Ok(RedisTarget { kind, wait })
    }

    /// Response time-out of the single and Sentinel command connections: the crate's default,
    /// or longer than a `WAIT`.
    fn response_timeout(&self) -> Duration {
        self.wait.map_or(DEFAULT_RESPONSE_TIMEOUT, |w| DEFAULT_RESPONSE_TIMEOUT.max(w.timeout + Duration::from_secs(1)))
    }

    /// A connection for commands; reconnects (and on a cluster or Sentinel, retries) as the
    /// module doc says.
    ///
    /// # Errors
    /// A [`RedisError`] when no server can be reached.
    pub async fn connect(&self) -> RedisResult<RedisConn> {
        let link = match &self.kind {
            TargetKind::Single(client) if self.wait.is_none() => Link::Single(ConnectionManager::new(client.clone()).await?),
            TargetKind::Single(client) => {
                let config = redis::aio::ConnectionManagerConfig::new().set_response_timeout(Some(self.response_timeout()));
                Link::Single(ConnectionManager::new_with_config(client.clone(), config).await?)
            }
            TargetKind::Cluster { commands, .. } => Link::Cluster(commands.get_async_connection().await?),
            TargetKind::Sentinel { sentinels, service } => {
                let config = AsyncConnectionConfig::new().set_response_timeout(Some(self.response_timeout()));
                let conn = SentinelConn::new(sentinels, service, config)?;
                conn.current().await?;
                Link::Sentinel(conn)
            }
        };
        Ok(RedisConn { link, wait: self.wait })
    }

    /// A connection of its own for a blocking command (`BLPOP`), without a response time-out
    /// (it would cut the block short), so that the block does not stall other commands.
    ///
    /// # Errors
    /// A [`RedisError`] when no server can be reached.
    pub async fn connect_blocking(&self) -> RedisResult<RedisConn> {
        let no_timeout = AsyncConnectionConfig::new().set_response_timeout(None);
        let link = match &self.kind {
            TargetKind::Single(client) => Link::Blocking(client.get_multiplexed_async_connection_with_config(&no_timeout).await?),
            TargetKind::Cluster { blocking, .. } => Link::Cluster(blocking.get_async_connection().await?),
            TargetKind::Sentinel { sentinels, service } => {
                let conn = SentinelConn::new(sentinels, service, no_timeout)?;
                conn.current().await?;
                Link::Sentinel(conn)
            }
        };
        Ok(RedisConn { link, wait: None })
    }
}

/// Connects to the Redis `config` describes (see [`RedisTarget::connect`]).
///
/// # Errors
/// A [`RedisError`] when the configuration is invalid or no server can be reached.
pub async fn connect(config: &RedisConfig) -> RedisResult<RedisConn> {
    RedisTarget::from_config(config)?.connect().await
}

/// `[redis] wait_replicas` and `wait_timeout`: after a job's terminal result is written, `WAIT`
/// until that many replicas have it (see [`RedisConn::wait_replicated`]).
#[derive(Debug, Clone, Copy)]
pub struct WaitReplicas {
    /// Replicas that must acknowledge.
    pub replicas: u32,
    /// Longest wait.
    pub timeout: Duration,
}

/// A terminal result that fewer replicas than `[redis] wait_replicas` acknowledged in time.
#[derive(Debug, thiserror::Error)]
#[error("{acked} of {wanted} redis replicas acknowledged the write within {timeout:?}")]
pub struct NotReplicated {
    /// Replicas that did.
    pub acked: u32,
    /// `wait_replicas`.
    pub wanted: u32,
    /// `wait_timeout`.
    pub timeout: Duration,
}

/// A connection to a single Redis, a Redis Cluster or a Sentinel-managed primary: use it like
/// any `redis::aio::ConnectionLike` (`query_async`, `Script::invoke_async`). Clones share the
/// underlying connections.
#[derive(Clone)]
pub struct RedisConn {
    link: Link,
    /// `[redis] wait_replicas`, for [`RedisConn::wait_replicated`].
    wait: Option<WaitReplicas>,
}

#[derive(Clone)]
enum Link {
    /// A single server, reconnecting by itself.
    Single(ConnectionManager),
    /// A single server's connection for blocking commands (no response time-out; dropped by
    /// its owner on error).
    Blocking(MultiplexedConnection),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
    /// A Sentinel-managed primary.
    Sentinel(SentinelConn),
}

impl RedisConn {
    /// When `[redis] wait_replicas` is set: `WAIT <wait_replicas> <wait_timeout ms>` on the
    /// connection to the primary of `key`'s slot, after a write to `key` on this connection, so
    /// that the write survives the primary's death (replication is asynchronous: the Redis
    /// Cluster specification, "Write safety"). Nothing when it is not set.
    ///
    /// # Errors
    /// [`WaitError::NotReplicated`] when fewer replicas acknowledged in time;
    /// [`WaitError::Redis`].
    pub async fn wait_replicated(&mut self, key: &str) -> Result<(), WaitError> {
        let Some(wait) = self.wait else { return Ok(()) };
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(wait.replicas).arg(wait.timeout.as_millis() as u64);
        let acked: i64 = match &mut self.link {
            Link::Cluster(c) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::with_key(key, SlotAddr::Master)));
                redis::from_redis_value(c.route_command(cmd, route).await?).map_err(RedisError::from)?
            }
            // Not retried on another connection: `WAIT` counts this connection's writes.
            Link::Sentinel(c) => cmd.query_async(&mut c.current().await?).await?,
            _ => cmd.query_async(self).await?,
        };
        let acked = u32::try_from(acked).unwrap_or(0);
        if acked < wait.replicas {
            return Err(WaitError::NotReplicated(NotReplicated { acked, wanted: wait.replicas, timeout: wait.timeout }));
        }
        Ok(())
    }
}

/// Failure of [`RedisConn::wait_replicated`].
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    /// Redis failed.
    #[error("redis: {0}")]
    Redis(#[from] RedisError),
    /// Too few replicas acknowledged.
    #[error(transparent)]
    NotReplicated(#[from] NotReplicated),
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match &mut self.link {
            Link::Single(c) => c.req_packed_command(cmd),
            Link::Blocking(c) => c.req_packed_command(cmd),
            Link::Cluster(c) => c.req_packed_command(cmd),
            Link::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(&'a mut self, cmd: &'a Pipeline, offset: usize, count: usize) -> RedisFuture<'a, Vec<Value>> {
        match &mut self.link {
            Link::Single(c) => c.req_packed_commands(cmd, offset, count),
            Link::Blocking(c) => c.req_packed_commands(cmd, offset, count),
            Link::Cluster(c) => c.req_packed_commands(cmd, offset, count),
            Link::Sentinel(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match &self.link {
            Link::Single(c) => c.get_db(),
            Link::Blocking(c) => c.get_db(),
            Link::Cluster(c) => c.get_db(),
            Link::Sentinel(_) => 0,
        }
    }
}

/// A connection to the primary the sentinels name, re-resolved after a failover (module doc).
#[derive(Clone)]
pub struct SentinelConn {
    client: Arc<tokio::sync::Mutex<SentinelClient>>,
    current: Arc<Mutex<Option<MultiplexedConnection>>>,
    config: AsyncConnectionConfig,
}

impl SentinelConn {
    fn new(sentinels: &[String], service: &str, config: AsyncConnectionConfig) -> RedisResult<Self> {
        let client = SentinelClient::build(sentinels.to_vec(), service.to_owned(), None, SentinelServerType::Master)?;
        Ok(SentinelConn { client: Arc::new(tokio::sync::Mutex::new(client)), current: Arc::new(Mutex::new(None)), config })
    }

    fn cached(&self) -> Option<MultiplexedConnection> {
        self.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn forget(&self) {
        *self.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }

    /// The connection to the current primary, asking the sentinels when there is none.
    async fn current(&self) -> RedisResult<MultiplexedConnection> {
        if let Some(conn) = self.cached() {
            return Ok(conn);
        }
        let mut client = self.client.lock().await;
        if let Some(conn) = self.cached() {
            return Ok(conn);
        }
        let conn = client.get_async_connection_with_config(&self.config).await?;
        *self.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(conn.clone());
        Ok(conn)
    }

    /// Runs `op` on the current primary, re-resolving and retrying on a failover error.
    async fn retrying<T, F, Fut>(&self, mut op: F) -> RedisResult<T>
    where
        F: FnMut(MultiplexedConnection) -> Fut,
        Fut: std::future::Future<Output = RedisResult<T>>,
    {
        let started = tokio::time::Instant::now();
        loop {
            let result = match self.current().await {
                Ok(conn) => op(conn).await,
                Err(e) => Err(e),
            };
            match result {
                Err(e) if failover_error(&e) && started.elapsed() < SENTINEL_RETRY_FOR => {
                    tracing::warn!(error = %e, "redis primary unavailable; asking the sentinels again");
                    self.forget();
                    tokio::time::sleep(SENTINEL_RETRY_WAIT).await;
                }
                other => return other,
            }
        }
    }

    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.retrying(move |mut c| async move { c.req_packed_command(cmd).await }))
    }

    fn req_packed_commands<'a>(&'a mut self, pipeline: &'a Pipeline, offset: usize, count: usize) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(self.retrying(move |mut c| async move { c.req_packed_commands(pipeline, offset, count).await }))
    }
}

/// True for an error a Sentinel failover causes: the primary unreachable or gone, or a server
/// that is no longer the primary (`READONLY`), or one still loading or without a primary.
fn failover_error(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.is_unrecoverable_error()
        || matches!(e.code(), Some("READONLY" | "LOADING" | "MASTERDOWN" | "TRYAGAIN"))
        || matches!(e.kind(), redis::ErrorKind::MasterNameNotFoundBySentinel | redis::ErrorKind::InvalidClientConfig)
}

/// A Lua script run with `EVAL`, its source sent every time: the shape of `redis::Script`
/// (`Script::new(src).key(k).arg(a).invoke_async(con)`), without the server's script cache.
/// `redis::Script` sends `EVALSHA`, and on `NOSCRIPT` loads the script and tries once more, so
/// a client that may run `SCRIPT FLUSH` (any Redis user with `@scripting`) could fail every
/// compare-and-set of the workers by flushing in a loop: jobs would run twice and be lost. No
/// call here depends on the server's script cache (test:
/// jobs_complete_once_while_a_client_flushes_the_script_cache). Redis still compiles a script
/// once and keeps it by its SHA; the source costs a few hundred bytes per call.
#[derive(Debug, Clone, Copy)]
pub struct Script(&'static str);

impl Script {
    /// The script `source`.
    pub const fn new(source: &'static str) -> Self {
        Script(source)
    }

    /// An invocation with `key` as its first key.
    pub fn key<T: redis::ToRedisArgs>(self, key: T) -> Eval {
        Eval { source: self.0, keys: key.to_redis_args(), args: Vec::new() }
    }

    /// An invocation without keys, with `arg` as its first argument.
    pub fn arg<T: redis::ToRedisArgs>(self, arg: T) -> Eval {
        Eval { source: self.0, keys: Vec::new(), args: arg.to_redis_args() }
    }
}

/// One `EVAL` of a [`Script`]: its keys (`KEYS`) and arguments (`ARGV`), in order.
#[derive(Debug, Clone)]
pub struct Eval {
    source: &'static str,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Eval {
    /// Adds a key (`KEYS[n]`).
    pub fn key<T: redis::ToRedisArgs>(mut self, key: T) -> Self {
        self.keys.extend(key.to_redis_args());
        self
    }

    /// Adds an argument (`ARGV[n]`).
    pub fn arg<T: redis::ToRedisArgs>(mut self, arg: T) -> Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    /// Runs it: `EVAL <source> <number of keys> <keys> <args>` (a Redis Cluster routes it by
    /// its first key).
    ///
    /// # Errors
    /// Redis' error, or the reply's conversion error.
    pub async fn invoke_async<C: redis::aio::ConnectionLike, T: redis::FromRedisValue>(&self, con: &mut C) -> redis::RedisResult<T> {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(self.source).arg(self.keys.len()).arg(&self.keys).arg(&self.args);
        cmd.query_async(con).await
    }
}
