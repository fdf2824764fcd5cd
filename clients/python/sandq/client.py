"""The blocking client: pika (publisher confirms, mandatory), redis-py, boto3."""
from __future__ import annotations

import os
import threading
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union, cast

import boto3
import botocore.config
import botocore.exceptions
import pika
import pika.exceptions
from pika.adapters.utils.connection_workflow import AMQPConnectorException
import redis
import redis.cluster
import redis.sentinel

from . import gateway, protocol
from .errors import (RAISED_BY_WAIT, JobNotFound, SandqError, SubmitError, UnservedSku, UnservedSkuWarning, WaitTimeout,
                     error_for)
from .events import ACTIVE, Callbacks, Transcript, parse_xread
from .protocol import BLOCK_S, EVENTS_COUNT, EVENTS_START, Config, Names
from .types import TERMINAL, Artifact, Event, InputFile, JobResult, Output, Stream

Source = Union[str, os.PathLike, bytes]


def s3_client(config: Config) -> Any:
    return boto3.client(
        "s3", endpoint_url=config.s3_endpoint, region_name=config.s3_region,
        aws_access_key_id=config.s3_access_key_id, aws_secret_access_key=config.s3_secret_access_key,
        config=botocore.config.Config(signature_version="s3v4", s3={"addressing_style": "path"}),
    )


def read_source(source: Source) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    return Path(source).read_bytes()


