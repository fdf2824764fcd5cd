//! The one reader of `text/event-stream` (the gateway's live events, docs/gateway.md "Live
//! events"): [`SseParser`] turns chunks into messages, [`messages`] a body into a stream of
//! them; a message becomes the core's [`Event`] ([`event_of`]) or stays a raw [`JobEvent`].

use std::collections::{BTreeMap, VecDeque};

use futures::{Stream, StreamExt as _};
use sandq_schemas::events::{Event, EventKind};
use serde_json::Value;

use super::transport::{BodyStream, BoxError};

/// Largest single server-sent event read (a display's JSON included); a larger one is dropped.
pub const MAX_EVENT_BYTES: usize = 64 << 20;

/// One server-sent event of `GET /v1/jobs/{id}/events` as sent: its type and JSON data,
/// unparsed (docs/gateway.md "Live events"). [`super::HttpClient::events`] parses them into
/// [`Event`]s instead.
#[derive(Debug, Clone)]
pub struct JobEvent {
    /// Its stream id (the resume cursor).
    pub id: Option<String>,
    /// `stdout`, `stderr`, `display`, `attempt`, `started`, `finished`, `truncated`, `end`...
    pub kind: String,
    /// Its JSON data (`Null` when it is not JSON).
    pub data: Value,
}

impl From<SseMessage> for JobEvent {
    fn from(message: SseMessage) -> Self {
        JobEvent { id: message.id, kind: message.event, data: serde_json::from_str(&message.data).unwrap_or(Value::Null) }
    }
}

/// The messages of an event-stream body, as they come; the body's error ends it.
pub(super) fn messages(body: BodyStream) -> impl Stream<Item = Result<SseMessage, BoxError>> + Send + 'static {
    let state = (body, SseParser::default(), VecDeque::new(), false);
    futures::stream::unfold(state, |(mut body, mut parser, mut page, mut done)| async move {
        loop {
            if let Some(message) = page.pop_front() {
                return Some((Ok(message), (body, parser, page, done)));
            }
            if done {
                return None;
            }
            match body.next().await {
                Some(Ok(bytes)) => {
                    let mut out = Vec::new();
                    parser.feed(&bytes, &mut out);
                    page.extend(out);
                }
                Some(Err(e)) => {
                    done = true;
                    return Some((Err(e), (body, parser, page, done)));
                }
                None => done = true,
            }
        }
    })
}

/// One server-sent event as read: its `id:` (the last one seen on the stream), `event:` and
/// `data:` lines joined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SseMessage {
    /// The last `id:` seen on the stream.
    pub(super) id: Option<String>,
    /// Its `event:` (`message` when it had none).
    pub(super) event: String,
    /// Its `data:` lines, joined with LF.
    pub(super) data: String,
}

/// Reads `text/event-stream` (the WHATWG grammar: lines ended by LF, CRLF or CR; `:`
/// comments; `field: value`; an event ends at a blank line), chunk by chunk.
#[derive(Debug, Default)]
pub(super) struct SseParser {
    line: Vec<u8>,
    /// The line is over [`MAX_EVENT_BYTES`]: its event is dropped.
    overflow: bool,
    after_cr: bool,
    id: Option<String>,
    event: String,
    data: String,
    has_data: bool,
}

impl SseParser {
    /// Reads `bytes`, pushing each message they end onto `out`.
    pub(super) fn feed(&mut self, bytes: &[u8], out: &mut Vec<SseMessage>) {
        for &b in bytes {
            match b {
                b'\n' if self.after_cr => self.after_cr = false,
                b'\n' | b'\r' => {
                    self.after_cr = b == b'\r';
                    let line = std::mem::take(&mut self.line);
                    self.line_done(&line, out);
                }
                _ => {
                    self.after_cr = false;
                    if self.line.len() + self.data.len() >= MAX_EVENT_BYTES {
                        self.overflow = true;
                    } else {
                        self.line.push(b);
                    }
                }
            }
        }
    }

