"""The box's one-word state and the reasons behind it, as an operator reads them at a glance.

``ready``: every source answered and the proxy's canary passed. ``starting``: nothing has failed, something
is still coming up (a unit activating, an engine loading: the launcher's STATUS= says how far), and the
proxy waits for it. ``rolling``: `sudo pdctl apply` restarts the workers one batch at a time, and nothing
fails but what the rollout does on purpose (the workers of its step, and any it holds drained: out of rotation,
stopping, starting, refusing); the box serves from the others, so it is no alarm. ``degraded``: something
failed (endpoint refused, breaker open, unit failed or restarting, a worker held out of rotation with no rollout
running, a rollout that was interrupted). ``down``: the proxy itself does not answer. Faults are listed before
the rollout and starting reasons: the first reason is the line that matters most.
"""
from __future__ import annotations

from typing import Any

from appliance.inventory import is_na

from .rollout import line
from .snapshot import KVServerStatus, ProxyStatus, Rollout, UnitState


def _status(st: UnitState) -> str:
    return "" if is_na(st.status_text) else f" ({st.status_text})"


def _starting_unit(st: UnitState) -> bool:
    return st.active == "activating" and st.sub != "auto-restart"


def overall(workers: tuple, kv: KVServerStatus, proxy: ProxyStatus, rollout: Any = None) -> tuple[str, list]:
    """(state, reasons). ``rollout``: the Snapshot's (a Rollout, NA when its file did not read, or None)."""
    rolling = isinstance(rollout, Rollout) and not rollout.interrupted
    interrupted = isinstance(rollout, Rollout) and rollout.interrupted
    held = {w.instance: w.drained for w in workers if isinstance(w.drained, str) and w.drained}
    expected_of = (set(rollout.workers) | set(held)) if rolling else set()
    ro_line = [line(rollout)] if isinstance(rollout, Rollout) else []
    if is_na(proxy.health):
        return "down", [f"proxy: {proxy.health.reason}"] + ro_line
    faults: list = list(ro_line) if interrupted else []      # the workers keep what the rollout left them
    starting: list = []
    expected: list = []                           # what the rollout does on purpose
    by_unit = {w.state.unit: w.instance for w in workers}

    def fault(name: str, why: str) -> None:
        (expected if name in expected_of else faults).append(why)

    def start(name: str, why: str) -> None:
        (expected if name in expected_of else starting).append(why)
    for name, health, st in [("kv server", kv.health, kv.state)] + [(w.instance, w.health, w.state)
                                                                    for w in workers]:
        if _starting_unit(st):
            start(name, f"{name}: starting{_status(st)}")
        elif isinstance(health, str) and health.startswith("starting") and is_na(st.active):
            start(name, f"{name}: {health}")       # no unit state: a port that does not answer yet
        elif health != "ok":
            fault(name, f"{name}: {health.reason if is_na(health) else health}")
    for w in workers:
        if w.breaker in ("open", "half_open"):
            fault(w.instance, f"{w.instance}: breaker {w.breaker}")
        if w.instance in held and not rolling:
            faults.append(f"{w.instance}: out of rotation (drained: {held[w.instance]}) and no rollout runs")
    for st in [kv.state, proxy.state] + [w.state for w in workers]:
        if st.active in ("failed", "deactivating") or st.sub == "auto-restart":
            fault(by_unit.get(st.unit, ""), f"{st.unit}: {st.active}/{st.sub}{_status(st)}")
    if _starting_unit(proxy.state):
        starting.append(f"proxy: starting{_status(proxy.state)}")
    if proxy.ready != "ready":
        line_ = f"proxy {proxy.ready}" if not is_na(proxy.ready) else "proxy readiness unknown"
        (starting if starting and not faults else faults).append(line_)
    if faults:
        return "degraded", faults + (ro_line if rolling else []) + expected + starting
    if rolling:
        return "rolling", ro_line + expected + starting
    return ("starting", starting) if starting else ("ready", [])


def units_note(states: Any) -> str:
    """The one reason every unit state is NA for (not a systemd host, demo child processes), else ""."""
    vals = list(states.values()) if isinstance(states, dict) else list(states)
    reasons = {s.active.reason for s in vals if is_na(s.active)}
    if vals and len(reasons) == 1 and all(is_na(s.active) for s in vals):
        return reasons.pop()
    return ""
