"""Which plan family a box runs: counts asked by the operator, or the twin's ranking of all-both, hybrid and
classic P/D layouts by goodput (the highest rate holding the TTFT p95 and TPOT p95 SLOs).

Pure: the ranking is the twin's seeded discrete-event simulation (no I/O), cached per process because the
same inputs give the same answer. The planner (``planner.make_plan``) calls ``asked_counts`` or
``default_counts``; ``pdctl plan --what-if`` and the benchmarks use ``plan_workload``, ``plan_prompts``,
``predicted_of`` and the constants.
"""
from __future__ import annotations

import functools
import math

from ..model.profiles import ModelProfile
from ..policy.decide import Thresholds
from .inputs import Overrides, PlanError, Workload


def default_prefill_count(n_workers: int) -> int:
    """The seed's rule of thumb for prefix-heavy chat: 1 prefiller per 4 workers (1:1 at 2, 1:2 at 3, 1:3 at 4).

    Decode-heavy because the decode phase holds each request for its whole output while the prefill leg
    is one forward pass over mostly cached tokens; the twin's what-if can replace this rule.
    """
    return max(1, math.ceil(n_workers / 4))

def asked_counts(n: int, tp: int, n_gpus: int, ov: Overrides, reasons: list) -> tuple:
    p, d, b = ov.prefill, ov.decode, ov.both
    if not b:
        p = p or max(1, n - d)
        d = d or max(1, n - p)
    if p + d + b < 2 or (d + b) < 1:
        raise PlanError("a plan of 2+ workers needs at least 1 worker that decodes (--decode or --both) and 2 in "
                        "all")
    if p + d + b > n:
        raise PlanError(f"--prefill {p} --decode {d} --both {b} needs {p + d + b} TP-{tp} workers = "
                        f"{(p + d + b) * tp} GPUs; this box has {n} workers ({n_gpus} GPUs). Try --both {n}, or "
                        f"--prefill 1 --decode {n - 1}")
    if p + d + b < n:
        reasons.append(f"{n - p - d - b} worker slot(s) left idle: --prefill {p} --decode {d} --both {b} asked")
    reasons.append(f"{describe(p, d, b)} " + (f"chosen by {ov.counts_by}" if ov.counts_by else
                                               "as asked by the operator (--prefill/--decode/--both or [plan])"))
    return p, d, b


def describe(p: int, d: int, b: int) -> str:
    if not p and not d:
        return f"{b} both-workers (all kv_both)"
    return " + ".join(x for x in (f"{p} prefill" if p else "", f"{d} decode" if d else "",
                                  f"{b} both" if b else "") if x)


def default_counts(n: int, tp: int, gpus: list, model: ModelProfile, work: Workload, ov: Overrides,
                    reasons: list) -> tuple:
    """The family with the highest simulated goodput (the twin, the proxy's own decision code), or the
    fixed rule when the twin cannot model this box."""
    ranked = rank_families(gpus[0].name, n * tp, model, work, ov, tp) if ov.choose_family else None
    if isinstance(ranked, str) or ranked is None:
        p = default_prefill_count(n)
        if isinstance(ranked, str):
            reasons.append(f"the twin cannot rank plan families here ({ranked}): fixed rule instead")
        reasons.append(f"{p} prefill + {n - p} decode from {n} workers: the seed measured decode as the bottleneck "
                       "for prefix-heavy chat (1:2 to 1:3 prefill:decode), so 1 prefiller per 4 workers")
        return p, n - p, 0, {}
    best, rows, predicted = ranked
    nxt = [r for r in rows if r is not best][:2]
    reasons.append(
        f"{best.family} ({describe(best.prefill, best.decode, best.both)}) chosen by the twin: it holds "
        f"{best.max_rate_under_slo:.3g} req/s with TTFT p95 <= {work.ttft_slo_s:g} s and TPOT p95 <= "
        f"{work.tpot_slo_ms:g} ms under the {ov.policy} policy"
        + (", vs " + ", ".join(f"{r.family} {r.max_rate_under_slo:.3g}" for r in nxt) if nxt else "")
        + f" ({predicted['workload']}; `pdctl plan --what-if` prints every family)")
    return best.prefill, best.decode, best.both, predicted


