"""One simulated run of a PD stack: the event loop, the engines, the KV store and the proxy's policy.

``SimStack`` holds what one rate of ``simulator.simulate`` runs on: engines (``core.EngineCore`` each, with
their host links and prefix cache), the KV server's chunk store, and the proxy choosing legs by policy
(round-robin, pdctl, adaptive: see simulator.py). Requests move through it as events at model times
(``EventLoop``); the prefill and decode legs (``PrefillLeg``, ``DecodeLeg``) are the engines' payloads and
carry each request from leg to leg. simulator.py draws the arrivals and summarises the finished requests.

With ``adaptive`` and an admission policy (``appliance.policy.admit``, the proxy's own rule) a request is started, held
in the proxy's queue or refused at arrival, exactly as the live proxy does it: the same ``judge``, the same
learners fed with model time (each engine's TTFT and TPOT lines start from the cost model's prior,
``prior.prior_for``), the same queue order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

from appliance.constants import LMCACHE_CHUNK_TOKENS

from ..policy import admit as A
from ..policy.sharing import WaitQueue
from ..policy.decide import AGGREGATE, R_STATIC, SPLIT, Thresholds, WorkerLoad, decide
from . import kvpath
from .core import Seq
from .costmodel import CostModel
from .kvstore import ChunkStore
from .prior import prior_for
from .simengine import EventLoop, SimEngine
from .peer_router import cache_aware
from .workloads import Mix, Workload


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "round-robin"           # round-robin | pdctl | adaptive | cache-aware (simulator.py)
    skip_uncached_max: int = 512
    thresholds: Thresholds = Thresholds()
    admission: Optional[A.Policy] = None     # adaptive only: the proxy's admission (None or mode off: none)


@dataclass
class SimRequest:
    idx: int
    arrival: float
    keys: list
    chunk_tokens: list
    wl: Workload = None  # type: ignore[assignment]
    ci: int = 0                       # request class (its shared prefix)
    uncached: int = 0                 # adaptive: the decision's uncached-token estimate
    decode_to: Optional[SimEngine] = None   # adaptive split: the D leg's engine, chosen at arrival
    backlog_eng: Optional[SimEngine] = None
    leg: int = 0
    ttft: Optional[float] = None
    e2e: Optional[float] = None
    failed: bool = False
    skipped_p: bool = False
    ask: Optional[A.Ask] = None       # admission: the request as admission sees it
    refused: str = ""                 # admission: the refusal's reason ("" = not refused)
    start: float = 0.0                # when it left the proxy for an engine (after any queue wait)
    ahead: float = 0.0                # backlog met + its own uncached tokens (TTFT observation's x)
    ttft_eng: Optional[SimEngine] = None    # the engine whose prefill made its first token
    streams0: int = 0                 # streams on its decoding engine when its first token came
    sid: int = -1                     # the conversation this turn belongs to (-1: a single-turn request)
    turn: int = 0                     # its 1-based turn index there
    kv_gpu: int = 0                   # prompt tokens its first leg found in that engine's own prefix cache
    kv_l1: int = 0                    # prompt tokens its first leg loaded from the KV server
    computed: int = 0                 # prompt tokens computed, over every leg


class SimStack:
    """One run: engines, KV store, proxy policy and result collection."""

    def __init__(self, cost: CostModel, roles: Sequence[str], mix: Mix, policy: PolicyConfig, kv_bytes: int,
                 connector: bool = True):
        self.cost = cost
        self.connector = connector
        self.block = cost.cfg.block_size
        self.p = cost.params
        self.loop = EventLoop()
        counters: dict = {}
        self.engines = []
        for r in roles:
            i = counters.get(r, 0)
            counters[r] = i + 1
            self.engines.append(SimEngine(f"{r}-{i}", cost, self.loop, r, connector))
        self.pre = [e for e in self.engines if e.role == "prefill"]
        self.dec = [e for e in self.engines if e.role in ("decode", "both")]
        self.by_name = {e.name: e for e in self.engines}
        self.store = ChunkStore(kv_bytes)
        self.mix = mix
        self.policy = policy
        self.rr = 0
        self.inflight = 0
        self.max_inflight = 0
        self.done: list[SimRequest] = []
        self.last_t = 0.0
        self.on_done: Optional[Callable] = None     # called with (t, request) when a request ends (sessions.py)
        self.decisions: dict = {}
        adm = policy.admission
        self.adm = adm if adm is not None and adm.mode != "off" and policy.name == "adaptive" else None
        self.queue = WaitQueue()
        self.drain = A.DrainMeter()
        self.admissions: dict = {}
        self.max_queue = 0
        if self.adm is not None:
            prior = prior_for(cost, mix)
            for e in self.engines:
                e.rates = A.WorkerRates(prior)
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
    def shape(wl: Workload) -> list:
        c = LMCACHE_CHUNK_TOKENS
        return [min(c, wl.input_len - j * c) for j in range(math.ceil(wl.input_len / c))]

    def keys(self, idx: int, ci: int, wl: Workload) -> list:
        prefix_chunks = wl.prefix_len // LMCACHE_CHUNK_TOKENS
        return [("p", ci, j) if j < prefix_chunks else ("r", idx, j)
                for j in range(math.ceil(wl.input_len / LMCACHE_CHUNK_TOKENS))]

    @staticmethod
    def session_keys(idx: int, sid: int, wl: Workload) -> list:
        """A conversation's turn: its whole chunks beyond the system prompt are the conversation's own (the next
        turn repeats them), the trailing partial chunk only this prompt's (LMCache never matches it again)."""
        c = LMCACHE_CHUNK_TOKENS
        shared, whole = wl.prefix_len // c, wl.input_len // c
        return [("p", 0, j) if j < shared else ("s", sid, j) if j < whole else ("r", idx, j)
                for j in range(math.ceil(wl.input_len / c))]

    def blocks(self, req: "SimRequest", upto: int = 0) -> list:
        """The prompt's full KV blocks (vLLM's prefix cache caches whole blocks only); with ``upto`` the full
        blocks of the first ``upto`` tokens (a conversation's prompt and answer)."""
        b, wl = self.block, req.wl
        shared = wl.prefix_len // b
        own = ("sb", req.sid) if req.sid >= 0 else ("r", req.idx)
        return [("p", req.ci, j) if j < shared else (*own, j) for j in range((upto or wl.input_len) // b)]

    def warmth(self, req: "SimRequest") -> dict:
        """{engine name: leading prompt tokens its own prefix cache holds}, for a conversation's turn (what the
        proxy's ``WarmIndex`` guesses from the prompts it routed); empty for single requests, whose only warm part
        is the system prompt, warm everywhere."""
        if req.sid < 0 or not self.p.prefix_cache:
            return {}
        keys = self.blocks(req)
        sizes = [self.block] * len(keys)
        return {e.name: e.apc.peek(keys, sizes) for e in self.engines}

    # ---- proxy ---------------------------------------------------------------------------------
    def arrive(self, t: float, req: SimRequest) -> None:
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        name = self.policy.name
        if name == "adaptive":
            self._adaptive(t, req)
            return
        if name == "cache-aware":
            req.skipped_p = True
            self._count(AGGREGATE, R_STATIC)
            self.send_d(t, req, cache_aware(self, req))
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

    def _decide(self, req: SimRequest):
        n = req.wl.input_len
        cached = min(self.store.peek(req.keys), n - 1)
        warm = self.warmth(req)
        loads = [WorkerLoad(e.name, e.role, True, e.outstanding, e.backlog, e.core.num_running,
                            e.core.num_waiting, e.core.kv_usage(), warm.get(e.name, 0)) for e in self.engines]
        self.rr += 1
        return decide(n, cached, loads, self.policy.thresholds, self.rr)

    def _adaptive(self, t: float, req: SimRequest) -> None:
        d = self._decide(req)
        if self.adm is None:
            self._dispatch(t, req, d)
            return
        req.ask = A.Ask(t, t + self.adm.ttft_slo_s, d.uncached)
        q = A.QueueView(self.queue.rank(req.ask), len(self.queue), self.drain.rate(t))
        v = self._judge(t, req, d, q)
        self._admitted(v)
        if v.action == A.ADMIT:
            self._dispatch(t, req, d)
        elif v.action == A.REFUSE:
            self._refuse(t, req, v.reason)
        else:
            self.queue.push(req.ask, req)
            self.max_queue = max(self.max_queue, len(self.queue))
            goal = req.ask.arrival + self.adm.target * (req.ask.deadline - req.ask.arrival)
            self.loop.at(goal, self._pump)      # by then it has started or it leaves refused

    def _judge(self, t: float, req: SimRequest, d, q: "A.QueueView") -> "A.Verdict":
        ask = replace(req.ask, uncached=d.uncached)
        dec = self.by_name[d.decode]
        pre = self.by_name[d.prefill] if d.prefill else None
        cap = self.cost.cfg.max_num_seqs
        view = lambda e: A.Worker(e.name, e.outstanding, e.backlog, e.rates.rates(), cap)   # noqa: E731
        return A.judge(t, ask, view(pre) if pre else None, view(dec), q, self.adm)

    def _admitted(self, v: "A.Verdict") -> None:
        k = f"{v.action}:{v.reason}"
        self.admissions[k] = self.admissions.get(k, 0) + 1

    def _pump(self, t: float) -> None:
        """Start (or refuse) waiting requests from the head while the workers have room: called whenever a worker
        frees room (a first token, a finished leg) and at a waiting request's goal."""
        if self.adm is None:
            return
        while self.queue:
            _, req = self.queue.head()
            d = self._decide(req)
            v = self._judge(t, req, d, A.QueueView(0, len(self.queue), self.drain.rate(t), arriving=False))
            if v.action == A.QUEUE:
                return
            self.queue.pop()
            self._admitted(v)
            if v.action == A.ADMIT:
                self.drain.started(t)
                self._dispatch(t, req, d)
            else:
                self._refuse(t, req, v.reason)

    def _refuse(self, t: float, req: SimRequest, reason: str) -> None:
        req.refused = reason
        self.finish(t, req)

    def _dispatch(self, t: float, req: SimRequest, d) -> None:
        self._count(d.kind, d.reason)
        req.uncached = d.uncached
        req.start = t
        eng = self.by_name[d.prefill or d.decode]
        req.ttft_eng = eng
        req.ahead = eng.backlog + d.uncached
        if d.kind == AGGREGATE:
            req.skipped_p = True
            self.send_d(t, req, self.by_name[d.decode])
        else:
            req.decode_to = self.by_name[d.decode]
            self.send_p(t, req, self.by_name[d.prefill])

    def send_p(self, t: float, req: SimRequest, eng: SimEngine) -> None:
        eng.outstanding += 1
        self.hold_backlog(req, eng)
        self.loop.at(t + self.p.http_hop_s, self.lookup, req, eng, 1)

    def send_d(self, t: float, req: SimRequest, eng: Optional[SimEngine] = None) -> None:
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
    def hold_backlog(req: SimRequest, eng: SimEngine) -> None:
        """The request's uncached tokens count in ``eng``'s prefill backlog until its prefill is done."""
        req.backlog_eng = eng
        eng.backlog += req.uncached

    @staticmethod
    def release_backlog(req: SimRequest) -> None:
        if req.backlog_eng is not None:
            req.backlog_eng.backlog -= req.uncached
            req.backlog_eng = None

    # ---- engines -------------------------------------------------------------------------------
    def lookup(self, t: float, req: SimRequest, eng: SimEngine, max_tokens: int) -> None:
        n = req.wl.input_len
        hit = self.store.lookup(req.keys, req.chunk_tokens) if self.connector else 0
        local, last, pinned = 0, None, 0
        if self.p.prefix_cache:
            keys = self.blocks(req)
            system = req.wl.prefix_len // self.block
            eng.apc.fit(eng.cache_room(system))
            local, last = eng.apc.hit(keys, [self.block] * len(keys))
            pinned = len(keys) - system
            if req.sid >= 0 and local:    # running turns share the system prompt's blocks, not their histories
                last, local_shared = ("p", req.ci, system - 1), min(local, system * self.block)
        adm = kvpath.admit(self.cost, t, n, hit, local, eng.link_in, self.connector)
        if req.leg == 0:
            req.kv_gpu, req.kv_l1 = adm.local, adm.loaded
        req.computed += n - adm.skip
        p_leg = req.leg == 0 and not req.skipped_p
        req.leg += 1
        seq = Seq(rid=str(req.idx), prompt_len=n, max_tokens=max_tokens, hit=adm.skip, local=adm.local,
                  payload=PrefillLeg(self, req, eng, pinned) if p_leg else DecodeLeg(self, req, eng, pinned))
        eng.pinned += pinned
        if adm.local:
            seq.share_key = last
            seq.share_tokens = local_shared if req.sid >= 0 else adm.local
        self.loop.at(adm.ready_at, self._add, eng, seq, adm.defer)

    def _add(self, t: float, eng: SimEngine, seq: Seq, defer: bool = False) -> None:
        eng.core.add(seq, defer)
        eng.kick(t)

    def stored(self, t: float, req: SimRequest) -> None:
        self.store_keys(t, zip(req.keys, req.chunk_tokens))

    def store_keys(self, t: float, items) -> None:
        kvb = self.cost.kv_bytes_per_token
        self.store.store((k, n, n * kvb) for k, n in items)

    def answered(self, t: float, req: SimRequest, eng: SimEngine) -> None:
        """A conversation's turn ended on ``eng``: vLLM's prefix cache keeps the answer's full blocks, and a
        storing worker whose connector stores generated tokens (``stores_answers``) copies the chunks the answer
        completed to the KV server."""
        if req.sid < 0:
            return
        end = req.wl.input_len + req.wl.output_len
        if self.p.prefix_cache:
            eng.apc.warm(self.blocks(req, end))
        c = LMCACHE_CHUNK_TOKENS
        first, last = req.wl.input_len // c, end // c
        if self.connector and self.p.stores_answers and eng.role in ("both", "prefill") and last > first:
            stored_at, _ = kvpath.store(self.cost, t, (last - first) * c, eng.link_out)
            self.loop.at(stored_at, self.store_keys, [(("s", req.sid, j), c) for j in range(first, last)])

    def finish(self, t: float, req: SimRequest) -> None:
        self.inflight -= 1
        self.last_t = max(self.last_t, t)
        self.done.append(req)
        if self.on_done is not None:
            self.on_done(t, req)


class PrefillLeg:
    __slots__ = ("s", "req", "eng", "pinned")

    def __init__(self, s: SimStack, req: SimRequest, eng: SimEngine, pinned: int = 0):
        self.s, self.req, self.eng, self.pinned = s, req, eng, pinned

    def on_first(self, t: float, seq: Seq) -> None:
        pass

    def on_finish(self, t: float, seq: Seq) -> None:
        s = self.s
        self.eng.outstanding -= 1
        self.eng.pinned -= self.pinned
        s.release_backlog(self.req)
        s._pump(t)
        if not s.connector:           # nothing is stored: the decode leg recomputes what its cache lacks
            s.loop.at(t + s.p.http_hop_s, s.send_d, self.req)
            return
        stored_at, notified = kvpath.store(s.cost, t, seq.prompt_len - seq.hit, self.eng.link_out)
        s.loop.at(stored_at, s.stored, self.req)
        s.loop.at(max(t + s.p.http_hop_s, notified), s.send_d, self.req)

    def on_reject(self, t: float, seq: Seq) -> None:
        self.eng.outstanding -= 1
        self.eng.pinned -= self.pinned
        self.s.release_backlog(self.req)
        self.req.failed = True
        self.s.finish(t, self.req)


class DecodeLeg(PrefillLeg):
    __slots__ = ("stored_at",)

    def __init__(self, s: SimStack, req: SimRequest, eng: SimEngine, pinned: int = 0):
        super().__init__(s, req, eng, pinned)
        self.stored_at = 0.0

    def _release(self, t: float, held: int) -> None:
        self.eng.core.release_held(held)
        self.eng.kick(t)

    def on_first(self, t: float, seq: Seq) -> None:
        s = self.s
        req = self.req
        req.ttft = t + s.p.http_hop_s - req.arrival
        s.release_backlog(req)
        if s.adm is not None:
            req.ttft_eng.rates.saw_first_token(req.ahead, t + s.p.http_hop_s - req.start)
            req.streams0 = self.eng.outstanding
            s._pump(t)
        if s.connector and self.eng.role in ("both", "prefill") and seq.preemptions == 0:   # kv_both stores
            stored_at, _ = kvpath.store(s.cost, t, seq.prompt_len - seq.hit, self.eng.link_out)
            s.loop.at(stored_at, s.stored, self.req)
        n = kvpath.consumer_store_tokens(s.cost, self.eng.role, seq.prompt_len) if s.connector else 0
        if n and seq.preemptions == 0:        # a consumer that stores: the chunks are there already, only the
            self.stored_at, _ = kvpath.store(s.cost, t, n, self.eng.link_out)   # link time and the held blocks

    def on_finish(self, t: float, seq: Seq) -> None:
        s, req = self.s, self.req
        if self.stored_at > t:                # vLLM frees the blocks once the connector's store is done
            core, held = self.eng.core, seq.prompt_len + seq.gen
            core.hold(held)
            s.loop.at(self.stored_at, self._release, held)
        if s.adm is not None and req.wl.output_len > 1 and req.ttft is not None:
            tpot = (t - (req.arrival + req.ttft - s.p.http_hop_s)) / (req.wl.output_len - 1)
            self.eng.rates.saw_stream((req.streams0 + self.eng.outstanding) / 2, tpot)
        self.eng.outstanding -= 1
        self.eng.pinned -= self.pinned
        s.answered(t, req, self.eng)
        t_out = t + s.p.http_hop_s
        req.e2e = t_out - req.arrival
        s.finish(t_out, req)
        s._pump(t)
