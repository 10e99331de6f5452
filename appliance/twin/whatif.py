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

from ..errors import BenchError
from .costmodel import CostParams, EngineConfig
from .hardware import HardwareError
from .hardware import resolve as resolve_hw
from .params import PDCTL_SETUP
from .simulator import Sessions, SimError, Workload, simulate

OBJECTIVES = ("max-rate-under-slo",)


@dataclass(frozen=True)
class RatePoint:
    asked: float
    delivered: float
    ttft_p50_s: float
    ttft_p95_s: float
    failed: int
    under_slo: bool
    tpot_p95_ms: float = 0.0
    aggregated: float = 0.0             # share of requests the policy served on one worker (no P leg), 0..1


@dataclass(frozen=True)
class OverloadPoint:
    """One family past its ceiling with the proxy's admission (appliance/policy/admit.py) in the simulator."""
    label: str                          # "2x" | "peak"
    asked: float                        # req/s
    good_req_s: float                   # requests within both SLOs per second of arrivals (goodput)
    refused_share: float                # refused / asked, 0..1 (always beside goodput)
    admitted_in_slo: float              # good / admitted, 0..1


@dataclass(frozen=True)
class SplitResult:
    prefill: int
    decode: int
    tp: int
    points: tuple                       # RatePoint per asked rate
    ceiling: float                      # highest delivered req/s over the asked rates (family="all": also over
    #                                     the bisection's runs and a run at 2x the knee)
    max_rate_under_slo: float           # highest rate with TTFT p95 <= SLO and no failures (0: none), refined
    #                                     by bisection between the last asked rate that held and the next one
    recommended: bool = False
    holds_all: bool = False             # every asked rate held: the true limit is above the highest one
    both: int = 0                       # kv_both engines (soft roles): any leg, or a whole request
    overload: tuple = ()                # OverloadPoint at 2x its goodput and at the workload's peak (admission on)

    @property
    def family(self) -> str:
        """all-both (``3B``), hybrid (``1P2B``) or classic P/D (``1P2D``)."""
        if not self.prefill and not self.decode:
            return f"{self.both}B"
        return f"{self.prefill}P" + (f"{self.decode}D" if self.decode else "") + (f"{self.both}B" if self.both else "")

    @property
    def kind(self) -> str:
        return "all-both" if not (self.prefill or self.decode) else ("hybrid" if self.both else "P/D")

    @property
    def name(self) -> str:
        return self.family + (f" TP{self.tp}" if self.tp > 1 else "")

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
    slo_tpot_p95_ms: Optional[float] = None
    setup: str = PDCTL_SETUP            # the twin's cost parameters (params.SETUPS)

    @property
    def recommended(self) -> Optional[SplitResult]:
        return next((r for r in self.rows if r.recommended), None)

    def to_json(self) -> dict:
        return {"hardware": self.hardware, "model": self.model, "policy": self.policy, "setup": self.setup,
                "workload": {"input_len": self.workload.input_len, "prefix_len": self.workload.prefix_len,
                             "output_len": self.workload.output_len},
                "rates": list(self.rates), "slo_ttft_p95_s": self.slo_ttft_p95_s, "notes": list(self.notes),
                "slo_tpot_p95_ms": self.slo_tpot_p95_ms, "engines": self.engines,
                "splits": [{"split": r.name, "prefill": r.prefill, "decode": r.decode, "both": r.both,
                            "kind": r.kind, "tp": r.tp,
                            "ceiling": r.ceiling, "max_rate_under_slo": r.max_rate_under_slo,
                            "holds_all_rates": r.holds_all, "recommended": r.recommended,
                            "points": [p.__dict__ for p in r.points],
                            "overload": [o.__dict__ for o in r.overload]} for r in self.rows]}


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


def families(n_engines: int) -> list[tuple[int, int, int]]:
    """(prefill, decode, both) on all ``n_engines``: all-both, hybrids (k prefillers + both-workers) and
    classic P/D splits, with k up to half the engines (more prefillers than the rest only on 2-3 engines:
    every measured and simulated workload here is decode-heavy). Fewer engines never hold more."""
    top = max(1, math.ceil(n_engines / 2)) if n_engines > 3 else n_engines - 1
    out = [(0, 0, n_engines)]
    out += [(k, 0, n_engines - k) for k in range(1, top + 1)]
    out += [(k, n_engines - k, 0) for k in range(1, top + 1)]
    return out


def prompts_for(rate: float, num_prompts: int, min_window_s: float) -> int:
    """Prompts one simulated rate runs: ``num_prompts``, or more to fill ``min_window_s`` of arrivals (a short
    run past capacity ends before its queue grows and reads as holding). The planner's numbers for it are
    ``families.PLAN_PROMPTS`` / ``PLAN_WINDOW_S`` (``families.plan_prompts``)."""
    return max(num_prompts, math.ceil(rate * min_window_s)) if math.isfinite(rate) else num_prompts


