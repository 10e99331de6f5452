"""Route tables for the twin's HTTP surfaces on the wire server (appliance/wire/server.py).

The twin's engine and KV server answer fixed paths. Unknown paths and methods are answered as the twin always
answered them (its earlier aiohttp surface, which the proxy's tests know): ``404: Not Found`` and
``405: Method Not Allowed`` as text, the latter with ``Allow``; a GET route answers HEAD too (the server leaves
the body out). Kept apart from the wire layer because only the twin needs it: the proxy has its own routes.
"""
from __future__ import annotations

import json
from typing import Awaitable, Callable, Optional

from ..wire.server import Request, Response

JSON_TYPE = "application/json; charset=utf-8"
TEXT_TYPE = "text/plain; charset=utf-8"
Handler = Callable[[Request], Awaitable[Optional[Response]]]


def json_response(obj, status: int = 200) -> Response:
    return Response(json.dumps(obj).encode(), status, content_type=JSON_TYPE)


def empty(status: int = 200) -> Response:
    """A status without a body or a Content-Type (vLLM's /health)."""
    r = Response(b"", status)
    del r.headers["Content-Type"]
    return r


def remote(request: Request) -> str:
    """The client's address ("" when unknown)."""
    t = request.conn.transport
    peer = t.get_extra_info("peername") if t is not None else None
    return str(peer[0]) if peer else ""


def is_loopback(request: Request) -> bool:
    return remote(request) in ("127.0.0.1", "::1", "localhost")


class Routes:
    """(method, path) -> handler; ``dispatch`` is a wire Server's dispatch."""

    def __init__(self) -> None:
        self.table: dict[tuple[str, str], Handler] = {}
        self.allowed: dict[str, set] = {}

    def add(self, method: str, path: str, handler: Handler) -> None:
        methods = (method, "HEAD") if method == "GET" else (method,)
        for m in methods:
            self.table.setdefault((m, path), handler)
            self.allowed.setdefault(path, set()).add(m)

    def get(self, path: str, handler: Handler) -> None:
        self.add("GET", path, handler)

    def post(self, path: str, handler: Handler) -> None:
        self.add("POST", path, handler)

    async def dispatch(self, request: Request) -> Optional[Response]:
        handler = self.table.get((request.method, request.path))
        if handler is not None:
            return await handler(request)
        allowed = self.allowed.get(request.path)
        if allowed is None:
            return Response(b"404: Not Found", 404, content_type=TEXT_TYPE)
        return Response(b"405: Method Not Allowed", 405, {"Allow": ",".join(sorted(allowed))},
                        content_type=TEXT_TYPE)
