//! What the program left -> the job's result: artifacts from `/work`, rich outputs, the
//! session's files, state and packages saved, the captured streams stored, URLs presigned.

use sandq_core::time::now_ms;
use sandq_schemas::{JobResult, JobStatus, RunMode, SandboxStart, ValidJob};
use tracing::info;

use super::conclude::{Failure, InfraError};
use super::watch::Ran;
use crate::context::Context;
use crate::jobdir::JobDir;
use crate::placed::{Restore, Staged};
use crate::publish::{self, Attempt};
use crate::run::{Cell, RunOutput};
use crate::sandbox::Exit;
use crate::session::{self, Opened};
use crate::settings::SkuSettings;
use crate::{artifacts, outputs};

/// What [`result`] needs of the launch (the rest of [`Launched`](super::launch::Launched) was
/// used up by the run).
pub(super) struct Launch<'a> {
    /// The job's SKU as this worker serves it (its memory limit names an OOM kill).
    pub sku: SkuSettings,
    /// What staging recorded of the inputs.
    pub staged: Staged,
    /// The session files restored into `/work`.
    pub restore: Vec<Restore>,
    /// The cell's place in its session.
    pub cell: Cell,
    /// The sandbox's uid on the host.
    pub sandbox_uid: u32,
    /// Whether a warm sandbox ran the job.
    pub warm: bool,
    /// Whether its process was forked from a template.
    pub forked: bool,
    /// From `running` to the sandbox ready, ms.
    pub staged_ms: u64,
    /// The outputs' objects stored while the job ran (its live displays).
    pub uploaded: &'a outputs::Uploaded,
}

/// The job's result from its run: a cancelled one's streams only; otherwise artifacts,
/// outputs and (for a session job) the session saved.
///
/// # Errors
/// Infrastructure failures of S3, Redis or the session save.
pub(super) async fn result(
    ctx: &Context,
    job: &ValidJob,
    who: &Attempt,
    opened: Option<&Opened>,
    dir: &JobDir,
    launch: Launch<'_>,
    ran: Ran,
) -> Result<JobResult, Failure> {
    let (settings, sku) = (&ctx.settings, launch.sku);
    let bucket = &settings.services.s3.bucket;
    let Ran { output, cancelled } = ran;
    // Until the program started: staging (and the handover), or for a cold start also making
    // and starting the container.
    let start_ms = if launch.warm { 0 } else { (output.report.create_us + output.report.start_us) / 1000 };
    let sandbox = SandboxStart { warm: launch.warm, forked: launch.forked, sandbox_wait_ms: launch.staged_ms + start_ms };
    if cancelled {
        let logs = store_logs(ctx, job, who, &output).await?;
        let mut result = publish::finished(job, who, &output, artifacts::Collected::default(), sku.limits.memory_bytes, &logs, now_ms());
        result.status = JobStatus::Cancelled;
        result.signal = Some("SIGKILL".into());
        result.reason = Some("cancelled while running".into());
        result.session = opened.map(session::unchanged);
        result.sandbox = Some(sandbox);
        return Ok(result);
    }
    let r = &output.report;
    info!(create_us = r.create_us, start_us = r.start_us, fork_us = r.fork_us, wall_ms = r.wall_ms, "container cycle");
    let notebook = job.spec.run_mode() == RunMode::Notebook;
    let cell = launch.cell;
    let baseline = Opened::baseline(&launch.restore, job, &launch.staged);
    let collected = artifacts::collect(
        job,
        &who.id,
        &dir.work,
        &baseline,
        sku.disk_bytes != 0,
        &ctx.s3,
        bucket,
        settings.outputs.max_artifacts,
        settings.outputs.max_artifact_bytes,
    )
    .await
    .map_err(InfraError::Artifacts)?;
    let caps = outputs::Caps::of(&settings.outputs);
    let rich = if notebook {
        outputs::collect(&job.spec.job_id, &who.id, &dir.out, caps, outputs::Sink { s3: &ctx.s3, bucket, uploaded: launch.uploaded })
            .await
            .map_err(InfraError::Outputs)?
    } else {
        outputs::Outputs::default()
    };
    let session_info = match opened {
        Some(opened) => {
            let left = match cell.save_state {
                Some(_) => {
                    // Saved only when the cell ended by itself: a timeout or an OOM kill leaves
                    // the previous state.
                    let by_itself = matches!(output.report.exit, Exit::Exited { .. }) && output.report.stats.oom_kills == 0;
                    // The state this cell restored (for a runner that left it unchanged).
                    let restored = opened.manifest.context(job.spec.context.as_deref()).0.filter(|_| cell.restore_state).map(|f| f.size);
                    Some(session::read_state(&dir.out, settings.sessions.max_state_bytes, by_itself, restored).await)
                }
                None => None,
            };
            let count = notebook.then_some(cell.execution_count);
            let packages = session::left_packages(ctx, dir, launch.sandbox_uid, sku.limits.cpus).await;
            let left = session::Left { state: left, packages };
            let saved = session::save(ctx, job, opened, &collected.files, collected.skipped_total, count, left).await;
            Some(saved.map_err(InfraError::Session)?)
        }
        None => None,
    };
    let logs = store_logs(ctx, job, who, &output).await?;
    let mut result = publish::finished(job, who, &output, collected, sku.limits.memory_bytes, &logs, now_ms());
    result.outputs = rich.outputs;
    result.outputs_dropped = rich.dropped;
    result.error = rich.error;
    result.session = session_info;
    result.execution_count = notebook.then_some(cell.execution_count);
    result.sandbox = Some(sandbox);
    publish::presign(&mut result, &ctx.s3, bucket, publish::url_ttl(settings.outputs.artifact_url_ttl, job.result_ttl)).await;
    Ok(result)
}

/// Stores the captured streams' exact bytes in S3 (`jobs/<id>/<attempt id>/stdout` and `stderr`).
async fn store_logs(ctx: &Context, job: &ValidJob, who: &Attempt, output: &RunOutput) -> Result<publish::Logs, InfraError> {
    let bucket = &ctx.settings.services.s3.bucket;
    let mut logs = publish::Logs { inline_cap: ctx.settings.outputs.max_inline_output_bytes, ..Default::default() };
    for (stream, captured) in [("stdout", &output.stdout), ("stderr", &output.stderr)] {
        if captured.bytes.is_empty() {
            continue;
        }
        let key = sandq_schemas::names::log_key(&job.spec.job_id, &who.id, stream);
        sandq_core::storage::put_bytes(&ctx.s3, bucket, &key, captured.bytes.clone(), "application/octet-stream")
            .await
            .map_err(|source| InfraError::StoreLog { stream, source })?;
        if stream == "stdout" {
            logs.stdout_key = Some(key);
        } else {
            logs.stderr_key = Some(key);
        }
    }
    Ok(logs)
}
