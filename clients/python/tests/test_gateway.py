"""The SDK's HTTP mode (`sandq.Client(url=..., api_key=...)`) against a real sandq-gateway and the
tests' worker (conftest.py), in the same namespace: the gateway binary of
`${CARGO_TARGET_DIR:-target}/debug`, started with `--exit-on-stdin-eof` on a free port, and tenant
keys made with the `sandq key create` CLI. A loopback proxy of this file cuts chosen connections
to prove that event streams resume and submissions are retried without a gap, a duplicate or a
second job. Expected values are computed here (the CSV's sum in plain Python, the artifact's
bytes with hashlib). The first tests need no services: the SSE parser, the event mapping, the
problem types and the choice of mode."""
from __future__ import annotations

import asyncio
import csv
import dataclasses
import hashlib
import json
import io
import socket
import threading
import time
import uuid
from typing import Optional

import pytest

import sandq
from sandq import gateway
from sandq.aio import AsyncClient
from sandq.errors import Problem

from conftest import new_key

WAIT = 120.0

# A line every 200 ms, 10 in all: output that comes while the job runs.
TICKER = """\
import time
for i in range(10):
    print(f"tick {i} " + "." * 60, flush=True)
    time.sleep(0.2)
"""
TICKS = "".join(f"tick {i} " + "." * 60 + "\n" for i in range(10))


# --- without services ----------------------------------------------------------------------

def test_sse_parser_dispatches_on_blank_lines_and_drops_a_cut_event():
    parser = gateway.SseParser()
    lines = [": keep-alive", "", "id: 1-0", "event: stdout", 'data: {"text": "a"}', "", "id: 2-0", "data: x", "data:y", "",
             "event: stdout", "id: 3-0", "data: cut"]
    out = [e for e in (parser.feed(line) for line in lines) if e is not None]
    assert out == [("1-0", "stdout", '{"text": "a"}'), ("2-0", "message", "x\ny")]


def test_gateway_events_become_the_streams_events():
    def one(kind: str, data: str) -> sandq.Event:
        event = gateway.event_of("5-1", kind, data)
        assert event is not None and event.id == "5-1"
        return event

    e = one("stdout", '{"attempt": 1, "seq": 3, "text": "hi\\n"}')
    assert (e.type, e.attempt, e.seq, e.data) == ("stdout", 1, 3, "hi\n")
    e = one("started", '{"attempt": 2, "seq": 1, "warm": true}')
    assert (e.type, e.state, e.warm, e.attempt) == ("status", "started", True, 2)
    e = one("finished", '{"attempt": 1, "seq": 9, "exit_code": null}')
    assert (e.type, e.state, e.exit_code) == ("status", "finished", None)
    e = one("finished", '{"attempt": 1, "seq": 9, "exit_code": 3}')
    assert e.exit_code == 3
    e = one("requeued", '{"attempt": 1, "seq": 4, "reason": "worker lost"}')
    assert (e.type, e.state, e.reason) == ("status", "queued", "worker lost")
    output = {"output_type": "execute_result", "data": {"text/plain": {"text": "42", "size": 2}}}
    e = one("display", '{"attempt": 1, "seq": 2, "index": 0, "output": %s}' % json.dumps(output))
    assert (e.type, e.index, e.output.text) == ("display", 0, "42")
    e = one("truncated", '{"attempt": 1, "seq": 5, "stream": "stdout", "limit": 1048576}')
    assert (e.stream, e.limit) == ("stdout", 1048576)
    e = one("end", '{"attempt": 1, "seq": null, "status": "succeeded"}')
    assert (e.type, e.status, e.seq) == ("end", "succeeded", None)
    e = one("attempt", '{"attempt": 1, "seq": 0, "attempt_id": "a0123456789abcdef"}')
    assert e.attempt_id == "a0123456789abcdef"
    assert gateway.event_of(None, "stdout", "{}") is None and gateway.event_of("1-0", "stdout", "not json") is None


