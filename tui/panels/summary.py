"""The summary panels: latency (TTFT, TPOT, the goodput line), throughput (refusals and the admission queue
beside it), KV (prefill saved first), the decision mix.

Each function turns a Snapshot into something a widget renders; nothing here computes a figure.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.text import Text

from appliance.collector.snapshot import Snapshot
from appliance.inventory import is_na
from appliance.views.status import decisions_text, gib, num, pct, secs, share

from ..widgets.latency import Series
from ..widgets.rows import Row, Rows


def latency_series(snap: Snapshot) -> tuple:
    h = snap.history
    return (Series("TTFT", snap.proxy.ttft_p50_s, snap.proxy.ttft_p95_s, snap.slo_ttft_s,
                   h.get("ttft_p50", ()), h.get("ttft_p95", ())),
            Series("TPOT", snap.tpot_p50_s, snap.tpot_p95_s, snap.slo_tpot_s,
                   h.get("tpot_p50", ()), h.get("tpot_p95", ())))


def _rate(v: Any, fmt: str = "{:.1f}") -> str:
    return num(v, fmt)


def throughput(snap: Snapshot) -> Rows:
    t, h = snap.traffic, snap.history
    err = t.errors_per_s
    err_style = "bold red" if not is_na(err) and err > 0 else "bold"
    rows = [Row("req/s", _rate(t.req_per_s), h.get("req_per_s", ())),
            Row("in tok/s", _rate(t.prompt_tps, "{:.0f}"), h.get("prompt_tps", ())),
            Row("out tok/s", _rate(t.gen_tps, "{:.0f}"), h.get("gen_tps", ())),
            Row("errors/s", _rate(err, "{:.2f}"), h.get("errors_per_s", ()), style=err_style,
                spark_style="red")]
    mig = t.migrations_per_s
    adm = snap.proxy.admission
    refused = adm.refused_per_s
    rows.append(Row("refused/s", _rate(refused, "{:.2f}"), h.get("refused_per_s", ()) if not is_na(refused) else (),
                    style="bold yellow" if not is_na(refused) and refused > 0 else "bold", spark_style="yellow"))
    depth = adm.queue_depth
    rows.append(Row("queued", _rate(depth, "{:.0f}"), h.get("queue_depth", ()) if not is_na(depth) else (),
                    style="bold yellow" if not is_na(depth) and depth > 0 else "bold", spark_style="yellow"))
    rows.append(Row("migr/s", _rate(mig, "{:.2f}"), h.get("migrations_per_s", ()) if not is_na(mig) else ()))
    return Rows(tuple(rows))


def goodput_line(snap: Snapshot) -> "Fit":
    """The latency panel's last line: the goodput (streamed answers within both SLOs per second), always beside
    the refusals (a goodput that hides its refusals is inflated), then the queue; shorter forms for narrow
    panels, the goodput and the refusals first in every one."""
    adm = snap.proxy.admission
    good, refused, depth = adm.goodput, adm.refused_per_s, adm.queue_depth
    if is_na(good) and is_na(refused):
        return Fit((form(("goodput ", "bold"), ("NA (press ? for why)", "dim")),
                    form(("goodput ", "bold"), ("NA", "dim"))))
    g = (num(good), "dim" if is_na(good) else "bold green")
    r = (num(refused, "{:.2f}"), "dim" if is_na(refused) else ("bold yellow" if refused > 0 else "bold"))
    q = (num(depth, "{:.0f}"), "dim" if is_na(depth) else ("bold yellow" if depth > 0 else "bold"))
    wait = adm.queue_wait_p95_s
    w = [] if is_na(wait) else [(" · wait p95 ", "dim"), (secs(wait), "bold")]
    return Fit((form(("goodput ", "bold"), g, (" req/s in SLO", "dim"), (" · refused ", "dim"), r, ("/s", "dim"),
                     (" · queued ", "dim"), q, *w),
                form(("goodput ", "bold"), g, ("/s", "dim"), (" · refused ", "dim"), r, ("/s", "dim"),
                     (" · queued ", "dim"), q),
                form(("goodput ", "bold"), g, ("/s", "dim"), (" · refused ", "dim"), r, ("/s", "dim")),
                form(("good ", "bold"), g, (" refused ", "dim"), r)))


def kv(snap: Snapshot) -> Rows:
    lay, k = snap.kv_layers, snap.kv
    l1 = f"{pct(k.l1_usage)} {gib(k.l1_total_bytes)}" if not is_na(k.l1_usage) else "NA"
    return Rows((Row("prefill saved", pct(lay.prefill_saved), snap.history.get("prefill_saved", ()),
                     style="bold green", spark_style="green", top=1.0, headline=True),
                 Row("engine prefix", pct(lay.engine_local)),
                 Row("LMCache conn.", pct(lay.connector)),
                 Row("KV server", pct(lay.kv_server), snap.history.get("kv_hit", ()), top=1.0),
                 Row("L1 used", l1),
                 Row("evictions/s", num(k.evictions_per_s))))


KV_TOOLTIP = ("prefill saved: share of the clients' prompt tokens no engine computed (taken from a cache); "
              "a split request's D leg loading what its P leg just computed is a transfer, left out\n"
              "engine prefix: tokens found in each engine's own GPU prefix cache / tokens looked up\n"
              "LMCache conn.: tokens the engines loaded through the LMCache connector / tokens they asked for\n"
              "KV server: hit tokens / requested tokens over every lookup the LMCache server answered\n"
              "L1 used: the KV server's host-RAM cache in use, of its size\n"
              "all over the last window (deltas between samples, never lifetime totals)")


def tooltip(*keys: str) -> str:
    """The help's one-line explanations of these numbers (panels/glossary.py is their one owner)."""
    from .glossary import NUMBERS
    about = dict(NUMBERS)
    return "\n".join(f"{k}: {about[k]}" for k in keys)


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


def form(*parts: tuple) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    for text, style in parts:
        t.append(text, style=style)
    return t


def mix_text(snap: Snapshot) -> Fit:
    """The decision mix: the status line when it fits, else shorter; the aggregated and split shares come
    first in every form, so an ellipsis only ever cuts reasons."""
    mix = snap.proxy.decisions
    head = ("decisions ", "dim")
    if is_na(mix.aggregated) or is_na(mix.reasons):
        why = mix.aggregated.reason if is_na(mix.aggregated) else mix.reasons.reason
        return Fit((form(head, ("NA", "dim"), (f" · {why}", "dim")), form(("NA", "dim"), (f" · {why}", "dim")),
                    form(head, ("NA (press ? for why)", "dim"))))
    reasons = ", ".join(f"{r.reason} {share(r.share)}" for r in mix.reasons)
    n = f"  ({mix.decided:.0f} in {snap.window_s:.0f}s)"
    return Fit((form(head, (decisions_text(mix), "bold"), (n, "dim")), form(head, (decisions_text(mix), "bold")),
                form((decisions_text(mix), "bold")), form((decisions_text(mix, short=True), "bold")),
                form((f"agg {share(mix.aggregated)} split {share(mix.split)}", "bold"),
                     (f" · {reasons}" if reasons else "", "")),
                form((f"agg {share(mix.aggregated)} split {share(mix.split)}", "bold"))))
