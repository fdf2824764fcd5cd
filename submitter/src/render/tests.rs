//! Every expected text and exit code below is written out by hand from what `sandq`
//! prints (README "What the demo shows", docs/protocol.md "Status values"), not computed
//! by the code under test.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use sandq_client::{Event, EventKind, Transcript};
use sandq_schemas::{
    Artifact, CapturedOutput, ErrorInfo, ImageSize, JobResult, JobStatus, MimeValue, Output, OutputType, ResourceUsage, SessionInfo,
    SkippedArtifact, Sku, TableShape,
};

use super::{exit_code, finish_code, live_event, print_result, unserved_warning};

fn result(id: &str, status: JobStatus, exit: Option<i32>) -> JobResult {
    let mut r = JobResult::new(id, status);
    r.exit_code = exit;
    r
}

fn text(t: &str) -> CapturedOutput {
    CapturedOutput { text: t.to_owned(), total_bytes: t.len() as u64, ..CapturedOutput::default() }
}

fn artifact(path: &str, content_type: &str, size: u64, url: Option<&str>) -> Artifact {
    Artifact {
        path: path.to_owned(),
        key: format!("jobs/j/a1/{path}"),
        size,
        sha256: "0".repeat(64),
        content_type: content_type.to_owned(),
        url: url.map(str::to_owned),
        url_expires_at_ms: None,
    }
}

fn output(output_type: OutputType, data: &[(&str, Option<&str>, Option<Artifact>)]) -> Output {
    Output {
        output_type,
        data: data
            .iter()
            .map(|(mime, text, artifact)| {
                let value = MimeValue { text: text.map(str::to_owned), artifact: artifact.clone(), size: 1 };
                ((*mime).to_owned(), value)
            })
            .collect(),
        table: None,
        image: None,
        display: None,
        error: None,
    }
}

fn utf8(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).expect("utf-8")
}

/// What `run` prints of `result` after a wait: (stdout, stderr).
fn render(
    result: &JobResult,
    downloaded: &[(&Artifact, PathBuf)],
    saved: &BTreeMap<usize, PathBuf>,
    live: Option<&Transcript>,
) -> (String, String) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    print_result(result, downloaded, saved, live, &mut out, &mut err).expect("writing to a Vec");
    (utf8(out), utf8(err))
}

/// One job's result, the exit code of `run`, and exactly what it prints.
struct Case {
    name: &'static str,
    result: JobResult,
    exit: i32,
    stdout: &'static str,
    stderr: &'static str,
}

