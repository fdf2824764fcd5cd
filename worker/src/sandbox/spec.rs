//! The per-job OCI runtime config: `oci-bundles/config.template.json` (read-only rootfs,
//! writable `/work`, tmpfs `/tmp` and `/dev/shm`, own pid/net/ipc/uts/mount/cgroup/time namespaces, no
//! capabilities, `noNewPrivileges`, masked `/proc` paths) filled in with the job's command,
//! environment, paths and SKU limits.

use std::path::{Path, PathBuf};

use oci_spec::runtime::{LinuxCpu, LinuxIdMapping, LinuxMemory, LinuxNamespace, LinuxNamespaceType, LinuxPids, LinuxSeccomp, Spec};

/// The template, compiled in so that a worker binary and its sandbox policy cannot drift apart.
pub const TEMPLATE: &str = include_str!("../../../oci-bundles/config.template.json");

/// The seccomp profile (`oci-bundles/seccomp.json`): an allowlist in the spirit of Docker's
/// default profile, narrowed for a sandbox without capabilities (no namespace-creating
/// `clone`, no `unshare`/`setns`/`mount`, no `ptrace`, `bpf`, `perf_event_open`, `keyctl`,
/// `userfaultfd`, `io_uring`, AF_VSOCK sockets or 32-bit syscalls; `statx` asking for the
/// unique mount id, a host-wide count of mounts, gets EINVAL).
pub const SECCOMP: &str = include_str!("../../../oci-bundles/seccomp.json");

/// A user namespace mapping: container ids `0..size` are host ids `host_base..host_base+size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IdMap {
    /// First host uid/gid of the range.
    pub host_base: u32,
    /// Number of ids mapped.
    pub size: u32,
}

/// cgroup v1/v2 CPU period, microseconds (the kernel's default CFS period, 100 ms).
pub const CPU_PERIOD_US: u64 = 100_000;

/// TCP socket buffer memory a job may hold on cgroup v1 (`memory.kmem.tcp.limit_in_bytes`):
/// a quarter of its memory limit, at most 64 MiB. Past it the job's sockets are under memory
/// pressure (sends wait, windows shrink) rather than using the host's `tcp_mem`; 64 MiB keeps a
/// few fast connections at full speed.
pub fn tcp_buffer_limit(memory_bytes: u64) -> i64 {
    i64::try_from((memory_bytes / 4).min(64 << 20)).unwrap_or(i64::MAX)
}

/// Resource limits of one sandbox, from its SKU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SandboxLimits {
    /// CPU quota in cores (1.0 = one core's time per period).
    pub cpus: f64,
    /// Memory limit in bytes; swap is set equal, so the job cannot swap beyond it.
    pub memory_bytes: u64,
    /// Most processes and threads at once.
    pub pids: i64,
}

