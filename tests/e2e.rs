//! End-to-end tests: real RabbitMQ, Redis, Garage (S3) and youki containers.
//!
//! Expected values are computed here, independently of the sandbox (by parsing the CSV in Rust,
//! hashing bytes with sha2, reading PNG headers by hand).

use std::time::Duration;

use sandq_schemas::{InputFile, JobStatus, Sku};
use sandq_tests::{
    client, ensure_worker, namespace, publish_raw, python_job, repo_root, run, service_config, wait, worker_alive, worker_id,
};
use sha2::{Digest, Sha256};

/// Statistics of macrodata.csv computed without pandas.
struct MacroStats {
    rows: usize,
    realgdp_mean: f64,
    realgdp_growth_pct: f64,
    unemp_max: f64,
    unemp_max_period: String,
    infl_mean: f64,
}

fn macro_stats(csv: &str) -> MacroStats {
    let mut lines = csv.lines();
    let header: Vec<String> = lines.next().expect("header").split(',').map(|h| h.trim_matches('"').to_owned()).collect();
    let col = |name: &str| header.iter().position(|h| h == name).expect(name);
    let (year, quarter, gdp, unemp, infl) = (col("year"), col("quarter"), col("realgdp"), col("unemp"), col("infl"));
    let rows: Vec<Vec<f64>> =
        lines.filter(|l| !l.is_empty()).map(|l| l.split(',').map(|v| v.parse::<f64>().expect("number")).collect()).collect();
    let n = rows.len() as f64;
    let mut max_row = &rows[0];
    for r in &rows {
        if r[unemp] > max_row[unemp] {
            max_row = r;
        }
    }
    MacroStats {
        rows: rows.len(),
        realgdp_mean: rows.iter().map(|r| r[gdp]).sum::<f64>() / n,
        realgdp_growth_pct: rows[rows.len() - 1][gdp] / rows[0][gdp] * 100.0 - 100.0,
        unemp_max: max_row[unemp],
        unemp_max_period: format!("{}Q{}", max_row[year] as i64, max_row[quarter] as i64),
        infl_mean: rows.iter().map(|r| r[infl]).sum::<f64>() / n,
    }
}

/// Width and height from a PNG's IHDR chunk; panics unless the bytes start like a PNG.
fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    assert_eq!(&bytes[12..16], b"IHDR", "first chunk is IHDR");
    let w = u32::from_be_bytes(bytes[16..20].try_into().expect("4 bytes"));
    let h = u32::from_be_bytes(bytes[20..24].try_into().expect("4 bytes"));
    assert_eq!(&bytes[bytes.len() - 8..bytes.len() - 4], b"IEND", "last chunk is IEND");
    (w, h)
}

#[tokio::test]
async fn example_analysis_matches_independent_computation() {
    let mut client = client().await;
    let csv_path = repo_root().join("examples/macrodata.csv");
    let input = client.upload(&csv_path, "macrodata.csv").await.expect("upload");
    let csv = std::fs::read_to_string(&csv_path).expect("csv");
    assert_eq!(input.sha256, hex::encode(Sha256::digest(csv.as_bytes())));
    let code = std::fs::read_to_string(repo_root().join("examples/macro_summary.py")).expect("example");
    let mut spec = python_job(&code, Sku::M);
    spec.inputs = vec![input];
    let result = run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "stderr: {}", result.stderr.text);
    assert_eq!(result.exit_code, Some(0));
    assert_eq!(result.attempt, 1);
    assert_eq!(result.worker_id, Some(worker_id()));

    let line = result.stdout.text.lines().find_map(|l| l.strip_prefix("STATS ")).expect("STATS line");
    let got: serde_json::Value = serde_json::from_str(line).expect("STATS json");
    let want = macro_stats(&csv);
    assert_eq!(got["rows"], want.rows);
    assert_eq!(want.rows, 203, "the data set has 203 quarters");
    let close = |key: &str, expected: f64| {
        let value = got[key].as_f64().unwrap_or_else(|| panic!("{key} missing"));
        assert!((value - expected).abs() < 1e-5, "{key}: sandbox said {value}, expected {expected}");
    };
    close("realgdp_mean", want.realgdp_mean);
    close("realgdp_growth_pct", want.realgdp_growth_pct);
    close("unemp_max", want.unemp_max);
    close("infl_mean", want.infl_mean);
    assert_eq!(got["unemp_max_period"], want.unemp_max_period.as_str());

    assert_eq!(result.artifacts.len(), 1, "only the chart is new: {:?}", result.artifacts);
    let chart = &result.artifacts[0];
    assert_eq!(chart.path, "macro.png");
    assert_eq!(chart.content_type, "image/png");
    let dir = tempfile::tempdir().expect("tempdir");
    let local = client.download_artifact(chart, dir.path()).await.expect("download");
    let bytes = std::fs::read(local).expect("read chart");
    assert_eq!(bytes.len() as u64, chart.size);
    assert_eq!(hex::encode(Sha256::digest(&bytes)), chart.sha256);
    assert_eq!(png_size(&bytes), (800, 400), "figsize (8, 4) at 100 dpi");

    let usage = result.usage.expect("usage");
    assert!(usage.wall_ms > 0 && usage.cpu_ms > 0 && usage.peak_memory_bytes > 10 << 20, "{usage:?}");
    let (q, s, f) =
        (result.queued_at_ms.expect("queued"), result.started_at_ms.expect("started"), result.finished_at_ms.expect("finished"));
    assert!(q <= s && s <= f, "timestamps out of order: {q} {s} {f}");
}

