//! Start-up on the host, before the tokio runtime starts (and so before any job): the worker's
//! dirs, the host-wide limits the sandboxes share, a writable sysfs, whatever an earlier run of
//! this worker left (side cgroups, containers, job dirs), and the outbound network.

use std::path::PathBuf;

use tracing::{info, warn};

use crate::settings::Settings;

/// Why the host could not be made ready (the worker does not start).
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// A dir of the worker's could not be made or read.
    #[error("cannot create {}: {source}", path.display())]
    Dir {
        /// `worker.jobs_dir` or `worker.state_root`.
        path: PathBuf,
        /// The I/O error of creating or listing it.
        source: std::io::Error,
    },
    /// A host-wide limit or sysfs could not be set.
    #[error(transparent)]
    Limits(#[from] crate::sandbox::host_limits::HostLimitError),
    /// `sandq-container cleanup` could not run or failed.
    #[error("sandq-container cleanup failed: {0}")]
    Cleanup(String),
    /// A leftover job dir could not be removed.
    #[error("cannot remove {}", .0.display())]
    Leftover(PathBuf),
    /// The sandboxes' `resolv.conf` could not be written.
    #[error("cannot write the sandboxes' resolv.conf: {0}")]
    ResolvConf(#[source] std::io::Error),
    /// The outbound network could not be set up.
    #[error("cannot set up the outbound network (set worker.outbound_network = false to run without it): {0}")]
    Network(#[source] crate::sandbox::network::NetworkError),
}

/// Makes the host ready for `settings`' worker, in this order: its dirs; the host tables every
/// sandbox draws from (open files, pids, ptys), sized so that the sandboxes' own limits run out
/// first; a writable sysfs; the side cgroups, containers and job dirs a previous run of this
/// worker id left (crash safety); and, for outbound jobs, the bridge, firewall and resolvers.
/// `nameservers_configured`: `worker.nameservers` was set (else a host resolver left out is
/// warned about).
///
/// # Errors
/// [`HostError`], naming the step.
pub fn prepare(settings: &Settings, nameservers_configured: bool) -> Result<(), HostError> {
    for dir in [&settings.jobs_dir, &settings.state_root] {
        std::fs::create_dir_all(dir).map_err(|source| HostError::Dir { path: dir.clone(), source })?;
    }
    for (path, from, to) in crate::sandbox::host_limits::ensure(settings.capacity_memory_bytes)? {
        info!(path, from, to, "raised a host-wide limit the sandboxes share");
    }
    if crate::sandbox::host_limits::ensure_sysfs_writable()? {
        info!("remounted /sys read-write: its sysfs was read-only (a Kubernetes pod's), which sandboxes cannot mount their own beside");
    }
    crate::sandbox::cgroup::set_side_owner(&format!("{}\0{}", settings.worker_id, settings.state_root.display()));
    let removed = crate::sandbox::cgroup::remove_leftover_side_cgroups();
    if removed > 0 {
        info!(removed, "removed side cgroups an earlier run of this worker left (their processes killed)");
    }
    let status = std::process::Command::new(&settings.container_helper)
        .arg("cleanup")
        .arg(&settings.state_root)
        .env_clear()
        .status()
        .map_err(|e| HostError::Cleanup(format!("cannot run it: {e}")))?;
    if !status.success() {
        return Err(HostError::Cleanup(status.to_string()));
    }
    let entries = std::fs::read_dir(&settings.jobs_dir).map_err(|source| HostError::Dir { path: settings.jobs_dir.clone(), source })?;
    for entry in entries.flatten() {
        crate::jobdir::remove_job_dir(&entry.path());
        if entry.path().exists() {
            return Err(HostError::Leftover(entry.path()));
        }
    }
    if settings.network.outbound {
        if !nameservers_configured {
            for ns in crate::sandbox::network::host_nameservers().into_iter().filter(|ns| !settings.network.nameservers.contains(ns)) {
                warn!(%ns, nameservers = ?settings.network.nameservers, "the host's nameserver is in a blocked range: outbound sandboxes use others (set worker.nameservers to name it on purpose)");
            }
        }
        crate::sandbox::network::write_resolv_conf(&settings.resolv_conf(), &settings.network.nameservers)
            .map_err(HostError::ResolvConf)?;
        crate::sandbox::network::setup_host(&settings.network.nameservers, &settings.network.blocked_ranges).map_err(HostError::Network)?;
    }
    Ok(())
}
