"""Direct mode, blocking: the broker (pika: publisher confirms, mandatory), Redis (redis-py) and
S3 (boto3), with the service config (docs/protocol.md). Also what the asyncio twin
(`_aio_direct`) shares: `DirectBase` (the state and the decisions), the connections' settings."""
from __future__ import annotations

import threading
import time
import warnings
from types import ModuleType
from typing import Any, Callable, Iterator, Optional, cast

import boto3
import botocore.config
import botocore.exceptions
import pika
import pika.exceptions
from pika.adapters.utils.connection_workflow import AMQPConnectorException
import redis
import redis.cluster
import redis.sentinel

from . import protocol
from ._files import fetch_url
from .errors import SubmitError, UnservedSku, UnservedSkuWarning
from .events import ACTIVE, parse_xread
from .protocol import BLOCK_S, EVENTS_COUNT, Config, Names
from .types import TERMINAL, Artifact, Event, JobResult, Stream

# Longest wait for one broker address to complete the AMQP handshake before the next is tried
# (the Rust client's `broker::CONNECT_TIMEOUT`).
CONNECT_TIMEOUT_S = 10.0

# What a direct-mode submission does when no worker serves the job's SKU right now (its queue has
# no consumer; docs/protocol.md "Which SKUs are served"): "warn" (an `UnservedSkuWarning`, then
# it publishes), "refuse" (`UnservedSku`, nothing published) or "ignore" (it does not ask).
UNSERVED = ("warn", "refuse", "ignore")

# How long (s) a SKU seen served is taken to stay so before a submission asks the broker again
# (the Rust client's `SERVED_RECHECK`); a SKU seen unserved is asked again every time.
SERVED_RECHECK_S = 10.0


def s3_client(config: Config) -> Any:
    return boto3.client(
        "s3", endpoint_url=config.s3_endpoint, region_name=config.s3_region,
        aws_access_key_id=config.s3_access_key_id, aws_secret_access_key=config.s3_secret_access_key,
        config=botocore.config.Config(signature_version="s3v4", s3={"addressing_style": "path"}),
    )


def unserved_option(value: Optional[str]) -> str:
    """`value` checked against `UNSERVED` (None: "warn")."""
    if value is None:
        return "warn"
    if value not in UNSERVED:
        raise ValueError(f"unserved must be one of {', '.join(map(repr, UNSERVED))}, not {value!r}")
    return value


def unserved(config: Config, names: Names, job: dict, option: str, stacklevel: int) -> None:
    """Acts on a job whose SKU's queue has no consumer, as `option` says: raises `UnservedSku`
    ("refuse"), or warns (`UnservedSkuWarning`, at `stacklevel` from the caller)."""
    sku, queue = job["sku"], names.queue(job["sku"])
    if option == "refuse":
        raise UnservedSku(job["job_id"], sku, queue)
    ttl = config.unserved_ttl
    fate = f"or expires after {ttl} (queues.unserved_ttl)" if protocol.duration_ms(ttl) else "with no expiry"
    warnings.warn(f"no worker serves SKU {sku} right now (queue {queue} has no consumer): job {job['job_id']} waits "
                  f"in the queue until one does, {fate}", UnservedSkuWarning, stacklevel=stacklevel + 1)


def connect_redis(config: Config, package: ModuleType = redis, **kwargs: Any) -> Any:
    """A client of the Redis `config` names (`redis_mode`), from `package` (`redis`, or
    `redis.asyncio` for the asyncio twin): one server, a Redis Cluster (`RedisCluster`: routes
    each command by its key's slot, follows MOVED/ASK and retries through a failover) or the
    primary the sentinels name (`Sentinel.master_for`: asks them again after a failover).
    `kwargs` go to the connections (a socket timeout). docs/protocol.md "Redis deployments"."""
    if config.redis_mode == "cluster":
        nodes = [package.cluster.ClusterNode(**protocol.redis_kwargs(u)) for u in config.redis_nodes]
        auth = {k: v for k, v in protocol.redis_kwargs(config.redis_nodes[0]).items() if k in ("username", "password")}
        return package.cluster.RedisCluster(startup_nodes=nodes, **auth, **kwargs)
    if config.redis_mode == "sentinel":
        sentinels = [(k["host"], k["port"]) for k in map(protocol.redis_kwargs, config.redis_nodes)]
        return package.sentinel.Sentinel(sentinels, **kwargs).master_for(config.redis_service, **kwargs)
    if config.redis_mode != "single":
        raise ValueError(f"redis mode {config.redis_mode!r} is not single, cluster or sentinel")
    return package.Redis.from_url(config.redis_url, **kwargs)


