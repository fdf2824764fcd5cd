//! sandq's worker: consumes jobs from RabbitMQ and runs each in a youki (libcontainer)
//! sandbox. The job lifecycle is one module per stage:
//!
//! consume -> validate -> stage -> run -> collect -> publish -> ack
//!
//! [`consume`] takes deliveries; [`validate`] decodes and checks them; [`stage`] fetches the
//! inputs from S3 into a fresh work dir; [`run`] runs the program in a container through the
//! single-threaded helper ([`sandbox`]); [`collect`] uploads what the program left in `/work`;
//! [`publish`] writes the result to Redis; [`ack`] is the one place that decides ack, requeue
//! or dead-letter for every outcome. [`job`] strings the stages together for one delivery.
//! [`dead_letter`] gives every job the broker dead-lettered (unserved, or a poison message)
//! its terminal result.
//! [`metrics`] records what happens on the way; [`health`] serves it, with liveness and
//! readiness, over HTTP.

pub mod ack;
pub mod capacity;
pub mod collect;
pub mod consume;
pub mod dead_letter;
pub mod health;
pub mod job;
pub mod metrics;
pub mod publish;
pub mod outputs;
pub mod packages;
pub mod run;
pub mod sandbox;
pub mod session;
pub mod settings;
pub mod stage;
pub mod sys;
pub mod validate;
pub mod warm;
