"""The cell's run: main() (a cold or warm start, the script, the session state, the error
output) and the process exit (start(), _finish)."""

import os
import sys

from . import tracebacks, warm as _warm
from .common import RUNNER_DIR as _RUNNER_DIR, note as _note, safe_str as _safe_str, write_fd2 as _write_fd2
from .imports import SandqFinder, _lazy_ipython_package
from .outputs import Outputs
from .shell import make_shell
from .state import _env_number, _reason, load_state, same_file, save_state
from .tracebacks import error_output, format_exception_lines

_T0 = None  # set by SANDQ_RUNNER_TIMING


def _decode_source(raw, filename):
    """Source text like python decodes a script (BOM, coding cookie, universal newlines).
    Raises SyntaxError like python does for undecodable files."""
    import importlib.util
    try:
        return importlib.util.decode_source(raw)
    except (SyntaxError, UnicodeDecodeError):
        pass
    import ast
    try:  # let the compiler report it the way python does
        compile(raw, filename, "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
    except SyntaxError as exc:
        error = exc
    else:
        error = SyntaxError("cannot decode source file %s" % filename)
    error.__context__ = None
    raise error.with_traceback(None)


def _output_limit():
    value = os.environ.get("SANDQ_OUTPUT_LIMIT", "").strip()
    if not value:
        return None
    try:
        return max(0, int(value))
    except ValueError:
        _note("ignoring SANDQ_OUTPUT_LIMIT=%r (not an integer)" % value)
        return None


def _flush_figures():
    if "matplotlib.pyplot" not in sys.modules:
        return
    try:
        import sandq_mpl
        sandq_mpl.flush_figures()
    except Exception as exc:
        _note("could not capture figures: %s: %s" % (type(exc).__name__, exc))


def main():
    forked = sys.argv[1:2] == ["--template"]
    warm = forked or sys.argv[1:2] == ["--warm"]
    if warm:
        script_arg = _warm.WARM_SCRIPT
    elif len(sys.argv) < 2:
        sys.stderr.write("usage: sandq_runner.py <script> [args...] | --warm | --template\n")
        return 2
    else:
        script_arg = sys.argv[1]
    script = os.path.abspath(script_arg)

    # plain-python process state for the user's code
    script_dir = os.path.dirname(os.path.realpath(script_arg))
    if sys.path and os.path.realpath(sys.path[0] or ".") == os.path.realpath(_RUNNER_DIR):
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)
    sys.meta_path.insert(0, SandqFinder())
    if warm:
        # After the finder: matplotlib imported here must get the sandq backend, as it does
        # when the cell imports it.
        _warm._preload()

    import builtins
    import types
    site_exit = {name: getattr(builtins, name) for name in ("exit", "quit")
                 if hasattr(builtins, name)}

    user_module = types.ModuleType("__main__")
    user_module.__file__ = script
    user_module.__cached__ = None
    global _USER_MODULE
    _USER_MODULE = user_module

    # A template has no outputs file: each forked job opens its own once in its sandbox.
    outputs = Outputs(None if forked else os.environ.get("SANDQ_OUTPUTS") or None, _output_limit())
    _lazy_ipython_package()
    shell = make_shell(script, outputs, user_module)
    ns = shell.user_ns
    ns.pop("open", None)  # IPython's wrapper refuses open(0/1/2)
    for name in ("exit", "quit"):  # site's exit() raises SystemExit like in a script
        if name in site_exit:
            ns[name] = site_exit[name]
        else:
            ns.pop(name, None)
    ns["__file__"] = script
    try:
        import atexit
        atexit.unregister(shell.atexit_operations)
    except Exception:
        pass

    # What the runner (and a warm sandbox's preload) made lives as long as the process: out of
    # the collector's sight (gc.freeze), so that the collection at exit (_finish) scans only
    # the program's own objects: ~70 ms less with numpy, pandas and matplotlib loaded.
    import gc
    if warm:
        gc.collect()  # the warm-up's garbage, while no job waits
    gc.freeze()

    if forked:
        from . import template
        template.serve()  # returns in the job's process, inside its sandbox
        args = _warm._wait_for_handover()  # then waits for its job as a warm runner
        outputs.open(os.environ.get("SANDQ_OUTPUTS") or None, _output_limit())
    else:
        args = _warm._wait_for_handover() if warm else sys.argv[2:]
    sys.argv = [script_arg] + args
    # A job for another service's programs (`compat`): its working directory (the same
    # directory as /work) and PIL's saving images displayed (docs/e2b.md).
    workdir = os.environ.get("SANDQ_WORKDIR")
    if workdir:
        try:
            script_arg = os.path.abspath(script_arg)
            os.chdir(workdir)
        except OSError:
            pass
    if os.environ.get("SANDQ_PIL_SAVE_DISPLAYS"):
        from .imports import displaying_image_save
        displaying_image_save()

    try:
        with open(script_arg, "rb") as f:
            raw_source = f.read()
    except OSError as exc:
        message = "%s: can't open file %r: [Errno %s] %s" % (
            os.path.basename(sys.executable or "python3"), script, exc.errno, exc.strerror)
        sys.stderr.write(message + "\n")
        outputs.write({"output_type": "error", "ename": type(exc).__name__,
                       "evalue": _safe_str(exc), "traceback": [message]})
        return 2
    decode_error = None
    try:
        source = _decode_source(raw_source, script)
    except SyntaxError as exc:
        source = None
        decode_error = exc

    # Session state: restore the previous cell's variables, number this cell.
    baseline = dict(ns)
    state_out = os.environ.get("SANDQ_STATE_OUT")
    state_report = {"restored": 0, "not_restored": []}
    state_in = os.environ.get("SANDQ_STATE_IN")
    if state_in:
        import time
        t_restore = time.monotonic()
        state_report["restored"], state_report["not_restored"] = load_state(
            ns, state_in,
            _env_number("SANDQ_STATE_RESTORE_TIME_LIMIT", 30.0, float),
            _env_number("SANDQ_STATE_RESTORE_VARIABLE_LIMIT", 10.0, float))
        state_report["restore_ms"] = int((time.monotonic() - t_restore) * 1000)
    shell.execution_count = max(1, _env_number("SANDQ_EXECUTION_COUNT", 1))

    if _T0 is not None:
        import time
        _note("runner ready after %.3f s" % (time.perf_counter() - _T0))

    if source is None:
        error = decode_error
    else:
        lines = source.splitlines()
        first = next((i for i, line in enumerate(lines) if line.strip()), None)
        if first is not None and lines[first].startswith("%%"):
            tracebacks.CELL_MAGIC_LINES = first + 1
        result = shell.run_cell(source, store_history=True)
        error = result.error_before_exec or result.error_in_exec
        if error is None and shell.caught_errors:
            # The cell's code failed inside a magic that caught it (%%time, %%capture, %run):
            # the job fails with that exception, as the cell without the magic would.
            error = shell.caught_errors[-1]

    _flush_figures()

    if state_out:
        # The cell ended by itself (a timeout, OOM kill or cancel never gets here): save.
        try:
            state_report.update(save_state(
                ns, baseline, state_out,
                _env_number("SANDQ_STATE_LIMIT", 64 << 20),
                _env_number("SANDQ_STATE_TIME_LIMIT", 20.0, float)))
            # A state byte for byte the one restored is not handed back: the worker keeps the
            # session's previous one, with no hashing or storing (a cell that only reads).
            if state_in and not state_report["not_restored"] and same_file(state_out, state_in):
                os.remove(state_out)
                state_report["unchanged"] = True
        except Exception as exc:
            _note("could not save the session state: " + _reason(exc))
        report_path = os.environ.get("SANDQ_STATE_REPORT")
        if report_path:
            import json
            try:
                with open(report_path, "w") as f:
                    json.dump(state_report, f)
            except Exception as exc:
                _note("could not write the state report: " + _reason(exc))

    if isinstance(error, SystemExit):
        return error  # handled by python itself: code, message to stderr, status
    if error is None:
        return 0
    outputs.write(error_output(error, script))
    if id(error) not in shell.printed_errors:
        _write_fd2("\n".join(format_exception_lines(error, script)) + "\n")
    return 130 if isinstance(error, KeyboardInterrupt) else 1


