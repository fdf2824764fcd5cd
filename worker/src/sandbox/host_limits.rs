//! Host-wide kernel tables that every sandbox draws from, sized at start-up so that a
//! sandbox's own cgroup limits (memory, pids) run out before a table the host shares does
//! (test: a_sandbox_takes_a_bounded_share_of_the_hosts_tables in tests/limits.rs).
//!
//! - `fs.file-max`, the open file table: a program can hold open files beyond its
//!   `RLIMIT_NOFILE` (a mapping keeps its file open after the descriptor is closed; measured:
//!   400,000 files held by one S job, ~406 bytes of the job's memory each). Raised to at least
//!   one file per [`BYTES_PER_FILE`] of the worker's memory capacity, so that the jobs' memory
//!   limits bound it: when full, every process without `CAP_SYS_ADMIN` (other sandboxes, the
//!   broker, Redis) gets `ENFILE`. systemd raises it to the largest value by default for the
//!   same reason.
//! - `kernel.pid_max`: must exceed the sandboxes' `pids` limits together (slots and warm
//!   sandboxes of every worker on the node) plus the host's own; the kernel's default on a host
//!   without systemd is 32,768.
//! - `kernel.pty.max`: each sandbox's `/dev/pts` is a new devpts instance capped at
//!   [`PTYS_PER_SANDBOX`] (`max=` in the config template); the instances share
//!   `pty.max - pty.reserve` (4,096 by default).
//!
//! Each is sized for the node, not for this worker: several workers may share a node (the
//! Kubernetes pools, `worker.userns_lease_dir`), and one that raised a table to its own need
//! would leave it at the largest single worker's rather than their sum. So `file-max` counts
//! the node's memory (`MemTotal`), and `pid_max` and `pty.max` go
//! to the kernel's largest values, as systemd sets `pid_max` by default: every sandbox is
//! bounded by its own `pids` limit and devpts `max=` first.
//!
//! Only ever raised, never lowered. Each is a write to `/proc/sys` (root); a value that cannot
//! be raised is an error at start, not a silent risk.

use std::path::Path;

/// Memory a held open file costs its job at the least, bytes (a `struct file` is ~256 bytes;
/// 406 were measured with its mapping).
pub const BYTES_PER_FILE: u64 = 256;

/// The most ptys one sandbox may open (its devpts `max=`, `oci-bundles/config.template.json`).
pub const PTYS_PER_SANDBOX: u64 = 64;

/// The kernel's largest `pid_max` on 64-bit (`PID_MAX_LIMIT`, 2^22).
const PID_MAX_LIMIT: u64 = 1 << 22;

/// The kernel's largest `pty.max` (`NR_UNIX98_PTY_MAX`, 2^20).
const PTY_MAX_LIMIT: u64 = 1 << 20;

/// A host limit that could not be read or raised.
#[derive(Debug, thiserror::Error)]
pub enum HostLimitError {
    /// The sysctl could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The `/proc/sys` file.
        path: String,
        /// The read's error.
        source: std::io::Error,
    },
    /// The sysctl could not be raised (not root, or a read-only `/proc/sys`).
    #[error("cannot raise {path} from {from} to {to}: {source} (raise it on the host, e.g. sysctl -w)")]
    Raise {
        /// The `/proc/sys` file.
        path: String,
        /// Its current value.
        from: u64,
        /// The value the sandboxes' limits need.
        to: u64,
        /// The write's error.
        source: std::io::Error,
    },
    /// `/sys` is a read-only sysfs and `mount -o remount,rw /sys` failed.
    #[error("/sys is read-only and cannot be made writable ({0}): sandboxes cannot mount their own sysfs")]
    Sysfs(String),
}

