//! Sessions over the REST API: make, list, delete (waiting for a running job, or not), list,
//! write and delete their files. Reading a session's file is a redirect (`files.rs`).

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, Method};
use serde::Deserialize;
use serde_json::Value;

use super::{built, encode_path, route, HttpClient, HttpError};

/// A session of the key's tenant, as `GET /v1/sessions` lists it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct SessionInfo {
    /// Its name (the tenant's, without prefix).
    pub name: String,
    /// Files in it.
    #[serde(default)]
    pub files: u64,
    /// Their bytes.
    #[serde(default)]
    pub bytes: u64,
    /// When it expires unless a job uses it, Unix epoch ms; `None` before its first job.
    #[serde(default)]
    pub expires_at_ms: Option<u64>,
    /// Notebook cells run in it.
    #[serde(default)]
    pub execution_count: u64,
}

/// One file of a session, as `GET /v1/sessions/{name}/files` lists it.
#[derive(Debug, Clone, Deserialize)]
pub struct FileInfo {
    /// Path under `/work`.
    pub path: String,
    /// Bytes.
    pub size: u64,
    /// SHA-256, hex.
    #[serde(default)]
    pub sha256: String,
}

impl HttpClient {
    /// The tenant's sessions (`GET /v1/sessions`, at most 1000; within 60 s).
    ///
    /// # Errors
    /// The gateway's; the transport's.
    pub async fn sessions(&self) -> Result<Vec<SessionInfo>, HttpError> {
        #[derive(Deserialize)]
        struct Listed {
            sessions: Vec<SessionInfo>,
        }
        let reply = self.send_empty(Method::GET, "/v1/sessions", Some(Duration::from_secs(60))).await?;
        Ok(super::json_of::<Listed>(reply, "GET /v1/sessions").await?.sessions)
    }

    /// Deletes a session's files and state now (`DELETE /v1/sessions/{name}`); while a job of
    /// it runs the gateway waits up to 30 s, and this asks again until `wait` has passed. The
    /// next job naming it starts fresh.
    ///
    /// # Errors
    /// [`HttpError::NotFound`] for a session the tenant does not have; [`HttpError::Conflict`]
    /// when a job of it still ran after `wait`.
    pub async fn remove_session(&self, name: &str, wait: Duration) -> Result<(), HttpError> {
        let started = Instant::now();
        let path = route(&["v1", "sessions", name]);
        loop {
            match self.send_empty(Method::DELETE, &path, Some(Duration::from_secs(90))).await {
                Err(HttpError::Conflict(_)) if started.elapsed() < wait => tokio::time::sleep(Duration::from_secs(1)).await,
                other => return other.map(drop),
            }
        }
    }

    /// `DELETE /v1/sessions/{name}` once: its files and state deleted (the gateway waits up
    /// to 30 s for a job of it to end).
    ///
    /// # Errors
    /// 404, 409 (a job of it still runs); the transport's.
    pub async fn delete_session(&self, name: &str) -> Result<(), HttpError> {
        self.send_empty(Method::DELETE, &format!("/v1/sessions/{}", encode_path(name)), None).await.map(drop)
    }

    /// `POST /v1/sessions`: a new session of the tenant named `name` (or a new UUID's); its
    /// name.
    ///
    /// # Errors
    /// 400 for a bad name, 429 over `max_sessions`; the transport's.
    pub async fn create_session(&self, name: Option<&str>) -> Result<String, HttpError> {
        let body = match name {
            Some(n) => serde_json::json!({ "name": n }),
            None => serde_json::json!({}),
        };
        let created: Value = self.json(Method::POST, "/v1/sessions", Some(&body)).await?;
        created
            .get("name")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| HttpError::Malformed { what: "POST /v1/sessions".into(), reason: "no session name".into() })
    }

    /// `GET /v1/sessions/{name}/files`: its files, and whether the list was cut.
    ///
    /// # Errors
    /// 404; the transport's.
    pub async fn session_files(&self, name: &str) -> Result<(Vec<FileInfo>, bool), HttpError> {
        #[derive(Deserialize)]
        struct Files {
            files: Vec<FileInfo>,
            #[serde(default)]
            truncated: bool,
        }
        let files: Files = self.json(Method::GET, &format!("/v1/sessions/{}/files", encode_path(name)), None).await?;
        Ok((files.files, files.truncated))
    }

    /// `PUT /v1/sessions/{name}/files/{path}`: `bytes` become the file.
    ///
    /// # Errors
    /// 400 (a bad path), 409 (a job of it runs), 413; the transport's.
    pub async fn write_file(&self, name: &str, path: &str, bytes: impl Into<Bytes>) -> Result<(), HttpError> {
        let route = format!("/v1/sessions/{}/files/{}", encode_path(name), encode_path(path));
        let bytes = bytes.into();
        self.send(&route, || {
            let request = self.request(Method::PUT, &route).header(header::CONTENT_TYPE, "application/octet-stream");
            built(request, bytes.clone(), &route)
        })
        .await
        .map(drop)
    }

    /// `DELETE /v1/sessions/{name}/files/{path}`: the file removed from the session (any path
    /// it holds, so that one a job cannot restore can be removed).
    ///
    /// # Errors
    /// [`HttpError::NotFound`] when the tenant has no such session or the session no such file;
    /// 409 (a job of it runs); the transport's.
    pub async fn delete_file(&self, name: &str, path: &str) -> Result<(), HttpError> {
        let route = format!("/v1/sessions/{}/files/{}", encode_path(name), encode_path(path));
        self.send_empty(Method::DELETE, &route, None).await.map(drop)
    }
}
