"""The Python SDK against the real services and a real worker. Expected values are computed
here, from the data the tests make (the CSV's statistics in plain Python, PNG sizes read from
the header by hand, hashes with hashlib)."""
from __future__ import annotations

import csv
import hashlib
import io
import json
import struct
import time
import uuid

import pytest

import sandq
from sandq.aio import AsyncClient

WAIT = 180.0

ANALYSIS = """\
import json
import matplotlib.pyplot as plt
import pandas as pd

df = pd.read_csv('data/sales.csv')
df['profit'] = df['sales'] - df['cost']
stats = {
    'rows': int(len(df)),
    'sales_sum': float(df['sales'].sum()),
    'profit_mean': float(df['profit'].mean()),
    'best_day': int(df.loc[df['profit'].idxmax(), 'day']),
}
with open('stats.json', 'w') as f:
    json.dump(stats, f)
fig, ax = plt.subplots(figsize=(6, 3), dpi=100)
ax.plot(df['day'], df['profit'])
print('rows', len(df))
df.describe()
"""


def sales_csv() -> bytes:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["day", "sales", "cost"])
    for day in range(1, 61):
        w.writerow([day, round(100 + 7.5 * day + (day * 37 % 11) * 3.25, 2), round(80 + 5 * day + (day * 13 % 7) * 2.5, 2)])
    return out.getvalue().encode()


def expected_stats(data: bytes) -> dict:
    rows = list(csv.DictReader(io.StringIO(data.decode())))
    profits = [(float(r["sales"]) - float(r["cost"]), int(r["day"])) for r in rows]
    best = max(profits, key=lambda p: p[0])  # the first of equal maxima, like idxmax
    best = next(p for p in profits if p[0] == best[0])
    return {"rows": len(rows), "sales_sum": sum(float(r["sales"]) for r in rows),
            "profit_mean": sum(p for p, _ in profits) / len(rows), "best_day": best[1]}


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "PNG signature"
    assert data[12:16] == b"IHDR", "first chunk is IHDR"
    assert data[-8:-4] == b"IEND", "last chunk is IEND"
    return struct.unpack(">II", data[16:24])


def test_csv_job_chart_and_artifact(client: sandq.Client) -> None:
    data = sales_csv()
    upload = client.upload(data, "data/sales.csv")
    assert upload.sha256 == hashlib.sha256(data).hexdigest() and upload.key == f"inputs/sha256/{upload.sha256}"
    assert client.upload(data, "data/sales.csv") == upload, "a second upload of the same bytes names the same object"

    result = client.run(ANALYSIS, inputs=[upload], sku="M", wait_timeout=WAIT)
    assert result.status == "succeeded", result.stderr.text
    assert result.ok and result.exit_code == 0 and result.error is None
    assert result.stdout.text == "rows 60\n"
    assert result.execution_count == 1
    assert result.sandbox is not None and result.sandbox.sandbox_wait_ms >= 0
    assert result.usage is not None and result.usage.wall_ms > 0
    assert result.queued_at_ms <= result.started_at_ms <= result.finished_at_ms

    # The table: df.describe() of 4 columns (count, mean, std, min, 25%, 50%, 75%, max).
    [table] = [o for o in result.outputs if o.output_type == "execute_result"]
    assert table.table == sandq.TableInfo(rows=8, columns=4)
    assert "text/markdown" in table.data and table.text and "profit" in table.text

    # The chart: the figure left open, as an image output stored in S3 with a presigned URL.
    [(chart, png)] = result.images()
    assert chart.output_type == "display_data" and png.artifact is not None and png.artifact.url
    image = client.download(png.artifact)
    assert png_size(image) == (600, 300), "figsize (6, 3) at 100 dpi"
    assert chart.image == sandq.ImageInfo(width=600, height=300)
    assert png.size == len(image) == png.artifact.size

    # The artifact the program wrote, through its presigned URL, against the independent values.
    stats_artifact = result.artifact("stats.json")
    assert stats_artifact.content_type == "application/json"
    got = json.loads(client.download(stats_artifact))
    want = expected_stats(data)
    assert got["rows"] == want["rows"] == 60
    assert got["best_day"] == want["best_day"]
    assert got["sales_sum"] == pytest.approx(want["sales_sum"], abs=1e-6)
    assert got["profit_mean"] == pytest.approx(want["profit_mean"], abs=1e-6)
    assert [a.path for a in result.artifacts] == ["stats.json"], "the input is not an artifact"


TICKER = "import time\nfor i in range(10):\n    print(i, flush=True); time.sleep(0.2)"


