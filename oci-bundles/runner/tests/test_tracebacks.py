import os
import subprocess
import sys
import textwrap

import pytest

from sandq_nb import common, tracebacks
from sandq_nb.tracebacks import error_output, format_exception_lines


def _python_stderr(script):
    """What plain python prints for the script, without column carets (-X no_debug_ranges):
    the reference the runner's tracebacks follow."""
    proc = subprocess.run([sys.executable, "-X", "no_debug_ranges", script], capture_output=True,
                          text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 1
    return proc.stderr.rstrip("\n").split("\n")


def _run_here(script):
    """Runs the script in this process (as the shell would: compiled with its path) and
    returns the exception it raised."""
    with open(script) as f:
        code = compile(f.read(), script, "exec")
    try:
        exec(code, {"__name__": "__main__", "__file__": script})
    except BaseException as exc:  # noqa: B902
        return exc
    raise AssertionError("the script did not raise")


SCRIPTS = {
    "nested": """
        def inner(x):
            return {}[x]

        def outer():
            return inner("key")

        outer()
    """,
    "chained": """
        import json

        def parse(text):
            try:
                return json.loads(text)
            except ValueError as exc:
                raise RuntimeError("bad input") from exc

        try:
            parse("{")
        except RuntimeError:
            x = 1 / 0
    """,
    "library_frames_kept": """
        import json
        json.loads("[1, 2")
    """,
    "group": """
        def f():
            raise ExceptionGroup("many", [ValueError("a"), TypeError("b")])
        f()
    """,
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_matches_plain_python(tmp_path, name):
    if name == "group" and sys.version_info < (3, 11):
        pytest.skip("ExceptionGroup is 3.11+")
    script = str(tmp_path / "main.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(SCRIPTS[name]).lstrip("\n"))
    exc = _run_here(script)
    lines = format_exception_lines(exc, script)
    assert lines == _python_stderr(script)
    # this test's own frame (exec) is left out: the first frame is the script's
    first = next(line for line in lines if line.lstrip(" |").startswith("File "))
    assert first.lstrip(" |").startswith('File "%s", line ' % script)
    assert __file__ not in "\n".join(lines)
    assert not any(line.strip() and set(line.strip()) <= set("^~") for line in lines)


def test_internal_file():
    assert tracebacks._internal_file(common.RUNNER_FILE)
    assert tracebacks._internal_file(common.MPL_FILE)
    for module in ("run.py", "shell.py", "state.py", "anything_new.py"):
        assert tracebacks._internal_file(os.path.join(common.PACKAGE_DIR, module))
    assert tracebacks._internal_file(tracebacks.__file__)
    assert not tracebacks._internal_file(os.path.join(common.RUNNER_DIR, "main.py"))
    assert not tracebacks._internal_file(common.PACKAGE_DIR + "_other/x.py")
    assert not tracebacks._internal_file("")
    assert not tracebacks._internal_file(None)


def test_package_frames_between_user_frames_are_hidden(tmp_path):
    """A runner module calling back into the user's code (a formatter, a magic): its frame is
    not shown, the user's frames around it are."""
    script = str(tmp_path / "main.py")
    with open(script, "w") as f:
        f.write("def cb():\n    raise KeyError('k')\n\nrun_via_runner(cb)\n")
    runner_code = compile("def call(fn):\n    return fn()\n",
                          os.path.join(common.PACKAGE_DIR, "somewhere.py"), "exec")
    runner_ns = {}
    exec(runner_code, runner_ns)
    with open(script) as f:
        code = compile(f.read(), script, "exec")
    try:
        exec(code, {"run_via_runner": runner_ns["call"]})
    except KeyError as exc:
        lines = format_exception_lines(exc, script)
    assert lines == [
        "Traceback (most recent call last):",
        '  File "%s", line 4, in <module>' % script,
        "    run_via_runner(cb)",
        '  File "%s", line 2, in cb' % script,
        "    raise KeyError('k')",
        "KeyError: 'k'",
    ]


def test_without_a_script_frame_internal_frames_are_dropped(tmp_path):
    runner_code = compile("def fail():\n    raise ValueError('runner side')\n",
                          os.path.join(common.PACKAGE_DIR, "x.py"), "exec")
    ns = {}
    exec(runner_code, ns)
    try:
        ns["fail"]()
    except ValueError as exc:
        lines = format_exception_lines(exc, str(tmp_path / "main.py"))
    # only this test's frame is left (not the runner's, not the script's)
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: runner side"
    assert not any("x.py" in line for line in lines)
    assert sum(line.startswith("  File ") for line in lines) == 1
    assert lines[1].startswith('  File "%s"' % __file__)


def test_cell_magic_frames_are_mapped_to_the_script(tmp_path, monkeypatch):
    """%%time runs the cell's body as `<timed exec>`: its lines are the script's, shifted by the
    magic's line."""
    script = str(tmp_path / "main.py")
    with open(script, "w") as f:
        f.write("%%time\nx = 1\ny = x / 0\n")
    body = compile("x = 1\ny = x / 0\n", "<timed exec>", "exec")
    try:
        exec(body, {})
    except ZeroDivisionError as exc:
        error = exc
    monkeypatch.setattr(tracebacks, "CELL_MAGIC_LINES", 1)
    assert format_exception_lines(error, script)[-3:] == [
        '  File "%s", line 3, in <module>' % script,
        "    y = x / 0",
        "ZeroDivisionError: division by zero",
    ]


def test_syntax_error_like_python(tmp_path):
    script = str(tmp_path / "main.py")
    with open(script, "w") as f:
        f.write("x = 1\nprint((x +)\n")
    try:
        compile(open(script).read(), script, "exec")
    except SyntaxError as exc:
        error = exc.with_traceback(None)
    assert format_exception_lines(error, script) == _python_stderr(script)


def test_error_output():
    try:
        raise OSError(2, "gone")
    except OSError as exc:
        out = error_output(exc, "/nowhere.py")
    assert out["output_type"] == "error"
    assert out["ename"] == "FileNotFoundError"
    assert out["evalue"] == "[Errno 2] gone"
    assert out["traceback"][-1] == "FileNotFoundError: [Errno 2] gone"
    assert list(out) == ["output_type", "ename", "evalue", "traceback"]
