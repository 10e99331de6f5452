"""Errors as values in OpenAI's error shape, so every refusal a client sees says what, where and how to fix."""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ProxyError:
    status: int          # HTTP status the client gets
    message: str         # what went wrong and how to fix it
    type: str            # OpenAI error type: invalid_request_error, authentication_error, service_unavailable ...
    code: str            # stable machine-readable reason, e.g. "no_decoder", "body_too_large"
    param: str | None = None   # the request field at fault, when there is one

    def payload(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body(self) -> bytes:
        return json.dumps(self.payload()).encode()

    def sse(self) -> bytes:
        """The SSE event that ends a stream which already started: never followed by ``[DONE]``."""
        return b"data: " + self.body() + b"\n\n"


def engine_refusal(status: int, raw: bytes, method: str, path: str) -> bytes | None:
    """An engine's 4xx in OpenAI's shape: None when it already is one (vLLM's own errors), else its words wrapped:
    FastAPI's bare ``{"detail": "Not Found"}`` for a route the engine did not register, a plain-text 404 (the
    twin), or any other body."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        return None
    said = obj.get("detail") if isinstance(obj, dict) and "detail" in obj else raw[:200].decode("utf-8", "replace")
    if status in (404, 405):
        msg = (f"the engines do not serve {method} {path}: they answered {status} {said!r} (vLLM registers "
               "embeddings, rerank, score, classify and pooling only for a pooling model, the generation routes "
               "only for a generative one; README: OpenAI compatibility)")
        return ProxyError(status, msg, "invalid_request_error", "route_not_served").body()
    return ProxyError(status, f"the engine refused {method} {path}: {status} {said!r}", "invalid_request_error",
                      "engine_refused").body()


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ProxyError:
    return ProxyError(400, message, "invalid_request_error", code, param)


def unavailable(message: str, code: str) -> ProxyError:
    return ProxyError(503, message, "service_unavailable", code)


def upstream_failed(message: str, code: str = "upstream_error") -> ProxyError:
    return ProxyError(502, message, "upstream_error", code)


UNAUTHORIZED = ProxyError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (the key in the "
                               "proxy's --api-key-file)", "authentication_error", "invalid_api_key")
NOT_FOUND = ProxyError(404, "no such route: the proxy serves /v1/models[/{id}], /v1/completions, "
                            "/v1/chat/completions, /v1/responses (and /v1/responses/{id}[/cancel]), "
                            "/v1/completions/render, /v1/chat/completions/render, /tokenize, /detokenize, /version, "
                            "the pooling routes (/v1/embeddings, /v1/rerank, /v1/score ...), /health, /ready, "
                            "/metrics (README: OpenAI compatibility)", "invalid_request_error", "not_found")
