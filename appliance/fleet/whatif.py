"""What-if for a fleet: N identical boxes behind the router, from the twin's calibrated simulator.

Model: the router splits the fleet's Poisson arrivals evenly (a split Poisson stream is Poisson), and each
box holds the shared system prompt after its first request, so a fleet of N boxes at rate R behaves like
N independent boxes at R/N. The router's own hop (about a millisecond on a LAN) is not modelled.
Each box runs ``num_prompts`` prompts per rate, the seed's ``vllm bench serve`` method (600 per rate), so
"delivered" is completed / duration per box (the drain of the last requests included), summed over boxes.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..settings.schema import default as _d
from .plan import FleetError


@dataclass(frozen=True)
class WhatIfRow:
    boxes: int
    gpus: int
    rate: float              # fleet requests/s asked
    delivered: float         # fleet requests/s completed
    ttft_p50_s: float
    ttft_p95_s: float
    tpot_p50_ms: float
    kv_hit_rate: float


def fleet_whatif(boxes: list, rates: list, prefill: int = 1, decode: int = 2, hardware: str = "a100-80gb",
                 model: str = _d("install", "model"), num_prompts: int = 600, tp: int = 1, seed: int = 2003) -> list:
    from ..twin.simulator import SimError, simulate
    if not boxes or any(n < 1 for n in boxes):
        raise FleetError(f"--boxes {boxes}: give counts >= 1, e.g. 1,2,4")
    if num_prompts < 100:
        raise FleetError(f"--num-prompts {num_prompts}: use >= 100 so percentiles mean something")
    rows = []
    for n in boxes:
        for r in rates:
            try:
                res = simulate(hardware=hardware, model=model, prefill=prefill, decode=decode, rates=[r / n],
                               num_prompts=num_prompts, policy="pdctl", seed=seed)[0]
            except SimError as exc:
                raise FleetError(str(exc)) from None
            rows.append(WhatIfRow(boxes=n, gpus=n * (prefill + decode) * tp, rate=float(r),
                                  delivered=res["request_throughput"] * n, ttft_p50_s=res["p50_ttft_ms"] / 1000,
                                  ttft_p95_s=res["p95_ttft_ms"] / 1000, tpot_p50_ms=res["p50_tpot_ms"],
                                  kv_hit_rate=res["kv_hit_rate"]))
    return rows


def render_markdown(rows: list, slo_s: float = 2.0) -> str:
    out = ["| boxes | GPUs | asked req/s | delivered req/s | TTFT p50 s | TTFT p95 s | TPOT p50 ms |",
           "|---|---|---|---|---|---|---|"]
    for w in rows:
        out.append(f"| {w.boxes} | {w.gpus} | {w.rate:g} | {w.delivered:.1f} | {w.ttft_p50_s:.2f} | "
                   f"{w.ttft_p95_s:.2f} | {w.tpot_p50_ms:.1f} |")
    out.append("")
    for n in sorted({w.boxes for w in rows}):
        ok = [w.rate for w in rows if w.boxes == n and w.ttft_p95_s <= slo_s]
        out.append(f"- {n} box(es): highest asked rate with TTFT p95 <= {slo_s:g} s: "
                   + (f"{max(ok):g} req/s" if ok else "none of the rates tried"))
    return "\n".join(out) + "\n"
