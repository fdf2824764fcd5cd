//! What the settings read of the host: its memory, its name, the worker's own binary, the
//! subordinate id ranges of its users, and a lease of user-namespace ids shared with the other
//! workers of the machine. Kept apart so that [`RawConfig::validate`](super::RawConfig::validate)
//! reads as the checks it makes.

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The host's name (`/etc/hostname`), the default worker id; `worker` when unreadable.
pub(super) fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_owned()).unwrap_or_else(|_| "worker".into())
}

/// `name` beside the running binary (the default `sandq-container` helper).
///
/// # Errors
/// The running binary's path cannot be read.
pub(super) fn beside_own_binary(name: &str) -> std::io::Result<PathBuf> {
    Ok(std::env::current_exe()?.with_file_name(name))
}

/// The first entry of `/etc/subuid` or `/etc/subgid` whose ids overlap `range`, with its file.
pub(super) fn subordinate_conflict(range: std::ops::Range<u64>) -> Option<(&'static str, String)> {
    ["/etc/subuid", "/etc/subgid"].into_iter().find_map(|file| {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        subordinate_overlap(&text, range.clone()).map(|entry| (file, entry))
    })
}

/// The host's memory, bytes (`MemTotal` of `/proc/meminfo`; 0 when unreadable).
pub(super) fn host_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().find_map(|l| l.strip_prefix("MemTotal:").map(|v| v.trim().trim_end_matches("kB").trim().to_owned())))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Default first host id of the sandboxes' user namespace ranges: `0x7000_0000`
/// (1,879,048,192). It lies above Debian's subordinate ids (`SUB_UID_MIN` 100,000 to
/// `SUB_UID_MAX` 600,100,000 in `login.defs`, which `useradd` hands out) and above systemd's
/// container ranges (524,288 to 1,879,048,191, `nspawn`), in the range systemd leaves unused
/// below its foreign range at 2,147,352,576 (<https://systemd.io/UIDS-GIDS/>): room for 4,094
/// ranges of 65,536 ids.
pub const DEFAULT_USERNS_HOST_BASE: u32 = 0x7000_0000;

/// Ranges of 65,536 ids in one lease of `worker.userns_lease_dir`: the same for every worker,
/// so that workers of different sizes sharing the dir never overlap (64 covers, say, 16 slots and
/// 24 warm sandboxes); from the default base, 576 leases fit below `u32::MAX`.
pub const USERNS_LEASE_RANGES: u64 = 64;

