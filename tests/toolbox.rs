//! The sandbox image's toolbox (issue 9, section 3): every Python module and npm package that
//! `docs/sandbox-image.md` lists imports in the image at the version the doc states, and the
//! reported inputs of `tests/reported/` (programs users reported) give their right
//! behaviour through a real worker: `df.style`, Markdown to PDF, CJK chart labels, `.xls`
//! uploads, npm packages, and the artifact cap after unzipping an upload.

use std::path::Path;

use sandq_schemas::{JobResult, JobSpec, JobStatus, MimeValue, RunMode, Runtime, Sku};
use sandq_tests::{client, python_job, repo_root, run};

fn reported(name: &str) -> String {
    let path = repo_root().join("tests/reported").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `(runtime, name, version)` rows of the toolbox table in `docs/sandbox-image.md`
/// (`| python | jinja2 | 3.1.6 | ... |`).
fn documented() -> Vec<(String, String, String)> {
    let doc = std::fs::read_to_string(repo_root().join("docs/sandbox-image.md")).expect("sandbox-image.md");
    doc.lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.trim().trim_matches('|').split('|').map(str::trim).collect();
            let runtime = *cells.first()?;
            (cells.len() >= 3 && (runtime == "python" || runtime == "node"))
                .then(|| (runtime.to_owned(), cells[1].trim_matches('`').to_owned(), cells[2].to_owned()))
        })
        .collect()
}

fn script(code: &str, runtime: Runtime) -> JobSpec {
    let mut spec = python_job(code, Sku::S);
    spec.runtime = runtime;
    spec.mode = Some(RunMode::Script);
    spec
}