/// What varies per job.
#[derive(Debug, Clone)]
pub struct JobSandbox<'a> {
    /// The image's rootfs (shared, mounted read-only).
    pub rootfs: &'a Path,
    /// Host directory mounted read-write at `/work`.
    pub work_dir: &'a Path,
    /// Host directory mounted read-only at `/sandq` (the job's source code).
    pub src_dir: &'a Path,
    /// `linux.cgroupsPath`, absolute (`/sandq/<container id>`).
    pub cgroups_path: &'a str,
    /// argv of the program.
    pub args: Vec<String>,
    /// Environment, `NAME=value`.
    pub env: Vec<String>,
    /// uid and gid the program runs as inside the container.
    pub uid: u32,
    /// See `uid`.
    pub gid: u32,
    /// CPU, memory and process limits of the job's SKU, set on its cgroup.
    pub limits: SandboxLimits,
    /// The CPUs the sandbox is pinned to, in the kernel's list format (`0-1,4`;
    /// [`super::cpuset`]); `None`: any CPU.
    pub cpuset: Option<&'a str>,
    /// Own user namespace with this mapping (container root is then an unprivileged host
    /// uid); `None` keeps the host's user namespace.
    pub id_map: Option<IdMap>,
    /// Apply [`SECCOMP`].
    pub seccomp: bool,
    /// For outbound sandboxes: a file bind-mounted read-only at `/etc/resolv.conf`.
    pub resolv_conf: Option<&'a Path>,
    /// A file bind-mounted read-only over the image's CA bundle
    /// ([`crate::layout::SANDBOX_CA_BUNDLE`]): the image's CAs and the worker's extra ones.
    pub ca_bundle: Option<&'a Path>,
    /// A host directory (the job disk's `packages/`) bind-mounted read-write at
    /// [`crate::layout::SANDBOX_PACKAGES`]: packages the job installs; `src_dir` must hold a
    /// `packages` directory.
    pub packages_dir: Option<&'a Path>,
    /// A host directory (the job's outputs tmpfs) bind-mounted read-write at `/sandq/out`,
    /// where the notebook runner writes its outputs; `src_dir` must hold an `out` directory.
    pub out_dir: Option<&'a Path>,
    /// A host directory (the job disk's `in/`) bind-mounted read-only at
    /// [`crate::layout::SANDBOX_INPUT`]: the session state to restore; `src_dir` must hold an
    /// `in` directory.
    pub in_dir: Option<&'a Path>,
    /// The sandbox's clocks: `Some((boottime, monotonic))`, the host's `CLOCK_BOOTTIME` and
    /// `CLOCK_MONOTONIC` in whole seconds when the spec is made, subtracted in the sandbox's
    /// time namespace so that both start at about 0 when it starts; `None`: no time namespace
    /// (a kernel without them).
    pub host_clocks: Option<(i64, i64)>,
    /// The lowest CPU weight among the sandboxes (`cpu.shares` 2; v2 `cpu.weight` 1): a warm
    /// sandbox warming up, which yields to running jobs until its job is handed over
    /// ([`super::cgroup::set_cpu_priority`] then gives it the default).
    pub low_cpu_weight: bool,
}

