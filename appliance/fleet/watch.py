"""A UI-free, live fleet source: a background thread that reads every box and the router every few seconds.

``FleetWatch(plan, api_key).start()`` then ``latest()`` from any thread: the newest ``FleetView`` (None until the
first round finished). The HTTP calls happen on the watch's own thread, never on the caller's, so a box that
times out cannot stall a UI. ``collect`` already turns every failure into a value (a "down: why" or an NA);
should it raise anyway, the round becomes a FleetView that says so, and the watch keeps going.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from .plan import FleetPlan
from .status import BoxView, FleetView, collect

DEFAULT_INTERVAL_S = 2.0


def failed_view(plan: FleetPlan, exc: BaseException) -> FleetView:
    """What a round that raised shows: every box NA with the reason, the router 'down: <why>'."""
    why = f"fleet collect failed: {type(exc).__name__}: {exc}"
    boxes = tuple(BoxView(n.label, n.url, f"NA: {why}", f"NA: {why}", why) for n in plan.nodes)
    return FleetView(plan.router.url, f"down: {why}", boxes)


class FleetWatch:
    """Background fleet poller with ``latest()``; ``start()``/``stop()`` are idempotent."""

    def __init__(self, plan: FleetPlan, api_key: Optional[str] = None, interval: float = DEFAULT_INTERVAL_S,
                 timeout: float = 2.0, collect_fn: Callable[..., FleetView] = collect):
        if interval <= 0:
            raise ValueError(f"fleet watch interval must be > 0 (got {interval})")
        self.plan = plan
        self.api_key = api_key
        self.interval = interval
        self.timeout = timeout
        self._collect = collect_fn
        self._view: Optional[FleetView] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.rounds = 0                       # finished collect rounds (tests, diagnostics)
        self.updated_at: Optional[float] = None   # time.time() of the newest view

    def latest(self) -> Optional[FleetView]:
        with self._lock:
            return self._view

    def _round(self) -> FleetView:
        try:
            return self._collect(self.plan, api_key=self.api_key, timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - errors become values; the watch must outlive any one round
            return failed_view(self.plan, exc)

    def _publish(self, view: FleetView) -> None:
        with self._lock:
            self._view = view
            self.rounds += 1
            self.updated_at = time.time()

    def poll_once(self) -> FleetView:
        """One round on the calling thread (a test, or a one-shot caller), published to ``latest()``."""
        view = self._round()
        self._publish(view)
        return view

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            view = self._round()
            if stop.is_set():
                break
            self._publish(view)
            # a slow round (time-outs) does not stack rounds: wait the rest of the interval, at least a little
            stop.wait(max(0.05, self.interval - (time.monotonic() - t0)))

    def start(self) -> "FleetWatch":
        if self._thread is None:
            self._stop = threading.Event()      # one per thread: a stopped thread that is still in a round ends
            self._thread = threading.Thread(target=self._run, args=(self._stop,), name="pdctl-fleet-watch",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 1.0) -> None:
        """Ask the thread to end and wait up to ``timeout`` s. A round stuck in HTTP time-outs is not waited
        for (quitting the TUI must be quick): the daemon thread ends after that round, publishing nothing new."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        self._thread = None

    def __enter__(self) -> "FleetWatch":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
