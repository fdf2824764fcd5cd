import traceback

import pytest

from sandq_nb import run, tracebacks


def test_decode_source_like_python():
    assert run._decode_source(b"\xef\xbb\xbfx = 1\r\ny = 2\rz = 3\r\n", "s.py") == "x = 1\ny = 2\nz = 3\n"
    latin = b"# -*- coding: latin-1 -*-\ns = '\xe9'\n"
    assert run._decode_source(latin, "s.py") == "# -*- coding: latin-1 -*-\ns = '\u00e9'\n"


def test_decode_source_error_is_a_clean_syntax_error():
    with pytest.raises(SyntaxError) as info:
        run._decode_source(b"s = '\xff'\n", "/x/s.py")
    error = info.value
    assert error.filename == "/x/s.py" and error.lineno == 1
    assert "can't decode byte 0xff" in error.msg
    assert error.__context__ is None
    # the only frame left is the runner's own: hidden in the traceback the user sees
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != __file__]
    assert [f.name for f in frames] == ["_decode_source"]
    assert all(tracebacks._internal_file(f.filename) for f in frames)


@pytest.mark.parametrize("raw,expected,noted", [
    (None, None, False), ("", None, False), (" 100 ", 100, False), ("-5", 0, False), ("1e3", None, True),
])
def test_output_limit(monkeypatch, capfd, raw, expected, noted):
    if raw is None:
        monkeypatch.delenv("SANDQ_OUTPUT_LIMIT", raising=False)
    else:
        monkeypatch.setenv("SANDQ_OUTPUT_LIMIT", raw)
    assert run._output_limit() == expected
    err = capfd.readouterr().err
    assert err == ("sandq: ignoring SANDQ_OUTPUT_LIMIT='1e3' (not an integer)\n" if noted else "")


@pytest.mark.parametrize("status,code,stderr", [
    (0, 0, ""),
    (2, 2, ""),
    (SystemExit(), 0, ""),
    (SystemExit(None), 0, ""),
    (SystemExit(3), 3, ""),
    (SystemExit(256 + 7), 7, ""),
    (SystemExit(-1), 255, ""),
    (SystemExit("bye"), 1, "bye\n"),
    (SystemExit(["a"]), 1, "['a']\n"),
])
def test_exit_code_like_python(capsys, status, code, stderr):
    assert run._exit_code(status) == code
    assert capsys.readouterr().err == stderr