fn cases() -> Vec<Case> {
    let mut ok = result("j-ok", JobStatus::Succeeded, Some(0));
    ok.stdout = text("hello\n");
    ok.usage = Some(ResourceUsage { wall_ms: 1166, cpu_ms: 1241, peak_memory_bytes: 92 * (1 << 20) + (1 << 19) });
    (ok.queued_at_ms, ok.started_at_ms, ok.finished_at_ms) = (Some(1_000), Some(1_002), Some(2_221));

    let mut fail = result("j-fail", JobStatus::Failed, Some(3));
    fail.stderr = text("boom\n");

    let mut exception = result("j-exc", JobStatus::Failed, Some(1));
    exception.stderr = text("Traceback (most recent call last):\nZeroDivisionError: division by zero\n");
    exception.error = Some(ErrorInfo { name: "ZeroDivisionError".into(), value: "division by zero".into(), traceback: vec!["1/0".into()] });
    let mut error_output = output(OutputType::Error, &[]);
    error_output.error = exception.error.clone();
    exception.outputs = vec![error_output];

    let mut segv = result("j-segv", JobStatus::Failed, None);
    segv.signal = Some("SIGSEGV".into());
    segv.reason = Some("killed by signal SIGSEGV".into());

    let mut timeout = result("j-slow", JobStatus::TimedOut, None);
    timeout.stdout = text("tick\n");
    timeout.signal = Some("SIGKILL".into());
    timeout.reason = Some("still running after its timeout of 2s".into());

    let mut oom = result("j-oom", JobStatus::OomKilled, Some(0));
    oom.reason = Some("memory limit of 1073741824 bytes reached".into());

    let mut cancelled = result("j-cancel", JobStatus::Cancelled, None);
    cancelled.reason = Some("cancelled by a client".into());

    let mut rejected = result("j-bad", JobStatus::Rejected, None);
    rejected.reason = Some("field `timeout`: \"soon\" is not a duration".into());

    let mut expired = result("j-late", JobStatus::Expired, None);
    expired.reason = Some("its deadline passed 5 ms before a worker took it".into());

    let mut internal = result("j-infra", JobStatus::InternalError, None);
    internal.reason = Some("gave up after 3 attempts: s3: connection refused".into());

    let mut truncated = result("j-big", JobStatus::Succeeded, Some(0));
    truncated.stdout = CapturedOutput { text: "aaaa".into(), total_bytes: 100_000, truncated: true, ..CapturedOutput::default() };
    truncated.stderr = CapturedOutput { text: "e".into(), total_bytes: 70_000, truncated: true, ..CapturedOutput::default() };

    let mut rich = result("j-rich", JobStatus::Succeeded, Some(0));
    rich.stdout = text("saved macro.png\n");
    let mut table = output(
        OutputType::ExecuteResult,
        &[("text/markdown", Some("| | a |\n|---|---:|\n| 0 | 1 |\n"), None), ("text/plain", Some("   a\n0  1"), None)],
    );
    table.table = Some(TableShape { rows: 1, columns: 1 });
    let mut image = output(OutputType::DisplayData, &[("image/png", None, Some(artifact("outputs/1.png", "image/png", 10, None)))]);
    image.image = Some(ImageSize { width: 800, height: 400 });
    let plain = output(OutputType::DisplayData, &[("text/plain", Some("a text display\n\n"), None)]);
    rich.outputs = vec![table, image, plain];
    rich.outputs_dropped = 2;

    vec![
        Case {
            name: "succeeded",
            result: ok,
            exit: 0,
            stdout: "hello\n",
            stderr: "--- sandq: job j-ok succeeded\n    exit code: 0\n    wall 1166 ms, cpu 1241 ms, peak memory 92.5 MiB\n    queued -> started 2 ms, started -> finished 1219 ms, submitted -> finished 1221 ms\n",
        },
        Case { name: "failed with exit code 3", result: fail, exit: 3, stdout: "", stderr: "boom\n--- sandq: job j-fail failed\n    exit code: 3\n" },
        Case {
            name: "an uncaught exception",
            result: exception,
            exit: 1,
            stdout: "",
            stderr: "Traceback (most recent call last):\nZeroDivisionError: division by zero\n--- sandq: job j-exc failed\n    exit code: 1\n    error: ZeroDivisionError: division by zero\n",
        },
        Case {
            name: "killed by a signal",
            result: segv,
            exit: 137,
            stdout: "",
            stderr: "--- sandq: job j-segv failed\n    reason: killed by signal SIGSEGV\n    signal: SIGSEGV\n",
        },
        Case {
            name: "timed out",
            result: timeout,
            exit: 124,
            stdout: "tick\n",
            stderr: "--- sandq: job j-slow timed_out\n    reason: still running after its timeout of 2s\n    signal: SIGKILL\n",
        },
        Case {
            name: "out of memory, although the program exited 0",
            result: oom,
            exit: 137,
            stdout: "",
            stderr: "--- sandq: job j-oom oom_killed\n    reason: memory limit of 1073741824 bytes reached\n    exit code: 0\n",
        },
        Case {
            name: "cancelled",
            result: cancelled,
            exit: 125,
            stdout: "",
            stderr: "--- sandq: job j-cancel cancelled\n    reason: cancelled by a client\n",
        },
        Case {
            name: "rejected",
            result: rejected,
            exit: 125,
            stdout: "",
            stderr: "--- sandq: job j-bad rejected\n    reason: field `timeout`: \"soon\" is not a duration\n",
        },
        Case {
            name: "expired",
            result: expired,
            exit: 125,
            stdout: "",
            stderr: "--- sandq: job j-late expired\n    reason: its deadline passed 5 ms before a worker took it\n",
        },
        Case {
            name: "infrastructure error",
            result: internal,
            exit: 125,
            stdout: "",
            stderr: "--- sandq: job j-infra internal_error\n    reason: gave up after 3 attempts: s3: connection refused\n",
        },
        Case {
            name: "truncated streams",
            result: truncated,
            exit: 0,
            stdout: "aaaa",
            stderr: "e[sandq: stdout truncated: 100000 bytes in all]\n[sandq: stderr truncated: 70000 bytes in all]\n--- sandq: job j-big succeeded\n    exit code: 0\n",
        },
        Case {
            name: "rich outputs: a table, an image not saved, a text display, outputs dropped",
            result: rich,
            exit: 0,
            stdout: "saved macro.png\n| | a |\n|---|---:|\n| 0 | 1 |\n[result 0: table, 1 rows x 1 columns]\na text display\n[sandq: 2 outputs dropped over the caps]\n",
            stderr: "--- sandq: job j-rich succeeded\n    exit code: 0\n",
        },
    ]
}

