"""Text bars for table cells: fixed width, so columns never jump; NA is drawn as NA, never as 0."""
from __future__ import annotations

from typing import Any

from rich.text import Text

from appliance.inventory import is_na

EIGHTHS = " ▏▎▍▌▋▊▉█"


def bar(frac: Any, width: int = 8, label: str = "", warn: float = 0.8, crit: float = 0.95) -> Text:
    """``███▌    52%``: a bar of ``width`` cells plus the label (default: the percentage)."""
    if is_na(frac):
        return Text("NA".ljust(width) + (" " + "NA".rjust(4)), style="dim")
    f = max(0.0, min(1.0, float(frac)))
    cells = f * width
    full = int(cells)
    part = EIGHTHS[int((cells - full) * 8)] if full < width else ""
    style = "red" if f >= crit else ("yellow" if f >= warn else "green")
    t = Text()
    t.append("█" * full + part, style=style)
    t.append(" " * (width - full - len(part)), style="on grey11")
    t.append(" " + (label or f"{f * 100:3.0f}%"))
    return t
