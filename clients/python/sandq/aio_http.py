"""HTTP mode, asyncio: `sandq.aio.AsyncClient`'s API through sandq-gateway (docs/gateway.md)
with httpx's async client; `sandq.http.HttpClient`'s twin (the same requests, retries, errors
and stream resumption)."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, AsyncIterator, Optional

import httpx

from . import gateway, protocol
from .aio import AsyncClient
from .client import Source, check_download, read_source
from .errors import (RAISED_BY_WAIT, Conflict, JobNotFound, NotFound, SandqError, SubmitError, Unavailable, WaitTimeout,
                     error_for)
from .events import ACTIVE
from .http import timeout_of_stream, timeouts
from .protocol import BLOCK_S, EVENTS_START, Config
from .types import Artifact, Event, InputFile, JobResult, Stream


class AsyncHttpClient(AsyncClient):
    """`sandq.http.HttpClient`, asyncio: the same methods, awaitable (`events` is an async
    iterator). Use `async with` or call `aclose()`."""

    def __init__(self, config: Optional[Config] = None, *, namespace: Optional[str] = None, url: Optional[str] = None,
                 api_key: Optional[str] = None):
        target = gateway.http_target(config, namespace, url, api_key)
        if target is None:
            raise ValueError("AsyncHttpClient needs url= or $SANDQ_URL")
        self.url, api_key = target
        self.config = None  # type: ignore[assignment]
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeouts(gateway.READ_S), follow_redirects=False,
                                       headers={"Authorization": f"Bearer {api_key}", "User-Agent": gateway.USER_AGENT})
        self._plain = httpx.AsyncClient(timeout=timeouts(gateway.READ_S), follow_redirects=True,
                                        headers={"User-Agent": gateway.USER_AGENT})

    def __repr__(self) -> str:
        return f"AsyncHttpClient(url={self.url!r})"

    async def _request(self, method: str, path: str, *, job: Optional[str] = None, ok: tuple[int, ...] = (200,),
                       **kwargs: Any) -> httpx.Response:
        """`HttpClient._request`, asyncio."""
        attempt = 0
        while True:
            try:
                response = await self._http.request(method, path, **kwargs)
            except httpx.TransportError as e:
                delay = gateway.retry_delay(0, None, attempt)
                if delay is None:
                    raise gateway.unreachable(f"{method} {path}", e) from e
                await asyncio.sleep(delay)
                attempt += 1
                continue
            if response.status_code in ok:
                return response
            problem = gateway.problem_of(response.status_code, response.headers, response.content)
            delay = gateway.retry_delay(response.status_code, problem, attempt)
            if delay is None:
                raise gateway.error_of(problem, job=job)
            await asyncio.sleep(delay)
            attempt += 1

    # --- files -----------------------------------------------------------------------------
    async def upload(self, source: Source, path: Optional[str] = None) -> InputFile:
        data = await asyncio.to_thread(read_source, source)
        if path is None:
            if isinstance(source, (bytes, bytearray, memoryview)):
                raise ValueError("give the path inside /work for bytes")
            path = Path(source).name
        digest = protocol.sha256_hex(data)
        response = await self._request("POST", "/v1/files", ok=(200, 201), content=data,
                                       headers={"Content-Type": "application/octet-stream"})
        answer = response.json()
        if answer.get("file_id") != digest or answer.get("size") != len(data):
            raise SandqError(f"the gateway stored {answer!r} for a file of {len(data)} bytes with sha256 {digest}")
        return InputFile(key=protocol.input_key(digest), path=path, size=len(data), sha256=digest)

    async def download(self, artifact: Artifact) -> bytes:
        if artifact.job_id:
            path = f"{gateway.job_path(artifact.job_id)}/artifacts/{gateway.quote(artifact.path)}"
            response = await self._request("GET", path, ok=(301, 302, 303, 307, 308))
            url = response.headers.get("location")
            if not url:
                raise SandqError(f"{path}: a redirect without a Location")
            url = str(response.url.join(url))
        elif artifact.url:
            url = artifact.url
        else:
            raise SandqError(f"artifact {artifact.path} has neither a job nor a URL to fetch it by")
        try:
            fetched = await self._plain.get(url)
        except httpx.TransportError as e:
            raise gateway.unreachable(f"artifact {artifact.path}", e) from e
        if fetched.status_code != 200:
            raise SandqError(f"artifact {artifact.path}: its URL answered {fetched.status_code}")
        return check_download(artifact, fetched.content)

    async def read_log(self, stream: Stream) -> bytes:
        return gateway.offline_log(stream)

    # --- submitting ------------------------------------------------------------------------
    async def submit(self, code: Optional[str] = None, **spec: Any) -> str:
        """`sandq.http.HttpClient.submit`, asyncio."""
        job_id, body, headers = gateway.job_request(code, spec)
        try:
            await self._request("POST", "/v1/jobs", ok=(200, 201), content=body, headers=headers)
        except Unavailable as e:
            raise SubmitError(f"job {job_id} not submitted: {e}", problem=e.problem) from e
        return job_id

    # --- results ---------------------------------------------------------------------------
    async def _get(self, job_id: str, wait: float = 0.0) -> Optional[JobResult]:
        param = gateway.wait_param(wait)
        try:
            response = await self._request("GET", gateway.job_path(job_id), job=job_id,
                                           params={"wait": param} if param else None,
                                           timeout=timeouts(wait + gateway.READ_S))
        except NotFound:
            return None
        return JobResult.from_wire(response.json())

    async def status(self, job_id: str) -> Optional[JobResult]:
        return await self._get(job_id)

    async def wait(self, job_id: str, timeout: Optional[float] = None, *, raise_on_error: bool = True,
                   block_s: float = gateway.WAIT_S) -> JobResult:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            left = block_s if deadline is None else min(block_s, deadline - loop.time())
            result = await self._get(job_id, max(0.0, left))
            if result is None:
                raise JobNotFound(f"job {job_id} is unknown (never submitted, another tenant's, or its result expired)")
            if result.terminal:
                if raise_on_error and result.status in RAISED_BY_WAIT:
                    raise error_for(result)
                return result
            if deadline is not None and loop.time() >= deadline:
                raise WaitTimeout(f"job {job_id} is still {result.status} after {timeout} s")

    # --- live events -----------------------------------------------------------------------
    async def events(self, job_id: str, cursor: str = EVENTS_START, *, block: float = BLOCK_S,
                     timeout: Optional[float] = None) -> AsyncIterator[Event]:
        """`sandq.http.HttpClient.events`, asyncio."""
        if not 0 < block <= BLOCK_S:
            raise ValueError(f"block must be more than 0 and at most {BLOCK_S} s, not {block}")
        loop = asyncio.get_running_loop()
        path = f"{gateway.job_path(job_id)}/events"
        deadline = None if timeout is None else loop.time() + timeout
        failures = 0
        while True:
            left = gateway.STREAM_IDLE_S if deadline is None else min(gateway.STREAM_IDLE_S, deadline - loop.time())
            if left <= 0:
                return
            ended, got = False, False
            try:
                async with self._http.stream("GET", path, headers={"Last-Event-ID": cursor, "Accept": "text/event-stream"},
                                             timeout=timeout_of_stream(left)) as response:
                    if response.status_code != 200:
                        await response.aread()
                        problem = gateway.problem_of(response.status_code, response.headers, response.content)
                        delay = gateway.retry_delay(response.status_code, problem, failures)
                        if delay is None:
                            raise gateway.error_of(problem, job=job_id)
                        failures += 1
                        await asyncio.sleep(delay)
                        continue
                    parser = gateway.SseParser()
                    async for line in response.aiter_lines():
                        sse = parser.feed(line)
                        if sse is None:
                            continue
                        event = gateway.event_of(*sse)
                        if event is None:
                            continue
                        cursor, failures, got = event.id, 0, True
                        yield event
                        if event.type == "end":
                            return
                        if deadline is not None and loop.time() >= deadline:
                            return
                    ended = True
            except httpx.TransportError as e:
                if deadline is not None and loop.time() >= deadline:
                    return
                if isinstance(e, httpx.ReadTimeout):
                    continue
                delay = gateway.retry_delay(0, None, failures)
                if delay is None:
                    raise gateway.unreachable(f"GET {path}", e) from e
                failures += 1
                await asyncio.sleep(delay)
                continue
            if ended:
                if not await self._active(job_id):
                    return
                if not got:
                    await asyncio.sleep(gateway.RETRY_BASE_S)

    async def _active(self, job_id: str) -> bool:
        result = await self.status(job_id)
        return result is not None and result.status in ACTIVE

    async def cancel(self, job_id: str) -> bool:
        try:
            await self._request("DELETE", gateway.job_path(job_id), job=job_id, ok=(200, 202))
        except (NotFound, Conflict):
            return False
        return True

    # --- sessions --------------------------------------------------------------------------
    async def sessions(self) -> list[tuple[str, Optional[int]]]:  # type: ignore[override]
        listed = (await self._request("GET", "/v1/sessions")).json().get("sessions") or []
        rows = [(str(s["name"]), s.get("expires_at_ms")) for s in listed]
        return sorted(rows, key=lambda r: (r[1] is None, r[1] or 0, r[0]))

    # --- lifetime --------------------------------------------------------------------------
    async def aclose(self) -> None:
        await self._http.aclose()
        await self._plain.aclose()

    async def __aenter__(self) -> "AsyncHttpClient":
        return self
