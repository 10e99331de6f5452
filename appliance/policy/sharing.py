"""Who goes first among the requests waiting, and what a full box keeps free for whom: the admission queue and
the weighted shares between tenants (named keys), beside ``admit.judge``.

Pure like ``admit.py`` (no I/O; the clock is passed in), imported by the live proxy (appliance/proxy/admission.py)
and the twin's simulator (its one tenant always meets the plain order). The rule in plain words is in
docs/security.md ("Keys under overload").
"""
from __future__ import annotations

import bisect
import math
from collections import Counter, deque
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

    LATELY_MAX = 4096     # asks kept per tenant for the short window (a flood's rate is read from the newest ones)

    def __init__(self, half_life_s: float = 10.0, margin: float = 1.25, slack: int = 2, recent_s: float = 5.0,
                 rise_s: float = 4.0):
        self.half_life_s, self.margin, self.slack, self.recent_s = half_life_s, margin, slack, recent_s
        self.rise_s = rise_s
        self.capacity = 0.0           # streams the box holds within the TPOT target (the caller sets it)
        self._asks: dict = {}         # tenant -> (decayed count of its requests, when)
        self._first: dict = {}        # tenant -> when it first asked (the decayed count's start)
        self._lately: dict = {}       # tenant -> its asks within the last ``rise_s`` (times, oldest first)
        self._starts: dict = {}       # tenant -> (decayed count of its starts, when)
        self._duration: dict = {}     # tenant -> mean seconds its streams lasted (moving average)
        self._waited: dict = {}       # tenant -> when one of its requests last had to wait
        self._bucket: dict = {}       # tenant -> (starts it may make now, when counted): ``paced``

    def _decayed(self, d: dict, tenant: str, now: float) -> float:
        v, at = d.get(tenant, (0.0, now))
        return v * 0.5 ** (max(0.0, now - at) / self.half_life_s)

    def asked(self, tenant: str, now: float) -> None:
        """A request of ``tenant`` came to the gate (started, waited or refused alike)."""
        self._asks[tenant] = (self._decayed(self._asks, tenant, now) + 1.0, now)
        self._first.setdefault(tenant, now)
        lately = self._lately.setdefault(tenant, deque(maxlen=self.LATELY_MAX))
        lately.append(now)

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
        """Requests per second ``tenant`` asked lately, never read low while its asking rises: the larger of the
        decayed count over the time it has been counted (a decayed count reaches rate x half-life / ln 2 only
        after a few half-lives: read plainly, a tenant 16 s into its traffic looks a third slower than it is, and
        what is kept for it falls short just when its first streams end) and its asks of the last ``rise_s``
        (a tenant back from a pause, or asking more)."""
        h = self.half_life_s
        seen = max(now - self._first.get(tenant, now), self.rise_s)
        counted = self._decayed(self._asks, tenant, now) * math.log(2) / (h * (1.0 - 0.5 ** (seen / h)))
        lately = self._lately.get(tenant)
        if not lately:
            return counted
        while lately and lately[0] <= now - self.rise_s:
            lately.popleft()
        span = self.rise_s if len(lately) < self.LATELY_MAX else max(now - lately[0], 1e-3)
        return max(counted, len(lately) / span)

    def need(self, tenant: str, now: float) -> float:
        """Streams ``tenant`` runs at the rate it asks (Little's law), with the margin and slack; before one of its
        streams has ended (how long they last is not known yet) all it may: its share is kept for it."""
        if tenant not in self._duration:
            return math.inf
        return self.rate(tenant, now) * self._duration[tenant] * self.margin + self.slack

    def _wants(self, tenant: str, running: dict, waiting, weights: dict, now: float) -> dict:
        """What each tenant asking behind ``tenant`` in the fair order (fewer streams for its weight) wants kept
        for it: what it needs, up to its weighted share of the box's streams (all of that share while one of its
        requests waited within ``recent_s``: what it asks now is more than its rate says)."""
        active = {t for t, n in running.items() if n > 0} | set(waiting) | {tenant}
        if len(active) < 2:
            return {}
        w = sum(weights.get(t, 1.0) for t in active)
        mine = (running.get(tenant, 0) + 1) / weights.get(tenant, 1.0)
        out = {}
        for t in active - {tenant}:
            if (running.get(t, 0) + 1) / weights.get(t, 1.0) < mine:
                share = self.capacity * weights.get(t, 1.0) / w
                hurt = now - self._waited.get(t, -math.inf) <= self.recent_s
                out[t] = share if hurt else min(self.need(t, now), share)     # one that just waited: all its share
        return out

    def owed(self, tenant: str, running: dict, waiting, weights: dict, now: float) -> int:
        """Streams to keep free for the other tenants asking before ``tenant`` takes one more: what each one behind
        it wants (``_wants``) less what it runs. A tenant ahead of its share is owed nothing."""
        wants = self._wants(tenant, running, waiting, weights, now)
        return math.ceil(sum(max(0.0, want - running.get(t, 0)) for t, want in wants.items()))

    def paced(self, tenant: str, running: dict, waiting, weights: dict, now: float) -> bool:
        """Whether ``tenant`` must wait a moment before its next start: a tenant with others asking behind it
        starts at most the streams left to it (the box's less what those behind want) per stream lifetime, a
        few at once. Why: streams started together end together, and a wave of them (a batch job arriving into a
        box whose room had been kept for others takes that whole room in one instant) loads the prefill side at
        once, raises every stream's TPOT (the learnt room shrinks under streams already running) and frees the
        room again in one instant a stream lifetime later, each time just as another tenant's requests come."""
        wants = self._wants(tenant, running, waiting, weights, now)
        if not wants:
            return False
        life = self._duration.get(tenant) or max(self._duration.values(), default=0.0)
        if life <= 0:
            return False
        left = max(1.0, self.capacity - sum(wants.values()))
        rate, burst = left / life, max(2.0, left / 8.0)
        tokens, at = self._bucket.get(tenant, (burst, now))
        tokens = min(burst, tokens + (now - at) * rate)
        self._bucket[tenant] = (tokens, now)
        return tokens < 1.0

    def took(self, tenant: str) -> None:
        """A start ``paced`` let through (one of the bucket's tokens)."""
        if tenant in self._bucket:
            tokens, at = self._bucket[tenant]
            self._bucket[tenant] = (tokens - 1.0, at)

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
