"""Paths and small helpers shared by the runner's modules."""

import os
import sys

# This package's directory, and the runner's (where the entry file sandq_runner.py and
# sandq_mpl.py are: /sandq in the sandbox).
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
RUNNER_DIR = os.path.dirname(PACKAGE_DIR)
RUNNER_FILE = os.path.join(RUNNER_DIR, "sandq_runner.py")
MPL_FILE = os.path.join(RUNNER_DIR, "sandq_mpl.py")

MPL_BACKEND = "module://sandq_mpl"
PLOTLY_MIME = "application/vnd.plotly.v1+json"


def write_fd2(text):
    """Writes straight to fd 2 (not through sys.stderr, which user code may replace), after
    flushing what sys.stderr buffered, so that the order on the stream is kept."""
    try:
        sys.stderr.flush()
    except Exception:
        pass
    try:
        os.write(2, text.encode("utf-8", "replace"))
    except OSError:
        pass


def note(msg):
    """A runner message on fd 2."""
    write_fd2("sandq: " + msg + "\n")


def safe_repr(obj):
    try:
        return repr(obj)
    except Exception:
        try:
            return object.__repr__(obj)
        except Exception:
            return "<unrepresentable object>"


def safe_str(obj):
    try:
        return str(obj)
    except Exception:
        return "<exception str() failed>"