def connect_any(config: Config, start: int) -> tuple[pika.BlockingConnection, int]:
    """A connection to the first broker address that answers, trying `config.amqp_addresses()`
    from index `start` (modulo their count) round the list, each once; with the index used.
    Raises the last address's error when none answers."""
    addresses = config.amqp_addresses()
    last: Optional[Exception] = None
    for offset in range(len(addresses)):
        index = (start + offset) % len(addresses)
        parameters = pika.URLParameters(addresses[index])
        parameters.client_properties = {"connection_name": "sandq-python"}
        # A node that accepts TCP but never answers: give up on it after 10 s, as the Rust
        # client does (pika's default is 15 s).
        parameters.stack_timeout = CONNECT_TIMEOUT_S
        try:
            return pika.BlockingConnection(parameters), index
        except (pika.exceptions.AMQPError, AMQPConnectorException, OSError) as e:
            last = e
    assert last is not None
    raise last


def is_active(status: Optional[bytes]) -> bool:
    """A job hash's `status` field says `queued` or `running`."""
    return status is not None and status.decode() in ACTIVE


class DirectBase:
    """What both direct transports hold and decide: the config, the names, Redis (a client, and
    one for blocking reads), S3 (boto3, blocking: the asyncio twin runs these calls in a
    thread), `unserved=` and the SKUs seen served; the S3 calls."""

    block_s = BLOCK_S
    unknown = "never submitted, or its result expired"

    def __init__(self, config: Optional[Config], namespace: Optional[str], unserved: Optional[str],
                 connect: Callable[..., Any]):
        self.unserved = unserved_option(unserved)
        config = config or protocol.load_config()
        if namespace:
            config = config.with_namespace(namespace)
        self.config = config
        self.names = Names(config.namespace)
        self.redis = connect(config)
        # BLPOP and XREAD BLOCK block their connection for up to BLOCK_S: a client of its own
        # whose socket timeout outlasts it (redis-py's default would cut the wait short); its
        # pool gives each concurrent blocking call a connection of its own.
        self._blocking = connect(config, socket_timeout=BLOCK_S + 10)
        self.s3 = s3_client(config)
        # Index in `config.amqp_addresses()` of the node the publishing connection is (or was
        # last) on.
        self._amqp_index = -1
        # SKU -> when (time.monotonic()) its queue was last seen with a consumer.
        self._served_at: dict[str, float] = {}

    # --- S3 (blocking) ---------------------------------------------------------------------
    def _store(self, data: bytes, digest: str) -> None:
        """Uploads the file under its content address, unless it is there already."""
        key = protocol.input_key(digest)
        try:
            if self.s3.head_object(Bucket=self.config.s3_bucket, Key=key).get("ContentLength") == len(data):
                return
        except botocore.exceptions.ClientError:
            pass
        self.s3.put_object(Bucket=self.config.s3_bucket, Key=key, Body=data)

    def _fetch(self, artifact: Artifact) -> bytes:
        """Through its presigned URL, from S3 by key when it has none."""
        if artifact.url:
            return fetch_url(artifact.url)
        return self.s3.get_object(Bucket=self.config.s3_bucket, Key=artifact.key)["Body"].read()

    def _read_log(self, stream: Stream) -> bytes:
        """From S3 (up to 8 MiB); the inline text when the stream was empty."""
        if not stream.log_key:
            return stream.text.encode()
        return self.s3.get_object(Bucket=self.config.s3_bucket, Key=stream.log_key)["Body"].read()

    # --- decisions -------------------------------------------------------------------------
    def _asks(self, sku: str) -> bool:
        """Whether a submission asks the broker about the SKU (`unserved`, a recent answer)."""
        at = self._served_at.get(sku)
        return self.unserved != "ignore" and (at is None or time.monotonic() - at >= SERVED_RECHECK_S)

    def _heard(self, job: dict, consumers: Optional[int], stacklevel: int) -> None:
        """Acts on the broker's answer (None: it gave none) before the job is published: no
        consumer -> `unserved` (the warning at `stacklevel` from the caller), some -> remembered."""
        if consumers == 0:
            unserved(self.config, self.names, job, self.unserved, stacklevel=stacklevel + 1)
        elif consumers is not None:
            self._served_at[job["sku"]] = time.monotonic()

    def _queued(self, job: dict) -> tuple[Any, ...]:
        """The `EVAL` arguments that write a published job's `queued` record."""
        record, ttl = protocol.queued_record(job)
        return protocol.CAS_SCRIPT, 2, self.names.job(job["job_id"]), self.names.done(job["job_id"]), "queued", record, ttl

    def _cancelled_for(self, ttl: Optional[int]) -> int:
        """The cancel key's lifetime (s): the job's (`ttl`), else a day."""
        return ttl if ttl and ttl > 0 else 86400

    def _ended(self, status: Optional[bytes]) -> bool:
        """A job hash's `status` says unknown or over: nothing to cancel."""
        return status is None or status.decode() in TERMINAL