    fn line_done(&mut self, line: &[u8], out: &mut Vec<SseMessage>) {
        if line.is_empty() {
            let (event, data) = (std::mem::take(&mut self.event), std::mem::take(&mut self.data));
            if self.has_data && !self.overflow {
                let data = data.strip_suffix('\n').unwrap_or(&data).to_owned();
                out.push(SseMessage { id: self.id.clone(), event: if event.is_empty() { "message".into() } else { event }, data });
            }
            self.has_data = false;
            self.overflow = false;
            return;
        }
        if self.overflow || line.starts_with(b":") {
            return;
        }
        let line = String::from_utf8_lossy(line);
        let (field, value) = line.split_once(':').unwrap_or((&line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "event" => value.clone_into(&mut self.event),
            "data" => {
                self.data.push_str(value);
                self.data.push('\n');
                self.has_data = true;
            }
            "id" if !value.contains('\0') => self.id = Some(value.to_owned()),
            _ => {}
        }
    }
}

/// The live event a gateway's SSE message stands for (its `data`: `attempt`, `seq` and the
/// type's fields, docs/gateway.md); `None` without an id (not one of the job's events).
pub(super) fn event_of(message: &SseMessage) -> Option<Event> {
    let id = message.id.clone().filter(|id| !id.is_empty())?;
    let data: Value = serde_json::from_str(&message.data).unwrap_or(Value::Null);
    let text = |name: &str| data.get(name).and_then(Value::as_str).unwrap_or_default().to_owned();
    let number = |name: &str| data.get(name).and_then(Value::as_u64);
    let kind = match message.event.as_str() {
        "attempt" => EventKind::Attempt { attempt_id: text("attempt_id") },
        "started" => EventKind::Started { warm: data.get("warm").and_then(Value::as_bool).unwrap_or(false) },
        "finished" => EventKind::Finished { exit_code: data.get("exit_code").and_then(Value::as_i64).and_then(|c| i32::try_from(c).ok()) },
        "requeued" => EventKind::Requeued { reason: text("reason") },
        "stdout" => EventKind::Stdout(text("text")),
        "stderr" => EventKind::Stderr(text("text")),
        "display" => EventKind::Display {
            index: number("index").unwrap_or(0),
            output: data.get("output").and_then(|o| serde_json::from_value(o.clone()).ok()).map(Box::new),
        },
        "truncated" => EventKind::Truncated { stream: text("stream"), limit: number("limit").unwrap_or(0) },
        "end" => EventKind::End { status: text("status") },
        other => {
            let fields: BTreeMap<String, String> = data
                .as_object()
                .map(|o| o.iter().map(|(k, v)| (k.clone(), v.as_str().map_or_else(|| v.to_string(), str::to_owned))).collect())
                .unwrap_or_default();
            EventKind::Other { kind: other.to_owned(), fields }
        }
    };
    let attempt = number("attempt").and_then(|a| u32::try_from(a).ok()).unwrap_or(0);
    Some(Event { id, attempt, seq: number("seq"), kind })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(chunks: &[&[u8]]) -> Vec<SseMessage> {
        let mut parser = SseParser::default();
        let mut out = Vec::new();
        for chunk in chunks {
            parser.feed(chunk, &mut out);
        }
        out
    }

    #[test]
    fn server_sent_events_parse_across_chunks_and_line_endings() {
        let whole = b": keep-alive\n\nid: 1-0\nevent: stdout\ndata: {\"text\":\"a\"}\n\nid:2-0\r\nevent:end\r\ndata:{}\r\n\r\n";
        let expected = vec![
            SseMessage { id: Some("1-0".into()), event: "stdout".into(), data: "{\"text\":\"a\"}".into() },
            SseMessage { id: Some("2-0".into()), event: "end".into(), data: "{}".into() },
        ];
        assert_eq!(parse(&[whole]), expected);
        // Any split into chunks reads the same, a CRLF cut in two included.
        for cut in 0..whole.len() {
            assert_eq!(parse(&[&whole[..cut], &whole[cut..]]), expected, "cut at {cut}");
        }
        let bytes: Vec<&[u8]> = whole.chunks(1).collect();
        assert_eq!(parse(&bytes), expected);
        // Multi-line data joins with LF; a CR alone ends a line; the id carries over.
        assert_eq!(
            parse(&[b"id: 3-0\rdata: a\rdata: b\r\rdata: c\n\n"]),
            vec![
                SseMessage { id: Some("3-0".into()), event: "message".into(), data: "a\nb".into() },
                SseMessage { id: Some("3-0".into()), event: "message".into(), data: "c".into() },
            ]
        );
        // A comment or an event without data dispatches nothing.
        assert!(parse(&[b": hi\n\nevent: x\n\n"]).is_empty());
    }

    #[test]
    fn gateway_events_become_the_live_events_of_the_core() {
        let message = |event: &str, data: Value| SseMessage { id: Some("5-1".into()), event: event.into(), data: data.to_string() };
        let stdout = event_of(&message("stdout", json!({"attempt": 2, "seq": 7, "text": "hi\n"}))).expect("an event");
        assert_eq!(stdout, Event { id: "5-1".into(), attempt: 2, seq: Some(7), kind: EventKind::Stdout("hi\n".into()) });
        let end = event_of(&message("end", json!({"attempt": 1, "seq": null, "status": "succeeded"}))).expect("an event");
        assert_eq!(end.kind, EventKind::End { status: "succeeded".into() });
        assert_eq!(end.seq, None);
        let finished = event_of(&message("finished", json!({"attempt": 1, "seq": 3, "exit_code": null}))).expect("an event");
        assert_eq!(finished.kind, EventKind::Finished { exit_code: None });
        let display = event_of(&message(
            "display",
            json!({"attempt": 1, "seq": 4, "index": 2, "output": {"output_type": "display_data", "data": {"text/plain": {"text": "x", "size": 1}}}}),
        ))
        .expect("an event");
        let EventKind::Display { index: 2, output: Some(output) } = display.kind else { panic!("{display:?}") };
        assert_eq!(output.data["text/plain"].text.as_deref(), Some("x"));
        let other = event_of(&message("newer", json!({"attempt": 1, "n": 5}))).expect("an event");
        assert!(matches!(other.kind, EventKind::Other { ref kind, ref fields } if kind == "newer" && fields["n"] == "5"), "{other:?}");
        assert_eq!(event_of(&SseMessage { id: None, event: "stdout".into(), data: "{}".into() }), None);
    }
}
