//! Request bodies, bounded: in bytes (`max_body_bytes`, a key's `max_upload_bytes`) and in
//! time (`read_timeout`, between chunks), so a large or slow body cannot hold the gateway.

use axum::body::Body;
use axum::http::{header, HeaderMap};
use futures::StreamExt as _;

use crate::problem::Problem;
use crate::state::Gateway;

/// Reads a JSON request body (415 for another type): at most `max_body_bytes`, within `read_timeout`.
pub(crate) async fn read_json(gateway: &Gateway, headers: &HeaderMap, body: Body) -> Result<axum::body::Bytes, Problem> {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json")));
    if !json {
        return Err(Problem::media_type());
    }
    let max = gateway.settings.max_body_bytes;
    match tokio::time::timeout(gateway.settings.read_timeout, axum::body::to_bytes(body, max)).await {
        Err(_) => Err(Problem::slow_body(gateway.settings.read_timeout)),
        Ok(Err(_)) => Err(Problem::too_large(max)),
        Ok(Ok(bytes)) => Ok(bytes),
    }
}

/// Reads a body of any type into memory: at most `max` bytes (413), each chunk within
/// `read_timeout` (408).
pub(crate) async fn read_bounded(gateway: &Gateway, body: Body, max: u64) -> Result<Vec<u8>, Problem> {
    let mut bytes = Vec::new();
    let mut stream = body.into_data_stream();
    loop {
        let next = tokio::time::timeout(gateway.settings.read_timeout, stream.next())
            .await
            .map_err(|_| Problem::slow_body(gateway.settings.read_timeout))?;
        match next {
            None => return Ok(bytes),
            Some(Err(_)) => return Err(Problem::invalid("the body was cut off")),
            Some(Ok(chunk)) => {
                if bytes.len() as u64 + chunk.len() as u64 > max {
                    return Err(Problem::too_large(usize::try_from(max).unwrap_or(usize::MAX)));
                }
                bytes.extend_from_slice(&chunk);
            }
        }
    }
}
