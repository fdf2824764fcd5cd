//! What is placed in `/work` before the program runs, as the stages after it see it: a session
//! file to restore ([`Restore`]) and how staging left each placed file ([`Stamp`], [`Staged`]),
//! which artifact collection and the session save trust without reading the file again.

/// A session file to restore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Restore {
    /// Path relative to `/work` (checked again like an input path).
    pub path: String,
    /// S3 key of the content.
    pub key: String,
    /// Size, bytes.
    pub size: u64,
    /// SHA-256, hex.
    pub sha256: String,
}

/// The placed files of a job (path relative to `/work` -> how staging left it): what
/// collection may trust without reading the file again ([`Stamp`]).
pub(crate) type Staged = std::collections::BTreeMap<String, Stamp>;

/// How staging left a file: its identity, size and times. Collection hashes a staged file again
/// only when its stamp changed, so inputs are not hashed twice (worker CPU proportional to the
/// inputs' size; test: collection_reads_only_what_the_program_changed in tests/metrics.rs).
/// Any write, truncation, hole punch, `utimes`,
/// `chmod`, `chown` or rename sets a file's ctime to the current time, which the program cannot
/// choose, and [`settle`] makes that time later than any staged file's ctime: an unchanged stamp
/// means unchanged content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp {
    /// Device and inode.
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
    /// Size, bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i128,
    /// Status change time, nanoseconds since the epoch.
    pub ctime_ns: i128,
}

impl Stamp {
    /// The stamp of `meta` (from `fstat` of an open file, or `fstatat` without following).
    pub(crate) fn of(meta: &std::fs::Metadata) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.len(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
        }
    }
}
