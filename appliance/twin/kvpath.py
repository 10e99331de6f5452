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

from dataclasses import dataclass
from typing import Hashable, Sequence

from .core import HostLink
from .costmodel import CostModel


class PrefixCache:
    """vLLM's automatic prefix cache on one engine, in KV-server chunks.

    Approximation: nothing is evicted. A shared prefix is touched by every request, so vLLM's LRU keeps it;
    unique chunks rarely recur on the same engine, so their eviction does not change the cost."""

    def __init__(self) -> None:
        self.keys: set = set()

    def hit(self, keys: Sequence[Hashable], chunk_tokens: Sequence[int]) -> tuple[int, Hashable]:
        """Leading prompt tokens already on this GPU, and the key of the last shared chunk (the block run
        that sequences with the same leading chunks share); then remember the prompt's chunks."""
        n, last = 0, None
        for k, c in zip(keys, chunk_tokens):
            if k not in self.keys:
                break
            n, last = n + c, k
        self.keys.update(keys)
        return n, last

    def warm(self, keys: Sequence[Hashable]) -> None:
        self.keys.update(keys)


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
