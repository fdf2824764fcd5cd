//! Live events: what a job prints and displays reaches its Redis Stream while it runs
//! (docs/protocol.md "Live events"; the reading side is [`sandq_core::events`]).
//!
//! Best effort by construction: the capture tasks hand text to a bounded buffer
//! ([`PENDING_MAX`] per stream, never waiting), lifecycle and display events go through a
//! bounded channel ([`QUEUE`], `try_send`), and one publisher task per attempt sends them with
//! a time-out ([`SEND_TIMEOUT`]). When Redis is slow or down, events are dropped (a `seq` gap
//! says so) and the job goes on: nothing of the job waits on Redis but [`Live::flush`], which
//! is bounded ([`FLUSH_WAIT`]). The result stays complete and authoritative.

pub(crate) mod displays;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sandq_core::events::{ATTEMPT, DATA, MAX_LEN, SEQ, TYPE};
use sandq_core::redis_conn::RedisConn;
use tokio::sync::{mpsc, oneshot, Notify};

/// Longest text chunk event, bytes (plus at most 3 of a character cut short): the issue's
/// "every ~50 ms or ~8 KiB".
pub(crate) const CHUNK: usize = 8 << 10;
/// How often pending text is sent.
pub(crate) const COALESCE: Duration = Duration::from_millis(50);
/// Text pending per stream, bytes: what a stalled Redis can make the worker hold (beyond it
/// the bytes are dropped and the next event's `seq` skips one). As large as the default
/// `stream_max_bytes`, so that one read of a fast printer (capture reads up to 1 MiB) is
/// streamed whole.
pub(crate) const PENDING_MAX: usize = 1 << 20;
/// Lifecycle and display events pending; beyond, dropped.
pub(crate) const QUEUE: usize = 256;
/// Longest wait for one send to Redis.
pub(crate) const SEND_TIMEOUT: Duration = Duration::from_secs(1);
/// Longest wait for the stream to catch up at the end of the run, before the result is stored
/// (whose `end` event must follow the output).
pub(crate) const FLUSH_WAIT: Duration = Duration::from_secs(2);
/// Most `display` events per attempt (the result keeps up to `worker.max_outputs`).
pub(crate) const MAX_DISPLAYS: u64 = 100;
/// Most bytes of `display` events' JSON per attempt: with text inline up to
/// [`crate::outputs::INLINE_BUDGET`] a job (larger values go to S3, as in the result), a
/// display is small; this bounds what a hostile outputs file can put in Redis and in the queue.
pub(crate) const DISPLAY_BYTES: u64 = 1 << 20;

/// The two text streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Text {
    /// stdout.
    Stdout = 0,
    /// stderr.
    Stderr = 1,
}

impl Text {
    fn name(self) -> &'static str {
        match self {
            Text::Stdout => "stdout",
            Text::Stderr => "stderr",
        }
    }
}

/// One stream's text waiting to be sent.
#[derive(Debug, Default)]
struct Pending {
    bytes: Vec<u8>,
    /// Bytes were dropped since the last send (the buffer was full).
    overflowed: bool,
}

/// What the capture tasks and the publisher share.
#[derive(Debug)]
struct Shared {
    text: [Mutex<Pending>; 2],
    /// Bytes of text still allowed this attempt (`outputs.stream_max_bytes`).
    budget: AtomicU64,
    /// The budget ran out: one `truncated` event per stream that hit it.
    exhausted: [AtomicBool; 2],
    limit: u64,
    /// Events dropped before the publisher saw them (the queue was full): the next sent
    /// event's `seq` skips as many.
    lost: AtomicU64,
    wake: Notify,
}

/// An event for the publisher, other than text.
#[derive(Debug)]
enum Control {
    /// Fields after `type`, `attempt`, `seq`; with `true`, all the text pending goes first (a
    /// character cut short included).
    Event(&'static str, Vec<(&'static str, String)>, bool),
    /// Send everything pending, then answer.
    Flush(oneshot::Sender<()>),
}

/// A handle on one attempt's live events; cheap to clone. A disabled one
/// (`outputs.stream_max_bytes = 0`) does nothing.
#[derive(Debug, Clone, Default)]
pub(crate) struct Live {
    inner: Option<(Arc<Shared>, mpsc::Sender<Control>)>,
    displays: Arc<AtomicU64>,
    /// Bytes of display JSON still allowed this attempt ([`DISPLAY_BYTES`]).
    display_bytes: Arc<AtomicU64>,
    /// The publisher, stopped by [`Live::close`].
    task: Arc<Mutex<Option<tokio::task::JoinHandle<()>>>>,
}

