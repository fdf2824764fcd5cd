"""Imports: the import hook (sandq_mpl from the runner's directory; env overrides while
matplotlib and plotly read their configuration) and the lazy IPython package."""

import os
import sys

from .common import MPL_BACKEND as _MPL_BACKEND, MPL_FILE


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
            return importlib.util.spec_from_file_location("sandq_mpl", MPL_FILE)
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
