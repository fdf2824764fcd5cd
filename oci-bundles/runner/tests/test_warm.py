import json
import os
import sys
import threading
import time

import pytest

from sandq_nb import warm


@pytest.fixture
def restore_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_wait_for_handover_protocol(tmp_path, monkeypatch, restore_environ):
    ready, go, handover = tmp_path / ".ready", tmp_path / ".go", tmp_path / "handover.json"
    monkeypatch.setattr(warm, "WARM_READY", str(ready))
    monkeypatch.setattr(warm, "WARM_GO", str(go))
    monkeypatch.setattr(warm, "WARM_HANDOVER", str(handover))
    os.mkfifo(go, 0o600)
    os.environ["WARMUP_ONLY"] = "1"
    result = {}
    thread = threading.Thread(target=lambda: result.update(args=warm._wait_for_handover()))
    thread.start()
    # the runner says it is ready, then blocks on the FIFO
    deadline = time.monotonic() + 10
    while not ready.exists():
        assert time.monotonic() < deadline, "no .ready"
        time.sleep(0.01)
    time.sleep(0.05)
    assert thread.is_alive()
    # the worker: the handover first, then one byte to the FIFO
    handover.write_text(json.dumps({"env": {"JOB": "yes", "HOME": "/tmp"}, "args": ["a", "b c"]}))
    with open(go, "wb") as f:
        f.write(b"\n")
    thread.join(10)
    assert not thread.is_alive()
    assert result["args"] == ["a", "b c"]
    assert dict(os.environ) == {"JOB": "yes", "HOME": "/tmp"}  # replaced, not merged
    assert not ready.exists()


def test_preload_imports_quietly_and_cleans_tmp(tmp_path, monkeypatch, capfd):
    mods = tmp_path / "mods"
    mods.mkdir()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    (scratch / "kept").mkdir()
    (mods / "sandq_test_chatty.py").write_text(
        "import os, sys\n"
        "os.makedirs(os.path.join(os.environ['TMPDIR'], 'cache-dir', 'x'))\n"
        "os.write(2, b'import-time chatter\\n')\n"
        "LOADED = True\n")
    monkeypatch.syspath_prepend(str(mods))
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setenv("SANDQ_PRELOAD", " sandq_test_chatty , sandq_test_missing_module ,")
    monkeypatch.delitem(sys.modules, "sandq_test_chatty", raising=False)
    warm._preload()
    assert sys.modules["sandq_test_chatty"].LOADED
    assert sorted(os.listdir(scratch)) == ["kept"]
    os.write(2, b"after\n")  # fd 2 is back
    assert capfd.readouterr().err == "after\n"


def test_constants_match_the_worker():
    # worker/src/stage.rs: WARM_READY, WARM_GO in the outputs dir (/sandq/out), WARM_HANDOVER in src
    assert (warm.WARM_SCRIPT, warm.WARM_READY, warm.WARM_GO, warm.WARM_HANDOVER) == (
        "/sandq/main.py", "/sandq/out/.ready", "/sandq/out/.go", "/sandq/handover.json")
