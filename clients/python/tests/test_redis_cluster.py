"""The SDK on a Redis Cluster (`[redis] mode = "cluster"`): the blocking and asyncio clients
submit jobs, wait on their done lists (BLPOP routed by key) and cancel one, against a worker
configured to the same cluster, and read a job's live events (XREAD routed by key). Three
primaries without replicas, started here on loopback with their data in a temp dir and killed at
the end: failover is tests/redis_cluster.rs's subject.
Ports: `$SANDQ_REDIS_CLUSTER_PORT` .. +2 and the bus `$SANDQ_REDIS_CLUSTER_BUS_PORT` .. +2
(`.ci/run` exports them; else 17110 and 17130); RabbitMQ and S3 are the config's."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis

import sandq
from conftest import start_worker, stop_worker

NAMESPACE = "sandq-test-sdk-python-cluster"
WORKER_ID = "test-sdk-python-cluster"
WAIT = 180.0


def cli(port: int, *args: str) -> str:
    done = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True)
    return done.stdout


def slot_owners(ports: list[int]):
    """A function from a slot (CLUSTER KEYSLOT's output) to the port of the primary that serves it,
    read from each primary's own line (`myself`) of CLUSTER NODES: fields 9.. are its slot ranges."""
    ranges = []
    for port in ports:
        mine = next(line for line in cli(port, "cluster", "nodes").splitlines() if "myself" in line.split()[2])
        for part in mine.split()[8:]:
            low, _, high = part.partition("-")
            ranges.append((int(low), int(high or low), port))

    def owner_of(slot: str) -> int:
        return next(port for low, high, port in ranges if low <= int(slot) <= high)
    return owner_of


def wait_for(check, limit: float, what: str) -> None:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < limit, what
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster():
    port = int(os.environ.get("SANDQ_REDIS_CLUSTER_PORT", "17110"))
    bus = int(os.environ.get("SANDQ_REDIS_CLUSTER_BUS_PORT", str(port + 20)))
    ports = [port, port + 1, port + 2]
    root = Path(tempfile.mkdtemp(prefix="sandq-sdk-cluster-"))
    processes = []
    try:
        for i, p in enumerate(ports):
            (root / str(p)).mkdir()
            processes.append(subprocess.Popen(
                ["redis-server", "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-port", str(bus + i), "--cluster-node-timeout", "1000", "--save", "",
                 "--dir", str(root / str(p))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for p in ports:
            wait_for(lambda: cli(p, "ping").startswith("PONG"), 20, f"redis on {p} did not start")
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports], "--cluster-yes"],
                       check=True, capture_output=True)
        wait_for(lambda: all("cluster_state:ok" in cli(p, "cluster", "info") for p in ports), 60, "cluster not ready")
        yield [f"redis://127.0.0.1:{p}/" for p in ports]
    finally:
        for process in processes:
            process.kill()
            process.wait()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster_config(cluster) -> sandq.Config:
    from dataclasses import replace
    return replace(sandq.load_config().with_namespace(NAMESPACE), redis_mode="cluster", redis_nodes=tuple(cluster))


@pytest.fixture(scope="module")
def cluster_worker(cluster_config: sandq.Config):
    with sandq.Client(cluster_config) as client:
        client.declare_topology()
    # A metrics port of its own, and a worker that exits at start fails at once with its log
    # (start_worker): another worker on this machine may hold the default port.
    process = start_worker(WORKER_ID, dict(SANDQ__NAMESPACE=NAMESPACE, SANDQ__WORKER__CAPACITY_CPUS="16",
                                           SANDQ__WORKER__CAPACITY_MEMORY_BYTES=str(64 << 30), SANDQ__REDIS__MODE="cluster",
                                           SANDQ__REDIS__NODES=",".join(cluster_config.redis_nodes)))
    yield process
    stop_worker(process)


def test_jobs_and_a_cancel_through_a_redis_cluster(cluster_config: sandq.Config, cluster_worker) -> None:
    with sandq.Client(cluster_config) as client:
        assert isinstance(client.redis, redis.cluster.RedisCluster)
        ports = [int(url.rsplit(":", 1)[1].strip("/")) for url in cluster_config.redis_nodes]
        owner_of = slot_owners(ports)
        # Two job ids per primary, picked by the slot Redis itself computes (CLUSTER KEYSLOT), so
        # the spread is certain: random ids all fell on one primary 1 time in 243 (CI, 2026-11-30).
        ids: list[str] = []
        for port in ports:
            mine: list[str] = []
            while len(mine) < 2:
                candidate = f"sdk-cluster-{os.urandom(6).hex()}"
                if owner_of(cli(ports[0], "cluster", "keyslot", client.names.job(candidate))) == port:
                    mine.append(candidate)
            ids += mine
        for i, job_id in enumerate(ids):
            assert client.submit(f"print({i} * {i})", sku="S", job_id=job_id) == job_id
        results = [client.wait(job_id, WAIT) for job_id in ids]
        assert [(r.status, r.stdout.text) for r in results] == [("succeeded", f"{i * i}\n") for i in range(6)]
        # Each job's hash is on the primary that owns its slot, and on no other: the three
        # primaries hold two each (the point of a cluster).
        holders = {job_id: [p for p in ports if cli(p, "exists", client.names.job(job_id)).strip() == "1"] for job_id in ids}
        expected = {job_id: [owner_of(cli(ports[0], "cluster", "keyslot", client.names.job(job_id)))] for job_id in ids}
        assert holders == expected
        job_id = client.submit("import time\nprint('up', flush=True)\ntime.sleep(120)", sku="S", timeout="5m")
        wait_for(lambda: (s := client.status(job_id)) is not None and s.status == "running", 120, "never ran")
        assert client.cancel(job_id)
        assert client.wait(job_id, WAIT).status == "cancelled"


async def test_async_client_through_a_redis_cluster(cluster_config: sandq.Config, cluster_worker) -> None:
    async with sandq.AsyncClient(cluster_config) as client:
        result = await client.run("print(6 * 7)", sku="S", wait_timeout=WAIT)
        assert (result.status, result.stdout.text) == ("succeeded", "42\n")


async def test_live_events_through_a_redis_cluster(cluster_config: sandq.Config) -> None:
    """XREAD (blocking, then not) routed by the stream's key: a job's events, written here on
    each primary's slots, read back whole by the blocking and the asyncio clients (no worker)."""
    import json
    import uuid

    case = json.loads((Path(__file__).resolve().parents[3] / "schemas" / "vectors" / "events.json").read_text())["cases"][0]
    with sandq.Client(cluster_config) as client:
        async with sandq.AsyncClient(cluster_config) as aclient:
            for _ in range(6):
                job_id = f"sdk-cluster-events-{uuid.uuid4()}"
                client.redis.hset(client.names.job(job_id), "status", case["expect"]["status"])
                for entry in case["entries"][:-1]:
                    client.redis.xadd(client.names.events(job_id), entry["fields"], id=entry["id"])
                # Without the end first: the readers stop on the terminal status.
                want = [e["id"] for e in case["entries"][:-1]]
                assert [e.id for e in client.events(job_id, block=0.2)] == want
                client.redis.xadd(client.names.events(job_id), case["entries"][-1]["fields"], id=case["entries"][-1]["id"])
                want.append(case["entries"][-1]["id"])
                assert [e.id for e in client.events(job_id, block=0.2)] == want
                assert [e.id async for e in aclient.events(job_id, block=0.2)] == want
                client.redis.delete(client.names.job(job_id), client.names.events(job_id))
