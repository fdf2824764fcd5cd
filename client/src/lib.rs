//! sandq's Rust client: [`Client`] uploads inputs to S3, submits jobs to the broker with
//! publisher confirms, waits for and reads results in Redis, cancels jobs and downloads
//! artifacts; [`HttpClient`] does the same through the HTTP gateway (`sandq-gateway`) with an
//! API key; [`notebook`] exports finished jobs as a Jupyter notebook.
//!
//! It is built on `sandq-core` (configuration, broker, Redis, S3); the `sandq` CLI
//! (`submitter/`) is a thin binary over it.

pub mod backend;
pub mod client;
pub mod http;
pub mod notebook;

pub use backend::{Backend, BackendError, Target};
pub use client::{Client, ClientError, Unserved};
pub use http::{HttpClient, HttpError};
pub use sandq_core::events::{Event, EventKind, Transcript};
