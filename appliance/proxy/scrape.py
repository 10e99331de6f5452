"""Background loops: fast health probes (feed the breakers), vLLM /metrics scrapes (feed routing), and
/v1/models discovery (what the proxy serves, and each model's max_model_len)."""
from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from .. import constants as C

log = logging.getLogger("pdctl.proxy")

_WANT = {C.VLLM_RUNNING: "running", C.VLLM_WAITING: "waiting", C.VLLM_KV_USAGE: "kv_usage",
         C.VLLM_EXT_PREFIX_QUERIES + "_total": "ext_queries", C.VLLM_EXT_PREFIX_HITS + "_total": "ext_hits"}


def parse_load(text: str) -> dict:
    """Sum the gauges routing needs over all label sets (one per engine/DP rank); absent names stay absent."""
    out: dict = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = line.find("{")
        sp = line.rfind(" ")
        name = line[:name_end] if name_end != -1 else line[:line.find(" ")]
        key = _WANT.get(name)
        if key is None or sp == -1:
            continue
        try:
            out[key] = out.get(key, 0.0) + float(line[sp + 1:])
        except ValueError:
            continue
    return out


class Watcher:
    def __init__(self, state):
        self.s = state
        self._tasks: list = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._probe_loop()), loop.create_task(self._scrape_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def probe(self, b) -> None:
        cfg = self.s.cfg
        t0 = time.monotonic()
        try:
            async with self.s.probe_session.get(b.url + "/health",
                                                timeout=aiohttp.ClientTimeout(total=cfg.probe_timeout_s)) as r:
                await r.read()
                ok, why = r.status == 200, f"/health answered HTTP {r.status}"
        except asyncio.TimeoutError:
            ok, why = False, f"/health gave no answer within {cfg.probe_timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as e:
            ok, why = False, f"/health: {type(e).__name__}: {str(e)[:120]}"
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

    async def scrape(self, b) -> None:
        to = aiohttp.ClientTimeout(total=max(1.0, self.s.cfg.probe_timeout_s))
        try:
            async with self.s.probe_session.get(b.url + "/metrics", timeout=to) as r:
                text = await r.text(errors="replace") if r.status == 200 else ""
                if r.status != 200:
                    b.scrape_error = f"/metrics answered HTTP {r.status}"
                    return
            vals = parse_load(text)
            b.running, b.waiting = vals.get("running", 0.0), vals.get("waiting", 0.0)
            b.kv_usage = vals.get("kv_usage", 0.0)
            b.ext_queries, b.ext_hits = vals.get("ext_queries"), vals.get("ext_hits")
            b.scraped_at = time.monotonic()
            b.scrape_error = "" if "running" in vals else f"{C.VLLM_RUNNING} missing from /metrics"
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError, UnicodeError) as e:
            b.scrape_error = f"/metrics: {type(e).__name__}"

    async def models(self, b) -> None:
        try:
            async with self.s.probe_session.get(b.url + "/v1/models", headers=self.s.backend_headers(),
                                                timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                if r.status != 200:
                    return
                ans = await r.json(content_type=None)
            found = {}
            for m in ans.get("data", []) if isinstance(ans, dict) else []:
                if isinstance(m, dict) and isinstance(m.get("id"), str):
                    mml = m.get("max_model_len")
                    found[m["id"]] = mml if isinstance(mml, int) and not isinstance(mml, bool) else None
            b.models = found
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return

    async def _scrape_loop(self) -> None:
        n = 0
        while True:
            jobs = [self.scrape(b) for b in self.s.backends]
            if n % 5 == 0 or not self.s.known_models():
                jobs += [self.models(b) for b in self.s.backends]
            await asyncio.gather(*jobs, return_exceptions=True)
            n += 1
            await asyncio.sleep(self.s.cfg.scrape_interval_s)
