"""``POST /tokenize`` and the render routes (``/v1/completions/render``, ``/v1/chat/completions/render``): what a
fleet router's cache_aware policy asks each box before it routes, answered from one engine's /tokenize
(render.py plans the asks and shapes the answer; docs/fleet.md)."""
from __future__ import annotations

import asyncio
import json

from ..wire.server import Response
from . import render
from .answers import client_request_id, error_response, json_response
from .errors import ProxyError, bad_request, upstream_failed
from .legs import Passthrough
from .telemetry import new_request_id
from .utility_routes import checked_body


async def tokenize(s, request):
    """POST /tokenize: checked like /v1, then forwarded as-is to one engine."""
    body, refused = checked_body(s, request, "tokenize")
    if refused is not None:
        return refused
    crid = client_request_id(request)
    if ("prompt" in body) == ("messages" in body):
        s._count("tokenize", "client_error")
        return error_response(bad_request("POST /tokenize needs exactly one of 'prompt' (text or token ids) "
                                          "or 'messages' (chat)", param="prompt", code="missing_prompt"), crid)
    checked = render.plan(render.CHAT_RENDER if "messages" in body else render.COMPLETIONS_RENDER, body)
    if isinstance(checked, ProxyError):          # the same shape checks as the render routes
        s._count("tokenize", "client_error")
        return error_response(checked, crid)
    rid = new_request_id()
    out = await s.legs.utility("/tokenize", request.body, rid)
    if isinstance(out, ProxyError):
        s._count("tokenize", "unavailable" if out.status == 503 else "upstream_error")
        return error_response(out, crid or rid)
    s._count("tokenize", "ok" if out.status == 200 else "client_error")
    return Response(out.body, out.status, {"Content-Type": out.content_type, "X-Request-Id": crid or rid})

async def render_tokens(s, request):
    """POST /v1/completions/render and /v1/chat/completions/render, answered from the engines' /tokenize
    (see render.py): what a fleet router's cache_aware policy asks each box before it routes."""
    route = "render"
    body, refused = checked_body(s, request, route)
    if refused is not None:
        return refused
    crid = client_request_id(request)
    rid = crid or new_request_id()
    asks = render.plan(request.path, body)
    if isinstance(asks, ProxyError):
        s._count(route, "client_error")
        return error_response(asks, rid)

    async def one(ask):
        if isinstance(ask, list):
            return ask
        out = await s.legs.utility("/tokenize", json.dumps(ask).encode(), rid)
        if isinstance(out, ProxyError) or out.status != 200:
            return out
        try:
            return render.token_ids(json.loads(out.body))
        except (ValueError, UnicodeDecodeError):
            return upstream_failed(f"/tokenize answered a body that is not JSON: {out.body[:120]!r}")

    got = await asyncio.gather(*(one(a) for a in asks))
    for g in got:
        if isinstance(g, ProxyError):
            s._count(route, "client_error" if g.status < 500 else
                        ("unavailable" if g.status == 503 else "upstream_error"))
            return error_response(g, rid)
        if isinstance(g, Passthrough):            # the engine refused the prompt (4xx): its words
            s._count(route, "client_error")
            return Response(g.body, g.status, {"Content-Type": g.content_type, "X-Request-Id": rid})
    s._count(route, "ok")
    return json_response(render.response(request.path, rid, got))

