//! `sandq export`: a session's jobs (and an explicit list of jobs) written as a Jupyter
//! notebook, checked with nbformat's own validator and against the jobs' results. Real
//! worker, RabbitMQ, Redis, Garage and containers; the `sandq` binary from the target dir.
//!
//! nbformat comes from a virtualenv cached under `$SANDQ_CACHE` (default `/var/cache/sandq`),
//! made on first use (`python3 -m venv`, `pip install nbformat`) by one test at a time.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use base64::Engine;
use sandq_schemas::{JobStatus, Sku};
use sandq_tests::{bin_dir, client, namespace, python_job, run};
use sha2::{Digest, Sha256};

const NBFORMAT: &str = "nbformat==5.10.4";

/// A python3 that can `import nbformat` (found or made once per test binary).
fn nbformat_python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(nbformat_venv).clone()
}

/// The python3 of a virtualenv with nbformat, cached by the pinned version and the interpreter
/// (Debian's python3 refuses `pip install` into itself), made if it is not complete yet. Both
/// tests of this binary, and test runs of other checkouts sharing the cache, may ask for it at
/// once on a fresh machine: it is made under an exclusive lock of `nbformat-<key>.lock` beside
/// it, so that no run removes or uses another's half-made venv. `.complete` is written last; a
/// venv without it (its maker was killed) is removed and made again.
fn nbformat_venv() -> PathBuf {
    let interpreter = Command::new("python3").args(["-c", "import sys; print(sys.executable, sys.version)"]).output().expect("python3");
    let key = hex::encode(Sha256::digest([NBFORMAT.as_bytes(), &interpreter.stdout].concat()));
    let cache = std::env::var_os("SANDQ_CACHE").map_or_else(|| PathBuf::from("/var/cache/sandq"), PathBuf::from);
    let venv = cache.join(format!("nbformat-{}", &key[..16]));
    let python = venv.join("bin/python3");
    let complete = venv.join(".complete");
    if complete.exists() {
        return python;
    }
    std::fs::create_dir_all(&cache).expect("cache dir");
    let lock_path = cache.join(format!("nbformat-{}.lock", &key[..16]));
    let lock_file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&lock_path).expect("lock file");
    // Held until `lock_file` is closed, at the end of this function.
    lock_file.lock().expect("lock the nbformat venv");
    // Made by another test while this one waited for the lock.
    if !complete.exists() {
        let _ = std::fs::remove_dir_all(&venv);
        let made = Command::new("python3").args(["-m", "venv"]).arg(&venv).status().expect("python3 -m venv");
        assert!(made.success(), "python3 -m venv failed (apt-get install python3-venv)");
        let installed =
            Command::new(&python).args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", NBFORMAT]).status().expect("pip");
        assert!(installed.success(), "pip install {NBFORMAT} failed");
        std::fs::write(&complete, "").expect("mark venv complete");
    }
    drop(lock_file);
    python
}

/// Validates a notebook file with nbformat's own validator.
fn validate(path: &Path) {
    let checked = Command::new(nbformat_python())
        .args(["-c", "import sys, nbformat; nbformat.validate(nbformat.read(sys.argv[1], as_version=4)); print('valid')"])
        .arg(path)
        .output()
        .expect("python3");
    assert!(
        checked.status.success() && checked.stdout == b"valid\n",
        "nbformat rejects {}: {}{}",
        path.display(),
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
}

/// Runs `sandq export ARGS` in the test namespace.
fn export(args: &[&str]) {
    let output =
        Command::new(bin_dir().join("sandq")).arg("export").args(args).env("SANDQ__NAMESPACE", namespace()).output().expect("sandq");
    assert!(output.status.success(), "sandq export {args:?}: {}", String::from_utf8_lossy(&output.stderr));
}

fn read(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("notebook")).expect("notebook JSON")
}

