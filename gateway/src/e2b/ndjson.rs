//! E2B's NDJSON, as `/execute` streams it: one JSON object per line (`stdout`, `stderr`,
//! `keepalive`, then `number_of_executions`, each `result`, the `error` if any and
//! `end_of_execution`). Pure: what goes into the lines, never where it comes from (the live
//! events, the result and its outputs are read by [`super::execute`]).

use sandq_schemas::{JobResult, JobStatus};
use serde_json::{json, Value};

use super::state::rfc3339;

/// One line of the response body (its stream's item type: never an error here).
pub(super) type Line = Result<bytes::Bytes, std::io::Error>;

/// `value` as one line: its JSON (no newline inside: JSON escapes those in strings) and `\n`.
pub(super) fn line(value: &Value) -> Line {
    let mut bytes = serde_json::to_vec(value).unwrap_or_default();
    bytes.push(b'\n');
    Ok(bytes.into())
}

/// A `stdout` or `stderr` message: `text` printed at `ms` (Unix milliseconds).
pub(super) fn stream(kind: &str, text: &str, ms: u64) -> Value {
    json!({"type": kind, "text": text, "timestamp": rfc3339(ms)})
}

/// One stream's text on its way to NDJSON lines: whole lines go out as they complete, a
/// partial one after a keepalive tick has passed over it, or at the end. Each message is
/// stamped with the `now_ms` it goes out at.
pub(super) struct Lines {
    kind: &'static str,
    partial: String,
    ticks: u8,
}

impl Lines {
    pub(super) fn new(kind: &'static str) -> Self {
        Lines { kind, partial: String::new(), ticks: 0 }
    }

    /// The complete lines `text` finishes, as one message.
    pub(super) fn push(&mut self, text: &str, now_ms: u64) -> Option<Value> {
        self.partial.push_str(text);
        let end = self.partial.rfind('\n')? + 1;
        let rest = self.partial.split_off(end);
        let whole = std::mem::replace(&mut self.partial, rest);
        self.ticks = 0;
        Some(stream(self.kind, &whole, now_ms))
    }

    /// The partial line, once it has waited a whole tick.
    pub(super) fn tick(&mut self, now_ms: u64) -> Option<Value> {
        if self.partial.is_empty() {
            return None;
        }
        self.ticks += 1;
        (self.ticks >= 2).then(|| self.flush(now_ms)).flatten()
    }

    /// Whatever is left, at the end.
    pub(super) fn flush(&mut self, now_ms: u64) -> Option<Value> {
        self.ticks = 0;
        (!self.partial.is_empty()).then(|| std::mem::take(&mut self.partial)).map(|t| stream(self.kind, &t, now_ms))
    }
}

/// The text a binary representation (read from its artifact) is given in a `result`: base64
/// for images but SVG, and for PDFs; the text itself (lossy UTF-8) for the rest.
pub(super) fn binary_text(mime: &str, bytes: &[u8]) -> String {
    if mime.starts_with("image/") && mime != "image/svg+xml" || mime == "application/pdf" {
        base64::Engine::encode(&base64::engine::general_purpose::STANDARD, bytes)
    } else {
        String::from_utf8_lossy(bytes).into_owned()
    }
}

/// One output as a `result` message: each representation (`mime`, its text) under E2B's name
/// for it (`text`, `html`, `png`, `chart`, `data`...), the others in `extra`. `main`: the
/// cell's value (an `execute_result`), not a display.
pub(super) fn result(main: bool, representations: &[(&str, String)]) -> Value {
    let mut item = serde_json::Map::new();
    item.insert("type".into(), json!("result"));
    item.insert("is_main_result".into(), json!(main));
    let mut extra = serde_json::Map::new();
    for (mime, text) in representations {
        let text = text.as_str();
        let (name, value) = match *mime {
            "text/plain" => ("text", json!(strip_quotes(text))),
            "text/html" => ("html", json!(text)),
            "text/markdown" => ("markdown", json!(text)),
            "image/svg+xml" => ("svg", json!(text)),
            "image/png" => ("png", json!(text)),
            "image/jpeg" => ("jpeg", json!(text)),
            "application/pdf" => ("pdf", json!(text)),
            "text/latex" => ("latex", json!(text)),
            "application/json" => ("json", serde_json::from_str(text).unwrap_or(json!(text))),
            "application/javascript" => ("javascript", json!(text)),
            "application/vnd.sandq.chart+json" | "e2b/chart" => ("chart", serde_json::from_str(text).unwrap_or(Value::Null)),
            "e2b/data" => ("data", serde_json::from_str(text).unwrap_or(Value::Null)),
            "application/vnd.dataresource+json" => match serde_json::from_str::<Value>(text).ok().and_then(|t| columns(&t)) {
                Some(data) => ("data", data),
                None => continue,
            },
            other => {
                extra.insert(other.to_owned(), serde_json::from_str(text).unwrap_or(json!(text)));
                continue;
            }
        };
        item.insert(name.into(), value);
    }
    item.insert("extra".into(), Value::Object(extra));
    Value::Object(item)
}

