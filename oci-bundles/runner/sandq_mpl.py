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
           "figure_bundle", "publish_figure"]

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


def render_png(fig):
    """Render a figure to PNG at exactly figure size x figure dpi.

    Returns (png_bytes, width, height).  Renders with Agg whatever the figure's canvas is.
    """
    buf = io.BytesIO()
    canvas = fig.canvas
    if isinstance(canvas, FigureCanvasAgg):
        canvas.print_png(buf)
    else:
        agg = FigureCanvasAgg(fig)  # attaches itself to the figure
        try:
            agg.print_png(buf)
        finally:
            fig.set_canvas(canvas)
    png = buf.getvalue()
    size = png_size(png) or (0, 0)
    return png, size[0], size[1]


def figure_bundle(fig):
    """(data, metadata) for a figure, or None when the figure is empty."""
    if not has_content(fig):
        return None
    png, w, h = render_png(fig)
    _published.add(fig)
    return ({"image/png": png, "text/plain": repr(fig)},
            {"image/png": {"width": w, "height": h}})


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
