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
    streams_per_key: Arc<PerKey>,
    /// Request bodies being received (and uploads being stored) per key (`max_uploads_per_key`).
    uploads_per_key: Arc<PerKey>,
    /// Bytes in upload spools now, all keys together (`max_spooled_bytes`).
    pub(crate) spooled_bytes: Arc<std::sync::atomic::AtomicU64>,
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
            streams_per_key: Arc::default(),
            uploads_per_key: Arc::default(),
            spooled_bytes: Arc::default(),
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
    /// Every kind of long-lived answer takes one: an SSE event stream, a `?wait=`, and so the
    /// MCP tools' and E2B streams, which read those routes in-process with the caller's key.
    ///
    /// # Errors
    /// 503 when the gateway has `max_streams` open; 429 when the key has `max_streams_per_key`.
    pub(crate) fn take_stream(self: &Arc<Self>, key_id: &str) -> Result<StreamPermit, Problem> {
        let global = self
            .streams
            .clone()
            .try_acquire_owned()
            .map_err(|_| Problem::unavailable("too many open event streams on this gateway").retry_after(5))?;
        let per_key = PerKey::take(&self.streams_per_key, key_id, self.settings.max_streams_per_key).ok_or_else(|| {
            Problem::too_many(format!("at most {} open event streams and waits for this key", self.settings.max_streams_per_key), 5)
        })?;
        Ok(StreamPermit { _per_key: per_key, _global: global })
    }

    /// Takes one of the key's request bodies under way (`max_uploads_per_key`), held while a
    /// body is received (and an upload stored).
    ///
    /// # Errors
    /// 429 when the key has `max_uploads_per_key` bodies under way.
    pub(crate) fn take_upload(&self, key_id: &str) -> Result<KeyPermit, Problem> {
        let max = self.settings.max_uploads_per_key;
        PerKey::take(&self.uploads_per_key, key_id, max)
            .ok_or_else(|| Problem::too_many(format!("at most {max} request bodies (uploads) under way at once for this key"), 5))
    }

    /// Resolves once the key `key_id` is revoked (or deleted), checking every
    /// `revocation_check`; never resolves while it is valid (a failed check counts as valid).
    /// A stream or wait races its work against it, so a revoked key's streams end within
    /// about `revocation_check` (issue 36, finding 11).
    pub(crate) fn revoked(self: &Arc<Self>, key_id: &str) -> impl std::future::Future<Output = ()> + Send + 'static {
        let gateway = self.clone();
        let key_id = key_id.to_owned();
        async move {
            let mut tick = tokio::time::interval(gateway.settings.revocation_check);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                if gateway.is_revoked(&key_id).await {
                    return;
                }
            }
        }
    }

    /// Whether the key `key_id` is revoked or gone now (false when the store cannot tell).
    pub(crate) async fn is_revoked(&self, key_id: &str) -> bool {
        let mut redis = self.redis.clone();
        match sandq_core::keys::get(&mut redis, &self.names, key_id).await {
            Ok(record) => record.revoked_at_ms.is_some(),
            Err(sandq_core::keys::KeyError::Unknown(_)) => true,
            Err(_) => false,
        }
    }
}

/// Counts of something held per key (open streams, bodies under way).
#[derive(Debug, Default)]
pub(crate) struct PerKey {
    open: Mutex<std::collections::HashMap<String, usize>>,
}

impl PerKey {
    /// One more for `key_id`, unless it holds `max` already.
    fn take(this: &Arc<Self>, key_id: &str, max: usize) -> Option<KeyPermit> {
        let mut open = this.open.lock().ok()?;
        let held = open.entry(key_id.to_owned()).or_insert(0);
        if *held >= max {
            if *held == 0 {
                open.remove(key_id);
            }
            return None;
        }
        *held += 1;
        Some(KeyPermit { counts: this.clone(), key_id: key_id.to_owned() })
    }
}

/// One of a key's counted things; given back when dropped.
#[derive(Debug)]
pub(crate) struct KeyPermit {
    counts: Arc<PerKey>,
    key_id: String,
}

impl Drop for KeyPermit {
    fn drop(&mut self) {
        if let Ok(mut open) = self.counts.open.lock() {
            if let Some(held) = open.get_mut(&self.key_id) {
                *held = held.saturating_sub(1);
                if *held == 0 {
                    open.remove(&self.key_id);
                }
            }
        }
    }
}

/// One open event stream or long wait (the gateway's and the key's); given back when dropped.
pub(crate) struct StreamPermit {
    _per_key: KeyPermit,
    _global: tokio::sync::OwnedSemaphorePermit,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_holds_at_most_its_bound_and_gets_them_back() {
        let counts = Arc::new(PerKey::default());
        let a: Vec<_> = (0..3).map(|_| PerKey::take(&counts, "a", 3).expect("under the bound")).collect();
        assert!(PerKey::take(&counts, "a", 3).is_none());
        // Another key is counted apart.
        let b = PerKey::take(&counts, "b", 3).expect("another key");
        drop(a);
        assert!(PerKey::take(&counts, "a", 3).is_some());
        drop(b);
        assert!(counts.open.lock().expect("lock").is_empty(), "no entry is left for a key that holds none");
        assert!(PerKey::take(&counts, "c", 0).is_none());
        assert!(counts.open.lock().expect("lock").is_empty());
    }
}
