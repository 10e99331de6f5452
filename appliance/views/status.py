"""``pdctl status [--json]``: one Snapshot as text or JSON. The formatting helpers are shared with the TUI."""
from __future__ import annotations

import json
from typing import Any

from appliance.collector import rollout as RO
from appliance.collector.snapshot import (Admission, DecisionMix, LegCounts, Rollout, SessionMix, Snapshot,
                                         UnitState, WorkerStatus)
from appliance.inventory import NA, is_na
from appliance.policy.decide import AGGREGATE, SPLIT

GiB = 1024 ** 3


def pct(v: Any, digits: int = 0) -> str:
    return "NA" if is_na(v) else f"{100 * v:.{digits}f}%"


def num(v: Any, fmt: str = "{:.1f}") -> str:
    return "NA" if is_na(v) else fmt.format(v)


def secs(v: Any) -> str:
    if is_na(v):
        return "NA"
    return f"{v * 1000:.0f}ms" if v < 1 else f"{v:.2f}s"


def gib(v: Any) -> str:
    if is_na(v):
        return "NA"
    g = v / GiB
    return f"{g:.0f}G" if g >= 10 else f"{g:.1f}G"


def duration(v: Any) -> str:
    if is_na(v):
        return "NA"
    s = int(v)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}d{h:02d}h" if d else (f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s")


def unit_text(st: UnitState) -> str:
    """Short unit state: active, failed, inactive, restarting (auto-restart), starting, stopping."""
    if is_na(st.active):
        return "-" if "not a systemd host" in st.active.reason else "NA"
    if st.sub == "auto-restart":
        return "restarting"
    return {"activating": "starting", "deactivating": "stopping"}.get(st.active, st.active)


def drained_text(w: WorkerStatus) -> str:
    """``drained (rollout)`` while the proxy holds the worker out of rotation, else "" (NA: the proxy's status
    did not answer; the breakers' NA says why)."""
    return f"drained ({w.drained})" if isinstance(w.drained, str) and w.drained else ""


def worker_state(w: WorkerStatus) -> str:
    """The worker's unit state, or ``drained (rollout)`` for an active worker the proxy holds out of rotation
    (``restarting, drained`` when its unit is not active)."""
    s, held = unit_text(w.state), drained_text(w)
    if not held:
        return s
    return held if s in ("active", "-", "NA") else f"{s}, drained"


def rollout_text(r: Any) -> str:
    """The rollout line (``rollout: 2/4 decode-1 draining (3 legs still open) for 12 s``), or "" when none runs
    (a state file that does not read is NA: ``na_notes`` says why)."""
    return RO.line(r) if isinstance(r, Rollout) else ""


def text(v: Any) -> str:
    return "NA" if is_na(v) else str(v)


def health_short(v: Any) -> str:
    """``ok`` / ``HTTP 503`` / ``starting`` / ``down`` (refused) / ``NA``: fits a narrow column."""
    if is_na(v):
        return "down" if "refused" in v.reason else "NA"
    if v == "ok":
        return "ok"
    if v.startswith("unhealthy (HTTP "):
        return "HTTP " + v[len("unhealthy (HTTP "):].rstrip(")")
    return v.split(" ", 1)[0]


def skipped_text(v: Any) -> str:
    if is_na(v):
        return "NA"
    return ", ".join(f"{r} {n:.0f}" for r, n in v) or "none"


def share(v: float) -> str:
    """A share as a whole percent; a share too small to round to 1 % still says it happened."""
    return "<1%" if 0 < v < 0.005 else f"{100 * v:.0f}%"


def decisions_text(mix: DecisionMix, short: bool = False) -> str:
    """``82% aggregated (few_uncached 80%, prefill_backlog 2%), 18% split (long_uncached 18%)``, or NA.

    ``short`` (a narrow screen): ``agg 82% (few_uncached 80%, ...) split 18% (long_uncached 18%)``."""
    if is_na(mix.aggregated) or is_na(mix.reasons):
        return "NA"
    parts = []
    for kind, v, word in ((AGGREGATE, mix.aggregated, "agg" if short else "aggregated"),
                          (SPLIT, mix.split, "split")):
        why = ", ".join(f"{r.reason} {share(r.share)}" for r in mix.reasons if r.kind == kind)
        head = f"{word} {share(v)}" if short else f"{share(v)} {word}"
        parts.append(f"{head} ({why})" if why else head)
    return (" " if short else ", ").join(parts)


def sessions_text(mix: SessionMix) -> str:
    """``stayed 90%, moved_load 6%, new 4%`` (named conversations' turns in the window), ``none named``, or NA."""
    if is_na(mix.outcomes):
        return "NA"
    if not mix.outcomes:
        return "none named (X-Session-Id or user)"
    return ", ".join(f"{o} {share(s)}" for o, _, s in mix.outcomes)


