#!/usr/bin/env python3
"""Twin calibration, held out: fit the twin's parameters on some measured runs, check it on the others.

Question: how close does the twin's simulator come to measured runs, above all those it was not fitted on?
Baseline: each case's measured numbers (recorded runs in benchmarks/twin_cases.py; nothing is re-measured here),
replayed with the same topology, workload, prompt count and, where known, arrival instants.

    python benchmarks/twin_calibration.py            # check the shipped parameters on every case
    python benchmarks/twin_calibration.py --fit      # refit from the fit cases first, print the values, then check
    python benchmarks/twin_calibration.py --case p95 # only the cases whose name contains "p95"

The cases and their sources are in ``benchmarks/twin_cases.py``; each is marked FIT (a parameter is pinned on
it) or CHECK (nothing was fitted on it). For every case and asked rate the simulator runs the same topology,
workload and prompt count, with the arrival instants of the measured run where it came from ``pdctl bench``.
Targets, per case:
- TTFT p50 and TPOT p50 within +-20 % at every rate below saturation. A rate is below saturation when the
  measured delivered rate is at least 80 % of the asked rate, and so was every lower rate (finite runs drain
  their last requests, so a stack that keeps up delivers 85-100 % of what was asked);
- the delivered ceiling (the highest delivered rate of the sweep) within +-15 %;
- the knee (the first asked rate whose TTFT p50 passes 5 s; "-" when none does) at the same rate.
Exit status 1 when a case misses a target or a parameter leaves its plausible range.

How each fitted value is pinned (``--fit`` redoes exactly this; params.py holds the results):
- A100 (the seed's 1P2D and 1P1D tables, FIT): step_overhead_s (eager) from 1P2D TPOT p50 at 1 req/s minus a decode
  step's memory time (batch from Little's law); mfu = attn_mfu by bisection on the 1P2D mean delivered at 30/50/60
  req/s; store_eff (LMCache 0.4.2: the kv_both decoder re-stores its prompt and holds the blocks until done) by
  bisection on the 1P1D mean delivered at its saturated rates; store_notify_s minimax on TTFT p50 below saturation
  of both tables.
Then, without --case, a PREDICTION from first principles: 16k-token prompts (12k shared), 560-token answers on one
A100 decoder (1P1D), with its arithmetic; no measured data, nothing to pass or fail.
- H200 cold probes without the connector (FIT): step_overhead_s (cudagraph) from TPOT at batch 1 minus its
  memory time; then api_overhead_s, 1/mfu and 1/attn_mfu by least squares on TTFT p50 at 2,000/8,000/16,000
  tokens (intercept, linear and square term of the prefill); with the connector (FIT): connector_s from the
  TTFT difference.
- H200 seed P95 without the connector (FIT): kv_share_reread by bisection on TPOT p50 (12,000 shared tokens).
- H200 chat with the connector (FIT): connector_seq_s by bisection on TPOT p50.
- 2x H200 1P1D (FIT): kv_load_s minimax on TTFT p50.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from appliance.model.profiles import resolve as resolve_model  # noqa: E402
from appliance.twin.costmodel import CostModel, prefill_pairs  # noqa: E402
from appliance.twin.hardware import resolve as resolve_hw  # noqa: E402
from appliance.twin.params import FITTED_NAMES, PLAUSIBLE, CostParams, check_plausible  # noqa: E402
from appliance.twin.simulator import simulate  # noqa: E402
from twin_cases import Case, all_cases, find  # noqa: E402

TTFT_TOL, TPOT_TOL, CEILING_TOL, KNEE_S, SAT_SHARE = 0.20, 0.20, 0.15, 5.0, 0.80


def simulate_case(case: Case, params: CostParams) -> dict:
    rows = simulate(case.hardware, case.model, case.prefill, case.decode, case.workload, case.rates,
                    case.num_prompts, case.policy, case.seed, params=params, engine=case.engine,
                    kv_size_gb=case.kv_size_gb, connector=case.connector)
    return {float(r["request_rate"]): r for r in rows}


def below_saturation(case: Case) -> list:
    out = []
    for rate, m in case.measured.items():
        if m[0] < SAT_SHARE * rate:
            break
        out.append(rate)
    return out


def knee(points: dict):
    return next((rate for rate, ttft_s in points.items() if ttft_s > KNEE_S), None)


def err(sim: float, real: float) -> float:
    return (sim - real) / real


@dataclass
class Verdict:
    case: Case
    sim: dict
    compared: list
    ttft_err: dict = field(default_factory=dict)
    tpot_err: dict = field(default_factory=dict)
    ceiling: tuple = (0.0, 0.0)
    knees: tuple = (None, None)

    @property
    def ceiling_err(self) -> float:
        return err(*self.ceiling)

    @property
    def misses(self) -> list[str]:
        out = [f"TTFT p50 at {r:g} req/s {e:+.0%}" for r, e in self.ttft_err.items() if abs(e) > TTFT_TOL]
        out += [f"TPOT p50 at {r:g} req/s {e:+.0%}" for r, e in self.tpot_err.items() if abs(e) > TPOT_TOL]
        if abs(self.ceiling_err) > CEILING_TOL:
            out.append(f"ceiling {self.ceiling_err:+.0%}")
        if self.knees[0] != self.knees[1]:
            out.append(f"knee {_k(self.knees[1])} (real {_k(self.knees[0])})")
        return out


def evaluate(case: Case, params: CostParams) -> Verdict:
    sim = simulate_case(case, params)
    v = Verdict(case, sim, below_saturation(case))
    for rate in v.compared:
        _, t50, _, tpot, _ = case.measured[rate]
        v.ttft_err[rate] = err(sim[rate]["p50_ttft_ms"] / 1e3, t50)
        v.tpot_err[rate] = err(sim[rate]["p50_tpot_ms"], tpot)
    v.ceiling = (max(r["request_throughput"] for r in sim.values()), max(m[0] for m in case.measured.values()))
    v.knees = (knee({r: m[1] for r, m in case.measured.items()}),
               knee({r: s["p50_ttft_ms"] / 1e3 for r, s in sim.items()}))
    return v


def shipped(case: Case) -> CostParams:
    return CostParams.for_setup(case.setup, case.hardware)


# ---- fitting (each value pinned by its FIT case, see the module docstring) ----------------------------------
def _bisect(lo: float, hi: float, too_high, steps: int = 10) -> float:
    """The value in [lo, hi] where ``too_high(value)`` flips (True: the value is above the target)."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if too_high(mid) else (mid, hi)
    return (lo + hi) / 2


