"""HTTP mode, blocking: sandq-gateway (docs/gateway.md) with httpx. Also what the asyncio twin
(`_aio_gateway`) shares: the clients' settings, the retry decisions, an event stream's state
(`EventStream`). The pure parts of HTTP mode (which mode, the job's JSON, problems, SSE) are
`sandq.gateway`'s."""
from __future__ import annotations

import itertools
import time
from typing import Any, Iterator, Optional

import httpx

from . import gateway
from .errors import Conflict, NotFound, SandqError, SubmitError, Unavailable
from .events import ACTIVE
from .types import Artifact, Event, JobResult, Stream

# The answers `download`'s request for an artifact takes: a redirect to its presigned URL.
REDIRECTS = (301, 302, 303, 307, 308)


def timeouts(read: float) -> httpx.Timeout:
    return httpx.Timeout(gateway.CONNECT_S, read=read)


def timeout_of_stream(idle: float) -> httpx.Timeout:
    """An event stream's time-outs: connect and write as any request, a read at most `idle`."""
    return httpx.Timeout(gateway.CONNECT_S, read=max(0.05, idle))


def client_settings(url: str, api_key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The httpx client settings for the gateway (the key, no redirects followed), and for
    presigned S3 URLs (another origin: no key)."""
    keyed = dict(base_url=url, timeout=timeouts(gateway.READ_S), follow_redirects=False,
                 headers={"Authorization": f"Bearer {api_key}", "User-Agent": gateway.USER_AGENT})
    plain = dict(timeout=timeouts(gateway.READ_S), follow_redirects=True, headers={"User-Agent": gateway.USER_AGENT})
    return keyed, plain


def pause_after_answer(response: httpx.Response, attempt: int, job: Optional[str]) -> float:
    """The pause before sending a request again after attempt `attempt` (from 0) got an error
    answer; raises the problem's exception when it is not to be retried (`job`: the job the
    request is about, for `JobNotFound`). The answer's body must have been read."""
    problem = gateway.problem_of(response.status_code, response.headers, response.content)
    delay = gateway.retry_delay(response.status_code, problem, attempt)
    if delay is None:
        raise gateway.error_of(problem, job=job)
    return delay


def pause_after_silence(what: str, error: BaseException, attempt: int) -> float:
    """The pause before sending a request again after attempt `attempt` got no answer;
    `Unavailable` when the retries ran out."""
    delay = gateway.retry_delay(0, None, attempt)
    if delay is None:
        raise gateway.unreachable(what, error) from error
    return delay


def stored(answer: Any, data: bytes, digest: str) -> None:
    """Checks `POST /v1/files`'s answer against the file sent."""
    if answer.get("file_id") != digest or answer.get("size") != len(data):
        raise SandqError(f"the gateway stored {answer!r} for a file of {len(data)} bytes with sha256 {digest}")


def artifact_request(artifact: Artifact) -> Optional[str]:
    """The gateway's path of a result's artifact; None for one to fetch by its own URL (a rich
    output's representation); SandqError for one with neither."""
    if artifact.job_id:
        return f"{gateway.job_path(artifact.job_id)}/artifacts/{gateway.quote(artifact.path)}"
    if artifact.url:
        return None
    raise SandqError(f"artifact {artifact.path} has neither a job nor a URL to fetch it by")


def redirected(path: str, response: httpx.Response) -> str:
    """Where the gateway's redirect for an artifact points."""
    url = response.headers.get("location")
    if not url:
        raise SandqError(f"{path}: a redirect without a Location")
    return str(response.url.join(url))


def fetched(artifact: Artifact, response: httpx.Response) -> bytes:
    if response.status_code != 200:
        raise SandqError(f"artifact {artifact.path}: its URL answered {response.status_code}")
    return response.content


def result_request(job_id: str, wait: float) -> dict[str, Any]:
    """`GET /v1/jobs/{id}`'s request options for a wait of `wait` s."""
    param = gateway.wait_param(wait)
    return dict(job=job_id, params={"wait": param} if param else None, timeout=timeouts(wait + gateway.READ_S))


