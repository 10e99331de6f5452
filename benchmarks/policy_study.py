"""Policy study on the twin: the seed's round-robin 1P2D vs static families vs pdctl's default (the plan the
planner picks + the adaptive per-request policy), same GPUs, same workload, one run.

Question: does pdctl's default (its plan + the adaptive policy) hold more goodput than the seed's 1P2D and than
static families? Baseline, same run: the seed's round-robin 1P2D on the same GPUs, workload and arrivals.

Stack: 3 x A100-80GB, DeepSeek-V2-Lite, one shared KV server (the seed's headline box), twin simulator
(``appliance/twin/simulator.py``, which imports the proxy's own decision function). Workloads:
- A, the seed's P50 profile: 6000 shared + 1869 unique input tokens, 252 output; SLO TTFT p95 <= 2 s,
  TPOT p95 <= 80 ms;
- B, where splitting should pay: half A, half long and cold (15,840 input tokens, nothing shared, 561
  output); SLO TTFT p95 <= 2 s, TPOT p95 <= 60 ms.
Variants: round-robin 1P2D (the seed); static families under the first round's ``pdctl`` policy (1P2D,
2P1D, and all-both 3B, where every request is aggregated); and the default: ``make_plan`` with no counts
(the twin ranks all-both, hybrids and P/D splits) under the ``adaptive`` policy.

Goodput = the highest asked rate at which TTFT p95 and TPOT p95 hold their SLOs with no failures, found on
a rate ladder and refined by bisection. Each rate simulates max(600 prompts, 40 s of arrivals), and a rate that
held there again on 10 x its answers' mean lifetime (``families.plan_run``, the rule the planner's ranking and
``pdctl plan --what-if`` use too): a shorter run near or past capacity ends before its queue has grown and reads
as holding (see benchmarks/README.md). Every variant runs pdctl's setup on the GPU's own fit (``rank_params``).
Ceiling = delivered req/s (completed / time to the last completion) at 60 req/s asked, 600 prompts.

Usage: ``python benchmarks/policy_study.py [--workload A|B|both] [--hardware h200 --gpus 2] [--quick]``.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.inventory import detect  # noqa: E402
from appliance.model.profiles import resolve as resolve_model  # noqa: E402
from appliance.plan.families import (PLAN_LIFETIMES, PLAN_PROMPTS, PLAN_WINDOW_S, plan_prompts,  # noqa: E402
                                     plan_run, plan_workload, rank_params)
from appliance.plan.planner import Overrides, Workload as PlanWorkload, make_plan  # noqa: E402
from appliance.twin.simulator import simulate  # noqa: E402

LADDER = (1, 2, 3, 4, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 60)
NVML = {"a100-80gb": "A100-80GB", "h200": "H200", "h100-80gb": "H100", "b200": "B200"}
WORKLOADS = {
    "A": PlanWorkload(ttft_slo_s=2.0, tpot_slo_ms=80.0),
    "B": PlanWorkload(ttft_slo_s=2.0, tpot_slo_ms=60.0, cold_share=0.5),
}


def variants(hardware: str, gpus: int, model: str, work: PlanWorkload) -> list:
    """(label, prefill, decode, both, policy): the seed, static families, and pdctl's default."""
    plan = make_plan(detect(f"fake:{gpus}x{NVML[hardware]}"), resolve_model(model), work, Overrides(engine="twin"))
    p, d, b = (len(plan.by_role(r)) for r in ("prefill", "decode", "both"))
    fam = plan.predicted.get("family", f"{p}P{d}D{b}B")
    out = [("round-robin 1P1D (seed policy)" if gpus == 2 else "round-robin 1P2D (seed)", 1, gpus - 1, 0,
            "round-robin")]
    out += [(f"static pdctl {k}P{gpus - k}D", k, gpus - k, 0, "pdctl") for k in range(1, gpus)]
    out.append((f"static all-both {gpus}B (always aggregate)", 0, 0, gpus, "pdctl"))
    out.append((f"default: plan {fam} + adaptive", p, d, b, "adaptive"))
    return out