def per_s(v: Any, fmt: str = "{:.2f}") -> str:
    """``0.50/s``, or ``NA`` (never ``NA/s``)."""
    return "NA" if is_na(v) else fmt.format(v) + "/s"


def refusals_text(adm: Admission, top: int = 3) -> str:
    """The reasons of the refusals in the window, most first: ``deadline 0.40, queue_full 0.10``, ``none``, NA."""
    if is_na(adm.refusals):
        return "NA"
    shown = ", ".join(f"{r.reason} {r.per_s:.2f}" for r in adm.refusals[:top])
    more = len(adm.refusals) - top
    return (shown + (f", +{more} more" if more > 0 else "")) or "none"


def admission_text(adm: Admission) -> str:
    """``slo  goodput 3.9 req/s  refused 0.50/s (deadline 0.40)  queue 3 (wait p95 420ms)  admitted 4.10/s``:
    the goodput always beside the refusals (a goodput that hides its refusals is inflated), or NA with why."""
    if is_na(adm.refused_per_s) and is_na(adm.queue_depth):
        return f"NA ({adm.refused_per_s.reason})"
    why = refusals_text(adm)
    refused = per_s(adm.refused_per_s) + (f" ({why})" if why not in ("NA", "none") else "")
    wait = "" if is_na(adm.queue_wait_p95_s) else f" (wait p95 {secs(adm.queue_wait_p95_s)})"
    good = num(adm.goodput) + ("" if is_na(adm.goodput) else " req/s")
    return (f"{text(adm.mode)}  goodput {good}  refused {refused}  "
            f"queue {num(adm.queue_depth, '{:.0f}')}{wait}  admitted {per_s(adm.admitted_per_s)}")


def legs_text(legs: LegCounts, short: bool = False) -> str:
    """Legs of each kind on one worker: ``full 3 / P 0 / D 1`` (``short``: ``F3 P0 D1``), or NA."""
    vals = (legs.full, legs.prefill, legs.decode)
    if any(is_na(v) for v in vals):
        return "NA"
    if short:
        return " ".join(f"{k}{v:.0f}" for k, v in zip("FPD", vals))
    return " / ".join(f"{k} {v:.0f}" for k, v in zip(("full", "P", "D"), vals))


def na_notes(snap: Snapshot) -> list[str]:
    """Distinct reasons behind the NAs a reader sees, source-labelled (the 'why' of a degraded view)."""
    notes: list[str] = []

    def add(label: str, v: Any) -> None:
        if isinstance(v, NA):
            line = f"{label}: {v.reason}"
            if line not in notes:
                notes.append(line)
    add("gpus", snap.gpu_source)
    add("proxy", snap.proxy.health)
    add("proxy metrics", snap.proxy.ttft_p50_s)
    add("breakers", snap.proxy.breakers)
    mix = snap.proxy.decisions.aggregated
    if is_na(mix) and not any(n.endswith(": " + mix.reason) for n in notes):    # not "proxy down" again
        add("decisions", mix)
    adm = snap.proxy.admission
    for label, v in (("admission", adm.refused_per_s), ("admission mode", adm.mode), ("goodput", adm.goodput)):
        if is_na(v) and not any(n.endswith(": " + v.reason) for n in notes):
            add(label, v)
        if label == "admission" and is_na(v):      # an older or absent proxy: its mode and goodput say the same
            break
    add("kv server", snap.kv.health)
    add("kv metrics", snap.kv.hit_rate)
    for w in snap.workers:
        add(w.instance, w.health)
        add(f"{w.instance} metrics", w.running)
        if not snap.units_note:
            add(f"{w.instance} unit", w.state.active)
    if snap.units_note:
        notes.append(f"units: {snap.units_note}")
    else:
        add("kv unit", snap.kv.state.active)
        add("proxy unit", snap.proxy.state.active)
    add("TTFT SLO", snap.slo_ttft_s)
    add("TPOT", snap.tpot_p50_s)
    add("prefill saved", snap.kv_layers.prefill_saved)
    add("migrations", snap.traffic.migrations_per_s)
    add("rollout", snap.rollout)
    return notes


