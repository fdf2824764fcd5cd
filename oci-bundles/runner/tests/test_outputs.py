import base64
import json
import os
import threading

import pytest

from sandq_nb import outputs
from sandq_nb.outputs import Outputs


@pytest.mark.parametrize("mime,expected", [
    ("application/json", True),
    ("application/vnd.plotly.v1+json", True),
    ("application/vnd.dataresource+json", True),
    ("text/plain", False),
    ("application/jsonx", False),
])
def test_is_json_mime(mime, expected):
    assert outputs._is_json_mime(mime) is expected


@pytest.mark.parametrize("mime,expected", [
    ("text/html", True),
    ("image/svg+xml", True),
    ("application/javascript", True),
    ("application/x-latex", True),
    ("application/xml", True),
    ("image/png", False),
    ("application/pdf", False),
])
def test_is_text_mime(mime, expected):
    assert outputs._is_text_mime(mime) is expected


def test_dumps_is_compact_utf8_json():
    text = outputs._dumps({"a": [1, 2.5, None, True], "é": "✓"})
    assert text == '{"a":[1,2.5,null,true],"é":"✓"}'.encode("utf-8")


def test_dumps_odd_values():
    class Array:  # numpy-like: tolist
        def tolist(self):
            return [1, 2]

    class Scalar:  # numpy-scalar-like: item
        def item(self):
            return 7

    class Other:
        def __str__(self):
            return "other!"

    obj = {"b": b"\x00\xff", "s": {3}, "arr": Array(), "sc": Scalar(), "o": Other()}
    assert json.loads(outputs._dumps(obj)) == {
        "b": base64.b64encode(b"\x00\xff").decode("ascii"), "s": [3], "arr": [1, 2],
        "sc": 7, "o": "other!"}


def test_dumps_sanitizes_nan_keys_and_surrogates():
    obj = {1: float("nan"), "inf": [float("inf"), float("-inf"), 1.5], (1, 2): "x\ud800y"}
    line = outputs._dumps(obj)
    # strict JSON: no NaN/Infinity tokens; non-str keys become str(); surrogates become "?"
    assert json.loads(line.decode("utf-8")) == {"1": None, "inf": [None, None, 1.5], "(1, 2)": "x?y"}
    line.decode("utf-8")  # valid UTF-8


def test_sanitize_int_subclass_and_depth():
    class MyInt(int):
        pass

    value = outputs._sanitize(MyInt(5))
    assert value == 5 and type(value) is int
    assert outputs._sanitize(True) is True
    nested = []
    for _ in range(300):
        nested = [nested]
    out = outputs._sanitize(nested)
    depth = 0
    while isinstance(out, list):
        out = out[0]
        depth += 1
    # cut at depth 201 into a str()
    assert depth == 201 and isinstance(out, str)


def _lines(path):
    with open(path, "rb") as f:
        return f.read().split(b"\n")


def test_outputs_appends_one_line_each(tmp_path):
    path = str(tmp_path / "o.jsonl")
    with open(path, "wb") as f:
        f.write(b'{"old":1}\n')
    out = Outputs(path, None)
    out.write({"a": 1})
    out.write({"b": "x"})
    assert _lines(path) == [b'{"old":1}', b'{"a":1}', b'{"b":"x"}', b""]
    assert out.written == len(b'{"a":1}\n') + len(b'{"b":"x"}\n')


def test_outputs_limit_drops_the_first_that_does_not_fit_and_all_later(tmp_path, capfd):
    path = str(tmp_path / "o.jsonl")
    first = {"n": "x" * 10}
    second = {"n": "y" * 20}
    size = lambda o: len(json.dumps(o, separators=(",", ":"))) + 1  # noqa: E731
    limit = size(first) + size(second)
    out = Outputs(path, limit)
    out.write(first)
    out.write(second)  # exactly at the limit: kept
    assert capfd.readouterr().err == ""
    out.write({"n": "z"})  # over
    out.write({})  # small, but after the limit was hit: dropped too
    assert _lines(path) == [json.dumps(first, separators=(",", ":")).encode(),
                            json.dumps(second, separators=(",", ":")).encode(), b""]
    assert out.stopped
    err = capfd.readouterr().err
    assert err == ("sandq: output limit of %d bytes reached: this and all later outputs "
                   "(display data, results, errors) were dropped\n" % limit)


def test_outputs_zero_limit(tmp_path, capfd):
    path = tmp_path / "o.jsonl"
    out = Outputs(str(path), 0)
    out.write({})
    assert path.read_bytes() == b""
    assert "output limit of 0 bytes" in capfd.readouterr().err


def test_outputs_without_path_is_a_no_op(tmp_path):
    out = Outputs(None, 10)
    out.write({"a": 1})
    assert out.fd is None and out.written == 0


def test_outputs_unopenable_path_notes_once(tmp_path, capfd):
    path = str(tmp_path / "missing-dir" / "o.jsonl")
    out = Outputs(path, None)
    out.write({"a": 1})
    err = capfd.readouterr().err
    assert err == "sandq: cannot open outputs file %s: %s; outputs are not saved\n" % (
        path, os.strerror(2))


def test_outputs_flushes_stdout_first(tmp_path, capfd):
    import sys
    path = str(tmp_path / "o.jsonl")
    out = Outputs(path, None)
    sys.stdout.write("pending")  # buffered
    out.write({})
    assert capfd.readouterr().out == "pending"


def test_outputs_threads_do_not_interleave(tmp_path):
    path = str(tmp_path / "o.jsonl")
    out = Outputs(path, None)
    payload = {"x": "y" * 5000}

    def work():
        for _ in range(50):
            out.write(payload)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = _lines(path)
    assert lines[-1] == b"" and len(lines) == 201
    assert all(json.loads(line) == payload for line in lines[:-1])
