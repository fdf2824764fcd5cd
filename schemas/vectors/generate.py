#!/usr/bin/env python3
"""Writes the protocol test vectors of this directory (see README.md): `python3 generate.py`.

Standard library only, with a MessagePack encoder of its own, so that each vector's bytes are
exactly the types written below (a float64 for an integer, a uint64 for a small number, nil for
an absent field) whatever a MessagePack library would choose. The expected meanings (the
decoded JobSpec, the exact rejection reason, the decoded JobResult) are written here by hand
from docs/protocol.md; nothing here runs sandq's code. Re-running it rewrites the same files.
"""
from __future__ import annotations

import copy
import json
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


# --- A MessagePack encoder whose integer and float widths are chosen by the vector ------------
class U8(int): pass
class U16(int): pass
class U32(int): pass
class U64(int): pass
class I8(int): pass
class I16(int): pass
class I32(int): pass
class I64(int): pass
class F32(float): pass
class F64(float): pass
class Bin(bytes): pass
class Raw(bytes):
    """Bytes written as they are (for bodies that are not MessagePack)."""


def pack(v) -> bytes:
    if isinstance(v, Raw):
        return bytes(v)
    if v is None:
        return b"\xc0"
    if v is True:
        return b"\xc3"
    if v is False:
        return b"\xc2"
    for cls, prefix, fmt in ((U8, 0xCC, ">B"), (U16, 0xCD, ">H"), (U32, 0xCE, ">I"), (U64, 0xCF, ">Q"),
                             (I8, 0xD0, ">b"), (I16, 0xD1, ">h"), (I32, 0xD2, ">i"), (I64, 0xD3, ">q")):
        if isinstance(v, cls):
            return bytes([prefix]) + struct.pack(fmt, int(v))
    if isinstance(v, int):  # the smallest encoding, as most libraries write it
        if 0 <= v < 128:
            return bytes([v])
        if -32 <= v < 0:
            return struct.pack(">b", v)
        if v >= 0:
            return pack(U8(v) if v < 256 else U16(v) if v < 65536 else U32(v) if v < 2**32 else U64(v))
        return pack(I8(v) if v >= -128 else I16(v) if v >= -32768 else I32(v) if v >= -2**31 else I64(v))
    if isinstance(v, F32):
        return b"\xca" + struct.pack(">f", float(v))
    if isinstance(v, float):
        return b"\xcb" + struct.pack(">d", float(v))
    if isinstance(v, str):
        b = v.encode()
        n = len(b)
        head = (bytes([0xA0 | n]) if n < 32 else b"\xd9" + bytes([n]) if n < 256 else b"\xda" + struct.pack(">H", n)
                if n < 65536 else b"\xdb" + struct.pack(">I", n))
        return head + b
    if isinstance(v, (bytes, bytearray)):
        n = len(v)
        head = b"\xc4" + bytes([n]) if n < 256 else b"\xc5" + struct.pack(">H", n)
        return head + bytes(v)
    if isinstance(v, (list, tuple)):
        n = len(v)
        head = bytes([0x90 | n]) if n < 16 else b"\xdc" + struct.pack(">H", n)
        return head + b"".join(pack(x) for x in v)
    if isinstance(v, dict):
        n = len(v)
        head = bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)
        return head + b"".join(pack(k) + pack(x) for k, x in v.items())
    raise TypeError(f"cannot pack {v!r}")


def plain(v):
    """A wire value as JSON (the tags dropped)."""
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, (bytes, bytearray)):
        return list(v)
    return v


# --- JobSpecs ---------------------------------------------------------------------------------
SHA_A = "a" * 64
SHA_B = "0123456789abcdef" * 4
REQUIRED = {"schema_version": 1, "job_id": "vector-job-1", "sku": "S", "runtime": "python"}

# The decoded meaning of a JobSpec with nothing optional set (docs/protocol.md, "JobSpec": an
# absent list or map is empty, network defaults to "none", everything else is nil).
SPEC_DEFAULTS = {
    "schema_version": 1, "job_id": "vector-job-1", "sku": "S", "runtime": "python", "code": None,
    "entrypoint": None, "args": [], "inputs": [], "stdin": None, "env": {}, "timeout": None,
    "result_ttl": None, "network": "none", "submitted_at_ms": None, "deadline_ms": None, "mode": None,
    "session": None,
}


