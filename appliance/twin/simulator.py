"""Discrete-event simulator of a whole PD stack: proxy policy + prefillers + decoders + KV server.

Each request follows the seed's path: proxy -> prefiller (``max_tokens=1``; LMCache lookup, load of the
hit tokens over the host link, prefill in the engine's batch) -> KV store (GPU->host copy, then the
``request_store_finished`` notification) -> proxy -> decoder (lookup + load of the whole prompt, one
token recomputed, decode in the continuous batch) -> client. Engines are ``core.EngineCore`` and a
request's way in and out is ``kvpath`` (the engine's own prefix cache where the setup has it), the same
code the live twin engine runs. ``connector=False``: engines without a KV connector (no KV server; a
decode leg recomputes what its own prefix cache lacks).

Policies:
- ``round-robin``: the seed's proxy: one global round-robin index picks the prefiller and the decoder;
  the P leg always runs.
- ``pdctl``: least-loaded prefiller/decoder (fewest requests the proxy has outstanding there, lowest
  index on ties); skip the P leg when the prompt is shorter than one LMCache chunk (nothing could be
  transferred) or when the KV server already holds all but at most ``skip_uncached_max`` (512) tokens of
  the prompt; the decoder then prefills the short remainder itself and no store wait is needed.
  With 0 prefillers (pdctl only) every engine is ``both``: it prefills everything it is sent and stores
  the chunks it computed in the KV server, as LMCache's ``kv_both`` role does.

Warm-up like the seed: the shared prefix chunks are in the KV server (and in every engine's prefix cache
where the setup has one) before the first request. Arrivals are Poisson, the first at t=0, drawn exactly as
``pdctl bench`` draws them (``random.Random(seed + rate index)``), so a simulation with a bench run's seed
replays its arrival instants. Each rate starts from idle engines. Output keys follow ``vllm bench serve`` (``request_throughput`` = completed / duration, the
duration ending at the last response, so finite runs read below the steady-state ceiling), plus
``kv_hit_rate`` (KV server view: hit / looked-up tokens over all lookups of both legs, like
``lmcache_mp_lookup_hit_tokens / ..._requested_tokens``), ``max_concurrent_requests`` (client side),
``p_leg_skipped`` and ``preemptions``. With an admission policy (``admission=``, adaptive only; see simstack.py):
``refused`` (by reason), ``good`` (requests within both SLOs: TTFT and the request's own TPOT) and ``goodput``
(good per second of the run), always side by side, and the queue's longest length.
"""
from __future__ import annotations

import math
import random
from typing import Optional, Sequence

from appliance.model.profiles import ModelProfile
from appliance.model.profiles import resolve as resolve_model
from appliance.settings.schema import default as _d

from ..percentiles import (
    latency_fields,
    percentile,  # noqa: F401  (re-exported: tests read it here)
    throughput_fields,
)
from ..policy.admit import Policy as AdmissionPolicy
from ..policy.decide import Thresholds
from .costmodel import CostModel, CostParams, EngineConfig
from .params import PDCTL_SETUP
from .hardware import Hardware
from .hardware import resolve as resolve_hw
from .simstack import PolicyConfig, SimRequest, SimStack
from .workloads import Mix, Sessions, SimError, Workload  # noqa: F401  (re-exported: the simulator's inputs)

GB = 1e9
POLICIES = ("round-robin", "pdctl", "adaptive", "cache-aware")


