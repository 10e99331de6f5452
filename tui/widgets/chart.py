"""A multi-row text sparkline with a horizontal SLO line: columns above the SLO turn red."""
from __future__ import annotations

from typing import Optional, Sequence

from rich.text import Text
from textual.widget import Widget

BLOCKS = " ▁▂▃▄▅▆▇█"


def render_chart(data: Sequence[float], width: int, height: int, slo: Optional[float] = None) -> Text:
    """The last ``width`` values as bars of ``height`` rows, scaled to max(data, SLO * 1.25)."""
    width, height = max(1, width), max(1, height)
    vals = list(data)[-width:]
    vals = [0.0] * (width - len(vals)) + vals if len(vals) < width else vals
    top = max([v for v in vals] + ([slo * 1.25] if slo else []) + [1e-9])
    slo_row = None
    if slo:
        slo_row = height - 1 - min(height - 1, int(slo / top * height))   # row index from the top
    t = Text()
    for r in range(height):
        base = (height - 1 - r) * 8       # eighths below this row
        for v in vals:
            eighths = int(round(v / top * height * 8))
            fill = max(0, min(8, eighths - base))
            over = slo is not None and v > slo
            if fill > 0:
                t.append(BLOCKS[fill], style="red" if over else "cyan")
            elif r == slo_row:
                t.append("┈", style="yellow")
            else:
                t.append(" ")
        if r < height - 1:
            t.append("\n")
    return t


class Chart(Widget):
    """Holds the series; ``set_data`` triggers a redraw at the widget's current size."""

    DEFAULT_CSS = "Chart { height: 3; }"

    def __init__(self, *, id: Optional[str] = None, classes: Optional[str] = None):
        super().__init__(id=id, classes=classes)
        self.data: tuple = ()
        self.slo: Optional[float] = None

    def set_data(self, data: Sequence[float], slo: Optional[float]) -> None:
        self.data, self.slo = tuple(data), slo
        self.refresh()

    def render(self) -> Text:
        return render_chart(self.data, self.size.width, self.size.height, self.slo)
