"""The whole runner in a child process (python3 sandq_runner.py script args...); needs IPython."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ENTRY, RUNNER_DIR


def write(path, text):
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return str(path)


def test_looks_like_plain_python(runner, tmp_path):
    script = write(tmp_path / "main.py", """
        import json, os, sys
        print(json.dumps([sys.argv, __name__, __file__, sys.path[0], os.getcwd()]))
        x = 6
        x * 7
    """)
    rc, out, err, outputs = runner(script, "a", "b c", cwd=str(tmp_path))
    assert (rc, err) == (0, "")
    assert json.loads(out) == [[script, "a", "b c"], "__main__", script, str(tmp_path), str(tmp_path)]
    assert outputs == [{"output_type": "execute_result", "data": {"text/plain": "42"}, "metadata": {}}]


def test_error_traceback_is_plain_pythons(runner, tmp_path):
    script = write(tmp_path / "main.py", """
        def f(d):
            return d["missing"]

        print("before")
        f({})
    """)
    rc, out, err, outputs = runner(script)
    plain = subprocess.run([sys.executable, "-X", "no_debug_ranges", script], capture_output=True, text=True)
    assert rc == plain.returncode == 1
    assert out == plain.stdout == "before\n"
    assert err == plain.stderr
    assert outputs == [{"output_type": "error", "ename": "KeyError", "evalue": "'missing'",
                        "traceback": plain.stderr.rstrip("\n").split("\n")}]


def test_user_modules_named_like_the_runners_are_the_users(runner, tmp_path):
    names = ["state", "shell", "run", "common", "outputs", "warm", "imports", "tracebacks",
             "formatters", "bundles"]
    for name in names:
        (tmp_path / (name + ".py")).write_text("WHO = 'user %s'\n" % name)
    script = write(tmp_path / "main.py", """
        import importlib, sys
        names = %r
        print([importlib.import_module(n).WHO for n in names])
        print(sorted(n for n in sys.modules if n.startswith("sandq_nb.")) == sorted("sandq_nb." + n for n in names))
        {"k": 1}
    """ % names)
    rc, out, err, outputs = runner(script)
    assert (rc, err) == (0, "")
    assert out == "%r\nTrue\n" % ["user " + n for n in names]
    assert outputs[0]["data"]["text/plain"] == "{'k': 1}"


def test_exit_status_and_session_state(runner, tmp_path):
    state_out, report = str(tmp_path / "state.out"), str(tmp_path / "state.json")
    first = write(tmp_path / "main.py", """
        import math
        factor = 3
        def triple(x):
            return x * factor
        import sys
        sys.exit(4)
    """)
    rc, out, err, outputs = runner(first, env={
        "SANDQ_STATE_OUT": state_out, "SANDQ_STATE_REPORT": report, "SANDQ_STATE_LIMIT": "1000000"})
    assert (rc, out, err, outputs) == (4, "", "", [])
    with open(report) as f:
        saved = json.load(f)
    assert saved["variables"] == ["factor", "math", "sys", "triple"]
    assert saved["restored"] == 0 and saved["not_restored"] == [] and saved["unsaved"] == []
    second = write(tmp_path / "main.py", "print(triple(5), math.pi > 3)\nget_ipython().execution_count\n")
    rc, out, err, outputs = runner(second, env={"SANDQ_STATE_IN": state_out, "SANDQ_EXECUTION_COUNT": "7"})
    assert (rc, out, err) == (0, "15 True\n", "")
    assert outputs[0]["data"]["text/plain"] == "7"


def test_shell_and_await(runner, tmp_path):
    script = write(tmp_path / "main.py", """
        import asyncio
        !echo hi
        await asyncio.sleep(0)
        display({"a": 1})
        "done"
    """)
    rc, out, err, outputs = runner(script)
    assert (rc, out, err) == (0, "hi\n", "")
    assert [o["data"]["text/plain"] for o in outputs] == ["{'a': 1}", "'done'"]


def test_warm_start_waits_for_the_handover(tmp_path):
    pytest.importorskip("IPython")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    ready, go, handover = out_dir / ".ready", out_dir / ".go", tmp_path / "handover.json"
    os.mkfifo(go, 0o600)
    script = write(tmp_path / "main.py", """
        import os, sys
        print(sys.argv[1:], os.environ.get("JOB_VAR"), os.environ.get("WARMUP_VAR"))
        sys.argv[0]
    """)
    outputs = tmp_path / "outputs.jsonl"
    # The real paths are under /sandq: this driver points the warm module at tmp_path first.
    driver = textwrap.dedent("""
        import sys
        sys.path.insert(0, %r)
        from sandq_nb import run, warm
        warm.WARM_SCRIPT, warm.WARM_READY, warm.WARM_GO, warm.WARM_HANDOVER = %r, %r, %r, %r
        sys.argv = [%r, "--warm"]
        run.start()
    """) % (RUNNER_DIR, script, str(ready), str(go), str(handover), ENTRY)
    # The outputs file is opened before the handover: SANDQ_OUTPUTS is in the warm-up
    # environment (the worker's sandbox_environment), as it is in the job's.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1",
           "SANDQ_PRELOAD": "json", "WARMUP_VAR": "warm-up", "HOME": os.environ.get("HOME", "/tmp"),
           "SANDQ_OUTPUTS": str(outputs)}
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=str(tmp_path), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        job_env = dict(env, JOB_VAR="job")
        del job_env["WARMUP_VAR"]
        handover.write_text(json.dumps({"env": job_env, "args": ["x", "y"]}))
        with open(go, "wb") as f:
            f.write(b"1")
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, out, err) == (0, "['x', 'y'] job None\n", "")
    assert not ready.exists()
    assert [json.loads(line) for line in outputs.read_text().splitlines()] == [
        {"output_type": "execute_result", "data": {"text/plain": repr(script)}, "metadata": {}}]
