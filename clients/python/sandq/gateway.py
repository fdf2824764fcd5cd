"""HTTP mode's pure parts, shared by its transports (`_gateway`, `_aio_gateway`) and the clients:
which mode a client takes, a job as the gateway's JSON, problem documents as exceptions, which
answers are retried, and server-sent events as `Event`s (docs/gateway.md).

Which mode `Client(...)` / `AsyncClient(...)` takes (the first that applies):

1. `url=` given: HTTP, with `api_key=`, else `$SANDQ_API_KEY`.
2. `config=` or `namespace=` given: direct (AMQP, Redis, S3).
3. `$SANDQ_URL` set (not empty): HTTP, with `api_key=`, else `$SANDQ_API_KEY`.
4. Otherwise direct, with the config file (`$SANDQ_CONFIG`, else /etc/sandq/sandq.toml).

HTTP mode without a key is a ValueError, as are `url=` with `config=`/`namespace=` and `api_key=`
in direct mode.
"""
from __future__ import annotations

import json
import os
import urllib.parse
from typing import Any, Iterator, Mapping, Optional

from . import protocol
from .errors import (Conflict, ForbiddenByQuota, GatewayError, InvalidRequest, JobNotFound, NotFound, Problem, QuotaExceeded,
                     SandqError, Unauthorized, Unavailable)
from .types import Event, Stream

URL_ENV = "SANDQ_URL"
API_KEY_ENV = "SANDQ_API_KEY"
USER_AGENT = "sandq-python/0.1.0"

# Longest single `GET /v1/jobs/{id}?wait=` (s): under the gateway's `max_wait` (default 60 s;
# it caps a longer one anyway).
WAIT_S = 30.0
# An event stream silent for this long (s) is taken as dropped and reopened after the last
# event read (the gateway sends a keep-alive comment every `keep_alive`, 15 s by default).
STREAM_IDLE_S = 45.0
# A request that failed in a way worth trying again (no answer, 503, a 409 `Retry-After` while
# the same submission is being handled) is sent again up to this many times, after
# `RETRY_BASE_S` doubling (or the answer's `Retry-After`), each pause at most `RETRY_MAX_S`.
RETRIES = 5
RETRY_BASE_S = 0.5
RETRY_MAX_S = 10.0
# Connect/write time-out of every request; the read time-out of one that does not wait (s).
CONNECT_S = 10.0
READ_S = 60.0

_PROBLEMS: dict[str, type[SandqError]] = {
    "unauthorized": Unauthorized,
    "forbidden-by-quota": ForbiddenByQuota,
    "quota-exceeded": QuotaExceeded,
    "not-found": NotFound,
    "conflict": Conflict,
    "unavailable": Unavailable,
    "invalid-request": InvalidRequest,
    "unsupported-media-type": InvalidRequest,
    "body-too-large": InvalidRequest,
    "body-timeout": InvalidRequest,
    "method-not-allowed": InvalidRequest,
}
_BY_STATUS: dict[int, type[SandqError]] = {
    401: Unauthorized, 403: ForbiddenByQuota, 404: NotFound, 405: InvalidRequest, 408: InvalidRequest, 409: Conflict,
    400: InvalidRequest, 413: InvalidRequest, 415: InvalidRequest, 429: QuotaExceeded, 502: Unavailable,
    503: Unavailable, 504: Unavailable,
}


def http_target(config: Any, namespace: Optional[str], url: Optional[str],
                api_key: Optional[str]) -> Optional[tuple[str, str]]:
    """The gateway's base URL and the key when the client is to speak HTTP (the module's rules),
    None for direct mode. Raises ValueError for a contradictory choice or a missing key."""
    def key() -> str:
        chosen = api_key or os.environ.get(API_KEY_ENV)
        if not chosen:
            raise ValueError(f"HTTP mode needs an API key: api_key= or ${API_KEY_ENV}")
        return chosen

    if url:
        if config is not None or namespace:
            raise ValueError("give url= (HTTP mode) or config=/namespace= (direct mode), not both")
        return url.rstrip("/"), key()
    if config is not None or namespace:
        if api_key:
            raise ValueError("api_key= is for HTTP mode: give url= (or set $SANDQ_URL) and no config")
        return None
    env_url = os.environ.get(URL_ENV, "").strip()
    if env_url:
        return env_url.rstrip("/"), key()
    if api_key:
        raise ValueError(f"api_key= needs url= or ${URL_ENV}")
    return None


