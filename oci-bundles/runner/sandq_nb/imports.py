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
    "matplotlib.font_manager": {},
    "PIL.ImageShow": {},
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


# Fonts every text falls back to, in this order, for the glyphs its own fonts lack: CJK,
# Devanagari, then emoji and symbols (the image's fonts: docs/sandbox-image.md). matplotlib
# falls back only along a text's `font.family` list, which a style or theme replaces
# (seaborn's set_style/set_theme, style sheets): so they are added to every text's family when
# its fonts are looked up, whatever the style. A family that names them already is unchanged.
FALLBACK_FONTS = ("Noto Sans CJK JP", "Lohit Devanagari", "Symbola")


def with_fallbacks(families):
    """`families` (a text's font family list) followed by the FALLBACK_FONTS it lacks."""
    families = [families] if isinstance(families, str) else list(families)
    return families + [name for name in FALLBACK_FONTS if name not in families]


def _after_font_manager(module):
    """FontManager._find_fonts_by_props (matplotlib 3.6+: the fallback chain of Agg, PDF, PS
    and text paths) looks up the FALLBACK_FONTS after a text's own families."""
    manager = getattr(module, "FontManager", None)
    find = getattr(manager, "_find_fonts_by_props", None)
    if find is None or getattr(find, "_sandq", False):
        return
    import functools

    @functools.wraps(find)
    def find_with_fallbacks(self, prop, *args, **kwargs):
        families = prop.get_family()
        wanted = with_fallbacks(families)
        if len(wanted) != len(families):
            prop = prop.copy()
            prop.set_family(wanted)
        return find(self, prop, *args, **kwargs)

    find_with_fallbacks._sandq = True
    manager._find_fonts_by_props = find_with_fallbacks


class DisplayViewer:
    """PIL's `Image.show()` viewer in a notebook cell: the image is displayed (a
    `display_data` output, `image/png`), as Jupyter and E2B's interpreter show it. Without it
    Pillow finds no image viewer in the sandbox and shows nothing."""

    format = "PNG"

    def show(self, image, **options):
        from IPython.display import display
        display(image)
        return 1


def displaying_image_save():
    """E2B's interpreter displays an image that `Image.save` writes to a path (its startup
    script `0003_images.py`); a job with `compat: e2b` (SANDQ_PIL_SAVE_DISPLAYS) gets the
    same. The image is still saved; saving to a file object displays nothing, as there."""
    try:
        from PIL import Image
    except Exception:
        return
    save = Image.Image.save
    if getattr(save, "_sandq", False):
        return
    import functools

    @functools.wraps(save)
    def save_and_display(self, fp, *args, **kwargs):
        if isinstance(fp, (str, os.PathLike)):
            try:
                from IPython.display import display
                display(self)
            except Exception:
                pass
        return save(self, fp, *args, **kwargs)

    save_and_display._sandq = True
    Image.Image.save = save_and_display


def _after_image_show(module):
    """Registers DisplayViewer first (`PIL.ImageShow.register`, order -1)."""
    register = getattr(module, "register", None)
    if register is None or any(isinstance(v, DisplayViewer) for v in getattr(module, "_viewers", ())):
        return
    register(DisplayViewer(), order=-1)


_AFTER_IMPORT = {
    "matplotlib": _after_matplotlib,
    "matplotlib.font_manager": _after_font_manager,
    "PIL.ImageShow": _after_image_show,
}


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
