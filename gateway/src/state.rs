//! What every request shares: the config, the deployment's names, Redis, S3, the publishers
//! (a pool of queue clients), the metrics, and the bounds on requests and event streams under
//! way. A leaf: it imports no handler, so every module may import it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sandq_client::{Client, ClientError};
use sandq_core::config::ServiceConfig;
use sandq_core::redis_conn::{RedisConn, RedisTarget};
use sandq_schemas::names::Names;
use sandq_schemas::JobSpec;

use crate::metrics::Metrics;
use crate::problem::Problem;
use crate::settings::GatewaySettings;

/// What every request shares.
pub struct Gateway {
    /// `[gateway]`.
    pub(crate) settings: GatewaySettings,
    /// The services.
    pub(crate) service: ServiceConfig,
    /// The deployment's names.
    pub(crate) names: Names,
    /// Shared, multiplexed (never for blocking commands).
    pub(crate) redis: RedisConn,
    /// For connections of their own (`XREAD BLOCK`).
    pub(crate) redis_target: RedisTarget,
    /// S3 (uploads, artifacts' URLs).
    pub(crate) s3: aws_sdk_s3::Client,
    publishers: Vec<tokio::sync::Mutex<Client>>,
    next: AtomicUsize,
    /// Event streams and long waits open on this gateway (`max_streams`).
    streams: Arc<tokio::sync::Semaphore>,
    /// ... and per key (`max_streams_per_key`).
    streams_per_key: Mutex<std::collections::HashMap<String, usize>>,
    /// Requests being handled (`max_requests`).
    pub(crate) requests: Arc<tokio::sync::Semaphore>,
    /// The metrics.
    pub(crate) metrics: Metrics,
}

/// Failure to start the gateway.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A service could not be reached.
    #[error(transparent)]
    Connect(#[from] ClientError),
    /// Redis could not be reached.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

impl Gateway {
    /// Connects `settings.publishers` clients (each declares the topology) and Redis.
    ///
    /// # Errors
    /// [`StartError`] when a service cannot be reached.
    pub async fn connect(service: ServiceConfig, settings: GatewaySettings) -> Result<Arc<Self>, StartError> {
        let names = Names::new(service.namespace.clone());
        let redis_target = RedisTarget::from_config(&service.redis)?;
        let redis = redis_target.connect().await?;
        let mut publishers = Vec::with_capacity(settings.publishers);
        for _ in 0..settings.publishers.max(1) {
            publishers.push(tokio::sync::Mutex::new(Client::connect(service.clone()).await?));
        }
        let s3 = sandq_core::storage::client(&service.s3);
        let streams = Arc::new(tokio::sync::Semaphore::new(settings.max_streams));
        let requests = Arc::new(tokio::sync::Semaphore::new(settings.max_requests));
        Ok(Arc::new(Gateway {
            settings,
            service,
            names,
            redis,
            redis_target,
            s3,
            publishers,
            next: AtomicUsize::new(0),
            streams,
            streams_per_key: Mutex::new(Default::default()),
            requests,
            metrics: Metrics::new(),
        }))
    }

    /// Publishes a job with a free publisher (else the next in turn, waiting at most `wait`),
    /// with confirms, and writes its `queued` status ([`Client::submit`]).
    ///
    /// # Errors
    /// `None` when no publisher was free within `wait` (nothing was published);
    /// [`Client::submit`]'s.
    pub(crate) async fn publish(&self, spec: &JobSpec, wait: Duration) -> Result<(), Option<ClientError>> {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let n = self.publishers.len();
        let free = (0..n).find_map(|k| self.publishers[(start + k) % n].try_lock().ok());
        let mut client = match free {
            Some(client) => client,
            None => tokio::time::timeout(wait, self.publishers[start % n].lock()).await.map_err(|_| None)?,
        };
        client.submit(spec).await.map_err(Some)
    }

    /// Takes one of the gateway's and the key's event streams (or long waits), if any is left.
    ///
    /// # Errors
    /// 503 when the gateway has `max_streams` open; 429 when the key has `max_streams_per_key`.
    pub(crate) fn take_stream(self: &Arc<Self>, key_id: &str) -> Result<StreamPermit, Problem> {
        let global = self
            .streams
            .clone()
            .try_acquire_owned()
            .map_err(|_| Problem::unavailable("too many open event streams on this gateway").retry_after(5))?;
        let mut per_key = self.streams_per_key.lock().map_err(|_| Problem::unavailable("internal state"))?;
        let open = per_key.entry(key_id.to_owned()).or_insert(0);
        if *open >= self.settings.max_streams_per_key {
            return Err(Problem::too_many(
                format!("at most {} open event streams and waits for this key", self.settings.max_streams_per_key),
                5,
            ));
        }
        *open += 1;
        Ok(StreamPermit { gateway: self.clone(), key_id: key_id.to_owned(), _global: global })
    }
}

/// One open event stream or long wait; given back when dropped.
pub(crate) struct StreamPermit {
    gateway: Arc<Gateway>,
    key_id: String,
    _global: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        if let Ok(mut per_key) = self.gateway.streams_per_key.lock() {
            if let Some(open) = per_key.get_mut(&self.key_id) {
                *open = open.saturating_sub(1);
                if *open == 0 {
                    per_key.remove(&self.key_id);
                }
            }
        }
    }
}
