import os
import subprocess
import sys

import pytest

from sandq_nb import common, imports

RUNNER_DIR = common.RUNNER_DIR


def test_finder_serves_sandq_mpl_from_the_runner_dir():
    spec = imports.SandqFinder().find_spec("sandq_mpl")
    assert spec.name == "sandq_mpl" and spec.origin == os.path.join(RUNNER_DIR, "sandq_mpl.py")


def test_finder_ignores_other_modules():
    assert imports.SandqFinder().find_spec("json") is None
    assert imports.SandqFinder().find_spec("matplotlib.pyplot") is None


@pytest.fixture
def fake_matplotlib(tmp_path, monkeypatch):
    """A stand-in `matplotlib` package that records MPLBACKEND at import and has use()."""
    # (a real matplotlib an earlier test loaded is put back by monkeypatch afterwards)
    monkeypatch.delitem(sys.modules, "matplotlib", raising=False)
    pkg = tmp_path / "matplotlib"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import os\nSEEN = os.environ.get('MPLBACKEND')\n"
        "def use(backend, force=True):\n    return (backend, force)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", [imports.SandqFinder()] + sys.meta_path)
    yield
    sys.modules.pop("matplotlib", None)


@pytest.mark.parametrize("outer", [None, "Agg"])
def test_env_override_while_matplotlib_imports(fake_matplotlib, monkeypatch, outer):
    if outer is None:
        monkeypatch.delenv("MPLBACKEND", raising=False)
    else:
        monkeypatch.setenv("MPLBACKEND", outer)
    import matplotlib
    assert matplotlib.SEEN == "module://sandq_mpl"
    assert os.environ.get("MPLBACKEND") == outer  # restored: child processes keep the real env
    # matplotlib.use("agg") keeps the capture backend; others pass through
    assert matplotlib.use("Agg") == ("module://sandq_mpl", True)
    assert matplotlib.use("svg", force=False) == ("svg", False)
    assert matplotlib.use._sandq is True
    imports._after_matplotlib(matplotlib)  # not wrapped twice
    assert matplotlib.use("agg") == ("module://sandq_mpl", True)
    assert matplotlib.use.__wrapped__.__name__ == "use"


def test_lazy_ipython_package_skips_the_terminal_front_end():
    pytest.importorskip("IPython")
    code = (
        "import sys\n"
        "sys.path.insert(0, %r)\n"
        "from sandq_nb import imports\n"
        "imports._lazy_ipython_package()\n"
        "import IPython\n"
        "print('prompt_toolkit' in sys.modules, 'IPython.terminal' in sys.modules)\n"
        "from IPython.core.getipython import get_ipython\n"
        "print(IPython.get_ipython is get_ipython, IPython.version_info[:2])\n"
        "v = IPython.__version__\n"  # runs the real __init__
        "print('IPython.terminal' in sys.modules, v)\n"
        "import IPython.display\n"
        "print(callable(IPython.display.display))\n"
    ) % RUNNER_DIR
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, proc.stderr
    from importlib.metadata import version
    real = version("ipython")
    major, minor = (int(p) for p in real.split(".")[:2])
    assert proc.stdout.split("\n") == [
        "False False",
        "True (%d, %d)" % (major, minor),
        "True %s" % real,
        "True",
        "",
    ]


def test_fallback_fonts_follow_a_texts_own_families_once():
    from sandq_nb.imports import FALLBACK_FONTS, with_fallbacks
    assert with_fallbacks(["sans-serif"]) == ["sans-serif", *FALLBACK_FONTS]
    assert with_fallbacks("serif") == ["serif", *FALLBACK_FONTS]
    # A style that already names one keeps its place; only the missing ones are added.
    assert with_fallbacks(["sans-serif", "Symbola"]) == ["sans-serif", "Symbola", "Noto Sans CJK JP", "Lohit Devanagari"]


def test_font_lookups_get_the_fallbacks_whatever_the_style():
    font_manager = pytest.importorskip("matplotlib.font_manager")
    from sandq_nb import imports
    seen = []

    class Manager:
        def _find_fonts_by_props(self, prop, fontext="ttf"):
            seen.append(list(prop.get_family()))
            return ["x.ttf"]

    module = type("M", (), {"FontManager": Manager})
    imports._after_font_manager(module)
    imports._after_font_manager(module)  # installed once
    prop = font_manager.FontProperties(family=["sans-serif"])
    assert Manager()._find_fonts_by_props(prop) == ["x.ttf"]
    assert seen == [["sans-serif", *imports.FALLBACK_FONTS]]
    assert prop.get_family() == ["sans-serif"], "the text's own properties are not changed"


def test_image_show_displays_through_the_registered_viewer(monkeypatch):
    from sandq_nb import imports
    registered = []

    class Module:
        _viewers = registered

        @staticmethod
        def register(viewer, order=1):
            assert order == -1, "first, before any viewer Pillow finds"
            registered.insert(0, viewer)

    imports._after_image_show(Module)
    imports._after_image_show(Module)  # once
    assert len(registered) == 1 and isinstance(registered[0], imports.DisplayViewer)
    shown = []
    display_module = type("D", (), {"display": staticmethod(shown.append)})
    monkeypatch.setitem(sys.modules, "IPython.display", display_module)
    monkeypatch.setitem(sys.modules, "IPython", type("I", (), {"display": display_module}))
    assert registered[0].show("an image") == 1
    assert shown == ["an image"]
