//! The one rule for a file path under a job's `/work`: a session file (written by a job, a
//! `PUT /v1/sessions/{name}/files/{path}`, an E2B write or MCP's `upload_file`), a job's input
//! (`inputs[].path`), and the path an artifact is collected under.
//!
//! Two checks:
//! - [`check_session_path`], one path alone: what the worker can create beneath `/work` on any
//!   Linux file system (each component a file name of at most 255 bytes, `NAME_MAX`), without
//!   climbing out of it or naming it twice (no empty, `.` or `..` component), and the same file
//!   on every plane (no backslash, which a Windows client or URL parser reads as a separator).
//! - [`conflict`] and [`first_conflict`], paths together: one file cannot be both a file and a
//!   directory of another (`data` beside `data/x.csv`).
//!
//! The gateway refuses a write that breaks either; the worker checks a session's files against
//! the same rule before restoring them, and refuses a session that breaks it with a reason the
//! client reads (never an internal error retried): docs/threat-model.md, issue 36 finding 5.

use std::collections::BTreeSet;

/// Most bytes of a path: 1024.
pub const MAX_PATH_BYTES: usize = 1024;

/// Most bytes of one component: Linux's `NAME_MAX` (255), which ext4, xfs and tmpfs share.
pub const MAX_COMPONENT_BYTES: usize = 255;

/// Why a path is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// The path is empty.
    #[error("it is empty")]
    Empty,
    /// Longer than [`MAX_PATH_BYTES`].
    #[error("it is longer than 1024 bytes")]
    TooLong {
        /// Its length, bytes.
        bytes: usize,
    },
    /// Starts with `/`.
    #[error("it is absolute")]
    Absolute,
    /// Holds a NUL byte or a backslash.
    #[error("it contains NUL or a backslash")]
    NulOrBackslash,
    /// Has an empty component (`a//b`, a trailing `/`).
    #[error("it has an empty component")]
    EmptyComponent,
    /// Has a `.` or `..` component.
    #[error("it has a '.' or '..' component")]
    DotComponent,
    /// A component is longer than [`MAX_COMPONENT_BYTES`] (the file system's `NAME_MAX`).
    #[error("a component is longer than 255 bytes")]
    ComponentTooLong {
        /// The long component's length, bytes.
        bytes: usize,
    },
    /// One path is a directory of the other (`data` and `data/x.csv`): both cannot be files.
    #[error("it clashes with {other:?}: one would be both a file and a directory")]
    Conflict {
        /// The other path (clipped to 200 characters).
        other: String,
    },
}

impl PathError {
    /// The reason as a static phrase (for [`crate::ValidationError::Path`]).
    #[must_use]
    pub fn reason(&self) -> &'static str {
        match self {
            PathError::Empty => "it is empty",
            PathError::TooLong { .. } => "it is longer than 1024 bytes",
            PathError::Absolute => "it is absolute",
            PathError::NulOrBackslash => "it contains NUL or a backslash",
            PathError::EmptyComponent => "it has an empty component",
            PathError::DotComponent => "it has a '.' or '..' component",
            PathError::ComponentTooLong { .. } => "a component is longer than 255 bytes",
            PathError::Conflict { .. } => "it clashes with another file: one would be both a file and a directory",
        }
    }
}

/// A path [`check_session_path`] accepted: relative to `/work`, `/`-separated.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SessionPath(String);

impl SessionPath {
    /// The path.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The path, owned.
    #[must_use]
    pub fn into_string(self) -> String {
        self.0
    }
}

impl AsRef<str> for SessionPath {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for SessionPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks one path: non-empty, at most [`MAX_PATH_BYTES`], not absolute, without NUL or
/// backslash, `/`-separated components that are not empty, `.` or `..`, each at most
/// [`MAX_COMPONENT_BYTES`].
///
/// # Errors
/// The first [`PathError`] found, in that order.
pub fn check_session_path(path: &str) -> Result<SessionPath, PathError> {
    if path.is_empty() {
        return Err(PathError::Empty);
    }
    if path.len() > MAX_PATH_BYTES {
        return Err(PathError::TooLong { bytes: path.len() });
    }
    if path.starts_with('/') {
        return Err(PathError::Absolute);
    }
    if path.contains(['\0', '\\']) {
        return Err(PathError::NulOrBackslash);
    }
    for component in path.split('/') {
        match component {
            "" => return Err(PathError::EmptyComponent),
            "." | ".." => return Err(PathError::DotComponent),
            c if c.len() > MAX_COMPONENT_BYTES => return Err(PathError::ComponentTooLong { bytes: c.len() }),
            _ => {}
        }
    }
    Ok(SessionPath(path.to_owned()))
}

/// Whether `a` is a directory of `b` (`data` of `data/x.csv`; not of `data2/x` or itself).
fn is_dir_of(a: &str, b: &str) -> bool {
    b.strip_prefix(a).is_some_and(|rest| rest.starts_with('/'))
}

/// The first of `existing` that `path` cannot stand beside: one that is a directory of it or
/// that it is a directory of. The same path is no conflict (a write replaces it).
#[must_use]
pub fn conflict<'a>(existing: impl IntoIterator<Item = &'a str>, path: &str) -> Option<&'a str> {
    existing.into_iter().find(|e| is_dir_of(e, path) || is_dir_of(path, e))
}

