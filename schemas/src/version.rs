//! The wire format's version.

/// Version of the wire format written in `schema_version` of every [`crate::JobSpec`] and [`crate::JobResult`].
///
/// A worker rejects a job whose version it does not know (`rejected`, reason names the versions).
pub const SCHEMA_VERSION: u32 = 1;
