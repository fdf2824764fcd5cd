//! What a stored `reason` may say of the host: nothing. Errors carry host paths for the
//! worker's log (a job dir's file that could not be made, libcontainer's rootfs and state
//! paths, the helper's path), but a result is read by the client, who should learn neither the
//! worker's directories nor its job dirs' names. [`HostPaths::redact`] rewrites every path
//! under one of the worker's directories: a path inside the job's sandbox becomes the path the
//! program sees (`/work/...`, `/sandq/...`, an image path), any other a neutral word
//! (`<job dir>`, `<worker dir>`, `<sandbox state>`, `<sandbox image>`, `sandq-container`).
//! One rule where reasons are stored (`job::conclude`), so that no error message, new or old,
//! can leak one (test: `sandbox::no_result_names_a_worker_host_path` in tests/tenant).

use std::path::Path;

use crate::settings::Settings;

/// How a path under one of the worker's directories is written in a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shown {
    /// `<jobs_dir>/<container id>/...`: the sandbox's own path when the rest names a mount
    /// (`disk/work` is `/work`, `src` is `/sandq`...), else `<job dir>`.
    JobDir,
    /// The sandbox image: `<rootfs>/usr/bin/python3` is `/usr/bin/python3` in the sandbox.
    Image,
    /// Any other: this word.
    Word(&'static str),
}

/// The worker's host directories, longest first (a path is rewritten by the longest that
/// holds it).
#[derive(Debug, Clone, Default)]
pub(crate) struct HostPaths {
    prefixes: Vec<(String, Shown)>,
}

/// Where each directory of the job dir is mounted in the sandbox (`crate::jobdir`,
/// `oci-bundles/config.template.json`), the most specific first.
const JOB_DIR_MOUNTS: [(&str, &str); 5] =
    [("disk/work", "/work"), ("disk/packages", "/sandq/packages"), ("disk/in", "/sandq/in"), ("src", "/sandq"), ("out", "/sandq/out")];

impl HostPaths {
    /// The directories of `settings`: the jobs dir and the data dir holding it (templates,
    /// state caches), the state dir, the image and the directory holding it, the helper.
    pub(crate) fn of(settings: &Settings) -> Self {
        let mut dirs: Vec<(&Path, Shown)> = vec![
            (&settings.jobs_dir, Shown::JobDir),
            (&settings.state_root, Shown::Word("<sandbox state>")),
            (&settings.rootfs, Shown::Image),
            (&settings.container_helper, Shown::Word("sandq-container")),
        ];
        if let Some(data) = settings.jobs_dir.parent() {
            dirs.push((data, Shown::Word("<worker dir>")));
        }
        if let Some(state) = settings.state_root.parent() {
            dirs.push((state, Shown::Word("<sandbox state>")));
        }
        if let Some(image) = settings.rootfs.parent() {
            dirs.push((image, Shown::Word("<sandbox image>")));
        }
        Self::new(dirs)
    }

    /// Only `jobs_dir`, shown as the module says (for tests of the callers).
    #[cfg(test)]
    pub(crate) fn of_jobs_dir(jobs_dir: &Path) -> Self {
        Self::new(vec![(jobs_dir, Shown::JobDir)])
    }

    fn new(dirs: Vec<(&Path, Shown)>) -> Self {
        let mut prefixes: Vec<(String, Shown)> = dirs
            .into_iter()
            .map(|(dir, shown)| (dir.to_string_lossy().trim_end_matches('/').to_owned(), shown))
            // "/" or a relative directory would rewrite every path: such a setting names no
            // directory of the worker's own.
            .filter(|(dir, _)| dir.starts_with('/') && dir.len() > 1)
            .collect();
        prefixes.sort_by_key(|(dir, _)| std::cmp::Reverse(dir.len()));
        prefixes.dedup_by(|a, b| a.0 == b.0);
        HostPaths { prefixes }
    }

    /// `text` with every path under one of the directories rewritten as the module says. A
    /// path ends at whitespace, a quote or `:`, `,`, `;`, `)`, `]`, `}` (as error messages
    /// write them: `cannot read /x/y: No such file`, `"/x/y"`); a directory's name only counts
    /// where a path starts (after no path character) and ends (`/x/jobs` never matches
    /// `/x/jobs2`).
    pub(crate) fn redact(&self, text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        let mut previous: Option<char> = None;
        'scan: while let Some(c) = rest.chars().next() {
            if c == '/' && !previous.is_some_and(is_path_char) {
                for (dir, shown) in &self.prefixes {
                    let Some(after) = rest.strip_prefix(dir.as_str()) else { continue };
                    if after.chars().next().is_some_and(|n| n != '/' && !ends_path(n)) {
                        continue;
                    }
                    let end = after.find(ends_path).unwrap_or(after.len());
                    out.push_str(&show(*shown, &after[..end]));
                    previous = after[..end].chars().last().or(dir.chars().last());
                    rest = &after[end..];
                    continue 'scan;
                }
            }
            out.push(c);
            previous = Some(c);
            rest = &rest[c.len_utf8()..];
        }
        out
    }
}

