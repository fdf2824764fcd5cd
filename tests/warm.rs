//! Warm sandboxes (issue 8 part 1): a job handed a warm sandbox gives the same result, sees the
//! same sandbox and gets the same memory and CPUs of its own as one that starts cold; a warm
//! sandbox serves one job only; and a worker killed with SIGKILL while warm sandboxes wait
//! leaves nothing behind after restart. Workers of their own (an isolated namespace each), one
//! with warm sandboxes, one without.

use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use sandq_client::Client;
use sandq_schemas::{JobResult, JobSpec, JobStatus, OutputType, Sku};
use sandq_tests::{exits_within, isolated_worker_log, python_job, run, Isolated};

/// What a program can observe of its sandbox, as JSON: environment (less the job id), ids,
/// cwd, argv, user namespace size, mounts (mount point, root, fs type, options; not the
/// kernel's mount and device numbers, which vary per container, nor the host uid in options,
/// which varies per slot), rlimits, CPU affinity, files in
/// `/work` and `/tmp`, stdin; and, apart (`clocks`, which differ), the sandbox's boot and
/// monotonic clocks as `/proc/uptime`, `/proc/stat`'s `btime`, `clock_gettime` and `sysinfo(2)`
/// give them.
const PROBE: &str = r#"
import json, os, resource, sys
import re
mounts = []
for line in open("/proc/self/mountinfo"):
    f = line.split()
    sep = f.index("-")
    # uid=/gid= options name the sandbox's host ids, which differ by slot (own id range).
    options = re.sub(r"\b(uid|gid)=\d+", r"\1=N", f[sep + 3])
    mounts.append([f[4], f[3], f[sep + 1], f[5], options])
info = {
    "env": {k: v for k, v in os.environ.items() if k != "SANDQ_JOB_ID"},
    "ids": [os.getuid(), os.getgid(), os.geteuid(), os.getegid(), os.getgroups()],
    "cwd": os.getcwd(),
    "argv": sys.argv,
    "uid_map_size": open("/proc/self/uid_map").read().split()[2],
    "mounts": sorted(mounts),
    "rlimits": {n: resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")},
    "affinity": sorted(os.sched_getaffinity(0)),
    "work": sorted(os.listdir("/work")),
    "tmp": sorted(os.listdir("/tmp")),
    "stdin": sys.stdin.read(),
    "hostname": os.uname().nodename,
}
# The process's own state: capabilities, no_new_privs, seccomp, umask, CPUs and memory nodes,
# its cgroup, OOM score, nice, open descriptors, parent; and that it is in the namespaces of
# the sandbox's init (itself in a cold start).
status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
info["status"] = {k: status[k].strip() for k in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs",
                  "Seccomp", "Seccomp_filters", "Umask", "Cpus_allowed_list", "Mems_allowed_list"] if k in status}
info["cgroup"] = open("/proc/self/cgroup").read()
info["oom_score_adj"] = open("/proc/self/oom_score_adj").read()
info["nice"] = os.nice(0)
info["fds"] = sorted(os.listdir("/proc/self/fd"))
info["ppid"] = os.getppid()
# The interpreter's own state a start sets: its module path (the session packages' user site
# among it) and how its standard streams write.
info["sys_path"] = sys.path
info["streams"] = [[type(s.buffer).__name__, s.write_through, s.line_buffering] for s in (sys.stdout, sys.stderr)]
info["flags"] = [sys.flags.optimize, sys.flags.dont_write_bytecode, sys.flags.no_user_site, sys.flags.ignore_environment]
info["in_init_namespaces"] = {n: os.readlink("/proc/self/ns/" + n) == os.readlink("/proc/1/ns/" + n)
                              for n in sorted(os.listdir("/proc/self/ns"))}
info["init"] = "self" if os.getpid() == 1 else open("/proc/1/cmdline").read().replace("\0", " ").strip()
# What only an exec'd program matches (a script job's warm start): its command line, pid and
# signal mask and dispositions as the kernel shows them.
info["proc"] = {"cmdline": open("/proc/self/cmdline").read().split("\0"), "pid": os.getpid(),
                "signals": {k: status[k].strip() for k in ["SigBlk", "SigIgn"]}}