def params(hardware: str):
    """Every variant runs the cost parameters the planner ranks with (``families.rank_params``: pdctl's setup on
    the GPU's own fit), so the study compares policies and families on the engines the plan was chosen on."""
    return rank_params(hardware)


def run_rate(hardware, model, v, wl, rate, seed, n=None):
    _, p, d, b, pol = v
    return simulate(hardware, model, p, d, wl, [rate], num_prompts=n or plan_prompts(rate), policy=pol, seed=seed,
                    both=b, params=params(hardware))[0]


def held_run(hardware, model, v, wl, rate, seed, work) -> dict:
    """One rate of the goodput search, on the planner's windows (``families.plan_run``)."""
    return plan_run(lambda n: run_rate(hardware, model, v, wl, rate, seed, n), rate, lambda x: holds(x, work))


def holds(x: dict, work: PlanWorkload) -> bool:
    return (x["failed"] == 0 and x["p95_ttft_ms"] <= work.ttft_slo_s * 1000
            and x["p95_tpot_ms"] <= work.tpot_slo_ms)


def goodput(hardware, model, v, wl, work, seed, refine=4) -> tuple:
    """(goodput req/s, rows simulated on the ladder)."""
    rows, last_ok, nxt = [], 0.0, None
    for r in LADDER:
        x = held_run(hardware, model, v, wl, float(r), seed, work)
        rows.append((r, x))
        if not holds(x, work):
            nxt = float(r)
            break
        last_ok = float(r)
    if nxt is not None and last_ok:
        lo, hi = last_ok, nxt
        for _ in range(refine):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if holds(held_run(hardware, model, v, wl, mid, seed, work), work) else (lo, mid)
        last_ok = lo
    return last_ok, rows


def study(hardware: str, gpus: int, model: str, name: str, seed: int, show_rates: tuple) -> tuple:
    work = WORKLOADS[name]
    wl = plan_workload(work)
    vs = variants(hardware, gpus, model, work)
    res = {}
    for v in vs:
        g, _ = goodput(hardware, model, v, wl, work, seed)
        pts = {r: run_rate(hardware, model, v, wl, float(r), seed) for r in show_rates}
        ceil = simulate(hardware, model, v[1], v[2], wl, [60.0], num_prompts=600, policy=v[4], seed=seed,
                        both=v[3], params=params(hardware))[0]["request_throughput"]
        res[v[0]] = {"goodput": g, "points": pts, "ceiling": ceil, "variant": v}
    return work, res


def single_engine_ttft_p50(hardware: str, model: str, wl, seed: int) -> float:
    """TTFT p50 at 1 req/s of one aggregated engine (kv_both, the request served whole)."""
    return simulate(hardware, model, 0, 0, wl, [1.0], num_prompts=600, policy="adaptive", seed=seed,
                    both=1, params=params(hardware))[0]["p50_ttft_ms"]


