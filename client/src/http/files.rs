//! Bytes in and out over the REST API: a local file's upload (streamed), and what the gateway
//! serves as a redirect to a presigned URL (an artifact, a rich output, a log, a session's
//! file), followed by hand once, without the key: saved to disk checked against its record,
//! read into memory up to the caller's limit, or streamed on.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt as _, TryStreamExt as _};
use http::{header, Method};
use reqwest::Url;
use sandq_schemas::names::input_key;
use sandq_schemas::{Artifact, InputFile};
use serde::Deserialize;
use sha2::Digest as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::transport::{BodyStream, BoxError};
use super::{encode_path, json_of, read_bounded, route, HttpClient, HttpError, Outgoing};

/// Bytes read from a local file per chunk of an upload.
const UPLOAD_CHUNK_BYTES: usize = 64 << 10;

impl HttpClient {
    /// Uploads a local file (`POST /v1/files`, streamed) and returns the input entry that
    /// stages it at `sandbox_path` (relative to `/work`) in a job of this tenant.
    ///
    /// # Errors
    /// [`HttpError::Local`] when the file cannot be read; [`HttpError::BodyTooLarge`] over the
    /// key's `max_upload_bytes`; any other of the gateway's.
    pub async fn upload(&self, local: &Path, sandbox_path: &str) -> Result<InputFile, HttpError> {
        let local_error = |source| HttpError::Local { path: local.display().to_string(), source };
        let size = std::fs::metadata(local).map_err(local_error)?.len();
        let path = "/v1/files";
        let reply = self
            .send(path, || {
                let file = std::fs::File::open(local).map_err(local_error)?;
                self.request(Method::POST, path)
                    .header(header::CONTENT_TYPE, "application/octet-stream")
                    .header(header::CONTENT_LENGTH, size)
                    .body(file_body(file))
                    .map(Outgoing::Streamed)
                    .map_err(|e| HttpError::Malformed { what: path.to_owned(), reason: e.to_string() })
            })
            .await?;
        #[derive(Deserialize)]
        struct Uploaded {
            file_id: String,
            size: u64,
        }
        let uploaded: Uploaded = json_of(reply, "POST /v1/files").await?;
        Ok(InputFile { key: input_key(&uploaded.file_id), path: sandbox_path.to_owned(), size: uploaded.size, sha256: uploaded.file_id })
    }

    /// Downloads one of the job's artifacts into `dir`, at its path relative to `/work`,
    /// through the gateway's redirect (`GET /v1/jobs/{id}/artifacts/{path}`, within 60 s) to a
    /// presigned URL, fetched without the key; checks size and SHA-256 against `artifact` and
    /// only then gives the file its name. Returns the local path.
    ///
    /// # Errors
    /// [`HttpError::UnsafeArtifactPath`], [`HttpError::NotFound`], [`HttpError::Mismatch`],
    /// [`HttpError::Local`], [`HttpError::Transport`], [`HttpError::BadRedirect`],
    /// [`HttpError::Storage`].
    pub async fn download_artifact(&self, job_id: &str, artifact: &Artifact, dir: &Path) -> Result<PathBuf, HttpError> {
        sandq_schemas::validate::check_relative_path(&artifact.path)
            .map_err(|_| HttpError::UnsafeArtifactPath { path: artifact.path.clone() })?;
        let mut segments = vec!["v1", "jobs", job_id, "artifacts"];
        segments.extend(artifact.path.split('/'));
        let (body, url) = self.follow(&route(&segments), &artifact.path, Some(Duration::from_secs(60))).await?;
        save(body, &url, artifact, &dir.join(&artifact.path)).await
    }

    /// Downloads a stored representation of a rich output (an image, a large text) into `dir`
    /// from its presigned URL (the worker's), checking size and SHA-256. Returns the local
    /// path.
    ///
    /// # Errors
    /// [`HttpError::NoUrl`] when the worker presigned none; as [`HttpClient::download_artifact`].
    pub async fn download_output(&self, artifact: &Artifact, dir: &Path) -> Result<PathBuf, HttpError> {
        sandq_schemas::validate::check_relative_path(&artifact.path)
            .map_err(|_| HttpError::UnsafeArtifactPath { path: artifact.path.clone() })?;
        let url = artifact.url.as_deref().and_then(|u| Url::parse(u).ok()).ok_or_else(|| HttpError::NoUrl { key: artifact.key.clone() })?;
        let (body, shown) = self.fetch_plain(url).await?;
        save(body, &shown, artifact, &dir.join(&artifact.path)).await
    }

    /// A session's file's bytes (at most `max`), through its redirect.
    ///
    /// # Errors
    /// 404; [`HttpError::TooLarge`]; the transport's; storage's.
    pub async fn read_file(&self, name: &str, path: &str, max: usize) -> Result<Vec<u8>, HttpError> {
        self.redirected(&format!("/v1/sessions/{}/files/{}", encode_path(name), encode_path(path)), path, max).await
    }

    /// A job's artifact's bytes (at most `max`), through its redirect.
    ///
    /// # Errors
    /// 404; [`HttpError::TooLarge`]; the transport's; storage's.
    pub async fn artifact(&self, job_id: &str, path: &str, max: usize) -> Result<Vec<u8>, HttpError> {
        self.redirected(&format!("/v1/jobs/{}/artifacts/{}", encode_path(job_id), encode_path(path)), path, max).await
    }