import ctypes, struct, time
sysinfo = ctypes.create_string_buffer(256)
ctypes.CDLL(None, use_errno=True).sysinfo(sysinfo)
info["clocks"] = {
    "uptime": float(open("/proc/uptime").read().split()[0]),
    "btime": int([l for l in open("/proc/stat") if l.startswith("btime ")][0].split()[1]),
    "boottime": time.clock_gettime(time.CLOCK_BOOTTIME),
    "monotonic": time.monotonic(),
    "sysinfo_uptime": struct.unpack_from("l", sysinfo)[0],
    "now": time.time(),
}
print(json.dumps(info, sort_keys=True))
"#;

fn figure_job() -> JobSpec {
    python_job(
        "import matplotlib.pyplot as plt\ndisplay('first')\nplt.figure(figsize=(2, 1))\nplt.plot([1, 2])\nplt.show()\n'last'\n",
        Sku::S,
    )
}

fn probe_job() -> JobSpec {
    let mut spec = python_job(PROBE, Sku::S);
    spec.args = vec!["one".into(), "two words".into()];
    spec.env.insert("USER_VAR".into(), "x=y".into());
    spec.stdin = Some(b"from stdin\n".to_vec());
    spec
}

/// [`probe_job`] in script mode (`python3 /sandq/main.py one "two words"`), with a variable
/// the interpreter reads at start-up (a script's warm start honours it: its program starts at
/// the handover).
fn script_probe_job() -> JobSpec {
    let mut spec = python_job(PROBE, Sku::S);
    spec.mode = Some(sandq_schemas::RunMode::Script);
    spec.env.insert("PYTHONHASHSEED".into(), "7".into());
    spec.args = vec!["one".into(), "two words".into()];
    spec.env.insert("USER_VAR".into(), "x=y".into());
    spec.stdin = Some(b"from stdin\n".to_vec());
    spec
}

/// Runs `spec` until it has a result whose `sandbox.warm` is `warm` (a warm worker may still be
/// filling its pool for the first job).
async fn run_until(client: &mut Client, make: impl Fn() -> JobSpec, warm: bool) -> JobResult {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let result = run(client, &make()).await;
        if result.sandbox.is_some_and(|s| s.warm == warm) {
            return result;
        }
        assert!(Instant::now() < deadline, "no {} start: {:?}", if warm { "warm" } else { "cold" }, result.sandbox);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Runs `make`'s jobs until one is forked from a template (its sandbox's init is the holder):
/// a warm sandbox made before the template was ready is an unforked one.
async fn run_forked(client: &mut Client, make: impl Fn() -> JobSpec) -> JobResult {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let result = run_until(client, &make, true).await;
        if result.sandbox.is_some_and(|s| s.forked) {
            return result;
        }
        assert!(Instant::now() < deadline, "no forked start: {:?} {} {}", result.status, result.stdout.text, result.stderr.text);
    }
}

/// The host's boot time, Unix seconds (`btime` of the host's `/proc/stat`).
fn host_btime() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").expect("/proc/stat");
    stat.lines().find_map(|l| l.strip_prefix("btime ")).and_then(|v| v.trim().parse().ok()).expect("btime")
}

fn stop(mut worker: Child) {
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(60)), "the worker did not exit");
}

