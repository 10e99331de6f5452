"""LMCache store-finished telemetry: the D leg waits for its prefill's KV store, bounded, counted."""
from __future__ import annotations

import asyncio
import time

import aiohttp

from appliance.proxy.telemetry import StoreWaiter, extract_ids, new_request_id

from .conftest import make_cfg

BODY = {"model": "tiny", "prompt": "a prompt", "max_tokens": 3, "stream": True}


def test_ids_are_found_inside_vllm_wrapping():
    rid = new_request_id()
    assert extract_ids(f"cmpl-{rid}-0-8d6b96cd") == [rid]
    assert extract_ids(f"chatcmpl-{rid}-1-deadbeef") == [rid]
    assert extract_ids(rid) == [rid]
    assert extract_ids("cmpl-f4e02687-d12a-4b-0-8d6b96cd") == []
    assert extract_ids(None) == []


async def test_waiter_released_by_the_event():
    w = StoreWaiter()
    rid = new_request_id()
    w.expect(rid)
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, w.handle, {"event": "request_store_finished", "request_ids_set": [f"cmpl-{rid}-0-aa"]})
    t0 = time.monotonic()
    assert await w.wait(rid, 30.0) is True                 # True: the event, not the time-out, ended the wait
    assert time.monotonic() - t0 < 15 and w.matched == 1   # ~0.05 s; a wait held to its 30 s time-out fails


async def test_waiter_needs_every_tp_rank():
    w = StoreWaiter()
    rid = new_request_id()
    w.expect(rid)
    ev = {"event": "request_store_finished", "request_ids_set": [f"cmpl-{rid}-0-aa"], "world_size": 2}
    w.handle(dict(ev, kv_rank=0))
    assert await w.wait(rid, 0.05) is False           # one of two ranks stored: not yet
    w.expect(rid)
    w.handle(dict(ev, kv_rank=0))
    w.handle(dict(ev, kv_rank=1))
    assert await w.wait(rid, 0.5) is True


async def test_waiter_times_out_and_event_before_expect_still_counts():
    w = StoreWaiter()
    rid = new_request_id()
    w.expect(rid)
    assert await w.wait(rid, 0.05) is False
    early = new_request_id()
    w.handle({"event": "request_store_finished", "request_ids_set": [f"cmpl-{early}-0-bb"]})
    w.expect(early)
    assert await w.wait(early, 0.01) is True


def test_waiter_ignores_junk():
    w = StoreWaiter()
    for junk in (None, [], "x", {"event": "other"}, {"event": "request_store_finished", "request_ids_set": 5},
                 {"event": "request_store_finished", "request_ids_set": [1, None, {}]}):
        assert w.handle(junk)[0] == 0


async def with_telemetry_prefiller(spawn, fresh, proxy_factory, kv_wait_s: float) -> tuple:
    """(prefiller, proxy): a stand-in prefiller whose KV the proxy waits for (up to ``kv_wait_s``) before d0."""
    from appliance.proxy.config import BackendSpec
    pre = spawn()
    cfg = make_cfg([], [fresh["d0"].url], canary_interval_s=60, kv_wait_s=kv_wait_s)
    cfg = cfg.__class__(**{**cfg.__dict__, "backends": (BackendSpec(pre.url, "prefill", "prefill-0", True),)
                           + cfg.backends})
    return pre, await proxy_factory(cfg)


async def test_decode_leg_waits_for_the_store(spawn, fresh, proxy_factory):
    # a telemetry-posting prefiller (as with LMCACHE_REQUEST_TELEMETRY_TYPE=fastapi), 0.3 s store delay; the
    # proxy would wait up to 30 s for it, so only the store event can end the wait this soon
    pre, px = await with_telemetry_prefiller(spawn, fresh, proxy_factory, kv_wait_s=30.0)
    pre.call("/_control", {"mode": "ok", "store_delay_s": 0.3,
                           "telemetry": px.internal + "/api/v1/telemetry"})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        t0 = time.monotonic()
        async with s.post(px.url + "/v1/completions", json=BODY) as r:
            assert r.status == 200
            await r.read()
        took = time.monotonic() - t0
    p = [x for x in pre.log() if x["body"]["prompt"] == "a prompt"][0]
    d = [x for x in fresh["d0"].log() if x["body"]["prompt"] == "a prompt"][0]
    assert d["t"] - p["t"] >= 0.28                 # D left only after the store finished (its 0.3 s sleep)
    assert took < 15                               # ~0.4 s; the 30 s wait bound would be a hang
    st = px.server.status()
    # ended by the event, counted; the proxy's own KV warm-up of the prefiller (warmup.py, one long request when it
    # is first seen) may post its store event in the same moments (ci38, a busy machine: matched 2)
    assert st["kv_wait"] == {"stored": 1} and st["telemetry"]["matched"] >= 1


async def test_store_wait_is_bounded_and_the_timeout_counted(spawn, fresh, proxy_factory):
    # the store would finish after 60 s: the 0.2 s bound, not the store, must end the wait (the count says which)
    pre, px = await with_telemetry_prefiller(spawn, fresh, proxy_factory, kv_wait_s=0.2)
    pre.call("/_control", {"store_delay_s": 60.0, "telemetry": px.internal + "/api/v1/telemetry"})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=45)) as s:
        t0 = time.monotonic()
        async with s.post(px.url + "/v1/completions", json=BODY) as r:
            assert r.status == 200
            assert (await r.read()).rstrip().endswith(b"[DONE]")
        assert time.monotonic() - t0 < 30          # ~0.3 s; a wait for the 60 s store would be cut by this
    assert px.server.status()["kv_wait"] == {"timeout": 1}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        async with s.get(px.url + "/metrics") as r:
            assert 'pdctl_proxy_kv_store_wait_total{outcome="timeout"} 1.0' in await r.text()


async def test_telemetry_endpoint_answers_like_the_seed(pd):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        async with s.post(pd.internal + "/api/v1/telemetry", json={"event": "request_store_finished",
                                                                   "request_ids_set": ["cmpl-x-0-aa"]}) as r:
            assert r.status == 200
            assert await r.json() == {"status": "ok", "notified": 0, "total": 1}
        async with s.post(pd.internal + "/api/v1/telemetry", data=b"{not json") as r:
            assert r.status == 400
