"""The one HTTP/1.1 server of pdctl: the proxy's public and loopback ports and the twin's surfaces.

Why our own (benchmarks/README.md, "Wire layer choice"): on the proxy's path it costs less CPU per request than
uvicorn (httptools, raw ASGI) and granian, and the bounds a network-facing listener needs are part of it, where
uvicorn has no deadline for a request head nor a head size limit on httptools (projects that need them patch
its protocol class). The parser is httptools (llhttp), the loop uvloop when present.

Every resource a client can hold is bounded (``Limits``, the ``[listener]`` section of pdctl.toml; nginx's and
uvicorn's defaults were the model): the request head must arrive within ``header_timeout_s`` and may not exceed
``max_header_bytes`` even while incomplete, a body may pause at most ``body_timeout_s`` between reads, an idle
keep-alive connection lives ``keepalive_timeout_s``, a client that takes nothing of its answer for
``send_timeout_s`` is dropped (its handler is cancelled). At ``max_connections`` the connections that serve
nobody are closed to make room (``reclaim``: no request yet, then the longest-idle keep-alive ones); only when
none is idle does a new connection get a 503; one client address may hold ``max_connections_per_address`` (a 429
beyond), so one flooding address cannot take the listener. With an ``ssl.SSLContext`` the listener speaks
HTTP/1.1 over TLS (asyncio's TLS layer; a connection counts against the caps once its handshake, bounded by
``header_timeout_s``, is done), and ``set_ssl`` puts renewed certificates in force for the next connections
without closing any (the servername callback hands each new handshake the current context). One sweep per server
checks the deadlines. ``drain`` stops accepting and lets in-flight answers finish (a graceful stop);
``start(sock=...)`` serves a socket handed over by systemd.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import ssl as _ssl
from collections import Counter
from dataclasses import dataclass

from ..settings.schema import SCHEMA, schema_fields
from .tasks import cancel_and_wait
from .http1 import Connection, Request, Response

log = logging.getLogger("pdctl.wire")

__all__ = ["Limits", "Server", "Request", "Response"]


@dataclass(frozen=True)
@schema_fields({"listener": tuple(SCHEMA["listener"])})
class Limits:
    """What one client may hold of a listener: one field per key of [listener] in pdctl.toml (header_timeout_s,
    body_timeout_s, keepalive_timeout_s, send_timeout_s, max_connections, max_header_bytes, max_body_bytes),
    defaults from the config schema."""

    @property
    def tick_s(self) -> float:
        """How often the deadlines are checked: a quarter of the shortest timeout, within 50 ms .. 1 s."""
        shortest = min(self.header_timeout_s, self.body_timeout_s, self.keepalive_timeout_s, self.send_timeout_s)
        return max(0.05, min(1.0, shortest / 4))


class Server:
    """``dispatch(request)`` answers a Request with a Response, or streams it (``request.stream``) and returns
    None; ``error_body(status, message, code)`` is the body of the errors the server answers itself (the API's
    own error shape); ``name`` is how those errors name this server ("the proxy")."""

    def __init__(self, dispatch, error_body, max_body: int | None = None, limits: Limits | None = None,
                 name: str = "the server"):
        self.name = name
        self.limits = limits or Limits(max_connections_per_address=0)   # a per-address cap is the public port's
        self.dispatch, self.error_body = dispatch, error_body
        self.max_body = max_body if max_body is not None else self.limits.max_body_bytes
        self.loop = None
        self.server = None
        self.conns: set = set()
        self.draining = False
        self.stats: Counter = Counter()     # connections closed or refused by a limit, by reason
        self.per_address: Counter = Counter()   # open connections by client address
        self._sweeper: asyncio.Task | None = None
        self.ssl: _ssl.SSLContext | None = None

    async def start(self, host: str, port: int, sock: socket.socket | None = None,
                    ssl: _ssl.SSLContext | None = None) -> int:
        """Listen on ``host:port``, or serve ``sock`` (a listening socket handed over by systemd); over TLS with
        ``ssl`` (its certificates replaceable later: ``set_ssl``)."""
        self.loop = asyncio.get_running_loop()
        tls = {}
        if ssl is not None:
            self.ssl = ssl
            ssl.sni_callback = self._current_context
            tls = {"ssl": ssl, "ssl_handshake_timeout": self.limits.header_timeout_s}
        if sock is not None:
            self.server = await self.loop.create_server(lambda: Connection(self), sock=sock, backlog=2048, **tls)
        else:
            self.server = await self.loop.create_server(lambda: Connection(self), host, port, backlog=2048,
                                                        reuse_address=True, **tls)
        self._sweeper = self.loop.create_task(self._sweep())
        return self.server.sockets[0].getsockname()[1]

    def _current_context(self, ssl_object, server_name, initial) -> None:
        """OpenSSL's servername callback, called in every handshake (with or without SNI): the handshake goes on
        with the context in force now, so renewed certificates reach the next connections, open ones keep theirs.
        (SSL_set_SSL_CTX takes the certificate, key and CA store of the new context; the client-verify mode stays
        the listener's first, which is why turning mutual TLS on or off needs a restart.)"""
        if self.ssl is not None and ssl_object.context is not self.ssl:
            ssl_object.context = self.ssl

    def tls_change(self, ssl: _ssl.SSLContext | None) -> str:
        """"" when ``ssl`` can take over on this listener without a restart, else why not."""
        if (ssl is None) != (self.ssl is None):
            return "turning TLS " + ("on" if ssl is not None else "off") + " needs a restart of the listener"
        if ssl is not None and ssl.verify_mode != self.ssl.verify_mode:
            return "turning mutual TLS " + ("on" if ssl.verify_mode == _ssl.CERT_REQUIRED else "off") + \
                " needs a restart of the listener"
        return ""

    def set_ssl(self, ssl: _ssl.SSLContext) -> None:
        """New connections get ``ssl``'s certificates from now on (``tls_change`` must have said yes); open
        connections, and handshakes under way, keep theirs; nothing is re-bound."""
        if self.tls_change(ssl):
            raise ValueError(self.tls_change(ssl))
        self.ssl = ssl

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

    def reclaim(self) -> int:
        """At max_connections: close what serves nobody to make room, as nginx reuses its idle connections.
        First the connections that have sent no request yet, then idle keep-alive ones, the longest idle first,
        a sixteenth of the limit at a time (one scan serves the next connections too). -> how many closed."""
        now = self.loop.time()
        spare = [c for c in self.conns if c.idle() and not c.dead and c.transport is not None]
        if not spare:
            return 0
        spare.sort(key=lambda c: (not c.fresh, c.idle_since))
        n = 0
        for c in spare[:max(1, self.limits.max_connections // 16)]:
            self.stats["reclaimed_no_request" if c.fresh else "reclaimed_idle"] += 1
            c.dead = True
            c.forget()                      # its slot is free now; connection_lost follows
            c.transport.close()
            n += 1
        if n:
            log.info("at max_connections (%d): closed %d connection(s) that served nobody (%.0f s idle at most)",
                     self.limits.max_connections, n, now - min(c.idle_since for c in spare[:n]))
        return n

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
            await cancel_and_wait([self._sweeper])
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
