//! `sandq-gateway`: the HTTP front door. Tenants call a versioned JSON API (`/v1`) with an API
//! key; the gateway checks the key and its quotas, scopes every id to the key's tenant, and is
//! otherwise one more client of the queue: it publishes jobs with the Rust client, reads
//! results and live events from Redis. It keeps no state of its own (any number of replicas).
//!
//! This file is the crate's map; it declares and maps, and no module imports it. Where a
//! request goes:
//!
//! - [`serve`] accepts the connection (header time-out) and hands the request to the
//!   [`router`], whose routes all pass [`observe`] first (the bound on requests under way,
//!   metrics, one audit line).
//! - REST (`/v1`): [`auth::Caller`] checks the key, then the handler: [`jobs`] (submit, get
//!   with `?wait`, cancel, live events as SSE), [`files`] (uploads, artifacts, outputs, logs),
//!   [`sessions`]; with [`body`] (bounded bodies), [`quota`], [`scope`] (a tenant's ids) and
//!   [`webhooks`]. Each answers the result or a [`problem::Problem`]; [`openapi`] describes
//!   them.
//! - `/mcp` ([`mcp`], behind [`rebinding`]'s `Origin`/`Host` check) and E2B's routes ([`e2b`])
//!   turn their credential into a key and call the REST routes in-process ([`in_process`]).
//! - `/metrics` is served on the operator's listener only ([`router::operator_router`]).
//! - What they all share is [`state::Gateway`] (config, Redis, S3, publishers, stream and
//!   request bounds) and [`metrics`]; a leaf, like [`problem`], [`auth`] and [`settings`].
//! - Beside the requests, two tasks `main.rs` starts: webhook deliveries
//!   ([`dispatch_webhooks`]) and the E2B reaper ([`reap_e2b`]).
#![warn(unreachable_pub)]

mod auth;
mod body;
mod e2b;
mod files;
mod in_process;
mod jobs;
mod mcp;
mod metrics;
mod observe;
mod openapi;
mod problem;
mod quota;
mod rebinding;
mod router;
mod scope;
mod serve;
mod sessions;
pub mod settings;
mod state;
mod webhooks;

pub use e2b::reap as reap_e2b;
pub use router::{operator_router, router};
pub use serve::serve;
pub use state::{Gateway, StartError};
pub use webhooks::dispatch as dispatch_webhooks;