PLAN_RATES = (1, 2, 4, 8, 16, 32, 64, 128)   # asked req/s ladder of the family ranking (binary-searched for
PLAN_REFINE = 3                               # the last rate that holds), then this many bisection steps
PLAN_PROMPTS = 600                            # simulated prompts per rate, at least PLAN_WINDOW_S of arrivals:
PLAN_WINDOW_S = 40.0                          # shorter runs past capacity end before their queue grows
PLAN_LIFETIMES = 20.0                         # a rate that held holds only on this many answer lifetimes too
# The rule, in plain words (``twin.whatif.lifetime_run``): each rate runs max(600 prompts, 40 s of arrivals); a rate
# that held there runs again on 20 x its mean answer lifetime (mean E2E) of arrivals when that is longer, and holds
# only if it holds there too. Why: the simulated stack starts empty, so for about one answer lifetime every request
# finds a free slot, and near the capacity a queue then grows slowly: 3x A100 with CUDA graphs runs 3 x 128
# sequences of ~16 s, a capacity of ~24 req/s (Little's law; 24.0 completions/s in steady state past it), and 24
# req/s held TTFT p95 1.0 s on 40 s of arrivals, 1.5 s on 80 s, missed at 2.2 s on 160 s and 3.2 s on 320 s, while
# 23 held on 320 s (0.66 s). A rate at the capacity itself thus holds ~9 lifetimes; 20 leaves twice that. The
# delivered ceiling is read as a steady state too: the run at 2x the knee lasts 5 of the knee's answer lifetimes
# and its completions over the second half of its arrivals count (24.1 there), not only completed / duration, which
# ends in the drain of the last answers (21.8 on 40 s). To bound the run time, the families are first ranked on
# 40 s windows, then searched again with the rule best first, while one could still beat the best goodput found
# with it (the rule only lowers a goodput): the others keep their 40 s goodput, an upper bound, said in the notes.
# Only rates that held run twice; benchmarks/README.md "Twin calibration" has the seconds.
# The twin's setup the ranking simulates: pdctl's own (vLLM 0.26 with CUDA graphs and prefix caching, LMCache 0.5.3,
# pdctl's proxy), on each GPU's own fit, as the plan runs it; the seed setup only reproduces the seed's tables.
RANK_SETUP = "pdctl"


def rank_params(gpu_name: str):
    """The cost parameters of the ranking (``RANK_SETUP``, see above) on ``gpu_name``'s own fit."""
    from ..twin.hardware import resolve
    from ..twin.params import CostParams
    return CostParams.for_setup(RANK_SETUP, resolve(gpu_name).name)


def plan_prompts(rate: float) -> int:
    """max(PLAN_PROMPTS, PLAN_WINDOW_S of arrivals): what one rate simulates in the family ranking, what-if
    and benchmarks/policy_study.py (one rule, so their goodputs agree)."""
    from ..twin.whatif import prompts_for
    return prompts_for(rate, PLAN_PROMPTS, PLAN_WINDOW_S)


def plan_run(run, rate: float, holds) -> dict:
    """One rate on the ranking's windows (the rule above): ``run(n)`` simulates n prompts at ``rate``; ``holds``
    judges a summary. For scripts that search a goodput themselves (benchmarks/policy_study.py)."""
    from ..twin.whatif import lifetime_run
    return lifetime_run(run, rate, holds, PLAN_PROMPTS, PLAN_WINDOW_S, PLAN_LIFETIMES)[0]


def plan_workload(work: Workload):
    """The twin's workload for ranking: the typical prompt, plus the cold share as its own class; or, with
    ``sessions``, conversations whose first turn is the typical prompt (the cold share does not apply)."""
    from ..twin.simulator import Mix, Sessions
    from ..twin.simulator import Workload as SimWorkload
    if work.sessions:
        from ..twin.profiles import SessionProfile
        if work.session_turns_max < work.session_turns_min:
            raise PlanError(f"[workload] session_turns_max {work.session_turns_max} is below session_turns_min "
                            f"{work.session_turns_min}")
        system = min(work.prefix_len, work.input_len)
        prof = SessionProfile("workload", system, work.input_len - system, work.session_message_len,
                              work.output_len, work.session_turns_min, work.session_turns_max, work.session_think_s)
        if prof.last_turn(work.max_model_len) < 1:
            raise PlanError(f"[workload] sessions: a first turn ({work.input_len} prompt + {work.output_len} answer "
                            f"tokens) does not fit max_model_len {work.max_model_len}")
        return Sessions(prof, work.max_model_len)
    warm = SimWorkload(work.input_len, min(work.prefix_len, work.input_len), work.output_len)
    if not work.cold_share:
        return warm
    cold = SimWorkload(work.cold_input_len, 0, work.cold_output_len)
    if work.cold_share >= 1:
        return cold
    return Mix(((1 - work.cold_share, warm), (work.cold_share, cold)))


