//! `sandq mcp`: the MCP server (docs/mcp.md) over stdio, for desktop assistants and IDEs that
//! start it as a child process. Its tools call a gateway (`--url`, `SANDQ_URL`) with the local
//! API key (`--api-key`, `SANDQ_API_KEY`): an assistant gets a tenant's key and quotas, never
//! the queue's operator credentials. Standard output carries only the protocol; logs go to
//! standard error.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use rmcp::ServiceExt as _;
use sandq_client::http::HttpTransport;
use sandq_mcp::server::KeySource;

/// Serves MCP on stdin and stdout until the client closes stdin.
///
/// # Errors
/// When the HTTP client cannot be built or the MCP session fails to start.
pub async fn serve(url: &str, key: &str) -> anyhow::Result<()> {
    // No overall time-out: an event stream or a long job's wait stays open; connects are bounded.
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(Duration::from_secs(10))
        .build()
        .context("building the HTTP client")?;
    let transport = Arc::new(HttpTransport::new(url, http.clone()));
    let server = sandq_mcp::Sandq::new(transport, KeySource::Fixed(key.to_owned()), http);
    let running = server.serve(rmcp::transport::stdio()).await.context("starting the MCP session on stdio")?;
    running.waiting().await.context("serving MCP")?;
    Ok(())
}