#[tokio::test]
async fn a_warm_start_gives_the_same_result_and_sandbox_as_a_cold_one() {
    let world = Isolated::new().await;
    let warm_id = format!("{}-warm", world.namespace);
    let cold_id = format!("{}-cold", world.namespace);
    let host_btime = host_btime();
    let warm_worker_started = sandq_core::time::now_ms() / 1000;
    let warm_worker = world.start_worker_ready(&warm_id, &[("SANDQ__WARM__PER_SKU", "1")]);
    let mut client = world.client().await;
    let warm = run_forked(&mut client, probe_job).await;
    let warm_figure = run_until(&mut client, figure_job, true).await;
    let warm_script = run_until(&mut client, script_probe_job, true).await;
    stop(warm_worker);
    let cold_worker_started = sandq_core::time::now_ms() / 1000;
    let cold_worker = world.start_worker_ready(&cold_id, &[("SANDQ__WARM__PER_SKU", "0")]);
    let cold = run_until(&mut client, probe_job, false).await;
    let cold_figure = run_until(&mut client, figure_job, false).await;
    let cold_script = run_until(&mut client, script_probe_job, false).await;
    stop(cold_worker);
    // A script job's warm start: its program is exec'd at the handover, so it is what a cold
    // start's is in every respect the probe sees, its command line, pid and signals included.
    assert_eq!(warm_script.status, JobStatus::Succeeded, "{}", warm_script.stderr.text);
    assert_eq!(cold_script.status, JobStatus::Succeeded, "{}", cold_script.stderr.text);
    let (mut ws, mut cs): (serde_json::Value, serde_json::Value) = (
        serde_json::from_str(&warm_script.stdout.text).expect("warm script probe"),
        serde_json::from_str(&cold_script.stdout.text).expect("cold script probe"),
    );
    for probe in [&mut ws, &mut cs] {
        probe.as_object_mut().expect("probe").remove("clocks");
    }
    assert_eq!(ws, cs, "a warm script sandbox looks different from a cold one");
    // Values computed here, not by the code under test.
    assert_eq!(ws["proc"]["cmdline"], serde_json::json!(["python3", "/sandq/main.py", "one", "two words", ""]));
    assert_eq!(ws["proc"]["pid"], 1);
    assert_eq!(ws["init"], "self");
    assert_eq!(ws["env"]["PYTHONHASHSEED"], "7");
    assert_eq!(ws["argv"], serde_json::json!(["/sandq/main.py", "one", "two words"]));
    assert_eq!(ws["stdin"], "from stdin\n");
    assert_eq!(ws["status"]["NoNewPrivs"], "1");
    assert_eq!(ws["status"]["CapEff"], "0000000000000000");
    // Rich outputs in the same order: a figure shown with plt.show() comes back where it was
    // shown, also when matplotlib was preloaded (it must have the sandq backend).
    let kinds = |r: &JobResult| r.outputs.iter().map(|o| (o.output_type, o.data.contains_key("image/png"))).collect::<Vec<_>>();
    assert_eq!(kinds(&warm_figure), kinds(&cold_figure));
    assert_eq!(
        kinds(&cold_figure),
        [(OutputType::DisplayData, false), (OutputType::DisplayData, true), (OutputType::ExecuteResult, false)]
    );

    assert_eq!(warm.status, JobStatus::Succeeded, "{}", warm.stderr.text);
    assert_eq!(cold.status, JobStatus::Succeeded, "{}", cold.stderr.text);
    let (mut w, mut c): (serde_json::Value, serde_json::Value) =
        (serde_json::from_str(&warm.stdout.text).expect("warm probe"), serde_json::from_str(&cold.stdout.text).expect("cold probe"));
    // Clocks: each sandbox's boot clock counts from its own start (a time namespace of its own),
    // so its uptime is small and its `btime` is after its worker started, not the host's boot.
    for (name, probe, worker_started, result) in
        [("warm", &mut w, warm_worker_started, &warm), ("cold", &mut c, cold_worker_started, &cold)]
    {
        let clocks = probe.as_object_mut().expect("probe").remove("clocks").expect("clocks");
        let number = |key: &str| clocks[key].as_f64().unwrap_or_else(|| panic!("{name}: {key} in {clocks}"));
        let finished = result.finished_at_ms.expect("finished_at_ms") / 1000;
        assert!(
            host_btime + 5 < worker_started,
            "the host booted at {host_btime}, {} s before the {name} worker started: too close to tell the clocks apart",
            worker_started.saturating_sub(host_btime)
        );
        // Whole seconds, each rounded its own way: 2 s of slack.
        let btime = number("btime") as u64;
        assert!(
            btime + 2 >= worker_started && btime <= finished,
            "{name}: btime {btime}, its worker started at {worker_started}, the host booted at {host_btime}: {clocks}"
        );
        let longest = (finished - worker_started + 2) as f64;
        for key in ["uptime", "boottime", "monotonic", "sysinfo_uptime"] {
            assert!((0.0..=longest).contains(&number(key)), "{name}: {key} {} s, its worker is {longest} s old: {clocks}", number(key));
        }
        assert!((number("now") - number("uptime") - btime as f64).abs() <= 2.0, "{name}: btime is not now - uptime: {clocks}");
    }
    // A forked start's process is the sandbox's second (its init, pid 1, is a holder); a cold
    // or unforked warm start's is its init. Everything else is the same.
    assert_eq!(w["init"], "/bin/sleep infinity", "the warm start was not forked: {w}");
    assert_eq!(c["init"], "self");
    // A notebook job's process is its runner's (forked, or started before the job): its
    // command line is the runner's, not the job's (docs/protocol.md, Warm starts).
    for probe in [&mut w, &mut c] {
        probe.as_object_mut().expect("probe").remove("init");
        probe.as_object_mut().expect("probe").remove("proc");
    }
    assert_eq!(w, c, "a warm sandbox looks different from a cold one");
    // Values computed here: no capability, no_new_privs, seccomp filtering with one filter.
    assert_eq!(w["status"]["CapEff"], "0000000000000000");
    assert_eq!(w["status"]["CapBnd"], "0000000000000000");
    assert_eq!(w["status"]["NoNewPrivs"], "1");
    assert_eq!(w["status"]["Seccomp"], "2");
    assert!(w["in_init_namespaces"].as_object().expect("ns").values().all(|v| v == true), "{w}");
    // Values computed here, not by the code under test.
    assert_eq!(w["argv"], serde_json::json!(["/sandq/main.py", "one", "two words"]));
    assert_eq!(w["env"]["USER_VAR"], "x=y");
    assert_eq!(w["env"]["SANDQ_SKU"], "S");
    assert_eq!(w["stdin"], "from stdin\n");
    assert_eq!(w["cwd"], "/work");
    assert_eq!(w["ids"], serde_json::json!([1000, 1000, 1000, 1000, []]));
    // The same result fields, apart from the job's identity and timings.
    assert_eq!(
        (warm.exit_code, &warm.stderr.text, warm.outputs.len(), warm.error.is_none(), warm.execution_count),
        (cold.exit_code, &cold.stderr.text, cold.outputs.len(), cold.error.is_none(), cold.execution_count)
    );
    world.delete_queues().await;
}

