"""The asyncio client: aio-pika (publisher confirms, mandatory), redis.asyncio; S3 transfers
run boto3 in a thread."""
from __future__ import annotations

import asyncio
import inspect
import os
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional, Union, cast

import aio_pika
import aio_pika.exceptions
import aiormq
import aiormq.exceptions
import botocore.exceptions
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel

from . import gateway, protocol
from .client import (CONNECT_TIMEOUT_S, SERVED_RECHECK_S, Source, check_download, fetch_url, read_source, s3_client,
                     unserved, unserved_option)
from .errors import RAISED_BY_WAIT, JobNotFound, SubmitError, WaitTimeout, error_for
from .events import ACTIVE, Callbacks, Transcript, parse_xread
from .protocol import BLOCK_S, EVENTS_COUNT, EVENTS_START, Config, Names
from .types import TERMINAL, Artifact, Event, InputFile, JobResult, Output, Stream


class AsyncClient:
    """The asyncio twin of `sandq.Client`: the same methods, awaitable, and the same two modes
    (`AsyncClient(url=..., api_key=...)`, or `$SANDQ_URL`, is a `sandq.aio_http.AsyncHttpClient`
    speaking to sandq-gateway), and the same `unserved=` ("warn", "refuse", "ignore"). Use
    `async with AsyncClient() as client:` or call `aclose()`."""

    def __new__(cls, config: Optional[Config] = None, *, namespace: Optional[str] = None, url: Optional[str] = None,
                api_key: Optional[str] = None, unserved: Optional[str] = None) -> "AsyncClient":
        if cls is AsyncClient and gateway.http_target(config, namespace, url, api_key) is not None:
            if unserved is not None:
                raise ValueError("unserved= is direct mode's (the client asks the broker); not for HTTP mode")
            from .aio_http import AsyncHttpClient
            return super().__new__(AsyncHttpClient)
        return super().__new__(cls)

    def __init__(self, config: Optional[Config] = None, *, namespace: Optional[str] = None, url: Optional[str] = None,
                 api_key: Optional[str] = None, unserved: Optional[str] = None):
        if url or api_key:
            raise ValueError("url= and api_key= are HTTP mode's: sandq.aio.AsyncClient or sandq.aio_http.AsyncHttpClient, "
                             "not a subclass of the direct client")
        self.unserved = unserved_option(unserved)
        config = config or protocol.load_config()
        if namespace:
            config = config.with_namespace(namespace)
        self.config = config
        self.names = Names(config.namespace)
        self.redis = connect_redis(config)
        # BLPOP and XREAD BLOCK block their connection for up to BLOCK_S: a client of its own
        # whose socket timeout outlasts it (redis-py's default would cut the wait short); its
        # pool gives each concurrent blocking call a connection of its own.
        self._blocking = connect_redis(config, socket_timeout=BLOCK_S + 10)
        self.s3 = s3_client(config)
        self._amqp: Optional[aio_pika.abc.AbstractConnection] = None
        # Index in `config.amqp_addresses()` of the node `_amqp` is (or was last) on.
        self._amqp_index = -1
        self._channel: Optional[aio_pika.abc.AbstractChannel] = None
        self._lock = asyncio.Lock()
        # SKU -> when (time.monotonic()) its queue was last seen with a consumer.
        self._served_at: dict[str, float] = {}

    # --- files -----------------------------------------------------------------------------
    async def upload(self, source: Source, path: Optional[str] = None) -> InputFile:
        data = await asyncio.to_thread(read_source, source)
        if path is None:
            if isinstance(source, (bytes, bytearray, memoryview)):
                raise ValueError("give the path inside /work for bytes")
            path = Path(source).name
        digest = protocol.sha256_hex(data)
        key = protocol.input_key(digest)

        def put() -> None:
            try:
                if self.s3.head_object(Bucket=self.config.s3_bucket, Key=key).get("ContentLength") == len(data):
                    return
            except botocore.exceptions.ClientError:
                pass
            self.s3.put_object(Bucket=self.config.s3_bucket, Key=key, Body=data)

        await asyncio.to_thread(put)
        return InputFile(key=key, path=path, size=len(data), sha256=digest)

    async def download(self, artifact: Artifact) -> bytes:
        if artifact.url:
            data = await asyncio.to_thread(fetch_url, artifact.url)
        else:
            data = await asyncio.to_thread(
                lambda: self.s3.get_object(Bucket=self.config.s3_bucket, Key=artifact.key)["Body"].read())
        return check_download(artifact, data)

    async def download_to(self, artifact: Artifact, dest: Union[str, os.PathLike]) -> Path:
        target = Path(dest)
        if target.is_dir():
            target = target / Path(artifact.path).name
        target.write_bytes(await self.download(artifact))
        return target

    async def read_log(self, stream: Stream) -> bytes:
        if not stream.log_key:
            return stream.text.encode()
        key = stream.log_key
        return await asyncio.to_thread(lambda: self.s3.get_object(Bucket=self.config.s3_bucket, Key=key)["Body"].read())

    # --- submitting ------------------------------------------------------------------------
    async def _connect_any(self, start: int) -> tuple[aio_pika.abc.AbstractConnection, int]:
        """`sandq.client.connect_any`, asyncio."""
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
        """`sandq.Client._consumers`, asyncio: the consumer count of the SKU's queue (a passive
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

    async def _check_served(self, job: dict) -> None:
        """`sandq.Client._check_served`, asyncio."""
        sku = job["sku"]
        at = self._served_at.get(sku)
        if self.unserved == "ignore" or (at is not None and time.monotonic() - at < SERVED_RECHECK_S):
            return
        count = await self._consumers(sku)
        if count == 0:
            # stacklevel 3: the caller of `submit`.
            unserved(self.config, self.names, job, self.unserved, stacklevel=3)
        elif count is not None:
            self._served_at[sku] = time.monotonic()

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

    async def submit(self, code: Optional[str] = None, **spec: Any) -> str:
        """`sandq.Client.submit`, asyncio (the same question about the SKU first)."""
        job = protocol.build_job(code, **spec)
        await self._check_served(job)
        await self._publish(job)
        record, ttl = protocol.queued_record(job)
        await self.redis.eval(protocol.CAS_SCRIPT, 2, self.names.job(job["job_id"]), self.names.done(job["job_id"]),
                              "queued", record, ttl)
        return job["job_id"]

    # --- results ---------------------------------------------------------------------------
    async def status(self, job_id: str) -> Optional[JobResult]:
        raw = cast(Optional[bytes], await self.redis.hget(self.names.job(job_id), "result"))
        return None if raw is None else JobResult.from_wire(protocol.decode(raw))

    async def wait(self, job_id: str, timeout: Optional[float] = None, *, raise_on_error: bool = True,
                   block_s: float = BLOCK_S) -> JobResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            result = await self.status(job_id)
            if result is None:
                raise JobNotFound(f"job {job_id} is unknown (never submitted, or its result expired)")
            if result.terminal:
                if raise_on_error and result.status in RAISED_BY_WAIT:
                    raise error_for(result)
                return result
            left = block_s if deadline is None else min(block_s, deadline - time.monotonic())
            if left <= 0:
                raise WaitTimeout(f"job {job_id} is still {result.status} after {timeout} s")
            await self._blocking.blpop([self.names.done(job_id)], timeout=max(min(left, BLOCK_S), 0.01))

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
            if wait_timeout is not None:
                wait_timeout = max(0.0, wait_timeout - (time.monotonic() - started))
        return await self.wait(job_id, wait_timeout, raise_on_error=raise_on_error)

    # --- live events -----------------------------------------------------------------------
    async def events(self, job_id: str, cursor: str = EVENTS_START, *, block: float = BLOCK_S,
                     timeout: Optional[float] = None) -> AsyncIterator[Event]:
        """`sandq.Client.events`, asyncio: `async for event in client.events(job_id): ...`."""
        if not 0 < block <= BLOCK_S:
            raise ValueError(f"block must be more than 0 and at most {BLOCK_S} s, not {block}")
        key = self.names.events(job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        over = False  # the job is over: read what is left without waiting
        while True:
            if over:
                batch = parse_xread(await self.redis.xread({key: cursor}, count=EVENTS_COUNT))
                if not batch:
                    return
            else:
                left = block if deadline is None else min(block, deadline - time.monotonic())
                if left <= 0:
                    return
                reply = await self._blocking.xread({key: cursor}, count=EVENTS_COUNT, block=max(1, round(left * 1000)))
                batch = parse_xread(reply)
                if not batch:
                    over = not await self._active(job_id)
                    continue
            for event in batch:
                cursor = event.id
                yield event
                if event.type == "end":
                    return

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

    async def _active(self, job_id: str) -> bool:
        """The job's hash says `queued` or `running`."""
        status = cast(Optional[bytes], await self.redis.hget(self.names.job(job_id), "status"))
        return status is not None and status.decode() in ACTIVE

    async def cancel(self, job_id: str) -> bool:
        key = self.names.job(job_id)
        status = cast(Optional[bytes], await self.redis.hget(key, "status"))
        if status is None or status.decode() in TERMINAL:
            return False
        ttl = await self.redis.ttl(key)
        await self.redis.set(self.names.cancel(job_id), "1", ex=ttl if ttl and ttl > 0 else 86400)
        return True

    # --- sessions --------------------------------------------------------------------------
    def session(self, name: Optional[str] = None) -> "AsyncSession":
        return AsyncSession(self, name or protocol.new_session_name())

    async def sessions(self) -> list[tuple[str, int]]:
        rows = cast(list[tuple[bytes, float]], await self.redis.zrange(self.names.sessions, 0, -1, withscores=True))
        return [(n.decode(), int(score)) for n, score in rows]

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

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncSession:
    """Jobs of one session (`session=` set on each)."""

    def __init__(self, client: AsyncClient, name: str):
        self.client, self.name = client, name

    async def submit(self, code: Optional[str] = None, **spec: Any) -> str:
        return await self.client.submit(code, session=self.name, **spec)

    async def run(self, code: Optional[str] = None, **kwargs: Any) -> JobResult:
        """`AsyncClient.run` in the session (the same keywords, the callbacks included)."""
        return await self.client.run(code, session=self.name, **kwargs)


