"""E2B's own Python test suite (tests/e2b/python: e2b-dev/code-interpreter @7df1757, run by
E2B's SDK, e2b-code-interpreter 2.9.1 on e2b 2.45.1) against the gateway's E2B layer
(docs/e2b.md) on the real worker: every test passes except those listed below, each with its
reason. The suite runs in a virtualenv of its own ($SANDQ_E2B_PYTHON, made by scripts/test.sh
from tests/e2b/requirements.txt), as E2B runs it (pytest, two processes), pointed at the gateway
by the two variables an E2B user changes (E2B_API_URL, E2B_SANDBOX_URL) and a key of a new
tenant in E2B's form (`e2b_` and the key's hex)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import new_key

SUITE = Path(__file__).resolve().parents[3] / "tests" / "e2b" / "python"

# Tests that cannot apply to sandq: R and Java kernels, and E2B's template internals (systemd,
# its Jupyter server's processes). Deselected, as docs/e2b.md lists.
NOT_APPLICABLE = {
    **{f"tests/{kind}/env_vars/test_{lang}.py::{name}": f"no {lang.upper() if lang == 'r' else 'Java'} runtime in sandq"
       for kind in ("sync", "async") for lang in ("r", "java")
       for name in ("test_env_vars_on_sandbox", "test_env_vars_per_execution", "test_env_vars_overwrite")},
    **{f"tests/{kind}/{file}::{name}": "no R or Java runtime in sandq"
       for kind, file in (("sync", "test_cwd.py"), ("async", "test_async_cwd.py")) for name in ("test_cwd_r", "test_cwd_java")},
    "tests/sync/test_default_kernels.py::test_r_kernel": "no R runtime in sandq",
    "tests/sync/test_default_kernels.py::test_java_kernel": "no Java runtime in sandq",
    **{f"tests/{kind}/{file}::{name}": "E2B's template internals (systemd, its Jupyter processes)"
       for kind, file in (("sync", "test_systemd.py"), ("async", "test_async_systemd.py"))
       for name in ("test_restart_after_jupyter_kill", "test_restart_after_code_interpreter_kill")},
}

# Tests that apply but do not pass yet, each with what they need (none: docs/e2b.md).
NOT_YET: dict[str, str] = {}


def outcomes(junit: Path) -> dict[str, str]:
    """`tests/<file>::<name>` -> passed, failed or skipped, from pytest's JUnit XML."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        # classname is the module path with dots (`tests.sync.test_basic`), `file` its path.
        file = case.get("file") or (path + ".py")
        node = f"{file}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            out[node] = "failed"
        elif case.find("skipped") is not None:
            out[node] = "skipped"
        else:
            out[node] = "passed"
    return out


def run_suite(python: str, env: dict[str, str], args: list[str], junit: Path) -> dict[str, str]:
    command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", "-o", "junit_family=xunit1", *args]
    done = subprocess.run(command, cwd=SUITE, env=env, capture_output=True, text=True, timeout=1800)
    # Prefixed: the suite's own closing line must not count in scripts/test.sh's tally.
    sys.stdout.write("".join(f"e2b| {line}\n" for line in done.stdout[-20000:].splitlines()))
    sys.stderr.write("".join(f"e2b| {line}\n" for line in done.stderr[-5000:].splitlines()))
    assert junit.exists(), f"E2B's suite did not run ({done.returncode})"
    return outcomes(junit)


