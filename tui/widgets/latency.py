"""The latency panel: TTFT and TPOT, each a legend line (p50, p95, SLO) over its p50/p95 chart, and a footer
line under both (the goodput beside the refusals).

The panel splits its height between the two charts and draws the time axis under each when there is
room; otherwise the legend says the span (``· 2m``). Rendering only reads what ``set_data`` was given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rich.console import Group
from rich.text import Text
from textual.widget import Widget

from appliance.inventory import is_na
from appliance.views.status import secs

from .chart import P50_STYLE, P95_STYLE, SLO_STYLE, plot_span, render_chart, short_secs, span_text


@dataclass(frozen=True)
class Series:
    name: str                    # "TTFT" | "TPOT"
    p50: object                  # Num: the current value
    p95: object
    slo: object                  # Num
    h50: tuple                   # history, one value per tick (NaN gaps)
    h95: tuple


def legend(s: Series, width: int, span: str = "") -> Text:
    """``TTFT ▆p50 310ms ▆p95 740ms ┈SLO 2.00s · last 5m`` and shorter forms, the longest that fits."""
    over = not is_na(s.slo) and not is_na(s.p95) and s.p95 > s.slo
    p95_style = "bold red" if over else "bold"
    tail = [(f"  · last {span}", "dim")] if span else []
    slo_short = "NA" if is_na(s.slo) else short_secs(float(s.slo))
    forms = [
        [(s.name, "bold"), ("  ▆p50 ", P50_STYLE), (secs(s.p50), "bold"), ("  ▆p95 ", P95_STYLE),
         (secs(s.p95), p95_style), ("  ┈SLO ", SLO_STYLE), (secs(s.slo), SLO_STYLE)] + tail,
        [(s.name, "bold"), (" ▆", P50_STYLE), (secs(s.p50), "bold"), (" ▆", P95_STYLE), (secs(s.p95), p95_style),
         (" ┈", SLO_STYLE), (slo_short, SLO_STYLE)] + ([(f" · {span}", "dim")] if span else []),
        [(s.name, "bold"), (" ▆", P50_STYLE), (secs(s.p50), "bold"), (" ▆", P95_STYLE), (secs(s.p95), p95_style),
         (" ┈", SLO_STYLE), (slo_short, SLO_STYLE)],
        [(s.name, "bold"), (" ", ""), (secs(s.p50), "bold"), ("/", "dim"), (secs(s.p95), p95_style)],
    ]
    texts = []
    for parts in forms:
        t = Text(no_wrap=True, overflow="ellipsis")
        for txt, style in parts:
            t.append(txt, style=style)
        texts.append(t)
    return next((t for t in texts if t.cell_len <= width), texts[-1])


class LatencyPanel(Widget):
    DEFAULT_CSS = "LatencyPanel { height: 1fr; }"

    def __init__(self, *, id: Optional[str] = None, classes: Optional[str] = None):
        super().__init__(id=id, classes=classes)
        self.series: tuple = ()
        self.step_s = 1.0
        self.footer: object = None

    def set_data(self, series: tuple, step_s: float, footer: object = None) -> None:
        """``footer``: one line (any Rich renderable that fits itself to the width) under the charts."""
        if (series, step_s, footer) != (self.series, self.step_s, self.footer):
            self.series, self.step_s, self.footer = series, step_s, footer
            self.refresh()

    def render(self) -> Group:
        w, h = self.size.width, self.size.height
        if not self.series or w <= 0 or h <= 0:
            return Group(Text("waiting for the first sample…", style="dim"))
        lines: list = []
        n = len(self.series)
        foot = self.footer is not None and h > 2 * n        # every chart keeps its legend and a row
        h_charts = h - 1 if foot else h
        for i, s in enumerate(self.series):
            part = h_charts // n + (1 if i < h_charts % n else 0)
            rows = part - 1
            axis = rows >= 4
            span = "" if axis else span_text(plot_span(len(s.h95), w, self.step_s))
            lines.append(legend(s, w, span))
            if rows > 0:
                lines += render_chart(s.h50, s.h95, w, rows, None if is_na(s.slo) else float(s.slo), short_secs,
                                      self.step_s, axis=axis)
        lines = lines[:h_charts]
        if foot:
            lines.append(self.footer)
        return Group(*lines)
