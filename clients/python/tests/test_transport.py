"""The clients are facades over a transport (`sandq.transport`): which one each mode takes, and
what the facade does on top (`wait`'s loop and exceptions, `run`'s budget, `events`' check,
uploads) against a transport of the test's own; where the direct transport's unserved warning
points (its broker and Redis calls stood in for). No services."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

import sandq
from sandq import transport
from sandq._aio_direct import AsyncDirectTransport
from sandq._aio_gateway import AsyncGatewayTransport
from sandq._direct import DirectTransport
from sandq._gateway import GatewayTransport
from sandq.aio import AsyncClient

REPO = Path(__file__).resolve().parents[3]


def test_the_package_has_no_import_cycle() -> None:
    package = Path(sandq.__file__).parent
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "import_cycles.py"), str(package)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout


@pytest.mark.parametrize("protocol,classes", [
    (transport.Transport, (DirectTransport, GatewayTransport)),
    (transport.AsyncTransport, (AsyncDirectTransport, AsyncGatewayTransport)),
])
def test_every_transport_has_the_protocols_calls(protocol: Any, classes: tuple) -> None:
    calls = [n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert calls
    for cls in classes:
        for name in calls:
            mine, theirs = getattr(cls, name), getattr(protocol, name)
            assert inspect.iscoroutinefunction(mine) == inspect.iscoroutinefunction(theirs), (cls, name)
            assert list(inspect.signature(mine).parameters) == list(inspect.signature(theirs).parameters), (cls, name)
        for attribute in ("block_s", "unknown"):
            assert hasattr(cls, attribute), (cls, attribute)


def test_each_mode_takes_its_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SANDQ_URL", raising=False)
    with sandq.Client(url="http://gw:1", api_key="sq_k") as client:
        assert type(client) is sandq.HttpClient and isinstance(client.transport, GatewayTransport)
        assert client.url == "http://gw:1" and client.config is None and repr(client) == "HttpClient(url='http://gw:1')"
    client = AsyncClient(url="http://gw:1", api_key="sq_k")
    assert type(client) is sandq.AsyncHttpClient and isinstance(client.transport, AsyncGatewayTransport)
    asyncio.run(client.aclose())
    with pytest.raises(ValueError, match="unserved="):
        sandq.Client(url="http://gw:1", api_key="sq_k", unserved="warn")
    with pytest.raises(ValueError, match="HttpClient needs url="):
        sandq.HttpClient()
    from sandq.http import HttpClient
    from sandq.aio_http import AsyncHttpClient
    assert HttpClient is sandq.HttpClient and AsyncHttpClient is sandq.AsyncHttpClient


def result(status: str, job_id: str = "j1") -> sandq.JobResult:
    return sandq.JobResult.from_wire({"job_id": job_id, "status": status, "reason": "why" if status == "rejected" else None})


class Fake:
    """A transport whose results are a script: one per `result` call (None: unknown)."""

    config = None
    block_s = 7.0
    unknown = "a fake's"

    def __init__(self, *results: Optional[sandq.JobResult]):
        self.results = list(results)
        self.waits: list[float] = []
        self.stored: list[tuple[bytes, str]] = []
        self.submitted: list[tuple[Optional[str], dict]] = []

    def store(self, data: bytes, digest: str) -> None:
        self.stored.append((data, digest))

    def submit(self, code: Optional[str], spec: dict[str, Any]) -> str:
        self.submitted.append((code, spec))
        return "j1"

    def result(self, job_id: str, wait: float) -> Optional[sandq.JobResult]:
        self.waits.append(wait)
        return self.results.pop(0) if len(self.results) > 1 else self.results[0]

    def events(self, job_id: str, cursor: str, block: float, timeout: Optional[float]):
        yield sandq.Event.from_wire("1-0", {"type": "stdout", "attempt": "1", "seq": "0", "data": "hi"})
        yield sandq.Event.from_wire("2-0", {"type": "end", "attempt": "1", "status": "succeeded"})

    def close(self) -> None:
        pass


def facade(fake: Fake) -> sandq.Client:
    client = sandq.Client(url="http://gw:1", api_key="sq_k")
    client.close()
    client.transport = fake  # type: ignore[assignment]
    return client


def test_wait_loops_on_the_transport_and_raises_as_before() -> None:
    fake = Fake(result("queued"), result("running"), result("succeeded"))
    assert facade(fake).wait("j1").status == "succeeded"
    assert fake.waits == [7.0, 7.0, 7.0], "block_s defaults to the transport's"
    fake = Fake(result("queued"), result("succeeded"))
    facade(fake).wait("j1", block_s=2.0)
    assert fake.waits == [2.0, 2.0]
    with pytest.raises(sandq.JobNotFound, match=r"job j1 is unknown \(a fake's\)"):
        facade(Fake(None)).wait("j1")
    with pytest.raises(sandq.JobRejected):
        facade(Fake(result("rejected"))).wait("j1")
    assert facade(Fake(result("rejected"))).wait("j1", raise_on_error=False).status == "rejected"
    assert facade(Fake(result("failed"))).wait("j1").status == "failed"
    with pytest.raises(sandq.WaitTimeout):
        facade(Fake(result("running"))).wait("j1", timeout=0)
    fake = Fake(result("running"))
    with pytest.raises(sandq.WaitTimeout):
        facade(fake).wait("j1", timeout=0.05)
    assert all(0 <= w <= 0.05 for w in fake.waits)
    assert facade(Fake(result("running"))).status("j1").status == "running"


def test_run_follows_then_waits_and_upload_names_the_file(tmp_path: Path) -> None:
    fake = Fake(result("succeeded"))
    client = facade(fake)
    seen: list[str] = []
    assert client.run("print(1)", sku="S", on_stdout=seen.append).status == "succeeded"
    assert seen == ["hi"] and fake.submitted == [("print(1)", {"sku": "S"})]
    with pytest.raises(ValueError, match="block"):
        next(client.events("j1", block=6))
    (tmp_path / "data.csv").write_bytes(b"a,b\n")
    file = client.upload(tmp_path / "data.csv")
    assert file.path == "data.csv" and file.size == 4 and fake.stored == [(b"a,b\n", file.sha256)]
    assert file.key == sandq.protocol.input_key(file.sha256)
    with pytest.raises(ValueError, match="path inside /work"):
        client.upload(b"x")


class Recorded:
    """Stands for a Redis client: records `eval`."""

    def __init__(self) -> None:
        self.evals: list[tuple] = []

    def eval(self, *args: Any) -> None:
        self.evals.append(args)

    async def aeval(self, *args: Any) -> None:
        self.evals.append(args)


def test_the_unserved_warning_points_at_the_caller_of_submit(monkeypatch: pytest.MonkeyPatch) -> None:
    client = sandq.Client(sandq.Config(namespace="sandq-test-transport"), unserved="warn")
    recorded = Recorded()
    monkeypatch.setattr(client.transport, "_consumers", lambda sku: 0)
    monkeypatch.setattr(client.transport, "_publish", lambda job: None)
    monkeypatch.setattr(client.transport, "redis", recorded)
    with pytest.warns(sandq.UnservedSkuWarning) as record:
        job_id = client.submit("print(1)", sku="L")
    assert record.list[0].filename == __file__ and len(recorded.evals) == 1 and job_id in recorded.evals[0][2]
    monkeypatch.setattr(client.transport, "_consumers", lambda sku: 1)
    with no_warning():
        client.submit("print(1)", sku="L")
    refusing = sandq.Client(sandq.Config(namespace="sandq-test-transport"), unserved="refuse")
    monkeypatch.setattr(refusing.transport, "_consumers", lambda sku: 0)
    with pytest.raises(sandq.UnservedSku):
        refusing.submit("print(1)", sku="L")


def test_the_async_unserved_warning_points_at_the_caller_of_submit(monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> list:
        client = AsyncClient(sandq.Config(namespace="sandq-test-transport"))
        recorded = Recorded()

        async def consumers(sku: str) -> int:
            return 0

        async def publish(job: dict) -> None:
            return None

        monkeypatch.setattr(client.transport, "_consumers", consumers)
        monkeypatch.setattr(client.transport, "_publish", publish)
        monkeypatch.setattr(client.transport, "redis", type("R", (), {"eval": staticmethod(recorded.aeval)})())
        with pytest.warns(sandq.UnservedSkuWarning) as record:
            await client.submit("print(1)", sku="L")
        return record.list

    assert asyncio.run(go())[0].filename == __file__


@contextlib.contextmanager
def no_warning() -> Iterator[None]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        yield
    assert not record, [str(w.message) for w in record]
