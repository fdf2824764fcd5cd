"""sandq matplotlib backend: Agg rendering, figures published as image/png outputs.

Selected by the sandq runner (``module://sandq_mpl``) when the user's code imports
matplotlib.  ``plt.show()`` publishes every open figure as a ``display_data`` output
(through IPython's display machinery, which the runner turns into a JSON line) and
closes it; ``fig.show()`` publishes that one figure.  The runner calls
``flush_figures()`` when the cell ends, so figures that were never shown are captured
too.  Pixel size is always figure size x figure dpi (no tight bounding box).

A figure whose current state was already published (e.g. by ``display(fig)``) is not
published again unless it changed since (matplotlib marks changed figures "stale").
"""

import io
import os
import struct
import sys
import weakref

from matplotlib import _pylab_helpers
from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

__all__ = ["FigureCanvas", "FigureManager", "show", "flush_figures", "render_png",
           "figure_bundle", "publish_figure", "chart", "CHART_MIME"]

# Figures whose current state has been published; see _already_published().
_published = weakref.WeakSet()


def _warn(msg):
    try:
        sys.stderr.flush()
    except Exception:
        pass
    try:
        os.write(2, ("sandq: " + msg + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def png_size(png):
    """(width, height) from a PNG's IHDR chunk, or None."""
    if len(png) >= 24 and png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR":
        return struct.unpack(">II", png[16:24])
    return None


def has_content(fig):
    """False for a figure nothing was drawn on (it would be a blank image)."""
    for attr in ("axes", "lines", "patches", "texts", "images", "legends", "artists", "subfigs"):
        if getattr(fig, attr, None):
            return True
    return False


def retina():
    """Whether the cell asked for retina (hidpi) figures, as Jupyter's inline backend reads it:
    `%config InlineBackend.figure_format = "retina"` (or `figure_formats`), or
    `set_matplotlib_formats("retina")` (IPython's or matplotlib_inline's; `png2x` too)."""
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except Exception:
        return False
    if shell is None:
        return False
    names = set()
    try:
        config = shell.config.get("InlineBackend", {})
        one, many = config.get("figure_format"), config.get("figure_formats")
        if isinstance(one, str):
            names.add(one)
        if isinstance(many, (set, list, tuple, frozenset)):
            names.update(str(name) for name in many)
    except Exception:
        pass
    inline = sys.modules.get("matplotlib_inline.config")
    try:
        if inline is not None and inline.InlineBackend.initialized():
            names.update(inline.InlineBackend.instance().figure_formats)
    except Exception:
        pass
    try:
        # set_matplotlib_formats registers the PNG formatter of figures in the shell.
        from matplotlib.figure import Figure
        formatter = shell.display_formatter.formatters["image/png"].lookup_by_type(Figure)
        if getattr(getattr(formatter, "func", formatter), "__name__", "") == "retina_figure":
            names.add("retina")
    except Exception:
        pass
    return bool(names & {"retina", "png2x"})


def render_png(fig, scale=1):
    """Render a figure to PNG at exactly figure size x figure dpi x `scale` (2 for a retina
    figure, as Jupyter renders one).

    Returns (png_bytes, width, height).  Renders with Agg whatever the figure's canvas is.
    """
    buf = io.BytesIO()

    def draw(agg):
        if scale == 1:
            agg.print_png(buf)
        else:
            agg.print_figure(buf, format="png", dpi=fig.dpi * scale)

    canvas = fig.canvas
    if isinstance(canvas, FigureCanvasAgg):
        draw(canvas)
    else:
        agg = FigureCanvasAgg(fig)  # attaches itself to the figure
        try:
            draw(agg)
        finally:
            fig.set_canvas(canvas)
    png = buf.getvalue()
    size = png_size(png) or (0, 0)
    return png, size[0], size[1]


def figure_bundle(fig):
    """(data, metadata) for a figure, or None when the figure is empty: its PNG and, when the
    figure has data, what it shows as CHART_MIME (see chart())."""
    if not has_content(fig):
        return None
    scale = 2 if retina() else 1
    png, w, h = render_png(fig, scale)
    _published.add(fig)
    data = {"image/png": png, "text/plain": repr(fig)}
    try:
        found = chart(fig)  # after rendering: tick labels are set by a draw
    except Exception as exc:  # a figure we cannot read still comes back as its PNG
        _warn("could not read the chart data of a figure: %s: %s" % (type(exc).__name__, exc))
        found = None
    if found is not None:
        data[CHART_MIME] = found
    # A retina figure has twice the pixels and is displayed at its logical size, as Jupyter's.
    return data, {"image/png": {"width": w // scale, "height": h // scale}}


# --------------------------------------------------------------------------------------
# Chart data: what a figure shows, as JSON, in the shape of E2B's code interpreter `chart`
# (same field names and values, so code written for E2B's charts reads these). Documented in
# docs/protocol.md ("Chart data").

CHART_MIME = "application/vnd.sandq.chart+json"
MAX_CHART_POINTS = 10000  # per series; the rest of a longer series is left out
_UNIT = None


def _finite(value):
    """A JSON-safe scalar: numbers as float/int (None for NaN and infinities), dates as ISO
    text, anything else as its str()."""
    import datetime
    import math
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - matplotlib needs numpy
        np = None
    if np is not None:
        if isinstance(value, np.datetime64):
            return None if np.isnat(value) else str(value.astype("datetime64[s]"))
        if isinstance(value, np.generic):
            value = value.item()
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    if value is None:
        return None
    return str(value)


def _text(value):
    return value if isinstance(value, str) and value else None


def _label_unit(label):
    """`Temperature (°C)` or `Price [USD]`: the unit in brackets, else None."""
    global _UNIT
    if not label:
        return None
    if _UNIT is None:
        import re
        _UNIT = re.compile(r"\s\((.*?)\)|\[(.*?)\]")
    match = _UNIT.search(label)
    return (match.group(1) or match.group(2)) if match else None


def _converter(axis):
    getter = getattr(axis, "get_converter", None)
    return getter() if getter is not None else getattr(axis, "converter", None)


def _is_date_axis(axis):
    import matplotlib.dates as mdates
    kinds = tuple(k for k in (getattr(mdates, n, None) for n in (
        "DateConverter", "ConciseDateConverter", "_SwitchableDateConverter")) if k is not None)
    return isinstance(_converter(axis), kinds)


def _axis_scale(axis, scale, ticks, labels):
    """linear, log, symlog, logit (matplotlib's scale), datetime or categorical."""
    if _is_date_axis(axis):
        return "datetime"
    if scale != "linear":
        return scale
    try:
        from matplotlib.category import StrCategoryConverter
        if isinstance(_converter(axis), StrCategoryConverter):
            return "categorical"
    except ImportError:
        pass
    # E2B's rule: ticks 0..n-1 whose labels are not those numbers.
    if ticks and all(isinstance(t, (int, float)) and t == i and str(i) != label
                     for i, (t, label) in enumerate(zip(ticks, labels))):
        return "categorical"
    return "linear"


def _ticks(axis, values):
    if _is_date_axis(axis):
        import matplotlib.dates as mdates
        return [mdates.num2date(v).isoformat() for v in values]
    return [_finite(float(v)) for v in values]


def _base(ax, kind):
    return {"type": kind, "title": _text(ax.get_title()), "elements": []}


def _planar(ax, kind):
    chart = _base(ax, kind)
    x_label, y_label = _text(ax.get_xlabel()), _text(ax.get_ylabel())
    chart.update({"x_label": x_label, "y_label": y_label,
                  "x_unit": _label_unit(x_label), "y_unit": _label_unit(y_label)})
    return chart


def _with_ticks(ax, chart):
    for name, axis, scale in (("x", ax.xaxis, ax.get_xscale()), ("y", ax.yaxis, ax.get_yscale())):
        labels = [t.get_text() for t in axis.get_ticklabels()]
        ticks = _ticks(axis, axis.get_ticklocs())
        chart[name + "_ticks"] = ticks
        chart[name + "_tick_labels"] = labels
        chart[name + "_scale"] = _axis_scale(axis, scale, ticks, labels)
    return chart


def _points(xs, ys):
    return [[_finite(x), _finite(y)] for x, y in list(zip(xs, ys))[:MAX_CHART_POINTS]]


def _is_grid_line(line):
    """A 2-point horizontal or vertical line: grid, reference or error-bar lines (E2B's rule)."""
    xs, ys = line.get_xdata(), line.get_ydata()
    return len(xs) == 2 and len(ys) == 2 and (xs[0] == xs[1] or ys[0] == ys[1])


def _chart_type(ax):
    from matplotlib.collections import PathCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import PathPatch, Rectangle, Wedge
    from matplotlib.text import Text
    children = getattr(ax, "_children", None)
    if children is None:
        children = list(ax.lines) + list(ax.patches) + list(ax.collections) + list(ax.images)
    objects = [o for o in children if not isinstance(o, Text)]
    if all(isinstance(o, Line2D) for o in objects):
        return "line"
    if all(isinstance(o, (PathPatch, Line2D)) for o in objects):
        return "box_and_whisker"
    objects = [o for o in objects if not (isinstance(o, Line2D) and _is_grid_line(o))]
    for kind, types in (("scatter", PathCollection), ("pie", Wedge), ("bar", Rectangle)):
        if all(isinstance(o, types) for o in objects):
            return kind
    return "unknown"


def _line_chart(ax):
    chart = _with_ticks(ax, _planar(ax, "line"))
    for line in ax.get_lines():
        if _is_grid_line(line):
            continue
        label = line.get_label()
        if label.startswith("_child"):
            label = "Line " + label[len("_child"):]
        chart["elements"].append({"label": label, "points": _points(line.get_xdata(), line.get_ydata())})
    return chart


def _scatter_chart(ax):
    chart = _with_ticks(ax, _planar(ax, "scatter"))
    for collection in ax.collections:
        offsets = collection.get_offsets()
        chart["elements"].append({"label": collection.get_label(),
                                  "points": _points(offsets[:, 0], offsets[:, 1])})
    return chart


def _tick_label_at(axis, position):
    """The text of the tick at `position` on `axis`, else the position as a number."""
    for loc, label in zip(axis.get_ticklocs(), axis.get_ticklabels()):
        if abs(loc - position) <= 1e-9 * max(1.0, abs(position)) and label.get_text():
            return label.get_text()
    return "%g" % position


def _bar_chart(ax):
    from matplotlib.container import BarContainer
    chart = _planar(ax, "bar")
    horizontal = False
    for container in ax.containers:
        if not isinstance(container, BarContainer):
            continue
        group = container.get_label()
        if group.startswith("_container"):
            group = "Group " + group[len("_container"):]
        horizontal = getattr(container, "orientation", "vertical") == "horizontal"
        for rect in container:
            if horizontal:
                label = _tick_label_at(ax.yaxis, rect.get_y() + rect.get_height() / 2)
                value = rect.get_width()
            else:
                label = _tick_label_at(ax.xaxis, rect.get_x() + rect.get_width() / 2)
                value = rect.get_height()
            chart["elements"].append({"label": label, "group": group, "value": _finite(value)})
    if horizontal:  # E2B names the category axis x, the value axis y
        chart["x_label"], chart["y_label"] = chart["y_label"], chart["x_label"]
        chart["x_unit"], chart["y_unit"] = chart["y_unit"], chart["x_unit"]
    return chart


def _pie_chart(ax):
    chart = _base(ax, "pie")
    for wedge in ax.patches:
        chart["elements"].append({"label": wedge.get_label(),
                                  "angle": round(abs(float(wedge.theta2) - float(wedge.theta1)), 4),
                                  "radius": _finite(float(wedge.r))})
    return chart


def _boxes_are_vertical(ax, boxes):
    """True when the values run along y: a median line spans its box's width horizontally
    (matplotlib and seaborn draw it edge to edge); else boxes of one width are vertical."""
    def close(a, b):
        return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))
    for line in ax.lines:
        xs, ys = list(line.get_xdata()), list(line.get_ydata())
        if len(xs) != 2 or len(ys) != 2:
            continue
        for x0, x1, y0, y1 in boxes:
            try:
                if close(ys[0], ys[1]) and close(min(xs), x0) and close(max(xs), x1) and y0 <= ys[0] <= y1:
                    return True
                if close(xs[0], xs[1]) and close(min(ys), y0) and close(max(ys), y1) and x0 <= xs[0] <= x1:
                    return False
            except TypeError:
                continue
    return len({round(b[1] - b[0], 6) for b in boxes}) == 1


def _box_chart(ax):
    """Boxes drawn as patches (patch_artist=True, seaborn): quartiles from each box, the
    median, whiskers and outliers from the lines over it."""
    chart = _planar(ax, "box_and_whisker")
    boxes = []
    for patch in ax.patches:
        v = patch.get_path().vertices
        boxes.append([float(v[:, 0].min()), float(v[:, 0].max()), float(v[:, 1].min()), float(v[:, 1].max())])
    if not boxes:
        return chart
    vertical = _boxes_are_vertical(ax, boxes)
    axis = ax.xaxis if vertical else ax.yaxis
    stats = []
    for x0, x1, y0, y1 in boxes:
        if not vertical:
            x0, x1, y0, y1 = y0, y1, x0, x1
        center = (x0 + x1) / 2
        stats.append({"label": _tick_label_at(axis, center), "min": y0, "first_quartile": y0,
                      "median": None, "third_quartile": y1, "max": y1, "outliers": [],
                      "_span": (x0, x1)})
    eps = 1e-9
    for line in ax.lines:
        xs, ys = [float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()]
        if not vertical:
            xs, ys = ys, xs
        if not xs:
            continue
        for box in stats:
            lo, hi = box["_span"]
            if all(lo - eps <= x <= hi + eps for x in xs):
                break
        else:
            continue
        if len(xs) == 2 and ys[0] == ys[1] and xs[0] != xs[1]:
            # The median spans the box's width; a whisker's cap is narrower (and may sit on a
            # quartile).
            spans = abs(min(xs) - lo) <= 1e-6 * max(1.0, abs(lo)) and abs(max(xs) - hi) <= 1e-6 * max(1.0, abs(hi))
            if spans and box["first_quartile"] - eps <= ys[0] <= box["third_quartile"] + eps and box["median"] is None:
                box["median"] = ys[0]
            continue
        if len(xs) == 2 and xs[0] == xs[1]:
            if max(ys) <= box["first_quartile"] + eps:
                box["min"] = min(box["min"], min(ys))
            elif min(ys) >= box["third_quartile"] - eps:
                box["max"] = max(box["max"], max(ys))
            continue
        if line.get_linestyle() in ("None", "", " ", "none"):
            box["outliers"].extend(y for y in ys if y == y)
    for box in stats:
        del box["_span"]
        chart["elements"].append({k: (_finite(v) if k not in ("label", "outliers") else v) for k, v in box.items()})
    return chart


def _axes_chart(ax):
    kind = _chart_type(ax)
    builder = {"line": _line_chart, "scatter": _scatter_chart, "bar": _bar_chart,
               "pie": _pie_chart, "box_and_whisker": _box_chart}.get(kind)
    return builder(ax) if builder else _base(ax, "unknown")


def chart(fig):
    """What `fig` shows, as a dict in E2B's chart shape, or None for a figure without data:
    one axes gives its chart (`line`, `scatter`, `bar`, `pie`, `box_and_whisker` or
    `unknown`), several give a `superchart` whose elements are the axes' charts."""
    axes = [ax for ax in fig.get_axes()]
    if not axes or not any(ax.has_data() for ax in axes):
        return None
    if len(axes) == 1:
        return _axes_chart(axes[0])
    suptitle = fig.get_suptitle() if hasattr(fig, "get_suptitle") else (fig._suptitle.get_text() if getattr(fig, "_suptitle", None) else "")
    return {"type": "superchart", "title": _text(suptitle), "elements": [_axes_chart(ax) for ax in axes]}


def _already_published(fig):
    try:
        return fig in _published and not fig.stale
    except Exception:
        return False


def publish_figure(fig):
    """Publish one figure as display_data (unless this state was already published)."""
    if _already_published(fig):
        return
    bundle = figure_bundle(fig)
    if bundle is None:
        return
    data, metadata = bundle
    from IPython.display import display
    display(data, raw=True, metadata=metadata)


def _open_managers():
    managers = list(_pylab_helpers.Gcf.get_all_fig_managers())

    def key(m):
        num = getattr(m, "num", 0)
        return num if isinstance(num, int) else 0

    managers.sort(key=key)  # creation order, not last-activated order
    return managers


def flush_figures(close=True):
    """Publish all open pyplot figures in creation order; close them if close."""
    for manager in _open_managers():
        fig = getattr(getattr(manager, "canvas", None), "figure", None)
        try:
            if fig is not None:
                publish_figure(fig)
        except Exception as exc:  # a broken figure must not stop the others
            _warn("could not render figure %r: %s: %s" % (
                getattr(manager, "num", "?"), type(exc).__name__, exc))
        finally:
            if close:
                try:
                    _pylab_helpers.Gcf.destroy(manager)
                except Exception:
                    pass


def show(close=None, block=None):
    """pyplot.show(): publish and close all open figures."""
    flush_figures(close=True)


class FigureManager(FigureManagerBase):
    def show(self):
        """Figure.show(): publish this figure (it stays open)."""
        try:
            publish_figure(self.canvas.figure)
        except Exception as exc:
            _warn("could not render figure: %s: %s" % (type(exc).__name__, exc))


class FigureCanvas(FigureCanvasAgg):
    manager_class = FigureManager


FigureCanvasSandq = FigureCanvas
