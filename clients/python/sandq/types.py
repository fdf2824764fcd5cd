"""Typed views of the wire types of docs/protocol.md (`JobResult` and its parts, `InputFile`,
the live `Event`).

Every class has `from_wire(dict)`, which reads the decoded MessagePack map and ignores keys it
does not know (newer workers may add some); `raw` keeps the map as it came.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping, Optional, Union

TERMINAL = frozenset({"succeeded", "failed", "timed_out", "oom_killed", "rejected", "cancelled", "expired", "internal_error"})


def _list(value: Any) -> list:
    return list(value) if value else []


def _int(value: Any) -> Any:
    """An integer field as an int: some encoders (JavaScript's) write integers as floats."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


@dataclass(frozen=True)
class InputFile:
    """An uploaded file and where the job sees it (`/work/<path>`)."""
    key: str
    path: str
    size: int
    sha256: str

    def to_wire(self) -> dict:
        return {"key": self.key, "path": self.path, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class Stream:
    """stdout or stderr: the first bytes as text, and where the exact bytes are in S3."""
    text: str = ""
    total_bytes: int = 0
    truncated: bool = False
    lossy: bool = False
    log_key: Optional[str] = None
    log_bytes: int = 0

    @classmethod
    def from_wire(cls, m: Optional[dict]) -> "Stream":
        m = m or {}
        return cls(m.get("text") or "", m.get("total_bytes") or 0, bool(m.get("truncated")), bool(m.get("lossy")),
                   m.get("log_key"), m.get("log_bytes") or 0)


@dataclass(frozen=True)
class Artifact:
    """A file the job wrote (or a stored rich-output representation); `url` is presigned.
    `job_id` is the job of a result's `artifacts` entry (what the gateway serves it by; None for
    a rich output's representation)."""
    path: str
    key: str
    size: int
    sha256: str
    content_type: str
    url: Optional[str] = None
    url_expires_at_ms: Optional[int] = None
    job_id: Optional[str] = None

    @classmethod
    def from_wire(cls, m: dict, job_id: Optional[str] = None) -> "Artifact":
        return cls(m["path"], m["key"], m.get("size") or 0, m.get("sha256") or "", m.get("content_type") or "application/octet-stream",
                   m.get("url"), m.get("url_expires_at_ms"), job_id)


@dataclass(frozen=True)
class SkippedArtifact:
    path: str
    reason: str

    @classmethod
    def from_wire(cls, m: dict) -> "SkippedArtifact":
        return cls(m.get("path") or "", m.get("reason") or "")


@dataclass(frozen=True)
class Usage:
    wall_ms: int
    cpu_ms: int
    peak_memory_bytes: int

    @classmethod
    def from_wire(cls, m: Optional[dict]) -> Optional["Usage"]:
        return None if m is None else cls(m.get("wall_ms") or 0, m.get("cpu_ms") or 0, m.get("peak_memory_bytes") or 0)


@dataclass(frozen=True)
class ErrorInfo:
    """A notebook cell's uncaught exception: `{name, value, traceback}`."""
    name: str
    value: str
    traceback: list[str]

    @classmethod
    def from_wire(cls, m: Optional[dict]) -> Optional["ErrorInfo"]:
        return None if m is None else cls(m.get("name") or "", m.get("value") or "", _list(m.get("traceback")))


@dataclass(frozen=True)
class MimeValue:
    """One representation of an output: inline `text`, or an `artifact` in S3 (binary types)."""
    text: Optional[str]
    artifact: Optional[Artifact]
    size: int

    @classmethod
    def from_wire(cls, m: dict) -> "MimeValue":
        a = m.get("artifact")
        return cls(m.get("text"), Artifact.from_wire(a) if a else None, m.get("size") or 0)


@dataclass(frozen=True)
class TableInfo:
    rows: int
    columns: int


@dataclass(frozen=True)
class ImageInfo:
    width: int
    height: int


@dataclass(frozen=True)
class Output:
    """A rich output (notebook mode): a MIME bundle, as in Jupyter."""
    output_type: str
    data: dict[str, MimeValue]
    table: Optional[TableInfo] = None
    image: Optional[ImageInfo] = None
    error: Optional[ErrorInfo] = None
    #: The size to show the image at (CSS pixels) when it is not its pixel size (a retina figure).
    display: Optional[ImageInfo] = None

    @classmethod
    def from_wire(cls, m: dict) -> "Output":
        t, i, d = m.get("table"), m.get("image"), m.get("display")
        return cls(m.get("output_type") or "", {k: MimeValue.from_wire(v) for k, v in (m.get("data") or {}).items()},
                   TableInfo(t.get("rows") or 0, t.get("columns") or 0) if t else None,
                   ImageInfo(i.get("width") or 0, i.get("height") or 0) if i else None,
                   ErrorInfo.from_wire(m.get("error")),
                   ImageInfo(d.get("width") or 0, d.get("height") or 0) if d else None)

    @property
    def text(self) -> Optional[str]:
        """The `text/plain` representation."""
        v = self.data.get("text/plain")
        return v.text if v else None


@dataclass(frozen=True)
class SessionState:
    restored: int = 0
    not_restored: list[dict] = field(default_factory=list)
    saved: bool = False
    variables: list[str] = field(default_factory=list)
    unsaved: list[dict] = field(default_factory=list)
    bytes: int = 0
    save_ms: int = 0
    restore_ms: int = 0

    @classmethod
    def from_wire(cls, m: Optional[dict]) -> Optional["SessionState"]:
        if m is None:
            return None
        return cls(m.get("restored") or 0, _list(m.get("not_restored")), bool(m.get("saved")), _list(m.get("variables")),
                   _list(m.get("unsaved")), m.get("bytes") or 0, m.get("save_ms") or 0,
                   m.get("restore_ms") or 0)


@dataclass(frozen=True)
class SessionInfo:
    """What happened to the job's session."""
    name: str
    fresh: bool
    expired: bool
    restored_files: int
    saved_files: int
    deleted_files: int
    files: int
    bytes: int
    unsaved_files: int
    expires_at_ms: int
    state: Optional[SessionState]

    @classmethod
    def from_wire(cls, m: Optional[dict]) -> Optional["SessionInfo"]:
        if m is None:
            return None
        g = lambda k: m.get(k) or 0  # noqa: E731
        return cls(m.get("name") or "", bool(m.get("fresh")), bool(m.get("expired")), g("restored_files"), g("saved_files"),
                   g("deleted_files"), g("files"), g("bytes"), g("unsaved_files"), g("expires_at_ms"),
                   SessionState.from_wire(m.get("state")))


@dataclass(frozen=True)
class SandboxInfo:
    warm: bool
    sandbox_wait_ms: int
    #: The warm sandbox's process was forked from a pre-imported template (docs/protocol.md,
    #: "Warm starts"); False for a cold start or a result written before the field existed.
    forked: bool = False

    @classmethod
    def from_wire(cls, m: Optional[dict]) -> Optional["SandboxInfo"]:
        return None if m is None else cls(bool(m.get("warm")), m.get("sandbox_wait_ms") or 0, bool(m.get("forked")))


@dataclass(frozen=True)
class JobResult:
    """A job's status and result, as stored in Redis (`JobResult` of docs/protocol.md), or as
    the gateway shows it (the same fields, in JSON, with the tenant's job id and session name)."""
    job_id: str
    status: str
    reason: Optional[str]
    sku: Optional[str]
    exit_code: Optional[int]
    signal: Optional[str]
    stdout: Stream
    stderr: Stream
    artifacts: list[Artifact]
    skipped_artifacts: list[SkippedArtifact]
    skipped_artifacts_total: int
    usage: Optional[Usage]
    queued_at_ms: Optional[int]
    started_at_ms: Optional[int]
    finished_at_ms: Optional[int]
    worker_id: Optional[str]
    attempt: int
    outputs: list[Output]
    execution_count: Optional[int]
    sandbox: Optional[SandboxInfo]
    outputs_dropped: int
    error: Optional[ErrorInfo]
    session: Optional[SessionInfo]
    raw: dict = field(repr=False, compare=False)

    @classmethod
    def from_wire(cls, m: dict) -> "JobResult":
        return cls(
            job_id=m.get("job_id") or "", status=m.get("status") or "", reason=m.get("reason"), sku=m.get("sku"),
            exit_code=_int(m.get("exit_code")), signal=m.get("signal"),
            stdout=Stream.from_wire(m.get("stdout")), stderr=Stream.from_wire(m.get("stderr")),
            artifacts=[Artifact.from_wire(a, m.get("job_id") or None) for a in _list(m.get("artifacts"))],
            skipped_artifacts=[SkippedArtifact.from_wire(s) for s in _list(m.get("skipped_artifacts"))],
            skipped_artifacts_total=_int(m.get("skipped_artifacts_total")) or 0,
            usage=Usage.from_wire(m.get("usage")), queued_at_ms=_int(m.get("queued_at_ms")),
            started_at_ms=_int(m.get("started_at_ms")), finished_at_ms=_int(m.get("finished_at_ms")),
            worker_id=m.get("worker_id"), attempt=_int(m.get("attempt")) or 0,
            outputs=[Output.from_wire(o) for o in _list(m.get("outputs"))], execution_count=_int(m.get("execution_count")),
            sandbox=SandboxInfo.from_wire(m.get("sandbox")), outputs_dropped=_int(m.get("outputs_dropped")) or 0,
            error=ErrorInfo.from_wire(m.get("error")), session=SessionInfo.from_wire(m.get("session")), raw=m,
        )

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"

    def artifact(self, path: str) -> Artifact:
        """The artifact at `path` (relative to /work); KeyError when the job left none there."""
        for a in self.artifacts:
            if a.path == path:
                return a
        raise KeyError(path)

    def images(self) -> list[tuple[Output, MimeValue]]:
        """Every image representation of the outputs (`image/png`, ...), with its output."""
        return [(o, v) for o in self.outputs for mime, v in o.data.items() if mime.startswith("image/") and v.artifact]

    def raise_for_status(self) -> "JobResult":
        """Raises the `JobError` subclass of a status other than `succeeded`; returns self otherwise."""
        from .errors import error_for
        if self.status != "succeeded":
            raise error_for(self)
        return self


def _text(value: Union[str, bytes]) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


def _decimal(value: Optional[str]) -> Optional[int]:
    """A decimal field as an int; None when absent or not a decimal."""
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


@dataclass(frozen=True)
class Event:
    """One entry of a job's live event stream (docs/protocol.md "Live events").

    `id` is the stream entry's id (`"1764680000000-0"`): the cursor to resume after this event.
    `type` is `attempt`, `status`, `stdout`, `stderr`, `display`, `truncated`, `end`, or a type
    this SDK does not know (ignore it). `attempt` is the delivery attempt (from 1; 0 when the field
    is missing or malformed); `seq` the event's number within its attempt (from 0; None on `end`).
    `fields` holds every field as sent, these three included; the properties below read the
    type-specific ones (None when the event has no such field)."""
    id: str
    type: str
    attempt: int
    seq: Optional[int]
    fields: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, id: Union[str, bytes], fields: Mapping[Any, Any]) -> "Event":
        """Reads a stream entry: its id and field/value pairs (str or UTF-8 bytes). Never raises:
        what it cannot read is None (or `attempt` 0)."""
        fields = {_text(k): _text(v) for k, v in fields.items()}
        return cls(_text(id), fields.get("type", ""), _decimal(fields.get("attempt")) or 0,
                   _decimal(fields.get("seq")), fields)

    @property
    def data(self) -> Optional[str]:
        """`stdout`/`stderr`: the chunk's text (at most 8 KiB); `display`: the output's JSON."""
        return self.fields.get("data")

    @property
    def status(self) -> Optional[str]:
        """`end`: the job's terminal status (`succeeded`, `failed`, ...)."""
        return self.fields.get("status")

    @property
    def state(self) -> Optional[str]:
        """`status`: `started`, `finished` or `queued` (the attempt failed on infrastructure)."""
        return self.fields.get("state")

    @property
    def attempt_id(self) -> Optional[str]:
        """`attempt`: the attempt's id (`a<16 hex>`), as in the result's S3 keys."""
        return self.fields.get("attempt_id")

    @property
    def warm(self) -> Optional[bool]:
        """`status` `started`: whether a warm sandbox took the job."""
        warm = self.fields.get("warm")
        return None if warm is None else warm == "true"

    @property
    def exit_code(self) -> Optional[int]:
        """`status` `finished`: the program's exit code; None when it was killed."""
        return _decimal(self.fields.get("exit_code"))

    @property
    def reason(self) -> Optional[str]:
        """`status` `queued`: why the attempt failed."""
        return self.fields.get("reason")

    @property
    def index(self) -> Optional[int]:
        """`display`: the output's place in the result's `outputs` (from 0)."""
        return _decimal(self.fields.get("index"))

    @cached_property
    def output(self) -> Optional[Output]:
        """`display`: the output, as in the result's `outputs`; None for other types, or when its
        JSON does not read as an output."""
        if self.type != "display" or self.data is None:
            return None
        try:
            return Output.from_wire(json.loads(self.data))
        except (ValueError, TypeError, AttributeError, KeyError):  # not JSON, or another shape
            return None

    @property
    def stream(self) -> Optional[str]:
        """`truncated`: the kind no longer streamed (`stdout`, `stderr` or `display`)."""
        return self.fields.get("stream")

    @property
    def limit(self) -> Optional[int]:
        """`truncated`: the cap reached, bytes (events for `display`)."""
        return _decimal(self.fields.get("limit"))
