//! Data files of every type (CSV, JSON, JSON lines, Excel, text, JPEG) uploaded as inputs land
//! in the sandbox's work dir under their names, and the example programs in `examples/` read
//! them (with pandas, openpyxl, Pillow).
//!
//! Expected values are computed here, independently of the sandbox: by parsing the CSV, JSON
//! lines and text files by hand, the JSON with serde_json, and the JPEG's markers by hand. The
//! Excel sheet holds the same data as `Stocks.csv`, so its statistics are checked against the
//! ones computed from the CSV.

use std::collections::BTreeMap;
use std::path::PathBuf;

use sandq_client::Client;
use sandq_schemas::{JobStatus, Sku};
use sandq_tests::{client, python_job, repo_root, run};
use sha2::{Digest, Sha256};

/// Path of a file in `examples/data/`.
fn data(name: &str) -> PathBuf {
    repo_root().join("examples/data").join(name)
}

fn read_text(name: &str) -> String {
    std::fs::read_to_string(data(name)).unwrap_or_else(|e| panic!("read {name}: {e}"))
}

/// The `key=value` lines a program printed.
struct Output {
    script: String,
    values: BTreeMap<String, String>,
}

impl Output {
    fn parse(script: &str, stdout: &str) -> Output {
        let mut values = BTreeMap::new();
        for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
            let (key, value) = line.split_once('=').unwrap_or_else(|| panic!("{script}: not a key=value line: {line:?}"));
            let previous = values.insert(key.to_owned(), value.to_owned());
            assert!(previous.is_none(), "{script}: {key} printed twice");
        }
        Output { script: script.to_owned(), values }
    }

    fn str(&self, key: &str) -> &str {
        self.values.get(key).unwrap_or_else(|| panic!("{}: {key} missing from {:?}", self.script, self.values))
    }

    fn float(&self, key: &str) -> f64 {
        let value = self.str(key);
        value.parse().unwrap_or_else(|e| panic!("{}: {key}={value} is not a number: {e}", self.script))
    }

    /// Asserts `key` is `expected` up to a relative error of 1e-9.
    fn assert_close(&self, key: &str, expected: f64) {
        let value = self.float(key);
        let tolerance = 1e-9 * expected.abs().max(1.0);
        assert!((value - expected).abs() <= tolerance, "{}: {key}={value}, expected {expected}", self.script);
    }

    fn assert_eq(&self, key: &str, expected: impl std::fmt::Display) {
        assert_eq!(self.str(key), expected.to_string(), "{}: {key}", self.script);
    }
}