def sessions_of(answer: Any) -> list[tuple[str, Optional[int]]]:
    """`GET /v1/sessions`'s sessions, soonest expiry first; one without expiry (None) last."""
    rows = [(str(s["name"]), s.get("expires_at_ms")) for s in answer.get("sessions") or []]
    return sorted(rows, key=lambda r: (r[1] is None, r[1] or 0, r[0]))


def active(result: Optional[JobResult]) -> bool:
    return result is not None and result.status in ACTIVE


class EventStream:
    """The state of one `events` call over `GET /v1/jobs/{id}/events`, across the connections
    it opens: the cursor (sent as `Last-Event-ID`), the failures in a row, the deadline."""

    def __init__(self, job_id: str, cursor: str, timeout: Optional[float]):
        self.job_id, self.cursor = job_id, cursor
        self.path = f"{gateway.job_path(job_id)}/events"
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.failures = 0
        self.got = False
        self.finished = False
        self._parser = gateway.SseParser()

    def open(self) -> Optional[dict[str, Any]]:
        """The next connection's request options; None when the events are over (the job ended
        with nothing left, or the deadline has passed)."""
        left = gateway.STREAM_IDLE_S if self.deadline is None else min(gateway.STREAM_IDLE_S, self.deadline - time.monotonic())
        if left <= 0 or self.finished:
            return None
        self.got, self._parser = False, gateway.SseParser()
        return dict(headers={"Last-Event-ID": self.cursor, "Accept": "text/event-stream"}, timeout=timeout_of_stream(left))

    def refused(self, response: httpx.Response) -> float:
        """The pause after an answer other than 200 (read), or its exception."""
        delay = pause_after_answer(response, self.failures, self.job_id)
        self.failures += 1
        return delay

    def feed(self, line: str) -> Optional[Event]:
        """The event a line completes, if any."""
        sse = self._parser.feed(line)
        event = None if sse is None else gateway.event_of(*sse)
        if event is not None:
            self.cursor, self.failures, self.got = event.id, 0, True
        return event

    def over(self, event: Event) -> bool:
        """The events end after this one (`end`, or the deadline)."""
        return event.type == "end" or (self.deadline is not None and time.monotonic() >= self.deadline)

    def dropped(self, error: httpx.TransportError) -> float:
        """The pause before reopening a connection that failed: none after a silence of
        `STREAM_IDLE_S`, or past the deadline (`open` then ends the events); `Unavailable` after
        `gateway.RETRIES` failures in a row."""
        if (self.deadline is not None and time.monotonic() >= self.deadline) or isinstance(error, httpx.ReadTimeout):
            return 0.0
        delay = pause_after_silence(f"GET {self.path}", error, self.failures)
        self.failures += 1
        return delay

    def ended(self, still_active: bool) -> float:
        """After the gateway ended the stream: the events are over when the job is (nothing is
        left); else the pause before reopening (the stream reached `max_stream_life`)."""
        self.finished = not still_active
        return 0.0 if self.got or self.finished else gateway.RETRY_BASE_S


class GatewayBase:
    """What both gateway transports hold: the gateway's URL, an httpx client with the API key
    (`Authorization: Bearer`, no redirects followed) and one without it for presigned S3 URLs
    (another origin), of `client_class` (`httpx.Client` or `httpx.AsyncClient`)."""

    config = None
    block_s = gateway.WAIT_S
    unknown = "never submitted, another tenant's, or its result expired"

    def __init__(self, url: str, api_key: str, client_class: Any):
        self.url = url
        keyed, plain = client_settings(url, api_key)
        self._http = client_class(**keyed)
        self._plain = client_class(**plain)