def spec(**fields):
    """A wire JobSpec: the required fields, then `fields` in order."""
    out = dict(REQUIRED)
    out.update(fields)
    return out


def meaning(**fields):
    out = copy.deepcopy(SPEC_DEFAULTS)
    out.update(fields)
    return out


def input_file(path, sha, size):
    return {"key": f"inputs/sha256/{sha}", "path": path, "size": size, "sha256": sha}


VALID_SPECS = [
    ("minimal", "the required fields and code",
     spec(code="print(1)"), meaning(code="print(1)")),
    ("every_field", "every field set, with the types most encoders write",
     spec(code="import sys\nprint(sys.argv)", args=["--rows", "10"],
          inputs=[input_file("data.csv", SHA_A, 1100), input_file("dir/b.json", SHA_B, 5)],
          stdin=Bin(b"line 1\nline 2\n"), env={"MY_SETTING": "on", "OTHER": ""}, timeout="2m 30s",
          result_ttl="7days", network="outbound", submitted_at_ms=1796047054196,
          deadline_ms=1796047114196, mode="script", session="notebook-1.v2"),
     meaning(code="import sys\nprint(sys.argv)", args=["--rows", "10"],
             inputs=[input_file("data.csv", SHA_A, 1100), input_file("dir/b.json", SHA_B, 5)],
             stdin=list(b"line 1\nline 2\n"), env={"MY_SETTING": "on", "OTHER": ""}, timeout="2m 30s",
             result_ttl="7days", network="outbound", submitted_at_ms=1796047054196,
             deadline_ms=1796047114196, mode="script", session="notebook-1.v2")),
    ("nil_optionals", "every optional field nil (JavaScript's undefined and null, Python's None): as if absent",
     spec(code="print(1)", entrypoint=None, args=None, inputs=None, stdin=None, env=None, timeout=None,
          result_ttl=None, network=None, submitted_at_ms=None, deadline_ms=None, mode=None, session=None),
     meaning(code="print(1)")),
    ("float_integers", "integers written as float64 with integral values (msgpackr writes Date.now() so)",
     spec(schema_version=F64(1.0), code="print(1)", submitted_at_ms=F64(1796047054196.0), deadline_ms=F64(4102444800000.0)),
     meaning(code="print(1)", submitted_at_ms=1796047054196, deadline_ms=4102444800000)),
    ("integer_widths", "integers in wider encodings than needed, and signed ones",
     spec(schema_version=U64(1), code="print(1)", submitted_at_ms=I64(1796047054196), deadline_ms=U64(4102444800000)),
     meaning(code="print(1)", submitted_at_ms=1796047054196, deadline_ms=4102444800000)),
    ("input_sizes", "input sizes as float64, float32, uint16 and int8",
     spec(code="print(1)", inputs=[input_file("a.csv", SHA_A, F64(1100.0)), input_file("b.csv", SHA_B, F32(7.0)),
                                   input_file("c.csv", SHA_A, U16(3)), input_file("d.csv", SHA_B, I8(0))]),
     meaning(code="print(1)", inputs=[input_file("a.csv", SHA_A, 1100), input_file("b.csv", SHA_B, 7),
                                      input_file("c.csv", SHA_A, 3), input_file("d.csv", SHA_B, 0)])),
    ("stdin_as_str", "stdin as a MessagePack str: its UTF-8 bytes",
     spec(code="print(input())", stdin="héllo\n"), meaning(code="print(input())", stdin=list("héllo\n".encode()))),
    ("entrypoint", "an uploaded file run instead of code",
     spec(entrypoint="src/main.py", inputs=[input_file("src/main.py", SHA_B, 42)]),
     meaning(entrypoint="src/main.py", inputs=[input_file("src/main.py", SHA_B, 42)])),
    ("unknown_keys", "keys the worker does not know are ignored",
     spec(code="print(1)", priority=5, labels={"team": "x"}, client="other-sdk/9"), meaning(code="print(1)")),
    ("node_notebook", "a Node.js notebook cell with a session and an SKU of XL",
     spec(sku="XL", runtime="node", code="await Promise.resolve(41) + 1", mode="notebook",
          session="0c6f2b1e-0c1b-4b53-9a55-8f3f5bd1d3a4"),
     meaning(sku="XL", runtime="node", code="await Promise.resolve(41) + 1", mode="notebook",
             session="0c6f2b1e-0c1b-4b53-9a55-8f3f5bd1d3a4")),
]

