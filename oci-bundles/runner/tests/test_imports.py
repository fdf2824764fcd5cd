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