def test_run_streams_stdout_while_the_job_runs(client: sandq.Client) -> None:
    """`run(on_stdout=...)` gets the program's output as it prints (a line every 200 ms for
    2 s), long before the result; the chunks make up the result's stdout."""
    chunks: list[tuple[float, str]] = []
    result = client.run(TICKER, sku="S", wait_timeout=WAIT, on_stdout=lambda text: chunks.append((time.monotonic(), text)))
    returned = time.monotonic()
    assert result.status == "succeeded", result.stderr.text
    assert chunks, "no stdout event came"
    assert returned - chunks[0][0] >= 1.0, f"the first chunk came {returned - chunks[0][0]:.2f} s before run returned"
    assert "".join(text for _, text in chunks) == result.stdout.text


def test_session_keeps_variables_across_jobs(client: sandq.Client) -> None:
    session = client.session()
    first = session.run("x = 1", wait_timeout=WAIT).raise_for_status()
    second = session.run("x += 1\nprint(x)", wait_timeout=WAIT).raise_for_status()
    assert second.stdout.text == "2\n"
    assert (first.execution_count, second.execution_count) == (1, 2)
    assert first.session is not None and second.session is not None
    assert first.session.name == second.session.name == session.name
    assert first.session.fresh and not second.session.fresh
    assert second.session.state is not None and second.session.state.restored >= 1
    assert "x" in second.session.state.variables
    assert session.name in dict(client.sessions())


def test_timeout(client: sandq.Client) -> None:
    result = client.run("import time\nprint('started', flush=True)\ntime.sleep(60)", sku="S", timeout="2s",
                        wait_timeout=WAIT)
    assert result.status == "timed_out"
    assert result.signal == "SIGKILL"
    assert result.stdout.text == "started\n", "output up to the kill is kept"
    with pytest.raises(sandq.JobTimedOut) as e:
        result.raise_for_status()
    assert e.value.result is result and e.value.job_id == result.job_id


def test_cancel_a_running_job(client: sandq.Client) -> None:
    job_id = client.submit("import time\nprint('up', flush=True)\ntime.sleep(120)", sku="S", timeout="5m")
    started = time.monotonic()
    while (current := client.status(job_id)) is None or current.status != "running":
        assert time.monotonic() - started < 120, f"job still {current and current.status}"
        time.sleep(0.1)
    assert client.cancel(job_id)
    result = client.wait(job_id, WAIT)
    assert result.status == "cancelled"
    assert result.finished_at_ms - result.started_at_ms < 60_000, "killed, not left to run its two minutes"
    assert not client.cancel(job_id), "a finished job is not cancelled again"
    with pytest.raises(sandq.JobCancelled):
        result.raise_for_status()


def test_rejected_job_raises_with_the_reason(client: sandq.Client) -> None:
    with pytest.raises(sandq.JobRejected) as e:
        client.run("print(1)", env={"1BAD": "x"}, sku="S", wait_timeout=WAIT)
    assert e.value.result.status == "rejected"
    assert e.value.reason and "1BAD" in e.value.reason, e.value.reason
    # The same result, returned rather than raised.
    job_id = client.submit("print(1)", env={"PATH": "/evil"}, sku="S")
    result = client.wait(job_id, WAIT, raise_on_error=False)
    assert result.status == "rejected" and "PATH" in (result.reason or "")


def test_unknown_job_and_unroutable_submit(client: sandq.Client, config: sandq.Config) -> None:
    with pytest.raises(sandq.JobNotFound):
        client.wait(str(uuid.uuid4()), 5)
    # A namespace whose exchange nobody declared: the broker refuses, nothing is queued (its
    # queue does not exist either: unserved, warned before the publish).
    with sandq.Client(config.with_namespace(f"{config.namespace}-nowhere")) as nowhere:
        with pytest.raises(sandq.SubmitError), pytest.warns(sandq.UnservedSkuWarning):
            nowhere.submit("print(1)")