def rank_families(gpu_name: str, n_gpus: int, model: ModelProfile, work: Workload, ov: Overrides, tp: int):
    return _rank_families(gpu_name, n_gpus, model, work, ov.policy, ov.thresholds, tp)


@functools.lru_cache(maxsize=64)
def _rank_families(gpu_name: str, n_gpus: int, model: ModelProfile, work: Workload, policy: str,
                   thresholds: Thresholds, tp: int):
    """(best SplitResult, all rows best first, predicted dict) from the twin, or a string saying why not.

    Pure computation (the twin's discrete-event simulator, seeded): the same inputs give the same ranking."""
    from ..errors import BenchError
    from ..twin.hardware import HardwareError
    from ..twin.hardware import resolve as resolve_hw
    from ..twin.whatif import what_if_engines
    try:
        resolve_hw(gpu_name)
    except HardwareError as exc:
        return str(exc)
    wl = plan_workload(work)
    try:
        w = what_if_engines(gpu_name, n_gpus, model.name, wl, PLAN_RATES, slo_ttft_p95_s=work.ttft_slo_s,
                            policy=policy, tp=tp, num_prompts=PLAN_PROMPTS, seed=2003, kv_size_gb=80.0,
                            objective="max-rate-under-slo", refine=PLAN_REFINE, family="all",
                            slo_tpot_p95_ms=work.tpot_slo_ms, thresholds=thresholds,
                            min_window_s=PLAN_WINDOW_S, setup=RANK_SETUP, params=rank_params(gpu_name),
                            min_lifetimes=PLAN_LIFETIMES)
    except (BenchError, ValueError, KeyError) as exc:
        return str(exc)
    best = w.recommended
    if best is None:
        return f"no family holds the SLOs at {PLAN_RATES[0]} req/s"
    return best, w.rows, predicted_of(w, workload_shape(work))


def workload_shape(work: Workload) -> str:
    if work.sessions:
        return plan_workload(work).describe()
    return (f"{work.prefix_len}+{work.input_len - work.prefix_len} in / {work.output_len} out"
            + (f", {work.cold_share:.0%} cold {work.cold_input_len} in / {work.cold_output_len} out"
               if work.cold_share else ""))


def predicted_of(w, shape: str) -> dict:
    """plan.json's ``"predicted"`` from a what-if ranking (``twin.whatif.WhatIf``) with a recommended row:
    its goodput and delivered ceiling, and the latencies and aggregated share (0..1) at the highest ladder
    rate that held."""
    best = w.recommended
    at = max((p for p in best.points if p.under_slo), key=lambda p: p.asked)
    return {"by": "twin", "family": best.family, "kind": best.kind, "policy": w.policy,
            "goodput_req_s": round(best.max_rate_under_slo, 2), "ceiling_req_s": round(best.ceiling, 2),
            "at_req_s": at.asked, "ttft_p50_s": round(at.ttft_p50_s, 3), "ttft_p95_s": round(at.ttft_p95_s, 3),
            "tpot_p95_ms": round(at.tpot_p95_ms, 1), "aggregated_share": round(at.aggregated, 3),
            "slo": {"ttft_p95_s": w.slo_ttft_p95_s, "tpot_p95_ms": w.slo_tpot_p95_ms}, "workload": shape,
            "hardware": w.hardware, "ranking": [{"family": r.family, "goodput_req_s": round(r.max_rate_under_slo, 2)}
                                                for r in w.rows],
            **({"overload": {o.label: {"asked_req_s": round(o.asked, 2), "good_req_s": round(o.good_req_s, 2),
                                       "refused_share": round(o.refused_share, 3),
                                       "admitted_in_slo": round(o.admitted_in_slo, 3)} for o in best.overload}}
               if best.overload else {})}