impl Live {
    /// Starts the publisher of attempt `attempt` (`attempt_id`) of a job, to its stream `key`
    /// on `redis`, which expires after `ttl`, carrying at most `limit` bytes of text (0: no
    /// live events), and sends the `attempt` event.
    pub(crate) fn start(redis: RedisConn, key: String, limit: u64, (attempt, attempt_id): (u32, &str), ttl: Duration) -> Live {
        if limit == 0 {
            return Live::default();
        }
        let shared = Arc::new(Shared {
            text: Default::default(),
            budget: AtomicU64::new(limit),
            exhausted: Default::default(),
            limit,
            lost: AtomicU64::new(0),
            wake: Notify::new(),
        });
        let (tx, rx) = mpsc::channel(QUEUE);
        let publisher = Publisher {
            redis,
            key,
            attempt: attempt.to_string(),
            ttl_s: (ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0)).max(1),
            seq: 0,
            carry: Default::default(),
            truncated: [false; 2],
            sent_text: 0,
            shared: shared.clone(),
        };
        let task = tokio::spawn(publisher.run(rx));
        let live = Live {
            inner: Some((shared, tx)),
            displays: Arc::default(),
            display_bytes: Arc::new(AtomicU64::new(DISPLAY_BYTES)),
            task: Arc::new(Mutex::new(Some(task))),
        };
        live.event("attempt", vec![("attempt_id", attempt_id.to_owned())]);
        live
    }

    fn event(&self, kind: &'static str, fields: Vec<(&'static str, String)>) {
        self.send(Control::Event(kind, fields, false));
    }

    fn send(&self, control: Control) {
        if let Some((shared, tx)) = &self.inner {
            if tx.try_send(control).is_err() {
                shared.lost.fetch_add(1, Ordering::Relaxed);
                crate::metrics::live_events("dropped", 1);
            }
        }
    }

    /// `status` `started`.
    pub(crate) fn started(&self, warm: bool) {
        self.event("status", vec![("state", "started".into()), ("warm", warm.to_string())]);
    }

    /// `status` `finished`, with the exit code when the program exited, after all the text.
    pub(crate) fn finished(&self, exit_code: Option<i32>) {
        let mut fields = vec![("state", "finished".to_owned())];
        fields.extend(exit_code.map(|c| ("exit_code", c.to_string())));
        self.send(Control::Event("status", fields, true));
    }

    /// `status` `queued`: this attempt failed on infrastructure and the job goes back to the
    /// queue.
    pub(crate) fn requeued(&self, reason: &str) {
        self.event("status", vec![("state", "queued".into()), ("reason", reason.to_owned())]);
    }

    /// A `display` event (`json`: the output as the result has it); past [`MAX_DISPLAYS`], one
    /// `truncated` event instead. Returns false when the cap was reached (nothing more to send).
    /// Past [`DISPLAY_BYTES`] of JSON, the same.
    pub(crate) fn display(&self, index: usize, json: String) -> bool {
        let len = json.len() as u64;
        let fits = self.display_bytes.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| left.checked_sub(len)).is_ok();
        let n = if fits { self.displays.fetch_add(1, Ordering::Relaxed) } else { self.displays.swap(MAX_DISPLAYS + 1, Ordering::Relaxed) };
        if fits && n < MAX_DISPLAYS {
            self.event("display", vec![("index", index.to_string()), (DATA, json)]);
            true
        } else {
            if n <= MAX_DISPLAYS {
                self.event("truncated", vec![("stream", "display".into()), ("limit", MAX_DISPLAYS.to_string())]);
            }
            false
        }
    }

    /// Whether events are published at all.
    pub(crate) fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Hands text the program wrote to the publisher (from the capture tasks): never waits,
    /// copies at most the attempt's budget and [`PENDING_MAX`] pending.
    pub(crate) fn text(&self, stream: Text, bytes: &[u8]) {
        let Some((shared, _)) = &self.inner else { return };
        let i = stream as usize;
        if shared.exhausted[i].load(Ordering::Relaxed) {
            return;
        }
        let want = bytes.len() as u64;
        let granted = shared.budget.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| Some(left.saturating_sub(want))).unwrap_or(0);
        let take = granted.min(want) as usize;
        let full = {
            let mut pending = shared.text[i].lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let room = PENDING_MAX.saturating_sub(pending.bytes.len());
            pending.bytes.extend_from_slice(&bytes[..take.min(room)]);
            pending.overflowed |= take > room;
            // Under the lock: the publisher sees the last bytes before it sees the cap reached.
            if take < bytes.len() {
                shared.exhausted[i].store(true, Ordering::Relaxed);
            }
            pending.bytes.len() >= CHUNK
        };
        if full || take < bytes.len() {
            shared.wake.notify_one();
        }
    }

    /// Sends everything pending and waits until it is out, at most [`FLUSH_WAIT`]: called at
    /// the end of the run, so that the output comes before the `end` event the result's write
    /// appends.
    pub(crate) async fn flush(&self) {
        let Some((_, tx)) = &self.inner else { return };
        let (ack, done) = oneshot::channel();
        if tx.try_send(Control::Flush(ack)).is_ok() {
            let _ = tokio::time::timeout(FLUSH_WAIT, done).await;
        }
    }

    /// The attempt is over: what is still queued gets [`FLUSH_WAIT`] to go out, then the
    /// publisher is stopped (a slow Redis never keeps an ended attempt's events in memory).
    pub(crate) async fn close(&self) {
        let task = self.task.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        let Some(mut task) = task else { return };
        self.flush().await;
        if tokio::time::timeout(Duration::from_millis(1), &mut task).await.is_err() {
            task.abort();
        }
    }
}

