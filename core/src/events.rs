//! A job's live events: the Redis Stream `<ns>:job:{<job_id>}:events`
//! ([`sandq_schemas::names::Names::events_key`]), written best effort by the worker while the
//! job runs and closed by the `end` event the compare-and-set script appends with the terminal
//! result. The wire form (field names, types, caps, how to read and resume) is
//! docs/protocol.md "Live events"; this module is its Rust reading, shared by the worker (field
//! names) and the clients (parsing, reading, folding).

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::time::{Duration, Instant};

use futures::Stream;
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

/// How long each of [`follow`]'s reads waits for a first new event.
pub const FOLLOW_BLOCK: Duration = Duration::from_secs(5);

/// Where [`follow`] reads a job's events, and learns whether the job is over.
pub trait Pages {
    /// The events after `cursor` (a page, as [`read`]), waiting up to `block` for the first
    /// (`None`: not at all). `None` when the read failed: the source says so in its log (and
    /// makes a new connection on its next call), and [`follow`] tries again after its `retry`.
    fn page(&mut self, cursor: &str, block: Option<Duration>) -> impl Future<Output = Option<Vec<Event>>> + Send;

    /// Whether the job is over (by the source's rule: a terminal result, or also none at all),
    /// so that a wait with nothing new ends the stream once nothing is left to read.
    fn over(&mut self) -> impl Future<Output = bool> + Send;
}

/// A job's live events from after `cursor` ([`START`]: from the first) as they come
/// (docs/protocol.md "Live events"). The stream ends after the `end` event; or when a wait of
/// [`FOLLOW_BLOCK`] brought nothing, the job is over ([`Pages::over`]) and a last read finds
/// nothing more (a stream without `end`: expired, or written by an older worker); or, once
/// `until` has passed, before its next read. A failed read is tried again every `retry` from
/// the last event read, with no gap and no duplicate. To resume later, pass the last event's
/// `id`.
pub fn follow<P: Pages + Send>(pages: P, cursor: &str, retry: Duration, until: Option<Instant>) -> impl Stream<Item = Event> + Send {
    struct State<P> {
        pages: P,
        cursor: String,
        page: VecDeque<Event>,
        done: bool,
    }
    let state = State { pages, cursor: cursor.to_owned(), page: VecDeque::new(), done: false };
    futures::stream::unfold(state, move |mut s| async move {
        loop {
            if let Some(event) = s.page.pop_front() {
                s.cursor.clone_from(&event.id);
                if matches!(event.kind, EventKind::End { .. }) {
                    s.done = true;
                    s.page.clear();
                }
                return Some((event, s));
            }
            if s.done || until.is_some_and(|until| Instant::now() >= until) {
                return None;
            }
            match s.pages.page(&s.cursor, Some(FOLLOW_BLOCK)).await {
                Some(page) if !page.is_empty() => s.page.extend(page),
                Some(_) => {
                    if s.pages.over().await {
                        let rest = s.pages.page(&s.cursor, None).await.unwrap_or_default();
                        s.done = rest.is_empty();
                        s.page.extend(rest);
                    }
                }
                None => tokio::time::sleep(retry).await,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use futures::StreamExt as _;

    use super::*;

    /// A source that answers scripted pages (after checking the cursor and wait it is given)
    /// and scripted `over` answers.
    struct Script {
        pages: VecDeque<(&'static str, bool, Option<Vec<Event>>)>,
        over: VecDeque<bool>,
    }

    impl Pages for Script {
        async fn page(&mut self, cursor: &str, block: Option<Duration>) -> Option<Vec<Event>> {
            let (expected, blocks, page) = self.pages.pop_front().expect("no more reads expected");
            assert_eq!((cursor, block.is_some()), (expected, blocks), "read after {cursor}");
            page
        }

        async fn over(&mut self) -> bool {
            self.over.pop_front().expect("no more status checks expected")
        }
    }

    fn event(id: &str, kind: &str) -> Event {
        let mut fields = BTreeMap::from([(TYPE.to_owned(), kind.to_owned()), (ATTEMPT.to_owned(), "1".to_owned())]);
        if kind == "end" {
            fields.insert("status".into(), "succeeded".into());
        } else {
            fields.insert(DATA.into(), id.into());
        }
        Event::parse(id, fields)
    }

    fn ids(events: &[Event]) -> Vec<&str> {
        events.iter().map(|e| e.id.as_str()).collect()
    }

    #[tokio::test]
    async fn pages_are_read_after_the_last_event_and_end_stops_the_stream() {
        let script = Script {
            pages: VecDeque::from([
                (START, true, Some(vec![event("1-0", "stdout"), event("1-1", "stdout")])),
                ("1-1", true, None),
                ("1-1", true, Some(vec![])),
                ("1-1", true, Some(vec![event("2-0", "stdout"), event("3-0", "end"), event("4-0", "stdout")])),
            ]),
            over: VecDeque::from([false]),
        };
        let events: Vec<Event> = follow(script, START, Duration::ZERO, None).collect().await;
        // After `end`, nothing: not the rest of its page, and no further read.
        assert_eq!(ids(&events), ["1-0", "1-1", "2-0", "3-0"]);
    }

    #[tokio::test]
    async fn a_job_over_without_end_ends_once_a_last_read_finds_nothing() {
        let script = Script {
            pages: VecDeque::from([
                ("5-0", true, Some(vec![])),
                ("5-0", false, Some(vec![event("6-0", "stdout")])),
                ("6-0", true, Some(vec![])),
                ("6-0", false, Some(vec![])),
            ]),
            over: VecDeque::from([true, true]),
        };
        let events: Vec<Event> = follow(script, "5-0", Duration::ZERO, None).collect().await;
        assert_eq!(ids(&events), ["6-0"]);
    }

    #[tokio::test]
    async fn past_until_no_further_read_is_made() {
        let script = Script { pages: VecDeque::new(), over: VecDeque::new() };
        let until = Instant::now();
        let events: Vec<Event> = follow(script, START, Duration::ZERO, Some(until)).collect().await;
        assert!(events.is_empty(), "{events:?}");
    }
}
