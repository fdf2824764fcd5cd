//! sandq's worker: consumes jobs from RabbitMQ and runs each in a youki (libcontainer)
//! sandbox. One delivery's life is [`job::process`], a function that lists its steps in order:
//!
//! validate -> admit -> session -> reserve -> launch (warm or cold) -> run -> collect -> conclude,
//! then [`consume`] settles the delivery as [`ack::classify`] says.
//!
//! | module | what it does |
//! |---|---|
//! | [`consume`] | connections, one consumer per slot and SKU, reconnects; hands each delivery to [`job`] |
//! | [`validate`] | decodes and checks a message against the worker's limits |
//! | [`job`] | the pipeline of one delivery (its steps: `job/admit`, `launch`, `watch`, `collect`, `conclude`) |
//! | [`context`] | what every task shares ([`context::Context`]), and the job ids running here |
//! | [`capacity`] | the worker's cores and memory, reserved per job by its SKU |
//! | [`session`] | a session's lock, files, notebook state and packages: opened before, saved after; its reaper |
//! | [`jobdir`], [`layout`] | a job's directory on the host; the sandbox's file contract (`/sandq`) |
//! | [`stage`], [`placed`] | code, stdin, session files and inputs from S3 into the job dir; what was placed, as later steps trust it |
//! | [`warm`] | sandboxes started ahead of their job, their refill, and the pre-imported templates forked starts come from |
//! | [`run`], [`sandbox`] | the single-threaded helper that runs one container with libcontainer |
//! | [`artifacts`], [`outputs`] | files left in `/work` -> S3; the notebook's rich outputs |
//! | [`live`] | the job's live events while it runs (stdout, stderr, displays, lifecycle) to its Redis Stream, best effort |
//! | [`publish`] | the JobResult and its compare-and-set write to Redis |
//! | [`fair`] | a fair share of each SKU's slots between tenants: a job whose tenant runs more than a waiting tenant goes round the queue |
//! | [`ack`] | the one place that turns an outcome into ack, requeue or dead-letter |
//! | [`dead_letter`] | gives every job the broker dead-lettered its terminal result |
//! | [`settings`], [`packages`], [`host`] | configuration; package indexes and CAs; start-up on the host |
//! | [`service`] | connects, spawns the long-lived tasks, consumes until shutdown |
//! | [`metrics`], [`health`] | Prometheus metrics; `/metrics`, `/healthz`, `/readyz` |
//! | [`sys`] | every `unsafe` block and raw syscall |
#![warn(unreachable_pub)]

//!
//! Outside the crate: the `sandq-worker` binary uses [`settings`], [`host::prepare`] and
//! [`service::run`]; the `sandq-container` helper and the container-cycle benchmark use
//! [`sandbox`]. Everything else is `pub(crate)`.

pub(crate) mod ack;
pub(crate) mod artifacts;
pub(crate) mod capacity;
pub(crate) mod consume;
pub(crate) mod context;
pub(crate) mod dead_letter;
pub(crate) mod fair;
pub(crate) mod health;
pub mod host;
pub(crate) mod job;
pub(crate) mod jobdir;
pub(crate) mod layout;
pub(crate) mod live;
pub(crate) mod metrics;
pub(crate) mod outputs;
pub(crate) mod packages;
pub(crate) mod placed;
pub(crate) mod publish;
pub(crate) mod run;
pub mod sandbox;
pub mod service;
pub(crate) mod session;
pub mod settings;
pub(crate) mod stage;
pub(crate) mod sys;
pub(crate) mod validate;
pub(crate) mod warm;
