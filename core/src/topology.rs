//! The broker topology, declared idempotently by workers and submitters alike:
//!
//! - `<ns>.jobs`: durable direct exchange; routing key = SKU (`"M"`);
//! - `<ns>.jobs.<SKU>`: one durable quorum queue per SKU, bound with its SKU, with
//!   `x-delivery-limit`, `x-dead-letter-exchange = <ns>.dlx` and `x-message-ttl` (config
//!   `queues.unserved_ttl`: a job no worker takes within it is dead-lettered);
//! - `<ns>.dlx` (fanout) and `<ns>.dead`: where dead-lettered messages go, with RabbitMQ's
//!   `x-death` header saying why (`delivery_limit`, `rejected`, `expired`); every worker
//!   consumes `<ns>.dead` and writes the terminal result of each job found there
//!   (`sandq_worker::dead_letter`).
//!
//! Facts behind the arguments: RabbitMQ 3.10 has no default delivery limit (so
//! `x-delivery-limit` is always set), and quorum queues reject global QoS (consumers set a
//! per-consumer prefetch).

use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ErrorKind, ExchangeKind};
use sandq_schemas::names::Names;
use sandq_schemas::Sku;

use crate::config::ServiceConfig;

/// The arguments of every SKU queue: `x-queue-type = quorum`, `x-delivery-limit`,
/// `x-dead-letter-exchange = <ns>.dlx` and, unless `unserved_ttl` is zero, `x-message-ttl` (a
/// job no worker takes within it is dead-lettered with reason `expired`, and a worker's
/// dead-letter consumer gives it its `expired` result).
pub fn queue_arguments(names: &Names, delivery_limit: u32, unserved_ttl: Duration) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    args.insert("x-delivery-limit".into(), AMQPValue::LongInt(delivery_limit.try_into().unwrap_or(i32::MAX)));
    args.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(names.dead_letter_exchange().into()));
    if !unserved_ttl.is_zero() {
        let ms = i64::try_from(unserved_ttl.as_millis()).unwrap_or(i64::MAX);
        args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ms));
    }
    args
}

/// What [`declare`] found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Declared {
    /// SKU queues that already existed with other arguments (declared by an earlier version of
    /// sandq, without `x-message-ttl`, or with another delivery limit or TTL): the broker keeps
    /// a queue's arguments for its life, so these run with their old ones. They are used as
    /// they are; `docs/operations.md` says how to move them to the new arguments (a policy, or
    /// re-creating the queue when empty).
    pub with_other_arguments: Vec<String>,
}

fn precondition_failed(error: &lapin::Error) -> bool {
    matches!(error.kind(), ErrorKind::ProtocolError(e) if e.get_id() == 406)
}

/// Whether the broker answered `404 NOT_FOUND` (a passive declare of a queue that does not
/// exist; the broker closes the channel).
pub fn not_found(error: &lapin::Error) -> bool {
    matches!(error.kind(), ErrorKind::ProtocolError(e) if e.get_id() == 404)
}

/// Declares the exchanges and queues of every SKU with the arguments of
/// [`queue_arguments`] from `config` (`amqp.delivery_limit`, `queues.unserved_ttl`). Safe to
/// call any number of times. A SKU queue that exists with other arguments (the broker answers
/// `PRECONDITION_FAILED` and closes the channel) is checked to exist and used as it is, and
/// reported in [`Declared::with_other_arguments`]: a worker or client of this version works
/// against a deployment whose queues an earlier one declared.
///
/// Every declaration is first sent at once without waiting for its answer (`nowait`), then a
/// passive declare waits for the broker: one round trip instead of 15 (a one-shot CLI spent
/// ~15 ms of its ~70 here). Whatever fails that way (a queue with other arguments, a broker
/// that refuses `nowait`) is declared again one step at a time.
///
/// # Errors
/// The broker's error (connection lost, permissions).
pub async fn declare(connection: &Connection, names: &Names, config: &ServiceConfig) -> Result<Declared, lapin::Error> {
    match declare_pipelined(connection, names, config).await {
        Ok(()) => Ok(Declared::default()),
        Err(_) => declare_stepwise(connection, names, config).await,
    }
}

