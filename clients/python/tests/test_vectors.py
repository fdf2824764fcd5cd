"""The shared protocol test vectors (schemas/vectors/, see its README.md), run by the SDK: the
JobResult decoder reads every result vector to its meaning (integers as ints, nil as absent),
the JobSpec encoder writes every valid vector's meaning as a map that means the same under the
rules of docs/protocol.md ("Encoding"), and the duration parser agrees with the worker's
grammar. No services needed."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from sandq import protocol
from sandq.types import InputFile, JobResult

VECTORS = Path(__file__).resolve().parents[3] / "schemas" / "vectors"


def vectors(sub: str) -> list[tuple[str, bytes, dict]]:
    found = []
    for path in sorted((VECTORS / sub).glob("*.msgpack")):
        found.append((path.stem, path.read_bytes(), json.loads(path.with_suffix(".json").read_text())))
    assert found, f"no vectors in {sub}"
    return found


def same(actual, expected, where="") -> None:
    """Equal, with ints and floats kept apart (a float64 integer must decode to an int)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: {actual!r} is not a map"
        for key, value in expected.items():
            same(actual.get(key), value, f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), f"{where}: {actual!r} != {expected!r}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            same(a, e, f"{where}[{i}]")
    else:
        assert type(actual) is type(expected) and actual == expected, f"{where}: {actual!r} != {expected!r}"


def as_plain(value):
    """A typed SDK value as plain maps and lists (dataclasses as maps of their fields)."""
    if dataclasses.is_dataclass(value):
        return {f.name: as_plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name != "raw"}
    if isinstance(value, dict):
        return {k: as_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_plain(v) for v in value]
    return value


@pytest.mark.parametrize("name,raw,sidecar", vectors("jobresult"), ids=lambda v: v if isinstance(v, str) else "")
def test_result_vectors_decode_to_their_meaning(name, raw, sidecar):
    result = JobResult.from_wire(protocol.decode(raw))
    expected = dict(sidecar["result"])
    expected.pop("schema_version")  # the typed view does not keep it
    same(as_plain(result), expected, name)


# The decoded meaning of a JobSpec map, by the rules of docs/protocol.md: nil is absent; an
# absent list or map is empty; network defaults to "none"; an integral float is an integer;
# stdin is bytes (bin, or str as UTF-8).
SPEC_FIELDS = ["schema_version", "job_id", "sku", "runtime", "code", "entrypoint", "args", "inputs", "stdin", "env",
               "timeout", "result_ttl", "network", "submitted_at_ms", "deadline_ms", "mode", "session"]


def integer(value):
    if isinstance(value, float):
        assert value.is_integer(), value
        return int(value)
    return value


def meaning_of(m: dict) -> dict:
    get = lambda k: m.get(k)  # noqa: E731
    stdin = get("stdin")
    if isinstance(stdin, str):
        stdin = stdin.encode()
    return {
        "schema_version": integer(get("schema_version")), "job_id": get("job_id"), "sku": get("sku"),
        "runtime": get("runtime"), "code": get("code"), "entrypoint": get("entrypoint"), "args": get("args") or [],
        "inputs": [{**i, "size": integer(i["size"])} for i in get("inputs") or []],
        "stdin": None if stdin is None else list(stdin), "env": get("env") or {}, "timeout": get("timeout"),
        "result_ttl": get("result_ttl"), "network": get("network") or "none",
        "submitted_at_ms": integer(get("submitted_at_ms")), "deadline_ms": integer(get("deadline_ms")),
        "mode": get("mode"), "session": get("session"),
    }


@pytest.mark.parametrize("name,raw,sidecar", vectors("jobspec/valid"), ids=lambda v: v if isinstance(v, str) else "")
def test_spec_vectors_mean_what_they_say(name, raw, sidecar):
    same(meaning_of(protocol.decode(raw)), sidecar["spec"], name)


@pytest.mark.parametrize("name,raw,sidecar", vectors("jobspec/valid"), ids=lambda v: v if isinstance(v, str) else "")
def test_the_encoder_writes_each_valid_spec(name, raw, sidecar):
    s = sidecar["spec"]
    job = protocol.build_job(
        s["code"], entrypoint=s["entrypoint"], sku=s["sku"], runtime=s["runtime"],
        inputs=[InputFile(**i) for i in s["inputs"]], args=s["args"],
        stdin=None if s["stdin"] is None else bytes(s["stdin"]), env=s["env"], timeout=s["timeout"],
        result_ttl=s["result_ttl"], network=s["network"], deadline_ms=s["deadline_ms"], mode=s["mode"],
        session=s["session"], job_id=s["job_id"])
    wire = protocol.decode(protocol.encode(job))
    assert isinstance(wire["submitted_at_ms"], int)
    got = meaning_of(wire)
    got["submitted_at_ms"] = s["submitted_at_ms"]  # the encoder stamps its own time
    same(got, s, name)
    # No float and no nil anywhere: what every decoder reads the same.
    def walk(v):
        assert v is not None and not isinstance(v, float), (name, wire)
        for x in v.values() if isinstance(v, dict) else v if isinstance(v, list) else ():
            walk(x)
    walk(wire)


def test_durations_parse_as_the_worker_parses_them():
    cases = json.loads((VECTORS / "durations.json").read_text())["durations"]
    for case in cases:
        if case["seconds"] is None:
            with pytest.raises(ValueError):
                protocol.humantime_seconds(case["text"])
        else:
            # Key TTLs are whole seconds, at least 1.
            assert protocol.humantime_seconds(case["text"]) == max(1, math.floor(case["seconds"])), case
