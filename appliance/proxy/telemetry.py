"""LMCache request telemetry: release a decode leg when its prefill's KV store has finished.

LMCache stores the prefiller's KV after the prefill's HTTP answer; a decode leg sent at once can look up
before the store finished and silently recompute. A prefiller run with LMCACHE_REQUEST_TELEMETRY_TYPE=fastapi
POSTs ``{"event": "request_store_finished", "request_ids_set": [...], "world_size": N, "kv_rank": K}`` to the
proxy's internal port (one POST per TP rank). vLLM wraps the id we sent in ``X-Request-Id``
(``cmpl-<id>-0-8d6b96cd``), so ids are matched by our own id pattern, not by position.
"""
from __future__ import annotations

import asyncio
import os
import re
import time

from .. import constants as C

ID_PREFIX = "pdctl"
_ID_RE = re.compile(ID_PREFIX + r"[0-9a-f]{24}")
_EARLY_TTL_S = 30.0


def new_request_id() -> str:
    """Our leg id: no '-' inside, so vLLM's prefix/suffix wrapping can never cut it."""
    return ID_PREFIX + os.urandom(12).hex()


def extract_ids(reported: str) -> list:
    """Our ids inside one id LMCache reported (vLLM adds 'cmpl-'/'chatcmpl-' and '-<n>-<hex>' around it)."""
    return _ID_RE.findall(reported) if isinstance(reported, str) else []


class _Pending:
    __slots__ = ("future", "ranks", "world")

    def __init__(self, fut):
        self.future, self.ranks, self.world = fut, set(), 1


class StoreWaiter:
    def __init__(self):
        self._pending: dict = {}
        self._early: dict = {}     # id -> (time, ranks, world): events that came before expect()
        self.events = 0
        self.matched = 0
        self.unmatched = 0

    def expect(self, rid: str) -> None:
        fut = asyncio.get_running_loop().create_future()
        p = _Pending(fut)
        early = self._early.pop(rid, None)
        if early is not None:
            _, p.ranks, p.world = early
            if len(p.ranks) >= p.world:
                fut.set_result(True)
        self._pending[rid] = p

    def discard(self, rid: str) -> None:
        self._pending.pop(rid, None)

    async def wait(self, rid: str, timeout_s: float) -> bool:
        """True when the store finished (on every TP rank) within the bound; False on time-out."""
        p = self._pending.get(rid)
        if p is None:
            return False
        try:
            if not p.future.done():
                await asyncio.wait_for(asyncio.shield(p.future), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self._pending.pop(rid, None)

    def handle(self, event) -> tuple:
        """Apply one telemetry POST body; returns (notified, total) as the seed's endpoint answered."""
        if not isinstance(event, dict) or event.get("event") != C.TELEMETRY_EVENT_STORE_FINISHED:
            return 0, 0
        ids = event.get("request_ids_set") or event.get("request_ids") or []
        if isinstance(ids, str):
            ids = [ids]
        if not isinstance(ids, (list, tuple)):
            return 0, 0
        world = event.get("world_size", 1)
        world = world if isinstance(world, int) and not isinstance(world, bool) and 1 <= world <= 1024 else 1
        rank = event.get("kv_rank", 0)
        rank = rank if isinstance(rank, (int, str)) and not isinstance(rank, bool) else 0
        self.events += 1
        notified = 0
        now = time.monotonic()
        for reported in ids:
            for rid in extract_ids(reported):
                p = self._pending.get(rid)
                if p is None:
                    _, ranks, _w = self._early.get(rid, (now, set(), world))
                    ranks.add(rank)
                    self._early[rid] = (now, ranks, world)
                    self.unmatched += 1
                    continue
                p.ranks.add(rank)
                p.world = world
                if len(p.ranks) >= world and not p.future.done():
                    p.future.set_result(True)
                    notified += 1
                    self.matched += 1
        if len(self._early) > 10_000 or (self._early and notified == 0):
            self._expire(now)
        return notified, len(ids)

    def _expire(self, now: float) -> None:
        for rid in [r for r, (t, _, _) in self._early.items() if now - t > _EARLY_TTL_S]:
            del self._early[rid]
        while len(self._early) > 10_000:
            self._early.pop(next(iter(self._early)))
