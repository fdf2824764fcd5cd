import base64
import struct
import zlib

import pytest

from sandq_nb import bundles
from sandq_nb.bundles import normalize_bundle

PLOTLY = "application/vnd.plotly.v1+json"


def png(width, height):
    """A real (tiny, valid) PNG header + IHDR chunk of the given size."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk


def test_png_size_from_bytes_and_base64():
    data = png(640, 480)
    assert bundles._png_size_b64(data) == (640, 480)
    assert bundles._png_size_b64(base64.b64encode(data).decode()) == (640, 480)
    assert bundles._png_size_b64(b"GIF89a" + b"\0" * 30) is None
    assert bundles._png_size_b64("!!not base64!!") is None
    assert bundles._png_size_b64(b"\x89PNG") is None


def test_binary_as_base64_and_png_size_metadata():
    data = png(3, 5)
    out, md = normalize_bundle({"image/png": data, "text/plain": "<img>"}, None)
    assert out == {"image/png": base64.b64encode(data).decode("ascii"), "text/plain": "<img>"}
    assert md == {"image/png": {"width": 3, "height": 5}}


def test_png_metadata_given_is_kept():
    given = {"image/png": {"width": 1, "height": 1}, "isolated": True}
    out, md = normalize_bundle({"image/png": png(3, 5)}, given)
    assert md == given and md is not given


def test_text_bytes_decoded_other_values_stringified():
    out, md = normalize_bundle({"text/html": "<b>é</b>".encode(), "image/svg+xml": b"<svg/>",
                                "text/plain": 42, 7: "dropped"}, {})
    assert out == {"text/html": "<b>é</b>", "image/svg+xml": "<svg/>", "text/plain": "42"}
    assert md == {}


def test_json_types_become_json_values():
    out, _ = normalize_bundle({"application/json": '{"a": [1, 2]}',
                               "application/vnd.x+json": b'[true]',
                               "application/geo+json": "not json",
                               "application/vnd.y+json": {"k": 1}}, {})
    assert out == {"application/json": {"a": [1, 2]}, "application/vnd.x+json": [True],
                   "application/geo+json": "not json", "application/vnd.y+json": {"k": 1}}


def test_non_dict_data_is_its_repr():
    out, md = normalize_bundle([1, 2], "not a dict")
    assert out == {"text/plain": "[1, 2]"} and md == {}


def test_plotly_gets_summary_and_keeps_given_html():
    fig = {"data": [{"type": "bar"}, {"type": "bar"}, {"y": [1]}],
           "layout": {"title": {"text": "Sales"}}}
    out, _ = normalize_bundle({PLOTLY: fig, "text/html": "<div>given</div>"}, {})
    assert out["text/html"] == "<div>given</div>"
    assert out["text/plain"] == "<plotly Figure: 3 traces (bar, scatter), title 'Sales'>"
    assert out[PLOTLY] == fig


def test_plotly_without_plotly_installed_notes_and_has_no_html(capfd, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "plotly", None)  # import plotly.io fails
    out, _ = normalize_bundle({PLOTLY: {"data": []}}, {})
    assert "text/html" not in out
    assert out["text/plain"] == "<plotly Figure: 0 traces>"
    assert capfd.readouterr().err.startswith("sandq: could not make text/html for a plotly figure: ")


@pytest.mark.parametrize("fig,text", [
    ({"data": [{"type": "pie"}]}, "<plotly Figure: 1 trace (pie)>"),
    ({"data": ["odd"], "layout": {"title": "T"}}, "<plotly Figure: 1 trace (?), title 'T'>"),
    ({"data": None, "layout": None}, "<plotly Figure: 0 traces>"),
    ("not a dict", "<plotly Figure>"),
])
def test_plotly_summary(fig, text):
    assert bundles._plotly_summary(fig) == text


def test_plotly_html_with_plotly():
    pytest.importorskip("plotly")
    out, _ = normalize_bundle({PLOTLY: {"data": [{"type": "bar", "y": [1, 2]}]}}, {})
    assert "cdn.plot.ly" in out["text/html"] and "<html" not in out["text/html"]
