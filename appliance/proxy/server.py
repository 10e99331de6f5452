"""A lean HTTP/1.1 server for the proxy's ports (httptools parser, asyncio/uvloop protocol).

Why not aiohttp's server: without it the whole proxy used ~15 % less CPU per request (benchmarks/README.md,
"Proxy overhead"). What it does: keep-alive and pipelining (one request at a time per connection),
``Expect: 100-continue``, Content-Length and chunked request bodies with a size limit (413 before reading it
all), malformed input -> 400 and close. A client that goes away cancels its handler task, which closes the
upstream legs with it.

The public port faces the network, so every resource a client can hold is bounded (``Limits``, the
``[listener]`` section of pdctl.toml; nginx's and uvicorn's defaults were the model): the request head must
arrive within ``header_timeout_s`` and may not exceed ``max_header_bytes`` even while incomplete (httptools
buffers a partial header internally, so the bytes are counted as they arrive), a body may pause at most
``body_timeout_s`` between reads, an idle keep-alive connection lives ``keepalive_timeout_s``, a client that
takes nothing of its answer for ``send_timeout_s`` is dropped (its handler is cancelled, so its upstream legs
close), and beyond ``max_connections`` a new connection gets a 503 and is closed. One sweep per server
checks the deadlines (no timer per request: the data path only stores a number). ``HEAD`` is answered like
``GET`` without the body. ``drain`` stops accepting and lets in-flight answers finish (a graceful stop).
"""
from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter, deque
from dataclasses import dataclass
from http import HTTPStatus

import httptools

from ..config import default as _d

log = logging.getLogger("pdctl.proxy")
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_MAX_URL_BYTES = 16 * 1024
_PIPELINE_DEPTH = 32
_LINGER_S = 1.0            # a refused connection is closed this long after its 503 (the client reads it first)
IDLE, HEAD, BODY = 0, 1, 2  # where a connection is in reading its next request