@pytest.mark.parametrize("slug,status,cls", [
    ("unauthorized", 401, sandq.Unauthorized), ("forbidden-by-quota", 403, sandq.ForbiddenByQuota),
    ("quota-exceeded", 429, sandq.QuotaExceeded), ("not-found", 404, sandq.NotFound), ("conflict", 409, sandq.Conflict),
    ("unavailable", 503, sandq.Unavailable), ("invalid-request", 400, sandq.InvalidRequest),
    ("body-too-large", 413, sandq.InvalidRequest), ("unsupported-media-type", 415, sandq.InvalidRequest),
    ("something-new", 418, sandq.GatewayError)])
def test_problem_types_are_exception_classes(slug, status, cls):
    body = ('{"type": "urn:sandq:problem:%s", "title": "t", "status": %d, "detail": "d", "retry_after": 7}' % (slug, status)).encode()
    problem = gateway.problem_of(status, {"retry-after": "3"}, body)
    assert problem == Problem(type=f"urn:sandq:problem:{slug}", status=status, title="t", detail="d", retry_after=3.0)
    error = gateway.error_of(problem)
    assert type(error) is cls and error.problem is problem and isinstance(error, sandq.SandqError)
    if cls is sandq.NotFound:
        assert type(gateway.error_of(problem, job="j")) is sandq.JobNotFound
    # Not a problem document (a proxy's page): the status decides.
    plain = gateway.problem_of(status, {}, b"<html>nope</html>")
    assert plain.type == "about:blank" and "nope" in plain.detail
    assert isinstance(gateway.error_of(plain), cls if cls is not sandq.GatewayError else sandq.GatewayError)


def test_mode_precedence(monkeypatch):
    for var in ("SANDQ_URL", "SANDQ_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    assert gateway.http_target(None, None, None, None) is None
    assert gateway.http_target(None, None, "http://gw:8080/", "sq_k") == ("http://gw:8080", "sq_k")
    with pytest.raises(ValueError):
        gateway.http_target(None, None, "http://gw:8080", None)  # no key
    with pytest.raises(ValueError):
        gateway.http_target(None, None, None, "sq_k")  # a key without a URL
    monkeypatch.setenv("SANDQ_URL", "http://env:1")
    monkeypatch.setenv("SANDQ_API_KEY", "sq_env")
    assert gateway.http_target(None, None, None, None) == ("http://env:1", "sq_env")
    assert gateway.http_target(None, None, "http://arg:2", None) == ("http://arg:2", "sq_env")
    assert gateway.http_target(sandq.Config(), None, None, None) is None, "an explicit config is direct mode"
    assert gateway.http_target(None, "ns", None, None) is None, "so is a namespace"
    with pytest.raises(ValueError):
        gateway.http_target(sandq.Config(), None, "http://arg:2", None)
    with sandq.Client() as client:
        assert isinstance(client, sandq.HttpClient) and client.url == "http://env:1"
    with sandq.Client(sandq.Config()) as client:
        assert type(client) is sandq.Client


def test_a_job_as_the_gateways_json():
    data = sandq.InputFile(key="inputs/sha256/" + "a" * 64, path="d/x.csv", size=3, sha256="a" * 64)
    job_id, body, headers = gateway.job_request("print(1)", dict(sku="S", inputs=[data], stdin="in", env={"A": "1"},
                                                                  session="s1", callback_url="https://h/x"))
    assert headers["Idempotency-Key"] == job_id
    assert json.loads(body) == {
        "job_id": job_id, "runtime": "python", "code": "print(1)", "sku": "S", "stdin": "in", "env": {"A": "1"},
        "session": "s1", "inputs": [{"file_id": "a" * 64, "path": "d/x.csv"}], "callback_url": "https://h/x"}
    with pytest.raises(ValueError):
        gateway.job_request(None, dict(entrypoint="main.py"))
    with pytest.raises(ValueError):
        gateway.job_request("1", dict(stdin=b"\xff"))


# --- the gateway, its keys, a proxy that cuts connections ----------------------------------

def tenant(label: str) -> str:
    return f"{label}{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def api_key(gateway_url) -> str:
    return new_key(tenant("py"))


@pytest.fixture
def client(gateway_url, api_key):
    with sandq.Client(url=gateway_url, api_key=api_key) as c:
        assert isinstance(c, sandq.HttpClient)
        yield c


class CuttingProxy:
    """A loopback TCP proxy to the gateway that cuts the first `cuts` requests whose bytes hold
    `marker`: it forwards at most `cut_after` bytes of the answer, then closes the connection.
    `cut` counts the answers it did cut."""

    def __init__(self, upstream_url: str, marker: bytes, cut_after: int, cuts: int):
        host, port = upstream_url.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.marker, self.cut_after, self.cuts, self.armed, self.cut = marker, cut_after, cuts, 0, 0
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.server.close()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(down,), daemon=True).start()

    def _serve(self, down: socket.socket) -> None:
        up = socket.create_connection(self.upstream)
        state = {"cutting": False, "sent": 0}

        def requests() -> None:
            try:
                while data := down.recv(65536):
                    if self.marker in data:
                        with self.lock:
                            if self.armed < self.cuts:
                                self.armed += 1
                                state["cutting"], state["sent"] = True, 0
                    up.sendall(data)
            except OSError:
                pass
            finally:
                try:
                    up.shutdown(socket.SHUT_WR)
                except OSError:
                    pass

        threading.Thread(target=requests, daemon=True).start()
        try:
            while data := up.recv(65536):
                if state["cutting"]:
                    room = self.cut_after - state["sent"]
                    if len(data) >= room:
                        down.sendall(data[:max(room, 0)])
                        with self.lock:
                            self.cut += 1
                        break
                    state["sent"] += len(data)
                down.sendall(data)
        except OSError:
            pass
        finally:
            for s in (down, up):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()


