"""The drill-down of one unit (enter on a roles row): every figure the Snapshot has for it, and its GPUs."""
from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from appliance.collector.snapshot import Snapshot
from appliance.inventory import is_na
from appliance.views.status import (
    decisions_text,
    drained_text,
    duration,
    gib,
    health_short,
    legs_text,
    num,
    pct,
    per_s,
    refusals_text,
    secs,
    sessions_text,
    skipped_text,
    text,
    unit_text,
)

from ..widgets.chart import spark


def _v(v: Any) -> Text:
    """A value, or NA with its reason (the detail view has the room to say why)."""
    if is_na(v):
        return Text.assemble(("NA", "dim"), (f"  {v.reason}", "dim italic"))
    return Text(str(v))


def _unit_rows(st: Any) -> list:
    if is_na(st.active):
        return [("unit", _v(st.active))]
    return [("unit", Text(f"{st.unit}: {unit_text(st)} ({st.active}/{st.sub})")),
            ("restarts", _v(st.restarts)), ("STATUS=", _v(st.status_text)),
            ("main PID", _v(st.main_pid))]


def _table(rows: list) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="dim", no_wrap=True)
    t.add_column(overflow="fold")
    for k, v in rows:
        t.add_row(k, v if isinstance(v, Text) else Text(str(v)))
    return t


def _admission_rows(a: Any) -> list:
    """The proxy's admission: mode, goodput beside the refusals and their reasons, the queue."""
    why = refusals_text(a)
    return [("admission", _v(a.mode)),
            ("goodput", _v(a.goodput if is_na(a.goodput) else f"{num(a.goodput)} req/s within both SLOs")),
            ("refused/s", _v(a.refused_per_s if is_na(a.refused_per_s) else
                             per_s(a.refused_per_s) + (f" ({why})" if why not in ("NA", "none") else ""))),
            ("admitted / queued", Text(f"{per_s(a.admitted_per_s)} / {per_s(a.queued_per_s)}")),
            ("queue now", _v(a.queue_depth if is_na(a.queue_depth) else num(a.queue_depth, "{:.0f}"))),
            ("queue wait p95", _v(a.queue_wait_p95_s if is_na(a.queue_wait_p95_s) else secs(a.queue_wait_p95_s)))]


def title(snap: Snapshot, unit: str) -> str:
    for w in snap.workers:
        if w.unit == unit:
            gpus = ",".join(map(str, w.gpus)) or "cpu"
            return f"{w.instance} · {w.role} · {unit} · GPU {gpus} · :{w.port}"
    return unit


def body(snap: Snapshot, unit: str, width: int = 80) -> Table:
    """The figures of the worker, KV server or proxy whose unit is ``unit``."""
    spark_w = max(10, min(60, width - 30))
    for w in snap.workers:
        if w.unit != unit:
            continue
        rows = [("health", _v(w.health if is_na(w.health) else f"{w.health} ({health_short(w.health)})")),
                *_unit_rows(w.state),
                ("running / waiting", Text(f"{num(w.running, '{:.0f}')} / {num(w.waiting, '{:.0f}')}")),
                ("KV cache in use", _v(w.kv_usage if is_na(w.kv_usage) else pct(w.kv_usage))),
                ("engine prefix hit", _v(w.local_hit_rate if is_na(w.local_hit_rate) else pct(w.local_hit_rate))),
                ("connector hit", _v(w.external_hit_rate if is_na(w.external_hit_rate) else
                                     pct(w.external_hit_rate))),
                ("prompt tok/s", _v(w.prompt_tps if is_na(w.prompt_tps) else num(w.prompt_tps, "{:.0f}"))),
                ("generated tok/s", _v(w.gen_tps if is_na(w.gen_tps) else num(w.gen_tps, "{:.0f}"))),
                ("preemptions/s", _v(w.preemptions if is_na(w.preemptions) else num(w.preemptions, "{:.2f}"))),
                ("breaker", _v(w.breaker)),
                *([("rotation", Text(f"out: {drained_text(w)}", style="cyan"))] if drained_text(w) else []),
                ("legs open (F/P/D)", Text(legs_text(w.legs_inflight))),
                ("legs/s (F/P/D)", Text(" / ".join(num(x, "{:.2f}") for x in
                                                   (w.legs_per_s.full, w.legs_per_s.prefill, w.legs_per_s.decode))))]
        for g in snap.gpus:
            if g.index in w.gpus:
                h = snap.history
                rows += [(f"GPU {g.index}", Text(f"{g.name} · {num(g.util_pct, '{:.0f}%')} util · "
                                                 f"{gib(g.mem_used_bytes)}/{gib(g.mem_total_bytes)} · "
                                                 f"{num(g.temp_c, '{:.0f}C')} · {num(g.power_w, '{:.0f}W')}")),
                         ("  util history", spark(h.get(f"gpu{g.index}:util", ()), spark_w, 100.0, "green")),
                         ("  memory history", spark(h.get(f"gpu{g.index}:mem", ()), spark_w, 1.0, "bright_blue"))]
        if not w.gpus:
            rows.append(("GPU", Text("none (CPU engine)", style="dim")))
        return _table(rows)
    k, p = snap.kv, snap.proxy
    if unit == k.unit:
        return _table([("health", _v(k.health)), *_unit_rows(k.state), ("url", Text(k.url)),
                       ("hit rate", _v(k.hit_rate if is_na(k.hit_rate) else pct(k.hit_rate))),
                       ("L1 used", Text(f"{gib(k.l1_used_bytes)} / {gib(k.l1_total_bytes)} ({pct(k.l1_usage)})")),
                       ("evictions/s", _v(k.evictions_per_s)), ("lookups/s", _v(k.lookups_per_s)),
                       ("sessions", _v(k.active_sessions))])
    if unit == p.unit:
        br = p.breakers if is_na(p.breakers) else ", ".join(f"{b} {s}" for b, s in p.breakers) or "none"
        return _table([("health", _v(p.health)), ("ready", _v(p.ready)), *_unit_rows(p.state),
                       ("url", Text(p.url)), ("uptime", Text(duration(p.uptime_s))),
                       ("req/s", _v(p.req_per_s)), ("in flight", _v(p.inflight)),
                       ("TTFT p50 / p95", Text(f"{secs(p.ttft_p50_s)} / {secs(p.ttft_p95_s)}")),
                       ("decisions", Text(decisions_text(p.decisions))),
                       ("conversations", Text(sessions_text(p.sessions))),
                       ("P leg skipped", Text(skipped_text(p.pd_skipped))),
                       ("retries/s", _v(p.retries_per_s)), ("breakers", _v(br)), *_admission_rows(p.admission)])
    return _table([("unit", Text(f"{unit}: not in this snapshot", style="dim")), ("", Text(text("")))])
