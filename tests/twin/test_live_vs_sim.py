"""The live twin engines agree with the simulator (TTFT p50 within 15 % at 2 and 5 req/s).

A plain P-then-D client like the seed's proxy: P leg with ``max_tokens=1``, wait for LMCache's
``request_store_finished`` telemetry of that request, then the streamed D leg; TTFT measured at the
client. The engines run in real time (``--time-scale 1``: a faster scale also speeds up the twin's
own per-request Python work relative to nothing, which inflates TTFT on a loaded 2-core machine); ~30 s.
Outputs are 32 tokens to bound the streaming load.
"""
import asyncio
import json
import random
import secrets
import statistics
import time

import aiohttp
import pytest
from aiohttp import web

from appliance.twin.simulator import Workload, simulate

from .conftest import free_port, prompt_text

SCALE = 1.0
WL = Workload(input_len=7869, prefix_len=6000, output_len=32)


async def run_client(p_url: str, d_url: str, rate: float, n: int, events: dict, base_k: int) -> list[float]:
    rng = random.Random(11)
    ttfts: list[float] = []

    def prepare(k: int):
        text = prompt_text(WL.prefix_len, WL.input_len - WL.prefix_len, k)
        return (secrets.token_hex(8), json.dumps({"model": "twin-m", "prompt": text, "max_tokens": 1}),
                json.dumps({"model": "twin-m", "prompt": text, "max_tokens": WL.output_len, "stream": True}))

    async def one(sess, prepared, delay: float):
        xrid, p_body, d_body = prepared
        stored = events.setdefault(xrid, asyncio.Event())
        hdr = {"X-Request-Id": xrid, "Content-Type": "application/json"}
        await asyncio.sleep(delay - (time.monotonic() - start))
        t0 = time.monotonic()
        async with sess.post(p_url, data=p_body, headers=hdr) as r:
            assert r.status == 200
            await r.read()
        await asyncio.wait_for(stored.wait(), 30)
        async with sess.post(d_url, data=d_body, headers=hdr) as r:
            first = None
            async for line in r.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.monotonic()
            ttfts.append((first - t0) / SCALE)

    t, delays = 0.0, []
    for _ in range(n):
        delays.append(t)
        t += rng.expovariate(rate / SCALE)
    bodies = [prepare(base_k + i) for i in range(n)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as sess:
        start = time.monotonic()
        await asyncio.gather(*(one(sess, b, d) for b, d in zip(bodies, delays)))
    return ttfts


async def telemetry_server(events: dict):
    async def handle(req):
        body = await req.json()
        for rid in body["request_ids_set"]:
            xrid = rid.split("-")[1]
            events.setdefault(xrid, asyncio.Event()).set()
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/api/v1/telemetry", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/api/v1/telemetry"


@pytest.mark.slow
async def test_live_engines_agree_with_simulator(procs):
    events: dict = {}
    runner, url = await telemetry_server(events)
    try:
        zp, _ = procs.kvserver()
        env = {"LMCACHE_REQUEST_TELEMETRY_TYPE": "fastapi", "LMCACHE_REQUEST_TELEMETRY_ENDPOINT": url}
        pp, _ = procs.engine("prefill", zp, "--time-scale", str(SCALE), env=env)
        dp1, _ = procs.engine("decode", zp, "--time-scale", str(SCALE))
        p_url = f"http://127.0.0.1:{pp}/v1/completions"
        d_url = f"http://127.0.0.1:{dp1}/v1/completions"
        await run_client(p_url, d_url, 1.0, 1, events, 600)          # warm-up: the shared prefix is stored
        results = {}
        for rate, n, base in ((2.0, 30, 0), (5.0, 40, 100)):
            live = statistics.median(await run_client(p_url, d_url, rate, n, events, base))
            sim = simulate(prefill=1, decode=1, workload=WL, rates=[rate], num_prompts=300)[0]["p50_ttft_ms"] / 1e3
            results[rate] = (live, sim)
        print("live vs sim TTFT p50 (s):", results)
        for rate, (live, sim) in results.items():
            assert abs(live - sim) / sim < 0.15, results
    finally:
        await runner.cleanup()