@dataclass(frozen=True)
class Limits:
    """What one client may hold of a listener ([listener] in pdctl.toml; defaults from the config schema)."""
    header_timeout_s: float = _d("listener", "header_timeout_s")
    body_timeout_s: float = _d("listener", "body_timeout_s")
    keepalive_timeout_s: float = _d("listener", "keepalive_timeout_s")
    send_timeout_s: float = _d("listener", "send_timeout_s")
    max_connections: int = _d("listener", "max_connections")
    max_header_bytes: int = _d("listener", "max_header_bytes")
    max_body_bytes: int = _d("listener", "max_body_bytes")

    @property
    def tick_s(self) -> float:
        """How often the deadlines are checked: a quarter of the shortest timeout, within 50 ms .. 1 s."""
        shortest = min(self.header_timeout_s, self.body_timeout_s, self.keepalive_timeout_s, self.send_timeout_s)
        return max(0.05, min(1.0, shortest / 4))


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
                 "chunked", "head_only")

    def __init__(self, conn, method: str, url: bytes, headers: dict, body: bytes, keep_alive: bool,
                 http10: bool = False):
        self.conn, self.method, self.headers, self.body, self.keep_alive = conn, method, headers, body, keep_alive
        self.chunked = not http10          # HTTP/1.0 clients get the raw stream, ended by closing
        if http10:
            self.keep_alive = False
        self.head_only = method == "HEAD"  # answered like GET, without the body
        raw = url.decode("latin-1")
        path, _, self.query = raw.partition("?")
        self.path = path
        self._head_pending = None
        self.started = False      # a streamed answer has begun: its status can no longer change

    # --- streamed answers ---------------------------------------------------------------------
    def stream(self, status: int, headers: dict) -> None:
        """Begin a chunked answer; the head goes out with the first write (one send for both)."""
        if self.conn.server.draining:
            self.keep_alive = False
        extra = (b"Transfer-Encoding: chunked\r\n" if self.chunked else b"") + \
            (b"" if self.keep_alive else b"Connection: close\r\n")
        self._head_pending = _head(status, headers, extra)
        self.started = True

    def _frame(self, data: bytes) -> bytes:
        if not data or self.head_only:
            return b""
        return b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data

    async def write(self, data: bytes) -> None:
        out = self._frame(data)
        if self._head_pending is not None:
            out, self._head_pending = self._head_pending + out, None
        if out:
            await self.conn.send(out)

    async def end(self, data: bytes = b"") -> None:
        out = self._frame(data) + (b"0\r\n\r\n" if self.chunked and not self.head_only else b"")
        if self._head_pending is not None:
            out, self._head_pending = self._head_pending + out, None
        if out:
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
        self.phase = IDLE
        self.begins = 0           # messages begun on this connection (to attribute bytes to a request head)
        self.head_bytes = 0       # bytes of the current request head received so far, complete or not
        self.fresh = True         # no request has begun yet: an expired deadline closes without an answer
        self.read_deadline: float | None = None    # loop time by which the next read step must be done
        self.write_deadline: float | None = None   # loop time by which a paused write must have drained
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
        srv = self.server
        if len(srv.conns) >= srv.limits.max_connections:
            self._refuse()
            return
        srv.conns.add(self)
        self.read_deadline = srv.loop.time() + srv.limits.header_timeout_s

    def _refuse(self) -> None:
        """Over the connection cap: a 503 in OpenAI's shape, then close (after the client had time to read it)."""
        srv = self.server
        self.dead = self.closed = True
        srv.stats["refused_max_connections"] += 1
        body = srv.error_body(503, f"the proxy already holds {len(srv.conns)} client connections, its limit "
                                   "([listener] max_connections); retry shortly", "too_many_connections")
        t = self.transport
        t.write(_head(503, {"Content-Type": "application/json", "Content-Length": len(body), "Retry-After": 1},
                      b"Connection: close\r\n") + body)
        try:
            if t.can_write_eof():
                t.write_eof()
        except (OSError, RuntimeError):
            pass
        srv.loop.call_later(_LINGER_S, t.close)

    def connection_lost(self, exc):
        self.closed = True
        self.server.conns.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.drain_waiter is not None and not self.drain_waiter.done():
            self.drain_waiter.set_exception(ConnectionResetError("client went away"))

    def pause_writing(self):
        self.write_paused = True
        self.write_deadline = self.server.loop.time() + self.server.limits.send_timeout_s

    def resume_writing(self):
        self.write_paused = False
        self.write_deadline = None
        if self.drain_waiter is not None and not self.drain_waiter.done():
            self.drain_waiter.set_result(None)

    def data_received(self, data):
        if self.dead:
            return
        phase0, begins0 = self.phase, self.begins
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as e:
            self._reject(400, f"malformed HTTP request ({str(e)[:80]})")
        if self.dead:
            return
        if self.phase == HEAD:
            # the head is still incomplete: httptools holds a partial header line in its own buffer, so count
            # what arrived. Exact unless a pipelined message ended inside this chunk (then from the next one).
            if phase0 == HEAD and self.begins == begins0:
                self.head_bytes += len(data)
            elif phase0 == IDLE and self.begins == begins0 + 1:
                self.head_bytes = len(data)
            limit = self.server.limits.max_header_bytes
            if self.head_bytes > limit:
                self._reject(431, f"request head larger than {limit} bytes ([listener] max_header_bytes)",
                             code="headers_too_large")
        elif self.phase == BODY:
            self.read_deadline = self.server.loop.time() + self.server.limits.body_timeout_s

    # --- parser callbacks ---------------------------------------------------------------------
    def on_message_begin(self):
        self._reset_message()
        self.phase, self.fresh = HEAD, False
        self.begins += 1
        self.head_bytes = 0
        self.read_deadline = self.server.loop.time() + self.server.limits.header_timeout_s

    def on_url(self, url):
        self.url += url
        if len(self.url) > min(_MAX_URL_BYTES, self.server.limits.max_header_bytes):
            self._reject(414, "request URL too long")

    def on_header(self, name, value):
        self.header_bytes += len(name) + len(value)
        limit = self.server.limits.max_header_bytes
        if self.header_bytes > limit:
            self._reject(431, f"request headers larger than {limit} bytes ([listener] max_header_bytes)",
                         code="headers_too_large")
            return
        k = name.decode("latin-1").lower()
        v = value.decode("latin-1")
        self.headers[k] = self.headers[k] + ", " + v if k in self.headers else v

    def on_headers_complete(self):
        self.phase = BODY
        self.read_deadline = self.server.loop.time() + self.server.limits.body_timeout_s
        if self.rejected:
            return
        cl = self.headers.get("content-length")
        limit = self.server.max_body
        if cl is not None and cl.strip().isdigit() and int(cl) > limit:
            self._reject(413, f"request body is larger than the proxy's limit of {limit} bytes; "
                              "shorten the prompt or raise [listener] max_body_bytes", code="body_too_large")
            return
        if self.headers.get("expect", "").lower() == "100-continue":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body):
        if self.rejected:
            return
        self.body_len += len(body)
        limit = self.server.max_body
        if self.body_len > limit:
            self._reject(413, f"request body is larger than the proxy's limit of {limit} bytes; "
                              "shorten the prompt or raise [listener] max_body_bytes", code="body_too_large")
            return
        self.body_parts.append(body)

    def on_message_complete(self):
        self.phase = IDLE
        self.read_deadline = None          # set again (keep-alive) once the answer is out
        if self.rejected or self.dead:
            return
        method = self.parser.get_method().decode("latin-1")
        body = self.body_parts[0] if len(self.body_parts) == 1 else b"".join(self.body_parts)
        req = Request(self, method, self.url, self.headers, body, self.parser.should_keep_alive(),
                      self.parser.get_http_version() == "1.0")
        self.queue.append(req)
        if self.task is None:
            self.task = self.server.loop.create_task(self._serve())
        if len(self.queue) > _PIPELINE_DEPTH:
            self.transport.pause_reading()   # a client pipelining this deep waits for answers first

    # --- deadlines (LeanServer._sweep) --------------------------------------------------------
    def expire(self, now: float) -> None:
        if self.write_deadline is not None and now > self.write_deadline:
            self.server.stats["closed_send_timeout"] += 1
            log.info("dropping a client that took nothing of its answer for %.0f s",
                     self.server.limits.send_timeout_s)
            self.dead = True
            self.transport.abort()          # connection_lost cancels the handler, which closes its legs
            return
        if self.read_deadline is None or now <= self.read_deadline or self.closed:
            return
        self.read_deadline = None
        if self.phase == IDLE:
            self.server.stats["closed_idle" if not self.fresh else "closed_no_request"] += 1
            self.dead = True
            self.transport.close()
        elif self.task is not None:        # an answer is being written: no second answer can go in between
            self.server.stats["closed_header_timeout" if self.phase == HEAD else "closed_body_timeout"] += 1
            self.dead = True
            self.transport.close()
        elif self.phase == HEAD:
            self.server.stats["closed_header_timeout"] += 1
            self._reject(408, f"the request head did not arrive within {self.server.limits.header_timeout_s:g} s "
                              "([listener] header_timeout_s)", code="request_timeout")
        else:
            self.server.stats["closed_body_timeout"] += 1
            self._reject(408, f"the request body paused for more than {self.server.limits.body_timeout_s:g} s "
                              "([listener] body_timeout_s)", code="request_timeout")

    # --- serving ------------------------------------------------------------------------------
    def _reject(self, status: int, message: str, code: str = "invalid_request") -> None:
        """Answer at once and close: the rest of this connection's bytes cannot be trusted."""
        if self.rejected or self.dead:
            return
        self.rejected = self.dead = True
        self.server.stats[f"rejected_{status}"] += 1
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
                if self.transport.is_reading() is False and len(self.queue) <= _PIPELINE_DEPTH and not self.closed:
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
                if self.server.draining:
                    req.keep_alive = False
                if resp is not None and not self.closed:
                    body = resp.body
                    hdrs = resp.headers
                    hdrs["Content-Length"] = len(body)
                    extra = b"" if req.keep_alive else b"Connection: close\r\n"
                    self.transport.write(_head(resp.status, hdrs, extra) + (b"" if req.head_only else body))
                if not req.keep_alive:
                    self.transport.close()
                    return
        finally:
            self.task = None
            if self.queue and not self.closed:
                self.task = self.server.loop.create_task(self._serve())
            elif not self.closed and self.phase == IDLE:
                self.read_deadline = self.server.loop.time() + self.server.limits.keepalive_timeout_s

    def idle(self) -> bool:
        return self.task is None and not self.queue and self.phase == IDLE


