"""Text charts with scales: a p50/p95 history over a labelled time axis with a labelled SLO line, and
sparklines for table cells and metric rows. A history far below its SLO (under a quarter of it) is scaled
to itself, so 60 ms under a 2 s SLO is a shape, not a flat line; the legend still says the SLO.

A chart is ``rows`` of text: a left gutter with the scale (top value, ``SLO`` on the SLO's row, ``0`` at the
bottom) and the plot; with room for it, a last row with the time axis (``-5m … now``). Each plot column is
``k`` ticks (the max of them: a latency spike must not be averaged away), newest at the right; a tick the
collector could not measure (NaN) is a gap, never a zero. p50 is drawn over p95 in another colour.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

from rich.text import Text

BLOCKS = " ▁▂▃▄▅▆▇█"
GUTTER = 6
P50_STYLE, P95_STYLE, OVER_STYLE, SLO_STYLE, AXIS_STYLE = "bold cyan", "blue", "bold red", "yellow", "dim"


def short_secs(v: float) -> str:
    """An axis label of at most 5 cells: 250ms, 2.5s, 40s."""
    if v < 1:
        return f"{v * 1000:.0f}ms"
    return f"{v:g}s" if v < 10 else f"{v:.0f}s"


def nice_top(v: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k that is >= v (a scale a reader can take in at once)."""
    if not v or v <= 0 or math.isnan(v):
        return 1.0
    e = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if m * e >= v * 0.999999:
            return m * e
    return 10 * e


def columns(values: Sequence[float], width: int, agg: Callable = max) -> tuple[list, int]:
    """The series folded into at most ``width`` columns (each ``k`` ticks, the newest column ending at the
    newest tick); a column with no number is NaN. Returns (columns, k)."""
    n = len(values)
    if n == 0 or width <= 0:
        return [], 1
    k = max(1, math.ceil(n / width))
    out = []
    start = n - k * math.ceil(n / k)          # may be negative: the oldest column is partial
    for i in range(start, n, k):
        chunk = [v for v in values[max(0, i):i + k] if v == v]
        out.append(agg(chunk) if chunk else math.nan)
    return out, k


