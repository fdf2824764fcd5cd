//! Node.js in notebook mode (the default for `runtime: node`): the last expression's value as an
//! `execute_result`, top-level `await`, static `import`, uncaught errors and unhandled
//! rejections as the result's `error` at the user's lines, `process.exit`, and `mode: script`
//! running plain `node`. Real worker, RabbitMQ, Redis, Garage and containers.
//!
//! Expected values are written here: the numbers come from the test's own code, and the
//! `text/plain` strings are what Node's `util.inspect` prints for them.

use sandq_schemas::{ErrorInfo, JobResult, JobSpec, JobStatus, Output, OutputType, RunMode, Runtime, Sku};
use sandq_tests::{client, python_job, run};
use sha2::{Digest, Sha256};

/// A Node.js job running `code` in the runtime's default mode.
fn node_job(code: &str) -> JobSpec {
    let mut spec = python_job(code, Sku::S);
    spec.runtime = Runtime::Node;
    spec
}

async fn notebook(code: &str) -> JobResult {
    let mut client = client().await;
    run(&mut client, &node_job(code)).await
}

fn plain(output: &Output) -> &str {
    output.data.get("text/plain").and_then(|v| v.text.as_deref()).unwrap_or_else(|| panic!("no inline text/plain in {output:?}"))
}

/// The frame lines of a traceback (`    at f (/sandq/main.js:3:9)`).
fn frames(error: &ErrorInfo) -> Vec<&str> {
    error.traceback.iter().map(String::as_str).filter(|l| l.trim_start().starts_with("at ")).collect()
}

#[tokio::test]
async fn the_last_expression_comes_back_as_util_inspect_prints_it() {
    let code = "const items = ['x', 'y'];\nconsole.log('before');\nconsole.error('to stderr');\n({ a: 20 + 22, items, nested: { deeper: { deepest: { gone: 1 } } }, m: new Map([[1, 'one']]) })\n";
    let result = notebook(code).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.exit_code, Some(0));
    assert_eq!(result.stdout.text, "before\n", "console.log goes to stdout, the value does not");
    assert_eq!(result.stderr.text, "to stderr\n");
    assert_eq!(result.outputs.len(), 1, "{:?}", result.outputs);
    assert_eq!(result.outputs[0].output_type, OutputType::ExecuteResult);
    // util.inspect's default depth is 2: the third level shows as [Object].
    assert_eq!(
        plain(&result.outputs[0]),
        "{\n  a: 42,\n  items: [ 'x', 'y' ],\n  nested: { deeper: { deepest: [Object] } },\n  m: Map(1) { 1 => 'one' }\n}"
    );
    assert!(result.error.is_none());

    // A string is shown quoted; a last statement whose value is undefined gives no result.
    let result = notebook("const s = 'abc';\ns.toUpperCase() // the value\n").await;
    assert_eq!(result.outputs.iter().map(plain).collect::<Vec<_>>(), ["'ABC'"], "{result:?}");
    let result = notebook("console.log(6 * 7);\n").await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, "42\n");
    assert!(result.outputs.is_empty(), "undefined is not a result: {:?}", result.outputs);
}

#[tokio::test]
async fn top_level_await_and_static_imports_work_without_an_es_module() {
    let code = "\
import { createHash } from 'node:crypto';
import path from 'node:path';
const os = require('os');
const wait = (ms, value) => new Promise((resolve) => setTimeout(() => resolve(value), ms));
const n = await wait(50, 6);
const { basename } = await import('node:path');
console.log(createHash('sha256').update('abc').digest('hex'), os.platform(), basename(import.meta.filename));
path.join('a', 'b') + ':' + n * 7
";
    let result = notebook(code).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, format!("{} linux main.js\n", hex::encode(Sha256::digest(b"abc"))));
    assert_eq!(result.stderr.text, "", "no warnings on stderr");
    assert_eq!(result.outputs.iter().map(plain).collect::<Vec<_>>(), ["'a/b:42'"], "{result:?}");
}

