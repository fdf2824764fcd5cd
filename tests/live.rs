//! Live events (docs/protocol.md "Live events"): what a job prints and displays reaches the
//! client while it runs, through the job's Redis Stream, and the stored result stays whole
//! whatever happens to the stream: a worker SIGKILLed mid-stream, Redis restarted mid-job, an
//! output flood, a reader that disconnects and resumes.

use std::time::Duration;

use futures::StreamExt;
use sandq_client::{Client, Event, EventKind, Transcript};
use sandq_core::events::START;
use sandq_schemas::{JobStatus, RunMode, Sku};
use sandq_tests::{client, exits_within, free_port, python_job, signal, stop_worker, wait, Isolated, RedisFleet};

/// Longest a test reads a job's events.
const READ_LIMIT: Duration = Duration::from_secs(180);

/// Reads the job's events from `cursor` to the end, calling `each` on every one as it comes.
async fn read_all(client: &mut Client, job_id: &str, cursor: &str, mut each: impl FnMut(&Event)) -> Vec<Event> {
    let mut events = Vec::new();
    let reading = async {
        let stream = client.events(job_id, cursor, Duration::from_millis(200));
        futures::pin_mut!(stream);
        while let Some(event) = stream.next().await {
            each(&event);
            events.push(event);
        }
    };
    tokio::time::timeout(READ_LIMIT, reading).await.expect("the event stream did not end");
    events
}

/// Reads the job's events to their end on a task of its own, once the first line of output
/// has arrived (the caller then breaks something mid-stream).
async fn read_in_background(mut reader: Client, job_id: &str) -> tokio::task::JoinHandle<Vec<Event>> {
    let job_id = job_id.to_owned();
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel();
    let reading = tokio::spawn(async move {
        read_all(&mut reader, &job_id, START, |e| {
            let _ = seen_tx.send(matches!(e.kind, EventKind::Stdout(_)));
        })
        .await
    });
    while !seen_rx.recv().await.expect("the stream ended before any output") {}
    reading
}

/// The job's status now, read on a connection of its own.
async fn status_now(probe: &mut Client, job_id: &str) -> Option<JobStatus> {
    probe.status(job_id).await.expect("status").map(|r| r.status)
}

/// A job that prints `lines` lines `pause` seconds apart (flushed each).
fn printer(lines: u32, pause: f64) -> String {
    format!("import time\nfor i in range({lines}):\n    print('line', i, flush=True)\n    time.sleep({pause})\n")
}

fn expected_lines(lines: u32) -> String {
    (0..lines).map(|i| format!("line {i}\n")).collect()
}

#[tokio::test]
async fn lines_reach_the_client_while_the_job_runs_in_order() {
    let mut client = client().await;
    let spec = python_job(&printer(15, 0.2), Sku::S);
    client.submit(&spec).await.expect("submit");
    let events = read_all(&mut client, &spec.job_id, START, |_| {}).await;
    let mut transcript = Transcript::default();
    events.iter().for_each(|e| transcript.push(e));
    assert_eq!(transcript.stdout, expected_lines(15), "{events:#?}");
    assert!(transcript.missing.is_empty(), "no event was dropped: {:?}", transcript.missing);
    assert_eq!(transcript.status.as_deref(), Some("succeeded"));
    assert!(matches!(events[0].kind, EventKind::Attempt { .. }), "the attempt event comes first: {events:#?}");
    assert!(events.iter().any(|e| matches!(e.kind, EventKind::Started { .. })));
    assert!(events.iter().any(|e| matches!(e.kind, EventKind::Finished { exit_code: Some(0) })));
    assert!(matches!(events.last().map(|e| &e.kind), Some(EventKind::End { .. })));
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.stdout.text, expected_lines(15), "the stored result is whole");
    assert!(events.iter().all(|e| e.attempt == result.attempt));
}

/// A second client on the shared worker's services.
async fn client_again() -> Client {
    Client::connect(sandq_tests::service_config()).await.expect("client")
}

