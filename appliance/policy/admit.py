"""Admission by the SLO: start a request now, hold it in the proxy's bounded queue, or refuse it at once.

One pure rule, beside ``decide.py`` and imported by the live proxy and by the twin's simulator, so what-if
predicts what the proxy admits. ``judge`` has no I/O, no clock and no randomness; the learners below it keep
state but take the time as an argument, so the proxy feeds them wall time and the simulator model time.

The rule, in plain words (defaults derived on the twin by ``benchmarks/overload.py``):
1. The request has a deadline: its arrival plus the TTFT SLO (or its own shorter budget), and aims at
   ``target`` of it, keeping the rest as a margin for prediction error.
2. The worker ``decide()`` chose would give it a TTFT of ``a + s * (backlog + uncached)``: the prefill
   tokens queued there before it plus its own, at the rate that worker showed lately (``LinearFit``, learnt
   from each request's TTFT against the backlog it met; the twin's cost model is only the prior).
3. One more stream on the decoding worker would give every stream there a TPOT of ``b + k * (streams + 1)``,
   learnt the same way from each finished stream's TPOT against the streams that ran beside it.
4. **Start now** when the TTFT, counting what it already waited, stays within the target, one more stream
   keeps the TPOT within ``target`` of its SLO, and nobody with an earlier claim is waiting (the fairer share,
   then priority class, then deadline: ``sharing.WaitQueue``). An idle worker always takes the head of the queue (a
   wrong model never starves a box).
5. Otherwise **wait** in the proxy's queue (it can still go to whichever worker frees first) while its
   predicted wait (the requests ahead of it over the rate the queue drained at lately) still leaves time
   for its own TTFT before the deadline; else **refuse now** (503 and ``Retry-After``: the time the queue
   ahead needs to drain down to what a new request can wait), before any engine sees it.
6. A waiting request whose deadline can no longer be met even on an idle worker, or that waited until its goal
   (arrival + target x budget), leaves the queue refused; an idle worker takes the head only before that.
   A stream already started is never stopped by admission.

``mode = "queue"`` keeps the bounded queue without predictions: a worker takes at most ``max_streams``
streams, a request waits at most ``max_queue_wait_s``. ``mode = "off"``: everything starts at once
(the behaviour before admission: the engines' own unbounded queues).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Optional

from ..settings.schema import default as _d

ADMIT, QUEUE, REFUSE = "admit", "queue", "refuse"

# reasons (label values of pdctl_proxy_admission_total{outcome,reason,priority}; one owner: this module)
R_OFF = "off"                   # admitted: admission is off
R_ROOM = "room"                 # admitted: predicted TTFT and TPOT within the target
R_IDLE = "idle_worker"          # admitted: the worker has nothing running and nothing queued
R_TTFT = "ttft"                 # queued: the worker's prefill backlog would push the TTFT past the target
R_TPOT = "tpot"                 # queued: one more stream would push its worker's TPOT past the target
R_STREAMS = "streams"           # queued (mode queue): the worker holds max_streams streams
R_BEHIND = "behind"             # queued: requests with an earlier claim are waiting
R_QUEUE_FULL = "queue_full"     # refused: the queue holds max_queue requests (or only better ones)
R_DEADLINE = "deadline"         # refused at arrival: the predicted wait leaves no time for its TTFT
R_EXPIRED = "expired"           # refused from the queue: its deadline can no longer be met
R_GONE = "client_gone"          # left the queue: the client disconnected (no refusal is sent)
R_SHARE = "share"               # queued: its key holds its share of a full box, and the rest is held for other keys
REASONS = (R_OFF, R_ROOM, R_IDLE, R_TTFT, R_TPOT, R_STREAMS, R_BEHIND, R_QUEUE_FULL, R_DEADLINE, R_EXPIRED, R_GONE)
MODES = ("slo", "queue", "off")
STATUSES = (503, 429, 529)
OVERLOADED_CODE = "server_overloaded"     # the OpenAI-shaped error's code on a refusal


@dataclass(frozen=True)
class Policy:
    """The ``[admission]`` settings plus the SLOs they admit by (from ``[workload]``)."""
    mode: str = _d("admission", "mode")
    ttft_slo_s: float = _d("workload", "ttft_slo_s")
    tpot_slo_s: float = _d("workload", "tpot_slo_ms") / 1000.0
    target: float = _d("admission", "target")              # share of the TTFT SLO a prediction may use
    tpot_target: float = _d("admission", "tpot_target")    # share of the TPOT SLO one more stream may bring
    max_queue: int = _d("admission", "max_queue")           # requests waiting in the proxy at most
    max_queue_wait_s: float = _d("admission", "max_queue_wait_s")   # mode queue: longest wait (0 = ttft_slo_s)
    max_streams: int = _d("admission", "max_streams")       # mode queue: streams per worker at most
    retry_after_max_s: int = _d("admission", "retry_after_max_s")
    status: int = _d("admission", "status")                 # HTTP status of a refusal (503, 429 or 529)

    def wait_bound_s(self) -> float:
        return self.max_queue_wait_s or self.ttft_slo_s


@dataclass(frozen=True)
class Rates:
    """One worker's learnt service: TTFT = ttft_a + ttft_s * tokens ahead and its own; TPOT = tpot_b + tpot_k *
    streams."""
    ttft_a: float
    ttft_s: float
    tpot_b: float
    tpot_k: float
    tpot_sd: float = 0.0      # spread of observed TPOTs around the line (a margin: steady decoders need little)
    ttft_sd: float = 0.0      # spread of observed TTFTs around the line

    def ttft(self, tokens: float) -> float:
        return self.ttft_a + self.ttft_s * max(0.0, tokens)

    def tpot(self, streams: float) -> float:
        return self.tpot_b + self.tpot_k * max(0.0, streams)


@dataclass(frozen=True)
class Worker:
    """What admission needs of one chosen worker now."""
    name: str
    streams: int          # requests it is serving (whole or a D leg), counted by the proxy
    backlog: int          # uncached prompt tokens sent to it whose first token has not come back
    rates: Rates
    max_seqs: int = 1 << 30   # the engine's max_num_seqs: more would wait inside the engine, out of our sight


@dataclass(frozen=True)
class Ask:
    """One request as admission sees it (times on the caller's clock)."""
    arrival: float
    deadline: float       # arrival + TTFT budget (the SLO, or the request's own shorter budget)
    uncached: int         # prompt tokens the KV cache does not hold (decide's estimate)
    priority: int = 0     # lower first (vLLM's ``priority``)
    tenant: str = ""      # who asks (a named key): the box's capacity is shared between the tenants asking
    weight: float = 1.0   # the tenant's weight in that share (its key's class: keys/table.CLASS_WEIGHTS)


@dataclass(frozen=True)
class QueueView:
    ahead: int = 0        # waiting requests with an earlier claim (priority, then deadline)
    length: int = 0       # waiting requests in all
    drain_per_s: float = 0.0   # how fast the queue let requests start lately (0: not known yet)
    arriving: bool = True      # the request is new (False: it is the queue's head, asked again)


@dataclass(frozen=True)
class Verdict:
    action: str           # ADMIT | QUEUE | REFUSE
    reason: str
    ttft_s: float = 0.0   # predicted TTFT from arrival if started now
    retry_after_s: int = 0   # refusals: when a new request would likely be admitted


def retry_after(q: QueueView, wait_room_s: float, p: Policy) -> int:
    """Seconds until the queue ahead drains to what a new request can wait (whole seconds, 1..max). Never more
    than the longest anybody waits (every request now waiting has started or left by then), whatever a thin
    drain estimate says."""
    turnover = p.target * p.ttft_slo_s if p.mode == "slo" else p.wait_bound_s()
    cap = min(float(p.retry_after_max_s), turnover)
    if q.drain_per_s <= 0:
        return max(1, math.ceil(cap))
    need = (q.length + 1) / q.drain_per_s - max(0.0, wait_room_s)
    return max(1, math.ceil(min(cap, need)))


def judge(now: float, ask: Ask, prefill: Optional[Worker], decode: Worker, q: QueueView, p: Policy) -> Verdict:
    """Start, wait or refuse one request on the workers ``decide()`` chose (``prefill`` set for a split).

    ``q.ahead`` counts the waiting requests that go before this one: an arrival passes its own rank, the
    queue's head passes 0."""
    if p.mode == "off":
        return Verdict(ADMIT, R_OFF)
    pre = prefill or decode
    waited = max(0.0, now - ask.arrival)
    if p.mode == "queue":
        bound = ask.arrival + min(p.wait_bound_s(), ask.deadline - ask.arrival)
        if decode.streams < min(p.max_streams, decode.max_seqs) and q.ahead == 0:
            return Verdict(ADMIT, R_ROOM)
        if now >= bound:
            return Verdict(REFUSE, R_EXPIRED, 0.0, retry_after(q, 0.0, p))
        if q.arriving and q.length >= p.max_queue and q.ahead >= q.length:
            return Verdict(REFUSE, R_QUEUE_FULL, 0.0, retry_after(q, bound - now, p))
        return Verdict(QUEUE, R_STREAMS if q.ahead == 0 else R_BEHIND)
    goal = ask.arrival + p.target * (ask.deadline - ask.arrival)    # start by then, as TTFT counts from arrival
    own = pre.rates.ttft(ask.uncached)                              # its TTFT on this worker with nothing ahead
    ttft = waited + pre.rates.ttft(pre.backlog + ask.uncached)
    idle = decode.streams == 0 and pre.backlog == 0 and (prefill is None or prefill.streams == 0)
    if not q.arriving and now >= goal:     # it waited all it may: even an idle worker would start it too late
        return Verdict(REFUSE, R_EXPIRED, ttft, retry_after(q, 0.0, p))
    if q.ahead == 0:
        if idle:
            return Verdict(ADMIT, R_IDLE, ttft)
        ttft_ok = now + (ttft - waited) + pre.rates.ttft_sd <= goal
        tpot_ok = (decode.rates.tpot(decode.streams + 1) + decode.rates.tpot_sd <= p.tpot_target * p.tpot_slo_s
                   and decode.streams < decode.max_seqs)
        if ttft_ok and tpot_ok:
            return Verdict(ADMIT, R_ROOM, ttft)
        if now + own > goal or (tpot_ok and not ttft_ok and not q.arriving):
            # not even an idle worker could start it in time; or only the prefill backlog keeps it out, and a
            # backlog drains no faster than its deadline comes: waiting would only hold the queue behind it
            return Verdict(REFUSE, R_DEADLINE if q.arriving else R_EXPIRED, ttft,
                           retry_after(q, goal - now - own, p))
        reason = R_TTFT if not ttft_ok else R_TPOT
    else:
        reason = R_BEHIND
    room = goal - now - own                                          # how long it may still wait
    if q.length >= p.max_queue and q.arriving and q.ahead >= q.length:
        # full of requests that all go before it (a better one takes the last one's place: the caller's queue)
        return Verdict(REFUSE, R_QUEUE_FULL, ttft, retry_after(q, room, p))
    if q.arriving and q.drain_per_s > 0 and (q.ahead + 1) / q.drain_per_s > room:
        return Verdict(REFUSE, R_DEADLINE, ttft, retry_after(q, room, p))
    return Verdict(QUEUE, reason, ttft)


# ---- learners: state fed with observations, clock-free ------------------------------------------------------

class LinearFit:
    """y ~ a + b * x, fitted with exponential forgetting and held near a prior (a0, b0) until data says otherwise.

    Minimises sum w_i (y_i - a - b x_i)^2 + n0 (a - a0)^2 + n0 x0^2 (b - b0)^2: ridges toward the prior's intercept
    and slope (``x0`` a typical x), so a run of observations at one x (admission keeps the load in a narrow band)
    moves the intercept and slope together, not wildly apart. The intercept's ridge sits at x = 0, away from the
    data: it keeps the line a little above the data at small x (a conservative start; a prior placed at the
    data's level instead lost 15 % of the goodput at 4x the ceiling on the twin, benchmarks/overload.py). Observations weigh 0.5 after ``half_life`` more."""

    def __init__(self, a0: float, b0: float, x0: float, n0: float = 4.0, half_life: float = 200.0,
                 a_min: float = 0.0, b_min: float = 0.0):
        self.a0, self.b0, self.x0, self.n0 = a0, b0, max(x0, 1e-9), n0
        self.decay = 0.5 ** (1.0 / half_life)
        self.a_min, self.b_min = a_min, b_min
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.n = 0
        self._coef = (a0, b0)
        self.var = 0.0                  # forgetting mean of squared residuals (against the line before each point)

    def observe(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y)):
            return
        d = self.decay
        a0, b0 = self._coef
        r = y - (a0 + b0 * x)
        self.var = self.var * d + (1.0 - d) * r * r if self.n else 0.0
        self.sw = self.sw * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y
        self.n += 1
        la, lb = self.n0, self.n0 * self.x0 * self.x0
        m11, m12, m22 = self.sw + la, self.sx, self.sxx + lb
        r1, r2 = self.sy + la * self.a0, self.sxy + lb * self.b0
        det = m11 * m22 - m12 * m12
        if det <= 0:
            return
        a = (r1 * m22 - m12 * r2) / det
        b = (m11 * r2 - m12 * r1) / det
        if b < self.b_min:          # a slope below its floor: keep the floor, refit the intercept alone
            b = self.b_min
            a = (r1 - m12 * b) / m11
        self._coef = (max(self.a_min, a), b)

    def coef(self) -> tuple[float, float]:
        return self._coef

    def sd(self) -> float:
        return math.sqrt(self.var)


