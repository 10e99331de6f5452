"""The per-request decision: aggregate a request on one worker, or split it (P leg here, D leg there).

One pure function, imported by the live proxy and by the twin's simulator, so ``pdctl plan --what-if``
predicts what the proxy does. No I/O, no clock, no randomness: the same loads give the same decision.

The rule, in plain words (defaults derived by ``benchmarks/decision_thresholds.py`` on the twin):
1. Count the prompt tokens the shared KV cache does not hold yet (``uncached``).
2. At most ``aggregate_max_uncached`` of them: **aggregate** on the least-loaded worker that can decode
   (its own prefill of the short rest costs less than a P leg, a KV store, a notification and a second
   lookup; with ~80 % of the prompt in the shared L1 this is the common case), or on the worker whose own GPU
   prefix cache is **warm** for this prompt (a conversation's next turn: the worker that served its last turn
   holds its history and last answer) while that worker holds at least ``warm_min_tokens`` more of the prompt
   than the least-loaded one and is at most ``warm_max_extra_load`` busier: elsewhere the history and the
   answer come back over the host link from the L1 (whole chunks; the partial one is computed again). A
   decode-only worker (kv_consumer) stores nothing, so it aggregates only prompts with at most
   ``consumer_max_uncached`` uncached tokens; longer ones go to a ``both`` worker, or are split so the prefix
   gets stored for the next request.
3. More: **split**. The P leg goes to a dedicated prefiller (role ``prefill``) with the smallest prefill
   backlog, or, when none has room, to a ``both`` worker that is decoding almost nothing (at most
   ``split_idle_max_running`` sequences, so no decode stream feels the long prefill). The D leg goes to
   the least-loaded other worker that can decode. A long prefill kept off the decoders is what keeps
   their TPOT flat (prefill/decode interference).
4. A split needs a prefiller with room: when every candidate's backlog plus this prompt exceeds
   ``split_max_prefill_backlog`` tokens and the chosen decoder has nothing waiting, aggregate instead
   (Dynamo's prefill-queue rule: a long queue in front of the prefiller costs more TTFT than the
   interference costs TPOT). When the decoder has requests waiting it is the bottleneck, and a long
   prefill there would stall every stream: split anyway, onto the shortest backlog.
5. Nothing can decode (every decoder open or gone) but a prefiller is up: aggregate on the prefiller.

Workers whose breaker does not allow traffic are never chosen; both legs of a split never go to the
same worker; ties go to the earlier worker in plan order, rotated by ``tiebreak``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..settings.schema import default as _d

AGGREGATE = "aggregate"
SPLIT = "split"

# reasons (label values of pdctl_proxy_decisions_total{kind,reason}; one owner: this module)
R_FEW_UNCACHED = "few_uncached"           # uncached <= aggregate_max_uncached (prefix in the L1 or short prompt)
R_CANNOT_STORE = "decoder_cannot_store"   # split: only kv_consumer decoders, the prompt is worth storing
R_LONG_UNCACHED = "long_uncached"         # split: uncached > aggregate_max_uncached, a prefiller has room
R_IDLE_BOTH = "long_uncached_idle_both"   # split onto a both-worker that decodes almost nothing
R_PREFILL_BUSY = "prefill_backlog"        # long uncached, but every prefiller's backlog is full: aggregate
R_NO_PREFILLER = "no_prefiller"           # long uncached, no worker can take a P leg: aggregate
R_NO_DECODER = "no_decoder"               # nothing can decode but a prefiller is up: aggregate there
R_WARM = "warm_prefix"                    # aggregated on a worker whose GPU prefix cache holds the prompt's
#                                           history (a conversation's next turn), least-loaded or not
R_STATIC = "static"                       # baseline policies (round-robin, pdctl): their fixed rule
R_ENGINE_STATE = "engine_state"           # the request needs state one engine holds (a Responses API
#                                           previous_response_id): whole on that engine, never split (proxy)
REASONS = (R_FEW_UNCACHED, R_WARM, R_CANNOT_STORE, R_LONG_UNCACHED, R_IDLE_BOTH, R_PREFILL_BUSY, R_NO_PREFILLER, R_NO_DECODER, R_STATIC,
           R_ENGINE_STATE)

DECODE_ROLES = ("decode", "both")
PREFILL_ROLES = ("prefill", "both")


@dataclass(frozen=True)
class Thresholds:
    """The adaptive policy's knobs (config keys ``[proxy] aggregate_max_uncached`` and friends; defaults from the
    config schema)."""
    aggregate_max_uncached: int = _d("proxy", "aggregate_max_uncached")  # tokens; benchmarks/decision_thresholds.py
    split_max_prefill_backlog: int = _d("proxy", "split_max_prefill_backlog")  # queued on the chosen prefiller
    split_idle_max_running: int = _d("proxy", "split_idle_max_running")  # a both-worker takes P legs only then
    consumer_max_uncached: int = _d("proxy", "consumer_max_uncached")    # a decode-only worker aggregates at most
    # a warm worker (its GPU prefix cache holds this prompt) is preferred while it holds at least this many more
    # of the prompt's tokens than the least-loaded one (two LMCache chunks: less saves nothing worth a queue; 0 =
    # off: load alone decides, as before) ...
    warm_min_tokens: int = _d("proxy", "warm_min_tokens")
    # ... and its load (WorkerLoad.load) is at most this much above the least-loaded one's: a warm worker that is
    # the bottleneck gives the turn away, at the cost of an L1 load and the last answer computed again. 16 from
    # the twin (benchmarks/chat_sessions_twin.py --sweep-warm, 3x A100 and 2x H200): 4 moved a third of the turns
    # (1.27-1.35 prompt tokens computed per new one), 16 keeps ~1.13 with the lowest TTFT p95 at the ceiling; 64
    # leaves the load uneven enough that admission refuses more; goodput is the same from 4 to 64
    warm_max_extra_load: float = _d("proxy", "warm_max_extra_load")


@dataclass(frozen=True)
class WorkerLoad:
    """What the caller knows of one worker now (proxy: its counts + the last scrape; twin: exact state)."""
    name: str
    role: str                    # "prefill" | "decode" | "both"
    available: bool = True       # its breaker allows a request now
    inflight: int = 0            # legs the proxy has open on it
    prefill_backlog: int = 0     # uncached prompt tokens sent to it whose first token has not come back yet
    running: float = 0.0         # engine: sequences running (scraped)
    waiting: float = 0.0         # engine: sequences waiting
    kv_usage: float = 0.0        # engine: KV cache use 0..1
    warm: int = 0                # tokens of this prompt its own GPU prefix cache likely holds (the caller's guess
    #                              from what it served lately; 0 = unknown)

    def load(self) -> float:
        """Decode load score: open legs plus the engine's queue, KV pressure weighted in."""
        return self.inflight + self.running + 2.0 * self.waiting + 8.0 * self.kv_usage


