//! Code contexts (`/contexts`): notebook states of their own within a sandbox's session,
//! listed, created, deleted and restarted in the sandbox's record.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::Path;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::record::{plane_sandbox, CodeContext, Record};
use super::state::{body_json, E2b, Refused};
use crate::auth::Caller;

/// Longest context `cwd`, bytes.
const MAX_CWD_BYTES: usize = 4096;

/// Contexts with a state of their own a sandbox has at most: the session keeps 16 named
/// states besides its default one, least recently used dropped first, so a deleted or
/// restarted context's old state (never used again) goes before a live one.
const MAX_CONTEXTS: usize = 16;

/// The sandbox's contexts with a state of their own.
fn slotted(record: &Record) -> usize {
    record.contexts.iter().filter(|c| c.slot.is_some()).count()
}

/// A language as E2B's interpreter names it: none is python, `js` is javascript, `ts`
/// typescript, `sh` bash.
pub(super) fn language_name(language: Option<&str>) -> String {
    match language.map(str::to_ascii_lowercase).as_deref() {
        None | Some("") | Some("python") => "python".to_owned(),
        Some("js" | "javascript") => "javascript".to_owned(),
        Some("ts" | "typescript") => "typescript".to_owned(),
        Some("sh" | "bash") => "bash".to_owned(),
        Some(other) => other.to_owned(),
    }
}

fn context_json(c: &CodeContext) -> Value {
    json!({"id": c.id, "language": c.language, "cwd": c.cwd})
}

/// `GET /contexts`: the sandbox's contexts, in creation order.
pub(super) async fn contexts(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
) -> Result<Response, Refused> {
    let record = plane_sandbox(&e2b, caller, &headers).await?;
    Ok(Json(Value::Array(record.contexts.iter().map(context_json).collect())).into_response())
}

#[derive(Debug, Default, Deserialize)]
struct NewContext {
    #[serde(default)]
    language: Option<String>,
    #[serde(default)]
    cwd: Option<String>,
}

/// `POST /contexts {"language"?, "cwd"?}`: a new context with an empty state of its own.
pub(super) async fn create_context(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refused> {
    let mut record = plane_sandbox(&e2b, caller, &headers).await?;
    let new: NewContext = body_json(body, e2b.gateway.settings.read_timeout).await?;
    let language = language_name(new.language.as_deref());
    if !matches!(language.as_str(), "python" | "javascript" | "typescript" | "bash") {
        return Err((
            StatusCode::BAD_REQUEST,
            format!("language {language:?} is not supported by sandq (python, javascript, typescript, bash)"),
        )
            .into_response()
            .into());
    }
    if slotted(&record) >= MAX_CONTEXTS {
        return Err((StatusCode::BAD_REQUEST, format!("a sandbox has at most {MAX_CONTEXTS} contexts with states of their own"))
            .into_response()
            .into());
    }
    let cwd = new.cwd.unwrap_or_else(|| "/home/user".to_owned());
    if cwd.len() > MAX_CWD_BYTES {
        return Err((StatusCode::BAD_REQUEST, format!("cwd is over {MAX_CWD_BYTES} bytes")).into_response().into());
    }
    let id = uuid::Uuid::new_v4().simple().to_string();
    let context = CodeContext { slot: Some(id.clone()), id, language, cwd };
    record.contexts.push(context.clone());
    e2b.update(&record).await?;
    Ok(Json(context_json(&context)).into_response())
}

/// `DELETE /contexts/{id}`: the context is gone (its state is dropped from the session when
/// newer ones need the room).
pub(super) async fn delete_context(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    Path(context): Path<String>,
) -> Result<Response, Refused> {
    let mut record = plane_sandbox(&e2b, caller, &headers).await?;
    let before = record.contexts.len();
    record.contexts.retain(|c| c.id != context);
    if record.contexts.len() == before {
        return Err((StatusCode::NOT_FOUND, format!("Context {context} not found")).into_response().into());
    }
    e2b.update(&record).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `POST /contexts/{id}/restart`: the context starts over with an empty state (a new slot in
/// the session); the files stay.
pub(super) async fn restart_context(
    axum::Extension(e2b): axum::Extension<Arc<E2b>>,
    caller: Result<Caller, crate::problem::Problem>,
    headers: HeaderMap,
    Path(context): Path<String>,
) -> Result<Response, Refused> {
    let mut record = plane_sandbox(&e2b, caller, &headers).await?;
    let full = slotted(&record) >= MAX_CONTEXTS;
    let Some(found) = record.contexts.iter_mut().find(|c| c.id == context) else {
        return Err((StatusCode::NOT_FOUND, format!("Context {context} not found")).into_response().into());
    };
    // A default context restarted gets a state of its own: within the cap too.
    if found.slot.is_none() && full {
        return Err((StatusCode::BAD_REQUEST, format!("a sandbox has at most {MAX_CONTEXTS} contexts with states of their own"))
            .into_response()
            .into());
    }
    found.slot = Some(format!("{}.{}", found.id, &uuid::Uuid::new_v4().simple().to_string()[..12]));
    e2b.update(&record).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