/// Uploads `inputs` (files in `examples/data/`, each under its own name), runs
/// `examples/<script>` on them and returns what it printed; asserts it succeeded.
async fn run_example(client: &mut Client, script: &str, inputs: &[&str]) -> Output {
    let mut uploaded = Vec::new();
    for name in inputs {
        let path = data(name);
        let input = client.upload(&path, name).await.unwrap_or_else(|e| panic!("upload {name}: {e}"));
        let bytes = std::fs::read(&path).expect("read input");
        assert_eq!(input.sha256, hex::encode(Sha256::digest(&bytes)), "{name}: digest");
        assert_eq!(input.size, bytes.len() as u64, "{name}: size");
        assert_eq!(input.path, *name, "lands in the work dir under its name");
        uploaded.push(input);
    }
    let code = std::fs::read_to_string(repo_root().join("examples").join(script)).expect("example program");
    let mut spec = python_job(&code, Sku::M);
    spec.timeout = Some("120s".into());
    spec.inputs = uploaded;
    let result = run(client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{script}: stderr: {}", result.stderr.text);
    assert_eq!(result.exit_code, Some(0), "{script}");
    assert!(!result.stdout.truncated, "{script}: stdout truncated");
    Output::parse(script, &result.stdout.text)
}

/// Count, mean, minimum and maximum of the present values.
#[derive(Debug, Clone, Copy)]
struct Stats {
    count: usize,
    mean: f64,
    min: f64,
    max: f64,
}

fn stats(values: impl IntoIterator<Item = f64>) -> Stats {
    let (mut count, mut sum, mut min, mut max) = (0usize, 0.0, f64::INFINITY, f64::NEG_INFINITY);
    for v in values {
        count += 1;
        sum += v;
        min = min.min(v);
        max = max.max(v);
    }
    Stats { count, mean: sum / count as f64, min, max }
}

/// Stocks.csv parsed by hand: the comment line skipped, empty cells as `None`.
struct Stocks {
    tickers: Vec<String>,
    dates: Vec<String>,
    /// Per row, one price (or none) per ticker.
    rows: Vec<Vec<Option<f64>>>,
}

fn stocks() -> Stocks {
    let text = read_text("Stocks.csv");
    let mut lines = text.lines().filter(|l| !l.starts_with('#'));
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    assert_eq!(header[0], "Date");
    let tickers: Vec<String> = header[1..].iter().map(|t| (*t).to_owned()).collect();
    let (mut dates, mut rows) = (Vec::new(), Vec::new());
    for line in lines.filter(|l| !l.is_empty()) {
        let cells: Vec<&str> = line.split(',').collect();
        assert_eq!(cells.len(), header.len(), "row {line:?}");
        dates.push(cells[0].to_owned());
        rows.push(
            cells[1..].iter().map(|c| (!c.is_empty()).then(|| c.parse::<f64>().unwrap_or_else(|e| panic!("price {c:?}: {e}")))).collect(),
        );
    }
    Stocks { tickers, dates, rows }
}

impl Stocks {
    fn column(&self, i: usize) -> Stats {
        stats(self.rows.iter().filter_map(|r| r[i]))
    }

    /// Checks the statistics printed by `read_stocks_csv.py` or `read_stocks_xlsx.py`; `exact`
    /// when the program read the very same decimal strings (min and max then match exactly).
    fn check(&self, out: &Output, exact: bool) {
        out.assert_eq("rows", self.rows.len());
        out.assert_eq("empty_rows", self.rows.iter().filter(|r| r.iter().all(Option::is_none)).count());
        out.assert_eq("first_date", &self.dates[0]);
        out.assert_eq("last_date", &self.dates[self.dates.len() - 1]);
        out.assert_eq("tickers", self.tickers.join(","));
        for (i, ticker) in self.tickers.iter().enumerate() {
            let want = self.column(i);
            out.assert_eq(&format!("count.{ticker}"), want.count);
            out.assert_close(&format!("mean.{ticker}"), want.mean);
            if exact {
                assert_eq!(out.float(&format!("min.{ticker}")), want.min, "{}: min.{ticker}", out.script);
                assert_eq!(out.float(&format!("max.{ticker}")), want.max, "{}: max.{ticker}", out.script);
            } else {
                out.assert_close(&format!("min.{ticker}"), want.min);
                out.assert_close(&format!("max.{ticker}"), want.max);
            }
        }
    }
}

#[tokio::test]
async fn stocks_csv_with_comment_line_and_empty_cells() {
    let want = stocks();
    // What the data set's README says about it.
    assert_eq!(want.tickers.len(), 10);
    assert_eq!(want.dates[0], "1990-01-01");
    assert!(want.rows.iter().any(|r| r.iter().all(Option::is_none)), "some rows hold no price at all");
    let mut client = client().await;
    let out = run_example(&mut client, "read_stocks_csv.py", &["Stocks.csv"]).await;
    want.check(&out, true);
}

#[tokio::test]
async fn stocks_xlsx_sheet_matches_the_csv() {
    let want = stocks();
    let mut client = client().await;
    let out = run_example(&mut client, "read_stocks_xlsx.py", &["stocks.xlsx"]).await;
    // The workbook stores prices with 16 significant digits: close, not bit-identical.
    want.check(&out, false);
}

/// One weekly CO2 series: dates and values (`None` for a gap).
type Series = Vec<(String, Option<f64>)>;

fn co2_csv() -> Series {
    let text = read_text("co2.csv");
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("date,co2"));
    lines
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (date, value) = l.split_once(',').unwrap_or_else(|| panic!("co2.csv row {l:?}"));
            (date.to_owned(), (!value.is_empty()).then(|| value.parse().unwrap_or_else(|e| panic!("co2 {value:?}: {e}"))))
        })
        .collect()
}

fn co2_record(value: &serde_json::Value) -> (String, Option<f64>) {
    let date = value["date"].as_str().unwrap_or_else(|| panic!("date in {value}")).to_owned();
    let co2 = match &value["co2"] {
        serde_json::Value::Null => None,
        v => Some(v.as_f64().unwrap_or_else(|| panic!("co2 in {value}"))),
    };
    (date, co2)
}

fn co2_jsonl() -> Series {
    read_text("co2.jsonl")
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| co2_record(&serde_json::from_str(l).unwrap_or_else(|e| panic!("co2.jsonl line {l:?}: {e}"))))
        .collect()
}

