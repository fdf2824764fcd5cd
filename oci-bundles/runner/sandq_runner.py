"""sandq notebook runner.

    python3 sandq_runner.py <script> [args...]

Runs the whole script as ONE IPython cell (like a Jupyter notebook cell, without a
kernel) and appends each rich output as one JSON line to $SANDQ_OUTPUTS:

    {"output_type": "execute_result", "data": {...}, "metadata": {...}}
    {"output_type": "display_data", "data": {...}, "metadata": {...}}
    {"output_type": "error", "ename": ..., "evalue": ..., "traceback": [lines]}

stdout/stderr of the user's code go to fd 1 / fd 2 unchanged.  Exit status follows
plain python: 0, 1 after an uncaught exception, or the sys.exit() code.
See README.md next to this file.
"""

import os
import sys

_T0 = None  # set by SANDQ_RUNNER_TIMING

_RUNNER_FILE = os.path.abspath(__file__)
_RUNNER_DIR = os.path.dirname(_RUNNER_FILE)
_MPL_BACKEND = "module://sandq_mpl"
_PLOTLY_MIME = "application/vnd.plotly.v1+json"

MD_MAX_ROWS = 50
MD_MAX_COLS = 20
MD_MAX_CELL = 200

# Keep this module alive: IPython replaces sys.modules["__main__"] with the user's module.
_THIS_MODULE = sys.modules.get(__name__)


# --------------------------------------------------------------------------------------
# small helpers


def _write_fd2(text):
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


def _note(msg):
    """A runner message on fd 2."""
    _write_fd2("sandq: " + msg + "\n")


def _safe_repr(obj):
    try:
        return repr(obj)
    except Exception:
        try:
            return object.__repr__(obj)
        except Exception:
            return "<unrepresentable object>"


def _safe_str(obj):
    try:
        return str(obj)
    except Exception:
        return "<exception str() failed>"


# --------------------------------------------------------------------------------------
# output file


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


# --------------------------------------------------------------------------------------
# MIME bundles


def _png_size_b64(value):
    """(w, h) of a PNG given as bytes or base64 text, or None."""
    import struct
    try:
        if isinstance(value, str):
            import base64
            head = base64.b64decode(value[:44].encode("ascii"))
        else:
            head = bytes(value[:24])
        if len(head) >= 24 and head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR":
            return struct.unpack(">II", head[16:24])
    except Exception:
        pass
    return None


def _plotly_summary(fig):
    try:
        traces = fig.get("data") or []
        kinds = []
        for t in traces:
            kind = t.get("type", "scatter") if isinstance(t, dict) else "?"
            if kind not in kinds:
                kinds.append(str(kind))
        text = "<plotly Figure: %d trace%s" % (len(traces), "" if len(traces) == 1 else "s")
        if kinds:
            text += " (" + ", ".join(kinds) + ")"
        title = (fig.get("layout") or {}).get("title")
        if isinstance(title, dict):
            title = title.get("text")
        if title:
            text += ", title " + repr(str(title))
        return text + ">"
    except Exception:
        return "<plotly Figure>"


def _plotly_html(fig):
    try:
        import plotly.io as pio
        config = fig.get("config") if isinstance(fig, dict) else None
        return pio.to_html(fig, config=config, full_html=False, include_plotlyjs="cdn",
                           validate=False)
    except Exception as exc:
        _note("could not make text/html for a plotly figure: %s: %s" % (type(exc).__name__, exc))
        return None


def normalize_bundle(data, metadata):
    """Convert a MIME bundle to the JSON form: text as str, binary as base64 str,
    JSON types as JSON values.  Adds text/html + text/plain to plotly bundles and
    width/height metadata to PNGs that lack it."""
    out = {}
    if not isinstance(data, dict):
        data = {"text/plain": _safe_repr(data)}
    for mime, value in list(data.items()):
        if not isinstance(mime, str):
            continue
        try:
            if _is_json_mime(mime):
                if isinstance(value, (bytes, bytearray)):
                    value = bytes(value).decode("utf-8", "replace")
                if isinstance(value, str):
                    import json
                    try:
                        value = json.loads(value)
                    except ValueError:
                        pass
                out[mime] = value
            elif isinstance(value, (bytes, bytearray, memoryview)):
                out[mime] = (bytes(value).decode("utf-8", "replace") if _is_text_mime(mime)
                             else _b64(value))
            elif isinstance(value, str):
                out[mime] = value
            else:
                out[mime] = _safe_str(value)
        except Exception as exc:
            _note("dropped %s data: %s: %s" % (mime, type(exc).__name__, exc))
    md = dict(metadata) if isinstance(metadata, dict) else {}

    fig = out.get(_PLOTLY_MIME)
    if isinstance(fig, dict):
        if "text/html" not in out:
            html = _plotly_html(fig)
            if html is not None:
                out["text/html"] = html
        if "text/plain" not in out:
            out["text/plain"] = _plotly_summary(fig)

    if "image/png" in out and not isinstance(md.get("image/png"), dict):
        size = _png_size_b64(out["image/png"])
        if size:
            md["image/png"] = {"width": size[0], "height": size[1]}
    return out, md