/// Takes the first free lease `userns-<k>.lock` (`k < leases`) in `dir`, creating the dir and the
/// file as needed: an exclusive, non-blocking `flock` (`File::try_lock`) that the kernel drops
/// when the last descriptor of the file closes, so a killed worker's lease is free at once.
///
/// # Errors
/// [`LeaseError`], naming the dir: it cannot be made or opened, or all `leases` are taken.
pub(super) fn take_userns_lease(dir: &Path, leases: usize) -> Result<(usize, std::fs::File), LeaseError> {
    std::fs::create_dir_all(dir).map_err(|source| LeaseError::Dir { dir: dir.to_path_buf(), source })?;
    for k in 0..leases {
        let path = dir.join(format!("userns-{k}.lock"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|source| LeaseError::Open { path: path.clone(), source })?;
        match file.try_lock() {
            Ok(()) => return Ok((k, file)),
            Err(std::fs::TryLockError::WouldBlock) => continue,
            Err(std::fs::TryLockError::Error(source)) => return Err(LeaseError::Lock { path, source }),
        }
    }
    Err(LeaseError::AllTaken { dir: dir.to_path_buf(), leases })
}

/// Why no lease of user-namespace ids could be taken.
#[derive(Debug, thiserror::Error)]
pub(super) enum LeaseError {
    /// The lease dir cannot be made.
    #[error("worker.userns_lease_dir {}: {source}", dir.display())]
    Dir {
        /// `worker.userns_lease_dir`.
        dir: PathBuf,
        /// The I/O error of creating it.
        source: std::io::Error,
    },
    /// A lease file cannot be opened (a symlink is refused: `O_NOFOLLOW`).
    #[error("worker.userns_lease_dir: {}: {source}", path.display())]
    Open {
        /// The lease file (`<dir>/userns-<k>.lock`).
        path: PathBuf,
        /// The I/O error of opening it.
        source: std::io::Error,
    },
    /// A lease file cannot be locked for another reason than another holder.
    #[error("worker.userns_lease_dir: lock {}: {source}", path.display())]
    Lock {
        /// The lease file (`<dir>/userns-<k>.lock`).
        path: PathBuf,
        /// The `flock` error (not "held by another").
        source: std::io::Error,
    },
    /// Other workers hold every lease.
    #[error("worker.userns_lease_dir {}: all {leases} leases of user-namespace ids are held by other workers", dir.display())]
    AllTaken {
        /// `worker.userns_lease_dir`.
        dir: PathBuf,
        /// How many leases fit the id space.
        leases: usize,
    },
}

/// The first line of an `/etc/subuid` / `/etc/subgid` text (`name:first:count`) whose ids
/// overlap `range`; malformed lines are ignored (the file is the shadow tools' to check).
pub(super) fn subordinate_overlap(text: &str, range: std::ops::Range<u64>) -> Option<String> {
    text.lines().find_map(|line| {
        let mut fields = line.trim().split(':');
        let (_, first, count) = (fields.next()?, fields.next()?.parse::<u64>().ok()?, fields.next()?.parse::<u64>().ok()?);
        (first < range.end && range.start < first + count).then(|| line.trim().to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subordinate_ranges_that_touch_the_sandbox_ids_are_found() {
        // Debian's first `useradd` entry: ids 100000..165536.
        let text = "# comment\nalice:100000:65536\nbroken line\nbob:165536:65536\n";
        assert_eq!(subordinate_overlap(text, 165_535..165_536).as_deref(), Some("alice:100000:65536"));
        assert_eq!(subordinate_overlap(text, 165_536..165_537).as_deref(), Some("bob:165536:65536"));
        assert_eq!(subordinate_overlap(text, 50_000..100_000), None, "ends right before alice's first id");
        assert_eq!(subordinate_overlap(text, 231_072..300_000), None, "starts right after bob's last id");
        let base = u64::from(DEFAULT_USERNS_HOST_BASE);
        assert_eq!(subordinate_overlap(text, base..base + 40 * 65_536), None);
        // The default sits above login.defs' SUB_UID_MAX (600,100,000) and systemd's container
        // ranges (up to 1,879,048,191), below its foreign range (2,147,352,576).
        assert!(base > 1_879_048_191 && base + 4094 * 65_536 <= 2_147_352_576);
    }

    #[test]
    fn workers_sharing_a_lease_dir_take_distinct_leases_and_a_closed_one_is_free_again() {
        let dir = std::env::temp_dir().join(format!("sandq-lease-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (a, file_a) = take_userns_lease(&dir, 3).expect("a free lease");
        let (b, _file_b) = take_userns_lease(&dir, 3).expect("a free lease");
        let (c, _file_c) = take_userns_lease(&dir, 3).expect("a free lease");
        assert_eq!((a, b, c), (0, 1, 2), "each lock is its own open file description, so each taker waits its turn");
        let full = take_userns_lease(&dir, 3).expect_err("all taken");
        let full = full.to_string();
        assert!(full.contains("all 3 leases"), "{full}");
        drop(file_a); // the kernel drops the flock with the last descriptor, as at a worker's exit
        assert_eq!(take_userns_lease(&dir, 3).expect("lease 0 again").0, 0);
        // A planted symlink is not followed (O_NOFOLLOW): the lease is refused, not taken.
        let dir2 = dir.join("planted");
        std::fs::create_dir_all(&dir2).expect("dir");
        std::os::unix::fs::symlink("/etc/hostname", dir2.join("userns-0.lock")).expect("symlink");
        assert!(take_userns_lease(&dir2, 1).is_err());
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
