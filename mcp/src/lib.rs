//! sandq as a Model Context Protocol server (docs/mcp.md), on the official Rust SDK (`rmcp`).
//!
//! The server is a client of the gateway's REST API (docs/gateway.md), never of the queue
//! directly: every tool call is one or more REST requests made with the caller's API key, so
//! the key's tenant, quotas, audit lines and id scoping apply to MCP exactly as to HTTP. Two
//! transports carry it:
//! - streamable HTTP at `/mcp` on the gateway, where the REST requests go in-process to the
//!   gateway's own router (no network hop) with the bearer key of the MCP request;
//! - stdio (`sandq mcp`), where they go over HTTP to a gateway URL with the local key.
//!
//! A tool call's path: [`server::Sandq`] (the tool, its arguments) ->
//! [`sandq_client::http::HttpClient`] (the REST requests; the client's `http` feature only, so
//! no broker, Redis or S3 crate) -> [`sandq_client::http::Transport`] (in-process or HTTP) ->
//! [`content`] (the result as MCP content a model reads well: text, markdown tables, images,
//! resource links).

pub mod content;
mod refusal;
pub mod server;

pub use server::Sandq;
