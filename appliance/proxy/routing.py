"""Which prefiller, which decoder, and whether the P leg is worth it.

``pdctl`` policy: prefiller by least outstanding work; decoder by load (proxy in-flight plus the engine's
scraped running/waiting/KV usage) with affinity (``X-Session-Id`` or the first prompt chunk) kept while the
preferred decoder is not much busier than the least busy one (bounded-load rendezvous hashing).
``round-robin``: the seed's baseline, round-robin over each pool, never skips the P leg.
``adaptive`` (the default): per request, aggregate on one worker or split P/D, from live load, by the
one pure rule in ``appliance/policy/decide.py`` (the twin's simulator imports the same function).

Every policy answers ``route(prompt_text, prompt_tokens, hint) -> Route``: the decision (kind, reason) and,
for ``adaptive``, the chosen backends (``hint``: the worker of a session's last turn, sessions.py; only
``adaptive`` weighs it); the legs fall back to ``pick_prefill`` / ``pick_decode`` when a
chosen backend fails before its first byte.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from ..policy import decide as D
from .warm import CHUNK_CHARS, WarmIndex, chunk_prefixes

AFFINITY_SLACK = 2.0                           # preferred decoder kept while load <= least + max(slack, 25 %)

SKIP_AGGREGATED = "aggregated"          # no prefill workers in the plan
SKIP_SHORT = "short_prompt"             # nothing worth storing: below the threshold
SKIP_CACHED = "prefix_cached"           # the prefix was stored recently; the rest is short
SKIP_NO_PREFILLER = "prefill_unavailable"   # every prefiller failed or is open, fallback allowed


@dataclass(frozen=True)
class Route:
    kind: str                  # decide.AGGREGATE | decide.SPLIT
    reason: str                # decide.R_* or a skip reason (baselines)
    prefill: object = None     # Backend chosen for the P leg (adaptive), else the policy picks
    decode: object = None      # Backend chosen for the whole request or the D leg (adaptive)
    uncached: int = 0          # estimated prompt tokens not in the KV server


def _eligible(pool, excluded):
    now = time.monotonic()
    return [b for b in pool if b not in excluded and b.breaker.allows(now)]


class PrefixIndex:
    """Prompt prefixes stored in the KV server recently, at ~chunk boundaries, with a time-to-live.

    The proxy cannot ask LMCache cheaply whether a prefix is still in L1, so "recent" (TTL, bounded
    size) stands in for "still there"; a wrong guess costs a decoder-side recompute, never a wrong answer.
    """

    def __init__(self, ttl_s: float = 300.0, max_entries: int = 200_000):
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._seen: OrderedDict = OrderedDict()

    boundaries = staticmethod(chunk_prefixes)

    def clear(self) -> None:
        """Forget everything (the KV server restarted: its L1 is empty)."""
        self._seen.clear()

    def record(self, text: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for _, d in self.boundaries(text):
            self._seen[d] = now
            self._seen.move_to_end(d)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)

    def cached_chars(self, text: str, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        for end, d in reversed(self.boundaries(text)):
            t = self._seen.get(d)
            if t is not None and now - t <= self.ttl_s:
                return end
        return 0


class RoundRobin:
    """The seed's baseline: round-robin over each pool, P leg always (unless aggregated). (The seed shared
    one index between both pools, which pins P/D pairs when the pool sizes share a factor; one per pool.)"""
    name = "round-robin"

    def __init__(self, prefill: list, decode: list, min_prompt_tokens: int, prefix: PrefixIndex):
        self.prefill, self.decode = prefill, decode
        self.min_prompt_tokens = min_prompt_tokens
        self.prefix = prefix
        self._rr = {"prefill": 0, "decode": 0}

    def _rotate(self, cands, pool: str = "decode"):
        self._rr[pool] += 1
        return cands[self._rr[pool] % len(cands)]

    def skip_reason(self, prompt_text: str, prompt_tokens: int) -> str | None:
        return SKIP_AGGREGATED if not self.prefill else None

    def route(self, prompt_text: str, prompt_tokens: int, hint=None) -> Route:
        skip = self.skip_reason(prompt_text, prompt_tokens)
        return Route(D.AGGREGATE, skip, uncached=prompt_tokens) if skip else Route(D.SPLIT, D.R_STATIC,
                                                                                    uncached=prompt_tokens)

    def pick_prefill(self, excluded=()):
        cands = _eligible(self.prefill, excluded)
        return self._rotate(cands, "prefill") if cands else None

    def served(self, prompt_text: str, backend) -> None:
        """``backend`` computed or loaded ``prompt_text`` (the adaptive policy remembers where it is warm)."""

    def pick_decode(self, affinity: str | None = None, excluded=()):
        cands = _eligible(self.decode, excluded)
        return self._rotate(cands) if cands else None


class PdctlPolicy(RoundRobin):
    name = "pdctl"

    def skip_reason(self, prompt_text: str, prompt_tokens: int) -> str | None:
        if not self.prefill:
            return SKIP_AGGREGATED
        if prompt_tokens < self.min_prompt_tokens:
            return SKIP_SHORT
        cached = self.prefix.cached_chars(prompt_text)
        if cached and (len(prompt_text) - cached) // 4 < self.min_prompt_tokens:
            return SKIP_CACHED
        return None

    def pick_prefill(self, excluded=()):
        cands = _eligible(self.prefill, excluded)
        if not cands:
            return None
        best = min(b.inflight + b.waiting for b in cands)
        ties = [b for b in cands if b.inflight + b.waiting == best]
        return ties[0] if len(ties) == 1 else self._rotate(ties, "prefill")

    def pick_decode(self, affinity: str | None = None, excluded=()):
        cands = _eligible(self.decode, excluded)
        if not cands:
            return None
        if len(cands) == 1:
            return cands[0]
        loads = [(b.load(), b) for b in cands]
        least = min(l for l, _ in loads)
        if affinity is not None:
            pref_load, pref = max(((l, b) for l, b in loads), key=lambda lb: hash((affinity, lb[1].url)))
            if pref_load <= least + max(AFFINITY_SLACK, 0.25 * least):
                return pref
        ties = [b for l, b in loads if l == least]
        return ties[0] if len(ties) == 1 else self._rotate(ties)


class AdaptivePolicy(PdctlPolicy):
    """Aggregate or split per request from live load (``appliance.policy.decide``); soft roles: a ``both`` worker
    serves whole requests, P legs and D legs."""
    name = "adaptive"

    def __init__(self, prefill: list, decode: list, min_prompt_tokens: int, prefix: PrefixIndex,
                 thresholds: D.Thresholds = D.Thresholds(), warm=None):
        super().__init__(prefill, decode, min_prompt_tokens, prefix)
        self.thresholds = thresholds
        self.warm = warm if warm is not None else WarmIndex()    # where each prompt is warm (warm.py)
        self.chars_per_token = lambda: 4.0     # the server points this at its learned ratio (tokens.py)
        self.workers = list(prefill) + [b for b in decode if b not in prefill]
        # P-leg fallbacks: dedicated prefillers first, then both-workers
        self.prefill = list(prefill) + [b for b in decode if b.spec.role == "both"]
        self._turn = 0

    def skip_reason(self, prompt_text: str, prompt_tokens: int) -> str | None:
        return None

    def loads(self, warm_chars: dict | None = None) -> list:
        now = time.monotonic()
        cpt = self.chars_per_token()
        warm_chars = warm_chars or {}
        out = []
        for b in self.workers:
            fresh = b.scraped_at and now - b.scraped_at < 5.0
            out.append(D.WorkerLoad(b.label, b.spec.role, b.breaker.allows(now), b.inflight + b.reserved_streams,
                                    b.prefill_backlog + b.reserved_tokens,
                                    b.running if fresh else 0.0, b.waiting if fresh else 0.0,
                                    b.kv_usage if fresh else 0.0, int(warm_chars.get(b.label, 0) / cpt)))
        return out

    def route(self, prompt_text: str, prompt_tokens: int, hint=None) -> Route:
        cached = min(int(self.prefix.cached_chars(prompt_text) / self.chars_per_token()), prompt_tokens)
        self._turn += 1
        warm = self.warm.warm_chars(prompt_text)
        if hint is not None:      # the session's last worker holds its last prompt and answer (sessions.py)
            warm[hint.worker] = max(warm.get(hint.worker, 0), hint.chars)
        d = D.decide(prompt_tokens, cached, self.loads(warm), self.thresholds, self._turn)
        if d is None:
            return Route(D.AGGREGATE, D.R_NO_DECODER, uncached=prompt_tokens - cached)
        by = {b.label: b for b in self.workers}
        return Route(d.kind, d.reason, by.get(d.prefill), by[d.decode], d.uncached)

    def pick_prefill(self, excluded=()):
        cands = _eligible(self.prefill, excluded)
        if not cands:
            return None
        return min(cands, key=lambda b: (b.spec.role != "prefill", b.prefill_backlog, b.inflight))

    def served(self, prompt_text: str, backend) -> None:
        if backend is not None and prompt_text:
            self.warm.record(prompt_text, backend.label)

    def pick_decode(self, affinity: str | None = None, excluded=()):
        got = super().pick_decode(affinity, excluded)
        if got is None:   # nothing that decodes is up: a prefiller can serve the whole request
            cands = _eligible([b for b in self.prefill if b.spec.role == "prefill"], excluded)
            got = min(cands, key=lambda b: b.load(), default=None)
        return got


POLICIES = {"adaptive": AdaptivePolicy, "pdctl": PdctlPolicy, "round-robin": RoundRobin}


def make_policy(cfg, backends: list, prefix: PrefixIndex, chars_per_token, warm=None):
    """The routing policy over ``backends`` as ``cfg`` asks (the proxy's start and its reload build it alike);
    ``chars_per_token()`` is the server's learned ratio (tokens.py); ``warm`` the server's ``WarmIndex`` (kept
    across a reload: the engines' caches are)."""
    if cfg.policy not in POLICIES:
        raise ValueError(f"unknown proxy policy {cfg.policy!r}: choose one of {', '.join(POLICIES)}")
    prefill = [b for b in backends if b.spec.role == "prefill"]
    decode = [b for b in backends if b.spec.role in ("decode", "both")]
    extra = {"thresholds": cfg.thresholds, "warm": warm} if cfg.policy == "adaptive" else {}
    policy = POLICIES[cfg.policy](prefill, decode, cfg.pd_min_prompt_tokens, prefix, **extra)
    if hasattr(policy, "chars_per_token"):
        policy.chars_per_token = chars_per_token
    return policy


def affinity_key(session_id: str | None, prompt_text: str) -> str | None:
    """The session (``X-Session-Id`` or ``user``: sessions.session_key) when given, else the first prompt chunk
    (same system prompt -> same decoder)."""
    if session_id:
        return "s:" + session_id
    return "p:" + prompt_text[:CHUNK_CHARS] if prompt_text else None
