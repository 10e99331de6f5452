"""HTTP scrapes with short time-outs (the Prometheus text is parsed by appliance.wire.prom).

Fetching: every GET of a tick is in flight at once from the calling thread (non-blocking sockets and
one ``poll``, no thread pool to wake), on per-URL keep-alive connections (no TCP handshake per scrape),
and responses are parsed by httptools (llhttp, the parser uvicorn uses). A stale keep-alive connection
is retried once on a fresh one. Failures are values (``Fetched.error``), never exceptions.

"""
from __future__ import annotations

import errno
import http.client
import json
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional
from urllib.parse import urlsplit

import httptools


@dataclass(frozen=True)
class Fetched:
    url: str
    status: int = 0              # HTTP status, 0 when no response
    body: str = ""
    error: str = ""              # why there is no usable response ("" when status is 2xx)

    @property
    def ok(self) -> bool:
        return not self.error


def _split(url: str) -> tuple[str, int, str]:
    parts = urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return parts.hostname or "127.0.0.1", parts.port or 80, path


def _failure(url: str, e: BaseException, timeout_s: float) -> Fetched:
    if isinstance(e, ConnectionRefusedError):
        return Fetched(url, error="connection refused (not listening)")
    if isinstance(e, (socket.timeout, TimeoutError)):
        return Fetched(url, error=f"no answer within {timeout_s:g}s")
    return Fetched(url, error=f"{type(e).__name__}: {e}".rstrip(": "))


_POLLIN, _POLLOUT = select.POLLIN, select.POLLOUT
_POLLEND = select.POLLERR | select.POLLHUP


class _Req:
    """One GET in flight; also the httptools callback target for its response."""
    __slots__ = ("key", "url", "addrs", "data", "sock", "reused", "sent", "got_bytes", "parser", "chunks",
                 "framed", "headers_done", "done", "keep", "deadline")

    def __init__(self, key: Any, url: str, addrs: list, data: bytes) -> None:
        self.key, self.url, self.addrs, self.data = key, url, addrs, data
        self.sock: Optional[socket.socket] = None
        self.reused = False
        self.sent = 0
        self.deadline = 0.0
        self._reset()

    def _reset(self) -> None:
        self.got_bytes = False
        self.chunks: list[bytes] = []
        self.framed = False            # Content-Length or chunked: the body's end is known without EOF
        self.headers_done = False
        self.done = False
        self.keep = False
        self.parser = httptools.HttpResponseParser(self)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.done = True
        self.keep = self.parser.should_keep_alive()     # llhttp forgets it once the message is over


