//! `sandq submit`, `sandq run` and `sandq wait`: a job made from the command line, submitted,
//! its live output printed, its result waited for, its files downloaded and the result printed.

use std::collections::BTreeMap;
use std::io::{IsTerminal as _, Read as _};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _};
use futures::StreamExt as _;
use indicatif::{ProgressBar, ProgressStyle};
use sandq_client::{Backend, Transcript};
use sandq_core::time::now_ms;
use sandq_schemas::{JobSpec, NetworkMode, Output, RunMode, Runtime};

use crate::args::JobArgs;
use crate::render;

/// `sandq submit`: submits the job and prints its id.
pub(crate) async fn submit(backend: &mut Backend, args: &JobArgs) -> anyhow::Result<i32> {
    let spec = build_and_submit(backend, args).await?;
    println!("{}", spec.job_id);
    Ok(0)
}

/// `sandq run`: submits the job, prints what it prints as it runs (unless `--no-stream` or
/// `--json`), then [`finish`]es it.
pub(crate) async fn run(backend: &mut Backend, args: &JobArgs, json: bool) -> anyhow::Result<i32> {
    let spec = build_and_submit(backend, args).await?;
    let live = if args.no_stream || json { None } else { Some(stream_live(backend, &spec.job_id, args.wait.into()).await) };
    finish(backend, &spec.job_id, &args.out, args.wait.into(), json, live.as_ref()).await
}

/// The job of the command line, submitted; without `--refuse-unserved`, a job no worker serves
/// right now is submitted after a warning on stderr.
async fn build_and_submit(backend: &mut Backend, args: &JobArgs) -> anyhow::Result<JobSpec> {
    let spec = build_job(backend, args).await?;
    if !args.refuse_unserved {
        if let Some(ttl) = backend.unserved_wait(spec.sku).await {
            eprintln!("{}", render::unserved_warning(spec.sku, ttl));
        }
    }
    backend.submit(&spec, args.refuse_unserved).await?;
    Ok(spec)
}

async fn build_job(backend: &Backend, args: &JobArgs) -> anyhow::Result<JobSpec> {
    let runtime = match (&args.runtime, &args.program) {
        (Some(r), _) if r == "node" => Runtime::Node,
        (Some(_), _) => Runtime::Python,
        (None, Some(p)) if p.extension().is_some_and(|e| e == "js" || e == "mjs") => Runtime::Node,
        _ => Runtime::Python,
    };
    let code = match (&args.code, &args.program) {
        (Some(code), _) => code.clone(),
        (None, Some(program)) => std::fs::read_to_string(program).with_context(|| format!("cannot read {}", program.display()))?,
        (None, None) => bail!("give a program file or -c CODE"),
    };
    let mut inputs = Vec::new();
    for upload in &args.uploads {
        let (local, sandbox_path) = match upload.split_once(':') {
            Some((l, p)) => (PathBuf::from(l), p.to_owned()),
            None => {
                let local = PathBuf::from(upload);
                let name = local.file_name().context("upload has no file name")?.to_string_lossy().into_owned();
                (local, name)
            }
        };
        inputs.push(backend.upload(&local, &sandbox_path).await.with_context(|| format!("cannot upload {}", local.display()))?);
    }
    let stdin = match &args.stdin {
        None => None,
        Some(p) if p == Path::new("-") => {
            let mut buf = Vec::new();
            std::io::stdin().read_to_end(&mut buf)?;
            Some(buf)
        }
        Some(p) => Some(std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?),
    };
    let mut env = BTreeMap::new();
    for pair in &args.env {
        let (k, v) = pair.split_once('=').context("--env takes NAME=VALUE")?;
        env.insert(k.to_owned(), v.to_owned());
    }
    let job_id = args.id.clone().unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let mut spec = JobSpec::new(job_id, args.sku, runtime, code);
    spec.args = args.args.clone();
    spec.inputs = inputs;
    spec.stdin = stdin;
    spec.env = env;
    spec.timeout = args.timeout.clone();
    spec.network = if args.network == "outbound" { NetworkMode::Outbound } else { NetworkMode::None };
    spec.submitted_at_ms = Some(now_ms());
    spec.mode = match args.mode.as_deref() {
        Some("script") => Some(RunMode::Script),
        Some(_) => Some(RunMode::Notebook),
        None => None,
    };
    spec.session = args.session.clone();
    Ok(spec)
}