# --------------------------------------------------------------------------------------
# pandas / matplotlib formatters (registered by type name: nothing is imported early)


def _md_escape(text):
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "<br>")
    text = text.replace("|", "\\|").replace("<", "\\<")  # no raw HTML tags (<NA>)
    if len(text) > MD_MAX_CELL:
        text = text[:MD_MAX_CELL - 1] + "…"
    return text


def _md_value(v):
    try:
        if v is None:
            return "None"
        if isinstance(v, float) or type(v).__name__.startswith("float"):
            f = float(v)
            if f != f:
                return "NaN"
            if f in (float("inf"), float("-inf")):
                return "inf" if f > 0 else "-inf"
            if f.is_integer() and abs(f) < 1e16:
                return "%.1f" % f
            if 1e-4 <= abs(f) < 1e16:
                return ("%.6f" % f).rstrip("0").rstrip(".")
            return "%.6g" % f
        if isinstance(v, tuple):
            return ", ".join(_md_value(x) for x in v)
        return str(v)
    except Exception:
        return _safe_repr(v)


def _md_label(v):
    if isinstance(v, tuple):
        return " / ".join(_md_value(x) for x in v)
    return _md_value(v)


def frame_markdown(df, max_rows=MD_MAX_ROWS, max_cols=MD_MAX_COLS):
    """GitHub-style markdown table of a DataFrame: index first, capped rows/columns."""
    nrows, ncols = len(df.index), len(df.columns)
    sub = df.iloc[:max_rows, :max_cols]
    names = [n for n in sub.index.names]
    index_header = " / ".join("" if n is None else _md_value(n) for n in names)
    if not index_header.strip(" /"):
        index_header = ""
    header = [index_header] + [_md_label(c) for c in sub.columns]
    align = ["---"]
    for i in range(sub.shape[1]):
        kind = getattr(sub.dtypes.iloc[i], "kind", "O")
        align.append("---:" if kind in "iufc" else "---")
    lines = ["| " + " | ".join(_md_escape(h) for h in header) + " |",
             "|" + "|".join(align) + "|"]
    for label, row in zip(sub.index, sub.itertuples(index=False, name=None)):
        cells = [_md_label(label)] + [_md_value(v) for v in row]
        lines.append("| " + " | ".join(_md_escape(c) for c in cells) + " |")
    if nrows > max_rows or ncols > max_cols:
        lines.append("")
        lines.append("… %d rows × %d columns" % (nrows, ncols))
    return "\n".join(lines)


def _df_markdown(df):
    return frame_markdown(df)


def _series_frame(s):
    return s.to_frame()


def _series_markdown(s):
    return frame_markdown(_series_frame(s))


def _series_html(s):
    return _series_frame(s)._repr_html_()


TABLE_SCHEMA_MIME = "application/vnd.dataresource+json"


