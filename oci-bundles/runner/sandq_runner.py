"""sandq notebook runner.

    python3 sandq_runner.py <script> [args...]

Runs the whole script as ONE IPython cell (like a Jupyter notebook cell, without a
kernel) and appends each rich output as one JSON line to $SANDQ_OUTPUTS:

    {"output_type": "execute_result", "data": {...}, "metadata": {...}}
    {"output_type": "display_data", "data": {...}, "metadata": {...}}
    {"output_type": "error", "ename": ..., "evalue": ..., "traceback": [lines]}

stdout/stderr of the user's code go to fd 1 / fd 2 unchanged.  Exit status follows
plain python: 0, 1 after an uncaught exception, or the sys.exit() code.

This file is only the entry point: the runner is the package `sandq_nb/` next to it
(and `sandq_mpl.py`, the matplotlib backend). See README.md next to this file.
"""

import os
import sys

# Keep this module alive: IPython replaces sys.modules["__main__"] with the user's module.
_THIS_MODULE = sys.modules.get(__name__)


def _load():
    """Imports the runner package from this file's directory, whatever sys.path is (python
    -P / PYTHONSAFEPATH leave the directory out) and whatever else it holds; sys.path is
    left as it was (run.main puts the script's directory first, as plain python does)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    try:
        from sandq_nb import run
    finally:
        del sys.path[0]
    return run


if __name__ == "__main__":
    _load().start()