U64_MAX = 18446744073709551615
U32_MAX = 4294967295

# The exact `reason` of the `rejected` result (docs/protocol.md, "JobSpec" and "Encoding"),
# with the worker's default limits: today's text of the worker's decoder and validator
# (schemas/src/de.rs, validate.rs), which schemas/tests/vectors.rs checks. Reasons are for
# people and their wording may change: other clients show them, never match on them.
INVALID_SPECS = [
    ("fractional_float", "a float that is not integral in an integer field",
     spec(code="print(1)", deadline_ms=1796047054196.5),
     "malformed message: deadline_ms: expected an integer or nil, found the float 1796047054196.5, which is not integral"),
    ("negative_integer", "a negative integer in an unsigned field",
     spec(code="print(1)", submitted_at_ms=-1),
     f"malformed message: submitted_at_ms: -1 is out of range, expected an integer from 0 to {U64_MAX}"),
    ("schema_version_string", "schema_version as a string",
     spec(schema_version="1", code="print(1)"),
     'malformed message: schema_version: expected an integer, found the string "1"'),
    ("schema_version_too_large", "schema_version past 32 bits",
     spec(schema_version=U64(2**32), code="print(1)"),
     f"malformed message: schema_version: 4294967296 is out of range, expected an integer from 0 to {U32_MAX}"),
    ("schema_version_2", "a schema version this worker does not speak",
     spec(schema_version=2, code="print(1)"),
     "schema_version 2 is not supported (this worker speaks 1)"),
    ("schema_version_nil", "nil for a required field",
     spec(schema_version=None, code="print(1)"),
     "malformed message: schema_version: expected an integer, found nil"),
    ("missing_job_id", "no job_id",
     {"schema_version": 1, "sku": "S", "runtime": "python", "code": "print(1)"},
     "malformed message: missing field `job_id`"),
    ("bad_job_id", "a job id outside [A-Za-z0-9_-]",
     spec(job_id="x/y", code="print(1)"),
     'job_id "x/y" is invalid: only A-Z, a-z, 0-9, \'_\' and \'-\' are allowed'),
    ("job_id_too_long", "a job id of 65 characters (at most 64)",
     spec(job_id="j" * 65, code="print(1)"),
     f'job_id "{"j" * 65}" is invalid: it is longer than 64 characters'),
    ("unknown_sku", "an SKU that does not exist",
     spec(sku="XXL", code="print(1)"),
     "malformed message: sku: unknown variant `XXL`, expected one of `S`, `M`, `L`, `XL`"),
    ("unknown_network", "a network mode that does not exist",
     spec(code="print(1)", network="internet"),
     "malformed message: network: unknown variant `internet`, expected `none` or `outbound`"),
    ("args_not_a_list", "args as an integer",
     spec(code="print(1)", args=3),
     "malformed message: args: invalid type: integer `3`, expected a sequence"),
    ("input_size_fraction", "an input size that is not integral",
     spec(code="print(1)", inputs=[input_file("data.csv", SHA_A, 2.5)]),
     "malformed message: inputs[].size: expected an integer, found the float 2.5, which is not integral"),
    ("code_too_large", "code of 1 MiB and one byte (at most 1 MiB, 1048576 bytes of UTF-8)",
     spec(code="#" * ((1 << 20) + 1)),
     "code is 1048577 bytes, more than the limit of 1048576"),
    ("code_and_entrypoint", "both code and entrypoint",
     spec(code="print(1)", entrypoint="main.py"),
     "exactly one of code and entrypoint must be set"),
    ("no_source", "neither code nor entrypoint (code nil)",
     spec(code=None),
     "exactly one of code and entrypoint must be set"),
    ("path_escapes", "an input path with '..'",
     spec(code="print(1)", inputs=[input_file("../x", SHA_A, 1)]),
     "path \"../x\" is invalid: it has a '.' or '..' component"),
    ("input_key_outside_uploads", "an input whose key is not under inputs/sha256/ (another job's artifact)",
     spec(code="print(1)", inputs=[{"key": "jobs/other-job/a0123456789abcdef/artifacts/data.csv", "path": "data.csv",
                                    "size": 1100, "sha256": SHA_A}]),
     'input "data.csv" has an invalid S3 key: expected inputs/sha256/<its sha256> or inputs/tenant/<tenant>/sha256/<its sha256>'),
    ("input_key_other_digest", "an input whose key names another digest than its sha256",
     spec(code="print(1)", inputs=[{"key": f"inputs/sha256/{SHA_B}", "path": "data.csv", "size": 1100, "sha256": SHA_A}]),
     'input "data.csv" has an invalid S3 key: expected inputs/sha256/<its sha256> or inputs/tenant/<tenant>/sha256/<its sha256>'),
    ("bad_env_name", "an environment variable name outside [A-Za-z_][A-Za-z0-9_]*",
     spec(code="print(1)", env={"MY-SETTING": "on"}),
     'env "MY-SETTING" is not allowed: names match [A-Za-z_][A-Za-z0-9_]*'),
    ("reserved_env", "an environment variable the sandbox sets",
     spec(code="print(1)", env={"PATH": "/tmp"}),
     'env "PATH" is not allowed: the sandbox sets it'),
    ("timeout_without_unit", "a duration without a unit",
     spec(code="print(1)", timeout="90"),
     'timeout "90" is not a duration such as "60s" or "2m 30s": time unit needed, for example 90sec or 90ms'),
    ("timeout_too_long", "a timeout above the worker's 15 minutes",
     spec(code="print(1)", timeout="16m"),
     'timeout "16m" is out of range: must be above 0 and at most 15m'),
    ("result_ttl_too_long", "a result TTL above 7 days",
     spec(code="print(1)", result_ttl="8days"),
     'result_ttl "8days" is out of range: must be above 0 and at most 7days'),
    ("bad_session", "a session name starting with '.'",
     spec(code="print(1)", session=".hidden"),
     "session name \".hidden\" is not 1 to 64 of [A-Za-z0-9_.-] not starting with '.'"),
]