/// Sends one attempt's events; ends when every [`Live`] handle is gone.
struct Publisher {
    redis: RedisConn,
    key: String,
    attempt: String,
    ttl_s: u64,
    seq: u64,
    /// The start of a character cut short at the end of the last send, per stream.
    carry: [Vec<u8>; 2],
    /// A `truncated` event was sent, per stream.
    truncated: [bool; 2],
    /// Text sent so far, bytes (both streams).
    sent_text: u64,
    shared: Arc<Shared>,
}

type Entry = (&'static str, Vec<(&'static str, String)>);

impl Publisher {
    async fn run(mut self, mut rx: mpsc::Receiver<Control>) {
        let mut tick = tokio::time::interval(COALESCE);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                message = rx.recv() => match message {
                    // Text printed before an event goes out before it.
                    Some(Control::Event(kind, fields, all)) => {
                        let mut entries = self.take_text(all);
                        entries.push((kind, fields));
                        self.send(entries).await;
                    }
                    Some(Control::Flush(ack)) => {
                        let entries = self.take_text(true);
                        self.send(entries).await;
                        let _ = ack.send(());
                    }
                    None => {
                        let entries = self.take_text(true);
                        self.send(entries).await;
                        return;
                    }
                },
                () = self.shared.wake.notified() => {
                    let entries = self.take_text(false);
                    self.send(entries).await;
                }
                _ = tick.tick() => {
                    let entries = self.take_text(false);
                    self.send(entries).await;
                }
            }
        }
    }

    /// The pending text as chunk events (and a `truncated` event for a stream whose budget
    /// ran out). Unless `last`, the start of a character cut short stays for the next send.
    fn take_text(&mut self, last: bool) -> Vec<Entry> {
        let mut entries = Vec::new();
        for stream in [Text::Stdout, Text::Stderr] {
            let i = stream as usize;
            let (bytes, overflowed, exhausted) = {
                let mut pending = self.shared.text[i].lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let exhausted = self.shared.exhausted[i].load(Ordering::Relaxed);
                (std::mem::take(&mut pending.bytes), std::mem::take(&mut pending.overflowed), exhausted)
            };
            if overflowed {
                // Bytes were lost: the next event's seq skips one, which readers see as a gap.
                self.seq += 1;
                crate::metrics::live_events("dropped", 1);
            }
            let mut text = std::mem::take(&mut self.carry[i]);
            text.extend_from_slice(&bytes);
            if !last {
                let cut = complete_prefix(&text);
                self.carry[i] = text.split_off(cut);
            }
            // The cap holds for the text sent, not only the bytes read: invalid bytes become
            // three-byte U+FFFD each.
            let mut capped = false;
            for chunk in chunks(&String::from_utf8_lossy(&text), CHUNK) {
                let room = self.shared.limit.saturating_sub(self.sent_text) as usize;
                let mut chunk = chunk;
                if chunk.len() > room {
                    let mut cut = room;
                    while !chunk.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    chunk = &chunk[..cut];
                    capped = true;
                }
                if !chunk.is_empty() {
                    self.sent_text += chunk.len() as u64;
                    entries.push((stream.name(), vec![(DATA, chunk.to_owned())]));
                }
                if capped {
                    self.shared.exhausted[i].store(true, Ordering::Relaxed);
                    self.carry[i].clear();
                    break;
                }
            }
            if (exhausted || capped) && !self.truncated[i] && self.carry[i].is_empty() {
                self.truncated[i] = true;
                entries.push(("truncated", vec![("stream", stream.name().into()), ("limit", self.shared.limit.to_string())]));
            }
        }
        entries
    }

    /// Sends `entries` in one pipeline, each numbered; on failure they are dropped (their
    /// numbers stay used: a gap).
    async fn send(&mut self, entries: Vec<Entry>) {
        if entries.is_empty() {
            return;
        }
        let n = entries.len() as u64;
        self.seq += self.shared.lost.swap(0, Ordering::Relaxed);
        let mut pipe = redis::pipe();
        for (kind, fields) in entries {
            let cmd = pipe.cmd("XADD").arg(&self.key).arg("MAXLEN").arg("~").arg(MAX_LEN).arg("*");
            cmd.arg(TYPE).arg(kind).arg(ATTEMPT).arg(&self.attempt).arg(SEQ).arg(self.seq);
            for (name, value) in fields {
                cmd.arg(name).arg(value);
            }
            self.seq += 1;
        }
        pipe.cmd("EXPIRE").arg(&self.key).arg(self.ttl_s).ignore();
        let sent = tokio::time::timeout(SEND_TIMEOUT, pipe.query_async::<redis::Value>(&mut self.redis)).await;
        match sent {
            Ok(Ok(_)) => crate::metrics::live_events("sent", n),
            Ok(Err(e)) => {
                crate::metrics::live_events("dropped", n);
                tracing::debug!(error = %e, events = n, "live events dropped");
            }
            Err(_) => {
                crate::metrics::live_events("dropped", n);
                tracing::debug!(events = n, "live events dropped: Redis did not answer in time");
            }
        }
    }
}