def _mean_err(case: Case, params: CostParams, metric: str) -> float:
    v = evaluate(case, params)
    return statistics.fmean((v.ttft_err if metric == "ttft" else v.tpot_err).values())


def _minimax_shift(cases, params: CostParams, name: str, lo: float, hi: float) -> CostParams:
    """Shift ``name`` (a latency on every request's TTFT path) to balance the largest TTFT p50 gaps below saturation
    of one case or of several together."""
    cases = cases if isinstance(cases, list) else [cases]
    for _ in range(3):
        gaps = []
        for case in cases:
            v = evaluate(case, params)
            gaps += [case.measured[r][1] - v.sim[r]["p50_ttft_ms"] / 1e3 for r in v.compared]
        value = min(max(getattr(params, name) + (max(gaps) + min(gaps)) / 2, lo), hi)
        params = params.with_(**{name: round(value, 4)})
    return params


def _solve3(a: list, b: list) -> list:
    """Least squares for 3 unknowns (normal equations, Gaussian elimination)."""
    n = [[sum(r[i] * r[j] for r in a) for j in range(3)] + [sum(r[i] * y for r, y in zip(a, b))] for i in range(3)]
    for i in range(3):
        piv = n[i][i]
        n[i] = [x / piv for x in n[i]]
        for k in range(3):
            if k != i:
                n[k] = [xk - n[k][i] * xi for xk, xi in zip(n[k], n[i])]
    return [n[i][3] for i in range(3)]


