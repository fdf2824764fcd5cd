"""HTTP mode, asyncio: sandq-gateway with httpx's async client; `_gateway.GatewayTransport`'s
twin (the same requests, retries, errors and stream resumption: the decisions are `_gateway`'s)."""
from __future__ import annotations

import asyncio
import itertools
from typing import Any, AsyncIterator, Optional

import httpx

from . import gateway
from ._gateway import (REDIRECTS, EventStream, GatewayBase, active, artifact_request, fetched, pause_after_answer,
                       pause_after_silence, redirected, result_request, sessions_of, stored)
from .errors import Conflict, NotFound, SubmitError, Unavailable
from .types import Artifact, Event, JobResult, Stream


class AsyncGatewayTransport(GatewayBase):
    """`sandq.transport.AsyncTransport` over sandq-gateway."""

    def __init__(self, url: str, api_key: str):
        super().__init__(url, api_key, httpx.AsyncClient)

    async def _request(self, method: str, path: str, *, job: Optional[str] = None, ok: tuple[int, ...] = (200,),
                       **kwargs: Any) -> httpx.Response:
        """`GatewayTransport._request`, asyncio."""
        for attempt in itertools.count():
            try:
                response = await self._http.request(method, path, **kwargs)
            except httpx.TransportError as e:
                await asyncio.sleep(pause_after_silence(f"{method} {path}", e, attempt))
                continue
            if response.status_code in ok:
                return response
            await asyncio.sleep(pause_after_answer(response, attempt, job))
        raise AssertionError("unreachable")

    # --- files -----------------------------------------------------------------------------
    async def store(self, data: bytes, digest: str) -> None:
        response = await self._request("POST", "/v1/files", ok=(200, 201), content=data,
                                       headers={"Content-Type": "application/octet-stream"})
        stored(response.json(), data, digest)

    async def fetch(self, artifact: Artifact) -> bytes:
        path = artifact_request(artifact)
        url = artifact.url if path is None else redirected(path, await self._request("GET", path, ok=REDIRECTS))
        try:
            return fetched(artifact, await self._plain.get(url))
        except httpx.TransportError as e:
            raise gateway.unreachable(f"artifact {artifact.path}", e) from e

    async def read_log(self, stream: Stream) -> bytes:
        return gateway.offline_log(stream)

    # --- submitting ------------------------------------------------------------------------
    async def submit(self, code: Optional[str], spec: dict[str, Any]) -> str:
        job_id, body, headers = gateway.job_request(code, spec)
        try:
            await self._request("POST", "/v1/jobs", ok=(200, 201), content=body, headers=headers)
        except Unavailable as e:
            raise SubmitError(f"job {job_id} not submitted: {e}", problem=e.problem) from e
        return job_id

    # --- results ---------------------------------------------------------------------------
    async def result(self, job_id: str, wait: float) -> Optional[JobResult]:
        try:
            response = await self._request("GET", gateway.job_path(job_id), **result_request(job_id, wait))
        except NotFound:
            return None
        return JobResult.from_wire(response.json())

    async def events(self, job_id: str, cursor: str, block: float, timeout: Optional[float]) -> AsyncIterator[Event]:
        stream = EventStream(job_id, cursor, timeout)
        while (options := stream.open()) is not None:
            try:
                async with self._http.stream("GET", stream.path, **options) as response:
                    if response.status_code != 200:
                        await response.aread()
                        await asyncio.sleep(stream.refused(response))
                        continue
                    async for line in response.aiter_lines():
                        if (event := stream.feed(line)) is not None:
                            yield event
                            if stream.over(event):
                                return
            except httpx.TransportError as e:
                await asyncio.sleep(stream.dropped(e))
                continue
            await asyncio.sleep(stream.ended(active(await self.result(job_id, 0.0))))

    async def cancel(self, job_id: str) -> bool:
        try:
            await self._request("DELETE", gateway.job_path(job_id), job=job_id, ok=(200, 202))
        except (NotFound, Conflict):
            return False
        return True

    async def sessions(self) -> list[tuple[str, Optional[int]]]:
        return sessions_of((await self._request("GET", "/v1/sessions")).json())

    async def aclose(self) -> None:
        await self._http.aclose()
        await self._plain.aclose()
