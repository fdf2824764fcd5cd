import os

from sandq_nb import common


def test_paths_point_at_the_runner_files():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert common.RUNNER_DIR == here
    assert common.PACKAGE_DIR == os.path.join(here, "sandq_nb")
    assert common.RUNNER_FILE == os.path.join(here, "sandq_runner.py")
    assert common.MPL_FILE == os.path.join(here, "sandq_mpl.py")
    assert os.path.isfile(common.RUNNER_FILE) and os.path.isfile(common.MPL_FILE)
    assert common.MPL_BACKEND == "module://sandq_mpl"


def test_note_goes_to_fd2_with_prefix(capfd):
    common.note("hello ✓")
    out, err = capfd.readouterr()
    assert out == ""
    assert err == "sandq: hello ✓\n"


def test_write_fd2_replaces_lone_surrogates(capfd):
    common.write_fd2("a\udc80b")
    assert capfd.readouterr().err == "a?b"


class _BadRepr:
    def __repr__(self):
        raise ValueError("no")


class _BadStr:
    def __str__(self):
        raise ValueError("no")


def test_safe_repr_falls_back_to_object_repr():
    obj = _BadRepr()
    assert common.safe_repr(obj) == "<%s.%s object at %#x>" % (__name__, "_BadRepr", id(obj))
    assert common.safe_repr([1, "a"]) == "[1, 'a']"


def test_safe_str():
    assert common.safe_str(_BadStr()) == "<exception str() failed>"
    assert common.safe_str(3.5) == "3.5"
