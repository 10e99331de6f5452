"""Benchmark-only adapters: the proxy's own logic (ProxyServer routes, legs, relay) behind other HTTP libraries.

Used by ``benchmarks/wire_choice.py`` to measure the wire layer (issue 22) and nothing else: production code
never imports this. Two seams are swapped, everything else is the shipped proxy:

* the front server: ``lean`` (appliance/proxy/server.py, as shipped), ``uvicorn`` (httptools + uvloop, a raw
  ASGI app, no framework; keep-alive timeout and max connections from [listener]), ``uvicorn-limits`` (the same
  plus a protocol subclass for the head timeout and head size limit uvicorn lacks), ``granian-rsgi`` and
  ``granian-asgi`` (granian's own CLI, one worker, uvloop);
* the legs' client: ``lean`` (appliance/proxy/upstream.Pool), ``httpx`` (AsyncClient) or ``aiohttp``
  (ClientSession), each behind the small surface the proxy uses (request -> conn with status, headers,
  read, read_all, complete, release, close, fail).

For equivalence with the lean server, each library front also watches for the client going away (one task
per request) and cancels the handler, as the lean server does on connection_lost; ``PDCTL_WIRE_NOWATCH=1``
leaves that out to show what the watch costs.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from appliance.proxy import cli as proxy_cli, routes  # noqa: E402
from appliance.proxy.answers import error_body as _error_body  # noqa: E402
from appliance.proxy.app import ProxyServer  # noqa: E402
from appliance.wire.server import Response  # noqa: E402
from wire_clients import install_client  # noqa: E402

log = logging.getLogger("pdctl.proxy")
FRONTS = ("lean", "uvicorn", "uvicorn-limits", "granian-rsgi", "granian-asgi")


# ============================================================================ the proxy core
def build_proxy(listen_port: int, prefill: str, decode: str, client: str) -> ProxyServer:
    """The proxy exactly as ``pdctl proxy --prefill P --decode D --pd-min-prompt-tokens 0`` builds it."""
    import argparse
    ap = argparse.ArgumentParser()
    proxy_cli.register(ap.add_subparsers())
    args = ap.parse_args(["proxy", "--listen", f"127.0.0.1:{listen_port}", "--internal", "127.0.0.1:0",
                          "--prefill", prefill, "--decode", decode, "--pd-min-prompt-tokens", "0"])
    server = ProxyServer(proxy_cli.config_from_args(args))
    install_client(server, client)
    return server


async def start_core(server: ProxyServer, listen: bool) -> None:
    """ProxyServer.start as shipped; for a library front its own listeners are left out."""
    if not listen:
        async def no_listener(routes, host, port, max_body):
            return port
        server._listen = no_listener
    await server.start()


async def dispatch(server: ProxyServer, req):
    """The lean server's dispatch and handler-failure policy (500 in OpenAI's shape, or close once started)."""
    try:
        return await server._public.get((req.method, req.path), lambda r: routes.unknown(server, r))(req)
    except (ConnectionResetError, BrokenPipeError):
        return None
    except Exception as e:  # noqa: BLE001
        log.exception("handler failed for %s %s", req.method, req.path)
        if req.started:
            raise
        return Response(_error_body(500, f"proxy internal error ({type(e).__name__})", "internal_error"), 500)


async def dispatch_watched(server: ProxyServer, req, disconnected):
    """``dispatch``, cancelled when ``disconnected()`` returns first (the client went away, as the lean server's
    connection_lost does); None then, and when ``disconnected`` is None the request is not watched."""
    if disconnected is None:
        return await dispatch(server, req)
    me = asyncio.current_task()

    async def gone():
        await disconnected()
        if not req.done:
            me.cancel()
    w = asyncio.get_running_loop().create_task(gone())
    try:
        return await dispatch(server, req)
    except asyncio.CancelledError:
        return None
    finally:
        w.cancel()


def merged_headers(pairs) -> dict:
    """Request headers by lower-case name, repeated ones joined with ", " (as the lean server reads them)."""
    h: dict = {}
    for k, v in pairs:
        k = k.lower()
        h[k] = h[k] + ", " + v if k in h else v
    return h


def _too_large(max_body: int) -> Response:
    """413 and close, as the lean server does: the rest of the body is not read."""
    return Response(_error_body(413, f"request body is larger than the proxy's limit of {max_body} bytes",
                                "body_too_large"), 413, {"Connection": "close"})


# ============================================================================ ASGI front (uvicorn, granian)
class AsgiRequest:
    __slots__ = ("method", "path", "query", "headers", "body", "started", "keep_alive", "done", "_send",
                 "_start")

    def __init__(self, scope, body: bytes, send):
        self.method, self.path, self.body, self._send = scope["method"], scope["path"], body, send
        self.query = scope.get("query_string", b"").decode("latin-1")
        h = merged_headers((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"])
        self.headers, self.started, self.keep_alive, self.done, self._start = h, False, True, False, None

    def stream(self, status: int, headers: dict) -> None:
        self._start = {"type": "http.response.start", "status": status,
                       "headers": [(k.encode("latin-1"), str(v).encode("latin-1")) for k, v in headers.items()]}
        self.started = True

    async def _out(self, msg) -> None:
        try:
            await self._send(msg)
        except (OSError, RuntimeError) as e:   # granian: the client went away
            raise ConnectionResetError(str(e)) from None

    async def write(self, data: bytes) -> None:
        if self._start is not None:
            start, self._start = self._start, None
            await self._out(start)
        if data:
            await self._out({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        self.done = True
        if self._start is not None:
            start, self._start = self._start, None
            await self._out(start)
        await self._out({"type": "http.response.body", "body": data, "more_body": False})


class AsgiApp:
    """A raw ASGI 3 app (no framework) around ProxyServer; lifespan starts the proxy core."""

    def __init__(self, server: ProxyServer, watch: bool = True):
        self.s, self.watch, self.max_body = server, watch, server.cfg.max_body_bytes

    async def _lifespan(self, receive, send):
        while True:
            m = await receive()
            if m["type"] == "lifespan.startup":
                await start_core(self.s, listen=False)
                await send({"type": "lifespan.startup.complete"})
            elif m["type"] == "lifespan.shutdown":
                await self.s.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        for k, v in scope["headers"]:
            if k.lower() == b"content-length" and v.isdigit() and int(v) > self.max_body:
                return await self._send_resp(AsgiRequest(scope, b"", send), _too_large(self.max_body))
        body, more = b"", True
        while more:
            m = await receive()
            if m["type"] == "http.disconnect":
                return
            body += m.get("body", b"")
            more = m.get("more_body", False)
            if len(body) > self.max_body:
                return await self._send_resp(AsgiRequest(scope, b"", send), _too_large(self.max_body))
        req = AsgiRequest(scope, body, send)

        async def disconnected():
            while (await receive())["type"] != "http.disconnect":
                pass
        resp = await dispatch_watched(self.s, req, disconnected if self.watch else None)
        if resp is not None:
            await self._send_resp(req, resp)

    @staticmethod
    async def _send_resp(req, resp) -> None:
        req.done = True
        h = [(k.encode("latin-1"), str(v).encode("latin-1")) for k, v in resp.headers.items()]
        h.append((b"content-length", str(len(resp.body)).encode()))
        try:
            await req._send({"type": "http.response.start", "status": resp.status, "headers": h})
            await req._send({"type": "http.response.body", "body": resp.body, "more_body": False})
        except (OSError, RuntimeError):
            pass


# ============================================================================ RSGI front (granian)
class RsgiRequest:
    __slots__ = ("method", "path", "query", "headers", "body", "started", "keep_alive", "done", "_proto",
                 "_status", "_hdrs", "_t")

    def __init__(self, scope, proto, body: bytes):
        self.method, self.path, self.query, self.body = scope.method, scope.path, scope.query_string, body
        h = merged_headers(scope.headers.items())
        self.headers, self._proto, self.started, self.keep_alive, self.done, self._t = h, proto, False, True, \
            False, None

    def stream(self, status: int, headers: dict) -> None:
        self._status, self._hdrs, self.started = status, [(k, str(v)) for k, v in headers.items()], True

    async def write(self, data: bytes) -> None:
        if self._t is None:
            self._t = self._proto.response_stream(self._status, self._hdrs)
        if data:
            try:
                await self._t.send_bytes(data)
            except (OSError, RuntimeError) as e:   # RSGIProtocolClosed: the client went away
                raise ConnectionResetError(str(e)) from None

    async def end(self, data: bytes = b"") -> None:
        self.done = True
        await self.write(data)        # the stream ends when the handler returns


class RsgiApp:
    def __init__(self, server: ProxyServer, watch: bool = True):
        self.s, self.watch, self.max_body = server, watch, server.cfg.max_body_bytes

    def __rsgi_init__(self, loop):
        loop.run_until_complete(start_core(self.s, listen=False))

    def __rsgi_del__(self, loop):
        loop.run_until_complete(self.s.stop())

    async def __rsgi__(self, scope, proto):
        if scope.proto != "http":
            return
        cl = scope.headers.get("content-length")
        if cl and cl.isdigit() and int(cl) > self.max_body:
            return self._resp(proto, _too_large(self.max_body))
        body = await proto()
        req = RsgiRequest(scope, proto, body)
        resp = await dispatch_watched(self.s, req, proto.client_disconnect if self.watch else None)
        if resp is not None:
            self._resp(proto, resp)

    @staticmethod
    def _resp(proto, resp) -> None:
        h = [(k, str(v)) for k, v in resp.headers.items()]
        h.append(("content-length", str(len(resp.body))))
        proto.response_bytes(resp.status, h, resp.body)


# ============================================================================ granian targets (its CLI imports these)
def _from_env(kind):
    spec = json.loads(os.environ["PDCTL_WIRE_SPEC"])
    server = build_proxy(spec["port"], spec["prefill"], spec["decode"], spec["client"])
    return kind(server, watch=os.environ.get("PDCTL_WIRE_NOWATCH") != "1")


def rsgi_app():
    """granian --factory benchmarks.wire_adapters:rsgi_app"""
    return _from_env(RsgiApp)


def asgi_app():
    """granian --factory --interface asgi benchmarks.wire_adapters:asgi_app"""
    return _from_env(AsgiApp)


# ============================================================================ in-process fronts
async def serve_lean(server: ProxyServer) -> None:
    await start_core(server, listen=True)
    await asyncio.Event().wait()


def limited_httptools(header_timeout_s: float, max_header_bytes: int):
    """uvicorn's httptools protocol plus two [listener] limits it lacks (Config(http=<class>) takes a protocol
    class): the request head must arrive whole within ``header_timeout_s`` (a new connection's first head too,
    so idle and slow-header connections are closed), and request line + headers over ``max_header_bytes`` get
    431. Overrides uvicorn internals (connection_made, on_message_begin, on_url, on_header,
    on_headers_complete, send_400_response): pinned to the uvicorn version measured."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class LimitedHttpTools(HttpToolsProtocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._head_bytes, self._refused = 0, False
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_late)

        def _head_late(self):
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc):
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def on_message_begin(self):
            super().on_message_begin()
            self._head_bytes = 0
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_late)

        def _count(self, n: int) -> None:
            self._head_bytes += n
            if self._head_bytes > max_header_bytes and not self._refused:
                self._refused = True
                body = _error_body(431, f"request headers larger than {max_header_bytes} bytes", "invalid_request")
                self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: "
                                     b"application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                                     % (len(body), body))
                self.transport.close()
                raise ValueError("request head too large")     # stops the parser (HttpParserCallbackError)

        def on_url(self, url):
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name, value):
            self._count(len(name) + len(value))
            super().on_header(name, value)

        def on_headers_complete(self):
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().on_headers_complete()

        def send_400_response(self, msg):
            if not self._refused:
                super().send_400_response(msg)

    return LimitedHttpTools


async def serve_uvicorn(server: ProxyServer, port: int, watch: bool, limits: bool = False) -> None:
    import uvicorn
    cfg = server.cfg
    http = limited_httptools(cfg.header_timeout_s, cfg.max_header_bytes) if limits else "httptools"
    ucfg = uvicorn.Config(AsgiApp(server, watch), host="127.0.0.1", port=port, http=http, loop="none",
                          lifespan="on", ws="none", access_log=False, log_level="warning", backlog=2048,
                          timeout_keep_alive=int(cfg.keepalive_timeout_s), limit_concurrency=cfg.max_connections)
    await uvicorn.Server(ucfg).serve()
