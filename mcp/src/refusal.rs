//! What the MCP server makes of the gateway's refusals and failures ([`HttpError`]): a tool
//! error result the model reads (a problem the gateway answered), or a JSON-RPC error (a
//! broken gateway, an unknown task).

use rmcp::model::{CallToolResult, ContentBlock};
use rmcp::ErrorData;
use sandq_client::http::HttpError;

/// A refused request as a tool error result (the model reads why); a broken gateway as a
/// JSON-RPC internal error.
pub(crate) fn refused(e: HttpError) -> Result<CallToolResult, ErrorData> {
    if let HttpError::TooLarge { .. } = e {
        return Ok(CallToolResult::error(vec![ContentBlock::text(e.to_string())]));
    }
    let Some(status) = e.status() else { return Err(ErrorData::internal_error(with_causes(&e), None)) };
    let mut text = format!("refused: {}", e.summary());
    if let Some(kind) = e.problem().map(|p| p.kind.as_str()).filter(|k| !k.is_empty()) {
        text.push_str(&format!(" [{kind}]"));
    }
    if let Some(s) = e.problem().and_then(|p| p.retry_after) {
        text.push_str(&format!(" (retry after {s} s)"));
    }
    if status == 404 && e.problem().is_none_or(|p| p.detail.is_empty()) {
        text.push_str(" (no such thing for this key)");
    }
    Ok(CallToolResult::error(vec![ContentBlock::text(text)]))
}

/// `e` with its sources (a transport's cause is not in its own message).
pub(crate) fn with_causes(e: &HttpError) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// A task id that names no job of the key: JSON-RPC invalid params (the extension's error for
/// an unknown task).
pub(crate) fn no_task(id: &str, e: &HttpError) -> ErrorData {
    if e.is_not_found() || e.is_bad_request() {
        ErrorData::invalid_params(format!("no task {id} for this key"), None)
    } else {
        ErrorData::internal_error(with_causes(e), None)
    }
}
