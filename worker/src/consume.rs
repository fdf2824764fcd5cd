//! Where deliveries come from (before step 1 of `crate::job`): take deliveries from the SKU queues. One AMQP channel per job slot with prefetch 1
//! (so the worker's prefetch equals its slots, and a broker `consumer_timeout` closing one
//! channel cannot requeue another slot's job). The connection is re-made with backoff when the
//! broker goes away; deliveries in flight then come back as redeliveries (at-least-once).
//!
//! With several broker addresses (`amqp.urls`, the nodes of a cluster), a lost connection is
//! re-made to the next address first, then round-robin through the others
//! ([`sandq_core::broker::connect`]); the backoff applies between rounds. Every channel
//! and consumer is opened anew on the new connection: nothing of the old one (no delivery tag)
//! is used again.
//!
//! Before a delivery goes to [`crate::job`], [`crate::fair::take`] decides whose turn it is: a
//! first delivery of a tenant running more jobs of the SKU than another tenant with jobs waiting
//! is published again at the tail of its queue (confirmed on the slot's channel, which is in
//! confirm mode for that) and acked without running, as is a delivery a newer copy of it
//! superseded.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, Consumer};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{error, info, warn};

use crate::ack::{self, Disposition, Outcome};
use crate::context::Context;
use crate::metrics;
use crate::{fair, job};

