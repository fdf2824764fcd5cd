"""The blocking client: `Client`, a facade over a transport (`sandq.transport`): direct mode
(`_direct`: pika, redis-py, boto3) or HTTP mode (`_gateway`: sandq-gateway with httpx)."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from . import gateway
from ._files import Source, check_download, input_file, read_source, target_of, work_path
from ._wait import Waiting, remaining
from .events import Callbacks, Transcript
from .protocol import BLOCK_S, EVENTS_START, Config, new_session_name
from .transport import Transport
from .types import Artifact, Event, InputFile, JobResult, Output, Stream

__all__ = ["Client", "HttpClient", "Session", "Source"]


class Client:
    """A sandq client, in one of two modes with the same methods:

    - direct: `Client()` reads the service config (`$SANDQ_CONFIG`, else /etc/sandq/sandq.toml)
      and speaks AMQP, Redis and S3; pass a `Config` or `namespace=` to choose others;
    - HTTP: `Client(url="https://sandq.example.com", api_key="sq_...")` speaks to sandq-gateway
      (docs/gateway.md) and is a `sandq.HttpClient`; also taken when `$SANDQ_URL` is set (with
      `$SANDQ_API_KEY`) and neither a config nor a namespace is given (`sandq.gateway` has the
      rules).

    Before publishing a job, a direct client asks the broker whether any worker serves its SKU
    (docs/protocol.md "Which SKUs are served"); `unserved=` says what it does when none does:
    "warn" (default: an `UnservedSkuWarning`, then it submits; a job waits in its queue until a
    worker comes, an autoscaler's say, or `queues.unserved_ttl` passes), "refuse" (`UnservedSku`,
    nothing published) or "ignore" (no question asked). A SKU seen served is not asked about
    again for 10 s; a broker that cannot answer does not stop the submission.

    The mode is `transport` (`sandq.transport.Transport`); its attributes are the client's too
    (direct: `config`, `names`, `redis`, `s3`, `unserved`; HTTP: `url`, and `config` None).
    Thread-safe for submitting; close it (or use it as a context manager) when done."""

    transport: Transport

    def __new__(cls, config: Optional[Config] = None, *, namespace: Optional[str] = None, url: Optional[str] = None,
                api_key: Optional[str] = None, unserved: Optional[str] = None) -> "Client":
        if cls is Client and gateway.takes_http(config, namespace, url, api_key, unserved):
            return super().__new__(HttpClient)
        return super().__new__(cls)

    def __init__(self, config: Optional[Config] = None, *, namespace: Optional[str] = None, url: Optional[str] = None,
                 api_key: Optional[str] = None, unserved: Optional[str] = None):
        if url or api_key:
            raise ValueError("url= and api_key= are HTTP mode's: sandq.Client or sandq.HttpClient, not a subclass of the direct client")
        from ._direct import DirectTransport
        self.transport = DirectTransport(config, namespace=namespace, unserved=unserved)

    def __getattr__(self, name: str) -> Any:
        # The transport's attributes (`redis`, `names`, `url`...), once `__init__` has set it.
        if name.startswith("__") or "transport" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.transport, name)

    # --- files -----------------------------------------------------------------------------
    def upload(self, source: Source, path: Optional[str] = None) -> InputFile:
        """Uploads a file (a path, or bytes) under its content address, unless it is there
        already; the job sees it at `/work/<path>` (default: the file's name). Over HTTP
        `POST /v1/files`: the file is the tenant's for the gateway's `file_ttl` (7 days by
        default)."""
        data = read_source(source)
        path = work_path(source, path)
        file = input_file(data, path)
        self.transport.store(data, file.sha256)
        return file

    def download(self, artifact: Artifact) -> bytes:
        """An artifact's bytes, checked against its size and sha256: direct, through its
        presigned URL (from S3 by key when it has none); over HTTP, a result's artifact through
        `GET /v1/jobs/{id}/artifacts/{path}` (a redirect to a presigned URL, fetched without the
        key), a rich output's representation through its own `url` (`NotFound` when the gateway
        has no such artifact for this tenant)."""
        return check_download(artifact, self.transport.fetch(artifact))

    def download_to(self, artifact: Artifact, dest: Union[str, os.PathLike]) -> Path:
        """`download`, written to `dest` (a directory gets the artifact's name)."""
        target = target_of(artifact, dest)
        target.write_bytes(self.download(artifact))
        return target

    def read_log(self, stream: Stream) -> bytes:
        """The exact bytes of stdout or stderr (up to 8 MiB), from S3; the inline text when the
        stream was empty. Over HTTP (the gateway serves no logs) the inline text when it is
        exact (not truncated or lossy), else SandqError."""
        return self.transport.read_log(stream)

    # --- submitting ------------------------------------------------------------------------
    def submit(self, code: Optional[str] = None, **spec: Any) -> str:
        """Submits a job and returns its id once the broker confirmed it. Keyword arguments are
        the JobSpec's fields (docs/protocol.md): `entrypoint`, `sku` ("M"), `runtime`
        ("python"), `inputs` (from `upload`), `args`, `stdin`, `env`, `timeout` ("60s"),
        `result_ttl`, `network`, `deadline_ms`, `mode`, `session`, `job_id`.

        Before the publish, unless `unserved="ignore"`, it asks whether a worker serves the SKU
        (the class's doc): none does -> `UnservedSkuWarning`, or `UnservedSku` raised with
        `unserved="refuse"` (nothing published, no status written).

        Over HTTP, `POST /v1/jobs` (the job id is the tenant's): no `entrypoint` (the gateway
        runs `code`), `stdin` as text, plus `callback_url` (docs/gateway.md "Webhooks"). Sent
        again on no answer or 503 with the same body and job id (`Idempotency-Key`); raises
        `SubmitError` when the retries ran out (the job may be queued: submit again with
        `job_id=` that id), and `InvalidRequest`, `ForbiddenByQuota`, `QuotaExceeded`,
        `Conflict`, `Unauthorized` for the gateway's refusals."""
        return self.transport.submit(code, spec)

    def declare_topology(self) -> None:
        """Declares the namespace's exchanges and queues, with exactly the workers' arguments
        (workers declare them too; a client may rely on them existing). Direct mode only."""
        self.transport.declare_topology()

    # --- results ---------------------------------------------------------------------------
    def status(self, job_id: str) -> Optional[JobResult]:
        """The job's current result (`queued`, `running` or terminal); None when unknown (over
        HTTP: the gateway has no such job for this tenant)."""
        return self.transport.result(job_id, 0.0)

    def wait(self, job_id: str, timeout: Optional[float] = None, *, raise_on_error: bool = True,
             block_s: Optional[float] = None) -> JobResult:
        """Blocks until the job's result is terminal (direct: BLPOP on its done list, reading the
        hash before and after every wait; HTTP: `GET /v1/jobs/{id}?wait=`), each wait at most
        `block_s` (None: 5 s direct, 30 s over HTTP). Raises `WaitTimeout` after `timeout`
        seconds (None: no limit), `JobNotFound` for an unknown job, and unless `raise_on_error`
        is false `JobRejected`, `JobExpired` or `JobInternalError`."""
        waiting = Waiting(job_id, timeout, self.transport.block_s if block_s is None else block_s,
                          self.transport.unknown, raise_on_error)
        while True:
            result = waiting.done(self.transport.result(job_id, waiting.left()))
            if result is not None:
                return result

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
            wait_timeout = remaining(wait_timeout, started)
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
        errors.

        Over HTTP, through `GET /v1/jobs/{id}/events` (server-sent events): a dropped or silent
        connection (`sandq.gateway.STREAM_IDLE_S`) is reopened with `Last-Event-ID`, the last
        event's id, so the events go on with no gap and no duplicate; `block` is checked but has
        no other effect. Raises `JobNotFound` when the gateway has no such job for this tenant,
        `Unavailable` after `sandq.gateway.RETRIES` failed connections in a row."""
        if not 0 < block <= BLOCK_S:
            raise ValueError(f"block must be more than 0 and at most {BLOCK_S} s, not {block}")
        yield from self.transport.events(job_id, cursor, block, timeout)

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

    def cancel(self, job_id: str) -> bool:
        """Asks the workers to cancel the job (skipped when queued, killed when running); False
        when it is unknown or already finished (over HTTP `DELETE /v1/jobs/{id}`; also False for
        a job the tenant does not have). The result then becomes `cancelled`."""
        return self.transport.cancel(job_id)

    # --- sessions --------------------------------------------------------------------------
    def session(self, name: Optional[str] = None) -> "Session":
        """A session: jobs run through it share `/work` and (Python notebook) variables. A new
        unguessable name unless one is given."""
        return Session(self, name or new_session_name())

    def sessions(self) -> list[tuple[str, Optional[int]]]:
        """The sessions and their expiry (Unix ms), soonest first: direct, the namespace's; over
        HTTP (`GET /v1/sessions`) the tenant's, where one no job has used yet has no expiry
        (None, listed last)."""
        return self.transport.sessions()

    # --- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HttpClient(Client):
    """`sandq.Client` over HTTP (what `Client(url=..., api_key=...)` is): the same facade,
    always over sandq-gateway (`_gateway.GatewayTransport`: requests with the API key, retried
    when safe, error answers raised as their problem type's `sandq.errors` class)."""

    def __init__(self, config: Optional[Config] = None, *, namespace: Optional[str] = None, url: Optional[str] = None,
                 api_key: Optional[str] = None):
        from ._gateway import GatewayTransport
        self.transport = GatewayTransport(*gateway.required_target("HttpClient", config, namespace, url, api_key))

    def __repr__(self) -> str:
        return f"HttpClient(url={self.url!r})"


class Session:
    """Jobs of one session (`session=` set on each)."""

    def __init__(self, client: Client, name: str):
        self.client, self.name = client, name

    def submit(self, code: Optional[str] = None, **spec: Any) -> str:
        return self.client.submit(code, session=self.name, **spec)

    def run(self, code: Optional[str] = None, **kwargs: Any) -> JobResult:
        """`Client.run` in the session (the same keywords, the callbacks included)."""
        return self.client.run(code, session=self.name, **kwargs)
