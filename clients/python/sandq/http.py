"""HTTP mode, blocking: `sandq.Client`'s API through sandq-gateway (docs/gateway.md) with httpx.

`sandq.Client(url=..., api_key=...)` (or `$SANDQ_URL` and `$SANDQ_API_KEY`: `sandq.gateway`
gives the rules) is a `HttpClient`. The methods are `Client`'s, with the gateway's ids (the
tenant's job ids and session names); what differs is said on each.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator, Optional

import httpx

from . import gateway, protocol
from .client import Client, Source, check_download, read_source
from .errors import (RAISED_BY_WAIT, Conflict, JobNotFound, NotFound, SandqError, SubmitError, Unavailable, WaitTimeout,
                     error_for)
from .events import ACTIVE
from .protocol import BLOCK_S, EVENTS_START, Config
from .types import Artifact, Event, InputFile, JobResult, Stream


def timeouts(read: float) -> httpx.Timeout:
    return httpx.Timeout(gateway.CONNECT_S, read=read)


class HttpClient(Client):
    """`sandq.Client` over HTTP: every call is a request to sandq-gateway with the API key
    (`Authorization: Bearer`). Requests that got no answer, a 502/503/504, or a 409 asking for
    a retry are sent again (`sandq.gateway.RETRIES` times in all, backing off); every request is
    safe to repeat (a submission carries its job id and `Idempotency-Key`). Error answers raise
    the `sandq.errors` class of their problem type. Thread-safe; close it when done."""

    def __init__(self, config: Optional[Config] = None, *, namespace: Optional[str] = None, url: Optional[str] = None,
                 api_key: Optional[str] = None):
        target = gateway.http_target(config, namespace, url, api_key)
        if target is None:
            raise ValueError("HttpClient needs url= or $SANDQ_URL")
        self.url, api_key = target
        self.config = None  # type: ignore[assignment]
        self._http = httpx.Client(base_url=self.url, timeout=timeouts(gateway.READ_S), follow_redirects=False,
                                  headers={"Authorization": f"Bearer {api_key}", "User-Agent": gateway.USER_AGENT})
        # Presigned S3 URLs are fetched without the key (another origin).
        self._plain = httpx.Client(timeout=timeouts(gateway.READ_S), follow_redirects=True,
                                   headers={"User-Agent": gateway.USER_AGENT})

    def __repr__(self) -> str:
        return f"HttpClient(url={self.url!r})"

    # --- requests --------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, job: Optional[str] = None, ok: tuple[int, ...] = (200,),
                 **kwargs: Any) -> httpx.Response:
        """Sends a request (again after a failure worth retrying) and returns an answer whose
        status is in `ok`; raises the problem's exception for any other (`job`: the job the
        request is about, for `JobNotFound`), `Unavailable` when no answer came."""
        attempt = 0
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as e:
                delay = gateway.retry_delay(0, None, attempt)
                if delay is None:
                    raise gateway.unreachable(f"{method} {path}", e) from e
                time.sleep(delay)
                attempt += 1
                continue
            if response.status_code in ok:
                return response
            problem = gateway.problem_of(response.status_code, response.headers, response.content)
            delay = gateway.retry_delay(response.status_code, problem, attempt)
            if delay is None:
                raise gateway.error_of(problem, job=job)
            time.sleep(delay)
            attempt += 1

    # --- files -----------------------------------------------------------------------------
    def upload(self, source: Source, path: Optional[str] = None) -> InputFile:
        """`POST /v1/files`: the file is the tenant's for the gateway's `file_ttl` (7 days by
        default); give the returned `InputFile` in a job's `inputs`."""
        data = read_source(source)
        if path is None:
            if isinstance(source, (bytes, bytearray, memoryview)):
                raise ValueError("give the path inside /work for bytes")
            path = Path(source).name
        digest = protocol.sha256_hex(data)
        response = self._request("POST", "/v1/files", ok=(200, 201), content=data,
                                 headers={"Content-Type": "application/octet-stream"})
        answer = response.json()
        if answer.get("file_id") != digest or answer.get("size") != len(data):
            raise SandqError(f"the gateway stored {answer!r} for a file of {len(data)} bytes with sha256 {digest}")
        return InputFile(key=protocol.input_key(digest), path=path, size=len(data), sha256=digest)

    def download(self, artifact: Artifact) -> bytes:
        """An artifact of a result's `artifacts` through `GET /v1/jobs/{id}/artifacts/{path}`
        (a redirect to a presigned URL, fetched without the key); a rich output's
        representation (no `job_id`) through its own presigned `url`. Checked against its size
        and sha256. `NotFound` when the gateway has no such artifact for this tenant."""
        if artifact.job_id:
            path = f"{gateway.job_path(artifact.job_id)}/artifacts/{gateway.quote(artifact.path)}"
            response = self._request("GET", path, ok=(301, 302, 303, 307, 308))
            url = response.headers.get("location")
            if not url:
                raise SandqError(f"{path}: a redirect without a Location")
            url = str(response.url.join(url))
        elif artifact.url:
            url = artifact.url
        else:
            raise SandqError(f"artifact {artifact.path} has neither a job nor a URL to fetch it by")
        try:
            fetched = self._plain.get(url)
        except httpx.TransportError as e:
            raise gateway.unreachable(f"artifact {artifact.path}", e) from e
        if fetched.status_code != 200:
            raise SandqError(f"artifact {artifact.path}: its URL answered {fetched.status_code}")
        return check_download(artifact, fetched.content)

    def read_log(self, stream: Stream) -> bytes:
        """The gateway serves no logs: the inline text when it is exact (not truncated or
        lossy), else SandqError."""
        return gateway.offline_log(stream)

    # --- submitting ------------------------------------------------------------------------
    def submit(self, code: Optional[str] = None, **spec: Any) -> str:
        """`POST /v1/jobs`; returns the job id (the tenant's) once the gateway queued it.
        `Client.submit`'s keywords but `entrypoint` (the gateway runs `code`), with `stdin` as
        text, plus `callback_url` (docs/gateway.md "Webhooks"). The default SKU is the SDK's
        (`M`), as in direct mode. Sent again on no answer or 503 with the same body and job id
        (`Idempotency-Key`), so a retry finds the same job; raises `SubmitError` when the
        retries ran out (the job may be queued: submit again with `job_id=` that id), and
        `InvalidRequest`, `ForbiddenByQuota`, `QuotaExceeded`, `Conflict`, `Unauthorized` for
        the gateway's refusals."""
        job_id, body, headers = gateway.job_request(code, spec)
        try:
            self._request("POST", "/v1/jobs", ok=(200, 201), content=body, headers=headers)
        except Unavailable as e:
            raise SubmitError(f"job {job_id} not submitted: {e}", problem=e.problem) from e
        return job_id

    def declare_topology(self) -> None:
        raise SandqError("the gateway declares the topology: declare_topology needs direct mode")

    # --- results ---------------------------------------------------------------------------
    def _get(self, job_id: str, wait: float = 0.0) -> Optional[JobResult]:
        param = gateway.wait_param(wait)
        try:
            response = self._request("GET", gateway.job_path(job_id), job=job_id, params={"wait": param} if param else None,
                                     timeout=timeouts(wait + gateway.READ_S))
        except NotFound:
            return None
        return JobResult.from_wire(response.json())

    def status(self, job_id: str) -> Optional[JobResult]:
        """`GET /v1/jobs/{id}`: the job's current result; None when the gateway has no such job
        for this tenant."""
        return self._get(job_id)

    def wait(self, job_id: str, timeout: Optional[float] = None, *, raise_on_error: bool = True,
             block_s: float = gateway.WAIT_S) -> JobResult:
        """`Client.wait` with `GET /v1/jobs/{id}?wait=` (each at most `block_s`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = block_s if deadline is None else min(block_s, deadline - time.monotonic())
            result = self._get(job_id, max(0.0, left))
            if result is None:
                raise JobNotFound(f"job {job_id} is unknown (never submitted, another tenant's, or its result expired)")
            if result.terminal:
                if raise_on_error and result.status in RAISED_BY_WAIT:
                    raise error_for(result)
                return result
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"job {job_id} is still {result.status} after {timeout} s")

    # --- live events -----------------------------------------------------------------------
    def events(self, job_id: str, cursor: str = EVENTS_START, *, block: float = BLOCK_S,
               timeout: Optional[float] = None) -> Iterator[Event]:
        """`Client.events` through `GET /v1/jobs/{id}/events` (server-sent events). A dropped
        or silent connection (`sandq.gateway.STREAM_IDLE_S`) is reopened with `Last-Event-ID`,
        the last event's id: the events go on with no gap and no duplicate. `block` is checked
        but has no other effect. Raises `JobNotFound` when the gateway has no such job for this
        tenant, `Unavailable` after `sandq.gateway.RETRIES` failed connections in a row."""
        if not 0 < block <= BLOCK_S:
            raise ValueError(f"block must be more than 0 and at most {BLOCK_S} s, not {block}")
        path = f"{gateway.job_path(job_id)}/events"
        deadline = None if timeout is None else time.monotonic() + timeout
        failures = 0
        while True:
            left = gateway.STREAM_IDLE_S if deadline is None else min(gateway.STREAM_IDLE_S, deadline - time.monotonic())
            if left <= 0:
                return
            ended, got = False, False
            try:
                with self._http.stream("GET", path, headers={"Last-Event-ID": cursor, "Accept": "text/event-stream"},
                                       timeout=timeout_of_stream(left)) as response:
                    if response.status_code != 200:
                        response.read()
                        problem = gateway.problem_of(response.status_code, response.headers, response.content)
                        delay = gateway.retry_delay(response.status_code, problem, failures)
                        if delay is None:
                            raise gateway.error_of(problem, job=job_id)
                        failures += 1
                        time.sleep(delay)
                        continue
                    for sse_id, kind, data in gateway.SseParser().lines(response.iter_lines()):
                        event = gateway.event_of(sse_id, kind, data)
                        if event is None:
                            continue
                        cursor, failures, got = event.id, 0, True
                        yield event
                        if event.type == "end":
                            return
                        if deadline is not None and time.monotonic() >= deadline:
                            return
                    ended = True
            except httpx.TransportError as e:
                if deadline is not None and time.monotonic() >= deadline:
                    return
                if isinstance(e, httpx.ReadTimeout):
                    continue  # silent for STREAM_IDLE_S: reopen
                delay = gateway.retry_delay(0, None, failures)
                if delay is None:
                    raise gateway.unreachable(f"GET {path}", e) from e
                failures += 1
                time.sleep(delay)
                continue
            if ended:
                # The gateway ended the stream: the job is over with nothing left, or the
                # stream reached `max_stream_life` and the job still runs (reopen).
                if not self._active(job_id):
                    return
                if not got:
                    time.sleep(gateway.RETRY_BASE_S)

    def _active(self, job_id: str) -> bool:
        result = self.status(job_id)
        return result is not None and result.status in ACTIVE

    def cancel(self, job_id: str) -> bool:
        """`DELETE /v1/jobs/{id}`; False when the job is over or the gateway has no such job
        for this tenant."""
        try:
            self._request("DELETE", gateway.job_path(job_id), job=job_id, ok=(200, 202))
        except (NotFound, Conflict):
            return False
        return True

    # --- sessions --------------------------------------------------------------------------
    def sessions(self) -> list[tuple[str, Optional[int]]]:  # type: ignore[override]
        """`GET /v1/sessions`: the tenant's sessions and their expiry (Unix ms), soonest first;
        a session no job has used yet has no expiry (None, listed last)."""
        listed = self._request("GET", "/v1/sessions").json().get("sessions") or []
        rows = [(str(s["name"]), s.get("expires_at_ms")) for s in listed]
        return sorted(rows, key=lambda r: (r[1] is None, r[1] or 0, r[0]))

    # --- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        self._http.close()
        self._plain.close()

    def __enter__(self) -> "HttpClient":
        return self


def timeout_of_stream(idle: float) -> httpx.Timeout:
    """An event stream's time-outs: connect and write as any request, a read at most `idle`."""
    return httpx.Timeout(gateway.CONNECT_S, read=max(0.05, idle))