class Fetcher:
    """Keep-alive GETs, one connection per URL, many at once; a stale connection is retried once fresh.

    ``fetch_all({key: url})`` runs every GET concurrently from the calling thread and returns
    ``{key: Fetched}``; each GET has its own ``timeout_s`` (a hung endpoint costs one time-out in all).
    ``wait = begin(urls)`` sends the requests and returns at once; ``wait()`` collects the answers, so the
    caller can do other work (the GPU sample) while the servers answer. ``fetcher(url)`` is one GET.
    """

    def __init__(self, timeout_s: float = 0.5):
        self.timeout_s = timeout_s
        self._conns: dict[str, socket.socket] = {}
        self._targets: dict[str, tuple[str, int, bytes]] = {}
        self._lock = threading.Lock()
        self._buf = bytearray(262144)
        self._view = memoryview(self._buf)

    def __call__(self, url: str) -> Fetched:
        return self.fetch_all({0: url})[0]

    def _target(self, url: str) -> tuple[str, int, bytes]:
        t = self._targets.get(url)
        if t is None:
            host, port, path = _split(url)
            hosthdr = f"[{host}]" if ":" in host else host
            data = (f"GET {path} HTTP/1.1\r\nHost: {hosthdr}:{port}\r\nAccept: */*\r\n"   # as http.client
                    "Accept-Encoding: identity\r\nConnection: keep-alive\r\n\r\n").encode("latin-1")
            t = self._targets[url] = (host, port, data)
        return t

    def fetch_all(self, urls: dict) -> dict:
        return self.begin(urls)()

    def begin(self, urls: dict) -> Callable[[], dict]:
        """Send every GET now; the returned function waits for the answers (call it exactly once)."""
        self._lock.acquire()
        try:
            run = self._run(urls)
            next(run)
        except BaseException:
            self._lock.release()
            raise
        done: list = []

        def wait() -> dict:
            if not done:
                try:
                    done.append(next(run))
                finally:
                    self._lock.release()
            return done[0]
        return wait

    def _run(self, urls: dict) -> Iterator[Optional[dict]]:
        out: dict = {}
        buf, view = self._buf, self._view
        poller = select.poll()
        live: dict[int, _Req] = {}
        timeout_s = self.timeout_s

        def fail(r: _Req, e: BaseException) -> None:
            out[r.key] = _failure(r.url, e, timeout_s)

        def drop(r: _Req) -> None:
            if r.sock is not None:
                fd = r.sock.fileno()
                if live.pop(fd, None) is not None:
                    poller.unregister(fd)
                r.sock.close()
                r.sock = None

        def start(r: _Req, fresh: bool) -> None:
            """Send on the URL's kept connection, or connect a new one (non-blocking)."""
            r._reset()
            r.sent = 0
            r.deadline = time.monotonic() + timeout_s
            sock = None if fresh else self._conns.pop(r.url, None)
            r.reused = sock is not None
            if sock is None:
                if not r.addrs:
                    try:
                        host, port, _ = self._target(r.url)
                        r.addrs = [ai[:2] + (ai[4],) for ai in
                                   socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
                    except OSError as e:
                        fail(r, e)
                        return
                family, kind, addr = r.addrs[0]
                sock = socket.socket(family, kind)
                sock.setblocking(False)
                rc = sock.connect_ex(addr)
                if rc not in (0, errno.EINPROGRESS, errno.EAGAIN):
                    sock.close()
                    next_addr(r, OSError(rc, os.strerror(rc)))
                    return
                r.sock = sock
                live[sock.fileno()] = r
                poller.register(sock, _POLLOUT)     # writable: connected (or refused: SO_ERROR says)
                return
            r.sock = sock
            live[sock.fileno()] = r
            poller.register(sock, _POLLIN)
            send(r)

        def next_addr(r: _Req, e: OSError) -> None:
            if isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED:
                e = ConnectionRefusedError(errno.ECONNREFUSED, os.strerror(errno.ECONNREFUSED))
            if len(r.addrs) > 1:             # e.g. localhost -> ::1 refused, try 127.0.0.1
                r.addrs = r.addrs[1:]
                start(r, fresh=True)
                return
            fail(r, e)

        def send(r: _Req) -> None:
            try:
                r.sent += r.sock.send(r.data[r.sent:])
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                drop(r)
                if r.reused:                  # the server closed an idle keep-alive connection
                    start(r, fresh=True)
                else:
                    fail(r, e)
                return
            poller.modify(r.sock, _POLLIN if r.sent >= len(r.data) else _POLLIN | _POLLOUT)

        def finish(r: _Req) -> None:
            keep = r.keep and r.framed
            sock = r.sock
            fd = sock.fileno()
            live.pop(fd, None)
            poller.unregister(fd)
            r.sock = None
            if keep:
                old = self._conns.pop(r.url, None)
                if old is not None:
                    old.close()
                self._conns[r.url] = sock
            else:
                sock.close()
            status = r.parser.get_status_code()
            body = b"".join(r.chunks).decode("utf-8", "replace")
            out[r.key] = (Fetched(r.url, status=status, body=body) if 200 <= status < 300 else
                          Fetched(r.url, status=status, body=body, error=f"HTTP {status}"))

        def readable(r: _Req) -> None:
            try:
                n = r.sock.recv_into(buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                drop(r)
                if r.reused and not r.got_bytes:
                    start(r, fresh=True)
                else:
                    fail(r, e)
                return
            if not n:
                if r.headers_done and not r.framed:        # body delimited by the close
                    finish(r)
                    return
                drop(r)
                if r.reused and not r.got_bytes:
                    start(r, fresh=True)
                else:
                    fail(r, http.client.RemoteDisconnected("Remote end closed connection without response"))
                return
            r.got_bytes = True
            try:
                r.parser.feed_data(view[:n])
            except httptools.HttpParserError as e:
                drop(r)
                fail(r, http.client.HTTPException(f"bad HTTP response: {e}"))
                return
            if r.done:
                finish(r)

        for key, url in urls.items():
            try:
                self._target(url)
            except ValueError as e:          # e.g. a non-numeric port
                out[key] = _failure(url, e, timeout_s)
                continue
            start(_Req(key, url, [], self._target(url)[2]), fresh=False)
        yield None                            # requests are out: the caller may work while servers answer

        while live:
            now = time.monotonic()
            for r in [r for r in live.values() if r.deadline <= now]:
                drop(r)
                out[r.key] = Fetched(r.url, error=f"no answer within {timeout_s:g}s")
            if not live:
                break
            wait = min(r.deadline for r in live.values()) - now
            for fd, ev in poller.poll(max(1, int(wait * 1000 + 0.999))):
                r = live.get(fd)
                if r is None:
                    continue
                if r.sent == 0 and not r.reused and ev & (_POLLOUT | _POLLEND) and not r.got_bytes:
                    err = r.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        drop(r)
                        next_addr(r, OSError(err, os.strerror(err)))
                        continue
                if ev & _POLLOUT and r.sent < len(r.data):
                    send(r)
                    if r.sock is None or r.key in out:
                        continue
                if ev & (_POLLIN | _POLLEND):
                    readable(r)
        yield out

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.close()


def parse_json(f: Fetched) -> Any | str:
    try:
        return json.loads(f.body)
    except ValueError as e:
        return f"not JSON: {e}"
