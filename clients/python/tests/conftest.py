"""The SDK's tests run against the services of the sandq config (`$SANDQ_CONFIG`, else
/etc/sandq/sandq.toml), with a worker of their own in a namespace of their own
(`sandq-test-sdk-python`), as the Rust tests do (tests/harness.rs): the worker binary of
`${CARGO_TARGET_DIR:-target}/debug`, started with `--exit-on-stdin-eof` so that it stops when
the tests end; it inherits the environment (`SANDQ__WORKER__DATA_DIR`/`STATE_DIR` when CI set
them)."""
from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pika
import pytest

import sandq

NAMESPACE = "sandq-test-sdk-python"
WORKER_ID = "test-sdk-python"
REPO = Path(__file__).resolve().parents[3]


def worker_binary() -> Path:
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
    if not target.is_absolute():
        target = REPO / target
    return target / "debug" / "sandq-worker"


def purge_queues(config: sandq.Config) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(config.amqp_url))
    try:
        channel = connection.channel()
        for sku in ("S", "M", "L", "XL"):
            channel.queue_purge(f"{NAMESPACE}.jobs.{sku}")
        channel.queue_purge(f"{NAMESPACE}.dead")
    finally:
        connection.close()


@pytest.fixture(scope="session")
def config() -> sandq.Config:
    return sandq.load_config().with_namespace(NAMESPACE)


@pytest.fixture(scope="session")
def worker(config: sandq.Config):
    with sandq.Client(config) as client:
        client.declare_topology()
    purge_queues(config)
    binary = worker_binary()
    assert binary.exists(), f"{binary} missing: build the workspace first (cargo build --workspace)"
    log_path = Path(tempfile.gettempdir()) / f"sandq-{WORKER_ID}-worker.log"
    env = dict(os.environ, SANDQ__NAMESPACE=NAMESPACE, SANDQ__WORKER__ID=WORKER_ID,
               SANDQ__WORKER__CAPACITY_CPUS="16", SANDQ__WORKER__CAPACITY_MEMORY_BYTES=str(64 << 30),
               # Workers of other tests and instances run beside it (docs/STYLE.md): any free port.
               SANDQ__WORKER__METRICS_ADDR="127.0.0.1:0")
    with open(log_path, "wb") as log:
        process = subprocess.Popen([str(binary), "--exit-on-stdin-eof"], stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, stderr=log, env=env)
    started = time.monotonic()
    while b"consuming" not in log_path.read_bytes():
        assert process.poll() is None, f"worker exited: {log_path.read_text(errors='replace')}"
        assert time.monotonic() - started < 60, f"worker did not start: {log_path.read_text(errors='replace')}"
        time.sleep(0.05)
    yield process
    assert process.stdin is not None
    process.stdin.close()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture
def client(config: sandq.Config, worker) -> sandq.Client:
    with sandq.Client(config) as c:
        yield c
