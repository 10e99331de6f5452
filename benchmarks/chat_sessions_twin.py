"""Multi-turn chat on the twin (issue 32): does a conversation's history cost nothing extra, and what does the box
deliver against the setups an operator would otherwise run?

Traffic: ``SESSION_PROFILES["chat-sessions"]`` (appliance/twin/profiles.py: the seed's P50 shape as conversations, a
6,000-token system prompt shared by all, a 1,900-token first message, 150-token later messages, 250-token answers,
3-10 turns, 8 s mean think time; ``--think-s`` changes it). Conversations start Poisson at rate / 6.5 per second,
so a rate is turns per second; each next turn comes a think time after the last answer (appliance/twin/sessions.py).
A refused turn is asked again after 1 s and 2 s (the OpenAI SDK's retries), then its conversation ends.

Model: ``--model``, by default the seed's DeepSeek-V2-Lite (MLA: 31,104 B of KV a token, 1.2 M tokens of KV cache
per A100). With more KV a token the same GPU caches hold fewer conversations: ``llama-3.1-8b`` (GQA, 32 layers x 8
KV heads x 128 x K and V x bf16 = 131,072 B, 4.2x; 0.40 M tokens per A100, 0.83 M per H200) and ``qwen2.5-32b``
(64 layers, 262,144 B, 8.4x; 0.22 M tokens per H200; on 3x A100 pdctl's plan is one tensor-parallel engine, so that
pair is refused), every number from the model's config.json (appliance/model/profiles.py, costmodel.py ``ARCH``).
The H200 kernel efficiencies were fitted on a Llama-3.1-8B-shaped model (docs/gpu-run.md); nothing in the twin was
checked against Qwen2.5-32B, nor Llama on A100.

Setups, one run, the same conversations (seed fixed), the same engines (pdctl's setup on that GPU:
``CostParams.for_setup("pdctl", hardware)``):
- ``pdctl``: the default plan (``make_plan``, as benchmarks/policy_study.py: its workers and its L1 size, which is
  the fake box's host RAM less a reserve), the adaptive policy with the warm rule
  (``decide()``: a turn goes to the worker whose own GPU prefix cache holds its history while that worker is not the
  bottleneck) and SLO admission (the default ``[admission]``);
- ``pdctl, warm off``: the same with ``warm_min_tokens = 0`` (load alone decides, the policy before issue 32);
- ``round-robin 1P{n-1}D``: the seed's proxy (every turn split, P and D by one global round-robin index) and the
  seed's 80 GB L1;
- ``vllm-router cache_aware``: the same engines all serving whole requests without the KV connector (no shared L1),
  behind vllm-router 0.1.17's default policy (appliance/twin/peer_router.py), no admission.
Rates: 0.7x, 1x, 1.5x and 2x G, where G is the highest rate at which pdctl's default (admission off) holds TTFT p95
and TPOT p95 of all turns within the SLOs (2 s, 80 ms), bisected. Each rate runs ``Sessions.steady_window_s()`` of conversation
starts; rates (asked, goodput) count the last two thirds of that window (the first fills the box).

Printed per setup and rate: goodput (turns/s within both SLOs), turns asked per second (retries included),
refusals, TTFT p50/p95 of turn 1 and turn 5, prompt tokens computed per token the users wrote (the system prompt
and the history are not new), and where the first leg's KV came from (own GPU cache / L1 / computed).

Targets (issue 32), checked for ``pdctl``: turn-5 TTFT p50 within 20 % of turn 1's (at 0.7x and 1x); prompt tokens
computed <= 1.3x the new tokens (at every rate); goodput >= 1.3x vllm-router cache_aware's (at every rate, printed
as the ratio). Exit 0 when all hold, 1 otherwise (each failure on a FAIL line).

Usage: ``python benchmarks/chat_sessions_twin.py [--profile a100|h200|all] [--think-s S] [--seed N] [--model M]``.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.policy.admit import Policy  # noqa: E402
from appliance.policy.decide import Thresholds  # noqa: E402
from appliance.twin.params import PDCTL_SETUP, CostParams  # noqa: E402
from appliance.twin.profiles import SESSION_PROFILES  # noqa: E402
from appliance.twin.simulator import simulate  # noqa: E402
from appliance.twin.workloads import Sessions  # noqa: E402

PROFILES = {"a100": ("a100-80gb", 3), "h200": ("h200", 2)}     # name: (hardware, GPUs)
NVML = {"a100-80gb": "A100-80GB", "h200": "H200"}
MODEL = "deepseek-v2-lite"      # the seed's model (MLA: 31,104 B of KV a token)
# --model: the registry models the twin has shape facts for (appliance/twin/costmodel.py ARCH), each KV size from
# its config.json (appliance/model/profiles.py): llama-3.1-8b 131,072 B a token (32 layers x 8 KV heads x 128 x
# K and V x bf16), 4.2x the seed model's
MODELS = ("deepseek-v2-lite", "llama-3.1-8b", "qwen2.5-32b")     # llama-3.1-70b needs tensor parallel here
MULTIPLES = (0.7, 1.0, 1.5, 2.0)
LIGHT = (0.7, 1.0)              # where turn 5's TTFT p50 is compared with turn 1's
TURN_TOL = 0.20
COMPUTED_MAX = 1.3
GOODPUT_RATIO = 1.3
SLO = (2.0, 0.080)
SEED_L1_GB = 80.0               # the seed's LMCache --l1-size-gb (shared/reference/seed-runbooks.md)


@dataclasses.dataclass(frozen=True)
class Setup:
    label: str
    prefill: int
    decode: int
    both: int
    policy: str
    warm: bool = True
    admission: bool = False
    connector: bool = True
    warm_extra: float = Thresholds().warm_max_extra_load
    l1_gb: float = SEED_L1_GB
    model: str = MODEL


def setups(hardware: str, gpus: int, model: str = MODEL) -> list:
    from appliance.inventory import detect
    from appliance.model.profiles import resolve as resolve_model
    from appliance.plan.planner import Overrides, Workload as PlanWorkload, make_plan
    plan = make_plan(detect(f"fake:{gpus}x{NVML[hardware]}"), resolve_model(model), PlanWorkload(),
                     Overrides(engine="twin"))
    p, d, b = (len(plan.by_role(r)) for r in ("prefill", "decode", "both"))
    fam = plan.predicted.get("family", f"{p}P{d}D{b}B")
    l1 = plan.kv_server.l1_size_gb      # what the plan gives LMCache on this box (host RAM less a reserve)
    if p + d + b != gpus:
        raise SystemExit(f"pdctl's plan for {model} on {gpus}x {NVML[hardware]} is {fam} (tensor parallel or fewer "
                         "workers than GPUs): the per-GPU comparison below does not apply; pick another --profile")
    return [Setup(f"pdctl ({fam}, adaptive, warm, admission)", p, d, b, "adaptive", True, True, l1_gb=l1, model=model),
            Setup(f"pdctl, warm off ({fam})", p, d, b, "adaptive", False, True, l1_gb=l1, model=model),
            Setup(f"round-robin 1P{gpus - 1}D (seed)", 1, gpus - 1, 0, "round-robin", model=model),
            Setup(f"vllm-router cache_aware, {gpus} engines, no connector", 0, 0, gpus, "cache-aware",
                  connector=False, model=model)]


def run(hardware: str, s: Setup, sessions: Sessions, rate: float, seed: int, admission=None) -> dict:
    th = Thresholds(warm_max_extra_load=s.warm_extra) if s.warm else Thresholds(warm_min_tokens=0)
    adm = admission if admission is not None else (Policy(ttft_slo_s=SLO[0], tpot_slo_s=SLO[1]) if s.admission
                                                   else None)
    n = math.ceil(rate * sessions.steady_window_s())
    return simulate(hardware, s.model, s.prefill, s.decode, sessions, [rate], num_prompts=n, policy=s.policy,
                    seed=seed, both=s.both, thresholds=th, connector=s.connector, admission=adm, kv_size_gb=s.l1_gb,
                    params=CostParams.for_setup(PDCTL_SETUP, hardware))[0]


def holds(r: dict) -> bool:
    return r["failed"] == 0 and r["p95_ttft_ms"] <= SLO[0] * 1000 and r["p95_tpot_ms"] <= SLO[1] * 1000


def ceiling(hardware: str, s: Setup, sessions: Sessions, seed: int, lo: float = 4.0) -> float:
    """The highest rate (turns/s) at which ``s`` without admission holds both SLOs: doubling from ``lo`` (halving
    when ``lo`` already misses them), then 4 bisections."""
    off = Policy(mode="off")
    if holds(run(hardware, s, sessions, lo, seed, off)):
        hi = lo * 2
        while holds(run(hardware, s, sessions, hi, seed, off)):
            lo, hi = hi, hi * 2
            if hi > 1024:
                return lo
    else:
        hi, lo = lo, lo / 2
        while not holds(run(hardware, s, sessions, lo, seed, off)):
            hi, lo = lo, lo / 2
            if lo < 0.1:
                return 0.0
    for _ in range(4):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if holds(run(hardware, s, sessions, mid, seed, off)) else (lo, mid)
    return lo


def row(label: str, rate: float, r: dict) -> str:
    t1, t5 = r["per_turn"].get(1, {}), r["per_turn"].get(5, {})
    src = r["kv_source"]
    return (f"| {label} | {rate:.1f} | {r['session_goodput']:.1f} | {r['turns_asked_per_s']:.1f} | "
            f"{r.get('refused', 0)} | {t1.get('ttft_p50_ms', float('nan')):.0f} / {t1.get('ttft_p95_ms', 0):.0f} | "
            f"{t5.get('ttft_p50_ms', float('nan')):.0f} / {t5.get('ttft_p95_ms', 0):.0f} | "
            f"{r['computed_per_new']:.2f} | {src['gpu']:.2f} / {src['l1']:.2f} / {src['computed']:.2f} |")


def kv_facts(hardware: str, model: str) -> str:
    """The model's KV bytes a token and how many tokens one GPU's own prefix cache holds (pdctl's engine settings)."""
    from appliance.model.profiles import resolve as resolve_model
    from appliance.twin.costmodel import CostModel
    from appliance.twin.hardware import resolve as resolve_hw
    m = resolve_model(model)
    cap = CostModel(resolve_hw(hardware), m, params=CostParams.for_setup(PDCTL_SETUP, hardware)).kv_capacity_tokens()
    return f"KV {m.kv_bytes_per_token:,} B a token, {cap / 1e6:.2f} M tokens of GPU KV cache per engine"


def study(name: str, sessions: Sessions, seed: int, model: str = MODEL) -> list:
    hardware, gpus = PROFILES[name]
    t0 = time.time()
    ss = setups(hardware, gpus, model)
    g = ceiling(hardware, ss[0], sessions, seed)
    print(f"\n## {gpus}x {NVML[hardware]}, {model} ({kv_facts(hardware, model)}): G = {g:.1f} turns/s (pdctl's "
          f"default, admission off, both SLOs; L1 {ss[0].l1_gb:g} GB; {time.time() - t0:.0f} s)\n", flush=True)
    print("| setup | rate turns/s | goodput | asked (with retries) | refused | turn 1 TTFT p50 / p95 ms | "
          "turn 5 TTFT p50 / p95 ms | computed / new | KV from GPU / L1 / computed |")
    print("|---|---|---|---|---|---|---|---|---|")
    fails = []
    res: dict = {}
    for m in MULTIPLES:
        rate = round(g * m, 2)
        for s in ss:
            r = res[(s.label, m)] = run(hardware, s, sessions, rate, seed)
            print(row(s.label, rate, r), flush=True)
    pd, peer = ss[0].label, ss[-1].label
    print()
    for m in MULTIPLES:
        r, q = res[(pd, m)], res[(peer, m)]
        ratio = r["session_goodput"] / q["session_goodput"] if q["session_goodput"] else math.inf
        t1, t5 = r["per_turn"][1]["ttft_p50_ms"], r["per_turn"].get(5, {}).get("ttft_p50_ms", math.nan)
        checks = [(f"{m:g}x G: computed / new {r['computed_per_new']:.2f} <= {COMPUTED_MAX}",
                   r["computed_per_new"] <= COMPUTED_MAX),
                  (f"{m:g}x G: goodput {r['session_goodput']:.1f} vs vllm-router cache_aware "
                   f"{q['session_goodput']:.1f} = {ratio:.2f}x >= {GOODPUT_RATIO}x", ratio >= GOODPUT_RATIO)]
        if m in LIGHT:
            checks.append((f"{m:g}x G: turn 5 TTFT p50 {t5:.0f} ms within {TURN_TOL:.0%} of turn 1's {t1:.0f} ms "
                           "(or below)", t5 <= t1 * (1 + TURN_TOL)))
        for text, ok in checks:
            print(f"{'PASS' if ok else 'FAIL'} {name} {text}")
            if not ok:
                fails.append(f"{name} {text}")
    print(f"({name}: {time.time() - t0:.0f} s)")
    return fails


def sweep_warm(name: str, sessions: Sessions, seed: int, values=(4.0, 8.0, 16.0, 32.0, 64.0),
               model: str = MODEL) -> None:
    """pdctl's default at 0.7x, 1x and 1.5x G for several ``warm_max_extra_load`` values (how much busier than the
    least-loaded worker a warm worker may be and still get the turn): where ``Thresholds``' default comes from."""
    hardware, gpus = PROFILES[name]
    base = setups(hardware, gpus, model)[0]
    g = ceiling(hardware, base, sessions, seed)
    print(f"\n## warm_max_extra_load on {gpus}x {NVML[hardware]}, {model}: G = {g:.1f} turns/s\n")
    print("| setup | rate turns/s | goodput | asked (with retries) | refused | turn 1 TTFT p50 / p95 ms | "
          "turn 5 TTFT p50 / p95 ms | computed / new | KV from GPU / L1 / computed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in (0.7, 1.0, 1.5):
        for v in values:
            s = dataclasses.replace(base, warm_extra=v, label=f"warm_max_extra_load {v:g}")
            print(row(s.label, round(g * m, 2), run(hardware, s, sessions, round(g * m, 2), seed)), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", choices=(*PROFILES, "all"), default="all")
    ap.add_argument("--think-s", type=float, default=None, help="mean think time (default: the profile's)")
    ap.add_argument("--seed", type=int, default=2003)
    ap.add_argument("--model", choices=MODELS, default=MODEL,
                    help="the model the engines serve (default: the seed's, %(default)s; llama-3.1-8b has 4.2x its "
                         "KV a token)")
    ap.add_argument("--sweep-warm", action="store_true", help="only sweep the warm rule's warm_max_extra_load")
    args = ap.parse_args(argv)
    prof = SESSION_PROFILES["chat-sessions"]
    if args.think_s is not None:
        prof = dataclasses.replace(prof, think_s=args.think_s)
    sessions = Sessions(prof)
    sessions.check()
    print(f"# chat sessions on the twin: {prof.system_len}-token system prompt, {prof.first_len}-token first message, "
          f"{prof.message_len}-token later messages, {prof.answer_len}-token answers, {prof.turns_min}-"
          f"{prof.turns_max} turns, think {prof.think_s:g} s; SLO TTFT p95 {SLO[0]:g} s, TPOT p95 "
          f"{SLO[1] * 1000:g} ms; seed {args.seed}; model {args.model}")
    fails = []
    for name in (PROFILES if args.profile == "all" else (args.profile,)):
        if args.sweep_warm:
            sweep_warm(name, sessions, args.seed, model=args.model)
            continue
        fails += study(name, sessions, args.seed, args.model)
    print(f"\n{len(fails)} target(s) missed" + "".join(f"\nFAIL {f}" for f in fails))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