/// Consumes until `shutdown` becomes true; then stops taking deliveries, lets every in-flight
/// job finish, and returns.
pub(crate) async fn run(ctx: Context, mut shutdown: watch::Receiver<bool>) {
    let mut backoff = Duration::from_millis(200);
    // Index (in `amqp.addresses()`) of the address to try first.
    let mut next = 0;
    loop {
        if *shutdown.borrow() {
            return;
        }
        let connected_at = std::time::Instant::now();
        let served = serve(&ctx, shutdown.clone(), &mut next).await;
        crate::health::set_broker(None);
        match served {
            Ok(()) => return,
            Err(e) => {
                metrics::infrastructure_error(metrics::ErrorKind::Broker);
                if connected_at.elapsed() > Duration::from_secs(30) {
                    backoff = Duration::from_millis(200);
                }
                error!(error = %e, "broker connection lost; reconnecting in {backoff:?}");
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    _ = shutdown.changed() => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
}

/// Connects (from address `next` on), declares the topology and runs every task until
/// shutdown or a broker failure; on return `next` is the address after the one used, so that a
/// reconnection tries another node first.
async fn serve(ctx: &Context, shutdown: watch::Receiver<bool>, next: &mut usize) -> Result<(), lapin::Error> {
    let settings = &ctx.settings;
    let addresses = settings.services.amqp.addresses();
    let properties = ConnectionProperties::default().with_connection_name(format!("sandq-worker {}", settings.worker_id).into());
    let (connection, index) = sandq_core::broker::connect(&addresses, *next, &properties).await?;
    // Shared with the dead-letter consumer, which opens short channels of its own on it.
    let connection = Arc::new(connection);
    *next = index + 1;
    let address = sandq_core::broker::redact(&addresses[index]);
    let declared = sandq_core::topology::declare(&connection, &settings.names, &settings.services).await?;
    for queue in &declared.with_other_arguments {
        warn!(
            queue,
            "queue exists with other arguments (declared by an earlier version?): using it as it is; \
             jobs nobody takes do not expire there (queues.unserved_ttl) until it is re-created or given a policy (docs/operations.md)"
        );
    }
    let mut slots = JoinSet::new();
    // Each consumer slot runs one job at a time, with the user namespace range of its index.
    let mut index = 0;
    for (sku, sku_settings) in &settings.skus {
        for slot in 0..sku_settings.slots {
            let task = Task::Slot { sku: *sku, slot, index };
            let run = open_slot(ctx, &connection, task, shutdown.clone()).await?;
            slots.spawn(run);
            index += 1;
        }
    }
    // Every worker also gives dead-lettered jobs their terminal result; the consumer ends with
    // the slots (Ok on shutdown, Err on a broker failure).
    let job_slots = slots.len();
    slots.spawn(open_slot(ctx, &connection, Task::DeadLetters, shutdown.clone()).await?);
    crate::health::set_broker(Some(connection.status().clone()));
    info!(worker_id = %settings.worker_id, slots = job_slots, broker = %address, "consuming");
    // A task that ends with an error while the connection stands lost only its channel (the
    // broker closed it: a consumer_timeout, say): that one is reopened, the other slots' jobs
    // go on (test: a_channel_closed_by_the_broker_is_reopened_alone_and_the_job_runs_once in
    // tests/channel_close.rs). When the connection is gone, everything is dropped and the
    // worker reconnects. Ok on shutdown (wait for the others to finish their job).
    let mut outcome = Ok(());
    while let Some(joined) = slots.join_next().await {
        match joined {
            Ok((_, Ok(()))) => {}
            Ok((task, Err(e))) if !*shutdown.borrow() && connection.status().connected() => {
                warn!(error = %e, ?task, "a channel closed; reopening it alone");
                match open_slot(ctx, &connection, task, shutdown.clone()).await {
                    Ok(run) => {
                        slots.spawn(run);
                    }
                    Err(e) => {
                        outcome = Err(e);
                        slots.abort_all();
                    }
                }
            }
            Ok((_, Err(e))) => {
                outcome = Err(e);
                if !*shutdown.borrow() {
                    slots.abort_all();
                }
            }
            Err(e) if e.is_cancelled() => {}
            Err(e) => error!(error = %e, "slot task failed"),
        }
    }
    if outcome.is_ok() {
        // Bounded: a broker that does not answer the close must not hold the worker's exit.
        let _ = tokio::time::timeout(Duration::from_secs(5), connection.close(200, "worker shutting down".into())).await;
    }
    info!("consumers stopped");
    outcome
}

/// What a task of [`serve`] consumes: a job slot of a SKU (its slot number and user namespace
/// range index), or the dead-letter queue.
#[derive(Debug, Clone, Copy)]
enum Task {
    Slot { sku: sandq_schemas::Sku, slot: usize, index: usize },
    DeadLetters,
}

type TaskRun = std::pin::Pin<Box<dyn std::future::Future<Output = (Task, Result<(), lapin::Error>)> + Send>>;

/// Opens `task`'s channel and consumer on `connection`; returns the future that runs it.
async fn open_slot(
    ctx: &Context,
    connection: &Arc<Connection>,
    task: Task,
    shutdown: watch::Receiver<bool>,
) -> Result<TaskRun, lapin::Error> {
    let settings = &ctx.settings;
    let channel = connection.create_channel().await?;
    let ctx = ctx.clone();
    match task {
        Task::Slot { sku, slot, index } => {
            channel.basic_qos(1, BasicQosOptions::default()).await?;
            // Confirms for the copies of jobs sent round the queue (crate::fair): a delivery
            // is acked only once its copy is confirmed.
            channel.confirm_select(ConfirmSelectOptions::default()).await?;
            let tag = format!("{}-{}-{}", settings.worker_id, sku, slot);
            let consumer = channel
                .basic_consume(
                    settings.names.jobs_queue(sku).into(),
                    tag.clone().into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            Ok(Box::pin(async move { (task, slot_loop(ctx, (sku, index), consumer, shutdown, channel, tag).await) }))
        }
        Task::DeadLetters => {
            let connection = Arc::clone(connection);
            Ok(Box::pin(async move { (task, crate::dead_letter::run(ctx, channel, connection, shutdown).await) }))
        }
    }
}

async fn slot_loop(
    ctx: Context,
    (sku, index): (sandq_schemas::Sku, usize),
    mut consumer: Consumer,
    mut shutdown: watch::Receiver<bool>,
    channel: lapin::Channel,
    tag: String,
) -> Result<(), lapin::Error> {
    loop {
        let Some(delivery) = ack::next_delivery(&mut consumer, &mut shutdown, "consumer cancelled").await? else {
            return Ok(());
        };
        let lapin::message::Delivery { data, acker, redelivered, properties, .. } = delivery;
        let attempt = ack::attempt_number(properties.headers().as_ref(), redelivered);
        // Whose turn is it? Another tenant's: the job's copy is at the tail of the queue, and
        // this delivery is acked without running; so is one superseded by a copy (a failed ack
        // of it comes back: the round recorded before the ack marks it superseded).
        let taken = fair::Delivery { sku, body: &data, properties: &properties, attempt, redelivered };
        let running = match fair::take(&ctx, &channel, &taken).await {
            fair::Taken::Run(running) => running,
            fair::Taken::Rotated | fair::Taken::Superseded => {
                if let Err(e) = ack::settle(&acker, Disposition::Ack).await {
                    warn!(error = %e, "cannot ack a delivery whose copy went round the queue; the broker will redeliver it");
                    return Err(e);
                }
                continue;
            }
        };
        let message = job::Message { body: data, attempt, message_id: properties.message_id().as_ref().map(ToString::to_string) };
        let tracker = metrics::Tracker::new(sku, redelivered);
        // A panic in one job is caught here, at the job boundary; the job is requeued.
        let processed = tracker.scope(AssertUnwindSafe(job::process(&ctx, &message, sku, index)).catch_unwind()).await;
        let outcome = processed.as_ref().map_or_else(
            |_| {
                error!("job processing panicked; requeueing");
                Outcome::Infrastructure { attempt: 0, final_result_stored: false }
            },
            Clone::clone,
        );
        tracker.settled(&outcome, processed.is_err());
        let disposition = ack::classify(&outcome, ctx.settings.max_attempts);
        if let Some(running) = running {
            running.end(&ctx, disposition == Disposition::Requeue).await;
        }
        if let (Disposition::Requeue, Outcome::Infrastructure { attempt, .. }) = (disposition, &outcome) {
            // Back off before handing the job back: a storage outage must not burn its
            // attempts in a tight loop (1 s, 2 s, 4 s ... at most 30 s).
            let delay = Duration::from_secs(1u64 << attempt.saturating_sub(1).min(5)).min(Duration::from_secs(30));
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                _ = shutdown.changed() => {}
            }
        }
        if *shutdown.borrow() {
            // Stop this consumer before settling, so that a requeued job is not handed straight
            // back to a worker that is going away.
            let _ = tokio::time::timeout(Duration::from_secs(5), channel.basic_cancel(tag.as_str().into(), BasicCancelOptions::default()))
                .await;
        }
        // While shutting down the settlement is bounded: a channel the broker is closing must
        // not hold the worker's exit (an unsent ack is a redelivery, which finds the job's
        // terminal result and does not run it again).
        let settled = if *shutdown.borrow() {
            tokio::time::timeout(Duration::from_secs(10), ack::settle(&acker, disposition)).await.unwrap_or_else(|_| {
                warn!(?disposition, "settling a delivery took over 10 s while shutting down; the broker will redeliver it");
                Ok(())
            })
        } else {
            ack::settle(&acker, disposition).await
        };
        if let Err(e) = settled {
            warn!(error = %e, ?disposition, "cannot settle delivery; the broker will redeliver it");
            return Err(e);
        }
        if *shutdown.borrow() {
            return Ok(());
        }
    }
}
