//! Jupyter notebooks from job results (`sandq export`): one code cell per job, in the order
//! given, as nbformat 4.5.
//!
//! A cell's source is the code the job was submitted with, which the result does not carry:
//! the Rust client records it in Redis when it submits (`Names::job_source_key`, same TTL as
//! the result). A job without a recorded source (submitted by another client, an `entrypoint`
//! job, or past its TTL) gets a comment saying so. Outputs, in this order: the `stdout` stream,
//! the `stderr` stream (the whole logs from S3 when the inline text was truncated), then the
//! rich outputs as the job produced them (`execute_result`, `display_data`, `error`). Images and
//! other representations stored in S3 are fetched, checked against their SHA-256, and embedded
//! (binary types as base64, as nbformat wants).

use base64::Engine;
use sandq_schemas::{JobResult, MimeValue, Output, OutputType, Runtime};
use serde_json::{json, Map, Value};

pub use crate::client::JobSource;
use crate::{Client, ClientError};

/// Failure to export a notebook.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// A stored representation or log could not be fetched.
    #[error("job {job_id}: cannot fetch {key}: {source}")]
    Fetch {
        /// The job.
        job_id: String,
        /// The S3 key.
        key: String,
        /// The client's error.
        source: ClientError,
    },
}

/// True for MIME types nbformat stores as JSON values rather than strings.
fn is_json_mime(mime: &str) -> bool {
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
}

/// True for MIME types whose content is text (stored as a string); the rest is base64.
fn is_text_mime(mime: &str) -> bool {
    mime.starts_with("text/") || is_json_mime(mime) || mime == "image/svg+xml" || mime == "application/javascript"
}

async fn fetch(client: &Client, job_id: &str, artifact: &sandq_schemas::Artifact) -> Result<Vec<u8>, ExportError> {
    client.fetch_artifact(artifact).await.map_err(|source| ExportError::Fetch {
        job_id: job_id.to_owned(),
        key: artifact.key.clone(),
        source,
    })
}

/// One representation as nbformat wants it: a JSON value for JSON types, a string for text,
/// base64 for binary types. `None` for a representation that cannot be (JSON that does not
/// parse, a value with neither text nor an object).
async fn mime_value(client: &Client, job_id: &str, mime: &str, value: &MimeValue) -> Result<Option<Value>, ExportError> {
    let bytes = match (&value.text, &value.artifact) {
        (Some(text), _) => text.clone().into_bytes(),
        (None, Some(artifact)) => fetch(client, job_id, artifact).await?,
        (None, None) => return Ok(None),
    };
    if is_json_mime(mime) {
        return Ok(serde_json::from_slice(&bytes).ok());
    }
    if is_text_mime(mime) {
        return Ok(Some(Value::String(String::from_utf8_lossy(&bytes).into_owned())));
    }
    Ok(Some(Value::String(base64::engine::general_purpose::STANDARD.encode(&bytes))))
}

async fn stream(client: &Client, job_id: &str, name: &str, captured: &sandq_schemas::CapturedOutput) -> Result<Option<Value>, ExportError> {
    let text = match &captured.log_key {
        Some(key) if captured.truncated || captured.lossy => {
            let bytes = client.fetch_log(key, captured.log_bytes).await.map_err(|source| ExportError::Fetch {
                job_id: job_id.to_owned(),
                key: key.clone(),
                source,
            })?;
            String::from_utf8_lossy(&bytes).into_owned()
        }
        _ => captured.text.clone(),
    };
    Ok((!text.is_empty()).then(|| json!({"output_type": "stream", "name": name, "text": text})))
}

async fn output(client: &Client, result: &JobResult, output: &Output) -> Result<Option<Value>, ExportError> {
    if output.output_type == OutputType::Error {
        let Some(error) = output.error.as_ref().or(result.error.as_ref()) else { return Ok(None) };
        return Ok(Some(json!({"output_type": "error", "ename": error.name, "evalue": error.value, "traceback": error.traceback})));
    }
    let mut data = Map::new();
    let mut metadata = Map::new();
    for (mime, value) in &output.data {
        if let Some(v) = mime_value(client, &result.job_id, mime, value).await? {
            data.insert(mime.clone(), v);
            if let (Some(image), true) = (output.image, mime.starts_with("image/")) {
                metadata.insert(mime.clone(), json!({"width": image.width, "height": image.height}));
            }
        }
    }
    Ok(Some(match output.output_type {
        OutputType::ExecuteResult => json!({
            "output_type": "execute_result",
            "execution_count": result.execution_count,
            "data": data,
            "metadata": metadata,
        }),
        _ => json!({"output_type": "display_data", "data": data, "metadata": metadata}),
    }))
}

/// The code cell of one job (`id` = the job id, which fits nbformat's cell id rules).
///
/// # Errors
/// [`ExportError::Fetch`] when a stored log or representation cannot be fetched.
pub async fn cell(client: &Client, result: &JobResult, source: Option<&JobSource>) -> Result<Value, ExportError> {
    let mut outputs = Vec::new();
    outputs.extend(stream(client, &result.job_id, "stdout", &result.stdout).await?);
    outputs.extend(stream(client, &result.job_id, "stderr", &result.stderr).await?);
    for o in &result.outputs {
        outputs.extend(output(client, result, o).await?);
    }
    let source = source.map_or_else(
        || {
            format!(
                "# sandq: the code of job {} was not recorded (submitted by another client, from an entrypoint, or expired)\n",
                result.job_id
            )
        },
        |s| s.code.clone(),
    );
    Ok(json!({
        "cell_type": "code",
        "id": result.job_id,
        "execution_count": result.execution_count,
        "metadata": {"sandq": {
            "job_id": result.job_id,
            "status": result.status.as_str(),
            "sku": result.sku.map(|s| s.as_str()),
            "exit_code": result.exit_code,
            "started_at_ms": result.started_at_ms,
            "finished_at_ms": result.finished_at_ms,
        }},
        "source": source,
        "outputs": outputs,
    }))
}

/// The notebook (nbformat 4.5) of `cells`, its kernel that of `runtime`.
pub fn notebook(cells: Vec<Value>, runtime: Runtime) -> Value {
    let (kernelspec, language) = match runtime {
        Runtime::Python => (json!({"name": "python3", "display_name": "Python 3", "language": "python"}), json!({"name": "python"})),
        Runtime::Node => {
            (json!({"name": "javascript", "display_name": "JavaScript (Node.js)", "language": "javascript"}), json!({"name": "javascript"}))
        }
    };
    json!({
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {"kernelspec": kernelspec, "language_info": language},
        "cells": cells,
    })
}