#[tokio::test]
async fn lines_arrive_before_the_job_ends() {
    let mut client = client().await;
    let mut probe = client_again().await;
    let spec = python_job(&printer(15, 0.2), Sku::S);
    client.submit(&spec).await.expect("submit");
    let mut status_at_first_line = None;
    let mut stdout = String::new();
    let reading = async {
        let stream = client.events(&spec.job_id, START, Duration::from_millis(200));
        futures::pin_mut!(stream);
        while let Some(event) = stream.next().await {
            if let EventKind::Stdout(text) = &event.kind {
                if status_at_first_line.is_none() {
                    status_at_first_line = Some(status_now(&mut probe, &spec.job_id).await);
                }
                stdout.push_str(text);
            }
        }
    };
    tokio::time::timeout(READ_LIMIT, reading).await.expect("the event stream did not end");
    // The job prints for 3 s: its first line is read while its status is still `running`.
    assert_eq!(status_at_first_line, Some(Some(JobStatus::Running)));
    assert_eq!(stdout, expected_lines(15));
}

#[tokio::test]
async fn the_first_chart_arrives_before_the_second_is_drawn() {
    let mut client = client().await;
    let mut probe = client_again().await;
    let code = "import time\nimport matplotlib.pyplot as plt\n\
                fig, ax = plt.subplots()\nax.plot([1, 2, 3])\nax.set_title('first')\nplt.show()\n\
                time.sleep(3)\n\
                fig, ax = plt.subplots()\nax.bar([1, 2], [3, 4])\nax.set_title('second')\nplt.show()\n";
    let mut spec = python_job(code, Sku::S);
    spec.mode = Some(RunMode::Notebook);
    client.submit(&spec).await.expect("submit");
    let mut displays = Vec::new();
    let mut status_at_first = None;
    let reading = async {
        let stream = client.events(&spec.job_id, START, Duration::from_millis(200));
        futures::pin_mut!(stream);
        while let Some(event) = stream.next().await {
            if let EventKind::Display { index, output } = &event.kind {
                if displays.is_empty() {
                    status_at_first = Some(status_now(&mut probe, &spec.job_id).await);
                }
                displays.push((*index, output.clone().expect("a display's output parses")));
            }
        }
    };
    tokio::time::timeout(READ_LIMIT, reading).await.expect("the event stream did not end");
    assert_eq!(status_at_first, Some(Some(JobStatus::Running)), "the first chart came while the job ran");
    assert_eq!(displays.iter().map(|(i, _)| *i).collect::<Vec<_>>(), vec![0, 1]);
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    assert_eq!(result.outputs.len(), 2);
    for (index, output) in &displays {
        let live = output.data.get("image/png").and_then(|v| v.artifact.as_ref()).expect("the chart is an S3 object, not inline bytes");
        assert!(live.url.is_some(), "the live chart has a URL");
        let stored = result.outputs[*index as usize].data["image/png"].artifact.as_ref().expect("stored chart");
        assert_eq!((&live.key, &live.sha256), (&stored.key, &stored.sha256), "the live chart is the stored one");
        let bytes = client.fetch_artifact(live).await.expect("the live chart can be fetched");
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"));
    }
}

#[tokio::test]
async fn a_reader_that_resumes_from_its_cursor_gets_no_gap_and_no_duplicate() {
    let mut client = client().await;
    let spec = python_job(&printer(30, 0.05), Sku::S);
    client.submit(&spec).await.expect("submit");
    // Read five events, then drop the stream (a disconnect).
    let mut first = Vec::new();
    {
        let stream = client.events(&spec.job_id, START, Duration::from_millis(200));
        futures::pin_mut!(stream);
        while first.len() < 5 {
            let next = tokio::time::timeout(READ_LIMIT, stream.next()).await.expect("events");
            first.push(next.expect("the stream ended after fewer than 5 events"));
        }
    }
    let cursor = first.last().expect("five").id.clone();
    let rest = read_all(&mut client, &spec.job_id, &cursor, |_| {}).await;
    let whole = read_all(&mut client, &spec.job_id, START, |_| {}).await;
    let resumed: Vec<&str> = first.iter().chain(&rest).map(|e| e.id.as_str()).collect();
    let once: Vec<&str> = whole.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(resumed, once, "resumed reading = one reading from the start");
    let mut transcript = Transcript::default();
    first.iter().chain(&rest).for_each(|e| transcript.push(e));
    assert_eq!(transcript.stdout, expected_lines(30));
}