def span_text(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s >= 180:
        return f"{round(s / 60)}m"
    m, s = divmod(s, 60)
    return f"{m}m" if not s else f"{m}m{s:02d}s"


def time_axis(plot_w: int, span_s: float) -> Text:
    """``-5m        -2m30s        now`` under a plot of ``plot_w`` columns covering ``span_s`` seconds."""
    left, right = f"-{span_text(span_s)}", "now"
    t = Text(" " * GUTTER, style=AXIS_STYLE)
    mid = f"-{span_text(span_s / 2)}"
    if plot_w >= len(left) + len(mid) + len(right) + 4:
        pos = plot_w // 2 - len(mid) // 2
        line = left + " " * (pos - len(left)) + mid
        line += " " * (plot_w - len(line) - len(right)) + right
    else:
        line = left + " " * max(1, plot_w - len(left) - len(right)) + right
    t.append(line[:plot_w], style=AXIS_STYLE)
    return t


def render_chart(p50: Sequence[float], p95: Sequence[float], width: int, height: int,
                 slo: Optional[float], fmt: Callable[[float], str], step_s: float = 1.0,
                 axis: bool = True) -> list[Text]:
    """``height`` rows of ``width`` cells; the last is the time axis when ``axis`` and height >= 3."""
    width, height = max(GUTTER + 4, width), max(1, height)
    with_axis = axis and height >= 3
    rows = height - 1 if with_axis else height
    plot_w = width - GUTTER
    c95, k = columns(list(p95), plot_w)
    c50, _ = columns(list(p50), plot_w)
    c50 = [math.nan] * (len(c95) - len(c50)) + c50[-len(c95):] if c95 else []
    pad = plot_w - len(c95)
    known = [v for v in c95 if v == v]
    if slo and known and max(known) < slo / 4:
        slo = None                       # far below the SLO: scale to the data (the legend says the SLO)
    top = nice_top(max(known + ([slo * 1.25] if slo else []) + [1e-9]))
    slo_row = None if not slo else rows - 1 - min(rows - 1, int(slo / top * rows))
    out = []
    for r in range(rows):
        t = Text()
        label = fmt(top) if r == 0 else ("SLO" if r == slo_row else ("0" if r == rows - 1 else ""))
        t.append(f"{label:>{GUTTER - 1}.{GUTTER - 1}}", style=SLO_STYLE if label == "SLO" else AXIS_STYLE)
        t.append("┤" if label else "│", style=AXIS_STYLE)
        base = (rows - 1 - r) * 8
        t.append(("┈" if r == slo_row else " ") * pad, style=SLO_STYLE)
        for v95, v50 in zip(c95, c50):
            if v95 != v95:
                t.append("┈" if r == slo_row else " ", style=SLO_STYLE)
                continue
            f95 = max(0, min(8, int(round(v95 / top * rows * 8)) - base))
            f50 = max(0, min(8, int(round(v50 / top * rows * 8)) - base)) if v50 == v50 else 0
            if f50 > 0:
                t.append(BLOCKS[f50], style=P50_STYLE if f50 == 8 or f95 <= f50 else
                         f"{P50_STYLE} on {'dark_red' if slo and v95 > slo else 'navy_blue'}")
            elif f95 > 0:
                t.append(BLOCKS[f95], style=OVER_STYLE if slo and v95 > slo else P95_STYLE)
            elif r == slo_row:
                t.append("┈", style=SLO_STYLE)
            else:
                t.append(" ")
        out.append(t)
    if with_axis:
        out.append(time_axis(plot_w, plot_span(len(p95), width, step_s)))
    return out


def plot_span(n: int, width: int, step_s: float) -> float:
    """Seconds from the plot's left edge to now: what the time axis says (the plot's full width, data or
    not, so a tick is placed where its label says)."""
    k = max(1, math.ceil(n / max(1, width - GUTTER)))
    return (width - GUTTER) * k * step_s


def spark(values: Sequence[float], width: int, top: Optional[float] = None, style: str = "cyan") -> Text:
    """A one-row sparkline of the newest ``width`` columns (mean per column), scaled to ``top`` or the max;
    gaps (NaN) are blanks, and a series with no number yet is a dim dotted line."""
    if width <= 0:
        return Text()
    cols, _ = columns(list(values), width, agg=lambda xs: sum(xs) / len(xs))
    known = [v for v in cols if v == v]
    if not known:
        return Text("·" * width, style="dim")
    hi = top if top else (max(known) or 1.0)
    t = Text(" " * (width - len(cols)))
    for v in cols:
        t.append(" " if v != v else BLOCKS[max(1, min(8, int(round(v / hi * 8))))], style=style)
    return t


def bars(values: Sequence[float], width: int, rows: int, top: Optional[float] = None,
         style: str = "cyan") -> list[Text]:
    """A sparkline ``rows`` tall (mean per column, newest at the right, NaN gaps blank)."""
    if rows <= 1:
        return [spark(values, width, top, style)]
    cols, _ = columns(list(values), width, agg=lambda xs: sum(xs) / len(xs))
    known = [v for v in cols if v == v]
    if not known:
        return [Text(" " * width)] * (rows - 1) + [Text("·" * width, style="dim")]
    hi = top if top else (max(known) if known and max(known) > 0 else 1.0)
    pad = width - len(cols)
    out = []
    for r in range(rows):
        base = (rows - 1 - r) * 8
        t = Text(" " * pad)
        for v in cols:
            if v != v:
                t.append(" ")
                continue
            fill = max(0, min(8, max(1, int(round(v / hi * rows * 8))) - base))
            t.append(BLOCKS[fill], style=style)
        out.append(t)
    return out
