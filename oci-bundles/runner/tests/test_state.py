import io
import os
import pickle
import threading

import pytest

from sandq_nb import state
from sandq_nb.state import load_state, save_state


def _size(name, value):
    """Bytes one record takes (computed apart from save_state): its name length (4 bytes), the
    name, its payload length and memo count (8 bytes each), and the payload, one pickle of the
    same pickler."""
    return 4 + len(name.encode()) + 16 + len(state._pickler_module().dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def _records(path):
    """The record names and payload lengths of a saved state, read by hand from the format of
    the module doc."""
    import struct
    with open(path, "rb") as f:
        assert f.read(len(b"SANDQ-STATE-2\n")) == b"SANDQ-STATE-2\n"
        out = []
        while True:
            head = f.read(4)
            if not head:
                return out
            (n,) = struct.unpack("<I", head)
            name = f.read(n).decode()
            length, _memo = struct.unpack("<QQ", f.read(16))
            f.seek(length, 1)
            if name:  # an empty name is a memo reset, not a variable
                out.append((name, length))


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
    records = _records(path)
    assert [name for name, _ in records] == ["a", "b", "changed"]
    assert all(length > 0 for _, length in records)
    assert not os.path.exists(path + ".tmp")

    target = {"a": "old", "untouched": 5}
    assert load_state(target, path) == (3, [])
    assert target == {"a": "text", "b": [1, 2, {"x": 3}], "changed": 2, "untouched": 5}


def test_size_cap_is_exact_and_counts_what_was_saved(tmp_path):
    path = str(tmp_path / "state.out")
    a, b, c = "a" * 100, "b" * 200, "c"
    limit = len(state.MAGIC) + _size("a", a) + _size("b", b)
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
    assert len(_records(str(tmp_path / "s"))) == 1005  # all saved, only the list is capped


def test_load_missing_and_unreadable(tmp_path):
    ns = {}
    assert load_state(ns, str(tmp_path / "none")) == (0, [])
    (tmp_path / "bad").write_bytes(b"not a pickle")
    count, errors = load_state(ns, str(tmp_path / "bad"))
    assert count == 0 and len(errors) == 1 and errors[0]["name"] == "*"
    assert errors[0]["reason"].startswith("the saved state cannot be read: UnpicklingError: ")
    # A state cut short: the records before the cut load, the rest is one listed failure.
    path = str(tmp_path / "cut")
    save_state({"a": 1, "b": "x" * 1000}, {}, path, 1 << 20, 60.0)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 500)
    cut = {}
    count, errors = load_state(cut, path)
    assert (count, cut) == (1, {"a": 1})
    assert [e["name"] for e in errors] == ["b"]
    with open(tmp_path / "nodict", "wb") as f:
        pickle.dump([1], f)
    assert load_state(ns, str(tmp_path / "nodict")) == (0, [{
        "name": "*",
        "reason": "the saved state cannot be read: TypeError: list indices must be integers or slices, not str"}])
    assert ns == {}


def test_the_first_format_still_loads_and_one_bad_variable_leaves_itself_out(tmp_path):
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


def _cloudpickle():
    if state._pickler_module().__name__ == "pickle":
        pytest.skip("neither cloudpickle nor joblib's copy of it is installed")


def _cell(ns, code):
    exec(compile(code, "<cell>", "exec"), ns)


def _next_cell(tmp_path, cell1, cell2, **limits):
    """Runs cell1 in a namespace, saves it, loads it into a new one, runs cell2 there."""
    path = str(tmp_path / "s")
    ns = {"__name__": "__main__"}
    _cell(ns, cell1)
    report = save_state(ns, {"__name__": "__main__"}, path, 64 << 20, 60.0)
    target = {"__name__": "__main__"}
    restored, not_restored = load_state(target, path, **limits)
    _cell(target, cell2)
    return target, report, restored, not_restored


