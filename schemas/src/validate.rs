//! Checks a decoded [`JobSpec`] against the worker's [`Limits`] before anything is staged.
//!
//! A job that fails here is `rejected` with the error's message as `reason` and never retried.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::{JobSpec, NetworkMode, SCHEMA_VERSION};

/// Limits a job must fit. The defaults are the product's (60 s default timeout) or sizes that
/// keep one job message and its staging bounded; the worker's config can change each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Timeout of a job that names none: 60 s (product brief).
    pub default_timeout: Duration,
    /// Largest timeout a job may ask for: 15 min.
    pub max_timeout: Duration,
    /// Result TTL of a job that names none: 24 h (Celery's default is 1 day).
    pub default_result_ttl: Duration,
    /// Largest result TTL: 7 days (also the longest SigV4 presigned URL).
    pub max_result_ttl: Duration,
    /// Largest `code`, bytes: 1 MiB.
    pub max_code_bytes: usize,
    /// Largest `stdin`, bytes: 8 MiB.
    pub max_stdin_bytes: usize,
    /// Most input files: 1,000 (a body with more is refused while it is decoded, whatever this
    /// says: [`crate::de::MAX_INPUTS`]).
    pub max_inputs: usize,
    /// Largest total size of the input files, bytes: 1 GiB.
    pub max_input_bytes: u64,
    /// Most `env` entries: 128 (more are refused while decoding: [`crate::de::MAX_ENV`]).
    pub max_env: usize,
    /// Most `args`: 1,024 (more are refused while decoding: [`crate::de::MAX_ARGS`]).
    pub max_args: usize,
    /// Whether `network: "outbound"` is served (the worker's `outbound_network`).
    pub outbound_network: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            default_timeout: Duration::from_secs(60),
            max_timeout: Duration::from_secs(15 * 60),
            default_result_ttl: Duration::from_secs(24 * 3600),
            max_result_ttl: Duration::from_secs(7 * 24 * 3600),
            max_code_bytes: 1 << 20,
            max_stdin_bytes: 8 << 20,
            max_inputs: crate::de::MAX_INPUTS,
            max_input_bytes: 1 << 30,
            max_env: crate::de::MAX_ENV,
            max_args: crate::de::MAX_ARGS,
            outbound_network: true,
        }
    }
}

/// A job that passed [`JobSpec::validate`], with its durations parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidJob {
    /// The job as published.
    pub spec: JobSpec,
    /// Wall-clock limit of the program.
    pub timeout: Duration,
    /// How long the result stays in Redis.
    pub result_ttl: Duration,
}