#[tokio::test]
async fn a_thrown_error_returns_name_value_and_frames_at_the_users_lines() {
    let code = "\
console.log('start');
function divide(a, b) {
  if (b === 0) throw new RangeError(`cannot divide ${a} by zero`);
  return a / b;
}
await null;
divide(10, 0);
";
    let result = notebook(code).await;
    assert_eq!(result.status, JobStatus::Failed, "{result:?}");
    assert_eq!(result.exit_code, Some(1));
    assert_eq!(result.stdout.text, "start\n");
    let error = result.error.as_ref().expect("error");
    assert_eq!(error.name, "RangeError");
    assert_eq!(error.value, "cannot divide 10 by zero");
    assert_eq!(error.traceback[0], "RangeError: cannot divide 10 by zero");
    let frames = frames(error);
    assert_eq!(frames.len(), 2, "the throw and the call, no runner or Node.js frames: {:?}", error.traceback);
    assert!(frames[0].contains("divide (/sandq/main.js:3:"), "{frames:?}");
    assert!(frames[1].contains("/sandq/main.js:7:"), "{frames:?}");
    assert_eq!(result.outputs.last().map(|o| o.output_type), Some(OutputType::Error));
    // stderr has what node prints: the line, then the stack.
    assert!(
        result.stderr.text.contains("RangeError: cannot divide 10 by zero\n    at divide (/sandq/main.js:3:"),
        "{}",
        result.stderr.text
    );
    assert!(result.stderr.text.contains("if (b === 0) throw new RangeError"), "{}", result.stderr.text);
    assert!(!result.stderr.text.contains("sandq_runner"), "{}", result.stderr.text);

    // A library frame the user's code called stays, above the user's frames.
    let result = notebook("const fs = require('fs');\n\nfs.readFileSync('/no/such/file.txt');\n").await;
    let error = result.error.as_ref().expect("error");
    assert_eq!(error.name, "Error");
    assert!(error.value.starts_with("ENOENT: no such file or directory"), "{error:?}");
    let frames = self::frames(error);
    let (last, above) = frames.split_last().expect("frames");
    assert!(last.contains("/sandq/main.js:3:"), "{frames:?}");
    assert!(above.iter().any(|f| f.contains("readFileSync (node:fs:")), "{frames:?}");

    // A syntax error points at its line; nothing runs.
    let result = notebook("console.log('never');\nlet x = (1 +;\n").await;
    assert_eq!(result.status, JobStatus::Failed, "{result:?}");
    assert_eq!(result.stdout.text, "");
    let error = result.error.as_ref().expect("error");
    assert_eq!(error.name, "SyntaxError", "{error:?}");
    assert_eq!(error.traceback.first().map(String::as_str), Some("/sandq/main.js:2"), "{error:?}");
    assert_eq!(error.traceback.get(1).map(String::as_str), Some("let x = (1 +;"), "{error:?}");
}

#[tokio::test]
async fn an_unhandled_rejection_fails_the_job_after_the_result() {
    let code = "async function later() {\n  await null;\n  throw new TypeError('nobody awaited me');\n}\nlater();\n'done'\n";
    let result = notebook(code).await;
    assert_eq!(result.status, JobStatus::Failed, "{result:?}");
    assert_eq!(result.exit_code, Some(1));
    let kinds: Vec<OutputType> = result.outputs.iter().map(|o| o.output_type).collect();
    assert_eq!(kinds, [OutputType::ExecuteResult, OutputType::Error], "{:?}", result.outputs);
    assert_eq!(plain(&result.outputs[0]), "'done'");
    let error = result.error.as_ref().expect("error");
    assert_eq!((error.name.as_str(), error.value.as_str()), ("TypeError", "nobody awaited me"));
    assert!(frames(error).first().is_some_and(|f| f.contains("later (/sandq/main.js:3:")), "{error:?}");

    // A user's own handler takes it, as in node: no error, the job succeeds.
    let code =
        "process.on('unhandledRejection', (e) => console.log('handled', e.message));\nconst rejected = Promise.reject(new Error('x'));\n";
    let result = notebook(code).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, "handled x\n");
    assert!(result.error.is_none());
}

#[tokio::test]
async fn process_exit_ends_the_job_with_its_code_as_in_node() {
    let mut spec = node_job(
        "process.on('exit', (code) => console.log('exit', code));\nconsole.log(process.argv.slice(1));\nprocess.exit(3);\n'never'\n",
    );
    spec.args = vec!["a b".into(), "c".into()];
    let mut client = client().await;
    let result = run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Failed, "{result:?}");
    assert_eq!(result.exit_code, Some(3));
    assert_eq!(result.stdout.text, "[ '/sandq/main.js', 'a b', 'c' ]\nexit 3\n", "argv is plain node's");
    assert!(result.outputs.is_empty() && result.error.is_none(), "{result:?}");

    let result = run(&mut client, &node_job("process.exitCode = 4;\n'set'\n")).await;
    assert_eq!(result.exit_code, Some(4), "{result:?}");
    assert_eq!(result.outputs.iter().map(plain).collect::<Vec<_>>(), ["'set'"]);
}

#[tokio::test]
async fn script_mode_still_runs_plain_node() {
    let code = "const files = require('fs').readdirSync('/sandq').filter((f) => f.startsWith('sandq_')).sort();\nconsole.log(JSON.stringify(files), require.main === module);\nfiles.length\n";
    let mut spec = node_job(code);
    spec.mode = Some(RunMode::Script);
    let mut client = client().await;
    let result = run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, "[\"sandq_stdio.js\"] true\n", "no runner beside main.js, only the stdio preload");
    assert!(result.outputs.is_empty(), "{:?}", result.outputs);

    // The same code in notebook mode: only the Node.js runner is staged, and the value comes back.
    let result = run(&mut client, &node_job(code)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, "[\"sandq_runner.js\",\"sandq_stdio.js\"] true\n");
    assert_eq!(result.outputs.iter().map(plain).collect::<Vec<_>>(), ["2"]);

    // An uncaught error in script mode is node's own: on stderr, not in `error`.
    let mut spec = node_job("function boom() { throw new Error('kaboom'); }\nboom();\n");
    spec.mode = Some(RunMode::Script);
    let result = run(&mut client, &spec).await;
    assert_eq!((result.status, result.exit_code), (JobStatus::Failed, Some(1)), "{result:?}");
    assert!(result.error.is_none() && result.outputs.is_empty(), "{result:?}");
    assert!(result.stderr.text.contains("at boom (/sandq/main.js:1:"), "{}", result.stderr.text);
}
