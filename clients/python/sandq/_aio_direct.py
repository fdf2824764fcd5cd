"""Direct mode, asyncio: aio-pika (publisher confirms, mandatory) and redis.asyncio; S3 calls
(boto3) run in a thread. `_direct.DirectTransport`'s twin: the state and the decisions are
`_direct.DirectBase`'s."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional, cast

import aio_pika
import aio_pika.exceptions
import aiormq
import aiormq.exceptions
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel

from . import protocol
from ._direct import (CONNECT_TIMEOUT_S, DirectBase, StreamReading, blpop_s, connect_redis, is_active, parse_result,
                      parse_sessions)
from .errors import SubmitError
from .events import parse_xread
from .protocol import Config
from .types import Artifact, Event, JobResult, Stream


def connect_async_redis(config: Config, **kwargs: Any) -> Any:
    """`_direct.connect_redis` with redis.asyncio."""
    return connect_redis(config, redis.asyncio, **kwargs)


class AsyncDirectTransport(DirectBase):
    """`sandq.transport.AsyncTransport` through the broker, Redis and S3."""

    def __init__(self, config: Optional[Config] = None, *, namespace: Optional[str] = None,
                 unserved: Optional[str] = None):
        super().__init__(config, namespace, unserved, connect_async_redis)
        self._amqp: Optional[aio_pika.abc.AbstractConnection] = None
        self._channel: Optional[aio_pika.abc.AbstractChannel] = None
        self._lock = asyncio.Lock()

    # --- files -----------------------------------------------------------------------------
    async def store(self, data: bytes, digest: str) -> None:
        await asyncio.to_thread(self._store, data, digest)

    async def fetch(self, artifact: Artifact) -> bytes:
        return await asyncio.to_thread(self._fetch, artifact)

    async def read_log(self, stream: Stream) -> bytes:
        return await asyncio.to_thread(self._read_log, stream)

    # --- submitting ------------------------------------------------------------------------
    async def _connect_any(self, start: int) -> tuple[aio_pika.abc.AbstractConnection, int]:
        """`_direct.connect_any`, asyncio."""
        addresses = self.config.amqp_addresses()
        last: Optional[BaseException] = None
        for offset in range(len(addresses)):
            index = (start + offset) % len(addresses)
            try:
                connection = await aio_pika.connect(addresses[index], timeout=CONNECT_TIMEOUT_S,
                                                    client_properties={"connection_name": "sandq-python"})
                return connection, index
            except (aiormq.exceptions.AMQPError, ConnectionError, OSError, asyncio.TimeoutError) as e:
                last = e
        assert last is not None
        raise last

    async def _connect(self) -> None:
        """Opens the publishing connection and its confirming channel, unless open. Hold `_lock`."""
        if self._amqp is None or self._amqp.is_closed:
            self._amqp, self._amqp_index = await self._connect_any(self._amqp_index + 1)
            self._channel = await self._amqp.channel(publisher_confirms=True, on_return_raises=True)

    async def _consumers(self, sku: str) -> Optional[int]:
        """`DirectTransport._consumers`, asyncio: the consumer count of the SKU's queue (a passive
        declare on a channel of its own, closed after; 0 when the queue does not exist), None
        when the broker did not answer."""
        async with self._lock:
            try:
                await self._connect()
                assert self._amqp is not None
                channel = await self._amqp.channel(publisher_confirms=False)
            except (aiormq.exceptions.AMQPError, ConnectionError, OSError, asyncio.TimeoutError):
                # Connecting again is `_publish`'s to do, and to report.
                await self._close_amqp()
                return None
            try:
                queue = await channel.declare_queue(self.names.queue(sku), passive=True, timeout=CONNECT_TIMEOUT_S)
                assert queue.declaration_result is not None
                return queue.declaration_result.consumer_count
            except aiormq.exceptions.ChannelNotFoundEntity:
                # 404 NOT_FOUND (the broker closed the channel): an undeclared queue, unserved.
                return 0
            except aiormq.exceptions.ChannelClosed:
                return None
            except (aiormq.exceptions.AMQPError, ConnectionError, OSError, asyncio.TimeoutError):
                await self._close_amqp()
                return None
            finally:
                try:
                    if not channel.is_closed:
                        await channel.close()
                except Exception:  # noqa: BLE001 (closing a channel the broker closed)
                    pass

    async def _publish(self, job: dict) -> None:
        # A publish that fails (lost connection, nack, no confirm within `confirm_timeout`) is
        # made again, with the same body and job id, on the next broker address: at most once
        # per address plus once. A duplicate is harmless (docs/protocol.md, "Several broker
        # addresses").
        message = aio_pika.Message(protocol.encode(job), **protocol.amqp_properties(job))
        attempts = len(self.config.amqp_addresses()) + 1
        confirm_s = protocol.humantime_seconds(self.config.confirm_timeout)
        async with self._lock:
            for attempt in range(1, attempts + 1):
                try:
                    await self._connect()
                    assert self._channel is not None
                    exchange = await self._channel.get_exchange(self.names.exchange, ensure=False)
                    await exchange.publish(message, routing_key=job["sku"], mandatory=True, timeout=confirm_s)
                    return
                except aio_pika.exceptions.DeliveryError as e:
                    # A return (unroutable) is final; a nack is retried elsewhere.
                    if not isinstance(e.frame, aiormq.spec.Basic.Nack) or attempt == attempts:
                        raise SubmitError(f"job {job['job_id']} not accepted by the broker: {e}") from e
                    await self._close_amqp()
                except (aiormq.exceptions.AMQPError, ConnectionError, OSError, asyncio.TimeoutError) as e:
                    await self._close_amqp()
                    if attempt == attempts:
                        raise SubmitError(f"job {job['job_id']} not submitted: {e!r}") from e

    async def submit(self, code: Optional[str], spec: dict[str, Any]) -> str:
        """`DirectTransport.submit`, asyncio (the same question about the SKU first)."""
        job = protocol.build_job(code, **spec)
        if self._asks(job["sku"]):
            # stacklevel 3: the caller of `AsyncClient.submit` (above this and `AsyncClient.submit`).
            self._heard(job, await self._consumers(job["sku"]), stacklevel=3)
        await self._publish(job)
        await self.redis.eval(*self._queued(job))
        return job["job_id"]

    # --- results ---------------------------------------------------------------------------
    async def _status(self, job_id: str, field: str) -> Optional[bytes]:
        return cast(Optional[bytes], await self.redis.hget(self.names.job(job_id), field))

    async def result(self, job_id: str, wait: float) -> Optional[JobResult]:
        """`DirectTransport.result`, asyncio."""
        result = parse_result(await self._status(job_id, "result"))
        if result is None or result.terminal or wait <= 0:
            return result
        await self._blocking.blpop([self.names.done(job_id)], timeout=blpop_s(wait))
        return parse_result(await self._status(job_id, "result"))

    async def events(self, job_id: str, cursor: str, block: float, timeout: Optional[float]) -> AsyncIterator[Event]:
        """`DirectTransport.events`, asyncio."""
        reading = StreamReading(self.names.events(job_id), cursor, block, timeout)
        while (read := reading.next()) is not None:
            batch = parse_xread(await (self._blocking if "block" in read else self.redis).xread(**read))
            if not batch and reading.over:
                return
            if not batch:
                reading.over = not is_active(await self._status(job_id, "status"))
            for event in batch:
                yield event
                if reading.took(event):
                    return

    async def cancel(self, job_id: str) -> bool:
        key = self.names.job(job_id)
        if self._ended(await self._status(job_id, "status")):
            return False
        await self.redis.set(self.names.cancel(job_id), "1", ex=self._cancelled_for(await self.redis.ttl(key)))
        return True

    async def sessions(self) -> list[tuple[str, Optional[int]]]:
        rows = await self.redis.zrange(self.names.sessions, 0, -1, withscores=True)
        return parse_sessions(cast(list[tuple[bytes, float]], rows))

    # --- lifetime --------------------------------------------------------------------------
    async def _close_amqp(self) -> None:
        try:
            if self._amqp is not None and not self._amqp.is_closed:
                await self._amqp.close()
        except Exception:  # noqa: BLE001 (closing a broken connection)
            pass
        self._amqp = self._channel = None

    async def aclose(self) -> None:
        async with self._lock:
            await self._close_amqp()
        await self.redis.aclose()
        await self._blocking.aclose()
