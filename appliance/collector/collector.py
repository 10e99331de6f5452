"""The collector's thread and cadence: one immutable Snapshot per tick from every source.

Sources per tick: GPU sampler (NVML or twin), one ``systemctl show`` for all units, each worker's
``/health`` and ``/metrics``, the KV server's ``/healthcheck``, ``/status`` and ``/metrics``, the proxy's
``/metrics``, ``/ready`` and its loopback status JSON, and the state file of a rollout (rollout.py). The GETs
are all in flight at once on the wire client (scrape.py: keep-alive per endpoint, short time-outs), so one hung
endpoint costs one time-out, not one per source. This module decides what to read when (the I/O); derive.py
turns it into the Snapshot's parts (pure), history.py keeps the charted series. A failing source makes its own
fields NA and the overall state "degraded"; it never stops the tick. Time comes from an injected clock (clock.py).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Optional

from appliance import constants as C

from appliance.inventory import NA

from . import derive as D
from . import figures as F
from . import rollout as RO
from . import state as S
from .clock import REAL, Clock
from .endpoints import Endpoints
from .gpus import GpuSampler, NoGpus, default_sampler
from .history import History
from .rates import Window
from .scrape import Scraper
from .snapshot import Snapshot, na_unit
from .units import SystemctlUnits, UnitSource

_SLOW_KEYS = ("w_health:", "kv_health", "kv_status")


def lineage(pids: set) -> dict:
    """pid -> (pid, parent, grandparent, ...) of each process still visible (GPU process attribution)."""
    if not pids:
        return {}
    import psutil
    out = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            out[pid] = (pid, *(p.pid for p in proc.parents()))
        except Exception:  # noqa: BLE001 - process gone or not visible: attribution is best effort
            pass
    return out


class Collector:
    """Polls every source each ``interval`` seconds; ``latest()`` is the newest Snapshot (or None)."""

    def __init__(self, plan: Any, gpu_sampler: Optional[GpuSampler] = None, interval: float = 1.0, *,
                 units: Optional[UnitSource] = None, window_s: float = 10.0, timeout_s: float = 0.5,
                 slo_ttft_s: Optional[float] = None, slo_tpot_s: Optional[float] = None, history_len: int = 300,
                 units_every: int = 5, units_steady_every: int = 15, clock: Clock = REAL,
                 rollout_path: Path = C.ROLLOUT_STATE):
        self.plan = plan
        self.rollout_path = Path(rollout_path)
        self._phases = RO.Phases()
        self.sampler = gpu_sampler if gpu_sampler is not None else default_sampler(plan)
        self.interval = interval
        self.units = units if units is not None else SystemctlUnits()
        self.timeout_s = timeout_s
        self.clock = clock
        self.window = Window(window_s)
        self.slo_ttft_s = slo_ttft_s
        self.slo_tpot_s = slo_tpot_s
        self._history = History(history_len)
        self._scraper = Scraper(timeout_s)
        self._eps: Optional[Endpoints] = None
        self._eps_plan: Any = None
        self._tick = 0
        self.units_every = max(1, units_every)
        self.units_steady_every = max(self.units_every, units_steady_every)
        self._states: dict = {}
        self._got: dict = {}
        self._last_errors: frozenset = frozenset()
        self._latest: Optional[Snapshot] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- thread ------------------------------------------------------------------------------------
    def start(self) -> "Collector":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="pdctl-collector", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread, which releases the connections and the sampler as it ends (a tick still in its
        time-outs ends a little after this returns)."""
        self._stop.set()
        t, self._thread = self._thread, None
        if t is None:
            self.close()
        else:
            t.join(timeout=self.interval + 5 * self.timeout_s + 2)

    def close(self) -> None:
        """Release the keep-alive connections and the GPU sampler (again: nothing to do)."""
        self._scraper.close()
        self.sampler.close()

    def latest(self) -> Optional[Snapshot]:
        with self._lock:
            return self._latest

    def _run(self) -> None:
        """Tick every ``interval`` of real time (the wait is the stop event's, so the cadence is real time
        whatever clock the readings use)."""
        nxt = time.monotonic()
        try:
            while not self._stop.is_set():
                snap = self.tick()
                with self._lock:
                    self._latest = snap
                nxt += self.interval
                delay = nxt - time.monotonic()
                if delay < 0:                     # a slow tick: skip ahead instead of bursting
                    nxt = time.monotonic()
                    delay = 0
                self._stop.wait(delay)
        finally:
            self.close()

    # -- one tick ----------------------------------------------------------------------------------
    def _endpoints(self) -> Endpoints:
        if self._eps is None or self._eps_plan is not self.plan:
            self._eps, self._eps_plan = Endpoints.of(self.plan), self.plan
        return self._eps

    def _fetch(self, urls: dict) -> tuple[dict, Any]:
        """This tick's answers (``{key: Reply}``, the unchanged ones carried over) and the raw GPU sample."""
        # health and /status every units_every ticks, and every tick while anything fails: with the
        # engines' /metrics answering each tick they add little, and each GET costs CPU
        slow = bool(self._last_errors) or self._tick % self.units_every == 0
        todo = {k: u for k, u in urls.items() if slow or not k.startswith(_SLOW_KEYS) or k not in self._got}
        got, raw_gpus = self._scraper.fetch_all_while(todo, self.sampler.sample)   # GPUs while servers answer
        if not slow and any(not r.ok for k, r in got.items() if k != "px_status"):
            got.update(self._scraper.fetch_all({k: u for k, u in urls.items() if k not in got}))
        self._got = {**self._got, **got}
        return self._got, raw_gpus

    def tick(self) -> Snapshot:
        plan, clock = self.plan, self.clock
        eps = self._endpoints()
        got, raw_gpus = self._fetch(eps.urls)
        now = clock.time()
        states = self._unit_states(got, eps)
        parsed = D.parse(plan, got)
        self.window.push(clock.monotonic(), D.cumulative(plan, eps, parsed))
        main_pids = D.main_pids_of(plan, eps, states)
        procs = {p[0] for g in raw_gpus for p in g.processes} if main_pids and not isinstance(raw_gpus, NA) else set()
        p = D.derive(plan, eps, got, parsed, self.window, states, raw_gpus, lineage(procs),
                     getattr(self.sampler, "source", "gpu"), now)
        rollout = self._phases.see(RO.read(self.rollout_path, now), now)
        overall, reasons = S.overall(p.workers, p.kv, p.proxy, rollout)
        self._tick += 1
        self._history.push(D.history_values(p))
        model, count = F.gpu_model(plan, p.gpu_source, p.gpus)
        return Snapshot(
            taken_at=now, tick=self._tick, interval_s=self.interval, window_s=round(self.window.span, 3),
            mode=plan.mode, engine=plan.engine, engine_version=plan.engine_version,
            model=plan.served_model_name or plan.model, overall=overall, overall_reasons=tuple(reasons),
            uptime_s=p.proxy.uptime_s, gpu_source=p.gpu_source, gpus=p.gpus, workers=p.workers, kv=p.kv,
            proxy=p.proxy, kv_layers=p.layers, traffic=p.traffic,
            slo_ttft_s=self.slo_ttft_s if self.slo_ttft_s is not None else NA("no TTFT SLO configured"),
            tpot_p50_s=p.tpot_p50_s, tpot_p95_s=p.tpot_p95_s,
            slo_tpot_s=self.slo_tpot_s if self.slo_tpot_s is not None else NA("no TPOT SLO configured"),
            family=str((plan.predicted or {}).get("family", "")), gpu_model=model, gpu_count=count,
            units_note=S.units_note(states), history=self._history.snapshot(), rollout=rollout)

    def _unit_states(self, got: dict, eps: Endpoints) -> dict:
        """``systemctl show`` (a process spawn: a third of the collector's CPU) every ``units_every`` ticks
        while anything is starting, failing or restarting; every ``units_steady_every`` ticks while every unit
        is active/running and every endpoint answers (nothing there changes without an endpoint noticing: a
        stop, crash or restart fails its /health or /metrics first); and at once whenever the set of failing
        endpoints changes, so a crash shows its unit state promptly."""
        errors = frozenset(k for k, r in got.items() if not r.ok and not k.startswith("px_status"))
        names = list(eps.unit_names)
        steady = not errors and bool(self._states) and all(
            s.active == "active" and s.sub == "running" for s in self._states.values())
        every = self.units_steady_every if steady else self.units_every
        if self._states and errors == self._last_errors and self._tick % every:
            return self._states
        self._last_errors = errors
        try:
            self._states = self.units.states(names)
        except Exception as e:  # noqa: BLE001 - a broken unit source degrades the unit columns only
            self._states = {u: na_unit(u, f"unit source failed: {e}") for u in names}
        return self._states


def collect_once(plan: Any, gpu_sampler: Optional[GpuSampler] = None, *, units: Optional[UnitSource] = None,
                 settle_s: float = 0.0, timeout_s: float = 0.5, slo_ttft_s: Optional[float] = None,
                 slo_tpot_s: Optional[float] = None, clock: Clock = REAL,
                 rollout_path: Path = C.ROLLOUT_STATE) -> Snapshot:
    """One Snapshot without a thread. With ``settle_s`` > 0 two ticks are taken so rates are filled."""
    c = Collector(plan, gpu_sampler, interval=max(settle_s, 0.1), units=units, window_s=max(settle_s, 0.1) * 2,
                  timeout_s=timeout_s, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s, clock=clock,
                  rollout_path=rollout_path)
    try:
        snap = c.tick()
        if settle_s > 0:
            clock.sleep(settle_s)
            snap = c.tick()
        return snap
    finally:
        c.close()


__all__ = ["Collector", "collect_once", "NoGpus"]