class LeanServer:
    def __init__(self, dispatch, error_body, max_body: int | None = None, limits: Limits | None = None):
        self.limits = limits or Limits()
        self.dispatch, self.error_body = dispatch, error_body
        self.max_body = max_body if max_body is not None else self.limits.max_body_bytes
        self.loop = None
        self.server = None
        self.conns: set = set()
        self.draining = False
        self.stats: Counter = Counter()     # connections closed or refused by a limit, by reason
        self._sweeper: asyncio.Task | None = None

    async def start(self, host: str, port: int, sock: socket.socket | None = None) -> int:
        """Listen on ``host:port``, or serve ``sock`` (a listening socket handed over by systemd)."""
        self.loop = asyncio.get_running_loop()
        if sock is not None:
            self.server = await self.loop.create_server(lambda: _Conn(self), sock=sock, backlog=2048)
        else:
            self.server = await self.loop.create_server(lambda: _Conn(self), host, port, backlog=2048,
                                                        reuse_address=True)
        self._sweeper = self.loop.create_task(self._sweep())
        return self.server.sockets[0].getsockname()[1]

    def set_limits(self, limits: Limits, max_body: int | None = None) -> None:
        """New limits for new deadlines and checks (a reload); deadlines already set run out as they were."""
        self.limits = limits
        self.max_body = max_body if max_body is not None else limits.max_body_bytes

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.limits.tick_s)
            now = self.loop.time()
            for c in list(self.conns):
                if c.read_deadline is not None or c.write_deadline is not None:
                    c.expire(now)

    def _close_idle(self) -> int:
        n = 0
        for c in list(self.conns):
            if c.idle() and c.transport is not None:
                c.dead = True
                c.transport.close()
                n += 1
        return n

    async def drain(self, timeout_s: float) -> dict:
        """Graceful stop: stop accepting (a socket systemd holds stays open: new clients wait in its backlog
        for the next process), close idle keep-alive connections, let requests in flight finish (their answers
        say ``Connection: close``) for up to ``timeout_s``, then close what is left. Returns what it saw."""
        self.draining = True
        if self.server is not None:
            self.server.close()
        busy0 = len(self.conns)
        idle = self._close_idle()
        deadline = self.loop.time() + timeout_s
        while self.conns and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
            idle += self._close_idle()
        left = len(self.conns)
        for c in list(self.conns):
            if c.transport is not None:
                c.transport.close()
        return {"connections": busy0, "closed_idle": idle, "cut_at_deadline": left}

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        if self.server is not None:
            self.server.close()
            for c in list(self.conns):
                if c.transport is not None:
                    c.transport.close()
            try:
                await asyncio.wait_for(self.server.wait_closed(), 2.0)
            except asyncio.TimeoutError:
                pass
