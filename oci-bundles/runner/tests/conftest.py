"""Puts the runner's directory (oci-bundles/runner) on sys.path so that `import sandq_nb`
works, and keeps Python from writing __pycache__ into the tree (the sandbox mounts the
runner read-only and sets PYTHONDONTWRITEBYTECODE=1 too)."""

import os
import subprocess
import sys

import pytest

sys.dont_write_bytecode = True

RUNNER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = os.path.join(RUNNER_DIR, "sandq_runner.py")
if RUNNER_DIR not in sys.path:
    sys.path.insert(0, RUNNER_DIR)


def run_runner(script, *args, cwd=None, env=None, timeout=120):
    """Runs `python3 sandq_runner.py script args...` in a child process; returns
    (returncode, stdout, stderr, [outputs as dicts])."""
    import json
    outputs = os.path.join(os.path.dirname(script), "outputs.jsonl")
    if os.path.exists(outputs):
        os.remove(outputs)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("SANDQ_")}
    child_env.update({"PYTHONDONTWRITEBYTECODE": "1", "SANDQ_OUTPUTS": outputs, "MPLBACKEND": "Agg"})
    child_env.update(env or {})
    proc = subprocess.run([sys.executable, ENTRY, script, *args], cwd=cwd or os.path.dirname(script),
                          env=child_env, capture_output=True, text=True, timeout=timeout)
    lines = []
    if os.path.exists(outputs):
        with open(outputs, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f]
    return proc.returncode, proc.stdout, proc.stderr, lines


@pytest.fixture
def runner():
    pytest.importorskip("IPython")
    return run_runner
