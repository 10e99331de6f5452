"""Start every worker's LMCache heartbeat as soon as it is admitted, so an idle worker is never reaped.

Why: lmcache 0.5.6 starts a worker's heartbeat (its PING with its instance id) only with the worker's first
store or retrieve. Until then the KV server judges it against ``--worker-registration-grace-seconds``; a
worker that is up but gets no long request for that long (an appliance idle overnight, a worker the
readiness canary never picks) is reaped, and is never registered again (LMCache issues 4715, 4795). So each
worker, when first seen healthy and again after every time its breaker opened (a restart), gets one request
longer than an LMCache chunk, with a prompt no engine has seen (so no local prefix cache answers it): a KV
producer (``prefill``/``both``) computes and stores it; a consumer (``decode``) retrieves it right after a
producer stored it, which its ``vllm:external_prefix_cache_hits`` counter confirms. From then on the
heartbeat keeps the worker registered (``heartbeat_s`` << ``worker_reap_timeout_s``) however long it idles.
"""
from __future__ import annotations

import asyncio
import json
import logging

from ..wire.client import UpstreamError
from .breaker import CLOSED
from .legs import post_whole
from .telemetry import new_request_id

log = logging.getLogger("pdctl.proxy")
PRODUCERS = ("prefill", "both")
MAX_TRIES = 3          # a worker whose warm-up never reaches LMCache is given up on (logged) after this many
TIMEOUT_S = 60.0


def _state(server) -> dict:
    """Per backend (by id): 'warm', 'given_up', or the number of failed warm-ups so far."""
    if not hasattr(server, "_kv_warm"):
        server._kv_warm = {}
    return server._kv_warm


def summary(server) -> dict:
    """Per backend label: warmed (its heartbeat runs), or not (yet, or given up) (/pdctl/status "kv_warm")."""
    st = _state(server)
    return {b.label: st.get(id(b)) == "warm" for b in server.backends}


async def _one(server, b, prompt: str, model: str, rid: str) -> bool:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json", "X-Request-Id": rid}
    if server.cfg.backend_api_key:
        headers["Authorization"] = "Bearer " + server.cfg.backend_api_key
    b.prompt_chars_sent += len(prompt)     # keep the chars-per-token calibration honest (tokens.py)
    try:
        status, _, raw = await post_whole(b, "/v1/completions", body, headers,
                                           min(TIMEOUT_S, server.cfg.prefill_timeout_s))
    except UpstreamError as e:
        log.info("KV warm-up of %s failed: %s", b.label, e)
        return False
    if status != 200:
        log.info("KV warm-up of %s: HTTP %s %r", b.label, status, raw[:120])
    return status == 200


async def _stored(server, producer, prompt: str, model: str, settle_s: float) -> bool:
    """The producer computes ``prompt``; wait for LMCache's store-finished event (telemetry) or ``settle_s``."""
    rid = new_request_id()
    waiting = producer.spec.telemetry and server.cfg.kv_wait_s > 0
    if waiting:
        server.waiter.expect(rid)
    try:
        if not await _one(server, producer, prompt, model, rid):
            return False
        if waiting:
            await server.waiter.wait(rid, max(server.cfg.kv_wait_s, settle_s))
        else:
            await asyncio.sleep(settle_s)
        return True
    finally:
        server.waiter.discard(rid)


async def warm_new_workers(server, prompt: str, model: str) -> list:
    """Warm each closed-breaker worker not warmed since it was last (re)admitted; returns the labels warmed."""
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
    todo = [b for b in server.backends if st.get(id(b)) not in ("warm", "given_up") and b.breaker.state == CLOSED]
    if not todo:
        return []
    producers = [b for b in server.backends if b.spec.role in PRODUCERS and b.breaker.state == CLOSED]
    warmed = []
    for b in sorted(todo, key=lambda b: b.spec.role not in PRODUCERS):
        tries = st.get(id(b)) or 0
        unique = f"pdctl KV warm-up {new_request_id()}: {prompt}"      # no engine holds its prefix yet
        if b.spec.role in PRODUCERS:
            ok = await _one(server, b, unique, model, new_request_id())
        elif not producers:
            ok = False
        else:
            ok = await _stored(server, producers[0], unique, model, settle_s=0.5 * 2 ** tries)
            await server.watcher.scrape(b)
            before = b.ext_hits
            ok = ok and await _one(server, b, unique, model, new_request_id())
            if ok and before is not None:
                await server.watcher.scrape(b)
                ok = b.ext_hits is not None and b.ext_hits > before
        if ok:
            st[id(b)] = "warm"
            warmed.append(b.label)
        elif tries + 1 >= MAX_TRIES:
            log.warning("KV warm-up of %s did not reach LMCache after %d tries; its heartbeat starts only with "
                        "its first long request", b.label, tries + 1)
            st[id(b)] = "given_up"           # until it is re-admitted
        else:
            st[id(b)] = tries + 1
    if warmed:
        log.info("KV warm-up: %s (their LMCache heartbeats run from now on)", ", ".join(warmed))
    return warmed