#[tokio::test]
async fn a_session_exports_as_a_valid_notebook_with_code_counts_streams_images_and_errors() {
    let mut client = client().await;
    let session = uuid::Uuid::new_v4().to_string();
    let first_code = "\
import sys
import matplotlib.pyplot as plt
print('hello')
print('careful', file=sys.stderr)
plt.figure(figsize=(2, 1), dpi=50)
plt.plot([1, 2], [2, 1])
plt.show()
x = 41
x + 1
";
    let second_code = "x += 1\nraise ValueError(f'x is {x}')\n";
    let mut first = python_job(first_code, Sku::S);
    first.session = Some(session.clone());
    let first_result = run(&mut client, &first).await;
    assert_eq!(first_result.status, JobStatus::Succeeded, "{first_result:?}");
    let mut second = python_job(second_code, Sku::S);
    second.session = Some(session.clone());
    let second_result = run(&mut client, &second).await;
    assert_eq!(second_result.status, JobStatus::Failed, "{second_result:?}");

    // The figure's PNG as the job stored it, checked against its digest here.
    let png = first_result.outputs.iter().find_map(|o| o.data.get("image/png")).and_then(|v| v.artifact.clone()).expect("a PNG output");
    let dir = tempfile::tempdir().expect("tempdir");
    let png_bytes = std::fs::read(client.download_artifact(&png, dir.path()).await.expect("download")).expect("read png");
    assert_eq!(hex::encode(Sha256::digest(&png_bytes)), png.sha256);
    assert_eq!(&png_bytes[..8], b"\x89PNG\r\n\x1a\n");

    let by_session = dir.path().join("session.ipynb");
    export(&["--session", &session, "-o", by_session.to_str().expect("utf-8")]);
    validate(&by_session);
    let notebook = read(&by_session);
    assert_eq!((notebook["nbformat"].as_u64(), notebook["nbformat_minor"].as_u64()), (Some(4), Some(5)));
    assert_eq!(notebook["metadata"]["kernelspec"]["language"], "python");
    let cells = notebook["cells"].as_array().expect("cells");
    assert_eq!(cells.len(), 2, "{notebook}");
    let (a, b) = (&cells[0], &cells[1]);
    assert_eq!(a["cell_type"], "code");
    assert_eq!(a["id"], first.job_id.as_str());
    assert_eq!(a["source"], first_code);
    assert_eq!(a["execution_count"], 1);
    let outputs = a["outputs"].as_array().expect("outputs");
    let kinds: Vec<&str> = outputs.iter().map(|o| o["output_type"].as_str().unwrap_or_default()).collect();
    assert_eq!(kinds, ["stream", "stream", "display_data", "execute_result"], "{outputs:?}");
    assert_eq!((&outputs[0]["name"], &outputs[0]["text"]), (&"stdout".into(), &"hello\n".into()));
    assert_eq!(outputs[1]["name"], "stderr");
    assert!(outputs[1]["text"].as_str().unwrap_or_default().contains("careful"), "{:?}", outputs[1]);
    let embedded = outputs[2]["data"]["image/png"].as_str().expect("base64 PNG");
    let decoded = base64::engine::general_purpose::STANDARD.decode(embedded).expect("base64");
    assert_eq!(decoded, png_bytes, "the embedded image is the job's PNG");
    assert_eq!(outputs[2]["metadata"]["image/png"]["width"], 100);
    assert_eq!(outputs[3]["data"]["text/plain"], "42");
    assert_eq!(outputs[3]["execution_count"], 1);

    assert_eq!(b["id"], second.job_id.as_str());
    assert_eq!(b["source"], second_code);
    assert_eq!(b["execution_count"], 2, "the session's second cell");
    let error = b["outputs"].as_array().expect("outputs").iter().find(|o| o["output_type"] == "error").expect("an error output");
    assert_eq!(error["ename"], "ValueError");
    assert_eq!(error["evalue"], "x is 42");
    let traceback: Vec<&str> = error["traceback"].as_array().expect("traceback").iter().filter_map(|l| l.as_str()).collect();
    assert!(traceback.iter().any(|l| l.contains("/sandq/main.py")), "{traceback:?}");

    // An explicit list keeps the order given.
    let listed = dir.path().join("listed.ipynb");
    export(&[&second.job_id, &first.job_id, "-o", listed.to_str().expect("utf-8")]);
    validate(&listed);
    let ids: Vec<serde_json::Value> = read(&listed)["cells"].as_array().expect("cells").iter().map(|c| c["id"].clone()).collect();
    assert_eq!(ids, [second.job_id.as_str(), first.job_id.as_str()]);
}

/// A job whose code the client did not record (an entry point from its inputs) still exports:
/// its cell says the code was not recorded, and the notebook stays valid.
#[tokio::test]
async fn a_job_without_recorded_code_exports_with_a_comment_in_its_cell() {
    let mut client = client().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let program = dir.path().join("prog.py");
    std::fs::write(&program, "print('from an entry point')\n").expect("write");
    let mut spec = python_job("", Sku::S);
    spec.code = None;
    spec.entrypoint = Some("prog.py".into());
    spec.inputs = vec![client.upload(&program, "prog.py").await.expect("upload")];
    let result = run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    let path = dir.path().join("entry.ipynb");
    export(&[&spec.job_id, "-o", path.to_str().expect("utf-8")]);
    validate(&path);
    let cell = read(&path)["cells"][0].clone();
    let source = cell["source"].as_str().expect("source");
    assert!(source.starts_with('#') && source.contains("not recorded") && source.contains(&spec.job_id), "{source}");
    assert_eq!(cell["outputs"][0]["text"], "from an entry point\n");
}
