"""Header: plan, model, ready/degraded, uptime; the second line says why anything is degraded or NA."""
from __future__ import annotations

from typing import Optional

from rich.text import Text

from appliance.collector.snapshot import Snapshot
from appliance.status import duration, na_notes

STATE_STYLE = {"ready": "bold green", "degraded": "bold yellow", "down": "bold red"}


def plan_shape(snap: Snapshot) -> str:
    """``1P3D`` for a disaggregated plan (prefill/decode worker counts; ``2B`` more for workers that serve
    either leg, role "both"), ``2x aggregated`` otherwise."""
    roles = [w.role for w in snap.workers]
    if snap.mode == "disaggregated":
        both = roles.count("both")
        return f"{roles.count('prefill')}P{roles.count('decode')}D" + (f"{both}B" if both else "")
    return f"{len(roles)}x {snap.mode}"


def title(snap: Optional[Snapshot], paused: bool) -> Text:
    t = Text()
    if snap is None:
        t.append("pdctl  waiting for the first sample…", style="bold")
        return t
    t.append("pdctl ", style="bold")
    t.append(f"{plan_shape(snap)} · {snap.engine} {snap.engine_version} · {snap.model} · ")
    t.append(snap.overall.upper(), style=STATE_STYLE.get(snap.overall, "bold"))
    t.append(f" · up {duration(snap.uptime_s)}")
    if paused:
        t.append("  PAUSED", style="bold reverse yellow")
    return t


def why(snap: Optional[Snapshot]) -> Text:
    if snap is None:
        return Text("")
    items = list(snap.overall_reasons) + [n for n in na_notes(snap) if n not in snap.overall_reasons]
    if not items:
        return Text("all sources answered", style="dim green")
    t = Text()
    t.append("why: ", style="bold yellow")
    t.append(items[0])
    if len(items) > 1:
        t.append(f"  (+{len(items) - 1} more: press ?)", style="dim")
    t.no_wrap = True
    t.overflow = "ellipsis"
    return t
