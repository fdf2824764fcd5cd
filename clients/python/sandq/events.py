"""A job's live events (docs/protocol.md "Live events"): what the worker appends to the Redis
Stream `<ns>:job:{<job_id>}:events` while the job runs, and what a reader makes of them.

`Client.events` / `AsyncClient.events` yield the `Event`s; `Transcript` folds them into the
newest attempt's text and displays (what `run(on_stdout=...)` follows); `Callbacks` says which
callback of `run` an event goes to. The stream is best effort: the job's stored result stays
authoritative.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .types import Event, Output

# The statuses of a job still under way: the reader keeps waiting for events while the job's
# hash says one of them (anything else, an unknown job included, is over).
ACTIVE = frozenset({"queued", "running"})


def parse_xread(reply: Any) -> list[Event]:
    """The events of an `XREAD` reply of one stream, in order: RESP2's
    `[[key, [(id, {field: value}), ...]]]`, RESP3's `{key: [[id, {field: value}], ...]}`, or
    None / empty (nothing new in time)."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, dict) else (entries for _, entries in reply)
    events = []
    for entries in streams:
        for entry_id, fields in entries:
            if fields is None:  # an entry trimmed between the read's index and its body
                continue
            if not isinstance(fields, dict):  # a flat [field, value, ...] list
                fields = dict(zip(fields[::2], fields[1::2]))
            events.append(Event.from_wire(entry_id, fields))
    return events


@dataclass
class Transcript:
    """What a reader makes of a job's events so far (docs/protocol.md "Live events"): the text
    and displays of the newest attempt, the gaps, the caps reached, the end. Feed it every event
    in stream order with `push`.

    A later attempt's `attempt` event means the earlier attempt was abandoned (its worker died,
    or it failed on infrastructure and the job was requeued): its text, displays and caps are
    dropped here, as they are not in the result."""
    #: Attempts seen, in order (1 for the first delivery).
    attempts: list[int] = field(default_factory=list)
    #: stdout of the newest attempt: its chunks' text concatenated.
    stdout: str = ""
    #: stderr of the newest attempt.
    stderr: str = ""
    #: Displays of the newest attempt, in order: (index in the result's `outputs`, the output;
    #: None when its JSON did not read as an output).
    displays: list[tuple[int, Optional[Output]]] = field(default_factory=list)
    #: (attempt, seq) of events the worker dropped, before the last one seen of each attempt.
    missing: list[tuple[int, int]] = field(default_factory=list)
    #: Kinds whose cap was reached in the newest attempt (`stdout`, `stderr`, `display`).
    truncated: list[str] = field(default_factory=list)
    #: The terminal status, once `end` was read; None before.
    status: Optional[str] = None
    #: The cursor to resume from: the last event's id (None before any).
    last_id: Optional[str] = None
    _next_seq: dict[int, int] = field(default_factory=dict, repr=False)

    @property
    def attempt(self) -> int:
        """The newest attempt seen (0 before any)."""
        return self.attempts[-1] if self.attempts else 0

    def push(self, event: Event) -> bool:
        """Folds one event in. Returns True when it belongs to the newest attempt (or is the
        `end`), False for a late event of an abandoned attempt (ignored, but for its `seq`)."""
        self.last_id = event.id
        if event.attempt > self.attempt:
            self.attempts.append(event.attempt)
            self.stdout, self.stderr = "", ""
            self.displays, self.truncated = [], []
        if event.seq is not None:
            expected = self._next_seq.get(event.attempt, 0)
            self.missing.extend((event.attempt, seq) for seq in range(expected, event.seq))
            self._next_seq[event.attempt] = max(expected, event.seq + 1)
        if event.type == "end":
            # The job's end, whatever attempt it names (the script writes 0 when it knows none).
            self.status = event.status
            return True
        if event.attempt < self.attempt:
            return False
        if event.type == "stdout":
            self.stdout += event.data or ""
        elif event.type == "stderr":
            self.stderr += event.data or ""
        elif event.type == "display":
            self.displays.append((event.index or 0, event.output))
        elif event.type == "truncated" and event.stream:
            self.truncated.append(event.stream)
        return True


@dataclass(frozen=True)
class Callbacks:
    """The callbacks of `run(on_stdout=..., ...)` and `follow`: `on_event(event)` gets every
    `Event` first (unknown types and late events of abandoned attempts included); then
    `on_stdout(text)` and `on_stderr(text)` each chunk of the newest attempt (str, at most 8 KiB,
    cut on character boundaries), in order, and `on_display(output)` each rich output of the
    newest attempt (an `Output`, as in the result's `outputs`). What a callback returns is
    ignored (awaited first by the asyncio client when awaitable); what it raises propagates.

    When a job is delivered again (its worker died, or it failed on infrastructure), an `attempt`
    event with a higher number arrives and the callbacks carry on with the new attempt's output:
    what they got from the earlier attempt was abandoned and is not in the result (watch
    `on_event` for `event.type == "attempt"` to mark the restart)."""
    on_stdout: Optional[Callable[[str], Any]] = None
    on_stderr: Optional[Callable[[str], Any]] = None
    on_display: Optional[Callable[[Output], Any]] = None
    on_event: Optional[Callable[[Event], Any]] = None

    def __bool__(self) -> bool:
        return any((self.on_stdout, self.on_stderr, self.on_display, self.on_event))

    def calls(self, event: Event, current: bool) -> list[tuple[Callable[[Any], Any], Any]]:
        """The (callback, argument) pairs `event` makes, in order (`on_event` first); `current`:
        it belongs to the newest attempt (`Transcript.push`'s answer). A display whose JSON does
        not read as an output goes to `on_event` only."""
        out: list[tuple[Callable[[Any], Any], Any]] = []
        if self.on_event:
            out.append((self.on_event, event))
        if not current:
            return out
        if event.type == "stdout" and self.on_stdout and event.data:
            out.append((self.on_stdout, event.data))
        elif event.type == "stderr" and self.on_stderr and event.data:
            out.append((self.on_stderr, event.data))
        elif event.type == "display" and self.on_display and event.output is not None:
            out.append((self.on_display, event.output))
        return out
