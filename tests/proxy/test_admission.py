"""Admission in the live proxy (appliance/proxy/admission.py) against stand-in engine processes: a burst far above
what one slow decoder holds gets fast 503s with Retry-After in OpenAI's shape, nothing refused reaches an engine,
a client that leaves while queued never reaches one, ``priority`` is checked, and mode off admits everything."""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import aiohttp
import pytest

from appliance.policy import admit as A

from .conftest import make_cfg


async def wait_until(pred, timeout: float, what: str) -> None:
    """Until ``pred()`` holds (the in-process proxy runs on this loop: sleep asynchronously), bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, f"waited {timeout} s for {what}"
        await asyncio.sleep(0.02)

# a decoder that streams 30 tokens at 20 ms each (~0.6 s per answer); SLOs it can hold for about 2 streams:
# TTFT 0.6 s, TPOT 30 ms, and a prior that says one more stream costs 8 ms of TPOT from 10 ms alone
PRIOR = A.Prior(ttft_a=0.02, prefill_tps=1e6, tpot_b=0.010, tpot_k=0.008, tokens_ref=100.0, streams_ref=2.0)
SLO = A.Policy(mode="slo", ttft_slo_s=0.6, tpot_slo_s=0.030, target=0.85, tpot_target=1.0, max_queue=64)


def body(i: int, **extra) -> dict:
    return {"model": "tiny", "prompt": f"request {i} " + "w " * 20, "max_tokens": 30, "stream": True, **extra}


def served(e) -> list:
    """The test's own generation requests the engine received (not the proxy's canaries or probes)."""
    return [x for x in e.log() if x["path"] == "/v1/completions" and str(x["body"].get("prompt", "")).startswith(
        ("request ", "the leaver"))]


async def post(session, url: str, b: dict) -> tuple:
    async with session.post(url + "/v1/completions", json=b) as r:
        return r.status, dict(r.headers), await r.read()


async def admission_proxy(spawn, proxy_factory, policy: A.Policy):
    e = spawn()
    e.mode("ok", token_delay_s=0.02)
    cfg = make_cfg([], [e.url], policy="adaptive", admission=policy, admission_prior=PRIOR)
    return e, await proxy_factory(cfg)


async def test_a_burst_past_capacity_gets_fast_honest_refusals_and_refused_requests_reach_no_engine(spawn,
                                                                                                 proxy_factory):
    e, px = await admission_proxy(spawn, proxy_factory, SLO)
    async with aiohttp.ClientSession() as s:
        got = await asyncio.gather(*(post(s, px.url, body(i)) for i in range(40)))
    ok = [g for g in got if g[0] == 200]
    refused = [g for g in got if g[0] == 503]
    assert len(ok) + len(refused) == 40, [g[0] for g in got]
    assert ok and refused, "a burst 10x past what the decoder holds: some start, the rest are refused"
    for status, headers, raw in refused:
        err = json.loads(raw)["error"]
        assert err["code"] == A.OVERLOADED_CODE and err["type"] == "service_unavailable"
        assert "overloaded" in err["message"] and "Retry-After" in err["message"]
        assert int(headers["Retry-After"]) >= 1
    for _, _, raw in ok:
        assert raw.rstrip().endswith(b"[DONE]")
    # nothing both refused and executed: the engine saw exactly the admitted requests
    assert len(served(e)) == len(ok)
    st = px.server.status()["admission"]
    assert st["mode"] == "slo" and st["queue"] == 0
    assert sum(v for k, v in st["verdicts"].items() if k.startswith("refuse:")) == len(refused)
    metrics = px.server.metrics.render().decode()
    assert 'pdctl_proxy_admission_total{outcome="refuse"' in metrics


async def test_a_client_that_leaves_the_queue_never_reaches_an_engine(spawn, proxy_factory):
    e, px = await admission_proxy(spawn, proxy_factory, replace(SLO, ttft_slo_s=5.0, max_queue=64))
    e.mode("ok", token_delay_s=0.1)               # ~3 s per answer: the queue holds the late ones
    async with aiohttp.ClientSession() as s:
        busy = [asyncio.create_task(post(s, px.url, body(i))) for i in range(4)]
        await wait_until(lambda: len(px.server.gate.queue) >= 1, timeout=10, what="a request waiting in the queue")
        queued = len(px.server.gate.queue)
        sent = len(served(e))
        leaver = asyncio.create_task(post(s, px.url, body(99, prompt="the leaver " + "w " * 20)))
        await wait_until(lambda: len(px.server.gate.queue) == queued + 1, timeout=10, what="the leaver queued")
        leaver.cancel()
        await wait_until(lambda: px.server.counts.get("admission:refuse:client_gone", 0) == 1, timeout=10,
                         what="the leaver counted as gone")
        for t in busy:
            await t
    assert not any("the leaver" in json.dumps(x.get("body", "")) for x in e.log())
    assert len(served(e)) >= sent


async def test_priority_must_be_an_integer_and_is_not_sent_to_the_engines(spawn, proxy_factory):
    e, px = await admission_proxy(spawn, proxy_factory, SLO)
    async with aiohttp.ClientSession() as s:
        status, _, raw = await post(s, px.url, body(1, priority="high"))
        assert status == 400 and json.loads(raw)["error"]["param"] == "priority"
        status, _, raw = await post(s, px.url, body(2, priority=-5))
        assert status == 200
    sent = served(e)
    assert len(sent) == 1 and "priority" not in sent[0]["body"]


async def test_mode_off_admits_everything(spawn, proxy_factory):
    e, px = await admission_proxy(spawn, proxy_factory, replace(SLO, mode="off"))
    async with aiohttp.ClientSession() as s:
        got = await asyncio.gather(*(post(s, px.url, body(i)) for i in range(20)))
    assert [g[0] for g in got] == [200] * 20
    assert len(served(e)) == 20


async def test_reload_switches_the_mode_and_lets_the_waiting_start(spawn, proxy_factory):
    e, px = await admission_proxy(spawn, proxy_factory, replace(SLO, ttft_slo_s=5.0))
    e.mode("ok", token_delay_s=0.1)
    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(post(s, px.url, body(i))) for i in range(8)]
        await wait_until(lambda: len(px.server.gate.queue) >= 1, timeout=10, what="a request waiting in the queue")
        changes = px.server.reload(replace(px.server.cfg, admission=replace(SLO, mode="off")))
        assert any(c.startswith("admission: mode off") for c in changes), changes
        got = await asyncio.gather(*tasks)
    assert [g[0] for g in got] == [200] * 8        # the waiting ones started when admission went off
    assert px.server.gate.policy.mode == "off" and len(px.server.gate.queue) == 0


async def test_a_batch_key_waits_behind_every_interactive_one(spawn, proxy_factory):
    """Named keys on, two streams per worker at most: a batch key's flood fills the worker and the queue (asking
    ``priority: -5`` does not lift it above its class); an interactive key's request that comes later starts
    before every batch request still waiting (the batch key runs its streams, the interactive key none: the fair
    order, sharing.WaitQueue, then class: guard.queue_priority)."""
    from appliance.keys import table as T
    tbl = T.KeyTable((), "keys.toml")
    tbl, app = T.added(tbl, "app")
    tbl, bulk = T.added(tbl, "bulk", klass="batch")
    e = spawn()
    e.mode("ok", token_delay_s=0.03)                # ~1 s per answer
    cfg = make_cfg([], [e.url], policy="adaptive", keys=tbl, max_num_seqs=2, admission_prior=PRIOR,
                   admission=replace(SLO, ttft_slo_s=30.0, tpot_slo_s=1.0))
    px = await proxy_factory(cfg)

    async def as_key(s, key, b):
        async with s.post(px.url + "/v1/completions", json=b, headers={"Authorization": f"Bearer {key}"}) as r:
            return r.status, await r.read()
    async with aiohttp.ClientSession() as s:
        flood = [asyncio.create_task(as_key(s, bulk, body(i, priority=-5))) for i in range(8)]
        await wait_until(lambda: len(px.server.gate.queue) >= 4, timeout=20, what="batch requests waiting")
        waiting = len(px.server.gate.queue)
        # the requests started so far (the proxy runs on this loop: nothing moves until the post below yields)
        started = sum(v for k, v in px.server.counts.items() if k.startswith("admission:admit:"))
        mine = await as_key(s, app, body(100))
        got = await asyncio.gather(*flood)
    assert mine[0] == 200 and [g[0] for g in got] == [200] * 8, (mine[0], [g[0] for g in got])
    order = [x["body"]["prompt"].split()[1] for x in served(e)]
    # it starts right after those started before it came (one more, had a stream ended while its request was on
    # its way in), ahead of the 4+ batch requests that were waiting: however slow the machine
    assert order.index("100") <= started + 1, (order, started, waiting)
    assert waiting >= 4 and len(order) == 9


async def test_keys_share_the_streams_by_class_weight_and_a_refusal_costs_no_quota(spawn, proxy_factory):
    """Five streams, a batch key flooding, then an interactive key asking for many at once: while both wait, each
    start goes to the key that would run the fewest streams for its weight (interactive 4, batch 1), so the
    interactive key rises to 4 of the 5 and the batch key keeps 1, never more (appliance/policy/sharing.WaitQueue).
    The batch key's requests the box refused (queue full) cost its token quota nothing."""
    from appliance.keys import table as T
    tbl = T.KeyTable((), "keys.toml")
    tbl, app = T.added(tbl, "app")
    tbl, bulk = T.added(tbl, "bulk", klass="batch", limits=T.Limits(tpm=10_000_000))
    e = spawn()
    e.mode("ok", token_delay_s=0.03)                # ~1 s per answer
    cfg = make_cfg([], [e.url], policy="adaptive", keys=tbl, max_num_seqs=5, admission_prior=PRIOR,
                   admission=replace(SLO, ttft_slo_s=60.0, tpot_slo_s=1.0, max_queue=24))
    px = await proxy_factory(cfg)
    gate = px.server.gate
    starts = []                                      # (tenant, running before, waiting tenants) per start
    ticket = gate._ticket

    def logged(now, rt, tenant=""):
        waiting = {k[3] for k, _ in gate.queue._items}
        starts.append((tenant, dict(gate.running), waiting))
        return ticket(now, rt, tenant)
    gate._ticket = logged

    async def as_key(s, key, b):
        async with s.post(px.url + "/v1/completions", json=b, headers={"Authorization": f"Bearer {key}"}) as r:
            return r.status, await r.read()
    async with aiohttp.ClientSession() as s:
        flood = [asyncio.create_task(as_key(s, bulk, body(i))) for i in range(30)]
        await wait_until(lambda: len(gate.queue) >= 20, timeout=20, what="batch requests waiting")
        mine = await asyncio.gather(*(as_key(s, app, body(100 + i)) for i in range(12)))
        got = await asyncio.gather(*flood)
    assert [m[0] for m in mine] == [200] * 12, [m[0] for m in mine]
    codes = sorted(g[0] for g in got)
    assert set(codes) <= {200, 503} and 503 in codes, codes      # the queue was full: some refused at once
    both = [(t, r) for t, r, w in starts if {app_name for app_name in w} >= {"app", "bulk"}]
    assert both, starts
    # while both waited, a start went to the key that would run the fewest streams for its weight
    for t, r in both:
        mine_next = (r.get(t, 0) + 1) / T.CLASS_WEIGHTS["interactive" if t == "app" else "batch"]
        other = "bulk" if t == "app" else "app"
        theirs = (r.get(other, 0) + 1) / T.CLASS_WEIGHTS["interactive" if other == "app" else "batch"]
        assert mine_next <= theirs, (t, r, starts)
    peak = max(r.get("app", 0) + (t == "app") for t, r in both)
    assert peak == 4, starts                          # the interactive key's share: 4 of the 5 streams
    assert all(r.get("bulk", 0) + (t == "bulk") >= 1 for t, r in both if t == "bulk")
    ok = sum(1 for c in codes if c == 200)
    used = px.server.quota.snapshot()["bulk"]["tokens"]
    per = [x for x in served(e) if x["body"]["prompt"].startswith("request ") and int(
        x["body"]["prompt"].split()[1]) < 100]
    assert len(per) == ok
    # what the served ones used (prompt + 30 tokens each), not a token more for the refused ones
    assert used <= ok * (px.server.chars_per_token.estimate(len(body(0)["prompt"])) + 30) + ok, (used, ok)
