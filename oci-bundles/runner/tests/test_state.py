import io
import os
import pickle
import threading

import pytest

from sandq_nb import state
from sandq_nb.state import load_state, save_state


def _size(value):
    """Bytes the state takes for one value: the same pickler, the same protocol."""
    return len(state._pickler_module().dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def _saved_file(path):
    with open(path, "rb") as f:
        return pickle.load(f)


def test_round_trip_and_what_is_left_out(tmp_path):
    path = str(tmp_path / "state.out")
    shared = object()
    baseline = {"os": os, "shared": shared, "changed": 1}
    ns = {
        "os": os,  # the shell's own, unchanged: left out, not listed
        "shared": shared,
        "changed": 2,  # the shell's name, a new value: saved
        "b": [1, 2, {"x": 3}],
        "a": "text",
        "_private": 1,
        "In": [], "Out": {}, "get_ipython": None, "exit": None, "quit": None, "open": None,
    }
    report = save_state(ns, baseline, path, 1 << 20, 60.0)
    assert report["variables"] == ["a", "b", "changed"]  # sorted
    assert report["unsaved"] == []
    assert report["bytes"] == os.path.getsize(path)
    assert isinstance(report["save_ms"], int) and report["save_ms"] >= 0
    assert set(report) == {"variables", "unsaved", "bytes", "save_ms"}
    saved = _saved_file(path)
    assert saved["version"] == 1 and sorted(saved["variables"]) == ["a", "b", "changed"]
    assert all(isinstance(blob, bytes) for blob in saved["variables"].values())
    assert not os.path.exists(path + ".tmp")

    target = {"a": "old", "untouched": 5}
    assert load_state(target, path) == (3, [])
    assert target == {"a": "text", "b": [1, 2, {"x": 3}], "changed": 2, "untouched": 5}


def test_size_cap_is_exact_and_counts_what_was_saved(tmp_path):
    path = str(tmp_path / "state.out")
    a, b, c = "a" * 100, "b" * 200, "c"
    limit = _size(a) + _size(b)
    report = save_state({"a": a, "b": b, "c": c}, {}, path, limit, 60.0)
    # a and b fill the cap exactly; c, however small, does not fit any more
    assert report["variables"] == ["a", "b"]
    assert report["unsaved"] == [{"name": "c", "reason": "over the size cap of %d bytes" % limit}]

    report = save_state({"a": a, "b": b, "c": c}, {}, path, limit - 1, 60.0)
    assert report["variables"] == ["a", "c"]
    assert report["unsaved"] == [{"name": "b", "reason": "over the size cap of %d bytes" % (limit - 1)}]


def test_capped_file_stops_a_huge_object_while_it_is_written():
    buf = io.BytesIO()
    capped = state._CappedFile(buf, 10)
    capped.write(b"12345")
    capped.write(b"67890")
    with pytest.raises(state._StateTooLarge):
        capped.write(b"x")
    assert buf.getvalue() == b"1234567890"


def test_time_cap(tmp_path):
    report = save_state({"a": 1, "b": 2}, {}, str(tmp_path / "s"), 1 << 20, -1)
    assert report["variables"] == []
    assert report["unsaved"] == [{"name": "a", "reason": "over the time cap of -1s"},
                                 {"name": "b", "reason": "over the time cap of -1s"}]


def test_unpicklable_and_open_files(tmp_path):
    lock = threading.Lock()
    try:
        state._pickler_module().dumps(lock, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        expected = "%s: %s" % (type(exc).__name__, exc)
    with open(tmp_path / "f.txt", "w") as f:
        report = save_state({"lock": lock, "f": f, "n": 1}, {}, str(tmp_path / "s"), 1 << 20, 60.0)
    assert report["variables"] == ["n"]
    assert report["unsaved"] == [{"name": "f", "reason": "an open file cannot be saved"},
                                 {"name": "lock", "reason": expected[:200]}]


class _Raises:
    def __init__(self, exc):
        self.exc = exc

    def __reduce__(self):
        raise self.exc


def test_reduce_errors(tmp_path):
    path = str(tmp_path / "s")
    report = save_state({"x": _Raises(ValueError("v" * 300))}, {}, path, 1 << 20, 60.0)
    assert report["unsaved"] == [{"name": "x", "reason": ("ValueError: " + "v" * 300)[:200]}]

    class Custom(BaseException):
        pass

    report = save_state({"x": _Raises(Custom("c"))}, {}, path, 1 << 20, 60.0)
    assert report["unsaved"] == [{"name": "x", "reason": "Custom: c"}]
    with pytest.raises(KeyboardInterrupt):
        save_state({"x": _Raises(KeyboardInterrupt())}, {}, path, 1 << 20, 60.0)
    with pytest.raises(SystemExit):
        save_state({"x": _Raises(SystemExit(3))}, {}, path, 1 << 20, 60.0)


def test_listing_caps(tmp_path):
    ns = {"v%04d" % i: i for i in range(1005)}
    ns.update({"u%03d" % i: _Raises(ValueError(i)) for i in range(105)})
    report = save_state(ns, {}, str(tmp_path / "s"), 1 << 20, 60.0)
    assert report["variables"] == ["v%04d" % i for i in range(1000)]
    assert report["unsaved"] == [{"name": "u%03d" % i, "reason": "ValueError: %d" % i} for i in range(100)]
    assert len(_saved_file(str(tmp_path / "s"))["variables"]) == 1005  # all saved, only the list is capped


def test_load_missing_and_unreadable(tmp_path):
    ns = {}
    assert load_state(ns, str(tmp_path / "none")) == (0, [])
    (tmp_path / "bad").write_bytes(b"not a pickle")
    count, errors = load_state(ns, str(tmp_path / "bad"))
    assert count == 0 and len(errors) == 1 and errors[0]["name"] == "*"
    assert errors[0]["reason"].startswith("the saved state cannot be read: UnpicklingError: ")
    with open(tmp_path / "nodict", "wb") as f:
        pickle.dump([1], f)
    assert load_state(ns, str(tmp_path / "nodict")) == (0, [{
        "name": "*",
        "reason": "the saved state cannot be read: TypeError: list indices must be integers or slices, not str"}])
    assert ns == {}


def test_load_one_bad_variable_leaves_itself_out(tmp_path):
    path = tmp_path / "s"
    missing = b"cno_such_module_for_sandq_tests\nThing\n."  # protocol 0: a global reference
    with open(path, "wb") as f:
        pickle.dump({"version": 1, "variables": {"ok": pickle.dumps(5), "bad": missing}}, f)
    ns = {}
    assert load_state(ns, str(path)) == (1, [{
        "name": "bad", "reason": "ModuleNotFoundError: No module named 'no_such_module_for_sandq_tests'"}])
    assert ns == {"ok": 5}


def test_functions_defined_by_the_cell_go_by_value(tmp_path):
    if state._pickler_module().__name__ == "pickle":
        pytest.skip("neither cloudpickle nor joblib's copy of it is installed")
    ns = {"__name__": "__main__"}
    exec("factor = 3\ndef triple(x):\n    return x * factor\n", ns)
    path = str(tmp_path / "s")
    report = save_state(ns, {}, path, 1 << 20, 60.0)
    assert report["variables"] == ["factor", "triple"]
    target = {}
    assert load_state(target, path) == (2, [])
    assert target["triple"](5) == 15


@pytest.mark.parametrize("raw,kind,expected", [
    (None, int, 7), ("", int, 7), ("  12 ", int, 12), ("x", int, 7), ("2.5", float, 2.5), ("2.5", int, 7),
])
def test_env_number(monkeypatch, raw, kind, expected):
    if raw is None:
        monkeypatch.delenv("SANDQ_TEST_NUMBER", raising=False)
    else:
        monkeypatch.setenv("SANDQ_TEST_NUMBER", raw)
    assert state._env_number("SANDQ_TEST_NUMBER", 7, kind) == expected
