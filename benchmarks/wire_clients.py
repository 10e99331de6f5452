"""Benchmark-only legs' clients for benchmarks/wire_choice.py: httpx and aiohttp behind upstream.Pool's surface.

The proxy uses a small part of ``appliance/proxy/upstream``: ``Pool.request`` (send, wait for the head) returning
a connection with status, headers, read, read_all, complete, release, close and fail. These adapters give the
same surface over httpx.AsyncClient and aiohttp.ClientSession, so legs.py, relay.py and scrape.py run unchanged.
Production code never imports this.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from appliance.wire.client import UpstreamError, UpstreamTimeout, read_to_end  # noqa: E402

CLIENTS = ("lean", "httpx", "aiohttp")


class _LibConn:
    """What legs.py / relay.py / scrape.py use of upstream.Conn, over a library's streamed response.
    ``fail`` (breaker trip, hung worker) must wake a reader blocked inside the library: the reading task is
    cancelled and the cancellation turned back into the error, as the lean Conn's waiter does."""

    def __init__(self):
        self.status, self.headers, self.error = 0, {}, None
        self.done, self.resp, self._task = False, None, None

    def fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        if self._task is not None:
            self._task.cancel()

    async def _guard(self, aw, timeout_s):
        if self.error is not None:
            raise self.error
        self._task = asyncio.current_task()
        try:
            return await aw
        except asyncio.CancelledError:
            if self.error is not None and self._task.uncancel() == 0:
                raise self.error from None
            raise
        except StopAsyncIteration:
            raise
        except Exception as e:  # noqa: BLE001 - every library failure is the engine's, as in upstream.py
            self.error = self._translate(e, timeout_s)
            raise self.error from None
        finally:
            self._task = None

    @staticmethod
    def _translate(e: Exception, timeout_s) -> UpstreamError:
        name = type(e).__name__.lower()
        if "timeout" in name or isinstance(e, asyncio.TimeoutError):
            return UpstreamTimeout(f"no data from the engine within {timeout_s} s ({type(e).__name__})")
        return UpstreamError(f"{type(e).__name__}: {e}")

    @property
    def complete(self) -> bool:
        return self.done

    async def read_all(self, timeout_s: float | None = None, limit: int = 64 * 1024 * 1024) -> bytes:
        return await read_to_end(self.read, timeout_s, limit)


class HttpxConn(_LibConn):
    async def read(self, timeout_s: float | None = None) -> bytes:
        if self.done:
            return b""
        try:
            return await self._guard(self._it.__anext__(), timeout_s)
        except StopAsyncIteration:        # httpx closed the response and gave the connection back
            self.done = True
            return b""

    def release(self) -> None:
        if not self.done:
            self.close()

    def close(self) -> None:
        if self.resp is not None and not self.done:
            self.done = True
            asyncio.ensure_future(self.resp.aclose())


class HttpxPool:
    """httpx.AsyncClient (httpcore, h11) with unbounded pool; read timeout = the head/chunk timeout."""

    def __init__(self, host: str, port: int, connect_timeout_s: float = 1.0):
        self.base, self.connect_timeout_s, self.client = f"http://{host}:{port}", connect_timeout_s, None

    async def request(self, method, path, body, headers, head_timeout_s, watch=None):
        import httpx
        if self.client is None:
            self.client = httpx.AsyncClient(base_url=self.base, trust_env=False, limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=None, keepalive_expiry=60.0))
        t = httpx.Timeout(None, connect=self.connect_timeout_s, read=head_timeout_s)
        req = self.client.build_request(method, path, content=body or None, headers=headers, timeout=t)
        conn = HttpxConn()
        if watch is not None:
            watch.add(conn)
        conn.resp = await conn._guard(self.client.send(req, stream=True), head_timeout_s)
        conn.status = conn.resp.status_code
        conn.headers = {k.lower(): v for k, v in conn.resp.headers.items()}
        conn._it = conn.resp.aiter_raw()
        return conn

    def close(self) -> None:
        if self.client is not None:
            asyncio.ensure_future(self.client.aclose())
            self.client = None


class AiohttpConn(_LibConn):
    async def read(self, timeout_s: float | None = None) -> bytes:
        if self.done:
            return b""
        data = await self._guard(self.resp.content.readany(), timeout_s)
        if not data or self.resp.content.at_eof():
            self.done = True
        return data

    def release(self) -> None:
        if self.done and self.error is None:
            self.resp.release()
        else:
            self.close()

    def close(self) -> None:
        if self.resp is not None:
            self.done = True
            self.resp.close()


class AiohttpPool:
    """aiohttp.ClientSession on an unbounded TCPConnector; sock_read = the head/chunk timeout."""

    def __init__(self, host: str, port: int, connect_timeout_s: float = 1.0):
        self.base, self.connect_timeout_s, self.session = f"http://{host}:{port}", connect_timeout_s, None

    async def request(self, method, path, body, headers, head_timeout_s, watch=None):
        import aiohttp
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                                                 auto_decompress=False)
        t = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s, sock_read=head_timeout_s)
        conn = AiohttpConn()
        if watch is not None:
            watch.add(conn)
        conn.resp = await conn._guard(self.session.request(method, self.base + path, data=body or None,
                                                           headers=headers, timeout=t), head_timeout_s)
        conn.status = conn.resp.status
        conn.headers = {k.lower(): v for k, v in conn.resp.headers.items()}
        return conn

    def close(self) -> None:
        if self.session is not None:
            asyncio.ensure_future(self.session.close())
            self.session = None


def install_client(server, client: str) -> None:
    """Every backend's request and probe pools become the chosen library's (scrapes and probes too)."""
    if client == "lean":
        return
    cls = {"httpx": HttpxPool, "aiohttp": AiohttpPool}[client]
    for b in server.backends:
        host, port = b.pool.host, b.pool.port
        b.pool, b.probe_pool = cls(host, port), cls(host, port)