def test_functions_see_the_restored_namespace_not_a_copy(tmp_path):
    _cloudpickle()
    ns, _, _, errors = _next_cell(
        tmp_path,
        "rate = 0.1\nhistory = []\ndef charge(a):\n    history.append(a)\n    return a * (1 + rate)\ncharge(10)\n",
        "rate = 0.5\nresult = (charge(100), history)\n")
    assert errors == []
    assert ns["result"] == (150.0, [10, 100])
    assert ns["charge"].__globals__ is ns


def test_two_names_for_one_object_stay_one_object(tmp_path):
    _cloudpickle()
    ns, _, _, _ = _next_cell(tmp_path, "rows = [1]\nalias = rows\nboth = {'x': rows}\n", "alias.append(2)\n")
    assert ns["rows"] is ns["alias"] is ns["both"]["x"] and ns["rows"] == [1, 2]


def test_classes_closures_and_lambdas_resolve_the_live_globals(tmp_path):
    _cloudpickle()
    ns, _, _, errors = _next_cell(
        tmp_path,
        "def make(n):\n    def add(x):\n        return x + n + offset\n    return add\n"
        "offset = 1\nfs = [make(1), lambda v: v * scale]\nscale = 3\n"
        "class Acc:\n    def __init__(self):\n        self.items = []\n    def push(self, v):\n        self.items.append(v)\n        return total()\n"
        "def total():\n    return sum(acc.items)\nacc = Acc()\n",
        "offset = 10\nscale = 5\nout = (fs[0](1), fs[1](2), acc.push(3), type(acc) is Acc)\n")
    assert errors == []
    assert ns["out"] == (12, 10, 3, True)


def test_large_buffers_are_kept(tmp_path):
    np = pytest.importorskip("numpy")
    ns, report, _, errors = _next_cell(tmp_path, "import numpy as np\nbig = np.arange(200_000) * 0.5\n", "total = big.sum()\n")
    assert report["unsaved"] == [] and errors == []
    assert ns["total"] == float(np.arange(200_000).sum()) * 0.5
    assert report["bytes"] > 200_000 * 8


class _Slow:
    def __reduce__(self):
        import time
        return (time.sleep, (3600,))


class _Bad:
    def __reduce__(self):
        return (int, ("not a number",))


def test_a_value_that_hangs_or_raises_on_load_is_dropped_and_the_rest_loads(tmp_path):
    path = str(tmp_path / "s")
    save_state({"a_slow": _Slow(), "b_bad": _Bad(), "c_fine": [1, 2], "d_fine": "text"}, {}, path, 1 << 20, 60.0)
    ns = {}
    import time
    t0 = time.monotonic()
    restored, errors = load_state(ns, path, seconds=30.0, variable_seconds=0.5)
    assert time.monotonic() - t0 < 5
    assert (restored, ns) == (2, {"c_fine": [1, 2], "d_fine": "text"})
    assert errors == [{"name": "a_slow", "reason": "restoring it took over 0.5s"},
                      {"name": "b_bad", "reason": "ValueError: invalid literal for int() with base 10: 'not a number'"}]


def test_a_value_that_fails_to_save_leaves_the_others_whole(tmp_path):
    _cloudpickle()
    # `g` (a generator) fails halfway through its record; what it memoized is cut with it, and
    # the records after it (an instance of the session's class, sharing it) still load right.
    ns, report, restored, errors = _next_cell(
        tmp_path,
        "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n"
        "g = (i for i in range(3))\np = Point(3, 4)\nshared = [p, p]\n",
        "out = (p.norm(), type(p) is Point, shared[0] is shared[1] is p)\n")
    assert [u["name"] for u in report["unsaved"]] == ["g"]
    assert errors == []
    assert ns["out"] == (5.0, True, True)


