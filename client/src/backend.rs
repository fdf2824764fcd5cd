//! Where a program's requests go: to sandq's services directly (the config's broker, Redis and
//! S3, through [`Client`]), or to a gateway over HTTP with an API key (through [`HttpClient`]).
//! [`Target::choose`] makes the choice the `sandq` CLI makes (a URL, else the config file);
//! [`Backend::connect`] connects; the job operations are written once against [`Backend`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::stream::{LocalBoxStream, StreamExt as _};
use sandq_core::config::{self, ConfigError, ServiceConfig};
use sandq_schemas::{Artifact, InputFile, JobResult, JobSpec, JobStatus, Sku};

use crate::{Client, ClientError, Event, HttpClient, HttpError, Unserved};

/// How often [`Backend::wait`] and [`Backend::events`] ask Redis again, directly.
const POLL: Duration = Duration::from_millis(500);

/// Failure to choose, connect to or use a [`Backend`].
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A gateway URL was given without an API key (or with a blank one).
    #[error("a gateway URL needs an API key")]
    MissingApiKey,
    /// The config file is missing or wrong (boxed, as below: the error stays small).
    #[error(transparent)]
    Config(Box<ConfigError>),
    /// The services of the config file could not be reached.
    #[error("cannot connect to sandq's services")]
    Connect(#[source] ClientError),
    /// The gateway did not take the job.
    #[error("cannot submit job {job_id}")]
    Submit {
        /// The job.
        job_id: String,
        /// What the gateway (or the way to it) answered.
        source: Box<HttpError>,
    },
    /// An operation on the services failed.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// An operation through the gateway failed.
    #[error(transparent)]
    Http(#[from] HttpError),
}

/// Where the requests will go, chosen before anything connects.
#[derive(Debug)]
pub enum Target {
    /// A gateway, with its API key.
    Gateway(HttpClient),
    /// The services of this config (boxed: a config is large).
    Services(Box<ServiceConfig>),
}

impl Target {
    /// A gateway when `url` is given (with `api_key`, which must not be blank); else the
    /// config file `config` (else `$SANDQ_CONFIG`, else `/etc/sandq/sandq.toml`), read now.
    /// With a URL no config file is read.
    ///
    /// # Errors
    /// [`BackendError::MissingApiKey`], [`BackendError::Http`] for a URL that is not one
    /// ([`HttpClient::new`]), [`BackendError::Config`] for a missing or wrong config file.
    pub fn choose(url: Option<&str>, api_key: Option<&str>, config: Option<&Path>) -> Result<Target, BackendError> {
        match url {
            Some(url) => {
                let key = api_key.filter(|k| !k.trim().is_empty()).ok_or(BackendError::MissingApiKey)?;
                Ok(Target::Gateway(HttpClient::new(url, key)?))
            }
            None => {
                let service = config::load(&config::config_path(config)).map_err(|e| BackendError::Config(Box::new(e)))?;
                Ok(Target::Services(Box::new(service)))
            }
        }
    }
}

/// The services, or the gateway.
pub enum Backend {
    /// The broker, Redis and S3 of the config file (boxed: a connected client is large).
    Direct {
        /// The connected client.
        client: Box<Client>,
        /// How long a job no worker serves waits in its queue before it expires
        /// (`queues.unserved_ttl`; zero: never).
        unserved_ttl: Duration,
    },
    /// A gateway with an API key.
    Http(HttpClient),
}

impl Backend {
    /// Connects to the services of `target` (a gateway: nothing is sent yet).
    ///
    /// # Errors
    /// [`BackendError::Connect`] when the broker or Redis cannot be reached.
    pub async fn connect(target: Target) -> Result<Backend, BackendError> {
        Ok(match target {
            Target::Gateway(http) => Backend::Http(http),
            Target::Services(service) => {
                let unserved_ttl = service.queues.unserved_ttl;
                let client = Client::connect(*service).await.map_err(BackendError::Connect)?;
                Backend::Direct { client: Box::new(client), unserved_ttl }
            }
        })
    }

    /// Uploads a local file; the input that stages it at `sandbox_path`.
    ///
    /// # Errors
    /// The client's error: the file cannot be read, or the upload failed.
    pub async fn upload(&self, local: &Path, sandbox_path: &str) -> Result<InputFile, BackendError> {
        Ok(match self {
            Backend::Direct { client, .. } => client.upload(local, sandbox_path).await?,
            Backend::Http(http) => http.upload(local, sandbox_path).await?,
        })
    }

    /// Directly, when no worker consumes the queue of `sku` right now (the broker says so):
    /// how long a job submitted now waits for one before it expires (`queues.unserved_ttl`;
    /// zero: never). `None` when a worker does, when the broker cannot tell, and over HTTP.
    pub async fn unserved_wait(&self, sku: Sku) -> Option<Duration> {
        match self {
            Backend::Direct { client, unserved_ttl } => matches!(client.consumers(sku).await, Ok(0)).then_some(*unserved_ttl),
            Backend::Http(_) => None,
        }
    }

    /// Submits the job. Directly, a job no worker serves right now is refused when `refuse`
    /// ([`ClientError::Unserved`]), else submitted without a check (it then waits in the queue
    /// until a worker comes, or expires: [`Backend::unserved_wait`] says when). Over HTTP, a
    /// job this id names already (submitted before with the same body) is taken as submitted.
    ///
    /// # Errors
    /// [`BackendError::Client`] directly, [`BackendError::Submit`] over HTTP.
    pub async fn submit(&mut self, spec: &JobSpec, refuse: bool) -> Result<(), BackendError> {
        match self {
            Backend::Direct { client, .. } => {
                client.set_unserved(if refuse { Unserved::Refuse } else { Unserved::Ignore });
                client.submit(spec).await?;
            }
            Backend::Http(http) => {
                http.submit(spec).await.map_err(|source| BackendError::Submit { job_id: spec.job_id.clone(), source: Box::new(source) })?;
            }
        }
        Ok(())
    }

    /// The job's current result; `None` when it is unknown.
    ///
    /// # Errors
    /// When Redis or the gateway cannot be read.
    pub async fn status(&mut self, job_id: &str) -> Result<Option<JobResult>, BackendError> {
        Ok(match self {
            Backend::Direct { client, .. } => client.status(job_id).await?,
            Backend::Http(http) => http.status(job_id).await?,
        })
    }

    /// Waits for the job's terminal result, at most `timeout`, calling `on_change` as its
    /// status changes.
    ///
    /// # Errors
    /// When waiting ended before the job did, or Redis or the gateway failed.
    pub async fn wait(
        &mut self,
        job_id: &str,
        timeout: Duration,
        on_change: impl FnMut(Option<JobStatus>),
    ) -> Result<JobResult, BackendError> {
        Ok(match self {
            Backend::Direct { client, .. } => client.wait(job_id, timeout, POLL, on_change).await?,
            Backend::Http(http) => http.wait(job_id, timeout, on_change).await?,
        })
    }

    /// Asks for the job to be cancelled; false when it is unknown or over.
    ///
    /// # Errors
    /// When Redis or the gateway failed.
    pub async fn cancel(&mut self, job_id: &str) -> Result<bool, BackendError> {
        Ok(match self {
            Backend::Direct { client, .. } => client.cancel(job_id).await?,
            Backend::Http(http) => http.cancel(job_id).await?,
        })
    }

    /// The job's live events from the first, as they come; ends after `end`. Directly, every
    /// item is an event; over HTTP, an error opening the stream is its last item.
    pub fn events<'a>(&'a mut self, job_id: &'a str) -> LocalBoxStream<'a, Result<Event, BackendError>> {
        match self {
            Backend::Direct { client, .. } => client.events(job_id, sandq_core::events::START, POLL).map(Ok).boxed_local(),
            Backend::Http(http) => http.events(job_id, None).map(|event| event.map_err(BackendError::from)).boxed_local(),
        }
    }

    /// Downloads one of the job's artifacts into `dir`, checked against its size and SHA-256.
    ///
    /// # Errors
    /// When the download fails or its content does not match.
    pub async fn download_artifact(&self, job_id: &str, artifact: &Artifact, dir: &Path) -> Result<PathBuf, BackendError> {
        Ok(match self {
            Backend::Direct { client, .. } => client.download_artifact(artifact, dir).await?,
            Backend::Http(http) => http.download_artifact(job_id, artifact, dir).await?,
        })
    }

    /// Downloads a stored representation of a rich output into `dir`, checked likewise.
    ///
    /// # Errors
    /// When the download fails or its content does not match.
    pub async fn download_output(&self, artifact: &Artifact, dir: &Path) -> Result<PathBuf, BackendError> {
        Ok(match self {
            Backend::Direct { client, .. } => client.download_artifact(artifact, dir).await?,
            Backend::Http(http) => http.download_output(artifact, dir).await?,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::{BackendError, Target};
    use crate::HttpError;
    use sandq_core::config::ConfigError;

    const URL: &str = "https://sandq.example.com";

    #[test]
    fn a_url_chooses_the_gateway_and_needs_a_key() {
        let no_config = Some(Path::new("/nonexistent/sandq.toml"));
        let target = Target::choose(Some(URL), Some("sq_abc"), no_config).expect("a gateway");
        assert!(
            matches!(&target, Target::Gateway(http) if http.base_url().and_then(|u| u.host_str()) == Some("sandq.example.com")),
            "{target:?}"
        );
        for key in [None, Some(""), Some("  ")] {
            let err = Target::choose(Some(URL), key, no_config).expect_err("no key");
            assert!(matches!(err, BackendError::MissingApiKey), "{key:?}: {err:?}");
        }
        let err = Target::choose(Some("ftp://sandq.example.com"), Some("sq_abc"), no_config).expect_err("not http");
        assert!(matches!(err, BackendError::Http(HttpError::Url { .. })), "{err:?}");
    }

    #[test]
    fn without_a_url_the_config_file_is_read_even_with_a_key() {
        let err = Target::choose(None, Some("sq_abc"), Some(Path::new("/nonexistent/sandq.toml"))).expect_err("no file");
        assert!(matches!(&err, BackendError::Config(e) if matches!(**e, ConfigError::Missing { .. })), "{err:?}");
    }
}
