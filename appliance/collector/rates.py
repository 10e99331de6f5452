"""Rates, ratios and percentiles from deltas between ticks (never lifetime totals).

A lifetime hit ratio hides what is happening now (a cache that was warm an hour ago still shows 90 %),
so every figure is computed over a sliding window of raw cumulative samples: the delta between the
newest sample and the oldest one still inside the window. A counter that went down means the process
restarted; its delta is then its new value, as Prometheus' ``rate()`` does.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Union

from appliance.inventory import NA

Cum = Union[float, dict]     # a counter value, or cumulative histogram buckets {le: count}


class Window:
    """Cumulative samples of many series over the last ``span_s`` seconds."""

    def __init__(self, span_s: float = 10.0):
        self.span_s = span_s
        self._ticks: deque[tuple[float, dict]] = deque()
        self._memo: dict = {}          # (key, lazy) -> delta for the current ticks (floats and NA only)

    def push(self, t: float, values: dict) -> None:
        self._memo.clear()
        self._ticks.append((t, values))
        # keep exactly one tick at or before the window start, so deltas cover the whole span
        while len(self._ticks) >= 2 and self._ticks[1][0] <= t - self.span_s:
            self._ticks.popleft()

    @property
    def latest(self) -> dict:
        """The newest tick's values (empty before the first push)."""
        return self._ticks[-1][1] if self._ticks else {}

    @property
    def span(self) -> float:
        return self._ticks[-1][0] - self._ticks[0][0] if len(self._ticks) >= 2 else 0.0

    def delta(self, key: str, lazy: str = "") -> Union[float, dict, NA]:
        """Newest minus oldest value of one series in the window (NA until two ticks saw it).

        ``lazy`` names a source whose counters appear only after their first event (LMCache, labelled
        proxy counters): in a tick where that source answered (``up:<source>`` set) an absent series was 0.
        """
        hit = self._memo.get((key, lazy))
        if hit is not None:
            return hit
        d = self._delta(key, lazy)
        if not isinstance(d, dict):                 # a dict is the caller's to keep: not shared
            self._memo[(key, lazy)] = d
        return d

    def _delta(self, key: str, lazy: str) -> Union[float, dict, NA]:
        if len(self._ticks) < 2:
            return NA("first sample: rates need two ticks")
        new = self._ticks[-1][1].get(key)
        if new is None or isinstance(new, NA):
            return new if isinstance(new, NA) else NA("series absent in the latest scrape")
        old = None
        for _, vals in self._ticks:
            if vals is self._ticks[-1][1]:
                break
            v = vals.get(key)
            if v is not None and not isinstance(v, NA):
                old = v
                break
            if lazy and vals.get(f"up:{lazy}"):
                old = 0.0 if not isinstance(new, dict) else {}
                break
        if old is None:
            return NA("series seen in one tick only")
        if isinstance(new, dict):
            old_d = old if isinstance(old, dict) else {}
            if any(new.get(k, 0.0) < old_d.get(k, 0.0) for k in old_d):
                return dict(new)                        # restarted: everything since the restart
            return {k: v - old_d.get(k, 0.0) for k, v in new.items()}
        return new if new < old else new - old

    def rate(self, key: str, lazy: str = "") -> Union[float, NA]:
        d = self.delta(key, lazy)
        if isinstance(d, NA):
            return d
        if isinstance(d, dict) or self.span <= 0:
            return NA("not a counter")
        return d / self.span


def ratio(num: Union[float, NA], den: Union[float, NA], what: str = "lookups") -> Union[float, NA]:
    if isinstance(num, NA):
        return num
    if isinstance(den, NA):
        return den
    if den <= 0:
        return NA(f"no {what} in the window")
    return max(0.0, min(1.0, num / den))


def quantile(q: float, buckets: Union[dict, NA, None]) -> Union[float, NA]:
    """``histogram_quantile`` over cumulative bucket deltas {le: count}, linear inside a bucket."""
    if buckets is None:
        return NA("histogram absent")
    if isinstance(buckets, NA):
        return buckets
    items = sorted(buckets.items())
    if not items or math.isinf(items[-1][0]) is False:
        return NA("histogram has no +Inf bucket")
    total = items[-1][1]
    if total <= 0:
        return NA("no requests in the window")
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in items:
        if c >= rank:
            if math.isinf(le):
                return prev_le                      # beyond the last finite bound: report that bound
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def sum_values(values: list) -> Union[float, NA]:
    """Sum of per-worker figures; NA only when none is known (a partial sum says so in the reason)."""
    known = [v for v in values if not isinstance(v, NA)]
    if not known:
        return values[0] if values else NA("no workers")
    return float(sum(known))