/// Checks the `prefix.*` lines of `read_co2.py` against `series`.
fn check_co2(out: &Output, prefix: &str, series: &Series) {
    let present = stats(series.iter().filter_map(|(_, v)| *v));
    let (mut longest, mut run) = (0, 0);
    for (_, v) in series {
        run = if v.is_none() { run + 1 } else { 0 };
        longest = longest.max(run);
    }
    out.assert_eq(&format!("{prefix}.rows"), series.len());
    out.assert_eq(&format!("{prefix}.missing"), series.len() - present.count);
    out.assert_eq(&format!("{prefix}.longest_gap"), longest);
    out.assert_eq(&format!("{prefix}.first_date"), &series[0].0);
    out.assert_eq(&format!("{prefix}.last_date"), &series[series.len() - 1].0);
    out.assert_close(&format!("{prefix}.mean"), present.mean);
    assert_eq!(out.float(&format!("{prefix}.min")), present.min, "{prefix}.min");
    assert_eq!(out.float(&format!("{prefix}.max")), present.max, "{prefix}.max");
}

#[tokio::test]
async fn co2_csv_and_jsonl_with_gaps() {
    let (csv, jsonl) = (co2_csv(), co2_jsonl());
    // The README: 2284 weekly values from 1958 to 2001, with gaps; the JSON lines are the CSV.
    assert_eq!(csv.len(), 2284);
    assert!(csv.iter().any(|(_, v)| v.is_none()), "the series has gaps");
    assert_eq!(csv, jsonl, "co2.jsonl holds the series of co2.csv");
    let mut client = client().await;
    let out = run_example(&mut client, "read_co2.py", &["co2.csv", "co2.jsonl"]).await;
    check_co2(&out, "csv", &csv);
    check_co2(&out, "jsonl", &jsonl);
    out.assert_eq("same_series", "True");
}

#[tokio::test]
async fn json_array_of_records() {
    let value: serde_json::Value = serde_json::from_str(&read_text("co2_sample.json")).expect("co2_sample.json");
    let records: Series = value.as_array().expect("a JSON array").iter().map(co2_record).collect();
    // As examples/data/README.md says: the first 100 records of co2.jsonl.
    assert_eq!(records, co2_jsonl()[..100]);
    let present = stats(records.iter().filter_map(|(_, v)| *v));
    let mut client = client().await;
    let out = run_example(&mut client, "read_json.py", &["co2_sample.json"]).await;
    out.assert_eq("records", records.len());
    out.assert_eq("keys", "co2,date");
    out.assert_eq("nulls", records.len() - present.count);
    out.assert_eq("first_date", &records[0].0);
    out.assert_eq("last_date", &records[records.len() - 1].0);
    out.assert_close("mean", present.mean);
    assert_eq!(out.float("min"), present.min);
    assert_eq!(out.float("max"), present.max);
}

#[tokio::test]
async fn iris_with_counts_and_class_names_in_the_header() {
    let text = read_text("iris.csv");
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let (samples, features): (usize, usize) = (header[0].parse().expect("samples"), header[1].parse().expect("features"));
    let classes = &header[2..];
    assert_eq!((samples, features, classes), (150, 4, &["setosa", "versicolor", "virginica"][..]));
    // Per class: sample count and per-feature sums.
    let mut per_class = vec![(0usize, [0.0f64; 4]); classes.len()];
    for line in lines.filter(|l| !l.is_empty()) {
        let cells: Vec<&str> = line.split(',').collect();
        assert_eq!(cells.len(), features + 1, "row {line:?}");
        let class: usize = cells[features].parse().expect("target");
        let entry = &mut per_class[class];
        entry.0 += 1;
        for (sum, cell) in entry.1.iter_mut().zip(&cells[..features]) {
            *sum += cell.parse::<f64>().expect("feature");
        }
    }
    assert_eq!(per_class.iter().map(|c| c.0).sum::<usize>(), samples);

    let mut client = client().await;
    let out = run_example(&mut client, "read_iris.py", &["iris.csv"]).await;
    out.assert_eq("header_samples", samples);
    out.assert_eq("header_features", features);
    out.assert_eq("classes", classes.join(","));
    out.assert_eq("rows", samples);
    let names = ["sepal_length", "sepal_width", "petal_length", "petal_width"];
    for (class, (count, sums)) in classes.iter().zip(&per_class) {
        out.assert_eq(&format!("count.{class}"), count);
        for (feature, sum) in names.iter().zip(sums) {
            out.assert_close(&format!("mean.{class}.{feature}"), sum / *count as f64);
        }
    }
}

