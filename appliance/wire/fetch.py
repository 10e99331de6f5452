"""One request and its whole answer, with errors as values: the wire client for callers that are not a proxy leg.

``fetch`` (async) for code on an event loop (the collector's thread loop, the TUI, the twin, the benchmarks);
``fetch_sync`` for command-line code with no loop of its own (install's readiness wait, ``pdctl status``, the
fleet's status, health probes): it runs the same client on a private loop. Both reuse a caller's ``Pool`` when
given one (keep-alive across calls), else open one for the call and close it.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from .client import Pool, UpstreamError, UpstreamTimeout, UpstreamUnreachable

DEFAULT_LIMIT = 16 * 1024 * 1024       # a status page or a scrape; bigger answers are an error, not a hang


@dataclass(frozen=True)
class Reply:
    url: str
    status: int = 0                    # 0: no answer (see error)
    body: bytes = b""
    headers: dict = field(default_factory=dict)
    error: str = ""                    # why there is no answer, or "" ("timeout: ..." for a time-out)
    timed_out: bool = False
    unreachable: bool = False          # no connection could be made (refused): the peer never saw the request

    @property
    def ok(self) -> bool:
        return not self.error and 200 <= self.status < 300

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body as JSON (raises ValueError when it is not)."""
        return json.loads(self.body)


def split(url: str) -> tuple[str, int, str]:
    """(host, port, path with query) of an http:// or https:// URL."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"{url!r}: only http(s)://host:port URLs are fetched")
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    return u.hostname, u.port or (443 if u.scheme == "https" else 80), path


def client_context(ca_file: str | None = None):
    """TLS client settings for an https URL: the system's trusted CAs, or only ``ca_file`` (a box's private CA);
    the certificate and its host name are always checked."""
    import ssl
    return ssl.create_default_context(cafile=ca_file) if ca_file else ssl.create_default_context()


async def fetch(url: str, method: str = "GET", body: bytes = b"", headers: dict | None = None,
                timeout_s: float = 2.0, limit: int = DEFAULT_LIMIT, pool: Pool | None = None,
                tls=None) -> Reply:
    """Send one request and read its whole answer within ``timeout_s`` (connect, head and each read). An https
    URL speaks TLS with ``tls`` (an ``ssl.SSLContext``; default ``client_context()``)."""
    try:
        host, port, path = split(url)
        if url.startswith("https:") and tls is None:
            tls = client_context()
    except (ValueError, OSError) as e:
        return Reply(url, error=str(e))
    own = pool is None
    p = pool if pool is not None else Pool(host, port, connect_timeout_s=timeout_s,
                                           ssl=tls if url.startswith("https:") else None)
    try:
        h = dict(headers or {})
        if body and not any(k.lower() == "content-type" for k in h):
            h["Content-Type"] = "application/json"
        conn = await p.request(method, path, body, h, timeout_s)
        try:
            data = await conn.read_all(timeout_s, limit=limit)
            return Reply(url, conn.status, data, dict(conn.headers))
        finally:
            conn.release()
    except UpstreamTimeout as e:
        return Reply(url, error=f"timeout: {e}", timed_out=True)
    except UpstreamUnreachable as e:
        return Reply(url, error=str(e), unreachable=True)
    except UpstreamError as e:
        return Reply(url, error=str(e))
    finally:
        if own:
            p.close()


def fetch_sync(url: str, method: str = "GET", body: bytes = b"", headers: dict | None = None,
               timeout_s: float = 2.0, limit: int = DEFAULT_LIMIT, tls=None) -> Reply:
    """``fetch`` for code without an event loop (a running loop must ``await fetch`` instead)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("fetch_sync called from a running event loop: await appliance.wire.fetch.fetch")
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(fetch(url, method, body, headers, timeout_s, limit, tls=tls))
    finally:
        loop.close()


def get_json(url: str, timeout_s: float = 2.0) -> tuple[Any, str]:
    """(parsed JSON, "") of a GET, or (None, why not): for status pages read by command-line code."""
    r = fetch_sync(url, timeout_s=timeout_s)
    if not r.ok:
        return None, r.error or f"HTTP {r.status}: {r.text[:200]}"
    try:
        return r.json(), ""
    except ValueError as e:
        return None, f"not JSON: {e}"