#[tokio::test]
async fn every_documented_package_imports_at_its_documented_version() {
    let rows = documented();
    let python: Vec<_> = rows.iter().filter(|r| r.0 == "python").collect();
    let node: Vec<_> = rows.iter().filter(|r| r.0 == "node").collect();
    // The list, at least (an assistant's toolbox).
    for name in [
        "jinja2",
        "markdown",
        "weasyprint",
        "reportlab",
        "fpdf",
        "sympy",
        "tabulate",
        "tqdm",
        "xlrd",
        "pyarrow",
        "networkx",
        "skimage",
        "cv2",
        "nltk",
        "imageio",
        "xarray",
        "aiohttp",
        "pytz",
        "joblib",
        "soundfile",
    ] {
        assert!(python.iter().any(|r| r.1 == name), "{name} is not in the doc's table");
    }
    for name in ["lodash", "axios", "dayjs", "csv-parse", "uuid", "xlsx"] {
        assert!(node.iter().any(|r| r.1 == name), "{name} is not in the doc's table");
    }

    let mut client = client().await;
    let check = std::fs::read_to_string(repo_root().join("oci-bundles/image-check.py")).expect("image-check.py");
    let result = run(&mut client, &script(&check, Runtime::Python)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    let lines: Vec<&str> = result.stdout.text.lines().collect();
    for (_, name, version) in &python {
        let line = format!("ok {name} {version}");
        assert!(lines.contains(&line.as_str()), "{line} not in:\n{}", result.stdout.text);
    }

    // From /work, not beside the packages: `require` and `import` find them from anywhere.
    let check = std::fs::read_to_string(repo_root().join("oci-bundles/image-check.js")).expect("image-check.js");
    for mode in [RunMode::Script, RunMode::Notebook] {
        let mut spec = script(&check, Runtime::Node);
        spec.mode = Some(mode);
        let result = run(&mut client, &spec).await;
        assert_eq!(result.status, JobStatus::Succeeded, "{mode:?}: {result:?}");
        for (_, name, version) in &node {
            let line = format!("ok {name} {version} require import");
            assert!(result.stdout.text.lines().any(|l| l == line), "{mode:?}: {line} not in:\n{}", result.stdout.text);
        }
    }
}

#[tokio::test]
async fn npm_packages_load_by_require_and_by_static_import() {
    // Right: the common packages an assistant reaches for are installed and load.
    let mut client = client().await;
    let result = run(&mut client, &script(&reported("node_packages.js"), Runtime::Node)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, "ok lodash\nok axios\nok dayjs\nok csv-parse\nok uuid\n");

    // Static imports in a notebook cell, used for real.
    let code = "import _ from 'lodash';\nimport dayjs from 'dayjs';\nimport { parse } from 'csv-parse/sync';\nimport * as XLSX from 'xlsx';\nimport { validate } from 'uuid';\nconst rows = parse('a,b\\n1,2\\n3,4\\n', { columns: true });\nconst sheet = XLSX.utils.json_to_sheet(rows);\n[_.sumBy(rows, (r) => Number(r.b)), dayjs('2024-02-28').add(1, 'day').format('YYYY-MM-DD'), XLSX.utils.sheet_to_csv(sheet).trim(), validate('not-a-uuid')]\n";
    let mut spec = python_job(code, Sku::S);
    spec.runtime = Runtime::Node;
    let result = run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    let value = result.outputs[0].data["text/plain"].text.clone().expect("text");
    assert_eq!(value, "[ 6, '2024-02-29', 'a,b\\n1,2\\n3,4', false ]");
}

fn html(result: &JobResult) -> String {
    result.outputs.iter().find_map(|o| o.data.get("text/html").and_then(|v: &MimeValue| v.text.clone())).expect("text/html output")
}

#[tokio::test]
async fn a_styler_renders_as_html() {
    // Right: one execute_result whose text/html holds "12.5%" and a highlight style.
    let mut client = client().await;
    let result = run(&mut client, &python_job(&reported("styler.py"), Sku::S)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.outputs.len(), 1, "{:?}", result.outputs);
    let html = html(&result);
    assert!(html.contains("12.5%") && html.contains("40.0%"), "{html}");
    assert!(html.contains("background-color: gold"), "{html}");
}

async fn upload(client: &sandq_client::Client, local: &Path, name: &str) -> sandq_schemas::InputFile {
    client.upload(local, name).await.unwrap_or_else(|e| panic!("upload {name}: {e}"))
}

#[tokio::test]
async fn markdown_converts_to_a_pdf_artifact() {
    // Right: notes.pdf (application/pdf) comes back as an artifact. Upload notes.md with it.
    let mut client = client().await;
    let mut spec = python_job(&reported("md_to_pdf.py"), Sku::S);
    spec.inputs.push(upload(&client, &repo_root().join("tests/reported/notes.md"), "notes.md").await);
    let result = run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    let pdf = result.artifacts.iter().find(|a| a.path == "notes.pdf").unwrap_or_else(|| panic!("no notes.pdf: {:?}", result.artifacts));
    assert_eq!(pdf.content_type, "application/pdf");
    let dir = tempfile::tempdir().expect("tempdir");
    let local = client.download_artifact(pdf, dir.path()).await.expect("download");
    let bytes = std::fs::read(&local).expect("pdf");
    assert!(bytes.starts_with(b"%PDF-"), "a PDF");

    // Its text, read back by another library (pypdf) in another job.
    let mut spec = script("import pypdf\nprint(' '.join(p.extract_text() for p in pypdf.PdfReader('notes.pdf').pages))\n", Runtime::Python);
    spec.inputs.push(upload(&client, &local, "notes.pdf").await);
    let result = run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    for text in ["Quarterly notes", "grew", "North: +12%", "South: +8%"] {
        assert!(result.stdout.text.contains(text), "{text} not in {}", result.stdout.text);
    }
}

#[tokio::test]
async fn cjk_arabic_hebrew_and_devanagari_labels_render_without_missing_glyphs() {
    // Right: a 600x300 PNG whose labels render; no "Glyph ... missing from font" warning.
    let mut client = client().await;
    let result = run(&mut client, &python_job(&reported("cjk_chart.py"), Sku::S)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert!(!result.stderr.text.contains("missing from font"), "{}", result.stderr.text);
    let image = result.outputs.iter().find_map(|o| o.image).expect("an image output");
    assert_eq!((image.width, image.height), (600, 300));

    // Each script's text is drawn with a font that has its glyphs (the fallback list), in
    // script mode too, where nothing of sandq's runner is loaded.
    let code = "import warnings\nwarnings.simplefilter('error')\nimport matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.set_title('東京 大阪 서울 売上 / 매출')\nax.set_xlabel('مرحبا بالعالم')\nax.set_ylabel('שלום עולם')\nax.text(0.5, 0.5, 'नमस्ते दुनिया')\nfig.savefig('labels.png')\nprint('drawn')\n";
    let result = run(&mut client, &script(code, Runtime::Python)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, "drawn\n");
    assert!(!result.stderr.text.contains("missing"), "{}", result.stderr.text);
}

#[tokio::test]
async fn an_uploaded_xls_reads() {
    // Right: it reads (xlrd), like .xlsx does. data.xls: made with xlwt, the values below.
    let mut client = client().await;
    let code = format!("{}print(df.to_csv(index=False), end='')\n", reported("legacy_xls.py"));
    let mut spec = python_job(&code, Sku::S);
    spec.inputs.push(upload(&client, &repo_root().join("tests/reported/data.xls"), "data.xls").await);
    let result = run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, "region,units,price\nNorth,12,2.5\nSouth,8,4.25\nEast,5,10.0\n");
}

#[tokio::test]
async fn the_requested_summary_survives_the_artifact_cap_after_an_unzip() {
    // Right: summary.csv comes back even though the extracted files exceed the artifact cap;
    // what is dropped is reported. 150 CSVs, file i holding `a,b` = `i,2i`.
    let dir = tempfile::tempdir().expect("tempdir");
    let zip = dir.path().join("many_csvs.zip");
    let made = std::process::Command::new("python3")
        .arg("-c")
        .arg("import sys, zipfile\nwith zipfile.ZipFile(sys.argv[1], 'w') as z:\n    for i in range(150):\n        z.writestr(f'part{i:03}.csv', f'a,b\\n{i},{2 * i}\\n')\n")
        .arg(&zip)
        .status()
        .expect("python3");
    assert!(made.success());
    let mut client = client().await;
    let mut spec = python_job(&reported("unzip_then_summarize.py"), Sku::S);
    spec.inputs.push(upload(&client, &zip, "many_csvs.zip").await);
    let result = run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, "150 files\n");
    let summary =
        result.artifacts.iter().find(|a| a.path == "summary.csv").unwrap_or_else(|| panic!("no summary.csv: {:?}", result.artifacts));
    let local = client.download_artifact(summary, dir.path()).await.expect("download");
    let (a, b): (u64, u64) = ((0..150).sum(), (0..150).map(|i| 2 * i).sum());
    assert_eq!(std::fs::read_to_string(local).expect("summary"), format!(",0\na,{a}\nb,{b}\n"));
    // The cap dropped extracted files, and says so.
    let extracted = result.artifacts.iter().filter(|a| a.path.starts_with("extracted/")).count();
    assert!(extracted < 150, "{extracted} extracted files collected");
    assert_eq!(result.skipped_artifacts_total as usize, 150 - extracted, "{:?}", result.skipped_artifacts);
    assert!(
        result.skipped_artifacts.iter().all(|s| s.path.starts_with("extracted/") && s.reason == "too_many"),
        "{:?}",
        result.skipped_artifacts
    );
}

