"""The one HTTP/1.1 client of pdctl: keep-alive pools to loopback services, no per-request task.

Why not aiohttp's client: on this class of box it was the largest CPU cost per request in the proxy
(``benchmarks/proxy_overhead.py``; see benchmarks/README.md). The engines speak plain HTTP/1.1 (uvicorn/h11):
Content-Length or chunked bodies, keep-alive. The body arrives as whatever bytes are buffered (chunks
coalesced), so a stream is relayed with as few writes as the engine made.
"""
from __future__ import annotations

import asyncio
import errno
import threading
from collections import deque

import httptools

_HEAD, _BODY, _DONE = range(3)
_PAUSE_AT = 1 << 20


class UpstreamError(Exception):
    """The engine connection failed (refused, reset, closed mid-body, malformed, or timed out)."""


class UpstreamTimeout(UpstreamError):
    pass


class UpstreamUnreachable(UpstreamError):
    """No connection could be made (refused, unreachable): the peer never saw the request."""


_READ = threading.local()       # one read buffer per thread (each event loop reads into its own)
_READ_BYTES = 256 * 1024
REFUSED = "connection refused (not listening)"


def _read_buffer() -> memoryview:
    view = getattr(_READ, "view", None)
    if view is None:
        view = _READ.view = memoryview(bytearray(_READ_BYTES))
    return view


def refused(e: BaseException | None) -> bool:
    """Whether a connect failed because nothing listens (at every address, when there were several)."""
    if isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED:
        return True
    msg = str(e or "")                 # several addresses (localhost: ::1 and 127.0.0.1), each refused
    return msg.startswith("Multiple exceptions") and msg.count("[Errno") == msg.count(f"[Errno {errno.ECONNREFUSED}]")


async def read_to_end(read, timeout_s: float | None, limit: int) -> bytes:
    """The rest of a body from ``read(timeout_s)`` (b"" at its end), refusing one larger than ``limit`` bytes.
    Shared with the benchmarks' library-backed connections (benchmarks/wire_choice.py)."""
    out = bytearray()
    while True:
        d = await read(timeout_s)
        if not d:
            return bytes(out)
        out += d
        if len(out) > limit:
            raise UpstreamError(f"answer larger than {limit} bytes")


class Conn(asyncio.BufferedProtocol):
    """One keep-alive connection to an engine; parses answers with httptools (llhttp)."""

    def __init__(self, pool):
        self.pool = pool
        self.transport = None
        self.closed = False
        self.uses = 0
        self.in_pool = False          # idle in its pool: no request outstanding, so no byte may arrive
        self.parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self):
        self.state = _HEAD
        self.status = 0
        self.headers: dict = {}
        self.pieces: deque = deque()
        self.waiter = None
        self.error: Exception | None = None
        self.keep_alive = True
        self.paused = False
        self.pending_bytes = 0
        self.seen = 0             # bytes received for the current exchange
        self.until_close = False

    # --- protocol callbacks -------------------------------------------------------------------
    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        self.closed = True
        self.pool._forget(self)
        if self.state == _BODY and self.until_close:
            self.state = _DONE
        elif self.state != _DONE and self.error is None:
            self.error = UpstreamError("the server closed the connection" +
                                       (" before answering" if self.state == _HEAD else " mid-body"))
        self._wake()

    # asyncio reads into the thread's buffer (recv_into), not into a fresh 256 KiB bytes object per read: for a
    # 100 KB scrape that was ~70 us of CPU (benchmarks/collector_cost.py). The parser copies out what it keeps
    # before the next read lands, so one buffer serves every connection of a loop.
    def get_buffer(self, sizehint: int) -> memoryview:
        return _read_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(_read_buffer()[:nbytes])

    def data_received(self, data):
        self.seen += len(data)
        if self.in_pool:                # bytes while nothing was asked: this connection cannot be trusted again
            self.keep_alive = False
            self.close()
            return
        if self.state == _DONE:
            self.keep_alive = False     # bytes nobody asked for: do not reuse this connection
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.fail(UpstreamError(f"malformed HTTP from the server: {e}"))
            return
        if self.pending_bytes > _PAUSE_AT and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    # --- parser callbacks ---------------------------------------------------------------------
    def on_header(self, name, value):
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self):
        status = self.parser.get_status_code()
        if 100 <= status < 200:         # an interim answer (100 Continue, 103 Early Hints): not the answer's head
            self.headers = {}
            return
        self.status = status
        self.state = _BODY
        self.keep_alive = self.parser.should_keep_alive()
        h = self.headers
        self.until_close = "content-length" not in h and "chunked" not in h.get("transfer-encoding", "")

    def on_body(self, body):
        self.pieces.append(body)
        self.pending_bytes += len(body)

    def on_message_complete(self):
        if self.state == _BODY:
            self.state = _DONE

    # --- waiting ------------------------------------------------------------------------------
    def _wake(self):
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def fail(self, exc: Exception) -> None:
        """Abort this exchange (breaker opened, timeout): the waiting reader raises ``exc``."""
        if self.error is None:
            self.error = exc
        self.keep_alive = False
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    async def _wait(self, timeout_s: float | None):
        self.waiter = fut = self.pool.loop.create_future()
        timer = None
        if timeout_s is not None:
            timer = self.pool.loop.call_later(timeout_s, self._timeout, fut, timeout_s)
        try:
            await fut
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def _timeout(self, fut, timeout_s):
        if not fut.done():
            self.fail(UpstreamTimeout(f"no data from the server within {timeout_s:g} s"))

    async def head(self, timeout_s: float | None) -> int:
        while self.state == _HEAD:
            if self.error is not None:
                raise self.error
            await self._wait(timeout_s)
        return self.status

    async def read(self, timeout_s: float | None = None) -> bytes:
        """All body bytes buffered now (waiting for some if none); b"" once the body is complete."""
        while not self.pieces:
            if self.state == _DONE:
                return b""
            if self.error is not None:
                raise self.error
            await self._wait(timeout_s)
        data = self.pieces.popleft() if len(self.pieces) == 1 else b"".join(self.pieces)
        self.pieces.clear()
        self.pending_bytes = 0
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        return data

    @property
    def complete(self) -> bool:
        return self.state == _DONE and not self.pieces

    async def read_all(self, timeout_s: float | None = None, limit: int = 64 * 1024 * 1024) -> bytes:
        return await read_to_end(self.read, timeout_s, limit)

    def close(self) -> None:
        """Drop the connection (the engine sees the client go away and aborts the request)."""
        self.keep_alive = False
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.pool._forget(self)

    def release(self) -> None:
        """Back to the pool when the answer was read to the end on a keep-alive connection, else closed."""
        if self.state == _DONE and self.keep_alive and self.error is None and not self.closed:
            self._reset()
            self.in_pool = True
            self.pool._idle.append(self)
        else:
            self.close()


