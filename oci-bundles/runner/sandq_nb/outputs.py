"""The outputs file: one JSON object a line appended to $SANDQ_OUTPUTS, within
$SANDQ_OUTPUT_LIMIT bytes."""

import os
import sys

from .common import note as _note, safe_str as _safe_str


def _is_json_mime(mime):
    return mime == "application/json" or mime.endswith("+json")


def _is_text_mime(mime):
    return (mime.startswith("text/") or mime.endswith("+xml")
            or mime in ("application/javascript", "application/ecmascript",
                        "application/xml", "application/x-latex"))


def _b64(data):
    import base64
    return base64.b64encode(bytes(data)).decode("ascii")


def _json_default(o):
    if isinstance(o, (bytes, bytearray, memoryview)):
        return _b64(o)
    if isinstance(o, (set, frozenset)):
        return list(o)
    for attr in ("tolist", "item"):  # numpy arrays and scalars
        fn = getattr(type(o), attr, None)
        if fn is not None:
            try:
                return fn(o)
            except Exception:
                pass
    return _safe_str(o)


def _sanitize(o, depth=0):
    """Make o strictly JSON-serialisable (no NaN/Infinity, str keys, no odd objects)."""
    if depth > 200:
        return _safe_str(o)
    if o is None or isinstance(o, (bool, int, str)):
        if isinstance(o, int) and not isinstance(o, bool) and type(o) is not int:
            return int(o)
        return o
    if isinstance(o, float):
        return o if o == o and o not in (float("inf"), float("-inf")) else None
    if isinstance(o, dict):
        return {(k if isinstance(k, str) else _safe_str(k)): _sanitize(v, depth + 1)
                for k, v in list(o.items())}
    if isinstance(o, (list, tuple)):
        return [_sanitize(v, depth + 1) for v in list(o)]
    converted = _json_default(o)
    if converted is o or isinstance(converted, str):
        return converted if isinstance(converted, str) else _safe_str(o)
    return _sanitize(converted, depth + 1)


def _dumps(obj):
    import json
    try:
        text = json.dumps(obj, ensure_ascii=False, allow_nan=False,
                          separators=(",", ":"), default=_json_default)
    except (ValueError, TypeError, RecursionError):
        text = json.dumps(_sanitize(obj), ensure_ascii=False, allow_nan=False,
                          separators=(",", ":"), default=_safe_str)
    # lone surrogates cannot be encoded: replace them
    return text.encode("utf-8", "replace")


class Outputs:
    """Appends one JSON line per output to $SANDQ_OUTPUTS, within $SANDQ_OUTPUT_LIMIT."""

    def __init__(self, path, limit):
        import threading
        self.fd = None
        self.path = path
        self.limit = limit
        self.written = 0
        self.stopped = False
        self.lock = threading.Lock()
        self.open(path, limit)

    def open(self, path, limit):
        """Opens `path` for appending (None: outputs are not saved), within `limit` bytes."""
        self.path = path
        self.limit = limit
        if path:
            try:
                self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                _note("cannot open outputs file %s: %s; outputs are not saved" % (path, exc.strerror))

    def write(self, obj):
        if self.fd is None or self.stopped:
            return
        # so that text printed before this output is out before it
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        line = _dumps(obj) + b"\n"
        with self.lock:
            if self.stopped:
                return
            if self.limit is not None and self.written + len(line) > self.limit:
                self.stopped = True
                _note("output limit of %d bytes reached: this and all later outputs "
                      "(display data, results, errors) were dropped" % self.limit)
                return
            try:
                view = memoryview(line)
                while view:
                    n = os.write(self.fd, view)
                    view = view[n:]
            except OSError as exc:
                self.stopped = True
                _note("cannot write outputs file: %s; later outputs are dropped" % exc.strerror)
                return
            self.written += len(line)

