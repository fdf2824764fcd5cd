//! The broker topology, declared idempotently by workers and submitters alike:
//!
//! - `<ns>.jobs`: durable direct exchange; routing key = SKU (`"M"`);
//! - `<ns>.jobs.<SKU>`: one durable quorum queue per SKU, bound with its SKU, with
//!   `x-delivery-limit` and `x-dead-letter-exchange = <ns>.dlx`;
//! - `<ns>.dlx` (fanout) and `<ns>.dead`: where poison messages end, with RabbitMQ's `x-death`
//!   header saying why (`delivery_limit`, `rejected`).
//!
//! Facts behind the arguments: `../shared/notes/queue-and-storage.md` (RabbitMQ 3.10 has no
//! default delivery limit; quorum queues reject global QoS).

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};
use sandq_schemas::names::Names;
use sandq_schemas::Sku;

/// Declares the exchanges and queues of every SKU. Safe to call any number of times with the
/// same `delivery_limit`.
///
/// # Errors
/// The broker's error, e.g. `PRECONDITION_FAILED` when a queue exists with other arguments.
pub async fn declare(channel: &Channel, names: &Names, delivery_limit: u32) -> Result<(), lapin::Error> {
    let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
    channel
        .exchange_declare(names.dead_letter_exchange().into(), ExchangeKind::Fanout, durable, FieldTable::default())
        .await?;
    let mut dead_args = FieldTable::default();
    dead_args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    channel
        .queue_declare(names.dead_letter_queue().into(), QueueDeclareOptions::durable(), dead_args)
        .await?;
    channel
        .queue_bind(
            names.dead_letter_queue().into(),
            names.dead_letter_exchange().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    channel
        .exchange_declare(names.jobs_exchange().into(), ExchangeKind::Direct, durable, FieldTable::default())
        .await?;
    for sku in Sku::ALL {
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
        args.insert("x-delivery-limit".into(), AMQPValue::LongInt(delivery_limit.try_into().unwrap_or(i32::MAX)));
        args.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(names.dead_letter_exchange().into()));
        channel.queue_declare(names.jobs_queue(sku).into(), QueueDeclareOptions::durable(), args).await?;
        channel
            .queue_bind(
                names.jobs_queue(sku).into(),
                names.jobs_exchange().into(),
                names.routing_key(sku).into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    Ok(())
}

/// Messages waiting in the dead-letter queue (a passive declare: nothing is created).
///
/// # Errors
/// The broker's error (`NOT_FOUND` when the topology was never declared).
pub async fn dead_letter_count(channel: &Channel, names: &Names) -> Result<u32, lapin::Error> {
    let queue = channel
        .queue_declare(
            names.dead_letter_queue().into(),
            QueueDeclareOptions { passive: true, ..Default::default() },
            FieldTable::default(),
        )
        .await?;
    Ok(queue.message_count())
}

/// Deletes the namespace's queues (jobs of every SKU and the dead-letter queue), with whatever
/// they hold; the exchanges stay. For test and load-test namespaces, never a live deployment.
///
/// # Errors
/// The broker's error.
pub async fn delete_queues(channel: &Channel, names: &Names) -> Result<(), lapin::Error> {
    for queue in Sku::ALL.iter().map(|s| names.jobs_queue(*s)).chain([names.dead_letter_queue()]) {
        channel.queue_delete(queue.into(), Default::default()).await?;
    }
    Ok(())
}
