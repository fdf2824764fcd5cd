//! Reads a container's resource usage from its cgroup, on cgroup v1 (this machine kind: hybrid,
//! v1 controllers under `/sys/fs/cgroup/<controller>`) and v2 (most production nodes), and the
//! CPUs sandboxes may be pinned to ([`available_cpus`], for [`super::cpuset`]).
//!
//! [`read`] must run after the container's processes exit and before `delete` (which removes
//! the cgroup).

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
    /// `memory.events` `oom_kill`). The exit status does not show an OOM kill of a child, so
    /// this counter decides `oom_killed` (test: oom_of_a_child_is_reported_even_with_exit_code_zero
    /// in tests/hostile.rs).
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
            entries.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())).map(|e| join(&e.path(), cgroups_path)).collect()
        })
        .unwrap_or_default()
}

/// The CPUs sandboxes may be pinned to: the effective cpuset of the sandboxes' parent cgroup
/// (`/sandq`) if it exists yet, else of the root (v2 `cpuset.cpus.effective`, v1
/// `cpuset/.../cpuset.effective_cpus`), else the online CPUs. Never empty: `[0]` when nothing
/// is readable.
pub fn available_cpus() -> Vec<u32> {
    let root = Path::new(CGROUP_ROOT);
    let (dir, file) = if is_v2() { (root.to_path_buf(), "cpuset.cpus.effective") } else { (root.join("cpuset"), "cpuset.effective_cpus") };
    [dir.join("sandq").join(file), dir.join(file), PathBuf::from("/sys/devices/system/cpu/online")]
        .iter()
        .filter_map(|path| std::fs::read_to_string(path).ok())
        .map(|text| parse_cpu_list(&text))
        .find(|cpus| !cpus.is_empty())
        .unwrap_or_else(|| vec![0])
}

/// Parses the kernel's CPU list format (`0-3,8,10-11`), sorted, without duplicates; an
/// unreadable part is skipped.
pub fn parse_cpu_list(text: &str) -> Vec<u32> {
    let mut cpus: Vec<u32> = text
        .trim()
        .split(',')
        .filter_map(|part| {
            let part = part.trim();
            match part.split_once('-') {
                Some((a, b)) => Some(a.parse::<u32>().ok()?..=b.parse::<u32>().ok()?),
                None => part.parse::<u32>().ok().map(|c| c..=c),
            }
        })
        // A bound on a malformed range: no machine has a million CPUs.
        .flat_map(|range| range.take(1 << 20))
        .collect();
    cpus.sort_unstable();
    cpus.dedup();
    cpus
}

/// Formats CPUs in the kernel's list format (the OCI `linux.resources.cpu.cpus`), ranges
/// joined: `[0, 1, 2, 5]` -> `0-2,5`.
pub fn format_cpu_list(cpus: &[u32]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        while i + 1 < sorted.len() && sorted[i + 1] == sorted[i] + 1 {
            i += 1;
        }
        parts.push(if sorted[i] == start { start.to_string() } else { format!("{start}-{}", sorted[i]) });
        i += 1;
    }
    parts.join(",")
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

/// The memory the cgroup at `cgroups_path` holds now (v1 `memory.usage_in_bytes`, v2
/// `memory.current`), bytes; `None` when it cannot be read.
pub fn memory_current(cgroups_path: &str) -> Option<u64> {
    let root = Path::new(CGROUP_ROOT);
    if is_v2() {
        read_u64(&join(root, cgroups_path).join("memory.current"))
    } else {
        read_u64(&join(&root.join("memory"), cgroups_path).join("memory.usage_in_bytes"))
    }
}