/// Failure to make a job's spec.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The compiled-in template does not parse (a build defect; caught by unit tests).
    #[error("config template is invalid: {0}")]
    Template(#[from] serde_json::Error),
    /// The template lacks a section this code fills in.
    #[error("config template lacks {0}")]
    Missing(&'static str),
    /// Writing `config.json` failed.
    #[error("cannot write {path}: {source}")]
    Write {
        /// `<bundle>/config.json`.
        path: PathBuf,
        /// The I/O error of creating or writing it.
        source: std::io::Error,
    },
}

/// Makes the spec of one job from [`TEMPLATE`].
///
/// # Errors
/// [`SpecError::Template`] or [`SpecError::Missing`] (template defects).
pub fn build(job: &JobSandbox<'_>) -> Result<Spec, SpecError> {
    let mut spec: Spec = serde_json::from_str(TEMPLATE)?;
    let process = spec.process_mut().as_mut().ok_or(SpecError::Missing("process"))?;
    process.set_args(Some(job.args.clone()));
    process.set_env(Some(job.env.clone()));
    process.user_mut().set_uid(job.uid);
    process.user_mut().set_gid(job.gid);
    spec.root_mut().as_mut().ok_or(SpecError::Missing("root"))?.set_path(job.rootfs.to_path_buf());
    for mount in spec.mounts_mut().as_mut().ok_or(SpecError::Missing("mounts"))? {
        // /home/user is /work again, for programs written for E2B's sandboxes (docs/e2b.md).
        if mount.destination() == Path::new("/work") || mount.destination() == Path::new("/home/user") {
            mount.set_source(Some(job.work_dir.to_path_buf()));
        } else if mount.destination() == Path::new("/sandq") {
            mount.set_source(Some(job.src_dir.to_path_buf()));
        }
    }
    // The host's load average, task count and last pid show every job's activity: a file of
    // the job's own is bound over it (libcontainer allows binds over /proc/loadavg, as over
    // the other files LXCFS virtualises; test: host_disk_activity_and_paths_are_not_visible).
    let loadavg = oci_spec::runtime::MountBuilder::default()
        .destination("/proc/loadavg")
        .typ("bind")
        .source(job.src_dir.join(crate::layout::LOADAVG_FILE))
        .options(["rbind", "ro", "nosuid", "nodev", "noexec"].map(str::to_owned).to_vec())
        .build()
        .map_err(|_| SpecError::Missing("a valid loadavg mount"))?;
    spec.mounts_mut().get_or_insert_with(Vec::new).push(loadavg);
    if let Some(out_dir) = job.out_dir {
        let mount = oci_spec::runtime::MountBuilder::default()
            .destination("/sandq/out")
            .typ("bind")
            .source(out_dir)
            .options(["rbind", "rw", "nosuid", "nodev", "noexec"].map(str::to_owned).to_vec())
            .build()
            .map_err(|_| SpecError::Missing("a valid outputs mount"))?;
        spec.mounts_mut().get_or_insert_with(Vec::new).push(mount);
    }
    if let Some(in_dir) = job.in_dir {
        let mount = oci_spec::runtime::MountBuilder::default()
            .destination(crate::layout::SANDBOX_INPUT)
            .typ("bind")
            .source(in_dir)
            .options(["rbind", "ro", "nosuid", "nodev", "noexec"].map(str::to_owned).to_vec())
            .build()
            .map_err(|_| SpecError::Missing("a valid input mount"))?;
        spec.mounts_mut().get_or_insert_with(Vec::new).push(mount);
    }
    // The image's /etc/hostname and /etc/resolv.conf are the build host's: every sandbox gets
    // files of its own over them; an outbound one its resolvers (test:
    // no_host_path_visible_in_the_sandbox_names_the_job).
    let no_resolv = job.src_dir.join(crate::layout::NO_RESOLV_FILE);
    for (destination, source) in [
        ("/etc/hostname", job.src_dir.join(crate::layout::HOSTNAME_FILE)),
        ("/etc/resolv.conf", job.resolv_conf.map_or(no_resolv, Path::to_path_buf)),
    ] {
        let mount = oci_spec::runtime::MountBuilder::default()
            .destination(destination)
            .typ("bind")
            .source(source)
            .options(["rbind", "ro", "nosuid", "nodev", "noexec"].map(str::to_owned).to_vec())
            .build()
            .map_err(|_| SpecError::Missing("a valid /etc file mount"))?;
        spec.mounts_mut().get_or_insert_with(Vec::new).push(mount);
    }
    if let Some(packages_dir) = job.packages_dir {
        // Executable: installed packages hold native extensions and commands (like /work).
        let mount = oci_spec::runtime::MountBuilder::default()
            .destination(crate::layout::SANDBOX_PACKAGES)
            .typ("bind")
            .source(packages_dir)
            .options(["rbind", "rw", "nosuid", "nodev"].map(str::to_owned).to_vec())
            .build()
            .map_err(|_| SpecError::Missing("a valid packages mount"))?;
        spec.mounts_mut().get_or_insert_with(Vec::new).push(mount);
    }
    if let Some(ca_bundle) = job.ca_bundle {
        let mount = oci_spec::runtime::MountBuilder::default()
            .destination(crate::layout::SANDBOX_CA_BUNDLE)
            .typ("bind")
            .source(ca_bundle)
            .options(["rbind", "ro", "nosuid", "nodev", "noexec"].map(str::to_owned).to_vec())
            .build()
            .map_err(|_| SpecError::Missing("a valid CA bundle mount"))?;
        spec.mounts_mut().get_or_insert_with(Vec::new).push(mount);
    }
    let linux = spec.linux_mut().as_mut().ok_or(SpecError::Missing("linux"))?;
    linux.set_cgroups_path(Some(PathBuf::from(job.cgroups_path)));
    let resources = linux.resources_mut().as_mut().ok_or(SpecError::Missing("linux.resources"))?;
    let mut cpu = LinuxCpu::default();
    cpu.set_period(Some(CPU_PERIOD_US));
    cpu.set_quota(Some((job.limits.cpus * CPU_PERIOD_US as f64).round() as i64));
    if job.low_cpu_weight {
        cpu.set_shares(Some(2));
    }
    cpu.set_cpus(job.cpuset.map(str::to_owned));
    resources.set_cpu(Some(cpu));
    let mut memory = LinuxMemory::default();
    let bytes = i64::try_from(job.limits.memory_bytes).unwrap_or(i64::MAX);
    memory.set_limit(Some(bytes));
    memory.set_swap(Some(bytes));
    if !super::cgroup::is_v2() {
        // cgroup v1 charges TCP socket buffers to a job only once its kmem.tcp limit is set;
        // otherwise they count against the host's `tcp_mem` alone (2.2 GB of buffers were
        // queued by a job whose peak memory was 10 MiB). v2 charges them to memory.max (test:
        // tcp_buffers_are_charged_to_the_job in tests/hostile.rs).
        memory.set_kernel_tcp(Some(tcp_buffer_limit(job.limits.memory_bytes)));
    }
    resources.set_memory(Some(memory));
    let mut pids = LinuxPids::default();
    pids.set_limit(job.limits.pids);
    resources.set_pids(Some(pids));
    if job.seccomp {
        let profile: LinuxSeccomp = serde_json::from_str(SECCOMP)?;
        linux.set_seccomp(Some(profile));
    }
    // The host's disks under their real sysfs paths: `/sys/block` and its aliases are masked
    // in the template, but each link leads to a directory under `/sys/devices` whose `stat`
    // shows the disk's reads and writes, other jobs' included (test:
    // host_disk_activity_and_paths_are_not_visible in tests/hostile.rs).
    linux.masked_paths_mut().get_or_insert_with(Vec::new).extend(block_device_dirs().iter().cloned());
    // The boot-time and monotonic clocks are the host's since its boot: `/proc/uptime`, the
    // `btime` of `/proc/stat` (computed from the boot clock of the reader's time namespace),
    // `sysinfo(2)` and process start times identified the host. In a time namespace of its
    // own they count from the sandbox's start, warm or cold (test:
    // a_warm_start_gives_the_same_result_and_sandbox_as_a_cold_one in tests/warm.rs).
    match job.host_clocks {
        Some((boottime, monotonic)) => {
            let offset = |secs: i64| {
                let mut offset = oci_spec::runtime::LinuxTimeOffset::default();
                offset.set_secs(Some(-secs));
                offset
            };
            let offsets = [("boottime".to_owned(), offset(boottime)), ("monotonic".to_owned(), offset(monotonic))];
            linux.set_time_offsets(Some(offsets.into_iter().collect()));
        }
        None => {
            if let Some(namespaces) = linux.namespaces_mut() {
                namespaces.retain(|n| n.typ() != LinuxNamespaceType::Time);
            }
        }
    }
    if let Some(map) = job.id_map {
        let mapping: LinuxIdMapping = oci_spec::runtime::LinuxIdMappingBuilder::default()
            .container_id(0u32)
            .host_id(map.host_base)
            .size(map.size)
            .build()
            .map_err(|_| SpecError::Missing("a valid id mapping"))?;
        linux.set_uid_mappings(Some(vec![mapping]));
        linux.set_gid_mappings(Some(vec![mapping]));
        let mut user = LinuxNamespace::default();
        user.set_typ(LinuxNamespaceType::User);
        linux.namespaces_mut().get_or_insert_with(Vec::new).push(user);
    }
    Ok(spec)
}

/// The host's clocks for [`JobSandbox::host_clocks`], read now: `None` when the kernel has no
/// time namespaces.
pub fn host_clocks() -> Option<(i64, i64)> {
    crate::sys::time_namespaces_supported().then(crate::sys::boot_and_monotonic_secs)
}

/// The real sysfs directories of the host's disks and their controllers: the targets of the
/// links in `/sys/block` (but those under `/sys/devices/virtual/block`, masked whole in the
/// template; NVMe multipath disks under `/sys/devices/virtual/nvme-subsystem` included), of
/// the SCSI devices and hosts behind them (`/sys/class/scsi_device/*/device`, whose
/// `iorequest_cnt` counts the disk's commands; `/sys/class/scsi_host/*`, whose `host_busy`
/// counts those in flight)
/// and of the NVMe controllers and subsystems (`/sys/class/nvme*`: a volume's `serial`), read
/// once (a disk added later is not masked until the worker restarts).
pub fn block_device_dirs() -> &'static [String] {
    static DIRS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    DIRS.get_or_init(|| {
        let targets = |dir: &str, below: &str| -> Vec<std::path::PathBuf> {
            std::fs::read_dir(dir)
                .map(|entries| entries.flatten().filter_map(|e| std::fs::canonicalize(e.path().join(below)).ok()).collect())
                .unwrap_or_default()
        };
        let mut dirs: Vec<String> = targets("/sys/block", "")
            .into_iter()
            .chain(targets("/sys/class/scsi_device", "device"))
            .chain(targets("/sys/class/scsi_host", ""))
            .chain(targets("/sys/class/nvme", ""))
            .chain(targets("/sys/class/nvme-subsystem", ""))
            .filter(|p| p.starts_with("/sys/devices") && !p.starts_with("/sys/devices/virtual/block"))
            .filter_map(|p| p.to_str().map(str::to_owned))
            .collect();
        dirs.sort();
        dirs.dedup();
        dirs
    })
}

