"""A peer's router in the simulator: what an operator would otherwise put in front of the same engines.

Only the routing rule lives here; the stack (``simstack.SimStack``) runs it with ``policy="cache-aware"``, usually
on engines without a KV connector (``connector=False``), as vllm-router serves plain vLLM engines.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheAware:
    """vllm-router's ``cache_aware`` policy (0.1.17, a fork of SGLang's router): the router keeps an approximate
    tree of the prompts it sent each worker. Load imbalanced (the busiest worker more than ``balance_abs`` requests
    and ``balance_rel`` times above the idlest): the idlest. Else the worker matching most of the prompt, if that
    share exceeds ``cache_threshold``; else the worker with the smallest tree. Defaults: ``--cache-threshold 0.3``
    (shared/reference/vllm-and-peers.md), balance thresholds 32 and 1.1 (the router's load-balancing docs).
    The tree is read here as each worker's prefix cache (the tree approximates it); ties go to the least loaded."""
    cache_threshold: float = 0.3
    balance_abs: int = 32
    balance_rel: float = 1.1


def cache_aware(s, req, rule: CacheAware = CacheAware()):
    """The engine ``rule`` picks for ``req`` on stack ``s`` (a ``simstack.SimStack``)."""
    engines = s.dec
    lo = min(engines, key=lambda e: e.outstanding)
    hi = max(e.outstanding for e in engines)
    if hi - lo.outstanding > rule.balance_abs and hi > lo.outstanding * rule.balance_rel:
        return lo
    keys = s.blocks(req)
    sizes = [s.block] * len(keys)
    match = {e.name: e.apc.peek(keys, sizes) for e in engines}
    best = max(match.values())
    if best > rule.cache_threshold * req.wl.input_len:
        return min((e for e in engines if match[e.name] == best), key=lambda e: e.outstanding)
    return min(engines, key=lambda e: (len(e.apc), e.outstanding))