# --- JobResults -------------------------------------------------------------------------------
def stream(text="", **kw):
    out = {"text": text, "total_bytes": len(text.encode()), "truncated": False, "lossy": False, "log_key": None,
           "log_bytes": 0}
    out.update(kw)
    return out


# A JobResult with nothing optional set (docs/protocol.md, "JobResult").
RESULT_DEFAULTS = {
    "schema_version": 1, "job_id": "vector-job-1", "status": "queued", "reason": None, "sku": None,
    "exit_code": None, "signal": None, "stdout": stream(), "stderr": stream(), "artifacts": [],
    "skipped_artifacts": [], "skipped_artifacts_total": 0, "usage": None, "queued_at_ms": None,
    "started_at_ms": None, "finished_at_ms": None, "worker_id": None, "attempt": 0, "outputs": [],
    "outputs_dropped": 0, "error": None, "session": None, "execution_count": None, "sandbox": None,
}

ATTEMPT = "a0123456789abcdef"
PREFIX = f"jobs/vector-job-1/{ATTEMPT}/"


def result(**fields):
    out = copy.deepcopy(RESULT_DEFAULTS)
    out.update(fields)
    return out


def artifact(path, size, sha, content_type, key=None, url=True):
    key = key or f"{PREFIX}artifacts/{path}"
    return {"path": path, "key": key, "size": size, "sha256": sha, "content_type": content_type,
            "url": f"http://127.0.0.1:3900/sandq/{key}?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Expires=86400" if url else None,
            "url_expires_at_ms": 1796133454196 if url else None}