def test_a_value_that_fails_to_restore_drops_only_what_shares_with_it(tmp_path):
    path = str(tmp_path / "s")
    poison = _Bad()
    save_state({"a_bad": poison, "b_holds_it": [poison], "c_list": [1, 2], "d_alias": None}, {}, path, 1 << 20, 60.0)
    # d_alias names c_list's list: saved after it, it shares it.
    ns = {"a_bad": 0, "b_holds_it": 0}
    ns_in = {"a_bad": poison, "b_holds_it": [poison], "c_list": [1, 2]}
    ns_in["d_alias"] = ns_in["c_list"]
    save_state(ns_in, {}, path, 1 << 20, 60.0)
    ns = {}
    restored, errors = load_state(ns, path)
    assert [e["name"] for e in errors] == ["a_bad", "b_holds_it"]
    assert errors[1]["reason"] == "it shares objects with a variable that could not be restored"
    assert restored == 2 and ns["c_list"] == [1, 2] and ns["d_alias"] is ns["c_list"]


def test_the_whole_restore_has_a_time_limit(tmp_path):
    path = str(tmp_path / "s")
    save_state({"a": _Slow(), "b": 1}, {}, path, 1 << 20, 60.0)
    ns = {}
    restored, errors = load_state(ns, path, seconds=0.3, variable_seconds=10.0)
    assert (restored, ns) == (0, {})
    assert errors == [{"name": "a", "reason": "restoring it took over 0.3s"},
                      {"name": "b", "reason": "over the restore time limit of 0.3s"}]


@pytest.mark.parametrize("raw,kind,expected", [
    (None, int, 7), ("", int, 7), ("  12 ", int, 12), ("x", int, 7), ("2.5", float, 2.5), ("2.5", int, 7),
])
def test_env_number(monkeypatch, raw, kind, expected):
    if raw is None:
        monkeypatch.delenv("SANDQ_TEST_NUMBER", raising=False)
    else:
        monkeypatch.setenv("SANDQ_TEST_NUMBER", raw)
    assert state._env_number("SANDQ_TEST_NUMBER", 7, kind) == expected


def test_after_a_failed_value_the_others_that_share_only_names_still_load(tmp_path):
    # `a` fails while its global `builtins.int` is fetched by name; `b` (the os module) and `c`
    # fetch other names the pickler memoized in `a`'s record: they are plain strings, not
    # anything `a` built, and load.
    _cloudpickle()  # plain pickle cannot save a module
    path = str(tmp_path / "s")
    save_state({"a": _Bad(), "b": os, "c": int, "d": {"k": [1]}}, {}, path, 1 << 20, 60.0)
    ns = {}
    restored, errors = load_state(ns, path)
    assert [e["name"] for e in errors] == ["a"]
    assert (restored, ns["b"] is os, ns["c"] is int, ns["d"]) == (3, True, True, {"k": [1]})


def test_same_file_compares_every_byte(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    data = os.urandom(3 * 1024 + 7)
    a.write_bytes(data)
    b.write_bytes(data)
    assert state.same_file(str(a), str(b), chunk=1024)
    b.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert not state.same_file(str(a), str(b), chunk=1024)
    b.write_bytes(data + b"x")
    assert not state.same_file(str(a), str(b), chunk=1024)
    assert not state.same_file(str(a), str(tmp_path / "missing"))


def test_a_restored_state_saved_again_untouched_is_the_same_bytes(tmp_path):
    """What lets a cell that only reads skip storing its state: a state restored and saved
    again with nothing changed is byte for byte the one restored (numbers, a list shared by two
    names, a module, a function reading a global); a change makes it differ."""
    _cloudpickle()
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    ns = {"__name__": "__main__"}
    _cell(ns, "import math\nrows = [1, 2.5, 'x']\nalias = rows\nrate = 3\ndef scaled(v):\n    return v * rate * math.pi\n")
    save_state(ns, {"__name__": "__main__"}, first, 64 << 20, 60.0)
    target = {"__name__": "__main__"}
    load_state(target, first)
    save_state(target, {"__name__": "__main__"}, second, 64 << 20, 60.0)
    assert state.same_file(first, second)
    _cell(target, "alias.append(4)\n")
    save_state(target, {"__name__": "__main__"}, second, 64 << 20, 60.0)
    assert not state.same_file(first, second)