/// [`declare`]'s first try: every declaration and binding with `nowait`, in order on one
/// channel, then a passive declare of the last queue. The broker handles a channel's methods
/// in order and closes the channel at the first that fails, so the passive declare's answer
/// means every one before it succeeded.
async fn declare_pipelined(connection: &Connection, names: &Names, config: &ServiceConfig) -> Result<(), lapin::Error> {
    let channel = connection.create_channel().await?;
    let exchange = ExchangeDeclareOptions { durable: true, nowait: true, ..Default::default() };
    let queue = QueueDeclareOptions { durable: true, nowait: true, ..Default::default() };
    let bind = QueueBindOptions { nowait: true };
    channel.exchange_declare(names.dead_letter_exchange().into(), ExchangeKind::Fanout, exchange, FieldTable::default()).await?;
    let mut dead_args = FieldTable::default();
    dead_args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    channel.queue_declare(names.dead_letter_queue().into(), queue, dead_args).await?;
    channel
        .queue_bind(names.dead_letter_queue().into(), names.dead_letter_exchange().into(), "".into(), bind, FieldTable::default())
        .await?;
    channel.exchange_declare(names.jobs_exchange().into(), ExchangeKind::Direct, exchange, FieldTable::default()).await?;
    for sku in Sku::ALL {
        let name = names.jobs_queue(sku);
        let args = queue_arguments(names, config.amqp.delivery_limit, config.queues.unserved_ttl);
        channel.queue_declare(name.as_str().into(), queue, args).await?;
        channel
            .queue_bind(name.as_str().into(), names.jobs_exchange().into(), names.routing_key(sku).into(), bind, FieldTable::default())
            .await?;
    }
    let last = names.jobs_queue(Sku::ALL[Sku::ALL.len() - 1]);
    channel.queue_declare(last.as_str().into(), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default()).await?;
    let _ = channel.close(200, "topology declared".into()).await;
    Ok(())
}

/// [`declare`] one step at a time, each answered before the next.
async fn declare_stepwise(connection: &Connection, names: &Names, config: &ServiceConfig) -> Result<Declared, lapin::Error> {
    let mut channel = connection.create_channel().await?;
    let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
    channel.exchange_declare(names.dead_letter_exchange().into(), ExchangeKind::Fanout, durable, FieldTable::default()).await?;
    let mut dead_args = FieldTable::default();
    dead_args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    channel.queue_declare(names.dead_letter_queue().into(), QueueDeclareOptions::durable(), dead_args).await?;
    channel
        .queue_bind(
            names.dead_letter_queue().into(),
            names.dead_letter_exchange().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    channel.exchange_declare(names.jobs_exchange().into(), ExchangeKind::Direct, durable, FieldTable::default()).await?;
    let mut declared = Declared::default();
    for sku in Sku::ALL {
        let queue = names.jobs_queue(sku);
        let args = queue_arguments(names, config.amqp.delivery_limit, config.queues.unserved_ttl);
        match channel.queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), args).await {
            Ok(_) => {}
            Err(e) if precondition_failed(&e) => {
                // The broker closed the channel: check on a new one that the queue exists.
                channel = connection.create_channel().await?;
                let passive = QueueDeclareOptions { passive: true, ..Default::default() };
                channel.queue_declare(queue.as_str().into(), passive, FieldTable::default()).await?;
                declared.with_other_arguments.push(queue.clone());
            }
            Err(e) => return Err(e),
        }
        channel
            .queue_bind(
                queue.as_str().into(),
                names.jobs_exchange().into(),
                names.routing_key(sku).into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    let _ = channel.close(200, "topology declared".into()).await;
    Ok(declared)
}

/// Declares a SKU queue as versions before the unserved-job TTL did (no `x-message-ttl`), for
/// tests of deployments whose queues an earlier version declared.
///
/// # Errors
/// The broker's error.
pub async fn declare_legacy_queue(channel: &Channel, names: &Names, sku: Sku, delivery_limit: u32) -> Result<(), lapin::Error> {
    let args = queue_arguments(names, delivery_limit, Duration::ZERO);
    channel.queue_declare(names.jobs_queue(sku).into(), QueueDeclareOptions::durable(), args).await?;
    Ok(())
}

/// Messages waiting in the dead-letter queue (a passive declare: nothing is created).
///
/// # Errors
/// The broker's error (`NOT_FOUND` when the topology was never declared).
pub async fn dead_letter_count(channel: &Channel, names: &Names) -> Result<u32, lapin::Error> {
    let queue = channel
        .queue_declare(names.dead_letter_queue().into(), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default())
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