def _summary(stack: SimStack, rate: float, num_prompts: int, duration: float, hit0: tuple) -> dict:
    ok = [r for r in stack.done if not r.failed and r.ttft is not None]
    refused = [r for r in stack.done if r.refused]
    failed = num_prompts - len(ok) - len(refused)
    ttft = [r.ttft * 1000 for r in ok]
    e2e = [r.e2e * 1000 for r in ok]
    tpot = [(r.e2e - r.ttft) * 1000 / (r.wl.output_len - 1) for r in ok if r.wl.output_len > 1]
    out_tokens = sum(r.wl.output_len for r in ok)
    in_tokens = sum(r.wl.input_len for r in ok)
    dur = max(duration, 1e-9)
    c = stack.store.c
    req_tok = c.lookup_requested_tokens - hit0[0]
    hit_tok = c.lookup_hit_tokens - hit0[1]
    busy = [e.core.counters.busy_s / dur for e in stack.engines]
    # completions per second over the second half of the arrival window: equals the asked rate only while
    # the stack keeps up (a finite run past capacity can still show low TTFT/TPOT percentiles)
    last = max((r.arrival for r in stack.done), default=0.0)
    half = [r for r in ok if last / 2 <= r.arrival + r.e2e <= last]
    sustained = len(half) / (last / 2) if last > 0 else float(len(ok))
    res = {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "duration": round(dur, 3),
        **throughput_fields(len(ok), failed, in_tokens, out_tokens, dur),
        "sustained_throughput": sustained,
        "max_concurrent_requests": stack.max_inflight,
        "kv_hit_rate": hit_tok / req_tok if req_tok else 0.0,
        "p_leg_skipped": sum(1 for r in ok if r.skipped_p),
        "preemptions": sum(e.core.counters.preemptions for e in stack.engines),
        "decisions": dict(sorted(stack.decisions.items())),
        "engine_busy": {e.name: round(b, 3) for e, b in zip(stack.engines, busy)},
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("e2el", e2e)):
        res.update(latency_fields(name, xs))
    adm = stack.policy.admission
    if adm is not None:
        # good per second of arrivals (the asked rate x the share within both SLOs): a run's drain tail after
        # the last arrival is not capacity the box had to offer
        window = num_prompts / rate if math.isfinite(rate) and rate > 0 else dur
        good = sum(1 for r in ok if r.ttft <= adm.ttft_slo_s and
                   (r.wl.output_len <= 1 or (r.e2e - r.ttft) / (r.wl.output_len - 1) <= adm.tpot_slo_s))
        why: dict = {}
        for r in refused:
            why[r.refused] = why.get(r.refused, 0) + 1
        res.update({"admission_mode": adm.mode, "admitted": len(ok) + failed, "refused": len(refused),
                    "refused_reasons": dict(sorted(why.items())), "good": good, "goodput": good / window,
                    "good_share_admitted": good / len(ok) if ok else 0.0, "max_queue": stack.max_queue,
                    "admissions": dict(sorted(stack.admissions.items()))})
    return res


def _resolve(hardware, model) -> tuple[Hardware, ModelProfile]:
    hw = hardware if isinstance(hardware, Hardware) else resolve_hw(str(hardware))
    mp = model if isinstance(model, ModelProfile) else resolve_model(str(model))
    return hw, mp


def simulate_rate(cost: CostModel, roles: Sequence[str], workload, rate: float, num_prompts: int,
                  policy: PolicyConfig, seed: int, kv_bytes: int, connector: bool = True,
                  slo: tuple = (_d("workload", "ttft_slo_s"), _d("workload", "tpot_slo_ms") / 1000)) -> dict:
    if isinstance(workload, Sessions):
        return _simulate_sessions(cost, roles, workload, rate, num_prompts, policy, seed, kv_bytes, connector, slo)
    mix = Mix.of(workload)
    stack = SimStack(cost, roles, mix, policy, kv_bytes, connector)
    rng = random.Random(seed)
    pick = random.Random(seed * 7919 + 1)    # the class draw never shifts the arrival times
    shapes = [stack.shape(wl) for _, wl in mix.classes]
    t = 0.0
    for i in range(num_prompts):
        ci = mix.pick(pick)
        wl = mix.classes[ci][1]
        req = SimRequest(idx=i, arrival=t, keys=stack.keys(i, ci, wl), chunk_tokens=shapes[ci], wl=wl, ci=ci)
        stack.loop.at(t, stack.arrive, req)
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    c = stack.store.c
    hit0 = (c.lookup_requested_tokens, c.lookup_hit_tokens)
    stack.loop.run()
    return _summary(stack, rate, num_prompts, stack.last_t, hit0)


def _simulate_sessions(cost: CostModel, roles: Sequence[str], sessions: Sessions, rate: float, num_turns: int,
                       policy: PolicyConfig, seed: int, kv_bytes: int, connector: bool, slo: tuple) -> dict:
    from .sessions import SessionDriver, session_fields
    stack = SimStack(cost, roles, sessions.mix(), policy, kv_bytes, connector)
    driver = SessionDriver(stack, sessions, seed)
    window = driver.schedule(rate, num_turns, seed)
    c = stack.store.c
    hit0 = (c.lookup_requested_tokens, c.lookup_hit_tokens)
    stack.loop.run()
    res = _summary(stack, rate, len(stack.done), stack.last_t, hit0)
    res.update(session_fields(driver, window, *slo))
    return res


