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

from . import kvpath
from .core import EngineCore, HostLink, Seq
from .costmodel import CostModel, CostParams, EngineConfig
from .hardware import Hardware, resolve as resolve_hw
from .kvstore import ChunkStore
from ..decide import AGGREGATE, R_STATIC, SPLIT, Thresholds, WorkerLoad, decide

GB = 1e9
POLICIES = ("round-robin", "pdctl", "adaptive")


from .workloads import Mix, SimError, Workload  # noqa: E402,F401  (re-exported: the simulator's inputs)


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "round-robin"
    skip_uncached_max: int = 512
    thresholds: Thresholds = Thresholds()


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
    def __init__(self, name: str, cost: CostModel, loop: _Loop, role: str = "decode", connector: bool = True):
        self.name = name
        self.role = role          # "prefill" (kv_producer) | "decode" (kv_consumer) | "both" (kv_both)
        self.backlog = 0          # uncached tokens sent here whose prefill has not finished (decide's input)
        self.core = EngineCore(cost, connector)
        self.loop = loop
        self.link_in = HostLink()
        self.link_out = HostLink()
        self.busy = False
        self.polling = False
        self.outstanding = 0
        self.apc = kvpath.PrefixCache()   # vLLM's prefix cache on this GPU, in blocks (used when prefix_cache)

    def kick(self, t: float) -> None:
        if self.busy or not self.core.has_work():
            return
        plan = self.core.step()
        if plan is None:
            if self.core.has_deferred() and not self.polling:   # idle: notice the answered lookup later
                self.polling = True
                self.loop.at(t + self.core.cost.params.connector_s, self._poll)
            return
        self.busy = True
        self.loop.at(t + plan.duration, self._end, plan)

    def _poll(self, t: float) -> None:
        self.polling = False
        self.core.release_deferred()
        self.kick(t)

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
    wl: "Workload" = None  # type: ignore[assignment]
    ci: int = 0                       # request class (its shared prefix)
    uncached: int = 0                 # adaptive: the decision's uncached-token estimate
    decode_to: Optional[_SimEngine] = None   # adaptive split: the D leg's engine, chosen at arrival
    backlog_eng: Optional[_SimEngine] = None
    leg: int = 0
    ttft: Optional[float] = None
    e2e: Optional[float] = None
    failed: bool = False
    skipped_p: bool = False


