"""How the proxy routes, as an operator reads it: the decision mix over the window and the legs per worker.

Both come from the proxy's /metrics like its other counters. ``decisions_total{kind,reason}`` gives the
mix as deltas between ticks (a lifetime share hides a change in traffic); ``legs_total`` and
``legs_inflight`` ({backend,leg}) give what each worker serves: whole requests, P legs, D legs. Labelled
counters appear on first use, so a series missing while its family is exposed is 0; a proxy older than the
per-request decision exposes no family at all, and then every figure is NA saying so, never 0.
"""
from __future__ import annotations

from typing import Callable, Iterable, Union

from appliance import constants as C
from appliance.inventory import NA
from appliance.policy.decide import AGGREGATE, SPLIT

from .. import metric_names as N
from ..wire.prom import Metrics
from .rates import Window
from .snapshot import LEG_KINDS, DecisionMix, DecisionReason, LegCounts, SessionMix

DECISION = "px:decision:"          # window series: px:decision:<kind>:<reason>
LEG = "px:leg:"                    # window series: px:leg:<worker instance>:<leg>
SESSION = "px:session:"            # window series: px:session:<outcome>
_KIND_ORDER = {AGGREGATE: 0, SPLIT: 1}


def _older(metric: str) -> str:
    return f"proxy exposes no {metric} (older than the per-request decision)"


def cumulative(pm: Metrics, who: Callable[[str], str]) -> dict:
    """The window's series from one proxy scrape; ``who`` maps a backend label to its worker instance."""
    vals: dict = {}
    name = N.resolve(N.PROXY, "decisions", pm.names)
    if name is not None:
        for lab, v in pm.samples(name, "_total"):
            k = f"{DECISION}{lab.get('kind', '')}:{lab.get('reason', '')}"
            vals[k] = vals.get(k, 0.0) + v
    name = N.resolve(N.PROXY, "legs", pm.names)
    if name is not None:
        for lab, v in pm.samples(name, "_total"):
            k = f"{LEG}{who(lab.get('backend', ''))}:{lab.get('leg', '')}"
            vals[k] = vals.get(k, 0.0) + v
    name = N.resolve(N.PROXY, "sessions", pm.names)
    if name is not None:
        for lab, v in pm.samples(name, "_total"):
            k = SESSION + lab.get("outcome", "")
            vals[k] = vals.get(k, 0.0) + v
    return vals


def sessions(window: Window, pm: Union[Metrics, NA]) -> SessionMix:
    """Named conversations' turns over the window, by what their last worker meant (proxy/sessions.py)."""
    if isinstance(pm, NA):
        return SessionMix.na(pm.reason)
    if N.resolve(N.PROXY, "sessions", pm.names) is None:
        return SessionMix.na(f"proxy exposes no {C.PROXY_SESSIONS}_total (older than named sessions)")
    if window.span <= 0:
        return SessionMix.na("first sample: rates need two ticks")
    counts = []
    for key in window.latest:
        if key.startswith(SESSION):
            d = window.delta(key, "px")
            if not isinstance(d, NA) and d > 0:
                counts.append((key[len(SESSION):], float(d)))
    total = sum(c for _, c in counts)
    counts.sort(key=lambda c: (-c[1], c[0]))
    return SessionMix(total, tuple((o, c, c / total) for o, c in counts))


def mix(window: Window, pm: Union[Metrics, NA]) -> DecisionMix:
    """Shares aggregated/split and per reason, from the decision counters' deltas over the window."""
    if isinstance(pm, NA):
        return DecisionMix.na(pm.reason)
    if N.resolve(N.PROXY, "decisions", pm.names) is None:
        return DecisionMix.na(_older(C.PROXY_DECISIONS + "_total"))
    if window.span <= 0:
        return DecisionMix.na("first sample: rates need two ticks")
    counts, why = [], None
    for key in window.latest:
        if key.startswith(DECISION):
            d = window.delta(key, "px")
            if isinstance(d, NA):
                why = why or d
            elif d > 0:
                kind, reason = key[len(DECISION):].split(":", 1)
                counts.append((kind, reason, float(d)))
    total = sum(c for _, _, c in counts)
    if total <= 0:
        return DecisionMix.na(why.reason) if why else DecisionMix(0.0, NA("no decisions in the window"),
                                                                  NA("no decisions in the window"), ())
    counts.sort(key=lambda c: (_KIND_ORDER.get(c[0], 2), -c[2], c[1]))
    return DecisionMix(decided=total,
                       aggregated=sum(c for k, _, c in counts if k == AGGREGATE) / total,
                       split=sum(c for k, _, c in counts if k == SPLIT) / total,
                       reasons=tuple(DecisionReason(k, r, c, c / total) for k, r, c in counts))


def _rate(window: Window, key: str) -> Union[float, NA]:
    r = window.rate(key, "px")
    if isinstance(r, NA) and r.reason == "series absent in the latest scrape":
        return 0.0                  # the family is exposed: the proxy never sent this worker such a leg
    return r


def legs(window: Window, pm: Union[Metrics, NA], who: Callable[[str], str],
         instances: Iterable[str]) -> dict:
    """Per worker instance: (legs open now, legs per second over the window), each a LegCounts."""
    instances = list(instances)
    if isinstance(pm, NA):
        na = LegCounts.na(pm.reason)
        return {i: (na, na) for i in instances}
    gauge = N.resolve(N.PROXY, "legs_inflight", pm.names)
    counter = N.resolve(N.PROXY, "legs", pm.names)
    open_now: dict = {}
    for lab, v in pm.samples(gauge) if gauge else ():
        k = (who(lab.get("backend", "")), lab.get("leg", ""))
        open_now[k] = open_now.get(k, 0.0) + v
    out = {}
    for inst in instances:
        now = (LegCounts(**{leg: open_now.get((inst, leg), 0.0) for leg in LEG_KINDS}) if gauge else
               LegCounts.na(_older(C.PROXY_LEGS_INFLIGHT)))
        if counter is None:
            per_s = LegCounts.na(_older(C.PROXY_LEGS + "_total"))
        elif window.span <= 0:
            per_s = LegCounts.na("first sample: rates need two ticks")
        else:
            per_s = LegCounts(**{leg: _rate(window, f"{LEG}{inst}:{leg}") for leg in LEG_KINDS})
        out[inst] = (now, per_s)
    return out
