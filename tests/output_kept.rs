//! Nothing a program wrote or raised is lost (issue 9, section 1): output written before a
//! timeout, an OOM kill, a cancel or `process.exit` reaches the result in both Python modes and
//! in Node.js, stderr too; a cell whose exception a magic caught (`%%time`, `%%capture`, `%run`)
//! fails with it. Real worker, broker, Redis, Garage and containers; the reported inputs are
//! `tests/reported/` (programs users reported, with the right behaviour at the top of each), run
//! as they are.

use std::time::Duration;

use sandq_schemas::{JobResult, JobSpec, JobStatus, RunMode, Runtime, Sku};
use sandq_tests::{client, python_job, repo_root, run, wait, wait_for_status};

fn reported(name: &str) -> String {
    let path = repo_root().join("tests/reported").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn node_job(code: &str) -> JobSpec {
    let mut spec = python_job(code, Sku::S);
    spec.runtime = Runtime::Node;
    spec
}

fn with_mode(mut spec: JobSpec, mode: RunMode) -> JobSpec {
    spec.mode = Some(mode);
    spec
}

const MODES: [RunMode; 2] = [RunMode::Notebook, RunMode::Script];

#[tokio::test]
async fn prints_before_a_timeout_are_kept_in_both_python_modes() {
    // Right (the file's first line): timed_out, stdout == "step 1\nstep 2\nstep 3\n".
    let code = reported("partial_output_timeout.py");
    let expected: String = (1..=3).map(|i| format!("step {i}\n")).collect();
    let mut client = client().await;
    for mode in MODES {
        let mut spec = with_mode(python_job(&code, Sku::S), mode);
        spec.timeout = Some("3s".into());
        let result = run(&mut client, &spec).await;
        assert_eq!(result.status, JobStatus::TimedOut, "{mode:?}: {result:?}");
        assert_eq!(result.stdout.text, expected, "{mode:?}");
        assert_eq!(result.stdout.total_bytes, expected.len() as u64, "{mode:?}");
    }
}

#[tokio::test]
async fn stderr_without_a_newline_and_a_childs_output_are_kept_at_a_timeout() {
    // stderr is line-buffered by default: a partial line would die with the process. A child
    // python process inherits the unbuffered streams.
    let code = "import subprocess, sys, time\nsys.stderr.write('warning: half a line')\nsubprocess.Popen([sys.executable, '-c', 'import time; print(\"child\"); time.sleep(60)'])\nprint('parent', end='')\ntime.sleep(60)\n";
    let mut client = client().await;
    for mode in MODES {
        let mut spec = with_mode(python_job(code, Sku::S), mode);
        spec.timeout = Some("4s".into());
        let result = run(&mut client, &spec).await;
        assert_eq!(result.status, JobStatus::TimedOut, "{mode:?}: {result:?}");
        assert_eq!(result.stderr.text, "warning: half a line", "{mode:?}");
        // The two processes' writes in either order.
        let stdout = result.stdout.text.as_str();
        assert!(stdout == "parentchild\n" || stdout == "child\nparent", "{mode:?}: {stdout:?}");
    }
}

#[tokio::test]
async fn prints_before_an_oom_kill_are_kept() {
    // The harness's worker gives SKU S 512 MiB.
    let code = "print('allocating')\nprint('still here')\nchunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))\n";
    let mut client = client().await;
    for mode in MODES {
        let result = run(&mut client, &with_mode(python_job(code, Sku::S), mode)).await;
        assert_eq!(result.status, JobStatus::OomKilled, "{mode:?}: {result:?}");
        assert_eq!(result.stdout.text, "allocating\nstill here\n", "{mode:?}");
    }
}

async fn cancel_after_output(spec: &JobSpec) -> JobResult {
    let mut client = client().await;
    client.submit(spec).await.expect("submit");
    wait_for_status(&mut client, &spec.job_id, JobStatus::Running, Duration::from_secs(60)).await;
    // The program prints at once and then sleeps: give it time to start and print.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(client.cancel(&spec.job_id).await.expect("cancel"));
    wait(&mut client, &spec.job_id).await
}

#[tokio::test]
async fn prints_before_a_cancel_are_kept() {
    // No flush=True: the print sits in Python's buffer unless stdout is unbuffered.
    let code = "import time\nprint('working on it')\ntime.sleep(120)\n";
    for mode in MODES {
        let result = cancel_after_output(&with_mode(python_job(code, Sku::S), mode)).await;
        assert_eq!(result.status, JobStatus::Cancelled, "{mode:?}: {result:?}");
        assert_eq!(result.stdout.text, "working on it\n", "{mode:?}");
    }
    let result = cancel_after_output(&node_job("process.stdout.write('x'.repeat(200000));\nsetTimeout(() => {}, 120000);\n")).await;
    assert_eq!(result.status, JobStatus::Cancelled, "{result:?}");
    assert_eq!(result.stdout.total_bytes, 200_000);
}

#[tokio::test]
async fn node_keeps_every_byte_logged_before_process_exit() {
    // Right: succeeded, stdout.total_bytes == 300000 (3000 lines of 99 x's and a newline).
    let code = reported("node_exit_big_stdout.js");
    let mut client = client().await;
    for mode in MODES {
        let result = run(&mut client, &with_mode(node_job(&code), mode)).await;
        assert_eq!(result.status, JobStatus::Succeeded, "{mode:?}: {result:?}");
        assert_eq!(result.stdout.total_bytes, 300_000, "{mode:?}");
        // The inline text is capped (the rest is in the log object); what is there is the lines.
        let line = format!("{}\n", "x".repeat(99));
        assert!(line.repeat(3000).starts_with(&result.stdout.text), "{mode:?}: not the logged lines");
    }
    // stderr the same way, with an exit code.
    let code = "process.stderr.write('e'.repeat(250000));\nprocess.exit(3);\n";
    for mode in MODES {
        let result = run(&mut client, &with_mode(node_job(code), mode)).await;
        assert_eq!((result.status, result.exit_code), (JobStatus::Failed, Some(3)), "{mode:?}: {result:?}");
        assert_eq!(result.stderr.total_bytes, 250_000, "{mode:?}");
    }
}

#[tokio::test]
async fn node_keeps_a_large_write_before_an_uncaught_error() {
    let code = "process.stdout.write('y'.repeat(400000));\nthrow new TypeError('late failure');\n";
    let mut client = client().await;
    for mode in MODES {
        let result = run(&mut client, &with_mode(node_job(code), mode)).await;
        assert_eq!((result.status, result.exit_code), (JobStatus::Failed, Some(1)), "{mode:?}: {result:?}");
        assert_eq!(result.stdout.total_bytes, 400_000, "{mode:?}");
        assert!(result.stderr.text.contains("TypeError: late failure"), "{mode:?}: {}", result.stderr.text);
    }
}

/// The cell's outcome without and with a wrapper, which must be the same.
async fn same_failure(plain: &str, wrapped: &str) -> (JobResult, JobResult) {
    let mut client = client().await;
    let plain = run(&mut client, &python_job(plain, Sku::S)).await;
    let wrapped = run(&mut client, &python_job(wrapped, Sku::S)).await;
    assert_eq!((plain.status, plain.exit_code), (JobStatus::Failed, Some(1)), "{plain:?}");
    assert_eq!((wrapped.status, wrapped.exit_code), (JobStatus::Failed, Some(1)), "{wrapped:?}");
    let (a, b) = (plain.error.clone().expect("plain error"), wrapped.error.clone().expect("wrapped error"));
    assert_eq!((&a.name, &a.value), (&b.name, &b.value));
    (plain, wrapped)
}

#[tokio::test]
async fn a_cell_under_time_that_raises_fails_like_without_the_magic() {
    // Right: failed, exit 1, error ZeroDivisionError with its traceback, as without %%time.
    let wrapped = reported("magic_hides_error.py");
    let plain = wrapped.strip_prefix("%%time\n").expect("the file starts with %%time");
    let (_, result) = same_failure(plain, &wrapped).await;
    let error = result.error.expect("error");
    assert_eq!((error.name.as_str(), error.value.as_str()), ("ZeroDivisionError", "division by zero"));
    // The user's lines, numbered as in the file (the magic's line is line 1).
    assert!(error.traceback.iter().any(|l| l.contains("File \"/sandq/main.py\", line 4, in ratio")), "{:?}", error.traceback);
    assert!(error.traceback.iter().any(|l| l.contains("return a / b")), "{:?}", error.traceback);
    assert!(!error.traceback.iter().any(|l| l.contains("IPython")), "no IPython frames: {:?}", error.traceback);
    assert!(result.stderr.text.contains("ZeroDivisionError: division by zero"), "{}", result.stderr.text);
    let outputs: Vec<_> = result.outputs.iter().filter_map(|o| o.error.as_ref()).collect();
    assert_eq!(outputs.len(), 1, "one error output: {:?}", result.outputs);
}

#[tokio::test]
async fn capture_run_and_line_magics_do_not_hide_an_error() {
    same_failure("print('x')\n{}['missing']\n", "%%capture out\nprint('x')\n{}['missing']\n").await;
    same_failure("1 / 0\n", "%time 1 / 0\n").await;
    let (_, run_magic) =
        same_failure("raise ValueError('bad input')\n", "open('step.py', 'w').write(\"raise ValueError('bad input')\\n\")\n%run step.py\n")
            .await;
    assert_eq!(run_magic.error.expect("error").name, "ValueError");

    // A display formatter that raised: the shell showed its traceback, so the job failed.
    let mut client = client().await;
    let code = "class Broken:\n    def _repr_html_(self):\n        raise ValueError('cannot render')\nBroken()\n";
    let result = run(&mut client, &python_job(code, Sku::S)).await;
    assert_eq!((result.status, result.exit_code), (JobStatus::Failed, Some(1)), "{result:?}");
    let error = result.error.expect("error");
    assert_eq!((error.name.as_str(), error.value.as_str()), ("ValueError", "cannot render"));

    // A magic that ran fine leaves the cell succeeded, with its value.
    let result = run(&mut client, &python_job("%%time\nx = 6 * 7\nx\n", Sku::S)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert!(result.stdout.text.contains("Wall time"), "{}", result.stdout.text);
    // %run of a script ending with sys.exit(0) is not a failure.
    let result =
        run(&mut client, &python_job("open('ok.py', 'w').write('import sys\\nprint(1)\\nsys.exit(0)\\n')\n%run ok.py\n", Sku::S)).await;
    assert_eq!((result.status, result.exit_code), (JobStatus::Succeeded, Some(0)), "{result:?}");
}
