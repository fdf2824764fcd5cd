"""Session state: the variables, functions, classes and imports a cell leaves, pickled for
the next job of the session (by value for what the cell defined: cloudpickle), and loaded
back before that job's cell runs. Written and read only inside sandboxes of the session."""

import os

from .common import safe_str as _safe_str


_STATE_SKIP = {"In", "Out", "get_ipython", "exit", "quit", "open"}
_STATE_MAX_LISTED = 1000
_STATE_MAX_UNSAVED_LISTED = 100


class _StateTooLarge(Exception):
    pass


class _CappedFile:
    """A write-only file that raises _StateTooLarge past `limit` bytes, so that a huge object
    is abandoned while it is being pickled rather than after it filled the memory."""

    def __init__(self, f, limit):
        self.f = f
        self.left = limit

    def write(self, data):
        n = len(data)
        if n > self.left:
            raise _StateTooLarge()
        self.left -= n
        return self.f.write(data)


def _pickler_module():
    try:
        import cloudpickle
        return cloudpickle
    except ImportError:
        pass
    try:
        from joblib.externals import cloudpickle
        return cloudpickle
    except ImportError:
        import pickle
        return pickle


def _reason(exc):
    return ("%s: %s" % (type(exc).__name__, _safe_str(exc)))[:200]


def load_state(ns, path):
    """Loads the state at `path` into `ns`; returns (restored count, [not restored])."""
    import pickle
    not_restored = []
    try:
        with open(path, "rb") as f:
            saved = pickle.load(f)
        variables = saved["variables"]
    except FileNotFoundError:
        return 0, []
    except Exception as exc:
        return 0, [{"name": "*", "reason": "the saved state cannot be read: " + _reason(exc)}]
    restored = 0
    for name, blob in variables.items():
        try:
            ns[name] = pickle.loads(blob)
            restored += 1
        except Exception as exc:
            not_restored.append({"name": name, "reason": _reason(exc)})
    return restored, not_restored


def save_state(ns, baseline, path, limit, seconds):
    """Pickles the user's variables in `ns` (not the shell's own: `baseline`) to `path`, each on
    its own so that one bad object only leaves itself out, within `limit` bytes and `seconds`.
    Returns the report (names saved, left out with reasons, bytes, ms)."""
    import io
    import pickle
    import time
    t0 = time.monotonic()
    module = _pickler_module()
    saved, unsaved, total = {}, [], 0
    for name in sorted(ns):
        value = ns[name]
        if name.startswith("_") or name in _STATE_SKIP:
            continue
        if name in baseline and baseline[name] is value:
            continue
        if time.monotonic() - t0 > seconds:
            unsaved.append({"name": name, "reason": "over the time cap of %gs" % seconds})
            continue
        if isinstance(value, io.IOBase):
            # cloudpickle would save a file's content and bring back a copy: not the open file.
            unsaved.append({"name": name, "reason": "an open file cannot be saved"})
            continue
        buf = io.BytesIO()
        try:
            # Importable modules, functions and classes go by reference (re-imported on load);
            # what the cells defined goes by value.
            module.dump(value, _CappedFile(buf, limit - total), protocol=pickle.HIGHEST_PROTOCOL)
        except _StateTooLarge:
            unsaved.append({"name": name, "reason": "over the size cap of %d bytes" % limit})
            continue
        except BaseException as exc:  # anything the object's __reduce__ raises
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            unsaved.append({"name": name, "reason": _reason(exc)})
            continue
        blob = buf.getvalue()
        saved[name] = blob
        total += len(blob)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump({"version": 1, "variables": saved}, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)
    return {
        "variables": list(saved)[:_STATE_MAX_LISTED],
        "unsaved": unsaved[:_STATE_MAX_UNSAVED_LISTED],
        "bytes": os.path.getsize(path),
        "save_ms": int((time.monotonic() - t0) * 1000),
    }


def _env_number(name, default, kind=int):
    value = os.environ.get(name, "").strip()
    try:
        return kind(value) if value else default
    except ValueError:
        return default