#[tokio::test]
async fn parquet_docx_and_pdf_files_read_back_what_was_written() {
    // Each format written by one library and read by the one an assistant reaches for.
    let code = "\
import pandas as pd, docx, pypdf
from fpdf import FPDF
pd.DataFrame({'city': ['Oslo', 'Lima'], 'temp': [4.5, 19.25]}).to_parquet('t.parquet')
print(pd.read_parquet('t.parquet').to_csv(index=False), end='')
d = docx.Document(); d.add_paragraph('hello from docx'); d.save('t.docx')
print(docx.Document('t.docx').paragraphs[0].text)
pdf = FPDF(); pdf.add_page(); pdf.set_font('helvetica', size=12); pdf.cell(text='hello from fpdf2'); pdf.output('t.pdf')
print(pypdf.PdfReader('t.pdf').pages[0].extract_text())
";
    let mut client = client().await;
    let result = run(&mut client, &script(code, Runtime::Python)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, "city,temp\nOslo,4.5\nLima,19.25\nhello from docx\nhello from fpdf2\n");
}

#[tokio::test]
async fn a_seaborn_style_or_theme_keeps_the_cjk_and_emoji_fallbacks() {
    // Right: Chinese labels and emoji render whatever style or theme the code set first; no
    // "missing from font" warning.
    let mut client = client().await;
    for case in ["seaborn_style_cjk.py", "emoji_title.py"] {
        let result = run(&mut client, &python_job(&reported(case), Sku::S)).await;
        assert_eq!(result.status, JobStatus::Succeeded, "{case}: {result:?}");
        assert!(!result.stderr.text.contains("missing from font"), "{case}: {}", result.stderr.text);
        assert!(result.outputs.iter().any(|o| o.image.is_some()), "{case}: no figure");
    }
    let themed = "import warnings\nwarnings.simplefilter('error')\nimport seaborn as sns\nsns.set_theme(style='whitegrid', font='sans-serif')\n\
                  import matplotlib.pyplot as plt\nplt.bar(['東京', 'नमस्ते', '🚀'], [1, 2, 3])\nplt.title('売上 ✅')\nplt.show()\nprint('drawn')\n";
    let result = run(&mut client, &python_job(themed, Sku::S)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}\n{result:?}", result.stderr.text);
    assert_eq!(result.stdout.text, "drawn\n");
}