def fit_a100(p: CostParams) -> CostParams:
    case = find("a100 seed 1P2D, P50")
    hw, m = resolve_hw(case.hardware), resolve_model(case.model)
    m1 = case.measured[1.0]
    batch = 1.0 * m1[4] / case.decode
    ctx = case.workload.input_len + case.workload.output_len / 2
    mem_s = (m.weights_bytes + batch * ctx * m.kv_bytes_per_token) / (hw.hbm_bytes_per_s * p.mem_eff)
    p = p.with_(step_overhead_s=round(m1[3] / 1e3 - mem_s, 4))
    ceiling_rates = (30.0, 50.0, 60.0)
    target = statistics.fmean(case.measured[r][0] for r in ceiling_rates)
    sub = replace(case, measured={r: case.measured[r] for r in ceiling_rates})

    def too_high(mfu: float) -> bool:
        sim = simulate_case(sub, p.with_(mfu=mfu, attn_mfu=mfu))
        return statistics.fmean(sim[r]["request_throughput"] for r in ceiling_rates) > target
    mfu = round(_bisect(*PLAUSIBLE["mfu"], too_high, 8), 3)
    p = p.with_(mfu=mfu, attn_mfu=mfu)
    # the one-decoder box: its ceiling is the decoder's (kv_both) store path, which keeps finished requests' blocks
    one = find("a100 seed 1P1D, P50")
    sat = tuple(r for r in one.measured if r not in below_saturation(one))
    target1 = statistics.fmean(one.measured[r][0] for r in sat)
    sub1 = replace(one, measured={r: one.measured[r] for r in sat})

    def store_too_fast(eff: float) -> bool:
        sim = simulate_case(sub1, p.with_(store_eff=eff))
        return statistics.fmean(sim[r]["request_throughput"] for r in sat) > target1
    p = p.with_(store_eff=round(_bisect(*PLAUSIBLE["store_eff"], store_too_fast, 12), 3))
    both = [replace(c, measured={r: c.measured[r] for r in below_saturation(c)}) for c in (case, one)]
    return _minimax_shift(both, p, "store_notify_s", *PLAUSIBLE["store_notify_s"])


def fit_h200(p: CostParams) -> CostParams:
    probes = [find(f"h200 1x nokv, probe{n}") for n in (2000, 8000, 16000)]
    m, hw = resolve_model(probes[0].model), resolve_hw("h200")
    cost = CostModel(hw, m, probes[0].engine, p)
    bw = hw.hbm_bytes_per_s * p.mem_eff
    ovh = statistics.fmean(c.measured[0.5][3] / 1e3 - (m.weights_bytes + (c.workload.input_len + 32)
                                                       * m.kv_bytes_per_token) / bw for c in probes)
    p = p.with_(step_overhead_s=round(ovh, 5))
    rows, ys = [], []
    for c in probes:
        n = c.workload.input_len
        rows.append([1.0, 2 * cost.arch.matmul_active_params * n / hw.bf16_flops,
                     2 * cost.arch.attn_width * m.num_layers * prefill_pairs(n) / hw.bf16_flops])
        ys.append(c.measured[0.5][1] - 2 * p.http_hop_s - p.step_overhead_s)
    api, inv_mfu, inv_attn = _solve3(rows, ys)
    p = p.with_(api_overhead_s=round(api, 4), mfu=round(1 / inv_mfu, 3), attn_mfu=round(1 / inv_attn, 3))
    diffs = [find(f"h200 1x conn, probe{n}").measured[0.5][1] - find(f"h200 1x nokv, probe{n}").measured[0.5][1]
             for n in (2000, 8000, 16000)]
    p = p.with_(connector_s=round(max(0.0, statistics.fmean(diffs) - p.rpc_s), 4))
    p95 = find("h200 1x nokv, p95")
    p = p.with_(kv_share_reread=round(_bisect(0.0, 1.0, lambda r: _mean_err(p95, p.with_(kv_share_reread=r),
                                                                              "tpot") > 0), 3))
    chat = find("h200 1x conn, chat")
    p = p.with_(connector_seq_s=round(_bisect(*PLAUSIBLE["connector_seq_s"], lambda k: _mean_err(
        chat, p.with_(connector_seq_s=k), "tpot") > 0), 7))
    return _minimax_shift(find("h200x2 1P1D, P50"), p, "kv_load_s", *PLAUSIBLE["kv_load_s"])


FITTED = FITTED_NAMES


def fit_all() -> dict:
    """{(setup, hardware): fitted CostParams} for every setup/hardware pair a case uses."""
    a100 = fit_a100(CostParams.for_setup("seed", "a100-80gb"))
    h200 = fit_h200(CostParams.for_setup("pdctl", "h200"))
    return {("seed", "a100-80gb"): a100, ("pdctl", "h200"): h200}


