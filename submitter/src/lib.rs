//! sandq's client library (and the pieces the worker shares with it): service configuration,
//! the broker topology, S3 transfers, the Redis result store, and [`client::Client`], which
//! uploads inputs, submits jobs with publisher confirms and waits for results.
//!
//! The `sandq` CLI (`src/main.rs`) is a thin layer over [`client::Client`].

pub mod broker;
pub mod client;
pub mod config;
pub mod notebook;
pub mod redis_conn;
pub mod results;
pub mod sessions;
pub mod storage;
pub mod topology;

pub use client::{Client, ClientError};