def fetch_url(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as response:  # noqa: S310 (a presigned http(s) URL)
        return response.read()


def check_download(artifact: Artifact, data: bytes) -> bytes:
    if len(data) != artifact.size or protocol.sha256_hex(data) != artifact.sha256:
        raise SandqError(f"artifact {artifact.path}: downloaded {len(data)} bytes that do not match its size or sha256")
    return data


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


class Client:
    """A sandq client, in one of two modes with the same methods:

    - direct: `Client()` reads the service config (`$SANDQ_CONFIG`, else /etc/sandq/sandq.toml)
      and speaks AMQP, Redis and S3; pass a `Config` or `namespace=` to choose others;
    - HTTP: `Client(url="https://sandq.example.com", api_key="sq_...")` speaks to sandq-gateway
      (docs/gateway.md) and is a `sandq.http.HttpClient`; also taken when `$SANDQ_URL` is set
      (with `$SANDQ_API_KEY`) and neither a config nor a namespace is given (`sandq.gateway`
      has the rules).

    Before publishing a job, a direct client asks the broker whether any worker serves its SKU
    (docs/protocol.md "Which SKUs are served"); `unserved=` says what it does when none does:
    "warn" (default: an `UnservedSkuWarning`, then it submits; a job waits in its queue until a
    worker comes, an autoscaler's say, or `queues.unserved_ttl` passes), "refuse" (`UnservedSku`,
    nothing published) or "ignore" (no question asked). A SKU seen served is not asked about
    again for 10 s; a broker that cannot answer does not stop the submission.

    Thread-safe for submitting; close it (or use it as a context manager) when done."""

    def __new__(cls, config: Optional[Config] = None, *, namespace: Optional[str] = None, url: Optional[str] = None,
                api_key: Optional[str] = None, unserved: Optional[str] = None) -> "Client":
        if cls is Client and gateway.http_target(config, namespace, url, api_key) is not None:
            if unserved is not None:
                raise ValueError("unserved= is direct mode's (the client asks the broker); not for HTTP mode")
            from .http import HttpClient
            return super().__new__(HttpClient)
        return super().__new__(cls)

    def __init__(self, config: Optional[Config] = None, *, namespace: Optional[str] = None, url: Optional[str] = None,
                 api_key: Optional[str] = None, unserved: Optional[str] = None):
        if url or api_key:
            raise ValueError("url= and api_key= are HTTP mode's: sandq.Client or sandq.http.HttpClient, not a subclass of the direct client")
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
        self._amqp: Optional[pika.BlockingConnection] = None
        # Index in `config.amqp_addresses()` of the node `_amqp` is (or was last) on.
        self._amqp_index = -1
        self._channel: Any = None
        self._lock = threading.Lock()
        # SKU -> when (time.monotonic()) its queue was last seen with a consumer.
        self._served_at: dict[str, float] = {}

    # --- files -----------------------------------------------------------------------------
    def upload(self, source: Source, path: Optional[str] = None) -> InputFile:
        """Uploads a file (a path, or bytes) under its content address, unless it is there
        already; the job sees it at `/work/<path>` (default: the file's name)."""
        data = read_source(source)
        if path is None:
            if isinstance(source, (bytes, bytearray, memoryview)):
                raise ValueError("give the path inside /work for bytes")
            path = Path(source).name
        digest = protocol.sha256_hex(data)
        key = protocol.input_key(digest)
        try:
            head = self.s3.head_object(Bucket=self.config.s3_bucket, Key=key)
            exists = head.get("ContentLength") == len(data)
        except botocore.exceptions.ClientError:
            exists = False
        if not exists:
            self.s3.put_object(Bucket=self.config.s3_bucket, Key=key, Body=data)
        return InputFile(key=key, path=path, size=len(data), sha256=digest)

    def download(self, artifact: Artifact) -> bytes:
        """An artifact's bytes, through its presigned URL (from S3 by key when it has none),
        checked against its size and sha256."""
        if artifact.url:
            data = fetch_url(artifact.url)
        else:
            data = self.s3.get_object(Bucket=self.config.s3_bucket, Key=artifact.key)["Body"].read()
        return check_download(artifact, data)

    def download_to(self, artifact: Artifact, dest: Union[str, os.PathLike]) -> Path:
        """`download`, written to `dest` (a directory gets the artifact's name)."""
        target = Path(dest)
        if target.is_dir():
            target = target / Path(artifact.path).name
        target.write_bytes(self.download(artifact))
        return target

    def read_log(self, stream: Stream) -> bytes:
        """The exact bytes of stdout or stderr (up to 8 MiB), from S3; the inline text when the
        stream was empty."""
        if not stream.log_key:
            return stream.text.encode()
        return self.s3.get_object(Bucket=self.config.s3_bucket, Key=stream.log_key)["Body"].read()

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

    def _check_served(self, job: dict) -> None:
        """Applies `unserved` to the job before it is published."""
        sku = job["sku"]
        at = self._served_at.get(sku)
        if self.unserved == "ignore" or (at is not None and time.monotonic() - at < SERVED_RECHECK_S):
            return
        count = self._consumers(sku)
        if count == 0:
            # stacklevel 3: the caller of `submit`.
            unserved(self.config, self.names, job, self.unserved, stacklevel=3)
        elif count is not None:
            self._served_at[sku] = time.monotonic()

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

    def submit(self, code: Optional[str] = None, **spec: Any) -> str:
        """Submits a job and returns its id once the broker confirmed it. Keyword arguments are
        the JobSpec's fields (docs/protocol.md): `entrypoint`, `sku` ("M"), `runtime`
        ("python"), `inputs` (from `upload`), `args`, `stdin`, `env`, `timeout` ("60s"),
        `result_ttl`, `network`, `deadline_ms`, `mode`, `session`, `job_id`.

        Before the publish, unless `unserved="ignore"`, it asks whether a worker serves the SKU
        (the class's doc): none does -> `UnservedSkuWarning`, or `UnservedSku` raised with
        `unserved="refuse"` (nothing published, no status written)."""
        job = protocol.build_job(code, **spec)
        self._check_served(job)
        self._publish(job)
        record, ttl = protocol.queued_record(job)
        key = self.names.job(job["job_id"])
        self.redis.eval(protocol.CAS_SCRIPT, 2, key, self.names.done(job["job_id"]), "queued", record, ttl)
        return job["job_id"]

    def declare_topology(self) -> None:
        """Declares the namespace's exchanges and queues, with exactly the workers' arguments
        (workers declare them too; a client may rely on them existing)."""
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
    def status(self, job_id: str) -> Optional[JobResult]:
        """The job's current result (`queued`, `running` or terminal); None when unknown."""
        raw = cast(Optional[bytes], self.redis.hget(self.names.job(job_id), "result"))
        return None if raw is None else JobResult.from_wire(protocol.decode(raw))

    def wait(self, job_id: str, timeout: Optional[float] = None, *, raise_on_error: bool = True,
             block_s: float = BLOCK_S) -> JobResult:
        """Blocks until the job's result is terminal (BLPOP on its done list, reading the hash
        before and after every wait). Raises `WaitTimeout` after `timeout` seconds (None: no
        limit), `JobNotFound` for an unknown job, and unless `raise_on_error` is false
        `JobRejected`, `JobExpired` or `JobInternalError`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            result = self.status(job_id)
            if result is None:
                raise JobNotFound(f"job {job_id} is unknown (never submitted, or its result expired)")
            if result.terminal:
                if raise_on_error and result.status in RAISED_BY_WAIT:
                    raise error_for(result)
                return result
            left = block_s if deadline is None else min(block_s, deadline - time.monotonic())
            if left <= 0:
                raise WaitTimeout(f"job {job_id} is still {result.status} after {timeout} s")
            self._blocking.blpop([self.names.done(job_id)], timeout=max(min(left, BLOCK_S), 0.01))

    def run(self, code: Optional[str] = None, *, wait_timeout: Optional[float] = None, raise_on_error: bool = True,
            on_stdout: Optional[Callable[[str], Any]] = None, on_stderr: Optional[Callable[[str], Any]] = None,
            on_display: Optional[Callable[[Output], Any]] = None, on_event: Optional[Callable[[Event], Any]] = None,
            **spec: Any) -> JobResult:
        """`submit` then `wait`; returns the stored result, raises as `wait` does.

        With any callback, the job's live events are read between the two (`follow`): while the
        job runs, `on_stdout(text)` / `on_stderr(text)` get each chunk the program writes,
        `on_display(output)` each rich output, `on_event(event)` every `Event`; a redelivered
        job's callbacks go on with the new attempt's output (the earlier attempt's was
        abandoned: see `sandq.events.Callbacks`). The chunks are best effort (a slow Redis
        drops some, the worker caps them at 1 MiB): the returned result is the authoritative
        record. `wait_timeout` (s) bounds the whole; an exception a callback raises propagates
        (the job keeps running)."""
        job_id = self.submit(code, **spec)
        callbacks = Callbacks(on_stdout, on_stderr, on_display, on_event)
        if callbacks:
            started = time.monotonic()
            self._follow(job_id, callbacks, EVENTS_START, BLOCK_S, wait_timeout)
            if wait_timeout is not None:
                wait_timeout = max(0.0, wait_timeout - (time.monotonic() - started))
        return self.wait(job_id, wait_timeout, raise_on_error=raise_on_error)

    # --- live events -----------------------------------------------------------------------
    def events(self, job_id: str, cursor: str = EVENTS_START, *, block: float = BLOCK_S,
               timeout: Optional[float] = None) -> Iterator[Event]:
        """The job's live events after `cursor` (a stream id; `"0-0"`: from the first), in order,
        as they come (docs/protocol.md "Live events"). Ends after yielding the `end` event, or
        when a read that waited `block` seconds (0 < block <= 5) found nothing new and the job
        is no longer queued or running (a stream without `end`: expired, or an older worker; an
        unknown job), after the events still unread; or, without error, once `timeout` seconds
        (None: no limit) have passed.

        To resume after an interruption, pass the `id` of the last event processed: the events
        after it come, with no gap and no duplicate (unless the stream was trimmed: it keeps
        about 10,000 entries). Raises ValueError for a `block` out of range, and redis-py's
        errors."""
        if not 0 < block <= BLOCK_S:
            raise ValueError(f"block must be more than 0 and at most {BLOCK_S} s, not {block}")
        key = self.names.events(job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        over = False  # the job is over: read what is left without waiting
        while True:
            if over:
                batch = parse_xread(self.redis.xread({key: cursor}, count=EVENTS_COUNT))
                if not batch:
                    return
            else:
                left = block if deadline is None else min(block, deadline - time.monotonic())
                if left <= 0:
                    return
                reply = self._blocking.xread({key: cursor}, count=EVENTS_COUNT, block=max(1, round(left * 1000)))
                batch = parse_xread(reply)
                if not batch:
                    over = not self._active(job_id)
                    continue
            for event in batch:
                cursor = event.id
                yield event
                if event.type == "end":
                    return

    def follow(self, job_id: str, cursor: str = EVENTS_START, *, on_stdout: Optional[Callable[[str], Any]] = None,
               on_stderr: Optional[Callable[[str], Any]] = None, on_display: Optional[Callable[[Output], Any]] = None,
               on_event: Optional[Callable[[Event], Any]] = None, block: float = BLOCK_S,
               timeout: Optional[float] = None) -> Transcript:
        """Reads the job's `events` (same `cursor`, `block`, `timeout`) into the callbacks, as
        `run` does (`sandq.events.Callbacks` says which event goes where), and returns what they
        made (`sandq.events.Transcript`: the newest attempt's stdout, stderr and displays, the
        terminal status when `end` came)."""
        return self._follow(job_id, Callbacks(on_stdout, on_stderr, on_display, on_event), cursor, block, timeout)

    def _follow(self, job_id: str, callbacks: Callbacks, cursor: str, block: float,
                timeout: Optional[float]) -> Transcript:
        transcript = Transcript()
        for event in self.events(job_id, cursor, block=block, timeout=timeout):
            for callback, argument in callbacks.calls(event, transcript.push(event)):
                callback(argument)
        return transcript

    def _active(self, job_id: str) -> bool:
        """The job's hash says `queued` or `running`."""
        status = cast(Optional[bytes], self.redis.hget(self.names.job(job_id), "status"))
        return status is not None and status.decode() in ACTIVE

    def cancel(self, job_id: str) -> bool:
        """Asks the workers to cancel the job (skipped when queued, killed when running); False
        when it is unknown or already finished. The result then becomes `cancelled`."""
        key = self.names.job(job_id)
        status = cast(Optional[bytes], self.redis.hget(key, "status"))
        if status is None or status.decode() in TERMINAL:
            return False
        ttl = self.redis.ttl(key)
        self.redis.set(self.names.cancel(job_id), "1", ex=ttl if ttl and ttl > 0 else 86400)
        return True

    # --- sessions --------------------------------------------------------------------------
    def session(self, name: Optional[str] = None) -> "Session":
        """A session: jobs run through it share `/work` and (Python notebook) variables. A new
        unguessable name unless one is given."""
        return Session(self, name or protocol.new_session_name())

    def sessions(self) -> list[tuple[str, int]]:
        """The namespace's sessions and their expiry (Unix ms), soonest first."""
        rows = cast(list[tuple[bytes, float]], self.redis.zrange(self.names.sessions, 0, -1, withscores=True))
        return [(n.decode(), int(score)) for n, score in rows]

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

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session:
    """Jobs of one session (`session=` set on each)."""

    def __init__(self, client: Client, name: str):
        self.client, self.name = client, name

    def submit(self, code: Optional[str] = None, **spec: Any) -> str:
        return self.client.submit(code, session=self.name, **spec)

    def run(self, code: Optional[str] = None, **kwargs: Any) -> JobResult:
        """`Client.run` in the session (the same keywords, the callbacks included)."""
        return self.client.run(code, session=self.name, **kwargs)


def connect_redis(config: Config, **kwargs: Any) -> Any:
    """A redis client of the Redis `config` names (`redis_mode`): one server, a Redis Cluster
    (`RedisCluster`: routes each command by its key's slot, follows MOVED/ASK and retries through a
    failover) or the primary the sentinels name (`Sentinel.master_for`: asks them again after a
    failover). `kwargs` go to the connections (a socket timeout). docs/protocol.md "Redis
    deployments"."""
    if config.redis_mode == "cluster":
        nodes = [redis.cluster.ClusterNode(**protocol.redis_kwargs(u)) for u in config.redis_nodes]
        auth = {k: v for k, v in protocol.redis_kwargs(config.redis_nodes[0]).items() if k in ("username", "password")}
        return redis.cluster.RedisCluster(startup_nodes=nodes, **auth, **kwargs)
    if config.redis_mode == "sentinel":
        sentinels = [(k["host"], k["port"]) for k in map(protocol.redis_kwargs, config.redis_nodes)]
        return redis.sentinel.Sentinel(sentinels, **kwargs).master_for(config.redis_service, **kwargs)
    if config.redis_mode != "single":
        raise ValueError(f"redis mode {config.redis_mode!r} is not single, cluster or sentinel")
    return redis.Redis.from_url(config.redis_url, **kwargs)