#[tokio::test]
async fn a_retina_figure_has_twice_the_pixels_and_its_display_size() {
    // Right, as Jupyter: 1280x960 pixels for the default 6.4x4.8 in at 100 dpi, shown at
    // 640x480; the same through set_matplotlib_formats; a plain figure stays 640x480.
    let mut client = client().await;
    let set_formats = "from matplotlib_inline.backend_inline import set_matplotlib_formats\nset_matplotlib_formats('retina')\nimport matplotlib.pyplot as plt\nplt.plot([3, 1, 2])\nplt.show()\n";
    for (code, pixels, display) in [
        (reported("hidpi_figure.py"), (1280, 960), Some((640, 480))),
        (set_formats.to_owned(), (1280, 960), Some((640, 480))),
        ("import matplotlib.pyplot as plt\nplt.plot([3, 1, 2])\nplt.show()\n".to_owned(), (640, 480), None),
    ] {
        let result = run(&mut client, &python_job(&code, Sku::S)).await;
        assert_eq!(result.status, JobStatus::Succeeded, "{code}: {result:?}");
        let figure = result.outputs.iter().find(|o| o.image.is_some()).unwrap_or_else(|| panic!("{code}: no figure"));
        let image = figure.image.expect("size");
        assert_eq!((image.width, image.height), pixels, "{code}");
        assert_eq!(figure.display.map(|d| (d.width, d.height)), display, "{code}");
    }
}

#[tokio::test]
async fn pil_image_show_displays_the_image() {
    // Right, as E2B's interpreter and Jupyter: Image.show() in a cell gives a display_data
    // output with the image's PNG (before: nothing, Pillow found no viewer).
    let mut client = client().await;
    let code = "from PIL import Image\nImage.new('RGB', (120, 80), 'red').show()\nprint('shown')\n";
    let result = run(&mut client, &python_job(code, Sku::S)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
    assert_eq!(result.stdout.text, "shown\n");
    let shown: Vec<_> = result.outputs.iter().filter(|o| o.data.contains_key("image/png")).collect();
    assert_eq!(shown.len(), 1, "{:?}", result.outputs);
    assert_eq!(shown[0].image.map(|i| (i.width, i.height)), Some((120, 80)));
}

#[tokio::test]
async fn lines_printed_by_several_processes_stay_whole() {
    // Right (notebook and script mode, SKU M): 800 lines, each exactly "line <i> <k> " and 60
    // x's: two processes printing whole lines never split each other's lines.
    let mut client = client().await;
    let code = reported("interleaved_lines.py");
    for spec in [python_job(&code, Sku::M), {
        let mut s = script(&code, Runtime::Python);
        s.sku = Sku::M;
        s
    }] {
        let result = run(&mut client, &spec).await;
        assert_eq!(result.status, JobStatus::Succeeded, "{result:?}");
        let lines: Vec<&str> = result.stdout.text.lines().collect();
        assert_eq!(lines.len(), 800, "{}", result.stdout.text);
        let mut expected: Vec<String> = (0..4).flat_map(|i| (0..200).map(move |k| format!("line {i} {k} {}", "x".repeat(60)))).collect();
        let mut got: Vec<String> = lines.iter().map(|l| (*l).to_owned()).collect();
        expected.sort();
        got.sort();
        assert_eq!(got, expected, "a line was split or mixed");
    }
}
