"""The twin KV server's store: chunk hash -> size, LRU over a byte budget, with LMCache's counters.

Pure (no I/O): the ZMQ/HTTP server (``kvserver``) and the simulator both use it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence


@dataclass
class StoreCounters:
    """Names match LMCache's ``lmcache_mp_*`` series (see ``appliance.constants``)."""
    lookup_requests: int = 0
    lookup_requested_tokens: int = 0
    lookup_hit_tokens: int = 0
    lookup_hit_keys: int = 0
    write_chunks: int = 0
    read_chunks: int = 0
    evicted_chunks: int = 0
    stores_submitted: int = 0
    stores_finished: int = 0


class ChunkStore:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"KV store size must be > 0 bytes, got {capacity_bytes}")
        self.capacity = int(capacity_bytes)
        self.used = 0
        self._items: "OrderedDict[Hashable, tuple[int, int]]" = OrderedDict()  # key -> (tokens, bytes)
        self.c = StoreCounters()

    def __len__(self) -> int:
        return len(self._items)

    def usage_ratio(self) -> float:
        return self.used / self.capacity

    def store(self, chunks: Iterable[tuple[Hashable, int, int]]) -> int:
        """Store (key, tokens, bytes) chunks; existing keys are refreshed. Returns chunks written."""
        self.c.stores_submitted += 1
        written = 0
        for key, tokens, nbytes in chunks:
            if key in self._items:
                self._items.move_to_end(key)
                continue
            if nbytes > self.capacity:
                continue
            while self.used + nbytes > self.capacity and self._items:
                _, (_, b) = self._items.popitem(last=False)
                self.used -= b
                self.c.evicted_chunks += 1
            self._items[key] = (int(tokens), int(nbytes))
            self.used += nbytes
            written += 1
        self.c.write_chunks += written
        self.c.stores_finished += 1
        return written

    def peek(self, keys: Sequence[Hashable]) -> int:
        """Tokens of the longest stored prefix, without counting or touching the LRU order."""
        hit = 0
        for key in keys:
            item = self._items.get(key)
            if item is None:
                break
            hit += item[0]
        return hit

    def lookup(self, keys: Sequence[Hashable], tokens: Sequence[int]) -> int:
        """Tokens of the longest stored prefix of ``keys`` (chunk token counts in ``tokens``); counted."""
        self.c.lookup_requests += 1
        self.c.lookup_requested_tokens += int(sum(tokens))
        hit = 0
        nkeys = 0
        for key in keys:
            item = self._items.get(key)
            if item is None:
                break
            self._items.move_to_end(key)
            hit += item[0]
            nkeys += 1
        self.c.lookup_hit_tokens += hit
        self.c.lookup_hit_keys += nkeys
        self.c.read_chunks += nkeys
        return hit

    def clear(self) -> None:
        self._items.clear()
        self.used = 0
