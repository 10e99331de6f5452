"""The simulator's clock and engines: an event loop at model times, and one engine (``core.EngineCore``) with its host
links, prefix cache and the proxy's bookkeeping of it (outstanding legs, prefill backlog, admission's learnt lines).
"""
from __future__ import annotations

import heapq
from typing import Callable, Optional

from ..policy import admit as A
from . import kvpath
from .core import EngineCore, HostLink
from .costmodel import CostModel


class EventLoop:
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


class SimEngine:
    def __init__(self, name: str, cost: CostModel, loop: EventLoop, role: str = "decode", connector: bool = True):
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
        # vLLM's prefix cache on this GPU, in blocks (used when prefix_cache), as many as its KV cache holds
        self.apc = kvpath.PrefixCache(max(1, cost.kv_capacity_tokens() // cost.cfg.block_size))
        self.rates: Optional[A.WorkerRates] = None   # admission's learnt TTFT/TPOT lines (admission on)
        self.pinned = 0           # prompt blocks of the sequences sent here and not finished, beyond the system
        #                           prompt (in the prefix cache and in use: never evicted)

    def cache_room(self, system_blocks: int) -> int:
        """Blocks the prefix cache may hold now: the free KV blocks (idle cached blocks live there and go first
        when running sequences grow) plus the prompt blocks running sequences use."""
        free = (self.core.capacity - self.core.kv_used) // self.core.cfg.block_size
        return free + self.pinned + system_blocks

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