#[tokio::test]
async fn a_redelivered_attempt_starts_with_an_attempt_event_and_the_result_is_whole() {
    let world = Isolated::new().await;
    let first_id = format!("{}-a", world.namespace);
    let mut first = world.start_worker_ready(&first_id, &sandq_tests::small_worker_env(&[]));
    let mut client = world.client().await;
    // The first attempt prints slowly (and is killed); the second quickly.
    let code = "import os, time\nattempt = os.environ['SANDQ_ATTEMPT']\nfor i in range(40):\n    print(attempt, i, flush=True)\n    \
                if attempt == '1':\n        time.sleep(0.25)\n";
    let spec = python_job(code, Sku::S);
    client.submit(&spec).await.expect("submit");
    let reading = read_in_background(world.client().await, &spec.job_id).await;
    signal(&first, "KILL");
    assert!(exits_within(&mut first, Duration::from_secs(5)));
    let second = world.start_worker_ready(&format!("{}-b", world.namespace), &sandq_tests::small_worker_env(&[]));
    let events = reading.await.expect("reader");
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    // The new worker may get the job while the killed one's sandbox is still being torn down,
    // and hand it back once before running it: the attempt that ran is 2 or later.
    let last = result.attempt;
    assert!(last >= 2, "{result:?}");
    let last_lines: String = (0..40).map(|i| format!("{last} {i}\n")).collect();
    assert_eq!(result.stdout.text, last_lines, "the result is the last attempt's, whole");
    // Attempt 1's events, then the last attempt's, which begin with its attempt event (an
    // attempt that did not run sends none).
    let switch = events.iter().position(|e| e.attempt > 1).expect("events of a later attempt");
    assert!(switch > 0 && events[..switch].iter().all(|e| e.attempt == 1), "{events:#?}");
    // Attempt 1 streamed the start of its own output (an unbuffered print may arrive in
    // pieces: "1", " 0\n"...).
    let first_text: String = events[..switch]
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Stdout(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    let attempt_1: String = (0..40).map(|i| format!("1 {i}\n")).collect();
    assert!(!first_text.is_empty() && attempt_1.starts_with(&first_text), "{first_text:?}");
    assert!(matches!(events[switch].kind, EventKind::Attempt { .. }), "{:?}", events[switch]);
    assert!(events[switch..].iter().all(|e| e.attempt == last), "{events:#?}");
    let mut transcript = Transcript::default();
    events.iter().for_each(|e| transcript.push(e));
    assert_eq!(transcript.attempts, vec![1, last]);
    assert_eq!(transcript.stdout, last_lines);
    assert_eq!(transcript.status.as_deref(), Some("succeeded"));
    stop_worker(second);
    world.delete_queues().await;
}

#[tokio::test]
async fn a_redis_restart_mid_job_loses_nothing_of_the_result() {
    let port = free_port();
    let mut redis = RedisFleet::single("live-redis", port);
    let url = format!("redis://127.0.0.1:{port}/");
    let world = Isolated::with_config(|c| c.redis.url = url.clone()).await;
    let mut env = sandq_tests::small_worker_env(&[]);
    env.push(("SANDQ__REDIS__URL", url.as_str()));
    let worker = world.start_worker_ready(&format!("{}-w", world.namespace), &env);
    let mut client = world.client().await;
    let spec = python_job(&printer(25, 0.2), Sku::S);
    client.submit(&spec).await.expect("submit");
    let reading = read_in_background(world.client().await, &spec.job_id).await;
    // Down for a second while the job prints.
    let redis = tokio::task::spawn_blocking(move || {
        redis.restart(port, Duration::from_secs(1));
        redis
    })
    .await
    .expect("restart");
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, expected_lines(25), "the result is complete");
    // The reader got through the restart to the end (gaps allowed: the stream is best effort).
    let events = reading.await.expect("reader");
    let mut transcript = Transcript::default();
    events.iter().for_each(|e| transcript.push(e));
    assert_eq!(transcript.status.as_deref(), Some("succeeded"), "{events:#?}");
    stop_worker(worker);
    world.delete_queues().await;
    drop(redis);
}