    /// A job's rich output's stored representation (`output-<i>-<n>.<ext>`), at most `max`
    /// bytes, through its redirect.
    ///
    /// # Errors
    /// 404; [`HttpError::TooLarge`]; the transport's; storage's.
    pub async fn output(&self, job_id: &str, name: &str, max: usize) -> Result<Vec<u8>, HttpError> {
        self.redirected(&format!("/v1/jobs/{}/outputs/{}", encode_path(job_id), encode_path(name)), name, max).await
    }

    /// A job's whole `stdout` or `stderr` as stored (at most `max` bytes).
    ///
    /// # Errors
    /// 404 (the stream was empty); [`HttpError::TooLarge`]; the transport's; storage's.
    pub async fn log(&self, job_id: &str, stream: &str, max: usize) -> Result<Vec<u8>, HttpError> {
        self.redirected(&format!("/v1/jobs/{}/logs/{}", encode_path(job_id), encode_path(stream)), stream, max).await
    }

    /// A session's file as it comes from storage (not read into memory), through its redirect.
    ///
    /// # Errors
    /// 404; the transport's; storage's answer when not a success ([`HttpError::Storage`]).
    pub async fn file_stream(&self, name: &str, path: &str) -> Result<BodyStream, HttpError> {
        let route = format!("/v1/sessions/{}/files/{}", encode_path(name), encode_path(path));
        Ok(self.follow(&route, path, None).await?.0)
    }

    /// The bytes behind a redirect of the gateway (a presigned URL), at most `max`.
    async fn redirected(&self, route: &str, what: &str, max: usize) -> Result<Vec<u8>, HttpError> {
        let (body, _) = self.follow(route, what, None).await?;
        Ok(read_bounded(body, max, what).await?.to_vec())
    }

    /// `GET route` (within `timeout`) and, when it is a redirect, its `Location` fetched
    /// without the key (one hop: that answer's own redirect is not followed): the body and the
    /// URL it came from, without its query.
    async fn follow(&self, route: &str, what: &str, timeout: Option<Duration>) -> Result<(BodyStream, String), HttpError> {
        let reply = self.send_empty(Method::GET, route, timeout).await?;
        if !reply.status.is_redirection() {
            return Ok((reply.body, self.shown(route)));
        }
        let location = reply
            .headers
            .get(header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|l| Url::parse(l).ok().or_else(|| Url::parse(&self.shown(route)).ok()?.join(l).ok()))
            .ok_or_else(|| HttpError::BadRedirect { path: what.to_owned() })?;
        self.fetch_plain(location).await
    }

    /// GETs a presigned URL: no key, no redirect followed. The body, and the URL without its
    /// query (the signature) to name it.
    async fn fetch_plain(&self, url: Url) -> Result<(BodyStream, String), HttpError> {
        let shown = url.as_str().split('?').next().unwrap_or_default().to_owned();
        let response = self.fetch.get(url).send().await.map_err(|e| HttpError::transport(&shown, Box::new(e.without_url())))?;
        if !response.status().is_success() {
            let status = response.status().as_u16();
            let body = response.text().await.unwrap_or_default().chars().take(300).collect();
            return Err(HttpError::Storage { url: shown, status, body });
        }
        Ok((response.bytes_stream().map_err(|e| Box::new(e.without_url()) as BoxError).boxed(), shown))
    }
}

/// A local file's bytes as a body, chunk by chunk.
fn file_body(file: std::fs::File) -> BodyStream {
    futures::stream::try_unfold(tokio::fs::File::from_std(file), |mut file| async move {
        let mut chunk = vec![0; UPLOAD_CHUNK_BYTES];
        let n = file.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        chunk.truncate(n);
        Ok(Some((Bytes::from(chunk), file)))
    })
    .map_err(|e: std::io::Error| Box::new(e) as BoxError)
    .boxed()
}

/// Writes a download (`body`, from `url`) to a temporary file beside `dest`, stopping one byte
/// past the expected size, and renames it to `dest` once size and SHA-256 match `artifact`: a
/// failed download never leaves a partial file under the artifact's name.
async fn save(mut body: BodyStream, url: &str, artifact: &Artifact, dest: &Path) -> Result<PathBuf, HttpError> {
    let local = |source| HttpError::Local { path: dest.display().to_string(), source };
    let mismatch = |reason: String| HttpError::Mismatch { path: artifact.path.clone(), reason };
    if let Some(parent) = dest.parent() {
        tokio::fs::create_dir_all(parent).await.map_err(local)?;
    }
    let partial = dest.with_file_name(format!(".sandq-partial-{}", uuid::Uuid::new_v4().simple()));
    let written = async {
        let mut file = tokio::fs::File::create(&partial).await.map_err(local)?;
        let mut hasher = sha2::Sha256::new();
        let mut size = 0u64;
        while let Some(chunk) = body.try_next().await.map_err(|source| HttpError::transport(url, source))? {
            size += chunk.len() as u64;
            if size > artifact.size {
                return Err(mismatch(format!("more than its {} bytes", artifact.size)));
            }
            hasher.update(&chunk);
            file.write_all(&chunk).await.map_err(local)?;
        }
        file.flush().await.map_err(local)?;
        if size != artifact.size {
            return Err(mismatch(format!("{size} bytes, not {}", artifact.size)));
        }
        let found = hex::encode(hasher.finalize());
        if found != artifact.sha256 {
            return Err(mismatch(format!("SHA-256 {found}, not {}", artifact.sha256)));
        }
        Ok(())
    }
    .await;
    if let Err(e) = written {
        let _ = tokio::fs::remove_file(&partial).await;
        return Err(e);
    }
    tokio::fs::rename(&partial, dest).await.map_err(local)?;
    Ok(dest.to_path_buf())
}
