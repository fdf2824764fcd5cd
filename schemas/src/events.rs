//! A job's live events as parsed: the fields of one entry of the Redis Stream
//! `<ns>:job:{<job_id>}:events` ([`crate::names::Names::events_key`]) and their fold into a
//! [`Transcript`]. The wire form (field names, types, caps, how to read and resume) is
//! docs/protocol.md "Live events"; `sandq_core::events` reads the stream and re-exports these
//! types, and the HTTP client parses the gateway's server-sent events into them.

use std::collections::BTreeMap;

use crate::Output;

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
