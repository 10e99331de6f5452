"""What-if's faces: the table (``render``), the rate list and flags ``pdctl bench|plan --what-if`` take, and the run
behind them (``run_what_if``). The simulation itself is ``whatif.py``.
"""
from __future__ import annotations

import argparse
import json
import math

from ..errors import BenchError
from .profiles import load_profile
from .simulator import Mix, Sessions, Workload
from .whatif import WhatIf, what_if


def render(w: WhatIf) -> str:
    """Table: one row per split, ceiling and TTFT p50/p95 (and TPOT p95 with a TPOT SLO) per rate; ``*``
    marks the recommended split."""
    wl = w.workload
    tpot = w.slo_tpot_p95_ms is not None
    shape = (f"{wl.prefix_len}+{wl.input_len - wl.prefix_len} in / {wl.output_len} out" if isinstance(wl, Workload)
             else wl.describe() if isinstance(wl, Sessions)
             else " + ".join(f"{share:g} x ({c.prefix_len}+{c.input_len - c.prefix_len} in / {c.output_len} out)"
                             for share, c in Mix.of(wl).classes))
    out = [f"what-if: {w.model} on up to {w.engines} engines of {w.hardware} ({w.policy} routing, {w.setup} "
           f"setup); workload "
           f"{shape}; SLO TTFT p95 <= {w.slo_ttft_p95_s:g}s" + (f", TPOT p95 <= {w.slo_tpot_p95_ms:g}ms" if tpot
                                                                 else "")]
    unit = "p50/p95 s,TPOT" if tpot else "p50/p95 s"
    width = 23 if tpot else 17
    head = f"  {'split':<10} {'ceiling':>8} {'max@SLO':>8}"
    for r in w.rates:
        head += f"  {f'{r:g}/s {unit}':>{width}}"
    over = any(row.overload for row in w.rows)
    if over:
        head += "  " + "  ".join(f"{lab:>22}" for lab in ("good@2x (refused)", "good@peak (refused)"))
    out.append(head)
    for row in w.rows:
        held = (">=" if row.holds_all else "") + f"{row.max_rate_under_slo:.3g}"
        line = f"{'*' if row.recommended else ' '} {row.name:<10} {row.ceiling:>8.2f} {held:>8}"
        for r in w.rates:
            p = row.point(r)
            if p is None:
                line += f"  {'-':>{width}}"
                continue
            cell = f"{p.ttft_p50_s:.2f}/{p.ttft_p95_s:.2f}" + (f",{p.tpot_p95_ms:.0f}ms" if tpot else "")
            line += f"  {cell + ('' if p.under_slo else '!'):>{width}}"
        if over:
            for o in (row.overload + (None, None))[:2]:
                cell = f"{o.good_req_s:.3g}/s @{o.asked:.3g} ({o.refused_share:.0%})" if o else "-"
                line += f"  {cell:>22}"
        out.append(line)
    rec = w.recommended
    out.append(f"* recommended: {rec.name} (holds {'>= ' if rec.holds_all else ''}{rec.max_rate_under_slo:.3g} "
               f"req/s under the SLO, ceiling {rec.ceiling:.2f} req/s)" if rec else "no split meets the SLO")
    if any(r.holds_all for r in w.rows):
        out.append(">= : held at every asked rate; ask higher --rates to find where it stops")
    out.append("! = over the SLO (or failures) at that rate; - = not simulated (below a rate that held, or above "
               "one that missed); "
               "ceiling = highest delivered req/s; nB = kv_both engines (soft roles), nP/nD = prefill/decode")
    if over:
        out.append("good@2x / good@peak: requests within both SLOs per second at 2x the family's goodput and at the "
                   "workload's peak rate, with the proxy's admission (refused share in brackets)")
    out.extend(f"note: {n}" for n in w.notes)
    return "\n".join(out)


# ---- the command line of `pdctl plan --what-if` and `pdctl bench --what-if` -------------------------
def parse_rates(text: str, flag: str = "--rates") -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip()
        try:
            r = float(part)
        except ValueError:
            raise BenchError(f"{flag} {text!r}: {part!r} is not a number; use e.g. 1,2,5,10 (inf = all at once)") \
                from None
        if not r > 0 or math.isnan(r):
            raise BenchError(f"{flag} {text!r}: {part!r} must be > 0")
        rates.append(r)
    if not rates:
        raise BenchError(f"{flag} is empty; use e.g. 1,2,5,10")
    return rates


def add_what_if_flags(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """What-if flags; ``pdctl plan`` can add them too (``prefix="what_if_"`` keeps its own dests apart)."""
    p.add_argument("--rates", dest=f"{prefix}rates", default="1,2,5,10,20", help="asked req/s per split")
    p.add_argument("--slo-ttft-p95", dest=f"{prefix}slo", type=float, default=3.5,
                   help="TTFT p95 SLO in seconds (seed's production: 3.5)")
    p.add_argument("--objective", dest=f"{prefix}objective", default="max-rate-under-slo",
                   choices=("max-rate-under-slo",))
    p.add_argument("--workload", dest=f"{prefix}profile", default="seed-p50",
                   help="seed-p50 | seed-p95 | FILE (as pdctl bench --profile)")
    p.add_argument("--sim-prompts", dest=f"{prefix}num_prompts", type=int, default=600,
                   help="simulated prompts per rate (seed: 600)")


def run_what_if(inventory, model: str, args: argparse.Namespace, prefix: str = "", tp: int = 1,
                policy: str = "pdctl", as_json: bool = False) -> int:
    """Simulate every P/D split of ``inventory`` and print the table (or JSON); BenchError on bad input."""
    prof = load_profile(getattr(args, f"{prefix}profile"))
    n = getattr(args, f"{prefix}num_prompts")
    if n < 1:
        raise BenchError("--sim-prompts must be >= 1")
    w = what_if(inventory, model, Workload(prof.input_len, prof.prefix_len, prof.output_len),
                parse_rates(getattr(args, f"{prefix}rates")), slo_ttft_p95_s=getattr(args, f"{prefix}slo"),
                policy=policy, tp=tp, num_prompts=n, objective=getattr(args, f"{prefix}objective"))
    print(json.dumps(w.to_json(), indent=2) if as_json else render(w))
    return 0