def takes_http(config: Any, namespace: Optional[str], url: Optional[str], api_key: Optional[str],
               unserved: Optional[str]) -> bool:
    """Whether `Client(...)` / `AsyncClient(...)` is the HTTP client (`http_target`); ValueError
    for `unserved=` there (it is direct mode's)."""
    if http_target(config, namespace, url, api_key) is None:
        return False
    if unserved is not None:
        raise ValueError("unserved= is direct mode's (the client asks the broker); not for HTTP mode")
    return True


def required_target(who: str, config: Any, namespace: Optional[str], url: Optional[str],
                    api_key: Optional[str]) -> tuple[str, str]:
    """`http_target` for a client that is HTTP only (`who`: its class's name); ValueError when
    the rules say direct."""
    target = http_target(config, namespace, url, api_key)
    if target is None:
        raise ValueError(f"{who} needs url= or ${URL_ENV}")
    return target


def quote(segment: str) -> str:
    """One path segment, percent-encoded."""
    return urllib.parse.quote(segment, safe="")


def job_path(job_id: str) -> str:
    return f"/v1/jobs/{quote(job_id)}"


def job_request(code: Optional[str], spec: dict[str, Any]) -> tuple[str, bytes, dict[str, str]]:
    """`submit`'s keywords as `POST /v1/jobs`: the job id (the client's: a retry sends the same
    bytes, so the gateway finds the first job), the JSON body and the headers (`Idempotency-Key`:
    the job id). `callback_url` is HTTP mode's own keyword (docs/gateway.md "Webhooks").

    Raises ValueError for what the gateway cannot take: `entrypoint` (it runs `code`), `stdin`
    that is not UTF-8 text, and what `protocol.build_job` refuses."""
    spec = dict(spec)
    callback_url = spec.pop("callback_url", None)
    if spec.get("entrypoint") is not None:
        raise ValueError("the gateway runs code only: entrypoint needs direct mode")
    job = protocol.build_job(code, **spec)
    body: dict[str, Any] = {"job_id": job["job_id"], "runtime": job["runtime"], "code": job["code"], "sku": job["sku"]}
    if "stdin" in job:
        try:
            body["stdin"] = job["stdin"].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError("over HTTP stdin is text: give UTF-8") from e
    if "inputs" in job:
        body["inputs"] = [{"file_id": i["sha256"], "path": i["path"]} for i in job["inputs"]]
    for key in ("args", "env", "timeout", "result_ttl", "network", "mode", "session", "deadline_ms"):
        if key in job:
            body[key] = job[key]
    if callback_url is not None:
        body["callback_url"] = callback_url
    headers = {"Content-Type": "application/json", "Idempotency-Key": job["job_id"]}
    return job["job_id"], json.dumps(body, separators=(",", ":")).encode(), headers


def retry_after(headers: Mapping[str, str], body: Any) -> Optional[float]:
    """Seconds from `Retry-After` (delta-seconds), else the problem's `retry_after`."""
    value = headers.get("retry-after")
    try:
        if value is not None:
            return max(0.0, float(value))
    except ValueError:
        pass
    if isinstance(body, dict) and isinstance(body.get("retry_after"), (int, float)):
        return max(0.0, float(body["retry_after"]))
    return None


def problem_of(status: int, headers: Mapping[str, str], content: bytes) -> Problem:
    """The problem document of an error answer; one made up of the status and the first bytes
    when the answer is not one (a proxy's page)."""
    try:
        doc = json.loads(content) if content else None
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("type"), str):
        return Problem(type=doc["type"], status=int(doc.get("status") or status), title=str(doc.get("title") or ""),
                       detail=str(doc.get("detail") or ""), retry_after=retry_after(headers, doc), raw=doc)
    return Problem(type="about:blank", status=status, detail=content[:500].decode("utf-8", "replace"),
                   retry_after=retry_after(headers, None))