/// Raises the memory limit of the cgroup at `cgroups_path` to `bytes`: v2 `memory.max`; v1
/// `memory.memsw.limit_in_bytes` (memory + swap, when the kernel accounts swap: it may not be
/// below the memory limit, so it is raised first) then `memory.limit_in_bytes`. Also restarts
/// v1's peak (`memory.max_usage_in_bytes`) from the current usage. Only for raising: a lower
/// limit would be written in the wrong order on v1.
///
/// # Errors
/// The write's error (no memory controller, the cgroup gone).
pub fn raise_memory_limit(cgroups_path: &str, bytes: u64) -> std::io::Result<()> {
    let root = Path::new(CGROUP_ROOT);
    if is_v2() {
        return std::fs::write(join(root, cgroups_path).join("memory.max"), bytes.to_string());
    }
    let dir = join(&root.join("memory"), cgroups_path);
    let memsw = dir.join("memory.memsw.limit_in_bytes");
    if memsw.exists() {
        std::fs::write(&memsw, bytes.to_string())?;
    }
    std::fs::write(dir.join("memory.limit_in_bytes"), bytes.to_string())?;
    std::fs::write(dir.join("memory.max_usage_in_bytes"), "0")
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

/// Pins the cgroup at `cgroups_path` to `cpus` (the kernel's list format): v1
/// `cpuset/<path>/cpuset.cpus`, v2 `<path>/cpuset.cpus`. The kernel moves its processes.
///
/// # Errors
/// The write's error (no cpuset controller, the cgroup gone, CPUs outside the parent's).
pub fn set_cpuset(cgroups_path: &str, cpus: &str) -> std::io::Result<()> {
    let root = Path::new(CGROUP_ROOT);
    let dir = if is_v2() { join(root, cgroups_path) } else { join(&root.join("cpuset"), cgroups_path) };
    std::fs::write(dir.join("cpuset.cpus"), cpus)
}

/// A cgroup for work the worker does on a job's behalf outside its sandbox (the session
/// packages `tar`; test: the_packages_tar_runs_confined_to_a_cgroup_of_the_jobs_size in
/// `session::packages`), limited like the job: `cpus` cores of CFS quota
/// (v1 `cpu.cfs_quota_us` over a 100 ms period, v2 `cpu.max`), `memory_bytes` (v1
/// `memory.limit_in_bytes`, v2 `memory.max`) and [`SIDE_PIDS_MAX`] processes, at
/// `/sandq/side-<owner>-<name>` beside the sandboxes' cgroups, so that the work competes for the CPU
/// like one more sandbox of the job's size rather than as the worker. Its usage is read with
/// [`read`] at [`SideCgroup::path`]; the cgroup is removed when dropped (its processes must
/// have exited: the caller waits for them).
#[derive(Debug)]
pub struct SideCgroup {
    path: String,
    dirs: Vec<PathBuf>,
}

/// Most processes in a [`SideCgroup`]: `tar` needs one (GNU tar forks only for compression,
/// which sandq does not use).
pub const SIDE_PIDS_MAX: u64 = 16;

/// CFS period of a [`SideCgroup`], microseconds (the kernel's default).
const CFS_PERIOD_US: u64 = 100_000;

/// This worker's part of the side cgroups' names (`side-<owner>-...`), set once at start from
/// its id ([`set_side_owner`]), so that a worker's start-up clean-up
/// ([`remove_leftover_side_cgroups`]) touches its own only (workers share `/sandq`).
static SIDE_OWNER: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Sets this worker's part of the side cgroups' names: 8 hex digits of a hash of `owner`, the
/// worker's id and its state root together (two workers of one id but their own state dirs
/// leave each other's alone, as the container clean-up, scoped to the state root, does).
/// Before it is set (unit tests), `0` is used.
pub fn set_side_owner(owner: &str) {
    let hash = owner.bytes().fold(0x811c_9dc5_u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193));
    let _ = SIDE_OWNER.set(format!("{hash:08x}"));
}

fn side_owner() -> &'static str {
    SIDE_OWNER.get().map_or("0", String::as_str)
}

