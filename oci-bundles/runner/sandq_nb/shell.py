"""The IPython shell that runs the cell: make_shell(). IPython is imported when it is called."""

import os
import sys

from . import tracebacks
from .bundles import normalize_bundle
from .common import (MPL_BACKEND as _MPL_BACKEND, note as _note, safe_repr as _safe_repr,
                     safe_str as _safe_str, write_fd2 as _write_fd2)
from .formatters import (TABLE_SCHEMA_MIME, _FIGURE_CHARTS, _df_markdown, _figure_png,
                         _series_html, _series_markdown, _table_schema, _table_shape)
from .tracebacks import format_exception_lines


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

    tracebacks.INTERNAL_PREFIXES.append(
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
                if len(lines) == len(transformed_code.splitlines()) or tracebacks.CELL_MAGIC_LINES:
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
