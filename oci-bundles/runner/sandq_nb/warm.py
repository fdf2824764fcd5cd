"""Warm start (`sandq_runner.py --warm`): the worker starts the sandbox before any job; the
runner preloads modules and makes its shell, says it is ready, and waits for the handover."""

import os


WARM_SCRIPT = "/sandq/main.py"
WARM_READY = "/sandq/out/.ready"
WARM_GO = "/sandq/out/.go"
WARM_HANDOVER = "/sandq/handover.json"


def _preload():
    """Imports the modules named in $SANDQ_PRELOAD (comma-separated; default numpy, pandas,
    matplotlib with pyplot and the runner's backend), with stderr silenced: their import-time chatter is not the job's."""
    names = os.environ.get("SANDQ_PRELOAD", "numpy,pandas,matplotlib")
    tmp = os.environ.get("TMPDIR") or "/tmp"
    try:
        tmp_before = set(os.listdir(tmp))
    except OSError:
        tmp_before = None
    saved = os.dup(2)
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        import importlib
        for name in [n.strip() for n in names.split(",") if n.strip()]:
            try:
                importlib.import_module(name)
                if name == "matplotlib":
                    importlib.import_module("matplotlib.pyplot")
                    # The runner's backend (and Agg's, which it imports): with pyplot loaded,
                    # every cell's end looks for figures through it (~5 ms a cell otherwise).
                    importlib.import_module("sandq_mpl")
            except Exception:
                pass
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    # What the imports left in /tmp (matplotlib's cache dir) a cold start would not have.
    if tmp_before is not None:
        import shutil
        for name in set(os.listdir(tmp)) - tmp_before:
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)


def _wait_for_handover():
    """Blocks until the worker hands a job over; returns the job's argv after the script.
    The handover file (read-only for the sandbox) holds the job's whole environment and its
    arguments; the environment replaces the warm-up one."""
    import json
    open(WARM_READY, "w").close()
    with open(WARM_GO, "rb") as go:
        go.read(1)
    try:
        os.remove(WARM_READY)
    except OSError:
        pass
    return read_handover()


def read_handover():
    """Reads the handover (the job's environment, which replaces the warm-up one, and its
    arguments); returns the arguments."""
    import json
    with open(WARM_HANDOVER, "rb") as f:
        handover = json.load(f)
    os.environ.clear()
    os.environ.update(handover["env"])
    return list(handover["args"])
