//! Notebook-mode results: MIME bundles for the last expression, `display()`, DataFrames,
//! matplotlib/seaborn figures and plotly figures; errors with the user's line numbers;
//! presigned artifact URLs. Real worker, RabbitMQ, Redis, Garage and containers.
//!
//! Expected values come from the test's own inputs (numbers chosen here), PNG headers parsed
//! by hand, and SHA-256 computed here over the downloaded bytes.

use sandq_schemas::{JobResult, JobStatus, MimeValue, Output, OutputType, RunMode, Sku};
use sandq_tests::{client, python_job, run, service_config};
use sha2::{Digest, Sha256};

fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    assert_eq!(&bytes[12..16], b"IHDR", "first chunk is IHDR");
    let w = u32::from_be_bytes(bytes[16..20].try_into().expect("4 bytes"));
    let h = u32::from_be_bytes(bytes[20..24].try_into().expect("4 bytes"));
    (w, h)
}

fn text<'a>(output: &'a Output, mime: &str) -> &'a str {
    output.data.get(mime).and_then(|v: &MimeValue| v.text.as_deref()).unwrap_or_else(|| panic!("no inline {mime} in {output:?}"))
}

async fn notebook(code: &str) -> JobResult {
    let mut client = client().await;
    run(&mut client, &python_job(code, Sku::S)).await
}

#[tokio::test]
async fn a_cell_ending_with_a_dataframe_returns_html_and_markdown_with_its_shape() {
    let code =
        "import pandas as pd\nprint('before')\ndf = pd.DataFrame({'a': [1, 2, 3], 'b': [4.5, 5.5, 6.5]}, index=['x', 'y', 'z'])\ndf\n";
    let result = notebook(code).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, "before\n", "the value is not printed on stdout");
    assert_eq!(result.outputs.len(), 1, "{:?}", result.outputs);
    let output = &result.outputs[0];
    assert_eq!(output.output_type, OutputType::ExecuteResult);
    let table = output.table.expect("table shape");
    assert_eq!((table.rows, table.columns), (3, 2));
    let html = text(output, "text/html");
    assert!(html.contains("<table"), "{html}");
    for cell in ["<th>x</th>", "<td>1</td>", "<td>6.5</td>", "<th>b</th>"] {
        assert!(html.contains(cell), "{cell} missing from {html}");
    }
    let markdown = text(output, "text/markdown");
    let rows: Vec<Vec<String>> = markdown
        .lines()
        .filter(|l| l.starts_with('|'))
        .map(|l| l.trim_matches('|').split('|').map(|c| c.trim().to_owned()).collect())
        .collect();
    assert_eq!(rows.len(), 5, "header, separator and 3 rows: {markdown}");
    assert_eq!(rows[0][1..], ["a", "b"], "{markdown}");
    assert_eq!(rows[2], ["x", "1", "4.5"], "{markdown}");
    assert_eq!(rows[4], ["z", "3", "6.5"], "{markdown}");
    assert!(text(output, "text/plain").contains("6.5"));
}

#[tokio::test]
async fn a_large_dataframe_keeps_its_true_shape_and_a_capped_markdown_table() {
    let code = "import pandas as pd\npd.DataFrame({f'c{j}': range(j, j + 1000) for j in range(30)})\n";
    let result = notebook(code).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    let output = &result.outputs[0];
    let table = output.table.expect("table shape");
    assert_eq!((table.rows, table.columns), (1000, 30));
    let markdown = text(output, "text/markdown");
    let table_lines = markdown.lines().filter(|l| l.starts_with('|')).count();
    assert!(table_lines <= 52, "markdown is capped: {table_lines} lines");
    assert!(markdown.contains("1000 rows"), "says how big the table is: {markdown}");
}