/// A limit raised at start: (the `/proc/sys` file, old value, new value).
pub type Raised = (&'static str, u64, u64);

/// Raises the host tables the sandboxes share to what the node needs (`capacity_memory_bytes`,
/// this worker's memory capacity in bytes, is a floor when `/proc/meminfo` cannot be read);
/// returns what was raised.
///
/// # Errors
/// [`HostLimitError`] when a table is too small and cannot be raised.
pub fn ensure(capacity_memory_bytes: u64) -> Result<Vec<Raised>, HostLimitError> {
    let files = node_memory_bytes().unwrap_or(0).max(capacity_memory_bytes) / BYTES_PER_FILE;
    let (pids, ptys) = (PID_MAX_LIMIT, PTY_MAX_LIMIT);
    let mut raised = Vec::new();
    for (path, needed) in [("/proc/sys/fs/file-max", files), ("/proc/sys/kernel/pid_max", pids), ("/proc/sys/kernel/pty/max", ptys)] {
        let now = read(path)?;
        if now < needed {
            std::fs::write(path, needed.to_string()).map_err(|source| HostLimitError::Raise {
                path: path.to_owned(),
                from: now,
                to: needed,
                source,
            })?;
            raised.push((path, now, needed));
        }
    }
    Ok(raised)
}

/// Whether the mount at `/sys` in a `/proc/self/mountinfo` text is a sysfs whose superblock is
/// read-only (the fields after ` - ` are the type, the source and the superblock's options).
pub fn sysfs_read_only(mountinfo: &str) -> bool {
    mountinfo.lines().rfind(|line| line.split(' ').nth(4) == Some("/sys")).is_some_and(|line| {
        let mut fields = line.split(" - ").nth(1).unwrap_or("").split(' ');
        fields.next() == Some("sysfs") && fields.nth(1).is_some_and(|options| options.split(',').any(|o| o == "ro"))
    })
}

/// Makes the worker's `/sys` writable when its sysfs superblock is read-only; returns whether it
/// did.
///
/// Why: a sandbox in a user namespace may mount a new sysfs only if the kernel finds one as
/// permissive already visible (`mount_too_revealing`, fs/namespace.c), and libcontainer creates
/// the mount read-write before making it read-only. In a Kubernetes pod the sysfs of the pod's
/// network namespace is first mounted by the pod's unprivileged pause container, read-only, and
/// every container of the pod shares that superblock: every sandbox then failed with
/// `failed to prepare rootfs` (EPERM from `fsmount`). A privileged worker container may remount
/// it read-write; on a host `/sys` is writable already and nothing is done.
///
/// # Errors
/// [`HostLimitError::Sysfs`] when the remount fails.
pub fn ensure_sysfs_writable() -> Result<bool, HostLimitError> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| HostLimitError::Sysfs(e.to_string()))?;
    if !sysfs_read_only(&mountinfo) {
        return Ok(false);
    }
    let out = std::process::Command::new("mount")
        .args(["-o", "remount,rw", "/sys"])
        .output()
        .map_err(|e| HostLimitError::Sysfs(format!("mount: {e}")))?;
    if !out.status.success() {
        return Err(HostLimitError::Sysfs(String::from_utf8_lossy(&out.stderr).trim().to_owned()));
    }
    Ok(true)
}

/// The node's memory (`MemTotal` of `/proc/meminfo`), bytes.
fn node_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = text.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    kib.checked_mul(1024)
}

fn read(path: &str) -> Result<u64, HostLimitError> {
    let text = std::fs::read_to_string(Path::new(path)).map_err(|source| HostLimitError::Read { path: path.to_owned(), source })?;
    text.trim().parse().map_err(|e| HostLimitError::Read { path: path.to_owned(), source: std::io::Error::other(format!("{e}: {text:?}")) })
}

#[cfg(test)]
mod tests {
    use super::PTYS_PER_SANDBOX;

    #[test]
    fn a_read_only_sysfs_superblock_is_found_and_a_read_only_mount_alone_is_not() {
        // A privileged container's mountinfo in a pod (containerd 1.6, cgroup v1), and a host's.
        let pod =
            "475 196 0:117 / / rw,relatime - overlay overlay rw\n478 475 0:112 / /sys rw,nosuid,nodev,noexec,relatime - sysfs sysfs ro\n";
        let host = "25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw\n";
        let ro_mount = "25 30 0:23 / /sys ro,nosuid - sysfs sysfs rw\n";
        assert!(super::sysfs_read_only(pod));
        assert!(!super::sysfs_read_only(host));
        assert!(!super::sysfs_read_only(ro_mount), "the superblock decides, not the mount's flags");
        assert!(!super::sysfs_read_only("30 1 0:5 / / rw - ext4 /dev/vda ro\n"), "no /sys at all");
    }

    #[test]
    fn the_templates_devpts_is_capped_at_ptys_per_sandbox() {
        let spec: serde_json::Value = serde_json::from_str(crate::sandbox::spec::TEMPLATE).expect("template");
        let mounts = spec["mounts"].as_array().expect("mounts");
        let devpts = mounts.iter().find(|m| m["type"] == "devpts").expect("a devpts mount");
        let max = format!("max={PTYS_PER_SANDBOX}");
        assert!(devpts["options"].as_array().expect("options").iter().any(|o| o == max.as_str()), "{devpts}");
    }
}
