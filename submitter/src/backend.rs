//! Where `sandq` sends its requests: to sandq's services directly (the config's broker, Redis
//! and S3, through [`Client`]), or to a gateway over HTTP with an API key (`--url`, through
//! [`HttpClient`]). The job commands are written once against [`Backend`]; the commands with no
//! HTTP route (`key`, `export`) refuse URL mode in `main`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use futures::stream::{LocalBoxStream, StreamExt as _};
use sandq_client::{Client, Event, HttpClient, Unserved};
use sandq_schemas::{Artifact, InputFile, JobResult, JobSpec, JobStatus};

/// The services, or the gateway.
pub(crate) enum Backend {
    /// The broker, Redis and S3 of the config file (boxed: a connected client is large).
    Direct(Box<Client>),
    /// A gateway (`--url`, `SANDQ_URL`) with an API key (`--api-key`, `SANDQ_API_KEY`).
    Http(HttpClient),
}

impl Backend {
    /// Uploads a local file; the input that stages it at `sandbox_path`.
    pub(crate) async fn upload(&self, local: &Path, sandbox_path: &str) -> anyhow::Result<InputFile> {
        Ok(match self {
            Backend::Direct(client) => client.upload(local, sandbox_path).await?,
            Backend::Http(http) => http.upload(local, sandbox_path).await?,
        })
    }

    /// Submits the job. Directly, when no worker consumes the SKU's queue right now, refuses it
    /// (`refuse`: [`sandq_client::ClientError::Unserved`]) or says so on stderr and submits it
    /// (the job then waits in the queue until a worker comes, e.g. when the autoscaler adds one,
    /// or expires after `unserved_ttl`). Over HTTP, a job this id names already (submitted before
    /// with the same body) is taken as submitted.
    pub(crate) async fn submit(&mut self, spec: &JobSpec, refuse: bool, unserved_ttl: Duration) -> anyhow::Result<()> {
        match self {
            Backend::Direct(client) => {
                if refuse {
                    client.set_unserved(Unserved::Refuse);
                } else {
                    client.set_unserved(Unserved::Ignore);
                    if let Ok(0) = client.consumers(spec.sku).await {
                        let expiry = if unserved_ttl.is_zero() {
                            "never expires (queues.unserved_ttl is 0)".to_owned()
                        } else {
                            format!("expires after {} (queues.unserved_ttl)", humantime::format_duration(unserved_ttl))
                        };
                        eprintln!(
                            "sandq: no worker serves SKU {} right now; the job waits in the queue until one does, or {expiry}",
                            spec.sku
                        );
                    }
                }
                client.submit(spec).await?;
            }
            Backend::Http(http) => {
                http.submit(spec).await.with_context(|| format!("cannot submit job {}", spec.job_id))?;
            }
        }
        Ok(())
    }

    /// The job's current result; `None` when it is unknown.
    pub(crate) async fn status(&mut self, job_id: &str) -> anyhow::Result<Option<JobResult>> {
        Ok(match self {
            Backend::Direct(client) => client.status(job_id).await?,
            Backend::Http(http) => http.status(job_id).await?,
        })
    }

    /// Waits for the job's terminal result, at most `timeout`, calling `on_change` as its
    /// status changes.
    pub(crate) async fn wait(
        &mut self,
        job_id: &str,
        timeout: Duration,
        on_change: impl FnMut(Option<JobStatus>),
    ) -> anyhow::Result<JobResult> {
        Ok(match self {
            Backend::Direct(client) => client.wait(job_id, timeout, Duration::from_millis(500), on_change).await?,
            Backend::Http(http) => http.wait(job_id, timeout, on_change).await?,
        })
    }

    /// Asks for the job to be cancelled; false when it is unknown or over.
    pub(crate) async fn cancel(&mut self, job_id: &str) -> anyhow::Result<bool> {
        Ok(match self {
            Backend::Direct(client) => client.cancel(job_id).await?,
            Backend::Http(http) => http.cancel(job_id).await?,
        })
    }

    /// The job's live events from the first, as they come; ends after `end`. Over HTTP, an
    /// error opening the stream is said on stderr and ends it (the wait that follows reports
    /// it again, or the result).
    pub(crate) fn events<'a>(&'a mut self, job_id: &'a str) -> LocalBoxStream<'a, Event> {
        match self {
            Backend::Direct(client) => client.events(job_id, sandq_core::events::START, Duration::from_millis(500)).boxed_local(),
            Backend::Http(http) => http
                .events(job_id, None)
                .filter_map(|event| async move { event.map_err(|e| eprintln!("sandq: no live output: {e}")).ok() })
                .boxed_local(),
        }
    }

    /// Downloads one of the job's artifacts into `dir`, checked against its size and SHA-256.
    pub(crate) async fn download_artifact(&self, job_id: &str, artifact: &Artifact, dir: &Path) -> anyhow::Result<PathBuf> {
        Ok(match self {
            Backend::Direct(client) => client.download_artifact(artifact, dir).await?,
            Backend::Http(http) => http.download_artifact(job_id, artifact, dir).await?,
        })
    }

    /// Downloads a stored representation of a rich output into `dir`, checked likewise.
    pub(crate) async fn download_output(&self, artifact: &Artifact, dir: &Path) -> anyhow::Result<PathBuf> {
        Ok(match self {
            Backend::Direct(client) => client.download_artifact(artifact, dir).await?,
            Backend::Http(http) => http.download_output(artifact, dir).await?,
        })
    }
}
