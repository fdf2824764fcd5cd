//! One delivery, from the queue to its [`Outcome`], in [`process`]: the steps below in this
//! order, each a module of its own.
//!
//! | step | what | where |
//! |---|---|---|
//! | 1 validate | decode and check the message; a bad one is `rejected` (or dead-lettered without a job id) | [`crate::validate`], [`conclude::reject_undecodable`] |
//! | 2 admit | one attempt of a job at a time on this worker; not finished, cancelled or late; SKU served | [`crate::context::InFlight`], [`admit`] |
//! | 3 session | wait for the session's lock (before any capacity is taken), load its manifest | [`crate::session`] |
//! | 4 reserve | wait for the SKU's capacity, check again, write `running` | [`admit::reserve_and_start`] |
//! | 5 launch | a warm sandbox takes the job, or inputs staged and a cold sandbox started | [`launch`], [`crate::stage`], [`crate::warm`] |
//! | 6 run | the program to its end, a cancel, or shutdown | [`watch`], [`crate::run`] |
//! | 7 collect | artifacts, rich outputs, session saved, streams stored | [`collect`], [`crate::artifacts`], [`crate::outputs`] |
//! | 8 conclude | the result stored (compare-and-set) and the delivery's outcome decided | [`conclude`] |
//! | 9 clean up | job dir removed, capacity and session lock released | here |
//!
//! What the broker then does with the delivery (ack, requeue, dead-letter) is
//! [`crate::ack::classify`]'s, called by [`crate::consume`].

mod admit;
mod collect;
pub(crate) mod conclude;
mod launch;
mod watch;

use sandq_core::time::now_ms;
use sandq_schemas::ValidJob;
use tracing::{info, Instrument};

use self::admit::Admission;
use crate::ack::Outcome;
use crate::context::Context;
use crate::live::displays::Displays;
use crate::live::Live;
use crate::publish::Attempt;
use crate::{outputs, session, validate};

/// One delivery as the pipeline reads it, built by [`crate::consume`] from the broker's
/// (which keeps the acker: settling the delivery is its part).
#[derive(Debug, Clone)]
pub(crate) struct Message {
    /// The body as published (MessagePack; untrusted).
    pub body: Vec<u8>,
    /// The delivery's attempt number ([`crate::ack::attempt_number`] of its redelivered flag
    /// and `x-delivery-count` header): 1 for the first.
    pub attempt: u32,
    /// The AMQP `message_id` property: the job id of a body too large to read one from.
    pub message_id: Option<String>,
}

/// Processes one delivery, taken from the queue of SKU `queue` by consumer slot `slot` (which
/// picks the sandbox's user namespace range: [`crate::settings::Settings::id_map_for`]), to
/// its outcome. Never panics on bad input.
pub(crate) async fn process(ctx: &Context, message: &Message, queue: sandq_schemas::Sku, slot: usize) -> Outcome {
    // 1. Validate.
    let attempt = message.attempt;
    let job = match validate::validate(&message.body, &ctx.settings, queue) {
        Ok(job) => job,
        Err(e) => return conclude::reject_undecodable(ctx, message, &e.to_string()).await,
    };
    let span = tracing::info_span!("job", job_id = %job.spec.job_id, attempt, sku = %job.spec.sku);
    attempt_job(ctx, &job, attempt, slot).instrument(span).await
}