#[tokio::test]
async fn a_warm_sandbox_serves_one_job_only() {
    let world = Isolated::new().await;
    let id = format!("{}-one", world.namespace);
    let worker = world.start_worker_ready(&id, &[("SANDQ__WARM__PER_SKU", "1")]);
    let mut client = world.client().await;
    let first = run_until(
        &mut client,
        || python_job("open('/tmp/left', 'w').write('x')\nopen('/work/left', 'w').write('x')\nprint('first')", Sku::S),
        true,
    )
    .await;
    assert_eq!(first.stdout.text, "first\n");
    let second =
        run_until(&mut client, || python_job("import os\nprint(os.path.exists('/tmp/left'), os.path.exists('/work/left'))", Sku::S), true)
            .await;
    assert_eq!(second.stdout.text, "False False\n", "the second job saw the first one's files");
    let log = isolated_worker_log(&id);
    let (a, b) = (
        sandq_tests::container_id_in_log(&log, &first.job_id).expect("first container"),
        sandq_tests::container_id_in_log(&log, &second.job_id).expect("second container"),
    );
    assert_ne!(a, b, "two jobs got the same sandbox");
    stop(worker);
    world.delete_queues().await;
}

/// [`PROBE`] for Node.js, in notebook mode (the default): ends with top-level `await` and a
/// last expression, whose value is the cell's result.
const NODE_PROBE: &str = r#"
const fs = require('fs');
const os = require('os');
const mounts = fs.readFileSync('/proc/self/mountinfo', 'utf8').trim().split('\n').map((line) => {
  const f = line.split(' ');
  const sep = f.indexOf('-');
  return [f[4], f[3], f[sep + 1], f[5], f[sep + 3].replace(/\b(uid|gid)=\d+/g, '$1=N')];
}).sort();
const env = { ...process.env };
delete env.SANDQ_JOB_ID;
const info = {
  env,
  ids: [process.getuid(), process.getgid(), process.geteuid(), process.getegid(), process.getgroups()],
  cwd: process.cwd(),
  argv: process.argv.slice(1),
  execArgv: process.execArgv,
  paths: module.paths,
  mounts,
  limits: fs.readFileSync('/proc/self/limits', 'utf8'),
  work: fs.readdirSync('/work').sort(),
  tmp: fs.readdirSync('/tmp').sort(),
  stdin: fs.readFileSync(0, 'utf8'),
  hostname: os.hostname(),
};
console.log(JSON.stringify(info));
const answer = await Promise.resolve(6 * 7);
answer
"#;

