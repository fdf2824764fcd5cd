//! sandq's Rust clients, each behind a feature (both on by default):
//! - `direct`: [`Client`] uploads inputs to S3, submits jobs to the broker with publisher
//!   confirms, waits for and reads results in Redis, cancels jobs and downloads artifacts;
//!   [`notebook`] exports finished jobs as a Jupyter notebook. It is built on `sandq-core`
//!   (configuration, broker, Redis, S3).
//! - `http`: [`http::HttpClient`] does the same and more (sessions, files) through the HTTP
//!   gateway (`sandq-gateway`) with an API key; the MCP server (`sandq-mcp`) and the gateway's
//!   E2B API use it too. It needs no broker, Redis or S3 crate.
//!
//! The `sandq` CLI (`submitter/`) is a thin binary over both.

#[cfg(all(feature = "direct", feature = "http"))]
pub mod backend;
#[cfg(feature = "direct")]
pub mod client;
#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "direct")]
pub mod notebook;

#[cfg(all(feature = "direct", feature = "http"))]
pub use backend::{Backend, BackendError, Target};
#[cfg(feature = "direct")]
pub use client::{Client, ClientError, Unserved};
#[cfg(feature = "http")]
pub use http::{HttpClient, HttpError};
pub use sandq_schemas::events::{Event, EventKind, Transcript};