/// How the path `below` (empty or `/...`) under a directory shown as `shown` is written.
fn show(shown: Shown, below: &str) -> String {
    match shown {
        Shown::Word(word) => word.to_owned(),
        Shown::Image => {
            if below.is_empty() {
                "/".to_owned()
            } else {
                below.to_owned()
            }
        }
        Shown::JobDir => {
            // "/<container id>/<inside>"
            let inside = below.trim_start_matches('/').split_once('/').map_or("", |(_, inside)| inside);
            for (dir, mount) in JOB_DIR_MOUNTS {
                if inside == dir {
                    return mount.to_owned();
                }
                if let Some(under) = inside.strip_prefix(dir).filter(|u| u.starts_with('/')) {
                    return format!("{mount}{under}");
                }
            }
            "<job dir>".to_owned()
        }
    }
}

/// Characters a path is made of, for where one starts: a `/` after one of them is inside a
/// word (`a/b`), not a path's start.
fn is_path_char(c: char) -> bool {
    c.is_alphanumeric() || matches!(c, '/' | '.' | '_' | '-' | '~' | '+' | '@')
}

/// Where a path in an error message ends.
fn ends_path(c: char) -> bool {
    c.is_whitespace() || matches!(c, '"' | '\'' | '`' | ':' | ',' | ';' | ')' | ']' | '}')
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::{HostPaths, Shown};

    fn paths() -> HostPaths {
        HostPaths::new(vec![
            (Path::new("/var/lib/sandq/w1"), Shown::JobDir),
            (Path::new("/var/lib/sandq"), Shown::Word("<worker dir>")),
            (Path::new("/run/sandq/w1"), Shown::Word("<sandbox state>")),
            (Path::new("/run/sandq"), Shown::Word("<sandbox state>")),
            (Path::new("/var/cache/sandq/rootfs/4c98/rootfs"), Shown::Image),
            (Path::new("/var/cache/sandq/rootfs/4c98"), Shown::Word("<sandbox image>")),
            (Path::new("/usr/local/bin/sandq-container"), Shown::Word("sandq-container")),
        ])
    }

    #[test]
    fn a_path_in_the_job_dir_is_the_sandbox_path() {
        let p = paths();
        let cases = [
            ("local file /var/lib/sandq/w1/abc123/disk/work/data/x.csv: Not a directory", "local file /work/data/x.csv: Not a directory"),
            ("cannot prepare /var/lib/sandq/w1/abc123/disk/work: denied", "cannot prepare /work: denied"),
            ("cannot read \"/var/lib/sandq/w1/abc/src/main.py\"", "cannot read \"/sandq/main.py\""),
            ("/var/lib/sandq/w1/abc/out/outputs.jsonl", "/sandq/out/outputs.jsonl"),
            ("/var/lib/sandq/w1/abc/disk/packages/python", "/sandq/packages/python"),
            ("/var/lib/sandq/w1/abc/disk/in/state", "/sandq/in/state"),
            // Not a mount: a neutral word, the container id dropped too.
            ("cannot write /var/lib/sandq/w1/abc/bundle/config.json: full", "cannot write <job dir>: full"),
            ("/var/lib/sandq/w1/abc/disk/workx", "<job dir>"),
            ("/var/lib/sandq/w1/abc", "<job dir>"),
            ("/var/lib/sandq/w1", "<job dir>"),
        ];
        for (text, shown) in cases {
            assert_eq!(p.redact(text), shown, "{text}");
        }
    }

    #[test]
    fn other_worker_paths_are_neutral_words() {
        let p = paths();
        let cases = [
            (
                "sandbox create failed: rootfs /var/cache/sandq/rootfs/4c98/rootfs (state /run/sandq/w1/abc): EBUSY",
                "sandbox create failed: rootfs / (state <sandbox state>): EBUSY",
            ),
            ("exec /var/cache/sandq/rootfs/4c98/rootfs/usr/bin/python3 failed", "exec /usr/bin/python3 failed"),
            ("/var/cache/sandq/rootfs/4c98/image.lock busy", "<sandbox image> busy"),
            ("/var/lib/sandq/w1.templates/S.sock, /var/lib/sandq/w1.state-cache/x", "<worker dir>, <worker dir>"),
            ("cannot run /usr/local/bin/sandq-container: ENOENT", "cannot run sandq-container: ENOENT"),
            ("[/run/sandq/w1/x]", "[<sandbox state>]"),
        ];
        for (text, shown) in cases {
            assert_eq!(p.redact(text), shown, "{text}");
        }
    }

    #[test]
    fn only_whole_paths_of_the_worker_are_rewritten() {
        let p = paths();
        for text in [
            "exit code 1",
            "cannot stage input \"data/x.csv\": object inputs/sha256/ab does not exist",
            "/var/lib/sandq2/x",
            "/var/lib/sandqx",
            "a/var/lib/sandq/w1/x",
            "/work/var/lib/sandq/w1/x",
            "gave up after 3 attempts: \u{e9}/run/sandqueue",
        ] {
            assert_eq!(p.redact(text), text);
        }
        // A setting of "/" or a relative path names no directory: nothing is rewritten.
        let root = HostPaths::new(vec![(Path::new("/"), Shown::Word("x")), (Path::new("rel"), Shown::Word("x"))]);
        assert_eq!(root.redact("/etc/passwd rel/x"), "/etc/passwd rel/x");
    }
}
