"""MIME bundles: a formatter's data and metadata to their JSON form."""

from .common import PLOTLY_MIME as _PLOTLY_MIME, note as _note, safe_repr as _safe_repr, safe_str as _safe_str
from .outputs import _b64, _is_json_mime, _is_text_mime


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
