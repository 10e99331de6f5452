"""The proxy's admission as an operator reads it: what it started, queued and refused per second over the
window, the queue now, the queue wait p95, and the goodput beside the refusals (appliance/policy/admit.py decides,
appliance/proxy/admission.py acts).

All from the proxy's /metrics like its other counters: ``admission_total{outcome,reason,priority}`` (summed
over priority) as deltas between ticks, the queue-depth gauge, the queue-wait histogram's bucket deltas and
the good-requests counter (streamed answers within both SLOs: its rate is the goodput); the mode from the
proxy's status JSON. A request that waited and then started counts once in queued/s and once in admitted/s.
Labelled counters appear on first use, so a verdict missing while its family is exposed is 0; a proxy older
than admission exposes no family at all, and then every figure is NA saying so, never 0.
"""
from __future__ import annotations

from typing import Any, Union

from appliance import constants as C
from appliance.inventory import NA
from appliance.policy.admit import ADMIT, QUEUE, REFUSE

from .. import metric_names as N
from ..wire.prom import Metrics
from .rates import Window, quantile
from .snapshot import Admission, Refusal

VERDICT = "px:admission:"          # window series: px:admission:<outcome>:<reason>
GOOD = "px:good"
QUEUE_WAIT = "px:queue_wait"
FIRST = "first sample: rates need two ticks"


def _older(metric: str) -> str:
    return f"proxy exposes no {metric} (older than admission)"


def cumulative(pm: Metrics) -> dict:
    """The window's series from one proxy scrape."""
    vals: dict = {}
    name = N.resolve(N.PROXY, "admission", pm.names)
    if name is not None:
        for lab, v in pm.samples(name, "_total"):
            k = f"{VERDICT}{lab.get('outcome', '')}:{lab.get('reason', '')}"
            vals[k] = vals.get(k, 0.0) + v
    name = N.resolve(N.PROXY, "good", pm.names)
    if name is not None:
        vals[GOOD] = pm.total(name, "_total") or 0.0
    name = N.resolve(N.PROXY, "queue_wait", pm.names)
    if name is not None:
        vals[QUEUE_WAIT] = pm.buckets(name)
    return {k: v for k, v in vals.items() if v is not None}


def mode_of(status: Any) -> Union[str, NA]:
    """The admission mode from the proxy's status JSON (a dict), or NA with why (``status``: the NA itself)."""
    if isinstance(status, NA):
        return status
    if isinstance(status, str):
        return NA(f"proxy status: {status}")
    adm = status.get("admission") if isinstance(status, dict) else None
    if not isinstance(adm, dict):
        return NA("proxy status has no admission (older than admission)")
    mode = adm.get("mode")
    return str(mode) if isinstance(mode, str) and mode else NA("proxy status names no admission mode")


def figures(window: Window, pm: Union[Metrics, NA], status: Any) -> Admission:
    """Per second over the window: admitted, queued, refused (by reason); the queue depth now, its wait p95
    and the goodput. ``status``: the proxy's parsed status JSON, or NA saying why it is missing."""
    mode = mode_of(status)
    if isinstance(pm, NA):
        return Admission.na(pm.reason, mode)
    if N.resolve(N.PROXY, "admission", pm.names) is None:
        return Admission.na(_older(C.PROXY_ADMISSION + "_total"), mode)
    name = N.resolve(N.PROXY, "queue_depth", pm.names)
    v = pm.total(name) if name else None
    if name is None:
        depth: Any = NA(_older(C.PROXY_QUEUE_DEPTH))
    else:
        depth = float(v) if v is not None else NA(f"{name} has no sample")
    good = _good(window, pm)
    wait = _wait_p95(window, pm)
    if window.span <= 0:
        first = NA(FIRST)
        return Admission(mode, first, first, first, first, depth, wait, good)
    per: dict = {ADMIT: 0.0, QUEUE: 0.0, REFUSE: 0.0}
    refused: dict = {}
    why, seen = None, False
    for key in window.latest:
        if not key.startswith(VERDICT):
            continue
        d = window.delta(key, "px")
        if isinstance(d, NA):
            why = why or d
            continue
        seen = True
        outcome, reason = key[len(VERDICT):].split(":", 1)
        per[outcome] = per.get(outcome, 0.0) + d / window.span
        if outcome == REFUSE and d > 0:
            refused[reason] = refused.get(reason, 0.0) + d / window.span
    if why is not None and not seen:
        return Admission(mode, why, why, why, why, depth, wait, good)
    refusals = tuple(Refusal(r, n) for r, n in sorted(refused.items(), key=lambda x: (-x[1], x[0])))
    return Admission(mode, per[ADMIT], per[QUEUE], per[REFUSE], refusals, depth, wait, good)


def _good(window: Window, pm: Metrics) -> Union[float, NA]:
    if N.resolve(N.PROXY, "good", pm.names) is None:
        return NA(_older(C.PROXY_GOOD + "_total"))
    return window.rate(GOOD, "px")


def _wait_p95(window: Window, pm: Metrics) -> Union[float, NA]:
    if N.resolve(N.PROXY, "queue_wait", pm.names) is None:
        return NA(_older(C.PROXY_QUEUE_WAIT))
    d = window.delta(QUEUE_WAIT)
    if isinstance(d, NA):
        return d
    if not isinstance(d, dict):
        return NA("queue wait is not a histogram")
    p = quantile(0.95, d)
    if isinstance(p, NA) and p.reason.startswith("no requests"):
        return NA("nobody waited in the queue in the window")
    return p