@dataclass(frozen=True)
class Decision:
    kind: str                    # AGGREGATE | SPLIT
    reason: str
    decode: str                  # the worker serving the whole request (aggregate) or the D leg (split)
    prefill: Optional[str] = None   # the P-leg worker (split only)
    uncached: int = 0


def _least(ws: list, key, tiebreak: int):
    best = min(key(w) for w in ws)
    ties = [w for w in ws if key(w) == best]
    return ties[tiebreak % len(ties)]


def decide(prompt_tokens: int, cached_tokens: int, workers: Sequence[WorkerLoad], th: Thresholds = Thresholds(),
           tiebreak: int = 0) -> Optional[Decision]:
    """The decision for one request, or None when no worker is available at all."""
    uncached = max(0, int(prompt_tokens) - max(0, int(cached_tokens)))
    up = [w for w in workers if w.available]
    decoders = [w for w in up if w.role in DECODE_ROLES]
    if not decoders:
        pre = [w for w in up if w.role == "prefill"]
        if not pre:
            return None
        w = _least(pre, WorkerLoad.load, tiebreak)
        return Decision(AGGREGATE, R_NO_DECODER, w.name, None, uncached)
    long_reason = R_LONG_UNCACHED
    if uncached <= th.aggregate_max_uncached:
        pool = decoders if uncached <= th.consumer_max_uncached else [w for w in decoders if w.role == "both"]
        if pool:
            w = _least(pool, WorkerLoad.load, tiebreak)
            hot = max(pool, key=lambda x: x.warm)       # the first of the warmest, in plan order
            on = th.warm_min_tokens > 0                 # 0: the operator turned warmth off, load alone decides
            if on and hot.warm - w.warm >= th.warm_min_tokens and hot.load() <= w.load() + th.warm_max_extra_load:
                w = hot
            # counted warm when the chosen worker holds the prompt's history (warm_min_tokens more than the
            # coldest candidate: the shared system prompt is warm everywhere), whether or not it was the least loaded
            warm = on and w.warm - min(x.warm for x in pool) >= th.warm_min_tokens
            return Decision(AGGREGATE, R_WARM if warm else R_FEW_UNCACHED, w.name, None, uncached)
        long_reason = R_CANNOT_STORE
    d = _least(decoders, WorkerLoad.load, tiebreak)
    dedicated = [w for w in up if w.role == "prefill"]
    idle_both = [w for w in up if w.role == "both" and w.name != d.name and w.running <= th.split_idle_max_running]
    for pool, reason in ((dedicated, long_reason), (idle_both, R_IDLE_BOTH)):
        room = [w for w in pool if w.prefill_backlog + uncached <= th.split_max_prefill_backlog]
        if room or (pool and d.waiting > 0):
            p = _least(room or pool, lambda w: (w.prefill_backlog, w.inflight), tiebreak)
            return Decision(SPLIT, reason, d.name, p.name, uncached)
    reason = R_PREFILL_BUSY if dedicated or idle_both else R_NO_PREFILLER
    return Decision(AGGREGATE, reason, d.name, None, uncached)
