"""The proxy's admission gate: ``appliance.policy.admit.judge`` on live state, the bounded queue, fast refusals.

``Gate.enter`` is the one step between a generation's decision and its legs. It asks ``judge`` whether the
request starts now, waits, or is refused, with what the proxy knows of the chosen workers (legs open on them,
their prefill backlog, and the TTFT/TPOT lines learnt from their own answers: ``observe_first`` and
``observe_stream``). A waiting request holds a future in the ``WaitQueue``; ``poke`` (called whenever a leg ends
or a first byte comes back) re-decides the head on the state of that moment and starts, keeps or refuses it. A
started request holds a reservation on its workers until its legs count themselves there, so one poke never
starts more than the workers can take. A client that leaves while waiting leaves the queue at once
(``CancelledError``) and reaches no engine.

Fair shares: every started request counts as one stream of its tenant (its named key) until it ends
(``Ticket.close``); the queue lets the tenant with the fewest streams for its weight go first
(``sharing.WaitQueue``), so a batch key at 5x its share waits behind an interactive key within its share.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from ..policy import admit as A
from ..policy import sharing as S
from .errors import ProxyError


@dataclass
class Ticket:
    """A started request's claim on its workers until its legs are counted there (``release``)."""
    gate: "Gate"
    start: float
    ahead: float = 0.0                 # backlog met + its own uncached tokens (the TTFT observation's x)
    held: dict = field(default_factory=dict)    # backend -> (streams, tokens) reserved
    tenant: str | None = None          # counted in the gate's ``running`` until ``close``

    def release(self, backend) -> None:
        got = self.held.pop(backend, None)
        if got is not None:
            backend.reserved_streams -= got[0]
            backend.reserved_tokens -= got[1]

    def release_all(self) -> None:
        for b in list(self.held):
            self.release(b)

    def close(self) -> None:
        """The request ended (answered, failed or left): its reservations go, its tenant runs one stream less."""
        self.release_all()
        if self.tenant is not None:
            self.gate.shares.ended(self.tenant, time.monotonic() - self.start)
            self.gate.ended(self.tenant)
            self.tenant = None


@dataclass
class _Waiter:
    ask: A.Ask
    reroute: object                    # () -> Route: decide again on the state of the moment
    fut: asyncio.Future


def refusal(v: A.Verdict, status: int, queue_len: int) -> tuple:
    why = {A.R_QUEUE_FULL: f"the admission queue is full ({queue_len} waiting)",
           A.R_DEADLINE: "the requests already waiting would push this one past its TTFT deadline",
           A.R_EXPIRED: "it waited in the admission queue until its TTFT deadline could no longer be met"
           }.get(v.reason, v.reason)
    err = ProxyError(status, f"the server is overloaded: {why}; retry after {v.retry_after_s} s (Retry-After), "
                             "or send to another box", "service_unavailable" if status != 429 else "rate_limit_exceeded",
                     A.OVERLOADED_CODE)
    return err, {"Retry-After": str(v.retry_after_s)}