#[test]
fn each_result_prints_its_summary_and_exits_with_its_code() {
    for case in cases() {
        let (stdout, stderr) = render(&case.result, &[], &BTreeMap::new(), None);
        assert_eq!(stdout, case.stdout, "stdout of {}", case.name);
        assert_eq!(stderr, case.stderr, "stderr of {}", case.name);
        assert_eq!(exit_code(&case.result), case.exit, "exit code of {}", case.name);
        assert_eq!(finish_code(&case.result, false), case.exit, "exit code of {} after its downloads", case.name);
    }
}

#[test]
fn a_failed_download_makes_only_a_success_exit_125() {
    let ok = result("j", JobStatus::Succeeded, Some(0));
    assert_eq!(finish_code(&ok, true), 125);
    let failed = result("j", JobStatus::Failed, Some(4));
    assert_eq!(finish_code(&failed, true), 4);
    let timeout = result("j", JobStatus::TimedOut, None);
    assert_eq!(finish_code(&timeout, true), 124);
}

#[test]
fn statuses_that_are_not_over_exit_125() {
    assert_eq!(exit_code(&result("j", JobStatus::Queued, None)), 125);
    assert_eq!(exit_code(&result("j", JobStatus::Running, None)), 125);
    // A success without an exit code is not one the program gave: sandq's 125.
    assert_eq!(exit_code(&result("j", JobStatus::Succeeded, None)), 125);
}

#[test]
fn saved_outputs_and_artifacts_say_where_they_are() {
    let mut r = result("j-art", JobStatus::Succeeded, Some(0));
    let png = artifact("macro.png", "image/png", 59_677, Some("https://s3.example/macro.png"));
    let csv = artifact("data.csv", "text/csv", 12, Some("https://s3.example/data.csv"));
    let raw = artifact("raw.bin", "application/octet-stream", 3, None);
    r.artifacts = vec![png.clone(), csv, raw];
    let mut image = output(OutputType::DisplayData, &[("image/png", None, Some(artifact("outputs/0.png", "image/png", 10, None)))]);
    image.image = Some(ImageSize { width: 640, height: 480 });
    let figure = output(
        OutputType::ExecuteResult,
        &[("application/vnd.plotly.v1+json", Some("{}"), None), ("text/html", Some("<div></div>"), None)],
    );
    r.outputs = vec![image, figure];
    r.skipped_artifacts = vec![SkippedArtifact { path: "link".into(), reason: "symlink".into() }];
    r.skipped_artifacts_total = 3;
    r.session = Some(SessionInfo {
        name: "s1".into(),
        fresh: true,
        expired: false,
        restored_files: 0,
        saved_files: 2,
        deleted_files: 0,
        files: 2,
        bytes: 59_689,
        unsaved_files: 0,
        expires_at_ms: 0,
        state: None,
    });
    let downloaded = [(&png, PathBuf::from("sandq-out/j-art/macro.png"))];
    let saved = BTreeMap::from([
        (0, PathBuf::from("sandq-out/j-art/outputs/output-0-0.png")),
        (1, PathBuf::from("sandq-out/j-art/outputs/output-1.html")),
    ]);
    let (stdout, stderr) = render(&r, &downloaded, &saved, None);
    assert_eq!(
        stdout,
        "[display 0: image/png 640x480 saved to sandq-out/j-art/outputs/output-0-0.png]\n\
         [result 1: application/vnd.plotly.v1+json saved to sandq-out/j-art/outputs/output-1.html]\n"
    );
    assert_eq!(
        stderr,
        "--- sandq: job j-art succeeded\n    exit code: 0\n\
         \x20   artifact macro.png (image/png, 59677 bytes) -> sandq-out/j-art/macro.png\n\
         \x20   artifact data.csv (text/csv, 12 bytes) at https://s3.example/data.csv\n\
         \x20   artifact raw.bin (application/octet-stream, 3 bytes) at jobs/j/a1/raw.bin\n\
         \x20   session s1 (fresh): restored 0, saved 2, deleted 0 files; now 2 files, 59689 bytes\n\
         \x20   skipped link (symlink)\n\
         \x20   ... and 2 more files skipped\n"
    );
}