def ran(**fields):
    """A result of a job that ran (timings, worker, usage, sandbox)."""
    base = dict(sku="M", queued_at_ms=1796047054196, started_at_ms=1796047054198, finished_at_ms=1796047055417,
                worker_id="worker-1", attempt=1, usage={"wall_ms": 1166, "cpu_ms": 1241, "peak_memory_bytes": 96993280},
                sandbox={"warm": True, "forked": True, "sandbox_wait_ms": 12})
    base.update(fields)
    return result(**base)


TRACEBACK = ["Traceback (most recent call last):", '  File "/sandq/main.py", line 3, in <module>', "    1 / 0",
             "ZeroDivisionError: division by zero"]
ERROR = {"name": "ZeroDivisionError", "value": "division by zero", "traceback": TRACEBACK}
TABLE_MD = "|  | a |\n|---|---:|\n| 0 | 1 |\n"
PNG = artifact("output-1-0.png", 59677, SHA_B, "image/png", key=f"{PREFIX}outputs/output-1-0.png")
SESSION = {"name": "0c6f2b1e-0c1b-4b53-9a55-8f3f5bd1d3a4", "fresh": False, "expired": False, "restored_files": 2,
           "saved_files": 1, "deleted_files": 1, "files": 2, "bytes": 59777, "unsaved_files": 3,
           "expires_at_ms": 1796048855417,
           "state": {"restored": 2, "not_restored": [{"name": "gone", "reason": "ModuleNotFoundError: No module named 'gone'"}],
                     "saved": True, "variables": ["df", "x"], "unsaved": [{"name": "f", "reason": "TypeError: cannot pickle '_io.TextIOWrapper' object"}],
                     "bytes": 4096, "save_ms": 35, "restore_ms": 12}}