fn node_probe_job() -> JobSpec {
    let mut spec = python_job(NODE_PROBE, Sku::S);
    spec.runtime = sandq_schemas::Runtime::Node;
    spec.args = vec!["one".into(), "two words".into()];
    spec.env.insert("USER_VAR".into(), "x=y".into());
    spec.stdin = Some(b"from stdin\n".to_vec());
    spec
}

/// Node.js notebook jobs get warm sandboxes too: the same probe, result value and error as a
/// cold start; a job setting a variable node reads at start-up (`NODE_OPTIONS`) starts cold.
#[tokio::test]
async fn a_warm_node_start_gives_the_same_result_and_sandbox_as_a_cold_one() {
    let world = Isolated::new().await;
    let warm_id = format!("{}-nwarm", world.namespace);
    let cold_id = format!("{}-ncold", world.namespace);
    let thrower = || {
        let mut spec = node_probe_job();
        spec.code = Some("const x = 1;\nfunction f() { throw new RangeError('too far: ' + x); }\nf();\n".into());
        spec
    };
    let warm_worker = world.start_worker_ready(&warm_id, &[("SANDQ__WARM__PER_SKU", "1"), ("SANDQ__WARM__RUNTIMES", "node")]);
    let mut client = world.client().await;
    let warm = run_until(&mut client, node_probe_job, true).await;
    let warm_error = run_until(&mut client, thrower, true).await;
    // Given time to refill, a job with NODE_OPTIONS still starts cold.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut options = node_probe_job();
    options.env.insert("NODE_OPTIONS".into(), "--max-old-space-size=300".into());
    let with_options = run(&mut client, &options).await;
    assert_eq!(with_options.status, JobStatus::Succeeded, "{}", with_options.stderr.text);
    assert_eq!(with_options.sandbox.map(|s| s.warm), Some(false), "NODE_OPTIONS would be ignored by a warm node");
    let after = run_until(&mut client, node_probe_job, true).await;
    assert_eq!(after.status, JobStatus::Succeeded);
    stop(warm_worker);
    let cold_worker = world.start_worker_ready(&cold_id, &[("SANDQ__WARM__PER_SKU", "0")]);
    let cold = run_until(&mut client, node_probe_job, false).await;
    let cold_error = run_until(&mut client, thrower, false).await;
    stop(cold_worker);

    for r in [&warm, &cold] {
        assert_eq!(r.status, JobStatus::Succeeded, "{}", r.stderr.text);
    }
    let (w, c): (serde_json::Value, serde_json::Value) =
        (serde_json::from_str(&warm.stdout.text).expect("warm probe"), serde_json::from_str(&cold.stdout.text).expect("cold probe"));
    assert_eq!(w, c, "a warm node sandbox looks different from a cold one");
    assert_eq!(w["argv"], serde_json::json!(["/sandq/main.js", "one", "two words"]));
    assert_eq!(w["env"]["USER_VAR"], "x=y");
    assert_eq!(w["stdin"], "from stdin\n");
    assert_eq!(w["cwd"], "/work");
    let value = |r: &JobResult| {
        r.outputs
            .iter()
            .find(|o| o.output_type == OutputType::ExecuteResult)
            .and_then(|o| o.data.get("text/plain").and_then(|v| v.text.clone()))
    };
    assert_eq!(value(&warm).as_deref(), Some("42"));
    assert_eq!(value(&warm), value(&cold));
    // The same error, pointing at the user's lines.
    for r in [&warm_error, &cold_error] {
        assert_eq!(r.status, JobStatus::Failed);
        let error = r.error.as_ref().expect("error");
        assert_eq!((error.name.as_str(), error.value.as_str()), ("RangeError", "too far: 1"));
        assert!(error.traceback.iter().any(|l| l.contains("main.js:2")), "{:?}", error.traceback);
    }
    assert_eq!(warm_error.error, cold_error.error);
    assert_eq!(warm_error.stderr.text, cold_error.stderr.text);
    world.delete_queues().await;
}

