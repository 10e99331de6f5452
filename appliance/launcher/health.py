"""One short HTTP health probe, classified the way a launcher needs it.

vLLM binds its port before the model is loaded and may answer slowly while it loads, so a probe has a
short time-out and a time-out means "starting", never "dead". Stdlib only: this runs once a second for
the whole life of every engine.
"""
from __future__ import annotations

import http.client
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

HEALTHY, STARTING, UNHEALTHY, CLOSED = "healthy", "starting", "unhealthy", "closed"


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
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        resp = conn.getresponse()
        resp.read(4096)
        if resp.status == 200:
            return Probe(HEALTHY, f"{path} 200")
        return Probe(UNHEALTHY, f"{path} answered HTTP {resp.status}")
    except (socket.timeout, TimeoutError):
        return Probe(STARTING, f"{path} did not answer within {timeout_s:g} s")
    except ConnectionRefusedError:
        return Probe(CLOSED, f"port {port} not open yet")
    except (OSError, http.client.HTTPException) as exc:
        return Probe(UNHEALTHY, f"{path} failed: {type(exc).__name__}: {exc}")
    finally:
        conn.close()
