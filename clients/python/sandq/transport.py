"""What a client asks of a mode: direct (`_direct.DirectTransport`: the broker, Redis and S3) or
through sandq-gateway over HTTP (`_gateway.GatewayTransport`), and their asyncio twins
(`_aio_direct`, `_aio_gateway`). `sandq.Client` and `sandq.aio.AsyncClient` are facades over
one: they add what both modes share (an upload's name and content address, the download's
check, `wait`'s loop and what it raises, `run`, `follow`, sessions); a transport is the same
calls done its way. Internal: the clients are the API (`client.transport` is the one taken).
"""
from __future__ import annotations

from typing import Any, AsyncIterator, Iterator, Optional, Protocol

from .types import Artifact, Event, JobResult, Stream


class Transport(Protocol):
    """The blocking calls of a mode."""

    #: Direct mode's `Config`; None over HTTP.
    config: Any
    #: The longest single wait of `result` (s): `wait`'s `block_s` when none is given.
    block_s: float
    #: Why a job may be unknown, for `JobNotFound`'s message.
    unknown: str

    def store(self, data: bytes, digest: str) -> None:
        """Makes `data` (whose sha256 is `digest`) an input a job can name by its content address."""

    def fetch(self, artifact: Artifact) -> bytes:
        """An artifact's bytes, not yet checked against its size and sha256."""

    def read_log(self, stream: Stream) -> bytes:
        """The exact bytes of stdout or stderr."""

    def submit(self, code: Optional[str], spec: dict[str, Any]) -> str:
        """Submits a job (`Client.submit`'s keywords in `spec`); its id once accepted."""

    def result(self, job_id: str, wait: float) -> Optional[JobResult]:
        """The job's current result, after waiting up to `wait` s for it to be terminal when it
        is not (0: no wait); None when the job is unknown."""

    def events(self, job_id: str, cursor: str, block: float, timeout: Optional[float]) -> Iterator[Event]:
        """The job's live events after `cursor` (`Client.events`; `block` already checked)."""

    def cancel(self, job_id: str) -> bool:
        """Asks for the job to be cancelled; False when it is unknown or over."""

    def sessions(self) -> list[tuple[str, Optional[int]]]:
        """The sessions and their expiry (Unix ms), soonest first."""

    def declare_topology(self) -> None:
        """Declares the namespace's exchanges and queues (direct mode only)."""

    def close(self) -> None:
        """Closes the connections."""


class AsyncTransport(Protocol):
    """`Transport`, asyncio (no `declare_topology`: the blocking client's)."""

    config: Any
    block_s: float
    unknown: str

    async def store(self, data: bytes, digest: str) -> None: ...

    async def fetch(self, artifact: Artifact) -> bytes: ...

    async def read_log(self, stream: Stream) -> bytes: ...

    async def submit(self, code: Optional[str], spec: dict[str, Any]) -> str: ...

    async def result(self, job_id: str, wait: float) -> Optional[JobResult]: ...

    def events(self, job_id: str, cursor: str, block: float, timeout: Optional[float]) -> AsyncIterator[Event]: ...

    async def cancel(self, job_id: str) -> bool: ...

    async def sessions(self) -> list[tuple[str, Optional[int]]]: ...

    async def aclose(self) -> None: ...
