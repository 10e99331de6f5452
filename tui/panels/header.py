"""The header: what runs (plan shape, family, GPUs, model, engine, uptime) and the box's state with the one
line that matters most (the first fault, or what is still starting and how far: the launcher's STATUS=).
"Not a systemd host" is said here once, instead of NA in every unit cell."""
from __future__ import annotations

from typing import Optional

from rich.text import Text

from appliance.collector.snapshot import Snapshot
from appliance.inventory import is_na
from appliance.views.status import duration, na_notes

from .summary import Fit, form

STATE_STYLE = {"ready": "bold black on green", "starting": "bold black on yellow",
               "rolling": "bold black on cyan", "degraded": "bold black on dark_orange", "down": "bold white on red"}
REASON_STYLE = {"starting": "yellow", "rolling": "cyan"}       # the first reason's; a fault's is bold


def plan_shape(snap: Snapshot) -> str:
    """``1P3D`` (prefill/decode worker counts), ``8B`` (soft roles: workers that serve either leg, role
    "both"), ``1P0D3B`` (a hybrid); ``2x aggregated`` for an aggregated plan."""
    roles = [w.role for w in snap.workers]
    if snap.mode == "aggregated":
        return f"{len(roles)}x {snap.mode}"
    p, d, b = roles.count("prefill"), roles.count("decode"), roles.count("both")
    return (f"{p}P{d}D" if p or d else "") + (f"{b}B" if b else "")


def gpus_text(snap: Snapshot) -> str:
    if is_na(snap.gpu_model):
        if snap.engine == "vllm-cpu" or not snap.gpu_count:
            return "CPU engine, no GPUs" if snap.engine == "vllm-cpu" else "no GPUs"
        return f"{snap.gpu_count} GPUs (no samples)"
    return f"{snap.gpu_count}x {snap.gpu_model}"


def title(snap: Optional[Snapshot], paused: bool) -> Fit:
    if snap is None:
        return Fit((form(("pdctl ", "bold"), ("waiting for the first sample…", "")),))
    shape = plan_shape(snap) + (f" {snap.family}" if snap.family and snap.family != plan_shape(snap) else "")
    up = f"up {duration(snap.uptime_s)}"
    pause = ("  PAUSED", "bold reverse yellow") if paused else ("", "")
    units = (f" · {snap.units_note}", "dim") if snap.units_note else ("", "")
    short_units = (" · no systemd", "dim") if snap.units_note else ("", "")
    eng = snap.engine if snap.engine_version in ("", snap.engine) else f"{snap.engine} {snap.engine_version}"
    return Fit((
        form(("pdctl ", "bold"), (f"{shape} {snap.mode}", "bold cyan"), (" · ", "dim"), (gpus_text(snap), "bold"),
             (" · ", "dim"), (snap.model, ""), (" · ", "dim"), (eng, ""), (" · ", "dim"), (up, ""), units, pause),
        form(("pdctl ", "bold"), (shape, "bold cyan"), (" · ", "dim"), (gpus_text(snap), "bold"), (" · ", "dim"),
             (snap.model, ""), (" · ", "dim"), (eng, ""), (" · ", "dim"), (up, ""), short_units, pause),
        form((shape, "bold cyan"), (" ", ""), (gpus_text(snap), "bold"), (" · ", "dim"), (snap.model, ""),
             (" · ", "dim"), (up, ""), short_units, pause),
        form((shape, "bold cyan"), (" ", ""), (gpus_text(snap), "bold"), (" ", ""), (up, ""), pause),
    ))


def state_line(snap: Optional[Snapshot]) -> Fit:
    """``READY  all sources answered`` / ``DEGRADED  decode-1: connection refused  (+2 more: ?)``."""
    if snap is None:
        return Fit((form(("", "")),))
    word = (f" {snap.overall.upper()} ", STATE_STYLE.get(snap.overall, "bold"))
    items = list(snap.overall_reasons) + [n for n in na_notes(snap)
                                          if n not in snap.overall_reasons and not n.startswith("units: ")]
    if snap.overall == "ready":
        rest = [n for n in items]
        if not rest:
            return Fit((form(word, ("  all sources answered", "green")),))
        return Fit((form(word, ("  serving · ", "green"), (f"{len(rest)} value(s) NA: press ? for why", "dim")),
                    form(word, (f"  {len(rest)} NA: ?", "dim"))))
    first = items[0] if items else snap.overall
    more = f"  (+{len(items) - 1} more: press ?)" if len(items) > 1 else ""
    style = REASON_STYLE.get(snap.overall, "bold")
    return Fit((form(word, ("  ", ""), (first, style), (more, "dim")),
                form(word, ("  ", ""), (first, style))))


def why(snap: Optional[Snapshot]) -> Text:
    """The state line as plain Text (kept for callers that want one line, e.g. the fleet's title)."""
    return state_line(snap).pick(10_000)