/// The first two of `paths` that cannot both be files (`(directory, file under it)`), if any.
/// O(n × depth).
#[must_use]
pub fn first_conflict<'a>(paths: impl IntoIterator<Item = &'a str>) -> Option<(&'a str, &'a str)> {
    let all: BTreeSet<&str> = paths.into_iter().collect();
    for path in &all {
        let mut end = 0;
        while let Some(slash) = path[end..].find('/') {
            let dir = &path[..end + slash];
            if let Some(found) = all.get(dir) {
                return Some((found, path));
            }
            end += slash + 1;
        }
    }
    None
}

/// `path` clipped to 200 characters, for a message.
#[must_use]
pub fn clipped(path: &str) -> String {
    path.chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn the_rule_table() {
        let long = "x".repeat(256);
        let max = "x".repeat(255);
        let deep = format!("{max}/{max}/{max}/{max}");
        let too_long = format!("{deep}/y");
        let cases: &[(&str, Result<(), PathError>)] = &[
            ("a.txt", Ok(())),
            ("data/x.csv", Ok(())),
            ("deep/er/file", Ok(())),
            (".hidden", Ok(())),
            ("...", Ok(())),
            ("a b/ü.txt", Ok(())),
            (&max, Ok(())),
            (&deep, Ok(())),
            ("", Err(PathError::Empty)),
            (&too_long, Err(PathError::TooLong { bytes: too_long.len() })),
            ("/etc/passwd", Err(PathError::Absolute)),
            ("a\\b", Err(PathError::NulOrBackslash)),
            ("..\\x", Err(PathError::NulOrBackslash)),
            ("a\0b", Err(PathError::NulOrBackslash)),
            ("a//b", Err(PathError::EmptyComponent)),
            ("a/", Err(PathError::EmptyComponent)),
            ("./a", Err(PathError::DotComponent)),
            ("a/..", Err(PathError::DotComponent)),
            ("../x", Err(PathError::DotComponent)),
            (&long, Err(PathError::ComponentTooLong { bytes: 256 })),
        ];
        for (path, want) in cases {
            assert_eq!(check_session_path(path).map(drop), *want, "{:?}", clipped(path));
        }
        assert_eq!(check_session_path("d/x").map(SessionPath::into_string), Ok("d/x".to_owned()));
    }

    #[test]
    fn a_file_and_a_directory_of_the_same_name_conflict() {
        let existing = ["data/x.csv", "data2", "notes.txt"];
        for (path, want) in [
            ("data", Some("data/x.csv")),
            ("data/x.csv/y", Some("data/x.csv")),
            ("notes.txt/a", Some("notes.txt")),
            ("data/x.csv", None),
            ("data/y.csv", None),
            ("data2/z", Some("data2")),
            ("dat", None),
            ("data-1", None),
        ] {
            assert_eq!(conflict(existing.iter().copied(), path), want, "{path}");
        }
        assert_eq!(first_conflict(["data", "data-1", "data/x.csv"]), Some(("data", "data/x.csv")));
        assert_eq!(first_conflict(["a/b/c", "x", "a/b"]), Some(("a/b", "a/b/c")));
        assert_eq!(first_conflict(["a/b", "a/c", "ab/c", "a.b"]), None);
    }

    /// An independent model of what a Linux file system takes beneath a directory: each
    /// component a name of 1 to 255 bytes without `/` or NUL, not `.` or `..`.
    fn creatable(path: &str) -> bool {
        !path.starts_with('/') && path.split('/').all(|c| !c.is_empty() && c != "." && c != ".." && c.len() <= 255 && !c.contains('\0'))
    }

    proptest! {
        /// Every accepted path is creatable beneath its root, and names the same file on every
        /// plane (no backslash).
        #[test]
        fn accepted_paths_are_creatable(path in "([a-z.\\\\/\u{0}é]{0,6}){0,4}") {
            if let Ok(p) = check_session_path(&path) {
                prop_assert!(creatable(p.as_str()), "{path:?}");
                prop_assert!(!p.as_str().contains('\\'));
            }
        }

        /// A conflict is found exactly when one path is a directory of another.
        #[test]
        fn conflicts_are_exactly_directory_prefixes(paths in proptest::collection::vec("[ab]{1,2}(/[ab]{1,2}){0,2}", 0..6)) {
            let model = paths.iter().any(|a| paths.iter().any(|b| b.starts_with(&format!("{a}/"))));
            prop_assert_eq!(first_conflict(paths.iter().map(String::as_str)).is_some(), model);
        }
    }
}
