"""The SDK's tests run against the services of the sandq config (`$SANDQ_CONFIG`, else
/etc/sandq/sandq.toml), with a worker of their own in a namespace of their own
(`sandq-test-sdk-python`), as the Rust tests do (tests/harness.rs): the worker binary of
`${CARGO_TARGET_DIR:-target}/debug`, started with `--exit-on-stdin-eof` so that it stops when
the tests end, on a metrics port of its own (`start_worker`); it inherits the environment
(`SANDQ__WORKER__DATA_DIR`/`STATE_DIR` when CI set them)."""
from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pika
import pytest

import sandq

# SANDQ_TEST_SDK_NAMESPACE: another namespace (and worker id), for two runs side by side.
NAMESPACE = os.environ.get("SANDQ_TEST_SDK_NAMESPACE", "sandq-test-sdk-python")
WORKER_ID = NAMESPACE.removeprefix("sandq-")
REPO = Path(__file__).resolve().parents[3]


def cargo_binary(name: str) -> Path:
    """A binary of the workspace's debug build: `${CARGO_TARGET_DIR:-target}/debug/<name>`."""
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
    if not target.is_absolute():
        target = REPO / target
    return target / "debug" / name


def worker_binary() -> Path:
    return cargo_binary("sandq-worker")


def start_worker(worker_id: str, env: dict[str, str]) -> subprocess.Popen:
    """Starts the worker binary as `worker_id`, with `env` over the inherited environment, and
    waits (up to 60 s) until it consumes. Its metrics endpoint takes any free port: other workers
    run on this machine (other tests, CI, a demo), and one of them may hold the default
    127.0.0.1:9464, which would make this one exit. A worker that exits before consuming fails
    the test at once, with its log."""
    binary = worker_binary()
    assert binary.exists(), f"{binary} missing: build the workspace first (cargo build --workspace)"
    log_path = Path(tempfile.gettempdir()) / f"sandq-{worker_id}-worker.log"
    env = {**os.environ, "SANDQ__WORKER__ID": worker_id, "SANDQ__WORKER__METRICS_ADDR": "127.0.0.1:0", **env}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([str(binary), "--exit-on-stdin-eof"], stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, stderr=log, env=env)
    started = time.monotonic()
    while b"consuming" not in log_path.read_bytes():
        code = process.poll()
        if code is not None:
            pytest.fail(f"worker {worker_id} exited ({code}) before consuming; its log:\n{log_path.read_text(errors='replace')}")
        if time.monotonic() - started > 60:
            process.kill()
            process.wait()
            pytest.fail(f"worker {worker_id} did not consume within 60 s; its log:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.05)
    return process


def stop_worker(process: subprocess.Popen) -> None:
    """Stops a worker of `start_worker` (or the gateway of `gateway_url`): closes its stdin, then
    waits up to 60 s (kills it after)."""
    assert process.stdin is not None
    process.stdin.close()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


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
    process = start_worker(WORKER_ID, dict(SANDQ__NAMESPACE=NAMESPACE, SANDQ__WORKER__CAPACITY_CPUS="16",
                                           SANDQ__WORKER__CAPACITY_MEMORY_BYTES=str(64 << 30)))
    yield process
    stop_worker(process)


@pytest.fixture
def client(config: sandq.Config, worker) -> sandq.Client:
    with sandq.Client(config) as c:
        yield c


def binary(name: str) -> Path:
    """`cargo_binary(name)`, which must have been built."""
    path = cargo_binary(name)
    assert path.exists(), f"{path} missing: build the workspace first (cargo build --workspace)"
    return path


@pytest.fixture(scope="session")
def gateway_url(worker) -> str:
    """A sandq-gateway in the worker's namespace, on a free port, bodies of at most 2 MiB; stopped
    at the end (`--exit-on-stdin-eof`). Its base URL."""
    log_path = Path(tempfile.gettempdir()) / f"{NAMESPACE}-gateway.log"
    env = {**os.environ, "SANDQ__NAMESPACE": NAMESPACE, "SANDQ__GATEWAY__LISTEN": "127.0.0.1:0",
           "SANDQ__GATEWAY__METRICS_LISTEN": "127.0.0.1:0",
           "SANDQ__GATEWAY__KEEP_ALIVE": "1s",
           "SANDQ__GATEWAY__MAX_BODY_BYTES": str(2 << 20)}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([str(binary("sandq-gateway")), "--exit-on-stdin-eof"], stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, stderr=log, env=env)
    started = time.monotonic()
    url = None
    while url is None:
        text = log_path.read_text(errors="replace")
        line = next((line for line in text.splitlines() if "serving the API" in line and "addr=" in line), None)
        if line is not None:
            url = "http://" + line.split("addr=", 1)[1].split()[0]
        elif process.poll() is not None or time.monotonic() - started > 60:
            process.kill()
            pytest.fail(f"the gateway did not start ({process.poll()}); its log:\n{text}")
        else:
            time.sleep(0.05)
    yield url
    stop_worker(process)


def new_key(tenant: str, *flags: str) -> str:
    """A key for `tenant` (`sandq key create`, in the tests' namespace)."""
    out = subprocess.run([str(binary("sandq")), "key", "create", "--tenant", tenant, *flags], capture_output=True,
                         env={**os.environ, "SANDQ__NAMESPACE": NAMESPACE}, timeout=60)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    key = out.stdout.decode().strip()
    assert key.startswith("sq_"), out.stdout
    return key
