"""Where the adaptive policy's default thresholds come from: a sweep on the twin, printed.

Question: which ``aggregate_max_uncached`` and ``consumer_max_uncached`` give the best worst-case goodput?
Baseline, same run: the shipped default's row of the same sweep (printed beside the pick); each value's goodput
is normalised to the best of the sweep.

``aggregate_max_uncached`` (aggregate while at most this many prompt tokens are uncached, split above) is
swept on the family where it decides the most, the hybrid 1 prefill + 2 both on 3 x A100-80GB
(DeepSeek-V2-Lite), for the policy study's workloads A (seed P50: 1,869 uncached) and B (half A, half
15,840-token cold prompts; TPOT SLO 60 ms). ``consumer_max_uncached`` (what a decode-only worker may
aggregate) is swept on 1P2D. Goodput as in ``policy_study.py`` (both SLOs, bisection, >= 40 s of
arrivals per rate). The default is the value with the best worst-case goodput over A and B, each
normalised to its best value in the sweep.

Usage: ``python benchmarks/decision_thresholds.py [--values 512,1024,...]``.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.policy.decide import Thresholds  # noqa: E402
from appliance.plan.families import plan_workload  # noqa: E402

import policy_study as ps  # noqa: E402


def goodput_with(th: Thresholds, family: tuple, name: str, hw: str, model: str, seed: int) -> float:
    work = ps.WORKLOADS[name]
    wl = plan_workload(work)
    p, d, b = family
    orig = ps.simulate

    def sim(*a, **kw):
        kw.setdefault("thresholds", th)
        return orig(*a, **kw)
    ps.simulate = sim
    try:
        g, _ = ps.goodput(hw, model, ("sweep", p, d, b, "adaptive"), wl, work, seed, refine=3)
    finally:
        ps.simulate = orig
    return g


def sweep(key: str, values: list, family: tuple, hw: str, model: str, seed: int) -> str:
    rows = {v: {n: goodput_with(replace(Thresholds(), **{key: v}), family, n, hw, model, seed) for n in ("A", "B")}
            for v in values}
    best = {n: max(r[n] for r in rows.values()) or 1.0 for n in ("A", "B")}
    score = {v: min(r[n] / best[n] for n in ("A", "B")) for v, r in rows.items()}
    pick = max(values, key=lambda v: (round(score[v], 3), -abs(v - Thresholds().__dict__[key])))
    fam = "".join(f"{n}{k}" for n, k in zip(family, "PDB") if n)
    out = [f"{key} on {fam} ({hw}, {model}): goodput req/s per workload, worst-case share of the best",
           f"| {key} | A (seed P50) | B (half cold 15,840) | worst share |", "|---|---|---|---|"]
    for v in values:
        out.append(f"| {v}{' *' if v == pick else ''} | {rows[v]['A']:.2f} | {rows[v]['B']:.2f} | {score[v]:.2f} |")
    out.append(f"* best worst case: {pick} (shipped default {Thresholds().__dict__[key]})")
    if key == "consumer_max_uncached":
        out.append("  (the twin warms the shared prefix before the run, so it cannot show what this protects: a "
                   "decode-only worker stores nothing, and a prefix that nobody stored yet would stay uncached; the "
                   "default keeps the first round's 512)")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--values", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--consumer-values", default="0,256,512,1024,2048")
    ap.add_argument("--hardware", default="a100-80gb")
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--seed", type=int, default=2003)
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    print(sweep("aggregate_max_uncached", [int(x) for x in a.values.split(",")], (1, 0, 2), a.hardware, a.model,
                a.seed))
    print()
    print(sweep("consumer_max_uncached", [int(x) for x in a.consumer_values.split(",")], (1, 2, 0), a.hardware,
                a.model, a.seed))
    print(f"\n({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
