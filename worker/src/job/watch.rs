//! The program runs to its end (exit, timeout, OOM kill), or until the client cancels the job
//! or the worker's shutdown grace is over, whichever comes first.

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use sandq_core::results;
use sandq_schemas::ValidJob;

use super::conclude::{Failure, InfraError};
use crate::context::Context;
use crate::jobdir::JobDir;
use crate::live::displays::Displays;
use crate::live::Live;
use crate::run::{Handover, RunOutput, Started};
use crate::sandbox::Exit;

/// How often a running job's cancel key is checked (a cancelled job dies within about this).
pub(crate) const CANCEL_POLL: Duration = Duration::from_millis(250);

/// Why a running container was stopped early.
const STOP_NONE: u8 = 0;
const STOP_CANCEL: u8 = 1;
const STOP_SHUTDOWN: u8 = 2;

/// How the program's run ended, as far as the job is concerned.
pub(super) struct Ran {
    /// The helper's report and the captured streams.
    pub output: RunOutput,
    /// The client cancelled the job while it ran (the container was killed).
    pub cancelled: bool,
}

/// Runs the started sandbox's program to its end (a warm one is handed `handover` first).
///
/// # Errors
/// [`Failure::Interrupted`] when the worker's shutdown killed it; infrastructure failures of
/// the helper or of a libcontainer step.
///
/// While it runs, a notebook job's rich outputs go to `live` as they are displayed
/// (`displays`); at its end, a `finished` event, and everything pending is sent (bounded:
/// [`crate::live::FLUSH_WAIT`]).
pub(super) async fn run(
    ctx: &Context,
    job: &ValidJob,
    dir: &JobDir,
    started: Started,
    handover: Option<&Handover>,
    live: &Live,
    displays: Option<&mut Displays<'_>>,
) -> Result<Ran, Failure> {
    let stop_reason = AtomicU8::new(STOP_NONE);
    let stop = stop_signal(ctx, &job.spec.job_id, &stop_reason);
    let finish = started.finish(dir, &ctx.settings, job.timeout, handover, stop);
    let output = match displays {
        None => finish.await,
        Some(displays) => displays.follow(finish).await,
    };
    let exit_code = match output.as_ref().map(|o| &o.report.exit) {
        Ok(Exit::Exited { code }) => Some(*code),
        _ => None,
    };
    // All the text (a character cut short included), then `finished`, out before the result's
    // write appends `end` (one bounded wait).
    live.finished(exit_code);
    live.flush().await;
    let output = output.map_err(InfraError::Run)?;
    crate::metrics::enter(crate::metrics::Stage::Collect);
    if let Exit::Failed { step, message } = &output.report.exit {
        if step == "fork" {
            // The SKU's template cannot fork into sandboxes here (its process died, or the host
            // refuses a step): its warm sandboxes are made unforked for a while, so that this
            // job's next attempt, and the next jobs, are not lost to it.
            ctx.warm.templates.fork_failed(job.spec.sku);
            tracing::warn!(error = %message, "a forked start failed: the SKU's warm sandboxes start unforked for a while");
        }
        return Err(InfraError::Sandbox { step: step.clone(), message: message.clone() }.into());
    }
    let killed = output.report.exit == Exit::Killed;
    if killed && stop_reason.load(Ordering::SeqCst) != STOP_CANCEL {
        return Err(Failure::Interrupted);
    }
    Ok(Ran { output, cancelled: killed })
}

/// Resolves when the job's cancel key is set or the shutdown grace is over, recording which.
async fn stop_signal(ctx: &Context, job_id: &str, reason: &AtomicU8) {
    let mut redis = ctx.redis.clone();
    let mut abort = ctx.abort.clone();
    let cancelled = async {
        loop {
            tokio::time::sleep(CANCEL_POLL).await;
            if results::cancel_requested(&mut redis, &ctx.settings.names, job_id).await.unwrap_or(false) {
                return;
            }
        }
    };
    tokio::select! {
        () = cancelled => reason.store(STOP_CANCEL, Ordering::SeqCst),
        _ = abort.wait_for(|a| *a) => reason.store(STOP_SHUTDOWN, Ordering::SeqCst),
    }
}