/// Why a job was rejected. Messages are lower-case, name the offending field and value, and are
/// what the client reads in `reason`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    /// `schema_version` is not one this worker speaks.
    #[error("schema_version {found} is not supported (this worker speaks {expected})")]
    SchemaVersion {
        /// Version in the message.
        found: u32,
        /// Version this build speaks.
        expected: u32,
    },
    /// `job_id` is empty, too long or has a character outside `[A-Za-z0-9_-]`.
    #[error("job_id {id:?} is invalid: {reason}")]
    JobId {
        /// The id as sent.
        id: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Neither or both of `code` and `entrypoint` are set.
    #[error("exactly one of code and entrypoint must be set")]
    Source,
    /// `code` is larger than [`Limits::max_code_bytes`].
    #[error("code is {size} bytes, more than the limit of {max}")]
    CodeTooLarge {
        /// Size of `code`, bytes.
        size: usize,
        /// The limit, bytes.
        max: usize,
    },
    /// `stdin` is larger than [`Limits::max_stdin_bytes`].
    #[error("stdin is {size} bytes, more than the limit of {max}")]
    StdinTooLarge {
        /// Size of `stdin`, bytes.
        size: usize,
        /// The limit, bytes.
        max: usize,
    },
    /// An input path or the entrypoint is not a safe relative path.
    #[error("path {path:?} is invalid: {reason}")]
    Path {
        /// The path as sent.
        path: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Two inputs have the same path, or one's path is a directory of another's.
    #[error("input path {path:?} clashes with another input")]
    PathClash {
        /// The second of the two paths.
        path: String,
    },
    /// An input's `sha256` is not 64 lower-case hex digits.
    #[error("input {path:?} has an invalid sha256 {sha256:?}: expected 64 lower-case hex digits")]
    Sha256 {
        /// The input's path.
        path: String,
        /// The digest as sent.
        sha256: String,
    },
    /// An input's `key` is not `inputs/sha256/<its sha256>` or
    /// `inputs/tenant/<tenant>/sha256/<its sha256>` (inputs come only from the upload areas).
    #[error("input {path:?} has an invalid S3 key: expected inputs/sha256/<its sha256> or inputs/tenant/<tenant>/sha256/<its sha256>")]
    InputKey {
        /// The input's path.
        path: String,
    },
    /// More inputs than [`Limits::max_inputs`] or more bytes than [`Limits::max_input_bytes`].
    #[error("inputs exceed the limits: {count} files / {bytes} bytes (at most {max_count} / {max_bytes})")]
    InputsTooLarge {
        /// Number of inputs.
        count: usize,
        /// Their total size, bytes.
        bytes: u64,
        /// The limit on the count.
        max_count: usize,
        /// The limit on the bytes.
        max_bytes: u64,
    },
    /// `entrypoint` does not name one of the inputs.
    #[error("entrypoint {path:?} is not one of the inputs")]
    EntrypointMissing {
        /// The entrypoint as sent.
        path: String,
    },
    /// A duration field is not a humantime duration.
    #[error("{field} {value:?} is not a duration such as \"60s\" or \"2m 30s\": {message}")]
    Duration {
        /// Field name.
        field: &'static str,
        /// The value as sent.
        value: String,
        /// humantime's message.
        message: String,
    },
    /// A duration is zero or above its limit.
    #[error("{field} {value:?} is out of range: must be above 0 and at most {max}")]
    DurationRange {
        /// Field name.
        field: &'static str,
        /// The value as sent.
        value: String,
        /// The limit, humantime.
        max: String,
    },
    /// An `env` name is invalid or reserved, or there are too many.
    #[error("env {name:?} is not allowed: {reason}")]
    Env {
        /// The variable's name.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// More `args` than [`Limits::max_args`], or one holds a NUL byte.
    #[error("args are invalid: {reason}")]
    Args {
        /// What is wrong with them.
        reason: &'static str,
    },
    /// The network mode is not served by this worker.
    #[error("network mode {mode:?} is not served by this worker")]
    Network {
        /// The mode as sent.
        mode: NetworkMode,
    },
    /// The session name is not 1 to 64 of `[A-Za-z0-9_.-]` or starts with `.`.
    #[error("session name {name:?} is not 1 to 64 of [A-Za-z0-9_.-] not starting with '.'")]
    Session {
        /// The name as sent.
        name: String,
    },
    /// TypeScript (`dialect`) on another runtime than Node.js, or in script mode.
    #[error("dialect typescript needs runtime node in notebook mode")]
    Dialect,
    /// The context name is not 1 to 64 of `[A-Za-z0-9_.-]` (or starts with `.`), or the job
    /// names a context but no session.
    #[error("context {name:?}: {reason}")]
    Context {
        /// The name as sent.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// Environment variables the sandbox sets itself; a job cannot override them. Besides these,
/// every `SANDQ_*` and every `LD_*` name (the dynamic loader's) is refused.
pub const RESERVED_ENV: &[&str] = &["PATH", "HOME", "PWD", "MPLCONFIGDIR", "TMPDIR"];

/// The kernel's limit on one argv or environment string, including its NUL (`MAX_ARG_STRLEN`,
/// 32 pages of 4 KiB: `include/uapi/linux/binfmts.h`).
pub const MAX_ARG_STRLEN: usize = 32 * 4096;

/// Most bytes of `args` and `env` together (each string with its NUL): the kernel allows a
/// quarter of the stack rlimit (2 MiB of the usual 8 MiB); half of that leaves room for the
/// sandbox's own variables and the interpreter's arguments.
pub const MAX_EXEC_BYTES: usize = 1 << 20;

/// Checks a job id: 1 to 64 characters of `[A-Za-z0-9_-]`.
///
/// # Errors
/// [`ValidationError::JobId`] with the reason.
pub fn check_job_id(id: &str) -> Result<(), ValidationError> {
    let bad = |reason| Err(ValidationError::JobId { id: id.chars().take(80).collect(), reason });
    if id.is_empty() {
        return bad("it is empty");
    }
    if id.len() > 64 {
        return bad("it is longer than 64 characters");
    }
    if !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return bad("only A-Z, a-z, 0-9, '_' and '-' are allowed");
    }
    Ok(())
}

/// Checks a session name: 1 to 64 of `[A-Za-z0-9_.-]`, not starting with `.` (it becomes
/// part of S3 keys and Redis keys).
///
/// # Errors
/// [`ValidationError::Session`].
pub fn check_session_name(name: &str) -> Result<(), ValidationError> {
    let valid = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if valid {
        Ok(())
    } else {
        Err(ValidationError::Session { name: name.chars().take(100).collect() })
    }
}

/// Longest path relative to `/work` an input, artifact or session file may have, bytes.
pub const MAX_PATH_BYTES: usize = crate::paths::MAX_PATH_BYTES;

/// Checks a path relative to `/work` (inputs, entry points, restored session files,
/// artifacts) by the one rule, [`crate::paths::check_session_path`]: non-empty, at most
/// [`MAX_PATH_BYTES`], `/`-separated components that are not empty, `.` or `..`, each at most
/// 255 bytes, without NUL or backslash.
///
/// # Errors
/// [`ValidationError::Path`] with the reason.
pub fn check_relative_path(path: &str) -> Result<(), ValidationError> {
    crate::paths::check_session_path(path)
        .map(drop)
        .map_err(|e| ValidationError::Path { path: crate::paths::clipped(path), reason: e.reason() })
}

fn parse_duration(field: &'static str, value: Option<&str>, default: Duration, max: Duration) -> Result<Duration, ValidationError> {
    let Some(value) = value else { return Ok(default) };
    let parsed = humantime::parse_duration(value).map_err(|e| ValidationError::Duration {
        field,
        value: value.chars().take(80).collect(),
        message: e.to_string(),
    })?;
    if parsed.is_zero() || parsed > max {
        return Err(ValidationError::DurationRange { field, value: value.to_owned(), max: humantime::format_duration(max).to_string() });
    }
    Ok(parsed)
}

impl JobSpec {
    /// Checks every field against `limits`; returns the job with its durations parsed.
    ///
    /// # Errors
    /// The first [`ValidationError`] found, fields checked in declaration order.
    pub fn validate(self, limits: &Limits) -> Result<ValidJob, ValidationError> {
        if self.schema_version != SCHEMA_VERSION {
            return Err(ValidationError::SchemaVersion { found: self.schema_version, expected: SCHEMA_VERSION });
        }
        check_job_id(&self.job_id)?;
        match (&self.code, &self.entrypoint) {
            (Some(code), None) if code.len() > limits.max_code_bytes => {
                return Err(ValidationError::CodeTooLarge { size: code.len(), max: limits.max_code_bytes })
            }
            (Some(_), None) | (None, Some(_)) => {}
            _ => return Err(ValidationError::Source),
        }
        if self.args.len() > limits.max_args {
            return Err(ValidationError::Args { reason: "too many" });
        }
        if self.args.iter().any(|a| a.contains('\0')) {
            return Err(ValidationError::Args { reason: "an argument contains a NUL byte" });
        }
        // execve(2) refuses (E2BIG) a single string over MAX_ARG_STRLEN and a total over a
        // quarter of the stack limit: say so here rather than fail in the sandbox with exit
        // 255 and no reason.
        if self.args.iter().any(|a| a.len() >= MAX_ARG_STRLEN) {
            return Err(ValidationError::Args { reason: "an argument is 128 KiB or longer (the kernel's MAX_ARG_STRLEN)" });
        }
        let exec_bytes =
            self.args.iter().map(|a| a.len() + 1).sum::<usize>() + self.env.iter().map(|(k, v)| k.len() + v.len() + 2).sum::<usize>();
        if exec_bytes > MAX_EXEC_BYTES {
            return Err(ValidationError::Args { reason: "args and env together exceed 1 MiB" });
        }
        let total: u64 = self.inputs.iter().map(|i| i.size).fold(0, u64::saturating_add);
        if self.inputs.len() > limits.max_inputs || total > limits.max_input_bytes {
            return Err(ValidationError::InputsTooLarge {
                count: self.inputs.len(),
                bytes: total,
                max_count: limits.max_inputs,
                max_bytes: limits.max_input_bytes,
            });
        }
        let mut seen = BTreeSet::new();
        for input in &self.inputs {
            check_relative_path(&input.path)?;
            let hex_ok = input.sha256.len() == 64 && input.sha256.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
            if !hex_ok {
                return Err(ValidationError::Sha256 { path: input.path.clone(), sha256: input.sha256.clone() });
            }
            // Only the content-addressed upload area: a job must not stage another job's
            // artifacts, logs or session files by naming their keys.
            if !crate::names::is_input_key(&input.key, &input.sha256) {
                return Err(ValidationError::InputKey { path: input.path.clone() });
            }
            if !seen.insert(input.path.as_str()) {
                return Err(ValidationError::PathClash { path: input.path.clone() });
            }
        }
        // A path that is a directory prefix of another ("a" and "a/b") cannot be staged.
        if let Some((_, path)) = crate::paths::first_conflict(seen.iter().copied()) {
            return Err(ValidationError::PathClash { path: path.to_owned() });
        }
        if let Some(entry) = &self.entrypoint {
            check_relative_path(entry)?;
            if !seen.contains(entry.as_str()) {
                return Err(ValidationError::EntrypointMissing { path: entry.clone() });
            }
        }
        if let Some(stdin) = &self.stdin {
            if stdin.len() > limits.max_stdin_bytes {
                return Err(ValidationError::StdinTooLarge { size: stdin.len(), max: limits.max_stdin_bytes });
            }
        }
        if self.env.len() > limits.max_env {
            return Err(ValidationError::Env { name: String::new(), reason: "too many variables" });
        }
        for (name, value) in &self.env {
            let valid_name = !name.is_empty()
                && name.len() <= 256
                && !name.as_bytes()[0].is_ascii_digit()
                && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !valid_name {
                return Err(ValidationError::Env { name: name.clone(), reason: "names match [A-Za-z_][A-Za-z0-9_]*" });
            }
            if RESERVED_ENV.contains(&name.as_str()) || name.starts_with("SANDQ_") || name.starts_with("LD_") {
                return Err(ValidationError::Env { name: name.clone(), reason: "the sandbox sets it" });
            }
            if value.contains('\0') {
                return Err(ValidationError::Env { name: name.clone(), reason: "the value contains a NUL byte" });
            }
            if name.len() + value.len() + 1 >= MAX_ARG_STRLEN {
                return Err(ValidationError::Env {
                    name: name.clone(),
                    reason: "NAME=value is 128 KiB or longer (the kernel's MAX_ARG_STRLEN)",
                });
            }
        }
        if let Some(session) = &self.session {
            check_session_name(session)?;
        }
        if self.dialect == Some(crate::Dialect::Typescript)
            && (self.runtime != crate::Runtime::Node || self.run_mode() != crate::RunMode::Notebook)
        {
            return Err(ValidationError::Dialect);
        }
        if let Some(context) = &self.context {
            let name: String = context.chars().take(100).collect();
            if check_session_name(context).is_err() {
                return Err(ValidationError::Context { name, reason: "not 1 to 64 of [A-Za-z0-9_.-] not starting with '.'" });
            }
            if self.session.is_none() {
                return Err(ValidationError::Context { name, reason: "a context is a session's: name the session too" });
            }
        }
        if self.network == NetworkMode::Outbound && !limits.outbound_network {
            return Err(ValidationError::Network { mode: self.network });
        }
        let timeout = parse_duration("timeout", self.timeout.as_deref(), limits.default_timeout, limits.max_timeout)?;
        let result_ttl = parse_duration("result_ttl", self.result_ttl.as_deref(), limits.default_result_ttl, limits.max_result_ttl)?;
        Ok(ValidJob { spec: self, timeout, result_ttl })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{InputFile, Runtime, Sku};

    fn job() -> JobSpec {
        JobSpec::new("job-1", Sku::M, Runtime::Python, "print(1)")
    }

    fn input(path: &str) -> InputFile {
        InputFile { key: format!("inputs/sha256/{}", "a".repeat(64)), path: path.into(), size: 1, sha256: "a".repeat(64) }
    }

    #[test]
    fn inputs_come_only_from_the_content_addressed_area() {
        let mut j = job();
        j.inputs = vec![input("data.csv")];
        assert!(j.clone().validate(&Limits::default()).is_ok());
        let mut tenants = j.clone();
        tenants.inputs[0].key = crate::names::tenant_input_key("acme", &"a".repeat(64));
        assert!(tenants.validate(&Limits::default()).is_ok(), "a tenant's upload area");
        let other = format!("inputs/tenant/acme/sha256/{}", "b".repeat(64));
        for key in ["sessions/sandq/victim/manifest.json", "jobs/other/artifacts/secret.txt", "inputs/sha256/x", other.as_str()] {
            let mut j = j.clone();
            j.inputs[0].key = key.into();
            assert!(matches!(j.validate(&Limits::default()), Err(ValidationError::InputKey { .. })), "{key}");
        }
    }

    #[test]
    fn sessions_and_modes_are_checked() {
        for name in ["a", "notebook-1.v2", &"x".repeat(64)] {
            let mut j = job();
            j.session = Some(name.to_owned());
            assert!(j.validate(&Limits::default()).is_ok(), "{name}");
        }
        for name in ["", ".hidden", "..", "a/b", "a b", &"x".repeat(65), "ü"] {
            let mut j = job();
            j.session = Some(name.to_owned());
            assert!(matches!(j.validate(&Limits::default()), Err(ValidationError::Session { .. })), "{name:?}");
        }
        // A context is a session's, with a session name's characters.
        let mut j = job();
        j.context = Some("c1".to_owned());
        assert!(matches!(j.clone().validate(&Limits::default()), Err(ValidationError::Context { .. })));
        j.session = Some("s".to_owned());
        assert!(j.clone().validate(&Limits::default()).is_ok());
        j.context = Some("a/b".to_owned());
        assert!(matches!(j.validate(&Limits::default()), Err(ValidationError::Context { .. })));
        // Both runtimes have both modes; notebook is the default of each.
        for runtime in [Runtime::Python, Runtime::Node] {
            let mut j = job();
            j.runtime = runtime;
            assert_eq!(j.run_mode(), crate::RunMode::Notebook, "{runtime:?}");
            for mode in [crate::RunMode::Notebook, crate::RunMode::Script] {
                j.mode = Some(mode);
                assert_eq!(j.run_mode(), mode);
                assert!(j.clone().validate(&Limits::default()).is_ok(), "{runtime:?} {mode:?}");
            }
        }
    }

    #[test]
    fn defaults_apply() {
        let valid = job().validate(&Limits::default()).expect("valid");
        assert_eq!(valid.timeout, Duration::from_secs(60));
        assert_eq!(valid.result_ttl, Duration::from_secs(86400));
    }

    #[test]
    fn humantime_timeout_is_parsed_and_bounded() {
        let mut j = job();
        j.timeout = Some("2m 30s".into());
        assert_eq!(j.validate(&Limits::default()).expect("valid").timeout, Duration::from_secs(150));
        let mut j = job();
        j.timeout = Some("16m".into());
        assert!(matches!(j.validate(&Limits::default()), Err(ValidationError::DurationRange { field: "timeout", .. })));
        let mut j = job();
        j.timeout = Some("soon".into());
        assert!(matches!(j.validate(&Limits::default()), Err(ValidationError::Duration { field: "timeout", .. })));
        let mut j = job();
        j.timeout = Some("0s".into());
        assert!(matches!(j.validate(&Limits::default()), Err(ValidationError::DurationRange { .. })));
    }

    #[test]
    fn bad_paths_are_rejected() {
        for path in ["", "/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a/.", "a\\b", "a\0b"] {
            let mut j = job();
            j.inputs = vec![input(path)];
            let err = j.validate(&Limits::default()).expect_err(path);
            assert!(matches!(err, ValidationError::Path { .. }), "{path:?}: {err}");
        }
        let mut j = job();
        j.inputs = vec![input("data/x.csv"), input("data/y.csv")];
        j.validate(&Limits::default()).expect("nested paths are fine");
    }

    #[test]
    fn clashing_paths_are_rejected() {
        let mut j = job();
        j.inputs = vec![input("a"), input("a")];
        assert!(matches!(j.validate(&Limits::default()), Err(ValidationError::PathClash { .. })));
        let mut j = job();
        j.inputs = vec![input("a/b/c"), input("a/b")];
        assert!(matches!(j.validate(&Limits::default()), Err(ValidationError::PathClash { .. })));
    }

    #[test]
    fn job_ids_are_checked() {
        for id in ["", "a b", "x/y", "ü", &"a".repeat(65)] {
            assert!(check_job_id(id).is_err(), "{id:?}");
        }
        check_job_id("0c6f2b1e-0c1b-4b53-9a55-8f3f5bd1d3a4").expect("uuid is fine");
    }

    #[test]
    fn source_must_be_exactly_one() {
        let mut j = job();
        j.code = None;
        assert_eq!(j.validate(&Limits::default()), Err(ValidationError::Source));
        let mut j = job();
        j.entrypoint = Some("main.py".into());
        assert_eq!(j.validate(&Limits::default()), Err(ValidationError::Source));
        let mut j = job();
        j.code = None;
        j.entrypoint = Some("main.py".into());
        assert!(matches!(j.validate(&Limits::default()), Err(ValidationError::EntrypointMissing { .. })));
    }

    #[test]
    fn reserved_env_is_refused() {
        // Every LD_* name, not only LD_PRELOAD and LD_LIBRARY_PATH: the dynamic loader reads
        // others (LD_AUDIT loads a library too).
        for name in ["PATH", "SANDQ_X", "1A", "A-B", "", "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "LD_BIND_NOW"] {
            let mut j = job();
            j.env.insert(name.into(), "v".into());
            assert!(matches!(j.validate(&Limits::default()), Err(ValidationError::Env { .. })), "{name}");
        }
        let mut j = job();
        j.env.insert("OLD_VALUE".into(), "v".into());
        assert!(j.validate(&Limits::default()).is_ok(), "LD_ only as a prefix");
    }

    /// What execve(2) would refuse with E2BIG is rejected with a reason instead of failing in
    /// the sandbox with exit 255; the kernel's limits are 131,072 bytes a
    /// string (with its NUL) and a quarter of the 8 MiB stack in all.
    #[test]
    fn what_execve_refuses_is_rejected_up_front() {
        let limits = Limits::default();
        let mut j = job();
        j.args = vec!["a".repeat(131_072)];
        assert!(matches!(j.clone().validate(&limits), Err(ValidationError::Args { .. })), "131,073 bytes with its NUL");
        j.args = vec!["a".repeat(131_071)];
        assert!(j.clone().validate(&limits).is_ok(), "131,072 bytes with its NUL fits");
        j.args = vec!["a".repeat(100_000); 11];
        assert!(matches!(j.validate(&limits), Err(ValidationError::Args { .. })), "1.1 MB of arguments");
        let mut j = job();
        j.env.insert("BIG".into(), "v".repeat(200_000));
        let err = j.clone().validate(&limits).expect_err("a 200 kB value");
        assert_eq!(err.to_string(), "env \"BIG\" is not allowed: NAME=value is 128 KiB or longer (the kernel's MAX_ARG_STRLEN)");
        j.env.insert("BIG".into(), "v".repeat(3 << 20));
        let err = j.validate(&limits).expect_err("a 3 MB value");
        assert_eq!(err.to_string(), "args are invalid: args and env together exceed 1 MiB");
    }

    proptest::proptest! {
        /// Any path the checker accepts stays beneath its root when joined, component by
        /// component (checked independently of the checker's own rules).
        #[test]
        fn accepted_paths_stay_beneath(path in "[a-z./]{0,12}") {
            if check_relative_path(&path).is_ok() {
                let mut depth: i32 = 0;
                for c in std::path::Path::new(&path).components() {
                    match c {
                        std::path::Component::Normal(_) => depth += 1,
                        std::path::Component::ParentDir => depth -= 1,
                        _ => proptest::prop_assert!(false, "unexpected component in {path:?}"),
                    }
                    proptest::prop_assert!(depth > 0);
                }
            }
        }
    }
}
