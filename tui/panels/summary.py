"""TTFT, KV and traffic panels: headline numbers (and the TTFT chart with its SLO line); the decision mix."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.text import Text

from appliance.collector.snapshot import Snapshot
from appliance.inventory import is_na
from appliance.status import decisions_text, gib, num, pct, secs, share, skipped_text


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



@dataclass(frozen=True)
class Fit:
    """One line in several forms, longest first: renders the first that fits the width it is given (the
    last one, cut with an ellipsis, when none does), so a resize needs no new snapshot."""
    forms: tuple

    def pick(self, width: int) -> Text:
        for t in self.forms:
            if t.cell_len <= width:
                return t
        return self.forms[-1]

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield self.pick(options.max_width)


def _form(*parts: tuple) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    for text, style in parts:
        t.append(text, style=style)
    return t


def mix_text(snap: Snapshot) -> Fit:
    """The decision mix: the status line when it fits, else shorter; the aggregated and split shares come
    first in every form, so an ellipsis only ever cuts reasons."""
    mix = snap.proxy.decisions
    if is_na(mix.aggregated) or is_na(mix.reasons):
        why = mix.aggregated.reason if is_na(mix.aggregated) else mix.reasons.reason
        return Fit((_form(("NA", "dim"), (f" · {why}", "dim")),))
    reasons = ", ".join(f"{r.reason} {share(r.share)}" for r in mix.reasons)
    return Fit((_form((decisions_text(mix), "bold")), _form((decisions_text(mix, short=True), "bold")),
                _form((f"agg {share(mix.aggregated)} split {share(mix.split)}", "bold"),
                      (f" · {reasons}" if reasons else "", ""))))
