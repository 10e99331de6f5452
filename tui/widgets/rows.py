"""Metric rows that fit any width: ``label  value  ▁▂▃▅▇`` with the sparkline taking what is left.

Built once per snapshot, laid out at render time from the width Rich gives (``__rich_console__``), so a
resize needs no new snapshot and a value is never cut: the sparkline shrinks first, then disappears.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rich.text import Text

from textual.widget import Widget

from .chart import bars, spark


def _short(v: float) -> str:
    """A scale mark: 5.5, 21k, 100% for ratios scaled to 1."""
    if v == 1.0:
        return "100%"
    return f"{v / 1000:.0f}k" if v >= 10000 else (f"{v:.0f}" if v >= 100 else f"{v:.2g}")


@dataclass(frozen=True)
class Row:
    label: str
    value: str
    history: tuple = ()          # tick-aligned series (NaN gaps); () for no sparkline
    style: str = "bold"
    spark_style: str = "cyan"
    top: Optional[float] = None  # the sparkline's scale (None: its own max)
    headline: bool = False       # the panel's main number: reverse-video value


@dataclass(frozen=True)
class Rows:
    rows: tuple
    label_w: int = 0             # 0: the longest label

    def lines(self, width: int, height: int = 0) -> list[Text]:
        """One line per row; given a ``height`` with room to spare, each row with a history gets a
        sparkline that many rows tall under it (the spare rows shared evenly) instead of one inline."""
        lw = self.label_w or max((len(r.label) for r in self.rows), default=0)
        vw = max((len(r.value) for r in self.rows), default=0)
        charted = [r for r in self.rows if r.history]
        spare = height - len(self.rows) if height else 0
        tall = spare // len(charted) if charted and spare >= 2 * len(charted) else 0
        out = []
        for r in self.rows:
            t = Text(no_wrap=True, overflow="ellipsis")
            t.append(f"{r.label:<{lw}} ", style="bold" if r.headline else "dim")
            style = "dim" if r.value == "NA" else (f"reverse {r.style}" if r.headline else r.style)
            t.append(f"{r.value:>{vw}}", style=style)
            room = width - t.cell_len - 1
            if r.history and tall:
                known = [v for v in r.history if v == v]
                scale = r.top if r.top else (max(known) if known else None)
                mark = f"▲{_short(scale)}" if scale else ""
                if mark and width - t.cell_len > len(mark) + 1:
                    t.append(mark.rjust(width - t.cell_len), style="dim")
                out.append(t)
                out += bars(r.history, width, tall, r.top, r.spark_style)
                continue
            if r.history and room >= 4:
                t.append(" ")
                t.append_text(spark(r.history, room, r.top, r.spark_style))
            out.append(t)
        return out

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield from self.lines(options.max_width)

    def min_width(self) -> int:
        lw = self.label_w or max((len(r.label) for r in self.rows), default=0)
        return lw + 1 + max((len(r.value) for r in self.rows), default=0)


class RowsPanel(Widget):
    """Renders a ``Rows`` at the widget's size (taller panels get taller sparklines)."""
    DEFAULT_CSS = "RowsPanel { height: 1fr; }"

    def __init__(self, *, id: Optional[str] = None, classes: Optional[str] = None):
        super().__init__(id=id, classes=classes)
        self.rows: Optional[Rows] = None

    def set_rows(self, rows: Rows) -> None:
        if rows != self.rows:
            self.rows = rows
            self.refresh()

    def render(self) -> Any:
        from rich.console import Group
        if self.rows is None:
            return Text("")
        return Group(*self.rows.lines(self.size.width, self.size.height)[:self.size.height])
