"""Per-backend circuit breaker: closed -> open after N consecutive failures -> half-open after a cool-down.
A drained backend (a rollout holds it out, control.py) allows nothing whatever its state.

Fed by fast health probes and by request outcomes. Half-open lets one trial through (a probe or a
request); its success closes the breaker, its failure opens it again. Times come from the caller's
monotonic clock so tests can drive it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUE = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}   # the gauge's encoding (SGLang's smg_worker_cb_state uses the same)


@dataclass
class Breaker:
    failures_to_open: int = 3
    open_s: float = 1.0
    state: str = CLOSED
    consecutive_failures: int = 0
    opened_at: float = 0.0
    trial_in_flight: bool = False
    last_error: str = ""
    transitions: int = 0
    opened_by: str = ""       # "probe" | "request": what the next success must come from
    drained: str = ""         # why an operator's rollout holds it out of rotation ("" = not held; control.py)
    history: list = field(default_factory=list)   # (monotonic time, new state, reason), last 20

    def _go(self, state: str, reason: str, now: float) -> None:
        if state != self.state:
            self.state = state
            self.transitions += 1
            self.history.append((now, state, reason))
            del self.history[:-20]
        if state == OPEN:
            self.opened_at = now
        self.trial_in_flight = False

    def _tick(self, now: float) -> None:
        if self.state == OPEN and now - self.opened_at >= self.open_s:
            self._go(HALF_OPEN, "cool-down over", now)

    def allows(self, now: float | None = None) -> bool:
        """May a request go to this backend now? (does not claim the half-open trial)"""
        now = time.monotonic() if now is None else now
        self._tick(now)
        if self.drained:
            return False
        return self.state == CLOSED or (self.state == HALF_OPEN and not self.trial_in_flight)

    def claim(self, now: float | None = None) -> bool:
        """Take the right to send: always in closed, the single trial in half-open."""
        if not self.allows(now):
            return False
        if self.state == HALF_OPEN:
            self.trial_in_flight = True
        return True

    def success(self, source: str = "request", now: float | None = None) -> None:
        """A good outcome. A probe alone closes only a breaker that probes opened: a backend whose /health
        is fine but whose requests fail must prove itself with a real request."""
        now = time.monotonic() if now is None else now
        if source == "request" or self.opened_by == "probe" or self.state == CLOSED:
            self.consecutive_failures = 0
            if self.state != CLOSED:
                self._go(CLOSED, f"{source} succeeded", now)

    def failure(self, reason: str, source: str = "request", now: float | None = None) -> bool:
        """A bad outcome; returns True when this one opened the breaker."""
        now = time.monotonic() if now is None else now
        self.last_error = reason
        self.consecutive_failures += 1
        self._tick(now)
        if self.state == HALF_OPEN or (self.state == CLOSED and self.consecutive_failures >= self.failures_to_open):
            self.opened_by = source
            self._go(OPEN, reason, now)
            return True
        if self.state == OPEN:
            self.opened_at = now   # still failing: stay open, no trial yet
        return False

    def force_open(self, reason: str, source: str, now: float | None = None) -> None:
        """Open now, whatever the count (a hung engine): only a real request can close it again."""
        now = time.monotonic() if now is None else now
        self.last_error = reason
        self.consecutive_failures = max(self.consecutive_failures + 1, self.failures_to_open)
        self.opened_by = source
        self._go(OPEN, reason, now)

    def release(self) -> None:
        """A claimed half-open trial ended without a verdict (e.g. the client went away)."""
        self.trial_in_flight = False
