"""Runtime state of one engine behind the proxy: breaker, in-flight count, scraped load, served models."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .. import constants as C
from .breaker import OPEN, Breaker
from .config import BackendSpec
from ..wire.client import Pool, UpstreamError

LEG_KINDS = ("full", "prefill", "decode")   # a whole (aggregated) request, a P leg, a D leg


@dataclass(eq=False)
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
    pool: Pool | None = None           # request traffic
    probe_pool: Pool | None = None     # health probes and scrapes, never queued behind requests
    pending: set = field(default_factory=set)    # connections still waiting for their first byte
    prefill_backlog: int = 0          # uncached prompt tokens sent here whose first byte has not come back
    reserved_streams: int = 0         # admitted requests bound here whose legs have not started yet (admission.py)
    reserved_tokens: int = 0          # ... and their uncached prompt tokens
    prompt_chars_sent: int = 0        # prompt characters of every leg sent here (tokens.py calibration)
    chars_seen: int = 0               # prompt_chars_sent at the last scrape
    tokens_seen: float | None = None  # vllm:prompt_tokens_total at the last scrape
    legs: dict = field(default_factory=lambda: dict.fromkeys(LEG_KINDS, 0))           # served, by leg kind
    legs_inflight: dict = field(default_factory=lambda: dict.fromkeys(LEG_KINDS, 0))  # open now, by leg kind
    # hung-worker detection (stall.py): evidence that the engine still makes progress
    streams: set = field(default_factory=set)   # connections streaming an answer to a client now
    last_progress: float = 0.0        # monotonic: last byte on any leg, last leg answered, or counters grew
    itl_s: float = 0.0                # recent gap between two chunks of one stream (EWMA)
    work_seen: float | None = None    # token counters at the last scrape (prompt + generation + steps)
    stalls: int = 0                   # times it was found hung

    def __post_init__(self):
        u = urlsplit(self.spec.url)
        self.pool = Pool(u.hostname or C.LOOPBACK, u.port or 80)
        self.probe_pool = Pool(u.hostname or C.LOOPBACK, u.port or 80)

    @classmethod
    def from_config(cls, spec, cfg) -> "Backend":
        """A backend as the proxy's config asks: its breaker's thresholds, its pools' connect time-out."""
        b = cls(spec, Breaker(cfg.breaker_failures, cfg.breaker_open_s))
        b.pool.connect_timeout_s = b.probe_pool.connect_timeout_s = cfg.connect_timeout_s
        return b

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def label(self) -> str:
        return self.spec.label

    def trip(self, streams: bool = False) -> None:
        """The breaker opened: legs still waiting on this backend give up now and retry elsewhere; with
        ``streams`` (the engine is hung) the answers it is streaming fail too, and are continued elsewhere."""
        err = UpstreamError(f"{self.label}: breaker opened while waiting ({self.breaker.last_error})")
        for c in list(self.pending) + (list(self.streams) if streams else []):
            c.fail(err)
        self.pending.clear()

    def touch(self, now: float | None = None) -> None:
        """Evidence of progress (a byte arrived, a leg was answered, a leg starts on an idle engine)."""
        self.last_progress = time.monotonic() if now is None else now

    def chunk_gap(self, gap_s: float) -> None:
        self.itl_s = gap_s if self.itl_s == 0.0 else 0.8 * self.itl_s + 0.2 * gap_s

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
                "drained": b.drained,
                "requests": self.requests, "failures": self.failures, "running": self.running,
                "waiting": self.waiting, "kv_usage": self.kv_usage,
                "external_prefix_queries": self.ext_queries, "external_prefix_hits": self.ext_hits,
                "scrape_age_s": round(time.monotonic() - self.scraped_at, 3) if self.scraped_at else None,
                "scrape_error": self.scrape_error, "probe_ms": round(self.probe_ms, 2),
                "telemetry": self.spec.telemetry, "models": sorted(self.models),
                "legs": dict(self.legs), "legs_inflight": dict(self.legs_inflight),
                "prefill_backlog": self.prefill_backlog, "streams": len(self.streams),
                "itl_ms": round(self.itl_s * 1000, 1), "stalls": self.stalls}
