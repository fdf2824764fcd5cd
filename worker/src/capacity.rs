//! The worker's declared capacity (cores and memory), handed out to running jobs so that the
//! sum of their SKUs never exceeds it, however many slots are configured. A job waits here,
//! still `queued` and unacked, until its SKU's share is free.

use tokio::sync::{Semaphore, SemaphorePermit};

/// Cores (in millicores) and memory (in MiB) left to hand out.
#[derive(Debug)]
pub(crate) struct Capacity {
    total_millicores: usize,
    millicores: Semaphore,
    mebibytes: Semaphore,
}

/// A job's share of the capacity, given back when dropped.
#[derive(Debug)]
pub(crate) struct Reservation<'a> {
    capacity: &'a Capacity,
    _cpu: SemaphorePermit<'a>,
    _memory: SemaphorePermit<'a>,
    /// Memory taken on top by [`Reservation::try_grow_memory`].
    _extra: Option<SemaphorePermit<'a>>,
    cpus: f64,
    memory_bytes: i64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        crate::metrics::capacity_held(-self.cpus, -self.memory_bytes);
    }
}

fn millicores(cpus: f64) -> u32 {
    (cpus * 1000.0).ceil().clamp(0.0, f64::from(u32::MAX)) as u32
}

fn mebibytes(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(1 << 20)).unwrap_or(u32::MAX)
}

impl Capacity {
    /// A capacity of `cpus` cores and `memory_bytes` of memory.
    pub(crate) fn new(cpus: f64, memory_bytes: u64) -> Self {
        Capacity {
            total_millicores: millicores(cpus) as usize,
            millicores: Semaphore::new(millicores(cpus) as usize),
            mebibytes: Semaphore::new(mebibytes(memory_bytes) as usize),
        }
    }

    /// True when no job holds any of the capacity (nothing runs).
    pub(crate) fn is_idle(&self) -> bool {
        self.millicores.available_permits() == self.total_millicores
    }

    /// Waits until `cpus` cores and `memory_bytes` are free and takes them. Always in the same
    /// order (cores, then memory), so two waiting jobs cannot deadlock. A request larger than
    /// the whole capacity would wait forever: settings refuse to serve such a SKU.
    pub(crate) async fn reserve(&self, cpus: f64, memory_bytes: u64) -> Reservation<'_> {
        let cpu = self.millicores.acquire_many(millicores(cpus)).await;
        let memory = self.mebibytes.acquire_many(mebibytes(memory_bytes)).await;
        match (cpu, memory) {
            (Ok(cpu), Ok(memory)) => {
                let memory_bytes = i64::try_from(memory_bytes).unwrap_or(i64::MAX);
                crate::metrics::capacity_held(cpus, memory_bytes);
                Reservation { capacity: self, _cpu: cpu, _memory: memory, _extra: None, cpus, memory_bytes }
            }
            // The semaphores are never closed.
            _ => unreachable!("capacity semaphores closed"),
        }
    }
}

impl Reservation<'_> {
    /// Takes `bytes` more memory for the job if that much is free now, without waiting; false
    /// (nothing taken) when it is not, or when the reservation grew already. A warm start asks
    /// for what the warm-up holds, so that its job gets the SKU's whole memory without the
    /// worker's memory being overcommitted (test: a_warm_start_leaves_the_job_the_memory_of_a_cold_one
    /// in tests/warm.rs).
    pub(crate) fn try_grow_memory(&mut self, bytes: u64) -> bool {
        if self._extra.is_some() {
            return false;
        }
        let Ok(permit) = self.capacity.mebibytes.try_acquire_many(mebibytes(bytes)) else { return false };
        self._extra = Some(permit);
        let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
        crate::metrics::capacity_held(0.0, bytes);
        self.memory_bytes = self.memory_bytes.saturating_add(bytes);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn reservations_never_exceed_the_capacity() {
        let capacity = Capacity::new(2.0, 4 << 30);
        let m = capacity.reserve(2.0, 4 << 30).await;
        let blocked = tokio::time::timeout(Duration::from_millis(50), capacity.reserve(1.0, 1 << 30)).await;
        assert!(blocked.is_err(), "a 1-core job fitted beside a 2-core job on 2 cores");
        drop(m);
        let s1 = capacity.reserve(1.0, 2 << 30).await;
        let s2 = tokio::time::timeout(Duration::from_millis(50), capacity.reserve(1.0, 2 << 30)).await;
        assert!(s2.is_ok(), "two 1-core jobs fit on 2 cores");
        drop(s1);
    }

    #[tokio::test]
    async fn a_reservation_grows_only_into_free_memory() {
        let capacity = Capacity::new(2.0, 4 << 30);
        let mut a = capacity.reserve(1.0, 3 << 30).await;
        assert!(!a.try_grow_memory(2 << 30), "grew past the capacity");
        assert!(a.try_grow_memory(1 << 30));
        assert!(!a.try_grow_memory(1 << 20), "grew twice");
        let blocked = tokio::time::timeout(Duration::from_millis(50), capacity.reserve(1.0, 1 << 20)).await;
        assert!(blocked.is_err(), "the grown memory was handed out again");
        drop(a);
        let whole = tokio::time::timeout(Duration::from_millis(50), capacity.reserve(2.0, 4 << 30)).await;
        assert!(whole.is_ok(), "the grown memory was not given back");
    }
}
