"""Background loops: fast health probes (feed the breakers), vLLM /metrics scrapes (feed routing), and
/v1/models discovery (what the proxy serves, and each model's max_model_len)."""
from __future__ import annotations

import asyncio
import json
import logging
import time

from .. import constants as C
from .. import metric_names as N
from ..wire.client import UpstreamError, UpstreamTimeout
from ..wire.prom import parse_metrics
from ..wire.tasks import cancel_and_wait

log = logging.getLogger("pdctl.proxy")

# what routing and hung-worker detection read from an engine's /metrics: logical name -> sample suffix
_LOAD = {"running": "", "waiting": "", "kv_usage": "", "ext_queries": "_total", "ext_hits": "_total",
         "prompt_tokens": "_total", "gen_tokens": "_total", "steps": "_count"}
_LOAD_NAMES = N.all_names({k: N.VLLM[k] for k in _LOAD})


def parse_load(text: str) -> dict:
    """The load figures, summed over all label sets (one per engine/DP rank), under whichever name this
    engine version exposes (metric_names: renamed metrics read right on older vLLM); absent ones stay absent."""
    m = parse_metrics(text, _LOAD_NAMES)
    if isinstance(m, str):
        return {}
    out: dict = {}
    for logical, suffix in _LOAD.items():
        name = N.resolve(N.VLLM, logical, m.names)
        v = m.total(name, suffix) if name is not None else None
        if v is not None:
            out[logical] = v
    return out


class Watcher:
    def __init__(self, state):
        self.s = state
        self._tasks: list = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._probe_loop()), loop.create_task(self._scrape_loop())]
        if self.s.cfg.kv_url:
            self._tasks.append(loop.create_task(self._kv_loop()))

    async def _kv_loop(self) -> None:
        """Watch the KV server: when it is down (restarting) its L1 is gone, so every prefix the proxy believed
        stored is forgotten (else the P leg would be skipped for prefixes the decoders can no longer load)."""
        from urllib.parse import urlsplit
        from ..wire.client import Pool
        u = urlsplit(self.s.cfg.kv_url)
        pool = Pool(u.hostname or C.LOOPBACK, u.port or 80, self.s.cfg.connect_timeout_s)
        was_up = True
        try:
            while True:
                try:
                    conn = await pool.request("GET", "/healthcheck", b"", None, self.s.cfg.probe_timeout_s)
                    try:
                        up = conn.status == 200
                        await conn.read_all(self.s.cfg.probe_timeout_s, limit=65536)
                    finally:
                        conn.release()
                except UpstreamError:
                    up = False
                if not up and was_up:
                    self.s.prefix.clear()
                    self.s.counts["kv_server:down"] += 1
                self.s.kv_up = up
                was_up = up
                await asyncio.sleep(self.s.cfg.probe_interval_s)
        finally:
            pool.close()

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)

    async def _get(self, b, path: str, timeout_s: float) -> tuple:
        """(status, body) of one GET on the backend's probe connections (apart from request traffic)."""
        conn = await b.probe_pool.request("GET", path, b"", self.s.backend_headers(), timeout_s)
        try:
            status = conn.status
            body = await conn.read_all(timeout_s, limit=16 * 1024 * 1024)
        finally:
            conn.release()
        return status, body

    async def probe(self, b) -> None:
        cfg = self.s.cfg
        t0 = time.monotonic()
        try:
            status, _ = await self._get(b, "/health", cfg.probe_timeout_s)
            ok, why = status == 200, f"/health answered HTTP {status}"
        except UpstreamTimeout:
            ok, why = False, f"/health gave no answer within {cfg.probe_timeout_s:g} s"
        except UpstreamError as e:
            ok, why = False, f"/health: {e}"
        b.probed_at = time.monotonic()
        b.probe_ms = (b.probed_at - t0) * 1000
        if ok:
            b.breaker.success("probe")
        else:
            b.record_failure(f"{b.label}: {why}", "probe")
        self.s.metrics.set_backend_states([b])

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.probe(b) for b in self.s.backends), return_exceptions=True)
            await asyncio.sleep(self.s.cfg.probe_interval_s)

    def _calibrate(self, b, tokens) -> None:
        """Feed the characters sent to ``b`` since its last scrape and its prompt-token growth to the
        server's chars-per-token estimate (tokens.py)."""
        if tokens is None:
            return
        if b.tokens_seen is not None:
            self.s.chars_per_token.observe(b.prompt_chars_sent - b.chars_seen, tokens - b.tokens_seen)
        b.tokens_seen, b.chars_seen = tokens, b.prompt_chars_sent

    async def scrape(self, b) -> None:
        try:
            status, body = await self._get(b, "/metrics", max(1.0, self.s.cfg.probe_timeout_s))
        except UpstreamError as e:
            b.scrape_error = f"/metrics: {e}"
            return
        if status != 200:
            b.scrape_error = f"/metrics answered HTTP {status}"
            return
        vals = parse_load(body.decode("utf-8", "replace"))
        b.running, b.waiting = vals.get("running", 0.0), vals.get("waiting", 0.0)
        b.kv_usage = vals.get("kv_usage", 0.0)
        b.ext_queries, b.ext_hits = vals.get("ext_queries"), vals.get("ext_hits")
        self._calibrate(b, vals.get("prompt_tokens"))
        b.scraped_at = time.monotonic()
        work = sum(vals.get(k, 0.0) for k in ("prompt_tokens", "gen_tokens", "steps"))
        if b.work_seen is not None and work > b.work_seen:
            b.touch(b.scraped_at)      # the engine works (maybe for others): not hung (stall.py)
        b.work_seen = work
        b.scrape_error = "" if "running" in vals else f"{C.VLLM_RUNNING} missing from /metrics"

    async def models(self, b) -> None:
        try:
            status, body = await self._get(b, "/v1/models", 2.0)
            ans = json.loads(body) if status == 200 else None
        except (UpstreamError, ValueError):
            return
        found = {}
        for m in ans.get("data", []) if isinstance(ans, dict) else []:
            if isinstance(m, dict) and isinstance(m.get("id"), str):
                mml = m.get("max_model_len")
                found[m["id"]] = mml if isinstance(mml, int) and not isinstance(mml, bool) else None
        if found or status == 200:
            b.models = found

    async def _scrape_loop(self) -> None:
        n = 0
        while True:
            jobs = [self.scrape(b) for b in self.s.backends]
            if n % 5 == 0 or not self.s.known_models():
                jobs += [self.models(b) for b in self.s.backends]
            await asyncio.gather(*jobs, return_exceptions=True)
            n += 1
            await asyncio.sleep(self.s.cfg.scrape_interval_s)