#[tokio::test]
async fn matplotlib_and_seaborn_figures_come_back_as_pngs_of_figure_size_times_dpi() {
    let code = "\
import matplotlib.pyplot as plt
import seaborn as sns
display('first')
fig = plt.figure(figsize=(8, 5), dpi=100)
plt.plot([1, 2, 3], [3, 1, 2])
plt.show()
plt.figure(figsize=(4, 3), dpi=50)
sns.histplot([1, 2, 2, 3, 3, 3])
'last'
";
    let result = notebook(code).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    let kinds: Vec<(OutputType, bool)> = result.outputs.iter().map(|o| (o.output_type, o.data.contains_key("image/png"))).collect();
    // display('first'), the figure shown, the value 'last', then the figure left open at the end.
    assert_eq!(
        kinds,
        [
            (OutputType::DisplayData, false),
            (OutputType::DisplayData, true),
            (OutputType::ExecuteResult, false),
            (OutputType::DisplayData, true)
        ],
        "{:?}",
        result.outputs
    );
    assert_eq!(text(&result.outputs[0], "text/plain"), "'first'");
    assert_eq!(text(&result.outputs[2], "text/plain"), "'last'");
    let client = client().await;
    let dir = tempfile::tempdir().expect("tempdir");
    for (output, expected) in [(&result.outputs[1], (800, 500)), (&result.outputs[3], (200, 150))] {
        let png = output.data["image/png"].artifact.as_ref().expect("images are stored in S3");
        assert_eq!(png.content_type, "image/png");
        let path = client.download_artifact(png, dir.path()).await.expect("download");
        let bytes = std::fs::read(&path).expect("read");
        assert_eq!(png_size(&bytes), expected);
        assert_eq!(hex::encode(Sha256::digest(&bytes)), png.sha256);
        assert_eq!(bytes.len() as u64, png.size);
        let image = output.image.expect("image size");
        assert_eq!((image.width, image.height), expected);
    }
}

#[tokio::test]
async fn a_plotly_figure_returns_its_json_and_html() {
    let code = "import plotly.graph_objects as go\nfig = go.Figure(go.Bar(x=['a', 'b'], y=[3, 5]))\nfig.show()\nfig\n";
    let result = notebook(code).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.outputs.len(), 2, "fig.show() and the value: {:?}", result.outputs);
    for output in &result.outputs {
        let figure: serde_json::Value = serde_json::from_str(text(output, "application/vnd.plotly.v1+json")).expect("plotly JSON");
        assert_eq!(figure["data"][0]["type"], "bar", "{figure}");
        assert_eq!(figure["data"][0]["y"], serde_json::json!([3, 5]), "{figure}");
        assert_eq!(figure["data"][0]["x"], serde_json::json!(["a", "b"]), "{figure}");
        let html = output.data.get("text/html").expect("html");
        assert!(html.size > 0);
    }
    // A plotly figure displays itself (`_ipython_display_`), so as the last expression it is
    // `display_data`, as in Jupyter.
    assert!(result.outputs.iter().all(|o| o.output_type == OutputType::DisplayData), "{:?}", result.outputs);
}

#[tokio::test]
async fn an_exception_returns_name_value_and_a_traceback_ending_at_the_users_line() {
    let code = "print('start')\ndef divide(x):\n    return 10 / x\n\ndivide(0)\n";
    let result = notebook(code).await;
    assert_eq!(result.status, JobStatus::Failed, "{result:?}");
    assert_eq!(result.exit_code, Some(1));
    assert_eq!(result.stdout.text, "start\n");
    let error = result.error.as_ref().expect("error");
    assert_eq!(error.name, "ZeroDivisionError");
    assert_eq!(error.value, "division by zero");
    let traceback = error.traceback.join("\n");
    assert!(!traceback.contains('\u{1b}'), "no ANSI colour: {traceback:?}");
    let frames: Vec<&String> = error.traceback.iter().filter(|l| l.trim_start().starts_with("File ")).collect();
    assert_eq!(frames.len(), 2, "the call and the division, no runner frames: {traceback}");
    assert!(frames[0].contains("/sandq/main.py") && frames[0].contains("line 5"), "{traceback}");
    assert!(frames[1].contains("/sandq/main.py") && frames[1].contains("line 3"), "{traceback}");
    assert!(traceback.contains("return 10 / x"), "source line shown: {traceback}");
    assert_eq!(result.outputs.last().map(|o| o.output_type), Some(OutputType::Error));
    assert!(result.stderr.text.contains("ZeroDivisionError: division by zero"), "{}", result.stderr.text);
}

#[tokio::test]
async fn a_syntax_error_and_sys_exit_behave_as_in_python() {
    let result = notebook("x = (1,\n").await;
    assert_eq!(result.status, JobStatus::Failed, "{result:?}");
    assert_eq!(result.error.as_ref().map(|e| e.name.as_str()), Some("SyntaxError"), "{result:?}");
    let result = notebook("import sys\nprint('bye')\nsys.exit(3)\n").await;
    assert_eq!(result.exit_code, Some(3), "{result:?}");
    assert!(result.error.is_none() && result.outputs.is_empty(), "{result:?}");
}

#[tokio::test]
async fn script_mode_runs_plain_python_without_outputs() {
    let mut spec = python_job("import sys\nprint(sys.argv[0])\n1 + 1\n", Sku::S);
    spec.mode = Some(RunMode::Script);
    let mut client = client().await;
    let result = run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, "/sandq/main.py\n");
    assert!(result.outputs.is_empty(), "{:?}", result.outputs);
}

