"""One request's way into and out of an engine's KV cache: shared by the simulator and the live twin engine.

Into (``admit``): the API server's work, the KV connector's lookup (asynchronous: the request skips one scheduler
step, ``core.EngineCore.add(defer=True)``), vLLM's own prefix cache, the load of the chunks only the KV server
holds over the host link, the async-load bookkeeping. Out (``store``): the new KV copied to the KV server over
the host link, then the ``request_store_finished`` notification; a decoder of a setup whose connector stores on
consumers re-stores its prompt (``consumer_store_tokens``) and keeps a finished request's blocks until that
store is done. Both drivers
call these functions with their own clock, so ``pdctl twin engine`` and ``pdctl twin simulate`` charge the
same terms for the same request.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

from .core import HostLink
from .costmodel import CostModel


class PrefixCache:
    """vLLM's automatic prefix cache on one engine, in KV blocks (or KV-server chunks, as the caller keys them).

    Least recently used first out once it holds ``capacity`` keys (None: never, the live twin engine's
    approximation). A shared prefix is touched by every request, so it stays; a conversation's history stays while
    its turns come back before other prompts push it out, as on the GPU (the blocks of running sequences are in the
    same pool there: an approximation)."""

    def __init__(self, capacity: Optional[int] = None) -> None:
        self.keys: OrderedDict = OrderedDict()
        self.capacity = capacity

    def peek(self, keys: Sequence[Hashable], chunk_tokens: Sequence[int]) -> int:
        """Leading tokens of ``keys`` held now, changing nothing (what a router's view of this cache would say)."""
        n = 0
        for k, c in zip(keys, chunk_tokens):
            if k not in self.keys:
                break
            n += c
        return n

    def hit(self, keys: Sequence[Hashable], chunk_tokens: Sequence[int]) -> tuple[int, Hashable]:
        """Leading prompt tokens already on this GPU, and the key of the last shared chunk (the block run
        that sequences with the same leading chunks share); then remember the prompt's chunks."""
        n, last = 0, None
        for k, c in zip(keys, chunk_tokens):
            if k not in self.keys:
                break
            n, last = n + c, k
        self.warm(keys)
        return n, last

    def warm(self, keys: Sequence[Hashable]) -> None:
        """Remember ``keys`` as just used (a prompt computed or loaded, an answer's full blocks)."""
        d = self.keys
        for k in keys:
            d[k] = None
            d.move_to_end(k)
        if self.capacity is not None:
            self.fit(self.capacity)

    def fit(self, limit: int) -> None:
        """Forget the least recently used keys beyond ``limit`` (the blocks the GPU can keep cached now)."""
        d = self.keys
        while len(d) > max(0, limit):
            d.popitem(last=False)

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class Admission:
    """What the engine gets for one request: tokens it need not compute, and when it may start."""
    skip: int            # prompt tokens whose KV is ready (prefix cache + KV server), never the whole prompt
    loaded: int          # of those, tokens loaded from the KV server over the host link
    local: int           # of those, tokens found in the engine's own prefix cache
    ready_at: float      # model time the request reaches the scheduler's queue
    defer: bool          # the connector's lookup answers asynchronously: the request skips one scheduler step


def admit(cost: CostModel, now: float, prompt_len: int, store_hit: int, local_hit: int, link: HostLink,
          connector: bool) -> Admission:
    """Admission of a request that arrived at the engine at ``now`` (model seconds).

    ``store_hit``: leading tokens the KV server holds (0 without a connector); ``local_hit``: leading tokens in
    the engine's prefix cache (0 with it off). vLLM asks the connector only for what its own cache lacks."""
    p = cost.params
    cap = max(0, prompt_len - 1)                       # the last prompt token is always computed
    local = min(local_hit, cap) if p.prefix_cache else 0
    hit = min(store_hit, cap) if connector else 0
    skip = max(hit, local)
    loaded = max(0, hit - local)
    start = now + p.api_overhead_s + (p.rpc_s if connector else 0.0)
    ready = link.reserve(start, cost.host_transfer_time(loaded)) if loaded else start
    if loaded:        # an external load: the connector parks the request until the load is reported
        ready += p.kv_load_s
    return Admission(skip, loaded, local, ready, connector and p.async_lookup)



def consumer_store_tokens(cost: CostModel, role: str, prompt_len: int) -> int:
    """Tokens a decoder (``role`` "decode") stores once its prompt is in place: the whole prompt where the setup's
    connector stores on a consumer (``consumer_stores``: LMCache MP before its issue 5143, whose decoders ran
    ``kv_both`` and re-stored the chunks they had loaded), else none."""
    return prompt_len if role == "decode" and cost.params.consumer_stores else 0


def store(cost: CostModel, now: float, new_tokens: int, link: HostLink) -> tuple[float, float]:
    """(stored_at, notified_at): the new KV copied to the KV server behind earlier stores on this engine's link,
    then the store-finished notification reaching the proxy."""
    stored = link.reserve(now, cost.store_time(new_tokens))
    return stored, stored + cost.params.store_notify_s
