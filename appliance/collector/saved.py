"""Prefill saved: the share of the clients' prompt tokens that no engine had to compute.

The question an operator asks of a shared KV cache is "how much prefill did it save?". Each engine says
how many prompt tokens it was given and how many of those it took from a cache (its own prefix cache or
LMCache through the connector). Summing that over engines counts a split request twice, and its D leg
"hits" the prompt its P leg has just computed and stored: a transfer, not a saving (a P/D box with no
reuse at all would read ~50 % saved). So each worker's tokens are weighted by the share of its legs in
the window that were not D legs (the proxy's ``legs_total{backend,leg}``): exact for a worker that served
one kind of leg in the window, an estimate by leg counts for one that mixed kinds.

    saved = Σ_w cached_w·(1 - d_w) / Σ_w prompt_w·(1 - d_w)
"""
from __future__ import annotations

from typing import Iterable, Union

from appliance import constants as C
from appliance.inventory import NA

from .rates import Window
from .routing import LEG

Num = Union[float, NA]


def _d(window: Window, key: str) -> Union[float, NA]:
    d = window.delta(key, "px")
    if isinstance(d, NA) and d.reason == "series absent in the latest scrape":
        return 0.0
    return d if isinstance(d, (float, NA)) else NA("not a counter")


def cached_tokens(window: Window, inst: str) -> Union[float, NA]:
    """Δ prompt tokens taken from a cache: vLLM's prompt_tokens_cached, else prefix + connector hits."""
    d = window.delta(f"w:{inst}:prompt_cached")
    if isinstance(d, float):
        return d
    local, ext = window.delta(f"w:{inst}:prefix_hits"), window.delta(f"w:{inst}:ext_hits")
    if isinstance(local, float) and isinstance(ext, float):
        return local + ext
    if isinstance(local, float) and isinstance(ext, NA) and ext.reason.startswith("series absent"):
        return local                      # an engine without a KV connector
    return d if isinstance(d, NA) else NA("cached prompt tokens not exposed")


def prefill_saved(window: Window, instances: Iterable[str], legs_exposed: Union[bool, NA]) -> Num:
    if isinstance(legs_exposed, NA):
        return legs_exposed
    if not legs_exposed:
        return NA(f"proxy exposes no {C.PROXY_LEGS}_total: a D leg's KV transfer cannot be told from reuse")
    num = den = 0.0
    why = None
    for inst in instances:
        prompt, cached = window.delta(f"w:{inst}:prompt_tokens"), cached_tokens(window, inst)
        if not isinstance(prompt, float) or not isinstance(cached, float):
            why = why or (prompt if isinstance(prompt, NA) else cached)
            continue
        legs = {k: _d(window, f"{LEG}{inst}:{k}") for k in ("full", "prefill", "decode")}
        if any(isinstance(v, NA) for v in legs.values()):
            why = why or next(v for v in legs.values() if isinstance(v, NA))
            continue
        total = sum(legs.values())
        keep = 1.0 - legs["decode"] / total if total > 0 else 1.0
        num += min(cached, prompt) * keep
        den += prompt * keep
    if den <= 0:
        return why if isinstance(why, NA) and why.reason != "series absent in the latest scrape" else \
            NA("no prompt tokens in the window")
    return max(0.0, min(1.0, num / den))