# --- jobs over HTTP ------------------------------------------------------------------------

def test_run_reads_stdout_and_a_retried_submission_is_the_same_job(client, gateway_url, api_key):
    result = client.run("print(6 * 7)", sku="S", mode="script", wait_timeout=WAIT)
    assert result.status == "succeeded", result.stderr.text
    assert result.stdout.text == "42\n" and result.exit_code == 0
    assert client.status(result.job_id) == result
    assert "_" not in result.job_id, "the tenant's id (a UUID), without the queue's `<tenant>_` prefix"

    # The first answer to this POST is cut: the request reached the gateway, which queued the
    # job; the client sends the same bytes again and gets the same job, not a second one.
    proxy = CuttingProxy(gateway_url, b"POST /v1/jobs", cut_after=0, cuts=1)
    try:
        with sandq.Client(url=proxy.url, api_key=api_key) as through:
            job_id = through.submit("print('once')", sku="S", mode="script")
            assert proxy.cut == 1
            again = client.wait(job_id, WAIT)
    finally:
        proxy.close()
    assert (again.status, again.stdout.text, again.attempt) == ("succeeded", "once\n", 1)
    assert client.submit("print('once')", sku="S", mode="script", job_id=job_id) == job_id, "the same body: the same job"
    with pytest.raises(sandq.Conflict) as conflict:
        client.submit("print('twice')", sku="S", mode="script", job_id=job_id)
    assert conflict.value.problem.type == "urn:sandq:problem:conflict"


def test_uploaded_csv_read_in_the_job(client):
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["day", "amount"])
    for day in range(1, 41):
        writer.writerow([day, round(10 + day * 2.75 + (day * 7 % 5) * 0.5, 2)])
    data = out.getvalue().encode()
    expected = sum(float(r["amount"]) for r in csv.DictReader(io.StringIO(data.decode())))

    upload = client.upload(data, "data/amounts.csv")
    assert upload.sha256 == hashlib.sha256(data).hexdigest() and upload.size == len(data)
    code = ("import csv\n"
            "rows = list(csv.DictReader(open('data/amounts.csv')))\n"
            "print(len(rows), repr(sum(float(r['amount']) for r in rows)))\n")
    result = client.run(code, inputs=[upload], sku="S", mode="script", wait_timeout=WAIT)
    assert result.status == "succeeded", result.stderr.text
    count, total = result.stdout.text.split()
    assert int(count) == 40 and float(total) == pytest.approx(expected)