def roles_for(prefill: int, decode: int, both: int = 0, policy: str = "round-robin") -> tuple:
    """Engine roles in plan order. The old ``pdctl`` 0P form (no prefillers) means engines doing both."""
    if policy == "pdctl" and prefill == 0 and both == 0:
        decode, both = 0, decode
    return ("prefill",) * prefill + ("decode",) * decode + ("both",) * both


def simulate(hardware: object = "a100-80gb", model: object = _d("install", "model"), prefill: int = 1,
             decode: int = 2, workload=Workload(), rates: Sequence[float] = (1, 2, 5, 10),
             num_prompts: int = 600, policy: str = "round-robin", seed: int = 2003,
             params: Optional[CostParams] = None, engine: Optional[EngineConfig] = None,
             kv_size_gb: float = 80.0, skip_uncached_max: int = 512, both: int = 0,
             thresholds: Thresholds = Thresholds(), connector: bool = True,
             admission: Optional[AdmissionPolicy] = None, setup: str = PDCTL_SETUP) -> list[dict]:
    """One summary dict per rate (``vllm bench serve`` key names + ``kv_hit_rate``); SimError on bad input.

    Cost parameters: ``params``, or ``CostParams.for_setup(setup, hardware)``: by default pdctl's own setup
    (vLLM 0.26 with CUDA graphs and prefix caching, LMCache 0.5.3, pdctl's proxy) on that GPU's fit; ``setup=
    "seed"`` for the seed's stack (its tables). The routing ``policy`` is separate: pdctl's proxy runs all three.

    Engines: ``prefill`` dedicated prefillers (kv_producer), ``decode`` decoders (kv_consumer), ``both``
    engines that store and retrieve (kv_both). ``workload`` is a Workload or a Mix. ``connector`` False: engines
    without a KV connector (no KV server; a decode leg recomputes what its own prefix cache lacks). ``admission``:
    the proxy's admission policy (adaptive only; mode off or None: none) and the SLOs ``good`` counts by."""
    if policy not in POLICIES:
        raise SimError(f"--policy {policy!r}: use one of {', '.join(POLICIES)}")
    if min(prefill, decode, both) < 0:
        raise SimError(f"engine counts must be >= 0, got {prefill}P{decode}D{both}B")
    if policy == "cache-aware" and (prefill or decode):
        raise SimError(f"--policy cache-aware routes whole requests: engines must all be both, got "
                       f"{prefill}P{decode}D{both}B")
    if policy == "round-robin" and (prefill < 1 or decode + both < 1):
        raise SimError(f"need >= 1 prefiller (round-robin) and >= 1 decoder, got {prefill}P{decode + both}D")
    if decode + both < 1 and not (policy == "adaptive" and prefill):
        raise SimError(f"need >= 1 engine that decodes, got {prefill}P{decode}D{both}B")
    if num_prompts < 1:
        raise SimError(f"--num-prompts must be >= 1, got {num_prompts}")
    if not rates or any(not (r > 0) for r in rates):
        raise SimError(f"--rates must be positive numbers (or inf), got {list(rates)}")
    if kv_size_gb <= 0:
        raise SimError(f"KV server size must be > 0 GB, got {kv_size_gb}")
    if isinstance(workload, Sessions):
        workload.check()
    else:
        Mix.of(workload).check()
    hw, mp = _resolve(hardware, model)
    if params is None:
        try:
            params = CostParams.for_setup(setup, hw.name)
        except ValueError as exc:
            raise SimError(str(exc)) from None
    cost = CostModel(hw, mp, engine or EngineConfig(), params)
    if cost.kv_capacity_tokens() <= 0:
        raise SimError(f"{mp.name} ({mp.weights_bytes / 2**30:.1f} GiB weights) does not fit on {hw.name} "
                       f"at gpu_memory_utilization {cost.cfg.gpu_memory_utilization}: raise tp or pick a "
                       "larger GPU")
    if admission is not None and admission.mode != "off" and policy != "adaptive":
        raise SimError(f"admission mode {admission.mode!r} needs --policy adaptive (the proxy admits on the "
                       f"workers decide() chose), got {policy!r}")
    pol = PolicyConfig(policy, skip_uncached_max, thresholds, admission)
    roles = roles_for(prefill, decode, both, policy)
    slo = (admission.ttft_slo_s, admission.tpot_slo_s) if admission is not None else \
        (_d("workload", "ttft_slo_s"), _d("workload", "tpot_slo_ms") / 1000)
    return [simulate_rate(cost, roles, workload, float(r), num_prompts, pol, seed + i, int(kv_size_gb * GB),
                          connector, slo) for i, r in enumerate(rates)]