/// Container ids of the warm sandboxes a worker started, from its log.
fn warm_ids(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains("warm sandbox started"))
        .filter_map(|l| l.split("container_id=\"").nth(1))
        .filter_map(|rest| rest.split('"').next())
        .map(str::to_owned)
        .collect()
}

fn leftovers(worker_id: &str, container: &str) -> Vec<String> {
    let mut found = Vec::new();
    for dir in [sandq_tests::worker_data_dir(), sandq_tests::worker_state_dir()] {
        let path = dir.join(worker_id).join(container);
        if path.exists() {
            found.push(path.display().to_string());
        }
    }
    for dir in ["/sys/fs/cgroup/memory/sandq", "/sys/fs/cgroup/pids/sandq", "/sys/fs/cgroup/cpu/sandq", "/sys/fs/cgroup/sandq"] {
        let path = Path::new(dir).join(container);
        if path.exists() {
            found.push(path.display().to_string());
        }
    }
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        if std::fs::read_to_string(entry.path().join("cgroup")).is_ok_and(|c| c.contains(container)) {
            found.push(format!("process {:?}", entry.file_name()));
        }
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    if mounts.contains(container) {
        found.push("a mount".into());
    }
    found
}

#[tokio::test]
async fn a_sigkilled_worker_leaves_no_warm_sandbox_after_restart() {
    let world = Isolated::new().await;
    let id = format!("{}-kill", world.namespace);
    let mut worker = world.start_worker_ready(&id, &[("SANDQ__WARM__PER_SKU", "1")]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let ids = loop {
        let ids = warm_ids(&isolated_worker_log(&id));
        if ids.len() >= 2 {
            break ids;
        }
        assert!(Instant::now() < deadline, "no warm sandboxes started");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Their runners are up and waiting.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!leftovers(&id, &ids[0]).is_empty(), "the warm sandbox was not where this test looks");
    sandq_tests::signal(&worker, "KILL");
    let _ = worker.wait();
    let restarted = world.start_worker_ready(&id, &[("SANDQ__WARM__PER_SKU", "0")]);
    for container in &ids {
        assert_eq!(leftovers(&id, container), Vec::<String>::new(), "warm sandbox {container} left behind");
    }
    stop(restarted);
    world.delete_queues().await;
}

/// The CPU weight of the cgroup of container `id`: v1 `cpu.shares`, v2 `cpu.weight`.
fn cpu_weight(id: &str) -> Option<u64> {
    let path = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        Path::new("/sys/fs/cgroup/sandq").join(id).join("cpu.weight")
    } else {
        Path::new("/sys/fs/cgroup/cpu/sandq").join(id).join("cpu.shares")
    };
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// A warm sandbox warms up and waits at the lowest CPU weight (a job arriving meanwhile gets
/// the CPU first), and runs its job at the default weight, as a cold start does.
#[tokio::test]
async fn a_warm_sandbox_yields_the_cpu_until_its_job_arrives() {
    let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let (lowest, default) = if v2 { (1, 100) } else { (2, 1024) };
    let world = Isolated::new().await;
    let id = format!("{}-cpu", world.namespace);
    let worker = world.start_worker_ready(&id, &[("SANDQ__WARM__PER_SKU", "1"), ("SANDQ__WARM__RUNTIMES", "python")]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let waiting = loop {
        if let Some(first) = warm_ids(&isolated_worker_log(&id)).into_iter().find(|c| cpu_weight(c).is_some()) {
            break first;
        }
        assert!(Instant::now() < deadline, "no warm sandbox's cgroup found");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // The cgroup exists a moment before the runtime writes its limits (the kernel's default
    // weight until then): what counts is the weight it waits at.
    let settle = Instant::now() + Duration::from_secs(5);
    while cpu_weight(&waiting) != Some(lowest) && Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(cpu_weight(&waiting), Some(lowest), "a waiting warm sandbox has another weight");
    let mut client = world.client().await;
    let spec = python_job("import time\nprint('running', flush=True)\ntime.sleep(4)\n", Sku::S);
    let deadline = Instant::now() + Duration::from_secs(90);
    // Until a job of this test gets a warm sandbox (the pool may still be filling).
    let (container, result) = loop {
        let spec = JobSpec { job_id: uuid::Uuid::new_v4().to_string(), ..spec.clone() };
        client.submit(&spec).await.expect("submit");
        sandq_tests::wait_for_status(&mut client, &spec.job_id, JobStatus::Running, Duration::from_secs(60)).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let container = sandq_tests::container_id_in_log(&isolated_worker_log(&id), &spec.job_id).expect("container id");
        let weight = cpu_weight(&container);
        let result = sandq_tests::wait(&mut client, &spec.job_id).await;
        if result.sandbox.is_some_and(|s| s.warm) {
            break (container, (weight, result));
        }
        assert!(Instant::now() < deadline, "no warm start");
    };
    let (weight, result) = result;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    assert_eq!(weight, Some(default), "the job in warm sandbox {container} ran at another CPU weight");
    stop(worker);
    world.delete_queues().await;
}

/// A waiting warm sandbox holds no CPUs, and the job handed to it is pinned to CPUs of its own:
/// beside a cold job it runs on other CPUs (on a host with two or more), so two running jobs
/// never share CPUs. With both runtimes' pools of S and M waiting on two CPUs, pins taken at
/// warm-up would put the cold S job on the warm S sandbox's CPU.
#[tokio::test]
async fn a_warm_start_and_a_cold_one_get_cpus_of_their_own() {
    if sandq_tests::host_cpus() < 2 {
        eprintln!("one CPU: nothing to check");
        return;
    }
    let world = Isolated::new().await;
    let id = format!("{}-pins", world.namespace);
    let worker = world.start_worker_ready(
        &id,
        &[
            ("SANDQ__WARM__PER_SKU", "1"),
            ("SANDQ__SKUS__S__SLOTS", "2"),
            ("SANDQ__SKUS__S__CPUS", "1"),
            ("SANDQ__SKUS__S__MEMORY_BYTES", "1073741824"),
            ("SANDQ__WORKER__CAPACITY_CPUS", "2"),
        ],
    );
    let mut client = world.client().await;
    let code = "import time\nprint(next(l for l in open('/proc/self/status') if l.startswith('Cpus_allowed_list')).split()[1])\n\
                t = time.time()\nwhile time.time() - t < 3: pass\n";
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        // Room for the pool to refill, then a warm-eligible job and a script-mode (cold) one.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let warm = python_job(code, Sku::S);
        let mut cold = python_job(code, Sku::S);
        cold.mode = Some(sandq_schemas::RunMode::Script);
        client.submit(&warm).await.expect("submit");
        client.submit(&cold).await.expect("submit");
        let (w, c) = (sandq_tests::wait(&mut client, &warm.job_id).await, sandq_tests::wait(&mut client, &cold.job_id).await);
        assert_eq!((w.status, c.status), (JobStatus::Succeeded, JobStatus::Succeeded), "{} {}", w.stderr.text, c.stderr.text);
        let overlapped = w.started_at_ms < c.finished_at_ms && c.started_at_ms < w.finished_at_ms;
        if w.sandbox.is_some_and(|s| s.warm) && overlapped {
            assert_ne!(w.stdout.text, c.stdout.text, "a warm and a cold job ran on the same CPUs at once");
            break;
        }
        assert!(Instant::now() < deadline, "no warm start beside a cold one");
    }
    stop(worker);
    world.delete_queues().await;
}

/// A warm sandbox has the same limits as a cold one (docs/protocol.md, Warm starts): the
/// warm-up's preload (numpy, pandas, matplotlib: about 100 MiB resident) sits in the job's
/// memory cgroup, so a job that fits its SKU's memory cold must not be OOM-killed warm; at
/// handover the limit grows by what the warm-up holds. (`tests/warm/warm_usage.sh` compares the
/// `usage` a warm and a cold start report, by hand.)
#[tokio::test]
async fn a_warm_start_leaves_the_job_the_memory_of_a_cold_one() {
    let world = Isolated::new().await;
    // Set after worker_env's `0` (the later value of a variable wins).
    let env = sandq_tests::small_worker_env(&[("SANDQ__WARM__PER_SKU", "1"), ("SANDQ__WARM__RUNTIMES", "python")]);
    let mut worker = world.start_worker_ready(&format!("{}-w", world.namespace), &env);
    let mut client = world.client().await;
    // 440 MiB touched, of S's 512 MiB (memory + swap): what a cold start leaves a cell.
    let job = |cold: bool| {
        let mut spec =
            python_job("b = bytearray(440 << 20)\nfor i in range(0, len(b), 4096):\n    b[i] = 1\nprint(len(b) >> 20)\n", Sku::S);
        if cold {
            // Read by the interpreter at start-up: such a job always starts cold.
            spec.env.insert("TZ".into(), "UTC".into());
        }
        spec
    };
    let cold = run_until(&mut client, || job(true), false).await;
    assert_eq!((cold.status, cold.stdout.text.as_str()), (JobStatus::Succeeded, "440\n"), "{:?}", cold.reason);
    let warm = run_until(&mut client, || job(false), true).await;
    assert_eq!(
        (warm.status, warm.stdout.text.as_str()),
        (JobStatus::Succeeded, "440\n"),
        "the same job cold: succeeded (peak {:?}); warm: {:?} ({:?}, peak {:?})",
        cold.usage.map(|u| u.peak_memory_bytes),
        warm.status,
        warm.reason,
        warm.usage.map(|u| u.peak_memory_bytes)
    );
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(60)));
    world.delete_queues().await;
}

