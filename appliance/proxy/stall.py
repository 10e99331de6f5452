"""Hung workers: an engine with legs open that shows no progress for longer than its bound.

Progress is any evidence that the engine still works: a byte on any of its legs, a leg answered, or its token
counters (prompt, generation, engine steps) grown between two scrapes, so an engine that is busy with other
requests (ours queue behind them) or with a long prefill is not hung. The bound is
``max(stall_floor_s, stall_factor x its recent inter-token latency, its prefill backlog / a slow prefill rate)``
(a long prompt alone on an engine may show nothing until its prefill ends). A hung engine's breaker opens at once
(a probe alone cannot close it again: /health may still answer while the engine core is wedged) and every
leg on it fails now: a wait for a first byte is retried on another worker, an answer being streamed is
continued elsewhere (relay.py).
"""
from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("pdctl.proxy")
SOURCE = "stall"
SLOW_PREFILL_TOKENS_PER_S = 2000.0   # below what any engine we plan for prefills (a tiny model on 2 CPU cores:
#                                      ~5,000/s; an H200: tens of thousands)


def bound_s(itl_s: float, floor_s: float, factor: float, backlog_tokens: int = 0) -> float:
    return max(floor_s, factor * itl_s, backlog_tokens / SLOW_PREFILL_TOKENS_PER_S)


def silence(b, now: float, floor_s: float, factor: float) -> float | None:
    """Seconds ``b`` has been silent with work open, when that is past its bound (None: not hung)."""
    if b.inflight <= 0 and not b.streams:
        return None
    quiet = now - b.last_progress
    return quiet if quiet > bound_s(b.itl_s, floor_s, factor, b.prefill_backlog) else None


def declare_hung(server, b, quiet: float, now: float) -> None:
    cfg = server.cfg
    why = (f"{b.label}: hung: no progress on any of its {b.inflight} open legs for {quiet:.1f} s (bound "
           f"{bound_s(b.itl_s, cfg.stall_floor_s, cfg.stall_factor, b.prefill_backlog):.1f} s = max(stall_floor_s, "
           f"stall_factor x inter-token latency {b.itl_s * 1000:.0f} ms, prefill backlog {b.prefill_backlog} "
           f"tokens / {SLOW_PREFILL_TOKENS_PER_S:g} per s))")
    log.warning(why)
    b.stalls += 1
    b.failures += 1
    b.breaker.force_open(why, SOURCE, now)
    server.metrics.stalls.labels(b.label).inc()
    server.counts["stalls"] += 1
    b.touch(now)                 # one verdict per silence: the legs fail now, the next bound starts afresh
    b.trip(streams=True)


async def stall_loop(server) -> None:
    cfg = server.cfg
    period = max(0.05, min(0.5, cfg.stall_floor_s / 4))
    while True:
        await asyncio.sleep(period)
        now = time.monotonic()
        for b in server.backends:
            quiet = silence(b, now, cfg.stall_floor_s, cfg.stall_factor)
            if quiet is not None:
                declare_hung(server, b, quiet, now)
