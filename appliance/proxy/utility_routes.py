"""The engines' other routes through :9000: answered by one engine, with the same key and body checks as /v1.

- ``POST /detokenize``, ``GET /version``: forwarded to the least busy healthy engine (every engine behind the
  proxy serves the same model and tokenizer), retried on another before an answer.
- ``POST /v1/embeddings``, ``/v2/embed``, ``/pooling``, ``/classify``, ``/score``, ``/v1/score``, ``/rerank``,
  ``/v1/rerank``, ``/v2/rerank``, ``/v1/responses/render``: forwarded the same way; the engine's own answer goes
  back. A generative model's engine does not register the pooling routes, so it answers FastAPI's bare
  ``{"detail": "Not Found"}``: that 404 keeps its status and words, in OpenAI's error shape (legs.py).
- ``GET /v1/models/{id}``: vLLM (0.32) serves only the list, so the proxy answers from what the engines
  report on ``GET /v1/models`` (the same card as the list), or 404 ``model_not_found``.
- ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``: sent to the engine that holds the stored
  response (stored_responses.locate), never to another.
"""
from __future__ import annotations

import asyncio
import json
from urllib.parse import unquote

from ..wire.server import Response
from . import responses as RS
from . import stored_responses as SR
from .answers import client_request_id, error_response
from .errors import ProxyError, bad_request
from .telemetry import new_request_id

DETOKENIZE, VERSION = "/detokenize", "/version"
POOLING_PATHS = ("/v1/embeddings", "/v2/embed", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
                 "/v1/rerank", "/v2/rerank")
FORWARDED = POOLING_PATHS + ("/v1/responses/render",)
MODELS_PREFIX = "/v1/models/"
RESPONSES_PREFIX = RS.PATH + "/"
MAX_DETOKENIZE = 1 << 20


def checked_body(s, request, route: str):
    """Checks shared by /tokenize and the render routes (key, JSON object, served model): (body, None) or
    (None, the 4xx answer)."""
    crid = client_request_id(request)
    try:
        body = json.loads(request.body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        body = None
    if not isinstance(body, dict):
        s._count(route, "client_error")
        return None, error_response(bad_request(f"the body of POST {request.path} must be a JSON object",
                                                code="invalid_json"), crid)
    model = body.get("model")
    models = s.known_models()
    if model is not None and models and model not in models:
        s._count(route, "client_error")
        return None, error_response(ProxyError(404, f"model {str(model)[:200]!r} is not served here; served: "
                                                    f"{', '.join(sorted(models))}", "invalid_request_error",
                                               "model_not_found", "model"), crid)
    return body, None


def _answer(server, route: str, out, rid: str) -> Response:
    """An engine's answer (Passthrough: a refusal already in OpenAI's shape, legs.py) or the proxy's error, counted."""
    if isinstance(out, ProxyError):
        server._count(route, "unavailable" if out.status == 503 else "upstream_error")
        return error_response(out, rid)
    server._count(route, "ok" if out.status == 200 else "client_error")
    return Response(out.body, out.status, {"Content-Type": out.content_type, "X-Request-Id": rid})


# ----- fixed paths ---------------------------------------------------------------------------------------
def _forward(path: str, route: str, check=None):
    async def handler(server, request):
        body, refused = checked_body(server, request, route)
        if refused is not None:
            return refused
        rid = client_request_id(request) or new_request_id()
        if check is not None:
            err = check(body)
            if err is not None:
                server._count(route, "client_error")
                return error_response(err, rid)
        return _answer(server, route, await server.legs.utility(path, request.body, rid), rid)
    return handler


def _check_detokenize(body: dict) -> ProxyError | None:
    toks = body.get("tokens")
    if not isinstance(toks, list) or len(toks) > MAX_DETOKENIZE or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in toks):
        return bad_request("'tokens' must be a list of token ids (integers >= 0), e.g. {\"tokens\": [1, 2, 3]}",
                           param="tokens", code="invalid_type")
    return None


async def _version(server, request):
    rid = client_request_id(request) or new_request_id()
    return _answer(server, "version", await server.legs.utility(VERSION, b"", rid, "GET"), rid)


def label(path: str) -> str:
    """The counters' route label of a forwarded path ("other" for a path no route serves)."""
    if path == DETOKENIZE:
        return "detokenize"
    if path == VERSION:
        return "version"
    if path in POOLING_PATHS:
        return "pooling"
    return "render" if path in FORWARDED else "other"


