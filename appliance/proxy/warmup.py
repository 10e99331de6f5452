"""Start every worker's LMCache heartbeat as soon as it is admitted, so an idle worker is never reaped.

Why: lmcache 0.5.6 starts a worker's heartbeat (its PING with its instance id) only with the worker's first
store or retrieve. Until then the KV server judges it against ``--worker-registration-grace-seconds``; a
worker that is up but gets no long request for that long (an appliance idle overnight, a worker the
readiness canary never picks) is reaped, and its first retrieve afterwards hangs (LMCache issues 4715,
4795). So each worker, when first seen healthy and again after every time its breaker opened (a restart),
gets one request longer than an LMCache chunk: a KV producer (``prefill``/``both``) stores it, and a
consumer (``decode``) retrieves it right after a producer stored it. From then on the heartbeat keeps the
worker registered (``heartbeat_s`` << ``worker_reap_timeout_s``) however long the box stays idle.
"""
from __future__ import annotations

import json
import logging
import time

from .breaker import CLOSED
from .legs import _post_whole
from .upstream import UpstreamError

log = logging.getLogger("pdctl.proxy")
PRODUCERS = ("prefill", "both")
MAX_TRIES = 3          # a consumer that never shows a KV hit is given up on (logged) after this many warm-ups
TIMEOUT_S = 60.0


def _state(server) -> dict:
    """Per backend (by id): 'warm', or the number of failed warm-ups so far."""
    if not hasattr(server, "_kv_warm"):
        server._kv_warm = {}
    return server._kv_warm


def summary(server) -> dict:
    """Per backend label: warmed (its heartbeat runs) or not yet (/pdctl/status "kv_warm")."""
    st = _state(server)
    return {b.label: st.get(id(b)) == "warm" for b in server.backends}


async def _one(server, b, body: bytes) -> bool:
    headers = {"Content-Type": "application/json", "X-Request-Id": f"pdctl-warmup-{int(time.time() * 1000)}"}
    if server.cfg.backend_api_key:
        headers["Authorization"] = "Bearer " + server.cfg.backend_api_key
    b.prompt_chars_sent += len(body)     # keep the chars-per-token calibration honest (tokens.py)
    try:
        status, _, raw = await _post_whole(b, "/v1/completions", body, headers,
                                           min(TIMEOUT_S, server.cfg.prefill_timeout_s))
    except UpstreamError as e:
        log.info("KV warm-up of %s failed: %s", b.label, e)
        return False
    if status != 200:
        log.info("KV warm-up of %s: HTTP %s %r", b.label, status, raw[:120])
    return status == 200


async def warm_new_workers(server, prompt: str, model: str) -> list:
    """Warm each closed-breaker worker not warmed since it was last (re)admitted; returns the labels warmed.

    Producers first (one of them stores the prompt), then consumers (each retrieves it: checked on its
    ``vllm:external_prefix_cache_hits`` counter, which must grow)."""
    st = _state(server)
    live = {id(b) for b in server.backends}
    for k in list(st):
        if k not in live:
            del st[k]
    for b in server.backends:
        if b.breaker.state != CLOSED:
            st.pop(id(b), None)          # down or restarting: warm it again once it is back
    if not server.kv_up:
        return []
    todo = [b for b in server.backends if st.get(id(b)) != "warm" and b.breaker.state == CLOSED]
    if not todo:
        return []
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    warmed = []
    producers = [b for b in server.backends if b.spec.role in PRODUCERS and b.breaker.state == CLOSED]
    for b in sorted(todo, key=lambda b: b.spec.role not in PRODUCERS):
        if b.spec.role in PRODUCERS:
            ok = await _one(server, b, body)
        else:
            stored = bool(producers) and await _one(server, producers[0], body)
            await server.watcher.scrape(b)
            before = b.ext_hits
            ok = stored and await _one(server, b, body)
            if ok and before is not None:
                await server.watcher.scrape(b)
                ok = b.ext_hits is not None and b.ext_hits > before
        if ok:
            st[id(b)] = "warm"
            warmed.append(b.label)
            continue
        tries = (st.get(id(b)) or 0) + 1
        if tries >= MAX_TRIES:
            log.warning("KV warm-up of %s did not reach LMCache after %d tries; its heartbeat may start only "
                        "with its first long request", b.label, tries)
            st[id(b)] = "warm"
        else:
            st[id(b)] = tries
    if warmed:
        log.info("KV warm-up: %s (their LMCache heartbeats run from now on)", ", ".join(warmed))
    return warmed
