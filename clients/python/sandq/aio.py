"""The asyncio client: `AsyncClient`, `sandq.Client`'s twin, a facade over an asyncio transport
(`sandq.transport.AsyncTransport`): direct mode (`_aio_direct`: aio-pika, redis.asyncio, boto3
in a thread) or HTTP mode (`_aio_gateway`: sandq-gateway with httpx's async client)."""
from __future__ import annotations

import asyncio
import inspect
import os
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional, Union

from . import gateway
from ._files import Source, check_download, input_file, read_source, target_of, work_path
from ._wait import Waiting, remaining
from .events import Callbacks, Transcript
from .protocol import BLOCK_S, EVENTS_START, Config, new_session_name
from .transport import AsyncTransport
from .types import Artifact, Event, InputFile, JobResult, Output, Stream

__all__ = ["AsyncClient", "AsyncHttpClient", "AsyncSession"]


class AsyncClient:
    """The asyncio twin of `sandq.Client`: the same methods, awaitable (`events` an async
    iterator; a callback may be a plain function or return an awaitable), and the same two
    modes (`AsyncClient(url=..., api_key=...)`, or `$SANDQ_URL`, is a `sandq.AsyncHttpClient`
    speaking to sandq-gateway), and the same `unserved=` ("warn", "refuse", "ignore"); no
    `declare_topology`. Use `async with AsyncClient() as client:` or call `aclose()`."""

    transport: AsyncTransport

    def __new__(cls, config: Optional[Config] = None, *, namespace: Optional[str] = None, url: Optional[str] = None,
                api_key: Optional[str] = None, unserved: Optional[str] = None) -> "AsyncClient":
        if cls is AsyncClient and gateway.takes_http(config, namespace, url, api_key, unserved):
            return super().__new__(AsyncHttpClient)
        return super().__new__(cls)

    def __init__(self, config: Optional[Config] = None, *, namespace: Optional[str] = None, url: Optional[str] = None,
                 api_key: Optional[str] = None, unserved: Optional[str] = None):
        if url or api_key:
            raise ValueError("url= and api_key= are HTTP mode's: sandq.AsyncClient or sandq.AsyncHttpClient, "
                             "not a subclass of the direct client")
        from ._aio_direct import AsyncDirectTransport
        self.transport = AsyncDirectTransport(config, namespace=namespace, unserved=unserved)

    def __getattr__(self, name: str) -> Any:
        # The transport's attributes (`redis`, `names`, `url`...), once `__init__` has set it.
        if name.startswith("__") or "transport" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.transport, name)

    # --- files -----------------------------------------------------------------------------
    async def upload(self, source: Source, path: Optional[str] = None) -> InputFile:
        """`sandq.Client.upload`, asyncio (the file is read in a thread)."""
        data = await asyncio.to_thread(read_source, source)
        file = input_file(data, work_path(source, path))
        await self.transport.store(data, file.sha256)
        return file

    async def download(self, artifact: Artifact) -> bytes:
        """`sandq.Client.download`, asyncio."""
        return check_download(artifact, await self.transport.fetch(artifact))

    async def download_to(self, artifact: Artifact, dest: Union[str, os.PathLike]) -> Path:
        target = target_of(artifact, dest)
        target.write_bytes(await self.download(artifact))
        return target

    async def read_log(self, stream: Stream) -> bytes:
        """`sandq.Client.read_log`, asyncio."""
        return await self.transport.read_log(stream)

    # --- submitting ------------------------------------------------------------------------
    async def submit(self, code: Optional[str] = None, **spec: Any) -> str:
        """`sandq.Client.submit`, asyncio (the same question about the SKU first)."""
        return await self.transport.submit(code, spec)

    # --- results ---------------------------------------------------------------------------
    async def status(self, job_id: str) -> Optional[JobResult]:
        return await self.transport.result(job_id, 0.0)

    async def wait(self, job_id: str, timeout: Optional[float] = None, *, raise_on_error: bool = True,
                   block_s: Optional[float] = None) -> JobResult:
        """`sandq.Client.wait`, asyncio."""
        block = self.transport.block_s if block_s is None else block_s
        waiting = Waiting(job_id, timeout, block, self.transport.unknown, raise_on_error)
        result = None
        while result is None:
            result = waiting.done(await self.transport.result(job_id, waiting.left()))
        return result

    async def run(self, code: Optional[str] = None, *, wait_timeout: Optional[float] = None,
                  raise_on_error: bool = True, on_stdout: Optional[Callable[[str], Any]] = None,
                  on_stderr: Optional[Callable[[str], Any]] = None, on_display: Optional[Callable[[Output], Any]] = None,
                  on_event: Optional[Callable[[Event], Any]] = None, **spec: Any) -> JobResult:
        """`sandq.Client.run`, asyncio: a callback may be a plain function or return an awaitable
        (an `async def`), which is awaited before the next event is read."""
        job_id = await self.submit(code, **spec)
        callbacks = Callbacks(on_stdout, on_stderr, on_display, on_event)
        if callbacks:
            started = time.monotonic()
            await self._follow(job_id, callbacks, EVENTS_START, BLOCK_S, wait_timeout)
            wait_timeout = remaining(wait_timeout, started)
        return await self.wait(job_id, wait_timeout, raise_on_error=raise_on_error)

    # --- live events -----------------------------------------------------------------------
    async def events(self, job_id: str, cursor: str = EVENTS_START, *, block: float = BLOCK_S,
                     timeout: Optional[float] = None) -> AsyncIterator[Event]:
        """`sandq.Client.events`, asyncio: `async for event in client.events(job_id): ...`."""
        if not 0 < block <= BLOCK_S:
            raise ValueError(f"block must be more than 0 and at most {BLOCK_S} s, not {block}")
        async for event in self.transport.events(job_id, cursor, block, timeout):
            yield event

    async def follow(self, job_id: str, cursor: str = EVENTS_START, *, on_stdout: Optional[Callable[[str], Any]] = None,
                     on_stderr: Optional[Callable[[str], Any]] = None,
                     on_display: Optional[Callable[[Output], Any]] = None,
                     on_event: Optional[Callable[[Event], Any]] = None, block: float = BLOCK_S,
                     timeout: Optional[float] = None) -> Transcript:
        """`sandq.Client.follow`, asyncio; callbacks as in `run`."""
        return await self._follow(job_id, Callbacks(on_stdout, on_stderr, on_display, on_event), cursor, block, timeout)

    async def _follow(self, job_id: str, callbacks: Callbacks, cursor: str, block: float,
                      timeout: Optional[float]) -> Transcript:
        transcript = Transcript()
        async for event in self.events(job_id, cursor, block=block, timeout=timeout):
            for callback, argument in callbacks.calls(event, transcript.push(event)):
                returned = callback(argument)
                if inspect.isawaitable(returned):
                    await returned
        return transcript

    async def cancel(self, job_id: str) -> bool:
        return await self.transport.cancel(job_id)

    # --- sessions --------------------------------------------------------------------------
    def session(self, name: Optional[str] = None) -> "AsyncSession":
        return AsyncSession(self, name or new_session_name())

    async def sessions(self) -> list[tuple[str, Optional[int]]]:
        return await self.transport.sessions()

    # --- lifetime --------------------------------------------------------------------------
    async def aclose(self) -> None:
        await self.transport.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncHttpClient(AsyncClient):
    """`sandq.HttpClient`, asyncio (what `AsyncClient(url=..., api_key=...)` is): the same
    facade, always over sandq-gateway (`_aio_gateway.AsyncGatewayTransport`)."""

    def __init__(self, config: Optional[Config] = None, *, namespace: Optional[str] = None, url: Optional[str] = None,
                 api_key: Optional[str] = None):
        from ._aio_gateway import AsyncGatewayTransport
        self.transport = AsyncGatewayTransport(*gateway.required_target("AsyncHttpClient", config, namespace, url, api_key))

    def __repr__(self) -> str:
        return f"AsyncHttpClient(url={self.url!r})"


class AsyncSession:
    """Jobs of one session (`session=` set on each)."""

    def __init__(self, client: AsyncClient, name: str):
        self.client, self.name = client, name

    async def submit(self, code: Optional[str] = None, **spec: Any) -> str:
        return await self.client.submit(code, session=self.name, **spec)

    async def run(self, code: Optional[str] = None, **kwargs: Any) -> JobResult:
        """`AsyncClient.run` in the session (the same keywords, the callbacks included)."""
        return await self.client.run(code, session=self.name, **kwargs)
