"""Taking one worker out of rotation and putting it back: the proxy's half of a rolling restart.

``POST /pdctl/workers/drain`` on the internal (loopback) port, with the control secret the proxy writes at
start (``[proxy]``-less: ``C.PROXY_CONTROL_TOKEN``, mode 0600, so only root and the proxy's own user can
drain a worker; any local user can reach the port). The body is JSON:

- ``{"worker": "decode-1", "drain": true}``: no new request or leg goes to it (its breaker allows nothing,
  breaker.py); what it streams now goes on. The answer says how many legs and streams it still has open.
- ``{"worker": "decode-1", "drain": true, "migrate": true}``: its open streams fail over now and continue on
  another worker (migrate.py), its waiting legs retry elsewhere: what the rollout does at its drain time-out.
- ``{"worker": "decode-1", "drain": false}``: a canary (one real 1-token completion sent to it alone) must
  succeed, then it is back in rotation; a failed canary keeps it out and answers 503 with the engine's error.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
from pathlib import Path

from .answers import error_response, json_response
from .errors import ProxyError, bad_request
from .legs import post_whole
from .telemetry import new_request_id

log = logging.getLogger("pdctl.proxy")
CANARY = "pdctl rollout canary"
CANARY_TIMEOUT_S = 60.0


def write_token(path: str) -> str:
    """A fresh secret in ``path`` (0600, replaced atomically); "" (control refused) where it cannot be written."""
    if not path:
        return ""
    token = secrets.token_urlsafe(32)
    p = Path(path)
    tmp = p.with_name(p.name + ".new")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(tmp, p)
    except OSError as exc:
        log.warning("no control secret (%s: %s): rolling restarts cannot drain workers through this proxy",
                    path, exc.strerror or exc)
        return ""
    return token


def _authorized(s, request) -> bool:
    given = request.headers.get("authorization", "")
    return bool(s.control_token) and hmac.compare_digest(given.encode(), f"Bearer {s.control_token}".encode())


def _view(b) -> dict:
    return {"worker": b.label, "drained": bool(b.breaker.drained), "state": b.breaker.state,
            "inflight": b.inflight, "streams": len(b.streams), "pending": len(b.pending),
            "reserved": b.reserved_streams}


async def _canary(s, b) -> str:
    """One 1-token completion sent to ``b`` alone: "" when it answered 200, else why not."""
    models = sorted(b.models) or sorted(s.known_models())
    if not models:
        await s.watcher.models(b)
        models = sorted(b.models)
    if not models:
        return "it answered no GET /v1/models"
    body = json.dumps({"model": models[0], "prompt": CANARY, "max_tokens": 1, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json", "X-Request-Id": new_request_id(), **s.backend_headers()}
    try:
        status, _, raw = await post_whole(b, "/v1/completions", body, headers, CANARY_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - any failure of the canary is its answer
        return f"{type(exc).__name__}: {exc}"
    return "" if status == 200 else f"HTTP {status}: {raw[:200].decode(errors='replace')}"


async def drain(s, request):
    if not _authorized(s, request):
        return error_response(ProxyError(403, "draining a worker needs the proxy's control secret (readable by "
                                         "root: `sudo pdctl apply` sends it)", "permission_error", "forbidden"))
    try:
        ask = json.loads(request.body)
        name, want = str(ask["worker"]), ask["drain"]
        if not isinstance(want, bool):
            raise TypeError("drain must be true or false")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return error_response(bad_request(f"body must be {{\"worker\": NAME, \"drain\": true|false}}: {exc}",
                                          code="invalid_json"))
    b = next((x for x in s.backends if x.label == name), None)
    if b is None:
        return error_response(ProxyError(404, f"no worker {name!r}; known: {', '.join(x.label for x in s.backends)}",
                                         "invalid_request_error", "unknown_worker"))
    if want:
        if not b.breaker.drained:
            b.breaker.drained = str(ask.get("reason") or "rollout")
            s.metrics.rollout.labels("drained").inc()
            s.counts["rollout:drained"] += 1
            log.info("%s drained (%s): %d legs open", b.label, b.breaker.drained, b.inflight)
        if ask.get("migrate"):
            moved = len(b.streams) + len(b.pending)
            if moved:
                b.trip(streams=True)
                s.metrics.rollout.labels("migrated").inc(moved)
                s.counts["rollout:migrated"] += moved
                log.info("%s: %d open legs moved to other workers (drain time-out)", b.label, moved)
        return json_response(_view(b))
    if b.breaker.drained:
        why = await _canary(s, b)
        if why:
            s.metrics.rollout.labels("canary_failed").inc()
            s.counts["rollout:canary_failed"] += 1
            return error_response(ProxyError(503, f"{b.label} failed its canary and stays out of rotation: {why}",
                                             "service_unavailable", "canary_failed"))
        b.breaker.drained = ""
        b.breaker.success("request")      # the canary was a real request: a request-opened breaker closes too
        s.metrics.rollout.labels("undrained").inc()
        s.counts["rollout:undrained"] += 1
        log.info("%s back in rotation (canary ok)", b.label)
    return json_response(_view(b))
