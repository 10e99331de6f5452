"""What-if planning: every feasible prefill/decode split of a box's GPUs, run on the twin's simulator.

Answers "how should I split these GPUs, and what will the box hold?" before the GPUs are rented. For each
split (P prefillers + D decoders, P + D = the usable GPUs / TP) it simulates the workload at each asked
rate and reports the delivered ceiling and TTFT p50/p95. The recommended split is the one that holds the
highest rate with TTFT p95 under the SLO and no failures (objective ``max-rate-under-slo``; found on the
asked rates, then refined by bisection between the last rate that held and the next one, capped at the
delivered ceiling); ties go
to the higher ceiling (0.1 req/s resolution), then to the lower TTFT p95 at that rate, then to fewer GPUs.

"Delivered" is ``vllm bench serve``'s request throughput (completed / time to the last completion), so it
includes the drain of the last requests: with few prompts at a high rate it understates what the box
holds. The seed ran 600 prompts per rate; so does the default here.

The simulator needs one hardware profile, so a mixed box is planned on its largest group of same-kind GPUs
(said in ``notes``). Pure: the inventory is handed in, nothing is probed.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

from appliance.twin.costmodel import EngineConfig
from appliance.twin.hardware import HardwareError, resolve as resolve_hw
from appliance.twin.simulator import SimError, Workload, simulate

from . import BenchError

OBJECTIVES = ("max-rate-under-slo",)


@dataclass(frozen=True)
class RatePoint:
    asked: float
    delivered: float
    ttft_p50_s: float
    ttft_p95_s: float
    failed: int
    under_slo: bool


@dataclass(frozen=True)
class SplitResult:
    prefill: int
    decode: int
    tp: int
    points: tuple                       # RatePoint per asked rate
    ceiling: float                      # highest delivered req/s over the asked rates
    max_rate_under_slo: float           # highest rate with TTFT p95 <= SLO and no failures (0: none), refined
    #                                     by bisection between the last asked rate that held and the next one
    recommended: bool = False
    holds_all: bool = False             # every asked rate held: the true limit is above the highest one

    @property
    def name(self) -> str:
        return f"{self.prefill}P{self.decode}D" + (f" TP{self.tp}" if self.tp > 1 else "")

    def point(self, rate: float) -> Optional[RatePoint]:
        return next((p for p in self.points if p.asked == rate), None)


@dataclass(frozen=True)
class WhatIf:
    hardware: str
    model: str
    workload: Workload
    rates: tuple
    slo_ttft_p95_s: float
    policy: str
    rows: tuple                         # SplitResult, best first
    notes: tuple = field(default_factory=tuple)
    engines: int = 0                    # engines the box has room for (GPUs // TP)

    @property
    def recommended(self) -> Optional[SplitResult]:
        return next((r for r in self.rows if r.recommended), None)

    def to_json(self) -> dict:
        return {"hardware": self.hardware, "model": self.model, "policy": self.policy,
                "workload": {"input_len": self.workload.input_len, "prefix_len": self.workload.prefix_len,
                             "output_len": self.workload.output_len},
                "rates": list(self.rates), "slo_ttft_p95_s": self.slo_ttft_p95_s, "notes": list(self.notes),
                "engines": self.engines,
                "splits": [{"split": r.name, "prefill": r.prefill, "decode": r.decode, "tp": r.tp,
                            "ceiling": r.ceiling, "max_rate_under_slo": r.max_rate_under_slo,
                            "holds_all_rates": r.holds_all, "recommended": r.recommended,
                            "points": [p.__dict__ for p in r.points]} for r in self.rows]}


def _gpu_group(inventory) -> tuple[str, int, list]:
    """(NVML name, count) of the largest same-kind GPU group, and notes."""
    names = [g.name for g in inventory.gpus if not getattr(g, "mig_mode", None) == "enabled"]
    if not names:
        raise BenchError("what-if needs GPUs: the inventory has none (use --gpus fake:3xA100-80GB to plan a box "
                         "you do not have)")
    kinds = Counter(names)
    name, n = kinds.most_common(1)[0]
    notes = []
    if len(kinds) > 1:
        notes.append(f"mixed GPUs {dict(kinds)}: planned on the {n} x {name} only")
    return name, n, notes


def splits(n_engines: int) -> list[tuple[int, int]]:
    """Every (prefillers, decoders) with >= 1 of each and at most ``n_engines`` in all: a split may leave
    GPUs idle, so the table also answers "would fewer GPUs do?" (1P1D on a 3-GPU box)."""
    return [(p, d) for total in range(2, n_engines + 1) for p in range(1, total) for d in (total - p,)]


def what_if(inventory, model: str, workload: Workload = Workload(), rates: Sequence[float] = (1, 2, 5, 10, 20),
            *, slo_ttft_p95_s: float = 3.5, policy: str = "round-robin", tp: int = 1, num_prompts: int = 600,
            seed: int = 2003, kv_size_gb: float = 80.0, objective: str = "max-rate-under-slo",
            refine: int = 4) -> WhatIf:
    """Simulate each feasible P/D split of ``inventory``'s GPUs; rows best first, the recommended one marked."""
    if objective not in OBJECTIVES:
        raise BenchError(f"--objective {objective!r}: use one of {', '.join(OBJECTIVES)}")
    if tp < 1:
        raise BenchError(f"--tp must be >= 1, got {tp}")
    if not slo_ttft_p95_s > 0:
        raise BenchError(f"TTFT p95 SLO must be > 0 s, got {slo_ttft_p95_s}")
    rates = tuple(float(r) for r in rates)
    if not rates or any(not r > 0 or math.isinf(r) for r in rates):
        raise BenchError(f"--rates must be finite numbers > 0, got {list(rates)}")
    gpu_name, n_gpus, notes = _gpu_group(inventory)
    try:
        hw = resolve_hw(gpu_name)
    except HardwareError as exc:
        raise BenchError(f"what-if: {exc} (the twin has no cost profile for {gpu_name!r})") from None
    n_engines = n_gpus // tp
    if n_gpus % tp:
        notes.append(f"{n_gpus % tp} GPU(s) left out: {n_gpus} is not a multiple of TP {tp}")
    if n_engines < 2:
        raise BenchError(f"what-if needs >= 2 engines to split into prefill and decode; {n_gpus} x {gpu_name} at "
                         f"TP {tp} gives {n_engines}")
    rates = tuple(sorted(set(rates)))

    def sim(p: int, d: int, rs: Sequence[float]) -> list:
        try:
            return simulate(hw, model, p, d, workload, rs, num_prompts=num_prompts, policy=policy, seed=seed,
                            engine=EngineConfig(tp=tp), kv_size_gb=kv_size_gb)
        except SimError as exc:
            raise BenchError(f"what-if: {exc}") from None

    def holds(s: dict) -> bool:
        return s["p95_ttft_ms"] / 1000 <= slo_ttft_p95_s and s["failed"] == 0

    rows = []
    for p, d in splits(n_engines):
        res = sim(p, d, rates)
        pts = tuple(RatePoint(asked=r, delivered=s["request_throughput"], ttft_p50_s=s["p50_ttft_ms"] / 1000,
                              ttft_p95_s=s["p95_ttft_ms"] / 1000, failed=s["failed"], under_slo=holds(s))
                    for r, s in zip(rates, res))
        ok = [i for i, pt in enumerate(pts) if pt.under_slo]
        best_ok = pts[ok[-1]].asked if ok else 0.0
        ceiling = max(pt.delivered for pt in pts)
        if ok and ok[-1] + 1 < len(pts):           # bisect the knee between the last rate held and the next,
            # never above the delivered ceiling: a short run past capacity can keep its TTFT p95 low by luck
            # of timing (the queue has not grown yet), which is no rate to plan for
            lo, hi = best_ok, min(pts[ok[-1] + 1].asked, max(best_ok, ceiling))
            for _ in range(refine):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if holds(sim(p, d, [mid])[0]) else (lo, mid)
            best_ok = lo
        rows.append(SplitResult(p, d, tp, pts, ceiling, best_ok,
                                holds_all=bool(ok) and ok[-1] == len(pts) - 1))

    def key(r: SplitResult):
        at = max((p for p in r.points if p.under_slo), key=lambda p: p.asked, default=None)
        return (-round(r.max_rate_under_slo, 2), -round(r.ceiling, 1), at.ttft_p95_s if at else math.inf,
                r.prefill + r.decode, r.prefill)

    rows.sort(key=key)
    if rows[0].max_rate_under_slo > 0:
        rows[0] = SplitResult(**{**rows[0].__dict__, "recommended": True})
    else:
        notes.append(f"no split holds TTFT p95 <= {slo_ttft_p95_s:g}s at any asked rate: lower the rates, "
                     "add GPUs or relax the SLO")
    return WhatIf(hw.name, model, workload, rates, slo_ttft_p95_s, policy, tuple(rows), tuple(notes), n_engines)


