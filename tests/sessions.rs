//! Sessions: files persist from one job to the next of the same session, never reach another
//! session, deletions propagate, two jobs of one session run one after the other, and an
//! expired session is deleted from S3 and starts fresh. Real worker, RabbitMQ, Redis, Garage.

use std::time::Duration;

use sandq_core::storage;
use sandq_schemas::names::Names;
use sandq_schemas::{JobSpec, JobStatus, Sku};
use sandq_tests::{client, exits_within, namespace, python_job, run, service_config, wait, Isolated};

fn session_job(code: &str, session: &str) -> JobSpec {
    let mut spec = python_job(code, Sku::S);
    spec.session = Some(session.to_owned());
    spec
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// Keys in S3 under the session's prefix.
async fn session_objects(names: &Names, session: &str) -> Vec<String> {
    let config = service_config();
    let s3 = storage::client(&config.s3);
    storage::list(&s3, &config.s3.bucket, &names.session_prefix(session), 1000).await.expect("list")
}

#[tokio::test]
async fn files_persist_within_a_session_and_never_reach_another() {
    let mut client = client().await;
    let names = Names::new(namespace());
    let (a, b) = (unique("a"), unique("b"));
    let token = uuid::Uuid::new_v4().to_string();
    let first = run(&mut client, &session_job(&format!("open('notes.txt', 'w').write('{token}')\nimport os; os.makedirs('sub', exist_ok=True)\nopen('sub/same.txt', 'w').write('x')\nopen('sub/copy.txt', 'w').write('x')\nopen('100% résumé?+&.txt', 'w').write('odd')\n"), &a)).await;
    assert_eq!(first.status, JobStatus::Succeeded, "{first:?}");
    let info = first.session.as_ref().expect("session info");
    assert!(info.fresh && !info.expired, "{info:?}");
    assert_eq!((info.saved_files, info.files), (4, 4), "{info:?}");
    // Two files with the same content share one blob: manifest + 3 blobs + the notebook state
    // (the cell's `os`).
    assert_eq!(session_objects(&names, &a).await.len(), 5);

    let second = run(
        &mut client,
        &session_job(
            "print(open('notes.txt').read())\nimport os\nprint(sorted(os.listdir('sub')))\nprint(open('100% résumé?+&.txt').read())\n",
            &a,
        ),
    )
    .await;
    assert_eq!(second.status, JobStatus::Succeeded, "{second:?}");
    assert_eq!(second.stdout.text, format!("{token}\n['copy.txt', 'same.txt']\nodd\n"));
    let info = second.session.as_ref().expect("session info");
    assert!(!info.fresh, "{info:?}");
    assert_eq!((info.restored_files, info.saved_files, info.deleted_files), (4, 0, 0), "unchanged files are not saved again: {info:?}");
    assert!(second.artifacts.is_empty(), "restored, unchanged files are not artifacts again: {:?}", second.artifacts);

    let other = run(&mut client, &session_job("import os\nprint(os.listdir('.'))\n", &b)).await;
    assert_eq!(other.stdout.text, "[]\n", "another session sees nothing: {other:?}");
    assert!(other.session.as_ref().is_some_and(|s| s.fresh));
    let plain = run(&mut client, &python_job("import os\nprint(os.listdir('.'))\n", Sku::S)).await;
    assert_eq!(plain.stdout.text, "[]\n", "a job without a session sees nothing");

    // Deleting a file in a job deletes it from the session (and its blob once unreferenced).
    let third = run(
        &mut client,
        &session_job("import os\nos.remove('notes.txt')\nos.remove('sub/copy.txt')\nos.remove('100% résumé?+&.txt')\n", &a),
    )
    .await;
    let info = third.session.as_ref().expect("session info");
    assert_eq!((info.deleted_files, info.files), (3, 1), "{info:?}");
    let objects = session_objects(&names, &a).await;
    assert_eq!(objects.len(), 3, "manifest + the blob still used by sub/same.txt + the state: {objects:?}");
    let fourth = run(&mut client, &session_job("import os\nprint(os.path.exists('notes.txt'), open('sub/same.txt').read())\n", &a)).await;
    assert_eq!(fourth.stdout.text, "False x\n");

    // `sandq session ls` / `rm` through the client library.
    let listed = client.sessions(10_000).await.expect("list");
    let entry = listed.iter().find(|s| s.name == a).expect("session a listed");
    assert_eq!((entry.files, entry.bytes), (Some(1), Some(1)));
    for name in [&a, &b] {
        client.remove_session(name, Duration::from_secs(10)).await.expect("rm");
        assert!(session_objects(&names, name).await.is_empty());
    }
    let after = run(&mut client, &session_job("import os\nprint(os.listdir('.'))\n", &a)).await;
    assert_eq!(after.stdout.text, "[]\n");
    assert!(after.session.as_ref().is_some_and(|s| s.fresh && !s.expired));
    client.remove_session(&a, Duration::from_secs(10)).await.expect("rm");
}

#[tokio::test]
async fn two_jobs_of_one_session_run_one_after_the_other() {
    let mut client = client().await;
    let session = unique("serial");
    let code = "import time, os\nn = len(open('log.txt').read().splitlines()) if os.path.exists('log.txt') else 0\ntime.sleep(1)\nopen('log.txt', 'a').write(f'{n}\\n')\n";
    // Different SKUs, so that the worker has a free slot for each and would run them at once.
    let mut second = session_job(code, &session);
    second.sku = Sku::M;
    let jobs = [session_job(code, &session), second];
    for job in &jobs {
        client.submit(job).await.expect("submit");
    }
    for job in &jobs {
        let result = wait(&mut client, &job.job_id).await;
        assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    }
    // Had they overlapped, both would have seen an empty log and written "0".
    let check = run(&mut client, &session_job("print(open('log.txt').read(), end='')", &session)).await;
    assert_eq!(check.stdout.text, "0\n1\n");
    client.remove_session(&session, Duration::from_secs(10)).await.expect("rm");
}

#[tokio::test]
async fn an_expired_session_is_deleted_from_s3_and_starts_fresh() {
    let world = Isolated::new().await;
    let env = [("SANDQ__SESSIONS__IDLE_TIMEOUT", "2s"), ("SANDQ__SESSIONS__REAP_INTERVAL", "500ms")];
    let mut worker = world.start_worker_ready(&format!("{}-w", world.namespace), &env);
    let mut client = world.client().await;
    let names = Names::new(world.namespace.clone());
    let session = unique("expiring");
    let first = run(&mut client, &session_job("open('data.csv', 'w').write('1,2\\n')", &session)).await;
    assert_eq!(first.status, JobStatus::Succeeded, "{first:?}");
    let info = first.session.as_ref().expect("session info");
    assert!(info.expires_at_ms > first.finished_at_ms.expect("finished") - 1000);
    assert_eq!(session_objects(&names, &session).await.len(), 3, "manifest, one blob and the notebook state");
    // The reaper deletes it within a few periods of the expiry.
    let started = std::time::Instant::now();
    while !session_objects(&names, &session).await.is_empty() {
        assert!(started.elapsed() < Duration::from_secs(30), "session still in S3 30 s after expiry");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let later = run(&mut client, &session_job("import os\nprint(os.listdir('.'))\n", &session)).await;
    assert_eq!(later.stdout.text, "[]\n", "{later:?}");
    let info = later.session.as_ref().expect("session info");
    assert!(info.fresh && info.expired, "told the session expired: {info:?}");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    client.remove_session(&session, Duration::from_secs(10)).await.expect("rm");
    world.delete_queues().await;
}

/// An input wins over a session file it clashes with (same path, or one a directory of the
/// other): the job runs with the input instead of failing to stage.
#[tokio::test]
async fn an_input_wins_over_a_clashing_session_file() {
    let mut client = client().await;
    let session = unique("clash");
    // keep2.txt is a hard link to keep.txt: on the job's own /work filesystem it can only join
    // the job's own files, so both are saved.
    let first = run(
        &mut client,
        &session_job(
            "import os\nopen('data', 'w').write('old')\nopen('keep.txt', 'w').write('kept')\nos.link('keep.txt', 'keep2.txt')\n",
            &session,
        ),
    )
    .await;
    assert_eq!(first.status, JobStatus::Succeeded, "{first:?}");
    let dir = tempfile::tempdir().expect("tempdir");
    let local = dir.path().join("x.csv");
    std::fs::write(&local, "a,b\n1,2\n").expect("write");
    let input = client.upload(&local, "data/x.csv").await.expect("upload");
    let mut spec =
        session_job("print(open('data/x.csv').read(), end='')\nprint(open('keep.txt').read(), open('keep2.txt').read())\n", &session);
    spec.inputs = vec![input];
    let second = run(&mut client, &spec).await;
    assert_eq!(second.status, JobStatus::Succeeded, "{second:?}");
    assert_eq!(second.stdout.text, "a,b\n1,2\nkept kept\n");
    client.remove_session(&session, Duration::from_secs(10)).await.expect("rm");
}

/// A notebook session keeps its variables, functions, classes and imports from one job to the
/// next, as a notebook does; cells are numbered; what cannot be saved is listed; a timed-out
/// job leaves the previous state; other sessions and session-less jobs see none of it.
#[tokio::test]
async fn notebook_variables_persist_across_the_jobs_of_a_session() {
    let mut client = client().await;
    let (s, other) = (unique("state"), unique("other"));
    let first = run(
        &mut client,
        &session_job(
            "import io\nimport pandas as pd\nx = 1\ndf = pd.read_csv(io.StringIO('a,b\\n1,2\\n3,4\\n'))\n\
             class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n\
             def double(v):\n    return 2 * v\n\
             p = Point(3, 4)\nf = open('/etc/hostname')\ng = (i for i in range(3))\nx\n",
            &s,
        ),
    )
    .await;
    assert_eq!(first.status, JobStatus::Succeeded, "{first:?}");
    assert_eq!(first.execution_count, Some(1));
    let state = first.session.as_ref().and_then(|i| i.state.clone()).expect("state report");
    assert!(state.saved && state.bytes > 0, "{state:?}");
    for name in ["Point", "df", "double", "io", "p", "pd", "x"] {
        assert!(state.variables.iter().any(|v| v == name), "{name} not saved: {state:?}");
    }
    let unsaved: Vec<(&str, &str)> = state.unsaved.iter().map(|u| (u.name.as_str(), u.reason.as_str())).collect();
    assert_eq!(unsaved, [("f", "an open file cannot be saved"), ("g", "TypeError: cannot pickle 'generator' object")]);

    let second =
        run(&mut client, &session_job("x += 1\nprint(x, int(df.b.sum()), p.norm(), double(21), type(p).__name__)\nq = Point(6, 8)\n", &s))
            .await;
    assert_eq!(second.status, JobStatus::Succeeded, "{}", second.stderr.text);
    assert_eq!(second.stdout.text, "2 6 5.0 42 Point\n");
    assert_eq!(second.execution_count, Some(2));
    assert_eq!(second.session.as_ref().and_then(|i| i.state.as_ref()).map(|st| st.restored), Some(7));

    let third = run(&mut client, &session_job("print(x, q.norm(), isinstance(q, Point), df.shape)\n", &s)).await;
    assert_eq!(third.stdout.text, "2 10.0 True (2, 2)\n", "{}", third.stderr.text);
    assert_eq!(third.execution_count, Some(3));

    // A timed-out job leaves the previous state (its cell still counts).
    let mut slow = session_job("x = 100\nimport time\ntime.sleep(30)\n", &s);
    slow.timeout = Some("2s".into());
    let slow = run(&mut client, &slow).await;
    assert_eq!(slow.status, JobStatus::TimedOut);
    assert!(slow.session.as_ref().and_then(|i| i.state.as_ref()).is_some_and(|st| !st.saved));
    let after = run(&mut client, &session_job("print(x)\n", &s)).await;
    assert_eq!(after.stdout.text, "2\n", "{}", after.stderr.text);
    assert_eq!(after.execution_count, Some(5));

    // Nothing of it elsewhere.
    let probe = "print([n for n in ('x', 'df', 'Point', 'p') if n in globals()])\n";
    let elsewhere = run(&mut client, &session_job(probe, &other)).await;
    assert_eq!(elsewhere.stdout.text, "[]\n");
    assert_eq!(elsewhere.execution_count, Some(1));
    let plain = run(&mut client, &python_job(probe, Sku::S)).await;
    assert_eq!(plain.stdout.text, "[]\n");
    assert_eq!(plain.execution_count, Some(1));
    assert!(plain.session.is_none());
}