/// Steps 2 to 9 for a valid job (inside its span).
async fn attempt_job(ctx: &Context, job: &ValidJob, attempt: u32, slot: usize) -> Outcome {
    let mut who = Attempt {
        id: format!("a{:016x}", rand::random::<u64>()),
        slot,
        worker_id: ctx.settings.worker_id.clone(),
        number: attempt,
        started_at_ms: now_ms(),
    };
    // 2. Admit. The hold lasts until the attempt has ended (its result stored, its sandbox
    // gone), whichever way.
    let _held = ctx.in_flight.hold(&job.spec.job_id).await;
    let sku = match admit::admit(ctx, job, &who).await {
        Admission::Run(sku) => sku,
        Admission::Duplicate => {
            info!("job already has a terminal result; acking the duplicate");
            return Outcome::Stored;
        }
        Admission::Cancelled => {
            return conclude::conclude(ctx, job, &who, Err(conclude::Failure::Cancelled("cancelled before it started"))).await
        }
        Admission::Expired(result) => {
            info!("job expired in the queue");
            return conclude::store_or_retry(ctx, &result, job.result_ttl, attempt).await;
        }
        Admission::NotServed(result) => return conclude::store_or_retry(ctx, &result, job.result_ttl, attempt).await,
        Admission::Unreadable => return Outcome::Infrastructure { attempt, final_result_stored: false },
    };
    // Random, not derived from the job id: the container id names the job dir, and paths of
    // the host can leak into sandboxes; a job id is a capability (its result can be read, and a
    // duplicate submitted, by whoever knows it).
    let container_id = format!("j-{:032x}", rand::random::<u128>());
    info!(container_id, attempt_id = who.id, "container id");
    // The attempt's live events (best effort: crate::live), from its `attempt` event, sent
    // once it has written `running` (a delivery that waits, bounces or finds the job done
    // sends none).
    let mut live = Live::default();
    let uploaded = outputs::Uploaded::default();

    // 3. Session: its lock is held until the result is stored, then released whatever happened
    // (if this future is dropped, its lease frees it).
    let opened = match &job.spec.session {
        None => None,
        Some(name) => match session::open(ctx, name, &who.id).await {
            Ok(opened) => Some(opened),
            Err(e) => {
                let failure = admit::session_failure(ctx, job, e).await;
                return conclude::conclude(ctx, job, &who, Err(failure)).await;
            }
        },
    };
    let steps = async {
        let (mut reservation, mut leftover, mut lease) = (None, None, None);
        let ended = async {
            // 4. Reserve the SKU's capacity, then write `running`.
            if opened.is_some() {
                admit::recheck(ctx, job, "cancelled while it waited for its session").await?;
            }
            let reserved = reservation.insert(admit::reserve_and_start(ctx, job, sku, &mut who).await?);
            live = Live::start(
                ctx.live_redis.clone(),
                ctx.settings.names.events_key(&job.spec.job_id),
                ctx.settings.outputs.stream_max_bytes,
                (attempt, &who.id),
                // Alive as long as the job; the terminal result's `end` sets `result_ttl`.
                admit::live_ttl(ctx, job),
            );
            // 5. Launch. Once the sandbox started, its job dir is removed after the result is
            // out (step 9); before that, on a failure, it cleans up on drop.
            let (dir, launched) = launch::launch(ctx, job, sku, &who, &container_id, opened.as_ref(), reserved).await?;
            let dir = &*leftover.insert(dir);
            let launch::Launched { started, staged, restore, cell, handover, sandbox_uid, staged_ms, forked } = launched;
            let warm = handover.is_some();
            // The program's text goes live from here (what it printed before is sent too).
            started.stream_to(&live);
            live.started(warm);
            // A warm sandbox's user namespace range stays taken until its container is deleted
            // (step 9).
            let (handover, range) = handover.unzip();
            lease = range;
            // 6. Run (a notebook job's displays sent live as they come).
            let notebook = job.spec.run_mode() == sandq_schemas::RunMode::Notebook;
            let mut displays = (notebook && live.enabled()).then(|| Displays {
                live: &live,
                job_id: &job.spec.job_id,
                attempt_id: &who.id,
                out_dir: dir.out.clone(),
                caps: outputs::Caps::of(&ctx.settings.outputs),
                sink: outputs::Sink { s3: &ctx.s3, bucket: &ctx.settings.services.s3.bucket, uploaded: &uploaded },
                url_ttl: crate::publish::url_ttl(ctx.settings.outputs.artifact_url_ttl, job.result_ttl),
                tail: outputs::Tail::default(),
            });
            let ran = watch::run(ctx, job, dir, started, handover.as_ref(), &live, displays.as_mut()).await?;
            // 7. Collect.
            let launch = collect::Launch { sku, staged, restore, cell, sandbox_uid, warm, forked, staged_ms, uploaded: &uploaded };
            collect::result(ctx, job, &who, opened.as_ref(), dir, launch, ran).await
        }
        .await;
        // 8. Conclude: store the result (a terminal one closes the live events with `end`),
        // decide the delivery's outcome.
        let outcome = conclude::conclude(ctx, job, &who, ended).await;
        match &outcome {
            Outcome::Infrastructure { final_result_stored: false, .. } => live.requeued("infrastructure error"),
            Outcome::Interrupted => live.requeued("the worker shut down"),
            _ => {}
        }
        live.close().await;
        // 9. Clean up: the job dir goes once the result is out (tearing its filesystem down can
        // take seconds), with the job's capacity held until it is gone.
        if let Some(dir) = leftover {
            dir.remove().await;
        }
        drop(lease);
        drop(reservation);
        outcome
    };
    let outcome = match &opened {
        None => steps.await,
        Some(o) => tokio::select! {
            outcome = steps => outcome,
            () = session::keep(ctx, &o.name, &o.holder) => unreachable!("keep never returns"),
        },
    };
    if let Some(opened) = &opened {
        session::close(ctx, &opened.name, &opened.holder).await;
    }
    outcome
}
