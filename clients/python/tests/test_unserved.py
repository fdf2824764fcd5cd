"""A direct-mode submission asks the broker whether a worker serves the job's SKU (its queue's
consumer count; docs/protocol.md "Which SKUs are served"): warns, refuses or ignores as
`unserved=` says. Real broker and Redis; a namespace no worker consumes, and the SDK tests'
worker for the served case."""
from __future__ import annotations

import uuid
import warnings

import pika
import pytest

import sandq
from sandq import protocol
from sandq.aio import AsyncClient

UNSERVED_NS = f"sandq-test-unserved-py-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def unserved_config():
    """A namespace whose topology exists but that no worker consumes; its queues, exchanges and
    job keys are deleted at the end."""
    config = sandq.load_config().with_namespace(UNSERVED_NS)
    with sandq.Client(config) as client:
        client.declare_topology()
    yield config
    names = protocol.Names(UNSERVED_NS)
    connection = pika.BlockingConnection(pika.URLParameters(config.amqp_url))
    try:
        channel = connection.channel()
        for sku in protocol.SKUS:
            channel.queue_delete(names.queue(sku))
        channel.queue_delete(names.dead_queue)
        channel.exchange_delete(names.exchange)
        channel.exchange_delete(names.dlx)
    finally:
        connection.close()
    with sandq.Client(config) as client:
        for key in client.redis.scan_iter(match=f"{UNSERVED_NS}*"):
            client.redis.delete(key)


def messages(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, sandq.UnservedSkuWarning)]


def ready(config: sandq.Config, sku: str) -> int:
    """The ready messages in the SKU's queue, from a passive declare of the test's own."""
    connection = pika.BlockingConnection(pika.URLParameters(config.amqp_url))
    try:
        return connection.channel().queue_declare(protocol.Names(config.namespace).queue(sku), passive=True).method.message_count
    finally:
        connection.close()


def test_an_unserved_sku_warns_then_the_job_is_queued(unserved_config: sandq.Config) -> None:
    assert issubclass(sandq.UnservedSkuWarning, UserWarning)
    queue = f"{UNSERVED_NS}.jobs.L"
    with sandq.Client(unserved_config) as client:
        before = ready(unserved_config, "L")
        with pytest.warns(sandq.UnservedSkuWarning) as record:
            job_id = client.submit("print(1)", sku="L", result_ttl="5m")
        [message] = messages(record.list)
        assert job_id in message and "SKU L" in message and queue in message, message
        assert "expires after 1h (queues.unserved_ttl)" in message or unserved_config.unserved_ttl != "1h", message
        # The warning points at the caller of submit, not inside the SDK.
        assert record.list[0].filename == __file__
        status = client.status(job_id)
        assert status is not None and status.status == "queued" and status.sku == "L"
        assert ready(unserved_config, "L") == before + 1
        # A count of 0 is never remembered: the next job is asked about, and warned, again.
        with pytest.warns(sandq.UnservedSkuWarning) as again:
            second = client.submit("print(2)", sku="L", result_ttl="5m")
        [message] = messages(again.list)
        assert second in message
        assert ready(unserved_config, "L") == before + 2


def test_refuse_raises_without_publishing_or_writing_queued(unserved_config: sandq.Config) -> None:
    job_id = str(uuid.uuid4())
    with sandq.Client(unserved_config, unserved="refuse") as client:
        before = ready(unserved_config, "M")
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            with pytest.raises(sandq.UnservedSku) as refused:
                client.submit("print(1)", sku="M", job_id=job_id)
        assert messages(record) == []
        error = refused.value
        assert isinstance(error, sandq.SandqError)
        assert (error.job_id, error.sku, error.queue) == (job_id, "M", f"{UNSERVED_NS}.jobs.M")
        assert str(error) == (f"no worker serves sku M right now (queue {UNSERVED_NS}.jobs.M has no consumer): "
                              f"job {job_id} not submitted")
        assert client.status(job_id) is None
        assert client.redis.exists(client.names.job(job_id)) == 0
        assert ready(unserved_config, "M") == before


