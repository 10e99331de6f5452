"""Discrete-event simulator of a whole PD stack: proxy policy + prefillers + decoders + KV server.

Each request follows the seed's path: proxy -> prefiller (``max_tokens=1``; LMCache lookup, load of the
hit tokens over the host link, prefill in the engine's batch) -> KV store (GPU->host copy, then the
``request_store_finished`` notification) -> proxy -> decoder (lookup + load of the whole prompt, one
token recomputed, decode in the continuous batch) -> client. Engines are ``core.EngineCore`` with the
same cost model the live twin engine uses.

Policies:
- ``round-robin``: the seed's proxy: one global round-robin index picks the prefiller and the decoder;
  the P leg always runs.
- ``pdctl``: least-loaded prefiller/decoder (fewest requests the proxy has outstanding there, lowest
  index on ties); skip the P leg when the prompt is shorter than one LMCache chunk (nothing could be
  transferred) or when the KV server already holds all but at most ``skip_uncached_max`` (512) tokens of
  the prompt; the decoder then prefills the short remainder itself and no store wait is needed.
  With 0 prefillers (pdctl only) every engine is ``both``: it prefills everything it is sent and stores
  the chunks it computed in the KV server, as LMCache's ``kv_both`` role does.

Warm-up like the seed: the shared prefix chunks are in the KV server before the first request.
Arrivals are Poisson (``vllm bench serve``'s default), the first at t=0. Each rate starts from idle
engines. Output keys follow ``vllm bench serve`` (``request_throughput`` = completed / duration, the
duration ending at the last response, so finite runs read below the steady-state ceiling), plus
``kv_hit_rate`` (KV server view: hit / looked-up tokens over all lookups of both legs, like
``lmcache_mp_lookup_hit_tokens / ..._requested_tokens``), ``max_concurrent_requests`` (client side),
``p_leg_skipped`` and ``preemptions``.
"""
from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from appliance.constants import LMCACHE_CHUNK_TOKENS
from appliance.models import ModelProfile, resolve as resolve_model

from .core import EngineCore, HostLink, Seq
from .costmodel import CostModel, CostParams, EngineConfig
from .hardware import Hardware, resolve as resolve_hw
from .kvstore import ChunkStore

GB = 1e9
POLICIES = ("round-robin", "pdctl")


class SimError(ValueError):
    """Bad simulator input (what, and how to fix it)."""


