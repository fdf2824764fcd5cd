//! The Rust client over the broker, Redis and S3 (the `direct` feature): upload inputs, submit a
//! job with publisher confirms, download its artifacts, list and remove sessions; reading a job
//! back (its result, waiting, live events, cancel) is `client/read.rs`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Publishes of one job that the broker may nack before [`Client::submit`] gives up: nacks come
/// while a quorum queue elects a leader (its node stopping, `tests/rabbitmq_cluster.rs`), which
/// takes seconds; with pauses of 0.2 s doubling to 2 s, 8 tries wait ~9 s in all.
pub const NACK_ATTEMPTS: usize = 8;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::Confirmation;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use sandq_schemas::names::{input_key, Names};
use sandq_schemas::{Artifact, InputFile, JobResult, JobSpec, JobStatus, Runtime, CONTENT_TYPE, SCHEMA_VERSION};

use sandq_core::config::ServiceConfig;
use sandq_core::redis_conn::{RedisConn, RedisTarget};
use sandq_core::time::now_ms;
use sandq_core::{results, storage, topology};

mod read;

/// What a job ran, as [`Client::submit`] records it (`Names::job_source_key`, the result's TTL)
/// for [`crate::notebook`] to read back.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JobSource {
    /// The job's runtime.
    pub runtime: Runtime,
    /// The job's `code`.
    pub code: String,
}

