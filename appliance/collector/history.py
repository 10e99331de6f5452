"""The last N ticks of every charted series, aligned on ticks so a chart's time axis tells the truth.

A tick whose value was NA is kept as NaN (a gap the chart draws as a gap), never dropped: dropping it
would slide older samples to the right and make "60 s ago" a lie. Series that appear later (a GPU that
starts reporting) are padded with NaN at the front, so every series ends at the newest tick.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Any

from appliance.inventory import is_na

NAN = math.nan


class History:
    def __init__(self, length: int = 300):
        self.length = max(1, length)
        self.ticks = 0
        self._series: dict[str, deque] = {}

    def push(self, values: dict[str, Any]) -> None:
        """One tick: every series gets one value (NaN for NA or for a series absent this tick)."""
        self.ticks += 1
        n = min(self.ticks, self.length)
        for name, v in values.items():
            ring = self._series.get(name)
            if ring is None:
                ring = self._series[name] = deque([NAN] * (n - 1), maxlen=self.length)
            ring.append(NAN if v is None or is_na(v) else float(v))
        for name, ring in self._series.items():
            if name not in values:
                ring.append(NAN)

    def snapshot(self) -> dict[str, tuple]:
        return {k: tuple(r) for k, r in self._series.items()}


def known(series: tuple) -> list[float]:
    """The values of a history series that are numbers (NaN gaps left out)."""
    return [v for v in series if v == v]
