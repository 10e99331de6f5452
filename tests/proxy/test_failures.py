"""Honest failure behaviour against engines that crash, hang, answer 500 or die mid-stream."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from appliance.policy.decide import Thresholds

from .conftest import make_cfg

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}


async def post(url, body, timeout=10, session_id=None):
    headers = {"X-Session-Id": session_id} if session_id else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        async with s.post(url + "/v1/chat/completions", json=body, headers=headers,
                          timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, await r.read()


def error_of(raw: bytes) -> dict:
    return json.loads(raw)["error"]


async def test_decode_500_retried_on_another_decoder_before_first_byte(fresh, proxy_factory):
    e = fresh
    e["d0"].mode("error500")
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url, e["d1"].url], canary_interval_s=60))
    for i in range(24):                       # distinct sessions spread over both decoders (affinity)
        status, raw = await post(px.url, CHAT, session_id=f"s{i}")
        assert status == 200 and raw.rstrip().endswith(b"[DONE]")
    st = px.server.status()
    assert st["retries"] >= 1
    assert any(b["failures"] >= 1 for b in st["backends"] if b["name"] == "decode-0")


async def test_prefill_500_retried_on_another_prefiller(fresh, proxy_factory):
    e = fresh
    e["p0"].mode("error500")
    px = await proxy_factory(make_cfg([e["p0"].url, e["p1"].url], [e["d0"].url]))
    for _ in range(3):
        status, _ = await post(px.url, CHAT)
        assert status == 200
    assert px.server.counts["retries"] >= 1


@pytest.mark.parametrize("policy", ["pdctl", "adaptive"])
async def test_prefill_failure_never_dispatches_decode_when_told_to_fail(fresh, proxy_factory, policy):
    """on_prefill_failure = "fail" holds for every policy (the adaptive one too): a 503, no D leg."""
    e = fresh
    e["p0"].mode("error500")
    e["p1"].mode("error500")
    px = await proxy_factory(make_cfg([e["p0"].url, e["p1"].url], [e["d0"].url], canary_interval_s=60,
                                      on_prefill_failure="fail", policy=policy, pd_min_prompt_tokens=0,
                                      thresholds=Thresholds(aggregate_max_uncached=0, split_idle_max_running=1000)))
    await asyncio.sleep(0.1)
    status, raw = await post(px.url, dict(CHAT, messages=[{"role": "user", "content": "p-fail"}]))
    assert status == 503
    err = error_of(raw)
    assert err["code"] in ("prefill_failed", "no_prefiller") and "HTTP 500" in err["message"]
    assert not [x for x in e["d0"].log() if x["body"].get("messages", [{}])[0].get("content") == "p-fail"]


async def test_prefill_fallback_to_decode_is_the_default_and_counted(fresh, proxy_factory):
    """Hard P/D roles too (policy pdctl): a failed prefiller means the decoder prefills (no 503)."""
    e = fresh
    e["p0"].mode("error500")
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url], max_attempts=1, policy="pdctl"))
    status, _ = await post(px.url, CHAT)
    assert status == 200
    assert px.server.status()["pd_skipped"].get("prefill_unavailable") == 1


async def test_hanging_decoder_times_out_and_retries(fresh, proxy_factory):
    e = fresh
    e["d0"].mode("hang_gen")
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url, e["d1"].url], first_byte_timeout_s=0.5))
    t0 = time.monotonic()
    for i in range(3):
        status, raw = await post(px.url, CHAT, session_id=f"h{i}")
        assert status == 200 and raw.rstrip().endswith(b"[DONE]")
    assert time.monotonic() - t0 < 30     # ~1 s (one 0.5 s time-out, then d1); d0 never answers: a hang bound


async def test_fully_hung_backend_is_opened_by_probes_within_a_second(fresh, proxy_factory):
    e = fresh
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url, e["d1"].url], probe_timeout_s=0.3,
                                      probe_interval_s=0.1))
    e["d0"].mode("hang_all")
    t0 = time.monotonic()
    d0 = next(b for b in px.server.backends if b.label == "decode-0")
    while d0.breaker.state == "closed" and time.monotonic() - t0 < 30:
        await asyncio.sleep(0.05)
    # opened before any request was sent (its probes: 0.3 s time-outs every 0.1 s, ~1 s); that time is the probe
    # settings' arithmetic, so the verdict is the state, which a busy machine cannot break
    assert d0.breaker.state != "closed"
    status, _ = await post(px.url, CHAT)
    assert status == 200


async def test_crashed_engine_is_retried_elsewhere_and_breaker_opens(spawn, fresh, proxy_factory):
    a, b = spawn(2)
    px = await proxy_factory(make_cfg([fresh["p0"].url], [a.url, b.url], canary_interval_s=60))
    a.mode("crash")
    for i in range(40):                       # until affinity lands a session on the crashing engine
        status, raw = await post(px.url, CHAT, session_id=f"c{i}")
        assert status == 200, raw             # the crash is never visible to a client
        if not a.alive() and i >= 3:
            break
    assert not a.alive()
    d0 = next(x for x in px.server.backends if x.url == a.url)
    t0 = time.monotonic()
    while d0.breaker.state == "closed" and time.monotonic() - t0 < 30:
        await asyncio.sleep(0.05)
    assert d0.breaker.state == "open" and d0.breaker.last_error


async def test_mid_stream_death_ends_with_an_error_event_never_done(fresh, proxy_factory):
    e = fresh
    e["d0"].mode("die_mid_stream")
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url]))
    status, raw = await post(px.url, dict(CHAT, max_tokens=8))
    assert status == 200                          # the first bytes were already out
    assert b"data: [DONE]" not in raw
    last = [x for x in raw.split(b"\n\n") if x][-1]
    err = json.loads(last[len(b"data: "):])["error"]
    assert err["code"] == "stream_broken" and "decode-0" in err["message"]
    assert px.server.counts["chat:stream_error"] == 1


async def test_stream_without_done_is_not_a_silent_success(fresh, proxy_factory):
    """The engine ends cleanly but without [DONE]: without migration that is an error event; with it, the
    answer was complete (its finish_reason went out), so only the end is added, counted as completed."""
    e = fresh
    e["d0"].mode("no_done")
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url], max_migrations=0))
    status, raw = await post(px.url, CHAT)
    assert b"data: [DONE]" not in raw and b'"stream_broken"' in raw
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url]))
    status, raw = await post(px.url, CHAT)
    assert raw.endswith(b"data: [DONE]\n\n") and b"error" not in raw
    assert px.server.status()["migrations"] == {"completed": 1}


async def test_death_before_first_byte_is_retried(fresh, proxy_factory):
    e = fresh
    e["d0"].mode("die_before_first")
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url, e["d1"].url]))
    for i in range(6):
        status, raw = await post(px.url, CHAT, session_id=f"b{i}")
        assert status == 200 and raw.rstrip().endswith(b"[DONE]")


async def test_no_backend_at_all_is_a_503_with_a_reason(spawn, proxy_factory):
    dead = spawn()
    url = dead.url
    dead.kill()
    px = await proxy_factory(make_cfg([], [url], canary_interval_s=60, probe_interval_s=0.05))
    t0 = time.monotonic()                         # probes open the breaker (connection refused): ~0.2 s
    while px.server.backends[0].breaker.state != "open" and time.monotonic() - t0 < 30:
        await asyncio.sleep(0.05)
    status, raw = await post(px.url, CHAT)
    assert status == 503
    err = error_of(raw)
    assert err["code"] == "no_decoder" and "open" in err["message"] and err["type"] == "service_unavailable"


async def test_client_disconnect_cancels_the_upstream_leg(fresh, proxy_factory):
    e = fresh
    e["d0"].mode("ok", token_delay_s=0.2)
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url]))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        r = await s.post(px.url + "/v1/chat/completions", json=dict(CHAT, max_tokens=50))
        await r.content.readany()                 # streaming has begun
        r.close()                                 # the client goes away
    t0 = time.monotonic()
    while e["d0"].state()["cancelled"] == 0 and time.monotonic() - t0 < 30:
        await asyncio.sleep(0.05)
    assert e["d0"].state()["cancelled"] == 1
    assert e["d0"].state()["active"] == 0


async def test_client_disconnect_during_prefill_cancels_it(fresh, proxy_factory):
    e = fresh
    e["p0"].mode("hang_gen")
    px = await proxy_factory(make_cfg([e["p0"].url], [e["d0"].url], canary_interval_s=60))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        try:
            await s.post(px.url + "/v1/chat/completions", json=dict(CHAT, messages=[{"role": "user",
                                                                                       "content": "gone"}]),
                         timeout=aiohttp.ClientTimeout(total=0.3))
        except asyncio.TimeoutError:
            pass
    t0 = time.monotonic()
    while e["p0"].state()["cancelled"] == 0 and time.monotonic() - t0 < 30:
        await asyncio.sleep(0.05)
    assert e["p0"].state()["cancelled"] == 1      # the hung P leg was closed, not left running
    assert px.server.counts["chat:client_disconnect"] == 1
    assert not [x for x in e["d0"].log() if x["body"].get("messages", [{}])[0].get("content") == "gone"]