# ---- report ---------------------------------------------------------------------------------------------------
def _k(rate) -> str:
    return "-" if rate is None else f"{rate:g}"


def report(verdicts: list, out=print) -> None:
    out("| case | role | asked | delivered sim / real | TTFT p50 ms sim / real (err) | TPOT p50 ms sim / real (err) |")
    out("|---|---|---|---|---|---|")
    for v in verdicts:
        c = v.case
        for rate, m in c.measured.items():
            s = v.sim[rate]
            sat = "" if rate in v.compared else " (sat.)"
            ttft, tpot = s["p50_ttft_ms"], s["p50_tpot_ms"]
            out(f"| {c.name} | {c.role} | {rate:g}{sat} | {s['request_throughput']:.2f} / {m[0]:.2f} "
                f"| {ttft:.0f} / {m[1] * 1e3:.0f} ({err(ttft, m[1] * 1e3):+.0%}) "
                f"| {tpot:.1f} / {m[3]:.1f} ({err(tpot, m[3]):+.0%}) |")
    out("\n| case | role | TTFT/TPOT p50 below saturation (rates) | ceiling sim / real (err) | knee sim / real "
        "| verdict |")
    out("|---|---|---|---|---|---|")
    for v in verdicts:
        worst = max([abs(e) for e in (*v.ttft_err.values(), *v.tpot_err.values())], default=0.0)
        rates = ",".join(f"{r:g}" for r in v.compared) or "none"
        miss = v.misses
        out(f"| {v.case.name} | {v.case.role.upper()} | worst {worst:.0%} ({rates}) | {v.ceiling[0]:.2f} / "
            f"{v.ceiling[1]:.2f} ({v.ceiling_err:+.0%}) | {_k(v.knees[1])} / {_k(v.knees[0])} "
            f"| {'OK' if not miss else 'MISS: ' + '; '.join(miss)} |")


# ---- a prediction from first principles (no measured data: nothing to pass or fail) ---------------------------------
LONG = dict(input_len=16000, prefix_len=12000, output_len=560)
LONG_RATES = (1.0, 2.0, 3.0, 5.0)


