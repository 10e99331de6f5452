"""The box's one-word state and the reasons behind it, as an operator reads them at a glance.

``ready``: every source answered and the proxy's canary passed. ``starting``: nothing has failed, something
is still coming up (a unit activating, an engine loading: the launcher's STATUS= says how far), and the
proxy waits for it. ``degraded``: something failed (endpoint refused, breaker open, unit failed or
restarting). ``down``: the proxy itself does not answer. Faults are listed before starting reasons: the
first reason is the line that matters most.
"""
from __future__ import annotations

from typing import Any

from appliance.inventory import is_na

from .snapshot import KVServerStatus, ProxyStatus, UnitState


def _status(st: UnitState) -> str:
    return "" if is_na(st.status_text) else f" ({st.status_text})"


def _starting_unit(st: UnitState) -> bool:
    return st.active == "activating" and st.sub != "auto-restart"


def overall(workers: tuple, kv: KVServerStatus, proxy: ProxyStatus) -> tuple[str, list]:
    if is_na(proxy.health):
        return "down", [f"proxy: {proxy.health.reason}"]
    faults: list = []
    starting: list = []
    for name, health, st in [("kv server", kv.health, kv.state)] + [(w.instance, w.health, w.state)
                                                                    for w in workers]:
        if _starting_unit(st):
            starting.append(f"{name}: starting{_status(st)}")
        elif isinstance(health, str) and health.startswith("starting") and is_na(st.active):
            starting.append(f"{name}: {health}")       # no unit state: a port that does not answer yet
        elif health != "ok":
            faults.append(f"{name}: {health.reason if is_na(health) else health}")
    for w in workers:
        if w.breaker in ("open", "half_open"):
            faults.append(f"{w.instance}: breaker {w.breaker}")
    for st in [kv.state, proxy.state] + [w.state for w in workers]:
        if st.active in ("failed", "deactivating") or st.sub == "auto-restart":
            faults.append(f"{st.unit}: {st.active}/{st.sub}{_status(st)}")
    if _starting_unit(proxy.state):
        starting.append(f"proxy: starting{_status(proxy.state)}")
    if proxy.ready != "ready":
        line = f"proxy {proxy.ready}" if not is_na(proxy.ready) else "proxy readiness unknown"
        (starting if starting and not faults else faults).append(line)
    if faults:
        return "degraded", faults + starting
    return ("starting", starting) if starting else ("ready", [])


def units_note(states: Any) -> str:
    """The one reason every unit state is NA for (not a systemd host, demo child processes), else ""."""
    vals = list(states.values()) if isinstance(states, dict) else list(states)
    reasons = {s.active.reason for s in vals if is_na(s.active)}
    if vals and len(reasons) == 1 and all(is_na(s.active) for s in vals):
        return reasons.pop()
    return ""
