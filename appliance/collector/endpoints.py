"""Which URLs a tick reads and which worker a proxy backend label stands for, built once per plan."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from appliance import constants as C

PROXY_STATUS_PATH = C.BOX_STATUS_PATH     # the proxy's loopback status JSON (backends, breakers, uptime)


@dataclass(frozen=True)
class Endpoints:
    """Every URL of a tick and the names backends map to, built once per plan object."""
    urls: dict                   # key ("w_metrics:<instance>", "kv_status", "px_ready", ...) -> URL
    wunit: dict                  # worker instance -> unit name (a property of the plan that formats)
    by_port: dict                # worker port -> instance (the proxy may label a backend by its URL)
    unit_names: tuple
    proxy_url: str

    @classmethod
    def of(cls, plan: Any) -> "Endpoints":
        px = plan.proxy
        kvu = plan.kv_server.http_url
        tls = bool(getattr(px, "tls_cert_file", ""))
        proxy_url = f"{'https' if tls else 'http'}://{C.LOOPBACK}:{px.port}"
        # the proxy's own numbers: from the public port as a client sees it, unless TLS or keys guard it (then
        # from the loopback side door, which answers /metrics and /ready without a key and without TLS)
        guarded = tls or bool(getattr(px, "keys_file", "") or getattr(px, "api_key_file", ""))
        read = f"http://{C.LOOPBACK}:{px.internal_port}" if guarded else proxy_url
        urls: dict[str, str] = {"kv_health": kvu + "/healthcheck", "kv_status": kvu + "/status",
                                "kv_metrics": kvu + "/metrics", "px_metrics": read + "/metrics",
                                "px_ready": read + "/ready",
                                "px_status": f"http://{C.LOOPBACK}:{px.internal_port}{PROXY_STATUS_PATH}"}
        for w in plan.workers:
            urls[f"w_health:{w.instance}"] = w.url() + "/health"
            urls[f"w_metrics:{w.instance}"] = w.url() + "/metrics"
        wunit = {w.instance: w.unit for w in plan.workers}
        return cls(urls=urls, wunit=wunit, by_port={w.port: w.instance for w in plan.workers},
                   unit_names=(C.KV_UNIT, C.PROXY_UNIT, *wunit.values()), proxy_url=proxy_url)

    def who(self, name: str, url: str = "") -> str:
        """The plan instance a proxy backend label stands for: its name, or the worker on its URL's port."""
        if name in self.wunit:
            return name
        url = url or name
        try:
            return self.by_port.get(int(url.rstrip("/").rsplit(":", 1)[1]), name or url)
        except (ValueError, IndexError):
            return name or url