class _Stack:
    """One run: engines, KV store, proxy policy and result collection."""

    def __init__(self, cost: CostModel, roles: Sequence[str], mix: "Mix", policy: PolicyConfig, kv_bytes: int,
                 connector: bool = True):
        self.cost = cost
        self.connector = connector
        self.block = cost.cfg.block_size
        self.p = cost.params
        self.loop = _Loop()
        counters: dict = {}
        self.engines = []
        for r in roles:
            i = counters.get(r, 0)
            counters[r] = i + 1
            self.engines.append(_SimEngine(f"{r}-{i}", cost, self.loop, r, connector))
        self.pre = [e for e in self.engines if e.role == "prefill"]
        self.dec = [e for e in self.engines if e.role in ("decode", "both")]
        self.by_name = {e.name: e for e in self.engines}
        self.store = ChunkStore(kv_bytes)
        self.mix = mix
        self.policy = policy
        self.rr = 0
        self.inflight = 0
        self.max_inflight = 0
        self.done: list[_Req] = []
        self.last_t = 0.0
        self.decisions: dict = {}
        kvb = cost.kv_bytes_per_token
        c = LMCACHE_CHUNK_TOKENS
        for ci, (_, wl) in enumerate(mix.classes):   # warm-up: every class's shared prefix is stored, and (like
            #                                           the warm-up requests did) in every engine's prefix cache
            if connector:
                self.store.store((("p", ci, j), c, c * kvb) for j in range(wl.prefix_len // c))
            if self.p.prefix_cache:
                for e in self.engines:
                    e.apc.warm([("p", ci, b) for b in range(wl.prefix_len // self.block)])

    @staticmethod
    def shape(wl: "Workload") -> list:
        c = LMCACHE_CHUNK_TOKENS
        return [min(c, wl.input_len - j * c) for j in range(math.ceil(wl.input_len / c))]

    def keys(self, idx: int, ci: int, wl: "Workload") -> list:
        prefix_chunks = wl.prefix_len // LMCACHE_CHUNK_TOKENS
        return [("p", ci, j) if j < prefix_chunks else ("r", idx, j)
                for j in range(math.ceil(wl.input_len / LMCACHE_CHUNK_TOKENS))]

    def blocks(self, req: "_Req") -> list:
        """The prompt's full KV blocks (vLLM's prefix cache caches whole blocks only)."""
        b, wl = self.block, req.wl
        shared = wl.prefix_len // b
        return [("p", req.ci, j) if j < shared else ("r", req.idx, j) for j in range(wl.input_len // b)]

    # ---- proxy ---------------------------------------------------------------------------------
    def arrive(self, t: float, req: _Req) -> None:
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        name = self.policy.name
        if name == "adaptive":
            self._adaptive(t, req)
            return
        n = req.wl.input_len
        if name == "pdctl":
            cached = min(self.store.peek(req.keys), n - 1)
            if not self.pre or n < LMCACHE_CHUNK_TOKENS or n - cached <= self.policy.skip_uncached_max:
                req.skipped_p = True
                self._count(AGGREGATE, R_STATIC)
                self.send_d(t, req)
                return
            eng = min(self.pre, key=lambda e: e.outstanding)
        else:
            eng = self.pre[self.rr % len(self.pre)]
        self._count(SPLIT, R_STATIC)
        self.send_p(t, req, eng)

    def _count(self, kind: str, reason: str) -> None:
        k = f"{kind}:{reason}"
        self.decisions[k] = self.decisions.get(k, 0) + 1

    def _adaptive(self, t: float, req: _Req) -> None:
        n = req.wl.input_len
        cached = min(self.store.peek(req.keys), n - 1)
        loads = [WorkerLoad(e.name, e.role, True, e.outstanding, e.backlog, e.core.num_running,
                            e.core.num_waiting, e.core.kv_usage()) for e in self.engines]
        self.rr += 1
        d = decide(n, cached, loads, self.policy.thresholds, self.rr)
        self._count(d.kind, d.reason)
        req.uncached = d.uncached
        if d.kind == AGGREGATE:
            req.skipped_p = True
            self.send_d(t, req, self.by_name[d.decode])
        else:
            req.decode_to = self.by_name[d.decode]
            self.send_p(t, req, self.by_name[d.prefill])

    def send_p(self, t: float, req: _Req, eng: _SimEngine) -> None:
        eng.outstanding += 1
        self.hold_backlog(req, eng)
        self.loop.at(t + self.p.http_hop_s, self.lookup, req, eng, 1)

    def send_d(self, t: float, req: _Req, eng: Optional[_SimEngine] = None) -> None:
        if eng is None:
            eng = req.decode_to
        if eng is None:
            if self.policy.name == "pdctl":
                eng = min(self.dec, key=lambda e: e.outstanding)
            else:
                eng = self.dec[self.rr % len(self.dec)]
                self.rr += 1
        eng.outstanding += 1
        if req.skipped_p:
            self.hold_backlog(req, eng)
        self.loop.at(t + self.p.http_hop_s, self.lookup, req, eng, req.wl.output_len)

    @staticmethod
    def hold_backlog(req: _Req, eng: _SimEngine) -> None:
        """The request's uncached tokens count in ``eng``'s prefill backlog until its prefill is done."""
        req.backlog_eng = eng
        eng.backlog += req.uncached

    @staticmethod
    def release_backlog(req: _Req) -> None:
        if req.backlog_eng is not None:
            req.backlog_eng.backlog -= req.uncached
            req.backlog_eng = None

    # ---- engines -------------------------------------------------------------------------------
    def lookup(self, t: float, req: _Req, eng: _SimEngine, max_tokens: int) -> None:
        n = req.wl.input_len
        hit = self.store.lookup(req.keys, req.chunk_tokens) if self.connector else 0
        local, last = 0, None
        if self.p.prefix_cache:
            keys = self.blocks(req)
            local, last = eng.apc.hit(keys, [self.block] * len(keys))
        adm = kvpath.admit(self.cost, t, n, hit, local, eng.link_in, self.connector)
        p_leg = req.leg == 0 and not req.skipped_p
        req.leg += 1
        seq = Seq(rid=str(req.idx), prompt_len=n, max_tokens=max_tokens, hit=adm.skip, local=adm.local,
                  payload=_PLeg(self, req, eng) if p_leg else _DLeg(self, req, eng))
        if adm.local:
            seq.share_key, seq.share_tokens = last, adm.local
        self.loop.at(adm.ready_at, self._add, eng, seq, adm.defer)

    def _add(self, t: float, eng: _SimEngine, seq: Seq, defer: bool = False) -> None:
        eng.core.add(seq, defer)
        eng.kick(t)

    def stored(self, t: float, req: _Req) -> None:
        kvb = self.cost.kv_bytes_per_token
        self.store.store((k, n, n * kvb) for k, n in zip(req.keys, req.chunk_tokens))

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
        s.release_backlog(self.req)
        if not s.connector:           # nothing is stored: the decode leg recomputes what its cache lacks
            s.loop.at(t + s.p.http_hop_s, s.send_d, self.req)
            return
        stored_at, notified = kvpath.store(s.cost, t, seq.prompt_len - seq.hit, self.eng.link_out)
        s.loop.at(stored_at, s.stored, self.req)
        s.loop.at(max(t + s.p.http_hop_s, notified), s.send_d, self.req)

    def on_reject(self, t: float, seq: Seq) -> None:
        self.eng.outstanding -= 1
        self.s.release_backlog(self.req)
        self.req.failed = True
        self.s.finish(t, self.req)


class _DLeg(_PLeg):
    def on_first(self, t: float, seq: Seq) -> None:
        s = self.s
        self.req.ttft = t + s.p.http_hop_s - self.req.arrival
        s.release_backlog(self.req)
        if s.connector and self.eng.role in ("both", "prefill") and seq.preemptions == 0:   # kv_both stores
            stored_at, _ = kvpath.store(s.cost, t, seq.prompt_len - seq.hit, self.eng.link_out)
            s.loop.at(stored_at, s.stored, self.req)

    def on_finish(self, t: float, seq: Seq) -> None:
        self.eng.outstanding -= 1
        t_out = t + self.s.p.http_hop_s
        self.req.e2e = t_out - self.req.arrival
        self.s.finish(t_out, self.req)


def _summary(stack: _Stack, rate: float, num_prompts: int, duration: float, hit0: tuple) -> dict:
    ok = [r for r in stack.done if not r.failed and r.ttft is not None]
    failed = num_prompts - len(ok)
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
        "completed": len(ok),
        "failed": failed,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "sustained_throughput": sustained,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "max_concurrent_requests": stack.max_inflight,
        "kv_hit_rate": hit_tok / req_tok if req_tok else 0.0,
        "p_leg_skipped": sum(1 for r in ok if r.skipped_p),
        "preemptions": sum(e.core.counters.preemptions for e in stack.engines),
        "decisions": dict(sorted(stack.decisions.items())),
        "engine_busy": {e.name: round(b, 3) for e, b in zip(stack.engines, busy)},
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


def simulate_rate(cost: CostModel, roles: Sequence[str], workload, rate: float, num_prompts: int,
                  policy: PolicyConfig, seed: int, kv_bytes: int, connector: bool = True) -> dict:
    mix = Mix.of(workload)
    stack = _Stack(cost, roles, mix, policy, kv_bytes, connector)
    rng = random.Random(seed)
    pick = random.Random(seed * 7919 + 1)    # the class draw never shifts the arrival times
    shapes = [stack.shape(wl) for _, wl in mix.classes]
    t = 0.0
    for i in range(num_prompts):
        ci = mix.pick(pick)
        wl = mix.classes[ci][1]
        req = _Req(idx=i, arrival=t, keys=stack.keys(i, ci, wl), chunk_tokens=shapes[ci], wl=wl, ci=ci)
        stack.loop.at(t, stack.arrive, req)
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    c = stack.store.c
    hit0 = (c.lookup_requested_tokens, c.lookup_hit_tokens)
    stack.loop.run()
    return _summary(stack, rate, num_prompts, stack.last_t, hit0)


def roles_for(prefill: int, decode: int, both: int = 0, policy: str = "round-robin") -> tuple:
    """Engine roles in plan order. The old ``pdctl`` 0P form (no prefillers) means engines doing both."""
    if policy == "pdctl" and prefill == 0 and both == 0:
        decode, both = 0, decode
    return ("prefill",) * prefill + ("decode",) * decode + ("both",) * both


def simulate(hardware: object = "a100-80gb", model: object = "deepseek-v2-lite", prefill: int = 1,
             decode: int = 2, workload=Workload(), rates: Sequence[float] = (1, 2, 5, 10),
             num_prompts: int = 600, policy: str = "round-robin", seed: int = 2003,
             params: Optional[CostParams] = None, engine: Optional[EngineConfig] = None,
             kv_size_gb: float = 80.0, skip_uncached_max: int = 512, both: int = 0,
             thresholds: Thresholds = Thresholds(), connector: bool = True) -> list[dict]:
    """One summary dict per rate (``vllm bench serve`` key names + ``kv_hit_rate``); SimError on bad input.

    Engines: ``prefill`` dedicated prefillers (kv_producer), ``decode`` decoders (kv_consumer), ``both``
    engines that store and retrieve (kv_both). ``workload`` is a Workload or a Mix. ``connector`` False: engines
    without a KV connector (no KV server; a decode leg recomputes what its own prefix cache lacks)."""
    if policy not in POLICIES:
        raise SimError(f"--policy {policy!r}: use one of {', '.join(POLICIES)}")
    if min(prefill, decode, both) < 0:
        raise SimError(f"engine counts must be >= 0, got {prefill}P{decode}D{both}B")
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
    mix = Mix.of(workload)
    mix.check()
    hw, mp = _resolve(hardware, model)
    cost = CostModel(hw, mp, engine or EngineConfig(), params or CostParams())
    if cost.kv_capacity_tokens() <= 0:
        raise SimError(f"{mp.name} ({mp.weights_bytes / 2**30:.1f} GiB weights) does not fit on {hw.name} "
                       f"at gpu_memory_utilization {cost.cfg.gpu_memory_utilization}: raise tp or pick a "
                       "larger GPU")
    pol = PolicyConfig(policy, skip_uncached_max, thresholds)
    roles = roles_for(prefill, decode, both, policy)
    return [simulate_rate(cost, roles, mix, float(r), num_prompts, pol, seed + i, int(kv_size_gb * GB), connector)
            for i, r in enumerate(rates)]
