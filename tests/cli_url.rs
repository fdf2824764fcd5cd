//! The `sandq` CLI in URL mode (`SANDQ_URL`, `SANDQ_API_KEY`; docs/gateway.md) against a real
//! gateway and worker: inline code, uploaded inputs, output printed live, artifacts and rich
//! outputs saved and checked, status, wait, cancel, sessions, idempotent resubmission, and the
//! refusals (a wrong key, no key, commands with no HTTP route). Every `sandq` here runs with a
//! config path that does not exist: URL mode never reads one.

use std::io::BufRead as _;
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sandq_core::keys::{self, Quotas};
use sandq_schemas::names::Names;
use sandq_tests::{bin_dir, ensure_worker, namespace, repo_root, service_config};
use serde_json::Value;

/// The gateway of this test binary, in the test namespace, ending every event stream after
/// 1 s (`max_stream_life`: the CLI must resume each with `Last-Event-ID`); stops when this
/// process ends (`--exit-on-stdin-eof`: the pipe on its stdin closes). Its log is
/// [`gateway_log`].
struct Gateway {
    base: String,
    _child: Child,
}

static GATEWAY: OnceLock<Gateway> = OnceLock::new();

fn gateway_log() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("{}-gateway.log", namespace()))
}

fn gateway() -> &'static str {
    &GATEWAY
        .get_or_init(|| {
            ensure_worker();
            let log_path = gateway_log();
            let log = std::fs::File::create(&log_path).expect("log file");
            let child = Command::new(bin_dir().join("sandq-gateway"))
                .arg("--exit-on-stdin-eof")
                .env("SANDQ__NAMESPACE", namespace())
                .env("SANDQ__GATEWAY__LISTEN", "127.0.0.1:0")
                .env("SANDQ__GATEWAY__METRICS_LISTEN", "127.0.0.1:0")
                .env("SANDQ__GATEWAY__MAX_STREAM_LIFE", "1s")
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("start sandq-gateway");
            let started = Instant::now();
            let base = loop {
                let text = std::fs::read_to_string(&log_path).unwrap_or_default();
                if let Some(addr) = text.lines().find(|l| l.contains("serving the API")).and_then(|l| l.split("addr=").nth(1)) {
                    break format!("http://{}", addr.split_whitespace().next().unwrap_or_default());
                }
                assert!(started.elapsed() < Duration::from_secs(60), "the gateway did not start: {text}");
                std::thread::sleep(Duration::from_millis(50));
            };
            Gateway { base, _child: child }
        })
        .base
}

/// A key of a tenant of its own (tests run in parallel; quotas count per key).
async fn new_key(label: &str) -> String {
    new_key_with(label, Quotas::default()).await
}

