"""Routing: least-outstanding prefiller, load-aware decoder with affinity, counted skips, round-robin."""
from __future__ import annotations

import asyncio
import time
from collections import Counter

import aiohttp

from appliance.proxy.backends import Backend
from appliance.proxy.breaker import Breaker
from appliance.proxy.config import BackendSpec
from appliance.proxy.routing import (SKIP_AGGREGATED, SKIP_CACHED, SKIP_SHORT, PdctlPolicy, PrefixIndex,
                                     RoundRobin, affinity_key)

from .conftest import make_cfg


def backends(role, n):
    return [Backend(BackendSpec(f"http://127.0.0.1:{9 + i}", role, f"{role}-{i}"), Breaker()) for i in range(n)]


def policy(cls=PdctlPolicy, p=2, d=3, min_tokens=512):
    return cls(backends("prefill", p), backends("decode", d), min_tokens, PrefixIndex())


def test_prefiller_with_least_outstanding_work_wins():
    pol = policy()
    a, b = pol.prefill
    a.inflight, b.inflight = 3, 1
    assert pol.pick_prefill() is b
    b.waiting = 5                       # the engine's own queue counts too
    assert pol.pick_prefill() is a
    assert pol.pick_prefill(excluded={a}) is b


def test_open_breakers_are_skipped():
    pol = policy()
    a, b = pol.prefill
    b.inflight = 9
    for _ in range(3):
        a.breaker.failure("down")
    assert pol.pick_prefill() is b
    for _ in range(3):
        b.breaker.failure("down")
    assert pol.pick_prefill() is None


def test_decoder_by_load_including_scraped_gauges():
    pol = policy()
    d0, d1, d2 = pol.decode
    now = time.monotonic()
    for d in pol.decode:
        d.scraped_at = now
    d0.running, d1.running, d2.running = 10, 2, 6
    assert pol.pick_decode(None) is d1
    d1.kv_usage = 0.95                  # nearly full KV cache weighs in
    d1.waiting = 3
    assert pol.pick_decode(None) is d2


def test_stale_scrapes_are_ignored():
    pol = policy(d=2)
    d0, d1 = pol.decode
    d0.running, d0.scraped_at = 50, time.monotonic() - 60
    d1.inflight = 1
    assert pol.pick_decode(None) is d0


def test_session_affinity_is_sticky_and_spreads():
    pol = policy(d=3)
    picks = {s: pol.pick_decode(affinity_key(s, "")) for s in (f"user-{i}" for i in range(60))}
    for s, d in picks.items():
        assert pol.pick_decode(affinity_key(s, "")) is d
    assert len(set(picks.values())) == 3


def test_affinity_yields_to_a_much_less_loaded_decoder():
    pol = policy(d=2)
    key = affinity_key("sess", "")
    pref = pol.pick_decode(key)
    other = next(d for d in pol.decode if d is not pref)
    pref.inflight = 2
    assert pol.pick_decode(key) is pref      # within the slack: stay
    pref.inflight = 10
    assert pol.pick_decode(key) is other     # far busier: move


def test_first_prompt_chunk_hash_is_the_default_affinity():
    sys_prompt = "You are a careful assistant. " * 60          # > one chunk
    a = affinity_key(None, sys_prompt + "question one")
    b = affinity_key(None, sys_prompt + "a different question")
    assert a == b and affinity_key("s1", sys_prompt) != a and affinity_key(None, "") is None


def test_conditional_skip_reasons():
    pol = policy(min_tokens=100)
    assert pol.skip_reason("short", 10) == SKIP_SHORT
    long_text = "x" * 4096          # four whole chunks: all storable
    assert pol.skip_reason(long_text, 1000) is None
    pol.prefix.record(long_text)
    assert pol.skip_reason(long_text + " and a short follow-up", 1005) == SKIP_CACHED
    assert pol.skip_reason(long_text + "y" * 4000, 2000) is None     # the new part is long: prefill it
    agg = PdctlPolicy([], backends("both", 1), 100, PrefixIndex())
    assert agg.skip_reason(long_text, 1000) == SKIP_AGGREGATED


def test_prefix_entries_expire():
    idx = PrefixIndex(ttl_s=10)
    text = "z" * 3000
    idx.record(text, now=0.0)
    assert idx.cached_chars(text, now=5.0) > 0 and idx.cached_chars(text, now=11.0) == 0


def test_round_robin_alternates_and_never_skips():
    pol = policy(RoundRobin, p=2, d=2, min_tokens=10**6)
    assert pol.skip_reason("tiny", 1) is None
    got = Counter(pol.pick_decode(affinity_key("same", "")).label for _ in range(10))
    assert got == {"decode-0": 5, "decode-1": 5}
    got = Counter(pol.pick_prefill().label for _ in range(10))
    assert got == {"prefill-0": 5, "prefill-1": 5}