#[tokio::test]
async fn raising_program_fails_with_traceback() {
    let mut client = client().await;
    let spec = python_job("def f():\n    raise ValueError('boom')\nf()\n", Sku::S);
    let result = run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Failed);
    assert_eq!(result.exit_code, Some(1));
    assert!(result.stderr.text.contains("Traceback (most recent call last)"), "{}", result.stderr.text);
    assert!(result.stderr.text.contains("line 2, in f"), "{}", result.stderr.text);
    assert!(result.stderr.text.trim_end().ends_with("ValueError: boom"), "{}", result.stderr.text);
}

#[tokio::test]
async fn exit_code_is_reported() {
    let mut client = client().await;
    let result = run(&mut client, &python_job("import sys\nprint('bye')\nsys.exit(3)\n", Sku::S)).await;
    assert_eq!(result.status, JobStatus::Failed);
    assert_eq!(result.exit_code, Some(3));
    assert_eq!(result.stdout.text, "bye\n");
    assert!(!result.stdout.truncated);
    assert_eq!(result.stdout.total_bytes, 4);
}

#[tokio::test]
async fn stdin_reaches_the_program() {
    let mut client = client().await;
    let data: Vec<u8> = (0..100_000u32).flat_map(|i| format!("{i}\n").into_bytes()).collect();
    let mut spec = python_job(
        "import sys, hashlib\nb = sys.stdin.buffer.read()\nprint(len(b), b.count(b'\\n'), hashlib.sha256(b).hexdigest())\n",
        Sku::S,
    );
    spec.stdin = Some(data.clone());
    let result = run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    let expected = format!("{} {} {}\n", data.len(), 100_000, hex::encode(Sha256::digest(&data)));
    assert_eq!(result.stdout.text, expected);
}