class GatewayTransport(GatewayBase):
    """`sandq.transport.Transport` over sandq-gateway: every call a request with the API key.
    Requests that got no answer, a 502/503/504, or a 409 asking for a retry are sent again
    (`sandq.gateway.RETRIES` times in all, backing off); every request is safe to repeat (a
    submission carries its job id and `Idempotency-Key`). Error answers raise the
    `sandq.errors` class of their problem type. Thread-safe."""

    def __init__(self, url: str, api_key: str):
        super().__init__(url, api_key, httpx.Client)

    def _request(self, method: str, path: str, *, job: Optional[str] = None, ok: tuple[int, ...] = (200,),
                 **kwargs: Any) -> httpx.Response:
        """Sends a request (again after a failure worth retrying) and returns an answer whose
        status is in `ok`; raises the problem's exception for any other (`job`: the job the
        request is about, for `JobNotFound`), `Unavailable` when no answer came."""
        for attempt in itertools.count():
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as e:
                time.sleep(pause_after_silence(f"{method} {path}", e, attempt))
                continue
            if response.status_code in ok:
                return response
            time.sleep(pause_after_answer(response, attempt, job))
        raise AssertionError("unreachable")

    # --- files -----------------------------------------------------------------------------
    def store(self, data: bytes, digest: str) -> None:
        """`POST /v1/files`: the file is the tenant's for the gateway's `file_ttl`."""
        response = self._request("POST", "/v1/files", ok=(200, 201), content=data,
                                 headers={"Content-Type": "application/octet-stream"})
        stored(response.json(), data, digest)

    def fetch(self, artifact: Artifact) -> bytes:
        """A result's artifact through `GET /v1/jobs/{id}/artifacts/{path}` (a redirect to a
        presigned URL, fetched without the key); a rich output's through its own `url`."""
        path = artifact_request(artifact)
        url = artifact.url if path is None else redirected(path, self._request("GET", path, ok=REDIRECTS))
        try:
            return fetched(artifact, self._plain.get(url))
        except httpx.TransportError as e:
            raise gateway.unreachable(f"artifact {artifact.path}", e) from e

    def read_log(self, stream: Stream) -> bytes:
        return gateway.offline_log(stream)

    # --- submitting ------------------------------------------------------------------------
    def submit(self, code: Optional[str], spec: dict[str, Any]) -> str:
        """`POST /v1/jobs`, sent again on no answer or 503 with the same body and job id."""
        job_id, body, headers = gateway.job_request(code, spec)
        try:
            self._request("POST", "/v1/jobs", ok=(200, 201), content=body, headers=headers)
        except Unavailable as e:
            raise SubmitError(f"job {job_id} not submitted: {e}", problem=e.problem) from e
        return job_id

    def declare_topology(self) -> None:
        raise SandqError("the gateway declares the topology: declare_topology needs direct mode")

    # --- results ---------------------------------------------------------------------------
    def result(self, job_id: str, wait: float) -> Optional[JobResult]:
        """`GET /v1/jobs/{id}?wait=`; None when the gateway has no such job for this tenant."""
        try:
            return JobResult.from_wire(self._request("GET", gateway.job_path(job_id), **result_request(job_id, wait)).json())
        except NotFound:
            return None

    def events(self, job_id: str, cursor: str, block: float, timeout: Optional[float]) -> Iterator[Event]:
        """Server-sent events; a dropped or silent connection is reopened after the last event."""
        stream = EventStream(job_id, cursor, timeout)
        while (options := stream.open()) is not None:
            try:
                with self._http.stream("GET", stream.path, **options) as response:
                    if response.status_code != 200:
                        response.read()
                        time.sleep(stream.refused(response))
                        continue
                    for line in response.iter_lines():
                        if (event := stream.feed(line)) is not None:
                            yield event
                            if stream.over(event):
                                return
            except httpx.TransportError as e:
                time.sleep(stream.dropped(e))
                continue
            time.sleep(stream.ended(active(self.result(job_id, 0.0))))

    def cancel(self, job_id: str) -> bool:
        """`DELETE /v1/jobs/{id}`."""
        try:
            self._request("DELETE", gateway.job_path(job_id), job=job_id, ok=(200, 202))
        except (NotFound, Conflict):
            return False
        return True

    def sessions(self) -> list[tuple[str, Optional[int]]]:
        return sessions_of(self._request("GET", "/v1/sessions").json())

    def close(self) -> None:
        self._http.close()
        self._plain.close()