class Pool:
    """Keep-alive connections to one engine (host, port)."""

    def __init__(self, host: str, port: int, connect_timeout_s: float = 1.0, ssl=None):
        """``ssl``: an ``ssl.SSLContext`` to speak TLS (a client of pdctl's TLS port; engines speak plain HTTP)."""
        self.host, self.port, self.connect_timeout_s = host, port, connect_timeout_s
        self.ssl = ssl
        self._host = f"Host: {host}:{port}\r\n"
        self._idle: list = []
        self._all: set = set()
        self.loop = None

    def _forget(self, conn) -> None:
        self._all.discard(conn)
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    async def _connect(self) -> Conn:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        try:
            tls = {"ssl": self.ssl, "server_hostname": self.host} if self.ssl is not None else {}
            _, conn = await asyncio.wait_for(self.loop.create_connection(lambda: Conn(self), self.host, self.port,
                                                                         **tls), self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"connect to {self.host}:{self.port} took over {self.connect_timeout_s:g} s") \
                from None
        except OSError as e:
            why = REFUSED if refused(e) else (e.strerror or str(e))
            raise UpstreamUnreachable(f"connect to {self.host}:{self.port}: {why}") from None
        self._all.add(conn)
        return conn

    async def send(self, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> Conn:
        """Write one request on an idle (or new) connection; read the answer from the returned Conn."""
        while self._idle:
            conn = self._idle.pop()
            conn.in_pool = False
            if not conn.closed and not conn.transport.is_closing():
                break
        else:
            conn = await self._connect()
        extra = "".join([f"{k}: {v}\r\n" for k, v in headers.items()]) if headers else ""
        head = f"{method} {path} HTTP/1.1\r\n{self._host}{extra}Content-Length: {len(body)}\r\n\r\n".encode("latin-1")
        conn.uses += 1
        conn.transport.write(head + body if body else head)
        return conn

    async def request(self, method: str, path: str, body: bytes, headers: dict | None, head_timeout_s: float | None,
                      watch: set | None = None) -> Conn:
        """Send and wait for the response head. A reused keep-alive connection that the engine had closed
        meanwhile (nothing received) is retried once on a fresh one: the engine never saw that request.
        ``watch`` collects the live connection so a breaker trip can abort it (caller removes it)."""
        for attempt in (0, 1):
            conn = await self.send(method, path, body, headers)
            if watch is not None:
                watch.add(conn)
            try:
                await conn.head(head_timeout_s)
                return conn
            except BaseException as e:
                conn.close()
                if watch is not None:
                    watch.discard(conn)
                retry = (isinstance(e, UpstreamError) and not isinstance(e, UpstreamTimeout) and attempt == 0
                         and conn.uses > 1 and conn.seen == 0)
                if not retry:
                    raise
        raise UpstreamError(f"no usable connection to {self.host}:{self.port}")

    def close(self) -> None:
        for c in list(self._all):
            c.close()
        self._idle.clear()