/// Prints the job's live events as they come ([`render::live_event`]). Returns what was
/// printed, so that the end prints only what the stream missed. Gives up after `wait`.
async fn stream_live(backend: &mut Backend, job_id: &str, wait: Duration) -> Transcript {
    let mut transcript = Transcript::default();
    let printing = async {
        let mut events = backend.events(job_id);
        while let Some(event) = events.next().await {
            // Over HTTP, an error opening the stream is its last item: said, and the wait that
            // follows reports it again, or the result.
            let event = match event {
                Ok(event) => event,
                Err(e) => {
                    eprintln!("sandq: no live output: {e}");
                    continue;
                }
            };
            // Best effort, as the stream: a closed stdout does not stop the job's wait.
            let _ = render::live_event(&event, &mut transcript, &mut std::io::stdout().lock(), &mut std::io::stderr().lock());
        }
    };
    let _ = tokio::time::timeout(wait, printing).await;
    transcript
}

/// Waits for the job's result (a spinner on a terminal), downloads its artifacts into
/// `out/<job id>/` and its images and figures into `out/<job id>/outputs/`, prints it (as JSON
/// with `json`); returns the exit code ([`render::finish_code`]). `sandq wait` is this alone.
pub(crate) async fn finish(
    backend: &mut Backend,
    job_id: &str,
    out: &Path,
    wait: Duration,
    json: bool,
    live: Option<&Transcript>,
) -> anyhow::Result<i32> {
    let progress = if std::io::stderr().is_terminal() && !json {
        let bar = ProgressBar::new_spinner();
        bar.set_style(ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")?);
        bar.enable_steady_tick(Duration::from_millis(100));
        Some(bar)
    } else {
        None
    };
    let result = backend
        .wait(job_id, wait, |status| {
            if let Some(bar) = &progress {
                bar.set_message(format!("job {job_id}: {}", status.map_or("unknown".to_owned(), |s| s.to_string())));
            }
        })
        .await;
    if let Some(bar) = &progress {
        bar.finish_and_clear();
    }
    let result = result?;
    let dir = out.join(job_id);
    let mut downloaded = Vec::new();
    // A failed download (a file of the job in the way, a full disk, content that does not
    // match its digest) is reported and makes the exit code 125 when the job itself succeeded,
    // but the result is printed whatever happens here.
    let mut download_failed = false;
    for artifact in &result.artifacts {
        match backend.download_artifact(job_id, artifact, &dir).await {
            Ok(path) => downloaded.push((artifact, path)),
            Err(e) => {
                download_failed = true;
                eprintln!("sandq: cannot download artifact {}: {e}", artifact.path);
            }
        }
    }
    let outputs_dir = dir.join("outputs");
    let mut saved_outputs = BTreeMap::new();
    for (index, output) in result.outputs.iter().enumerate() {
        match save_output(backend, output, index, &outputs_dir).await {
            Ok(Some(saved)) => {
                saved_outputs.insert(index, saved);
            }
            Ok(None) => {}
            Err(e) => eprintln!("sandq: cannot save output {index}: {e:#}"),
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        render::print_result(&result, &downloaded, &saved_outputs, live, &mut std::io::stdout().lock(), &mut std::io::stderr().lock())?;
    }
    Ok(render::finish_code(&result, download_failed))
}

/// Saves the representation of a rich output a person wants as a file: an image, or the HTML
/// of a plotly figure, or any representation stored only in S3 (too large to inline). Returns
/// the local path.
async fn save_output(backend: &Backend, output: &Output, index: usize, dir: &Path) -> anyhow::Result<Option<PathBuf>> {
    let image = output.data.iter().find(|(mime, _)| mime.starts_with("image/"));
    let plotly_html = output.data.contains_key("application/vnd.plotly.v1+json").then(|| output.data.get("text/html")).flatten();
    let chosen = image.map(|(_, v)| v).or(plotly_html).or_else(|| {
        let shown = output.data.get("text/markdown").or_else(|| output.data.get("text/plain"));
        shown.filter(|v| v.text.is_none())
    });
    let Some(value) = chosen else { return Ok(None) };
    if let Some(artifact) = &value.artifact {
        return Ok(Some(backend.download_output(artifact, dir).await?));
    }
    let Some(text) = &value.text else { return Ok(None) };
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("output-{index}.html"));
    std::fs::write(&path, text)?;
    Ok(Some(path))
}