/// Failure of a client operation.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The broker could not be reached or refused an operation.
    #[error("rabbitmq: {0}")]
    Broker(#[from] lapin::Error),
    /// The broker did not accept the job: it nacked it, or returned it as unroutable. The job
    /// is not queued.
    #[error("the broker did not accept job {job_id}: {reason}")]
    NotAccepted {
        /// The job.
        job_id: String,
        /// `nack` or `returned: <reply text>`.
        reason: String,
    },
    /// The broker took no decision on the job within `amqp.confirm_timeout` on any address
    /// tried: it may or may not be queued.
    #[error("no publisher confirm for job {job_id} within {} on any broker address", humantime::format_duration(*waited))]
    ConfirmTimeout {
        /// The job.
        job_id: String,
        /// The confirm timeout of each attempt.
        waited: Duration,
    },
    /// Redis failed.
    #[error(transparent)]
    Result(#[from] results::ResultError),
    /// An S3 transfer failed.
    #[error(transparent)]
    Transfer(#[from] storage::TransferError),
    /// The job is invalid (checked before publishing, with the default limits).
    #[error("invalid job")]
    Invalid(#[from] sandq_schemas::ValidationError),
    /// The job could not be encoded.
    #[error(transparent)]
    Encode(#[from] sandq_schemas::EncodeError),
    /// Waiting ended before the job did.
    #[error("job {job_id} did not finish within {}", humantime::format_duration(std::time::Duration::from_secs(waited.as_secs())))]
    WaitTimeout {
        /// The job.
        job_id: String,
        /// How long we waited.
        waited: Duration,
    },
    /// An artifact path would leave the download folder.
    #[error("artifact path {path:?} is unsafe")]
    UnsafeArtifactPath {
        /// The path.
        path: String,
    },
    /// A session operation failed.
    #[error(transparent)]
    Session(#[from] sandq_core::sessions::SessionError),
    /// No worker serves the job's SKU right now (its queue has no consumer) and the client
    /// refuses such jobs ([`Unserved::Refuse`]). Nothing was published.
    #[error("no worker serves sku {sku} right now (queue {queue} has no consumer): job {job_id} not submitted")]
    Unserved {
        /// The job.
        job_id: String,
        /// Its SKU.
        sku: sandq_schemas::Sku,
        /// The SKU's queue.
        queue: String,
    },
}

/// What [`Client::submit`] does with a job whose SKU no worker serves right now: its queue
/// `<ns>.jobs.<SKU>` has no consumer, so the job waits there until a worker comes (an
/// autoscaler starting one from zero, say) or `queues.unserved_ttl` passes and it expires
/// (docs/protocol.md, "Which SKUs are served").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Unserved {
    /// Log a warning (`tracing`, target `sandq_client`) and submit it: the default.
    #[default]
    Warn,
    /// Do not publish it: [`ClientError::Unserved`].
    Refuse,
    /// Submit it without asking the broker (no extra round trip).
    Ignore,
}

/// How long a SKU seen served is taken to stay so before [`Client::submit`] asks the broker
/// again: one passive declare per SKU per interval, not per job.
const SERVED_RECHECK: Duration = Duration::from_secs(10);

/// Longest single `XREAD BLOCK` of [`Client::events`]: the job's status is checked after
/// each that returned nothing.
pub const EVENTS_BLOCK: Duration = sandq_core::events::FOLLOW_BLOCK;

/// A connected client.
pub struct Client {
    config: ServiceConfig,
    names: Names,
    connection: Connection,
    channel: Channel,
    /// Index in `config.amqp.addresses()` of the node `channel` is on.
    broker_index: usize,
    redis: RedisConn,
    /// Where Redis is, to open the blocking connection.
    redis_target: RedisTarget,
    /// A connection of its own for `BLPOP` (a blocking command would stall other commands on
    /// a shared multiplexed connection); made on first wait.
    blocking: Option<RedisConn>,
    /// Made on first use ([`Client::s3`]): building it reads the system's trust store, which a
    /// job without files never needs.
    s3: std::sync::OnceLock<aws_sdk_s3::Client>,
    /// What to do with a job whose SKU is unserved.
    unserved: Unserved,
    /// When each SKU was last seen with a consumer.
    served_at: std::collections::HashMap<sandq_schemas::Sku, Instant>,
}

/// Connects to the first broker address that answers from index `start` on
/// ([`sandq_core::broker::connect`]), declares the topology when `declare`, and opens a channel with
/// publisher confirms; returns the connection, the channel and the address's index.
async fn open_broker(
    config: &ServiceConfig,
    names: &Names,
    start: usize,
    declare: bool,
) -> Result<(Connection, Channel, usize), lapin::Error> {
    let properties = ConnectionProperties::default().with_connection_name("sandq-client".into());
    let (connection, index) = sandq_core::broker::connect(&config.amqp.addresses(), start, &properties).await?;
    if declare {
        topology::declare(&connection, names, config).await?;
    }
    let channel = connection.create_channel().await?;
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    Ok((connection, channel, index))
}

impl Client {
    /// Connects to RabbitMQ (the first of `amqp.urls` that answers, else `amqp.url`; publisher
    /// confirms on), Redis and S3, and declares the topology.
    ///
    /// # Errors
    /// [`ClientError::Broker`] (the last address's error) or [`ClientError::Result`] when a
    /// service cannot be reached.
    pub async fn connect(config: ServiceConfig) -> Result<Self, ClientError> {
        let names = Names::new(config.namespace.clone());
        let redis_target = RedisTarget::from_config(&config.redis).map_err(results::ResultError::from)?;
        // The broker and Redis at once: each costs a few round trips.
        let (broker, redis) = tokio::join!(open_broker(&config, &names, 0, true), redis_target.connect());
        let (connection, channel, broker_index) = broker?;
        let redis = redis.map_err(results::ResultError::from)?;
        let s3 = std::sync::OnceLock::new();
        Ok(Client {
            config,
            names,
            connection,
            channel,
            broker_index,
            redis,
            redis_target,
            blocking: None,
            s3,
            unserved: Unserved::default(),
            served_at: std::collections::HashMap::new(),
        })
    }

    /// The S3 client, made on first use.
    fn s3(&self) -> &aws_sdk_s3::Client {
        self.s3.get_or_init(|| storage::client(&self.config.s3))
    }

    /// Sets what [`Client::submit`] does with a job whose SKU no worker serves right now
    /// (default [`Unserved::Warn`]).
    pub fn set_unserved(&mut self, unserved: Unserved) {
        self.unserved = unserved;
    }

    /// The names of this deployment.
    pub fn names(&self) -> &Names {
        &self.names
    }

    /// Uploads a local file to its content-addressed key (`inputs/sha256/<hex>`), skipping the
    /// upload when the object already exists, and returns the input entry that stages it at
    /// `sandbox_path` (relative to `/work`).
    ///
    /// # Errors
    /// [`ClientError::Transfer`].
    pub async fn upload(&self, local: &Path, sandbox_path: &str) -> Result<InputFile, ClientError> {
        let (sha256, size) = storage::digest_file(local).await?;
        let key = input_key(&sha256);
        // Skipped only when an object of the same size is there: one of another size cannot
        // hold these bytes (any client may write under any digest), and is overwritten. One of
        // the same size but other bytes fails its job's digest check, and the worker then
        // removes it (test: a_poisoned_input_object_is_removed_and_uploaded_again).
        if storage::object_size(self.s3(), &self.config.s3.bucket, &key).await? != Some(size) {
            let file = tokio::fs::File::open(local)
                .await
                .map_err(|source| storage::TransferError::Local { path: local.display().to_string(), source })?;
            storage::put_file(self.s3(), &self.config.s3.bucket, &key, file, &local.display().to_string(), "application/octet-stream")
                .await?;
        }
        Ok(InputFile { key, path: sandbox_path.to_owned(), size, sha256 })
    }

    /// Publishes `spec` (persistent, `mandatory`) and waits for the broker's confirm; then
    /// records the job as `queued` in Redis. The job is submitted only if this returns `Ok`.
    /// A publish that fails (connection lost, no confirm within `amqp.confirm_timeout`, a nack)
    /// is repeated on the next broker address, at most once per address plus once (so twice
    /// with one address), and a nack up to [`NACK_ATTEMPTS`] times with a pause; the job may
    /// then be queued twice, which its id makes harmless.
    ///
    /// Before publishing, unless [`Unserved::Ignore`] is set, it asks the broker whether the SKU's
    /// queue has a consumer (at most once per SKU every 10 s while it has): with none it warns,
    /// or refuses the job ([`Client::set_unserved`]).
    ///
    /// # Errors
    /// [`ClientError::Invalid`] before publishing; [`ClientError::Unserved`] when no worker serves
    /// the SKU and the client refuses such jobs; [`ClientError::NotAccepted`] when the broker
    /// returns the message, or nacks it on the last attempt; [`ClientError::ConfirmTimeout`]
    /// when the last attempt got no confirm; [`ClientError::Broker`] (no address answers) or
    /// [`ClientError::Result`].
    pub async fn submit(&mut self, spec: &JobSpec) -> Result<(), ClientError> {
        let valid = spec.clone().validate(&sandq_schemas::Limits::default())?;
        let body = sandq_schemas::encode(spec)?;
        self.check_served(spec).await?;
        // A publish whose connection fails, or whose confirm does not come within
        // `amqp.confirm_timeout`, or which the broker nacks, is published again on the next
        // address (round-robin; with one address, once more on the same node after a
        // reconnect). Should an earlier publish have reached the queue with only its confirm
        // lost, the job is queued twice: at-least-once execution and the result's
        // compare-and-set absorb that, and the `queued` write below is a no-op the second time
        // (docs/protocol.md, "Several broker addresses").
        let attempts = self.config.amqp.addresses().len() + 1;
        let mut attempt = 0;
        let confirm = loop {
            attempt += 1;
            let failure = match tokio::time::timeout(self.config.amqp.confirm_timeout, self.publish(spec, &body)).await {
                // A nack is what every node answers while a quorum queue elects a new leader (its
                // node stopping): that passes within seconds, so nacks get NACK_ATTEMPTS tries
                // with a growing pause between them (0.2 s doubling to 2 s, ~9 s in all).
                Ok(Ok(Confirmation::Nack(_))) if attempt < attempts.max(NACK_ATTEMPTS) => {
                    let pause = Duration::from_millis(200 << (attempt - 1).min(4)).min(Duration::from_secs(2));
                    tokio::time::sleep(pause).await;
                    "the broker nacked it".to_owned()
                }
                Ok(Ok(confirm)) => break confirm,
                Ok(Err(ClientError::Broker(e))) if attempt < attempts => e.to_string(),
                Ok(Err(e)) => return Err(e),
                Err(_) if attempt < attempts => format!("no confirm within {:?}", self.config.amqp.confirm_timeout),
                Err(_) => {
                    return Err(ClientError::ConfirmTimeout { job_id: spec.job_id.clone(), waited: self.config.amqp.confirm_timeout })
                }
            };
            tracing::warn!(job_id = %spec.job_id, attempt, error = %failure, "publish failed; publishing again on the next broker address");
            self.reconnect().await?;
        };
        match confirm {
            Confirmation::Ack(None) => {}
            Confirmation::Ack(Some(returned)) => {
                return Err(ClientError::NotAccepted { job_id: spec.job_id.clone(), reason: format!("returned: {}", returned.reply_text) })
            }
            Confirmation::Nack(_) => return Err(ClientError::NotAccepted { job_id: spec.job_id.clone(), reason: "nack".into() }),
            Confirmation::NotRequested => {
                return Err(ClientError::NotAccepted { job_id: spec.job_id.clone(), reason: "publisher confirms are off".into() })
            }
        }
        let mut queued = JobResult::new(spec.job_id.clone(), JobStatus::Queued);
        queued.sku = Some(spec.sku);
        queued.queued_at_ms = spec.submitted_at_ms;
        // Kept as long as the job may wait and run, not its `result_ttl` (which only its
        // terminal result takes): a short `result_ttl` must not make a queued job look gone.
        let live = results::live_ttl(self.config.queues.unserved_ttl, valid.timeout, valid.result_ttl);
        results::write(&mut self.redis, &self.names, &queued, live).await?;
        // For `sandq export`: the code (the result does not carry it) and the session's job
        // list. The job is queued whatever happens here.
        if let Err(e) = self.record_source(spec, valid.result_ttl).await {
            tracing::warn!(error = %e, job_id = %spec.job_id, "cannot record the job's source for export");
        }
        Ok(())
    }

    async fn record_source(&mut self, spec: &JobSpec, ttl: Duration) -> redis::RedisResult<()> {
        let ttl_s = ttl.as_secs().max(1);
        if spec.code.is_none() && spec.session.is_none() {
            return Ok(());
        }
        // Two writes, not one pipeline: the job's key and the session's are in different Redis
        // Cluster slots (a cluster refuses a pipeline across slots), and the pipeline was never
        // atomic anyway.
        if let Some(code) = &spec.code {
            let source = JobSource { runtime: spec.runtime, code: code.clone() };
            let json = serde_json::to_string(&source).unwrap_or_default();
            let () = redis::cmd("SET")
                .arg(self.names.job_source_key(&spec.job_id))
                .arg(json)
                .arg("EX")
                .arg(ttl_s)
                .query_async(&mut self.redis)
                .await?;
        }
        if let Some(session) = &spec.session {
            let key = self.names.session_jobs_key(session);
            let mut pipe = redis::pipe();
            pipe.cmd("RPUSH").arg(&key).arg(&spec.job_id).ignore();
            pipe.cmd("EXPIRE").arg(&key).arg(ttl_s).ignore();
            pipe.query_async::<()>(&mut self.redis).await?;
        }
        Ok(())
    }

    /// The code and runtime a job was submitted with, as the Rust client recorded them
    /// (`Names::job_source_key`); `None` when not recorded (another client, an `entrypoint`
    /// job, or expired).
    ///
    /// # Errors
    /// [`ClientError::Result`].
    pub async fn job_source(&mut self, job_id: &str) -> Result<Option<JobSource>, ClientError> {
        let json: Option<String> = redis::cmd("GET")
            .arg(self.names.job_source_key(job_id))
            .query_async(&mut self.redis)
            .await
            .map_err(results::ResultError::from)?;
        Ok(json.and_then(|j| serde_json::from_str(&j).ok()))
    }

    /// Ids of a session's jobs in the order the Rust client submitted them
    /// (`Names::session_jobs_key`).
    ///
    /// # Errors
    /// [`ClientError::Result`].
    pub async fn session_jobs(&mut self, session: &str) -> Result<Vec<String>, ClientError> {
        Ok(redis::cmd("LRANGE")
            .arg(self.names.session_jobs_key(session))
            .arg(0)
            .arg(-1)
            .query_async(&mut self.redis)
            .await
            .map_err(results::ResultError::from)?)
    }

    /// Reads an artifact (or a stored output representation) into memory, checking its size
    /// and SHA-256.
    ///
    /// # Errors
    /// [`ClientError::Transfer`].
    pub async fn fetch_artifact(&self, artifact: &Artifact) -> Result<Vec<u8>, ClientError> {
        use sha2::Digest;
        let bytes = self.fetch_log(&artifact.key, artifact.size).await?;
        if bytes.len() as u64 != artifact.size {
            return Err(
                storage::TransferError::Size { key: artifact.key.clone(), found: bytes.len() as u64, expected: artifact.size }.into()
            );
        }
        let found = hex::encode(sha2::Sha256::digest(&bytes));
        if found != artifact.sha256 {
            return Err(storage::TransferError::Digest { key: artifact.key.clone(), found, expected: artifact.sha256.clone() }.into());
        }
        Ok(bytes)
    }

    async fn publish(&self, spec: &JobSpec, body: &[u8]) -> Result<Confirmation, ClientError> {
        let mut headers = FieldTable::default();
        headers.insert("schema_version".into(), AMQPValue::LongUInt(SCHEMA_VERSION));
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type(CONTENT_TYPE.into())
            .with_message_id(spec.job_id.clone().into())
            .with_timestamp(now_ms() / 1000)
            .with_type("sandq.job".into())
            .with_app_id("sandq-submitter".into())
            .with_headers(headers);
        Ok(self
            .channel
            .basic_publish(
                self.names.jobs_exchange().into(),
                self.names.routing_key(spec.sku).into(),
                BasicPublishOptions { mandatory: true, ..Default::default() },
                body,
                properties,
            )
            .await?
            .await?)
    }

    /// Replaces the broker connection with one to the next address that answers, starting
    /// after the current one. The topology is not declared again: it is durable and was
    /// declared by [`Client::connect`], and a declaration is a cluster-wide metadata
    /// transaction, which a hung node (alive to TCP, answering nothing) stalls until the others
    /// count it down (`net_ticktime`, 60 s by default; measured by `tests/rabbitmq_cluster.rs`),
    /// while a publish to an existing queue needs only the queue's leader and a majority.
    async fn reconnect(&mut self) -> Result<(), ClientError> {
        let (connection, channel, index) = open_broker(&self.config, &self.names, self.broker_index + 1, false).await?;
        self.connection = connection;
        self.channel = channel;
        self.broker_index = index;
        Ok(())
    }

    /// Reads a stored stream (`CapturedOutput::log_key`) of at most `log_bytes` bytes.
    ///
    /// # Errors
    /// [`ClientError::Transfer`].
    pub async fn fetch_log(&self, key: &str, log_bytes: u64) -> Result<Vec<u8>, ClientError> {
        let response = self
            .s3()
            .get_object()
            .bucket(&self.config.s3.bucket)
            .key(key)
            .send()
            .await
            .map_err(|e| storage::TransferError::Request { key: key.to_owned(), message: e.to_string() })?;
        let mut body = response.body;
        let mut bytes = Vec::new();
        while let Some(chunk) =
            body.try_next().await.map_err(|e| storage::TransferError::Request { key: key.to_owned(), message: e.to_string() })?
        {
            if (bytes.len() + chunk.len()) as u64 > log_bytes {
                return Err(storage::TransferError::Size {
                    key: key.to_owned(),
                    found: (bytes.len() + chunk.len()) as u64,
                    expected: log_bytes,
                }
                .into());
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(bytes)
    }

    /// Downloads an artifact into `dir`, at its path relative to `/work`, checking its size
    /// and SHA-256. Returns the local path.
    ///
    /// # Errors
    /// [`ClientError::UnsafeArtifactPath`] when the path is not a safe relative path,
    /// [`ClientError::Transfer`].
    pub async fn download_artifact(&self, artifact: &Artifact, dir: &Path) -> Result<PathBuf, ClientError> {
        sandq_schemas::validate::check_relative_path(&artifact.path)
            .map_err(|_| ClientError::UnsafeArtifactPath { path: artifact.path.clone() })?;
        let dest = dir.join(&artifact.path);
        let local = |source| storage::TransferError::Local { path: dest.display().to_string(), source };
        if let Some(parent) = dest.parent() {
            tokio::fs::create_dir_all(parent).await.map_err(local)?;
        }
        // Into a temporary file beside it, renamed only once size and digest check out: a
        // failed download never leaves a partial or empty file under the artifact's name.
        let partial = dest.with_file_name(format!(".sandq-partial-{}", uuid::Uuid::new_v4().simple()));
        let mut file = tokio::fs::File::create(&partial).await.map_err(local)?;
        let fetched = storage::get_to_file(
            self.s3(),
            &self.config.s3.bucket,
            &artifact.key,
            &mut file,
            &dest.display().to_string(),
            Some(artifact.size),
            Some(&artifact.sha256),
        )
        .await;
        drop(file);
        if let Err(e) = fetched {
            let _ = tokio::fs::remove_file(&partial).await;
            return Err(e.into());
        }
        tokio::fs::rename(&partial, &dest).await.map_err(local)?;
        Ok(dest)
    }

    /// The sessions of this deployment, soonest expiry first (at most `max`).
    ///
    /// # Errors
    /// [`ClientError::Session`].
    pub async fn sessions(&mut self, max: usize) -> Result<Vec<sandq_core::sessions::Listed>, ClientError> {
        let s3 = self.s3().clone();
        Ok(sandq_core::sessions::list(&s3, &self.config.s3.bucket, &mut self.redis, &self.names, max).await?)
    }

    /// Deletes a session's files now (waiting up to `wait` for a running job of it to end);
    /// returns the S3 objects deleted. The next job naming it starts fresh.
    ///
    /// # Errors
    /// [`ClientError::Invalid`] for a name no job could use; [`ClientError::Session`]
    /// ([`sandq_core::sessions::SessionError::Busy`] when a job kept it).
    pub async fn remove_session(&mut self, name: &str, wait: Duration) -> Result<usize, ClientError> {
        sandq_schemas::validate::check_session_name(name)?;
        let holder = format!("cli-{}", uuid::Uuid::new_v4());
        let (s3, bucket, names) = (self.s3().clone(), &self.config.s3.bucket, &self.names);
        let removed = sandq_core::sessions::remove(&s3, bucket, &mut self.redis, names, name, &holder, wait).await?;
        removed.unlocked?;
        Ok(removed.deleted?)
    }

    /// How many consumers (worker slots) the queue of `sku` has right now; 0 means no worker
    /// serves the SKU at the moment, and its jobs wait (also when the queue does not exist).
    /// Asked on a channel of its own (a passive declare of a missing queue closes its
    /// channel), closed after.
    ///
    /// # Errors
    /// [`ClientError::Broker`].
    pub async fn consumers(&self, sku: sandq_schemas::Sku) -> Result<u32, ClientError> {
        let channel = self.connection.create_channel().await?;
        let queue = channel
            .queue_declare(
                self.names.jobs_queue(sku).as_str().into(),
                lapin::options::QueueDeclareOptions { passive: true, ..Default::default() },
                FieldTable::default(),
            )
            .await;
        if channel.status().connected() {
            let _ = channel.close(200, "consumer count read".into()).await;
        }
        match queue {
            Ok(queue) => Ok(queue.consumer_count()),
            Err(e) if topology::not_found(&e) => Ok(0),
            Err(e) => Err(e.into()),
        }
    }

    /// Applies [`Unserved`] to `spec` before it is published. A broker that cannot answer
    /// the question does not stop the job (the publish then says what is wrong).
    async fn check_served(&mut self, spec: &JobSpec) -> Result<(), ClientError> {
        if self.unserved == Unserved::Ignore || self.served_at.get(&spec.sku).is_some_and(|at| at.elapsed() < SERVED_RECHECK) {
            return Ok(());
        }
        match self.consumers(spec.sku).await {
            Ok(0) => {
                let queue = self.names.jobs_queue(spec.sku);
                if self.unserved == Unserved::Refuse {
                    return Err(ClientError::Unserved { job_id: spec.job_id.clone(), sku: spec.sku, queue });
                }
                tracing::warn!(job_id = %spec.job_id, sku = %spec.sku, %queue, "no worker serves the job's sku right now (its queue has no consumer): it waits until one does, or expires");
            }
            Ok(_) => {
                self.served_at.insert(spec.sku, Instant::now());
            }
            Err(e) => tracing::debug!(error = %e, sku = %spec.sku, "cannot read the sku queue's consumer count"),
        }
        Ok(())
    }
}