class StreamReading:
    """One `events` call on a job's Redis stream: XREAD BLOCK up to `block` s at a time; a read
    that found nothing asks the job hash whether the job is over (`over`), and then what is left
    is read without waiting. Ends with the `end` event, at the deadline, or when nothing is left."""

    def __init__(self, key: str, cursor: str, block: float, timeout: Optional[float]):
        self.key, self.cursor, self.block = key, cursor, block
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.over = False  # the job is over: read what is left without waiting

    def next(self) -> Optional[dict[str, Any]]:
        """The next XREAD's arguments (with `block` while the job may still write); None at the
        deadline."""
        if self.over:
            return dict(streams={self.key: self.cursor}, count=EVENTS_COUNT)
        left = self.block if self.deadline is None else min(self.block, self.deadline - time.monotonic())
        if left <= 0:
            return None
        return dict(streams={self.key: self.cursor}, count=EVENTS_COUNT, block=max(1, round(left * 1000)))

    def took(self, event: Event) -> bool:
        """Moves the cursor past `event`; whether it is the last (`end`)."""
        self.cursor = event.id
        return event.type == "end"


def parse_result(raw: Optional[bytes]) -> Optional[JobResult]:
    return None if raw is None else JobResult.from_wire(protocol.decode(raw))


def parse_sessions(rows: list[tuple[bytes, float]]) -> list[tuple[str, Optional[int]]]:
    return [(n.decode(), int(score)) for n, score in rows]


def blpop_s(wait: float) -> float:
    """BLPOP's timeout for a wait of `wait` s (at most `BLOCK_S`, at least 10 ms)."""
    return max(min(wait, BLOCK_S), 0.01)