async def test_skips_are_counted_by_reason_end_to_end(fresh, proxy_factory):
    e = fresh
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url], pd_min_prompt_tokens=50,
                                      canary_interval_s=60))
    long_prompt = "abcd" * 1280          # five whole chunks
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        for prompt in ("short one", long_prompt, long_prompt + " next turn"):
            async with s.post(px.url + "/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                                "max_tokens": 2}) as r:
                assert r.status == 200
        async with s.get(px.url + "/metrics") as r:
            text = await r.text()
    st = px.server.status()
    assert st["pd_skipped"] == {"short_prompt": 1, "prefix_cached": 1}
    assert 'pdctl_proxy_pd_skipped_total{reason="short_prompt"} 1.0' in text
    prompts = [x["body"]["prompt"] for x in e["p0"].log()]
    assert prompts.count(long_prompt) == 1 and "short one" not in prompts


async def first_canary(px, timeout: float = 30.0) -> None:
    """Wait until the proxy's start-up canary has finished, so it cannot interleave with a test's requests."""
    t0 = time.monotonic()
    while px.server.canary["last_ok"] is None:
        assert time.monotonic() - t0 < timeout, "the start-up canary did not finish"
        await asyncio.sleep(0.05)


async def test_decoder_choice_follows_scraped_engine_load(fresh, proxy_factory):
    e = fresh
    e["d0"].mode("ok", gauges={"running": 40, "waiting": 10})
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url, e["d1"].url], canary_interval_s=60))
    await first_canary(px)
    d0 = next(b for b in px.server.backends if b.label == "decode-0")
    t0 = time.monotonic()
    while d0.running < 40 and time.monotonic() - t0 < 30:      # scraped every 0.2 s
        await asyncio.sleep(0.05)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        for i in range(8):
            async with s.post(px.url + "/v1/completions", json={"model": "tiny", "prompt": f"p{i}",
                                                                "max_tokens": 2}) as r:
                assert r.status == 200
    mine = lambda k: [x for x in e[k].log() if x["body"]["prompt"].startswith("p") and
                      not x["body"]["prompt"].startswith("pdctl readiness canary")]
    assert not mine("d0")
    assert len(mine("d1")) == 8


async def test_round_robin_policy_end_to_end(fresh, proxy_factory):
    e = fresh
    px = await proxy_factory(make_cfg([e["p0"].url, e["p1"].url], [e["d0"].url, e["d1"].url],
                                      policy="round-robin", pd_min_prompt_tokens=10**6, canary_interval_s=60))
    await first_canary(px)   # the start-up canary takes one turn of each pool; then the test's requests alternate
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        for i in range(6):
            async with s.post(px.url + "/v1/completions", json={"model": "tiny", "prompt": f"rr{i}",
                                                                "max_tokens": 2}) as r:
                assert r.status == 200
    n = {k: len([x for x in e[k].log() if x["body"]["prompt"].startswith("rr")]) for k in ("p0", "p1", "d0", "d1")}
    assert n == {"p0": 3, "p1": 3, "d0": 3, "d1": 3}


async def test_prefix_index_forgotten_when_the_kv_server_goes_down(fresh, proxy_factory):
    """A KV server restart empties its L1: the proxy must stop skipping the P leg for prefixes it stored before."""
    from aiohttp import web
    up = {"ok": True}

    async def health(_req):
        return web.Response(status=200 if up["ok"] else 503, text="{}")
    app = web.Application()
    app.router.add_get("/healthcheck", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    kv_port = site._server.sockets[0].getsockname()[1]
    e = fresh
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url], pd_min_prompt_tokens=50, canary_interval_s=60,
                                      kv_url=f"http://127.0.0.1:{kv_port}", probe_interval_s=0.1))
    long_prompt = "wxyz" * 1280
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
            async def send(prompt):
                async with s.post(px.url + "/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                                    "max_tokens": 2}) as r:
                    assert r.status == 200
            await send(long_prompt)
            await send(long_prompt + " again")            # prefix stored: P leg skipped
            assert px.server.status()["pd_skipped"].get("prefix_cached") == 1
            up["ok"] = False                              # the KV server goes down (restart)
            t0 = time.monotonic()
            while px.server.kv_up:
                assert time.monotonic() - t0 < 30            # probed every 0.1 s
                await asyncio.sleep(0.05)
            up["ok"] = True
            await send(long_prompt + " after the restart")  # must take the P leg again
        st = px.server.status()
        assert st["pd_skipped"].get("prefix_cached") == 1 and st["kv_server"]["outages_seen"] == 1
        prompts = [x["body"]["prompt"] for x in e["p0"].log()]
        assert prompts.count(long_prompt + " after the restart") == 1
    finally:
        await runner.cleanup()
