"""Redis key layout 2 (docs/protocol.md "Redis key layout"): the keys of a job share one Redis
Cluster hash slot, computed with redis-py's own slot function (CRC16 of the hash tag, mod 16384),
not with the SDK's; and the `[redis]` settings of the three deployments are read."""
from __future__ import annotations

from redis.crc import key_slot

import sandq
from sandq import protocol


def test_a_jobs_keys_share_a_slot_and_jobs_spread():
    names = protocol.Names("ns-1")
    assert names.job("j1") == "ns-1:job:{j1}"
    assert names.done("j1") == "ns-1:job:{j1}:done"
    assert names.cancel("j1") == "ns-1:job:{j1}:cancel"
    assert names.events("j1") == "ns-1:job:{j1}:events"
    slots = set()
    for i in range(50):
        job_id = f"job-{i}"
        keys = [names.job(job_id), names.done(job_id), names.cancel(job_id), names.events(job_id)]
        assert len({key_slot(k.encode()) for k in keys}) == 1, keys
        slots.add(key_slot(names.job(job_id).encode()))
    # Layout 1 put a job's hash and done list in different slots (the CROSSSLOT of issue 12).
    assert key_slot(b"ns-1:job:j1") != key_slot(b"ns-1:job:j1:done")
    # The tag is the id, not the namespace: jobs spread over the slots.
    assert len(slots) > 40


def test_redis_deployment_settings(tmp_path, monkeypatch):
    for var in ("SANDQ__REDIS__MODE", "SANDQ__REDIS__NODES", "SANDQ__REDIS__SERVICE"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "sandq.toml"
    path.write_text('[redis]\nmode = "cluster"\nnodes = ["redis://127.0.0.1:7000/", "redis://:pw@127.0.0.1:7001/"]\n')
    config = sandq.load_config(path)
    assert (config.redis_mode, config.redis_nodes) == ("cluster", ("redis://127.0.0.1:7000/", "redis://:pw@127.0.0.1:7001/"))
    assert protocol.redis_kwargs(config.redis_nodes[1]) == {"host": "127.0.0.1", "port": 7001, "password": "pw"}
    monkeypatch.setenv("SANDQ__REDIS__MODE", "sentinel")
    monkeypatch.setenv("SANDQ__REDIS__NODES", "redis://10.0.0.1:26379/, redis://10.0.0.2:26379/")
    monkeypatch.setenv("SANDQ__REDIS__SERVICE", "primary-1")
    config = sandq.load_config(path)
    assert (config.redis_mode, config.redis_nodes, config.redis_service) == (
        "sentinel", ("redis://10.0.0.1:26379/", "redis://10.0.0.2:26379/"), "primary-1")
    path.write_text("")
    for var in ("SANDQ__REDIS__MODE", "SANDQ__REDIS__NODES", "SANDQ__REDIS__SERVICE"):
        monkeypatch.delenv(var)
    config = sandq.load_config(path)
    assert (config.redis_mode, config.redis_nodes, config.redis_service) == ("single", (), "mymaster")
