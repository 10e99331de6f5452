"""One HTTP/1.1 connection of a wire server: parsing (httptools), deadlines, answers, streamed answers.

Keep-alive and pipelining (one request at a time per connection, answers in order), ``Expect: 100-continue``,
Content-Length and chunked request bodies with a size limit (413 before reading it all), malformed input -> 400
and close, HEAD without a body. The request head is counted while it arrives (httptools keeps a partial header
in its own buffer), so a header that never ends is refused at ``max_header_bytes``. A client that goes away
cancels its handler task, which closes whatever the handler had open upstream. Deadlines are stored here and
checked by the server's sweep (server.py), never by a timer per request.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from http import HTTPStatus

import httptools

log = logging.getLogger("pdctl.wire")
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_MAX_URL_BYTES = 16 * 1024
_PIPELINE_DEPTH = 32
_LINGER_S = 1.0            # a refused or rejected connection is closed this long after its answer (read first)
IDLE, HEAD, BODY = 0, 1, 2  # where a connection is in reading its next request
_NO_BODY = (204, 304)       # answers that never carry a body (nor, for 204, a Content-Length)


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
                 "chunked", "head_only", "caller", "completion_tokens", "prompt_tokens", "trail", "box_refused")

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
        self.caller = None        # who sent it, set by the application's door (the proxy: a named key)
        self.completion_tokens = 0   # what the answer used, set by the application (the proxy's per-key quota)
        self.prompt_tokens = 0       # the prompt's tokens as the engine counted them (0: the answer did not say)
        self.trail = None         # the application's record of this request (the proxy's audit entry)
        self.box_refused = False  # the application refused it for its own state (overload): no work was done

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


class Connection(asyncio.Protocol):
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
        self.addr: str | None = None     # the client's address, counted against max_connections_per_address
        self.idle_since = 0.0            # loop time it last became idle (connected, or its last answer ended)
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
        srv = self.server
        self.transport = transport
        peer = transport.get_extra_info("peername")
        addr = peer[0] if isinstance(peer, tuple) and peer else None
        cap = srv.limits.max_connections_per_address
        if addr is not None and cap and srv.per_address[addr] >= cap:
            self._refuse(429, f"{srv.name} already holds {srv.per_address[addr]} connections from {addr}, its limit "
                              "per client address ([listener] max_connections_per_address); reuse a keep-alive "
                              "connection or close some", "too_many_connections_per_address",
                         "refused_per_address")
            return
        if len(srv.conns) >= srv.limits.max_connections and not srv.reclaim():
            self._refuse(503, f"{srv.name} already holds {len(srv.conns)} client connections, its limit "
                              "([listener] max_connections), and none is idle; retry shortly",
                         "too_many_connections", "refused_max_connections")
            return
        srv.conns.add(self)
        if addr is not None:
            self.addr = addr
            srv.per_address[addr] += 1
        self.idle_since = srv.loop.time()
        self.read_deadline = self.idle_since + srv.limits.header_timeout_s

    def forget(self) -> None:
        """Forget this connection: its slot and its address's count (once; connection_lost and reclaim)."""
        self.closed = True
        srv = self.server
        if self in srv.conns:
            srv.conns.discard(self)
            if self.addr is not None:
                srv.per_address[self.addr] -= 1
                if srv.per_address[self.addr] <= 0:
                    del srv.per_address[self.addr]

    def _refuse(self, status: int, message: str, code: str, stat: str) -> None:
        """Over a connection cap: an answer in OpenAI's shape, then close (after the client had time to read it)."""
        srv = self.server
        self.dead = self.closed = True
        srv.stats[stat] += 1
        t = self.transport
        body = srv.error_body(status, message, code)
        t.write(_head(status, {"Content-Type": "application/json", "Content-Length": len(body), "Retry-After": 1},
                      b"Connection: close\r\n") + body)
        try:
            if t.can_write_eof():
                t.write_eof()
        except (OSError, RuntimeError):
            pass
        srv.loop.call_later(_LINGER_S, t.close)

    def connection_lost(self, exc):
        self.forget()
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
            self._reject(413, f"request body is larger than {self.server.name}'s limit of {limit} bytes; "
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
            self._reject(413, f"request body is larger than {self.server.name}'s limit of {limit} bytes; "
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

    # --- deadlines (Server._sweep) --------------------------------------------------------
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
        """Answer at once and close: the rest of this connection's bytes cannot be trusted.

        A lingering close, as for a refusal (and nginx's lingering_close): the answer, then our end of the stream
        (FIN), then the close _LINGER_S later, reading and dropping what the client still sends meanwhile. Closed
        at once, a socket with unread bytes (a client still sending its head or body) answers them with a reset,
        which can reach the client before it has read the answer: it would see a reset instead of the 408/413."""
        if self.rejected or self.dead:
            return
        self.rejected = self.dead = True
        self.server.stats[f"rejected_{status}"] += 1
        body = self.server.error_body(status, message, code)
        t = self.transport
        if t is not None and not t.is_closing():
            t.write(_head(status, {"Content-Type": "application/json", "Content-Length": len(body)},
                          b"Connection: close\r\n") + body)
            try:
                if t.can_write_eof():
                    t.write_eof()
            except (OSError, RuntimeError):
                t.close()
                return
            self.server.loop.call_later(_LINGER_S, t.close)

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
                    body = self.server.error_body(500, f"{self.server.name}: internal error ({type(e).__name__})",
                                                  "internal_error")
                    resp = Response(body, 500)
                if self.server.draining:
                    req.keep_alive = False
                if resp is not None and not self.closed:
                    body = resp.body
                    hdrs = resp.headers
                    bodiless = resp.status in _NO_BODY
                    if bodiless:                   # RFC 9110: no body, and no Content-Length on a 204
                        hdrs.pop("Content-Type", None)
                    else:
                        hdrs["Content-Length"] = len(body)   # HEAD too: the length GET would have
                    extra = b"" if req.keep_alive else b"Connection: close\r\n"
                    self.transport.write(_head(resp.status, hdrs, extra)
                                         + (b"" if req.head_only or bodiless else body))
                if not req.keep_alive:
                    self.transport.close()
                    return
        finally:
            self.task = None
            if self.queue and not self.closed:
                self.task = self.server.loop.create_task(self._serve())
            elif not self.closed and self.phase == IDLE:
                self.idle_since = self.server.loop.time()
                self.read_deadline = self.idle_since + self.server.limits.keepalive_timeout_s

    def idle(self) -> bool:
        return self.task is None and not self.queue and self.phase == IDLE