def test_live_events_come_while_the_job_runs_and_resume_without_gap_or_duplicate(client, gateway_url, api_key):
    job_id = client.submit(TICKER, sku="S", mode="script")
    # Through a proxy that cuts the first two event streams mid-way: the client reopens them
    # after the last event it read.
    proxy = CuttingProxy(gateway_url, b"/events", cut_after=700, cuts=2)
    seen: list[sandq.Event] = []
    first_at_ms: Optional[float] = None
    status_at_first = None
    try:
        with sandq.Client(url=proxy.url, api_key=api_key) as through:
            for event in through.events(job_id, timeout=WAIT):
                seen.append(event)
                if event.type == "stdout" and first_at_ms is None:
                    first_at_ms = time.time() * 1000
                    status_at_first = client.status(job_id).status
    finally:
        proxy.close()
    result = client.wait(job_id, WAIT)
    assert result.status == "succeeded", result.stderr.text
    assert proxy.cut == 2, "both streams were cut"
    assert first_at_ms is not None and status_at_first == "running" and first_at_ms < result.finished_at_ms

    whole = list(client.events(job_id))
    assert [e.id for e in seen] == [e.id for e in whole], "no gap, no duplicate across the cuts"
    assert len({e.id for e in whole}) == len(whole) and whole[-1].type == "end" and whole[-1].status == "succeeded"
    assert "".join(e.data or "" for e in whole if e.type == "stdout") == TICKS == result.stdout.text

    # From a cursor: exactly the events after it.
    middle = len(whole) // 2
    rest = list(client.events(job_id, whole[middle].id))
    assert [e.id for e in rest] == [e.id for e in whole[middle + 1:]]

    # follow's callbacks make the same text.
    chunks: list[str] = []
    transcript = client.follow(job_id, on_stdout=chunks.append)
    assert "".join(chunks) == transcript.stdout == TICKS and transcript.status == "succeeded"


def test_a_session_keeps_a_variable_across_runs(client):
    session = client.session()
    first = session.run("x = 41\n", sku="S", wait_timeout=WAIT)
    assert first.status == "succeeded", first.stderr.text
    second = session.run("print(x + 1)\n", sku="S", wait_timeout=WAIT)
    assert second.status == "succeeded", second.stderr.text
    assert second.stdout.text == "42\n"
    assert second.session is not None and second.session.name == session.name
    names = [name for name, _ in client.sessions()]
    assert session.name in names


def test_cancel_a_running_job(client):
    job_id = client.submit("import time\nprint('started', flush=True)\ntime.sleep(60)\n", sku="S", mode="script")
    for event in client.events(job_id, timeout=WAIT):
        if event.type == "stdout" and "started" in (event.data or ""):
            break
    assert client.cancel(job_id) is True
    result = client.wait(job_id, WAIT)
    assert result.status == "cancelled"
    assert result.finished_at_ms - result.started_at_ms < 30_000
    assert client.cancel(job_id) is False, "a job that is over"


def artifact_bytes() -> bytes:
    return b"".join(hashlib.sha256(str(i).encode()).digest() for i in range(2000))


def test_artifact_downloaded_and_another_tenants_job_is_not_found(client, gateway_url, tmp_path):
    code = ("import hashlib\n"
            "data = b''.join(hashlib.sha256(str(i).encode()).digest() for i in range(2000))\n"
            "open('out.bin', 'wb').write(data)\n")
    result = client.run(code, sku="S", mode="script", wait_timeout=WAIT)
    assert result.status == "succeeded", result.stderr.text
    artifact = result.artifact("out.bin")
    expected = artifact_bytes()
    assert artifact.size == len(expected) and artifact.sha256 == hashlib.sha256(expected).hexdigest()
    assert client.download(artifact) == expected
    written = client.download_to(artifact, tmp_path)
    assert written == tmp_path / "out.bin" and written.read_bytes() == expected

    # Another tenant sees none of it: the same answers as for an id never used.
    with sandq.Client(url=gateway_url, api_key=new_key(tenant("other"))) as other:
        assert other.status(result.job_id) is None
        with pytest.raises(sandq.JobNotFound) as not_found:
            other.wait(result.job_id, 5)
        assert isinstance(not_found.value, KeyError)
        with pytest.raises(sandq.JobNotFound) as streamed:
            list(other.events(result.job_id))
        assert streamed.value.problem.status == 404 and streamed.value.problem.slug == "not-found"
        assert other.cancel(result.job_id) is False
        with pytest.raises(sandq.NotFound):
            other.download(artifact)
    with pytest.raises(sandq.NotFound):
        client.download(dataclasses.replace(artifact, path="no-such-file"))