def fixed(server) -> dict:
    """(method, path) -> handler, for the proxy's route table."""
    def bind(fn):
        async def h(request):
            return await fn(server, request)
        return h
    routes = {("POST", DETOKENIZE): bind(_forward(DETOKENIZE, "detokenize", _check_detokenize)),
              ("GET", VERSION): bind(_version)}
    for p in FORWARDED:
        routes[("POST", p)] = bind(_forward(p, "pooling" if p in POOLING_PATHS else "render"))
    return routes


# ----- paths with a parameter ------------------------------------------------------------------------------
async def _model_card(server, request, model: str):
    rid = client_request_id(request)
    models = server.known_models()
    if not models:
        await asyncio.gather(*(server.watcher.models(b) for b in server.backends), return_exceptions=True)
        models = server.known_models()
    if model not in models:
        server._count("models", "client_error")
        served = ", ".join(sorted(models)) or "none yet (no engine answered GET /v1/models)"
        return error_response(ProxyError(404, f"model {model[:200]!r} is not served here; served: {served}",
                                 "invalid_request_error", "model_not_found", "model"), rid)
    server._count("models", "ok")
    mml = models[model]
    card = {"id": model, "object": "model", "created": server.started_wall, "owned_by": "pdctl",
            **({"max_model_len": mml} if mml else {})}
    return Response(json.dumps(card).encode(), 200, {"X-Request-Id": rid} if rid else None)


async def _stored(server, request, resp_id: str, suffix: str):
    """GET /v1/responses/{id} or POST /v1/responses/{id}/cancel, on the engine that holds the response."""
    route = "responses_cancel" if suffix else "responses_get"
    rid = client_request_id(request) or new_request_id()
    if not RS.ID_RE.fullmatch(resp_id):
        server._count(route, "client_error")
        return error_response(bad_request("the response id in the path must be letters, digits and _.:- (e.g. "
                                  "resp_abc123)", param="response_id", code="invalid_type"), rid)
    query = request.query or ""
    if not suffix and "stream=true" in query.lower():
        server._count(route, "client_error")
        return error_response(bad_request("streamed retrieval (stream=true) of a background response is not served "
                                  "through the proxy; poll GET /v1/responses/{id} without stream",
                                  param="stream", code="unsupported"), rid)
    home = await SR.locate(server, resp_id, rid)
    path = f"{RS.PATH}/{resp_id}{suffix}" + (f"?{query}" if query and not suffix else "")
    method = "POST" if suffix else "GET"
    only = None if home is None else (home,)     # nobody holds it: any one engine answers (its own 404)
    out = await server.legs.utility(path, request.body if suffix else b"", rid, method, only=only)
    return _answer(server, route, out, rid)


def parameterised(server, request):
    """The coroutine answering a path with a parameter, or None (the path is not one of them)."""
    path, method = request.path, request.method
    if path.startswith(MODELS_PREFIX) and method == "GET" and len(path) > len(MODELS_PREFIX):
        return _model_card(server, request, unquote(path[len(MODELS_PREFIX):]))
    if path.startswith(RESPONSES_PREFIX):
        rest = path[len(RESPONSES_PREFIX):]
        if rest.endswith("/cancel") and method == "POST" and "/" not in rest[:-7] and rest[:-7]:
            return _stored(server, request, rest[:-7], "/cancel")
        if method == "GET" and rest and "/" not in rest:
            return _stored(server, request, rest, "")
    return None


def known_path(path: str) -> bool:
    """Served here with another method (the caller answers 405, not 404)."""
    return (path in (DETOKENIZE, VERSION) or path in FORWARDED or path.startswith(MODELS_PREFIX)
            or path.startswith(RESPONSES_PREFIX))


# ----- what clients ask for (status "features", read by pdctl doctor) ---------------------------------------
def features(body: dict):
    """Request features worth counting: tools (a tool-call parser must be set), structured output, logprobs,
    several choices, engine-held state."""
    if body.get("tools") and body.get("tool_choice") != "none":
        yield "tools"
    rf, text = body.get("response_format"), body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if body.get("structured_outputs") or any(isinstance(f, dict) and f.get("type") not in (None, "text")
                                             for f in (rf, fmt)):
        yield "structured_output"
    if body.get("logprobs") or body.get("top_logprobs"):
        yield "logprobs"
    if body.get("previous_response_id"):
        yield "previous_response_id"
