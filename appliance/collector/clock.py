"""The collector's clock, injected so tests drive time instead of sleeping on it.

Rates divide by the span between ticks, so the window is timed by ``monotonic`` (a wall-clock step never
makes a negative or huge rate); ``time`` (the wall clock) only stamps the Snapshot and turns a start time
into an uptime. ``sleep`` is what ``collect_once`` waits between its two ticks. The background thread's
cadence is real time whatever the clock: it waits on its stop event, so ``stop()`` is never kept waiting.
"""
from __future__ import annotations

import time as _time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class RealClock:
    """The process's clocks."""

    monotonic = staticmethod(_time.monotonic)
    time = staticmethod(_time.time)
    sleep = staticmethod(_time.sleep)


REAL = RealClock()
