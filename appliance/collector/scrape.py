"""The collector's GETs: every request of a tick in flight at once on the wire client, answers as values.

The requests run on a private asyncio loop that the calling thread drives for the length of one batch (the
collector thread each tick, ``collect_once``, ``pdctl doctor``), on one keep-alive pool per endpoint
(host:port: no TCP handshake per scrape), each with a short time-out, so one hung endpoint
costs one time-out in all. A failure is a ``Reply`` whose ``error`` says why in the operator's words: "connection
refused (not listening)", "no answer within 0.5s", "HTTP 503" (the body kept). The Prometheus text is
parsed by appliance.wire.prom.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from typing import Any, Callable, Optional

from ..wire.client import Pool
from ..wire.fetch import client_context, Reply, fetch, split


class Scraper:
    """Keep-alive GETs to many endpoints at once; ``fetch_all({key: url})`` returns ``{key: Reply}``.

    ``fetch_all_while(urls, work)`` runs ``work()`` (the GPU sample) while the servers answer. One batch at a
    time (a lock, never held across a yield); not from a thread whose own event loop is running.
    """

    def __init__(self, timeout_s: float = 0.5):
        self.timeout_s = timeout_s
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._pools: dict[tuple, Pool] = {}          # (host, port) -> its keep-alive connections
        self._lock = threading.Lock()

    def fetch_all(self, urls: dict) -> dict:
        return self.fetch_all_while(urls, None)[0]

    def fetch_all_while(self, urls: dict, work: Optional[Callable[[], Any]]) -> tuple[dict, Any]:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            return self._loop.run_until_complete(self._batch(urls, work))

    async def _batch(self, urls: dict, work: Optional[Callable[[], Any]]) -> tuple[dict, Any]:
        tasks = {k: asyncio.ensure_future(self._get(u)) for k, u in urls.items()}
        done: Any = None
        if work is not None:
            await asyncio.sleep(0)           # every request written (or its connect begun) before the work
            try:
                done = work()
            except BaseException:
                for t in tasks.values():
                    t.cancel()
                await asyncio.gather(*tasks.values(), return_exceptions=True)
                raise
        if tasks:
            await asyncio.wait(tasks.values())
        return {k: t.result() for k, t in tasks.items()}, done

    async def _get(self, url: str) -> Reply:
        try:
            host, port, _ = split(url)
        except ValueError as e:
            return Reply(url, error=str(e))
        tls = url.startswith("https:")
        pool = self._pools.get((host, port, tls))
        if pool is None:
            pool = self._pools[(host, port, tls)] = Pool(host, port, self.timeout_s,
                                                         ssl=client_context() if tls else None)
        r = await fetch(url, timeout_s=self.timeout_s, pool=pool)
        if r.timed_out:
            return replace(r, error=f"no answer within {self.timeout_s:g}s")
        if not r.error and not 200 <= r.status < 300:
            return replace(r, error=f"HTTP {r.status}")
        return r

    def close(self) -> None:
        """Close every kept connection and the loop (a later batch opens new ones)."""
        with self._lock:
            loop, self._loop = self._loop, None
            pools, self._pools = list(self._pools.values()), {}
            for p in pools:
                p.close()
            if loop is not None:
                loop.run_until_complete(asyncio.sleep(0))     # the transports' close callbacks
                loop.close()


def parse_json(r: Reply) -> Any:
    """The body as JSON, or a string saying why it is not."""
    try:
        return r.json()
    except ValueError as e:
        return f"not JSON: {e}"
