//! The container cycle (create -> start -> exit -> stats -> delete) as the worker drives it:
//! one `sandq-container` helper exec'd per container, running `/bin/true` in the sandbox image,
//! with and without the user namespace and seccomp. Needs root and the image
//! (`scripts/services.sh`); reads the rootfs from the sandq config.
//!
//! `cargo bench -p sandq-worker --bench container_cycle`; numbers in docs/benchmarks.md.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use criterion::{criterion_group, criterion_main, Criterion};
use sandq_worker::sandbox::spec::{self, IdMap, JobSandbox, SandboxLimits};
use sandq_worker::sandbox::{Exit, SandboxReport, SandboxRequest};

fn rootfs() -> PathBuf {
    let path = sandq_core::config::config_path(None);
    let raw: sandq_worker::settings::RawConfig = sandq_core::config::load(&path).expect("sandq config");
    raw.worker.rootfs.expect("worker.rootfs in the sandq config")
}

fn cycle(root: &Path, rootfs: &Path, n: u64, userns: bool, seccomp: bool) -> SandboxReport {
    let id = format!("bench-{}-{n}", std::process::id());
    let dir = root.join(&id);
    let (bundle, work, src) = (dir.join("bundle"), dir.join("work"), dir.join("src"));
    for d in [&bundle, &work, &src] {
        std::fs::create_dir_all(d).expect("mkdir");
    }
    let id_map = userns.then_some(IdMap { host_base: 100_000, size: 65_536 });
    let cgroups_path = format!("/sandq/{id}");
    let sandbox = JobSandbox {
        rootfs,
        work_dir: &work,
        src_dir: &src,
        cgroups_path: &cgroups_path,
        args: vec!["/bin/true".into()],
        env: vec!["PATH=/usr/bin:/bin".into()],
        uid: 1000,
        gid: 1000,
        limits: SandboxLimits { cpus: 1.0, memory_bytes: 512 << 20, pids: 64 },
        cpuset: None,
        id_map,
        seccomp,
        resolv_conf: None,
        ca_bundle: None,
        packages_dir: None,
        out_dir: None,
        in_dir: None,
        host_clocks: spec::host_clocks(),
        low_cpu_weight: false,
    };
    spec::write(&spec::build(&sandbox).expect("spec"), &bundle).expect("write spec");
    let request = SandboxRequest {
        container_id: id,
        bundle,
        state_root: root.join("state"),
        stdin_path: None,
        timeout_ms: 10_000,
        report_path: dir.join("report.json"),
        cgroups_path,
        outbound: false,
        userns: id_map,
        warm: false,
        fork: None,
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_sandq-container"))
        .arg("run")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn helper");
    let mut line = serde_json::to_vec(&request).expect("json");
    line.push(b'\n');
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(&line).expect("request");
    let status = child.wait().expect("wait");
    drop(stdin);
    assert!(status.success());
    let report: SandboxReport = serde_json::from_slice(&std::fs::read(&request.report_path).expect("report")).expect("report json");
    assert_eq!(report.exit, Exit::Exited { code: 0 }, "{report:?}");
    std::fs::remove_dir_all(&dir).expect("cleanup");
    report
}

fn bench(c: &mut Criterion) {
    let rootfs = rootfs();
    let root = tempfile::tempdir_in("/var/lib").expect("tempdir");
    std::fs::set_permissions(root.path(), std::os::unix::fs::PermissionsExt::from_mode(0o711)).expect("chmod");
    let mut group = c.benchmark_group("container_cycle");
    group.sample_size(30);
    let mut n = 0;
    for (name, userns, seccomp) in
        [("plain", false, false), ("userns+seccomp", true, true), ("userns", true, false), ("seccomp", false, true)]
    {
        let mut phases = Vec::new();
        group.bench_function(name, |b| {
            b.iter(|| {
                n += 1;
                phases.push(cycle(root.path(), &rootfs, n, userns, seccomp));
            })
        });
        let median = |f: fn(&SandboxReport) -> u64| {
            let mut v: Vec<u64> = phases.iter().map(f).collect();
            v.sort_unstable();
            v[v.len() / 2] as f64 / 1000.0
        };
        println!(
            "{name}: median create {:.1} ms, start {:.1} ms, delete {:.1} ms (inside the helper, {} cycles)",
            median(|r| r.create_us),
            median(|r| r.start_us),
            median(|r| r.delete_us),
            phases.len()
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
