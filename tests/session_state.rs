//! A session keeps what a notebook keeps: real-size data, functions that see the session's
//! globals, two names for one object, and a session that goes on when a value of its state
//! cannot be restored (it hangs, raises, or needs more memory than the job has). The cells of
//! `tests/reported/sessions/<case>/` are run in order in a fresh session each, on the real
//! worker and image; the right behaviour is written at the top of each case's last cell.

use sandq_schemas::{JobResult, JobSpec, JobStatus, SessionState, Sku};
use sandq_tests::{client, python_job, repo_root, run};

fn cell(case: &str, n: usize) -> String {
    let path = repo_root().join("tests/reported/sessions").join(case).join(format!("cell{n}.py"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn in_session(code: &str, session: &str) -> JobSpec {
    let mut spec = python_job(code, Sku::S);
    spec.session = Some(session.to_owned());
    spec
}

fn fresh_session() -> String {
    format!("state-{}", uuid::Uuid::new_v4().simple())
}

fn state(result: &JobResult) -> SessionState {
    result.session.as_ref().and_then(|s| s.state.clone()).unwrap_or_else(|| panic!("no state report: {result:?}"))
}

/// Runs the cells of `case` in one new session; every cell must succeed.
async fn cells(case: &str, count: usize) -> Vec<JobResult> {
    let mut client = client().await;
    let session = fresh_session();
    let mut results = Vec::new();
    for n in 1..=count {
        let result = run(&mut client, &in_session(&cell(case, n), &session)).await;
        assert_eq!(result.status, JobStatus::Succeeded, "{case} cell {n}: {}\n{result:?}", result.stderr.text);
        results.push(result);
    }
    results
}

#[tokio::test]
async fn a_dataframe_of_100000_rows_is_kept() {
    let results = cells("big_frame", 2).await;
    let saved = state(&results[0]);
    assert!(saved.unsaved.is_empty(), "{saved:?}");
    assert!(saved.variables.iter().any(|v| v == "df"), "{saved:?}");
    // Two float64/int64 columns of 100,000 rows: at least their 1.6 MB of buffers.
    assert!(saved.bytes >= 1_600_000, "{saved:?}");
    // sum(0.5 k for k < 100000) = 0.5 * 99999 * 100000 / 2
    assert_eq!(results[1].stdout.text, format!("100000 {:.1}\n", 0.5 * 99_999.0 * 100_000.0 / 2.0));
    assert!(state(&results[1]).not_restored.is_empty());
}

#[tokio::test]
async fn a_restored_function_sees_the_sessions_globals() {
    let results = cells("function_globals", 2).await;
    // charge(100) with the new rate 0.5, appended to the list the session sees.
    assert_eq!(results[1].stdout.text, "150.0 [10, 100]\n");
}

#[tokio::test]
async fn two_names_for_one_object_stay_one_object() {
    let results = cells("shared_objects", 2).await;
    assert_eq!(results[1].stdout.text, "True [1, 2]\n", "{}", results[1].stderr.text);
    // The figure of cell 1, retitled and resized: 10 x 4 in at the default 100 dpi, with the
    // line drawn in cell 1 and the new title.
    let figures: Vec<_> = results[1].outputs.iter().filter(|o| o.image.is_some()).collect();
    assert_eq!(figures.len(), 1, "{:?}", results[1].outputs);
    let size = figures[0].image.expect("size");
    assert_eq!((size.width, size.height), (1000, 400));
    let chart: serde_json::Value =
        serde_json::from_str(figures[0].data.get("application/vnd.sandq.chart+json").and_then(|v| v.text.as_deref()).expect("chart data"))
            .expect("chart json");
    assert_eq!(chart["title"], "second", "{chart}");
    assert_eq!(chart["elements"].as_array().map(Vec::len), Some(1), "the line of cell 1: {chart}");
}

#[tokio::test]
async fn a_value_whose_restore_hangs_is_dropped_and_the_session_goes_on() {
    let mut client = client().await;
    let session = fresh_session();
    let first = run(&mut client, &in_session(&cell("poison_state", 1), &session)).await;
    assert_eq!(first.status, JobStatus::Succeeded, "{first:?}");
    let mut second = in_session(&cell("poison_state", 2), &session);
    second.timeout = Some("20s".into());
    let second = run(&mut client, &second).await;
    assert_eq!(second.status, JobStatus::Succeeded, "{}\n{second:?}", second.stderr.text);
    assert_eq!(second.stdout.text, "alive 42\n");
    let restored = state(&second);
    let dropped: Vec<&str> = restored.not_restored.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(dropped, ["x"], "{restored:?}");
    assert!(restored.not_restored[0].reason.starts_with("restoring it took over"), "{restored:?}");
    assert!(restored.restore_ms >= 1_000, "the hang was cut, after its limit: {restored:?}");
    // The state saved after cell 2 no longer holds it: the next cell starts at once.
    let third = run(&mut client, &in_session("print('third', y)\n", &session)).await;
    assert_eq!(third.stdout.text, "third 42\n", "{third:?}");
    assert!(state(&third).not_restored.is_empty(), "{:?}", state(&third));
}

#[tokio::test]
async fn values_that_raise_or_eat_memory_on_restore_are_dropped_alone() {
    let mut client = client().await;
    let session = fresh_session();
    // Restoring `boom` raises; restoring `hog` asks for 12.8 GB on a 2 GB SKU; restoring
    // `writer` writes a file into /work (it runs inside the job's sandbox, like any cell).
    let first = run(
        &mut client,
        &in_session(
            "import numpy as np\n\
             class Boom:\n    def __reduce__(self):\n        return (int, ('not a number',))\n\
             class Hog:\n    def __reduce__(self):\n        return (np.ones, ((40_000, 40_000),))\n\
             class Writer:\n    def __reduce__(self):\n        return (eval, (\"open('/work/written_on_load.txt', 'w').write('hi')\",))\n\
             boom, hog, writer = Boom(), Hog(), Writer()\nkept = {'a': [1, 2, 3]}\n",
            &session,
        ),
    )
    .await;
    assert_eq!(first.status, JobStatus::Succeeded, "{first:?}");
    let second = run(&mut client, &in_session("import os\nprint(kept['a'], os.path.exists('written_on_load.txt'))\n", &session)).await;
    assert_eq!(second.status, JobStatus::Succeeded, "{}\n{second:?}", second.stderr.text);
    assert_eq!(second.stdout.text, "[1, 2, 3] True\n");
    let restored = state(&second);
    let reasons: std::collections::BTreeMap<&str, &str> =
        restored.not_restored.iter().map(|v| (v.name.as_str(), v.reason.as_str())).collect();
    assert_eq!(reasons.get("boom"), Some(&"ValueError: invalid literal for int() with base 10: 'not a number'"), "{restored:?}");
    assert_eq!(reasons.get("hog"), Some(&"restoring it needed more memory than the job has left"), "{restored:?}");
    assert!(!reasons.contains_key("kept"), "{restored:?}");
    let third = run(&mut client, &in_session("print(sorted(k for k in ('boom', 'hog', 'kept') if k in globals()))\n", &session)).await;
    assert_eq!(third.stdout.text, "['kept']\n", "the session healed: {third:?}");
}

/// The next cell on the worker that saved a state restores it from the worker's own copy,
/// not from S3; with that copy gone (as on another worker), from S3; the session sees the
/// same values either way.
#[tokio::test]
async fn a_state_saved_here_is_restored_from_the_workers_copy_else_from_s3() {
    let world = sandq_tests::Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let port = sandq_tests::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut env = sandq_tests::small_worker_env(&[]);
    env.push(("SANDQ__WORKER__METRICS_ADDR", addr.as_str()));
    let worker = world.start_worker_ready(&id, &env);
    let mut client = world.client().await;
    let session = fresh_session();
    let first = run(&mut client, &in_session("x = list(range(10))\ny = {'k': x}", &session)).await;
    assert_eq!(first.status, JobStatus::Succeeded, "{first:?}");
    let series = |outcome: &str| format!("sandq_state_cache_total{{outcome=\"{outcome}\"}}");
    let before = (sandq_tests::metric(port, &series("hit")), sandq_tests::metric(port, &series("miss")));
    let second = run(&mut client, &in_session("x.append(10)\nprint(sum(x), y['k'] is x)", &session)).await;
    assert_eq!(second.stdout.text, "55 True\n", "{second:?}");
    let hits = sandq_tests::metric(port, &series("hit")).zip(before.0).map(|(a, b)| a - b);
    let misses = sandq_tests::metric(port, &series("miss"));
    assert_eq!(hits, Some(1.0), "the second cell's state came from the worker's copy (misses {misses:?}, before {before:?})");
    // Without the copy: from S3, the same values.
    let cache = sandq_tests::worker_data_dir().join(format!("{id}.state-cache"));
    assert!(cache.is_dir(), "{}", cache.display());
    std::fs::remove_dir_all(&cache).expect("remove the cache");
    let third = run(&mut client, &in_session("print(sum(x), y['k'] is x)", &session)).await;
    assert_eq!(third.stdout.text, "55 True\n", "{third:?}");
    let misses = sandq_tests::metric(port, &series("miss")).zip(before.1).map(|(a, b)| a - b);
    assert_eq!(misses, Some(1.0), "the third cell's state came from S3");
    sandq_tests::stop_worker(worker);
    world.delete_queues().await;
    let _ = std::fs::remove_dir_all(&cache);
}

/// The state a cell restores is read from a read-only directory on the host's disk
/// (`/sandq/in`), not from a tmpfs the worker fills: a tmpfs page the worker writes is charged
/// to the worker's memory, so a 40 MB state would have grown the worker by 40 MB a cell
/// (issue 21). The restored value is the one saved (its digest, computed in the cell that made
/// it), and the sandbox cannot write the file it restores from.
#[tokio::test]
async fn a_restored_state_comes_from_a_read_only_disk_file_not_a_tmpfs() {
    let mut client = client().await;
    let session = fresh_session();
    let first = run(
        &mut client,
        &in_session("import hashlib, os\nblob = os.urandom(40_000_000)\nprint(hashlib.sha256(blob).hexdigest())", &session),
    )
    .await;
    assert_eq!(first.status, JobStatus::Succeeded, "{first:?}");
    assert!(state(&first).unsaved.is_empty(), "{:?}", state(&first));
    let digest = first.stdout.text.trim().to_owned();
    let probe = r#"
import errno, hashlib, os
path = os.environ["SANDQ_STATE_IN"]
mount = next(l.split() for l in open("/proc/self/mountinfo") if l.split()[4] == os.path.dirname(path))
fstype = mount[mount.index("-") + 1]
try:
    open(path, "ab").close()
    write = "written"
except OSError as e:
    write = errno.errorcode[e.errno]
print(hashlib.sha256(blob).hexdigest(), fstype, "ro" in mount[5].split(","), write, os.path.getsize(path) > 40_000_000)
"#;
    let second = run(&mut client, &in_session(probe, &session)).await;
    assert_eq!(second.status, JobStatus::Succeeded, "{second:?}");
    let fields: Vec<&str> = second.stdout.text.split_whitespace().collect();
    assert_eq!(fields.len(), 5, "{second:?}");
    assert_eq!(fields[0], digest, "the restored blob is the saved one");
    assert_ne!(fields[1], "tmpfs", "the state is not on a tmpfs: {second:?}");
    assert_eq!((fields[2], fields[4]), ("True", "True"), "a read-only mount holding the whole state: {second:?}");
    // Not the sandbox's file (EACCES), on a read-only mount (EROFS) besides.
    assert!(["EACCES", "EROFS"].contains(&fields[3]), "the sandbox cannot write it: {second:?}");
}
