//! The worker's own copies of the notebook states its session jobs saved, by SHA-256
//! (`<data_dir>/<worker id>.state-cache/<sha256>`): the next cell of a session on this worker
//! restores its state from here instead of downloading it from S3 and hashing it again.
//!
//! Only the worker writes here, from a state it hashed itself ([`super::read_state`]), and
//! the directory is not in any sandbox: a cached file is trusted to be its name's content.
//! Bounded by `sessions.state_cache_bytes`, oldest (least recently used) first out. Best
//! effort: any failure is a miss (the state comes from S3).

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use tokio::io::AsyncSeekExt;

/// The cache of one worker.
#[derive(Debug, Clone)]
pub(crate) struct StateCache {
    dir: PathBuf,
    budget: u64,
}

/// A SHA-256 as the cache names files: 64 lower-case hex digits.
fn valid(sha256: &str) -> bool {
    sha256.len() == 64 && sha256.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl StateCache {
    /// The cache in `dir`, at most `budget` bytes (0: no cache).
    pub(crate) fn new(dir: PathBuf, budget: u64) -> Self {
        StateCache { dir, budget }
    }

    /// Copies the cached state `sha256` of `size` bytes into `dest` (an open, empty file of the
    /// job's). False when it is not cached (or cannot be copied: `dest` may then hold part of
    /// it, and the caller truncates it before downloading).
    pub(crate) async fn copy_to(&self, sha256: &str, size: u64, dest: &mut tokio::fs::File) -> bool {
        if self.budget == 0 || !valid(sha256) {
            crate::metrics::state_cache("miss");
            return false;
        }
        let path = self.dir.join(sha256);
        let Ok(dest) = dest.try_clone().await.map(tokio::fs::File::into_std) else { return false };
        let dest = dest.await;
        // std's copy (copy_file_range in the kernel), not tokio's 8 KiB round trips.
        let copied = tokio::task::spawn_blocking(move || {
            let mut cached = std::fs::File::open(&path)?;
            let meta = cached.metadata()?;
            if !meta.is_file() || meta.len() != size {
                return Ok(false);
            }
            let mut dest = dest;
            let copied = std::io::copy(&mut cached, &mut dest)? == size;
            if copied {
                // Recently used: last to be evicted.
                cached.set_modified(SystemTime::now())?;
            }
            Ok::<_, std::io::Error>(copied)
        })
        .await
        .is_ok_and(|r| r.is_ok_and(|copied| copied));
        crate::metrics::state_cache(if copied { "hit" } else { "miss" });
        copied
    }

    /// Keeps a copy of `file` (a state this worker hashed: `sha256`, `size` bytes), read from
    /// its start and left at its start; then evicts the least recently used beyond the budget.
    pub(crate) async fn keep(&self, file: &mut tokio::fs::File, sha256: &str, size: u64) {
        if self.budget == 0 || size > self.budget || !valid(sha256) {
            return;
        }
        let path = self.dir.join(sha256);
        if tokio::fs::metadata(&path).await.is_ok_and(|m| m.len() == size) {
            let _ = std::fs::File::open(&path).and_then(|f| f.set_modified(SystemTime::now()));
            return;
        }
        if tokio::fs::create_dir_all(&self.dir).await.is_err() {
            return;
        }
        let partial = self.dir.join(format!(".{sha256}.{:016x}", rand::random::<u64>()));
        let Ok(source) = file.try_clone().await else { return };
        let source = source.into_std().await;
        let target = path.clone();
        let temp = partial.clone();
        // std's copy (copy_file_range in the kernel), from the start, then renamed into place.
        let copied = tokio::task::spawn_blocking(move || {
            use std::io::Seek;
            let mut source = source;
            let mut out = std::fs::File::create(&temp)?;
            source.seek(std::io::SeekFrom::Start(0))?;
            let n = std::io::copy(&mut source, &mut out)?;
            if n != size {
                return Err(std::io::Error::other("the state changed size while copied"));
            }
            std::fs::rename(&temp, &target)
        })
        .await;
        // The clone shares the file offset: back to the start for the caller.
        let _ = file.seek(std::io::SeekFrom::Start(0)).await;
        if !copied.is_ok_and(|r| r.is_ok()) {
            let _ = tokio::fs::remove_file(&partial).await;
            return;
        }
        let (dir, budget) = (self.dir.clone(), self.budget);
        let _ = tokio::task::spawn_blocking(move || evict(&dir, budget)).await;
    }
}

/// Removes the least recently used files of `dir` until the rest fit in `budget` bytes (a
/// half-written copy of another job's counts too, and goes when it is the oldest).
fn evict(dir: &Path, budget: u64) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut files: Vec<(SystemTime, u64, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let meta = e.metadata().ok().filter(std::fs::Metadata::is_file)?;
            Some((meta.modified().ok()?, meta.len(), e.path()))
        })
        .collect();
    files.sort_by_key(|f| std::cmp::Reverse(f.0));
    let mut kept = 0u64;
    for (_, len, path) in files {
        kept += len;
        if kept > budget {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_kept_state_is_copied_back_and_the_oldest_goes_first() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = StateCache::new(dir.path().join("cache"), 10);
        let sha = |c: char| c.to_string().repeat(64);
        let mut source = tokio::fs::File::from_std(tempfile::tempfile().expect("file"));
        tokio::io::AsyncWriteExt::write_all(&mut source, b"0123456").await.expect("write");
        cache.keep(&mut source, &sha('a'), 7).await;
        let mut dest = tokio::fs::File::from_std(tempfile::tempfile().expect("file"));
        assert!(cache.copy_to(&sha('a'), 7, &mut dest).await);
        dest.seek(std::io::SeekFrom::Start(0)).await.expect("seek");
        let mut back = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut dest, &mut back).await.expect("read");
        assert_eq!(back, "0123456");
        // Another size, a name that is no SHA-256, an unknown state: misses.
        assert!(!cache.copy_to(&sha('a'), 8, &mut dest).await);
        assert!(!cache.copy_to("../../etc/passwd", 7, &mut dest).await);
        assert!(!cache.copy_to(&sha('b'), 7, &mut dest).await);
        // A second state of 7 bytes passes the budget of 10: the older goes.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        cache.keep(&mut source, &sha('b'), 7).await;
        assert!(!cache.copy_to(&sha('a'), 7, &mut dest).await, "evicted");
        let mut dest = tokio::fs::File::from_std(tempfile::tempfile().expect("file"));
        assert!(cache.copy_to(&sha('b'), 7, &mut dest).await);
    }
}