def test_e2b_s_own_suite_passes_but_for_the_listed_tests(gateway_url: str):
    python = os.environ.get("SANDQ_E2B_PYTHON")
    assert python, "SANDQ_E2B_PYTHON (the E2B suite's virtualenv python, made by scripts/test.sh) is not set"
    key = new_key(f"e2b{uuid.uuid4().hex[:10]}", "--jobs-per-minute", "2000", "--max-in-flight", "20")
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update({
        "E2B_API_KEY": "e2b_" + key.encode().hex(),
        "E2B_API_URL": gateway_url,
        "E2B_SANDBOX_URL": gateway_url,
    })
    listed = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"], cwd=SUITE, env=env,
                            capture_output=True, text=True, timeout=300)
    collected = [line.strip() for line in listed.stdout.splitlines() if "::" in line]
    assert len(collected) == 145, f"E2B's suite has 145 tests at 7df1757; collected {len(collected)}:\n{listed.stdout[-3000:]}"
    assert set(NOT_APPLICABLE) <= set(collected) and set(NOT_YET) <= set(collected), "a listed test is not in the suite"
    # The tests to run, by exact id (`--deselect` matches by prefix: test_cwd_java would take
    # test_cwd_javascript with it).
    selected = [node for node in collected if node not in NOT_APPLICABLE]
    with tempfile.TemporaryDirectory() as tmp:
        first = run_suite(python, env, selected, Path(tmp) / "first.xml")
        # A test that failed once (this 2-core machine runs the worker, the gateway and two
        # test processes at once; E2B's interrupt test waits a fixed 5 s) is run once more, alone.
        again = sorted(n for n, o in first.items() if o == "failed" and n not in NOT_YET)
        second = run_suite(python, env, ["-p", "no:xdist", "-o", "addopts=--import-mode=importlib", *again], Path(tmp) / "second.xml") if again else {}
    assert first, "no test ran"
    assert not set(first) & set(NOT_APPLICABLE), "a deselected test ran"
    final = {**first, **second}
    failing = sorted(n for n, o in final.items() if o == "failed" and n not in NOT_YET)
    assert not failing, f"E2B tests failing (twice): {failing}"
    skipped = sorted(n for n, o in final.items() if o == "skipped")
    assert not skipped, f"skipped: {skipped}"
    missing = sorted(set(selected) - set(final))
    assert not missing, f"selected but not reported: {missing}"
    now_passing = sorted(n for n in NOT_YET if final.get(n) == "passed")
    assert not now_passing, f"passing now: take them off NOT_YET: {now_passing}"
    passed = sum(1 for o in final.values() if o == "passed")
    assert passed == len(selected) - len(NOT_YET), (passed, len(selected), len(NOT_YET))
    print(f"E2B suite: {passed} passed, {len(NOT_YET)} not yet, {len(NOT_APPLICABLE)} not applicable; run again: {again}")


