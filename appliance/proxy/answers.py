"""The proxy's answers in OpenAI's shape and the checks every route shares (API key, client request id)."""
from __future__ import annotations

import hmac
import json

from ..wire.server import Response
from .errors import ProxyError


def json_response(obj, status: int = 200) -> Response:
    return Response(json.dumps(obj).encode(), status)


def error_response(err: ProxyError, request_id: str | None = None) -> Response:
    return Response(err.body(), err.status, {"X-Request-Id": request_id} if request_id else None)


def error_body(status: int, message: str, code: str) -> bytes:
    kind = "invalid_request_error" if status < 500 else "service_unavailable" if status == 503 else "internal_error"
    return ProxyError(status, message, kind, code).body()


def client_request_id(request) -> str | None:
    v = request.headers.get("x-request-id")
    if v and len(v) <= 128 and v.isprintable() and v.isascii():
        return v
    return None




def authorized(cfg, request) -> bool:
    """The client sent the API key as Bearer (always true when no key is configured)."""
    if not cfg.api_key:
        return True
    got = request.headers.get("authorization", "")
    return got.startswith("Bearer ") and hmac.compare_digest(got[7:].strip().encode("utf-8", "replace"),
                                                             cfg.api_key.encode())
