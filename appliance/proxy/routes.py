"""The proxy's route tables and its own small routes (health, readiness, metrics, models, status, telemetry).

Public port (:9000, faces the network): the OpenAI routes (orchestrate.py for generations, tokenize_routes.py,
utility_routes.py for the engines' other routes), /health, /ready, /metrics. Internal port (loopback only):
LMCache's request telemetry, /pdctl/status, /health, /metrics, the rollout's drain (control.py). ``s`` is the ProxyServer.
"""
from __future__ import annotations

import asyncio
import json
import time
from functools import partial

from .. import constants as C
from ..wire.server import Response
from . import control, orchestrate, render, responses as RS, tokenize_routes, utility_routes
from .answers import error_response, json_response
from .errors import NOT_FOUND, UNAUTHORIZED, ProxyError, bad_request, unavailable
from .validate import CHAT, COMPLETIONS, RESPONSES

GEN_PATHS = ("/v1/completions", "/v1/chat/completions", RS.PATH)
_GEN_PATHS = GEN_PATHS
_LABELS = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT, RS.PATH: RESPONSES, "/v1/models": "models",
           "/metrics": "metrics", "/tokenize": "tokenize", render.COMPLETIONS_RENDER: "render",
           render.CHAT_RENDER: "render", C.BOX_STATUS_PATH: "status"}


def label(path: str) -> str:
    """The ``route`` label of a public path in the request counters (a bounded set: unknown paths are "other")."""
    if path in _LABELS:
        return _LABELS[path]
    if path.startswith("/v1/models/"):
        return "models"
    if path.startswith(RS.PATH + "/"):
        return "responses_get"
    return utility_routes.label(path)
_KNOWN_GET = ("/v1/models", "/health", "/ready", "/metrics")
# Answered by one engine (same model and tokenizer everywhere): a fleet router's cache_aware policy asks the
# render routes for every text request to match prompt prefixes by token ids (docs/fleet.md).
_UTILITY_PATHS = ("/tokenize", render.COMPLETIONS_RENDER, render.CHAT_RENDER)


def public(s) -> dict:
    """(method, path) -> handler(request) of the public port."""
    routes = {("GET", "/health"): partial(health, s), ("GET", "/ready"): partial(ready, s),
              ("GET", "/metrics"): partial(metrics, s), ("GET", "/v1/models"): partial(models, s),
              ("POST", "/v1/completions"): partial(orchestrate.generate, s, path="/v1/completions",
                                                   kind=COMPLETIONS),
              ("POST", "/v1/chat/completions"): partial(orchestrate.generate, s, path="/v1/chat/completions",
                                                        kind=CHAT),
              ("POST", RS.PATH): partial(orchestrate.generate, s, path=RS.PATH, kind=RESPONSES),
              ("POST", "/tokenize"): partial(tokenize_routes.tokenize, s),
              ("POST", render.COMPLETIONS_RENDER): partial(tokenize_routes.render_tokens, s),
              ("POST", render.CHAT_RENDER): partial(tokenize_routes.render_tokens, s)}
    routes.update(utility_routes.fixed(s))   # /detokenize, /version, pooling routes (utility_routes.py)
    if s.cfg.public_status:
        routes[("GET", C.BOX_STATUS_PATH)] = s.h_public_status
    return routes


def internal(s) -> dict:
    """(method, path) -> handler(request) of the loopback-only port."""
    return {("POST", C.TELEMETRY_PATH): partial(telemetry, s), ("GET", C.BOX_STATUS_PATH): partial(status, s),
            ("GET", "/health"): partial(health, s), ("GET", "/ready"): partial(ready, s),
            ("GET", "/metrics"): partial(metrics, s), ("POST", C.PROXY_DRAIN_PATH): partial(control.drain, s)}


async def health(s, request):
    return json_response({"status": "ok", "uptime_s": round(time.monotonic() - s.started, 1)})


def readiness(s) -> tuple:
    last = s.canary["last_ok"]
    if last is not None and time.monotonic() - last <= s.cfg.ready_window_s:
        return True, f"PD canary succeeded {time.monotonic() - last:.1f} s ago"
    return False, f"no successful PD canary in the last {s.cfg.ready_window_s:g} s: {s.canary['error']}"


async def ready(s, request):
    ok, why = readiness(s)
    if ok:
        return json_response({"ready": True, "reason": why, "canary_ms": s.canary["ms"]})
    return error_response(unavailable(why, "not_ready"))


async def metrics(s, request):
    s.metrics.set_backend_states(s.backends)
    return Response(s.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")


async def status(s, request):
    return json_response(s.status())


async def public_status(s, request):
    """Read-only box status for a fleet front node: the internal JSON, only with the API key."""
    if s.keyring is None:          # the door (guard.py) checked the key; without any key this stays closed
        return error_response(UNAUTHORIZED)
    return await status(s, request)


async def models(s, request):
    known = s.known_models()
    if not known:
        await asyncio.gather(*(s.watcher.models(b) for b in s.backends), return_exceptions=True)
        known = s.known_models()
    if not known:
        return error_response(unavailable("no backend answered GET /v1/models; check `pdctl status`", "no_models"))
    data = [{"id": k, "object": "model", "created": s.started_wall, "owned_by": "pdctl",
             **({"max_model_len": v} if v else {})} for k, v in sorted(known.items())]
    return json_response({"object": "list", "data": data})


async def unknown(s, request):
    routed = utility_routes.parameterised(s, request)   # /v1/models/{id}, /v1/responses/{id}[/cancel]
    if routed is not None:
        return await routed
    if request.path in _GEN_PATHS or request.path in _KNOWN_GET or request.path in _UTILITY_PATHS \
            or utility_routes.known_path(request.path):
        return error_response(ProxyError(405, f"{request.method} is not allowed on {request.path}",
                                         "invalid_request_error", "method_not_allowed"))
    return error_response(NOT_FOUND)


async def telemetry(s, request):
    try:
        event = json.loads(request.body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return error_response(bad_request("telemetry body is not JSON", code="invalid_json"))
    notified, total = s.waiter.handle(event)
    return json_response({"status": "ok", "notified": notified, "total": total})