/// What a JPEG's markers say, read by hand.
#[derive(Debug, Default)]
struct JpegInfo {
    width: u32,
    height: u32,
    components: u8,
    /// JFIF density (x, y) when its unit is dots per inch.
    dpi: Option<(u16, u16)>,
    comment: Option<String>,
}

fn jpeg_info(bytes: &[u8]) -> JpegInfo {
    assert_eq!(&bytes[..2], b"\xff\xd8", "JPEG SOI marker");
    let mut info = JpegInfo::default();
    let mut at = 2;
    let mut frame = false;
    while at + 4 <= bytes.len() {
        assert_eq!(bytes[at], 0xff, "marker expected at byte {at}");
        let marker = bytes[at + 1];
        if marker == 0xff {
            at += 1; // fill byte
            continue;
        }
        let len = usize::from(u16::from_be_bytes([bytes[at + 2], bytes[at + 3]]));
        let segment = &bytes[at + 4..at + 2 + len];
        match marker {
            // SOF0..SOF15 except DHT (c4), JPG (c8) and DAC (cc): precision, height, width, components.
            0xc0..=0xcf if !matches!(marker, 0xc4 | 0xc8 | 0xcc) => {
                info.height = u32::from(u16::from_be_bytes([segment[1], segment[2]]));
                info.width = u32::from(u16::from_be_bytes([segment[3], segment[4]]));
                info.components = segment[5];
                frame = true;
            }
            0xe0 if segment.starts_with(b"JFIF\0") && segment[7] == 1 => {
                info.dpi = Some((u16::from_be_bytes([segment[8], segment[9]]), u16::from_be_bytes([segment[10], segment[11]])));
            }
            0xfe => info.comment = Some(String::from_utf8_lossy(segment).into_owned()),
            0xda => break, // start of scan: the headers are over
            _ => {}
        }
        at += 2 + len;
    }
    assert!(frame, "no SOF marker");
    info
}

#[tokio::test]
async fn jpeg_image() {
    let bytes = std::fs::read(data("grace_hopper.jpg")).expect("jpeg");
    let want = jpeg_info(&bytes);
    assert_eq!((want.width, want.height, want.components), (512, 600, 3), "the README: a 512x600 RGB photograph");
    let mut client = client().await;
    let out = run_example(&mut client, "read_image.py", &["grace_hopper.jpg"]).await;
    out.assert_eq("format", "JPEG");
    out.assert_eq("width", want.width);
    out.assert_eq("height", want.height);
    out.assert_eq("mode", if want.components == 3 { "RGB" } else { "L" });
    out.assert_eq("bands", want.components);
    out.assert_eq("pixels", want.width * want.height);
    let (x, y) = want.dpi.expect("JFIF density in dots per inch");
    out.assert_eq("dpi", format!("{x}x{y}"));
    out.assert_eq("comment", want.comment.expect("COM segment"));
}

#[tokio::test]
async fn plain_text() {
    let bytes = std::fs::read(data("README-data.txt")).expect("text");
    let text = std::str::from_utf8(&bytes).expect("UTF-8");
    let mut client = client().await;
    let out = run_example(&mut client, "read_text.py", &["README-data.txt"]).await;
    out.assert_eq("bytes", bytes.len());
    out.assert_eq("chars", text.chars().count());
    out.assert_eq("lines", bytes.iter().filter(|b| **b == b'\n').count());
    out.assert_eq("words", text.split_whitespace().count());
    out.assert_eq("longest_line", text.lines().map(|l| l.chars().count()).max().expect("a line"));
    out.assert_eq("table_rows", text.lines().filter(|l| l.starts_with('|')).count());
}

/// Every data file in `examples/data/` is read by an example program: the programs name it.
#[test]
fn every_data_file_is_read_by_an_example() {
    let mut programs = String::new();
    for entry in std::fs::read_dir(repo_root().join("examples")).expect("examples dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "py") {
            programs.push_str(&std::fs::read_to_string(&path).expect("program"));
        }
    }
    let mut names = Vec::new();
    for entry in std::fs::read_dir(repo_root().join("examples/data")).expect("data dir") {
        let name = entry.expect("entry").file_name().to_string_lossy().into_owned();
        if name != "README.md" {
            assert!(programs.contains(&format!("\"{name}\"")), "no example program opens {name}");
            names.push(name);
        }
    }
    names.sort();
    let expected =
        ["README-data.txt", "Stocks.csv", "co2.csv", "co2.jsonl", "co2_sample.json", "grace_hopper.jpg", "iris.csv", "stocks.xlsx"];
    assert_eq!(names, expected);
}