def test_the_e2b_layer_keeps_tenants_apart_bounds_what_it_keeps_and_a_killed_sandbox_stays_gone(gateway_url: str):
    """The E2B routes by hand (httpx): another tenant's key finds nothing of a sandbox; the
    sizes a sandbox keeps are bounded; restarting the default context empties the state a plain
    run_code sees; contexts with states are capped at 16; a killed sandbox cannot be extended
    back to life, and envd's /health says it is gone."""
    import httpx
    import json as _json

    mine, theirs = (new_key(f"e2b{uuid.uuid4().hex[:10]}", "--jobs-per-minute", "600") for _ in range(2))
    e2b = lambda key: {"X-API-Key": "e2b_" + key.encode().hex()}

    def plane(key, sandbox, port=49999):
        return {"X-Access-Token": "e2b_" + key.encode().hex(), "E2b-Sandbox-Id": sandbox, "E2b-Sandbox-Port": str(port)}

    def execute(http, key, sandbox, code, **extra):
        lines = []
        with http.stream("POST", "/execute", json={"code": code, **extra}, headers=plane(key, sandbox)) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line:
                    lines.append(_json.loads(line))
        assert lines[-1] == {"type": "end_of_execution"}, lines
        return lines

    with httpx.Client(base_url=gateway_url, timeout=120) as http:
        created = http.post("/sandboxes", json={"templateID": "code-interpreter-v1", "timeout": 120}, headers=e2b(mine))
        assert created.status_code == 201, created.text
        sandbox = created.json()["sandboxID"]
        # Another tenant: not found on the control plane, not running on the sandbox plane.
        assert http.get(f"/sandboxes/{sandbox}", headers=e2b(theirs)).status_code == 404
        assert http.delete(f"/sandboxes/{sandbox}", headers=e2b(theirs)).status_code == 404
        assert http.post(f"/sandboxes/{sandbox}/timeout", json={"timeout": 600}, headers=e2b(theirs)).status_code == 404
        assert http.post("/execute", json={"code": "1"}, headers=plane(theirs, sandbox)).status_code == 502
        assert http.get("/contexts", headers=plane(theirs, sandbox)).status_code == 502
        assert all(s["sandboxID"] != sandbox for s in http.get("/sandboxes", headers=e2b(theirs)).json())
        assert any(s["sandboxID"] == sandbox for s in http.get("/sandboxes", headers=e2b(mine)).json())
        # Bounded: 65 metadata entries are refused.
        big = http.post("/sandboxes", json={"metadata": {f"k{i}": "v" for i in range(65)}}, headers=e2b(mine))
        assert big.status_code == 400, big.text
        # A restarted default context: the next plain cell starts empty.
        execute(http, mine, sandbox, "x = 1")
        assert any(l.get("text") == "1" for l in execute(http, mine, sandbox, "x") if l["type"] == "result")
        assert http.post("/contexts/python/restart", headers=plane(mine, sandbox)).status_code == 204
        errors = [l for l in execute(http, mine, sandbox, "x") if l["type"] == "error"]
        assert [e["name"] for e in errors] == ["NameError"], errors
        # 16 contexts with states of their own at most (the restarted default is one of them).
        made = [http.post("/contexts", json={"language": "python"}, headers=plane(mine, sandbox)) for _ in range(16)]
        assert [r.status_code for r in made] == [200] * 15 + [400], [r.text for r in made]
        # Killed: gone for good.
        assert http.delete(f"/sandboxes/{sandbox}", headers=e2b(mine)).status_code == 204
        assert http.post(f"/sandboxes/{sandbox}/timeout", json={"timeout": 600}, headers=e2b(mine)).status_code == 404
        assert http.post(f"/sandboxes/{sandbox}/connect", json={"timeout": 600}, headers=e2b(mine)).status_code == 404
        assert http.get("/health", headers=plane(mine, sandbox, 49983)).status_code == 502
        assert http.post("/contexts", json={}, headers=plane(mine, sandbox)).status_code == 502


def test_e2b_s_sdk_reads_writes_and_lists_files_and_runs_commands(gateway_url: str):
    """E2B's SDK unchanged: `sandbox.files` (write as multipart and octet-stream, read as text
    and bytes, list, exists, get_info, not found, a path outside /home/user refused) and
    `sandbox.commands.run` (output live, exit codes, env, cwd, quoting, a background command
    killed), with a cell and a command seeing each other's files, and another tenant reaching
    none of it (e2b_envd_driver.py, in the E2B suite's interpreter)."""
    python = os.environ.get("SANDQ_E2B_PYTHON")
    assert python, "SANDQ_E2B_PYTHON (the E2B suite's virtualenv python, made by scripts/test.sh) is not set"
    mine, theirs = (new_key(f"e2b{uuid.uuid4().hex[:10]}", "--jobs-per-minute", "600") for _ in range(2))
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update({
        "E2B_API_KEY": "e2b_" + mine.encode().hex(),
        "E2B_API_URL": gateway_url,
        "E2B_SANDBOX_URL": gateway_url,
        "SANDQ_OTHER_KEY": "e2b_" + theirs.encode().hex(),
    })
    driver = Path(__file__).with_name("e2b_envd_driver.py")
    done = subprocess.run([python, str(driver)], env=env, capture_output=True, text=True, timeout=900)
    sys.stdout.write("".join(f"envd| {line}\n" for line in done.stdout.splitlines()))
    assert done.returncode == 0, f"the driver failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    checks = [line for line in done.stdout.splitlines() if line.startswith("ok: ")]
    assert len(checks) == 30, checks  # every check of the driver ran