def report(name: str, work: PlanWorkload, res: dict, show_rates: tuple, base_ttft1: float) -> str:
    lines = [f"workload {name}: SLO TTFT p95 <= {work.ttft_slo_s:g} s, TPOT p95 <= {work.tpot_slo_ms:g} ms"]
    lines.append("| variant | goodput req/s | ceiling req/s | " + " | ".join(
        f"{r:g}/s: delivered, TTFT p50/p95 s, TPOT p95 ms, agg %" for r in show_rates) + " |")
    lines.append("|---|---|---|" + "---|" * len(show_rates))
    for lb, x in res.items():
        cells = []
        for r in show_rates:
            p = x["points"][r]
            agg = sum(v for k, v in p["decisions"].items() if k.startswith("aggregate:")) / max(1, p["completed"])
            cells.append(f"{p['request_throughput']:.2f}, {p['p50_ttft_ms'] / 1000:.3f}/{p['p95_ttft_ms'] / 1000:.3f},"
                         f" {p['p95_tpot_ms']:.1f}, {agg:.0%}" + ("" if holds(p, work) else " !"))
        lines.append(f"| {lb} | {x['goodput']:.2f} | {x['ceiling']:.2f} | " + " | ".join(cells) + " |")
    lines.append("(! = an SLO missed at that rate; agg % = requests served whole on one engine)")
    labels = list(res)
    seed_lb, default_lb = labels[0], labels[-1]
    s, dflt = res[seed_lb], res[default_lb]
    statics = {lb: res[lb] for lb in labels[1:-1]}
    best_static = max(statics.values(), key=lambda x: x["goodput"])
    worst_static = min(statics.values(), key=lambda x: x["goodput"])
    g_ratio = dflt["goodput"] / s["goodput"] if s["goodput"] else math.inf
    lines.append("")
    lines.append(f"default vs the seed: goodput {dflt['goodput']:.2f} vs {s['goodput']:.2f} req/s = {g_ratio:.2f}x; "
                 f"ceiling {dflt['ceiling']:.2f} vs {s['ceiling']:.2f} = {dflt['ceiling'] / s['ceiling']:.2f}x")
    if name == "A":
        lines.append(f"  target goodput >= 1.6x (aim 2.0x): {'met' if g_ratio >= 1.6 else 'not met'}; "
                     f"ceiling >= 1.3x: {'met' if dflt['ceiling'] >= 1.3 * s['ceiling'] else 'not met'}")
        if 10 in show_rates:
            r10 = dflt["points"][10]["p95_ttft_ms"] / s["points"][10]["p95_ttft_ms"]
            lines.append(f"  TTFT p95 at 10 req/s {dflt['points'][10]['p95_ttft_ms'] / 1000:.3f} vs "
                         f"{s['points'][10]['p95_ttft_ms'] / 1000:.3f} s = {r10:.2f}x (target <= 0.5x: "
                         f"{'met' if r10 <= 0.5 else 'not met'})")
        if 1 in show_rates:
            t1 = dflt["points"][1]["p50_ttft_ms"]
            lines.append(f"  TTFT p50 at 1 req/s {t1:.0f} ms vs one aggregated engine {base_ttft1:.0f} ms = "
                         f"{t1 / base_ttft1 - 1:+.1%} (target within 10 %: "
                         f"{'met' if abs(t1 / base_ttft1 - 1) <= 0.10 else 'not met'})")
    else:
        lines.append(f"  default {dflt['goodput']:.2f} vs best static {best_static['variant'][0]} "
                     f"{best_static['goodput']:.2f} (target >=: {'met' if dflt['goodput'] >= best_static['goodput'] - 1e-9 else 'not met'}) "
                     f"and worst static {worst_static['variant'][0]} {worst_static['goodput']:.2f} (target >= 1.2x: "
                     f"{'met' if dflt['goodput'] >= 1.2 * worst_static['goodput'] else 'not met'})")
    busy = dflt["points"][max(show_rates)]["engine_busy"]
    lines.append(f"  engines' busy share, default at {max(show_rates):g} req/s: "
                 + ", ".join(f"{k} {v:.0%}" for k, v in busy.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=("A", "B", "both"), default="both")
    ap.add_argument("--hardware", default="a100-80gb", choices=sorted(NVML))
    ap.add_argument("--gpus", type=int, default=3)
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--seed", type=int, default=2003)
    ap.add_argument("--rates", default="1,5,10,15", help="rates shown per variant in the table")
    a = ap.parse_args(argv)
    show = tuple(float(x) if "." in x else int(x) for x in a.rates.split(","))
    names = ("A", "B") if a.workload == "both" else (a.workload,)
    for name in names:
        t0 = time.monotonic()
        work, res = study(a.hardware, a.gpus, a.model, name, a.seed, show)
        base = single_engine_ttft_p50(a.hardware, a.model, plan_workload(work), a.seed)
        print(f"policy study: {a.gpus} x {a.hardware}, {a.model}, workload {name}, twin simulator, "
              f"max({PLAN_PROMPTS} prompts, {PLAN_WINDOW_S:g} s) per rate, {PLAN_LIFETIMES:g} answer lifetimes once "
              f"held ({time.monotonic() - t0:.1f} s)")
        print(report(name, work, res, show, base))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