#[tokio::test]
async fn malformed_messages_are_rejected_and_the_worker_survives() {
    let mut client = client().await;
    let reason_of = |r: &sandq_schemas::JobResult| r.reason.clone().unwrap_or_default();

    // Not MessagePack at all; the job id comes from the AMQP message_id.
    let id = uuid::Uuid::new_v4().to_string();
    publish_raw(b"\xc1this is not msgpack", Sku::M, Some(&id)).await;
    let result = wait(&mut client, &id).await;
    assert_eq!(result.status, JobStatus::Rejected);
    assert!(reason_of(&result).contains("malformed"), "{}", reason_of(&result));

    // MessagePack, but fields are missing.
    let id = uuid::Uuid::new_v4().to_string();
    let body = rmp_serde::to_vec_named(&serde_json::json!({"schema_version": 1, "job_id": id})).expect("encode");
    publish_raw(&body, Sku::M, None).await;
    let result = wait(&mut client, &id).await;
    assert_eq!(result.status, JobStatus::Rejected);
    assert!(reason_of(&result).contains("missing field"), "{}", reason_of(&result));

    // An unknown SKU.
    let mut spec = python_job("print(1)", Sku::M);
    let mut value = serde_json::to_value(&spec).expect("json");
    value["sku"] = "XXL".into();
    publish_raw(&rmp_serde::to_vec_named(&value).expect("encode"), Sku::M, None).await;
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Rejected);
    assert!(reason_of(&result).contains("XXL"), "{}", reason_of(&result));

    // A path escaping /work (the client library would refuse it; a hostile client need not).
    spec = python_job("print(1)", Sku::M);
    spec.inputs = vec![InputFile { key: "inputs/sha256/x".into(), path: "../../etc/passwd".into(), size: 1, sha256: "a".repeat(64) }];
    publish_raw(&rmp_serde::to_vec_named(&spec).expect("encode"), Sku::M, None).await;
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Rejected);
    assert!(reason_of(&result).contains("../../etc/passwd"), "{}", reason_of(&result));

    // An input object that does not exist in S3.
    spec = python_job("print(1)", Sku::M);
    let missing = hex::encode(Sha256::digest(uuid::Uuid::new_v4().as_bytes()));
    spec.inputs = vec![InputFile { key: format!("inputs/sha256/{missing}"), path: "data.csv".into(), size: 10, sha256: missing }];
    publish_raw(&rmp_serde::to_vec_named(&spec).expect("encode"), Sku::M, None).await;
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Rejected);
    assert!(reason_of(&result).contains("does not exist"), "{}", reason_of(&result));

    // No job id anywhere: nothing to write a result under, so it is dead-lettered.
    // The worker's dead-letter consumer then counts and logs it.
    let marker = format!("garbage-{}", uuid::Uuid::new_v4());
    let before = no_id_dead_letters(marker.len());
    publish_raw(marker.as_bytes(), Sku::M, None).await;
    assert!(dead_lettered(marker.as_bytes(), before).await, "the unidentifiable message was not dead-lettered");

    // The worker is still there and the next job runs normally.
    assert!(worker_alive());
    let result = run(&mut client, &python_job("print(6 * 7)", Sku::M)).await;
    assert_eq!(result.status, JobStatus::Succeeded);
    assert_eq!(result.stdout.text, "42\n");
}

