"""Who goes first among the requests waiting, and what a full box keeps free for whom: the admission queue and
the weighted shares between tenants (named keys), beside ``admit.judge``.

Pure like ``admit.py`` (no I/O; the clock is passed in), imported by the live proxy (appliance/proxy/admission.py)
and the twin's simulator (its one tenant always meets the plain order). The rule in plain words is in
docs/security.md ("Keys under overload").
"""
from __future__ import annotations

import bisect
import math
from collections import Counter
from typing import Callable, Optional

from .admit import Ask, Policy, Rates


def stream_room(rates: Rates, p: Policy, max_seqs: int) -> int:
    """Streams one worker takes before one more would push its TPOT past the target (``judge``'s own TPOT rule),
    at most ``max_seqs``; ``max_streams`` in queue mode."""
    if p.mode == "queue":
        return max(1, min(p.max_streams, max_seqs))
    target = p.tpot_target * p.tpot_slo_s
    n = max_seqs if rates.tpot_k <= 0 else int((target - rates.tpot_sd - rates.tpot_b) / rates.tpot_k) + 1
    n = min(max_seqs, n)
    while n > 1 and rates.tpot(n) + rates.tpot_sd > target:    # judge's own comparison, float for float
        n -= 1
    return max(1, n)


class Shares:
    """Weighted shares of the box between tenants (named keys) whose streams cannot be taken back.

    A started stream holds its worker until it ends (16 s for a seed answer; streams started together end
    together), so a tenant at 5x its share that takes every stream that comes free leaves a tenant within its
    share waiting that long for its next request, far past its TTFT. So the streams a tenant asking will need
    are kept free for it: by Little's law, the rate it asks at times how long its streams last, with a margin
    (``need``), up to its weighted share of the streams the box holds (``capacity``: the workers' room within the
    TPOT target, ``stream_room``), less what it runs. A tenant ahead of another in the fair order may take a
    free stream only where the worker keeps room for what the ones behind it are ``owed``: a light tenant's
    unused share is lent out, a busy one's is kept free for it.

    The same for the prefill side, where a box of long prompts is bound first: a tenant that took more than its
    weighted share of the recent starts while another tenant within its share had to wait lately
    (``recent_s``) is judged against a TTFT target scaled down by its share over what it took (``target_scale``).

    Tenants asking: those with streams running or requests waiting. One tenant alone (no keys, or one key
    asking) is never held back. Clock-free: the caller passes the time."""

    def __init__(self, half_life_s: float = 10.0, margin: float = 1.25, slack: int = 2, recent_s: float = 5.0):
        self.half_life_s, self.margin, self.slack, self.recent_s = half_life_s, margin, slack, recent_s
        self.capacity = 0.0           # streams the box holds within the TPOT target (the caller sets it)
        self._asks: dict = {}         # tenant -> (decayed count of its requests, when)
        self._starts: dict = {}       # tenant -> (decayed count of its starts, when)
        self._duration: dict = {}     # tenant -> mean seconds its streams lasted (moving average)
        self._waited: dict = {}       # tenant -> when one of its requests last had to wait

    def _decayed(self, d: dict, tenant: str, now: float) -> float:
        v, at = d.get(tenant, (0.0, now))
        return v * 0.5 ** (max(0.0, now - at) / self.half_life_s)

    def asked(self, tenant: str, now: float) -> None:
        """A request of ``tenant`` came to the gate (started, waited or refused alike)."""
        self._asks[tenant] = (self._decayed(self._asks, tenant, now) + 1.0, now)

    def started(self, tenant: str, now: float) -> None:
        self._starts[tenant] = (self._decayed(self._starts, tenant, now) + 1.0, now)

    def ended(self, tenant: str, seconds: float) -> None:
        """One of ``tenant``'s streams ended after ``seconds``."""
        old = self._duration.get(tenant)
        self._duration[tenant] = seconds if old is None else 0.9 * old + 0.1 * seconds

    def waited(self, tenant: str, now: float) -> None:
        """One of ``tenant``'s requests had to wait (queued) or was turned away now."""
        self._waited[tenant] = now

    def rate(self, tenant: str, now: float) -> float:
        """Requests per second ``tenant`` asked lately (a decayed count's steady state is rate x half-life / ln 2)."""
        return self._decayed(self._asks, tenant, now) * math.log(2) / self.half_life_s

    def need(self, tenant: str, now: float) -> float:
        """Streams ``tenant`` runs at the rate it asks (Little's law), with the margin and slack; before one of its
        streams has ended (how long they last is not known yet) all it may: its share is kept for it."""
        if tenant not in self._duration:
            return math.inf
        return self.rate(tenant, now) * self._duration[tenant] * self.margin + self.slack

    def owed(self, tenant: str, running: dict, waiting, weights: dict, now: float) -> int:
        """Streams to keep free for the other tenants asking before ``tenant`` takes one more: each one behind it
        in the fair order (fewer streams for its weight) is owed what it needs, up to its weighted share of the
        box's streams (all of that share while one of its requests waited within ``recent_s``: what it asks now
        is more than its rate says), less what it runs. A tenant ahead of its share is owed nothing."""
        active = {t for t, n in running.items() if n > 0} | set(waiting) | {tenant}
        if len(active) < 2:
            return 0
        w = sum(weights.get(t, 1.0) for t in active)
        mine = (running.get(tenant, 0) + 1) / weights.get(tenant, 1.0)
        out = 0.0
        for t in active - {tenant}:
            if (running.get(t, 0) + 1) / weights.get(t, 1.0) < mine:
                share = self.capacity * weights.get(t, 1.0) / w
                hurt = now - self._waited.get(t, -math.inf) <= self.recent_s
                want = share if hurt else min(self.need(t, now), share)     # one that just waited: all its share
                out += max(0.0, want - running.get(t, 0))
        return math.ceil(out)

    def target_scale(self, tenant: str, running: dict, waiting, weights: dict, now: float) -> float:
        """1, or the tenant's weighted share over the share of the recent starts it took, when it took more than
        its share while another tenant asking, below its own share, had to wait within ``recent_s``."""
        active = {t for t, n in running.items() if n > 0} | set(waiting) | {tenant}
        if len(active) < 2:
            return 1.0
        took = {t: self._decayed(self._starts, t, now) for t in active}
        total = sum(took.values())
        if total <= 0:
            return 1.0
        w = sum(weights.get(t, 1.0) for t in active)
        mine, share = took[tenant] / total, weights.get(tenant, 1.0) / w
        if mine <= share:
            return 1.0
        hurt = any(now - self._waited.get(t, -math.inf) <= self.recent_s
                   and took[t] / total < weights.get(t, 1.0) / w for t in active - {tenant})
        return share / mine if hurt else 1.0

    def status(self, now: float) -> dict:
        return {t: {"asks_per_s": round(self.rate(t, now), 2),
                    "stream_s": round(self._duration[t], 2) if t in self._duration else None,
                    "need": round(self.need(t, now), 1) if t in self._duration else None} for t in sorted(self._asks)}