class DrainMeter:
    """How fast waiting requests left the queue to start lately: starts per second over a sliding window."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self.times: deque = deque()

    def started(self, now: float) -> None:
        self.times.append(now)
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self.times and self.times[0] < now - self.window_s:
            self.times.popleft()

    def rate(self, now: float) -> float:
        """Starts per second over the window (0 while fewer than 3 starts say anything)."""
        self._trim(now)
        if len(self.times) < 3:
            return 0.0
        return (len(self.times) - 1) / max(now - self.times[0], 1e-3)


@dataclass(frozen=True)
class Prior:
    """Where a worker's learnt rates start (the twin's cost model for a known GPU and model; generic else)."""
    ttft_a: float = 0.15          # s: TTFT of a request with nothing ahead and few uncached tokens
    prefill_tps: float = 10000.0  # uncached prompt tokens prefilled per second
    tpot_b: float = 0.02          # s: TPOT of one stream alone
    tpot_k: float = 0.0005        # s per concurrent stream
    tokens_ref: float = 4096.0    # a typical backlog + uncached (scales the prior's weight on the slope)
    streams_ref: float = 32.0     # a typical stream count

    def to_dict(self) -> dict:
        return {"ttft_a": self.ttft_a, "prefill_tps": self.prefill_tps, "tpot_b": self.tpot_b,
                "tpot_k": self.tpot_k, "tokens_ref": self.tokens_ref, "streams_ref": self.streams_ref}

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "Prior":
        if not d:
            return cls()
        return cls(**{k: float(d[k]) for k in cls().to_dict() if k in d})


class WorkerRates:
    """One worker's learnt TTFT and TPOT lines (``Rates``), fed by the caller's observations."""

    def __init__(self, prior: Prior = Prior()):
        self.prior = prior
        self.ttft = LinearFit(prior.ttft_a, 1.0 / prior.prefill_tps, prior.tokens_ref, a_min=0.0,
                              b_min=1e-7)
        self.tpot = LinearFit(prior.tpot_b, prior.tpot_k, prior.streams_ref, a_min=0.0, b_min=0.0)
        self._rates: Optional[Rates] = None    # built once per observation (the proxy asks per request)

    def saw_first_token(self, tokens_ahead_and_own: float, ttft_s: float) -> None:
        """A request that met ``tokens_ahead_and_own`` (backlog at start + its uncached tokens) got its first
        token ``ttft_s`` after it started (queue wait excluded)."""
        self.ttft.observe(tokens_ahead_and_own, ttft_s)
        self._rates = None

    def saw_stream(self, streams: float, tpot_s: float) -> None:
        """A stream ended having seen ``streams`` streams on its worker (its own included), at ``tpot_s``."""
        self.tpot.observe(streams, tpot_s)
        self._rates = None

    def rates(self) -> Rates:
        if self._rates is None:
            a, s = self.ttft.coef()
            b, k = self.tpot.coef()
            self._rates = Rates(a, s, b, k, self.tpot.sd(), self.ttft.sd())
        return self._rates