/// The length of the longest prefix of `bytes` that does not end inside a UTF-8 character:
/// all of it, less the start of a multi-byte character whose continuation bytes are missing.
/// Invalid bytes count as complete (they become U+FFFD).
pub(crate) fn complete_prefix(bytes: &[u8]) -> usize {
    let len = bytes.len();
    // The last lead byte within the last 4.
    for back in 1..=len.min(4) {
        let b = bytes[len - back];
        if b & 0xC0 == 0x80 {
            continue; // a continuation byte
        }
        let need = match b {
            0xC2..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF4 => 4,
            _ => 1,
        };
        return if need > back { len - back } else { len };
    }
    len
}

/// `text` in pieces of at most `max` bytes, each cut on a character boundary.
pub(crate) fn chunks(text: &str, max: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut cut = rest.len().min(max);
        while !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        if cut == 0 {
            // A character longer than `max` (only with a tiny max): take it whole.
            cut = rest.char_indices().nth(1).map_or(rest.len(), |(i, _)| i);
        }
        let (head, tail) = rest.split_at(cut);
        out.push(head);
        rest = tail;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_character_cut_short_waits_for_its_end() {
        let euro = "€".as_bytes(); // E2 82 AC
        assert_eq!(complete_prefix(b"abc"), 3);
        assert_eq!(complete_prefix(&[b'a', euro[0]]), 1);
        assert_eq!(complete_prefix(&[b'a', euro[0], euro[1]]), 1);
        assert_eq!(complete_prefix(&[b'a', euro[0], euro[1], euro[2]]), 4);
        let emoji = "😀".as_bytes(); // 4 bytes
        assert_eq!(complete_prefix(&emoji[..3]), 0);
        assert_eq!(complete_prefix(emoji), 4);
        // Invalid bytes are not held back.
        assert_eq!(complete_prefix(&[b'a', 0xFF]), 2);
        assert_eq!(complete_prefix(&[0x80, 0x80]), 2);
    }

    proptest! {
        /// Any text cut into pieces anywhere, each piece sent as `take_text` does (complete
        /// prefix now, the rest carried), arrives whole and in order, and no chunk is longer
        /// than the cap plus one character.
        #[test]
        fn text_cut_anywhere_arrives_whole(text in "\\PC{0,200}", cuts in proptest::collection::vec(0usize..400, 0..8), max in 1usize..20) {
            let bytes = text.as_bytes();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut carry = Vec::new();
            let mut got = String::new();
            let mut last = 0;
            for cut in cuts.into_iter().chain([bytes.len()]) {
                carry.extend_from_slice(&bytes[last..cut]);
                last = cut;
                let keep = complete_prefix(&carry);
                let rest = carry.split_off(keep);
                let sent = String::from_utf8(std::mem::replace(&mut carry, rest)).expect("a complete prefix is valid UTF-8");
                for chunk in chunks(&sent, max) {
                    prop_assert!(chunk.len() <= max.max(4));
                    got.push_str(chunk);
                }
            }
            prop_assert!(carry.is_empty());
            prop_assert_eq!(got, text);
        }
    }
}
