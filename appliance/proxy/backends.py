"""Runtime state of one engine behind the proxy: breaker, in-flight count, scraped load, served models."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from .breaker import OPEN, Breaker
from .config import BackendSpec


@dataclass
class Backend:
    spec: BackendSpec
    breaker: Breaker
    inflight: int = 0                 # legs this proxy has open on it now
    running: float = 0.0              # vllm:num_requests_running (last scrape)
    waiting: float = 0.0              # vllm:num_requests_waiting
    kv_usage: float = 0.0             # vllm:kv_cache_usage_perc (0..1)
    ext_queries: float | None = None  # vllm:external_prefix_cache_queries_total (KV from LMCache: asked)
    ext_hits: float | None = None     # vllm:external_prefix_cache_hits_total (found)
    scraped_at: float = 0.0           # monotonic; 0 = never
    scrape_error: str = ""
    probed_at: float = 0.0
    probe_ms: float = 0.0
    models: dict = field(default_factory=dict)   # model id -> max_model_len (or None)
    requests: int = 0
    failures: int = 0
    _tripped: asyncio.Future | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def label(self) -> str:
        return self.spec.label

    def tripped(self) -> asyncio.Future:
        """Resolves when this backend's breaker opens: legs waiting on it give up and retry elsewhere."""
        if self._tripped is None or self._tripped.done():
            self._tripped = asyncio.get_running_loop().create_future()
        return self._tripped

    def trip(self) -> None:
        if self._tripped is not None and not self._tripped.done():
            self._tripped.set_result(True)

    def record_failure(self, reason: str, source: str = "request") -> None:
        if source == "request":
            self.failures += 1
        if self.breaker.failure(reason, source) or self.breaker.state == OPEN:
            self.trip()

    def load(self) -> float:
        """Decoder load score: proxy in-flight legs plus the engine's own queue, KV pressure weighted in."""
        fresh = self.scraped_at and time.monotonic() - self.scraped_at < 5.0
        engine = (self.running + 2.0 * self.waiting + 8.0 * self.kv_usage) if fresh else 0.0
        return self.inflight + engine

    def status(self) -> dict:
        b = self.breaker
        return {"name": self.label, "url": self.url, "role": self.spec.role, "state": b.state,
                "consecutive_failures": b.consecutive_failures, "last_error": b.last_error,
                "opened_by": b.opened_by, "transitions": b.transitions, "inflight": self.inflight,
                "requests": self.requests, "failures": self.failures, "running": self.running,
                "waiting": self.waiting, "kv_usage": self.kv_usage,
                "external_prefix_queries": self.ext_queries, "external_prefix_hits": self.ext_hits,
                "scrape_age_s": round(time.monotonic() - self.scraped_at, 3) if self.scraped_at else None,
                "scrape_error": self.scrape_error, "probe_ms": round(self.probe_ms, 2),
                "telemetry": self.spec.telemetry, "models": sorted(self.models)}
