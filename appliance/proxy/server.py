"""A lean HTTP/1.1 server for the proxy's ports (httptools parser, asyncio/uvloop protocol).

Why not aiohttp's server: without it the whole proxy used ~15 % less CPU per request (benchmarks/README.md,
"Proxy overhead"). What it does: keep-alive and pipelining (one request at
a time per connection), ``Expect: 100-continue``, Content-Length and chunked request bodies with a size
limit (413 before reading it all), header limits (431), malformed input -> 400 and close. A client that
goes away cancels its handler task, which closes the upstream legs with it.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from http import HTTPStatus

import httptools

log = logging.getLogger("pdctl.proxy")
_MAX_HEADER_BYTES = 64 * 1024
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


def _head(status: int, headers: dict, extra: bytes) -> bytes:
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))]
    for k, v in headers.items():
        lines.append(f"{k}: {v}\r\n".encode("latin-1", "replace"))
    lines.append(extra)
    lines.append(b"\r\n")
    return b"".join(lines)


class Response:
    __slots__ = ("status", "body", "headers")

    def __init__(self, body: bytes = b"", status: int = 200, headers: dict | None = None,
                 content_type: str = "application/json"):
        self.status, self.body = status, body
        self.headers = headers if headers is not None else {}
        self.headers.setdefault("Content-Type", content_type)


class Request:
    __slots__ = ("method", "path", "query", "headers", "body", "conn", "keep_alive", "_head_pending", "started",
                 "chunked")

    def __init__(self, conn, method: str, url: bytes, headers: dict, body: bytes, keep_alive: bool,
                 http10: bool = False):
        self.conn, self.method, self.headers, self.body, self.keep_alive = conn, method, headers, body, keep_alive
        self.chunked = not http10          # HTTP/1.0 clients get the raw stream, ended by closing
        if http10:
            self.keep_alive = False
        raw = url.decode("latin-1")
        path, _, self.query = raw.partition("?")
        self.path = path
        self._head_pending = None
        self.started = False      # a streamed answer has begun: its status can no longer change

    # --- streamed answers ---------------------------------------------------------------------
    def stream(self, status: int, headers: dict) -> None:
        """Begin a chunked answer; the head goes out with the first write (one send for both)."""
        extra = (b"Transfer-Encoding: chunked\r\n" if self.chunked else b"") + \
            (b"" if self.keep_alive else b"Connection: close\r\n")
        self._head_pending = _head(status, headers, extra)
        self.started = True

    def _frame(self, data: bytes) -> bytes:
        if not data:
            return b""
        return b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data

    async def write(self, data: bytes) -> None:
        out = self._frame(data)
        if self._head_pending is not None:
            out, self._head_pending = self._head_pending + out, None
        if out:
            await self.conn.send(out)

    async def end(self, data: bytes = b"") -> None:
        out = self._frame(data) + (b"0\r\n\r\n" if self.chunked else b"")
        if self._head_pending is not None:
            out, self._head_pending = self._head_pending + out, None
        await self.conn.send(out)


class _Conn(asyncio.Protocol):
    def __init__(self, server):
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport = None
        self.closed = False
        self.queue: deque = deque()
        self.task: asyncio.Task | None = None
        self.write_paused = False
        self.drain_waiter: asyncio.Future | None = None
        self.dead = False         # answered with an error and closing: ignore whatever else arrives
        self._reset_message()

    def _reset_message(self):
        self.url = b""
        self.headers: dict = {}
        self.header_bytes = 0
        self.body_parts: list = []
        self.body_len = 0
        self.rejected = False

    # --- transport callbacks ------------------------------------------------------------------
    def connection_made(self, transport):
        self.transport = transport
        self.server.conns.add(self)

    def connection_lost(self, exc):
        self.closed = True
        self.server.conns.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.drain_waiter is not None and not self.drain_waiter.done():
            self.drain_waiter.set_exception(ConnectionResetError("client went away"))

    def pause_writing(self):
        self.write_paused = True

    def resume_writing(self):
        self.write_paused = False
        if self.drain_waiter is not None and not self.drain_waiter.done():
            self.drain_waiter.set_result(None)

    def data_received(self, data):
        if self.dead:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as e:
            self._reject(400, f"malformed HTTP request ({str(e)[:80]})")

    # --- parser callbacks ---------------------------------------------------------------------
    def on_message_begin(self):
        self._reset_message()

    def on_url(self, url):
        self.url += url
        if len(self.url) > 16 * 1024:
            self._reject(414, "request URL too long")

    def on_header(self, name, value):
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > _MAX_HEADER_BYTES:
            self._reject(431, "request headers larger than 64 KiB")
            return
        k = name.decode("latin-1").lower()
        v = value.decode("latin-1")
        self.headers[k] = self.headers[k] + ", " + v if k in self.headers else v

    def on_headers_complete(self):
        if self.rejected:
            return
        cl = self.headers.get("content-length")
        if cl is not None and cl.strip().isdigit() and int(cl) > self.server.max_body:
            self._reject(413, f"request body is larger than the proxy's limit of {self.server.max_body} bytes; "
                              "shorten the prompt or raise --max-body-bytes", code="body_too_large")
            return
        if self.headers.get("expect", "").lower() == "100-continue":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body):
        if self.rejected:
            return
        self.body_len += len(body)
        if self.body_len > self.server.max_body:
            self._reject(413, f"request body is larger than the proxy's limit of {self.server.max_body} bytes; "
                              "shorten the prompt or raise --max-body-bytes", code="body_too_large")
            return
        self.body_parts.append(body)

    def on_message_complete(self):
        if self.rejected or self.dead:
            return
        method = self.parser.get_method().decode("latin-1")
        body = self.body_parts[0] if len(self.body_parts) == 1 else b"".join(self.body_parts)
        req = Request(self, method, self.url, self.headers, body, self.parser.should_keep_alive(),
                      self.parser.get_http_version() == "1.0")
        self.queue.append(req)
        if self.task is None:
            self.task = self.server.loop.create_task(self._serve())
        if len(self.queue) > 32:
            self.transport.pause_reading()   # a client pipelining this deep waits for answers first

    # --- serving ------------------------------------------------------------------------------
    def _reject(self, status: int, message: str, code: str = "invalid_request") -> None:
        """Answer at once and close: the rest of this connection's bytes cannot be trusted."""
        if self.rejected or self.dead:
            return
        self.rejected = self.dead = True
        body = self.server.error_body(status, message, code)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_head(status, {"Content-Type": "application/json", "Content-Length": len(body)},
                                       b"Connection: close\r\n") + body)
            self.transport.close()

    async def send(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("client went away")
        self.transport.write(data)
        if self.write_paused:
            self.drain_waiter = self.server.loop.create_future()
            await self.drain_waiter

    async def _serve(self):
        try:
            while self.queue and not self.closed:
                req = self.queue.popleft()
                if self.transport.is_reading() is False and len(self.queue) <= 32 and not self.closed:
                    self.transport.resume_reading()
                try:
                    resp = await self.server.dispatch(req)
                except (ConnectionResetError, BrokenPipeError):
                    return
                except Exception as e:  # noqa: BLE001 - a handler bug still answers, in OpenAI's shape
                    log.exception("handler failed for %s %s", req.method, req.path)
                    if req.started:
                        self.transport.close()
                        return
                    body = self.server.error_body(500, f"proxy internal error ({type(e).__name__})",
                                                  "internal_error")
                    resp = Response(body, 500)
                if resp is not None and not self.closed:
                    body = resp.body
                    hdrs = resp.headers
                    hdrs["Content-Length"] = len(body)
                    extra = b"" if req.keep_alive else b"Connection: close\r\n"
                    self.transport.write(_head(resp.status, hdrs, extra) + body)
                if not req.keep_alive:
                    self.transport.close()
                    return
        finally:
            self.task = None
            if self.queue and not self.closed:
                self.task = self.server.loop.create_task(self._serve())


class LeanServer:
    def __init__(self, dispatch, error_body, max_body: int):
        self.dispatch, self.error_body, self.max_body = dispatch, error_body, max_body
        self.loop = None
        self.server = None
        self.conns: set = set()

    async def start(self, host: str, port: int) -> int:
        self.loop = asyncio.get_running_loop()
        self.server = await self.loop.create_server(lambda: _Conn(self), host, port, backlog=2048,
                                                    reuse_address=True)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for c in list(self.conns):
                if c.transport is not None:
                    c.transport.close()
            try:
                await asyncio.wait_for(self.server.wait_closed(), 2.0)
            except asyncio.TimeoutError:
                pass
