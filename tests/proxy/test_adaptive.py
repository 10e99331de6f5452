"""The adaptive policy end to end (real proxy, stand-in engine processes): per-request aggregate or split,
counted by kind and reason in /metrics and /pdctl/status, legs per backend, and a prefiller failure that
becomes an aggregated request instead of a 503."""
from __future__ import annotations

import aiohttp
from dataclasses import replace

from appliance import constants as C
from appliance.policy.decide import Thresholds
from appliance.proxy.config import BackendSpec, ProxyConfig

from .conftest import make_cfg
from .test_routing import first_canary

LONG = "cold tail " * 400            # ~4000 chars: ~1000 uncached tokens by the proxy's estimate


def adaptive_cfg(prefill: list, both: list, **kw) -> ProxyConfig:
    specs = tuple([BackendSpec(u, "prefill", name=f"prefill-{i}") for i, u in enumerate(prefill)]
                  + [BackendSpec(u, "both", name=f"both-{i}") for i, u in enumerate(both)])
    base = make_cfg([], [], canary_interval_s=60)
    return replace(base, backends=specs, policy="adaptive", **kw)


def mine(engine, tag: str) -> list:
    return [x["body"] for x in engine.log() if str(x["body"].get("prompt", "")).startswith(tag)]


async def post(s, px, prompt: str, stream: bool = False):
    async with s.post(px.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                        "stream": stream}) as r:
        return r.status, await r.text()


async def test_hybrid_aggregates_few_uncached_and_splits_long_cold(fresh, proxy_factory):
    e = fresh
    px = await proxy_factory(adaptive_cfg([e["p0"].url], [e["d0"].url, e["d1"].url],
                                          thresholds=Thresholds(aggregate_max_uncached=512)))
    await first_canary(px)
    base = {b["name"]: dict(b["legs"]) for b in px.server.status()["backends"]}   # the canary's legs
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        for i in range(4):
            assert (await post(s, px, f"warm{i} short question"))[0] == 200
        status, body = await post(s, px, "cold0 " + LONG, stream=True)
        assert status == 200 and body.rstrip().endswith("[DONE]")
    # the short ones: whole requests on the both-workers, never a P leg
    assert not mine(e["p0"], "warm")
    assert len(mine(e["d0"], "warm")) + len(mine(e["d1"], "warm")) == 4
    # the long cold one: P leg (max_tokens=1, not streamed) on the prefiller, D leg (the original) on a both
    p_legs = mine(e["p0"], "cold0")
    assert len(p_legs) == 1 and p_legs[0]["max_tokens"] == 1 and p_legs[0]["stream"] is False
    d_legs = mine(e["d0"], "cold0") + mine(e["d1"], "cold0")
    assert len(d_legs) == 1 and d_legs[0]["max_tokens"] == 4
    st = px.server.status()
    assert st["decisions"]["aggregate"]["few_uncached"] == 4 and st["decisions"]["split"]["long_uncached"] == 1
    legs = {b["name"]: {k: v - base[b["name"]][k] for k, v in b["legs"].items()} for b in st["backends"]}
    assert legs["prefill-0"]["prefill"] == 1 and legs["prefill-0"]["full"] == 0
    assert legs["both-0"]["full"] + legs["both-1"]["full"] == 4
    assert legs["both-0"]["decode"] + legs["both-1"]["decode"] == 1
    assert all(b["prefill_backlog"] == 0 and not any(b["legs_inflight"].values()) for b in st["backends"])
    async with aiohttp.ClientSession() as s, s.get(px.url + "/metrics") as r:
        text = await r.text()
    assert f'{C.PROXY_DECISIONS}_total{{kind="split",reason="long_uncached"}} 1.0' in text
    assert f'{C.PROXY_LEGS}_total{{backend="prefill-0",leg="prefill"}} {1 + base["prefill-0"]["prefill"]:.1f}' in text


async def test_prefiller_failure_is_served_aggregated_not_503(fresh, proxy_factory):
    e = fresh
    px = await proxy_factory(adaptive_cfg([e["p0"].url], [e["d0"].url],
                                          thresholds=Thresholds(aggregate_max_uncached=0)))
    await first_canary(px)
    e["p0"].mode("error500")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        for i in range(5):
            status, body = await post(s, px, f"fail{i} " + LONG)
            assert status == 200, body
    assert len(mine(e["d0"], "fail")) == 5          # the both-worker prefilled each prompt itself
    agg = px.server.status()["decisions"]["aggregate"]
    assert agg.get("no_prefiller", 0) == 5, agg     # P leg failed (or breaker open): counted, never a 503


async def test_all_both_forced_split_never_uses_one_worker_for_both_legs(fresh, proxy_factory):
    e = fresh
    px = await proxy_factory(adaptive_cfg([], [e["d0"].url, e["d1"].url],
                                          thresholds=Thresholds(aggregate_max_uncached=0, split_idle_max_running=1000)))
    await first_canary(px)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
        for i in range(6):
            assert (await post(s, px, f"x{i} " + LONG))[0] == 200
    for i in range(6):
        tag = f"x{i} "
        p = [k for k in ("d0", "d1") if any(b["max_tokens"] == 1 for b in mine(e[k], tag))]
        d = [k for k in ("d0", "d1") if any(b["max_tokens"] == 4 for b in mine(e[k], tag))]
        assert len(p) == 1 and len(d) == 1 and p != d, (i, p, d)
    assert px.server.status()["decisions"]["split"]["long_uncached_idle_both"] == 6