def predict_long_one_decoder(out=print, num_prompts: int = 300) -> dict:
    """The seed's stack on 2x A100 (1 prefiller + 1 decoder, seed setup) with 16k-token prompts (12k shared prefix)
    and 560-token answers: what the twin's physics predicts, with the arithmetic behind it."""
    from appliance.twin.simulator import Workload
    hw, m = resolve_hw("a100-80gb"), resolve_model("deepseek-v2-lite")
    p = CostParams.for_setup("seed", "a100-80gb")
    cost = CostModel(hw, m, params=p)
    n, c, o = LONG["input_len"], LONG["prefix_len"], LONG["output_len"]
    kvb, new = m.kv_bytes_per_token, n - c
    cap = cost.kv_capacity_tokens()
    b_kv = min(cost.cfg.max_num_seqs, cap // (n + o))            # decoding sequences the KV cache holds at most
    ctx = n + o / 2
    step = cost.decode_step_time(b_kv, int(ctx))
    gemm_flops = 2 * cost.arch.matmul_active_params * new
    attn_flops = 2 * cost.arch.attn_width * m.num_layers * prefill_pairs(new, c)
    load12k = cost.host_transfer_time(c)
    dstore = cost.store_time(n)
    out("\nPREDICTION (no measured data; printed, not checked): seed stack, 1P1D on 2x A100-80GB, DeepSeek-V2-Lite, "
        f"{n:,}-token prompts ({c:,} shared), {o}-token answers")
    out(f"- prefill of the {new:,} new tokens after {c:,} loaded: GEMMs {gemm_flops / 1e12:.1f} TFLOP + attention "
        f"{attn_flops / 1e12:.1f} TFLOP (new x cached {new * c / 1e6:.0f} M pairs) at {p.mfu:.3f} of 312 TFLOP/s = "
        f"{cost.prefill_time(new, c) * 1e3:.0f} ms with the step overhead")
    out(f"- L1 load of the {c:,}-token prefix: {c * kvb / 1e6:.0f} MB over PCIe Gen4 (32 GB/s x {p.host_link_eff}) = "
        f"{load12k * 1e3:.1f} ms (Gen5 on H200: {load12k * 1e3 / 2:.1f} ms); the decoder loads all {n - 1:,}: "
        f"{cost.host_transfer_time(n - 1) * 1e3:.1f} ms")
    out(f"- decode: KV cache {cap:,} tokens holds {cap // (n + o)} sequences of {n + o:,} (max_num_seqs "
        f"{cost.cfg.max_num_seqs}); a step at batch {b_kv} reads {m.weights_bytes / 1e9:.1f} GB of weights + "
        f"{b_kv * ctx * kvb / 1e9:.1f} GB of KV = {step * 1e3:.0f} ms -> at most {b_kv / (o * step):.2f} req/s")
    out(f"- the kv_both decoder re-stores each {n:,}-token prompt ({n * kvb / 1e6:.0f} MB at store_eff {p.store_eff} "
        f"= {dstore:.2f} s) and holds its blocks until then -> at most {1 / dstore:.2f} req/s")
    rows = simulate("a100-80gb", "deepseek-v2-lite", 1, 1, Workload(**LONG), LONG_RATES, num_prompts, "round-robin",
                    2003, params=p, kv_size_gb=80.0)
    out("| asked | delivered | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | preemptions |")
    out("|---|---|---|---|---|---|")
    for r in rows:
        out(f"| {r['request_rate']:g} | {r['request_throughput']:.2f} | {r['p50_ttft_ms']:.0f} | {r['p95_ttft_ms']:.0f} "
            f"| {r['p50_tpot_ms']:.1f} | {r['preemptions']} |")
    k = knee({float(r["request_rate"]): r["p50_ttft_ms"] / 1e3 for r in rows})
    out(f"PREDICTION: ceiling {max(r['request_throughput'] for r in rows):.2f} req/s, knee (TTFT p50 > 5 s) at "
        f"{_k(k)} req/s of {', '.join(f'{x:g}' for x in LONG_RATES)}")
    return {"rows": rows, "knee": k}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", action="store_true", help="refit the fitted parameters first (from the FIT cases)")
    ap.add_argument("--case", default="", help="only cases whose name contains this text")
    a = ap.parse_args()
    params = {}
    if a.fit:
        t = time.monotonic()
        params = fit_all()
        print(f"fitted in {time.monotonic() - t:.1f} s (shipped values in appliance/twin/params.py):")
        for (setup, hw), p in params.items():
            ship = CostParams.for_setup(setup, hw)
            print(f"  {setup} on {hw}: " + ", ".join(f"{k}={getattr(p, k):g} (shipped {getattr(ship, k):g})"
                                                   for k in FITTED))
    cases = [c for c in all_cases() if a.case in c.name]
    if not cases:
        print(f"no case matches {a.case!r}", file=sys.stderr)
        return 2
    t = time.monotonic()
    verdicts = [evaluate(c, params.get((c.setup, c.hardware)) or shipped(c)) for c in cases]
    print(f"{len(cases)} cases simulated in {time.monotonic() - t:.1f} s\n")
    report(verdicts)
    bad_params = {f"{c.setup}/{c.hardware}": check_plausible(params.get((c.setup, c.hardware)) or shipped(c))
                  for c in cases}
    bad_params = {k: v for k, v in bad_params.items() if v}
    fit_miss = [v.case.name for v in verdicts if v.case.role == "fit" and v.misses]
    check_miss = [v.case.name for v in verdicts if v.case.role == "check" and v.misses]
    n_check = sum(1 for v in verdicts if v.case.role == "check")
    print(f"\nchecked cases (nothing fitted on them): {n_check - len(check_miss)} of {n_check} within every target"
          + (f"; MISS: {', '.join(check_miss)}" if check_miss else ""))
    print(f"fitted cases: {'all within every target' if not fit_miss else 'MISS: ' + ', '.join(fit_miss)}")
    print(f"parameters inside plausible ranges: {'OK' if not bad_params else 'OUT: ' + str(bad_params)}")
    if not a.case:
        predict_long_one_decoder()
    return 0 if not (fit_miss or check_miss or bad_params) else 1


if __name__ == "__main__":
    sys.exit(main())