def lifetime_run(run, rate: float, holds, num_prompts: int, min_window_s: float, lifetimes: float) -> tuple:
    """One rate on ``prompts_for``'s window, and a run that ``holds`` again on ``lifetimes`` x its mean answer
    lifetime (mean E2E) of arrivals when longer (a stack that starts empty has a free slot for every request for
    about one lifetime: near capacity a short run ends before its queue grows). ``run(n)``: n prompts at ``rate``.
    (summary, whether it spans ``lifetimes`` lifetimes, its ``sustained_throughput`` then a steady state)."""
    s = run(n := prompts_for(rate, num_prompts, min_window_s))
    if not lifetimes > 0 or not holds(s):
        return s, False
    need = math.ceil(rate * lifetimes * s["mean_e2el_ms"] / 1000)
    return (s, True) if need <= n else (run(need), True)


def what_if(inventory, model: str, workload=Workload(), rates: Sequence[float] = (1, 2, 5, 10, 20),
            *, slo_ttft_p95_s: float = 3.5, policy: str = "round-robin", tp: int = 1, num_prompts: int = 600,
            seed: int = 2003, kv_size_gb: float = 80.0, objective: str = "max-rate-under-slo",
            refine: int = 4, family: str = "pd", slo_tpot_p95_ms: Optional[float] = None,
            thresholds=None, min_window_s: float = 0.0, admission=None, peak_rate: float = 0.0,
            setup: str = PDCTL_SETUP, params: Optional[CostParams] = None, min_lifetimes: float = 0.0) -> WhatIf:
    """Simulate each feasible split of ``inventory``'s GPUs; rows best first, the recommended one marked.

    ``family="pd"``: every P/D split (also on fewer engines), the first round's what-if. ``family="all"``:
    all-both, hybrids and P/D splits on all engines (``families``), each under ``policy`` (the adaptive
    one by default in the planner). With a TPOT SLO a rate holds only when both SLOs hold. ``family="all"``
    runs each rate alone with at least ``min_window_s`` of arrivals (``prompts_for``: a run past capacity
    must last long enough for its queue to grow, or it reads as holding), binary-searches the ladder
    (unsimulated rates show as ``-``) and measures the ceiling past capacity too (a run at 2x the knee). The
    knee is not capped at that ceiling: "delivered" counts the last requests' drain (long answers weigh on
    it), and some stacks deliver less past capacity than they hold under the SLO (the adaptive policy's
    1P3B with cold prompts on 4x H200 holds 16.5 req/s on 160 s windows, and delivers ~11 at 2x).

    ``admission`` (an ``appliance.policy.admit.Policy``, adaptive policy only): each family is also run past its ceiling
    with the proxy's admission, at 2x its goodput and at ``peak_rate``: good req/s beside the share refused.

    ``setup``: the twin's cost parameters (``params.SETUPS``), by default pdctl's own on the GPU's fit (what the
    plan runs); ``"seed"`` replays the seed's stack. ``params``: these cost parameters instead (``setup`` then
    only names them). ``min_lifetimes`` > 0: the planner's rule (``families.PLAN_LIFETIMES``, ``lifetime_run``;
    the ceiling also counts the steady state of those runs and of the run at 2x the knee)."""
    return _what_if(_gpu_setup(inventory, tp), model, workload, rates, slo_ttft_p95_s=slo_ttft_p95_s,
                    policy=policy, tp=tp, num_prompts=num_prompts, seed=seed, kv_size_gb=kv_size_gb,
                    objective=objective, refine=refine, family=family, slo_tpot_p95_ms=slo_tpot_p95_ms,
                    thresholds=thresholds, min_window_s=min_window_s, admission=admission, peak_rate=peak_rate,
                    setup=setup, params=params, min_lifetimes=min_lifetimes)


def _gpu_setup(inventory, tp: int) -> tuple:
    if tp < 1:
        raise BenchError(f"--tp must be >= 1, got {tp}")
    return _gpu_group(inventory)


def what_if_engines(gpu_name: str, n_gpus: int, model: str, workload, rates: Sequence[float], **kw) -> WhatIf:
    """``what_if`` for a box described by its GPU kind and count (the planner's view, no Inventory)."""
    return _what_if((gpu_name, n_gpus, []), model, workload, rates, **kw)