#[tokio::test]
async fn artifacts_have_presigned_urls_that_serve_their_bytes() {
    let code = "import pathlib\npathlib.Path('report.csv').write_text('a,b\\n1,2\\n')\n";
    let result = notebook(code).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    let artifact = result.artifacts.iter().find(|a| a.path == "report.csv").expect("artifact");
    assert_eq!(artifact.content_type, "text/csv");
    let url = artifact.url.as_ref().expect("presigned url");
    assert!(url.starts_with(&format!("{}/", service_config().s3.endpoint)), "{url}");
    let expires = artifact.url_expires_at_ms.expect("expiry");
    let now = sandq_core::time::now_ms();
    // Valid `worker.artifact_url_ttl` (default 1 h), capped by the job's `result_ttl` (10 min).
    assert!(expires > now && expires <= now + 600_000 + 60_000, "validity 10 min: {expires} vs {now}");
    let fetched = std::process::Command::new("curl").args(["-sS", "--fail", "--max-time", "10", url]).output().expect("curl");
    assert!(fetched.status.success(), "{}", String::from_utf8_lossy(&fetched.stderr));
    assert_eq!(fetched.stdout, b"a,b\n1,2\n");
    // The signature covers the key: another key with the same query string is refused.
    let tampered = url.replacen("report.csv", "report.txt", 1);
    let refused = std::process::Command::new("curl").args(["-sS", "--fail", "--max-time", "10", &tampered]).output().expect("curl");
    assert!(!refused.status.success(), "a tampered URL must not work");
}

/// The outputs file is the program's to write: forged, oversized and malformed lines are
/// bounded and counted, and a symlink planted in its place is not followed.
#[tokio::test]
async fn a_forged_outputs_file_is_bounded_and_never_followed() {
    let code = r#"
import json, os
p = os.environ["SANDQ_OUTPUTS"]
with open(p, "a") as f:
    f.write("not json\n")
    f.write(json.dumps({"output_type": "display_data", "data": {f"application/x-{i}": "" for i in range(1000)}}) + "\n")
    f.write(json.dumps({"output_type": "display_data", "data": {"Text/HTML\r\nX-Injected: 1": "a", "text/plain": "kept"}}) + "\n")
    f.write(json.dumps({"output_type": "error", "ename": "E" * 100000, "evalue": "v", "traceback": ["x" * 10] * 100000}) + "\n")
    f.write("[" * 100000 + "\n")
    for _ in range(30):
        f.write(json.dumps({"output_type": "error", "ename": "E" * 4096, "evalue": "V" * 4096, "traceback": ["T" * 4096] * 200}) + "\n")
"#;
    let result = notebook(code).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    assert!(result.outputs.len() >= 3, "{:?}", result.outputs.iter().map(|o| o.data.len()).collect::<Vec<_>>());
    // 16 representations, plus the (empty) text/plain every bundle gets.
    assert!(result.outputs[0].data.len() <= 17, "representations per output are capped: {}", result.outputs[0].data.len());
    assert_eq!(result.outputs[1].data.keys().collect::<Vec<_>>(), ["text/plain"], "invalid MIME names are dropped");
    let error = result.error.as_ref().expect("forged error");
    assert!(error.name.len() <= 4100 && error.traceback.len() <= 200, "error fields are clipped");
    // "not json", the 1000-type line's extra types, the bad MIME name, the deep nesting.
    let expected_drops: u64 = 1 + (1000 - 16) + 1 + 1;
    assert!(result.outputs_dropped >= expected_drops, "dropped {}", result.outputs_dropped);
    let stored = sandq_schemas::encode(&result).expect("encode").len();
    // 30 errors of 800 KiB each are cut to the 256 KiB inline budget (the last one is also
    // `result.error`): the Redis value stays small.
    assert!(stored < 1 << 20, "result in Redis is {stored} bytes");

    // A host file of valid output lines, which the worker would read if it followed the link.
    let host_file = std::env::temp_dir().join(format!("sandq-forged-{}.jsonl", uuid::Uuid::new_v4()));
    std::fs::write(&host_file, "{\"output_type\": \"display_data\", \"data\": {\"text/plain\": \"read from the host\"}}\n").expect("write");
    let planted = format!(
        "import os\np = os.environ['SANDQ_OUTPUTS']\nif os.path.lexists(p):\n    os.remove(p)\nos.symlink({:?}, p)\n",
        host_file.display().to_string()
    );
    let result = notebook(&planted).await;
    let _ = std::fs::remove_file(&host_file);
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    assert!(result.outputs.is_empty(), "a symlinked outputs file is not read: {:?}", result.outputs);
}
