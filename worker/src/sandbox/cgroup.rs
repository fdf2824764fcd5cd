//! Reads a container's resource usage from its cgroup, on cgroup v1 (this machine kind: hybrid,
//! v1 controllers under `/sys/fs/cgroup/<controller>`) and v2 (most production nodes).
//!
//! Must run after the container's processes exit and before `delete` (which removes the cgroup).

use std::path::{Path, PathBuf};

/// Usage read from a cgroup; a counter the kernel does not expose reads as 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CgroupStats {
    /// CPU time of all processes, user + system, milliseconds (v1 `cpuacct.usage` in ns, v2
    /// `cpu.stat` `usage_usec`).
    pub cpu_ms: u64,
    /// Peak memory, bytes (v1 `memory.max_usage_in_bytes`, v2 `memory.peak`, Linux 5.19+).
    pub peak_memory_bytes: u64,
    /// Processes the kernel OOM-killed in this cgroup (v1 `memory.oom_control` `oom_kill`, v2
    /// `memory.events` `oom_kill`). The exit status does not show an OOM kill of a child
    /// (`../shared/notes/youki.md`), so this counter decides `oom_killed`.
    pub oom_kills: u64,
}

/// Mount point of the cgroup hierarchies.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// True when `/sys/fs/cgroup` is a unified (v2) hierarchy.
pub fn is_v2() -> bool {
    Path::new(CGROUP_ROOT).join("cgroup.controllers").exists()
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Value of `key` in a flat keyed file (`key value` per line, e.g. `memory.events`).
fn read_keyed(path: &Path, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

fn join(root: &Path, cgroups_path: &str) -> PathBuf {
    root.join(cgroups_path.trim_start_matches('/'))
}

/// The directories of the cgroup at `cgroups_path` (absolute): the unified one on v2, one per
/// v1 controller hierarchy (those that are mounted) on v1.
pub fn dirs(cgroups_path: &str) -> Vec<PathBuf> {
    let root = Path::new(CGROUP_ROOT);
    if is_v2() {
        return vec![join(root, cgroups_path)];
    }
    std::fs::read_dir(root)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| join(&e.path(), cgroups_path))
                .collect()
        })
        .unwrap_or_default()
}

/// Reads the usage of the cgroup at `cgroups_path` (the spec's `linux.cgroupsPath`, absolute).
pub fn read(cgroups_path: &str) -> CgroupStats {
    let root = Path::new(CGROUP_ROOT);
    if is_v2() {
        let dir = join(root, cgroups_path);
        CgroupStats {
            cpu_ms: read_keyed(&dir.join("cpu.stat"), "usage_usec").unwrap_or(0) / 1000,
            peak_memory_bytes: read_u64(&dir.join("memory.peak")).unwrap_or(0),
            oom_kills: read_keyed(&dir.join("memory.events"), "oom_kill").unwrap_or(0),
        }
    } else {
        let cpu = join(&root.join("cpuacct"), cgroups_path);
        let memory = join(&root.join("memory"), cgroups_path);
        CgroupStats {
            cpu_ms: read_u64(&cpu.join("cpuacct.usage")).unwrap_or(0) / 1_000_000,
            peak_memory_bytes: read_u64(&memory.join("memory.max_usage_in_bytes")).unwrap_or(0),
            oom_kills: read_keyed(&memory.join("memory.oom_control"), "oom_kill").unwrap_or(0),
        }
    }
}

/// The CPU weight of the cgroup at `cgroups_path` among its siblings (the other sandboxes):
/// the lowest when `low` (v1 `cpu.shares` 2, v2 `cpu.weight` 1), else the kernel's default
/// (1024, 100). A warm sandbox warms up at the lowest, so that a job arriving meanwhile gets
/// the CPU first, and gets the default when its job is handed over.
///
/// # Errors
/// The write's error (no cpu controller, the cgroup gone).
pub fn set_cpu_priority(cgroups_path: &str, low: bool) -> std::io::Result<()> {
    let root = Path::new(CGROUP_ROOT);
    if is_v2() {
        std::fs::write(join(root, cgroups_path).join("cpu.weight"), if low { "1" } else { "100" })
    } else {
        std::fs::write(join(&root.join("cpu"), cgroups_path).join("cpu.shares"), if low { "2" } else { "1024" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_files_are_parsed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("memory.events");
        std::fs::write(&file, "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n").expect("write");
        assert_eq!(read_keyed(&file, "oom_kill"), Some(2));
        assert_eq!(read_keyed(&file, "oom"), Some(1));
        assert_eq!(read_keyed(&file, "missing"), None);
    }

    #[test]
    fn absolute_cgroup_paths_join_beneath_the_root() {
        assert_eq!(join(Path::new("/sys/fs/cgroup/memory"), "/sandq/j1"), Path::new("/sys/fs/cgroup/memory/sandq/j1"));
    }
}