Standing = Callable[[str], float]      # tenant -> (streams it runs + 1) / its weight (lower: served first)


class WaitQueue:
    """The proxy's queue: waiting requests ordered by the fairer share, then priority class, then deadline, then
    arrival order.

    Fair shares (named keys): when requests of more than one tenant wait, the next to go is one of the tenant that
    would run the fewest streams for its weight with it (``standing``: (streams running + 1) / weight); on a tie,
    and within a tenant, priority then deadline. So under overload each tenant asking gets the box's streams in proportion to its weight, a
    tenant at 5x its share only competes with itself, and a tenant within its share goes ahead of one beyond it
    whatever came first. With one tenant (no keys: every request is tenant "") this is the plain order.

    Holds the caller's payloads (the proxy's futures, the simulator's requests); bounded by the caller through
    ``judge`` (``max_queue``). ``rank`` is what ``judge`` needs as ``ahead`` for an arrival."""

    def __init__(self) -> None:
        self._items: list = []       # sorted [((priority, deadline, seq, tenant), payload)]
        self._seq = 0
        self._tenants: Counter = Counter()     # tenant -> requests waiting

    def __len__(self) -> int:
        return len(self._items)

    @staticmethod
    def key(ask: Ask, seq: int) -> tuple:
        return (ask.priority, ask.deadline, seq, ask.tenant)

    def _fair(self, standing: Optional[Standing], tenant: Optional[str] = None) -> bool:
        """Whether shares decide anything: more than one tenant among those waiting (and ``tenant``)."""
        if standing is None or not self._tenants:
            return False
        return len(self._tenants) > 1 or (tenant is not None and tenant not in self._tenants)

    def rank(self, ask: Ask, standing: Optional[Standing] = None) -> int:
        """Waiting requests that go before ``ask`` (same standing, class and deadline: those that came first)."""
        probe = (ask.priority, ask.deadline, math.inf)
        if not self._fair(standing, ask.tenant):
            return bisect.bisect_right(self._items, probe, key=lambda kp: kp[0])
        mine = (standing(ask.tenant), probe)
        at = {t: standing(t) for t in self._tenants}
        return sum(1 for k, _ in self._items if (at[k[3]], k[:3]) < mine)

    def push(self, ask: Ask, payload) -> tuple:
        self._seq += 1
        k = self.key(ask, self._seq)
        bisect.insort(self._items, (k, payload), key=lambda kp: kp[0][:3])
        self._tenants[ask.tenant] += 1
        return k

    def _pick(self, standing: Optional[Standing], worst: bool):
        if not self._items:
            return None
        if not self._fair(standing):
            return self._items[-1 if worst else 0]
        at = {t: standing(t) for t in self._tenants}
        order = (lambda kp: (at[kp[0][3]], kp[0][:3]))
        return max(self._items, key=order) if worst else min(self._items, key=order)

    def head(self, standing: Optional[Standing] = None):
        """(key, payload) of the waiting request that goes first, or None."""
        return self._pick(standing, worst=False)

    def pop(self, key: Optional[tuple] = None):
        """Take out the request of ``key`` (default: the first in the plain order) and return (key, payload)."""
        i = 0 if key is None else next(j for j, (k, _) in enumerate(self._items) if k == key)
        got = self._items.pop(i)
        self._gone(got[0])
        return got

    def _gone(self, k: tuple) -> None:
        self._tenants[k[3]] -= 1
        if self._tenants[k[3]] <= 0:
            del self._tenants[k[3]]

    def last(self, standing: Optional[Standing] = None):
        """(key, payload) of the waiting request refused first when a better one needs its place."""
        return self._pick(standing, worst=True)

    def goes_before(self, key: tuple, ask: Ask, standing: Optional[Standing] = None) -> bool:
        """Whether the waiting request of ``key`` keeps its place ahead of ``ask`` (a full queue's last one
        against a newcomer)."""
        mine, theirs = (ask.priority, ask.deadline), key[:2]
        if standing is None or key[3] == ask.tenant:
            return theirs <= mine
        return (standing(key[3]), theirs) <= (standing(ask.tenant), mine)

    def remove(self, key: tuple) -> bool:
        """Take a request out (its client left, or its place went to a better one); False when not there."""
        for i, (k, _) in enumerate(self._items):
            if k == key:
                del self._items[i]
                self._gone(k)
                return True
        return False

    def payloads(self) -> list:
        return [p for _, p in self._items]

    def tenants(self) -> set:
        """The tenants with requests waiting."""
        return set(self._tenants)