RESULTS = [
    ("queued_by_client", "the minimal queued result a client writes (docs/protocol.md)",
     {"schema_version": 1, "job_id": "vector-job-1", "status": "queued", "sku": "S", "queued_at_ms": 1796047054196, "attempt": 0},
     result(sku="S", queued_at_ms=1796047054196)),
    ("queued_by_js_client", "a queued result with float64 integers and nil fields, as a JavaScript encoder writes it",
     {"schema_version": F64(1.0), "job_id": "vector-job-1", "status": "queued", "reason": None, "sku": "S",
      "queued_at_ms": F64(1796047054196.0), "attempt": F64(0.0), "stdout": None, "artifacts": None, "outputs_dropped": None},
     result(sku="S", queued_at_ms=1796047054196)),
    ("running", "a worker took it",
     None, result(status="running", sku="M", queued_at_ms=1796047054196, started_at_ms=1796047054198, worker_id="worker-1", attempt=1)),
    ("succeeded_notebook", "a notebook cell of a session: a table, a chart, an artifact, session state",
     None, ran(status="succeeded", exit_code=0,
               stdout=stream("203 quarters\n", log_key=f"{PREFIX}stdout", log_bytes=13),
               artifacts=[artifact("macro.png", 59677, SHA_A, "image/png"), artifact("summary.csv", 100, SHA_B, "text/csv", url=False)],
               skipped_artifacts=[{"path": "link", "reason": "symlink"}, {"path": "big.bin", "reason": "too_large"}],
               skipped_artifacts_total=3,
               outputs=[
                   {"output_type": "execute_result",
                    "data": {"text/markdown": {"text": TABLE_MD, "artifact": None, "size": len(TABLE_MD)},
                             "text/plain": {"text": "   a\n0  1", "artifact": None, "size": 9}},
                    "table": {"rows": 1, "columns": 1}, "image": None, "error": None},
                   {"output_type": "display_data",
                    "data": {"image/png": {"text": None, "artifact": PNG, "size": 59677},
                             "text/plain": {"text": "<Figure size 800x400 with 1 Axes>", "artifact": None, "size": 33}},
                    "table": None, "image": {"width": 800, "height": 400}, "error": None}],
               outputs_dropped=1, session=SESSION, execution_count=4)),
    ("failed_exception", "an uncaught exception in notebook mode",
     None, ran(status="failed", exit_code=1, stderr=stream("\n".join(TRACEBACK) + "\n", log_key=f"{PREFIX}stderr", log_bytes=123),
               outputs=[{"output_type": "error", "data": {"text/plain": {"text": "ZeroDivisionError: division by zero", "artifact": None, "size": 35}},
                         "table": None, "image": None, "error": ERROR}],
               error=ERROR, execution_count=1, sandbox={"warm": False, "forked": False, "sandbox_wait_ms": 431})),
    ("failed_signal", "killed by a signal",
     None, ran(status="failed", signal="SIGSEGV", reason="killed by SIGSEGV")),
    ("timed_out", "still running at its timeout; output kept",
     None, ran(status="timed_out", signal="SIGKILL", reason="still running after 5s",
               stdout=stream("x" * 10, total_bytes=70000000, truncated=True, log_key=f"{PREFIX}stdout", log_bytes=8388608))),
    ("oom_killed", "the memory limit",
     None, ran(status="oom_killed", signal="SIGKILL", reason="memory limit of 4294967296 bytes exceeded (1 process(es) killed by the kernel)",
               stdout=stream("caf\ufffd\n", total_bytes=5, lossy=True, log_key=f"{PREFIX}stdout", log_bytes=5))),
    ("rejected", "an invalid job: no sku, the reason",
     None, result(status="rejected", reason='env "PATH" is not allowed: the sandbox sets it', worker_id="worker-1",
                  finished_at_ms=1796047054200)),
    ("cancelled_before_start", "cancelled while queued: no usage, no sandbox",
     None, result(status="cancelled", reason="cancelled before it started", sku="S", queued_at_ms=1796047054196,
                  worker_id="worker-1", attempt=1, finished_at_ms=1796047054300)),
    ("cancelled_while_running", "cancelled while running: killed, output kept",
     None, ran(status="cancelled", signal="SIGKILL", reason="cancelled while running", stdout=stream("started\n", log_key=f"{PREFIX}stdout", log_bytes=8))),
    ("expired", "no worker took it in time",
     None, result(status="expired", reason="no worker took it within 1h (queues.unserved_ttl): no running worker serves its sku, or every one was busy",
                  sku="L", queued_at_ms=1796047054196, worker_id="worker-1", finished_at_ms=1796050654196)),
    ("internal_error", "its deliveries kept killing workers",
     None, result(status="internal_error", reason="its deliveries kept failing (killed its worker 6 times): it was dead-lettered at the queue's delivery limit",
                  sku="M", queued_at_ms=1796047054196, started_at_ms=1796047060000, worker_id="worker-2", attempt=6,
                  finished_at_ms=1796047099000)),
]


def write(path, data: bytes):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def write_json(path, value):
    write(path, (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode())


def main() -> int:
    for sub in ("jobspec/valid", "jobspec/invalid", "jobresult"):
        d = os.path.join(HERE, sub)
        if os.path.isdir(d):
            for name in os.listdir(d):
                os.remove(os.path.join(d, name))
    for name, description, wire, expected in VALID_SPECS:
        write(os.path.join(HERE, "jobspec/valid", name + ".msgpack"), pack(wire))
        write_json(os.path.join(HERE, "jobspec/valid", name + ".json"), {"description": description, "spec": expected})
    for name, description, wire, reason in INVALID_SPECS:
        write(os.path.join(HERE, "jobspec/invalid", name + ".msgpack"), pack(wire))
        write_json(os.path.join(HERE, "jobspec/invalid", name + ".json"), {"description": description, "reason": reason})
    for name, description, wire, expected in RESULTS:
        # Without a wire form of its own, a result is sent as a worker writes it: every field.
        write(os.path.join(HERE, "jobresult", name + ".msgpack"), pack(wire if wire is not None else expected))
        write_json(os.path.join(HERE, "jobresult", name + ".json"), {"description": description, "result": expected})
    print(f"{len(VALID_SPECS)} valid and {len(INVALID_SPECS)} invalid JobSpecs, {len(RESULTS)} JobResults in {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