def test_a_wrong_key_is_unauthorized(gateway_url):
    with sandq.Client(url=gateway_url, api_key="sq_aaaaaaaaaaaa_" + "A" * 43) as client:
        with pytest.raises(sandq.Unauthorized) as refused:
            client.submit("print(1)", sku="S")
        assert refused.value.problem.status == 401 and refused.value.problem.type == "urn:sandq:problem:unauthorized"
        with pytest.raises(sandq.Unauthorized):
            client.status("anything")
        with pytest.raises(sandq.Unauthorized):
            client.upload(b"x", "x.txt")


def test_quotas_are_typed_errors(gateway_url):
    with sandq.Client(url=gateway_url, api_key=new_key(tenant("quota"), "--max-in-flight", "1")) as client:
        with pytest.raises(sandq.ForbiddenByQuota):
            client.submit("print(1)", sku="XL")
        with pytest.raises(sandq.InvalidRequest) as invalid:
            client.submit("print(1)", sku="S", job_id="not an id!")
        assert "job_id" in invalid.value.problem.detail
        sleeper = client.submit("import time\ntime.sleep(30)\n", sku="S", mode="script")
        with pytest.raises(sandq.QuotaExceeded) as over:
            client.submit("print(1)", sku="S")
        assert over.value.retry_after is not None and over.value.retry_after >= 1
        assert client.cancel(sleeper)
        assert client.wait(sleeper, WAIT).status == "cancelled"


async def test_the_asyncio_client_runs_with_callbacks(gateway_url, api_key):
    chunks: list[str] = []
    events: list[sandq.Event] = []

    async def on_event(event: sandq.Event) -> None:
        await asyncio.sleep(0)
        events.append(event)

    # Its event stream is cut once mid-way: it resumes as the blocking client's does.
    proxy = CuttingProxy(gateway_url, b"/events", cut_after=700, cuts=1)
    try:
        async with AsyncClient(url=proxy.url, api_key=api_key) as client:
            assert isinstance(client, sandq.AsyncHttpClient)
            result = await client.run(TICKER, sku="S", mode="script", wait_timeout=WAIT, on_stdout=chunks.append,
                                      on_event=on_event)
    finally:
        proxy.close()
    assert proxy.cut == 1
    assert result.status == "succeeded", result.stderr.text
    assert "".join(chunks) == TICKS == result.stdout.text
    assert events[-1].type == "end" and events[-1].status == "succeeded"
    assert [e.id for e in events] == [e.id for e in await collect(gateway_url, api_key, result.job_id)]
    async with AsyncClient(url=gateway_url, api_key=api_key) as client:
        assert (await client.status(result.job_id)) == result
        data = b"a,b\n1,2\n"
        upload = await client.upload(data, "t.csv")
        again = await client.run("print(open('t.csv').read(), end='')", inputs=[upload], sku="S", mode="script",
                                 wait_timeout=WAIT)
        assert again.stdout.text == data.decode()


async def collect(url: str, key: str, job_id: str) -> list[sandq.Event]:
    async with AsyncClient(url=url, api_key=key) as client:
        return [event async for event in client.events(job_id)]


def test_a_rich_outputs_image_downloads_through_its_url(client):
    result = client.run("import matplotlib.pyplot as plt\nfig, ax = plt.subplots(figsize=(4, 2), dpi=50)\nax.plot([1, 3, 2])\n",
                        sku="S", wait_timeout=WAIT)
    assert result.status == "succeeded", result.stderr.text
    [(output, value)] = result.images()
    assert value.artifact is not None and value.artifact.job_id is None, "not one of the result's artifacts"
    png = client.download(value.artifact)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (200, 100) == (output.image.width, output.image.height)