def _exit_code(status):
    """The process status python itself would give `status` (an int or a SystemExit), writing
    a SystemExit's non-integer message to stderr as python does."""
    if not isinstance(status, SystemExit):
        return status
    code = status.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write("%s\n" % (code,))
    except Exception:
        pass
    return 1


def _finish(status):
    """Ends the process as python's own shutdown would, minus the teardown of every module
    (about 0.2 s with numpy, pandas and matplotlib loaded): wait for the program's non-daemon
    threads, run its atexit callbacks, drop its namespace and collect (so that files it left
    open are flushed and closed), flush the standard streams, then _exit."""
    import gc
    import threading
    code = _exit_code(status)
    try:
        threading._shutdown()
    except Exception:
        pass
    try:
        import atexit
        atexit._run_exitfuncs()
    except BaseException:
        pass
    main_module = sys.modules.get("__main__")
    for module in [m for m in (_USER_MODULE, main_module) if m is not None]:
        try:
            module.__dict__.clear()
        except Exception:
            pass
    try:
        gc.collect()
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


_USER_MODULE = None  # the cell's namespace, set by main()


def start():
    """The entry point (sandq_runner.py): runs main() and ends the process with its status."""
    global _T0
    if os.environ.get("SANDQ_RUNNER_TIMING"):
        import time
        _T0 = time.perf_counter()
    _finish(main())
