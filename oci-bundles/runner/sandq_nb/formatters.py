"""pandas / matplotlib formatters, registered by type name (nothing is imported early):
markdown tables, Jupyter's table schema, figures as PNG."""

import sys

from .common import safe_repr as _safe_repr

MD_MAX_ROWS = 50
MD_MAX_COLS = 20
MD_MAX_CELL = 200


def _md_escape(text):
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "<br>")
    text = text.replace("|", "\\|").replace("<", "\\<")  # no raw HTML tags (<NA>)
    if len(text) > MD_MAX_CELL:
        text = text[:MD_MAX_CELL - 1] + "…"
    return text


def _md_value(v):
    try:
        if v is None:
            return "None"
        if isinstance(v, float) or type(v).__name__.startswith("float"):
            f = float(v)
            if f != f:
                return "NaN"
            if f in (float("inf"), float("-inf")):
                return "inf" if f > 0 else "-inf"
            if f.is_integer() and abs(f) < 1e16:
                return "%.1f" % f
            if 1e-4 <= abs(f) < 1e16:
                return ("%.6f" % f).rstrip("0").rstrip(".")
            return "%.6g" % f
        if isinstance(v, tuple):
            return ", ".join(_md_value(x) for x in v)
        return str(v)
    except Exception:
        return _safe_repr(v)


def _md_label(v):
    if isinstance(v, tuple):
        return " / ".join(_md_value(x) for x in v)
    return _md_value(v)


def frame_markdown(df, max_rows=MD_MAX_ROWS, max_cols=MD_MAX_COLS):
    """GitHub-style markdown table of a DataFrame: index first, capped rows/columns."""
    nrows, ncols = len(df.index), len(df.columns)
    sub = df.iloc[:max_rows, :max_cols]
    names = [n for n in sub.index.names]
    index_header = " / ".join("" if n is None else _md_value(n) for n in names)
    if not index_header.strip(" /"):
        index_header = ""
    header = [index_header] + [_md_label(c) for c in sub.columns]
    align = ["---"]
    for i in range(sub.shape[1]):
        kind = getattr(sub.dtypes.iloc[i], "kind", "O")
        align.append("---:" if kind in "iufc" else "---")
    lines = ["| " + " | ".join(_md_escape(h) for h in header) + " |",
             "|" + "|".join(align) + "|"]
    for label, row in zip(sub.index, sub.itertuples(index=False, name=None)):
        cells = [_md_label(label)] + [_md_value(v) for v in row]
        lines.append("| " + " | ".join(_md_escape(c) for c in cells) + " |")
    if nrows > max_rows or ncols > max_cols:
        lines.append("")
        lines.append("… %d rows × %d columns" % (nrows, ncols))
    return "\n".join(lines)


def _df_markdown(df):
    return frame_markdown(df)


def _series_frame(s):
    return s.to_frame()


def _series_markdown(s):
    return frame_markdown(_series_frame(s))


def _series_html(s):
    return _series_frame(s)._repr_html_()


TABLE_SCHEMA_MIME = "application/vnd.dataresource+json"


def _html_rows_and_columns(obj):
    """The rows and columns of a DataFrame or Series that pandas' HTML shows (display options
    max_rows, min_rows, max_columns): all of them, or the first and last halves."""
    import pandas as pd
    max_rows = pd.get_option("display.max_rows")
    min_rows = pd.get_option("display.min_rows") or max_rows
    if max_rows and len(obj) > max_rows:
        keep = min(min_rows, max_rows)
        obj = pd.concat([obj.iloc[:(keep + 1) // 2], obj.iloc[len(obj) - keep // 2:]])
    max_cols = pd.get_option("display.max_columns")
    if isinstance(obj, pd.DataFrame) and max_cols and obj.shape[1] > max_cols:
        obj = pd.concat([obj.iloc[:, :(max_cols + 1) // 2], obj.iloc[:, obj.shape[1] - max_cols // 2:]], axis=1)
    return obj


def _table_schema(obj):
    """Jupyter's table schema (pandas' own `to_json(orient="table")`: fields with types, the
    index as a column, dates as ISO text, NaN as null) of the rows and columns the HTML shows;
    None where pandas cannot write it (MultiIndex columns, duplicate names)."""
    import json
    try:
        return json.loads(_html_rows_and_columns(obj).to_json(orient="table", date_format="iso"))
    except Exception:
        return None


def _table_shape(obj):
    pd = sys.modules.get("pandas")
    if pd is None:
        return None
    try:
        if isinstance(obj, pd.DataFrame):
            return len(obj.index), len(obj.columns)
        if isinstance(obj, pd.Series):
            return len(obj.index), 1
    except Exception:
        pass
    return None


def _figure_png(fig):
    import sandq_mpl
    bundle = sandq_mpl.figure_bundle(fig)
    if bundle is None:
        return None
    data, md = bundle
    chart = data.get(sandq_mpl.CHART_MIME)
    if chart is not None:
        _FIGURE_CHARTS[id(fig)] = chart  # added to the bundle by the display formatter
    return data["image/png"], md["image/png"]


_FIGURE_CHARTS = {}  # id(figure) -> its chart data, between the PNG formatter and format()