def _what_if(box: tuple, model: str, workload, rates: Sequence[float], *, slo_ttft_p95_s: float, policy: str,
             tp: int, num_prompts: int, seed: int, kv_size_gb: float, objective: str, refine: int, family: str,
             slo_tpot_p95_ms: Optional[float], thresholds, min_window_s: float = 0.0, admission=None,
             peak_rate: float = 0.0, setup: str = PDCTL_SETUP, params: Optional[CostParams] = None,
             min_lifetimes: float = 0.0) -> WhatIf:
    if objective not in OBJECTIVES:
        raise BenchError(f"--objective {objective!r}: use one of {', '.join(OBJECTIVES)}")
    if tp < 1:
        raise BenchError(f"--tp must be >= 1, got {tp}")
    if not slo_ttft_p95_s > 0:
        raise BenchError(f"TTFT p95 SLO must be > 0 s, got {slo_ttft_p95_s}")
    rates = tuple(float(r) for r in rates)
    if not rates or any(not r > 0 or math.isinf(r) for r in rates):
        raise BenchError(f"--rates must be finite numbers > 0, got {list(rates)}")
    gpu_name, n_gpus, notes = box[0], box[1], list(box[2])
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
    try:
        params = params or CostParams.for_setup(setup, hw.name)
    except ValueError as exc:
        raise BenchError(f"what-if: {exc}") from None

    extra = {"thresholds": thresholds} if thresholds is not None else {}
    if isinstance(workload, Sessions):     # a conversation lasts its turns: fill the box, then a steady state
        min_window_s = max(min_window_s, workload.steady_window_s())

    life: dict = {}     # rate -> mean answer lifetime (s) of its run, for the runs that held on ``cur`` of them
    steady: list = []   # steady-state completion rates of the runs on ``cur`` lifetimes
    cur = [0.0]         # the lifetimes rule of the family being searched (0: ``min_window_s`` alone)
    memo: dict = {}     # (p, d, b, rate, prompts) -> summary: the second search reruns its short runs for free

    def run(p: int, d: int, b: int, rs: Sequence[float], n: int) -> list:
        k = (p, d, b, tuple(rs), n)
        try:
            if k not in memo:
                memo[k] = simulate(hw, model, p, d, workload, rs, num_prompts=n, policy=policy, seed=seed,
                                   engine=EngineConfig(tp=tp), kv_size_gb=kv_size_gb, both=b, params=params, **extra)
            return memo[k]
        except SimError as exc:
            raise BenchError(f"what-if: {exc}") from None

    def sim(p: int, d: int, b: int, rs: Sequence[float]) -> list:
        if len(rs) > 1:
            return run(p, d, b, rs, num_prompts)
        s, long = lifetime_run(lambda n: run(p, d, b, rs, n)[0], rs[0], holds, num_prompts, min_window_s, cur[0])
        if long:
            life[rs[0]] = s["mean_e2el_ms"] / 1000
            steady.append(s["sustained_throughput"])
        return [s]

    def holds(s: dict) -> bool:
        ok = s["p95_ttft_ms"] / 1000 <= slo_ttft_p95_s and s["failed"] == 0
        return ok and (slo_tpot_p95_ms is None or s["p95_tpot_ms"] <= slo_tpot_p95_ms)

    def point(r: float, s: dict) -> RatePoint:
        dec = s.get("decisions", {})    # one decision per request: the share is of the requests this run had
        agg = sum(v for k, v in dec.items() if k.startswith("aggregate:"))
        return RatePoint(asked=r, delivered=s["request_throughput"], ttft_p50_s=s["p50_ttft_ms"] / 1000,
                         ttft_p95_s=s["p95_ttft_ms"] / 1000, failed=s["failed"], under_slo=holds(s),
                         tpot_p95_ms=s["p95_tpot_ms"], aggregated=agg / max(1, sum(dec.values())))

    def past(p: int, d: int, b: int, label: str, r: float, knee: float) -> OverloadPoint:
        """The family at ``r`` req/s with admission, on the window of the ceiling's run at 2x the knee."""
        window = max(min_window_s, cur[0] / 4 * life.get(knee, 0.0))
        try:
            s = simulate(hw, model, p, d, workload, [r], num_prompts=prompts_for(r, num_prompts, window),
                         policy=policy, seed=seed, engine=EngineConfig(tp=tp), kv_size_gb=kv_size_gb, both=b,
                         admission=admission, params=params, **extra)[0]
        except SimError as exc:
            raise BenchError(f"what-if: {exc}") from None
        n = s["admitted"] + s["refused"]
        return OverloadPoint(label, r, s["goodput"], s["refused"] / max(1, n), s["good_share_admitted"])

    def row(p: int, d: int, b: int, lifetimes: float) -> SplitResult:
        cur[0] = lifetimes
        life.clear()
        steady.clear()
        if family == "pd":
            pts = tuple(point(r, s) for r, s in zip(rates, sim(p, d, b, rates)))
        else:   # binary search of the ladder for the last rate that holds: below a rate that held every rate
            #     holds, above one that missed every rate misses (the low rates simulate longest)
            got, lo, hi = {}, -1, len(rates)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                got[mid] = point(rates[mid], sim(p, d, b, [rates[mid]])[0])
                lo, hi = (mid, hi) if got[mid].under_slo else (lo, mid)
            pts = tuple(got[i] for i in sorted(got))
        ok = [i for i, pt in enumerate(pts) if pt.under_slo]
        best_ok = pts[ok[-1]].asked if ok else 0.0
        ceiling = max(pt.delivered for pt in pts)
        if ok and ok[-1] + 1 < len(pts):           # bisect the knee between the last rate held and the next;
            # TTFT-only: never above the delivered ceiling (a short run past capacity can keep its TTFT p95
            # low by luck of timing, the queue has not grown yet, which is no rate to plan for)
            nxt = pts[ok[-1] + 1].asked
            lo, hi = best_ok, (nxt if slo_tpot_p95_ms is not None else min(nxt, max(best_ok, ceiling)))
            for _ in range(refine):
                mid = (lo + hi) / 2
                s = sim(p, d, b, [mid])[0]
                if family != "pd":
                    ceiling = max(ceiling, s["request_throughput"])
                lo, hi = (mid, hi) if holds(s) else (lo, mid)
            best_ok = lo
            if family != "pd" and pts[-1].asked < 2 * best_ok:
                # the ceiling past capacity: a run just above the knee is still draining its short queue when
                # it ends (delivered well under what the engines do), so one run reaches 2x the knee, on ``cur`` / 4
                # of the knee's lifetimes (at 2x its slots fill within half a lifetime: the second half of its
                # arrivals is steady); its steady state counts too (completed / duration ends in the drain)
                r2, window = 2 * best_ok, max(min_window_s, cur[0] / 4 * life.get(best_ok, 0.0))
                s2 = run(p, d, b, [r2], prompts_for(r2, num_prompts, window))[0]
                ceiling = max(ceiling, s2["request_throughput"], s2["sustained_throughput"] if best_ok in life else 0)
        over = ()
        if admission is not None and policy == "adaptive" and best_ok > 0:
            over = tuple(past(p, d, b, lab, r, best_ok) for lab, r in (("2x", 2 * best_ok), ("peak", peak_rate))
                         if r > 0)
        return SplitResult(p, d, tp, pts, max([ceiling, *steady]), best_ok, both=b, overload=over,
                           holds_all=bool(ok) and pts[ok[-1]].asked == rates[-1])

    def key(r: SplitResult):
        at = max((p for p in r.points if p.under_slo), key=lambda p: p.asked, default=None)
        return (-round(r.max_rate_under_slo, 2), -round(r.ceiling, 1), at.ttft_p95_s if at else math.inf,
                r.prefill + r.decode + r.both, r.prefill, r.decode)

    shapes = [(p, d, 0) for p, d in splits(n_engines)] if family == "pd" else families(n_engines)
    if policy == "round-robin":   # the seed's proxy always takes a P leg: no family without a prefiller
        shapes = [sh for sh in shapes if sh[0] >= 1]
    rows = [row(p, d, b, 0.0) for p, d, b in shapes]
    if min_lifetimes > 0:   # the lifetimes rule, best first, on every family that could still beat the best one it
        #                     verified: the rule only lowers a goodput, so one already below cannot overtake it
        done: list = []
        for i in sorted(range(len(rows)), key=lambda i: key(rows[i])):
            if done and rows[i].max_rate_under_slo < max(rows[j].max_rate_under_slo for j in done):
                break
            rows[i] = row(rows[i].prefill, rows[i].decode, rows[i].both, min_lifetimes)
            done.append(i)
        if len(done) < len(rows):
            notes.append(f"{len(rows) - len(done)} famil{'y' if len(rows) - len(done) == 1 else 'ies'} below the "
                         f"best one's goodput on {min_lifetimes:g} answer lifetimes kept {min_window_s:g} s windows "
                         "(their goodput an upper bound)")
    rows.sort(key=key)
    if rows[0].max_rate_under_slo > 0:
        rows[0] = SplitResult(**{**rows[0].__dict__, "recommended": True})
    else:
        notes.append(f"no split holds TTFT p95 <= {slo_ttft_p95_s:g}s at any asked rate: lower the rates, "
                     "add GPUs or relax the SLO")
    return WhatIf(hw.name, model, workload, rates, slo_ttft_p95_s, policy, tuple(rows), tuple(notes), n_engines,
                  slo_tpot_p95_ms, setup)