/// Writes `spec` as `<bundle>/config.json`.
///
/// # Errors
/// [`SpecError::Write`].
pub fn write(spec: &Spec, bundle: &Path) -> Result<(), SpecError> {
    let path = bundle.join("config.json");
    let bytes = serde_json::to_vec_pretty(spec)?;
    std::fs::write(&path, bytes).map_err(|source| SpecError::Write { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_is_filled_in() {
        let job = JobSandbox {
            rootfs: Path::new("/img/rootfs"),
            work_dir: Path::new("/jobs/a/work"),
            src_dir: Path::new("/jobs/a/src"),
            cgroups_path: "/sandq/a",
            args: vec!["python3".into(), "/sandq/main.py".into()],
            env: vec!["PATH=/usr/bin".into()],
            uid: 1000,
            gid: 1000,
            limits: SandboxLimits { cpus: 2.0, memory_bytes: 4 << 30, pids: 512 },
            cpuset: Some("2-3"),
            id_map: Some(IdMap { host_base: 100_000, size: 65_536 }),
            seccomp: true,
            resolv_conf: None,
            ca_bundle: Some(Path::new("/jobs/a/src/.ca-certificates.crt")),
            packages_dir: Some(Path::new("/jobs/a/disk/packages")),
            out_dir: None,
            in_dir: Some(Path::new("/jobs/a/disk/in")),
            host_clocks: Some((86_400, 86_000)),
            low_cpu_weight: false,
        };
        let spec = build(&job).expect("spec");
        let json = serde_json::to_value(&spec).expect("json");
        assert_eq!(json["root"]["path"], "/img/rootfs");
        assert_eq!(json["root"]["readonly"], true);
        assert_eq!(json["process"]["noNewPrivileges"], true);
        assert_eq!(json["process"]["capabilities"]["bounding"], serde_json::json!([]));
        assert_eq!(json["linux"]["resources"]["cpu"]["quota"], 200_000);
        assert_eq!(json["linux"]["resources"]["cpu"]["cpus"], "2-3");
        assert_eq!(json["linux"]["resources"]["memory"]["limit"], 4_i64 << 30);
        assert_eq!(json["linux"]["resources"]["memory"]["swap"], 4_i64 << 30);
        assert_eq!(json["linux"]["resources"]["pids"]["limit"], 512);
        let mounts = json["mounts"].as_array().expect("mounts");
        let work = mounts.iter().find(|m| m["destination"] == "/work").expect("work mount");
        assert_eq!(work["source"], "/jobs/a/work");
        let ca = mounts.iter().find(|m| m["destination"] == "/etc/ssl/certs/ca-certificates.crt").expect("CA bundle mount");
        assert_eq!(ca["source"], "/jobs/a/src/.ca-certificates.crt");
        assert!(ca["options"].as_array().expect("options").contains(&serde_json::json!("ro")));
        let packages = mounts.iter().find(|m| m["destination"] == "/sandq/packages").expect("packages mount");
        assert_eq!(packages["source"], "/jobs/a/disk/packages");
        assert!(packages["options"].as_array().expect("options").contains(&serde_json::json!("rw")));
        let namespaces: Vec<&str> = json["linux"]["namespaces"].as_array().expect("ns").iter().filter_map(|n| n["type"].as_str()).collect();
        assert_eq!(json["linux"]["uidMappings"][0]["hostID"], 100_000);
        assert_eq!(json["linux"]["seccomp"]["defaultAction"], "SCMP_ACT_ERRNO");
        for ns in ["pid", "network", "ipc", "uts", "mount", "user", "cgroup", "time"] {
            assert!(namespaces.contains(&ns), "{ns} namespace missing");
        }
        assert_eq!(json["linux"]["timeOffsets"]["boottime"]["secs"], -86_400);
        assert_eq!(json["linux"]["timeOffsets"]["monotonic"]["secs"], -86_000);
        let without = build(&JobSandbox { host_clocks: None, ..job }).expect("spec");
        let json = serde_json::to_value(&without).expect("json");
        assert!(json["linux"]["namespaces"].as_array().expect("ns").iter().all(|n| n["type"] != "time"), "{json}");
        assert!(json["linux"].get("timeOffsets").is_none());
    }
}