/// Waits (up to 30 s) for the worker's dead-letter consumer to log one more message of
/// `body`'s size without a usable job id than `before` (the count when it was published).
async fn dead_lettered(body: &[u8], before: usize) -> bool {
    for _ in 0..300 {
        if no_id_dead_letters(body.len()) > before {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// Dead-lettered messages of `len` bytes the shared worker logged as having no usable job id.
fn no_id_dead_letters(len: usize) -> usize {
    let size = format!("bytes={len}");
    sandq_tests::worker_log()
        .lines()
        .filter(|l| l.contains("dead-lettered message without a usable job id") && l.split_whitespace().any(|w| w == size))
        .count()
}

#[tokio::test]
async fn python_client_round_trip() {
    ensure_worker();
    let config = service_config();
    let output = tokio::process::Command::new("python3")
        .arg(repo_root().join("clients/python/sandq_client.py"))
        .args(["--namespace", &namespace(), "--amqp-url", &config.amqp.url, "--redis-url", &config.redis.url, "--sku", "S"])
        .args(["--code", "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))"])
        .args(["--stdin", "1 2 3 4 5 6 7 8 9 10"])
        .output()
        .await
        .expect("python3 clients/python/sandq_client.py");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "client failed: {stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    let result: serde_json::Value = serde_json::from_str(&stdout).expect("client prints JSON");
    assert_eq!(result["status"], "succeeded");
    assert_eq!(result["exit_code"], 0);
    assert_eq!(result["stdout"]["text"], "55\n");
    assert_eq!(result["sku"], "S");
    // A notebook cell's value, read from the plain maps of the result by another language;
    // submitted with two broker addresses, the first refusing (loopback port 1): the client
    // goes on to the next.
    let addresses = format!("amqp://guest:guest@127.0.0.1:1/%2f,{}", config.amqp.url);
    let output = tokio::process::Command::new("python3")
        .arg(repo_root().join("clients/python/sandq_client.py"))
        .args(["--namespace", &namespace(), "--amqp-url", &addresses, "--redis-url", &config.redis.url, "--sku", "S"])
        .args(["--code", "x = 6\nx * 7"])
        .output()
        .await
        .expect("python3 clients/python/sandq_client.py");
    let result: serde_json::Value = serde_json::from_slice(&output.stdout).expect("client prints JSON");
    assert_eq!(result["outputs"][0]["output_type"], "execute_result", "{result}");
    assert_eq!(result["outputs"][0]["data"]["text/plain"]["text"], "42", "{result}");
}

#[tokio::test]
async fn node_jobs_report_output_stack_traces_and_exit_codes() {
    let mut client = client().await;
    let node = |code: &str| {
        let mut spec = python_job(code, Sku::S);
        spec.runtime = sandq_schemas::Runtime::Node;
        spec
    };
    let result = run(
        &mut client,
        &node("const os = require('os');\nconsole.log(process.version.split('.')[0], os.platform());\nfunction boom() { throw new Error('kaboom'); }\nboom();\n"),
    )
    .await;
    assert_eq!(result.status, JobStatus::Failed);
    assert_eq!(result.exit_code, Some(1));
    let major: u32 = result.stdout.text.trim_start_matches('v').split(' ').next().and_then(|v| v.parse().ok()).expect("node version");
    assert!(major >= 20, "Node.js 20+ required, got {}", result.stdout.text);
    assert!(result.stdout.text.ends_with(" linux\n"));
    assert!(result.stderr.text.contains("Error: kaboom"), "{}", result.stderr.text);
    assert!(result.stderr.text.contains("at boom (/sandq/main.js:3:"), "stack trace with the user's line: {}", result.stderr.text);
    // An ES module, a built-in module, and an exit code.
    let result = run(
        &mut client,
        &node(
            "import { createHash } from 'node:crypto';\nconsole.log(createHash('sha256').update('abc').digest('hex'));\nprocess.exit(4);\n",
        ),
    )
    .await;
    assert_eq!(result.exit_code, Some(4));
    assert_eq!(result.stdout.text, format!("{}\n", hex::encode(Sha256::digest(b"abc"))));
}

/// The shared protocol vectors (schemas/vectors/) through the real broker and worker, each
/// under a fresh job id on SKU S's queue: every valid JobSpec without inputs (inputs name
/// objects the vectors do not upload) runs, and every invalid one that names a usable job id is
/// `rejected` with exactly the reason its sidecar gives.
#[tokio::test]
async fn protocol_vectors_through_the_worker() {
    use rmpv::Value;
    let mut client = client().await;
    let root = repo_root().join("schemas/vectors/jobspec");
    // (name, body, expected status, expected reason)
    let mut cases = Vec::new();
    for (sub, valid) in [("valid", true), ("invalid", false)] {
        let mut names: Vec<_> = std::fs::read_dir(root.join(sub)).expect("vectors").flatten().map(|e| e.path()).collect();
        names.sort();
        for path in names.into_iter().filter(|p| p.extension().is_some_and(|e| e == "msgpack")) {
            let name = path.file_stem().expect("stem").to_string_lossy().into_owned();
            let sidecar: serde_json::Value =
                serde_json::from_slice(&std::fs::read(path.with_extension("json")).expect("sidecar")).expect("json");
            let mut value = rmpv::decode::read_value(&mut std::fs::read(&path).expect("vector").as_slice()).expect("msgpack");
            let Value::Map(map) = &mut value else { panic!("{name}: not a map") };
            let get = |map: &Vec<(Value, Value)>, k: &str| map.iter().find(|(key, _)| key.as_str() == Some(k)).map(|(_, v)| v.clone());
            let has_inputs = get(map, "inputs").is_some_and(|v| v.as_array().is_some_and(|a| !a.is_empty()));
            let id_ok = get(map, "job_id").and_then(|v| v.as_str().map(str::to_owned)).is_some_and(|id| id == "vector-job-1");
            if (valid && has_inputs) || !id_ok {
                continue;
            }
            let id = uuid::Uuid::new_v4().to_string();
            for (key, v) in map.iter_mut() {
                match key.as_str() {
                    Some("job_id") => *v = Value::from(id.as_str()),
                    // The queue decides the SKU: every vector goes to S's queue.
                    Some("sku") if v.as_str().is_some_and(|s| ["S", "M", "L", "XL"].contains(&s)) => *v = Value::from("S"),
                    _ => {}
                }
            }
            let mut body = Vec::new();
            rmpv::encode::write_value(&mut body, &value).expect("encode");
            let expected = if valid { None } else { Some(sidecar["reason"].as_str().expect("reason").to_owned()) };
            cases.push((name, id, body, expected));
        }
    }
    assert!(cases.len() >= 20, "only {} vectors", cases.len());
    for (_, id, body, _) in &cases {
        publish_raw(body, Sku::S, Some(id)).await;
    }
    for (name, id, _, expected) in &cases {
        let result = wait(&mut client, id).await;
        match expected {
            None => assert!(matches!(result.status, JobStatus::Succeeded | JobStatus::Failed), "{name}: {result:?}"),
            Some(reason) => {
                assert_eq!(result.status, JobStatus::Rejected, "{name}");
                assert_eq!(result.reason.as_deref(), Some(reason.as_str()), "{name}");
            }
        }
    }
}
