"""Overload on the twin (issue 28): does admission by the SLO keep goodput past the ceiling?

Question: past the rate the box holds, today's proxy admits every request into the engines' unbounded
first-come-first-served queues, every request waits behind all the others and the share within the SLOs falls to
nothing. Does ``[admission] mode = "slo"`` (``appliance/policy/admit.py``: start a request only while its predicted TTFT
and its worker's TPOT stay within the SLOs, hold the rest briefly in the proxy's bounded queue, refuse at once
what cannot make its deadline) keep the good requests per second near the box's goodput rate instead?

Variants, one run, same arrivals (seed fixed), twin simulator (``appliance/twin/simulator.py``, which imports the
proxy's own ``decide()`` and ``judge()``):
- the baseline: the seed's round-robin 1P2D (1P1D on 2 GPUs), no admission;
- pdctl's default plan (``make_plan`` with no counts, as ``benchmarks/policy_study.py``) under the ``adaptive``
  policy with ``mode = "off"`` (today's behaviour), with ``mode = "slo"`` (the default ``Policy()``), and with
  ``mode = "queue"`` (the bounded queue with a stream cap, no prediction).
Rates: 0.7x, 1x, 1.5x, 2x and 4x of G, the default plan's goodput rate as ``benchmarks/policy_study.py`` finds it
(the highest asked rate holding TTFT p95 and TPOT p95 within the SLOs with no failures); each rate is 60 s of
Poisson arrivals (num_prompts = round(60 x rate)). A request is good when its TTFT and its own TPOT are both within
the SLOs; good req/s = good / the arrival window. Refusals are always printed beside goodput.

Targets (issue 28), with admission (slo): good req/s at 1.5x, 2x and 4x >= 0.9 x G; >= 95 % of the admitted
requests within both SLOs (at every rate); at 0.7x nothing refused and TTFT p50 within 5 % of ``mode = "off"``.

Profiles: ``a100`` (3 x A100-80GB, seed P50 workload A of the policy study: SLO TTFT 2 s, TPOT 80 ms), ``h200``
(2 x H200, workload A), ``b`` (3 x A100, workload B: half long cold prompts, TPOT 60 ms).

Usage: ``python benchmarks/overload.py [--profile a100|h200|b|all] [--seed N] [--quick]``; exit 0 when every
target holds, 1 when one fails (named on its FAIL line).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.policy.admit import Policy  # noqa: E402
from appliance.plan.families import plan_workload, rank_params  # noqa: E402
from appliance.twin.simulator import simulate  # noqa: E402
from benchmarks.policy_study import WORKLOADS, goodput, variants  # noqa: E402

PROFILES = {     # name: (hardware, gpus, policy study's workload)
    "a100": ("a100-80gb", 3, "A"),
    "h200": ("h200", 2, "A"),
    "b": ("a100-80gb", 3, "B"),
}
MULTIPLES = (0.7, 1.0, 1.5, 2.0, 4.0)
OVERLOAD = (1.5, 2.0, 4.0)       # where good req/s must stay >= GOOD_SHARE_OF_G x G
GOOD_SHARE_OF_G = 0.9
IN_SLO_ADMITTED = 0.95
LIGHT = 0.7                      # below the ceiling: nothing refused, TTFT p50 as with mode off
P50_TOL = 0.05


def profile_variants(hardware: str, gpus: int, model: str, work) -> list:
    """(label, prefill, decode, both, policy, admission mode): the seed without admission, and pdctl's default plan
    (from the planner, via the policy study's ``variants``) with mode off, slo and queue."""
    vs = variants(hardware, gpus, model, work)
    seed_lb, p0, d0, b0, pol0 = vs[0]
    dflt_lb, p, d, b, pol = vs[-1]
    dflt_lb = dflt_lb.replace("default: ", "")
    return [(seed_lb, p0, d0, b0, pol0, "off")] + [
        (f"{dflt_lb}, mode {m}", p, d, b, pol, m) for m in ("off", "slo", "queue")]


def run(hardware, model, v, wl, work, rate: float, window_s: float, seed: int) -> dict:
    _, p, d, b, pol, mode = v
    adm = Policy(mode=mode, ttft_slo_s=work.ttft_slo_s, tpot_slo_s=work.tpot_slo_ms / 1000.0)
    return simulate(hardware, model, p, d, wl, [rate], num_prompts=max(1, round(window_s * rate)), policy=pol,
                    seed=seed, both=b, admission=adm, params=rank_params(hardware))[0]   # the planner's


def in_slo_share(x: dict) -> float:
    """Good requests over admitted ones (admitted counts the failed too)."""
    return x["good"] / x["admitted"] if x["admitted"] else 1.0


def reasons(x: dict) -> str:
    why = x["refused_reasons"]
    return f"{x['refused']}" + (" (" + ", ".join(f"{k} {n}" for k, n in why.items()) + ")" if why else "")


def table(res: dict, g: float) -> list:
    lines = ["| variant | x G | asked req/s | admitted | refused (reasons) | admitted in SLO | good req/s | "
             "TTFT p50/p95 s | TPOT p95 ms | max queue |", "|---|---|---|---|---|---|---|---|---|---|"]
    for lb, pts in res.items():
        for m in MULTIPLES:
            x = pts[m]
            fail = f", {x['failed']} failed" if x.get("failed") else ""
            lines.append(f"| {lb} | {m:g} | {m * g:.2f} | {x['admitted']}{fail} | {reasons(x)} | "
                         f"{in_slo_share(x):.1%} | {x['goodput']:.2f} | {x['p50_ttft_ms'] / 1000:.3f}/"
                         f"{x['p95_ttft_ms'] / 1000:.3f} | {x['p95_tpot_ms']:.1f} | {x['max_queue']} |")
    return lines


def targets(res: dict, vs: list, g: float) -> list:
    """(ok, line) per target of the issue, on the default plan with mode slo (vs mode off at 0.7x)."""
    off, slo = res[vs[1][0]], res[vs[2][0]]
    out = []
    for m in OVERLOAD:
        x = slo[m]["goodput"]
        ok = x >= GOOD_SHARE_OF_G * g
        out.append((ok, f"slo good req/s at {m:g}x G ({m * g:.2f} asked): {x:.2f} >= {GOOD_SHARE_OF_G:g} x G = "
                        f"{GOOD_SHARE_OF_G * g:.2f} (mode off: {off[m]['goodput']:.2f})"))
    worst = min(MULTIPLES, key=lambda m: in_slo_share(slo[m]))
    s = in_slo_share(slo[worst])
    out.append((s >= IN_SLO_ADMITTED, f"slo admitted within both SLOs at every rate: lowest {s:.1%} (at {worst:g}x) "
                                      f">= {IN_SLO_ADMITTED:.0%}"))
    light = slo[LIGHT]
    out.append((light["refused"] == 0, f"slo refuses nothing at {LIGHT:g}x G: {reasons(light)} refused"))
    p_slo, p_off = light["p50_ttft_ms"], off[LIGHT]["p50_ttft_ms"]
    dev = p_slo / p_off - 1 if p_off else 0.0
    out.append((abs(dev) <= P50_TOL, f"slo TTFT p50 at {LIGHT:g}x G within {P50_TOL:.0%} of mode off: "
                                     f"{p_slo:.0f} vs {p_off:.0f} ms = {dev:+.1%}"))
    return out


def why_failed(res: dict, vs: list, g: float) -> list:
    """What admission did at the overload rates (to read beside a FAIL): verdicts by reason, TTFT percentiles."""
    slo = res[vs[2][0]]
    lines = []
    for m in MULTIPLES:
        x = slo[m]
        lines.append(f"  slo at {m:g}x: verdicts {x['admissions']}; TTFT p50/p95/p99 {x['p50_ttft_ms']:.0f}/"
                     f"{x['p95_ttft_ms']:.0f}/{x['p99_ttft_ms']:.0f} ms, TPOT p95/p99 {x['p95_tpot_ms']:.1f}/"
                     f"{x['p99_tpot_ms']:.1f} ms, sustained {x['sustained_throughput']:.2f} req/s")
    return lines


def study(name: str, model: str, seed: int, window_s: float) -> tuple:
    """(ok, printed lines) of one profile."""
    hardware, gpus, wname = PROFILES[name]
    work = WORKLOADS[wname]
    wl = plan_workload(work)
    t0 = time.monotonic()
    vs = profile_variants(hardware, gpus, model, work)
    d = vs[1]
    g, _ = goodput(hardware, model, (d[0], d[1], d[2], d[3], d[4]), wl, work, seed)
    if g <= 0:
        return False, [f"profile {name}: the default plan holds no rate of the policy study's ladder: FAIL"]
    res = {v[0]: {m: run(hardware, model, v, wl, work, m * g, window_s, seed) for m in MULTIPLES} for v in vs}
    lines = [f"profile {name}: {gpus} x {hardware}, {model}, workload {wname} (SLO TTFT {work.ttft_slo_s:g} s, TPOT "
             f"{work.tpot_slo_ms:g} ms), twin, seed {seed}, {window_s:g} s of Poisson arrivals per rate "
             f"({time.monotonic() - t0:.1f} s)",
             f"G = goodput of the default plan (policy study: TTFT p95 and TPOT p95 within the SLOs): {g:.2f} req/s",
             ""]
    lines += table(res, g)
    lines.append("")
    checks = targets(res, vs, g)
    lines += [f"  {'PASS' if ok else 'FAIL'} {line}" for ok, line in checks]
    ok = all(c for c, _ in checks)
    if not ok:
        lines += why_failed(res, vs, g)
    return ok, lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", choices=(*PROFILES, "all"), default="all")
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--seed", type=int, default=2003, help="arrivals' seed (the policy study's)")
    ap.add_argument("--window", type=float, default=60.0, help="seconds of arrivals per rate")
    ap.add_argument("--quick", action="store_true", help="smoke run: 20 s of arrivals per rate")
    a = ap.parse_args(argv)
    window = 20.0 if a.quick else a.window
    names = tuple(PROFILES) if a.profile == "all" else (a.profile,)
    failed = []
    for name in names:
        ok, lines = study(name, a.model, a.seed, window)
        print("\n".join(lines))
        print()
        if not ok:
            failed.append(name)
    if failed:
        print(f"targets FAILED on profile(s): {', '.join(failed)}")
        return 1
    print(f"all targets held on {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
