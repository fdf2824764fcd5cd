//! Wire types of the sandq job protocol, shared by the worker, the Rust submitter and (through
//! `docs/protocol.md`) clients in any other language.
//!
//! Every message is MessagePack with **named fields** (`rmp_serde::to_vec_named`), so a client in
//! another language reads and writes plain maps with string keys. Enums are plain strings
//! (`"M"`, `"python"`, `"succeeded"`).
//!
//! - [`JobSpec`]: what a client publishes to RabbitMQ (one job per message).
//! - [`JobResult`] and [`JobStatus`]: what the worker writes to Redis, read back by clients.
//! - [`names`]: exchange, queue and routing names, Redis keys, S3 key layout.
//! - [`protocol`]: protocol text used verbatim in every language (the compare-and-set script).
//! - [`paths`]: the one rule for a path under `/work` (session files, inputs, artifacts).
//! - [`validate`]: limits and the checks every job passes before it is staged.
//! - [`de`]: the lenient field decoders (nil is absent; integers of any width, or integral
//!   floats), whose errors name the field.

mod codec;
pub mod de;
pub mod events;
pub mod job;
mod keys;
pub mod names;
pub mod paths;
pub mod protocol;
pub mod result;
pub mod validate;
mod version;

pub use codec::{decode, encode, peek_job_id, DecodeError, EncodeError, CONTENT_TYPE, MAX_DEPTH};
pub use job::{Compat, Dialect, InputFile, JobSpec, NetworkMode, RunMode, Runtime, Sku};
pub use result::{
    Artifact, CapturedOutput, ErrorInfo, ImageSize, JobResult, JobStatus, MimeValue, Output, OutputType, ResourceUsage, SandboxStart,
    SessionInfo, SessionState, SkippedArtifact, TableShape, UnsavedVariable,
};
pub use validate::{Limits, ValidJob, ValidationError};
pub use version::SCHEMA_VERSION;