/// The closing messages of a cell: its streams when no live event carried them (`printed`
/// false), the execution count, its `results` (made by [`result`]), its error (the program's,
/// or the job's end when it did not succeed), and `end_of_execution`.
pub(super) fn closing(result: &JobResult, printed: bool, results: Vec<Value>, now_ms: u64) -> Vec<Value> {
    let mut out = Vec::new();
    if !printed {
        for (kind, captured) in [("stdout", &result.stdout), ("stderr", &result.stderr)] {
            if !captured.text.is_empty() {
                out.push(stream(kind, &captured.text, now_ms));
            }
        }
    }
    if let Some(count) = result.execution_count {
        out.push(json!({"type": "number_of_executions", "execution_count": count}));
    }
    out.extend(results);
    if let Some(error) = &result.error {
        out.push(json!({"type": "error", "name": error.name, "value": error.value, "traceback": error.traceback.join("\n")}));
    } else if !matches!(result.status, JobStatus::Succeeded) {
        let name = match result.status {
            JobStatus::TimedOut => "TimeoutError",
            JobStatus::OomKilled => "OOMKilled",
            _ => "SandqError",
        };
        let value = result.reason.clone().unwrap_or_else(|| result.status.to_string());
        out.push(json!({"type": "error", "name": name, "value": value, "traceback": ""}));
    }
    out.push(json!({"type": "end_of_execution"}));
    out
}

/// A pandas table schema (`application/vnd.dataresource+json`: `schema.fields`, `primaryKey`,
/// `data` rows) as E2B's `data`: `DataFrame.to_dict(orient="list")`, a list per column, the
/// index (the primary key's columns) left out. `None` when it is not that shape.
fn columns(table: &Value) -> Option<Value> {
    let schema = table.get("schema")?;
    let key: Vec<&str> =
        schema.get("primaryKey").and_then(Value::as_array).map_or_else(Vec::new, |k| k.iter().filter_map(Value::as_str).collect());
    let rows = table.get("data")?.as_array()?;
    let mut out = serde_json::Map::new();
    for field in schema.get("fields")?.as_array()? {
        let name = field.get("name")?.as_str()?;
        if key.contains(&name) {
            continue;
        }
        let column: Vec<Value> = rows.iter().map(|row| row.get(name).cloned().unwrap_or(Value::Null)).collect();
        out.insert(name.to_owned(), Value::Array(column));
    }
    Some(Value::Object(out))
}

