"""TTFT, KV and traffic panels: headline numbers (and the TTFT chart with its SLO line)."""
from __future__ import annotations

from rich.text import Text

from appliance.collector.snapshot import Snapshot
from appliance.inventory import is_na
from appliance.status import gib, num, pct, secs, skipped_text


def _line(t: Text, label: str, value: str, style: str = "bold") -> None:
    t.no_wrap, t.overflow = True, "ellipsis"
    if t.plain:
        t.append("\n")
    t.append(f"{label} ", style="dim")
    t.append(value, style="dim" if value == "NA" else style)


def ttft_text(snap: Snapshot) -> Text:
    p, slo = snap.proxy, snap.slo_ttft_s
    t = Text()
    over = not is_na(slo) and not is_na(p.ttft_p95_s) and p.ttft_p95_s > slo
    t.append("p50 ", style="dim")
    t.append(secs(p.ttft_p50_s), style="bold")
    t.append(" p95 ", style="dim")
    t.append(secs(p.ttft_p95_s), style="bold red" if over else "bold")
    t.append(" SLO ", style="dim")
    t.append(secs(slo), style="yellow")
    return t


def kv_text(snap: Snapshot) -> Text:
    lay, k = snap.kv_layers, snap.kv
    t = Text()
    _line(t, "engine ", pct(lay.engine_local))
    _line(t, "connect", pct(lay.connector))
    _line(t, "kv srv ", pct(lay.kv_server))
    _line(t, "L1     ", f"{pct(k.l1_usage)}/{gib(k.l1_total_bytes)}" if not is_na(k.l1_usage)
          else "NA")
    _line(t, "evict/s", num(k.evictions_per_s))
    return t


def traffic_text(snap: Snapshot) -> Text:
    tr, p = snap.traffic, snap.proxy
    t = Text()
    _line(t, "req/s  ", num(tr.req_per_s))
    _line(t, "in  t/s", num(tr.prompt_tps, "{:.0f}"))
    _line(t, "out t/s", num(tr.gen_tps, "{:.0f}"))
    _line(t, "retry/s", num(p.retries_per_s, "{:.2f}"))
    _line(t, "PD skip", skipped_text(p.pd_skipped))
    return t
