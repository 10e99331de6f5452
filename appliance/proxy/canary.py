"""The proxy's readiness canary: one real request through the legs, the only honest /ready signal.

The first canary, and the first after a failed one, is longer than one LMCache chunk (256 tokens) so that it
makes the prefiller store and the decoder retrieve: lmcache 0.5.6 starts a worker's heartbeat (which
re-registers it after a KV server restart) only after that worker's first store or retrieve
(docs/real-engines.md). A worker that restarted fails a canary first, so it gets a long one too. The others
are short: they never reach LMCache and do not disturb its hit counters.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

from .errors import ProxyError
from .legs import Passthrough, decode_body, prefill_body
from .telemetry import new_request_id
from .warmup import warm_new_workers

log = logging.getLogger("pdctl.proxy")
CANARY_PROMPT = "pdctl readiness canary: " + " ".join(f"probe{i % 97} check" for i in range(200))
CANARY_SHORT = "pdctl readiness canary"

async def canary_once(server) -> bool:
    """One real request through both legs (P then D, max_tokens=1): the only honest readiness signal."""
    t0 = time.monotonic()
    server.canary["at"] = t0
    models = server.known_models()
    if not models:
        await asyncio.gather(*(server.watcher.models(b) for b in server.backends), return_exceptions=True)
        models = server.known_models()
    if not models:
        server.canary.update(ok=False, error="no backend answered GET /v1/models")
        return False
    body = {"model": sorted(models)[0], "prompt": CANARY_PROMPT if server._canary_long else CANARY_SHORT,
            "max_tokens": 1,
            "temperature": 0, "stream": False}
    raw = json.dumps(body).encode()
    rid = new_request_id()
    kv = None
    # a rollout may hold every prefiller out (control.py): the box then serves requests whole, and so does the canary,
    # so /ready stays true through a rolling restart
    if any(not b.breaker.drained for b in server.policy.prefill):
        pr = await server.legs.prefill("/v1/completions", prefill_body(body), rid, chars=len(body["prompt"]))
        if isinstance(pr, (ProxyError, Passthrough)):
            why = pr.message if isinstance(pr, ProxyError) else f"prefill HTTP {pr.status}: {pr.body[:120]!r}"
            server.canary.update(ok=False, error="P leg: " + why)
            return False
        kv = pr.kv_params
    d = await server.legs.decode("/v1/completions", decode_body(raw, body, kv), rid, None, False,
                               chars=len(body["prompt"]))
    if isinstance(d, ProxyError) or d.status != 200:
        why = d.message if isinstance(d, ProxyError) else f"HTTP {d.status}: {d.body[:120]!r}"
        server.canary.update(ok=False, error="D leg: " + why)
        return False
    now = time.monotonic()
    server.canary.update(ok=True, last_ok=now, error="", ms=round((now - t0) * 1000, 1))
    server._canary_long = False
    return True

async def canary_loop(server) -> None:
    await asyncio.sleep(0.2)
    while True:
        try:
            ok = await canary_once(server)
        except Exception as e:  # noqa: BLE001 - the loop must outlive any one canary's failure
            ok = False
            server.canary.update(ok=False, error=f"{type(e).__name__}: {e}")
            log.exception("canary failed")
        server.metrics.count("canary", "ok" if ok else "failed")
        if not ok:
            server._canary_long = True
        else:   # every worker's LMCache heartbeat must run before it idles (warmup.py; LMCache 4715/4795)
            try:
                await warm_new_workers(server, CANARY_PROMPT, sorted(server.known_models())[0])
            except Exception:  # noqa: BLE001 - a failed warm-up is retried with the next canary
                log.exception("KV warm-up failed")
        await asyncio.sleep(server.cfg.canary_interval_s if ok else min(1.0, server.cfg.canary_interval_s))
