//! sandq's shared infrastructure, used by the worker, the Rust client and every other binary:
//! which addresses a tenant's requests may reach ([`addr`]),
//! service configuration ([`config`]), broker connections and the queue topology ([`broker`],
//! [`topology`]), the Redis connection and the result store ([`redis_conn`], [`results`]),
//! session manifests and locks ([`sessions`]), S3 transfers ([`storage`]) and the clock
//! ([`time`]).
//!
//! Nothing here is a client or a CLI: the Rust client is `sandq-client` (`client/`), the
//! `sandq` CLI is `submitter/`, and the worker is `worker/`; each depends on this crate, and
//! this crate on `sandq-schemas` only.

pub mod addr;
pub mod broker;
pub mod config;
pub mod events;
pub mod fair;
pub mod keys;
pub mod redis_conn;
pub mod results;
pub mod sessions;
pub mod storage;
pub mod time;
pub mod topology;