class DirectTransport(DirectBase):
    """`sandq.transport.Transport` through the broker, Redis and S3. Thread-safe for submitting."""

    def __init__(self, config: Optional[Config] = None, *, namespace: Optional[str] = None,
                 unserved: Optional[str] = None):
        super().__init__(config, namespace, unserved, connect_redis)
        self._amqp: Optional[pika.BlockingConnection] = None
        self._channel: Any = None
        self._lock = threading.Lock()

    # --- files -----------------------------------------------------------------------------
    def store(self, data: bytes, digest: str) -> None:
        self._store(data, digest)

    def fetch(self, artifact: Artifact) -> bytes:
        return self._fetch(artifact)

    def read_log(self, stream: Stream) -> bytes:
        return self._read_log(stream)

    # --- submitting ------------------------------------------------------------------------
    def _connect(self) -> None:
        """Opens the publishing connection and its confirming channel, unless open. Hold `_lock`."""
        if self._amqp is None or self._amqp.is_closed:
            self._amqp, self._amqp_index = connect_any(self.config, self._amqp_index + 1)
            self._channel = self._amqp.channel()
            self._channel.confirm_delivery()

    def _consumers(self, sku: str) -> Optional[int]:
        """The consumer count of the SKU's queue (a passive declare, on a channel of its own
        closed after; 0 when the queue does not exist), None when the broker did not answer."""
        with self._lock:
            try:
                self._connect()
                assert self._amqp is not None
                channel = self._amqp.channel()
            except (pika.exceptions.AMQPError, AMQPConnectorException, OSError):
                # Connecting again is `_publish`'s to do, and to report.
                self._close_amqp()
                return None
            try:
                return channel.queue_declare(self.names.queue(sku), passive=True).method.consumer_count
            except pika.exceptions.ChannelClosedByBroker as e:
                # The broker closed the channel: 404 NOT_FOUND is an undeclared queue (unserved).
                return 0 if e.reply_code == 404 else None
            except pika.exceptions.AMQPError:
                self._close_amqp()
                return None
            finally:
                try:
                    if channel.is_open:
                        channel.close()
                except pika.exceptions.AMQPError:
                    pass

    def _publish(self, job: dict) -> None:
        # A publish that fails (lost connection, nack) is made again, with the same body and
        # job id, on the next broker address: at most once per address plus once. A duplicate
        # is harmless (docs/protocol.md, "Several broker addresses"). pika's blocking channel
        # waits for the confirm without a timeout: `confirm_timeout` is the asyncio client's.
        properties = pika.BasicProperties(**protocol.amqp_properties(job))
        body = protocol.encode(job)
        attempts = len(self.config.amqp_addresses()) + 1
        with self._lock:
            for attempt in range(1, attempts + 1):
                try:
                    self._connect()
                    self._channel.basic_publish(self.names.exchange, job["sku"], body, properties, mandatory=True)
                    return
                except pika.exceptions.UnroutableError as e:
                    raise SubmitError(f"job {job['job_id']} not accepted by the broker: {e}") from e
                except pika.exceptions.NackError as e:
                    self._close_amqp()
                    if attempt == attempts:
                        raise SubmitError(f"job {job['job_id']} not accepted by the broker: {e}") from e
                except pika.exceptions.AMQPError as e:
                    self._close_amqp()
                    if attempt == attempts:
                        raise SubmitError(f"job {job['job_id']} not submitted: {e!r}") from e

    def submit(self, code: Optional[str], spec: dict[str, Any]) -> str:
        """Asks whether a worker serves the SKU (unless `unserved="ignore"`), publishes, then
        writes the `queued` record."""
        job = protocol.build_job(code, **spec)
        if self._asks(job["sku"]):
            # stacklevel 3: the caller of `Client.submit` (above this and `Client.submit`).
            self._heard(job, self._consumers(job["sku"]), stacklevel=3)
        self._publish(job)
        self.redis.eval(*self._queued(job))
        return job["job_id"]

    def declare_topology(self) -> None:
        connection, _ = connect_any(self.config, 0)
        try:
            ch = connection.channel()
            n = self.names
            ch.exchange_declare(n.dlx, "fanout", durable=True)
            ch.queue_declare(n.dead_queue, durable=True, arguments={"x-queue-type": "quorum"})
            ch.queue_bind(n.dead_queue, n.dlx, "")
            ch.exchange_declare(n.exchange, "direct", durable=True)
            for sku in protocol.SKUS:
                args = protocol.queue_arguments(n, self.config.delivery_limit, self.config.unserved_ttl)
                try:
                    ch.queue_declare(n.queue(sku), durable=True, arguments=args)
                except pika.exceptions.ChannelClosedByBroker as e:
                    # 406 PRECONDITION_FAILED: declared by an earlier version with other
                    # arguments (docs/operations.md); it is used as it is.
                    if e.reply_code != 406:
                        raise
                    ch = connection.channel()
                    ch.queue_declare(n.queue(sku), passive=True)
                ch.queue_bind(n.queue(sku), n.exchange, sku)
        finally:
            connection.close()

    # --- results ---------------------------------------------------------------------------
    def result(self, job_id: str, wait: float) -> Optional[JobResult]:
        """The job hash's result; when it is not terminal and `wait` > 0, again after a BLPOP
        on the job's done list of up to `wait` s."""
        result = parse_result(cast(Optional[bytes], self.redis.hget(self.names.job(job_id), "result")))
        if result is None or result.terminal or wait <= 0:
            return result
        self._blocking.blpop([self.names.done(job_id)], timeout=blpop_s(wait))
        return parse_result(cast(Optional[bytes], self.redis.hget(self.names.job(job_id), "result")))

    def events(self, job_id: str, cursor: str, block: float, timeout: Optional[float]) -> Iterator[Event]:
        """XREAD BLOCK on the job's stream (`StreamReading`)."""
        reading = StreamReading(self.names.events(job_id), cursor, block, timeout)
        while (read := reading.next()) is not None:
            batch = parse_xread((self._blocking if "block" in read else self.redis).xread(**read))
            if not batch and reading.over:
                return
            if not batch:
                reading.over = not is_active(cast(Optional[bytes], self.redis.hget(self.names.job(job_id), "status")))
            for event in batch:
                yield event
                if reading.took(event):
                    return

    def cancel(self, job_id: str) -> bool:
        """Sets the job's cancel key (skipped when queued, killed when running), for as long as
        the job's hash lives."""
        key = self.names.job(job_id)
        if self._ended(cast(Optional[bytes], self.redis.hget(key, "status"))):
            return False
        self.redis.set(self.names.cancel(job_id), "1", ex=self._cancelled_for(self.redis.ttl(key)))
        return True

    def sessions(self) -> list[tuple[str, Optional[int]]]:
        return parse_sessions(cast(list[tuple[bytes, float]], self.redis.zrange(self.names.sessions, 0, -1, withscores=True)))

    # --- lifetime --------------------------------------------------------------------------
    def _close_amqp(self) -> None:
        try:
            if self._amqp is not None and self._amqp.is_open:
                self._amqp.close()
        except pika.exceptions.AMQPError:
            pass
        self._amqp = self._channel = None

    def close(self) -> None:
        with self._lock:
            self._close_amqp()
        self.redis.close()
        self._blocking.close()