def test_a_queue_that_does_not_exist_is_unserved(unserved_config: sandq.Config) -> None:
    """A passive declare of an undeclared queue closes its channel with 404: unserved, and the
    client's connection goes on (the refusal names the SKU's queue)."""
    nowhere = unserved_config.with_namespace(f"{UNSERVED_NS}-nowhere")
    with sandq.Client(nowhere, unserved="refuse") as client:
        for _ in range(2):
            with pytest.raises(sandq.UnservedSku) as refused:
                client.submit("print(1)", sku="S")
            assert refused.value.queue == f"{UNSERVED_NS}-nowhere.jobs.S"


def test_ignore_does_not_ask(unserved_config: sandq.Config) -> None:
    with sandq.Client(unserved_config, unserved="ignore") as client:
        before = ready(unserved_config, "XL")
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            job_id = client.submit("print(1)", sku="XL", result_ttl="5m")
        assert messages(record) == []
        status = client.status(job_id)
        assert status is not None and status.status == "queued"
        assert ready(unserved_config, "XL") == before + 1


def test_the_option_is_checked() -> None:
    with pytest.raises(ValueError, match="unserved must be one of"):
        sandq.Client(sandq.load_config().with_namespace(UNSERVED_NS), unserved="never")
    with pytest.raises(ValueError, match="direct mode's"):
        sandq.Client(url="http://127.0.0.1:1", api_key="sq_x", unserved="refuse")


async def test_async_client_warns_and_refuses(unserved_config: sandq.Config) -> None:
    async with AsyncClient(unserved_config) as client:
        before = ready(unserved_config, "L")
        with pytest.warns(sandq.UnservedSkuWarning) as record:
            job_id = await client.submit("print(1)", sku="L", result_ttl="5m")
        [message] = messages(record.list)
        assert job_id in message and "SKU L" in message and f"{UNSERVED_NS}.jobs.L" in message, message
        status = await client.status(job_id)
        assert status is not None and status.status == "queued"
        assert ready(unserved_config, "L") == before + 1
    refused_id = str(uuid.uuid4())
    async with AsyncClient(unserved_config, unserved="refuse") as client:
        with pytest.raises(sandq.UnservedSku) as refused:
            await client.submit("print(1)", sku="L", job_id=refused_id)
        assert (refused.value.job_id, refused.value.sku) == (refused_id, "L")
        assert await client.status(refused_id) is None
        # 404 (no such queue): unserved too, and the client's connection still publishes.
        nowhere = AsyncClient(unserved_config.with_namespace(f"{UNSERVED_NS}-nowhere"), unserved="refuse")
        async with nowhere:
            with pytest.raises(sandq.UnservedSku):
                await nowhere.submit("print(1)", sku="S")
        with pytest.warns(sandq.UnservedSkuWarning):
            async with AsyncClient(unserved_config) as warned:
                await warned.submit("print(1)", sku="S", result_ttl="5m")
    assert ready(unserved_config, "L") == before + 1


def test_a_served_sku_does_not_warn(config: sandq.Config, worker) -> None:
    """With the SDK tests' worker consuming: no warning, in either mode of refusal."""
    for option in ("warn", "refuse"):
        with sandq.Client(config, unserved=option) as client:
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                job_id = client.submit("print(6 * 7)", sku="S")
                # A second job within 10 s: the served SKU is remembered (no warning either way).
                second = client.submit("print(1)", sku="S")
            assert messages(record) == []
            assert client.wait(job_id, 120).stdout.text == "42\n"
            assert client.wait(second, 120).status == "succeeded"


async def test_a_served_sku_does_not_warn_async(config: sandq.Config, worker) -> None:
    async with AsyncClient(config, unserved="refuse") as client:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            job_id = await client.submit("print(6 * 7)", sku="S")
        assert messages(record) == []
        assert (await client.wait(job_id, 120)).stdout.text == "42\n"
