"""Tracebacks: plain lines like python prints them, without the runner's frames (any module
of this package, the entry file, sandq_mpl) and IPython's."""

import os

from . import common
from .common import safe_str as _safe_str


def _internal_file(filename):
    if not filename:
        return False
    if filename in (common.RUNNER_FILE, common.MPL_FILE):
        return True
    for prefix in INTERNAL_PREFIXES:
        if filename.startswith(prefix):
            return True
    return False


# Directories whose files are internal: this package's, and IPython's (added by make_shell).
INTERNAL_PREFIXES = [common.PACKAGE_DIR + os.sep]

# Lines of the script up to and including its cell magic (`%%time` on line 1: 1), else 0.
# Set by run.main before the cell runs; read here and by the shell's compiler.
CELL_MAGIC_LINES = 0


def _filter_te(te, script, seen):
    """Hide runner/IPython frames: keep frames from the first frame in the user's script
    on (library frames the user called stay); without such a frame, drop internal
    frames.  Also drop column carets, recursively through chained exceptions."""
    import traceback
    if te is None or id(te) in seen:
        return
    seen.add(id(te))
    frames = list(te.stack)
    first = next((i for i, fs in enumerate(frames) if fs.filename == script), None)
    if first is not None:
        frames = frames[first:]
    # Also between the user's frames: a magic (%%time, %run...) runs the user's code through
    # IPython's frames.
    frames = [fs for fs in frames if not _internal_file(fs.filename)]
    if CELL_MAGIC_LINES:
        # A cell magic ran the cell's body under a name of IPython's (`<timed exec>` for
        # %%time, `<ipython-input-...>` for a body run as a cell): the body starts after the
        # magic's line, so these are the script's lines, shifted.
        for fs in frames:
            if fs.filename == "<timed exec>" or fs.filename.startswith("<ipython-input-"):
                fs.filename = script
                fs.lineno += CELL_MAGIC_LINES
                if getattr(fs, "end_lineno", None) is not None:
                    fs.end_lineno += CELL_MAGIC_LINES
                for cached in ("_lines", "_lines_dedented", "_line"):  # read again, from the script
                    try:
                        setattr(fs, cached, None)
                    except AttributeError:
                        pass
    for fs in frames:
        try:
            fs.colno = None
            fs.end_colno = None
        except Exception:
            pass
    te.stack = traceback.StackSummary.from_list(frames)
    _filter_te(te.__cause__, script, seen)
    _filter_te(te.__context__, script, seen)
    for sub in getattr(te, "exceptions", None) or ():
        _filter_te(sub, script, seen)


def format_exception_lines(exc, script):
    """Plain-text traceback lines (no newlines, no ANSI) like plain python prints."""
    import traceback
    try:
        te = traceback.TracebackException.from_exception(exc, compact=True)
        _filter_te(te, script, set())
        text = "".join(te.format())
    except Exception:
        text = "%s: %s\n" % (type(exc).__name__, _safe_str(exc))
    return text.rstrip("\n").split("\n")


def error_output(exc, script):
    lines = format_exception_lines(exc, script)
    return {"output_type": "error", "ename": type(exc).__name__,
            "evalue": _safe_str(exc), "traceback": lines}
