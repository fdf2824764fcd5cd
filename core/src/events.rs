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
use sandq_schemas::Output;

use crate::redis_conn::RedisConn;

/// The stream's approximate length cap (`XADD ... MAXLEN ~ 10000`, also in the
/// compare-and-set script): a job printing every 50 ms for the 15 min maximum timeout makes
/// at most 18,000 chunk events per stream, so only a long, slow printer loses its oldest.
pub const MAX_LEN: usize = 10_000;

/// Field: the event's type.
pub const TYPE: &str = "type";
/// Field: the delivery attempt (decimal, from 1).
pub const ATTEMPT: &str = "attempt";
/// Field: the event's number within its attempt (decimal, from 0; absent on `end`).
pub const SEQ: &str = "seq";
/// Field: text of a chunk, JSON of a display.
pub const DATA: &str = "data";

/// The cursor of a whole stream: `XREAD` from it returns the first entry on.
pub const START: &str = "0-0";

/// One entry of a job's event stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// The stream entry's id (`<ms>-<n>`): the cursor to resume after this event.
    pub id: String,
    /// The delivery attempt it belongs to (from 1; 0 when the field is missing or malformed).
    pub attempt: u32,
    /// Its number within the attempt; `None` on `end` (and when malformed).
    pub seq: Option<u64>,
    /// What it says.
    pub kind: EventKind,
}

/// What an event says (docs/protocol.md "Live events", by type).
#[derive(Debug, Clone, PartialEq)]
pub enum EventKind {
    /// `attempt`: an attempt began; a later one means the earlier was abandoned.
    Attempt {
        /// The attempt's id (`a<16 hex>`), as in the result's S3 keys.
        attempt_id: String,
    },
    /// `status` `started`: the program started, in a warm sandbox or a cold one.
    Started {
        /// A warm sandbox took the job.
        warm: bool,
    },
    /// `status` `finished`: the program ended.
    Finished {
        /// Its exit code; `None` when it was killed (timeout, OOM, cancel).
        exit_code: Option<i32>,
    },
    /// `status` `queued`: the attempt failed on infrastructure and the job was requeued.
    Requeued {
        /// Why.
        reason: String,
    },
    /// `stdout`: a chunk of text, at most 8 KiB, cut on a character boundary.
    Stdout(String),
    /// `stderr`: as [`EventKind::Stdout`].
    Stderr(String),
    /// `display`: a rich output as soon as it was displayed.
    Display {
        /// Its index in the result's `outputs`.
        index: u64,
        /// The output; `None` when its JSON did not parse (a newer worker's shape).
        output: Option<Box<Output>>,
    },
    /// `truncated`: the attempt's cap for `stream` (`stdout`, `stderr`, `display`) was reached.
    Truncated {
        /// Which kind stops being streamed.
        stream: String,
        /// The cap, bytes (events for `display`).
        limit: u64,
    },
    /// `end`: the job is over; its terminal result is stored.
    End {
        /// The terminal status's wire name (`succeeded`, `failed`...).
        status: String,
    },
    /// A type this client does not know (ignore it), or a `status` with another `state`.
    Other {
        /// The `type` field.
        kind: String,
        /// Every field, as sent.
        fields: BTreeMap<String, String>,
    },
}

impl Event {
    /// Reads one stream entry (`id`, its field/value pairs). Never fails: what it cannot read is
    /// [`EventKind::Other`], a missing number 0 or `None`.
    pub fn parse(id: impl Into<String>, fields: BTreeMap<String, String>) -> Event {
        let get = |name: &str| fields.get(name).cloned().unwrap_or_default();
        let attempt = fields.get(ATTEMPT).and_then(|a| a.parse().ok()).unwrap_or(0);
        let seq = fields.get(SEQ).and_then(|s| s.parse().ok());
        let kind = match (fields.get(TYPE).map(String::as_str).unwrap_or(""), fields.get("state").map(String::as_str)) {
            ("attempt", _) => EventKind::Attempt { attempt_id: get("attempt_id") },
            ("status", Some("started")) => EventKind::Started { warm: fields.get("warm").is_some_and(|w| w == "true") },
            ("status", Some("finished")) => EventKind::Finished { exit_code: fields.get("exit_code").and_then(|c| c.parse().ok()) },
            ("status", Some("queued")) => EventKind::Requeued { reason: get("reason") },
            ("stdout", _) => EventKind::Stdout(get(DATA)),
            ("stderr", _) => EventKind::Stderr(get(DATA)),
            ("display", _) => EventKind::Display {
                index: fields.get("index").and_then(|i| i.parse().ok()).unwrap_or(0),
                output: serde_json::from_str(&get(DATA)).ok().map(Box::new),
            },
            ("truncated", _) => {
                EventKind::Truncated { stream: get("stream"), limit: fields.get("limit").and_then(|l| l.parse().ok()).unwrap_or(0) }
            }
            ("end", _) => EventKind::End { status: get("status") },
            (other, _) => EventKind::Other { kind: other.to_owned(), fields: fields.clone() },
        };
        Event { id: id.into(), attempt, seq, kind }
    }
}

/// What a reader makes of a job's events so far (docs/protocol.md "Live events"): the text
/// and displays of the newest attempt, the gaps, the caps reached, the end.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Transcript {
    /// Attempts seen, in order.
    pub attempts: Vec<u32>,
    /// stdout of the newest attempt: its chunks concatenated.
    pub stdout: String,
    /// stderr of the newest attempt.
    pub stderr: String,
    /// Displays of the newest attempt, in order: (index, output).
    pub displays: Vec<(u64, Option<Box<Output>>)>,
    /// (attempt, seq) of events the worker dropped, before the last one seen of each attempt.
    pub missing: Vec<(u32, u64)>,
    /// Kinds whose cap was reached in the newest attempt.
    pub truncated: Vec<String>,
    /// The terminal status, once `end` was read.
    pub status: Option<String>,
    /// The cursor to resume from: the last event's id.
    pub last_id: Option<String>,
    next_seq: BTreeMap<u32, u64>,
}

impl Transcript {
    /// The newest attempt seen (0 before any).
    pub fn attempt(&self) -> u32 {
        self.attempts.last().copied().unwrap_or(0)
    }

    /// Folds one event in.
    pub fn push(&mut self, event: &Event) {
        self.last_id = Some(event.id.clone());
        if event.attempt > self.attempt() {
            // A new attempt: what the previous one printed is not in the result.
            self.attempts.push(event.attempt);
            self.stdout.clear();
            self.stderr.clear();
            self.displays.clear();
            self.truncated.clear();
        }
        if let Some(seq) = event.seq {
            let next = self.next_seq.entry(event.attempt).or_insert(0);
            self.missing.extend((*next..seq).map(|s| (event.attempt, s)));
            *next = (*next).max(seq + 1);
        }
        if let EventKind::End { status } = &event.kind {
            // The job's end whatever attempt it names (one written for the job as a whole,
            // by the dead-letter consumer, may carry none).
            self.status = Some(status.clone());
            return;
        }
        if event.attempt < self.attempt() {
            return; // a straggler of an abandoned attempt
        }
        match &event.kind {
            EventKind::Stdout(text) => self.stdout.push_str(text),
            EventKind::Stderr(text) => self.stderr.push_str(text),
            EventKind::Display { index, output } => self.displays.push((*index, output.clone())),
            EventKind::Truncated { stream, .. } => self.truncated.push(stream.clone()),
            _ => {}
        }
    }
}

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