/// Jupyter's `text/plain` of a string is its repr: E2B's server strips the quotes around it.
fn strip_quotes(text: &str) -> String {
    for q in ['\'', '"'] {
        if text.len() >= 2 && text.starts_with(q) && text.ends_with(q) {
            return text[1..text.len() - 1].to_owned();
        }
    }
    text.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_schema_becomes_lists_by_column_without_the_index() {
        let table = json!({
            "schema": {"fields": [{"name": "index", "type": "integer"}, {"name": "a", "type": "integer"}, {"name": "b", "type": "string"}], "primaryKey": ["index"]},
            "data": [{"index": 0, "a": 1, "b": "x"}, {"index": 1, "a": 2, "b": "y"}],
        });
        assert_eq!(columns(&table), Some(json!({"a": [1, 2], "b": ["x", "y"]})));
        assert_eq!(columns(&json!({"data": []})), None);
    }

    #[test]
    fn a_line_is_the_json_and_one_newline_with_newlines_in_text_escaped() {
        let bytes = |l: Line| l.expect("never an error").to_vec();
        assert_eq!(bytes(line(&json!({"type": "end_of_execution"}))), b"{\"type\":\"end_of_execution\"}\n".to_vec());
        assert_eq!(bytes(line(&json!({"text": "a\nb"}))), b"{\"text\":\"a\\nb\"}\n".to_vec());
    }

    #[test]
    fn streams_go_out_as_whole_lines_and_a_partial_one_after_a_tick() {
        let mut lines = Lines::new("stdout");
        assert_eq!(lines.push("1", 0), None);
        let out = lines.push("\n2\n3", 0).expect("a line");
        assert_eq!(out, json!({"type": "stdout", "text": "1\n2\n", "timestamp": "1970-01-01T00:00:00.000Z"}));
        assert_eq!(lines.tick(1_000), None, "waits one tick");
        assert_eq!(lines.tick(2_500).expect("then goes"), json!({"type": "stdout", "text": "3", "timestamp": "1970-01-01T00:00:02.500Z"}));
        assert_eq!(lines.flush(3_000), None);
        lines.push("tail", 3_000);
        assert_eq!(lines.flush(4_000).expect("at the end")["text"], "tail");
        assert_eq!(Lines::new("stderr").push("e\n", 0).expect("a line")["type"], "stderr");
    }

    #[test]
    fn images_and_pdfs_are_base64_and_other_binaries_text() {
        // base64 by hand: 0x89 'P' 'N' 'G' -> 100010 010101 000001 001110 010001 11(0000) = "iVBORw==".
        assert_eq!(binary_text("image/png", b"\x89PNG"), "iVBORw==");
        assert_eq!(binary_text("image/jpeg", b"\x89PNG"), "iVBORw==");
        assert_eq!(binary_text("application/pdf", b"%PDF"), "JVBERg==");
        assert_eq!(binary_text("image/svg+xml", b"<svg/>"), "<svg/>");
        assert_eq!(binary_text("text/html", b"<b>\xff</b>"), "<b>\u{fffd}</b>");
    }

    #[test]
    fn representations_take_e2b_names_and_the_rest_goes_to_extra() {
        let reprs = [
            ("text/plain", "'hi'".to_owned()),
            ("image/png", "iVBORw==".to_owned()),
            ("application/json", "{\"a\": 1}".to_owned()),
            ("e2b/chart", "not json".to_owned()),
            ("application/vnd.dataresource+json", "[]".to_owned()),
            ("application/x-custom", "[1, 2]".to_owned()),
            ("application/x-text", "plain".to_owned()),
        ];
        let expected = json!({
            "type": "result",
            "is_main_result": true,
            "text": "hi",
            "png": "iVBORw==",
            "json": {"a": 1},
            "chart": null,
            "extra": {"application/x-custom": [1, 2], "application/x-text": "plain"},
        });
        assert_eq!(result(true, &reprs), expected);
        assert_eq!(result(false, &[]), json!({"type": "result", "is_main_result": false, "extra": {}}));
    }

    #[test]
    fn a_cell_closes_with_its_count_results_error_and_end() {
        let mut failed = JobResult::new("j", JobStatus::Failed);
        failed.execution_count = Some(3);
        failed.stdout.text = "out\n".into();
        failed.error = Some(sandq_schemas::ErrorInfo {
            name: "ZeroDivisionError".into(),
            value: "division by zero".into(),
            traceback: vec!["a".into(), "b".into()],
        });
        let shown = json!({"type": "result"});
        assert_eq!(
            closing(&failed, false, vec![shown.clone()], 0),
            vec![
                json!({"type": "stdout", "text": "out\n", "timestamp": "1970-01-01T00:00:00.000Z"}),
                json!({"type": "number_of_executions", "execution_count": 3}),
                shown,
                json!({"type": "error", "name": "ZeroDivisionError", "value": "division by zero", "traceback": "a\nb"}),
                json!({"type": "end_of_execution"}),
            ]
        );
        // Printed live: not again. A job that ended otherwise than by the program's error.
        let mut timed_out = JobResult::new("j", JobStatus::TimedOut);
        timed_out.stdout.text = "out\n".into();
        timed_out.reason = Some("the job ran past its timeout".into());
        assert_eq!(
            closing(&timed_out, true, Vec::new(), 0),
            vec![
                json!({"type": "error", "name": "TimeoutError", "value": "the job ran past its timeout", "traceback": ""}),
                json!({"type": "end_of_execution"}),
            ]
        );
        let succeeded = JobResult::new("j", JobStatus::Succeeded);
        assert_eq!(closing(&succeeded, true, Vec::new(), 0), vec![json!({"type": "end_of_execution"})]);
    }

    #[test]
    fn string_reprs_lose_their_quotes_and_other_text_is_kept() {
        assert_eq!(strip_quotes("'hello'"), "hello");
        assert_eq!(strip_quotes("\"it's\""), "it's");
        assert_eq!(strip_quotes("1"), "1");
        assert_eq!(strip_quotes("'"), "'");
    }
}
