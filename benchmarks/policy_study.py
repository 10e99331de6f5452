"""Policy study on the twin: the seed's round-robin proxy vs pdctl's routing, same stack and workload.

Stack: 1 prefiller + 2 decoders, DeepSeek-V2-Lite on A100-80GB, one shared KV server (the seed's headline
setup). Workload: the seed's P50 profile (6000 shared + 1869 unique input tokens, 252 output, Poisson,
600 prompts per rate, warm prefix). Policies (``appliance/twin/simulator.py``):
- round-robin: one global index picks prefiller and decoder; every request takes the P leg.
- pdctl: least-outstanding prefiller/decoder; skips the P leg when the KV server already holds all but
  <= 512 tokens of the prompt (the decoder prefills the short rest itself).

Variants on the same 3 GPUs: round-robin 1P2D (the seed); pdctl 1P2D (default skip threshold 512); pdctl
1P2D with the threshold above the unique length (decoders prefill the unique tail against the cached prefix,
the prefiller idles); pdctl 0P3D (no dedicated prefiller: three engines doing both, sharing the KV server).
Prints per asked rate: delivered req/s and TTFT p50/p95 per variant, then each variant against the issue's
two targets (ceiling >= 1.3x round-robin; TTFT p95 at 10 req/s <= 0.6x round-robin).

Usage: ``python benchmarks/policy_study.py [--rates ...] [--num-prompts N] [--markdown]``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.twin.simulator import Workload, simulate  # noqa: E402


VARIANTS = (  # label, prefillers, decoders, policy, skip_uncached_max
    ("round-robin 1P2D (seed)", 1, 2, "round-robin", 512),
    ("pdctl 1P2D", 1, 2, "pdctl", 512),
    ("pdctl 1P2D skip<=2048", 1, 2, "pdctl", 2048),
    ("pdctl 0P3D (all both)", 0, 3, "pdctl", 2048),
)


def run(hardware: str, model: str, rates: list, num_prompts: int, seed: int, workload: Workload) -> dict:
    return {label: simulate(hardware, model, p, d, workload, rates, num_prompts=num_prompts, policy=pol, seed=seed,
                            skip_uncached_max=skip)
            for label, p, d, pol, skip in VARIANTS}


def report(res: dict, rates: list, markdown: bool) -> str:
    labels = list(res)
    lines = []
    if markdown:
        lines.append("| asked req/s | " + " | ".join(f"{lb}: delivered, TTFT p50/p95 s" for lb in labels) + " |")
        lines.append("|---|" + "---|" * len(labels))
    else:
        lines.append(f"{'asked':>6} | " + " | ".join(f"{lb:>27}" for lb in labels))
    for i, r in enumerate(rates):
        cells = []
        for lb in labels:
            x = res[lb][i]
            skip = x["p_leg_skipped"] / max(x["completed"], 1)
            ttft = f"{x['p50_ttft_ms'] / 1000:6.3f}/{x['p95_ttft_ms'] / 1000:6.3f}"
            cells.append(f"{x['request_throughput']:5.2f}  {ttft}" + (f" s{skip:.0%}" if skip else ""))
        if markdown:
            lines.append(f"| {r:g} | " + " | ".join(cells) + " |")
        else:
            lines.append(f"{r:>6g} | " + " | ".join(f"{c:>27}" for c in cells))
    lines.append("(sN% = share of requests whose P leg pdctl skipped)")
    base = res[labels[0]]
    c_rr = max(x["request_throughput"] for x in base)
    i10 = rates.index(10) if 10 in rates else None
    lines.append("")
    for lb in labels[1:]:
        c = max(x["request_throughput"] for x in res[lb])
        msg = (f"{lb}: ceiling {c:.2f} vs {c_rr:.2f} req/s = {c / c_rr:.2f}x "
               f"(target >= 1.3x: {'met' if c >= 1.3 * c_rr else 'not met'})")
        if i10 is not None:
            p_rr, p = base[i10]["p95_ttft_ms"], res[lb][i10]["p95_ttft_ms"]
            msg += (f"; TTFT p95 at 10 req/s {p / 1000:.3f} vs {p_rr / 1000:.3f} s = {p / p_rr:.2f}x "
                    f"(target <= 0.6x: {'met' if p <= 0.6 * p_rr else 'not met'})")
        lines.append(msg)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="1,2,5,10,20,30,50,60")
    ap.add_argument("--num-prompts", type=int, default=600)
    ap.add_argument("--hardware", default="a100-80gb")
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--seed", type=int, default=2003)
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    rates = [float(x) for x in a.rates.split(",")]
    t0 = time.monotonic()
    res = run(a.hardware, a.model, rates, a.num_prompts, a.seed, Workload())
    print(f"policy study: 3 x {a.hardware}, {a.model}, seed P50 workload, "
          f"{a.num_prompts} prompts per rate (twin simulator, {time.monotonic() - t0:.1f} s)")
    print(report(res, rates, a.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