def render_text(snap: Snapshot) -> str:
    out = []
    reasons = f" ({'; '.join(snap.overall_reasons)})" if snap.overall_reasons else ""
    gpus = f"{snap.gpu_count}x {snap.gpu_model}" if not is_na(snap.gpu_model) else "no GPUs"
    out.append(f"pdctl {snap.mode} {snap.engine} {snap.engine_version}  model {snap.model}  {gpus}  "
               f"{snap.overall.upper()}{reasons}  uptime {duration(snap.uptime_s)}")
    if isinstance(snap.rollout, Rollout):
        r = snap.rollout
        out.append(f"{rollout_text(r)}   (pdctl apply pid {r.pid}, started {RO.ago(r.age_s)} ago)")
    if snap.units_note:
        out.append(f"units    {snap.units_note}")
    t = snap.traffic
    out.append(f"traffic  {num(t.req_per_s)} req/s  prompt {num(t.prompt_tps, '{:.0f}')} tok/s  "
               f"gen {num(t.gen_tps, '{:.0f}')} tok/s  errors {num(t.errors_per_s, '{:.2f}')}/s  "
               f"migrations {num(t.migrations_per_s, '{:.2f}')}/s  running {num(t.running, '{:.0f}')}  "
               f"waiting {num(t.waiting, '{:.0f}')}   (window {snap.window_s:.1f}s)")
    p = snap.proxy
    slo = "" if is_na(snap.slo_ttft_s) else f"  SLO {secs(snap.slo_ttft_s)}"
    out.append(f"TTFT     p50 {secs(p.ttft_p50_s)}  p95 {secs(p.ttft_p95_s)}{slo}   "
               f"PD skipped: {skipped_text(p.pd_skipped)}  retries {num(p.retries_per_s, '{:.2f}')}/s")
    slo = "" if is_na(snap.slo_tpot_s) else f"  SLO {secs(snap.slo_tpot_s)}"
    out.append(f"TPOT     p50 {secs(snap.tpot_p50_s)}  p95 {secs(snap.tpot_p95_s)}{slo}")
    mix = p.decisions
    why = f" ({mix.aggregated.reason})" if is_na(mix.aggregated) else f"   ({mix.decided:.0f} in the window)"
    out.append(f"decisions {decisions_text(mix)}{why}")
    out.append(f"admission {admission_text(p.admission)}")
    sm = p.sessions
    why = f" ({sm.outcomes.reason})" if is_na(sm.outcomes) else \
        (f"   ({sm.named:.0f} named turns in the window)" if sm.outcomes else "")
    out.append(f"conversations {sessions_text(sm)}{why}")
    k, lay = snap.kv, snap.kv_layers
    out.append(f"KV       prefill saved {pct(lay.prefill_saved)}   hit: engine {pct(lay.engine_local)}  "
               f"connector {pct(lay.connector)}  "
               f"kv-server {pct(lay.kv_server)}   L1 {gib(k.l1_used_bytes)}/{gib(k.l1_total_bytes)} "
               f"({pct(k.l1_usage)})  evictions {num(k.evictions_per_s, '{:.1f}')}/s")
    out.append("")
    rows = [("kvserver", k.state, unit_text(k.state), k.health, "", "", "", "", "", "", "", "")]
    for w in snap.workers:
        rows.append((w.instance, w.state, worker_state(w), w.health, num(w.running, "{:.0f}"),
                     num(w.waiting, "{:.0f}"), pct(w.kv_usage), pct(w.local_hit_rate), pct(w.external_hit_rate),
                     text(w.breaker), legs_text(w.legs_inflight), ",".join(map(str, w.gpus)) or "-"))
    rows.append(("proxy", p.state, unit_text(p.state), p.health, "", "", "", "", "", "", "", ""))
    uw = max([14] + [len(r[2]) + 2 for r in rows])     # "drained (rollout)" widens the unit column
    out.append(f"{'instance':<12}{'unit':<{uw}}{'health':<10}{'rst':>4} {'run':>4} {'wait':>5} {'kv':>5} "
               f"{'local':>6} {'conn':>6} {'breaker':<9} {'legs in flight':<21}gpus")
    for name, st, state, health, run, wait, kvu, loc, ext, br, legs, gp in rows:
        h = health_short(health)
        out.append(f"{name:<12}{state:<{uw}}{h:<10}{text(st.restarts):>4} {run:>4} {wait:>5} {kvu:>5} "
                   f"{loc:>6} {ext:>6} {br:<9} {legs:<20} {gp}".rstrip())
    out.append("")
    if snap.gpus:
        out.append(f"{'gpu':<4}{'role':<10}{'util':>5} {'memory':>13} {'temp':>5} {'power':>7}  name")
        for g in snap.gpus:
            mem = f"{gib(g.mem_used_bytes)}/{gib(g.mem_total_bytes)}"
            out.append(f"{g.index:<4}{g.role or '-':<10}{num(g.util_pct, '{:.0f}%'):>5} {mem:>13} "
                       f"{num(g.temp_c, '{:.0f}C'):>5} {num(g.power_w, '{:.0f}W'):>7}  {g.name}")
    else:
        out.append(f"gpus: {text(snap.gpu_source)}")
    notes = na_notes(snap)
    if notes:
        out.append("")
        out.append("why NA:")
        out += [f"  {n}" for n in notes]
    return "\n".join(out) + "\n"


def render_json(snap: Snapshot) -> str:
    return json.dumps(snap.to_json(), indent=2)
