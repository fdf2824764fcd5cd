//! A job's live events: the Redis Stream `<ns>:job:{<job_id>}:events`
//! ([`sandq_schemas::names::Names::events_key`]), written best effort by the worker while the
//! job runs and closed by the `end` event the compare-and-set script appends with the terminal
//! result. The wire form (field names, types, caps, how to read and resume) is
//! docs/protocol.md "Live events"; this module is its Rust reading, shared by the worker (field
//! names) and the clients (parsing, reading, folding).

use std::collections::BTreeMap;
use std::time::Duration;

use redis::streams::StreamReadReply;
pub use sandq_schemas::events::{Event, EventKind, Transcript, ATTEMPT, DATA, MAX_LEN, SEQ, START, TYPE};

use crate::redis_conn::RedisConn;

/// Reads the events after `cursor` (at most `count`), waiting up to `block` for the first
/// when there are none yet (`None`: do not wait). An empty list: nothing new in time.
/// `XREAD BLOCK` holds its connection: give a blocking read a connection of its own
/// ([`crate::redis_conn::RedisTarget::connect_blocking`]), with a response time-out longer
/// than `block`.
///
/// # Errors
/// Redis's.
pub async fn read(redis: &mut RedisConn, key: &str, cursor: &str, count: usize, block: Option<Duration>) -> redis::RedisResult<Vec<Event>> {
    let mut cmd = redis::cmd("XREAD");
    cmd.arg("COUNT").arg(count.max(1));
    if let Some(block) = block {
        cmd.arg("BLOCK").arg(block.as_millis().max(1) as u64);
    }
    cmd.arg("STREAMS").arg(key).arg(cursor);
    let reply: Option<StreamReadReply> = cmd.query_async(redis).await?;
    let mut events = Vec::new();
    for stream in reply.map(|r| r.keys).unwrap_or_default() {
        for entry in stream.ids {
            let fields = entry
                .map
                .into_iter()
                .filter_map(|(k, v)| redis::from_redis_value::<String>(v).ok().map(|v| (k, v)))
                .collect::<BTreeMap<_, _>>();
            events.push(Event::parse(entry.id, fields));
        }
    }
    Ok(events)
}