#[tokio::test]
async fn an_output_flood_streams_at_most_the_cap_and_the_worker_memory_stays_flat() {
    let world = Isolated::new().await;
    let worker = world.start_worker_ready(&format!("{}-w", world.namespace), &sandq_tests::small_worker_env(&[]));
    let pid = worker.id();
    let mut client = world.client().await;
    let mut redis = sandq_tests::plain_redis(&world).await;
    // 100 MiB to stdout, as fast as the pipe takes it.
    let code = "import os\nchunk = b'x' * (1 << 20)\nfor i in range(100):\n    os.write(1, chunk)\n";
    let mut peaks = Vec::new();
    for _ in 0..2 {
        let mut spec = python_job(code, Sku::S);
        spec.mode = Some(RunMode::Script);
        client.submit(&spec).await.expect("submit");
        let events = read_all(&mut client, &spec.job_id, START, |_| {}).await;
        let result = wait(&mut client, &spec.job_id).await;
        assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
        assert_eq!(result.stdout.total_bytes, 100 << 20, "the result counts every byte, as without streaming");
        assert_eq!(result.stdout.log_bytes, 8 << 20);
        let streamed: usize = events.iter().map(|e| if let EventKind::Stdout(t) = &e.kind { t.len() } else { 0 }).sum();
        assert!(streamed > 0 && streamed <= 1 << 20, "streamed {streamed} bytes, the cap is 1 MiB");
        assert!(
            events.iter().any(|e| matches!(&e.kind, EventKind::Truncated { stream, limit } if stream == "stdout" && *limit == 1 << 20)),
            "a truncated event says where the stream stopped"
        );
        let key = sandq_schemas::names::Names::new(world.namespace.clone()).events_key(&spec.job_id);
        let used: u64 = redis::cmd("MEMORY").arg("USAGE").arg(&key).query_async(&mut redis).await.expect("memory usage");
        assert!(used < 2 << 20, "the capped stream holds {used} bytes of Redis memory");
        peaks.push(sandq_tests::process_usage(pid).0);
    }
    // The second flood raised the worker's peak memory by little: nothing accumulates.
    let growth = peaks[1].saturating_sub(peaks[0]);
    assert!(growth < 16 << 20, "the second flood raised the worker's peak memory by {growth} bytes ({peaks:?})");
    stop_worker(worker);
    world.delete_queues().await;
}

/// `sandq run` prints each line as the job prints it (by default), and once: the summary at
/// the end does not print it again.
#[tokio::test]
async fn sandq_run_prints_lines_as_they_come_and_only_once() {
    use std::io::BufRead;
    let mut probe = client().await;
    let job_id = uuid::Uuid::new_v4().to_string();
    let out = tempfile::tempdir().expect("out dir");
    let mut child = std::process::Command::new(sandq_tests::bin_dir().join("sandq"))
        .args(["run", "--sku", "S", "--id", &job_id, "--out"])
        .arg(out.path())
        .args(["-c", &printer(15, 0.2)])
        .env("SANDQ__NAMESPACE", sandq_tests::namespace())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("sandq run");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let _ = tx.send(line.expect("line"));
        }
    });
    let mut lines = Vec::new();
    let mut job = None;
    while let Some(line) = tokio::time::timeout(READ_LIMIT, rx.recv()).await.expect("sandq run printed nothing for minutes") {
        if lines.is_empty() {
            job = Some(status_now(&mut probe, &job_id).await);
        }
        lines.push(line);
    }
    let status = child.wait().expect("sandq run exits");
    assert!(status.success(), "{status:?}: {}", std::io::read_to_string(child.stderr.take().expect("stderr")).unwrap_or_default());
    assert_eq!(job, Some(Some(JobStatus::Running)), "the first line was printed while the job ran");
    let expected: Vec<String> = expected_lines(15).lines().map(str::to_owned).collect();
    assert_eq!(lines, expected, "every line once, in order");
}