def connect_redis(config: Config, **kwargs: Any) -> Any:
    """A redis.asyncio client of the Redis `config` names (`redis_mode`): one server, a Redis Cluster
    (`RedisCluster`: routes each command by its key's slot, follows MOVED/ASK and retries through a
    failover) or the primary the sentinels name (`Sentinel.master_for`: asks them again after a
    failover). `kwargs` go to the connections (a socket timeout). docs/protocol.md "Redis
    deployments"."""
    if config.redis_mode == "cluster":
        nodes = [redis.asyncio.cluster.ClusterNode(**protocol.redis_kwargs(u)) for u in config.redis_nodes]
        auth = {k: v for k, v in protocol.redis_kwargs(config.redis_nodes[0]).items() if k in ("username", "password")}
        return redis.asyncio.cluster.RedisCluster(startup_nodes=nodes, **auth, **kwargs)
    if config.redis_mode == "sentinel":
        sentinels = [(k["host"], k["port"]) for k in map(protocol.redis_kwargs, config.redis_nodes)]
        return redis.asyncio.sentinel.Sentinel(sentinels, **kwargs).master_for(config.redis_service, **kwargs)
    if config.redis_mode != "single":
        raise ValueError(f"redis mode {config.redis_mode!r} is not single, cluster or sentinel")
    return redis.asyncio.Redis.from_url(config.redis_url, **kwargs)