/// The pids of `worker`'s templates (its children running `sandq_runner.py --template`).
fn templates_of(worker: u32) -> Vec<i32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let ppid = stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().nth(1)).and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(worker) && cmdline.windows(10).any(|w| w == b"--template") {
            pids.push(pid);
        }
    }
    pids
}

#[tokio::test]
async fn jobs_run_when_the_template_dies_or_is_replaced_and_forking_is_a_setting() {
    let world = Isolated::new().await;
    let id = format!("{}-tpl", world.namespace);
    let worker = world.start_worker_ready(&id, &[("SANDQ__WARM__PER_SKU", "1")]);
    let mut client = world.client().await;
    let job = || python_job("print(6 * 7)", Sku::S);
    let forked = run_forked(&mut client, job).await;
    assert_eq!(forked.stdout.text, "42\n");
    // Its templates killed: the next jobs run (in the forked sandboxes already made, whose
    // processes outlive their template, then unforked or cold), and a template is started
    // again.
    let templates = templates_of(worker.id());
    assert!(!templates.is_empty(), "no template of worker {}", worker.id());
    for pid in &templates {
        let killed = std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status().expect("kill");
        assert!(killed.success(), "cannot kill template {pid}");
    }
    for _ in 0..3 {
        let result = run(&mut client, &job()).await;
        assert_eq!((result.status, result.stdout.text.as_str()), (JobStatus::Succeeded, "42\n"), "{result:?}");
    }
    let again = run_forked(&mut client, job).await;
    assert_eq!(again.stdout.text, "42\n");
    assert!(templates_of(worker.id()).iter().all(|pid| !templates.contains(pid)), "the killed templates are still there");
    stop(worker);
    // warm.template_lifetime: a template is replaced by a new one once it has served that
    // long, and the sandboxes forked from the old one still run their jobs.
    let short = world.start_worker_ready(&format!("{id}-life"), &[("SANDQ__WARM__PER_SKU", "1"), ("SANDQ__WARM__TEMPLATE_LIFETIME", "4s")]);
    run_forked(&mut client, job).await;
    let first = templates_of(short.id());
    assert!(!first.is_empty(), "no template of worker {}", short.id());
    let deadline = Instant::now() + Duration::from_secs(60);
    while templates_of(short.id()).iter().any(|pid| first.contains(pid)) || templates_of(short.id()).is_empty() {
        assert!(Instant::now() < deadline, "the templates {first:?} were not replaced within 60 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for pid in &first {
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "the replaced template {pid} is still there");
    }
    let after = run_forked(&mut client, job).await;
    assert_eq!(after.stdout.text, "42\n");
    stop(short);
    // warm.forked = false: warm starts preload on their own.
    let unforked = world.start_worker_ready(&format!("{id}-off"), &[("SANDQ__WARM__PER_SKU", "1"), ("SANDQ__WARM__FORKED", "false")]);
    let warm = run_until(&mut client, job, true).await;
    assert_eq!(warm.stdout.text, "42\n");
    assert!(!warm.sandbox.is_some_and(|s| s.forked), "forked although warm.forked = false");
    assert!(templates_of(unforked.id()).is_empty(), "a template runs although warm.forked = false");
    stop(unforked);
    world.delete_queues().await;
}
