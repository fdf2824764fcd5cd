//! The worker's declared capacity (cores and memory), handed out to running jobs so that the
//! sum of their SKUs never exceeds it, however many slots are configured. A job waits here,
//! still `queued` and unacked, until its SKU's share is free.

use tokio::sync::{Semaphore, SemaphorePermit};

/// Cores (in millicores) and memory (in MiB) left to hand out.
#[derive(Debug)]
pub struct Capacity {
    total_millicores: usize,
    millicores: Semaphore,
    mebibytes: Semaphore,
}

/// A job's share of the capacity, given back when dropped.
#[derive(Debug)]
pub struct Reservation<'a> {
    _cpu: SemaphorePermit<'a>,
    _memory: SemaphorePermit<'a>,
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
    pub fn new(cpus: f64, memory_bytes: u64) -> Self {
        Capacity {
            total_millicores: millicores(cpus) as usize,
            millicores: Semaphore::new(millicores(cpus) as usize),
            mebibytes: Semaphore::new(mebibytes(memory_bytes) as usize),
        }
    }

    /// True when no job holds any of the capacity (nothing runs).
    pub fn is_idle(&self) -> bool {
        self.millicores.available_permits() == self.total_millicores
    }

    /// Waits until `cpus` cores and `memory_bytes` are free and takes them. Always in the same
    /// order (cores, then memory), so two waiting jobs cannot deadlock. A request larger than
    /// the whole capacity would wait forever: settings refuse to serve such a SKU.
    pub async fn reserve(&self, cpus: f64, memory_bytes: u64) -> Reservation<'_> {
        let cpu = self.millicores.acquire_many(millicores(cpus)).await;
        let memory = self.mebibytes.acquire_many(mebibytes(memory_bytes)).await;
        match (cpu, memory) {
            (Ok(cpu), Ok(memory)) => {
                let memory_bytes = i64::try_from(memory_bytes).unwrap_or(i64::MAX);
                crate::metrics::capacity_held(cpus, memory_bytes);
                Reservation { _cpu: cpu, _memory: memory, cpus, memory_bytes }
            }
            // The semaphores are never closed.
            _ => unreachable!("capacity semaphores closed"),
        }
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
}
