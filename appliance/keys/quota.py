"""Each key's use against its own limits: whether a request may pass, and the rate-limit headers it gets.

Requests and tokens per minute are counted over a sliding 60 s window; tokens per UTC day over the day. A
request's tokens are not known before it ends, so at admission it reserves what it may use (its prompt's
estimated tokens plus its ``max_tokens``) and the reservation is replaced by what it used when it ends: the
window never holds more than the limit, however many requests of one key are in flight (counting only ended
requests would let a key with many long streams overshoot by all of them). A refusal says which limit, when
to come back (``Retry-After``) and carries OpenAI's ``x-ratelimit-*`` headers; one key's refusals never touch
another key's counts. Pure: the clocks are passed in, so the tests drive time.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone

from .table import NamedKey

WINDOW_S = 60.0


@dataclass(frozen=True)
class Verdict:
    ok: bool
    limit: str = ""                  # the limit that refused ("rpm", "tpm", "max_streams", "daily_tokens")
    retry_after_s: float = 0.0
    message: str = ""
    headers: dict = field(default_factory=dict)


@dataclass
class Usage:
    """One key's counts (mutable, owned by Quota)."""
    requests: deque = field(default_factory=deque)     # monotonic times of admitted requests, last 60 s
    tokens: deque = field(default_factory=deque)       # (monotonic time, tokens) of ended requests, last 60 s
    window_tokens: int = 0                             # sum of ``tokens``
    reserved: int = 0                                  # tokens reserved by requests in flight
    inflight: int = 0
    day: str = ""
    day_tokens: int = 0
    admitted: int = 0
    refused: dict = field(default_factory=dict)        # limit -> count
    used_tokens: int = 0                               # since the proxy started


def duration(seconds: float) -> str:
    """OpenAI's reset format: ``"20ms"``, ``"1s"``, ``"6m0s"``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    s = math.ceil(seconds)
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


class Quota:
    def __init__(self, clock=time.monotonic, wall=time.time):
        self.clock, self.wall = clock, wall
        self.usage: dict = {}

    def _u(self, name: str) -> Usage:
        u = self.usage.get(name)
        if u is None:
            u = self.usage[name] = Usage()
        return u

    def _tick(self, u: Usage, now: float) -> None:
        edge = now - WINDOW_S
        while u.requests and u.requests[0] <= edge:
            u.requests.popleft()
        while u.tokens and u.tokens[0][0] <= edge:
            u.window_tokens -= u.tokens.popleft()[1]
        today = datetime.fromtimestamp(self.wall(), timezone.utc).strftime("%Y-%m-%d")
        if u.day != today:
            u.day, u.day_tokens = today, 0

    def _to_midnight(self) -> float:
        t = self.wall()
        return 86400.0 - (t % 86400.0)

    def _tokens_free_after(self, u: Usage, need: int, limit: int, now: float) -> float:
        """Seconds until the window's ended tokens have dropped enough for ``need`` more (reservations included)."""
        excess = u.window_tokens + u.reserved + need - limit
        for t, n in u.tokens:
            excess -= n
            if excess <= 0:
                return max(0.0, t + WINDOW_S - now)
        return WINDOW_S          # what is reserved in flight must end first: a minute bounds it

    def headers(self, key: NamedKey, extra_requests: int = 0) -> dict:
        """OpenAI's rate-limit headers for the key's per-minute limits (none when it has none)."""
        lim, now = key.limits, self.clock()
        u = self._u(key.name)
        self._tick(u, now)
        h = {}
        if lim.rpm:
            h["x-ratelimit-limit-requests"] = str(lim.rpm)
            h["x-ratelimit-remaining-requests"] = str(max(0, lim.rpm - len(u.requests) - extra_requests))
            h["x-ratelimit-reset-requests"] = duration(u.requests[0] + WINDOW_S - now if u.requests else 0.0)
        if lim.tpm:
            used = u.window_tokens + u.reserved
            h["x-ratelimit-limit-tokens"] = str(lim.tpm)
            h["x-ratelimit-remaining-tokens"] = str(max(0, lim.tpm - used))
            h["x-ratelimit-reset-tokens"] = duration(u.tokens[0][0] + WINDOW_S - now if u.tokens else 0.0)
        return h

    def admit(self, key: NamedKey, tokens: int = 0) -> Verdict:
        """Whether one more request of ``key`` that may use up to ``tokens`` passes now; when it does it is
        counted (in flight until ``finish``)."""
        lim, now = key.limits, self.clock()
        u = self._u(key.name)
        self._tick(u, now)
        refusal = None
        if lim.max_streams and u.inflight >= lim.max_streams:
            refusal = ("max_streams", 1.0, f"{u.inflight} requests in flight, the key's limit is {lim.max_streams} "
                                           "at once: wait for one to end")
        elif lim.rpm and len(u.requests) >= lim.rpm:
            refusal = ("rpm", u.requests[0] + WINDOW_S - now, f"{len(u.requests)} requests in the last minute, the "
                                                              f"key's limit is {lim.rpm} per minute")
        elif lim.tpm and tokens > lim.tpm:
            refusal = ("tpm", WINDOW_S, f"this request may use {tokens} tokens (prompt + max_tokens), more than the "
                                        f"key's {lim.tpm} per minute: lower max_tokens or shorten the prompt")
        elif lim.tpm and u.window_tokens + u.reserved + tokens > lim.tpm:
            refusal = ("tpm", self._tokens_free_after(u, tokens, lim.tpm, now),
                       f"{u.window_tokens + u.reserved} tokens used or reserved in the last minute, this request "
                       f"may use {tokens}, the key's limit is {lim.tpm} per minute")
        elif lim.daily_tokens and u.day_tokens + u.reserved + tokens > lim.daily_tokens:
            refusal = ("daily_tokens", self._to_midnight(),
                       f"{u.day_tokens + u.reserved} of the key's {lim.daily_tokens} tokens for today (UTC) used or "
                       f"reserved, this request may use {tokens}")
        if refusal:
            limit, after, why = refusal
            u.refused[limit] = u.refused.get(limit, 0) + 1
            return Verdict(False, limit, max(after, 0.001), f"key {key.name!r} is over its limit: {why}",
                           self.headers(key))
        u.requests.append(now)
        u.inflight += 1
        u.reserved += tokens
        u.admitted += 1
        return Verdict(True, headers=self.headers(key))

    def finish(self, key: NamedKey, reserved: int, used: int) -> None:
        """A request admitted with ``reserved`` tokens ended having used ``used`` (prompt + completion)."""
        now = self.clock()
        u = self._u(key.name)
        self._tick(u, now)
        u.inflight = max(0, u.inflight - 1)
        u.reserved = max(0, u.reserved - reserved)
        used = max(0, int(used))
        if used:
            u.tokens.append((now, used))
            u.window_tokens += used
            u.day_tokens += used
            u.used_tokens += used

    def snapshot(self) -> dict:
        """{key name: counts} for /pdctl/status and ``pdctl status --keys``."""
        now = self.clock()
        out = {}
        for name, u in sorted(self.usage.items()):
            self._tick(u, now)
            out[name] = {"inflight": u.inflight, "requests_last_min": len(u.requests),
                         "tokens_last_min": u.window_tokens, "reserved_tokens": u.reserved,
                         "tokens_today": u.day_tokens, "admitted": u.admitted, "refused": dict(u.refused),
                         "tokens": u.used_tokens}
        return out
