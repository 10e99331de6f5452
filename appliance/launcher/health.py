"""One short HTTP health probe, classified the way a launcher needs it.

vLLM binds its port before the model is loaded and may answer slowly while it loads, so a probe has a
short time-out and a time-out means "starting", never "dead". One request on the wire client
(``fetch_sync``: a connection and a private event loop per probe, closed after it; it runs once a second
for the whole life of every engine).
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from ..wire.fetch import fetch_sync

HEALTHY, STARTING, UNHEALTHY, CLOSED = "healthy", "starting", "unhealthy", "closed"
_BODY_LIMIT = 64 * 1024          # a health answer is empty or short; a longer one is an error, not a hang


@dataclass(frozen=True)
class Probe:
    state: str   # healthy (200) | starting (time-out) | unhealthy (other status) | closed (nothing listens)
    detail: str  # one line for STATUS= and logs

    @property
    def ok(self) -> bool:
        return self.state == HEALTHY


def probe(url: str, timeout_s: float = 2.0) -> Probe:
    """GET ``url`` once; never raises."""
    parts = urlsplit(url)
    port = parts.port or 80
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    r = fetch_sync(url, headers={"Connection": "close"}, timeout_s=timeout_s, limit=_BODY_LIMIT)
    if r.timed_out:
        return Probe(STARTING, f"{path} did not answer within {timeout_s:g} s")
    if r.unreachable:                                # refused: nothing listens there
        return Probe(CLOSED, f"port {port} not open yet")
    if r.error:
        return Probe(UNHEALTHY, f"{path} failed: {r.error}")
    if r.status == 200:
        return Probe(HEALTHY, f"{path} 200")
    return Probe(UNHEALTHY, f"{path} answered HTTP {r.status}")