def error_of(problem: Problem, *, job: Optional[str] = None) -> SandqError:
    """The exception of a problem (the `type`'s class, else the status's, else `GatewayError`);
    a not-found about a job (`job`: its id) is a `JobNotFound`."""
    cls = _PROBLEMS.get(problem.slug) if problem.type.startswith("urn:sandq:problem:") else None
    cls = cls or _BY_STATUS.get(problem.status) or GatewayError
    if cls is NotFound and job is not None:
        cls = JobNotFound
    what = f" (job {job})" if job is not None else ""
    message = f"{problem.status} {problem.slug}{what}: {problem.detail or problem.title}"
    return cls(message, problem=problem)


def unreachable(what: str, error: BaseException) -> Unavailable:
    """No answer from the gateway (a connection refused or cut, a time-out)."""
    return Unavailable(f"{what}: no answer from the gateway: {error!r}")


def retry_delay(status: int, problem: Optional[Problem], attempt: int) -> Optional[float]:
    """The pause before sending a request again after `attempt` (from 0) failed with `status`
    (0: no answer), or None when it is not to be retried: only no answer, 502/503/504, and a 409
    that asks for a retry (`Retry-After`: the same submission under way) are."""
    if attempt + 1 >= RETRIES:
        return None
    retryable = status in (0, 502, 503, 504) or (status == 409 and problem is not None and problem.retry_after is not None)
    if not retryable:
        return None
    backoff = RETRY_BASE_S * (2 ** attempt)
    if problem is not None and problem.retry_after is not None:
        backoff = max(backoff, problem.retry_after)
    return min(backoff, RETRY_MAX_S)


def wait_param(seconds: float) -> Optional[str]:
    """`?wait=` for `seconds` (humantime ms), None for no wait."""
    ms = int(seconds * 1000)
    return f"{ms}ms" if ms > 0 else None


def offline_log(stream: Stream) -> bytes:
    """`read_log` over HTTP: the gateway serves no logs, so only a stream whose inline text is
    exact (not truncated, not lossy) can be given; else SandqError."""
    if stream.truncated or stream.lossy:
        raise SandqError("the gateway serves no logs: this stream's exact bytes need direct mode (its inline text is cut)")
    return stream.text.encode()


class SseParser:
    """Server-sent events (the WHATWG `text/event-stream` rules) from lines without their line
    ends: `feed(line)` returns the event that line completes, as (`id`, `event`, `data`), or
    None. Comments (`:`), `retry` and unknown fields are ignored; an event without data is
    not dispatched; a partial event at the end of a cut stream is never returned."""

    def __init__(self) -> None:
        self._id: Optional[str] = None
        self._event = ""
        self._data: list[str] = []

    def feed(self, line: str) -> Optional[tuple[Optional[str], str, str]]:
        if line == "":
            if not self._data:
                self._event = ""
                return None
            out = (self._id, self._event or "message", "\n".join(self._data))
            self._event, self._data = "", []
            return out
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        return None

    def lines(self, lines: Iterator[str]) -> Iterator[tuple[Optional[str], str, str]]:
        for line in lines:
            event = self.feed(line)
            if event is not None:
                yield event


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def event_of(sse_id: Optional[str], kind: str, data: str) -> Optional[Event]:
    """The `Event` (the Redis stream entry's form, docs/protocol.md "Live events") of one
    server-sent event of `GET /v1/jobs/{id}/events` (docs/gateway.md "Live events"): `started`,
    `finished` and `requeued` are `status` events (`state` `started`, `finished`, `queued`),
    `stdout`/`stderr`'s `text` and `display`'s `output` (as JSON) are the `data` field. None
    for an event without an id, or whose data is not a JSON object."""
    if sse_id is None:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    fields: dict[str, str] = {}
    if doc.get("attempt") is not None:
        fields["attempt"] = _text(doc["attempt"])
    if doc.get("seq") is not None:
        fields["seq"] = _text(doc["seq"])
    rest = {k: v for k, v in doc.items() if k not in ("attempt", "seq") and v is not None}
    states = {"started": "started", "finished": "finished", "requeued": "queued"}
    if kind in states:
        fields["type"], fields["state"] = "status", states[kind]
    else:
        fields["type"] = kind
    if kind in ("stdout", "stderr"):
        fields["data"] = _text(rest.pop("text", ""))
    elif kind == "display":
        fields["data"] = json.dumps(rest.pop("output", None))
    for k, v in rest.items():
        fields[k] = _text(v)
    return Event.from_wire(sse_id, fields)