@dataclass(frozen=True)
class Workload:
    input_len: int = 7869      # tokens per prompt (the seed's P50 profile: 6000 shared + 1869 unique)
    prefix_len: int = 6000     # tokens shared by every prompt
    output_len: int = 252

    def check(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise SimError(f"input-len ({self.input_len}) and output-len ({self.output_len}) must be >= 1")
        if not 0 <= self.prefix_len <= self.input_len:
            raise SimError(f"prefix-len {self.prefix_len} must be between 0 and input-len {self.input_len}")


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "round-robin"
    skip_uncached_max: int = 512


from ..percentiles import percentile  # noqa: E402  (re-exported: one definition)


class _Loop:
    def __init__(self) -> None:
        self.heap: list = []
        self.n = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        self.n += 1
        heapq.heappush(self.heap, (t, self.n, fn, args))

    def run(self) -> float:
        t = 0.0
        heap = self.heap
        while heap:
            t, _, fn, args = heapq.heappop(heap)
            fn(t, *args)
        return t


class _SimEngine:
    def __init__(self, name: str, cost: CostModel, loop: _Loop):
        self.name = name
        self.core = EngineCore(cost)
        self.loop = loop
        self.link_in = HostLink()
        self.link_out = HostLink()
        self.busy = False
        self.outstanding = 0
        self.apc: set = set()     # chunk keys on the GPU (vLLM automatic prefix caching), see ``local_hit``

    def local_hit(self, keys: list, chunk_tokens: list) -> int:
        """Leading prompt tokens already on this GPU (APC), then remember the prompt's chunks.

        Approximation: nothing is evicted. The shared prefix is touched by every request so vLLM's LRU
        keeps it; unique chunks never recur on the same engine, so their eviction does not matter here."""
        n = 0
        for k, c in zip(keys, chunk_tokens):
            if k not in self.apc:
                break
            n += c
        self.apc.update(keys)
        return n

    def kick(self, t: float) -> None:
        if self.busy or not self.core.has_work():
            return
        plan = self.core.step()
        if plan is None:
            return
        self.busy = True
        self.loop.at(t + plan.duration, self._end, plan)

    def _end(self, t: float, plan) -> None:
        self.busy = False
        for seq in plan.first_tokens:
            seq.payload.on_first(t, seq)
        for seq in plan.finished:
            seq.payload.on_finish(t, seq)
        for seq in plan.rejected:
            seq.payload.on_reject(t, seq)
        self.kick(t)


@dataclass
class _Req:
    idx: int
    arrival: float
    keys: list
    chunk_tokens: list
    ttft: Optional[float] = None
    e2e: Optional[float] = None
    failed: bool = False
    skipped_p: bool = False


class _Stack:
    """One run: engines, KV store, proxy policy and result collection."""

    def __init__(self, cost: CostModel, n_prefill: int, n_decode: int, wl: Workload, policy: PolicyConfig,
                 kv_bytes: int):
        self.cost = cost
        self.p = cost.params
        self.loop = _Loop()
        self.pre = [_SimEngine(f"prefill-{i}", cost, self.loop) for i in range(n_prefill)]
        self.dec = [_SimEngine(f"decode-{i}", cost, self.loop) for i in range(n_decode)]
        self.store = ChunkStore(kv_bytes)
        self.wl = wl
        self.policy = policy
        self.rr = 0
        self.inflight = 0
        self.max_inflight = 0
        self.done: list[_Req] = []
        self.last_t = 0.0
        kvb = cost.kv_bytes_per_token
        c = LMCACHE_CHUNK_TOKENS
        self.n_chunks = math.ceil(wl.input_len / c)
        self.chunk_tokens = [min(c, wl.input_len - j * c) for j in range(self.n_chunks)]
        self.prefix_chunks = wl.prefix_len // c
        self.store.store((("p", j), c, c * kvb) for j in range(self.prefix_chunks))  # warm-up

    def keys(self, idx: int) -> list:
        return [("p", j) if j < self.prefix_chunks else ("r", idx, j) for j in range(self.n_chunks)]

    # ---- proxy ---------------------------------------------------------------------------------
    def arrive(self, t: float, req: _Req) -> None:
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        if self.policy.name == "pdctl":
            n = self.wl.input_len
            cached = min(self.store.peek(req.keys), n - 1)
            if not self.pre or n < LMCACHE_CHUNK_TOKENS or n - cached <= self.policy.skip_uncached_max:
                req.skipped_p = True
                self.send_d(t, req)
                return
            eng = min(self.pre, key=lambda e: e.outstanding)
        else:
            eng = self.pre[self.rr % len(self.pre)]
        eng.outstanding += 1
        self.loop.at(t + self.p.http_hop_s, self.lookup, req, eng, 1)

    def send_d(self, t: float, req: _Req) -> None:
        if self.policy.name == "pdctl":
            eng = min(self.dec, key=lambda e: e.outstanding)
        else:
            eng = self.dec[self.rr % len(self.dec)]
            self.rr += 1
        eng.outstanding += 1
        self.loop.at(t + self.p.http_hop_s, self.lookup, req, eng, self.wl.output_len)

    # ---- engines -------------------------------------------------------------------------------
    def lookup(self, t: float, req: _Req, eng: _SimEngine, max_tokens: int) -> None:
        hit = min(self.store.lookup(req.keys, self.chunk_tokens), self.wl.input_len - 1)
        local = min(eng.local_hit(req.keys, self.chunk_tokens), hit) if self.p.prefix_cache else 0
        ready = eng.link_in.reserve(t + self.p.api_overhead_s + self.p.rpc_s,
                                    self.cost.host_transfer_time(hit - local))
        if hit > local:   # an external load: the connector parks the request until the load is reported
            ready += self.p.kv_load_s
        seq = Seq(rid=str(req.idx), prompt_len=self.wl.input_len, max_tokens=max_tokens, hit=hit,
                  payload=_PLeg(self, req, eng) if max_tokens == 1 and eng in self.pre else _DLeg(self, req, eng))
        self.loop.at(ready, self._add, eng, seq)

    def _add(self, t: float, eng: _SimEngine, seq: Seq) -> None:
        eng.core.add(seq)
        eng.kick(t)

    def stored(self, t: float, req: _Req) -> None:
        kvb = self.cost.kv_bytes_per_token
        self.store.store((k, n, n * kvb) for k, n in zip(req.keys, self.chunk_tokens))

    def finish(self, t: float, req: _Req) -> None:
        self.inflight -= 1
        self.last_t = max(self.last_t, t)
        self.done.append(req)


class _PLeg:
    __slots__ = ("s", "req", "eng")

    def __init__(self, s: _Stack, req: _Req, eng: _SimEngine):
        self.s, self.req, self.eng = s, req, eng

    def on_first(self, t: float, seq: Seq) -> None:
        pass

    def on_finish(self, t: float, seq: Seq) -> None:
        s = self.s
        self.eng.outstanding -= 1
        new = seq.prompt_len - seq.hit
        stored_at = self.eng.link_out.reserve(t, s.cost.host_transfer_time(new))
        s.loop.at(stored_at, s.stored, self.req)
        go = max(t + s.p.http_hop_s, stored_at + s.p.store_notify_s)
        s.loop.at(go, s.send_d, self.req)

    def on_reject(self, t: float, seq: Seq) -> None:
        self.eng.outstanding -= 1
        self.req.failed = True
        self.s.finish(t, self.req)


class _DLeg(_PLeg):
    def on_first(self, t: float, seq: Seq) -> None:
        s = self.s
        self.req.ttft = t + s.p.http_hop_s - self.req.arrival
        if not s.pre and seq.preemptions == 0:   # no prefillers: engines run kv_both and store what they computed
            stored_at = self.eng.link_out.reserve(t, s.cost.host_transfer_time(seq.prompt_len - seq.hit))
            s.loop.at(stored_at, s.stored, self.req)

    def on_finish(self, t: float, seq: Seq) -> None:
        self.eng.outstanding -= 1
        t_out = t + self.s.p.http_hop_s
        self.req.e2e = t_out - self.req.arrival
        self.s.finish(t_out, self.req)


def _summary(stack: _Stack, rate: float, num_prompts: int, duration: float, hit0: tuple) -> dict:
    wl = stack.wl
    ok = [r for r in stack.done if not r.failed and r.ttft is not None]
    failed = num_prompts - len(ok)
    ttft = [r.ttft * 1000 for r in ok]
    e2e = [r.e2e * 1000 for r in ok]
    tpot = [(r.e2e - r.ttft) * 1000 / (wl.output_len - 1) for r in ok] if wl.output_len > 1 else []
    out_tokens = wl.output_len * len(ok)
    in_tokens = wl.input_len * len(ok)
    dur = max(duration, 1e-9)
    c = stack.store.c
    req_tok = c.lookup_requested_tokens - hit0[0]
    hit_tok = c.lookup_hit_tokens - hit0[1]
    res = {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "duration": round(dur, 3),
        "completed": len(ok),
        "failed": failed,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "max_concurrent_requests": stack.max_inflight,
        "kv_hit_rate": hit_tok / req_tok if req_tok else 0.0,
        "p_leg_skipped": sum(1 for r in ok if r.skipped_p),
        "preemptions": sum(e.core.counters.preemptions for e in stack.pre + stack.dec),
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("e2el", e2e)):
        res[f"mean_{name}_ms"] = statistics.fmean(xs) if xs else 0.0
        res[f"median_{name}_ms"] = percentile(xs, 50)
        res[f"std_{name}_ms"] = statistics.pstdev(xs) if len(xs) > 1 else 0.0
        for q in (50, 90, 95, 99):
            res[f"p{q}_{name}_ms"] = percentile(xs, q)
    return res


def _resolve(hardware, model) -> tuple[Hardware, ModelProfile]:
    hw = hardware if isinstance(hardware, Hardware) else resolve_hw(str(hardware))
    mp = model if isinstance(model, ModelProfile) else resolve_model(str(model))
    return hw, mp


def simulate_rate(cost: CostModel, prefill: int, decode: int, workload: Workload, rate: float,
                  num_prompts: int, policy: PolicyConfig, seed: int, kv_bytes: int) -> dict:
    stack = _Stack(cost, prefill, decode, workload, policy, kv_bytes)
    rng = random.Random(seed)
    t = 0.0
    for i in range(num_prompts):
        req = _Req(idx=i, arrival=t, keys=stack.keys(i), chunk_tokens=stack.chunk_tokens)
        stack.loop.at(t, stack.arrive, req)
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    c = stack.store.c
    hit0 = (c.lookup_requested_tokens, c.lookup_hit_tokens)
    stack.loop.run()
    return _summary(stack, rate, num_prompts, stack.last_t, hit0)


def simulate(hardware: object = "a100-80gb", model: object = "deepseek-v2-lite", prefill: int = 1,
             decode: int = 2, workload: Workload = Workload(), rates: Sequence[float] = (1, 2, 5, 10),
             num_prompts: int = 600, policy: str = "round-robin", seed: int = 2003,
             params: Optional[CostParams] = None, engine: Optional[EngineConfig] = None,
             kv_size_gb: float = 80.0, skip_uncached_max: int = 512) -> list[dict]:
    """One summary dict per rate (``vllm bench serve`` key names + ``kv_hit_rate``); SimError on bad input."""
    if policy not in POLICIES:
        raise SimError(f"--policy {policy!r}: use one of {', '.join(POLICIES)}")
    if prefill < (0 if policy == "pdctl" else 1) or decode < 1:
        raise SimError(f"need >= 1 prefiller (round-robin) and >= 1 decoder, got {prefill}P{decode}D")
    if num_prompts < 1:
        raise SimError(f"--num-prompts must be >= 1, got {num_prompts}")
    if not rates or any(not (r > 0) for r in rates):
        raise SimError(f"--rates must be positive numbers (or inf), got {list(rates)}")
    if kv_size_gb <= 0:
        raise SimError(f"KV server size must be > 0 GB, got {kv_size_gb}")
    workload.check()
    hw, mp = _resolve(hardware, model)
    cost = CostModel(hw, mp, engine or EngineConfig(), params or CostParams())
    if cost.kv_capacity_tokens() <= 0:
        raise SimError(f"{mp.name} ({mp.weights_bytes / 2**30:.1f} GiB weights) does not fit on {hw.name} "
                       f"at gpu_memory_utilization {cost.cfg.gpu_memory_utilization}: raise tp or pick a "
                       "larger GPU")
    pol = PolicyConfig(policy, skip_uncached_max)
    return [simulate_rate(cost, prefill, decode, workload, float(r), num_prompts, pol, seed + i,
                          int(kv_size_gb * GB))
            for i, r in enumerate(rates)]
