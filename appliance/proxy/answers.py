"""The proxy's answers in OpenAI's shape and the client request id every route echoes (keys: guard.py)."""
from __future__ import annotations

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