async def test_async_client(config: sandq.Config, worker) -> None:
    async with AsyncClient(config) as client:
        numbers = "\n".join(str(i) for i in range(1, 1001)).encode()
        upload = await client.upload(numbers, "numbers.txt")
        result = await client.run(
            "import sys\nprint(sum(int(l) for l in open('numbers.txt')), sys.stdin.read())\n6 * 7",
            inputs=[upload], stdin="hello", sku="S", wait_timeout=WAIT)
        assert result.status == "succeeded", result.stderr.text
        assert result.stdout.text == f"{sum(range(1, 1001))} hello\n"
        assert [o.text for o in result.outputs] == ["42"]
        assert result.sandbox is not None

        session = client.session()
        await session.run("y = [1, 2]", sku="S", wait_timeout=WAIT)
        second = await session.run("y.append(3)\nprint(sum(y))", sku="S", wait_timeout=WAIT)
        assert second.stdout.text == "6\n" and second.execution_count == 2

        job_id = await client.submit("import time\ntime.sleep(120)", sku="S", timeout="5m")
        assert await client.cancel(job_id)
        assert (await client.wait(job_id, WAIT)).status == "cancelled"

        with pytest.raises(sandq.JobRejected) as e:
            await client.run("print(1)", env={"LD_PRELOAD": "x"}, sku="S", wait_timeout=WAIT)
        assert "LD_PRELOAD" in (e.value.reason or "")


def test_declares_over_queues_of_an_earlier_version(config: sandq.Config) -> None:
    """Queues declared before x-message-ttl (docs/operations.md): declaring the topology uses
    them as they are, and the queue keeps its old arguments."""
    import pika

    from sandq import protocol

    legacy = config.with_namespace(f"sandq-test-sdk-python-legacy-{uuid.uuid4().hex[:8]}")
    names = protocol.Names(legacy.namespace)
    connection = pika.BlockingConnection(pika.URLParameters(legacy.amqp_url))
    try:
        channel = connection.channel()
        old = {"x-queue-type": "quorum", "x-delivery-limit": legacy.delivery_limit, "x-dead-letter-exchange": names.dlx}
        for sku in protocol.SKUS:
            channel.queue_declare(names.queue(sku), durable=True, arguments=old)
        with sandq.Client(legacy) as client:
            client.declare_topology()  # would raise ChannelClosedByBroker (406) without the fallback
        channel = connection.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            channel.queue_declare(names.queue("S"), durable=True,
                                  arguments=protocol.queue_arguments(names, legacy.delivery_limit, legacy.unserved_ttl))
        assert refused.value.reply_code == 406, "the queue should have kept its old arguments"
        channel = connection.channel()
        for sku in protocol.SKUS:
            channel.queue_delete(names.queue(sku))
        channel.queue_delete(names.dead_queue)
    finally:
        connection.close()


def test_amqp_urls_as_a_list_or_a_comma_separated_string(tmp_path, monkeypatch) -> None:
    path = tmp_path / "sandq.toml"
    path.write_text('[amqp]\nurl = "amqp://x:9/%2f"\nurls = ["amqp://a:1/%2f", "amqp://b:2/%2f"]\nconfirm_timeout = "5s"\n')
    monkeypatch.delenv("SANDQ__AMQP__URLS", raising=False)
    monkeypatch.delenv("SANDQ__AMQP__URL", raising=False)
    monkeypatch.delenv("SANDQ__AMQP__CONFIRM_TIMEOUT", raising=False)
    loaded = sandq.load_config(path)
    assert loaded.amqp_addresses() == ["amqp://a:1/%2f", "amqp://b:2/%2f"]
    assert loaded.confirm_timeout == "5s"
    monkeypatch.setenv("SANDQ__AMQP__URLS", " amqp://c:3/%2f,, amqp://d:4/%2f ")
    assert sandq.load_config(path).amqp_addresses() == ["amqp://c:3/%2f", "amqp://d:4/%2f"]
    monkeypatch.setenv("SANDQ__AMQP__URLS", "")
    assert sandq.load_config(path).amqp_addresses() == ["amqp://x:9/%2f"]


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_submit_goes_past_broker_addresses_that_refuse_or_hang(config: sandq.Config, worker) -> None:
    """`amqp.urls` whose first address refuses (a node that is down) and second accepts TCP but
    never answers (a node that hangs; skipped after 10 s): both clients connect to the third and
    the job runs. Only loopback: a port nothing listens on, a listener that never reads."""
    import socket
    from dataclasses import replace
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        urls = (f"amqp://guest:guest@127.0.0.1:{_closed_port()}/%2f",
                f"amqp://guest:guest@127.0.0.1:{silent.getsockname()[1]}/%2f", config.amqp_url)
        skipping = replace(config, amqp_urls=urls)
        with sandq.Client(skipping) as client:
            result = client.run("print(6 * 7)", sku="S", wait_timeout=WAIT)
            assert result.status == "succeeded" and result.stdout.text == "42\n"
        async with AsyncClient(skipping) as aclient:
            result = await aclient.run("print(6 * 9)", sku="S", wait_timeout=WAIT)
            assert result.status == "succeeded" and result.stdout.text == "54\n"