class Gate:
    def __init__(self, server, policy: A.Policy, prior: A.Prior):
        self.s = server
        self.policy = policy
        self.prior = prior
        self.queue = S.WaitQueue()
        self.drain = A.DrainMeter()
        self.starts = A.DrainMeter()    # every start, at arrival or from the queue (the room that appears)
        self.rates: dict = {}          # backend label -> WorkerRates
        self._counters: dict = {}      # (outcome, reason, priority) -> its labelled counter
        self._poke_pending = False
        self.running: Counter = Counter()     # tenant -> requests started and not ended
        self.weights: dict = {}               # tenant -> its weight in the share (the last request's)
        self.shares = S.Shares()              # what a full box owes each tenant (sharing.Shares)

    # ----- configuration --------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Admission judges the workers ``decide()`` chose: the adaptive policy's (the baselines pick their
        workers leg by leg, after the fact)."""
        return self.policy.mode != "off" and self.s.cfg.policy == "adaptive"

    def reconfigure(self, policy: A.Policy, prior: A.Prior) -> None:
        """A reload: new settings apply to the next decision; waiting requests keep their place (mode off lets them
        all start)."""
        self.policy, self.prior = policy, prior
        self.poke()

    def worker_rates(self, b) -> A.WorkerRates:
        r = self.rates.get(b.label)
        if r is None:
            r = self.rates[b.label] = A.WorkerRates(self.prior)
        return r

    def view(self, b, max_seqs: int) -> A.Worker:
        return A.Worker(b.label, b.inflight + b.reserved_streams, b.prefill_backlog + b.reserved_tokens,
                        self.worker_rates(b).rates(), max_seqs)

    # ----- the step ---------------------------------------------------------------------------------
    def _judge(self, now: float, ask: A.Ask, rt, ahead: int, arriving: bool = True) -> A.Verdict:
        """``judge`` on the chosen workers; a tenant past its share of the starts while another waits is judged
        against its scaled TTFT target (sharing.Shares.target_scale); a wait is noted for the shares."""
        pol = self.policy
        if len(self.running) + len(self.queue.tenants()) >= 2 and pol.mode == "slo":
            scale = self.shares.target_scale(ask.tenant, self.running, self.queue.tenants(), self.weights, now)
            if scale < 1.0:
                pol = replace(pol, target=pol.target * scale)
        v = self._judge_with(now, ask, rt, ahead, arriving, pol)
        if v.action != A.ADMIT:                      # it waits or is turned away: its tenant is asking, unserved
            self.shares.waited(ask.tenant, now)
        return v

    def _judge_with(self, now: float, ask: A.Ask, rt, ahead: int, arriving: bool, pol: A.Policy) -> A.Verdict:
        cap = self.s.cfg.max_num_seqs or (1 << 30)
        dec = self.view(rt.decode, cap)
        pre = self.view(rt.prefill, cap) if rt.prefill is not None else None
        drain = self.drain.rate(now)
        if len(self.running) + len(self.queue.tenants()) >= 2:
            # tenants share the box: a tenant first in the fair order gets whatever room appears, started from the
            # queue or at another's arrival alike, so its wait is told by every start, not only the queue's
            drain = max(drain, self.starts.rate(now))
        q = A.QueueView(ahead, len(self.queue), drain, arriving)
        if ask.uncached != rt.uncached:
            ask = replace(ask, uncached=rt.uncached)
        return A.judge(now, ask, pre, dec, q, pol)

    def standing(self, tenant: str) -> float:
        """Streams ``tenant`` would run for its weight with one more started: who goes first when several tenants
        wait (lower first). Counting the one more makes the shares come out in the weights' proportion (4 to 1:
        an interactive key takes four streams for every one of a batch key) rather than alternating."""
        return (self.running.get(tenant, 0) + 1) / max(self.weights.get(tenant, 1.0), 1e-9)

    def ended(self, tenant: str) -> None:
        self.running[tenant] -= 1
        if self.running[tenant] <= 0:
            del self.running[tenant]
        self.poke()

    def capacity(self) -> int:
        """Streams the decoding workers take within the TPOT target now (sharing.stream_room on their learnt
        rates)."""
        cap = self.s.cfg.max_num_seqs or (1 << 30)
        return sum(S.stream_room(self.worker_rates(b).rates(), self.policy, cap) for b in self.s.backends
                   if b.spec.role in ("decode", "both") and b.breaker.allows())

    def _within_share(self, v: A.Verdict, ask: A.Ask, rt, now: float) -> A.Verdict:
        """An admission the shares hold back becomes a wait (``R_SHARE``): the box must keep free, beside this
        stream, the streams other tenants are owed (sharing.Shares.owed), counted over every decoding worker (the
        owed ones go wherever ``decide()`` sends them)."""
        if v.action != A.ADMIT or v.reason == A.R_IDLE or len(self.running) + len(self.queue.tenants()) < 2:
            return v
        decoders = [b for b in self.s.backends if b.spec.role in ("decode", "both") and b.breaker.allows()]
        self.shares.capacity = self.capacity()
        waiting = self.queue.tenants()
        owed = self.shares.owed(ask.tenant, self.running, waiting, self.weights, now)
        free = self.shares.capacity - sum(b.inflight + b.reserved_streams for b in decoders)
        if (owed > 0 and free - 1 < owed) or self.shares.paced(ask.tenant, self.running, waiting, self.weights, now):
            return A.Verdict(A.QUEUE, A.R_SHARE, v.ttft_s)
        self.shares.took(ask.tenant)
        return v

    def _ticket(self, now: float, rt, tenant: str = "") -> Ticket:
        t = Ticket(self, now, tenant=tenant)
        self.running[tenant] += 1
        self.shares.started(tenant, now)
        self.starts.started(now)
        first = rt.prefill if rt.prefill is not None else rt.decode
        t.ahead = first.prefill_backlog + first.reserved_tokens + rt.uncached
        parts = {first: (0, rt.uncached)}
        s, tok = parts.get(rt.decode, (0, 0))
        parts[rt.decode] = (s + 1, tok)
        for b, (s, tok) in parts.items():
            b.reserved_streams += s          # decide() sees them too (routing.AdaptivePolicy.loads)
            b.reserved_tokens += tok
        t.held = parts
        return t

    def _count(self, v: A.Verdict, priority: int) -> None:
        key = (v.action, v.reason, priority)
        c = self._counters.get(key)
        if c is None:
            c = self._counters[key] = self.s.metrics.admission.labels(v.action, v.reason, str(priority))
        c.inc()
        self.s.counts[f"admission:{v.action}:{v.reason}"] += 1

    async def enter(self, ask: A.Ask, rt, reroute):
        """(Route, Ticket) to go on with, or (Refusal error, headers). ``rt`` is the route decided at arrival;
        ``reroute()`` decides again (for a request that waited)."""
        now = time.monotonic()
        if not self.active or rt.decode is None:
            return rt, None
        self.weights[ask.tenant] = ask.weight
        self.shares.asked(ask.tenant, now)
        v = self._within_share(self._judge(now, ask, rt, self.queue.rank(ask, self.standing)), ask, rt, now)
        self._count(v, ask.priority)
        if v.action == A.ADMIT:
            return rt, self._ticket(now, rt, ask.tenant)
        if v.action == A.REFUSE:
            return refusal(v, self.policy.status, len(self.queue))
        if len(self.queue) >= self.policy.max_queue:      # full: a better claim takes the worst one's place
            last = self.queue.last(self.standing)
            if last is None or self.queue.goes_before(last[0], ask, self.standing):
                v = A.Verdict(A.REFUSE, A.R_QUEUE_FULL, v.ttft_s, A.retry_after(
                    A.QueueView(len(self.queue), len(self.queue), self.drain.rate(now)), 0.0, self.policy))
                self._count(v, ask.priority)
                return refusal(v, self.policy.status, len(self.queue))
            self.queue.remove(last[0])
            self._finish(last[1], A.Verdict(A.REFUSE, A.R_QUEUE_FULL, 0.0, A.retry_after(
                A.QueueView(len(self.queue), len(self.queue), self.drain.rate(now)), 0.0, self.policy)))
        fut = asyncio.get_running_loop().create_future()
        key = self.queue.push(ask, _Waiter(ask, reroute, fut))
        self.s.metrics.queue_depth.set(len(self.queue))
        self._at(ask.arrival + self.policy.target * (ask.deadline - ask.arrival))
        try:
            return await fut
        except asyncio.CancelledError:
            if self.queue.remove(key):
                self._count(A.Verdict(A.REFUSE, A.R_GONE), ask.priority)
                self.s.metrics.queue_depth.set(len(self.queue))
            elif fut.done() and not fut.cancelled():
                got = fut.result()
                if isinstance(got[1], Ticket):
                    got[1].close()
            raise
        finally:
            self.s.metrics.queue_wait.observe(time.monotonic() - now)

    def _finish(self, w: _Waiter, v: A.Verdict, rt=None, ticket=None) -> None:
        self._count(v, w.ask.priority)
        if w.fut.done():
            if ticket is not None:
                ticket.close()
            return
        if v.action == A.ADMIT:
            w.fut.set_result((rt, ticket))
        else:
            w.fut.set_result(refusal(v, self.policy.status, len(self.queue)))

    def _at(self, when: float) -> None:
        """Pump at ``when``: by then the waiting request has started, or it leaves refused."""
        asyncio.get_running_loop().call_later(max(0.0, when - time.monotonic()) + 0.001, self.pump)

    def poke(self) -> None:
        """Room may have freed (a leg ended, a first byte came back): pump the queue soon, once."""
        if not self.queue or self._poke_pending:
            return
        self._poke_pending = True
        try:
            asyncio.get_running_loop().call_soon(self._poked)
        except RuntimeError:       # no loop (a test's synchronous teardown): nothing waits
            self._poke_pending = False

    def _poked(self) -> None:
        self._poke_pending = False
        self.pump()

    def pump(self) -> None:
        """Start or refuse waiting requests from the head while the head's workers have room."""
        while self.queue:
            key, w = self.queue.head(self.standing)
            if w.fut.done():
                self.queue.pop(key)
                continue
            now = time.monotonic()
            if not self.active:
                rt = w.reroute()
                self.queue.pop(key)
                self._finish(w, A.Verdict(A.ADMIT, A.R_OFF), rt, None)
                continue
            rt = w.reroute()
            if rt.decode is None:                       # no worker at all: let the legs answer (503, no worker)
                self.queue.pop(key)
                self._finish(w, A.Verdict(A.ADMIT, A.R_IDLE), rt, None)
                continue
            v = self._within_share(self._judge(now, w.ask, rt, 0, arriving=False), w.ask, rt, now)
            if v.action == A.QUEUE:
                break
            self.queue.pop(key)
            if v.action == A.ADMIT:
                self.drain.started(now)
                self._finish(w, v, rt, self._ticket(now, rt, w.ask.tenant))
            else:
                self._finish(w, v)
        self.s.metrics.queue_depth.set(len(self.queue))

    # ----- learning -----------------------------------------------------------------------------------
    def observe_first(self, ticket: Ticket | None, backend) -> None:
        """The first token came back on ``backend`` (the worker that prefilled it)."""
        if ticket is not None and backend is not None:
            self.worker_rates(backend).saw_first_token(ticket.ahead, time.monotonic() - ticket.start)

    def observe_stream(self, backend, streams: float, tpot_s: float) -> None:
        if backend is not None and tpot_s > 0:
            self.worker_rates(backend).saw_stream(streams, tpot_s)

    def status(self) -> dict:
        now = time.monotonic()
        return {"mode": self.policy.mode, "active": self.active, "refusal_status": self.policy.status,
                **({} if self.active or self.policy.mode == "off" else
                   {"inactive": f"policy {self.s.cfg.policy}: admission judges the workers the adaptive policy "
                                "chose; set [proxy] policy = \"adaptive\""}),
                "queue": len(self.queue), "drain_per_s": round(self.drain.rate(now), 3),
                "stream_room": self.capacity() if self.active else None,
                "tenants": {t: {"running": self.running.get(t, 0), "weight": self.weights.get(t, 1.0),
                                **self.shares.status(now).get(t, {})}
                            for t in sorted(set(self.running) | {t for t in self.weights if t})},
                "ttft_slo_s": self.policy.ttft_slo_s, "tpot_slo_ms": round(self.policy.tpot_slo_s * 1000, 3),
                "workers": {k: {"ttft_base_s": round(r.rates().ttft_a, 4),
                                "prefill_tps": round(1.0 / r.rates().ttft_s, 1) if r.rates().ttft_s else None,
                                "tpot_base_ms": round(r.rates().tpot_b * 1000, 3),
                                "tpot_per_stream_ms": round(r.rates().tpot_k * 1000, 4),
                                "first_tokens_seen": r.ttft.n, "streams_seen": r.tpot.n}
                            for k, r in self.rates.items()}}