def render(w: WhatIf) -> str:
    """Table: one row per split, ceiling and TTFT p50/p95 per rate; ``*`` marks the recommended split."""
    wl = w.workload
    out = [f"what-if: {w.model} on up to {w.engines} engines of {w.hardware} ({w.policy} routing); workload "
           f"{wl.prefix_len}+{wl.input_len - wl.prefix_len} in / {wl.output_len} out; SLO TTFT p95 <= "
           f"{w.slo_ttft_p95_s:g}s"]
    head = f"  {'split':<10} {'ceiling':>8} {'max@SLO':>8}"
    for r in w.rates:
        head += f"  {f'{r:g}/s p50/p95 s':>17}"
    out.append(head)
    for row in w.rows:
        held = (">=" if row.holds_all else "") + f"{row.max_rate_under_slo:.3g}"
        line = f"{'*' if row.recommended else ' '} {row.name:<10} {row.ceiling:>8.2f} {held:>8}"
        for p in row.points:
            cell = f"{p.ttft_p50_s:.2f}/{p.ttft_p95_s:.2f}" + ("" if p.under_slo else "!")
            line += f"  {cell:>17}"
        out.append(line)
    rec = w.recommended
    out.append(f"* recommended: {rec.name} (holds {'>= ' if rec.holds_all else ''}{rec.max_rate_under_slo:.3g} "
               f"req/s under the SLO, ceiling {rec.ceiling:.2f} req/s)" if rec else "no split meets the SLO")
    if any(r.holds_all for r in w.rows):
        out.append(">= : held at every asked rate; ask higher --rates to find where it stops")
    out.append("! = TTFT p95 over the SLO (or failures) at that rate; ceiling = highest delivered req/s")
    out.extend(f"note: {n}" for n in w.notes)
    return "\n".join(out)
