//! Per-sandbox CPU sets, allocated by the worker like the kubelet's static CPU manager: a
//! sandbox of a SKU with `cpus` cores is pinned (`linux.resources.cpu.cpus`, a cpuset cgroup,
//! v1 or v2: libcontainer writes it) to `ceil(cpus)` CPUs of its own, so that every CPU count a
//! program reads (`sched_getaffinity`, `nproc`, Node's `os.availableParallelism()`, and Python's
//! `os.cpu_count()` through `PYTHON_CPU_COUNT`) is the SKU's cores, and default pools and
//! `n_jobs=-1` fit the sandbox.
//!
//! Where the host lacks the cores: a sandbox never gets more CPUs than the host has (on a
//! 2-core host an L sandbox sees 2), and when every CPU is already held the sandbox shares the
//! CPUs with the fewest holders (kubelet's shared pool). The CFS quota still caps the time
//! each sandbox gets, so sharing changes which CPUs run a job, never how much CPU time it may
//! use. Exclusivity holds among the sandboxes of one worker (one worker a machine, as the
//! operations guide says).

use std::sync::{Mutex, OnceLock};

/// The CPUs of this machine the worker hands out, with how many sandboxes hold each.
#[derive(Debug)]
pub struct CpuPool {
    cpus: Vec<u32>,
    holders: Mutex<Vec<u32>>,
}

/// CPUs held by one sandbox, given back when dropped.
#[derive(Debug)]
pub struct CpuLease {
    pool: &'static CpuPool,
    /// Indexes into `pool.cpus`.
    held: Vec<usize>,
}

impl CpuPool {
    /// A pool of `cpus` (CPU numbers), none held.
    pub fn new(mut cpus: Vec<u32>) -> Self {
        cpus.sort_unstable();
        cpus.dedup();
        if cpus.is_empty() {
            cpus.push(0);
        }
        let holders = Mutex::new(vec![0; cpus.len()]);
        CpuPool { cpus, holders }
    }

    /// The worker's pool: the CPUs sandboxes may use ([`super::cgroup::available_cpus`]), read
    /// once.
    pub fn global() -> &'static CpuPool {
        static POOL: OnceLock<CpuPool> = OnceLock::new();
        POOL.get_or_init(|| CpuPool::new(super::cgroup::available_cpus()))
    }

    /// The CPUs a sandbox of `cores` (a SKU's `cpus`) is pinned to, and so the CPU count its
    /// program sees: `ceil(cores)`, at least 1, at most the pool's size.
    pub fn count_for(&self, cores: f64) -> usize {
        let wanted = if cores.is_finite() && cores > 0.0 { cores.ceil() as usize } else { 1 };
        wanted.clamp(1, self.cpus.len())
    }

    /// Takes [`Self::count_for`]`(cores)` CPUs: those held by the fewest sandboxes (free ones
    /// first), lowest numbers first among equals.
    pub fn lease(&'static self, cores: f64) -> CpuLease {
        let count = self.count_for(cores);
        let mut holders = self.holders.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut order: Vec<usize> = (0..self.cpus.len()).collect();
        order.sort_by_key(|&i| (holders[i], i));
        let mut held: Vec<usize> = order.into_iter().take(count).collect();
        held.sort_unstable();
        for &i in &held {
            holders[i] += 1;
        }
        CpuLease { pool: self, held }
    }
}

impl CpuPool {
    /// Every CPU of the pool in the kernel's list format: where a sandbox holding no lease (a
    /// warm one, waiting) may run.
    pub fn all_list(&self) -> String {
        super::cgroup::format_cpu_list(&self.cpus)
    }
}

impl CpuLease {
    /// The CPU numbers held.
    pub fn cpus(&self) -> Vec<u32> {
        self.held.iter().map(|&i| self.pool.cpus[i]).collect()
    }

    /// The held CPUs in the kernel's list format, for `linux.resources.cpu.cpus`.
    pub fn cpu_list(&self) -> String {
        super::cgroup::format_cpu_list(&self.cpus())
    }
}

impl Drop for CpuLease {
    fn drop(&mut self) {
        let mut holders = self.pool.holders.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for &i in &self.held {
            holders[i] = holders[i].saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(cpus: Vec<u32>) -> &'static CpuPool {
        Box::leak(Box::new(CpuPool::new(cpus)))
    }

    #[test]
    fn sandboxes_get_cpus_of_their_own_while_there_are_free_ones() {
        let pool = pool(vec![0, 1, 2, 3, 4, 5]);
        let s = pool.lease(1.0);
        let m = pool.lease(2.0);
        let half = pool.lease(0.5);
        assert_eq!(s.cpus(), [0]);
        assert_eq!(m.cpus(), [1, 2]);
        assert_eq!(half.cpus(), [3]);
        drop(m);
        // The freed CPUs are taken again before any held one is shared.
        let l = pool.lease(3.0);
        assert_eq!(l.cpus(), [1, 2, 4]);
        assert_eq!(l.cpu_list(), "1-2,4");
    }

    #[test]
    fn without_free_cpus_the_least_held_are_shared() {
        let pool = pool(vec![0, 1]);
        let a = pool.lease(1.0);
        let b = pool.lease(1.0);
        assert_eq!((a.cpus(), b.cpus()), (vec![0], vec![1]));
        let c = pool.lease(1.0);
        assert_eq!(c.cpus(), [0]);
        let d = pool.lease(1.0);
        assert_eq!(d.cpus(), [1]);
        drop((a, c));
        assert_eq!(pool.lease(1.0).cpus(), [0], "cpu 0 is free again, cpu 1 still held by b and d");
    }

    #[test]
    fn a_sandbox_never_sees_more_cpus_than_the_host_has() {
        let pool = pool(vec![4, 7]);
        assert_eq!(pool.count_for(1.0), 1);
        assert_eq!(pool.count_for(1.5), 2);
        assert_eq!(pool.count_for(8.0), 2);
        assert_eq!(pool.count_for(0.0), 1);
        assert_eq!(pool.lease(8.0).cpus(), [4, 7]);
    }
}