def _html_rows_and_columns(obj):
    """The rows and columns of a DataFrame or Series that pandas' HTML shows (display options
    max_rows, min_rows, max_columns): all of them, or the first and last halves."""
    import pandas as pd
    max_rows = pd.get_option("display.max_rows")
    min_rows = pd.get_option("display.min_rows") or max_rows
    if max_rows and len(obj) > max_rows:
        keep = min(min_rows, max_rows)
        obj = pd.concat([obj.iloc[:(keep + 1) // 2], obj.iloc[len(obj) - keep // 2:]])
    max_cols = pd.get_option("display.max_columns")
    if isinstance(obj, pd.DataFrame) and max_cols and obj.shape[1] > max_cols:
        obj = pd.concat([obj.iloc[:, :(max_cols + 1) // 2], obj.iloc[:, obj.shape[1] - max_cols // 2:]], axis=1)
    return obj


def _table_schema(obj):
    """Jupyter's table schema (pandas' own `to_json(orient="table")`: fields with types, the
    index as a column, dates as ISO text, NaN as null) of the rows and columns the HTML shows;
    None where pandas cannot write it (MultiIndex columns, duplicate names)."""
    import json
    try:
        return json.loads(_html_rows_and_columns(obj).to_json(orient="table", date_format="iso"))
    except Exception:
        return None


def _table_shape(obj):
    pd = sys.modules.get("pandas")
    if pd is None:
        return None
    try:
        if isinstance(obj, pd.DataFrame):
            return len(obj.index), len(obj.columns)
        if isinstance(obj, pd.Series):
            return len(obj.index), 1
    except Exception:
        pass
    return None


def _figure_png(fig):
    import sandq_mpl
    bundle = sandq_mpl.figure_bundle(fig)
    if bundle is None:
        return None
    data, md = bundle
    chart = data.get(sandq_mpl.CHART_MIME)
    if chart is not None:
        _FIGURE_CHARTS[id(fig)] = chart  # added to the bundle by the display formatter
    return data["image/png"], md["image/png"]


_FIGURE_CHARTS = {}  # id(figure) -> its chart data, between the PNG formatter and format()


# --------------------------------------------------------------------------------------
# tracebacks


def _internal_file(filename):
    if not filename:
        return False
    if filename in (_RUNNER_FILE, os.path.join(_RUNNER_DIR, "sandq_mpl.py")):
        return True
    for prefix in _INTERNAL_PREFIXES:
        if filename.startswith(prefix):
            return True
    return False


_INTERNAL_PREFIXES = []

# Lines of the script up to and including its cell magic (`%%time` on line 1: 1), else 0.
_CELL_MAGIC_LINES = 0


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
    if _CELL_MAGIC_LINES:
        # A cell magic ran the cell's body under a name of IPython's (`<timed exec>` for
        # %%time, `<ipython-input-...>` for a body run as a cell): the body starts after the
        # magic's line, so these are the script's lines, shifted.
        for fs in frames:
            if fs.filename == "<timed exec>" or fs.filename.startswith("<ipython-input-"):
                fs.filename = script
                fs.lineno += _CELL_MAGIC_LINES
                if getattr(fs, "end_lineno", None) is not None:
                    fs.end_lineno += _CELL_MAGIC_LINES
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


# --------------------------------------------------------------------------------------
# import hook: sandq_mpl from the runner's directory; env overrides while matplotlib
# and plotly read their configuration at import (child processes keep the real env)


_IMPORT_ENV = {
    "matplotlib": {"MPLBACKEND": _MPL_BACKEND},
    "plotly.io._renderers": {"PLOTLY_RENDERER": "plotly_mimetype"},
}


def _after_matplotlib(module):
    """matplotlib.use('agg') keeps capturing: our backend is Agg plus figure capture."""
    use = getattr(module, "use", None)
    if use is None or getattr(use, "_sandq", False):
        return
    import functools

    @functools.wraps(use)
    def sandq_use(backend, *args, **kwargs):
        if isinstance(backend, str) and backend.lower() == "agg":
            backend = _MPL_BACKEND
        return use(backend, *args, **kwargs)

    sandq_use._sandq = True
    module.use = sandq_use


_AFTER_IMPORT = {"matplotlib": _after_matplotlib}


class SandqFinder:
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "sandq_mpl":
            import importlib.util
            return importlib.util.spec_from_file_location(
                "sandq_mpl", os.path.join(_RUNNER_DIR, "sandq_mpl.py"))
        env = _IMPORT_ENV.get(fullname)
        if env is None:
            return None
        import importlib.machinery
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = getattr(spec, "loader", None)
        orig = getattr(loader, "exec_module", None)
        if orig is None:
            return spec
        after = _AFTER_IMPORT.get(fullname)

        def exec_module(module):
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                orig(module)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            if after is not None:
                try:
                    after(module)
                except Exception:
                    pass

        try:
            loader.exec_module = exec_module
        except Exception:
            pass
        return spec


# --------------------------------------------------------------------------------------
# lazy IPython package: IPython/__init__.py imports the terminal front end
# (prompt_toolkit, jedi: ~60% of the start-up time) which a kernel-less runner never
# uses.  Register the package without running its __init__; the first access to an
# attribute it would define runs the real __init__ in the same module.

_IPYTHON_DUNDERS_FROM_INIT = ("__version__", "__author__", "__license__", "__all__",
                              "__patched_cves__")


def _lazy_ipython_package():
    if "IPython" in sys.modules:
        return
    try:
        import importlib.machinery
        import importlib.util
        spec = importlib.machinery.PathFinder.find_spec("IPython")
        if (spec is None or spec.loader is None or not spec.submodule_search_locations
                or not hasattr(spec.loader, "get_code")):
            return
        module = importlib.util.module_from_spec(spec)
    except Exception:
        return
    state = {"loaded": False}

    def __getattr__(name):
        if (name.startswith("__") and name.endswith("__")
                and name not in _IPYTHON_DUNDERS_FROM_INIT):
            raise AttributeError(name)
        if not state["loaded"]:
            state["loaded"] = True
            exec(spec.loader.get_code("IPython"), module.__dict__)
        try:
            return module.__dict__[name]
        except KeyError:
            raise AttributeError("module 'IPython' has no attribute %r" % name) from None

    module.__getattr__ = __getattr__
    sys.modules["IPython"] = module
    try:
        from IPython.core import release
        from IPython.core.getipython import get_ipython
        module.get_ipython = get_ipython
        module.version_info = release.version_info
    except Exception:
        del sys.modules["IPython"]
        for name in [n for n in sys.modules if n.startswith("IPython.")]:
            del sys.modules[name]


# --------------------------------------------------------------------------------------
# the IPython shell


def make_shell(script, outputs, user_module):
    from traitlets import Type
    from traitlets.config import Config
    from IPython.core.compilerop import CachingCompiler
    from IPython.core.displayhook import DisplayHook
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.formatters import BaseFormatter, DisplayFormatter
    from traitlets import ObjectName, Unicode
    from IPython.core.interactiveshell import InteractiveShell
    import IPython.core

    _INTERNAL_PREFIXES.append(
        os.path.dirname(os.path.dirname(os.path.abspath(IPython.core.__file__))) + os.sep)

    def emit(output_type, data, metadata):
        try:
            data, metadata = normalize_bundle(data, metadata)
        except Exception as exc:
            _note("could not encode an output: %s: %s" % (type(exc).__name__, exc))
            return
        if not data:
            return
        outputs.write({"output_type": output_type, "data": data, "metadata": metadata})

    class SandqCompiler(CachingCompiler):
        """The cell gets the script's path as filename: real paths and line numbers in
        tracebacks; linecache holds the raw source for it."""
        _named = False

        def get_code_name(self, raw_code, transformed_code, number):
            if not self._named:
                self._named = True
                return script
            return super().get_code_name(raw_code, transformed_code, number)

        def ast_parse(self, source, filename="<unknown>", symbol="exec"):
            # codeop's flags make unclosed brackets "incomplete input": parse like a script
            import ast
            import codeop
            flags = self.flags & ~(getattr(codeop, "PyCF_ALLOW_INCOMPLETE_INPUT", 0)
                                   | getattr(codeop, "PyCF_DONT_IMPLY_DEDENT", 0))
            return compile(source, filename, symbol, flags | ast.PyCF_ONLY_AST, 1)

        def cache(self, transformed_code, number=0, raw_code=None):
            name = super().cache(transformed_code, number, raw_code)
            if name == script and raw_code is not None:
                import linecache
                lines = raw_code.splitlines()
                # A cell magic makes the whole cell one call on line 1; its body's frames are
                # mapped to the script's lines (_filter_te), which must then be the raw ones.
                if len(lines) == len(transformed_code.splitlines()) or _CELL_MAGIC_LINES:
                    linecache.cache[name] = (len(raw_code), None,
                                             [line + "\n" for line in lines], name)
            return name

    class SandqDisplayHook(DisplayHook):
        """Last-expression values become execute_result outputs; nothing on stdout."""

        def start_displayhook(self):
            pass

        def write_output_prompt(self):
            pass

        def write_format_data(self, format_dict, md_dict=None):
            emit("execute_result", format_dict, md_dict)

        def finish_displayhook(self):
            pass

    class SandqDisplayPublisher(DisplayPublisher):
        def publish(self, data, metadata=None, source=None, *, transient=None,
                    update=False, **kwargs):
            if update:  # update_display(): an append-only log cannot replace outputs
                return
            emit("display_data", data, metadata)

        def clear_output(self, wait=False):
            pass

    class SandqDisplayFormatter(DisplayFormatter):
        def _displays_itself(self, obj):
            try:
                self.ipython_display_formatter.lookup(obj)
                return True
            except Exception:
                pass
            try:
                return callable(getattr(type(obj), "_ipython_display_", None))
            except Exception:
                return False

        def format(self, obj, include=None, exclude=None):
            try:
                data, md = super().format(obj, include=include, exclude=exclude)
            except Exception as exc:
                _note("display formatting failed for %s: %s: %s" % (
                    type(obj).__name__, type(exc).__name__, _safe_str(exc)))
                return {"text/plain": _safe_repr(obj)}, {}
            if not data and self._displays_itself(obj):
                return data, md  # _ipython_display_ published it
            if "text/plain" not in data and (not include or "text/plain" in include):
                data["text/plain"] = _safe_repr(obj)
            chart = _FIGURE_CHARTS.pop(id(obj), None)
            if chart is not None:
                data["application/vnd.sandq.chart+json"] = chart
            md = dict(md or {})
            shape = _table_shape(obj)
            if shape is not None:
                md["sandq/table"] = {"rows": shape[0], "columns": shape[1]}
            if ("image/jpeg" in data and "image/png" in data
                    and type(obj).__module__.startswith("PIL.")):
                data.pop("image/jpeg", None)
                md.pop("image/jpeg", None)
            return data, md

    class SandqShell(InteractiveShell):
        displayhook_class = Type(SandqDisplayHook)
        display_pub_class = Type(SandqDisplayPublisher)
        compiler_class = Type(SandqCompiler)

        printed_errors = set()
        # Every exception the shell caught on the cell's behalf: raised out of the cell's code
        # (any run_cell, also one nested in a magic such as %%capture) or shown as a traceback
        # (%%time, %time, %run and display formatters catch and show). A cell whose own
        # run_cell reports no error still failed when this is not empty: the magic hid it.
        caught_errors = []

        def init_display_formatter(self):
            self.display_formatter = SandqDisplayFormatter(parent=self)
            self.configurables.append(self.display_formatter)

        def init_completer(self):
            pass  # no tab completion here: importing jedi is deferred until needed

        def __getattr__(self, name):
            if name == "Completer":
                InteractiveShell.init_completer(self)
                return self.__dict__["Completer"]
            raise AttributeError("%r object has no attribute %r" % (type(self).__name__, name))

        def enable_gui(self, gui=None):
            pass

        def enable_matplotlib(self, gui=None):
            """%matplotlib [anything]: use the sandq backend."""
            import matplotlib
            matplotlib.use(_MPL_BACKEND)
            import matplotlib.pyplot  # noqa: F401
            return "inline", _MPL_BACKEND

        async def run_code(self, code_obj, result=None, *, async_=False):
            __tracebackhide__ = "__ipython_bottom__"  # noqa: F841
            try:
                if async_:
                    await eval(code_obj, self.user_global_ns, self.user_ns)
                else:
                    exec(code_obj, self.user_global_ns, self.user_ns)
            except BaseException as exc:  # incl. SystemExit, KeyboardInterrupt
                if result is not None:
                    result.error_in_exec = exc
                self.caught_errors.append(exc)
                return True
            return False

        def _sandq_report(self, exc):
            if exc is None:
                return
            self.caught_errors.append(exc)
            self.printed_errors.add(id(exc))
            _write_fd2("\n".join(format_exception_lines(exc, script)) + "\n")

        def showtraceback(self, exc_tuple=None, filename=None, tb_offset=None,
                          exception_only=False, running_compiled_code=False):
            try:
                exc = exc_tuple[1] if exc_tuple else sys.exc_info()[1]
                self._sandq_report(exc)
            except Exception:
                pass

        def showsyntaxerror(self, filename=None, running_compiled_code=False):
            try:
                self._sandq_report(sys.exc_info()[1])
            except Exception:
                pass

    cfg = Config()
    cfg.HistoryManager.enabled = False
    cfg.InteractiveShell.colors = "NoColor"
    cfg.InteractiveShell.xmode = "Plain"
    ipython_dir = None  # IPython's default: $IPYTHONDIR or ~/.ipython
    if not os.environ.get("IPYTHONDIR") and not os.access(os.path.expanduser("~"), os.W_OK):
        import tempfile
        try:  # (IPython would warn on stderr and do the same)
            ipython_dir = tempfile.mkdtemp(prefix="sandq-ipython-")
        except OSError:
            pass
    shell = SandqShell.instance(config=cfg, user_module=user_module, ipython_dir=ipython_dir)

    fmts = shell.display_formatter.formatters
    fmts["text/markdown"].for_type_by_name("pandas.core.frame", "DataFrame", _df_markdown)
    fmts["text/markdown"].for_type_by_name("pandas.core.series", "Series", _series_markdown)
    fmts["text/html"].for_type_by_name("pandas.core.series", "Series", _series_html)
    fmts["image/png"].for_type_by_name("matplotlib.figure", "Figure", _figure_png)

    class TableSchemaFormatter(BaseFormatter):
        """application/vnd.dataresource+json for DataFrames and Series, beside their HTML."""
        format_type = Unicode(TABLE_SCHEMA_MIME)
        _return_type = (dict,)
        print_method = ObjectName("_repr_data_resource_")

    schema = TableSchemaFormatter(parent=shell.display_formatter)
    schema.for_type_by_name("pandas.core.frame", "DataFrame", _table_schema)
    schema.for_type_by_name("pandas.core.series", "Series", _table_schema)
    fmts[TABLE_SCHEMA_MIME] = schema
    return shell


# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Session state: the variables, functions, classes and imports a cell leaves, pickled for
# the next job of the session (by value for what the cell defined: cloudpickle), and loaded
# back before that job's cell runs. Written and read only inside sandboxes of the session.

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


# --------------------------------------------------------------------------------------
# Warm start (`sandq_runner.py --warm`): the worker starts the sandbox before any job; the
# runner preloads modules and makes its shell, says it is ready, and waits for the handover.

WARM_SCRIPT = "/sandq/main.py"
WARM_READY = "/sandq/out/.ready"
WARM_GO = "/sandq/out/.go"
WARM_HANDOVER = "/sandq/handover.json"


def _preload():
    """Imports the modules named in $SANDQ_PRELOAD (comma-separated; default numpy, pandas,
    matplotlib with pyplot), with stderr silenced: their import-time chatter is not the job's."""
    names = os.environ.get("SANDQ_PRELOAD", "numpy,pandas,matplotlib")
    tmp = os.environ.get("TMPDIR") or "/tmp"
    try:
        tmp_before = set(os.listdir(tmp))
    except OSError:
        tmp_before = None
    saved = os.dup(2)
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        import importlib
        for name in [n.strip() for n in names.split(",") if n.strip()]:
            try:
                importlib.import_module(name)
                if name == "matplotlib":
                    importlib.import_module("matplotlib.pyplot")
            except Exception:
                pass
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    # What the imports left in /tmp (matplotlib's cache dir) a cold start would not have.
    if tmp_before is not None:
        import shutil
        for name in set(os.listdir(tmp)) - tmp_before:
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)


def _wait_for_handover():
    """Blocks until the worker hands a job over; returns the job's argv after the script.
    The handover file (read-only for the sandbox) holds the job's whole environment and its
    arguments; the environment replaces the warm-up one."""
    import json
    open(WARM_READY, "w").close()
    with open(WARM_GO, "rb") as go:
        go.read(1)
    with open(WARM_HANDOVER, "rb") as f:
        handover = json.load(f)
    os.environ.clear()
    os.environ.update(handover["env"])
    try:
        os.remove(WARM_READY)
    except OSError:
        pass
    return list(handover["args"])


def main():
    warm = sys.argv[1:2] == ["--warm"]
    if warm:
        script_arg = WARM_SCRIPT
    elif len(sys.argv) < 2:
        sys.stderr.write("usage: sandq_runner.py <script> [args...] | --warm\n")
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
        _preload()

    import builtins
    import types
    site_exit = {name: getattr(builtins, name) for name in ("exit", "quit")
                 if hasattr(builtins, name)}

    user_module = types.ModuleType("__main__")
    user_module.__file__ = script
    user_module.__cached__ = None
    global _USER_MODULE
    _USER_MODULE = user_module

    outputs = Outputs(os.environ.get("SANDQ_OUTPUTS") or None, _output_limit())
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

    args = _wait_for_handover() if warm else sys.argv[2:]
    sys.argv = [script_arg] + args

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
        state_report["restored"], state_report["not_restored"] = load_state(ns, state_in)
    shell.execution_count = max(1, _env_number("SANDQ_EXECUTION_COUNT", 1))

    if _T0 is not None:
        import time
        _note("runner ready after %.3f s" % (time.perf_counter() - _T0))

    if source is None:
        error = decode_error
    else:
        global _CELL_MAGIC_LINES
        lines = source.splitlines()
        first = next((i for i, line in enumerate(lines) if line.strip()), None)
        if first is not None and lines[first].startswith("%%"):
            _CELL_MAGIC_LINES = first + 1
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


if __name__ == "__main__":
    if os.environ.get("SANDQ_RUNNER_TIMING"):
        import time
        _T0 = time.perf_counter()
    _finish(main())