#[test]
fn a_session_that_had_expired_says_so() {
    let mut r = result("j-s", JobStatus::Succeeded, Some(0));
    r.session = Some(SessionInfo {
        name: "s2".into(),
        fresh: true,
        expired: true,
        restored_files: 0,
        saved_files: 0,
        deleted_files: 0,
        files: 0,
        bytes: 0,
        unsaved_files: 0,
        expires_at_ms: 0,
        state: None,
    });
    let (_, stderr) = render(&r, &[], &BTreeMap::new(), None);
    assert_eq!(
        stderr,
        "--- sandq: job j-s succeeded\n    exit code: 0\n    session s2 (fresh: the session had expired): restored 0, saved 0, deleted 0 files; now 0 files, 0 bytes\n"
    );
}

/// The end of `run` after live output: only what the stream did not print.
#[test]
fn after_live_output_only_the_rest_is_printed() {
    let mut r = result("j-live", JobStatus::Succeeded, Some(0));
    r.stdout = text("hello\nworld\n");
    r.stderr = text("warn\n");
    let summary = "--- sandq: job j-live succeeded\n    exit code: 0\n";

    // All of it came live.
    let mut live = Transcript::default();
    (live.stdout, live.stderr) = ("hello\nworld\n".into(), "warn\n".into());
    assert_eq!(render(&r, &[], &BTreeMap::new(), Some(&live)), (String::new(), summary.to_owned()));

    // The stream stopped early: the rest of each.
    (live.stdout, live.stderr) = ("hello\n".into(), String::new());
    assert_eq!(render(&r, &[], &BTreeMap::new(), Some(&live)), ("world\n".to_owned(), format!("warn\n{summary}")));

    // The stream held more than the inline text: nothing more.
    (live.stdout, live.stderr) = ("hello\nworld\nand more\n".into(), "warn\n".into());
    assert_eq!(render(&r, &[], &BTreeMap::new(), Some(&live)), (String::new(), summary.to_owned()));

    // Another attempt's output came live: the stored one follows whole, said so.
    (live.stdout, live.stderr) = ("other\n".into(), String::new());
    assert_eq!(
        render(&r, &[], &BTreeMap::new(), Some(&live)),
        ("hello\nworld\n".to_owned(), format!("[sandq: the live output differs from the stored one, which follows]\nwarn\n{summary}"))
    );

    // Nothing came live: all of it, without a word.
    let quiet = Transcript::default();
    assert_eq!(render(&r, &[], &BTreeMap::new(), Some(&quiet)), ("hello\nworld\n".to_owned(), format!("warn\n{summary}")));
}