/// Kills every process left in this worker's side cgroups by an earlier run (a worker killed
/// while a packages `tar` ran leaves the cgroup, and the `tar` writing into a job dir as the
/// slot's uid), then removes the cgroups; returns how many it removed (test:
/// leftover_side_cgroups_are_emptied_and_removed_and_only_this_workers).
/// Run at start, before the job dirs are removed. v1: each controller's `/sandq/side-<owner>-*`;
/// v2: the unified one (`cgroup.kill` where the kernel has it, else each pid).
pub fn remove_leftover_side_cgroups() -> usize {
    let prefix = format!("side-{}-", side_owner());
    let mut removed = 0;
    for parent in dirs("/sandq") {
        let Ok(entries) = std::fs::read_dir(&parent) else { continue };
        for entry in entries.flatten() {
            if !entry.file_name().to_string_lossy().starts_with(&prefix) || !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let dir = entry.path();
            let _ = std::fs::write(dir.join("cgroup.kill"), "1");
            for _ in 0..100 {
                let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
                let pids: Vec<i32> = procs.lines().filter_map(|l| l.trim().parse().ok()).collect();
                if pids.is_empty() {
                    break;
                }
                for pid in pids {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            if std::fs::remove_dir(&dir).is_ok() {
                removed += 1;
            }
        }
    }
    removed
}

impl SideCgroup {
    /// Creates the cgroup `/sandq/side-<owner>-<name>` (`name`: `[A-Za-z0-9_-]`, unique among
    /// the jobs running; `<owner>`: [`set_side_owner`]) with its limits. On v2 the controllers
    /// are enabled in `/sandq` first.
    ///
    /// # Errors
    /// The first failed directory creation or limit write (nothing is left behind).
    pub fn create(name: &str, cpus: f64, memory_bytes: u64) -> std::io::Result<SideCgroup> {
        let path = format!("/sandq/side-{}-{name}", side_owner());
        let root = Path::new(CGROUP_ROOT);
        let quota = ((cpus.max(0.01) * CFS_PERIOD_US as f64) as u64).max(1000);
        let mut side = SideCgroup { path: path.clone(), dirs: Vec::new() };
        if is_v2() {
            let parent = root.join("sandq");
            std::fs::create_dir_all(&parent)?;
            // Best effort: already enabled where sandboxes ran; refused only for a controller
            // the root does not delegate, which the writes below then report.
            let _ = std::fs::write(parent.join("cgroup.subtree_control"), "+cpu +memory +pids");
            let dir = join(root, &path);
            std::fs::create_dir(&dir)?;
            side.dirs.push(dir.clone());
            std::fs::write(dir.join("cpu.max"), format!("{quota} {CFS_PERIOD_US}"))?;
            std::fs::write(dir.join("memory.max"), memory_bytes.to_string())?;
            std::fs::write(dir.join("pids.max"), SIDE_PIDS_MAX.to_string())?;
        } else {
            for controller in ["cpu", "cpuacct", "memory", "pids"] {
                let dir = join(&root.join(controller), &path);
                std::fs::create_dir_all(&dir)?;
                side.dirs.push(dir);
            }
            let dir = |controller: &str| join(&root.join(controller), &path);
            std::fs::write(dir("cpu").join("cpu.cfs_period_us"), CFS_PERIOD_US.to_string())?;
            std::fs::write(dir("cpu").join("cpu.cfs_quota_us"), quota.to_string())?;
            std::fs::write(dir("memory").join("memory.limit_in_bytes"), memory_bytes.to_string())?;
            std::fs::write(dir("pids").join("pids.max"), SIDE_PIDS_MAX.to_string())?;
        }
        Ok(side)
    }

    /// The cgroup's path below the hierarchy roots (`/sandq/side-<name>`), for [`read`].
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The `cgroup.procs` files a process writes its pid into to join the cgroup (one per v1
    /// controller, the unified one on v2).
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }
}

impl Drop for SideCgroup {
    fn drop(&mut self) {
        for dir in &self.dirs {
            // Empty by now (the caller waited for its processes); a failure leaves an empty
            // cgroup, which costs nothing and is not reused (names are unique).
            let _ = std::fs::remove_dir(dir);
        }
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
    fn cpu_lists_parse_and_format() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), [0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list("1"), [1]);
        assert_eq!(parse_cpu_list("\n"), Vec::<u32>::new());
        assert_eq!(parse_cpu_list("3,1-2,x,2"), [1, 2, 3]);
        assert_eq!(format_cpu_list(&[5, 0, 1, 2, 7, 8]), "0-2,5,7-8");
        assert_eq!(format_cpu_list(&[3]), "3");
        assert_eq!(parse_cpu_list(&format_cpu_list(&[0, 2, 3, 4, 9])), [0, 2, 3, 4, 9]);
    }

    #[test]
    fn available_cpus_are_the_hosts_online_cpus_here() {
        // Nothing restricts the root cpuset on a test machine: every online CPU.
        let online = parse_cpu_list(&std::fs::read_to_string("/sys/devices/system/cpu/online").expect("online"));
        assert_eq!(available_cpus(), online);
    }

    /// A side cgroup a killed worker left, with a process in it, is emptied (the process
    /// killed) and removed at the next start; another worker's is not touched. Root only (it
    /// makes cgroups).
    #[test]
    fn leftover_side_cgroups_are_emptied_and_removed_and_only_this_workers() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: making a cgroup needs root");
            return;
        }
        set_side_owner("unit-test-worker");
        let left = SideCgroup::create(&format!("left-{}", std::process::id()), 0.5, 64 << 20).expect("side cgroup");
        let path = left.path().to_owned();
        let mut sleeper = std::process::Command::new("sh")
            .arg("-c")
            .arg(r#"for f in "$@"; do echo $$ > "$f"; done; exec sleep 600"#)
            .arg("sh")
            .args(left.procs_files())
            .spawn()
            .expect("sleeper");
        // Joined before the clean-up looks (the shell writes, then execs).
        let procs = left.procs_files()[0].clone();
        for _ in 0..100 {
            if std::fs::read_to_string(&procs).unwrap_or_default().contains(&sleeper.id().to_string()) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // Another worker's, which must stay.
        let others = format!("/sandq/side-00000000-other-{}", std::process::id());
        let other_dirs = dirs(&others);
        for dir in &other_dirs {
            std::fs::create_dir_all(dir).expect("other");
        }
        std::mem::forget(left); // as a killed worker would: no Drop
        let removed = remove_leftover_side_cgroups();
        let status = sleeper.wait().expect("wait");
        let left_behind: Vec<PathBuf> = dirs(&path).into_iter().filter(|d| d.exists()).collect();
        let others_kept = other_dirs.iter().all(|d| d.exists());
        for dir in &other_dirs {
            let _ = std::fs::remove_dir(dir);
        }
        assert!(removed >= 1, "nothing removed");
        assert!(left_behind.is_empty(), "left: {left_behind:?}");
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "the process in it was not killed");
        assert!(others_kept, "another worker's side cgroup was removed");
    }

    #[test]
    fn absolute_cgroup_paths_join_beneath_the_root() {
        assert_eq!(join(Path::new("/sys/fs/cgroup/memory"), "/sandq/j1"), Path::new("/sys/fs/cgroup/memory/sandq/j1"));
    }
}