async fn new_key_with(label: &str, quotas: Quotas) -> String {
    let tenant = format!("{label}{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let mut redis = sandq_core::redis_conn::connect(&service_config().redis).await.expect("redis");
    keys::create(&mut redis, &Names::new(namespace()), &tenant, "cli", quotas).await.expect("create key").1
}

/// `sandq` in URL mode with `key`; no config file to fall back on.
fn sandq(key: &str) -> Command {
    let mut command = Command::new(bin_dir().join("sandq"));
    command
        .env("SANDQ_URL", gateway())
        .env("SANDQ_API_KEY", key)
        .env("SANDQ_CONFIG", "/nonexistent/sandq.toml")
        .env_remove("SANDQ__NAMESPACE");
    command
}

fn run(command: &mut Command) -> Output {
    command.output().expect("run sandq")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// What `sandq status` prints of a job that is not over: `<id> <status>`.
fn status_of(key: &str, id: &str) -> String {
    let out = run(sandq(key).args(["status", id]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    text(&out.stdout)
}

#[tokio::test]
async fn inline_code_runs_through_the_gateway_and_reads_back_like_direct_mode() {
    let key = new_key("inline").await;
    let out = run(sandq(&key).args(["run", "--sku", "S", "--wait", "3m", "-c", "print(6 * 7)"]));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(text(&out.stdout), "42\n");
    assert!(stderr.contains("--- sandq: job ") && stderr.contains(" succeeded") && stderr.contains("exit code: 0"), "{stderr}");

    // The program's exit code is the CLI's; --json prints the JobResult with the client's id.
    let id = uuid::Uuid::new_v4().to_string();
    let out = run(sandq(&key).args(["--json", "run", "--sku", "S", "--wait", "3m", "--id", &id, "-c", "import sys\nsys.exit(3)"]));
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    let result: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(result["job_id"], id.as_str());
    assert_eq!(result["status"], "failed");

    let out = run(sandq(&key).args(["status", &id]));
    assert_eq!(out.status.code(), Some(0));
    assert!(text(&out.stderr).contains(&format!("--- sandq: job {id} failed")), "{}", text(&out.stderr));
    let out = run(sandq(&key).args(["--json", "status", &id]));
    assert_eq!(serde_json::from_slice::<Value>(&out.stdout).expect("JSON")["exit_code"], 3);
    // Another tenant's key does not see it: unknown, exit 2.
    let other = new_key("other").await;
    let out = run(sandq(&other).args(["status", &id]));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("unknown"), "{}", text(&out.stderr));
}

/// The sum of column `realgdp` and the row count of macrodata.csv, parsed here.
fn realgdp_sum(csv: &str) -> (usize, f64) {
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').map(|h| h.trim_matches('"')).collect();
    let column = header.iter().position(|h| *h == "realgdp").expect("realgdp");
    let values: Vec<f64> =
        lines.filter(|l| !l.is_empty()).map(|l| l.split(',').nth(column).expect("field").parse().expect("number")).collect();
    (values.len(), values.iter().sum())
}

#[tokio::test]
async fn uploaded_inputs_are_staged_and_computed_on() {
    let key = new_key("upload").await;
    let csv_path = repo_root().join("examples/macrodata.csv");
    let (rows, sum) = realgdp_sum(&std::fs::read_to_string(&csv_path).expect("csv"));
    let code = "import csv\n\
                for name in ['macrodata.csv', 'data/m.csv']:\n    \
                    rows = list(csv.DictReader(open(name)))\n    \
                    print(name, len(rows), repr(sum(float(r['realgdp']) for r in rows)))\n";
    let out = run(sandq(&key)
        .args(["run", "--sku", "S", "--wait", "3m", "--upload"])
        .arg(&csv_path)
        .arg("--upload")
        .arg(format!("{}:data/m.csv", csv_path.display()))
        .args(["-c", code]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    for (line, name) in lines.iter().zip(["macrodata.csv", "data/m.csv"]) {
        let fields: Vec<&str> = line.split(' ').collect();
        assert_eq!(fields[..2], [name, &rows.to_string()], "{line}");
        let computed: f64 = fields[2].parse().expect("a float");
        assert!((computed - sum).abs() < 1e-6 * sum, "{name}: the sandbox summed {computed}, here {sum}");
    }
    assert_eq!(rows, 203);
}

#[tokio::test]
async fn output_is_printed_while_the_job_runs_and_only_once() {
    let key = new_key("live").await;
    let id = uuid::Uuid::new_v4().to_string();
    let code = "import time\nfor i in range(12):\n    print('line', i, flush=True)\n    time.sleep(0.2)\n";
    let mut child = sandq(&key)
        .args(["run", "--sku", "S", "--wait", "3m", "--id", &id, "-c", code])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sandq run");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let _ = tx.send(line.expect("a line"));
        }
    });
    let first = rx.recv_timeout(Duration::from_secs(180)).expect("sandq run printed nothing");
    // The job is still running when its first line is out (it prints for 2.4 s).
    let status_then = status_of(&key, &id);
    let mut lines = vec![first];
    lines.extend(rx.iter());
    let status = child.wait().expect("sandq run exits");
    let stderr = std::io::read_to_string(child.stderr.take().expect("stderr")).unwrap_or_default();
    assert!(status.success(), "{status:?}: {stderr}");
    assert_eq!(status_then.trim(), format!("{id} running"), "the first line came while the job ran");
    let expected: Vec<String> = (0..12).map(|i| format!("line {i}")).collect();
    assert_eq!(lines, expected, "every line once, in order");
    assert!(!stderr.contains("differs"), "{stderr}");
    // The job printed for 2.4 s and each stream lived 1 s: the lines above came through
    // several, each resumed after the last event read.
    let log = std::fs::read_to_string(gateway_log()).expect("gateway log");
    let opened = log.lines().filter(|l| l.contains(r#"route="/v1/jobs/{id}/events""#) && l.contains(&format!("job_id=\"{id}\""))).count();
    assert!(opened >= 2, "the event stream was opened {opened} times");

    // --no-stream prints the same at the end.
    let out = run(sandq(&key).args(["run", "--sku", "S", "--wait", "3m", "--no-stream", "-c", "print('a')\nprint('b')"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "a\nb\n");
}

#[tokio::test]
async fn artifacts_and_charts_are_saved_through_the_gateway_with_their_bytes() {
    let key = new_key("artifact").await;
    let id = uuid::Uuid::new_v4().to_string();
    let out_dir = tempfile::tempdir().expect("out dir");
    let code = "import os\n\
                os.makedirs('out', exist_ok=True)\n\
                open('out/data bin', 'wb').write(bytes((i * 7 + i // 256) % 256 for i in range(100000)))\n\
                import matplotlib.pyplot as plt\n\
                plt.plot([1, 3, 2])\n";
    let out = run(sandq(&key).args(["run", "--sku", "S", "--wait", "3m", "--id", &id, "--out"]).arg(out_dir.path()).args(["-c", code]));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let expected: Vec<u8> = (0..100_000u32).map(|i| ((i * 7 + i / 256) % 256) as u8).collect();
    let saved = out_dir.path().join(&id).join("out/data bin");
    assert_eq!(std::fs::read(&saved).expect("the artifact was saved"), expected);
    assert!(stderr.contains(&format!("artifact out/data bin (application/octet-stream, 100000 bytes) -> {}", saved.display())), "{stderr}");
    // Through the gateway's redirect, once.
    let log = std::fs::read_to_string(gateway_log()).expect("gateway log");
    let redirects = log
        .lines()
        .filter(|l| l.contains(r#"route="/v1/jobs/{id}/artifacts/{*path}" status=307"#) && l.contains(&format!("job_id=\"{id}\"")))
        .count();
    assert_eq!(redirects, 1);
    // The chart left open is a display, saved from its own URL.
    let outputs: Vec<_> = std::fs::read_dir(out_dir.path().join(&id).join("outputs")).expect("outputs dir").collect();
    assert_eq!(outputs.len(), 1, "{outputs:?}");
    let png = std::fs::read(outputs[0].as_ref().expect("entry").path()).expect("chart");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(text(&out.stdout).contains("image/png"), "{}", text(&out.stdout));
    // Nothing half-written is left beside them.
    let partial = walk(out_dir.path()).into_iter().filter(|p| p.to_string_lossy().contains(".sandq-partial")).count();
    assert_eq!(partial, 0);
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(walk(&path));
        }
        found.push(path);
    }
    found
}

#[tokio::test]
async fn a_running_job_is_cancelled_and_waited_for() {
    let key = new_key("cancel").await;
    let out = run(sandq(&key).args(["submit", "--sku", "S", "-c", "import time\nprint('up', flush=True)\ntime.sleep(120)"]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let id = text(&out.stdout).trim().to_owned();
    let started = Instant::now();
    while status_of(&key, &id).trim() != format!("{id} running") {
        assert!(started.elapsed() < Duration::from_secs(180), "job {id} never ran");
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = run(sandq(&key).args(["cancel", &id]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains(&format!("cancellation of {id} requested")));
    let waited = Instant::now();
    let out = run(sandq(&key).args(["wait", &id, "--wait", "60s"]));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(stderr.contains(&format!("--- sandq: job {id} cancelled")), "{stderr}");
    assert!(waited.elapsed() < Duration::from_secs(30), "the job was killed, not left to sleep");
    // Over: a second cancel says so.
    let out = run(sandq(&key).args(["cancel", &id]));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
}

#[tokio::test]
async fn a_wrong_or_missing_key_and_direct_only_commands_are_refused_clearly() {
    let wrong = format!("sq_{}_{}", "a".repeat(12), "b".repeat(43));
    let out = run(sandq(&wrong).args(["run", "--sku", "S", "-c", "print(1)"]));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(stderr.contains("the gateway refused the API key") && stderr.contains("401 unauthorized"), "{stderr}");
    assert!(out.stdout.is_empty());
    let out = run(sandq(&wrong).args(["status", "some-job"]));
    assert_eq!(out.status.code(), Some(125));
    assert!(text(&out.stderr).contains("refused the API key"), "{}", text(&out.stderr));

    let out = run(sandq("").env_remove("SANDQ_API_KEY").args(["run", "-c", "print(1)"]));
    assert_eq!(out.status.code(), Some(125));
    assert!(text(&out.stderr).contains("--url needs an API key"), "{}", text(&out.stderr));

    // More than the key may ever do is refused with the gateway's reason; a job naming no
    // timeout gets the key's longest.
    let short = new_key_with("short", Quotas { max_timeout: Duration::from_secs(30), ..Quotas::default() }).await;
    let out = run(sandq(&short).args(["run", "--sku", "S", "--timeout", "5m", "-c", "print(1)"]));
    assert_eq!(out.status.code(), Some(125));
    assert!(text(&out.stderr).contains("the API key may not do this") && text(&out.stderr).contains("403"), "{}", text(&out.stderr));
    let out = run(sandq(&short).args(["run", "--sku", "S", "--wait", "3m", "-c", "print(1)"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "1\n");

    let key = new_key("refuse").await;
    for args in [&["key", "ls"][..], &["export", "x", "-o", "/tmp/never.ipynb"]] {
        let out = run(sandq(&key).args(args));
        assert_eq!(out.status.code(), Some(125), "{args:?}");
        assert!(text(&out.stderr).contains("no HTTP equivalent"), "{args:?}: {}", text(&out.stderr));
    }
}

#[tokio::test]
async fn sessions_carry_state_list_and_delete_and_a_resubmission_is_the_same_job() {
    let key = new_key("session").await;
    let first = run(sandq(&key).args(["run", "--sku", "S", "--wait", "3m", "--session", "s1", "-c", "x = 41"]));
    assert_eq!(first.status.code(), Some(0), "{}", text(&first.stderr));
    let second = run(sandq(&key).args(["run", "--sku", "S", "--wait", "3m", "--session", "s1", "-c", "print(x + 1)"]));
    assert_eq!(second.status.code(), Some(0), "{}", text(&second.stderr));
    assert_eq!(text(&second.stdout), "42\n");
    assert!(text(&second.stderr).contains("session s1: restored"), "{}", text(&second.stderr));

    let out = run(sandq(&key).args(["--json", "session", "ls"]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let sessions: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let names: Vec<&str> = sessions.as_array().expect("a list").iter().filter_map(|s| s["name"].as_str()).collect();
    assert_eq!(names, ["s1"], "{sessions}");
    assert_eq!(sessions[0]["execution_count"], 2, "{sessions}");
    let table = text(&run(sandq(&key).args(["session", "ls"])).stdout);
    assert!(table.lines().nth(1).is_some_and(|l| l.starts_with("s1 ")), "{table}");
    let out = run(sandq(&key).args(["session", "rm", "s1"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = run(sandq(&key).args(["--json", "session", "ls"]));
    assert_eq!(serde_json::from_slice::<Value>(&out.stdout).expect("JSON"), serde_json::json!([]));

    // The same id and code again is the same job (Idempotency-Key); other code under it is a
    // conflict, said as such.
    let id = uuid::Uuid::new_v4().to_string();
    for _ in 0..2 {
        let out = run(sandq(&key).args(["submit", "--sku", "S", "--id", &id, "-c", "print('once')"]));
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        assert_eq!(text(&out.stdout).trim(), id);
    }
    let out = run(sandq(&key).args(["submit", "--sku", "S", "--id", &id, "-c", "print('twice')"]));
    assert_eq!(out.status.code(), Some(125));
    assert!(text(&out.stderr).contains("409 conflict"), "{}", text(&out.stderr));
    let out = run(sandq(&key).args(["wait", &id, "--wait", "3m"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "once\n");
}