#[test]
fn displays_shown_live_are_not_printed_again_only_where_they_were_saved() {
    let mut r = result("j-d", JobStatus::Succeeded, Some(0));
    let text_display = output(OutputType::DisplayData, &[("text/plain", Some("42"), None)]);
    let image = output(OutputType::DisplayData, &[("image/png", None, Some(artifact("outputs/1.png", "image/png", 10, None)))]);
    let result_image = output(OutputType::ExecuteResult, &[("image/png", None, Some(artifact("outputs/2.png", "image/png", 10, None)))]);
    r.outputs = vec![text_display, image, result_image];
    let saved = BTreeMap::from([(1, PathBuf::from("out/1.png")), (2, PathBuf::from("out/2.png"))]);
    let mut live = Transcript::default();
    live.displays = vec![(0, None)];
    let (stdout, _) = render(&r, &[], &saved, Some(&live));
    assert_eq!(stdout, "[display 1 saved to out/1.png]\n[result 2 saved to out/2.png]\n");
}

fn event(attempt: u32, seq: u64, kind: EventKind) -> Event {
    Event { id: format!("1-{seq}"), attempt, seq: Some(seq), kind }
}

#[test]
fn live_events_print_as_they_come() {
    let mut image =
        output(OutputType::DisplayData, &[("image/png", None, Some(artifact("outputs/0.png", "image/png", 10, Some("https://s3/x.png"))))]);
    image.image = Some(ImageSize { width: 640, height: 480 });
    let keyed = output(
        OutputType::DisplayData,
        &[("application/vnd.plotly.v1+json", None, Some(artifact("outputs/3.json", "application/json", 10, None)))],
    );
    let markdown = output(OutputType::ExecuteResult, &[("text/markdown", Some("**bold**\n"), None), ("text/plain", Some("bold"), None)]);
    let error = output(OutputType::Error, &[("text/plain", Some("ZeroDivisionError"), None)]);
    let events = [
        event(1, 0, EventKind::Attempt { attempt_id: "a1".into() }),
        event(1, 1, EventKind::Started { warm: true }),
        event(1, 2, EventKind::Stdout("a\n".into())),
        event(1, 3, EventKind::Stderr("e\n".into())),
        event(1, 4, EventKind::Display { index: 0, output: Some(Box::new(image)) }),
        event(1, 5, EventKind::Display { index: 1, output: Some(Box::new(markdown)) }),
        event(1, 6, EventKind::Display { index: 2, output: Some(Box::new(error)) }),
        event(1, 7, EventKind::Display { index: 3, output: Some(Box::new(keyed)) }),
        event(1, 8, EventKind::Display { index: 4, output: None }),
        event(1, 9, EventKind::Requeued { reason: "s3 down".into() }),
        event(2, 0, EventKind::Attempt { attempt_id: "a2".into() }),
        event(2, 1, EventKind::Stdout("b".into())),
        event(2, 2, EventKind::Truncated { stream: "stdout".into(), limit: 1_048_576 }),
        event(2, 3, EventKind::Finished { exit_code: Some(0) }),
        Event { id: "1-99".into(), attempt: 2, seq: None, kind: EventKind::End { status: "succeeded".into() } },
    ];
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let mut transcript = Transcript::default();
    for e in &events {
        live_event(e, &mut transcript, &mut out, &mut err).expect("writing to a Vec");
    }
    assert_eq!(utf8(out), "a\n[display 0: image/png 640x480 https://s3/x.png]\n**bold**\n[display 3: application/vnd.plotly.v1+json jobs/j/a1/outputs/3.json]\nb");
    assert_eq!(
        utf8(err),
        "e\n[sandq: attempt 2 starts over; what attempt 1 printed is not in the result]\n\
         [sandq: live stdout stopped at its cap (1048576); the rest comes at the end]\n"
    );
    // What the end compares the result with: the newest attempt's.
    assert_eq!((transcript.attempt(), transcript.stdout.as_str(), transcript.stderr.as_str()), (2, "b", ""));
}

#[test]
fn the_unserved_warning_says_when_the_job_expires() {
    assert_eq!(
        unserved_warning(Sku::S, Duration::ZERO),
        "sandq: no worker serves SKU S right now; the job waits in the queue until one does, or never expires (queues.unserved_ttl is 0)"
    );
    assert_eq!(
        unserved_warning(Sku::M, Duration::from_secs(3600)),
        "sandq: no worker serves SKU M right now; the job waits in the queue until one does, or expires after 1h (queues.unserved_ttl)"
    );
}
